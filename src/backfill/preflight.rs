//! What a backfill tries before it changes anything, so that a mistake of the operator's making
//! (a typo in `--where`, a `;` in `--order-by`, contracts that do not load, a slot in use) leaves a
//! healthy slot as it was: the options, the control connection, the query planned against the
//! table, the NATS connection, then the slot decision, which a standing marker takes part in.

use super::port::{BackfillServers, Control, Prepared};
use super::slot::decide_slot;
use super::snapshot::snapshot_query;
use super::{BackfillError, BackfillOptions};
use crate::backfill_marker;
use crate::config::Settings;
use crate::nats::NatsPort;

/// What a backfill needs once it has decided about the slot.
pub(super) struct Ready {
    /// The control connection: the snapshot's transaction, and dropping slots.
    pub(super) control: Box<dyn Control>,
    /// The NATS connection to publish through.
    pub(super) nats: NatsPort,
    /// The existing slot is to be dropped first.
    pub(super) replace: bool,
}

/// Everything that can fail for a reason of the operator's making, tried before anything is
/// dropped or created: a typo in --where must leave a healthy slot as it was. Then the slot
/// decision, which a marker that stands for this slot takes part in.
pub(super) async fn get_ready(
    settings: &Settings,
    prepared: &Prepared,
    opts: &BackfillOptions,
    servers: &mut dyn BackfillServers,
) -> Result<Ready, BackfillError> {
    let control = servers
        .control()
        .await
        .map_err(|source| BackfillError::Postgres {
            target: settings.conn.to_string(),
            check: settings.key_source("postgres.url"),
            source,
        })?;
    let nats = preflight(settings, opts, &*control, servers).await?;
    let standing = backfill_marker::read(&*nats, &settings.config().nats.stream)
        .await?
        .filter(|m| m.guards(&settings.config().postgres.slot));
    let replace = decide_slot(settings, prepared.slot.as_ref(), opts, standing.as_ref())?;
    Ok(Ready {
        control,
        nats,
        replace,
    })
}

/// Refuses what must not reach the database: schemas that did not load, `;` in `--order-by`.
pub(super) fn check_options(
    settings: &Settings,
    opts: &BackfillOptions,
) -> Result<(), BackfillError> {
    // Rows must never go out unchecked because the contracts did not load (P8).
    settings.schemas_loaded()?;
    if let Some(o) = &opts.order_by
        && o.contains(';')
    {
        return Err(BackfillError::OrderBy(o.clone()));
    }
    Ok(())
}

/// What must work before the slot is touched: `--where` and `--order-by` planned against the table
/// (a zero-row query in a read-only transaction: a wrong column, a syntax error or a second statement
/// fails here), and a NATS connection. Returns the connection for the publishing.
async fn preflight(
    settings: &Settings,
    opts: &BackfillOptions,
    pg: &dyn Control,
    servers: &mut dyn BackfillServers,
) -> Result<NatsPort, BackfillError> {
    let table = settings.config().outbox.table.clone();
    let query = snapshot_query(settings, opts, "1");
    pg.preflight(format!("{query} LIMIT 0"))
        .await
        .map_err(|message| {
            // Permission denied names the grant: the predicate was never the problem.
            if message.0.contains("(42501)") {
                BackfillError::NoSelect {
                    table,
                    role: settings.conn.user.clone(),
                    message,
                }
            } else {
                BackfillError::Preflight {
                    table,
                    what: "--where / --order-by".to_owned(),
                    message,
                }
            }
        })?;
    servers.nats().await
}
