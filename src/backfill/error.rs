//! Why a backfill did not finish ([`BackfillError`]: one line naming the object and the fix), and
//! the text a stopped backfill gives of what it leaves behind ([`left_after_stop`]): the slot it
//! created or replaced, and the marker that keeps `run` and `setup` from starting with a gap.

use super::port::{BoxError, QueryError};
use crate::backfill_marker::{self, MarkerError};
use crate::nats::ConnectError;
use crate::outbox::StageError;
use crate::setup::SetupError;
use crate::sink::{SinkError, TailError};
use crate::source::SourceError;

/// Why a backfill did not finish. One line naming the object and the fix.
#[derive(Debug, thiserror::Error)]
pub enum BackfillError {
    /// A setting the backfill cannot run with (`outbox.schemas` that does not load).
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    /// Setup failed: a check, or creating the publication or the stream.
    #[error(transparent)]
    Setup(#[from] SetupError),
    /// `--order-by` contains `;`.
    #[error(
        "--order-by {0:?} contains ';': give only the sort keys, e.g. --order-by \"created_at, event_id\""
    )]
    OrderBy(String),
    /// The slot exists and a walsender streams it.
    #[error(
        "replication slot {slot} is in use by PID {pid} (a relay streams it): backfill creates the slot anew and \
         must not run beside a relay; stop every relay for this slot (standbys too), then run backfill again. \
         Nothing was changed"
    )]
    SlotActive {
        /// The slot's name.
        slot: String,
        /// The process id of the walsender that streams it.
        pid: i32,
    },
    /// The slot exists, is inactive, and `--replace-slot` was not given.
    #[error(
        "replication slot {slot} already exists ({found}). backfill creates the slot at the snapshot it reads the \
         rows in, so it has to replace this one, and whatever the old slot still holds is then published only if \
         --where selects it. If that is what you want, stop every relay for this slot and run {replace}; if the \
         slot is healthy, {run} needs no backfill. Nothing was changed"
    )]
    SlotExists {
        /// The slot's name.
        slot: String,
        /// What the slot is like: invalidated, or where it is confirmed up to.
        found: String,
        /// This backfill again, with `--replace-slot` (`again`).
        replace: String,
        /// `outbox-relay run` with these settings.
        run: String,
    },
    /// Dropping the existing slot (`--replace-slot`) failed.
    #[error("cannot drop replication slot {slot} (to replace it)")]
    DropSlot {
        /// The slot's name.
        slot: String,
        /// The server's error.
        #[source]
        source: BoxError,
    },
    /// A connection to Postgres could not be opened.
    #[error("cannot connect to Postgres at {target} (check {check})")]
    Postgres {
        /// `postgres.url`, with the password masked.
        target: String,
        /// Where `postgres.url` was set: its variable, or the file (`Settings::key_source`).
        check: String,
        /// Why the connection failed.
        #[source]
        source: SourceError,
    },
    /// Creating the slot with an exported snapshot failed.
    #[error(
        "cannot create replication slot {slot} with an exported snapshot (the role needs REPLICATION; see \
         sql/03_relay_role.sql)"
    )]
    CreateSlot {
        /// The slot's name.
        slot: String,
        /// Why it failed.
        #[source]
        source: SourceError,
    },
    /// The check of `--where` and `--order-by`, before any slot is touched, failed: no slot (and so no
    /// snapshot) exists for it yet, so the text must not say it read one.
    #[error("checking {what} on {table} failed, before any slot was created or changed: {message}")]
    Preflight {
        /// The outbox table.
        table: String,
        /// What was checked.
        what: String,
        /// The server's error.
        message: QueryError,
    },
    /// The role may not read the outbox table (SQLSTATE 42501): the grant is what is missing, not
    /// anything in `--where` or `--order-by`.
    #[error(
        "role {role} may not read {table} ({message}), which backfill reads its rows from: as the table's owner, \
         GRANT SELECT ON {table} TO {role} (sql/03_relay_role.sql does it: psql -v outbox_table={table} -v \
         relay_role={role} -f sql/03_relay_role.sql). Nothing was changed"
    )]
    NoSelect {
        /// The outbox table.
        table: String,
        /// The role the relay connects as.
        role: String,
        /// The server's error.
        message: QueryError,
    },
    /// A query reading the outbox table in the snapshot failed.
    #[error("reading {table} in the slot's snapshot failed ({what}): {message}")]
    Query {
        /// The outbox table.
        table: String,
        /// What the query was for.
        what: String,
        /// The server's error.
        message: QueryError,
    },
    /// NATS cannot be reached or refuses the relay.
    #[error(transparent)]
    Nats(#[from] ConnectError),
    /// The stream's tail cannot be read.
    #[error(transparent)]
    Tail(#[from] TailError),
    /// Publishing failed part way; the new slot was dropped, the marker stays.
    #[error(
        "backfill stopped after {done} of {total} rows, and the slot it created was dropped; its marker on the \
         stream keeps `run` and `setup` from starting with a gap: fix the cause and run {again} again (JetStream \
         drops the rows it already holds)"
    )]
    Publish {
        /// Rows handed to the sink before the failure.
        done: u64,
        /// Rows to backfill.
        total: u64,
        /// This backfill again (`again`; filled in by the caller that knows the options).
        again: String,
        /// Why publishing failed (boxed: the sink's errors are large, and this path is rare).
        #[source]
        source: Box<SinkError>,
    },
    /// The outbox stage could not interpret the rows fed to it.
    #[error("backfill")]
    Stage(#[from] StageError),
    /// SIGINT or SIGTERM before any slot was dropped or created.
    #[error("backfill stopped by {signal} before it changed any slot: nothing was changed")]
    StoppedEarly {
        /// The signal.
        signal: &'static str,
    },
    /// SIGINT or SIGTERM once a slot was dropped or created: the new slot was dropped, the marker
    /// stays.
    #[error(
        "backfill stopped by {signal} {progress}: {left}. To finish, run {command} again (JetStream drops the \
         rows it already holds)"
    )]
    Stopped {
        /// The signal.
        signal: &'static str,
        /// How far it got: `after 3000 of 30000 rows`, `while it created its slot`.
        progress: String,
        /// What is left: the marker, and the slot if it could not be dropped.
        left: String,
        /// The command that repeats this backfill (`again`), in backticks.
        command: String,
    },
    /// The backfill marker could not be set (nothing was changed) or read.
    #[error(transparent)]
    Marker(#[from] MarkerError),
    /// Every row is stored and the slot is ready, but the marker could not be removed.
    #[error(
        "backfill stored every row and slot {slot} is ready, but its marker could not be removed, so `run` and \
         `setup` still refuse: fix the cause and run {again} again"
    )]
    MarkerLeft {
        /// The slot.
        slot: String,
        /// This backfill again (`again`).
        again: String,
        /// Why the marker stays.
        #[source]
        source: MarkerError,
    },
    /// More than `u32::MAX` rows match.
    #[error(
        "backfill of more than {} rows in one run: split it with --where",
        u32::MAX
    )]
    TooManyRows,
}

