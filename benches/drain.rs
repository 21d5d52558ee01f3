//! Backlog drain and commit → stored latency, each next to a baseline measured in the same run.
//!
//! On a private Postgres (tests/support) a backlog of single-row outbox transactions is written after
//! every slot exists, and then, per round (rounds alternate so a busy machine slows them alike):
//!
//! - `pg_recvlogical` drains its own slot into /dev/null until `--endpos` (the WAL position taken after
//!   the writes): the baseline, the walsender's decoding speed plus a trivial client;
//! - our source alone (`ReplConnection` + `Decoder`, confirm at each Commit) drains its slot to the
//!   same position;
//! - the relay binary (`outbox-relay run`, a subprocess so its RSS and CPU are its own) drains its slot
//!   to a fresh NATS until the stream holds every event. Its peak RSS (VmHWM) and CPU (utime+stime)
//!   are read from /proc just before it is stopped.
//!
//! Then, with the last round's relay caught up, writers commit single-event transactions at fixed
//! rates; an ordered consumer on the stream takes the receive time of each event id, and the latency
//! is that minus the moment the writer's COMMIT returned.
//!
//! `cargo bench --bench drain` prints a table and one JSON line. Knobs (environment): `BENCH_EVENTS`
//! (100000), `BENCH_ROUNDS` (3), `BENCH_LATENCY_SECS` (10), `BENCH_RATES` (`1000,5000`),
//! `BENCH_RELAY_WRAPPER` (a command prefix for the relay, e.g. `perf record -g -o relay.data --`; its
//! RSS/CPU are then the wrapper's). Under `cargo test --benches` (no `--bench` argument) it does nothing:
//! starting servers is the tests' job.

#[path = "../tests/support/mod.rs"]
// Only the servers and the database are used here; the rest of the test support is for the tests.
#[allow(unused_imports)]
mod support;

use std::collections::HashMap;
use std::fs;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use async_nats::jetstream::{self, consumer::DeliverPolicy, consumer::pull::OrderedConfig};
use futures_util::StreamExt;
use outbox_relay::Lsn;
use outbox_relay::pgoutput::{Decoder, Message};
use outbox_relay::source::{
    ConnInfo, PgOutputOptions, ReplConnection, ReplicationEvent, StreamConfig,
};
use support::{NatsServer, PgServer, TestDb};

const PUBLICATION: &str = "bench_pub";
const STREAM: &str = "OUTBOX";
/// About 200 bytes of jsonb, like the decode bench.
const PAYLOAD: &str = r#"{"items": [{"qty": 2, "sku": "SKU-00000001", "price_cents": 1999}, {"qty": 1, "sku": "SKU-00000002", "price_cents": 4500}], "total_cents": 8498, "currency": "EUR", "customer_id": "cust-000042", "note": "leave at the door"}"#;

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn main() -> anyhow::Result<()> {
    if !std::env::args().any(|a| a == "--bench") {
        println!("drain bench: skipped (it starts servers; run `cargo bench --bench drain`)");
        return Ok(());
    }
    let pg = PgServer::start_private();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    rt.block_on(run(&pg))
}

struct Round {
    recvlogical_eps: f64,
    source_eps: f64,
    relay_eps: f64,
    relay_rss_mb: f64,
    relay_cpu_ms_per_1k: f64,
}

