//! What the stream says is parked: the one reader of the parking subjects, for the session (the
//! parked set it starts from, [`rebuild`]; a key's run when a control message releases it,
//! [`run_bounds`] and [`read_run`]) and for the operator tools (`parked`, `status`, `verify`:
//! [`each_parked`]). The stream is the record: a parking subject whose last message is a parked
//! copy is a parked key, one whose last message is a release marker is not, and a key's run is
//! the parked copies after the release marker before it (in stream order). Nothing here trusts
//! memory, so a restart, a promotion or a standby taking over reads the same.
//!
//! Every read goes through the NATS port (`read_subjects`), so the simulation's JetStream answers
//! it too, and holds one message at a time: the parked set is bounded by
//! `outbox.max_parked_keys`, a run is read in stream order without being held.
//!
//! Which keys are parked is read as every message of the parking subjects in stream order,
//! headers only, through a read that moves to a new consumer every page (16,384 deliveries):
//! the last message of each key wins, a release marker takes the key out. A last-per-subject read
//! (one consumer delivering each subject's newest message) would hold fewer messages, but it
//! cannot be paged (a second consumer cannot start where the first stopped), and past the client's
//! buffer (tens of thousands of subjects) deliveries were dropped and the session restarted for
//! ever. The keys held while reading are those parked at that point of the stream, which the
//! relay bounded by `outbox.max_parked_keys`: one more ends the read, and the caller's bound
//! (a stop naming the key, `parked`'s "more") applies.

use std::collections::HashMap;
use std::time::Duration;

use async_nats::HeaderMap;

use super::key::{KeyHash, key_of_subject, parked_filter, parked_subject};
use super::set::{Full, ParkedKey, ParkedSet};
use crate::message::parked::{CONTROL_ID, PARKED_BEHIND, PARKED_COUNT, PARKED_SINCE, PARKING};
use crate::message::{AGGREGATE_ID, AGGREGATE_TYPE, ERROR};
use crate::nats::{NatsError, NatsPort, StoredMessage, SubjectRead};

/// One parked key as the stream shows it, for the operator tools.
#[derive(Debug, Clone)]
pub struct ParkedEntry {
    /// The key.
    pub key: KeyHash,
    /// Its parking subject.
    pub subject: String,
    /// `Outbox-Aggregate-Type` of its last parked copy (as the header holds it: one line).
    pub aggregate_type: Option<String>,
    /// `Outbox-Aggregate-Id` of its last parked copy.
    pub aggregate_id: Option<String>,
    /// The run: poison, reason, count, since.
    pub parked: ParkedKey,
    /// The stream sequence of its last parked copy.
    pub seq: u64,
}

/// The longest key value an entry keeps, in bytes (the headers hold the values whole).
const MAX_KEY_VALUE_BYTES: usize = 256;

/// What a message on a parking subject is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Mark {
    /// A parked copy of its key's run, as its headers name the run.
    Copy(ParkedKey),
    /// A release marker of control request `request`.
    Released {
        /// `Outbox-Control-Id`.
        request: String,
    },
    /// Neither (a message the relay did not write).
    Other,
}

/// What the headers of a message on a parking subject say it is.
pub fn mark(h: &HeaderMap) -> Mark {
    let text = |n: &str| h.get(n).map(|v| v.as_str());
    if text(PARKING).is_some() {
        return Mark::Released {
            request: text(CONTROL_ID).unwrap_or_default().to_owned(),
        };
    }
    match text(PARKED_BEHIND) {
        Some(behind) => {
            let mut k = ParkedKey::new(
                behind,
                text(ERROR).unwrap_or_default(),
                text(PARKED_SINCE).unwrap_or_default().to_owned(),
            );
            k.count = text(PARKED_COUNT).and_then(|c| c.parse().ok()).unwrap_or(1);
            Mark::Copy(k)
        }
        None => Mark::Other,
    }
}

