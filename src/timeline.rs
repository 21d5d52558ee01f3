//! A timeline's history, as the server keeps it in its history file and sends it in answer to
//! `TIMELINE_HISTORY`: the timelines before the current one, each with the LSN where it ended
//! (its switch point). A promotion or a point-in-time recovery ends a timeline and starts a new one;
//! WAL below the switch point is the same on both, WAL at or past it on the old timeline is a
//! history that did not survive. The relay uses this to tell whether a message it published on an
//! older timeline is still part of the server's history (the tail's trust rule, `src/tail/trust.rs`).
//!
//! The file is text, one line per ancestor, `parentTLI<TAB>X/Y<TAB>reason`, oldest first; blank
//! lines and lines starting with `#` are ignored. Timeline 1 has no history file. The parser is
//! pure and refuses anything the server would not write (a clear error, never a panic): a wrong
//! history would make the relay skip events it never stored.

use std::fmt;

use crate::Lsn;

/// The history of one timeline: its earlier timelines and where each ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TimelineHistory {
    timeline: u32,
    /// Oldest first: timelines strictly increasing and below `timeline`, switch points
    /// non-decreasing.
    ancestors: Vec<Switch>,
}

/// One earlier timeline and the LSN where it ended: WAL below `end` is the later timelines' too.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Switch {
    /// The earlier timeline.
    pub timeline: u32,
    /// Its switch point: the first LSN that is no longer its history.
    pub end: Lsn,
}

/// A history file that is not what the server writes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("timeline history of timeline {timeline}, line {line}: {what}")]
pub struct HistoryError {
    timeline: u32,
    /// 1-based; 0 for the file as a whole.
    line: usize,
    what: String,
}

impl TimelineHistory {
    /// A timeline with no known ancestors: timeline 1, or one whose history was not read.
    pub fn root(timeline: u32) -> Self {
        TimelineHistory {
            timeline,
            ancestors: Vec::new(),
        }
    }

    /// Parses the history file `content` of `timeline` (what `TIMELINE_HISTORY timeline`
    /// returns).
    pub fn parse(timeline: u32, content: &str) -> Result<Self, HistoryError> {
        let err = |line: usize, what: String| HistoryError {
            timeline,
            line,
            what,
        };
        let mut ancestors: Vec<Switch> = Vec::new();
        for (i, text) in content.lines().enumerate() {
            let line = i + 1;
            let text = text.trim_start();
            if text.is_empty() || text.starts_with('#') {
                continue;
            }
            // The server separates the fields by a tab and reads them back split at any
            // whitespace; the reason (free text) is the rest of the line.
            let mut fields = text.split_whitespace();
            let tli = fields.next().unwrap_or_default();
            let tli: u32 = tli
                .parse()
                .ok()
                .filter(|&t| t > 0)
                .ok_or_else(|| err(line, format!("{tli:?} is not a timeline ID")))?;
            let end = fields.next().ok_or_else(|| {
                err(
                    line,
                    format!("timeline {tli} has no switch point (expected X/Y)"),
                )
            })?;
            let end: Lsn = end
                .parse()
                .map_err(|_| err(line, format!("switch point {end:?} is not an LSN (X/Y)")))?;
            if let Some(last) = ancestors.last() {
                if tli <= last.timeline {
                    return Err(err(
                        line,
                        format!(
                            "timeline {tli} after timeline {}: timelines must increase",
                            last.timeline
                        ),
                    ));
                }
                if end < last.end {
                    return Err(err(
                        line,
                        format!(
                            "switch point {end} before the earlier timeline's {}",
                            last.end
                        ),
                    ));
                }
            }
            if tli >= timeline {
                return Err(err(
                    line,
                    format!("timeline {tli} is not older than timeline {timeline}"),
                ));
            }
            ancestors.push(Switch { timeline: tli, end });
        }
        if timeline > 1 && ancestors.is_empty() {
            return Err(err(0, "names no earlier timeline".into()));
        }
        Ok(TimelineHistory {
            timeline,
            ancestors,
        })
    }

    /// The timeline this is the history of.
    pub fn timeline(&self) -> u32 {
        self.timeline
    }

    /// The earlier timelines, oldest first.
    pub fn ancestors(&self) -> &[Switch] {
        &self.ancestors
    }

    /// How far `timeline`'s WAL is part of this history: everything for this timeline itself,
    /// below its switch point for an ancestor, nothing for any other timeline.
    pub fn shared(&self, timeline: u32) -> Shared {
        if timeline == self.timeline {
            return Shared::All;
        }
        match self.ancestors.iter().find(|s| s.timeline == timeline) {
            Some(s) => Shared::Below(s.end),
            None => Shared::Nothing,
        }
    }
}

/// How far another timeline's WAL is part of a history ([`TimelineHistory::shared`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shared {
    /// It is the history's own timeline.
    All,
    /// An ancestor: its WAL below this LSN (its switch point).
    Below(Lsn),
    /// Not an ancestor.
    Nothing,
}

