//! Where a published message comes from: its [`Position`] in one WAL history and that history's
//! name, [`History`]. Both travel in one header, `Outbox-Position: SYSTEM/TIMELINE/SLOT/X/Y:I`
//! ([`stamp`], [`parse_stamp`]), so that a new session can tell, from the stream's last message
//! alone, which of the events the walsender sends again are already stored — without guessing from
//! commit LSNs or ids. One header, not two: each header costs the relay a map entry and nats-server
//! its bytes on every message.
//!
//! A position has a sub-index too, 0 for every event (printed `X/Y:I`, unchanged) and counting the
//! messages a control message expands to (`X/Y:I.S`): a release of a parked key takes one index
//! in its transaction and publishes a marker and the key's run at sub-indexes 0, 1, 2, …
//!
//! Why a position and not the commit LSN: two units of work can share a commit LSN. A
//! non-transactional logical message's LSN is the *end* of its WAL record, and the next record can be
//! the COMMIT of another transaction, whose commit LSN is then the same number. Positions are unique
//! and totally ordered within one history, in the order the walsender sends them:
//!
//! - an event of a transaction: (commit LSN, its index among the transaction's outbox events);
//! - a non-transactional message: (its LSN − 1, 0). Its record starts before that and every commit
//!   the walsender sends after it starts at or after its LSN; WAL records start on 8-byte
//!   boundaries, so no commit starts at an odd-by-one LSN;
//! - a backfilled row: (the slot's consistent point − 1, the cursor's index), before every commit
//!   the slot sends and after every commit the snapshot shows.
//!
//! Why a history: positions are WAL offsets, and the same offset means another event in another
//! database, on another timeline (point-in-time recovery, promotion) or after a restore from a disk
//! snapshot (same system and timeline, the WAL after the snapshot written anew). The first two are
//! told by `IDENTIFY_SYSTEM`; the slot name keeps two relays' positions apart. A new timeline keeps
//! its ancestors' WAL below the point where each ended (`TIMELINE_HISTORY`,
//! [`crate::source::TimelineHistory`]), so there an older timeline's position still names the same
//! event. A restore is not
//! visible in any identifier: [`crate::sink::Replay`] checks that the walsender's events reach the
//! tail's position with the tail's own event before it trusts anything it skipped.

use std::fmt;
use std::str::FromStr;

use crate::Lsn;

/// A message's place in one slot's history (see the module docs). Ordered by LSN, then index,
/// then sub-index.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Position {
    /// The commit LSN of the event's transaction, or the LSN a standalone message or backfilled
    /// row is placed at.
    pub(crate) lsn: Lsn,
    /// Its index within that LSN (insert order within a transaction, cursor order in a backfill).
    pub(crate) index: u32,
    /// Its place among the messages one unit of work expands to: 0 for an event (its one
    /// message); a control message that releases a parked key takes one index and its messages
    /// (the release marker, then the run's events) are sub-indexes 0, 1, 2, … of it.
    pub(crate) sub: u32,
}

impl Position {
    /// The position of event `index` of the transaction committed at `commit_lsn`.
    pub fn in_transaction(commit_lsn: Lsn, index: u32) -> Self {
        Position {
            lsn: commit_lsn,
            index,
            sub: 0,
        }
    }

    /// The `sub`-th message of the unit of work at this position.
    pub fn with_sub(self, sub: u32) -> Self {
        Position { sub, ..self }
    }

    /// The position of a non-transactional message whose WAL record ends at `lsn`.
    pub(crate) fn standalone(lsn: Lsn) -> Self {
        Position {
            lsn: Lsn(lsn.0.saturating_sub(1)),
            index: 0,
            sub: 0,
        }
    }
}

impl fmt::Display for Position {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.lsn, self.index)?;
        if self.sub != 0 {
            write!(f, ".{}", self.sub)?;
        }
        Ok(())
    }
}

/// Text that is not a position (`X/Y:I` or `X/Y:I.S`) or not a history (`SYSTEM/TIMELINE/SLOT`).
#[derive(Debug, thiserror::Error)]
#[error("invalid {what} {text:?}: expected {form}")]
pub struct ParseError {
    what: &'static str,
    text: String,
    form: &'static str,
}

impl FromStr for Position {
    type Err = ParseError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = || ParseError {
            what: "position",
            text: s.to_owned(),
            form: "an LSN and an index, like 16/B374D848:3 (or 16/B374D848:3.1)",
        };
        let (lsn, index) = s.trim().rsplit_once(':').ok_or_else(err)?;
        let (index, sub) = match index.split_once('.') {
            Some((i, sub)) => (i, sub.parse().map_err(|_| err())?),
            None => (index, 0),
        };
        Ok(Position {
            lsn: lsn.parse().map_err(|_| err())?,
            index: index.parse().map_err(|_| err())?,
            sub,
        })
    }
}

