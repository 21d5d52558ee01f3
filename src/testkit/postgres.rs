//! Real Postgres servers for tests: `initdb` into a temp dir, a free port, `wal_level=logical`, TLS with a
//! test CA, and roles for every auth method the relay supports. One shared server per test binary for
//! ordinary tests; private servers for tests that stop, restart or crash Postgres.
//!
//! Binaries come from `PG_BIN`, else the highest `/usr/lib/postgresql/<v>/bin` (CONTRIBUTING.md).
//! A `PG_BIN`
//! without client tools (npm's embedded-postgres ships only `initdb`, `pg_ctl` and `postgres`) borrows
//! `psql` and `pg_isready` from the default installation: libpq speaks to newer servers. Postgres
//! refuses to run as root, so when the tests run as root the server runs as the `postgres` user and its
//! directories belong to it. The `postgres` binary is started directly (not through `pg_ctl`) so the
//! test holds the postmaster's pid and can signal it: SIGINT is a fast shutdown, SIGKILL a crash.
//! <https://www.postgresql.org/docs/current/server-shutdown.html>
//!
//! `start_copy` starts a second server from a copy of a stopped one's data dir (the base of a physical
//! standby; see `pg_pair.rs`).

use std::fs;
use std::io::Write;
use std::os::unix::fs::{PermissionsExt, chown};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use super::process::{self, Watchdog};

const HOST: &str = "127.0.0.1";
/// Crash recovery after `kill` and the first start on a busy 2-core machine both fit in this.
const READY_TIMEOUT: Duration = Duration::from_secs(60);

/// One Postgres server process for tests, on a free port, with `wal_level=logical` and TLS.
pub struct PgServer {
    bin_dir: PathBuf,
    /// `psql` and `pg_isready`: `bin_dir` when it has them, else the default installation's.
    client_bin_dir: PathBuf,
    root: PathBuf,
    data_dir: PathBuf,
    pid_file: PathBuf,
    ca_cert: PathBuf,
    port: u16,
    version_num: u32,
    /// `(uid, gid)` of `postgres` when we are root; `None` runs the server as ourselves.
    run_as: Option<(u32, u32)>,
    child: Mutex<Option<Child>>,
    watchdog: Mutex<Option<Watchdog>>,
}

