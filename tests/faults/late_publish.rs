//! A message stored in the place one of the relay's publishes expected, while later ones are still
//! on their way (issue 33, defect 10). A fenced message names the sequence it must follow; a
//! message of another writer, or a publish of an ended session arriving late, that takes that
//! sequence gets it refused, and the next message, which expected exactly the sequence the
//! intruder now holds, used to be stored past the refused one: the stream then held events out
//! of commit order (the relay publishes the refused one again later, so nothing was lost). Every
//! fenced message after a session's first now also names its predecessor's `Nats-Msg-Id`
//! (`Nats-Expected-Last-Msg-Id`), which no intruder carries: nothing is stored past a refused
//! message.
//!
//! The intruder is placed by hand: the relay publishes through a proxy that holds what it sends,
//! a message is published directly meanwhile, and the proxy then delivers the relay's.

use std::time::Duration;

use outbox_relay::metrics::Metrics;
use tokio::task::block_in_place;

use super::{assert_all_stored_once_in_order, text_id_db, wait_for_slot, write_backlog};
use crate::support::{
    InProcessRelay, NatsServer, PgServer, Proxy, read_all, relay_config, stream_count, wait_for,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_stored_in_the_place_of_a_refused_one_lets_nothing_past_it() {
    let db = text_id_db(PgServer::shared()).await;
    let nats = NatsServer::start();
    let proxy = Proxy::start(nats.port());
    let mut config = relay_config(&db, &nats);
    config.nats.url = proxy.nats_url();
    assert!(config.nats.fence, "the fenced stream is the default");
    // The hold below must not end the session: its expectations are what is tested.
    config.nats.ack_timeout_ms = 15_000;
    let stream = config.nats.stream.clone();
    let dead_subject = config.nats.dead_letter_subject.clone();
    let relay = InProcessRelay::start(config.clone());
    let client = db.client().await;
    wait_for_slot(&client, &config.postgres.slot).await;
    wait_for("the relay to stream", Duration::from_secs(30), || async {
        Metrics::get(&relay.metrics.streaming) == 1
    })
    .await;
    // Directly to the server, past the proxy.
    let js = nats.jetstream().await;

    let first = block_in_place(|| write_backlog(&db, "a", 3));
    wait_for("the first events", Duration::from_secs(30), || async {
        stream_count(&js, &stream).await >= 3
    })
    .await;

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
