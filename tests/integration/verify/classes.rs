//! The differences of `verify`'s first round, each planted by hand, and a clean stream of 100,000
//! events: each must be reported exactly, with its exit code.

use serde_json::Value;

use super::*;

#[tokio::test]
async fn a_clean_stream_of_100_000_events_reports_nothing() {
    let s = Story::published(5000, 95_000).await;
    // A row without a usable id (the relay would publish it under a WAL-derived id) is not compared,
    // and the report says so.
    s.client
        .batch_execute(
            "INSERT INTO outbox (event_id, aggregate_type, aggregate_id, event_type, payload) \
             VALUES ('', 'Claim', '1', 'ClaimSubmitted', '{}')",
        )
        .await
        .unwrap();
    let (code, json) = s.verify(&["--payloads"]).await;
    assert_eq!(code, 0, "{json}");
    assert_eq!(json["rows"], 100_001, "{json}");
    assert_eq!(json["messages"], 100_001, "{json}");
    for c in CLASSES {
        assert_eq!(json[c], 0, "{c} in {json}");
        if c != "in_flight" {
            assert_eq!(json["examples"][c], Value::Array(vec![]), "{c} in {json}");
        }
    }
    assert!(json["proven_up_to"]["lsn"].is_string(), "{json}");
    let checks = json["checks"].to_string();
    for c in [
        "completeness",
        "waiting",
        "once",
        "order",
        "gap_free",
        "routing",
        "payloads",
    ] {
        assert!(checks.contains(c), "{c} in {checks}");
    }
    assert!(
        json["skipped"]
            .to_string()
            .contains("1 rows without a usable event id"),
        "{json}"
    );
}

#[tokio::test]
async fn a_message_deleted_from_the_stream_is_missing_and_its_sequence_a_hole() {
    let s = Story::published(10, 10).await;
    let seq = s
        .read_all()
        .await
        .iter()
        .find(|m| m.id() == "e-5531")
        .expect("e-5531 stored")
        .seq;
    let stream = s.stream().await;
    assert!(stream.delete_message(seq).await.unwrap());
    let (code, json) = s.verify(&[]).await;
    assert_eq!(code, 1, "{json}");
    assert_counts(&json, &[("missing", 1), ("holes", 1)]);
    assert_eq!(json["examples"]["missing"][0]["event_id"], "e-5531");
    assert!(json["examples"]["missing"][0].get("sequence").is_none());
    assert_eq!(json["examples"]["holes"][0]["sequence"], seq, "{json}");
    assert_eq!(json["rows"], 21);
    assert_eq!(json["messages"], 20);
    // --where and --since choose the rows: without e-5531, or only rows newer than it, no row
    // differs; the hole stays, whatever rows are chosen.
    let (code, json) = s.verify(&["--where", "event_id <> 'e-5531'"]).await;
    assert_eq!((code, json["rows"].as_u64()), (1, Some(20)), "{json}");
    assert_counts(&json, &[("holes", 1)]);
    let (code, json) = s.verify(&["--since", "2999-01-01 00:00+00"]).await;
    assert_eq!((code, json["rows"].as_u64()), (1, Some(0)), "{json}");
    assert_counts(&json, &[("holes", 1)]);
}

#[tokio::test]
async fn a_duplicate_published_by_another_client_is_a_duplicate_not_a_break_of_order() {
    let s = Story::published(10, 10).await;
    let messages = s.read_all().await;
    let original = messages.iter().find(|m| m.id() == "e-5531").unwrap();
    // Another client republishes e-5531 as it is, without Nats-Msg-Id (which JetStream would
    // deduplicate within its window) but with the event id consumers deduplicate on.
    let mut h = headers_of(original, &["Nats-Msg-Id"]);
    h.insert("Outbox-Event-Id", "e-5531");
    let copy = publish(&s.js, &original.subject, h, original.payload_str()).await;
    let (code, json) = s.verify(&[]).await;
    assert_eq!(code, 1, "{json}");
    assert_exactly(&json, "duplicates", 1, "e-5531");
    assert_eq!(
        json["examples"]["duplicates"][0]["sequence"], copy,
        "{json}"
    );
}

