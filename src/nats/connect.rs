//! The NATS connection the sink publishes through (and `setup`, `status`, `verify` and the backfill
//! read the stream with): servers, credentials and TLS from the settings, one-line typed errors that
//! tell an unreachable server from refused credentials.
//!
//! The client gets the server addresses without credentials and the credentials through its own
//! options, so neither its logs nor its errors can print a password or token.

use std::time::Duration;

use async_nats::{ConnectErrorKind, ConnectOptions};
use secrecy::ExposeSecret;

use crate::config::{NatsAuth, Settings};

/// NATS cannot be reached or refuses the relay.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// `nats.creds_file` cannot be read or used.
    #[error("nats.creds_file {path:?}: {error}")]
    Credentials {
        /// The file's path.
        path: String,
        /// Why it cannot be read or used, shown in the message (so not also a `source()`).
        error: std::io::Error,
    },
    /// A server refused the relay's credentials.
    #[error(
        "NATS at {servers} refused the relay's credentials: check nats.user/nats.password, nats.token, \
         nats.nkey_seed_file or nats.creds_file (or the credentials in nats.url)"
    )]
    Unauthorized {
        /// The servers tried, as `host:port` joined by commas.
        servers: String,
        /// The client's error.
        #[source]
        source: async_nats::ConnectError,
    },
    /// TLS to the servers failed (handshake, certificates or the TLS files).
    #[error(
        "TLS to NATS at {servers} failed: check nats.tls_ca_file, nats.tls_cert_file/tls_key_file and tls://"
    )]
    Tls {
        /// The servers tried, as `host:port` joined by commas.
        servers: String,
        /// The client's error.
        #[source]
        source: async_nats::ConnectError,
    },
    /// No server could be reached (or another connect error).
    #[error("cannot connect to NATS at {servers}: check nats.url and that nats-server runs")]
    Connect {
        /// The servers tried, as `host:port` joined by commas.
        servers: String,
        /// The client's error.
        #[source]
        source: async_nats::ConnectError,
    },
}

/// Connects to NATS with the relay's settings. Tries each server once; the relay's own restart
/// loop retries, and once connected async-nats reconnects by itself.
pub(crate) async fn connect_nats(settings: &Settings) -> Result<async_nats::Client, ConnectError> {
    let n = &settings.nats_conn;
    let servers = n
        .servers
        .iter()
        .map(|s| format!("{}:{}", s.host(), s.port()))
        .collect::<Vec<_>>()
        .join(",");
    let mut opts = ConnectOptions::new()
        .name("outbox-relay")
        .connection_timeout(Duration::from_secs(5))
        // The configured order: the first server is the one the operator expects to be used.
        .retain_servers_order()
        // JetStream answers on the inbox; a prefix of the relay's own can be kept from other clients
        // by NATS permissions (docs/operations.md, NATS permissions).
        .custom_inbox_prefix(&settings.config().nats.inbox_prefix);
    opts = match &n.auth {
        NatsAuth::None => opts,
        NatsAuth::UserPassword { user, password } => {
            opts.user_and_password(user.clone(), password.expose_secret().to_owned())
        }
        NatsAuth::Token(t) => opts.token(t.expose_secret().to_owned()),
        NatsAuth::NkeySeed(seed) => opts.nkey(seed.expose_secret().to_owned()),
        NatsAuth::CredsFile(path) => {
            opts.credentials_file(path)
                .await
                .map_err(|error| ConnectError::Credentials {
                    path: path.display().to_string(),
                    error,
                })?
        }
    };
    if let Some(ca) = &n.tls_ca_file {
        opts = opts.add_root_certificates(ca.clone());
    }
    if let Some((cert, key)) = &n.tls_client {
        opts = opts.add_client_certificate(cert.clone(), key.clone());
    }
    if n.tls_required {
        opts = opts.require_tls(true);
    }
    opts.connect(n.servers.as_slice())
        .await
        .map_err(|source| match source.kind() {
            ConnectErrorKind::AuthorizationViolation | ConnectErrorKind::Authentication => {
                ConnectError::Unauthorized { servers, source }
            }
            ConnectErrorKind::Tls => ConnectError::Tls { servers, source },
            // async-nats reports a failed handshake as I/O; the rustls error underneath says TLS.
            _ if is_tls(&source) => ConnectError::Tls { servers, source },
            _ => ConnectError::Connect { servers, source },
        })
}

/// Whether a rustls error is somewhere in `e`'s chain (also inside an `io::Error`).
fn is_tls(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cur = Some(e);
    while let Some(err) = cur {
        if err.downcast_ref::<rustls::Error>().is_some() {
            return true;
        }
        if let Some(inner) = err
            .downcast_ref::<std::io::Error>()
            .and_then(|io| io.get_ref())
            && (inner.downcast_ref::<rustls::Error>().is_some() || is_tls(inner))
        {
            return true;
        }
        cur = err.source();
    }
    false
}
