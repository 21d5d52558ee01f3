//! `outbox-relay status`: the slot and the stream as the servers see them, and a verdict.
//!
//! Healthy means: the slot exists and is not invalidated, and the stream exists. Everything else is
//! reported as a problem, and `status` exits 1. It reads only; it never creates or changes anything.

use serde::Serialize;

use crate::config::Config;
use crate::setup::{connect_nats, connect_postgres};

/// The slot as `pg_replication_slots` shows it.
#[derive(Debug, Clone, Serialize)]
pub struct SlotStatus {
    pub name: String,
    pub exists: bool,
    pub active: bool,
    pub active_pid: Option<i32>,
    pub confirmed_flush_lsn: Option<String>,
    /// `pg_current_wal_lsn() - confirmed_flush_lsn`.
    pub lag_bytes: Option<i64>,
    /// `pg_current_wal_lsn() - restart_lsn`: WAL the slot keeps on disk.
    pub retained_bytes: Option<i64>,
    pub wal_status: Option<String>,
    pub safe_wal_size: Option<i64>,
}

/// The stream as JetStream reports it.
#[derive(Debug, Clone, Serialize)]
pub struct StreamStatus {
    pub name: String,
    pub exists: bool,
    pub messages: u64,
    pub bytes: u64,
    pub last_sequence: u64,
    pub subjects: Vec<String>,
    pub storage: String,
    pub replicas: usize,
    pub duplicate_window_secs: u64,
}

