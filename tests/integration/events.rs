//! Event sources and formats against real Postgres and NATS: logical messages as events
//! (`outbox.message_prefix`, in commit order among row events, the SQL helper, messages-only mode, a
//! kill -9 during a backlog of them), header columns, and the CloudEvents binary-mode headers, judged
//! by what a consumer of the stream sees.

use std::collections::BTreeMap;
use std::time::Duration;

use outbox_relay::config::Config;
use tokio::task::block_in_place;
use tokio_postgres::Client;

use crate::support::{
    InProcessRelay, NatsServer, PgServer, RelayProcess, Scenario, ScenarioBuilder, Stored, TestDb,
    read_all, relay_config, relay_env, run_command, stream_count, wait_for,
};

/// The text-id outbox (plus a tenant column) and a claims table; logical messages under the
/// prefix `outbox` are events too.
fn events_scenario() -> ScenarioBuilder<'static> {
    Scenario::builder()
        .text_ids()
        .sql(
            "ALTER TABLE public.outbox ADD COLUMN tenant_id int;
             CREATE TABLE claims (id bigint PRIMARY KEY, status text NOT NULL);
             INSERT INTO claims SELECT g, 'open' FROM generate_series(4711, 4720) g;",
        )
        .config(|c| c.outbox.message_prefix = "outbox".into())
}

fn message_config(db: &TestDb, nats: &NatsServer) -> Config {
    let mut config = relay_config(db, nats);
    config.outbox.message_prefix = "outbox".into();
    config
}

async fn wait_and_read(nats: &NatsServer, stream: &str, n: u64) -> Vec<Stored> {
    let js = nats.jetstream().await;
    wait_for(
        &format!("{n} messages in {stream}"),
        Duration::from_secs(30),
        || async { stream_count(&js, stream).await >= n },
    )
    .await;
    read_all(&js, stream).await
}

/// The content of an event message.
fn content(id: &str, aggregate_id: &str, event_type: &str, payload: &str) -> String {
    format!(
        r#"{{"id":"{id}","aggregate_type":"Claim","aggregate_id":"{aggregate_id}","event_type":"{event_type}","payload":{payload},"headers":{{"traceparent":"00-{id}"}}}}"#
    )
}

async fn emit(client: &impl tokio_postgres::GenericClient, prefix: &str, content: &str) {
    client
        .execute(
            "SELECT pg_logical_emit_message(true, $1, $2::text)",
            &[&prefix, &content],
        )
        .await
        .unwrap_or_else(|e| panic!("emit {content}: {e}"));
}

async fn insert_row(client: &impl tokio_postgres::GenericClient, id: &str, payload: &str) {
    client
        .execute(
            "INSERT INTO public.outbox (event_id, aggregate_type, aggregate_id, event_type, payload, headers) \
             VALUES ($1, 'Claim', '4711', 'ClaimNoted', $2::text::jsonb, '{\"traceparent\":\"00-row\"}')",
            &[&id, &payload],
        )
        .await
        .unwrap_or_else(|e| panic!("insert {id}: {e}"));
}

