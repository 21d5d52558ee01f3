//! P7: an event that cannot be published as it is ends as a dead letter on `outbox_dead_letter` with
//! the reason in `Outbox-Error`, and the events after it are still delivered; with
//! `on_invalid = "stop"` the relay stops instead, naming the event, and the slot stays before it.
//! (Malformed replication data is the decoder's business: its proptests and the cargo-fuzz target in
//! fuzz/ cover it.)

use std::time::Duration;

use async_nats::jetstream::{self, stream};
use outbox_relay::config::{Config, OnInvalid};
use tokio_postgres::Client;

use super::wait_for_slot;
use crate::support::{
    InProcessRelay, NatsServer, PgServer, Stored, TEXT_ID_OUTBOX_SQL, TestDb, confirmed_flush,
    current_wal_lsn, read_all, relay_config, stream_count, wait_for,
};

const DEAD_LETTER: &str = "outbox_dead_letter";

/// An outbox table whose columns may all be NULL (no primary key), to write what a real schema
/// should forbid.
const NULLABLE_OUTBOX_SQL: &str = "CREATE TABLE public.outbox (
    event_id       text,
    aggregate_type text,
    aggregate_id   text,
    event_type     text,
    payload        jsonb,
    created_at     timestamptz NOT NULL DEFAULT now()
);";

struct Rig {
    db: TestDb,
    nats: NatsServer,
    config: Config,
    client: Client,
    js: jetstream::Context,
}

impl Rig {
    async fn new(table_sql: &str, nats: NatsServer) -> Rig {
        let db = TestDb::create(PgServer::shared()).await;
        db.psql(table_sql);
        let config = relay_config(&db, &nats);
        let client = db.client().await;
        let js = nats.jetstream().await;
        Rig {
            db,
            nats,
            config,
            client,
            js,
        }
    }

    async fn start(&self) -> InProcessRelay {
        let relay = InProcessRelay::start(self.config.clone());
        wait_for_slot(&self.client, &self.config.postgres.slot).await;
        wait_for("the relay to stream", Duration::from_secs(30), || async {
            relay.metrics.streaming.get() == 1 || relay.is_finished()
        })
        .await;
        relay
    }

    async fn insert(
        &self,
        id: Option<&str>,
        aggregate_type: Option<&str>,
        event_type: Option<&str>,
        payload: &str,
    ) {
        self.client
            .execute(
                "INSERT INTO public.outbox (event_id, aggregate_type, aggregate_id, event_type, payload) \
                 VALUES ($1, $2, '1', $3, $4::text::jsonb)",
                &[&id, &aggregate_type, &event_type, &payload],
            )
            .await
            .unwrap_or_else(|e| panic!("insert {id:?}: {e}"));
    }

    async fn good(&self, id: &str) {
        self.insert(
            Some(id),
            Some("Claim"),
            Some("ClaimApproved"),
            r#"{"ok": true}"#,
        )
        .await;
    }

    /// Creates the relay's stream before the relay does, on the subjects it publishes to, with
    /// the test's `change` (a limit that refuses what the test sends).
    async fn create_stream(&self, change: impl FnOnce(&mut stream::Config)) {
        let mut config = stream::Config {
            name: self.config.nats.stream.clone(),
            subjects: vec!["outbox.*".into(), DEAD_LETTER.into()],
            duplicate_window: Duration::from_secs(120),
            ..Default::default()
        };
        change(&mut config);
        self.js.create_stream(config).await.expect("create stream");
    }

    /// Waits for `n` messages and reads them.
    async fn messages(&self, n: usize) -> Vec<Stored> {
        let stream = &self.config.nats.stream;
        wait_for(
            &format!("{n} messages"),
            Duration::from_secs(30),
            || async { stream_count(&self.js, stream).await >= n as u64 },
        )
        .await;
        tokio::time::sleep(Duration::from_millis(500)).await;
        let all = read_all(&self.js, stream).await;
        assert_eq!(all.len(), n, "{all:#?}");
        all
    }
}

fn assert_dead_letter(m: &Stored, id: &str, error_mentions: &str) {
    assert_eq!(m.subject, DEAD_LETTER, "{m:?}");
    assert_eq!(m.id(), id, "{m:?}");
    let error = m.header("Outbox-Error");
    assert!(
        error.contains(error_mentions),
        "Outbox-Error of {id} names {error_mentions}: {error}"
    );
    assert!(!error.contains('\n'));
}

