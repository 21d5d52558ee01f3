//! Trace context end to end (`[telemetry]`, `outbox.context_prefix`, docs/tracing.md) against real
//! Postgres, NATS and an OTLP/HTTP receiver that decodes what the relay exports: the writer's
//! `traceparent` from a row's headers or from its transaction's context message
//! (`sql/08_outbox_context.sql`), one PRODUCER span per sampled event whose parent is the writer's
//! span and whose id is the one the stored message's `traceparent` names (so a consumer's span
//! becomes its child), nothing for unsampled, absent or malformed context, an error span for a dead
//! letter; and a collector that is gone or hangs costs spans, counted, never events.

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use outbox_relay::config::Config;

use crate::support::{
    InProcessRelay, NatsServer, OtlpReceiver, PgServer, ReceivedSpan, Stored, TEXT_ID_OUTBOX_SQL,
    TestDb, read_all, relay_config, stream_count, wait_for,
};

/// Writers' contexts: sampled ones (flags 01) with their own trace ids, and an unsampled one.
const TP_ROW: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
const TP_CTX: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
const TP_OWN: &str = "00-11111111111111111111111111111111-2222222222222222-01";
const TP_DEAD: &str = "00-33333333333333333333333333333333-4444444444444444-01";
const TP_UNSAMPLED: &str = "00-55555555555555555555555555555555-6666666666666666-00";
const TP_MALFORMED: &str = "00-NOT-A-TRACE-01";

async fn db_with_outbox() -> TestDb {
    let db = TestDb::create(PgServer::shared()).await;
    db.psql(TEXT_ID_OUTBOX_SQL);
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/sql/08_outbox_context.sql");
    db.psql(&std::fs::read_to_string(path).expect("read sql/08"));
    db
}

fn traced_config(db: &TestDb, nats: &NatsServer, endpoint: &str) -> Config {
    let mut config = relay_config(db, nats);
    config.outbox.headers_column = "headers".into();
    config.outbox.context_prefix = "outbox-context".into();
    config.telemetry.otlp_endpoint = endpoint.to_owned();
    config.telemetry.service_name = "claims-relay".into();
    config
}

async fn insert(
    client: &impl tokio_postgres::GenericClient,
    id: &str,
    aggregate_type: &str,
    headers: Option<&str>,
) {
    client
        .execute(
            "INSERT INTO public.outbox (event_id, aggregate_type, aggregate_id, event_type, payload, headers) \
             VALUES ($1, $2, '4711', 'ClaimApproved', '{\"claim_id\": 4711}', $3::text::jsonb)",
            &[&id, &aggregate_type, &headers],
        )
        .await
        .unwrap_or_else(|e| panic!("insert {id}: {e}"));
}

fn headers_with(traceparent: &str) -> String {
    format!(r#"{{"traceparent": "{traceparent}"}}"#)
}

fn unix_nanos(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).unwrap().as_nanos() as u64
}

/// The span a stored message's `traceparent` names, checked to be the relay's child of `writer`.
fn span_of<'a>(m: &Stored, writer: &str, spans: &'a [ReceivedSpan]) -> &'a ReceivedSpan {
    let tp = m.header("traceparent");
    let parts: Vec<&str> = tp.split('-').collect();
    let w: Vec<&str> = writer.split('-').collect();
    assert_eq!(parts.len(), 4, "{tp}");
    assert_eq!(parts[0], "00");
    assert_eq!(parts[1], w[1], "{}: same trace as the writer", m.id());
    assert_ne!(
        parts[2],
        w[2],
        "{}: names the relay's span, not the writer's",
        m.id()
    );
    assert_eq!(parts[3], "01", "still sampled");
    let span = spans
        .iter()
        .find(|s| s.span_id == parts[2])
        .unwrap_or_else(|| panic!("no span {} for {}: {spans:#?}", parts[2], m.id()));
    assert_eq!(span.trace_id, w[1], "{}", m.id());
    assert_eq!(
        span.parent_span_id,
        w[2],
        "{}: the writer's span is the parent",
        m.id()
    );
    assert_eq!(span.kind, 4, "PRODUCER");
    assert_eq!(span.service_name, "claims-relay");
    assert_eq!(span.scope, "outbox-relay");
    assert_eq!(span.attr("messaging.system"), "nats");
    assert_eq!(span.attr("messaging.operation.type"), "send");
    assert_eq!(span.attr("messaging.message.id"), m.id());
    assert_eq!(span.attr("messaging.destination.name"), m.subject);
    assert_eq!(span.name, format!("send {}", m.subject));
    assert_eq!(
        span.attr("outbox.commit_lsn"),
        m.header("Outbox-Commit-Lsn")
    );
    assert!(span.start_unix_nano <= span.end_unix_nano, "{span:?}");
    span
}

