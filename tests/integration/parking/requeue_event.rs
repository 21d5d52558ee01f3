//! A dead letter's requeue (`outbox_requeue_event`, `outbox-relay requeue --event`) against the
//! real binary in `dead_letter` mode: a ClaimApproved that fails its schema is dead-lettered; after
//! the schema is fixed, `requeue --event` republishes it to `outbox.Claim` with its own id as
//! `Nats-Msg-Id` and its original headers; one still invalid becomes a new dead letter
//! (`dead-letter:<id>:<request>`) with the new reason; an unknown id is a warning and the relay
//! goes on; kill -9 right after the control message commits still gets the event there, once; and
//! with `nats.atomic_transactions = true` a request after an event of its own transaction.

use std::time::Duration;

use super::{FIXED, LIMIT, STRICT, approve, insert, stored};
use crate::support::{RelayProcess, Scenario, Stored, run_command, wait_for};

/// A text-id outbox with sql/09 installed, NATS, ClaimApproved's contract `schema`, and a
/// `dead_letter`-mode configuration whose position service `requeue` can ask.
async fn world(schema: &str) -> Scenario {
    Scenario::builder()
        .text_ids()
        .operator_role()
        .schema("ClaimApproved", schema)
        .http_listen(&crate::ops::free_addr())
        .config(|c| c.outbox.headers_column = "headers".into())
        .start()
        .await
}

fn stop(p: &mut RelayProcess, signal: &str) {
    p.signal(signal);
    assert!(p.wait(Duration::from_secs(30)).is_some(), "stopped");
}

/// Messages on `subject` whose event id is `id`.
fn on<'a>(all: &'a [Stored], subject: &str, id: &str) -> Vec<&'a Stored> {
    all.iter()
        .filter(|m| m.subject == subject && m.id() == id)
        .collect()
}

/// Emits `requeue_event` for `id` as sql/09's function does, with a request id of the test's.
async fn requeue_event(client: &tokio_postgres::Client, id: &str, request: &str) {
    let body = serde_json::json!({"op": "requeue_event", "event_id": id, "request": request});
    client
        .execute(
            "SELECT pg_logical_emit_message(true, 'outbox-relay.control', $1::text)",
            &[&body.to_string()],
        )
        .await
        .unwrap_or_else(|e| panic!("requeue_event {id}: {e}"));
}

