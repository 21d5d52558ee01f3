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
//! Tests of other servers and settings say so on the builder: a Postgres of their own
//! ([`ScenarioBuilder::on`]), a NATS server with a configuration and the relay's credentials
//! ([`ScenarioBuilder::nats_config`], [`ScenarioBuilder::nats_user`]: the scenario's own JetStream
//! client connects as that user), payload contracts and parking ([`ScenarioBuilder::schema`],
//! [`ScenarioBuilder::park`]), and sql/09's operator functions with a role of the test's own
//! ([`ScenarioBuilder::operator_role`]). Roles a scenario makes ([`Scenario::login_role`] too)
//! are dropped after its database. [`Scenario::env`] carries those settings (and the outbox
//! table's and message prefix's) to the binary.
//!
//! The steps a test then repeats (start the relay once its slot is found, wait for the slot to be
//! confirmed past a position, read the stream) are methods, so a test reads as its story.

use std::path::Path;
use std::time::Duration;

use async_nats::jetstream;
use outbox_relay::Lsn;
use outbox_relay::config::{Config, OnInvalid};

use super::{
    InProcessRelay, NatsServer, PgServer, RelayProcess, Stored, TEXT_ID_OUTBOX_SQL, TestDb,
    confirmed_flush, current_wal_lsn, default_outbox_sql, free_addr, read_all, relay_config,
    relay_env, requeue_sql_with, stream_count, unique, wait_for,
};

/// How long a scenario's waits for the slot wait at the most before the test fails.
const CONFIRM_LIMIT: Duration = Duration::from_secs(60);

/// What [`Scenario::start`] makes: the servers, the SQL to run in the new database and the changes
/// to the relay's configuration, in the order given.
#[must_use = "a scenario is made by start()"]
pub(crate) struct ScenarioBuilder<'a> {
    /// `None`: the shared Postgres (not started before `start`).
    server: Option<&'a PgServer>,
    nats_conf: String,
    sql: Vec<String>,
    schemas: Vec<(String, String)>,
    operator_role: bool,
    tweaks: Vec<ConfigChange>,
}

/// A test's change to the relay's configuration.
type ConfigChange = Box<dyn FnOnce(&mut Config)>;

/// A test's servers and the relay's configuration for them (see the module's documentation).
pub(crate) struct Scenario {
    pub db: TestDb,
    /// Dropped after `db`: a role with grants in a database cannot be dropped before it.
    roles: Roles,
    /// The operator role sql/09 was installed for, one of `roles`.
    operator: Option<String>,
    pub nats: NatsServer,
    pub config: Config,
    pub client: tokio_postgres::Client,
    pub js: jetstream::Context,
    /// `config.postgres.slot`.
    pub slot: String,
    /// `config.nats.stream`.
    pub stream: String,
    /// The directory `config.outbox.schemas` names, when the builder was given schemas.
    schemas: Option<tempfile::TempDir>,
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

/// The password of the login roles a scenario makes ([`Scenario::login_role`]).
pub(crate) const ROLE_PASSWORD: &str = "role-pw";

/// The roles a scenario made, dropped from the shared server when the scenario ends (roles are
/// the server's, not the database's; a private server goes with its roles).
struct Roles {
    names: Vec<String>,
    shared: bool,
}

impl Drop for Roles {
    fn drop(&mut self) {
        // A failed test is unwinding already: a second panic here would abort the binary.
        if self.shared && !self.names.is_empty() && !std::thread::panicking() {
            let drop_roles: String = self
                .names
                .iter()
                .map(|name| format!("DROP ROLE IF EXISTS {name};\n"))
                .collect();
            PgServer::shared().psql("postgres", &drop_roles);
        }
    }
}

impl Scenario {
    /// The parts, in the order of the fields: database, NATS server, config, client, JetStream
    /// context, slot, stream. Not for a scenario with schemas or roles, which would go at once.
    pub(crate) fn into_parts(self) -> Parts {
        assert!(
            self.schemas.is_none() && self.roles.names.is_empty(),
            "into_parts would drop the scenario's schemas and roles: keep the Scenario"
        );
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

    /// A scenario to build: an empty database on the shared Postgres, a plain JetStream server,
    /// the relay's test configuration unchanged.
    pub(crate) fn builder() -> ScenarioBuilder<'static> {
        ScenarioBuilder {
            server: None,
            nats_conf: String::new(),
            sql: Vec::new(),
            schemas: Vec::new(),
            operator_role: false,
            tweaks: Vec::new(),
        }
    }

    /// A text-id outbox ([`ScenarioBuilder::text_ids`]) and the relay's HTTP listener on a free
    /// loopback address ([`Scenario::http_addr`]): the start of a test that asks the relay's
    /// endpoints, or `status` what the relay itself says.
    pub(crate) async fn listening() -> Scenario {
        let addr = free_addr();
        Scenario::builder()
            .text_ids()
            .http_listen(&addr)
            .start()
            .await
    }

    /// `http.listen`: where the relay's HTTP endpoints are (`listening`, `http_listen`).
    pub(crate) fn http_addr(&self) -> String {
        self.config.http.listen.clone()
    }

