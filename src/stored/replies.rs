//! The reply subjects the position service answers on ([`ReplyRules`]): requesters' inboxes, and
//! nothing else.
//!
//! The service answers with the relay's own NATS rights, on whatever reply subject a request names
//! (and a user with `allow_responses` may publish there even where its deny list says no). A caller
//! who may not publish into a stream could otherwise have the relay do it: an answer on
//! `outbox.Claim` is stored as an event (the fence then refuses the next one and the session
//! restarts), an answer on another relay's subject ends that relay's session, an answer on any other
//! stream of the account reaches its consumers, an answer on the relay's inbox is a planted ack, and
//! an answer on `$JS.API.…` is a JetStream request made in the relay's name. A list of what to
//! refuse always misses a subject it does not know (round 5, finding 1), so the rule is an allow
//! list: a reply subject is answered only when it is
//!
//! - a literal subject (no wildcard, no empty token, no `$…`) of at most [`MAX_REPLY_BYTES`], what an
//!   inbox needs (a prefix of at most 64 bytes and two NUIDs), so an open wait keeps little;
//! - under one of `nats.service_reply_prefixes` (`_INBOX.` by default), whose checks at load keep
//!   the relay's stream, the service's subjects and `$…` out of them;
//! - not under the relay's own inbox prefix (unless that is the shared `_INBOX`, under which any
//!   client may publish anyway);
//! - not one of the relay's own stream's subjects (as the stream is configured, NATS wildcards
//!   matched) or its dead-letter subject;
//! - under a prefix no stream of the account stores subjects under ([`Streams`], asked of JetStream
//!   by `streams.rs`): while that is unknown, nothing is answered.
//!
//! Pure: the owner builds the rules once per session and asks [`ReplyRules::refuses`] per request.

use std::fmt;

use crate::config::{MAX_PREFIX_BYTES, SHARED_INBOX_PREFIX};
use crate::route::{check_subject, subjects_overlap};

/// The longest reply subject answered: an inbox prefix of at most 64 bytes
/// (`config::MAX_PREFIX_BYTES`) and what clients put after it (async-nats: `<prefix><NUID>.<NUID>`,
/// 45 bytes; the Go and Java clients less). An open wait keeps its reply subject, so this bounds it.
pub(crate) const MAX_REPLY_BYTES: usize = 128;
// An allowed prefix leaves at least 64 bytes for the unique part.
const _: () = assert!(MAX_PREFIX_BYTES + 64 <= MAX_REPLY_BYTES);

/// What the account's streams store under each allowed prefix, as last asked of JetStream.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) enum Streams {
    /// Not known yet, or the last check failed: nothing is answered until a check succeeds.
    #[default]
    Unknown,
    /// Per allowed prefix, in the order configured: a stream that stores subjects under it, if any.
    Checked(Vec<Option<String>>),
}

/// Which replies the service answers; see the module docs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ReplyRules {
    /// `nats.service_reply_prefixes`, each ending in `.`.
    allowed: Vec<String>,
    /// `<nats.inbox_prefix>.`, unless it is the shared `_INBOX`.
    own_inbox: Option<String>,
    /// The relay's stream's subjects (wildcards allowed) and its dead-letter subject.
    stored: Vec<String>,
}

/// Why a reply subject is refused (for the debug log; every refusal counts as `reply_subject`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Refused {
    /// Longer than [`MAX_REPLY_BYTES`].
    TooLong(usize),
    /// A `$…` subject, which NATS reserves (JetStream's API, KV, object store, services, system).
    Reserved,
    /// Not a literal subject: a wildcard, an empty token, whitespace.
    NotLiteral,
    /// Under none of `nats.service_reply_prefixes`.
    NotAnInbox,
    /// Under the relay's own inbox prefix.
    OwnInbox(String),
    /// The relay's stream stores it (one of its subjects, or the dead-letter subject).
    Stored(String),
    /// A stream of the account stores subjects under the prefix it is under.
    StreamUnder {
        /// The prefix.
        prefix: String,
        /// The stream.
        stream: String,
    },
    /// Which streams store subjects under the prefixes is not known now.
    Unchecked,
}

