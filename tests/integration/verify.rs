//! `outbox-relay verify` against real servers: the relay (in process) publishes the README's story
//! (claim 4711, event e-5531 on `outbox.Claim`) among other events, then each class of difference
//! is planted by hand as another client or an operator would cause it, and the binary's `--json`
//! must report exactly that class (its count and its example's event id) with exit code 1; a clean
//! stream of a few thousand events reports nothing and exits 0.

use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream;
use outbox_relay::config::Config;
use serde_json::Value;

use crate::support::{
    Finished, InProcessRelay, NatsServer, PgServer, Stored, TEXT_ID_OUTBOX_SQL, TestDb, read_all,
    relay_config, relay_env, run_command, stream_count, wait_for,
};

/// The classes of the contract, each a count in `--json`.
const CLASSES: [&str; 8] = [
    "missing",
    "in_flight",
    "duplicates",
    "out_of_order",
    "foreign",
    "misrouted",
    "payload_differs",
    "older_than_stream",
];

const STORY_PAYLOAD: &str = r#"{"claim_id": 4711, "status": "approved", "amount_cents": 125000}"#;

/// A database with the text-id outbox and servers for one test.
struct Story {
    /// Kept for the test's length: the database goes with it.
    _db: TestDb,
    nats: NatsServer,
    config: Config,
    client: tokio_postgres::Client,
}

impl Story {
    async fn new() -> Story {
        let db = TestDb::create(PgServer::shared()).await;
        db.psql(TEXT_ID_OUTBOX_SQL);
        let nats = NatsServer::start();
        let config = relay_config(&db, &nats);
        let client = db.client().await;
        Story {
            _db: db,
            nats,
            config,
            client,
        }
    }

    /// `n` filler events `e-<from>..`, one transaction each `per_tx` rows.
    async fn fillers(&self, from: u32, n: u32, per_tx: u32) {
        let mut i = from;
        while i < from + n {
            let end = (i + per_tx).min(from + n) - 1;
            self.client
                .batch_execute(&format!(
                    "INSERT INTO outbox (event_id, aggregate_type, aggregate_id, event_type, payload) \
                     SELECT 'e-' || g, 'Claim', g::text, 'ClaimSubmitted', jsonb_build_object('claim_id', g) \
                     FROM generate_series({i}, {end}) g"
                ))
                .await
                .unwrap();
            i = end + 1;
        }
    }

    /// Claim 4711 approved: event e-5531, created a minute ago. A row created in the last seconds
    /// that is not in the stream is in flight rather than missing (while the relay's slot has not
    /// confirmed past it), so the planted differences are about a row that is old enough.
    async fn e5531(&self) {
        self.client
            .execute(
                "INSERT INTO outbox (event_id, aggregate_type, aggregate_id, event_type, payload, created_at) \
                 VALUES ('e-5531', 'Claim', '4711', 'ClaimApproved', $1::text::jsonb, now() - interval '1 minute')",
                &[&STORY_PAYLOAD],
            )
            .await
            .unwrap();
    }

    async fn js(&self) -> jetstream::Context {
        self.nats.jetstream().await
    }

    async fn wait_for_messages(&self, n: u64) {
        let js = self.js().await;
        let stream = self.config.nats.stream.clone();
        wait_for(
            &format!("{n} messages in {stream}"),
            // A minute, and more for a long story (100,000 events on a loaded 2-core machine).
            Duration::from_secs(60 + n / 500),
            || async { stream_count(&js, &stream).await >= n },
        )
        .await;
    }

    /// The relay publishes `before` fillers, e-5531, `after` fillers, and stops.
    async fn published(before: u32, after: u32) -> Story {
        let s = Story::new().await;
        let relay = InProcessRelay::start_streaming(&s.config, &s.client).await;
        s.fillers(1, before, 100).await;
        s.e5531().await;
        s.fillers(10_000, after, 100).await;
        s.wait_for_messages(u64::from(before + after + 1)).await;
        relay.stop().await.expect("relay stops cleanly");
        s
    }

    async fn messages(&self) -> Vec<Stored> {
        read_all(&self.js().await, &self.config.nats.stream).await
    }

