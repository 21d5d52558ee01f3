//! Settling the oldest message of the window from its answer: check the ack, count a duplicate
//! (the fence's expectations step back), republish what the stream refused (as a dead letter, down
//! the shrink ladder) or refused behind a duplicate (with the expectation the stream now has), and
//! report the outcome in order. The window's order is kept: what is sent again here is awaited
//! here, before anything behind it is settled.

use async_nats::jetstream::{
    self, ErrorCode,
    context::{PublishError, PublishErrorKind},
};
use tracing::{debug, warn};

use super::envelope::{Sent, routed_subject, send_dead_letter, stamped};
use super::publish::{Ack, Forged};
use super::window::{InFlight, Pending};
use super::{Outcome, Sink, SinkError, batch};
use crate::message::{self, Shrink};

/// JetStream error codes that mean "this message will never be stored as it is"
/// (nats-server `errors.json`): the message exceeds `max_msg_size` (10054), its headers are too
/// large (10097).
fn refused_for_good(e: &PublishError) -> Option<String> {
    if e.kind() != PublishErrorKind::Other {
        return None;
    }
    let je = std::error::Error::source(e)?.downcast_ref::<jetstream::Error>()?;
    match je.error_code() {
        ErrorCode::STREAM_MESSAGE_EXCEEDS_MAXIMUM | ErrorCode::STREAM_HEADER_EXCEEDS_MAXIMUM => {
            Some(je.to_string())
        }
        _ => None,
    }
}

/// For a refusal by the fence (10071), the stream's last sequence when it is past `expected` (it
/// says "wrong last sequence: N"): something else took a sequence in the message's place. A
/// refusal whose number cannot be read counts as past: only the stream being behind (a duplicate
/// or a lost publish before the message) may be repaired by sending again.
fn stored_past(e: &PublishError, expected: Option<u64>) -> Option<u64> {
    if e.kind() != PublishErrorKind::WrongLastSequence {
        return None;
    }
    let expected = expected?;
    let text = std::error::Error::source(e)
        .and_then(|s| s.downcast_ref::<jetstream::Error>())
        .map(ToString::to_string)
        .unwrap_or_default();
    let last = text
        .split(" (code")
        .next()
        .and_then(|d| d.rsplit(':').next())
        .and_then(|n| n.trim().parse::<u64>().ok());
    match last {
        Some(last) if last <= expected => None,
        Some(last) => Some(last),
        None => Some(u64::MAX),
    }
}

impl Sink {
    /// Settles the oldest message, whose answer is `answer`, and reports it (with its batch).
    pub(super) async fn settle_front(
        &mut self,
        answer: Result<Ack, PublishError>,
    ) -> Result<(), SinkError> {
        let Some(Pending::Sent(mut item)) = self.window.pop_front() else {
            return Err(SinkError::Stopped);
        };
        self.deadline = None;
        let outcome = if item.members.is_some() {
            self.settle_batch(&item, answer).await?
        } else {
            self.settle_one(&mut item, answer).await?
        };
        self.report(item, outcome);
        Ok(())
    }

    /// The ack of a batch's commit settles the whole batch.
    async fn settle_batch(
        &mut self,
        item: &InFlight,
        answer: Result<Ack, PublishError>,
    ) -> Result<Outcome, SinkError> {
        match answer {
            // A batch cannot be a duplicate: its messages carry no Nats-Msg-Id, the only thing
            // JetStream deduplicates by. An answer that says so is planted (or not JetStream's),
            // and it would confirm a batch nobody stored.
            Ok(ack) if ack.duplicate => Err(SinkError::Publish {
                id: item.event.msg_id.clone(),
                source: PublishError::with_source(
                    PublishErrorKind::Other,
                    Forged {
                        stream: self.config.stream.clone(),
                        why: format!(
                            "it says the atomic batch committed by message {} is a duplicate of sequence {}, \
                             but a batch carries no Nats-Msg-Id to be a duplicate by",
                            item.event.msg_id, ack.sequence
                        ),
                    },
                ),
            }),
            Ok(ack) => {
                self.check(item, ack).await?;
                // Held until the stream shows the commit message at that sequence.
                self.stored_new = Some((ack.sequence, item.event.position));
                if let Some(f) = self.fence.as_mut() {
                    f.stored(ack.sequence, None);
                }
                Ok(batch::outcome(&item.sent))
            }
            Err(e) if let Some(last) = stored_past(&e, item.expected) => {
                Err(SinkError::StoredPastRefused {
                    id: item.event.msg_id.clone(),
                    expected: item.expected.unwrap_or(0),
                    last,
                })
            }
            // Every message was measured against the stream's limit as the session read it, so
            // the limit was lowered since: the next session reads it and dead-letters what is
            // over, in its place (one restart).
            Err(e) if let Some(refusal) = refused_for_good(&e) => Err(SinkError::BatchRefused {
                id: item.event.msg_id.clone(),
                refusal,
            }),
            Err(e) if batch::fence_refused(&e) => Err(SinkError::FenceBroken {
                id: item.event.msg_id.clone(),
                expected: item.expected.unwrap_or(0),
                source: e,
            }),
            Err(source) => Err(SinkError::Publish {
                id: item.event.msg_id.clone(),
                source,
            }),
        }
    }

