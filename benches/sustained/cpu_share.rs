//! Who used the CPU during a phase of the sustained-load bench, so each row of its table shows what
//! bounds it: the writers (the bench's writer threads and the Postgres backends they commit through),
//! the slot's walsender, the relay, nats-server, the consumer thread, the rest of Postgres (WAL
//! writer, checkpointer…), the rest of the bench process, and everything on the machine that is not
//! ours (other work on a shared box).
//!
//! Each is utime+stime from /proc (`/proc/<pid>/stat` of a process, `/proc/self/task/<tid>/stat` of
//! the bench's threads, picked by the names its runtimes give them), read at the phase's start and
//! end; the machine's busy time comes from `/proc/stat`. Shares are % of one core (200 % = both
//! cores of a 2-vCPU box); the 10 ms tick makes them good to about 0.1 % over a 60 s phase.

use std::fs;
use std::time::Instant;

use crate::cpu::{cpu_ms, stat_cpu_ms};

/// Thread names of the bench's writer runtime and consumer thread (15 bytes at most: the kernel
/// keeps no more of a thread's name).
pub(crate) const WRITER_THREAD: &str = "bench-writer";
pub(crate) const CONSUMER_THREAD: &str = "bench-consumer";

/// The processes of one phase.
pub(crate) struct Pids {
    pub(crate) relay: u32,
    pub(crate) nats: u32,
    pub(crate) walsender: Option<u32>,
    pub(crate) writer_backends: Vec<u32>,
    pub(crate) postmaster: u32,
}

/// CPU ms of each party so far.
#[derive(Clone, Copy)]
pub(crate) struct Snapshot {
    at: Instant,
    relay: f64,
    nats: f64,
    walsender: f64,
    writer_backends: f64,
    postgres_all: f64,
    bench_writers: f64,
    bench_consumer: f64,
    bench_all: f64,
    /// Busy and total jiffies of the whole machine (all cores), and its core count.
    machine_busy: u64,
    machine_total: u64,
    cores: usize,
}

/// % of one core over a phase.
#[derive(Clone, Copy, Default)]
pub(crate) struct Shares {
    pub(crate) writer_client: f64,
    pub(crate) writer_backends: f64,
    pub(crate) walsender: f64,
    pub(crate) relay: f64,
    pub(crate) nats: f64,
    pub(crate) consumer: f64,
    pub(crate) postgres_other: f64,
    pub(crate) bench_other: f64,
    /// Busy time of the machine that none of the above used: other people's work.
    pub(crate) not_ours: f64,
    /// The whole machine's busy time, and what it could give (cores × 100).
    pub(crate) machine: f64,
    pub(crate) capacity: f64,
}

impl Shares {
    /// Every share as (JSON name, words for the progress line, value), in the order both print
    /// them: the one list the line, the table and the JSON read, so a party added here shows in
    /// all three.
    pub(crate) fn parties(&self) -> [(&'static str, &'static str, f64); 11] {
        [
            ("writer_client", "writers", self.writer_client),
            ("writer_backends", "writer backends", self.writer_backends),
            ("walsender", "walsender", self.walsender),
            ("relay", "relay", self.relay),
            ("nats_server", "nats-server", self.nats),
            ("consumer", "consumer", self.consumer),
            ("postgres_other", "postgres other", self.postgres_other),
            ("bench_other", "bench other", self.bench_other),
            ("not_ours", "not ours", self.not_ours),
            ("machine", "machine", self.machine),
            ("capacity", "of", self.capacity),
        ]
    }

    /// `writers 11, writer backends 18, …, machine 100 of 200` for the progress line.
    pub(crate) fn text(&self) -> String {
        let parts: Vec<String> = self
            .parties()
            .iter()
            .map(|(_, words, v)| format!("{words} {v:.0}"))
            .collect();
        // "machine N" and "of M" read as one phrase.
        let (head, tail) = parts.split_at(parts.len() - 2);
        format!("{}; {}", head.join(", "), tail.join(" "))
    }

    /// `{"writer_client":11.0,…,"capacity":200}` for the JSON line.
    pub(crate) fn json(&self) -> String {
        let parts: Vec<String> = self
            .parties()
            .iter()
            .map(|(name, _, v)| match *name {
                "capacity" => format!("\"{name}\":{v:.0}"),
                _ => format!("\"{name}\":{v:.1}"),
            })
            .collect();
        format!("{{{}}}", parts.join(","))
    }
}

