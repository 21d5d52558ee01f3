//! The fixed cost of a JetStream atomic batch in nats-server: sequential batches of 10, 100 and
//! 1,000 members (one in flight, as the relay's `nats.atomic_transactions` sends them), committed
//! by the last member (`Nats-Batch-Commit: 1`) or by an end-of-batch marker that is not stored
//! (`Nats-Batch-Commit: eob`), on a file and on a memory stream. Per variant: nats-server's CPU per
//! batch and per member (utime+stime of its pid from the first publish to the last commit's ack),
//! the publisher's per batch, and batches/s.
//!
//! Why the storage: on a single-replica file stream nats-server stages every batch in a file store
//! of its own (a directory created and removed per batch, `newBatchStore` in
//! `server/jetstream_batching.go`), on a memory stream in a memory store; the difference is the
//! staging's price. The members carry the relay's batch messages: `Outbox-Event-Id` and the
//! descriptive headers (no `Nats-Msg-Id`, which a batch cannot carry), the batch id and sequence,
//! the fence's expectation on the first; the commit's ack must count the batch's members, and the
//! stream must hold them all at the end.
//!
//! `BENCH_ATOMIC_COST_ONLY=1` runs only this (no Postgres). Knobs: `BENCH_ATOMIC_SIZES`
//! (`10,100,1000`), `BENCH_ATOMIC_MEMBERS` (20000: members per variant and round, at least 20
//! batches), `BENCH_ROUNDS` (3); a fresh nats-server per variant, the variants in turn per round.

use async_nats::HeaderMap;
use async_nats::jetstream::{self, stream};
use bytes::Bytes;
use futures_util::StreamExt;
use outbox_relay::testkit::NatsServer;

use super::{STREAM, env_list, env_or, median, shapes, sink};

/// How a batch is committed.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Commit {
    /// The last member carries `Nats-Batch-Commit: 1`.
    Last,
    /// An empty marker after the last member carries `Nats-Batch-Commit: eob` and is not stored.
    Eob,
}

/// What one variant measured.
struct Run {
    batches_per_s: f64,
    server_ms: f64,
    thread_ms: f64,
}

/// A member's headers: the relay's atomic message for event `i`, `k`-th of its batch.
fn member(i: u64, id: &str, k: u64) -> HeaderMap {
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
    h.insert("Nats-Batch-Id", id);
    h.insert("Nats-Batch-Sequence", k.to_string());
    if k == 1 {
        h.insert("Nats-Expected-Last-Sequence", i.to_string());
    }
    h
}

/// Publishes `batches` batches of `size` members one after the other (each commit's ack awaited
/// before the next batch starts) to a new stream with `storage`; checks every commit's count and
/// the stream's total.
#[allow(clippy::too_many_arguments)]
async fn sequential(
    client: async_nats::Client,
    storage: stream::StorageType,
    commit: Commit,
    size: u64,
    batches: u64,
    payload: Bytes,
    server_pid: Option<u32>,
) -> anyhow::Result<Run> {
    let js = jetstream::new(client.clone());
    let mut config = sink::stream_config(STREAM);
    config.storage = storage;
    config.allow_atomic_publish = true;
    js.create_stream(config).await?;
    let inbox = client.new_inbox();
    let mut acks = client.subscribe(inbox.clone()).await?;
    let server_cpu = || server_pid.map_or(f64::NAN, super::cpu_ms);
    let (s0, c0) = (server_cpu(), super::stat_cpu_ms("/proc/thread-self/stat"));
    let t = std::time::Instant::now();
    let mut i = 0u64;
    for b in 0..batches {
        let id = format!("bench-{b}");
        for k in 1..=size {
            let mut h = member(i, &id, k);
            i += 1;
            if k == size && commit == Commit::Last {
                h.insert("Nats-Batch-Commit", "1");
                client
                    .publish_with_reply_and_headers(
                        "outbox.Order",
                        inbox.clone(),
                        h,
                        payload.clone(),
                    )
                    .await?;
            } else {
                client
                    .publish_with_headers("outbox.Order", h, payload.clone())
                    .await?;
            }
        }
        if commit == Commit::Eob {
            let mut h = HeaderMap::new();
            h.insert("Nats-Batch-Id", id.as_str());
            h.insert("Nats-Batch-Sequence", (size + 1).to_string());
            h.insert("Nats-Batch-Commit", "eob");
            client
                .publish_with_reply_and_headers("outbox.Order", inbox.clone(), h, Bytes::new())
                .await?;
        }
        let Some(m) = acks.next().await else {
            anyhow::bail!("ack subscription ended at batch {b}");
        };
        let ack: serde_json::Value = serde_json::from_slice(&m.payload)?;
        anyhow::ensure!(ack.get("error").is_none(), "batch {b} refused: {ack}");
        let count = ack.get("count").and_then(serde_json::Value::as_u64);
        anyhow::ensure!(
            count == Some(size),
            "batch {b}: the commit's ack counts {count:?} of {size}: {ack}"
        );
    }
    let run = Run {
        batches_per_s: batches as f64 / t.elapsed().as_secs_f64(),
        server_ms: server_cpu() - s0,
        thread_ms: super::stat_cpu_ms("/proc/thread-self/stat") - c0,
    };
    let stored = js.get_stream(STREAM).await?.info().await?.state.messages;
    anyhow::ensure!(
        stored == batches * size,
        "the stream holds {stored} of {}",
        batches * size
    );
    Ok(run)
}

