//! The stream side of a `verify` run, before any message is read: the connection, the stream, its
//! state and configuration, the limits that remove messages by themselves, the start a backfill
//! recorded, and from these the range of sequences that is the relay's: from the backfill's start
//! (or sequence 1) or `--from-sequence`, to the stream's last sequence.
//!
//! What lies before the stream's first message inside that range is gone. A head limit
//! (`limits.rs`) or `--from-sequence` explains it: rows created before the first message read are
//! then older than the stream. Nothing explains it under setup's default limits (`discard: new`,
//! no `max_age`): the gone sequences are holes and those rows are missing.

use async_nats::jetstream::{self, stream};

use super::VerifyError;
use super::limits::Limits;
use crate::backfill::Start;
use crate::config::Settings;
use crate::nats::connect_nats;

/// The stream, looked at once before it is read.
pub(crate) struct StreamSide {
    /// The NATS connection.
    pub(crate) nats: async_nats::Client,
    /// The stream.
    pub(crate) stream: jetstream::stream::Stream,
    /// Its state when the run began.
    pub(crate) state: stream::State,
    /// What its configuration removes by itself.
    pub(crate) limits: Limits,
    /// The backfill that began the relay's history in it, if one did (`outbox-relay.start`).
    pub(crate) start: Option<Start>,
    /// The first sequence of the relay's range.
    pub(crate) range_start: u64,
    /// The first sequence read: the range's start, or the stream's first message when later.
    pub(crate) read_start: u64,
}

impl StreamSide {
    /// Connects and looks the stream up.
    pub(crate) async fn open(
        settings: &Settings,
        from_sequence: Option<u64>,
    ) -> Result<StreamSide, VerifyError> {
        let name = &settings.config().nats.stream;
        let nats = connect_nats(settings).await?;
        let js = jetstream::new(nats.clone());
        let mut stream = js
            .get_stream(name)
            .await
            .map_err(|e| stream_error(name, "looking it up (run `outbox-relay setup`?)", &e))?;
        let info = stream
            .info()
            .await
            .map_err(|e| stream_error(name, "reading its state", &e))?
            .clone();
        let start = Start::in_metadata(&info.config.metadata);
        let range_start = start
            .as_ref()
            .map_or(1, |s| s.sequence)
            .max(from_sequence.unwrap_or(1));
        Ok(StreamSide {
            nats,
            stream,
            read_start: range_start.max(info.state.first_sequence),
            limits: Limits::of(&info.config),
            state: info.state,
            start,
            range_start,
        })
    }

    /// The sequences of the range gone before the stream's first message.
    pub(crate) fn head_gone(&self) -> u64 {
        // An empty stream reports its first sequence as its last + 1 (or 0 when never written).
        self.state.first_sequence.saturating_sub(self.range_start)
    }

    /// Why the first message read is not the range's first, when something explains it: a head
    /// limit, or `--from-sequence` beyond the stream's first message. `None` when nothing is gone
    /// before it, or nothing explains it.
    pub(crate) fn head_explained(&self, from_sequence: Option<u64>) -> Option<String> {
        if from_sequence.is_some_and(|f| f > self.state.first_sequence.max(1)) {
            return Some("--from-sequence".to_owned());
        }
        if self.head_gone() == 0 {
            return None;
        }
        self.limits.explains_head().map(str::to_owned)
    }

    /// The stream's last sequence now.
    pub(crate) async fn last_sequence(&mut self) -> Result<u64, VerifyError> {
        let name = self.stream.cached_info().config.name.clone();
        Ok(self
            .stream
            .info()
            .await
            .map_err(|e| stream_error(&name, "reading its state", &e))?
            .state
            .last_sequence)
    }
}

/// [`VerifyError::Stream`] for `what` on stream `name`.
pub(crate) fn stream_error(name: &str, what: &str, e: &dyn std::fmt::Display) -> VerifyError {
    VerifyError::Stream {
        stream: name.to_owned(),
        what: what.to_owned(),
        detail: e.to_string(),
    }
}
