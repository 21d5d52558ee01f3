//! Backlog drain, commit → stored latency and database load, each next to a baseline measured in the
//! same run.
//!
//! On a private Postgres (`outbox_relay::testkit`) a backlog of single-row outbox transactions is written after
//! every slot exists, and then, per round (rounds alternate so a busy machine slows them alike):
//!
//! - `pg_recvlogical` drains its own slot into /dev/null until `--endpos` (the WAL position taken after
//!   the writes): the source's limit, the walsender's decoding speed plus a trivial client;
//! - our source alone (`ReplConnection` + `Decoder`, confirm at each Commit) drains its slot to the
//!   same position;
//! - the sink's limit (`drain/sink.rs`): async-nats publishing as many messages, with the relay's
//!   subject, headers and payload, at the relay's window, to a fresh NATS; no Postgres;
//! - the relay binary (`outbox-relay run`, a subprocess so its RSS and CPU are its own) drains its slot
//!   to a fresh NATS until the stream holds every event. Its peak RSS (VmHWM) and CPU (utime+stime)
//!   are read from /proc just before it is stopped.
//!
//! Then, with the last round's relay caught up, the database load of an idle period is read, and
//! writers commit single-event transactions at fixed rates; an ordered consumer on the stream takes the
//! receive time of each event id, and the latency is that minus the moment the writer's COMMIT
//! returned. The same drain (without the source) runs on a backlog of 10k transactions × 10 events,
//! and with `BENCH_BIG=1` on 1M single-event transactions.
//!
//! Last, a typical polling publisher (`drain/poll.rs`), at each poll interval: its drain of
//! the same backlog, the load it puts on the database while idle and at 1k events/s
//! (`pg_stat_user_tables` of the outbox table, `pg_stat_database`), and its latency at 1k/s.
//!
//! `cargo bench --bench drain` prints a table and one JSON line. Knobs (environment): `BENCH_EVENTS`
//! (100000), `BENCH_ROUNDS` (3), `BENCH_LATENCY_SECS` (10), `BENCH_RATES` (`1000,5000,10000`),
//! `BENCH_IDLE_SECS` (10), `BENCH_BATCH_TXNS` (10000; 0 skips the 10-event transactions),
//! `BENCH_BIG=1` (`BENCH_BIG_EVENTS`, 1000000), `BENCH_SCHEMAS` (validation off against on,
//! `drain/schemas.rs`; `BENCH_SCHEMAS_ONLY=1` runs only that), `BENCH_POLL_INTERVALS_MS` (`5000,100`; empty skips the
//! polling baseline), `BENCH_RELAY_WRAPPER` (a command prefix for the relay, e.g.
//! `perf record -g -o relay.data --`, with `cargo bench --profile profiling` so the relay has
//! symbols; its RSS/CPU are then the wrapper's), `BENCH_HEADERS=1` (what
//! each header costs nats-server, `drain/headers.rs`; `BENCH_HEADERS_ONLY=1` runs only that),
//! `BENCH_IDLE_COST=1` (the relay's CPU at idle and a trickle of events, `drain/trickle.rs`;
//! `BENCH_IDLE_COST_ONLY=1` runs only that), `BENCH_FAST=1` (fast batch publishing against
//! per-message acks, `drain/fast.rs`; `BENCH_FAST_ONLY=1` runs only that),
//! `BENCH_ATOMIC_COST_ONLY=1` (atomic batches' fixed cost in nats-server, `drain/atomic.rs`),
//! `BENCH_ATOMIC_LATENCY_ONLY=1` (commit → consumer latency of atomic transactions with group commit
//! on and off, `drain/atomic_latency.rs`), `BENCH_PARK=1` (`on_invalid = "park"` against `dead_letter`
//! and the cost of a parked event, `drain/parking.rs`; `BENCH_PARK_ONLY=1` runs only that). Under `cargo test --benches` (no `--bench` argument) it
//! does nothing: starting servers is the tests' job.

