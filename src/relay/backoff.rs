//! The restart loop's backoff ([`backoff`]): capped, exponential, jittered, so relays that failed
//! together do not come back together; the jitter is a xorshift over a seed ([`xorshift`]), which
//! the simulation sets so that a seed replays the same run. Pure.

use std::time::Duration;

/// Advances a xorshift64 state (never 0) and returns it: the backoff's jitter.
pub(super) fn xorshift(state: &mut u64) -> u64 {
    let mut x = *state;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    *state = x;
    x
}

/// Capped exponential backoff with jitter: 100 ms, 200 ms, … up to 30 s, each ±25 % (`random`
/// picks where).
pub(super) fn backoff(failures: u32, random: u64) -> Duration {
    let base = 100u64.saturating_mul(1u64 << failures.min(12).saturating_sub(1));
    let capped = base.min(30_000);
    let jitter = capped / 4;
    let offset = if jitter == 0 {
        0
    } else {
        random % (2 * jitter)
    };
    Duration::from_millis(capped - jitter + offset)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_and_is_capped() {
        for f in 1..40 {
            let d = backoff(f, u64::from(f) * 7919);
            assert!(d <= Duration::from_millis(30_000 + 7_500), "{f}: {d:?}");
            assert!(d >= Duration::from_millis(75), "{f}: {d:?}");
        }
        assert!(backoff(1, 0) < Duration::from_millis(200));
        assert!(backoff(20, u64::MAX) >= Duration::from_millis(22_500));
    }
}
