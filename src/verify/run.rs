//! One `verify` run, step by step: each step is a method of [`Run`], called in order by
//! [`super::verify`]; what a step finds goes into the run's state for the next ones and into the
//! report. See the module docs of `verify` for why the steps come in this order.

use std::time::{Instant, SystemTime, UNIX_EPOCH};

use super::class::Class;
use super::compare::{self, DEAD_LETTER, RowFinding, RowRec, content_hash, hash64};
use super::findings;
use super::look::{self, AbsentRules, Candidate, LookCtx};
use super::messages::Messages;
use super::parked::ParkedRuns;
use super::proof::{self, ProofTracker};
use super::report::{Proven, VerifyReport};
use super::side::{Head, StreamSide};
use super::skipped::Skipped;
use super::slot::{self, Waiting};
use super::stream::{PROGRESS_EVERY, StreamScan, split_position};
use super::{ROWS_CURSOR, Rows, VerifyError, VerifyOptions, expected_subject, first_time_us, span};
use crate::Lsn;
use crate::config::Settings;
use crate::event::{MAX_ID_BYTES, usable_id};

/// A progress line every [`PROGRESS_EVERY`].
pub(super) struct Ticker(Instant);

impl Ticker {
    pub(super) fn new() -> Ticker {
        Ticker(Instant::now())
    }

    pub(super) fn due(&mut self) -> bool {
        let due = self.0.elapsed() >= PROGRESS_EVERY;
        if due {
            self.0 = Instant::now();
        }
        due
    }
}

/// One run's state, step by step.
pub(super) struct Run<'a, P> {
    settings: &'a Settings,
    opts: &'a VerifyOptions,
    progress: P,
    rows: Option<Rows>,
    side: StreamSide,
    scan: StreamScan,
    /// The first read's messages, indexed.
    first: Messages,
    /// The recheck's, when there was one.
    later: Option<Messages>,
    candidates: Vec<Candidate>,
    waiting: Waiting,
    proof: ProofTracker,
    /// Id hashes of events stored twice or out of order, sorted, for the proof.
    unproven_ids: Vec<(u64, Class)>,
    unusable_ids: u64,
    /// What explains the messages gone before the stream's first one.
    head: Option<Head>,
    /// Rows created before this (µs) may have lost their message to `max_age` inside the stream
    /// (per-message TTLs allowed: `StreamSide::aged_inside_before`).
    aged_inside: Option<i64>,
    /// The runs of the parked keys the parked copies belong to.
    runs: ParkedRuns<'a>,
    report: VerifyReport,
}

impl<'a, P: FnMut(String)> Run<'a, P> {
    pub(super) fn new(
        settings: &'a Settings,
        opts: &'a VerifyOptions,
        rows: Option<Rows>,
        side: StreamSide,
        progress: P,
    ) -> Self {
        let n = &settings.config().nats;
        let below = rows.as_ref().and_then(|r| r.table.snapshot_lsn);
        let runs = ParkedRuns::new(settings, &side.nats);
        Run {
            settings,
            opts,
            progress,
            rows,
            side,
            scan: StreamScan::new(opts.payloads, &n.dead_letter_subject, below),
            first: Messages::default(),
            later: None,
            candidates: Vec::new(),
            waiting: Waiting::Passed,
            proof: ProofTracker::default(),
            unproven_ids: Vec::new(),
            unusable_ids: 0,
            head: None,
            aged_inside: None,
            runs,
            report: VerifyReport {
                stream: n.stream.clone(),
                fence: n.fence,
                commands: Some([
                    settings.command("parked"),
                    settings.command("requeue --key TYPE/ID"),
                    settings.command("requeue --event ID"),
                ]),
                ..VerifyReport::default()
            },
        }
    }

    /// The messages read so far, in sequence order.
    fn parts(&self) -> Vec<&Messages> {
        std::iter::once(&self.first)
            .chain(self.later.as_ref())
            .collect()
    }

