//! The start of `run`: setup and the first NATS connection, retried while a server cannot be
//! reached, so a relay started during a deploy or a reboot waits for its servers the way a running
//! relay does, instead of exiting and using up its service manager's restart budget.
//!
//! Which failures are worth waiting for is the relay's policy (`policy.rs`, [`policy::startup`]):
//! a Postgres error is waited for when the running relay would restart on it (a refused
//! connection, a server starting up or shutting down, too many connections), not otherwise (a
//! wrong password, a missing database, TLS). For NATS, only "no server could be reached" is waited
//! for; refused credentials, TLS and an unreadable creds file are settings to fix and end `run` at
//! once. Every check setup makes on what it found (the table, the publication, the slot, the
//! stream) is definite too.
//!
//! One log line per change of state (waiting for Postgres, for NATS, reachable again), not one per
//! attempt; the attempts back off like the restart loop's (0.1 s doubling to 30 s, jittered).

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use tracing::{debug, info, warn};

use crate::config::Settings;
use crate::nats::connect_nats;
use crate::setup::{self, SetupError, SetupReport};

use super::backoff::{backoff, xorshift};
use super::error::{CauseKind, RelayError};
use super::policy::{self, Verdict};
use crate::error_chain::error_chain;

/// Setup, then the NATS client sessions start with, retried while [`transient`] says a server is
/// only unreachable. `None` when `shutdown` resolved first.
pub(super) async fn wait_for_servers(
    settings: &Settings,
    jitter: &mut u64,
    mut shutdown: Pin<&mut (impl Future<Output = ()> + Send)>,
) -> Result<Option<(SetupReport, async_nats::Client)>, RelayError> {
    let mut failures = 0u32;
    let mut waiting: Option<CauseKind> = None;
    loop {
        let attempt = async {
            let report = setup::setup(settings).await?;
            let nats = connect_nats(settings).await.map_err(SetupError::Nats)?;
            Ok::<_, SetupError>((report, nats))
        };
        let result = tokio::select! {
            biased;
            _ = shutdown.as_mut() => return Ok(None),
            r = attempt => r,
        };
        let e = match result {
            Ok(ready) => {
                if let Some(kind) = waiting {
                    info!(waited_for = %kind, "servers reachable: starting");
                }
                return Ok(Some(ready));
            }
            Err(e) => e,
        };
        let Some(kind) = transient(&e) else {
            return Err(e.into());
        };
        let error = error_chain(&e);
        if waiting != Some(kind) {
            warn!(cause = %kind, %error, "cannot start yet: waiting for the server; retrying");
            waiting = Some(kind);
        } else {
            debug!(cause = %kind, %error, "start retry failed");
        }
        failures = failures.saturating_add(1);
        let delay: Duration = backoff(failures, xorshift(jitter));
        tokio::select! {
            biased;
            _ = shutdown.as_mut() => return Ok(None),
            _ = tokio::time::sleep(delay) => {}
        }
    }
}

/// The server a start-up failure waits for, or `None` when it is definite ([`policy::startup`]).
fn transient(e: &SetupError) -> Option<CauseKind> {
    match policy::startup(e) {
        Verdict::Restart(kind) => Some(kind),
        Verdict::Standby | Verdict::Stop | Verdict::Defect => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::{ServerError, SourceError};

    fn source_server(code: &str) -> SourceError {
        SourceError::Server {
            context: "connect",
            error: Box::new(ServerError {
                severity: "FATAL".into(),
                code: code.into(),
                message: "m".into(),
                detail: None,
                hint: None,
            }),
        }
    }

    fn pg(source: SourceError) -> SetupError {
        SetupError::Postgres {
            target: "127.0.0.1:5432".into(),
            check: "postgres.url".into(),
            source,
        }
    }

    #[test]
    fn unreachable_postgres_waits_a_refusal_does_not() {
        let refused = SourceError::Io {
            target: "127.0.0.1:5432".into(),
            error: std::io::Error::from(std::io::ErrorKind::ConnectionRefused),
        };
        assert_eq!(transient(&pg(refused)), Some(CauseKind::Postgres));
        assert_eq!(
            transient(&pg(source_server("57P03"))),
            Some(CauseKind::Postgres),
            "the database system is starting up"
        );
        assert_eq!(
            transient(&pg(source_server("28P01"))),
            None,
            "wrong password"
        );
        assert_eq!(
            transient(&pg(source_server("3D000"))),
            None,
            "no such database"
        );
        assert_eq!(transient(&pg(SourceError::Tls("bad".into()))), None);
    }

    #[test]
    fn checks_on_what_setup_found_are_definite() {
        assert_eq!(
            transient(&SetupError::Prerequisite("wal_level".into())),
            None
        );
        assert_eq!(
            transient(&SetupError::Slot {
                name: "s".into(),
                problem: "p".into()
            }),
            None
        );
    }
}
