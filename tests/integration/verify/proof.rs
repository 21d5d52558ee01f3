//! Retention gated on proof: `verify --record` stores `proven_up_to` in the outbox table's proof
//! table, and `outbox_prune(..., proven_only => true)` (sql/05_retention.sql) deletes only the rows
//! at or below it: never the dead-lettered row, the waiting one, or anything after them.

use super::*;

/// Rows `ids` created `age` ago (one transaction).
async fn rows_created(s: &Story, ids: std::ops::Range<u32>, aggregate_type: &str, age: &str) {
    s.client
        .batch_execute(&format!(
            "INSERT INTO outbox (event_id, aggregate_type, aggregate_id, event_type, payload, created_at) \
             SELECT 'e-' || g, '{aggregate_type}', g::text, 'ClaimApproved', '{{}}', now() - interval '{age}' \
             FROM generate_series({}, {}) g",
            ids.start,
            ids.end - 1
        ))
        .await
        .unwrap();
}

async fn remaining(s: &Story) -> Vec<String> {
    s.client
        .query(
            "SELECT event_id FROM outbox ORDER BY created_at, event_id",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect()
}

#[tokio::test]
async fn record_then_a_proof_gated_prune_keeps_the_dead_letter_the_waiting_row_and_all_after() {
    let s = Story::with_sql_file("05_retention.sql").await;
    let relay = s.relay().await;
    rows_created(&s, 1..11, "Claim", "3 days").await;
    // A dead letter ("Bad Claim" is no subject token), then more rows after it.
    rows_created(&s, 50..51, "Bad Claim", "2 days").await;
    rows_created(&s, 20..30, "Claim", "1 day").await;
    s.wait_messages(21).await;
    relay.stop().await.expect("relay stops cleanly");
    // Written while the relay is stopped: waiting in the slot.
    rows_created(&s, 60..61, "Claim", "2 hours").await;

    let (code, json) = s.verify(&["--record"]).await;
    assert_eq!(code, 1, "the dead letter is a difference: {json}");
    assert_counts(&json, &[("dead_lettered", 1), ("waiting", 1)]);
    let proven = &json["proven_up_to"];
    assert!(proven["lsn"].is_string(), "{json}");
    let stored: String = s
        .client
        .query_one(
            "SELECT to_char(proven_created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"') \
             FROM outbox_proof",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(proven["created_at"], stored.as_str(), "{json}");

    // Everything may go by age (keep 0): the proof alone keeps the rest.
    s.db.psql("CALL outbox_prune(interval '0 seconds', 3, proven_only => true);");
    let left = remaining(&s).await;
    let mut want = vec!["e-50".to_owned()];
    want.extend((20..30).map(|i| format!("e-{i}")));
    want.push("e-60".to_owned());
    assert_eq!(left, want, "only e-1..e-10, proven, were deleted");

    // Without a proof, a proven-only prune deletes nothing.
    s.db.psql(
        "DELETE FROM outbox_proof; CALL outbox_prune(interval '0 seconds', proven_only => true);",
    );
    assert_eq!(remaining(&s).await.len(), 12);
}

#[tokio::test]
async fn a_row_whose_transaction_was_open_while_verify_read_is_never_pruned_by_its_proof() {
    let s = Story::with_sql_file("05_retention.sql").await;
    s.relay_publishes(1..11).await;
    // A transaction that began before verify read the rows and commits after it, with a creation
    // time long before the proof: verify never saw its row.
    let late = s.db.client().await;
    late.batch_execute(
        "BEGIN; INSERT INTO outbox (event_id, aggregate_type, aggregate_id, event_type, payload, created_at) \
         VALUES ('late-1', 'Claim', '1', 'ClaimApproved', '{}', now() - interval '3 days')",
    )
    .await
    .unwrap();
    let (code, json) = s.verify(&["--record"]).await;
    assert_eq!(code, 0, "{json}");
    late.batch_execute("COMMIT").await.unwrap();
    s.db.psql("CALL outbox_prune(interval '0 seconds', proven_only => true);");
    assert_eq!(remaining(&s).await, vec!["late-1".to_owned()]);
}