#[tokio::test]
async fn a_pair_stored_out_of_order_by_another_client_is_one_break() {
    let s = Story::published(10, 10).await;
    let messages = s.read_all().await;
    let last = messages.last().unwrap();
    let position = last.header("Outbox-Position");
    let (history, place) = position.rsplit_once('/').unwrap();
    let (lsn_lo, _) = place.split_once(':').unwrap();
    let lo = u64::from_str_radix(lsn_lo, 16).unwrap();
    // x-2's position is after x-1's, and it is stored first.
    for (id, offset) in [("x-2", 0x200u64), ("x-1", 0x100)] {
        let mut h = headers_of(last, &["Nats-Msg-Id", "Outbox-Position"]);
        h.insert("Nats-Msg-Id", id);
        h.insert(
            "Outbox-Position",
            format!("{history}/{:X}:0", lo + offset).as_str(),
        );
        publish(&s.js, "outbox.Claim", h, "{}").await;
    }
    let (code, json) = s.verify(&[]).await;
    assert_eq!(code, 1, "{json}");
    // x-1 and x-2 have no row: the stream alone checks them.
    assert_counts(&json, &[("out_of_order", 1), ("stream_only", 2)]);
    assert_eq!(json["examples"]["out_of_order"][0]["event_id"], "x-1");
    assert_eq!(
        json["examples"]["out_of_order"][0]["sequence"], 23,
        "{json}"
    );
}

