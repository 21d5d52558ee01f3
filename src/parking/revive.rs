//! A parked copy read back from its key's subject as the event it was ([`revive`]), for a requeue,
//! and a dead letter likewise ([`revive_dead_letter`], for `requeue_event`): its id
//! (`Outbox-Event-Id`; an old dead letter's `Nats-Msg-Id`), its key and type, its own headers
//! (every header outside the relay's `Nats-` and `Outbox-` names), its payload and its own commit
//! time (`Outbox-Commit-Time`, which its `ce-time` says, not the request's), placed at the
//! position of the control message's expansion it is republished at. A copy the stream's limits
//! shrank (no payload, or headers cut) cannot be republished as the event it was: it comes back
//! with a problem, so the requeue parks its key again (or dead-letters it again) with that
//! reason. Pure.

use crate::Lsn;
use crate::event::OutboxEvent;
use crate::message::DEAD_LETTER_ID_PREFIX;
use crate::message::{AGGREGATE_ID, AGGREGATE_TYPE, COMMIT_LSN, EVENT_ID, EVENT_TYPE, NATS_MSG_ID};
use crate::message::{COMMIT_TIME, parse_rfc3339_micros};
use crate::message::{CONTENT_TYPE, PAYLOAD_SIZE, TRUNCATED_HEADERS, content_type_of};
use crate::nats::StoredMessage;
use crate::position::Position;

/// The reason a copy whose payload was dropped keeps its key parked.
pub const PAYLOAD_DROPPED: &str = "payload dropped when parked: over the stream's limit";

/// The reason a dead letter whose payload was dropped is dead-lettered again.
pub const DEAD_LETTER_PAYLOAD_DROPPED: &str =
    "payload dropped when dead-lettered: over the stream's limit";

/// The event `copy` holds, republished at `at` by a control message committed at `commit_ts`.
/// Its key is read from its headers, which hold one line: a key value with a line break comes
/// back changed ([`revive_of_key`] keeps it).
pub fn revive(copy: &StoredMessage, at: Position, commit_ts: i64) -> OutboxEvent {
    let id = copy.headers.get(EVENT_ID).map(|v| v.as_str().to_owned());
    revive_as(copy, id, at, commit_ts, "parked", PAYLOAD_DROPPED)
}

/// [`revive`] for a copy read from the parking subject of the key (`aggregate_type`,
/// `aggregate_id`) a control message names: every copy there is of that key, so the event takes
/// the key's values as the request holds them, whole. Its headers hold them on one line (a line
/// break cannot be in a header), and a value read back from them would hash to another key: the
/// copy would not be held behind its key's poison, nor parked again on its key's subject.
pub fn revive_of_key(
    copy: &StoredMessage,
    aggregate_type: Option<&str>,
    aggregate_id: Option<&str>,
    at: Position,
    commit_ts: i64,
) -> OutboxEvent {
    let mut event = revive(copy, at, commit_ts);
    event.aggregate_type = aggregate_type.map(str::to_owned);
    event.aggregate_id = aggregate_id.map(str::to_owned);
    event
}

/// The event the dead letter `m` holds, republished at `at` by a `requeue_event` committed at
/// `commit_ts`; an old dead letter (from before dead letters had ids of their own) has no
/// `Outbox-Event-Id`, and its `Nats-Msg-Id` is the event's id.
pub fn revive_dead_letter(m: &StoredMessage, at: Position, commit_ts: i64) -> OutboxEvent {
    let id = dead_letter_event_id(&m.headers).map(str::to_owned);
    revive_as(
        m,
        id,
        at,
        commit_ts,
        "dead-lettered",
        DEAD_LETTER_PAYLOAD_DROPPED,
    )
}

/// The event id a dead letter's headers name: `Outbox-Event-Id`, or (an old dead letter) its
/// `Nats-Msg-Id` when that is not a dead letter's own id.
pub fn dead_letter_event_id(h: &async_nats::HeaderMap) -> Option<&str> {
    match h.get(EVENT_ID) {
        Some(v) => Some(v.as_str()),
        None => h
            .get(NATS_MSG_ID)
            .map(|v| v.as_str())
            .filter(|id| !id.starts_with(DEAD_LETTER_ID_PREFIX)),
    }
}

