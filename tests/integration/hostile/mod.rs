//! P11 under attack (docs/guarantees.md#p11-hostile-input): what a hostile or broken world does
//! to the relay, against
//! real servers. `nats` covers the connection (credentials in the URL or as keys, refused
//! credentials, TLS on a private CA and mutual TLS, websocket URLs); `rows` the events no schema
//! forbids (a 5,000-character aggregate type, 70 KB headers, ids reused in live traffic); `limits`
//! what the relay must survive without growing (a frozen NATS under a backlog of 1 MB events, a full
//! stream, an HTTP client that never finishes its request); `secrets` that no output ever holds a
//! password or token; `answers` the answers another client plants on the relay's inbox; `account` the
//! position service asked to answer into other streams of its NATS account; `waits` floods of
//! read-your-writes waits (bytes, and the listener's room for probes); `labels` metric labels made of
//! event types; `exposure` the ports docker-compose.yml publishes. Each hostile input is followed by a normal event that must arrive.

mod account;
mod answers;
mod exposure;
mod labels;
mod limits;
mod nats;
mod rows;
mod secrets;
mod waits;

use std::time::{Duration, Instant};

use async_nats::jetstream;
use outbox_relay::config::Config;
use tokio_postgres::Client;

pub(crate) use crate::support::http_get;
use crate::support::{
    Finished, InProcessRelay, PgServer, Stored, TEXT_ID_OUTBOX_SQL, TestDb, read_all, stream_count,
    wait_for,
};

pub(crate) const LIMIT: Duration = Duration::from_secs(60);

/// A database with the text-id outbox table (which has a `headers jsonb` column).
pub(crate) async fn text_id_db() -> TestDb {
    let db = TestDb::create(PgServer::shared()).await;
    db.psql(TEXT_ID_OUTBOX_SQL);
    db
}

/// Inserts one event in its own transaction.
pub(crate) async fn insert(
    client: &Client,
    id: &str,
    aggregate_type: &str,
    aggregate_id: &str,
    headers: Option<&str>,
) {
    client
        .execute(
            "INSERT INTO public.outbox (event_id, aggregate_type, aggregate_id, event_type, payload, headers) \
             VALUES ($1, $2, $3, 'ClaimApproved', '{\"claim_id\": 4711}', $4::text::jsonb)",
            &[&id, &aggregate_type, &aggregate_id, &headers],
        )
        .await
        .unwrap_or_else(|e| panic!("insert {id}: {e}"));
}

/// A normal event: aggregate type `Claim`, routed to `outbox.Claim`.
pub(crate) async fn good(client: &Client, id: &str) {
    insert(client, id, "Claim", "4711", None).await;
}

/// Waits (up to `LIMIT`) until `stream` holds at least `n` messages, then reads them all.
pub(crate) async fn messages(js: &jetstream::Context, stream: &str, n: usize) -> Vec<Stored> {
    wait_for(&format!("{n} messages in {stream}"), LIMIT, || async {
        stream_count(js, stream).await >= n as u64
    })
    .await;
    read_all(js, stream).await
}

/// Starts an in-process relay and waits until it streams (panics with its result if it ends).
pub(crate) async fn start_streaming(config: &Config) -> InProcessRelay {
    let relay = InProcessRelay::start(config.clone());
    wait_for("the relay to stream", LIMIT, || async {
        relay.metrics.streaming.get() == 1 || relay.is_finished()
    })
    .await;
    if relay.is_finished() {
        panic!("the relay stopped: {:?}", relay.stop().await);
    }
    relay
}

/// Waits until the slot's confirmed position reaches `lsn` (the WAL position after the last insert):
/// the relay has gone past everything before it.
pub(crate) async fn wait_slot_past(client: &Client, slot: &str, lsn: outbox_relay::Lsn) {
    wait_for(
        &format!("slot {slot} confirmed past {lsn}"),
        LIMIT,
        || async {
            crate::support::confirmed_flush(client, slot)
                .await
                .is_some_and(|c| c >= lsn)
        },
    )
    .await;
}

/// Replaces (or adds) one variable.
pub(crate) fn set(env: &mut Vec<(String, String)>, key: &str, value: &str) {
    env.retain(|(k, _)| k != key);
    env.push((key.into(), value.into()));
}

/// Panics if any of `secrets` appears in stdout or stderr, plainly or percent-encoded.
pub(crate) fn assert_no_secret(what: &str, f: &Finished, secrets: &[&str]) {
    for secret in secrets {
        let encoded = percent_encode(secret);
        for (stream, text) in [("stdout", &f.stdout), ("stderr", &f.stderr)] {
            assert!(
                !text.contains(secret) && !text.contains(&encoded),
                "{what}: {stream} shows the secret {secret}:\n{text}"
            );
        }
    }
}

/// Every byte that is not unreserved as `%XX` (RFC 3986), for credentials in URLs.
pub(crate) fn percent_encode(s: &str) -> String {
    s.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

/// The value of one series in a Prometheus text body.
pub(crate) fn metric(body: &str, series: &str) -> Option<f64> {
    body.lines().find_map(|l| {
        l.strip_prefix(series)
            .and_then(|rest| rest.strip_prefix(' '))
            .and_then(|v| v.trim().parse().ok())
    })
}

/// Waits until `GET path` answers `want`.
pub(crate) async fn wait_http(addr: &str, path: &str, want: u16) {
    let deadline = Instant::now() + LIMIT;
    loop {
        if http_get(addr, path).await.is_some_and(|(s, _)| s == want) {
            return;
        }
        assert!(Instant::now() < deadline, "{path} never answered {want}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A field of `/proc/<pid>/status` in kB (`VmRSS`, `VmHWM`).
pub(crate) fn proc_kb(pid: u32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_else(|e| panic!("read /proc/{pid}/status: {e}"));
    status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or_else(|| panic!("no {field} in /proc/{pid}/status"))
}

/// Waits until a relay streams from `slot`: the slot is active and has a confirmed position. Not
/// just "exists" or "active": a slot shows in `pg_replication_slots`, active for the backend that
/// creates it, before it reaches its consistent point, and a row committed before that point is not
/// in it. `confirmed_flush_lsn` is set once that point is found.
pub(crate) async fn wait_for_active_slot(client: &Client, slot: &str) {
    wait_for("the relay's slot to be active", LIMIT, || async {
        client
            .query_opt(
                "SELECT 1 FROM pg_replication_slots \
                  WHERE slot_name = $1 AND active AND confirmed_flush_lsn IS NOT NULL",
                &[&slot],
            )
            .await
            .expect("query pg_replication_slots")
            .is_some()
    })
    .await;
}
