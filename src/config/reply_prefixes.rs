//! `nats.service_reply_prefixes`: the subjects the position service may answer on. Every answer
//! goes out with the relay's NATS rights, so a reply subject is allowed only under one of these
//! prefixes (the requesters' inboxes, `_INBOX.` by default) and checked here once, so that no
//! configured prefix can name a subject the relay must never publish to: its own stream's, its own
//! inbox, the position service's subjects or NATS' `$…` subjects. What is left to check per request
//! and per account (other streams) is in `crate::stored`'s reply rules.

use super::{ConfigError, NatsConfig, invalid};
use crate::route::{SubjectTemplate, check_subject, subjects_overlap};

/// The inbox prefix every NATS client shares unless given another (the default
/// `nats.inbox_prefix`): any client may publish under it, so the relay cannot keep its own inbox
/// apart from the requesters' while it uses it.
pub(crate) const SHARED_INBOX_PREFIX: &str = "_INBOX";

/// The longest prefix: what is left of a reply subject's bound (`stored`'s `MAX_REPLY_BYTES`,
/// 128) must hold the unique part of an inbox, two NUIDs of 22 characters and their dots.
pub(crate) const MAX_PREFIX_BYTES: usize = 64;

/// The most prefixes: each is compared with every request's reply subject.
const MAX_PREFIXES: usize = 16;

const KEY: &str = "nats.service_reply_prefixes";

/// Checks every prefix: whole literal tokens ending in `.`, at most [`MAX_PREFIX_BYTES`], outside
/// the stream's subjects (`template`, the dead-letter subject), outside the position service's
/// subjects, and not inside the relay's own inbox (unless that is the shared `_INBOX`).
pub(super) fn check(n: &NatsConfig, template: &SubjectTemplate) -> Result<(), ConfigError> {
    let prefixes = &n.service_reply_prefixes;
    if prefixes.is_empty() {
        return Err(invalid(
            KEY,
            "is empty: the position service would answer no request; name the requesters' inbox \
             prefixes, such as [\"_INBOX.\"] (the default)",
        ));
    }
    if prefixes.len() > MAX_PREFIXES {
        return Err(invalid(
            KEY,
            format!(
                "names {} prefixes, more than {MAX_PREFIXES}: give requesters a shared inbox prefix",
                prefixes.len()
            ),
        ));
    }
    for p in prefixes {
        check_one(n, template, p)?;
    }
    Ok(())
}

fn check_one(n: &NatsConfig, template: &SubjectTemplate, p: &str) -> Result<(), ConfigError> {
    let shown = crate::text::cut(p, 80);
    if p.len() > MAX_PREFIX_BYTES {
        return Err(invalid(
            KEY,
            format!(
                "{shown:?} is {} bytes, more than {MAX_PREFIX_BYTES}: an inbox prefix is short, such as \"_INBOX.\"",
                p.len()
            ),
        ));
    }
    let Some(stem) = p.strip_suffix('.') else {
        return Err(invalid(
            KEY,
            format!(
                "{shown:?} does not end with '.': a prefix is whole subject tokens and a dot, such as \"_INBOX.\""
            ),
        ));
    };
    check_subject(stem).map_err(|why| {
        invalid(
            KEY,
            format!("{shown:?}: {why}: use literal tokens and a dot, such as \"_INBOX.\""),
        )
    })?;
    let under = format!("{p}>");
    let never = [
        ("nats.subject", template.wildcard()),
        ("nats.dead_letter_subject", n.dead_letter_subject.clone()),
        (
            "the position service's subjects",
            "outbox-relay.>".to_owned(),
        ),
    ];
    for (what, subject) in never {
        if subjects_overlap(&under, &subject) {
            return Err(invalid(
                KEY,
                format!(
                    "{shown:?}: replies under it could land on {what} {subject:?}; name the requesters' inbox \
                     prefix, such as \"_INBOX.\""
                ),
            ));
        }
    }
    let inbox = format!("{}.", n.inbox_prefix);
    if n.inbox_prefix != SHARED_INBOX_PREFIX && p.starts_with(&inbox) {
        return Err(invalid(
            KEY,
            format!(
                "{shown:?} is inside the relay's own inbox (nats.inbox_prefix {:?}), where an answer would be a \
                 planted ack: name the requesters' inbox prefix, such as \"_INBOX.\"",
                n.inbox_prefix
            ),
        ));
    }
    Ok(())
}
