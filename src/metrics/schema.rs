//! The `outbox_relay_schema_*` series: events whose payload failed its JSON Schema, by event type,
//! and reloads of the schema directory. Kept with the other series so that `metrics` needs no
//! module above it; the schema checks (`crate::schema`) count into it.
//!
//! The event type is a writer's input, kept until the relay exits: it is the one label value of
//! `/metrics` that comes from input, so it is bounded in bytes as well as in number ([`label`]):
//! 1,000 values of at most 128 bytes (round 5, finding 4: 120 event types of 256 KB had grown
//! `/metrics` to 31 MB).

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::sync::Mutex;

use super::encode::{Kind, header, sample};
use super::value::{Counter, Gauge};

/// The most event types the failure counter keeps apart; the rest are counted as `(other)`, so a
/// writer that invents event types cannot grow `/metrics` without bound.
const MAX_LABELS: usize = 1000;

/// The longest label value kept: a longer event type is cut and given a hash suffix ([`label`]).
/// Event types are names (`ClaimApproved`); 128 bytes keeps every real one whole.
pub(crate) const MAX_LABEL_BYTES: usize = 128;

/// `value` as a label value of at most [`MAX_LABEL_BYTES`]: as it is when it fits, else its start
/// (cut on a character boundary), `~` and the 16 hex digits of its FNV-1a hash, so two long values
/// that start alike stay apart and the same value always gets the same label.
pub(crate) fn label(value: &str) -> Cow<'_, str> {
    if value.len() <= MAX_LABEL_BYTES {
        return Cow::Borrowed(value);
    }
    let hash = crate::fnv::fnv1a_64(value.as_bytes());
    let start = crate::text::cut(value, MAX_LABEL_BYTES - 17);
    Cow::Owned(format!("{start}~{hash:016x}"))
}

/// `outbox_relay_schema_*` metrics.
#[derive(Debug, Default)]
pub struct SchemaMetrics {
    /// Failed checks by event type.
    failures: Mutex<BTreeMap<String, u64>>,
    /// Reloads that put a new set in force.
    pub(crate) reloads: Counter,
    /// Reloads that failed (the previous set stayed).
    pub(crate) reload_failures: Counter,
    /// Schemas in force.
    pub(crate) loaded: Gauge,
}

/// Counter: events whose payload failed their schema, by event type.
pub(crate) const SCHEMA_FAILURES: &str = "outbox_relay_schema_failures_total";
/// Counter: schema directory reloads, by result (`ok`, `failed`).
pub(crate) const SCHEMA_RELOADS: &str = "outbox_relay_schema_reloads_total";
/// Gauge: schemas in force.
pub(crate) const SCHEMAS_LOADED: &str = "outbox_relay_schemas_loaded";

impl SchemaMetrics {
    /// Counts a failed check of an event of `event_type`.
    pub(crate) fn failed(&self, event_type: &str) {
        let event_type = label(event_type);
        let mut map = self.failures.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = map.get_mut(event_type.as_ref()) {
            *n += 1;
        } else if map.len() < MAX_LABELS {
            map.insert(event_type.into_owned(), 1);
        } else {
            *map.entry("(other)".to_owned()).or_default() += 1;
        }
    }

    /// Failed checks of `event_type` so far.
    pub fn failures(&self, event_type: &str) -> u64 {
        let map = self.failures.lock().unwrap_or_else(|p| p.into_inner());
        map.get(label(event_type).as_ref()).copied().unwrap_or(0)
    }

    /// Appends the Prometheus text of these series to `out`.
    pub(crate) fn render(&self, out: &mut String) {
        header(
            out,
            SCHEMA_FAILURES,
            Kind::Counter,
            "Events whose payload failed its JSON Schema (dead letters), by event type.",
        );
        for (t, n) in self
            .failures
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
        {
            sample(&mut *out, SCHEMA_FAILURES, &[("event_type", t)], n);
        }
        header(
            out,
            SCHEMA_RELOADS,
            Kind::Counter,
            "Reloads of the schema directory (SIGHUP), by result.",
        );
        let reloads = [("ok", &self.reloads), ("failed", &self.reload_failures)];
        for (result, n) in reloads {
            sample(&mut *out, SCHEMA_RELOADS, &[("result", result)], n.get());
        }
        header(out, SCHEMAS_LOADED, Kind::Gauge, "JSON Schemas in force.");
        sample(out, SCHEMAS_LOADED, &[], self.loaded.get());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_event_types_are_cut_with_a_hash_and_kept_apart() {
        assert_eq!(label("ClaimApproved"), "ClaimApproved");
        let at_bound = "a".repeat(MAX_LABEL_BYTES);
        assert_eq!(label(&at_bound), at_bound.as_str());
        let (a, b) = ("x".repeat(256 << 10) + "A", "x".repeat(256 << 10) + "B");
        let (la, lb) = (label(&a), label(&b));
        assert!(
            la.len() <= MAX_LABEL_BYTES && lb.len() <= MAX_LABEL_BYTES,
            "{la}"
        );
        assert_ne!(la, lb, "values that start alike stay apart");
        assert_eq!(label(&a), la, "the same value, the same label");
        // A cut never splits a character.
        assert!(label(&"ü".repeat(200)).len() <= MAX_LABEL_BYTES);

        let m = SchemaMetrics::default();
        for i in 0..120 {
            m.failed(&format!("{}{i}", "T".repeat(256 << 10)));
        }
        m.failed(&a);
        assert_eq!(m.failures(&a), 1);
        let mut out = String::new();
        m.render(&mut out);
        assert!(
            out.len() < 121 * (MAX_LABEL_BYTES + 64) + 1024,
            "/metrics stays small: {} bytes",
            out.len()
        );
    }
}
