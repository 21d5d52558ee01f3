//! CPU time of a process or thread from /proc, for the benches that report CPU per event (shared by
//! the drain and positions benches, each a binary of its own).

use std::process::Command;

/// utime + stime of `pid` in milliseconds (fields 14 and 15 of /proc/pid/stat, in clock ticks).
pub(crate) fn cpu_ms(pid: u32) -> f64 {
    stat_cpu_ms(&format!("/proc/{pid}/stat"))
}

/// utime + stime in milliseconds from a /proc `stat` file (a process's, or a thread's).
pub(crate) fn stat_cpu_ms(path: &str) -> f64 {
    let stat = std::fs::read_to_string(path).unwrap_or_default();
    // The command name (field 2) may hold spaces; count fields after its closing parenthesis.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<u64> = rest
        .split_whitespace()
        .map(|x| x.parse().unwrap_or(0))
        .collect();
    let ticks = f.get(11).copied().unwrap_or(0) + f.get(12).copied().unwrap_or(0);
    ticks as f64 * 1000.0 / clock_ticks() as f64
}

/// Clock ticks per second, asked once (a `getconf` run inside a measured interval would count).
fn clock_ticks() -> u64 {
    static TICKS: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *TICKS.get_or_init(|| {
        Command::new("getconf")
            .arg("CLK_TCK")
            .output()
            .ok()
            .and_then(|o| String::from_utf8_lossy(&o.stdout).trim().parse().ok())
            .unwrap_or(100)
    })
}
