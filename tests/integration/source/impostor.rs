//! A server in the middle that plays Postgres just far enough to try to get past SCRAM without knowing
//! the password: it offers SCRAM-SHA-256-PLUS over TLS, then either says AuthenticationOk right after
//! the client's first SCRAM message, or sends an AuthenticationSASLFinal whose server signature it
//! made up. Either way it would go on to play the walsender, so both connections (replication and
//! control) must refuse before ReadyForQuery, whatever `sslmode`, `channel_binding` and
//! `require_auth` say. libpq refuses both ("server did not complete authentication").
//!
//! The impostor is not a mock of Postgres: it is the attacker, and the client under test is real.

use std::sync::Arc;
use std::time::Duration;

use outbox_relay::source::{ConnInfo, ReplConnection, SourceError, connect_control};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpListener;

/// How the impostor ends the SCRAM exchange.
#[derive(Debug, Clone, Copy)]
enum Trick {
    /// AuthenticationOk right after SASLInitialResponse.
    EarlyOk,
    /// A full exchange whose AuthenticationSASLFinal carries a signature it cannot have computed.
    ForgedFinal,
    /// A message header announcing half a gigabyte, then silence.
    HugeFrame,
}

/// A TLS acceptor with a fresh self-signed certificate for 127.0.0.1 (`sslmode=require` does not
/// check it; a man in the middle with any certificate is the case to refuse).
fn acceptor() -> tokio_rustls::TlsAcceptor {
    let key = rcgen::KeyPair::generate().expect("key");
    let params = rcgen::CertificateParams::new(vec!["127.0.0.1".to_string()]).expect("cert params");
    let cert = params.self_signed(&key).expect("self-sign");
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("versions")
        .with_no_client_auth()
        .with_single_cert(
            vec![CertificateDer::from(cert.der().to_vec())],
            PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der())),
        )
        .expect("server config");
    tokio_rustls::TlsAcceptor::from(Arc::new(config))
}

fn auth(code: u32, payload: &[u8]) -> Vec<u8> {
    let mut m = vec![b'R'];
    m.extend(((8 + payload.len()) as u32).to_be_bytes());
    m.extend(code.to_be_bytes());
    m.extend(payload);
    m
}

/// What a real server sends after AuthenticationOk, up to ReadyForQuery.
fn welcome() -> Vec<u8> {
    let mut m = Vec::new();
    for (k, v) in [
        ("server_version", "17.0"),
        ("in_hot_standby", "off"),
        ("default_transaction_read_only", "off"),
    ] {
        let body = [k.as_bytes(), b"\0", v.as_bytes(), b"\0"].concat();
        m.push(b'S');
        m.extend(((4 + body.len()) as u32).to_be_bytes());
        m.extend(body);
    }
    m.extend([b'K', 0, 0, 0, 12, 0, 0, 0, 42, 0, 0, 0, 7]);
    m.extend([b'Z', 0, 0, 0, 5, b'I']);
    m
}

/// One frontend message after the startup packet: its body.
async fn read_message<S: AsyncRead + Unpin>(s: &mut S) -> std::io::Result<Vec<u8>> {
    let _tag = s.read_u8().await?;
    let len = s.read_u32().await? as usize;
    let mut body = vec![0; len.saturating_sub(4)];
    s.read_exact(&mut body).await?;
    Ok(body)
}

/// The client nonce of a SASLInitialResponse body (`mechanism\0 len data`, data = `gs2,,n=,r=NONCE`).
fn client_nonce(body: &[u8]) -> String {
    let nul = body.iter().position(|b| *b == 0).expect("mechanism");
    let data = String::from_utf8_lossy(&body[nul + 5..]).into_owned();
    let bare = data
        .splitn(3, ',')
        .nth(2)
        .expect("client-first-message-bare");
    bare.split(',')
        .find_map(|kv| kv.strip_prefix("r="))
        .expect("nonce")
        .to_owned()
}

