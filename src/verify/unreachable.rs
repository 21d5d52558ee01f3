//! `verify` while NATS cannot be reached: the stream cannot be read, but the rows and the slot can.
//! Every row whose event the slot holds is counted as waiting, so an operator sees during an
//! outage that those events are not lost; the others are not checked, and the run exits 2 with
//! the connection's error (the report's `not_checked`). The same look into the slot as a full run
//! (`slot.rs`), over every row of the snapshot.

use super::class::Class;
use super::compare::hash64;
use super::report::{Example, VerifyReport};
use super::run::Ticker;
use super::skipped::Skipped;
use super::slot::{self, Waiting};
use super::{ROWS_CURSOR, Rows, VerifyError, VerifyOptions};
use crate::config::Settings;

/// The report of the rows and the slot alone; `e` is why the stream could not be read.
pub(super) async fn report(
    settings: &Settings,
    opts: &VerifyOptions,
    rows: Rows,
    e: VerifyError,
    mut progress: impl FnMut(String),
) -> Result<VerifyReport, VerifyError> {
    let n = &settings.config().nats;
    let mut report = VerifyReport {
        stream: n.stream.clone(),
        fence: n.fence,
        // The connection's error may quote what a server said: one escaped, bounded line.
        not_checked: Some(crate::text::shown(
            &format!(
                "the stream could not be read ({e}): rows whose event the slot holds are counted as waiting, the \
                 others were not checked"
            ),
            crate::error_chain::MAX_LINE,
        )),
        checks: vec!["waiting"],
        ..VerifyReport::default()
    };
    let waiting = slot::look(settings, rows.table.snapshot_lsn, opts.slot_look).await;
    if let Some(w) = waiting.warning() {
        report.warn(w);
    }
    count_waiting(settings, &rows, &waiting, &mut report, &mut progress).await?;
    report.skipped.push(Skipped::StreamUnreachable);
    if opts.record {
        report.skipped.push(Skipped::RecordUnreachable);
    }
    rows.close().await;
    Ok(report)
}

/// Goes through the rows, counting those whose event the slot holds.
async fn count_waiting(
    settings: &Settings,
    rows: &Rows,
    waiting: &Waiting,
    report: &mut VerifyReport,
    progress: &mut impl FnMut(String),
) -> Result<(), VerifyError> {
    let o = &settings.config().outbox;
    let mut ticker = Ticker::new();
    rows.table
        .fetch_all(&rows.pg, o, ROWS_CURSOR, async |r| {
            report.rows += 1;
            if ticker.due() {
                progress(format!("verify: {} rows read", report.rows));
            }
            if let Some(id) = r.id
                && waiting.waits(hash64(id.as_bytes())) == Some(true)
            {
                report.add(Class::Waiting, || {
                    Some(Example {
                        event_id: id.to_owned(),
                        sequence: None,
                        detail: None,
                    })
                });
            }
            Ok(true)
        })
        .await?;
    progress(format!("verify: {} rows read", report.rows));
    Ok(())
}
