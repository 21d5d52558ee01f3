//! The relay's NATS connection against servers that demand something: user/password and token auth
//! (in the URL, percent-encoded, or as `nats.user`/`nats.password`/`nats.token`), TLS on a private
//! CA, mutual TLS, `nats.tls_required` against a plain server, and websocket URLs. A server that
//! refuses the relay must say so (credentials refused, TLS failed), never "cannot connect", and never
//! print the secret it refused.

use std::time::Duration;

use async_nats::{ConnectOptions, jetstream};
use outbox_relay::config::Config;
use tokio_postgres::Client;

use super::{LIMIT, assert_no_secret, good, percent_encode, set, start_streaming, text_id_db};
use crate::support::{
    NatsServer, read_all, relay_config, relay_env, run_command, stream_count, wait_for,
};

/// A password with every character a URL treats specially.
const PASSWORD: &str = "p@ss:w/rd%?#1";
const WRONG_PASSWORD: &str = "Wr0ng@pw";
const TOKEN: &str = "t0k3n-s3cr3t";
const WRONG_TOKEN: &str = "t0k3n-wr0ng";

/// Runs an in-process relay with `config` until event `id` is in the stream, then stops it cleanly.
async fn deliver_one(config: &Config, client: &Client, js: &jetstream::Context, id: &str) {
    let relay = start_streaming(config).await;
    good(client, id).await;
    let stream = &config.nats.stream;
    wait_for(&format!("event {id}"), LIMIT, || async {
        stream_count(js, stream).await > 0
            && read_all(js, stream).await.iter().any(|m| m.id() == id)
    })
    .await;
    relay.stop().await.expect("the relay stops cleanly");
}

async fn js(opts: ConnectOptions, url: &str) -> jetstream::Context {
    jetstream::new(
        opts.connect(url)
            .await
            .unwrap_or_else(|e| panic!("test client to {url}: {e}")),
    )
}

/// `setup` with `env` must fail with a line that says the credentials were refused.
fn assert_refused(what: &str, env: &[(String, String)], secrets: &[&str]) {
    let f = run_command(&["setup"], env, LIMIT);
    assert_eq!(f.status.code(), Some(1), "{what}: {}", f.stderr);
    assert!(
        f.stderr.contains("refused the relay's credentials"),
        "{what}: says the credentials were refused: {}",
        f.stderr
    );
    assert!(
        !f.stderr.contains("cannot connect"),
        "{what}: not a connection problem: {}",
        f.stderr
    );
    assert_no_secret(what, &f, secrets);
}

/// User/password auth: the relay delivers with the credentials in the URL (percent-encoded special
/// characters) and with `nats.user`/`nats.password`; a wrong password, either way, fails `setup` with
/// "refused the relay's credentials" and without the password.
#[tokio::test]
async fn nats_user_password_in_the_url_or_as_keys_and_a_wrong_one_is_refused() {
    let nats = NatsServer::start_with_config(&format!(
        "authorization {{\n  user: relay\n  password: {PASSWORD:?}\n}}"
    ));
    let db = text_id_db().await;
    let client = db.client().await;
    let mut config = relay_config(&db, &nats);
    let port = nats.port();
    let js = js(
        ConnectOptions::with_user_and_password("relay".into(), PASSWORD.into()),
        &nats.url(),
    )
    .await;

    config.nats.url = format!("nats://relay:{}@127.0.0.1:{port}", percent_encode(PASSWORD));
    deliver_one(&config, &client, &js, "url-1").await;

    config.nats.url = nats.url();
    config.nats.user = "relay".into();
    config.nats.password = PASSWORD.into();
    deliver_one(&config, &client, &js, "keys-1").await;

    // And a normal event behind both: the stream holds them in order.
    let ids: Vec<String> = read_all(&js, &config.nats.stream)
        .await
        .iter()
        .map(|m| m.id().to_owned())
        .collect();
    assert_eq!(ids, ["url-1", "keys-1"]);

    let mut env = relay_env(&config);
    set(
        &mut env,
        "OUTBOX_RELAY_NATS_URL",
        &format!(
            "nats://relay:{}@127.0.0.1:{port}",
            percent_encode(WRONG_PASSWORD)
        ),
    );
    assert_refused(
        "wrong password in the URL",
        &env,
        &[WRONG_PASSWORD, PASSWORD],
    );
    let mut env = relay_env(&config);
    set(&mut env, "OUTBOX_RELAY_NATS_USER", "relay");
    set(&mut env, "OUTBOX_RELAY_NATS_PASSWORD", WRONG_PASSWORD);
    assert_refused("wrong nats.password", &env, &[WRONG_PASSWORD, PASSWORD]);
}

