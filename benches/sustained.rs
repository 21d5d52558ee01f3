//! Latency under sustained load, in the format CDC vendors publish: writers commit outbox rows at a
//! fixed rate for a minute, and the bench reports, per event, the time from its commit to the moment
//! JetStream stored it (the stream message's timestamp) and to the moment a consumer received it, as
//! p50, p99, p99.9 and max, with the rate reached and every party's share of the CPU.
//!
//! Per phase (a rate, a transaction shape, single publishes or `nats.atomic_transactions`): the
//! outbox table is emptied, a slot is made, a fresh nats-server and the relay binary start, and once
//! the relay's `/readyz` answers 200 an ordered consumer (`sustained/consumer.rs`) and the writers
//! (`sustained/writers.rs`: tokio-postgres, pipelined, several connections) start. The writers' clock
//! read when COMMIT returns is an event's commit time. CPU shares (`sustained/cpu_share.rs`) cover the
//! writing; afterwards the bench waits up to `BENCH_DRAIN_SECS` for the last events.
//!
//! After the fixed rates of a mode and shape, the highest rate the machine sustains is searched:
//! a rate is sustained when the writers reach 97 % of it, every event arrives, and the p99 of the
//! phase's last 5 s stays under `BENCH_SUSTAIN_P99_MS` (a pipeline that falls behind grows its
//! latency every second). From the highest fixed rate that passed, short probes step up by 1.5×
//! until one fails, then bisect (geometric mean) `BENCH_SEARCH_STEPS` times; the highest passing
//! rate then runs as long as the fixed ones (the `max` row).
//!
//! Knobs: `BENCH_SECS` (60), `BENCH_RATES` (`1000,10000,50000` events/s), `BENCH_PER_TXN` (`1,10`),
//! `BENCH_MODES` (`single,atomic`), `BENCH_SEARCH` (1; 0 skips it), `BENCH_PROBE_SECS` (10),
//! `BENCH_SEARCH_STEPS` (3), `BENCH_SUSTAIN_P99_MS` (100), `BENCH_DRAIN_SECS` (30),
//! `BENCH_WRITERS` (4 connections), `BENCH_PIPELINE` (64 transactions in flight per connection),
//! `BENCH_RELAY_ALT` (another build of the relay, run after each fixed and `max` phase of this one),
//! `BENCH_RELAY_WRAPPER` (a command before the relay, e.g. `perf record`), `BENCH_STORAGE` (`file`, the
//! stream the relay creates; `memory`: the bench creates the stream in memory before the relay starts,
//! to tell nats-server's file staging of atomic batches apart from the rest; a bench knob, never a
//! deployment's), `BENCH_ATOMIC_GROUP_MS` (unset: the relay's default `nats.atomic_group_ms`).
//! Without `--bench` (`cargo
//! test --benches`) it runs one 2 s phase at 1,000 events/s, single publishes, one event per
//! transaction.

#[path = "sustained/consumer.rs"]
mod consumer;
#[path = "common/cpu.rs"]
mod cpu;
#[path = "sustained/cpu_share.rs"]
mod cpu_share;
#[path = "common/outbox_db.rs"]
mod outbox_db;
#[path = "common/readyz.rs"]
mod readyz;
#[path = "common/relay_child.rs"]
mod relay_child;
#[path = "sustained/report.rs"]
mod report;
#[path = "sustained/writers.rs"]
mod writers;

use std::sync::Arc;
use std::sync::atomic::AtomicI64;
use std::time::{Duration, Instant};

use anyhow::bail;
use outbox_relay::testkit::{NatsServer, PgServer, TestDb};

use consumer::Consumer;
use cpu_share::{Pids, Snapshot, WRITER_THREAD, postmaster_pid};
use relay_child::RelayChild;
use report::{Criterion, Measured, Phase};
use writers::Load;

