//! An event's own headers given as a JSON object (the headers column, a logical message's
//! `"headers"`, a trace context message's content): each name checked ([`crate::header_name`]),
//! each value one line; what is wrong with them is a [`HeaderProblem`], the words the event's dead
//! letter carries.

/// Why headers given as JSON cannot be used.
#[derive(Debug, thiserror::Error)]
pub(super) enum HeaderProblem {
    /// The text does not parse.
    #[error("not JSON ({0})")]
    NotJson(serde_json::Error),
    /// It parses, to something else than an object.
    #[error("not a JSON object")]
    NotObject,
    /// A context message's content does not parse.
    #[error("content is not JSON ({0})")]
    ContentNotJson(serde_json::Error),
    /// A context message's content is something else than an object.
    #[error("content is not a JSON object")]
    ContentNotObject,
    /// A context message's content is larger than a context is kept.
    #[error(
        "content is {bytes} bytes, more than {max}: a context carries a few headers (traceparent, tracestate, \
         baggage)"
    )]
    ContentTooLarge {
        /// The content's size.
        bytes: usize,
        /// The most kept.
        max: usize,
    },
    /// A name no event header may have ([`crate::header_name::check`] says why).
    #[error("{0}")]
    Name(crate::header_name::NameProblem),
    /// A value that must be a string is not (a context message's).
    #[error("the value of {0:?} is not a string")]
    NotString(String),
    /// A value with a line break, which no header value may have.
    #[error("the value of {0:?} contains a line break")]
    LineBreak(String),
}

/// The headers column: a JSON object; string values as they are, other values as their JSON text.
/// Names must be valid header names and must not override the relay's own headers.
pub(super) fn parse_headers(
    json: &str,
    cloudevents: bool,
) -> Result<Vec<(String, String)>, HeaderProblem> {
    let value: serde_json::Value = serde_json::from_str(json).map_err(HeaderProblem::NotJson)?;
    let serde_json::Value::Object(map) = value else {
        return Err(HeaderProblem::NotObject);
    };
    let mut out = Vec::with_capacity(map.len());
    for (k, v) in map {
        crate::header_name::check(&k, cloudevents).map_err(HeaderProblem::Name)?;
        let v = match v {
            serde_json::Value::String(s) => s,
            other => other.to_string(),
        };
        if v.contains(['\r', '\n']) {
            return Err(HeaderProblem::LineBreak(k));
        }
        out.push((k, v));
    }
    Ok(out)
}
