#!/usr/bin/env bash
# Installs the system packages mbtunnel needs to build and test. Idempotent: installs only what is
# missing. The Dockerfile's build stage reads the same list (PACKAGES below) — one source of truth.
#
#   scripts/deps.sh                    the build and test packages
#   scripts/deps.sh --list             print that list
#   scripts/deps.sh --packages "a b" [--label NAME]
#                                      the same install for another list (scripts/bench-deps.sh)
#
# Packages are installed with service starts refused (a policy-rc.d for the duration, unless one
# exists): a package whose maintainer script would start a system service (nginx, iperf3 for the
# bench) must not take ports in the root namespace.
set -euo pipefail
PACKAGES="cmake clang libclang-dev linux-libc-dev pkg-config iproute2 iptables nftables curl protobuf-compiler libprotobuf-dev"
LABEL=deps
if [ "${1:-}" = "--list" ]; then echo "$PACKAGES"; exit 0; fi
if [ "${1:-}" = "--packages" ]; then
  PACKAGES=${2:?--packages needs a list}
  [ "${3:-}" = "--label" ] && LABEL=${4:?--label needs a name}
fi
missing=()
for p in $PACKAGES; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then exit 0; fi
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
echo "$LABEL: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
POLICY=/usr/sbin/policy-rc.d
ADDED_POLICY=0
if [ ! -e "$POLICY" ]; then
  printf '#!/bin/sh\nexit 101\n' | $SUDO tee "$POLICY" >/dev/null
  $SUDO chmod 755 "$POLICY"; ADDED_POLICY=1
fi
trap '[ "$ADDED_POLICY" = 1 ] && $SUDO rm -f "$POLICY"' EXIT
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
