#!/usr/bin/env bash
# A local mesh on this machine: two node proxies, an echo workload and a client, on loopback
# addresses. Traffic: client (127.0.0.2) → proxy A outbound → HBONE mTLS → proxy B inbound
# (127.0.0.3:15008) → echo (127.0.0.3:8080) and back. Exits 0 only if the round trip worked.
#
# No redirect rules are needed: the echo service's VIP (127.0.0.50:8080) is where proxy A's
# outbound listener sits, so the client's connection reaches the proxy the way iptables/eBPF
# capture would deliver it, and the proxy maps the VIP to the echo workload.
set -euo pipefail
# DEMO_NETNS=1: the same mesh in network namespaces, in-pod mode, with redirect rules (root).
if [ "${DEMO_NETNS:-0}" = 1 ]; then exec "$(dirname "$0")/demo-netns.sh"; fi
BIN=${BIN:-target/release/mbtunnel}
BYTES=${BYTES:-1048576}
WORK=$(mktemp -d /tmp/mbtunnel-demo.XXXXXX)
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$WORK"; }
trap cleanup EXIT

mesh() {
cat <<YAML
trust_domain: cluster.local
ca_dir: $WORK/ca
key_algorithm: ${KEY_ALGORITHM:-rsa-2048}
workloads:
  - {uid: client-1, name: client, namespace: demo, service_account: client, ips: [127.0.0.2], node: node-a}
  - {uid: echo-1, name: echo, namespace: demo, service_account: echo, ips: [127.0.0.3], node: node-b}
YAML
for i in $(seq 11 18); do
  echo "  - {uid: burst-$i, name: burst-$i, namespace: demo, service_account: burst-$i, ips: [127.0.0.$i], node: node-a}"
done
cat <<YAML
services:
  - {name: echo, namespace: demo, hostname: echo.demo.svc.cluster.local, vips: [127.0.0.50], ports: [{port: 8080, target_port: 8080}], workloads: [echo-1]}
YAML
}
{ echo "node_name: node-a"; mesh; cat <<YAML
outbound_addr: 127.0.0.50:8080
inbound_addr: 127.0.0.2:15008
inbound_plaintext_addr: 127.0.0.2:15006
metrics_addr: 127.0.0.2:15020
readiness_addr: 127.0.0.2:15021
admin_addr: 127.0.0.2:15000
YAML
} > "$WORK/node-a.yaml"
{ echo "node_name: node-b"; mesh; cat <<YAML
outbound_addr: 127.0.0.3:15001
inbound_addr: 127.0.0.3:15008
inbound_plaintext_addr: 127.0.0.3:15006
metrics_addr: 127.0.0.3:15020
readiness_addr: 127.0.0.3:15021
admin_addr: 127.0.0.3:15000
YAML
} > "$WORK/node-b.yaml"

"$BIN" tool echo --listen 127.0.0.3:8080 > "$WORK/echo.log" & PIDS+=($!)
RUST_LOG=${RUST_LOG:-info} "$BIN" run --config "$WORK/node-a.yaml" > "$WORK/node-a.log" 2>&1 & PIDS+=($!)
RUST_LOG=${RUST_LOG:-info} "$BIN" run --config "$WORK/node-b.yaml" > "$WORK/node-b.log" 2>&1 & PIDS+=($!)

get() { curl -fsS --max-time 2 "$1" 2>/dev/null; }
for i in $(seq 1 100); do
  if get http://127.0.0.2:15021/healthz/ready >/dev/null && get http://127.0.0.3:15021/healthz/ready >/dev/null; then break; fi
  if [ "$i" = 100 ]; then echo "demo: proxies did not become ready"; tail -n 20 "$WORK"/node-*.log; exit 1; fi
  sleep 0.1
done

echo "== mbtunnel demo: client → proxy A (outbound) → HBONE mTLS → proxy B (inbound) → echo =="
ok=1
if ! RESULT=$("$BIN" tool send --connect 127.0.0.50:8080 --bind 127.0.0.2 --bytes "$BYTES"); then ok=0; fi
"$BIN" tool send --connect 127.0.0.50:8080 --bind 127.0.0.2 --bytes 1000 >/dev/null || ok=0
# A burst: eight client workloads (eight identities, so eight new HBONE connections) at once;
# their handshakes' signatures meet in the signers' queues and run as batches.
BURST=()
for i in $(seq 11 18); do "$BIN" tool send --connect 127.0.0.50:8080 --bind 127.0.0.$i --bytes 4096 >/dev/null & BURST+=($!); done
for p in "${BURST[@]}"; do wait "$p" || ok=0; done
sleep 0.3
MA=$(get http://127.0.0.2:15020/metrics); MB=$(get http://127.0.0.3:15020/metrics)
echo "client result:      ${RESULT:-failed}"
echo "echo server saw:    $(head -n1 "$WORK/echo.log") (source address as seen by the app)"
echo "identities:"
get http://127.0.0.2:15000/config_dump | grep -o '"identity": "[^"]*"' | sort -u | sed 's/^/  node A holds /'
get http://127.0.0.3:15000/config_dump | grep -o '"identity": "[^"]*"' | sort -u | sed 's/^/  node B holds /'
echo "signer (mbtunnel doctor):"
"$BIN" doctor | sed 's/^/  /'
echo "-- proxy A (reporter=source), the 1 MiB client --"
echo "$MA" | grep -E 'sa/client"|^mbtunnel' | grep -E '^(istio_tcp_(sent|received)_bytes_total|istio_tcp_connections_(opened|closed)_total|mbtunnel_tls_handshakes_total|mbtunnel_signer_backend_info|mbtunnel_hbone_pool_connections)' || true
echo "-- proxy B (reporter=destination), the 1 MiB client --"
echo "$MB" | grep -E 'sa/client"|^mbtunnel' | grep -E '^(istio_tcp_(sent|received)_bytes_total|istio_tcp_connections_(opened|closed)_total|mbtunnel_tls_handshakes_total)' || true
echo "-- signers (batches: _sum / _count = mean batch size) --"
for n in A B; do
  m=$MA; [ $n = B ] && m=$MB
  echo "$m" | grep -E '^mbtunnel_signer_(ops_total|batch_size_(sum|count))' | sed "s/^/proxy $n: /"
done
echo "-- access log (proxy B) --"
grep -h 'connection complete' "$WORK/node-b.log" | head -n 1 || true
echo "-- signer speed on this CPU (IFMA multi-buffer vs BoringSSL single-op, same run) --"
"$BIN" speed --seconds "${SPEED_SECONDS:-0.3}" || ok=0
# Check what the metrics prove: mutual TLS on both sides, the client's identity seen by B.
echo "$MB" | grep '^istio_tcp_connections_opened_total{reporter="destination"' \
  | grep 'source_principal="spiffe://cluster.local/ns/demo/sa/client"' \
  | grep 'destination_principal="spiffe://cluster.local/ns/demo/sa/echo"' \
  | grep -q 'connection_security_policy="mutual_tls"' || ok=0
echo "$MA" | grep -qE 'mbtunnel_tls_handshakes_total\{side="client",result="success",kind="(full|resumed)"\} [1-9]' || ok=0
if [ "$ok" = 1 ]; then echo "DEMO OK"; else echo "DEMO FAILED"; tail -n 30 "$WORK"/node-*.log; exit 1; fi