/// Everything `status` prints.
#[derive(Debug, Clone, Serialize)]
pub struct Status {
    pub healthy: bool,
    pub slot: SlotStatus,
    pub publication: PublicationStatus,
    pub stream: StreamStatus,
    pub problems: Vec<String>,
    pub warnings: Vec<String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct PublicationStatus {
    pub name: String,
    pub exists: bool,
    pub tables: Vec<String>,
}

/// Gathers the status. Errors only when a server cannot be reached at all.
/// `max_lag_bytes`: a slot further behind than this is a problem (the relay is stalled or too slow).
pub async fn status(
    config: &Config,
    max_lag_bytes: i64,
) -> Result<Status, crate::setup::SetupError> {
    let pg = connect_postgres(config).await?;
    let q = |e: tokio_postgres::Error| crate::setup::SetupError(format!("postgres: {e}"));
    let slot_name = &config.postgres.slot;
    let row = pg
        .query_opt(
            "SELECT active, active_pid, confirmed_flush_lsn::text, \
             (pg_current_wal_lsn() - confirmed_flush_lsn)::int8, \
             (pg_current_wal_lsn() - restart_lsn)::int8, wal_status, safe_wal_size \
             FROM pg_replication_slots WHERE slot_name = $1",
            &[slot_name],
        )
        .await
        .map_err(q)?;
    let slot = match row {
        None => SlotStatus {
            name: slot_name.clone(),
            exists: false,
            active: false,
            active_pid: None,
            confirmed_flush_lsn: None,
            lag_bytes: None,
            retained_bytes: None,
            wal_status: None,
            safe_wal_size: None,
        },
        Some(r) => SlotStatus {
            name: slot_name.clone(),
            exists: true,
            active: r.get(0),
            active_pid: r.get(1),
            confirmed_flush_lsn: r.get(2),
            lag_bytes: r.get(3),
            retained_bytes: r.get(4),
            wal_status: r.get(5),
            safe_wal_size: r.get(6),
        },
    };
    let publication_name = &config.postgres.publication;
    let exists = pg
        .query_opt(
            "SELECT 1 FROM pg_publication WHERE pubname = $1",
            &[publication_name],
        )
        .await
        .map_err(q)?
        .is_some();
    let tables = pg
        .query(
            "SELECT schemaname || '.' || tablename FROM pg_publication_tables WHERE pubname = $1 ORDER BY 1",
            &[publication_name],
        )
        .await
        .map_err(q)?
        .iter()
        .map(|r| r.get::<_, String>(0))
        .collect();
    let publication = PublicationStatus {
        name: publication_name.clone(),
        exists,
        tables,
    };

    let mut problems = Vec::new();
    let mut warnings = Vec::new();
    let stream_name = &config.nats.stream;
    // NATS being down is a finding of status, not a reason to hide the slot's state.
    let js = match connect_nats(config).await {
        Ok(c) => Some(async_nats::jetstream::new(c)),
        Err(e) => {
            problems.push(e.to_string());
            None
        }
    };
    let lookup = async {
        match &js {
            Some(js) => js.get_stream(stream_name).await.ok(),
            None => None,
        }
    };
    let stream = match lookup.await {
        Some(mut s) => match s.info().await {
            Ok(info) => StreamStatus {
                name: stream_name.clone(),
                exists: true,
                messages: info.state.messages,
                bytes: info.state.bytes,
                last_sequence: info.state.last_sequence,
                subjects: info.config.subjects.clone(),
                storage: format!("{:?}", info.config.storage).to_lowercase(),
                replicas: info.config.num_replicas,
                duplicate_window_secs: info.config.duplicate_window.as_secs(),
            },
            Err(_) => missing_stream(stream_name),
        },
        None => missing_stream(stream_name),
    };

    if !slot.exists {
        problems.push(format!(
            "slot {slot_name} does not exist: run outbox-relay setup"
        ));
    }
    if slot.wal_status.as_deref() == Some("lost") {
        problems.push(crate::setup::lost_slot_message(slot_name));
    }
    if !publication.exists {
        problems.push(format!(
            "publication {publication_name} does not exist: run outbox-relay setup"
        ));
    }
    if js.is_some() && !stream.exists {
        problems.push(format!(
            "stream {stream_name} does not exist: run outbox-relay setup"
        ));
    }
    if let Some(lag) = slot.lag_bytes.filter(|&l| l > max_lag_bytes) {
        problems.push(format!(
            "slot {slot_name} is {lag} bytes behind the WAL (more than {max_lag_bytes}): is the relay running and acknowledged?"
        ));
    }
    if stream.exists && stream.storage == "memory" {
        warnings.push(
            "stream uses memory storage: acknowledged events do not survive a nats-server restart"
                .into(),
        );
    }
    if stream.exists && stream.storage == "file" && stream.replicas == 1 {
        warnings.push(
            "stream has one replica: an ack means written to that server's OS, not fsynced; power loss can \
             lose acknowledged events unless nats-server runs with sync_interval: always (or use 3 replicas)"
                .into(),
        );
    }
    // A republish after a failure comes at most one ack timeout plus the longest backoff (30 s) after
    // the first attempt; a shorter duplicate window lets such a republish be stored twice.
    let retry_horizon = config.nats.ack_timeout_ms / 1000 + 30;
    if stream.exists && stream.duplicate_window_secs < retry_horizon {
        warnings.push(format!(
            "stream duplicate window is {}s, shorter than the relay's retry horizon of {retry_horizon}s: \
             republished events may be stored twice; raise the stream's duplicate_window",
            stream.duplicate_window_secs
        ));
    }
    Ok(Status {
        healthy: problems.is_empty(),
        slot,
        publication,
        stream,
        problems,
        warnings,
    })
}

fn missing_stream(name: &str) -> StreamStatus {
    StreamStatus {
        name: name.to_owned(),
        exists: false,
        messages: 0,
        bytes: 0,
        last_sequence: 0,
        subjects: Vec::new(),
        storage: String::new(),
        replicas: 0,
        duplicate_window_secs: 0,
    }
}

impl Status {
    /// The human-readable form.
    pub fn render_text(&self) -> String {
        let s = &self.slot;
        let opt = |v: &Option<String>| v.clone().unwrap_or_else(|| "-".into());
        let num = |v: Option<i64>| v.map_or_else(|| "-".into(), |n| n.to_string());
        let mut out = String::new();
        out.push_str(&format!(
            "slot {}: {}{} confirmed {} lag {} bytes retained {} bytes wal_status {}\n",
            s.name,
            if s.exists { "exists" } else { "MISSING" },
            if s.active { ", active" } else { ", inactive" },
            opt(&s.confirmed_flush_lsn),
            num(s.lag_bytes),
            num(s.retained_bytes),
            opt(&s.wal_status),
        ));
        out.push_str(&format!(
            "publication {}: {} tables [{}]\n",
            self.publication.name,
            if self.publication.exists {
                "exists,"
            } else {
                "MISSING,"
            },
            self.publication.tables.join(", ")
        ));
        let st = &self.stream;
        out.push_str(&format!(
            "stream {}: {} {} messages {} bytes last sequence {} storage {} replicas {} duplicate window {}s\n",
            st.name,
            if st.exists { "exists," } else { "MISSING," },
            st.messages,
            st.bytes,
            st.last_sequence,
            st.storage,
            st.replicas,
            st.duplicate_window_secs
        ));
        for w in &self.warnings {
            out.push_str(&format!("warning: {w}\n"));
        }
        for p in &self.problems {
            out.push_str(&format!("problem: {p}\n"));
        }
        out.push_str(if self.healthy {
            "healthy\n"
        } else {
            "NOT healthy\n"
        });
        out
    }
}
