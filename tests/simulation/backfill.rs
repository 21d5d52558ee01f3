//! The backfill's servers in the simulation: `outbox_relay::backfill::BackfillServers` over the
//! simulated Postgres and JetStream, so that the real `backfill_over` (the slot decision, the
//! marker, the publish loop through the real sink, the stop) runs in a world where the operator
//! stops it with SIGTERM or kills it at any point (`world.rs`, the backfill episode).
//!
//! What the simulated Postgres answers: setup finds the slot as it is; `pg_drop_replication_slot`
//! drops it unless a walsender holds it; the slot is created with its exported snapshot after a
//! moment (Postgres waits there for running transactions), unless `pg_cancel_backend` came first
//! or the backfill's task was dropped (killed); the snapshot lives until its replication connection
//! closes; its rows are the outbox rows committed before the consistent point, fetched 1,000 at a
//! time as the real cursor does. Every query text is taken as the default `--where` and
//! `--order-by` (the simulation never passes others). Table rows are never deleted here: retention
//! of the outbox table is not modelled.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use futures_util::future::BoxFuture;
use outbox_relay::Lsn;
use outbox_relay::backfill::{
    BackfillError, BackfillServers, BoxError, Control, CursorError, DropFailure, Prepared,
    QueryError, SlotMaker,
};
use outbox_relay::nats::NatsPort;
use outbox_relay::pgoutput::Column;
use outbox_relay::setup::SetupError;
use outbox_relay::source::{ServerError, SourceError, SystemInfo};
use tokio::time::Instant;

use super::jetstream::JetStream;
use super::port::ProcessPort;
use super::postgres::Postgres;
use super::rng::Dice;

/// A snapshot's rows: each column's text, `None` for NULL.
pub(crate) type Rows = Vec<Vec<Option<Bytes>>>;

/// The simulated Postgres's record of backfills.
#[derive(Default)]
pub(crate) struct PgBackfill {
    /// Walsenders of backfills so far (their pids).
    pub walsenders: i32,
    /// Walsenders whose command `pg_cancel_backend` cancelled.
    pub cancelled: BTreeSet<i32>,
    /// Exported snapshots whose connection is open: their rows.
    pub snapshots: HashMap<String, Rows>,
    /// Slots created so far.
    pub slots: u32,
    /// Logical messages of the history before a backfill's new slot that the stream lacked when
    /// it was created, and when: never sent again.
    pub left_behind: Vec<(String, Instant)>,
}

/// The process numbers of backfills start here (relay processes count from 1): the checks tell
/// a backfill's publishes by it.
pub(crate) const BACKFILL_PROCESS: u64 = 1_000_000;

/// One run of `outbox-relay backfill`'s servers.
pub(crate) struct SimBackfill {
    pub pg: Arc<Postgres>,
    pub js: Arc<JetStream>,
    pub dice: Dice,
    /// Its process number (from [`BACKFILL_PROCESS`]).
    pub process: u64,
}

impl BackfillServers for SimBackfill {
    fn prepare(&mut self) -> BoxFuture<'_, Result<Prepared, SetupError>> {
        Box::pin(async move {
            tokio::time::sleep(self.dice.millis(0, 20)).await;
            Ok(Prepared::found(self.pg.slot_found()))
        })
    }

    fn undo(&mut self) -> BoxFuture<'_, ()> {
        Box::pin(async {})
    }

    fn control(&mut self) -> BoxFuture<'_, Result<Box<dyn Control>, SourceError>> {
        Box::pin(async move {
            Ok(Box::new(SimControl {
                pg: Arc::clone(&self.pg),
                dice: self.dice.clone(),
                cursor: Mutex::default(),
            }) as Box<dyn Control>)
        })
    }

    fn nats(&mut self) -> BoxFuture<'_, Result<NatsPort, BackfillError>> {
        Box::pin(async move {
            Ok(NatsPort::new(ProcessPort {
                js: Arc::clone(&self.js),
                process: self.process,
            }))
        })
    }

    fn now_micros(&self) -> i64 {
        self.pg.pg_now()
    }

    fn replication(&mut self) -> BoxFuture<'_, Result<Box<dyn SlotMaker>, SourceError>> {
        Box::pin(async move {
            Ok(Box::new(SimSlotMaker {
                pg: Arc::clone(&self.pg),
                dice: self.dice.clone(),
                pid: self.pg.backfill_walsender(),
                snapshot: None,
            }) as Box<dyn SlotMaker>)
        })
    }
}

/// The control connection: the snapshot's transaction and its cursor.
struct SimControl {
    pg: Arc<Postgres>,
    dice: Dice,
    /// The imported snapshot's rows, and how many the cursor has fetched.
    cursor: Mutex<Option<(Rows, usize)>>,
}

/// A server error as the real client's `Display` shows one.
#[derive(Debug, thiserror::Error)]
#[error("db error: ERROR: {0}")]
struct DbError(String);

