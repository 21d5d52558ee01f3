//! Looking into the changes a slot has not confirmed yet, for outbox events: `status` asks whether
//! an event waits in an idle slot, and the relay asks whether another client consumed its slot past
//! events the stream lacks (`relay/slot_mark.rs`).
//!
//! The changes are peeked (`pg_logical_slot_peek_binary_changes`, nothing is consumed) with the
//! relay's own pgoutput options and judged by the relay's own decoder and outbox stage, so an event
//! is exactly what a relay would publish: inserts into the outbox table or its partitions, logical
//! messages under `outbox.message_prefix`. Updates, deletes and truncates of the outbox, other tables
//! and other prefixes are not events, however many come first; the first event is found behind any
//! number of them up to the bound.
//!
//! `verify` looks further: every pending event up to the rows' snapshot, each handed to it as the
//! look finds it ([`scan_each`]), so that a row whose event the slot still holds is told apart from
//! a missing one without a clock.
//!
//! The look is bounded twice: in changes (`upto_nchanges`; rows are read one at a time, so memory
//! stays small whatever their size) and in time (`statement_timeout`). When a bound ends it with
//! WAL still pending and no event found, the answer is "unknown", never "none".
//!
//! The look reads through a port ([`PeekPort`], `slot_scan/port.rs`): the real one peeks a slot on
//! a control connection (`slot_scan/postgres.rs`); for tests, `InHand` (`slot_scan/in_hand.rs`,
//! feature `test-support`) hands over changes already read, the deterministic simulation's own
//! Postgres's records among them, so all run this file's judgement and its staged looks.

#[cfg(feature = "test-support")]
mod in_hand;
mod port;
mod postgres;

use std::ops::ControlFlow;

use bytes::Bytes;

use crate::Lsn;
use crate::config::Settings;
use crate::outbox::{OutboxStage, Step};
use crate::pgoutput::Decoder;
use crate::position::Position;

#[cfg(feature = "test-support")]
pub use in_hand::{InHand, Transactions};
pub use port::{Bound, PeekFailed, PeekPort, Rows};
pub(crate) use postgres::{SlotPeek, in_use};

/// The first, cheap look of a search for the first event (see [`scan`]).
const FIRST_LOOK: u32 = 64;

/// An outbox event the look found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Found {
    /// Its position (commit LSN and index).
    pub(crate) position: Position,
    /// Its `Nats-Msg-Id`.
    pub(crate) id: String,
}

/// What a look saw.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Scan {
    /// Outbox events counted (all of them when the look is complete).
    pub(crate) events: u64,
    /// The first of them.
    pub(crate) first: Option<Found>,
    /// The last of them.
    pub(crate) last: Option<Found>,
    /// Why the look ended before the end of the pending WAL: `None` when it saw everything.
    pub(crate) unfinished: Option<String>,
}

impl Scan {
    /// An event was found, or there is none: `None` while unknown (a bound ended the look first).
    pub(crate) fn any(&self) -> Option<bool> {
        if self.events > 0 {
            Some(true)
        } else if self.unfinished.is_some() {
            None
        } else {
            Some(false)
        }
    }
}

/// What a look hands each event it counts to (see [`scan_each`]).
pub(crate) type Each<'a, 'f> = &'a mut (dyn FnMut(&Found) + Send + 'f);

/// Judges peeked pgoutput rows, in order, as the relay would; events at or before `after` are not
/// counted (the stream holds them), nor those of transactions committed at or after `before` (the
/// peek's `upto_lsn` ends at a record boundary, and may hand over the one straddling it).
pub(crate) struct Scanner {
    decoder: Decoder,
    stage: OutboxStage,
    after: Option<Position>,
    before: Option<Lsn>,
    scan: Scan,
    rows: u64,
}

impl Scanner {
    /// A scanner for `settings`' outbox, whose table has the partitions `partitions`.
    pub(crate) fn new(
        settings: &Settings,
        partitions: Vec<u32>,
        after: Option<Position>,
        before: Option<Lsn>,
    ) -> Self {
        let mut stage = OutboxStage::new(&settings.config().outbox);
        stage.set_partitions(partitions);
        Scanner {
            decoder: Decoder::new(),
            stage,
            after,
            before,
            scan: Scan::default(),
            rows: 0,
        }
    }

