//! The replay's decisions: which of the events a session replays from the confirmed position are
//! already stored, judged from the stream's tail ([`Replay`]). Pure: no I/O and no clock, so every
//! rule is unit- and property-tested here. The sink asks it about each replayed event
//! ([`Replayed`]); the proof that what was skipped is in the stream is `replay_proof.rs`, and the
//! expectations every publish carries are the fence's (`fence.rs`).

use crate::Lsn;
use crate::position::{History, Position};
use crate::source::Shared;

use super::tail::{Origin, Stamp, Tail};

/// What to do with one replayed event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Replayed {
    /// Before the tail's position: stored if the tail turns out to be this history's; not to be
    /// reported as stored until [`Replayed::Verified`] says so.
    Skip,
    /// The tail's own event: it and every event skipped before it are stored.
    Verified,
    /// Not stored yet: publish it.
    Publish,
    /// The events passed the tail's position without the tail's event among them: the stream's
    /// tail is from another history (a restored database), and nothing skipped is stored.
    Diverged {
        /// The tail's position.
        tail: Position,
        /// The first event past it.
        at: Position,
    },
}

/// Decides, for the events a session replays from the confirmed position, which are already stored.
///
/// It trusts the stream's tail only when the relay wrote it in this history (the history in
/// `Outbox-Position`: this system and slot, and this timeline or an ancestor of it below the
/// point where that ancestor ended) at a position the server has reached, and even then only
/// provisionally: events before the tail's position are skipped, but they count as stored only
/// once the walsender's events reach the tail's position with the tail's own event id. Anything else publishes (JetStream's duplicate
/// window and the fence handle the true duplicates).
#[derive(Debug, Clone)]
pub(crate) struct Replay {
    state: State,
    /// The sequence of the message whose event the replay verifies, when it is not the stream's
    /// last (see [`Replay::new`]): the skipped events must be the messages that end there.
    ends_at: Option<u64>,
}

#[derive(Debug, Clone)]
enum State {
    Publishing,
    Verifying {
        until: Position,
        id: String,
        skipped: u64,
    },
}

/// Why a session does not skip anything, for its log line.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum Untrusted {
    /// The tail lacks an `Outbox-Position` that names a history, or an id.
    #[error(
        "the stream's last message was not written by this relay (no Outbox-Position with a history)"
    )]
    Foreign,
    /// The tail is from another database or slot, or a timeline that is neither this one nor an
    /// ancestor of it.
    #[error(
        "the stream's last message is from another history ({tail}, this session streams {here})"
    )]
    OtherHistory {
        /// The tail's history.
        tail: History,
        /// The session's.
        here: History,
    },
    /// The tail is from an ancestor timeline, at or past the point where that timeline ended: a
    /// history the server does not have (the old primary wrote it after the standby's last WAL).
    #[error(
        "the stream's last message is at {tail} on timeline {timeline}, at or past {switch} where \
         this server's timeline {here} branched off it: it is from a history this server does not have"
    )]
    PastSwitch {
        /// The tail's position.
        tail: Position,
        /// The tail's timeline.
        timeline: u32,
        /// Where that timeline ended in this server's history.
        switch: Lsn,
        /// The session's timeline.
        here: u32,
    },
    /// The tail's position is beyond the server's WAL.
    #[error(
        "the stream's last message is at {tail}, beyond the server's WAL end {wal_end}: the database was restored \
         from a backup or snapshot taken before the relay published it"
    )]
    AheadOfServer {
        /// The tail's position.
        tail: Position,
        /// The server's WAL flush position.
        wal_end: Lsn,
    },
    /// An earlier session found the stream's tail unreliable; holds why
    /// ([`crate::sink::SinkError::distrust`]).
    #[error("an earlier session found the stream's tail unreliable: {0}")]
    Distrusted(String),
}

impl Replay {
    /// A replay that skips nothing.
    pub(crate) fn publishing() -> Self {
        Replay {
            state: State::Publishing,
            ends_at: None,
        }
    }

