//! The relay process across outages and signals (docs/operations.md): a relay started while NATS or
//! Postgres is down waits for it (alive on `/healthz`, not ready on `/readyz`, one log line) and then
//! publishes what was written meanwhile, while a setting it cannot use still ends it at once; `status`
//! during a NATS outage says the relay is retrying and the stream's state is unknown, and never takes
//! the slot from a relay that starts while it runs; SIGHUP reloads what it can and keeps the relay
//! running.
//!
//! Every test runs the built binary, as a service manager would.

use std::time::Duration;

use async_nats::jetstream;
use serde_json::Value;
use tokio_postgres::Client;

use crate::ops::{free_addr, try_get, wait_for_status};
use crate::support::{
    Finished, NatsServer, PgServer, RelayProcess, Scenario, TEXT_ID_OUTBOX_SQL, TestDb, read_all,
    relay_config, relay_env, run_command, stream_count, wait_for,
};
use crate::truth::{good as insert, set};

const LIMIT: Duration = Duration::from_secs(60);

/// A database on `server` (a private one: the shared server's tests begin with a `Scenario`) with
/// the text-id outbox table.
async fn text_id_db(server: &PgServer) -> TestDb {
    let db = TestDb::create(server).await;
    db.psql(TEXT_ID_OUTBOX_SQL);
    db
}

/// Lines of `stderr` that contain `text`.
fn lines_with(stderr: &str, text: &str) -> usize {
    stderr.lines().filter(|l| l.contains(text)).count()
}

