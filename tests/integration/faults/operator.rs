//! An operator deletes the JetStream stream under the running relay and recreates it 3 s later: the
//! events written while it was missing are not skipped; they arrive once it is back (P1).

use std::time::Duration;

use super::{Writer, assert_all_stored_once_in_order_within, text_id_db, wait_for_slot};
use crate::support::{InProcessRelay, NatsServer, PgServer, relay_config, stream_count, wait_for};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_deleted_and_recreated_while_the_relay_runs() {
    let db = text_id_db(PgServer::shared()).await;
    let nats = NatsServer::start();
    let config = relay_config(&db, &nats);
    let stream = config.nats.stream.clone();
    let relay = InProcessRelay::start(config.clone());
    let client = db.client().await;
    wait_for_slot(&client, &config.postgres.slot).await;
    let js = nats.jetstream().await;
    let writer = Writer::start(db.url(), "e", 50);
    tokio::time::sleep(Duration::from_secs(3)).await;
    // Let the relay catch up, so "before the delete" and "after" are clear cut.
    writer.pause(true);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let before = stream_count(&js, &stream).await;
    wait_for("the relay to catch up", Duration::from_secs(30), || async {
        relay.metrics.in_flight.get() == 0 && stream_count(&js, &stream).await >= before
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let before = stream_count(&js, &stream).await as usize;
    js.delete_stream(&stream).await.expect("delete stream");
    writer.pause(false);
    tokio::time::sleep(Duration::from_secs(3)).await;
    outbox_relay::setup::setup(&config.validate().unwrap())
        .await
        .expect("recreate the stream");
    tokio::time::sleep(Duration::from_secs(3)).await;
    let all = writer.stop().await;
    assert!(
        before > 0 && before < all.len(),
        "{before} of {}",
        all.len()
    );
    let expected = &all[before..];
    let t = assert_all_stored_once_in_order_within(&js, &stream, expected, Duration::from_secs(60))
        .await;
    // Each session starts from the slot's own position on the server, which trails what the relay
    // confirmed by up to a status interval: the last few events before the delete can come again,
    // into a stream that no longer remembers their ids. Anything else is not allowed.
    let stored = crate::support::read_all(&js, &stream).await;
    let after: std::collections::HashSet<&str> = expected.iter().map(String::as_str).collect();
    let extra: Vec<&str> = stored
        .iter()
        .map(|m| m.id())
        .filter(|id| !after.contains(id))
        .collect();
    let last_before = &all[before.saturating_sub(extra.len())..before];
    assert!(
        extra.iter().all(|id| last_before.iter().any(|b| b == id)),
        "the recreated stream holds the events after the delete and at most the last few before it \
         (republished from the slot's position): extra {extra:?}, the last before the delete {last_before:?}"
    );
    assert_eq!(stored.len(), expected.len() + extra.len());
    eprintln!(
        "stream delete: {before} events before the delete (gone with the stream), {} after, {} reconnects",
        expected.len(),
        relay.metrics.reconnects.get()
    );
    t.report("stream deleted, recreated 3 s later", 1);
    relay.stop().await.expect("relay stops cleanly");
}