impl fmt::Display for Refused {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Refused::TooLong(n) => write!(f, "{n} bytes, more than {MAX_REPLY_BYTES}"),
            Refused::Reserved => f.write_str("a $ subject, which NATS reserves"),
            Refused::NotLiteral => f.write_str("not a literal subject"),
            Refused::NotAnInbox => f.write_str("under none of nats.service_reply_prefixes"),
            Refused::OwnInbox(p) => write!(f, "under the relay's own inbox {p}>"),
            Refused::Stored(s) => write!(f, "the relay's stream stores {s}"),
            Refused::StreamUnder { prefix, stream } => {
                write!(f, "stream {stream} stores subjects under {prefix}")
            }
            Refused::Unchecked => {
                f.write_str("the streams that store subjects under the prefixes are not known now")
            }
        }
    }
}

impl ReplyRules {
    /// The rules for a relay whose stream stores `stream_subjects` (the stream's configuration),
    /// with `dead_letter_subject`, `inbox_prefix` and `reply_prefixes` (`nats.*`).
    pub(crate) fn new(
        stream_subjects: &[String],
        dead_letter_subject: &str,
        inbox_prefix: &str,
        reply_prefixes: &[String],
    ) -> ReplyRules {
        let mut stored = stream_subjects.to_vec();
        stored.push(dead_letter_subject.to_owned());
        ReplyRules {
            allowed: reply_prefixes.to_vec(),
            own_inbox: (inbox_prefix != SHARED_INBOX_PREFIX).then(|| format!("{inbox_prefix}.")),
            stored,
        }
    }

    /// The allowed prefixes, in order ([`Streams::Checked`] has one entry for each).
    pub(crate) fn prefixes(&self) -> &[String] {
        &self.allowed
    }

