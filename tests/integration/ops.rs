//! Operability (docs/operations.md): what an operator sees of a running relay.
//! The metrics move while events flow
//! and freeze while NATS is down; `/readyz` follows the connections; `status --json` has the shape the
//! docs promise and its exit code follows health; logs never show a password, and the JSON log format
//! is JSON on every line; an HTTP address in use is one clear line; a standby says so.
//!
//! The HTTP side is read with a plain HTTP/1.0 GET over a TCP socket, as a probe or a scraper would.

use std::time::{Duration, Instant};

use serde_json::Value;
use tokio_postgres::Client;

use crate::hostile::wait_for_active_slot;
use crate::support::{
    Finished, InProcessRelay, PgServer, RelayProcess, Scenario, run_command, slot_exists,
    stream_count, unique, wait_for,
};
pub(crate) use crate::support::{free_addr, http_get as try_get};

const LIMIT: Duration = Duration::from_secs(60);

async fn get(addr: &str, path: &str) -> (u16, String) {
    try_get(addr, path)
        .await
        .unwrap_or_else(|| panic!("GET {path} on {addr} failed"))
}

pub(crate) async fn scrape(addr: &str) -> String {
    let (status, body) = get(addr, "/metrics").await;
    assert_eq!(status, 200, "/metrics: {body}");
    body
}

/// The value of one series, e.g. `outbox_relay_in_flight` or `x_total{outcome="ok"}`.
fn sample(body: &str, series: &str) -> Option<f64> {
    body.lines().find_map(|l| {
        l.strip_prefix(series)
            .and_then(|rest| rest.strip_prefix(' '))
            .map(|v| {
                v.trim()
                    .parse()
                    .unwrap_or_else(|e| panic!("{series}: {v:?}: {e}"))
            })
    })
}

fn value(body: &str, series: &str) -> f64 {
    sample(body, series).unwrap_or_else(|| panic!("no series {series} in:\n{body}"))
}

const OK: &str = "outbox_relay_events_published_total{outcome=\"ok\"}";
const ACK_COUNT: &str = "outbox_relay_commit_to_ack_seconds_count";
const CONFIRMED: &str = "outbox_relay_confirmed_lsn";
const SINCE_ACK: &str = "outbox_relay_seconds_since_last_ack";
const LAG: &str = "outbox_relay_slot_lag_bytes";
const RESERVED: &str = "outbox_relay_slot_wal_status{status=\"reserved\"}";

