//! sql/09_requeue.sql against a real Postgres: it installs again without an error, creates its
//! operator role NOLOGIN when missing, keeps EXECUTE from PUBLIC and from every role without the
//! grant (42501), and each function writes exactly one transactional logical message whose prefix
//! and JSON content are the relay's control message, read back from a pgoutput slot with
//! `messages 'true'` and decoded by the relay's own decoder. A relay's name makes the prefix, and
//! values that look like SQL or JSON injection (quotes, line breaks) arrive as string data. The script
//! installs in one transaction: a run failing part way leaves nothing behind.

use outbox_relay::Lsn;
use serde_json::json;
use tokio_postgres::{Client, NoTls};

use super::{emitted, watch_messages};
use crate::support::{PgServer, Scenario, TestDb, requeue_sql, requeue_sql_with};

const PG_PASSWORD: &str = "operator-pw";

/// A client logged in as `role` (created LOGIN, in `member_of` when given) on `db`.
async fn login(server: &PgServer, db: &TestDb, role: &str, member_of: Option<&str>) -> Client {
    let member = member_of.map_or(String::new(), |r| format!(" IN ROLE {r}"));
    db.psql(&format!(
        "CREATE ROLE {role} LOGIN PASSWORD '{PG_PASSWORD}'{member}"
    ));
    let (client, connection) =
        tokio_postgres::connect(&server.url_as(role, PG_PASSWORD, db.name()), NoTls)
            .await
            .unwrap_or_else(|e| panic!("connect as {role}: {e}"));
    tokio::spawn(connection);
    client
}

/// The three calls, as a caller makes them.
const CALLS: [&str; 3] = [
    "SELECT request::text, lsn::text FROM public.outbox_requeue('Claim', '4711')",
    "SELECT request::text, lsn::text FROM public.outbox_discard('Claim', '4711')",
    "SELECT request::text, lsn::text FROM public.outbox_requeue_event('e-1')",
];

/// The default operator role, on a server of its own (roles are the server's, and another test
/// may install the script at the same time): created NOLOGIN, granted EXECUTE; a role without the
/// grant is refused each function (42501), a member of the operator role may call each; and the
/// script runs again without an error.
#[tokio::test]
async fn the_functions_install_again_and_only_the_operator_role_may_call_them() {
    let server = PgServer::start_private();
    let db = TestDb::create(&server).await;
    db.psql(&requeue_sql());
    db.psql(&requeue_sql());
    assert_eq!(
        db.psql("SELECT rolcanlogin FROM pg_roles WHERE rolname = 'outbox_operator'"),
        "f",
        "the operator role is created NOLOGIN"
    );
    assert_eq!(
        db.psql(
            "SELECT count(*) FROM pg_proc p, aclexplode(p.proacl) a \
             WHERE p.proname IN ('outbox_requeue', 'outbox_discard', 'outbox_requeue_event') \
               AND a.grantee = 0"
        ),
        "0",
        "PUBLIC may execute none of them"
    );
    let nobody = login(&server, &db, "nobody", None).await;
    for call in CALLS {
        let e = nobody
            .query_one(call, &[])
            .await
            .expect_err(&format!("{call} as a role without the grant"));
        let code = e.as_db_error().map(|d| d.code().code().to_owned());
        assert_eq!(code.as_deref(), Some("42501"), "{call}: {e}");
    }
    let alice = login(&server, &db, "alice", Some("outbox_operator")).await;
    for call in CALLS {
        let row = alice
            .query_one(call, &[])
            .await
            .unwrap_or_else(|e| panic!("{call} as a member of outbox_operator: {e}"));
        let request: String = row.get(0);
        let lsn: String = row.get(1);
        assert_eq!(request.len(), 36, "a uuid: {request}");
        lsn.parse::<Lsn>()
            .unwrap_or_else(|e| panic!("{call}: lsn {lsn}: {e}"));
    }
}

/// Calls `call` (which returns request and lsn) and says what it returned.
async fn call(
    client: &Client,
    call: &str,
    args: &[&(dyn tokio_postgres::types::ToSql + Sync)],
) -> (String, Lsn) {
    let row = client
        .query_one(call, args)
        .await
        .unwrap_or_else(|e| panic!("{call}: {e}"));
    let lsn: String = row.get(1);
    (row.get(0), lsn.parse().expect("lsn parses"))
}

