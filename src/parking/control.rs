//! Control messages, pure: a transactional logical message under the relay's control prefix
//! (`outbox-relay.control`, or `outbox-relay.control.<name>` for a relay with a `name`: [`prefix`])
//! asks the relay to release a parked key. sql/09's functions emit them; the relay carries them
//! out when it reaches them in commit order, so a release is ordered with the writes around it and
//! survives any crash (it stays in the WAL until the slot is confirmed past it).
//!
//! The content is a JSON object: `{"op": "requeue" | "discard", "aggregate_type": …,
//! "aggregate_id": …, "request": "<id>"}` or `{"op": "requeue_event", "event_id": …, "request":
//! …}` ([`parse`]). Content that is none of these is no control message: the relay warns with its
//! LSN, counts it and goes on (it is not an event, so never a dead letter, and never a stop).

use serde::Deserialize;

use crate::metrics::ControlOp;

/// The control prefix every relay reads: with a `name`, `<CONTROL_PREFIX>.<name>`.
pub const CONTROL_PREFIX: &str = "outbox-relay.control";

/// The largest control message content read, in bytes. It bounds the JSON parse, not memory (the
/// decoder holds the message whole already), and must take any key an operator may need to
/// release: an outbox column holds any text, and a key parks whatever its length, so 16 KiB left a
/// key with a longer id parked for good (sql/09's functions refuse a longer request, with this
/// number, rather than write one the relay ignores).
pub const MAX_CONTROL_BYTES: usize = 1024 * 1024;

/// The longest request id taken: it names the release marker (`released:<request>`).
pub const MAX_REQUEST_BYTES: usize = 128;

/// Whether a relay with these settings asks pgoutput for logical messages (`messages 'true'`,
/// Postgres 14+), and so sees control messages at all: with `outbox.message_prefix` or
/// `outbox.context_prefix` set, or in park mode. Without, a `requeue_event` would pass it unseen.
pub fn messages_read(settings: &crate::config::Settings) -> bool {
    let o = &settings.config().outbox;
    !o.message_prefix.is_empty() || !o.context_prefix.is_empty() || settings.park_on_invalid
}

/// The control prefix of a relay named `name` ("" for none).
pub fn prefix(name: &str) -> String {
    match name {
        "" => CONTROL_PREFIX.to_owned(),
        n => format!("{CONTROL_PREFIX}.{n}"),
    }
}

/// What a control message asks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Control {
    /// Republish the key's parked run to its subjects (validated again), and release the key.
    Requeue(KeyRequest),
    /// Release the key without republishing its run.
    Discard(KeyRequest),
    /// Republish one dead letter.
    RequeueEvent {
        /// The event's id.
        event_id: String,
        /// The request id.
        request: String,
    },
}

/// A key and the request naming it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyRequest {
    /// `aggregate_type` (`None`: NULL).
    pub aggregate_type: Option<String>,
    /// `aggregate_id` (`None`: NULL).
    pub aggregate_id: Option<String>,
    /// The request id.
    pub request: String,
}

impl Control {
    /// The operation, as the metrics label it.
    pub fn op(&self) -> ControlOp {
        match self {
            Control::Requeue(_) => ControlOp::Requeue,
            Control::Discard(_) => ControlOp::Discard,
            Control::RequeueEvent { .. } => ControlOp::RequeueEvent,
        }
    }

    /// The request id.
    pub fn request(&self) -> &str {
        match self {
            Control::Requeue(k) | Control::Discard(k) => &k.request,
            Control::RequeueEvent { request, .. } => request,
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Raw {
    op: String,
    #[serde(default)]
    aggregate_type: Option<String>,
    #[serde(default)]
    aggregate_id: Option<String>,
    #[serde(default)]
    event_id: Option<String>,
    request: String,
}

/// The control message `content` is, or why it is none (one line).
pub fn parse(content: &[u8]) -> Result<Control, String> {
    if content.len() > MAX_CONTROL_BYTES {
        return Err(format!(
            "{} bytes, over the {MAX_CONTROL_BYTES} a control message may hold",
            content.len()
        ));
    }
    let raw: Raw = serde_json::from_slice(content).map_err(|e| {
        format!(
            "not a control object: {}",
            crate::text::one_line(&e.to_string())
        )
    })?;
    let request = raw.request;
    if request.is_empty()
        || request.len() > MAX_REQUEST_BYTES
        || request.chars().any(|c| c.is_whitespace() || c.is_control())
    {
        return Err(format!(
            "request must be 1 to {MAX_REQUEST_BYTES} bytes without spaces or control characters"
        ));
    }
    let key = || KeyRequest {
        aggregate_type: raw.aggregate_type.clone(),
        aggregate_id: raw.aggregate_id.clone(),
        request: request.clone(),
    };
    match raw.op.as_str() {
        "requeue" => Ok(Control::Requeue(key())),
        "discard" => Ok(Control::Discard(key())),
        "requeue_event" => match raw.event_id {
            Some(event_id) if crate::event::usable_id(&event_id) => Ok(Control::RequeueEvent {
                event_id,
                request: request.clone(),
            }),
            _ => Err("requeue_event needs an event_id".to_owned()),
        },
        other => Err(format!(
            "unknown op {:?} (requeue, discard or requeue_event)",
            crate::text::cut(other, 64)
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_prefix_carries_the_relays_name() {
        assert_eq!(prefix(""), "outbox-relay.control");
        assert_eq!(prefix("billing"), "outbox-relay.control.billing");
    }

    #[test]
    fn requeue_discard_and_requeue_event_parse_with_null_apart_from_empty() {
        let c = parse(
            br#"{"op":"requeue","aggregate_type":"Claim","aggregate_id":"4711","request":"r-1"}"#,
        )
        .unwrap();
        assert_eq!(
            c,
            Control::Requeue(KeyRequest {
                aggregate_type: Some("Claim".into()),
                aggregate_id: Some("4711".into()),
                request: "r-1".into()
            })
        );
        let c = parse(
            br#"{"op":"discard","aggregate_type":"Claim","aggregate_id":null,"request":"r-2"}"#,
        )
        .unwrap();
        assert!(matches!(
            c,
            Control::Discard(KeyRequest {
                aggregate_id: None,
                ..
            })
        ));
        let c = parse(br#"{"op":"requeue_event","event_id":"e-1","request":"r-3"}"#).unwrap();
        assert_eq!(c.op(), ControlOp::RequeueEvent);
        assert_eq!(c.request(), "r-3");
    }

    #[test]
    fn anything_else_is_no_control_message_with_a_one_line_reason() {
        for bad in [
            &b"not json"[..],
            br#"{"op":"explode","request":"r"}"#,
            br#"{"op":"requeue","aggregate_type":"C"}"#,
            br#"{"op":"requeue","request":"has space"}"#,
            br#"{"op":"requeue","request":""}"#,
            br#"{"op":"requeue_event","request":"r"}"#,
            br#"{"op":"requeue","request":"r","extra":1}"#,
        ] {
            let e = parse(bad).unwrap_err();
            assert!(!e.contains('\n'), "{e}");
        }
        let big = vec![b' '; MAX_CONTROL_BYTES + 1];
        assert!(parse(&big).unwrap_err().contains("over the"));
    }
}
