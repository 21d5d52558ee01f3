//! Commit → consumer latency under a steady rate, and where the slow events lost their time.
//!
//! Writers commit single-event transactions on a fixed schedule; an ordered consumer records when each
//! event id arrives. Latency is the receive time minus the moment the writer's COMMIT returned. To
//! tell a stall of the relay's path from one of the box, each event's time is split at the moment
//! JetStream stored it (the stream message's timestamp, the server's clock on the same host):
//! *upstream* is COMMIT → stored (walsender, relay, nats-server's ingest and file store), *delivery*
//! is stored → consumer. Alongside, a thread samples the kernel's pressure stall information
//! (`/proc/pressure/{cpu,io}`, the time some task waited for a CPU or for I/O) every 100 ms, so the
//! seconds that hold slow events can be compared with the rest of the phase.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::bail;
use async_nats::jetstream::{self, consumer::DeliverPolicy, consumer::pull::OrderedConfig};
use futures_util::StreamExt;
use outbox_relay::testkit::{NatsServer, TestDb};

use super::{PAYLOAD, STREAM};

/// Over this, an event counts as slow (the latency goal's bound).
const SLOW_MS: f64 = 20.0;

pub(crate) struct Latency {
    pub(crate) count: usize,
    /// Events over 20 ms, and the seconds into the phase of the first and last of them (one stall
    /// or spread out?).
    pub(crate) slow: usize,
    pub(crate) slow_span_s: (f64, f64),
    pub(crate) missing: usize,
    pub(crate) achieved: f64,
    pub(crate) p50_ms: f64,
    pub(crate) p99_ms: f64,
    pub(crate) max_ms: f64,
    pub(crate) parts: Parts,
}

/// Where the time went.
#[derive(Default)]
pub(crate) struct Parts {
    /// p99 of COMMIT → stored, of stored → consumer, and of the writer's own INSERT + COMMIT round
    /// trip (a slow commit means the database itself stalled).
    pub(crate) upstream_p99_ms: f64,
    pub(crate) delivery_p99_ms: f64,
    pub(crate) write_p99_ms: f64,
    /// Of the slow events: how many spent most of their time upstream, and how many were written
    /// by a commit that itself took over 20 ms.
    pub(crate) slow_upstream: usize,
    pub(crate) slow_after_slow_commit: usize,
    /// Stall time per second (ms/s, summed over all tasks as the kernel counts "some"): CPU and I/O,
    /// over the whole phase and over the seconds that hold slow events.
    pub(crate) cpu_some: f64,
    pub(crate) io_some: f64,
    pub(crate) cpu_some_slow: f64,
    pub(crate) io_some_slow: f64,
}

/// What one event saw.
#[derive(Clone, Copy)]
struct Written {
    at: Instant,
    wall_ns: i128,
    write_ms: f64,
}

#[derive(Clone, Copy)]
struct Received {
    at: Instant,
    stored_ns: i128,
}

fn wall_ns() -> i128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as i128)
}

