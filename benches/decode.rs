//! Decoder throughput and allocations per event, on the frames a real outbox insert produces.
//!
//! One transaction = Begin, Insert (uuid, three short texts, a ~200-byte jsonb payload, a timestamptz,
//! NULL headers), Commit; a Relation message comes first, as the walsender sends it. Three stages are
//! timed in the same run, one after the other per round, so a busy machine slows them alike:
//!
//! - `decode`: `pgoutput::Decoder::decode` of the three frames (the requirement: pure decoder);
//! - `decode+stage`: plus `outbox::OutboxStage::step` (row → `OutboxEvent`);
//! - `decode+stage+build`: plus `message::build` (subject, headers, payload: what goes to NATS).
//!
//! Allocations come from `dhat` as the global allocator, counted in a separate pass while its profiler
//! runs; the timed rounds run after the profiler is dropped, when `dhat::Alloc` only forwards to the
//! system allocator.
//!
//! `cargo bench --bench decode` prints a table and a JSON line. Under `cargo test --benches` (no
//! `--bench` argument) it runs one small round as a smoke test.

use std::hint::black_box;
use std::time::Instant;

use bytes::Bytes;
use outbox_relay::Lsn;
use outbox_relay::config::OutboxConfig;
use outbox_relay::message;
use outbox_relay::outbox::{OutboxStage, Step};
use outbox_relay::pgoutput::{Column, Decoder, Message, Relation, TupleValue, encode};
use outbox_relay::route::SubjectTemplate;

#[global_allocator]
static ALLOC: dhat::Alloc = dhat::Alloc;

const RELATION_ID: u32 = 16_385;
/// `pg_type` oids of the outbox columns.
const UUID: u32 = 2950;
const TEXT: u32 = 25;
const JSONB: u32 = 3802;
const TIMESTAMPTZ: u32 = 1184;

fn relation() -> Bytes {
    let col = |name: &str, type_oid: u32, flags: u8| Column {
        flags,
        name: name.into(),
        type_oid,
        type_modifier: -1,
    };
    encode::message(&Message::Relation(Relation {
        xid: None,
        id: RELATION_ID,
        namespace: "public".into(),
        name: "outbox".into(),
        replica_identity: b'd',
        columns: vec![
            col("event_id", UUID, 1),
            col("aggregate_type", TEXT, 0),
            col("aggregate_id", TEXT, 0),
            col("event_type", TEXT, 0),
            col("payload", JSONB, 0),
            col("created_at", TIMESTAMPTZ, 0),
            col("headers", JSONB, 0),
        ],
    }))
}

/// A jsonb text output of about 200 bytes, as `payload::text` would print it.
fn payload(i: u64) -> String {
    let p = format!(
        r#"{{"items": [{{"qty": 2, "sku": "SKU-{i:08}", "price_cents": 1999}}, {{"qty": 1, "sku": "SKU-{:08}", "price_cents": 4500}}], "total_cents": 8498, "currency": "EUR", "customer_id": "cust-{:06}", "note": "leave at the door"}}"#,
        i + 1,
        i % 1_000_000
    );
    debug_assert!((180..=240).contains(&p.len()), "{}", p.len());
    p
}

/// Begin, Insert, Commit of transaction `i`, as the walsender frames them.
fn transaction(i: u64) -> [(Bytes, Lsn); 3] {
    let base = 0x1_0000_0000 + i * 0x200;
    let text = |s: String| TupleValue::Text(Bytes::from(s));
    let begin = Message::Begin {
        final_lsn: Lsn(base + 0x180),
        commit_ts: 760_000_000_000_000 + i as i64,
        xid: 1000 + i as u32,
    };
    let insert = Message::Insert {
        xid: None,
        relation_id: RELATION_ID,
        new: vec![
            text(format!("0190a5b2-7c3d-7e4f-8a9b-{i:012x}")),
            text("Order".into()),
            text(format!("order-{i}")),
            text("OrderPlaced".into()),
            text(payload(i)),
            text("2024-01-31 12:34:56.789012+00".into()),
            TupleValue::Null,
        ],
    };
    let commit = Message::Commit {
        flags: 0,
        commit_lsn: Lsn(base + 0x180),
        end_lsn: Lsn(base + 0x1b0),
        commit_ts: 760_000_000_000_000 + i as i64,
    };
    [
        (encode::message(&begin), Lsn(base)),
        (encode::message(&insert), Lsn(base + 0x28)),
        (encode::message(&commit), Lsn(base + 0x180)),
    ]
}