    /// `outbox-relay verify --json ARGS` with `env` added to the test's: how it ended.
    async fn verify_with(&self, args: &[&str], env: &[(&str, &str)]) -> Finished {
        let mut all = vec!["verify".to_owned(), "--json".to_owned()];
        all.extend(args.iter().map(|a| (*a).to_owned()));
        let mut vars = relay_env(&self.config);
        vars.extend(env.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())));
        tokio::task::spawn_blocking(move || {
            let args: Vec<&str> = all.iter().map(String::as_str).collect();
            run_command(&args, &vars, Duration::from_secs(120))
        })
        .await
        .unwrap()
    }

    /// `outbox-relay verify --json ARGS`: exit code and the object.
    async fn verify(&self, args: &[&str]) -> (i32, Value) {
        let done = self.verify_with(args, &[]).await;
        let code = done.status.code().expect("verify exited");
        let json: Value = serde_json::from_str(done.stdout.trim()).unwrap_or_else(|e| {
            panic!(
                "verify printed no JSON ({e}), exit {code}\nstdout: {}\nstderr: {}",
                done.stdout, done.stderr
            )
        });
        println!("verify {args:?}: exit {code}: {json}");
        (code, json)
    }
}

/// Headers of a stored message as a map to publish again, without `skip` and the fence's
/// expectations (which were about the stream's tail when the relay published).
fn headers_of(m: &Stored, skip: &[&str]) -> HeaderMap {
    let mut h = HeaderMap::new();
    for (k, v) in &m.headers {
        if !skip.contains(&k.as_str()) && !k.starts_with("Nats-Expected-") {
            h.insert(k.as_str(), v.as_str());
        }
    }
    h
}

async fn publish(js: &jetstream::Context, subject: &str, h: HeaderMap, payload: &str) -> u64 {
    js.publish_with_headers(subject.to_owned(), h, payload.to_owned().into())
        .await
        .unwrap()
        .await
        .unwrap()
        .sequence
}

