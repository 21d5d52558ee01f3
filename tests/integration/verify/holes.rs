//! Every sequence of the relay's range is accounted for: a message gone where the stream's limits
//! cannot explain it is a hole, whether or not a row maps to it; the head of the stream is
//! `older_than_stream` only when the stream's limits removed it.

use async_nats::jetstream::stream::DiscardPolicy;

use super::*;

#[tokio::test]
async fn messages_deleted_with_and_without_a_row_are_holes() {
    let s = Story::with_sql_file("06_outbox_message.sql").await;
    let relay = s.relay().await;
    s.fillers(1, 5, 5).await;
    s.client
        .query_one(
            "SELECT outbox_message('Claim', '4711', 'ClaimApproved', '{}', NULL, 'm-1')",
            &[],
        )
        .await
        .unwrap();
    s.fillers(6, 5, 5).await;
    s.wait_messages(11).await;
    relay.stop().await.expect("relay stops cleanly");
    let (row_seq, message_seq) = (s.seq_of("e-3").await, s.seq_of("m-1").await);
    let stream = s.stream().await;
    for seq in [row_seq, message_seq] {
        assert!(stream.delete_message(seq).await.unwrap());
    }
    let (code, json) = s.verify(&[]).await;
    assert_eq!(code, 1, "{json}");
    // e-3's row is missing; m-1 had none, and only its sequence tells it is gone.
    assert_counts(&json, &[("holes", 2), ("missing", 1)]);
    assert_eq!(json["examples"]["missing"][0]["event_id"], "e-3", "{json}");
    let holes: Vec<u64> = json["examples"]["holes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|h| h["sequence"].as_u64().unwrap())
        .collect();
    assert_eq!(holes, vec![row_seq, message_seq], "{json}");
    assert!(
        json["checks"].to_string().contains("gap_free"),
        "holes are what gap_free checks: {json}"
    );
}

#[tokio::test]
async fn a_head_deleted_under_setups_default_limits_is_missing_not_older_than_the_stream() {
    let s = Story::published(10, 10).await;
    // setup's stream: discard new, no max_age. Nothing in it removes the first messages.
    s.stream().await.purge().sequence(3).await.unwrap();
    let (code, json) = s.verify(&[]).await;
    assert_eq!(code, 1, "{json}");
    assert_counts(&json, &[("missing", 2), ("holes", 2)]);
    assert_eq!(json["examples"]["missing"][0]["event_id"], "e-1", "{json}");
    assert_eq!(json["examples"]["holes"][0]["sequence"], 1, "{json}");
    assert_eq!(json["first_sequence"], 3, "{json}");
}

#[tokio::test]
async fn a_head_trimmed_by_max_msgs_with_discard_old_is_older_than_the_stream() {
    let s = Story::published(10, 10).await;
    let js = &s.js;
    let mut cfg = s.stream().await.info().await.unwrap().config.clone();
    cfg.discard = DiscardPolicy::Old;
    cfg.max_messages = 15;
    js.update_stream(cfg).await.unwrap();
    let first = s.stream().await.info().await.unwrap().state.first_sequence;
    assert_eq!(first, 7, "the server trims to the new limit");
    let (code, json) = s.verify(&[]).await;
    assert_eq!(code, 0, "the stream's limits explain its start: {json}");
    assert_exactly(&json, "older_than_stream", 6, "e-1");
    assert!(
        json["skipped"]
            .to_string()
            .contains("max_msgs 15 with discard old"),
        "{json}"
    );
}
