//! The outbox stage: a relation cache, and the mapping from an INSERT into the outbox table to an
//! [`OutboxEvent`].
//!
//! Only inserts into the configured table become events. Updates, deletes and truncates of it are
//! counted and ignored (an insert followed by a delete in the same transaction still publishes: the
//! insert is in the WAL). Changes to other tables are ignored. Column positions are looked up by name
//! from the latest Relation message, which the walsender re-sends after every schema change, so a
//! column added mid-stream is harmless and a needed column dropped or renamed turns the following
//! events into invalid ones (with the reason) instead of silently mis-mapping them.
//!
//! Values stay `Bytes` slices of the received frame: the jsonb text is already JSON and is published as
//! stored, never parsed and re-serialised. Only `bytea` (hex text output → raw bytes) and the optional
//! headers column (a small JSON object) are decoded.
//!
//! With `outbox.message_prefix`, a transactional logical message with that prefix
//! (`pg_logical_emit_message(true, prefix, content)`) is an event too: its content is a JSON object
//! with the same fields as a row, and it takes its place among the row events of its transaction. Its
//! `payload` is published as the JSON text the application wrote, sliced out of the frame. A
//! non-transactional message with the prefix is atomic with nothing, so it is never published as an
//! event: it becomes a dead letter of its own ([`Step::Standalone`]), outside any transaction.

mod context;

use std::collections::HashMap;
use std::sync::Arc;

use bytes::Bytes;

use serde::Deserialize;
use serde_json::value::RawValue;

use crate::Lsn;
use crate::config::OutboxConfig;
use crate::pgoutput::{Message, Relation, TupleValue};
use crate::position::Position;
use crate::schema::{PendingCheck, SchemaMetrics, SchemaReader, Schemas, Verdict};

/// The longest event id published as `Nats-Msg-Id`; a longer one makes the event invalid (its dead
/// letter gets a WAL-derived id), so one huge id cannot keep even a minimal dead letter out.
pub(crate) const MAX_ID_BYTES: usize = 1024;

/// Whether `id` can be an event's `Nats-Msg-Id` as it is: not empty, no line break (a header
/// cannot hold one), at most [`MAX_ID_BYTES`]. The one rule: [`id_problems`] words it for a dead
/// letter, and `message::message_id` makes up an id for an event whose id breaks it.
pub(crate) fn usable_id(id: &str) -> bool {
    !id.is_empty() && id.len() <= MAX_ID_BYTES && !id.contains(['\r', '\n'])
}

/// The problems of an unusable `id` ([`usable_id`]), each naming where it came from (`what`: the
/// id column, or the message's `"id"` field).
fn id_problems(id: &str, what: &str, problems: &mut Vec<String>) {
    if id.is_empty() {
        problems.push(format!("{what} is empty"));
    }
    if id.contains(['\r', '\n']) {
        problems.push(format!(
            "{what} contains a line break, which cannot go into the Nats-Msg-Id header"
        ));
    }
    if id.len() > MAX_ID_BYTES {
        let len = id.len();
        problems.push(format!(
            "{what} is {len} bytes long, more than the {MAX_ID_BYTES} an id may have"
        ));
    }
}

/// Type OIDs the mapping cares about (`pg_type.dat`).
mod oid {
    pub(super) const BYTEA: u32 = 17;
    pub(super) const JSON: u32 = 114;
    pub(super) const JSONB: u32 = 3802;
    pub(super) const TEXT: u32 = 25;
    pub(super) const VARCHAR: u32 = 1043;
}

/// The CloudEvents `datacontenttype` of JSON payloads (jsonb and json columns, logical messages).
pub const JSON_CONTENT_TYPE: &str = "application/json";
/// ... and of text payloads.
pub(crate) const TEXT_CONTENT_TYPE: &str = "text/plain; charset=utf-8";

