# shellcheck shell=bash
# Two "nodes" in network namespaces joined by one veth pair, a proxy per node serving exactly one
# workload with the node's own address ("dedicated" mode, as in shared/anchors/README.md), capture
# by iptables REDIRECT on the client node. Sourced by scripts/interop-ztunnel.sh and
# benches/dataplane.sh (both run as root from the repository root).
#
#   ns A: 10.77.0.1 = node A = workload default/client (sa client)   capture: nat OUTPUT,
#         skip mark 0x539/0xfff and -o lo, TCP to 10.77.0.2 → REDIRECT 15001
#   ns B: 10.77.0.2 = node B = workload default/server (sa server)   the apps listen on 10.77.0.2
#
# mbtunnel and ztunnel trust each other (and themselves) through ztunnel's FAKE_CA root, which is
# given to mbtunnel as its CA (ca_dir/ca-cert.pem + ca-key.pem): every leaf is EC P-256 from that
# one root.
#
# Before sourcing, the caller sets: BIN (mbtunnel, absolute), WORK (a scratch directory), T (a
# short unique prefix, ≤ 8 characters: interface names are T-va/T-vb), optionally ANCHORS. The
# caller owns the EXIT trap and calls topo_cleanup from it. Processes started through the helpers
# are recorded in PIDS.

A="$T-a"; B="$T-b"
IP_A=${IP_A:-10.77.0.1}; IP_B=${IP_B:-10.77.0.2}
PIDS=()

# topo_find_ztunnel → ZT (exit 1 without a usable binary).
topo_find_ztunnel() {
  if [ -z "${ANCHORS:-}" ]; then
    ANCHORS=../shared/anchors; [ -d "$ANCHORS" ] || ANCHORS=/work/shared/anchors
  fi
  [ -x "$ANCHORS/ztunnel-path" ] && ZT=$("$ANCHORS/ztunnel-path" 2>/dev/null) && [ -x "$ZT" ]
}

topo_cleanup() {
  local p
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  ip netns del "$A" 2>/dev/null || true
  ip netns del "$B" 2>/dev/null || true
}

nsx() { local ns=$1; shift; ip netns exec "$ns" "$@"; }
get() { nsx "$1" curl -fsS --max-time 3 "$2" 2>/dev/null; }

# --- namespaces, veth, capture in A ----------------------------------------------------------
topo_netns_up() {
  local ns
  for ns in "$A" "$B"; do ip netns add "$ns"; ip -n "$ns" link set lo up; done
  ip link add "$T-va" netns "$A" type veth peer name "$T-vb" netns "$B"
  ip -n "$A" addr add "$IP_A/24" dev "$T-va"; ip -n "$A" link set "$T-va" up
  ip -n "$B" addr add "$IP_B/24" dev "$T-vb"; ip -n "$B" link set "$T-vb" up
  nsx "$A" iptables -t nat -A OUTPUT -m mark --mark 0x539/0xfff -j RETURN
  nsx "$A" iptables -t nat -A OUTPUT -o lo -j RETURN
  nsx "$A" iptables -t nat -A OUTPUT -p tcp -d "$IP_B/32" -j REDIRECT --to-ports 15001
}

# --- mesh state, CA ------------------------------------------------------------------------------
# The CA goes to $WORK/ca (ztunnel's FAKE_CA root from the anchors; without them, mbtunnel alone,
# a development root from scripts/make-ca.sh), ztunnel's workloads to $WORK/zt-workloads.yaml.
topo_write_mesh() {
  if [ -e "${ANCHORS:-}/ztunnel-fake-root-cert.pem" ]; then
    mkdir -p "$WORK/ca"
    cp "$ANCHORS/ztunnel-fake-root-cert.pem" "$WORK/ca/ca-cert.pem"
    cp "$ANCHORS/ztunnel-fake-root-key.pem" "$WORK/ca/ca-key.pem"
  else
    scripts/make-ca.sh "$WORK/ca" cluster.local >/dev/null
  fi
  cat > "$WORK/zt-workloads.yaml" <<YAML
workloads:
- uid: cluster1//v1/Pod/default/client
  name: client
  namespace: default
  serviceAccount: client
  trustDomain: cluster.local
  workloadIps: ["$IP_A"]
  protocol: HBONE
  node: nodeA
  network: ""
  services: {}
- uid: cluster1//v1/Pod/default/server
  name: server
  namespace: default
  serviceAccount: server
  trustDomain: cluster.local
  workloadIps: ["$IP_B"]
  protocol: HBONE
  node: nodeB
  network: ""
  services: {}
YAML
}

mbt_config() { # node → config path
  cat > "$WORK/mbt-$1.yaml" <<YAML
node_name: $1
trust_domain: cluster.local
ca_dir: $WORK/ca
key_algorithm: ecdsa-p256
transparent: false            # the app is in the proxy's own namespace: dial it from our address
socket_mark: 0x539
watch_file: false
workloads:
  - {uid: cluster1//v1/Pod/default/client, name: client, namespace: default, service_account: client, ips: [$IP_A], node: nodeA, protocol: HBONE}
  - {uid: cluster1//v1/Pod/default/server, name: server, namespace: default, service_account: server, ips: [$IP_B], node: nodeB, protocol: HBONE}
YAML
  echo "$WORK/mbt-$1.yaml"
}

# --- processes -----------------------------------------------------------------------------------
# Both keep the PID of the proxy itself (env and `ip netns exec` exec into it), so /proc/$PID is
# the proxy's. RUST_LOG: ZT_LOG / MBT_LOG, else RUST_LOG, else each product's own default.
start_ztunnel() { # ns workload(ns/name/sa) log → pid in ZPID
  local dir="$WORK/zt-$1"; mkdir -p "$dir"
  local log=${ZT_LOG:-${RUST_LOG:-}}
  ( cd "$dir" && exec env ${log:+RUST_LOG="$log"} FAKE_CA=true XDS_ADDRESS= \
      LOCAL_XDS_PATH="$WORK/zt-workloads.yaml" PROXY_MODE=dedicated PROXY_WORKLOAD_INFO="$2" \
      ENABLE_ORIG_SRC=false PACKET_MARK=1337 ISTIO_META_DNS_CAPTURE=false \
      ip netns exec "$1" "$ZT" ) > "$3" 2>&1 &
  ZPID=$!; PIDS+=("$ZPID")
}
start_mbtunnel() { # ns node log → pid in MPID
  local log=${MBT_LOG:-${RUST_LOG:-}}
  env ${log:+RUST_LOG="$log"} ip netns exec "$1" "$BIN" run --config "$(mbt_config "$2")" > "$3" 2>&1 &
  MPID=$!; PIDS+=("$MPID")
}
wait_ready() { # ns name log [seconds, default 30]
  local i secs=${4:-30}
  for i in $(seq 1 $((secs * 5))); do
    if get "$1" http://127.0.0.1:15021/healthz/ready >/dev/null; then return 0; fi
    sleep 0.2
  done
  echo "  $2 in $1 did not become ready in ${secs} s"; tail -n 30 "$3"; return 1
}
# Stops one process started here and forgets it (cleanup must not signal a PID reused since).
stop() {
  kill "$1" 2>/dev/null || true; wait "$1" 2>/dev/null || true
  local p keep=()
  for p in "${PIDS[@]}"; do [ "$p" = "$1" ] || keep+=("$p"); done
  PIDS=("${keep[@]}")
}