impl fmt::Display for TimelineHistory {
    /// The history file's form (without reasons), e.g. `1\t0/3000000\n2\t0/5000A0\n`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for s in &self.ancestors {
            writeln!(f, "{}\t{}", s.timeline, s.end)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn reads_what_the_server_writes() {
        // As PG writes it: tab-separated, a reason, a blank line and a comment tolerated.
        let content = "1\t0/3000148\tno recovery target specified\n\n\
                       # a comment\n\
                       2\t0/50000A0\tbefore 2026-12-03 10:00:00+00\n";
        let h = TimelineHistory::parse(3, content).unwrap();
        assert_eq!(h.timeline(), 3);
        assert_eq!(
            h.ancestors(),
            &[
                Switch {
                    timeline: 1,
                    end: Lsn(0x300_0148)
                },
                Switch {
                    timeline: 2,
                    end: Lsn(0x500_00A0)
                }
            ]
        );
        assert_eq!(h.shared(3), Shared::All);
        assert_eq!(h.shared(1), Shared::Below(Lsn(0x300_0148)));
        assert_eq!(h.shared(2), Shared::Below(Lsn(0x500_00A0)));
        assert_eq!(h.shared(4), Shared::Nothing);
        // A line without a reason, spaces instead of tabs: what the server's own reader accepts.
        let h = TimelineHistory::parse(2, "  1   0/3000148").unwrap();
        assert_eq!(h.shared(1), Shared::Below(Lsn(0x300_0148)));
    }

    #[test]
    fn timeline_one_and_an_unread_history_have_no_ancestors() {
        assert_eq!(
            TimelineHistory::parse(1, "").unwrap(),
            TimelineHistory::root(1)
        );
        assert_eq!(TimelineHistory::root(4).shared(3), Shared::Nothing);
        assert_eq!(TimelineHistory::root(4).shared(4), Shared::All);
    }

    #[test]
    fn refuses_what_the_server_would_not_write() {
        let refused = |tli, content: &str| {
            TimelineHistory::parse(tli, content)
                .expect_err(content)
                .to_string()
        };
        assert_eq!(
            refused(2, "x\t0/1\tr"),
            "timeline history of timeline 2, line 1: \"x\" is not a timeline ID"
        );
        assert!(refused(2, "0\t0/1").contains("not a timeline ID"));
        assert!(refused(2, "1").contains("timeline 1 has no switch point"));
        assert!(refused(2, "1\t01000").contains("is not an LSN"));
        assert!(refused(3, "2\t0/5\n1\t0/6").contains("line 2: timeline 1 after timeline 2"));
        assert!(refused(3, "1\t0/5\n1\t0/6").contains("timelines must increase"));
        assert!(refused(3, "1\t0/6\n2\t0/5").contains("before the earlier timeline's"));
        assert!(refused(2, "2\t0/5").contains("not older than timeline 2"));
        assert!(refused(2, "# only a comment\n").contains("line 0: names no earlier timeline"));
        assert!(refused(2, "").contains("names no earlier timeline"));
    }

    fn history() -> impl Strategy<Value = TimelineHistory> {
        // Increasing timelines with non-decreasing switch points, and a later current one.
        prop::collection::vec((1u32..5, 0u64..0x1_0000_0000), 0..6).prop_map(|steps| {
            let (mut tli, mut end) = (0u32, 0u64);
            let ancestors: Vec<Switch> = steps
                .into_iter()
                .map(|(dt, de)| {
                    tli += dt;
                    end += de;
                    Switch {
                        timeline: tli,
                        end: Lsn(end),
                    }
                })
                .collect();
            TimelineHistory {
                timeline: tli + 1,
                ancestors,
            }
        })
    }

    proptest! {
        #[test]
        fn a_written_history_reads_back_the_same(h in history(), reason in "[ -~]{0,40}") {
            // Each line with a reason, as the server writes it.
            let content: String = h
                .ancestors()
                .iter()
                .map(|s| format!("{}\t{}\t{reason}\n", s.timeline, s.end))
                .collect();
            let parsed = TimelineHistory::parse(h.timeline(), &content).unwrap();
            prop_assert_eq!(&parsed, &h);
            prop_assert_eq!(TimelineHistory::parse(h.timeline(), &h.to_string()).unwrap(), h.clone());
            // Each written timeline is shared below its own switch point, no other one at all.
            for s in h.ancestors() {
                prop_assert_eq!(parsed.shared(s.timeline), Shared::Below(s.end));
            }
            prop_assert_eq!(parsed.shared(h.timeline()), Shared::All);
            prop_assert_eq!(parsed.shared(h.timeline() + 1), Shared::Nothing);
        }

        #[test]
        fn any_text_is_parsed_or_refused_never_a_panic(tli in 1u32..10, content in "\\PC{0,200}") {
            if let Ok(h) = TimelineHistory::parse(tli, &content) {
                // Whatever is accepted keeps the invariants the trust rule relies on.
                let a = h.ancestors();
                prop_assert!(a.iter().all(|s| s.timeline < tli));
                prop_assert!(a.windows(2).all(|w| w[0].timeline < w[1].timeline && w[0].end <= w[1].end));
            }
        }
    }
}