impl PgServer {
    /// The shared server for ordinary tests, started once per test binary, never stopped by tests.
    /// Its watchdog removes it when the test binary exits.
    pub fn shared() -> &'static PgServer {
        static SHARED: OnceLock<PgServer> = OnceLock::new();
        SHARED.get_or_init(PgServer::start_new)
    }

    /// A private server (for tests that stop/restart Postgres); stopped and its dir removed on Drop.
    pub fn start_private() -> PgServer {
        PgServer::start_new()
    }

    /// The server's port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The address the server listens on, `127.0.0.1`.
    pub fn host(&self) -> &str {
        HOST
    }

    /// `server_version_num`, e.g. 150018.
    pub fn version_num(&self) -> u32 {
        self.version_num
    }

    /// Where the server binaries (`initdb`, `postgres`) come from.
    pub fn bin_dir(&self) -> &Path {
        &self.bin_dir
    }

    /// Where `psql` and `pg_isready` come from: `bin_dir` when it has them (see the module comment).
    pub fn client_bin_dir(&self) -> &Path {
        &self.client_bin_dir
    }

    /// Superuser URL (trust auth over TCP).
    pub fn url(&self, db: &str) -> String {
        format!("postgres://postgres@{HOST}:{}/{db}", self.port)
    }

    /// URL with a password, for `scram_user`/`scram_pw` and `md5_user`/`md5_pw` (or roles a test made).
    pub fn url_as(&self, user: &str, password: &str, db: &str) -> String {
        format!(
            "postgres://{}:{}@{HOST}:{}/{db}",
            url_encode(user),
            url_encode(password),
            self.port
        )
    }

    /// The server's data directory, for tests that snapshot and restore it as a disk snapshot would
    /// (`cp -a` keeps its owner, the `postgres` user when the tests run as root, and its 0700 mode).
    /// Copy or replace it only while the server is stopped ([`PgServer::stop`]); `start` then
    /// serves whatever is there. It holds `server.log` too.
    pub fn data_dir(&self) -> &Path {
        &self.data_dir
    }

    /// PEM of the CA that signed the server certificate (SAN `localhost` and `127.0.0.1`).
    pub fn ca_cert_path(&self) -> &Path {
        &self.ca_cert
    }

    /// The last `n` bytes of the server log, for panic messages.
    pub(crate) fn log_tail(&self, n: usize) -> String {
        process::log_tail(&self.data_dir.join("server.log"), n)
    }

    /// Fast shutdown (SIGINT) and wait for the postmaster to exit. No-op when already stopped.
    pub fn stop(&self) {
        let mut child = self.child.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(mut c) = child.take() {
            process::stop_child(&mut c, "INT", Duration::from_secs(60));
        }
        // A stale pid must not be signalled by the watchdog once the pid is reused.
        let _ = fs::remove_file(&self.pid_file);
    }

    /// Immediate shutdown (SIGQUIT, what `pg_ctl stop -m immediate` sends): the postmaster stops its
    /// backends and exits without a shutdown checkpoint, so WAL not yet sent to a standby stays
    /// behind and the next start runs crash recovery. No-op when already stopped.
    pub(crate) fn stop_immediate(&self) {
        let mut child = self.child.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(mut c) = child.take() {
            process::stop_child(&mut c, "QUIT", Duration::from_secs(30));
        }
        let _ = fs::remove_file(&self.pid_file);
    }

    /// Whether the postmaster this struct started is running (not stopped, killed or exited).
    pub(crate) fn is_running(&self) -> bool {
        let mut child = self.child.lock().unwrap_or_else(|e| e.into_inner());
        child
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    /// Starts the server again on the same port and data dir (after `stop` or `kill`; crash recovery
    /// runs after `kill`) and waits until it accepts connections.
    pub fn start(&self) {
        let mut child = self.child.lock().unwrap_or_else(|e| e.into_inner());
        assert!(child.is_none(), "PgServer::start: already running");
        *child = Some(self.spawn_ready().unwrap_or_else(|e| panic!("{e}")));
    }

    /// [`PgServer::stop`], then [`PgServer::start`].
    pub fn restart(&self) {
        self.stop();
        self.start();
    }

    /// Crash: SIGKILL the postmaster together with its backends (its process group), as an OOM kill or
    /// a power cut would. `start` brings it back with crash recovery.
    pub fn kill(&self) {
        let mut child = self.child.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(mut c) = child.take() {
            process::signal(-i64::from(c.id()), "KILL");
            process::wait_exit(&mut c, Duration::from_secs(10));
        }
        let _ = fs::remove_file(&self.pid_file);
    }

    /// Runs `sql` (one or more statements) with `psql -X -q -A -t -v ON_ERROR_STOP=1` as the superuser;
    /// returns trimmed stdout, panics with stderr on error.
    pub fn psql(&self, db: &str, sql: &str) -> String {
        self.conn()
            .psql(db, sql)
            .unwrap_or_else(|e| panic!("psql on {db} failed: {e}\n--- sql:\n{sql}"))
    }

    /// What a `TestDb` needs to reach this server, without borrowing it.
    pub(crate) fn conn(&self) -> PgConn {
        PgConn {
            psql: self.client_bin_dir.join("psql"),
            port: self.port,
        }
    }

    fn start_new() -> PgServer {
        PgServer::start_new_with(bin_dir())
    }

    /// A new private server from the binaries in `bin_dir`: initdb, certificates, roles.
    pub(crate) fn start_new_with(bin_dir: PathBuf) -> PgServer {
        let mut server = PgServer::prepare(bin_dir);
        write_certs(&server.root, server.run_as);
        init_data_dir(&server.bin_dir, &server.data_dir, server.run_as);
        server.start_on_free_port("");
        server.bootstrap();
        server
    }

    /// A new private server whose data dir is a copy of `source`'s, which must be stopped cleanly
    /// (`stop`) so the copy is consistent: what `pg_basebackup` gives, without needing it (the npm
    /// builds do not ship it). The copy gets its own port, temp dir and watchdog, `source`'s
    /// certificates (one CA verifies both, as a multi-host URL needs), `extra_conf` appended to
    /// `postgresql.conf`, and an empty `signal_file` (`standby.signal`) when given. The roles come
    /// with the copy, so nothing is bootstrapped: a standby is read-only.
    pub(crate) fn start_copy(
        source: &PgServer,
        extra_conf: &str,
        signal_file: Option<&str>,
    ) -> PgServer {
        assert!(
            !source.is_running(),
            "PgServer::start_copy: stop the source first, a running data dir copies inconsistently"
        );
        let mut server = PgServer::prepare(source.bin_dir.clone());
        for (name, mode) in [
            ("ca.crt", 0o644),
            ("server.crt", 0o644),
            ("server.key", 0o600),
        ] {
            let (from, to) = (source.root.join(name), server.root.join(name));
            fs::copy(&from, &to)
                .unwrap_or_else(|e| panic!("copy {} to {}: {e}", from.display(), to.display()));
            fs::set_permissions(&to, fs::Permissions::from_mode(mode))
                .unwrap_or_else(|e| panic!("chmod {}: {e}", to.display()));
            if name == "server.key" {
                give_to(&to, server.run_as);
            }
        }
        // `cp -a` keeps the owner (postgres) and the 0700 modes Postgres insists on.
        let out = Command::new("cp")
            .arg("-a")
            .arg(&source.data_dir)
            .arg(&server.data_dir)
            .output()
            .expect("spawn cp");
        assert!(
            out.status.success(),
            "cp -a {} {}: {}",
            source.data_dir.display(),
            server.data_dir.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        // Not part of a base backup: the source's pid file and log, and its replication slots
        // (pg_basebackup leaves pg_replslot empty too; a copied slot would pin WAL on the copy).
        for name in ["postmaster.pid", "postmaster.opts", "server.log"] {
            let _ = fs::remove_file(server.data_dir.join(name));
        }
        let slots = server.data_dir.join("pg_replslot");
        for entry in fs::read_dir(&slots)
            .unwrap_or_else(|e| panic!("read {}: {e}", slots.display()))
            .flatten()
        {
            fs::remove_dir_all(entry.path())
                .unwrap_or_else(|e| panic!("remove {}: {e}", entry.path().display()));
        }
        if let Some(name) = signal_file {
            let path = server.data_dir.join(name);
            fs::write(&path, "").unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
            give_to(&path, server.run_as);
        }
        server.version_num = source.version_num;
        server.start_on_free_port(extra_conf);
        server
    }

    /// Appends settings to `postgresql.conf` (the last occurrence of a setting wins); they apply at
    /// the next `start`, or at a reload (`SELECT pg_reload_conf()`) for those that allow it.
    pub(crate) fn append_config(&self, text: &str) {
        append_config(&self.data_dir, text);
    }

    /// Binaries, the user to run as, the temp dir and its watchdog: everything before a data dir.
    fn prepare(bin_dir: PathBuf) -> PgServer {
        for name in ["initdb", "postgres"] {
            assert!(
                bin_dir.join(name).exists(),
                "{} missing: set PG_BIN or run scripts/install-deps.sh",
                bin_dir.join(name).display()
            );
        }
        let client_bin_dir = client_bin_dir(&bin_dir);
        let run_as = if process::euid() == 0 {
            Some(process::user_ids("postgres").expect(
                "running as root, but there is no `postgres` user to run the server as \
                 (apt-get install postgresql creates it)",
            ))
        } else {
            None
        };
        let root = process::temp_root("pg");
        let pid_file = root.join("server.pid");
        // First, so the dir goes away even when what follows panics.
        let watchdog = Watchdog::spawn(&pid_file, &root, "INT");
        PgServer {
            bin_dir,
            client_bin_dir,
            data_dir: root.join("data"),
            ca_cert: root.join("ca.crt"),
            root,
            pid_file,
            port: 0,
            version_num: 0,
            run_as,
            child: Mutex::new(None),
            watchdog: Mutex::new(Some(watchdog)),
        }
    }

    /// Writes the test settings (and `extra_conf`) for a free port and starts the server; panics
    /// with the log when it does not come up. The port is picked before the server binds it; on a
    /// clash this tries again with a new one.
    fn start_on_free_port(&mut self, extra_conf: &str) {
        let mut last_error = String::new();
        for _ in 0..3 {
            self.port = process::free_port();
            write_config(&self.root, &self.data_dir, self.port);
            if !extra_conf.is_empty() {
                append_config(&self.data_dir, extra_conf);
            }
            match self.spawn_ready() {
                Ok(child) => {
                    *self.child.get_mut().unwrap() = Some(child);
                    return;
                }
                Err(e) => last_error = e,
            }
        }
        panic!("could not start Postgres: {last_error}");
    }

    /// Spawns the postmaster and waits until it accepts connections, or returns why it did not.
    fn spawn_ready(&self) -> Result<Child, String> {
        let log = self.data_dir.join("server.log");
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            let logged_before = fs::metadata(&log).map_or(0, |m| m.len() as usize);
            let mut child = self.spawn_postmaster(&log)?;
            process::write_pid_file(&self.pid_file, child.id());
            loop {
                if let Ok(Some(status)) = child.try_wait() {
                    let _ = fs::remove_file(&self.pid_file);
                    let tail = process::log_tail(&log, 3000);
                    // After a crash the killed backends may hold the old shared memory for a moment.
                    // Only this attempt's lines count.
                    if shared_memory_still_held(&process::log_since(&log, logged_before))
                        && Instant::now() < deadline
                    {
                        std::thread::sleep(Duration::from_millis(200));
                        break;
                    }
                    return Err(format!(
                        "postgres on port {} exited ({status}); log {}:\n{tail}",
                        self.port,
                        log.display()
                    ));
                }
                if self.is_ready(&child) {
                    return Ok(child);
                }
                if Instant::now() > deadline {
                    process::stop_child(&mut child, "KILL", Duration::from_secs(5));
                    let _ = fs::remove_file(&self.pid_file);
                    return Err(format!(
                        "postgres on port {} not ready after {READY_TIMEOUT:?}; log {}:\n{}",
                        self.port,
                        log.display(),
                        process::log_tail(&log, 3000)
                    ));
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }

    fn spawn_postmaster(&self, log: &Path) -> Result<Child, String> {
        let open_log = || {
            fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(log)
                .map_err(|e| format!("open {}: {e}", log.display()))
        };
        let mut cmd = Command::new(self.bin_dir.join("postgres"));
        cmd.arg("-D")
            .arg(&self.data_dir)
            .stdin(Stdio::null())
            .stdout(open_log()?)
            .stderr(open_log()?);
        process::own_group(&mut cmd);
        if let Some((uid, gid)) = self.run_as {
            cmd.uid(uid).gid(gid);
        }
        cmd.spawn()
            .map_err(|e| format!("spawn {}: {e}", self.bin_dir.join("postgres").display()))
    }

    /// Ready when this start's postmaster says so in its `postmaster.pid` and the port answers. The
    /// file comes first: a port answering alone could be another server's (ours failed to bind it),
    /// and the file left by a killed server names a dead pid.
    fn is_ready(&self, child: &Child) -> bool {
        let pid_file = fs::read_to_string(self.data_dir.join("postmaster.pid")).unwrap_or_default();
        postmaster_ready(&pid_file, child.id())
            && Command::new(self.client_bin_dir.join("pg_isready"))
                .args(["-q", "-h", HOST, "-U", "postgres", "-d", "postgres", "-p"])
                .arg(self.port.to_string())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
    }

    /// Reads the version and creates the password roles. `md5_user` is created under
    /// `password_encryption = 'md5'` so its stored hash is md5 and pg_hba's md5 line really is md5 auth.
    fn bootstrap(&mut self) {
        let version = self.psql("postgres", "SHOW server_version_num");
        self.version_num = version
            .parse()
            .unwrap_or_else(|_| panic!("server_version_num: {version:?}"));
        self.psql(
            "postgres",
            "CREATE ROLE scram_user LOGIN REPLICATION PASSWORD 'scram_pw';\n\
             SET password_encryption = 'md5';\n\
             CREATE ROLE md5_user LOGIN REPLICATION PASSWORD 'md5_pw';",
        );
    }
}

impl Drop for PgServer {
    fn drop(&mut self) {
        self.stop();
        self.watchdog
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        process::remove_dir(&self.root);
    }
}

/// The part of a server `TestDb` keeps: enough to run psql against it.
#[derive(Clone, Debug)]
pub(crate) struct PgConn {
    psql: PathBuf,
    port: u16,
}

impl PgConn {
    pub(crate) fn port(&self) -> u16 {
        self.port
    }

    /// psql as the superuser over TCP; `Err(stderr)` on failure. SQL goes in on stdin so several
    /// statements run one after the other (as a script), not as one implicit transaction like `-c`.
    pub(crate) fn psql(&self, db: &str, sql: &str) -> Result<String, String> {
        let mut child = Command::new(&self.psql)
            .args([
                "-X",
                "-q",
                "-A",
                "-t",
                "-v",
                "ON_ERROR_STOP=1",
                "-h",
                HOST,
                "-U",
            ])
            .args(["postgres", "-d", db, "-p"])
            .arg(self.port.to_string())
            // TLS is tested by the relay's own tests; the helper takes the short path.
            .env("PGSSLMODE", "disable")
            .env("PGCONNECT_TIMEOUT", "10")
            .env_remove("PGPASSWORD")
            .env_remove("PGSERVICE")
            .env_remove("PGOPTIONS")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| format!("spawn {}: {e}", self.psql.display()))?;
        let write = child
            .stdin
            .take()
            .expect("psql stdin")
            .write_all(sql.as_bytes());
        let out = child
            .wait_with_output()
            .map_err(|e| format!("wait psql: {e}"))?;
        write.map_err(|e| format!("write to psql: {e}"))?;
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
        } else {
            Err(format!(
                "{}{}",
                String::from_utf8_lossy(&out.stderr),
                String::from_utf8_lossy(&out.stdout)
            ))
        }
    }
}

/// `PG_BIN`, else the default installation (`default_bin_dir`).
pub(crate) fn bin_dir() -> PathBuf {
    match std::env::var_os("PG_BIN") {
        Some(dir) => PathBuf::from(dir),
        None => default_bin_dir(),
    }
}

/// The major version of the server binaries `PgServer` and `PgPair` use (`PG_BIN`, else the default),
/// from `postgres --version` (which, unlike serving, may run as root): for choosing or skipping tests
/// before any server starts.
pub fn server_major() -> u32 {
    major_of(&bin_dir())
}

fn major_of(bin_dir: &Path) -> u32 {
    let postgres = bin_dir.join("postgres");
    let out = Command::new(&postgres)
        .arg("--version")
        .output()
        .unwrap_or_else(|e| panic!("spawn {}: {e}", postgres.display()));
    // "postgres (PostgreSQL) 18.4"; a build may append a suffix such as " (Debian 15.14-0+deb12u1)".
    let text = String::from_utf8_lossy(&out.stdout);
    text.split_whitespace()
        .nth(2)
        .and_then(|v| v.split('.').next())
        .and_then(|major| major.parse().ok())
        .unwrap_or_else(|| panic!("{} --version: {text:?}", postgres.display()))
}

/// `bin_dir` when it has `psql` and `pg_isready`, else the default installation's.
fn client_bin_dir(bin_dir: &Path) -> PathBuf {
    let dir = if bin_dir.join("psql").exists() && bin_dir.join("pg_isready").exists() {
        bin_dir.to_path_buf()
    } else {
        default_bin_dir()
    };
    for name in ["psql", "pg_isready"] {
        assert!(
            dir.join(name).exists(),
            "{} missing: run scripts/install-deps.sh",
            dir.join(name).display()
        );
    }
    dir
}

/// The highest `/usr/lib/postgresql/<v>/bin` that has `initdb`.
fn default_bin_dir() -> PathBuf {
    let mut found: Vec<(u32, PathBuf)> = fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let version = e.file_name().to_str()?.parse().ok()?;
            let bin = e.path().join("bin");
            bin.join("initdb").exists().then_some((version, bin))
        })
        .collect();
    found.sort();
    found
        .pop()
        .map(|(_, bin)| bin)
        .expect("no Postgres: set PG_BIN or run scripts/install-deps.sh")
}