/// Calls `each` with every parked key the stream shows (every message of
/// `<dead_letter_subject>.parked.>` in stream order, headers only, paged: see the module docs),
/// in no particular order, holding at most `max` + 1 keys: with one more than `max` parked at some
/// point of the stream the read ends there, and `each` gets `max` + 1 keys (its bound applies).
/// `each` may stop the calls by returning `Err`.
pub async fn each_parked<E>(
    port: &NatsPort,
    stream: &str,
    dead_letter_subject: &str,
    max: usize,
    timeout: Duration,
    mut each: impl FnMut(ParkedEntry) -> Result<(), E>,
) -> Result<Result<(), E>, NatsError> {
    let filter = parked_filter(dead_letter_subject);
    let mut read = port
        .read_subjects(stream, &filter, SubjectRead::Headers(1), timeout)
        .await?;
    let mut keys: HashMap<KeyHash, ParkedEntry> = HashMap::new();
    while let Some(m) = read.next().await? {
        let Some(key) = key_of_subject(dead_letter_subject, &m.subject) else {
            continue;
        };
        match mark(&m.headers) {
            Mark::Copy(parked) => {
                let value = |n: &str| {
                    m.headers
                        .get(n)
                        .map(|v| crate::text::cut(v.as_str(), MAX_KEY_VALUE_BYTES).to_owned())
                };
                let entry = ParkedEntry {
                    key,
                    subject: m.subject.clone(),
                    aggregate_type: value(AGGREGATE_TYPE),
                    aggregate_id: value(AGGREGATE_ID),
                    parked,
                    seq: m.seq,
                };
                keys.insert(key, entry);
                if keys.len() > max {
                    break;
                }
            }
            Mark::Released { .. } => {
                keys.remove(&key);
            }
            // A message the relay did not write changes nothing.
            Mark::Other => {}
        }
    }
    // In the order of their parking subjects, as `parked` and `status` say: a map's own order
    // differs from one process to the next (the simulation's replay of a seed saw `status` name
    // another first key).
    let mut entries: Vec<ParkedEntry> = keys.into_values().collect();
    entries.sort_unstable_by(|a, b| a.subject.cmp(&b.subject));
    for entry in entries {
        if let Err(e) = each(entry) {
            return Ok(Err(e));
        }
    }
    Ok(Ok(()))
}

/// Why the parked set could not be rebuilt from the stream.
#[derive(Debug, thiserror::Error)]
pub enum RebuildError {
    /// The parking subjects could not be read.
    #[error("reading the parked keys from stream {stream}")]
    Read {
        /// The stream.
        stream: String,
        /// Why.
        #[source]
        source: NatsError,
    },
    /// More keys are parked than the bound allows. What to do is the relay's to say
    /// (`SinkError::ParkedTooMany`): only it knows the command, with its `--config`, that lists
    /// this relay's keys.
    #[error(
        "stream {stream} holds more than {max} parked keys (outbox.max_parked_keys = {max}), among them {key}"
    )]
    Full {
        /// The stream.
        stream: String,
        /// The bound.
        max: usize,
        /// The key past the bound, `aggregate_type/aggregate_id`, escaped.
        key: String,
    },
}

/// The parked set a session starts from: every parked key the stream shows, bounded by `max`.
pub async fn rebuild(
    port: &NatsPort,
    stream: &str,
    dead_letter_subject: &str,
    max: usize,
    timeout: Duration,
) -> Result<ParkedSet, RebuildError> {
    let mut set = ParkedSet::new(max);
    let read = each_parked(port, stream, dead_letter_subject, max, timeout, |e| {
        set.park(e.key, e.parked.clone())
            .map(|_| ())
            .map_err(|Full { max }| RebuildError::Full {
                stream: stream.to_owned(),
                max,
                key: entry_key_text(&e),
            })
    })
    .await
    .map_err(|source| RebuildError::Read {
        stream: stream.to_owned(),
        source,
    })?;
    read?;
    Ok(set)
}

/// An entry's key as one escaped line, `aggregate_type/aggregate_id`.
pub fn entry_key_text(e: &ParkedEntry) -> String {
    let part = |v: &Option<String>| {
        v.as_deref()
            .map_or_else(|| "(null)".to_owned(), |s| s.escape_debug().to_string())
    };
    format!("{}/{}", part(&e.aggregate_type), part(&e.aggregate_id))
}

