//! What `verify` found, as the summary a person reads and as the `--json` object of the contract
//! (docs/operations.md, "Proving delivery"): one count per class, and per class a bounded list of
//! examples, each with the event id and, where there is one, the stream sequence. The rest of a
//! class is counted, not listed.

use std::collections::BTreeMap;
use std::fmt;

use serde_json::{Value, json};

/// How many examples a class lists.
pub(crate) const EXAMPLES: usize = 10;

/// The classes, in the order the report shows them.
pub(crate) const CLASSES: [&str; 8] = [
    "missing",
    "in_flight",
    "duplicates",
    "out_of_order",
    "foreign",
    "misrouted",
    "payload_differs",
    "older_than_stream",
];

/// The section of docs/recovery.md on what to do about each difference.
pub(crate) const RECOVERY: &str = "docs/recovery.md#differences-found-by-outbox-relay-verify";

/// One listed difference.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Example {
    /// The event id (the row's, or the message's `Outbox-Event-Id`/`Nats-Msg-Id`; "" when a foreign
    /// message has none).
    pub event_id: String,
    /// The stream sequence of the message it is about, where there is one.
    pub sequence: Option<u64>,
    /// More, by class: the first copy's sequence, the subject, the position.
    pub detail: Option<String>,
}

/// The report. Counts per class in `counts` (every class of [`CLASSES`] is there).
#[derive(Debug, Clone, Default)]
pub struct VerifyReport {
    /// The relay's stream.
    pub stream: String,
    /// Rows read (matching `--where`/`--since`).
    pub rows: u64,
    /// Messages read from the stream.
    pub messages: u64,
    /// The first and last sequence read (0 when the stream is empty).
    pub first_sequence: u64,
    /// See `first_sequence`.
    pub last_sequence: u64,
    /// Count per class.
    pub counts: BTreeMap<&'static str, u64>,
    /// Examples per class, at most [`EXAMPLES`] each.
    pub examples: BTreeMap<&'static str, Vec<Example>>,
    /// The checks that ran (`completeness`, `once`, `order`, `gap_free`, `routing`, `payloads`).
    pub checks: Vec<&'static str>,
    /// Checks that did not run, and why.
    pub skipped: Vec<String>,
    /// Whether foreign messages count as a difference (`nats.fence = true`).
    pub fence: bool,
}

impl VerifyReport {
    /// The count of one class.
    pub fn count(&self, class: &str) -> u64 {
        self.counts.get(class).copied().unwrap_or(0)
    }

    /// Counts one finding, keeping it as an example while the class has room.
    pub(crate) fn add(&mut self, class: &'static str, example: impl FnOnce() -> Option<Example>) {
        *self.counts.entry(class).or_default() += 1;
        let list = self.examples.entry(class).or_default();
        if list.len() < EXAMPLES
            && let Some(e) = example()
        {
            list.push(e);
        }
    }

    /// Whether the class has room for another example (to skip a costly look-up when not).
    pub(crate) fn wants_example(&self, class: &str) -> bool {
        self.examples.get(class).is_none_or(|l| l.len() < EXAMPLES)
    }

    /// The number of differences: every class but `in_flight` and `older_than_stream` (neither
    /// missing nor fine), and `foreign` only with the fence (without it, other writers are allowed).
    pub fn differences(&self) -> u64 {
        CLASSES
            .iter()
            .filter(|c| !matches!(**c, "in_flight" | "older_than_stream"))
            .filter(|c| self.fence || **c != "foreign")
            .map(|c| self.count(c))
            .sum()
    }

