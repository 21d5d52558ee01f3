//! A session's messages in flight and what settles them ([`Flight`]): the publisher they go through
//! (`publish.rs`), the fence they are stamped with (`fence.rs`) and the replay's skips
//! (`replay_proof.rs`), the window that holds them (`window.rs`), and the gate their acks pass
//! (`prove.rs`). Both strategies send through it: a single message with [`Flight::submit_one`], a
//! batch member or commit through the batcher (`batch.rs`), which asks it for room and for the
//! batch before to be stored.
//!
//! Settling is decided without I/O (`settle.rs`, [`settle::decide`]); this file carries the
//! decision out ([`Flight::settle_front`]): reports the outcome, checks a duplicate against the
//! stream, or sends the message again (its dead letter, or behind a duplicate) and waits for that
//! answer before anything behind it is settled. What a wait resolves on is [`Flight::ready`]:
//! the oldest answer, its deadline, the proof's read-back, or a waiting batch's bound.

use tokio::time::Instant;
use tracing::{debug, warn};

use super::config::SinkConfig;
use super::envelope;
use super::error::{Forged, SinkError};
use super::fence::Fence;
use super::outcome::{Acked, Outcome};
use super::prove::{ProofGate, showing};
use super::publish::{Answer, Publisher};
use super::replay_proof::{Skip, Skips, prove_skipped};
use super::settle::{self, Decision};
use super::window::{Front, InFlight, Pending, Window, approx_size};
use crate::event::OutboxEvent;
use crate::parking::ParkedSet;
use crate::position::Position;

/// See the module docs.
pub(super) struct Flight {
    publisher: Publisher,
    config: SinkConfig,
    /// The fence, on a fenced stream.
    fence: Option<Fence>,
    /// What the replay skipped and has not proven yet.
    skips: Skips,
    window: Window,
    gate: ProofGate,
    /// The keys parked (`outbox.on_invalid = "park"`): read from the stream when the session
    /// starts, changed as this session parks and releases keys.
    parked: ParkedSet,
    /// The id of the message whose settling waits (for the answer to a copy sent again, or for
    /// the stream's word on a duplicate), taken off the window and not yet reported. Still set
    /// when a settle starts, the step that waited was dropped (a clean stop drops a step
    /// waiting for room): that message is never reported, so nothing behind it may be.
    interrupted: Option<String>,
}

/// What a wait for the oldest answer came to.
enum Waited {
    /// An answer arrived (kept by the publisher): look again.
    Answer,
    /// Time to settle: the deadline passed, the inbox ended, or the proof came back.
    Settle,
}

impl Flight {
    /// A flight through `publisher` with `config`; `fence` on a fenced stream, whose tail's last
    /// sequence is `last_sequence` (0 without the fence).
    pub(super) fn new(
        publisher: Publisher,
        config: SinkConfig,
        fence: Option<Fence>,
        last_sequence: u64,
        parked: ParkedSet,
    ) -> Self {
        let window = Window::new(config.max_in_flight, config.max_in_flight_bytes);
        Flight {
            publisher,
            config,
            fence,
            skips: Skips::default(),
            window,
            gate: ProofGate::new(last_sequence),
            parked,
            interrupted: None,
        }
    }

    /// The keys parked now.
    #[inline]
    pub(super) fn parked(&self) -> &ParkedSet {
        &self.parked
    }

    /// Starts from the keys the stream shows parked.
    pub(super) fn restore_parked(&mut self, parked: ParkedSet) {
        self.parked = parked;
    }

    /// The sink's settings.
    #[inline]
    pub(super) fn config(&self) -> &SinkConfig {
        &self.config
    }

    /// The publisher and the settings, to send a batch's messages with (`batch.rs`).
    #[inline]
    pub(super) fn wire(&mut self) -> (&mut Publisher, &SinkConfig) {
        (&mut self.publisher, &self.config)
    }

