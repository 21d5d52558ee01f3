#!/usr/bin/env bash
# The demo (the README's first command): the outbox story end to end on local servers.
#
# The claims service approves claim 4711 and records event e-5531 in the same transaction; the relay
# publishes it to outbox.Claim; the payment service pays. Then the messaging platform goes down, more
# claims are approved, the relay retries and keeps its place; when NATS returns every event arrives, in
# commit order (and `verify` during the outage says those events wait in the slot, none is missing). The
# payment service "crashes" before acknowledging one event, gets it redelivered, recognises it by its id
# and pays once. Then a bad event parks its key (outbox.on_invalid = "park"): claim 4717's approval fails
# a schema that still has the old approval limit, so it and the claim's ClaimPaid are held on the key's
# parking subject while other claims flow; the payment service pays nothing for 4717 until the schema is
# fixed and `outbox-relay requeue --key Claim/4717` releases both, in order.
#
# Starts its own Postgres (wal_level=logical) and nats-server (JetStream) on free loopback ports in a
# temporary directory, installing them first if missing, and removes everything when it ends.
#
# It builds the relay and the demo's payment service first (cargo build, debug, where cargo builds:
# CARGO_TARGET_DIR or a config's build.target-dir if set, else target/). With
# OUTBOX_RELAY_BIN=/path/to/outbox-relay it runs that binary instead and builds only the payment service.
set -euo pipefail

# A prebuilt relay, resolved before the cd below. Not left in the environment: the relay reads
# OUTBOX_RELAY_* variables as settings.
PREBUILT=""
if [ -n "${OUTBOX_RELAY_BIN:-}" ]; then
  PREBUILT=$(realpath -m "$OUTBOX_RELAY_BIN")
  [ -x "$PREBUILT" ] || { echo "demo: OUTBOX_RELAY_BIN=$OUTBOX_RELAY_BIN is not an executable file" >&2; exit 1; }
fi
unset OUTBOX_RELAY_BIN
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$(pwd)

say() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
note() { printf '   %s\n' "$*"; }

bash scripts/install-deps.sh >/dev/null
TARGET_DIR=$(bash scripts/target-dir.sh)

if [ -n "$PREBUILT" ]; then
  say "Building the demo's payment service (the relay: $PREBUILT)"
  cargo build --quiet --example payment_service
  RELAY=$PREBUILT
else
  say "Building outbox-relay and the demo's payment service"
  cargo build --quiet --bin outbox-relay --example payment_service
  RELAY="$TARGET_DIR/debug/outbox-relay"
fi
PAYMENT="$TARGET_DIR/debug/examples/payment_service"

