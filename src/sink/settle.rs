//! Settling the oldest message of the window from its answer, as a pure decision ([`decide`]):
//! stored (and how), a duplicate to check against the stream, a refusal for good (its dead letter
//! goes in its place, down the shrink ladder), a refusal behind a duplicate (sent once more with
//! the expectation the stream now has), an answer that cannot be JetStream's, or the end of the
//! session. No I/O and no clock: the sink carries the decision out (`Flight::settle_front`), and
//! every rule is unit-tested below without a publisher, for single messages and batch commits
//! alike. The window's order is kept by the sink: what it sends again is awaited before anything
//! behind it is settled.

use async_nats::jetstream::ErrorCode;

use super::destination::Sent;
use super::error::SinkError;
use super::fence::{Expect, Fence};
use super::outcome::Outcome;
use super::publish::{Answer, NotAcked};
use super::window::{InFlight, stored_outcome};
use crate::nats::{NatsError, NatsErrorKind};

/// What to do with the oldest message, given its answer.
#[derive(Debug)]
pub(super) enum Decision {
    /// Stored as a new message at `sequence`: report `outcome` (the proof gate holds it until the
    /// stream shows it).
    Stored {
        /// The stream sequence the ack named.
        sequence: u64,
        /// How the message ended.
        outcome: Outcome,
    },
    /// JetStream says it duplicates the message at `sequence`: report it a duplicate once the
    /// stream shows that message is the same event (`Publisher::holds`).
    Duplicate {
        /// The sequence of the message it duplicates.
        sequence: u64,
    },
    /// The stream refused it for good (`refusal`, JetStream's words): send its dead letter in its
    /// place, one step further down the shrink ladder than it was.
    DeadLetter {
        /// JetStream's refusal.
        refusal: String,
    },
    /// Refused behind a duplicate: send it once more, expecting what the stream is known to hold.
    Resend {
        /// The expectation to send it with.
        expect: Expect,
    },
    /// The answer cannot be JetStream's: why.
    Forged(String),
    /// The session ends with this error.
    Fail(SinkError),
}

impl Decision {
    /// Whether carrying it out waits (for JetStream's answer to what it sends again, or for the
    /// stream's word on a duplicate): a wait the sink's caller may drop half-way.
    pub(super) fn waits(&self) -> bool {
        matches!(
            self,
            Decision::Duplicate { .. } | Decision::DeadLetter { .. } | Decision::Resend { .. }
        )
    }
}

/// Decides what the answer to `item`, the oldest message, means. `fence`: the session's fence, if
/// the stream is fenced; `resent`: `item` was sent once more behind a duplicate already.
pub(super) fn decide(
    item: &InFlight,
    answer: Answer,
    fence: Option<&Fence>,
    resent: bool,
) -> Decision {
    let e = match answer {
        Ok(ack) if item.members.is_some() && ack.duplicate => {
            // A batch cannot be a duplicate: its messages carry no Nats-Msg-Id, the only thing
            // JetStream deduplicates by. An answer that says so is planted (or not JetStream's),
            // and it would confirm a batch nobody stored.
            return Decision::Forged(format!(
                "it says the atomic batch committed by message {} is a duplicate of sequence {}, but a batch \
                 carries no Nats-Msg-Id to be a duplicate by",
                item.event.msg_id, ack.sequence
            ));
        }
        Ok(ack) if ack.duplicate => {
            return Decision::Duplicate {
                sequence: ack.sequence,
            };
        }
        Ok(ack) => return stored(item, ack.sequence),
        Err(NotAcked::Forged(source)) => {
            return Decision::Fail(SinkError::Forged {
                id: item.event.msg_id.clone(),
                source,
            });
        }
        Err(NotAcked::Nats(e)) => e,
    };
    if item.members.is_some() {
        return Decision::Fail(batch_refused(item, e));
    }
    refused(item, e, fence, resent)
}

/// A new store at `sequence`: on a fenced stream it must take exactly the sequence after the one
/// it expected. Anything else is not JetStream's answer, and ends the session before it can
/// confirm anything.
fn stored(item: &InFlight, sequence: u64) -> Decision {
    match item.expected {
        Some(e) if sequence != e + 1 => Decision::Forged(format!(
            "it stores message {} at sequence {sequence}, but the stream's last sequence had to be {e}",
            item.event.msg_id
        )),
        _ => Decision::Stored {
            sequence,
            outcome: stored_outcome(&item.sent),
        },
    }
}