/// Where the run a control request releases lies on its key's parking subject: the parked
/// copies with sequences in `after < seq < before` (`before` = `None`: to the end).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RunBounds {
    /// The sequence of the release marker before the run (0: none).
    pub after: u64,
    /// The sequence of `request`'s own marker, when the stream holds it already (a replay).
    pub before: Option<u64>,
    /// Parked copies between the two (for a key that is not parked and no marker: 0).
    pub copies: u64,
}

/// Which run control request `request` releases on `key`'s subject, decided from the stream
/// (headers only, one message at a time): when the stream holds `released:<request>` already, the
/// run between the marker before it and it; else the run after the key's last marker.
pub async fn run_bounds(
    port: &NatsPort,
    stream: &str,
    dead_letter_subject: &str,
    key: KeyHash,
    request: &str,
    timeout: Duration,
) -> Result<RunBounds, NatsError> {
    let subject = parked_subject(dead_letter_subject, key);
    let mut read = port
        .read_subjects(stream, &subject, SubjectRead::Headers(1), timeout)
        .await?;
    let (mut last_marker, mut copies) = (0, 0);
    while let Some(m) = read.next().await? {
        match mark(&m.headers) {
            Mark::Released { request: r } if r == request => {
                return Ok(RunBounds {
                    after: last_marker,
                    before: Some(m.seq),
                    copies,
                });
            }
            Mark::Released { .. } => {
                last_marker = m.seq;
                copies = 0;
            }
            Mark::Copy(_) => copies += 1,
            Mark::Other => {}
        }
    }
    Ok(RunBounds {
        after: last_marker,
        before: None,
        copies,
    })
}

/// A read of the parked copies of a run, in stream order, with their payloads.
pub struct RunRead {
    read: Box<dyn crate::nats::MessageRead>,
    before: Option<u64>,
}

impl RunRead {
    /// The next parked copy of the run, `None` past its end.
    pub async fn next(&mut self) -> Result<Option<StoredMessage>, NatsError> {
        while let Some(m) = self.read.next().await? {
            if self.before.is_some_and(|b| m.seq >= b) {
                return Ok(None);
            }
            match mark(&m.headers) {
                Mark::Copy(_) => return Ok(Some(m)),
                // A marker inside the bounds cannot be (the bounds are between two), and a
                // foreign message is no part of a run.
                Mark::Released { .. } | Mark::Other => continue,
            }
        }
        Ok(None)
    }
}

/// Starts the read of the run `bounds` names on `key`'s subject.
pub async fn read_run(
    port: &NatsPort,
    stream: &str,
    dead_letter_subject: &str,
    key: KeyHash,
    bounds: RunBounds,
    timeout: Duration,
) -> Result<RunRead, NatsError> {
    let subject = parked_subject(dead_letter_subject, key);
    let read = port
        .read_subjects(
            stream,
            &subject,
            SubjectRead::From(bounds.after + 1),
            timeout,
        )
        .await?;
    Ok(RunRead {
        read,
        before: bounds.before,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::message::parked::{Release, parked_copy, release_marker};
    use crate::parking::revive::tests::{event, run};

    #[test]
    fn a_parked_copy_and_a_marker_read_back_as_what_they_are() {
        let e = event("e-2", None);
        let copy = parked_copy(&e, &run("e-1", 2), None, crate::message::Shrink::Keep);
        let Mark::Copy(k) = mark(&copy.headers) else {
            panic!("a copy")
        };
        assert_eq!(
            (k.poison.as_str(), k.reason.as_str(), k.count),
            ("e-1", "bad", 2)
        );
        assert_eq!(k.since, "2026-01-01T00:00:00Z");
        let m = release_marker("dl.parked.x", "r-1", Release::Requeued, None, None);
        assert_eq!(
            mark(&m.headers),
            Mark::Released {
                request: "r-1".into()
            }
        );
        assert_eq!(mark(&HeaderMap::new()), Mark::Other);
    }
}
