//! What `outbox.on_invalid = "park"` costs: the relay draining the same backlog in `dead_letter`
//! mode and in `park` mode with no poison event, alternating per round in one run, and what one
//! parked event costs against one that flows. CPU per event is the relay process's utime+stime
//! from /proc, spawn to the last message stored, as in the other sections.
//!
//! Per round, four relays on fresh nats-servers (each round starts with the next one):
//! - `dead_letter`: the main section's single-row backlog (every key different, nothing invalid);
//! - `park`: the same backlog with `on_invalid = "park"` — the parked set is rebuilt at start and
//!   every event's key is looked up in it, so this pair is the mode's price when nothing is parked;
//! - `park + schemas, flowing`: the same backlog with a JSON Schema every event passes;
//! - `park + schemas, parked`: a backlog of the same size in which all events share one key and the
//!   first fails the schema, so every event goes to that key's parking subject. Against the flowing
//!   run (same validation, same message count) the difference is the cost of a parked event.
//!
//! Knobs: `BENCH_PARK_EVENTS` (`BENCH_EVENTS`, 100000), `BENCH_PARK_ROUNDS` (`BENCH_ROUNDS`; at most 4,
//! four slots a round on a server with 20).
//! `BENCH_PARK_ONLY=1` runs only this section; it is skipped otherwise unless `BENCH_PARK=1`.

use outbox_relay::testkit::{NatsServer, PgServer, TestDb};

use super::{PAYLOAD, env_or, fill, median, relay_db_setup, relay_with};

/// A contract the bench payload passes and `{}` fails.
const ORDER_PLACED: &str = r#"{
  "type": "object",
  "required": ["items", "total_cents", "currency", "customer_id"],
  "properties": {"total_cents": {"type": "integer", "minimum": 0}}
}"#;

/// (events/s, CPU µs per event) of one relay run.
type Run = (f64, f64);

pub(crate) struct ParkResult {
    pub events: u64,
    /// Medians: dead_letter, park, park + schemas flowing, park + schemas parked.
    pub med: [Run; 4],
    pub rounds: Vec<[Run; 4]>,
}

const NAMES: [&str; 4] = [
    "dead_letter",
    "park",
    "park + schemas, flowing",
    "park + schemas, all parked",
];

