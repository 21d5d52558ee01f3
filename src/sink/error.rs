//! Why publishing cannot go on ([`SinkError`]), and what a failure means for the sessions after it
//! that only the sink can say: whether the stream's tail is to be trusted again
//! ([`SinkError::distrust`]). Whether it restarts the session, stops the relay or is a bug is the
//! relay's policy (src/relay/policy.rs), decided there for every error type. Kept apart from the
//! sink's logic so that the relay and the backfill can read the failures without the publisher's
//! machinery.
//!
//! Failures of the NATS seam are [`NatsError`]s of a kind; what the sink finds wrong itself is a
//! variant of its own: an answer that cannot be JetStream's ([`Forged`], [`SinkError::Forged`]), a
//! proof that could not be read ([`SinkError::Unshown`]).

use std::time::Duration;

use super::distrust::Distrust;
use crate::nats::NatsError;
use crate::position::Position;

/// Why publishing cannot go on.
#[derive(Debug, thiserror::Error)]
pub enum SinkError {
    /// No ack arrived within `nats.ack_timeout_ms`; holds the timeout and the message id.
    #[error("no ack from JetStream within {0:?} (message {1})")]
    AckTimeout(Duration, String),
    /// Sending a publish failed, or JetStream refused the message.
    #[error("JetStream publish of message {id} failed")]
    Publish {
        /// The message's `Nats-Msg-Id`.
        id: String,
        /// What the NATS seam said.
        #[source]
        source: NatsError,
    },
    /// An answer to a publish, or what the stream shows for it, cannot be JetStream's: planted on
    /// the relay's inbox by another client.
    #[error("JetStream publish of message {id} failed")]
    Forged {
        /// The message's `Nats-Msg-Id` (or, for a proof, `at position P`).
        id: String,
        /// What is wrong with the answer.
        #[source]
        source: Forged,
    },
    /// Reading the stream's message back, to prove the acks that named it, failed.
    #[error(
        "JetStream publish of message at position {position} failed: reading back stream {stream} sequence \
         {sequence} to prove the ack that named it"
    )]
    Unshown {
        /// The `Outbox-Position` of the message the ack named.
        position: Position,
        /// The stream.
        stream: String,
        /// The sequence the ack named.
        sequence: u64,
        /// Why it could not be read.
        #[source]
        source: NatsError,
    },
    #[error(
        "the stream's tail is not where the relay left it (message {id} expected last sequence {expected}): a message before it was lost or the stream changed; resynchronising"
    )]
    /// The stream refused a fenced publish: its last sequence is not the one the message expected.
    FenceBroken {
        /// The message's `Nats-Msg-Id`.
        id: String,
        /// The `Nats-Expected-Last-Sequence` the message carried.
        expected: u64,
        /// JetStream's refusal.
        #[source]
        source: NatsError,
    },
    /// Sending a member of an atomic batch on the connection failed.
    #[error("publish of message {id} (part of an atomic batch) failed")]
    CorePublish {
        /// The message's event id.
        id: String,
        /// What the NATS seam said.
        #[source]
        source: NatsError,
    },
    /// JetStream refused an atomic batch for the size of a message in it (its `max_msg_size`,
    /// or headers too large), although the relay measured each against the limit the session
    /// read: the next session reads the limit again and dead-letters what is over it.
    #[error(
        "the stream refused the atomic batch committed by message {id} ({refusal}): its max_msg_size changed \
         since the session started? restarting to read it again (a message over it becomes a dead letter)"
    )]
    BatchRefused {
        /// The id of the batch's commit message.
        id: String,
        /// JetStream's refusal.
        refusal: String,
    },
    /// The window holds nothing that can be settled where something must be (a defect in the
    /// relay: the members of an open atomic batch filled it, or the message to settle is not the
    /// oldest published one).
    #[error("the publish window is full of messages that wait for a batch commit not yet sent")]
    Stopped,
    /// Settling message `id` was given up half-way: the step carrying it out (waiting for the
    /// answer to a copy sent again, or reading the stream about a duplicate) was dropped, as a
    /// clean stop drops a step that waits. The message left the window unreported, so nothing
    /// behind it may be reported in this session (acks go to progress in publish order); the
    /// next session publishes it again.
    #[error(
        "settling message {id} was interrupted while it waited for JetStream: nothing behind it is reported in \
         this session, and the next start publishes it again"
    )]
    Interrupted {
        /// The message's event id.
        id: String,
    },
    /// A message was refused because the stream's last sequence had moved past the one it expected:
    /// something else stored a message in its place (another writer, or a publish of an earlier
    /// session arriving late), and a message behind it, whose expectation that matched, may be
    /// stored past the gap. Nothing past it is confirmed; the next session trusts no tail and
    /// publishes every event from the confirmed position again (a late copy can then follow what
    /// was stored past the gap, but none is lost).
    #[error(
        "the stream refused message {id}: its last sequence is {last}, past the {expected} the message expected \
         (another writer on the stream, or a late publish of an earlier session); publishing every event from the \
         confirmed position again"
    )]
    StoredPastRefused {
        /// The refused message's id.
        id: String,
        /// The `Nats-Expected-Last-Sequence` it carried.
        expected: u64,
        /// The stream's last sequence, as the refusal named it.
        last: u64,
    },
    /// The replay reached the stream's last message, but the messages before it are not the events
    /// it skipped (a message in the stream that the relay did not write, or one missing: a gap a
    /// late publish of an earlier session left behind another writer's message). Nothing skipped is
    /// confirmed; the next session trusts no tail and publishes every event from the confirmed
    /// position again.
    #[error(
        "the stream's last {count} messages (up to sequence {sequence}) are not the events the replay skipped \
         ({reason}); publishing every event from the confirmed position again"
    )]
    Unproven {
        /// The last message compared: the stream's last when the session started, or the message
        /// before a cut-off replay verified in its place.
        sequence: u64,
        /// How many messages were compared.
        count: u64,
        /// What did not match.
        reason: String,
        /// When `sequence` is the message before a cut-off replay: the stream's last sequence.
        over: Option<u64>,
    },
    /// The replayed events passed the position of the stream's last message without that message's
    /// own event: the stream's tail is from another history of the database (restored from a
    /// snapshot or backup). Nothing skipped is confirmed; the next session publishes every event.
    #[error(
        "the stream's last message (sequence {sequence}, position {tail}) is not in this database's history: the \
         replay reached {at} without it (database restored from a snapshot or backup?); publishing every event \
         from the confirmed position again"
    )]
    Diverged {
        /// The message judged: the stream's last when the session started, or the message before
        /// a cut-off replay verified in its place.
        sequence: u64,
        /// Its position.
        tail: Position,
        /// The first replayed event past it.
        at: Position,
        /// When `sequence` is the message before a cut-off replay: the stream's last sequence.
        over: Option<u64>,
    },
    /// `outbox.on_invalid = "stop"` and an event cannot be published as it is.
    #[error(
        "event {id} at {lsn} cannot be published ({reason}); outbox.on_invalid = \"stop\": fix or delete the row's \
         cause and restart, or set outbox.on_invalid = \"dead_letter\" to route it to the dead-letter subject"
    )]
    Invalid {
        /// The event's message id.
        id: String,
        /// The commit LSN of the event's transaction.
        lsn: crate::Lsn,
        /// Why the event cannot be published.
        reason: String,
    },
    /// Parking one more key would pass `outbox.max_parked_keys`: the event is not confirmed.
    #[error(
        "event {id} at {lsn} would park key {key}, but {parked} keys are parked already \
         (outbox.max_parked_keys = {parked}): requeue or discard parked keys ({command} lists them), or raise \
         outbox.max_parked_keys, and start the relay again; nothing is lost"
    )]
    ParkedFull {
        /// The event's message id.
        id: String,
        /// The commit LSN of the event's transaction.
        lsn: crate::Lsn,
        /// The key, `aggregate_type/aggregate_id` escaped as one line.
        key: String,
        /// The bound.
        parked: usize,
        /// The command that lists the parked keys, with the relay's `--config` (`Settings::command`).
        command: String,
    },
    /// The stream shows more parked keys than `outbox.max_parked_keys` (read when a session
    /// starts).
    #[error(
        "stream {stream} holds more than {max} parked keys (outbox.max_parked_keys = {max}), among them \
         {key}: requeue or discard parked keys ({command} lists them), or raise outbox.max_parked_keys"
    )]
    ParkedTooMany {
        /// The stream.
        stream: String,
        /// The bound.
        max: usize,
        /// A key past the bound, `aggregate_type/aggregate_id` escaped.
        key: String,
        /// The command that lists the parked keys, with the relay's `--config` (`Settings::command`).
        command: String,
    },
    /// Not even the minimal dead letter (id and reason) could be stored.
    #[error(
        "event {id} at {lsn} cannot be published ({reason}), and the stream refused even its minimal dead letter \
         ({refusal}): check the stream's max_msg_size and the server's max_payload, and nats.dead_letter_subject"
    )]
    DeadLetterRefused {
        /// The event's message id.
        id: String,
        /// The commit LSN of the event's transaction.
        lsn: crate::Lsn,
        /// Why the event itself cannot be published.
        reason: String,
        /// Why the stream refused the dead letter.
        refusal: String,
    },
}

