//! Commit → consumer latency of atomic transactions (`nats.atomic_transactions`) under a steady
//! rate, with group commit at its default (`nats.atomic_group_ms = 1`) and off (0), alternating in
//! one run: the number behind the claim that sharing batches buys throughput without costing a
//! lone transaction more than the bound. Writers commit transactions of `BENCH_ATOMIC_PER_TXN`
//! events (10) at each of `BENCH_ATOMIC_RATES` transactions/s (`100,300,1000`) for
//! `BENCH_LATENCY_SECS` (10) per variant; each variant and rate gets a fresh nats-server and a slot
//! created just before its relay starts, so no phase drains another's backlog. Latency is per
//! event, from its transaction's COMMIT returning to the consumer receiving it (as in
//! `latency.rs`, which this reuses).

use outbox_relay::testkit::{NatsServer, PgServer, TestDb};

use super::latency::{latency, print_latency};
use super::{env_list, env_or, relay_db_setup, relay_with};

pub(crate) async fn run(pg: &PgServer) -> anyhow::Result<()> {
    let rates = env_list("BENCH_ATOMIC_RATES", "100,300,1000");
    let per_txn: u64 = env_or("BENCH_ATOMIC_PER_TXN", 10u64).max(1);
    let secs: u64 = env_or("BENCH_LATENCY_SECS", 10u64).max(1);
    let rounds: usize = env_or("BENCH_ROUNDS", 1usize).max(1);
    let bin: String = env!("CARGO_BIN_EXE_outbox-relay").into();
    let db = TestDb::create(pg).await;
    relay_db_setup(&db, &[])?;
    println!(
        "== atomic transactions of {per_txn} events: commit → consumer latency, group commit on (1 ms) and off, {secs} s per rate, {rounds} round(s) =="
    );
    let mut phase = 0u32;
    for round in 0..rounds {
        for &rate in &rates {
            for group_ms in ["1", "0"] {
                phase += 1;
                let slot = format!("atomic_latency_{phase}");
                db.psql(&format!(
                    "SELECT pg_create_logical_replication_slot('{slot}', 'pgoutput')"
                ));
                let nats = NatsServer::start();
                let env = [
                    ("OUTBOX_RELAY_NATS_ATOMIC_TRANSACTIONS", "true".to_string()),
                    ("OUTBOX_RELAY_NATS_ATOMIC_GROUP_MS", group_ms.to_string()),
                ];
                let (mut relay, _, _, _) = relay_with(&db, &nats, &slot, 0, &bin, &env).await?;
                // Let the relay's session reach streaming before the first commit.
                tokio::time::sleep(std::time::Duration::from_secs(1)).await;
                let l = latency(&db, &nats, rate, secs, phase, per_txn).await?;
                let who = format!(
                    "round {} atomic_group_ms {group_ms} ({rate} txn/s of {per_txn})",
                    round + 1
                );
                print_latency(&who, rate * per_txn, &l);
                relay.stop();
                drop(relay);
                db.psql(&format!("SELECT pg_drop_replication_slot('{slot}')"));
            }
        }
    }
    Ok(())
}
