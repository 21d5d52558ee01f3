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
    /// The stream allows per-message TTLs (`allow_msg_ttl`; setup allows them in park mode).
    pub(crate) ttl: bool,
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
            ttl: c.allow_message_ttl,
        }
    }

    /// Rows created before the time this returns (µs) may have had their message removed by
    /// `max_age` *inside* the stream, not only at its head: with per-message TTLs allowed, a message
    /// older than `max_age` stays at the head when it carries `Nats-TTL: never` (park mode's parked
    /// copies and release markers do), while those stored after it age out. The same horizon as at
    /// the head: `now - max_age`, and only in a stream created before it. `None` without TTLs or
    /// `max_age`, or in a younger stream.
    pub(crate) fn aged_inside_before(&self, created_unix_us: i64, now_unix_us: i64) -> Option<i64> {
        self.ttl
            .then(|| self.age_horizon(created_unix_us, now_unix_us))
            .flatten()
    }

    /// `now - max_age` (µs), before which `max_age` may have removed messages, for a stream created
    /// before it; `None` without `max_age` or in a younger stream.
    pub(crate) fn age_horizon(&self, created_unix_us: i64, now_unix_us: i64) -> Option<i64> {
        let max_age = i64::try_from(self.max_age?.as_micros()).unwrap_or(i64::MAX);
        let horizon = now_unix_us.saturating_sub(max_age);
        (created_unix_us < horizon).then_some(horizon)
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

    #[test]
    fn with_ttls_allowed_max_age_explains_rows_gone_inside_the_stream_before_its_horizon() {
        let day = Duration::from_secs(86_400);
        let us = |d: Duration| d.as_micros() as i64;
        let now = us(Duration::from_secs(100 * 86_400));
        let parked = Config {
            max_age: day,
            allow_message_ttl: true,
            ..Config::default()
        };
        let week_old = now - us(7 * day);
        assert_eq!(
            Limits::of(&parked).aged_inside_before(week_old, now),
            Some(now - us(day))
        );
        // A stream younger than max_age has lost nothing to age.
        let hour_old = now - us(Duration::from_secs(3_600));
        assert_eq!(Limits::of(&parked).aged_inside_before(hour_old, now), None);
        // Without TTLs, age removes from the head only (the head's own rule).
        let plain = Config {
            allow_message_ttl: false,
            ..parked.clone()
        };
        assert_eq!(Limits::of(&plain).aged_inside_before(week_old, now), None);
        let forever = Config {
            max_age: Duration::ZERO,
            ..parked
        };
        assert_eq!(Limits::of(&forever).aged_inside_before(week_old, now), None);
    }
}