    /// Asks the fence's replay about `event` (submitted as `seq`): true when it is stored already,
    /// so it is not published. When the replay reaches the tail's own event, the events it skipped
    /// are read back and proven (`prove_skipped`), then reported stored in their place.
    pub(super) async fn skip_replayed(
        &mut self,
        seq: u64,
        event: &OutboxEvent,
    ) -> Result<bool, SinkError> {
        let Some(fence) = self.fence.as_mut() else {
            return Ok(false);
        };
        match self.skips.replayed(fence, seq, event)? {
            Skip::Publish => Ok(false),
            Skip::Skipped => Ok(true),
            Skip::Verified { first, count, hash } => {
                let started = Instant::now();
                prove_skipped(&self.publisher, fence, &self.config.stream, count, hash).await?;
                debug!(events = count, position = %event.position, took_ms = started.elapsed().as_millis() as u64,
                    "replay reached the stream's tail: skipped events are stored");
                self.window.push(Pending::Stored { first, count });
                Ok(true)
            }
        }
    }

    /// Sends `event` as a single message, submitted as `seq`, once it has a place in the window.
    pub(super) async fn submit_one(
        &mut self,
        seq: u64,
        event: Box<OutboxEvent>,
    ) -> Result<(), SinkError> {
        let size = self.reserve(approx_size(&event)).await?;
        let item = envelope::send_event(
            &mut self.publisher,
            &self.config,
            &mut self.parked,
            self.fence.as_mut(),
            seq,
            event,
            size,
        )
        .await?;
        self.window.push(Pending::Sent(item));
        Ok(())
    }

    /// Sends the release marker `marker` for the key of `event` (its synthetic event: position
    /// and id) as message `seq`, unless the replay proves it stored: then it changes nothing (the
    /// parked set read at the start already shows it). Published, the key is released. Returns
    /// whether it was published.
    pub(super) async fn submit_marker(
        &mut self,
        seq: u64,
        event: Box<OutboxEvent>,
        marker: super::destination::Sent,
    ) -> Result<bool, SinkError> {
        if self.skip_replayed(seq, &event).await? {
            return Ok(false);
        }
        self.parked
            .release(&crate::parking::KeyHash::of_event(&event));
        let size = self.reserve(approx_size(&event)).await?;
        let item = envelope::send_marker(
            &mut self.publisher,
            &self.config,
            &mut self.parked,
            self.fence.as_mut(),
            seq,
            event,
            size,
            marker,
        )
        .await?;
        self.window.push(Pending::Sent(item));
        Ok(true)
    }

    /// Sets (or ends) the request whose run is being republished (copies parked again get ids of
    /// their own).
    pub(super) fn set_requeue(&mut self, request: Option<String>) {
        self.parked.set_requeue(request);
    }

    /// Sets (or ends) the request republishing a dead letter (`requeue_event`).
    pub(super) fn set_requeue_dead_letter(&mut self, request: Option<String>) {
        self.parked.set_requeue_dead_letter(request);
    }

    /// Takes a place for a message of `size` bytes in the window, settling the oldest messages
    /// while it is full. Returns the bytes taken.
    pub(super) async fn reserve(&mut self, size: usize) -> Result<usize, SinkError> {
        let size = self.window.bytes_for(size);
        while self.window.is_full_for(size) {
            self.settle_oldest().await?;
        }
        self.window.take(size);
        Ok(size)
    }

    /// Settles the oldest messages until fewer than `max` atomic batches are in flight.
    pub(super) async fn wait_for_batches(&mut self, max: usize) -> Result<(), SinkError> {
        while self.window.batches() >= max {
            self.settle_oldest().await?;
        }
        Ok(())
    }

    /// Atomic batches committed and not yet settled.
    #[inline]
    pub(super) fn batches(&self) -> usize {
        self.window.batches()
    }

    /// The `Nats-Expected-Last-Sequence` of the next message, which carries no `Nats-Msg-Id` (a
    /// batch's first), on a fenced stream.
    #[inline]
    pub(super) fn next_sequence(&mut self) -> Option<u64> {
        self.fence.as_mut().map(Fence::next_sequence)
    }

    /// A sent message enters the window.
    #[inline]
    pub(super) fn push(&mut self, item: InFlight) {
        self.window.push(Pending::Sent(item));
    }