/// Token auth: `nats://token@host` and `nats.token` both deliver; a wrong token is refused without
/// being shown.
#[tokio::test]
async fn nats_token_in_the_url_or_as_a_key() {
    let nats = NatsServer::start_with_config(&format!("authorization {{\n  token: {TOKEN:?}\n}}"));
    let db = text_id_db().await;
    let client = db.client().await;
    let mut config = relay_config(&db, &nats);
    let js = js(ConnectOptions::with_token(TOKEN.into()), &nats.url()).await;

    config.nats.url = format!("nats://{TOKEN}@127.0.0.1:{}", nats.port());
    deliver_one(&config, &client, &js, "url-1").await;
    config.nats.url = nats.url();
    config.nats.token = TOKEN.into();
    deliver_one(&config, &client, &js, "key-1").await;

    let mut env = relay_env(&config);
    set(&mut env, "OUTBOX_RELAY_NATS_TOKEN", WRONG_TOKEN);
    assert_refused("wrong nats.token", &env, &[WRONG_TOKEN, TOKEN]);
    let mut env = relay_env(&config);
    set(
        &mut env,
        "OUTBOX_RELAY_NATS_URL",
        &format!("nats://{WRONG_TOKEN}@127.0.0.1:{}", nats.port()),
    );
    assert_refused("wrong token in the URL", &env, &[WRONG_TOKEN, TOKEN]);
}

/// `setup` with `env` fails with a line about TLS.
fn assert_tls_failure(what: &str, env: &[(String, String)]) {
    let f = run_command(&["setup"], env, LIMIT);
    assert_eq!(f.status.code(), Some(1), "{what}: {}", f.stderr);
    assert!(
        f.stderr.to_lowercase().contains("tls"),
        "{what}: the error is about TLS: {}",
        f.stderr
    );
}

/// TLS on a private CA: `tls://` with `nats.tls_ca_file` delivers (the failures: below).
#[tokio::test]
async fn nats_tls_with_a_private_ca() {
    let nats = NatsServer::start_tls(false);
    let tls = nats.tls_files().clone();
    let url = format!("tls://127.0.0.1:{}", nats.port());
    let db = text_id_db().await;
    let client = db.client().await;
    let mut config = relay_config(&db, &nats);
    config.nats.url = url.clone();
    config.nats.tls_ca_file = tls.ca.display().to_string();
    let js = js(
        ConnectOptions::new()
            .add_root_certificates(tls.ca.clone())
            .require_tls(true),
        &url,
    )
    .await;
    deliver_one(&config, &client, &js, "tls-1").await;
}

/// Mutual TLS (`verify: true`): with `nats.tls_cert_file`/`tls_key_file` the relay delivers.
#[tokio::test]
async fn nats_mutual_tls_needs_the_client_certificate() {
    let nats = NatsServer::start_tls(true);
    let tls = nats.tls_files().clone();
    let url = format!("tls://127.0.0.1:{}", nats.port());
    let db = text_id_db().await;
    let client = db.client().await;
    let mut config = relay_config(&db, &nats);
    config.nats.url = url.clone();
    config.nats.tls_ca_file = tls.ca.display().to_string();
    config.nats.tls_cert_file = tls.client_cert.display().to_string();
    config.nats.tls_key_file = tls.client_key.display().to_string();
    let js = js(
        ConnectOptions::new()
            .add_root_certificates(tls.ca.clone())
            .add_client_certificate(tls.client_cert.clone(), tls.client_key.clone())
            .require_tls(true),
        &url,
    )
    .await;
    deliver_one(&config, &client, &js, "mtls-1").await;
}

