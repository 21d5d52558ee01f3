//! What `verify` found, as the summary a person reads and as the `--json` object of the contract
//! (docs/operations.md, "Proving delivery"): one count per [`Class`], per class a bounded list of
//! examples (each with the event id and, where there is one, the stream sequence) and the recovery
//! it calls for, `proven_up_to`, and the exit code: 0 clean, 1 with differences, 2 when something
//! could not be checked. The rest of a class is counted, not listed.

use std::collections::BTreeMap;
use std::fmt;

use serde_json::{Value, json};

use super::class::Class;
use super::skipped::Skipped;
use crate::Lsn;
use crate::error_chain::MAX_LINE;
use crate::text::shown;

/// How many examples a class lists.
pub(crate) const EXAMPLES: usize = 10;

/// The most of an example's id or detail the report shows, in bytes.
const MAX_SHOWN: usize = 1024;

/// The section of docs/recovery.md on what to do about each difference.
pub(crate) const RECOVERY: &str = "docs/recovery.md#differences-found-by-outbox-relay-verify";

/// µs between 1970-01-01 and 2000-01-01 (the epoch of [`crate::message::rfc3339_micros`]).
const PG_EPOCH_UNIX_US: i64 = 946_684_800_000_000;

/// One listed finding.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Example {
    /// The event id (the row's, or the message's `Outbox-Event-Id`/`Nats-Msg-Id`; "" when a foreign
    /// message or a hole has none).
    pub event_id: String,
    /// The stream sequence of the message it is about, where there is one.
    pub sequence: Option<u64>,
    /// More, by class: the first copy's sequence, the subject, the reason, the gone range.
    pub detail: Option<String>,
}

/// The newest point up to which every row is proven stored once, in order (docs/operations.md).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Proven {
    /// The commit LSN of the newest event at or before `created_unix_us` whose row is proven.
    pub lsn: Option<Lsn>,
    /// Every row created at or before this time (µs since the Unix epoch) is proven.
    pub created_unix_us: Option<i64>,
}

impl Proven {
    /// `created_unix_us` as RFC 3339 (UTC, µs).
    pub fn created_at(&self) -> Option<String> {
        self.created_unix_us.map(rfc3339_unix_us)
    }
}

/// µs since the Unix epoch as RFC 3339 (UTC, µs).
pub(crate) fn rfc3339_unix_us(us: i64) -> String {
    crate::message::rfc3339_micros(us - PG_EPOCH_UNIX_US)
}

/// The report. Every class of [`Class::ALL`] has a count.
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
    pub counts: BTreeMap<Class, u64>,
    /// Examples per class, at most [`EXAMPLES`] each.
    pub examples: BTreeMap<Class, Vec<Example>>,
    /// The checks that ran (`completeness`, `waiting`, `once`, `order`, `gap_free`, `routing`,
    /// `payloads`).
    pub checks: Vec<&'static str>,
    /// Checks that did not run, and what was left out, and why.
    pub skipped: Vec<Skipped>,
    /// One line each: what kept a check from being complete (a slot that could not be copied).
    pub warnings: Vec<String>,
    /// Whether foreign messages count as a difference (`nats.fence = true`).
    pub fence: bool,
    /// See [`Proven`]; `None` fields when nothing is proven or it cannot be said.
    pub proven_up_to: Proven,
    /// Why part of the check could not run at all (NATS unreachable): exit 2 with this line.
    pub not_checked: Option<String>,
    /// `outbox-relay parked`, `outbox-relay requeue --key TYPE/ID` and `outbox-relay requeue --event
    /// ID` as `verify`'s settings print them (`Settings::command`: its `--config` and variables), for
    /// the recoveries that name them; `None`: the plain words.
    pub commands: Option<[String; 3]>,
}

impl VerifyReport {
    /// The count of one class.
    pub fn count(&self, class: Class) -> u64 {
        self.counts.get(&class).copied().unwrap_or(0)
    }

    /// Counts `n` findings of a class, keeping `example` while the class has room. What an example
    /// quotes (an id, a reason, a subject) comes from rows and messages others wrote: it is kept
    /// as one escaped, bounded line ([`shown`]).
    pub(crate) fn add_n(
        &mut self,
        class: Class,
        n: u64,
        example: impl FnOnce() -> Option<Example>,
    ) {
        *self.counts.entry(class).or_default() += n;
        let list = self.examples.entry(class).or_default();
        if list.len() < EXAMPLES
            && let Some(e) = example()
        {
            list.push(Example {
                event_id: shown(&e.event_id, MAX_SHOWN),
                sequence: e.sequence,
                detail: e.detail.map(|d| shown(&d, MAX_SHOWN)),
            });
        }
    }

