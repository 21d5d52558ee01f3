//! `backfill` against the live relay on the same backlog, in the same run: how fast a recovery or an
//! adoption publishes the rows of a table, next to how fast `run` drains the same rows from its slot.
//!
//! On a private Postgres (`outbox_relay::testkit`) the live rounds' slots are created first, then a
//! backlog of `BENCH_EVENTS` single-row outbox transactions (the drain bench's payload) is written.
//! Rounds alternate, so a busy machine slows both alike, each with a fresh NATS:
//!
//! - live: `relay::run` (in process, on a current-thread runtime like the binary's) from its slot until
//!   the stream holds every event;
//! - backfill: `backfill` of every row into an empty stream (it creates its own slot), timed from the
//!   first row read to the last ack (the slot's creation, which waits for running transactions, is
//!   printed apart).
//!
//! `cargo bench --bench backfill` prints one line per round, the medians and their ratio (the target is
//! backfill ≥ 0.8 × live). Knobs: `BENCH_EVENTS` (100000), `BENCH_ROUNDS` (3). Under
//! `cargo test --benches` (no `--bench` argument) it does nothing: starting servers is the tests' job.

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream;
use outbox_relay::backfill::{BackfillOptions, backfill};
use outbox_relay::config::Config;
use outbox_relay::metrics::Metrics;
use outbox_relay::testkit::{NatsServer, PgServer, TestDb};

const PUBLICATION: &str = "bench_pub";
/// The drain bench's payload: about 200 bytes of jsonb.
const PAYLOAD: &str = r#"{"items": [{"qty": 2, "sku": "SKU-00000001", "price_cents": 1999}, {"qty": 1, "sku": "SKU-00000002", "price_cents": 4500}], "total_cents": 8498, "currency": "EUR", "customer_id": "cust-000042", "note": "leave at the door"}"#;

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn main() -> anyhow::Result<()> {
    if !std::env::args().any(|a| a == "--bench") {
        println!("backfill bench: skipped (it starts servers; run `cargo bench --bench backfill`)");
        return Ok(());
    }
    let pg = PgServer::start_private();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(run(&pg))
}

fn config(db: &TestDb, nats: &NatsServer, slot: &str) -> anyhow::Result<Config> {
    let mut c = Config::default();
    c.postgres.url = db.url();
    c.postgres.slot = slot.to_owned();
    c.postgres.publication = PUBLICATION.to_owned();
    c.nats.url = nats.url();
    c.http.listen = String::new();
    c.validate()?;
    Ok(c)
}

async fn stream_count(js: &jetstream::Context, stream: &str) -> u64 {
    match js.get_stream(stream).await {
        Ok(mut s) => s.info().await.map(|i| i.state.messages).unwrap_or(0),
        Err(_) => 0,
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

async fn run(pg: &PgServer) -> anyhow::Result<()> {
    let events: u64 = env_or("BENCH_EVENTS", 100_000);
    let rounds: usize = env_or("BENCH_ROUNDS", 3).max(1);
    let db = TestDb::create(pg).await;
    let outbox_sql = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/sql/01_outbox_table.sql"
    ))?;
    db.psql(&format!(
        "{outbox_sql}\nCREATE PUBLICATION {PUBLICATION} FOR TABLE public.outbox WITH (publish = 'insert');"
    ));
    for r in 0..rounds {
        db.psql(&format!(
            "SELECT pg_create_logical_replication_slot('live_{r}', 'pgoutput')"
        ));
    }
    let t = Instant::now();
    db.psql(&format!(
        "CREATE OR REPLACE PROCEDURE bench_fill(n int) LANGUAGE plpgsql AS $$\n\
         BEGIN\n\
           FOR i IN 1..n LOOP\n\
             INSERT INTO public.outbox (aggregate_type, aggregate_id, event_type, payload)\n\
               VALUES ('Order', 'order-' || i, 'OrderPlaced', '{PAYLOAD}'::jsonb);\n\
             COMMIT;\n\
           END LOOP;\n\
         END $$;\n\
         SET synchronous_commit = off;\n\
         CALL bench_fill({events});\n\
         SET synchronous_commit = on;\n\
         SELECT txid_current();"
    ));
    println!(
        "backlog: {events} single-row transactions written in {:.1} s",
        t.elapsed().as_secs_f64()
    );

    let (mut live, mut filled) = (Vec::new(), Vec::new());
    for r in 0..rounds {
        // Live: the relay drains its slot into a fresh stream.
        let nats = NatsServer::start();
        let cfg = config(&db, &nats, &format!("live_{r}"))?;
        let js = jetstream::new(async_nats::connect(nats.url()).await?);
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let t = Instant::now();
        let relay = tokio::spawn(outbox_relay::relay::run(
            cfg.validate()?,
            Arc::new(Metrics::default()),
            async {
                let _ = stop_rx.await;
            },
        ));
        while stream_count(&js, &cfg.nats.stream).await < events {
            if relay.is_finished() {
                anyhow::bail!("the relay stopped: {:?}", relay.await);
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let live_eps = events as f64 / t.elapsed().as_secs_f64();
        let _ = stop_tx.send(());
        relay.await??;
        drop(nats);

        // Backfill: every row into a fresh stream, through a new slot.
        let nats = NatsServer::start();
        let cfg = config(&db, &nats, &format!("backfill_{r}"))?;
        let report = backfill(&cfg.validate()?, BackfillOptions::default(), |_| {}).await?;
        anyhow::ensure!(
            report.rows == events && report.stored == events,
            "backfill stored {} of {events}",
            report.stored
        );
        db.psql(&format!("SELECT pg_drop_replication_slot('backfill_{r}')"));
        drop(nats);
        println!(
            "round {r}: live {live_eps:>8.0} events/s   backfill {:>8.0} rows/s ({:.1} s, slot creation {:.2} s)",
            report.rate(),
            report.elapsed.as_secs_f64(),
            report.slot_wait.as_secs_f64()
        );
        live.push(live_eps);
        filled.push(report.rate());
    }
    let (live, filled) = (median(live), median(filled));
    println!(
        "median: live drain {live:.0} events/s, backfill {filled:.0} rows/s: backfill/live = {:.2} (target >= 0.8)",
        filled / live
    );
    println!(
        "{{\"bench\":\"backfill\",\"events\":{events},\"live_eps\":{live:.0},\"backfill_rps\":{filled:.0},\"ratio\":{:.2}}}",
        filled / live
    );
    Ok(())
}
