//! Counters, gauges and one histogram of a running relay, and their Prometheus text form.
//!
//! Each series is a [`Counter`], a [`Gauge`] or a histogram (`value.rs`): relaxed atomics, so
//! updating one costs one atomic add on the hot path; the pipeline writes, the HTTP listener
//! (`/metrics`) and tests read. The exposition is the Prometheus text format 0.0.4
//! (<https://prometheus.io/docs/instrumenting/exposition_formats/>), written by one encoder
//! (`encode.rs`) for every series, the schema series of `schema.rs` included. The official
//! `prometheus-client` crate was weighed against this, and an update would cost the same there: its
//! `Counter` and `Gauge` are the same relaxed atomics (`fetch_add(v, Ordering::Relaxed)` on an
//! `AtomicU64` behind an `Arc`), and its histogram's lock per observation (`parking_lot`) is
//! uncontended on the relay's one thread. What it would change is the rest: it writes OpenMetrics
//! text (a `# TYPE` line without the `_total` suffix, a closing `# EOF`), not this format, so
//! `/metrics` would not stay byte for byte what the deployment kit's alerts, their promtool tests
//! and the dashboard are checked against end to end (tests/integration/deploy.rs, against a live
//! relay); it brings a registry and a derive macro for label sets where the series are fixed struct
//! fields and arrays indexed by enums (the one open label, schema failures by event type, is a
//! capped map in `schema.rs`); and it would replace only the rendering (the encoder and the
//! functions here and in `schema.rs` that call it). Metric names are the constants below, prefix
//! `outbox_relay_`.

use std::time::{SystemTime, UNIX_EPOCH};

mod encode;
#[cfg(test)]
mod golden;
mod parking;
mod schema;
mod value;

use encode::{Kind, family};
pub use parking::{ControlOp, ControlResult, ParkingMetrics};
pub use schema::SchemaMetrics;
use value::Histogram;
pub use value::{Counter, Gauge};

/// The kind of a restart (`crate::relay::Restart::kind`): the `cause` label of the metrics, and
/// one log line per change of state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CauseKind {
    /// [`Restart::Postgres`](crate::relay::Restart::Postgres).
    Postgres,
    /// [`Restart::Nats`](crate::relay::Restart::Nats).
    Nats,
    /// [`Restart::SlotHeld`](crate::relay::Restart::SlotHeld).
    SlotHeld,
}

impl CauseKind {
    /// Every kind, in the order of their discriminants (metric arrays are indexed by them).
    pub(crate) const ALL: [CauseKind; 3] =
        [CauseKind::Postgres, CauseKind::Nats, CauseKind::SlotHeld];

    /// The label value (`cause="…"` in logs and metrics).
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            CauseKind::Postgres => "postgres",
            CauseKind::Nats => "nats",
            CauseKind::SlotHeld => "slot_held",
        }
    }
}

