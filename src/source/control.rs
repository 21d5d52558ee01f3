//! The control connection: ordinary SQL through tokio-postgres (slot and publication checks, status
//! queries), with the same connection string, host order, `target_session_attrs`, TLS rules,
//! `channel_binding` and `require_auth` as the replication connection.

use tokio_postgres::Client;
use tracing::debug;

use super::auth_error::AuthError;
use super::auth_guard::{GaveUp, GuardedConnect, Seen};
use super::conninfo::{ConnInfo, SslMode};
use super::error::{ServerError, SourceError};
use super::hosts::{self, ServerRole};
use super::socket::PgStream;
use super::tls;

/// Connects to the first acceptable host and spawns the connection task. The task ends when the
/// client is dropped.
pub async fn connect_control(
    info: &ConnInfo,
    application_name: &str,
) -> Result<Client, SourceError> {
    hosts::connect_first(info, |target| async move {
        let client = connect_one(&target, application_name).await?;
        let row = client
            .query_one(
                "SELECT pg_is_in_recovery(), current_setting('transaction_read_only') = 'on'",
                &[],
            )
            .await
            .map_err(|e| map_error(&format!("{}:{}", target.host, target.port), e, None))?;
        let role = ServerRole {
            in_recovery: row.get(0),
            read_only: row.get(1),
        };
        Ok((client, role))
    })
    .await
}

async fn connect_one(info: &ConnInfo, application_name: &str) -> Result<Client, SourceError> {
    let mut config = info.tokio_postgres_config(application_name);
    let addr = format!("{}:{}", info.host, info.port);
    let tcp = tokio::time::timeout(
        info.connect_timeout,
        PgStream::connect(&info.host, info.port),
    )
    .await
    .map_err(|_| SourceError::Timeout {
        target: addr.clone(),
        secs: info.connect_timeout.as_secs(),
    })?
    .map_err(|error| SourceError::Io {
        target: addr.clone(),
        error,
    })?;
    let tls_config = match tcp.supports_tls() {
        true => tls::client_config_off_runtime(info)
            .await
            .map_err(|e| SourceError::Tls(e.to_string()))?,
        false => {
            config.ssl_mode(tokio_postgres::config::SslMode::Disable);
            None
        }
    };
    // The guard watches the server's authentication requests on the wire (below tokio-postgres,
    // which would answer a cleartext request with the password whatever require_auth says).
    let connect = async {
        match tls_config {
            None => {
                let guard = GuardedConnect::new(tokio_postgres::NoTls, info);
                let seen = guard.seen();
                start(&config, guard.wrap_raw(tcp), guard, &seen, &addr).await
            }
            Some(tls_config) => {
                debug_assert_ne!(info.sslmode, SslMode::Disable);
                let mut rustls =
                    tokio_postgres_rustls::MakeRustlsConnect::new((*tls_config).clone());
                let tls = tokio_postgres::tls::MakeTlsConnect::<
                    super::auth_guard::Guarded<PgStream>,
                >::make_tls_connect(&mut rustls, &info.host)
                .map_err(|e| SourceError::Tls(e.to_string()))?;
                let guard = GuardedConnect::new(tls, info);
                let seen = guard.seen();
                start(&config, guard.wrap_raw(tcp), guard, &seen, &addr).await
            }
        }
    };
    tokio::time::timeout(info.connect_timeout, connect)
        .await
        .map_err(|_| SourceError::Timeout {
            target: addr,
            secs: info.connect_timeout.as_secs(),
        })?
}

/// Connects over `stream` with `tls` and spawns the connection task (it ends when the client is
/// dropped). `seen` is what the guards saw, to tell why a failed login failed.
async fn start<T>(
    config: &tokio_postgres::Config,
    stream: super::auth_guard::Guarded<PgStream>,
    tls: T,
    seen: &Seen,
    addr: &str,
) -> Result<Client, SourceError>
where
    T: tokio_postgres::tls::TlsConnect<super::auth_guard::Guarded<PgStream>>,
    T::Stream: Send + 'static,
{
    let (client, conn) = config
        .connect_raw(stream, tls)
        .await
        .map_err(|e| map_error(addr, e, Some(seen)))?;
    tokio::spawn(async move {
        if let Err(e) = conn.await {
            debug!(error = %e, "control connection ended");
        }
    });
    Ok(client)
}

/// A failed query on the control connection, on one line: the server's message and SQLSTATE
/// (`relation "x" does not exist (42P01)`; its DETAIL and HINT lines are left out), or the
/// client's error with its causes.
pub(crate) fn query_error_text(e: &tokio_postgres::Error) -> String {
    match e.as_db_error() {
        Some(db) => format!("{} ({})", db.message(), db.code().code()),
        None => crate::error_chain::error_chain(e),
    }
}

/// A tokio-postgres error as a source error: the server's own error with its SQLSTATE, a refused
/// authentication as such, the OS cause of a failed connection kept. `seen` (during a login) is what
/// the server asked for: tokio-postgres' error tells why it gave up only in its text.
fn map_error(addr: &str, e: tokio_postgres::Error, seen: Option<&Seen>) -> SourceError {
    if let Some(db) = e.as_db_error() {
        return SourceError::Server {
            context: "connect",
            error: Box::new(ServerError {
                severity: db.severity().to_owned(),
                code: db.code().code().to_owned(),
                message: db.message().to_owned(),
                detail: db.detail().map(str::to_owned),
                hint: db.hint().map(str::to_owned),
            }),
        };
    }
    // The guard's refusal (require_auth, or channel_binding=require refusing a method).
    if let Some(guard) = super::auth_guard::refusal(&e) {
        return SourceError::Auth(guard.into());
    }
    let text = crate::error_chain::error_chain(&e);
    // TLS refused or failed (`sslmode=require` against a server without TLS, a certificate that does
    // not verify): a setting to fix, not a server to wait for. tokio-postgres has no public error
    // kind, but its TLS errors, and only those, say this of themselves; their cause may be an I/O
    // error (the handshake's), which must not make them look like a connection problem.
    if e.to_string() == "error performing TLS handshake" {
        return SourceError::Tls(format!("{addr}: {text}"));
    }
    let io = std::error::Error::source(&e).and_then(|s| s.downcast_ref::<std::io::Error>());
    // Not the socket: tokio-postgres declined to answer what the server asked.
    match seen.and_then(Seen::gave_up).filter(|_| io.is_none()) {
        Some(GaveUp::NoPassword) => {
            return SourceError::Auth(AuthError::NoPasswordControl);
        }
        Some(GaveUp::NoChannelBinding) => {
            return SourceError::Auth(AuthError::ServerDidNotBind(text));
        }
        None => {}
    }
    let error = match io {
        Some(io) => std::io::Error::new(io.kind(), io.to_string()),
        None => std::io::Error::other(text),
    };
    SourceError::Io {
        target: addr.to_owned(),
        error,
    }
}
