//! Fast batch publishing (ADR-50, nats-server 2.14+, stream `allow_batched`) against today's
//! per-message acks, measured first: does acking once per flow window instead of once per message
//! save at least 15 % of nats-server's and the publisher's CPU per message together? Below that,
//! a second publishing protocol in the relay is not worth its failure modes.
//!
//! Both publishers send the relay's exact messages (`outbox.Order`, the relay's default headers
//! built by its own functions, `Nats-Msg-Id` and the fence's `Nats-Expected-Last-Sequence`
//! included, the shapes section's 131-byte payload) to a fresh nats-server and stream per variant,
//! on a thread of their own with a current-thread runtime, like the relay: `core` is the `sink
//! core` publisher ([`sink::publish_core`]: one ack inbox, the relay's window of 4096, every ack
//! checked in order); `fast N` is one fast batch with a flow window of N messages
//! ([`publish_fast`]). Per variant, from the first publish to the last ack: msg/s, nats-server's
//! CPU per message (utime+stime of its pid) and the publisher thread's (headers, client, ack
//! reader). The variants run in turn within each round, the first one rotating from round to
//! round, and each `fast` is compared with the `core` of its own round.
//!
//! `BENCH_FAST=1` adds this to a run, `BENCH_FAST_ONLY=1` runs nothing else (no Postgres).
//! Knobs: `BENCH_FAST_EVENTS` (100000) per variant and round, `BENCH_ROUNDS` (3),
//! `BENCH_FAST_FLOWS` (`50,200,500`), `BENCH_FAST_OUTSTANDING` (2: flow windows the publisher may
//! have beyond the last flow ack, the ADR's recommendation).
//!
//! The protocol, as nats-server 2.15 reads it (`server/stream.go`, `getFastBatch`; and
//! `server/jetstream_batching.go`): every message is a core publish whose reply subject is
//! `<prefix>.<batch id>.<flow>.<gap mode>.<batch sequence>.<operation>.$FI`, operation 0 starting
//! the batch (sequence 1), 1 adding, 2 adding and committing, 4 a ping. The server stores each
//! message as it arrives, with the usual per-message checks (the fence, duplicates), and answers on
//! the reply subject: the first message with `{"type":"ack","seq":0,"msgs":M}` (M: the flow it
//! grants, at most 500), then one flow ack `{"type":"ack","seq":S,"msgs":M}` each M messages
//! persisted (all up to S are stored, in gap mode `fail`), a `{"type":"gap",…}` or
//! `{"type":"err",…}` on a missing or refused message (in gap mode `fail` the batch then ends),
//! and the commit's pub ack naming the `batch` and its `count`. Flow acks can be lost (they are
//! core messages): a publisher that waited a second for one sends a ping, which the server answers
//! with the latest.

use std::time::{Duration, Instant};

use async_nats::HeaderMap;
use async_nats::jetstream::{self, stream};
use bytes::Bytes;
use futures_util::StreamExt;
use outbox_relay::testkit::NatsServer;
use tokio::sync::watch;

use super::{STREAM, env_list, env_or, headers, median, shapes, sink};

/// How long the publisher waits for a flow ack before it pings, and how many pings in a row it
/// sends before it gives up on the batch.
const STALL: Duration = Duration::from_secs(1);
const MAX_PINGS: u32 = 10;

/// What [`publish_fast`] measured from its first publish to the commit's ack.
pub(crate) struct FastRun {
    pub eps: f64,
    /// CPU time of the publisher thread (see [`sink::CoreRun::thread_ms`]).
    pub thread_ms: f64,
    /// CPU time of the server process given, NaN without one.
    pub server_ms: f64,
    /// Flow acks received (the first message's answer included).
    pub flow_acks: u64,
    /// Pings sent because a flow ack was late.
    pub pings: u64,
}

/// What the server has said about the batch so far.
#[derive(Clone, Copy, Default)]
struct Flow {
    /// The highest batch sequence the server says is stored.
    acked: u64,
    /// The flow the server grants (messages per flow ack); 0 until its first answer.
    msgs: u64,
}

/// One answer on the batch's reply subject.
enum Reply {
    Flow { seq: u64, msgs: u64 },
    Commit { count: u64 },
}

/// Reads one answer; a gap, a refused message or a refused batch is an error naming it.
fn parse_reply(payload: &[u8]) -> anyhow::Result<Reply> {
    let v: serde_json::Value = serde_json::from_slice(payload)?;
    anyhow::ensure!(v.get("error").is_none(), "fast batch refused: {v}");
    let num = |k: &str| v.get(k).and_then(serde_json::Value::as_u64);
    if v.get("batch").is_some() {
        let count = num("count").ok_or_else(|| anyhow::anyhow!("commit ack without count: {v}"))?;
        return Ok(Reply::Commit { count });
    }
    match v.get("type").and_then(|t| t.as_str()) {
        Some("ack") => match (num("seq"), num("msgs")) {
            (Some(seq), Some(msgs)) => Ok(Reply::Flow { seq, msgs }),
            _ => anyhow::bail!("flow ack without seq/msgs: {v}"),
        },
        _ => anyhow::bail!("fast batch answer not understood (a gap?): {v}"),
    }
}

