//! Metric labels from input (docs/security.md, security round 5, finding 4): the schema-failure
//! counter is labelled by event type, a writer's input kept until the relay exits. 120 rows with
//! event types of 256 KB each grew `/metrics` from 5 KB to 31 MB and the relay's resident memory
//! from 24 to 166 MB. Now a label value is cut to 128 bytes with a hash suffix.

use std::time::Duration;

use super::{LIMIT, good, http_get, proc_kb, set, text_id_db, wait_http};
use crate::ops::free_addr;
use crate::support::{NatsServer, RelayProcess, relay_config, relay_env, stream_count, wait_for};

/// Event types of 256 KB.
const LONG: i32 = 256 << 10;
const ROWS: i32 = 120;

/// With `outbox.schemas_required`, 120 events whose 256 KB event types have no schema file fail
/// their check (dead letters). `/metrics` keeps a series per event type, each label at most 128
/// bytes: the whole text stays under 64 KB, and the failures are counted under the cut labels.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_event_types_do_not_grow_metrics() {
    let db = text_id_db().await;
    let nats = NatsServer::start();
    let config = relay_config(&db, &nats);
    let schemas = tempfile::tempdir().expect("schema dir");
    std::fs::write(
        schemas.path().join("ClaimApproved.json"),
        r#"{"type": "object"}"#,
    )
    .expect("write schema");
    let addr = free_addr();
    let mut env = relay_env(&config);
    set(&mut env, "OUTBOX_RELAY_HTTP_LISTEN", &addr);
    set(
        &mut env,
        "OUTBOX_RELAY_OUTBOX_SCHEMAS",
        &schemas.path().display().to_string(),
    );
    set(&mut env, "OUTBOX_RELAY_OUTBOX_SCHEMAS_REQUIRED", "true");
    // 30 MB of dead letters on a busy machine: no restart (which checks them again) for a slow ack.
    set(&mut env, "OUTBOX_RELAY_NATS_ACK_TIMEOUT_MS", "30000");
    let relay = RelayProcess::spawn(&["run"], &env);
    wait_http(&addr, "/position", 200).await;
    let (_, small) = http_get(&addr, "/metrics").await.expect("/metrics");
    let before = proc_kb(relay.pid(), "VmRSS");

    let client = db.client().await;
    client
        .execute(
            "INSERT INTO public.outbox (event_id, aggregate_type, aggregate_id, event_type, payload) \
             SELECT 'long-' || i, 'Claim', '4711', repeat('T', $1) || i, '{}' \
               FROM generate_series(1, $2) AS i",
            &[&LONG, &ROWS],
        )
        .await
        .expect("insert the long event types");
    good(&client, "after").await;
    let js = nats.jetstream().await;
    // 30 MB through a file stream: on two cores shared with other builds this took over a
    // minute (a wait bound, not a timing claim).
    wait_for("every event in the stream", 3 * LIMIT, || async {
        stream_count(&js, &config.nats.stream).await > ROWS as u64
    })
    .await;
    // The counter is updated before the dead letter is published.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let (_, text) = http_get(&addr, "/metrics").await.expect("/metrics");
    let peak = proc_kb(relay.pid(), "VmHWM");
    let series: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("outbox_relay_schema_failures_total{"))
        .collect();
    eprintln!(
        "labels: /metrics {} bytes before, {} bytes after {ROWS} event types of {LONG} bytes ({} series); \
         RSS before {before} kB, peak {peak} kB",
        small.len(),
        text.len(),
        series.len()
    );
    assert_eq!(series.len(), ROWS as usize, "one series per event type");
    let counted: f64 = series
        .iter()
        .filter_map(|l| l.rsplit_once(' ').and_then(|(_, v)| v.parse::<f64>().ok()))
        .sum();
    // A session that restarts checks its events again, and counts them again.
    assert!(counted >= ROWS as f64, "every failure counted: {counted}");
    for l in &series {
        let label = l
            .split_once("event_type=\"")
            .and_then(|(_, rest)| rest.split_once("\"}"))
            .map(|(v, _)| v)
            .expect("an event_type label");
        assert!(label.len() <= 128, "{} bytes: {label}", label.len());
    }
    assert!(
        text.len() < 64 << 10,
        "/metrics is {} bytes after {ROWS} long event types",
        text.len()
    );
    drop(relay);
}
