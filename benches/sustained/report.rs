//! The sustained-load bench's numbers: per phase, the latency percentiles of commit → stored
//! (JetStream's timestamp of the stored message) and commit → received (the consumer has it), of
//! change → stored (from the database's clock at the INSERT, the field's `updated_at` → broker
//! timestamp), the rate the writers reached, whether the pipeline kept up, and each party's CPU share; printed as a
//! line per phase while the bench runs, then as one table and one JSON line.

use std::sync::atomic::{AtomicI64, Ordering};

use crate::consumer::Receipts;
use crate::cpu_share::Shares;
use crate::writers::{Load, Written};

/// p50, p99, p99.9 and max of a latency, in ms.
#[derive(Clone, Copy, Default)]
pub(crate) struct Percentiles {
    pub(crate) p50: f64,
    pub(crate) p99: f64,
    pub(crate) p999: f64,
    pub(crate) max: f64,
}

impl Percentiles {
    /// Of `ns` (sorted in place); NaN when empty.
    fn of(ns: &mut [i64]) -> Percentiles {
        if ns.is_empty() {
            return Percentiles {
                p50: f64::NAN,
                p99: f64::NAN,
                p999: f64::NAN,
                max: f64::NAN,
            };
        }
        ns.sort_unstable();
        let at = |q: f64| ns[((ns.len() as f64 * q) as usize).min(ns.len() - 1)] as f64 / 1e6;
        Percentiles {
            p50: at(0.50),
            p99: at(0.99),
            p999: at(0.999),
            max: ns[ns.len() - 1] as f64 / 1e6,
        }
    }

    fn text(&self) -> String {
        format!(
            "{:.2} / {:.2} / {:.2} / {:.2}",
            self.p50, self.p99, self.p999, self.max
        )
    }

    fn json(&self) -> String {
        let n = |x: f64| {
            if x.is_finite() {
                format!("{x:.3}")
            } else {
                "null".into()
            }
        };
        format!(
            r#"{{"p50_ms":{},"p99_ms":{},"p999_ms":{},"max_ms":{}}}"#,
            n(self.p50),
            n(self.p99),
            n(self.p999),
            n(self.max)
        )
    }
}

/// One phase's result.
pub(crate) struct Phase {
    /// `fixed`, `probe` (a step of the search for the highest sustained rate) or `max`.
    pub(crate) kind: &'static str,
    /// `relay` or `alt` (`BENCH_RELAY_ALT`).
    pub(crate) variant: &'static str,
    pub(crate) atomic: bool,
    pub(crate) load: Load,
    pub(crate) events: usize,
    pub(crate) achieved_eps: f64,
    pub(crate) received: usize,
    /// Events the consumer had before their writer read the clock after COMMIT (counted as 0 ms).
    pub(crate) before_commit_returned: usize,
    pub(crate) stored: Percentiles,
    pub(crate) total: Percentiles,
    /// From the database's `clock_timestamp()` at the INSERT (before the commit) to stored.
    pub(crate) change_stored: Percentiles,
    /// p99 of commit → received over the events committed in the phase's last 5 s.
    pub(crate) tail_p99_ms: f64,
    pub(crate) written: Written,
    pub(crate) shares: Shares,
    pub(crate) loadavg: (f64, f64),
    pub(crate) kept_up: bool,
}

/// Whether a phase counts as sustained (what the search for the highest rate asks).
pub(crate) struct Criterion {
    /// The writers reached at least this share of the rate (0.97).
    pub(crate) min_achieved: f64,
    /// The p99 of the phase's last 5 s stayed at or under this (a pipeline that falls behind
    /// grows its latency with every second).
    pub(crate) tail_p99_ms: f64,
}

/// What a phase measured, before it is summed up.
pub(crate) struct Measured<'a> {
    pub(crate) commits: &'a [AtomicI64],
    pub(crate) receipts: &'a Receipts,
    pub(crate) written: Written,
    pub(crate) shares: Shares,
    pub(crate) loadavg: (f64, f64),
}

/// Puts a phase's numbers together.
pub(crate) fn phase(
    kind: &'static str,
    variant: &'static str,
    atomic: bool,
    load: Load,
    m: Measured<'_>,
    criterion: &Criterion,
) -> Phase {
    let Measured {
        commits,
        receipts,
        written,
        shares,
        loadavg,
    } = m;
    let events = load.events();
    let last_commit = commits
        .iter()
        .map(|c| c.load(Ordering::Relaxed))
        .max()
        .unwrap_or(0);
    let tail_from = last_commit - 5_000_000_000;
    let (mut stored, mut total, mut tail) = (Vec::new(), Vec::new(), Vec::new());
    let mut change_stored = Vec::new();
    let mut before_commit_returned = 0;
    for (i, commit) in commits.iter().enumerate().take(events) {
        let commit = commit.load(Ordering::Relaxed);
        let received = receipts.received_ns[i].load(Ordering::Relaxed);
        if commit == 0 || received == 0 {
            continue;
        }
        let at_stored = receipts.stored_ns[i].load(Ordering::Relaxed);
        if received < commit {
            before_commit_returned += 1;
        }
        total.push((received - commit).max(0));
        stored.push((at_stored - commit).max(0));
        let change = receipts.change_ns[i].load(Ordering::Relaxed);
        if change > 0 {
            change_stored.push((at_stored - change).max(0));
        }
        if commit >= tail_from {
            tail.push((received - commit).max(0));
        }
    }
    let received = total.len();
    let achieved_eps = written.txns as f64 * load.per_txn as f64 / written.secs.max(1e-9);
    let tail_p99_ms = Percentiles::of(&mut tail).p99;
    let kept_up = received == events
        && achieved_eps >= criterion.min_achieved * load.rate as f64
        && tail_p99_ms <= criterion.tail_p99_ms;
    Phase {
        kind,
        variant,
        atomic,
        load,
        events,
        achieved_eps,
        received,
        before_commit_returned,
        stored: Percentiles::of(&mut stored),
        total: Percentiles::of(&mut total),
        change_stored: Percentiles::of(&mut change_stored),
        tail_p99_ms,
        written,
        shares,
        loadavg,
        kept_up,
    }
}

