#!/usr/bin/env bash
# Data-plane bench, mbtunnel side by side with ztunnel (issue 14 §1). Root (network namespaces).
#
#   sudo benches/dataplane.sh          or   make bench-dataplane   (installs the tools first)
#
# Topology (benches/lib/topology.sh, the same as scripts/interop-ztunnel.sh): two node namespaces
# joined by veth, the SAME product on both ends (mbtunnel↔mbtunnel or ztunnel↔ztunnel), capture by
# iptables REDIRECT on the client node, EC P-256 leaves from one shared root (ztunnel's FAKE_CA
# root, given to mbtunnel as its CA), the apps on the server node:
#
#   ns A 10.77.0.1: load generator ──REDIRECT 15001──▶ proxy A ══HBONE mTLS══▶ proxy B (15008)
#   ns B 10.77.0.2:                                    ──▶ nginx :80 (1 KB body) / iperf3 -s :5201
#
# Workloads, in this order, on one pair of fresh proxies per product and round (ROUNDS rounds,
# mbtunnel and ztunnel interleaved, the first product alternating between rounds):
#   fixed   hey -c 16 -q RATE/16 (RATE req/s in all), POST 1 KB request → 1 KB response
#                                                                 → proxy vCPU, RSS per proxy
#   iperf1  iperf3 one stream, SECS seconds                       → Gbit/s, proxy CPU-s per GB
#   iperf4  iperf3 -P 4                                           → Gbit/s, proxy CPU-s per GB
#   wrk     wrk -c 16, the same request                           → max req/s, CPU-s per 1000 req
#   cpr     wrk -c 16 with "Connection: close": a new TCP connection per request, through the
#           pooled HBONE connection                               → conn/s
#   hs      HS_PROCS × `openssl s_time -new -www /` straight to the server proxy's 15008 with a
#           client leaf from the shared root (SPIFFE id of default/client): a full mTLS handshake,
#           then the client sends a request and reads until the server closes, so the work after
#           the handshake (h2 preface, close_notify) counts too → handshakes/s, server CPU per
#           handshake
#   hsn     the same without `-www`: s_time closes right after its Finished (supporting row: the
#           difference is the post-handshake work)
#   hsr     the same with `openssl s_time -reuse -www /`: each client would reuse its session if
#           the server sent it a TLS 1.3 ticket. Neither does: ztunnel sends none, mbtunnel sends
#           them only to mbtunnel peers (clients offering its `mbtunnel-tickets` ALPN token, which
#           s_time cannot), so this row checks that a foreign client gets full handshakes and no
#           tickets. `-www /` makes s_time read after the handshake, which is when a TLS 1.3
#           client receives its ticket; the HBONE server answers the HTTP/1.0 GET by closing.
#                                                             → handshakes/s, share resumed
# (GB = 10^9 bytes received by iperf3; "proxy CPU" = utime+stime of both proxies from
# /proc/PID/stat, summed; RSS = VmRSS from /proc/PID/status, read 3/4 into the fixed-rate run, and
# after the last workload once the proxies have idled IDLE_SECS seconds: what a burst leaves behind.)
#
# Quiet machine: before each product's run the machine must be idle (at most QUIET_MAX CPUs busy
# over QUIET_SECS, waiting up to QUIET_WAIT seconds), and during each workload the CPU used by
# processes that are not part of the bench (/proc/stat minus proxies, apps, load generator,
# ksoftirqd) must stay under QUIET_MAX; a run that overlapped other load is re-run (fresh
# proxies), up to RETRIES times, and the table says so.
#
# Without the ztunnel binary (../shared/anchors/ztunnel-path) it measures mbtunnel alone and says
# so. Prints the table (medians over the rounds, min–max spread) and writes it between markers in
# benches/README.md (README_WRITE=0 to skip; README_FILE to choose).
#
# Environment: BIN (mbtunnel; default target/dist/mbtunnel, the profile the image ships, built
# with `cargo build --profile dist` if missing), ROUNDS=5, SECS=5, IDLE_SECS=12, RATE=1000, CONNS=16, HS_PROCS=4, QUIET_MAX=0.25, QUIET_SECS=2,
# QUIET_WAIT=30, RETRIES=2, PRODUCTS="ztunnel mbtunnel", MBT_LOG / ZT_LOG (RUST_LOG of each; default:
# the product's own default), KEEP=1 keeps the work directory (logs, raw outputs).
#
# PERF=1 profiles both proxies (`perf record -F 1999 -g -p PID`, PERF_CG to change the call-graph
# option) during each workload named in PERF_WORKLOADS (default "iperf1 wrk cpr hs") into
# <run>/<workload>-client.perf and -server.perf, keeps the work directory and does not write the
# README (recording costs CPU: a profiled run's figures are not the table's). perf's own CPU is
# reported as cpu_profilers in <run>/<workload>.json and not counted as foreign load by the quiet
# check. Break a profile down by kind of work with benches/lib/perf_breakdown.py.
set -euo pipefail
BIN=${BIN:-target/dist/mbtunnel}
[ -e "$BIN" ] && BIN=$(realpath "$BIN")     # before the cd below: BIN may be relative to the caller
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-5}; SECS=${SECS:-5}; IDLE_SECS=${IDLE_SECS:-12}; RATE=${RATE:-1000}; CONNS=${CONNS:-16}; HS_PROCS=${HS_PROCS:-4}
QUIET_MAX=${QUIET_MAX:-0.25}; QUIET_SECS=${QUIET_SECS:-2}; QUIET_WAIT=${QUIET_WAIT:-30}
RETRIES=${RETRIES:-2}; README_WRITE=${README_WRITE:-1}; README_FILE=${README_FILE:-benches/README.md}
PERF=${PERF:-0}; PERF_WORKLOADS=${PERF_WORKLOADS:-"iperf1 wrk cpr hs"}
if [ "$PERF" = 1 ]; then
  command -v perf >/dev/null || { echo "dataplane: PERF=1 needs perf (apt-get install linux-perf)"; exit 1; }
  KEEP=1; README_WRITE=0
