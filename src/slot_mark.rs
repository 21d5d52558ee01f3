//! The stop mark: how the relay finds out that another client consumed its slot
//! (`pg_logical_slot_get_changes`) or advanced it (`pg_replication_slot_advance`) past outbox
//! events while no relay streamed it. Those events are never sent to the relay again, so without
//! this nothing would say they are missing from the stream.
//!
//! The slot alone cannot tell: its `confirmed_flush_lsn` moves past the stream's last event in
//! normal operation too (an idle relay confirms the walsender's keepalive positions, P5), and the
//! WAL below it can no longer be decoded through it. So when a session ends while it still holds
//! the slot, the relay copies it (`pg_copy_logical_replication_slot`, a logical slot named
//! [`name`]) at that position. The next session, once it holds the slot, peeks the copy up to the
//! slot's position and counts the outbox events past the stream's last one:
//!
//! - none: whatever moved the slot skipped no event the stream lacks (a normal restart, an idle
//!   period, another relay of this slot that streamed in between): the mark is dropped;
//! - some: they were consumed by someone else. The mark is kept, as the evidence `status` reads
//!   and so the relay refuses to stream on past them (each retry finds them again, or keeps what
//!   it found when it can no longer compare) until the operator recovers with `backfill` and drops
//!   the mark, or drops it to accept the gap.
//!
//! The rule compares events, not positions, so no position the relay itself confirmed can raise
//! it: an event before the mark's position was streamed before the mark was made, and one between
//! the mark and the slot that a relay published is at or before the stream's last message (the
//! stream holds a gap-free prefix of the outbox in commit order). A mark is never left behind while
//! a session streams: it is made only while the ending session's walsender still holds the slot,
//! and every session start drops it unless it holds evidence, so it retains no WAL the slot does
//! not retain itself. What it cannot see: a relay that died without ending its session (kill -9,
//! a crash, Postgres going away first) leaves no mark, and a stream whose last message is gone or
//! not the relay's gives nothing to compare with; both are said in the log, never guessed.
//!
//! The session's start reads the mark through a port ([`MarkPort`]: where it stands, a peek of it,
//! dropping it): [`PgMarks`] over a control connection, or the deterministic simulation's Postgres,
//! so both run [`at_start`] and the rule behind it.

use std::fmt;
use std::future::Future;
use std::time::Duration;

use tokio_postgres::Client;

use crate::Lsn;
use crate::config::Settings;
use crate::nats::NatsPort;
use crate::position::Position;
use crate::slot_scan::{self, Bound, Found, PeekPort, SlotPeek};
use crate::source::SystemInfo;
use crate::tail::{Origin, Tail};

/// The mark's name: the slot's with `_mark`, cut to Postgres' 63 bytes.
pub(crate) fn name(slot: &str) -> String {
    const SUFFIX: &str = "_mark";
    let keep = slot.len().min(63 - SUFFIX.len());
    // Slot names are [a-z0-9_]: any byte is a character boundary.
    format!("{}{SUFFIX}", &slot[..keep])
}

/// How far the stream is known to hold this slot's events.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Stored {
    /// Every event through this position (`None`: the stream holds none).
    Through(Option<Position>),
    /// Not known, and why.
    Unknown(String),
}

impl Stored {
    /// From the stream's tail: its last message's position, when a relay wrote it in the history
    /// `origin` streams, by the rule the replay trusts a tail by ([`crate::tail::judge`]: this system
    /// and slot, this timeline or an ancestor below its switch point, not past the server's WAL).
    /// With `origin` `None`, only the slot is compared: `status` knows no timeline.
    pub(crate) fn from_tail(tail: &Tail, slot: &str, origin: Option<&Origin>) -> Stored {
        if tail.last_sequence == 0 {
            return Stored::Through(None);
        }
        let Some(last) = &tail.last else {
            return Stored::Unknown(format!(
                "the stream's last message (sequence {}) is gone (limits or a purge)",
                tail.last_sequence
            ));
        };
        if let Some(origin) = origin {
            return match crate::tail::judge(last, origin) {
                Ok((p, _)) => Stored::Through(Some(p)),
                Err(why) => Stored::Unknown(why.to_string()),
            };
        }
        match (&last.position, &last.history) {
            (Some(p), Some(h)) if h.slot == slot => Stored::Through(Some(*p)),
            (Some(_), Some(h)) => Stored::Unknown(format!(
                "the stream's last message is from another history ({h})"
            )),
            _ => Stored::Unknown(
                "the stream's last message was not written by this relay (no Outbox-Position)"
                    .into(),
            ),
        }
    }
}

