#!/usr/bin/env bash
# Installs the system packages the data-plane bench (benches/dataplane.sh, `make bench-dataplane`)
# needs, and nothing else: `make test` and `make demo` never call this. Idempotent, through
# scripts/deps.sh (which refuses service starts during the install: the bench runs nginx and
# iperf3 itself, in its namespaces). Debian package names:
#   iperf3        one- and four-stream throughput
#   wrk           max req/s (keep-alive) and connection-per-request runs
#   hey           the fixed-rate run (`hey -q`, 16 connections)
#   nginx         the 1 KB body behind the server side
#   openssl       `openssl s_time -new` handshakes, and the bench's client leaf
#   python3       the bench's table arithmetic
#   procps, iproute2, iptables, curl   namespaces, capture, readiness
set -euo pipefail
PACKAGES="iperf3 wrk hey nginx openssl python3 procps iproute2 iptables curl"
if [ "${1:-}" = "--list" ]; then echo "$PACKAGES"; exit 0; fi
exec "$(dirname "$0")/deps.sh" --packages "$PACKAGES" --label bench-deps
