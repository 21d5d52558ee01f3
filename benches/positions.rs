//! The position service under load (docs/performance.md, "Read-your-writes"): how soon a wait is
//! answered after the JetStream ack that completes it, and what the waits cost the relay's CPU.
//!
//! One relay binary (a subprocess, so its CPU is its own: utime+stime from /proc) streams a fresh
//! slot to a fresh NATS. `BENCH_WAITERS` (100) writer tasks each commit one single-row outbox
//! transaction every 100 ms (1,000 events/s together), take `pg_current_wal_lsn()` after the COMMIT,
//! and in the `waits` phase ask `outbox-relay.<slot>.wait` for it (1,000 waits/s, 100 open at a
//! time at most); the `no waits` phase writes the same way and asks nothing. Phases of `BENCH_SECS`
//! (15) alternate for `BENCH_ROUNDS` (2) rounds in the same run, so a busy machine slows both alike.
//!
//! The ack is seen from outside: a core subscriber of `outbox.>` sees each publish with its event id
//! and its reply subject (one per publish), and a subscriber of `_INBOX.>` sees JetStream's ack
//! arrive there, at the time the relay gets it. For each wait that was asked before its own event's
//! ack arrived (the others are answered at once, and counted), the latency is the wait's reply minus
//! that ack: an upper bound of "ack that completes it → reply" (the completing ack is this one or a
//! later one). Under `cargo test --benches` it does nothing: starting servers is the tests' job.

#[path = "common/cpu.rs"]
mod cpu;

use std::collections::HashMap;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cpu::cpu_ms;

use anyhow::{Context, bail};
use futures_util::StreamExt;
use outbox_relay::config::Config;
use outbox_relay::testkit::{NatsServer, PgServer, TestDb};

