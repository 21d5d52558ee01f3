//! Where an event goes: the one place that decides it. An event goes to its own subject, or, when
//! it cannot be published as it is (a problem the outbox stage recorded, a subject that does not
//! render, a message too large for the server or the stream, a refusal by the stream for good),
//! `outbox.on_invalid` decides between its dead letter, a stop, and parking its key ([`choose`],
//! [`refused`]). Every path asks here: a single message (`envelope.rs`), a member of an atomic
//! batch (`batch.rs`, `batch/fit.rs`), a message the stream refused later (`settle.rs`). What was
//! decided is kept with the message in flight ([`Sent`]), so it can be sent again the same way.
//!
//! Parking (`"park"`): a key whose event could not be published is parked in the session's
//! [`ParkedSet`], and that event and every later event of the key go to the key's parking
//! subject as parked copies ([`Sent::Parked`]) until a control message releases it. Asking
//! whether a key is parked costs nothing while no key is (one length check), and a SHA-256 of the
//! key's values while some are.

use std::borrow::Cow;

use tracing::warn;

use super::config::SinkConfig;
use super::error::SinkError;
use crate::event::OutboxEvent;
use crate::message::Shrink;
use crate::parking::{Full, KeyHash, ParkedKey, ParkedSet, parked_subject};

/// Where an event's message went, so it can be sent again the same way.
#[derive(Debug, Clone)]
pub(crate) enum Sent {
    /// The routed message, to the event's own subject.
    Event,
    /// A dead letter with this reason, shrunk this far.
    DeadLetter {
        /// Why the event cannot be published as it is.
        reason: String,
        /// How far down the shrink ladder it went.
        shrink: Shrink,
        /// The request of the `requeue_event` that found the event still invalid: the dead
        /// letter's id is then `dead-letter:<id>:<request>`, so JetStream does not drop it as the
        /// first dead letter's duplicate.
        requeue: Option<Box<str>>,
    },
    /// A parked copy on its key's parking subject (boxed: rare, and larger than the others).
    Parked(Box<ParkedAs>),
    /// The release marker of a control message, on the key's parking subject.
    Marker(Box<MarkerAs>),
}

/// A release marker: which key, how, by which request.
#[derive(Debug, Clone)]
pub(crate) struct MarkerAs {
    /// The key's parking subject.
    pub(crate) subject: String,
    /// The control request's id.
    pub(crate) request: String,
    /// Requeued or discarded.
    pub(crate) release: crate::message::parked::Release,
}

/// A parked copy's place in its key's run.
#[derive(Debug, Clone)]
pub(crate) struct ParkedAs {
    /// Its parking subject.
    pub(crate) subject: String,
    /// The first failure's reason.
    pub(crate) reason: String,
    /// The poison's id.
    pub(crate) behind: String,
    /// The copy's place in the run (1-based).
    pub(crate) count: u64,
    /// The poison's commit time, RFC 3339.
    pub(crate) since: String,
    /// The request id of a requeue that parks it again.
    pub(crate) requeue: Option<String>,
    /// How far down the shrink ladder it went.
    pub(crate) shrink: Shrink,
}

impl ParkedAs {
    /// The copy of the next event held on `key`, parked as `parked`.
    fn new(
        config: &SinkConfig,
        key: KeyHash,
        parked: &ParkedKey,
        requeue: Option<String>,
    ) -> ParkedAs {
        ParkedAs {
            subject: parked_subject(&config.dead_letter_subject, key),
            reason: parked.reason.clone(),
            behind: parked.poison.clone(),
            count: parked.count,
            since: parked.since.clone(),
            requeue,
            shrink: Shrink::Keep,
        }
    }

    /// The run as the message builder takes it.
    pub(crate) fn run(&self) -> crate::message::parked::Run<'_> {
        crate::message::parked::Run {
            subject: &self.subject,
            reason: &self.reason,
            behind: &self.behind,
            count: self.count,
            since: &self.since,
            requeue: self.requeue.as_deref(),
        }
    }
}

