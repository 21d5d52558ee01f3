//! The simulated Postgres's answers to the library's looks at a slot: the changes the simulator
//! already read out of its WAL (what `pg_logical_slot_peek_binary_changes` hands over) go to the
//! library's own `slot_scan::InHand` port, and [`SimMarks`] is the `slot_mark::MarkPort` over its
//! stop mark. Through them `status` (`status.rs`) and the relay's start (`world.rs`'s
//! `slot_check`) run the library's own looks and its own judgement of the mark; only the server's
//! answers are simulated.

use std::convert::Infallible;
use std::sync::Arc;

use bytes::Bytes;
use outbox_relay::Lsn;
use outbox_relay::slot_mark::MarkPort;

use super::postgres::Postgres;

/// The simulated server's peek: the library's in-hand port (`status.rs` looks through it too).
pub(crate) use outbox_relay::slot_scan::InHand;

/// The stop mark as the simulated Postgres keeps it: where it stands, and its changes up to the
/// slot's position, one list per transaction.
pub(crate) struct MarkView {
    /// The mark's `confirmed_flush_lsn`.
    pub(crate) at: Lsn,
    /// Its changes up to the slot's position.
    pub(crate) changes: Vec<Vec<(Lsn, Bytes)>>,
}

/// The stop mark of the simulated Postgres as a session's start reads it: the mark as it stood
/// when the session looked (`None`: no mark), peeked as it was then, dropped on the server.
pub(crate) struct SimMarks {
    pg: Arc<Postgres>,
    at: Option<Lsn>,
    peek: InHand<Vec<Vec<(Lsn, Bytes)>>>,
}

impl SimMarks {
    /// The mark of `pg` as it stands, peeked up to `slot_at`.
    pub(crate) fn of(pg: &Arc<Postgres>, slot_at: u64) -> Self {
        let (at, changes) = match pg.mark_view(slot_at) {
            Some(m) => (Some(m.at), m.changes),
            None => (None, Vec::new()),
        };
        SimMarks {
            pg: Arc::clone(pg),
            at,
            peek: InHand(changes),
        }
    }
}

impl MarkPort for SimMarks {
    type Error = Infallible;
    type Peek = InHand<Vec<Vec<(Lsn, Bytes)>>>;

    async fn position(&mut self) -> Result<Option<Lsn>, Infallible> {
        Ok(self.at)
    }

    fn peek(&mut self) -> &mut Self::Peek {
        &mut self.peek
    }

    async fn drop_mark(&mut self) -> Result<(), Infallible> {
        self.pg.drop_mark("the relay's start");
        Ok(())
    }
}
