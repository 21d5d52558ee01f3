//! The messages on a key's parking subject (`<dead_letter_subject>.parked.<hash>`): a parked
//! copy of an event ([`parked_copy`]), in the dead-letter form (descriptive headers, the payload
//! as stored, shrunk by the same ladder when it does not fit) with an id of its own
//! (`Nats-Msg-Id: parked:<id>`, or `parked:<id>:<request>` when a requeue parks it again), the
//! event's id in `Outbox-Event-Id`, and the key's run in `Outbox-Parked-Behind` (the poison's id),
//! `Outbox-Parked-Count` (its place in the run) and `Outbox-Parked-Since` (the poison's commit
//! time); and the release marker a control message writes ([`release_marker`]): no payload,
//! `Nats-Msg-Id: released:<request>`, `Outbox-Parking: requeued | discarded`,
//! `Outbox-Control-Id` and the key's values. The run of a key is the parked copies after its last
//! marker, in stream order: the stream is the record of what is parked.

use async_nats::HeaderMap;
use async_nats::header::HeaderValue;
use bytes::Bytes;

use super::{AGGREGATE_ID, AGGREGATE_TYPE, EVENT_ID, NATS_MSG_ID, Outgoing, header_value};
use super::{IdHeader, Shrink, dead_letter_as};
use crate::event::OutboxEvent;

/// On a parked copy: the id of the event its key is parked behind (the poison).
pub const PARKED_BEHIND: &str = "Outbox-Parked-Behind";
/// On a parked copy: its place (1-based) in its key's run.
pub const PARKED_COUNT: &str = "Outbox-Parked-Count";
/// On a parked copy: the poison's commit time, RFC 3339.
pub const PARKED_SINCE: &str = "Outbox-Parked-Since";
/// On a release marker: `requeued` or `discarded`.
pub const PARKING: &str = "Outbox-Parking";
/// On a release marker: the control message's request id.
pub const CONTROL_ID: &str = "Outbox-Control-Id";

/// On a parked copy and a release marker: `never` (per-message TTL, which `setup` allows on the
/// stream in park mode), so that the stream's `max_age` never removes them: they are the only
/// record of a parked event, and of a release (without the marker, a restart would find the key
/// parked again).
pub const NATS_TTL: &str = "Nats-TTL";

/// What a parked copy's `Nats-Msg-Id` starts with.
pub const PARKED_ID_PREFIX: &str = "parked:";
/// What a release marker's `Nats-Msg-Id` starts with.
pub const RELEASED_ID_PREFIX: &str = "released:";

/// How a release marker released its key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Release {
    /// The run was republished to its subjects (or parked again from a still-invalid event on).
    Requeued,
    /// The run was dropped.
    Discarded,
}

impl Release {
    /// The `Outbox-Parking` value.
    pub fn as_str(self) -> &'static str {
        match self {
            Release::Requeued => "requeued",
            Release::Discarded => "discarded",
        }
    }
}

/// Where a parked copy sits in its key's run, and what it names.
#[derive(Debug, Clone, Copy)]
pub struct Run<'a> {
    /// The key's parking subject.
    pub subject: &'a str,
    /// The first failure's reason.
    pub reason: &'a str,
    /// The poison event's id.
    pub behind: &'a str,
    /// Its place in the run (1-based).
    pub count: u64,
    /// The poison's commit time, RFC 3339.
    pub since: &'a str,
    /// The request id of the requeue that parked it again, if one did.
    pub requeue: Option<&'a str>,
}

/// The `Nats-Msg-Id` of the parked copy of the event whose id is `id` (`requeue`: the request
/// that parked it again).
pub(crate) fn parked_id(id: &str, requeue: Option<&str>) -> String {
    let mut out = String::with_capacity(PARKED_ID_PREFIX.len() + id.len() + 40);
    out.push_str(PARKED_ID_PREFIX);
    out.push_str(id);
    if let Some(r) = requeue {
        out.push(':');
        out.push_str(r);
    }
    out
}

/// The parked copy of `event` in `run`, shrunk as `shrink` says; `routed`: the subject the event
/// would have had, when the template gives one.
pub(crate) fn parked_copy(
    event: &OutboxEvent,
    run: &Run<'_>,
    routed: Option<&str>,
    shrink: Shrink,
) -> Outgoing {
    let mut out = dead_letter_as(
        event,
        run.subject,
        run.reason,
        routed,
        shrink,
        IdHeader::MsgId,
    );
    let h = &mut out.headers;
    h.insert(
        NATS_MSG_ID,
        HeaderValue::from(parked_id(&event.msg_id, run.requeue)),
    );
    h.insert(EVENT_ID, HeaderValue::from(event.msg_id.clone()));
    h.insert(PARKED_BEHIND, HeaderValue::from(run.behind.to_owned()));
    h.insert(
        PARKED_COUNT,
        HeaderValue::from(itoa::Buffer::new().format(run.count)),
    );
    h.insert(PARKED_SINCE, HeaderValue::from(run.since.to_owned()));
    h.insert(NATS_TTL, "never");
    out
}

