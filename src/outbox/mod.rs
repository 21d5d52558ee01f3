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
//!
//! The stage does no I/O. When it needs the outbox table's partitions to place a Relation, its
//! step asks for them ([`Step::LookUpPartitions`]) and the caller answers
//! ([`OutboxStage::partitions_found`]).
//!
//! Files by role: `row.rs` (an INSERT as an event), `event_message.rs` (a logical message as
//! one), `context.rs` (trace context messages), `headers.rs` (an event's own headers as JSON);
//! what an event is, and its id rules, are `crate::event`'s.

mod context;
mod control;
mod event_message;
mod headers;
mod row;

use std::collections::HashMap;
use std::sync::Arc;

use crate::Lsn;
use crate::config::OutboxConfig;
use crate::event::OutboxEvent;
use crate::pgoutput::{Message, Relation};
use crate::schema::{PendingCheck, SchemaMetrics, SchemaReader, Schemas};
use row::OutboxColumns;

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
    /// A Relation message the stage cannot place before it knows the outbox table's partitions
    /// (only with [`OutboxStage::with_partition_lookup`]): look them up and hand them to
    /// [`OutboxStage::partitions_found`] before the next step.
    LookUpPartitions,
    /// A control message (`outbox.on_invalid = "park"`): release a parked key, at `at` (one index
    /// of its transaction; what it expands to takes that index's sub-positions).
    Control {
        /// What it asks.
        control: crate::parking::control::Control,
        /// Its position.
        at: crate::position::Position,
        /// Its transaction's commit time.
        commit_ts: i64,
    },
    /// A message under the control prefix that is no control message (or not transactional):
    /// warned about with its LSN, counted, ignored.
    ControlIgnored {
        /// Where its record is.
        lsn: Lsn,
        /// Why it is ignored, one line.
        why: String,
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
    /// Whether a Relation the stage cannot place asks for the partitions
    /// ([`Step::LookUpPartitions`]) rather than being taken for another table.
    looks_up_partitions: bool,
    /// The Relation waiting for the answer to [`Step::LookUpPartitions`].
    unplaced: Option<Relation>,
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
    /// The control prefix, when control messages are read (every relay session reads them).
    control_prefix: Option<String>,
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
            looks_up_partitions: false,
            unplaced: None,
            commit_lsn: Lsn::ZERO,
            commit_ts: 0,
            index: 0,
            in_txn: false,
            schemas: None,
            context: Vec::new(),
            control_prefix: None,
        }
    }

    /// Reads control messages under `prefix` ([`Step::Control`]).
    pub(crate) fn with_control(mut self, prefix: String) -> Self {
        self.control_prefix = Some(prefix);
        self
    }

    /// Checks `event` again against the schemas in force now (a parked event requeued): its
    /// problem set when it fails, a large payload's check left for the sink.
    pub(crate) fn check_again(&mut self, event: &mut crate::event::OutboxEvent) {
        self.check(event, false);
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

    /// Asks for the outbox table's partitions ([`Step::LookUpPartitions`]) whenever a Relation
    /// arrives that it has not seen in this session and cannot place: a partition attached since
    /// the partitions were last looked up, sent under its own name by a publication without
    /// `publish_via_partition_root`. Without it, such a Relation is another table's.
    pub(crate) fn with_partition_lookup(mut self) -> Self {
        self.looks_up_partitions = true;
        self
    }

    /// Interprets one decoded message.
    pub fn step(&mut self, msg: Message) -> Result<Step, StageError> {
        match msg {
            Message::Begin {
                final_lsn,
                commit_ts,
                ..
            } => self.begin(final_lsn, commit_ts),
            Message::Commit {
                commit_lsn,
                end_lsn,
                ..
            } => self.commit(commit_lsn, end_lsn),
            Message::Relation(rel) => Ok(self.relation(rel)),
            Message::Insert {
                relation_id, new, ..
            } => self.insert(relation_id, new),
            Message::Update { relation_id, .. } => Ok(self.ignored(relation_id, "update")),
            Message::Delete { relation_id, .. } => Ok(self.ignored(relation_id, "delete")),
            Message::Truncate { relation_ids, .. } => Ok(self.truncated(&relation_ids)),
            Message::Message {
                transactional,
                lsn,
                prefix,
                content,
                ..
            } if !self.config.message_prefix.is_empty() && prefix == self.config.message_prefix => {
                self.event_message(transactional, lsn, &prefix, content)
            }
            Message::Message {
                transactional,
                lsn,
                prefix,
                content,
                ..
            } if !self.config.context_prefix.is_empty() && prefix == self.config.context_prefix => {
                self.context_message(transactional, lsn, &prefix, content)
            }
            Message::Message {
                transactional,
                lsn,
                prefix,
                content,
                ..
            } if self.control_prefix.as_deref() == Some(prefix.as_str()) => {
                self.control_message(transactional, lsn, content)
            }
            Message::StreamStart { .. } => Err(StageError::Unrequested("Stream Start")),
            Message::BeginPrepare { .. } => Err(StageError::Unrequested("Begin Prepare")),
            // Named one by one, not `_`: a message kind the decoder learns must be decided here.
            // A logical message under another prefix is someone else's; an origin or a type says
            // nothing the stage uses; the rest of the streaming and two-phase messages only follow
            // a Stream Start or a Begin Prepare, refused above.
            Message::Message { .. }
            | Message::Origin { .. }
            | Message::Type { .. }
            | Message::StreamStop
            | Message::StreamCommit { .. }
            | Message::StreamAbort { .. }
            | Message::Prepare { .. }
            | Message::StreamPrepare { .. }
            | Message::CommitPrepared { .. }
            | Message::RollbackPrepared { .. } => Ok(Step::Nothing),
        }
    }

    /// A transaction starts: its events count from 0, with no trace context yet.
    fn begin(&mut self, final_lsn: Lsn, commit_ts: i64) -> Result<Step, StageError> {
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
        Ok(Step::Begin { final_lsn })
    }

    /// The open transaction commits, at the LSN its Begin announced.
    fn commit(&mut self, commit_lsn: Lsn, end_lsn: Lsn) -> Result<Step, StageError> {
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
        Ok(Step::Commit {
            commit_lsn,
            end_lsn,
        })
    }

    /// `event`, the open transaction's next: the place after it is the next event's.
    fn next_event(&mut self, event: OutboxEvent) -> Step {
        self.index += 1;
        Step::Event(Box::new(event))
    }

    /// A Relation: the outbox table's (or a partition's) columns, or none for another table; one
    /// the stage cannot place yet waits for the partitions when it looks them up.
    fn relation(&mut self, rel: Relation) -> Step {
        if self.looks_up_partitions && self.is_new_foreign_relation(&rel) {
            // Once per relation and session: is it a partition attached since we looked?
            self.unplaced = Some(rel);
            return Step::LookUpPartitions;
        }
        self.place(rel);
        Step::Nothing
    }

    fn place(&mut self, rel: Relation) {
        let outbox = self.is_outbox(&rel) || self.partitions.contains(&rel.id);
        let cols = outbox.then(|| self.columns(&rel));
        self.relations.insert(rel.id, cols);
    }

    /// The answer to [`Step::LookUpPartitions`]: the outbox table's partitions now. The Relation
    /// that asked is placed with them.
    pub(crate) fn partitions_found(&mut self, oids: impl IntoIterator<Item = u32>) {
        self.set_partitions(oids);
        if let Some(rel) = self.unplaced.take() {
            self.place(rel);
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
    /// name: it may be a partition the stage has not been told about yet.
    fn is_new_foreign_relation(&self, rel: &Relation) -> bool {
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
        let verdict = set.check(event_type, &event.payload, bytea);
        event.record(verdict, metrics);
    }

    fn ignored(&self, relation_id: u32, kind: &'static str) -> Step {
        match self.relations.get(&relation_id) {
            Some(Some(_)) => Step::IgnoredChange(kind),
            _ => Step::Nothing,
        }
    }

    /// A truncate: counted when it names the outbox table.
    fn truncated(&self, relation_ids: &[u32]) -> Step {
        if relation_ids
            .iter()
            .any(|id| matches!(self.relations.get(id), Some(Some(_))))
        {
            Step::IgnoredChange("truncate")
        } else {
            Step::Nothing
        }
    }

    fn is_outbox(&self, rel: &Relation) -> bool {
        // pgoutput sends "" for pg_catalog; the outbox is never there.
        rel.name == self.table && rel.namespace == self.schema
    }
}

#[cfg(test)]
mod tests;
