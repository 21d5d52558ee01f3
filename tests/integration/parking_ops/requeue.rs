//! `outbox-relay requeue` as an operator runs it, against a real Postgres and NATS: one line naming
//! the fix while sql/09 is missing, installed for another relay's prefix, or refused to the login;
//! once it goes through, one line with the request id and the control message's LSN (the message
//! read back from a slot of the test's own: the key's first `/` splits, `--key-null-id` sends a
//! NULL id, `--discard` calls `outbox_discard`), then one line saying the running relay has stored
//! past the request's transaction.

use std::time::Duration;

use serde_json::{Value, json};
use tokio_postgres::Client;

use super::requeue_sql_with;
use crate::ops::{free_addr, try_get};
use crate::support::{
    NatsServer, PgServer, RelayProcess, TestDb, default_outbox_sql, relay_config, relay_env,
    run_command, unique, wait_for,
};

const LIMIT: Duration = Duration::from_secs(90);

/// A pgoutput slot of the test's own that keeps every control message for it to read.
async fn watch_messages(client: &Client, db: &TestDb) -> (String, String) {
    let (slot, publication) = (
        format!("{}_watch", db.slot_name()),
        format!("{}_watch", db.publication_name()),
    );
    client
        .batch_execute(&format!("CREATE PUBLICATION {publication}"))
        .await
        .expect("create an empty publication");
    client
        .query_one(
            "SELECT lsn FROM pg_create_logical_replication_slot($1, 'pgoutput')",
            &[&slot],
        )
        .await
        .expect("create the watching slot");
    (slot, publication)
}

/// The control messages' contents the watching slot holds, in order (the relay's own slot has
/// passed them by then).
async fn contents(client: &Client, slot: &str, publication: &str) -> Vec<Value> {
    use outbox_relay::pgoutput::{Decoder, Message};
    let rows = client
        .query(
            "SELECT data FROM pg_logical_slot_peek_binary_changes($1, NULL, NULL, \
             'proto_version', '1', 'publication_names', $2, 'messages', 'true')",
            &[&slot, &publication],
        )
        .await
        .expect("peek the watching slot");
    let mut decoder = Decoder::new();
    rows.iter()
        .filter_map(|r| {
            let data: Vec<u8> = r.get(0);
            match decoder
                .decode(bytes::Bytes::from(data), outbox_relay::Lsn(0))
                .expect("decodes")
            {
                Message::Message {
                    prefix, content, ..
                } if prefix.starts_with("outbox-relay.control") => {
                    Some(serde_json::from_slice(&content).expect("JSON content"))
                }
                _ => None,
            }
        })
        .collect()
}

/// The request id `requeue`'s first line names.
fn request_of(line: &str) -> String {
    line.split_once(": request ")
        .and_then(|(_, rest)| rest.split_whitespace().next())
        .unwrap_or_else(|| panic!("a request id in {line:?}"))
        .to_owned()
}

/// What `requeue` printed on stderr, checked to be the one line of a failed command.
fn one_error_line(stderr: &str) -> &str {
    let line = stderr.trim();
    assert!(
        line.starts_with("outbox-relay: ") && !line.contains('\n'),
        "one error line: {stderr}"
    );
    line
}

