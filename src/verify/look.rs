//! The exact second look at the rows with a candidate finding: the rows are read again (same
//! snapshot), and each candidate row is classed by its id, not its hash. A row not in the stream
//! is classed by [`AbsentRules`] (the slot, the stream's head, the backfill that began it); a row
//! whose message carries another subject or payload, or that only a dead letter carries, is
//! compared with that message read again by its sequence, which must carry the row's own id; one
//! only parked copies carry is parked or discarded as its key's run stands (`parked.rs`).
//! Every row that is not proven is handed to the proof ([`ProofTracker::unproven`]).

use async_nats::jetstream;

use super::VerifyError;
use super::class::Class;
use super::compare::{RowFinding, RowRec, hash64};
use super::detail::Detail;
use super::parked::ParkedRuns;
use super::proof::ProofTracker;
use super::report::{Example, VerifyReport};
use super::rows::{RowView, Table};
use super::slot::Waiting;
use super::stream::event_id;
use crate::config::Settings;

/// A row with a candidate finding, kept from the first pass.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Candidate {
    pub(crate) row: RowRec,
    pub(crate) finding: RowFinding,
}

/// What decides the class of a row whose event is not in the stream.
pub(crate) struct AbsentRules<'a> {
    /// Rows created before this (µs) were left out by the backfill that began the stream.
    pub(crate) before_backfill: Option<i64>,
    /// Rows created before this (µs: the first message read) are older than the stream, when a
    /// limit or `--from-sequence` explains the stream's start.
    pub(crate) older_than: Option<i64>,
    /// What the slot says.
    pub(crate) waiting: &'a Waiting,
}

impl AbsentRules<'_> {
    /// The class of a row not in the stream, with id hash `id`, created at `created`: waiting
    /// when the slot holds it, whatever its age; unknown when the slot could not tell; missing
    /// only when neither the slot, the stream's limits nor the backfill that began it explain it.
    pub(crate) fn class(&self, id: u64, created: Option<i64>) -> Class {
        let before = |t: Option<i64>| t.is_some_and(|t| created.is_some_and(|c| c < t));
        if before(self.before_backfill) {
            return Class::BeforeBackfill;
        }
        let waits = self.waiting.waits(id);
        if waits == Some(true) {
            return Class::Waiting;
        }
        if self
            .older_than
            .is_some_and(|t| created.is_none_or(|c| c < t))
        {
            return Class::OlderThanStream;
        }
        match waits {
            None => Class::Unknown,
            _ => Class::Missing,
        }
    }
}

/// What the second look needs besides the rows.
pub(crate) struct LookCtx<'a> {
    pub(crate) settings: &'a Settings,
    pub(crate) payloads: bool,
    pub(crate) rules: AbsentRules<'a>,
    pub(crate) stream: &'a jetstream::stream::Stream,
    /// Id hashes of events stored twice or out of order: their rows are not proven.
    pub(crate) unproven_ids: &'a [(u64, Class)],
}

/// Reads the rows again and classes each candidate (`candidates` sorted by id hash).
pub(crate) async fn second_look(
    pg: &tokio_postgres::Client,
    table: &Table,
    candidates: &[Candidate],
    ctx: &LookCtx<'_>,
    runs: &mut ParkedRuns<'_>,
    (report, proof): (&mut VerifyReport, &mut ProofTracker),
) -> Result<(), VerifyError> {
    let o = &ctx.settings.config().outbox;
    table
        .scan(pg, o, ctx.payloads, "outbox_relay_verify_look", async |r| {
            let Some(id) = r.id else { return Ok(true) };
            let h = hash64(id.as_bytes());
            if let Some(class) = unproven_id(ctx.unproven_ids, h) {
                proof.unproven(r.created_us, Some(class));
            }
            let Ok(k) = candidates.binary_search_by_key(&h, |c| c.row.id) else {
                return Ok(true);
            };
            let found = match candidates[k].finding {
                RowFinding::Absent => Some((ctx.rules.class(h, r.created_us), None, None)),
                RowFinding::Differs(seq) => differs(ctx, &r, id, seq).await,
                RowFinding::DeadLettered(seq) => dead_lettered(ctx, id, seq).await,
                RowFinding::Parked(seq) => runs.class(ctx.stream, Some(id), seq).await.map(|f| f.1),
            };
            if let Some((class, sequence, detail)) = found {
                proof.unproven(r.created_us, Some(class));
                report.add(class, || {
                    Some(Example {
                        event_id: id.to_owned(),
                        sequence,
                        detail: detail.map(|d| d.to_string()),
                    })
                });
            }
            Ok(true)
        })
        .await
}