/// Publishes `events` messages to `outbox.Order` on a new stream (`config` with `allow_batched`)
/// as one fast batch with flow window `flow` in gap mode `fail`, at most `outstanding` windows
/// beyond the last flow ack (only the first message before the server's first answer), the last
/// message committing; then checks that the commit's ack counts every message and that the stream
/// holds them. CPU times as in [`sink::publish_core`].
#[allow(clippy::too_many_arguments)]
pub(crate) async fn publish_fast(
    client: async_nats::Client,
    mut config: stream::Config,
    payload: Bytes,
    events: u64,
    server_pid: Option<u32>,
    flow: u16,
    outstanding: u64,
    mut headers: impl FnMut(u64) -> HeaderMap,
) -> anyhow::Result<FastRun> {
    anyhow::ensure!(events > 0 && outstanding > 0, "nothing to publish");
    let js = jetstream::new(client.clone());
    config.allow_batch_publish = true;
    let name = config.name.clone();
    js.create_stream(config).await?;
    // The inbox's last token is the batch id the server keys the batch by.
    let inbox = client.new_inbox();
    let mut sub = client.subscribe(format!("{inbox}.>")).await?;
    let (tx, mut rx) = watch::channel(Flow::default());
    let server_cpu = || server_pid.map_or(f64::NAN, super::cpu_ms);
    let (s0, c0) = (server_cpu(), super::stat_cpu_ms("/proc/thread-self/stat"));
    let t = Instant::now();
    let reader = tokio::spawn(async move {
        let mut flow_acks = 0u64;
        while let Some(m) = sub.next().await {
            match parse_reply(&m.payload)? {
                Reply::Flow { seq, msgs } => {
                    flow_acks += 1;
                    tx.send_modify(|f| {
                        f.acked = f.acked.max(seq);
                        f.msgs = msgs;
                    });
                }
                Reply::Commit { count } => return Ok((count, flow_acks)),
            }
        }
        anyhow::bail!("ack subscription ended before the commit's ack")
    });
    let reply = |k: u64, op: u8| format!("{inbox}.{flow}.fail.{k}.{op}.$FI");
    let mut pings = 0u64;
    for k in 1..=events {
        let mut stalls = 0;
        loop {
            let open =
                rx.wait_for(|f| k == 1 || (f.msgs > 0 && k <= f.acked + outstanding * f.msgs));
            match tokio::time::timeout(STALL, open).await {
                Ok(Ok(_)) => break,
                // The reader ended (an error answer, or the commit's ack too early): its error.
                Ok(Err(_)) => {
                    return Err(match reader.await? {
                        Err(e) => e,
                        Ok((count, _)) => {
                            anyhow::anyhow!("batch committed at {count} before message {k}")
                        }
                    });
                }
                Err(_) => {
                    stalls += 1;
                    anyhow::ensure!(
                        stalls <= MAX_PINGS,
                        "no flow ack for {MAX_PINGS} s at batch sequence {k}"
                    );
                    pings += 1;
                    client
                        .publish_with_reply("outbox.Order", reply(k - 1, 4), Bytes::new())
                        .await?;
                }
            }
        }
        let op = match k {
            k if k == events => 2,
            1 => 0,
            _ => 1,
        };
        client
            .publish_with_reply_and_headers(
                "outbox.Order",
                reply(k, op),
                headers(k - 1),
                payload.clone(),
            )
            .await?;
    }
    let (count, flow_acks) = reader.await??;
    let secs = t.elapsed().as_secs_f64();
    let run = FastRun {
        eps: events as f64 / secs,
        thread_ms: super::stat_cpu_ms("/proc/thread-self/stat") - c0,
        server_ms: server_cpu() - s0,
        flow_acks,
        pings,
    };
    anyhow::ensure!(
        count == events,
        "the commit's ack counts {count} of {events}"
    );
    let stored = js.get_stream(&name).await?.info().await?.state.messages;
    anyhow::ensure!(stored == events, "the stream holds {stored} of {events}");
    Ok(run)
}

/// One variant's measures per round.
#[derive(Default)]
struct Rounds {
    eps: Vec<f64>,
    nats_us: Vec<f64>,
    client_us: Vec<f64>,
    flow_acks: Vec<u64>,
    pings: Vec<u64>,
}

