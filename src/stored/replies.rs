//! The reply subjects the position service refuses to answer on ([`ReplyRules`]).
//!
//! The service answers with the relay's own NATS rights, on whatever reply subject a request names,
//! and `allow_responses` lets it publish there even where its deny list says no. A caller who may not
//! publish into the stream could otherwise have the relay do it: an answer on `outbox.Claim` is
//! stored as an event (the fence then refuses the next one and the session restarts, again and
//! again), an answer on the relay's inbox is a planted ack, and an answer on `$JS.API.…` is a
//! JetStream request made in the relay's name (a purge of the stream, say). So a request whose reply
//! subject the relay must never publish to gets no answer at all: the stream's subjects (as the
//! stream is configured, NATS wildcards matched), the dead-letter subject, the relay's own inbox
//! prefix, every relay's service subjects (`outbox-relay.>`, where an answer would be a request
//! again), every `$…` subject (NATS reserves them: `$JS.`, `$KV.`, `$O.`, `$SRV.`, `$SYS.`), and
//! anything that is not a literal subject (a wildcard reply would reach every subscriber it matches).
//! Pure: the owner builds the rules once per session and asks [`ReplyRules::refuses`] per request.

use std::fmt;

use crate::route::{check_subject, subjects_overlap};

/// The prefix of every relay's service subjects (`outbox-relay.<slot>.position`, `.wait`).
const SERVICE_PREFIX: &str = "outbox-relay";

/// The inbox prefix every client shares unless it is given another: refusing it would refuse every
/// requester, and it protects nothing, since any client may publish under it directly.
const SHARED_INBOX: &str = "_INBOX";

/// What the relay never answers on; see the module docs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ReplyRules {
    /// Subjects the stream stores (wildcards allowed) and the dead-letter subject.
    stored: Vec<String>,
    /// Prefixes refused with everything under them (`P` refuses `P` and `P.>`).
    prefixes: Vec<String>,
}

/// Why a reply subject is refused (the label of the refusal, for the debug log).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Refused {
    /// A `$…` subject, which NATS reserves (JetStream's API, KV, object store, services, system).
    Reserved,
    /// Not a literal subject: a wildcard, an empty token, whitespace, too long.
    NotLiteral,
    /// The stream stores it (one of its subjects, or the dead-letter subject).
    Stored(String),
    /// Under the relay's inbox prefix or the service subjects.
    Under(String),
}

impl fmt::Display for Refused {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Refused::Reserved => f.write_str("a $ subject, which NATS reserves"),
            Refused::NotLiteral => f.write_str("not a literal subject"),
            Refused::Stored(s) => write!(f, "the stream stores {s}"),
            Refused::Under(p) => write!(f, "under {p}"),
        }
    }
}

impl ReplyRules {
    /// The rules for a relay whose stream stores `stream_subjects` (the stream's configuration),
    /// with `dead_letter_subject` and `inbox_prefix` (`nats.*`).
    pub(crate) fn new(
        stream_subjects: &[String],
        dead_letter_subject: &str,
        inbox_prefix: &str,
    ) -> ReplyRules {
        let mut stored = stream_subjects.to_vec();
        stored.push(dead_letter_subject.to_owned());
        let mut prefixes = vec![SERVICE_PREFIX.to_owned()];
        if inbox_prefix != SHARED_INBOX {
            prefixes.push(inbox_prefix.to_owned());
        }
        ReplyRules { stored, prefixes }
    }

    /// Why `reply` must not be answered on, or `None` when it may.
    pub(crate) fn refuses(&self, reply: &str) -> Option<Refused> {
        if reply.starts_with('$') {
            return Some(Refused::Reserved);
        }
        if check_subject(reply).is_err() {
            return Some(Refused::NotLiteral);
        }
        if let Some(s) = self.stored.iter().find(|s| subjects_overlap(s, reply)) {
            return Some(Refused::Stored(s.clone()));
        }
        self.prefixes
            .iter()
            .find(|p| {
                reply
                    .strip_prefix(p.as_str())
                    .is_some_and(|rest| rest.is_empty() || rest.starts_with('.'))
            })
            .map(|p| Refused::Under(format!("{p}.>")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn rules(inbox: &str) -> ReplyRules {
        ReplyRules::new(
            &["outbox.*".to_owned(), "audit.>".to_owned()],
            "outbox_dead_letter",
            inbox,
        )
    }

    #[test]
    fn the_stream_the_inbox_the_service_and_reserved_subjects_are_refused() {
        let r = rules("_INBOX_outbox_relay");
        for (reply, why) in [
            ("outbox.Claim", Refused::Stored("outbox.*".into())),
            ("audit.a.b.c", Refused::Stored("audit.>".into())),
            (
                "outbox_dead_letter",
                Refused::Stored("outbox_dead_letter".into()),
            ),
            (
                "_INBOX_outbox_relay.abc.7",
                Refused::Under("_INBOX_outbox_relay.>".into()),
            ),
            (
                "_INBOX_outbox_relay",
                Refused::Under("_INBOX_outbox_relay.>".into()),
            ),
            (
                "outbox-relay.other_slot.wait",
                Refused::Under("outbox-relay.>".into()),
            ),
            ("$JS.API.STREAM.PURGE.OUTBOX", Refused::Reserved),
            ("$KV.config.key", Refused::Reserved),
            ("$O.store.chunk", Refused::Reserved),
            ("$SRV.PING", Refused::Reserved),
            ("$JS.ACK.OUTBOX.c.1.2.3.4.5", Refused::Reserved),
            ("outbox.>", Refused::NotLiteral),
            ("a.*", Refused::NotLiteral),
            ("a..b", Refused::NotLiteral),
            ("", Refused::NotLiteral),
            ("a b", Refused::NotLiteral),
        ] {
            assert_eq!(r.refuses(reply), Some(why), "{reply:?}");
        }
    }

    #[test]
    fn requesters_inboxes_are_answered() {
        let r = rules("_INBOX_outbox_relay");
        for reply in [
            "_INBOX.Xy7pQ.1",
            "_INBOX_claims.abc",
            // Neither a stream subject nor under the prefix, only alike.
            "outbox",
            "outbox.Claim.extra",
            "_INBOX_outbox_relay2.x",
            "outbox-relayX.y",
            "audit",
        ] {
            assert_eq!(r.refuses(reply), None, "{reply:?}");
        }
        // The shared default inbox prefix is every requester's: it is not refused.
        assert_eq!(rules("_INBOX").refuses("_INBOX.Xy7pQ.1"), None);
    }

    proptest! {
        /// Whatever the literal reply subject, an answer is allowed only when no stream subject
        /// matches it: the stream never stores an answer.
        #[test]
        fn no_answer_is_ever_stored(tokens in prop::collection::vec("[a-c]{1,2}", 1..4)) {
            let stream = ["a.*".to_owned(), "b.>".to_owned(), "c".to_owned()];
            let r = ReplyRules::new(&stream, "dl", "_INBOX_r");
            let reply = tokens.join(".");
            let stored = (tokens.len() == 2 && tokens[0] == "a")
                || (tokens.len() >= 2 && tokens[0] == "b")
                || reply == "c";
            prop_assert_eq!(r.refuses(&reply).is_some(), stored, "{}", reply);
        }
    }
}
