//! `outbox-relay verify` against real servers: the relay (in process) publishes the README's story
//! (claim 4711, event e-5531 on `outbox.Claim`) among other events, then each class is planted by
//! hand as another client, an operator or an outage would cause it, and the binary's `--json` must
//! report exactly that class (its count and its example's event id, every other class 0) with its
//! exit code; a clean stream of 100,000 events reports nothing and exits 0.
//!
//! One file a subject: `classes.rs` (the differences of the first round, and a clean stream),
//! `waiting.rs` (the slot decides waiting: a stopped relay, NATS down, a look's bound, a slot that
//! cannot be copied), `dead_letters.rs`, `holes.rs` (holes, the stream's head and its limits),
//! `stream_only.rs` (outboxes without rows), `proof.rs` (`--record` and the prune it gates),
//! `migration.rs` (docs/migrating.md's switch from a polling publisher).

mod classes;
mod dead_letters;
mod holes;
mod migration;
mod proof;
mod stream_only;
mod waiting;

use std::ops::Deref;
use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream;
use serde_json::Value;

use crate::support::{Finished, Scenario, ScenarioBuilder, Stored, run_command, sql_file};

/// The classes of the contract, each a count in `--json` (`in_flight` is `waiting`'s old name).
const CLASSES: [&str; 16] = [
    "missing",
    "in_flight",
    "waiting",
    "unknown",
    "dead_lettered",
    "parked",
    "discarded",
    "holes",
    "duplicates",
    "out_of_order",
    "foreign",
    "misrouted",
    "payload_differs",
    "older_than_stream",
    "stream_only",
    "before_backfill",
];

const STORY_PAYLOAD: &str = r#"{"claim_id": 4711, "status": "approved", "amount_cents": 125000}"#;

/// A scenario with the steps of verify's stories: fillers, e-5531, the relay publishing them, and
/// `verify` run as the binary against the scenario's servers.
struct Story(Scenario);

impl Deref for Story {
    type Target = Scenario;

    fn deref(&self) -> &Scenario {
        &self.0
    }
}

impl Story {
    /// A story on the scenario `builder` makes.
    async fn of(builder: ScenarioBuilder<'_>) -> Story {
        Story(builder.start().await)
    }

    /// A database with the text-id outbox.
    async fn new() -> Story {
        Story::of(Scenario::builder().text_ids()).await
    }

    /// A database with the text-id outbox and `sql/<file>`.
    async fn with_sql_file(file: &str) -> Story {
        Story::of(Scenario::builder().text_ids().sql(&sql_file(file))).await
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

    /// The relay publishes `before` fillers, e-5531, `after` fillers, and stops.
    async fn published(before: u32, after: u32) -> Story {
        let s = Story::new().await;
        let relay = s.relay().await;
        s.fillers(1, before, 100).await;
        s.e5531().await;
        s.fillers(10_000, after, 100).await;
        s.wait_messages(u64::from(before + after + 1)).await;
        relay.stop().await.expect("relay stops cleanly");
        s
    }

    /// `outbox-relay verify --json ARGS` with `env` added to the scenario's: how it ended.
    async fn verify_with(&self, args: &[&str], env: &[(&str, &str)]) -> Finished {
        let mut all = vec!["verify".to_owned(), "--json".to_owned()];
        all.extend(args.iter().map(|a| (*a).to_owned()));
        let mut vars = self.env();
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
        let (code, json, _) = self.verify_env(args, &[]).await;
        (code, json)
    }

    /// `outbox-relay verify --json ARGS` with `env` added: exit code, the object and stderr.
    async fn verify_env(&self, args: &[&str], env: &[(&str, &str)]) -> (i32, Value, String) {
        let done = self.verify_with(args, env).await;
        let code = done.status.code().expect("verify exited");
        let json: Value = serde_json::from_str(done.stdout.trim()).unwrap_or_else(|e| {
            panic!(
                "verify printed no JSON ({e}), exit {code}\nstdout: {}\nstderr: {}",
                done.stdout, done.stderr
            )
        });
        println!("verify {args:?}: exit {code}: {json}");
        (code, json, done.stderr)
    }

    /// The relay publishes the filler events `fillers` (five a transaction) and stops.
    async fn relay_publishes(&self, fillers: std::ops::Range<u32>) {
        let relay = self.relay().await;
        let n = fillers.end - fillers.start;
        self.fillers(fillers.start, n, 5).await;
        self.wait_messages(u64::from(n)).await;
        relay.stop().await.expect("relay stops cleanly");
    }

    /// Waits until the relay's slot has confirmed everything written so far.
    async fn wait_all_confirmed(&self) {
        let end = self.wal_lsn().await;
        self.wait_confirmed("the slot confirmed past the last event", end)
            .await;
    }

    async fn stream(&self) -> jetstream::stream::Stream {
        self.js.get_stream(&self.stream).await.unwrap()
    }

    /// The stream sequence of the message with event id `id`.
    async fn seq_of(&self, id: &str) -> u64 {
        self.read_all()
            .await
            .iter()
            .find(|m| m.id() == id)
            .unwrap_or_else(|| panic!("{id} stored"))
            .seq
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

/// Every class is 0 but those of `counts`, which have their count.
fn assert_counts(json: &Value, counts: &[(&str, u64)]) {
    for c in CLASSES {
        let want = counts.iter().find(|(k, _)| *k == c).map_or(0, |(_, n)| *n);
        let want = match c {
            "in_flight" => counts
                .iter()
                .find(|(k, _)| *k == "waiting")
                .map_or(0, |x| x.1),
            _ => want,
        };
        assert_eq!(json[c], want, "{c} in {json}");
    }
}

/// Every class is 0 but `class`, which is `n` with `event_id` as its first example.
fn assert_exactly(json: &Value, class: &str, n: u64, event_id: &str) {
    assert_counts(json, &[(class, n)]);
    assert_eq!(json["examples"][class][0]["event_id"], event_id, "{json}");
}
