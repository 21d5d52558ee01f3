//! Where an event goes: the one place that decides it. An event goes to its own subject, or, when
//! it cannot be published as it is (a problem the outbox stage recorded, a subject that does not
//! render, a message too large for the server or the stream, a refusal by the stream for good),
//! `outbox.on_invalid` decides between its dead letter and a stop ([`choose`], [`refused`]). Every
//! path asks here: a single message (`envelope.rs`), a member of an atomic batch (`batch.rs`,
//! `batch/fit.rs`), a message the stream refused later (`settle.rs`). What was decided is kept with
//! the message in flight ([`Sent`]), so it can be sent again the same way.
//!
//! Parking (a key whose event could not be published holds every later event of that key on a
//! parking subject) is a third destination, and belongs here: [`choose`] and [`refused`] are what
//! it changes.

use tracing::warn;

use super::config::SinkConfig;
use super::error::SinkError;
use crate::event::OutboxEvent;
use crate::message::Shrink;

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
    },
}

/// The destination of `event`, whose message was built with `problem` (`Some`: why it cannot be
/// published as it is, and its message is the dead letter): its own subject, or its dead letter
/// (`outbox.on_invalid = "dead_letter"`, logged); `Err` to stop (`"stop"`).
#[inline]
pub(crate) fn choose(
    config: &SinkConfig,
    event: &OutboxEvent,
    problem: Option<&str>,
) -> Result<Sent, SinkError> {
    match problem {
        None => Ok(Sent::Event),
        Some(reason) => {
            dead_letter(config, event, reason)?;
            Ok(Sent::DeadLetter {
                reason: reason.to_owned(),
                shrink: Shrink::Keep,
            })
        }
    }
}

/// The message sent for `event` as `sent` cannot be stored (`reason`: too large, or refused by the
/// stream for good): the reason its dead letter carries and the step of the shrink ladder to go on
/// below. A routed event becomes its dead letter (`outbox.on_invalid` permitting: `Err` to stop);
/// a dead letter keeps its first reason and shrinks further.
pub(crate) fn refused(
    config: &SinkConfig,
    event: &OutboxEvent,
    sent: &Sent,
    reason: String,
) -> Result<(String, Shrink), SinkError> {
    match sent {
        Sent::Event => {
            dead_letter(config, event, &reason)?;
            Ok((reason, Shrink::Keep))
        }
        Sent::DeadLetter { reason, shrink } => Ok((reason.clone(), *shrink)),
    }
}

/// `outbox.on_invalid`, the one place it is applied: `Ok` means dead-letter the event (and it is
/// logged), `Err` means stop.
fn dead_letter(config: &SinkConfig, event: &OutboxEvent, reason: &str) -> Result<(), SinkError> {
    if config.stop_on_invalid {
        return Err(SinkError::Invalid {
            id: event.msg_id.clone(),
            lsn: event.commit_lsn,
            reason: reason.to_owned(),
        });
    }
    warn!(id = %event.msg_id, lsn = %event.commit_lsn, %reason, "dead-lettering event");
    Ok(())
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
            problem: None,
            msg_id: "e-1".into(),
            content_type: None,
            data_schema: None,
            schema_check: None,
        }
    }

    #[test]
    fn an_event_without_a_problem_goes_to_its_subject_whatever_on_invalid_says() {
        for on_invalid in [OnInvalid::DeadLetter, OnInvalid::Stop] {
            assert!(matches!(
                choose(&config(on_invalid), &event(), None),
                Ok(Sent::Event)
            ));
        }
    }

    #[test]
    fn a_problem_is_a_dead_letter_or_a_stop() {
        let sent = choose(&config(OnInvalid::DeadLetter), &event(), Some("bad token")).unwrap();
        assert!(
            matches!(&sent, Sent::DeadLetter { reason, shrink: Shrink::Keep } if reason == "bad token")
        );
        let stop = choose(&config(OnInvalid::Stop), &event(), Some("bad token")).unwrap_err();
        assert!(matches!(stop, SinkError::Invalid { reason, .. } if reason == "bad token"));
    }

    #[test]
    fn a_refused_dead_letter_keeps_its_reason_and_shrinks_on() {
        let c = config(OnInvalid::Stop);
        let sent = Sent::DeadLetter {
            reason: "bad token".into(),
            shrink: Shrink::DropPayload,
        };
        // Already a dead letter: on_invalid was applied when it became one.
        let (reason, from) = refused(&c, &event(), &sent, "too large".into()).unwrap();
        assert_eq!((reason.as_str(), from), ("bad token", Shrink::DropPayload));
        assert!(refused(&c, &event(), &Sent::Event, "too large".into()).is_err());
        let (reason, from) = refused(
            &config(OnInvalid::DeadLetter),
            &event(),
            &Sent::Event,
            "too large".into(),
        )
        .unwrap();
        assert_eq!((reason.as_str(), from), ("too large", Shrink::Keep));
    }
}