    /// One row of the peek: its LSN and its pgoutput message. A row that cannot be decoded or makes
    /// no sense ends the look as unknown: a relay would stop there too.
    pub(crate) fn row(&mut self, lsn: Lsn, data: Bytes) -> Result<(), Unreadable> {
        self.rows += 1;
        let msg = self
            .decoder
            .decode(data, lsn)
            .map_err(|cause| Unreadable::Undecodable { lsn, cause })?;
        let event = match self
            .stage
            .step(msg)
            .map_err(|cause| Unreadable::Refused { lsn, cause })?
        {
            Step::Event(e) | Step::Standalone { event: e, .. } => e,
            _ => return Ok(()),
        };
        if self.after.is_some_and(|a| event.position <= a)
            || self.before.is_some_and(|b| event.position.lsn >= b)
        {
            return Ok(());
        }
        let found = Found {
            position: event.position,
            id: event.msg_id.clone(),
        };
        self.scan.events += 1;
        self.scan.first.get_or_insert_with(|| found.clone());
        self.scan.last = Some(found);
        Ok(())
    }

    /// Rows judged so far.
    pub(crate) fn rows(&self) -> u64 {
        self.rows
    }

    /// What was seen; `unfinished` says why the look ended early, if it did.
    pub(crate) fn finish(mut self, unfinished: Option<String>) -> Scan {
        self.scan.unfinished = unfinished;
        self.scan
    }
}

/// A change the look cannot judge; it ends the look as unknown. The cause is part of the one line
/// (it is not a `source()`: the line is what a problem or a warning carries).
#[derive(Debug, thiserror::Error)]
pub(crate) enum Unreadable {
    /// The pgoutput message does not decode.
    #[error("the change at {lsn} cannot be decoded: {cause}")]
    Undecodable {
        lsn: Lsn,
        cause: crate::pgoutput::DecodeError,
    },
    /// The outbox stage refuses it (as a relay would stop there).
    #[error("the change at {lsn}: {cause}")]
    Refused {
        lsn: Lsn,
        cause: crate::outbox::StageError,
    },
}

/// Peeks through `port` up to `upto` (the end of the WAL when `None`) and counts the outbox events
/// past `after`. With `first_only` it stops at the first. `Err` only when the look could not be
/// set up at all.
pub(crate) async fn scan<P: PeekPort>(
    settings: &Settings,
    port: &mut P,
    upto: Option<Lsn>,
    after: Option<Position>,
    first_only: bool,
    bound: Bound,
) -> Result<Scan, P::Error> {
    let look = Look {
        upto,
        after,
        first_only,
        bound,
    };
    scan_with(settings, port, look, None).await
}

/// What `status` asks of a slot no one streams: every event waiting in it, within
/// [`Bound::DEFAULT`] (the real servers' port peeks a copy of the slot: `status/postgres.rs`).
pub async fn waiting<P: PeekPort>(settings: &Settings, port: &mut P) -> Result<Scan, P::Error> {
    scan(settings, port, None, None, false, Bound::DEFAULT).await
}

/// [`scan`] of every pending event up to `upto` (none skipped as stored, no early end), handing
/// each one it counts to `each` as it goes.
pub(crate) async fn scan_each<P: PeekPort>(
    settings: &Settings,
    port: &mut P,
    upto: Option<Lsn>,
    bound: Bound,
    each: Each<'_, '_>,
) -> Result<Scan, P::Error> {
    let look = Look {
        upto,
        after: None,
        first_only: false,
        bound,
    };
    scan_with(settings, port, look, Some(each)).await
}

/// What one look reads: [`scan`]'s arguments.
#[derive(Clone, Copy)]
struct Look {
    upto: Option<Lsn>,
    after: Option<Position>,
    first_only: bool,
    bound: Bound,
}

async fn scan_with<P: PeekPort>(
    settings: &Settings,
    port: &mut P,
    look: Look,
    mut each: Option<Each<'_, '_>>,
) -> Result<Scan, P::Error> {
    let partitions = port.begin(look.bound).await?;
    let mut scan = Scan::default();
    for changes in stages(look.first_only, look.bound) {
        let mut scanner = Scanner::new(settings, partitions.clone(), look.after, look.upto);
        let unfinished = look_once(port, look, changes, &mut scanner, each.as_deref_mut()).await;
        scan = scanner.finish(unfinished);
        if scan.any().is_some() {
            break;
        }
    }
    port.end().await;
    Ok(scan)
}

/// The looks a search makes, each bounded by this many changes. The server decodes every change
/// up to `upto_nchanges` before it returns the first row. A look for the first event usually finds
/// it in the first transaction: a small look first, the whole bound only when that one saw no
/// event and more is pending.
fn stages(first_only: bool, bound: Bound) -> Vec<u32> {
    if first_only && bound.changes > FIRST_LOOK {
        vec![FIRST_LOOK, bound.changes]
    } else {
        vec![bound.changes]
    }
}

