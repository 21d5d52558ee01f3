//! The backfill's doors to its servers: [`BackfillServers`] (setup, the connections), [`Control`]
//! (the control connection: the slot decision's drops, the snapshot's transaction and cursor) and
//! [`SlotMaker`] (the replication connection that creates the slot with its exported snapshot).
//! Production implements them over tokio-postgres, the replication protocol and async-nats
//! (`servers.rs`); the deterministic simulation (tests/simulation) over its in-memory Postgres and
//! JetStream, so the real backfill (the slot decision, the marker's rules, the publish loop through
//! the real sink, the handling of a stop) runs against a world where it is stopped or killed at any
//! point. NATS is the sink's own port ([`NatsPort`]), the marker included (its API requests).
//!
//! The methods are what the backfill does, not SQL: the SQL the operator wrote (`--where`,
//! `--order-by`) goes in as text the real connection sends as it is. Failed queries come back as the
//! server's one-line text ([`QueryError`]), which the backfill puts in its error as before.
//! Trait objects with boxed futures, as the NATS port: one allocation per call, per 1,000 rows for
//! the cursor.

use bytes::Bytes;
use futures_util::future::BoxFuture;

use crate::Lsn;
use crate::catalog::SlotRow;
use crate::nats::NatsPort;
use crate::pgoutput::Column;
use crate::setup::SetupError;
use crate::source::{SourceError, SystemInfo};

/// An error with its own chain (dropping a slot: the server's error as it came).
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// What setup found and created before the backfill, as the backfill needs it.
#[derive(Debug, Clone, Default)]
pub struct Prepared {
    /// What setup found and created (publication, stream), one line each.
    pub(crate) lines: Vec<String>,
    /// Findings that did not stop it, one line each.
    pub(crate) warnings: Vec<crate::warning::Warning>,
    /// The slot as it exists now, if it does.
    pub(crate) slot: Option<SlotRow>,
}

impl Prepared {
    /// Setup found the slot `active_pid` streams (`None`: inactive) confirmed up to `confirmed`,
    /// or (`slot` `None`) no slot: for a simulated server.
    pub fn found(slot: Option<(Option<i32>, Lsn)>) -> Self {
        Prepared {
            slot: slot.map(|(pid, confirmed)| SlotRow {
                slot_type: "logical".to_owned(),
                plugin: Some("pgoutput".to_owned()),
                active: pid.is_some(),
                active_pid: pid,
                confirmed_flush_lsn: Some(confirmed.to_string()),
                wal_status: Some("reserved".to_owned()),
                ..SlotRow::default()
            }),
            ..Prepared::default()
        }
    }
}

/// A statement on the control connection failed: the server's message and SQLSTATE on one line
/// (`query_error_text`), or the simulated server's stand-in. The backfill quotes it as it is, in its
/// error ([`BackfillError::Query`](super::BackfillError::Query),
/// [`BackfillError::Preflight`](super::BackfillError::Preflight)) and in its warnings.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct QueryError(pub String);

/// Why a slot could not be dropped after a stop or a failure.
#[derive(Debug, Clone)]
pub struct DropFailure {
    /// A walsender still holds it (55006): it lets go a moment after its connection closed.
    pub in_use: bool,
    /// The server's error, one line.
    pub message: QueryError,
}

/// What the backfill needs of its servers, in the order it asks.
pub trait BackfillServers: Send {
    /// Setup without the slot: the checks, the publication and the stream.
    fn prepare(&mut self) -> BoxFuture<'_, Result<Prepared, SetupError>>;
    /// Removes what [`BackfillServers::prepare`] created (the step after it failed).
    fn undo(&mut self) -> BoxFuture<'_, ()>;
    /// The control connection.
    fn control(&mut self) -> BoxFuture<'_, Result<Box<dyn Control>, SourceError>>;
    /// The NATS connection to read the marker and publish through.
    fn nats(&mut self) -> BoxFuture<'_, Result<NatsPort, super::BackfillError>>;
    /// A replication connection to create the slot on.
    fn replication(&mut self) -> BoxFuture<'_, Result<Box<dyn SlotMaker>, SourceError>>;
    /// Now, in µs since 2000-01-01: when the marker says the backfill began, and its rows' commit
    /// time. The machine's clock; the simulation's virtual one, so that a seed replays the same.
    fn now_micros(&self) -> i64 {
        crate::lsn::pg_now_micros()
    }
}

