//! Authentication and TLS of the replication connection (docs/pgoutput.md, "The connection" and
//! classic bug 11), against the roles
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

/// libpq's `channel_binding=require` and `require_auth`, on both connections: without TLS there is no
/// channel binding, so the login is refused before a password is sent; an md5 role is refused by
/// `require_auth=scram-sha-256`; over TLS with SCRAM both pass.
#[tokio::test]
async fn channel_binding_and_require_auth_refuse_a_downgrade() {
    let server = PgServer::shared();
    let db = TestDb::create(server).await;
    let url = |user: &str, pw: &str, params: &str| {
        format!("{}?{params}", server.url_as(user, pw, db.name()))
    };
    let refused = |e: SourceError, what: &str| {
        assert!(matches!(e, SourceError::Auth(_)), "{what}: {e:?}");
        assert!(!e.to_string().contains("scram_pw") && !e.to_string().contains("md5_pw"));
        e.to_string()
    };

    // No TLS: nothing to bind to.
    let plain = url(
        "scram_user",
        "scram_pw",
        "sslmode=disable&channel_binding=require",
    );
    let e = connect(&plain).await.err().expect("refused without TLS");
    let text = refused(e, "replication, no TLS");
    assert!(text.contains("channel_binding=require"), "{text}");
    let info = outbox_relay::source::ConnInfo::parse(&plain).unwrap();
    let Err(e) = outbox_relay::source::connect_control(&info, "test").await else {
        panic!("control connection accepted without TLS")
    };
    let text = refused(e, "control, no TLS");
    assert!(text.contains("channel binding"), "{text}");

    // An md5 role under require_auth=scram-sha-256: refused before the hash is sent.
    let md5 = url(
        "md5_user",
        "md5_pw",
        "sslmode=disable&require_auth=scram-sha-256",
    );
    let e = connect(&md5).await.err().expect("md5 refused");
    let text = refused(e, "replication, md5");
    assert!(
        text.contains("md5") && text.contains("require_auth"),
        "{text}"
    );
    let info = outbox_relay::source::ConnInfo::parse(&md5).unwrap();
    let Err(e) = outbox_relay::source::connect_control(&info, "test").await else {
        panic!("control connection accepted md5")
    };
    let text = refused(e, "control, md5");
    assert!(text.contains("require_auth"), "{text}");

    // TLS and SCRAM: both settings are satisfied.
    let good = url(
        "scram_user",
        "scram_pw",
        "sslmode=require&channel_binding=require&require_auth=scram-sha-256",
    );
    must_connect(&good).await.close().await;
    let info = outbox_relay::source::ConnInfo::parse(&good).unwrap();
    outbox_relay::source::connect_control(&info, "test")
        .await
        .unwrap_or_else(|e| panic!("control over TLS with SCRAM: {e}"));
}
