//! Finding one event's dead letter in the stream, for a `requeue_event` control message: a
//! headers-only read of exactly `nats.dead_letter_subject` (not the `.parked.>` subjects below it)
//! through the NATS port, so the simulation's JetStream answers it too, that keeps one sequence,
//! the newest dead letter whose `Outbox-Event-Id` (or, for a dead letter from before dead letters
//! had ids of their own, `Nats-Msg-Id`) is the event's id; then that one message is read again
//! with its payload. The read holds one message's headers at a time, and the port's read takes
//! the stream in bounded pages (a new consumer every few thousand deliveries), so memory stays
//! bounded however many dead letters the stream holds; its time grows with their number.
//!
//! The newest, not the first: a requeued event still invalid is dead-lettered again
//! (`dead-letter:<id>:<request>`) with today's reason, and a later requeue should start from that.

use std::time::Duration;

use super::revive::dead_letter_event_id;
use crate::nats::{NatsError, NatsErrorKind, NatsPort, StoredMessage, SubjectRead};

/// The newest dead letter of the event `event_id` on `dead_letter_subject`, with its payload;
/// `None` when the stream holds none (never written, or gone: a limit, a purge).
pub async fn find(
    port: &NatsPort,
    stream: &str,
    dead_letter_subject: &str,
    event_id: &str,
    timeout: Duration,
) -> Result<Option<StoredMessage>, NatsError> {
    let mut read = port
        .read_subjects(
            stream,
            dead_letter_subject,
            SubjectRead::Headers(1),
            timeout,
        )
        .await?;
    let mut newest = None;
    while let Some(m) = read.next().await? {
        if m.subject == dead_letter_subject && dead_letter_event_id(&m.headers) == Some(event_id) {
            newest = Some(m.seq);
        }
    }
    drop(read);
    let Some(seq) = newest else {
        return Ok(None);
    };
    let mut read = port
        .read_subjects(stream, dead_letter_subject, SubjectRead::From(seq), timeout)
        .await?;
    match read.next().await? {
        Some(m) if m.seq == seq && dead_letter_event_id(&m.headers) == Some(event_id) => {
            Ok(Some(m))
        }
        // Gone between the two reads (a limit, a purge): as if never found.
        Some(m) if m.seq > seq => Ok(None),
        None => Ok(None),
        Some(m) => Err(NatsError::new(
            NatsErrorKind::Other,
            format!(
                "reading dead letter {seq} of stream {stream} gave message {} instead",
                m.seq
            ),
        )),
    }
}
