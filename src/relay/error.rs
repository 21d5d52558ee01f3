//! Why the relay stops or restarts, as types: [`RelayError`] ends `run` (a definite error: a bad
//! setting, an invalidated slot, a frame that cannot be decoded; or a defect, a bug),
//! [`Restart`] ends one session and starts the next from the confirmed LSN (transient trouble with
//! Postgres or NATS, or a slot that another relay holds). Which error becomes which is not decided
//! here but in `policy.rs`, for every error type; these are the shapes it decides between.
//!
//! Each variant carries its source error (`#[source]`), so `main` prints the whole chain, and
//! [`CauseKind`] gives metric labels and log fields without comparing strings. A restart says itself
//! which tail it leaves untrusted ([`Restart::distrust`]), so the restart loop does not look into its
//! variants. The table of decisions: docs/architecture.md, "Errors: restart or stop".

use crate::Lsn;
use crate::config::ConfigError;
use crate::http::BindError;
use crate::nats::ConnectError;
use crate::outbox::StageError;
use crate::pgoutput::DecodeError;
use crate::setup::SetupError;
use crate::sink::{Distrust, SinkError, TailError};
use crate::source::SourceError;

/// A definite error: `run` ends with it; nothing past the confirmed LSN is confirmed.
#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    /// A setting cannot be used.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// A check before streaming failed, or setup could not create what is missing.
    #[error(transparent)]
    Setup(#[from] SetupError),
    /// The HTTP listener cannot be started.
    #[error(transparent)]
    Http(#[from] BindError),
    /// Postgres can no longer give the slot's changes; events since its position may be lost.
    #[error("{message}")]
    SlotInvalidated {
        /// The slot's name.
        slot: String,
        /// `setup::lost_slot_message`: the reason (`invalidation_reason` on PG 17+, or `wal_status`),
        /// what is lost and the command that recovers.
        message: String,
        /// The error the server sent when the relay tried to stream the slot.
        #[source]
        source: SourceError,
    },
    /// The replication connection failed in a way retrying cannot fix (password, TLS, permissions).
    #[error(transparent)]
    Source(SourceError),
    /// A pgoutput message cannot be decoded.
    #[error("cannot decode replication data; nothing past {confirmed} is confirmed")]
    Decode {
        /// The last position confirmed to the slot.
        confirmed: Lsn,
        /// What could not be decoded.
        #[source]
        source: DecodeError,
    },
    /// The decoded messages break the shape of a transaction stream.
    #[error("replication data at {lsn}")]
    Stage {
        /// The WAL position of the XLogData that carried the message.
        lsn: Lsn,
        /// What was wrong with the stream.
        #[source]
        source: StageError,
    },
    /// `outbox.on_invalid = "stop"` met an event that cannot be published, or the stream refused
    /// even a minimal dead letter.
    #[error(transparent)]
    Sink(SinkError),
    /// Something the relay's code rules out happened (an ack out of publish order, a window that
    /// cannot be settled): a bug. The relay stops rather than go on from a state it cannot reason
    /// about; nothing past the confirmed position is confirmed.
    #[error(
        "outbox-relay stopped on a bug of its own, not on a problem with the servers or the settings; nothing \
         past the confirmed position was confirmed, and a restart resumes from there. Please report it with this \
         line"
    )]
    Defect(#[source] Box<dyn std::error::Error + Send + Sync>),
}

impl RelayError {
    /// Whether it is a defect: a bug of the relay's, which the simulation and the tests count as a
    /// failure whatever else happened.
    pub fn is_defect(&self) -> bool {
        matches!(self, RelayError::Defect(_))
    }
}

/// Transient trouble: the session ends and the next starts from the confirmed LSN.
#[derive(Debug, thiserror::Error)]
pub enum Restart {
    /// The replication connection failed in a way a reconnect can fix.
    #[error("postgres")]
    Postgres(#[source] SourceError),
    /// NATS, the stream or the sink failed in a way a reconnect can fix.
    #[error("NATS")]
    Nats(#[source] NatsTrouble),
    /// "replication slot … is active for PID …": another relay streams; wait as a standby.
    #[error("slot held by another relay")]
    SlotHeld(#[source] SourceError),
    /// Another client consumed the slot past outbox events the stream lacks (`slot_mark.rs`; the
    /// text says which and how to recover). Streaming on would confirm past the gap as if nothing
    /// happened, so every session refuses until the evidence is gone.
    #[error("{0}")]
    SlotConsumed(String),
}

/// What went wrong on the NATS side of a session.
#[derive(Debug, thiserror::Error)]
pub enum NatsTrouble {
    /// NATS cannot be reached or refuses the relay.
    #[error(transparent)]
    Connect(#[from] ConnectError),
    /// The stream's tail cannot be read (for the fence).
    #[error(transparent)]
    Tail(#[from] TailError),
    /// Publishing failed (ack timeout, lost connection, broken fence).
    #[error(transparent)]
    Sink(#[from] SinkError),
    /// NATS cannot be reached, as a [`crate::relay::Connector`] other than the real one reports it
    /// (the simulation's outages).
    #[error("NATS unavailable: {0}")]
    Unavailable(String),
}

pub(crate) use crate::metrics::CauseKind;

impl Restart {
    /// The kind of this restart.
    pub(crate) fn kind(&self) -> CauseKind {
        match self {
            Restart::Postgres(_) | Restart::SlotConsumed(_) => CauseKind::Postgres,
            Restart::Nats(_) => CauseKind::Nats,
            Restart::SlotHeld(_) => CauseKind::SlotHeld,
        }
    }

    /// Why and which tail the next sessions must not trust, when the sink error that ended the
    /// session found it so ([`SinkError::distrust`]); `None` for every other restart.
    pub(crate) fn distrust(&self) -> Option<Distrust> {
        match self {
            Restart::Nats(NatsTrouble::Sink(e)) => e.distrust(),
            _ => None,
        }
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
