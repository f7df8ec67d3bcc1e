#!/usr/bin/env bash
# Handshake-bound traffic between two nodes (issue 35 §4): N client identities each open one
# connection through both proxies, mbtunnel pair vs ztunnel pair in the same run. Root.
#
#   sudo benches/hsstorm.sh            or   make bench-hsstorm   (installs the tools first)
#
# Topology: node A and node B namespaces joined by veth (10.77.0.1 / 10.77.0.2). Node A holds N
# pod namespaces (10.78.x.y, one veth each, routed through node A), each pod its own workload
# and identity (spiffe://cluster.local/ns/storm/sa/client-i); a stand-in for istio-cni
# (`mbtunnel tool cni`) installs the in-pod redirect rules and enrols every pod over ZDS with
# the node proxy, which runs in shared (in-pod) mode: ztunnel with INPOD_UDS, mbtunnel with
# inpod_enabled. Node B runs the server workload's proxy (dedicated, as benches/dataplane.sh)
# and nginx on 10.77.0.2:80.
#
#   pod i (10.78.x.y) ──REDIRECT 15001 in the pod──▶ proxy A (in the pod) ══HBONE mTLS as client-i══▶
#     proxy B :15008 ──▶ nginx
#
# Per configuration and round: fresh proxies; wait until node A's proxy holds a certificate for
# every pod (/config_dump, the same shape in both products), then
#   first    every pod opens one connection (`mbtunnel tool storm`, CONC at a time): a new
#            HBONE connection per identity, a full mTLS handshake each (both sides sign)
#   again    the pooled connections are let go (pool idle timeout POOL_IDLE s on both
#            products), then every pod connects once more: a new HBONE connection per identity
#            again, where an mbtunnel client resumes the session its first connection got
#            (tls_resumption) and a ztunnel client (which never offers a session) does not.
# Measured: connections per second (N / wall time of the storm), both proxies' CPU
# (utime+stime) per connection, latency p50/p99.
#
# Configurations: ztunnel (P-256 leaves, its only choice), mbtunnel with P-256 and RSA-2048
# workload keys, each with tls_resumption on (its default) and off. Both products otherwise at
# their defaults, where an mbtunnel pair agrees on the post-quantum hybrid X25519MLKEM768 and the
# ztunnel pair (62d82653, tls-aws-lc) on X25519 (its profile holds no ML-KEM work); so
# mbt-p256-x25519 (P-256, resumption on, tls_groups [X25519]) is the like-for-like pair.
#
# Environment: BIN (default target/dist/mbtunnel, built if missing), NS="200 2000" (NxR: N pods,
# R rounds, e.g. "200x3 2000x1"), ROUNDS=3 (for an N without its own),
# CONC=64, POOL_IDLE=2, CONFIGS (default: all six: ztunnel mbt-p256 mbt-p256-nores mbt-p256-x25519 mbt-rsa
# mbt-rsa-nores), BIG_CONFIGS (the configurations for N >= 1000, default CONFIGS: RSA-2048 keys
# for 2,000 identities take minutes to generate per run), README_WRITE=1, README_FILE=benches/README.md, KEEP=1 keeps the work directory,
# PERF=1 records `perf record -g` of both proxies during each storm into the run's directory
# (PERF_CG="--call-graph dwarf,16384" for user-space stacks: the binaries keep no frame pointers),
# PERF=all the whole machine (`perf record -a -g`: who spends the CPU per connection, e.g.
# `perf report -i F --sort comm`) (profiles only: the recording costs CPU, so its figures are not
# for the table; with KEEP=1 and README_WRITE=0).
set -euo pipefail
BIN=${BIN:-target/dist/mbtunnel}
[ -e "$BIN" ] && BIN=$(realpath "$BIN")
cd "$(dirname "$0")/.."
NS=${NS:-"200 2000"}; ROUNDS=${ROUNDS:-3}; CONC=${CONC:-64}; POOL_IDLE=${POOL_IDLE:-2}
CONFIGS=${CONFIGS:-"ztunnel mbt-p256 mbt-p256-nores mbt-p256-x25519 mbt-rsa mbt-rsa-nores"}
README_WRITE=${README_WRITE:-1}; README_FILE=${README_FILE:-benches/README.md}
PY=/usr/bin/python3; [ -x "$PY" ] || PY=python3
say() { echo "hsstorm: $*"; }

