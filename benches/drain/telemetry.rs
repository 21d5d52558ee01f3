//! `[telemetry]`'s cost: relay CPU per event draining the same kind of backlog with telemetry off, on
//! with 0 % sampled (every row's `traceparent` has flags 00) and on with 100 % sampled (flags 01), in
//! alternating rounds of one run (`BENCH_TELEMETRY=1`; `BENCH_TELEMETRY_ONLY=1` runs nothing else).
//!
//! Every row carries a `traceparent` in its headers column in all three, so "off" publishes the same
//! messages and only the spans differ. The collector is a small HTTP server in this process that
//! reads each request and answers 200 without decoding (its CPU is not the relay's). The relay's CPU
//! (utime + stime of the process, export thread included) is read one second after the stream holds
//! every event, so the last batch of spans has been sent.

use std::io::{Read, Write};
use std::net::TcpListener;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use outbox_relay::testkit::{NatsServer, PgServer, TestDb};

use super::{cpu_ms, relay_db_setup, relay_with};

/// One variant's result per round.
pub(crate) struct Row {
    pub variant: &'static str,
    pub cpu_ms_per_1k: Vec<f64>,
    pub eps: Vec<f64>,
}

/// Requests and body bytes the bench collector received.
struct Collector {
    endpoint: String,
    requests: Arc<AtomicU64>,
    bytes: Arc<AtomicU64>,
}

fn collector() -> anyhow::Result<Collector> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let endpoint = format!("http://{}", listener.local_addr()?);
    let requests = Arc::new(AtomicU64::new(0));
    let bytes = Arc::new(AtomicU64::new(0));
    let (r, b) = (Arc::clone(&requests), Arc::clone(&bytes));
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { continue };
            let mut got = Vec::new();
            let mut buf = [0u8; 65536];
            // Head, then Content-Length bytes of body.
            let body_len = loop {
                let Ok(n) = conn.read(&mut buf) else {
                    break None;
                };
                if n == 0 {
                    break None;
                }
                got.extend_from_slice(&buf[..n]);
                if let Some(end) = got.windows(4).position(|w| w == b"\r\n\r\n") {
                    let head = String::from_utf8_lossy(&got[..end]).to_ascii_lowercase();
                    let len: usize = head
                        .lines()
                        .find_map(|l| l.strip_prefix("content-length:"))
                        .and_then(|v| v.trim().parse().ok())
                        .unwrap_or(0);
                    break Some((end + 4, len));
                }
            };
            let Some((start, len)) = body_len else {
                continue;
            };
            while got.len() < start + len {
                match conn.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => got.extend_from_slice(&buf[..n]),
                }
            }
            r.fetch_add(1, Ordering::Relaxed);
            b.fetch_add(len as u64, Ordering::Relaxed);
            let _ = conn
                .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
        }
    });
    Ok(Collector {
        endpoint,
        requests,
        bytes,
    })
}

/// A backlog of `events` single-row transactions whose headers hold a traceparent with `flags`.
fn fill_traced(db: &TestDb, events: u64, flags: &str) {
    db.psql(&format!(
        "CREATE OR REPLACE PROCEDURE bench_fill_traced(n int) LANGUAGE plpgsql AS $$\n\
         BEGIN\n\
           FOR i IN 1..n LOOP\n\
             INSERT INTO public.outbox (aggregate_type, aggregate_id, event_type, payload, headers)\n\
               VALUES ('Order', 'order-' || i, 'OrderPlaced', '{payload}'::jsonb,\n\
                 jsonb_build_object('traceparent', '00-' || md5(i::text) || '-' || lpad(to_hex(i), 16, '0') || '-{flags}'));\n\
             COMMIT;\n\
           END LOOP;\n\
         END $$;\n\
         SET synchronous_commit = off;\n\
         CALL bench_fill_traced({events});\n\
         SET synchronous_commit = on;\n\
         SELECT txid_current();",
        payload = super::PAYLOAD
    ));
}

/// See the module docs.
pub(crate) async fn run(pg: &PgServer, events: u64, rounds: usize) -> anyhow::Result<Vec<Row>> {
    let slots =
        |kind: &str| -> Vec<String> { (0..rounds).map(|r| format!("{kind}_{r}")).collect() };
    let (off_slots, sampled_slots, unsampled_slots) =
        (slots("off"), slots("sampled"), slots("unsampled"));
    let sampled_db = TestDb::create(pg).await;
    relay_db_setup(&sampled_db, &[&off_slots[..], &sampled_slots].concat())?;
    fill_traced(&sampled_db, events, "01");
    let unsampled_db = TestDb::create(pg).await;
    relay_db_setup(&unsampled_db, &unsampled_slots)?;
    fill_traced(&unsampled_db, events, "00");
    let collector = collector()?;
    println!("telemetry: {events} single-row transactions, each with a traceparent, per variant");
    let mut rows = vec![
        Row {
            variant: "off",
            cpu_ms_per_1k: vec![],
            eps: vec![],
        },
        Row {
            variant: "on, 0% sampled",
            cpu_ms_per_1k: vec![],
            eps: vec![],
        },
        Row {
            variant: "on, 100% sampled",
            cpu_ms_per_1k: vec![],
            eps: vec![],
        },
    ];
    for r in 0..rounds {
        for (i, (db, slot, endpoint)) in [
            (&sampled_db, &off_slots[r], String::new()),
            (
                &unsampled_db,
                &unsampled_slots[r],
                collector.endpoint.clone(),
            ),
            (&sampled_db, &sampled_slots[r], collector.endpoint.clone()),
        ]
        .into_iter()
        .enumerate()
        {
            let before = collector.requests.load(Ordering::Relaxed);
            let nats = NatsServer::start();
            let extra = [
                ("OUTBOX_RELAY_OUTBOX_HEADERS_COLUMN", "headers".to_owned()),
                ("OUTBOX_RELAY_TELEMETRY_OTLP_ENDPOINT", endpoint),
            ];
            let (mut relay, eps, _rss, _cpu) = relay_with(
                db,
                &nats,
                slot,
                events,
                env!("CARGO_BIN_EXE_outbox-relay"),
                &extra,
            )
            .await?;
            // The export thread sends its last batch within its delay (500 ms).
            tokio::time::sleep(Duration::from_secs(1)).await;
            let cpu = cpu_ms(relay.pid());
            relay.stop();
            let per_1k = cpu / (events as f64 / 1000.0);
            println!(
                "telemetry round {} {:>17}: relay {eps:.0}/s, CPU {per_1k:.2} ms/1k events, {} export requests",
                r + 1,
                rows[i].variant,
                collector.requests.load(Ordering::Relaxed) - before
            );
            rows[i].cpu_ms_per_1k.push(per_1k);
            rows[i].eps.push(eps);
        }
    }
    println!(
        "telemetry: the collector received {} requests, {:.1} MB of OTLP protobuf",
        collector.requests.load(Ordering::Relaxed),
        collector.bytes.load(Ordering::Relaxed) as f64 / 1e6
    );
    Ok(rows)
}