fi
PY=/usr/bin/python3; [ -x "$PY" ] || PY=python3
say() { echo "dataplane: $*"; }

if [ "$(id -u)" != 0 ]; then say "needs root (network namespaces)"; exit 1; fi
missing=()
for c in iperf3 wrk hey nginx openssl curl ip iptables timeout; do command -v "$c" >/dev/null || missing+=("$c"); done
if [ "${#missing[@]}" != 0 ]; then
  say "missing ${missing[*]}: running scripts/bench-deps.sh"; ./scripts/bench-deps.sh
fi
if [ ! -x "$BIN" ]; then
  if [ "$BIN" = "$(pwd)/target/dist/mbtunnel" ] || [ "$BIN" = target/dist/mbtunnel ]; then
    say "no $BIN: cargo build --profile dist --locked"; cargo build --profile dist --locked --bin mbtunnel
    BIN=$(realpath target/dist/mbtunnel)
  else
    say "no mbtunnel binary at $BIN"; exit 1
  fi
fi

T="dp$$"
. benches/lib/topology.sh
PRODUCTS=${PRODUCTS:-"ztunnel mbtunnel"}
ZT_NOTE=""
if ! topo_find_ztunnel; then
  ZT_NOTE="ztunnel binary absent ($ANCHORS/ztunnel-path gave none): mbtunnel measured alone"
  PRODUCTS=mbtunnel; say "$ZT_NOTE"
fi
WORK=$(mktemp -d /tmp/mbtunnel-dataplane.XXXXXX)
cleanup() {
  topo_cleanup
  if [ "${KEEP:-0}" = 1 ]; then say "work directory kept: $WORK"; else rm -rf "$WORK"; fi
}
trap cleanup EXIT

topo_write_mesh