async fn run(pg: &PgServer) -> anyhow::Result<()> {
    let events: u64 = env_or("BENCH_EVENTS", 100_000);
    let rounds: usize = env_or("BENCH_ROUNDS", 3).max(1);
    let latency_secs: u64 = env_or("BENCH_LATENCY_SECS", 10);
    let rates: Vec<u64> = std::env::var("BENCH_RATES")
        .unwrap_or_else(|_| "1000,5000".into())
        .split(',')
        .filter_map(|r| r.trim().parse().ok())
        .collect();

    let db = TestDb::create(pg).await;
    let outbox_sql = fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/sql/01_outbox_table.sql"
    ))?;
    // No autovacuum: its WAL would land between the backlog and the end position on some runs only.
    db.psql(&format!(
        "{outbox_sql}\nALTER TABLE public.outbox SET (autovacuum_enabled = false);\n\
         CREATE PUBLICATION {PUBLICATION} FOR TABLE public.outbox WITH (publish = 'insert');"
    ));
    let slots =
        |kind: &str| -> Vec<String> { (0..rounds).map(|r| format!("{kind}_{r}")).collect() };
    let (recv_slots, source_slots, relay_slots) = (slots("recv"), slots("source"), slots("relay"));
    for slot in recv_slots.iter().chain(&source_slots).chain(&relay_slots) {
        db.psql(&format!(
            "SELECT pg_create_logical_replication_slot('{slot}', 'pgoutput')"
        ));
    }

    // The backlog: one transaction per row, written by a procedure (COMMIT inside the loop), without
    // waiting for WAL flushes. The end position is the insert position right after it (the end of the
    // last commit record; pg_current_wal_lsn() would be the page-aligned write position, before it);
    // a synchronous empty transaction then flushes everything up to it, so the walsenders can send it.
    let t = Instant::now();
    let out = db.psql(&format!(
        "CREATE PROCEDURE bench_fill(n int) LANGUAGE plpgsql AS $$\n\
         BEGIN\n\
           FOR i IN 1..n LOOP\n\
             INSERT INTO public.outbox (aggregate_type, aggregate_id, event_type, payload)\n\
               VALUES ('Order', 'order-' || i, 'OrderPlaced', '{PAYLOAD}'::jsonb);\n\
             COMMIT;\n\
           END LOOP;\n\
         END $$;\n\
         SET synchronous_commit = off;\n\
         CALL bench_fill({events});\n\
         SELECT pg_current_wal_insert_lsn();\n\
         SET synchronous_commit = on;\n\
         SELECT txid_current();"
    ));
    let fill_secs = t.elapsed().as_secs_f64();
    let target: Lsn = out
        .lines()
        .next()
        .unwrap_or_default()
        .parse()
        .map_err(|e| anyhow::anyhow!("pg_current_wal_insert_lsn {out:?}: {e:?}"))?;
    let wal_mb: f64 = db
        .psql(&format!(
            "SELECT (pg_current_wal_lsn() - confirmed_flush_lsn) / 1048576.0 FROM pg_replication_slots WHERE slot_name = '{}'",
            recv_slots[0]
        ))
        .parse()?;
    println!(
        "backlog: {events} single-row transactions written in {fill_secs:.1} s; {wal_mb:.0} MB of WAL; end position {target}"
    );

    let mut results = Vec::new();
    let mut kept: Option<(RelayChild, NatsServer)> = None;
    for r in 0..rounds {
        let recvlogical_eps = recvlogical(pg, &db, &recv_slots[r], target, events)?;
        let source_eps = source(&db, &source_slots[r], target, events).await?;
        let nats = NatsServer::start();
        let (relay, relay_eps, relay_rss_mb, relay_cpu_ms) =
            relay(&db, &nats, &relay_slots[r], events).await?;
        let round = Round {
            recvlogical_eps,
            source_eps,
            relay_eps,
            relay_rss_mb,
            relay_cpu_ms_per_1k: relay_cpu_ms / (events as f64 / 1000.0),
        };
        println!(
            "round {}: pg_recvlogical {:.0}/s, source {:.0}/s ({:.2}x), relay {:.0}/s ({:.2}x), relay peak RSS {:.1} MB, relay CPU {:.1} ms/1k events",
            r + 1,
            round.recvlogical_eps,
            round.source_eps,
            round.source_eps / round.recvlogical_eps,
            round.relay_eps,
            round.relay_eps / round.recvlogical_eps,
            round.relay_rss_mb,
            round.relay_cpu_ms_per_1k
        );
        results.push(round);
        if r + 1 == rounds {
            kept = Some((relay, nats));
        }
    }

    let mut latencies = Vec::new();
    if let Some((mut relay, nats)) = kept {
        if latency_secs > 0 {
            for (phase, &rate) in rates.iter().enumerate() {
                let l = latency(&db, &nats, rate, latency_secs, phase as u32 + 1).await?;
                println!(
                    "latency at {rate}/s (achieved {:.0}/s, {} events, {} missing): p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms; {} over 20 ms, committed between {:.2} s and {:.2} s",
                    l.achieved,
                    l.count,
                    l.missing,
                    l.p50_ms,
                    l.p99_ms,
                    l.max_ms,
                    l.slow,
                    l.slow_span_s.0,
                    l.slow_span_s.1
                );
                latencies.push((rate, l));
            }
        }
        relay.stop();
        drop(nats);
    }

    let med = |f: &dyn Fn(&Round) -> f64| {
        let mut v: Vec<f64> = results.iter().map(f).collect();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let recv_eps = med(&|r| r.recvlogical_eps);
    let source_eps = med(&|r| r.source_eps);
    let relay_eps = med(&|r| r.relay_eps);
    let ratio_source = med(&|r| r.source_eps / r.recvlogical_eps);
    let ratio_relay = med(&|r| r.relay_eps / r.recvlogical_eps);
    let rss = results.iter().map(|r| r.relay_rss_mb).fold(0.0, f64::max);
    let cpu = med(&|r| r.relay_cpu_ms_per_1k);

    println!();
    println!("drain of {events} single-row transactions, median of {rounds} alternating rounds");
    println!(
        "{:<28} {:>12} {:>12} {:>8}",
        "", "events/s", "vs baseline", "target"
    );
    println!(
        "{:<28} {:>12.0} {:>12} {:>8}",
        "pg_recvlogical (baseline)", recv_eps, "1.00", ""
    );
    println!(
        "{:<28} {:>12.0} {:>12.2} {:>8}",
        "source (recv+decode)", source_eps, ratio_source, ">= 0.9"
    );
    println!(
        "{:<28} {:>12.0} {:>12.2} {:>8}",
        "relay (to JetStream)", relay_eps, ratio_relay, ">= 0.8"
    );
    println!("relay peak RSS {rss:.1} MB (target <= 64), CPU {cpu:.1} ms per 1k events");
    for (rate, l) in &latencies {
        println!(
            "latency commit -> consumer at {rate}/s: p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms{}",
            l.p50_ms,
            l.p99_ms,
            l.max_ms,
            if *rate == 5000 {
                " (target p99 <= 20 ms)"
            } else {
                ""
            }
        );
    }
    let lat_json: Vec<String> = latencies
        .iter()
        .map(|(rate, l)| {
            format!(
                r#""{rate}":{{"p50_ms":{:.2},"p99_ms":{:.2},"max_ms":{:.2},"achieved_eps":{:.0},"missing":{}}}"#,
                l.p50_ms, l.p99_ms, l.max_ms, l.achieved, l.missing
            )
        })
        .collect();
    println!(
        r#"{{"bench":"drain","events":{events},"rounds":{rounds},"pg_recvlogical_eps":{recv_eps:.0},"source_eps":{source_eps:.0},"relay_eps":{relay_eps:.0},"ratio_source":{ratio_source:.3},"ratio_relay":{ratio_relay:.3},"relay_peak_rss_mb":{rss:.1},"relay_cpu_ms_per_1k":{cpu:.1},"latency":{{{}}}}}"#,
        lat_json.join(",")
    );
    Ok(())
}

