//! The backfill marker: the stream metadata key `outbox-relay.backfill`, which says that a backfill of
//! a slot has begun and has not finished. `backfill` sets it before it drops or creates a slot and
//! removes it after the last row is acknowledged; `setup`, `run` (at every session's start) and
//! `status` read it.
//!
//! Why it exists: a backfill creates its slot at a snapshot and then publishes that snapshot's rows.
//! Until the last of them is stored, the slot stands past rows that are not in the stream, and a
//! `run` from it would never publish them. A backfill that is stopped by a signal drops its slot, but
//! one that is killed (kill -9, a crash, a lost host) cannot: the marker outlives it, and while it
//! stands nothing streams the slot. The recovery is the same in every case, another backfill, which
//! replaces the slot and publishes the rows again (JetStream drops those it holds).
//!
//! The value is JSON naming the slot and the backfill that set it (pid, host, start time, its
//! `--where` and `--order-by`), so the refusal can say which backfill it was, and a backfill removes
//! only a marker it set itself.
//!
//! Whoever may update the stream can write the marker, so what it says is data, never an
//! instruction: its fields are printed escaped, each as one bounded line (`text::shown`), and its
//! `--where` is never offered as part of a command to run. The refusal prints the command without
//! it (with the `--config` this process runs with) and shows the recorded predicate beside it, for
//! the operator to check against their own before reusing it.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::config::Settings;
use crate::nats::JetStreamPort;
use crate::text::shown;

/// The stream metadata key.
pub(crate) const META_BACKFILL: &str = "outbox-relay.backfill";

/// A backfill that has begun and not finished, as its marker names it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Marker {
    /// The slot the backfill creates (`postgres.slot`); empty when the value could not be read.
    pub(crate) slot: String,
    /// The backfill's process id.
    pub(crate) pid: u32,
    /// The host it ran on.
    pub(crate) host: String,
    /// When it set the marker (RFC 3339, UTC).
    pub(crate) started: String,
    /// Its `--where`.
    #[serde(rename = "where", default, skip_serializing_if = "Option::is_none")]
    pub(crate) where_sql: Option<String>,
    /// Its `--order-by`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) order_by: Option<String>,
}

impl Marker {
    /// The marker a backfill of `slot` in this process sets at `now` (µs since 2000-01-01).
    pub(crate) fn new(
        slot: &str,
        where_sql: Option<&str>,
        order_by: Option<&str>,
        now: i64,
    ) -> Marker {
        Marker {
            slot: slot.to_owned(),
            pid: std::process::id(),
            host: host_name(),
            started: crate::message::rfc3339_micros(now),
            where_sql: where_sql.map(str::to_owned),
            order_by: order_by.map(str::to_owned),
        }
    }

    /// The marker in a stream's metadata, if one stands. A value that is not the JSON a backfill
    /// writes (edited by hand) still stands, for every slot: what it guards cannot be told.
    pub(crate) fn in_metadata(metadata: &HashMap<String, String>) -> Option<Marker> {
        let value = metadata.get(META_BACKFILL)?;
        Some(serde_json::from_str(value).unwrap_or_else(|_| Marker {
            slot: String::new(),
            pid: 0,
            host: format!("unknown (unreadable value \"{}\")", shown(value, 200)),
            started: "unknown".to_owned(),
            where_sql: None,
            order_by: None,
        }))
    }

    /// Whether it guards `slot`.
    pub(crate) fn guards(&self, slot: &str) -> bool {
        self.slot.is_empty() || self.slot == slot
    }

    /// Who set it: `pid 4711 on host-1 at 2026-…Z`, each field escaped and bounded (the stream's
    /// metadata says so, not this process).
    pub(crate) fn origin(&self) -> String {
        format!(
            "pid {} on {} at {}",
            self.pid,
            shown(&self.host, 255),
            shown(&self.started, 64)
        )
    }

    /// The slot it names, escaped, or `(unknown)`.
    pub(crate) fn slot_shown(&self) -> String {
        if self.slot.is_empty() {
            "(unknown)".to_owned()
        } else {
            shown(&self.slot, 63)
        }
    }

