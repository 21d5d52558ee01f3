//! The parked set as a session holds it, pure: [`KeyHash`] → [`ParkedKey`] (the poison event's
//! id, cut to [`crate::event::MAX_ID_BYTES`]; the first failure's reason, one line of at most
//! [`MAX_REASON_BYTES`]; how many events the key's current run holds; since when), bounded by
//! `outbox.max_parked_keys` ([`ParkedSet::park`] refuses one more: the relay stops, nothing is
//! lost). It is never the record: every session rebuilds it from the parking subjects in the
//! stream (`ledger.rs`), so what it says is what the stream says, plus what this session stored.

use std::collections::HashMap;

use super::key::KeyHash;
use crate::text::{cut, one_line};

/// The longest reason a parked key keeps (and its parked copies carry), in bytes.
pub const MAX_REASON_BYTES: usize = 512;

/// One parked key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParkedKey {
    /// The poison event's id (`Outbox-Parked-Behind`).
    pub poison: String,
    /// The first failure's reason (`Outbox-Error`), one line.
    pub reason: String,
    /// Events in the key's current run, the poison included (`Outbox-Parked-Count` of the last).
    pub count: u64,
    /// The poison's commit time, RFC 3339 (`Outbox-Parked-Since`).
    pub since: String,
    /// The poison's place in commit order, when this process parked the key (`None` when the key
    /// was read back from the stream: its poison is stored, so it comes before every event the
    /// session sends). An event sent before the key was parked and sent again behind a refusal is
    /// held only by a poison that comes before it ([`ParkedSet::holds`]).
    pub at: Option<crate::position::Position>,
}

impl ParkedKey {
    /// A key parked at `poison` for `reason` since `since`, with its fields cut to their bounds.
    pub fn new(poison: &str, reason: &str, since: String) -> ParkedKey {
        ParkedKey {
            poison: cut(poison, crate::event::MAX_ID_BYTES).to_owned(),
            reason: bounded_reason(reason),
            count: 1,
            since: cut(&since, 64).to_owned(),
            at: None,
        }
    }

    /// The same key, its poison at `at` in commit order.
    pub fn at(mut self, at: crate::position::Position) -> ParkedKey {
        self.at = Some(at);
        self
    }
}

/// `reason` as a parked key keeps it: one line, at most [`MAX_REASON_BYTES`].
pub fn bounded_reason(reason: &str) -> String {
    cut(&one_line(reason), MAX_REASON_BYTES).to_owned()
}

/// Unix milliseconds of a `since` (`YYYY-MM-DDTHH:MM:SS[.ffffff]Z`, as the relay writes it),
/// `None` for any other text. Howard Hinnant's `days_from_civil`
/// (<https://howardhinnant.github.io/date_algorithms.html#days_from_civil>).
pub fn since_unix_ms(since: &str) -> Option<u64> {
    let b = since.as_bytes();
    if b.len() < 20 || b[4] != b'-' || b[7] != b'-' || b[10] != b'T' || !since.ends_with('Z') {
        return None;
    }
    let num = |r: std::ops::Range<usize>| since.get(r)?.parse::<i64>().ok();
    let (y, m, d) = (num(0..4)?, num(5..7)?, num(8..10)?);
    let (hh, mm, ss) = (num(11..13)?, num(14..16)?, num(17..19)?);
    let frac_us = match since.get(19..since.len() - 1)? {
        "" => 0,
        f => {
            let digits = f.strip_prefix('.')?;
            let us: String = digits
                .chars()
                .chain(std::iter::repeat('0'))
                .take(6)
                .collect();
            us.parse::<i64>().ok()?
        }
    };
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    let ms = (days * 86_400 + hh * 3600 + mm * 60 + ss) * 1000 + frac_us / 1000;
    u64::try_from(ms).ok()
}

/// Parking one more key would pass `outbox.max_parked_keys`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Full {
    /// The bound.
    pub max: usize,
}

/// The parked keys of one session; see the module docs.
#[derive(Debug, Default, Clone)]
pub struct ParkedSet {
    keys: HashMap<KeyHash, ParkedKey>,
    max: usize,
    /// The request whose run is being republished, while it is: a copy parked again then has an
    /// id of its own (`parked:<id>:<request>`), or JetStream would drop it as the first copy's
    /// duplicate.
    requeue: Option<String>,
    /// Whether that request republishes a dead letter (`requeue_event`): a still-invalid event is
    /// then a new dead letter (`dead-letter:<id>:<request>`), whatever `outbox.on_invalid` says.
    of_dead_letter: bool,
    /// `SIM_MUTATION=memory` (`mutation.rs`): the stream's last sequence when the session began;
    /// the run copies up to it are not in this session's memory.
    #[cfg(feature = "test-support")]
    pub memory_from: u64,
}

impl ParkedSet {
    /// An empty set that holds at most `max` keys.
    pub fn new(max: usize) -> ParkedSet {
        ParkedSet {
            keys: HashMap::new(),
            max,
            requeue: None,
            of_dead_letter: false,
            #[cfg(feature = "test-support")]
            memory_from: 0,
        }
    }

    /// The request whose run is being republished now, if one is.
    pub fn requeue(&self) -> Option<&str> {
        self.requeue.as_deref()
    }

    /// Sets (or, with `None`, ends) the request whose run is being republished.
    pub fn set_requeue(&mut self, request: Option<String>) {
        self.requeue = request;
        self.of_dead_letter = false;
    }

