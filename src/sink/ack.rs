//! The ack task: awaits each publish's ack in publish order and reports it, dead-letters what the
//! stream refuses for good, and repairs the fence behind a duplicate (see [`super::fence`]).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use async_nats::jetstream::{
    self,
    context::{PublishError, PublishErrorKind},
};
use tokio::sync::mpsc;
use tracing::{debug, warn};

use super::batch::{self, Role};
use super::publish::{Ack, Forged, Publisher, Replies};
use super::{
    Acked, InFlight, Outcome, Queued, Sent, SinkConfig, SinkError, routed_subject,
    send_dead_letter, stamped,
};
use crate::message;

pub(super) struct AckTask {
    /// For what the ack task sends itself: republishes behind a duplicate, dead letters.
    pub publisher: Publisher,
    /// The acks of everything the session's sink sends.
    pub replies: Replies,
    pub config: Arc<SinkConfig>,
    /// With a fenced stream: the stream's last sequence at the start, and the duplicate counter the
    /// publishing side subtracts from its expectations.
    pub fence: Option<(u64, Arc<AtomicU64>)>,
}

/// JetStream error codes that mean "this message will never be stored as it is"
/// (nats-server `errors.json`): 10054 message size exceeds `max_msg_size`, 10097 headers too large.
fn refused_for_good(e: &jetstream::context::PublishError) -> Option<String> {
    if e.kind() != PublishErrorKind::Other {
        return None;
    }
    let je = std::error::Error::source(e)?.downcast_ref::<jetstream::Error>()?;
    match je.error_code().0 {
        10054 | 10097 => Some(je.to_string()),
        _ => None,
    }
}

/// Reports one ack; the window place is given back after it is reported (drop of the permits).
/// False when nobody listens any more.
fn report(
    acks: &mpsc::UnboundedSender<Result<Acked, SinkError>>,
    item: InFlight,
    result: Result<Outcome, SinkError>,
) -> bool {
    let InFlight {
        seq,
        event,
        _permits,
        ..
    } = item;
    let msg = result.map(|outcome| Acked {
        seq,
        outcome,
        commit_ts: event.commit_ts,
    });
    let ok = acks.send(msg).is_ok();
    drop(_permits);
    ok
}

impl AckTask {
    pub async fn run(
        mut self,
        mut rx: mpsc::UnboundedReceiver<Queued>,
        acks: mpsc::UnboundedSender<Result<Acked, SinkError>>,
    ) {
        // The last sequence the stream is known to hold (fenced streams).
        let mut last_stored = self.fence.as_ref().map(|(base, _)| *base);
        // Members of the atomic batch whose commit has not been settled yet.
        let mut members: Vec<InFlight> = Vec::new();
        // Every item that is ready per wake-up: one channel wake-up per burst, not per message.
        let mut ready = Vec::with_capacity(256);
        while rx.recv_many(&mut ready, 256).await > 0 {
            for queued in ready.drain(..) {
                let mut item = match queued {
                    Queued::Sent(item) => item,
                    Queued::Stored { first, count } => {
                        for seq in first..first + count {
                            let ack = Acked {
                                seq,
                                outcome: Outcome::AlreadyStored,
                                commit_ts: 0,
                            };
                            if acks.send(Ok(ack)).is_err() {
                                return;
                            }
                        }
                        continue;
                    }
                };
                let result = match item.batch {
                    Some(Role::Member) => {
                        members.push(item);
                        continue;
                    }
                    Some(Role::Commit) => {
                        match self.settle_batch(&mut item, &mut last_stored).await {
                            Ok(()) => {
                                for m in members.drain(..) {
                                    let outcome = batch::outcome(&m.sent);
                                    if !report(&acks, m, Ok(outcome)) {
                                        return;
                                    }
                                }
                                Ok(batch::outcome(&item.sent))
                            }
                            Err(e) => Err(e),
                        }
                    }
                    None => self.settle(&mut item, &mut last_stored).await,
                };
                let failed = result.is_err();
                // After a failure nothing later may be reported: the relay restarts.
                if !report(&acks, item, result) || failed {
                    return;
                }
            }
        }
        debug!("ack task done");
    }

