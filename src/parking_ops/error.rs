//! Why `requeue` sent nothing: each a line naming the function or setting and the fix (not
//! installed: run the script; installed for another relay's prefix; refused: grant the operator
//! role).

use crate::source::SourceError;

/// Why a request was not sent; each a line naming the function or setting and the fix.
#[derive(Debug, thiserror::Error)]
pub enum RequeueError {
    /// `--postgres-url` does not parse.
    #[error("--postgres-url: {0}")]
    Url(String),
    /// Postgres cannot be reached or refused the login.
    #[error("cannot connect to Postgres: {0}")]
    Connect(#[from] SourceError),
    /// No function of that name and arguments in the database.
    #[error(
        "{function} is not installed in this database: run sql/09_requeue.sql as the functions' owner (psql -v relay_name=<name> for a relay with a name)"
    )]
    NotInstalled {
        /// The function.
        function: &'static str,
    },
    /// Installed, but for other prefixes than this relay's.
    #[error(
        "{function}: the installed {found} emit(s) control messages under another prefix than this relay's {prefix}: run sql/09_requeue.sql with -v relay_name=<this relay's name> (and -v requeue_schema=<a schema of its own>)"
    )]
    OtherPrefix {
        /// The function.
        function: &'static str,
        /// The functions found, with their prefixes.
        found: String,
        /// This relay's control prefix.
        prefix: String,
    },
    /// Installed more than once for this relay's prefix.
    #[error(
        "{function}: {found} all emit this relay's prefix {prefix}: drop all but one (DROP FUNCTION …)"
    )]
    Ambiguous {
        /// The function.
        function: &'static str,
        /// The functions found.
        found: String,
        /// This relay's control prefix.
        prefix: String,
    },
    /// The login may not execute it.
    #[error(
        "permission denied for {function} as role {role}: GRANT outbox_operator TO {role} (the role sql/09_requeue.sql's -v operator_role names), or pass --postgres-url of a member of it"
    )]
    Refused {
        /// The function.
        function: String,
        /// The login role.
        role: String,
    },
    /// `--event` to a relay that asks Postgres for no logical messages: it would pass the request
    /// unseen, and `requeue` would report it stored.
    #[error(
        "requeue --event {event}: this relay reads no logical messages (outbox.message_prefix and outbox.context_prefix are both \"\"), so it would never see the request: set outbox.message_prefix (default \"outbox\") and restart the relay, or republish the dead letter as docs/recovery.md, \"Requeue one dead letter\", says"
    )]
    NoMessages {
        /// The event id, escaped.
        event: String,
    },
    /// The key is not parked (and no `--force`).
    #[error(
        "{key} is not parked ({parked} lists what is), so there is nothing to {op}: pass --force to send the request anyway"
    )]
    NotParked {
        /// The key, escaped.
        key: String,
        /// `outbox-relay parked` with the `--config` this command ran with.
        parked: String,
        /// `requeue` or `discard`.
        op: &'static str,
    },
    /// Whether the key is parked could not be read from the stream (and no `--force`).
    #[error(
        "cannot tell whether {key} is parked: {why}; pass --force to send the request without checking"
    )]
    ParkedUnknown {
        /// The key, escaped.
        key: String,
        /// Why not, one line.
        why: String,
    },
    /// Any other failure of the call.
    #[error("{function}: {error}")]
    Query {
        /// The function.
        function: &'static str,
        /// The server's message and SQLSTATE.
        error: String,
    },
}