/// Waits until the relay's stderr contains `text`, or panics with it (and fails if the relay exits).
async fn wait_for_log(p: &mut RelayProcess, text: &str) {
    let deadline = std::time::Instant::now() + LIMIT;
    loop {
        let stderr = p.stderr();
        if stderr.contains(text) {
            return;
        }
        assert!(
            p.is_running(),
            "the relay exited before logging {text:?}:\n{stderr}"
        );
        assert!(
            std::time::Instant::now() < deadline,
            "no {text:?} within {LIMIT:?}:\n{stderr}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn wait_for_ids(js: &jetstream::Context, stream: &str, ids: &[&str]) {
    wait_for(&format!("{ids:?} in {stream}"), LIMIT, || async {
        if stream_count(js, stream).await < ids.len() as u64 {
            return false;
        }
        let stored: Vec<String> = read_all(js, stream)
            .await
            .iter()
            .map(|m| m.id().to_owned())
            .collect();
        ids.iter().all(|id| stored.iter().any(|s| s == id))
    })
    .await;
}

/// SIGTERM and exit 0; returns what the relay wrote.
fn stop(mut p: RelayProcess) -> Finished {
    let f = p.terminate(LIMIT);
    assert_eq!(f.status.code(), Some(0), "{}", f.stderr);
    f
}

/// Once the server is back: `/readyz` is 200, and the relay, stopped, said once that the servers
/// are reachable.
async fn assert_back(p: RelayProcess, addr: &str) {
    wait_for_status(addr, "/readyz", 200, 60).await;
    let f = stop(p);
    assert_eq!(
        lines_with(&f.stderr, "servers reachable"),
        1,
        "{}",
        f.stderr
    );
}

/// While it waits: the process runs, `/healthz` is 200, `/readyz` is 503, and the waiting line was
/// written once although several attempts failed.
async fn assert_waiting(p: &mut RelayProcess, addr: &str) {
    wait_for_log(p, "cannot start yet").await;
    wait_for_status(addr, "/healthz", 200, 30).await;
    // Long enough for several attempts (0.1 s, 0.2 s, 0.4 s, 0.8 s, 1.6 s, …).
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert!(p.is_running(), "the relay exited: {}", p.stderr());
    assert_eq!(try_get(addr, "/healthz").await.map(|r| r.0), Some(200));
    let ready = try_get(addr, "/readyz").await;
    assert_eq!(ready.as_ref().map(|r| r.0), Some(503), "{ready:?}");
    let stderr = p.stderr();
    assert_eq!(
        lines_with(&stderr, "cannot start yet"),
        1,
        "one line per state change, not per attempt:\n{stderr}"
    );
}

/// A relay started while nats-server is down (after a deploy's `setup`, as on a node reboot) waits
/// for it instead of exiting; an event written meanwhile is published once NATS is back.
#[tokio::test]
async fn a_relay_started_while_nats_is_down_waits_and_then_publishes() {
    let s = Scenario::builder().text_ids().start().await;
    let mut env = s.env();
    let setup = run_command(&["setup"], &env, LIMIT);
    assert!(setup.status.success(), "setup: {}", setup.stderr);
    let addr = free_addr();
    set(&mut env, "OUTBOX_RELAY_HTTP_LISTEN", &addr);
    let (_db, nats, config, client, _js, _slot, _stream) = s.into_parts();

    nats.stop();
    let mut p = RelayProcess::spawn(&["run"], &env);
    insert(&client, "while-nats-down").await;
    assert_waiting(&mut p, &addr).await;
    assert!(
        p.stderr().contains("cause=nats") || p.stderr().contains("NATS"),
        "the line names NATS: {}",
        p.stderr()
    );

    nats.start_again();
    let js = nats.jetstream().await;
    wait_for_ids(&js, &config.nats.stream, &["while-nats-down"]).await;
    assert_back(p, &addr).await;
}

/// The same with Postgres down: the relay waits, and publishes both an event written before the
/// outage and one written after Postgres came back.
#[tokio::test]
async fn a_relay_started_while_postgres_is_down_waits_and_then_publishes() {
    let server = PgServer::start_private();
    let db = text_id_db(&server).await;
    let nats = NatsServer::start();
    let config = relay_config(&db, &nats);
    let mut env = relay_env(&config);
    let setup = run_command(&["setup"], &env, LIMIT);
    assert!(setup.status.success(), "setup: {}", setup.stderr);
    let addr = free_addr();
    set(&mut env, "OUTBOX_RELAY_HTTP_LISTEN", &addr);
    insert(&db.client().await, "before-pg-down").await;

    server.stop();
    let mut p = RelayProcess::spawn(&["run"], &env);
    assert_waiting(&mut p, &addr).await;
    assert!(
        p.stderr().contains("cause=postgres"),
        "the line names postgres: {}",
        p.stderr()
    );

    server.start();
    insert(&db.client().await, "after-pg-back").await;
    let js = nats.jetstream().await;
    wait_for_ids(
        &js,
        &config.nats.stream,
        &["before-pg-down", "after-pg-back"],
    )
    .await;
    assert_back(p, &addr).await;
}

/// docs/security.md, finding 4: a multi-host `postgres.url` whose first host is down and whose
/// second refuses the password ends `run` at once with the refusal, instead of logging in with the
/// wrong password again and again (enough to lock an LDAP- or PAM-backed account); a single host
/// did so already.
#[tokio::test]
async fn a_wrong_password_ends_run_even_when_another_host_is_down() {
    let server = PgServer::shared();
    let db = text_id_db(server).await;
    let nats = NatsServer::start();
    let config = relay_config(&db, &nats);
    let down = free_addr();
    let mut env = relay_env(&config);
    set(
        &mut env,
        "OUTBOX_RELAY_POSTGRES_URL",
        &format!(
            "postgres://scram_user:wrong@{down},{}:{}/{}?sslmode=disable",
            server.host(),
            server.port(),
            db.name()
        ),
    );
    let f = run_command(&["run"], &env, Duration::from_secs(30));
    assert_eq!(f.status.code(), Some(1), "{}", f.stderr);
    let last = f.stderr.trim().lines().last().unwrap_or("").to_owned();
    assert!(
        last.starts_with("outbox-relay: ") && last.contains("password authentication failed"),
        "{}",
        f.stderr
    );
    assert_eq!(lines_with(&f.stderr, "cannot start yet"), 0, "{}", f.stderr);
    assert!(
        !f.stderr.contains(":wrong@"),
        "no password in the output: {}",
        f.stderr
    );
}

/// docs/security.md, finding 8: `sslmode=require` against a server without TLS (here a listener
/// that answers every SSLRequest with `N`, as such a Postgres does) ends `run` at once with a line
/// that says TLS, as the docs promise for TLS failures, instead of "waiting for the server;
/// retrying" forever.
#[tokio::test]
async fn a_tls_refusal_on_the_control_connection_ends_run() {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut s) = conn else { return };
            std::thread::spawn(move || {
                let mut request = [0u8; 8];
                if s.read_exact(&mut request).is_ok() {
                    let _ = s.write_all(b"N");
                    let _ = s.read(&mut [0u8; 64]);
                }
            });
        }
    });
    let s = Scenario::builder().text_ids().start().await;
    let mut env = s.env();
    set(
        &mut env,
        "OUTBOX_RELAY_POSTGRES_URL",
        &format!("postgres://outbox_relay@{addr}/app?sslmode=require"),
    );
    let f = run_command(&["run"], &env, Duration::from_secs(30));
    assert_eq!(f.status.code(), Some(1), "{}", f.stderr);
    let last = f.stderr.trim().lines().last().unwrap_or("").to_owned();
    assert!(
        last.starts_with("outbox-relay: ")
            && last.contains("TLS")
            && last.contains("server does not support TLS"),
        "{}",
        f.stderr
    );
    assert_eq!(lines_with(&f.stderr, "cannot start yet"), 0, "{}", f.stderr);
}