    /// Awaits the ack of a batch's commit: it settles the whole batch.
    async fn settle_batch(
        &mut self,
        item: &mut InFlight,
        last_stored: &mut Option<u64>,
    ) -> Result<(), SinkError> {
        let Some(ack) = item.ack.take() else {
            return Ok(());
        };
        let timeout = self.config.ack_timeout;
        let Some(result) = self.replies.ack(ack, timeout).await else {
            return Err(SinkError::AckTimeout(timeout, item.event.msg_id.clone()));
        };
        match result {
            Ok(pub_ack) => {
                // A batch is never a duplicate (its messages carry no Nats-Msg-Id).
                self.check(item, pub_ack).await?;
                if last_stored.is_some() {
                    *last_stored = Some(pub_ack.sequence);
                }
                Ok(())
            }
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

    /// Awaits the ack of `item` and decides its outcome.
    async fn settle(
        &mut self,
        item: &mut InFlight,
        last_stored: &mut Option<u64>,
    ) -> Result<Outcome, SinkError> {
        let Some(mut ack) = item.ack.take() else {
            // Only batch members have no token, and they never come here.
            return Err(SinkError::Stopped);
        };
        let timeout = self.config.ack_timeout;
        // Republished once behind the known tail already (see below).
        let mut refenced = false;
        loop {
            let Some(result) = self.replies.ack(ack, timeout).await else {
                return Err(SinkError::AckTimeout(timeout, item.event.msg_id.clone()));
            };
            let e = match result {
                Ok(pub_ack) => {
                    self.check(item, pub_ack).await?;
                    if pub_ack.duplicate {
                        self.duplicate(item);
                    } else if last_stored.is_some() {
                        *last_stored = Some(pub_ack.sequence);
                    }
                    return Ok(match &item.sent {
                        Sent::DeadLetter { reason, .. } => Outcome::DeadLetter {
                            reason: reason.clone(),
                        },
                        Sent::Event => Outcome::Stored {
                            duplicate: pub_ack.duplicate,
                        },
                    });
                }
                Err(e) => e,
            };
            if let Some(refusal) = refused_for_good(&e) {
                ack = self.refused(item, refusal).await?;
                continue;
            }
            if e.kind() == PublishErrorKind::WrongLastSequence {
                // Refused behind a duplicate: either sent with an expectation that counted the
                // duplicate (acknowledged after it was sent), or sent with the right one but
                // arriving before the messages ahead of it were republished. Either way, send it
                // once more behind what the stream is known to hold; a second refusal there means
                // the stream really is not where the relay left it.
                if let (Some(_), Some(last), false) = (item.expected, *last_stored, refenced) {
                    debug!(id = %item.event.msg_id, expected = ?item.expected, last, "republishing behind a duplicate");
                    item.expected = Some(last);
                    refenced = true;
                    ack = self.resend(item).await?;
                    continue;
                }
                return Err(SinkError::FenceBroken {
                    id: item.event.msg_id.clone(),
                    expected: item.expected.unwrap_or(0),
                    source: e,
                });
            }
            return Err(SinkError::Publish {
                id: item.event.msg_id.clone(),
                source: e,
            });
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
                .holds(&self.config.stream, ack.sequence, &item.event.msg_id)
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
    fn duplicate(&self, item: &InFlight) {
        match (&self.fence, item.expected) {
            (Some((_, duplicates)), Some(_)) => {
                duplicates.fetch_add(1, Ordering::AcqRel);
                warn!(id = %item.event.msg_id, lsn = %item.event.commit_lsn, "event id already used by an earlier event: JetStream dropped it as a duplicate");
            }
            _ => debug!(id = %item.event.msg_id, "duplicate dropped by JetStream"),
        }
    }

    /// The stream refused `item` for good: dead-letter it, or a smaller dead letter than before.
    async fn refused(&self, item: &mut InFlight, refusal: String) -> Result<u64, SinkError> {
        let reason = format!("the stream refused the message: {refusal}");
        let next = match &item.sent {
            Sent::Event => {
                self.config.on_invalid(&item.event, &reason)?;
                // The hot path keeps no copy of a routed event's subject: render it again.
                item.subject = routed_subject(
                    &self.config,
                    &item.event,
                    &item.sent,
                    std::mem::take(&mut item.subject),
                );
                let (ack, shrink) = send_dead_letter(
                    &self.publisher,
                    &self.config,
                    &item.event,
                    (!item.subject.is_empty()).then_some(item.subject.as_str()),
                    &reason,
                    item.expected,
                )
                .await?;
                item.sent = Sent::DeadLetter { reason, shrink };
                return Ok(ack);
            }
            Sent::DeadLetter { reason, shrink } => match shrink.smaller() {
                Some(next) => next,
                None => {
                    return Err(SinkError::DeadLetterRefused {
                        id: item.event.msg_id.clone(),
                        lsn: item.event.commit_lsn,
                        reason: reason.clone(),
                        refusal,
                    });
                }
            },
        };
        if let Sent::DeadLetter { shrink, .. } = &mut item.sent {
            *shrink = next;
        }
        self.resend(item).await
    }

    /// Sends `item` again as it was last sent (event or dead letter), with its current expectation.
    async fn resend(&self, item: &InFlight) -> Result<u64, SinkError> {
        let out = match &item.sent {
            Sent::Event => message::build(
                &item.event,
                &self.config.template,
                &self.config.dead_letter_subject,
                self.config.cloudevents.as_ref(),
            ),
            Sent::DeadLetter { reason, shrink } => message::dead_letter(
                &item.event,
                &self.config.dead_letter_subject,
                reason,
                (!item.subject.is_empty()).then_some(item.subject.as_str()),
                *shrink,
            ),
        };
        let (target, headers, payload) =
            stamped(out, item.expected, self.config.history.as_deref());
        self.publisher
            .send(target, headers, payload)
            .await
            .map_err(|source| SinkError::Publish {
                id: item.event.msg_id.clone(),
                source,
            })
    }
}
