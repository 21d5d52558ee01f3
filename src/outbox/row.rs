//! An INSERT into the outbox table (or one of its partitions) as an event: where the configured
//! columns are in the table's current Relation ([`OutboxColumns`]), and the row's values read by
//! them. What is missing or malformed becomes the event's problem, never a wrong event.

use bytes::Bytes;

use super::{OutboxStage, StageError, Step, headers::parse_headers};
use crate::event::{JSON_CONTENT_TYPE, OutboxEvent, TEXT_CONTENT_TYPE, id_problems, message_id};
use crate::pgoutput::{Relation, TupleValue};

/// Type OIDs the mapping cares about (`pg_type.dat`).
pub(super) mod oid {
    pub(in crate::outbox) const BYTEA: u32 = 17;
    pub(in crate::outbox) const JSON: u32 = 114;
    pub(in crate::outbox) const JSONB: u32 = 3802;
    pub(in crate::outbox) const TEXT: u32 = 25;
    pub(in crate::outbox) const VARCHAR: u32 = 1043;
}

/// Positions of the configured columns in the outbox table's current Relation.
#[derive(Debug, Clone)]
pub(super) struct OutboxColumns {
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

impl OutboxStage {
    /// An insert: an event when it is into the outbox table, else nothing.
    pub(super) fn insert(
        &mut self,
        relation_id: u32,
        new: Vec<TupleValue>,
    ) -> Result<Step, StageError> {
        let cols = match self.relations.get(&relation_id) {
            None => return Err(StageError::UnknownRelation(relation_id)),
            Some(None) => return Ok(Step::Nothing),
            Some(Some(cols)) => cols,
        };
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
        Ok(self.next_event(event))
    }

    pub(super) fn columns(&self, rel: &Relation) -> OutboxColumns {
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

    /// The event of `row`, at the open transaction's next place.
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
        let mut text = |pos: Option<usize>, name: &str, required: bool| {
            text(pos.and_then(|p| row.get(p))?, name, required, &mut problems)
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
        let payload = self.payload(cols, &row, &mut problems);
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
        super::context::apply(&mut headers, &self.context);
        let msg_id = message_id(id.as_deref(), self.commit_lsn, self.index, &payload);
        OutboxEvent {
            msg_id,
            id,
            aggregate_type,
            aggregate_id,
            event_type,
            headers,
            problem: (!problems.is_empty()).then(|| problems.join("; ")),
            ..OutboxEvent::at(
                payload,
                self.commit_lsn,
                self.index,
                self.commit_ts,
                cols.content_type,
            )
        }
    }

    /// The payload column's value as it is published: as stored, or bytea's hex decoded.
    fn payload(
        &self,
        cols: &OutboxColumns,
        row: &[TupleValue],
        problems: &mut Vec<String>,
    ) -> Bytes {
        let column = &self.config.payload_column;
        match cols.payload.and_then(|p| row.get(p)) {
            Some(TupleValue::Text(b)) if cols.payload_is_bytea => match decode_bytea_hex(b) {
                Some(raw) => raw,
                None => {
                    problems.push(format!("column {column} is not bytea hex output"));
                    b.clone()
                }
            },
            Some(TupleValue::Text(b) | TupleValue::Binary(b)) => b.clone(),
            Some(TupleValue::UnchangedToast) => {
                problems.push(format!(
                    "column {column} was not sent (unchanged TOAST value)"
                ));
                Bytes::new()
            }
            Some(TupleValue::Null) | None => Bytes::new(),
        }
    }
}

/// A text column's value, or `None` with the reason in `problems` (a null is a problem only for
/// a `required` column).
fn text(v: &TupleValue, name: &str, required: bool, problems: &mut Vec<String>) -> Option<String> {
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
}

/// `\x48656c6c6f` → `Hello` (bytea's default `bytea_output = hex`).
pub(super) fn decode_bytea_hex(b: &[u8]) -> Option<Bytes> {
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
