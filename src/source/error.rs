//! Errors of the replication source, split the way the relay reacts to them.
//!
//! *Transient* errors (a dropped connection, a server restart, a slot still held by a dying walsender)
//! make the relay reconnect and restart from its last confirmed LSN. *Definite* errors (bad password,
//! missing slot or publication, `wal_level` not logical, an invalidated slot, a frame we cannot decode)
//! will not go away by retrying: the relay stops with the message, which names what to fix.

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

impl ServerError {
    /// Whether retrying can help. SQLSTATE classes from
    /// <https://www.postgresql.org/docs/current/errcodes-appendix.html>.
    pub(crate) fn is_transient(&self) -> bool {
        let class = self.code.get(..2).unwrap_or("");
        match self.code.as_str() {
            // object_in_use: "replication slot … is active for PID …" (an old walsender lingers).
            "55006" => true,
            // cannot_connect_now (starting up / shutting down), admin/crash shutdown.
            "57P01" | "57P02" | "57P03" | "57P05" => true,
            // too_many_connections: another client may leave.
            "53300" => true,
            _ => matches!(class, "08" | "40" | "53" | "58"),
        }
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
    /// True when reconnecting and restarting from the confirmed LSN can succeed.
    pub fn is_transient(&self) -> bool {
        match self {
            SourceError::Io { .. }
            | SourceError::Timeout { .. }
            | SourceError::Closed(_)
            | SourceError::WrongRole { .. } => true,
            // One host down must not turn another's refusal into a retry: every attempt would
            // log in with the refused credentials again (an LDAP or PAM account locks, an address
            // gets banned). Any host that refused them, or TLS, makes the attempt definite.
            SourceError::NoHost(tried) => {
                !tried.iter().any(|(_, e)| e.is_refusal())
                    && tried.iter().any(|(_, e)| e.is_transient())
            }
            SourceError::Server { error, .. } => error.is_transient(),
            SourceError::Auth(_)
            | SourceError::Tls(_)
            | SourceError::Protocol(_)
            | SourceError::Version { .. }
            | SourceError::BadFrame { .. }
            | SourceError::FrameTooLarge { .. } => false,
        }
    }

    /// The server refused the relay's credentials (SQLSTATE class 28, or the client's own
    /// authentication checks) or TLS failed: settings to fix, which no retry can.
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

#[cfg(test)]
mod tests {
    use super::*;

    fn server(code: &str) -> SourceError {
        SourceError::Server {
            context: "test",
            error: Box::new(ServerError {
                severity: "ERROR".into(),
                code: code.into(),
                message: "m".into(),
                detail: None,
                hint: None,
            }),
        }
    }

    #[test]
    fn classifies_sqlstates() {
        assert!(
            server("55006").is_transient(),
            "slot active elsewhere retries"
        );
        assert!(server("57P01").is_transient(), "admin shutdown retries");
        assert!(server("08006").is_transient());
        assert!(!server("28P01").is_transient(), "bad password is definite");
        assert!(!server("42704").is_transient(), "missing slot is definite");
        assert!(
            !server("55000").is_transient(),
            "invalidated slot is definite"
        );
    }

    /// docs/security.md, finding 4: a multi-host attempt where one host is down and another refused
    /// the password (or TLS) is definite, whatever the order; all hosts down, or one down and one a
    /// standby, retry.
    #[test]
    fn a_refusal_by_any_host_is_definite() {
        let down = || SourceError::Io {
            target: "db1:5432".into(),
            error: std::io::Error::from(std::io::ErrorKind::ConnectionRefused),
        };
        let standby = || SourceError::WrongRole {
            target: "db3:5432".into(),
            found: "a standby",
            wanted: "read-write",
        };
        let hosts = |es: Vec<SourceError>| {
            SourceError::NoHost(es.into_iter().map(|e| ("h".to_owned(), e)).collect())
        };
        for refused in [
            server("28P01"),
            server("28000"),
            SourceError::Auth(AuthError::BadSignature(std::io::Error::other("bad proof"))),
            SourceError::Tls("the server does not support TLS".into()),
        ] {
            let e = hosts(vec![down(), refused]);
            assert!(!e.is_transient(), "{e}");
            assert!(e.is_refusal(), "{e}");
        }
        assert!(!hosts(vec![server("28P01"), down()]).is_transient());
        assert!(hosts(vec![down(), down()]).is_transient());
        assert!(hosts(vec![down(), standby()]).is_transient());
        // A definite error that is not a refusal keeps the old rule: a host down may come back.
        assert!(hosts(vec![down(), server("3D000")]).is_transient());
    }
}