#[derive(Default)]
struct Rounds {
    server_us_per_batch: Vec<f64>,
    thread_us_per_batch: Vec<f64>,
    batches_per_s: Vec<f64>,
}

/// See the module docs.
pub(crate) async fn run(rounds: usize) -> anyhow::Result<()> {
    let sizes: Vec<u64> = env_list("BENCH_ATOMIC_SIZES", "10,100,1000")
        .into_iter()
        .map(|s| s.clamp(1, 1000))
        .collect();
    let members: u64 = env_or("BENCH_ATOMIC_MEMBERS", 20_000);
    let payload = Bytes::from(shapes::payload_of(120));
    let mut variants = Vec::new();
    for storage in [stream::StorageType::File, stream::StorageType::Memory] {
        for commit in [Commit::Last, Commit::Eob] {
            for &size in &sizes {
                variants.push((storage, commit, size));
            }
        }
    }
    let label = |(storage, commit, size): (stream::StorageType, Commit, u64)| {
        format!(
            "{} {} x{size}",
            match storage {
                stream::StorageType::File => "file",
                stream::StorageType::Memory => "memory",
            },
            match commit {
                Commit::Last => "commit 1",
                Commit::Eob => "eob",
            }
        )
    };
    println!(
        "atomic batches: {members} members of {} B per variant and round (at least 20 batches), one batch in flight, {rounds} round(s), a fresh nats-server each",
        payload.len()
    );
    let mut results: Vec<Rounds> = variants.iter().map(|_| Rounds::default()).collect();
    for r in 0..rounds {
        for (v, &(storage, commit, size)) in variants.iter().enumerate() {
            let batches = (members / size).max(20);
            let nats = NatsServer::start();
            let (p, pid) = (payload.clone(), nats.pid());
            let (run, _) = sink::on_own_thread(nats.url(), move |c| async move {
                sequential(c, storage, commit, size, batches, p, pid).await
            })?;
            let per_batch = |ms: f64| ms * 1000.0 / batches as f64;
            println!(
                "  round {} {:<20}: {:>7.1} batches/s, nats-server {:>8.1} µs/batch ({:.2} µs/member), publisher {:>7.1} µs/batch",
                r + 1,
                label(variants[v]),
                run.batches_per_s,
                per_batch(run.server_ms),
                per_batch(run.server_ms) / size as f64,
                per_batch(run.thread_ms)
            );
            let m = &mut results[v];
            m.server_us_per_batch.push(per_batch(run.server_ms));
            m.thread_us_per_batch.push(per_batch(run.thread_ms));
            m.batches_per_s.push(run.batches_per_s);
        }
    }
    println!();
    println!(
        "== atomic batches, one in flight: {members} members per variant × {rounds} round(s); medians [per round] =="
    );
    println!(
        "| variant              | nats-server µs/batch [rounds]      | µs/member | publisher µs/batch | batches/s |"
    );
    let mut json = Vec::new();
    for (v, &variant) in variants.iter().enumerate() {
        let m = &results[v];
        let server = median(m.server_us_per_batch.clone());
        let rounds_text = m
            .server_us_per_batch
            .iter()
            .map(|x| format!("{x:.0}"))
            .collect::<Vec<_>>()
            .join(" ");
        println!(
            "| {:<20} | {server:>8.0} [{rounds_text:<24}] | {:>9.2} | {:>18.0} | {:>9.1} |",
            label(variant),
            server / variant.2 as f64,
            median(m.thread_us_per_batch.clone()),
            median(m.batches_per_s.clone())
        );
        json.push(format!(
            r#"{{"variant":"{}","size":{},"nats_us_per_batch":{server:.0},"nats_us_per_member":{:.2},"publisher_us_per_batch":{:.0},"batches_per_s":{:.1}}}"#,
            label(variant),
            variant.2,
            server / variant.2 as f64,
            median(m.thread_us_per_batch.clone()),
            median(m.batches_per_s.clone())
        ));
    }
    println!(
        r#"{{"bench":"atomic","members":{members},"rounds":{rounds},"rows":[{}]}}"#,
        json.join(",")
    );
    Ok(())
}
