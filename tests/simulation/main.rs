//! Deterministic simulation of the relay: the real restart loop, sessions, sink, fence and replay,
//! progress tracker, pgoutput decoder, outbox stage and replication stream framing, driven against
//! an in-memory Postgres (WAL, slot, walsender) and an in-memory JetStream, on a current-thread
//! runtime with a paused clock, every choice drawn from one seeded generator, faults injected at
//! random times and the modes users choose drawn per world (`simulation/world.rs`), and the
//! promises (P1–P4, P7, P9), the position service's claims and `status`'s verdict on the slot
//! checked against what the simulators saw, never against what the relay logged
//! (`simulation/check.rs`, `simulation/world.rs`). A third layer beside the unit tests and the tests against real
//! servers: it reaches interleavings of faults no real-server test can order on purpose, and a seed
//! replays its run forever.
//! The simulators plug into the relay's own seams: its `Connector`, the
//! NATS port `JetStreamPort` (`simulation/port.rs`, implemented by the async-nats client in
//! production), the backfill's `BackfillServers` (`simulation/backfill.rs`) and
//! `ReplicationStream::over`.
//!
//! ```text
//! cargo test --test simulation                               # SIM_SEEDS seeds from SIM_SEED_START
//! SIM_SEED=<n> cargo test --test simulation -- --nocapture   # one seed, its whole trace
//! SIM_FAULTS=all,-forge                                      # which faults (simulation/world.rs)
//! SIM_KEEP_GOING=1                                           # every seed; list the failing ones
//! ```
//!
//! The default fault set is every fault ([`DEFAULT_FAULTS`]): a fault is never left out because
//! it breaks a promise, it is fixed. `transit` (publishes that linger on the way to the server, so
//! that one of an ended session lands after the next session read the stream's tail) once broke
//! P4: a late publish took the sequence the new session's first message expected, and a later
//! message of that session, whose expected sequence the late ones happened to fill, was stored
//! past the refused one. Publishes are now chained by message id as well as by sequence
//! (`Nats-Expected-Last-Msg-Id`, which the simulated JetStream checks as nats-server does), so
//! nothing is stored past a refused message.

mod backfill;
mod check;
mod jetstream;
mod parking;
mod peek;
mod port;
mod postgres;
mod requeue_event;
mod rng;
mod status;
mod trace;
mod world;

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use world::FaultSet;

/// Seeds per `cargo test` run: about a minute of a debug build on two cores (CI's machine).
const DEFAULT_SEEDS: u64 = 600;
/// The first seed, so that CI runs the same worlds every time; move it to explore new ones.
const DEFAULT_SEED_START: u64 = 1;
/// The seeds the determinism test runs twice.
const REPLAYED_SEEDS: [u64; 3] = [3, 11, 25];

fn env_u64(name: &str) -> Option<u64> {
    let v = std::env::var(name).ok()?;
    Some(
        v.trim()
            .parse()
            .unwrap_or_else(|_| panic!("{name}={v:?} is not a number")),
    )
}

/// Every fault (see the module docs), park worlds (`parking.rs`) included. Park worlds were opt-in
/// while seeds failed in them; each is explained and fixed: seed 10 (a copy parked again without
/// its payload lost its mark), 25 (the world's schema fix), 549 (a clean stop dropped a settle
/// half-way and the drain reported the message behind the lost one) and 2627 (an event sent again
/// behind a refusal was parked behind a poison that comes after it in commit order).
const DEFAULT_FAULTS: &str = "all";

fn faults() -> FaultSet {
    let spec = std::env::var("SIM_FAULTS").unwrap_or_else(|_| DEFAULT_FAULTS.into());
    FaultSet::parse(&spec).unwrap_or_else(|e| panic!("{e}"))
}

/// One seed; a panic anywhere in it (the simulators, the relay) is a failure of that seed.
fn run_seed(seed: u64, faults: &FaultSet, keep_trace: bool) -> Result<world::Outcome, String> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        world::run(seed, faults, keep_trace)
    }))
    .map_err(|p| {
        p.downcast_ref::<String>()
            .cloned()
            .or_else(|| p.downcast_ref::<&str>().map(|s| (*s).to_owned()))
            .unwrap_or_else(|| "panic".into())
    })
}

