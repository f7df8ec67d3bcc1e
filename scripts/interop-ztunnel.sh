#!/usr/bin/env bash
# HBONE interop with a real ztunnel (Istio's node proxy), both ways (needs root). Developer
# script, not CI: without the ztunnel binary (../shared/anchors/ztunnel-path) it prints SKIPPED
# and exits 0.
#
# Topology: two network namespaces joined by one veth pair, each standing for a node whose proxy
# serves exactly one workload with the node's own address ("dedicated" mode, as in
# shared/anchors/README.md). Both proxies trust each other through ztunnel's FAKE_CA root, which
# is given to mbtunnel as its CA (ca_dir/ca-cert.pem + ca-key.pem).
#
#   ns A: 10.77.0.1 = node A = workload default/client (sa client)      capture: nat OUTPUT,
#         skip mark 0x539/0xfff and -o lo, TCP to 10.77.0.2 → REDIRECT 15001
#   ns B: 10.77.0.2 = node B = workload default/server (sa server)      echo on 10.77.0.2:8080
#                                                                       (`$BIN tool echo`)
#   1. app A ──10.77.0.2:8080──▶ mbtunnel (A, outbound 15001) ══HBONE mTLS══▶ ztunnel (B, 15008) ──▶ echo
#   2. app A ──10.77.0.2:8080──▶ ztunnel (A, outbound 15001)  ══HBONE mTLS══▶ mbtunnel (B, 15008) ──▶ echo
#
# Each direction: 1 MiB and a few small round trips (`$BIN tool send`, which checks its echo),
# evidence that HBONE was used (ztunnel's access log names the HBONE address, both proxies count
# the connection with connection_security_policy="mutual_tls"), then resets across the tunnel
# (python3, skipped without it): when the app on mbtunnel's side resets, mbtunnel must send
# RST_STREAM(CONNECT_ERROR), which ztunnel's access log reports ("...CONNECT request was reset or
# abnormally closed"); what each far app then sees is printed for information only (ztunnel passes
# a reset on as a FIN and never sends one itself); then another round trip must work on the same
# pooled HBONE connection.
#
# Run: sudo scripts/interop-ztunnel.sh   (BIN=path/to/mbtunnel; RUST_LOG=debug for both proxies,
# or MBT_LOG / ZT_LOG for one, e.g. MBT_LOG=info,h2=debug shows the frames; KEEP=1 keeps the
# logs). Everything (namespaces, processes, files) is removed on exit. Exit status 0 = both PASS.
set -euo pipefail
BIN=${BIN:-target/release/mbtunnel}
[ -e "$BIN" ] && BIN=$(realpath "$BIN")     # before the cd below: BIN may be relative to the caller
cd "$(dirname "$0")/.."
T="mbzt$$"
# Topology, mesh state and proxy start-up are shared with benches/dataplane.sh.
. benches/lib/topology.sh
if ! topo_find_ztunnel; then
  echo "interop-ztunnel: SKIPPED (no ztunnel binary: $ANCHORS/ztunnel-path did not give one)"; exit 0
fi
if [ "$(id -u)" != 0 ]; then echo "interop-ztunnel: needs root (network namespaces)"; exit 1; fi
[ -x "$BIN" ] || { echo "interop-ztunnel: no mbtunnel binary at $BIN (build it, or set BIN=...)"; exit 1; }
for c in ip iptables curl timeout; do
  command -v "$c" >/dev/null || { echo "interop-ztunnel: needs $c"; exit 1; }
done

PORT=8080; RST_PORT=8081
WORK=$(mktemp -d /tmp/mbtunnel-interop-zt.XXXXXX)
export ZT_LOG=${ZT_LOG:-${RUST_LOG:-info}} MBT_LOG=${MBT_LOG:-${RUST_LOG:-info}}
cleanup() {
  topo_cleanup
  if [ "${KEEP:-0}" = 1 ]; then echo "logs kept in $WORK"; else rm -rf "$WORK"; fi
}
trap cleanup EXIT

topo_netns_up
topo_write_mesh