/// One outbox row on its way to JetStream. Fields are `None` when the column was NULL or missing; then
/// `problem` says why the event cannot be published as is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutboxEvent {
    /// The event id's text form (`outbox.id_column`).
    pub id: Option<String>,
    /// The kind of entity (`outbox.aggregate_type_column`).
    pub aggregate_type: Option<String>,
    /// The entity's id (`outbox.aggregate_id_column`).
    pub aggregate_id: Option<String>,
    /// What happened (`outbox.event_type_column`).
    pub event_type: Option<String>,
    /// The message body, as stored (`outbox.payload_column`).
    pub payload: Bytes,
    /// The event's own headers as (name, value): headers column, `header_columns`, or a message's `headers`.
    pub headers: Vec<(String, String)>,
    /// The commit LSN of the transaction (from Begin.final_lsn): the `Outbox-Commit-Lsn` header.
    pub commit_lsn: Lsn,
    /// Position among the outbox inserts of its transaction (0-based).
    pub index: u32,
    /// Its place in the slot's history: the `Outbox-Position` header, what a resuming session
    /// compares with the stream's tail ([`crate::position`]).
    pub position: Position,
    /// The transaction's commit time (µs since 2000-01-01, from Begin), for commit → ack latency.
    pub commit_ts: i64,
    /// Why this event must go to the dead-letter subject; `None` for a good event.
    pub problem: Option<String>,
    /// The `Nats-Msg-Id`, computed once ([`crate::message::message_id`]).
    pub msg_id: String,
    /// The payload's media type, from the payload column's type (`None` for bytea: unknown bytes).
    pub content_type: Option<&'static str>,
    /// The `$id` of the JSON Schema the payload passed (`outbox.schemas`): `ce-dataschema`.
    pub data_schema: Option<Arc<str>>,
    /// The contract check of a payload too large to check on the runtime thread, which the sink
    /// runs before it publishes the event (`schema/budget.rs`); `None` once checked, or for none.
    pub schema_check: Option<PendingCheck>,
}

/// What one pgoutput message means for the relay.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// A transaction starts.
    Begin {
        /// The transaction's commit LSN (`Begin.final_lsn`).
        final_lsn: Lsn,
    },
    /// An outbox event of the open transaction.
    Event(Box<OutboxEvent>),
    /// An event outside any transaction (a non-transactional logical message with the prefix, always
    /// with a problem): publish it, then `end_lsn` may be confirmed once it is acked.
    Standalone {
        /// The event, always with a problem.
        event: Box<OutboxEvent>,
        /// The end of the message's WAL record.
        end_lsn: Lsn,
    },
    /// The open transaction committed.
    Commit {
        /// The LSN of the commit record.
        commit_lsn: Lsn,
        /// The end of the commit record: confirmable once every event before it is acked.
        end_lsn: Lsn,
    },
    /// An outbox update/delete/truncate: counted, not published.
    IgnoredChange(&'static str),
    /// Anything else: relations, other tables, origins, types.
    Nothing,
}

/// A stream the stage cannot interpret: a protocol violation, not a bad event. Definite: the relay
/// stops rather than guess, and nothing past it is confirmed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StageError {
    /// An insert names a relation id no Relation message has described.
    #[error("insert for relation {0} arrived before its Relation message")]
    UnknownRelation(u32),
    /// An outbox insert's tuple has another number of columns than its Relation message.
    #[error("insert into {table} has {got} columns, its Relation message {expected}")]
    ColumnCount {
        /// The outbox table.
        table: String,
        /// Columns in the insert's tuple.
        got: usize,
        /// Columns in the Relation message.
        expected: usize,
    },
    /// A streamed or two-phase message arrives although the relay asked for neither.
    #[error("streamed or two-phase transaction message {0} received, but neither was requested")]
    Unrequested(&'static str),
    /// A Begin arrives before the open transaction's Commit.
    #[error(
        "BEGIN of the transaction committing at {new} arrived inside the one committing at {open}"
    )]
    NestedBegin {
        /// The open transaction's commit LSN.
        open: Lsn,
        /// The new Begin's commit LSN.
        new: Lsn,
    },
    /// A Commit's commit LSN differs from the final LSN its Begin announced.
    #[error("COMMIT at {commit} does not match its BEGIN's final LSN {begin}")]
    CommitMismatch {
        /// The Begin's `final_lsn`.
        begin: Lsn,
        /// The Commit's `commit_lsn`.
        commit: Lsn,
    },
    /// A Commit arrives with no transaction open.
    #[error("COMMIT at {0} arrived outside a transaction")]
    CommitWithoutBegin(Lsn),
    /// A transactional logical message arrives with no transaction open.
    #[error("transactional logical message at {0} arrived outside a transaction")]
    MessageWithoutBegin(Lsn),
}