    /// Adds a warning line, escaped and bounded (it may quote what a server said).
    pub(crate) fn warn(&mut self, line: &str) {
        self.warnings.push(shown(line, MAX_LINE));
    }

    /// Counts one finding, keeping it as an example while the class has room.
    pub(crate) fn add(&mut self, class: Class, example: impl FnOnce() -> Option<Example>) {
        self.add_n(class, 1, example);
    }

    /// Whether the class has room for another example (to skip a costly look-up when not).
    pub(crate) fn wants_example(&self, class: Class) -> bool {
        self.examples.get(&class).is_none_or(|l| l.len() < EXAMPLES)
    }

    /// The number of differences: the sum of the classes that are one ([`Class::is_difference`]).
    pub fn differences(&self) -> u64 {
        Class::ALL
            .iter()
            .filter(|c| c.is_difference(self.fence))
            .map(|c| self.count(*c))
            .sum()
    }

    /// 0 clean; 1 with differences; 2 when something could not be checked (NATS unreachable, or
    /// rows whose waiting could not be told) and no difference was found: those rows may be
    /// missing or only waiting, and saying "missing" would have the operator store them twice.
    pub fn exit_code(&self) -> u8 {
        if self.differences() > 0 {
            1
        } else if self.not_checked.is_some() || self.count(Class::Unknown) > 0 {
            2
        } else {
            0
        }
    }

    /// The `--json` object.
    pub fn to_json(&self) -> Value {
        let mut o = serde_json::Map::new();
        o.insert("stream".into(), json!(self.stream));
        o.insert("rows".into(), json!(self.rows));
        o.insert("messages".into(), json!(self.messages));
        for c in Class::ALL {
            o.insert(c.key().into(), json!(self.count(c)));
        }
        // The name `waiting` had before the slot decided it; kept for scripts that read it.
        o.insert("in_flight".into(), json!(self.count(Class::Waiting)));
        o.insert(
            "proven_up_to".into(),
            json!({
                "lsn": self.proven_up_to.lsn.map(|l| l.to_string()),
                "created_at": self.proven_up_to.created_at(),
            }),
        );
        o.insert("first_sequence".into(), json!(self.first_sequence));
        o.insert("last_sequence".into(), json!(self.last_sequence));
        o.insert("checks".into(), json!(self.checks));
        let skipped: Vec<String> = self.skipped.iter().map(ToString::to_string).collect();
        o.insert("skipped".into(), json!(skipped));
        o.insert("warnings".into(), json!(self.warnings));
        o.insert("differences".into(), json!(self.differences()));
        if let Some(n) = &self.not_checked {
            o.insert("not_checked".into(), json!(n));
        }
        if self.differences() > 0 {
            o.insert("recovery".into(), json!(RECOVERY));
        }
        o.insert("recoveries".into(), self.recoveries());
        o.insert("examples".into(), self.examples_json());
        Value::Object(o)
    }

    /// Per class found: what to do.
    fn recoveries(&self) -> Value {
        let found = Class::ALL.iter().filter(|c| self.count(**c) > 0);
        Value::Object(
            found
                .map(|c| (c.key().to_owned(), json!(self.recovery(*c))))
                .collect(),
        )
    }

    fn examples_json(&self) -> Value {
        let list = |c: &Class| -> Vec<Value> {
            let entries = self.examples.get(c).into_iter().flatten();
            entries
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
                .collect()
        };
        Value::Object(
            Class::ALL
                .iter()
                .map(|c| (c.key().to_owned(), Value::Array(list(c))))
                .collect(),
        )
    }

