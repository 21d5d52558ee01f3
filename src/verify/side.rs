//! The stream side of a `verify` run, before any message is read: the connection, the stream, its
//! state and configuration, the limits that remove messages by themselves, the start a backfill
//! recorded, and from these the range of sequences that is the relay's: from the backfill's start
//! (or sequence 1) or `--from-sequence`, to the stream's last sequence.
//!
//! What lies before the stream's first message inside that range is gone. A limit that removes
//! the oldest messages whatever their age (`limits.rs`) or `--from-sequence` explains it: rows
//! created before the first message read are then older than the stream. `max_age` explains only
//! messages stored before `now - max_age`, and none in a stream created after that: rows created
//! after it are missing. Nothing else explains it (setup's default: `discard: new`, 7 days of
//! `max_age`, so a message deleted from a week-old stream's head is a hole, its row missing).

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
    /// When the stream was created, µs since the Unix epoch.
    pub(crate) created_unix_us: i64,
}

/// What explains the messages gone before the stream's first one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Head {
    /// In words, for the report.
    pub(crate) why: String,
    /// Only messages stored before this time (µs since the Unix epoch) can have gone that way
    /// (`max_age`); `None`: any message.
    pub(crate) before: Option<i64>,
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
            created_unix_us: (info.created.unix_timestamp_nanos() / 1000) as i64,
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

    /// Why the first message read is not the range's first, when something explains it: a limit
    /// that removes the oldest messages, `max_age` (for messages stored before `now - max_age`, in
    /// a stream older than that), or `--from-sequence` beyond the stream's first message. `None`
    /// when nothing is gone before it, or nothing explains it.
    pub(crate) fn head_explained(
        &self,
        from_sequence: Option<u64>,
        now_unix_us: i64,
    ) -> Option<Head> {
        let any = |why: &str| {
            Some(Head {
                why: why.to_owned(),
                before: None,
            })
        };
        if from_sequence.is_some_and(|f| f > self.state.first_sequence.max(1)) {
            return any("--from-sequence");
        }
        if self.head_gone() == 0 {
            return None;
        }
        if let Some(why) = self.limits.explains_any_head() {
            return any(why);
        }
        let max_age = self.limits.max_age?;
        let horizon = self.limits.age_horizon(self.created_unix_us, now_unix_us)?;
        Some(Head {
            why: format!("max_age {}s", max_age.as_secs()),
            before: Some(horizon),
        })
    }

    /// Rows created before the time this returns (µs) may have lost their message to `max_age`
    /// anywhere in the stream: with per-message TTLs allowed, a message that never expires can hold
    /// the head while those after it age out ([`Limits::aged_inside_before`]).
    pub(crate) fn aged_inside_before(&self, now_unix_us: i64) -> Option<i64> {
        self.limits
            .aged_inside_before(self.created_unix_us, now_unix_us)
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
