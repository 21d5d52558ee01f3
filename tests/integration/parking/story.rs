//! The claim 4711 story, a requeue after the fix, a discard, `max_parked_keys` reached, a key with a
//! 20,000-byte id released through sql/09 (its marker fitting an 8 KiB `max_msg_size`), and a key
//! with a line break parked again by a requeue, a requeue still invalid keeping the key's
//! parked-since time, with the relay in-process.

use super::{
    FIXED, STRICT, approve, close, control, ids_on, insert, parking_subject, stored, world,
};
use crate::support::{InProcessRelay, Scenario, wait_for};

/// claim 4711: submitted (flows), approved with a claim that breaks the schema (parks the key),
/// paid (parked behind it); claim 4712 approved properly (flows).
async fn the_story(s: &Scenario) -> InProcessRelay {
    let client = &s.client;
    let relay = s.relay().await;
    insert(
        client,
        "s-4711",
        "4711",
        "ClaimSubmitted",
        r#"{"claim": 4711}"#,
    )
    .await;
    approve(client, "4711", r#"{"claim": "4711"}"#).await;
    insert(client, "p-4711", "4711", "ClaimPaid", r#"{"claim": 4711}"#).await;
    approve(client, "4712", r#"{"claim": 4712}"#).await;
    stored(&s.nats, &s.config, 4).await;
    relay
}

#[tokio::test]
async fn an_invalid_approval_parks_its_claim_and_the_payment_waits_behind_it() {
    let s = world(STRICT).await;
    let relay = the_story(&s).await;
    let all = stored(&s.nats, &s.config, 4).await;
    let parking = parking_subject(&s.config, "4711");
    assert_eq!(
        ids_on(&all, "outbox.Claim"),
        ["s-4711", "a-4712"],
        "{all:#?}"
    );
    assert_eq!(ids_on(&all, &parking), ["a-4711", "p-4711"], "{all:#?}");
    let poison = all.iter().find(|m| m.id() == "a-4711").unwrap();
    let paid = all.iter().find(|m| m.id() == "p-4711").unwrap();
    assert_eq!(poison.header("Nats-Msg-Id"), "parked:a-4711");
    assert_eq!(paid.header("Nats-Msg-Id"), "parked:p-4711");
    for (m, n) in [(poison, "1"), (paid, "2")] {
        assert_eq!(m.header("Outbox-Parked-Behind"), "a-4711");
        assert_eq!(m.header("Outbox-Parked-Count"), n);
        assert_eq!(m.header("Outbox-Subject"), "outbox.Claim");
        assert!(
            m.header("Outbox-Error").starts_with("ClaimApproved:"),
            "the poison's reason on every copy: {m:?}"
        );
        assert!(m.header("Outbox-Parked-Since").ends_with('Z'));
    }
    assert_eq!(
        paid.payload_str(),
        r#"{"claim": 4711}"#,
        "the payload as stored"
    );
    // The slot advanced past everything: parked events are stored.
    let wal = s.wal_lsn().await;
    s.wait_confirmed("the slot confirmed past the parked events", wal)
        .await;
    let m = &relay.metrics;
    wait_for("the parking gauges", super::LIMIT, || async {
        m.parking.keys.get() == 1 && m.parking.events.get() == 2
    })
    .await;
    relay.stop().await.expect("clean stop");
}

#[tokio::test]
async fn a_requeue_after_the_fix_publishes_the_run_in_order_with_the_original_ids() {
    let s = world(STRICT).await;
    let client = &s.client;
    let relay = the_story(&s).await;
    relay.stop().await.expect("clean stop");
    // The contract is fixed; the relay starts again and reads the parked key from the stream.
    s.write_schema("ClaimApproved", FIXED);
    let relay = s.relay().await;
    insert(client, "n-4711", "4711", "ClaimNoted", r#"{"claim": 4711}"#).await;
    let all = stored(&s.nats, &s.config, 5).await;
    let parking = parking_subject(&s.config, "4711");
    assert_eq!(
        ids_on(&all, &parking),
        ["a-4711", "p-4711", "n-4711"],
        "still parked after the restart: the parked set is rebuilt from the stream"
    );
    assert_eq!(all.last().unwrap().header("Outbox-Parked-Count"), "3");
    control(client, "requeue", "4711", "r-1").await;
    close(client, "4711").await;
    let all = stored(&s.nats, &s.config, 10).await;
    assert_eq!(
        ids_on(&all, "outbox.Claim"),
        ["s-4711", "a-4712", "a-4711", "p-4711", "n-4711", "c-4711"],
        "{all:#?}"
    );
    let requeued = all
        .iter()
        .find(|m| m.subject == "outbox.Claim" && m.id() == "a-4711")
        .unwrap();
    assert_eq!(requeued.header("Nats-Msg-Id"), "a-4711", "the original id");
    assert!(!requeued.headers.contains_key("Outbox-Parked-Behind"));
    let marker = all.iter().find(|m| m.id() == "released:r-1").unwrap();
    assert_eq!(marker.subject, parking);
    assert_eq!(marker.header("Outbox-Parking"), "requeued");
    relay.stop().await.expect("clean stop");
}

#[tokio::test]
async fn a_discard_releases_the_key_without_republishing_its_run() {
    let s = world(STRICT).await;
    let client = &s.client;
    let relay = the_story(&s).await;
    control(client, "discard", "4711", "r-2").await;
    close(client, "4711").await;
    let all = stored(&s.nats, &s.config, 6).await;
    assert_eq!(
        ids_on(&all, "outbox.Claim"),
        ["s-4711", "a-4712", "c-4711"],
        "{all:#?}"
    );
    let marker = all.iter().find(|m| m.id() == "released:r-2").unwrap();
    assert_eq!(marker.header("Outbox-Parking"), "discarded");
    relay.stop().await.expect("clean stop");
}

#[tokio::test]
async fn a_requeue_of_a_key_that_is_not_parked_does_nothing() {
    let s = world(STRICT).await;
    let client = &s.client;
    let relay = the_story(&s).await;
    control(client, "requeue", "4712", "r-3").await;
    s.client
        .execute(
            "SELECT pg_logical_emit_message(true, 'outbox-relay.control', 'not json')",
            &[],
        )
        .await
        .unwrap();
    close(client, "4712").await;
    let all = stored(&s.nats, &s.config, 5).await;
    assert_eq!(
        all.len(),
        5,
        "no marker for a key that is not parked: {all:#?}"
    );
    let m = &relay.metrics;
    use outbox_relay::metrics::{ControlOp, ControlResult};
    assert_eq!(
        m.parking
            .controls(ControlOp::Requeue, ControlResult::Nothing),
        1
    );
    assert_eq!(
        m.parking
            .controls(ControlOp::Invalid, ControlResult::Ignored),
        1
    );
    relay.stop().await.expect("clean stop");
}

#[tokio::test]
async fn past_max_parked_keys_the_relay_stops_naming_the_key_and_nothing_is_lost() {
    let mut s = world(STRICT).await;
    s.config.outbox.max_parked_keys = 1;
    let client = &s.client;
    let relay = s.relay().await;
    approve(client, "4711", r#"{"claim": "x"}"#).await;
    stored(&s.nats, &s.config, 1).await;
    approve(client, "4712", r#"{"claim": "y"}"#).await;
    wait_for("the relay to stop", super::LIMIT, || async {
        relay.is_finished()
    })
    .await;
    let e = relay.stop().await.expect_err("a stop");
    let text = outbox_relay::error_chain::error_chain(&e);
    assert!(
        text.contains("Claim/4712")
            && text.contains("outbox.max_parked_keys")
            && !text.contains('\n'),
        "{text}"
    );
    // Still in the slot: the relay's slot holds it for the next start. (Comparing the confirmed
    // position with the WAL position before the insert raced keepalives, which confirm the WAL of
    // other databases of the shared server while nothing is in flight.)
    let (slot, publication) = (&s.config.postgres.slot, &s.config.postgres.publication);
    wait_for(
        "the slot to hold a-4712 (not confirmed)",
        super::LIMIT,
        || async {
            let rows = s
                .client
                .query(
                    "SELECT data FROM pg_logical_slot_peek_binary_changes($1, NULL, NULL, \
                 'proto_version', '1', 'publication_names', $2)",
                    &[slot, publication],
                )
                .await;
            // An error: the slot is still active for the stopped relay's connection a moment.
            rows.is_ok_and(|rows| {
                rows.iter().any(|r| {
                    let data: Vec<u8> = r.get(0);
                    data.windows(6).any(|w| w == b"a-4712")
                })
            })
        },
    )
    .await;
}

/// A key whose id holds a line break: a requeue while its poison is still invalid parks it again
/// on the key's own subject, and the key's next event waits behind it there (the headers hold
/// the id on one line; a copy revived from them alone would park another key and let the next
/// event through).
#[tokio::test]
async fn a_requeue_still_invalid_keeps_a_key_with_a_line_break_parked_on_its_own_subject() {
    let s = world(STRICT).await;
    let client = &s.client;
    let relay = s.relay().await;
    let claim = "47\n11";
    insert(client, "a-1", claim, "ClaimApproved", r#"{"claim": "x"}"#).await;
    stored(&s.nats, &s.config, 1).await;
    let body = serde_json::json!({"op": "requeue", "aggregate_type": "Claim",
        "aggregate_id": claim, "request": "r-nl"});
    s.client
        .execute(
            "SELECT pg_logical_emit_message(true, 'outbox-relay.control', $1::text)",
            &[&body.to_string()],
        )
        .await
        .expect("requeue");
    insert(client, "p-1", claim, "ClaimPaid", r#"{"claim": 1}"#).await;
    let all = stored(&s.nats, &s.config, 4).await;
    assert_eq!(
        ids_on(&all, &parking_subject(&s.config, claim)),
        ["a-1", "released:r-nl", "a-1", "p-1"],
        "{all:#?}"
    );
    assert!(ids_on(&all, "outbox.Claim").is_empty(), "{all:#?}");
    relay.stop().await.expect("clean stop");
}

/// A key whose id is 20,000 bytes (an outbox column holds any text) parks like any other, and
/// sql/09's `outbox_discard` releases it: the relay reads the control message the function wrote,
/// however long the key it names, and the key's next event flows.
#[tokio::test]
async fn a_key_with_a_huge_id_is_released_through_the_sql_function() {
    let s = huge_key_world().await;
    let relay = s.relay().await;
    let claim = huge_key_parked(&s).await;
    let client = &s.client;
    client
        .query_one("SELECT request FROM outbox_discard('Claim', $1)", &[&claim])
        .await
        .expect("outbox_discard");
    insert(client, "c-1", &claim, "ClaimClosed", r#"{"claim": 1}"#).await;
    wait_for("ClaimClosed on outbox.Claim", super::LIMIT, || async {
        ids_on(&s.read_all().await, "outbox.Claim") == ["c-1"]
    })
    .await;
    relay.stop().await.expect("clean stop");
}

/// The same key in a stream whose `max_msg_size` (8 KiB) its values alone pass: its parked copies
/// shrink to fit, and so does its release marker (a marker with the key's values whole was refused,
/// and the relay stopped at every start, the release never stored).
#[tokio::test]
async fn a_huge_keys_release_marker_fits_the_streams_max_msg_size() {
    let s = huge_key_world().await;
    let dl = s.config.nats.dead_letter_subject.clone();
    s.js.create_stream(async_nats::jetstream::stream::Config {
        name: s.config.nats.stream.clone(),
        subjects: vec!["outbox.>".into(), dl.clone(), format!("{dl}.parked.>")],
        max_message_size: 8192,
        ..Default::default()
    })
    .await
    .expect("a stream with an 8 KiB max_msg_size");
    let relay = s.relay().await;
    let claim = huge_key_parked(&s).await;
    let row = s
        .client
        .query_one(
            "SELECT request::text FROM outbox_discard('Claim', $1)",
            &[&claim],
        )
        .await
        .expect("outbox_discard");
    let marker = format!("released:{}", row.get::<_, String>(0));
    let parking = parking_subject(&s.config, &claim);
    wait_for("the release marker", super::LIMIT, || async {
        ids_on(&s.read_all().await, &parking).contains(&marker.as_str())
    })
    .await;
    relay.stop().await.expect("clean stop");
}

/// A park-mode world with sql/09 installed.
async fn huge_key_world() -> Scenario {
    Scenario::builder()
        .text_ids()
        .schema("ClaimApproved", STRICT)
        .park()
        .operator_role()
        .start()
        .await
}

/// Parks the key `Claim`/`4711-xxx…` (20,005 bytes) with two events; returns its id.
async fn huge_key_parked(s: &Scenario) -> String {
    let claim = format!("4711-{}", "x".repeat(20_000));
    insert(
        &s.client,
        "a-1",
        &claim,
        "ClaimApproved",
        r#"{"claim": "x"}"#,
    )
    .await;
    insert(&s.client, "p-1", &claim, "ClaimPaid", r#"{"claim": 1}"#).await;
    let all = stored(&s.nats, &s.config, 2).await;
    assert_eq!(
        ids_on(&all, &parking_subject(&s.config, &claim)),
        ["a-1", "p-1"],
        "{all:#?}"
    );
    claim
}

/// A requeue while the poison is still invalid parks the key again behind the same poison: the
/// key has been held since that event committed, not since the request. The copy parked again
/// keeps the poison's commit time as `Outbox-Parked-Since`, which `parked`, `status` and the
/// oldest-age gauge read (a failed attempt must not make a key look freshly parked).
#[tokio::test]
async fn a_requeue_still_invalid_keeps_the_keys_parked_since() {
    let s = world(STRICT).await;
    let client = &s.client;
    let relay = s.relay().await;
    approve(client, "4711", r#"{"claim": "x"}"#).await;
    let first = stored(&s.nats, &s.config, 1).await;
    let since = first[0].header("Outbox-Parked-Since").to_owned();
    assert_eq!(since, first[0].header("Outbox-Commit-Time"), "{first:#?}");
    control(client, "requeue", "4711", "r-1").await;
    let all = stored(&s.nats, &s.config, 3).await;
    let subject = parking_subject(&s.config, "4711");
    assert_eq!(
        ids_on(&all, &subject),
        ["a-4711", "released:r-1", "a-4711"],
        "{all:#?}"
    );
    assert_eq!(
        all[2].header("Outbox-Parked-Since"),
        since,
        "parked again behind the same poison: {all:#?}"
    );
    relay.stop().await.expect("clean stop");
}