/// Settings retrying cannot fix still end `run` at once with one clear line: NATS refusing the
/// relay's credentials, and a Postgres database that does not exist.
#[tokio::test]
async fn a_setting_that_cannot_work_still_ends_run_at_once() {
    let db = text_id_db(PgServer::shared()).await;
    let nats =
        NatsServer::start_with_config("authorization {\n  user: relay\n  password: right\n}");
    let config = relay_config(&db, &nats);
    let mut env = relay_env(&config);
    set(
        &mut env,
        "OUTBOX_RELAY_NATS_URL",
        &format!("nats://relay:wrong@127.0.0.1:{}", nats.port()),
    );
    let f = run_command(&["run"], &env, LIMIT);
    assert_eq!(f.status.code(), Some(1), "{}", f.stderr);
    let last = f.stderr.trim().lines().last().unwrap_or("").to_owned();
    assert!(
        last.starts_with("outbox-relay: ") && last.contains("refused the relay's credentials"),
        "{}",
        f.stderr
    );
    assert_eq!(lines_with(&f.stderr, "cannot start yet"), 0, "{}", f.stderr);

    let mut env = relay_env(&config);
    set(
        &mut env,
        "OUTBOX_RELAY_POSTGRES_URL",
        &PgServer::shared().url("no_such_database_here"),
    );
    let f = run_command(&["run"], &env, LIMIT);
    assert_eq!(f.status.code(), Some(1), "{}", f.stderr);
    let last = f.stderr.trim().lines().last().unwrap_or("").to_owned();
    assert!(last.contains("postgres.url"), "{}", f.stderr);
    assert_eq!(lines_with(&f.stderr, "cannot start yet"), 0, "{}", f.stderr);
}