/// A single message the stream (or the seam) refused: its dead letter, a resend behind a
/// duplicate, or the end of the session.
fn refused(item: &InFlight, e: NatsError, fence: Option<&Fence>, resent: bool) -> Decision {
    let id = || item.event.msg_id.clone();
    if let Some(refusal) = refused_for_good(&e) {
        if let Sent::DeadLetter { reason, shrink, .. } = &item.sent
            && shrink.smaller().is_none()
        {
            return Decision::Fail(SinkError::DeadLetterRefused {
                id: id(),
                lsn: item.event.commit_lsn,
                reason: reason.clone(),
                refusal,
            });
        }
        return Decision::DeadLetter { refusal };
    }
    if let Some(last) = stored_past(&e, item.expected) {
        return Decision::Fail(SinkError::StoredPastRefused {
            id: id(),
            expected: item.expected.unwrap_or(0),
            last,
        });
    }
    if !refused_by_the_fence(&e) {
        return Decision::Fail(SinkError::Publish {
            id: id(),
            source: e,
        });
    }
    // Refused behind a duplicate: either sent with an expectation that counted the duplicate
    // (acknowledged after it was sent), or sent with the right one but arriving before the
    // messages ahead of it were republished, or chained to the id of a message that turned out a
    // duplicate (10070 with the right sequence: the stream's last message is then the one the acks
    // named). Either way, send it once more behind what the stream is known to hold; a second
    // refusal there means the stream really is not where the relay left it.
    match (item.expected, fence, resent) {
        (Some(_), Some(f), false) => Decision::Resend {
            expect: f.behind_last_stored(),
        },
        _ => Decision::Fail(SinkError::FenceBroken {
            id: id(),
            expected: item.expected.unwrap_or(0),
            source: e,
        }),
    }
}

/// A batch commit the stream (or the seam) refused: the session ends, and the batch's error says
/// why.
fn batch_refused(item: &InFlight, e: NatsError) -> SinkError {
    let id = item.event.msg_id.clone();
    if let Some(last) = stored_past(&e, item.expected) {
        return SinkError::StoredPastRefused {
            id,
            expected: item.expected.unwrap_or(0),
            last,
        };
    }
    // Every message was measured against the stream's limit as the session read it, so the limit
    // was lowered since: the next session reads it and dead-letters what is over, in its place
    // (one restart).
    if let Some(refusal) = refused_for_good(&e) {
        return SinkError::BatchRefused { id, refusal };
    }
    // A batch's first message carries the fence's sequence, and the batch no id expectation.
    if e.code() == Some(ErrorCode::STREAM_WRONG_LAST_SEQUENCE) {
        return SinkError::FenceBroken {
            id,
            expected: item.expected.unwrap_or(0),
            source: e,
        };
    }
    SinkError::Publish { id, source: e }
}

/// JetStream error codes that mean "this message will never be stored as it is"
/// (nats-server `errors.json`): the message exceeds `max_msg_size` (10054), its headers are too
/// large (10097). The refusal as JetStream put it.
fn refused_for_good(e: &NatsError) -> Option<String> {
    match e.code()? {
        ErrorCode::STREAM_MESSAGE_EXCEEDS_MAXIMUM | ErrorCode::STREAM_HEADER_EXCEEDS_MAXIMUM => {
            Some(e.cause_text())
        }
        _ => None,
    }
}

/// Whether the fence refused it: its expected last sequence (10071) or message id (10070) is not
/// the stream's.
fn refused_by_the_fence(e: &NatsError) -> bool {
    matches!(
        e.code(),
        Some(ErrorCode::STREAM_WRONG_LAST_SEQUENCE | ErrorCode::STREAM_WRONG_LAST_MESSAGE_ID)
    )
}

