//! The stream's tail as the relay reads it: the last sequence, the stream's `max_msg_size`, and
//! what the last message says of itself ([`Tail`], [`Stamp`]), or why it could not be read
//! ([`TailError`]). Plain values, no I/O.

use crate::message;
use crate::nats::NatsError;
use crate::position::{History, Position};

/// The stream's last message, as far as the relay needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Tail {
    /// The stream's last sequence (0 for a new stream).
    pub(crate) last_sequence: u64,
    /// What the message at `last_sequence` says of itself, when it is still there.
    pub(crate) last: Option<Stamp>,
    /// The stream's `max_msg_size` (headers and payload), when it has one.
    pub(crate) max_msg_size: Option<usize>,
}

/// The headers by which the relay recognises a message it wrote: each is `None` when the message
/// lacks it or it does not parse (a message the relay did not write, or an older relay's).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(crate) struct Stamp {
    /// The position `Outbox-Position` names.
    pub(crate) position: Option<Position>,
    /// The history `Outbox-Position` names.
    pub(crate) history: Option<History>,
    /// The event id: `Outbox-Event-Id` (a dead letter, a parked copy, a message of an atomic
    /// batch), else `Nats-Msg-Id`.
    pub(crate) id: Option<String>,
    /// `;replay-over=N` after the position: the message was published by a session that trusted
    /// no tail, when the stream's last sequence was N ([`crate::position::REPLAY_OVER`]).
    pub(crate) replay_over: Option<u64>,
}

impl Stamp {
    /// What a stored message's headers say of it.
    pub(crate) fn from_headers(h: &async_nats::HeaderMap) -> Self {
        let text = |name: &str| h.get(name).map(|v| v.as_str().to_owned());
        let stamp = h.get(message::POSITION).map(|v| v.as_str());
        let (history, position) = stamp
            .and_then(|v| crate::position::parse_stamp(v).ok())
            .map_or((None, None), |(h, p)| (h, Some(p)));
        Stamp {
            position,
            history,
            id: text(message::EVENT_ID).or_else(|| text(message::NATS_MSG_ID)),
            replay_over: stamp.and_then(crate::position::replay_over),
        }
    }
}

/// The stream's tail cannot be read. The cause is the `source()`, not part of the message: it may
/// have causes of its own, and `error_chain` prints them all once.
#[derive(Debug, thiserror::Error)]
#[error("JetStream stream {stream}")]
pub struct TailError {
    /// The stream's name.
    pub(crate) stream: String,
    /// Why its tail cannot be read (no stream, no JetStream, no answer).
    #[source]
    pub(crate) source: NatsError,
}
