#!/usr/bin/env bash
# Builds the fuzz targets in fuzz/ and runs each for SECONDS (default 60), one after the other.
#   scripts/fuzz.sh [SECONDS] [TARGET...]      (all targets when none is named)
# `make fuzz` runs it with FUZZ_SECONDS, `make fuzz-smoke` for a few seconds per target.
#
# - cargo-fuzz is installed by scripts/fuzz-deps.sh; it needs nightly-only flags
#   (-Zsanitizer=address), which the stable toolchain accepts with RUSTC_BOOTSTRAP=1.
# - The build goes to FUZZ_TARGET_DIR (default fuzz/target), never to ../target: sanitizer and
#   coverage flags would otherwise make every later release build start from scratch (BoringSSL
#   included). The first build of fuzz/ builds BoringSSL once more there.
# - Corpora: fuzz/corpus/TARGET (grows, git-ignored) plus the committed seeds in fuzz/seeds/TARGET.
#   A crash leaves its input in fuzz/artifacts/TARGET/ and makes this script fail; replay it
#   with `RUSTC_BOOTSTRAP=1 cargo fuzz run TARGET fuzz/artifacts/TARGET/crash-…` in fuzz/.
# - Prints one line per target: seconds, executions, corpus size, result.
set -euo pipefail
cd "$(dirname "$0")/.."
SECONDS_PER_TARGET=${1:-60}
shift || true
CARGO=${CARGO:-cargo}
export RUSTC_BOOTSTRAP=1
export CARGO_TARGET_DIR=${FUZZ_TARGET_DIR:-$PWD/fuzz/target}
./scripts/deps.sh
CARGO="$CARGO" ./scripts/fuzz-deps.sh

cd fuzz
"$CARGO" fmt -- --check
if [ $# -eq 0 ]; then set -- $("$CARGO" fuzz list); fi
start=$(date +%s)
"$CARGO" fuzz build --release --debug-assertions
echo "fuzz: built ${*} in $(( $(date +%s) - start )) s"

summary=()
failed=0
for t in "$@"; do
  mkdir -p "corpus/$t"
  seeds=()
  if [ -d "seeds/$t" ]; then seeds=("seeds/$t"); fi
  log=$(mktemp)
  t0=$(date +%s)
  if "$CARGO" fuzz run --release --debug-assertions "$t" "corpus/$t" "${seeds[@]}" -- \
      -max_total_time="$SECONDS_PER_TARGET" -rss_limit_mb=2048 -print_final_stats=1 >"$log" 2>&1; then
    result=ok
  else
    result=FAILED
    failed=1
    grep -E "panicked|ERROR|SUMMARY|Test unit written|artifact" "$log" | head -20 || true
  fi
  runs=$(grep -oE "stat::number_of_executed_units: *[0-9]+" "$log" | grep -oE "[0-9]+$" | tail -1)
  units=$(ls "corpus/$t" | wc -l)
  summary+=("$(printf '%-16s %5ss %12s execs %6s corpus  %s' "$t" "$(( $(date +%s) - t0 ))" "${runs:-?}" "$units" "$result")")
  rm -f "$log"
done
printf '%s\n' "fuzz summary (${SECONDS_PER_TARGET} s per target):" "${summary[@]}"
exit $failed
