//! What `status` reports, as plain data: Postgres, the URL's other hosts, the slot, the relay
//! processes, the publication, the stream, the schema directory and an unfinished backfill, with
//! the problems (which make the status unhealthy) and the warnings found. `--json` prints these
//! types serialized; `text.rs` is the text form. What a server that could not be reached would have
//! told is `None` (`null`), never `false` or 0. Nothing here reads a server or judges what was
//! found.

use serde::Serialize;

/// Whether a server or object could be looked at, and what was found.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum State {
    /// The server answered and the object is there.
    Exists,
    /// The server answered and the object is not there.
    Missing,
    /// The server did not answer.
    Unreachable,
    /// The server refused the credentials (a wrong password, a refused method): the setting is
    /// wrong, the server is up.
    AuthFailed,
    /// TLS to the server failed (a certificate, `sslmode`, `tls_required`).
    TlsFailed,
    /// NATS answered, but without JetStream (`-js`).
    JetstreamDisabled,
}

impl State {
    pub(super) fn word(self) -> &'static str {
        match self {
            State::Exists => "exists",
            State::Missing => "MISSING",
            State::Unreachable => "UNREACHABLE",
            State::AuthFailed => "AUTHENTICATION FAILED",
            State::TlsFailed => "TLS FAILED",
            State::JetstreamDisabled => "JETSTREAM NOT ENABLED",
        }
    }
}

/// The slot as `pg_replication_slots` shows it.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct SlotStatus {
    /// `postgres.slot`.
    pub(crate) name: String,
    /// Whether Postgres answered and the slot exists.
    pub(crate) state: State,
    /// The slot exists (`None`: Postgres could not be asked).
    pub(crate) exists: Option<bool>,
    /// A walsender (a relay) streams the slot now (`None`: Postgres could not be asked).
    pub(crate) active: Option<bool>,
    /// The process id of that walsender.
    pub(crate) active_pid: Option<i32>,
    /// The position the slot's consumer last confirmed.
    pub(crate) confirmed_flush_lsn: Option<String>,
    /// WAL position − `confirmed_flush_lsn`.
    pub(crate) lag_bytes: Option<i64>,
    /// WAL position − `restart_lsn`: WAL the slot keeps on disk.
    pub(crate) retained_bytes: Option<i64>,
    /// `reserved`, `extended`, `unreserved` or `lost`: whether the WAL the slot needs is still there.
    pub(crate) wal_status: Option<String>,
    /// Bytes of WAL that can still be written before the slot is in danger of being lost.
    pub(crate) safe_wal_size: Option<i64>,
    /// Events are decoded in the slot and no relay streams it (`None`: not looked at, or the
    /// look ended at its bound with WAL still pending and no event found).
    pub(crate) events_waiting: Option<bool>,
    /// The first event that waits: its id and position.
    pub(crate) waiting_event: Option<String>,
    /// How many events wait, counted within the look's bound (`None`: not looked at).
    pub(crate) waiting_events: Option<u64>,
    /// Whether that count is all of them (`false`: the look stopped at its bound with WAL still
    /// pending, so at least that many wait).
    pub(crate) waiting_events_complete: Option<bool>,
    /// How long no relay has held the slot, in seconds (`None`: one holds it, or it is not known).
    pub(crate) unheld_secs: Option<u64>,
    /// How `unheld_secs` is known: `inactive_since` (PG 17+) or `watched` (status watched the slot
    /// that long, on a server that does not record since when).
    pub(crate) unheld_measured: Option<&'static str>,
    /// Outbox events a client other than a relay consumed from the slot (or advanced it past)
    /// that the stream lacks, found through the stop mark (`None`: no mark, or not judged).
    pub(crate) consumed_events: Option<u64>,
    /// PG 17+.
    pub(crate) inactive_since: Option<String>,
    /// Why the slot was invalidated (PG 17+); `None` while it is usable.
    pub(crate) invalidation_reason: Option<String>,
    /// PG 17+: the slot is a failover slot, which standbys keep a copy of.
    pub(crate) failover: Option<bool>,
    /// PG 17+: the slot is a copy synced from a primary's failover slot.
    pub(crate) synced: Option<bool>,
}