    /// The relay on a task, returned once its slot has a consistent point (rows written before
    /// that are not decoded).
    pub(crate) async fn relay(&self) -> InProcessRelay {
        InProcessRelay::start_streaming(&self.config, &self.client).await
    }

    /// The binary's `run` with [`Scenario::env`]. Pair it with [`Scenario::wait_slot_made`]
    /// before writing what it must decode.
    pub(crate) fn run_binary(&self) -> RelayProcess {
        RelayProcess::spawn(&["run"], &self.env())
    }

    /// Waits until the relay's slot exists: what is committed after it is the relay's.
    pub(crate) async fn wait_slot_made(&self) {
        wait_for("the relay's slot", CONFIRM_LIMIT, || async {
            self.confirmed().await.is_some()
        })
        .await;
    }

    /// The environment that points the binary at this scenario's servers and names, with the
    /// outbox table, message prefix, schemas, headers column, `on_invalid` and NATS credentials
    /// where they differ from the default (a test adds the variables of other settings it changes).
    pub(crate) fn env(&self) -> Vec<(String, String)> {
        let mut env = relay_env(&self.config);
        env.extend(changed_settings(&self.config));
        env
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

    /// Waits until the stream holds `n` messages or more: a minute, and a second more for every
    /// 500 (a long story on a loaded 2-core machine).
    pub(crate) async fn wait_messages(&self, n: u64) {
        let limit = CONFIRM_LIMIT + Duration::from_secs(n / 500);
        wait_for(
            &format!("{n} messages in {}", self.stream),
            limit,
            || async { self.count().await >= n },
        )
        .await;
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

    /// Replaces the contract of `event_type` in the schemas directory (a fix; the relay reads it
    /// at its next start).
    pub(crate) fn write_schema(&self, event_type: &str, schema: &str) {
        let dir = self
            .schemas
            .as_ref()
            .expect("a scenario with schemas (ScenarioBuilder::schema)");
        write_schema(dir.path(), event_type, schema);
    }

    /// Installs sql/09_requeue.sql for a new operator role of the scenario's own (`op_<unique>`,
    /// so that tests on the shared server do not share one), with `vars` set too (`relay_name`).
    /// The role is dropped when the scenario ends, after its database.
    pub(crate) fn install_operator_role(&mut self, vars: &[(&str, &str)]) {
        assert!(self.operator.is_none(), "one operator role a scenario");
        let name = unique("op");
        let mut all = vec![("operator_role", name.as_str())];
        all.extend_from_slice(vars);
        self.db.psql(&requeue_sql_with(&all));
        self.roles.names.push(name.clone());
        self.operator = Some(name);
    }

    /// The operator role sql/09 was installed for ([`Scenario::install_operator_role`]).
    pub(crate) fn operator(&self) -> &str {
        self.operator
            .as_deref()
            .expect("a scenario with an operator role (install_operator_role)")
    }

    /// A new role `<prefix>_<unique>` that may log in with [`ROLE_PASSWORD`] (a member of
    /// `member_of` when given), dropped when the scenario ends: its name.
    pub(crate) fn login_role(&mut self, prefix: &str, member_of: Option<&str>) -> String {
        let name = unique(prefix);
        let member = member_of.map_or(String::new(), |r| format!(" IN ROLE {r}"));
        self.db.psql(&format!(
            "CREATE ROLE {name} LOGIN PASSWORD '{ROLE_PASSWORD}'{member}"
        ));
        self.roles.names.push(name.clone());
        name
    }
}

/// `<dir>/<event_type>.json`, the file `outbox.schemas` holds an event type's contract in.
fn write_schema(dir: &Path, event_type: &str, schema: &str) {
    let path = dir.join(format!("{event_type}.json"));
    std::fs::write(&path, schema).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
}

/// The `OUTBOX_RELAY_*` variables of the settings a scenario may change beyond what `relay_env`
/// carries, for those that differ from the default.
fn changed_settings(config: &Config) -> Vec<(String, String)> {
    let default = Config::default();
    let on_invalid = |c: &Config| serde_json::to_value(c.outbox.on_invalid).expect("serializes");
    let settings = [
        ("OUTBOX_TABLE", &config.outbox.table, &default.outbox.table),
        (
            "OUTBOX_MESSAGE_PREFIX",
            &config.outbox.message_prefix,
            &default.outbox.message_prefix,
        ),
        (
            "OUTBOX_SCHEMAS",
            &config.outbox.schemas,
            &default.outbox.schemas,
        ),
        (
            "OUTBOX_HEADERS_COLUMN",
            &config.outbox.headers_column,
            &default.outbox.headers_column,
        ),
        ("NATS_USER", &config.nats.user, &default.nats.user),
        (
            "NATS_PASSWORD",
            &config.nats.password,
            &default.nats.password,
        ),
        ("NATS_TOKEN", &config.nats.token, &default.nats.token),
        (
            "NATS_INBOX_PREFIX",
            &config.nats.inbox_prefix,
            &default.nats.inbox_prefix,
        ),
    ];
    let mut env: Vec<(String, String)> = settings
        .into_iter()
        .filter(|(_, value, default)| value != default)
        .map(|(name, value, _)| (format!("OUTBOX_RELAY_{name}"), value.clone()))
        .collect();
    if config.outbox.on_invalid != default.outbox.on_invalid {
        let value = on_invalid(config);
        let value = value.as_str().expect("a name");
        env.push(("OUTBOX_RELAY_OUTBOX_ON_INVALID".into(), value.to_owned()));
    }
    env
}

/// A JetStream context as the relay's configured NATS user (or token, and inbox prefix) when it
/// has one: a server with a configuration of the test's may admit no one else.
async fn jetstream_as(nats: &NatsServer, config: &Config) -> jetstream::Context {
    let n = &config.nats;
    let mut options = if !n.user.is_empty() {
        async_nats::ConnectOptions::with_user_and_password(n.user.clone(), n.password.clone())
    } else if !n.token.is_empty() {
        async_nats::ConnectOptions::with_token(n.token.clone())
    } else {
        return nats.jetstream().await;
    };
    if !n.inbox_prefix.is_empty() {
        options = options.custom_inbox_prefix(n.inbox_prefix.clone());
    }
    let client = options
        .connect(nats.url())
        .await
        .unwrap_or_else(|e| panic!("connect to {} as {:?}: {e}", nats.url(), n.user));
    jetstream::new(client)
}

impl<'a> ScenarioBuilder<'a> {
    /// The database on `server` (a private one, `PgServer::start_private()`) instead of the
    /// shared Postgres.
    pub(crate) fn on<'b>(self, server: &'b PgServer) -> ScenarioBuilder<'b> {
        ScenarioBuilder {
            server: Some(server),
            nats_conf: self.nats_conf,
            sql: self.sql,
            schemas: self.schemas,
            operator_role: self.operator_role,
            tweaks: self.tweaks,
        }
    }

