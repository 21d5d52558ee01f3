#!/usr/bin/env bash
# Checks the deployment kit in deploy/ offline: the alert rules (promtool check rules) and their unit
# tests (promtool test rules), the Kubernetes manifests, the alerts' and the dashboard's structure
# (scripts/check_deploy.py), and the systemd unit (systemd-analyze verify). A tool that is missing
# is skipped with a line saying so; scripts/install-deps.sh installs them. Whether the metric names
# used in deploy/ exist is checked against a live relay by `cargo test` (tests/integration/deploy.rs).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

if command -v promtool >/dev/null 2>&1; then
  promtool check rules deploy/prometheus/alerts.yml
  promtool test rules deploy/prometheus/alerts_test.yml
else
  echo "skipped: promtool not installed (Debian package prometheus)"
fi

if python3 -c 'import yaml' 2>/dev/null; then
  python3 scripts/check_deploy.py
else
  echo "skipped: python3 has no PyYAML (Debian python3-yaml); Kubernetes and structure checks not run"
fi

if command -v systemd-analyze >/dev/null 2>&1; then
  # verify insists that ExecStart's binary exists; point it at a stand-in, as the binary is not
  # installed on the machine that checks the unit.
  dir=$(mktemp -d)
  trap 'rm -rf "$dir"' EXIT
  printf '#!/bin/sh\n' >"$dir/outbox-relay"
  chmod +x "$dir/outbox-relay"
  sed "s#/usr/local/bin/outbox-relay#$dir/outbox-relay#" deploy/systemd/outbox-relay.service \
    >"$dir/outbox-relay.service"
  # verify prints problems and exits 0 on some of them (unknown settings are warnings): fail on any.
  out=$(systemd-analyze verify "$dir/outbox-relay.service" 2>&1) || { echo "$out" >&2; exit 1; }
  if [ -n "$out" ]; then
    echo "systemd-analyze verify: $out" >&2
    exit 1
  fi
  echo "systemd-analyze verify: deploy/systemd/outbox-relay.service is valid"
  # The daily proof of delivery: its oneshot service and timer, the same way.
  sed "s#/usr/local/bin/outbox-relay#$dir/outbox-relay#" deploy/systemd/outbox-relay-verify.service \
    >"$dir/outbox-relay-verify.service"
  cp deploy/systemd/outbox-relay-verify.timer "$dir/"
  out=$(systemd-analyze verify "$dir/outbox-relay-verify.service" "$dir/outbox-relay-verify.timer" 2>&1) \
    || { echo "$out" >&2; exit 1; }
  if [ -n "$out" ]; then
    echo "systemd-analyze verify: $out" >&2
    exit 1
  fi
  echo "systemd-analyze verify: deploy/systemd/outbox-relay-verify.service and .timer are valid"
  systemd-analyze security --offline=yes "$dir/outbox-relay.service" 2>/dev/null | tail -n 1 || true
else
  echo "skipped: systemd-analyze not installed; deploy/systemd/outbox-relay.service not verified"
fi