    /// The text report's lines for one class (nothing when it has none).
    fn fmt_class(&self, f: &mut fmt::Formatter<'_>, c: Class) -> fmt::Result {
        let n = self.count(c);
        if n == 0 {
            return Ok(());
        }
        writeln!(f, "{}: {n}", c.key())?;
        for e in self.examples.get(&c).into_iter().flatten() {
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
        let shown = self.examples.get(&c).map_or(0, Vec::len) as u64;
        if n > shown && c != Class::Holes && c != Class::StreamOnly {
            writeln!(f, "  … and {} more", n - shown)?;
        }
        writeln!(f, "  what to do: {}", self.recovery(c))
    }

    /// What to do about `c`, the commands it names with the `--config` `verify` ran with: copied
    /// without it, they would read and release the default relay's keys.
    fn recovery(&self, c: Class) -> String {
        let text = c.recovery();
        match &self.commands {
            Some([parked, requeue_key, requeue_event]) => text
                .replace("outbox-relay requeue --event ID", requeue_event)
                .replace("outbox-relay requeue --key TYPE/ID", requeue_key)
                .replace("outbox-relay parked", parked),
            None => text.to_owned(),
        }
    }

    /// The text report's last line.
    fn verdict(&self) -> String {
        let waiting = self.count(Class::Waiting);
        let discarded = match self.count(Class::Discarded) {
            0 => String::new(),
            n => format!(
                "; {n} discarded by an operator (requeue --discard), never published to their subjects"
            ),
        };
        match (self.differences(), &self.not_checked) {
            (n, _) if n > 0 => format!("{n} differences: what to do is in {RECOVERY}"),
            (_, Some(why)) => format!("not everything could be checked: {why}"),
            _ if self.count(Class::Unknown) > 0 => format!(
                "no difference found, but {} rows could not be told waiting or missing (see the warning)",
                self.count(Class::Unknown)
            ),
            _ if waiting > 0 => format!(
                "no differences: every event stored arrived once and in order; {waiting} wait in the slot \
                 (the relay has not published them yet){discarded}"
            ),
            // Discarded events never reached their subjects: "every event arrived" would be untrue.
            _ if self.rows > 0 && !discarded.is_empty() => format!(
                "no differences: every event not discarded arrived once and in order ({} rows checked){discarded}",
                self.rows
            ),
            _ if self.rows > 0 => format!(
                "every event arrived once and in order ({} rows checked)",
                self.rows
            ),
            _ => "no differences".to_owned(),
        }
    }
}

impl fmt::Display for VerifyReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // A stream that could not be read has no count: "0 messages" would say it is empty.
        let stream = if self.not_checked.is_some() {
            format!("stream {} not read", self.stream)
        } else {
            format!(
                "{} messages in stream {} (sequences {}..{})",
                self.messages, self.stream, self.first_sequence, self.last_sequence
            )
        };
        writeln!(
            f,
            "verify: {} rows, {stream}; checks: {}",
            self.rows,
            self.checks.join(", ")
        )?;
        for s in &self.skipped {
            writeln!(f, "  not checked: {s}")?;
        }
        for w in &self.warnings {
            writeln!(f, "  warning: {w}")?;
        }
        for c in Class::ALL {
            self.fmt_class(f, c)?;
        }
        match (self.proven_up_to.created_at(), self.proven_up_to.lsn) {
            (Some(t), Some(l)) => writeln!(
                f,
                "proven up to: rows created at or before {t} (commit LSN {l})"
            )?,
            (Some(t), None) => writeln!(f, "proven up to: rows created at or before {t}")?,
            _ => {}
        }
        writeln!(f, "{}", self.verdict())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn missing(r: &mut VerifyReport, n: usize) {
        for i in 0..n {
            r.add(Class::Missing, || {
                Some(Example {
                    event_id: format!("e-{i}"),
                    sequence: None,
                    detail: None,
                })
            });
        }
    }

    #[test]
    fn discarded_events_are_not_said_to_have_arrived() {
        let mut r = VerifyReport {
            rows: 10,
            ..VerifyReport::default()
        };
        r.add(Class::Discarded, || None);
        r.add(Class::Discarded, || None);
        let text = r.to_string();
        let last = text.lines().last().unwrap_or_default();
        assert!(
            !last.starts_with("every event arrived") && last.contains("2 discarded by an operator"),
            "{last}"
        );
    }

    #[test]
    fn a_stream_that_could_not_be_read_is_not_called_empty() {
        let r = VerifyReport {
            rows: 4,
            stream: "OUTBOX".into(),
            not_checked: Some("the stream could not be read (NATS down)".into()),
            ..VerifyReport::default()
        };
        let first = r.to_string().lines().next().unwrap_or_default().to_owned();
        assert!(
            first.starts_with("verify: 4 rows, stream OUTBOX not read;"),
            "{first}"
        );
    }

    #[test]
    fn a_dead_letters_recovery_names_requeue_event_with_the_config_verify_ran_with() {
        let mut r = VerifyReport::default();
        r.add(Class::DeadLettered, || None);
        r.commands = Some([
            "`outbox-relay --config /r.toml parked`".into(),
            "`outbox-relay --config /r.toml requeue --key TYPE/ID`".into(),
            "`outbox-relay --config /r.toml requeue --event ID`".into(),
        ]);
        let text = r.to_string();
        assert!(
            text.contains("then `outbox-relay --config /r.toml requeue --event ID` for each"),
            "{text}"
        );
    }

