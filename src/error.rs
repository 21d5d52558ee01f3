//! Why the relay stops or restarts, as types: [`RelayError`] ends `run` (a definite error: a bad
//! setting, an invalidated slot, a frame that cannot be decoded), [`Restart`] ends one session and
//! starts the next from the confirmed LSN (transient trouble with Postgres or NATS, or a slot that
//! another relay holds).
//!
//! Each variant carries its source error (`#[source]`), so `main` prints the whole chain, and
//! [`CauseKind`] gives metric labels and log fields without comparing strings.

use crate::Lsn;
use crate::config::ConfigError;
use crate::outbox::StageError;
use crate::pgoutput::DecodeError;
use crate::progress::OutOfOrderAck;
use crate::setup::SetupError;
use crate::sink::{ConnectError, SinkError, TailError};
use crate::source::SourceError;

/// A definite error: `run` ends with it; nothing past the confirmed LSN is confirmed.
#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Setup(#[from] SetupError),
    #[error(transparent)]
    Http(#[from] crate::http::BindError),
    /// Postgres can no longer give the slot's changes; events since its position may be lost.
    #[error("{}", crate::setup::lost_slot_message(.slot, .reason))]
    SlotInvalidated {
        slot: String,
        /// `invalidation_reason` (PG 17+) or `wal_status`, as the server reports it.
        reason: String,
        #[source]
        source: SourceError,
    },
    /// The replication connection failed in a way retrying cannot fix (password, TLS, permissions).
    #[error(transparent)]
    Source(SourceError),
    #[error("cannot decode replication data; nothing past {confirmed} is confirmed")]
    Decode {
        confirmed: Lsn,
        #[source]
        source: DecodeError,
    },
    #[error("replication data at {lsn}")]
    Stage {
        lsn: Lsn,
        #[source]
        source: StageError,
    },
    /// `outbox.on_invalid = "stop"` met an event that cannot be published, or the stream refused
    /// even a minimal dead letter.
    #[error(transparent)]
    Sink(SinkError),
    #[error(transparent)]
    Progress(#[from] OutOfOrderAck),
}

/// Transient trouble: the session ends and the next starts from the confirmed LSN.
#[derive(Debug, thiserror::Error)]
pub enum Restart {
    #[error("postgres: {0}")]
    Postgres(#[source] SourceError),
    #[error("NATS: {0}")]
    Nats(#[source] NatsTrouble),
    /// "replication slot … is active for PID …": another relay streams; wait as a standby.
    #[error("slot held by another relay: {0}")]
    SlotHeld(#[source] SourceError),
}

/// What went wrong on the NATS side of a session.
#[derive(Debug, thiserror::Error)]
pub enum NatsTrouble {
    #[error(transparent)]
    Connect(#[from] ConnectError),
    #[error(transparent)]
    Tail(#[from] TailError),
    #[error(transparent)]
    Sink(#[from] SinkError),
    #[error("the ack task ended")]
    AckTaskEnded,
}

/// The kind of a [`Restart`], for one log line per change of state and for metric labels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CauseKind {
    Postgres,
    Nats,
    SlotHeld,
}

impl CauseKind {
    /// Every kind, in the order of their discriminants (metric arrays are indexed by them).
    pub const ALL: [CauseKind; 3] = [CauseKind::Postgres, CauseKind::Nats, CauseKind::SlotHeld];

    /// The label value (`cause="…"` in logs and metrics).
    pub fn as_str(self) -> &'static str {
        match self {
            CauseKind::Postgres => "postgres",
            CauseKind::Nats => "nats",
            CauseKind::SlotHeld => "slot_held",
        }
    }
}

impl std::fmt::Display for CauseKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Restart {
    pub fn kind(&self) -> CauseKind {
        match self {
            Restart::Postgres(_) => CauseKind::Postgres,
            Restart::Nats(_) => CauseKind::Nats,
            Restart::SlotHeld(_) => CauseKind::SlotHeld,
        }
    }
}

impl<T: Into<NatsTrouble>> From<T> for Restart {
    fn from(e: T) -> Self {
        Restart::Nats(e.into())
    }
}

/// How a session ended.
#[derive(Debug)]
pub enum SessionEnd {
    /// Shutdown requested and done.
    Shutdown,
    /// Transient trouble: restart from the confirmed LSN.
    Restart(Restart),
    /// Stop the relay.
    Fatal(RelayError),
}

impl From<Restart> for SessionEnd {
    fn from(r: Restart) -> Self {
        SessionEnd::Restart(r)
    }
}

impl From<RelayError> for SessionEnd {
    fn from(e: RelayError) -> Self {
        SessionEnd::Fatal(e)
    }
}

/// A replication-source error: a standby wait, a retry, or the end.
pub fn from_source(e: SourceError) -> SessionEnd {
    if e.sqlstate() == Some("55006") {
        SessionEnd::Restart(Restart::SlotHeld(e))
    } else if e.is_transient() {
        SessionEnd::Restart(Restart::Postgres(e))
    } else {
        SessionEnd::Fatal(RelayError::Source(e))
    }
}

/// A sink error: definite ones (`on_invalid = "stop"`, a dead letter that cannot be stored) end the
/// relay, the rest restart the session.
pub fn from_sink(e: SinkError) -> SessionEnd {
    if e.is_transient() {
        SessionEnd::Restart(Restart::Nats(NatsTrouble::Sink(e)))
    } else {
        SessionEnd::Fatal(RelayError::Sink(e))
    }
}