/// A class, the message's sequence and a detail.
type Found = Option<(Class, Option<u64>, Option<Detail>)>;

fn unproven_id(ids: &[(u64, Class)], h: u64) -> Option<Class> {
    ids.binary_search_by_key(&h, |x| x.0).ok().map(|k| ids[k].1)
}

/// The message the merge paired with the row, read again: it must carry the row's own id, and its
/// subject or payload must really differ.
async fn differs(ctx: &LookCtx<'_>, r: &RowView<'_>, id: &str, seq: u64) -> Found {
    let m = ctx.stream.get_raw_message(seq).await.ok()?;
    if event_id(Some(&m.headers)) != Some(id) {
        return None;
    }
    let expected = super::expected_subject(&ctx.settings.subject, r);
    let (class, detail) = match expected {
        Some(e) if e == m.subject.as_str() => {
            if !(ctx.payloads && m.payload.as_ref() != r.payload) {
                return None;
            }
            (Class::PayloadDiffers, Detail::PayloadDiffers)
        }
        template => (
            Class::Misrouted,
            Detail::Misrouted {
                stored_on: m.subject.to_string(),
                template,
            },
        ),
    };
    Some((class, Some(seq), Some(detail)))
}

/// The dead letter the merge found for the row, read again for its id and its reason.
async fn dead_lettered(ctx: &LookCtx<'_>, id: &str, seq: u64) -> Found {
    let m = ctx.stream.get_raw_message(seq).await.ok()?;
    if event_id(Some(&m.headers)) != Some(id) {
        return None;
    }
    Some((
        Class::DeadLettered,
        Some(seq),
        Some(dead_letter_detail(&m.subject, &m.headers)),
    ))
}

/// A dead letter's subject and reason (its `Outbox-Error`, already one bounded line), as a detail.
pub(crate) fn dead_letter_detail(subject: &str, headers: &async_nats::HeaderMap) -> Detail {
    let reason = headers
        .get("Outbox-Error")
        .map_or("no Outbox-Error header", |v| v.as_str());
    Detail::DeadLetter {
        subject: subject.to_owned(),
        meant_for: headers.get("Outbox-Subject").map(|v| v.as_str().to_owned()),
        reason: crate::text::one_line(reason),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_absent_row_is_waiting_by_the_slot_never_by_its_age() {
        let waiting = Waiting::Told(vec![7]);
        let rules = AbsentRules {
            before_backfill: None,
            older_than: None,
            waiting: &waiting,
        };
        // Created a day ago: still waiting when the slot holds it.
        assert_eq!(rules.class(7, Some(0)), Class::Waiting);
        assert_eq!(rules.class(8, Some(0)), Class::Missing);
        let unknown = Waiting::Unknown {
            pending: vec![7],
            why: "bound".into(),
        };
        let rules = AbsentRules {
            waiting: &unknown,
            ..rules
        };
        assert_eq!(rules.class(7, None), Class::Waiting);
        assert_eq!(rules.class(8, None), Class::Unknown, "never missing");
        let limited = AbsentRules {
            older_than: Some(100),
            before_backfill: Some(50),
            ..rules
        };
        assert_eq!(limited.class(8, Some(40)), Class::BeforeBackfill);
        assert_eq!(limited.class(8, Some(60)), Class::OlderThanStream);
        assert_eq!(limited.class(8, Some(160)), Class::Unknown);
        assert_eq!(limited.class(7, Some(60)), Class::Waiting);
    }
}
