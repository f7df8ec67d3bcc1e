#!/usr/bin/env bash
# Installs the system packages mbtunnel needs to build and test. Idempotent: installs only what is
# missing. The Dockerfile's build stage reads the same list (PACKAGES below) — one source of truth.
set -euo pipefail
PACKAGES="cmake clang libclang-dev linux-libc-dev pkg-config iproute2 iptables nftables curl protobuf-compiler libprotobuf-dev"
if [ "${1:-}" = "--list" ]; then echo "$PACKAGES"; exit 0; fi
missing=()
for p in $PACKAGES; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then exit 0; fi
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
echo "deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