#[path = "drain/atomic.rs"]
mod atomic;
#[path = "drain/atomic_latency.rs"]
mod atomic_latency;
#[path = "common/cpu.rs"]
mod cpu;
#[path = "drain/fast.rs"]
mod fast;
#[path = "drain/headers.rs"]
mod headers;
#[path = "drain/latency.rs"]
mod latency;
#[path = "common/outbox_db.rs"]
mod outbox_db;
#[path = "drain/parking.rs"]
mod parking;
#[path = "drain/poll.rs"]
mod poll;
#[path = "common/relay_child.rs"]
mod relay_child;
#[path = "drain/schemas.rs"]
mod schemas;
#[path = "drain/shapes.rs"]
mod shapes;
#[path = "drain/sink.rs"]
mod sink;
#[path = "drain/telemetry.rs"]
mod telemetry;
#[path = "drain/trickle.rs"]
mod trickle;

use std::fs;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use cpu::{cpu_ms, stat_cpu_ms};

use anyhow::{Context, bail};
use async_nats::jetstream;
use latency::{Latency, latency, latency_json, print_latency};
use outbox_relay::Lsn;
use outbox_relay::pgoutput::{Decoder, Message};
use outbox_relay::source::{
    ConnInfo, PgOutputOptions, ReplConnection, ReplicationEvent, StreamConfig,
};
use outbox_relay::testkit::{NatsServer, PgServer, TestDb};
use poll::{PgLoad, Poller};
use relay_child::RelayChild;

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

fn env_list(name: &str, default: &str) -> Vec<u64> {
    std::env::var(name)
        .unwrap_or_else(|_| default.into())
        .split(',')
        .filter_map(|r| r.trim().parse().ok())
        .collect()
}

/// Whether the environment variable `name` is `1`.
fn flag(name: &str) -> bool {
    std::env::var(name).is_ok_and(|v| v == "1")
}

