//! Where the relay's history in a stream begins, when a backfill began it: the stream metadata key
//! `outbox-relay.start`, written by a backfill that finds the stream holding no message, and read
//! by `verify`.
//!
//! Why: adopting the relay on an outbox a polling publisher drained (docs/migrating.md) backfills
//! only the rows the poller had not sent (`--where "published_at IS NULL"`). The rows it had sent
//! stay in the table and are in no message of this stream; without a record of where the relay
//! took over, `verify` reports each of them as missing, every day, until retention removes them.
//! With it, `verify` starts at the backfill: a row created before the backfill began, whose event
//! the stream does not hold, was left out by that backfill's `--where` and is not the relay's
//! (`before_backfill`, counted and not a difference); the report says what was left out.
//!
//! Why stream metadata and not a table: the start belongs to the stream (a new or recreated stream
//! begins a new history, and its metadata goes with it), the backfill already updates the stream's
//! metadata for its marker (no new privilege, and nothing written in the application's database,
//! where the relay's role writes nothing), and `verify` reads the stream's information anyway. Only
//! a backfill into a stream with no message writes it, and only once: a backfill that recovers a
//! lost slot on a stream with history is no start, and the rows before it are the relay's.
//!
//! The `--where` is kept as text for the report only: `verify` never runs SQL it reads from the
//! stream (anyone allowed to update the stream could write it).

use std::collections::HashMap;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::backfill_marker::{Marker, api_error};
use crate::nats::JetStreamPort;

/// The stream metadata key.
pub(crate) const META_START: &str = "outbox-relay.start";

/// A backfill that began the relay's history in a stream.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Start {
    /// The slot it created.
    pub slot: String,
    /// When it began (RFC 3339, UTC; the backfill host's clock).
    pub started: String,
    /// The same, in µs since the Unix epoch.
    pub started_unix_us: i64,
    /// The stream's first sequence of this history (its last sequence + 1 when the backfill began).
    pub sequence: u64,
    /// The backfill's `--where`; `None` when it published every row (then it left nothing out).
    #[serde(rename = "where", default, skip_serializing_if = "Option::is_none")]
    pub where_sql: Option<String>,
}

/// µs between 1970-01-01 and 2000-01-01 (the Postgres epoch the backfill's clock counts from).
const PG_EPOCH_UNIX_US: i64 = 946_684_800_000_000;

impl Start {
    /// The start a backfill with `marker` records on a stream whose last sequence is `last_sequence`,
    /// at `now` (µs since 2000-01-01).
    fn new(marker: &Marker, last_sequence: u64, now: i64) -> Start {
        Start {
            slot: marker.slot.clone(),
            started: marker.started.clone(),
            started_unix_us: now + PG_EPOCH_UNIX_US,
            sequence: last_sequence + 1,
            where_sql: marker.where_sql.clone(),
        }
    }

    /// The start in a stream's metadata, if one is there and readable (an unreadable value is no
    /// start: `verify` then checks every row, which errs towards reporting, never hiding).
    pub fn in_metadata(metadata: &HashMap<String, String>) -> Option<Start> {
        serde_json::from_str(metadata.get(META_START)?).ok()
    }

    /// Whether the backfill left rows out (it had a `--where`).
    pub fn selective(&self) -> bool {
        self.where_sql.is_some()
    }
}

/// Records where the backfill with `marker` begins the stream's history, when the stream holds no
/// message and no start yet; returns what it recorded. `now`: µs since 2000-01-01. A stream whose
/// state the server does not report is left as it is.
pub(crate) async fn record(
    js: &dyn JetStreamPort,
    stream: &str,
    marker: &Marker,
    now: i64,
) -> Result<Option<Start>, String> {
    let info = js
        .api_request(format!("STREAM.INFO.{stream}"), Value::Object(Map::new()))
        .await
        .map_err(|e| crate::error_chain::error_chain(&e))?;
    if let Some(e) = api_error(&info) {
        return Err(e);
    }
    let state = info.get("state");
    let messages = state
        .and_then(|s| s.get("messages"))
        .and_then(Value::as_u64);
    let last = state
        .and_then(|s| s.get("last_seq"))
        .and_then(Value::as_u64);
    let (Some(0), Some(last), Some(mut cfg)) = (messages, last, info.get("config").cloned()) else {
        return Ok(None);
    };
    let Some(metadata) = cfg
        .as_object_mut()
        .map(|c| {
            c.entry("metadata")
                .or_insert_with(|| Value::Object(Map::new()))
        })
        .and_then(Value::as_object_mut)
    else {
        return Ok(None);
    };
    if metadata.contains_key(META_START) {
        return Ok(None);
    }
    let start = Start::new(marker, last, now);
    let value = serde_json::to_string(&start).map_err(|e| e.to_string())?;
    metadata.insert(META_START.to_owned(), Value::String(value));
    let answer = js
        .api_request(format!("STREAM.UPDATE.{stream}"), cfg)
        .await
        .map_err(|e| crate::error_chain::error_chain(&e))?;
    match api_error(&answer) {
        Some(e) => Err(e),
        None => Ok(Some(start)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_start_survives_the_metadata_round_trip_and_an_odd_value_is_none() {
        let marker = Marker::new("outbox_relay", Some("published_at IS NULL"), None, 0);
        let start = Start::new(&marker, 41, 1_000_000);
        assert_eq!(start.sequence, 42);
        assert_eq!(start.started_unix_us, PG_EPOCH_UNIX_US + 1_000_000);
        assert!(start.selective());
        let meta = HashMap::from([(
            META_START.to_owned(),
            serde_json::to_string(&start).unwrap(),
        )]);
        assert_eq!(Start::in_metadata(&meta), Some(start));
        let odd = HashMap::from([(META_START.to_owned(), "set by hand".to_owned())]);
        assert_eq!(Start::in_metadata(&odd), None);
        let every_row = Start::new(&Marker::new("s", None, None, 0), 0, 0);
        assert!(!every_row.selective());
    }
}
