//! What an example of a `verify` finding says about its message, as a [`Detail`]: the steps find
//! it, this file says how it reads (its `Display`, the `detail` of `--json`'s examples and the
//! text after an example's id). Values come from messages others wrote; the report keeps each
//! line escaped and bounded when it keeps the example (`report.rs`).

use std::fmt;

/// One example's detail.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Detail {
    /// A second copy: where the first is, and the replay that wrote it again, if one did (the
    /// stream's last sequence when that replay began).
    SecondCopy {
        /// The first copy's sequence.
        first: u64,
        /// `replay-over=N` of the later copy's position.
        replay_over: Option<u64>,
    },
    /// A break of order.
    NotAbove {
        /// The message's `Outbox-Position`.
        position: String,
    },
    /// A message without the relay's headers.
    Foreign {
        /// Its subject.
        subject: String,
    },
    /// A run of gone sequences.
    Gone {
        /// The first gone sequence.
        from: u64,
        /// The last.
        to: u64,
        /// How many.
        n: u64,
        /// Why they count as a hole.
        why: &'static str,
    },
    /// A dead letter: its subject, the subject it was meant for, its reason (one line).
    DeadLetter {
        /// The dead-letter subject.
        subject: String,
        /// `Outbox-Subject`.
        meant_for: Option<String>,
        /// `Outbox-Error`, or that it has none.
        reason: String,
    },
    /// A row's message on another subject.
    Misrouted {
        /// Where it is stored.
        stored_on: String,
        /// What the template gives (`None`: the row can only be a dead letter).
        template: Option<String>,
    },
    /// A row's message body differs.
    PayloadDiffers,
    /// A parked copy in its key's current run.
    Parked {
        /// The parking subject.
        subject: String,
        /// `Outbox-Parked-Behind`.
        behind: String,
        /// `Outbox-Error`.
        reason: String,
    },
    /// A parked copy of a run a marker ended without it.
    Discarded {
        /// The parking subject.
        subject: String,
        /// The marker's sequence.
        at: u64,
    },
    /// A parked copy whose run could not be read.
    RunUnread {
        /// The parking subject.
        subject: String,
        /// Why.
        why: String,
    },
    /// An event no row has, with what its message says.
    NoRow(Box<Detail>),
}

impl fmt::Display for Detail {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Detail::SecondCopy {
                first,
                replay_over: Some(n),
            } => write!(
                f,
                "first stored at sequence {first}; published again by a replay that trusted no tail (the \
                 stream's last sequence was {n} when it began)"
            ),
            Detail::SecondCopy { first, .. } => write!(f, "first stored at sequence {first}"),
            Detail::NotAbove { position } => write!(
                f,
                "Outbox-Position {position} is not above the message before it"
            ),
            Detail::Foreign { subject } => write!(f, "subject {subject}, no Outbox-Position"),
            Detail::Gone { from, to, n, why } => {
                write!(f, "sequences {from}..{to} gone ({n}), {why}")
            }
            Detail::DeadLetter {
                subject,
                meant_for,
                reason,
            } => {
                write!(f, "on {subject}")?;
                if let Some(m) = meant_for {
                    write!(f, ", meant for {m}")?;
                }
                write!(f, ": {reason}")
            }
            Detail::Misrouted {
                stored_on,
                template: Some(t),
            } => write!(f, "stored on {stored_on}, the template gives {t}"),
            Detail::Misrouted { stored_on, .. } => write!(
                f,
                "stored on {stored_on}, the row can only be a dead letter"
            ),
            Detail::PayloadDiffers => f.write_str("the payload differs from the row's"),
            Detail::Parked {
                subject,
                behind,
                reason,
            } => write!(f, "on {subject} behind {behind}: {reason}"),
            Detail::Discarded { subject, at } => write!(
                f,
                "on {subject}: its run was released at sequence {at} without it"
            ),
            Detail::RunUnread { subject, why } => {
                write!(f, "on {subject}: its run could not be read: {why}")
            }
            Detail::NoRow(d) => write!(f, "{d} (no row)"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The texts the report has printed: the enum changed how they are made, not a word.
    #[test]
    fn each_detail_reads_as_it_always_did() {
        let dl = Detail::DeadLetter {
            subject: "dl".into(),
            meant_for: Some("outbox.Claim".into()),
            reason: "bad".into(),
        };
        let cases = [
            (
                Detail::SecondCopy {
                    first: 4,
                    replay_over: None,
                },
                "first stored at sequence 4",
            ),
            (
                Detail::SecondCopy {
                    first: 4,
                    replay_over: Some(9),
                },
                "first stored at sequence 4; published again by a replay that trusted no tail (the stream's \
                 last sequence was 9 when it began)",
            ),
            (
                Detail::NotAbove {
                    position: "0/10:0".into(),
                },
                "Outbox-Position 0/10:0 is not above the message before it",
            ),
            (
                Detail::Foreign {
                    subject: "x".into(),
                },
                "subject x, no Outbox-Position",
            ),
            (
                Detail::Gone {
                    from: 3,
                    to: 4,
                    n: 2,
                    why: "deleted",
                },
                "sequences 3..4 gone (2), deleted",
            ),
            (dl.clone(), "on dl, meant for outbox.Claim: bad"),
            (
                Detail::NoRow(Box::new(dl)),
                "on dl, meant for outbox.Claim: bad (no row)",
            ),
            (
                Detail::Misrouted {
                    stored_on: "a".into(),
                    template: Some("b".into()),
                },
                "stored on a, the template gives b",
            ),
            (
                Detail::Misrouted {
                    stored_on: "a".into(),
                    template: None,
                },
                "stored on a, the row can only be a dead letter",
            ),
            (Detail::PayloadDiffers, "the payload differs from the row's"),
        ];
        for (d, line) in cases {
            assert_eq!(d.to_string(), line);
        }
    }
}