impl Sent {
    /// The `Nats-Msg-Id` the message carries for the event whose id is `msg_id` (what the next
    /// message's `Nats-Expected-Last-Msg-Id` names): the id itself, `dead-letter:<id>`, or
    /// `parked:<id>` (`parked:<id>:<request>` when a requeue parked it again).
    pub(crate) fn wire_id<'a>(&self, msg_id: &'a str) -> Cow<'a, str> {
        match self {
            Sent::Event => Cow::Borrowed(msg_id),
            Sent::DeadLetter { requeue, .. } => {
                Cow::Owned(crate::message::dead_letter_id(msg_id, requeue.as_deref()))
            }
            Sent::Parked(p) => Cow::Owned(crate::message::parked::parked_id(
                msg_id,
                p.requeue.as_deref(),
            )),
            Sent::Marker(m) => Cow::Owned(crate::message::parked::released_id(&m.request)),
        }
    }

    /// The reason it is not the routed event, if it is not.
    pub(crate) fn reason(&self) -> Option<&str> {
        match self {
            Sent::Event => None,
            Sent::DeadLetter { reason, .. } => Some(reason),
            Sent::Parked(p) => Some(&p.reason),
            Sent::Marker(_) => Some("the release marker cannot be stored"),
        }
    }

    /// How far down the shrink ladder it went (`Keep` for the routed event).
    pub(crate) fn shrink(&self) -> Shrink {
        match self {
            Sent::Event | Sent::Marker(_) => Shrink::Keep,
            Sent::DeadLetter { shrink, .. } => *shrink,
            Sent::Parked(p) => p.shrink,
        }
    }

    /// The same message, shrunk to `shrink` (the routed event has no smaller form).
    pub(crate) fn shrunk(mut self, to: Shrink) -> Sent {
        match &mut self {
            Sent::Event | Sent::Marker(_) => {}
            Sent::DeadLetter { shrink, .. } => *shrink = to,
            Sent::Parked(p) => p.shrink = to,
        }
        self
    }
}

/// The destination of `event`, whose message was built with `problem` (`Some`: why it cannot be
/// published as it is): its own subject, its dead letter (`outbox.on_invalid = "dead_letter"`,
/// logged), a parked copy (`"park"`: its key is parked, or it parks it now); `Err` to stop
/// (`"stop"`, or one more parked key than `outbox.max_parked_keys`).
#[inline]
pub(crate) fn choose(
    config: &SinkConfig,
    parked: &mut ParkedSet,
    event: &OutboxEvent,
    problem: Option<&str>,
) -> Result<Sent, SinkError> {
    if config.park_on_invalid {
        #[cfg(feature = "test-support")]
        let unchecked =
            crate::parking::mutation::on(crate::parking::mutation::Mutation::KeyUnchecked);
        #[cfg(not(feature = "test-support"))]
        let unchecked = false;
        if !parked.is_empty() && !unchecked {
            let key = KeyHash::of_event(event);
            let requeue = parked.requeue().map(str::to_owned);
            if let Some(k) = parked.hold(&key) {
                return Ok(Sent::Parked(Box::new(ParkedAs::new(
                    config, key, k, requeue,
                ))));
            }
        }
        return match problem {
            None => Ok(Sent::Event),
            Some(reason) if parked.requeue_of_dead_letter().is_none() => {
                park(config, parked, event, reason)
            }
            Some(reason) => dead_letter(config, parked, event, reason.to_owned()),
        };
    }
    match problem {
        None => Ok(Sent::Event),
        Some(reason) => dead_letter(config, parked, event, reason.to_owned()),
    }
}

/// The message sent for `event` as `sent` cannot be stored (`reason`: too large, or refused by the
/// stream for good): what goes in its place, at the step of the shrink ladder to go on below. A
/// routed event becomes its dead letter or parks its key (`outbox.on_invalid` permitting: `Err` to
/// stop); a dead letter or parked copy keeps its first reason and shrinks further.
pub(crate) fn refused(
    config: &SinkConfig,
    parked: &mut ParkedSet,
    event: &OutboxEvent,
    sent: &Sent,
    reason: String,
) -> Result<Sent, SinkError> {
    match sent {
        Sent::Event if config.park_on_invalid && parked.requeue_of_dead_letter().is_none() => {
            park(config, parked, event, &reason)
        }
        Sent::Event => dead_letter(config, parked, event, reason),
        other => Ok(other.clone()),
    }
}

