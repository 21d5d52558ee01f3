//! [`Shutdown`]: the relay's stop signal as the restart loop and its sessions see it. `sessions`
//! holds the sender and sets it once, when the caller's shutdown future resolves; the loop and
//! the session select on [`Shutdown::requested`] wherever they can wait (connecting, backing off,
//! streaming, a step waiting for room in the window).

use tokio::sync::watch;

/// A receiver of the stop signal. Cloning it is cheap; every clone sees the same signal.
#[derive(Clone)]
pub(super) struct Shutdown(watch::Receiver<bool>);

impl Shutdown {
    /// A signal not yet given, and the sender that gives it (`send(true)`).
    pub(super) fn new() -> (watch::Sender<bool>, Shutdown) {
        let (tx, rx) = watch::channel(false);
        (tx, Shutdown(rx))
    }

    /// Resolves once shutdown is requested, at once if it already was. A sender dropped without
    /// asking counts as asking: nobody is left to ask, and waiting for it would never end.
    pub(super) async fn requested(&mut self) {
        // An error means the sender is gone: resolve all the same.
        let _ = self.0.wait_for(|s| *s).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn resolves_when_asked_or_when_nobody_is_left_to_ask() {
        let (tx, mut stop) = Shutdown::new();
        let waiting = tokio::time::timeout(std::time::Duration::from_millis(10), stop.requested());
        assert!(waiting.await.is_err(), "not yet asked");
        tx.send(true).unwrap();
        stop.requested().await;
        // Asked before: resolves at once, for every clone.
        stop.clone().requested().await;

        let (tx, mut stop) = Shutdown::new();
        drop(tx);
        stop.requested().await;
    }
}
