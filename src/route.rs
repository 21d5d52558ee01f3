//! Subject routing: `outbox.{aggregate_type}` → `outbox.Claim`.
//!
//! `{partition}` (with `nats.partitions` = N) is the aggregate id's partition in `0..N`, computed as
//! nats-server's subject mapping function `partition(N, …)` computes it ([`partition`]), so a
//! template and a server-side mapping put an aggregate in the same partition.
//!
//! A template is parsed once at startup; rendering validates every substituted value as a NATS subject
//! token (no empty token, whitespace, `.`, `*`, `>` or control characters:
//! <https://docs.nats.io/nats-concepts/subjects#characters-allowed-and-recommended-for-subject-names>).
//! A value that fails is not "fixed up": the event goes to the dead-letter subject with the reason,
//! because a silently rewritten subject would route it where no consumer expects it.

use std::fmt;

/// A placeholder of the template.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Field {
    /// `{aggregate_type}`.
    AggregateType,
    /// `{event_type}`.
    EventType,
    /// `{aggregate_id}`.
    AggregateId,
    /// `{partition}`: the aggregate id's partition.
    Partition,
}

impl Field {
    fn name(self) -> &'static str {
        match self {
            Field::AggregateType => "aggregate_type",
            Field::EventType => "event_type",
            Field::AggregateId => "aggregate_id",
            Field::Partition => "partition",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Part {
    Lit(String),
    Field(Field),
}

/// A parsed subject template.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SubjectTemplate {
    parts: Vec<Part>,
    source: String,
    /// `nats.partitions` (0: none), for `{partition}`.
    partitions: u32,
}

/// A template that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("subject template {template:?}: {reason}")]
pub struct TemplateError {
    template: String,
    reason: String,
}

/// Why a literal subject (the dead-letter subject, the inbox prefix, a template's literal parts)
/// is not a valid NATS subject.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum SubjectError {
    /// The subject is empty.
    #[error("the subject is empty")]
    Empty,
    /// The subject is over [`MAX_SUBJECT_BYTES`].
    #[error("the subject is {len} bytes long, more than {MAX_SUBJECT_BYTES}")]
    TooLong {
        /// Its length in bytes.
        len: usize,
    },
    /// The subject starts with `$`, which NATS keeps for itself.
    #[error("{subject:?} starts with '$', which NATS reserves for its own subjects")]
    Reserved {
        /// The subject.
        subject: String,
    },
    /// One of its tokens is not a valid token ([`check_token`]).
    #[error("token {token:?} of {subject:?} is invalid: {why}")]
    Token {
        /// The token.
        token: String,
        /// The subject.
        subject: String,
        /// Why the token is invalid.
        why: &'static str,
    },
}

/// Why an event's values cannot form a subject (goes into `Outbox-Error`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field} {value:?} is not a valid subject token: {reason}")]
pub(crate) struct RouteError {
    /// The placeholder's field, e.g. `aggregate_type`.
    pub(crate) field: &'static str,
    /// The event's value for it.
    pub(crate) value: String,
    /// Why the value is not a valid token.
    pub(crate) reason: &'static str,
}

