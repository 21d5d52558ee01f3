//! Event contracts (`outbox.schemas`) against real Postgres and nats-server: payloads that break
//! their JSON Schema (type, required, a minimum reached through a `$ref` to another file) become
//! dead letters naming the type, the pointer and the keyword while the stream goes on; a type
//! without a schema passes unless schemas are required; bytea payloads must be JSON; logical
//! messages and backfilled rows are checked the same way; SIGHUP puts a new directory in force and
//! keeps the old one when the new one does not load; a directory that does not load stops the
//! commands that check at once; `check-schemas` reports a table with a mix.

use std::path::Path;
use std::time::Duration;

use outbox_relay::backfill::{BackfillOptions, backfill};
use outbox_relay::config::Config;
use tokio_postgres::Client;

use crate::support::{
    InProcessRelay, NatsServer, PgServer, RelayProcess, Stored, TEXT_ID_OUTBOX_SQL, TestDb,
    read_all, relay_config, relay_env, run_command, stream_count, wait_for,
};

const LIMIT: Duration = Duration::from_secs(60);

/// ClaimApproved: `claim` an integer, `amount` required and ≥ 0 through `common.json`.
const CLAIM_APPROVED: &str = r#"{
    "$id": "https://schemas.example.com/claims/ClaimApproved.json",
    "type": "object",
    "required": ["claim", "amount"],
    "properties": {
        "claim": {"type": "integer"},
        "amount": {"$ref": "common.json#/$defs/amount"}
    }
}"#;
const COMMON: &str = r#"{"$defs": {"amount": {"type": "number", "minimum": 0}}}"#;

fn schema_dir(files: &[(&str, &str)]) -> tempfile::TempDir {
    let d = tempfile::tempdir().expect("tempdir");
    write_schemas(d.path(), files);
    d
}

fn write_schemas(dir: &Path, files: &[(&str, &str)]) {
    for (name, text) in files {
        std::fs::write(dir.join(name), text).expect("write schema");
    }
}

async fn text_id_db() -> TestDb {
    let db = TestDb::create(PgServer::shared()).await;
    db.psql(TEXT_ID_OUTBOX_SQL);
    db
}

async fn insert(client: &Client, id: &str, event_type: &str, payload: &str) {
    client
        .execute(
            "INSERT INTO public.outbox (event_id, aggregate_type, aggregate_id, event_type, payload) \
             VALUES ($1, 'Claim', '4711', $2, $3::text::jsonb)",
            &[&id, &event_type, &payload],
        )
        .await
        .unwrap_or_else(|e| panic!("insert {id}: {e}"));
}

async fn wait_and_read(nats: &NatsServer, stream: &str, n: u64) -> Vec<Stored> {
    let js = nats.jetstream().await;
    wait_for(&format!("{n} messages in {stream}"), LIMIT, || async {
        stream_count(&js, stream).await >= n
    })
    .await;
    read_all(&js, stream).await
}

fn by_id<'a>(all: &'a [Stored], id: &str) -> &'a Stored {
    all.iter()
        .find(|m| m.id() == id)
        .unwrap_or_else(|| panic!("{id} not in the stream: {all:?}"))
}

/// The reason of a dead letter, after checking it is one.
fn reason<'a>(m: &'a Stored, config: &Config) -> &'a str {
    assert_eq!(m.subject, config.nats.dead_letter_subject, "{m:?}");
    m.header("Outbox-Error")
}

