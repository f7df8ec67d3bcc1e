#!/usr/bin/env bash
# The demo in network namespaces, in-pod mode (needs root): two simulated nodes joined by a
# bridge, a client pod on node 1 and an echo pod on node 2. A stand-in for istio-cni
# (`mbtunnel tool cni`) installs the redirect rules in each pod and enrols it over ZDS; each node
# proxy runs inside its node's namespace and opens the pod's listeners inside the pod.
#
#   client pod 10.0.1.2 ──connect 10.0.2.2:8080──▶ (iptables REDIRECT → 15001 in the pod)
#     ─▶ proxy node-1 ──HBONE mTLS, from 10.0.1.2 to 10.0.2.2:15008──▶ proxy node-2 (in the echo pod)
#     ─▶ echo 10.0.2.2:8080, which sees 10.0.1.2 as the source
#
# Run: sudo DEMO_NETNS=1 make demo   (or scripts/demo-netns.sh). Everything is removed on exit.
set -euo pipefail
BIN=$(realpath "${BIN:-target/release/mbtunnel}")
if [ "$(id -u)" != 0 ]; then echo "demo-netns: needs root (network namespaces)"; exit 1; fi
T="mbtd$$"
WORK=$(mktemp -d /tmp/mbtunnel-demo-netns.XXXXXX)
PIDS=()
NSS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  for ((i=${#NSS[@]}-1; i>=0; i--)); do ip netns del "${NSS[$i]}" 2>/dev/null || true; done
  rm -rf "$WORK"
}
trap cleanup EXIT
addns() { ip netns add "$1"; NSS+=("$1"); ip -n "$1" link set lo up; }

addns "$T-fab"; ip -n "$T-fab" link add br0 type bridge; ip -n "$T-fab" link set br0 up
for n in 1 2; do
  N="$T-n$n"; addns "$N"
  ip -n "$T-fab" link add "n$n" type veth peer name eth0 netns "$N"
  ip -n "$T-fab" link set "n$n" master br0 up
  ip -n "$N" addr add "10.0.0.$n/24" dev eth0; ip -n "$N" link set eth0 up
  ip netns exec "$N" sh -c 'echo 1 > /proc/sys/net/ipv4/ip_forward'
done
ip -n "$T-n1" route add 10.0.2.0/24 via 10.0.0.2
ip -n "$T-n2" route add 10.0.1.0/24 via 10.0.0.1
pod() { # node pod
  local N="$T-n$1" P="$T-n$1p$2"; addns "$P"
  ip -n "$N" link add "vp$2" type veth peer name eth0 netns "$P"
  ip -n "$N" addr add "10.0.$1.1/32" dev "vp$2"; ip -n "$N" link set "vp$2" up
  ip -n "$N" route add "10.0.$1.$2/32" dev "vp$2"
  ip -n "$P" addr add "10.0.$1.$2/32" dev eth0; ip -n "$P" link set eth0 up
  ip -n "$P" route add "10.0.$1.1" dev eth0 scope link
  ip -n "$P" route add default via "10.0.$1.1" dev eth0
}
pod 1 2; pod 2 2

for n in 1 2; do
cat > "$WORK/node-$n.yaml" <<YAML
node_name: node-$n
ca_dir: $WORK/ca
key_algorithm: ${KEY_ALGORITHM:-ecdsa-p256}
inpod_enabled: true
inpod_socket: $WORK/cni-$n.sock
workloads:
  - {uid: client-1, name: client, namespace: demo, service_account: client, ips: [10.0.1.2], node: node-1}
  - {uid: echo-1, name: echo, namespace: demo, service_account: echo, ips: [10.0.2.2], node: node-2}
YAML
done

ip netns exec "$T-n2p2" "$BIN" tool echo --listen 0.0.0.0:8080 > "$WORK/echo.log" & PIDS+=($!)
"$BIN" tool cni --socket "$WORK/cni-1.sock" --pod "client-1=/var/run/netns/$T-n1p2" > "$WORK/cni-1.log" 2>&1 & PIDS+=($!)
"$BIN" tool cni --socket "$WORK/cni-2.sock" --pod "echo-1=/var/run/netns/$T-n2p2" --redirect nftables > "$WORK/cni-2.log" 2>&1 & PIDS+=($!)
for n in 1 2; do
  RUST_LOG=${RUST_LOG:-info} ip netns exec "$T-n$n" "$BIN" run --config "$WORK/node-$n.yaml" > "$WORK/node-$n.log" 2>&1 & PIDS+=($!)
done
get() { ip netns exec "$1" curl -fsS --max-time 2 "$2" 2>/dev/null; }
for i in $(seq 1 100); do
  if get "$T-n1" http://127.0.0.1:15021/healthz/ready >/dev/null && get "$T-n2" http://127.0.0.1:15021/healthz/ready >/dev/null; then break; fi
  if [ "$i" = 100 ]; then echo "demo-netns: proxies did not become ready"; tail -n 20 "$WORK"/*.log; exit 1; fi
  sleep 0.1
done

echo "== mbtunnel demo in namespaces (in-pod mode): client pod (node 1) → echo pod (node 2) =="
ok=1
RESULT=$(ip netns exec "$T-n1p2" "$BIN" tool send --connect 10.0.2.2:8080 --bytes "${BYTES:-1048576}") || ok=0
sleep 0.3
MA=$(get "$T-n1" http://127.0.0.1:15020/metrics); MB=$(get "$T-n2" http://127.0.0.1:15020/metrics)
echo "CNI acks:           $(cat "$WORK"/cni-*.log | tr '\n' ' ')"
echo "client result:      ${RESULT:-failed}"
echo "echo server saw:    $(head -n1 "$WORK/echo.log") (the client pod's own address)"
echo "pod rules (client): $(ip netns exec "$T-n1p2" iptables -t nat -S MBT_OUTPUT | tail -n1)"
echo "-- proxy node-1 (reporter=source) --"
echo "$MA" | grep -E '^istio_tcp_(connections_opened|sent_bytes)_total' || true
echo "-- proxy node-2 (reporter=destination) --"
echo "$MB" | grep -E '^istio_tcp_(connections_opened|sent_bytes)_total' || true
echo "$MB" | grep 'reporter="destination"' | grep 'source_principal="spiffe://cluster.local/ns/demo/sa/client"' \
  | grep -q 'connection_security_policy="mutual_tls"' || ok=0
grep -q '"echo_peer":"10.0.1.2:' "$WORK/echo.log" || ok=0
if [ "$ok" = 1 ]; then echo "DEMO (namespaces) OK"; else echo "DEMO (namespaces) FAILED"; tail -n 30 "$WORK"/*.log; exit 1; fi
