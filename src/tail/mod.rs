//! The stream's tail: what the relay reads of the stream's last message and judges it by. A module
//! of its own, below the sink and the operator tools, because both read it: the sink's fence, replay
//! and proof; `status`, the stop mark (`slot_mark`), the connector and the backfill. It imports
//! neither the sink nor the replication connection (`source`), so no operator tool needs the sink to
//! read a tail.
//!
//! - `stamp.rs`: the values read ([`Tail`], [`Stamp`], [`TailError`]);
//! - `origin.rs`: the history a session streams ([`Origin`]);
//! - `trust.rs`: whether a tail is the relay's own in that history ([`judge`], [`Untrusted`]), pure;
//! - `read.rs`: reading it through the NATS port ([`read_tail`]).

mod origin;
mod read;
mod stamp;
mod trust;

pub(crate) use origin::Origin;
pub(crate) use read::read_tail;
pub(crate) use stamp::TailError;
pub(crate) use stamp::{Stamp, Tail};
pub(crate) use trust::{Untrusted, judge};

/// Fixtures the fence's and the replay's tests share: a history, a session streaming it, and a
/// stream's tail written in it.
#[cfg(test)]
pub(crate) mod tests {
    use super::{Origin, Stamp, Tail};
    use crate::Lsn;
    use crate::position::{History, Position};
    use crate::timeline::TimelineHistory;

    pub(crate) fn history() -> History {
        History {
            system_id: "7311234567890123456".into(),
            timeline: 1,
            slot: "outbox_relay".into(),
        }
    }

    pub(crate) fn origin() -> Origin {
        Origin {
            history: history(),
            wal_end: Lsn(0x10_000),
            timelines: TimelineHistory::root(1),
        }
    }

    pub(crate) fn pos(lsn: u64, index: u32) -> Position {
        Position::in_transaction(Lsn(lsn), index)
    }

    pub(crate) fn tail(lsn: u64, index: u32, id: &str) -> Tail {
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