/// Plays the trick on one connection: TLS, the startup packet, SCRAM up to the trick, then the
/// welcome a walsender would send.
async fn play<S: AsyncRead + AsyncWrite + Unpin>(mut s: S, trick: Trick) -> std::io::Result<()> {
    let len = s.read_u32().await? as usize;
    let mut startup = vec![0; len - 4];
    s.read_exact(&mut startup).await?;
    if let Trick::HugeFrame = trick {
        s.write_all(&[b'R', 0x20, 0, 0, 0]).await?;
        s.flush().await?;
        let mut rest = [0u8; 1024];
        while s.read(&mut rest).await? > 0 {}
        return Ok(());
    }
    s.write_all(&auth(10, b"SCRAM-SHA-256-PLUS\0SCRAM-SHA-256\0\0"))
        .await?;
    let first = read_message(&mut s).await?;
    match trick {
        Trick::EarlyOk | Trick::HugeFrame => s.write_all(&auth(0, &[])).await?,
        Trick::ForgedFinal => {
            let nonce = format!("{}impostor", client_nonce(&first));
            let server_first = format!("r={nonce},s=c2FsdHNhbHRzYWx0,i=4096");
            s.write_all(&auth(11, server_first.as_bytes())).await?;
            read_message(&mut s).await?;
            let forged = "v=AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=";
            s.write_all(&auth(12, forged.as_bytes())).await?;
            s.write_all(&auth(0, &[])).await?;
        }
    }
    s.write_all(&welcome()).await?;
    s.flush().await?;
    // Hold the connection so the client, not a closed socket, decides the outcome.
    let mut rest = [0u8; 1024];
    while s.read(&mut rest).await? > 0 {}
    Ok(())
}

/// Listens on a free loopback port and plays `trick` on every connection.
async fn impostor(trick: Trick) -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let tls = acceptor();
    tokio::spawn(async move {
        while let Ok((mut tcp, _)) = listener.accept().await {
            let tls = tls.clone();
            tokio::spawn(async move {
                let mut ssl_request = [0u8; 8];
                tcp.read_exact(&mut ssl_request).await?;
                tcp.write_all(b"S").await?;
                let stream = tls.accept(tcp).await?;
                play(stream, trick).await
            });
        }
    });
    port
}

fn url(port: u16, params: &str) -> ConnInfo {
    let url = format!("postgres://scram_user:scram_pw@127.0.0.1:{port}/app?{params}");
    ConnInfo::parse(&url).unwrap_or_else(|e| panic!("parse {url}: {e}"))
}

/// The settings a careful user picks against a man in the middle, and the defaults.
const SETTINGS: [&str; 3] = [
    "sslmode=require&channel_binding=require&require_auth=scram-sha-256",
    "sslmode=require&require_auth=scram-sha-256",
    "sslmode=require",
];

async fn refused_by_both(trick: Trick, expect: &str) {
    let port = impostor(trick).await;
    for params in SETTINGS {
        let info = url(port, params);
        let repl = tokio::time::timeout(
            Duration::from_secs(20),
            ReplConnection::connect(&info, "impostor_test"),
        )
        .await
        .expect("replication connect hangs");
        match repl {
            Ok(_) => panic!("replication connection accepted {trick:?} with {params}"),
            Err(e) => {
                assert!(
                    matches!(e, SourceError::Auth(_)),
                    "{trick:?} {params}: {e:?}"
                );
                assert!(e.to_string().contains(expect), "{trick:?} {params}: {e}");
                assert!(!e.to_string().contains("scram_pw"), "{e}");
            }
        }
        let control = tokio::time::timeout(
            Duration::from_secs(20),
            connect_control(&info, "impostor_test"),
        )
        .await
        .expect("control connect hangs");
        if control.is_ok() {
            panic!("control connection accepted {trick:?} with {params}");
        }
    }
}

#[tokio::test]
async fn an_ok_before_scram_finishes_is_refused_on_both_connections() {
    refused_by_both(Trick::EarlyOk, "did not complete SCRAM").await;
}

#[tokio::test]
async fn a_server_signature_that_does_not_verify_is_refused_on_both_connections() {
    refused_by_both(Trick::ForgedFinal, "server signature invalid").await;
}

/// Before authentication every message is tiny: a header announcing 512 MiB is refused at once
/// (not awaited until the connect timeout, and nothing reserved for it).
#[tokio::test]
async fn a_huge_message_before_authentication_is_refused_at_once() {
    let port = impostor(Trick::HugeFrame).await;
    let info = url(port, "sslmode=require&connect_timeout=30");
    let result = tokio::time::timeout(
        Duration::from_secs(10),
        ReplConnection::connect(&info, "impostor_test"),
    )
    .await
    .expect("the connection waited for half a gigabyte");
    match result {
        Ok(_) => panic!("connected to a server that sent a 512 MiB header"),
        Err(e) => assert!(matches!(e, SourceError::FrameTooLarge { .. }), "{e:?}"),
    }
}
