#!/usr/bin/env bash
# Runs the pgoutput decoder's fuzz target (fuzz/) for a bounded time, on the stable toolchain: the
# same libFuzzer and SanitizerCoverage instrumentation cargo-fuzz sets up, without the nightly-only
# AddressSanitizer (the decoder has no unsafe code; a panic is what we look for). Usage:
#   bash scripts/fuzz.sh [seconds]        (default 60)
# Exit non-zero when the fuzzer finds an input that panics; the input is saved under fuzz/artifacts/.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
secs=${1:-60}

export RUSTFLAGS="--cfg fuzzing -Cdebug-assertions -Coverflow-checks -Cpasses=sancov-module \
-Cllvm-args=-sanitizer-coverage-level=4 -Cllvm-args=-sanitizer-coverage-inline-8bit-counters \
-Cllvm-args=-sanitizer-coverage-pc-table -Cllvm-args=-sanitizer-coverage-trace-compares"
# An explicit --target keeps RUSTFLAGS off build scripts and proc macros (as cargo-fuzz does): they
# run on the host and must not be instrumented.
host=$(rustc -vV | sed -n 's/^host: //p')
echo "building the fuzz target (fuzz/target/$host)"
cargo build --quiet --release --manifest-path fuzz/Cargo.toml --bin pgoutput --target "$host"

mkdir -p fuzz/corpus/pgoutput fuzz/artifacts/pgoutput
echo "fuzzing the pgoutput decoder for ${secs}s"
log=fuzz/artifacts/pgoutput/last-run.log
status=0
"fuzz/target/$host/release/pgoutput" -max_total_time="$secs" -max_len=4096 -print_final_stats=1 \
  -artifact_prefix=fuzz/artifacts/pgoutput/ fuzz/corpus/pgoutput >"$log" 2>&1 || status=$?
grep -E '^(#[0-9]+ +DONE|stat::number_of_executed_units|SUMMARY|thread .* panicked)' "$log" || true
if [ "$status" -ne 0 ]; then
  tail -n 30 "$log" >&2
  echo "fuzz: the decoder failed on an input (exit $status); see fuzz/artifacts/pgoutput/" >&2
  exit "$status"
fi
echo "fuzz: no crash in ${secs}s"