#[tokio::test]
async fn a_dead_letter_requeued_after_the_fix_arrives_on_its_subject_with_its_own_id() {
    let s = world(STRICT).await;
    let client = &s.client;
    let mut relay = s.run_binary();
    s.wait_slot_made().await;
    let dl = s.config.nats.dead_letter_subject.clone();
    s.client
        .execute(
            "INSERT INTO public.outbox (event_id, aggregate_type, aggregate_id, event_type, payload, headers) \
             VALUES ('a-4711', 'Claim', '4711', 'ClaimApproved', '{\"claim\": \"4711\"}', '{\"tenant\": \"t1\"}')",
            &[],
        )
        .await
        .expect("insert a-4711");
    insert(
        client,
        "b-4712",
        "4712",
        "ClaimApproved",
        r#"{"claim": false}"#,
    )
    .await;
    let all = stored(&s.nats, &s.config, 2).await;
    assert_eq!(on(&all, &dl, "a-4711").len(), 1, "dead-lettered: {all:#?}");

    // An id the stream holds no dead letter of: a warning naming the LSN, and the relay goes on.
    requeue_event(client, "no-such-event", "r-0").await;
    insert(client, "c-4713", "4713", "ClaimPaid", r#"{"claim": 4713}"#).await;
    let all = stored(&s.nats, &s.config, 3).await;
    assert_eq!(on(&all, "outbox.Claim", "c-4713").len(), 1, "{all:#?}");
    assert!(relay.is_running(), "{}", relay.stderr());
    assert!(
        relay.stderr().contains("no dead letter of this event"),
        "{}",
        relay.stderr()
    );

    // The contract is fixed (a restart reads it); b-4712's payload still fails it.
    s.write_schema("ClaimApproved", FIXED);
    stop(&mut relay, "TERM");
    let mut relay = s.run_binary();
    let addr = s.config.http.listen.clone();
    wait_for("the relay's /position", LIMIT, || async {
        matches!(
            crate::ops::try_get(&addr, "/position").await,
            Some((200, _))
        )
    })
    .await;
    requeue_event(client, "b-4712", "r-b").await;
    let sent = run_command(&["requeue", "--event", "a-4711"], &s.env(), LIMIT);
    assert_eq!(
        sent.status.code(),
        Some(0),
        "{}{}",
        sent.stdout,
        sent.stderr
    );
    assert!(
        sent.stdout.starts_with("requeue event a-4711: request ")
            && sent
                .stdout
                .contains("carried out: the relay has stored through "),
        "{}\nrelay: {}",
        sent.stdout,
        relay.stderr()
    );
    let all = stored(&s.nats, &s.config, 5).await;
    let routed = on(&all, "outbox.Claim", "a-4711");
    assert_eq!(routed.len(), 1, "{all:#?}");
    let a = routed[0];
    assert_eq!(a.header("Nats-Msg-Id"), "a-4711", "its original id");
    assert_eq!(a.header("tenant"), "t1", "its original headers");
    assert_eq!(a.payload_str(), r#"{"claim": "4711"}"#);
    assert!(!a.headers.contains_key("Outbox-Error"), "{a:?}");
    let again = on(&all, &dl, "b-4712");
    assert_eq!(again.len(), 2, "a new dead letter: {all:#?}");
    assert_eq!(again[1].header("Nats-Msg-Id"), "dead-letter:b-4712:r-b");
    assert!(
        again[1].header("Outbox-Error").contains("ClaimApproved"),
        "{:?}",
        again[1]
    );
    assert!(on(&all, "outbox.Claim", "b-4712").is_empty(), "{all:#?}");
    assert!(relay.is_running(), "{}", relay.stderr());
    stop(&mut relay, "TERM");
}

#[tokio::test]
async fn kill_9_right_after_the_requeue_commits_still_republishes_the_dead_letter_once() {
    let s = world(STRICT).await;
    let client = &s.client;
    dead_lettered_then_fixed(&s, "KILL").await;
    let mut relay = s.run_binary();
    requeue_event(client, "a-4711", "r-9").await;
    stop(&mut relay, "KILL");
    let mut relay = s.run_binary();
    insert(client, "p-4711", "4711", "ClaimPaid", r#"{"claim": 4711}"#).await;
    wait_for("ClaimPaid on outbox.Claim", LIMIT, || async {
        let all = s.read_all().await;
        !on(&all, "outbox.Claim", "p-4711").is_empty()
    })
    .await;
    let all = s.read_all().await;
    assert_eq!(
        all.iter()
            .filter(|m| m.subject == "outbox.Claim")
            .map(Stored::id)
            .collect::<Vec<_>>(),
        ["a-4711", "p-4711"],
        "the requeued event once, before what was committed after it: {all:#?}"
    );
    stop(&mut relay, "TERM");
}

/// With `nats.atomic_transactions = true` (where `requeue_event` works too), a transaction that
/// writes an event and then asks for a dead letter's requeue: the relay must not wait for the
/// event's ack before its transaction's batch is committed (it never comes): both reach
/// `outbox.Claim`, the requeued one after the event, and the relay does not restart.
#[tokio::test]
async fn with_atomic_transactions_a_requeue_after_an_event_of_its_transaction_is_carried_out() {
    let s = Scenario::builder()
        .text_ids()
        .schema("ClaimApproved", STRICT)
        .config(|c| c.nats.atomic_transactions = true)
        .start()
        .await;
    let client = &s.client;
    dead_lettered_then_fixed(&s, "TERM").await;
    let mut relay = s.run_binary();
    let body = serde_json::json!({"op": "requeue_event", "event_id": "a-4711", "request": "r-a"});
    client
        .batch_execute(&format!(
            "BEGIN; \
             INSERT INTO public.outbox (event_id, aggregate_type, aggregate_id, event_type, payload) \
             VALUES ('p-4712', 'Claim', '4712', 'ClaimPaid', '{{\"claim\": 4712}}'); \
             SELECT pg_logical_emit_message(true, 'outbox-relay.control', '{body}'); \
             COMMIT"
        ))
        .await
        .expect("event and requeue_event in one transaction");
    let all = stored(&s.nats, &s.config, 3).await;
    let routed: Vec<&str> = all
        .iter()
        .filter(|m| m.subject == "outbox.Claim")
        .map(Stored::id)
        .collect();
    assert_eq!(routed, ["p-4712", "a-4711"], "{all:#?}");
    assert!(relay.is_running(), "{}", relay.stderr());
    assert!(
        !relay.stderr().contains("pipeline stopped"),
        "no restart: {}",
        relay.stderr()
    );
    stop(&mut relay, "TERM");
}

/// Runs the relay until claim 4711's approval, which breaks the schema, is a dead letter, then
/// fixes the schema and stops the relay with `signal`.
async fn dead_lettered_then_fixed(s: &Scenario, signal: &str) {
    let mut relay = s.run_binary();
    s.wait_slot_made().await;
    approve(&s.client, "4711", r#"{"claim": "4711"}"#).await;
    stored(&s.nats, &s.config, 1).await;
    s.write_schema("ClaimApproved", FIXED);
    stop(&mut relay, signal);
}