#[derive(Clone, Copy, PartialEq)]
enum Stage {
    Decode,
    DecodeOutbox,
    DecodeOutboxBuild,
}

impl Stage {
    const ALL: [Stage; 3] = [Stage::Decode, Stage::DecodeOutbox, Stage::DecodeOutboxBuild];

    fn name(self) -> &'static str {
        match self {
            Stage::Decode => "decode",
            Stage::DecodeOutbox => "decode+stage",
            Stage::DecodeOutboxBuild => "decode+stage+build",
        }
    }
}

/// Runs `stage` over every transaction once; returns the number of events.
fn run(stage: Stage, relation: &Bytes, txns: &[[(Bytes, Lsn); 3]]) -> u64 {
    let config = OutboxConfig::default();
    let template = SubjectTemplate::parse("outbox.{aggregate_type}").expect("template");
    let mut decoder = Decoder::new();
    let mut outbox = OutboxStage::new(&config);
    let rel = decoder.decode(relation.clone(), Lsn(1)).expect("relation");
    outbox.step(rel).expect("relation step");
    let mut events = 0u64;
    for txn in txns {
        for (frame, lsn) in txn {
            // Cloning a Bytes is a refcount increment, as the source hands out slices of its buffer.
            let msg = decoder.decode(frame.clone(), *lsn).expect("decode");
            if stage == Stage::Decode {
                if matches!(msg, Message::Insert { .. }) {
                    events += 1;
                }
                black_box(msg);
                continue;
            }
            let step = outbox.step(msg).expect("step");
            if let Step::Event(event) = &step {
                events += 1;
                if stage == Stage::DecodeOutboxBuild {
                    black_box(message::build(event, &template, "outbox_dead_letter", None));
                }
            }
            black_box(step);
        }
    }
    events
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let bench = std::env::args().any(|a| a == "--bench");
    let (n, rounds) = if bench { (200_000, 7) } else { (1_000, 1) };

    let relation = relation();
    let txns: Vec<_> = (0..n).map(transaction).collect();
    let frame_bytes: usize = txns.iter().flatten().map(|(b, _)| b.len()).sum();

    // Allocations: one pass per stage after a warm-up pass, over fewer events: the profiler records a
    // backtrace per allocation, so it is off (dropped) before anything is timed.
    let profiler = dhat::Profiler::builder().testing().build();
    let counted = &txns[..20_000.min(txns.len())];
    let mut allocs = Vec::new();
    for stage in Stage::ALL {
        run(stage, &relation, &txns[..1000.min(txns.len())]);
        let before = dhat::HeapStats::get();
        let events = run(stage, &relation, counted);
        let after = dhat::HeapStats::get();
        let per_event = (after.total_blocks - before.total_blocks) as f64 / events as f64;
        let bytes_per_event = (after.total_bytes - before.total_bytes) as f64 / events as f64;
        allocs.push((per_event, bytes_per_event));
    }
    drop(profiler);

    // Throughput: the stages alternate within each round.
    let mut eps: Vec<Vec<f64>> = vec![Vec::new(); Stage::ALL.len()];
    for _ in 0..rounds {
        for (k, stage) in Stage::ALL.into_iter().enumerate() {
            let t = Instant::now();
            let events = run(stage, &relation, &txns);
            eps[k].push(events as f64 / t.elapsed().as_secs_f64());
        }
    }

    println!(
        "decode bench: {n} single-insert transactions (Begin+Insert+Commit, {} bytes of frames per event), {rounds} rounds, median",
        frame_bytes / n as usize
    );
    println!(
        "{:<20} {:>14} {:>10} {:>13} {:>15}",
        "stage", "events/s", "ns/event", "allocs/event", "alloc B/event"
    );
    let mut json = Vec::new();
    for (k, stage) in Stage::ALL.into_iter().enumerate() {
        let m = median(&mut eps[k]);
        let (a, b) = allocs[k];
        println!(
            "{:<20} {:>14.0} {:>10.0} {:>13.2} {:>15.0}",
            stage.name(),
            m,
            1e9 / m,
            a,
            b
        );
        json.push(format!(
            r#""{}":{{"events_per_s":{m:.0},"allocs_per_event":{a:.2},"alloc_bytes_per_event":{b:.0}}}"#,
            stage.name()
        ));
    }
    println!(r#"{{"bench":"decode","events":{n},{}}}"#, json.join(","));
}