/// A payload of 3 kB, over the 2048 bytes of a test stream's `max_msg_size`.
fn over_2048() -> String {
    format!(r#"{{"pad": "{}"}}"#, "x".repeat(3_000))
}

/// Event `refused`'s dead letter, for `reason`, without its payload `big` but with its size.
fn assert_refused_without_payload(m: &Stored, reason: &str, big: &str) {
    assert_dead_letter(m, "refused", reason);
    assert!(m.payload.is_empty());
    assert_eq!(m.header("Outbox-Payload-Size"), big.len().to_string());
}

fn assert_delivered(m: &Stored, id: &str) {
    assert_eq!((m.subject.as_str(), m.id()), ("outbox.Claim", id), "{m:?}");
}

fn report(case: &str, events: usize, dead: u64) {
    eprintln!(
        "FAULT-MATRIX | bad input: {case} | 1 | {events} | 0 | 0 | yes ({dead} dead letters)"
    );
}

/// Aggregate types that are not one subject token: a space, a '.', empty.
#[tokio::test]
async fn invalid_subject_tokens_are_dead_lettered() {
    let rig = Rig::new(TEXT_ID_OUTBOX_SQL, NatsServer::start()).await;
    let relay = rig.start().await;
    for (id, t) in [
        ("bad-space", "Bad Type"),
        ("bad-dot", "a.b"),
        ("bad-empty", ""),
    ] {
        rig.insert(Some(id), Some(t), Some("ClaimApproved"), r#"{"n": 1}"#)
            .await;
    }
    rig.good("good-1").await;
    let all = rig.messages(4).await;
    for (m, (id, t)) in all.iter().zip([
        ("bad-space", "Bad Type"),
        ("bad-dot", "a.b"),
        ("bad-empty", ""),
    ]) {
        assert_dead_letter(m, id, "aggregate_type");
        assert_eq!(m.header("Outbox-Aggregate-Type"), t);
        assert_eq!(m.payload_str(), r#"{"n": 1}"#, "payload kept");
    }
    assert_delivered(&all[3], "good-1");
    assert_eq!(relay.metrics.dead_letters.get(), 3);
    report("aggregate_type with space / '.' / empty", 4, 3);
    relay.stop().await.expect("relay stops cleanly");
}

/// NULL event_type, NULL aggregate_type, NULL id (its dead letter's id is `lsn:<commit lsn>:<index>`).
#[tokio::test]
async fn null_columns_and_a_missing_id_are_dead_lettered() {
    let rig = Rig::new(NULLABLE_OUTBOX_SQL, NatsServer::start()).await;
    let relay = rig.start().await;
    rig.insert(Some("null-event-type"), Some("Claim"), None, "{}")
        .await;
    rig.insert(
        Some("null-aggregate-type"),
        None,
        Some("ClaimApproved"),
        "{}",
    )
    .await;
    // Two in one transaction, the id-less one second: its index is 1.
    rig.client
        .batch_execute(
            "BEGIN;
             INSERT INTO public.outbox (event_id, aggregate_type, aggregate_id, event_type, payload)
               VALUES ('before-null-id', 'Claim', '1', 'ClaimApproved', '{}');
             INSERT INTO public.outbox (event_id, aggregate_type, aggregate_id, event_type, payload)
               VALUES (NULL, 'Claim', '1', 'ClaimApproved', '{}');
             COMMIT;",
        )
        .await
        .unwrap();
    rig.good("good-1").await;
    let all = rig.messages(5).await;
    assert_dead_letter(&all[0], "null-event-type", "event_type");
    assert_dead_letter(&all[1], "null-aggregate-type", "aggregate_type");
    assert_delivered(&all[2], "before-null-id");
    let lsn = all[3].commit_lsn();
    assert_eq!(lsn, all[2].commit_lsn(), "one transaction");
    let id = outbox_relay::event::message_id(None, lsn, 1, all[3].payload.as_ref());
    assert_dead_letter(&all[3], &id, "event_id");
    assert_delivered(&all[4], "good-1");
    assert_eq!(relay.metrics.dead_letters.get(), 3);
    report("NULL event_type / aggregate_type / id", 5, 3);
    relay.stop().await.expect("relay stops cleanly");
}

/// Payload + headers over the server's max_payload (4096): a dead letter without the payload, with
/// `Outbox-Payload-Size`.
#[tokio::test]
async fn over_max_payload_is_dead_lettered_without_its_payload() {
    let rig = Rig::new(
        TEXT_ID_OUTBOX_SQL,
        NatsServer::start_with_config("max_payload: 4096"),
    )
    .await;
    let relay = rig.start().await;
    let big = format!(r#"{{"pad": "{}"}}"#, "x".repeat(10_000));
    rig.insert(Some("too-big"), Some("Claim"), Some("ClaimApproved"), &big)
        .await;
    rig.good("good-1").await;
    let all = rig.messages(2).await;
    assert_dead_letter(&all[0], "too-big", "max_payload");
    assert!(all[0].payload.is_empty());
    assert_eq!(all[0].header("Outbox-Payload-Size"), big.len().to_string());
    assert_eq!(all[0].header("Outbox-Subject"), "outbox.Claim");
    assert_delivered(&all[1], "good-1");
    report("payload over max_payload (10 kB > 4096)", 2, 1);
    relay.stop().await.expect("relay stops cleanly");
    drop(rig.nats);
}

/// A message the stream refuses (its max_msg_size is 2048, the payload 3 kB): a dead letter, which
/// drops the payload so it fits.
#[tokio::test]
async fn message_refused_by_the_stream_is_dead_lettered() {
    let rig = Rig::new(TEXT_ID_OUTBOX_SQL, NatsServer::start()).await;
    rig.create_stream(|s| s.max_message_size = 2048).await;
    let relay = rig.start().await;
    let big = over_2048();
    rig.insert(Some("refused"), Some("Claim"), Some("ClaimApproved"), &big)
        .await;
    rig.good("good-1").await;
    let all = rig.messages(2).await;
    assert_refused_without_payload(&all[0], "refused", &big);
    assert_delivered(&all[1], "good-1");
    report("stream refuses (max_msg_size 2048, 3 kB)", 2, 1);
    relay.stop().await.expect("relay stops cleanly");
}

/// The same without the fence (`nats.fence = false`), with the events behind the refused one in
/// flight with it (one transaction): nothing refuses them, so the refused event's dead letter used
/// to be stored after them (P4). The relay knows the stream's max_msg_size and dead-letters the
/// event before sending it, in its place.
#[tokio::test]
async fn message_over_the_streams_max_msg_size_keeps_its_place_without_the_fence() {
    let mut rig = Rig::new(TEXT_ID_OUTBOX_SQL, NatsServer::start()).await;
    rig.config.nats.fence = false;
    rig.create_stream(|s| s.max_message_size = 2048).await;
    let relay = rig.start().await;
    let big = over_2048();
    rig.client
        .batch_execute(&format!(
            "BEGIN; \
             INSERT INTO public.outbox (event_id, aggregate_type, aggregate_id, event_type, payload) \
               VALUES ('refused', 'Claim', '1', 'ClaimApproved', '{big}'); \
             INSERT INTO public.outbox (event_id, aggregate_type, aggregate_id, event_type, payload) \
               SELECT 'after-' || lpad(i::text, 3, '0'), 'Claim', '1', 'ClaimApproved', '{{}}' \
               FROM generate_series(1, 50) AS i; \
             COMMIT;"
        ))
        .await
        .expect("one transaction of 51 events");
    let all = rig.messages(51).await;
    let order: Vec<&str> = all.iter().map(Stored::id).collect();
    let mut expected = vec!["refused".to_owned()];
    expected.extend((1..=50).map(|i| format!("after-{i:03}")));
    assert_eq!(
        order, expected,
        "P4: the dead letter keeps the refused event's place"
    );
    assert_refused_without_payload(&all[0], "max_msg_size", &big);
    for m in &all[1..] {
        assert_eq!(m.subject, "outbox.Claim", "{m:?}");
    }
    report(
        "stream refuses (max_msg_size 2048, 3 kB), fence = false, in flight with 50 later events",
        51,
        1,
    );
    relay.stop().await.expect("relay stops cleanly");
}

/// The same with `nats.atomic_transactions`: a batch that holds a message over the stream's
/// max_msg_size would be refused whole, every time, so the relay must dead-letter that message before
/// it goes into the batch, and the rest of its transaction and the next one are stored.
#[tokio::test]
async fn message_over_the_streams_max_msg_size_is_dead_lettered_in_an_atomic_batch() {
    let mut rig = Rig::new(TEXT_ID_OUTBOX_SQL, NatsServer::start()).await;
    rig.config.nats.atomic_transactions = true;
    rig.create_stream(|s| {
        s.max_message_size = 2048;
        s.allow_atomic_publish = true;
    })
    .await;
    let relay = rig.start().await;
    let big = over_2048();
    rig.client
        .batch_execute(&format!(
            "BEGIN; \
             INSERT INTO public.outbox (event_id, aggregate_type, aggregate_id, event_type, payload) \
               VALUES ('before', 'Claim', '1', 'ClaimApproved', '{{}}'); \
             INSERT INTO public.outbox (event_id, aggregate_type, aggregate_id, event_type, payload) \
               VALUES ('refused', 'Claim', '1', 'ClaimApproved', '{big}'); \
             INSERT INTO public.outbox (event_id, aggregate_type, aggregate_id, event_type, payload) \
               VALUES ('after', 'Claim', '1', 'ClaimApproved', '{{}}'); \
             COMMIT;"
        ))
        .await
        .expect("one transaction of three events");
    rig.good("good-1").await;
    let all = rig.messages(4).await;
    assert_delivered(&all[0], "before");
    assert_refused_without_payload(&all[1], "max_msg_size", &big);
    assert_delivered(&all[2], "after");
    assert_delivered(&all[3], "good-1");
    report(
        "stream refuses (max_msg_size 2048, 3 kB), atomic batch",
        4,
        1,
    );
    relay.stop().await.expect("relay stops cleanly");
}

/// A column added while streaming is ignored; a needed column dropped turns the following events into
/// dead letters whose reason names it.
#[tokio::test]
async fn dropped_column_dead_letters_added_column_is_ignored() {
    let rig = Rig::new(TEXT_ID_OUTBOX_SQL, NatsServer::start()).await;
    let relay = rig.start().await;
    rig.good("e-1").await;
    rig.client
        .batch_execute("ALTER TABLE public.outbox ADD COLUMN extra text DEFAULT 'x'")
        .await
        .unwrap();
    rig.good("e-2").await;
    rig.client
        .batch_execute("ALTER TABLE public.outbox DROP COLUMN event_type")
        .await
        .unwrap();
    for id in ["e-3", "e-4"] {
        rig.client
            .execute(
                "INSERT INTO public.outbox (event_id, aggregate_type, aggregate_id, payload) \
                 VALUES ($1, 'Claim', '1', '{}')",
                &[&id],
            )
            .await
            .unwrap();
    }
    let all = rig.messages(4).await;
    assert_delivered(&all[0], "e-1");
    assert_delivered(&all[1], "e-2");
    assert_dead_letter(&all[2], "e-3", "event_type");
    assert_dead_letter(&all[3], "e-4", "event_type");
    report("column added, then event_type dropped", 4, 2);
    relay.stop().await.expect("relay stops cleanly");
}

/// `on_invalid = "stop"`: the relay stops with an error naming the event; the slot is not confirmed
/// past it, and a restart stops at it again.
#[tokio::test]
async fn on_invalid_stop_stops_at_the_event_and_confirms_nothing_past_it() {
    let mut rig = Rig::new(TEXT_ID_OUTBOX_SQL, NatsServer::start()).await;
    rig.config.outbox.on_invalid = OnInvalid::Stop;
    let relay = rig.start().await;
    rig.good("e-1").await;
    rig.messages(1).await;
    rig.insert(Some("bad-1"), Some("Bad Type"), Some("ClaimApproved"), "{}")
        .await;
    let after_bad = current_wal_lsn(&rig.client).await;
    rig.good("e-2").await;
    wait_for("the relay to stop", Duration::from_secs(30), || async {
        relay.is_finished()
    })
    .await;
    let err = relay.stop().await.expect_err("stops with an error");
    let msg = err.to_string();
    assert!(
        msg.contains("bad-1") && msg.contains("on_invalid"),
        "names the event: {msg}"
    );
    let slot = &rig.config.postgres.slot;
    let confirmed = confirmed_flush(&rig.client, slot).await.expect("slot");
    assert!(
        confirmed < after_bad,
        "slot confirmed {confirmed}, past bad-1's commit (WAL after it: {after_bad})"
    );
    // Again: the same event stops it; nothing after it was published.
    let relay = rig.start().await;
    wait_for(
        "the relay to stop again",
        Duration::from_secs(30),
        || async { relay.is_finished() },
    )
    .await;
    let err = relay.stop().await.expect_err("stops again");
    assert!(err.to_string().contains("bad-1"), "{err}");
    assert_eq!(stream_count(&rig.js, &rig.config.nats.stream).await, 1);
    assert!(confirmed_flush(&rig.client, slot).await.expect("slot") < after_bad);
    eprintln!("on_invalid = stop: {msg}");
    eprintln!(
        "FAULT-MATRIX | bad input: on_invalid = stop | 2 | 3 | n/a (stopped at bad-1, e-2 held) | 0 | yes"
    );
    let _ = &rig.db;
}

/// A dead letter republished after every restart is a duplicate, not a new dead letter: an event
/// that becomes a dead letter, followed in its transaction by one the stream refuses (full,
/// `discard: new`), so every session republishes the dead letter (no fence: nothing is skipped) and
/// JetStream drops it by its id. The dead letter is counted once, the republished copies as
/// duplicates, and they are not progress: the restarts back off (the old relay counted a new dead
/// letter per session and restarted every ~100 ms).
#[tokio::test]
async fn a_republished_dead_letter_is_a_duplicate_and_does_not_reset_the_backoff() {
    let mut rig = Rig::new(TEXT_ID_OUTBOX_SQL, NatsServer::start()).await;
    rig.config.nats.fence = false;
    rig.create_stream(|s| {
        s.max_messages = 1;
        s.discard = stream::DiscardPolicy::New;
    })
    .await;
    let relay = rig.start().await;
    rig.client
        .batch_execute(
            "BEGIN; \
             INSERT INTO public.outbox (event_id, aggregate_type, aggregate_id, event_type, payload) \
               VALUES ('bad-1', 'Bad Type', '1', 'ClaimApproved', '{}'); \
             INSERT INTO public.outbox (event_id, aggregate_type, aggregate_id, event_type, payload) \
               VALUES ('refused-1', 'Claim', '1', 'ClaimApproved', '{}'); \
             COMMIT;",
        )
        .await
        .expect("one transaction: a dead letter, then an event the full stream refuses");
    wait_for("the first restart", Duration::from_secs(30), || async {
        relay.metrics.reconnects.get() >= 1
    })
    .await;
    let watched = std::time::Instant::now();
    let first = relay.metrics.reconnects.get();
    tokio::time::sleep(Duration::from_secs(6)).await;
    let restarts = relay.metrics.reconnects.get() - first;
    let dead = relay.metrics.dead_letters.get();
    let duplicates = relay.metrics.published_duplicate.get();
    eprintln!(
        "republished dead letter: {dead} dead letters, {duplicates} duplicates, {restarts} restarts in {:?}",
        watched.elapsed()
    );
    assert!(!relay.is_finished(), "the relay keeps retrying");
    assert_eq!(dead, 1, "the dead letter is counted once");
    assert!(
        duplicates >= 1,
        "its republished copies count as duplicates: {duplicates}"
    );
    // Backoff from the first restart: 200, 400, 800, 1600, 3200 ms (each ±25 %) reach past 6 s at
    // the fifth; a backoff reset by every republished copy restarts every ~100 ms (about 50).
    assert!(
        (1..=6).contains(&restarts),
        "restarts back off: {restarts} in 6 s"
    );
    let all = read_all(&rig.js, &rig.config.nats.stream).await;
    assert_eq!(all.len(), 1, "{all:#?}");
    assert_dead_letter(&all[0], "bad-1", "aggregate_type");
    report("dead letter republished behind a full stream", 2, dead);
    relay.stop().await.expect("relay stops cleanly");
}
