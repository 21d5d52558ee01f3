//! Drains of real transaction shapes: backlogs of 1, 10 and 100 events per transaction, at payload
//! sizes of ~120 B, 2 KB and 16 KB, each measured in one run against `pg_recvlogical` on the same
//! backlog and against raw async-nats publishing of the same messages (single publishes through a
//! JetStream context or with one ack inbox, one fast-ingest batch, and atomic batches of one
//! transaction each) at the relay's window, with the CPU time per event of the relay, of each
//! publisher and of nats-server read from /proc (utime+stime): on a 2-core box shared by Postgres,
//! nats-server and the relay, CPU per event is the number that says who bounds whom.
//!
//! Relay variants per round: `relay` (single publishes), `relay atomic` (`nats.atomic_transactions`,
//! group commit at its default), `relay atomic 1/batch` (the same with `nats.atomic_group_ms = 0`,
//! one batch per transaction: group commit's baseline), and with
//! `BENCH_RELAY_ALT=/path/to/outbox-relay` the same binary built from another commit (`alt`, and
//! `alt atomic` when the atomic variant runs), so a change is judged by a same-run ratio. Knobs:
//! `BENCH_SHAPES` (`1,10,100`), `BENCH_PAYLOADS` (`120,2048,16384`, bytes of jsonb text),
//! `BENCH_SHAPE_EVENTS` (100000; capped at 100 MB of payload per backlog), `BENCH_SHAPE_ROUNDS`
//! (`BENCH_ROUNDS`), `BENCH_SHAPE_ATOMIC` (1; 0 skips the atomic variants), `BENCH_SHAPE_UNGROUPED`
//! (1; 0 skips `relay atomic 1/batch`), `BENCH_SHAPE_LEAN` (0; 1 adds `relay lean`, the relay with
//! `nats.descriptive_headers = false`), `BENCH_FAST_FLOW` (100: the flow window of `sink fast`).
//!
//! After the shapes table, the pipeline's ceiling: a drain needs the walsender, the relay and
//! nats-server at once, so the machine can carry at most cores × 10⁶ / (w + r + n) events/s, with
//! w, r and n the three processes' CPU µs per event measured in the relay's rounds; each relay
//! variant's rate is set against the ceiling its own CPU implies. One more line per shape projects
//! a relay publishing fast batches: the relay's w, r and n, with r and n lowered by what `sink
//! fast` saved the publisher and nats-server against `sink core` in the same rounds (a projection:
//! the relay has no fast batch mode).

use outbox_relay::testkit::{NatsServer, PgServer, TestDb};

use super::{
    STREAM, cpu_ms, env_list, env_or, fill_with, median, recvlogical, relay_db_setup, relay_with,
    sink, stored_payload,
};

/// One variant's medians.
#[derive(Default, Clone)]
pub(crate) struct Measure {
    pub eps: f64,
    /// CPU µs per event of the relay, or of the publisher and its client for the sink limits (NaN
    /// for the batched one, which runs in the bench's runtime).
    pub relay_us: f64,
    pub nats_us: f64,
    pub rss_mb: f64,
    /// CPU µs per event of the walsender that served the relay (NaN for the publishers alone): with
    /// the relay's and nats-server's, what the whole pipeline asks of the machine per event.
    pub wal_us: f64,
}

