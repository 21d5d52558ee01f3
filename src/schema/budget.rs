//! The contract check of a large payload, off the runtime thread and within a time budget
//! ([`PendingCheck`]); the event records its verdict (`OutboxEvent::check_schema`, src/event.rs).
//!
//! The relay runs on one runtime thread: a check that takes long there silences `/healthz`, the
//! position service and the slot's keepalives alike. Patterns are linear (`PatternOptions::regex()`
//! in `schema.rs`), so a check's time grows with the payload and the schema, but a large payload
//! against a large schema can still take a while. So the outbox stage checks a payload of at most
//! [`INLINE_BYTES`] at once (the common case, microseconds) and leaves a larger one to this
//! check, which the sink runs before it publishes the event (live and backfill alike): on the
//! blocking pool, awaited for at most [`BUDGET`]. An event whose check runs out of the budget is a
//! dead letter saying so; its check finishes on the pool and is dropped.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;

use super::{SchemaMetrics, SchemaSet, Verdict};

/// Payloads up to this many bytes are checked at once, on the runtime thread.
pub(crate) const INLINE_BYTES: usize = 16 * 1024;

/// How long the check of a larger payload may take before its event is a dead letter. Generous: a
/// check on a busy machine must not turn a good event into a dead letter; only one that could keep
/// the relay away from its connections for seconds does.
pub(crate) const BUDGET: Duration = Duration::from_secs(5);

/// Test support: large checks run on the calling thread ([`check_on_the_calling_thread`]).
#[cfg(feature = "test-support")]
static ON_THE_CALLING_THREAD: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(false);

/// Test support (feature `test-support`, never in a release build): from now on every large check
/// of this process runs on the calling thread, with no budget. For the deterministic simulation: a
/// check on the blocking pool ends at a moment of real time, so how many steps the world's other
/// tasks took meanwhile, and with them the world's draws, changed from one run of a seed to the next.
#[cfg(feature = "test-support")]
pub fn check_on_the_calling_thread() {
    ON_THE_CALLING_THREAD.store(true, std::sync::atomic::Ordering::Relaxed);
}

/// A check the stage left for later: the set in force when the event arrived, and where failures
/// are counted.
#[derive(Clone)]
pub struct PendingCheck {
    pub(crate) set: Arc<SchemaSet>,
    pub(crate) metrics: Arc<SchemaMetrics>,
    /// The payload column is bytea.
    pub(crate) bytea: bool,
}

impl fmt::Debug for PendingCheck {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PendingCheck")
            .field("set", &self.set)
            .finish()
    }
}

/// Two events are equal whatever check they wait for: the check is not part of what they say.
impl PartialEq for PendingCheck {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.set, &other.set) && self.bytea == other.bytea
    }
}

impl Eq for PendingCheck {}

impl PendingCheck {
    /// The verdict on `payload` of an event of type `event_type`, checked on the blocking pool
    /// within `budget`: a check that panics or runs out of it fails, saying so.
    pub(crate) async fn verdict(
        self,
        event_type: &str,
        payload: Bytes,
        budget: Duration,
    ) -> Verdict {
        let len = payload.len();
        let (set, bytea) = (self.set, self.bytea);
        #[cfg(feature = "test-support")]
        if ON_THE_CALLING_THREAD.load(std::sync::atomic::Ordering::Relaxed) {
            return set.check(event_type, &payload, bytea);
        }
        let checking = {
            let event_type = event_type.to_owned();
            tokio::task::spawn_blocking(move || set.check(&event_type, &payload, bytea))
        };
        match tokio::time::timeout(budget, checking).await {
            Ok(Ok(verdict)) => verdict,
            // A panic inside the validator: the event cannot be shown to pass.
            Ok(Err(e)) => Verdict::Fail(format!(
                "{event_type}: the schema check failed ({e}); the event is not published as it is"
            )),
            Err(_) => Verdict::Fail(format!(
                "{event_type}: the schema check of its {len} byte payload ran out of its {} s budget; \
                 simplify the schema (its patterns) or keep such payloads smaller",
                budget.as_secs_f64()
            )),
        }
    }
}