/// A row event, a message event and another row event of one transaction arrive in that order, each
/// with its subject, id, headers and payload; the message's payload is the JSON text as written.
#[tokio::test]
async fn row_message_row_of_one_transaction_arrive_in_write_order() {
    let s = events_scenario()
        .config(|c| c.outbox.headers_column = "headers".into())
        .start()
        .await;
    let (_db, nats, config, mut client, _js, _slot, _stream) = s.into_parts();
    let relay = InProcessRelay::start_streaming(&config, &client).await;

    let payload = r#"{"claim_id": 4711,   "note":"spaces kept"}"#;
    let tx = client.transaction().await.unwrap();
    insert_row(&tx, "r-1", r#"{"n": 1}"#).await;
    emit(
        &tx,
        "outbox",
        &content("m-1", "4711", "ClaimApproved", payload),
    )
    .await;
    insert_row(&tx, "r-2", r#"{"n": 2}"#).await;
    tx.commit().await.unwrap();

    let all = wait_and_read(&nats, &config.nats.stream, 3).await;
    let ids: Vec<&str> = all.iter().map(Stored::id).collect();
    assert_eq!(
        ids,
        ["r-1", "m-1", "r-2"],
        "write order within the transaction"
    );
    let m = &all[1];
    assert_eq!(m.subject, "outbox.Claim", "routed by the same template");
    assert_eq!(m.header("Outbox-Event-Type"), "ClaimApproved");
    assert_eq!(m.header("Outbox-Aggregate-Type"), "Claim");
    assert_eq!(m.header("Outbox-Aggregate-Id"), "4711");
    assert_eq!(m.header("traceparent"), "00-m-1");
    assert_eq!(m.payload_str(), payload, "the JSON text as written");
    assert_eq!(m.commit_lsn(), all[0].commit_lsn(), "one transaction");
    assert_eq!(m.commit_lsn(), all[2].commit_lsn());
    assert_eq!(all[0].payload_str(), r#"{"n": 1}"#);
    assert_eq!(all[2].header("traceparent"), "00-row");
    relay.stop().await.unwrap();
}

/// A rolled-back message never arrives, another prefix is ignored, malformed content and a
/// non-transactional message are dead-lettered with their reasons, and the next event still flows.
#[tokio::test]
async fn rollback_other_prefix_and_malformed_messages() {
    let s = events_scenario().start().await;
    let (_db, nats, config, mut client, _js, _slot, _stream) = s.into_parts();
    let relay = InProcessRelay::start_streaming(&config, &client).await;

    let tx = client.transaction().await.unwrap();
    emit(&tx, "outbox", &content("rolled-back", "1", "E", "1")).await;
    tx.rollback().await.unwrap();
    emit(&client, "audit", &content("other-prefix", "1", "E", "1")).await;
    emit(
        &client,
        "outbox",
        r#"{"id":"bad-1","aggregate_type":"Claim""#,
    )
    .await;
    emit(
        &client,
        "outbox",
        r#"{"id":"bad-2","aggregate_type":"Claim","aggregate_id":"1","event_type":"E"}"#,
    )
    .await;
    client
        .execute(
            "SELECT pg_logical_emit_message(false, 'outbox', $1::text)",
            &[&content("non-tx", "1", "E", "1")],
        )
        .await
        .unwrap();
    emit(
        &client,
        "outbox",
        &content("good", "4711", "ClaimApproved", "{}"),
    )
    .await;

    let all = wait_and_read(&nats, &config.nats.stream, 4).await;
    // Let anything wrongly published after them arrive too.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let all_again = read_all(&nats.jetstream().await, &config.nats.stream).await;
    assert_eq!(all_again.len(), 4, "{all_again:?}");
    let dead = &config.nats.dead_letter_subject;
    let (bad1, bad2, nontx, good) = (&all[0], &all[1], &all[2], &all[3]);
    assert_eq!(&bad1.subject, dead);
    assert!(
        bad1.header("Outbox-Error").contains("not a valid event"),
        "{bad1:?}"
    );
    assert_eq!(
        bad1.payload_str(),
        r#"{"id":"bad-1","aggregate_type":"Claim""#
    );
    assert!(
        bad1.id().starts_with("lsn:"),
        "no id could be read: {bad1:?}"
    );
    assert_eq!(&bad2.subject, dead);
    assert_eq!(bad2.id(), "bad-2");
    assert!(bad2.header("Outbox-Error").contains("lacks \"payload\""));
    assert_eq!(&nontx.subject, dead);
    assert!(
        nontx
            .header("Outbox-Error")
            .contains("pg_logical_emit_message(true"),
        "{nontx:?}"
    );
    assert!(
        nontx.id().starts_with("lsn:") && nontx.id().contains(":non-transactional:"),
        "{nontx:?}"
    );
    assert_eq!(good.subject, "outbox.Claim");
    assert_eq!(good.id(), "good");
    // Nothing is left unconfirmed by the standalone dead letter: the slot passes the last commit.
    let slot = config.postgres.slot.clone();
    wait_for(
        "the slot to pass the last event",
        Duration::from_secs(15),
        || {
            let client = &client;
            let slot = &slot;
            async move {
                crate::support::confirmed_flush(client, slot)
                    .await
                    .is_some_and(|c| c >= good.commit_lsn())
            }
        },
    )
    .await;
    relay.stop().await.unwrap();
}

/// Messages-only mode (`outbox.table = ""`): no outbox table at all; setup creates an empty
/// publication, and sql/06_outbox_message.sql's helper writes an event in the transaction of a
/// business update, which commits both or neither.
#[tokio::test]
async fn messages_only_with_the_sql_helper_in_a_business_transaction() {
    let db = TestDb::create(PgServer::shared()).await;
    db.psql(
        "CREATE TABLE claims (id bigint PRIMARY KEY, status text NOT NULL);
         INSERT INTO claims VALUES (4711, 'open'), (4712, 'open');",
    );
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/sql/06_outbox_message.sql");
    db.psql(&std::fs::read_to_string(path).unwrap());
    let nats = NatsServer::start();
    let mut config = message_config(&db, &nats);
    config.outbox.table = String::new();
    let setup = run_command(&["setup"], &message_env(&config), Duration::from_secs(60));
    assert!(setup.status.success(), "setup: {}", setup.stderr);
    assert!(setup.stdout.contains("messages only"), "{}", setup.stdout);
    let tables: i64 = db
        .client()
        .await
        .query_one(
            "SELECT count(*) FROM pg_publication_tables WHERE pubname = $1",
            &[&config.postgres.publication],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(tables, 0, "the publication is empty");
    let mut client = db.client().await;
    let relay = InProcessRelay::start_streaming(&config, &client).await;

    let tx = client.transaction().await.unwrap();
    tx.execute("UPDATE claims SET status = 'approved' WHERE id = 4711", &[])
        .await
        .unwrap();
    let id: String = tx
        .query_one(
            "SELECT outbox_message('Claim', '4711', 'ClaimApproved', '{\"claim_id\": 4711}', \
             '{\"traceparent\": \"00-abc\"}')",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    tx.commit().await.unwrap();
    // Rolled back with its business update: never published.
    let tx = client.transaction().await.unwrap();
    tx.execute("UPDATE claims SET status = 'approved' WHERE id = 4712", &[])
        .await
        .unwrap();
    tx.query_one(
        "SELECT outbox_message('Claim', '4712', 'ClaimApproved', '{}', p_event_id => 'never')",
        &[],
    )
    .await
    .unwrap();
    tx.rollback().await.unwrap();
    let explicit: String = client
        .query_one(
            "SELECT outbox_message('Claim', '4711', 'ClaimPaid', '[1, 2]', p_event_id => 'paid-1')",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(explicit, "paid-1");

    let all = wait_and_read(&nats, &config.nats.stream, 2).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        read_all(&nats.jetstream().await, &config.nats.stream)
            .await
            .len(),
        2
    );
    assert_eq!(all[0].id(), id);
    assert!(uuid_like(&id), "{id}");
    assert_eq!(all[0].subject, "outbox.Claim");
    assert_eq!(all[0].header("Outbox-Event-Type"), "ClaimApproved");
    assert_eq!(all[0].header("traceparent"), "00-abc");
    assert_eq!(all[0].payload_str(), r#"{"claim_id": 4711}"#);
    assert_eq!(all[1].id(), "paid-1");
    assert_eq!(all[1].payload_str(), "[1, 2]");
    relay.stop().await.unwrap();
}

fn uuid_like(s: &str) -> bool {
    s.len() == 36 && s.chars().filter(|&c| c == '-').count() == 4
}

/// The binary's environment for `config`, with the message prefix and table.
fn message_env(config: &Config) -> Vec<(String, String)> {
    let mut env = relay_env(config);
    env.push((
        "OUTBOX_RELAY_OUTBOX_MESSAGE_PREFIX".into(),
        config.outbox.message_prefix.clone(),
    ));
    env.push((
        "OUTBOX_RELAY_OUTBOX_TABLE".into(),
        config.outbox.table.clone(),
    ));
    env
}

/// P1/P3/P4 for message events across SIGKILLs: a backlog of message events (several per
/// transaction) drains through the relay binary killed twice on the way; every event is stored once,
/// in commit order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_during_a_backlog_of_message_events() {
    const TXNS: u64 = 2_000;
    const PER_TXN: u64 = 3;
    let db = TestDb::create(PgServer::shared()).await;
    let nats = NatsServer::start();
    let mut config = message_config(&db, &nats);
    config.outbox.table = String::new();
    let mut env = message_env(&config);
    let setup = run_command(&["setup"], &env, Duration::from_secs(60));
    assert!(setup.status.success(), "setup: {}", setup.stderr);
    block_in_place(|| {
        db.psql(&format!(
            "DO $$ BEGIN
               FOR t IN 0..{last} LOOP
                 FOR i IN 0..{per_last} LOOP
                   PERFORM pg_logical_emit_message(true, 'outbox', json_build_object(
                     'id', 'k-' || lpad((t * {PER_TXN} + i)::text, 7, '0'), 'aggregate_type', 'Claim',
                     'aggregate_id', t::text, 'event_type', 'E', 'payload', json_build_object('n', i))::text);
                 END LOOP;
                 COMMIT;
               END LOOP;
             END $$;",
            last = TXNS - 1,
            per_last = PER_TXN - 1,
        ))
    });
    let total = TXNS * PER_TXN;
    env.push((
        "OUTBOX_RELAY_POSTGRES_STATUS_INTERVAL_MS".into(),
        "100".into(),
    ));
    let js = nats.jetstream().await;
    let stream = config.nats.stream.clone();
    for target in [total / 3, 2 * total / 3] {
        let mut relay = RelayProcess::spawn(&["run"], &env);
        wait_for(
            &format!("{target} stored"),
            Duration::from_secs(60),
            || async { stream_count(&js, &stream).await >= target },
        )
        .await;
        assert!(relay.is_running(), "relay exited: {}", relay.stderr());
        relay.signal("KILL");
        assert!(relay.wait(Duration::from_secs(10)).is_some(), "SIGKILL");
    }
    let mut last = RelayProcess::spawn(&["run"], &env);
    wait_for(
        &format!("{total} stored"),
        Duration::from_secs(90),
        || async { stream_count(&js, &stream).await >= total },
    )
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    last.signal("TERM");
    assert!(
        last.wait(Duration::from_secs(15))
            .expect("exit on SIGTERM")
            .success(),
        "{}",
        last.stderr()
    );
    let all = read_all(&js, &stream).await;
    let ids: Vec<&str> = all.iter().map(Stored::id).collect();
    let expected: Vec<String> = (0..total).map(|n| format!("k-{n:07}")).collect();
    assert_eq!(ids.len(), expected.len(), "every event exactly once");
    assert!(
        ids.iter().zip(&expected).all(|(a, b)| a == b),
        "commit order, no duplicates"
    );
}

/// Header columns and the CloudEvents headers have exact values, for a row (jsonb payload) and a
/// message, and the message parses as a binary-mode CloudEvent by the NATS binding's rules.
#[tokio::test]
async fn header_columns_and_cloudevents_headers() {
    let s = events_scenario()
        .config(|c| {
            c.outbox.headers_column = "headers".into();
            c.outbox.header_columns = vec!["tenant_id:Tenant-Id".into(), "aggregate_id".into()];
            c.nats.cloudevents = true;
            c.nats.cloudevents_source = "/claims service".into();
        })
        .start()
        .await;
    let (_db, nats, config, client, _js, _slot, _stream) = s.into_parts();
    let relay = InProcessRelay::start_streaming(&config, &client).await;

    let before = utc_now(&client).await;
    client
        .execute(
            "INSERT INTO public.outbox (event_id, aggregate_type, aggregate_id, event_type, payload, tenant_id) \
             VALUES ('r-1', 'Claim', '4711 €', 'ClaimApproved', '{\"a\": 1}', 42)",
            &[],
        )
        .await
        .unwrap();
    client
        .execute(
            "INSERT INTO public.outbox (event_id, aggregate_type, aggregate_id, event_type, payload) \
             VALUES ('r-2', 'Claim', '4712', 'ClaimApproved', '{}')",
            &[],
        )
        .await
        .unwrap();
    emit(
        &client,
        "outbox",
        &content("m-1", "4713", "ClaimPaid", "[1]"),
    )
    .await;
    let after = utc_now(&client).await;

    let all = wait_and_read(&nats, &config.nats.stream, 3).await;
    let (r1, r2, m1) = (&all[0], &all[1], &all[2]);
    assert_eq!(r1.header("Tenant-Id"), "42");
    assert_eq!(r1.header("aggregate_id"), "4711 €");
    assert!(
        !r2.headers.contains_key("Tenant-Id"),
        "NULL gives no header"
    );
    assert_eq!(r1.header("ce-specversion"), "1.0");
    assert_eq!(r1.header("ce-id"), "r-1");
    assert_eq!(r1.header("ce-type"), "ClaimApproved");
    assert_eq!(r1.header("ce-source"), "/claims%20service");
    assert_eq!(r1.header("ce-subject"), "4711%20%E2%82%AC");
    assert_eq!(r1.header("ce-datacontenttype"), "application/json");
    // The commit time, in the same RFC 3339 shape, so the strings compare as times.
    let time = r1.header("ce-time");
    assert!(
        before.as_str() <= time && time <= after.as_str(),
        "ce-time {time} outside [{before}, {after}]"
    );
    assert!(
        !r1.headers
            .keys()
            .any(|k| k.eq_ignore_ascii_case("content-type"))
    );
    assert_eq!(m1.header("ce-id"), "m-1");
    assert_eq!(m1.header("ce-type"), "ClaimPaid");
    assert_eq!(m1.header("ce-subject"), "4713");
    assert_eq!(m1.header("ce-datacontenttype"), "application/json");
    for m in &all {
        let ev = parse_binary_cloudevent(m).unwrap_or_else(|e| panic!("{e}: {m:?}"));
        assert_eq!(ev["id"], m.id());
        assert_eq!(ev["source"], "/claims service");
    }
    assert_eq!(
        parse_binary_cloudevent(r1).unwrap()["subject"],
        "4711 €",
        "a consumer decodes the aggregate id"
    );
    relay.stop().await.unwrap();
}

/// `nats.descriptive_headers = false`: row and message events arrive without `Outbox-Event-Type`,
/// `-Aggregate-Type`, `-Aggregate-Id` and `-Commit-Lsn`, with their id, position and own headers; a
/// relay started again on that stream resumes from its tail (which it reads by position and id) and
/// publishes the next event once, in order.
#[tokio::test]
async fn without_descriptive_headers_events_carry_id_and_position_and_the_relay_resumes() {
    let s = events_scenario()
        .config(|c| {
            c.nats.descriptive_headers = false;
            c.outbox.headers_column = "headers".into();
        })
        .start()
        .await;
    let (_db, nats, config, client, _js, _slot, _stream) = s.into_parts();
    let relay = InProcessRelay::start_streaming(&config, &client).await;
    insert_row(&client, "e-5531", r#"{"claim_id": 4711}"#).await;
    emit(
        &client,
        "outbox",
        &content("m-1", "4712", "ClaimPaid", "[1]"),
    )
    .await;
    let first = wait_and_read(&nats, &config.nats.stream, 2).await;
    relay.stop().await.unwrap();

    let relay = InProcessRelay::start_streaming(&config, &client).await;
    insert_row(&client, "e-5532", r#"{"claim_id": 4713}"#).await;
    let all = wait_and_read(&nats, &config.nats.stream, 3).await;
    relay.stop().await.unwrap();

    assert_eq!(first.len(), 2);
    let ids: Vec<&str> = all.iter().map(Stored::id).collect();
    assert_eq!(
        ids,
        ["e-5531", "m-1", "e-5532"],
        "each once, in commit order"
    );
    for m in &all {
        for gone in [
            "Outbox-Event-Type",
            "Outbox-Aggregate-Type",
            "Outbox-Aggregate-Id",
            "Outbox-Commit-Lsn",
        ] {
            assert!(!m.headers.contains_key(gone), "{gone} on {m:?}");
        }
        assert!(!m.header("Outbox-Position").is_empty(), "{m:?}");
        assert!(
            m.headers.contains_key("traceparent"),
            "own headers stay: {m:?}"
        );
    }
    assert_eq!(all[0].subject, "outbox.Claim");
}

/// The server's clock as the relay writes `ce-time`.
async fn utc_now(client: &Client) -> String {
    client
        .query_one(
            "SELECT to_char(clock_timestamp() AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"')",
            &[],
        )
        .await
        .unwrap()
        .get(0)
}

/// What a consumer of the NATS binding (v1.0.3-wip, §3 and §3.1) does with a message: binary mode
/// unless `Content-Type` starts with `application/cloudevents`; every `ce-` header is an attribute,
/// its value percent-decoded (invalid UTF-8 refused); `specversion` 1.0 and `id`, `source`, `type`
/// are required; `time` is an RFC 3339 timestamp.
fn parse_binary_cloudevent(m: &Stored) -> Result<BTreeMap<String, String>, String> {
    if m.headers.iter().any(|(k, v)| {
        k.eq_ignore_ascii_case("content-type")
            && v.to_ascii_lowercase()
                .starts_with("application/cloudevents")
    }) {
        return Err("structured mode".into());
    }
    let mut attrs = BTreeMap::new();
    for (k, v) in &m.headers {
        let lower = k.to_ascii_lowercase();
        let Some(name) = lower.strip_prefix("ce-") else {
            continue;
        };
        if !v.bytes().all(|b| (0x21..=0x7e).contains(&b)) {
            return Err(format!("{k}: not printable ASCII without spaces"));
        }
        let decoded = percent_decode(v).ok_or_else(|| format!("{k}: bad percent-encoding"))?;
        attrs.insert(name.to_owned(), decoded);
    }
    if attrs.get("specversion").map(String::as_str) != Some("1.0") {
        return Err("specversion is not 1.0".into());
    }
    for required in ["id", "source", "type"] {
        if attrs.get(required).is_none_or(String::is_empty) {
            return Err(format!("{required} missing or empty"));
        }
    }
    if let Some(t) = attrs.get("time") {
        let b = t.as_bytes();
        let shape = b.len() == 27
            && b[4] == b'-'
            && b[7] == b'-'
            && b[10] == b'T'
            && b[13] == b':'
            && b[16] == b':'
            && b[19] == b'.'
            && b[26] == b'Z';
        if !shape {
            return Err(format!("time {t} is not RFC 3339 UTC with microseconds"));
        }
    }
    Ok(attrs)
}

fn percent_decode(v: &str) -> Option<String> {
    let b = v.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hex = std::str::from_utf8(b.get(i + 1..i + 3)?).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}