/// SIGHUP does not end the relay: it re-reads `--config`, applies `log.level` (here to `warn`, so
/// the info lines of the shutdown no longer appear), names the changed key that needs a restart in
/// one line, and keeps publishing. A file that no longer parses is reported and changes nothing.
#[tokio::test]
async fn sighup_reloads_the_log_level_names_what_needs_a_restart_and_keeps_running() {
    let s = Scenario::builder().text_ids().start().await;
    let env = s.env();
    let (_db, _nats, _config, client, js, _slot, stream) = s.into_parts();
    let stream = &stream;
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("relay.toml");
    std::fs::write(&file, "[log]\nlevel = \"info\"\n").expect("write config");
    let path = file.display().to_string();
    let mut p = RelayProcess::spawn(&["run", "--config", &path], &env);
    wait_for_log(&mut p, "streaming").await;
    insert(&client, "before-hup").await;
    wait_for_ids(&js, stream, &["before-hup"]).await;

    std::fs::write(
        &file,
        "[log]\nlevel = \"warn\"\n[nats]\nmax_in_flight = 7\n",
    )
    .expect("write config");
    p.signal("HUP");
    wait_for_log(&mut p, "SIGHUP: configuration reloaded").await;
    let stderr = p.stderr();
    let line = stderr
        .lines()
        .find(|l| l.contains("SIGHUP"))
        .expect("the reload line");
    assert!(line.contains("applied log.level"), "{line}");
    assert!(
        line.contains("needs a restart: nats.max_in_flight"),
        "{line}"
    );
    assert_eq!(lines_with(&stderr, "SIGHUP"), 1, "{stderr}");
    insert(&client, "after-hup").await;
    wait_for_ids(&js, stream, &["before-hup", "after-hup"]).await;

    std::fs::write(&file, "[log\nlevel = \"warn\"\n").expect("write config");
    p.signal("HUP");
    wait_for_log(&mut p, "cannot be loaded").await;
    insert(&client, "after-bad-hup").await;
    wait_for_ids(&js, stream, &["before-hup", "after-hup", "after-bad-hup"]).await;

    let f = stop(p);
    assert!(
        !f.stderr.contains("shutdown requested"),
        "log.level = warn is in force: {}",
        f.stderr
    );
}

/// `status --json`, parsed.
fn json(f: &Finished) -> Value {
    serde_json::from_str(&f.stdout)
        .unwrap_or_else(|e| panic!("not JSON ({e}):\n{}\n{}", f.stdout, f.stderr))
}

async fn slot_active(client: &Client, slot: &str) -> bool {
    client
        .query_opt(
            "SELECT 1 FROM pg_replication_slots WHERE slot_name = $1 AND active",
            &[&slot],
        )
        .await
        .expect("query pg_replication_slots")
        .is_some()
}

/// `status` asks the relay itself. With nats-server stopped and no event written,
/// the relay's walsender stays active (its session ends only when a publish fails or times out), so
/// Postgres alone shows "streaming"; the relay's own `/readyz` says "nats disconnected" at once.
/// `status` reports the relay's word: not streaming, a problem naming the reason and the listener,
/// exit 1, and `relay.own_word` in JSON; while NATS was up it said "ready" with the stored LSN.
#[tokio::test]
async fn status_asks_the_relay_and_says_nats_is_down_while_postgres_still_shows_streaming() {
    let s = Scenario::listening().await;
    let (addr, env) = (s.http_addr(), s.env());
    let (_db, nats, config, client, js, slot, _stream) = s.into_parts();
    let mut p = RelayProcess::run(&config);
    wait_for_log(&mut p, "streaming").await;
    insert(&client, "before-outage").await;
    wait_for_ids(&js, &config.nats.stream, &["before-outage"]).await;
    wait_for_status(&addr, "/readyz", 200, 30).await;
    let up = run_command(&["status"], &env, LIMIT);
    let relay_line = up
        .stdout
        .lines()
        .find(|l| l.starts_with("relay:"))
        .unwrap_or_else(|| panic!("no relay line: {}", up.stdout))
        .to_owned();
    assert!(
        relay_line.contains(&format!(
            "its own word at http {addr}: ready, stored up to "
        )),
        "{relay_line}"
    );

    nats.stop();
    wait_for_status(&addr, "/readyz", 503, 30).await;
    assert!(
        slot_active(&client, &slot).await,
        "the walsender still holds the slot: what Postgres shows says streaming"
    );
    let text = run_command(&["status"], &env, LIMIT);
    assert_eq!(
        text.status.code(),
        Some(1),
        "{}{}",
        text.stdout,
        text.stderr
    );
    let out = &text.stdout;
    assert!(
        out.contains(&format!(
            "relay: running (pid {}), NOT streaming by its own word: nats disconnected",
            p.pid()
        )),
        "{out}"
    );
    assert!(
        out.contains(&format!(
            "problem: the relay at http {addr} is not streaming: nats disconnected"
        )),
        "{out}"
    );
    let f = run_command(&["status", "--json"], &env, LIMIT);
    let v = json(&f);
    let word = &v["relay"]["own_word"];
    assert_eq!(word["reached"], true, "{v:#}");
    assert_eq!(word["ready"], false, "{v:#}");
    assert_eq!(word["not_ready_because"], "nats disconnected", "{v:#}");
    assert!(word["seconds_since_last_ack"].as_f64().is_some(), "{v:#}");
    drop(p);
}