    /// Reads the relay's range of the stream into `first`.
    pub(super) async fn read_first(&mut self) -> Result<(), VerifyError> {
        let name = &self.settings.config().nats.stream;
        let (start, last) = (self.side.read_start, self.side.state.last_sequence);
        span(name, start, last)?;
        // Exactly the records needed: a vector that doubles would hold up to twice that.
        self.scan.msgs = Messages::new(start, self.side.state.messages);
        if self.side.state.messages > 0 {
            let progress = &mut self.progress;
            self.scan
                .read(&self.side.nats, name, start, last, &mut |read| {
                    progress(format!("verify: {read} messages read"))
                })
                .await?;
        }
        self.first = std::mem::take(&mut self.scan.msgs);
        self.first.index();
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_micros() as i64);
        self.head = self.side.head_explained(self.opts.from_sequence, now);
        self.aged_inside = self.side.aged_inside_before(now);
        Ok(())
    }

    /// The rows, one at a time: only those with a candidate finding are kept.
    pub(super) async fn pass_rows(&mut self) -> Result<(), VerifyError> {
        let Some(rows) = &self.rows else {
            return Ok(());
        };
        self.proof.previous = rows.table.previous_proof(&rows.pg).await;
        let o = &self.settings.config().outbox;
        let (template, payloads) = (&self.settings.subject, self.opts.payloads);
        let (report, proof, candidates) = (&mut self.report, &mut self.proof, &mut self.candidates);
        let (first, progress, unusable) = (&self.first, &mut self.progress, &mut self.unusable_ids);
        let mut ticker = Ticker::new();
        rows.table
            .fetch_all(&rows.pg, o, ROWS_CURSOR, async |r| {
                proof.row(r.created_us);
                if ticker.due() {
                    progress(format!("verify: {} rows read", report.rows));
                }
                // The relay gives a row without a usable id a WAL-derived one, which the row cannot
                // be matched with (docs/guarantees.md, Messages).
                let Some(id) = r.id.filter(|id| usable_id(id)) else {
                    *unusable += 1;
                    proof.unproven(r.created_us, None);
                    return Ok(true);
                };
                let content = match expected_subject(template, &r) {
                    Some(subject) => content_hash(&subject, payloads.then_some(r.payload)),
                    None => DEAD_LETTER,
                };
                let row = RowRec {
                    id: hash64(id.as_bytes()),
                    content,
                };
                // Rows compared: those without a usable id are said apart.
                report.rows += 1;
                if let Some(finding) = compare::check(row, &[first]) {
                    candidates.push(Candidate { row, finding });
                }
                Ok(true)
            })
            .await?;
        progress(format!("verify: {} rows read", report.rows));
        Ok(())
    }

    /// For rows not in the stream: what the slot holds, then the stream read again past the first
    /// read. No clock: whatever the slot had confirmed when it was copied was stored before, so
    /// the second read holds it; what it had not confirmed is waiting.
    pub(super) async fn recheck(&mut self) -> Result<(), VerifyError> {
        let absent = self
            .candidates
            .iter()
            .any(|c| c.finding == RowFinding::Absent);
        let Some(rows) = self.rows.as_ref().filter(|_| absent) else {
            return Ok(());
        };
        let slot_name = &self.settings.config().postgres.slot;
        (self.progress)(format!(
            "verify: looking into replication slot {slot_name} for rows not in the stream"
        ));
        self.waiting =
            slot::look(self.settings, rows.table.snapshot_lsn, self.opts.slot_look).await;
        if let Some(w) = self.waiting.warning() {
            self.report.warn(w);
        }
        let name = &self.settings.config().nats.stream;
        let from = self.side.read_start.max(self.scan.read_to + 1);
        let now = self.side.last_sequence().await?;
        span(name, from, now)?;
        // The later messages in a part of their own: growing the first would copy it.
        self.scan.msgs = Messages::new(from, (now + 1).saturating_sub(from));
        let progress = &mut self.progress;
        self.scan
            .read(&self.side.nats, name, from, now, &mut |read| {
                progress(format!("verify: {read} messages read"))
            })
            .await?;
        let mut later = std::mem::take(&mut self.scan.msgs);
        later.index();
        let parts = [&self.first, &later];
        self.candidates
            .retain_mut(|c| match compare::check(c.row, &parts) {
                Some(f) => {
                    c.finding = f;
                    true
                }
                None => false,
            });
        self.later = Some(later);
        Ok(())
    }

    /// What the stream shows by itself: second copies, order, foreign messages, holes and the
    /// events no row found.
    pub(super) async fn stream_findings(&mut self) -> Result<(), VerifyError> {
        let parts: Vec<&Messages> = std::iter::once(&self.first)
            .chain(self.later.as_ref())
            .collect();
        let stream = &self.side.stream;
        let report = &mut self.report;
        let pairs = compare::second_copies(&parts);
        let (copies, dup_ids) = findings::duplicates(stream, &pairs, report).await?;
        let order = &self.scan.out_of_order;
        let order_ids = findings::out_of_order(stream, order, &copies, report).await?;
        findings::foreign(stream, &self.scan.foreign, report).await?;
        findings::holes(&self.side, self.head.as_ref(), &self.scan, report);
        if self.opts.where_sql.is_some() || self.opts.since.is_some() {
            report.skipped.push(Skipped::StreamOnlyFiltered);
        } else {
            findings::stream_only(stream, &parts, &mut self.runs, report).await?;
        }
        let mut ids: Vec<(u64, Class)> = dup_ids
            .into_iter()
            .map(|h| (h, Class::Duplicates))
            .collect();
        match order_ids {
            Some(o) => ids.extend(o.into_iter().map(|h| (h, Class::OutOfOrder))),
            None => self.proof.unproven(None, Some(Class::OutOfOrder)),
        }
        ids.sort_unstable_by_key(|x| x.0);
        self.unproven_ids = ids;
        Ok(())
    }

    /// The exact second look at the candidates, by their ids.
    pub(super) async fn classify(&mut self) -> Result<(), VerifyError> {
        let Some(rows) = &self.rows else {
            return Ok(());
        };
        if self.candidates.is_empty() && self.unproven_ids.is_empty() {
            return Ok(());
        }
        self.candidates.sort_unstable_by_key(|c| c.row.id);
        // Rows created before the first message read, and (max_age) before its horizon; with
        // per-message TTLs, also rows before max_age's horizon whose message went inside the stream.
        let at_head = match &self.head {
            Some(h) => {
                let first = first_time_us(&self.side.stream, self.scan.first_read).await;
                Some(h.before.map_or(first, |b| first.min(b)))
            }
            None => None,
        };
        let older_than = at_head.max(self.aged_inside);
        let before_backfill = match (&self.side.start, rows.table.has_created) {
            (Some(s), true) if s.selective() => Some(s.started_unix_us),
            _ => None,
        };
        let ctx = LookCtx {
            settings: self.settings,
            payloads: self.opts.payloads,
            rules: AbsentRules {
                before_backfill,
                older_than,
                waiting: &self.waiting,
            },
            stream: &self.side.stream,
            unproven_ids: &self.unproven_ids,
        };
        let (report, proof) = (&mut self.report, &mut self.proof);
        let runs = &mut self.runs;
        look::second_look(
            &rows.pg,
            &rows.table,
            &self.candidates,
            &ctx,
            runs,
            (report, proof),
        )
        .await?;
        if let Some(s) = self
            .side
            .start
            .as_ref()
            .filter(|_| report.count(Class::BeforeBackfill) > 0)
        {
            // Stream metadata anyone allowed to update the stream may write: shown escaped and
            // bounded, never run.
            let shown = |v: &str| crate::text::shown(v, 1024);
            report.skipped.push(Skipped::BeforeBackfill {
                rows: report.count(Class::BeforeBackfill),
                slot: shown(&s.slot),
                started: shown(&s.started),
                where_sql: shown(s.where_sql.as_deref().unwrap_or_default()),
            });
        }
        Ok(())
    }

    /// `proven_up_to`, for a check of every row of a table with a creation time.
    pub(super) async fn prove(&mut self) -> Result<(), VerifyError> {
        let Some(rows) = &self.rows else {
            return Ok(());
        };
        if self.opts.where_sql.is_some() || self.opts.since.is_some() {
            self.report.skipped.push(Skipped::ProofFiltered);
            return Ok(());
        }
        if !rows.table.has_created {
            self.report.skipped.push(Skipped::ProofNoCreatedAt {
                table: self.settings.config().outbox.table.clone(),
            });
            return Ok(());
        }
        let created = self.proof.created_bound();
        let lsn = match created {
            None => None,
            Some(_) if !self.proof.held_back() => self.scan.newest_below.map(|p| p.lsn),
            Some(c) => self.newest_proven_lsn(c).await?,
        };
        self.report.proven_up_to = Proven {
            lsn,
            created_unix_us: created,
        };
        Ok(())
    }

    /// The commit LSN of the newest message whose row was created at or before `created`: the
    /// rows are read once more, their first copies looked up, the newest read for its position.
    async fn newest_proven_lsn(&mut self, created: i64) -> Result<Option<Lsn>, VerifyError> {
        let Some(rows) = &self.rows else {
            return Ok(None);
        };
        let parts = self.parts();
        let mut newest = 0u64;
        let o = &self.settings.config().outbox;
        rows.table
            .scan(&rows.pg, o, false, "outbox_relay_verify_proof", async |r| {
                if let (Some(id), Some(c)) = (r.id, r.created_us)
                    && c <= created
                {
                    let h = hash64(id.as_bytes());
                    let first = parts
                        .iter()
                        .find_map(|p| p.copies(h).and_then(|c| c.routed));
                    newest = newest.max(first.map_or(0, |f| f.0));
                }
                Ok(true)
            })
            .await?;
        if newest == 0 {
            return Ok(None);
        }
        let m = self.side.stream.get_raw_message(newest).await.ok();
        let position = m.as_ref().and_then(|m| m.headers.get("Outbox-Position"));
        Ok(position
            .and_then(|p| split_position(p.as_str()))
            .map(|(_, p)| p.lsn))
    }

    /// The counts of the reads, the checks that ran and what was left out; `--record`; the
    /// snapshot's end.
    pub(super) async fn finish(mut self) -> Result<VerifyReport, VerifyError> {
        let r = &mut self.report;
        r.messages = self.scan.messages;
        r.first_sequence = self.scan.first_read;
        r.last_sequence = self.scan.last_read;
        r.checks = vec!["once", "order", "gap_free"];
        if self.unusable_ids > 0 {
            r.skipped.push(Skipped::UnusableIds {
                rows: self.unusable_ids,
                max_id_bytes: MAX_ID_BYTES,
            });
        }
        match &self.rows {
            Some(rows) => {
                r.checks.splice(0..0, ["completeness", "waiting"]);
                r.checks.push("routing");
                if self.opts.payloads {
                    r.checks.push("payloads");
                } else {
                    r.skipped.push(Skipped::Payloads);
                }
                if self.opts.record {
                    proof::record(self.settings, &rows.table, &r.proven_up_to, r.rows).await?;
                }
                rows.close().await;
            }
            None => r.skipped.push(Skipped::NoRows),
        }
        Ok(self.report)
    }
}
