//! The real [`PeekPort`]: `pg_logical_slot_peek_binary_changes` on a control connection, with the
//! relay's own pgoutput options, rows read one at a time (memory stays small whatever their size),
//! the look's time bound as the session's `statement_timeout`, and a slot busy with another
//! backend's peek waited for rather than reported.

use std::time::Duration;

use bytes::Bytes;
use futures_util::StreamExt;
use tokio::time::Instant;
use tokio_postgres::Client;

use super::port::{Bound, PeekFailed, PeekPort, Rows};
use crate::Lsn;
use crate::config::Settings;

/// Peeks of one slot (or a copy or a mark of it) over `pg`.
pub(crate) struct SlotPeek<'a> {
    settings: &'a Settings,
    pg: &'a Client,
    slot: String,
    bound: Bound,
    /// Until when a busy slot is waited for (set by `begin`).
    deadline: Instant,
}

impl<'a> SlotPeek<'a> {
    /// Peeks of `slot`, which the caller must not need to stay unacquired: a copy or a mark.
    pub(crate) fn new(settings: &'a Settings, pg: &'a Client, slot: impl Into<String>) -> Self {
        SlotPeek {
            settings,
            pg,
            slot: slot.into(),
            bound: Bound::DEFAULT,
            deadline: Instant::now(),
        }
    }

    /// One query of the peek; `handed` says whether any row went to `rows`.
    async fn query(
        &self,
        upto: Option<Lsn>,
        changes: u32,
        rows: Rows<'_, '_>,
        handed: &mut bool,
    ) -> Result<(), tokio_postgres::Error> {
        // Logical messages are only decoded when asked for, as the relay asks.
        let outbox = &self.settings.config().outbox;
        let messages = if outbox.message_prefix.is_empty() && outbox.context_prefix.is_empty() {
            "false"
        } else {
            "true"
        };
        let upto = upto.map(|l| l.to_string());
        let changes = i32::try_from(changes).unwrap_or(i32::MAX);
        let publication = self.settings.config().postgres.publication.clone();
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 5] =
            [&self.slot, &upto, &changes, &publication, &messages];
        let stream = self
            .pg
            .query_raw(
                "SELECT lsn::text, data FROM pg_logical_slot_peek_binary_changes($1, $2::text::pg_lsn, $3, \
                 'proto_version', '1', 'publication_names', $4, 'messages', $5)",
                params,
            )
            .await?;
        tokio::pin!(stream);
        while let Some(row) = stream.next().await {
            let row = row?;
            let lsn = row.get::<_, String>(0).parse::<Lsn>().unwrap_or(Lsn::ZERO);
            *handed = true;
            if rows(lsn, Bytes::from(row.get::<_, Vec<u8>>(1))).is_break() {
                break;
            }
        }
        Ok(())
    }
}

impl PeekPort for SlotPeek<'_> {
    type Error = tokio_postgres::Error;

    async fn begin(&mut self, bound: Bound) -> Result<Vec<u32>, tokio_postgres::Error> {
        let partitions = match self.settings.config().outbox.table.as_str() {
            "" => Vec::new(),
            table => crate::catalog::partitions(self.pg, table).await?,
        };
        self.pg
            .batch_execute(&format!(
                "SET statement_timeout = {}",
                bound.timeout.as_millis()
            ))
            .await?;
        self.bound = bound;
        // A slot can be peeked by one backend at a time: a mark that `status` and a starting relay
        // look at together is busy for one of them for as long as the other's look takes (at most
        // the bound). Wait for it rather than report "unknown".
        self.deadline = Instant::now() + bound.timeout + Duration::from_secs(2);
        Ok(partitions)
    }

    async fn peek(
        &mut self,
        upto: Option<Lsn>,
        changes: u32,
        rows: Rows<'_, '_>,
    ) -> Result<(), PeekFailed> {
        loop {
            // The server decodes the whole look before it sends the first row, so a busy slot is
            // refused before any row was handed: trying again hands nothing twice.
            let mut handed = false;
            match self.query(upto, changes, &mut *rows, &mut handed).await {
                Err(e) if !handed && in_use(&e) && Instant::now() < self.deadline => {
                    tokio::time::sleep(Duration::from_millis(250)).await;
                }
                Err(e) => return Err(PeekFailed(server_words(&e, self.bound))),
                Ok(()) => return Ok(()),
            }
        }
    }

    async fn end(&mut self) {
        let _ = self.pg.batch_execute("RESET statement_timeout").await;
    }
}

/// The slot is held by another backend (SQLSTATE 55006, "replication slot … is active for PID …").
pub(crate) fn in_use(e: &tokio_postgres::Error) -> bool {
    e.code() == Some(&tokio_postgres::error::SqlState::OBJECT_IN_USE)
}

/// The server's reason, in words a problem line can carry.
fn server_words(e: &tokio_postgres::Error, bound: Bound) -> String {
    match e.as_db_error() {
        Some(d) if d.code() == &tokio_postgres::error::SqlState::QUERY_CANCELED => format!(
            "decoding the pending WAL took longer than {} s",
            bound.timeout.as_secs()
        ),
        Some(d) => d.message().to_owned(),
        None => e.to_string(),
    }
}
