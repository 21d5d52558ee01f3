//! What a NATS message for an outbox event looks like (DESIGN.md §4): subject, headers, payload, and
//! the dead-letter form of an event that cannot be published as it is.
//!
//! Headers: `Nats-Msg-Id` (the event id: JetStream drops a republished event inside the stream's
//! duplicate window), `Outbox-Event-Type`, `Outbox-Aggregate-Type`, `Outbox-Aggregate-Id`,
//! `Outbox-Commit-Lsn`, plus the event's own headers. A dead letter carries the same headers plus
//! `Outbox-Error` (one line) and `Outbox-Subject` (the subject it would have had), and its payload as
//! stored unless that is what made it too big (then it is empty and `Outbox-Payload-Size` says how big).

use std::sync::LazyLock;

use async_nats::HeaderMap;
use async_nats::header::{HeaderName, HeaderValue, IntoHeaderName};
use bytes::Bytes;

use crate::outbox::OutboxEvent;
use crate::route::SubjectTemplate;

pub const NATS_MSG_ID: &str = "Nats-Msg-Id";
pub const EVENT_TYPE: &str = "Outbox-Event-Type";
pub const AGGREGATE_TYPE: &str = "Outbox-Aggregate-Type";
pub const AGGREGATE_ID: &str = "Outbox-Aggregate-Id";
pub const COMMIT_LSN: &str = "Outbox-Commit-Lsn";
pub const ERROR: &str = "Outbox-Error";
pub const SUBJECT: &str = "Outbox-Subject";
pub const PAYLOAD_SIZE: &str = "Outbox-Payload-Size";
/// On a shrunk dead letter: the headers whose values were cut to fit.
pub const TRUNCATED_HEADERS: &str = "Outbox-Truncated-Headers";
/// Set by the sink when the stream is fenced (see `fence`).
pub const EXPECTED_LAST_SEQUENCE: &str = "Nats-Expected-Last-Sequence";
/// The event id on messages of an atomic batch, which cannot carry `Nats-Msg-Id` (the server refuses
/// a batch message with one, or rejects the whole batch for one duplicate): consumers deduplicate
/// with it, and the fence finds the stream's last event by it.
pub const EVENT_ID: &str = "Outbox-Event-Id";

/// Which header carries the event id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IdHeader {
    /// `Nats-Msg-Id`: JetStream deduplicates by it (single publishes).
    MsgId,
    /// `Outbox-Event-Id`: atomic batches.
    EventId,
}

/// A message ready for JetStream.
#[derive(Debug, Clone)]
pub struct Outgoing {
    pub subject: String,
    pub headers: HeaderMap,
    pub payload: Bytes,
    /// Set for dead letters: the reason, for logs and metrics.
    pub dead_letter: Option<String>,
}

/// Builds the message for `event`: routed by `template`, or a dead letter when the event has a problem
/// or cannot be routed.
pub fn build(
    event: &OutboxEvent,
    template: &SubjectTemplate,
    dead_letter_subject: &str,
) -> Outgoing {
    build_as(event, template, dead_letter_subject, IdHeader::MsgId)
}

/// [`build`], with the event id in the header `id` says.
pub fn build_as(
    event: &OutboxEvent,
    template: &SubjectTemplate,
    dead_letter_subject: &str,
    id: IdHeader,
) -> Outgoing {
    let routed = template.render(
        event.aggregate_type.as_deref().unwrap_or(""),
        event.event_type.as_deref().unwrap_or(""),
        event.aggregate_id.as_deref().unwrap_or(""),
    );
    match (&event.problem, routed) {
        (None, Ok(subject)) => Outgoing {
            subject,
            headers: headers(event, id),
            payload: event.payload.clone(),
            dead_letter: None,
        },
        (Some(problem), routed) => dead_letter_as(
            event,
            dead_letter_subject,
            problem,
            routed.ok().as_deref(),
            Shrink::Keep,
            id,
        ),
        (None, Err(e)) => dead_letter_as(
            event,
            dead_letter_subject,
            &e.to_string(),
            None,
            Shrink::Keep,
            id,
        ),
    }
}

/// How much of an event a dead letter keeps. A dead letter that does not fit the server's limits is
/// shrunk step by step, so one oversized row can never stop the relay (P7, P11).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shrink {
    /// Payload and every header as they are.
    Keep,
    /// No payload (`Outbox-Payload-Size` says how big it was); header values over
    /// [`MAX_DEAD_LETTER_HEADER`] bytes truncated and named in `Outbox-Truncated-Headers`.
    DropPayload,
    /// Only the id, the reason, the commit LSN and the payload size.
    Minimal,
}

/// The longest header value a shrunk dead letter keeps.
pub const MAX_DEAD_LETTER_HEADER: usize = 1024;

