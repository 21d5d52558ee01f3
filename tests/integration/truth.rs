//! Operator truth (P8 and P9 in docs/guarantees.md; `status` in docs/operations.md): what the relay
//! tells an operator must be true. A lost
//! slot behind a stream that holds events is never replaced quietly (`run` names `backfill`); a
//! failed `setup` leaves nothing behind; `status` calls a stopped relay with waiting events, a NATS
//! that is down or lacks JetStream, an unreachable Postgres and a stream that does not cover the
//! subjects by their names, and prints JSON even then; Kubernetes' variables do not stop the relay
//! and a misspelt one is named; a bad `log.level` is a config error; a JSON-logging failure still
//! ends with the plain line; logs in a file carry no colour codes; the `in_flight` gauge never
//! passes `max_in_flight`.

use std::time::Duration;

use async_nats::jetstream::stream;
use serde_json::Value;
use tokio_postgres::Client;

use crate::hostile::wait_for_active_slot;
use crate::ops::free_addr;
use crate::support::{
    Finished, InProcessRelay, NatsServer, PgServer, RelayProcess, Scenario, TestDb, run_command,
    slot_exists, unique, wait_for,
};

const LIMIT: Duration = Duration::from_secs(60);

/// A database with the text-id outbox, a JetStream server and the relay's configuration.
async fn text_ids() -> Scenario {
    Scenario::builder().text_ids().start().await
}

pub(crate) async fn good(client: &Client, id: &str) {
    client
        .execute(
            "INSERT INTO public.outbox (event_id, aggregate_type, aggregate_id, event_type, payload) \
             VALUES ($1, 'Claim', '4711', 'ClaimApproved', '{\"claim_id\": 4711}')",
            &[&id],
        )
        .await
        .unwrap_or_else(|e| panic!("insert {id}: {e}"));
}

pub(crate) fn set(env: &mut Vec<(String, String)>, key: &str, value: &str) {
    env.retain(|(k, _)| k != key);
    env.push((key.into(), value.into()));
}

async fn publication_exists(client: &Client, name: &str) -> bool {
    client
        .query_opt("SELECT 1 FROM pg_publication WHERE pubname = $1", &[&name])
        .await
        .expect("query pg_publication")
        .is_some()
}

pub(crate) fn json(f: &Finished) -> Value {
    serde_json::from_str(&f.stdout).unwrap_or_else(|e| {
        panic!(
            "status --json printed no JSON ({e}): {}\n{}",
            f.stdout, f.stderr
        )
    })
}

/// P9: the relay published A and stopped; B was committed; the slot was dropped. `run` must not
/// create a new slot (which would start after B, so B would never be published): it exits 1 naming
/// `backfill`, and no slot exists afterwards. On a first start with an empty stream the slot is
/// still created without asking.
#[tokio::test]
async fn lost_slot_behind_a_stream_with_events_needs_backfill() {
    let s = text_ids().await;
    let (client, slot) = (&s.client, &s.slot);
    assert!(!slot_exists(client, slot).await);

    // First start, empty stream: the slot is created on its own.
    let relay = InProcessRelay::start(s.config.clone());
    wait_for_active_slot(client, slot).await;
    assert!(!relay.is_finished());
    good(client, "a").await;
    wait_for("event a", LIMIT, || async { s.count().await == 1 }).await;
    relay.stop().await.expect("the relay stops cleanly");

    good(client, "b").await;
    client
        .execute("SELECT pg_drop_replication_slot($1)", &[slot])
        .await
        .expect("drop the slot");
    let f = run_command(&["run"], &s.env(), LIMIT);
    assert_eq!(f.status.code(), Some(1), "{}", f.stderr);
    let last = f.stderr.trim().lines().last().unwrap_or("").to_owned();
    assert!(
        last.contains("backfill"),
        "names the recovery: {}",
        f.stderr
    );
    assert!(last.contains(slot.as_str()), "names the slot: {last}");
    assert!(
        !slot_exists(client, slot).await,
        "no slot was created quietly"
    );
    assert_eq!(s.count().await, 1);
}