/// The stream as JetStream reports it.
#[derive(Debug, Clone, Serialize)]
pub struct StreamStatus {
    /// `nats.stream`.
    pub(crate) name: String,
    /// Whether NATS answered with JetStream and the stream exists.
    pub state: State,
    /// The stream exists (`None`: NATS or JetStream could not be asked). The fields below are
    /// `None` unless it exists.
    pub exists: Option<bool>,
    /// Messages the stream holds.
    pub(crate) messages: Option<u64>,
    /// Bytes the stream holds.
    pub(crate) bytes: Option<u64>,
    /// Sequence number of the stream's last message.
    pub(crate) last_sequence: Option<u64>,
    /// The subjects the stream stores.
    pub(crate) subjects: Option<Vec<String>>,
    /// `file` or `memory`.
    pub(crate) storage: Option<String>,
    /// Number of replicas.
    pub(crate) replicas: Option<usize>,
    /// The stream's duplicate window, in seconds.
    pub(crate) duplicate_window_secs: Option<u64>,
    /// `max_msgs` (`None`: unlimited or unknown).
    pub(crate) max_msgs: Option<u64>,
    /// `max_bytes` (`None`: unlimited or unknown).
    pub(crate) max_bytes: Option<u64>,
    /// `max_age` in seconds (`None`: unlimited or unknown).
    pub(crate) max_age_secs: Option<u64>,
    /// `new` (a full stream refuses events: the relay stalls) or `old` (it drops the oldest).
    pub(crate) discard: Option<String>,
    /// Why the stream's state is unknown (NATS unreachable, JetStream not answering).
    pub(crate) unknown_because: Option<String>,
    /// Dead letters on `nats.dead_letter_subject` (`None`: not known).
    pub(crate) dead_letters: Option<DeadLetters>,
    /// Keys parked on the parking subjects (`None`: not read, or the stream stores no parking
    /// subject: `parked.rs`).
    pub(crate) parked: Option<super::parked::ParkedStatus>,
    /// The stream's metadata (read for the backfill marker; not printed).
    #[serde(skip)]
    pub(crate) metadata: std::collections::HashMap<String, String>,
}

/// The dead letters the stream holds: events that could not be published as they are (P7).
#[derive(Debug, Clone, Serialize)]
pub(crate) struct DeadLetters {
    /// `nats.dead_letter_subject`.
    pub(crate) subject: String,
    /// How many the stream holds now.
    pub(crate) count: u64,
    /// The newest of them.
    pub(crate) newest: Option<DeadLetter>,
}

/// One dead letter, as its headers say (escaped, each one bounded line: the event's own values).
#[derive(Debug, Clone, Serialize)]
pub(crate) struct DeadLetter {
    /// Its stream sequence.
    pub(crate) sequence: u64,
    /// When the stream stored it (RFC 3339).
    pub(crate) time: String,
    /// The event's id (`Outbox-Event-Id`, else `Nats-Msg-Id`).
    pub(crate) event_id: Option<String>,
    /// `Outbox-Error`: why it could not be published.
    pub(crate) reason: Option<String>,
}

/// A stop mark (`<slot>_mark`) whose slot is gone: it keeps WAL like a slot, forever.
#[derive(Debug, Clone, Serialize)]
pub struct OrphanMark {
    /// The mark's slot name.
    pub(crate) name: String,
    /// The slot it was made for (its name without `_mark`; cut to 58 bytes when the slot's was longer).
    pub(crate) slot: String,
    /// WAL it keeps: WAL position − its `restart_lsn`.
    pub(crate) retained_bytes: Option<i64>,
}

/// A backfill of the slot that has begun and not finished: its marker on the stream.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct BackfillStatus {
    /// The stream metadata key (`outbox-relay.backfill`).
    pub(crate) marker: &'static str,
    /// What the marker names: the slot, and the backfill's pid, host, start, `--where`, `--order-by`.
    #[serde(flatten)]
    pub(crate) backfill: crate::backfill_marker::Marker,
    /// How to recover (repeat the backfill) once it no longer runs: the command with this
    /// `--config`, never with SQL read from the marker.
    pub(crate) recover: String,
}