/// A routed event sent again behind a refusal (`resend`): when its key was parked since it was
/// first sent by an event ahead of it (refused for good), it goes as a parked copy instead, so
/// nothing of a parked key reaches its subject after the poison. A key parked by an event after
/// it does not hold it: it goes to its subject, before its poison, as in commit order.
pub(crate) fn again(
    config: &SinkConfig,
    parked: &mut ParkedSet,
    event: &OutboxEvent,
    sent: &Sent,
) -> Option<Sent> {
    if !config.park_on_invalid || parked.is_empty() || !matches!(sent, Sent::Event) {
        return None;
    }
    let key = KeyHash::of_event(event);
    // Parked by an event after this one (refused for good while this one waited): this one was
    // sent before its poison and goes to its subject as first decided.
    if !parked.holds(&key, event.position) {
        return None;
    }
    let requeue = parked.requeue().map(str::to_owned);
    let k = parked.hold(&key)?;
    Some(Sent::Parked(Box::new(ParkedAs::new(
        config, key, k, requeue,
    ))))
}

/// Parks `event`'s key at `event` for `reason` (logged): its parked copy is the run's first.
fn park(
    config: &SinkConfig,
    parked: &mut ParkedSet,
    event: &OutboxEvent,
    reason: &str,
) -> Result<Sent, SinkError> {
    let key = KeyHash::of_event(event);
    // Since the poison committed: a copy parked again by a failed requeue keeps its own commit
    // time, so the key does not look freshly parked after each attempt.
    let since = crate::message::rfc3339_micros(event.own_commit_ts());
    let requeue = parked.requeue().map(str::to_owned);
    match parked.park(
        key,
        ParkedKey::new(&event.msg_id, reason, since).at(event.position),
    ) {
        Ok(k) => {
            warn!(id = %event.msg_id, lsn = %event.commit_lsn, key = %key_text(event), %reason, "parking the event's key");
            Ok(Sent::Parked(Box::new(ParkedAs::new(
                config, key, k, requeue,
            ))))
        }
        Err(Full { max }) => Err(SinkError::ParkedFull {
            id: event.msg_id.clone(),
            lsn: event.commit_lsn,
            key: key_text(event),
            parked: max,
            command: config.parked_command.clone(),
        }),
    }
}

/// The key of `event` as one escaped line, `aggregate_type/aggregate_id` (NULL as `(null)`).
pub(crate) fn key_text(event: &OutboxEvent) -> String {
    let part = |v: &Option<String>| match v {
        None => "(null)".to_owned(),
        Some(s) => crate::text::cut(&s.escape_debug().to_string(), 256).to_owned(),
    };
    format!(
        "{}/{}",
        part(&event.aggregate_type),
        part(&event.aggregate_id)
    )
}