/// Outbox events between the mark and the slot's position that the stream lacks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Consumed {
    /// `postgres.slot`.
    pub(crate) slot: String,
    /// The backfill command that recovers, with the settings' `--config`.
    pub(crate) recover: String,
    /// Where the last session left the slot (the mark's position).
    pub(crate) mark_at: Lsn,
    /// Where the slot stands now.
    pub(crate) slot_at: Lsn,
    /// How many events were counted, and whether that is all of them.
    pub(crate) events: u64,
    /// The count stopped at the look's bound.
    pub(crate) at_least: bool,
    /// The first of them.
    pub(crate) first: Found,
    /// The last of them counted.
    pub(crate) last: Found,
}

impl fmt::Display for Consumed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "replication slot {slot} was moved from {from} to {to} by a client other than a relay \
             (pg_logical_slot_get_changes or pg_replication_slot_advance) past {least}{n} outbox events the stream lacks \
             (the first {first_id} at {first_pos}, the last {last_id} at {last_pos}): they will never be sent again. \
             Stop every relay for the slot, recover with {recover} (see docs/recovery.md), then drop the mark \
             with SELECT pg_drop_replication_slot('{mark}') (dropping it without a backfill accepts the gap)",
            slot = self.slot,
            from = self.mark_at,
            to = self.slot_at,
            least = if self.at_least { "at least " } else { "" },
            n = self.events,
            first_id = self.first.id,
            first_pos = self.first.position,
            last_id = self.last.id,
            last_pos = self.last.position,
            mark = name(&self.slot),
            recover = self.recover,
        )
    }
}

/// What the start of a session found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Check {
    /// No mark: the last session did not end cleanly, or this is the first.
    NoMark,
    /// The mark showed no event the stream lacks; it has been dropped.
    Clean,
    /// Events were consumed by someone else; the mark stays.
    Consumed(Consumed),
    /// The mark could not be judged (and was dropped, so it retains no WAL): why.
    Unknown(String),
}

/// The mark's `confirmed_flush_lsn`, if there is a mark.
async fn mark_position(pg: &Client, mark: &str) -> Result<Option<Lsn>, tokio_postgres::Error> {
    let row = pg
        .query_opt(
            "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1",
            &[&mark],
        )
        .await?;
    Ok(row
        .and_then(|r| r.get::<_, Option<String>>(0))
        .and_then(|t| t.parse().ok()))
}

/// The stop mark as a session's start reads it: where it stands, a peek of its changes, and
/// dropping it. The real port is [`PgMarks`]; the deterministic simulation's reads its own Postgres.
pub trait MarkPort: Send {
    /// What a read failed with (said in the log as why the mark could not be judged).
    type Error: fmt::Display + Send;
    /// The peek of the mark's changes.
    type Peek: PeekPort<Error = Self::Error>;
    /// The mark's `confirmed_flush_lsn` (`None`: there is no mark).
    fn position(&mut self) -> impl Future<Output = Result<Option<Lsn>, Self::Error>> + Send;
    /// The mark's changes, to be looked at ([`scan_mark`]).
    fn peek(&mut self) -> &mut Self::Peek;
    /// Drops the mark if there is one.
    fn drop_mark(&mut self) -> impl Future<Output = Result<(), Self::Error>> + Send;
}

/// The real [`MarkPort`]: the mark of `postgres.slot`, over a control connection.
pub(crate) struct PgMarks<'a> {
    settings: &'a Settings,
    pg: &'a Client,
    peek: SlotPeek<'a>,
}