impl Control for SimControl {
    fn preflight(&self, _: String) -> BoxFuture<'_, Result<(), QueryError>> {
        Box::pin(async { Ok(()) })
    }

    fn drop_slot(&self, _: String) -> BoxFuture<'_, Result<(), BoxError>> {
        Box::pin(async move {
            self.pg
                .drop_slot("the backfill (to replace it)", false)
                .map_err(|(_, m)| Box::new(DbError(m)) as BoxError)
        })
    }

    fn cancel_backend(&self, pid: i32) -> BoxFuture<'_, Result<(), QueryError>> {
        Box::pin(async move {
            self.pg.cancel_backend(pid);
            Ok(())
        })
    }

    fn rollback(&self) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            *self.cursor.lock().unwrap() = None;
        })
    }

    fn drop_slot_if_exists(&self, _: String) -> BoxFuture<'_, Result<(), DropFailure>> {
        Box::pin(async move {
            self.pg
                .drop_slot("the stopped backfill", true)
                .map_err(|(in_use, message)| DropFailure {
                    in_use,
                    message: QueryError(message),
                })
        })
    }

    fn import_snapshot(&self, snapshot: String) -> BoxFuture<'_, Result<(), QueryError>> {
        Box::pin(async move {
            let rows = self.pg.snapshot_rows(&snapshot).ok_or_else(|| {
                QueryError(format!(
                    "invalid snapshot identifier: \"{snapshot}\" (22023)"
                ))
            })?;
            *self.cursor.lock().unwrap() = Some((rows, 0));
            Ok(())
        })
    }

    fn columns(&self, _: String) -> BoxFuture<'_, Result<Vec<Column>, QueryError>> {
        Box::pin(async { Ok(Postgres::outbox_columns()) })
    }

    fn count(&self, _: String) -> BoxFuture<'_, Result<i64, QueryError>> {
        Box::pin(async move {
            let c = self.cursor.lock().unwrap();
            let (rows, _) = c
                .as_ref()
                .ok_or_else(|| QueryError("no transaction".to_owned()))?;
            Ok(rows.len() as i64)
        })
    }

    fn declare_cursor(&self, _: String, _: String) -> BoxFuture<'_, Result<(), CursorError>> {
        Box::pin(async move {
            match self.cursor.lock().unwrap().as_mut() {
                Some((_, at)) => {
                    *at = 0;
                    Ok(())
                }
                None => Err(CursorError::Declare(QueryError("no transaction".into()))),
            }
        })
    }

    fn fetch(&self) -> BoxFuture<'_, Result<Vec<Vec<Option<Bytes>>>, QueryError>> {
        Box::pin(async move {
            // A round trip: the publish loop's acks come in meanwhile.
            tokio::time::sleep(self.dice.millis(0, 5)).await;
            let mut c = self.cursor.lock().unwrap();
            let (rows, at) = c.as_mut().ok_or_else(|| {
                QueryError("cursor \"outbox_relay_backfill\" does not exist".to_owned())
            })?;
            let end = (*at + 1000).min(rows.len());
            let batch = rows[*at..end].to_vec();
            *at = end;
            Ok(batch)
        })
    }

    fn commit(&self) -> BoxFuture<'_, Result<(), QueryError>> {
        Box::pin(async move {
            *self.cursor.lock().unwrap() = None;
            Ok(())
        })
    }

    fn drop_stop_mark(&self) -> BoxFuture<'_, Result<(), QueryError>> {
        Box::pin(async move {
            self.pg.drop_mark("the backfill");
            Ok(())
        })
    }
}

/// The replication connection the backfill creates its slot on.
struct SimSlotMaker {
    pg: Arc<Postgres>,
    dice: Dice,
    pid: i32,
    /// The snapshot it exported, released when it closes.
    snapshot: Option<String>,
}

impl SlotMaker for SimSlotMaker {
    fn identify_system(&mut self) -> BoxFuture<'_, Option<SystemInfo>> {
        Box::pin(async move { Some(self.pg.system_info()) })
    }

    fn backend_pid(&self) -> i32 {
        self.pid
    }

    fn create_slot_with_snapshot(
        &mut self,
        _: String,
        _: bool,
    ) -> BoxFuture<'_, Result<(Lsn, String), SourceError>> {
        Box::pin(async move {
            // Postgres waits for the transactions that were running; dropped meanwhile (the
            // process killed), it creates nothing.
            tokio::time::sleep(self.dice.millis(0, 1_500)).await;
            let (lsn, name) =
                self.pg
                    .create_backfill_slot(self.pid)
                    .map_err(|message| SourceError::Server {
                        context: "CREATE_REPLICATION_SLOT",
                        error: Box::new(ServerError {
                            severity: "ERROR".into(),
                            code: "XX000".into(),
                            message,
                            detail: None,
                            hint: None,
                        }),
                    })?;
            self.snapshot = Some(name.clone());
            Ok((lsn, name))
        })
    }

    fn close(self: Box<Self>) -> BoxFuture<'static, ()> {
        Box::pin(async move {
            if let Some(name) = &self.snapshot {
                self.pg.release_snapshot(name);
            }
        })
    }
}

/// How long the operator waits before a signal or a kill, at most.
pub(crate) const INTERRUPT_WITHIN: Duration = Duration::from_millis(3_000);
