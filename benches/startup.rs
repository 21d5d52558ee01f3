//! How fast the relay binary starts: the time from spawning `outbox-relay --version` to its exit, and
//! from spawning `outbox-relay run` to its first `/readyz` 200 (connected to a real Postgres and
//! nats-server, the slot and stream already there: a restart), next to the file's size, for this
//! build and any others named in the same run. The number behind shipping a stripped binary: does
//! dropping the debug info and symbols change how fast the relay is up?
//!
//! Per round every binary takes its turn (the first one rotating, so a busy machine slows them
//! alike): `BENCH_VERSION_RUNS` (20) runs of `--version`, then one `run` polled every millisecond
//! until ready and then stopped with SIGTERM. Before the rounds, each binary runs once unmeasured
//! (the stream is created then, and the file is in the page cache for every measured start: a cold
//! cache would need the whole machine's cache dropped, which a shared box does not allow).
//!
//! `cargo bench --bench startup`; knobs: `BENCH_ROUNDS` (10), `BENCH_VERSION_RUNS` (20),
//! `BENCH_STARTUP_BINS` (`label=/path/to/outbox-relay,…`: other builds, e.g. the one before a
//! change), `BENCH_RELAY_ALT` (one more, labelled `alt`). Without `--bench` (`cargo test
//! --benches`) it skips: it starts servers.

#[path = "common/outbox_db.rs"]
mod outbox_db;
#[path = "common/readyz.rs"]
mod readyz;
#[path = "common/relay_child.rs"]
mod relay_child;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use outbox_relay::testkit::{NatsServer, PgServer, TestDb};

use relay_child::RelayChild;

const PUBLICATION: &str = "bench_pub";
const SLOT: &str = "startup";

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// A binary under test and what it measured.
struct Binary {
    label: String,
    path: String,
    size_bytes: u64,
    version_ms: Vec<f64>,
    ready_ms: Vec<f64>,
    rss_at_ready_mb: Vec<f64>,
}