/// This backfill's command again, to copy: its own `--where` and `--order-by` (the operator's, given
/// to this process: never read from stream metadata) and, with `replace_slot`, `--replace-slot`,
/// with the `--config` and variables it ran with (`Settings::command`).
pub(super) fn again(
    settings: &crate::config::Settings,
    opts: &super::BackfillOptions,
    replace_slot: bool,
) -> String {
    let mut args = "backfill".to_owned();
    if let Some(w) = &opts.where_sql {
        args.push_str(&format!(" --where {}", shell_quote(w)));
    }
    if let Some(o) = &opts.order_by {
        args.push_str(&format!(" --order-by {}", shell_quote(o)));
    }
    if replace_slot {
        args.push_str(" --replace-slot");
    }
    settings.command(&args)
}

/// `s` in single quotes for a POSIX shell.
fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// What became of the slot when a backfill stopped.
#[derive(Clone, Copy)]
pub(super) enum SlotLeft {
    /// The slot it created was dropped.
    NewDropped,
    /// The old slot was dropped (`--replace-slot`, or one an unfinished backfill left); no new
    /// one was made.
    OldDropped,
    /// A slot could not be dropped and is still there.
    Kept,
}

/// What a stopped backfill leaves, for [`BackfillError::Stopped`].
pub(super) fn left_after_stop(slot: &str, stream: &str, what: SlotLeft) -> String {
    let marker = format!(
        "the backfill marker {} on stream {stream}, which keeps `run` and `setup` from starting until a backfill \
         finishes",
        backfill_marker::META_BACKFILL
    );
    match what {
        SlotLeft::NewDropped => {
            format!("the slot {slot} it created was dropped, and nothing is left but {marker}")
        }
        SlotLeft::OldDropped => format!(
            "the existing slot {slot} was dropped to be replaced and no new one was made, and nothing is left \
             but {marker}"
        ),
        SlotLeft::Kept => format!(
            "the slot {slot} could not be dropped (see the warning above); left are that slot and {marker}"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stop_says_what_is_left_and_how_to_finish() {
        let e = BackfillError::Stopped {
            signal: "SIGTERM",
            progress: "after 3000 of 30000 rows".into(),
            left: left_after_stop("outbox_relay", "OUTBOX", SlotLeft::NewDropped),
            command: "`outbox-relay backfill --where 'x'`".into(),
        };
        let text = e.to_string();
        assert!(!text.contains('\n'), "{text}");
        assert!(
            text.starts_with("backfill stopped by SIGTERM after 3000 of 30000 rows"),
            "{text}"
        );
        assert!(
            text.contains("outbox_relay it created was dropped"),
            "{text}"
        );
        assert!(
            text.contains("outbox-relay.backfill on stream OUTBOX"),
            "{text}"
        );
        assert!(
            text.contains("run `outbox-relay backfill --where 'x'` again"),
            "{text}"
        );
        let kept = left_after_stop("outbox_relay", "OUTBOX", SlotLeft::Kept);
        assert!(kept.contains("could not be dropped"), "{kept}");
        let old = left_after_stop("outbox_relay", "OUTBOX", SlotLeft::OldDropped);
        assert!(old.contains("no new one was made"), "{old}");
    }

    #[test]
    fn again_repeats_the_operators_own_options_with_the_config() {
        let mut settings = crate::config::Config::default().validate().unwrap();
        let opts = super::super::BackfillOptions {
            where_sql: Some("kind <> 'x'".into()),
            order_by: None,
            replace_slot: false,
        };
        assert_eq!(
            again(&settings, &opts, true),
            r"`outbox-relay backfill --where 'kind <> '\''x'\''' --replace-slot`"
        );
        settings.origin.file = Some("/etc/relay.toml".into());
        assert_eq!(
            again(&settings, &super::super::BackfillOptions::default(), false),
            "`outbox-relay --config /etc/relay.toml backfill`"
        );
    }
}
