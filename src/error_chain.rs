//! An error and its chain of sources as one line (`a: b: c`), the form every log line, `status`
//! problem and command error of the relay prints. A leaf: any layer may print an error this way
//! without importing the layer that happens to use it most.

/// [`error_chain`] as the one line a command prints last: control characters escaped and at most
/// [`MAX_LINE`] bytes (`text::shown`), since the chain may quote what a server said.
pub fn error_line(e: &dyn std::error::Error) -> String {
    crate::text::shown(&error_chain(e), MAX_LINE)
}

/// The longest error line a command prints.
pub const MAX_LINE: usize = 8192;

/// An error and its sources on one line: `a: b: c`.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let text = s.to_string();
        // The relay's errors either show their cause or return it as the source, never both; but
        // async-nats' errors do both ("{kind}: {source}"), so a text the line already ends with is
        // not written again.
        if !out.ends_with(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        source = s.source();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_chain_names_every_cause_once() {
        #[derive(Debug, thiserror::Error)]
        #[error("outer")]
        struct Outer(#[source] std::io::Error);
        let e = Outer(std::io::Error::other("connection refused"));
        assert_eq!(error_chain(&e), "outer: connection refused");
    }

    #[test]
    fn error_chain_does_not_repeat_what_async_nats_already_printed() {
        let e = async_nats::RequestError::with_source(
            async_nats::RequestErrorKind::Other,
            std::io::Error::other("broken pipe"),
        );
        assert!(e.to_string().ends_with("broken pipe"), "{e}");
        assert_eq!(error_chain(&e).matches("broken pipe").count(), 1);
    }
}
