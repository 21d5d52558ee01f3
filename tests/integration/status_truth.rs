//! What `status` tells an operator, tried as an operator meets it (docs/operations.md, "The status
//! command"): never healthy while no relay holds the slot past the grace period, whether or not
//! events wait, and healthy again when a restarted relay takes the slot within it; waiting events
//! counted; dead letters in the stream named; Postgres' WAL-retention limits as warnings with their
//! numbers; stop marks that outlive their slot named with the SQL that drops them; the relay's own
//! word taken only from a listener of this slot and stream that Postgres shows, and never as lines
//! of its own; one relay state for the text and the JSON; refused credentials named as such.

use std::time::Duration;

use serde_json::Value;
use std::io::{Read, Write};

use crate::hostile::wait_for_active_slot;
use crate::named_relays::write;
use crate::ops::{free_addr, try_get, wait_for_status};
use crate::support::{
    Finished, NatsServer, PgServer, RelayProcess, Scenario, TestDb, run_command, slot_exists,
    wait_for,
};
use crate::truth::{good, json, set};

const LIMIT: Duration = Duration::from_secs(90);

/// A database with the text-id outbox, a NATS of the test's own, and a relay configuration for
/// them (the test's own slot, publication and stream), as parts.
pub(crate) async fn servers() -> (TestDb, NatsServer, outbox_relay::config::Config) {
    let (db, nats, config, ..) = Scenario::builder().text_ids().start().await.into_parts();
    (db, nats, config)
}

/// `setup` with `env`, which must succeed; what it printed.
pub(crate) fn set_up(env: &[(String, String)]) -> Finished {
    let setup = run_command(&["setup"], env, LIMIT);
    assert_eq!(setup.status.code(), Some(0), "{}", setup.stderr);
    setup
}

fn problems(v: &Value) -> Vec<String> {
    v["problems"]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|p| p.as_str().unwrap_or("").to_owned())
                .collect()
        })
        .unwrap_or_default()
}

fn warning_names(v: &Value) -> Vec<String> {
    v["warning_names"]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|w| w.as_str().unwrap_or("").to_owned())
                .collect()
        })
        .unwrap_or_default()
}

/// Runs `run` until it has published one event (`before-stop`) into the empty stream, stops it
/// with SIGTERM (a clean stop of a session that confirmed, which leaves the stop mark) and checks it
/// exited 0.
async fn run_and_stop(env: &[(String, String)], s: &Scenario) {
    let mut p = RelayProcess::spawn(&["run"], env);
    wait_for_active_slot(&s.client, &s.slot).await;
    good(&s.client, "before-stop").await;
    wait_for("the event", LIMIT, || async { s.count().await == 1 }).await;
    p.signal("TERM");
    assert_eq!(
        p.wait(LIMIT).and_then(|s| s.code()),
        Some(0),
        "{}",
        p.stderr()
    );
}

/// 47#1: with the relay stopped and nothing waiting, `status` said `relay: not running` and
/// `healthy`. Now: once no relay has held the slot for longer than `status.grace_secs` it is a
/// problem (exit 1); on a server before 17 status watches the slot that long. A relay that takes the
/// slot within the grace period (a restart) leaves the status healthy.
#[tokio::test]
async fn no_relay_holding_the_slot_past_the_grace_period_is_a_problem_even_with_nothing_waiting() {
    let s = Scenario::builder().text_ids().start().await;
    let mut env = s.env();
    set_up(&env);
    run_and_stop(&env, &s).await;

    set(&mut env, "OUTBOX_RELAY_STATUS_GRACE_SECS", "1");
    // Before 17 status watches the slot for the grace period; from 17 on it reads since when the
    // slot is unheld, and within the first second that is still inside the grace period.
    let mut f = run_command(&["status", "--json"], &env, LIMIT);
    if PgServer::shared().version_num() >= 170000 && f.status.code() == Some(0) {
        let v = json(&f);
        assert!(
            warning_names(&v).contains(&"unheld-within-grace".to_owned()),
            "within the grace period: {v:#}"
        );
        tokio::time::sleep(Duration::from_millis(1500)).await;
        f = run_command(&["status", "--json"], &env, LIMIT);
    }
    let v = json(&f);
    assert_eq!(f.status.code(), Some(1), "{v:#}");
    assert_eq!(v["slot"]["events_waiting"], false, "nothing waits: {v:#}");
    let unheld = problems(&v)
        .into_iter()
        .find(|p| p.contains("no relay"))
        .unwrap_or_else(|| panic!("a problem says no relay holds the slot: {v:#}"));
    assert!(
        unheld.contains(&s.slot) && unheld.contains("status.grace_secs 1"),
        "{unheld}"
    );
    assert!(v["slot"]["unheld_secs"].as_u64().is_some(), "{v:#}");

    // A restart: status watches (before 17) or reads inactive_since (17+); the relay is back
    // within the grace period, and the status is healthy.
    set(&mut env, "OUTBOX_RELAY_STATUS_GRACE_SECS", "120");
    let mut status = RelayProcess::spawn(&["status", "--json"], &env);
    if PgServer::shared().version_num() < 170000 {
        wait_for("status to watch the slot", LIMIT, || {
            let stderr = status.stderr();
            async move { stderr.contains("watching it for up to 120 s") }
        })
        .await;
    }
    let mut relay = RelayProcess::spawn(&["run"], &env);
    let code = status.wait(LIMIT).and_then(|s| s.code());
    let out = status.stdout();
    relay.signal("TERM");
    let _ = relay.wait(LIMIT);
    let v: Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"));
    assert!(
        !problems(&v).iter().any(|p| p.contains("no relay")),
        "{v:#}"
    );
    if PgServer::shared().version_num() < 170000 {
        assert_eq!(
            code,
            Some(0),
            "the relay took the slot while status watched: {v:#}"
        );
        assert_eq!(v["relay"]["state"], "streaming", "{v:#}");
    }
}

