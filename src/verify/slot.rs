//! Waiting is decided by the slot, never by a clock: a row whose event is not in the stream is
//! `waiting` when the relay's slot still holds it (committed, not yet confirmed), whatever time has
//! passed since. The slot is copied (`pg_copy_logical_replication_slot`, a temporary slot: the copy
//! reads the slot's positions without acquiring it, so a relay streaming the slot is not
//! disturbed, and it goes with this connection) and the copy is peeked up to the rows' snapshot
//! with the relay's own decoder and outbox stage ([`slot_scan::scan_each`]); the id of each pending
//! event is kept as its hash, so memory is 8 bytes per pending event, bounded by the look.
//!
//! What the slot cannot tell stays unknown, never missing: a copy that fails (the role lacks
//! REPLICATION, `max_replication_slots` is reached) or a look that its bound ends first leaves the
//! rows it did not find `unknown`, with one line saying why. A slot that does not exist or was
//! invalidated holds nothing: rows not in the stream are missing (what `backfill` recovers).
//!
//! The look runs on a connection of its own: the rows' snapshot transaction is read-only and stays
//! open for the second look.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio_postgres::Client;

use super::compare::hash64;
use crate::Lsn;
use crate::config::Settings;
use crate::slot_scan::{self, Bound};

/// How long the look may decode (the session's `statement_timeout`).
const LOOK_TIMEOUT: Duration = Duration::from_secs(120);

/// The default bound of the look in changes (`--slot-look`): a backlog of about a million events
/// is told within the timeout on a small machine; past it, rows are unknown, never guessed.
pub const DEFAULT_SLOT_LOOK: u32 = 1_000_000;

/// What the slot says about rows not in the stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Waiting {
    /// The slot confirmed past the rows' snapshot: none of its rows waits.
    Passed,
    /// Every pending event up to the snapshot was looked at: these wait (sorted id hashes).
    Told(Vec<u64>),
    /// The look could not see everything: these wait, the others are not known; and why.
    Unknown {
        /// Sorted id hashes of the pending events the look did see.
        pending: Vec<u64>,
        /// One line.
        why: String,
    },
    /// The slot does not exist or was invalidated: nothing waits in it (and why, one line).
    NoSlot(String),
}

impl Waiting {
    /// Whether the event with id hash `id` waits: `None` when it cannot be told.
    pub(crate) fn waits(&self, id: u64) -> Option<bool> {
        match self {
            Waiting::Passed | Waiting::NoSlot(_) => Some(false),
            Waiting::Told(pending) => Some(pending.binary_search(&id).is_ok()),
            Waiting::Unknown { pending, .. } => pending.binary_search(&id).is_ok().then_some(true),
        }
    }

    /// The line to show the operator, if there is one.
    pub(crate) fn warning(&self) -> Option<&str> {
        match self {
            Waiting::Unknown { why, .. } | Waiting::NoSlot(why) => Some(why),
            Waiting::Passed | Waiting::Told(_) => None,
        }
    }
}

/// Looks into the relay's slot for the events pending up to `snapshot` (the rows' snapshot's WAL
/// position), within `changes` changes.
pub(crate) async fn look(settings: &Settings, snapshot: Option<Lsn>, changes: u32) -> Waiting {
    let slot = settings.config().postgres.slot.clone();
    let cannot = |detail: String| Waiting::Unknown {
        pending: Vec::new(),
        why: format!(
            "replication slot {slot}: cannot copy it to tell waiting rows from missing ones ({detail}); \
             rows not in the stream are counted as unknown (verify needs the REPLICATION attribute, as the \
             relay's role has, and one free slot below max_replication_slots)"
        ),
    };
    let pg = match crate::catalog::connect(settings, "verify").await {
        Ok(pg) => pg,
        Err(e) => return cannot(e.to_string()),
    };
    match state(&pg, &slot, snapshot).await {
        Ok(Some(w)) => return w,
        Ok(None) => {}
        Err(e) => return cannot(server_words(&e)),
    }
    let copy = copy_name();
    if let Err(e) = pg
        .query(
            "SELECT pg_copy_logical_replication_slot($1, $2, true)",
            &[&slot, &copy],
        )
        .await
    {
        return cannot(server_words(&e));
    }
    let looked = peek(settings, &pg, &slot, &copy, snapshot, changes).await;
    let _ = pg
        .query("SELECT pg_drop_replication_slot($1)", &[&copy])
        .await;
    looked
}