impl<'a> PgMarks<'a> {
    /// The mark of `settings`' slot, over `pg`.
    pub(crate) fn new(settings: &'a Settings, pg: &'a Client) -> Self {
        PgMarks {
            settings,
            pg,
            peek: peek_mark(settings, pg),
        }
    }
}

/// Peeks of the mark of `settings`' slot over `pg` (`status` looks at it through this too).
pub(crate) fn peek_mark<'a>(settings: &'a Settings, pg: &'a Client) -> SlotPeek<'a> {
    SlotPeek::new(settings, pg, name(&settings.config().postgres.slot))
}

impl<'a> MarkPort for PgMarks<'a> {
    type Error = tokio_postgres::Error;
    type Peek = SlotPeek<'a>;

    async fn position(&mut self) -> Result<Option<Lsn>, tokio_postgres::Error> {
        mark_at(self.settings, self.pg).await
    }

    fn peek(&mut self) -> &mut SlotPeek<'a> {
        &mut self.peek
    }

    async fn drop_mark(&mut self) -> Result<(), tokio_postgres::Error> {
        drop_mark(self.settings, self.pg).await
    }
}

/// Judges the mark against the slot at `slot_at` and what the stream holds, without dropping it:
/// the relay's start decides what to keep ([`check`]); `status` judges through [`judge_from`] over
/// its own servers' answers ([`mark_at`], [`scan_mark`]).
async fn judge<M: MarkPort>(
    settings: &Settings,
    marks: &mut M,
    slot_at: Lsn,
    stored: &Stored,
) -> Result<Check, M::Error> {
    let mark_at = marks.position().await?;
    let peek = marks.peek();
    judge_from(settings, mark_at, slot_at, stored, move |after| {
        scan_mark(settings, peek, slot_at, after)
    })
    .await
}

/// The mark's position, if there is a mark.
pub(crate) async fn mark_at(
    settings: &Settings,
    pg: &Client,
) -> Result<Option<Lsn>, tokio_postgres::Error> {
    mark_position(pg, &name(&settings.config().postgres.slot)).await
}

/// The outbox events the mark (peeked through `peek`) holds up to `slot_at`, past `after`, within
/// [`Bound::DEFAULT`].
pub async fn scan_mark<P: PeekPort>(
    settings: &Settings,
    peek: &mut P,
    slot_at: Lsn,
    after: Option<Position>,
) -> Result<slot_scan::Scan, P::Error> {
    slot_scan::scan(settings, peek, Some(slot_at), after, false, Bound::DEFAULT).await
}

/// [`judge`] once the mark's position (`mark_at`, `None`: no mark) is known; `scan` counts the
/// events the mark holds up to `slot_at` past the position it is given (a real server's peek, or a
/// simulated one's).
pub(crate) async fn judge_from<E, F, Fut>(
    settings: &Settings,
    mark_at: Option<Lsn>,
    slot_at: Lsn,
    stored: &Stored,
    scan: F,
) -> Result<Check, E>
where
    F: FnOnce(Option<Position>) -> Fut,
    Fut: std::future::Future<Output = Result<slot_scan::Scan, E>>,
{
    let Some(mark_at) = mark_at else {
        return Ok(Check::NoMark);
    };
    if mark_at >= slot_at {
        return Ok(Check::Clean);
    }
    let after = match stored {
        Stored::Through(p) => *p,
        Stored::Unknown(why) => return Ok(Check::Unknown(why.clone())),
    };
    let scan = scan(after).await?;
    Ok(match (scan.first, scan.last) {
        (Some(first), Some(last)) => Check::Consumed(Consumed {
            slot: settings.config().postgres.slot.clone(),
            recover: settings.command("backfill"),
            mark_at,
            slot_at,
            events: scan.events,
            at_least: scan.unfinished.is_some(),
            first,
            last,
        }),
        _ => match scan.unfinished {
            Some(why) => Check::Unknown(format!(
                "the WAL from {mark_at} to {slot_at} could not be read to the end: {why}"
            )),
            None => Check::Clean,
        },
    })
}