    #[test]
    fn a_recovery_names_its_commands_with_the_config_verify_ran_with() {
        let mut r = VerifyReport::default();
        r.add(Class::Parked, || None);
        let plain = r.to_json()["recoveries"]["parked"].to_string();
        assert!(
            plain.contains("then outbox-relay requeue --key TYPE/ID"),
            "{plain}"
        );
        r.commands = Some([
            "`outbox-relay --config /r.toml parked`".into(),
            "`outbox-relay --config /r.toml requeue --key TYPE/ID`".into(),
            "`outbox-relay --config /r.toml requeue --event ID`".into(),
        ]);
        let text = r.to_string();
        for r in [r.to_json()["recoveries"]["parked"].to_string(), text] {
            assert!(
                r.contains(
                    "then `outbox-relay --config /r.toml requeue --key TYPE/ID` (or --discard); \
                     `outbox-relay --config /r.toml parked` lists the keys"
                ),
                "{r}"
            );
        }
    }

    #[test]
    fn the_json_has_every_contract_key_and_bounded_examples() {
        let mut r = VerifyReport {
            fence: true,
            ..VerifyReport::default()
        };
        missing(&mut r, 15);
        r.add(Class::Waiting, || None);
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
            "waiting",
            "dead_lettered",
            "parked",
            "holes",
            "stream_only",
            "unknown",
        ] {
            assert!(j[k].is_u64(), "{k}: {j}");
        }
        assert!(j["proven_up_to"].get("lsn").is_some(), "{j}");
        assert!(j["proven_up_to"].get("created_at").is_some(), "{j}");
        assert_eq!(j["missing"], 15);
        assert_eq!(j["in_flight"], 1, "the old name of waiting");
        assert_eq!(j["examples"]["missing"].as_array().unwrap().len(), EXAMPLES);
        assert_eq!(j["examples"]["missing"][0]["event_id"], "e-0");
        assert!(j["examples"]["missing"][0].get("sequence").is_none());
        assert!(
            j["recoveries"]["missing"]
                .as_str()
                .unwrap()
                .ends_with("docs/recovery.md#missing"),
            "{j}"
        );
        assert_eq!(r.differences(), 15, "waiting is not a difference");
        assert_eq!(r.exit_code(), 1);
        let text = r.to_string();
        assert!(text.contains("missing: 15\n  e-0\n"), "{text}");
        assert!(text.contains("… and 5 more"), "{text}");
        assert!(text.contains("what to do: "), "{text}");
    }

    #[test]
    fn exit_codes_clean_waiting_unknown_and_unreachable() {
        let mut r = VerifyReport {
            rows: 3,
            ..VerifyReport::default()
        };
        assert_eq!(r.exit_code(), 0);
        assert!(
            r.to_string()
                .contains("every event arrived once and in order")
        );
        r.add(Class::Waiting, || None);
        assert_eq!(r.exit_code(), 0, "waiting is no difference");
        assert!(r.to_string().contains("1 wait in the slot"), "{r}");
        r.add(Class::Unknown, || None);
        assert_eq!(r.exit_code(), 2, "unknown could not be checked");
        missing(&mut r, 1);
        assert_eq!(r.exit_code(), 1, "a difference wins");
        let unreachable = VerifyReport {
            not_checked: Some("NATS unreachable".into()),
            ..VerifyReport::default()
        };
        assert_eq!(unreachable.exit_code(), 2);
    }

    #[test]
    fn what_others_wrote_is_shown_as_one_escaped_bounded_line() {
        let mut r = VerifyReport::default();
        r.add(Class::Foreign, || {
            Some(Example {
                event_id: "f-1\u{1b}[2J\nforged line".into(),
                sequence: Some(7),
                detail: Some("x".repeat(5000)),
            })
        });
        r.warn("server said:\u{202e}olleh");
        let e = &r.examples[&Class::Foreign][0];
        assert_eq!(e.event_id, "f-1\\u{1b}[2J\\u{a}forged line");
        assert!(e.detail.as_ref().unwrap().len() <= MAX_SHOWN + 3);
        assert_eq!(r.warnings[0], "server said:\\u{202e}olleh");
        assert_eq!(
            r.to_string()
                .lines()
                .filter(|l| l.contains("forged"))
                .count(),
            1
        );
    }

    #[test]
    fn proven_up_to_is_printed_as_rfc3339() {
        let p = Proven {
            lsn: Some(Lsn(0x16B3748)),
            created_unix_us: Some(PG_EPOCH_UNIX_US + 1),
        };
        assert_eq!(
            p.created_at().as_deref(),
            Some("2000-01-01T00:00:00.000001Z")
        );
        let r = VerifyReport {
            proven_up_to: p,
            ..VerifyReport::default()
        };
        assert_eq!(r.to_json()["proven_up_to"]["lsn"], "0/16B3748");
    }
}
