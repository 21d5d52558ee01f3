//! The control connection: ordinary SQL through tokio-postgres (slot and publication checks, status
//! queries), with the same URL and the same TLS rules as the replication connection.

use tokio_postgres::Client;
use tracing::debug;

use super::conninfo::{ConnInfo, SslMode};
use super::error::SourceError;
use super::tls;

/// Connects and spawns the connection task. The task ends when the client is dropped.
pub async fn connect_control(
    info: &ConnInfo,
    application_name: &str,
) -> Result<Client, SourceError> {
    let config = info.tokio_postgres_config(application_name);
    let target = format!("{}:{}", info.host, info.port);
    let map = |e: tokio_postgres::Error| match e.as_db_error() {
        Some(db) => SourceError::Server {
            context: "connect",
            error: Box::new(super::error::ServerError {
                severity: db.severity().to_owned(),
                code: db.code().code().to_owned(),
                message: db.message().to_owned(),
                detail: db.detail().map(str::to_owned),
                hint: db.hint().map(str::to_owned),
            }),
        },
        None => SourceError::Io {
            target: target.clone(),
            source: std::io::Error::other(e.to_string()),
        },
    };
    let client = match tls::client_config(info).map_err(|e| SourceError::Tls(e.to_string()))? {
        None => {
            let (client, conn) = config.connect(tokio_postgres::NoTls).await.map_err(map)?;
            tokio::spawn(async move {
                if let Err(e) = conn.await {
                    debug!(error = %e, "control connection ended");
                }
            });
            client
        }
        Some(tls_config) => {
            debug_assert_ne!(info.sslmode, SslMode::Disable);
            let tls = tokio_postgres_rustls::MakeRustlsConnect::new((*tls_config).clone());
            let (client, conn) = config.connect(tls).await.map_err(map)?;
            tokio::spawn(async move {
                if let Err(e) = conn.await {
                    debug!(error = %e, "control connection ended");
                }
            });
            client
        }
    };
    Ok(client)
}