/// One WAL history as seen through one slot: the database system, its timeline and the slot.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct History {
    /// `IDENTIFY_SYSTEM`'s system identifier (fixed at initdb, kept by physical replicas).
    pub(crate) system_id: String,
    /// The timeline (a promotion or a point-in-time recovery starts a new one).
    pub(crate) timeline: u32,
    /// The replication slot the messages were read through.
    pub(crate) slot: String,
}

impl fmt::Display for History {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}/{}", self.system_id, self.timeline, self.slot)
    }
}

impl FromStr for History {
    type Err = ParseError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = || ParseError {
            what: "history",
            text: s.to_owned(),
            form: "system identifier, timeline and slot, like 7311234567890123456/1/outbox_relay",
        };
        let mut parts = s.trim().splitn(3, '/');
        let system_id = parts.next().filter(|p| !p.is_empty()).ok_or_else(err)?;
        let timeline = parts.next().ok_or_else(err)?.parse().map_err(|_| err())?;
        let slot = parts.next().filter(|p| !p.is_empty()).ok_or_else(err)?;
        if !system_id.bytes().all(|b| b.is_ascii_digit()) {
            return Err(err());
        }
        Ok(History {
            system_id: system_id.to_owned(),
            timeline,
            slot: slot.to_owned(),
        })
    }
}

/// The field a session that trusted no tail stamps after every message's position:
/// `;replay-over=N`, N the stream's last sequence when the session began. Such a session publishes
/// again from the slot's confirmed position, so its messages can sit after messages with higher
/// positions; a later session whose tail is one of them reads message N, the stream's last before
/// that replay, to find where the stream really ends ([`crate::sink::Replay`]).
pub(crate) const REPLAY_OVER: &str = "replay-over";

/// What a session stamps on every message besides the position, formatted once per session: the
/// [`History`] text (`SYSTEM/TIMELINE/SLOT`), then, when the session replays over a stream whose
/// tail it did not trust, `;replay-over=N` ([`REPLAY_OVER`]). [`stamp`] puts the history before
/// the position and the fields after it: the header's format gains fields only at its end.
pub(crate) fn context(history: &History, replay_over: Option<u64>) -> String {
    let mut out = history.to_string();
    if let Some(n) = replay_over {
        out.push(';');
        out.push_str(REPLAY_OVER);
        out.push('=');
        out.push_str(itoa::Buffer::new().format(n));
    }
    out
}

/// The `Outbox-Position` value of a message at `position` in `context` (a session's
/// [`context`]: `SYSTEM/TIMELINE/SLOT`, maybe with `;fields`): `SYSTEM/TIMELINE/SLOT/X/Y:I;fields`,
/// or only `X/Y:I` without a context. Written without `core::fmt`: it is on every message.
pub(crate) fn stamp(position: Position, context: Option<&str>) -> String {
    let (history, fields) = match context {
        Some(c) => match c.split_once(';') {
            Some((h, f)) => (Some(h), Some(f)),
            None => (Some(c), None),
        },
        None => (None, None),
    };
    let mut out = String::with_capacity(
        context.map_or(0, str::len) + 1 + 8 + 1 + 8 + 1 + 10 + 11 + usize::from(fields.is_some()),
    );
    if let Some(h) = history {
        out.push_str(h);
        out.push('/');
    }
    position.lsn.push_to(&mut out);
    out.push(':');
    out.push_str(itoa::Buffer::new().format(position.index));
    if position.sub != 0 {
        out.push('.');
        out.push_str(itoa::Buffer::new().format(position.sub));
    }
    if let Some(f) = fields {
        out.push(';');
        out.push_str(f);
    }
    out
}

/// An `Outbox-Position` value: the position, and the history when the value names one. Fields
/// after the position (`;name=value`) are not part of either ([`replay_over`]).
pub(crate) fn parse_stamp(s: &str) -> Result<(Option<History>, Position), ParseError> {
    let s = s.split_once(';').map_or(s, |(main, _)| main).trim();
    // The position is the last two '/'-separated parts (an LSN has one '/'); a history has three
    // before it (slot names have no '/').
    let mut cut = s.rmatch_indices('/').map(|(i, _)| i);
    let (_, lsn_slash) = (cut.next(), cut.next());
    match lsn_slash {
        None => Ok((None, s.parse()?)),
        Some(i) => Ok((Some(s[..i].parse()?), s[i + 1..].parse()?)),
    }
}