    /// Resolves when [`Flight::settle`] has something to do: settled acks wait, the oldest
    /// message's answer arrived, its deadline passed, or `due` (a waiting batch's bound) passed.
    /// Never resolves with nothing in flight and nothing due. Cancel safe: an answer taken off the
    /// inbox is kept, and the proof stays in flight.
    pub(super) async fn ready(&mut self, due: Option<Instant>) {
        if self.interrupted.is_some() {
            // Settling fails at once: nothing is worth waiting for.
            return;
        }
        loop {
            if self.gate.may_take() || self.gate.has_result() {
                return;
            }
            if due.is_some_and(|d| Instant::now() >= d) {
                return;
            }
            let token = match self.window.front() {
                Front::Empty => return self.wait_idle(due).await,
                Front::Stored => return,
                Front::Sent(token) => token,
            };
            if self.publisher.has(token) {
                return;
            }
            match self.wait_answer(due).await {
                Waited::Answer => {}
                Waited::Settle => return,
            }
        }
    }

    /// Nothing published is waiting: only the proof in flight, or a waiting batch's bound, can
    /// bring something now (the proof's request is bounded by the ack timeout).
    async fn wait_idle(&mut self, due: Option<Instant>) {
        let group = until(due);
        let Some(f) = self.gate.in_flight() else {
            return group.await;
        };
        tokio::select! {
            biased;
            shown = showing(f) => self.gate.came(shown),
            () = group => {}
        }
    }

    /// Waits for one more answer, the oldest one's deadline, the proof's result or `due`. With a
    /// batch waiting (nothing committed in flight), the oldest message is one of its own members,
    /// answered only by its commit: the bound is what comes first.
    async fn wait_answer(&mut self, due: Option<Instant>) -> Waited {
        let timer = self.window.timer(self.config.ack_timeout);
        let publisher = &mut self.publisher;
        let answer = async {
            match self.gate.in_flight() {
                None => Ok(publisher.receive(timer).await),
                // Both cancel safe: an answer taken off the inbox is kept, and the proof stays
                // in flight.
                Some(f) => tokio::select! {
                    biased;
                    shown = showing(f) => Err(shown),
                    received = publisher.receive(timer) => Ok(received),
                },
            }
        };
        let received = tokio::select! {
            biased;
            received = answer => received,
            () = until(due) => return Waited::Settle,
        };
        match received {
            Ok(true) => Waited::Answer,
            Ok(false) => Waited::Settle,
            Err(shown) => {
                self.gate.came(shown);
                Waited::Settle
            }
        }
    }

    /// Settles, in order, every message whose answer is here (waiting only for the answers of
    /// what it sends again: behind a duplicate, or as a dead letter), and judges the proofs that
    /// came. The results come out of [`Flight::acked`]. An error ends the session: nothing after
    /// it may be reported.
    pub(super) async fn settle(&mut self) -> Result<(), SinkError> {
        loop {
            self.gate.judge(&self.config.stream)?;
            self.settle_window().await?;
            if !self.gate.start(&self.publisher) {
                return Ok(());
            }
        }
    }

    /// Settles, in order, every message of the window whose answer is here.
    async fn settle_window(&mut self) -> Result<(), SinkError> {
        self.not_interrupted()?;
        loop {
            let token = match self.window.front() {
                Front::Empty => return Ok(()),
                Front::Stored => {
                    self.settle_stored();
                    continue;
                }
                Front::Sent(token) => token,
            };
            let answer = match self.publisher.take(token) {
                Ok(Some(answer)) => answer,
                Ok(None) if self.window.overdue() => return Err(self.timed_out()),
                Ok(None) => return Ok(()),
                Err(e) => return Err(e.into_error(self.window.front_id())),
            };
            self.settle_front(answer).await?;
        }
    }

    /// Waits (bounded by the ack timeout) for the oldest message's answer and settles it.
    async fn settle_oldest(&mut self) -> Result<(), SinkError> {
        self.not_interrupted()?;
        let token = match self.window.front() {
            // Only members of the open batch are in flight: they wait for their commit, which
            // the batch limits send before the window fills.
            Front::Empty => return Err(SinkError::Stopped),
            Front::Stored => {
                self.settle_stored();
                return Ok(());
            }
            Front::Sent(token) => token,
        };
        match self.publisher.wait(token, self.config.ack_timeout).await {
            Some(answer) => self.settle_front(answer).await,
            None => Err(self.timed_out()),
        }
    }

