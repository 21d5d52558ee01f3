//! Warnings with stable names: what `setup`, `run`, `status` and `backfill` find that does not stop
//! them, each under a name that stays the same from release to release, so that an operator who
//! decided to live with one can acknowledge it by name (`warnings.acknowledged`) instead of learning
//! to skip every warning. An acknowledged warning is left out of what is printed and logged (and
//! `status` says which names were left out); an unknown name in the key is a configuration error,
//! so a typo silences nothing.
//!
//! A leaf: the names and the type, nothing that reads a server.

use std::fmt;

use serde::Serialize;

/// One finding that does not stop the command: its stable name and its one-line text.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Warning {
    /// The stable name (one of [`NAMES`]).
    pub name: &'static str,
    /// What was found and what to do, one line.
    pub text: String,
}

impl Warning {
    /// The warning `name` (one of [`NAMES`]) saying `text`.
    pub fn new(name: &'static str, text: impl Into<String>) -> Warning {
        debug_assert!(
            NAMES.iter().any(|(n, _)| *n == name),
            "unnamed warning {name}"
        );
        Warning {
            name,
            text: text.into(),
        }
    }
}

impl Warning {
    /// The text as one escaped line of at most [`MAX_TEXT`] bytes: a warning may quote a table, a
    /// function or a subject a server named, which may hold control characters.
    pub fn text_line(&self) -> String {
        crate::text::shown(&self.text, MAX_TEXT)
    }
}

/// The longest warning text printed.
pub const MAX_TEXT: usize = 4096;

impl fmt::Display for Warning {
    /// `warning[NAME]: TEXT`, the line `setup`, `status` and `backfill` print.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "warning[{}]: {}", self.name, self.text_line())
    }
}

/// Every warning's name and what it is about (docs/operations.md lists them). Names are only ever
/// added: an acknowledged name must keep meaning the same thing.
pub const NAMES: &[(&str, &str)] = &[
    (
        "unknown-variable",
        "an OUTBOX_RELAY_* variable names no setting but is close to one",
    ),
    (
        "unrelayed-message-helper",
        "sql/06's helper is installed for a prefix this relay does not relay",
    ),
    (
        "public-emit-message",
        "every role may call pg_logical_emit_message while a prefix is relayed",
    ),
    (
        "public-emit-helper",
        "every role may call a SECURITY DEFINER helper that emits logical messages",
    ),
    (
        "publication-more-than-inserts",
        "the publication publishes updates, deletes or truncates too",
    ),
    (
        "rows-before-slot",
        "the outbox table holds rows committed before the slot exists",
    ),
    (
        "no-synchronized-standby-slots",
        "physical standbys stream, but synchronized_standby_slots is empty",
    ),
    (
        "not-failover-slot",
        "the slot would not survive a promotion of a standby",
    ),
    (
        "standby-without-slot",
        "a standby of the URL has no synced copy of the failover slot",
    ),
    (
        "reached-standby",
        "postgres.url reached a standby, not the primary",
    ),
    (
        "wal-keep-unbounded",
        "max_slot_wal_keep_size = -1: a stopped relay's slot keeps WAL until the disk is full",
    ),
    (
        "wal-keep-near-limit",
        "the slot retains half of max_slot_wal_keep_size or more",
    ),
    (
        "idle-slot-timeout",
        "Postgres 18 invalidates a slot no relay holds for idle_replication_slot_timeout",
    ),
    (
        "partitions-not-covered",
        "the stream's subjects leave some {partition} subjects out",
    ),
    (
        "streams-not-listed",
        "the NATS user may not list streams, so another relay's could not be checked",
    ),
    (
        "filtered-overlap",
        "another relay's publication relays the same table through a row filter",
    ),
    ("memory-storage", "the stream keeps its messages in memory"),
    (
        "one-replica",
        "the stream has one replica, and an ack is not a power-loss-safe write",
    ),
    (
        "duplicate-window",
        "the stream's duplicate window is shorter than the relay's retry horizon",
    ),
    ("stream-filling", "the stream is 80 % full or more"),
    (
        "dead-letters",
        "the stream holds dead letters: events that could not be published as they are",
    ),
    (
        "unheld-within-grace",
        "no relay holds the slot, for less than status.grace_secs so far",
    ),
    (
        "own-word-unknown",
        "the relay's own word could not be asked (http.listen unreachable or empty)",
    ),
    (
        "own-word-not-believed",
        "what answers on http.listen is not a relay of this slot that Postgres shows",
    ),
    (
        "stop-mark-unjudged",
        "whether another client consumed the slot since the last relay session cannot be told",
    ),
];

/// The names in `acknowledged` that are no warning's name.
pub fn unknown_names(acknowledged: &[String]) -> Vec<&str> {
    acknowledged
        .iter()
        .map(String::as_str)
        .filter(|a| !NAMES.iter().any(|(n, _)| n == a))
        .collect()
}

/// `warnings` without those whose name is in `acknowledged`, and the names left out (each once).
pub fn split_acknowledged(
    warnings: Vec<Warning>,
    acknowledged: &[String],
) -> (Vec<Warning>, Vec<&'static str>) {
    let mut left_out: Vec<&'static str> = Vec::new();
    let kept = warnings
        .into_iter()
        .filter(|w| {
            let ack = acknowledged.iter().any(|a| a == w.name);
            if ack && !left_out.contains(&w.name) {
                left_out.push(w.name);
            }
            !ack
        })
        .collect();
    (kept, left_out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique_lowercase_words_joined_by_dashes() {
        for (i, (name, what)) in NAMES.iter().enumerate() {
            assert!(
                name.bytes().all(|b| b.is_ascii_lowercase() || b == b'-'),
                "{name}"
            );
            assert!(!what.is_empty());
            assert!(!NAMES[..i].iter().any(|(n, _)| n == name), "{name} twice");
        }
    }

    /// docs/operations.md's table "Warnings and their names" lists every name, as [`NAMES`] says it.
    #[test]
    fn the_operations_guide_lists_every_name() {
        let doc = include_str!("../docs/operations.md");
        let (_, table) = doc
            .split_once("### Warnings and their names\n")
            .expect("docs/operations.md has the section");
        let table = table.split("\n## ").next().unwrap_or(table);
        for (name, what) in NAMES {
            assert!(
                table.contains(&format!("| `{name}` | {what} |")),
                "docs/operations.md lacks the row of {name}"
            );
        }
    }

    #[test]
    fn acknowledged_names_are_left_out_and_said_once() {
        let w = |n| Warning::new(n, "text");
        let (kept, left_out) = split_acknowledged(
            vec![w("dead-letters"), w("one-replica"), w("dead-letters")],
            &["dead-letters".to_owned()],
        );
        assert_eq!(kept, vec![w("one-replica")]);
        assert_eq!(left_out, vec!["dead-letters"]);
        assert_eq!(
            unknown_names(&["dead-letters".into(), "dead-leters".into()]),
            ["dead-leters"]
        );
        assert_eq!(w("one-replica").to_string(), "warning[one-replica]: text");
    }
}