/// For a refusal by the fence (10071), the stream's last sequence when it is past `expected`:
/// something else took a sequence in the message's place. A refusal that names no number counts as
/// past: only the stream being behind (a duplicate or a lost publish before the message) may be
/// repaired by sending again.
fn stored_past(e: &NatsError, expected: Option<u64>) -> Option<u64> {
    let NatsErrorKind::Refused {
        code: ErrorCode::STREAM_WRONG_LAST_SEQUENCE,
        last_sequence,
    } = e.kind()
    else {
        return None;
    };
    let expected = expected?;
    match last_sequence {
        Some(last) if last <= expected => None,
        Some(last) => Some(last),
        None => Some(u64::MAX),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Lsn;
    use crate::message::Shrink;
    use crate::position::Position;
    use crate::sink::error::Forged;
    use crate::sink::publish::Ack;
    use crate::sink::replay::Replay;
    use crate::tail::tests::tail;

    fn item(expected: Option<u64>, sent: Sent, batch: bool) -> InFlight {
        InFlight {
            seq: 0,
            ack: 0,
            event: Box::new(crate::event::OutboxEvent {
                id: Some("e-1".into()),
                aggregate_type: Some("Claim".into()),
                aggregate_id: Some("4711".into()),
                event_type: Some("ClaimApproved".into()),
                payload: bytes::Bytes::from_static(b"{}"),
                headers: vec![],
                commit_lsn: Lsn(0x100),
                index: 0,
                position: Position::in_transaction(Lsn(0x100), 0),
                commit_ts: 0,
                original_commit_ts: None,
                problem: None,
                msg_id: "e-1".into(),
                content_type: None,
                data_schema: None,
                schema_check: None,
            }),
            subject: String::new(),
            sent,
            expected,
            expected_id: None,
            size: 0,
            members: batch.then(Vec::new),
            span: None,
        }
    }

    fn ack(sequence: u64, duplicate: bool) -> Answer {
        Ok(Ack {
            sequence,
            duplicate,
        })
    }

    fn refusal(code: u64, last_sequence: Option<u64>, text: &str) -> Answer {
        Err(NotAcked::Nats(NatsError::new(
            NatsErrorKind::Refused {
                code: ErrorCode(code),
                last_sequence,
            },
            text.to_owned(),
        )))
    }

    fn dead_letter(shrink: Shrink) -> Sent {
        Sent::DeadLetter {
            reason: "bad token".into(),
            shrink,
            requeue: None,
        }
    }

    /// A fence over a stream whose last sequence is 9, which stored "e-0" at 9 in this session.
    fn fence() -> Fence {
        let mut f = Fence::new(&tail(200, 1, "b"), Replay::publishing());
        f.stored(9, Some("e-0"));
        f
    }

    #[test]
    fn an_ack_at_the_expected_sequence_is_a_new_store_of_what_was_sent() {
        let d = decide(
            &item(Some(9), Sent::Event, false),
            ack(10, false),
            None,
            false,
        );
        assert!(matches!(
            d,
            Decision::Stored {
                sequence: 10,
                outcome: Outcome::Stored { duplicate: false }
            }
        ));
        let d = decide(
            &item(None, dead_letter(Shrink::Keep), false),
            ack(3, false),
            None,
            false,
        );
        assert!(
            matches!(d, Decision::Stored { outcome: Outcome::DeadLetter { reason }, .. } if reason == "bad token")
        );
    }

    #[test]
    fn an_ack_at_another_sequence_than_expected_is_forged() {
        let d = decide(
            &item(Some(9), Sent::Event, false),
            ack(12, false),
            None,
            false,
        );
        assert!(
            matches!(&d, Decision::Forged(why) if why.contains("at sequence 12, but the stream's last sequence had to be 9")),
            "{d:?}"
        );
        // A batch commit too.
        let d = decide(
            &item(Some(9), Sent::Event, true),
            ack(12, false),
            None,
            false,
        );
        assert!(matches!(d, Decision::Forged(_)), "{d:?}");
    }

    #[test]
    fn a_duplicate_is_checked_but_a_batch_is_never_one() {
        let d = decide(
            &item(Some(9), Sent::Event, false),
            ack(4, true),
            None,
            false,
        );
        assert!(matches!(d, Decision::Duplicate { sequence: 4 }), "{d:?}");
        let d = decide(&item(Some(9), Sent::Event, true), ack(4, true), None, false);
        assert!(
            matches!(&d, Decision::Forged(why) if why.contains("a batch carries no Nats-Msg-Id")),
            "{d:?}"
        );
    }

    #[test]
    fn a_message_too_large_for_the_stream_goes_down_the_dead_letter_ladder() {
        let too_large = || refusal(10054, None, "message size exceeds maximum allowed");
        let d = decide(&item(Some(9), Sent::Event, false), too_large(), None, false);
        assert!(
            matches!(&d, Decision::DeadLetter { refusal } if refusal == "message size exceeds maximum allowed"),
            "{d:?}"
        );
        let d = decide(
            &item(Some(9), dead_letter(Shrink::DropPayload), false),
            refusal(10097, None, "headers too large"),
            None,
            false,
        );
        assert!(matches!(d, Decision::DeadLetter { .. }), "{d:?}");
        // The minimal dead letter refused: nothing smaller is left.
        let d = decide(
            &item(Some(9), dead_letter(Shrink::Minimal), false),
            too_large(),
            None,
            false,
        );
        assert!(
            matches!(d, Decision::Fail(SinkError::DeadLetterRefused { .. })),
            "{d:?}"
        );
        // A batch measured its members: a refusal for size means the limit changed.
        let d = decide(&item(Some(9), Sent::Event, true), too_large(), None, false);
        assert!(
            matches!(d, Decision::Fail(SinkError::BatchRefused { .. })),
            "{d:?}"
        );
    }

    #[test]
    fn a_refusal_past_the_expected_sequence_ends_the_session_with_the_last_sequence() {
        for batch in [false, true] {
            let d = decide(
                &item(Some(9), Sent::Event, batch),
                refusal(10071, Some(11), "wrong last sequence: 11"),
                Some(&fence()),
                false,
            );
            assert!(
                matches!(
                    d,
                    Decision::Fail(SinkError::StoredPastRefused {
                        expected: 9,
                        last: 11,
                        ..
                    })
                ),
                "{d:?}"
            );
        }
        // No number named: counted as past.
        let d = decide(
            &item(Some(9), Sent::Event, false),
            refusal(10071, None, "wrong last sequence"),
            Some(&fence()),
            false,
        );
        assert!(
            matches!(
                d,
                Decision::Fail(SinkError::StoredPastRefused { last: u64::MAX, .. })
            ),
            "{d:?}"
        );
    }

    #[test]
    fn a_refusal_behind_a_duplicate_is_sent_once_more_behind_what_is_stored() {
        for code in [10071, 10070] {
            let d = decide(
                &item(Some(9), Sent::Event, false),
                refusal(code, Some(8), "wrong last"),
                Some(&fence()),
                false,
            );
            assert!(
                matches!(&d, Decision::Resend { expect } if expect.seq == 9 && expect.id.as_deref() == Some("e-0")),
                "{code}: {d:?}"
            );
            // Refused there too: the stream is not where the relay left it.
            let d = decide(
                &item(Some(9), Sent::Event, false),
                refusal(code, Some(8), "wrong last"),
                Some(&fence()),
                true,
            );
            assert!(
                matches!(d, Decision::Fail(SinkError::FenceBroken { .. })),
                "{d:?}"
            );
        }
        // A batch is never sent again: the fence is broken.
        let d = decide(
            &item(Some(9), Sent::Event, true),
            refusal(10071, Some(8), "wrong last sequence: 8"),
            Some(&fence()),
            false,
        );
        assert!(
            matches!(d, Decision::Fail(SinkError::FenceBroken { .. })),
            "{d:?}"
        );
    }

    #[test]
    fn anything_else_ends_the_session_as_it_is() {
        let closed = || Err(NotAcked::Nats(NatsError::of(NatsErrorKind::Closed)));
        for batch in [false, true] {
            let d = decide(&item(Some(9), Sent::Event, batch), closed(), None, false);
            assert!(
                matches!(&d, Decision::Fail(SinkError::Publish { source, .. }) if source.kind() == NatsErrorKind::Closed),
                "{d:?}"
            );
            let forged = Err(NotAcked::Forged(Forged {
                stream: "OUTBOX".into(),
                why: "it names no stream".into(),
            }));
            let d = decide(&item(Some(9), Sent::Event, batch), forged, None, false);
            assert!(
                matches!(d, Decision::Fail(SinkError::Forged { .. })),
                "{d:?}"
            );
        }
        // Without the fence a 10071 cannot come; if it does, nothing repairs it.
        let d = decide(
            &item(None, Sent::Event, false),
            refusal(10071, Some(8), "wrong last sequence: 8"),
            None,
            false,
        );
        assert!(
            matches!(d, Decision::Fail(SinkError::FenceBroken { .. })),
            "{d:?}"
        );
    }
}
