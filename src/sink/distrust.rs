//! Why a session found the stream's tail unreliable, and which tail it was: what the following
//! sessions of the same relay process make of it. A distrust is about one tail, the stream's last
//! sequence the failed session judged. While the stream still ends there, the next sessions skip
//! nothing (the same tail would fail the same way); once it ends elsewhere, something was stored
//! past it since (this process, a standby that holds the slot now, a late publish), and the new
//! tail is judged on its own, by the same checks and the same read-back proof as any other. A
//! process that kept distrusting a tail the other relay has long stored past would publish
//! everything from the confirmed position again, and atomic batches, which carry no
//! `Nats-Msg-Id`, would store it all twice.
//!
//! When what failed was the look past a cut-off replay's tail (the message before that replay,
//! `;replay-over=N`), only the look past is distrusted: the tail itself, the replay's own copy in
//! this history, is judged as usual.

/// See the module docs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Distrust {
    /// Why, for the next session's warn line.
    pub(crate) why: String,
    /// The stream's last sequence when it was found; `None`: not known (a refusal whose number
    /// could not be read), then it holds whatever the stream's tail.
    pub(crate) at: Option<u64>,
    /// What failed was the message before a cut-off replay, verified in the tail's place.
    pub(crate) look_past: bool,
}

/// What a distrust means for a session whose stream ends at a given sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verdict<'a> {
    /// The stream ends elsewhere now: the tail is judged on its own.
    Stale,
    /// Judge the tail, but not the message before the replay that wrote it.
    TailAlone,
    /// Skip nothing; the reason.
    Skip(&'a str),
}

impl Distrust {
    /// What it means for a session whose stream's last sequence is `last_sequence`.
    pub(crate) fn verdict(&self, last_sequence: u64) -> Verdict<'_> {
        match self.at {
            Some(at) if at != last_sequence => Verdict::Stale,
            _ if self.look_past => Verdict::TailAlone,
            _ => Verdict::Skip(&self.why),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn distrust(at: Option<u64>, look_past: bool) -> Distrust {
        Distrust {
            why: "its last message (sequence 68, position 1/1E067:0) is not in this database's history"
                .into(),
            at,
            look_past,
        }
    }

    #[test]
    fn it_holds_while_the_stream_ends_at_the_tail_it_was_found_at() {
        let d = distrust(Some(68), false);
        assert_eq!(d.verdict(68), Verdict::Skip(&d.why));
        assert_eq!(
            d.verdict(81),
            Verdict::Stale,
            "stored past since: the new tail is judged on its own"
        );
    }

    #[test]
    fn a_refusal_whose_number_was_not_read_holds_whatever_the_tail() {
        let d = distrust(None, false);
        assert_eq!(d.verdict(68), Verdict::Skip(&d.why));
        assert_eq!(d.verdict(81), Verdict::Skip(&d.why));
    }

    #[test]
    fn a_failed_look_past_distrusts_only_the_look_past() {
        let d = distrust(Some(81), true);
        assert_eq!(d.verdict(81), Verdict::TailAlone);
        assert_eq!(d.verdict(90), Verdict::Stale);
    }
}