if [ "$(id -u)" != 0 ]; then say "needs root (network namespaces)"; exit 1; fi
for c in nginx curl ip iptables; do
  command -v "$c" >/dev/null || { say "missing $c: running scripts/bench-deps.sh"; ./scripts/bench-deps.sh; break; }
done
if [ ! -x "$BIN" ]; then
  if [ "$BIN" = "$(pwd)/target/dist/mbtunnel" ] || [ "$BIN" = target/dist/mbtunnel ]; then
    say "no $BIN: cargo build --profile dist --locked"; cargo build --profile dist --locked --bin mbtunnel
    BIN=$(realpath target/dist/mbtunnel)
  else
    say "no mbtunnel binary at $BIN"; exit 1
  fi
fi

T="hst$$"
WORK=$(mktemp -d /tmp/mbtunnel-hsstorm.XXXXXX)
. benches/lib/topology.sh
ZT_NOTE=""
if ! topo_find_ztunnel; then
  ZT_NOTE="ztunnel binary absent ($ANCHORS/ztunnel-path gave none): mbtunnel measured alone"
  CONFIGS=$(tr ' ' '\n' <<<"$CONFIGS" | grep -v '^ztunnel$' | tr '\n' ' '); say "$ZT_NOTE"
fi
PODNS=()
# The neighbour (ARP) table is one for all namespaces, and N pods need about 2N entries (each pod's
# gateway, node A's entry for each pod): the default gc_thresh3 of 1024 overflows near N = 500
# ("neighbor table overflow!" in the kernel log, the proxies' connects fail with EHOSTUNREACH).
# Raised for the run, restored on exit.
NEIGH_SAVED=$(sysctl -n net.ipv4.neigh.default.gc_thresh1 net.ipv4.neigh.default.gc_thresh2 net.ipv4.neigh.default.gc_thresh3 | tr '\n' ' ')
neigh_restore() {
  local t1 t2 t3; read -r t1 t2 t3 <<<"$NEIGH_SAVED"
  sysctl -qw net.ipv4.neigh.default.gc_thresh3="$t3" net.ipv4.neigh.default.gc_thresh2="$t2" \
    net.ipv4.neigh.default.gc_thresh1="$t1" || true
}
cleanup() {
  neigh_restore
  topo_cleanup
  local p
  for p in "${PODNS[@]}"; do ip netns del "$p" 2>/dev/null || true; done
  if [ "${KEEP:-0}" = 1 ]; then say "work directory kept: $WORK"; else rm -rf "$WORK"; fi
}
trap cleanup EXIT
topo_write_mesh   # the CA (ztunnel's FAKE_CA root, shared by both products)

pod_ip() { echo "10.78.$(($1 / 250)).$(($1 % 250 + 2))"; }