/// Writers commit transactions of `per_txn` events at `rate` transactions/s for `secs`; an ordered
/// consumer records when each id arrives (`Nats-Msg-Id`, or `Outbox-Event-Id` on atomic batches).
/// Event ids are `<phase>-…-<index>` uuids so phases never mix.
pub(crate) async fn latency(
    db: &TestDb,
    nats: &NatsServer,
    rate: u64,
    secs: u64,
    phase: u32,
    per_txn: u64,
) -> anyhow::Result<Latency> {
    let per_txn = per_txn.max(1) as usize;
    let txns = (rate * secs) as usize;
    let total = txns * per_txn;
    let js = jetstream::new(nats.client().await);
    let stream = js.get_stream(STREAM).await?;
    let consumer = stream
        .create_consumer(OrderedConfig {
            deliver_policy: DeliverPolicy::New,
            ..Default::default()
        })
        .await?;
    let mut messages = consumer.messages().await?;
    let received: Arc<Mutex<HashMap<usize, Received>>> = Arc::default();
    let prefix = format!("{phase:08x}-");
    let reader = {
        let received = Arc::clone(&received);
        tokio::spawn(async move {
            while let Some(Ok(m)) = messages.next().await {
                let now = Instant::now();
                let stored_ns = m.info().map_or(0, |i| i.published.unix_timestamp_nanos());
                let id = m
                    .headers
                    .as_ref()
                    .and_then(|h| h.get("Nats-Msg-Id").or_else(|| h.get("Outbox-Event-Id")))
                    .map(|v| v.as_str().to_owned())
                    .unwrap_or_default();
                if let Some(rest) = id.strip_prefix(&prefix)
                    && let Some(i) = rest
                        .rsplit('-')
                        .next()
                        .and_then(|x| usize::from_str_radix(x, 16).ok())
                {
                    received
                        .lock()
                        .unwrap()
                        .insert(i, Received { at: now, stored_ns });
                }
            }
        })
    };
    let pressure = Pressure::start();

    // Enough connections that one slow commit does not hold up the schedule: each writes every
    // `writers`-th event at its scheduled time.
    let writers = (rate / 250).clamp(4, 32) as usize;
    let committed: Arc<Mutex<Vec<Option<Written>>>> = Arc::new(Mutex::new(vec![None; total]));
    let start = tokio::time::Instant::now() + Duration::from_millis(200);
    let mut tasks = Vec::new();
    for w in 0..writers {
        let client = db.client().await;
        let committed = Arc::clone(&committed);
        tasks.push(tokio::spawn(async move {
            let insert = client
                .prepare(
                    "INSERT INTO public.outbox (event_id, aggregate_type, aggregate_id, event_type, payload) \
                     VALUES ($1::text::uuid, 'Order', $2, 'OrderPlaced', $3::text::jsonb)",
                )
                .await?;
            // A transaction of several events: one statement, its rows from an array of ids.
            let insert_many = client
                .prepare(
                    "INSERT INTO public.outbox (event_id, aggregate_type, aggregate_id, event_type, payload) \
                     SELECT unnest($1::text[])::uuid, 'Order', $2, 'OrderPlaced', $3::text::jsonb",
                )
                .await?;
            let mut t = w;
            while t < txns {
                let due = start + Duration::from_nanos(t as u64 * 1_000_000_000 / rate);
                tokio::time::sleep_until(due).await;
                let first = t * per_txn;
                let agg = format!("order-{t}");
                let sent = Instant::now();
                if per_txn == 1 {
                    let id = format!("{phase:08x}-0000-4000-8000-{first:012x}");
                    client.execute(&insert, &[&id, &agg, &PAYLOAD]).await?;
                } else {
                    let ids: Vec<String> = (first..first + per_txn)
                        .map(|i| format!("{phase:08x}-0000-4000-8000-{i:012x}"))
                        .collect();
                    client.execute(&insert_many, &[&ids, &agg, &PAYLOAD]).await?;
                }
                let at = Instant::now();
                let written = Written {
                    at,
                    wall_ns: wall_ns(),
                    write_ms: at.duration_since(sent).as_secs_f64() * 1000.0,
                };
                let mut committed = committed.lock().unwrap();
                for slot in &mut committed[first..first + per_txn] {
                    *slot = Some(written);
                }
                t += writers;
            }
            anyhow::Ok(())
        }));
    }
    let t = Instant::now();
    for task in tasks {
        task.await??;
    }
    let achieved = total as f64 / (t.elapsed().as_secs_f64() - 0.2).max(1e-3);
    // Let the last events arrive.
    let deadline = Instant::now() + Duration::from_secs(10);
    while received.lock().unwrap().len() < total && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    reader.abort();
    let samples = pressure.stop();
    let received = received.lock().unwrap();
    let committed = committed.lock().unwrap();
    summarize(&committed, &received, &samples, total, achieved, rate)
}

