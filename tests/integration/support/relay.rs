//! Running the relay under test: in-process (`InProcessRelay`, for tests that look at its metrics) or
//! as the real binary (`RelayProcess`, for SIGKILL/SIGTERM and exit-code tests), plus the readers the
//! end-to-end tests judge it by: the stream's messages in stream order and the slot's confirmed LSN.
//!
//! A child gets exactly the `OUTBOX_RELAY_*` variables a test sets, with any inherited ones removed:
//! they would override the test's settings (and one that names no setting, though not fatal, is
//! logged as a warning when it looks like a misspelt key).

use std::collections::BTreeMap;
use std::fs;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{self, consumer::pull::OrderedConfig};
use futures_util::StreamExt;
use outbox_relay::Lsn;
use outbox_relay::config::Config;
use outbox_relay::metrics::Metrics;
use outbox_relay::relay::RelayError;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use super::process;
use super::{NatsServer, TestDb, unique};

/// The default outbox table of `sql/01_outbox_table.sql`, as shipped (uuid ids).
pub(crate) fn default_outbox_sql() -> String {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/sql/01_outbox_table.sql");
    fs::read_to_string(path).unwrap_or_else(|e| panic!("read {path}: {e}"))
}

/// The default outbox table with `event_id text`, so tests can write readable ids like `e-5531`.
pub(crate) const TEXT_ID_OUTBOX_SQL: &str = "CREATE TABLE public.outbox (
    event_id       text        PRIMARY KEY,
    aggregate_type text        NOT NULL,
    aggregate_id   text        NOT NULL,
    event_type     text        NOT NULL,
    payload        jsonb       NOT NULL,
    created_at     timestamptz NOT NULL DEFAULT now(),
    headers        jsonb
);";

/// A relay configuration for `db` and `nats`: the test's own slot, publication and stream, no HTTP
/// listener, a short ack timeout so fault tests notice a dead NATS quickly.
pub(crate) fn relay_config(db: &TestDb, nats: &NatsServer) -> Config {
    let mut config = Config::default();
    config.postgres.url = db.url();
    config.postgres.slot = db.slot_name();
    config.postgres.publication = db.publication_name();
    config.nats.url = nats.url();
    config.nats.stream = unique("OUTBOX").to_uppercase();
    config.http.listen = String::new();
    config.nats.ack_timeout_ms = 2000;
    config.validate().expect("test relay config is valid");
    config
}

/// `relay::run` on a task of the test's runtime.
pub(crate) struct InProcessRelay {
    pub metrics: Arc<Metrics>,
    stop: Option<oneshot::Sender<()>>,
    handle: Option<JoinHandle<Result<(), RelayError>>>,
}

impl InProcessRelay {
    /// Starts the relay and waits until its slot has a consistent point: a slot shows before it is
    /// found, and rows written then are not decoded.
    pub(crate) async fn start_streaming(
        config: &Config,
        client: &tokio_postgres::Client,
    ) -> InProcessRelay {
        let relay = InProcessRelay::start(config.clone());
        let slot = config.postgres.slot.clone();
        super::wait_for("the relay's slot", Duration::from_secs(30), || async {
            confirmed_flush(client, &slot).await.is_some()
        })
        .await;
        relay
    }

    pub(crate) fn start(config: Config) -> InProcessRelay {
        let metrics = Arc::new(Metrics::default());
        let (tx, rx) = oneshot::channel::<()>();
        let settings = config.validate().expect("test relay config is valid");
        let handle = tokio::spawn(outbox_relay::relay::run(
            settings,
            Arc::clone(&metrics),
            async {
                let _ = rx.await;
            },
        ));
        InProcessRelay {
            metrics,
            stop: Some(tx),
            handle: Some(handle),
        }
    }

    /// True once `run` returned (setup failed or a definite error).
    pub(crate) fn is_finished(&self) -> bool {
        self.handle.as_ref().is_none_or(|h| h.is_finished())
    }

    /// Requests shutdown and returns what `run` returned (panics if it takes over 30 s).
    pub(crate) async fn stop(mut self) -> Result<(), RelayError> {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        let handle = self.handle.take().expect("relay handle");
        let ended = tokio::time::timeout(Duration::from_secs(30), handle)
            .await
            .expect("relay did not stop within 30 s")
            .expect("relay task panicked");
        // A defect is a bug of the relay's, whatever the test expected of it.
        if let Err(e) = &ended {
            assert!(
                !e.is_defect(),
                "the relay stopped on a defect: {}",
                outbox_relay::error_chain::error_chain(e)
            );
        }
        ended
    }
}

impl Drop for InProcessRelay {
    fn drop(&mut self) {
        if let Some(h) = self.handle.take() {
            h.abort();
        }
    }
}

/// The `outbox-relay` binary as a child process, stderr captured in a file.
pub(crate) struct RelayProcess {
    child: Child,
    stderr_path: PathBuf,
    stdout_path: PathBuf,
    _dir: tempfile::TempDir,
}

