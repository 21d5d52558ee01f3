//! What the sink hands the session for every event, in publish order: [`Acked`], with how its
//! message ended ([`Outcome`]). A leaf of the sink: the window, the proof gate and the coordinator
//! all speak it.

/// How a message ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// Stored (or already stored: `duplicate`, JetStream dropped it by its `Nats-Msg-Id`; a
    /// republished dead letter too).
    Stored {
        /// JetStream already had it.
        duplicate: bool,
    },
    /// Not published: a fenced replay found it in the stream already.
    AlreadyStored,
    /// Stored on the dead-letter subject as a new message, with the reason (a dead letter JetStream
    /// dropped as a duplicate is [`Outcome::Stored`] with `duplicate`).
    DeadLetter {
        /// Why the event could not be published as it is.
        reason: String,
    },
}

impl Outcome {
    /// Whether JetStream stored a new message for it (an event or a dead letter): the only proof
    /// that the way to the stream works again. A duplicate, or an event a replay found stored,
    /// proves nothing: a stream that refuses every new message still answers those.
    pub(crate) fn is_new(&self) -> bool {
        matches!(
            self,
            Outcome::Stored { duplicate: false } | Outcome::DeadLetter { .. }
        )
    }
}

/// An ack, reported in publish order.
#[derive(Debug)]
pub(crate) struct Acked {
    /// The sequence number the event was submitted with ([`Sink::submit`](super::Sink::submit)).
    pub(crate) seq: u64,
    /// How the message ended.
    pub(crate) outcome: Outcome,
    /// The event's commit time (µs since 2000-01-01; 0 when unknown), for commit → ack latency.
    pub(crate) commit_ts: i64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_new_message_is_progress() {
        assert!(Outcome::Stored { duplicate: false }.is_new());
        assert!(
            Outcome::DeadLetter {
                reason: "aggregate_type".into()
            }
            .is_new()
        );
        assert!(!Outcome::Stored { duplicate: true }.is_new());
        assert!(!Outcome::AlreadyStored.is_new());
    }
}