/// What a session's start finds of its slot (`crate::relay::Connector::slot_check`): its position,
/// and the stop mark's judgement.
#[derive(Debug, Clone, Default)]
pub struct SlotCheck {
    /// The slot's `confirmed_flush_lsn` (`None`: it could not be read).
    pub(crate) confirmed: Option<Lsn>,
    /// Another client consumed the slot past events the stream lacks.
    pub(crate) consumed: Option<Consumed>,
    /// Why that could not be told, when it could not (for the log).
    pub(crate) unknown: Option<String>,
}

impl SlotCheck {
    /// The slot stands at `confirmed`; nothing else is known.
    pub fn at(confirmed: Lsn) -> Self {
        SlotCheck {
            confirmed: Some(confirmed),
            ..SlotCheck::default()
        }
    }

    /// What the stop mark's judgement (`slot_mark::check`) adds.
    pub(crate) fn judged<E: std::fmt::Display>(&mut self, found: Result<Check, E>) {
        match found {
            Ok(Check::Consumed(c)) => self.consumed = Some(c),
            Ok(Check::Unknown(why)) => self.unknown = Some(why),
            Ok(Check::NoMark | Check::Clean) => {}
            Err(e) => self.unknown = Some(format!("the stop mark cannot be read: {e}")),
        }
    }
}

/// Whether a session start keeps the mark after `found`: evidence stays; anything else goes, also
/// when it could not be judged: a mark left behind a streaming session would keep WAL for as long
/// as that session lasts.
fn keeps<E>(found: &Result<Check, E>) -> bool {
    matches!(found, Ok(Check::Consumed(_) | Check::NoMark))
}

/// What a look that cannot compare (`found` is [`Check::Unknown`]) keeps of an earlier one: the
/// consumption this process `reported` of the same mark (the mark still at `mark_at`) stands, and
/// so does the mark. The stream's last message can go between two looks (aged out by `max_age`, a
/// purge): the events the mark showed are missing all the same, and a retry that let go of the
/// evidence then would stream on past them before anyone saw the report. A mark made since (the
/// operator dropped the old one) stands elsewhere and is judged on its own.
fn still_reported<E>(
    found: Result<Check, E>,
    mark_at: Option<Lsn>,
    reported: Option<&Consumed>,
) -> Result<Check, E> {
    match (&found, reported) {
        (Ok(Check::Unknown(_)), Some(r)) if mark_at == Some(r.mark_at) => {
            Ok(Check::Consumed(r.clone()))
        }
        _ => found,
    }
}

/// The start of a session that holds the slot at `slot_at`: [`judge`], then drops the mark unless
/// it holds evidence (also what this process `reported` of it before, [`still_reported`]).
async fn check<M: MarkPort>(
    settings: &Settings,
    marks: &mut M,
    slot_at: Lsn,
    stored: &Stored,
    reported: Option<&Consumed>,
) -> Result<Check, M::Error> {
    let mut found = judge(settings, marks, slot_at, stored).await;
    if let (Ok(Check::Unknown(_)), Some(_)) = (&found, reported) {
        let mark_at = marks.position().await?;
        found = still_reported(found, mark_at, reported);
    }
    if !keeps(&found) {
        marks.drop_mark().await?;
    }
    found
}

