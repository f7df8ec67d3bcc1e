#!/usr/bin/env bash
# Record, from a real ztunnel, what it does around a waypoint, as test fixtures
# (tests/fixtures/ztunnel-waypoint/: outbound.json, inbound.json, the mesh YAML used). Needs root
# (network namespaces), python3 with h2 and cryptography (pip install h2 cryptography), curl,
# iptables. Without the ztunnel binary (../shared/anchors/ztunnel-path) it prints SKIPPED and
# exits 0. Namespaces, processes and scratch files are removed on exit, also on failure.
#
#   netns A (node A): 10.78.0.1 = workload default/client; ztunnel serving it (outbound 15001);
#       capture: nat OUTPUT, skip mark 0x539/0xfff and -o lo, TCP to the VIP subnet 10.78.1.0/24
#       and to the server pods 10.78.0.2 / 10.78.0.4 → REDIRECT 15001
#   netns W (node W): 10.78.0.3 = workload default/waypoint, one veth to A
#
# Phase 1, outbound: a python test waypoint (TLS 1.3, client cert required, ALPN h2, HTTP/2
#   CONNECT → 200 + echo) on 10.78.0.3:15019 (the waypoint's hboneMtlsPort) and a plain TCP trap
#   on 10.78.0.3:15008; an app in A connects to each case's target through ztunnel A.
# Phase 2, inbound: ztunnel in W serving default/waypoint (applicationTunnel PROXY:15088), plain
#   TCP recorders on 0.0.0.0:15088/80/8080 in W; a python HBONE client in A (cert for sa client)
#   sends one CONNECT per case to 10.78.0.3:15008. Then again with the waypoint workload
#   without applicationTunnel (mesh-no-app-tunnel.yaml).
#
# Run: sudo scripts/record-ztunnel-waypoint.sh [OUT_DIR]   (default tests/fixtures/ztunnel-waypoint;
# KEEP=1 keeps the scratch directory with the raw logs). Exit 0 = fixtures written.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${1:-tests/fixtures/ztunnel-waypoint}
LIB=$ROOT/scripts/lib/waypoint_recorder.py
ANCHORS=${ANCHORS:-../shared/anchors}; [ -d "$ANCHORS" ] || ANCHORS=/work/shared/anchors
ANCHORS=$(realpath "$ANCHORS" 2>/dev/null || echo "$ANCHORS")
ZT=""
if [ -x "$ANCHORS/ztunnel-path" ]; then ZT=$("$ANCHORS/ztunnel-path" 2>/dev/null || true); fi
if [ -z "$ZT" ] || [ ! -x "$ZT" ]; then
  echo "record-ztunnel-waypoint: SKIPPED (no ztunnel binary: $ANCHORS/ztunnel-path did not give one)"; exit 0
fi
if [ "$(id -u)" != 0 ]; then echo "record-ztunnel-waypoint: needs root (network namespaces)"; exit 1; fi
for c in ip iptables curl python3; do
  command -v "$c" >/dev/null || { echo "record-ztunnel-waypoint: needs $c"; exit 1; }
done
python3 -c 'import h2, cryptography' 2>/dev/null \
  || { echo "record-ztunnel-waypoint: needs python3 modules h2 and cryptography (pip install h2 cryptography)"; exit 1; }

