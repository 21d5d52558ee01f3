//! Which of sql/09_requeue.sql's functions to call: the one installed for this relay's control
//! prefix, found in the catalog by its name, its argument types and the prefix its body emits (the
//! script writes that literal with `format('%L')`), in whatever schema it was created. The call
//! then names it schema-qualified, so no caller's `search_path` can put another function of that
//! name in its place.

use tokio_postgres::Client;

use super::error::RequeueError;
use crate::source::query_error_text;
use crate::text::shown;

/// One of the three release functions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Function {
    /// `outbox_requeue(aggregate_type, aggregate_id)`.
    Requeue,
    /// `outbox_discard(aggregate_type, aggregate_id)`.
    Discard,
    /// `outbox_requeue_event(event_id)`.
    RequeueEvent,
}

impl Function {
    /// Its name and argument types, as an operator would write them.
    pub(super) fn signature(self) -> &'static str {
        match self {
            Function::Requeue => "outbox_requeue(text, text)",
            Function::Discard => "outbox_discard(text, text)",
            Function::RequeueEvent => "outbox_requeue_event(text)",
        }
    }

    fn name(self) -> &'static str {
        self.signature().split('(').next().unwrap_or_default()
    }

    /// `pg_proc.proargtypes` as text (25 is `text`).
    fn argtypes(self) -> &'static str {
        match self {
            Function::Requeue | Function::Discard => "25 25",
            Function::RequeueEvent => "25",
        }
    }
}

/// The schema-qualified name of `function` as installed for `prefix`, quoted for SQL.
pub(super) async fn installed(
    pg: &Client,
    function: Function,
    prefix: &str,
) -> Result<String, RequeueError> {
    // `format('%L')` doubles a quote inside the literal: undo that to get the prefix as emitted.
    let rows = pg
        .query(
            "SELECT quote_ident(n.nspname) || '.' || quote_ident(p.proname), \
                    replace(substring(p.prosrc FROM $re$pg_logical_emit_message\\(\\s*true\\s*,\\s*'((?:[^']|'')*)'$re$), \
                            '''''', '''') \
             FROM pg_catalog.pg_proc p JOIN pg_catalog.pg_namespace n ON n.oid = p.pronamespace \
             WHERE p.proname = $1 AND p.proargtypes::text = $2 \
             ORDER BY 1",
            &[&function.name(), &function.argtypes()],
        )
        .await
        .map_err(|e| RequeueError::Query {
            function: function.signature(),
            error: query_error_text(&e),
        })?;
    let found: Vec<(String, Option<String>)> = rows.iter().map(|r| (r.get(0), r.get(1))).collect();
    let mine: Vec<&String> = found
        .iter()
        .filter(|(_, p)| p.as_deref() == Some(prefix))
        .map(|(name, _)| name)
        .collect();
    match mine.as_slice() {
        [one] => Ok((*one).clone()),
        [] if found.is_empty() => Err(RequeueError::NotInstalled {
            function: function.signature(),
        }),
        [] => Err(RequeueError::OtherPrefix {
            function: function.signature(),
            found: found
                .iter()
                .map(|(name, p)| {
                    let p = p.as_deref().unwrap_or("no prefix");
                    format!("{} ({})", shown(name, 200), shown(p, 200))
                })
                .collect::<Vec<_>>()
                .join(", "),
            prefix: prefix.to_owned(),
        }),
        several => Err(RequeueError::Ambiguous {
            function: function.signature(),
            found: several
                .iter()
                .map(|s| shown(s, 200))
                .collect::<Vec<_>>()
                .join(", "),
            prefix: prefix.to_owned(),
        }),
    }
}

/// The logical message prefix of the control messages the relay named `name` reads:
/// `outbox-relay.control`, or `outbox-relay.control.<name>` for a relay with a name.
pub(super) fn control_prefix(name: &str) -> String {
    if name.is_empty() {
        "outbox-relay.control".to_owned()
    } else {
        format!("outbox-relay.control.{name}")
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_relays_name_extends_the_control_prefix() {
        assert_eq!(super::control_prefix(""), "outbox-relay.control");
        assert_eq!(
            super::control_prefix("orders"),
            "outbox-relay.control.orders"
        );
    }
}