/// The event `copy` holds with the id `id`, as [`revive`] says; `kept`: how it was kept (for a
/// problem's reason), `dropped`: the reason when its payload was dropped.
fn revive_as(
    copy: &StoredMessage,
    id: Option<String>,
    at: Position,
    commit_ts: i64,
    kept: &str,
    dropped: &str,
) -> OutboxEvent {
    let h = &copy.headers;
    let text = |n: &str| h.get(n).map(|v| v.as_str().to_owned());
    let commit_lsn = text(COMMIT_LSN)
        .and_then(|l| l.parse::<Lsn>().ok())
        .unwrap_or(at.lsn);
    // The payload's media type, recorded on the copy (`ce-datacontenttype` when published); a
    // copy from before it was recorded has none.
    let content_type = text(CONTENT_TYPE).and_then(|v| content_type_of(&v));
    let mut event = OutboxEvent::at(
        copy.payload.clone(),
        commit_lsn,
        at.index,
        commit_ts,
        content_type,
    );
    event.position = at;
    // Its own commit time (`ce-time`), in the relay's own form only; a copy from before it was
    // recorded, or with another value, is published with the request's, as before.
    event.original_commit_ts = h
        .get(COMMIT_TIME)
        .and_then(|v| parse_rfc3339_micros(v.as_str()));
    event.id = id;
    event.msg_id = event.id.clone().unwrap_or_default();
    event.aggregate_type = text(AGGREGATE_TYPE);
    event.aggregate_id = text(AGGREGATE_ID);
    event.event_type = text(EVENT_TYPE);
    for (name, values) in h.iter() {
        let name: &str = name.as_ref();
        let reserved = ["nats-", "outbox-"]
            .iter()
            .any(|p| name.len() >= p.len() && name[..p.len()].eq_ignore_ascii_case(p));
        if reserved {
            continue;
        }
        for v in values {
            event.headers.push((name.to_owned(), v.as_str().to_owned()));
        }
    }
    if h.get(PAYLOAD_SIZE).is_some() {
        event.problem = Some(dropped.to_owned());
    } else if let Some(cut) = text(TRUNCATED_HEADERS) {
        event.problem = Some(format!(
            "headers cut when {kept} ({cut}): over the stream's limit"
        ));
    }
    if event.problem.is_some() {
        // The copy parked (or dead-lettered) again from this event is small enough to keep
        // whole, so no shrink would mark it: it carries the marks on, or the next requeue would
        // read its empty payload or cut headers as the event's own and publish them.
        for name in [PAYLOAD_SIZE, TRUNCATED_HEADERS] {
            if let Some(v) = text(name) {
                event.headers.push((name.to_owned(), v));
            }
        }
    } else if event.id.is_none() {
        event.problem = Some(format!("a message {kept} without Outbox-Event-Id"));
        event.msg_id = crate::event::message_id(None, commit_lsn, at.index, &copy.payload);
    }
    event
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::message::parked::{Run, parked_copy};
    use crate::message::{Outgoing, Shrink};

    /// Event `msg_id` with `{}` as its payload, of `content_type`, committed at 0/10.
    pub(crate) fn event(msg_id: &str, content_type: Option<&'static str>) -> OutboxEvent {
        let payload = bytes::Bytes::from_static(b"{}");
        let mut e = OutboxEvent::at(payload, Lsn(0x10), 0, 0, content_type);
        e.msg_id = msg_id.into();
        e
    }

    /// The `count`th event of a run parked on `dl.parked.x` behind `behind`, for the reason `bad`.
    pub(crate) fn run(behind: &str, count: u64) -> Run<'_> {
        Run {
            subject: "dl.parked.x",
            reason: "bad",
            behind,
            count,
            since: "2026-01-01T00:00:00Z",
            requeue: None,
        }
    }

    /// `out` as the stream stores it, at `seq`.
    fn stored(seq: u64, out: Outgoing) -> StoredMessage {
        StoredMessage {
            seq,
            subject: out.subject,
            headers: out.headers,
            payload: out.payload,
        }
    }

    fn copy_of(shrink: Shrink) -> StoredMessage {
        let mut e = OutboxEvent::at(
            bytes::Bytes::from_static(br#"{"claim":4711}"#),
            Lsn(0x1_0000_0010),
            3,
            0,
            None,
        );
        e.id = Some("e-9".into());
        e.msg_id = "e-9".into();
        e.aggregate_type = Some("Claim".into());
        e.aggregate_id = Some("4711".into());
        e.event_type = Some("ClaimPaid".into());
        e.headers = vec![("tenant".into(), "t1".into())];
        let run = run("e-1", 2);
        let out = parked_copy(&e, &run, Some("outbox.Claim"), shrink);
        stored(7, out)
    }

    #[test]
    fn a_parked_copy_comes_back_as_its_event_at_the_expansions_position() {
        let at = Position::in_transaction(Lsn(0x2_0000_0000), 4).with_sub(2);
        let e = revive(&copy_of(Shrink::Keep), at, 77);
        assert_eq!(e.msg_id, "e-9");
        assert_eq!(e.id.as_deref(), Some("e-9"));
        assert_eq!(e.position, at);
        assert_eq!(e.commit_lsn, Lsn(0x1_0000_0010), "the original commit LSN");
        assert_eq!(
            (
                e.aggregate_type.as_deref(),
                e.aggregate_id.as_deref(),
                e.event_type.as_deref()
            ),
            (Some("Claim"), Some("4711"), Some("ClaimPaid"))
        );
        assert_eq!(e.headers, vec![("tenant".to_owned(), "t1".to_owned())]);
        assert_eq!(&e.payload[..], br#"{"claim":4711}"#);
        assert!(e.problem.is_none());
    }

    #[test]
    fn a_dead_letter_comes_back_as_its_event_and_an_old_one_by_its_nats_msg_id() {
        let at = Position::in_transaction(Lsn(0x2_0000_0000), 4);
        let mut e = event("e-5", None);
        e.headers = vec![("tenant".into(), "t1".into())];
        let out = crate::message::dead_letter(&e, "dl", "bad", Some("outbox.Claim"), Shrink::Keep);
        let mut m = stored(3, out);
        assert_eq!(
            m.headers.get(NATS_MSG_ID).unwrap().as_str(),
            "dead-letter:e-5"
        );
        let back = revive_dead_letter(&m, at, 0);
        assert_eq!(
            (back.msg_id.as_str(), back.problem.as_deref()),
            ("e-5", None)
        );
        assert_eq!(back.headers, vec![("tenant".to_owned(), "t1".to_owned())]);
        // A dead letter from before dead letters had ids of their own.
        m.headers.insert(NATS_MSG_ID, "e-5");
        let mut old = async_nats::HeaderMap::new();
        for (n, vs) in m.headers.iter() {
            let name: &str = n.as_ref();
            if !name.eq_ignore_ascii_case(EVENT_ID) {
                for v in vs {
                    old.append(n.clone(), v.clone());
                }
            }
        }
        m.headers = old;
        assert_eq!(dead_letter_event_id(&m.headers), Some("e-5"));
        assert_eq!(revive_dead_letter(&m, at, 0).msg_id, "e-5");
        let dropped = crate::message::dead_letter(&e, "dl", "bad", None, Shrink::DropPayload);
        let m = stored(4, dropped);
        assert_eq!(
            revive_dead_letter(&m, at, 0).problem.as_deref(),
            Some(DEAD_LETTER_PAYLOAD_DROPPED)
        );
    }

    #[test]
    fn a_key_with_line_breaks_hashes_as_itself_when_revived_from_its_request() {
        let mut e = event("e-1", None);
        e.aggregate_type = Some("Claim\nType".into());
        e.aggregate_id = Some("47\r\n11".into());
        let run = run("e-1", 1);
        let out = parked_copy(&e, &run, None, Shrink::Keep);
        let copy = stored(1, out);
        let at = Position::in_transaction(Lsn(0x20), 0).with_sub(1);
        let key = crate::parking::KeyHash::of_event(&e);
        assert_ne!(
            crate::parking::KeyHash::of_event(&revive(&copy, at, 0)),
            key,
            "the headers hold the values on one line"
        );
        let back = revive_of_key(&copy, Some("Claim\nType"), Some("47\r\n11"), at, 0);
        assert_eq!(crate::parking::KeyHash::of_event(&back), key);
        let null = revive_of_key(&copy, Some("Claim\nType"), None, at, 0);
        assert_eq!(null.aggregate_id, None, "NULL stays NULL");
    }

    #[test]
    fn a_copy_parked_again_without_its_payload_cannot_be_requeued_either() {
        let at = Position::in_transaction(Lsn(0x2_0000_0000), 4).with_sub(1);
        let first = revive(&copy_of(Shrink::DropPayload), at, 0);
        let run = Run {
            reason: PAYLOAD_DROPPED,
            requeue: Some("r-1"),
            ..run("e-9", 1)
        };
        // Parked again by the first requeue: its empty payload fits, so it is kept whole.
        let out = parked_copy(&first, &run, None, Shrink::Keep);
        let again = stored(9, out);
        let second = revive(&again, at, 0);
        assert_eq!(
            second.problem.as_deref(),
            Some(PAYLOAD_DROPPED),
            "a second requeue would publish the empty payload as the event"
        );
        let mut cut = copy_of(Shrink::Keep);
        cut.headers.insert(TRUNCATED_HEADERS, "tenant");
        let first = revive(&cut, at, 0);
        let out = parked_copy(&first, &run, None, Shrink::Keep);
        let again = stored(10, out);
        assert!(
            revive(&again, at, 0).problem.is_some(),
            "a second requeue would publish the cut headers as the event's"
        );
    }

    #[test]
    fn a_revived_copy_or_dead_letter_has_the_events_content_type_again() {
        let at = Position::in_transaction(Lsn(0x2_0000_0000), 4).with_sub(1);
        let mut e = event("e-5", Some(crate::event::JSON_CONTENT_TYPE));
        let run = run("e-5", 1);
        let copy = stored(1, parked_copy(&e, &run, None, Shrink::Keep));
        assert_eq!(revive(&copy, at, 0).content_type, e.content_type);
        let letter = stored(
            1,
            crate::message::dead_letter(&e, "dl", "bad", None, Shrink::Keep),
        );
        assert_eq!(
            revive_dead_letter(&letter, at, 0).content_type,
            e.content_type
        );
        e.content_type = Some(crate::event::TEXT_CONTENT_TYPE);
        let copy = stored(1, parked_copy(&e, &run, None, Shrink::Keep));
        assert_eq!(revive(&copy, at, 0).content_type, e.content_type);
        // A bytea payload has none; a value the relay never writes gives none.
        e.content_type = None;
        let mut copy = stored(1, parked_copy(&e, &run, None, Shrink::Keep));
        assert_eq!(revive(&copy, at, 0).content_type, None);
        copy.headers.insert(CONTENT_TYPE, "text/html");
        assert_eq!(revive(&copy, at, 0).content_type, None);
    }

    // 2024-02-29 13:45:06.000789 UTC, and the request's commit a day later.
    const COMMITTED: i64 = 762_529_506_000_789;
    const REQUEST: i64 = COMMITTED + 86_400_000_000;
    const COMMITTED_TEXT: &str = "2024-02-29T13:45:06.000789Z";

    /// An event committed at `COMMITTED`, the run it parks in, and where the request stands.
    fn committed_event() -> (OutboxEvent, Run<'static>, Position) {
        let mut e = event("e-5", None);
        e.commit_ts = COMMITTED;
        e.event_type = Some("ClaimApproved".into());
        let run = Run {
            since: COMMITTED_TEXT,
            ..run("e-5", 1)
        };
        let at = Position::in_transaction(Lsn(0x2_0000_0000), 4).with_sub(1);
        (e, run, at)
    }

    /// The `ce-time` the event would be published with.
    fn ce_time(e: &OutboxEvent) -> Option<String> {
        let template = crate::route::SubjectTemplate::parse("outbox.x").unwrap();
        let ce = crate::message::CloudEvents::new("/s");
        let m = crate::message::build(e, &template, "dl", Some(&ce));
        m.headers.get("ce-time").map(|v| v.as_str().to_owned())
    }

    #[test]
    fn a_revived_copy_or_dead_letter_keeps_its_own_commit_time_for_ce_time() {
        let (e, run, at) = committed_event();
        let copy = stored(1, parked_copy(&e, &run, None, Shrink::Keep));
        assert_eq!(
            copy.headers.get(COMMIT_TIME).map(|v| v.as_str()),
            Some(COMMITTED_TEXT)
        );
        let back = revive(&copy, at, REQUEST);
        assert_eq!(
            (back.commit_ts, back.original_commit_ts),
            (REQUEST, Some(COMMITTED))
        );
        assert_eq!(ce_time(&back).as_deref(), Some(COMMITTED_TEXT));
        let letter = stored(
            1,
            crate::message::dead_letter(&e, "dl", "bad", None, Shrink::Keep),
        );
        let back = revive_dead_letter(&letter, at, REQUEST);
        assert_eq!(ce_time(&back).as_deref(), Some(COMMITTED_TEXT));
        // Parked again by a requeue: the copy carries the first commit time on, not the request's.
        let again = stored(1, parked_copy(&back, &run, None, Shrink::Keep));
        assert_eq!(
            revive(&again, at, REQUEST + 1).original_commit_ts,
            Some(COMMITTED)
        );
    }

    #[test]
    fn a_copy_without_a_commit_time_of_the_relays_form_gets_the_requests_time() {
        let (e, run, at) = committed_event();
        // A copy from before the header, or with a value the relay never writes: the request's
        // time, as before.
        let mut old = stored(1, parked_copy(&e, &run, None, Shrink::Keep));
        old.headers.insert(COMMIT_TIME, "2024-02-29T13:45:06Z");
        let unstamped = OutboxEvent {
            commit_ts: 0,
            ..e.clone()
        };
        for c in [
            stored(1, parked_copy(&unstamped, &run, None, Shrink::Keep)),
            old,
        ] {
            let back = revive(&c, at, REQUEST);
            assert_eq!(back.original_commit_ts, None, "{:?}", c.headers);
            assert_eq!(
                ce_time(&back).as_deref(),
                Some("2024-03-01T13:45:06.000789Z")
            );
        }
    }

    #[test]
    fn a_copy_without_its_payload_cannot_be_requeued() {
        let at = Position::in_transaction(Lsn(0x2_0000_0000), 4).with_sub(1);
        let e = revive(&copy_of(Shrink::DropPayload), at, 0);
        assert_eq!(e.problem.as_deref(), Some(PAYLOAD_DROPPED));
    }
}