    /// Fails when an earlier settle was dropped half-way ([`Flight::interrupted`]): the message it
    /// held is not reported, so settling anything behind it would hand progress an ack out of
    /// publish order.
    fn not_interrupted(&self) -> Result<(), SinkError> {
        match &self.interrupted {
            Some(id) => Err(SinkError::Interrupted { id: id.clone() }),
            None => Ok(()),
        }
    }

    /// Events a replay proved stored, at the front: settled without an answer (proven by the
    /// replay's read-back already).
    fn settle_stored(&mut self) {
        if let Some(count) = self.window.settle_stored() {
            self.gate.settled(count, None);
        }
    }

    /// The oldest message's ack did not come in time.
    fn timed_out(&self) -> SinkError {
        SinkError::AckTimeout(self.config.ack_timeout, self.window.front_id())
    }

    /// Settles the oldest message, whose answer is `answer`, and reports it (with its batch).
    async fn settle_front(&mut self, answer: Answer) -> Result<(), SinkError> {
        let Some(mut item) = self.window.pop_sent() else {
            return Err(SinkError::Stopped);
        };
        // Cancel safety: `item` is off the window now. A decision that waits marks it first
        // (`interrupted`), and only its report clears the mark; a step dropped in between
        // leaves it, and nothing behind `item` is settled in this session.
        let (outcome, new) = self.carry_out(&mut item, answer).await?;
        self.interrupted = None;
        let count = self
            .window
            .settled(item, outcome, self.config.telemetry.as_ref());
        self.gate.settled(count, new);
        Ok(())
    }

    /// Carries out what [`settle::decide`] says about `item`'s answer, sending it again as long as
    /// that can still store it: how it ended, and the new store the gate must see the stream show.
    async fn carry_out(
        &mut self,
        item: &mut InFlight,
        mut answer: Answer,
    ) -> Result<(Outcome, Option<(u64, Position)>), SinkError> {
        let timeout = self.config.ack_timeout;
        let mut resent = false;
        loop {
            let decision = settle::decide(item, answer, self.fence.as_ref(), resent);
            if decision.waits() && self.interrupted.is_none() {
                self.interrupted = Some(item.event.msg_id.clone());
            }
            let token = match decision {
                Decision::Stored { sequence, outcome } => {
                    if let Some(f) = self.fence.as_mut() {
                        // A dead letter or parked copy carries an id of its own; a batch none.
                        let id = item.sent.wire_id(&item.event.msg_id);
                        f.stored(sequence, item.members.is_none().then_some(&*id));
                    }
                    return Ok((outcome, Some((sequence, item.event.position))));
                }
                Decision::Duplicate { sequence } => {
                    self.duplicate(item, sequence).await?;
                    return Ok((Outcome::Stored { duplicate: true }, None));
                }
                Decision::DeadLetter { refusal } => {
                    envelope::send_refused(
                        &mut self.publisher,
                        &self.config,
                        &mut self.parked,
                        item,
                        refusal,
                    )
                    .await?
                }
                Decision::Resend { expect } => {
                    debug!(id = %item.event.msg_id, expected = ?item.expected, last = expect.seq, last_id = ?expect.id, "republishing behind a duplicate");
                    item.expected = Some(expect.seq);
                    item.expected_id = expect.id;
                    resent = true;
                    envelope::resend(&mut self.publisher, &self.config, &mut self.parked, item)
                        .await?
                }
                Decision::Forged(why) => return Err(self.forged(item, why)),
                Decision::Fail(e) => return Err(e),
            };
            answer = match self.publisher.wait(token, timeout).await {
                Some(a) => a,
                None => return Err(SinkError::AckTimeout(timeout, item.event.msg_id.clone())),
            };
        }
    }

