//! The JetStream stream as `status` reads it: its state, counts, limits and metadata, or why they
//! are unknown (NATS unreachable, JetStream not enabled or not answering), and how far the stream's
//! tail says it holds the slot's events (what the stop mark is judged against). It reads only; what
//! the stream's state means is judged in `checks.rs` and `slot.rs`.

use super::report::{State, StreamStatus};
use crate::config::Settings;
use crate::nats::connect_nats;
use crate::slot_mark;

/// The stream `name` before NATS answered: every field unknown.
pub(super) fn unknown_stream(name: &str) -> StreamStatus {
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
        metadata: Default::default(),
    }
}

pub(super) async fn read_stream(settings: &Settings, problems: &mut Vec<String>) -> StreamStatus {
    let name = &settings.config().nats.stream;
    let mut st = unknown_stream(name);
    let client = match connect_nats(settings).await {
        Ok(c) => c,
        Err(e) => {
            let error = crate::error_chain::error_chain(&e);
            st.unknown_because = Some(format!("NATS unreachable ({error})"));
            problems.push(error);
            return st;
        }
    };
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
            }
            Err(e) => {
                st.unknown_because = Some(format!("JetStream did not answer ({e})"));
                problems.push(format!("JetStream stream {name}: {e}"));
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
                problems.push(format!("JetStream stream {name}: {e}"));
            }
            _ => {
                st.state = State::JetstreamDisabled;
                st.unknown_because = Some("JetStream not available".into());
                problems.push(
                    "NATS answers, but JetStream is not available: start nats-server with -js"
                        .into(),
                );
            }
        },
    }
    st
}

/// How far the stream's tail, read through `nats`, says the stream holds the slot's events.
pub(super) async fn stored_by_tail(
    nats: &crate::nats::NatsPort,
    slot: &str,
    stream: &str,
) -> slot_mark::Stored {
    // As long as any other request of status's client may take (async-nats' default).
    let timeout = std::time::Duration::from_secs(10);
    match crate::sink::read_tail(nats, stream, timeout).await {
        // status knows no timeline: the slot named in the tail is compared, not the history.
        Ok(tail) => slot_mark::Stored::from_tail(&tail, slot, None),
        Err(e) => slot_mark::Stored::Unknown(crate::error_chain::error_chain(&e)),
    }
}