/// `pg_recvlogical --start … --endpos` into /dev/null: wall time from spawn to exit → events/s.
fn recvlogical(
    pg: &PgServer,
    db: &TestDb,
    slot: &str,
    target: Lsn,
    events: u64,
) -> anyhow::Result<f64> {
    let conninfo = format!(
        "host={} port={} user=postgres dbname={} sslmode=disable",
        pg.host(),
        pg.port(),
        db.name()
    );
    let t = Instant::now();
    let out = Command::new(pg.bin_dir().join("pg_recvlogical"))
        .args([
            "-d",
            &conninfo,
            "-S",
            slot,
            "--start",
            "--no-loop",
            "-f",
            "/dev/null",
        ])
        .args(["-o", "proto_version=1", "-o"])
        .arg(format!("publication_names={PUBLICATION}"))
        .arg(format!("--endpos={target}"))
        .stdin(Stdio::null())
        .output()
        .context("spawn pg_recvlogical")?;
    let secs = t.elapsed().as_secs_f64();
    if !out.status.success() {
        bail!(
            "pg_recvlogical failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(events as f64 / secs)
}

/// Our source alone: connect, stream, decode every message, confirm each Commit, until `target`.
async fn source(db: &TestDb, slot: &str, target: Lsn, events: u64) -> anyhow::Result<f64> {
    let url = format!("{}?sslmode=disable", db.url());
    let t = Instant::now();
    let conn = ReplConnection::connect(&ConnInfo::parse(&url)?, "bench").await?;
    let mut options = PgOutputOptions::new([PUBLICATION.to_string()]);
    options.proto_version = Some(1);
    let mut stream = conn
        .start_replication(slot, Lsn(0), &options, StreamConfig::default())
        .await
        .map_err(|(e, _)| e)?;
    let mut decoder = Decoder::new();
    let mut inserts = 0u64;
    loop {
        let Some(ev) = stream.recv().await else {
            bail!("replication stream ended after {inserts} inserts");
        };
        match ev? {
            ReplicationEvent::XLogData {
                wal_start, data, ..
            } => match decoder.decode(data, wal_start)? {
                Message::Insert { .. } => inserts += 1,
                Message::Commit { end_lsn, .. } => {
                    stream.confirm(end_lsn);
                    if end_lsn >= target {
                        break;
                    }
                }
                _ => {}
            },
            ReplicationEvent::Keepalive { wal_end, .. } => {
                if wal_end >= target {
                    break;
                }
            }
        }
    }
    let secs = t.elapsed().as_secs_f64();
    stream.stop(Duration::from_secs(5)).await?;
    if inserts != events {
        bail!("source saw {inserts} inserts, expected {events}");
    }
    Ok(events as f64 / secs)
}

/// The relay binary, stopped on drop.
struct RelayChild {
    child: Child,
    _dir: tempfile::TempDir,
}

impl RelayChild {
    fn spawn(env: &[(&str, String)]) -> anyhow::Result<RelayChild> {
        let dir = tempfile::tempdir()?;
        let wrapper = std::env::var("BENCH_RELAY_WRAPPER").unwrap_or_default();
        let mut words: Vec<String> = wrapper.split_whitespace().map(str::to_owned).collect();
        words.push(env!("CARGO_BIN_EXE_outbox-relay").to_owned());
        words.push("run".to_owned());
        let mut cmd = Command::new(&words[0]);
        cmd.args(&words[1..]);
        for (k, _) in std::env::vars() {
            if k.starts_with("OUTBOX_RELAY_") {
                cmd.env_remove(k);
            }
        }
        cmd.envs(env.iter().map(|(k, v)| (*k, v.as_str())))
            .stdin(Stdio::null())
            .stdout(fs::File::create(dir.path().join("stdout"))?)
            .stderr(fs::File::create(dir.path().join("stderr"))?);
        let child = cmd.spawn().context("spawn outbox-relay")?;
        Ok(RelayChild { child, _dir: dir })
    }

    fn log(&self) -> String {
        fs::read_to_string(self._dir.path().join("stderr")).unwrap_or_default()
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGTERM (a clean stop; a `perf record` wrapper then writes its data), SIGKILL after 10 s.
    fn stop(&mut self) {
        let _ = Command::new("sh")
            .args(["-c", r#"kill -s TERM "$1" 2>/dev/null"#, "sh"])
            .arg(self.child.id().to_string())
            .status();
        let deadline = Instant::now() + Duration::from_secs(10);
        while matches!(self.child.try_wait(), Ok(None)) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for RelayChild {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Peak resident set (VmHWM) of `pid` in MB.
fn peak_rss_mb(pid: u32) -> f64 {
    let status = fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .map_or(0.0, |kb| kb / 1024.0)
}

/// utime + stime of `pid` in milliseconds (fields 14 and 15 of /proc/pid/stat, in clock ticks).
fn cpu_ms(pid: u32) -> f64 {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // The command name (field 2) may hold spaces; count fields after its closing parenthesis.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<u64> = rest
        .split_whitespace()
        .map(|x| x.parse().unwrap_or(0))
        .collect();
    let ticks = f.get(11).copied().unwrap_or(0) + f.get(12).copied().unwrap_or(0);
    ticks as f64 * 1000.0 / clock_ticks() as f64
}

fn clock_ticks() -> u64 {
    Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8_lossy(&o.stdout).trim().parse().ok())
        .unwrap_or(100)
}

/// The relay drains `slot` into a fresh stream: spawn → the stream holds `events` messages.
/// Returns the still running relay, events/s, peak RSS (MB) and CPU (ms) at that moment.
async fn relay(
    db: &TestDb,
    nats: &NatsServer,
    slot: &str,
    events: u64,
) -> anyhow::Result<(RelayChild, f64, f64, f64)> {
    let js = jetstream::new(nats.client().await);
    let env = [
        (
            "OUTBOX_RELAY_POSTGRES_URL",
            format!("{}?sslmode=disable", db.url()),
        ),
        ("OUTBOX_RELAY_POSTGRES_SLOT", slot.to_owned()),
        ("OUTBOX_RELAY_POSTGRES_PUBLICATION", PUBLICATION.to_owned()),
        ("OUTBOX_RELAY_NATS_URL", nats.url()),
        ("OUTBOX_RELAY_NATS_STREAM", STREAM.to_owned()),
        ("OUTBOX_RELAY_HTTP_LISTEN", String::new()),
    ];
    let t = Instant::now();
    let mut relay = RelayChild::spawn(&env)?;
    loop {
        tokio::time::sleep(Duration::from_millis(20)).await;
        if let Ok(Some(status)) = relay.child.try_wait() {
            bail!("relay exited ({status}):\n{}", relay.log());
        }
        if t.elapsed() > Duration::from_secs(300) {
            bail!("relay did not drain in 300 s:\n{}", relay.log());
        }
        let Ok(mut stream) = js.get_stream(STREAM).await else {
            continue;
        };
        if stream.info().await.map(|i| i.state.messages).unwrap_or(0) >= events {
            break;
        }
    }
    let secs = t.elapsed().as_secs_f64();
    let rss = peak_rss_mb(relay.pid());
    let cpu = cpu_ms(relay.pid());
    Ok((relay, events as f64 / secs, rss, cpu))
}

struct Latency {
    count: usize,
    /// Events over 20 ms, and the seconds into the phase of the first and last of them (one stall
    /// or spread out?).
    slow: usize,
    slow_span_s: (f64, f64),
    missing: usize,
    achieved: f64,
    p50_ms: f64,
    p99_ms: f64,
    max_ms: f64,
}

/// Writers commit single-event transactions at `rate`/s for `secs`; an ordered consumer records when
/// each id arrives. Event ids are `<phase>-…-<index>` uuids so phases never mix.
async fn latency(
    db: &TestDb,
    nats: &NatsServer,
    rate: u64,
    secs: u64,
    phase: u32,
) -> anyhow::Result<Latency> {
    let total = (rate * secs) as usize;
    let js = jetstream::new(nats.client().await);
    let stream = js.get_stream(STREAM).await?;
    let consumer = stream
        .create_consumer(OrderedConfig {
            deliver_policy: DeliverPolicy::New,
            ..Default::default()
        })
        .await?;
    let mut messages = consumer.messages().await?;
    let received: Arc<Mutex<HashMap<usize, Instant>>> = Arc::default();
    let prefix = format!("{phase:08x}-");
    let reader = {
        let received = Arc::clone(&received);
        tokio::spawn(async move {
            while let Some(Ok(m)) = messages.next().await {
                let now = Instant::now();
                let id = m
                    .headers
                    .as_ref()
                    .and_then(|h| h.get("Nats-Msg-Id"))
                    .map(|v| v.as_str().to_owned())
                    .unwrap_or_default();
                if let Some(rest) = id.strip_prefix(&prefix)
                    && let Some(i) = rest
                        .rsplit('-')
                        .next()
                        .and_then(|x| usize::from_str_radix(x, 16).ok())
                {
                    received.lock().unwrap().insert(i, now);
                }
            }
        })
    };

    // Enough connections that one slow commit does not hold up the schedule: each writes every
    // `writers`-th event at its scheduled time.
    let writers = (rate / 250).clamp(4, 32) as usize;
    let committed: Arc<Mutex<Vec<Option<Instant>>>> = Arc::new(Mutex::new(vec![None; total]));
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
            let mut i = w;
            while i < total {
                let due = start + Duration::from_nanos(i as u64 * 1_000_000_000 / rate);
                tokio::time::sleep_until(due).await;
                let id = format!("{phase:08x}-0000-4000-8000-{i:012x}");
                let agg = format!("order-{i}");
                client.execute(&insert, &[&id, &agg, &PAYLOAD]).await?;
                committed.lock().unwrap()[i] = Some(Instant::now());
                i += writers;
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
    let received = received.lock().unwrap();
    let committed = committed.lock().unwrap();
    let first = committed.iter().flatten().min().copied();
    let slow: Vec<f64> = committed
        .iter()
        .enumerate()
        .filter_map(|(i, c)| {
            let (c, r) = (c.as_ref()?, received.get(&i)?);
            (r.saturating_duration_since(*c) > Duration::from_millis(20))
                .then(|| first.map_or(0.0, |f| c.duration_since(f).as_secs_f64()))
        })
        .collect();
    let slow_span_s = (
        slow.iter().copied().fold(f64::INFINITY, f64::min),
        slow.iter().copied().fold(0.0, f64::max),
    );
    let mut ms: Vec<f64> = committed
        .iter()
        .enumerate()
        .filter_map(|(i, c)| {
            let (c, r) = (c.as_ref()?, received.get(&i)?);
            // A consumer can see an event before its writer sees COMMIT return: count that as 0.
            Some(r.saturating_duration_since(*c).as_secs_f64() * 1000.0)
        })
        .collect();
    ms.sort_by(f64::total_cmp);
    if ms.is_empty() {
        bail!("no event of the {rate}/s phase arrived");
    }
    let pct = |p: f64| ms[((ms.len() as f64 * p) as usize).min(ms.len() - 1)];
    Ok(Latency {
        count: ms.len(),
        slow: slow.len(),
        slow_span_s,
        missing: total - ms.len(),
        achieved,
        p50_ms: pct(0.50),
        p99_ms: pct(0.99),
        max_ms: ms[ms.len() - 1],
    })
}
