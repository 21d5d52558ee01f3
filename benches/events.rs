//! The table-less outbox next to the table, side by side: for each way of writing an event
//! (`outbox_write`: a row that stays; `outbox_emit`: a row inserted and deleted in the same transaction,
//! sql/04_write_event.sql; `outbox_message`: a transactional logical message, no row,
//! sql/06_outbox_message.sql) it measures
//!
//! - writer transactions per second: `BENCH_WRITERS` connections (4) each commit single-event
//!   transactions (`BEGIN; SELECT <helper>(…); COMMIT`, one round trip) until `BENCH_EVENTS` (20000)
//!   are written;
//! - WAL bytes per event: `pg_current_wal_lsn()` before and after the writes, divided by the events;
//! - the relay's drain rate: the in-process relay (with `outbox.message_prefix = "outbox"`, so one
//!   configuration reads all three) started on that backlog, until the stream holds every event,
//!   from the call to `run` (connects and setup checks included; they take a few ms).
//!
//! Each helper gets its own database, slot and stream on one private Postgres, written after the slot
//! exists. Rounds (`BENCH_ROUNDS`, 3) alternate the helpers so a busy machine slows them alike; the
//! medians are printed as a table (docs/performance.md) and one JSON line. Under `cargo test --benches`
//! (no `--bench` argument) it does nothing: starting servers is the tests' job.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use outbox_relay::Lsn;
use outbox_relay::config::Config;
use outbox_relay::metrics::Metrics;
use outbox_relay::testkit::{NatsServer, PgServer, TestDb};

/// About 200 bytes of jsonb, like the drain bench.
const PAYLOAD: &str = r#"{"items": [{"qty": 2, "sku": "SKU-00000001", "price_cents": 1999}, {"qty": 1, "sku": "SKU-00000002", "price_cents": 4500}], "total_cents": 8498, "currency": "EUR", "customer_id": "cust-000042", "note": "leave at the door"}"#;

const HELPERS: [&str; 3] = ["outbox_write", "outbox_emit", "outbox_message"];

fn knob(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn main() -> anyhow::Result<()> {
    if !std::env::args().any(|a| a == "--bench") {
        println!("events bench: skipped (it starts servers; run `cargo bench --bench events`)");
        return Ok(());
    }
    let pg = PgServer::start_private();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    rt.block_on(run(&pg))
}

struct Sample {
    writer_tps: f64,
    wal_bytes_per_event: f64,
    drain_eps: f64,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

async fn run(pg: &PgServer) -> anyhow::Result<()> {
    let events = knob("BENCH_EVENTS", 20_000);
    let writers = knob("BENCH_WRITERS", 4).max(1);
    let rounds = knob("BENCH_ROUNDS", 3).max(1);
    let mut samples: Vec<Vec<Sample>> = HELPERS.iter().map(|_| Vec::new()).collect();
    for round in 1..=rounds {
        for (i, helper) in HELPERS.iter().enumerate() {
            let s = one(pg, helper, events, writers).await?;
            eprintln!(
                "round {round} {helper}: {:.0} tx/s, {:.0} WAL bytes/event, drain {:.0} events/s",
                s.writer_tps, s.wal_bytes_per_event, s.drain_eps
            );
            samples[i].push(s);
        }
    }
    println!(
        "\n{events} single-event transactions, {writers} writers, median of {rounds} rounds\n"
    );
    println!("| helper | writer tx/s | WAL bytes/event | relay drain events/s |");
    println!("|---|---:|---:|---:|");
    let mut json = Vec::new();
    for (helper, s) in HELPERS.iter().zip(&samples) {
        let tps = median(s.iter().map(|x| x.writer_tps).collect());
        let wal = median(s.iter().map(|x| x.wal_bytes_per_event).collect());
        let drain = median(s.iter().map(|x| x.drain_eps).collect());
        println!("| `{helper}` | {tps:.0} | {wal:.0} | {drain:.0} |");
        json.push(format!(
            r#""{helper}":{{"writer_tps":{tps:.0},"wal_bytes_per_event":{wal:.0},"drain_eps":{drain:.0}}}"#
        ));
    }
    println!(
        "\n{{\"bench\":\"events\",\"events\":{events},\"writers\":{writers},\"rounds\":{rounds},{}}}",
        json.join(",")
    );
    Ok(())
}

/// One helper, one round: a fresh database, slot and stream; the writes; the drain.
async fn one(pg: &PgServer, helper: &str, events: u64, writers: u64) -> anyhow::Result<Sample> {
    let db = TestDb::create(pg).await;
    let root = env!("CARGO_MANIFEST_DIR");
    for file in [
        "sql/01_outbox_table.sql",
        "sql/04_write_event.sql",
        "sql/06_outbox_message.sql",
    ] {
        let sql = std::fs::read_to_string(format!("{root}/{file}")).context(file)?;
        db.psql(&sql);
    }
    let nats = NatsServer::start();
    let mut config = Config::default();
    config.postgres.url = db.url();
    config.postgres.slot = db.slot_name();
    config.postgres.publication = db.publication_name();
    config.nats.url = nats.url();
    config.http.listen = String::new();
    config.outbox.message_prefix = "outbox".into();
    let settings = config.validate()?;
    // The slot exists before the writes, so the backlog is all in it.
    outbox_relay::setup::setup(&settings).await?;

    let client = db.client().await;
    let before = wal_lsn(&client).await?;
    let started = Instant::now();
    let mut tasks = Vec::new();
    for w in 0..writers {
        let c = db.client().await;
        let n = events / writers + u64::from(w < events % writers);
        let sql =
            format!("BEGIN; SELECT {helper}('Order', 'o-{w}', 'OrderPlaced', '{PAYLOAD}'); COMMIT");
        tasks.push(tokio::spawn(async move {
            for _ in 0..n {
                c.batch_execute(&sql).await?;
            }
            Ok::<_, tokio_postgres::Error>(())
        }));
    }
    for t in tasks {
        t.await??;
    }
    let write_secs = started.elapsed().as_secs_f64();
    let after = wal_lsn(&client).await?;

    let metrics = Arc::new(Metrics::default());
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let started = Instant::now();
    let relay = tokio::spawn(outbox_relay::relay::run(settings, metrics, async {
        let _ = stop_rx.await;
    }));
    let js = nats.jetstream().await;
    loop {
        let stored = match js.get_stream(&config.nats.stream).await {
            Ok(mut s) => s.info().await.map(|i| i.state.messages).unwrap_or(0),
            Err(_) => 0,
        };
        if stored >= events {
            break;
        }
        if relay.is_finished() {
            bail!("relay stopped at {stored} of {events} events");
        }
        if started.elapsed() > Duration::from_secs(600) {
            bail!("drain took over 10 minutes ({stored} of {events})");
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let drain_secs = started.elapsed().as_secs_f64();
    let _ = stop_tx.send(());
    relay.await??;
    Ok(Sample {
        writer_tps: events as f64 / write_secs,
        wal_bytes_per_event: (after.0 - before.0) as f64 / events as f64,
        drain_eps: events as f64 / drain_secs,
    })
}

async fn wal_lsn(client: &tokio_postgres::Client) -> anyhow::Result<Lsn> {
    let s: String = client
        .query_one("SELECT pg_current_wal_lsn()::text", &[])
        .await?
        .get(0);
    s.parse().map_err(|e| anyhow::anyhow!("{e}"))
}
