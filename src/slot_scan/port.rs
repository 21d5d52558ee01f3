//! The port a look at a slot reads through ([`PeekPort`]): one slot's pending changes as the
//! server hands them over, and the bounds of a look. The look itself (`slot_scan.rs`) judges what
//! it is handed and never asks a server directly, so the deterministic simulation runs the very
//! look `status`, `verify` and the relay's start run, over its own Postgres's records; the real
//! port is `postgres.rs`.

use std::future::Future;
use std::ops::ControlFlow;
use std::time::Duration;

use bytes::Bytes;

use crate::Lsn;

/// How far a look may go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bound {
    /// At most this many pgoutput rows (the server ends at the first transaction boundary past it).
    pub(crate) changes: u32,
    /// At most this long (the session's `statement_timeout`).
    pub(crate) timeout: Duration,
}

impl Bound {
    /// What `status` and the relay's start allow: a look must answer within seconds, and the
    /// server keeps what it decoded (up to this many changes) in a tuplestore until it is read.
    pub const DEFAULT: Bound = Bound {
        changes: 20_000,
        timeout: Duration::from_secs(10),
    };
}

/// What a peek hands each row to, in order: its LSN and its pgoutput message. `Break` ends the
/// peek (the look has seen what it needed, or a row it cannot judge).
pub type Rows<'a, 'f> = &'a mut (dyn FnMut(Lsn, Bytes) -> ControlFlow<()> + Send + 'f);

/// A peek that ended before its end, in the server's words (a refused or timed-out query): the
/// look reports it as why it is unfinished.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct PeekFailed(pub String);

/// One slot's pending changes, peeked (nothing consumed): what `pg_logical_slot_peek_binary_changes`
/// with the relay's own pgoutput options answers, or a simulated server's records.
pub trait PeekPort: Send {
    /// What the set-up before the looks failed with; the look reports it as its own error.
    type Error: Send;
    /// Before a search's looks: the time `bound` set, and the OIDs of the outbox table's partitions
    /// (what the outbox stage counts as the outbox's rows).
    fn begin(&mut self, bound: Bound)
    -> impl Future<Output = Result<Vec<u32>, Self::Error>> + Send;
    /// One peek up to `upto` (the end of the WAL when `None`) of at most `changes` rows; like the
    /// server, it ends at the end of the transaction that reaches the bound. Each row goes to
    /// `rows` until it says `Break`.
    fn peek(
        &mut self,
        upto: Option<Lsn>,
        changes: u32,
        rows: Rows<'_, '_>,
    ) -> impl Future<Output = Result<(), PeekFailed>> + Send;
    /// After a search's looks: what `begin` set is undone.
    fn end(&mut self) -> impl Future<Output = ()> + Send;
}
