//! The production [`BackfillServers`]: setup over real connections, the control connection as a
//! tokio-postgres client, the slot created over the relay's replication protocol, NATS through the
//! async-nats client. Every statement is the one the backfill always sent.

use std::sync::Mutex;

use bytes::Bytes;
use futures_util::TryStreamExt;
use futures_util::future::BoxFuture;
use tokio_postgres::{Client, Statement};

use super::BackfillError;
use super::port::{
    BackfillServers, BoxError, Control, CursorError, DropFailure, Prepared, QueryError, SlotMaker,
};
use crate::Lsn;
use crate::catalog;
use crate::config::Settings;
use crate::nats::NatsPort;
use crate::pgoutput::Column;
use crate::setup::{self, SetupError};
use crate::source::{ReplConnection, SourceError, SystemInfo, query_error_text};

/// The servers `settings` name.
pub(crate) struct Servers<'a> {
    settings: &'a Settings,
    /// What setup created, for [`BackfillServers::undo`].
    prepared: Option<setup::Prepared>,
}

impl<'a> Servers<'a> {
    pub(crate) fn new(settings: &'a Settings) -> Self {
        Servers {
            settings,
            prepared: None,
        }
    }
}

impl BackfillServers for Servers<'_> {
    fn prepare(&mut self) -> BoxFuture<'_, Result<Prepared, SetupError>> {
        Box::pin(async move {
            let p = setup::prepare_without_slot(self.settings).await?;
            let found = Prepared {
                lines: p.report.lines.clone(),
                warnings: p.report.warnings.clone(),
                slot: p.slot.clone(),
            };
            self.prepared = Some(p);
            Ok(found)
        })
    }

    fn undo(&mut self) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            if let Some(p) = &self.prepared {
                p.undo(self.settings).await;
            }
        })
    }

    fn control(&mut self) -> BoxFuture<'_, Result<Box<dyn Control>, SourceError>> {
        Box::pin(async move {
            let client = catalog::connect(self.settings, "backfill").await?;
            Ok(Box::new(PgControl {
                client,
                settings: self.settings.clone(),
                fetch: Mutex::new(None),
            }) as Box<dyn Control>)
        })
    }

    fn nats(&mut self) -> BoxFuture<'_, Result<NatsPort, BackfillError>> {
        Box::pin(async move {
            Ok(NatsPort::from(
                crate::nats::connect_nats(self.settings).await?,
            ))
        })
    }

    fn replication(&mut self) -> BoxFuture<'_, Result<Box<dyn SlotMaker>, SourceError>> {
        Box::pin(async move {
            let repl =
                ReplConnection::connect(&self.settings.conn, "outbox-relay backfill").await?;
            Ok(Box::new(repl) as Box<dyn SlotMaker>)
        })
    }
}

/// The control connection.
struct PgControl {
    client: Client,
    settings: Settings,
    /// The cursor's prepared `FETCH`.
    fetch: Mutex<Option<Statement>>,
}

