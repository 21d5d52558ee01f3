//! Errors of the replication source: what went wrong, with the server's own SQLSTATE where it sent
//! one. What the relay does about each is decided in one place for every error type, the relay's
//! policy (src/relay/policy.rs): *transient* errors (a dropped connection, a server restart, a slot
//! still held by a dying walsender) make the relay reconnect and restart from its last confirmed
//! LSN; *definite* errors (bad password, missing slot or publication, `wal_level` not logical, an
//! invalidated slot, a frame we cannot decode) will not go away by retrying: the relay stops with
//! the message, which names what to fix.

use super::auth_error::AuthError;
use crate::Lsn;

/// An ErrorResponse from the server: SQLSTATE and message (plus hint/detail when sent).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerError {
    /// The severity (`ERROR`, `FATAL`, `PANIC`).
    pub severity: String,
    /// The SQLSTATE code, e.g. `42704`.
    pub code: String,
    /// The primary message.
    pub message: String,
    /// The optional detail message.
    pub detail: Option<String>,
    /// The optional hint on how to fix it.
    pub hint: Option<String>,
}

impl std::fmt::Display for ServerError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}: {}", self.severity, self.code, self.message)?;
        if let Some(d) = &self.detail {
            write!(f, " ({d})")?;
        }
        if let Some(h) = &self.hint {
            write!(f, " hint: {h}")?;
        }
        Ok(())
    }
}

/// Why a connection to Postgres, or the replication stream on it, failed.
#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    /// Connecting, reading or writing the socket failed.
    #[error("postgres connection to {target}: {error}")]
    Io {
        /// The host and port.
        target: String,
        /// The I/O error, shown in the message (so not also a `source()`).
        error: std::io::Error,
    },
    /// The server did not answer in time: at connect, or no message on the stream within the receive timeout.
    #[error("postgres at {target} did not answer within {secs}s")]
    Timeout {
        /// The host and port.
        target: String,
        /// The timeout that passed, in seconds.
        secs: u64,
    },
    /// The server sent an ErrorResponse.
    #[error("postgres {context}: {error}")]
    Server {
        /// What the relay was doing when the error came.
        context: &'static str,
        /// The server's error.
        error: Box<ServerError>,
    },
    /// Authentication failed or was refused by the relay (e.g. a method `require_auth` forbids).
    #[error("postgres authentication: {0}")]
    Auth(AuthError),
    /// TLS could not be set up, negotiated or verified.
    #[error("postgres TLS: {0}")]
    Tls(String),
    /// The server broke the protocol, or the pgoutput options cannot be sent (e.g. no publication).
    #[error("postgres protocol: {0}")]
    Protocol(String),
    /// The server closed the connection or ended the replication stream.
    #[error("replication stream: {0}")]
    Closed(&'static str),
    /// The server is too old for a feature the settings ask for.
    #[error(
        "server version {version} does not support {what}: Postgres {needs} or newer is needed"
    )]
    Version {
        /// The server's `server_version_num`.
        version: u32,
        /// The feature that needs a newer server.
        what: String,
        /// The oldest Postgres major version that has it.
        needs: &'static str,
    },
    /// A CopyData payload of the replication stream (XLogData or keepalive) could not be parsed.
    #[error("replication data at {lsn}: {reason}")]
    BadFrame {
        /// The WAL position of the frame, or 0/0 when not yet known.
        lsn: Lsn,
        /// What was wrong with the bytes.
        reason: String,
    },
    /// A length prefix over the frame cap ([`super::MAX_FRAME_BYTES`] by default): refused before
    /// anything is reserved for it, since no Postgres sends a message that large.
    #[error(
        "postgres protocol: a {tag:?} message announces {len} bytes, over the {max}-byte frame limit"
    )]
    FrameTooLarge {
        /// The message's type byte.
        tag: char,
        /// The length the message announces.
        len: usize,
        /// The frame cap in force.
        max: usize,
    },
    /// The host answered but is not what `target_session_attrs` asks for (e.g. a standby while a
    /// failover is under way).
    #[error("postgres at {target} is {found}, not what target_session_attrs={wanted} asks for")]
    WrongRole {
        /// The host and port.
        target: String,
        /// What the host is (e.g. `a standby`).
        found: &'static str,
        /// The `target_session_attrs` value asked for.
        wanted: &'static str,
    },
    /// Every host of a multi-host URL failed.
    #[error("no host of postgres.url could be used: {}", describe_hosts(.0))]
    NoHost(Vec<(String, SourceError)>),
}

fn describe_hosts(tried: &[(String, SourceError)]) -> String {
    tried
        .iter()
        .map(|(target, e)| format!("{target}: {}", crate::error_chain::error_chain(e)))
        .collect::<Vec<_>>()
        .join("; ")
}

impl SourceError {
    /// The server refused the relay's credentials (SQLSTATE class 28, or the client's own
    /// authentication checks) or TLS failed: settings to fix. A fact about the error, which the
    /// relay's policy (no retry) and `status` (`AUTHENTICATION FAILED`, not unreachable) both read.
    pub(crate) fn is_refusal(&self) -> bool {
        match self {
            SourceError::Auth(_) | SourceError::Tls(_) => true,
            SourceError::Server { error, .. } => error.code.starts_with("28"),
            SourceError::NoHost(tried) => tried.iter().any(|(_, e)| e.is_refusal()),
            _ => false,
        }
    }

    /// The SQLSTATE when the server sent an error.
    pub fn sqlstate(&self) -> Option<&str> {
        match self {
            SourceError::Server { error, .. } => Some(&error.code),
            _ => None,
        }
    }
}