# --- the apps on node B: nginx (1 KB body for any method), iperf3 server ----------------------
mkdir -p "$WORK/nginx/logs" "$WORK/nginx/tmp"
BODY=$(head -c 1024 /dev/zero | tr '\0' 'x')
cat > "$WORK/nginx/nginx.conf" <<NGINX
user root;
worker_processes 1;
pid $WORK/nginx/nginx.pid;
error_log $WORK/nginx/logs/error.log warn;
events { worker_connections 4096; }
http {
  access_log off;
  keepalive_requests 1000000;
  keepalive_timeout 120s;
  client_body_temp_path $WORK/nginx/tmp/body;
  proxy_temp_path $WORK/nginx/tmp/proxy;
  fastcgi_temp_path $WORK/nginx/tmp/fastcgi;
  uwsgi_temp_path $WORK/nginx/tmp/uwsgi;
  scgi_temp_path $WORK/nginx/tmp/scgi;
  server {
    listen $IP_B:80 reuseport;
    location / { default_type application/octet-stream; return 200 '$BODY'; }
  }
}
NGINX
head -c 1024 /dev/zero | tr '\0' 'y' > "$WORK/req.bin"
cat > "$WORK/post.lua" <<'LUA'
wrk.method = "POST"
wrk.body = string.rep("y", 1024)
wrk.headers["Content-Type"] = "application/octet-stream"
LUA
{ cat "$WORK/post.lua"; echo 'wrk.headers["Connection"] = "close"'; } > "$WORK/post-close.lua"
# --- fresh nodes for each run: namespaces, capture, apps ---------------------------------------------
# Every product run gets its own namespaces, so no run inherits another's sockets (a connection-per-
# request run leaves tens of thousands in TIME-WAIT) or state.
nodes_up() { # dir
  topo_netns_up
  # The handshake clients dial the server proxy's 15008 themselves, as a peer proxy would: not captured.
  nsx "$A" iptables -t nat -I OUTPUT 1 -p tcp -d "$IP_B/32" --dport 15008 -j RETURN
  # Connection-per-request runs open thousands of connections per second: room for ephemeral ports.
  local ns
  for ns in "$A" "$B"; do
    nsx "$ns" sysctl -qw net.ipv4.ip_local_port_range="1024 65000" net.ipv4.tcp_tw_reuse=1
  done
  ip netns exec "$B" nginx -p "$WORK/nginx" -c "$WORK/nginx/nginx.conf" -g 'daemon off;' > "$1/nginx.log" 2>&1 &
  NGINX_PID=$!; PIDS+=("$NGINX_PID")
  ip netns exec "$B" iperf3 -s -B "$IP_B" -p 5201 > "$1/iperf3-server.log" 2>&1 &
  IPERF_PID=$!; PIDS+=("$IPERF_PID")
  local i got=0
  for i in $(seq 1 50); do
    got=$(nsx "$B" curl -fsS -X POST --data-binary @"$WORK/req.bin" "http://$IP_B/" 2>/dev/null | wc -c) || true
    [ "$got" = 1024 ] && break; sleep 0.1
  done
  [ "$got" = 1024 ] || { say "nginx does not answer 1 KB (got $got bytes)"; cat "$WORK/nginx/logs/error.log"; return 1; }
  for i in $(seq 1 50); do
    nsx "$B" ss -Htln "sport = :5201" | grep -q . && return 0; sleep 0.1
  done
  say "iperf3 server not listening"; return 1
}
nodes_down() {
  stop "$NGINX_PID"; stop "$IPERF_PID"
  ip netns del "$A"; ip netns del "$B"
}

# --- the handshake client's leaf: EC P-256, SPIFFE id of default/client, from the shared root -----
openssl ecparam -name prime256v1 -genkey -noout -out "$WORK/hs-key.pem" 2>/dev/null
openssl req -new -key "$WORK/hs-key.pem" -subj "/O=cluster.local" -out "$WORK/hs.csr" 2>/dev/null
printf '%s\n' "subjectAltName=URI:spiffe://cluster.local/ns/default/sa/client" \
  "keyUsage=critical,digitalSignature" "extendedKeyUsage=clientAuth,serverAuth" \
  "basicConstraints=critical,CA:FALSE" > "$WORK/hs.ext"
openssl x509 -req -in "$WORK/hs.csr" -CA "$WORK/ca/ca-cert.pem" -CAkey "$WORK/ca/ca-key.pem" \
  -set_serial "0x$(openssl rand -hex 8)" -days 1 -sha256 -extfile "$WORK/hs.ext" \
  -out "$WORK/hs-cert.pem" 2>/dev/null

# --- one product's run -----------------------------------------------------------------------------
start_pair() { # product dir → CPID SPID
  if [ "$1" = ztunnel ]; then
    start_ztunnel "$B" default/server/server "$2/server.log"; SPID=$ZPID
    start_ztunnel "$A" default/client/client "$2/client.log"; CPID=$ZPID
  else
    start_mbtunnel "$B" nodeB "$2/server.log"; SPID=$MPID
    start_mbtunnel "$A" nodeA "$2/client.log"; CPID=$MPID
  fi
  wait_ready "$B" "$1" "$2/server.log" && wait_ready "$A" "$1" "$2/client.log"
}