# --- nodes, pods, apps (once per N) -------------------------------------------------------------
nodes_up() { # n
  local n=$1 ns i ip need=$((4 * $1 + 1024))
  if [ "$(sysctl -n net.ipv4.neigh.default.gc_thresh3)" -lt "$need" ]; then
    sysctl -qw net.ipv4.neigh.default.gc_thresh3="$need" net.ipv4.neigh.default.gc_thresh2="$need" \
      net.ipv4.neigh.default.gc_thresh1="$((2 * $1))"
  fi
  for ns in "$A" "$B"; do ip netns add "$ns"; ip -n "$ns" link set lo up; done
  ip link add "$T-va" netns "$A" type veth peer name "$T-vb" netns "$B"
  ip -n "$A" addr add "$IP_A/24" dev "$T-va"; ip -n "$A" link set "$T-va" up
  ip -n "$B" addr add "$IP_B/24" dev "$T-vb"; ip -n "$B" link set "$T-vb" up
  ip -n "$B" route add 10.78.0.0/16 via "$IP_A"
  nsx "$A" sysctl -qw net.ipv4.ip_forward=1
  for ns in "$A" "$B"; do
    nsx "$ns" sysctl -qw net.ipv4.ip_local_port_range="1024 65000" net.ipv4.tcp_tw_reuse=1
  done
  : > "$WORK/pods.txt"
  # Pods in batches through `ip -batch` (one process per few hundred commands, not per command).
  local nb="$WORK/ip-node.batch"; : > "$nb"
  for i in $(seq 1 "$n"); do
    ip=$(pod_ip "$i"); ns="$T-p$i"
    ip netns add "$ns"; PODNS+=("$ns")
    echo "link add vp$i type veth peer name eth0 netns $ns" >> "$nb"
    echo "addr add 10.78.255.254/32 dev vp$i" >> "$nb"
    echo "link set vp$i up" >> "$nb"
    echo "route add $ip/32 dev vp$i" >> "$nb"
    echo "storm-$i=/var/run/netns/$ns=storm/client-$i/client-$i" >> "$WORK/pods.txt"
  done
  ip -n "$A" -batch "$nb"
  for i in $(seq 1 "$n"); do
    ip=$(pod_ip "$i"); ns="$T-p$i"
    printf '%s\n' "link set lo up" "addr add $ip/32 dev eth0" "link set eth0 up" \
      "route add 10.78.255.254 dev eth0 scope link" "route add default via 10.78.255.254 dev eth0" \
      | ip -n "$ns" -batch -
  done
  # The mesh: N client workloads on node A, the server on node B, in both products' formats.
  {
    echo "workloads:"
    for i in $(seq 1 "$n"); do
      printf -- '- {uid: storm-%d, name: client-%d, namespace: storm, serviceAccount: client-%d, trustDomain: cluster.local, workloadIps: ["%s"], protocol: HBONE, node: nodeA, network: "", services: {}}\n' \
        "$i" "$i" "$i" "$(pod_ip "$i")"
    done
    printf -- '- {uid: cluster1//v1/Pod/default/server, name: server, namespace: default, serviceAccount: server, trustDomain: cluster.local, workloadIps: ["%s"], protocol: HBONE, node: nodeB, network: "", services: {}}\n' "$IP_B"
  } > "$WORK/zt-mesh.yaml"
  {
    echo "workloads:"
    for i in $(seq 1 "$n"); do
      printf '  - {uid: storm-%d, name: client-%d, namespace: storm, service_account: client-%d, ips: [%s], node: nodeA, protocol: HBONE}\n' \
        "$i" "$i" "$i" "$(pod_ip "$i")"
    done
    printf '  - {uid: cluster1//v1/Pod/default/server, name: server, namespace: default, service_account: server, ips: [%s], node: nodeB, protocol: HBONE}\n' "$IP_B"
  } > "$WORK/mbt-mesh.yaml"
  # The stand-in CNI: rules in every pod, then ZDS for whichever node proxy connects.
  "$BIN" tool cni --socket "$WORK/cni.sock" --pods-file "$WORK/pods.txt" --quiet > "$WORK/cni-$n.log" 2>&1 &
  CNI_PID=$!; PIDS+=("$CNI_PID")
  for i in $(seq 1 600); do [ -S "$WORK/cni.sock" ] && break; sleep 0.2; done
  [ -S "$WORK/cni.sock" ] || { say "the CNI stand-in did not start"; cat "$WORK/cni-$n.log"; return 1; }
  # nginx on node B answering 1 KB.
  mkdir -p "$WORK/nginx/logs" "$WORK/nginx/tmp"
  cat > "$WORK/nginx/nginx.conf" <<NGINX
user root;
worker_processes 1;
pid $WORK/nginx/nginx.pid;
error_log $WORK/nginx/logs/error.log warn;
events { worker_connections 8192; }
http {
  access_log off;
  client_body_temp_path $WORK/nginx/tmp/body;
  proxy_temp_path $WORK/nginx/tmp/proxy;
  fastcgi_temp_path $WORK/nginx/tmp/fastcgi;
  uwsgi_temp_path $WORK/nginx/tmp/uwsgi;
  scgi_temp_path $WORK/nginx/tmp/scgi;
  server { listen $IP_B:80 reuseport; location / { default_type text/plain; return 200 '$(head -c 1024 /dev/zero | tr '\0' 'x')'; } }
}
NGINX
  ip netns exec "$B" nginx -p "$WORK/nginx" -c "$WORK/nginx/nginx.conf" -g 'daemon off;' > "$WORK/nginx.log" 2>&1 &
  NGINX_PID=$!; PIDS+=("$NGINX_PID")
}

