//! The relay binary as a subprocess of a bench (`outbox-relay run`), so its CPU and memory are its
//! own in /proc: started with the environment the bench gives it (and none of the caller's
//! `OUTBOX_RELAY_*`), its log kept in a temporary directory, stopped cleanly on drop. Shared by the
//! drain and sustained-load benches, each a binary of its own.
//!
//! `BENCH_RELAY_WRAPPER` puts a command before the binary, e.g. `perf record -g -o relay.data --`
//! (the pid is then the wrapper's; build with `--profile profiling` so the profile has symbols).

use std::fs;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context;

/// The relay binary, stopped on drop.
pub(crate) struct RelayChild {
    pub(crate) child: Child,
    dir: tempfile::TempDir,
}

impl RelayChild {
    /// `bin run` with exactly `env` as its `OUTBOX_RELAY_*` settings, behind `BENCH_RELAY_WRAPPER`.
    pub(crate) fn spawn_bin(bin: &str, env: &[(&str, String)]) -> anyhow::Result<RelayChild> {
        let dir = tempfile::tempdir()?;
        let wrapper = std::env::var("BENCH_RELAY_WRAPPER").unwrap_or_default();
        let mut words: Vec<String> = wrapper.split_whitespace().map(str::to_owned).collect();
        words.push(bin.to_owned());
        words.push("run".to_owned());
        let mut cmd = Command::new(&words[0]);
        cmd.args(&words[1..]);
        for (k, _) in std::env::vars() {
            if k.starts_with("OUTBOX_RELAY_") {
                cmd.env_remove(k);
            }
        }
        cmd.envs(env.iter().map(|(k, v)| (*k, v.as_str())))
            .stdin(Stdio::null())
            .stdout(fs::File::create(dir.path().join("stdout"))?)
            .stderr(fs::File::create(dir.path().join("stderr"))?);
        let child = cmd.spawn().context("spawn outbox-relay")?;
        Ok(RelayChild { child, dir })
    }

    /// What the relay wrote to stderr so far (its log), for an error message.
    pub(crate) fn log(&self) -> String {
        fs::read_to_string(self.dir.path().join("stderr")).unwrap_or_default()
    }

    pub(crate) fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGTERM (a clean stop; a `perf record` wrapper then writes its data), SIGKILL after 10 s.
    pub(crate) fn stop(&mut self) {
        let _ = Command::new("sh")
            .args(["-c", r#"kill -s TERM "$1" 2>/dev/null"#, "sh"])
            .arg(self.child.id().to_string())
            .status();
        let deadline = Instant::now() + Duration::from_secs(10);
        while matches!(self.child.try_wait(), Ok(None)) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for RelayChild {
    fn drop(&mut self) {
        self.stop();
    }
}
