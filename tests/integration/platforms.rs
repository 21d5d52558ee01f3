//! Postgres as platforms hand it over, against the real test server: a Unix-socket directory as the
//! host (libpq's default on Debian; `peer` authentication included), and a relay role set up the way
//! Amazon RDS and Aurora do it (no REPLICATION attribute, membership of `rds_replication`).

use std::time::Duration;

use outbox_relay::setup::setup;
use outbox_relay::source::{ConnInfo, ReplConnection, connect_control};

use crate::support::{
    InProcessRelay, NatsServer, PgServer, TEXT_ID_OUTBOX_SQL, TestDb, read_all, relay_config,
    stream_count, unique, wait_for,
};

const LIMIT: Duration = Duration::from_secs(60);

/// The server's socket directory (its data directory in the tests).
fn socket_dir(server: &PgServer) -> String {
    server.data_dir().display().to_string()
}

/// A socket directory as the host, in both forms, for both connections; `peer` authentication for
/// the test's own operating-system user; and a relay whose URL names only the socket publishes.
#[tokio::test]
async fn a_unix_socket_directory_serves_both_connections_and_the_relay() {
    let server = PgServer::shared();
    let db = TestDb::create(server).await;
    let dir = socket_dir(server);
    let port = server.port();

    for url in [
        format!("host={dir} port={port} dbname={} user=postgres", db.name()),
        format!(
            "postgres:///{}?host={dir}&port={port}&user=postgres",
            db.name()
        ),
    ] {
        let info = ConnInfo::parse(&url).unwrap_or_else(|e| panic!("{url}: {e}"));
        assert_eq!(info.host, dir);
        let mut repl = ReplConnection::connect(&info, &unique("socket"))
            .await
            .unwrap_or_else(|e| panic!("replication over {url}: {e}"));
        let system = repl.identify_system().await.expect("IDENTIFY_SYSTEM");
        assert_eq!(system.dbname.as_deref(), Some(db.name()));
        repl.close().await;
        let control = connect_control(&info, "socket_test")
            .await
            .unwrap_or_else(|e| panic!("control over {url}: {e}"));
        // No TCP peer address: the server saw a socket connection.
        let addr: Option<String> = control
            .query_one("SELECT inet_client_addr()::text", &[])
            .await
            .expect("query")
            .get(0);
        assert_eq!(addr, None, "{url} went over TCP");
    }

    // peer: the server asks nothing and checks the connecting process's user.
    let os_user = outbox_relay::testkit::os_user();
    server.psql(
        "postgres",
        &format!(
            "DO $$ BEGIN IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '{os_user}') THEN \
             CREATE ROLE \"{os_user}\" LOGIN REPLICATION; END IF; END $$"
        ),
    );
    let peer = format!("host={dir} port={port} dbname={} user={os_user}", db.name());
    let info = ConnInfo::parse(&peer).unwrap();
    let mut repl = ReplConnection::connect(&info, &unique("peer"))
        .await
        .unwrap_or_else(|e| panic!("peer over {peer}: {e}"));
    repl.identify_system()
        .await
        .expect("IDENTIFY_SYSTEM as peer");
    repl.close().await;

    // The relay end to end, with nothing but the socket in its URL.
    db.psql(TEXT_ID_OUTBOX_SQL);
    let nats = NatsServer::start();
    let mut config = relay_config(&db, &nats);
    config.postgres.url = format!("host={dir} port={port} dbname={} user=postgres", db.name());
    let settings = config.validate().expect("valid");
    setup(&settings).await.expect("setup over the socket");
    let relay = InProcessRelay::start(config.clone());
    db.psql(
        "INSERT INTO outbox (event_id, aggregate_type, aggregate_id, event_type, payload) \
         VALUES ('e-5531', 'Claim', '4711', 'ClaimApproved', '{\"claim\": 4711}')",
    );
    let js = async_nats::jetstream::new(nats.client().await);
    wait_for("the event over a socket-connected relay", LIMIT, || async {
        stream_count(&js, &config.nats.stream).await >= 1
    })
    .await;
    relay.stop().await.unwrap();
    let stored = read_all(&js, &config.nats.stream).await;
    assert_eq!(stored.len(), 1);
    assert_eq!(stored[0].id(), "e-5531");
}

/// On RDS and Aurora the relay's role gets no REPLICATION attribute but membership of
/// `rds_replication`. `setup` accepts the membership instead of refusing with its own
/// prerequisite line; a plain server then refuses the walsender with its own error (on RDS it
/// streams). A role with neither is still refused before anything is created, naming both fixes.
#[tokio::test]
async fn an_rds_replication_member_passes_the_role_check() {
    let server = PgServer::shared();
    let db = TestDb::create(server).await;
    db.psql(TEXT_ID_OUTBOX_SQL);
    let rds_user = unique("rds_relay");
    let plain_user = unique("plain_relay");
    server.psql(
        "postgres",
        &format!(
            "DO $$ BEGIN IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'rds_replication') THEN \
             CREATE ROLE rds_replication NOLOGIN; END IF; END $$;\n\
             CREATE ROLE {rds_user} LOGIN PASSWORD 'pw' IN ROLE rds_replication;\n\
             CREATE ROLE {plain_user} LOGIN PASSWORD 'pw';"
        ),
    );
    db.psql(&format!(
        "GRANT SELECT ON outbox TO {rds_user}, {plain_user};\n\
         CREATE PUBLICATION {} FOR TABLE outbox;",
        db.publication_name()
    ));
    let nats = NatsServer::start();
    let with_user = |user: &str| {
        let mut config = relay_config(&db, &nats);
        config.postgres.url = format!("{}?sslmode=disable", server.url_as(user, "pw", db.name()));
        config.validate().expect("valid")
    };

    let e = setup(&with_user(&plain_user))
        .await
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("lacks the REPLICATION attribute") && e.contains("rds_replication"),
        "{e}"
    );

    let e = setup(&with_user(&rds_user)).await.unwrap_err();
    let e = outbox_relay::error_chain::error_chain(&e);
    assert!(
        !e.contains("lacks the REPLICATION attribute"),
        "the member was refused by the relay's own check: {e}"
    );
    // The plain server's own refusal of the walsender, passed on as it is.
    // (PG 15: "must be superuser or replication role to use replication slots"; 16+: "permission
    // denied to use replication slots".)
    assert!(
        e.contains("db error")
            && (e.contains("replication role") || e.contains("permission denied")),
        "the server's reason: {e}"
    );
}
