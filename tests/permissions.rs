//! The permissions story of the docs, tried as written: who may write events and who may touch the
//! relay's subjects. Logical messages: after sql/06_outbox_message.sql a plain role can no longer call
//! `pg_logical_emit_message` itself (table privileges do not apply to it, so before that any role could
//! forge an event), still writes events through the helper, and `setup`/`status` warn exactly while it
//! could. NATS: a server configured with the accounts and users docs/operations.md prints, where the
//! relay works end to end and another user of the account can neither publish into the stream's
//! subjects nor answer on the relay's inbox.

use std::time::Duration;

use outbox_relay::config::Config;
use tokio_postgres::NoTls;

use crate::support::{
    NatsServer, PgServer, TestDb, relay_config, relay_env, run_command, server_major, unique,
};

const LIMIT: Duration = Duration::from_secs(60);
const PG_PASSWORD: &str = "writer-pw";

/// The binary's environment for messages only with prefix `outbox`.
fn messages_env(config: &Config) -> Vec<(String, String)> {
    let mut env = relay_env(config);
    env.push(("OUTBOX_RELAY_OUTBOX_MESSAGE_PREFIX".into(), "outbox".into()));
    env.push(("OUTBOX_RELAY_OUTBOX_TABLE".into(), String::new()));
    env
}

/// The line `setup` and `status` print while PUBLIC may execute `pg_logical_emit_message`.
fn emit_warning(stdout: &str) -> Option<&str> {
    stdout
        .lines()
        .find(|l| l.starts_with("warning:") && l.contains("pg_logical_emit_message"))
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
    let server = PgServer::shared();
    let db = TestDb::create(server).await;
    let writer = unique("writer");
    db.psql(&format!(
        "CREATE ROLE {writer} LOGIN PASSWORD '{PG_PASSWORD}'"
    ));
    let nats = NatsServer::start();
    let config = relay_config(&db, &nats);
    let env = messages_env(&config);
    let (as_writer, connection) =
        tokio_postgres::connect(&server.url_as(&writer, PG_PASSWORD, db.name()), NoTls)
            .await
            .expect("connect as the writer");
    tokio::spawn(connection);
    let calls = direct_calls(&db.client().await).await;
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

    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/sql/06_outbox_message.sql");
    let script = std::fs::read_to_string(path).expect("read sql/06");
    db.psql(&format!("\\set writer_role {writer}\n{script}"));

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
    drop(as_writer);
    drop(db);
    server.psql("postgres", &format!("DROP ROLE IF EXISTS {writer}"));
}