/// What the slot's row says before any copy: gone, invalidated, or past the snapshot.
async fn state(
    pg: &Client,
    slot: &str,
    snapshot: Option<Lsn>,
) -> Result<Option<Waiting>, tokio_postgres::Error> {
    // invalidation_reason exists from Postgres 17 on; through to_jsonb the query runs on all.
    let row = pg
        .query_opt(
            "SELECT confirmed_flush_lsn::text, wal_status, to_jsonb(s) ->> 'invalidation_reason' \
             FROM pg_replication_slots s WHERE slot_name = $1",
            &[&slot],
        )
        .await?;
    let Some(row) = row else {
        return Ok(Some(Waiting::NoSlot(format!(
            "replication slot {slot} does not exist: nothing waits in it, so rows not in the stream are missing \
             (docs/recovery.md, recovering with backfill)"
        ))));
    };
    let confirmed: Option<Lsn> = row.get::<_, Option<String>>(0).and_then(|s| s.parse().ok());
    let wal_status: Option<String> = row.get(1);
    let reason: Option<String> = row.get(2);
    if wal_status.as_deref() == Some("lost") || reason.is_some() {
        return Ok(Some(Waiting::NoSlot(format!(
            "replication slot {slot} was invalidated ({}): what it held is lost, so rows not in the stream are \
             missing (docs/recovery.md, recovering with backfill)",
            reason.unwrap_or_else(|| "wal_status lost".to_owned())
        ))));
    }
    match (confirmed, snapshot) {
        (Some(c), Some(s)) if c >= s => Ok(Some(Waiting::Passed)),
        _ => Ok(None),
    }
}

/// Peeks the copy and collects the pending events' id hashes.
async fn peek(
    settings: &Settings,
    pg: &Client,
    slot: &str,
    copy: &str,
    snapshot: Option<Lsn>,
    changes: u32,
) -> Waiting {
    let mut pending: Vec<u64> = Vec::new();
    let bound = Bound {
        changes,
        timeout: LOOK_TIMEOUT,
    };
    let mut each = |f: &slot_scan::Found| pending.push(hash64(f.id.as_bytes()));
    let port = &mut slot_scan::SlotPeek::new(settings, pg, copy);
    let scan = slot_scan::scan_each(settings, port, snapshot, bound, &mut each).await;
    pending.sort_unstable();
    pending.dedup();
    let why = match scan {
        Ok(s) => match s.unfinished {
            None => return Waiting::Told(pending),
            Some(why) => why,
        },
        Err(e) => server_words(&e),
    };
    Waiting::Unknown {
        pending,
        why: format!(
            "replication slot {slot}: the look for waiting events ended early ({why}); rows not in the stream and \
             not seen waiting are counted as unknown (raise --slot-look, or run verify once the relay caught up)"
        ),
    }
}

/// A name for the temporary copy no other session uses.
fn copy_name() -> String {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    format!("outbox_relay_verify_{}_{nanos}", std::process::id())
}

/// The server's words for a failed query.
fn server_words(e: &tokio_postgres::Error) -> String {
    match e.as_db_error() {
        Some(d) => d.message().to_owned(),
        None => e.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_complete_look_says_an_event_does_not_wait() {
        let told = Waiting::Told(vec![3, 7]);
        assert_eq!(told.waits(7), Some(true));
        assert_eq!(told.waits(5), Some(false));
        let partial = Waiting::Unknown {
            pending: vec![3],
            why: "bound".into(),
        };
        assert_eq!(partial.waits(3), Some(true));
        assert_eq!(partial.waits(5), None, "not seen is not known");
        assert_eq!(Waiting::Passed.waits(5), Some(false));
        assert_eq!(Waiting::NoSlot("gone".into()).waits(5), Some(false));
        assert_eq!(partial.warning(), Some("bound"));
        assert_eq!(told.warning(), None);
    }
}
