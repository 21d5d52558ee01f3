//! Rows no schema forbids, in live traffic: a 5,000-character aggregate type (once a publish the
//! server answered by closing the connection, so no ack ever came and the relay restarted forever),
//! a 70 KB aggregate id and a 70 KB value in the headers column (over JetStream's 64 KB header
//! limit: the dead letter itself must be shrunk), and event ids reused while the fence is on (once a
//! session restart per duplicate). Each is followed by normal events that must arrive in order, and
//! the slot must move past all of it, with no restart.

use std::time::Duration;

use super::{LIMIT, good, insert, messages, start_streaming, text_id_db, wait_slot_past};
use crate::support::{
    NatsServer, Stored, current_wal_lsn, read_all, relay_config, stream_count, wait_for,
};

const DEAD_LETTER: &str = "outbox_dead_letter";

fn assert_dead_letter(m: &Stored, id: &str) {
    assert_eq!(m.subject, DEAD_LETTER, "{id}: {:?}", m.headers);
    assert_eq!(m.id(), id);
    assert!(!m.header("Outbox-Error").contains('\n'));
    assert!(m.header("Outbox-Error").len() <= 1024, "{:?}", m.headers);
}

fn assert_delivered(m: &Stored, id: &str) {
    assert_eq!(m.subject, "outbox.Claim", "{id}: {:?}", m.headers);
    assert_eq!(m.id(), id);
}

