#!/usr/bin/env bash
# Record, from two real ztunnels, what operators read of them after a few connections, as test
# fixtures in tests/fixtures/ztunnel-metrics/:
#   source.prom, destination.prom   the istio_tcp_* series of each side
#   source-full.prom                every family ztunnel A exports (the full exposition)
#   config_dump.json                ztunnel A's /config_dump
#   access.log, access.json         ztunnel B's access-log lines, plain and LOG_FORMAT=json
#   mesh.yaml                       the mesh both were fed
# tests/inpod.rs sends the same connections through two mbtunnels fed the same mesh and compares
# series, label sets and values; tests/operate.rs compares families, dump keys and log fields. Needs root (network namespaces), iptables, curl, and a built mbtunnel
# (target/release/mbtunnel: its `tool echo` / `tool send` are the apps). Without the ztunnel
# binary (../shared/anchors/ztunnel-path) it prints SKIPPED and exits 0.
#
#   netns A: 10.79.0.1 = workload demo/client (node A), ztunnel A; nat OUTPUT: TCP to the
#            server pod and to the VIP subnet 10.79.1.0/24 → REDIRECT 15001 (mark 0x539 and lo skipped)
#   netns B: 10.79.0.2 = workload demo/server (node B), ztunnel B (HBONE 15008), echo on 8080
#
# Connections: one to the pod (10.79.0.2:8080), one to the service VIP (10.79.1.2:80 → 8080), and
# one to the pod's port 8081, which a DENY policy on the server refuses.
#
# Run: sudo scripts/record-ztunnel-metrics.sh [OUT_DIR]   (KEEP=1 keeps the scratch directory)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${1:-tests/fixtures/ztunnel-metrics}
MBT=${MBTUNNEL:-$ROOT/target/release/mbtunnel}
ANCHORS=${ANCHORS:-../shared/anchors}; [ -d "$ANCHORS" ] || ANCHORS=/work/shared/anchors
ZT=""
if [ -x "$ANCHORS/ztunnel-path" ]; then ZT=$("$ANCHORS/ztunnel-path" 2>/dev/null || true); fi
if [ -z "$ZT" ] || [ ! -x "$ZT" ]; then
  echo "record-ztunnel-metrics: SKIPPED (no ztunnel binary from $ANCHORS/ztunnel-path)"; exit 0
fi
[ "$(id -u)" = 0 ] || { echo "record-ztunnel-metrics: needs root"; exit 1; }
[ -x "$MBT" ] || { echo "record-ztunnel-metrics: build mbtunnel first ($MBT)"; exit 1; }
ZT_COMMIT=$(sed -n 's/.*istio\/ztunnel at commit \([0-9a-f]\{7,40\}\).*/\1/p' "$ANCHORS/README.md" | head -n1)

T="zm$$"; A="$T-a"; B="$T-b"
WORK=$(mktemp -d /tmp/mbtunnel-zt-metrics.XXXXXX)
PIDS=()
cleanup() {
  local p
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
  ip netns del "$A" 2>/dev/null || true
  ip netns del "$B" 2>/dev/null || true
  if [ "${KEEP:-0}" = 1 ]; then echo "scratch kept in $WORK"; else rm -rf "$WORK"; fi
}
trap cleanup EXIT
nsx() { local ns=$1; shift; ip netns exec "$ns" "$@"; }

for ns in "$A" "$B"; do ip netns add "$ns"; ip -n "$ns" link set lo up; done
ip link add "$T-a" netns "$A" type veth peer name "$T-b" netns "$B"
ip -n "$A" addr add 10.79.0.1/24 dev "$T-a"; ip -n "$A" link set "$T-a" up
ip -n "$B" addr add 10.79.0.2/24 dev "$T-b"; ip -n "$B" link set "$T-b" up
ip -n "$A" route add 10.79.1.0/24 dev "$T-a"
nsx "$A" iptables -t nat -A OUTPUT -m mark --mark 0x539/0xfff -j RETURN
nsx "$A" iptables -t nat -A OUTPUT -o lo -j RETURN
nsx "$A" iptables -t nat -A OUTPUT -p tcp -d 10.79.1.0/24 -j REDIRECT --to-ports 15001
nsx "$A" iptables -t nat -A OUTPUT -p tcp -d 10.79.0.2/32 -j REDIRECT --to-ports 15001

cat > "$WORK/mesh.yaml" <<'YAML'
# Mesh state for scripts/record-ztunnel-metrics.sh (ztunnel LOCAL_XDS_PATH format).
workloads:
- uid: zclient-uid
  name: client-7d4f
  namespace: demo
  serviceAccount: client
  trustDomain: cluster.local
  workloadIps: ["10.79.0.1"]
  protocol: HBONE
  node: nodeA
  network: ""
  clusterId: cluster1
  workloadName: client
  workloadType: deployment
  canonicalName: client-app
  canonicalRevision: v1
  locality: {region: region-a, zone: zone-a1, subzone: ""}
  services: {}