WORK=$(mktemp -d /tmp/outbox-relay-demo.XXXXXX)
chmod 755 "$WORK"
PIDS=()
cleanup() {
  set +e
  for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null; done
  sleep 0.5
  if [ -f "$WORK/pg/postmaster.pid" ]; then kill -INT "$(head -n 1 "$WORK/pg/postmaster.pid")" 2>/dev/null; fi
  for pid in "${PIDS[@]}"; do kill -KILL "$pid" 2>/dev/null; done
  sleep 0.5
  rm -rf "$WORK"
}
trap cleanup EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# --- Postgres -----------------------------------------------------------------------------------
PG_BIN=${PG_BIN:-$(dirname "$(ls -d /usr/lib/postgresql/*/bin/initdb | sort -V | tail -n 1)")}
PG_PORT=$(free_port)
as_pg() { if [ "$(id -u)" -eq 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi; }
mkdir -p "$WORK/pg"
[ "$(id -u)" -eq 0 ] && chown postgres "$WORK/pg"
as_pg "$PG_BIN/initdb" -D "$WORK/pg" -U postgres --auth=trust -E UTF8 --locale=C >/dev/null
as_pg "$PG_BIN/postgres" -D "$WORK/pg" -c listen_addresses=127.0.0.1 -c port="$PG_PORT" \
  -c unix_socket_directories="$WORK/pg" -c wal_level=logical -c max_replication_slots=10 \
  -c max_wal_senders=10 >"$WORK/postgres.log" 2>&1 &
PIDS+=($!)
PG_URL="postgres://postgres@127.0.0.1:$PG_PORT/claims"
psql_() { psql -X -q -v ON_ERROR_STOP=1 -h 127.0.0.1 -p "$PG_PORT" -U postgres "$@"; }
for _ in $(seq 1 100); do psql_ -d postgres -c 'select 1' >/dev/null 2>&1 && break; sleep 0.1; done
psql_ -d postgres -c 'CREATE DATABASE claims' -c 'CREATE DATABASE payments'

# --- NATS ---------------------------------------------------------------------------------------
NATS_PORT=$(free_port)
start_nats() {
  nats-server -js -a 127.0.0.1 -p "$NATS_PORT" -sd "$WORK/nats" >>"$WORK/nats.log" 2>&1 &
  NATS_PID=$!
  PIDS+=("$NATS_PID")
  for _ in $(seq 1 100); do (echo >"/dev/tcp/127.0.0.1/$NATS_PORT") 2>/dev/null && break; sleep 0.1; done
}
start_nats
NATS_URL="nats://127.0.0.1:$NATS_PORT"
note "Postgres on 127.0.0.1:$PG_PORT (wal_level=logical), nats-server with JetStream on 127.0.0.1:$NATS_PORT"

# --- The claims service's schema ----------------------------------------------------------------
say "The claims service's database: claims and the outbox table"
# Text event ids, so the story's ids (e-5531) can be used as they are; the default table uses uuid.
psql_ -d claims <<'SQL'
CREATE TABLE claims (claim_id bigint PRIMARY KEY, status text NOT NULL, amount numeric NOT NULL);
INSERT INTO claims SELECT i, 'submitted', 1000 + i - 4711 + 250 FROM generate_series(4711, 4716) i;
CREATE TABLE public.outbox (
    event_id text PRIMARY KEY,
    aggregate_type text NOT NULL,
    aggregate_id text NOT NULL,
    event_type text NOT NULL,
    payload jsonb NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);
SQL
note "claims 4711..4716 submitted; table public.outbox ready"

export OUTBOX_RELAY_POSTGRES_URL="$PG_URL"
export OUTBOX_RELAY_NATS_URL="$NATS_URL"
export OUTBOX_RELAY_HTTP_LISTEN=""

say "outbox-relay setup"
"$RELAY" setup | sed 's/^/   /'

say "Starting the relay and the payment service"
"$RELAY" run >"$WORK/relay.log" 2>&1 &
RELAY_PID=$!
PIDS+=("$RELAY_PID")
"$PAYMENT" --postgres "postgres://postgres@127.0.0.1:$PG_PORT/payments" --nats "$NATS_URL" \
  --skip-ack-once e-5531 &
PIDS+=($!)
sleep 1.5

approve() { # claim_id event_id
  psql_ -d claims <<SQL
BEGIN;
UPDATE claims SET status = 'approved' WHERE claim_id = $1;
INSERT INTO outbox (event_id, aggregate_type, aggregate_id, event_type, payload)
SELECT '$2', 'Claim', '$1', 'ClaimApproved',
       jsonb_build_object('claim_id', claim_id, 'status', 'approved', 'amount', amount)
FROM claims WHERE claim_id = $1;
COMMIT;
SQL
  note "claims service: approved claim $1 and recorded event $2 in the same transaction"
}

payments() { psql_ -d payments -Atc "SELECT count(*) FROM payments" 2>/dev/null || echo 0; }
wait_payments() { # n timeout_s
  for _ in $(seq 1 $(($2 * 10))); do [ "$(payments)" -ge "$1" ] && return 0; sleep 0.1; done
  echo "demo: expected $1 payments, have $(payments); relay log:" >&2
  tail -n 20 "$WORK/relay.log" >&2
  return 1
}

say "Claim 4711 is approved"
approve 4711 e-5531
wait_payments 1 20
sleep 3 # the payment service skipped the ack of e-5531: JetStream redelivers it after 2 s

say "The messaging platform goes down"
kill -TERM "$NATS_PID"
wait "$NATS_PID" 2>/dev/null || true
note "nats-server stopped"
for i in 2 3 4 5; do approve $((4710 + i)) "e-553$i"; done
sleep 2
note "relay status while NATS is down (the slot stays before the unacknowledged events):"
"$RELAY" status 2>&1 | grep -E '^slot|cannot connect' | sed 's/^/     /' || true
note "verify while NATS is down: the stream cannot be read, but the slot shows the four events waiting, not missing"
VERIFY_DOWN=$("$RELAY" verify 2>/dev/null || true) # exit 2: not everything could be checked
echo "$VERIFY_DOWN" | grep -vE '^  (what to do|not checked)' | sed 's/^/     /'
if ! echo "$VERIFY_DOWN" | grep -qx 'waiting: 4' || echo "$VERIFY_DOWN" | grep -q '^missing:'; then
  echo "demo: verify during the outage should report 4 events waiting and none missing" >&2
  exit 1
fi
sleep 2

say "NATS is back"
start_nats
note "nats-server started again; the relay republishes from the slot's confirmed position"
wait_payments 5 60
approve 4716 e-5536
wait_payments 6 20
sleep 1

say "Result"
"$RELAY" status | sed 's/^/   /'
note "proof of delivery: the outbox table's rows against the stream (exit 0: once and in order)"
"$RELAY" verify --payloads | sed 's/^/     /' # pipefail: a difference (exit 1) ends the demo
note "payments made: $(payments) for 6 approved claims"
psql_ -d payments -c "SELECT event_id, claim_id, amount FROM payments ORDER BY event_id"
note "relay log:"
grep -vE 'async_nats' "$WORK/relay.log" | sed 's/\x1b\[[0-9;]*m//g; s/^/     /' | tail -n 12

kill -TERM "$RELAY_PID"
wait "$RELAY_PID" && note "relay stopped cleanly (exit 0) after confirming everything"
[ "$(payments)" -eq 6 ]
say "Every approved claim was paid once, including the redelivered e-5531"

# --- A poison event parks its key, not the stream -------------------------------------------------
say "A bad event parks its key: outbox.on_invalid = \"park\""
# The approval schema still says the old limit of 10,000; the claims team raised it to 50,000.
mkdir -p "$WORK/schemas"
schema() { # maximum
  cat >"$WORK/schemas/ClaimApproved.json" <<JSON
{"\$schema": "https://json-schema.org/draft/2020-12/schema", "type": "object",
 "required": ["claim_id", "amount"],
 "properties": {"claim_id": {"type": "integer"}, "amount": {"type": "number", "maximum": $1}}}
JSON
}
schema 10000
psql_ -d claims -f "$ROOT/sql/09_requeue.sql" >/dev/null
note "sql/09_requeue.sql installed: outbox_requeue(), outbox_discard(), outbox_requeue_event()"
export OUTBOX_RELAY_OUTBOX_ON_INVALID=park
export OUTBOX_RELAY_OUTBOX_SCHEMAS="$WORK/schemas"
export OUTBOX_RELAY_HTTP_LISTEN="127.0.0.1:$(free_port)"
"$RELAY" setup | sed 's/^/   /' # adds the parking subjects to the stream
"$RELAY" run >>"$WORK/relay.log" 2>&1 &
RELAY_PID=$!
PIDS+=("$RELAY_PID")
sleep 1.5

psql_ -d claims -c "INSERT INTO claims VALUES (4717, 'submitted', 25000), (4718, 'submitted', 1500)"
approve 4717 e-5537
psql_ -d claims <<'SQL'
INSERT INTO outbox (event_id, aggregate_type, aggregate_id, event_type, payload)
VALUES ('e-5538', 'Claim', '4717', 'ClaimPaid', '{"claim_id": 4717, "status": "paid"}');
SQL
note "claims service: recorded e-5538 ClaimPaid for claim 4717 (its approval, e-5537, fails the old schema)"
approve 4718 e-5539 # another key flows as usual
sleep 2
note "outbox-relay parked (exit 1: a key is parked):"
"$RELAY" parked | sed 's/^/     /' || true
note "payments made: $(payments): the payment service has seen neither 4717's approval nor its ClaimPaid"
[ "$(payments)" -eq 7 ] || { echo "demo: only e-5539 should have been paid" >&2; exit 1; }

say "The schema is fixed, and the key requeued"
schema 50000
kill -HUP "$RELAY_PID"
sleep 1
note "schema ClaimApproved.json: maximum 50000, reloaded with SIGHUP"
"$RELAY" requeue --key Claim/4717 | sed 's/^/   /'
wait_payments 8 30
note "outbox-relay parked after the requeue:"
"$RELAY" parked | sed 's/^/     /'
note "payments made: $(payments): claim 4717 paid once its approval arrived, ClaimPaid after it"
psql_ -d payments -c "SELECT event_id, claim_id, amount FROM payments WHERE claim_id = 4717"

kill -TERM "$RELAY_PID"
wait "$RELAY_PID" && note "relay stopped cleanly (exit 0)"
say "Done: every approved claim was paid once, and claim 4717's events arrived in their order after the fix"
