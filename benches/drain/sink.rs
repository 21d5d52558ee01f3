//! The sink's limit: async-nats publishing as many messages as the backlog holds, with the relay's
//! subject, headers (`Nats-Msg-Id` a uuid, the three `Outbox-*` values, `Outbox-Commit-Lsn`, and the
//! fence's `Nats-Expected-Last-Sequence`) and payload, through a JetStream context configured like the
//! relay's sink, at the relay's window (4096 publishes in flight, acks awaited in order by a second
//! task). No Postgres: what the relay would reach with an infinitely fast source.
//!
//! [`publish_core`], the publisher of `sink core` (one ack inbox, what the relay does), takes any
//! stream config and headers: the header costs (`drain/headers.rs`) publish through it too.

use std::time::{Duration, Instant};

use std::future::Future;
use std::sync::Arc;

use async_nats::HeaderMap;
use async_nats::jetstream::{self, context::PublishAckFuture, stream};
use bytes::Bytes;
use futures_util::StreamExt;
use tokio::sync::{Semaphore, mpsc};

/// The relay's default `nats.max_in_flight`.
pub(crate) const WINDOW: usize = 4096;

/// The stream as `outbox-relay setup` creates it (src/setup/stream.rs).
pub(crate) fn stream_config(name: &str) -> stream::Config {
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

/// Runs `f` (a publisher) on its own thread with a current-thread runtime, like the relay's, and
/// connects its client there, so the thread's CPU time is the publisher's and its client's:
/// returns `f`'s result and that CPU time in ms.
pub(crate) fn on_own_thread<F, Fut, T>(url: String, f: F) -> anyhow::Result<(T, f64)>
where
    F: FnOnce(async_nats::Client) -> Fut + Send + 'static,
    Fut: Future<Output = anyhow::Result<T>>,
    T: Send + 'static,
{
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        rt.block_on(async move {
            let client = async_nats::connect(url).await?;
            let c0 = thread_cpu_ms();
            let out = f(client).await?;
            Ok((out, thread_cpu_ms() - c0))
        })
    })
    .join()
    .map_err(|_| anyhow::anyhow!("publisher thread panicked"))?
}

/// utime+stime of the calling thread, in ms.
fn thread_cpu_ms() -> f64 {
    super::stat_cpu_ms("/proc/thread-self/stat")
}

/// The relay's headers for message `i` (without the fence's expectation).
fn headers(i: u64) -> HeaderMap {
    let mut h = HeaderMap::new();
    h.insert("Nats-Msg-Id", format!("00000000-0000-4000-8000-{i:012x}"));
    h.insert("Outbox-Event-Type", "OrderPlaced");
    h.insert("Outbox-Aggregate-Type", "Order");
    h.insert("Outbox-Aggregate-Id", format!("order-{}", i + 1));
    h.insert(
        "Outbox-Commit-Lsn",
        format!("0/{:X}", 0x1A00_0000 + i * 520),
    );
    h
}

/// The same messages as [`limit`], as core publishes whose reply subject is the publisher's own
/// inbox with the message's number (`<inbox>.<i>`), one subscription for all acks, awaited in order
/// by a second task: no per-publish inbox, oneshot channel, request map or timer in the client.
pub(crate) async fn limit_core(
    client: async_nats::Client,
    stream_name: &str,
    payload: &str,
    events: u64,
) -> anyhow::Result<f64> {
    let run = publish_core(
        client,
        stream_config(stream_name),
        Bytes::from(payload.to_owned()),
        events,
        None,
        |i| {
            let mut h = headers(i);
            h.insert("Nats-Expected-Last-Sequence", i.to_string());
            h
        },
    )
    .await?;
    Ok(run.eps)
}

/// What [`publish_core`] measured from its first publish to its last ack.
pub(crate) struct CoreRun {
    pub eps: f64,
    /// CPU time of the calling thread: the publisher, the ack reader and the client's connection
    /// task, when it runs on a current-thread runtime of its own ([`on_own_thread`]).
    pub thread_ms: f64,
    /// CPU time of the server process given, NaN without one.
    pub server_ms: f64,
}

/// The core publisher of [`limit_core`], for any stream config and headers: creates the stream,
/// publishes `events` messages to `outbox.Order` with `headers(i)` (an empty map goes out as a
/// plain `PUB`), [`WINDOW`] in flight, each ack checked in order. CPU times are read at the first
/// publish and the last ack, so the stream's creation and the connection are not in them.
pub(crate) async fn publish_core(
    client: async_nats::Client,
    config: stream::Config,
    payload: Bytes,
    events: u64,
    server_pid: Option<u32>,
    mut headers: impl FnMut(u64) -> HeaderMap,
) -> anyhow::Result<CoreRun> {
    let js = jetstream::new(client.clone());
    js.create_stream(config).await?;
    let inbox = client.new_inbox();
    let mut sub = client.subscribe(format!("{inbox}.*")).await?;
    let window = Arc::new(Semaphore::new(WINDOW));
    let server_cpu = || server_pid.map_or(f64::NAN, super::cpu_ms);
    let (s0, c0) = (server_cpu(), thread_cpu_ms());
    let t = Instant::now();
    let freed = Arc::clone(&window);
    let acks = tokio::spawn(async move {
        let mut n = 0u64;
        while n < events {
            let Some(m) = sub.next().await else {
                anyhow::bail!("ack subscription ended after {n}");
            };
            let seq: u64 = m
                .subject
                .rsplit_once('.')
                .and_then(|(_, s)| s.parse().ok())
                .unwrap_or(u64::MAX);
            anyhow::ensure!(seq == n, "ack {seq} arrived where {n} was expected");
            let ack: serde_json::Value = serde_json::from_slice(&m.payload)?;
            anyhow::ensure!(ack.get("error").is_none(), "refused: {ack}");
            n += 1;
            freed.add_permits(1);
        }
        anyhow::Ok(n)
    });
    for i in 0..events {
        window.acquire().await?.forget();
        client
            .publish_with_reply_and_headers(
                "outbox.Order",
                format!("{inbox}.{i}"),
                headers(i),
                payload.clone(),
            )
            .await?;
    }
    let acked = acks.await??;
    let secs = t.elapsed().as_secs_f64();
    let run = CoreRun {
        eps: events as f64 / secs,
        thread_ms: thread_cpu_ms() - c0,
        server_ms: server_cpu() - s0,
    };
    anyhow::ensure!(acked == events, "{acked} of {events} acked");
    Ok(run)
}