    /// The options the marker records, as data to compare with the operator's own: `; its marker
    /// records --where "…" and --order-by "…"` (escaped, bounded), or nothing.
    pub(crate) fn recorded_options(&self) -> String {
        let mut parts = Vec::new();
        if let Some(w) = &self.where_sql {
            parts.push(format!("--where \"{}\"", shown(w, 200)));
        }
        if let Some(o) = &self.order_by {
            parts.push(format!("--order-by \"{}\"", shown(o, 200)));
        }
        if parts.is_empty() {
            String::new()
        } else {
            format!(
                " with the --where and --order-by you gave that backfill (its marker records {}: read from the \
                 stream, so check it against yours before reusing it)",
                parts.join(" and ")
            )
        }
    }

    /// How to recover once the backfill no longer runs: the backfill command with this process's
    /// `--config`, never with the marker's `--where` (see the module docs).
    pub(crate) fn recovery(&self, settings: &Settings) -> String {
        format!(
            "run {}{} again",
            settings.command("backfill"),
            self.recorded_options()
        )
    }

    /// Why `run` and `setup` refuse while it stands, with the recovery; one line.
    pub(crate) fn refusal(&self, settings: &Settings) -> String {
        format!(
            "has the backfill marker {META_BACKFILL} (set by the backfill of slot {} started by {}): that backfill \
             has not finished, so the slot may stand past rows it never published, and nothing may stream it. If \
             the backfill still runs, let it finish; if it no longer runs (stopped, killed, crashed), {} (it \
             replaces the slot and publishes the rows again; JetStream drops those stream {} holds), \
             or to give those rows up, {}; see docs/recovery.md",
            self.slot_shown(),
            self.origin(),
            self.recovery(settings),
            settings.config().nats.stream,
            settings.command("backfill --where false"),
        )
    }
}

/// Why the marker could not be set or removed.
#[derive(Debug, thiserror::Error)]
pub enum MarkerError {
    /// Reading the stream's configuration failed.
    #[error(
        "cannot read the configuration of JetStream stream {stream} to set or clear the backfill marker \
         {META_BACKFILL}: {reason}"
    )]
    Read {
        /// `nats.stream`.
        stream: String,
        /// What NATS answered.
        reason: String,
    },
    /// Updating the stream's metadata was refused.
    #[error(
        "cannot update JetStream stream {stream} to {what} the backfill marker {META_BACKFILL}: {reason} (the \
         relay's NATS user needs to publish to $JS.API.STREAM.UPDATE.{stream} for backfill; see docs/operations.md, \
         NATS permissions)"
    )]
    Update {
        /// `nats.stream`.
        stream: String,
        /// `set` or `clear`.
        what: &'static str,
        /// What NATS answered.
        reason: String,
    },
}

/// The marker standing on the stream, if any.
pub(crate) async fn read(
    js: &dyn JetStreamPort,
    stream: &str,
) -> Result<Option<Marker>, MarkerError> {
    Ok(Marker::in_metadata(&metadata_of(
        &config(js, stream).await?,
    )))
}

/// Sets `marker` on the stream (replacing one that stands: the backfill setting it takes over).
pub(crate) async fn set(
    js: &dyn JetStreamPort,
    stream: &str,
    marker: &Marker,
) -> Result<(), MarkerError> {
    let mut cfg = config(js, stream).await?;
    let value = serde_json::to_string(marker).unwrap_or_default();
    let metadata = cfg.as_object_mut().map(|c| {
        c.entry("metadata")
            .or_insert_with(|| Value::Object(Map::new()))
    });
    match metadata.and_then(Value::as_object_mut) {
        Some(m) => {
            m.insert(META_BACKFILL.to_owned(), Value::String(value));
        }
        None => {
            return Err(MarkerError::Read {
                stream: stream.to_owned(),
                reason: "its configuration is not a JSON object with an object `metadata`"
                    .to_owned(),
            });
        }
    }
    update(js, stream, &cfg, "set").await
}

/// Removes the marker if it is still `marker` (another backfill may have taken over since).
/// Returns whether it was removed.
pub(crate) async fn clear(
    js: &dyn JetStreamPort,
    stream: &str,
    marker: &Marker,
) -> Result<bool, MarkerError> {
    let mut cfg = config(js, stream).await?;
    if Marker::in_metadata(&metadata_of(&cfg)).as_ref() != Some(marker) {
        return Ok(false);
    }
    if let Some(m) = cfg.get_mut("metadata").and_then(Value::as_object_mut) {
        m.remove(META_BACKFILL);
    }
    update(js, stream, &cfg, "clear").await?;
    Ok(true)
}

