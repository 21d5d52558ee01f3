//! Answers planted on the relay's inbox that used to confirm an event nobody stored. Another client
//! of the relay's account takes the relay's publishes (no stream captures their subject while it
//! plants, so JetStream never answers them) and answers them itself, on the reply subject it saw:
//!
//! - "duplicate" of a sequence the stream never reached (`seq: 999999999`): a missing message
//!   counted as "gone since", so the ack passed;
//! - two different answers for one publish, a refusal and then an ack: the last one won;
//! - "duplicate" for an atomic batch's commit, naming a message gone since: a batch cannot be a
//!   duplicate, yet the batch was confirmed;
//! - a perfect ack, naming the relay's stream and exactly the sequence the message expected to take:
//!   every check of the answer passed, and the slot was confirmed past a message the stream never
//!   stored.
//!
//! Each test checks that the slot is never confirmed past the planted event, then takes the planter
//! away, gives the stream its subjects back and waits for the event to be stored once.

use std::time::{Duration, Instant};

use async_nats::jetstream;
use bytes::Bytes;
use futures_util::StreamExt;
use outbox_relay::Lsn;
use outbox_relay::config::Config;
use tokio::task::JoinHandle;

use super::{LIMIT, good, messages, start_streaming, text_id_db};
use crate::support::{NatsServer, confirmed_flush, relay_config};

/// How long the slot must stay behind the planted event.
const WATCH: Duration = Duration::from_secs(6);

/// The stream's subjects become `subjects`.
async fn set_subjects(js: &jetstream::Context, stream: &str, subjects: Vec<String>) {
    let mut s = js.get_stream(stream).await.expect("stream");
    let mut config = s.info().await.expect("stream info").config.clone();
    config.subjects = subjects;
    js.update_stream(config)
        .await
        .expect("update the stream's subjects");
}

/// A relayed message as the planter saw it.
struct Seen {
    reply: Option<String>,
    headers: async_nats::HeaderMap,
}

impl Seen {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(|v| v.as_str())
    }
}

/// The relay streaming into a stream that holds `before` events, and a planter: the stream then
/// covers only the dead-letter subject, and `plant` answers each batch of `per_round` relayed
/// messages (the relay's publishes to `outbox.>`) with answers `(reply subject, payload)` of its
/// choice. Returns the planter's task; it stops after `rounds` rounds.
struct Planted {
    /// Dropping it drops the database.
    _db: crate::support::TestDb,
    config: Config,
    relay: crate::support::InProcessRelay,
    js: jetstream::Context,
    client: tokio_postgres::Client,
    subjects: Vec<String>,
    planter: JoinHandle<()>,
    /// The commit LSN (`Outbox-Commit-Lsn`) of each round the planter answered.
    commits: tokio::sync::mpsc::UnboundedReceiver<Lsn>,
}

type Plant = fn(&str, &[Seen]) -> Vec<(String, String)>;

async fn planted(
    nats: &NatsServer,
    atomic: bool,
    before: &[&str],
    per_round: usize,
    rounds: usize,
    plant: Plant,
) -> Planted {
    let db = text_id_db().await;
    let mut config = relay_config(&db, nats);
    config.postgres.status_interval_ms = 100;
    config.nats.atomic_transactions = atomic;
    // Keep the restarts behind planted answers short: they are every session's end here.
    config.nats.ack_timeout_ms = 1000;
    let client = db.client().await;
    let relay = start_streaming(&config).await;
    let js = nats.jetstream().await;
    let stream = config.nats.stream.clone();
    for id in before {
        good(&client, id).await;
    }
    messages(&js, &stream, before.len()).await;
    let mut s = js.get_stream(&stream).await.expect("stream");
    let subjects = s.info().await.expect("stream info").config.subjects.clone();
    let planter = nats.client().await;
    let mut sub = planter.subscribe("outbox.>").await.expect("subscribe");
    planter.flush().await.expect("flush");
    set_subjects(&js, &stream, vec![config.nats.dead_letter_subject.clone()]).await;
    let name = stream.clone();
    let (tx, commits) = tokio::sync::mpsc::unbounded_channel();
    let planter = tokio::spawn(async move {
        for _ in 0..rounds {
            let mut seen = Vec::new();
            while seen.len() < per_round {
                let Ok(Some(m)) = tokio::time::timeout(LIMIT, sub.next()).await else {
                    return;
                };
                seen.push(Seen {
                    reply: m.reply.map(|r| r.to_string()),
                    headers: m.headers.unwrap_or_default(),
                });
            }
            for (reply, payload) in plant(&name, &seen) {
                planter
                    .publish(reply, Bytes::from(payload))
                    .await
                    .expect("plant");
            }
            planter.flush().await.expect("flush");
            let _ = tx.send(commit_lsn(&seen));
        }
    });
    Planted {
        _db: db,
        config,
        relay,
        js,
        client,
        subjects,
        planter,
        commits,
    }
}

impl Planted {
    /// Writes `ids` in one transaction; returns its commit LSN as the relay's messages name it,
    /// once the planter has answered them.
    async fn write(&mut self, ids: &[&str]) -> Lsn {
        let values = ids
            .iter()
            .map(|id| format!("('{id}', 'Claim', '4711', 'ClaimApproved', '{{}}')"))
            .collect::<Vec<_>>()
            .join(", ");
        self.client
            .batch_execute(&format!(
                "INSERT INTO public.outbox (event_id, aggregate_type, aggregate_id, event_type, payload) \
                 VALUES {values}"
            ))
            .await
            .expect("insert");
        tokio::time::timeout(LIMIT, self.commits.recv())
            .await
            .expect("the planter answers the relay's publishes")
            .expect("the planter runs")
    }