/// Waits until the series reaches `at_least`, or panics with the last scrape.
async fn wait_for_series(addr: &str, series: &str, at_least: f64, secs: u64) -> String {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        let body = scrape(addr).await;
        if sample(&body, series).is_some_and(|v| v >= at_least) {
            return body;
        }
        assert!(
            Instant::now() < deadline,
            "{series} did not reach {at_least} within {secs} s:\n{body}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

pub(crate) async fn wait_for_status(addr: &str, path: &str, want: u16, secs: u64) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        let got = try_get(addr, path).await;
        if got.as_ref().is_some_and(|(s, _)| *s == want) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{path} did not answer {want} within {secs} s; last: {got:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A text-id outbox, a JetStream server and the relay's configuration, with `http.listen` at
/// `addr` when given.
async fn text_ids(addr: Option<&str>) -> Scenario {
    let builder = Scenario::builder().text_ids();
    match addr {
        Some(addr) => builder.http_listen(addr).start().await,
        None => builder.start().await,
    }
}

async fn insert_events(client: &Client, ids: &[String]) {
    for id in ids {
        client
            .execute(
                "INSERT INTO public.outbox (event_id, aggregate_type, aggregate_id, event_type, payload) \
                 VALUES ($1, 'Claim', '4711', 'ClaimApproved', '{\"claim_id\": 4711}')",
                &[id],
            )
            .await
            .unwrap_or_else(|e| panic!("insert {id}: {e}"));
    }
}

fn ids(prefix: &str, n: usize) -> Vec<String> {
    (0..n).map(|i| format!("{prefix}-{i}")).collect()
}

/// The counters and the latency histogram move with the events and the confirmed LSN with the slot;
/// during a NATS outage the ok counter stands still while the seconds since the last ack grow and the
/// sampled slot lag shows the unconfirmed WAL; after it every event is counted once.
#[tokio::test]
async fn metrics_move_while_events_flow_and_freeze_while_nats_is_down() {
    let addr = free_addr();
    let s = text_ids(Some(&addr)).await;
    let (nats, slot) = (&s.nats, s.slot.clone());
    let client = s.db.client().await;
    let relay = InProcessRelay::start(s.config.clone());
    wait_for_status(&addr, "/readyz", 200, 60).await;
    wait_for_active_slot(&client, &slot).await;

    let before = scrape(&addr).await;
    assert_eq!(value(&before, OK), 0.0, "{before}");
    assert_eq!(value(&before, ACK_COUNT), 0.0, "{before}");
    assert_eq!(value(&before, SINCE_ACK), -1.0, "no ack yet: {before}");
    let confirmed_before = value(&before, CONFIRMED);

    insert_events(&client, &ids("m", 5)).await;
    let flowing = wait_for_series(&addr, OK, 5.0, 30).await;
    assert_eq!(value(&flowing, OK), 5.0, "{flowing}");
    assert!(value(&flowing, ACK_COUNT) >= 5.0, "{flowing}");
    // The confirmed LSN follows the acks; the status writer may confirm a moment later.
    wait_for_series(&addr, CONFIRMED, confirmed_before + 1.0, 10).await;
    // The slot sampler runs every 5 s.
    let sampled = wait_for_series(&addr, RESERVED, 1.0, 12).await;
    assert!(sample(&sampled, LAG).is_some(), "{sampled}");

    // NATS goes down; events keep coming.
    nats.stop();
    insert_events(&client, &ids("n", 3)).await;
    let down = Instant::now();
    let first = scrape(&addr).await;
    let since_first = value(&first, SINCE_ACK);
    // Stand still for at least 3 s, and until the sampler has seen the unconfirmed WAL.
    let mut lagging = false;
    let mut last = first.clone();
    while down.elapsed() < Duration::from_secs(3) || !lagging {
        assert!(
            down.elapsed() < Duration::from_secs(15),
            "slot lag stayed 0 for 15 s with 3 unacknowledged events:\n{last}"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
        last = scrape(&addr).await;
        assert_eq!(
            value(&last, OK),
            5.0,
            "ok counter moved while NATS was down"
        );
        lagging = value(&last, LAG) > 0.0;
    }
    let since_last = value(&last, SINCE_ACK);
    assert!(
        since_last >= since_first + 2.5,
        "seconds since the last ack did not grow during the outage: {since_first} -> {since_last}"
    );
    assert!(
        value(&last, "outbox_relay_reconnects_total{cause=\"nats\"}") >= 1.0,
        "{last}"
    );

    nats.start_again();
    let after = wait_for_series(&addr, OK, 8.0, 60).await;
    assert_eq!(value(&after, OK), 8.0, "every event counted once: {after}");
    assert!(value(&after, ACK_COUNT) >= 8.0, "{after}");
    assert!(
        value(&after, SINCE_ACK) < since_last,
        "an ack arrived: {after}"
    );
    relay.stop().await.expect("relay stops cleanly");
}

/// `/readyz` follows the NATS connection (503 while it is down, 200 when it is back); `/healthz` stays
/// 200 as long as the process runs; anything else is 404.
#[tokio::test]
async fn readyz_follows_nats_healthz_stays_up_unknown_path_is_404() {
    let addr = free_addr();
    let s = text_ids(Some(&addr)).await;
    let nats = &s.nats;
    let relay = InProcessRelay::start(s.config.clone());
    wait_for_status(&addr, "/readyz", 200, 60).await;
    assert_eq!(get(&addr, "/healthz").await.0, 200);
    let (status, body) = get(&addr, "/nope").await;
    assert_eq!(status, 404, "{body}");

    nats.stop();
    wait_for_status(&addr, "/readyz", 503, 10).await;
    let (_, why) = get(&addr, "/readyz").await;
    assert!(why.contains("nats"), "the 503 says why: {why}");
    assert_eq!(
        get(&addr, "/healthz").await.0,
        200,
        "healthz while NATS is down"
    );

    nats.start_again();
    wait_for_status(&addr, "/readyz", 200, 60).await;
    assert_eq!(get(&addr, "/healthz").await.0, 200);
    relay.stop().await.expect("relay stops cleanly");
}

fn status_json(f: &Finished) -> Value {
    serde_json::from_str(&f.stdout).unwrap_or_else(|e| {
        panic!(
            "status --json is not JSON ({e}):\n{}\nstderr: {}",
            f.stdout, f.stderr
        )
    })
}

/// Panics unless `v[key]` exists and `is` says it has the right type.
fn assert_key(v: &Value, path: &str, key: &str, is: fn(&Value) -> bool) {
    let got = v
        .get(key)
        .unwrap_or_else(|| panic!("status --json has no {path}.{key}: {v:#}"));
    assert!(is(got), "{path}.{key} has the wrong type: {got}");
}

fn is_number_or_null(v: &Value) -> bool {
    v.is_i64() || v.is_null()
}

fn is_string_or_null(v: &Value) -> bool {
    v.is_string() || v.is_null()
}

/// `status --json`: every documented key with its type; exit 0 when healthy; exit 1 when the slot is
/// gone; exit 1 when NATS cannot be reached, with the slot still reported.
#[tokio::test]
async fn status_json_has_its_shape_and_exit_code_follows_health() {
    let s = Scenario::builder().default_outbox().start().await;
    let (db, config) = (&s.db, &s.config);
    let env = s.env();
    let slot = s.slot.clone();
    let setup = run_command(&["setup"], &env, LIMIT);
    assert!(setup.status.success(), "setup: {}", setup.stderr);

    // No relay has held the slot since setup, longer than the grace period (`relay_env`: 1 s): the
    // one problem, with nothing waiting.
    let idle = run_command(&["status", "--json"], &env, LIMIT);
    assert_eq!(idle.status.code(), Some(1), "{}", idle.stderr);
    let json = status_json(&idle);
    for key in [
        "healthy",
        "slot",
        "publication",
        "stream",
        "problems",
        "warnings",
    ] {
        assert!(json.get(key).is_some(), "no top-level {key}: {json:#}");
    }
    assert_eq!(json["healthy"], Value::Bool(false));
    let problems = json["problems"].as_array().expect("problems");
    assert_eq!(problems.len(), 1, "{json:#}");
    assert!(
        problems[0].as_str().unwrap_or("").contains("no relay"),
        "{json:#}"
    );
    assert!(json["warnings"].is_array());
    let s = &json["slot"];
    assert_eq!(s["events_waiting"], Value::Bool(false), "{json:#}");
    assert_eq!(s["waiting_events"], 0, "{json:#}");
    assert!(s["unheld_secs"].is_u64(), "{json:#}");
    assert_key(s, "slot", "exists", Value::is_boolean);
    assert_key(s, "slot", "active", Value::is_boolean);
    assert_key(s, "slot", "confirmed_flush_lsn", Value::is_string);
    assert_key(s, "slot", "lag_bytes", Value::is_i64);
    assert_key(s, "slot", "wal_status", Value::is_string);
    assert_key(s, "slot", "safe_wal_size", is_number_or_null);
    assert_eq!(s["exists"], Value::Bool(true));
    assert_eq!(s["active"], Value::Bool(false), "no relay runs");
    assert_eq!(s["wal_status"], "reserved");
    assert!(
        s["confirmed_flush_lsn"]
            .as_str()
            .unwrap()
            .parse::<outbox_relay::Lsn>()
            .is_ok(),
        "{s}"
    );
    let p = &json["publication"];
    assert_key(p, "publication", "exists", Value::is_boolean);
    assert_key(p, "publication", "tables", Value::is_array);
    assert_eq!(p["exists"], Value::Bool(true));
    assert_eq!(p["tables"], serde_json::json!(["public.outbox"]));
    let st = &json["stream"];
    for (key, is) in [
        ("exists", Value::is_boolean as fn(&Value) -> bool),
        ("messages", Value::is_u64),
        ("last_sequence", Value::is_u64),
        ("storage", Value::is_string),
        ("replicas", Value::is_u64),
        ("duplicate_window_secs", Value::is_u64),
    ] {
        assert_key(st, "stream", key, is);
    }
    assert_eq!(st["exists"], Value::Bool(true));
    assert_eq!(st["messages"], 0);
    assert_eq!(st["storage"], "file");
    assert_eq!(st["replicas"], 1);
    assert_eq!(
        st["duplicate_window_secs"],
        config.nats.duplicate_window_secs
    );

    // NATS unreachable: unhealthy, the problem names it, the slot is still there.
    let mut no_nats = env.clone();
    no_nats.retain(|(k, _)| k != "OUTBOX_RELAY_NATS_URL");
    no_nats.push((
        "OUTBOX_RELAY_NATS_URL".into(),
        format!("nats://{}", free_addr()),
    ));
    let down = run_command(&["status", "--json"], &no_nats, LIMIT);
    assert_eq!(
        down.status.code(),
        Some(1),
        "{}{}",
        down.stdout,
        down.stderr
    );
    let json = status_json(&down);
    assert_eq!(json["healthy"], Value::Bool(false));
    assert_eq!(json["slot"]["exists"], Value::Bool(true), "{json:#}");
    assert!(json["slot"]["confirmed_flush_lsn"].is_string(), "{json:#}");
    assert_eq!(json["slot"]["wal_status"], "reserved", "{json:#}");
    let problems = json["problems"].as_array().expect("problems");
    assert!(
        problems
            .iter()
            .any(|p| p.as_str().unwrap_or("").contains("nats.url")),
        "a problem names nats.url: {json:#}"
    );

    // The slot is dropped: unhealthy, and the slot part says so.
    db.psql(&format!("SELECT pg_drop_replication_slot('{slot}')"));
    let gone = run_command(&["status", "--json"], &env, LIMIT);
    assert_eq!(
        gone.status.code(),
        Some(1),
        "{}{}",
        gone.stdout,
        gone.stderr
    );
    let json = status_json(&gone);
    assert_eq!(json["healthy"], Value::Bool(false));
    assert_eq!(json["slot"]["exists"], Value::Bool(false));
    assert_key(
        &json["slot"],
        "slot",
        "confirmed_flush_lsn",
        is_string_or_null,
    );
    assert!(
        json["problems"]
            .as_array()
            .unwrap()
            .iter()
            .any(|p| p.as_str().unwrap_or("").contains(&slot)),
        "a problem names the slot: {json:#}"
    );
    assert_eq!(json["stream"]["exists"], Value::Bool(true));
}

const PG_PASSWORD: &str = "S3cretPw!";
const NATS_PASSWORD: &str = "N4tsPw";
const WRONG_PASSWORD: &str = "Wr0ngSecret";

/// Panics if any password appears in the output, plainly or URL-encoded.
fn assert_no_secret(what: &str, f: &Finished) {
    for secret in ["S3cretPw", NATS_PASSWORD, WRONG_PASSWORD] {
        for (stream, text) in [("stdout", &f.stdout), ("stderr", &f.stderr)] {
            assert!(
                !text.contains(secret),
                "{what}: {stream} shows the password {secret}:\n{text}"
            );
        }
    }
}

fn set(env: &mut Vec<(String, String)>, key: &str, value: &str) {
    env.retain(|(k, _)| k != key);
    env.push((key.into(), value.into()));
}

/// Runs the binary's `run` until it streams, writes one event, waits for it, sends SIGTERM.
async fn run_with_one_event(
    env: &[(String, String)],
    client: &Client,
    js: &async_nats::jetstream::Context,
    slot: &str,
    stream: &str,
    id: &str,
) -> Finished {
    let mut p = RelayProcess::spawn(&["run"], env);
    wait_for_active_slot(client, slot).await;
    let before = stream_count(js, stream).await;
    insert_events(client, &[id.to_owned()]).await;
    wait_for("the event in the stream", LIMIT, || async {
        stream_count(js, stream).await > before
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    p.terminate(Duration::from_secs(30))
}

/// Runs the binary's `run` until it logs that it waits for a server at start, then stops it with
/// SIGTERM (it must exit 0).
pub(crate) async fn run_until_waiting(env: &[(String, String)]) -> Finished {
    let mut p = RelayProcess::spawn(&["run"], env);
    wait_for("the relay's waiting line", LIMIT, || {
        let stderr = p.stderr();
        async move { stderr.contains("cannot start yet") }
    })
    .await;
    assert!(p.is_running(), "the relay exited: {}", p.stderr());
    let f = p.terminate(Duration::from_secs(30));
    assert_eq!(f.status.code(), Some(0), "{}", f.stderr);
    f
}

/// With debug logs, `setup`, `run` (text and JSON logs), `status` and failing connections never show
/// the Postgres or NATS password; every stderr line of `run` with `log.format = "json"` is JSON.
#[tokio::test]
async fn logs_never_show_passwords_and_json_logs_are_json() {
    let server = PgServer::shared();
    let s = text_ids(None).await;
    let (db, nats) = (&s.db, &s.nats);
    let role = unique("relay_pw");
    db.psql(&format!(
        "CREATE ROLE {role} SUPERUSER LOGIN PASSWORD '{PG_PASSWORD}'"
    ));
    let (slot, stream) = (s.slot.clone(), s.stream.clone());
    let mut env = s.env();
    set(
        &mut env,
        "OUTBOX_RELAY_POSTGRES_URL",
        &server.url_as(&role, PG_PASSWORD, db.name()),
    );
    // The test server has no auth configured, so it accepts any user and password.
    set(
        &mut env,
        "OUTBOX_RELAY_NATS_URL",
        &format!("nats://relay:{NATS_PASSWORD}@127.0.0.1:{}", nats.port()),
    );
    set(&mut env, "OUTBOX_RELAY_LOG_LEVEL", "debug");
    let client = db.client().await;
    let js = nats.jetstream().await;

    let setup = run_command(&["setup"], &env, LIMIT);
    assert!(
        setup.status.success(),
        "setup with passwords: {}",
        setup.stderr
    );
    assert!(slot_exists(&client, &slot).await);
    assert_no_secret("setup", &setup);

    let run = run_with_one_event(&env, &client, &js, &slot, &stream, "pw-1").await;
    assert_eq!(run.status.code(), Some(0), "run: {}", run.stderr);
    assert!(
        run.stderr.contains("streaming"),
        "debug logs were written: {}",
        run.stderr
    );
    assert_no_secret("run", &run);

    let mut json_env = env.clone();
    set(&mut json_env, "OUTBOX_RELAY_LOG_FORMAT", "json");
    let json_run = run_with_one_event(&json_env, &client, &js, &slot, &stream, "pw-2").await;
    assert_eq!(json_run.status.code(), Some(0), "run: {}", json_run.stderr);
    assert_no_secret("run with JSON logs", &json_run);
    let mut lines = 0;
    for line in json_run.stderr.lines().filter(|l| !l.trim().is_empty()) {
        let v: Value = serde_json::from_str(line)
            .unwrap_or_else(|e| panic!("stderr line is not JSON ({e}): {line}"));
        assert!(v.is_object(), "{line}");
        lines += 1;
    }
    assert!(lines >= 2, "JSON run logged: {}", json_run.stderr);

    // The relay stopped: exit 1 (no relay holds the slot), and no secret either way.
    let status = run_command(&["status"], &env, LIMIT);
    assert!(
        status.stdout.ends_with("healthy\n") && matches!(status.status.code(), Some(0 | 1)),
        "status: {}{}",
        status.stdout,
        status.stderr
    );
    assert_no_secret("status", &status);

    // Failing cases: the wrong Postgres password; NATS credentials for a server that is not there.
    let mut wrong_pg = env.clone();
    set(
        &mut wrong_pg,
        "OUTBOX_RELAY_POSTGRES_URL",
        &server.url_as(&role, WRONG_PASSWORD, db.name()),
    );
    let mut no_nats = env.clone();
    set(
        &mut no_nats,
        "OUTBOX_RELAY_NATS_URL",
        &format!("nats://relay:{NATS_PASSWORD}@{}", free_addr()),
    );
    for (what, env) in [
        ("wrong postgres password", &wrong_pg),
        ("nats down", &no_nats),
    ] {
        for args in [&["run"][..], &["setup"], &["status"], &["status", "--json"]] {
            if what == "nats down" && args == ["run"] {
                // `run` waits for an unreachable server: its waiting line must not show it either.
                let f = run_until_waiting(env).await;
                assert_no_secret(&format!("{what}: {args:?}"), &f);
                continue;
            }
            let f = run_command(args, env, LIMIT);
            assert!(!f.status.success(), "{what}: {args:?} succeeded");
            assert_no_secret(&format!("{what}: {args:?}"), &f);
        }
    }

    drop(client);
    db.psql(&format!(
        "REASSIGN OWNED BY {role} TO postgres; DROP OWNED BY {role};"
    ));
    drop(s);
    server.psql("postgres", &format!("DROP ROLE IF EXISTS {role}"));
}

/// An `http.listen` address that is taken: `run` exits non-zero with one stderr line naming the key.
#[tokio::test]
async fn http_listen_in_use_is_one_clear_line() {
    let s = text_ids(None).await;
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = taken.local_addr().unwrap().to_string();
    let mut env = s.env();
    set(&mut env, "OUTBOX_RELAY_HTTP_LISTEN", &addr);
    let f = run_command(&["run"], &env, LIMIT);
    assert!(!f.status.success(), "run with {addr} taken succeeded");
    let stderr = f.stderr.trim();
    assert_eq!(stderr.lines().count(), 1, "one line:\n{stderr}");
    assert!(stderr.contains("http.listen"), "{stderr}");
    assert!(stderr.contains(&addr), "names the address: {stderr}");
    drop(taken);
}

/// A second relay on the same slot shows it waits: `outbox_relay_standby` is 1 and `/readyz` is 503
/// while the first holds the slot; once the first stops, the standby streams, the gauge drops to 0
/// and `/readyz` turns 200.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standby_shows_in_metrics_and_readyz_until_it_takes_over() {
    let s = text_ids(None).await;
    let (config, client) = (&s.config, s.db.client().await);
    let active = InProcessRelay::start(config.clone());
    wait_for_active_slot(&client, &config.postgres.slot).await;

    let mut standby_config = config.clone();
    let addr = free_addr();
    standby_config.http.listen = addr.clone();
    let standby = InProcessRelay::start(standby_config);
    wait_for_status(&addr, "/healthz", 200, 30).await;
    wait_for_series(&addr, "outbox_relay_standby", 1.0, 30).await;
    let (status, body) = get(&addr, "/readyz").await;
    assert_eq!(status, 503, "a standby is not ready: {body}");
    assert_eq!(value(&scrape(&addr).await, "outbox_relay_streaming"), 0.0);

    active.stop().await.expect("the active relay stops cleanly");
    wait_for_status(&addr, "/readyz", 200, 30).await;
    let body = scrape(&addr).await;
    assert_eq!(value(&body, "outbox_relay_standby"), 0.0, "{body}");
    assert_eq!(value(&body, "outbox_relay_streaming"), 1.0, "{body}");
    standby.stop().await.expect("the standby stops cleanly");
}

/// A publication that also publishes deletes, a retention DELETE committed
/// first and an outbox insert after it, no relay running. The insert waits behind a transaction
/// that holds no event: `status` must still find it (exit 1, naming the event), and `setup` warns
/// about the publication.
#[tokio::test]
async fn status_finds_an_event_that_waits_behind_a_retention_delete() {
    let s = text_ids(None).await;
    let (db, client) = (&s.db, s.db.client().await);
    // Rows from before the slot: a retention job's to delete, not events that wait.
    insert_events(&client, &ids("old", 3)).await;
    let env = s.env();
    let publication = &s.config.postgres.publication;
    let setup = run_command(&["setup"], &env, LIMIT);
    assert!(setup.status.success(), "setup: {}", setup.stderr);
    // The rows from before the slot are not events that wait (the one problem is that no relay
    // holds the slot).
    let before = status_json(&run_command(&["status", "--json"], &env, LIMIT));
    assert_eq!(
        before["slot"]["events_waiting"],
        Value::Bool(false),
        "{before:#}"
    );
    assert_eq!(before["slot"]["waiting_events"], 0, "{before:#}");

    db.psql(&format!(
        "ALTER PUBLICATION \"{publication}\" SET (publish = 'insert, delete')"
    ));
    client
        .batch_execute("DELETE FROM public.outbox")
        .await
        .expect("the retention delete");
    insert_events(&client, &["e-waiting".to_owned()]).await;
    let status = run_command(&["status"], &env, LIMIT);
    assert_eq!(
        status.status.code(),
        Some(1),
        "an event waits, no relay runs:\n{}",
        status.stdout
    );
    assert!(
        status
            .stdout
            .contains("while 1 event waits in it, the first e-waiting"),
        "status does not name the waiting event:\n{}",
        status.stdout
    );
    let json = status_json(&run_command(&["status", "--json"], &env, LIMIT));
    assert_eq!(
        json["slot"]["events_waiting"],
        Value::Bool(true),
        "{json:#}"
    );
}

/// The bound of the test above: a retention DELETE of more rows than `status` looks at (20,000
/// changes) before the waiting insert. `status` cannot see the event, and must not say healthy: it
/// exits 1 saying the slot cannot be checked for waiting events, and `events_waiting` is `null`.
#[tokio::test]
async fn status_is_unknown_not_healthy_when_its_look_ends_at_the_bound() {
    let s = text_ids(None).await;
    let (db, config) = (&s.db, &s.config);
    db.psql(
        "INSERT INTO public.outbox (event_id, aggregate_type, aggregate_id, event_type, payload) \
         SELECT 'old-' || i, 'Claim', '1', 'x', '{}' FROM generate_series(1, 20001) i",
    );
    let env = s.env();
    let setup = run_command(&["setup"], &env, LIMIT);
    assert!(setup.status.success(), "setup: {}", setup.stderr);
    db.psql(&format!(
        "ALTER PUBLICATION \"{}\" SET (publish = 'insert, delete')",
        config.postgres.publication
    ));
    db.psql("DELETE FROM public.outbox");
    let client = db.client().await;
    insert_events(&client, &["e-behind".to_owned()]).await;
    let status = run_command(&["status"], &env, LIMIT);
    assert_eq!(status.status.code(), Some(1), "{}", status.stdout);
    assert!(
        status
            .stdout
            .contains("cannot be checked for waiting events (more than 20000 changes are pending"),
        "{}",
        status.stdout
    );
    let json = status_json(&run_command(&["status", "--json"], &env, LIMIT));
    assert_eq!(json["slot"]["events_waiting"], Value::Null, "{json:#}");
}