eval "$(python3 "$LIB" env)"
T="zw$$"; A="$T-a"; W="$T-w"
WORK=$(mktemp -d /tmp/mbtunnel-zt-waypoint.XXXXXX)
PIDS=()
cleanup() {
  local p
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
  ip netns del "$A" 2>/dev/null || true
  ip netns del "$W" 2>/dev/null || true
  if [ "${KEEP:-0}" = 1 ]; then echo "scratch kept in $WORK"; else rm -rf "$WORK"; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM
stop() {  # stop one process started here and forget it
  kill "$1" 2>/dev/null || true; wait "$1" 2>/dev/null || true
  local p keep=()
  for p in "${PIDS[@]}"; do [ "$p" = "$1" ] || keep+=("$p"); done
  PIDS=("${keep[@]}")
}
# (background processes are started with `ip netns exec` itself, never through this function: a
# backgrounded function is a subshell, and killing it would leave the process running)
nsx() { local ns=$1; shift; ip netns exec "$ns" "$@"; }

# ztunnel's identity for the fixtures: the commit named in the anchors README, the binary's hash.
ZT_COMMIT=$(sed -n 's/.*istio\/ztunnel at commit \([0-9a-f]\{7,40\}\).*/\1/p' "$ANCHORS/README.md" | head -n1)
ZT_SHA=$(sha256sum "$ZT" | cut -d' ' -f1)

# --- namespaces ----------------------------------------------------------------------------------
for ns in "$A" "$W"; do ip netns add "$ns"; ip -n "$ns" link set lo up; done
ip link add "$T-a" netns "$A" type veth peer name "$T-w" netns "$W"
ip -n "$A" addr add "$IP_CLIENT/24" dev "$T-a"; ip -n "$A" link set "$T-a" up
ip -n "$W" addr add "$IP_WAYPOINT/24" dev "$T-w"; ip -n "$W" link set "$T-w" up
ip -n "$A" route add "$SUBNET_VIPS" dev "$T-a"      # so the app's connect() to a VIP gets routed
nsx "$A" iptables -t nat -A OUTPUT -m mark --mark 0x539/0xfff -j RETURN
nsx "$A" iptables -t nat -A OUTPUT -o lo -j RETURN
nsx "$A" iptables -t nat -A OUTPUT -p tcp -d "$SUBNET_VIPS" -j REDIRECT --to-ports 15001
nsx "$A" iptables -t nat -A OUTPUT -p tcp -d "$IP_SERVER/32" -j REDIRECT --to-ports 15001
nsx "$A" iptables -t nat -A OUTPUT -p tcp -d "$IP_SERVER2/32" -j REDIRECT --to-ports 15001

# --- mesh state, certificates ------------------------------------------------------------------
python3 "$LIB" mesh app-tunnel > "$WORK/mesh.yaml"
python3 "$LIB" mesh no-app-tunnel > "$WORK/mesh-no-app-tunnel.yaml"
for sa in waypoint client; do
  python3 "$LIB" mkcert --root-cert "$ANCHORS/ztunnel-fake-root-cert.pem" \
    --root-key "$ANCHORS/ztunnel-fake-root-key.pem" --uri "spiffe://cluster.local/ns/default/sa/$sa" \
    --out-cert "$WORK/$sa-cert.pem" --out-key "$WORK/$sa-key.pem"
done

start_ztunnel() { # ns workload(ns/name/sa) yaml log → pid in ZPID
  local dir; dir=$(mktemp -d "$WORK/zt.XXXX")
  ( cd "$dir" && exec env RUST_LOG="${ZT_LOG:-info}" FAKE_CA=true XDS_ADDRESS= \
      LOCAL_XDS_PATH="$3" PROXY_MODE=dedicated PROXY_WORKLOAD_INFO="$2" \
      ENABLE_ORIG_SRC=false PACKET_MARK=1337 ISTIO_META_DNS_CAPTURE=false \
      ip netns exec "$1" "$ZT" ) > "$4" 2>&1 &
  ZPID=$!; PIDS+=("$ZPID")
}
wait_ready() { # ns log
  local i
  for i in $(seq 1 150); do
    nsx "$1" curl -fsS --max-time 2 http://127.0.0.1:15021/healthz/ready >/dev/null 2>&1 && return 0
    sleep 0.2
  done
  echo "record-ztunnel-waypoint: ztunnel in $1 did not become ready"; tail -n 30 "$2"; return 1
}
wait_listening() { # log: our python servers print "listening" once bound
  local i
  for i in $(seq 1 100); do grep -q listening "$1" 2>/dev/null && return 0; sleep 0.1; done
  echo "record-ztunnel-waypoint: a recorder did not start:"; cat "$1"; return 1
}

# --- phase 1: outbound ---------------------------------------------------------------------------
echo "== outbound: ztunnel (client's node proxy) → test waypoint on $IP_WAYPOINT:$WAYPOINT_PORT =="
ip netns exec "$W" python3 "$LIB" waypoint-server --listen "$IP_WAYPOINT:$WAYPOINT_PORT" \
  --cert "$WORK/waypoint-cert.pem" --key "$WORK/waypoint-key.pem" \
  --root "$ANCHORS/ztunnel-fake-root-cert.pem" --out "$WORK/waypoint.jsonl" > "$WORK/waypoint.log" 2>&1 &
PIDS+=($!)
ip netns exec "$W" python3 "$LIB" tcp-listener --listen "$IP_WAYPOINT:15008" --out "$WORK/trap15008.jsonl" \
  > "$WORK/trap.log" 2>&1 & TRAP=$!; PIDS+=("$TRAP")
start_ztunnel "$A" default/client/client "$WORK/mesh.yaml" "$WORK/ztunnel-A.log"; ZA=$ZPID
wait_ready "$A" "$WORK/ztunnel-A.log"
wait_listening "$WORK/waypoint.log"; wait_listening "$WORK/trap.log"
python3 "$LIB" drive-outbound --out "$WORK/outbound.json" --zt-commit "$ZT_COMMIT" --zt-sha256 "$ZT_SHA" \
  --ns-client "$A" --ztunnel-log "$WORK/ztunnel-A.log" --waypoint-jsonl "$WORK/waypoint.jsonl" \
  --trap-jsonl "$WORK/trap15008.jsonl"
stop "$ZA"; stop "$TRAP"

# --- phase 2: inbound ----------------------------------------------------------------------------
ip netns exec "$W" python3 "$LIB" tcp-listener --listen "0.0.0.0:$APP_TUNNEL_PORT" --listen 0.0.0.0:80 \
  --listen 0.0.0.0:8080 --out "$WORK/upstream.jsonl" > "$WORK/upstream.log" 2>&1 & PIDS+=($!)
wait_listening "$WORK/upstream.log"
for variant in app-tunnel no-app-tunnel; do
  echo "== inbound ($variant): HBONE client → ztunnel (waypoint's node proxy) on $IP_WAYPOINT:15008 =="
  yaml="$WORK/mesh.yaml"; [ "$variant" = no-app-tunnel ] && yaml="$WORK/mesh-no-app-tunnel.yaml"
  start_ztunnel "$W" default/waypoint/waypoint "$yaml" "$WORK/ztunnel-W-$variant.log"; ZW=$ZPID
  wait_ready "$W" "$WORK/ztunnel-W-$variant.log"
  python3 "$LIB" drive-inbound --out "$WORK/inbound-$variant.json" --variant "$variant" \
    --ns-client "$A" --ns-waypoint "$W" --ztunnel-log "$WORK/ztunnel-W-$variant.log" \
    --listener-jsonl "$WORK/upstream.jsonl" --cert "$WORK/client-cert.pem" --key "$WORK/client-key.pem" \
    --root "$ANCHORS/ztunnel-fake-root-cert.pem"
  stop "$ZW"
done
python3 "$LIB" assemble-inbound --out "$WORK/inbound.json" --zt-commit "$ZT_COMMIT" --zt-sha256 "$ZT_SHA" \
  "$WORK/inbound-app-tunnel.json" "$WORK/inbound-no-app-tunnel.json"

# --- publish -------------------------------------------------------------------------------------
mkdir -p "$OUT"
cp "$WORK/outbound.json" "$WORK/inbound.json" "$WORK/mesh.yaml" "$WORK/mesh-no-app-tunnel.yaml" "$OUT/"
echo "record-ztunnel-waypoint: wrote $OUT/{outbound.json,inbound.json,mesh.yaml,mesh-no-app-tunnel.yaml}"
