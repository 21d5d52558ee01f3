//! sql/06's `outbox_message()` publishes with the default configuration (`outbox.message_prefix`
//! defaults to the helper's prefix, "outbox"), and `setup` and `status` warn, one line naming
//! `outbox.message_prefix` and the fix, whenever the helper is installed but its prefix is not
//! relayed (`""`, the explicit opt-out, or another prefix). Against real Postgres and NATS, through
//! the binary with no `OUTBOX_RELAY_OUTBOX_MESSAGE_PREFIX` at all where the default is meant.

use std::time::Duration;

use crate::support::{
    NatsServer, PgServer, RelayProcess, TestDb, default_outbox_sql, read_all, relay_config,
    relay_env, run_command, wait_for,
};

const LIMIT: Duration = Duration::from_secs(60);

/// sql/06 as shipped, with psql variables set first (`-v name=value` in the docs).
pub(crate) fn sql_06(vars: &[(&str, &str)]) -> String {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/sql/06_outbox_message.sql");
    let script = std::fs::read_to_string(path).expect("read sql/06");
    let mut out = String::new();
    for (k, v) in vars {
        out.push_str(&format!("\\set {k} {v}\n"));
    }
    out + &script
}

/// The warning line about an installed helper whose prefix this relay does not relay.
pub(crate) fn helper_warning(stdout: &str) -> Option<&str> {
    stdout.lines().find(|l| {
        l.starts_with("warning[unrelayed-message-helper]:")
            && l.contains("(sql/06_outbox_message.sql) writes events")
    })
}

/// With the default configuration (the binary gets no message prefix at all), an event written with
/// `outbox_message()` arrives in the stream, and setup says nothing about an unrelayed helper. Before
/// the default was "outbox", the relay did not even ask pgoutput for messages: nothing arrived.
#[tokio::test]
async fn with_the_default_config_an_outbox_message_event_arrives_in_the_stream() {
    let db = TestDb::create(PgServer::shared()).await;
    db.psql(&default_outbox_sql());
    db.psql(&sql_06(&[]));
    let nats = NatsServer::start();
    let config = relay_config(&db, &nats);
    let env = relay_env(&config);
    assert!(
        !env.iter().any(|(k, _)| k.contains("MESSAGE_PREFIX")),
        "the default is what is tested"
    );
    let setup = run_command(&["setup"], &env, LIMIT);
    assert!(setup.status.success(), "setup: {}", setup.stderr);

    let mut relay = RelayProcess::spawn(&["run"], &env);
    let client = db.client().await;
    let slot = config.postgres.slot.clone();
    wait_for("the relay streaming its slot", LIMIT, || async {
        client
            .query_one(
                "SELECT coalesce((SELECT active FROM pg_replication_slots WHERE slot_name = $1), false)",
                &[&slot],
            )
            .await
            .unwrap()
            .get::<_, bool>(0)
    })
    .await;
    let id: String = client
        .query_one(
            "SELECT outbox_message('Claim', '4712', 'ClaimApproved', '{\"claim_id\": 4712}')",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let js = nats.jetstream().await;
    let stream = config.nats.stream.clone();
    let mut stored = Vec::new();
    for _ in 0..150 {
        stored = read_all(&js, &stream).await;
        if !stored.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    relay.signal("TERM");
    let exited = relay.wait(LIMIT);
    assert_eq!(
        stored.len(),
        1,
        "the helper's event in stream {stream} with the default config; the relay's log:\n{}",
        relay.stderr()
    );
    assert_eq!(stored[0].id(), id);
    assert_eq!(stored[0].subject, "outbox.Claim");
    assert_eq!(stored[0].payload_str(), r#"{"claim_id": 4712}"#);
    assert_eq!(exited.and_then(|s| s.code()), Some(0), "{}", relay.stderr());
    // The helper's prefix is relayed: setup had nothing to warn about.
    assert_eq!(helper_warning(&setup.stdout), None, "{}", setup.stdout);
}

/// `message_prefix = ""` while sql/06's helper is installed: `setup` and `status` print the same one
/// line naming the helper, `outbox.message_prefix` and the fix. Without the helper, neither warns; with
/// a helper made for another prefix (`-v message_prefix=billing -v function_name=billing_message`)
/// under the default prefix, the line names that helper and its prefix.
#[tokio::test]
async fn setup_and_status_warn_while_the_helper_is_installed_but_its_prefix_is_not_relayed() {
    let db = TestDb::create(PgServer::shared()).await;
    db.psql(&default_outbox_sql());
    let nats = NatsServer::start();
    let config = relay_config(&db, &nats);
    let mut off = relay_env(&config);
    off.push(("OUTBOX_RELAY_OUTBOX_MESSAGE_PREFIX".into(), String::new()));

    // No helper: nothing to warn about.
    let setup = run_command(&["setup"], &off, LIMIT);
    assert!(setup.status.success(), "setup: {}", setup.stderr);
    assert_eq!(helper_warning(&setup.stdout), None, "{}", setup.stdout);

    db.psql(&sql_06(&[]));
    let setup = run_command(&["setup"], &off, LIMIT);
    assert!(setup.status.success(), "setup: {}", setup.stderr);
    let line = helper_warning(&setup.stdout)
        .unwrap_or_else(|| panic!("setup warns about the unrelayed helper:\n{}", setup.stdout))
        .to_owned();
    assert!(
        line.contains("outbox_message(text,text,text,jsonb,jsonb,text)")
            && line.contains("prefix \"outbox\"")
            && line.contains("outbox.message_prefix is \"\" (off)")
            && line.contains("set outbox.message_prefix = \"outbox\""),
        "{line}"
    );
    let status = run_command(&["status"], &off, LIMIT);
    assert_eq!(
        helper_warning(&status.stdout),
        Some(line.as_str()),
        "status warns as setup does:\n{}",
        status.stdout
    );

    // The default relays the helper's prefix: no warning.
    let default = relay_env(&config);
    let status = run_command(&["status"], &default, LIMIT);
    assert_eq!(helper_warning(&status.stdout), None, "{}", status.stdout);

    // A helper for another prefix is compared with its own prefix.
    db.psql(&sql_06(&[
        ("message_prefix", "billing"),
        ("function_name", "billing_message"),
    ]));
    let setup = run_command(&["setup"], &default, LIMIT);
    assert!(setup.status.success(), "setup: {}", setup.stderr);
    let line = helper_warning(&setup.stdout)
        .unwrap_or_else(|| panic!("setup warns about billing_message:\n{}", setup.stdout));
    assert!(
        line.contains("billing_message(")
            && line.contains("prefix \"billing\"")
            && line.contains("outbox.message_prefix is \"outbox\""),
        "{line}"
    );
}