/// What the start of a session that holds the slot at `slot_at` finds (`Connector::slot_check`,
/// `system`: what its `IDENTIFY_SYSTEM` said): the stream's tail read through `nats` and trusted by
/// the replay's rule, then the mark read through `marks`, judged against it, and dropped unless it
/// holds evidence ([`check`]).
pub async fn at_start<M: MarkPort>(
    settings: &Settings,
    system: &SystemInfo,
    nats: &NatsPort,
    slot_at: Lsn,
    marks: &mut M,
    reported: Option<&Consumed>,
) -> SlotCheck {
    let slot = &settings.config().postgres.slot;
    let origin = Origin::of(
        &system.system_id,
        system.timeline,
        system.xlogpos,
        &system.history,
        slot,
    );
    let stored =
        match crate::tail::read_tail(nats, &settings.config().nats.stream, settings.ack_timeout)
            .await
        {
            Ok(tail) => Stored::from_tail(&tail, slot, Some(&origin)),
            Err(e) => Stored::Unknown(format!(
                "the stream's tail cannot be read: {}",
                crate::error_chain::error_chain(&e)
            )),
        };
    let mut out = SlotCheck::at(slot_at);
    out.judged(check(settings, marks, slot_at, &stored, reported).await);
    out
}

/// Drops the mark if there is one. A mark `status` is peeking at is busy for a few seconds at
/// most: waited for, so that no mark is left behind a streaming session.
pub(crate) async fn drop_mark(
    settings: &Settings,
    pg: &Client,
) -> Result<(), tokio_postgres::Error> {
    let deadline = tokio::time::Instant::now() + Bound::DEFAULT.timeout + Duration::from_secs(2);
    loop {
        let dropped = pg
            .execute(
                "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = $1",
                &[&name(&settings.config().postgres.slot)],
            )
            .await;
        match dropped {
            Err(e) if slot_scan::in_use(&e) && tokio::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
            other => return other.map(|_| ()),
        }
    }
}

