//! The facts `status` reads, behind one trait ([`Facts`]): the control connection's answers about
//! the server, the slot, the relay processes, the publication and the stop marks; the look at the
//! slot's waiting events; the stream and its parked keys; the relay's own word; `run`'s checks; the other hosts. The
//! verdict (`gather.rs` and the rules it calls) reads nothing else, so whatever implements the trait
//! is judged by the very code an operator's `status` runs: the real servers (`servers.rs`,
//! [`Servers`](super::Servers), each opened once) or the deterministic simulation's (tests/simulation).
//!
//! What a fact's reading failed with is a [`FactError`], whose text is the server's own words, as
//! `status` prints them in its problem lines.

use std::future::Future;

use crate::Lsn;
use crate::nats::NatsPort;
use crate::position::Position;
use crate::warning::Warning;

pub use super::parked::{ParkedReadError, ParkedStatus, read_parked};
pub use super::report::{
    OrphanMark, ServerStatus, StandbyStatus, State, StreamStatus, unknown_stream,
};
pub use crate::catalog::SlotRow;
pub use crate::relay_word::RelayWord;
pub use crate::slot_scan::Scan;

/// A fact could not be read: the server's words (a query's error, a refused look).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct FactError(pub String);

impl From<ParkedReadError> for FactError {
    fn from(e: ParkedReadError) -> FactError {
        FactError(e.to_string())
    }
}

/// The control connection to Postgres could not be opened: what `status` reports the server as,
/// and the error line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unreached {
    /// Unreachable, or a setting to fix (credentials, TLS).
    pub state: State,
    /// The error and its causes, on one line.
    pub error: String,
}

/// The stream as read: its status, and the problem its reading found (NATS unreachable, JetStream
/// not enabled or not answering), if any.
#[derive(Debug, Clone)]
pub struct StreamRead {
    /// What was read of the stream.
    pub status: StreamStatus,
    /// The problem line, when the reading found one.
    pub problem: Option<String>,
}

/// The publication as read: whether it exists, and its tables.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PublicationRead {
    /// `pg_publication` has it.
    pub exists: bool,
    /// `schema.table` of each table it publishes, sorted.
    pub tables: Vec<String>,
}

/// Every fact `status` reads. The Postgres facts are asked only after [`Facts::postgres`] said the
/// control connection is open; NATS facts say by themselves when NATS cannot be reached.
pub trait Facts: Sync {
    /// Whether the control connection to Postgres is open (opened once, on the first ask).
    fn postgres(&self) -> impl Future<Output = Result<(), Unreached>> + Send;
    /// The server: its version, recovery, host and WAL-retention settings (state `Exists`).
    fn server(&self) -> impl Future<Output = Result<ServerStatus, FactError>> + Send;
    /// The slot's `pg_replication_slots` row, with its lag (`None`: no such slot).
    fn slot(&self) -> impl Future<Output = Result<Option<SlotRow>, FactError>> + Send;
    /// The pids of the relay processes connected for the slot.
    fn relay_pids(&self) -> impl Future<Output = Result<Vec<u32>, FactError>> + Send;
    /// The outbox events waiting in the slot, looked at without holding it (a copy's peek).
    fn waiting(&self) -> impl Future<Output = Result<Scan, FactError>> + Send;
    /// PG 17+: seconds since no one holds the slot, when it is inactive.
    fn unheld_secs(&self) -> impl Future<Output = Result<Option<u64>, FactError>> + Send;
    /// Whether a walsender holds the slot now (watched before PG 17, see `gather.rs`).
    fn held(&self) -> impl Future<Output = Result<bool, FactError>> + Send;
    /// The publication.
    fn publication(&self) -> impl Future<Output = Result<PublicationRead, FactError>> + Send;
    /// The warnings about who may write outbox messages (`setup`'s own reading).
    fn message_warnings(&self) -> impl Future<Output = Result<Vec<Warning>, FactError>> + Send;
    /// Stop marks in this database whose slot is gone.
    fn orphan_marks(&self) -> impl Future<Output = Result<Vec<OrphanMark>, FactError>> + Send;
    /// The stop mark's position (`None`: there is no mark).
    fn mark_at(&self) -> impl Future<Output = Result<Option<Lsn>, FactError>> + Send;
    /// The outbox events the stop mark holds up to `slot_at`, past `after`.
    fn scan_mark(
        &self,
        slot_at: Lsn,
        after: Option<Position>,
    ) -> impl Future<Output = Result<Scan, FactError>> + Send;
    /// The stream: its state, counts, limits and dead letters.
    fn stream(&self) -> impl Future<Output = StreamRead> + Send;
    /// The keys parked on the stream's parking subjects (asked only when the stream exists and
    /// can hold them: `parked.rs`).
    fn parked(&self) -> impl Future<Output = Result<ParkedStatus, FactError>> + Send;
    /// The NATS port the stream's tail is read through (`None`: NATS cannot be reached).
    fn nats(&self) -> impl Future<Output = Option<NatsPort>> + Send;
    /// What the relay says of itself on `http.listen` (`None`: nothing listens there, or no
    /// address is set).
    fn own_word(&self) -> impl Future<Output = Option<RelayWord>> + Send;
    /// The checks `run` makes before it streams; the error line of the first that fails.
    fn run_checks(&self) -> impl Future<Output = Result<(), FactError>> + Send;
    /// Each other host of the URL (not the one `reached`), and its copy of the slot.
    fn standbys(&self, reached: Option<&str>) -> impl Future<Output = Vec<StandbyStatus>> + Send;
}
