//! Authentication and TLS of the replication connection (reference §1, §7 test 11), against the roles
//! and the CA the test server was set up with.

use outbox_relay::source::{ReplConnection, SourceError};

use super::connect;
use crate::support::{PgServer, TestDb};

async fn must_connect(url: &str) -> ReplConnection {
    let mut conn = connect(url)
        .await
        .unwrap_or_else(|e| panic!("connect {url}: {e}"));
    let system = conn
        .identify_system()
        .await
        .unwrap_or_else(|e| panic!("IDENTIFY_SYSTEM over {url}: {e}"));
    assert!(system.dbname.is_some(), "{system:?}");
    conn
}

/// `pg_stat_ssl.ssl` of a backend, asked over another connection.
async fn uses_ssl(db: &TestDb, pid: i32) -> bool {
    db.client()
        .await
        .query_one("SELECT ssl FROM pg_stat_ssl WHERE pid = $1", &[&pid])
        .await
        .unwrap_or_else(|e| panic!("pg_stat_ssl of {pid}: {e}"))
        .get(0)
}

#[tokio::test]
async fn scram_and_md5_log_in_and_bad_passwords_are_definite() {
    let server = PgServer::shared();
    let db = TestDb::create(server).await;
    let plain =
        |user: &str, pw: &str| format!("{}?sslmode=disable", server.url_as(user, pw, db.name()));

    must_connect(&plain("scram_user", "scram_pw"))
        .await
        .close()
        .await;
    must_connect(&plain("md5_user", "md5_pw"))
        .await
        .close()
        .await;

    for user in ["scram_user", "md5_user"] {
        let e = match connect(&plain(user, "wrong")).await {
            Ok(_) => panic!("{user} logged in with a wrong password"),
            Err(e) => e,
        };
        assert_eq!(e.sqlstate(), Some("28P01"), "{e}");
        assert!(!e.is_transient(), "{e}");
        assert!(
            e.to_string().contains("password authentication failed"),
            "{e}"
        );
    }

    let url = format!(
        "postgres://scram_user@{}:{}/{}?sslmode=disable",
        server.host(),
        server.port(),
        db.name()
    );
    let e = match connect(&url).await {
        Ok(_) => panic!("logged in without a password"),
        Err(e) => e,
    };
    assert!(matches!(e, SourceError::Auth(_)), "{e:?}");
    let message = e.to_string();
    assert!(
        message.contains("scram_user") && message.contains("password required"),
        "{message}"
    );
    assert!(!e.is_transient());
}

#[tokio::test]
async fn sslmodes_encrypt_verify_and_reject_an_unknown_ca() {
    let server = PgServer::shared();
    let db = TestDb::create(server).await;
    let base = server.url_as("scram_user", "scram_pw", db.name());
    let ca = server.ca_cert_path().display().to_string();

    // require: TLS, and SCRAM over it (with channel binding, the server offers -PLUS over TLS).
    let conn = must_connect(&format!("{base}?sslmode=require")).await;
    assert!(uses_ssl(&db, conn.backend_pid()).await, "require");
    conn.close().await;

    let conn = must_connect(&format!("{base}?sslmode=disable")).await;
    assert!(!uses_ssl(&db, conn.backend_pid()).await, "disable");
    conn.close().await;

    // verify-full: the certificate names 127.0.0.1 and localhost.
    for host in ["127.0.0.1", "localhost"] {
        let url = format!(
            "postgres://scram_user:scram_pw@{host}:{}/{}?sslmode=verify-full&sslrootcert={ca}",
            server.port(),
            db.name()
        );
        let conn = must_connect(&url).await;
        assert!(uses_ssl(&db, conn.backend_pid()).await, "{url}");
        conn.close().await;
    }

    // verify-full against a CA that did not sign the server certificate.
    let other_ca = {
        use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair};
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(DnType::CommonName, "some other CA");
        let cert = params.self_signed(&KeyPair::generate().unwrap()).unwrap();
        let file = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(file.path(), cert.pem()).unwrap();
        file
    };
    let url = format!(
        "{base}?sslmode=verify-full&sslrootcert={}",
        other_ca.path().display()
    );
    let e = match connect(&url).await {
        Ok(_) => panic!("verify-full accepted a server certificate from an unknown CA"),
        Err(e) => e,
    };
    assert!(matches!(e, SourceError::Tls(_)), "{e:?}");
    assert!(!e.is_transient(), "{e}");
}
