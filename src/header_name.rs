//! Which names an event's own headers may have (a headers column, `outbox.header_columns`, a
//! logical message's `headers`, a trace context message): the one rule both the configuration
//! and the outbox stage check. A leaf: it imports nothing of the crate.

/// Why a name cannot be an event's own header.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum NameProblem {
    /// Not a header name at all.
    #[error("{0:?} is not a valid header name")]
    Invalid(String),
    /// One of the relay's own.
    #[error("{0:?} is reserved (Nats-*/Outbox-* headers are set by the relay)")]
    Reserved(String),
    /// One of the CloudEvents binding's, with `nats.cloudevents` on.
    #[error(
        "{0:?} is reserved while nats.cloudevents is on (ce-* and Content-Type belong to the CloudEvents binding)"
    )]
    CloudEvents(String),
}

/// Whether `name` may be an event's own header: a valid header name that is not one the relay
/// sets. `Nats-*` and `Outbox-*` are always the relay's; with CloudEvents on, so are `ce-*` and
/// `Content-Type` (which would turn the message into a structured-mode CloudEvent for a consumer).
pub(crate) fn check(name: &str, cloudevents: bool) -> Result<(), NameProblem> {
    if name.is_empty()
        || name
            .chars()
            .any(|c| c == ':' || c.is_whitespace() || c.is_control() || !c.is_ascii())
    {
        return Err(NameProblem::Invalid(name.to_owned()));
    }
    let lower = name.to_ascii_lowercase();
    if lower.starts_with("nats-") || lower.starts_with("outbox-") {
        return Err(NameProblem::Reserved(name.to_owned()));
    }
    if cloudevents && (lower.starts_with("ce-") || lower == "content-type") {
        return Err(NameProblem::CloudEvents(name.to_owned()));
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
