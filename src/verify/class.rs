//! The classes of `verify`'s findings: each is a count in `--json` (its key), a line in the text
//! report, whether it is a difference (exit 1), and the recovery it calls for, named in the report
//! next to it (the sections of docs/recovery.md, "Differences found by outbox-relay verify").

/// One class of finding.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Class {
    /// A row whose event is in no message of the relay's and that the slot does not hold.
    Missing,
    /// A row whose event the slot still holds (committed, not confirmed): decided by the slot.
    Waiting,
    /// A row not in the stream whose waiting could not be told (the slot could not be copied, or
    /// the look's bound ended first). Never counted as missing.
    Unknown,
    /// A row (or, without one, an event) stored only on the dead-letter subject.
    DeadLettered,
    /// A row (or, without one, an event) whose only copies are parked, the last in its key's
    /// current run: held back from its subject's consumers until the key is requeued or
    /// discarded.
    Parked,
    /// A row (or event) whose only copies are parked, in a run an operator discarded
    /// (`outbox-relay requeue --discard`): a decision recorded in the stream, not a loss.
    Discarded,
    /// Stream sequences in the relay's range that are gone where the stream's limits cannot
    /// explain it (each sequence counted).
    Holes,
    /// An event id stored again (each later copy of its kind counted).
    Duplicates,
    /// A message of the relay's whose position is not above the one before it.
    OutOfOrder,
    /// A message without the relay's headers.
    Foreign,
    /// A row's message on another subject than the template gives.
    Misrouted,
    /// With `--payloads`: a row's message body differs from the row's payload.
    PayloadDiffers,
    /// A row not in the stream while its message is explained away by the stream's limits or
    /// `--from-sequence`.
    OlderThanStream,
    /// An event with no row (messages-only outbox, a row deleted in its transaction or pruned):
    /// checked for continuity only.
    StreamOnly,
    /// A row created before the backfill that began the stream, which that backfill did not
    /// select: not the relay's.
    BeforeBackfill,
}

impl Class {
    /// Every class, in the order the report shows them.
    pub const ALL: [Class; 15] = [
        Class::Missing,
        Class::DeadLettered,
        Class::Parked,
        Class::Holes,
        Class::Duplicates,
        Class::OutOfOrder,
        Class::Foreign,
        Class::Misrouted,
        Class::PayloadDiffers,
        Class::Unknown,
        Class::Waiting,
        Class::OlderThanStream,
        Class::StreamOnly,
        Class::BeforeBackfill,
        Class::Discarded,
    ];