/// Positions of the configured columns in the outbox table's current Relation.
#[derive(Debug, Clone)]
struct OutboxColumns {
    ncols: usize,
    id: Option<usize>,
    aggregate_type: Option<usize>,
    aggregate_id: Option<usize>,
    event_type: Option<usize>,
    payload: Option<usize>,
    payload_is_bytea: bool,
    headers: Option<usize>,
    /// `outbox.header_columns`: (position in the row, index into the stage's list), for the columns
    /// the table has.
    header_columns: Vec<(usize, usize)>,
    content_type: Option<&'static str>,
    /// Configured columns the table does not have (dropped or renamed): the reason for dead letters.
    missing: Vec<String>,
}

/// The stage. One per replication session (the relation cache starts empty on every connect).
#[derive(Debug)]
pub struct OutboxStage {
    config: OutboxConfig,
    schema: String,
    table: String,
    /// `outbox.header_columns` as (column, header name).
    header_columns: Vec<(String, String)>,
    /// `nats.cloudevents`: `ce-*` and `Content-Type` are the relay's, not an event's own headers.
    cloudevents: bool,
    /// Relation id → columns, for the outbox table only; other relations map to `None`.
    relations: HashMap<u32, Option<OutboxColumns>>,
    /// OIDs of the outbox table's partitions ([`OutboxStage::set_partitions`]): a publication without
    /// `publish_via_partition_root` sends their inserts under their own names.
    partitions: std::collections::HashSet<u32>,
    commit_lsn: Lsn,
    commit_ts: i64,
    /// Outbox inserts seen in the current transaction.
    index: u32,
    /// Between BEGIN and COMMIT: the shape checks Materialize's source makes, so a confused stream
    /// is an error, never a mis-attributed event.
    in_txn: bool,
    /// `outbox.schemas`: the contracts events are checked against, and where failures are counted.
    schemas: Option<(SchemaReader, Arc<SchemaMetrics>)>,
    /// The open transaction's trace context (`outbox.context_prefix`, `context.rs`): headers for
    /// its events that follow the context message.
    context: Vec<(String, String)>,
}

impl OutboxStage {
    /// A stage for the outbox `config` describes, with an empty relation cache.
    pub fn new(config: &OutboxConfig) -> Self {
        let (schema, table) = config.table_parts();
        OutboxStage {
            schema: schema.to_owned(),
            table: table.to_owned(),
            header_columns: config.header_column_pairs(),
            cloudevents: false,
            config: config.clone(),
            relations: HashMap::new(),
            partitions: Default::default(),
            commit_lsn: Lsn::ZERO,
            commit_ts: 0,
            index: 0,
            in_txn: false,
            schemas: None,
            context: Vec::new(),
        }
    }

    /// Checks every event's payload against `schemas` (the set in force when it arrives), counting
    /// failures in `metrics`; a failing event gets the reason as its problem (a dead letter).
    pub(crate) fn with_schemas(mut self, schemas: &Schemas, metrics: Arc<SchemaMetrics>) -> Self {
        self.schemas = Some((schemas.reader(), metrics));
        self
    }

    /// With `nats.cloudevents` on, events may not bring their own `ce-*` or `Content-Type` headers.
    pub(crate) fn with_cloudevents(mut self, on: bool) -> Self {
        self.cloudevents = on;
        self
    }

