//! `setup --check`: what `setup` would create or change, with every check `setup` makes and every
//! refusal it would give, and nothing created, changed or dropped. The quickstart's "run setup
//! first to see and approve what it does" needs exactly this: the same checks ([`super::checks`],
//! which only read), then a line per change `setup` would make instead of making it. A refusal is
//! the same one-line error `setup` gives; the caller exits 1 with it.

use async_nats::jetstream;

use super::{Checked, Mode, SetupError, SetupReport, checks, connect_postgres};
use crate::config::Settings;
use crate::nats::connect_nats;

/// Every check of `setup`, then what it would create or change, one line each starting with
/// `would`, counted in [`SetupReport::would_change`]. Changes nothing.
pub async fn check(settings: &Settings) -> Result<SetupReport, SetupError> {
    let pg = connect_postgres(settings).await?;
    let js = jetstream::new(connect_nats(settings).await?);
    let mut report = SetupReport::default();
    let checked = checks(settings, &pg, &js, &mut report, Mode::Setup).await?;
    plan(settings, &checked, &mut report);
    Ok(report)
}

/// The lines for what [`super::apply`] would do with `checked`, in its order.
fn plan(settings: &Settings, checked: &Checked, report: &mut SetupReport) {
    let config = settings.config();
    let mut would = |line: String| {
        report.lines.push(line);
        report.would_change += 1;
    };
    if checked.create_stream {
        would(format!(
            "stream {}: would be created ({})",
            config.nats.stream,
            super::stream::described(settings)
        ));
    }
    if checked.add_parked {
        would(super::stream::parked_change(settings));
    }
    if checked.allow_ttl {
        would(super::stream::ttl_change(settings));
    }
    if checked.found.create_publication {
        let publication = &config.postgres.publication;
        would(if config.outbox.messages_only() {
            format!("publication {publication}: would be created (no tables: messages only)")
        } else {
            format!(
                "publication {publication}: would be created (FOR TABLE {}, publish = 'insert'{}; the table's owner \
                 may create it instead with sql/02_publication.sql)",
                config.outbox.table,
                if checked.found.partitioned {
                    ", publish_via_partition_root = true"
                } else {
                    ""
                }
            )
        });
    }
    let failover = checked.found.version >= 170000 && config.postgres.failover;
    if checked.create_slot {
        would(format!(
            "slot {}: would be created (pgoutput{}), starting at the WAL position when setup runs; it keeps WAL \
             from then on",
            config.postgres.slot,
            if failover { ", failover" } else { "" }
        ));
    }
    if let Some(existing) = &checked.found.slot
        && failover
        && existing.failover == Some(false)
        && !existing.active
    {
        would(format!(
            "slot {}: would be made a failover slot",
            config.postgres.slot
        ));
    }
}
