//! The findings the stream shows by itself, rows or not: second copies (each confirmed by reading
//! both copies' ids), breaks of order, foreign messages, holes (gone sequences nothing in the
//! stream's limits explains), and the events no row found: stream-only events, counted, and
//! stream-only dead letters, which consumers never saw. Each step is a function of its own; the
//! ids of rows stored twice or out of order are returned, for the proof.

use async_nats::jetstream::stream::{RawMessageErrorKind, Stream};

use super::VerifyError;
use super::class::Class;
use super::compare::{Unmatched, hash64, unmatched};
use super::detail::Detail;
use super::look::dead_letter_detail;
use super::messages::Messages;
use super::parked::ParkedRuns;
use super::report::{EXAMPLES, Example, VerifyReport};
use super::side::{Head, StreamSide, stream_error};
use super::skipped::Skipped;
use super::stream::{StreamScan, event_id};

/// Out-of-order messages read again for their ids, at most; past it the proof proves nothing.
const MAX_ORDER_LOOKS: usize = 10_000;

/// What a message read again by its sequence carries: event id, subject, `Outbox-Position`.
struct Read {
    id: Option<String>,
    subject: String,
    position: String,
    headers: async_nats::HeaderMap,
}

async fn read(stream: &Stream, seq: u64) -> Result<Option<Read>, VerifyError> {
    match stream.get_raw_message(seq).await {
        Ok(m) => Ok(Some(Read {
            id: event_id(Some(&m.headers)).map(str::to_owned),
            subject: m.subject.to_string(),
            position: m
                .headers
                .get("Outbox-Position")
                .map(|v| v.as_str().to_owned())
                .unwrap_or_default(),
            headers: m.headers,
        })),
        Err(e) if e.kind() == RawMessageErrorKind::NoMessageFound => Ok(None),
        Err(e) => {
            let name = stream.cached_info().config.name.clone();
            Err(stream_error(&name, "reading a message", &e))
        }
    }
}

/// Confirms each proposed second copy (`pairs`: first copy, later copy) by reading both; counts
/// the true ones. Returns their sequences, sorted, and the ids' hashes.
pub(crate) async fn duplicates(
    stream: &Stream,
    pairs: &[(u64, u64)],
    report: &mut VerifyReport,
) -> Result<(Vec<u64>, Vec<u64>), VerifyError> {
    let (mut seqs, mut ids) = (Vec::new(), Vec::new());
    for &(first, later) in pairs {
        let (Some(a), Some(b)) = (read(stream, first).await?, read(stream, later).await?) else {
            continue;
        };
        let (Some(id), true) = (b.id.clone(), a.id == b.id) else {
            continue;
        };
        seqs.push(later);
        ids.push(hash64(id.as_bytes()));
        let detail = Detail::SecondCopy {
            first,
            replay_over: crate::position::replay_over(&b.position),
        }
        .to_string();
        report.add(Class::Duplicates, || {
            Some(Example {
                event_id: id,
                sequence: Some(later),
                detail: Some(detail),
            })
        });
    }
    seqs.sort_unstable();
    Ok((seqs, ids))
}

/// Counts the breaks of order that are not a second copy (a copy sits wherever its writer put
/// it). Returns the ids' hashes, `None` when there were too many to read them all.
pub(crate) async fn out_of_order(
    stream: &Stream,
    breaks: &[u64],
    second_copies: &[u64],
    report: &mut VerifyReport,
) -> Result<Option<Vec<u64>>, VerifyError> {
    let breaks: Vec<u64> = breaks
        .iter()
        .copied()
        .filter(|s| second_copies.binary_search(s).is_err())
        .collect();
    let all = breaks.len() <= MAX_ORDER_LOOKS;
    let mut ids = Vec::new();
    for (i, &seq) in breaks.iter().enumerate() {
        let m = if all || i < EXAMPLES {
            read(stream, seq).await?
        } else {
            None
        };
        ids.extend(
            m.as_ref()
                .and_then(|m| m.id.as_deref())
                .map(|id| hash64(id.as_bytes())),
        );
        report.add(Class::OutOfOrder, || {
            m.map(|m| Example {
                event_id: m.id.unwrap_or_default(),
                sequence: Some(seq),
                detail: Some(
                    Detail::NotAbove {
                        position: m.position,
                    }
                    .to_string(),
                ),
            })
        });
    }
    Ok(all.then_some(ids))
}