nodes_down() {
  stop "$NGINX_PID"; stop "$CNI_PID"; rm -f "$WORK/cni.sock"
  local p
  for p in "${PODNS[@]}"; do ip netns del "$p" 2>/dev/null || true; done
  PODNS=()
  ip netns del "$A"; ip netns del "$B"
}

# --- proxies ------------------------------------------------------------------------------------
mbt_node_config() { # node key resumption inpod groups → path
  local f="$WORK/mbt-$1.yaml"
  {
    echo "node_name: $1"
    echo "trust_domain: cluster.local"
    echo "ca_dir: $WORK/ca"
    echo "key_algorithm: $2"
    echo "tls_resumption: $3"
    [ -n "${5:-}" ] && echo "tls_groups: [$5]"
    echo "pool_idle_timeout_secs: $POOL_IDLE"
    echo "socket_mark: 0x539"
    echo "watch_file: false"
    if [ "$4" = 1 ]; then
      echo "inpod_enabled: true"; echo "inpod_socket: $WORK/cni.sock"
    else
      echo "transparent: false"
    fi
    cat "$WORK/mbt-mesh.yaml"
  } > "$f"
  echo "$f"
}

start_pair() { # config dir → CPID SPID
  local cfg=$1 dir=$2
  if [ "$cfg" = ztunnel ]; then
    start_ztunnel_dedicated "$dir"
    local zd="$WORK/zt-client"; mkdir -p "$zd"
    ( cd "$zd" && exec env FAKE_CA=true XDS_ADDRESS= LOCAL_XDS_PATH="$WORK/zt-mesh.yaml" \
        NODE_NAME=nodeA INPOD_UDS="$WORK/cni.sock" POOL_UNUSED_RELEASE_TIMEOUT="${POOL_IDLE}s" \
        ISTIO_META_DNS_CAPTURE=false ip netns exec "$A" "$ZT" ) > "$dir/client.log" 2>&1 &
    CPID=$!; PIDS+=("$CPID")
  else
    local key=ecdsa-p256 res=true
    case "$cfg" in mbt-rsa*) key=rsa-2048 ;; esac
    case "$cfg" in *-nores) res=false ;; esac
    local groups=""
    case "$cfg" in *-x25519) groups=X25519 ;; esac
    ip netns exec "$B" "$BIN" run --config "$(mbt_node_config nodeB "$key" "$res" 0 "$groups")" > "$dir/server.log" 2>&1 &
    SPID=$!; PIDS+=("$SPID")
    ip netns exec "$A" "$BIN" run --config "$(mbt_node_config nodeA "$key" "$res" 1 "$groups")" > "$dir/client.log" 2>&1 &
    CPID=$!; PIDS+=("$CPID")
  fi
  # Node A's proxy is ready once it holds a certificate for every enrolled pod: with RSA-2048
  # keys that is ~13 keys/s here, minutes for 2,000 pods (the bound wait_certs uses too).
  wait_ready "$B" "$cfg server" "$dir/server.log" && wait_ready "$A" "$cfg client" "$dir/client.log" 300
}
start_ztunnel_dedicated() { # dir → SPID (the server side, as in benches/dataplane.sh)
  local zd="$WORK/zt-server"; mkdir -p "$zd"
  ( cd "$zd" && exec env FAKE_CA=true XDS_ADDRESS= LOCAL_XDS_PATH="$WORK/zt-mesh.yaml" \
      PROXY_MODE=dedicated PROXY_WORKLOAD_INFO=default/server/server ENABLE_ORIG_SRC=false \
      PACKET_MARK=1337 POOL_UNUSED_RELEASE_TIMEOUT="${POOL_IDLE}s" ISTIO_META_DNS_CAPTURE=false \
      ip netns exec "$B" "$ZT" ) > "$1/server.log" 2>&1 &
  SPID=$!; PIDS+=("$SPID")
}