impl SinkError {
    /// Why the stream's tail is not to be trusted by the next sessions, and which tail, for the
    /// error that found it so; `None` for every other error. The next session's warn line names
    /// the reason ([`Distrust`]).
    pub(crate) fn distrust(&self) -> Option<Distrust> {
        let (why, at, look_past) = match self {
            SinkError::Diverged {
                sequence,
                tail,
                over,
                ..
            } => (
                format!(
                    "its last message (sequence {sequence}, position {tail}) is not in this database's history"
                ),
                Some(over.unwrap_or(*sequence)),
                over.is_some(),
            ),
            SinkError::StoredPastRefused { id, expected, last } => (
                format!(
                    "message {id} was refused expecting last sequence {expected}, and the stream's last is {last}: \
                     a message may be stored past the refused one"
                ),
                (*last != u64::MAX).then_some(*last),
                false,
            ),
            SinkError::Unproven {
                sequence,
                count,
                reason,
                over,
            } => (
                format!(
                    "the proof that its last {count} messages (up to sequence {sequence}) are the events the replay \
                     skipped could not be completed: {reason}"
                ),
                Some(over.unwrap_or(*sequence)),
                over.is_some(),
            ),
            _ => return None,
        };
        Some(Distrust { why, at, look_past })
    }
}