/// 47#4 and 47#6: with the relay stopped, `status` counts the events that wait (not only the first);
/// right after NATS died, while the relay's session still holds the slot, the relay's own word says
/// it does not stream, and the text and the JSON agree (`relay.state` = `not_streaming`), with the
/// events that wait in the held slot counted.
#[tokio::test]
async fn waiting_events_are_counted_and_text_and_json_agree_while_nats_is_down() {
    let addr = free_addr();
    let s = Scenario::builder()
        .text_ids()
        .http_listen(&addr)
        // The session outlives NATS until a publish times out: long enough for status to look.
        .config(|c| c.nats.ack_timeout_ms = 120_000)
        .start()
        .await;
    let env = s.env();
    set_up(&env);
    for id in ["w-1", "w-2", "w-3"] {
        good(&s.client, id).await;
    }
    let f = run_command(&["status", "--json"], &env, LIMIT);
    let v = json(&f);
    assert_eq!(f.status.code(), Some(1), "{v:#}");
    assert_eq!(v["slot"]["waiting_events"], 3, "{v:#}");
    assert_eq!(v["slot"]["waiting_events_complete"], true, "{v:#}");
    let text = run_command(&["status"], &env, LIMIT).stdout;
    assert!(
        text.contains("while 3 events wait in it, the first w-1"),
        "{text}"
    );

    let mut p = s.run_binary();
    wait_for("the three events", LIMIT, || async { s.count().await == 3 }).await;
    wait_for_status(&addr, "/readyz", 200, 30).await;
    s.nats.stop();
    wait_for_status(&addr, "/readyz", 503, 30).await;
    good(&s.client, "w-4").await;
    good(&s.client, "w-5").await;
    let f = run_command(&["status", "--json"], &env, LIMIT);
    let text = run_command(&["status"], &env, LIMIT);
    let v = json(&f);
    let held: bool = s
        .client
        .query_one(
            "SELECT coalesce((SELECT active FROM pg_replication_slots WHERE slot_name = $1), false)",
            &[&s.slot],
        )
        .await
        .unwrap()
        .get(0);
    p.signal("KILL");
    let _ = p.wait(LIMIT);
    assert!(
        held,
        "the session holds the slot until its ack timeout (120 s)"
    );
    assert_eq!(v["relay"]["state"], "not_streaming", "{v:#}");
    assert!(
        text.stdout.contains("NOT streaming by its own word"),
        "{}",
        text.stdout
    );
    assert!(
        v["slot"]["waiting_events"].as_u64().is_some_and(|n| n >= 2),
        "the events written after NATS died wait in the held slot: {v:#}"
    );
}