/// Stream sizing and P9: `setup` creates the stream with the configured age and size limits, and a
/// stream whose age limit has removed every event still counts as holding this outbox's events (its
/// metadata names the slot): a lost slot behind it needs `backfill`, it is never replaced quietly.
#[tokio::test]
async fn a_stream_emptied_by_its_limits_still_guards_a_lost_slot() {
    let s = Scenario::builder()
        .text_ids()
        .config(|c| {
            c.nats.max_age_secs = 2;
            c.nats.duplicate_window_secs = 1;
            c.nats.max_bytes = 10 << 20;
        })
        .start()
        .await;
    let settings = s.config.validate().expect("valid");
    let (client, slot) = (&s.client, &s.slot);
    outbox_relay::setup::setup(&settings).await.expect("setup");
    let info =
        s.js.get_stream(&s.stream)
            .await
            .expect("stream")
            .info()
            .await
            .expect("info")
            .clone();
    assert_eq!(info.config.max_age, Duration::from_secs(2));
    assert_eq!(info.config.max_bytes, 10 << 20);
    assert_eq!(info.config.discard, stream::DiscardPolicy::New);

    let relay = InProcessRelay::start(s.config.clone());
    good(client, "a").await;
    wait_for("event a", LIMIT, || async { s.count().await == 1 }).await;
    relay.stop().await.expect("the relay stops cleanly");
    wait_for("the age limit to remove event a", LIMIT, || async {
        s.count().await == 0
    })
    .await;

    client
        .execute("SELECT pg_drop_replication_slot($1)", &[slot])
        .await
        .expect("drop the slot");
    let e = outbox_relay::setup::setup(&settings).await.unwrap_err();
    let text = e.to_string();
    assert!(text.contains("backfill"), "names the recovery: {text}");
    assert!(
        !slot_exists(client, slot).await,
        "no slot was created behind an emptied stream"
    );
}

/// P8: a `setup` that fails leaves no slot, no publication and no stream behind: a stream with 3
/// replicas on a single server, and a stream whose subjects overlap another stream's.
#[tokio::test]
async fn failed_setup_leaves_nothing_behind() {
    let s = text_ids().await;
    let (js, config) = (&s.js, &s.config);
    let nothing_left = |what: &'static str| {
        let client = &s.client;
        async move {
            assert!(
                !slot_exists(client, &config.postgres.slot).await,
                "{what}: a slot was left"
            );
            assert!(
                !publication_exists(client, &config.postgres.publication).await,
                "{what}: a publication was left"
            );
            assert!(
                js.get_stream(&config.nats.stream).await.is_err(),
                "{what}: a stream was left"
            );
        }
    };

    let mut env = s.env();
    set(&mut env, "OUTBOX_RELAY_NATS_STREAM_REPLICAS", "3");
    let f = run_command(&["setup"], &env, LIMIT);
    assert_eq!(
        f.status.code(),
        Some(1),
        "replicas 3 on one server: {}",
        f.stderr
    );
    assert!(
        f.stderr.contains(&config.nats.stream),
        "names the stream: {}",
        f.stderr
    );
    nothing_left("stream_replicas = 3").await;

    js.create_stream(stream::Config {
        name: "OTHER_APP".into(),
        subjects: vec!["outbox.>".into()],
        ..Default::default()
    })
    .await
    .expect("another application's stream");
    let f = run_command(&["setup"], &s.env(), LIMIT);
    assert_eq!(
        f.status.code(),
        Some(1),
        "overlapping subjects: {}",
        f.stderr
    );
    let line = f.stderr.trim().lines().last().unwrap_or("").to_owned();
    assert!(
        line.contains(&config.nats.stream) && line.to_lowercase().contains("overlap"),
        "names the stream and the overlap: {line}"
    );
    nothing_left("subjects overlap").await;
    // The other stream is untouched.
    assert!(js.get_stream("OTHER_APP").await.is_ok());
}