/// `outbox.on_invalid`, the one place it is applied: the event's dead letter (logged), or `Err`
/// to stop. A dead letter being requeued (`requeue_event`) that is still invalid is never a stop:
/// it goes to a new dead letter with an id of its own (`dead-letter:<id>:<request>`).
fn dead_letter(
    config: &SinkConfig,
    parked: &ParkedSet,
    event: &OutboxEvent,
    reason: String,
) -> Result<Sent, SinkError> {
    let requeue = parked.requeue_of_dead_letter();
    if config.stop_on_invalid && requeue.is_none() {
        return Err(SinkError::Invalid {
            id: event.msg_id.clone(),
            lsn: event.commit_lsn,
            reason,
        });
    }
    match requeue {
        None => warn!(id = %event.msg_id, lsn = %event.commit_lsn, %reason, "dead-lettering event"),
        Some(r) => {
            warn!(id = %event.msg_id, request = %r, %reason, "a requeued dead letter is still invalid: dead-lettering it again")
        }
    }
    Ok(Sent::DeadLetter {
        reason,
        shrink: Shrink::Keep,
        requeue: requeue.map(Box::from),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Config, OnInvalid};

    fn config(on_invalid: OnInvalid) -> SinkConfig {
        let mut c = Config::default();
        c.outbox.on_invalid = on_invalid;
        SinkConfig::from_settings(&c.validate().unwrap())
    }

    fn event() -> OutboxEvent {
        OutboxEvent {
            id: Some("e-1".into()),
            aggregate_type: Some("Claim".into()),
            aggregate_id: Some("4711".into()),
            event_type: Some("ClaimApproved".into()),
            payload: bytes::Bytes::from_static(b"{}"),
            headers: vec![],
            commit_lsn: crate::Lsn(0x100),
            index: 0,
            position: crate::position::Position::in_transaction(crate::Lsn(0x100), 0),
            commit_ts: 0,
            original_commit_ts: None,
            problem: None,
            msg_id: "e-1".into(),
            content_type: None,
            data_schema: None,
            schema_check: None,
        }
    }

    fn none() -> ParkedSet {
        ParkedSet::new(10)
    }

    #[test]
    fn an_event_without_a_problem_goes_to_its_subject_whatever_on_invalid_says() {
        for on_invalid in [OnInvalid::DeadLetter, OnInvalid::Stop, OnInvalid::Park] {
            assert!(matches!(
                choose(&config(on_invalid), &mut none(), &event(), None),
                Ok(Sent::Event)
            ));
        }
    }

    #[test]
    fn a_requeued_dead_letter_still_invalid_is_a_new_dead_letter_of_its_own_in_every_mode() {
        for on_invalid in [OnInvalid::DeadLetter, OnInvalid::Stop, OnInvalid::Park] {
            let mut parked = none();
            parked.set_requeue_dead_letter(Some("r-1".into()));
            let c = config(on_invalid);
            let sent = choose(&c, &mut parked, &event(), Some("still bad")).unwrap();
            assert!(
                matches!(&sent, Sent::DeadLetter { reason, requeue: Some(r), .. } if reason == "still bad" && &**r == "r-1"),
                "{on_invalid:?}: {sent:?}"
            );
            assert_eq!(sent.wire_id("e-1"), "dead-letter:e-1:r-1");
            assert!(parked.is_empty(), "{on_invalid:?}: no key parked");
            let refused = refused(&c, &mut parked, &event(), &Sent::Event, "too large".into());
            assert_eq!(
                refused.unwrap().wire_id("e-1"),
                "dead-letter:e-1:r-1",
                "{on_invalid:?}"
            );
            // Valid now: to its subject, with its own id.
            let ok = choose(&c, &mut parked, &event(), None).unwrap();
            assert_eq!(ok.wire_id("e-1"), "e-1");
            parked.set_requeue_dead_letter(None);
            assert!(parked.requeue_of_dead_letter().is_none());
        }
    }

    #[test]
    fn a_requeued_dead_letter_of_a_parked_key_waits_behind_its_poison() {
        let c = config(OnInvalid::Park);
        let mut parked = none();
        choose(&c, &mut parked, &event(), Some("bad")).unwrap();
        parked.set_requeue_dead_letter(Some("r-2".into()));
        let sent = choose(&c, &mut parked, &event(), None).unwrap();
        assert_eq!(sent.wire_id("e-1"), "parked:e-1:r-2");
    }

    #[test]
    fn a_problem_is_a_dead_letter_or_a_stop() {
        let sent = choose(
            &config(OnInvalid::DeadLetter),
            &mut none(),
            &event(),
            Some("bad token"),
        )
        .unwrap();
        assert!(
            matches!(&sent, Sent::DeadLetter { reason, shrink: Shrink::Keep, requeue: None } if reason == "bad token")
        );
        assert_eq!(sent.wire_id("e-1"), "dead-letter:e-1");
        let stop = choose(
            &config(OnInvalid::Stop),
            &mut none(),
            &event(),
            Some("bad token"),
        )
        .unwrap_err();
        assert!(matches!(stop, SinkError::Invalid { reason, .. } if reason == "bad token"));
    }

    #[test]
    fn in_park_mode_a_problem_parks_the_key_and_holds_its_later_events() {
        let c = config(OnInvalid::Park);
        let mut parked = none();
        let sent = choose(&c, &mut parked, &event(), Some("bad schema")).unwrap();
        let Sent::Parked(p) = &sent else {
            panic!("parked: {sent:?}")
        };
        assert_eq!(
            (p.count, p.behind.as_str(), p.reason.as_str()),
            (1, "e-1", "bad schema")
        );
        assert!(p.subject.starts_with("outbox_dead_letter.parked."));
        assert_eq!(sent.wire_id("e-1"), "parked:e-1");
        // The next event of the same key, valid, is held behind the poison, with its reason.
        let mut next = event();
        next.msg_id = "e-2".into();
        let Sent::Parked(q) = choose(&c, &mut parked, &next, None).unwrap() else {
            panic!("held")
        };
        assert_eq!(
            (q.count, q.behind.as_str(), q.reason.as_str()),
            (2, "e-1", "bad schema")
        );
        assert_eq!(q.subject, p.subject);
        // Another key flows.
        let mut other = event();
        other.aggregate_id = Some("4712".into());
        assert!(matches!(
            choose(&c, &mut parked, &other, None),
            Ok(Sent::Event)
        ));
        // NULL is a key of its own, not "".
        other.aggregate_id = None;
        assert!(matches!(
            choose(&c, &mut parked, &other, None),
            Ok(Sent::Event)
        ));
        assert_eq!((parked.len(), parked.events()), (1, 2));
    }

    #[test]
    fn parking_past_max_parked_keys_stops_naming_the_key_the_setting_and_the_command() {
        let mut settings = {
            let mut c = Config::default();
            c.outbox.on_invalid = OnInvalid::Park;
            c.validate().unwrap()
        };
        settings.origin.file = Some("/etc/relay b.toml".into());
        let mut c = SinkConfig::from_settings(&settings);
        c.max_parked_keys = 1;
        let mut parked = ParkedSet::new(1);
        choose(&c, &mut parked, &event(), Some("bad")).unwrap();
        let mut other = event();
        other.aggregate_id = Some("4712\nx".into());
        let e = choose(&c, &mut parked, &other, Some("bad")).unwrap_err();
        let text = e.to_string();
        assert!(matches!(e, SinkError::ParkedFull { .. }));
        assert!(
            text.contains("Claim/4712")
                && text.contains("outbox.max_parked_keys")
                && text.contains("(`outbox-relay --config '/etc/relay b.toml' parked` lists them)")
                && !text.contains('\n'),
            "{text}"
        );
    }

    #[test]
    fn a_refused_dead_letter_keeps_its_reason_and_shrinks_on() {
        let c = config(OnInvalid::Stop);
        let sent = Sent::DeadLetter {
            reason: "bad token".into(),
            shrink: Shrink::DropPayload,
            requeue: None,
        };
        // Already a dead letter: on_invalid was applied when it became one.
        let instead = refused(&c, &mut none(), &event(), &sent, "too large".into()).unwrap();
        assert_eq!(
            (instead.reason(), instead.shrink()),
            (Some("bad token"), Shrink::DropPayload)
        );
        assert!(refused(&c, &mut none(), &event(), &Sent::Event, "too large".into()).is_err());
        let instead = refused(
            &config(OnInvalid::DeadLetter),
            &mut none(),
            &event(),
            &Sent::Event,
            "too large".into(),
        )
        .unwrap();
        assert_eq!(
            (instead.reason(), instead.shrink()),
            (Some("too large"), Shrink::Keep)
        );
        // In park mode a routed event refused for good parks its key.
        let mut parked = none();
        let instead = refused(
            &config(OnInvalid::Park),
            &mut parked,
            &event(),
            &Sent::Event,
            "too large".into(),
        )
        .unwrap();
        assert!(matches!(instead, Sent::Parked(_)));
        assert_eq!(parked.len(), 1);
    }

    #[test]
    fn an_event_sent_again_is_held_only_by_a_poison_before_it() {
        let c = config(OnInvalid::Park);
        let at = |index: u32, id: &str| {
            let mut e = event();
            e.index = index;
            e.position = crate::position::Position::in_transaction(crate::Lsn(0x100), index);
            e.msg_id = id.into();
            e
        };
        let (before, poison, after) = (at(0, "e-0"), at(1, "e-1"), at(2, "e-2"));
        let mut parked = none();
        // e-0 went out as an event; while it waited, e-1 (after it) parked the key.
        let sent = choose(&c, &mut parked, &poison, Some("bad schema")).unwrap();
        assert!(matches!(sent, Sent::Parked(_)));
        // e-0 sent again behind a refusal: it comes before its poison, so it goes to its subject.
        assert!(
            again(&c, &mut parked, &before, &Sent::Event).is_none(),
            "an event before the poison was parked behind it"
        );
        // An event after the poison, sent again, is held behind it.
        assert!(matches!(
            again(&c, &mut parked, &after, &Sent::Event),
            Some(Sent::Parked(_))
        ));
        assert_eq!(parked.events(), 2);
        // A key read back from the stream (no place known) holds everything the session sends.
        let mut rebuilt = none();
        rebuilt
            .park(
                KeyHash::of_event(&before),
                ParkedKey::new("e-9", "bad", "2026-01-01T00:00:00Z".into()),
            )
            .unwrap();
        assert!(again(&c, &mut rebuilt, &before, &Sent::Event).is_some());
    }
}
