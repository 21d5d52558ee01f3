//! No output holds a secret, even at `log.level = "trace"` where every library logs what it does:
//! `run`, `setup`, `status` and `status --json` with a Postgres password (SCRAM), a NATS password in
//! the URL and a NATS token as a key, and a config file whose TOML syntax error is on the password
//! line (the parser's own message would quote the line).

use std::time::Duration;

use super::{LIMIT, assert_no_secret, good, percent_encode, set, text_id_db, wait_for_active_slot};
use crate::support::{
    Finished, NatsServer, PgServer, RelayProcess, relay_config, relay_env, run_command,
    stream_count, unique, wait_for,
};

const PG_PASSWORD: &str = "Pg-S3cret!x";
const NATS_PASSWORD: &str = "N4ts-S3cret@y";
const NATS_TOKEN: &str = "N4tsT0kenZ";
const SECRETS: [&str; 3] = [PG_PASSWORD, NATS_PASSWORD, NATS_TOKEN];

/// `run` until it has delivered event `id`, then SIGTERM; its whole output.
async fn run_briefly(
    env: &[(String, String)],
    client: &tokio_postgres::Client,
    js: &async_nats::jetstream::Context,
    slot: &str,
    stream: &str,
    id: &str,
) -> Finished {
    let mut p = RelayProcess::spawn(&["run"], env);
    wait_for_active_slot(client, slot).await;
    let before = stream_count(js, stream).await;
    good(client, id).await;
    wait_for(&format!("event {id}"), LIMIT, || async {
        stream_count(js, stream).await > before
    })
    .await;
    p.terminate(Duration::from_secs(30))
}

#[tokio::test]
async fn secrets_never_appear_in_any_output_even_at_trace() {
    let server = PgServer::shared();
    let db = text_id_db().await;
    let role = unique("relay_secret");
    db.psql(&format!(
        "CREATE ROLE {role} SUPERUSER LOGIN PASSWORD '{PG_PASSWORD}'"
    ));
    // Two NATS servers sharing nothing: one with a user and password, one with a token.
    let pw_nats = NatsServer::start_with_config(&format!(
        "authorization {{\n  user: relay\n  password: {NATS_PASSWORD:?}\n}}"
    ));
    let token_nats =
        NatsServer::start_with_config(&format!("authorization {{\n  token: {NATS_TOKEN:?}\n}}"));
    let client = db.client().await;

    let config = relay_config(&db, &pw_nats);
    let mut env = relay_env(&config);
    set(
        &mut env,
        "OUTBOX_RELAY_POSTGRES_URL",
        &server.url_as(&role, PG_PASSWORD, db.name()),
    );
    set(&mut env, "OUTBOX_RELAY_LOG_LEVEL", "trace");
    let mut pw_env = env.clone();
    set(
        &mut pw_env,
        "OUTBOX_RELAY_NATS_URL",
        &format!(
            "nats://relay:{}@127.0.0.1:{}",
            percent_encode(NATS_PASSWORD),
            pw_nats.port()
        ),
    );
    let mut token_env = env.clone();
    set(&mut token_env, "OUTBOX_RELAY_NATS_URL", &token_nats.url());
    set(&mut token_env, "OUTBOX_RELAY_NATS_TOKEN", NATS_TOKEN);
    // Its own slot and stream, so the two runs do not meet.
    set(
        &mut token_env,
        "OUTBOX_RELAY_POSTGRES_SLOT",
        &format!("{}_t", config.postgres.slot),
    );

    for (what, env, nats, opts) in [
        (
            "password in the URL",
            &pw_env,
            &pw_nats,
            async_nats::ConnectOptions::with_user_and_password(
                "relay".into(),
                NATS_PASSWORD.into(),
            ),
        ),
        (
            "token key",
            &token_env,
            &token_nats,
            async_nats::ConnectOptions::with_token(NATS_TOKEN.into()),
        ),
    ] {
        let js = async_nats::jetstream::new(opts.connect(nats.url()).await.expect("test client"));
        let slot = env
            .iter()
            .find(|(k, _)| k == "OUTBOX_RELAY_POSTGRES_SLOT")
            .map(|(_, v)| v.clone())
            .unwrap();
        let setup = run_command(&["setup"], env, LIMIT);
        assert_eq!(
            setup.status.code(),
            Some(0),
            "{what}: setup: {}",
            setup.stderr
        );
        assert_no_secret(&format!("{what}: setup"), &setup, &SECRETS);

        let run = run_briefly(
            env,
            &client,
            &js,
            &slot,
            &config.nats.stream,
            &format!("{slot}-1"),
        )
        .await;
        assert_eq!(run.status.code(), Some(0), "{what}: run: {}", run.stderr);
        assert!(
            run.stderr.contains("TRACE"),
            "{what}: trace logs were written"
        );
        assert_no_secret(&format!("{what}: run"), &run, &SECRETS);

        for args in [&["status"][..], &["status", "--json"]] {
            let f = run_command(args, env, LIMIT);
            assert!(f.status.code().is_some(), "{what}: {args:?}");
            assert!(
                !f.stdout.is_empty(),
                "{what}: {args:?} printed: {}",
                f.stderr
            );
            assert_no_secret(&format!("{what}: {args:?}"), &f, &SECRETS);
        }
    }

    // A TOML syntax error on the line that holds each password: the error names the line, not its
    // text.
    let dir = tempfile::tempdir().expect("tempdir");
    for (n, text) in [
        format!(
            "[postgres]\nurl = \"{}\n",
            server.url_as(&role, PG_PASSWORD, db.name())
        ),
        format!("[nats]\nurl = 'nats://relay:{NATS_PASSWORD}@127.0.0.1:4222\n"),
        format!("[nats]\ntoken = {NATS_TOKEN}\n"),
    ]
    .iter()
    .enumerate()
    {
        let path = dir.path().join(format!("relay-{n}.toml"));
        std::fs::write(&path, text).expect("write config");
        let path = path.display().to_string();
        for args in [
            &["run", "--config", path.as_str()][..],
            &["status", "--json", "--config", path.as_str()],
        ] {
            let f = run_command(
                args,
                &[("OUTBOX_RELAY_LOG_LEVEL".into(), "trace".into())],
                LIMIT,
            );
            assert_eq!(f.status.code(), Some(1), "{args:?}: {}", f.stderr);
            assert!(f.stderr.contains("line 2"), "names the line: {}", f.stderr);
            assert_no_secret(&format!("bad TOML {n} {args:?}"), &f, &SECRETS);
        }
    }

    drop(client);
    db.psql(&format!(
        "REASSIGN OWNED BY {role} TO postgres; DROP OWNED BY {role};"
    ));
    drop(db);
    server.psql("postgres", &format!("DROP ROLE IF EXISTS {role}"));
}