/// The dead-letter form of `event`, shrunk as `shrink` says.
pub fn dead_letter(
    event: &OutboxEvent,
    dead_letter_subject: &str,
    reason: &str,
    subject: Option<&str>,
    shrink: Shrink,
) -> Outgoing {
    dead_letter_as(
        event,
        dead_letter_subject,
        reason,
        subject,
        shrink,
        IdHeader::MsgId,
    )
}

/// [`dead_letter`], with the event id in the header `id` says.
pub fn dead_letter_as(
    event: &OutboxEvent,
    dead_letter_subject: &str,
    reason: &str,
    subject: Option<&str>,
    shrink: Shrink,
    id: IdHeader,
) -> Outgoing {
    let mut h = match shrink {
        Shrink::Keep => headers(event, id),
        Shrink::DropPayload => truncated(headers(event, id)),
        Shrink::Minimal => {
            let n = names();
            let mut h = HeaderMap::new();
            h.insert(n.id(id).clone(), HeaderValue::from(event.msg_id.clone()));
            h.insert(
                n.commit_lsn.clone(),
                HeaderValue::from(event.commit_lsn.to_string()),
            );
            h
        }
    };
    h.insert(ERROR, cap(&one_line(reason)).as_str());
    if let Some(s) = subject.filter(|_| shrink != Shrink::Minimal) {
        h.insert(SUBJECT, cap(s).as_str());
    }
    let payload = if shrink == Shrink::Keep {
        event.payload.clone()
    } else {
        h.insert(PAYLOAD_SIZE, event.payload.len().to_string().as_str());
        Bytes::new()
    };
    Outgoing {
        subject: dead_letter_subject.to_owned(),
        headers: h,
        payload,
        dead_letter: Some(reason.to_owned()),
    }
}

/// Truncates header values over [`MAX_DEAD_LETTER_HEADER`] bytes and names them in a header.
fn truncated(h: HeaderMap) -> HeaderMap {
    let mut out = HeaderMap::new();
    let mut cut = Vec::new();
    for (name, values) in h.iter() {
        for v in values {
            let s = v.as_str();
            if s.len() > MAX_DEAD_LETTER_HEADER {
                cut.push(name.to_string());
            }
            out.append(name.clone(), cap(s).as_str());
        }
    }
    if !cut.is_empty() {
        out.insert(TRUNCATED_HEADERS, cap(&cut.join(",")).as_str());
    }
    out
}

/// `s` cut to at most [`MAX_DEAD_LETTER_HEADER`] bytes, on a character boundary.
fn cap(s: &str) -> String {
    if s.len() <= MAX_DEAD_LETTER_HEADER {
        return s.to_owned();
    }
    let mut end = MAX_DEAD_LETTER_HEADER;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_owned()
}

/// The message id: the event id, or, when the row had none, one derived from its position in the WAL
/// so that a republished dead letter is still deduplicated. Computed once per event, by the outbox
/// stage, and carried in [`OutboxEvent::msg_id`].
pub fn message_id(id: Option<&str>, commit_lsn: crate::Lsn, index: u32) -> String {
    match id {
        // A line break cannot go into a header (the outbox stage reports it as a problem).
        Some(id) if !id.is_empty() && !id.contains(['\r', '\n']) => id.to_owned(),
        _ => format!("lsn:{commit_lsn}:{index}"),
    }
}

/// The relay's header names, built once: a name made from a `&str` is validated and copied on
/// every insert, and these five are on every message.
struct Names {
    msg_id: HeaderName,
    event_id: HeaderName,
    event_type: HeaderName,
    aggregate_type: HeaderName,
    aggregate_id: HeaderName,
    commit_lsn: HeaderName,
}

impl Names {
    fn id(&self, id: IdHeader) -> &HeaderName {
        match id {
            IdHeader::MsgId => &self.msg_id,
            IdHeader::EventId => &self.event_id,
        }
    }
}

fn names() -> &'static Names {
    static NAMES: LazyLock<Names> = LazyLock::new(|| Names {
        msg_id: NATS_MSG_ID.into_header_name(),
        event_id: EVENT_ID.into_header_name(),
        event_type: EVENT_TYPE.into_header_name(),
        aggregate_type: AGGREGATE_TYPE.into_header_name(),
        aggregate_id: AGGREGATE_ID.into_header_name(),
        commit_lsn: COMMIT_LSN.into_header_name(),
    });
    &NAMES
}

fn headers(event: &OutboxEvent, id: IdHeader) -> HeaderMap {
    let n = names();
    let mut h = HeaderMap::new();
    // Values go in as owned Strings: HeaderValue keeps them without another copy.
    h.insert(n.id(id).clone(), HeaderValue::from(event.msg_id.clone()));
    if let Some(v) = &event.event_type {
        h.insert(n.event_type.clone(), HeaderValue::from(header_value(v)));
    }
    if let Some(v) = &event.aggregate_type {
        h.insert(n.aggregate_type.clone(), HeaderValue::from(header_value(v)));
    }
    if let Some(v) = &event.aggregate_id {
        h.insert(n.aggregate_id.clone(), HeaderValue::from(header_value(v)));
    }
    h.insert(
        n.commit_lsn.clone(),
        HeaderValue::from(event.commit_lsn.to_string()),
    );
    for (k, v) in &event.headers {
        h.insert(k.as_str(), v.as_str());
    }
    h
}

