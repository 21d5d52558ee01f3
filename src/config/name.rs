//! The top-level `name` key: one relay's names derived from one word, so that a second relay on the
//! same Postgres and NATS differs from the first by this key alone.
//!
//! `name = "orders"` derives `postgres.slot` and `postgres.publication` (`outbox_relay_orders`),
//! `nats.stream` (`OUTBOX_ORDERS`), `nats.subject` (`orders.{aggregate_type}`) and
//! `nats.dead_letter_subject` (`orders_dead_letter`): today's defaults with the name added in the same
//! place each time. The position service's prefix, `outbox-relay.<slot>`, follows the slot. A key set
//! in the file or the environment always wins: the derivation fills in only the keys the loaded table
//! lacks, before the table becomes a [`super::Config`], because afterwards an explicit value equal to a
//! default could no longer be told from an unset one. `name = ""` (the default) keeps today's names.

use super::{ConfigError, invalid};

/// The longest name: `outbox_relay_` plus the name must stay a slot name (63 bytes).
const MAX_LEN: usize = 50;

/// The (section, key, value) pairs `name` derives.
pub(super) fn derived(name: &str) -> [(&'static str, &'static str, String); 5] {
    [
        ("postgres", "slot", format!("outbox_relay_{name}")),
        ("postgres", "publication", format!("outbox_relay_{name}")),
        (
            "nats",
            "stream",
            format!("OUTBOX_{}", name.to_ascii_uppercase()),
        ),
        ("nats", "subject", format!("{name}.{{aggregate_type}}")),
        ("nats", "dead_letter_subject", format!("{name}_dead_letter")),
    ]
}

/// Fills in the keys `name` derives that `table` (the file with the environment applied) does not set.
pub(super) fn derive(table: &mut toml::Table) {
    let Some(toml::Value::String(name)) = table.get("name") else {
        return;
    };
    if name.is_empty() {
        return;
    }
    for (section, key, value) in derived(&name.clone()) {
        let section = table
            .entry(section.to_owned())
            .or_insert_with(|| toml::Value::Table(toml::Table::new()));
        // A section that is not a table is the deserialiser's error to report, naming it.
        if let toml::Value::Table(t) = section {
            t.entry(key.to_owned())
                .or_insert_with(|| toml::Value::String(value));
        }
    }
}

/// `name`: empty, or a word that is a valid slot, publication, stream and subject token once derived.
pub(super) fn check(name: &str) -> Result<(), ConfigError> {
    if name.is_empty() {
        return Ok(());
    }
    if name.len() > MAX_LEN
        || !name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
    {
        return Err(invalid(
            "name",
            format!(
                "{name:?} is not a valid relay name: use 1-{MAX_LEN} lowercase letters, digits and underscores \
                 (it becomes the slot outbox_relay_<name>, the stream OUTBOX_<NAME> and the subjects <name>.*), \
                 or \"\" for the default names"
            ),
        ));
    }
    Ok(())
}