    /// The replay of a session that streams `origin` with the stream at `tail`; `distrust`: why an
    /// earlier session found the tail unreliable, if one did. The error says why the tail is not
    /// trusted (then nothing is skipped).
    ///
    /// `before_replay`: when the tail was published by a session that trusted no tail
    /// (`;replay-over=N`, [`Stamp::replay_over`]), message N as the stream holds it. Such a session
    /// publishes again from the slot's confirmed position, so when it ended early its last message
    /// sits behind messages with higher positions, and a replay that trusted that tail would publish
    /// them all again (with atomic batches, which carry no `Nats-Msg-Id`, nothing drops those
    /// copies). Message N was the stream's last before that replay: when it is this history's and
    /// lies further on, the replay verifies it instead, and the skipped events must then be the
    /// messages that end at N ([`Replay::ends_at`]). When it is not (gone, foreign, another history),
    /// the tail is used as before: no worse than a replay that never looked.
    pub(crate) fn new(
        tail: &Tail,
        before_replay: Option<(u64, &Stamp)>,
        origin: &Origin,
        distrust: Option<&str>,
    ) -> (Self, Option<Untrusted>) {
        match Self::trusted(tail, origin, distrust) {
            Ok(Some((until, id))) => {
                let further = before_replay
                    .filter(|(seq, _)| *seq < tail.last_sequence)
                    .and_then(|(seq, stamp)| {
                        let (p, id) = Self::judge(stamp, origin).ok()?;
                        (p > until).then_some((p, id, seq))
                    });
                let (until, id, ends_at) = match further {
                    Some((p, id, seq)) => (p, id, Some(seq)),
                    None => (until, id, None),
                };
                (
                    Replay {
                        state: State::Verifying {
                            until,
                            id,
                            skipped: 0,
                        },
                        ends_at,
                    },
                    None,
                )
            }
            Ok(None) => (Self::publishing(), None),
            Err(why) => (Self::publishing(), Some(why)),
        }
    }

    /// The sequence of the message the replay verifies when it is not the stream's last message:
    /// the skipped events are proven against the messages that end there.
    pub(crate) fn ends_at(&self) -> Option<u64> {
        self.ends_at
    }

    fn trusted(
        tail: &Tail,
        origin: &Origin,
        distrust: Option<&str>,
    ) -> Result<Option<(Position, String)>, Untrusted> {
        // An empty stream, or its last message gone: nothing to match.
        let Some(last) = &tail.last else {
            return Ok(None);
        };
        if let Some(why) = distrust {
            return Err(Untrusted::Distrusted(why.to_owned()));
        }
        Self::judge(last, origin).map(Some)
    }

    /// Whether a message the relay wrote (`last`) names an event of the history `origin` streams,
    /// at a position the server has: its position and id, or why not. The stop mark's look
    /// (`slot_mark.rs`) trusts a tail by the same rule.
    pub(crate) fn judge(last: &Stamp, origin: &Origin) -> Result<(Position, String), Untrusted> {
        let (Some(position), Some(history), Some(id)) = (last.position, &last.history, &last.id)
        else {
            return Err(Untrusted::Foreign);
        };
        let other = || Untrusted::OtherHistory {
            tail: history.clone(),
            here: origin.history.clone(),
        };
        if history.system_id != origin.history.system_id || history.slot != origin.history.slot {
            return Err(other());
        }
        // The tail's timeline must be this one, or an ancestor whose WAL up to the tail's position
        // is this timeline's too (a promotion, or a recovery that went past the tail).
        if history.timeline != origin.history.timeline {
            match origin.timelines.shared(history.timeline) {
                Shared::Below(switch) if position.lsn < switch => {}
                Shared::Below(switch) => {
                    return Err(Untrusted::PastSwitch {
                        tail: position,
                        timeline: history.timeline,
                        switch,
                        here: origin.history.timeline,
                    });
                }
                Shared::All | Shared::Nothing => return Err(other()),
            }
        }
        if position.lsn >= origin.wal_end {
            return Err(Untrusted::AheadOfServer {
                tail: position,
                wal_end: origin.wal_end,
            });
        }
        Ok((position, id.clone()))
    }