    /// JetStream dropped `item` as a duplicate of its message `sequence`: the stream must show a
    /// message of the same id there (or one gone since, at a sequence it has reached), or the
    /// answer is not JetStream's. On a fenced stream a duplicate costs no sequence: later
    /// expectations step back by one.
    async fn duplicate(&mut self, item: &InFlight, sequence: u64) -> Result<(), SinkError> {
        // JetStream drops a message by its own `Nats-Msg-Id`: a dead letter's or a parked
        // copy's, not the event's.
        let id = &*item.sent.wire_id(&item.event.msg_id);
        let holds = self
            .publisher
            .holds(sequence, id, self.gate.last_sequence())
            .await
            .map_err(|source| SinkError::Publish {
                id: item.event.msg_id.clone(),
                source,
            })?;
        if let super::publish::Holds::No(why) = holds {
            return Err(self.forged(item, why));
        }
        self.gate.saw(sequence);
        match (self.fence.as_mut(), item.expected) {
            (Some(f), Some(_)) => {
                f.duplicate();
                warn!(id = %item.event.msg_id, lsn = %item.event.commit_lsn, "event id already used by an earlier event: JetStream dropped it as a duplicate");
            }
            _ => debug!(id = %item.event.msg_id, "duplicate dropped by JetStream"),
        }
        Ok(())
    }

    /// An answer about `item` that cannot be JetStream's, for `why`.
    fn forged(&self, item: &InFlight, why: String) -> SinkError {
        SinkError::Forged {
            id: item.event.msg_id.clone(),
            source: Forged {
                stream: self.config.stream.clone(),
                why,
            },
        }
    }

    /// The next settled ack, in publish order, once the stream has shown what it stored.
    pub(super) fn acked(&mut self) -> Option<Acked> {
        if !self.gate.may_take() {
            return None;
        }
        let ack = self.window.take_settled()?;
        self.gate.took();
        Some(ack)
    }

    /// The session ends on a failure: proves what is held, one proof at a time and within the ack
    /// timeout, so acks the stream shows are counted and confirmed like any other (a dead letter
    /// stored just before a refusal is counted in the session that stored it, not found as a
    /// duplicate by the next). What the stream does not show, or not in time, stays held.
    pub(super) async fn prove_held(&mut self) {
        let timeout = self.config.ack_timeout;
        let work = async {
            loop {
                if self.gate.judge(&self.config.stream).is_err() {
                    return;
                }
                if let Some(f) = self.gate.in_flight() {
                    let shown = showing(f).await;
                    self.gate.came(shown);
                    continue;
                }
                if !self.gate.start(&self.publisher) && self.gate.in_flight().is_none() {
                    return;
                }
            }
        };
        let _ = tokio::time::timeout(timeout, work).await;
    }

    /// A keepalive at `wal_end` arrived: a replay still waiting for the stream's tail is past it;
    /// with events skipped, that is [`SinkError::Diverged`].
    pub(super) fn keepalive(&mut self, wal_end: crate::Lsn) -> Result<(), SinkError> {
        let Some(fence) = self.fence.as_mut() else {
            return Ok(());
        };
        match fence.passed(wal_end) {
            Some(tail) => Err(SinkError::Diverged {
                sequence: fence.proof_end(),
                over: fence.over(),
                tail,
                at: Position::in_transaction(wal_end, 0),
            }),
            None => Ok(()),
        }
    }

    /// Submitted events skipped by the replay and not yet proven stored.
    pub(super) fn unverified(&self) -> u64 {
        self.fence.as_ref().map_or(0, Fence::unverified)
    }

    /// Messages in the window.
    pub(super) fn in_flight(&self) -> usize {
        self.window.messages()
    }

    /// The highest stream sequence the stream showed so far.
    pub(super) fn last_sequence(&self) -> u64 {
        self.gate.last_sequence()
    }

    /// Proofs started in this session.
    pub(super) fn proofs(&self) -> u64 {
        self.gate.proofs()
    }

    /// Settled acks held until the stream shows the last new store among them.
    pub(super) fn held(&self) -> u64 {
        self.gate.held()
    }
}

/// Resolves at `due`, never without one.
async fn until(due: Option<Instant>) {
    match due {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}
