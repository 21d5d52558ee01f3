//! `outbox-relay verify` on a table and a stream of `BENCH_EVENTS` events: events verified per second
//! and the command's peak resident memory, without and with `--payloads`.
//!
//! On a private Postgres (`outbox_relay::testkit`) the outbox table (`sql/01_outbox_table.sql`) gets
//! `BENCH_EVENTS` rows with the drain bench's payload (about 200 bytes of jsonb), and `backfill`
//! publishes them into a fresh stream, so the stream holds exactly what the relay writes. Then the
//! built binary runs `verify --json` `BENCH_ROUNDS` times each way, timed from start to exit, with its
//! peak RSS taken by `/usr/bin/time -f %M` (the kernel's high-water mark of the process). A run that
//! reports any difference fails the bench: the numbers are for a clean, complete check.
//!
//! `cargo bench --bench verify` prints one line per run and the medians. Knobs: `BENCH_EVENTS`
//! (200000), `BENCH_ROUNDS` (3), `BENCH_PAYLOADS` (1; 0 leaves the `--payloads` runs out, which at
//! millions of events take most of the time), and `BENCH_BASELINE`: the path of another build's
//! binary (e.g. main's), run on the same table and stream right after each run of this one, so the
//! two are compared under the same load. Under `cargo test --benches` (no `--bench` argument) it
//! does nothing: starting servers is the tests' job.

use std::process::Command;
use std::time::Instant;

use outbox_relay::backfill::{BackfillOptions, backfill};
use outbox_relay::config::Config;
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

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> anyhow::Result<()> {
    if !std::env::args().any(|a| a == "--bench") {
        println!("verify bench: skipped (it starts servers; run `cargo bench --bench verify`)");
        return Ok(());
    }
    let pg = PgServer::start_private();
    let nats = NatsServer::start();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let (db, config) = rt.block_on(fill(&pg, &nats))?;
    let events: u64 = env_or("BENCH_EVENTS", 200_000);
    let rounds: usize = env_or("BENCH_ROUNDS", 3).max(1);
    let modes: &[bool] = if env_or("BENCH_PAYLOADS", 1) == 0 {
        &[false]
    } else {
        &[false, true]
    };
    let mut binaries = vec![("", env!("CARGO_BIN_EXE_outbox-relay").to_owned())];
    if let Ok(baseline) = std::env::var("BENCH_BASELINE") {
        binaries.push((" (baseline)", baseline));
    }
    for &payloads in modes {
        let mut results = vec![(Vec::new(), Vec::new()); binaries.len()];
        for _ in 0..rounds {
            for ((label, bin), (rates, rss)) in binaries.iter().zip(&mut results) {
                let (secs, kb) = verify_once(bin, &config, payloads, events)?;
                println!(
                    "verify{}{label}: {events} events in {secs:.2} s ({:.0} events/s), peak RSS {:.1} MB",
                    if payloads { " --payloads" } else { "" },
                    events as f64 / secs,
                    kb / 1024.0
                );
                rates.push(events as f64 / secs);
                rss.push(kb / 1024.0);
            }
        }
        for ((label, _), (rates, rss)) in binaries.iter().zip(results) {
            println!(
                "median{}{label}: {:.0} events/s, peak RSS {:.1} MB",
                if payloads { " --payloads" } else { "" },
                median(rates),
                median(rss)
            );
        }
    }
    drop(db);
    Ok(())
}

/// The table with `BENCH_EVENTS` rows, and a stream `backfill` filled with them.
async fn fill(pg: &PgServer, nats: &NatsServer) -> anyhow::Result<(TestDb, Config)> {
    let events: u64 = env_or("BENCH_EVENTS", 200_000);
    let db = TestDb::create(pg).await;
    let outbox_sql = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/sql/01_outbox_table.sql"
    ))?;
    db.psql(&format!(
        "{outbox_sql}\nCREATE PUBLICATION {PUBLICATION} FOR TABLE public.outbox WITH (publish = 'insert');\n\
         INSERT INTO public.outbox (aggregate_type, aggregate_id, event_type, payload, created_at) \
         SELECT 'Order', 'order-' || i, 'OrderPlaced', '{PAYLOAD}'::jsonb, now() - interval '1 hour' \
         FROM generate_series(1, {events}) AS i;"
    ));
    let mut c = Config::default();
    c.postgres.url = db.url();
    c.postgres.slot = "bench_verify".into();
    c.postgres.publication = PUBLICATION.into();
    c.nats.url = nats.url();
    c.http.listen = String::new();
    let t = Instant::now();
    let report = backfill(&c.validate()?, BackfillOptions::default(), |_| {}).await?;
    anyhow::ensure!(report.stored == events, "backfill stored {}", report.stored);
    println!(
        "stream: {events} events published by backfill in {:.1} s",
        t.elapsed().as_secs_f64()
    );
    Ok((db, c))
}

/// One `verify --json` run of the binary `bin`: seconds and peak RSS in KiB.
fn verify_once(bin: &str, c: &Config, payloads: bool, events: u64) -> anyhow::Result<(f64, f64)> {
    let out_file = tempfile::NamedTempFile::new()?;
    let mut cmd = Command::new("/usr/bin/time");
    cmd.arg("-f")
        .arg("%M")
        .arg("-o")
        .arg(out_file.path())
        .arg(bin)
        .args(["verify", "--json"]);
    if payloads {
        cmd.arg("--payloads");
    }
    for (k, _) in std::env::vars() {
        if k.starts_with("OUTBOX_RELAY_") {
            cmd.env_remove(k);
        }
    }
    cmd.env("OUTBOX_RELAY_POSTGRES_URL", &c.postgres.url)
        .env("OUTBOX_RELAY_POSTGRES_SLOT", &c.postgres.slot)
        .env("OUTBOX_RELAY_POSTGRES_PUBLICATION", &c.postgres.publication)
        .env("OUTBOX_RELAY_NATS_URL", &c.nats.url)
        .env("OUTBOX_RELAY_HTTP_LISTEN", "");
    let t = Instant::now();
    let out = cmd.output()?;
    let secs = t.elapsed().as_secs_f64();
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).map_err(|e| {
        anyhow::anyhow!(
            "verify printed no JSON ({e}): {}",
            String::from_utf8_lossy(&out.stderr)
        )
    })?;
    anyhow::ensure!(
        out.status.success() && json["rows"] == events && json["messages"] == events,
        "verify was not clean: {json}"
    );
    let kb: f64 = std::fs::read_to_string(out_file.path())?.trim().parse()?;
    Ok((secs, kb))
}