    /// What to do with the replayed event at `position` with message id `id`. Events arrive in
    /// position order, as they were published.
    pub(crate) fn replayed(&mut self, position: Position, id: &str) -> Replayed {
        let State::Verifying {
            until,
            id: tail_id,
            skipped,
        } = &mut self.state
        else {
            return Replayed::Publish;
        };
        let decision = match position.cmp(until) {
            std::cmp::Ordering::Less => {
                *skipped += 1;
                return Replayed::Skip;
            }
            std::cmp::Ordering::Equal if id == tail_id => Replayed::Verified,
            // Nothing skipped: the tail lies before the confirmed position, all is new.
            std::cmp::Ordering::Greater if *skipped == 0 => Replayed::Publish,
            _ => Replayed::Diverged {
                tail: *until,
                at: position,
            },
        };
        self.state = State::Publishing;
        decision
    }

    /// A keepalive: the walsender has sent everything before `wal_end`. Once that is past the
    /// tail's position, the tail's own event would have come: if events were skipped, the tail is
    /// from another history (returns its position); if none were, it lay before the start and
    /// nothing is to be skipped. Without this a quiet outbox would hold skipped events back until
    /// the next event arrived.
    pub(crate) fn passed(&mut self, wal_end: Lsn) -> Option<Position> {
        let State::Verifying { until, skipped, .. } = &self.state else {
            return None;
        };
        if wal_end <= until.lsn {
            return None;
        }
        let diverged = (*skipped > 0).then_some(*until);
        self.state = State::Publishing;
        diverged
    }