/// For `setup`, `run` and `status`: the refusal when a marker guarding this slot stands in
/// `metadata`.
pub(crate) fn refusal(settings: &Settings, metadata: &HashMap<String, String>) -> Option<String> {
    Marker::in_metadata(metadata)
        .filter(|m| m.guards(&settings.config().postgres.slot))
        .map(|m| m.refusal(settings))
}

/// Every session of `run`, before it takes the slot: a backfill that began after this relay's setup
/// (and was killed, or still runs) leaves its marker on the stream, and its slot may stand past
/// rows it never published. A relay that waited meanwhile (as a standby, or for its servers) must
/// not stream that slot: this is the marker's refusal when one guards the slot (the relay stops
/// with it, as `run` would at its start). A marker that cannot be read (within the ack timeout, as
/// the sink's read of the tail) is no refusal: the session's own look at the stream follows, and
/// fails the same way. Shared by the production connector and the deterministic simulation's
/// (through `crate::relay::refuse_under_backfill`).
pub async fn refusal_for_run(settings: &Settings, js: &dyn JetStreamPort) -> Option<String> {
    let stream = &settings.config().nats.stream;
    let read = tokio::time::timeout(settings.ack_timeout, read(js, stream))
        .await
        .unwrap_or_else(|_| {
            Err(MarkerError::Read {
                stream: stream.clone(),
                reason: "no answer within nats.ack_timeout_ms".to_owned(),
            })
        });
    match read {
        Ok(Some(m)) if m.guards(&settings.config().postgres.slot) => Some(m.refusal(settings)),
        Ok(_) => None,
        Err(e) => {
            tracing::debug!(error = %e, "the backfill marker could not be read");
            None
        }
    }
}

/// The stream's configuration as the server sends it. Kept as JSON, not as the client's typed
/// configuration: an update sends the whole configuration back, and a field this client does not
/// know (a newer server's) must go back as it was, not be reset to its default.
async fn config(js: &dyn JetStreamPort, stream: &str) -> Result<Value, MarkerError> {
    let read = |reason: String| MarkerError::Read {
        stream: stream.to_owned(),
        reason,
    };
    let answer = js
        .api_request(format!("STREAM.INFO.{stream}"), Value::Object(Map::new()))
        .await
        .map_err(|e| read(crate::error_chain::error_chain(&e)))?;
    if let Some(e) = api_error(&answer) {
        return Err(read(e));
    }
    answer
        .get("config")
        .cloned()
        .filter(Value::is_object)
        .ok_or_else(|| read("the answer has no configuration".to_owned()))
}

/// The `metadata` of a stream configuration (string values only).
fn metadata_of(cfg: &Value) -> HashMap<String, String> {
    cfg.get("metadata")
        .and_then(Value::as_object)
        .map(|m| {
            m.iter()
                .filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_owned())))
                .collect()
        })
        .unwrap_or_default()
}

/// `STREAM.UPDATE` with `cfg`.
async fn update(
    js: &dyn JetStreamPort,
    stream: &str,
    cfg: &Value,
    what: &'static str,
) -> Result<(), MarkerError> {
    let refused = |reason: String| MarkerError::Update {
        stream: stream.to_owned(),
        what,
        reason,
    };
    let answer = js
        .api_request(format!("STREAM.UPDATE.{stream}"), cfg.clone())
        .await
        .map_err(|e| refused(crate::error_chain::error_chain(&e)))?;
    match api_error(&answer) {
        Some(e) => Err(refused(e)),
        None => Ok(()),
    }
}

/// A JetStream API error answer as `description (code N)`.
pub(crate) fn api_error(answer: &Value) -> Option<String> {
    let e = answer.get("error")?;
    Some(format!(
        "{} (error code {})",
        e.get("description")
            .and_then(Value::as_str)
            .unwrap_or("refused"),
        e.get("err_code").and_then(Value::as_u64).unwrap_or(0)
    ))
}