/// Header values cannot hold line breaks (they would end the header block).
fn header_value(v: &str) -> String {
    if v.contains(['\r', '\n']) {
        one_line(v)
    } else {
        v.to_owned()
    }
}

fn one_line(s: &str) -> String {
    s.split(['\r', '\n'])
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Lsn;

    fn event() -> OutboxEvent {
        OutboxEvent {
            id: Some("e-5531".into()),
            aggregate_type: Some("Claim".into()),
            aggregate_id: Some("4711".into()),
            event_type: Some("ClaimApproved".into()),
            payload: Bytes::from_static(b"{\"claim_id\":4711}"),
            headers: vec![("traceparent".into(), "00-1-2-01".into())],
            commit_lsn: Lsn(0x1_0000_00A0),
            index: 0,
            commit_ts: 0,
            problem: None,
            msg_id: "e-5531".into(),
        }
    }

    fn template() -> SubjectTemplate {
        SubjectTemplate::parse("outbox.{aggregate_type}").unwrap()
    }

    #[test]
    fn builds_contract_headers() {
        let m = build(&event(), &template(), "dlq");
        assert_eq!(m.subject, "outbox.Claim");
        assert_eq!(m.dead_letter, None);
        let h = &m.headers;
        assert_eq!(h.get(NATS_MSG_ID).unwrap().as_str(), "e-5531");
        assert_eq!(h.get(EVENT_TYPE).unwrap().as_str(), "ClaimApproved");
        assert_eq!(h.get(AGGREGATE_TYPE).unwrap().as_str(), "Claim");
        assert_eq!(h.get(AGGREGATE_ID).unwrap().as_str(), "4711");
        assert_eq!(h.get(COMMIT_LSN).unwrap().as_str(), "1/A0");
        assert_eq!(h.get("traceparent").unwrap().as_str(), "00-1-2-01");
        assert_eq!(&m.payload[..], b"{\"claim_id\":4711}");
    }

    #[test]
    fn unroutable_event_becomes_dead_letter_with_reason() {
        let mut e = event();
        e.aggregate_type = Some("Cl aim".into());
        let m = build(&e, &template(), "outbox_dead_letter");
        assert_eq!(m.subject, "outbox_dead_letter");
        let err = m.headers.get(ERROR).unwrap().as_str();
        assert!(
            err.contains("aggregate_type") && err.contains("whitespace"),
            "{err}"
        );
        assert!(m.headers.get(SUBJECT).is_none());
        assert_eq!(m.headers.get(NATS_MSG_ID).unwrap().as_str(), "e-5531");
        assert_eq!(&m.payload[..], &e.payload[..], "payload kept");
    }

    #[test]
    fn problem_event_keeps_the_subject_it_would_have_had() {
        let mut e = event();
        e.problem = Some("column x missing\nreally".into());
        let m = build(&e, &template(), "dlq");
        assert_eq!(m.subject, "dlq");
        assert_eq!(m.headers.get(SUBJECT).unwrap().as_str(), "outbox.Claim");
        assert_eq!(
            m.headers.get(ERROR).unwrap().as_str(),
            "column x missing really"
        );
    }

    #[test]
    fn oversize_dead_letter_drops_payload_and_says_its_size() {
        let e = event();
        let m = dead_letter(
            &e,
            "dlq",
            "too big",
            Some("outbox.Claim"),
            Shrink::DropPayload,
        );
        assert!(m.payload.is_empty());
        assert_eq!(
            m.headers.get(PAYLOAD_SIZE).unwrap().as_str(),
            e.payload.len().to_string()
        );
    }

    #[test]
    fn id_with_a_line_break_never_reaches_a_header() {
        let mut e = event();
        e.id = Some("e-1\r\nX-Evil: 1".into());
        e.index = 2;
        e.problem = Some("id has a line break".into());
        e.msg_id = message_id(e.id.as_deref(), e.commit_lsn, e.index);
        let m = build(&e, &template(), "dlq");
        assert_eq!(m.headers.get(NATS_MSG_ID).unwrap().as_str(), "lsn:1/A0:2");
    }

    #[test]
    fn missing_id_gets_a_stable_wal_derived_id() {
        let mut e = event();
        e.id = None;
        e.index = 3;
        assert_eq!(
            message_id(e.id.as_deref(), e.commit_lsn, e.index),
            "lsn:1/A0:3"
        );
    }
}