impl SubjectTemplate {
    /// Parses `{aggregate_type}`, `{event_type}`, `{aggregate_id}` and `{partition}` placeholders
    /// between literals. `{partition}` needs [`SubjectTemplate::with_partitions`].
    pub fn parse(s: &str) -> Result<Self, TemplateError> {
        let err = |reason: String| TemplateError {
            template: s.to_owned(),
            reason,
        };
        let mut parts = Vec::new();
        let mut rest = s;
        while let Some(open) = rest.find('{') {
            if open > 0 {
                parts.push(Part::Lit(rest[..open].to_owned()));
            }
            let close = rest[open..]
                .find('}')
                .ok_or_else(|| err("'{' without '}'".into()))?
                + open;
            let field = match &rest[open + 1..close] {
                "aggregate_type" => Field::AggregateType,
                "event_type" => Field::EventType,
                "aggregate_id" => Field::AggregateId,
                "partition" => Field::Partition,
                other => {
                    return Err(err(format!(
                        "unknown placeholder {{{other}}}: use {{aggregate_type}}, {{event_type}}, {{aggregate_id}} or {{partition}}"
                    )));
                }
            };
            parts.push(Part::Field(field));
            rest = &rest[close + 1..];
        }
        if rest.contains('}') {
            return Err(err("'}' without '{'".into()));
        }
        if !rest.is_empty() {
            parts.push(Part::Lit(rest.to_owned()));
        }
        let t = SubjectTemplate {
            parts,
            source: s.to_owned(),
            partitions: 0,
        };
        // With a valid stand-in for every placeholder the literal parts must form a valid subject
        // (so a literal '*' or '>' is refused: the template names subjects, not filters).
        let standin: String = t
            .parts
            .iter()
            .map(|p| match p {
                Part::Lit(l) => l.as_str(),
                Part::Field(_) => "x",
            })
            .collect();
        check_subject(&standin).map_err(|e| err(e.to_string()))?;
        if t.wildcard()
            .split('.')
            .any(|tok| tok.contains('*') && tok != "*")
        {
            return Err(err(
                "a placeholder must fill a whole token (like outbox.{aggregate_type}), so the stream can subscribe to it".into(),
            ));
        }
        Ok(t)
    }

    /// The template with `partitions` partitions for `{partition}` (0: none).
    pub(crate) fn with_partitions(mut self, partitions: u32) -> Self {
        self.partitions = partitions;
        self
    }

    /// The subject for one event, or why it cannot have one.
    pub(crate) fn render(
        &self,
        aggregate_type: &str,
        event_type: &str,
        aggregate_id: &str,
    ) -> Result<String, RouteError> {
        let mut out = String::with_capacity(self.source.len() + 32);
        for part in &self.parts {
            match part {
                Part::Lit(l) => out.push_str(l),
                // A number is always a valid token; settings refuse {partition} without partitions.
                Part::Field(Field::Partition) => out
                    .push_str(itoa::Buffer::new().format(partition(aggregate_id, self.partitions))),
                Part::Field(f) => {
                    let value = match f {
                        Field::AggregateType => aggregate_type,
                        Field::EventType => event_type,
                        Field::AggregateId | Field::Partition => aggregate_id,
                    };
                    check_token(value).map_err(|reason| RouteError {
                        field: f.name(),
                        value: shown(value),
                        reason,
                    })?;
                    out.push_str(value);
                }
            }
        }
        Ok(out)
    }

    /// The subject filter that covers every rendered subject: placeholders become `*`.
    pub(crate) fn wildcard(&self) -> String {
        self.parts
            .iter()
            .map(|p| match p {
                Part::Lit(l) => l.as_str(),
                Part::Field(_) => "*",
            })
            .collect()
    }

    /// With `{partition}` and partitions: for each partition in order, the filter that covers the
    /// subjects of that partition (other placeholders `*`, `{partition}` the number). Empty
    /// otherwise.
    pub(crate) fn partition_wildcards(&self) -> Vec<String> {
        if self.partitions == 0 || !self.fields().any(|f| f == Field::Partition) {
            return Vec::new();
        }
        (0..self.partitions)
            .map(|p| {
                let p = p.to_string();
                self.parts
                    .iter()
                    .map(|part| match part {
                        Part::Lit(l) => l.as_str(),
                        Part::Field(Field::Partition) => p.as_str(),
                        Part::Field(_) => "*",
                    })
                    .collect()
            })
            .collect()
    }

    /// Whether a literal subject could be produced by this template.
    pub(crate) fn matches_literal(&self, subject: &str) -> bool {
        let pattern = self.wildcard();
        let p: Vec<&str> = pattern.split('.').collect();
        let s: Vec<&str> = subject.split('.').collect();
        p.len() == s.len() && p.iter().zip(&s).all(|(p, s)| *p == "*" || p == s)
    }

