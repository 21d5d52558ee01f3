//! The parking series (`outbox.on_invalid = "park"`): how many keys are parked, how many events
//! their runs hold, how old the oldest parked key is, events stored as parked copies, and the
//! control messages the relay read, by operation and result. The session sets the gauges from
//! the sink's parked set after every burst of acks and at its start; the operation and result
//! labels are fixed lists, so nothing from input becomes a label.

use std::time::{SystemTime, UNIX_EPOCH};

use super::encode::{Kind, family};
use super::value::{Counter, Gauge};

/// Gauge: keys parked now.
pub(crate) const PARKED_KEYS: &str = "outbox_relay_parked_keys";
/// Gauge: events held on parked keys (the sum of their runs).
pub(crate) const PARKED_EVENTS: &str = "outbox_relay_parked_events";
/// Gauge: seconds since the oldest parked key's poison event committed (0 when none is parked).
pub(crate) const PARKED_OLDEST_AGE: &str = "outbox_relay_parked_oldest_age_seconds";
/// Counter: control messages read, by operation and result.
pub(crate) const CONTROL_MESSAGES: &str = "outbox_relay_control_messages_total";

/// A control message's operation, as the `op` label says it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ControlOp {
    /// `requeue`: republish a parked key's run.
    Requeue,
    /// `discard`: drop a parked key's run.
    Discard,
    /// `requeue_event`: republish one dead letter.
    RequeueEvent,
    /// Content the relay could not read as a control message.
    Invalid,
}

/// What came of a control message, as the `result` label says it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ControlResult {
    /// Carried out: a key released (or parked again at a still-invalid event), a dead letter
    /// republished.
    Applied,
    /// Nothing to do: the key is not parked, the dead letter not found.
    Nothing,
    /// Ignored with a warning: content that is no control message, or a non-transactional one.
    Ignored,
}

const OPS: [(ControlOp, &str); 4] = [
    (ControlOp::Requeue, "requeue"),
    (ControlOp::Discard, "discard"),
    (ControlOp::RequeueEvent, "requeue_event"),
    (ControlOp::Invalid, "invalid"),
];
const RESULTS: [(ControlResult, &str); 3] = [
    (ControlResult::Applied, "applied"),
    (ControlResult::Nothing, "nothing"),
    (ControlResult::Ignored, "ignored"),
];

/// `outbox_relay_parked_*` and `outbox_relay_control_messages_total`.
#[derive(Debug, Default)]
pub struct ParkingMetrics {
    /// Keys parked now.
    pub keys: Gauge,
    /// Events held on parked keys.
    pub events: Gauge,
    /// Unix milliseconds of the oldest parked key's poison commit (0 = none parked).
    pub(crate) oldest_unix_ms: Gauge,
    /// Events stored as parked copies (the `parked` outcome of events published).
    pub parked_total: Counter,
    /// Control messages by operation and result, indexed as `OPS` × `RESULTS`.
    control: [[Counter; 3]; 4],
}

impl ParkingMetrics {
    /// Counts one control message.
    pub fn control(&self, op: ControlOp, result: ControlResult) {
        let o = OPS.iter().position(|(x, _)| *x == op).unwrap_or(3);
        let r = RESULTS.iter().position(|(x, _)| *x == result).unwrap_or(2);
        self.control[o][r].inc();
    }

    /// Control messages of `op` with `result` so far.
    pub fn controls(&self, op: ControlOp, result: ControlResult) -> u64 {
        let o = OPS.iter().position(|(x, _)| *x == op).unwrap_or(3);
        let r = RESULTS.iter().position(|(x, _)| *x == result).unwrap_or(2);
        self.control[o][r].get()
    }

    /// Sets the gauges: `keys` parked holding `events`, the oldest poison committed at
    /// `oldest_unix_ms` (0 for none).
    pub(crate) fn set(&self, keys: usize, events: u64, oldest_unix_ms: u64) {
        self.keys.set(keys as u64);
        self.events.set(events);
        self.oldest_unix_ms.set(oldest_unix_ms);
    }

    /// Appends the Prometheus text of these series to `out`.
    pub(crate) fn render(&self, out: &mut String) {
        family(
            out,
            PARKED_KEYS,
            Kind::Gauge,
            "Keys parked behind an event that could not be published.",
            &[(&[], self.keys.get() as f64)],
        );
        family(
            out,
            PARKED_EVENTS,
            Kind::Gauge,
            "Events held on parked keys.",
            &[(&[], self.events.get() as f64)],
        );
        let age = match self.oldest_unix_ms.get() {
            0 => 0.0,
            t => now_ms().saturating_sub(t) as f64 / 1000.0,
        };
        family(
            out,
            PARKED_OLDEST_AGE,
            Kind::Gauge,
            "Seconds since the oldest parked key's poison event committed (0 when none is parked).",
            &[(&[], age)],
        );
        let labels: Vec<[(&str, &str); 2]> = OPS
            .iter()
            .flat_map(|(_, op)| {
                RESULTS
                    .iter()
                    .map(move |(_, r)| [("op", *op), ("result", *r)])
            })
            .collect();
        let samples: Vec<(&[(&str, &str)], f64)> = labels
            .iter()
            .enumerate()
            .map(|(i, l)| (&l[..], self.control[i / 3][i % 3].get() as f64))
            .collect();
        family(
            out,
            CONTROL_MESSAGES,
            Kind::Counter,
            "Control messages (outbox-relay.control) read, by operation and result.",
            &samples,
        );
    }
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}