impl Phase {
    fn mode(&self) -> &'static str {
        if self.atomic { "atomic" } else { "single" }
    }

    /// One line while the bench runs.
    pub(crate) fn print_line(&self) {
        println!(
            "{} {} {} {}/s x{} for {:.0} s: achieved {:.0}/s, received {} of {}{}; commit -> stored {} ms; \
             commit -> received {} ms (last 5 s p99 {:.2}); change (clock_timestamp() in the INSERT) -> stored {} ms; writers' round trip p99 {:.2} ms, at most {:.1} ms behind schedule; \
             CPU % of a core: {}; load {:.1} -> {:.1}; {}",
            self.variant,
            self.kind,
            self.mode(),
            self.load.rate,
            self.load.per_txn,
            self.load.secs,
            self.achieved_eps,
            self.received,
            self.events,
            if self.before_commit_returned > 0 {
                format!(
                    " ({} before their COMMIT returned)",
                    self.before_commit_returned
                )
            } else {
                String::new()
            },
            self.stored.text(),
            self.total.text(),
            self.tail_p99_ms,
            self.change_stored.text(),
            self.written.round_trip_p99_ms,
            self.written.behind_max_ms,
            self.shares.text(),
            self.loadavg.0,
            self.loadavg.1,
            if self.kept_up {
                "kept up"
            } else {
                "did NOT keep up"
            },
        );
    }

    fn json(&self) -> String {
        format!(
            r#"{{"kind":"{}","variant":"{}","mode":"{}","per_txn":{},"rate":{},"secs":{:.0},"events":{},"achieved_eps":{:.0},"received":{},"before_commit_returned":{},"stored":{},"received_latency":{},"change_stored":{},"tail_p99_ms":{:.3},"writer_round_trip_p99_ms":{:.3},"writer_behind_max_ms":{:.1},"cpu_pct":{},"loadavg":[{:.2},{:.2}],"kept_up":{}}}"#,
            self.kind,
            self.variant,
            self.mode(),
            self.load.per_txn,
            self.load.rate,
            self.load.secs,
            self.events,
            self.achieved_eps,
            self.received,
            self.before_commit_returned,
            self.stored.json(),
            self.total.json(),
            self.change_stored.json(),
            self.tail_p99_ms,
            self.written.round_trip_p99_ms,
            self.written.behind_max_ms,
            self.shares.json(),
            self.loadavg.0,
            self.loadavg.1,
            self.kept_up,
        )
    }
}

/// The table of the fixed-rate and `max` phases (the probes were printed as they ran), then one
/// JSON line with every phase.
pub(crate) fn print(phases: &[Phase]) {
    println!(
        "\n== sustained load: latency from the writer's COMMIT returning, ms (p50 / p99 / p99.9 / max); \
         CPU as % of one core over the writing =="
    );
    println!(
        "| mode | ev/txn | rate ev/s | achieved ev/s | commit → stored | commit → received | kept up | \
         writers (client + backends) | walsender | relay | nats-server | consumer | postgres other | not ours | load avg |"
    );
    println!("|---|---:|---:|---:|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|");
    for p in phases.iter().filter(|p| p.kind != "probe") {
        let rate = if p.kind == "max" {
            format!("**max** {}", p.load.rate)
        } else {
            p.load.rate.to_string()
        };
        // The table's CPU columns: the writers' two shares in one cell, then the pipeline's parties
        // and the rest, as the header names them (bench other, machine and capacity are left out).
        let cpu: Vec<String> = p
            .shares
            .parties()
            .iter()
            .filter(|(name, _, _)| !matches!(*name, "bench_other" | "machine" | "capacity"))
            .map(|(_, _, v)| format!("{v:.0}"))
            .collect();
        println!(
            "| {}{} | {} | {} | {:.0} | {} | {} | {} | {} + {} | {:.1}–{:.1} |",
            p.mode(),
            if p.variant == "relay" {
                String::new()
            } else {
                format!(" ({})", p.variant)
            },
            p.load.per_txn,
            rate,
            p.achieved_eps,
            p.stored.text(),
            p.total.text(),
            if p.kept_up { "yes" } else { "**no**" },
            cpu[0],
            cpu[1..].join(" | "),
            p.loadavg.0,
            p.loadavg.1,
        );
    }
    let all: Vec<String> = phases.iter().map(Phase::json).collect();
    println!("{{\"bench\":\"sustained\",\"phases\":[{}]}}", all.join(","));
}
