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
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Instant;

use world::FaultSet;

/// Seeds per `cargo test` run: about a minute of a debug build on two cores (CI's machine).
const DEFAULT_SEEDS: u64 = 600;
/// The first seed, so that CI runs the same worlds every time; move it to explore new ones.
const DEFAULT_SEED_START: u64 = 1;
/// The seeds the replay test runs both ways (`SIM_SEED`'s and the runner's): a spread of worlds,
/// park worlds among them (10, 25, 549 and 2627 are the seeds park worlds once failed; 2627 parted
/// between the two ways while tokio's unbiased `select!` drew from a generator of its own).
const REPLAYED_SEEDS: [u64; 16] = [
    3, 10, 11, 25, 37, 58, 101, 149, 233, 377, 549, 610, 987, 1597, 2584, 2627,
];

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
    // A large payload's schema check on the blocking pool would end at a moment of real time.
    outbox_relay::schema::check_on_the_calling_thread();
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

/// The command that replays `seed` as this run made it: the settings that choose the world
/// (`SIM_FAULTS`, `SIM_MUTATION`) as they were set, so that the replay is the failing run.
fn replay_line(seed: u64) -> String {
    let mut env = String::new();
    for name in ["SIM_FAULTS", "SIM_MUTATION"] {
        if let Ok(v) = std::env::var(name) {
            env.push_str(&format!("{name}={v} "));
        }
    }
    format!("replay: {env}SIM_SEED={seed} cargo test --release --test simulation -- --nocapture")
}

/// What a run of a seed comes to, compared between a replay and the runner: its verdict, its size,
/// what it published and what it traced.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Fingerprint {
    /// "ok", the first violation, or the panic.
    verdict: String,
    units: usize,
    stored: usize,
    published: u64,
    /// The trace's digest and its number of lines.
    trace: (u64, u64),
}

impl Fingerprint {
    fn of(outcome: &Result<world::Outcome, String>) -> Fingerprint {
        match outcome {
            Ok(o) => Fingerprint {
                verdict: o.violations.first().cloned().unwrap_or_else(|| "ok".into()),
                units: o.units,
                stored: o.stored,
                published: o.published,
                trace: o.trace.digest(),
            },
            Err(p) => Fingerprint {
                verdict: format!("panicked: {p}"),
                units: 0,
                stored: 0,
                published: 0,
                trace: (0, 0),
            },
        }
    }
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

/// `SIM_SEED`: one seed on the calling thread, its whole trace kept.
fn replay(seed: u64, faults: &FaultSet) -> Result<world::Outcome, String> {
    run_seed(seed, faults, true)
}

/// What the runner made of its seeds.
struct Sweep {
    done: u64,
    /// Sorted by seed.
    failed: Vec<Failure>,
    /// Every seed run, sorted by seed.
    runs: Vec<(u64, Fingerprint)>,
}

/// The multi-seed runner: `seeds` (ascending) on two threads, each with its own runtimes (the
/// worlds are independent), no trace kept. Unless `keep_going`, after a failure only lower seeds
/// still run, so the seed reported is the first failing one.
fn sweep(seeds: &[u64], faults: &FaultSet, keep_going: bool) -> Sweep {
    let next = AtomicUsize::new(0);
    let lowest_failed = AtomicU64::new(u64::MAX);
    let failed = Mutex::new(Vec::<Failure>::new());
    let runs = Mutex::new(Vec::<(u64, Fingerprint)>::new());
    std::thread::scope(|s| {
        for _ in 0..2 {
            s.spawn(|| {
                loop {
                    let Some(&seed) = seeds.get(next.fetch_add(1, Ordering::Relaxed)) else {
                        return;
                    };
                    if !keep_going && seed > lowest_failed.load(Ordering::Relaxed) {
                        return;
                    }
                    let outcome = run_seed(seed, faults, false);
                    runs.lock().unwrap().push((seed, Fingerprint::of(&outcome)));
                    if let Some(f) = failure(seed, outcome) {
                        lowest_failed.fetch_min(seed, Ordering::Relaxed);
                        failed.lock().unwrap().push(f);
                    }
                }
            });
        }
    });
    let mut failed = failed.into_inner().unwrap();
    failed.sort_by_key(|f| f.seed);
    let mut runs = runs.into_inner().unwrap();
    runs.sort_by_key(|r| r.0);
    Sweep {
        done: runs.len() as u64,
        failed,
        runs,
    }
}

#[test]
fn seeds_keep_the_promises() {
    let faults = faults();
    if let Some(seed) = env_u64("SIM_SEED") {
        let outcome = replay(seed, &faults);
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
    let seeds: Vec<u64> = (first..first + count).collect();
    let Sweep { done, failed, .. } = sweep(&seeds, &faults, keep_going);
    let secs = started.elapsed().as_secs_f64();
    println!(
        "simulation: {done} seeds from {first} in {secs:.1} s ({:.1} seeds/s)",
        done as f64 / secs
    );
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

/// A seed replayed with `SIM_SEED` is the run the runner made of it: same verdict, same units of
/// work, same stream, same trace. Each seed runs once each way, the runner's on its worker threads
/// and the replay on the test's, each world on a runtime of its own: whatever a run takes from
/// outside its seed (a generator tokio seeds anew per runtime, a map's per-process order, the wall
/// clock) parts the two.
#[test]
fn a_seed_replays_the_same_run() {
    let faults = faults();
    let swept = sweep(&REPLAYED_SEEDS, &faults, true);
    let mut parted = Vec::new();
    for (seed, ran) in &swept.runs {
        let again = replay(*seed, &faults);
        let replayed = Fingerprint::of(&again);
        if &replayed != ran {
            parted.push(format!(
                "seed {seed}: the runner made {ran:?}, the replay {replayed:?}"
            ));
        }
    }
    assert_eq!(swept.runs.len(), REPLAYED_SEEDS.len(), "every seed ran");
    assert!(
        parted.is_empty(),
        "{} of {} seeds replayed a different run than the runner's:\n{}",
        parted.len(),
        REPLAYED_SEEDS.len(),
        parted.join("\n")
    );
}