    /// Interprets one decoded message.
    pub fn step(&mut self, msg: Message) -> Result<Step, StageError> {
        Ok(match msg {
            Message::Begin {
                final_lsn,
                commit_ts,
                ..
            } => {
                if self.in_txn {
                    return Err(StageError::NestedBegin {
                        open: self.commit_lsn,
                        new: final_lsn,
                    });
                }
                self.in_txn = true;
                self.commit_lsn = final_lsn;
                self.commit_ts = commit_ts;
                self.index = 0;
                self.context.clear();
                Step::Begin { final_lsn }
            }
            Message::Commit {
                commit_lsn,
                end_lsn,
                ..
            } => {
                if !self.in_txn {
                    return Err(StageError::CommitWithoutBegin(commit_lsn));
                }
                if commit_lsn != self.commit_lsn {
                    return Err(StageError::CommitMismatch {
                        begin: self.commit_lsn,
                        commit: commit_lsn,
                    });
                }
                self.in_txn = false;
                self.context.clear();
                Step::Commit {
                    commit_lsn,
                    end_lsn,
                }
            }
            Message::Relation(rel) => {
                let outbox = self.is_outbox(&rel) || self.partitions.contains(&rel.id);
                let cols = outbox.then(|| self.columns(&rel));
                self.relations.insert(rel.id, cols);
                Step::Nothing
            }
            Message::Insert {
                relation_id, new, ..
            } => match self.relations.get(&relation_id) {
                None => return Err(StageError::UnknownRelation(relation_id)),
                Some(None) => Step::Nothing,
                Some(Some(cols)) => {
                    if new.len() != cols.ncols {
                        return Err(StageError::ColumnCount {
                            table: self.config.table.clone(),
                            got: new.len(),
                            expected: cols.ncols,
                        });
                    }
                    let bytea = cols.payload_is_bytea;
                    let mut event = self.event(cols, new);
                    self.check(&mut event, bytea);
                    self.index += 1;
                    Step::Event(Box::new(event))
                }
            },
            Message::Update { relation_id, .. } => self.ignored(relation_id, "update"),
            Message::Delete { relation_id, .. } => self.ignored(relation_id, "delete"),
            Message::Truncate { relation_ids, .. } => {
                if relation_ids
                    .iter()
                    .any(|id| matches!(self.relations.get(id), Some(Some(_))))
                {
                    Step::IgnoredChange("truncate")
                } else {
                    Step::Nothing
                }
            }
            Message::Message {
                transactional,
                lsn,
                prefix,
                content,
                ..
            } if !self.config.message_prefix.is_empty() && prefix == self.config.message_prefix => {
                if !transactional {
                    // pgoutput sends these at once, between transactions: they belong to none.
                    let mut event = self.message_event(&content, lsn, 0, 0);
                    event.problem = Some(format!(
                        "non-transactional logical message with prefix {prefix:?} at {lsn}: it is not atomic with \
                         any transaction, so it is not published as an event; emit it with \
                         pg_logical_emit_message(true, ...) (or sql/06_outbox_message.sql's outbox_message)"
                    ));
                    // A WAL-derived id: should the application emit the event again, properly, its own
                    // id must not be dropped as a duplicate of this dead letter.
                    event.msg_id = crate::message::standalone_id(lsn, &content);
                    // Not (lsn, 0): the next record may be a COMMIT that starts at `lsn`, and its
                    // transaction's events would share the position.
                    event.position = Position::standalone(lsn);
                    return Ok(Step::Standalone {
                        event: Box::new(event),
                        end_lsn: lsn,
                    });
                }
                if !self.in_txn {
                    return Err(StageError::MessageWithoutBegin(lsn));
                }
                let mut event =
                    self.message_event(&content, self.commit_lsn, self.index, self.commit_ts);
                self.check(&mut event, false);
                self.index += 1;
                Step::Event(Box::new(event))
            }
            Message::Message {
                transactional,
                lsn,
                prefix,
                content,
                ..
            } if !self.config.context_prefix.is_empty() && prefix == self.config.context_prefix => {
                return self.context_message(transactional, lsn, &prefix, content);
            }
            Message::StreamStart { .. } => return Err(StageError::Unrequested("Stream Start")),
            Message::BeginPrepare { .. } => return Err(StageError::Unrequested("Begin Prepare")),
            _ => Step::Nothing,
        })
    }