impl Snapshot {
    pub(crate) fn take(p: &Pids) -> Snapshot {
        let (machine_busy, machine_total, cores) = machine_jiffies();
        Snapshot {
            at: Instant::now(),
            relay: cpu_ms(p.relay),
            nats: cpu_ms(p.nats),
            walsender: p.walsender.map_or(0.0, cpu_ms),
            writer_backends: p.writer_backends.iter().map(|&pid| cpu_ms(pid)).sum(),
            postgres_all: postgres_ms(p.postmaster),
            bench_writers: own_threads_ms(WRITER_THREAD),
            bench_consumer: own_threads_ms(CONSUMER_THREAD),
            bench_all: stat_cpu_ms("/proc/self/stat"),
            machine_busy,
            machine_total,
            cores,
        }
    }

    /// Shares of one core between `self` (the start) and `end`.
    pub(crate) fn shares_until(&self, end: &Snapshot) -> Shares {
        let wall_ms = end.at.duration_since(self.at).as_secs_f64() * 1000.0;
        let pct = |a: f64, b: f64| (b - a).max(0.0) / wall_ms * 100.0;
        let capacity = end.cores as f64 * 100.0;
        let total = end.machine_total.saturating_sub(self.machine_total).max(1) as f64;
        let machine = end.machine_busy.saturating_sub(self.machine_busy) as f64 / total * capacity;
        let writer_backends = pct(self.writer_backends, end.writer_backends);
        let walsender = pct(self.walsender, end.walsender);
        let postgres_all = pct(self.postgres_all, end.postgres_all);
        let writer_client = pct(self.bench_writers, end.bench_writers);
        let consumer = pct(self.bench_consumer, end.bench_consumer);
        let bench_all = pct(self.bench_all, end.bench_all);
        let relay = pct(self.relay, end.relay);
        let nats = pct(self.nats, end.nats);
        Shares {
            writer_client,
            writer_backends,
            walsender,
            relay,
            nats,
            consumer,
            postgres_other: (postgres_all - writer_backends - walsender).max(0.0),
            bench_other: (bench_all - writer_client - consumer).max(0.0),
            not_ours: (machine - bench_all - postgres_all - relay - nats).max(0.0),
            machine,
            capacity,
        }
    }
}

/// The postmaster's pid, from the first line of `postmaster.pid` in its data directory.
pub(crate) fn postmaster_pid(data_dir: &std::path::Path) -> anyhow::Result<u32> {
    let text = fs::read_to_string(data_dir.join("postmaster.pid"))?;
    let pid = text.lines().next().unwrap_or_default().trim().parse()?;
    Ok(pid)
}

/// CPU ms of the postmaster and every process it started (backends, walsenders, WAL writer,
/// checkpointer, autovacuum): a child that has exited by the second reading drops out of it.
fn postgres_ms(postmaster: u32) -> f64 {
    let Ok(dir) = fs::read_dir("/proc") else {
        return 0.0;
    };
    let mut sum = cpu_ms(postmaster);
    for entry in dir.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        let stat = fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        // Field 4 (ppid) is the second field after the command name's closing parenthesis.
        let ppid = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().nth(1))
            .and_then(|p| p.parse::<u32>().ok());
        if ppid == Some(postmaster) {
            sum += cpu_ms(pid);
        }
    }
    sum
}

/// CPU ms of this process's threads whose name is `name`.
fn own_threads_ms(name: &str) -> f64 {
    let Ok(tasks) = fs::read_dir("/proc/self/task") else {
        return 0.0;
    };
    tasks
        .flatten()
        .filter(|t| {
            fs::read_to_string(t.path().join("comm")).is_ok_and(|comm| comm.trim_end() == name)
        })
        .map(|t| stat_cpu_ms(&t.path().join("stat").to_string_lossy()))
        .sum()
}

/// Busy and total jiffies of all cores (the `cpu` line of /proc/stat: idle and iowait are not busy),
/// and the number of cores (`cpuN` lines).
fn machine_jiffies() -> (u64, u64, usize) {
    let stat = fs::read_to_string("/proc/stat").unwrap_or_default();
    let cores = stat
        .lines()
        .filter(|l| l.starts_with("cpu") && l.as_bytes().get(3).is_some_and(u8::is_ascii_digit))
        .count()
        .max(1);
    let fields: Vec<u64> = stat
        .lines()
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .skip(1)
        .take(8)
        .map(|x| x.parse().unwrap_or(0))
        .collect();
    let total: u64 = fields.iter().sum();
    let idle = fields.get(3).copied().unwrap_or(0) + fields.get(4).copied().unwrap_or(0);
    (total.saturating_sub(idle), total, cores)
}
