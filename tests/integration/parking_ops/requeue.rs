//! `outbox-relay requeue` as an operator runs it, against a real Postgres and NATS: one line naming
//! the fix while sql/09 is missing, installed for another relay's prefix, or refused to the login;
//! once it goes through, one line with the request id and the control message's LSN (the message
//! read back from a slot of the test's own: the key's first `/` splits, `--key-null-id` sends a
//! NULL id, `--discard` calls `outbox_discard`), then one line saying the running relay has stored
//! past the request's transaction.

use std::time::Duration;

use serde_json::{Value, json};
use tokio_postgres::Client;

use super::{emitted, watch_messages};
use crate::ops::{free_addr, try_get};
use crate::support::{PgServer, ROLE_PASSWORD, Scenario, run_command, wait_for};

const LIMIT: Duration = Duration::from_secs(90);

/// The control messages' contents the watching slot holds, in order (the relay's own slot has
/// passed them by then).
async fn contents(client: &Client, watch: &(String, String)) -> Vec<Value> {
    emitted(client, watch)
        .await
        .into_iter()
        .filter(|m| m.prefix.starts_with("outbox-relay.control"))
        .map(|m| m.content)
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
    let addr = free_addr();
    let mut s = Scenario::builder()
        .default_outbox()
        .http_listen(&addr)
        .start()
        .await;
    let env = s.env();

    let missing = run_command(&["requeue", "--key", "Claim/4711", "--force"], &env, LIMIT);
    assert_eq!(missing.status.code(), Some(1), "{}", missing.stdout);
    let line = one_error_line(&missing.stderr);
    assert!(
        line.contains("outbox_requeue(text, text) is not installed")
            && line.contains("run sql/09_requeue.sql"),
        "{line}"
    );

    s.install_operator_role(&[]);
    let watch = watch_messages(&s.client, &s.db).await;
    let relay = s.run_binary();
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
        contents(&s.client, &watch).await,
        vec![
            json!({"op": "requeue", "aggregate_type": "Claim", "aggregate_id": "2026/4711", "request": requeued}),
            json!({"op": "discard", "aggregate_type": "Claim", "aggregate_id": null, "request": discarded}),
            json!({"op": "requeue_event", "event_id": "e-1", "request": event_request}),
        ]
    );
    drop(relay);
}

/// Installed for another relay's name, `requeue` says so and how to install it for this one; a
/// login without the operator role is refused with the grant to give, and a member of it may.
#[tokio::test]
async fn requeue_names_another_relays_prefix_and_the_grant_a_refused_login_needs() {
    let server = PgServer::shared();
    let mut s = Scenario::builder().start().await;
    let mut env = s.env();
    s.install_operator_role(&[("relay_name", "orders")]);
    let op = s.operator().to_owned();

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
    let nobody = s.login_role("nobody", None);
    let member = s.login_role("member", Some(&op));
    let refused = run_command(
        &[
            "requeue",
            "--key",
            "Claim/4711",
            "--force",
            "--postgres-url",
            &server.url_as(&nobody, ROLE_PASSWORD, s.db.name()),
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
            &server.url_as(&member, ROLE_PASSWORD, s.db.name()),
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
}
