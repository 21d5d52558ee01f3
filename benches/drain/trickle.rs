//! Idle and trickle cost: what a caught-up relay costs while it waits or sees a few events a second.
//! The release relay (`outbox-relay run`, a subprocess) drains a small backlog from a fresh database
//! and slot into a fresh nats-server; then, for each rate (events/s, 0 = idle), one writer
//! connection commits single-event transactions on a fixed schedule for a fixed time, and the CPU
//! (utime+stime from /proc, as % of one core over the phase's wall time) and the voluntary context
//! switches per second (wake-ups: a thread that blocked and was woken; summed over the threads) are
//! read for the relay, nats-server, the slot's walsender (`pg_replication_slots.active_pid`) and the
//! relay's other backends (its slot monitor). The stream's message count before and after each phase
//! says every event arrived.
//!
//! A relay that waits should cost close to nothing: at idle what is left is its timers (keepalive
//! replies, status updates, the slot monitor, NATS pings), which is what the wake-ups count. CPU is
//! the scheduler's runtime of every thread (`schedstat`, in ns), not utime+stime: those are sampled
//! at the 10 ms tick, too coarse for a process that runs a few µs a hundred times a second.
//!
//! `BENCH_IDLE_COST=1` adds this to a run, `BENCH_IDLE_COST_ONLY=1` runs nothing else;
//! `BENCH_TRICKLE_RATES` (`0,10,100`) and `BENCH_TRICKLE_SECS` (30) per rate.

use std::fs;
use std::time::{Duration, Instant};

use async_nats::jetstream;
use outbox_relay::testkit::{NatsServer, PgServer, TestDb};

use super::{PAYLOAD, STREAM, cpu_ms, env_list, env_or, fill, relay, relay_db_setup};

/// Events the relay drains before the phases: it streams once the stream holds them.
const WARM_EVENTS: u64 = 1000;

/// One rate's phase.
struct Phase {
    rate: u64,
    secs: f64,
    written: u64,
    arrived: u64,
    relay: Usage,
    nats: Usage,
    walsender: Usage,
    backends: Usage,
}

/// What one process (or group of them) did over a phase.
#[derive(Clone, Copy)]
struct Usage {
    /// CPU as % of one core.
    pct: f64,
    /// Voluntary context switches per second, all threads.
    wakeups: f64,
}

/// CPU ms and voluntary context switches of some processes, at one moment.
#[derive(Clone, Copy)]
struct Sample {
    cpu_ms: f64,
    switches: u64,
}

impl Sample {
    /// The sum over `pids`; a pid that is gone reads 0, and the phase then reads NaN.
    fn of(pids: &[u32]) -> Sample {
        Sample {
            cpu_ms: pids.iter().map(|&p| run_ms(p)).sum(),
            switches: pids.iter().map(|&p| voluntary_switches(p)).sum(),
        }
    }

    fn usage(self, after: Sample, secs: f64) -> Usage {
        if after.cpu_ms < self.cpu_ms || after.switches < self.switches {
            return Usage {
                pct: f64::NAN,
                wakeups: f64::NAN,
            };
        }
        Usage {
            pct: (after.cpu_ms - self.cpu_ms) / (secs * 1000.0) * 100.0,
            wakeups: (after.switches - self.switches) as f64 / secs,
        }
    }
}

/// CPU time of `pid` in ms: the scheduler's own runtime of each thread (`/proc/<pid>/task/*/schedstat`,
/// in ns), exact where utime+stime are sampled at the 10 ms tick, which at a trickle is too coarse and
/// can be skewed by wake-ups that fall in step with the tick. Falls back to utime+stime without
/// schedstat.
fn run_ms(pid: u32) -> f64 {
    let Ok(tasks) = fs::read_dir(format!("/proc/{pid}/task")) else {
        return cpu_ms(pid);
    };
    let ns: Option<u64> = tasks
        .flatten()
        .map(|t| {
            fs::read_to_string(t.path().join("schedstat"))
                .ok()?
                .split_whitespace()
                .next()?
                .parse::<u64>()
                .ok()
        })
        .sum();
    ns.map_or_else(|| cpu_ms(pid), |ns| ns as f64 / 1e6)
}

/// `voluntary_ctxt_switches` summed over the threads of `pid` (the process's own status file
/// counts only its main thread).
fn voluntary_switches(pid: u32) -> u64 {
    let Ok(tasks) = fs::read_dir(format!("/proc/{pid}/task")) else {
        return 0;
    };
    tasks
        .flatten()
        .filter_map(|t| fs::read_to_string(t.path().join("status")).ok())
        .filter_map(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("voluntary_ctxt_switches:"))
                .and_then(|v| v.trim().parse::<u64>().ok())
        })
        .sum()
}

