//! A [`PeekPort`] over changes already in hand ([`InHand`]), for tests (feature `test-support`):
//! the library's unit tests of the look and the deterministic simulation's Postgres hand it the
//! pgoutput rows a real peek would, so both run the very look `status` and the relay's start run.
//! One copy, so that what "handed over as the server does" means cannot drift between them.

use std::convert::Infallible;

use bytes::Bytes;

use super::port::{Bound, PeekFailed, PeekPort, Rows};
use crate::Lsn;

/// Changes in hand, one list of (LSN, pgoutput message) per transaction, in order: a slot's WAL
/// from its position on, cut where the look's `upto` ends (borrowed, or owned when read once
/// ahead of the look).
pub struct InHand<C>(pub C);

/// The changes of [`InHand`].
pub type Transactions = [Vec<(Lsn, Bytes)>];

impl<C: AsRef<Transactions> + Send + Sync> PeekPort for InHand<C> {
    type Error = Infallible;

    /// The outbox table in hand has no partitions, and its server no statement timeout.
    async fn begin(&mut self, _: Bound) -> Result<Vec<u32>, Infallible> {
        Ok(Vec::new())
    }

    /// Whole transactions, as the server's `upto_nchanges` hands them: the bound is checked only
    /// between transactions, so the one that reaches it is handed over to its end.
    async fn peek(
        &mut self,
        _upto: Option<Lsn>,
        changes: u32,
        rows: Rows<'_, '_>,
    ) -> Result<(), PeekFailed> {
        let mut handed = 0u64;
        for transaction in self.0.as_ref() {
            if handed >= u64::from(changes) {
                break;
            }
            for (lsn, data) in transaction {
                handed += 1;
                if rows(*lsn, data.clone()).is_break() {
                    return Ok(());
                }
            }
        }
        Ok(())
    }

    async fn end(&mut self) {}
}