    /// A trace context message (`context.rs`): the transaction's context from here on, or, when
    /// its content is not an object of strings or it belongs to no transaction, a dead letter
    /// saying why (the transaction's events then carry no context).
    fn context_message(
        &mut self,
        transactional: bool,
        lsn: Lsn,
        prefix: &str,
        content: Bytes,
    ) -> Result<Step, StageError> {
        let dead_letter = |problem: String, commit_lsn: Lsn, index: u32, commit_ts: i64| {
            Box::new(OutboxEvent {
                id: None,
                aggregate_type: None,
                aggregate_id: None,
                event_type: None,
                msg_id: crate::message::message_id(None, commit_lsn, index, &content),
                payload: content.clone(),
                headers: Vec::new(),
                commit_lsn,
                index,
                position: Position::in_transaction(commit_lsn, index),
                commit_ts,
                problem: Some(format!(
                    "trace context message (prefix {prefix:?}): {problem}"
                )),
                content_type: Some(JSON_CONTENT_TYPE),
                data_schema: None,
                schema_check: None,
            })
        };
        if !transactional {
            let mut event = dead_letter(
                format!(
                    "non-transactional at {lsn}: it belongs to no transaction, so it applies to no event; emit it \
                     with pg_logical_emit_message(true, ...) (or sql/08_outbox_context.sql's outbox_context)"
                ),
                lsn,
                0,
                0,
            );
            event.msg_id = crate::message::standalone_id(lsn, &content);
            event.position = Position::standalone(lsn);
            return Ok(Step::Standalone {
                event,
                end_lsn: lsn,
            });
        }
        if !self.in_txn {
            return Err(StageError::MessageWithoutBegin(lsn));
        }
        match context::parse(&content, self.cloudevents) {
            Ok(headers) => {
                self.context = headers;
                Ok(Step::Nothing)
            }
            Err(problem) => {
                self.context.clear();
                let event = dead_letter(problem, self.commit_lsn, self.index, self.commit_ts);
                self.index += 1;
                Ok(Step::Event(event))
            }
        }
    }

    /// The OIDs of the outbox table's partitions, at any level. Their Relation messages (a
    /// publication without `publish_via_partition_root`) are mapped to the outbox table: the
    /// columns are looked up by name in the partition's own Relation, so a partition whose columns
    /// are in another order maps correctly. Takes effect for Relation messages that follow.
    pub(crate) fn set_partitions(&mut self, oids: impl IntoIterator<Item = u32>) {
        self.partitions = oids.into_iter().collect();
    }

    /// A Relation the stage has not seen in this session and that is not the outbox table by
    /// name: it may be a partition the caller has not told about yet ([`Self::set_partitions`]).
    pub(crate) fn is_new_foreign_relation(&self, rel: &Relation) -> bool {
        !self.relations.contains_key(&rel.id)
            && !self.is_outbox(rel)
            && !self.partitions.contains(&rel.id)
    }

    /// The contract check (`outbox.schemas`) of an event that is good so far: the payload as it
    /// will be published, against its type's schema. Only a set that is active costs more than a
    /// branch; an event that already has a problem is a dead letter anyway.
    fn check(&mut self, event: &mut OutboxEvent, bytea: bool) {
        let Some((reader, metrics)) = &mut self.schemas else {
            return;
        };
        let set = reader.get();
        if !set.active() || event.problem.is_some() {
            return;
        }
        let Some(event_type) = event.event_type.as_deref() else {
            return;
        };
        // A large payload is checked off the runtime thread, within a budget, before it is
        // published; a type without a schema needs no check at all.
        if event.payload.len() > crate::schema::INLINE_BYTES && set.has_schema_for(event_type) {
            event.schema_check = Some(PendingCheck {
                set: reader.shared(),
                metrics: Arc::clone(metrics),
                bytea,
            });
            return;
        }
        match set.check(event_type, &event.payload, bytea) {
            Verdict::Pass(id) => event.data_schema = id,
            Verdict::NoSchema => {}
            Verdict::Fail(why) => {
                metrics.failed(event_type);
                event.problem = Some(why);
            }
        }
    }