/// The `;replay-over=N` field of an `Outbox-Position` value ([`REPLAY_OVER`]), when it has one
/// that parses. Fields it does not know are ignored: a later version may add its own.
pub(crate) fn replay_over(s: &str) -> Option<u64> {
    let (_, fields) = s.split_once(';')?;
    fields.split(';').find_map(|f| {
        let (name, value) = f.split_once('=')?;
        (name.trim() == REPLAY_OVER)
            .then(|| value.trim().parse().ok())
            .flatten()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_standalone_message_sorts_before_the_commit_that_follows_it() {
        // The message's record ends at 0/1000, the next record (a COMMIT) starts there.
        let message = Position::standalone(Lsn(0x1000));
        let txn = Position::in_transaction(Lsn(0x1000), 0);
        assert!(message < txn);
        assert!(Position::in_transaction(Lsn(0xFF8), 7) < message);
    }

    #[test]
    fn positions_order_by_lsn_then_index_and_round_trip() {
        let a = Position::in_transaction(Lsn(0x1_0000_0010), 2);
        let b = Position::in_transaction(Lsn(0x1_0000_0010), 10);
        assert!(a < b);
        assert_eq!(a.to_string(), "1/10:2");
        assert_eq!("1/10:2".parse::<Position>().unwrap(), a);
        assert!("1/10".parse::<Position>().is_err());
        assert!("1/10:x".parse::<Position>().is_err());
    }

    #[test]
    fn stamps_round_trip_with_and_without_a_history() {
        let h = History {
            system_id: "7311234567890123456".into(),
            timeline: 2,
            slot: "outbox_relay".into(),
        };
        let p = Position::in_transaction(Lsn(0x1A_0000_0F08), 12);
        let text = stamp(p, Some(&h.to_string()));
        assert_eq!(text, "7311234567890123456/2/outbox_relay/1A/F08:12");
        assert_eq!(parse_stamp(&text).unwrap(), (Some(h), p));
        assert_eq!(stamp(p, None), "1A/F08:12");
        assert_eq!(parse_stamp("1A/F08:12").unwrap(), (None, p));
        assert_eq!(stamp(Position::default(), None), "0/0:0");
        assert_eq!(p.to_string(), stamp(p, None), "the same form as Display");
        assert!(parse_stamp("x/1/s/1A/F08:12").is_err());
        assert!(parse_stamp("1A/F08").is_err());
        assert_eq!(replay_over(&text), None);
    }

    #[test]
    fn a_replay_over_field_follows_the_position_and_round_trips() {
        let h = History {
            system_id: "7311234567890123456".into(),
            timeline: 2,
            slot: "outbox_relay".into(),
        };
        let p = Position::in_transaction(Lsn(0x1A_0000_0F08), 12);
        let c = context(&h, Some(228));
        assert_eq!(c, "7311234567890123456/2/outbox_relay;replay-over=228");
        let text = stamp(p, Some(&c));
        assert_eq!(
            text, "7311234567890123456/2/outbox_relay/1A/F08:12;replay-over=228",
            "the field comes after the position: the format gains fields only at its end"
        );
        assert_eq!(parse_stamp(&text).unwrap(), (Some(h.clone()), p));
        assert_eq!(replay_over(&text), Some(228));
        assert_eq!(context(&h, None), h.to_string());
        // Fields this version does not know are ignored; a junk value is no field.
        assert_eq!(replay_over("1A/F08:12;future=1;replay-over=7"), Some(7));
        assert_eq!(replay_over("1A/F08:12;replay-over=x"), None);
        assert_eq!(replay_over("1A/F08:12;other=7"), None);
        assert_eq!(parse_stamp("1A/F08:12;other=7").unwrap(), (None, p));
    }

    #[test]
    fn a_sub_index_orders_inside_its_position_and_prints_only_when_set() {
        let p = Position::in_transaction(Lsn(0x1A_0000_0F08), 12);
        assert_eq!(p.with_sub(0), p, "sub 0 is the position itself");
        assert_eq!(stamp(p, None), "1A/F08:12", "existing bytes unchanged");
        let s1 = p.with_sub(1);
        let s2 = p.with_sub(2);
        assert!(p < s1 && s1 < s2);
        assert!(s2 < Position::in_transaction(Lsn(0x1A_0000_0F08), 13));
        assert_eq!(s1.to_string(), "1A/F08:12.1");
        assert_eq!("1A/F08:12.1".parse::<Position>().unwrap(), s1);
        let h = "7311234567890123456/2/outbox_relay";
        let text = stamp(s2, Some(&format!("{h};replay-over=5")));
        assert_eq!(text, format!("{h}/1A/F08:12.2;replay-over=5"));
        assert_eq!(parse_stamp(&text).unwrap().1, s2);
        assert_eq!(replay_over(&text), Some(5));
        assert!("1A/F08:12.".parse::<Position>().is_err());
        assert!("1A/F08:12.x".parse::<Position>().is_err());
    }

    #[test]
    fn history_round_trips_and_refuses_junk() {
        let h = History {
            system_id: "7311234567890123456".into(),
            timeline: 3,
            slot: "outbox_relay".into(),
        };
        assert_eq!(h.to_string(), "7311234567890123456/3/outbox_relay");
        assert_eq!(h.to_string().parse::<History>().unwrap(), h);
        assert!("abc/1/s".parse::<History>().is_err());
        assert!("1/x/s".parse::<History>().is_err());
        assert!("1/1/".parse::<History>().is_err());
        assert!("1/1".parse::<History>().is_err());
    }
}
