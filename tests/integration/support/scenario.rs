//! `Scenario`: the setup most end-to-end tests begin with, in one place. A database of its own on
//! the shared Postgres (with the SQL the test gives, the outbox table usually), a JetStream server,
//! the relay's configuration for both (with the test's changes), a Postgres client and a JetStream
//! context, and the slot's and stream's names:
//!
//! ```ignore
//! let s = Scenario::builder().text_ids().config(|c| c.nats.fence = true).start().await;
//! let relay = s.relay().await;
//! s.write_each(&["e-1", "e-2"]);
//! let end = s.wal_lsn().await;
//! s.wait_confirmed("e-1 and e-2 confirmed", end).await;
//! ```
//!
//! A test that would rather name the parts takes them with [`Scenario::into_parts`], keeping
//! every one it does not use under a `_name` (a `_` pattern would drop the database or the server
//! at once).
//!
//! The steps a test then repeats (start the relay once its slot is found, wait for the slot to be
//! confirmed past a position, read the stream) are methods, so a test reads as its story.

use std::time::Duration;

use async_nats::jetstream;
use outbox_relay::Lsn;
use outbox_relay::config::Config;

use super::{
    InProcessRelay, NatsServer, PgServer, Stored, TEXT_ID_OUTBOX_SQL, TestDb, confirmed_flush,
    current_wal_lsn, default_outbox_sql, read_all, relay_config, relay_env, stream_count, wait_for,
};

/// How long a scenario's waits for the slot wait at the most before the test fails.
const CONFIRM_LIMIT: Duration = Duration::from_secs(60);

/// What [`Scenario::start`] makes: the SQL to run in the new database and the changes to the
/// relay's configuration, in the order given.
#[must_use = "a scenario is made by start()"]
pub(crate) struct ScenarioBuilder {
    sql: Vec<String>,
    tweaks: Vec<ConfigChange>,
}

/// A test's change to the relay's configuration.
type ConfigChange = Box<dyn FnOnce(&mut Config)>;

/// A test's servers and the relay's configuration for them (see the module's documentation).
pub(crate) struct Scenario {
    pub db: TestDb,
    pub nats: NatsServer,
    pub config: Config,
    pub client: tokio_postgres::Client,
    pub js: jetstream::Context,
    /// `config.postgres.slot`.
    pub slot: String,
    /// `config.nats.stream`.
    pub stream: String,
}

/// A scenario's parts, as [`Scenario::into_parts`] hands them over.
type Parts = (
    TestDb,
    NatsServer,
    Config,
    tokio_postgres::Client,
    jetstream::Context,
    String,
    String,
);

impl Scenario {
    /// The parts, in the order of the fields: database, NATS server, config, client, JetStream
    /// context, slot, stream.
    pub(crate) fn into_parts(self) -> Parts {
        (
            self.db,
            self.nats,
            self.config,
            self.client,
            self.js,
            self.slot,
            self.stream,
        )
    }

    /// A scenario to build: an empty database, the relay's test configuration unchanged.
    pub(crate) fn builder() -> ScenarioBuilder {
        ScenarioBuilder {
            sql: Vec::new(),
            tweaks: Vec::new(),
        }
    }

    /// The relay on a task, returned once its slot has a consistent point (rows written before
    /// that are not decoded).
    pub(crate) async fn relay(&self) -> InProcessRelay {
        InProcessRelay::start_streaming(&self.config, &self.client).await
    }

    /// The environment that points the binary at this scenario's servers and names.
    pub(crate) fn env(&self) -> Vec<(String, String)> {
        relay_env(&self.config)
    }

    /// `pg_current_wal_lsn()`: where the slot must be confirmed to have everything written so far.
    pub(crate) async fn wal_lsn(&self) -> Lsn {
        current_wal_lsn(&self.client).await
    }

    /// Waits (a minute at the most) until the slot is confirmed at `end` or past it.
    pub(crate) async fn wait_confirmed(&self, what: &str, end: Lsn) {
        self.wait_confirmed_within(what, end, CONFIRM_LIMIT).await;
    }

    /// [`Scenario::wait_confirmed`], waiting up to `limit`.
    pub(crate) async fn wait_confirmed_within(&self, what: &str, end: Lsn, limit: Duration) {
        wait_for(what, limit, || async {
            confirmed_flush(&self.client, &self.slot)
                .await
                .is_some_and(|c| c >= end)
        })
        .await;
    }

    /// The slot's confirmed position (`None` while it does not exist).
    pub(crate) async fn confirmed(&self) -> Option<Lsn> {
        confirmed_flush(&self.client, &self.slot).await
    }

    /// How many messages the stream holds.
    pub(crate) async fn count(&self) -> u64 {
        stream_count(&self.js, &self.stream).await
    }

    /// Every message of the stream, in stream order.
    pub(crate) async fn read_all(&self) -> Vec<Stored> {
        read_all(&self.js, &self.stream).await
    }

    /// One transaction per id into a text-id outbox table ([`ScenarioBuilder::text_ids`]):
    /// `Claim` events with payload `{"id": …}`.
    pub(crate) fn write_each(&self, ids: &[&str]) {
        for id in ids {
            self.db.psql(&format!(
                "INSERT INTO public.outbox (event_id, aggregate_type, aggregate_id, event_type, payload)
                 VALUES ('{id}', 'Claim', '4711', 'ClaimApproved', '{{\"id\": \"{id}\"}}');"
            ));
        }
    }
}

impl ScenarioBuilder {
    /// Runs `sql` in the new database (after what was given before).
    pub(crate) fn sql(mut self, sql: &str) -> Self {
        self.sql.push(sql.to_owned());
        self
    }

    /// The outbox table with `event_id text`, for readable ids (`e-1`).
    pub(crate) fn text_ids(self) -> Self {
        self.sql(TEXT_ID_OUTBOX_SQL)
    }

    /// The outbox table as shipped (`sql/01_outbox_table.sql`, uuid ids).
    pub(crate) fn default_outbox(self) -> Self {
        self.sql(&default_outbox_sql())
    }

    /// An HTTP listener on `addr` (`free_addr()`), for the tests that ask `/position`, `/wait` or
    /// the health endpoints.
    pub(crate) fn http_listen(self, addr: &str) -> Self {
        let addr = addr.to_owned();
        self.config(move |c| c.http.listen = addr)
    }

    /// Changes the relay's configuration (after the changes given before).
    pub(crate) fn config(mut self, change: impl FnOnce(&mut Config) + 'static) -> Self {
        self.tweaks.push(Box::new(change));
        self
    }

    /// Creates the database on the shared Postgres and starts the JetStream server.
    pub(crate) async fn start(self) -> Scenario {
        let db = TestDb::create(PgServer::shared()).await;
        for sql in &self.sql {
            db.psql(sql);
        }
        let nats = NatsServer::start();
        let mut config = relay_config(&db, &nats);
        for change in self.tweaks {
            change(&mut config);
        }
        config
            .validate()
            .expect("the scenario's relay config is valid");
        let client = db.client().await;
        let js = nats.jetstream().await;
        Scenario {
            slot: config.postgres.slot.clone(),
            stream: config.nats.stream.clone(),
            db,
            nats,
            config,
            client,
            js,
        }
    }
}