/// What a relay for the slot is doing, as far as Postgres shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum RelayState {
    /// Something streams the slot (it is active).
    Streaming,
    /// A walsender still holds the slot, but the relay says (its own word, believed) that it does
    /// not stream: its NATS connection is down, and the session ends at the ack timeout.
    NotStreaming,
    /// A relay process for the slot is connected to Postgres but does not stream the slot: it
    /// waits for NATS or Postgres at start, or retries after an outage.
    Retrying,
    /// No relay for the slot is connected and the slot is not streamed.
    NotRunning,
    /// Postgres could not be asked.
    Unknown,
}

/// The relay processes of the slot that Postgres sees.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct RelayStatus {
    /// What they are doing.
    pub(crate) state: RelayState,
    /// Their process ids (on the relay's host), from the connections' `application_name`.
    pub(crate) pids: Vec<u32>,
    /// What the relay serving `http.listen` says of itself (`None`: `http.listen` is empty).
    pub(crate) own_word: Option<crate::relay_word::RelayWord>,
}

/// The publication as `pg_publication_tables` shows it.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct PublicationStatus {
    /// `postgres.publication`.
    pub(crate) name: String,
    /// The publication exists.
    pub(crate) exists: bool,
    /// The tables it publishes, schema-qualified.
    pub(crate) tables: Vec<String>,
}

/// Postgres as a whole.
#[derive(Debug, Clone, Serialize)]
pub struct ServerStatus {
    /// Whether the server answered.
    pub(crate) state: State,
    /// The host the control connection reached.
    pub(crate) host: Option<String>,
    /// The `server_version` setting, e.g. `17.2`.
    pub(crate) server_version: Option<String>,
    /// Connected to a standby (in recovery).
    pub(crate) in_recovery: Option<bool>,
    /// PG 17+: the physical slots a logical failover slot waits for.
    pub(crate) synchronized_standby_slots: Option<String>,
    /// PG 18+: a slot no one holds for longer is invalidated (`0`: never).
    pub(crate) idle_replication_slot_timeout: Option<String>,
    /// `idle_replication_slot_timeout` in seconds (0: off).
    pub(crate) idle_timeout_secs: Option<i64>,
    /// `max_slot_wal_keep_size` as the server shows it (`-1`: unlimited).
    pub(crate) max_slot_wal_keep_size: Option<String>,
    /// `max_slot_wal_keep_size` in bytes (`-1`: unlimited).
    pub(crate) max_slot_wal_keep_bytes: Option<i64>,
    /// `server_version_num`.
    pub(crate) version_num: Option<i32>,
}

impl ServerStatus {
    /// The server in `state`, with nothing read from it.
    pub fn unread(state: State) -> ServerStatus {
        ServerStatus {
            state,
            host: None,
            server_version: None,
            in_recovery: None,
            synchronized_standby_slots: None,
            idle_replication_slot_timeout: None,
            idle_timeout_secs: None,
            max_slot_wal_keep_size: None,
            max_slot_wal_keep_bytes: None,
            version_num: None,
        }
    }
}

/// The stream `name` before NATS answered: every field unknown.
pub fn unknown_stream(name: &str) -> StreamStatus {
    StreamStatus {
        name: name.to_owned(),
        state: State::Unreachable,
        exists: None,
        messages: None,
        bytes: None,
        last_sequence: None,
        subjects: None,
        storage: None,
        replicas: None,
        duplicate_window_secs: None,
        max_msgs: None,
        max_bytes: None,
        max_age_secs: None,
        discard: None,
        unknown_because: None,
        dead_letters: None,
        parked: None,
        metadata: Default::default(),
    }
}

/// Another host of `postgres.url` (a standby, usually) and its copy of the slot.
#[derive(Debug, Clone, Serialize)]
pub struct StandbyStatus {
    /// `host:port` as listed in the URL.
    pub(crate) host: String,
    /// Whether the host answered.
    pub(crate) state: State,
    /// The host is in recovery (a standby).
    pub(crate) in_recovery: Option<bool>,
    /// The slot exists there.
    pub(crate) slot_exists: bool,
    /// PG 17+: it is a synced copy of the primary's failover slot.
    pub(crate) synced: Option<bool>,
    /// The position of the slot's copy there.
    pub(crate) confirmed_flush_lsn: Option<String>,
}

