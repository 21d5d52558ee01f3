//! The warning `setup` and `status` give when sql/06_outbox_message.sql's helper is installed but
//! the prefix it emits is not relayed: every event written through it reaches the WAL, commits with
//! its transaction, and is published by nobody, without an error anywhere.
//!
//! The helper is recognised by what sql/06 makes, whatever `-v function_name` and `-v message_schema`
//! named it: a function outside `pg_catalog` with the helper's argument types
//! `(text, text, text, jsonb, jsonb, text)` whose body calls
//! `pg_logical_emit_message(true, '<prefix>', …)`. The prefix is read from that literal in its body (the
//! script writes it there with `format('%L')`), so a helper made for another prefix is compared with
//! that prefix, not with sql/06's default.

use tokio_postgres::Client;

use crate::config::Settings;
use crate::warning::Warning;

/// One line per installed helper whose prefix this relay's `outbox.message_prefix` does not relay.
pub(crate) async fn unrelayed_helpers(
    settings: &Settings,
    pg: &Client,
) -> Result<Vec<Warning>, tokio_postgres::Error> {
    // `format('%L')` doubles a quote inside the literal: undo that to get the prefix as emitted.
    let rows = pg
        .query(
            "SELECT p.oid::regprocedure::text, \
                    replace(substring(p.prosrc FROM $re$pg_logical_emit_message\\(\\s*true\\s*,\\s*'((?:[^']|'')*)'$re$), \
                            '''''', '''') \
             FROM pg_catalog.pg_proc p \
             WHERE p.pronamespace <> 'pg_catalog'::regnamespace \
               AND p.prorettype = 'text'::regtype \
               AND p.proargtypes = '25 25 25 3802 3802 25'::oidvector \
               AND p.prosrc LIKE '%pg_logical_emit_message%' \
             ORDER BY 1",
            &[],
        )
        .await?;
    let relayed = &settings.config().outbox.message_prefix;
    Ok(rows
        .iter()
        .filter_map(|r| {
            let function: String = r.get(0);
            let prefix: String = r.get::<_, Option<String>>(1)?;
            (prefix != *relayed).then(|| warning(&function, &prefix, relayed))
        })
        .collect())
}

/// The warning for `function`, which emits `prefix`, while the relay relays `relayed`.
fn warning(function: &str, prefix: &str, relayed: &str) -> Warning {
    let now = if relayed.is_empty() {
        "\"\" (off)".to_owned()
    } else {
        format!("{relayed:?}")
    };
    Warning::new(
        "unrelayed-message-helper",
        format!(
            "{function} (sql/06_outbox_message.sql) writes events as logical messages with prefix {prefix:?}, \
             but outbox.message_prefix is {now}, so this relay never publishes them: set outbox.message_prefix = \
             {prefix:?} (env OUTBOX_RELAY_OUTBOX_MESSAGE_PREFIX), or, if another relay publishes them, \
             acknowledge this warning: warnings.acknowledged = [\"unrelayed-message-helper\"]"
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::warning;

    #[test]
    fn the_warning_is_one_line_naming_the_key_and_the_fix() {
        let w = warning(
            "outbox_message(text,text,text,jsonb,jsonb,text)",
            "outbox",
            "",
        )
        .text;
        assert!(!w.contains('\n'), "{w}");
        assert!(
            w.contains("outbox.message_prefix is \"\" (off)")
                && w.contains("set outbox.message_prefix = \"outbox\""),
            "{w}"
        );
        let w = warning("billing_message(…)", "billing", "outbox").text;
        assert!(
            w.contains("outbox.message_prefix is \"outbox\"") && w.contains("= \"billing\""),
            "{w}"
        );
    }
}
