//! Smoke tests of the test environment itself: the shared Postgres decodes pgoutput from a logical
//! slot, JetStream deduplicates by `Nats-Msg-Id`, the fault-injection hooks (stop, restart, kill) bring
//! servers back, and the auth/TLS setup the relay's tests rely on is really there. When these fail, the
//! relay is not the problem.

use std::process::Command;

use async_nats::HeaderMap;
use async_nats::header::NATS_MESSAGE_ID;
use async_nats::jetstream::stream::{Config, StorageType};

use crate::support::{NatsServer, PgServer, TestDb, unique};

#[tokio::test]
async fn shared_postgres_is_15_or_later_with_logical_wal() {
    let pg = PgServer::shared();
    assert!(pg.version_num() >= 150000, "version {}", pg.version_num());
    assert_eq!(pg.psql("postgres", "SHOW wal_level"), "logical");
}

#[tokio::test]
async fn pgoutput_slot_sees_insert_and_jetstream_dedups() {
    let db = TestDb::create(PgServer::shared()).await;
    let client = db.client().await;
    let (slot, publication) = (db.slot_name(), db.publication_name());
    client
        .batch_execute(&format!(
            "CREATE TABLE smoke (id bigint PRIMARY KEY, body text NOT NULL);
             CREATE PUBLICATION {publication} FOR TABLE smoke;"
        ))
        .await
        .unwrap();
    client
        .query_one(
            "SELECT lsn FROM pg_create_logical_replication_slot($1, 'pgoutput')",
            &[&slot],
        )
        .await
        .unwrap();
    client
        .execute("INSERT INTO smoke VALUES (1, 'claim 4711 approved')", &[])
        .await
        .unwrap();
    let rows = client
        .query(
            "SELECT data FROM pg_logical_slot_peek_binary_changes($1, NULL, NULL, \
             'proto_version', '1', 'publication_names', $2)",
            &[&slot, &publication],
        )
        .await
        .unwrap();
    assert!(!rows.is_empty(), "no changes decoded from slot {slot}");
    let messages: Vec<Vec<u8>> = rows.iter().map(|r| r.get(0)).collect();
    let insert = messages
        .iter()
        .find(|m| m.first() == Some(&b'I'))
        .unwrap_or_else(|| panic!("no 'I' message in {messages:?}"));
    assert!(
        insert
            .windows(b"claim 4711 approved".len())
            .any(|w| w == b"claim 4711 approved"),
        "insert message lacks the row: {insert:?}"
    );

    let nats = NatsServer::start();
    let js = nats.jetstream().await;
    let stream = js
        .create_stream(Config {
            name: unique("smoke"),
            subjects: vec!["smoke.>".into()],
            storage: StorageType::File,
            ..Default::default()
        })
        .await
        .unwrap();
    let mut headers = HeaderMap::new();
    headers.insert(NATS_MESSAGE_ID, "e-5531");
    let publish = || async {
        js.publish_with_headers("smoke.claim", headers.clone(), "claim 4711 approved".into())
            .await
            .unwrap()
            .await
            .unwrap()
    };
    let first = publish().await;
    assert!(!first.duplicate);
    let again = publish().await;
    assert!(again.duplicate, "same Nats-Msg-Id was stored twice");
    assert_eq!(again.sequence, first.sequence);

    let message = stream.get_raw_message(first.sequence).await.unwrap();
    assert_eq!(&message.payload[..], b"claim 4711 approved");
    assert_eq!(
        message.headers.get(NATS_MESSAGE_ID).map(|v| v.as_str()),
        Some("e-5531")
    );
}

#[tokio::test]
async fn servers_answer_again_after_stop_restart_and_kill() {
    let pg = PgServer::start_private();
    pg.psql(
        "postgres",
        "CREATE TABLE t (x int); INSERT INTO t VALUES (1);",
    );
    let port = pg.port();
    pg.stop();
    assert!(
        std::net::TcpStream::connect(("127.0.0.1", port)).is_err(),
        "Postgres still listening after stop"
    );
    pg.start();
    assert_eq!(pg.psql("postgres", "SELECT count(*) FROM t"), "1");
    pg.restart();
    pg.psql("postgres", "INSERT INTO t VALUES (2)");
    pg.kill();
    pg.start();
    assert_eq!(pg.port(), port);
    assert_eq!(pg.psql("postgres", "SELECT count(*) FROM t"), "2");

    let nats = NatsServer::start();
    let name = unique("restart");
    let js = nats.jetstream().await;
    js.create_stream(Config {
        name: name.clone(),
        subjects: vec!["restart.>".into()],
        storage: StorageType::File,
        ..Default::default()
    })
    .await
    .unwrap();
    js.publish("restart.a", "one".into())
        .await
        .unwrap()
        .await
        .unwrap();
    nats.stop();
    assert!(
        std::net::TcpStream::connect(("127.0.0.1", nats.port())).is_err(),
        "nats-server still listening after stop"
    );
    nats.start_again();
    let js = nats.jetstream().await;
    let mut stream = js.get_stream(&name).await.unwrap();
    assert_eq!(stream.info().await.unwrap().state.messages, 1);
    nats.kill();
    nats.start_again();
    // A fresh client: a request the old one sent into the dead connection times out (5 s) before
    // its reconnect, which is the relay's problem to handle, not this smoke test's.
    let js = nats.jetstream().await;
    let mut stream = js.get_stream(&name).await.unwrap();
    assert_eq!(stream.info().await.unwrap().config.name, name);
}

#[tokio::test]
async fn password_roles_and_tls_are_set_up() {
    let pg = PgServer::shared();
    assert_eq!(
        pg.psql(
            "postgres",
            "SELECT rolname || ':' || left(rolpassword, 3) FROM pg_authid \
             WHERE rolname IN ('md5_user', 'scram_user') ORDER BY rolname",
        ),
        "md5_user:md5\nscram_user:SCR"
    );
    // verify-full checks the chain to ca.crt and the host name: the relay's TLS tests rely on it.
    let conninfo = format!(
        "host=localhost port={} dbname=postgres user=scram_user sslmode=verify-full sslrootcert={}",
        pg.port(),
        pg.ca_cert_path().display()
    );
    let out = Command::new(pg.client_bin_dir().join("psql"))
        .args([
            "-X",
            "-A",
            "-t",
            "-c",
            "SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()",
        ])
        .arg(conninfo)
        .env("PGPASSWORD", "scram_pw")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "psql over TLS as scram_user: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "t");
}