/// `status` shows the stream's limits and warns from 80 % of one: a stream with
/// `max_msgs` 5 and `discard: new` holding 4 events is "80 % full", and what a full one does.
#[tokio::test]
async fn status_shows_the_streams_limits_and_warns_when_it_is_80_percent_full() {
    let s = Scenario::builder().text_ids().start().await;
    let env = s.env();
    let (_db, _nats, config, client, js, _slot, _stream) = s.into_parts();
    js.create_stream(jetstream::stream::Config {
        name: config.nats.stream.clone(),
        subjects: vec!["outbox.*".into(), config.nats.dead_letter_subject.clone()],
        max_messages: 5,
        discard: jetstream::stream::DiscardPolicy::New,
        duplicate_window: Duration::from_secs(120),
        ..Default::default()
    })
    .await
    .expect("create the stream");
    let mut p = RelayProcess::run(&config);
    wait_for_log(&mut p, "streaming").await;
    let ids = ["f-1", "f-2", "f-3", "f-4"];
    for id in ids {
        insert(&client, id).await;
    }
    wait_for_ids(&js, &config.nats.stream, &ids).await;
    let text = run_command(&["status"], &env, LIMIT);
    let out = &text.stdout;
    assert!(out.contains(" max_msgs 5 discard new"), "{out}");
    assert!(
        out.contains(&format!(
            "warning[stream-filling]: stream {} is 80 % full: 4 of its max_msgs 5; with discard new a full stream refuses new events",
            config.nats.stream
        )),
        "{out}"
    );
    let f = run_command(&["status", "--json"], &env, LIMIT);
    let v = json(&f);
    assert_eq!(v["stream"]["max_msgs"], 5, "{v:#}");
    assert_eq!(v["stream"]["discard"], "new", "{v:#}");
    assert!(v["stream"]["max_bytes"].is_null(), "{v:#}");
    stop(p);
}

/// With the relay running and retrying against a stopped nats-server, `status` says a relay runs and
/// retries (not "start outbox-relay run"), the events waiting in the slot, and a stream whose state is
/// unknown: `null` in JSON, not `false` or 0, and `unknown: NATS unreachable (…)` in text.
#[tokio::test]
async fn status_during_a_nats_outage_says_the_relay_retries_and_the_stream_is_unknown() {
    let s = Scenario::builder().text_ids().start().await;
    let env = s.env();
    let (_db, nats, config, client, js, slot, _stream) = s.into_parts();
    let mut p = RelayProcess::run(&config);
    wait_for_log(&mut p, "streaming").await;
    insert(&client, "before-outage").await;
    wait_for_ids(&js, &config.nats.stream, &["before-outage"]).await;

    nats.stop();
    insert(&client, "during-outage").await;
    wait_for("the relay to stop streaming", LIMIT, || async {
        !slot_active(&client, &slot).await
    })
    .await;
    assert!(p.is_running(), "{}", p.stderr());

    let text = run_command(&["status"], &env, LIMIT);
    assert_eq!(
        text.status.code(),
        Some(1),
        "{}{}",
        text.stdout,
        text.stderr
    );
    let out = &text.stdout;
    assert!(!out.contains("start outbox-relay run"), "{out}");
    assert!(
        out.contains(&format!("relay: running (pid {})", p.pid())),
        "{out}"
    );
    assert!(out.contains("retrying"), "{out}");
    let stream_line = out
        .lines()
        .find(|l| l.starts_with(&format!("stream {}:", config.nats.stream)))
        .unwrap_or_else(|| panic!("no stream line: {out}"));
    assert!(
        stream_line.contains("unknown: NATS unreachable ("),
        "{stream_line}"
    );
    assert!(!stream_line.contains("0 messages"), "{stream_line}");

    let f = run_command(&["status", "--json"], &env, LIMIT);
    assert_eq!(f.status.code(), Some(1), "{}", f.stderr);
    let v = json(&f);
    let st = &v["stream"];
    for key in [
        "exists",
        "messages",
        "bytes",
        "last_sequence",
        "replicas",
        "storage",
        "duplicate_window_secs",
    ] {
        assert!(st[key].is_null(), "stream.{key} is unknown: {v:#}");
    }
    assert_eq!(st["state"], "unreachable", "{v:#}");
    assert_eq!(v["relay"]["state"], "retrying", "{v:#}");
    assert_eq!(v["relay"]["pids"], serde_json::json!([p.pid()]), "{v:#}");
    assert_eq!(v["slot"]["exists"], Value::Bool(true), "{v:#}");
    assert_eq!(v["slot"]["active"], Value::Bool(false), "{v:#}");
    assert_eq!(v["slot"]["events_waiting"], Value::Bool(true), "{v:#}");
    let problems = v["problems"].as_array().expect("problems");
    assert!(
        problems
            .iter()
            .all(|p| !p.as_str().unwrap_or("").contains("start outbox-relay run")),
        "{v:#}"
    );

    nats.start_again();
    wait_for_ids(
        &js,
        &config.nats.stream,
        &["before-outage", "during-outage"],
    )
    .await;
    let f = run_command(&["status", "--json"], &env, LIMIT);
    let v = json(&f);
    assert_eq!(v["relay"]["state"], "streaming", "{v:#}");
    assert_eq!(v["stream"]["exists"], Value::Bool(true), "{v:#}");
    stop(p);
}

