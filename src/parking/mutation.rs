//! Test-only defects of parking (feature `test-support`, never in a release build): the variable
//! `SIM_MUTATION` names one naive implementation, so that the deterministic simulation can count
//! how many seeds find it (tests/simulation/parking.rs, docs/architecture.md). Unset, the real code
//! runs; the release binary has none of this.
//!
//! - `memory`: a release republishes the run it kept in memory instead of reading it back from the
//!   stream: the copies parked before the session started (held by an earlier process) are lost;
//! - `no_rebuild`: a session starts with no key parked (the parked set is not rebuilt from the
//!   stream);
//! - `unchecked`: a later event of a parked key goes to its own subject (the key is not checked);
//! - `no_requeue_event`: a `requeue_event` control message is ignored (nothing republished, no
//!   dead letter written again).

use std::sync::OnceLock;

/// One naive implementation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mutation {
    /// `memory`.
    RunFromMemory,
    /// `no_rebuild`.
    NoRebuild,
    /// `unchecked`.
    KeyUnchecked,
    /// `no_requeue_event`.
    IgnoreRequeueEvent,
}

/// Whether `SIM_MUTATION` names `m`. An unknown name panics with the names there are: a count
/// over a misspelled mutation would count the real code.
pub fn on(m: Mutation) -> bool {
    static ACTIVE: OnceLock<Option<Mutation>> = OnceLock::new();
    *ACTIVE.get_or_init(|| match std::env::var("SIM_MUTATION").as_deref() {
        Err(_) | Ok("") => None,
        Ok("memory") => Some(Mutation::RunFromMemory),
        Ok("no_rebuild") => Some(Mutation::NoRebuild),
        Ok("unchecked") => Some(Mutation::KeyUnchecked),
        Ok("no_requeue_event") => Some(Mutation::IgnoreRequeueEvent),
        Ok(other) => {
            panic!("SIM_MUTATION={other:?}: memory, no_rebuild, unchecked or no_requeue_event")
        }
    }) == Some(m)
}
