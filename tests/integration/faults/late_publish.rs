//! A message stored in the place one of the relay's publishes expected, while later ones are still
//! on their way. A fenced message names the sequence it must follow; a
//! message of another writer, or a publish of an ended session arriving late, that takes that
//! sequence gets it refused, and the next message, which expected exactly the sequence the
//! intruder now holds, used to be stored past the refused one: the stream then held events out
//! of commit order (the relay publishes the refused one again later, so nothing was lost). Every
//! fenced message after a session's first now also names its predecessor's `Nats-Msg-Id`
//! (`Nats-Expected-Last-Msg-Id`), which no intruder carries: nothing is stored past a refused
//! message.
//!
//! Atomic batches (`nats.atomic_transactions`) carry no message id, so they are chained by
//! sequence only; there one batch in flight at a time keeps a later batch from being stored past
//! a refused one (found by the simulation).
//!
//! The intruder is placed by hand: the relay publishes through a proxy that holds what it sends,
//! a message is published directly meanwhile, and the proxy then delivers the relay's.

use std::time::Duration;

use async_nats::jetstream;
use outbox_relay::config::Config;
use tokio::task::block_in_place;
use tokio_postgres::Client;

use super::{assert_all_stored_once_in_order, text_id_db, wait_for_slot, write_backlog};
use crate::support::{
    InProcessRelay, NatsServer, PgServer, Proxy, TestDb, read_all, relay_config, stream_count,
    wait_for,
};

/// A text-id database, a NATS server, a proxy to it, and the relay's config, which publishes
/// through the proxy.
async fn behind_proxy() -> (TestDb, NatsServer, Proxy, Config) {
    let db = text_id_db(PgServer::shared()).await;
    let nats = NatsServer::start();
    let proxy = Proxy::start(nats.port());
    let mut config = relay_config(&db, &nats);
    config.nats.url = proxy.nats_url();
    (db, nats, proxy, config)
}