impl std::fmt::Display for CauseKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Counter: events acknowledged by JetStream, by outcome (`ok`, `duplicate`, `dead_letter`,
/// `parked`).
pub(crate) const EVENTS_PUBLISHED: &str = "outbox_relay_events_published_total";
/// Counter: updates, deletes and truncates of the outbox table, which are not published.
pub(crate) const IGNORED_CHANGES: &str = "outbox_relay_ignored_changes_total";
/// Counter: pipeline restarts from the confirmed position, by cause.
pub(crate) const RECONNECTS: &str = "outbox_relay_reconnects_total";
/// Histogram: time from the transaction's commit to JetStream's ack.
pub(crate) const COMMIT_TO_ACK: &str = "outbox_relay_commit_to_ack_seconds";
/// Gauge: messages published and not yet acknowledged.
pub(crate) const IN_FLIGHT: &str = "outbox_relay_in_flight";
/// Gauge: the LSN confirmed to the replication slot, as a number.
pub(crate) const CONFIRMED_LSN: &str = "outbox_relay_confirmed_lsn";
/// Gauge: the highest WAL position received from Postgres, as a number.
pub(crate) const RECEIVED_LSN: &str = "outbox_relay_received_lsn";
/// Gauge: `pg_current_wal_lsn()` minus the slot's `confirmed_flush_lsn`, sampled.
pub(crate) const SLOT_LAG: &str = "outbox_relay_slot_lag_bytes";
/// Gauge: `pg_current_wal_lsn()` minus the slot's `restart_lsn`, the WAL kept for the slot, sampled.
pub(crate) const RETAINED_WAL: &str = "outbox_relay_retained_wal_bytes";
/// Gauge: the slot's `wal_status`, 1 for the current one of [`WAL_STATUSES`].
pub(crate) const WAL_STATUS: &str = "outbox_relay_slot_wal_status";
/// Gauge: outbox events another client consumed from the slot (or skipped by advancing it) that the
/// stream lacks, as the relay found at its last session start; 0 when none were.
pub(crate) const SLOT_CONSUMED: &str = "outbox_relay_slot_consumed_events";
/// Gauge: seconds since JetStream last acknowledged an event (-1 before the first).
pub(crate) const SINCE_LAST_ACK: &str = "outbox_relay_seconds_since_last_ack";
/// Gauge: 1 while a replication session streams from Postgres.
pub(crate) const STREAMING: &str = "outbox_relay_streaming";
/// Gauge: 1 while the NATS connection is up.
pub(crate) const NATS_CONNECTED: &str = "outbox_relay_nats_connected";
/// Gauge: 1 while this relay waits as a standby because another relay holds the slot.
pub(crate) const STANDBY: &str = "outbox_relay_standby";
/// Counter: trace spans sent to the OTLP collector (`[telemetry]`).
pub(crate) const SPANS_EXPORTED: &str = "outbox_relay_spans_exported_total";
/// Counter: trace spans dropped: the export queue was full, or the collector refused, failed or did
/// not answer in time.
pub(crate) const SPANS_DROPPED: &str = "outbox_relay_spans_dropped_total";
/// Counter: position service and `/wait` requests refused, by reason (`reply_subject`: a reply
/// subject that is not a requester's inbox, left unanswered; `too_large`: a body or query over 512
/// bytes; `overloaded`: a wait beyond the open waits' byte budget or the listener's share for waits).
pub(crate) const POSITION_REFUSED: &str = "outbox_relay_position_requests_refused_total";

/// `wal_status` values of `pg_replication_slots`, in the order of the gauge's codes (0 = unknown).
pub(crate) const WAL_STATUSES: [&str; 4] = ["reserved", "extended", "unreserved", "lost"];

/// Live numbers of one relay process.
#[derive(Debug, Default)]
pub struct Metrics {
    /// Stored by JetStream as new messages.
    pub published_ok: Counter,
    /// Acknowledged as duplicates (already stored: a republish after a restart).
    pub published_duplicate: Counter,
    /// Published to the dead-letter subject.
    pub dead_letters: Counter,
    /// Updates, deletes and truncates of the outbox table (never published).
    pub ignored_changes: Counter,
    /// Pipeline restarts after a transient failure, in all.
    pub reconnects: Counter,
    /// The same by cause, indexed by [`CauseKind`] (see [`Metrics::restarted`]).
    pub(crate) reconnects_by_cause: [Counter; CauseKind::ALL.len()],
    /// The LSN last confirmed to the slot, as a number.
    pub(crate) confirmed_lsn: Gauge,
    /// The highest WAL position received from Postgres, as a number.
    pub(crate) received_lsn: Gauge,
    /// Messages published and not yet acknowledged.
    pub in_flight: Gauge,
    /// Unix milliseconds of the last ack (0 = none yet).
    pub(crate) last_ack_unix_ms: Gauge,
    /// 1 while a replication session streams.
    pub streaming: Gauge,
    /// 1 while the NATS client is connected.
    pub(crate) nats_connected: Gauge,
    /// 1 while waiting as a standby: another relay holds the slot.
    pub standby: Gauge,
    /// Sampled on the control connection: `pg_current_wal_lsn() - confirmed_flush_lsn`.
    pub(crate) slot_lag_bytes: Gauge,
    /// Sampled: `pg_current_wal_lsn() - restart_lsn`, the WAL the slot keeps.
    pub(crate) retained_wal_bytes: Gauge,
    /// 1 + index into [`WAL_STATUSES`]; 0 = unknown.
    pub(crate) wal_status: Gauge,
    /// Events another client took from the slot that the stream lacks (see [`SLOT_CONSUMED`]).
    pub slot_consumed_events: Gauge,
    /// Commit (the transaction's commit timestamp) → JetStream ack.
    pub(crate) commit_to_ack: Histogram,
    /// `outbox.schemas`: failed checks by event type, reloads, schemas in force. An `Arc`: the
    /// outbox stage counts into it.
    pub schemas: std::sync::Arc<SchemaMetrics>,
    /// `outbox.on_invalid = "park"`: parked keys and events, control messages.
    pub parking: ParkingMetrics,
    /// Trace spans the collector took.
    pub spans_exported: Counter,
    /// Trace spans dropped (queue full, collector down, slow or refusing).
    pub spans_dropped: Counter,
    /// Position service requests left unanswered: their reply subject is one the relay never
    /// publishes to.
    pub position_refused_reply: Counter,
    /// Position service and `/wait` requests refused for their size.
    pub position_refused_too_large: Counter,
    /// Waits refused at once: the open waits hold their byte budget, or (HTTP) the listener's
    /// connections for waits are taken.
    pub position_refused_overloaded: Counter,
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

impl Metrics {
    /// Counts a session restart of kind `cause`.
    pub(crate) fn restarted(&self, cause: CauseKind) {
        self.reconnects.inc();
        self.reconnects_by_cause[cause as usize].inc();
    }

    /// Records that an ack arrived now.
    pub(crate) fn acked_now(&self) {
        self.last_ack_unix_ms.set(now_ms());
    }

    /// Seconds since the last ack; `None` before the first.
    pub(crate) fn seconds_since_last_ack(&self) -> Option<f64> {
        match self.last_ack_unix_ms.get() {
            0 => None,
            t => Some(now_ms().saturating_sub(t) as f64 / 1000.0),
        }
    }

    /// Streaming with both connections up: what `/readyz` reports.
    pub(crate) fn ready(&self) -> bool {
        self.streaming.get() == 1 && self.nats_connected.get() == 1
    }

    /// Sets the `wal_status` gauge from its text.
    pub(crate) fn set_wal_status(&self, status: &str) {
        let code = WAL_STATUSES
            .iter()
            .position(|s| *s == status)
            .map_or(0, |i| i as u64 + 1);
        self.wal_status.set(code);
    }

    /// The Prometheus text exposition of every series.
    pub fn render(&self) -> String {
        let mut out = String::with_capacity(4096);
        self.render_events(&mut out);
        self.render_positions(&mut out);
        self.render_slot(&mut out);
        self.render_liveness(&mut out);
        self.render_spans(&mut out);
        self.render_refused(&mut out);
        self.render_commit_to_ack(&mut out);
        self.schemas.render(&mut out);
        self.parking.render(&mut out);
        out
    }

    /// Events published, changes ignored, restarts by cause.
    fn render_events(&self, out: &mut String) {
        family(
            out,
            EVENTS_PUBLISHED,
            Kind::Counter,
            "Outbox events acknowledged by JetStream, by outcome.",
            &[
                (&[("outcome", "ok")], self.published_ok.get() as f64),
                (
                    &[("outcome", "duplicate")],
                    self.published_duplicate.get() as f64,
                ),
                (
                    &[("outcome", "dead_letter")],
                    self.dead_letters.get() as f64,
                ),
                (
                    &[("outcome", "parked")],
                    self.parking.parked_total.get() as f64,
                ),
            ],
        );
        family(
            out,
            IGNORED_CHANGES,
            Kind::Counter,
            "Updates, deletes and truncates of the outbox table (not published).",
            &[(&[], self.ignored_changes.get() as f64)],
        );
        let labels = CauseKind::ALL.map(|c| [("cause", c.as_str())]);
        let causes = CauseKind::ALL.map(|c| {
            (
                &labels[c as usize][..],
                self.reconnects_by_cause[c as usize].get() as f64,
            )
        });
        family(
            out,
            RECONNECTS,
            Kind::Counter,
            "Pipeline restarts from the confirmed position, by cause.",
            &causes,
        );
    }

    /// Messages in flight and the confirmed and received positions.
    fn render_positions(&self, out: &mut String) {
        family(
            out,
            IN_FLIGHT,
            Kind::Gauge,
            "Messages published and not yet acknowledged.",
            &[(&[], self.in_flight.get() as f64)],
        );
        family(
            out,
            CONFIRMED_LSN,
            Kind::Gauge,
            "The LSN confirmed to the replication slot (as a number).",
            &[(&[], self.confirmed_lsn.get() as f64)],
        );
        family(
            out,
            RECEIVED_LSN,
            Kind::Gauge,
            "The highest WAL position received from Postgres (as a number).",
            &[(&[], self.received_lsn.get() as f64)],
        );
    }

    /// The slot as last sampled: lag, retained WAL, `wal_status`.
    fn render_slot(&self, out: &mut String) {
        family(
            out,
            SLOT_LAG,
            Kind::Gauge,
            "pg_current_wal_lsn() minus the slot's confirmed_flush_lsn, sampled.",
            &[(&[], self.slot_lag_bytes.get() as f64)],
        );
        family(
            out,
            RETAINED_WAL,
            Kind::Gauge,
            "pg_current_wal_lsn() minus the slot's restart_lsn: WAL kept for the slot, sampled.",
            &[(&[], self.retained_wal_bytes.get() as f64)],
        );
        let code = self.wal_status.get();
        let labels = WAL_STATUSES.map(|s| [("status", s)]);
        let mut statuses = [(&[][..], 0.0); WAL_STATUSES.len()];
        for (i, sample) in statuses.iter_mut().enumerate() {
            let current = code == i as u64 + 1;
            *sample = (&labels[i][..], if current { 1.0 } else { 0.0 });
        }
        family(
            out,
            WAL_STATUS,
            Kind::Gauge,
            "The slot's wal_status (1 for the current one); lost means events may be gone.",
            &statuses,
        );
        family(
            out,
            SLOT_CONSUMED,
            Kind::Gauge,
            "Outbox events another client consumed from the slot (or advanced it past) that the stream lacks; 0 when none.",
            &[(&[], self.slot_consumed_events.get() as f64)],
        );
    }

    /// The stall detector and the connection and standby states.
    fn render_liveness(&self, out: &mut String) {
        family(
            out,
            SINCE_LAST_ACK,
            Kind::Gauge,
            "Seconds since JetStream last acknowledged an event (-1 before the first): the stall detector.",
            &[(&[], self.seconds_since_last_ack().unwrap_or(-1.0))],
        );
        family(
            out,
            STREAMING,
            Kind::Gauge,
            "1 while a replication session streams from Postgres.",
            &[(&[], self.streaming.get() as f64)],
        );
        family(
            out,
            STANDBY,
            Kind::Gauge,
            "1 while this relay waits as a standby because another relay holds the slot.",
            &[(&[], self.standby.get() as f64)],
        );
        family(
            out,
            NATS_CONNECTED,
            Kind::Gauge,
            "1 while the NATS connection is up.",
            &[(&[], self.nats_connected.get() as f64)],
        );
    }

    /// Trace spans exported and dropped.
    fn render_spans(&self, out: &mut String) {
        family(
            out,
            SPANS_EXPORTED,
            Kind::Counter,
            "Trace spans sent to the OTLP collector ([telemetry]).",
            &[(&[], self.spans_exported.get() as f64)],
        );
        family(
            out,
            SPANS_DROPPED,
            Kind::Counter,
            "Trace spans dropped: export queue full, or the collector refused, failed or did not answer in time.",
            &[(&[], self.spans_dropped.get() as f64)],
        );
    }

    /// Requests the position service (and `/wait`) refused.
    fn render_refused(&self, out: &mut String) {
        family(
            out,
            POSITION_REFUSED,
            Kind::Counter,
            "Position service and /wait requests refused, by reason (reply_subject: never answered; too_large: over 512 bytes).",
            &[
                (
                    &[("reason", "reply_subject")],
                    self.position_refused_reply.get() as f64,
                ),
                (
                    &[("reason", "too_large")],
                    self.position_refused_too_large.get() as f64,
                ),
                (
                    &[("reason", "overloaded")],
                    self.position_refused_overloaded.get() as f64,
                ),
            ],
        );
    }

    /// The commit → ack latency histogram.
    fn render_commit_to_ack(&self, out: &mut String) {
        encode::histogram(
            out,
            COMMIT_TO_ACK,
            "Time from the transaction's commit to JetStream's ack.",
            &self.commit_to_ack,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn renders_prometheus_text() {
        let m = Metrics::default();
        m.published_ok.inc();
        m.published_ok.inc();
        m.dead_letters.inc();
        m.set_wal_status("extended");
        m.commit_to_ack.observe(Duration::from_millis(3));
        m.commit_to_ack.observe(Duration::from_secs(60));
        let text = m.render();
        assert!(
            text.contains("outbox_relay_events_published_total{outcome=\"ok\"} 2\n"),
            "{text}"
        );
        assert!(text.contains("outbox_relay_events_published_total{outcome=\"dead_letter\"} 1\n"));
        assert!(text.contains("outbox_relay_slot_wal_status{status=\"extended\"} 1\n"));
        assert!(text.contains("outbox_relay_slot_wal_status{status=\"lost\"} 0\n"));
        assert!(text.contains("outbox_relay_slot_consumed_events 0\n"));
        assert!(text.contains("outbox_relay_commit_to_ack_seconds_bucket{le=\"0.002\"} 0\n"));
        assert!(text.contains("outbox_relay_commit_to_ack_seconds_bucket{le=\"0.005\"} 1\n"));
        assert!(text.contains("outbox_relay_commit_to_ack_seconds_bucket{le=\"30\"} 1\n"));
        assert!(text.contains("outbox_relay_commit_to_ack_seconds_bucket{le=\"+Inf\"} 2\n"));
        assert!(text.contains("outbox_relay_commit_to_ack_seconds_count 2\n"));
        assert!(text.contains("outbox_relay_seconds_since_last_ack -1\n"));
        assert!(text.contains("outbox_relay_standby 0\n"));
        // Every sample line belongs to a declared family.
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let name = line.split(['{', ' ']).next().unwrap();
            let base = name
                .trim_end_matches("_bucket")
                .trim_end_matches("_sum")
                .trim_end_matches("_count");
            assert!(text.contains(&format!("# TYPE {base} ")), "{line}");
        }
    }

    #[test]
    fn ready_needs_both_connections() {
        let m = Metrics::default();
        assert!(!m.ready());
        m.streaming.set(1);
        assert!(!m.ready());
        m.nats_connected.set(1);
        assert!(m.ready());
    }
}