fn main() -> anyhow::Result<()> {
    if !std::env::args().any(|a| a == "--bench") {
        println!("startup bench: skipped (it starts servers; run `cargo bench --bench startup`)");
        return Ok(());
    }
    let rounds: usize = env_or("BENCH_ROUNDS", 10usize).max(1);
    let version_runs: usize = env_or("BENCH_VERSION_RUNS", 20usize).max(1);
    let mut named = vec![(
        "relay".to_owned(),
        env!("CARGO_BIN_EXE_outbox-relay").to_owned(),
    )];
    for entry in std::env::var("BENCH_STARTUP_BINS")
        .unwrap_or_default()
        .split(',')
        .filter(|e| !e.trim().is_empty())
    {
        let Some((label, path)) = entry.split_once('=') else {
            bail!("BENCH_STARTUP_BINS: {entry:?} is not label=/path/to/outbox-relay");
        };
        named.push((label.trim().to_owned(), path.trim().to_owned()));
    }
    if let Ok(alt) = std::env::var("BENCH_RELAY_ALT")
        && !alt.is_empty()
    {
        named.push(("alt".to_owned(), alt));
    }
    let mut binaries = Vec::new();
    for (label, path) in named {
        let size_bytes = std::fs::metadata(&path)
            .with_context(|| format!("{label}: {path}"))?
            .len();
        binaries.push(Binary {
            label,
            path,
            size_bytes,
            version_ms: Vec::new(),
            ready_ms: Vec::new(),
            rss_at_ready_mb: Vec::new(),
        });
    }

    let pg = PgServer::start_private();
    let nats = NatsServer::start();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let db = rt.block_on(TestDb::create(&pg));
    outbox_db::outbox_setup(&db, PUBLICATION)?;
    db.psql(&format!(
        "SELECT pg_create_logical_replication_slot('{SLOT}', 'pgoutput')"
    ));
    let env = |listen: &str| {
        vec![
            (
                "OUTBOX_RELAY_POSTGRES_URL",
                format!("{}?sslmode=disable", db.url()),
            ),
            ("OUTBOX_RELAY_POSTGRES_SLOT", SLOT.to_owned()),
            ("OUTBOX_RELAY_POSTGRES_PUBLICATION", PUBLICATION.to_owned()),
            ("OUTBOX_RELAY_NATS_URL", nats.url()),
            ("OUTBOX_RELAY_HTTP_LISTEN", listen.to_owned()),
        ]
    };
    println!(
        "== startup: {} binaries, {rounds} rounds, {version_runs} --version runs per round; load average {:.2} ==",
        binaries.len(),
        load_average()
    );
    for b in &binaries {
        time_to_ready(&b.path, &env(&readyz::free_listen_addr()?))
            .with_context(|| format!("{}: the unmeasured first start", b.label))?;
    }
    let count = binaries.len();
    for round in 0..rounds {
        for k in 0..count {
            let b = &mut binaries[(round + k) % count];
            for _ in 0..version_runs {
                b.version_ms.push(time_version(&b.path)?);
            }
            let (ms, rss) = time_to_ready(&b.path, &env(&readyz::free_listen_addr()?))?;
            b.ready_ms.push(ms);
            b.rss_at_ready_mb.push(rss);
        }
    }
    println!(
        "| binary | size MB | --version ms, median [p90] | spawn → /readyz 200 ms, median [min–max] | RSS at ready MB |"
    );
    println!("|---|---:|---|---|---:|");
    for b in &mut binaries {
        let (v50, v90) = (
            quantile(&mut b.version_ms, 0.5),
            quantile(&mut b.version_ms, 0.9),
        );
        let (r50, rmin, rmax) = (
            quantile(&mut b.ready_ms, 0.5),
            quantile(&mut b.ready_ms, 0.0),
            quantile(&mut b.ready_ms, 1.0),
        );
        println!(
            "| {} | {:.1} | {v50:.2} [{v90:.2}] | {r50:.1} [{rmin:.1}–{rmax:.1}] | {:.1} |",
            b.label,
            b.size_bytes as f64 / 1e6,
            quantile(&mut b.rss_at_ready_mb, 0.5),
        );
    }
    println!("load average at the end {:.2}", load_average());
    Ok(())
}

/// Wall ms from spawning `bin --version` to its exit.
fn time_version(bin: &str) -> anyhow::Result<f64> {
    let t = Instant::now();
    let status = Command::new(bin)
        .arg("--version")
        .stdout(Stdio::null())
        .status()?;
    let ms = t.elapsed().as_secs_f64() * 1000.0;
    if !status.success() {
        bail!("{bin} --version: {status}");
    }
    Ok(ms)
}

/// Wall ms from spawning `bin run` to the first 200 of `/readyz`, polled every millisecond, and its
/// resident set then (MB); the relay is stopped afterwards (SIGTERM, as a rolling restart does).
fn time_to_ready(bin: &str, env: &[(&str, String)]) -> anyhow::Result<(f64, f64)> {
    let listen = &env
        .iter()
        .find(|(k, _)| *k == "OUTBOX_RELAY_HTTP_LISTEN")
        .context("no listen address")?
        .1;
    let t = Instant::now();
    let mut relay = RelayChild::spawn_bin(bin, env)?;
    loop {
        if readyz::is_ready(listen) {
            break;
        }
        if let Ok(Some(status)) = relay.child.try_wait() {
            bail!(
                "the relay exited before it was ready ({status}):\n{}",
                relay.log()
            );
        }
        if t.elapsed() > Duration::from_secs(60) {
            bail!("the relay was not ready in 60 s:\n{}", relay.log());
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    let ms = t.elapsed().as_secs_f64() * 1000.0;
    let rss = resident_mb(relay.pid());
    relay.stop();
    Ok((ms, rss))
}

/// VmRSS of `pid` in MB.
fn resident_mb(pid: u32) -> f64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .map_or(f64::NAN, |kb| kb / 1024.0)
}

/// The `q` quantile of `v` (sorted in place); NaN when empty.
fn quantile(v: &mut [f64], q: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * q).round() as usize]
}

fn load_average() -> f64 {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(f64::NAN)
}
