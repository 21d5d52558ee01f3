//! Dead letters count as what they are: events consumers of their subject never saw. A row (and
//! an `outbox_message()` event without a row) stored only on the dead-letter subject is
//! `dead_lettered` with its reason, exit 1, until a routed copy is stored after it.

use super::*;

#[tokio::test]
async fn a_dead_lettered_row_and_event_are_a_difference_until_republished() {
    let s = Story::of(
        Scenario::builder()
            .text_ids()
            .sql(&sql_file("06_outbox_message.sql"))
            // A short duplicate window, so the republished copies are not dropped as the dead
            // letters'.
            .config(|c| c.nats.duplicate_window_secs = 1),
    )
    .await;
    let relay = s.relay().await;
    s.fillers(1, 5, 5).await;
    // "Bad Claim" is no subject token (whitespace): the relay dead-letters both.
    s.client
        .batch_execute(
            "INSERT INTO outbox (event_id, aggregate_type, aggregate_id, event_type, payload) \
             VALUES ('bad-1', 'Bad Claim', '1', 'ClaimApproved', '{}'); \
             SELECT outbox_message('Bad Claim', '2', 'ClaimApproved', '{}', NULL, 'm-bad');",
        )
        .await
        .unwrap();
    s.fillers(6, 5, 5).await;
    s.wait_messages(12).await;
    relay.stop().await.expect("relay stops cleanly");

    let (code, json) = s.verify(&[]).await;
    assert_eq!(code, 1, "{json}");
    // m-bad has no row: it is checked by the stream alone, and is a dead letter too.
    assert_counts(&json, &[("dead_lettered", 2), ("stream_only", 1)]);
    let examples = json["examples"]["dead_lettered"].to_string();
    for id in ["bad-1", "m-bad"] {
        assert!(examples.contains(&format!("\"{id}\"")), "{examples}");
    }
    assert!(
        examples.contains("whitespace") && examples.contains(&s.config.nats.dead_letter_subject),
        "the reason and the dead-letter subject: {examples}"
    );
    assert!(
        json["recoveries"]["dead_lettered"]
            .as_str()
            .is_some_and(|r| r.contains("docs/recovery.md#dead_lettered")),
        "{json}"
    );

    // The recovery of docs/recovery.md: the cause fixed, the row written anew and the event emitted
    // again with the same ids, once the duplicate window has passed since the dead letters.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let relay = s.relay().await;
    s.client
        .batch_execute(
            "WITH gone AS (DELETE FROM outbox WHERE event_id = 'bad-1' RETURNING *) \
             INSERT INTO outbox SELECT event_id, 'Claim', aggregate_id, event_type, payload, created_at, headers \
             FROM gone; \
             SELECT outbox_message('Claim', '2', 'ClaimApproved', '{}', NULL, 'm-bad');",
        )
        .await
        .unwrap();
    s.wait_messages(14).await;
    relay.stop().await.expect("relay stops cleanly");
    let (code, json) = s.verify(&[]).await;
    assert_eq!(code, 0, "republished: {json}");
    assert_counts(&json, &[("stream_only", 1)]);
}

/// A requeued dead letter is delivered: its event on its own subject with its original id
/// (`Nats-Msg-Id: <id>`) beside the dead letter (`Nats-Msg-Id: dead-letter:<id>`, the id in
/// `Outbox-Event-Id`). The row inserted again with the same id stores that very state (what
/// `requeue --event` stores too), at once: the dead letter's own id does not hold the event back
/// for the duplicate window (the default two minutes here).
#[tokio::test]
async fn a_requeued_dead_letter_is_delivered_not_dead_lettered_nor_a_duplicate() {
    let s = Story::new().await;
    let relay = s.relay().await;
    s.fillers(1, 3, 3).await;
    let insert = |ty: &'static str| {
        format!(
            "INSERT INTO outbox (event_id, aggregate_type, aggregate_id, event_type, payload) \
             VALUES ('bad-1', '{ty}', '1', 'ClaimApproved', '{{}}')"
        )
    };
    s.client.batch_execute(&insert("Bad Claim")).await.unwrap();
    s.wait_messages(4).await;
    let (code, json) = s.verify(&[]).await;
    assert_eq!(code, 1, "{json}");
    assert_counts(&json, &[("dead_lettered", 1)]);

    // The cause fixed, the event requeued: the row written anew with the same id.
    s.client
        .batch_execute(&format!(
            "DELETE FROM outbox WHERE event_id = 'bad-1'; {}",
            insert("Claim")
        ))
        .await
        .unwrap();
    s.wait_messages(5).await;
    relay.stop().await.expect("relay stops cleanly");
    let all = s.read_all().await;
    let ids: Vec<(&str, &str)> = all
        .iter()
        .filter(|m| m.id() == "bad-1")
        .map(|m| (m.subject.as_str(), m.header("Nats-Msg-Id")))
        .collect();
    assert_eq!(
        ids,
        [
            (
                s.config.nats.dead_letter_subject.as_str(),
                "dead-letter:bad-1"
            ),
            ("outbox.Claim", "bad-1")
        ],
        "{all:#?}"
    );
    let (code, json) = s.verify(&[]).await;
    assert_eq!(code, 0, "requeued: {json}");
    assert_counts(&json, &[]);
    assert_eq!(json["rows"], 4, "{json}");
}
