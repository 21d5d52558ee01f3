//! Outboxes without rows: a messages-only outbox (`outbox_message()`, `outbox.table = ""`) and an
//! outbox written with `outbox_emit()` (insert and delete in one transaction). verify checks what the
//! stream alone can prove (one copy per id, order, no hole), counts those events as `stream_only`,
//! and says what it could not check.

use serde_json::Value;

use super::*;

#[tokio::test]
async fn a_messages_only_outbox_runs_the_checks_that_need_no_rows_and_says_so() {
    let s = Story::of(
        Scenario::builder()
            .sql(&sql_file("06_outbox_message.sql"))
            .config(|c| {
                c.outbox.table = String::new();
                c.outbox.message_prefix = "outbox".into();
            }),
    )
    .await;
    let relay = s.relay().await;
    for claim in 4711..4716 {
        s.client
            .query_one(
                "SELECT outbox_message('Claim', $1, 'ClaimApproved', '{}')",
                &[&claim.to_string()],
            )
            .await
            .unwrap();
    }
    s.wait_messages(5).await;
    relay.stop().await.expect("relay stops cleanly");
    // The scenario's environment carries the empty table and the prefix.
    let clean = s.verify_with(&[], &[]).await;
    println!("messages only: {:?} {}", clean.status.code(), clean.stdout);
    assert_eq!(
        clean.status.code(),
        Some(0),
        "{}{}",
        clean.stdout,
        clean.stderr
    );
    let json: Value = serde_json::from_str(clean.stdout.trim()).unwrap();
    assert_eq!(json["rows"], 0, "{json}");
    assert_eq!(json["messages"], 5, "{json}");
    assert_counts(&json, &[("stream_only", 5)]);
    assert_eq!(
        json["checks"],
        serde_json::json!(["once", "order", "gap_free"]),
        "{json}"
    );
    assert!(
        json["skipped"].to_string().contains("completeness"),
        "{json}"
    );
    // The checks that ran do check: a foreign message is found without any rows.
    let mut h = HeaderMap::new();
    h.insert("Nats-Msg-Id", "f-1");
    publish(&s.js, "outbox.Claim", h, "{}").await;
    let foreign = s.verify_with(&[], &[]).await;
    assert_eq!(
        foreign.status.code(),
        Some(1),
        "{}{}",
        foreign.stdout,
        foreign.stderr
    );
    let json: Value = serde_json::from_str(foreign.stdout.trim()).unwrap();
    assert_counts(&json, &[("foreign", 1), ("stream_only", 5)]);
    assert_eq!(json["examples"]["foreign"][0]["event_id"], "f-1", "{json}");
}

#[tokio::test]
async fn an_outbox_emit_outbox_keeps_no_rows_and_its_events_are_stream_only() {
    let s = Story::of(
        Scenario::builder()
            .default_outbox()
            .sql(&sql_file("04_write_event.sql")),
    )
    .await;
    let relay = s.relay().await;
    for claim in 4711..4717 {
        s.client
            .query_one(
                "SELECT outbox_emit('Claim', $1, 'ClaimApproved', '{}')",
                &[&claim.to_string()],
            )
            .await
            .unwrap();
    }
    s.wait_messages(6).await;
    relay.stop().await.expect("relay stops cleanly");
    let (code, json) = s.verify(&[]).await;
    assert_eq!(code, 0, "{json}");
    assert_eq!(
        (json["rows"].as_u64(), json["messages"].as_u64()),
        (Some(0), Some(6)),
        "{json}"
    );
    assert_counts(&json, &[("stream_only", 6)]);
    // The checks that need no row still run: a second copy of one of them is found.
    let m = s.read_all().await.remove(2);
    let mut h = headers_of(&m, &["Nats-Msg-Id"]);
    h.insert("Outbox-Event-Id", m.id());
    publish(&s.js, &m.subject, h, m.payload_str()).await;
    let (code, json) = s.verify(&[]).await;
    assert_eq!(code, 1, "{json}");
    assert_counts(&json, &[("stream_only", 6), ("duplicates", 1)]);
}
