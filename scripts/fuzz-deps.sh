#!/usr/bin/env bash
# Installs cargo-fuzz, the cargo front end to libFuzzer, when the pinned version is missing.
# Idempotent: does nothing when `cargo fuzz --version` already reports it. Kept apart from
# scripts/deps.sh because only the fuzz targets need it, and it is a cargo tool, not an apt package.
set -euo pipefail
VERSION=0.13.2
CARGO=${CARGO:-cargo}
if "$CARGO" fuzz --version 2>/dev/null | grep -q "cargo-fuzz $VERSION"; then exit 0; fi
echo "fuzz-deps: installing cargo-fuzz $VERSION"
"$CARGO" install --locked --version "$VERSION" cargo-fuzz