/// The environment that points the binary at `config`'s servers and names.
pub(crate) fn relay_env(config: &Config) -> Vec<(String, String)> {
    let mut env = vec![
        (
            "OUTBOX_RELAY_POSTGRES_URL".into(),
            config.postgres.url.clone(),
        ),
        (
            "OUTBOX_RELAY_POSTGRES_SLOT".into(),
            config.postgres.slot.clone(),
        ),
        (
            "OUTBOX_RELAY_POSTGRES_PUBLICATION".into(),
            config.postgres.publication.clone(),
        ),
        ("OUTBOX_RELAY_NATS_URL".into(), config.nats.url.clone()),
        (
            "OUTBOX_RELAY_NATS_STREAM".into(),
            config.nats.stream.clone(),
        ),
        (
            "OUTBOX_RELAY_NATS_ACK_TIMEOUT_MS".into(),
            config.nats.ack_timeout_ms.to_string(),
        ),
        // "" unless the test gave the config a listener (then `status` asks that relay too).
        (
            "OUTBOX_RELAY_HTTP_LISTEN".into(),
            config.http.listen.clone(),
        ),
        // `status` on a server before Postgres 17 watches a slot no relay holds for this long: a
        // second, not the default half minute, so tests that call it on a stopped relay stay quick.
        (
            "OUTBOX_RELAY_STATUS_GRACE_SECS".into(),
            config.status.grace_secs.min(1).to_string(),
        ),
    ];
    if config.nats.atomic_transactions {
        env.push((
            "OUTBOX_RELAY_NATS_ATOMIC_TRANSACTIONS".into(),
            "true".into(),
        ));
        env.push((
            "OUTBOX_RELAY_NATS_ATOMIC_GROUP_MS".into(),
            config.nats.atomic_group_ms.to_string(),
        ));
    }
    env
}

/// A `Command` for the binary with exactly `env` as its `OUTBOX_RELAY_*` variables. `RELAY_TEST_BIN`
/// runs another build instead (e.g. an older commit's, to see which tests it fails).
pub(super) fn relay_command(args: &[&str], env: &[(String, String)]) -> Command {
    let bin = std::env::var_os("RELAY_TEST_BIN")
        .filter(|b| !b.is_empty())
        .unwrap_or_else(|| env!("CARGO_BIN_EXE_outbox-relay").into());
    let mut cmd = Command::new(bin);
    cmd.args(args);
    for (k, _) in std::env::vars() {
        if k.starts_with("OUTBOX_RELAY_") {
            cmd.env_remove(k);
        }
    }
    cmd.envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())));
    cmd.stdin(Stdio::null());
    cmd
}

/// Output of a finished command: exit status, stdout, stderr.
pub(crate) struct Finished {
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: String,
}

/// Runs the binary to completion (bounded by `timeout`, then SIGKILL and panic).
pub(crate) fn run_command(args: &[&str], env: &[(String, String)], timeout: Duration) -> Finished {
    let mut p = RelayProcess::spawn(args, env);
    let status = p
        .wait(timeout)
        .unwrap_or_else(|| panic!("outbox-relay {args:?} did not exit within {timeout:?}"));
    Finished {
        status,
        stdout: p.stdout(),
        stderr: p.stderr(),
    }
}

impl RelayProcess {
    pub(crate) fn spawn(args: &[&str], env: &[(String, String)]) -> RelayProcess {
        let dir = tempfile::tempdir().expect("tempdir for relay output");
        let stderr_path = dir.path().join("stderr");
        let stdout_path = dir.path().join("stdout");
        let child = relay_command(args, env)
            .stdout(fs::File::create(&stdout_path).expect("create stdout file"))
            .stderr(fs::File::create(&stderr_path).expect("create stderr file"))
            .spawn()
            .expect("spawn outbox-relay");
        RelayProcess {
            child,
            stderr_path,
            stdout_path,
            _dir: dir,
        }
    }

    /// `run` against `config`'s servers.
    pub(crate) fn run(config: &Config) -> RelayProcess {
        RelayProcess::spawn(&["run"], &relay_env(config))
    }

    pub(crate) fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends a signal by name (`TERM`, `KILL`, `INT`).
    pub(crate) fn signal(&self, name: &str) {
        process::signal(i64::from(self.child.id()), name);
    }

    /// SIGTERM, then the exit (panics, with what the relay wrote, if there is none within
    /// `timeout`): its status and output. The caller asserts the exit code it expects.
    pub(crate) fn terminate(&mut self, timeout: Duration) -> Finished {
        self.signal("TERM");
        let status = self
            .wait(timeout)
            .unwrap_or_else(|| panic!("no exit after SIGTERM: {}", self.stderr()));
        Finished {
            status,
            stdout: self.stdout(),
            stderr: self.stderr(),
        }
    }