/// Before sql/09 is installed `requeue` says which function is missing and to run the script;
/// after, it sends each request (printing its id and LSN) and, with a relay running, waits until
/// that relay has stored past the request's transaction.
#[tokio::test]
async fn requeue_names_the_missing_script_then_sends_each_request_and_waits_for_the_relay() {
    let server = PgServer::shared();
    let db = TestDb::create(server).await;
    db.psql(&default_outbox_sql());
    let nats = NatsServer::start();
    let mut config = relay_config(&db, &nats);
    let addr = free_addr();
    config.http.listen = addr.clone();
    let env = relay_env(&config);

    let missing = run_command(&["requeue", "--key", "Claim/4711", "--force"], &env, LIMIT);
    assert_eq!(missing.status.code(), Some(1), "{}", missing.stdout);
    let line = one_error_line(&missing.stderr);
    assert!(
        line.contains("outbox_requeue(text, text) is not installed")
            && line.contains("run sql/09_requeue.sql"),
        "{line}"
    );

    let op = unique("op");
    db.psql(&requeue_sql_with(&[("operator_role", &op)]));
    let client = db.client().await;
    let (watch, watch_publication) = watch_messages(&client, &db).await;
    let relay = RelayProcess::run(&config);
    wait_for("the relay's /position", LIMIT, || async {
        matches!(try_get(&addr, "/position").await, Some((200, _)))
    })
    .await;

    let sent = run_command(
        &["requeue", "--key", "Claim/2026/4711", "--force"],
        &env,
        LIMIT,
    );
    assert_eq!(
        sent.status.code(),
        Some(0),
        "{}{}",
        sent.stdout,
        sent.stderr
    );
    let lines: Vec<&str> = sent.stdout.lines().collect();
    assert_eq!(lines.len(), 2, "{}", sent.stdout);
    assert!(
        lines[0].starts_with("requeue Claim/2026/4711: request ")
            && lines[0].contains(" committed, control message at ")
            && lines[0].ends_with("(public.outbox_requeue)"),
        "{}",
        lines[0]
    );
    assert!(
        lines[1].starts_with("carried out: the relay has stored through "),
        "{}",
        lines[1]
    );
    let requeued = request_of(lines[0]);

    let null_id = run_command(
        &[
            "requeue",
            "--key-null-id",
            "Claim",
            "--discard",
            "--force",
            "--no-wait",
        ],
        &env,
        LIMIT,
    );
    assert_eq!(null_id.status.code(), Some(0), "{}", null_id.stderr);
    assert_eq!(null_id.stdout.lines().count(), 1, "{}", null_id.stdout);
    assert!(
        null_id
            .stdout
            .starts_with("discard Claim (NULL id): request "),
        "{}",
        null_id.stdout
    );
    let discarded = request_of(&null_id.stdout);

    // A dead letter's requeue is sent as outbox_requeue_event(event_id): whether the stream holds
    // the dead letter is the relay's to find when it reads the request.
    let event = run_command(&["requeue", "--event", "e-1", "--no-wait"], &env, LIMIT);
    assert_eq!(event.status.code(), Some(0), "{}", event.stderr);
    assert!(
        event.stdout.starts_with("requeue event e-1: request "),
        "{}",
        event.stdout
    );
    let event_request = request_of(&event.stdout);

    assert_eq!(
        contents(&client, &watch, &watch_publication).await,
        vec![
            json!({"op": "requeue", "aggregate_type": "Claim", "aggregate_id": "2026/4711", "request": requeued}),
            json!({"op": "discard", "aggregate_type": "Claim", "aggregate_id": null, "request": discarded}),
            json!({"op": "requeue_event", "event_id": "e-1", "request": event_request}),
        ]
    );
    drop(relay);
    drop(client);
    drop(db);
    server.psql("postgres", &format!("DROP ROLE IF EXISTS {op}"));
}

/// Installed for another relay's name, `requeue` says so and how to install it for this one; a
/// login without the operator role is refused with the grant to give, and a member of it may.
#[tokio::test]
async fn requeue_names_another_relays_prefix_and_the_grant_a_refused_login_needs() {
    let server = PgServer::shared();
    let db = TestDb::create(server).await;
    let nats = NatsServer::start();
    let config = relay_config(&db, &nats);
    let mut env = relay_env(&config);
    let op = unique("op");
    db.psql(&requeue_sql_with(&[
        ("operator_role", &op),
        ("relay_name", "orders"),
    ]));

    let other = run_command(&["requeue", "--key", "Claim/4711", "--force"], &env, LIMIT);
    assert_eq!(other.status.code(), Some(1), "{}", other.stdout);
    let line = one_error_line(&other.stderr);
    assert!(
        line.contains("public.outbox_requeue (outbox-relay.control.orders)")
            && line.contains("this relay's outbox-relay.control:")
            && line.contains("-v relay_name="),
        "{line}"
    );

    env.push(("OUTBOX_RELAY_NAME".into(), "orders".into()));
    let (nobody, member) = (unique("nobody"), unique("member"));
    db.psql(&format!(
        "CREATE ROLE {nobody} LOGIN PASSWORD 'pw'; CREATE ROLE {member} LOGIN PASSWORD 'pw' IN ROLE {op}"
    ));
    let refused = run_command(
        &[
            "requeue",
            "--key",
            "Claim/4711",
            "--force",
            "--postgres-url",
            &server.url_as(&nobody, "pw", db.name()),
        ],
        &env,
        LIMIT,
    );
    assert_eq!(refused.status.code(), Some(1), "{}", refused.stdout);
    let line = one_error_line(&refused.stderr);
    assert!(
        line.contains(&format!(
            "permission denied for public.outbox_requeue as role {nobody}: GRANT outbox_operator TO {nobody}"
        )),
        "{line}"
    );
    let allowed = run_command(
        &[
            "requeue",
            "--key",
            "Claim/4711",
            "--force",
            "--no-wait",
            "--postgres-url",
            &server.url_as(&member, "pw", db.name()),
        ],
        &env,
        LIMIT,
    );
    assert_eq!(allowed.status.code(), Some(0), "{}", allowed.stderr);
    assert!(
        allowed.stdout.starts_with("requeue Claim/4711: request "),
        "{}",
        allowed.stdout
    );
    drop(db);
    server.psql(
        "postgres",
        &format!(
            "DROP ROLE IF EXISTS {nobody}; DROP ROLE IF EXISTS {member}; DROP ROLE IF EXISTS {op}"
        ),
    );
}
