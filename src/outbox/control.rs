//! Control messages in the outbox stage (`outbox.on_invalid = "park"`): a transactional logical
//! message under the relay's control prefix becomes [`Step::Control`], which takes one index in
//! its transaction like an event (the messages it expands to are that index's sub-positions).
//! A non-transactional one, or content that is no control message, is [`Step::ControlIgnored`]:
//! the session warns with the LSN and counts it; never a dead letter, never a stop. Pure: what
//! the control does is the session's (it reads the stream).

use bytes::Bytes;

use super::{OutboxStage, StageError, Step};
use crate::Lsn;
use crate::parking::control;

impl OutboxStage {
    /// A logical message under the control prefix, whose record is at `lsn`.
    pub(super) fn control_message(
        &mut self,
        transactional: bool,
        lsn: Lsn,
        content: Bytes,
    ) -> Result<Step, StageError> {
        if !transactional {
            return Ok(Step::ControlIgnored {
                lsn,
                why: "non-transactional: it is atomic with nothing; emit it with pg_logical_emit_message(true, ...) \
                      (sql/09's functions do)"
                    .to_owned(),
            });
        }
        if !self.in_txn {
            return Err(StageError::MessageWithoutBegin(lsn));
        }
        match control::parse(&content) {
            Ok(control) => {
                let index = self.index;
                self.index += 1;
                Ok(Step::Control {
                    control,
                    at: crate::position::Position::in_transaction(self.commit_lsn, index),
                    commit_ts: self.commit_ts,
                })
            }
            Err(why) => Ok(Step::ControlIgnored { lsn, why }),
        }
    }
}