/// `status`: idle slot with nothing waiting → healthy; events waiting with no relay → exit 1 and a
/// line saying so; a subject template the stream does not cover → unhealthy; NATS stopped →
/// `stream.state = "unreachable"`; NATS without JetStream → `"jetstream_disabled"`; Postgres
/// unreachable → still JSON, `postgres.state = "unreachable"`.
#[tokio::test]
async fn status_tells_each_failure_by_its_name() {
    let s = text_ids().await;
    let env = s.env();
    let setup = run_command(&["setup"], &env, LIMIT);
    assert_eq!(setup.status.code(), Some(0), "{}", setup.stderr);

    // Idle slot, nothing waiting, but no relay has held it for longer than the grace period
    // (`relay_env`: 1 s): not healthy, and not for waiting events.
    let f = run_command(&["status", "--json"], &env, LIMIT);
    assert_eq!(f.status.code(), Some(1), "{}", f.stdout);
    assert_eq!(json(&f)["healthy"], Value::Bool(false));
    assert_eq!(
        json(&f)["slot"]["events_waiting"],
        Value::Bool(false),
        "{}",
        f.stdout
    );

    good(&s.client, "waiting-1").await;
    let f = run_command(&["status"], &env, LIMIT);
    assert_eq!(
        f.status.code(),
        Some(1),
        "an event waits, no relay: {}",
        f.stdout
    );
    assert!(
        f.stdout.contains("no relay streams slot")
            && f.stdout.contains("while 1 event waits in it"),
        "{}",
        f.stdout
    );
    let f = run_command(&["status", "--json"], &env, LIMIT);
    assert_eq!(
        json(&f)["slot"]["events_waiting"],
        Value::Bool(true),
        "{}",
        f.stdout
    );

    let mut other_subject = env.clone();
    set(
        &mut other_subject,
        "OUTBOX_RELAY_NATS_SUBJECT",
        "events.{aggregate_type}",
    );
    let f = run_command(&["status", "--json"], &other_subject, LIMIT);
    assert_eq!(f.status.code(), Some(1), "{}", f.stdout);
    let v = json(&f);
    assert!(
        v["problems"]
            .as_array()
            .unwrap()
            .iter()
            .any(|p| p.as_str().unwrap_or("").contains("events.*")),
        "a problem names the uncovered subject: {v:#}"
    );

    let mut no_pg = env.clone();
    set(
        &mut no_pg,
        "OUTBOX_RELAY_POSTGRES_URL",
        &format!("postgres://postgres@{}/x", free_addr()),
    );
    let f = run_command(&["status", "--json"], &no_pg, LIMIT);
    assert_eq!(f.status.code(), Some(1));
    assert_eq!(json(&f)["postgres"]["state"], "unreachable", "{}", f.stdout);

    let plain = NatsServer::start_without_jetstream();
    let mut no_js = env.clone();
    set(&mut no_js, "OUTBOX_RELAY_NATS_URL", &plain.url());
    let f = run_command(&["status", "--json"], &no_js, LIMIT);
    assert_eq!(f.status.code(), Some(1));
    assert_eq!(
        json(&f)["stream"]["state"],
        "jetstream_disabled",
        "{}",
        f.stdout
    );

    s.nats.stop();
    let f = run_command(&["status", "--json"], &env, LIMIT);
    assert_eq!(f.status.code(), Some(1));
    let v = json(&f);
    assert_eq!(v["stream"]["state"], "unreachable", "{v:#}");
    assert_eq!(v["postgres"]["state"], "exists", "{v:#}");
}

/// Environment: Kubernetes' `OUTBOX_RELAY_SERVICE_HOST`/`_PORT` do not stop the relay; a near miss
/// (`OUTBOX_RELAY_NATS_STREEM`) is a warning naming the real variable. Text logs written to a file
/// carry no ANSI escape codes.
#[tokio::test]
async fn kubernetes_variables_run_a_near_miss_warns_file_logs_are_plain() {
    let s = text_ids().await;
    let mut env = s.env();
    set(&mut env, "OUTBOX_RELAY_SERVICE_HOST", "10.0.0.1");
    set(&mut env, "OUTBOX_RELAY_SERVICE_PORT", "9187");
    set(
        &mut env,
        "OUTBOX_RELAY_PORT_9187_TCP",
        "tcp://10.0.0.1:9187",
    );
    set(&mut env, "OUTBOX_RELAY_NATS_STREEM", "TYPO");
    let mut p = RelayProcess::spawn(&["run"], &env);
    wait_for_active_slot(&s.client, &s.slot).await;
    good(&s.client, "k8s-1").await;
    wait_for("the event", LIMIT, || async { s.count().await == 1 }).await;
    p.signal("TERM");
    assert_eq!(
        p.wait(LIMIT).and_then(|s| s.code()),
        Some(0),
        "{}",
        p.stderr()
    );
    let stderr = p.stderr();
    let warning: Vec<&str> = stderr
        .lines()
        .filter(|l| l.contains("OUTBOX_RELAY_NATS_STREEM"))
        .collect();
    assert_eq!(warning.len(), 1, "{stderr}");
    assert!(
        warning[0].contains("OUTBOX_RELAY_NATS_STREAM"),
        "{}",
        warning[0]
    );
    assert!(warning[0].contains("WARN"), "{}", warning[0]);
    assert!(
        !stderr.contains("SERVICE_HOST"),
        "no warning for Kubernetes' variables: {stderr}"
    );
    assert!(
        !stderr.contains('\u{1b}'),
        "no ANSI escapes in a log file: {stderr:?}"
    );
}

