//! The servers `status` reads, each opened once ([`Servers`]): the one Postgres control connection
//! and the one NATS connection, opened lazily on the first fact that needs them, with the failure
//! of each open kept, so every fact that needs a server that could not be reached says the same
//! thing without trying again. The real implementation of [`Facts`]: each fact is a query of
//! `postgres.rs`, a read of `stream.rs`, the relay's word (`relay_word.rs`) or `setup`'s checks.
//! The other hosts of a URL that lists several are other servers, each asked once by
//! `postgres::read_standbys`.

use tokio::sync::OnceCell;
use tokio_postgres::Client;

use super::facts::{
    FactError, Facts, OrphanMark, ParkedStatus, PublicationRead, RelayWord, Scan, ServerStatus,
    SlotRow, StandbyStatus, State, StreamRead, Unreached, read_parked,
};
use super::{postgres, stream};
use crate::Lsn;
use crate::config::Settings;
use crate::nats::{ConnectError, NatsPort, connect_nats};
use crate::position::Position;
use crate::setup;
use crate::warning::Warning;

/// The servers of one `status`, each opened at most once.
pub struct Servers<'a> {
    settings: &'a Settings,
    postgres: OnceCell<Result<Client, Unreached>>,
    nats: OnceCell<Result<async_nats::Client, ConnectError>>,
}

impl<'a> Servers<'a> {
    /// The servers `settings` name, none opened yet.
    pub fn new(settings: &'a Settings) -> Self {
        Servers {
            settings,
            postgres: OnceCell::new(),
            nats: OnceCell::new(),
        }
    }

    /// The control connection, opened on the first call; refused credentials or TLS are a setting
    /// to fix, not a server that is down.
    async fn pg(&self) -> Result<&Client, &Unreached> {
        self.postgres
            .get_or_init(|| async {
                setup::connect_postgres(self.settings)
                    .await
                    .map_err(|e| Unreached {
                        state: match &e {
                            setup::SetupError::Postgres { source, .. } if source.is_refusal() => {
                                match source {
                                    crate::source::SourceError::Tls(_) => State::TlsFailed,
                                    _ => State::AuthFailed,
                                }
                            }
                            _ => State::Unreachable,
                        },
                        error: crate::error_chain::error_chain(&e),
                    })
            })
            .await
            .as_ref()
    }

    /// The control connection, for a fact asked after [`Facts::postgres`] said it is open.
    async fn client(&self) -> Result<&Client, FactError> {
        self.pg().await.map_err(|e| FactError(e.error.clone()))
    }

    /// The NATS connection, opened on the first call.
    async fn nats_client(&self) -> Result<&async_nats::Client, &ConnectError> {
        self.nats
            .get_or_init(|| connect_nats(self.settings))
            .await
            .as_ref()
    }

    fn slot_name(&self) -> &str {
        &self.settings.config().postgres.slot
    }
}

/// A query's error as `status` has always printed it after `postgres: `.
fn query(e: tokio_postgres::Error) -> FactError {
    FactError(e.to_string())
}

/// A look's error in the server's own words.
fn look(e: tokio_postgres::Error) -> FactError {
    FactError(
        e.as_db_error()
            .map_or_else(|| e.to_string(), |d| d.message().to_owned()),
    )
}

impl Facts for Servers<'_> {
    async fn postgres(&self) -> Result<(), Unreached> {
        self.pg().await.map(|_| ()).map_err(Clone::clone)
    }

    async fn server(&self) -> Result<ServerStatus, FactError> {
        postgres::server(self.client().await?).await.map_err(query)
    }

    async fn slot(&self) -> Result<Option<SlotRow>, FactError> {
        crate::catalog::slot(self.client().await?, self.slot_name())
            .await
            .map_err(query)
    }

    async fn relay_pids(&self) -> Result<Vec<u32>, FactError> {
        postgres::relay_pids(self.client().await?, self.slot_name())
            .await
            .map_err(query)
    }

    async fn waiting(&self) -> Result<Scan, FactError> {
        postgres::events_waiting(self.settings, self.client().await?)
            .await
            .map_err(look)
    }

    async fn unheld_secs(&self) -> Result<Option<u64>, FactError> {
        postgres::unheld_since(self.client().await?, self.slot_name())
            .await
            .map_err(query)
    }

    async fn held(&self) -> Result<bool, FactError> {
        postgres::held(self.client().await?, self.slot_name())
            .await
            .map_err(|e| FactError(crate::error_chain::error_chain(&e)))
    }

    async fn publication(&self) -> Result<PublicationRead, FactError> {
        let name = &self.settings.config().postgres.publication;
        postgres::publication(self.client().await?, name)
            .await
            .map_err(query)
    }

    async fn message_warnings(&self) -> Result<Vec<Warning>, FactError> {
        setup::message_warnings(self.settings, self.client().await?)
            .await
            .map_err(query)
    }

    async fn orphan_marks(&self) -> Result<Vec<OrphanMark>, FactError> {
        postgres::orphan_marks(self.client().await?)
            .await
            .map_err(query)
    }

    async fn mark_at(&self) -> Result<Option<Lsn>, FactError> {
        crate::slot_mark::mark_at(self.settings, self.client().await?)
            .await
            .map_err(|e| FactError(crate::source::query_error_text(&e)))
    }

    async fn scan_mark(&self, slot_at: Lsn, after: Option<Position>) -> Result<Scan, FactError> {
        let peek = &mut crate::slot_mark::peek_mark(self.settings, self.client().await?);
        crate::slot_mark::scan_mark(self.settings, peek, slot_at, after)
            .await
            .map_err(|e| FactError(crate::source::query_error_text(&e)))
    }

    async fn stream(&self) -> StreamRead {
        stream::read_stream(self.settings, self.nats_client().await).await
    }

    async fn parked(&self) -> Result<ParkedStatus, FactError> {
        let port = self
            .nats()
            .await
            .ok_or_else(|| FactError("NATS unreachable".into()))?;
        Ok(read_parked(&port, self.settings).await?)
    }

    async fn nats(&self) -> Option<NatsPort> {
        self.nats_client().await.ok().map(|c| c.clone().into())
    }

    async fn own_word(&self) -> Option<RelayWord> {
        crate::relay_word::ask(&self.settings.config().http.listen).await
    }

    async fn run_checks(&self) -> Result<(), FactError> {
        let pg = self.client().await?;
        let nats = self
            .nats_client()
            .await
            .map_err(|e| FactError(crate::error_chain::error_chain(e)))?;
        let js = async_nats::jetstream::new(nats.clone());
        setup::check_only(self.settings, pg, &js)
            .await
            .map_err(|e| FactError(crate::error_chain::error_chain(&e)))
    }

    async fn standbys(&self, reached: Option<&str>) -> Vec<StandbyStatus> {
        postgres::read_standbys(self.settings, reached).await
    }
}
