#!/usr/bin/env bash
# Runs the fuzz targets (fuzz/) for a bounded time, on the stable toolchain: the same libFuzzer and
# SanitizerCoverage instrumentation cargo-fuzz sets up, without the nightly-only AddressSanitizer (the
# code under test has no unsafe code; a panic is what we look for). Usage:
#   bash scripts/fuzz.sh [seconds]        (default 60, split between the targets)
# Targets: pgoutput (the decoder) and framing (the replication stream's framing, then the decoder).
# Each starts from its committed seed corpus, fuzz/corpus/<target>/ (frames captured from a real
# Postgres by `cargo run --example fuzz_corpus`), which stays read-only: what a run finds goes to
# fuzz/target/corpus/<target>/ and is kept for the next run. The targets are built where cargo builds
# (CARGO_TARGET_DIR or a config's build.target-dir if set, else fuzz/target/).
# Exit non-zero when the fuzzer finds an input that panics; the input is saved under fuzz/artifacts/.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
secs=${1:-60}
# target:max_len. The framing target reads whole streams of messages, so it gets longer inputs.
targets=(pgoutput:4096 framing:8192)
per_target=$(( secs / ${#targets[@]} ))
if [ "$per_target" -lt 1 ]; then per_target=1; fi
# Cargo's own answer, asked before RUSTFLAGS is set.
target_dir=$(bash scripts/target-dir.sh fuzz/Cargo.toml)

export RUSTFLAGS="--cfg fuzzing -Cdebug-assertions -Coverflow-checks -Cpasses=sancov-module \
-Cllvm-args=-sanitizer-coverage-level=4 -Cllvm-args=-sanitizer-coverage-inline-8bit-counters \
-Cllvm-args=-sanitizer-coverage-pc-table -Cllvm-args=-sanitizer-coverage-trace-compares"
# An explicit --target keeps RUSTFLAGS off build scripts and proc macros (as cargo-fuzz does): they
# run on the host and must not be instrumented.
host=$(rustc -vV | sed -n 's/^host: //p')
echo "building the fuzz targets ($target_dir/$host)"
cargo build --quiet --release --manifest-path fuzz/Cargo.toml --bins --target "$host"

for entry in "${targets[@]}"; do
  name=${entry%%:*}
  max_len=${entry##*:}
  seeds=fuzz/corpus/$name
  work=fuzz/target/corpus/$name
  mkdir -p "$seeds" "$work" "fuzz/artifacts/$name"
  echo "fuzzing $name for ${per_target}s ($(find "$seeds" -type f | wc -l) seeds)"
  log=fuzz/artifacts/$name/last-run.log
  status=0
  # libFuzzer adds new inputs to the first corpus directory only.
  "$target_dir/$host/release/$name" -max_total_time="$per_target" -max_len="$max_len" \
    -print_final_stats=1 -artifact_prefix="fuzz/artifacts/$name/" "$work" "$seeds" >"$log" 2>&1 \
    || status=$?
  grep -E '^(#[0-9]+ +(INITED|DONE)|stat::number_of_executed_units|SUMMARY|thread .* panicked)' "$log" \
    || true
  if [ "$status" -ne 0 ]; then
    tail -n 30 "$log" >&2
    echo "fuzz: $name failed on an input (exit $status); see fuzz/artifacts/$name/" >&2
    exit "$status"
  fi
done
echo "fuzz: no crash in ${secs}s"