fn give_to(path: &Path, run_as: Option<(u32, u32)>) {
    if let Some((uid, gid)) = run_as {
        chown(path, Some(uid), Some(gid))
            .unwrap_or_else(|e| panic!("chown {}: {e}", path.display()));
    }
}

/// A CA and a server certificate for `localhost`/`127.0.0.1` signed by it, so tests can check
/// `verify-full` against `ca.crt`. Postgres refuses a key readable by others, hence 0600 and owned by
/// the server's user. <https://www.postgresql.org/docs/current/ssl-tcp.html>
fn write_certs(root: &Path, run_as: Option<(u32, u32)>) {
    use rcgen::{
        BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, KeyUsagePurpose,
    };

    let mut ca_params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(DnType::CommonName, "outbox-relay test CA");
    ca_params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let ca_key = KeyPair::generate().expect("CA key");
    let ca_cert = ca_params.self_signed(&ca_key).expect("self-sign CA");
    let issuer = Issuer::new(ca_params, ca_key);

    let mut params = CertificateParams::new(vec!["localhost".to_string(), HOST.to_string()])
        .expect("server cert params");
    params
        .distinguished_name
        .push(DnType::CommonName, "localhost");
    params.use_authority_key_identifier_extension = true;
    let key = KeyPair::generate().expect("server key");
    let cert = params.signed_by(&key, &issuer).expect("sign server cert");

    let write = |name: &str, text: &str, mode: u32| {
        let path = root.join(name);
        fs::write(&path, text).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
        fs::set_permissions(&path, fs::Permissions::from_mode(mode))
            .unwrap_or_else(|e| panic!("chmod {}: {e}", path.display()));
        path
    };
    write("ca.crt", &ca_cert.pem(), 0o644);
    write("server.crt", &cert.pem(), 0o644);
    let key_path = write("server.key", &key.serialize_pem(), 0o600);
    give_to(&key_path, run_as);
}