fn main() -> anyhow::Result<()> {
    if !std::env::args().any(|a| a == "--bench") {
        println!("drain bench: skipped (it starts servers; run `cargo bench --bench drain`)");
        return Ok(());
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    // The header costs and fast batches need no Postgres: run alone, they start none.
    if flag("BENCH_HEADERS_ONLY") && !flag("BENCH_IDLE_COST_ONLY") {
        return rt.block_on(headers::run(env_or("BENCH_ROUNDS", 3usize).max(1)));
    }
    if flag("BENCH_FAST_ONLY") {
        return rt.block_on(fast::run(env_or("BENCH_ROUNDS", 3usize).max(1)));
    }
    if flag("BENCH_ATOMIC_COST_ONLY") {
        return rt.block_on(atomic::run(env_or("BENCH_ROUNDS", 3usize).max(1)));
    }
    let pg = PgServer::start_private();
    if flag("BENCH_ATOMIC_LATENCY_ONLY") {
        return rt.block_on(atomic_latency::run(&pg));
    }
    rt.block_on(run(&pg))
}

struct Round {
    recvlogical_eps: f64,
    source_eps: f64,
    sink_eps: f64,
    relay_eps: f64,
    relay_rss_mb: f64,
    relay_cpu_ms_per_1k: f64,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// Medians over the rounds of one backlog (`source_eps` is NaN where the source did not run).
struct Drain {
    label: String,
    events: u64,
    rounds: usize,
    recvlogical_eps: f64,
    source_eps: f64,
    sink_eps: f64,
    relay_eps: f64,
    ratio_relay: f64,
    ratio_source: f64,
    relay_rss_mb: f64,
    relay_cpu_ms_per_1k: f64,
}

impl Drain {
    fn of(label: &str, events: u64, results: &[Round]) -> Drain {
        let med = |f: &dyn Fn(&Round) -> f64| median(results.iter().map(f).collect());
        Drain {
            label: label.to_owned(),
            events,
            rounds: results.len(),
            recvlogical_eps: med(&|r| r.recvlogical_eps),
            source_eps: med(&|r| r.source_eps),
            sink_eps: med(&|r| r.sink_eps),
            relay_eps: med(&|r| r.relay_eps),
            ratio_relay: med(&|r| r.relay_eps / r.recvlogical_eps),
            ratio_source: med(&|r| r.source_eps / r.recvlogical_eps),
            relay_rss_mb: results.iter().map(|r| r.relay_rss_mb).fold(0.0, f64::max),
            relay_cpu_ms_per_1k: med(&|r| r.relay_cpu_ms_per_1k),
        }
    }

    fn json(&self) -> String {
        let num = |x: f64, d: usize| {
            if x.is_finite() {
                format!("{x:.d$}")
            } else {
                "null".into()
            }
        };
        format!(
            r#"{{"backlog":"{}","events":{},"rounds":{},"pg_recvlogical_eps":{},"sink_eps":{},"source_eps":{},"relay_eps":{},"ratio_relay":{},"ratio_source":{},"relay_peak_rss_mb":{},"relay_cpu_ms_per_1k":{}}}"#,
            self.label,
            self.events,
            self.rounds,
            num(self.recvlogical_eps, 0),
            num(self.sink_eps, 0),
            num(self.source_eps, 0),
            num(self.relay_eps, 0),
            num(self.ratio_relay, 3),
            num(self.ratio_source, 3),
            num(self.relay_rss_mb, 1),
            num(self.relay_cpu_ms_per_1k, 1)
        )
    }
}

/// One period of database load, with how long it lasted and (for the poller) its own statement count.
struct Load {
    who: String,
    period: String,
    secs: f64,
    delta: PgLoad,
    /// Statements the poller sent against the outbox table; for the relay the scans are the proof.
    statements: Option<u64>,
}

/// The polling baseline at one interval.
struct Polling {
    interval_ms: u64,
    drain_eps: f64,
    latency: Option<Latency>,
}

/// The outbox table of the relay (sql/01) with a publication and the given slots.
fn relay_db_setup(db: &TestDb, slots: &[String]) -> anyhow::Result<()> {
    outbox_db::outbox_setup(db, PUBLICATION)?;
    for slot in slots {
        db.psql(&format!(
            "SELECT pg_create_logical_replication_slot('{slot}', 'pgoutput')"
        ));
    }
    Ok(())
}

/// The backlog: `txns` transactions of `per_txn` rows, written by a procedure (COMMIT inside the
/// loop), without waiting for WAL flushes. The end position is the insert position right after it (the
/// end of the last commit record; pg_current_wal_lsn() would be the page-aligned write position, before
/// it); a synchronous empty transaction then flushes everything up to it, so the walsenders can send
/// it. Returns the end position and the seconds the writes took.
fn fill(db: &TestDb, txns: u64, per_txn: u64) -> anyhow::Result<(Lsn, f64)> {
    fill_with(db, txns, per_txn, PAYLOAD)
}

/// [`fill`] with another jsonb payload.
fn fill_with(db: &TestDb, txns: u64, per_txn: u64, payload: &str) -> anyhow::Result<(Lsn, f64)> {
    let t = Instant::now();
    let out = db.psql(&format!(
        "CREATE OR REPLACE PROCEDURE bench_fill(n int, k int) LANGUAGE plpgsql AS $$\n\
         BEGIN\n\
           FOR i IN 1..n LOOP\n\
             FOR j IN 1..k LOOP\n\
               INSERT INTO public.outbox (aggregate_type, aggregate_id, event_type, payload)\n\
                 VALUES ('Order', 'order-' || i, 'OrderPlaced', '{payload}'::jsonb);\n\
             END LOOP;\n\
             COMMIT;\n\
           END LOOP;\n\
         END $$;\n\
         SET synchronous_commit = off;\n\
         CALL bench_fill({txns}, {per_txn});\n\
         SELECT pg_current_wal_insert_lsn();\n\
         SET synchronous_commit = on;\n\
         SELECT txid_current();"
    ));
    let secs = t.elapsed().as_secs_f64();
    let target: Lsn = out
        .lines()
        .next()
        .unwrap_or_default()
        .parse()
        .map_err(|e| anyhow::anyhow!("pg_current_wal_insert_lsn {out:?}: {e:?}"))?;
    Ok((target, secs))
}

/// The payload as the relay publishes it (the jsonb text form).
fn stored_payload(db: &TestDb) -> String {
    db.psql("SELECT payload::text FROM public.outbox LIMIT 1")
}

/// The sink's limit on a fresh nats-server.
async fn sink_round(payload: &str, events: u64) -> anyhow::Result<f64> {
    let nats = NatsServer::start();
    sink::limit(nats.client().await, STREAM, payload, events).await
}

async fn run(pg: &PgServer) -> anyhow::Result<()> {
    let events: u64 = env_or("BENCH_EVENTS", 100_000);
    let rounds: usize = env_or("BENCH_ROUNDS", 3).max(1);
    let latency_secs: u64 = env_or("BENCH_LATENCY_SECS", 10);
    let idle_secs: u64 = env_or("BENCH_IDLE_SECS", 10);
    let rates = env_list("BENCH_RATES", "1000,5000,10000");
    let batch_txns: u64 = env_or("BENCH_BATCH_TXNS", 10_000);
    let big = std::env::var("BENCH_BIG").is_ok_and(|v| v == "1");
    let big_events: u64 = env_or("BENCH_BIG_EVENTS", 1_000_000);
    let poll_intervals = env_list("BENCH_POLL_INTERVALS_MS", "5000,100");
    let started = Instant::now();
    // Telemetry off / on 0 % / on 100 % sampled (`drain/telemetry.rs`), on request.
    if std::env::var("BENCH_TELEMETRY").is_ok_and(|v| v == "1")
        || std::env::var("BENCH_TELEMETRY_ONLY").is_ok_and(|v| v == "1")
    {
        let rows = telemetry::run(pg, events, rounds).await?;
        for row in &rows {
            println!(
                "| {:<17} | CPU per 1k events {} ms (median {:.2}) | {:.0} events/s (median) |",
                row.variant,
                row.cpu_ms_per_1k
                    .iter()
                    .map(|c| format!("{c:.2}"))
                    .collect::<Vec<_>>()
                    .join(" / "),
                median(row.cpu_ms_per_1k.clone()),
                median(row.eps.clone())
            );
        }
        if std::env::var("BENCH_TELEMETRY_ONLY").is_ok_and(|v| v == "1") {
            return Ok(());
        }
    }
    // What each header costs nats-server (`drain/headers.rs`), and the relay's idle and trickle
    // cost (`drain/trickle.rs`), on request.
    let (headers_only, idle_only) = (flag("BENCH_HEADERS_ONLY"), flag("BENCH_IDLE_COST_ONLY"));
    if headers_only || flag("BENCH_HEADERS") {
        headers::run(rounds).await?;
    }
    if flag("BENCH_FAST") {
        fast::run(rounds).await?;
    }
    if idle_only || flag("BENCH_IDLE_COST") {
        trickle::run(pg).await?;
    }
    if headers_only || idle_only {
        return Ok(());
    }
    // What park mode costs (`drain/parking.rs`), on request.
    if let Some(r) = parking::run(pg).await? {
        parking::print(&r);
        if flag("BENCH_PARK_ONLY") {
            return Ok(());
        }
    }
    // 0. Transaction shapes × payload sizes (`drain/shapes.rs`).
    let shape_rows = if std::env::var("BENCH_SHAPES").map_or(true, |v| !v.is_empty()) {
        shapes::run(pg, rounds).await?
    } else {
        Vec::new()
    };
    if std::env::var("BENCH_SHAPES_ONLY").is_ok_and(|v| v == "1") {
        return Ok(());
    }
    // 0b. Validation off and on (`drain/schemas.rs`).
    let schema_result = schemas::run(pg).await?;
    if std::env::var("BENCH_SCHEMAS_ONLY").is_ok_and(|v| v == "1") {
        if let Some(r) = &schema_result {
            schemas::print(r);
        }
        return Ok(());
    }
    let mut loads: Vec<Load> = Vec::new();
    let mut loadavg = vec![load_average()];

    // 1. The single-row backlog: pg_recvlogical, source, sink limit, relay; then idle load and latency.
    let db = TestDb::create(pg).await;
    let slots =
        |kind: &str| -> Vec<String> { (0..rounds).map(|r| format!("{kind}_{r}")).collect() };
    let (recv_slots, source_slots, relay_slots) = (slots("recv"), slots("source"), slots("relay"));
    let all: Vec<String> = [&recv_slots[..], &source_slots, &relay_slots].concat();
    relay_db_setup(&db, &all)?;
    let (target, fill_secs) = fill(&db, events, 1)?;
    let wal_mb: f64 = db
        .psql(&format!(
            "SELECT (pg_current_wal_lsn() - confirmed_flush_lsn) / 1048576.0 FROM pg_replication_slots WHERE slot_name = '{}'",
            recv_slots[0]
        ))
        .parse()?;
    let payload = stored_payload(&db);
    println!(
        "backlog: {events} single-row transactions written in {fill_secs:.1} s; {wal_mb:.0} MB of WAL; end position {target}; payload {} bytes",
        payload.len()
    );

    let mut results = Vec::new();
    let mut kept: Option<(RelayChild, NatsServer)> = None;
    for r in 0..rounds {
        let recvlogical_eps = recvlogical(pg, &db, &recv_slots[r], target, events)?;
        let source_eps = source(&db, &source_slots[r], target, events).await?;
        let sink_eps = sink_round(&payload, events).await?;
        let nats = NatsServer::start();
        let (relay, relay_eps, relay_rss_mb, relay_cpu_ms) =
            relay(&db, &nats, &relay_slots[r], events).await?;
        let round = Round {
            recvlogical_eps,
            source_eps,
            sink_eps,
            relay_eps,
            relay_rss_mb,
            relay_cpu_ms_per_1k: relay_cpu_ms / (events as f64 / 1000.0),
        };
        println!(
            "round {}: pg_recvlogical {:.0}/s, source {:.0}/s ({:.2}x), sink limit {:.0}/s, relay {:.0}/s ({:.2}x), relay peak RSS {:.1} MB, relay CPU {:.1} ms/1k events",
            r + 1,
            round.recvlogical_eps,
            round.source_eps,
            round.source_eps / round.recvlogical_eps,
            round.sink_eps,
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
    loadavg.push(load_average());
    let mut drains = vec![Drain::of(&format!("{events}x1"), events, &results)];

    let mut latencies: Vec<(String, u64, Latency)> = Vec::new();
    if let Some((mut relay, nats)) = kept {
        let stats = db.client().await;
        if idle_secs > 0 {
            loads.push(idle_load(&stats, "relay", idle_secs, None).await?);
        }
        if latency_secs > 0 {
            for (phase, &rate) in rates.iter().enumerate() {
                let before = PgLoad::read(&stats).await?;
                let t = Instant::now();
                let l = latency(&db, &nats, rate, latency_secs, phase as u32 + 1, 1).await?;
                loads.push(Load {
                    who: "relay".into(),
                    period: format!("{rate}/s"),
                    secs: t.elapsed().as_secs_f64(),
                    delta: PgLoad::read(&stats).await?.delta(&before),
                    statements: None,
                });
                print_latency("relay", rate, &l);
                latencies.push(("relay".into(), rate, l));
            }
        }
        loadavg.push(load_average());
        relay.stop();
        drop(nats);
    }
    drop(db);

    // 2. Transactions of 10 events, and (BENCH_BIG=1) the 1M backlog: pg_recvlogical, sink, relay.
    if batch_txns > 0 {
        drains.push(backlog_drain(pg, batch_txns, 10, rounds).await?);
        loadavg.push(load_average());
    }
    if big {
        drains.push(backlog_drain(pg, big_events, 1, 1).await?);
        loadavg.push(load_average());
    }

    // 3. The polling baseline at each interval.
    let mut polling = Vec::new();
    for &interval_ms in &poll_intervals {
        polling.push(
            polling_baseline(pg, events, interval_ms, idle_secs, latency_secs, &mut loads).await?,
        );
        loadavg.push(load_average());
    }

    if !shape_rows.is_empty() {
        shapes::print(&shape_rows);
    }
    if let Some(r) = &schema_result {
        schemas::print(r);
    }
    report(
        &drains,
        &latencies,
        &polling,
        &loads,
        &loadavg,
        started.elapsed(),
    );
    Ok(())
}

/// The database load of `idle_secs` with nothing written.
async fn idle_load(
    stats: &tokio_postgres::Client,
    who: &str,
    idle_secs: u64,
    poller: Option<&poll::Counters>,
) -> anyhow::Result<Load> {
    let before = PgLoad::read(stats).await?;
    let q0 = poller.map(poll::Counters::queries);
    let t = Instant::now();
    tokio::time::sleep(Duration::from_secs(idle_secs)).await;
    let after = PgLoad::read(stats).await?;
    Ok(Load {
        who: who.into(),
        period: "idle".into(),
        secs: t.elapsed().as_secs_f64(),
        delta: after.delta(&before),
        statements: poller.map(|c| c.queries() - q0.unwrap_or(0)),
    })
}

/// A backlog of `txns` × `per_txn` in a database of its own: `rounds` alternating rounds of
/// pg_recvlogical, the sink's limit and the relay.
async fn backlog_drain(
    pg: &PgServer,
    txns: u64,
    per_txn: u64,
    rounds: usize,
) -> anyhow::Result<Drain> {
    let events = txns * per_txn;
    let label = format!("{txns}x{per_txn}");
    let db = TestDb::create(pg).await;
    let recv_slots: Vec<String> = (0..rounds).map(|r| format!("recv_{r}")).collect();
    let relay_slots: Vec<String> = (0..rounds).map(|r| format!("relay_{r}")).collect();
    relay_db_setup(&db, &[&recv_slots[..], &relay_slots].concat())?;
    let (target, fill_secs) = fill(&db, txns, per_txn)?;
    let payload = stored_payload(&db);
    println!("backlog {label}: {events} events written in {fill_secs:.1} s; end position {target}");
    let mut results = Vec::new();
    for r in 0..rounds {
        let recvlogical_eps = recvlogical(pg, &db, &recv_slots[r], target, events)?;
        let sink_eps = sink_round(&payload, events).await?;
        let nats = NatsServer::start();
        let (mut relay, relay_eps, relay_rss_mb, relay_cpu_ms) =
            relay(&db, &nats, &relay_slots[r], events).await?;
        relay.stop();
        let round = Round {
            recvlogical_eps,
            source_eps: f64::NAN,
            sink_eps,
            relay_eps,
            relay_rss_mb,
            relay_cpu_ms_per_1k: relay_cpu_ms / (events as f64 / 1000.0),
        };
        println!(
            "{label} round {}: pg_recvlogical {:.0}/s, sink limit {:.0}/s, relay {:.0}/s ({:.2}x), relay peak RSS {:.1} MB, relay CPU {:.1} ms/1k events",
            r + 1,
            round.recvlogical_eps,
            round.sink_eps,
            round.relay_eps,
            round.relay_eps / round.recvlogical_eps,
            round.relay_rss_mb,
            round.relay_cpu_ms_per_1k
        );
        results.push(round);
    }
    Ok(Drain::of(&label, events, &results))
}

/// The poller at `interval_ms`: drains an `events` backlog of single-row transactions into a
/// fresh stream, then stays running for an idle period and a 1k/s latency phase, with the database
/// load of each.
async fn polling_baseline(
    pg: &PgServer,
    events: u64,
    interval_ms: u64,
    idle_secs: u64,
    latency_secs: u64,
    loads: &mut Vec<Load>,
) -> anyhow::Result<Polling> {
    let who = format!("polling {}", interval_label(interval_ms));
    let db = TestDb::create(pg).await;
    db.psql(poll::TABLE_SQL);
    let (_, fill_secs) = fill(&db, events, 1)?;
    db.psql("VACUUM ANALYZE public.outbox");
    println!("{who}: backlog of {events} written in {fill_secs:.1} s");
    let nats = NatsServer::start();
    let js = jetstream::new(nats.client().await);
    js.create_stream(sink::stream_config(STREAM)).await?;
    let t = Instant::now();
    let mut poller = Poller::start(
        db.client().await,
        jetstream::new(nats.client().await),
        Duration::from_millis(interval_ms),
    );
    let mut stream = js.get_stream(STREAM).await?;
    loop {
        tokio::time::sleep(Duration::from_millis(20)).await;
        poller.check()?;
        if t.elapsed() > Duration::from_secs(600) {
            bail!("{who} did not drain {events} events in 600 s");
        }
        if stream.info().await?.state.messages >= events {
            break;
        }
    }
    let drain_eps = events as f64 / t.elapsed().as_secs_f64();
    println!(
        "{who}: drained {events} in {:.1} s, {drain_eps:.0}/s ({} polls)",
        t.elapsed().as_secs_f64(),
        poller
            .counters
            .polls
            .load(std::sync::atomic::Ordering::Relaxed)
    );
    let stats = db.client().await;
    // The poller's backend publishes its counters at most once a second, and after the drain its next
    // transaction is one interval away: wait until every UPDATE of the drain is counted, so the idle
    // period does not inherit the drain's tail.
    let settle = Instant::now();
    while PgLoad::read(&stats).await?.n_tup_upd < events as i64
        && settle.elapsed() < Duration::from_secs(30)
    {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(Duration::from_millis(1100)).await;
    if idle_secs > 0 {
        loads.push(idle_load(&stats, &who, idle_secs, Some(&poller.counters)).await?);
    }
    let mut latency_result = None;
    if latency_secs > 0 {
        let before = PgLoad::read(&stats).await?;
        let q0 = poller.counters.queries();
        let t = Instant::now();
        let l = latency(&db, &nats, 1000, latency_secs, 1, 1).await?;
        poller.check()?;
        loads.push(Load {
            who: who.clone(),
            period: "1000/s".into(),
            secs: t.elapsed().as_secs_f64(),
            delta: PgLoad::read(&stats).await?.delta(&before),
            statements: Some(poller.counters.queries() - q0),
        });
        print_latency(&who, 1000, &l);
        latency_result = Some(l);
    }
    poller.stop().await?;
    Ok(Polling {
        interval_ms,
        drain_eps,
        latency: latency_result,
    })
}

fn interval_label(ms: u64) -> String {
    if ms >= 1000 && ms.is_multiple_of(1000) {
        format!("{} s", ms / 1000)
    } else {
        format!("{ms} ms")
    }
}

/// The 1-minute load average.
fn load_average() -> f64 {
    fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(f64::NAN)
}

fn report(
    drains: &[Drain],
    latencies: &[(String, u64, Latency)],
    polling: &[Polling],
    loads: &[Load],
    loadavg: &[f64],
    elapsed: Duration,
) {
    let n = |x: f64| {
        if x.is_finite() {
            format!("{x:.0}")
        } else {
            "-".into()
        }
    };
    let lat = |l: &Latency| {
        format!(
            "{:.2} / {:.2} / {:.2} ({:.0}/s)",
            l.p50_ms, l.p99_ms, l.max_ms, l.achieved
        )
    };
    println!();
    println!(
        "== drain: events/s (x = / pg_recvlogical of the same backlog, median of the rounds) =="
    );
    println!(
        "{:<14} {:>15} {:>11} {:>16} {:>16} {:>9} {:>10}",
        "backlog", "pg_recvlogical", "sink limit", "source", "relay", "RSS MB", "CPU ms/1k"
    );
    for d in drains {
        let source = if d.source_eps.is_finite() {
            format!("{} {:.2}x", n(d.source_eps), d.ratio_source)
        } else {
            "-".into()
        };
        println!(
            "{:<14} {:>15} {:>11} {:>16} {:>16} {:>9.1} {:>10.1}",
            d.label,
            n(d.recvlogical_eps),
            n(d.sink_eps),
            source,
            format!("{} {:.2}x", n(d.relay_eps), d.ratio_relay),
            d.relay_rss_mb,
            d.relay_cpu_ms_per_1k
        );
    }
    let base = drains.first();
    for p in polling {
        let ratio = base.map_or(f64::NAN, |d| p.drain_eps / d.recvlogical_eps);
        let relay_over = base.map_or(f64::NAN, |d| d.relay_eps / p.drain_eps);
        println!(
            "{:<14} {:>15} {:>11} {:>16} {:>16}   relay = {relay_over:.1}x this",
            format!("polling {}", interval_label(p.interval_ms)),
            "",
            "",
            "",
            format!("{} {ratio:.2}x", n(p.drain_eps)),
        );
    }
    println!();
    println!("== latency commit -> consumer received: p50 / p99 / max ms (achieved rate) ==");
    for (who, rate, l) in latencies {
        println!("{who:<20} {rate:>6}/s  {}", lat(l));
    }
    for p in polling {
        if let Some(l) = &p.latency {
            println!(
                "{:<20} {:>6}/s  {}",
                format!("polling {}", interval_label(p.interval_ms)),
                1000,
                lat(l)
            );
        }
    }
    println!();
    println!(
        "== database load: deltas over the period (outbox table: pg_stat_user_tables; pg_stat_database) =="
    );
    println!(
        "{:<18} {:>7} {:>6} {:>9} {:>9} {:>10} {:>14} {:>11} {:>11} {:>11} {:>12}",
        "who",
        "period",
        "secs",
        "seq_scan",
        "idx_scan",
        "n_tup_upd",
        "n_tup_hot_upd",
        "n_dead_tup",
        "autovacuum",
        "xact_commit",
        "outbox stmts"
    );
    for l in loads {
        let d = &l.delta;
        println!(
            "{:<18} {:>7} {:>6.1} {:>9} {:>9} {:>10} {:>14} {:>11} {:>11} {:>11} {:>12}",
            l.who,
            l.period,
            l.secs,
            d.seq_scan,
            d.idx_scan,
            d.n_tup_upd,
            d.n_tup_hot_upd,
            d.n_dead_tup,
            d.autovacuum_count,
            d.xact_commit,
            l.statements.map_or_else(
                || format!("{} scans", d.seq_scan + d.idx_scan),
                |s| s.to_string()
            )
        );
    }
    println!();
    let mark = |ok: bool| if ok { "met" } else { "MISSED" };
    if let Some(d) = base {
        println!(
            "target relay >= 0.8x pg_recvlogical on {}: {:.2}x {}",
            d.label,
            d.ratio_relay,
            mark(d.ratio_relay >= 0.8)
        );
    }
    if let Some((_, _, l)) = latencies.iter().find(|(_, r, _)| *r == 5000) {
        println!(
            "target p99 <= 20 ms at 5k/s: {:.2} ms {}",
            l.p99_ms,
            mark(l.p99_ms <= 20.0)
        );
    }
    if let Some(d) = drains.iter().find(|d| d.events >= 1_000_000) {
        println!(
            "target peak RSS <= 64 MB at {}: {:.1} MB {}",
            d.label,
            d.relay_rss_mb,
            mark(d.relay_rss_mb <= 64.0)
        );
    }
    if let (Some(d), Some(best)) = (base, polling.iter().map(|p| p.drain_eps).reduce(f64::max)) {
        let scans: i64 = loads
            .iter()
            .filter(|l| l.who == "relay")
            .map(|l| l.delta.seq_scan + l.delta.idx_scan)
            .sum();
        println!(
            "target >= 3x the polling baseline with 0 outbox queries: {:.1}x, {scans} scans {}",
            d.relay_eps / best,
            mark(d.relay_eps / best >= 3.0 && scans == 0)
        );
    }
    println!(
        "load average (1 min) at the sections: {}; whole run {:.0} s",
        loadavg
            .iter()
            .map(|l| format!("{l:.2}"))
            .collect::<Vec<_>>()
            .join(", "),
        elapsed.as_secs_f64()
    );

    let lat_json: Vec<String> = latencies
        .iter()
        .map(|(who, rate, l)| latency_json(who, *rate, l))
        .chain(polling.iter().filter_map(|p| {
            p.latency
                .as_ref()
                .map(|l| latency_json(&format!("polling_{}ms", p.interval_ms), 1000, l))
        }))
        .collect();
    let poll_json: Vec<String> = polling
        .iter()
        .map(|p| {
            format!(
                r#"{{"interval_ms":{},"drain_eps":{:.0}}}"#,
                p.interval_ms, p.drain_eps
            )
        })
        .collect();
    let load_json: Vec<String> = loads
        .iter()
        .map(|l| {
            format!(
                r#"{{"who":"{}","period":"{}","secs":{:.1},"delta":{},"statements":{}}}"#,
                l.who,
                l.period,
                l.secs,
                l.delta.json(),
                l.statements.map_or("null".into(), |s| s.to_string())
            )
        })
        .collect();
    println!(
        r#"{{"bench":"drain","drain":[{}],"polling":[{}],"latency":[{}],"load":[{}],"loadavg":[{}]}}"#,
        drains.iter().map(Drain::json).collect::<Vec<_>>().join(","),
        poll_json.join(","),
        lat_json.join(","),
        load_json.join(","),
        loadavg
            .iter()
            .map(|l| format!("{l:.2}"))
            .collect::<Vec<_>>()
            .join(",")
    );
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

/// Peak resident set (VmHWM) of `pid` in MB.
fn peak_rss_mb(pid: u32) -> f64 {
    let status = fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .map_or(0.0, |kb| kb / 1024.0)
}

/// The relay drains `slot` into a fresh stream: spawn → the stream holds `events` messages.
/// Returns the still running relay, events/s, peak RSS (MB) and CPU (ms) at that moment.
async fn relay(
    db: &TestDb,
    nats: &NatsServer,
    slot: &str,
    events: u64,
) -> anyhow::Result<(RelayChild, f64, f64, f64)> {
    relay_with(
        db,
        nats,
        slot,
        events,
        env!("CARGO_BIN_EXE_outbox-relay"),
        &[],
    )
    .await
}

/// [`relay`] with another binary and extra environment.
async fn relay_with(
    db: &TestDb,
    nats: &NatsServer,
    slot: &str,
    events: u64,
    bin: &str,
    extra: &[(&str, String)],
) -> anyhow::Result<(RelayChild, f64, f64, f64)> {
    let js = jetstream::new(nats.client().await);
    let mut env = vec![
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
    env.extend(extra.iter().cloned());
    let t = Instant::now();
    let mut relay = RelayChild::spawn_bin(bin, &env)?;
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
