//! Whether the relay trusts a message it finds at the stream's tail as one it wrote in the history
//! a session streams ([`judge`]), and why not ([`Untrusted`]). The replay (`src/sink/replay.rs`)
//! skips by this rule, and the stop mark's look (`src/slot_mark.rs`) trusts a tail by the same one.
//! Pure: no I/O and no clock.

use crate::Lsn;
use crate::position::{History, Position};
use crate::timeline::Shared;

use super::origin::Origin;
use super::stamp::Stamp;

/// Why a session does not skip anything, for its log line.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum Untrusted {
    /// The tail lacks an `Outbox-Position` that names a history, or an id.
    #[error(
        "the stream's last message was not written by this relay (no Outbox-Position with a history)"
    )]
    Foreign,
    /// The tail is from another database or slot, or a timeline that is neither this one nor an
    /// ancestor of it.
    #[error(
        "the stream's last message is from another history ({tail}, this session streams {here})"
    )]
    OtherHistory {
        /// The tail's history.
        tail: History,
        /// The session's.
        here: History,
    },
    /// The tail is from an ancestor timeline, at or past the point where that timeline ended: a
    /// history the server does not have (the old primary wrote it after the standby's last WAL).
    #[error(
        "the stream's last message is at {tail} on timeline {timeline}, at or past {switch} where \
         this server's timeline {here} branched off it: it is from a history this server does not have"
    )]
    PastSwitch {
        /// The tail's position.
        tail: Position,
        /// The tail's timeline.
        timeline: u32,
        /// Where that timeline ended in this server's history.
        switch: Lsn,
        /// The session's timeline.
        here: u32,
    },
    /// The tail's position is beyond the server's WAL.
    #[error(
        "the stream's last message is at {tail}, beyond the server's WAL end {wal_end}: the database was restored \
         from a backup or snapshot taken before the relay published it"
    )]
    AheadOfServer {
        /// The tail's position.
        tail: Position,
        /// The server's WAL flush position.
        wal_end: Lsn,
    },
    /// An earlier session found the stream's tail unreliable; holds why
    /// (the sink's `SinkError::distrust`).
    #[error("an earlier session found the stream's tail unreliable: {0}")]
    Distrusted(String),
}

/// Whether a message the relay wrote (`last`) names an event of the history `origin` streams,
/// at a position the server has: its position and id, or why not. The replay and
/// the stop mark's look (`slot_mark.rs`) trust a tail by this rule.
pub(crate) fn judge(last: &Stamp, origin: &Origin) -> Result<(Position, String), Untrusted> {
    let (Some(position), Some(history), Some(id)) = (last.position, &last.history, &last.id) else {
        return Err(Untrusted::Foreign);
    };
    let other = || Untrusted::OtherHistory {
        tail: history.clone(),
        here: origin.history.clone(),
    };
    if history.system_id != origin.history.system_id || history.slot != origin.history.slot {
        return Err(other());
    }
    // The tail's timeline must be this one, or an ancestor whose WAL up to the tail's position
    // is this timeline's too (a promotion, or a recovery that went past the tail).
    if history.timeline != origin.history.timeline {
        match origin.timelines.shared(history.timeline) {
            Shared::Below(switch) if position.lsn < switch => {}
            Shared::Below(switch) => {
                return Err(Untrusted::PastSwitch {
                    tail: position,
                    timeline: history.timeline,
                    switch,
                    here: origin.history.timeline,
                });
            }
            Shared::All | Shared::Nothing => return Err(other()),
        }
    }
    if position.lsn >= origin.wal_end {
        return Err(Untrusted::AheadOfServer {
            tail: position,
            wal_end: origin.wal_end,
        });
    }
    Ok((position, id.clone()))
}