/// Each function writes one transactional message with prefix `outbox-relay.control` and exactly
/// the JSON of its op (no other key; a NULL aggregate id as JSON null), at the LSN it returns.
#[tokio::test]
async fn each_function_emits_one_transactional_control_message_with_exactly_its_json() {
    let s = Scenario::builder().operator_role().start().await;
    let client = &s.client;
    let watch = watch_messages(client, &s.db).await;
    let (requeue, requeue_lsn) = call(
        client,
        "SELECT request::text, lsn::text FROM outbox_requeue($1, $2)",
        &[&"Claim", &"4711"],
    )
    .await;
    let (discard, discard_lsn) = call(
        client,
        "SELECT request::text, lsn::text FROM outbox_discard($1, $2)",
        &[&"Claim", &None::<&str>],
    )
    .await;
    let (event, event_lsn) = call(
        client,
        "SELECT request::text, lsn::text FROM outbox_requeue_event($1)",
        &[&"6f1c-e1"],
    )
    .await;
    let got = emitted(client, &watch).await;
    assert_eq!(got.len(), 3, "one message a call: {got:?}");
    let want = [
        (
            requeue_lsn,
            json!({"op": "requeue", "aggregate_type": "Claim", "aggregate_id": "4711", "request": requeue}),
        ),
        (
            discard_lsn,
            json!({"op": "discard", "aggregate_type": "Claim", "aggregate_id": null, "request": discard}),
        ),
        (
            event_lsn,
            json!({"op": "requeue_event", "event_id": "6f1c-e1", "request": event}),
        ),
    ];
    for (m, (lsn, content)) in got.iter().zip(want) {
        assert!(m.transactional, "{m:?}");
        assert_eq!(m.prefix, "outbox-relay.control", "{m:?}");
        assert_eq!(m.lsn, lsn, "the LSN the function returned: {m:?}");
        assert_eq!(m.content, content);
    }
    let refused = client
        .query_one("SELECT * FROM outbox_requeue(NULL, '4711')", &[])
        .await
        .expect_err("a key without its type");
    let message = refused.as_db_error().map(|d| d.message().to_owned());
    assert!(
        message
            .as_deref()
            .is_some_and(|m| m.contains("needs its aggregate type")),
        "{refused:?}"
    );
    // A key the relay would not read (its control message over 1 MiB) is refused, not written.
    let long = "x".repeat(1024 * 1024);
    let refused = client
        .query_one("SELECT * FROM outbox_discard('Claim', $1)", &[&long])
        .await
        .expect_err("a key longer than a control message may be");
    let message = refused.as_db_error().map(|d| d.message().to_owned());
    assert!(
        message
            .as_deref()
            .is_some_and(|m| m.contains("too long for a control message")),
        "{refused:?}"
    );
}

/// `-v relay_name=orders` makes the prefix `outbox-relay.control.orders`; a type and id full of
/// quotes, line breaks and JSON arrive as the strings they are; a name no relay can have is refused
/// with a line naming `relay_name`.
#[tokio::test]
async fn a_relays_name_makes_the_prefix_and_injection_looking_values_arrive_as_data() {
    let mut s = Scenario::builder().start().await;
    s.install_operator_role(&[("relay_name", "orders")]);
    let client = &s.client;
    let watch = watch_messages(client, &s.db).await;
    let hostile_type = "Cl'aim\", \"op\": \"discard";
    let hostile_id = "4711'); SELECT pg_logical_emit_message(true, 'x', 'y'); --\n\"}\\";
    let (request, _) = call(
        client,
        "SELECT request::text, lsn::text FROM outbox_requeue($1, $2)",
        &[&hostile_type, &hostile_id],
    )
    .await;
    let got = emitted(client, &watch).await;
    assert_eq!(got.len(), 1, "{got:?}");
    assert_eq!(got[0].prefix, "outbox-relay.control.orders");
    assert_eq!(
        got[0].content,
        json!({"op": "requeue", "aggregate_type": hostile_type, "aggregate_id": hostile_id, "request": request})
    );
    let (db, op) = (&s.db, s.operator());
    let bad = std::panic::catch_unwind(|| {
        db.psql(&requeue_sql_with(&[
            ("operator_role", op),
            ("relay_name", "Orders-2"),
        ]))
    })
    .expect_err("a name no relay can have");
    let text = bad.downcast_ref::<String>().cloned().unwrap_or_default();
    assert!(
        text.contains("relay_name 'Orders-2' must be a relay's name"),
        "{text}"
    );
}

/// The script installs in one transaction: a run that fails part way leaves nothing behind, so no
/// moment exists in which its functions are there but still executable by PUBLIC (a new function
/// is, until the script's REVOKE). Shown by a run that fails at the functions (their schema does not
/// exist) after the step that creates the operator role: the role must not be left either.
#[tokio::test]
async fn a_run_that_fails_part_way_leaves_nothing_installed() {
    let db = TestDb::create(PgServer::shared()).await;
    let failed = std::panic::catch_unwind(|| {
        db.psql(&requeue_sql_with(&[
            ("operator_role", "ops_half_installed"),
            ("requeue_schema", "no_such_schema"),
        ]))
    });
    assert!(failed.is_err(), "the functions' schema does not exist");
    assert_eq!(
        db.psql("SELECT count(*) FROM pg_roles WHERE rolname = 'ops_half_installed'"),
        "0",
        "the role created before the failing step was rolled back with it"
    );
}
