#!/usr/bin/env bash
# Runs every cargo fuzz target (or the ones named) for a bounded time each and
# writes one line of figures per target to target/fuzz-report.txt.
#
#   fuzz/run.sh [--seconds N] [--quick] [target ...]
#
# --seconds N: time per target (default 600, the 10 minutes RELIABILITY.md
# reports); --quick: 20 s per target (CI). Exits non-zero if any target
# crashes; the input is kept in fuzz/artifacts/<target>/ — make it a file
# of fuzz/regressions/<target>/ once fixed (tests/corpus.rs replays those).
#
# cargo fuzz needs nightly-only rustc flags (sanitizers, coverage passes);
# the pinned stable toolchain accepts them with RUSTC_BOOTSTRAP=1, which is
# set for this build only. The release profile's LTO is turned off for it:
# fat LTO drops the coverage counters' symbols (undefined __sancov_gen_).
set -euo pipefail
cd "$(dirname "$0")/.."

seconds=600
targets=()
while [ $# -gt 0 ]; do
  case "$1" in
    --seconds) seconds=$2; shift 2 ;;
    --quick) seconds=20; shift ;;
    -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
    -*) echo "fuzz/run.sh: unknown option $1" >&2; exit 64 ;;
    *) targets+=("$1"); shift ;;
  esac
done
[ ${#targets[@]} -gt 0 ] || targets=(record_codec request_validation config_parser)

fuzz_root="${XDG_CACHE_HOME:-$HOME/.cache}/dedupd-ci/cargo-fuzz"
if [ "$("$fuzz_root/bin/cargo-fuzz" --version 2>/dev/null)" != "cargo-fuzz 0.13.2" ]; then
  cargo install --quiet --locked cargo-fuzz@0.13.2 --root "$fuzz_root"
fi
fuzz() {
  CARGO_PROFILE_RELEASE_LTO=false RUSTC_BOOTSTRAP=1 "$fuzz_root/bin/cargo-fuzz" "$@"
}
fuzz build --features libfuzzer --debug-assertions
bin=target/x86_64-unknown-linux-gnu/release

report=target/fuzz-report.txt
: > "$report"
failed=0
for target in "${targets[@]}"; do
  corpus=target/fuzz-corpus/$target
  "$bin/write_seeds" "$target" "$corpus"
  log=target/fuzz-$target.log
  echo "fuzzing $target for ${seconds}s (log: $log)"
  started=$(date +%s)
  status=0
  fuzz run --features libfuzzer --debug-assertions "$target" "$corpus" -- \
    -max_total_time="$seconds" -rss_limit_mb=2048 -timeout=10 -print_final_stats=1 \
    > "$log" 2>&1 || status=$?
  elapsed=$(( $(date +%s) - started ))
  runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  coverage=$(grep -o 'cov: [0-9]*' "$log" | tail -1 | cut -d' ' -f2)
  features=$(grep -o 'ft: [0-9]*' "$log" | tail -1 | cut -d' ' -f2)
  corpus_size=$(find "$corpus" -type f | wc -l)
  if [ "$status" = 0 ]; then crashes=0; else crashes=1; failed=1; fi
  line="$target: ${elapsed}s, ${runs:-?} inputs, coverage ${coverage:-?} edges / ${features:-?} features, corpus $corpus_size, crashes $crashes"
  echo "$line" | tee -a "$report"
  if [ "$status" != 0 ]; then
    echo "  $target failed (exit $status); its input is in fuzz/artifacts/$target/:" >&2
    grep -E "panicked|ERROR|SUMMARY|Test unit written" "$log" | head -5 >&2 || true
  fi
done
exit "$failed"