    /// The `--json` object.
    pub fn to_json(&self) -> Value {
        let mut o = serde_json::Map::new();
        o.insert("stream".into(), json!(self.stream));
        o.insert("rows".into(), json!(self.rows));
        o.insert("messages".into(), json!(self.messages));
        for c in CLASSES {
            o.insert(c.into(), json!(self.count(c)));
        }
        o.insert("first_sequence".into(), json!(self.first_sequence));
        o.insert("last_sequence".into(), json!(self.last_sequence));
        o.insert("checks".into(), json!(self.checks));
        o.insert("skipped".into(), json!(self.skipped));
        o.insert("differences".into(), json!(self.differences()));
        let examples: serde_json::Map<String, Value> = CLASSES
            .iter()
            .map(|c| {
                let list: Vec<Value> = self
                    .examples
                    .get(c)
                    .into_iter()
                    .flatten()
                    .map(|e| {
                        let mut x = serde_json::Map::new();
                        x.insert("event_id".into(), json!(e.event_id));
                        if let Some(s) = e.sequence {
                            x.insert("sequence".into(), json!(s));
                        }
                        if let Some(d) = &e.detail {
                            x.insert("detail".into(), json!(d));
                        }
                        Value::Object(x)
                    })
                    .collect();
                ((*c).to_owned(), Value::Array(list))
            })
            .collect();
        o.insert("examples".into(), Value::Object(examples));
        if self.differences() > 0 {
            o.insert("recovery".into(), json!(RECOVERY));
        }
        Value::Object(o)
    }
}

impl fmt::Display for VerifyReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "verify: {} rows, {} messages in stream {} (sequences {}..{}); checks: {}",
            self.rows,
            self.messages,
            self.stream,
            self.first_sequence,
            self.last_sequence,
            self.checks.join(", ")
        )?;
        for s in &self.skipped {
            writeln!(f, "  not checked: {s}")?;
        }
        for c in CLASSES {
            let n = self.count(c);
            if n == 0 {
                continue;
            }
            writeln!(f, "{c}: {n}")?;
            for e in self.examples.get(c).into_iter().flatten() {
                let id = if e.event_id.is_empty() {
                    "(no id)"
                } else {
                    &e.event_id
                };
                match e.sequence {
                    Some(s) => write!(f, "  {id} at sequence {s}")?,
                    None => write!(f, "  {id}")?,
                }
                match &e.detail {
                    Some(d) => writeln!(f, " ({d})")?,
                    None => writeln!(f)?,
                }
            }
            let shown = self.examples.get(c).map_or(0, Vec::len) as u64;
            if n > shown {
                writeln!(f, "  … and {} more", n - shown)?;
            }
        }
        match self.differences() {
            0 if self.rows > 0 => writeln!(
                f,
                "every event arrived once and in order ({} rows checked)",
                self.rows
            ),
            0 => writeln!(f, "no differences"),
            n => writeln!(f, "{n} differences: what to do is in {RECOVERY}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_json_has_every_contract_key_and_bounded_examples() {
        let mut r = VerifyReport {
            fence: true,
            ..VerifyReport::default()
        };
        for i in 0..15 {
            r.add("missing", || {
                Some(Example {
                    event_id: format!("e-{i}"),
                    sequence: None,
                    detail: None,
                })
            });
        }
        r.add("in_flight", || None);
        let j = r.to_json();
        for k in [
            "rows",
            "messages",
            "missing",
            "in_flight",
            "duplicates",
            "out_of_order",
            "foreign",
            "misrouted",
            "payload_differs",
            "older_than_stream",
        ] {
            assert!(j[k].is_u64(), "{k}: {j}");
        }
        assert_eq!(j["missing"], 15);
        assert_eq!(j["examples"]["missing"].as_array().unwrap().len(), EXAMPLES);
        assert_eq!(j["examples"]["missing"][0]["event_id"], "e-0");
        assert!(j["examples"]["missing"][0].get("sequence").is_none());
        assert_eq!(r.differences(), 15, "in flight is not a difference");
        let text = r.to_string();
        assert!(text.contains("missing: 15\n  e-0\n"), "{text}");
        assert!(text.contains("… and 5 more"), "{text}");
    }
}