    /// Decides the outcome of a single message from its answer, sending it again as long as that
    /// can still store it.
    async fn settle_one(
        &mut self,
        item: &mut InFlight,
        mut answer: Result<Ack, PublishError>,
    ) -> Result<Outcome, SinkError> {
        let timeout = self.config.ack_timeout;
        // Republished once behind the known tail already (see below).
        let mut refenced = false;
        loop {
            let e = match answer {
                Ok(ack) => {
                    self.check(item, ack).await?;
                    if ack.duplicate {
                        // `check` read the stream for it already.
                        self.last_sequence = self.last_sequence.max(ack.sequence);
                        self.duplicate(item);
                    } else {
                        // Held until the stream shows it (or a later new store) at its sequence.
                        self.stored_new = Some((ack.sequence, item.event.position));
                        if let Some(f) = self.fence.as_mut() {
                            // A dead letter carries the event's `Nats-Msg-Id` too.
                            f.stored(ack.sequence, Some(&item.event.msg_id));
                        }
                    }
                    // A dead letter JetStream drops by its id was stored before (an earlier
                    // session's): a duplicate like any other, neither a new dead letter nor
                    // progress that could reset the relay's backoff.
                    return Ok(match &item.sent {
                        _ if ack.duplicate => Outcome::Stored { duplicate: true },
                        Sent::DeadLetter { reason, .. } => Outcome::DeadLetter {
                            reason: reason.clone(),
                        },
                        Sent::Event => Outcome::Stored { duplicate: false },
                    });
                }
                Err(e) => e,
            };
            let token = if let Some(refusal) = refused_for_good(&e) {
                self.refused(item, refusal).await?
            } else if let Some(last) = stored_past(&e, item.expected) {
                return Err(SinkError::StoredPastRefused {
                    id: item.event.msg_id.clone(),
                    expected: item.expected.unwrap_or(0),
                    last,
                });
            } else if matches!(
                e.kind(),
                PublishErrorKind::WrongLastSequence | PublishErrorKind::WrongLastMessageId
            ) {
                // Refused behind a duplicate: either sent with an expectation that counted the
                // duplicate (acknowledged after it was sent), or sent with the right one but
                // arriving before the messages ahead of it were republished, or chained to the id
                // of a message that turned out a duplicate (10070 with the right sequence: the
                // stream's last message is then the one the acks named). Either way, send it
                // once more behind what the stream is known to hold; a second refusal there means
                // the stream really is not where the relay left it.
                match (item.expected, self.fence.as_ref(), refenced) {
                    (Some(_), Some(f), false) => {
                        let behind = f.behind_last_stored();
                        debug!(id = %item.event.msg_id, expected = ?item.expected, last = behind.seq, last_id = ?behind.id, "republishing behind a duplicate");
                        item.expected = Some(behind.seq);
                        item.expected_id = behind.id;
                        refenced = true;
                        self.resend(item).await?
                    }
                    _ => {
                        return Err(SinkError::FenceBroken {
                            id: item.event.msg_id.clone(),
                            expected: item.expected.unwrap_or(0),
                            source: e,
                        });
                    }
                }
            } else {
                return Err(SinkError::Publish {
                    id: item.event.msg_id.clone(),
                    source: e,
                });
            };
            answer = match self.publisher.wait(token, timeout).await {
                Some(a) => a,
                None => return Err(SinkError::AckTimeout(timeout, item.event.msg_id.clone())),
            };
        }
    }

