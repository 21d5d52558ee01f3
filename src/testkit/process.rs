//! Process plumbing shared by the Postgres and NATS test servers: temp dirs with a recognizable prefix,
//! free ports, signals, bounded waits, and the watchdog that kills a server when the test binary dies.
//!
//! Servers run in their own process group (so a crash test can SIGKILL a postmaster together with its
//! backends, and a Ctrl-C on the terminal does not race the cleanup). Each server gets a watchdog: a
//! tiny `sh` loop that outlives a panicking or SIGKILLed test binary, then stops the server (whose pid
//! it reads from a file, because restarts change it) and removes its directory.

use std::collections::BTreeSet;
use std::fs;
use std::net::TcpListener;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// Every temp dir (and so every server command line) starts with this; `scripts/test.sh` looks for it
/// to prove nothing was left running.
pub(crate) const DIR_PREFIX: &str = "outbox-relay-test-";

/// A free TCP port on 127.0.0.1 that no server of this test process has had. There is a small race
/// until the server binds it; the starters retry with a new port when the first start fails.
///
/// A server keeps its port across `stop` and `start`, and while it is stopped the port is free to the
/// kernel: another test's server could be handed it and answer in its place (a pair's primary was once
/// reached on a port another test's server held, "the database system is shutting down"). So a port
/// is handed out once per process.
pub(crate) fn free_port() -> u16 {
    static HANDED_OUT: Mutex<BTreeSet<u16>> = Mutex::new(BTreeSet::new());
    let mut handed_out = HANDED_OUT.lock().unwrap_or_else(|e| e.into_inner());
    pick_unused(&mut handed_out, || {
        TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("bind 127.0.0.1:0 to find a free port")
            .port()
    })
}

/// The first port from `kernel` that is not in `handed_out`, recorded there.
fn pick_unused(handed_out: &mut BTreeSet<u16>, mut kernel: impl FnMut() -> u16) -> u16 {
    for _ in 0..10_000 {
        let port = kernel();
        if handed_out.insert(port) {
            return port;
        }
    }
    panic!(
        "no port the kernel offered was new to this test process ({} handed out)",
        handed_out.len()
    );
}

/// Creates `$TMPDIR/outbox-relay-test-[<tag>-]<kind>-<pid>-<n>`, mode 0755 so a server running as
/// another user can reach its own subdirectories. `RELAY_TEST_TAG` lets `scripts/test.sh` tell
/// its own servers from those of other runs on the same machine.
pub(crate) fn temp_root(kind: &str) -> PathBuf {
    static N: AtomicU32 = AtomicU32::new(0);
    let tag: String = std::env::var("RELAY_TEST_TAG")
        .unwrap_or_default()
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || *c == '-' || *c == '_')
        .collect();
    let tag = if tag.is_empty() {
        tag
    } else {
        format!("{tag}-")
    };
    let n = N.fetch_add(1, Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!(
        "{DIR_PREFIX}{tag}{kind}-{}-{n}",
        std::process::id()
    ));
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("create {}: {e}", dir.display()));
    fs::set_permissions(&dir, fs::Permissions::from_mode(0o755))
        .unwrap_or_else(|e| panic!("chmod {}: {e}", dir.display()));
    dir
}

/// The effective uid of this process (the owner of `/proc/self`), without libc.
pub(crate) fn euid() -> u32 {
    fs::metadata("/proc/self")
        .map(|m| m.uid())
        .expect("stat /proc/self")
}

/// `(uid, gid)` of a user from `/etc/passwd`.
pub(crate) fn user_ids(name: &str) -> Option<(u32, u32)> {
    let passwd = fs::read_to_string("/etc/passwd").ok()?;
    passwd.lines().find_map(|line| {
        let f: Vec<&str> = line.split(':').collect();
        (f.len() > 3 && f[0] == name).then(|| Some((f[2].parse().ok()?, f[3].parse().ok()?)))?
    })
}

