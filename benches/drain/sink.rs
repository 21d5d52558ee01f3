//! The sink's limit: async-nats publishing as many messages as the backlog holds, with the relay's
//! subject, headers (`Nats-Msg-Id` a uuid, the three `Outbox-*` values, `Outbox-Commit-Lsn`, and the
//! fence's `Nats-Expected-Last-Sequence`) and payload, through a JetStream context configured like the
//! relay's sink, at the relay's window (4096 publishes in flight, acks awaited in order by a second
//! task). No Postgres: what the relay would reach with an infinitely fast source.

use std::time::{Duration, Instant};

use async_nats::HeaderMap;
use async_nats::jetstream::{self, context::PublishAckFuture, stream};
use bytes::Bytes;
use tokio::sync::mpsc;

/// The relay's default `nats.max_in_flight`.
pub const WINDOW: usize = 4096;

/// The stream as `outbox-relay setup` creates it (src/setup.rs).
pub fn stream_config(name: &str) -> stream::Config {
    stream::Config {
        name: name.to_owned(),
        subjects: vec!["outbox.*".into(), "outbox_dead_letter".into()],
        storage: stream::StorageType::File,
        retention: stream::RetentionPolicy::Limits,
        discard: stream::DiscardPolicy::New,
        duplicate_window: Duration::from_secs(120),
        num_replicas: 1,
        ..Default::default()
    }
}

/// Publishes `events` messages to a new stream on `client`'s server; returns messages/s from the
/// first publish to the last ack.
pub async fn limit(
    client: async_nats::Client,
    stream_name: &str,
    payload: &str,
    events: u64,
) -> anyhow::Result<f64> {
    let js = jetstream::ContextBuilder::new()
        .timeout(Duration::from_secs(10))
        .max_ack_inflight(WINDOW + 64)
        .backpressure_on_inflight(true)
        .build(client);
    js.create_stream(stream_config(stream_name)).await?;
    let payload = Bytes::from(payload.to_owned());
    let (window, mut rx) = mpsc::channel::<PublishAckFuture>(WINDOW);
    let t = Instant::now();
    let acks = tokio::spawn(async move {
        let mut n = 0u64;
        while let Some(ack) = rx.recv().await {
            ack.await?;
            n += 1;
        }
        anyhow::Ok(n)
    });
    for i in 0..events {
        let permit = window.reserve().await?;
        let mut h = HeaderMap::new();
        h.insert("Nats-Msg-Id", format!("00000000-0000-4000-8000-{i:012x}"));
        h.insert("Outbox-Event-Type", "OrderPlaced");
        h.insert("Outbox-Aggregate-Type", "Order");
        h.insert("Outbox-Aggregate-Id", format!("order-{}", i + 1));
        h.insert(
            "Outbox-Commit-Lsn",
            format!("0/{:X}", 0x1A00_0000 + i * 520),
        );
        h.insert("Nats-Expected-Last-Sequence", i.to_string());
        let publish = jetstream::message::PublishMessage::build()
            .headers(h)
            .payload(payload.clone());
        permit.send(js.send_publish("outbox.Order", publish).await?);
    }
    drop(window);
    let acked = acks.await??;
    let secs = t.elapsed().as_secs_f64();
    anyhow::ensure!(acked == events, "{acked} of {events} acked");
    Ok(events as f64 / secs)
}
