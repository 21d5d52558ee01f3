//! Which names an event's own headers may have (a headers column, `outbox.header_columns`, a
//! logical message's `headers`, a trace context message): the one rule both the configuration
//! and the outbox stage check. A leaf: it imports nothing of the crate.

/// Whether `name` may be an event's own header: a valid header name that is not one the relay
/// sets. `Nats-*` and `Outbox-*` are always the relay's; with CloudEvents on, so are `ce-*` and
/// `Content-Type` (which would turn the message into a structured-mode CloudEvent for a consumer).
pub(crate) fn check(name: &str, cloudevents: bool) -> Result<(), String> {
    if name.is_empty()
        || name
            .chars()
            .any(|c| c == ':' || c.is_whitespace() || c.is_control() || !c.is_ascii())
    {
        return Err(format!("{name:?} is not a valid header name"));
    }
    let lower = name.to_ascii_lowercase();
    if lower.starts_with("nats-") || lower.starts_with("outbox-") {
        return Err(format!(
            "{name:?} is reserved (Nats-*/Outbox-* headers are set by the relay)"
        ));
    }
    if cloudevents && (lower.starts_with("ce-") || lower == "content-type") {
        return Err(format!(
            "{name:?} is reserved while nats.cloudevents is on (ce-* and Content-Type belong to the CloudEvents binding)"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reserved_header_names() {
        assert!(check("tenant", false).is_ok());
        assert!(check("nats-msg-id", false).is_err());
        assert!(check("OUTBOX-X", false).is_err());
        assert!(check("ce-id", false).is_ok());
        assert!(check("CE-Id", true).is_err());
        assert!(check("Content-Type", true).is_err());
        assert!(check("a b", false).is_err());
    }
}