fn summarize(
    committed: &[Option<Written>],
    received: &HashMap<usize, Received>,
    samples: &[Sample],
    total: usize,
    achieved: f64,
    rate: u64,
) -> anyhow::Result<Latency> {
    let first = committed.iter().flatten().map(|w| w.at).min();
    let since_first = |w: &Written| first.map_or(0.0, |f| w.at.duration_since(f).as_secs_f64());
    // (latency, upstream, delivery, write) in ms, per event that arrived.
    let mut events: Vec<(f64, f64, f64, f64, f64)> = Vec::new();
    for (i, w) in committed.iter().enumerate() {
        let (Some(w), Some(r)) = (w, received.get(&i)) else {
            continue;
        };
        // A consumer can see an event before its writer sees COMMIT return: count that as 0.
        let total_ms = r.at.saturating_duration_since(w.at).as_secs_f64() * 1000.0;
        let upstream = ((r.stored_ns - w.wall_ns) as f64 / 1e6).max(0.0);
        let delivery = (total_ms - upstream).max(0.0);
        events.push((total_ms, upstream, delivery, w.write_ms, since_first(w)));
    }
    if events.is_empty() {
        bail!("no event of the {rate}/s phase arrived");
    }
    let slow: Vec<_> = events.iter().filter(|e| e.0 > SLOW_MS).collect();
    let slow_span_s = (
        slow.iter().map(|e| e.4).fold(f64::INFINITY, f64::min),
        slow.iter().map(|e| e.4).fold(0.0, f64::max),
    );
    let p = |mut v: Vec<f64>, q: f64| {
        v.sort_by(f64::total_cmp);
        v[((v.len() as f64 * q) as usize).min(v.len() - 1)]
    };
    let col = |k: fn(&(f64, f64, f64, f64, f64)) -> f64| events.iter().map(k).collect::<Vec<_>>();
    let lat = col(|e| e.0);
    // The seconds of the phase (counted from the first commit) that hold a slow event.
    let slow_secs: std::collections::HashSet<u64> = slow.iter().map(|e| e.4 as u64).collect();
    let origin = first.unwrap_or_else(Instant::now);
    let (all, in_slow) = pressure_rates(samples, origin, &slow_secs);
    Ok(Latency {
        count: events.len(),
        slow: slow.len(),
        slow_span_s,
        missing: total - events.len(),
        achieved,
        p50_ms: p(lat.clone(), 0.50),
        p99_ms: p(lat.clone(), 0.99),
        max_ms: lat.iter().copied().fold(0.0, f64::max),
        parts: Parts {
            upstream_p99_ms: p(col(|e| e.1), 0.99),
            delivery_p99_ms: p(col(|e| e.2), 0.99),
            write_p99_ms: p(col(|e| e.3), 0.99),
            slow_upstream: slow.iter().filter(|e| e.1 >= e.2).count(),
            slow_after_slow_commit: slow.iter().filter(|e| e.3 > SLOW_MS).count(),
            cpu_some: all.0,
            io_some: all.1,
            cpu_some_slow: in_slow.0,
            io_some_slow: in_slow.1,
        },
    })
}

/// One reading of the pressure counters (cumulative µs of "some" stall).
#[derive(Clone, Copy)]
struct Sample {
    at: Instant,
    cpu_us: u64,
    io_us: u64,
}

/// Samples `/proc/pressure/{cpu,io}` every 100 ms on a thread of its own until stopped.
struct Pressure {
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<Vec<Sample>>,
}

