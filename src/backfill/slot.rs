//! The backfill's replication slot: whether an existing one may be replaced ([`decide_slot`]),
//! dropping it (`--replace-slot`), creating the new one with an exported snapshot, which a stop
//! cancels ([`create_slot`]), and dropping the new one again when the backfill fails or is stopped
//! ([`abandon_slot`]), so that `run` never starts after rows that were never published.

use std::future::Future;
use std::pin::Pin;
use std::time::{Duration, Instant};

use tracing::{info, warn};

use super::port::{BackfillServers, Control, SlotMaker};
use super::{BackfillError, BackfillOptions};
use crate::Lsn;
use crate::backfill_marker::Marker;
use crate::catalog;
use crate::config::Settings;
use crate::source::SystemInfo;

/// How long a slot the backfill's walsender just let go of may still show as active.
const SLOT_RELEASE: Duration = Duration::from_secs(10);

/// Drops the existing slot (`--replace-slot`).
pub(super) async fn drop_existing_slot(
    control: &dyn Control,
    slot: &str,
) -> Result<(), BackfillError> {
    control
        .drop_slot(slot.to_owned())
        .await
        .map_err(|source| BackfillError::DropSlot {
            slot: slot.to_owned(),
            source,
        })?;
    info!(%slot, "dropped the existing slot (--replace-slot)");
    Ok(())
}

/// The new slot: the replication connection (the snapshot lives as long as it does), the server's
/// history when it told it, the consistent point and the snapshot's name.
pub(super) type NewSlot = (Box<dyn SlotMaker>, Option<SystemInfo>, Lsn, String);

/// How creating the slot ended.
pub(super) enum Creation {
    /// The slot exists.
    Done(NewSlot),
    /// `stop` resolved meanwhile: the creation was cancelled, or had finished anyway (`created`).
    Stopped {
        /// The signal.
        signal: &'static str,
        /// The slot, when the cancel came too late.
        created: Option<NewSlot>,
    },
}

/// Opens the replication connection and creates the slot with an exported snapshot. A stop
/// meanwhile cancels the walsender's command (`pg_cancel_backend` on the control connection, the
/// same role): Postgres drops a slot it had not finished.
pub(super) async fn create_slot(
    settings: &Settings,
    control: &dyn Control,
    servers: &mut dyn BackfillServers,
    stop: Pin<&mut impl Future<Output = &'static str>>,
) -> Result<Creation, BackfillError> {
    let slot = settings.config().postgres.slot.clone();
    let mut repl = servers
        .replication()
        .await
        .map_err(|source| BackfillError::Postgres {
            target: settings.conn.to_string(),
            check: settings.key_source("postgres.url"),
            source,
        })?;
    // The history the backfilled messages name, so the next run's replay recognises them as its
    // own. Without it (an old server's answer it cannot read) they carry none, and the run after the
    // backfill trusts nothing and republishes (JetStream drops the duplicates).
    let system = repl.identify_system().await;
    let walsender = repl.backend_pid();
    let (result, signal) = {
        let creating =
            repl.create_slot_with_snapshot(slot.clone(), settings.config().postgres.failover);
        tokio::pin!(creating);
        tokio::select! {
            biased;
            signal = stop => {
                if let Err(e) = control.cancel_backend(walsender).await {
                    warn!(error = %e, "could not cancel the slot's creation; waiting for it");
                }
                (creating.await, Some(signal))
            }
            r = &mut creating => (r, None),
        }
    };
    match (result, signal) {
        (Ok((lsn, snapshot)), None) => Ok(Creation::Done((repl, system, lsn, snapshot))),
        (Ok((lsn, snapshot)), Some(signal)) => Ok(Creation::Stopped {
            signal,
            created: Some((repl, system, lsn, snapshot)),
        }),
        (Err(_), Some(signal)) => {
            repl.close().await;
            Ok(Creation::Stopped {
                signal,
                created: None,
            })
        }
        (Err(source), None) => {
            repl.close().await;
            Err(BackfillError::CreateSlot { slot, source })
        }
    }
}

