//! The `outbox_relay_schema_*` series: events whose payload failed its JSON Schema, by event type,
//! and reloads of the schema directory. Kept with the other series so that `metrics` needs no
//! module above it; the schema checks (`crate::schema`) count into it.

use std::collections::BTreeMap;
use std::sync::Mutex;

use super::encode::{Kind, header, sample};
use super::value::{Counter, Gauge};

/// The most event types the failure counter keeps apart; the rest are counted as `(other)`, so a
/// writer that invents event types cannot grow `/metrics` without bound.
const MAX_LABELS: usize = 1000;

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
        let mut map = self.failures.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = map.get_mut(event_type) {
            *n += 1;
        } else if map.len() < MAX_LABELS {
            map.insert(event_type.to_owned(), 1);
        } else {
            *map.entry("(other)".to_owned()).or_default() += 1;
        }
    }

    /// Failed checks of `event_type` so far.
    pub fn failures(&self, event_type: &str) -> u64 {
        let map = self.failures.lock().unwrap_or_else(|p| p.into_inner());
        map.get(event_type).copied().unwrap_or(0)
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