# Node A's proxy holds an Available certificate for every pod (both products' /config_dump), or
# its count stopped growing for 10 s: ztunnel 62d82653 prefetched 256 of 2,000 and fetches the
# rest on a pod's first connection. Prints "polls held".
wait_certs() { # n dir
  local i got=0 last=-1 still=0
  for i in $(seq 1 600); do
    got=$(get "$A" http://127.0.0.1:15000/config_dump | "$PY" -c '
import json, sys
try:
    d = json.load(sys.stdin)
except ValueError:
    print(0); sys.exit()
print(sum(1 for c in d.get("certificates", []) if c.get("state") == "Available" and "/ns/storm/" in c.get("identity", "")))') || got=0
    [ "$got" -ge "$1" ] && { echo "$i $got"; return 0; }
    if [ "$got" = "$last" ] && [ "$got" -gt 0 ]; then still=$((still + 1)); else still=0; fi
    [ "$still" -ge 20 ] && { echo "$i $got"; return 0; }
    last=$got
    sleep 0.5
  done
  say "  node A's proxy holds $got of $1 pod certificates after 300 s"; return 1
}

storm() { # dir name
  local perf=()
  if [ "${PERF:-0}" = 1 ]; then
    # shellcheck disable=SC2086 # PERF_CG is a list of perf options
    perf record -F 1999 ${PERF_CG:--g} -p "$CPID" -o "$1/$2-client.perf" >/dev/null 2>&1 & perf+=($!)
    # shellcheck disable=SC2086
    perf record -F 1999 ${PERF_CG:--g} -p "$SPID" -o "$1/$2-server.perf" >/dev/null 2>&1 & perf+=($!)
    sleep 1
  elif [ "${PERF:-0}" = all ]; then
    perf record -F 999 -a -g -o "$1/$2-all.perf" >/dev/null 2>&1 & perf+=($!)
    sleep 1
  fi
  "$PY" benches/lib/measure.py run --client "$CPID" --server "$SPID" --apps "$NGINX_PID" \
    --out "$1/$2.out" -- "$BIN" tool storm --pods-file "$WORK/pods.txt" --connect "$IP_B:80" \
    --concurrency "$CONC" > "$1/$2.json"
  local p
  for p in "${perf[@]}"; do kill -INT "$p"; wait "$p" || true; done
}

run_config() { # cfg n round → dir
  local cfg=$1 n=$2 dir="$WORK/runs/n$2-$1-r$3"
  mkdir -p "$dir"
  start_pair "$cfg" "$dir" || { stop "$CPID"; stop "$SPID"; return 1; }
  local waited held; read -r waited held < <(wait_certs "$n" "$dir") || { stop "$CPID"; stop "$SPID"; return 1; }
  sleep 2   # certificate work done: let the proxies settle
  storm "$dir" first
  sleep $((POOL_IDLE + 2))   # the pooled connections idle out on both nodes
  storm "$dir" again
  stop "$CPID"; stop "$SPID"
  cat > "$dir/meta.json" <<JSON
{"config": "$cfg", "n": $n, "round": $3, "conc": $CONC, "pool_idle": $POOL_IDLE, "cert_wait_polls": $waited, "certs_held_before": $held}
JSON
}

read -r -a CLIST <<<"$CONFIGS"
say "BIN=$BIN${ZT:+  ZT=$ZT}"
say "NS=$NS ROUNDS=$ROUNDS CONC=$CONC POOL_IDLE=$POOL_IDLE CONFIGS=$CONFIGS"
for item in $NS; do
  n=${item%x*}; rounds=$ROUNDS
  [ "$item" != "$n" ] && rounds=${item#*x}
  say "N=$n: $n pod namespaces on node A, $rounds rounds"
  nodes_up "$n"
  for r in $(seq 1 "$rounds"); do
    # Rotate the order each round, so no configuration always runs first.
    read -r -a CLIST <<<"$CONFIGS"
    if [ "$n" -ge 1000 ] && [ -n "${BIG_CONFIGS:-}" ]; then read -r -a CLIST <<<"$BIG_CONFIGS"; fi
    order=("${CLIST[@]:$(( (r - 1) % ${#CLIST[@]} ))}" "${CLIST[@]:0:$(( (r - 1) % ${#CLIST[@]} ))}")
    for cfg in "${order[@]}"; do
      say "N=$n round $r/$rounds $cfg"
      run_config "$cfg" "$n" "$r" || { say "  $cfg: run failed"; tail -n 20 "$WORK/runs/n$n-$cfg-r$r"/*.log; exit 1; }
      "$PY" -c '
import json, sys
for p in ("first", "again"):
    m = json.load(open(sys.argv[1] + "/" + p + ".json"))
    s = json.loads([l for l in open(sys.argv[1] + "/" + p + ".out").read().splitlines() if l.startswith("{")][-1])
    print("hsstorm:   %-5s %7.0f conn/s, proxies %.3f + %.3f ms CPU per connection, %d failed"
          % (p, s["conn_per_s"], m["cpu_client"] / s["connections"] * 1e3,
             m["cpu_server"] / s["connections"] * 1e3, s["failed"]))' "$WORK/runs/n$n-$cfg-r$r"
    done
  done
  nodes_down
done

ZT_VER=""
if [ -n "${ZT:-}" ]; then
  ZT_VER=$(timeout 5 "$ZT" version 2>/dev/null | sed -nE 's/.*GitRevision:"([0-9a-f]{8})[^"]*".*RustVersion:"([^"]*)".*CryptoProvider:"([^"]*)".*/ztunnel \1 (Rust \2, \3)/p' | head -n1)
fi
CPU_NAME=$(lscpu | awk -F: '/^Model name/ {gsub(/^ +/, "", $2); print $2; exit}')
CPU_FAM=$(lscpu | awk -F: '/^CPU family/ {gsub(/ /, "", $2); print $2; exit}')
CPU_MOD=$(lscpu | awk -F: '/^Model:/ {gsub(/ /, "", $2); print $2; exit}')
IFMA=$(grep -q avx512ifma /proc/cpuinfo && echo "with AVX-512 IFMA" || echo "without AVX-512 IFMA")
CMD="NS=\"$NS\" ROUNDS=$ROUNDS CONC=$CONC POOL_IDLE=$POOL_IDLE benches/hsstorm.sh"
"$PY" benches/lib/hsstorm_report.py "$WORK/runs" \
  --cpu "$CPU_NAME (family $CPU_FAM, model $CPU_MOD) $IFMA, $(nproc) vCPUs, kernel $(uname -r)" \
  --command "$CMD" --date "$(date -u +%F)" \
  --mbtunnel "$("$BIN" version 2>/dev/null | head -n1), binary file dated $(date -u -r "$BIN" '+%F %H:%M UTC')" \
  --ztunnel "$ZT_VER" --note "$ZT_NOTE" --readme "$README_FILE" --write-readme "$README_WRITE"