    /// Why `reply` must not be answered on, given what the account's `streams` store, or `None`
    /// when it may.
    pub(crate) fn refuses(&self, reply: &str, streams: &Streams) -> Option<Refused> {
        if reply.len() > MAX_REPLY_BYTES {
            return Some(Refused::TooLong(reply.len()));
        }
        if reply.starts_with('$') {
            return Some(Refused::Reserved);
        }
        if check_subject(reply).is_err() {
            return Some(Refused::NotLiteral);
        }
        // A literal subject never ends with '.', so it is longer than the prefix it starts with.
        let Some(i) = self
            .allowed
            .iter()
            .position(|p| reply.starts_with(p.as_str()))
        else {
            return Some(Refused::NotAnInbox);
        };
        if let Some(own) = &self.own_inbox
            && reply.starts_with(own.as_str())
        {
            return Some(Refused::OwnInbox(own.clone()));
        }
        if let Some(s) = self.stored.iter().find(|s| subjects_overlap(s, reply)) {
            return Some(Refused::Stored(s.clone()));
        }
        match streams {
            Streams::Unknown => Some(Refused::Unchecked),
            Streams::Checked(by_prefix) => match by_prefix.get(i) {
                Some(None) => None,
                Some(Some(stream)) => Some(Refused::StreamUnder {
                    prefix: self.allowed[i].clone(),
                    stream: stream.clone(),
                }),
                // A check made for other prefixes: not known.
                None => Some(Refused::Unchecked),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn rules(inbox: &str) -> ReplyRules {
        ReplyRules::new(
            &[
                "outbox.*".to_owned(),
                "audit.>".to_owned(),
                "_INBOX.x".to_owned(),
            ],
            "outbox_dead_letter",
            inbox,
            &["_INBOX.".to_owned(), "_R_.".to_owned()],
        )
    }

    fn clean() -> Streams {
        Streams::Checked(vec![None, None])
    }

    #[test]
    fn only_requesters_inboxes_are_answered() {
        let r = rules("_INBOX_outbox_relay");
        for reply in [
            "_INBOX.Xy7pQ.1",
            "_INBOX.Xy7pQrstuvwxyzABCDEFG.Xy7pQrstuvwxyzABCDEFH",
            "_R_.hKFLHm.NvgECe",
        ] {
            assert_eq!(r.refuses(reply, &clean()), None, "{reply:?}");
        }
        let long = format!("_INBOX.{}", "a".repeat(MAX_REPLY_BYTES));
        for (reply, why) in [
            // Round 5, findings 1 and 2: another relay's stream, its dead letters, any stream.
            ("bil.Invoice", Refused::NotAnInbox),
            ("bil_dead_letter", Refused::NotAnInbox),
            ("payments.card.charged", Refused::NotAnInbox),
            ("outbox.Claim", Refused::NotAnInbox),
            ("outbox-relay.other_slot.wait", Refused::NotAnInbox),
            ("_INBOX_claims.abc", Refused::NotAnInbox),
            ("_INBOX", Refused::NotAnInbox),
            ("_INBOX_outbox_relay.abc.7", Refused::NotAnInbox),
            ("$JS.API.STREAM.PURGE.OUTBOX", Refused::Reserved),
            ("$SRV.PING", Refused::Reserved),
            ("_INBOX.>", Refused::NotLiteral),
            ("_INBOX.a.*", Refused::NotLiteral),
            ("_INBOX..b", Refused::NotLiteral),
            ("", Refused::NotLiteral),
            ("_INBOX.a b", Refused::NotLiteral),
            (long.as_str(), Refused::TooLong(long.len())),
            // The relay's own stream may store subjects under an allowed prefix.
            ("_INBOX.x", Refused::Stored("_INBOX.x".into())),
        ] {
            assert_eq!(r.refuses(reply, &clean()), Some(why), "{reply:?}");
        }
        let at_bound = format!("_INBOX.{}", "a".repeat(MAX_REPLY_BYTES - 7));
        assert_eq!(r.refuses(&at_bound, &clean()), None);
    }

    #[test]
    fn the_relays_own_inbox_is_refused_unless_it_is_the_shared_one() {
        let r = rules("_INBOX.relay");
        assert_eq!(
            r.refuses("_INBOX.relay.abc.1", &clean()),
            Some(Refused::OwnInbox("_INBOX.relay.".into()))
        );
        assert_eq!(r.refuses("_INBOX.relay2.abc", &clean()), None);
        // The shared prefix is every requester's.
        assert_eq!(rules("_INBOX").refuses("_INBOX.Xy7pQ.1", &clean()), None);
    }

    #[test]
    fn a_prefix_some_stream_stores_under_and_an_unknown_account_answer_nothing() {
        let r = rules("_INBOX");
        let taken = Streams::Checked(vec![Some("AUDIT".into()), None]);
        assert_eq!(
            r.refuses("_INBOX.abc", &taken),
            Some(Refused::StreamUnder {
                prefix: "_INBOX.".into(),
                stream: "AUDIT".into()
            })
        );
        assert_eq!(r.refuses("_R_.abc.def", &taken), None);
        assert_eq!(
            r.refuses("_INBOX.abc", &Streams::Unknown),
            Some(Refused::Unchecked)
        );
        assert_eq!(
            r.refuses("_R_.abc", &Streams::Checked(vec![None])),
            Some(Refused::Unchecked)
        );
    }

    proptest! {
        /// Whatever the literal reply subject, an answer is allowed only under an allowed prefix
        /// and never where the relay's stream stores: answers reach inboxes, never a stream.
        #[test]
        fn only_inbox_subjects_outside_the_stream_are_answered(
            tokens in prop::collection::vec("(_INBOX|_R_|[a-c]{1,2})", 1..4)
        ) {
            let stream = ["a.*".to_owned(), "_INBOX.b.>".to_owned(), "c".to_owned()];
            let r = ReplyRules::new(&stream, "dl", "_INBOX_r", &["_INBOX.".into()]);
            let reply = tokens.join(".");
            let answered = r.refuses(&reply, &Streams::Checked(vec![None])).is_none();
            let inbox = tokens.len() >= 2 && tokens[0] == "_INBOX";
            let stored = tokens.len() >= 3 && tokens[1] == "b";
            prop_assert_eq!(answered, inbox && !stored, "{}", reply);
        }
    }
}