- uid: zserver-uid
  name: server-5c9b
  namespace: demo
  serviceAccount: server
  trustDomain: cluster.local
  workloadIps: ["10.79.0.2"]
  protocol: HBONE
  node: nodeB
  network: ""
  clusterId: cluster1
  workloadName: server
  workloadType: deployment
  services:
    "demo/server.demo.svc.cluster.local": {80: 8080}
services:
- name: server
  namespace: demo
  hostname: server.demo.svc.cluster.local
  vips: ["/10.79.1.2"]
  ports: {80: 8080}
policies:
- name: deny-8081
  namespace: demo
  scope: Namespace
  action: Deny
  dryRun: false
  rules:
  - - - destinationPorts: [8081]
YAML

start_ztunnel() { # ns workload(ns/name/sa) log [LOG_FORMAT]
  local dir; dir=$(mktemp -d "$WORK/zt.XXXX")
  ( cd "$dir" && exec env RUST_LOG=info LOG_FORMAT="${4:-plain}" FAKE_CA=true XDS_ADDRESS= \
      LOCAL_XDS_PATH="$WORK/mesh.yaml" PROXY_MODE=dedicated PROXY_WORKLOAD_INFO="$2" \
      ENABLE_ORIG_SRC=false PACKET_MARK=1337 ISTIO_META_DNS_CAPTURE=false \
      ip netns exec "$1" "$ZT" ) > "$3" 2>&1 &
  PIDS+=($!)
}
wait_ready() { # ns log
  local i
  for i in $(seq 1 150); do
    nsx "$1" curl -fsS --max-time 2 http://127.0.0.1:15021/healthz/ready >/dev/null 2>&1 && return 0
    sleep 0.2
  done
  echo "record-ztunnel-metrics: ztunnel in $1 not ready"; tail -n 30 "$2"; return 1
}
start_ztunnel "$A" demo/client-7d4f/client "$WORK/ztunnel-A.log"
start_ztunnel "$B" demo/server-5c9b/server "$WORK/ztunnel-B.log" "${B_LOG_FORMAT:-plain}"
wait_ready "$A" "$WORK/ztunnel-A.log"; wait_ready "$B" "$WORK/ztunnel-B.log"
for p in 8080 8081; do
  ip netns exec "$B" "$MBT" tool echo --listen "10.79.0.2:$p" > "$WORK/echo-$p.log" 2>&1 & PIDS+=($!)
done
sleep 0.5
nsx "$A" "$MBT" tool send --connect 10.79.0.2:8080 --bytes 1000
nsx "$A" "$MBT" tool send --connect 10.79.1.2:80 --bytes 2000
nsx "$A" "$MBT" tool send --connect 10.79.0.2:8081 --bytes 10 || echo "(denied, as expected)"
sleep 1
mkdir -p "$OUT"
keep() { grep -E '^(# (HELP|TYPE) )?istio_tcp_' || true; }
nsx "$A" curl -fsS http://127.0.0.1:15020/metrics | keep > "$OUT/source.prom"
nsx "$B" curl -fsS http://127.0.0.1:15020/metrics | keep > "$OUT/destination.prom"
nsx "$A" curl -fsS http://127.0.0.1:15020/metrics > "$OUT/source-full.prom"
nsx "$A" curl -fsS http://127.0.0.1:15000/config_dump > "$OUT/config_dump.json"
# Access lines without their timestamps (the first field of a plain line, "timestamp" in JSON).
grep -a 'access' "$WORK/ztunnel-B.log" | sed -E 's/^[0-9TZ:.-]+[[:space:]]+//' > "$OUT/access.log"
sed "1s|.*|# Mesh state of scripts/record-ztunnel-metrics.sh, recorded from ztunnel $ZT_COMMIT.|" \
  "$WORK/mesh.yaml" > "$OUT/mesh.yaml"
# The same connections once more with ztunnel B logging JSON (a second pair of ztunnels).
if [ "${B_LOG_FORMAT:-plain}" = plain ]; then
  J=$(mktemp -d "$WORK/json.XXXX")
  KEEP=0 B_LOG_FORMAT=json "$0" "$J" >/dev/null
  grep -a '"access"' "$J/access.log" | sed -E 's/"time":"[^"]*",?//' > "$OUT/access.json" || true
fi
grep -c . "$OUT"/*.prom
echo "record-ztunnel-metrics: fixtures in $OUT (ztunnel $ZT_COMMIT)"
