//! What a session starts from ([`open`]): the stream's tail read when fencing, what an earlier
//! session's distrust makes of it ([`Distrust::verdict`]), the message before a cut-off replay when
//! the tail names one, the fence and its replay built from them, the history every message will
//! name, and the stream's `max_msg_size` (read with or without the fence). Each step is a function
//! of its own; the sink (`mod.rs`) builds its parts from the result.

use tracing::{debug, warn};

use super::config::SinkConfig;
use super::distrust::{Distrust, Verdict};
use super::fence::Fence;
use super::port::read_tail;
use super::replay::Replay;
use super::tail::{Origin, Stamp, Tail, TailError};
use crate::nats::NatsPort;

/// What a session starts from.
pub(super) struct Opening {
    /// The fence, on a fenced stream.
    pub(super) fence: Option<Fence>,
    /// The history every message's `Outbox-Position` names (`None` where there is none).
    pub(super) history: Option<String>,
    /// The stream's `max_msg_size`, when it has one and it could be read.
    pub(super) max_msg_size: Option<usize>,
    /// The stream's last sequence when fencing (0 without the fence).
    pub(super) last_sequence: u64,
}

/// Reads what a session of `config` starts from through `port`. `origin`: the history the session
/// streams (`None` where there is none, e.g. a backfill: nothing is skipped and positions name no
/// history); `distrust`: why and which tail an earlier session of this process found unreliable.
pub(super) async fn open(
    port: &NatsPort,
    config: &SinkConfig,
    origin: Option<&Origin>,
    distrust: Option<&Distrust>,
) -> Result<Opening, TailError> {
    let mut history = origin.map(|o| o.history.to_string());
    let tail = if config.fence {
        let tail = read_tail(port, &config.stream, config.ack_timeout).await?;
        debug!(last_sequence = tail.last_sequence, last = ?tail.last, "stream tail");
        Some(tail)
    } else {
        None
    };
    let fence = match &tail {
        Some(tail) => {
            let verdict = judged(distrust, tail);
            // The tail of a replay that trusted no tail names the stream's last message before
            // that replay (`Replay::new`): read it too, unless looking there is what failed before.
            let before = match verdict {
                Verdict::TailAlone => None,
                _ => before_replay(port, config, tail).await,
            };
            let distrust = match verdict {
                Verdict::Skip(why) => Some(why),
                _ => None,
            };
            let replay = replay(tail, before.as_ref(), origin, distrust, &mut history);
            Some(Fence::new(tail, replay))
        }
        None => None,
    };
    let max_msg_size = match &tail {
        Some(t) => t.max_msg_size,
        None => max_msg_size(port, config).await,
    };
    Ok(Opening {
        fence,
        history,
        max_msg_size,
        last_sequence: tail.as_ref().map_or(0, |t| t.last_sequence),
    })
}

/// What an earlier session's distrust, if any, makes of `tail` (logged).
fn judged<'a>(distrust: Option<&'a Distrust>, tail: &Tail) -> Verdict<'a> {
    let Some(d) = distrust else {
        return Verdict::Stale;
    };
    let verdict = d.verdict(tail.last_sequence);
    match verdict {
        Verdict::Stale => debug!(
            last_sequence = tail.last_sequence,
            "the stream ends past the tail an earlier session found unreliable: judging its new tail"
        ),
        Verdict::TailAlone => debug!(
            "an earlier session found the message before the replay that wrote the stream's tail unreliable: judging the tail alone"
        ),
        Verdict::Skip(_) => {}
    }
    verdict
}

/// The message before the replay that wrote `tail` (`;replay-over=N`), when the tail names one
/// inside the stream: its sequence and what it says of itself. `None` when it cannot be read (the
/// tail alone is trusted then).
async fn before_replay(port: &NatsPort, config: &SinkConfig, tail: &Tail) -> Option<(u64, Stamp)> {
    let n = tail.last.as_ref()?.replay_over?;
    if n == 0 || n >= tail.last_sequence {
        return None;
    }
    match port
        .message_headers(&config.stream, n, config.ack_timeout)
        .await
    {
        Ok(h) => h.map(|h| (n, Stamp::from_headers(&h))),
        Err(e) => {
            debug!(error = %crate::error_chain::error_chain(&e), sequence = n, "cannot read the message before the replay that wrote the stream's tail: trusting the tail alone");
            None
        }
    }
}

/// The replay of a session that streams `origin` over `tail` (`before`: the message before a
/// cut-off replay). A replay that trusts no tail is logged, and its messages say so, and over which
/// tail (`history` gains `;replay-over=N`): a later session whose tail is one of them looks past
/// it.
fn replay(
    tail: &Tail,
    before: Option<&(u64, Stamp)>,
    origin: Option<&Origin>,
    distrust: Option<&str>,
    history: &mut Option<String>,
) -> Replay {
    let Some(origin) = origin else {
        return Replay::publishing();
    };
    let before = before.map(|(n, s)| (*n, s));
    let (replay, untrusted) = Replay::new(tail, before, origin, distrust);
    if let Some(why) = untrusted {
        warn!(%why, last_sequence = tail.last_sequence, "replay skips nothing: every event from the confirmed position is published again (JetStream drops the duplicates inside its window)");
        *history = Some(crate::position::context(
            &origin.history,
            Some(tail.last_sequence),
        ));
    } else if let Some(end) = replay.ends_at() {
        debug!(
            tail = tail.last_sequence,
            verifies = end,
            "the stream's tail is from a replay that trusted no tail: verifying the message before that replay instead"
        );
    }
    replay
}

/// The stream's `max_msg_size` without the fence, when it can be read: the tail is read for the
/// stream's limit only.
async fn max_msg_size(port: &NatsPort, config: &SinkConfig) -> Option<usize> {
    match read_tail(port, &config.stream, config.ack_timeout).await {
        Ok(t) => t.max_msg_size,
        Err(e) => {
            warn!(error = %crate::error_chain::error_chain(&e), "cannot read the stream's max_msg_size: a message over it is dead-lettered only after the stream refused it, behind the messages sent after it");
            None
        }
    }
}