    /// Lines for the NATS server's configuration file (`NatsServer::start_with_config`), e.g.
    /// `max_payload: 4096` or an `authorization` block.
    pub(crate) fn nats_config(mut self, conf: &str) -> Self {
        self.nats_conf = conf.to_owned();
        self
    }

    /// The relay's NATS user and password; the scenario's JetStream client connects as it too.
    pub(crate) fn nats_user(self, user: &str, password: &str) -> Self {
        let (user, password) = (user.to_owned(), password.to_owned());
        self.config(move |c| {
            c.nats.user = user;
            c.nats.password = password;
        })
    }

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

    /// `schema` as the contract of `event_type`, in a directory of the scenario's that
    /// `outbox.schemas` names ([`Scenario::write_schema`] changes it later).
    pub(crate) fn schema(mut self, event_type: &str, schema: &str) -> Self {
        self.schemas
            .push((event_type.to_owned(), schema.to_owned()));
        self
    }

    /// `outbox.on_invalid = "park"`: an event that fails its contract parks its key.
    pub(crate) fn park(self) -> Self {
        self.config(|c| c.outbox.on_invalid = OnInvalid::Park)
    }

    /// sql/09_requeue.sql installed (after the other SQL) for an operator role of the scenario's
    /// own ([`Scenario::install_operator_role`]).
    pub(crate) fn operator_role(mut self) -> Self {
        self.operator_role = true;
        self
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

    /// Creates the database, runs the SQL, starts the NATS server, and connects to both.
    pub(crate) async fn start(self) -> Scenario {
        let db = TestDb::create(self.server()).await;
        for sql in &self.sql {
            db.psql(sql);
        }
        let nats = NatsServer::start_with_config(&self.nats_conf);
        let mut config = relay_config(&db, &nats);
        let schemas = self.write_schemas(&mut config);
        for change in self.tweaks {
            change(&mut config);
        }
        config
            .validate()
            .expect("the scenario's relay config is valid");
        let client = db.client().await;
        let js = jetstream_as(&nats, &config).await;
        let mut scenario = Scenario {
            slot: config.postgres.slot.clone(),
            stream: config.nats.stream.clone(),
            db,
            roles: Roles {
                names: Vec::new(),
                shared: self.server.is_none(),
            },
            operator: None,
            nats,
            config,
            client,
            js,
            schemas,
        };
        if self.operator_role {
            scenario.install_operator_role(&[]);
        }
        scenario
    }

    /// The server the database goes on.
    fn server(&self) -> &'a PgServer {
        match self.server {
            Some(server) => server,
            None => PgServer::shared(),
        }
    }

    /// The schemas directory, with `config.outbox.schemas` naming it (none without schemas).
    fn write_schemas(&self, config: &mut Config) -> Option<tempfile::TempDir> {
        if self.schemas.is_empty() {
            return None;
        }
        let dir = tempfile::tempdir().expect("a schemas directory");
        for (event_type, schema) in &self.schemas {
            write_schema(dir.path(), event_type, schema);
        }
        config.outbox.schemas = dir.path().display().to_string();
        Some(dir)
    }
}