    fn ignored(&self, relation_id: u32, kind: &'static str) -> Step {
        match self.relations.get(&relation_id) {
            Some(Some(_)) => Step::IgnoredChange(kind),
            _ => Step::Nothing,
        }
    }

    fn is_outbox(&self, rel: &Relation) -> bool {
        // pgoutput sends "" for pg_catalog; the outbox is never there.
        rel.name == self.table && rel.namespace == self.schema
    }

    fn columns(&self, rel: &Relation) -> OutboxColumns {
        let find = |name: &str| rel.columns.iter().position(|c| c.name == name);
        let c = &self.config;
        let mut missing = Vec::new();
        let mut need = |name: &str| {
            let pos = find(name);
            if pos.is_none() {
                missing.push(name.to_owned());
            }
            pos
        };
        let id = need(&c.id_column);
        let aggregate_type = need(&c.aggregate_type_column);
        let aggregate_id = need(&c.aggregate_id_column);
        let event_type = need(&c.event_type_column);
        let payload = need(&c.payload_column);
        let headers = if c.headers_column.is_empty() {
            None
        } else {
            need(&c.headers_column)
        };
        let header_columns = self
            .header_columns
            .iter()
            .enumerate()
            .filter_map(|(i, (column, _))| Some((need(column)?, i)))
            .collect();
        let content_type = payload.and_then(|p| match rel.columns[p].type_oid {
            oid::JSON | oid::JSONB => Some(JSON_CONTENT_TYPE),
            oid::TEXT | oid::VARCHAR => Some(TEXT_CONTENT_TYPE),
            _ => None,
        });
        OutboxColumns {
            ncols: rel.columns.len(),
            id,
            aggregate_type,
            aggregate_id,
            event_type,
            payload_is_bytea: payload.is_some_and(|p| rel.columns[p].type_oid == oid::BYTEA),
            payload,
            headers,
            header_columns,
            content_type,
            missing,
        }
    }