# --- processes -----------------------------------------------------------------------------------
ip netns exec "$B" "$BIN" tool echo --listen "$IP_B:$PORT" > "$WORK/echo.log" 2>&1 & PIDS+=($!)
HAVE_PY=0; command -v python3 >/dev/null && HAVE_PY=1
# Reset helper (B, port 8081): "RESET-ME" → the app resets its connection (SO_LINGER 0);
# "I-RESET" → it reads until the client's end arrives and logs whether that was a reset or an EOF.
cat > "$WORK/rst.py" <<'PY'
import socket, struct, sys, threading
def serve(addr, port, log):
    l = socket.socket(); l.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    l.bind((addr, port)); l.listen(16)
    def one(c):
        c.settimeout(15)
        try:
            first = c.recv(64)
            if first.startswith(b"RESET-ME"):
                c.sendall(b"bye\n")
                c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                c.close(); print("server: reset the connection", flush=True, file=log); return
            while True:
                d = c.recv(65536)
                if not d:
                    print("server: saw EOF", flush=True, file=log); break
        except ConnectionResetError:
            print("server: saw RESET", flush=True, file=log)
        except socket.timeout:
            print("server: saw nothing (timeout)", flush=True, file=log)
        c.close()
    while True:
        c, _ = l.accept(); threading.Thread(target=one, args=(c,), daemon=True).start()
def client(addr, port, mode):
    c = socket.create_connection((addr, port), timeout=10)
    if mode == "server-resets":
        c.sendall(b"RESET-ME\n")
        got = b""
        try:
            while True:
                d = c.recv(65536)
                if not d: print("client: saw EOF after %r" % got); return
                got += d
        except ConnectionResetError: print("client: saw RESET after %r" % got)
        except socket.timeout: print("client: saw nothing (timeout) after %r" % got)
    else:
        c.sendall(b"I-RESET\n" + b"x" * 1000)
        import time; time.sleep(0.5)
        c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        c.close(); print("client: reset its connection")
if sys.argv[1] == "serve": serve(sys.argv[2], int(sys.argv[3]), open(sys.argv[4], "a"))
else: client(sys.argv[2], int(sys.argv[3]), sys.argv[4])
PY
if [ "$HAVE_PY" = 1 ]; then
  ip netns exec "$B" python3 "$WORK/rst.py" serve "$IP_B" "$RST_PORT" "$WORK/rst-server.log" 2>&1 & PIDS+=($!)
fi

