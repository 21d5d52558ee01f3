//! The JetStream stream as `status` reads it: its state, counts, limits and metadata, or why they
//! are unknown (NATS unreachable or refusing the credentials, JetStream not enabled or not
//! answering), the dead letters it holds (how many, and the newest one's headers, escaped), and how
//! far the stream's tail says it holds the slot's events (what the stop mark is judged against). It
//! reads only; what the stream's state means is judged in `checks.rs` and `slot.rs`.

use async_nats::jetstream;
use futures_util::TryStreamExt;

use super::facts::StreamRead;
use super::report::{DeadLetter, DeadLetters, State, unknown_stream};
use crate::config::Settings;
use crate::message;
use crate::nats::ConnectError;
use crate::slot_mark;
use crate::text::shown;

/// The stream `name` through NATS as [`Servers`](super::Servers) reached it (`nats`: its client,
/// or why it could not connect), with the problem the reading found, if any.
pub(super) async fn read_stream(
    settings: &Settings,
    nats: Result<&async_nats::Client, &ConnectError>,
) -> StreamRead {
    let name = &settings.config().nats.stream;
    let mut st = unknown_stream(name);
    let client = match nats {
        Ok(c) => c.clone(),
        Err(e) => {
            let error = crate::error_chain::error_chain(e);
            let (state, why) = match e {
                ConnectError::Unauthorized { .. } => {
                    (State::AuthFailed, "NATS refused the credentials")
                }
                ConnectError::Tls { .. } => (State::TlsFailed, "TLS to NATS failed"),
                _ => (State::Unreachable, "NATS unreachable"),
            };
            st.state = state;
            st.unknown_because = Some(format!("{why} ({error})"));
            return StreamRead {
                status: st,
                problem: Some(error),
            };
        }
    };
    let mut problem = None;
    let js = async_nats::jetstream::new(client);
    match js.get_stream(name).await {
        Ok(mut s) => match s.info().await {
            Ok(info) => {
                st.state = State::Exists;
                st.exists = Some(true);
                st.messages = Some(info.state.messages);
                st.bytes = Some(info.state.bytes);
                st.last_sequence = Some(info.state.last_sequence);
                st.subjects = Some(info.config.subjects.clone());
                st.storage = Some(format!("{:?}", info.config.storage).to_lowercase());
                st.replicas = Some(info.config.num_replicas);
                st.duplicate_window_secs = Some(info.config.duplicate_window.as_secs());
                // JetStream's "unlimited" is -1 (0 for max_age).
                st.max_msgs = u64::try_from(info.config.max_messages).ok();
                st.max_bytes = u64::try_from(info.config.max_bytes).ok();
                st.max_age_secs = Some(info.config.max_age.as_secs()).filter(|s| *s > 0);
                st.discard = Some(format!("{:?}", info.config.discard).to_lowercase());
                st.metadata = info.config.metadata.clone();
                let subject = &settings.config().nats.dead_letter_subject;
                st.dead_letters = dead_letters(&s, subject).await;
            }
            Err(e) => {
                st.unknown_because = Some(format!("JetStream did not answer ({e})"));
                problem = Some(format!("JetStream stream {name}: {e}"));
            }
        },
        Err(e) => match e.kind() {
            async_nats::jetstream::context::GetStreamErrorKind::JetStream(je)
                if je.error_code() == async_nats::jetstream::ErrorCode::STREAM_NOT_FOUND =>
            {
                st.state = State::Missing;
                st.exists = Some(false);
            }
            async_nats::jetstream::context::GetStreamErrorKind::JetStream(_) => {
                st.unknown_because = Some(format!("JetStream refused the lookup ({e})"));
                problem = Some(format!("JetStream stream {name}: {e}"));
            }
            _ => {
                st.state = State::JetstreamDisabled;
                st.unknown_because = Some("JetStream not available".into());
                problem = Some(
                    "NATS answers, but JetStream is not available: start nats-server with -js"
                        .into(),
                );
            }
        },
    }
    StreamRead {
        status: st,
        problem,
    }
}

/// The longest header value of a dead letter that `status` prints (a reason is one line well
/// below it; the event's own values may be longer).
const MAX_SHOWN: usize = 300;

/// The dead letters on `subject`: the count from the stream's per-subject state (one subject, so
/// one entry), the newest from its last message on that subject. `None` when the stream does not
/// answer (a permission, a server too old); the rest of the report stands without it.
async fn dead_letters(s: &jetstream::stream::Stream, subject: &str) -> Option<DeadLetters> {
    let mut counts = s.info_with_subjects(subject).await.ok()?;
    let mut count = 0u64;
    while let Some((_, n)) = counts.try_next().await.ok()? {
        count += n as u64;
    }
    let newest = if count == 0 {
        None
    } else {
        s.get_last_raw_message_by_subject(subject)
            .await
            .ok()
            .map(|m| {
                let header = |name: &str| m.headers.get(name).map(|v| shown(v.as_str(), MAX_SHOWN));
                DeadLetter {
                    sequence: m.sequence,
                    // µs since 2000-01-01, Postgres' epoch, which the formatter counts from.
                    time: message::rfc3339_micros(
                        i64::try_from(m.time.unix_timestamp_nanos() / 1000)
                            .unwrap_or(0)
                            .saturating_sub(946_684_800_000_000),
                    ),
                    event_id: header(message::EVENT_ID).or_else(|| header(message::NATS_MSG_ID)),
                    reason: header(message::ERROR),
                }
            })
    };
    Some(DeadLetters {
        subject: subject.to_owned(),
        count,
        newest,
    })
}

/// How far the stream's tail, read through `nats`, says the stream holds the slot's events.
pub(super) async fn stored_by_tail(
    nats: &crate::nats::NatsPort,
    slot: &str,
    stream: &str,
) -> slot_mark::Stored {
    // As long as any other request of status's client may take (async-nats' default).
    let timeout = std::time::Duration::from_secs(10);
    match crate::tail::read_tail(nats, stream, timeout).await {
        // status knows no timeline: the slot named in the tail is compared, not the history.
        Ok(tail) => slot_mark::Stored::from_tail(&tail, slot, None),
        Err(e) => slot_mark::Stored::Unknown(crate::error_chain::error_chain(&e)),
    }
}