/// One peek of at most `changes` rows, fed to `scanner` (each event it counts handed to `each`);
/// returns why the look ended early, if it did: a row it cannot judge, the port's failure, or the
/// bound reached with changes perhaps still pending.
async fn look_once<P: PeekPort>(
    port: &mut P,
    look: Look,
    changes: u32,
    scanner: &mut Scanner,
    mut each: Option<Each<'_, '_>>,
) -> Option<String> {
    // Set when a row ends the peek: `Some(why)` for a row that cannot be judged, `None` for the
    // first event of a look that wants only that.
    let mut stopped: Option<Option<String>> = None;
    let peeked = port
        .peek(look.upto, changes, &mut |lsn: Lsn, data: Bytes| {
            let counted = scanner.scan.events;
            if let Err(e) = scanner.row(lsn, data) {
                stopped = Some(Some(e.to_string()));
                return ControlFlow::Break(());
            }
            if scanner.scan.events > counted
                && let (Some(each), Some(found)) = (each.as_deref_mut(), &scanner.scan.last)
            {
                each(found);
            }
            if look.first_only && scanner.scan.events > 0 {
                stopped = Some(None);
                return ControlFlow::Break(());
            }
            ControlFlow::Continue(())
        })
        .await;
    match (stopped, peeked) {
        (Some(why), _) => why,
        (None, Err(failed)) => Some(failed.0),
        (None, Ok(())) => beyond(scanner.rows(), changes),
    }
}

