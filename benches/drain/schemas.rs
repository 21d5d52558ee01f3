//! Event contracts (`outbox.schemas`): the relay draining the same backlog with validation off and
//! on, alternating per round in one run, and the difference in CPU per event read from /proc
//! (utime+stime of the relay process, spawn to the last event stored). The backlog is the
//! single-row one of the main section (the 222-byte jsonb `PAYLOAD`, event type `OrderPlaced`);
//! the schema checks a few of its properties (types, a `required` list, a `minimum`, an array of
//! objects, a `$ref` to a second file), so every event is parsed and validated and passes.
//!
//! Knobs: `BENCH_SCHEMAS` (1; empty or 0 skips it), `BENCH_SCHEMA_EVENTS` (`BENCH_EVENTS`, 100000),
//! `BENCH_SCHEMA_ROUNDS` (`BENCH_ROUNDS`). `BENCH_SCHEMAS_ONLY=1` runs only this section.

use outbox_relay::testkit::{NatsServer, PgServer, TestDb};

use super::{env_or, fill, median, relay, relay_db_setup, relay_with, stored_payload};

const ORDER_PLACED: &str = r#"{
  "$id": "https://schemas.example.com/orders/OrderPlaced.json",
  "type": "object",
  "required": ["items", "total_cents", "currency", "customer_id"],
  "properties": {
    "items": {"type": "array", "items": {"$ref": "common.json#/$defs/item"}},
    "total_cents": {"type": "integer", "minimum": 0},
    "currency": {"type": "string", "minLength": 3, "maxLength": 3},
    "customer_id": {"type": "string"},
    "note": {"type": "string"}
  }
}"#;
const COMMON: &str = r#"{"$defs": {"item": {
  "type": "object",
  "required": ["sku", "qty"],
  "properties": {"sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1}, "price_cents": {"type": "integer"}}
}}}"#;

/// (events/s, CPU µs per event) of one relay run.
type Run = (f64, f64);

/// Medians of the off and on runs: events/s and CPU µs per event.
pub(crate) struct SchemaResult {
    pub events: u64,
    pub payload_bytes: usize,
    pub off: Run,
    pub on: Run,
    pub rounds: Vec<(Run, Run)>,
}

pub(crate) async fn run(pg: &PgServer) -> anyhow::Result<Option<SchemaResult>> {
    if std::env::var("BENCH_SCHEMAS").is_ok_and(|v| v.is_empty() || v == "0") {
        return Ok(None);
    }
    let events: u64 = env_or("BENCH_SCHEMA_EVENTS", env_or("BENCH_EVENTS", 100_000));
    let rounds: usize = env_or("BENCH_SCHEMA_ROUNDS", env_or("BENCH_ROUNDS", 3)).max(1);
    let dir = tempfile::tempdir()?;
    std::fs::write(dir.path().join("OrderPlaced.json"), ORDER_PLACED)?;
    std::fs::write(dir.path().join("common.json"), COMMON)?;
    let db = TestDb::create(pg).await;
    let slots: Vec<String> = (0..rounds)
        .flat_map(|r| [format!("schema_off_{r}"), format!("schema_on_{r}")])
        .collect();
    relay_db_setup(&db, &slots)?;
    fill(&db, events, 1)?;
    let payload_bytes = stored_payload(&db).len();
    let on_env = [(
        "OUTBOX_RELAY_OUTBOX_SCHEMAS",
        dir.path().display().to_string(),
    )];
    let mut results = Vec::new();
    for r in 0..rounds {
        let nats = NatsServer::start();
        let (mut child, off_eps, _, off_cpu) = relay(&db, &nats, &slots[2 * r], events).await?;
        child.stop();
        drop(nats);
        let nats = NatsServer::start();
        let (mut child, on_eps, _, on_cpu) = relay_with(
            &db,
            &nats,
            &slots[2 * r + 1],
            events,
            env!("CARGO_BIN_EXE_outbox-relay"),
            &on_env,
        )
        .await?;
        // Every event passed: a dead letter would show a broken bench, not a cost.
        let log = child.log();
        child.stop();
        drop(nats);
        anyhow::ensure!(
            log.contains("JSON Schemas loaded") && !log.contains("dead-lettering"),
            "validation was off or rejected events of the bench backlog:\n{log}"
        );
        let per = |cpu_ms: f64| cpu_ms * 1000.0 / events as f64;
        let (off, on) = ((off_eps, per(off_cpu)), (on_eps, per(on_cpu)));
        println!(
            "schemas round {}: off {:.0}/s {:.2} µs CPU/event; on {:.0}/s {:.2} µs CPU/event ({:+.2} µs)",
            r + 1,
            off.0,
            off.1,
            on.0,
            on.1,
            on.1 - off.1
        );
        results.push((off, on));
    }
    let med = |f: &dyn Fn(&(Run, Run)) -> f64| median(results.iter().map(f).collect());
    Ok(Some(SchemaResult {
        events,
        payload_bytes,
        off: (med(&|x| x.0.0), med(&|x| x.0.1)),
        on: (med(&|x| x.1.0), med(&|x| x.1.1)),
        rounds: results,
    }))
}

pub(crate) fn print(r: &SchemaResult) {
    println!(
        "\nschemas ({} events, {}-byte payload, medians of {} rounds): off {:.0}/s {:.2} µs CPU/event; \
         on {:.0}/s {:.2} µs CPU/event; validation costs {:+.2} µs/event (per-round differences: {})",
        r.events,
        r.payload_bytes,
        r.rounds.len(),
        r.off.0,
        r.off.1,
        r.on.0,
        r.on.1,
        r.on.1 - r.off.1,
        r.rounds
            .iter()
            .map(|(off, on)| format!("{:+.2}", on.1 - off.1))
            .collect::<Vec<_>>()
            .join(", ")
    );
}