/// Counts the messages without the relay's headers.
pub(crate) async fn foreign(
    stream: &Stream,
    seqs: &[u64],
    report: &mut VerifyReport,
) -> Result<(), VerifyError> {
    for &seq in seqs {
        let m = if report.wants_example(Class::Foreign) {
            read(stream, seq).await?
        } else {
            None
        };
        report.add(Class::Foreign, || {
            m.map(|m| Example {
                event_id: m.id.unwrap_or_default(),
                sequence: Some(seq),
                detail: Some(Detail::Foreign { subject: m.subject }.to_string()),
            })
        });
    }
    Ok(())
}

/// Counts the gone sequences nothing explains as holes: before the stream's first message (unless
/// `head` explains them), and inside the ranges read (unless a limit removes messages anywhere).
/// What a limit explains is said in `skipped`.
pub(crate) fn holes(
    side: &StreamSide,
    head: Option<&Head>,
    scan: &StreamScan,
    report: &mut VerifyReport,
) {
    let gone = side.head_gone();
    let first = side.state.first_sequence;
    if gone > 0 {
        let (from, to) = (side.range_start, first - 1);
        match head {
            Some(Head {
                why,
                before: Some(t),
            }) => report.skipped.push(Skipped::HeadBefore {
                gone,
                from,
                to,
                why: why.clone(),
                before: super::report::rfc3339_unix_us(*t),
            }),
            Some(h) => report.skipped.push(Skipped::Head {
                gone,
                from,
                to,
                why: h.why.clone(),
            }),
            None => hole(
                report,
                gone,
                (from, to),
                "before the stream's first message; its limits cannot have removed them",
            ),
        }
    }
    if scan.gone == 0 {
        return;
    }
    if let Some(why) = side.limits.explains_inside() {
        report.skipped.push(Skipped::Inside {
            gone: scan.gone,
            why: why.to_owned(),
        });
        return;
    }
    for &range in &scan.gone_ranges {
        hole(report, range.1 - range.0 + 1, range, "deleted");
    }
    let listed: u64 = scan.gone_ranges.iter().map(|r| r.1 - r.0 + 1).sum();
    report.add_n(Class::Holes, scan.gone - listed, || None);
}

fn hole(report: &mut VerifyReport, n: u64, (from, to): (u64, u64), why: &'static str) {
    report.add_n(Class::Holes, n, || {
        Some(Example {
            event_id: String::new(),
            sequence: Some(from),
            detail: Some(Detail::Gone { from, to, n, why }.to_string()),
        })
    });
}

/// Counts the events no row found: stream-only events, and among them those stored only as dead
/// letters (a difference: consumers of their subject never saw them) or only as parked copies
/// (parked or discarded, as their key's run stands).
pub(crate) async fn stream_only(
    stream: &Stream,
    parts: &[&Messages],
    runs: &mut ParkedRuns<'_>,
    report: &mut VerifyReport,
) -> Result<(), VerifyError> {
    let (mut routed, mut dead, mut listed, mut parked) = (0u64, 0u64, Vec::new(), Vec::new());
    unmatched(parts, |u| match u {
        Unmatched::Routed(_) => routed += 1,
        Unmatched::DeadLetter(seq) => {
            dead += 1;
            if listed.len() < EXAMPLES {
                listed.push(seq);
            }
        }
        // Their sequences: 8 bytes each, beside the 16 of each message kept already.
        Unmatched::Parked(seq) => parked.push(seq),
    });
    report.add_n(
        Class::StreamOnly,
        routed + dead + parked.len() as u64,
        || None,
    );
    for seq in parked {
        if let Some((id, (class, sequence, detail))) = runs.class(stream, None, seq).await {
            let detail = detail.map(|d| Detail::NoRow(Box::new(d)).to_string());
            report.add(class, || {
                Some(Example {
                    event_id: id,
                    sequence,
                    detail,
                })
            });
        }
    }
    for &seq in &listed {
        let m = read(stream, seq).await?;
        report.add(Class::DeadLettered, || {
            m.map(|m| Example {
                event_id: m.id.unwrap_or_default(),
                sequence: Some(seq),
                detail: Some(
                    Detail::NoRow(Box::new(dead_letter_detail(&m.subject, &m.headers))).to_string(),
                ),
            })
        });
    }
    report.add_n(Class::DeadLettered, dead - listed.len() as u64, || None);
    Ok(())
}
