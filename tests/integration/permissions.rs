//! The permissions story of the docs, tried as written: who may write events and who may touch the
//! relay's subjects. Logical messages: after sql/06_outbox_message.sql a plain role can no longer call
//! `pg_logical_emit_message` itself (table privileges do not apply to it, so before that any role could
//! forge an event), still writes events through the helper, and `setup`/`status` warn exactly while it
//! could. NATS: a server configured with the accounts and users docs/operations.md prints, where the
//! relay works end to end (its position service too) and another user of the account can neither
//! publish into the stream's subjects, nor answer on the relay's inbox, nor take the service's subjects;
//! and `backfill`, which needs one permission more than the relay (its marker), refused cleanly
//! without it.

use std::time::Duration;

use async_nats::{ConnectOptions, Event};
use futures_util::StreamExt;
use tokio::sync::mpsc;
use tokio_postgres::NoTls;

use crate::support::{
    InProcessRelay, NatsServer, PgServer, ROLE_PASSWORD, Scenario, ScenarioBuilder,
    confirmed_flush, current_wal_lsn, read_all, run_command, server_major, sql_file, stream_count,
    wait_for,
};

const LIMIT: Duration = Duration::from_secs(60);

/// Messages only, with prefix `outbox`: no outbox table.
fn messages_only(builder: ScenarioBuilder<'_>) -> ScenarioBuilder<'_> {
    builder.config(|c| {
        c.outbox.message_prefix = "outbox".into();
        c.outbox.table = String::new();
    })
}

/// A client logged in as `role` ([`Scenario::login_role`]) on the scenario's database, with
/// `params` added to its URL.
async fn connect_as(s: &Scenario, role: &str, params: &str) -> tokio_postgres::Client {
    let url = PgServer::shared().url_as(role, ROLE_PASSWORD, s.db.name());
    let (client, connection) = tokio_postgres::connect(&format!("{url}{params}"), NoTls)
        .await
        .unwrap_or_else(|e| panic!("connect as {role}: {e}"));
    tokio::spawn(connection);
    client
}

/// The line `setup` and `status` print while PUBLIC may execute `pg_logical_emit_message`.
fn emit_warning(stdout: &str) -> Option<&str> {
    stdout.lines().find(|l| {
        l.starts_with("warning[public-emit-message]:") && l.contains("pg_logical_emit_message")
    })
}

/// Every overload of `pg_logical_emit_message` on this server, as a call with arguments of its
/// types (text and bytea content; PG 17+ has a `flush` argument too).
async fn direct_calls(client: &tokio_postgres::Client) -> Vec<String> {
    client
        .query(
            "SELECT p.proargtypes[2]::regtype::text, p.pronargs FROM pg_proc p \
             WHERE p.proname = 'pg_logical_emit_message' AND p.pronamespace = 'pg_catalog'::regnamespace \
             ORDER BY 1, 2",
            &[],
        )
        .await
        .expect("pg_proc")
        .iter()
        .map(|r| {
            let (content, args): (String, i16) = (r.get(0), r.get(1));
            let flush = if args == 4 { ", false" } else { "" };
            format!(
                "SELECT pg_logical_emit_message(true, 'outbox', '{{\"id\": \"forged\"}}'::{content}{flush})"
            )
        })
        .collect()
}

/// sql/06 revokes direct calls of every `pg_logical_emit_message` overload from PUBLIC: before it a
/// plain role can emit a message with the relay's prefix itself (a forged event) and `setup`/`status`
/// warn, naming the function and the REVOKE; after it the role gets `permission denied` for each
/// overload, still writes an event through `outbox_message` (granted with `-v writer_role`), and the
/// warning is gone.
#[tokio::test]
async fn sql_06_stops_direct_emit_messages_and_setup_and_status_warn_until_it_ran() {
    let mut s = messages_only(Scenario::builder()).start().await;
    let writer = s.login_role("writer", None);
    let env = s.env();
    let as_writer = connect_as(&s, &writer, "").await;
    let calls = direct_calls(&s.client).await;
    // Text and bytea content, each with `flush` on PG 17+.
    assert_eq!(calls.len(), 2, "{calls:?}");
    let flush = server_major() >= 17;
    assert!(
        calls.iter().all(|c| c.contains(", false)") == flush),
        "{calls:?}"
    );

    // Before: anyone may.
    for call in &calls {
        as_writer
            .query_one(call.as_str(), &[])
            .await
            .unwrap_or_else(|e| panic!("{call} as a plain role before sql/06: {e}"));
    }
    let setup = run_command(&["setup"], &env, LIMIT);
    assert!(setup.status.success(), "setup: {}", setup.stderr);
    let line = emit_warning(&setup.stdout)
        .unwrap_or_else(|| panic!("setup warns about direct calls:\n{}", setup.stdout));
    assert!(
        line.contains("outbox.message_prefix")
            && line.contains("REVOKE EXECUTE ON FUNCTION pg_logical_emit_message(boolean,text,")
            && line.contains("FROM PUBLIC"),
        "{line}"
    );
    let status = run_command(&["status"], &env, LIMIT);
    assert!(
        emit_warning(&status.stdout).is_some_and(|l| l == line),
        "status warns as setup does:\n{}",
        status.stdout
    );

    let script = sql_file("06_outbox_message.sql");
    s.db.psql(&format!("\\set writer_role {writer}\n{script}"));

    // After: not directly, each overload…
    for call in &calls {
        let e = as_writer
            .query_one(call.as_str(), &[])
            .await
            .expect_err(&format!("{call} as a plain role after sql/06"));
        let code = e.as_db_error().map(|d| d.code().code().to_owned());
        assert_eq!(code.as_deref(), Some("42501"), "{call}: {e}");
    }
    // …but through the helper.
    let id: String = as_writer
        .query_one(
            "SELECT outbox_message('Claim', '4711', 'ClaimApproved', '{\"claim_id\": 4711}')",
            &[],
        )
        .await
        .expect("outbox_message as the writer after sql/06")
        .get(0);
    assert_eq!(id.len(), 36, "{id}");

    let setup = run_command(&["setup"], &env, LIMIT);
    assert!(setup.status.success(), "setup: {}", setup.stderr);
    assert_eq!(emit_warning(&setup.stdout), None, "{}", setup.stdout);
    let status = run_command(&["status"], &env, LIMIT);
    assert_eq!(emit_warning(&status.stdout), None, "{}", status.stdout);
}

/// docs/security.md, finding 7: any session may call itself `outbox-relay/<slot>/<pid>`. A role
/// with no rights that does so while no relay runs does not make `status` print "relay: running
/// (pid 4242)": only sessions of the relay's own role, and the slot's walsender, are believed.
#[tokio::test]
async fn status_believes_no_application_name_of_another_role() {
    let mut s = Scenario::builder().default_outbox().start().await;
    let nobody = s.login_role("nobody", None);
    let env = s.env();
    let setup = run_command(&["setup"], &env, LIMIT);
    assert!(setup.status.success(), "setup: {}", setup.stderr);
    let params = format!("?application_name=outbox-relay/{}/4242", s.slot);
    let impostor = connect_as(&s, &nobody, &params).await;
    let name: String = impostor
        .query_one("SELECT current_setting('application_name')", &[])
        .await
        .expect("application_name")
        .get(0);
    assert!(name.ends_with("/4242"), "{name}");
    let status = run_command(&["status"], &env, LIMIT);
    assert!(
        !status.stdout.contains("4242"),
        "status believes another role's application_name:\n{}",
        status.stdout
    );
    assert!(
        !status.stdout.contains("relay: running"),
        "{}",
        status.stdout
    );
}

/// The warning `setup` and `status` print while PUBLIC may execute a SECURITY DEFINER helper.
fn helper_warning(stdout: &str) -> Option<&str> {
    stdout
        .lines()
        .find(|l| l.starts_with("warning[public-emit-helper]:") && l.contains("SECURITY DEFINER"))
}

/// docs/security.md, finding 5: sql/06's `outbox_message` and sql/08's `outbox_context` are
/// SECURITY DEFINER; run without `-v writer_role` they used to keep PostgreSQL's default EXECUTE
/// for PUBLIC, so a role with no grants could publish events (and emit first under another writer's
/// id). Now both scripts always revoke it: such a role gets `permission denied` from either helper.
/// And while PUBLIC may execute such a helper (granted back by hand), `setup` and `status` warn,
/// naming it; once revoked, neither does.
#[tokio::test]
async fn the_helpers_are_never_executable_by_public_and_setup_warns_while_they_are() {
    let mut s = messages_only(Scenario::builder())
        .sql(&sql_file("06_outbox_message.sql"))
        .sql(&sql_file("08_outbox_context.sql"))
        .start()
        .await;
    let nobody = s.login_role("nobody", None);
    let env = s.env();
    let as_nobody = connect_as(&s, &nobody, "").await;
    for call in [
        "SELECT outbox_message('Claim', '4711', 'ClaimApproved', '{\"amount\": 1000000}')",
        "SELECT outbox_context('00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01')",
    ] {
        let e = as_nobody
            .query_one(call, &[])
            .await
            .expect_err(&format!("{call} as a role with no grants"));
        let code = e.as_db_error().map(|d| d.code().code().to_owned());
        assert_eq!(code.as_deref(), Some("42501"), "{call}: {e}");
    }

    let setup = run_command(&["setup"], &env, LIMIT);
    assert!(setup.status.success(), "setup: {}", setup.stderr);
    assert_eq!(helper_warning(&setup.stdout), None, "{}", setup.stdout);
    s.db.psql(
        "GRANT EXECUTE ON FUNCTION public.outbox_message(text, text, text, jsonb, jsonb, text) TO PUBLIC",
    );
    let setup = run_command(&["setup"], &env, LIMIT);
    assert!(setup.status.success(), "setup: {}", setup.stderr);
    let line = helper_warning(&setup.stdout)
        .unwrap_or_else(|| panic!("setup warns about the helper:\n{}", setup.stdout));
    assert!(
        line.contains("outbox_message(text,text,text,jsonb,jsonb,text)")
            && line.contains("FROM PUBLIC")
            && !line.contains("outbox_context"),
        "{line}"
    );
    let status = run_command(&["status"], &env, LIMIT);
    assert!(
        helper_warning(&status.stdout).is_some_and(|l| l == line),
        "status warns as setup does:\n{}",
        status.stdout
    );
}

/// docs/security.md, finding 6: with only `outbox.context_prefix` set (no `message_prefix`), every
/// role may still call `pg_logical_emit_message` and write context messages the relay applies
/// unchecked (an invalid one is a dead letter). `setup` and `status` warn about it, naming
/// `outbox.context_prefix` and the REVOKE, until sql/06 revoked it; then neither warns.
#[tokio::test]
async fn setup_and_status_warn_while_every_role_may_emit_context_messages() {
    let s = Scenario::builder().default_outbox().start().await;
    let mut env = s.env();
    env.push((
        "OUTBOX_RELAY_OUTBOX_CONTEXT_PREFIX".into(),
        "outbox-context".into(),
    ));
    // Message events are on by default ("outbox"): only context messages means turning them off.
    env.push(("OUTBOX_RELAY_OUTBOX_MESSAGE_PREFIX".into(), String::new()));
    let setup = run_command(&["setup"], &env, LIMIT);
    assert!(setup.status.success(), "setup: {}", setup.stderr);
    let line = emit_warning(&setup.stdout)
        .unwrap_or_else(|| panic!("setup warns about direct calls:\n{}", setup.stdout));
    assert!(
        line.contains("outbox.context_prefix is set")
            && line.contains("trace context messages")
            && line.contains("REVOKE EXECUTE ON FUNCTION pg_logical_emit_message(boolean,text,")
            && line.contains("FROM PUBLIC"),
        "{line}"
    );
    let status = run_command(&["status"], &env, LIMIT);
    assert!(
        emit_warning(&status.stdout).is_some_and(|l| l == line),
        "status warns as setup does:\n{}",
        status.stdout
    );

    s.db.psql(&sql_file("06_outbox_message.sql"));
    let setup = run_command(&["setup"], &env, LIMIT);
    assert!(setup.status.success(), "setup: {}", setup.stderr);
    assert_eq!(emit_warning(&setup.stdout), None, "{}", setup.stdout);
    let status = run_command(&["status"], &env, LIMIT);
    assert_eq!(emit_warning(&status.stdout), None, "{}", status.stdout);
}

/// The nats-server configuration docs/operations.md prints under "NATS permissions": the first code
/// block of that section, as it is.
pub(crate) fn documented_nats_config() -> String {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/docs/operations.md");
    let text = std::fs::read_to_string(path).expect("read docs/operations.md");
    let (_, section) = text
        .split_once("\n## NATS permissions\n")
        .expect("docs/operations.md has a section NATS permissions");
    let section = section.split("\n## ").next().unwrap_or(section);
    let (_, block) = section
        .split_once("\n```\n")
        .expect("the section prints a nats-server configuration");
    let (block, _) = block.split_once("\n```").expect("the block ends");
    block.to_owned()
}

/// A scenario on a NATS server with the documented configuration, the relay its documented user
/// with the stream's name and inbox prefix the permissions are written for (the scenario's own
/// JetStream client connects as that user too; [`Scenario::env`] carries all three to the binary).
pub(crate) fn documented(builder: ScenarioBuilder<'_>) -> ScenarioBuilder<'_> {
    builder
        .nats_config(&documented_nats_config())
        .nats_user(RELAY_USER, RELAY_PASSWORD)
        .config(|c| {
            c.nats.stream = "OUTBOX".into();
            c.nats.inbox_prefix = INBOX_PREFIX.into();
        })
}

/// The names and passwords of the documented configuration.
pub(crate) const RELAY_USER: &str = "outbox-relay";
pub(crate) const RELAY_PASSWORD: &str = "change-me-relay";
pub(crate) const SERVICE_USER: &str = "claims-service";
pub(crate) const SERVICE_PASSWORD: &str = "change-me-service";
pub(crate) const INBOX_PREFIX: &str = "_INBOX_outbox_relay";

/// A client of the documented service user, and the errors the server sends it (a permission
/// violation comes as an `-ERR` line, not as the publish's result).
pub(crate) async fn service_client(
    nats: &NatsServer,
) -> (async_nats::Client, mpsc::UnboundedReceiver<String>) {
    let (tx, rx) = mpsc::unbounded_channel();
    let client =
        ConnectOptions::with_user_and_password(SERVICE_USER.into(), SERVICE_PASSWORD.into())
            .event_callback(move |event| {
                let tx = tx.clone();
                async move {
                    if let Event::ServerError(e) = event {
                        let _ = tx.send(e.to_string());
                    }
                }
            })
            .connect(nats.url())
            .await
            .expect("connect as the service user");
    (client, rx)
}

/// Publishes `payload` to `subject` and returns the server's error for it, if one comes within 2 s.
async fn publish_refused(
    client: &async_nats::Client,
    errors: &mut mpsc::UnboundedReceiver<String>,
    subject: &str,
    payload: &'static [u8],
) -> Option<String> {
    client
        .publish(subject.to_owned(), payload.into())
        .await
        .expect("publish");
    client.flush().await.expect("flush");
    tokio::time::timeout(Duration::from_secs(2), errors.recv())
        .await
        .ok()
        .flatten()
}

/// A nats-server started with exactly the accounts and users docs/operations.md prints: the relay
/// (its user, `nats.inbox_prefix` as documented) runs `setup`, `status` and `run`, and an event
/// inserted into the outbox arrives in the stream. The service user of the same account reads the
/// stream, but its publish into `outbox.*` is a permission violation (nothing stored), and so is
/// its answer to the reply subject it saw on the relay's publish, a forged ack on the relay's inbox
/// (the relay's session goes on: the next event arrives).
#[tokio::test]
async fn the_documented_nats_permissions_let_the_relay_work_and_keep_others_off_its_subjects() {
    let conf = documented_nats_config();
    assert!(
        conf.contains(RELAY_PASSWORD)
            && conf.contains(SERVICE_PASSWORD)
            && conf.contains(INBOX_PREFIX),
        "the documented configuration names the users this test connects as:\n{conf}"
    );
    let s = documented(Scenario::builder().default_outbox())
        .start()
        .await;
    let env = s.env();
    let setup = run_command(&["setup"], &env, LIMIT);
    assert!(
        setup.status.success(),
        "setup with the documented permissions: {}",
        setup.stderr
    );

    let (service, mut errors) = service_client(&s.nats).await;
    let js = async_nats::jetstream::new(service.clone());
    // A core subscriber of the stream's subjects sees the relay's publishes and their reply subjects.
    let mut seen = service.subscribe("outbox.*").await.expect("subscribe");
    service.flush().await.expect("flush");

    let client = &s.client;
    let relay = InProcessRelay::start(s.config.clone());
    s.wait_slot_made().await;
    let insert = "INSERT INTO public.outbox (aggregate_type, aggregate_id, event_type, payload) \
                  VALUES ('Claim', $1, 'ClaimApproved', '{}')";
    client.execute(insert, &[&"4711"]).await.expect("insert");
    wait_for("the event in the stream", LIMIT, || async {
        stream_count(&js, "OUTBOX").await >= 1
    })
    .await;
    let published = tokio::time::timeout(LIMIT, seen.next())
        .await
        .expect("the relay's publish seen by the subscriber")
        .expect("subscription open");
    let reply = published
        .reply
        .expect("the relay publishes with a reply subject")
        .to_string();
    assert!(
        reply.starts_with(&format!("{INBOX_PREFIX}.")),
        "the relay's inbox is under nats.inbox_prefix: {reply}"
    );

    let status = run_command(&["status"], &env, LIMIT);
    assert!(
        status.status.success() && status.stdout.contains("healthy"),
        "status with the documented permissions:\n{}{}",
        status.stdout,
        status.stderr
    );

    let refused =
        publish_refused(&service, &mut errors, "outbox.Claim", b"{\"forged\": true}").await;
    assert!(
        refused
            .as_deref()
            .is_some_and(|e| e.contains("Permissions Violation for Publish to \"outbox.Claim\"")),
        "the service may not publish into the stream's subjects: {refused:?}"
    );
    let forged = br#"{"stream": "OUTBOX", "seq": 99}"#;
    let refused = publish_refused(&service, &mut errors, &reply, forged).await;
    assert!(
        refused.as_deref().is_some_and(
            |e| e.contains("Permissions Violation for Publish to") && e.contains(INBOX_PREFIX)
        ),
        "the service may not answer on the relay's inbox: {refused:?}"
    );

    // The service's user waits for its write through the position service (registered a moment
    // after the session started: no responders until then), and cannot take the service's subjects.
    client.execute(insert, &[&"4712"]).await.expect("insert");
    let token = current_wal_lsn(client).await;
    let wait = format!("outbox-relay.{}.wait", s.slot);
    let body = format!(r#"{{"lsn": "{token}", "timeout_ms": 20000}}"#);
    let deadline = std::time::Instant::now() + LIMIT;
    let answer = loop {
        if let Ok(m) = service.request(wait.clone(), body.clone().into()).await {
            break String::from_utf8_lossy(&m.payload).into_owned();
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no answer from {wait}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(answer.contains(r#""stored":true"#), "{answer}");
    let _sub = service.subscribe(wait.clone()).await.expect("subscribe");
    service.flush().await.expect("flush");
    let refused = tokio::time::timeout(Duration::from_secs(2), errors.recv())
        .await
        .ok()
        .flatten();
    assert!(
        refused
            .as_deref()
            .is_some_and(|e| e.contains("Permissions Violation for Subscription")),
        "the service may not subscribe to the position service's subjects: {refused:?}"
    );
    wait_for("the second event in the stream", LIMIT, || async {
        stream_count(&js, "OUTBOX").await >= 2
    })
    .await;
    let stored = read_all(&js, "OUTBOX").await;
    let ids: Vec<&str> = stored
        .iter()
        .map(|m| m.header("Outbox-Aggregate-Id"))
        .collect();
    assert_eq!(ids, ["4711", "4712"], "only the relay's events are stored");
    assert!(!relay.is_finished(), "the relay runs on");
    relay.stop().await.expect("relay stops cleanly");
}

/// `backfill` sets its marker on the stream, which the documented relay user may not do (no
/// `$JS.API.STREAM.UPDATE`): run as that user, it stops before it touches the slot, with one line
/// naming the permission, and leaves the slot and the stream as they were.
#[tokio::test]
async fn backfill_as_the_documented_relay_user_names_the_permission_and_changes_nothing() {
    let s = documented(Scenario::builder().default_outbox())
        .start()
        .await;
    let env = s.env();
    let setup = run_command(&["setup"], &env, LIMIT);
    assert!(setup.status.success(), "setup: {}", setup.stderr);
    let before = s.confirmed().await;
    assert!(before.is_some(), "setup created the slot");

    let out = run_command(&["backfill", "--replace-slot"], &env, LIMIT);
    assert!(!out.status.success(), "{}\n{}", out.stdout, out.stderr);
    let line = out
        .stderr
        .lines()
        .find(|l| l.starts_with("outbox-relay: "))
        .unwrap_or_else(|| panic!("no error line:\n{}", out.stderr));
    eprintln!("{line}");
    assert!(
        line.contains("backfill marker") && line.contains("$JS.API.STREAM.UPDATE.OUTBOX"),
        "{line}"
    );
    assert_eq!(s.confirmed().await, before, "the slot is as it was");
    let status = run_command(&["status", "--json"], &env, LIMIT);
    let v: serde_json::Value = serde_json::from_str(&status.stdout).expect("status --json");
    assert!(v["backfill"].is_null(), "no marker was set: {v}");
}

/// A resumed session proves the events it skipped by reading them back in bulk (an ephemeral
/// headers-only consumer), and the documented permissions allow that read: a relay stores a
/// transaction of 200 events and is killed before it confirms it; the next one finds them in the
/// stream, proves them without falling back to one request per message (whose warn line would
/// say so), stores nothing twice and confirms the slot.
#[tokio::test]
async fn the_documented_nats_permissions_let_a_resumed_session_read_its_replay_back_in_bulk() {
    const EVENTS: u64 = 200;
    let s = documented(Scenario::builder().default_outbox())
        .start()
        .await;
    let env = s.env();
    let setup = run_command(&["setup"], &env, LIMIT);
    assert!(setup.status.success(), "setup: {}", setup.stderr);
    let (service, _errors) = service_client(&s.nats).await;
    let js = async_nats::jetstream::new(service);
    let (client, slot) = (&s.client, &s.slot);
    // A relay killed right after JetStream acked the whole transaction, before its next status
    // update (at most a second later) confirmed it: the next one replays it. Tried again in the
    // rare case the update came first.
    let mut stored = 0;
    let mut end = None;
    for _ in 0..3 {
        client
            .batch_execute(&format!(
                "INSERT INTO public.outbox (aggregate_type, aggregate_id, event_type, payload) \
                 SELECT 'Claim', i::text, 'ClaimApproved', '{{}}' FROM generate_series(1, {EVENTS}) AS i"
            ))
            .await
            .expect("insert");
        stored += EVENTS;
        let lsn = current_wal_lsn(client).await;
        let mut first = crate::support::RelayProcess::spawn(&["run"], &env);
        let deadline = std::time::Instant::now() + LIMIT;
        while stream_count(&js, "OUTBOX").await < stored {
            assert!(
                std::time::Instant::now() < deadline && first.is_running(),
                "the transaction in the stream: {}",
                first.stderr()
            );
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        first.signal("KILL");
        assert!(first.wait(LIMIT).is_some(), "kill -9");
        if confirmed_flush(client, slot).await.expect("slot") < lsn {
            end = Some(lsn);
            break;
        }
    }
    let end = end.expect("a relay killed before it confirmed its transaction");

    let mut second = crate::support::RelayProcess::spawn(&["run"], &env);
    wait_for("the slot confirmed past the transaction", LIMIT, || async {
        confirmed_flush(client, slot)
            .await
            .is_some_and(|c| c >= end)
    })
    .await;
    second.signal("TERM");
    assert!(second.wait(LIMIT).is_some(), "the relay stops on SIGTERM");
    let log = second.stderr();
    assert!(
        !log.contains("cannot read the replay's messages back in bulk")
            && !log.contains("replay skips nothing")
            && !log.contains("pipeline stopped"),
        "the replay was proven by the bulk read:\n{log}"
    );
    assert_eq!(
        read_all(&js, "OUTBOX").await.len() as u64,
        stored,
        "nothing stored twice"
    );
}