/// `status` checks an idle slot for waiting events without acquiring it: the slot is never active
/// while `status` runs alone, and a relay started while `status` reads a long backlog never finds
/// its slot held (no standby line naming `status`'s connection) and publishes at once.
#[tokio::test]
async fn status_never_takes_the_slot_from_a_starting_relay() {
    let db = text_id_db(PgServer::shared()).await;
    let nats = NatsServer::start();
    let config = relay_config(&db, &nats);
    let env = relay_env(&config);
    let slot = config.postgres.slot.clone();
    let setup = run_command(&["setup"], &env, LIMIT);
    assert!(setup.status.success(), "setup: {}", setup.stderr);
    let client = db.client().await;
    // A long transaction on a table outside the publication, then an event: decoding the slot's
    // backlog takes a while, during which a peek on the slot would hold it.
    db.psql(
        "CREATE TABLE public.side (i int, t text); \
         INSERT INTO public.side SELECT g, repeat('x', 100) FROM generate_series(1, 300000) g;",
    );
    insert(&client, "waiting").await;

    let mut status = RelayProcess::spawn(&["status", "--json"], &env);
    let mut seen_active = false;
    while status.is_running() {
        seen_active |= slot_active(&client, &slot).await;
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(!seen_active, "status acquired the slot");
    let f = Finished {
        status: status.wait(LIMIT).expect("status exited"),
        stdout: status.stdout(),
        stderr: status.stderr(),
    };
    let v = json(&f);
    assert_eq!(v["slot"]["events_waiting"], Value::Bool(true), "{v:#}");
    assert_eq!(v["relay"]["state"], "not_running", "{v:#}");

    // Now a relay starts while two status runs read the backlog.
    let first = RelayProcess::spawn(&["status"], &env);
    tokio::time::sleep(Duration::from_millis(100)).await;
    let mut relay = RelayProcess::run(&config);
    let second = RelayProcess::spawn(&["status"], &env);
    let js = nats.jetstream().await;
    wait_for_ids(&js, &config.nats.stream, &["waiting"]).await;
    wait_for_log(&mut relay, "streaming").await;
    drop((first, second));
    let f = stop(relay);
    assert!(
        !f.stderr.contains("another relay holds the slot") && !f.stderr.contains("standby"),
        "the relay found its slot held: {}",
        f.stderr
    );
}