    /// Events skipped so far whose storage is not yet proven.
    pub(crate) fn unverified(&self) -> u64 {
        match &self.state {
            State::Verifying { skipped, .. } => *skipped,
            State::Publishing => 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sink::tail::tests::{history, origin, pos, tail};
    use crate::source::TimelineHistory;

    /// A session on `timeline` of a server whose history file says `file`.
    fn promoted(timeline: u32, file: &str) -> Origin {
        Origin {
            history: History {
                timeline,
                ..history()
            },
            wal_end: Lsn(0x10_000),
            timelines: TimelineHistory::parse(timeline, file).unwrap(),
        }
    }

    /// A tail at (lsn, 0) stamped with timeline `timeline`.
    fn tail_on(timeline: u32, lsn: u64) -> Tail {
        let mut t = tail(lsn, 0, "b");
        t.last.as_mut().unwrap().history.as_mut().unwrap().timeline = timeline;
        t
    }

    fn replay(t: &Tail) -> Replay {
        let (r, why) = Replay::new(t, None, &origin(), None);
        assert_eq!(why, None);
        r
    }

    /// The stream after a replay that trusted no tail was cut off: the stream's last message before
    /// it (sequence 5, event "e" at 500) and the replay's copies after it, the last one "b" at 200
    /// stamped `;replay-over=5`.
    fn cut_off_replay() -> (Tail, Stamp) {
        let mut t = tail(200, 1, "b");
        t.last.as_mut().unwrap().replay_over = Some(5);
        let before = tail(500, 0, "e").last.unwrap();
        (t, before)
    }

    #[test]
    fn a_cut_off_replays_tail_verifies_the_message_before_that_replay() {
        let (t, before) = cut_off_replay();
        let (mut r, why) = Replay::new(&t, Some((5, &before)), &origin(), None);
        assert_eq!(why, None);
        assert_eq!(r.ends_at(), Some(5), "the proof ends at message 5");
        // Everything up to "e" is stored already, the events past the replay's tail included.
        assert_eq!(r.replayed(pos(200, 1), "b"), Replayed::Skip);
        assert_eq!(r.replayed(pos(300, 0), "c"), Replayed::Skip);
        assert_eq!(r.replayed(pos(500, 0), "e"), Replayed::Verified);
        assert_eq!(r.replayed(pos(600, 0), "f"), Replayed::Publish);
        // The same stream read without the message before the replay: the tail alone, which would
        // have published "c" and "e" again.
        let (mut alone, _) = Replay::new(&t, None, &origin(), None);
        assert_eq!(alone.ends_at(), None);
        assert_eq!(alone.replayed(pos(200, 1), "b"), Replayed::Verified);
        assert_eq!(alone.replayed(pos(300, 0), "c"), Replayed::Publish);
    }

    #[test]
    fn the_message_before_a_replay_counts_only_when_it_is_this_historys_and_further_on() {
        let (t, before) = cut_off_replay();
        let ends_at = |before: &Stamp, seq: u64| {
            let (r, why) = Replay::new(&t, Some((seq, before)), &origin(), None);
            assert_eq!(why, None, "the tail itself is still trusted");
            r.ends_at()
        };
        assert_eq!(ends_at(&before, 5), Some(5));
        // Not before the tail in the stream: not the message before the replay.
        assert_eq!(ends_at(&before, 9), None);
        assert_eq!(ends_at(&before, 12), None);
        // Behind the tail's position (the replay passed it): the tail is the stream's end.
        assert_eq!(ends_at(&tail(100, 0, "a").last.unwrap(), 5), None);
        // Another writer's, another history's, or past the server's WAL (a restore): not trusted.
        let foreign = Stamp::default();
        assert_eq!(ends_at(&foreign, 5), None);
        let mut other = before.clone();
        other.history.as_mut().unwrap().slot = "another_slot".into();
        assert_eq!(ends_at(&other, 5), None);
        let ahead = tail(0x1_0000_0000, 0, "z").last.unwrap();
        assert_eq!(ends_at(&ahead, 5), None);
        // A tail the relay does not trust makes the message before it irrelevant.
        let (r, why) = Replay::new(
            &t,
            Some((5, &before)),
            &origin(),
            Some("an earlier session failed"),
        );
        assert!(why.is_some());
        assert_eq!(r.ends_at(), None);
    }

    #[test]
    fn skips_up_to_the_tail_and_verifies_at_its_own_event() {
        let mut r = replay(&tail(200, 1, "b"));
        assert_eq!(r.replayed(pos(100, 0), "x"), Replayed::Skip);
        assert_eq!(r.replayed(pos(200, 0), "a"), Replayed::Skip);
        assert_eq!(r.unverified(), 2);
        assert_eq!(r.replayed(pos(200, 1), "b"), Replayed::Verified);
        assert_eq!(r.unverified(), 0);
        assert_eq!(r.replayed(pos(200, 2), "c"), Replayed::Publish);
        assert_eq!(
            r.replayed(pos(100, 0), "x"),
            Replayed::Publish,
            "once passed, never again"
        );
    }

    #[test]
    fn a_tail_before_the_confirmed_position_skips_nothing() {
        let mut r = replay(&tail(200, 1, "b"));
        assert_eq!(r.replayed(pos(250, 0), "z"), Replayed::Publish);
        assert_eq!(r.replayed(pos(200, 1), "b"), Replayed::Publish);
    }

    #[test]
    fn passing_the_tail_without_its_event_is_divergence() {
        // A restored database: new events at lower positions, none at the tail's.
        let mut r = replay(&tail(200, 1, "b"));
        assert_eq!(r.replayed(pos(150, 0), "new-1"), Replayed::Skip);
        assert_eq!(
            r.replayed(pos(300, 0), "new-2"),
            Replayed::Diverged {
                tail: pos(200, 1),
                at: pos(300, 0)
            }
        );
        // Another event at the tail's very position is divergence too.
        let mut r = replay(&tail(200, 1, "b"));
        assert_eq!(r.replayed(pos(150, 0), "new-1"), Replayed::Skip);
        assert!(matches!(
            r.replayed(pos(200, 1), "other"),
            Replayed::Diverged { .. }
        ));
    }

    #[test]
    fn a_keepalive_past_the_tail_ends_the_wait_for_its_event() {
        // Skipped events, then the walsender is past the tail without having sent it: diverged.
        let mut r = replay(&tail(200, 1, "b"));
        assert_eq!(r.replayed(pos(150, 0), "new-1"), Replayed::Skip);
        assert_eq!(r.passed(Lsn(200)), None, "not past the tail's commit yet");
        assert_eq!(r.passed(Lsn(208)), Some(pos(200, 1)));
        assert_eq!(r.unverified(), 0);
        // Nothing skipped: the tail lay before the start; publish from here on.
        let mut r = replay(&tail(200, 1, "b"));
        assert_eq!(r.passed(Lsn(208)), None);
        assert_eq!(r.replayed(pos(300, 0), "c"), Replayed::Publish);
    }

    #[test]
    fn a_standalone_message_at_the_tail_is_not_the_next_transaction() {
        // Defect: a dead-lettered non-transactional message ending at 0/1000 is the tail; the next
        // transaction commits at 0/1000. Its events are not the tail's and must be published.
        let message = Position::standalone(Lsn(0x1000));
        let t = Tail {
            last_sequence: 4,
            last: Some(Stamp {
                replay_over: None,
                position: Some(message),
                history: Some(history()),
                id: Some("lsn:0/1000:non-transactional".into()),
            }),
            max_msg_size: None,
        };
        let mut r = replay(&t);
        assert_eq!(
            r.replayed(message, "lsn:0/1000:non-transactional"),
            Replayed::Verified
        );
        assert_eq!(r.replayed(pos(0x1000, 0), "e-1"), Replayed::Publish);
        assert_eq!(r.replayed(pos(0x1000, 1), "e-2"), Replayed::Publish);
    }

    #[test]
    fn untrusted_tails_skip_nothing() {
        let mut foreign = tail(200, 1, "b");
        foreign.last.as_mut().unwrap().history = None;
        let (mut r, why) = Replay::new(&foreign, None, &origin(), None);
        assert_eq!(why, Some(Untrusted::Foreign));
        assert_eq!(r.replayed(pos(100, 0), "x"), Replayed::Publish);

        let mut other = tail(200, 1, "b");
        other
            .last
            .as_mut()
            .unwrap()
            .history
            .as_mut()
            .unwrap()
            .timeline = 2;
        let (_, why) = Replay::new(&other, None, &origin(), None);
        assert!(matches!(why, Some(Untrusted::OtherHistory { .. })));

        let ahead = tail(0x20_000, 0, "b");
        let (mut r, why) = Replay::new(&ahead, None, &origin(), None);
        assert!(matches!(why, Some(Untrusted::AheadOfServer { .. })));
        assert_eq!(r.replayed(pos(100, 0), "x"), Replayed::Publish);

        let (_, why) = Replay::new(
            &tail(200, 1, "b"),
            None,
            &origin(),
            Some("the proof failed"),
        );
        assert_eq!(why, Some(Untrusted::Distrusted("the proof failed".into())));
    }

    #[test]
    fn a_promoted_server_trusts_a_tail_below_the_switch_point() {
        // Timeline 1 ended at 0/300 when the standby was promoted to timeline 2.
        let here = promoted(2, "1\t0/300\tno recovery target specified\n");
        let (mut r, why) = Replay::new(&tail_on(1, 0x2F8), None, &here, None);
        assert_eq!(why, None);
        assert_eq!(r.replayed(pos(0x100, 0), "a"), Replayed::Skip);
        assert_eq!(r.replayed(pos(0x2F8, 0), "b"), Replayed::Verified);
        // A standalone message whose record ends exactly at the switch point survived too.
        let mut standalone = tail_on(1, 0);
        standalone.last.as_mut().unwrap().position = Some(Position::standalone(Lsn(0x300)));
        assert_eq!(Replay::new(&standalone, None, &here, None).1, None);
        // Two promotions: timeline 2 ended at 0/500, a tail of either ancestor is trusted.
        let twice = promoted(3, "1\t0/300\tr\n2\t0/500\tr\n");
        assert_eq!(Replay::new(&tail_on(1, 0x200), None, &twice, None).1, None);
        assert_eq!(Replay::new(&tail_on(2, 0x4F8), None, &twice, None).1, None);
    }

    #[test]
    fn a_tail_at_or_past_the_switch_point_did_not_survive() {
        let here = promoted(2, "1\t0/300\n");
        for lsn in [0x300, 0x308, 0x8000] {
            let (mut r, why) = Replay::new(&tail_on(1, lsn), None, &here, None);
            assert_eq!(
                why,
                Some(Untrusted::PastSwitch {
                    tail: pos(lsn, 0),
                    timeline: 1,
                    switch: Lsn(0x300),
                    here: 2
                })
            );
            assert_eq!(r.replayed(pos(0x100, 0), "a"), Replayed::Publish);
        }
        let why = Replay::new(&tail_on(1, 0x300), None, &here, None)
            .1
            .unwrap();
        assert_eq!(
            why.to_string(),
            "the stream's last message is at 0/300:0 on timeline 1, at or past 0/300 where this \
             server's timeline 2 branched off it: it is from a history this server does not have"
        );
    }

    #[test]
    fn a_timeline_that_is_not_an_ancestor_is_another_history() {
        // Timeline 3 branched off timeline 1: timeline 2 (a sibling) is not its history.
        let sibling = promoted(3, "1\t0/300\n");
        assert!(matches!(
            Replay::new(&tail_on(2, 0x100), None, &sibling, None).1,
            Some(Untrusted::OtherHistory { .. })
        ));
        // A tail from a later timeline than the server's (the server was restored behind it).
        assert!(matches!(
            Replay::new(&tail_on(3, 0x100), None, &promoted(2, "1\t0/300\n"), None).1,
            Some(Untrusted::OtherHistory { .. })
        ));
        // Without the history (timeline 1's, or one that could not be read), only the same
        // timeline is trusted.
        let unread = Origin {
            timelines: TimelineHistory::root(2),
            ..promoted(2, "1\t0/300\n")
        };
        assert!(matches!(
            Replay::new(&tail_on(1, 0x100), None, &unread, None).1,
            Some(Untrusted::OtherHistory { .. })
        ));
        // An ancestor timeline of another system or slot is not this history either.
        let here = promoted(2, "1\t0/300\n");
        let mut other_slot = tail_on(1, 0x100);
        other_slot
            .last
            .as_mut()
            .unwrap()
            .history
            .as_mut()
            .unwrap()
            .slot = "other".into();
        assert!(matches!(
            Replay::new(&other_slot, None, &here, None).1,
            Some(Untrusted::OtherHistory { .. })
        ));
        let mut other_system = tail_on(1, 0x100);
        other_system
            .last
            .as_mut()
            .unwrap()
            .history
            .as_mut()
            .unwrap()
            .system_id = "7311234567890123457".into();
        assert!(matches!(
            Replay::new(&other_system, None, &here, None).1,
            Some(Untrusted::OtherHistory { .. })
        ));
        // Distrust still wins over an ancestor's tail.
        assert_eq!(
            Replay::new(
                &tail_on(1, 0x100),
                None,
                &here,
                Some("an earlier session failed")
            )
            .1,
            Some(Untrusted::Distrusted("an earlier session failed".into()))
        );
    }

    /// A history file of `current` with ancestors at the given (timeline step, LSN step).
    fn file(steps: &[(u32, u64)]) -> (u32, String, Vec<(u32, u64)>) {
        let (mut tli, mut end) = (0u32, 0u64);
        let mut ancestors = Vec::new();
        for &(dt, de) in steps {
            tli += dt;
            end += de;
            ancestors.push((tli, end));
        }
        let text = ancestors
            .iter()
            .map(|(t, e)| format!("{t}\t{}\treason\n", Lsn(*e)))
            .collect();
        (tli + 1, text, ancestors)
    }

    proptest::proptest! {
        /// The rule, both ways: a tail of another timeline is trusted exactly when that timeline
        /// is an ancestor and the tail lies below its switch point (and below the WAL end).
        #[test]
        fn an_older_timeline_is_trusted_exactly_below_its_switch_point(
            steps in proptest::collection::vec((1u32..4, 1u64..0x8000), 1..5),
            timeline in 1u32..20,
            lsn in 0u64..0x2_0000,
        ) {
            let (current, text, ancestors) = file(&steps);
            let here = promoted(current, &text);
            let (mut r, why) = Replay::new(&tail_on(timeline, lsn), None, &here, None);
            let below_switch = ancestors.iter().any(|&(t, end)| t == timeline && lsn < end);
            let expect_trust = (timeline == current || below_switch) && lsn < here.wal_end.0;
            proptest::prop_assert_eq!(why.is_none(), expect_trust, "{:?}", why);
            // Trusted: the events before the tail are skipped; otherwise everything publishes.
            let before = r.replayed(pos(lsn.saturating_sub(8), 0), "x");
            let skips = lsn >= 8 && expect_trust;
            proptest::prop_assert_eq!(before == Replayed::Skip, skips);
        }
    }

    #[test]
    fn empty_stream_skips_nothing_and_says_nothing() {
        let (mut r, why) = Replay::new(
            &Tail {
                last_sequence: 0,
                last: None,
                max_msg_size: None,
            },
            None,
            &origin(),
            None,
        );
        assert_eq!(why, None);
        assert_eq!(r.replayed(pos(1, 0), "a"), Replayed::Publish);
    }
}