    /// Checks an ack beyond its form (see `publish.rs`): on a fenced stream a new message takes
    /// exactly the sequence after the one it expected; a duplicate names a stored message with the
    /// same id. Anything else is not JetStream's answer, and ends the session before it can
    /// confirm anything.
    async fn check(&self, item: &InFlight, ack: Ack) -> Result<(), SinkError> {
        let forged = |why: String| SinkError::Publish {
            id: item.event.msg_id.clone(),
            source: PublishError::with_source(
                PublishErrorKind::Other,
                Forged {
                    stream: self.config.stream.clone(),
                    why,
                },
            ),
        };
        if ack.duplicate {
            return self
                .publisher
                .holds(ack.sequence, &item.event.msg_id, self.last_sequence)
                .await
                .map_err(forged);
        }
        match item.expected {
            Some(e) if ack.sequence != e + 1 => Err(forged(format!(
                "it stores message {} at sequence {}, but the stream's last sequence had to be {e}",
                item.event.msg_id, ack.sequence
            ))),
            _ => Ok(()),
        }
    }

    /// JetStream dropped the message as a duplicate of one it holds. On a fenced stream that costs
    /// no sequence: later expectations step back by one.
    fn duplicate(&mut self, item: &InFlight) {
        match (self.fence.as_mut(), item.expected) {
            (Some(f), Some(_)) => {
                f.duplicate();
                warn!(id = %item.event.msg_id, lsn = %item.event.commit_lsn, "event id already used by an earlier event: JetStream dropped it as a duplicate");
            }
            _ => debug!(id = %item.event.msg_id, "duplicate dropped by JetStream"),
        }
    }

    /// The stream refused `item` for good: dead-letter it, or a smaller dead letter than before.
    async fn refused(&mut self, item: &mut InFlight, refusal: String) -> Result<u64, SinkError> {
        let (reason, from) = match &item.sent {
            Sent::Event => {
                let reason = format!("the stream refused the message: {refusal}");
                self.config.on_invalid(&item.event, &reason)?;
                // The hot path keeps no copy of a routed event's subject: render it again.
                item.subject = routed_subject(
                    &self.config,
                    &item.event,
                    &item.sent,
                    std::mem::take(&mut item.subject),
                );
                (reason, Shrink::Keep)
            }
            Sent::DeadLetter { reason, shrink } => {
                if shrink.smaller().is_none() {
                    return Err(SinkError::DeadLetterRefused {
                        id: item.event.msg_id.clone(),
                        lsn: item.event.commit_lsn,
                        reason: reason.clone(),
                        refusal,
                    });
                }
                (reason.clone(), *shrink)
            }
        };
        let (ack, shrink) = send_dead_letter(
            &mut self.publisher,
            &self.config,
            &item.event,
            (!item.subject.is_empty()).then_some(item.subject.as_str()),
            &reason,
            (item.expected, item.expected_id.as_deref()),
            from,
        )
        .await?;
        item.sent = Sent::DeadLetter { reason, shrink };
        Ok(ack)
    }

    /// Sends `item` again as it was last sent (event or dead letter), with its current expectation.
    async fn resend(&mut self, item: &InFlight) -> Result<u64, SinkError> {
        let out = match &item.sent {
            Sent::Event => message::build_as(
                &item.event,
                &self.config.template,
                &self.config.dead_letter_subject,
                self.config.cloudevents.as_ref(),
                message::IdHeader::MsgId,
                self.config.descriptive,
            ),
            Sent::DeadLetter { reason, shrink } => message::dead_letter(
                &item.event,
                &self.config.dead_letter_subject,
                reason,
                (!item.subject.is_empty()).then_some(item.subject.as_str()),
                *shrink,
            ),
        };
        let (target, headers, payload) = stamped(
            out,
            &item.event,
            item.expected,
            item.expected_id.as_deref(),
            self.config.history.as_deref(),
        );
        self.publisher
            .send(target, headers, payload)
            .await
            .map_err(|source| SinkError::Publish {
                id: item.event.msg_id.clone(),
                source,
            })
    }
}
