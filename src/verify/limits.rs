//! What the stream's own configuration can remove, so that `verify` tells a message a limit took
//! from one someone deleted. JetStream removes messages by itself in two ways:
//!
//! - from the head: `max_msgs` or `max_bytes` with `discard: old` (with `discard: new`, setup's
//!   default, a full stream refuses new messages and removes nothing), and `max_age` (whatever the
//!   discard policy), which removes only messages stored longer ago than it: never a message of a
//!   stream younger than it, never one stored since `now - max_age` (setup's default is 7 days);
//! - anywhere: `max_msgs_per_subject` (unless new messages are refused per subject instead), a
//!   per-message TTL (`allow_msg_ttl`), and a retention other than `limits` (work queue, interest),
//!   which removes what consumers acknowledged.
//!
//! A gone sequence that none of them explains is a hole; rows whose message is gone at the head
//! are older than the stream only when a head limit explains it.

use std::time::Duration;

use async_nats::jetstream::stream::{Config, DiscardPolicy, RetentionPolicy};

/// The limits of a stream that remove messages, in words for the report.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Limits {
    /// What removes the oldest messages whatever their age (`max_msgs`, `max_bytes` with
    /// `discard: old`).
    pub(crate) by_count: Option<String>,
    /// `max_age`: removes the messages stored more than this long ago, and no other.
    pub(crate) max_age: Option<Duration>,
    /// What can remove messages anywhere (and so at the head too).
    pub(crate) anywhere: Option<String>,
}

impl Limits {
    /// The limits of a stream configured as `c`.
    pub(crate) fn of(c: &Config) -> Limits {
        let old = c.discard == DiscardPolicy::Old;
        let mut by_count = Vec::new();
        if old && c.max_messages > 0 {
            by_count.push(format!("max_msgs {} with discard old", c.max_messages));
        }
        if old && c.max_bytes > 0 {
            by_count.push(format!("max_bytes {} with discard old", c.max_bytes));
        }
        let mut anywhere = Vec::new();
        // With discard new per subject, a full subject refuses new messages instead.
        let per_subject_removes = old || !c.discard_new_per_subject;
        if c.max_messages_per_subject > 0 && per_subject_removes {
            anywhere.push(format!(
                "max_msgs_per_subject {}",
                c.max_messages_per_subject
            ));
        }
        if c.allow_message_ttl {
            anywhere.push("per-message TTLs (allow_msg_ttl)".to_owned());
        }
        if c.retention != RetentionPolicy::Limits {
            anywhere.push(format!("retention {:?}", c.retention).to_lowercase());
        }
        let words = |v: Vec<String>| (!v.is_empty()).then(|| v.join(", "));
        Limits {
            by_count: words(by_count),
            max_age: (!c.max_age.is_zero()).then_some(c.max_age),
            anywhere: words(anywhere),
        }
    }

    /// What removes messages from the head whatever their age, if anything.
    pub(crate) fn explains_any_head(&self) -> Option<&str> {
        self.by_count.as_deref().or(self.anywhere.as_deref())
    }

    /// What explains messages gone inside the stream, if anything.
    pub(crate) fn explains_inside(&self) -> Option<&str> {
        self.anywhere.as_deref()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn setups_default_removes_only_by_age_and_each_limit_says_where_it_removes() {
        let setup = Config {
            discard: DiscardPolicy::New,
            max_messages: -1,
            max_bytes: -1,
            max_messages_per_subject: -1,
            max_age: Duration::from_secs(604_800),
            ..Config::default()
        };
        let limits = Limits::of(&setup);
        assert_eq!(limits.explains_any_head(), None);
        assert_eq!(limits.max_age, Some(Duration::from_secs(604_800)));
        let forever = Config {
            max_age: Duration::ZERO,
            ..setup.clone()
        };
        assert_eq!(Limits::of(&forever), Limits::default());
        let full_refuses = Config {
            max_messages: 1000,
            ..setup.clone()
        };
        assert_eq!(Limits::of(&full_refuses).explains_any_head(), None);
        let trimmed = Config {
            discard: DiscardPolicy::Old,
            max_messages: 1000,
            ..setup.clone()
        };
        assert_eq!(
            Limits::of(&trimmed).explains_any_head(),
            Some("max_msgs 1000 with discard old")
        );
        assert_eq!(Limits::of(&trimmed).explains_inside(), None);
        let per_subject = Config {
            max_messages_per_subject: 1,
            ..forever.clone()
        };
        assert!(Limits::of(&per_subject).explains_inside().is_some());
        assert!(Limits::of(&per_subject).explains_any_head().is_some());
        let refused_per_subject = Config {
            discard_new_per_subject: true,
            ..per_subject
        };
        assert_eq!(Limits::of(&refused_per_subject), Limits::default());
        let queue = Config {
            retention: RetentionPolicy::WorkQueue,
            ..forever
        };
        assert_eq!(
            Limits::of(&queue).explains_inside(),
            Some("retention workqueue")
        );
    }
}