const PUBLICATION: &str = "bench_pub";
const STREAM: &str = "OUTBOX";

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn env_words(name: &str, default: &str) -> Vec<String> {
    std::env::var(name)
        .unwrap_or_else(|_| default.into())
        .split(',')
        .map(|w| w.trim().to_owned())
        .filter(|w| !w.is_empty())
        .collect()
}

fn env_numbers<T: std::str::FromStr>(name: &str, default: &str) -> Vec<T> {
    env_words(name, default)
        .iter()
        .filter_map(|w| w.parse().ok())
        .collect()
}

fn load_average() -> f64 {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(f64::NAN)
}

struct Knobs {
    secs: f64,
    rates: Vec<u64>,
    shapes: Vec<usize>,
    /// `false` = single publishes, `true` = atomic transactions.
    modes: Vec<bool>,
    search: bool,
    probe_secs: f64,
    search_steps: usize,
    drain_secs: u64,
    writers: usize,
    pipeline: usize,
    criterion: Criterion,
    alt: Option<String>,
    /// The stream in memory (`BENCH_STORAGE=memory`), created by the bench before the relay starts.
    memory: bool,
    /// `nats.atomic_group_ms` for the relay, when set.
    group_ms: Option<u64>,
}

impl Knobs {
    /// The environment's knobs; `smoke` (no `--bench`) makes the defaults one short phase.
    fn read(smoke: bool) -> anyhow::Result<Knobs> {
        let (secs, rates, shapes, modes, search) = if smoke {
            ("2", "1000", "1", "single", "0")
        } else {
            ("60", "1000,10000,50000", "1,10", "single,atomic", "1")
        };
        let modes = env_words("BENCH_MODES", modes)
            .iter()
            .map(|m| match m.as_str() {
                "single" => Ok(false),
                "atomic" => Ok(true),
                other => bail!("BENCH_MODES: {other:?} is neither single nor atomic"),
            })
            .collect::<anyhow::Result<Vec<bool>>>()?;
        Ok(Knobs {
            secs: env_or("BENCH_SECS", secs.parse()?),
            rates: env_numbers("BENCH_RATES", rates),
            shapes: env_numbers::<usize>("BENCH_PER_TXN", shapes)
                .into_iter()
                .map(|k| k.max(1))
                .collect(),
            modes,
            search: env_or("BENCH_SEARCH", search.parse::<u8>()?) == 1,
            probe_secs: env_or("BENCH_PROBE_SECS", 10.0),
            search_steps: env_or("BENCH_SEARCH_STEPS", 3),
            drain_secs: env_or("BENCH_DRAIN_SECS", 30),
            writers: env_or("BENCH_WRITERS", 4usize).max(1),
            pipeline: env_or("BENCH_PIPELINE", 64usize).max(1),
            criterion: Criterion {
                min_achieved: 0.97,
                tail_p99_ms: env_or("BENCH_SUSTAIN_P99_MS", 100.0),
            },
            alt: std::env::var("BENCH_RELAY_ALT")
                .ok()
                .filter(|p| !p.is_empty()),
            memory: match std::env::var("BENCH_STORAGE").as_deref() {
                Err(_) | Ok("" | "file") => false,
                Ok("memory") => true,
                Ok(other) => bail!("BENCH_STORAGE: {other:?} is neither file nor memory"),
            },
            group_ms: std::env::var("BENCH_ATOMIC_GROUP_MS")
                .ok()
                .and_then(|v| v.parse().ok()),
        })
    }
}

fn main() -> anyhow::Result<()> {
    let smoke = !std::env::args().any(|a| a == "--bench");
    let knobs = Knobs::read(smoke)?;
    let pg = PgServer::start_private();
    // Two threads: the writers' client work may take a core at the highest rates, and the
    // connections' tasks must not wait behind the schedule's ticks.
    let writer_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name(WRITER_THREAD)
        .enable_all()
        .build()?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(run(&pg, &writer_rt, knobs))
}