    /// Which placeholders the template uses.
    pub(crate) fn fields(&self) -> impl Iterator<Item = Field> + '_ {
        self.parts.iter().filter_map(|p| match p {
            Part::Field(f) => Some(*f),
            Part::Lit(_) => None,
        })
    }
}

impl fmt::Display for SubjectTemplate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.source)
    }
}

/// The partition of `key` among `partitions` (`0` when there are none), as nats-server's subject
/// mapping function `partition(partitions, token…)` computes it: the 32-bit FNV-1a hash of the
/// token's bytes (several tokens: their bytes one after the other) modulo the number of partitions
/// (`getHashPartition` in nats-server's `server/subject_transform.go`). The server agrees with it
/// for an aggregate id that is one valid subject token.
pub(crate) fn partition(key: &str, partitions: u32) -> u32 {
    if partitions == 0 {
        return 0;
    }
    crate::fnv::fnv1a_32(key.as_bytes()) % partitions
}

/// The longest subject token the relay publishes to. NATS' own limit is the 4 KiB control line of a
/// publish (beyond it the server closes the connection and no ack ever comes); a token this long is
/// a bad row, not a name.
pub(crate) const MAX_TOKEN_BYTES: usize = 256;
/// The longest literal subject (dead-letter subject, template literals).
pub(crate) const MAX_SUBJECT_BYTES: usize = 1024;

/// A value as an error shows it: at most 64 bytes, and its length when it is longer.
fn shown(v: &str) -> String {
    match crate::text::shortened(v, 64) {
        std::borrow::Cow::Borrowed(v) => v.to_owned(),
        std::borrow::Cow::Owned(cut) => format!("{cut} ({} bytes)", v.len()),
    }
}

/// One subject token: not empty, at most [`MAX_TOKEN_BYTES`], no whitespace, `.`, `*`, `>` or
/// control characters.
pub(crate) fn check_token(t: &str) -> Result<(), &'static str> {
    if t.is_empty() {
        return Err("it is empty");
    }
    if t.len() > MAX_TOKEN_BYTES {
        return Err("it is longer than 256 bytes");
    }
    for c in t.chars() {
        if c.is_whitespace() {
            return Err("it contains whitespace");
        }
        if c.is_control() {
            return Err("it contains a control character");
        }
        match c {
            '.' => return Err("it contains '.'"),
            '*' | '>' => return Err("it contains a wildcard ('*' or '>')"),
            _ => {}
        }
    }
    Ok(())
}

/// A whole literal subject (e.g. the dead-letter subject): valid tokens separated by `.`.
pub(crate) fn check_subject(s: &str) -> Result<(), SubjectError> {
    if s.is_empty() {
        return Err(SubjectError::Empty);
    }
    if s.len() > MAX_SUBJECT_BYTES {
        return Err(SubjectError::TooLong { len: s.len() });
    }
    if s.starts_with('$') {
        return Err(SubjectError::Reserved {
            subject: s.to_owned(),
        });
    }
    for tok in s.split('.') {
        check_token(tok).map_err(|why| SubjectError::Token {
            token: tok.to_owned(),
            subject: s.to_owned(),
            why,
        })?;
    }
    Ok(())
}

/// Whether the stream subject filter `filter` matches every subject `subject` can stand for
/// (`subject` may contain `*` itself, as a template's wildcard does).
pub(crate) fn subject_covers(filter: &str, subject: &str) -> bool {
    let f: Vec<&str> = filter.split('.').collect();
    let s: Vec<&str> = subject.split('.').collect();
    for (i, ft) in f.iter().enumerate() {
        match *ft {
            ">" => return s.len() > i,
            "*" => {
                if i >= s.len() || s[i] == ">" {
                    return false;
                }
            }
            lit => {
                if s.get(i) != Some(&lit) {
                    return false;
                }
            }
        }
    }
    f.len() == s.len()
}