/// `log.level = "loud"` is a config error naming `log.level`; with JSON logs a failing command still
/// ends with the plain `outbox-relay: …` line.
#[tokio::test]
async fn bad_log_level_and_json_log_failures_end_with_the_plain_line() {
    let f = run_command(
        &["status"],
        &[("OUTBOX_RELAY_LOG_LEVEL".into(), "loud".into())],
        LIMIT,
    );
    assert_eq!(f.status.code(), Some(1), "{}", f.stderr);
    assert!(f.stderr.contains("log.level"), "{}", f.stderr);

    // A database that does not exist: a definite error (`run` waits for an unreachable server).
    let env = vec![
        ("OUTBOX_RELAY_LOG_FORMAT".to_owned(), "json".to_owned()),
        (
            "OUTBOX_RELAY_POSTGRES_URL".to_owned(),
            PgServer::shared().url(&unique("no_such_db")),
        ),
        ("OUTBOX_RELAY_HTTP_LISTEN".to_owned(), String::new()),
    ];
    for args in [&["run"][..], &["setup"]] {
        let f = run_command(args, &env, LIMIT);
        assert_eq!(f.status.code(), Some(1), "{args:?}: {}", f.stderr);
        let lines: Vec<&str> = f.stderr.lines().filter(|l| !l.trim().is_empty()).collect();
        let last = lines.last().copied().unwrap_or("");
        assert!(
            last.starts_with("outbox-relay: "),
            "{args:?}: ends with the plain line: {}",
            f.stderr
        );
        assert!(last.contains("postgres.url"), "{last}");
        for l in &lines[..lines.len() - 1] {
            serde_json::from_str::<Value>(l)
                .unwrap_or_else(|e| panic!("{args:?}: not JSON ({e}): {l}"));
        }
    }
}

/// `outbox_relay_in_flight` never exceeds `nats.max_in_flight` while a backlog drains, for windows of
/// 1 to 4 (sampled every millisecond).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_flight_gauge_never_exceeds_max_in_flight() {
    let s = text_ids().await;
    let mut config = s.config.clone();
    // The slot first, so the backlog written before each relay starts is in it.
    let setup = run_command(&["setup"], &s.env(), LIMIT);
    assert_eq!(setup.status.code(), Some(0), "{}", setup.stderr);
    let mut total = 0u64;
    for max in 1..=4usize {
        crate::faults::write_backlog(&s.db, &format!("w{max}"), 300);
        total += 300;
        config.nats.max_in_flight = max;
        let relay = InProcessRelay::start(config.clone());
        let mut peak = 0;
        let deadline = std::time::Instant::now() + LIMIT;
        while s.count().await < total {
            for _ in 0..50 {
                peak = peak.max(relay.metrics.in_flight.get());
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            assert!(!relay.is_finished(), "the relay stopped");
            assert!(
                std::time::Instant::now() < deadline,
                "backlog {max} not drained"
            );
        }
        eprintln!("max_in_flight {max}: peak in_flight gauge {peak}");
        assert!(peak <= max as u64, "in_flight {peak} > max_in_flight {max}");
        assert!(peak >= 1, "the gauge moved while {max} drained");
        relay.stop().await.expect("the relay stops cleanly");
    }
}