quiet_wait() { # → QUIET_PRE (CPUs busy in the last sample)
  local t0=$SECONDS j
  while :; do
    j=$("$PY" benches/lib/measure.py idle --secs "$QUIET_SECS")
    QUIET_PRE=$("$PY" -c 'import json,sys; print("%.3f" % json.loads(sys.argv[1])["foreign"])' "$j")
    if "$PY" -c 'import sys; sys.exit(0 if float(sys.argv[1]) <= float(sys.argv[2]) else 1)' "$QUIET_PRE" "$QUIET_MAX"; then
      return 0
    fi
    if [ $((SECONDS - t0)) -ge "$QUIET_WAIT" ]; then
      say "  machine not quiet after ${QUIET_WAIT}s ($QUIET_PRE CPUs busy): going on, the run's own check decides"
      return 0
    fi
    say "  machine busy ($QUIET_PRE CPUs > $QUIET_MAX): waiting"
  done
}

measure() { # dir workload rss_at cmd... → dir/workload.json, dir/workload.out
  local dir=$1 w=$2 rss_at=$3 perf=() p; shift 3
  if [ "$PERF" = 1 ] && [[ " $PERF_WORKLOADS " == *" $w "* ]]; then
    # shellcheck disable=SC2086 # PERF_CG is a list of perf options
    perf record -F 1999 ${PERF_CG:--g} -p "$CPID" -o "$dir/$w-client.perf" >/dev/null 2>&1 & perf+=($!)
    # shellcheck disable=SC2086
    perf record -F 1999 ${PERF_CG:--g} -p "$SPID" -o "$dir/$w-server.perf" >/dev/null 2>&1 & perf+=($!)
    sleep 0.3
  fi
  "$PY" benches/lib/measure.py run --client "$CPID" --server "$SPID" --apps "$NGINX_PID,$IPERF_PID" \
    --profilers "$(IFS=,; echo "${perf[*]}")" --rss-at "$rss_at" --out "$dir/$w.out" -- timeout $((SECS + 60)) "$@" > "$dir/$w.json"
  for p in "${perf[@]}"; do kill -INT "$p"; wait "$p" || true; done
  sleep 0.5
}