    /// Its key in `--json` and its name in the text report.
    pub fn key(self) -> &'static str {
        match self {
            Class::Missing => "missing",
            Class::Waiting => "waiting",
            Class::Unknown => "unknown",
            Class::DeadLettered => "dead_lettered",
            Class::Parked => "parked",
            Class::Discarded => "discarded",
            Class::Holes => "holes",
            Class::Duplicates => "duplicates",
            Class::OutOfOrder => "out_of_order",
            Class::Foreign => "foreign",
            Class::Misrouted => "misrouted",
            Class::PayloadDiffers => "payload_differs",
            Class::OlderThanStream => "older_than_stream",
            Class::StreamOnly => "stream_only",
            Class::BeforeBackfill => "before_backfill",
        }
    }

    /// Whether it is a difference (exit 1). `foreign` is one only with the fence: without it other
    /// writers are allowed. Waiting, unknown, stream-only, older than the stream, before the
    /// backfill and discarded are not: none of them says an event was lost (unknown sets exit 2
    /// instead; discarded is an operator's decision). Parked is, as dead-lettered is: its
    /// subject's consumers have not seen it, and the operator has a command to act with.
    pub fn is_difference(self, fence: bool) -> bool {
        match self {
            Class::Missing
            | Class::DeadLettered
            | Class::Parked
            | Class::Holes
            | Class::Duplicates
            | Class::OutOfOrder
            | Class::Misrouted
            | Class::PayloadDiffers => true,
            Class::Foreign => fence,
            Class::Waiting
            | Class::Unknown
            | Class::OlderThanStream
            | Class::StreamOnly
            | Class::BeforeBackfill
            | Class::Discarded => false,
        }
    }

    /// What to do about it, one line, with the section of docs/recovery.md that says more.
    pub fn recovery(self) -> &'static str {
        match self {
            Class::Missing => {
                "recover a lost or consumed slot first, else re-insert the rows while the relay runs \
                 (check-schemas first): docs/recovery.md#missing"
            }
            Class::Waiting => {
                "nothing lost: start the relay (or let NATS return) and it publishes them: \
                 docs/recovery.md#waiting"
            }
            Class::Unknown => {
                "let verify copy the slot (REPLICATION, a free slot) or raise --slot-look, then run it again: \
                 docs/recovery.md#unknown"
            }
            Class::DeadLettered => {
                "fix the cause named in Outbox-Error, then outbox-relay requeue --event ID for each (or re-insert \
                 the row with the same id): docs/recovery.md#dead_lettered"
            }
            Class::Parked => {
                "fix the cause named in Outbox-Error, then outbox-relay requeue --key TYPE/ID (or --discard); \
                 outbox-relay parked lists the keys: docs/recovery.md#parked"
            }
            Class::Discarded => {
                "nothing to do: an operator discarded the key's run; re-insert the rows if they are wanted \
                 after all: docs/recovery.md#discarded"
            }
            Class::Holes => {
                "find who deleted them (nats stream info, the permissions); re-insert the rows of those \
                 that had one: docs/recovery.md#holes"
            }
            Class::Duplicates => {
                "consumers drop them by id; close the permissions if another client wrote them: \
                 docs/recovery.md#duplicates"
            }
            Class::OutOfOrder => {
                "check the listed events with the consumers that rely on order: docs/recovery.md#out_of_order"
            }
            Class::Foreign => {
                "close the stream's subjects to other publishers: docs/recovery.md#foreign"
            }
            Class::Misrouted => {
                "re-insert the rows once their ids are outside the duplicate window: docs/recovery.md#misrouted"
            }
            Class::PayloadDiffers => {
                "close the permissions; re-insert the rows if they are the truth: \
                 docs/recovery.md#payload_differs"
            }
            Class::OlderThanStream => {
                "nothing to do about the stream; verify a narrower range: docs/recovery.md#older_than_stream"
            }
            Class::StreamOnly => {
                "nothing to do: keep rows for a while to check more than continuity: \
                 docs/recovery.md#stream_only"
            }
            Class::BeforeBackfill => {
                "nothing to do: the publisher before the relay sent them: docs/recovery.md#before_backfill"
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_class_has_a_key_of_its_own_and_a_recovery_in_recovery_md() {
        let mut keys: Vec<&str> = Class::ALL.iter().map(|c| c.key()).collect();
        keys.sort_unstable();
        keys.dedup();
        assert_eq!(keys.len(), Class::ALL.len());
        let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/recovery.md"))
            .unwrap();
        for c in Class::ALL {
            let anchor = format!("docs/recovery.md#{}", c.key());
            assert!(c.recovery().ends_with(&anchor), "{c:?}: {}", c.recovery());
            // The section's heading is the class's key, so GitHub's anchor is the key.
            assert!(
                doc.contains(&format!("\n### `{}`\n", c.key())),
                "docs/recovery.md has no section ### `{}`",
                c.key()
            );
        }
    }

    #[test]
    fn waiting_unknown_and_stream_only_are_no_difference_foreign_only_with_the_fence() {
        for c in [
            Class::Waiting,
            Class::Unknown,
            Class::StreamOnly,
            Class::OlderThanStream,
            Class::BeforeBackfill,
            Class::Discarded,
        ] {
            assert!(!c.is_difference(true), "{c:?}");
        }
        for c in [
            Class::Missing,
            Class::DeadLettered,
            Class::Parked,
            Class::Holes,
        ] {
            assert!(c.is_difference(false), "{c:?}");
        }
        assert!(Class::Foreign.is_difference(true));
        assert!(!Class::Foreign.is_difference(false));
    }
}