/// Sends `signal` (a name such as `INT`, `TERM`, `KILL`) to a pid, or to a process group when `pid`
/// is negative. The shell's builtin `kill`, because a minimal Debian has no procps `kill` binary.
/// Errors (already gone) are ignored: callers wait for the exit themselves.
pub fn signal(pid: i64, signal: &str) {
    let _ = Command::new("sh")
        .args(["-c", r#"kill -s "$1" -- "$2" 2>/dev/null"#, "sh", signal])
        .arg(pid.to_string())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
}

/// Waits up to `timeout` for a child to exit; true if it did (and was reaped).
pub fn wait_exit(child: &mut Child, timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        match child.try_wait() {
            Ok(Some(_)) => return true,
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
            Ok(None) => return false,
            // Not our child any more (already reaped): nothing to wait for.
            Err(_) => return true,
        }
    }
}

/// Stops a server child: `graceful` signal to the leader, then SIGKILL to its whole process group if
/// it has not exited within `grace`.
pub(crate) fn stop_child(child: &mut Child, graceful: &str, grace: Duration) {
    let pid = i64::from(child.id());
    signal(pid, graceful);
    if !wait_exit(child, grace) {
        signal(-pid, "KILL");
        wait_exit(child, Duration::from_secs(10));
    }
}

/// The last `n` bytes of a log file, for panic messages.
pub(crate) fn log_tail(path: &Path, n: usize) -> String {
    let text = fs::read(path).unwrap_or_default();
    let start = text.len().saturating_sub(n);
    String::from_utf8_lossy(&text[start..]).into_owned()
}

/// What a log file gained after its first `offset` bytes (all of it when it shrank).
pub(crate) fn log_since(path: &Path, offset: usize) -> String {
    let text = fs::read(path).unwrap_or_default();
    let start = if offset <= text.len() { offset } else { 0 };
    String::from_utf8_lossy(&text[start..]).into_owned()
}

/// Puts a server command in its own process group; see the module comment.
pub(crate) fn own_group(cmd: &mut Command) -> &mut Command {
    cmd.process_group(0)
}

/// Kills the server whose pid is in `pid_file` and removes `root` once this test process is gone.
pub(crate) struct Watchdog {
    child: Child,
}

// $1 test pid, $2 pid file, $3 dir to remove, $4 graceful signal. The graceful stop gets one second, so
// the server is gone within ~1.5 s of the test process either way.
const WATCHDOG: &str = r#"
while kill -0 "$1" 2>/dev/null; do sleep 0.5; done
p=$(cat "$2" 2>/dev/null)
if [ -n "$p" ]; then
  kill -s "$4" -- "$p" 2>/dev/null
  i=0
  while kill -0 "$p" 2>/dev/null && [ "$i" -lt 10 ]; do sleep 0.1; i=$((i + 1)); done
  kill -s KILL -- "-$p" 2>/dev/null
fi
rm -rf "$3"
"#;

impl Watchdog {
    /// Starts a watchdog for the server whose pid is in `pid_file`; `graceful` is the signal it sends first.
    pub(crate) fn spawn(pid_file: &Path, root: &Path, graceful: &str) -> Watchdog {
        let child = own_group(
            Command::new("sh")
                .arg("-c")
                .arg(WATCHDOG)
                .arg("outbox-relay-watchdog")
                .arg(std::process::id().to_string())
                .arg(pid_file)
                .arg(root)
                .arg(graceful)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null()),
        )
        .spawn()
        .expect("spawn watchdog sh");
        Watchdog { child }
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Records the pid the watchdog must kill.
pub(crate) fn write_pid_file(path: &Path, pid: u32) {
    fs::write(path, pid.to_string()).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
}

/// Removes a server's directory; for Drop, so it never panics.
pub(crate) fn remove_dir(path: &PathBuf) {
    if let Err(e) = fs::remove_dir_all(path)
        && e.kind() != std::io::ErrorKind::NotFound
    {
        eprintln!("warning: could not remove {}: {e}", path.display());
    }
}

#[cfg(test)]
mod tests {
    use super::pick_unused;
    use std::collections::BTreeSet;

    #[test]
    fn a_port_handed_out_once_is_not_handed_out_again() {
        let mut handed_out = BTreeSet::new();
        let mut offers = [40001, 40001, 40002].into_iter();
        assert_eq!(
            pick_unused(&mut handed_out, || offers.next().unwrap()),
            40001
        );
        // The kernel offers 40001 again (its server is stopped, the port free): it is skipped.
        assert_eq!(
            pick_unused(&mut handed_out, || offers.next().unwrap()),
            40002
        );
    }
}