/// The control connection, as the backfill uses it.
pub trait Control: Send + Sync {
    /// Plans `query` (the snapshot query, `LIMIT 0`) in a read-only transaction that is rolled
    /// back.
    fn preflight(&self, query: String) -> BoxFuture<'_, Result<(), QueryError>>;
    /// `pg_drop_replication_slot(slot)` (`--replace-slot`, or the slot an unfinished backfill left).
    fn drop_slot(&self, slot: String) -> BoxFuture<'_, Result<(), BoxError>>;
    /// `pg_cancel_backend(pid)`: cancels the walsender's slot creation.
    fn cancel_backend(&self, pid: i32) -> BoxFuture<'_, Result<(), QueryError>>;
    /// Ends the snapshot's transaction, if one is open; a failure is of no consequence.
    fn rollback(&self) -> BoxFuture<'_, ()>;
    /// Drops `slot` if it exists.
    fn drop_slot_if_exists(&self, slot: String) -> BoxFuture<'_, Result<(), DropFailure>>;
    /// Opens the read-only REPEATABLE READ transaction that sees `snapshot`.
    fn import_snapshot(&self, snapshot: String) -> BoxFuture<'_, Result<(), QueryError>>;
    /// Every column of the table `qualified`, as pgoutput sends them.
    fn columns(&self, qualified: String) -> BoxFuture<'_, Result<Vec<Column>, QueryError>>;
    /// `query`'s one count.
    fn count(&self, query: String) -> BoxFuture<'_, Result<i64, QueryError>>;
    /// Declares the cursor (`declare`, one statement) and prepares its `fetch`.
    fn declare_cursor(
        &self,
        declare: String,
        fetch: String,
    ) -> BoxFuture<'_, Result<(), CursorError>>;
    /// The cursor's next rows (at most the `FETCH` count): each column's text, `None` for NULL.
    fn fetch(&self) -> BoxFuture<'_, Result<Vec<Vec<Option<Bytes>>>, QueryError>>;
    /// Commits the snapshot's transaction.
    fn commit(&self) -> BoxFuture<'_, Result<(), QueryError>>;
    /// Drops the stop mark of the slot (`slot_mark.rs`) if there is one.
    fn drop_stop_mark(&self) -> BoxFuture<'_, Result<(), QueryError>>;
}

/// Which step of [`Control::declare_cursor`] failed, with the server's text.
#[derive(Debug, Clone)]
pub enum CursorError {
    /// `DECLARE` (the `--where` and `--order-by` in it).
    Declare(QueryError),
    /// Preparing the `FETCH`.
    Fetch(QueryError),
}

/// The replication connection the slot is created on; its exported snapshot lives as long as it.
pub trait SlotMaker: Send {
    /// `IDENTIFY_SYSTEM`: the history the backfilled messages name (`None` when it failed).
    fn identify_system(&mut self) -> BoxFuture<'_, Option<SystemInfo>>;
    /// The walsender's process id, for [`Control::cancel_backend`].
    fn backend_pid(&self) -> i32;
    /// `CREATE_REPLICATION_SLOT … (SNAPSHOT 'export')`: the consistent point and the snapshot.
    fn create_slot_with_snapshot(
        &mut self,
        slot: String,
        failover: bool,
    ) -> BoxFuture<'_, Result<(Lsn, String), SourceError>>;
    /// Closes the connection (and with it the exported snapshot).
    fn close(self: Box<Self>) -> BoxFuture<'static, ()>;
}