impl Pressure {
    fn start() -> Pressure {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stop);
        let thread = std::thread::spawn(move || {
            let mut out = Vec::new();
            while !flag.load(Ordering::Relaxed) {
                if let (Some(cpu_us), Some(io_us)) = (some_total("cpu"), some_total("io")) {
                    out.push(Sample {
                        at: Instant::now(),
                        cpu_us,
                        io_us,
                    });
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            out
        });
        Pressure { stop, thread }
    }

    fn stop(self) -> Vec<Sample> {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.join().unwrap_or_default()
    }
}

/// The `total=` of the `some` line of `/proc/pressure/<what>`; `None` without PSI.
fn some_total(what: &str) -> Option<u64> {
    let text = std::fs::read_to_string(format!("/proc/pressure/{what}")).ok()?;
    let line = text.lines().find(|l| l.starts_with("some"))?;
    line.split_whitespace()
        .find_map(|f| f.strip_prefix("total="))?
        .parse()
        .ok()
}

/// Stall ms per second of CPU and I/O, over every sample interval and over those in `slow_secs`
/// (seconds since `origin`). NaN without samples.
fn pressure_rates(
    samples: &[Sample],
    origin: Instant,
    slow_secs: &std::collections::HashSet<u64>,
) -> ((f64, f64), (f64, f64)) {
    let mut all = (0.0, 0.0, 0.0);
    let mut slow = (0.0, 0.0, 0.0);
    for w in samples.windows(2) {
        let secs = w[1].at.duration_since(w[0].at).as_secs_f64();
        let cpu = w[1].cpu_us.saturating_sub(w[0].cpu_us) as f64 / 1000.0;
        let io = w[1].io_us.saturating_sub(w[0].io_us) as f64 / 1000.0;
        all = (all.0 + cpu, all.1 + io, all.2 + secs);
        let second = w[0].at.saturating_duration_since(origin).as_secs();
        if w[0].at >= origin && slow_secs.contains(&second) {
            slow = (slow.0 + cpu, slow.1 + io, slow.2 + secs);
        }
    }
    let rate = |t: (f64, f64, f64)| (t.0 / t.2, t.1 / t.2);
    (rate(all), rate(slow))
}

pub(crate) fn print_latency(who: &str, rate: u64, l: &Latency) {
    println!(
        "{who} latency at {rate}/s (achieved {:.0}/s, {} events, {} missing): p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms; {} over 20 ms{}",
        l.achieved,
        l.count,
        l.missing,
        l.p50_ms,
        l.p99_ms,
        l.max_ms,
        l.slow,
        if l.slow > 0 {
            format!(
                ", committed between {:.2} s and {:.2} s",
                l.slow_span_s.0, l.slow_span_s.1
            )
        } else {
            String::new()
        }
    );
    let p = &l.parts;
    println!(
        "  p99 commit -> stored {:.2} ms, stored -> consumer {:.2} ms, the writer's INSERT+COMMIT {:.2} ms; \
         slow events mostly upstream {} of {}, written by a commit over 20 ms {}; \
         pressure (stall ms/s) cpu {:.0}, io {:.0} over the phase; cpu {:.0}, io {:.0} in the seconds with slow events",
        p.upstream_p99_ms,
        p.delivery_p99_ms,
        p.write_p99_ms,
        p.slow_upstream,
        l.slow,
        p.slow_after_slow_commit,
        p.cpu_some,
        p.io_some,
        p.cpu_some_slow,
        p.io_some_slow,
    );
}

pub(crate) fn latency_json(who: &str, rate: u64, l: &Latency) -> String {
    let p = &l.parts;
    let num = |v: f64| {
        if v.is_finite() {
            format!("{v:.2}")
        } else {
            "null".to_owned()
        }
    };
    format!(
        r#"{{"who":"{who}","rate":{rate},"achieved_eps":{:.0},"p50_ms":{:.2},"p99_ms":{:.2},"max_ms":{:.2},"missing":{},"slow":{},"upstream_p99_ms":{:.2},"delivery_p99_ms":{:.2},"write_p99_ms":{:.2},"slow_upstream":{},"slow_after_slow_commit":{},"cpu_stall_ms_per_s":{},"io_stall_ms_per_s":{},"cpu_stall_slow_ms_per_s":{},"io_stall_slow_ms_per_s":{}}}"#,
        l.achieved,
        l.p50_ms,
        l.p99_ms,
        l.max_ms,
        l.missing,
        l.slow,
        p.upstream_p99_ms,
        p.delivery_p99_ms,
        p.write_p99_ms,
        p.slow_upstream,
        p.slow_after_slow_commit,
        num(p.cpu_some),
        num(p.io_some),
        num(p.cpu_some_slow),
        num(p.io_some_slow),
    )
}
