//! Where an event whose only copies are parked stands: `parked` while its last parked copy is in
//! its key's current run (no release marker after it on the key's parking subject), `discarded`
//! once a marker ended that run without republishing it (a requeue republishes the run: the
//! event's copy on its own subject then makes the row delivered, and one still invalid is parked
//! again, in the new run). Decided from the stream through the parking ledger's own reader
//! (`parking::ledger::run_bounds`), never from memory, as the relay decides a release.
//!
//! Each key's subject is read once (headers only, one message at a time) and its last marker
//! kept: memory is one entry per parked key met, which the relay bounds by
//! `outbox.max_parked_keys`.

use std::collections::HashMap;
use std::time::Duration;

use async_nats::jetstream;

use super::class::Class;
use super::compare::event_id;
use super::detail::Detail;
use crate::config::Settings;
use crate::message::ERROR;
use crate::message::parked::PARKED_BEHIND;
use crate::nats::NatsPort;
use crate::parking::ledger::run_bounds;
use crate::parking::{KeyHash, key_of_subject};

/// How long a read of a parking subject waits for the server's next message.
const READ_TIMEOUT: Duration = Duration::from_secs(30);

/// No release marker carries this request (a header value holds no line break): the read finds
/// the key's last marker.
const NO_REQUEST: &str = "\n";

/// What a parked copy says: its class, its sequence and a detail.
pub(crate) type ParkedFinding = (Class, Option<u64>, Option<Detail>);

/// The runs of the parked keys met so far.
pub(crate) struct ParkedRuns<'a> {
    settings: &'a Settings,
    port: NatsPort,
    /// Per key: the sequence of its last release marker (0: none).
    last_marker: HashMap<KeyHash, u64>,
}

impl<'a> ParkedRuns<'a> {
    /// Nothing read yet; the parking subjects are read through `client`.
    pub(crate) fn new(settings: &'a Settings, client: &async_nats::Client) -> Self {
        ParkedRuns {
            settings,
            port: NatsPort::from(client.clone()),
            last_marker: HashMap::new(),
        }
    }

    /// The class of event `id` whose last parked copy is at `seq` (`id`: `None` for an event no
    /// row has, taken from the copy). `None` when the copy is gone or carries another id (a hash
    /// collision proposed it). A parking subject that cannot be read makes it `unknown`, never
    /// delivered.
    pub(crate) async fn class(
        &mut self,
        stream: &jetstream::stream::Stream,
        id: Option<&str>,
        seq: u64,
    ) -> Option<(String, ParkedFinding)> {
        let m = stream.get_raw_message(seq).await.ok()?;
        let found = event_id(Some(&m.headers))?.to_owned();
        if id.is_some_and(|id| id != found) {
            return None;
        }
        let n = &self.settings.config().nats;
        let key = key_of_subject(&n.dead_letter_subject, &m.subject)?;
        let header = |h: &str| m.headers.get(h).map_or("", |v| v.as_str()).to_owned();
        let after = match self.last_marker.get(&key) {
            Some(&a) => a,
            None => {
                let read = run_bounds(
                    &self.port,
                    &n.stream,
                    &n.dead_letter_subject,
                    key,
                    NO_REQUEST,
                    READ_TIMEOUT,
                );
                match read.await {
                    Ok(b) => *self.last_marker.entry(key).or_insert(b.after),
                    Err(e) => {
                        let why = Detail::RunUnread {
                            subject: m.subject.to_string(),
                            why: crate::error_chain::error_chain(&e),
                        };
                        return Some((found, (Class::Unknown, Some(seq), Some(why))));
                    }
                }
            }
        };
        let subject = m.subject.to_string();
        let (class, detail) = if seq > after {
            let (behind, reason) = (header(PARKED_BEHIND), header(ERROR));
            let detail = Detail::Parked {
                subject,
                behind,
                reason,
            };
            (Class::Parked, detail)
        } else {
            (Class::Discarded, Detail::Discarded { subject, at: after })
        };
        Some((found, (class, Some(seq), Some(detail))))
    }
}