/// An answer that cannot be JetStream's ack for a publish to `stream`.
#[derive(Debug, thiserror::Error)]
#[error(
    "an answer on the relay's inbox is not a JetStream ack for stream {stream}: {why}; another client may be \
     publishing to the relay's inbox (allow only the relay to publish to its inbox, nats.inbox_prefix; see \
     docs/operations.md, NATS permissions)"
)]
pub struct Forged {
    /// The relay's stream.
    pub(crate) stream: String,
    /// What is wrong with it.
    pub(crate) why: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_proof_not_completed_says_so_and_why() {
        let e = SinkError::Unproven {
            sequence: 30_000,
            count: 25_000,
            reason: "reading back message 7 failed: timed out".into(),
            over: None,
        };
        let d = e.distrust().expect("the tail is distrusted");
        assert_eq!((d.at, d.look_past), (Some(30_000), false));
        let why = d.why;
        assert!(why.contains("could not be completed"), "{why}");
        assert!(
            why.contains("its last 25000 messages (up to sequence 30000)"),
            "{why}"
        );
        assert!(
            why.ends_with("reading back message 7 failed: timed out"),
            "{why}"
        );
        assert_eq!(
            SinkError::Stopped.distrust(),
            None,
            "other errors trust the tail"
        );
    }
}