/// This host's name, for the marker (`unknown` when the system does not say).
fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok().filter(|h| !h.is_empty()))
        .unwrap_or_else(|| "unknown".to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn marker() -> Marker {
        Marker {
            slot: "outbox_relay".into(),
            pid: 4711,
            host: "relay-1".into(),
            started: "2026-12-03T10:50:00.000000Z".into(),
            where_sql: Some("published_at IS NULL AND kind <> 'x'".into()),
            order_by: Some("created_at, event_id".into()),
        }
    }

    #[test]
    fn a_marker_survives_the_metadata_round_trip() {
        let m = marker();
        let meta = HashMap::from([(META_BACKFILL.to_owned(), serde_json::to_string(&m).unwrap())]);
        assert_eq!(Marker::in_metadata(&meta), Some(m));
        assert_eq!(Marker::in_metadata(&HashMap::new()), None);
    }

    #[test]
    fn the_recovery_offers_no_sql_from_the_marker_and_carries_the_config() {
        let mut settings = crate::config::Config::default().validate().unwrap();
        settings.origin.file = Some("/etc/relay.toml".into());
        let text = marker().recovery(&settings);
        assert!(
            text.starts_with(
                "run `outbox-relay --config /etc/relay.toml backfill` with the --where"
            ),
            "{text}"
        );
        assert!(
            text.contains(
                r#"records --where "published_at IS NULL AND kind <> 'x'" and --order-by"#
            ),
            "{text}"
        );
        let plain = Marker {
            where_sql: None,
            order_by: None,
            ..marker()
        };
        assert_eq!(
            plain.recovery(&settings),
            "run `outbox-relay --config /etc/relay.toml backfill` again"
        );
    }

    #[test]
    fn a_planted_marker_is_shown_escaped_on_one_line() {
        let settings = crate::config::Config::default().validate().unwrap();
        let planted = Marker {
            host: "h\u{1b}[2K\nrelay: streaming".into(),
            where_sql: Some("true) OR (1=1".into()),
            ..marker()
        };
        let text = planted.refusal(&settings);
        assert!(!text.contains('\n') && !text.contains('\u{1b}'), "{text}");
        assert!(text.contains(r"h\u{1b}[2K\u{a}relay: streaming"), "{text}");
        assert!(
            !text.contains("backfill --where 'true) OR (1=1"),
            "no SQL from the marker in a command: {text}"
        );
    }

    #[test]
    fn it_guards_its_own_slot_and_an_unreadable_one_guards_every_slot() {
        let m = marker();
        assert!(m.guards("outbox_relay"));
        assert!(!m.guards("billing"));
        let meta = HashMap::from([(META_BACKFILL.to_owned(), "set by hand".to_owned())]);
        let odd = Marker::in_metadata(&meta).expect("an unreadable marker still stands");
        assert!(odd.guards("billing"), "{odd:?}");
        let settings = crate::config::Config::default().validate().unwrap();
        assert!(
            odd.refusal(&settings).contains("unknown"),
            "{}",
            odd.refusal(&settings)
        );
    }

    #[test]
    fn metadata_is_read_from_the_configuration_as_the_server_sends_it() {
        let cfg = serde_json::json!({
            "name": "OUTBOX",
            "future_field": {"kept": true},
            "metadata": {"outbox-relay.slot": "outbox_relay", "odd": 7}
        });
        let m = metadata_of(&cfg);
        assert_eq!(
            m.get("outbox-relay.slot").map(String::as_str),
            Some("outbox_relay")
        );
        assert!(!m.contains_key("odd"), "only string values: {m:?}");
        assert!(metadata_of(&serde_json::json!({"name": "OUTBOX"})).is_empty());
        let refused = serde_json::json!({"error": {"code": 500, "err_code": 10052, "description": "stream configuration update can not change X"}});
        assert_eq!(
            api_error(&refused).as_deref(),
            Some("stream configuration update can not change X (error code 10052)")
        );
        assert_eq!(api_error(&cfg), None);
    }

    #[test]
    fn the_refusal_names_the_marker_the_backfill_and_the_recovery() {
        let settings = crate::config::Config::default().validate().unwrap();
        let text = marker().refusal(&settings);
        assert!(text.contains(META_BACKFILL), "{text}");
        assert!(text.contains("pid 4711 on relay-1"), "{text}");
        assert!(
            text.contains("run `outbox-relay backfill` with the --where"),
            "{text}"
        );
        assert!(!text.contains('\n'), "one line: {text}");
    }
}