/// Whether some subject matches both filters `a` and `b` (JetStream refuses two streams with
/// overlapping subjects).
pub(crate) fn subjects_overlap(a: &str, b: &str) -> bool {
    let a: Vec<&str> = a.split('.').collect();
    let b: Vec<&str> = b.split('.').collect();
    for i in 0..a.len().max(b.len()) {
        match (a.get(i), b.get(i)) {
            (Some(&">"), Some(_)) | (Some(_), Some(&">")) => return true,
            (Some(x), Some(y)) if *x == "*" || *y == "*" || x == y => {}
            _ => return false,
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn renders_default_template() {
        let t = SubjectTemplate::parse("outbox.{aggregate_type}").unwrap();
        assert_eq!(
            t.render("Claim", "ClaimApproved", "4711").unwrap(),
            "outbox.Claim"
        );
        assert_eq!(t.wildcard(), "outbox.*");
    }

    #[test]
    fn renders_all_placeholders() {
        let t = SubjectTemplate::parse("ev.{aggregate_type}.{event_type}.{aggregate_id}").unwrap();
        assert_eq!(
            t.render("Claim", "Approved", "4711").unwrap(),
            "ev.Claim.Approved.4711"
        );
        assert_eq!(t.wildcard(), "ev.*.*.*");
        assert!(t.matches_literal("ev.a.b.c"));
        assert!(!t.matches_literal("ev.a.b"));
        assert!(!t.matches_literal("other.a.b.c"));
    }

    #[test]
    fn rejects_bad_values_naming_the_field() {
        let t = SubjectTemplate::parse("outbox.{aggregate_type}").unwrap();
        for bad in ["", "a b", "a.b", "a*", ">", "a\tb", "a\u{7}"] {
            let e = t.render(bad, "E", "1").unwrap_err();
            assert_eq!(e.field, "aggregate_type", "{bad:?}");
        }
        assert_eq!(
            t.render("Schaden_ü-1", "E", "1").unwrap(),
            "outbox.Schaden_ü-1"
        );
    }

    #[test]
    fn rejects_bad_templates() {
        for bad in [
            "outbox.{nope}",
            "outbox.{aggregate_type",
            "outbox.}",
            "",
            "outbox..x",
            "outbox.>",
            "outbox.x{aggregate_type}",
            "$JS.x",
        ] {
            assert!(SubjectTemplate::parse(bad).is_err(), "{bad:?} accepted");
        }
    }

    proptest! {
        /// Whatever the values, render either fails or yields a subject the wildcard covers.
        #[test]
        fn rendered_subjects_match_the_wildcard(a in ".{0,12}", e in ".{0,12}", i in ".{0,12}") {
            let t = SubjectTemplate::parse("x.{aggregate_type}.{event_type}.{aggregate_id}").unwrap();
            if let Ok(s) = t.render(&a, &e, &i) {
                prop_assert!(t.matches_literal(&s));
                prop_assert!(check_subject(&s).is_ok());
            }
        }
    }

    #[test]
    fn stream_filters_cover_template_wildcards() {
        assert!(subject_covers("outbox.*", "outbox.*"));
        assert!(subject_covers("outbox.>", "outbox.*"));
        assert!(subject_covers(">", "outbox.*"));
        assert!(subject_covers("outbox_dead_letter", "outbox_dead_letter"));
        assert!(!subject_covers("outbox.Claim", "outbox.*"));
        assert!(!subject_covers("outbox.*", "outbox.*.*"));
        assert!(subject_covers("outbox.>", "outbox.*.*"));
        assert!(!subject_covers("other.>", "outbox.*"));
    }

    #[test]
    fn literal_wildcards_and_oversized_tokens_are_refused() {
        for bad in [
            "outbox.*",
            "outbox.>",
            "out*box.{aggregate_type}",
            "a.{aggregate_type}.>",
        ] {
            assert!(SubjectTemplate::parse(bad).is_err(), "{bad} accepted");
        }
        let t = SubjectTemplate::parse("outbox.{aggregate_type}").unwrap();
        let long = "C".repeat(5000);
        let e = t.render(&long, "x", "y").unwrap_err();
        assert!(e.to_string().len() < 300, "{e}");
        assert!(e.reason.contains("256"), "{e}");
        assert_eq!(
            check_subject(&"d".repeat(5000)),
            Err(SubjectError::TooLong { len: 5000 })
        );
        assert!(t.render(&"C".repeat(256), "x", "y").is_ok());
    }

    #[test]
    fn subject_errors_print_as_they_always_have() {
        // The configuration shows these for nats.dead_letter_subject and nats.inbox_prefix.
        let cases = [
            ("", "the subject is empty"),
            (
                "$JS.x",
                "\"$JS.x\" starts with '$', which NATS reserves for its own subjects",
            ),
            ("a..b", "token \"\" of \"a..b\" is invalid: it is empty"),
            (
                "a.b c",
                "token \"b c\" of \"a.b c\" is invalid: it contains whitespace",
            ),
        ];
        for (subject, text) in cases {
            assert_eq!(check_subject(subject).unwrap_err().to_string(), text);
        }
        assert_eq!(
            check_subject(&"d".repeat(5000)).unwrap_err().to_string(),
            "the subject is 5000 bytes long, more than 1024"
        );
    }

    #[test]
    fn partition_is_fnv1a_32_modulo_the_count() {
        // The published FNV-1a 32 test vectors: "" 0x811c9dc5, "a" 0xe40c292c, "foobar" 0xbf9cf968.
        assert_eq!(partition("", u32::MAX), 0x811c_9dc5);
        assert_eq!(partition("a", u32::MAX), 0xe40c_292c);
        assert_eq!(partition("foobar", u32::MAX), 0xbf9c_f968);
        assert_eq!(partition("foobar", 10), 0xbf9c_f968 % 10);
        assert_eq!(partition("anything", 1), 0);
        assert_eq!(partition("anything", 0), 0);
        for id in ["4711", "Schaden_ü-1", "e-5531"] {
            assert!(partition(id, 7) < 7);
        }
    }

    #[test]
    fn renders_the_partition_of_the_aggregate_id() {
        let t = SubjectTemplate::parse("outbox.{aggregate_type}.{partition}")
            .unwrap()
            .with_partitions(8);
        assert_eq!(t.wildcard(), "outbox.*.*");
        assert_eq!(
            t.render("Claim", "E", "foobar").unwrap(),
            format!("outbox.Claim.{}", 0xbf9c_f968_u32 % 8)
        );
        // The partition is the id's, whatever the id: not a token of its own.
        assert!(t.render("Claim", "E", "a.b").is_ok());
        assert_eq!(
            t.partition_wildcards(),
            (0..8).map(|p| format!("outbox.*.{p}")).collect::<Vec<_>>()
        );
        let plain = SubjectTemplate::parse("outbox.{aggregate_type}")
            .unwrap()
            .with_partitions(8);
        assert!(plain.partition_wildcards().is_empty());
    }

    #[test]
    fn overlapping_filters() {
        assert!(subjects_overlap("outbox.*", "outbox.Claim"));
        assert!(subjects_overlap("outbox.>", "outbox.a.b"));
        assert!(subjects_overlap(">", "x"));
        assert!(subjects_overlap("a.*.c", "a.b.*"));
        assert!(!subjects_overlap("outbox.*", "outbox.a.b"));
        assert!(!subjects_overlap("outbox.*", "other.*"));
        assert!(!subjects_overlap("dl", "dl.x"));
    }
}