/// Rows and logical messages: each kind of failure is a dead letter with its reason, the good
/// events around them are published (with `ce-dataschema` = the schema's `$id`), a type without a
/// schema passes, and the failures are counted by type.
#[tokio::test]
async fn failing_payloads_are_dead_letters_naming_type_pointer_and_keyword() {
    let db = text_id_db().await;
    let nats = NatsServer::start();
    let dir = schema_dir(&[
        ("ClaimApproved.json", CLAIM_APPROVED),
        ("common.json", COMMON),
    ]);
    let mut config = relay_config(&db, &nats);
    config.outbox.schemas = dir.path().display().to_string();
    config.outbox.message_prefix = "outbox".into();
    config.nats.cloudevents = true;
    let client = db.client().await;
    let relay = InProcessRelay::start_streaming(&config, &client).await;

    insert(
        &client,
        "ok-1",
        "ClaimApproved",
        r#"{"claim": 4711, "amount": 12.5}"#,
    )
    .await;
    insert(
        &client,
        "bad-type",
        "ClaimApproved",
        r#"{"claim": "4711", "amount": 1}"#,
    )
    .await;
    insert(
        &client,
        "bad-required",
        "ClaimApproved",
        r#"{"claim": 4711}"#,
    )
    .await;
    insert(
        &client,
        "bad-minimum",
        "ClaimApproved",
        r#"{"claim": 4711, "amount": -5}"#,
    )
    .await;
    insert(
        &client,
        "no-schema",
        "ClaimRejected",
        r#"{"anything": true}"#,
    )
    .await;
    client
        .execute(
            "SELECT pg_logical_emit_message(true, 'outbox', $1::text)",
            &[&r#"{"id":"bad-message","aggregate_type":"Claim","aggregate_id":"4711","event_type":"ClaimApproved","payload":{"claim":4711,"amount":"1"}}"#],
        )
        .await
        .expect("emit");
    // Payloads over 16 KiB are checked off the runtime thread, by the sink: the same verdicts.
    let note = "n".repeat(20 * 1024);
    insert(
        &client,
        "big-ok",
        "ClaimApproved",
        &format!(r#"{{"claim": 4713, "amount": 1, "note": "{note}"}}"#),
    )
    .await;
    insert(
        &client,
        "big-bad",
        "ClaimApproved",
        &format!(r#"{{"claim": "4713", "amount": 1, "note": "{note}"}}"#),
    )
    .await;
    insert(
        &client,
        "ok-2",
        "ClaimApproved",
        r#"{"claim": 4712, "amount": 0}"#,
    )
    .await;

    let all = wait_and_read(&nats, &config.nats.stream, 9).await;
    assert_eq!(
        by_id(&all, "big-ok").header("ce-dataschema"),
        "https://schemas.example.com/claims/ClaimApproved.json"
    );
    assert_eq!(
        reason(by_id(&all, "big-bad"), &config),
        r#"ClaimApproved: /claim: "4713" is not of type "integer" (type)"#
    );
    let ok = by_id(&all, "ok-1");
    assert_eq!(ok.subject, "outbox.Claim");
    assert_eq!(
        ok.header("ce-dataschema"),
        "https://schemas.example.com/claims/ClaimApproved.json"
    );
    assert_eq!(
        reason(by_id(&all, "bad-type"), &config),
        r#"ClaimApproved: /claim: "4711" is not of type "integer" (type)"#
    );
    assert_eq!(
        reason(by_id(&all, "bad-required"), &config),
        r#"ClaimApproved: (root): "amount" is a required property (required)"#
    );
    assert_eq!(
        reason(by_id(&all, "bad-minimum"), &config),
        "ClaimApproved: /amount: -5 is less than the minimum of 0 (minimum)"
    );
    assert_eq!(
        reason(by_id(&all, "bad-message"), &config),
        r#"ClaimApproved: /amount: "1" is not of type "number" (type)"#
    );
    // The dead letter keeps the payload, so the failing value can be looked at.
    assert_eq!(
        by_id(&all, "bad-type").payload_str(),
        r#"{"claim": "4711", "amount": 1}"#
    );
    let unchecked = by_id(&all, "no-schema");
    assert_eq!(unchecked.subject, "outbox.Claim");
    assert_eq!(
        unchecked.headers.get("ce-dataschema"),
        None,
        "no schema, no dataschema"
    );
    assert_eq!(
        by_id(&all, "ok-2").subject,
        "outbox.Claim",
        "the stream goes on"
    );
    assert_eq!(relay.metrics.schemas.failures("ClaimApproved"), 5);
    let text = relay.metrics.render();
    assert!(
        text.contains("outbox_relay_schema_failures_total{event_type=\"ClaimApproved\"} 5"),
        "{text}"
    );
    assert!(text.contains("outbox_relay_schemas_loaded 2"), "{text}");
    relay.stop().await.expect("clean stop");
}

/// `schemas_required = true` with a bytea payload column: JSON bytes that validate are published
/// as they are, bytes that are not JSON fail, and a type without a schema is a dead letter.
#[tokio::test]
async fn bytea_payloads_must_be_json_and_required_schemas_refuse_unknown_types() {
    let db = TestDb::create(PgServer::shared()).await;
    db.psql(
        "CREATE TABLE public.outbox (
            event_id text PRIMARY KEY, aggregate_type text NOT NULL, aggregate_id text NOT NULL,
            event_type text NOT NULL, payload bytea NOT NULL);",
    );
    let nats = NatsServer::start();
    let dir = schema_dir(&[("Blob.json", r#"{"type": "object", "required": ["n"]}"#)]);
    let mut config = relay_config(&db, &nats);
    config.outbox.schemas = dir.path().display().to_string();
    config.outbox.schemas_required = true;
    let client = db.client().await;
    let relay = InProcessRelay::start_streaming(&config, &client).await;
    for (id, ty, payload) in [
        ("json", "Blob", &br#"{"n": 1}"#[..]),
        ("raw", "Blob", &b"\x00\x01\xff"[..]),
        ("unknown-type", "Other", &br#"{"n": 1}"#[..]),
        ("after", "Blob", &br#"{"n": 2}"#[..]),
    ] {
        client
            .execute(
                "INSERT INTO public.outbox VALUES ($1, 'Blob', '1', $2, $3)",
                &[&id, &ty, &payload],
            )
            .await
            .expect("insert");
    }
    let all = wait_and_read(&nats, &config.nats.stream, 4).await;
    assert_eq!(by_id(&all, "json").subject, "outbox.Blob");
    assert_eq!(by_id(&all, "json").payload, &br#"{"n": 1}"#[..]);
    assert!(
        reason(by_id(&all, "raw"), &config).starts_with("Blob: the bytea payload is not JSON"),
        "{:?}",
        by_id(&all, "raw")
    );
    assert!(
        reason(by_id(&all, "unknown-type"), &config).contains("no schema Other.json in")
            && reason(by_id(&all, "unknown-type"), &config).contains("schemas_required"),
        "{:?}",
        by_id(&all, "unknown-type")
    );
    assert_eq!(by_id(&all, "after").subject, "outbox.Blob");
    relay.stop().await.expect("clean stop");
}

/// Waits until the relay's stderr contains `text` `n` times.
async fn wait_for_log(p: &mut RelayProcess, text: &str, n: usize) {
    let deadline = std::time::Instant::now() + LIMIT;
    loop {
        let stderr = p.stderr();
        if stderr.lines().filter(|l| l.contains(text)).count() >= n {
            return;
        }
        assert!(p.is_running(), "the relay exited:\n{stderr}");
        assert!(
            std::time::Instant::now() < deadline,
            "no {text:?} within {LIMIT:?}:\n{stderr}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The running binary: SIGHUP puts a changed directory in force (a rule added to the schema
/// applies to the next event); a directory that no longer loads is reported in one line naming
/// the file and the problem, and the schemas in force stay (the added rule still applies).
#[tokio::test]
async fn sighup_reloads_the_schemas_and_keeps_them_when_the_new_ones_do_not_load() {
    let db = text_id_db().await;
    let nats = NatsServer::start();
    let config = relay_config(&db, &nats);
    let dir = schema_dir(&[("ClaimApproved.json", r#"{"type": "object"}"#)]);
    let mut env = relay_env(&config);
    env.push((
        "OUTBOX_RELAY_OUTBOX_SCHEMAS".into(),
        dir.path().display().to_string(),
    ));
    let client = db.client().await;
    let mut p = RelayProcess::spawn(&["run"], &env);
    wait_for_log(&mut p, "streaming", 1).await;
    insert(&client, "before", "ClaimApproved", r#"{"claim": "x"}"#).await;
    // Stored before the reload: an event is checked when the relay decodes it, not when written.
    wait_and_read(&nats, &config.nats.stream, 1).await;

    write_schemas(
        dir.path(),
        &[(
            "ClaimApproved.json",
            r#"{"type": "object", "properties": {"claim": {"type": "integer"}}}"#,
        )],
    );
    p.signal("HUP");
    wait_for_log(&mut p, "applied outbox.schemas", 1).await;
    insert(
        &client,
        "after-reload",
        "ClaimApproved",
        r#"{"claim": "x"}"#,
    )
    .await;

    std::fs::write(dir.path().join("ClaimApproved.json"), "{\"type\": ").expect("write");
    p.signal("HUP");
    wait_for_log(&mut p, "could not apply outbox.schemas", 1).await;
    insert(
        &client,
        "after-bad-reload",
        "ClaimApproved",
        r#"{"claim": "x"}"#,
    )
    .await;
    insert(&client, "good", "ClaimApproved", r#"{"claim": 1}"#).await;

    let all = wait_and_read(&nats, &config.nats.stream, 4).await;
    assert_eq!(by_id(&all, "before").subject, "outbox.Claim");
    let dead = &config.nats.dead_letter_subject;
    assert_eq!(&by_id(&all, "after-reload").subject, dead);
    assert_eq!(
        &by_id(&all, "after-bad-reload").subject,
        dead,
        "the schemas in force stay"
    );
    assert_eq!(by_id(&all, "good").subject, "outbox.Claim");
    let stderr = p.stderr();
    let line = stderr
        .lines()
        .find(|l| l.contains("could not apply outbox.schemas"))
        .expect("the failed reload's line");
    assert!(
        line.contains("ClaimApproved.json: is not JSON"),
        "names the file and the problem: {line}"
    );
    p.signal("TERM");
    assert_eq!(p.wait(LIMIT).and_then(|s| s.code()), Some(0), "{stderr}");
}

/// A directory that does not load stops run, backfill and check-schemas at once with one line
/// naming the setting and the directory; status says what is wrong and is not healthy.
#[tokio::test]
async fn a_missing_directory_at_start_is_a_config_error() {
    let db = text_id_db().await;
    let nats = NatsServer::start();
    let config = relay_config(&db, &nats);
    let mut env = relay_env(&config);
    env.push((
        "OUTBOX_RELAY_OUTBOX_SCHEMAS".into(),
        "/no/such/schema/dir".into(),
    ));
    for cmd in ["run", "backfill", "check-schemas"] {
        let f = run_command(&[cmd], &env, Duration::from_secs(20));
        assert_eq!(f.status.code(), Some(1), "{cmd}: {}", f.stderr);
        let lines: Vec<&str> = f.stderr.lines().collect();
        assert_eq!(lines.len(), 1, "{cmd}: one line: {}", f.stderr);
        assert!(
            lines[0].contains("outbox.schemas")
                && lines[0].contains("/no/such/schema/dir: cannot read the directory"),
            "{cmd}: {}",
            f.stderr
        );
    }
    let f = run_command(&["status"], &env, LIMIT);
    assert_eq!(f.status.code(), Some(1), "{}", f.stdout);
    assert!(
        f.stdout
            .contains("schemas /no/such/schema/dir: DO NOT LOAD: /no/such/schema/dir: cannot read"),
        "{}",
        f.stdout
    );
    // The problem line used to read "refuses to              start" (a line continuation's spaces).
    let problem = f
        .stdout
        .lines()
        .find(|l| l.contains("a running relay keeps the schemas it has"))
        .unwrap_or_else(|| panic!("status names the schemas problem:\n{}", f.stdout));
    assert!(
        problem.contains("a relay started now refuses to start; fix the file, then send SIGHUP")
            && !problem.contains("  "),
        "{problem}"
    );
}

/// docs/security.md, finding 2: a `pattern` that needs backtracking (`^(\w+\s?)*(?<!\s)$` kept the
/// relay's only runtime thread busy for seconds on one 35 KB payload, and the slot stuck) is
/// refused when the schemas load: `run` and `check-schemas` exit 1 at once with one line naming the
/// file, where the pattern is and the pattern; `status` says the directory does not load.
#[tokio::test]
async fn a_backtracking_pattern_is_refused_when_the_schemas_load() {
    let db = text_id_db().await;
    let nats = NatsServer::start();
    let config = relay_config(&db, &nats);
    let schema = serde_json::json!({
        "type": "object",
        "properties": {"note": {"type": "string", "pattern": r"^(\w+\s?)*(?<!\s)$"}}
    });
    let dir = schema_dir(&[("NoteAdded.json", &schema.to_string())]);
    let dir_path = dir.path().to_str().expect("utf-8 path").to_owned();
    let mut env = relay_env(&config);
    env.push(("OUTBOX_RELAY_OUTBOX_SCHEMAS".into(), dir_path.clone()));
    for cmd in ["run", "check-schemas"] {
        let f = run_command(&[cmd], &env, Duration::from_secs(20));
        assert_eq!(f.status.code(), Some(1), "{cmd}: {}", f.stderr);
        let lines: Vec<&str> = f.stderr.lines().collect();
        assert_eq!(lines.len(), 1, "{cmd}: one line: {}", f.stderr);
        assert!(
            lines[0].contains("outbox.schemas")
                && lines[0].contains(&format!(
                    "{dir_path}/NoteAdded.json: /properties/note/pattern: pattern"
                ))
                && lines[0].contains(r#""^(\\w+\\s?)*(?<!\\s)$" is refused"#)
                && lines[0].contains("linear time"),
            "{cmd}: {}",
            f.stderr
        );
    }
    let f = run_command(&["status"], &env, LIMIT);
    assert_eq!(f.status.code(), Some(1), "{}", f.stdout);
    assert!(f.stdout.contains("DO NOT LOAD"), "{}", f.stdout);
}

/// Backfilled rows are checked like live ones: the failing row is a dead letter with its reason.
#[tokio::test]
async fn backfill_checks_the_rows_it_publishes() {
    let db = text_id_db().await;
    let nats = NatsServer::start();
    let dir = schema_dir(&[
        ("ClaimApproved.json", CLAIM_APPROVED),
        ("common.json", COMMON),
    ]);
    let mut config = relay_config(&db, &nats);
    config.outbox.schemas = dir.path().display().to_string();
    let client = db.client().await;
    insert(
        &client,
        "old-ok",
        "ClaimApproved",
        r#"{"claim": 1, "amount": 1}"#,
    )
    .await;
    insert(
        &client,
        "old-bad",
        "ClaimApproved",
        r#"{"claim": 1, "amount": -1}"#,
    )
    .await;
    let settings = config.validate().expect("valid");
    let report = backfill(&settings, BackfillOptions::default(), |_| {})
        .await
        .unwrap_or_else(|e| panic!("{}", outbox_relay::error_chain::error_chain(&e)));
    assert_eq!((report.stored, report.dead_letters), (1, 1));
    let all = read_all(&nats.jetstream().await, &config.nats.stream).await;
    assert_eq!(by_id(&all, "old-ok").subject, "outbox.Claim");
    assert_eq!(
        reason(by_id(&all, "old-bad"), &config),
        "ClaimApproved: /amount: -1 is less than the minimum of 0 (minimum)"
    );
}

/// `check-schemas` on a table with a mix: counts per type, the first failures with id, pointer and
/// keyword, progress on stderr, exit 1; with `--where` selecting only passing rows, exit 0. It
/// publishes nothing and needs no slot.
#[tokio::test]
async fn check_schemas_reports_a_mixed_table() {
    let db = text_id_db().await;
    let nats = NatsServer::start();
    let dir = schema_dir(&[
        ("ClaimApproved.json", CLAIM_APPROVED),
        ("common.json", COMMON),
    ]);
    let config = relay_config(&db, &nats);
    let client = db.client().await;
    client
        .batch_execute(
            "INSERT INTO public.outbox (event_id, aggregate_type, aggregate_id, event_type, payload)
             SELECT 'ok-' || g, 'Claim', g::text, 'ClaimApproved', jsonb_build_object('claim', g, 'amount', g)
             FROM generate_series(1, 2500) g;",
        )
        .await
        .expect("insert");
    insert(
        &client,
        "bad-1",
        "ClaimApproved",
        r#"{"claim": "4711", "amount": 1}"#,
    )
    .await;
    insert(&client, "bad-2", "ClaimApproved", r#"{"claim": 4711}"#).await;
    insert(&client, "other", "ClaimRejected", r#"{}"#).await;
    let mut env = relay_env(&config);
    env.push((
        "OUTBOX_RELAY_OUTBOX_SCHEMAS".into(),
        dir.path().display().to_string(),
    ));
    let f = run_command(&["check-schemas"], &env, LIMIT);
    assert_eq!(f.status.code(), Some(1), "{}\n{}", f.stdout, f.stderr);
    let out = &f.stdout;
    assert!(
        out.contains("check-schemas: 2503 rows of public.outbox against 2 schemas"),
        "{out}"
    );
    assert!(
        out.contains("  ClaimApproved: 2500 pass, 2 fail\n"),
        "{out}"
    );
    assert!(
        out.contains("  ClaimRejected: 1 without a schema (published unchecked)\n"),
        "{out}"
    );
    assert!(
        out.contains(r#"  bad-1: ClaimApproved: /claim: "4711" is not of type "integer" (type)"#),
        "{out}"
    );
    assert!(
        out.contains(
            r#"  bad-2: ClaimApproved: (root): "amount" is a required property (required)"#
        ),
        "{out}"
    );
    assert!(out.contains("2 of 2503 rows fail"), "{out}");
    assert!(
        f.stderr.contains("check-schemas: 2503/2503 rows, 2 fail"),
        "{}",
        f.stderr
    );

    let f = run_command(
        &["check-schemas", "--where", "event_id LIKE 'ok-%'"],
        &env,
        LIMIT,
    );
    assert_eq!(f.status.code(), Some(0), "{}\n{}", f.stdout, f.stderr);
    assert!(f.stdout.contains("all 2500 rows pass"), "{}", f.stdout);
    // Read only: no slot, nothing published.
    assert!(!crate::support::slot_exists(&client, &config.postgres.slot).await);
}