    /// Waits up to `timeout` for the exit; `None` if still running.
    pub(crate) fn wait(&mut self, timeout: Duration) -> Option<ExitStatus> {
        if process::wait_exit(&mut self.child, timeout) {
            self.child.try_wait().ok().flatten()
        } else {
            None
        }
    }

    pub(crate) fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    pub(crate) fn stderr(&self) -> String {
        fs::read_to_string(&self.stderr_path).unwrap_or_default()
    }

    pub(crate) fn stdout(&self) -> String {
        fs::read_to_string(&self.stdout_path).unwrap_or_default()
    }
}

impl Drop for RelayProcess {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        // A defect is a bug of the relay's, whatever the test expected of it (the words of
        // `RelayError::Defect`).
        let stderr = self.stderr();
        if !std::thread::panicking() && stderr.contains("stopped on a bug of its own") {
            panic!("the relay stopped on a defect: {stderr}");
        }
    }
}

/// One stored message, as a consumer sees it.
#[derive(Debug, Clone)]
pub(crate) struct Stored {
    pub seq: u64,
    pub subject: String,
    pub headers: BTreeMap<String, String>,
    pub payload: Vec<u8>,
}

impl Stored {
    pub(crate) fn header(&self, name: &str) -> &str {
        self.headers
            .get(name)
            .map(String::as_str)
            .unwrap_or_else(|| panic!("message {} has no {name} header: {self:?}", self.seq))
    }

    /// The event id: `Outbox-Event-Id` (a dead letter, a parked copy, a message of an atomic
    /// batch), else `Nats-Msg-Id`.
    pub(crate) fn id(&self) -> &str {
        self.headers
            .get("Outbox-Event-Id")
            .map_or_else(|| self.header("Nats-Msg-Id"), String::as_str)
    }

    pub(crate) fn commit_lsn(&self) -> Lsn {
        self.header("Outbox-Commit-Lsn")
            .parse()
            .unwrap_or_else(|e| panic!("message {}: {e}", self.seq))
    }

    pub(crate) fn payload_str(&self) -> &str {
        std::str::from_utf8(&self.payload).expect("utf-8 payload")
    }
}

/// Number of messages in `stream` (0 while the stream does not exist or NATS is down).
pub(crate) async fn stream_count(js: &jetstream::Context, stream: &str) -> u64 {
    let Ok(mut s) = js.get_stream(stream).await else {
        return 0;
    };
    s.info().await.map(|i| i.state.messages).unwrap_or(0)
}

/// Every message of `stream`, in stream order, through an ordered consumer.
pub(crate) async fn read_all(js: &jetstream::Context, stream: &str) -> Vec<Stored> {
    let mut s = js
        .get_stream(stream)
        .await
        .unwrap_or_else(|e| panic!("get stream {stream}: {e}"));
    let count = s.info().await.expect("stream info").state.messages as usize;
    if count == 0 {
        return Vec::new();
    }
    let consumer = s
        .create_consumer(OrderedConfig::default())
        .await
        .expect("create ordered consumer");
    let mut messages = consumer.messages().await.expect("consumer messages");
    let mut out = Vec::with_capacity(count);
    while out.len() < count {
        let m = tokio::time::timeout(Duration::from_secs(30), messages.next())
            .await
            .unwrap_or_else(|_| panic!("read {} of {count} messages of {stream}", out.len()))
            .expect("consumer ended")
            .expect("consumer message");
        let seq = m.info().expect("message info").stream_sequence;
        let headers = m
            .headers
            .iter()
            .flat_map(|h| h.iter())
            .map(|(k, v)| {
                (
                    k.to_string(),
                    v.first().map(|v| v.as_str().to_owned()).unwrap_or_default(),
                )
            })
            .collect();
        out.push(Stored {
            seq,
            subject: m.subject.to_string(),
            headers,
            payload: m.payload.to_vec(),
        });
    }
    out
}

/// The slot's `confirmed_flush_lsn` (`None` if the slot does not exist).
pub(crate) async fn confirmed_flush(client: &tokio_postgres::Client, slot: &str) -> Option<Lsn> {
    client
        .query_opt(
            "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await
        .expect("query pg_replication_slots")
        .and_then(|r| r.get::<_, Option<String>>(0))
        .map(|s| s.parse().expect("confirmed_flush_lsn parses"))
}

/// `pg_current_wal_lsn()`.
pub(crate) async fn current_wal_lsn(client: &tokio_postgres::Client) -> Lsn {
    let s: String = client
        .query_one("SELECT pg_current_wal_lsn()::text", &[])
        .await
        .expect("pg_current_wal_lsn")
        .get(0);
    s.parse().expect("lsn parses")
}

/// Whether a replication slot named `slot` exists on the server of `client`.
pub(crate) async fn slot_exists(client: &tokio_postgres::Client, slot: &str) -> bool {
    client
        .query_opt(
            "SELECT 1 FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await
        .expect("query pg_replication_slots")
        .is_some()
}
