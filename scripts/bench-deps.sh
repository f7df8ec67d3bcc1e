#!/usr/bin/env bash
# Installs the system packages the data-plane bench (benches/dataplane.sh, `make bench-dataplane`)
# needs, and nothing else: `make test` and `make demo` never call this. Idempotent: installs only
# what is missing. Debian package names:
#   iperf3        one- and four-stream throughput
#   wrk           max req/s (keep-alive) and connection-per-request runs
#   hey           the fixed-rate run (`hey -q`, 16 connections)
#   nginx         the 1 KB body behind the server side (run by the bench in its namespace, never
#                 as a system service: the install is done with service starts refused)
#   openssl       `openssl s_time -new` handshakes, and the bench's client leaf
#   python3       the bench's table arithmetic
#   procps, iproute2, iptables, curl   namespaces, capture, readiness
set -euo pipefail
PACKAGES="iperf3 wrk hey nginx openssl python3 procps iproute2 iptables curl"
if [ "${1:-}" = "--list" ]; then echo "$PACKAGES"; exit 0; fi
missing=()
for p in $PACKAGES; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then exit 0; fi
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
echo "bench-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
# nginx's and iperf3's maintainer scripts would start system services (port 80, 5201) in the
# root namespace; the bench starts its own in network namespaces. Refuse service starts for the
# install unless a policy already exists (as in most containers).
POLICY=/usr/sbin/policy-rc.d
ADDED_POLICY=0
if [ ! -e "$POLICY" ]; then
  printf '#!/bin/sh\nexit 101\n' | $SUDO tee "$POLICY" >/dev/null
  $SUDO chmod 755 "$POLICY"; ADDED_POLICY=1
fi
trap '[ "$ADDED_POLICY" = 1 ] && $SUDO rm -f "$POLICY"' EXIT
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