/// Why a look that judged `rows` rows under a bound of `changes` is unfinished, if it is: the server
/// stops at the first transaction's end past the bound, so a look that reached it may have left
/// changes pending.
pub(crate) fn beyond(rows: u64, changes: u32) -> Option<String> {
    (rows >= u64::from(changes))
        .then(|| format!("more than {changes} changes are pending; only the first were looked at"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use crate::pgoutput::{Column, Message, OldTuple, Relation, TupleValue, encode};

    fn settings() -> Settings {
        let mut c = Config::default();
        c.outbox.message_prefix = "outbox".into();
        c.validate().unwrap()
    }

    fn text(s: &str) -> TupleValue {
        TupleValue::Text(Bytes::copy_from_slice(s.as_bytes()))
    }

    fn relation(id: u32, name: &str) -> Message {
        let cols = [
            ("event_id", 25),
            ("aggregate_type", 25),
            ("aggregate_id", 25),
            ("event_type", 25),
            ("payload", 3802),
        ];
        Message::Relation(Relation {
            xid: None,
            id,
            namespace: "public".into(),
            name: name.into(),
            replica_identity: b'd',
            columns: cols
                .iter()
                .map(|(n, t)| Column {
                    flags: 0,
                    name: (*n).into(),
                    type_oid: *t,
                    type_modifier: -1,
                })
                .collect(),
        })
    }

    fn row(id: &str) -> Vec<TupleValue> {
        vec![
            text(id),
            text("Claim"),
            text("4711"),
            text("approved"),
            text("{}"),
        ]
    }

    /// A transaction committed at `commit` holding `changes`, as peek rows.
    fn txn(commit: u64, changes: Vec<Message>) -> Vec<Message> {
        let mut out = vec![Message::Begin {
            final_lsn: Lsn(commit),
            commit_ts: 0,
            xid: 7,
        }];
        out.extend(changes);
        out.push(Message::Commit {
            flags: 0,
            commit_lsn: Lsn(commit),
            end_lsn: Lsn(commit + 0x30),
            commit_ts: 0,
        });
        out
    }

    fn scan_of(after: Option<Position>, msgs: Vec<Message>) -> Scan {
        let mut s = Scanner::new(&settings(), Vec::new(), after, Some(Lsn(0x5000)));
        for (i, m) in msgs.iter().enumerate() {
            s.row(Lsn(0x100 + i as u64), encode::message(m)).unwrap();
        }
        s.finish(None)
    }

    #[test]
    fn an_insert_behind_outbox_deletes_and_other_tables_is_found() {
        let mut msgs = txn(
            0x1000,
            vec![
                relation(16384, "outbox"),
                Message::Delete {
                    xid: None,
                    relation_id: 16384,
                    old: OldTuple::Key(vec![text("old")]),
                },
            ],
        );
        msgs.extend(txn(
            0x2000,
            vec![
                relation(16390, "orders"),
                Message::Insert {
                    xid: None,
                    relation_id: 16390,
                    new: row("not-an-event"),
                },
            ],
        ));
        msgs.extend(txn(
            0x3000,
            vec![Message::Message {
                xid: None,
                transactional: true,
                lsn: Lsn(0x2ff0),
                prefix: "other".into(),
                content: Bytes::from_static(b"{}"),
            }],
        ));
        let quiet = scan_of(None, msgs.clone());
        assert_eq!(quiet.any(), Some(false), "{quiet:?}");
        msgs.extend(txn(
            0x4000,
            vec![Message::Insert {
                xid: None,
                relation_id: 16384,
                new: row("e-5531"),
            }],
        ));
        // Committed at the end of the look (`upto_lsn`): the relay's to stream, not waiting here.
        msgs.extend(txn(
            0x5000,
            vec![Message::Insert {
                xid: None,
                relation_id: 16384,
                new: row("later"),
            }],
        ));
        let found = scan_of(None, msgs);
        assert_eq!(found.any(), Some(true));
        assert_eq!(found.events, 1);
        let first = found.first.unwrap();
        assert_eq!(first.id, "e-5531");
        assert_eq!(first.position, Position::in_transaction(Lsn(0x4000), 0));
    }

    #[test]
    fn prefixed_messages_are_events_and_stored_ones_are_not_counted() {
        let msg = |lsn: u64, id: &str| Message::Message {
            xid: None,
            transactional: true,
            lsn: Lsn(lsn),
            prefix: "outbox".into(),
            content: Bytes::from(format!(
                r#"{{"id":"{id}","aggregate_type":"Claim","aggregate_id":"1","event_type":"x","payload":{{}}}}"#
            )),
        };
        let mut msgs = txn(0x1000, vec![msg(0xff0, "m-1")]);
        msgs.extend(txn(0x2000, vec![msg(0x1ff0, "m-2"), msg(0x1ff8, "m-3")]));
        let all = scan_of(None, msgs.clone());
        assert_eq!(all.events, 3);
        // The stream holds everything through the first event of the second transaction.
        let past = scan_of(Some(Position::in_transaction(Lsn(0x2000), 0)), msgs);
        assert_eq!(past.events, 1);
        assert_eq!(past.first.as_ref().unwrap().id, "m-3");
        assert_eq!(past.last.unwrap().id, "m-3");
    }

    async fn first_in_hand(transactions: &[Vec<(Lsn, Bytes)>], bound: Bound) -> Scan {
        let port = &mut InHand(transactions);
        let Ok(scan) = scan(&settings(), port, None, None, true, bound).await;
        scan
    }

    #[tokio::test]
    async fn a_look_over_changes_in_hand_reads_past_a_first_look_of_deletes_to_its_bound() {
        let delete = Message::Delete {
            xid: None,
            relation_id: 16384,
            old: OldTuple::Key(vec![text("old")]),
        };
        let rows = |msgs: Vec<Message>| -> Vec<(Lsn, Bytes)> {
            msgs.iter()
                .map(|m| (Lsn(0x100), encode::message(m)))
                .collect()
        };
        // A retention job's transactions: more rows than the first, small look reads.
        let mut transactions = vec![rows(txn(
            0x1000,
            vec![relation(16384, "outbox"), delete.clone()],
        ))];
        for i in 1..30 {
            transactions.push(rows(txn(0x1000 + i * 0x100, vec![delete.clone()])));
        }
        let quiet = first_in_hand(&transactions, Bound::DEFAULT).await;
        assert_eq!(quiet.any(), Some(false), "{quiet:?}");
        transactions.push(rows(txn(
            0x4000,
            vec![Message::Insert {
                xid: None,
                relation_id: 16384,
                new: row("e-5531"),
            }],
        )));
        let found = first_in_hand(&transactions, Bound::DEFAULT).await;
        assert_eq!(found.first.map(|f| f.id).as_deref(), Some("e-5531"));
        let short = Bound {
            changes: FIRST_LOOK,
            ..Bound::DEFAULT
        };
        let bounded = first_in_hand(&transactions, short).await;
        assert_eq!(
            bounded.any(),
            None,
            "a look its bound ended is unknown: {bounded:?}"
        );
    }

    #[test]
    fn an_unfinished_look_without_events_is_unknown_never_none() {
        let s = Scanner::new(&settings(), Vec::new(), None, None);
        let scan = s.finish(Some("more than 1 changes are pending".into()));
        assert_eq!(scan.any(), None);
    }

    #[test]
    fn a_change_that_cannot_be_decoded_ends_the_look() {
        let mut s = Scanner::new(&settings(), Vec::new(), None, None);
        let e = s.row(Lsn(0x10), Bytes::from_static(b"\xff")).unwrap_err();
        assert!(e.to_string().contains("0/10"), "{e}");
    }
}