/// Row headers, a context message (with an event's own traceparent winning over it, and an event
/// before it untouched), unsampled, absent and malformed context, a dead letter, and a context
/// message that is not an object of strings: each stored message and each span as the contract says.
#[tokio::test]
async fn spans_continue_the_writers_trace_and_the_messages_name_them() {
    let db = db_with_outbox().await;
    let nats = NatsServer::start();
    let receiver = OtlpReceiver::start().await;
    let config = traced_config(&db, &nats, &receiver.endpoint());
    let mut client = db.client().await;
    let relay = InProcessRelay::start_streaming(&config, &client).await;

    let before = SystemTime::now();
    insert(
        &client,
        "row",
        "Claim",
        Some(r#"{"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", "tracestate": "claims=1"}"#),
    )
    .await;
    let tx = client.transaction().await.unwrap();
    insert(&tx, "before-ctx", "Claim", None).await;
    tx.execute(
        "SELECT outbox_context($1, p_headers => '{\"baggage\": \"tenant=7\"}')",
        &[&TP_CTX],
    )
    .await
    .unwrap();
    insert(&tx, "ctx", "Claim", None).await;
    insert(&tx, "ctx-own", "Claim", Some(&headers_with(TP_OWN))).await;
    tx.commit().await.unwrap();
    let committed = SystemTime::now();
    insert(
        &client,
        "unsampled",
        "Claim",
        Some(&headers_with(TP_UNSAMPLED)),
    )
    .await;
    insert(&client, "absent", "Claim", None).await;
    insert(
        &client,
        "malformed",
        "Claim",
        Some(&headers_with(TP_MALFORMED)),
    )
    .await;
    // Unroutable (a space in the subject token): a dead letter, its span an error.
    insert(&client, "dead", "Cl aim", Some(&headers_with(TP_DEAD))).await;
    let tx = client.transaction().await.unwrap();
    tx.execute(
        "SELECT pg_logical_emit_message(true, 'outbox-context', '{\"traceparent\": 1}')",
        &[],
    )
    .await
    .unwrap();
    insert(&tx, "after-bad-ctx", "Claim", None).await;
    tx.commit().await.unwrap();

    let js = nats.jetstream().await;
    let stream = &config.nats.stream;
    wait_for("10 messages", Duration::from_secs(30), || async {
        stream_count(&js, stream).await >= 10
    })
    .await;
    let stored = read_all(&js, stream).await;
    let by_id: BTreeMap<&str, &Stored> = stored
        .iter()
        .filter_map(|m| {
            // The event id: a dead letter's Nats-Msg-Id is its own (`dead-letter:<id>`).
            let id = m
                .headers
                .get("Outbox-Event-Id")
                .or(m.headers.get("Nats-Msg-Id"))?;
            Some((id.as_str(), m))
        })
        .collect();
    let m = |id: &str| {
        *by_id
            .get(id)
            .unwrap_or_else(|| panic!("{id} stored: {stored:#?}"))
    };

    wait_for("4 spans", Duration::from_secs(20), || async {
        receiver.spans().len() >= 4
    })
    .await;
    // Nothing else comes: no span for unsampled, absent or malformed context.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let spans = receiver.spans();
    assert_eq!(spans.len(), 4, "{spans:#?}");
    assert!(
        receiver
            .requests()
            .iter()
            .all(|r| r == "POST /v1/traces application/x-protobuf"),
        "{:?}",
        receiver.requests()
    );

    // Row headers: the span starts at the commit and carries the writer's tracestate.
    let row = span_of(m("row"), TP_ROW, &spans);
    assert_eq!(row.trace_state, "claims=1");
    assert_eq!(m("row").header("tracestate"), "claims=1", "passed through");
    assert!(
        row.start_unix_nano + 1_000_000_000 >= unix_nanos(before)
            && row.start_unix_nano <= unix_nanos(committed),
        "start = the commit time: {row:?}"
    );
    assert!(row.end_unix_nano <= unix_nanos(SystemTime::now()));
    assert_eq!(row.status_code, 0, "unset");

    // The context message: for the events after it, with the event's own traceparent winning.
    assert!(
        !m("before-ctx").headers.contains_key("traceparent")
            && !m("before-ctx").headers.contains_key("baggage"),
        "an event before the context message has none: {:?}",
        m("before-ctx")
    );
    span_of(m("ctx"), TP_CTX, &spans);
    assert_eq!(m("ctx").header("baggage"), "tenant=7");
    span_of(m("ctx-own"), TP_OWN, &spans);
    assert_eq!(
        m("ctx-own").header("baggage"),
        "tenant=7",
        "the rest of the context"
    );

    // Unsampled, absent, malformed: passed through unchanged.
    assert_eq!(m("unsampled").header("traceparent"), TP_UNSAMPLED);
    assert!(!m("absent").headers.contains_key("traceparent"));
    assert_eq!(m("malformed").header("traceparent"), TP_MALFORMED);

    // The dead letter: its span is an error with the reason, and the dead letter names it.
    let dead = m("dead");
    assert_eq!(dead.subject, config.nats.dead_letter_subject);
    let dead_span = span_of(dead, TP_DEAD, &spans);
    assert_eq!(dead_span.status_code, 2, "error: {dead_span:?}");
    assert!(
        dead_span.status_message.contains("aggregate_type"),
        "{dead_span:?}"
    );

    // A context message that is not an object of strings: a dead letter saying so; the event after
    // it carries no context.
    let bad = stored
        .iter()
        .find(|s| {
            s.headers
                .get("Outbox-Error")
                .is_some_and(|e| e.contains("trace context message"))
        })
        .unwrap_or_else(|| panic!("the bad context message is a dead letter: {stored:#?}"));
    assert!(
        bad.header("Outbox-Error")
            .contains("\"traceparent\" is not a string"),
        "{bad:?}"
    );
    assert_eq!(bad.payload_str(), r#"{"traceparent": 1}"#);
    assert!(!m("after-bad-ctx").headers.contains_key("traceparent"));

    assert_eq!(relay.metrics.spans_exported.get(), 4);
    assert_eq!(relay.metrics.spans_dropped.get(), 0);
    relay.stop().await.unwrap();
}

/// 300 sampled events at full speed with the collector gone (connections refused), then with one
/// that accepts and never answers: every event is stored, every span is dropped and counted.
#[tokio::test]
async fn a_dead_or_hanging_collector_costs_spans_never_events() {
    for hanging in [false, true] {
        let db = db_with_outbox().await;
        let nats = NatsServer::start();
        // Gone: a receiver that was there and stopped. Hanging: a listener that accepts and then
        // says nothing, holding every connection.
        let (endpoint, _hold) = if hanging {
            let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            let endpoint = format!("http://{}", listener.local_addr().unwrap());
            let hold = std::thread::spawn(move || {
                let mut held = Vec::new();
                for c in listener.incoming().take(16) {
                    held.push(c);
                }
                std::thread::sleep(Duration::from_secs(60));
            });
            (endpoint, Some(hold))
        } else {
            let receiver = OtlpReceiver::start().await;
            let endpoint = receiver.endpoint();
            receiver.stop().await;
            (endpoint, None)
        };
        let config = traced_config(&db, &nats, &endpoint);
        let client = db.client().await;
        let relay = InProcessRelay::start_streaming(&config, &client).await;

        client
            .batch_execute(
                "DO $$ BEGIN FOR g IN 1..300 LOOP
                   INSERT INTO public.outbox (event_id, aggregate_type, aggregate_id, event_type, payload, headers)
                   VALUES ('e-' || g, 'Claim', g::text, 'ClaimApproved', '{}',
                           jsonb_build_object('traceparent',
                             '00-0af7651916cd43dd8448eb211c80319c-' || lpad(to_hex(g), 16, '0') || '-01'));
                   COMMIT;
                 END LOOP; END $$;",
            )
            .await
            .unwrap();
        let js = nats.jetstream().await;
        wait_for("300 events stored", Duration::from_secs(30), || async {
            stream_count(&js, &config.nats.stream).await >= 300
        })
        .await;
        wait_for(
            &format!("300 spans dropped (hanging: {hanging})"),
            Duration::from_secs(30),
            || async { relay.metrics.spans_dropped.get() >= 300 },
        )
        .await;
        assert_eq!(relay.metrics.spans_dropped.get(), 300);
        assert_eq!(relay.metrics.spans_exported.get(), 0);
        let stored = read_all(&js, &config.nats.stream).await;
        assert_eq!(stored.len(), 300);
        assert!(
            stored.iter().all(|m| m.subject == "outbox.Claim"),
            "no dead letters"
        );
        let text = relay.metrics.render();
        assert!(
            text.contains("outbox_relay_spans_dropped_total 300"),
            "{text}"
        );
        relay.stop().await.unwrap();
    }
}