/// The end of a session whose walsender (`walsender_pid`) still holds the slot, having confirmed
/// `confirmed`: leaves a mark at the slot's position, unless one is there already (an older mark
/// covers more, and one that holds evidence must stay). Only while the walsender holds the slot, so
/// no mark is made after another relay took the slot over (it would retain WAL behind that relay's
/// back). The walsender applies the final status update a moment after it is sent: the copy waits
/// (briefly) until the slot shows `confirmed`, so that a clean stop leaves nothing between the mark
/// and the slot for the next start to look at. Returns whether a mark was made.
pub(crate) async fn leave(
    settings: &Settings,
    pg: &Client,
    walsender_pid: i32,
    confirmed: Lsn,
) -> Result<bool, tokio_postgres::Error> {
    let slot = &settings.config().postgres.slot;
    let until = tokio::time::Instant::now() + Duration::from_secs(2);
    loop {
        let row = pg
            .query_opt(
                "SELECT confirmed_flush_lsn::text FROM pg_replication_slots \
                 WHERE slot_name = $1 AND active_pid = $2",
                &[slot, &walsender_pid],
            )
            .await?;
        let Some(row) = row else {
            // The walsender let the slot go (or another took it): no mark.
            return Ok(false);
        };
        let at: Option<Lsn> = row.get::<_, Option<String>>(0).and_then(|t| t.parse().ok());
        if at.is_some_and(|a| a >= confirmed) || tokio::time::Instant::now() >= until {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let made = pg
        .execute(
            "SELECT pg_copy_logical_replication_slot(slot_name, $2, false) FROM pg_replication_slots \
             WHERE slot_name = $1 AND active_pid = $3 \
             AND NOT EXISTS (SELECT 1 FROM pg_replication_slots WHERE slot_name = $2)",
            &[slot, &name(slot), &walsender_pid],
        )
        .await?;
    Ok(made > 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::position::History;
    use crate::tail::Stamp;

    fn history(slot: &str) -> History {
        History {
            system_id: "7311234567890123456".into(),
            timeline: 1,
            slot: slot.into(),
        }
    }

    /// A session on `timeline` of the system `history` names, whose server's WAL reaches 0/1000;
    /// `file`: the timeline's history file (empty for timeline 1 or one that names no ancestor).
    fn origin(timeline: u32, file: &str) -> Origin {
        Origin {
            history: History {
                timeline,
                ..history("s")
            },
            wal_end: Lsn(0x1000),
            timelines: if file.is_empty() {
                crate::timeline::TimelineHistory::root(timeline)
            } else {
                crate::timeline::TimelineHistory::parse(timeline, file).unwrap()
            },
        }
    }

    fn tail(last: Option<Stamp>) -> Tail {
        Tail {
            last_sequence: 9,
            last,
            max_msg_size: None,
        }
    }

    #[test]
    fn the_mark_is_named_for_the_slot_within_postgres_limit() {
        assert_eq!(name("outbox_relay"), "outbox_relay_mark");
        let long = "s".repeat(63);
        assert_eq!(name(&long).len(), 63);
        assert!(name(&long).ends_with("_mark"));
    }

    #[test]
    fn only_a_tail_this_relay_wrote_in_this_history_says_how_far_the_stream_holds() {
        let p = Position::in_transaction(Lsn(0x10), 2);
        let ours = Stamp {
            position: Some(p),
            history: Some(history("s")),
            id: Some("e-1".into()),
            replay_over: None,
        };
        assert_eq!(
            Stored::from_tail(&tail(Some(ours.clone())), "s", Some(&origin(1, ""))),
            Stored::Through(Some(p))
        );
        assert_eq!(
            Stored::from_tail(&tail(Some(ours.clone())), "s", None),
            Stored::Through(Some(p)),
            "status compares the slot only"
        );
        let empty = Tail {
            last_sequence: 0,
            last: None,
            max_msg_size: None,
        };
        assert_eq!(Stored::from_tail(&empty, "s", None), Stored::Through(None));
        for (t, slot, why) in [
            (tail(None), "s", "gone"),
            (tail(Some(ours.clone())), "other", "another history"),
            (
                tail(Some(Stamp::default())),
                "s",
                "not written by this relay",
            ),
        ] {
            match Stored::from_tail(&t, slot, None) {
                Stored::Unknown(w) => assert!(w.contains(why), "{w}"),
                other => panic!("{other:?}"),
            }
        }
        // A promoted server (timeline 2, branched off timeline 1 at 0/20): the old timeline's tail
        // below the switch point is this history's, at or past it is not; a timeline 2 that names
        // no ancestor, or a tail past the server's WAL (a restore behind it), is not either.
        let promoted = origin(2, "1\t0/20\tno recovery target specified\n");
        assert_eq!(
            Stored::from_tail(&tail(Some(ours.clone())), "s", Some(&promoted)),
            Stored::Through(Some(p))
        );
        let mut past = ours.clone();
        past.position = Some(Position::in_transaction(Lsn(0x20), 0));
        let mut ahead = origin(1, "");
        ahead.wal_end = Lsn(0x10);
        for (t, origin, why) in [
            (tail(Some(past)), promoted, "at or past"),
            (tail(Some(ours.clone())), origin(2, ""), "another history"),
            (tail(Some(ours)), ahead, "beyond the server's WAL"),
        ] {
            match Stored::from_tail(&t, "s", Some(&origin)) {
                Stored::Unknown(w) => assert!(w.contains(why), "{why}: {w}"),
                other => panic!("{why}: {other:?}"),
            }
        }
    }

    #[test]
    fn the_report_names_the_slot_the_events_and_the_recovery_on_one_line() {
        let found = |id: &str, lsn| Found {
            id: id.into(),
            position: Position::in_transaction(Lsn(lsn), 0),
        };
        let c = Consumed {
            slot: "outbox_relay".into(),
            recover: "`outbox-relay --config /etc/relay.toml backfill`".into(),
            mark_at: Lsn(0x100),
            slot_at: Lsn(0x900),
            events: 3,
            at_least: false,
            first: found("e-1", 0x200),
            last: found("e-3", 0x800),
        };
        let text = c.to_string();
        for part in [
            "replication slot outbox_relay was moved from 0/100 to 0/900",
            "past 3 outbox events the stream lacks",
            "the first e-1 at 0/200:0",
            "recover with `outbox-relay --config /etc/relay.toml backfill`",
            "pg_drop_replication_slot('outbox_relay_mark')",
        ] {
            assert!(text.contains(part), "{part}: {text}");
        }
        assert!(!text.contains('\n'));
    }
}