    fn event(&self, cols: &OutboxColumns, row: Vec<TupleValue>) -> OutboxEvent {
        let c = &self.config;
        let mut problems: Vec<String> = Vec::new();
        if !cols.missing.is_empty() {
            problems.push(format!(
                "column {} missing from {} (dropped or renamed?)",
                cols.missing.join(", "),
                c.table
            ));
        }
        let mut text = |pos: Option<usize>, name: &str, required: bool| -> Option<String> {
            let v = pos.and_then(|p| row.get(p))?;
            match v {
                TupleValue::Text(b) | TupleValue::Binary(b) => match std::str::from_utf8(b) {
                    Ok(s) => Some(s.to_owned()),
                    Err(_) => {
                        problems.push(format!("column {name} is not valid UTF-8"));
                        None
                    }
                },
                TupleValue::Null => {
                    if required {
                        problems.push(format!("column {name} is null"));
                    }
                    None
                }
                TupleValue::UnchangedToast => {
                    problems.push(format!(
                        "column {name} was not sent (unchanged TOAST value)"
                    ));
                    None
                }
            }
        };
        let id = text(cols.id, &c.id_column, true);
        let aggregate_type = text(cols.aggregate_type, &c.aggregate_type_column, true);
        let event_type = text(cols.event_type, &c.event_type_column, true);
        let aggregate_id = text(cols.aggregate_id, &c.aggregate_id_column, false);
        let headers_json = text(cols.headers, &c.headers_column, false);
        let column_headers: Vec<(String, String)> = cols
            .header_columns
            .iter()
            .filter_map(|&(pos, i)| {
                let (column, header) = &self.header_columns[i];
                Some((header.clone(), text(Some(pos), column, false)?))
            })
            .collect();
        if let Some(id) = id.as_deref() {
            id_problems(id, &format!("column {}", c.id_column), &mut problems);
        }
        let payload = match cols.payload.and_then(|p| row.get(p)) {
            Some(TupleValue::Text(b)) if cols.payload_is_bytea => match decode_bytea_hex(b) {
                Some(raw) => raw,
                None => {
                    problems.push(format!(
                        "column {} is not bytea hex output",
                        c.payload_column
                    ));
                    b.clone()
                }
            },
            Some(TupleValue::Text(b) | TupleValue::Binary(b)) => b.clone(),
            Some(TupleValue::UnchangedToast) => {
                problems.push(format!(
                    "column {} was not sent (unchanged TOAST value)",
                    c.payload_column
                ));
                Bytes::new()
            }
            Some(TupleValue::Null) | None => Bytes::new(),
        };
        let mut headers = Vec::new();
        if let Some(json) = headers_json {
            match parse_headers(&json, self.cloudevents) {
                Ok(h) => headers = h,
                Err(e) => problems.push(format!("column {}: {e}", c.headers_column)),
            }
        }
        // After the headers column's: a header column wins over a key of the same name there.
        for (header, value) in column_headers {
            if value.contains(['\r', '\n']) {
                problems.push(format!(
                    "the value of header {header:?} contains a line break"
                ));
            } else {
                headers.push((header, value));
            }
        }
        context::apply(&mut headers, &self.context);
        let msg_id =
            crate::message::message_id(id.as_deref(), self.commit_lsn, self.index, &payload);
        OutboxEvent {
            msg_id,
            id,
            aggregate_type,
            aggregate_id,
            event_type,
            payload,
            headers,
            commit_lsn: self.commit_lsn,
            index: self.index,
            position: Position::in_transaction(self.commit_lsn, self.index),
            commit_ts: self.commit_ts,
            problem: (!problems.is_empty()).then(|| problems.join("; ")),
            content_type: cols.content_type,
            data_schema: None,
            schema_check: None,
        }
    }

    /// A logical message's content as an event. The fields are those of a row; what is missing or
    /// malformed is the event's problem, and then the whole content is its payload, so the dead letter
    /// holds everything the application wrote.
    fn message_event(
        &self,
        content: &Bytes,
        commit_lsn: Lsn,
        index: u32,
        commit_ts: i64,
    ) -> OutboxEvent {
        let mut event = OutboxEvent {
            id: None,
            aggregate_type: None,
            aggregate_id: None,
            event_type: None,
            payload: content.clone(),
            headers: Vec::new(),
            commit_lsn,
            index,
            position: Position::in_transaction(commit_lsn, index),
            commit_ts,
            problem: None,
            msg_id: String::new(),
            content_type: Some(JSON_CONTENT_TYPE),
            data_schema: None,
            schema_check: None,
        };
        let mut problems = Vec::new();
        match parse_message(content) {
            Err(e) => problems.push(e),
            Ok(m) => {
                let mut field = |raw: Option<&RawValue>, name: &str, required: bool| {
                    let Some(raw) = raw else {
                        problems.push(format!("content lacks \"{name}\""));
                        return None;
                    };
                    match serde_json::from_str::<Option<String>>(raw.get()) {
                        Ok(None) if required => {
                            problems.push(format!("\"{name}\" is null"));
                            None
                        }
                        Ok(v) => v,
                        Err(_) => {
                            problems.push(format!("\"{name}\" is not a string"));
                            None
                        }
                    }
                };
                event.id = field(m.id, "id", true);
                event.aggregate_type = field(m.aggregate_type, "aggregate_type", true);
                // Like the column, aggregate_id may be null (then there is no header for it).
                event.aggregate_id = field(m.aggregate_id, "aggregate_id", false);
                event.event_type = field(m.event_type, "event_type", true);
                match m.headers.map(RawValue::get) {
                    None | Some("null") => {}
                    Some(json) => match parse_headers(json, self.cloudevents) {
                        Ok(h) => event.headers = h,
                        Err(e) => problems.push(format!("\"headers\": {e}")),
                    },
                }
                if let Some(id) = event.id.as_deref() {
                    id_problems(id, "\"id\"", &mut problems);
                }
                match m.payload {
                    None => problems.push("content lacks \"payload\"".into()),
                    // Borrowed from `content`, so this is a slice of the frame: the JSON text as written.
                    Some(raw) if problems.is_empty() => {
                        event.payload = content.slice_ref(raw.get().as_bytes())
                    }
                    Some(_) => {}
                }
            }
        }
        context::apply(&mut event.headers, &self.context);
        event.msg_id =
            crate::message::message_id(event.id.as_deref(), commit_lsn, index, &event.payload);
        if !problems.is_empty() {
            event.problem = Some(format!("logical message: {}", problems.join("; ")));
        }
        event
    }
}

