//! The replication source: a logical replication connection to Postgres, built on postgres-protocol
//! (the published tokio-postgres has no replication support), and the control connection for ordinary
//! SQL (tokio-postgres), both from the same connection URL.
//!
//! ```text
//! ConnInfo::parse(url) ──► ReplConnection::connect ──► identify_system / create_slot
//!                                 │
//!                                 └─► start_replication(slot, lsn, PgOutputOptions) ──► ReplicationStream
//!                                          recv() → XLogData | Keepalive        confirm(lsn) → status updates
//! ```
//!
//! Boundary: this module moves bytes and LSNs. It does not decode pgoutput (see [`crate::pgoutput`])
//! and does not decide what is safe to confirm (see [`crate::progress`]).

mod conn;
mod conninfo;
mod control;
mod error;
mod options;
mod stream;
mod tls;

pub use conn::{ReplConnection, Row, SystemInfo, parse_server_version, status_interval};
pub use conninfo::{ConnInfo, ConnInfoError, RootCerts, SslMode};
pub use control::connect_control;
pub use error::{ServerError, SourceError};
pub use options::PgOutputOptions;
pub use stream::{ReplicationEvent, ReplicationStream, StreamConfig};
pub use tls::TlsConfigError;