/// The servers and what stays across phases.
struct Bench<'a> {
    db: TestDb,
    writer_rt: &'a tokio::runtime::Runtime,
    postmaster: u32,
    knobs: Knobs,
    phase: u32,
}

async fn run(
    pg: &PgServer,
    writer_rt: &tokio::runtime::Runtime,
    knobs: Knobs,
) -> anyhow::Result<()> {
    let db = TestDb::create(pg).await;
    outbox_db::outbox_setup(&db, PUBLICATION)?;
    let postmaster = postmaster_pid(pg.data_dir())?;
    println!(
        "== sustained load: {:?} events/s × {:?} events per transaction × {}, {} s per phase; {} writer connections, \
         up to {} transactions in flight each; search for the highest sustained rate: {}; {} stream; atomic_group_ms {}; \
         load average {:.2} ==",
        knobs.rates,
        knobs.shapes,
        knobs
            .modes
            .iter()
            .map(|&a| if a { "atomic" } else { "single" })
            .collect::<Vec<_>>()
            .join("/"),
        knobs.secs,
        knobs.writers,
        knobs.pipeline,
        if knobs.search { "on" } else { "off" },
        if knobs.memory { "memory" } else { "file" },
        knobs
            .group_ms
            .map_or_else(|| "default".to_owned(), |g| g.to_string()),
        load_average(),
    );
    let mut bench = Bench {
        db,
        writer_rt,
        postmaster,
        knobs,
        phase: 0,
    };
    let mut phases: Vec<Phase> = Vec::new();
    let (modes, shapes, rates) = (
        bench.knobs.modes.clone(),
        bench.knobs.shapes.clone(),
        bench.knobs.rates.clone(),
    );
    for &atomic in &modes {
        for &per_txn in &shapes {
            // The highest rate that kept up and the lowest that did not, for the search.
            let (mut passed, mut failed) = (None::<u64>, None::<u64>);
            for &rate in &rates {
                let secs = bench.knobs.secs;
                let p = bench
                    .variants("fixed", atomic, rate, per_txn, secs, &mut phases)
                    .await?;
                if p {
                    passed = passed.max(Some(rate));
                } else {
                    failed = Some(failed.map_or(rate, |f: u64| f.min(rate)));
                }
            }
            if !bench.knobs.search {
                continue;
            }
            match bench
                .search(atomic, per_txn, passed, failed, &mut phases)
                .await?
            {
                Some(max) => {
                    let secs = bench.knobs.secs;
                    bench
                        .variants("max", atomic, max, per_txn, secs, &mut phases)
                        .await?;
                }
                None => println!(
                    "{} x{per_txn}: no rate down to 100 events/s was sustained",
                    if atomic { "atomic" } else { "single" }
                ),
            }
        }
    }
    report::print(&phases);
    Ok(())
}

/// `x` rounded to a step that suits its size (100 events/s under 10,000, else 1,000).
fn round_rate(x: f64) -> u64 {
    let step = if x < 10_000.0 { 100.0 } else { 1_000.0 };
    ((x / step).round() * step).max(100.0) as u64
}