/// 47#3: dead letters in the stream were invisible to `status`. Now a warning names how many, the
/// newest one's event and reason, and `stream.dead_letters` has them.
#[tokio::test]
async fn dead_letters_in_the_stream_are_counted_with_the_newest_reason() {
    let s = Scenario::builder().text_ids().start().await;
    let env = s.env();
    let mut p = s.run_binary();
    wait_for_active_slot(&s.client, &s.slot).await;
    for (id, aggregate_type) in [("dl-1", "Bad Type"), ("ok-1", "Claim"), ("dl-2", "a.b")] {
        write(&s.client, id, aggregate_type).await;
    }
    wait_for("three messages", LIMIT, || async { s.count().await == 3 }).await;
    let f = run_command(&["status", "--json"], &env, LIMIT);
    let text = run_command(&["status"], &env, LIMIT).stdout;
    p.signal("TERM");
    let _ = p.wait(LIMIT);
    let v = json(&f);
    let d = &v["stream"]["dead_letters"];
    assert_eq!(d["count"], 2, "{v:#}");
    assert_eq!(d["newest"]["event_id"], "dl-2", "{v:#}");
    assert!(
        d["newest"]["reason"]
            .as_str()
            .is_some_and(|r| r.contains("aggregate_type")),
        "{v:#}"
    );
    let line = text
        .lines()
        .find(|l| l.starts_with("warning[dead-letters]:"))
        .unwrap_or_else(|| panic!("{text}"));
    assert!(
        line.contains("holds 2 dead letters")
            && line.contains("event dl-2")
            && line.contains("requeue --event ID`")
            && !line.contains("new id"),
        "{line}"
    );
}

/// 47#2: Postgres' default `max_slot_wal_keep_size = -1` lets a stopped relay's slot keep WAL until
/// the disk fills; neither `setup` nor `status` said so. Now both warn, `status` with the WAL the slot
/// keeps. And on a server of its own with a small limit, a slot that falls behind it is `unreserved`
/// and then `lost`: problems naming `backfill`.
#[tokio::test]
async fn wal_retention_limits_are_warned_about_and_an_endangered_slot_names_backfill() {
    let s = Scenario::builder().text_ids().start().await;
    let env = s.env();
    let setup = set_up(&env);
    assert!(
        setup
            .stdout
            .contains("warning[wal-keep-unbounded]: max_slot_wal_keep_size is -1 (unlimited)"),
        "setup gives the sizing advice: {}",
        setup.stdout
    );
    let f = run_command(&["status", "--json"], &env, LIMIT);
    let v = json(&f);
    let at = warning_names(&v)
        .iter()
        .position(|n| n == "wal-keep-unbounded")
        .unwrap_or_else(|| panic!("{v:#}"));
    let w = v["warnings"][at]
        .as_str()
        .unwrap_or_else(|| panic!("{v:#}"));
    assert!(
        w.contains(&format!(
            "retains {} bytes now",
            v["slot"]["retained_bytes"]
        )),
        "{w}"
    );
    assert_eq!(v["postgres"]["max_slot_wal_keep_bytes"], -1, "{v:#}");

    // A server of its own: a limit of 1 MB, and WAL written past it with no relay confirming.
    let server = PgServer::start_private();
    server.psql(
        "postgres",
        "ALTER SYSTEM SET max_slot_wal_keep_size = '1MB';\nALTER SYSTEM SET max_wal_size = '256MB';\n\
         SELECT pg_reload_conf();",
    );
    let own = Scenario::builder().text_ids().on(&server).start().await;
    let env = own.env();
    if server.version_num() >= 180000 {
        server.psql(
            "postgres",
            "ALTER SYSTEM SET idle_replication_slot_timeout = '1h';\nSELECT pg_reload_conf();",
        );
    }
    let setup = set_up(&env);
    if server.version_num() >= 180000 {
        assert!(
            setup.stdout.contains(
                "warning[idle-slot-timeout]: idle_replication_slot_timeout is 1h (3600 s)"
            ),
            "{}",
            setup.stdout
        );
        let v = json(&run_command(&["status", "--json"], &env, LIMIT));
        assert!(
            warning_names(&v).contains(&"idle-slot-timeout".to_owned()),
            "{v:#}"
        );
    }
    own.db.psql(
        "CREATE TABLE filler (x text); \
         INSERT INTO filler SELECT repeat('x', 1000) FROM generate_series(1, 40000); \
         SELECT pg_switch_wal();",
    );
    let f = run_command(&["status", "--json"], &env, LIMIT);
    let v = json(&f);
    assert_eq!(f.status.code(), Some(1), "{v:#}");
    let wal_status = v["slot"]["wal_status"].as_str().unwrap_or("").to_owned();
    assert!(
        wal_status == "unreserved" || wal_status == "lost",
        "past the limit: {v:#}"
    );
    assert!(
        problems(&v)
            .iter()
            .any(|p| p.contains("backfill --replace-slot")),
        "{wal_status}: a problem names backfill: {v:#}"
    );
    own.db
        .psql("CHECKPOINT; INSERT INTO filler SELECT 'x' FROM generate_series(1, 10); CHECKPOINT;");
    let f = run_command(&["status", "--json"], &env, LIMIT);
    let v = json(&f);
    if v["slot"]["wal_status"] == "lost" {
        assert!(
            problems(&v)
                .iter()
                .any(|p| p.contains("was invalidated") && p.contains("backfill --replace-slot")),
            "{v:#}"
        );
    }
}

