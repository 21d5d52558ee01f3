//! What a session knows, before it reads anything, about the history it streams ([`Origin`]): the
//! server's system, timeline and slot, its WAL end, and the timeline's ancestors. A plain value.

use crate::Lsn;
use crate::position::History;
use crate::timeline::TimelineHistory;

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
    /// What `IDENTIFY_SYSTEM` (the server's `system_id`, its `timeline` and its WAL flush
    /// position `wal_end`) and `TIMELINE_HISTORY` (`timelines`) say about the history a session of
    /// `slot` streams. Taken as plain values, so the tail does not depend on the replication
    /// connection that reads them.
    pub(crate) fn of(
        system_id: &str,
        timeline: u32,
        wal_end: Lsn,
        timelines: &TimelineHistory,
        slot: &str,
    ) -> Origin {
        Origin {
            history: History {
                system_id: system_id.to_owned(),
                timeline,
                slot: slot.to_owned(),
            },
            wal_end,
            timelines: timelines.clone(),
        }
    }
}