/// After a failed or stopped publish: ends the snapshot's transaction and drops the new slot.
/// Returns whether the slot is gone.
pub(super) async fn abandon_slot(control: &dyn Control, slot: &str) -> bool {
    control.rollback().await;
    // Without the slot, `run` refuses (P9) instead of starting after rows that were never
    // published; the next backfill creates it again. The walsender that created it releases it a
    // moment after its connection closed: "is active for PID" (55006) is waited out, briefly.
    let deadline = Instant::now() + SLOT_RELEASE;
    loop {
        // Only if it exists: after a cancelled creation there may be none.
        match control.drop_slot_if_exists(slot.to_owned()).await {
            Ok(()) => return true,
            Err(e) if e.in_use && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(drop) => {
                warn!(%slot, error = %drop.message, "backfill stopped and the slot it created could not be dropped: run backfill again (it replaces the slot)");
                return false;
            }
        }
    }
}

/// Refuses an active slot, and an existing one without `--replace-slot`, unless an unfinished
/// backfill of this slot left it (its marker stands): that slot is replaced, as the marker's
/// recovery says. Returns whether to drop the existing slot.
pub(super) fn decide_slot(
    settings: &Settings,
    existing: Option<&catalog::SlotRow>,
    opts: &BackfillOptions,
    standing: Option<&Marker>,
) -> Result<bool, BackfillError> {
    let slot = &settings.config().postgres.slot;
    let Some(s) = existing else {
        return Ok(false);
    };
    if s.active {
        return Err(BackfillError::SlotActive {
            slot: slot.clone(),
            pid: s.active_pid.unwrap_or(0),
        });
    }
    if opts.replace_slot {
        return Ok(true);
    }
    if let Some(m) = standing {
        info!(%slot, backfill = %m.origin(), "replacing the slot an unfinished backfill left");
        return Ok(true);
    }
    let found = match s.invalidated() {
        Some(reason) => format!("invalidated: {reason}"),
        None => format!(
            "inactive, confirmed up to {}, wal_status {}",
            s.confirmed_flush_lsn.as_deref().unwrap_or("-"),
            s.wal_status.as_deref().unwrap_or("-")
        ),
    };
    Err(BackfillError::SlotExists {
        slot: slot.clone(),
        found,
        replace: super::error::again(settings, opts, true),
        run: settings.command("run"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn marker() -> Marker {
        Marker::new("outbox_relay", None, None, 0)
    }

    fn decide(
        existing: Option<&catalog::SlotRow>,
        replace_slot: bool,
        standing: Option<&Marker>,
    ) -> Result<bool, BackfillError> {
        let settings = crate::config::Config::default().validate().unwrap();
        let opts = BackfillOptions {
            replace_slot,
            ..BackfillOptions::default()
        };
        decide_slot(&settings, existing, &opts, standing)
    }

    #[test]
    fn a_slot_an_unfinished_backfill_left_is_replaced_without_the_option() {
        let idle = catalog::SlotRow::default();
        assert!(matches!(
            decide(Some(&idle), false, None),
            Err(BackfillError::SlotExists { .. })
        ));
        assert!(decide(Some(&idle), false, Some(&marker())).unwrap());
        assert!(decide(Some(&idle), true, None).unwrap());
        assert!(
            !decide(None, false, Some(&marker())).unwrap(),
            "no slot: nothing to drop"
        );
    }

    #[test]
    fn a_streamed_slot_is_refused_whatever_the_marker_says() {
        let active = catalog::SlotRow {
            active: true,
            active_pid: Some(4711),
            ..catalog::SlotRow::default()
        };
        for (replace, standing) in [(false, None), (true, None), (false, Some(marker()))] {
            assert!(matches!(
                decide(Some(&active), replace, standing.as_ref()),
                Err(BackfillError::SlotActive { pid: 4711, .. })
            ));
        }
    }
}