/// Publishes `events` messages to a new stream on `client`'s server; returns messages/s from the
/// first publish to the last ack.
pub(crate) async fn limit(
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
        let mut h = headers(i);
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

/// The same messages as [`limit`], published as JetStream atomic batches of `per_batch` (members
/// as core publishes without a reply, the last with `Nats-Batch-Commit` and the fence's
/// expectation on the first), at the same window of messages in flight: what batching can give
/// at best, with no Postgres.
pub(crate) async fn limit_batched(
    client: async_nats::Client,
    stream_name: &str,
    payload: &str,
    events: u64,
    per_batch: u64,
) -> anyhow::Result<f64> {
    let js = jetstream::ContextBuilder::new()
        .timeout(Duration::from_secs(10))
        .max_ack_inflight(WINDOW + 64)
        .backpressure_on_inflight(true)
        .build(client.clone());
    let mut cfg = stream_config(stream_name);
    cfg.allow_atomic_publish = true;
    js.create_stream(cfg).await?;
    let payload = Bytes::from(payload.to_owned());
    let per_batch = per_batch.clamp(1, 1000);
    let window_msgs: u64 = std::env::var("BENCH_BATCH_WINDOW")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(WINDOW as u64);
    // nats-server drops batches past 50 in flight per stream; the relay keeps 40 in flight at most.
    let (window, mut rx) =
        mpsc::channel::<(PublishAckFuture, u64)>((window_msgs / per_batch).clamp(1, 40) as usize);
    let t = Instant::now();
    let acks = tokio::spawn(async move {
        let mut n = 0u64;
        while let Some((ack, size)) = rx.recv().await {
            ack.await?;
            n += size;
        }
        anyhow::Ok(n)
    });
    let mut i = 0u64;
    let mut batch = 0u64;
    while i < events {
        // A closed window means the ack task failed: its error is the one to report.
        let Ok(permit) = window.reserve().await else {
            break;
        };
        batch += 1;
        let size = per_batch.min(events - i);
        let id = format!("bench-{batch}");
        for k in 1..=size {
            let mut h = HeaderMap::new();
            h.insert(
                "Outbox-Event-Id",
                format!("00000000-0000-4000-8000-{i:012x}"),
            );
            h.insert("Outbox-Event-Type", "OrderPlaced");
            h.insert("Outbox-Aggregate-Type", "Order");
            h.insert("Outbox-Aggregate-Id", format!("order-{}", i + 1));
            h.insert(
                "Outbox-Commit-Lsn",
                format!("0/{:X}", 0x1A00_0000 + i * 520),
            );
            h.insert("Nats-Batch-Id", id.as_str());
            h.insert("Nats-Batch-Sequence", k.to_string());
            if k == 1 {
                h.insert("Nats-Expected-Last-Sequence", i.to_string());
            }
            i += 1;
            if k == size {
                h.insert("Nats-Batch-Commit", "1");
                let publish = jetstream::message::PublishMessage::build()
                    .headers(h)
                    .payload(payload.clone());
                permit.send((js.send_publish("outbox.Order", publish).await?, size));
                break;
            }
            client
                .publish_with_headers("outbox.Order", h, payload.clone())
                .await?;
        }
    }
    drop(window);
    let acked = acks.await??;
    let secs = t.elapsed().as_secs_f64();
    anyhow::ensure!(acked == events, "{acked} of {events} acked");
    Ok(events as f64 / secs)
}

/// The same messages as [`limit`] in one fast batch (ADR-50, nats-server 2.14+, stream
/// `allow_batched`) with flow window `flow` ([`super::fast::publish_fast`]: at most two windows
/// beyond the last flow ack, the commit's count and the stream's checked).
pub(crate) async fn limit_fast(
    client: async_nats::Client,
    stream_name: &str,
    payload: &str,
    events: u64,
    flow: u16,
) -> anyhow::Result<f64> {
    let run = super::fast::publish_fast(
        client,
        stream_config(stream_name),
        Bytes::from(payload.to_owned()),
        events,
        None,
        flow,
        2,
        |i| {
            let mut h = headers(i);
            h.insert("Nats-Expected-Last-Sequence", i.to_string());
            h
        },
    )
    .await?;
    Ok(run.eps)
}