#[tokio::test]
async fn a_foreign_message_is_foreign() {
    let s = Story::published(10, 10).await;
    let mut h = HeaderMap::new();
    h.insert("Nats-Msg-Id", "f-1");
    let seq = publish(&s.js, "outbox.Claim", h, r#"{"not": "the relay's"}"#).await;
    let (code, json) = s.verify(&[]).await;
    assert_eq!(code, 1, "{json}");
    assert_exactly(&json, "foreign", 1, "f-1");
    assert_eq!(json["examples"]["foreign"][0]["sequence"], seq, "{json}");
}

#[tokio::test]
async fn a_row_inserted_before_the_slot_existed_is_missing() {
    let s = Story::new().await;
    // Written before the relay created its slot: the slot starts after it, so it is never sent.
    s.e5531().await;
    let relay = s.relay().await;
    s.fillers(1, 20, 10).await;
    s.wait_messages(20).await;
    relay.stop().await.expect("relay stops cleanly");
    let (code, json) = s.verify(&[]).await;
    assert_eq!(code, 1, "{json}");
    assert_exactly(&json, "missing", 1, "e-5531");
    assert_eq!(json["rows"], 21);

    // The recovery docs/recovery.md gives: the row written anew while the relay runs.
    let relay = s.relay().await;
    s.client
        .batch_execute(
            "WITH gone AS (DELETE FROM public.outbox WHERE event_id IN ('e-5531') RETURNING *) \
             INSERT INTO public.outbox SELECT * FROM gone",
        )
        .await
        .unwrap();
    s.wait_messages(21).await;
    relay.stop().await.expect("relay stops cleanly");
    let (code, json) = s.verify(&["--payloads"]).await;
    assert_eq!(code, 0, "after the recovery: {json}");
}

#[tokio::test]
async fn a_payload_changed_in_flight_differs_with_payloads_only() {
    let s = Story::new().await;
    let relay = s.relay().await;
    s.fillers(1, 10, 5).await;
    s.wait_messages(10).await;
    relay.stop().await.expect("relay stops cleanly");
    // The row is committed while the relay is stopped; a hand-made message carries it on, with
    // the relay's headers and the next position, but another amount.
    s.e5531().await;
    let messages = s.read_all().await;
    let last = messages.last().unwrap();
    let (history, place) = last.header("Outbox-Position").rsplit_once('/').unwrap();
    let (lsn_lo, _) = place.split_once(':').unwrap();
    let lo = u64::from_str_radix(lsn_lo, 16).unwrap();
    let mut h = headers_of(last, &["Nats-Msg-Id", "Outbox-Position"]);
    h.insert("Nats-Msg-Id", "e-5531");
    h.insert(
        "Outbox-Position",
        format!("{history}/{:X}:0", lo + 0x100).as_str(),
    );
    let stored: String = s
        .client
        .query_one(
            "SELECT payload::text FROM outbox WHERE event_id = 'e-5531'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let changed = stored.replace("125000", "1");
    assert_ne!(stored, changed);
    let seq = publish(&s.js, "outbox.Claim", h, &changed).await;

    let (code, json) = s.verify(&["--payloads"]).await;
    assert_eq!(code, 1, "{json}");
    assert_exactly(&json, "payload_differs", 1, "e-5531");
    assert_eq!(
        json["examples"]["payload_differs"][0]["sequence"], seq,
        "{json}"
    );
    // Without --payloads the bodies are not compared, and the report says so.
    let (code, json) = s.verify(&[]).await;
    assert_eq!(code, 0, "{json}");
    assert!(json["skipped"].to_string().contains("payloads"), "{json}");
}

#[tokio::test]
async fn a_message_on_another_subject_than_the_template_gives_is_misrouted() {
    let s = Story::new().await;
    let relay = s.relay().await;
    s.fillers(1, 10, 5).await;
    s.wait_messages(10).await;
    relay.stop().await.expect("relay stops cleanly");
    // e-5531 is committed while the relay is stopped and carried on by hand to outbox.Other.
    s.e5531().await;
    let messages = s.read_all().await;
    let last = messages.last().unwrap();
    let (history, place) = last.header("Outbox-Position").rsplit_once('/').unwrap();
    let lo = u64::from_str_radix(place.split_once(':').unwrap().0, 16).unwrap();
    let mut h = headers_of(last, &["Nats-Msg-Id", "Outbox-Position"]);
    h.insert("Nats-Msg-Id", "e-5531");
    h.insert(
        "Outbox-Position",
        format!("{history}/{:X}:0", lo + 0x100).as_str(),
    );
    let seq = publish(&s.js, "outbox.Other", h, STORY_PAYLOAD).await;
    let (code, json) = s.verify(&[]).await;
    assert_eq!(code, 1, "{json}");
    assert_exactly(&json, "misrouted", 1, "e-5531");
    assert_eq!(json["examples"]["misrouted"][0]["sequence"], seq, "{json}");
    let detail = json["examples"]["misrouted"][0]["detail"].to_string();
    assert!(
        detail.contains("outbox.Other") && detail.contains("outbox.Claim"),
        "{detail}"
    );
}

#[tokio::test]
async fn what_cannot_be_checked_exits_2_with_one_line_naming_it() {
    let s = Story::published(1, 0).await;
    let no_stream = s
        .verify_with(&[], &[("OUTBOX_RELAY_NATS_STREAM", "NO_SUCH_STREAM")])
        .await;
    println!(
        "no stream: {:?} {}",
        no_stream.status.code(),
        no_stream.stderr
    );
    assert_eq!(no_stream.status.code(), Some(2), "{}", no_stream.stderr);
    assert!(
        no_stream
            .stderr
            .contains("stream NO_SUCH_STREAM (nats.stream)"),
        "{}",
        no_stream.stderr
    );
    assert_eq!(
        no_stream.stderr.trim().lines().count(),
        1,
        "{}",
        no_stream.stderr
    );

    let bad_where = s.verify_with(&["--where", "no_such_column = 1"], &[]).await;
    println!(
        "bad --where: {:?} {}",
        bad_where.status.code(),
        bad_where.stderr
    );
    assert_eq!(bad_where.status.code(), Some(2), "{}", bad_where.stderr);
    assert!(bad_where.stderr.contains("--where"), "{}", bad_where.stderr);

    let bad_config = s
        .verify_with(&[], &[("OUTBOX_RELAY_NATS_MAX_IN_FLIGHT", "many")])
        .await;
    println!(
        "bad config: {:?} {}",
        bad_config.status.code(),
        bad_config.stderr
    );
    assert_eq!(bad_config.status.code(), Some(2), "{}", bad_config.stderr);
}

#[tokio::test]
async fn the_relays_documented_nats_user_can_verify() {
    // The scenario's environment carries the relay's user, its password and its inbox prefix to
    // setup and verify.
    let s = Story::of(crate::permissions::documented(
        Scenario::builder().text_ids(),
    ))
    .await;
    let setup = {
        let vars = s.env();
        tokio::task::spawn_blocking(move || run_command(&["setup"], &vars, Duration::from_secs(60)))
            .await
            .unwrap()
    };
    assert!(setup.status.success(), "setup: {}", setup.stderr);
    let relay = s.relay().await;
    s.fillers(1, 50, 10).await;
    s.e5531().await;
    // (Confirmed means stored; this NATS admits only the documented users, not the test's client.)
    s.wait_all_confirmed().await;
    // While the relay runs (its slot active): the look into the slot copies it, never takes it.
    let done = s.verify_with(&["--payloads"], &[]).await;
    relay.stop().await.expect("relay stops cleanly");
    println!(
        "verify as the relay's user: {:?}\n{}\n{}",
        done.status.code(),
        done.stdout,
        done.stderr
    );
    assert_eq!(
        done.status.code(),
        Some(0),
        "{}{}",
        done.stdout,
        done.stderr
    );
    let json: Value = serde_json::from_str(done.stdout.trim()).unwrap();
    assert_eq!(json["messages"], 51, "{json}");
}