    /// Sets (or, with `None`, ends) the request republishing a dead letter (`requeue_event`).
    pub fn set_requeue_dead_letter(&mut self, request: Option<String>) {
        self.of_dead_letter = request.is_some();
        self.requeue = request;
    }

    /// The request republishing a dead letter now, if one is: a still-invalid event becomes a
    /// new dead letter of its own, never a stop and never a parked key.
    pub fn requeue_of_dead_letter(&self) -> Option<&str> {
        self.requeue.as_deref().filter(|_| self.of_dead_letter)
    }

    /// Nothing parked: the hot path's one check, before it hashes any key.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// Parked keys.
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    /// The bound (`outbox.max_parked_keys`).
    pub fn max(&self) -> usize {
        self.max
    }

    /// The parked key `key`, if it is parked.
    pub fn get(&self, key: &KeyHash) -> Option<&ParkedKey> {
        self.keys.get(key)
    }

    /// Counts one more event in `key`'s run and returns the key as it is now; `None` when `key`
    /// is not parked.
    pub fn hold(&mut self, key: &KeyHash) -> Option<&ParkedKey> {
        let k = self.keys.get_mut(key)?;
        k.count += 1;
        Some(k)
    }

    /// Whether `key` is parked by a poison that comes before `position` in commit order (or by one
    /// read back from the stream, which comes before everything the session sends). A key parked by
    /// a later event does not hold an earlier one: that event was sent before the poison, and
    /// holding it when it is sent again would put it behind the poison in the key's run.
    pub fn holds(&self, key: &KeyHash, position: crate::position::Position) -> bool {
        self.keys
            .get(key)
            .is_some_and(|k| k.at.is_none_or(|at| at < position))
    }

    /// Parks `key` as `parked` (a new run, or a run re-parked by a requeue); [`Full`] when that
    /// would pass the bound, and the set is unchanged.
    pub fn park(&mut self, key: KeyHash, parked: ParkedKey) -> Result<&ParkedKey, Full> {
        if !self.keys.contains_key(&key) && self.keys.len() >= self.max {
            return Err(Full { max: self.max });
        }
        self.keys.insert(key, parked);
        Ok(&self.keys[&key])
    }

    /// Releases `key` (requeued or discarded); what it was, if it was parked.
    pub fn release(&mut self, key: &KeyHash) -> Option<ParkedKey> {
        self.keys.remove(key)
    }

    /// Events held on parked keys (the sum of the runs).
    pub fn events(&self) -> u64 {
        self.keys.values().map(|k| k.count).sum()
    }

    /// The oldest `since` among the parked keys (RFC 3339 texts of one form sort as times).
    pub fn oldest(&self) -> Option<&str> {
        self.keys.values().map(|k| k.since.as_str()).min()
    }

    /// Every parked key.
    pub fn iter(&self) -> impl Iterator<Item = (&KeyHash, &ParkedKey)> {
        self.keys.iter()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(n: u32) -> KeyHash {
        KeyHash::of(Some("Claim"), Some(&n.to_string()))
    }

    #[test]
    fn a_run_counts_its_events_and_a_release_ends_it() {
        let mut s = ParkedSet::new(2);
        assert!(s.hold(&key(1)).is_none(), "not parked: nothing held");
        s.park(
            key(1),
            ParkedKey::new("e-1", "bad", "2026-01-01T00:00:00Z".into()),
        )
        .unwrap();
        assert_eq!(s.hold(&key(1)).unwrap().count, 2);
        assert_eq!(s.events(), 2);
        assert_eq!(s.release(&key(1)).unwrap().poison, "e-1");
        assert!(s.is_empty());
    }

    #[test]
    fn the_bound_refuses_one_more_key_but_not_a_parked_one_again() {
        let mut s = ParkedSet::new(1);
        let p = || ParkedKey::new("e", "r", "2026-01-01T00:00:00Z".into());
        s.park(key(1), p()).unwrap();
        assert_eq!(s.park(key(2), p()), Err(Full { max: 1 }));
        assert!(s.park(key(1), p()).is_ok(), "a re-park replaces the run");
        assert_eq!(s.len(), 1);
    }

    #[test]
    fn what_a_key_keeps_is_bounded_in_bytes() {
        let long = format!("{}\nsecond line", "x".repeat(4000));
        let k = ParkedKey::new(&"i".repeat(4000), &long, "t".repeat(500));
        assert!(k.reason.len() <= MAX_REASON_BYTES && !k.reason.contains('\n'));
        assert!(k.poison.len() <= crate::event::MAX_ID_BYTES);
        assert!(k.since.len() <= 64);
    }

    #[test]
    fn since_reads_back_as_unix_time() {
        assert_eq!(since_unix_ms("1970-01-01T00:00:00Z"), Some(0));
        assert_eq!(
            since_unix_ms(&crate::message::rfc3339_micros(0)),
            Some(946_684_800_000),
            "2000-01-01, Postgres' epoch"
        );
        assert_eq!(
            since_unix_ms("2024-05-17T09:30:00.123456Z"),
            Some(1_715_938_200_123)
        );
        assert_eq!(since_unix_ms("yesterday"), None);
    }

    #[test]
    fn the_oldest_is_the_earliest_since() {
        let mut s = ParkedSet::new(5);
        s.park(
            key(1),
            ParkedKey::new("a", "r", "2026-02-01T00:00:00Z".into()),
        )
        .unwrap();
        s.park(
            key(2),
            ParkedKey::new("b", "r", "2026-01-01T00:00:00Z".into()),
        )
        .unwrap();
        assert_eq!(s.oldest(), Some("2026-01-01T00:00:00Z"));
    }
}