/// libpq conventions: a URL without a password takes it from `PGPASSWORD` or from the password file
/// (`PGPASSFILE`, ignored unless it is a regular file only its owner can read); without either, the
/// failure says a password is required.
#[tokio::test]
async fn libpq_environment_and_password_file_supply_the_password() {
    let s = text_ids().await;
    let server = PgServer::shared();
    let url = format!(
        "postgres://scram_user@{}:{}/{}?sslmode=disable",
        server.host(),
        server.port(),
        s.db.name()
    );
    let mut env = s.env();
    env.retain(|(k, _)| k != "OUTBOX_RELAY_POSTGRES_URL");
    env.push(("OUTBOX_RELAY_POSTGRES_URL".into(), url));
    // No password anywhere (HOME points at an empty directory: no ~/.pgpass).
    let home = tempfile::tempdir().unwrap();
    env.push(("HOME".into(), home.path().display().to_string()));
    let state = |f: &Finished| {
        json(f)["postgres"]["state"]
            .as_str()
            .unwrap_or("")
            .to_owned()
    };
    let f = run_command(&["status", "--json"], &env, LIMIT);
    // No password to give: authentication, not reachability, is what failed.
    assert_eq!(state(&f), "auth_failed", "{}", f.stdout);
    assert!(f.stdout.contains("password required"), "{}", f.stdout);

    let mut with_env = env.clone();
    with_env.push(("PGPASSWORD".into(), "scram_pw".into()));
    let f = run_command(&["status", "--json"], &with_env, LIMIT);
    assert_eq!(
        state(&f),
        "exists",
        "PGPASSWORD: {}\n{}",
        f.stdout,
        f.stderr
    );

    let passfile = home.path().join("pgpass");
    std::fs::write(&passfile, "*:*:*:scram_user:scram_pw\n").unwrap();
    let mut with_file = env.clone();
    with_file.push(("PGPASSFILE".into(), passfile.display().to_string()));
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&passfile, std::fs::Permissions::from_mode(0o644)).unwrap();
    let f = run_command(&["status", "--json"], &with_file, LIMIT);
    assert_eq!(
        state(&f),
        "auth_failed",
        "a world-readable password file is ignored: {}",
        f.stdout
    );
    std::fs::set_permissions(&passfile, std::fs::Permissions::from_mode(0o600)).unwrap();
    let f = run_command(&["status", "--json"], &with_file, LIMIT);
    assert_eq!(
        state(&f),
        "exists",
        "PGPASSFILE: {}\n{}",
        f.stdout,
        f.stderr
    );
    assert!(!f.stdout.contains("scram_pw") && !f.stderr.contains("scram_pw"));

    // A FIFO in the password file's place: opening it would block until someone writes, so it is
    // ignored with a warning instead (the command finishes within LIMIT).
    let fifo = home.path().join("pgpass.fifo");
    let made = std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap();
    assert!(made.success());
    let mut with_fifo = env.clone();
    with_fifo.push(("PGPASSFILE".into(), fifo.display().to_string()));
    let f = run_command(&["status", "--json"], &with_fifo, LIMIT);
    assert_eq!(state(&f), "auth_failed", "{}", f.stdout);
    assert!(
        f.stderr.contains("not a regular file"),
        "the FIFO is named: {}",
        f.stderr
    );
}

/// The shipped `sql/01_outbox_table.sql` on a fresh database says nothing untrue: no NOTICE that a
/// column "already exists" (the script adds `headers` to tables made before it existed).
#[tokio::test]
async fn the_outbox_table_script_is_quiet_on_a_fresh_install() {
    let server = PgServer::shared();
    let db = TestDb::create(server).await;
    let out = std::process::Command::new(server.client_bin_dir().join("psql"))
        .args([
            "-X",
            "-q",
            "-v",
            "ON_ERROR_STOP=1",
            "-h",
            server.host(),
            "-U",
            "postgres",
        ])
        .args(["-p", &server.port().to_string(), "-d", db.name(), "-f"])
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/sql/01_outbox_table.sql"
        ))
        .output()
        .expect("run psql");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.trim().is_empty(),
        "psql printed on a fresh install: {stderr}"
    );
}

/// `setup` on a table that already holds rows says that `run` will not publish them and names
/// `backfill`; on an empty table it says nothing of the kind.
#[tokio::test]
async fn setup_on_a_table_with_rows_names_backfill() {
    for rows in [false, true] {
        let s = text_ids().await;
        if rows {
            good(&s.client, "written-before-setup").await;
        }
        let settings = s.config.validate().expect("valid");
        let report = outbox_relay::setup::setup(&settings).await.expect("setup");
        let warned = report
            .warnings
            .iter()
            .any(|w| w.text.contains("already holds rows") && w.text.contains("backfill"));
        assert_eq!(warned, rows, "rows {rows}: {:?}", report.warnings);
    }
}

/// `--version` names the release and the commit the binary was built from (what `git` says HEAD
/// is, when the tests run in the repository the binary was built in).
#[test]
fn version_names_the_commit() {
    let f = run_command(&["--version"], &[], LIMIT);
    assert!(f.status.success(), "{}", f.stderr);
    let line = f.stdout.trim();
    assert!(
        line.starts_with(&format!(
            "outbox-relay {} (commit ",
            env!("CARGO_PKG_VERSION")
        )),
        "{line}"
    );
    let head = std::process::Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned());
    match head {
        Some(head) => assert!(line.contains(&head), "{line} is not HEAD {head}"),
        None => assert!(line.ends_with(')'), "{line}"),
    }
}
