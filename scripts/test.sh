#!/usr/bin/env bash
# The test command (README, CI): installs missing dependencies, checks formatting and lints, validates
# docker-compose.yml and deploy/ (scripts/check-deploy.sh), runs every test (unit and integration,
# against real Postgres and NATS), and then fails if any server the tests started is still running.
# Non-zero on any failure. cargo test compiles the crate and its tests first; with
# OUTBOX_RELAY_BIN=/path/to/outbox-relay, the tests that run the binary run that one (RELAY_TEST_BIN).
set -euo pipefail

# Resolved before the cd below, and not left in the environment, where OUTBOX_RELAY_* are settings.
if [ -n "${OUTBOX_RELAY_BIN:-}" ]; then
  RELAY_TEST_BIN=$(realpath -m "$OUTBOX_RELAY_BIN")
  [ -x "$RELAY_TEST_BIN" ] || { echo "test.sh: OUTBOX_RELAY_BIN=$OUTBOX_RELAY_BIN is not an executable file" >&2; exit 1; }
  export RELAY_TEST_BIN
  echo "the tests that run the binary run $RELAY_TEST_BIN"
fi
unset OUTBOX_RELAY_BIN
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

# (Not OUTBOX_RELAY_*: that prefix is the relay's configuration; a variable there that names no
# setting is ignored, with a warning when it looks like a misspelt key.)
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

# The version matrix: the checks of the test environment (roles, TLS), the replication source and the
# relay against each Postgres install-deps put under $PG_MATRIX_ROOT (the run above used the default,
# Debian's 15), and the high-availability fixture on 17 and 18, which have failover slots.
PG_MATRIX_ROOT=${PG_MATRIX_ROOT:-/opt}
for major in 16 17 18; do
  bin="$PG_MATRIX_ROOT/outbox-relay-pg$major/native/bin"
  if [ ! -x "$bin/postgres" ]; then
    step "Postgres $major matrix: skipped (not installed)"
    continue
  fi
  step "cargo test against Postgres $major (smoke:: source:: relay::)"
  version_start=$SECONDS
  PG_BIN="$bin" cargo test --test main --no-fail-fast -- smoke:: source:: relay:: || test_status=$?
  # A run of its own: its six servers starting at once on a 2-core machine have pushed a relay test
  # past its 30 s wait (seen on 18).
  if [ "$major" -ge 17 ]; then
    step "cargo test against Postgres $major (ha::)"
    PG_BIN="$bin" cargo test --test main --no-fail-fast -- ha:: || test_status=$?
  fi
  echo "Postgres $major: $((SECONDS - version_start)) s"
done

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