/// 47#8 / 48#6: after a clean stop, dropping only the slot (as migrating.md's "Going back" said)
/// left `<slot>_mark` keeping WAL for ever, named by nothing. Now `status` names it, with the WAL it
/// keeps and the SQL that drops it; run as given, that SQL removes it.
#[tokio::test]
async fn a_stop_mark_whose_slot_is_gone_is_a_problem_with_the_sql_that_drops_it() {
    let s = Scenario::builder().text_ids().start().await;
    let env = s.env();
    let mark = format!("{}_mark", s.slot);
    run_and_stop(&env, &s).await;
    assert!(
        slot_exists(&s.client, &mark).await,
        "a clean stop leaves the mark"
    );
    s.client
        .execute("SELECT pg_drop_replication_slot($1)", &[&s.slot])
        .await
        .unwrap();
    let f = run_command(&["status", "--json"], &env, LIMIT);
    let v = json(&f);
    assert_eq!(f.status.code(), Some(1), "{v:#}");
    assert_eq!(v["orphan_marks"][0]["name"], mark.as_str(), "{v:#}");
    let drop = format!("SELECT pg_drop_replication_slot('{mark}')");
    let line = problems(&v)
        .into_iter()
        .find(|p| p.starts_with(&format!("stop mark {mark} keeps")))
        .unwrap_or_else(|| panic!("{v:#}"));
    assert!(line.ends_with(&drop), "{line}");
    s.db.psql(&drop);
    assert!(!slot_exists(&s.client, &mark).await);
    let v = json(&run_command(&["status", "--json"], &env, LIMIT));
    assert_eq!(v["orphan_marks"], Value::Array(Vec::new()), "{v:#}");
}