fn knob(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn main() -> anyhow::Result<()> {
    if !std::env::args().any(|a| a == "--bench") {
        println!(
            "positions bench: skipped (it starts servers; run `cargo bench --bench positions`)"
        );
        return Ok(());
    }
    let pg = PgServer::start_private();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    rt.block_on(run(&pg))
}

/// What the observers saw: event id → its publish's reply subject, reply subject → when the ack
/// arrived there.
#[derive(Default)]
struct Seen {
    reply_of: HashMap<String, String>,
    acked_at: HashMap<String, Instant>,
}

/// One wait: its event, when it was asked and when answered.
struct Wait {
    id: String,
    asked: Instant,
    answered: Instant,
    stored: bool,
}

struct Phase {
    events_per_sec: f64,
    waits_per_sec: f64,
    cpu_ms_per_sec: f64,
    waits: Vec<Wait>,
}

async fn run(pg: &PgServer) -> anyhow::Result<()> {
    let waiters = knob("BENCH_WAITERS", 100).max(1);
    let secs = knob("BENCH_SECS", 15).max(1);
    let rounds = knob("BENCH_ROUNDS", 2).max(1);
    let db = TestDb::create(pg).await;
    let root = env!("CARGO_MANIFEST_DIR");
    let sql = std::fs::read_to_string(format!("{root}/sql/01_outbox_table.sql"))?;
    db.psql(&sql);
    let nats = NatsServer::start();
    let mut config = Config::default();
    config.postgres.url = db.url();
    config.postgres.slot = db.slot_name();
    config.postgres.publication = db.publication_name();
    config.nats.url = nats.url();
    config.http.listen = String::new();
    let settings = config.validate()?;
    outbox_relay::setup::setup(&settings).await?;

    let nc = nats.client().await;
    let seen = Arc::new(Mutex::new(Seen::default()));
    let mut publishes = nc.subscribe("outbox.>").await?;
    let mut acks = nc.subscribe("_INBOX.>").await?;
    nc.flush().await?;
    let s = Arc::clone(&seen);
    tokio::spawn(async move {
        while let Some(m) = publishes.next().await {
            let id = m.headers.as_ref().and_then(|h| h.get("Nats-Msg-Id"));
            if let (Some(id), Some(reply)) = (id, m.reply) {
                let mut s = s.lock().unwrap_or_else(|e| e.into_inner());
                s.reply_of.insert(id.as_str().to_owned(), reply.to_string());
            }
        }
    });
    let s = Arc::clone(&seen);
    tokio::spawn(async move {
        while let Some(m) = acks.next().await {
            let now = Instant::now();
            let mut s = s.lock().unwrap_or_else(|e| e.into_inner());
            s.acked_at.entry(m.subject.to_string()).or_insert(now);
        }
    });

    let mut relay = RelayChild::spawn(&config)?;
    let wait_subject = format!("outbox-relay.{}.wait", config.postgres.slot);
    // Until the service answers, the relay is not streaming yet.
    let started = Instant::now();
    while nc
        .request(wait_subject.clone(), r#"{"lsn":"0/0"}"#.into())
        .await
        .is_err()
    {
        if started.elapsed() > Duration::from_secs(60) {
            bail!(
                "the position service did not answer in 60 s:\n{}",
                relay.log()
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // A few writer connections, shared by the waiters (tokio-postgres pipelines their statements).
    let mut clients = Vec::new();
    for _ in 0..10 {
        clients.push(Arc::new(db.client().await));
    }

    let mut results: [Vec<Phase>; 2] = [Vec::new(), Vec::new()];
    for round in 1..=rounds {
        for (i, waits) in [false, true].into_iter().enumerate() {
            let p = phase(
                &clients,
                &nc,
                &wait_subject,
                waiters,
                secs,
                waits,
                relay.pid(),
            )
            .await?;
            eprintln!(
                "round {round} {}: {:.0} events/s, {:.0} waits/s, relay CPU {:.1} ms/s",
                if waits { "waits" } else { "no waits" },
                p.events_per_sec,
                p.waits_per_sec,
                p.cpu_ms_per_sec
            );
            results[i].push(p);
        }
    }
    relay.stop();

    let seen = seen.lock().unwrap_or_else(|e| e.into_inner());
    let mut latencies = Vec::new();
    let (mut at_once, mut timed_out, mut unmatched) = (0, 0, 0);
    for w in results[1].iter().flat_map(|p| &p.waits) {
        if !w.stored {
            timed_out += 1;
            continue;
        }
        let ack = seen.reply_of.get(&w.id).and_then(|r| seen.acked_at.get(r));
        match ack {
            Some(&ack) if ack > w.asked => latencies.push(w.answered.duration_since(ack)),
            Some(_) => at_once += 1,
            None => unmatched += 1,
        }
    }
    latencies.sort();
    let pct = |p: f64| -> f64 {
        latencies
            .get(((latencies.len() as f64 * p) as usize).min(latencies.len().saturating_sub(1)))
            .map_or(f64::NAN, |d| d.as_secs_f64() * 1000.0)
    };
    let cpu = |i: usize| median(results[i].iter().map(|p| p.cpu_ms_per_sec).collect());
    let eps = |i: usize| median(results[i].iter().map(|p| p.events_per_sec).collect());
    let wps = median(results[1].iter().map(|p| p.waits_per_sec).collect());
    println!(
        "\n{waiters} writers, one event each per 100 ms; {secs} s phases, median of {rounds} rounds\n"
    );
    println!("| phase | events/s | waits/s | relay CPU ms/s |");
    println!("|---|---:|---:|---:|");
    println!("| no waits | {:.0} | 0 | {:.1} |", eps(0), cpu(0));
    println!("| waits | {:.0} | {wps:.0} | {:.1} |", eps(1), cpu(1));
    println!(
        "\nack → wait reply, waits asked before their ack ({} of {}): p50 {:.2} ms, p90 {:.2} ms, p99 {:.2} ms, max {:.2} ms; \
         answered at once (ack before the ask): {at_once}; timed out: {timed_out}; ack not seen: {unmatched}",
        latencies.len(),
        latencies.len() + at_once + timed_out + unmatched,
        pct(0.5),
        pct(0.9),
        pct(0.99),
        pct(1.0)
    );
    println!(
        "\n{{\"bench\":\"positions\",\"waiters\":{waiters},\"secs\":{secs},\"rounds\":{rounds},\"eps_no_waits\":{:.0},\"eps_waits\":{:.0},\"waits_per_sec\":{wps:.0},\"cpu_ms_per_s_no_waits\":{:.1},\"cpu_ms_per_s_waits\":{:.1},\"ack_to_reply_ms_p50\":{:.3},\"ack_to_reply_ms_p99\":{:.3},\"waited\":{},\"at_once\":{at_once},\"timed_out\":{timed_out}}}",
        eps(0),
        eps(1),
        cpu(0),
        cpu(1),
        pct(0.5),
        pct(0.99),
        latencies.len()
    );
    Ok(())
}

/// One phase: `waiters` tasks write (and wait) for `secs`; the relay's CPU over the phase.
async fn phase(
    clients: &[Arc<tokio_postgres::Client>],
    nc: &async_nats::Client,
    wait_subject: &str,
    waiters: u64,
    secs: u64,
    waits: bool,
    relay_pid: u32,
) -> anyhow::Result<Phase> {
    let cpu_before = cpu_ms(relay_pid);
    let started = Instant::now();
    let until = tokio::time::Instant::now() + Duration::from_secs(secs);
    let mut tasks = Vec::new();
    for w in 0..waiters {
        let client = Arc::clone(&clients[w as usize % clients.len()]);
        let nc = nc.clone();
        let subject = wait_subject.to_owned();
        tasks.push(tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(100));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            // Spread the writers over the 100 ms.
            tokio::time::sleep(Duration::from_micros(w * 100_000 / waiters)).await;
            let (mut events, mut done) = (0u64, Vec::new());
            while tokio::time::Instant::now() < until {
                tick.tick().await;
                let id: String = client
                    .query_one(
                        "INSERT INTO public.outbox (aggregate_type, aggregate_id, event_type, payload) \
                         VALUES ('Order', $1, 'OrderPlaced', '{\"total_cents\": 8498}') RETURNING event_id::text",
                        &[&w.to_string()],
                    )
                    .await?
                    .get(0);
                let lsn: String = client
                    .query_one("SELECT pg_current_wal_lsn()::text", &[])
                    .await?
                    .get(0);
                events += 1;
                if !waits {
                    continue;
                }
                let asked = Instant::now();
                let reply = nc
                    .request(subject.clone(), format!(r#"{{"lsn":"{lsn}","timeout_ms":10000}}"#).into())
                    .await
                    .context("wait request")?;
                let answered = Instant::now();
                let stored = String::from_utf8_lossy(&reply.payload).contains(r#""stored":true"#);
                done.push(Wait {
                    id,
                    asked,
                    answered,
                    stored,
                });
            }
            Ok::<_, anyhow::Error>((events, done))
        }));
    }
    let (mut events, mut all) = (0, Vec::new());
    for t in tasks {
        let (e, w) = t.await??;
        events += e;
        all.extend(w);
    }
    let elapsed = started.elapsed().as_secs_f64();
    let cpu = cpu_ms(relay_pid) - cpu_before;
    Ok(Phase {
        events_per_sec: events as f64 / elapsed,
        waits_per_sec: all.len() as f64 / elapsed,
        cpu_ms_per_sec: cpu / elapsed,
        waits: all,
    })
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// The relay binary, stderr in a temporary directory.
struct RelayChild {
    child: Child,
    dir: tempfile::TempDir,
}

impl RelayChild {
    fn spawn(config: &Config) -> anyhow::Result<RelayChild> {
        let dir = tempfile::tempdir()?;
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_outbox-relay"));
        cmd.arg("run");
        for (k, _) in std::env::vars() {
            if k.starts_with("OUTBOX_RELAY_") {
                cmd.env_remove(k);
            }
        }
        cmd.env("OUTBOX_RELAY_POSTGRES_URL", &config.postgres.url)
            .env("OUTBOX_RELAY_POSTGRES_SLOT", &config.postgres.slot)
            .env(
                "OUTBOX_RELAY_POSTGRES_PUBLICATION",
                &config.postgres.publication,
            )
            .env("OUTBOX_RELAY_NATS_URL", &config.nats.url)
            .env("OUTBOX_RELAY_HTTP_LISTEN", "")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.path().join("stderr"))?);
        let child = cmd.spawn().context("spawn outbox-relay")?;
        Ok(RelayChild { child, dir })
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("stderr")).unwrap_or_default()
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    fn stop(&mut self) {
        let _ = Command::new("kill")
            .args(["-s", "TERM", &self.child.id().to_string()])
            .status();
        let _ = self.child.wait();
    }
}

impl Drop for RelayChild {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}
