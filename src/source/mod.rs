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
//!
//! # Layout
//!
//! Each module imports only those to its right (a `use super::…`), so the graph has no cycle:
//!
//! ```text
//! conn        ──► options, stream, hosts, socket, tls, wire, timeline, auth_policy, conninfo, error,
//!                 auth_error
//! control     ──► auth_guard, hosts, socket, tls, conninfo, error, auth_error
//! options     ──► wire, error
//! stream      ──► wire, error
//! hosts       ──► conninfo, error
//! auth_guard  ──► auth_policy, conninfo, auth_error
//! auth_policy ──► conninfo, auth_error
//! tls         ──► conninfo
//! wire        ──► error
//! conninfo    ──► passfile, socket, auth_error
//! error       ──► auth_error
//! auth_error, passfile, socket, timeline: leaves within source
//! ```
//!
//! Outside itself, the module reaches only leaves: `crate::lsn` (LSNs, the protocol clock),
//! `crate::error_chain` (to print a cause), `crate::secret_file` (the password file's permission
//! check).
//!
//! - `conninfo`: the connection URL and its TLS settings (the password file through `passfile`).
//! - `passfile`: the libpq password file (`~/.pgpass`, `PGPASSFILE`).
//! - `hosts`: the hosts of the URL tried in order, as `target_session_attrs` asks.
//! - `auth_policy`: which authentication methods `require_auth` and `channel_binding` allow, one
//!   policy for both connections.
//! - `auth_guard`: `require_auth` for the control connection, on the wire under tokio-postgres.
//! - `auth_error`: [`AuthError`], why authentication failed, and [`AuthRefusal`], what the policy
//!   refuses; each variant prints the text an operator reads.
//! - `error`: [`SourceError`] and [`ServerError`], transient or definite.
//! - `wire`: framing of backend messages (with the [`MAX_FRAME_BYTES`] cap), ErrorResponse fields,
//!   identifier and literal quoting; shared by `conn`, `options` and `stream`.
//! - `tls`: rustls configuration for `sslmode`, and the channel-binding hash.
//! - `options`: the pgoutput options of `START_REPLICATION`, checked against the server version.
//! - `stream`: the CopyBoth phase (reader and status-update writer tasks) and the CopyData parse.
//! - `socket`: the byte stream to a host: TCP, or a Unix socket when the host is a directory.
//! - `conn`: connect, authenticate, walsender commands; hands the socket to `stream`.
//! - `timeline`: the history file `TIMELINE_HISTORY` returns: a timeline's ancestors and switch points.
//! - `control`: the tokio-postgres connection for ordinary SQL.

mod auth_error;
mod auth_guard;
mod auth_policy;
mod conn;
mod conninfo;
mod control;
mod error;
mod hosts;
mod options;
mod passfile;
mod socket;
mod stream;
mod tls;
mod wire;

pub use crate::timeline::{HistoryError, Shared, Switch, TimelineHistory};
pub use auth_error::{AuthError, AuthRefusal};
pub use conn::{ReplConnection, SystemInfo};
pub use conninfo::ConnInfo;
pub(crate) use conninfo::TargetSessionAttrs;
pub use control::connect_control;
pub(crate) use control::query_error_text;
pub use error::{ServerError, SourceError};
pub use options::PgOutputOptions;
pub use stream::{ReplicationEvent, ReplicationStream, StreamConfig, parse_copy_data};
pub(crate) use wire::quote_ident;
pub use wire::{MAX_FRAME_BYTES, frame_len};