    /// The slot stays at or behind `lsn` (the planted events' commit) for [`WATCH`]; then the planter
    /// goes, the stream gets its subjects back, and `ids` are stored, once each.
    async fn assert_nothing_confirmed_then_stored(self, lsn: Lsn, ids: &[&str], before: usize) {
        let slot = &self.config.postgres.slot;
        let until = Instant::now() + WATCH;
        while Instant::now() < until {
            let confirmed = confirmed_flush(&self.client, slot).await.expect("slot");
            assert!(
                confirmed <= lsn,
                "the slot was confirmed to {confirmed}, past the commit {lsn} of events nobody stored"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        self.planter.abort();
        let stream = &self.config.nats.stream;
        set_subjects(&self.js, stream, self.subjects.clone()).await;
        let all = messages(&self.js, stream, before + ids.len()).await;
        let mut got: Vec<&str> = all.iter().map(|m| m.id()).collect();
        got.sort_unstable();
        let mut want: Vec<&str> = ids.to_vec();
        want.sort_unstable();
        assert_eq!(
            &got[got.len() - ids.len()..],
            &want[..],
            "stored once after the planter left"
        );
        assert_eq!(got.len(), before + ids.len(), "nothing twice: {got:?}");
        self.relay.stop().await.expect("relay stops cleanly");
    }
}

/// The commit LSN the relay's messages name (`Outbox-Commit-Lsn`), from what the planter saw.
fn commit_lsn(seen: &[Seen]) -> Lsn {
    let text = seen[0]
        .header("Outbox-Commit-Lsn")
        .expect("Outbox-Commit-Lsn");
    text.parse().expect("an LSN")
}

#[tokio::test]
async fn a_duplicate_of_a_sequence_the_stream_never_reached_confirms_nothing() {
    let nats = NatsServer::start();
    let mut p = planted(&nats, false, &["before-1"], 1, 50, |stream, seen| {
        vec![(
            seen[0].reply.clone().expect("a reply subject"),
            format!(r#"{{"stream":"{stream}","seq":999999999,"duplicate":true}}"#),
        )]
    })
    .await;
    let lsn = p.write(&["victim-1"]).await;
    p.assert_nothing_confirmed_then_stored(lsn, &["victim-1"], 1)
        .await;
}

#[tokio::test]
async fn two_different_answers_for_one_publish_confirm_nothing() {
    let nats = NatsServer::start();
    // The second event's refusal, then an ack for it in the sequence it expected, then the first
    // event's ack: the answers for the second wait while the first is awaited.
    let mut p = planted(&nats, false, &["before-1"], 2, 50, |stream, seen| {
        let expected = |s: &Seen| -> u64 {
            s.header("Nats-Expected-Last-Sequence")
                .expect("fenced")
                .parse()
                .expect("a number")
        };
        let reply = |s: &Seen| s.reply.clone().expect("a reply subject");
        vec![
            (
                reply(&seen[1]),
                r#"{"error":{"code":503,"err_code":10077,"description":"maximum messages exceeded"}}"#
                    .to_owned(),
            ),
            (
                reply(&seen[1]),
                format!(r#"{{"stream":"{stream}","seq":{}}}"#, expected(&seen[1]) + 1),
            ),
            (
                reply(&seen[0]),
                format!(r#"{{"stream":"{stream}","seq":{}}}"#, expected(&seen[0]) + 1),
            ),
        ]
    })
    .await;
    let lsn = p.write(&["victim-1", "victim-2"]).await;
    p.assert_nothing_confirmed_then_stored(lsn, &["victim-1", "victim-2"], 1)
        .await;
}

#[tokio::test]
async fn a_duplicate_answer_to_an_atomic_batch_commit_confirms_nothing() {
    let nats = NatsServer::start();
    // Two events stored, the first deleted since: "gone" at a sequence the stream has reached.
    let mut p = planted(
        &nats,
        true,
        &["before-1", "before-2"],
        2,
        50,
        |stream, seen| {
            let commit = seen
                .iter()
                .find(|s| s.reply.is_some())
                .expect("the batch commit has a reply subject");
            vec![(
                commit.reply.clone().unwrap(),
                format!(r#"{{"stream":"{stream}","seq":1,"duplicate":true}}"#),
            )]
        },
    )
    .await;
    let s =
        p.js.get_stream(&p.config.nats.stream)
            .await
            .expect("stream");
    s.delete_message(1).await.expect("delete message 1");
    let lsn = p.write(&["victim-1", "victim-2"]).await;
    p.assert_nothing_confirmed_then_stored(lsn, &["victim-1", "victim-2"], 1)
        .await;
}

#[tokio::test]
async fn a_perfect_ack_for_a_message_never_stored_confirms_nothing() {
    let nats = NatsServer::start();
    // The ack JetStream would send had it stored the message: the stream, and the sequence after
    // the one the message expected. Only reading the stream shows that nothing is there.
    let mut p = planted(&nats, false, &["before-1"], 1, 50, |stream, seen| {
        let expected: u64 = seen[0]
            .header("Nats-Expected-Last-Sequence")
            .expect("fenced")
            .parse()
            .expect("a number");
        vec![(
            seen[0].reply.clone().expect("a reply subject"),
            format!(r#"{{"stream":"{stream}","seq":{}}}"#, expected + 1),
        )]
    })
    .await;
    let lsn = p.write(&["victim-1"]).await;
    p.assert_nothing_confirmed_then_stored(lsn, &["victim-1"], 1)
        .await;
}
