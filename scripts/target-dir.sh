#!/usr/bin/env bash
# Prints the directory cargo builds into for a manifest (default: the repository's Cargo.toml), as
# cargo itself answers it: CARGO_TARGET_DIR, build.target-dir in a cargo config, or the workspace's
# target/. The scripts that run what cargo built (demo.sh, fuzz.sh) look for it there. Usage:
#   bash scripts/target-dir.sh [path/to/Cargo.toml]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
manifest=${1:-Cargo.toml}
# --no-deps: no dependency is resolved or fetched; the answer is one JSON field, read without jq.
dir=$(cargo metadata --format-version 1 --no-deps --manifest-path "$manifest" \
  | sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')
if [ -z "$dir" ]; then
  echo "target-dir: cargo metadata for $manifest named no target_directory" >&2
  exit 1
fi
printf '%s\n' "$dir"