/// The relay with `config`, fenced (the default) and with an ack timeout long enough that the
/// test's hold of its publishes does not end the session (the expectations are what is tested),
/// started and streaming, once the first three events (`a-…`) are stored: the relay, a client of
/// its database, a JetStream context straight to the server (past the proxy), and their ids.
async fn three_stored(
    db: &TestDb,
    nats: &NatsServer,
    config: &mut Config,
) -> (InProcessRelay, Client, jetstream::Context, Vec<String>) {
    assert!(config.nats.fence, "the fenced stream is the default");
    config.nats.ack_timeout_ms = 15_000;
    let relay = InProcessRelay::start(config.clone());
    let client = db.client().await;
    wait_for_slot(&client, &config.postgres.slot).await;
    wait_for("the relay to stream", Duration::from_secs(30), || async {
        relay.metrics.streaming.get() == 1
    })
    .await;
    let js = nats.jetstream().await;
    let first = block_in_place(|| write_backlog(db, "a", 3));
    let stream = &config.nats.stream;
    wait_for("the first events", Duration::from_secs(30), || async {
        stream_count(&js, stream).await >= 3
    })
    .await;
    (relay, client, js, first)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_stored_in_the_place_of_a_refused_one_lets_nothing_past_it() {
    let (db, nats, proxy, mut config) = behind_proxy().await;
    let (stream, dead_subject) = (
        config.nats.stream.clone(),
        config.nats.dead_letter_subject.clone(),
    );
    let (relay, _client, js, first) = three_stored(&db, &nats, &mut config).await;

    // The session read the tail long ago; what it publishes now is held on the way.
    proxy.blackhole(true);
    let later = block_in_place(|| write_backlog(&db, "b", 3));
    tokio::time::sleep(Duration::from_secs(1)).await;
    // Stored at sequence 4, the one b-000001 expects to follow: b-000001 is refused, and
    // b-000002 expects sequence 4 to be the last.
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Nats-Msg-Id", "published-by-hand-1");
    let ack = js
        .publish_with_headers(dead_subject, headers, "{}".into())
        .await
        .expect("publish by hand")
        .await
        .expect("JetStream stores the hand-published message");
    assert_eq!(
        ack.sequence, 4,
        "the hand-published message took sequence 4"
    );
    proxy.blackhole(false);

    let expected: Vec<String> = first.iter().chain(&later).cloned().collect();
    assert_all_stored_once_in_order(&js, &stream, &expected).await;

    // And it is the chain that kept them out: every relay message after a session's first names
    // the one before it, and the stream holds that one right before it.
    let all = read_all(&js, &stream).await;
    let mut chained = 0;
    for pair in all.windows(2) {
        if let Some(after) = pair[1].headers.get("Nats-Expected-Last-Msg-Id") {
            assert_eq!(
                after,
                pair[0].id(),
                "message {} expects to follow {after}, but follows {}",
                pair[1].seq,
                pair[0].id()
            );
            chained += 1;
        }
    }
    let ids: Vec<(u64, &str, Option<&String>)> = all
        .iter()
        .map(|m| (m.seq, m.id(), m.headers.get("Nats-Expected-Last-Msg-Id")))
        .collect();
    // a-000002, a-000003 (after a-000001) and b-000002, b-000003 (after the new session's first).
    assert!(
        chained >= 4,
        "messages after a session's first carry Nats-Expected-Last-Msg-Id: {ids:?}"
    );
    relay.stop().await.expect("the relay stops cleanly");
}

/// The same intruder under `nats.atomic_transactions`: a batch cannot carry `Nats-Msg-Id` nor an
/// id expectation, so batches are chained by sequence only (`Nats-Expected-Last-Sequence` on each
/// batch's first message). With two batches in flight, A expecting sequence 3 and B expecting 4, a
/// message of another writer stored at 4 gets A refused and B stored right after it: the stream
/// held B before A, out of commit order (P4; found by the simulation). Guards
/// one batch in flight (`MAX_BATCHES_IN_FLIGHT` in src/sink/batch.rs): B is sent only once A is
/// stored, so a refused A holds B back and both are published again, in order.
///
/// The proxy's black hole holds the relay's bytes (it stops reading; the kernel keeps what was
/// written, and the proxy delivers it all, in order, when the hole ends), so with several batches
/// in flight both A and B are on the wire behind the intruder: the test waits until the walsender
/// has sent B's commit to the relay, and a moment more for the relay to send it if it would.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_intruder_in_the_place_of_a_refused_batch_lets_no_later_batch_past_it() {
    let (db, nats, proxy, mut config) = behind_proxy().await;
    config.nats.atomic_transactions = true;
    let (stream, dead_subject) = (
        config.nats.stream.clone(),
        config.nats.dead_letter_subject.clone(),
    );
    let slot = config.postgres.slot.clone();
    let (relay, client, js, first) = three_stored(&db, &nats, &mut config).await;

    proxy.blackhole(true);
    // A (b-000001) then B (b-000002), a batch of one each.
    let later = block_in_place(|| write_backlog(&db, "b", 2));
    let (a, b) = (later[0].as_str(), later[1].as_str());
    let after_b = crate::support::current_wal_lsn(&client).await;
    wait_for(
        "the walsender to send B's commit",
        Duration::from_secs(30),
        || async {
            let sent: Option<String> = client
                .query_one(
                    "SELECT r.sent_lsn::text FROM pg_stat_replication r \
                     JOIN pg_replication_slots s ON s.active_pid = r.pid WHERE s.slot_name = $1",
                    &[&slot],
                )
                .await
                .ok()
                .and_then(|r| r.get(0));
            sent.and_then(|s| s.parse::<outbox_relay::Lsn>().ok())
                .is_some_and(|s| s >= after_b)
        },
    )
    .await;
    // The relay sends a batch as soon as it reads its Commit; with several in flight, B's follows
    // A's onto the wire at once.
    tokio::time::sleep(Duration::from_secs(1)).await;
    // Stored at sequence 4, the one A expects to follow: A is refused, and B expected sequence 4
    // to be the last.
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Nats-Msg-Id", "published-by-hand-1");
    let ack = js
        .publish_with_headers(dead_subject, headers, "{}".into())
        .await
        .expect("publish by hand")
        .await
        .expect("JetStream stores the hand-published message");
    assert_eq!(
        ack.sequence, 4,
        "the hand-published message took sequence 4"
    );
    proxy.blackhole(false);

    // B is stored in any case; A, refused, only by a later session, if at all.
    let position =
        |all: &[crate::support::Stored], id: &str| all.iter().find(|m| m.id() == id).map(|m| m.seq);
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let all = read_all(&js, &stream).await;
        let (at_a, at_b) = (position(&all, a), position(&all, b));
        let shown: Vec<String> = all
            .iter()
            .map(|m| format!("seq {} {} ({})", m.seq, m.id(), m.subject))
            .collect();
        if let Some(at_b) = at_b {
            assert!(
                at_a.is_some_and(|at_a| at_a < at_b),
                "B ({b}) stored at sequence {at_b} before A ({a}, {}): the stream holds B past the \
                 refused A, out of commit order: {shown:#?}",
                at_a.map_or_else(
                    || "not stored yet: it can only come after".to_owned(),
                    |s| format!("sequence {s}")
                )
            );
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "B ({b}) not stored after 60 s: {shown:#?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let expected: Vec<String> = first.iter().chain(&later).cloned().collect();
    let tally = assert_all_stored_once_in_order(&js, &stream, &expected).await;
    tally.report(
        "atomic batches, another writer's message in a batch's place",
        1,
    );
    let all = read_all(&js, &stream).await;
    assert!(
        all.iter()
            .filter(|m| m.seq != ack.sequence)
            .all(|m| m.headers.contains_key("Outbox-Event-Id")
                && !m.headers.contains_key("Nats-Msg-Id")),
        "the relay's messages are batch messages (the id in Outbox-Event-Id): {all:?}"
    );
    eprintln!(
        "atomic intruder: {} restarts; stream {:?}",
        relay.metrics.reconnects.get(),
        all.iter()
            .map(|m| (m.seq, m.id().to_owned()))
            .collect::<Vec<_>>()
    );
    relay.stop().await.expect("the relay stops cleanly");
}