fn replay_line(seed: u64) -> String {
    format!("replay: SIM_SEED={seed} cargo test --test simulation -- --nocapture")
}

/// A failed seed: its first violation, and the report printed for it.
struct Failure {
    seed: u64,
    first: String,
    report: String,
}

fn failure(seed: u64, outcome: Result<world::Outcome, String>) -> Option<Failure> {
    match outcome {
        Ok(o) if o.violations.is_empty() => None,
        Ok(o) => Some(Failure {
            seed,
            first: o.violations[0].clone(),
            report: format!(
                "{}\nlast events:\n{}",
                o.violations.join("\n"),
                o.trace.recent().join("\n")
            ),
        }),
        Err(p) => Some(Failure {
            seed,
            first: format!("panicked: {p}"),
            report: format!("panicked: {p}"),
        }),
    }
}

#[test]
fn seeds_keep_the_promises() {
    let faults = faults();
    if let Some(seed) = env_u64("SIM_SEED") {
        let outcome = run_seed(seed, &faults, true);
        if let Ok(o) = &outcome {
            for line in o.trace.all() {
                println!("{line}");
            }
        }
        let sizes = outcome
            .as_ref()
            .map(|o| format!("{} units of work, {} messages stored", o.units, o.stored))
            .unwrap_or_default();
        match failure(seed, outcome) {
            None => println!("seed {seed}: ok ({sizes})"),
            Some(f) => panic!("seed {seed}: {}\n{}", f.first, replay_line(seed)),
        }
        return;
    }
    let first = env_u64("SIM_SEED_START").unwrap_or(DEFAULT_SEED_START);
    let count = env_u64("SIM_SEEDS").unwrap_or(DEFAULT_SEEDS);
    let keep_going = std::env::var_os("SIM_KEEP_GOING").is_some();
    let started = Instant::now();
    // Two threads, each with its own runtimes: the worlds are independent. After a failure only
    // lower seeds still run, so the seed reported is the first failing one.
    let next = AtomicU64::new(first);
    let lowest_failed = AtomicU64::new(u64::MAX);
    let done = AtomicU64::new(0);
    let failed = Mutex::new(Vec::<Failure>::new());
    std::thread::scope(|s| {
        for _ in 0..2 {
            s.spawn(|| {
                loop {
                    let seed = next.fetch_add(1, Ordering::Relaxed);
                    if seed >= first + count
                        || (!keep_going && seed > lowest_failed.load(Ordering::Relaxed))
                    {
                        return;
                    }
                    let f = failure(seed, run_seed(seed, &faults, false));
                    done.fetch_add(1, Ordering::Relaxed);
                    if let Some(f) = f {
                        lowest_failed.fetch_min(seed, Ordering::Relaxed);
                        failed.lock().unwrap().push(f);
                    }
                }
            });
        }
    });
    let secs = started.elapsed().as_secs_f64();
    let done = done.load(Ordering::Relaxed);
    println!(
        "simulation: {done} seeds from {first} in {secs:.1} s ({:.1} seeds/s)",
        done as f64 / secs
    );
    let mut failed = failed.into_inner().unwrap();
    failed.sort_by_key(|f| f.seed);
    if keep_going {
        for f in &failed {
            println!("failed seed {}: {}", f.seed, f.first);
        }
    }
    if let Some(f) = failed.first() {
        panic!(
            "{} of {done} seeds broke a promise; the first is seed {} ({} seeds from the start):\n{}\n{}",
            failed.len(),
            f.seed,
            f.seed - first + 1,
            f.report,
            replay_line(f.seed)
        );
    }
}

#[test]
fn a_seed_replays_the_same_run() {
    let faults = faults();
    for seed in REPLAYED_SEEDS {
        let a = run_seed(seed, &faults, true).expect("first run");
        let b = run_seed(seed, &faults, true).expect("second run");
        if a.trace.digest() != b.trace.digest() {
            let (x, y) = (a.trace.all(), b.trace.all());
            let at = x
                .iter()
                .zip(&y)
                .position(|(l, r)| l != r)
                .unwrap_or(x.len().min(y.len()));
            panic!(
                "seed {seed} ran differently the second time, from line {at}:\n  first:  {}\n  second: {}",
                x.get(at).map_or("<end>", String::as_str),
                y.get(at).map_or("<end>", String::as_str)
            );
        }
    }
}
