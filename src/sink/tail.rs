//! The stream's tail as a session reads it when it starts: the last sequence, the stream's
//! `max_msg_size`, and what the last message says of itself ([`Tail`], [`Stamp`]), with what the
//! session knows of the history it streams ([`Origin`]). The fence, the replay and its proof judge
//! them; `slot_mark`, `status` and the connector read the tail too (through [`read_tail`](super::read_tail)).
//! A leaf of the sink: plain values, no I/O.

use crate::Lsn;
use crate::message;
use crate::nats::NatsError;
use crate::position::{History, Position};
use crate::source::TimelineHistory;

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
    /// `Nats-Msg-Id`, or `Outbox-Event-Id` on a message of an atomic batch.
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
            id: text(message::NATS_MSG_ID).or_else(|| text(message::EVENT_ID)),
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

/// What a session knows, before it reads anything, about the history it streams.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Origin {
    /// The server's system, timeline and the slot.
    pub(crate) history: History,
    /// The server's WAL flush position when the session started (`IDENTIFY_SYSTEM`).
    pub(crate) wal_end: Lsn,
    /// The timeline's ancestors and where each ended (`TIMELINE_HISTORY`): a promoted standby's
    /// WAL below the switch point is the old primary's.
    pub(crate) timelines: TimelineHistory,
}

impl Origin {
    /// What `IDENTIFY_SYSTEM` and `TIMELINE_HISTORY` (`system`) say about the history a session
    /// of `slot` streams.
    pub(crate) fn of(system: &crate::source::SystemInfo, slot: &str) -> Origin {
        Origin {
            history: History {
                system_id: system.system_id.clone(),
                timeline: system.timeline,
                slot: slot.to_owned(),
            },
            wal_end: system.xlogpos,
            timelines: system.history.clone(),
        }
    }
}

/// Fixtures the fence's and the replay's tests share: a history, a session streaming it, and a
/// stream's tail written in it.
#[cfg(test)]
pub(super) mod tests {
    use super::*;

    pub(in crate::sink) fn history() -> History {
        History {
            system_id: "7311234567890123456".into(),
            timeline: 1,
            slot: "outbox_relay".into(),
        }
    }

    pub(in crate::sink) fn origin() -> Origin {
        Origin {
            history: history(),
            wal_end: Lsn(0x10_000),
            timelines: TimelineHistory::root(1),
        }
    }

    pub(in crate::sink) fn pos(lsn: u64, index: u32) -> Position {
        Position::in_transaction(Lsn(lsn), index)
    }

    pub(in crate::sink) fn tail(lsn: u64, index: u32, id: &str) -> Tail {
        Tail {
            last_sequence: 9,
            last: Some(Stamp {
                replay_over: None,
                position: Some(pos(lsn, index)),
                history: Some(history()),
                id: Some(id.to_owned()),
            }),
            max_msg_size: None,
        }
    }
}
