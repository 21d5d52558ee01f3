//! `outbox-relay parked`: the parked keys as the stream shows them (the parking ledger's paged read
//! of `<dead_letter_subject>.parked.>`, headers only), each with its key
//! (escaped), the count of its parked events, since when, the reason, the poison event's id and its
//! parking subject; and whether one named key is parked (`requeue`'s check), from the newest message
//! of that key's own parking subject. Read-only, with the relay's NATS user.
//!
//! Bounded: at most `outbox.max_parked_keys` keys are listed (the relay stops before it parks more),
//! each field cut by the ledger; a stream that shows more says so in the last line.

use std::fmt;
use std::time::Duration;

use serde::Serialize;

use super::key::Key;
use crate::config::Settings;
use crate::nats::{NatsError, NatsPort, SubjectRead, connect_nats};
use crate::parking::ledger::{Mark, ParkedEntry, each_parked, mark};
use crate::parking::{KeyHash, parked_subject};
use crate::text::shown;

/// How long the read waits for the server's next message.
const READ_TIMEOUT: Duration = Duration::from_secs(10);

/// The most of a header value a line shows.
const SHOWN_BYTES: usize = 300;

/// One parked key, as `parked` prints it (and as `--json` writes it).
#[derive(Clone, Debug, Serialize)]
pub struct Parked {
    /// `Outbox-Aggregate-Type` of the key's newest parked copy, escaped; `None` when absent.
    pub aggregate_type: Option<String>,
    /// `Outbox-Aggregate-Id`, escaped; `None` when absent (a NULL id).
    pub aggregate_id: Option<String>,
    /// Events in the key's current run, the poison included.
    pub count: u64,
    /// The poison's commit time (RFC 3339).
    pub since: String,
    /// The first failure's reason, escaped.
    pub reason: String,
    /// The poison event's id, escaped.
    pub poison: String,
    /// The key's parking subject.
    pub subject: String,
}

impl Parked {
    /// One key as the ledger read it, each field an escaped line of at most 300 bytes.
    pub(crate) fn from_entry(e: &ParkedEntry) -> Parked {
        let show = |v: &str| shown(v, SHOWN_BYTES);
        Parked {
            aggregate_type: e.aggregate_type.as_deref().map(show),
            aggregate_id: e.aggregate_id.as_deref().map(show),
            count: e.parked.count,
            since: show(&e.parked.since),
            reason: show(&e.parked.reason),
            poison: show(&e.parked.poison),
            subject: show(&e.subject),
        }
    }
}

/// `Claim/4711: 2 events parked since … behind e-7001: <reason> (subject …)`.
impl fmt::Display for Parked {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ty = self.aggregate_type.as_deref().unwrap_or("(no type)");
        match &self.aggregate_id {
            Some(id) => write!(f, "{ty}/{id}")?,
            None => write!(f, "{ty} (NULL id)")?,
        }
        let events = if self.count == 1 { "event" } else { "events" };
        write!(
            f,
            ": {} {events} parked since {} behind {}: {} (subject {})",
            self.count, self.since, self.poison, self.reason, self.subject
        )
    }
}

/// What the stream shows parked.
#[derive(Clone, Debug, Serialize)]
pub struct ParkedReport {
    /// The stream read.
    pub stream: String,
    /// The parked keys, in the order the stream gave them (by parking subject).
    pub parked: Vec<Parked>,
    /// The events they hold.
    pub events: u64,
    /// Whether the stream shows more keys than were listed (`outbox.max_parked_keys`).
    pub more: bool,
    /// The command that releases a key, with the `--config` (and variables) this one ran with.
    #[serde(skip)]
    pub requeue: String,
}

impl ParkedReport {
    /// 0 no key parked, 1 some.
    pub fn exit_code(&self) -> u8 {
        u8::from(!self.parked.is_empty())
    }
}

/// One line per key, then a summary line.
impl fmt::Display for ParkedReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.parked.is_empty() {
            return writeln!(f, "parked: no key is parked in stream {}", self.stream);
        }
        for p in &self.parked {
            writeln!(f, "{p}")?;
        }
        let keys = self.parked.len();
        writeln!(
            f,
            "parked: {keys} key{} ({} events){} in stream {}; fix the cause, then {} (or --discard): \
             docs/recovery.md, \"A parked key\"",
            if keys == 1 { "" } else { "s" },
            self.events,
            if self.more {
                ", and more past outbox.max_parked_keys"
            } else {
                ""
            },
            self.stream,
            self.requeue
        )
    }
}

/// Why the stream could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ParkedError {
    /// NATS cannot be reached or refuses the relay's user.
    #[error(transparent)]
    Connect(#[from] crate::nats::ConnectError),
    /// The read failed.
    #[error("reading the parking subjects of stream {stream} ({filter})")]
    Read {
        /// The stream.
        stream: String,
        /// The subjects read.
        filter: String,
        /// Why.
        #[source]
        source: NatsError,
    },
}

/// Every parked key `settings`' stream shows, at most `outbox.max_parked_keys` of them.
pub async fn parked(settings: &Settings) -> Result<ParkedReport, ParkedError> {
    let config = settings.config();
    let (stream, dead_letter) = (&config.nats.stream, &config.nats.dead_letter_subject);
    let port = NatsPort::from(connect_nats(settings).await?);
    let max = usize::try_from(config.outbox.max_parked_keys).unwrap_or(usize::MAX);
    let mut report = ParkedReport {
        stream: stream.clone(),
        parked: Vec::new(),
        events: 0,
        more: false,
        requeue: settings.command("requeue --key TYPE/ID"),
    };
    let read = each_parked(&port, stream, dead_letter, max, READ_TIMEOUT, |e| {
        if report.parked.len() >= max {
            report.more = true;
            return Err(());
        }
        report.events = report.events.saturating_add(e.parked.count);
        report.parked.push(Parked::from_entry(&e));
        Ok(())
    })
    .await
    .map_err(|source| ParkedError::Read {
        stream: stream.clone(),
        filter: format!("{dead_letter}.parked.>"),
        source,
    })?;
    // Stopped at the bound: `more` says so.
    let _ = read;
    Ok(report)
}

/// Whether `key` is parked: the newest message of its parking subject is a parked copy.
pub(super) async fn is_parked(settings: &Settings, key: &Key) -> Result<bool, ParkedError> {
    let config = settings.config();
    let (stream, dead_letter) = (&config.nats.stream, &config.nats.dead_letter_subject);
    let hash = KeyHash::of(Some(&key.aggregate_type), key.aggregate_id.as_deref());
    let subject = parked_subject(dead_letter, hash);
    let port = NatsPort::from(connect_nats(settings).await?);
    let failed = |source| ParkedError::Read {
        stream: stream.clone(),
        filter: subject.clone(),
        source,
    };
    let mut read = port
        .read_subjects(stream, &subject, SubjectRead::Last, READ_TIMEOUT)
        .await
        .map_err(failed)?;
    Ok(match read.next().await.map_err(failed)? {
        Some(m) => matches!(mark(&m.headers), Mark::Copy(_)),
        None => false,
    })
}