FAILED=()
# run_direction name mbtunnel_log ztunnel_log mbtunnel_reporter mbtunnel_ns ztunnel_ns
run_direction() {
  local name=$1 mlog=$2 zlog=$3 reporter=$4 mns=$5 zns=$6 ok=1 out
  echo "== $name =="
  for n in 1048576 1 100 4096 65537; do
    if out=$(nsx "$A" timeout 30 "$BIN" tool send --connect "$IP_B:$PORT" --bytes "$n" 2>&1) \
       && grep -q '"intact":true' <<<"$out" && grep -q "\"received\":$n," <<<"$out"; then
      echo "  send $n bytes: $out"
    else
      echo "  send $n bytes FAILED: $out"; ok=0
    fi
  done
  if [ "$HAVE_PY" = 1 ]; then
    : > "$WORK/rst-server.log"
    out=$(nsx "$A" timeout 20 python3 "$WORK/rst.py" client "$IP_B" "$RST_PORT" server-resets 2>&1 || true)
    echo "  [info] app B resets → $out"
    out=$(nsx "$A" timeout 20 python3 "$WORK/rst.py" client "$IP_B" "$RST_PORT" client-resets 2>&1 || true)
    sleep 1
    echo "  [info] app A resets ($out) → $(tail -n1 "$WORK/rst-server.log" 2>/dev/null)"
    # mbtunnel's app leg was reset (A's app in direction 1, B's in direction 2): mbtunnel must end
    # the stream with RST_STREAM(CONNECT_ERROR), which ztunnel's h2 reports in its access log
    # (ztunnel itself then closes its own leg with a FIN: the "[info]" outcomes above).
    local rline
    rline=$(grep 'access' "$zlog" | grep "hbone_addr=$IP_B:$RST_PORT" \
            | grep 'CONNECT request was reset or abnormally closed' | tail -n1 || true)
    if [ -n "$rline" ]; then
      echo "  reset crossed (RST_STREAM CONNECT_ERROR from mbtunnel, seen by ztunnel): error=${rline##*error=}"
    else
      echo "  reset did NOT cross: ztunnel saw no RST_STREAM(CONNECT_ERROR) from mbtunnel"; ok=0
    fi
    if out=$(nsx "$A" timeout 30 "$BIN" tool send --connect "$IP_B:$PORT" --bytes 65536 2>&1) \
       && grep -q '"intact":true' <<<"$out"; then
      echo "  send after resets: $out"
    else
      echo "  send after resets FAILED: $out"; ok=0
    fi
  fi
  sleep 0.5
  local zm mm zacc zdir=outbound
  [ "$reporter" = source ] && zdir=inbound   # mbtunnel is the source: ztunnel is the server
  mm=$(get "$mns" http://127.0.0.1:15020/metrics || true)
  zm=$(get "$zns" http://127.0.0.1:15020/metrics || true)
  local ml zl
  ml=$(grep '^istio_tcp_connections_opened_total' <<<"$mm" | grep "reporter=\"$reporter\"" \
       | grep 'connection_security_policy="mutual_tls"' | head -n1 || true)
  zl=$(grep '^istio_tcp_connections_opened_total' <<<"$zm" \
       | grep 'connection_security_policy="mutual_tls"' | head -n1 || true)
  # ztunnel's access line for the 1 MiB connection: it names the HBONE target (dst.hbone_addr).
  zacc=$(grep 'access' "$zlog" | grep "dst.hbone_addr=$IP_B:$PORT" | grep 'bytes_recv=1048576' \
         | grep "direction=\"$zdir\"" | tail -n1 || true)
  if [ -n "$ml" ]; then echo "  mbtunnel metric: $ml"; else echo "  mbtunnel: no mutual_tls $reporter connection counted"; ok=0; fi
  if [ -n "$zl" ]; then echo "  ztunnel metric:  $zl"; else echo "  ztunnel: no mutual_tls connection counted"; ok=0; fi
  if [ -n "$zacc" ]; then echo "  ztunnel access:  $zacc"; else echo "  ztunnel: no access log line naming HBONE"; ok=0; fi
  if [ "$ok" = 1 ]; then
    echo "PASS: $name"
  else
    echo "FAIL: $name"; FAILED+=("$name")
    echo "--- mbtunnel log (tail) ---"; tail -n 40 "$mlog"
    echo "--- ztunnel log (tail) ---"; tail -n 40 "$zlog"
    echo "--- echo log (tail) ---"; tail -n 5 "$WORK/echo.log"
  fi
}

# --- direction 1: mbtunnel (client, A) → ztunnel (server, B) ------------------------------------
start_ztunnel "$B" default/server/server "$WORK/d1-ztunnel-B.log"; Z=$ZPID
start_mbtunnel "$A" nodeA "$WORK/d1-mbtunnel-A.log"; M=$MPID
if wait_ready "$B" ztunnel "$WORK/d1-ztunnel-B.log" && wait_ready "$A" mbtunnel "$WORK/d1-mbtunnel-A.log"; then
  run_direction "mbtunnel (A, client) → HBONE → ztunnel (B, server)" \
    "$WORK/d1-mbtunnel-A.log" "$WORK/d1-ztunnel-B.log" source "$A" "$B"
else
  echo "FAIL: direction 1 (proxies not ready)"; FAILED+=("direction 1")
fi
stop "$M"; stop "$Z"

# --- direction 2: ztunnel (client, A) → mbtunnel (server, B) ------------------------------------
start_ztunnel "$A" default/client/client "$WORK/d2-ztunnel-A.log"; Z=$ZPID
start_mbtunnel "$B" nodeB "$WORK/d2-mbtunnel-B.log"; M=$MPID
if wait_ready "$A" ztunnel "$WORK/d2-ztunnel-A.log" && wait_ready "$B" mbtunnel "$WORK/d2-mbtunnel-B.log"; then
  run_direction "ztunnel (A, client) → HBONE → mbtunnel (B, server)" \
    "$WORK/d2-mbtunnel-B.log" "$WORK/d2-ztunnel-A.log" destination "$B" "$A"
else
  echo "FAIL: direction 2 (proxies not ready)"; FAILED+=("direction 2")
fi
stop "$M"; stop "$Z"

if [ "${#FAILED[@]}" = 0 ]; then echo "INTEROP OK: both directions passed"; exit 0; fi
echo "INTEROP FAILED: ${FAILED[*]}"; exit 1
