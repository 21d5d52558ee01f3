//! Why the span exporter cannot use its endpoint or cannot start: [`EndpointError`] is what the
//! configuration reports for a `telemetry.otlp_endpoint` it refuses, [`StartError`] what the relay
//! logs when the exporter does not start (tracing never stops the relay). Each variant prints the
//! text an operator has always read.

/// Why `telemetry.otlp_endpoint` makes no traces URL.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum EndpointError {
    /// The value does not parse as a URL.
    #[error("not a URL ({0})")]
    NotUrl(url::ParseError),
    /// The scheme is not `http`.
    #[error(
        "scheme {0:?} is not supported: use http:// (a collector or agent next to the relay; TLS to a \
         remote backend is the collector's job)"
    )]
    Scheme(String),
    /// The URL has no host.
    #[error("has no host")]
    NoHost,
    /// The URL holds a user name or a password.
    #[error("must not hold credentials (use OTEL_EXPORTER_OTLP_HEADERS)")]
    Credentials,
}

/// Why the span exporter did not start.
#[derive(Debug, thiserror::Error)]
pub(crate) enum StartError {
    /// The endpoint makes no traces URL.
    #[error(transparent)]
    Endpoint(#[from] EndpointError),
    /// The traces URL does not parse.
    #[error("telemetry.otlp_endpoint {endpoint:?}: {error}")]
    Url {
        /// The endpoint, as configured.
        endpoint: String,
        /// Why the URL does not parse.
        error: url::ParseError,
    },
    /// The HTTP client found no host in the traces URL.
    #[error("telemetry.otlp_endpoint {endpoint:?}: the endpoint has no host")]
    NoHost {
        /// The endpoint, as configured.
        endpoint: String,
    },
    /// The export thread could not be spawned.
    #[error("cannot start the span export thread: {0}")]
    Thread(std::io::Error),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_variant_prints_as_it_always_has() {
        let cases: [(StartError, &str); 7] = [
            (
                EndpointError::NotUrl(url::ParseError::RelativeUrlWithoutBase).into(),
                "not a URL (relative URL without a base)",
            ),
            (
                EndpointError::Scheme("https".into()).into(),
                "scheme \"https\" is not supported: use http:// (a collector or agent next to the relay; TLS to a remote backend is the collector's job)",
            ),
            (EndpointError::NoHost.into(), "has no host"),
            (
                EndpointError::Credentials.into(),
                "must not hold credentials (use OTEL_EXPORTER_OTLP_HEADERS)",
            ),
            (
                StartError::Url {
                    endpoint: "x".into(),
                    error: url::ParseError::EmptyHost,
                },
                "telemetry.otlp_endpoint \"x\": empty host",
            ),
            (
                StartError::NoHost {
                    endpoint: "x".into(),
                },
                "telemetry.otlp_endpoint \"x\": the endpoint has no host",
            ),
            (
                StartError::Thread(std::io::Error::other("no threads")),
                "cannot start the span export thread: no threads",
            ),
        ];
        for (e, text) in cases {
            assert_eq!(e.to_string(), text);
        }
    }
}