/// See the module docs.
pub(crate) async fn run(rounds: usize) -> anyhow::Result<()> {
    let events: u64 = env_or("BENCH_FAST_EVENTS", 100_000).max(1);
    let outstanding: u64 = env_or("BENCH_FAST_OUTSTANDING", 2).max(1);
    let flows: Vec<u16> = env_list("BENCH_FAST_FLOWS", "50,200,500")
        .into_iter()
        .map(|f| f.clamp(1, u16::MAX as u64) as u16)
        .collect();
    // Variant 0 is `core`, then one per flow.
    let labels: Vec<String> = std::iter::once("core".to_owned())
        .chain(flows.iter().map(|f| format!("fast {f}")))
        .collect();
    let payload = Bytes::from(shapes::payload_of(120));
    println!(
        "fast batch: {events} messages of {} B per variant and round, {rounds} round(s), the relay's headers, a fresh nats-server each; {outstanding} flow window(s) beyond the last flow ack",
        payload.len()
    );
    let mut results: Vec<Rounds> = labels.iter().map(|_| Rounds::default()).collect();
    for r in 0..rounds {
        for step in 0..labels.len() {
            let v = (r + step) % labels.len();
            let nats = NatsServer::start();
            let (p, pid) = (payload.clone(), nats.pid());
            let config = sink::stream_config(STREAM);
            let h = headers::relay_default(payload.clone())?;
            let (eps, server_ms, thread_ms, acks, pings) = if v == 0 {
                let (run, _) = sink::on_own_thread(nats.url(), move |c| async move {
                    sink::publish_core(c, config, p, events, pid, h).await
                })?;
                (run.eps, run.server_ms, run.thread_ms, events, 0)
            } else {
                let flow = flows[v - 1];
                let (run, _) = sink::on_own_thread(nats.url(), move |c| async move {
                    publish_fast(c, config, p, events, pid, flow, outstanding, h).await
                })?;
                (
                    run.eps,
                    run.server_ms,
                    run.thread_ms,
                    run.flow_acks,
                    run.pings,
                )
            };
            let per = |ms: f64| ms * 1000.0 / events as f64;
            println!(
                "  round {} {:<9}: {eps:>7.0} msg/s, nats-server {:>5.2} µs/msg, publisher {:>5.2} µs/msg, acks {acks}, pings {pings}",
                r + 1,
                labels[v],
                per(server_ms),
                per(thread_ms)
            );
            let m = &mut results[v];
            m.eps.push(eps);
            m.nats_us.push(per(server_ms));
            m.client_us.push(per(thread_ms));
            m.flow_acks.push(acks);
            m.pings.push(pings);
        }
    }
    print(events, rounds, &labels, &results);
    Ok(())
}

fn print(events: u64, rounds: usize, labels: &[String], results: &[Rounds]) {
    let list = |v: &[f64]| {
        v.iter()
            .map(|x| format!("{x:.2}"))
            .collect::<Vec<_>>()
            .join(" ")
    };
    let sums = |m: &Rounds| -> Vec<f64> {
        m.nats_us
            .iter()
            .zip(&m.client_us)
            .map(|(n, c)| n + c)
            .collect()
    };
    // Each round's saving against that round's `core`, in % of core's server + publisher CPU:
    // a busy moment slows both of a pair.
    let core = sums(&results[0]);
    let saving = |m: &Rounds| -> Vec<f64> {
        sums(m)
            .iter()
            .zip(&core)
            .map(|(s, c)| (c - s) / c * 100.0)
            .collect()
    };
    println!();
    println!(
        "== fast batch against per-message acks: {events} msgs × {rounds} round(s); medians [per round]; saving = (core − variant) / core of nats-server + publisher µs/msg, same round =="
    );
    println!(
        "| variant   | msg/s    | nats-server µs/msg        | publisher µs/msg          | sum µs/msg | saving % [rounds]          | acks/round |"
    );
    let mut json = Vec::new();
    for (v, label) in labels.iter().enumerate() {
        let m = &results[v];
        let s = saving(m);
        let saving_text = if v == 0 {
            String::new()
        } else {
            format!(
                "{:+.1} [{}]",
                median(s.clone()),
                s.iter()
                    .map(|x| format!("{x:+.1}"))
                    .collect::<Vec<_>>()
                    .join(" ")
            )
        };
        println!(
            "| {label:<9} | {:>8.0} | {:>5.2} [{:<17}] | {:>5.2} [{:<17}] | {:>10.2} | {saving_text:<26} | {:>10} |",
            median(m.eps.clone()),
            median(m.nats_us.clone()),
            list(&m.nats_us),
            median(m.client_us.clone()),
            list(&m.client_us),
            median(sums(m)),
            m.flow_acks.first().copied().unwrap_or(0)
        );
        json.push(format!(
            r#"{{"variant":"{label}","eps":{:.0},"nats_us":{:.2},"publisher_us":{:.2},"sum_us":{:.2},"saving_pct":{},"pings":{}}}"#,
            median(m.eps.clone()),
            median(m.nats_us.clone()),
            median(m.client_us.clone()),
            median(sums(m)),
            if v == 0 {
                "null".to_owned()
            } else {
                format!("{:.1}", median(s))
            },
            m.pings.iter().sum::<u64>()
        ));
    }
    for (v, label) in labels.iter().enumerate().skip(1) {
        let s = median(saving(&results[v]));
        println!(
            "{label}: saves {s:.1} % of nats-server + publisher CPU per message (worth building at ≥ 15 %: {})",
            if s >= 15.0 { "yes" } else { "no" }
        );
    }
    println!(
        r#"{{"bench":"fast","events":{events},"rounds":{rounds},"rows":[{}]}}"#,
        json.join(",")
    );
}