fn init_data_dir(bin_dir: &Path, data_dir: &Path, run_as: Option<(u32, u32)>) {
    fs::create_dir(data_dir).unwrap_or_else(|e| panic!("mkdir {}: {e}", data_dir.display()));
    fs::set_permissions(data_dir, fs::Permissions::from_mode(0o700))
        .unwrap_or_else(|e| panic!("chmod {}: {e}", data_dir.display()));
    give_to(data_dir, run_as);
    let mut cmd = Command::new(bin_dir.join("initdb"));
    cmd.arg("-D")
        .arg(data_dir)
        .args(["-U", "postgres", "--auth=trust", "-E", "UTF8", "--locale=C"])
        // Test data is disposable: skip the fsyncs that make initdb slow.
        .args(["--no-sync", "--no-instructions"]);
    if let Some((uid, gid)) = run_as {
        cmd.uid(uid).gid(gid);
    }
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("spawn {}: {e}", bin_dir.join("initdb").display()));
    assert!(
        out.status.success(),
        "initdb failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Appends the test settings to `postgresql.conf` (the last occurrence of a setting wins, so the
/// retry with a new port, or a copy of the data dir, just appends again) and writes `pg_hba.conf`.
fn write_config(root: &Path, data_dir: &Path, port: u16) {
    let conf = format!(
        "\n# outbox-relay tests\n\
         listen_addresses = '{HOST}'\n\
         port = {port}\n\
         unix_socket_directories = '{data}'\n\
         wal_level = logical\n\
         max_replication_slots = 20\n\
         max_wal_senders = 20\n\
         # short, so a client that forgets its status updates is caught by the tests\n\
         wal_sender_timeout = '10s'\n\
         fsync = off\n\
         full_page_writes = off\n\
         shared_buffers = 64MB\n\
         max_connections = 100\n\
         # dynamic shared memory in the data dir, not /dev/shm: a killed server leaves nothing behind\n\
         dynamic_shared_memory_type = mmap\n\
         ssl = on\n\
         ssl_cert_file = '{root}/server.crt'\n\
         ssl_key_file = '{root}/server.key'\n\
         password_encryption = 'scram-sha-256'\n\
         log_line_prefix = '%m [%p] %q%u@%d '\n",
        data = data_dir.display(),
        root = root.display(),
    );
    append_config(data_dir, &conf);
    // First match wins. `all` does not match physical replication connections, hence the extra
    // `replication` lines; logical replication connections match by database name like any other.
    // The test process's own user logs in by `peer` over the socket (the Unix-socket tests);
    // everyone else locally by trust.
    let hba = format!(
        "local all {os_user} peer\n\
         local all all trust\n\
         host all postgres {HOST}/32 trust\n\
         host all md5_user {HOST}/32 md5\n\
         host all all {HOST}/32 scram-sha-256\n\
         local replication all trust\n\
         host replication postgres {HOST}/32 trust\n\
         host replication md5_user {HOST}/32 md5\n\
         host replication all {HOST}/32 scram-sha-256\n",
        os_user = os_user(),
    );
    let path = data_dir.join("pg_hba.conf");
    fs::write(&path, hba).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
}

/// The operating-system user the tests run as (`peer` authentication maps it to the role of the
/// same name).
pub fn os_user() -> String {
    let out = Command::new("id")
        .arg("-un")
        .output()
        .unwrap_or_else(|e| panic!("id -un: {e}"));
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

fn append_config(data_dir: &Path, text: &str) {
    let path = data_dir.join("postgresql.conf");
    fs::OpenOptions::new()
        .append(true)
        .open(&path)
        .and_then(|mut f| f.write_all(format!("\n{text}\n").as_bytes()))
        .unwrap_or_else(|e| panic!("append {}: {e}", path.display()));
}

/// Percent-encodes a URL userinfo part.
pub(crate) fn url_encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// Whether a start failed only because killed backends still hold the old server's shared memory.
/// The server names the block between the words: "pre-existing shared memory block (key K, ID I)
/// is still in use".
fn shared_memory_still_held(log: &str) -> bool {
    log.lines()
        .any(|l| l.contains("pre-existing shared memory block") && l.contains("is still in use"))
}

/// Whether `postmaster.pid`'s text says the postmaster `pid` accepts connections: line 1 is its pid,
/// line 8 its status (`starting`, `stopping`, `ready` or `standby`), which the server sets once it
/// listens and accepts (a hot standby included).
fn postmaster_ready(pid_file: &str, pid: u32) -> bool {
    let lines: Vec<&str> = pid_file.lines().collect();
    lines.first().map(|l| l.trim()) == Some(pid.to_string().as_str())
        && lines.get(7).map(|l| l.trim()) == Some("ready")
}

#[cfg(test)]
mod tests {
    use super::{postmaster_ready, shared_memory_still_held};

    #[test]
    fn a_start_refused_for_held_shared_memory_is_recognised_from_the_servers_own_line() {
        let refused = "2026-12-07 01:18:16.459 UTC [8263] FATAL:  pre-existing shared memory block \
                       (key 10486078, ID 2228232) is still in use\n\
                       2026-12-07 01:18:16.459 UTC [8263] HINT:  Terminate any old server processes";
        assert!(shared_memory_still_held(refused));
        let other = "FATAL:  could not create lock file \"postmaster.pid\": File exists";
        assert!(!shared_memory_still_held(other));
    }

    #[test]
    fn only_this_starts_postmaster_saying_ready_counts_as_ready() {
        let file = |pid: u32, status: &str| {
            format!(
                "{pid}\n/tmp/data\n1765000000\n41000\n/tmp\n127.0.0.1\n  1234  5678\n{status}\n"
            )
        };
        assert!(postmaster_ready(&file(4242, "ready   "), 4242));
        assert!(!postmaster_ready(&file(4242, "starting"), 4242));
        assert!(!postmaster_ready(&file(4242, "stopping"), 4242));
        // A killed server's file, still saying ready, names its own pid, not this start's.
        assert!(!postmaster_ready(&file(4111, "ready   "), 4242));
        assert!(!postmaster_ready("", 4242));
    }
}