/// TLS that cannot work fails `setup` with a line about TLS: a server certificate from a CA the
/// relay was not given, a mutual-TLS server and no client certificate, and `nats.tls_required = true`
/// against a server without TLS (no silent plain connection, nothing created).
///
/// async-nats reports some handshake failures as `ConnectErrorKind::Io` (the rustls error inside an
/// io::Error) rather than `ConnectErrorKind::Tls`; the relay's line must say TLS either way.
#[tokio::test]
async fn nats_tls_failures_say_tls() {
    let db = text_id_db().await;

    let nats = NatsServer::start_tls(false);
    let mut config = relay_config(&db, &nats);
    config.nats.url = format!("tls://127.0.0.1:{}", nats.port());
    assert_tls_failure("tls:// without the private CA", &relay_env(&config));

    let mtls = NatsServer::start_tls(true);
    config.nats.url = format!("tls://127.0.0.1:{}", mtls.port());
    let mut env = relay_env(&config);
    set(
        &mut env,
        "OUTBOX_RELAY_NATS_TLS_CA_FILE",
        &mtls.tls_files().ca.display().to_string(),
    );
    assert_tls_failure("mutual TLS without a client certificate", &env);

    let plain = NatsServer::start();
    let config = relay_config(&db, &plain);
    let mut env = relay_env(&config);
    set(&mut env, "OUTBOX_RELAY_NATS_TLS_REQUIRED", "true");
    assert_tls_failure("tls_required against a plain server", &env);
    let js = plain.jetstream().await;
    assert!(js.get_stream(&config.nats.stream).await.is_err());
}

/// The same failures as [`nats_tls_failures_say_tls`], judged only by what holds today: `setup`
/// fails (exit 1, no hang, nothing created), and the line carries the TLS library's reason.
#[tokio::test]
async fn nats_tls_failures_fail_setup_with_the_tls_reason() {
    let db = text_id_db().await;
    let check = |what: &str, env: &[(String, String)], reason: &str| {
        let f = run_command(&["setup"], env, LIMIT);
        assert_eq!(f.status.code(), Some(1), "{what}: {}", f.stderr);
        assert!(
            f.stderr.contains(reason),
            "{what}: names {reason}: {}",
            f.stderr
        );
    };
    let nats = NatsServer::start_tls(false);
    let mut config = relay_config(&db, &nats);
    config.nats.url = format!("tls://127.0.0.1:{}", nats.port());
    check(
        "tls:// without the private CA",
        &relay_env(&config),
        "certificate",
    );

    let mtls = NatsServer::start_tls(true);
    config.nats.url = format!("tls://127.0.0.1:{}", mtls.port());
    let mut env = relay_env(&config);
    set(
        &mut env,
        "OUTBOX_RELAY_NATS_TLS_CA_FILE",
        &mtls.tls_files().ca.display().to_string(),
    );
    // The server's refusal arrives as an alert or as a reset, depending on timing (TLS 1.3 sends
    // the client certificate after the client considers the handshake done).
    check("mutual TLS without a client certificate", &env, "");

    let plain = NatsServer::start();
    let config = relay_config(&db, &plain);
    let mut env = relay_env(&config);
    set(&mut env, "OUTBOX_RELAY_NATS_TLS_REQUIRED", "true");
    let f = run_command(&["setup"], &env, LIMIT);
    assert_eq!(f.status.code(), Some(1), "tls_required: {}", f.stderr);
    let js = plain.jetstream().await;
    assert!(
        js.get_stream(&config.nats.stream).await.is_err(),
        "nothing created"
    );

    // A CA file alone means TLS: a plain server (or someone stripping TLS) is refused too.
    let mut env = relay_env(&config);
    set(
        &mut env,
        "OUTBOX_RELAY_NATS_TLS_CA_FILE",
        &mtls.tls_files().ca.display().to_string(),
    );
    let f = run_command(&["setup"], &env, LIMIT);
    assert_eq!(
        f.status.code(),
        Some(1),
        "CA file, plain server: {}",
        f.stderr
    );
    assert!(
        js.get_stream(&config.nats.stream).await.is_err(),
        "nothing created over plaintext"
    );
}

/// `ws://` and `wss://` URLs are refused when the configuration is loaded: exit 1, one line naming
/// `nats.url`, before any server is contacted.
#[tokio::test]
async fn websocket_urls_are_refused_at_config_time() {
    for url in ["ws://127.0.0.1:8080", "wss://relay:pw@127.0.0.1:443"] {
        let env = vec![("OUTBOX_RELAY_NATS_URL".to_owned(), url.to_owned())];
        for args in [&["run"][..], &["setup"], &["status"]] {
            let f = run_command(args, &env, Duration::from_secs(30));
            assert_eq!(f.status.code(), Some(1), "{url} {args:?}: {}", f.stderr);
            let line = f.stderr.trim();
            assert_eq!(line.lines().count(), 1, "one line: {line}");
            assert!(line.contains("nats.url"), "{url}: {line}");
            assert!(!line.contains(":pw@"), "{url}: {line}");
        }
    }
}