/// A relay variant: label, binary, and the environment it runs with on top of the bench's.
type Variant = (String, String, Vec<(&'static str, String)>);

pub(crate) struct ShapeRow {
    pub payload: usize,
    pub per_txn: u64,
    pub events: u64,
    pub recvlogical_eps: f64,
    pub sink: Measure,
    /// Core publishes with the publisher's own ack subscription ([`sink::limit_core`]).
    pub sink_core: Measure,
    /// One fast-ingest batch ([`sink::limit_fast`]).
    pub sink_fast: Measure,
    pub sink_batched: Measure,
    /// (label, measure, ratio to pg_recvlogical)
    pub relays: Vec<(String, Measure, f64)>,
}

/// A jsonb object whose text form is about `bytes` long.
pub(crate) fn payload_of(bytes: usize) -> String {
    let pad = bytes.saturating_sub(40).max(1);
    format!(
        r#"{{"currency": "EUR", "total_cents": 8498, "pad": "{}"}}"#,
        "x".repeat(pad)
    )
}

fn nats_cpu(nats: &NatsServer) -> f64 {
    nats.pid().map_or(f64::NAN, cpu_ms)
}

pub(crate) async fn run(pg: &PgServer, default_rounds: usize) -> anyhow::Result<Vec<ShapeRow>> {
    let shapes = env_list("BENCH_SHAPES", "1,10,100");
    let payloads = env_list("BENCH_PAYLOADS", "120,2048,16384");
    let max_events: u64 = env_or("BENCH_SHAPE_EVENTS", 100_000);
    let rounds: usize = env_or("BENCH_SHAPE_ROUNDS", default_rounds).max(1);
    let atomic = env_or("BENCH_SHAPE_ATOMIC", 1u8) == 1;
    let ungrouped = env_or("BENCH_SHAPE_UNGROUPED", 1u8) == 1;
    let lean = env_or("BENCH_SHAPE_LEAN", 0u8) == 1;
    let alt = std::env::var("BENCH_RELAY_ALT")
        .ok()
        .filter(|s| !s.is_empty());
    let this: String = env!("CARGO_BIN_EXE_outbox-relay").into();
    let mut variants: Vec<Variant> = vec![("relay".into(), this.clone(), Vec::new())];
    if let Some(alt) = &alt {
        variants.push(("alt".into(), alt.clone(), Vec::new()));
    }
    if lean {
        // The relay's other message shape: without the four descriptive headers.
        let env = vec![("OUTBOX_RELAY_NATS_DESCRIPTIVE_HEADERS", "false".to_string())];
        variants.push(("relay lean".into(), this.clone(), env));
    }
    if atomic {
        let env = vec![("OUTBOX_RELAY_NATS_ATOMIC_TRANSACTIONS", "true".to_string())];
        variants.push(("relay atomic".into(), this.clone(), env.clone()));
        if ungrouped {
            // Group commit's baseline: one atomic batch per transaction.
            let mut one = env.clone();
            one.push(("OUTBOX_RELAY_NATS_ATOMIC_GROUP_MS", "0".to_string()));
            variants.push(("relay atomic 1/batch".into(), this.clone(), one));
        }
        // A change to the atomic path is judged against the other commit's atomic path too.
        if let Some(alt) = &alt {
            variants.push(("alt atomic".into(), alt.clone(), env));
        }
    }
    let mut rows = Vec::new();
    for &size in &payloads {
        let size = size as usize;
        for &per_txn in &shapes {
            let per_txn = per_txn.max(1);
            let cap = (100 << 20) / size.max(1) as u64;
            let events = (max_events.min(cap) / 100 * 100).max(per_txn);
            let txns = events / per_txn;
            let events = txns * per_txn;
            rows.push(shape(pg, size, per_txn, txns, events, rounds, &variants).await?);
        }
    }
    print(&rows);
    Ok(rows)
}

async fn shape(
    pg: &PgServer,
    size: usize,
    per_txn: u64,
    txns: u64,
    events: u64,
    rounds: usize,
    variants: &[Variant],
) -> anyhow::Result<ShapeRow> {
    let db = TestDb::create(pg).await;
    let recv_slots: Vec<String> = (0..rounds).map(|r| format!("recv_{r}")).collect();
    let mut relay_slots = Vec::new();
    for r in 0..rounds {
        for v in 0..variants.len() {
            relay_slots.push(format!("relay_{r}_{v}"));
        }
    }
    relay_db_setup(&db, &[&recv_slots[..], &relay_slots].concat())?;
    let (target, fill_secs) = fill_with(&db, txns, per_txn, &payload_of(size))?;
    let payload = stored_payload(&db);
    println!(
        "shape {}x{per_txn}, payload {} B: {events} events written in {fill_secs:.1} s",
        txns,
        payload.len()
    );
    let mut recv = Vec::new();
    let mut sink_m: Vec<Measure> = Vec::new();
    let mut sinkc_m: Vec<Measure> = Vec::new();
    let mut sinkf_m: Vec<Measure> = Vec::new();
    let mut sinkb_m: Vec<Measure> = Vec::new();
    let mut relay_m: Vec<Vec<Measure>> = vec![Vec::new(); variants.len()];
    let mut ratios: Vec<Vec<f64>> = vec![Vec::new(); variants.len()];
    for r in 0..rounds {
        let rl = recvlogical(pg, &db, &recv_slots[r], target, events)?;
        recv.push(rl);
        for variant in ["", " core", " fast"] {
            let nats = NatsServer::start();
            let c0 = nats_cpu(&nats);
            let p = payload.clone();
            let flow = env_or("BENCH_FAST_FLOW", 100u16);
            let run = sink::on_own_thread(nats.url(), move |c| async move {
                match variant {
                    " core" => sink::limit_core(c, STREAM, &p, events).await,
                    " fast" => sink::limit_fast(c, STREAM, &p, events, flow).await,
                    _ => sink::limit(c, STREAM, &p, events).await,
                }
            });
            let (eps, client_ms) = match run {
                Ok(r) => r,
                Err(e) => {
                    println!("  sink{variant} failed: {e:#}");
                    (f64::NAN, f64::NAN)
                }
            };
            let m = Measure {
                eps,
                relay_us: client_ms * 1000.0 / events as f64,
                nats_us: (nats_cpu(&nats) - c0) * 1000.0 / events as f64,
                rss_mb: f64::NAN,
                wal_us: f64::NAN,
            };
            println!(
                "  round {} sink{variant}: {eps:.0}/s, client {:.2} µs/event, nats-server {:.2} µs/event",
                r + 1,
                m.relay_us,
                m.nats_us
            );
            match variant {
                " core" => &mut sinkc_m,
                " fast" => &mut sinkf_m,
                _ => &mut sink_m,
            }
            .push(m);
        }
        {
            // Atomic batches cost nats-server ~3 ms of CPU each here: a few thousand events
            // (`BENCH_BATCHED_EVENTS`) say as much as the whole backlog.
            let events = events
                .min(env_or("BENCH_BATCHED_EVENTS", 5_000u64) / per_txn * per_txn)
                .max(per_txn);
            let nats = NatsServer::start();
            let c0 = nats_cpu(&nats);
            let eps =
                match sink::limit_batched(nats.client().await, STREAM, &payload, events, per_txn)
                    .await
                {
                    Ok(eps) => eps,
                    Err(e) => {
                        println!("  sink batched failed: {e:#}");
                        f64::NAN
                    }
                };
            sinkb_m.push(Measure {
                eps,
                relay_us: f64::NAN,
                nats_us: (nats_cpu(&nats) - c0) * 1000.0 / events as f64,
                rss_mb: f64::NAN,
                wal_us: f64::NAN,
            });
        }
        for (v, (label, bin, extra)) in variants.iter().enumerate() {
            let nats = NatsServer::start();
            let c0 = nats_cpu(&nats);
            let slot = &relay_slots[r * variants.len() + v];
            let (mut child, eps, rss, cpu) =
                relay_with(&db, &nats, slot, events, bin, extra).await?;
            let nats_us = (nats_cpu(&nats) - c0) * 1000.0 / events as f64;
            let wal_us = walsender_cpu_ms(&db, slot).await * 1000.0 / events as f64;
            child.stop();
            let m = Measure {
                eps,
                relay_us: cpu * 1000.0 / events as f64,
                nats_us,
                rss_mb: rss,
                wal_us,
            };
            println!(
                "  round {} {label}: {:.0}/s ({:.2}x rl {:.0}/s), relay {:.2} µs/event, nats-server {:.2} µs/event, walsender {:.2} µs/event, RSS {:.1} MB",
                r + 1,
                m.eps,
                m.eps / rl,
                rl,
                m.relay_us,
                m.nats_us,
                m.wal_us,
                m.rss_mb
            );
            ratios[v].push(eps / rl);
            relay_m[v].push(m);
        }
    }
    let med = |ms: &[Measure]| Measure {
        eps: median(ms.iter().map(|m| m.eps).collect()),
        relay_us: median(ms.iter().map(|m| m.relay_us).collect()),
        nats_us: median(ms.iter().map(|m| m.nats_us).collect()),
        rss_mb: ms.iter().map(|m| m.rss_mb).fold(f64::NAN, f64::max),
        wal_us: median(ms.iter().map(|m| m.wal_us).collect()),
    };
    Ok(ShapeRow {
        payload: payload.len(),
        per_txn,
        events,
        recvlogical_eps: median(recv),
        sink: med(&sink_m),
        sink_core: med(&sinkc_m),
        sink_fast: med(&sinkf_m),
        sink_batched: med(&sinkb_m),
        relays: variants
            .iter()
            .enumerate()
            .map(|(v, (label, _, _))| (label.clone(), med(&relay_m[v]), median(ratios[v].clone())))
            .collect(),
    })
}

/// CPU (ms) the walsender streaming `slot` used so far; NaN when no walsender holds the slot. A
/// walsender is a process of its own per replication connection, so its total is this drain's.
async fn walsender_cpu_ms(db: &TestDb, slot: &str) -> f64 {
    let client = db.client().await;
    match client
        .query_opt(
            "SELECT active_pid FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await
    {
        Ok(Some(row)) => row
            .get::<_, Option<i32>>(0)
            .map_or(f64::NAN, |pid| cpu_ms(pid as u32)),
        _ => f64::NAN,
    }
}

pub(crate) fn print(rows: &[ShapeRow]) {
    println!();
    println!(
        "== transaction shapes: events/s (x = / pg_recvlogical, median of the rounds); CPU µs per event: r = relay, c = publisher and client, n = nats-server, w = walsender =="
    );
    for row in rows {
        let mut line = format!(
            "{:>6} B x{:<4} {:>7} ev | rl {:>7.0} | sink {:>7.0} c {:>5.2} n {:>5.2} | sink core {:>7.0} c {:>5.2} n {:>5.2} | sink fast {:>7.0} c {:>5.2} n {:>5.2} | sink batched {:>7.0} n {:>5.2}",
            row.payload,
            row.per_txn,
            row.events,
            row.recvlogical_eps,
            row.sink.eps,
            row.sink.relay_us,
            row.sink.nats_us,
            row.sink_core.eps,
            row.sink_core.relay_us,
            row.sink_core.nats_us,
            row.sink_fast.eps,
            row.sink_fast.relay_us,
            row.sink_fast.nats_us,
            row.sink_batched.eps,
            row.sink_batched.nats_us
        );
        for (label, m, ratio) in &row.relays {
            line.push_str(&format!(
                " | {label} {:>7.0} {ratio:.2}x r {:.2} n {:.2} w {:.2} {:.0} MB",
                m.eps, m.relay_us, m.nats_us, m.wal_us, m.rss_mb
            ));
        }
        println!("{line}");
    }
    print_ceiling(rows);
    let json: Vec<String> = rows
        .iter()
        .map(|r| {
            let relays: Vec<String> = r
                .relays
                .iter()
                .map(|(l, m, x)| {
                    format!(
                        r#"{{"variant":"{l}","eps":{:.0},"ratio_rl":{x:.3},"relay_us":{:.2},"nats_us":{:.2},"walsender_us":{:.2},"rss_mb":{:.1}}}"#,
                        m.eps, m.relay_us, m.nats_us, m.wal_us, m.rss_mb
                    )
                })
                .collect();
            format!(
                r#"{{"payload":{},"per_txn":{},"events":{},"pg_recvlogical_eps":{:.0},"sink_eps":{:.0},"sink_client_us":{:.2},"sink_nats_us":{:.2},"sink_core_eps":{:.0},"sink_core_client_us":{:.2},"sink_core_nats_us":{:.2},"sink_fast_eps":{:.0},"sink_fast_client_us":{:.2},"sink_fast_nats_us":{:.2},"sink_batched_eps":{:.0},"sink_batched_nats_us":{:.2},"relays":[{}]}}"#,
                r.payload,
                r.per_txn,
                r.events,
                r.recvlogical_eps,
                r.sink.eps,
                r.sink.relay_us,
                r.sink.nats_us,
                r.sink_core.eps,
                r.sink_core.relay_us,
                r.sink_core.nats_us,
                r.sink_fast.eps,
                r.sink_fast.relay_us,
                r.sink_fast.nats_us,
                r.sink_batched.eps,
                r.sink_batched.nats_us,
                relays.join(",")
            )
        })
        .collect();
    println!("{{\"bench\":\"shapes\",\"rows\":[{}]}}", json.join(","));
}

/// The pipeline's ceiling per shape (see the module docs): the machine's cores against the
/// walsender's, the relay's and nats-server's CPU per event.
fn print_ceiling(rows: &[ShapeRow]) {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
    println!();
    println!(
        "== the pipeline's ceiling: {cores} cores × 10⁶ / (w + r + n) events/s; CPU µs per event: w = walsender, r = relay (or publisher), n = nats-server; medians of the rounds =="
    );
    println!(
        "| {:>6} | {:>6} | {:<22} | {:>5} | {:>5} | {:>5} | {:>6} | {:>9} | {:>9} | {:>11} |",
        "B", "ev/txn", "variant", "w", "r", "n", "sum", "ceiling/s", "events/s", "÷ ceiling"
    );
    for row in rows {
        let line = |label: &str, w: f64, r: f64, n: f64, eps: f64| {
            let sum = w + r + n;
            let ceiling = cores * 1e6 / sum;
            println!(
                "| {:>6} | {:>6} | {label:<22} | {w:>5.2} | {r:>5.2} | {n:>5.2} | {sum:>6.2} | {ceiling:>9.0} | {eps:>9.0} | {:>11.2} |",
                row.payload,
                row.per_txn,
                eps / ceiling
            );
        };
        for (label, m, _) in &row.relays {
            line(label, m.wal_us, m.relay_us, m.nats_us, m.eps);
        }
        // The relay's costs with what fast batches saved the bare publisher and nats-server.
        if let Some((_, m, _)) = row.relays.iter().find(|(l, _, _)| l == "relay") {
            let (core, fast) = (&row.sink_core, &row.sink_fast);
            let r = m.relay_us - (core.relay_us - fast.relay_us);
            let n = m.nats_us - (core.nats_us - fast.nats_us);
            line("relay + fast (projected)", m.wal_us, r, n, f64::NAN);
        }
    }
}