/// The content of an event message; every field borrowed, so nothing is copied until it is checked.
/// A field that is `null` is `Some("null")`, not `None`: "lacks" and "is null" are different reasons.
#[derive(Deserialize)]
struct MessageContent<'a> {
    #[serde(borrow, default, deserialize_with = "present")]
    id: Option<&'a RawValue>,
    #[serde(borrow, default, deserialize_with = "present")]
    aggregate_type: Option<&'a RawValue>,
    #[serde(borrow, default, deserialize_with = "present")]
    aggregate_id: Option<&'a RawValue>,
    #[serde(borrow, default, deserialize_with = "present")]
    event_type: Option<&'a RawValue>,
    #[serde(borrow, default, deserialize_with = "present")]
    payload: Option<&'a RawValue>,
    #[serde(borrow, default, deserialize_with = "present")]
    headers: Option<&'a RawValue>,
}

/// A field that is there, whatever its value (`null` included); `default` makes an absent one `None`.
fn present<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<&'de RawValue>, D::Error> {
    <&RawValue>::deserialize(d).map(Some)
}

fn parse_message(content: &[u8]) -> Result<MessageContent<'_>, String> {
    // serde_json would also read a struct from an array, by position; the contract is an object.
    if content.trim_ascii_start().first() != Some(&b'{') {
        return Err(if serde_json::from_slice::<&RawValue>(content).is_ok() {
            "content is not a JSON object".into()
        } else {
            "content is not JSON".into()
        });
    }
    serde_json::from_slice(content).map_err(|e| format!("content is not a valid event ({e})"))
}

/// `\x48656c6c6f` → `Hello` (bytea's default `bytea_output = hex`).
fn decode_bytea_hex(b: &[u8]) -> Option<Bytes> {
    let hex = b.strip_prefix(b"\\x")?;
    if hex.len() % 2 != 0 {
        return None;
    }
    let nib = |c: u8| match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    };
    hex.chunks_exact(2)
        .map(|p| Some(nib(p[0])? << 4 | nib(p[1])?))
        .collect::<Option<Vec<u8>>>()
        .map(Bytes::from)
}

/// The headers column: a JSON object; string values as they are, other values as their JSON text.
/// Names must be valid header names and must not override the relay's own headers.
fn parse_headers(json: &str, cloudevents: bool) -> Result<Vec<(String, String)>, String> {
    let value: serde_json::Value =
        serde_json::from_str(json).map_err(|e| format!("not JSON ({e})"))?;
    let serde_json::Value::Object(map) = value else {
        return Err("not a JSON object".into());
    };
    let mut out = Vec::with_capacity(map.len());
    for (k, v) in map {
        crate::message::check_header_name(&k, cloudevents)?;
        let v = match v {
            serde_json::Value::String(s) => s,
            other => other.to_string(),
        };
        if v.contains(['\r', '\n']) {
            return Err(format!("the value of {k:?} contains a line break"));
        }
        out.push((k, v));
    }
    Ok(out)
}

#[cfg(test)]
mod tests;
