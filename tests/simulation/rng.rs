//! The one random source of a simulated world: a SplitMix64 generator behind a lock, shared by the
//! simulated Postgres, the simulated JetStream and the world driver. Every choice a run makes (what
//! the writers write, when an ack arrives, which fault strikes) is drawn from it, in the order the
//! single-threaded runtime runs the tasks, so a seed replays the same run.
//!
//! SplitMix64 (Steele, Lea, Flood 2014) rather than a crate: ten lines, no dependency, and its
//! output never changes with a crate upgrade, so a seed recorded today still replays next year.

use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The shared generator; clones draw from the same sequence.
#[derive(Clone)]
pub(crate) struct Dice(Arc<Mutex<u64>>);

impl Dice {
    pub(crate) fn new(seed: u64) -> Self {
        Dice(Arc::new(Mutex::new(seed)))
    }

    #[track_caller]
    pub(crate) fn next_u64(&self) -> u64 {
        static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        if *ON.get_or_init(|| std::env::var_os("SIM_DICE_LOG").is_some()) {
            eprintln!("dice {}", std::panic::Location::caller());
        }
        let mut s = self.0.lock().unwrap();
        *s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = *s;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `lo..hi` (`lo` when the range is empty). The modulo bias is far below anything
    /// a simulation run could notice.
    #[track_caller]
    pub(crate) fn range(&self, lo: u64, hi: u64) -> u64 {
        if hi <= lo {
            lo
        } else {
            lo + self.next_u64() % (hi - lo)
        }
    }

    /// True with probability `p`.
    #[track_caller]
    pub(crate) fn chance(&self, p: f64) -> bool {
        ((self.next_u64() >> 11) as f64) < p * (1u64 << 53) as f64
    }

    /// One of `items`.
    #[track_caller]
    pub(crate) fn pick<T: Copy>(&self, items: &[T]) -> T {
        items[self.range(0, items.len() as u64) as usize]
    }

    /// A duration uniform in `lo..hi` milliseconds.
    #[track_caller]
    pub(crate) fn millis(&self, lo: u64, hi: u64) -> Duration {
        Duration::from_millis(self.range(lo, hi))
    }
}