impl Control for PgControl {
    fn preflight(&self, query: String) -> BoxFuture<'_, Result<(), QueryError>> {
        Box::pin(async move {
            let pg = &self.client;
            let checked = async {
                pg.batch_execute("BEGIN READ ONLY").await?;
                // execute, not batch_execute: the extended protocol refuses a second statement.
                let r = pg.execute(&query, &[]).await;
                pg.batch_execute("ROLLBACK").await?;
                r
            };
            checked.await.map(|_| ()).map_err(|e| query_failed(&e))
        })
    }

    fn drop_slot(&self, slot: String) -> BoxFuture<'_, Result<(), BoxError>> {
        Box::pin(async move {
            self.client
                .execute("SELECT pg_drop_replication_slot($1)", &[&slot])
                .await
                .map(|_| ())
                .map_err(|e| Box::new(e) as BoxError)
        })
    }

    fn cancel_backend(&self, pid: i32) -> BoxFuture<'_, Result<(), QueryError>> {
        Box::pin(async move {
            self.client
                .execute("SELECT pg_cancel_backend($1)", &[&pid])
                .await
                .map(|_| ())
                .map_err(|e| query_failed(&e))
        })
    }

    fn rollback(&self) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            let _ = self.client.batch_execute("ROLLBACK").await;
        })
    }

    fn drop_slot_if_exists(&self, slot: String) -> BoxFuture<'_, Result<(), DropFailure>> {
        Box::pin(async move {
            self.client
                .execute(
                    "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = $1",
                    &[&slot],
                )
                .await
                .map(|_| ())
                .map_err(|e| DropFailure {
                    in_use: e.code() == Some(&tokio_postgres::error::SqlState::OBJECT_IN_USE),
                    message: query_failed(&e),
                })
        })
    }

    fn import_snapshot(&self, snapshot: String) -> BoxFuture<'_, Result<(), QueryError>> {
        Box::pin(async move {
            // The snapshot name comes from the server; quoted all the same.
            self.client
                .batch_execute(&format!(
                    "BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY; SET TRANSACTION SNAPSHOT '{}'; \
                     SET LOCAL bytea_output = 'hex'",
                    snapshot.replace('\'', "''")
                ))
                .await
                .map_err(|e| query_failed(&e))
        })
    }

    fn columns(&self, qualified: String) -> BoxFuture<'_, Result<Vec<Column>, QueryError>> {
        Box::pin(async move {
            Ok(self
                .client
                .query(
                    "SELECT a.attname::text, a.atttypid, a.atttypmod FROM pg_attribute a \
                     WHERE a.attrelid = $1::text::regclass AND a.attnum > 0 AND NOT a.attisdropped AND a.attgenerated = '' \
                     ORDER BY a.attnum",
                    &[&qualified],
                )
                .await
                .map_err(|e| query_failed(&e))?
                .iter()
                .map(|r| Column {
                    flags: 0,
                    name: r.get(0),
                    type_oid: r.get(1),
                    type_modifier: r.get(2),
                })
                .collect())
        })
    }

    fn count(&self, query: String) -> BoxFuture<'_, Result<i64, QueryError>> {
        Box::pin(async move {
            self.client
                .query_one(&query, &[])
                .await
                .map(|r| r.get(0))
                .map_err(|e| query_failed(&e))
        })
    }

    fn declare_cursor(
        &self,
        declare: String,
        fetch: String,
    ) -> BoxFuture<'_, Result<(), CursorError>> {
        Box::pin(async move {
            // execute, not batch_execute: the extended protocol refuses a second statement.
            self.client
                .execute(&declare, &[])
                .await
                .map_err(|e| CursorError::Declare(query_failed(&e)))?;
            let statement = self
                .client
                .prepare(&fetch)
                .await
                .map_err(|e| CursorError::Fetch(query_failed(&e)))?;
            *self.fetch.lock().unwrap_or_else(|p| p.into_inner()) = Some(statement);
            Ok(())
        })
    }

    fn fetch(&self) -> BoxFuture<'_, Result<Vec<Vec<Option<Bytes>>>, QueryError>> {
        Box::pin(async move {
            let statement = self
                .fetch
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .clone()
                .ok_or_else(|| QueryError("no cursor declared".to_owned()))?;
            let rows = self
                .client
                .query_raw(&statement, std::iter::empty::<i32>())
                .await
                .map_err(|e| query_failed(&e))?;
            tokio::pin!(rows);
            let mut out = Vec::new();
            while let Some(row) = rows.try_next().await.map_err(|e| query_failed(&e))? {
                out.push(
                    (0..row.len())
                        .map(|i| {
                            row.get::<_, Option<&str>>(i)
                                .map(|v| Bytes::copy_from_slice(v.as_bytes()))
                        })
                        .collect(),
                );
            }
            Ok(out)
        })
    }

    fn commit(&self) -> BoxFuture<'_, Result<(), QueryError>> {
        Box::pin(async move {
            self.client
                .batch_execute("COMMIT")
                .await
                .map_err(|e| query_failed(&e))
        })
    }

    fn drop_stop_mark(&self) -> BoxFuture<'_, Result<(), QueryError>> {
        Box::pin(async move {
            crate::slot_mark::drop_mark(&self.settings, &self.client)
                .await
                .map_err(|e| query_failed(&e))
        })
    }
}

impl SlotMaker for ReplConnection {
    fn identify_system(&mut self) -> BoxFuture<'_, Option<SystemInfo>> {
        Box::pin(async move { ReplConnection::identify_system(self).await.ok() })
    }

    fn backend_pid(&self) -> i32 {
        ReplConnection::backend_pid(self)
    }

    fn create_slot_with_snapshot(
        &mut self,
        slot: String,
        failover: bool,
    ) -> BoxFuture<'_, Result<(Lsn, String), SourceError>> {
        Box::pin(
            async move { ReplConnection::create_slot_with_snapshot(self, &slot, failover).await },
        )
    }

    fn close(self: Box<Self>) -> BoxFuture<'static, ()> {
        Box::pin(async move { ReplConnection::close(*self).await })
    }
}

/// A failed statement on the control connection as the backfill's [`QueryError`].
fn query_failed(e: &tokio_postgres::Error) -> QueryError {
    QueryError(query_error_text(e))
}
