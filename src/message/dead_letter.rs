//! The dead-letter form of an event that cannot be published as it is: on the dead-letter
//! subject, with `Outbox-Error` (one line, ASCII) and `Outbox-Subject`, shrunk step by step
//! ([`Shrink`]) when it does not fit the server's limits. A dead letter has an id of its own,
//! `Nats-Msg-Id: dead-letter:<id>`, and the event's id in `Outbox-Event-Id`
//! ([`dead_letter_id`]), so the event requeued later is not dropped as its duplicate.

use async_nats::HeaderMap;
use async_nats::header::HeaderValue;
use bytes::Bytes;

use super::TRUNCATED_HEADERS;
use super::{COMMIT_TIME, CONTENT_TYPE, Descriptive, ERROR, IdHeader, Outgoing, PAYLOAD_SIZE};
use super::{SUBJECT, rfc3339_micros};
use super::{headers, names};
use crate::event::OutboxEvent;
use crate::text::{cut, one_line};

/// How much of an event a dead letter keeps. A dead letter that does not fit the server's limits is
/// shrunk step by step, so one oversized row can never stop the relay (P7, P11).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Shrink {
    /// Payload and every header as they are.
    Keep,
    /// No payload (`Outbox-Payload-Size` says how big it was); header values over
    /// [`MAX_DEAD_LETTER_HEADER`] bytes truncated and named in `Outbox-Truncated-Headers`.
    DropPayload,
    /// Only the id, the reason, the commit LSN and the payload size (and the sink's position).
    Minimal,
}

impl Shrink {
    /// The next step down the ladder (`Keep` → `DropPayload` → `Minimal`), `None` past the last:
    /// the one place the order of the steps is written.
    pub(crate) fn smaller(self) -> Option<Shrink> {
        match self {
            Shrink::Keep => Some(Shrink::DropPayload),
            Shrink::DropPayload => Some(Shrink::Minimal),
            Shrink::Minimal => None,
        }
    }

    /// Every step below this one, in order.
    pub(crate) fn below(self) -> impl Iterator<Item = Shrink> {
        std::iter::successors(self.smaller(), |s| s.smaller())
    }
}

/// The `Nats-Msg-Id` of the dead letter of the event whose id is `id`: `dead-letter:<id>`, or
/// `dead-letter:<id>:<request>` for the new dead letter of a requeued one still invalid
/// (`requeue`: the control request's id).
pub(crate) fn dead_letter_id(id: &str, requeue: Option<&str>) -> String {
    let extra = requeue.map_or(0, |r| r.len() + 1);
    let mut out = String::with_capacity(DEAD_LETTER_ID_PREFIX.len() + id.len() + extra);
    out.push_str(DEAD_LETTER_ID_PREFIX);
    out.push_str(id);
    if let Some(r) = requeue {
        out.push(':');
        out.push_str(r);
    }
    out
}

/// What a dead letter's `Nats-Msg-Id` starts with, before the event id.
pub(crate) const DEAD_LETTER_ID_PREFIX: &str = "dead-letter:";

/// The longest header value a shrunk dead letter keeps.
pub(crate) const MAX_DEAD_LETTER_HEADER: usize = 1024;

/// The dead-letter form of `event`, shrunk as `shrink` says.
pub(crate) fn dead_letter(
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
pub(crate) fn dead_letter_as(
    event: &OutboxEvent,
    dead_letter_subject: &str,
    reason: &str,
    subject: Option<&str>,
    shrink: Shrink,
    id: IdHeader,
) -> Outgoing {
    let mut h = match shrink {
        Shrink::Keep => headers(event, id, Descriptive::On),
        Shrink::DropPayload => truncated(headers(event, id, Descriptive::On)),
        Shrink::Minimal => {
            let n = names();
            let mut h = HeaderMap::new();
            h.insert(n.id(id).clone(), HeaderValue::from(event.msg_id.clone()));
            h.insert(
                n.commit_lsn.clone(),
                HeaderValue::from(event.commit_lsn.text()),
            );
            h
        }
    };
    if id == IdHeader::MsgId {
        // A dead letter's own id: with the event's, JetStream would drop the event as a duplicate
        // when it is requeued to its subject inside the duplicate window. The event's id travels
        // in `Outbox-Event-Id`, where every reader of the relay's messages looks first.
        let n = names();
        h.insert(
            n.msg_id.clone(),
            HeaderValue::from(dead_letter_id(&event.msg_id, None)),
        );
        h.insert(n.event_id.clone(), HeaderValue::from(event.msg_id.clone()));
    }
    h.insert(ERROR, cap(&ascii(&one_line(reason))).as_str());
    if let Some(s) = subject.filter(|_| shrink != Shrink::Minimal) {
        h.insert(SUBJECT, cap(s).as_str());
    }
    // What the event's `ce-datacontenttype` was (or would have been): a requeue reads the payload
    // back as bytes, and the column's type is not in the stream otherwise.
    if let Some(ct) = event.content_type.filter(|_| shrink != Shrink::Minimal) {
        h.insert(CONTENT_TYPE, ct);
    }
    // Likewise its `ce-time`: the copy is republished later, at the request's commit, and the
    // event's own commit time is in the stream nowhere else (a copy parked again after a failed
    // requeue carries the first one on). 27 bytes, never a row's text.
    let committed = event.own_commit_ts();
    if committed != 0 && shrink != Shrink::Minimal {
        h.insert(COMMIT_TIME, rfc3339_micros(committed).as_str());
    }
    let payload = if shrink == Shrink::Keep {
        event.payload.clone()
    } else {
        // A revived copy whose payload was dropped before carries the first size on.
        if h.get(PAYLOAD_SIZE).is_none() {
            h.insert(PAYLOAD_SIZE, event.payload.len().to_string().as_str());
        }
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
    cut(s, MAX_DEAD_LETTER_HEADER).to_owned()
}

/// The relay's own header text in ASCII: characters beyond it (from a row's values, which a
/// reason quotes) as `\u{…}` escapes. Some clients decode a non-ASCII header value as something
/// other than a string (nats-py: an `email.header.Header`).
fn ascii(s: &str) -> String {
    if s.is_ascii() {
        return s.to_owned();
    }
    s.chars()
        .map(|c| match c {
            c if c.is_ascii() => c.to_string(),
            c => c.escape_unicode().to_string(),
        })
        .collect()
}