/// See the module docs.
pub(crate) async fn run(pg: &PgServer) -> anyhow::Result<()> {
    let rates = env_list("BENCH_TRICKLE_RATES", "0,10,100");
    let secs: u64 = env_or("BENCH_TRICKLE_SECS", 30).max(1);
    let db = TestDb::create(pg).await;
    let slot = "trickle".to_owned();
    relay_db_setup(&db, std::slice::from_ref(&slot))?;
    fill(&db, WARM_EVENTS, 1)?;
    let nats = NatsServer::start();
    let (mut relay, ..) = relay(&db, &nats, &slot, WARM_EVENTS).await?;
    // The catch-up's acks, confirmations and first status updates stay out of the first phase.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let stats = db.client().await;
    let walsender: i32 = stats
        .query_one(
            "SELECT active_pid FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await?
        .try_get(0)
        .map_err(|e| anyhow::anyhow!("slot {slot} has no walsender: {e}"))?;
    let backends: Vec<u32> = stats
        .query(
            "SELECT pid FROM pg_stat_activity WHERE application_name LIKE 'outbox-relay/%' \
             AND backend_type <> 'walsender'",
            &[],
        )
        .await?
        .iter()
        .map(|r| r.get::<_, i32>(0) as u32)
        .collect();
    let pids = (
        relay.pid(),
        nats.pid().unwrap_or(0),
        walsender as u32,
        backends.clone(),
    );
    let js = jetstream::new(nats.client().await);
    let mut stream = js.get_stream(STREAM).await?;
    println!(
        "idle and trickle: relay pid {}, walsender pid {}, {} other relay backend(s); {secs} s per rate",
        pids.0,
        pids.2,
        backends.len()
    );
    let mut phases = Vec::new();
    for &rate in &rates {
        let before_msgs = stream.info().await?.state.messages;
        let total = rate * secs;
        let writer = db.client().await;
        let insert = writer
            .prepare(
                "INSERT INTO public.outbox (aggregate_type, aggregate_id, event_type, payload) \
                 VALUES ('Order', $1, 'OrderPlaced', $2::text::jsonb)",
            )
            .await?;
        let start = tokio::time::Instant::now() + Duration::from_millis(100);
        tokio::time::sleep_until(start).await;
        let s0 = (
            Sample::of(&[pids.0]),
            Sample::of(&[pids.1]),
            Sample::of(&[pids.2]),
            Sample::of(&pids.3),
        );
        let t = Instant::now();
        // The writer runs here, not in a task: it is the only thing this process does meanwhile.
        let mut written = 0u64;
        for i in 0..total {
            tokio::time::sleep_until(start + Duration::from_nanos(i * 1_000_000_000 / rate)).await;
            writer
                .execute(&insert, &[&format!("order-{i}"), &PAYLOAD])
                .await?;
            written += 1;
        }
        let write_secs = t.elapsed().as_secs_f64();
        tokio::time::sleep_until(start + Duration::from_secs(secs)).await;
        let wall = t.elapsed().as_secs_f64();
        let s1 = (
            Sample::of(&[pids.0]),
            Sample::of(&[pids.1]),
            Sample::of(&[pids.2]),
            Sample::of(&pids.3),
        );
        // Outside the phase: let the last events arrive, then count them.
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut arrived = 0;
        while Instant::now() < deadline {
            arrived = stream.info().await?.state.messages - before_msgs;
            if arrived >= written {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let phase = Phase {
            rate,
            secs: wall,
            written,
            arrived,
            relay: s0.0.usage(s1.0, wall),
            nats: s0.1.usage(s1.1, wall),
            walsender: s0.2.usage(s1.2, wall),
            backends: s0.3.usage(s1.3, wall),
        };
        println!(
            "  {rate}/s: {written} written in {write_secs:.1} s ({:.1}/s), {arrived} arrived; relay {:.3} % ({:.1} wake-ups/s), nats-server {:.3} %, walsender {:.3} %, other backends {:.3} %",
            written as f64 / write_secs.max(1e-3),
            phase.relay.pct,
            phase.relay.wakeups,
            phase.nats.pct,
            phase.walsender.pct,
            phase.backends.pct
        );
        phases.push(phase);
    }
    if let Ok(Some(status)) = relay.child.try_wait() {
        anyhow::bail!(
            "relay exited during the phases ({status}):\n{}",
            relay.log()
        );
    }
    relay.stop();
    print(secs, &phases);
    Ok(())
}

fn print(secs: u64, phases: &[Phase]) {
    println!();
    println!(
        "== idle and trickle cost: CPU as % of one core over each {secs} s phase (the scheduler's runtime per thread); wake-ups = voluntary context switches/s, all threads =="
    );
    println!(
        "| rate/s | written | arrived | relay % | relay wake-ups/s | relay µs/event | nats-server % | nats wake-ups/s | walsender % | walsender wake-ups/s | other backends % |"
    );
    for p in phases {
        println!(
            "| {:>6} | {:>7} | {:>7} | {:>7.3} | {:>16.1} | {:>14} | {:>13.3} | {:>15.1} | {:>11.3} | {:>20.1} | {:>16.3} |",
            p.rate,
            p.written,
            p.arrived,
            p.relay.pct,
            p.relay.wakeups,
            per_event(p).map_or("-".into(), |u| format!("{u:.1}")),
            p.nats.pct,
            p.nats.wakeups,
            p.walsender.pct,
            p.walsender.wakeups,
            p.backends.pct
        );
    }
    let num = |x: f64, d: usize| {
        if x.is_finite() {
            format!("{x:.d$}")
        } else {
            "null".into()
        }
    };
    let usage = |u: Usage| {
        format!(
            r#"{{"cpu_pct":{},"wakeups_per_s":{}}}"#,
            num(u.pct, 3),
            num(u.wakeups, 1)
        )
    };
    let rows: Vec<String> = phases
        .iter()
        .map(|p| {
            format!(
                r#"{{"rate":{},"secs":{:.2},"written":{},"arrived":{},"relay":{},"relay_us_per_event":{},"nats":{},"walsender":{},"other_backends":{}}}"#,
                p.rate,
                p.secs,
                p.written,
                p.arrived,
                usage(p.relay),
                per_event(p).map_or("null".into(), |u| num(u, 1)),
                usage(p.nats),
                usage(p.walsender),
                usage(p.backends)
            )
        })
        .collect();
    println!(
        r#"{{"bench":"trickle","secs":{secs},"rows":[{}]}}"#,
        rows.join(",")
    );
}

/// The relay's CPU per event written in the phase, its idle cost included.
fn per_event(p: &Phase) -> Option<f64> {
    (p.written > 0).then(|| p.relay.pct / 100.0 * p.secs * 1e6 / p.written as f64)
}