/// A 5,000-character aggregate type, a 70 KB aggregate id and a 70 KB header value each end as a
/// dead letter with the reason (the length; the stream's header refusal), shrunk where they must be
/// (the cut header named in `Outbox-Truncated-Headers`, the dropped payload's size in
/// `Outbox-Payload-Size`); the normal event after each arrives, the slot passes them all, and the
/// relay never restarts.
#[tokio::test]
async fn oversized_columns_and_headers_are_dead_lettered_and_the_relay_goes_on() {
    let db = text_id_db().await;
    let nats = NatsServer::start();
    let mut config = relay_config(&db, &nats);
    config.outbox.headers_column = "headers".into();
    let client = db.client().await;
    let js = nats.jetstream().await;
    let relay = start_streaming(&config).await;

    let long_type = "A".repeat(5000);
    insert(&client, "h-type", &long_type, "4711", None).await;
    good(&client, "g-1").await;
    let long_id = "i".repeat(70 * 1024);
    insert(&client, "h-aggid", "Claim", &long_id, None).await;
    good(&client, "g-2").await;
    let big_header = format!(
        r#"{{"traceparent": "00-1-2-01", "big": "{}"}}"#,
        "v".repeat(70 * 1024)
    );
    insert(&client, "h-header", "Claim", "4711", Some(&big_header)).await;
    good(&client, "g-3").await;
    let after = current_wal_lsn(&client).await;

    let all = messages(&js, &config.nats.stream, 6).await;
    assert_eq!(
        all.len(),
        6,
        "{:#?}",
        all.iter()
            .map(|m| (m.subject.clone(), m.id().to_owned()))
            .collect::<Vec<_>>()
    );

    // The long aggregate type: the reason names the length and the limit; the row fits otherwise,
    // so payload and headers are kept.
    let m = &all[0];
    assert_dead_letter(m, "h-type");
    let error = m.header("Outbox-Error");
    assert!(
        error.contains("5000 bytes") && error.contains("256"),
        "{error}"
    );
    assert_eq!(m.payload_str(), r#"{"claim_id": 4711}"#);
    assert!(
        !m.headers.contains_key("Outbox-Payload-Size"),
        "{:?}",
        m.headers.keys()
    );
    assert_delivered(&all[1], "g-1");

    // The 70 KB aggregate id: the stream refuses the headers, the dead letter is shrunk.
    let m = &all[2];
    assert_dead_letter(m, "h-aggid");
    let error = m.header("Outbox-Error").to_lowercase();
    assert!(error.contains("header"), "names the headers: {error}");
    assert!(
        m.header("Outbox-Truncated-Headers")
            .contains("Outbox-Aggregate-Id"),
        "{:?}",
        m.headers.get("Outbox-Truncated-Headers")
    );
    assert!(m.header("Outbox-Aggregate-Id").len() <= 1024);
    assert!(m.header("Outbox-Aggregate-Id").starts_with("iiii"));
    assert_eq!(
        m.header("Outbox-Payload-Size"),
        r#"{"claim_id": 4711}"#.len().to_string()
    );
    assert!(m.payload.is_empty());
    assert_eq!(m.header("Outbox-Subject"), "outbox.Claim");
    assert_delivered(&all[3], "g-2");

    // The 70 KB header value: cut and named; the small header is kept as it was.
    let m = &all[4];
    assert_dead_letter(m, "h-header");
    assert!(
        m.header("Outbox-Truncated-Headers").contains("big"),
        "{:?}",
        m.headers
    );
    assert!(m.header("big").len() <= 1024);
    assert_eq!(m.header("traceparent"), "00-1-2-01");
    assert!(m.headers.contains_key("Outbox-Payload-Size"));
    assert_delivered(&all[5], "g-3");

    wait_slot_past(&client, &config.postgres.slot, after).await;
    assert_eq!(relay.metrics.dead_letters.get(), 3);
    // BUG (see `a_row_the_stream_refuses_costs_no_restart`): each row the stream refuses while the
    // next event is in flight costs one session restart today. Bounded, not a loop: at most one
    // per refused row.
    let restarts = relay.metrics.reconnects.get();
    assert!(restarts <= 2, "{restarts} restarts for 2 refused rows");
    assert!(!relay.is_finished());
    relay.stop().await.expect("the relay stops cleanly");
}

/// A row the stream refuses (70 KB header: 10097) followed by a normal event that is already in
/// flight: the dead letter takes the refused message's place, and the normal event must follow it
/// without a session restart.
///
/// The race it guards: the event behind the refused one was sent expecting the refused one's
/// sequence (say 5) and reached the server before the dead letter, so it is refused with 10071
/// "wrong last sequence: 4". Settling that refusal (src/sink/settle.rs, the `WrongLastSequence`
/// branch) sends it once more behind what the stream is known to hold (`Fence::behind_last_stored`)
/// instead of ending the session with `FenceBroken`, which once cost a restart and a WARN line per
/// refused row.
#[tokio::test]
async fn a_row_the_stream_refuses_costs_no_restart() {
    let db = text_id_db().await;
    let nats = NatsServer::start();
    let mut config = relay_config(&db, &nats);
    config.outbox.headers_column = "headers".into();
    let client = db.client().await;
    let js = nats.jetstream().await;
    let relay = start_streaming(&config).await;
    let big_header = format!(r#"{{"big": "{}"}}"#, "v".repeat(70 * 1024));
    // One transaction, so the normal event is published right behind the refused one.
    client
        .batch_execute(&format!(
            "BEGIN;
             INSERT INTO public.outbox (event_id, aggregate_type, aggregate_id, event_type, payload, headers)
             VALUES ('h-1', 'Claim', '1', 'T', '{{}}', '{big_header}');
             INSERT INTO public.outbox (event_id, aggregate_type, aggregate_id, event_type, payload)
             VALUES ('g-1', 'Claim', '1', 'T', '{{}}');
             COMMIT;"
        ))
        .await
        .expect("insert");
    let all = messages(&js, &config.nats.stream, 2).await;
    assert_dead_letter(&all[0], "h-1");
    assert_delivered(&all[1], "g-1");
    assert_eq!(relay.metrics.reconnects.get(), 0, "no restart");
    relay.stop().await.expect("the relay stops cleanly");
}

/// With the fence on (the default), 200 events whose ids the stream already holds, interleaved with
/// 200 new ones: JetStream drops the 200 as duplicates, every new one arrives once and in order, the
/// duplicate counter says 200, and the session is not restarted per duplicate (the old fence
/// restarted once per duplicate: 200 restarts). See the strict version below for the restart that
/// still happens now and then.
#[tokio::test]
async fn reused_ids_in_live_traffic_do_not_restart_per_duplicate() {
    reused_ids(10).await;
}

/// As above, with no restart at all, as the fence module promises ("never a session restart").
///
/// The race it guards (the same branch of src/sink/settle.rs as
/// `a_row_the_stream_refuses_costs_no_restart`): n-0077 goes out expecting 277 before the duplicate
/// o-0076 is counted, is refused (last 276) and resent expecting 276; o-0077, sent after the count
/// with the right expectation 277, reaches the server before that resend and is refused too
/// ("wrong last sequence: 276"). Each is sent once more behind what the stream is known to hold,
/// never a restart (once seen in about one run in five here, more under load).
#[tokio::test]
async fn reused_ids_in_live_traffic_never_restart() {
    for _ in 0..5 {
        reused_ids(0).await;
    }
}

async fn reused_ids(max_restarts: u64) {
    let db = text_id_db().await;
    let nats = NatsServer::start();
    let config = relay_config(&db, &nats);
    assert!(config.nats.fence, "the fence is the default");
    let client = db.client().await;
    let js = nats.jetstream().await;
    let relay = start_streaming(&config).await;
    let stream = &config.nats.stream;

    let old: Vec<String> = (1..=200).map(|i| format!("o-{i:04}")).collect();
    for id in &old {
        good(&client, id).await;
    }
    wait_for("the first 200 events", LIMIT, || async {
        stream_count(&js, stream).await >= 200
    })
    .await;
    // Insert-then-delete keeps the table small; the ids stay in the stream's duplicate window.
    client
        .batch_execute("DELETE FROM public.outbox")
        .await
        .expect("delete");

    let mut new = Vec::new();
    for i in 1..=200 {
        let id = format!("n-{i:04}");
        good(&client, &id).await;
        good(&client, &old[i - 1]).await;
        new.push(id);
    }
    let after = current_wal_lsn(&client).await;
    wait_for("the 200 new events", LIMIT, || async {
        stream_count(&js, stream).await >= 400
    })
    .await;
    wait_slot_past(&client, &config.postgres.slot, after).await;
    tokio::time::sleep(Duration::from_millis(500)).await;

    let all = read_all(&js, stream).await;
    let ids: Vec<&str> = all.iter().map(Stored::id).collect();
    assert_eq!(all.len(), 400, "each id stored once");
    assert_eq!(
        &ids[..200],
        old.iter().map(String::as_str).collect::<Vec<_>>()
    );
    assert_eq!(
        &ids[200..],
        new.iter().map(String::as_str).collect::<Vec<_>>(),
        "new ones in order"
    );
    for w in all.windows(2) {
        assert_eq!(w[1].seq, w[0].seq + 1, "no gap in the stream");
    }
    let restarts = relay.metrics.reconnects.get();
    assert!(
        restarts <= max_restarts,
        "{restarts} restarts for 200 reused ids (at most {max_restarts})"
    );
    let (ok, dup) = (
        relay.metrics.published_ok.get(),
        relay.metrics.published_duplicate.get(),
    );
    if restarts == 0 {
        assert_eq!((ok, dup), (400, 200), "ok and duplicate counts");
    } else {
        // A restart replays from the confirmed position: the replayed events count as duplicates.
        assert!(ok <= 400 && dup >= 200, "ok {ok}, duplicates {dup}");
    }
    relay.stop().await.expect("the relay stops cleanly");
}