impl Bench<'_> {
    /// A phase of this relay and, when `BENCH_RELAY_ALT` is set, of the other build after it;
    /// returns whether this relay's phase kept up.
    async fn variants(
        &mut self,
        kind: &'static str,
        atomic: bool,
        rate: u64,
        per_txn: usize,
        secs: f64,
        phases: &mut Vec<Phase>,
    ) -> anyhow::Result<bool> {
        let own = env!("CARGO_BIN_EXE_outbox-relay").to_owned();
        let p = self
            .phase(kind, ("relay", &own), atomic, rate, per_txn, secs)
            .await?;
        let kept_up = p.kept_up;
        phases.push(p);
        if let Some(alt) = self.knobs.alt.clone() {
            let p = self
                .phase(kind, ("alt", &alt), atomic, rate, per_txn, secs)
                .await?;
            phases.push(p);
        }
        Ok(kept_up)
    }

    /// The highest rate this relay sustains, from what the fixed rates showed (`passed`: the highest
    /// that kept up; `failed`: the lowest that did not). None when not even 100 events/s did.
    async fn search(
        &mut self,
        atomic: bool,
        per_txn: usize,
        passed: Option<u64>,
        failed: Option<u64>,
        phases: &mut Vec<Phase>,
    ) -> anyhow::Result<Option<u64>> {
        let own = env!("CARGO_BIN_EXE_outbox-relay").to_owned();
        let secs = self.knobs.probe_secs;
        let (mut lo, mut hi) = (passed, failed);
        let mut probe = async |bench: &mut Self, rate: u64| -> anyhow::Result<bool> {
            let p = bench
                .phase("probe", ("relay", &own), atomic, rate, per_txn, secs)
                .await?;
            let kept_up = p.kept_up;
            phases.push(p);
            Ok(kept_up)
        };
        // Nothing passed: halve from the lowest failure.
        while lo.is_none() {
            let Some(h) = hi else { return Ok(None) };
            let r = round_rate(h as f64 / 2.0);
            if r >= h {
                return Ok(None);
            }
            if probe(self, r).await? {
                lo = Some(r);
            } else {
                hi = Some(r);
            }
        }
        let mut lo = lo.unwrap_or(100);
        // Up by 1.5× until a probe fails (at most 12 steps: 1.5¹² ≈ 130×).
        for _ in 0..12 {
            if hi.is_some() {
                break;
            }
            let r = round_rate(lo as f64 * 1.5);
            if probe(self, r).await? {
                lo = r;
            } else {
                hi = Some(r);
            }
        }
        // Bisect between the highest pass and the lowest failure, to within 10 %.
        for _ in 0..self.knobs.search_steps {
            let Some(h) = hi else { break };
            if h as f64 / lo as f64 <= 1.1 {
                break;
            }
            let r = round_rate((lo as f64 * h as f64).sqrt());
            if r <= lo || r >= h {
                break;
            }
            if probe(self, r).await? {
                lo = r;
            } else {
                hi = Some(r);
            }
        }
        Ok(Some(lo))
    }

    /// One phase: a clean table, a new slot, a fresh nats-server, the relay `bin`, the consumer and
    /// the writers at `rate` events/s for `secs`.
    async fn phase(
        &mut self,
        kind: &'static str,
        (variant, bin): (&'static str, &str),
        atomic: bool,
        rate: u64,
        per_txn: usize,
        secs: f64,
    ) -> anyhow::Result<Phase> {
        self.phase += 1;
        let load = Load {
            rate,
            per_txn,
            secs,
            phase: self.phase,
            pipeline: self.knobs.pipeline,
        };
        let events = load.events();
        // No phase sees another's rows or WAL: an empty table, a checkpoint, a slot made now.
        let slot = format!("sustained_{}", self.phase);
        self.db.psql(&format!(
            "TRUNCATE public.outbox;\nCHECKPOINT;\n\
             SELECT pg_create_logical_replication_slot('{slot}', 'pgoutput');"
        ));
        let nats = NatsServer::start();
        let listen = readyz::free_listen_addr()?;
        let mut env = vec![
            (
                "OUTBOX_RELAY_POSTGRES_URL",
                format!("{}?sslmode=disable", self.db.url()),
            ),
            ("OUTBOX_RELAY_POSTGRES_SLOT", slot.clone()),
            ("OUTBOX_RELAY_POSTGRES_PUBLICATION", PUBLICATION.to_owned()),
            ("OUTBOX_RELAY_NATS_URL", nats.url()),
            ("OUTBOX_RELAY_NATS_STREAM", STREAM.to_owned()),
            ("OUTBOX_RELAY_HTTP_LISTEN", listen.clone()),
        ];
        if atomic {
            env.push(("OUTBOX_RELAY_NATS_ATOMIC_TRANSACTIONS", "true".to_owned()));
        }
        if let Some(g) = self.knobs.group_ms {
            env.push(("OUTBOX_RELAY_NATS_ATOMIC_GROUP_MS", g.to_string()));
        }
        if self.knobs.memory {
            memory_stream(&nats.url(), atomic).await?;
        }
        let mut relay = RelayChild::spawn_bin(bin, &env)?;
        wait_ready(&mut relay, &listen).await?;
        let walsender = self
            .db
            .psql(&format!(
                "SELECT active_pid FROM pg_replication_slots WHERE slot_name = '{slot}'"
            ))
            .trim()
            .parse()
            .ok();
        let consumer = Consumer::start(nats.url(), STREAM, self.phase, events)?;
        let url = format!("{}?sslmode=disable", self.db.url());
        let writers = self
            .writer_rt
            .spawn(writers::connect(url, self.knobs.writers, per_txn))
            .await??;
        let pids = Pids {
            relay: relay.pid(),
            nats: nats.pid().unwrap_or(0),
            walsender,
            writer_backends: writers.iter().map(|w| w.backend_pid).collect(),
            postmaster: self.postmaster,
        };
        let commits: Arc<Vec<AtomicI64>> =
            Arc::new((0..events).map(|_| AtomicI64::new(0)).collect());
        let load_before = load_average();
        let before = Snapshot::take(&pids);
        let start = tokio::time::Instant::now() + Duration::from_millis(50);
        let written = self
            .writer_rt
            .spawn(writers::write(writers, load, start, Arc::clone(&commits)))
            .await??;
        let after = Snapshot::take(&pids);
        let load_after = load_average();
        // The rest arrives, or the wait ends (a pipeline that fell far behind).
        let deadline = Instant::now() + Duration::from_secs(self.knobs.drain_secs);
        while consumer.received() < events && Instant::now() < deadline {
            if let Ok(Some(status)) = relay.child.try_wait() {
                bail!(
                    "the relay exited during the phase ({status}):\n{}",
                    relay.log()
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let receipts = consumer.finish()?;
        relay.stop();
        drop(nats);
        self.db
            .psql(&format!("SELECT pg_drop_replication_slot('{slot}')"));
        let phase = report::phase(
            kind,
            variant,
            atomic,
            load,
            Measured {
                commits: &commits,
                receipts: &receipts,
                written,
                shares: before.shares_until(&after),
                loadavg: (load_before, load_after),
            },
            &self.knobs.criterion,
        );
        phase.print_line();
        Ok(phase)
    }
}

/// The stream the relay would create (its default subjects and dead-letter subject), in memory:
/// the relay finds it and uses it (with a warning that acknowledged events would not survive a
/// restart of nats-server).
async fn memory_stream(url: &str, atomic: bool) -> anyhow::Result<()> {
    use async_nats::jetstream::{self, stream};
    let js = jetstream::new(async_nats::connect(url).await?);
    js.create_stream(stream::Config {
        name: STREAM.to_owned(),
        subjects: vec!["outbox.*".into(), "outbox_dead_letter".into()],
        storage: stream::StorageType::Memory,
        discard: stream::DiscardPolicy::New,
        duplicate_window: Duration::from_secs(120),
        allow_atomic_publish: atomic,
        ..Default::default()
    })
    .await?;
    Ok(())
}

/// Polls the relay's `/readyz` until it answers 200 (streaming, NATS connected); fails when the relay
/// exits or is not ready within 60 s.
async fn wait_ready(relay: &mut RelayChild, listen: &str) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Ok(Some(status)) = relay.child.try_wait() {
            bail!(
                "the relay exited before it was ready ({status}):\n{}",
                relay.log()
            );
        }
        if readyz::is_ready(listen) {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("the relay was not ready in 60 s:\n{}", relay.log());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