/// The release marker control request `request` writes on `subject` (the key's parking subject)
/// for the key (`aggregate_type`, `aggregate_id`).
pub fn release_marker(
    subject: &str,
    request: &str,
    release: Release,
    aggregate_type: Option<&str>,
    aggregate_id: Option<&str>,
) -> Outgoing {
    let mut h = HeaderMap::new();
    h.insert(NATS_MSG_ID, HeaderValue::from(released_id(request)));
    h.insert(PARKING, release.as_str());
    h.insert(NATS_TTL, "never");
    h.insert(CONTROL_ID, HeaderValue::from(header_value(request)));
    // The key's values say whose marker it is, for people: nothing reads them back (the subject
    // names the key). Cut like a shrunk dead letter's headers, since a marker has no smaller form:
    // one over the stream's or the server's limit would stop the relay at every start.
    let value = |v: &str| {
        let v = header_value(v);
        crate::text::cut(&v, super::dead_letter::MAX_DEAD_LETTER_HEADER).to_owned()
    };
    if let Some(v) = aggregate_type {
        h.insert(AGGREGATE_TYPE, HeaderValue::from(value(v)));
    }
    if let Some(v) = aggregate_id {
        h.insert(AGGREGATE_ID, HeaderValue::from(value(v)));
    }
    Outgoing {
        subject: subject.to_owned(),
        headers: h,
        payload: Bytes::new(),
        dead_letter: None,
    }
}

/// The `Nats-Msg-Id` of the release marker of request `request`.
pub fn released_id(request: &str) -> String {
    format!("{RELEASED_ID_PREFIX}{request}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event() -> OutboxEvent {
        let mut e = OutboxEvent::at(Bytes::from_static(b"{}"), crate::Lsn(0x100), 0, 0, None);
        e.id = Some("e-7".into());
        e.msg_id = "e-7".into();
        e.aggregate_type = Some("Claim".into());
        e.aggregate_id = Some("4711".into());
        e
    }

    #[test]
    fn a_parked_copy_has_an_id_of_its_own_and_names_its_run() {
        let run = Run {
            subject: "dl.parked.00",
            reason: "ClaimApproved: /claim: not an integer",
            behind: "e-1",
            count: 3,
            since: "2026-01-01T00:00:00Z",
            requeue: None,
        };
        let out = parked_copy(&event(), &run, Some("outbox.Claim"), Shrink::Keep);
        let h = |n: &str| out.headers.get(n).map(|v| v.as_str().to_owned());
        assert_eq!(out.subject, "dl.parked.00");
        assert_eq!(h(NATS_MSG_ID).as_deref(), Some("parked:e-7"));
        assert_eq!(h(EVENT_ID).as_deref(), Some("e-7"));
        assert_eq!(h(PARKED_BEHIND).as_deref(), Some("e-1"));
        assert_eq!(h(PARKED_COUNT).as_deref(), Some("3"));
        assert_eq!(h(PARKED_SINCE).as_deref(), Some("2026-01-01T00:00:00Z"));
        assert_eq!(
            h(NATS_TTL).as_deref(),
            Some("never"),
            "max_age never removes it"
        );
        assert_eq!(h(super::super::ERROR).as_deref(), Some(run.reason));
        assert_eq!(h(super::super::SUBJECT).as_deref(), Some("outbox.Claim"));
        assert_eq!(h(AGGREGATE_ID).as_deref(), Some("4711"));
        let again = Run {
            requeue: Some("r-9"),
            ..run
        };
        let out = parked_copy(&event(), &again, None, Shrink::DropPayload);
        assert_eq!(
            out.headers.get(NATS_MSG_ID).unwrap().as_str(),
            "parked:e-7:r-9"
        );
        assert!(out.payload.is_empty());
    }

    #[test]
    fn a_release_marker_is_empty_and_names_its_request_and_key() {
        let m = release_marker(
            "dl.parked.00",
            "r-1",
            Release::Discarded,
            Some("Claim"),
            None,
        );
        assert!(m.payload.is_empty());
        assert_eq!(m.headers.get(NATS_MSG_ID).unwrap().as_str(), "released:r-1");
        assert_eq!(m.headers.get(PARKING).unwrap().as_str(), "discarded");
        assert_eq!(m.headers.get(CONTROL_ID).unwrap().as_str(), "r-1");
        assert_eq!(m.headers.get(NATS_TTL).unwrap().as_str(), "never");
        assert!(m.headers.get(AGGREGATE_ID).is_none());
    }

    #[test]
    fn a_release_marker_of_a_huge_key_stays_small() {
        // A key may be as long as a control message (1 MiB); the marker has no smaller form, and
        // one over the stream's max_msg_size or the server's max_payload stopped the relay at its
        // every start (the release could never be stored).
        let id = "4711".repeat(200_000);
        let m = release_marker(
            "dl.parked.00",
            "r-1",
            Release::Requeued,
            Some(&id),
            Some(&id),
        );
        let size: usize = m
            .headers
            .iter()
            .flat_map(|(_, vs)| vs.iter().map(|v| v.as_str().len()))
            .sum();
        assert!(size <= 4096, "{size} bytes of header values");
        assert!(id.starts_with(m.headers.get(AGGREGATE_ID).unwrap().as_str()));
    }
}