/// `outbox.schemas` as this process loads it now: what a relay started now would check with (a
/// running relay's own last reload is in its log and its `outbox_relay_schema_reloads_total`).
#[derive(Debug, Clone, Serialize)]
pub(crate) struct SchemasStatus {
    /// The directory.
    pub(crate) dir: String,
    /// Schemas that load from it now (`None` when it does not load).
    pub(crate) loaded: Option<usize>,
    /// Why it does not load: the file and the problem.
    pub(crate) error: Option<String>,
    /// `outbox.schemas_required`.
    pub(crate) required: bool,
}

/// Everything `status` prints.
#[derive(Debug, Clone, Serialize)]
pub struct Status {
    /// No problems were found.
    pub healthy: bool,
    /// The Postgres server `postgres.url` reached.
    pub(crate) postgres: ServerStatus,
    /// The URL's other hosts, when it lists several: failover readiness.
    pub(crate) standbys: Vec<StandbyStatus>,
    /// The replication slot.
    pub(crate) slot: SlotStatus,
    /// The relay processes for the slot, as Postgres sees them.
    pub(crate) relay: RelayStatus,
    /// The publication.
    pub(crate) publication: PublicationStatus,
    /// The JetStream stream.
    pub(crate) stream: StreamStatus,
    /// The schema directory (`None`: `outbox.schemas` is not set).
    pub(crate) schemas: Option<SchemasStatus>,
    /// A backfill of the slot that has not finished (`None`: none, or the stream could not be read).
    pub(crate) backfill: Option<BackfillStatus>,
    /// Stop marks in this database whose slot is gone.
    pub(crate) orphan_marks: Vec<OrphanMark>,
    /// `status.grace_secs`: how long the slot may be without a relay before that is a problem.
    pub(crate) grace_secs: u64,
    /// What makes the status unhealthy, one line each, with the fix.
    pub(crate) problems: Vec<String>,
    /// Findings that do not make the status unhealthy, one line each. In JSON, as before, their
    /// texts (strings), with their stable names in `warning_names`, in the same order.
    #[serde(serialize_with = "warning_texts")]
    pub(crate) warnings: Vec<crate::warning::Warning>,
    /// The stable name of each warning, in the order of `warnings`.
    pub(crate) warning_names: Vec<&'static str>,
    /// The names of warnings found and left out, as `warnings.acknowledged` asks.
    pub(crate) acknowledged_warnings: Vec<&'static str>,
}

impl Status {
    /// What makes the status unhealthy, one line each.
    pub fn problems(&self) -> &[String] {
        &self.problems
    }

    /// Whether outbox events wait in the slot (`None`: not looked at, or not known).
    pub fn events_waiting(&self) -> Option<bool> {
        self.slot.events_waiting
    }

    /// The id of the first waiting event, as `slot.waiting_event` names it before its position.
    pub fn waiting_event_id(&self) -> Option<&str> {
        let named = self.slot.waiting_event.as_deref()?;
        Some(named.rsplit_once(" (position ").map_or(named, |(id, _)| id))
    }
}

/// `warnings` as the array of strings `status --json` has always had (docs/compatibility.md).
fn warning_texts<S: serde::Serializer>(
    warnings: &[crate::warning::Warning],
    s: S,
) -> Result<S::Ok, S::Error> {
    s.collect_seq(warnings.iter().map(|w| &w.text))
}

/// What the control connection to Postgres found; all unknown when it could not connect.
pub(crate) struct PostgresSide {
    pub(crate) server: ServerStatus,
    pub(crate) slot: SlotStatus,
    pub(crate) relay: RelayStatus,
    pub(crate) publication: PublicationStatus,
    /// Why whether events wait in the slot could not be checked.
    pub(crate) events_unknown: Option<String>,
    /// Stop marks in this database whose slot is gone.
    pub(crate) orphan_marks: Vec<OrphanMark>,
}