tls_refusals() { # → "<refused handshakes, not closes> <closed or reset by the peer>" (mbtunnel server)
  { get "$B" http://127.0.0.1:15020/metrics || true; } | awk '
    /^mbtunnel_connections_refused_total\{reason="tls_/ {
      if ($1 ~ /"tls_peer_closed"/) c += $NF; else r += $NF }
    END {printf "%d %d\n", r, c}'
}

run_product() { # product round attempt → dir in RUN_DIR
  local prod=$1 dir="$WORK/runs/$1-r$2-a$3"
  mkdir -p "$dir"; RUN_DIR=$dir
  quiet_wait
  nodes_up "$dir" || return 1
  if ! start_pair "$prod" "$dir"; then
    echo "{\"error\": \"proxies not ready\"}" > "$dir/meta.json"; stop "$CPID"; stop "$SPID"; return 1
  fi
  # Warm-up: certificates fetched, the pooled HBONE connection up.
  nsx "$A" curl -fsS -o /dev/null --max-time 10 -X POST --data-binary @"$WORK/req.bin" "http://$IP_B/" || true
  sleep 0.5
  # The fixed rate first, on the fresh proxies: its RSS is the proxies' at that load, not what the
  # throughput runs left behind (that shows in the RSS read after the last workload).
  measure "$dir" fixed "$("$PY" -c "print($SECS * 0.75)")" ip netns exec "$A" hey -z "${SECS}s" -c "$CONNS" \
    -q "$("$PY" -c "print($RATE / $CONNS)")" -m POST -D "$WORK/req.bin" -T application/octet-stream "http://$IP_B/"
  measure "$dir" iperf1 -1 ip netns exec "$A" iperf3 -c "$IP_B" -p 5201 -t "$SECS" -J
  measure "$dir" iperf4 -1 ip netns exec "$A" iperf3 -c "$IP_B" -p 5201 -t "$SECS" -P 4 -J
  measure "$dir" wrk -1 ip netns exec "$A" wrk -t 2 -c "$CONNS" -d "${SECS}s" -s "$WORK/post.lua" "http://$IP_B/"
  measure "$dir" cpr -1 ip netns exec "$A" wrk -t 2 -c "$CONNS" -d "${SECS}s" -s "$WORK/post-close.lua" "http://$IP_B/"
  local tw_a tw_b   # sockets left in TIME-WAIT by the connection-per-request run (port room)
  tw_a=$(nsx "$A" ss -Htan state time-wait | wc -l); tw_b=$(nsx "$B" ss -Htan state time-wait | wc -l)
  local i hs_cmd="" hsn_cmd=""
  for i in $(seq 1 "$HS_PROCS"); do
    hs_cmd+="openssl s_time -connect $IP_B:15008 -new -www / -time $SECS -cert $WORK/hs-cert.pem -key $WORK/hs-key.pem > $dir/hs-$i.out 2>&1 & "
    hsn_cmd+="openssl s_time -connect $IP_B:15008 -new -time $SECS -cert $WORK/hs-cert.pem -key $WORK/hs-key.pem > $dir/hsn-$i.out 2>&1 & "
  done
  # One s_client with the same leaf first: what s_time's handshakes negotiate, and whether the
  # server accepts the leaf (a refused client certificate shows as an alert; s_time cannot tell,
  # since a TLS 1.3 client finishes before the server has judged its certificate).
  local sc neg accepted=1
  sc=$( (sleep 1) | ip netns exec "$A" timeout 5 openssl s_client -connect "$IP_B:15008" \
          -cert "$WORK/hs-cert.pem" -key "$WORK/hs-key.pem" 2>&1 | tr -d '\0' || true)
  neg=$(awk '/^New, / {sub(/^New, /, ""); sub(/, Cipher is/, ""); c = $0}
             /^Server Temp Key: / {sub(/^Server Temp Key: /, ""); sub(/,.*/, ""); k = $0}
             END {print c " " k}' <<<"$sc")
  grep -qi 'alert' <<<"$sc" && accepted=0
  local tickets
  tickets=$(grep -c 'Post-Handshake New Session Ticket' <<<"$sc" || true)
  # Server-side handshake failures during the run, apart from the client's abrupt close (s_time
  # closes its socket right after its Finished: a server that still writes then, e.g. a session
  # ticket, sees a reset; its handshake work is done by then). ztunnel's come from its log (a
  # line per failure); mbtunnel logs a reason at most once a second, so its come from its
  # refusal counter (`tls_peer_closed` = the peer's close or reset).
  local hsfail='tls handshake error|TLS handshake with peer failed'
  local reset='ConnectionReset|Connection reset|BrokenPipe|Broken pipe|UnexpectedEof|unexpected eof'
  local lines0 ref0="0 0" ref1
  lines0=$(wc -l < "$dir/server.log")
  [ "$prod" = ztunnel ] || ref0=$(tls_refusals)
  measure "$dir" hs -1 ip netns exec "$A" bash -c "$hs_cmd wait"
  sleep 0.5
  local rej rst
  if [ "$prod" = ztunnel ]; then
    rej=$(tail -n +"$((lines0 + 1))" "$dir/server.log" | grep -E "$hsfail" | grep -cvE "$reset" || true)
    rst=$(tail -n +"$((lines0 + 1))" "$dir/server.log" | grep -E "$hsfail" | grep -cE "$reset" || true)
  else
    ref1=$(tls_refusals)
    rej=$(( ${ref1% *} - ${ref0% *} )); rst=$(( ${ref1#* } - ${ref0#* } ))
  fi
  measure "$dir" hsn -1 ip netns exec "$A" bash -c "$hsn_cmd wait"
  local hsr_cmd=""
  for i in $(seq 1 "$HS_PROCS"); do
    hsr_cmd+="openssl s_time -connect $IP_B:15008 -reuse -www / -time $SECS -cert $WORK/hs-cert.pem -key $WORK/hs-key.pem > $dir/hsr-$i.out 2>&1 & "
  done
  measure "$dir" hsr -1 ip netns exec "$A" bash -c "$hsr_cmd wait"
  # Evidence that the traffic went through the proxies as mTLS (the capture worked).
  local mtls
  mtls=$(get "$B" http://127.0.0.1:15020/metrics | grep '^istio_tcp_connections_opened_total' \
         | grep 'connection_security_policy="mutual_tls"' | awk '{s += $NF} END {print s + 0}')
  local rss_c rss_s rss_ic rss_is
  rss_c=$(awk '/^VmRSS/ {print $2}' "/proc/$CPID/status"); rss_s=$(awk '/^VmRSS/ {print $2}' "/proc/$SPID/status")
  # What the sequence leaves behind once the proxies idle (ztunnel's jemalloc purges unused pages
  # after 10 s, mbtunnel trims its heap every 10 s).
  sleep "$IDLE_SECS"
  rss_ic=$(awk '/^VmRSS/ {print $2}' "/proc/$CPID/status"); rss_is=$(awk '/^VmRSS/ {print $2}' "/proc/$SPID/status")
  # Where that memory is, mapping by mapping (KEEP=1 keeps it; benches/lib/smaps_summary.py).
  cp "/proc/$CPID/smaps" "$dir/idle-client.smaps" 2>/dev/null || true
  cp "/proc/$SPID/smaps" "$dir/idle-server.smaps" 2>/dev/null || true
  stop "$CPID"; stop "$SPID"
  nodes_down
  cat > "$dir/meta.json" <<JSON
{"product": "$prod", "round": $2, "attempt": $3, "quiet_pre": $QUIET_PRE, "secs": $SECS,
 "hs_procs": $HS_PROCS, "hs_negotiated": "$neg", "hs_tickets": $tickets, "rate": $RATE, "conns": $CONNS, "server_mtls_connections": $mtls,
 "hs_leaf_accepted": $accepted, "hs_server_rejections": $rej, "hs_server_resets": $rst, "time_wait_a": $tw_a, "time_wait_b": $tw_b,
 "rss_end_client_kib": ${rss_c:-0}, "rss_end_server_kib": ${rss_s:-0},
 "rss_idle_client_kib": ${rss_ic:-0}, "rss_idle_server_kib": ${rss_is:-0}, "idle_secs": $IDLE_SECS}
JSON
}

# --- rounds ----------------------------------------------------------------------------------------
read -r -a PLIST <<<"$PRODUCTS"
say "BIN=$BIN${ZT:+  ZT=$ZT}"
say "ROUNDS=$ROUNDS SECS=$SECS IDLE_SECS=$IDLE_SECS RATE=$RATE CONNS=$CONNS HS_PROCS=$HS_PROCS QUIET_MAX=$QUIET_MAX RETRIES=$RETRIES"
for r in $(seq 1 "$ROUNDS"); do
  order=("${PLIST[@]}")
  if [ $((r % 2)) = 0 ] && [ "${#PLIST[@]}" = 2 ]; then order=("${PLIST[1]}" "${PLIST[0]}"); fi
  for prod in "${order[@]}"; do
    for a in $(seq 0 "$RETRIES"); do
      say "round $r/$ROUNDS $prod (attempt $((a + 1)))"
      run_product "$prod" "$r" "$a" || { say "  $prod: run failed (nodes or proxies did not come up)"; tail -n 20 "$RUN_DIR"/*.log; exit 1; }
      verdict=$("$PY" benches/lib/dataplane_report.py check "$RUN_DIR" "$QUIET_MAX")
      say "  $verdict"
      case "$verdict" in quiet*) break ;; esac
      if [ "$a" = "$RETRIES" ]; then say "  kept although it overlapped other load (RETRIES=$RETRIES spent)"; fi
    done
  done
done

ZT_VER=""
if [ -n "${ZT:-}" ]; then
  ZT_VER=$(timeout 5 "$ZT" version 2>/dev/null | sed -nE 's/.*GitRevision:"([0-9a-f]{8})[^"]*".*RustVersion:"([^"]*)".*CryptoProvider:"([^"]*)".*/ztunnel \1 (Rust \2, \3)/p' | head -n1)
  ZT_VER=${ZT_VER:-ztunnel $(basename "$ZT")}
fi
CPU_NAME=$(lscpu | awk -F: '/^Model name/ {gsub(/^ +/, "", $2); print $2; exit}')
CPU_FAM=$(lscpu | awk -F: '/^CPU family/ {gsub(/ /, "", $2); print $2; exit}')
CPU_MOD=$(lscpu | awk -F: '/^Model:/ {gsub(/ /, "", $2); print $2; exit}')
HYP=$(lscpu | awk -F: '/^Hypervisor vendor/ {gsub(/ /, "", $2); print $2; exit}')
CPU_DESC="$CPU_NAME (family $CPU_FAM, model $CPU_MOD), $(nproc) vCPUs${HYP:+ under $HYP}, kernel $(uname -r)"
CMD=""
for v in ROUNDS SECS IDLE_SECS RATE CONNS HS_PROCS QUIET_MAX RETRIES; do CMD+="$v=${!v} "; done
CMD+="benches/dataplane.sh"
"$PY" benches/lib/dataplane_report.py table "$WORK/runs" \
  --cpu "$CPU_DESC" --command "$CMD" --date "$(date -u +%F)" \
  --mbtunnel "$("$BIN" version 2>/dev/null | head -n1 || echo mbtunnel), binary file dated $(date -u -r "$BIN" '+%F %H:%M UTC')" \
  --ztunnel "$ZT_VER" --note "$ZT_NOTE" --quiet_max "$QUIET_MAX" \
  --readme "$README_FILE" --write-readme "$README_WRITE"
