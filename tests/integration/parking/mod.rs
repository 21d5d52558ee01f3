//! Parking a key (`outbox.on_invalid = "park"`) against real Postgres and nats-server: the claim
//! 4711 story (an approval that fails its schema parks the claim; its payment waits behind it on
//! the parking subject, never on `outbox.Claim`, while claim 4712 flows), a requeue through the WAL
//! after the schema is fixed, a discard, kill -9 while parked and right after the release commits,
//! a standby taking over while keys are parked, and `max_parked_keys` reached; a dead letter's
//! requeue in `dead_letter` mode (`requeue_event.rs`); the parked set rebuilt across many read
//! pages (`rebuild.rs`); a key parked longer than the stream's `max_age` (`aged.rs`). Shared preamble
//! here; the stories in `story.rs`, the crashes and the takeover in `crash.rs`, `setup` adding the
//! parking subjects to an older stream in `setup.rs`, what `status` and `verify` say of a
//! parked key in `ops.rs`.

mod aged;
mod cloudevents;
mod crash;
mod marks;
mod ops;
mod read_page;
mod rebuild;
mod requeue_event;
mod setup;
mod story;

use std::time::Duration;

use outbox_relay::config::Config;
use outbox_relay::parking::{KeyHash, parked_subject};
use tokio_postgres::Client;

use crate::support::{NatsServer, RelayProcess, Scenario, Stored, read_all};
use crate::support::{stream_count, wait_for};

pub(super) const LIMIT: Duration = Duration::from_secs(60);

/// ClaimApproved's contract: `claim` an integer.
pub(super) const STRICT: &str = r#"{"type": "object", "required": ["claim"],
    "properties": {"claim": {"type": "integer"}}}"#;
/// The fixed contract: `claim` an integer or a string of digits.
pub(super) const FIXED: &str = r#"{"type": "object", "required": ["claim"],
    "properties": {"claim": {"type": ["integer", "string"]}}}"#;

/// A database with a text-id outbox, a NATS server, a schema directory with `schema` as
/// ClaimApproved's, and a park-mode configuration for them.
pub(super) async fn world(schema: &str) -> Scenario {
    Scenario::builder()
        .text_ids()
        .schema("ClaimApproved", schema)
        .park()
        .start()
        .await
}

/// Inserts event `id` of claim `claim`.
pub(super) async fn insert(
    client: &Client,
    id: &str,
    claim: &str,
    event_type: &str,
    payload: &str,
) {
    client
        .execute(
            "INSERT INTO public.outbox (event_id, aggregate_type, aggregate_id, event_type, payload) \
             VALUES ($1, 'Claim', $2, $3, $4::text::jsonb)",
            &[&id, &claim, &event_type, &payload],
        )
        .await
        .unwrap_or_else(|e| panic!("insert {id}: {e}"));
}

/// Inserts claim `claim`'s approval, event `a-<claim>` with `payload`.
pub(super) async fn approve(client: &Client, claim: &str, payload: &str) {
    let id = format!("a-{claim}");
    insert(client, &id, claim, "ClaimApproved", payload).await;
}

/// Inserts claim `claim`'s closing, event `c-<claim>`, valid under every contract.
pub(super) async fn close(client: &Client, claim: &str) {
    let (id, payload) = (format!("c-{claim}"), format!(r#"{{"claim": {claim}}}"#));
    insert(client, &id, claim, "ClaimClosed", &payload).await;
}

/// The binary's `run` for `s`, reading 8 deliveries a page (the test-only
/// `OUTBOX_RELAY_TEST_READ_PAGE`), so that a parked set of a few dozen keys takes many pages.
pub(super) fn run_paged(s: &Scenario) -> RelayProcess {
    let mut env = s.env();
    env.push(("OUTBOX_RELAY_TEST_READ_PAGE".into(), "8".into()));
    RelayProcess::spawn(&["run"], &env)
}

/// Emits a control message as sql/09's functions do.
pub(super) async fn control(client: &Client, op: &str, claim: &str, request: &str) {
    let body = format!(
        r#"{{"op": "{op}", "aggregate_type": "Claim", "aggregate_id": "{claim}", "request": "{request}"}}"#
    );
    client
        .execute(
            "SELECT pg_logical_emit_message(true, 'outbox-relay.control', $1::text)",
            &[&body],
        )
        .await
        .unwrap_or_else(|e| panic!("control {op}: {e}"));
}

/// The parking subject of claim `claim`.
pub(super) fn parking_subject(config: &Config, claim: &str) -> String {
    parked_subject(
        &config.nats.dead_letter_subject,
        KeyHash::of(Some("Claim"), Some(claim)),
    )
}

/// Waits for `n` messages in the stream, then reads them all.
pub(super) async fn stored(nats: &NatsServer, config: &Config, n: u64) -> Vec<Stored> {
    let js = nats.jetstream().await;
    let stream = &config.nats.stream;
    wait_for(&format!("{n} messages in {stream}"), LIMIT, || async {
        stream_count(&js, stream).await >= n
    })
    .await;
    read_all(&js, stream).await
}

/// The event ids on `subject`, in stream order.
pub(super) fn ids_on<'a>(all: &'a [Stored], subject: &str) -> Vec<&'a str> {
    all.iter()
        .filter(|m| m.subject == subject)
        .map(|m| m.id())
        .collect()
}