/// Every class is 0 but `class`, which is `n` with `event_id` as its first example.
fn assert_exactly(json: &Value, class: &str, n: u64, event_id: &str) {
    for c in CLASSES {
        let want = if c == class { n } else { 0 };
        assert_eq!(json[c], want, "{c} in {json}");
    }
    assert_eq!(json["examples"][class][0]["event_id"], event_id, "{json}");
}

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
        assert_eq!(json["examples"][c], Value::Array(vec![]), "{c} in {json}");
    }
    let checks = json["checks"].to_string();
    for c in [
        "completeness",
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
async fn a_message_deleted_from_the_stream_is_missing() {
    let s = Story::published(10, 10).await;
    let seq = s
        .messages()
        .await
        .iter()
        .find(|m| m.id() == "e-5531")
        .expect("e-5531 stored")
        .seq;
    let stream = s
        .js()
        .await
        .get_stream(&s.config.nats.stream)
        .await
        .unwrap();
    assert!(stream.delete_message(seq).await.unwrap());
    let (code, json) = s.verify(&[]).await;
    assert_eq!(code, 1, "{json}");
    assert_exactly(&json, "missing", 1, "e-5531");
    assert!(json["examples"]["missing"][0].get("sequence").is_none());
    assert_eq!(json["rows"], 21);
    assert_eq!(json["messages"], 20);
    // --where and --since choose the rows: without e-5531, or only rows newer than it, nothing differs.
    let (code, json) = s.verify(&["--where", "event_id <> 'e-5531'"]).await;
    assert_eq!((code, json["rows"].as_u64()), (0, Some(20)), "{json}");
    let (code, json) = s.verify(&["--since", "2999-01-01 00:00+00"]).await;
    assert_eq!((code, json["rows"].as_u64()), (0, Some(0)), "{json}");
}

#[tokio::test]
async fn a_duplicate_published_by_another_client_is_a_duplicate_not_a_break_of_order() {
    let s = Story::published(10, 10).await;
    let messages = s.messages().await;
    let original = messages.iter().find(|m| m.id() == "e-5531").unwrap();
    // Another client republishes e-5531 as it is, without Nats-Msg-Id (which JetStream would
    // deduplicate within its window) but with the event id consumers deduplicate on.
    let mut h = headers_of(original, &["Nats-Msg-Id"]);
    h.insert("Outbox-Event-Id", "e-5531");
    let js = s.js().await;
    let copy = publish(&js, &original.subject, h, original.payload_str()).await;
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
    let messages = s.messages().await;
    let last = messages.last().unwrap();
    let position = last.header("Outbox-Position");
    let (history, place) = position.rsplit_once('/').unwrap();
    let (lsn_lo, _) = place.split_once(':').unwrap();
    let lo = u64::from_str_radix(lsn_lo, 16).unwrap();
    let js = s.js().await;
    // x-2's position is after x-1's, and it is stored first.
    for (id, offset) in [("x-2", 0x200u64), ("x-1", 0x100)] {
        let mut h = headers_of(last, &["Nats-Msg-Id", "Outbox-Position"]);
        h.insert("Nats-Msg-Id", id);
        h.insert(
            "Outbox-Position",
            format!("{history}/{:X}:0", lo + offset).as_str(),
        );
        publish(&js, "outbox.Claim", h, "{}").await;
    }
    let (code, json) = s.verify(&[]).await;
    assert_eq!(code, 1, "{json}");
    assert_exactly(&json, "out_of_order", 1, "x-1");
    assert_eq!(
        json["examples"]["out_of_order"][0]["sequence"], 23,
        "{json}"
    );
}

#[tokio::test]
async fn a_foreign_message_is_foreign() {
    let s = Story::published(10, 10).await;
    let js = s.js().await;
    let mut h = HeaderMap::new();
    h.insert("Nats-Msg-Id", "f-1");
    let seq = publish(&js, "outbox.Claim", h, r#"{"not": "the relay's"}"#).await;
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
    let relay = InProcessRelay::start_streaming(&s.config, &s.client).await;
    s.fillers(1, 20, 10).await;
    s.wait_for_messages(20).await;
    relay.stop().await.expect("relay stops cleanly");
    let (code, json) = s.verify(&[]).await;
    assert_eq!(code, 1, "{json}");
    assert_exactly(&json, "missing", 1, "e-5531");
    assert_eq!(json["rows"], 21);

    // The recovery docs/recovery.md gives: the row written anew while the relay runs.
    let relay = InProcessRelay::start_streaming(&s.config, &s.client).await;
    s.client
        .batch_execute(
            "WITH gone AS (DELETE FROM public.outbox WHERE event_id IN ('e-5531') RETURNING *) \
             INSERT INTO public.outbox SELECT * FROM gone",
        )
        .await
        .unwrap();
    s.wait_for_messages(21).await;
    relay.stop().await.expect("relay stops cleanly");
    let (code, json) = s.verify(&["--payloads"]).await;
    assert_eq!(code, 0, "after the recovery: {json}");
}

#[tokio::test]
async fn a_payload_changed_in_flight_differs_with_payloads_only() {
    let s = Story::new().await;
    let relay = InProcessRelay::start_streaming(&s.config, &s.client).await;
    s.fillers(1, 10, 5).await;
    s.wait_for_messages(10).await;
    relay.stop().await.expect("relay stops cleanly");
    // The row is committed while the relay is stopped; a hand-made message carries it on, with
    // the relay's headers and the next position, but another amount.
    s.e5531().await;
    let messages = s.messages().await;
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
    let js = s.js().await;
    let seq = publish(&js, "outbox.Claim", h, &changed).await;

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
async fn a_row_committed_just_now_and_not_stored_yet_is_in_flight_not_missing() {
    let s = Story::published(10, 10).await;
    // Claim 4712 is approved while the relay is stopped: its slot has not confirmed past the row.
    s.client
        .batch_execute(
            "INSERT INTO outbox (event_id, aggregate_type, aggregate_id, event_type, payload) \
             VALUES ('e-5532', 'Claim', '4712', 'ClaimApproved', '{\"claim_id\": 4712}')",
        )
        .await
        .unwrap();
    let (code, json) = s.verify(&[]).await;
    assert_eq!(code, 0, "in flight is not a difference: {json}");
    assert_exactly(&json, "in_flight", 1, "e-5532");
}

#[tokio::test]
async fn rows_older_than_the_streams_first_message_are_neither_missing_nor_fine() {
    let s = Story::published(10, 10).await;
    // As a limit (max_age, max_msgs) would: the first two messages are gone, the first sequence is 3.
    let stream = s
        .js()
        .await
        .get_stream(&s.config.nats.stream)
        .await
        .unwrap();
    stream.purge().sequence(3).await.unwrap();
    let (code, json) = s.verify(&[]).await;
    assert_eq!(code, 0, "older than the stream is not a difference: {json}");
    assert_exactly(&json, "older_than_stream", 2, "e-1");
    assert_eq!(json["first_sequence"], 3, "{json}");
}

#[tokio::test]
async fn a_message_on_another_subject_than_the_template_gives_is_misrouted() {
    let s = Story::new().await;
    let relay = InProcessRelay::start_streaming(&s.config, &s.client).await;
    s.fillers(1, 10, 5).await;
    s.wait_for_messages(10).await;
    relay.stop().await.expect("relay stops cleanly");
    // e-5531 is committed while the relay is stopped and carried on by hand to outbox.Other.
    s.e5531().await;
    let messages = s.messages().await;
    let last = messages.last().unwrap();
    let (history, place) = last.header("Outbox-Position").rsplit_once('/').unwrap();
    let lo = u64::from_str_radix(place.split_once(':').unwrap().0, 16).unwrap();
    let mut h = headers_of(last, &["Nats-Msg-Id", "Outbox-Position"]);
    h.insert("Nats-Msg-Id", "e-5531");
    h.insert(
        "Outbox-Position",
        format!("{history}/{:X}:0", lo + 0x100).as_str(),
    );
    let js = s.js().await;
    let seq = publish(&js, "outbox.Other", h, STORY_PAYLOAD).await;
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
    use crate::permissions::{INBOX_PREFIX, RELAY_PASSWORD, RELAY_USER, documented_nats_config};
    let db = TestDb::create(PgServer::shared()).await;
    db.psql(TEXT_ID_OUTBOX_SQL);
    let nats = NatsServer::start_with_config(&documented_nats_config());
    let mut config = relay_config(&db, &nats);
    // The names the documented permissions are written for.
    config.nats.stream = "OUTBOX".into();
    config.nats.user = RELAY_USER.into();
    config.nats.password = RELAY_PASSWORD.into();
    config.nats.inbox_prefix = INBOX_PREFIX.into();
    let client = db.client().await;
    let s = Story {
        _db: db,
        nats,
        config,
        client,
    };
    let env = [
        ("OUTBOX_RELAY_NATS_USER", RELAY_USER),
        ("OUTBOX_RELAY_NATS_PASSWORD", RELAY_PASSWORD),
        ("OUTBOX_RELAY_NATS_INBOX_PREFIX", INBOX_PREFIX),
    ];
    let setup = {
        let mut vars = relay_env(&s.config);
        vars.extend(env.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())));
        tokio::task::spawn_blocking(move || run_command(&["setup"], &vars, Duration::from_secs(60)))
            .await
            .unwrap()
    };
    assert!(setup.status.success(), "setup: {}", setup.stderr);
    let relay = InProcessRelay::start_streaming(&s.config, &s.client).await;
    s.fillers(1, 50, 10).await;
    s.e5531().await;
    let done = loop {
        let done = s.verify_with(&["--payloads"], &env).await;
        // The relay may still be publishing: then e-5531 is in flight and the run is clean anyway.
        if done.stdout.contains("\"rows\":51") || !done.status.success() {
            break done;
        }
    };
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

#[tokio::test]
async fn a_messages_only_outbox_runs_the_checks_that_need_no_rows_and_says_so() {
    let db = TestDb::create(PgServer::shared()).await;
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/sql/06_outbox_message.sql");
    db.psql(&std::fs::read_to_string(path).unwrap());
    let nats = NatsServer::start();
    let mut config = relay_config(&db, &nats);
    config.outbox.table = String::new();
    config.outbox.message_prefix = "outbox".into();
    let client = db.client().await;
    let s = Story {
        _db: db,
        nats,
        config,
        client,
    };
    let relay = InProcessRelay::start_streaming(&s.config, &s.client).await;
    for claim in 4711..4716 {
        s.client
            .query_one(
                "SELECT outbox_message('Claim', $1, 'ClaimApproved', '{}')",
                &[&claim.to_string()],
            )
            .await
            .unwrap();
    }
    s.wait_for_messages(5).await;
    relay.stop().await.expect("relay stops cleanly");
    let env = [
        ("OUTBOX_RELAY_OUTBOX_TABLE", ""),
        ("OUTBOX_RELAY_OUTBOX_MESSAGE_PREFIX", "outbox"),
    ];
    let clean = s.verify_with(&[], &env).await;
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
    publish(&s.js().await, "outbox.Claim", h, "{}").await;
    let foreign = s.verify_with(&[], &env).await;
    assert_eq!(
        foreign.status.code(),
        Some(1),
        "{}{}",
        foreign.stdout,
        foreign.stderr
    );
    let json: Value = serde_json::from_str(foreign.stdout.trim()).unwrap();
    assert_exactly(&json, "foreign", 1, "f-1");
}
