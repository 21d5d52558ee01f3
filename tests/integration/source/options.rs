//! START_REPLICATION options the server cannot honour (docs/pgoutput.md, "Options and protocol
//! versions" and classic bug 8): refused before any
//! byte of streaming with the connection handed back, or, for a missing publication, a server error
//! that names it (up to 17; 18 skips a missing publication and sends nothing).

use std::time::Duration;

use outbox_relay::Lsn;
use outbox_relay::source::{ReplicationEvent, SourceError};

use super::{config, create_slot, options, repl};
use crate::support::{PgServer, TestDb, unique};

#[tokio::test]
async fn unsupported_proto_version_and_origin_are_refused_before_streaming() {
    let server = PgServer::shared();
    let db = TestDb::create(server).await;
    let slot = db.slot_name();
    create_slot(&db, &slot).await;

    let mut opts = options(&db);
    opts.proto_version = Some(5);
    let conn = repl(&db).await;
    let (e, conn) = match conn
        .start_replication(&slot, Lsn::ZERO, &opts, config())
        .await
    {
        Ok(_) => panic!("proto_version 5 accepted"),
        Err(e) => e,
    };
    assert!(matches!(e, SourceError::Protocol(_)), "{e:?}");
    assert!(e.to_string().contains("proto_version 5"), "{e}");
    assert!(!e.is_transient());
    let mut conn = conn.expect("connection back after a refused option");
    conn.identify_system().await.unwrap();

    let mut opts = options(&db);
    opts.origin = Some("none".into());
    let result = conn
        .start_replication(&slot, Lsn::ZERO, &opts, config())
        .await;
    if server.version_num() < 160000 {
        let (e, conn) = match result {
            Ok(_) => panic!("origin accepted on {}", server.version_num()),
            Err(e) => e,
        };
        assert!(
            matches!(e, SourceError::Version { needs: "16", .. }),
            "{e:?}"
        );
        assert!(e.to_string().contains("Postgres 16"), "{e}");
        let mut conn = conn.expect("connection back after a refused option");
        conn.identify_system().await.unwrap();
        conn.close().await;
    } else {
        let stream = result.map_err(|(e, _)| e).expect("origin on 16+");
        stream.stop(Duration::from_secs(5)).await.unwrap();
    }
}

/// Up to 17 a missing publication is a server error once the first change is decoded. 18 skips it
/// instead ("WARNING: skipped loading publication"), so a publication created after the slot can
/// still be used: there the stream stays open and must send no data, only keepalives. (The relay
/// creates or checks its publication before it streams, so a name that never existed stops it there
/// on every version.)
#[tokio::test]
async fn missing_publication_is_a_server_error_naming_it() {
    let server = PgServer::shared();
    let db = TestDb::create(server).await;
    let client = db.client().await;
    client
        .batch_execute("CREATE TABLE t (id int PRIMARY KEY)")
        .await
        .unwrap();
    let slot = db.slot_name();
    create_slot(&db, &slot).await;
    // PG15 loads publications when the first change is decoded, so give it one.
    client
        .batch_execute("INSERT INTO t VALUES (1)")
        .await
        .unwrap();

    let missing = unique("no_such_pub");
    let mut opts = options(&db);
    opts.publication_names = vec![missing.clone()];
    let result = repl(&db)
        .await
        .start_replication(&slot, Lsn::ZERO, &opts, config())
        .await;
    // Bounded as a whole: keepalives alone must not keep the test waiting.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    let e = match result {
        Err((e, _)) => e,
        Ok(mut stream) => loop {
            match tokio::time::timeout_at(deadline, stream.recv()).await {
                Ok(Some(Ok(ReplicationEvent::Keepalive { .. }))) => {}
                Ok(Some(Ok(other))) => panic!("data for a missing publication: {other:?}"),
                Ok(Some(Err(e))) => break e,
                Ok(None) => panic!("stream ended without an error"),
                Err(_) if server.version_num() >= 180000 => {
                    // Nothing but keepalives for 15 s after a decodable insert: skipped, as 18 does.
                    stream.stop(Duration::from_secs(5)).await.unwrap();
                    return;
                }
                Err(_) => panic!("no error within 15 s for a missing publication"),
            }
        },
    };
    assert!(
        server.version_num() < 180000,
        "18 skips a missing publication, yet: {e:?}"
    );
    assert!(matches!(e, SourceError::Server { .. }), "{e:?}");
    let message = e.to_string();
    assert!(
        message.contains(&missing) && message.contains("does not exist"),
        "{message}"
    );
    assert!(!e.is_transient(), "{e}");
}
