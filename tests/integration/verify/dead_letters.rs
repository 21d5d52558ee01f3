//! Dead letters count as what they are: events consumers of their subject never saw. A row (and
//! an `outbox_message()` event without a row) stored only on the dead-letter subject is
//! `dead_lettered` with its reason, exit 1, until a routed copy is stored after it.

use super::*;

#[tokio::test]
async fn a_dead_lettered_row_and_event_are_a_difference_until_republished() {
    let mut s = Story::with_sql_file("06_outbox_message.sql").await;
    // A short duplicate window, so the republished copies are not dropped as the dead letters'.
    s.config.nats.duplicate_window_secs = 1;
    let relay = InProcessRelay::start_streaming(&s.config, &s.client).await;
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
    s.wait_for_messages(12).await;
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
    let relay = InProcessRelay::start_streaming(&s.config, &s.client).await;
    s.client
        .batch_execute(
            "WITH gone AS (DELETE FROM outbox WHERE event_id = 'bad-1' RETURNING *) \
             INSERT INTO outbox SELECT event_id, 'Claim', aggregate_id, event_type, payload, created_at, headers \
             FROM gone; \
             SELECT outbox_message('Claim', '2', 'ClaimApproved', '{}', NULL, 'm-bad');",
        )
        .await
        .unwrap();
    s.wait_for_messages(14).await;
    relay.stop().await.expect("relay stops cleanly");
    let (code, json) = s.verify(&[]).await;
    assert_eq!(code, 0, "republished: {json}");
    assert_counts(&json, &[("stream_only", 1)]);
}