pub(crate) async fn run(pg: &PgServer) -> anyhow::Result<Option<ParkResult>> {
    let wanted = ["BENCH_PARK", "BENCH_PARK_ONLY"]
        .iter()
        .any(|k| std::env::var(k).is_ok_and(|v| v == "1"));
    if !wanted {
        return Ok(None);
    }
    let events: u64 = env_or("BENCH_PARK_EVENTS", env_or("BENCH_EVENTS", 100_000));
    // Every relay needs a slot made before the backlog is written, and the test server has 20.
    let rounds: usize = env_or("BENCH_PARK_ROUNDS", env_or("BENCH_ROUNDS", 3)).clamp(1, 4);
    let dir = tempfile::tempdir()?;
    std::fs::write(dir.path().join("OrderPlaced.json"), ORDER_PLACED)?;

    // The flowing backlog: one slot per round and flowing variant.
    let flowing = TestDb::create(pg).await;
    let slots: Vec<String> = (0..rounds)
        .flat_map(|r| (0..3).map(move |v| format!("park_{v}_{r}")))
        .collect();
    relay_db_setup(&flowing, &slots)?;
    fill(&flowing, events, 1)?;
    // The parked backlog: one key, its first event invalid.
    let parked = TestDb::create(pg).await;
    let parked_slots: Vec<String> = (0..rounds).map(|r| format!("parked_{r}")).collect();
    relay_db_setup(&parked, &parked_slots)?;
    parked.psql(&format!(
        "INSERT INTO public.outbox (aggregate_type, aggregate_id, event_type, payload) \
           VALUES ('Order', 'order-1', 'OrderPlaced', '{{}}'::jsonb);\n\
         SET synchronous_commit = off;\n\
         INSERT INTO public.outbox (aggregate_type, aggregate_id, event_type, payload) \
           SELECT 'Order', 'order-1', 'OrderPlaced', '{PAYLOAD}'::jsonb FROM generate_series(2, {events});"
    ));

    let park = ("OUTBOX_RELAY_OUTBOX_ON_INVALID", "park".to_owned());
    let schemas = (
        "OUTBOX_RELAY_OUTBOX_SCHEMAS",
        dir.path().display().to_string(),
    );
    let bin = env!("CARGO_BIN_EXE_outbox-relay");
    let mut results = Vec::new();
    for r in 0..rounds {
        let mut row = [(0.0, 0.0); 4];
        // Each round starts with another variant, so a cold cache or a neighbour's burst does
        // not always fall on the same one.
        for v in (0..4).map(|i| (i + r) % 4) {
            let (db, slot, env): (&TestDb, &str, Vec<(&str, String)>) = match v {
                0 => (&flowing, &slots[3 * r], vec![]),
                1 => (&flowing, &slots[3 * r + 1], vec![park.clone()]),
                2 => (
                    &flowing,
                    &slots[3 * r + 2],
                    vec![park.clone(), schemas.clone()],
                ),
                _ => (
                    &parked,
                    &parked_slots[r],
                    vec![park.clone(), schemas.clone()],
                ),
            };
            let nats = NatsServer::start();
            let (mut child, eps, _, cpu) = relay_with(db, &nats, slot, events, bin, &env).await?;
            let log = child.log();
            child.stop();
            if std::env::var("BENCH_PARK_LOG").is_ok_and(|v| v == "1") {
                println!("--- {} log:\n{log}", NAMES[v]);
            }
            drop(nats);
            // A variant that did not do what it names would measure something else: only the
            // last one parks a key, and none dead-letters.
            let parks = log.contains("parking the event's key");
            anyhow::ensure!(
                (v == 3) == parks && !log.contains("dead-lettering"),
                "the {} run {} a key:\n{log}",
                NAMES[v],
                if parks { "parked" } else { "did not park" }
            );
            row[v] = (eps, cpu * 1000.0 / events as f64);
        }
        println!(
            "park round {}: {}",
            r + 1,
            row.iter()
                .zip(NAMES)
                .map(|(run, name)| format!("{name} {:.0}/s {:.2} µs", run.0, run.1))
                .collect::<Vec<_>>()
                .join("; ")
        );
        results.push(row);
    }
    let med = |i: usize| -> Run {
        (
            median(results.iter().map(|x| x[i].0).collect()),
            median(results.iter().map(|x| x[i].1).collect()),
        )
    };
    Ok(Some(ParkResult {
        events,
        med: [med(0), med(1), med(2), med(3)],
        rounds: results,
    }))
}

pub(crate) fn print(r: &ParkResult) {
    let [dl, park, flowing, parked] = r.med;
    println!(
        "\npark ({} events, medians of {} rounds): dead_letter {:.0}/s {:.2} µs CPU/event; park, nothing \
         parked {:.0}/s {:.2} µs ({:+.2} µs); with schemas flowing {:.0}/s {:.2} µs, all parked {:.0}/s \
         {:.2} µs: a parked event costs {:+.2} µs more than one that flows (per-round park − dead_letter: {})",
        r.events,
        r.rounds.len(),
        dl.0,
        dl.1,
        park.0,
        park.1,
        park.1 - dl.1,
        flowing.0,
        flowing.1,
        parked.0,
        parked.1,
        parked.1 - flowing.1,
        r.rounds
            .iter()
            .map(|x| format!("{:+.2}", x[1].1 - x[0].1))
            .collect::<Vec<_>>()
            .join(", ")
    );
    // Interference only adds CPU time, so on a busy machine the least of the rounds is the
    // steadier reading of what a variant costs.
    let least = |i: usize| {
        r.rounds
            .iter()
            .map(|x| x[i].1)
            .fold(f64::INFINITY, f64::min)
    };
    println!(
        "park, least CPU of the rounds (µs/event): {}",
        NAMES
            .iter()
            .enumerate()
            .map(|(i, name)| format!("{name} {:.2}", least(i)))
            .collect::<Vec<_>>()
            .join("; ")
    );
}