/// A listener that answers like a relay would, but says what the test wants: `/readyz` 200, and a
/// `/position` naming `slot`/`stream` with `stored_lsn` as given (line breaks and all). On a thread
/// of its own: the test blocks while the binary runs.
fn fake_listener(addr: &str, slot: &str, stream: &str, stored_lsn: &str) {
    let listener = std::net::TcpListener::bind(addr).unwrap();
    let position = serde_json::json!({
        "slot": slot, "stream": stream, "stored_lsn": stored_lsn,
        "confirmed_lsn": "0/1", "last_sequence": 1,
    })
    .to_string();
    std::thread::spawn(move || {
        for s in listener.incoming() {
            let Ok(mut s) = s else { return };
            let mut buf = vec![0u8; 4096];
            let n = s.read(&mut buf).unwrap_or(0);
            let req = String::from_utf8_lossy(&buf[..n]).into_owned();
            let body = if req.starts_with("GET /position") {
                position.clone()
            } else if req.starts_with("GET /metrics") {
                "outbox_relay_seconds_since_last_ack 0.5\n".to_owned()
            } else {
                "ready\n".to_owned()
            };
            let _ = s.write_all(
                format!(
                    "HTTP/1.1 200 OK\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                )
                .as_bytes(),
            );
        }
    });
}

/// 47#5 / 48#5: `status` quoted whatever answered on `http.listen` as the relay's own word: a local
/// process printed `relay: streaming (pid 1)` and `healthy` through a `stored_lsn` with line breaks,
/// while Postgres showed no relay; another relay's listener lent its "ready". Now the word is taken
/// only from a listener serving this slot and stream while Postgres shows its relay, and only as
/// plain values: neither lie reaches the report, which says why the listener is not believed.
#[tokio::test]
async fn the_relays_own_word_is_taken_only_from_a_listener_of_this_slot_that_postgres_shows() {
    let s = Scenario::listening().await;
    let (addr, env) = (s.http_addr(), s.env());
    set_up(&env);
    fake_listener(
        &addr,
        &s.slot,
        &s.stream,
        "0/1\nrelay: streaming (pid 1)\nhealthy",
    );
    assert_eq!(try_get(&addr, "/readyz").await.map(|r| r.0), Some(200));
    good(&s.client, "waits").await;
    let f = run_command(&["status"], &env, LIMIT);
    assert_eq!(f.status.code(), Some(1), "{}", f.stdout);
    let lines: Vec<&str> = f.stdout.lines().collect();
    assert_eq!(lines.last(), Some(&"NOT healthy"), "{}", f.stdout);
    assert!(
        !lines
            .iter()
            .any(|l| *l == "healthy" || l.starts_with("relay: streaming")),
        "no line of the listener's own: {}",
        f.stdout
    );
    assert!(lines.contains(&"relay: not running"), "{}", f.stdout);
    let v = json(&run_command(&["status", "--json"], &env, LIMIT));
    assert_eq!(v["relay"]["own_word"]["believed"], false, "{v:#}");
    assert!(v["relay"]["own_word"]["position"].is_null(), "{v:#}");
    assert!(
        warning_names(&v).contains(&"own-word-not-believed".to_owned()),
        "{v:#}"
    );

    // Another relay's listener, while this slot's relay streams (without a listener of its own).
    let other = free_addr();
    fake_listener(&other, "claims_slot", "CLAIMS", "0/1");
    let mut running = s.config.clone();
    running.http.listen = String::new();
    let mut p = RelayProcess::run(&running);
    wait_for_active_slot(&s.client, &s.slot).await;
    let mut asks_other = env.clone();
    set(&mut asks_other, "OUTBOX_RELAY_HTTP_LISTEN", &other);
    let f = run_command(&["status", "--json"], &asks_other, LIMIT);
    let text = run_command(&["status"], &asks_other, LIMIT).stdout;
    p.signal("TERM");
    let _ = p.wait(LIMIT);
    let v = json(&f);
    assert_eq!(v["relay"]["state"], "streaming", "{v:#}");
    assert_eq!(v["relay"]["own_word"]["believed"], false, "{v:#}");
    let relay_line = text.lines().find(|l| l.starts_with("relay:")).unwrap();
    assert!(!relay_line.contains("own word"), "{relay_line}");
    assert!(
        text.contains("serves slot claims_slot and stream CLAIMS, not slot"),
        "{text}"
    );
}

/// 47#7: a wrong password was headlined `postgres: UNREACHABLE`; now `AUTHENTICATION FAILED`, JSON
/// `postgres.state = "auth_failed"`, and (47#12) the line says to check the variable the URL came
/// from, not `postgres.url`.
#[tokio::test]
async fn refused_credentials_are_named_as_such_with_the_variable_to_check() {
    let s = Scenario::builder().text_ids().start().await;
    let server = PgServer::shared();
    let mut env = s.env();
    set(
        &mut env,
        "OUTBOX_RELAY_POSTGRES_URL",
        &format!(
            "postgres://scram_user:wrong@{}:{}/{}?sslmode=disable",
            server.host(),
            server.port(),
            s.db.name()
        ),
    );
    let f = run_command(&["status"], &env, LIMIT);
    assert_eq!(f.status.code(), Some(1), "{}", f.stdout);
    assert!(
        f.stdout.starts_with("postgres: AUTHENTICATION FAILED"),
        "{}",
        f.stdout
    );
    let v = json(&run_command(&["status", "--json"], &env, LIMIT));
    assert_eq!(v["postgres"]["state"], "auth_failed", "{v:#}");
    let setup = run_command(&["setup"], &env, LIMIT);
    assert_eq!(setup.status.code(), Some(1));
    assert!(
        setup
            .stderr
            .contains("check OUTBOX_RELAY_POSTGRES_URL, which sets postgres.url"),
        "{}",
        setup.stderr
    );
}

/// 48#6: every place the docs drop a slot (a `pg_drop_replication_slot(` call, or "drop the slot")
/// also deals with its stop mark within a few lines: a slot dropped alone after a clean stop leaves
/// `<slot>_mark` keeping WAL for ever.
#[test]
fn every_doc_that_drops_a_slot_drops_its_stop_mark_too() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files: Vec<std::path::PathBuf> = std::fs::read_dir(root.join("docs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    files.extend(["README.md", "CONTRIBUTING.md"].map(|f| root.join(f)));
    let mut missing = Vec::new();
    for file in files {
        let text = std::fs::read_to_string(&file).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        for (i, line) in lines.iter().enumerate() {
            let low = line.to_lowercase();
            let drops = line.contains("pg_drop_replication_slot(")
                || [
                    "drop the slot",
                    "drop its slot",
                    "drop a slot",
                    "drop that slot",
                ]
                .iter()
                .any(|p| low.contains(p));
            if !drops {
                continue;
            }
            let window = lines[i.saturating_sub(3)..(i + 9).min(lines.len())]
                .join("\n")
                .to_lowercase();
            if !window.contains("_mark") && !window.contains("stop mark") {
                missing.push(format!("{}:{}: {line}", file.display(), i + 1));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "drops a slot without its stop mark:\n{}",
        missing.join("\n")
    );
}
