//! JetStream publishes whose acks come back on one subscription per session.
//!
//! async-nats' `jetstream::Context::send_publish` makes every publish a request: a new inbox string,
//! a oneshot channel, an entry in the client's request map, an in-flight permit and two timers per
//! ack. Measured in `benches/drain` (`sink` against `sink core`), that is about 2 µs of CPU per
//! event, a third of the relay's. Here each session subscribes once to `<inbox>.*` and publishes
//! with the reply subject `<inbox>.<token>` (a core publish; JetStream answers a publish that has a
//! reply subject with its ack there), and the sink takes the answers off the one subscription in
//! order. The sink's own window already bounds what is in flight, so no further permit is needed, and
//! the subscription's queue (async-nats' default, 65,536 messages) holds the acks of a full window
//! (`nats.max_in_flight` is at most 65,536); an ack dropped past it would be an ack timeout, never a
//! lost event.
//!
//! Answers normally arrive in publish order; one that arrives before the answer awaited (after a
//! resend, which takes a new token) is kept until its turn. What an answer says is read by the NATS
//! side (`crate::nats::answer`): a no-responders status (no stream takes the subject) and
//! JetStream's error answers are [`NatsError`]s of their kind, like every other failure of the
//! seam, so the sink's decisions about them stay in one form.
//!
//! Acks are checked, not trusted: any client of the same account that may publish to `_INBOX.>` can
//! see the reply subject and plant an answer. An answer for a token never issued is dropped; an ack
//! must name the relay's stream and a sequence, and with the fence the sink also checks that the
//! sequence is exactly the one the message expected to take. A "duplicate" must name a message of
//! the same id, or one gone since at a sequence the stream has reached. Two different answers for
//! one publish end the session: JetStream answers once, so one of them is planted, and which one
//! cannot be told. Anything else ends the session; it never confirms anything.

use std::collections::HashMap;
use std::pin::Pin;
use std::time::Duration;

use tokio::time::Sleep;

use async_nats::HeaderMap;
use bytes::Bytes;

use super::error::{Forged, SinkError};
use super::port::Answers;
use super::tail::Stamp;
use crate::nats::{HeaderRead, NatsError, NatsErrorKind, NatsPort};
use crate::position::Position;

/// What the stream shows at a target's sequence ([`Publisher::show`]).
#[derive(Debug)]
pub(super) enum Shown {
    /// The message's `Outbox-Position`, if it has one.
    Message(Option<Position>),
    /// No message there; the stream's last sequence now.
    Gone { last: u64 },
}

/// A read of what the stream shows at one sequence ([`Publisher::show`]), in flight. In a mutex
/// only so the sink stays `Sync` (the future is `Send`, not `Sync`); it is polled through
/// `get_mut`, which never locks.
pub(super) type Showing =
    std::sync::Mutex<Pin<Box<dyn std::future::Future<Output = Result<Shown, NatsError>> + Send>>>;

/// Why an answer is not an ack: what the NATS seam says (JetStream refused, no stream took the
/// subject, the inbox is gone), or an answer that cannot be JetStream's.
#[derive(Debug)]
pub(super) enum NotAcked {
    /// A failure of the seam, of its kind.
    Nats(NatsError),
    /// An answer planted by another client.
    Forged(Forged),
}

impl NotAcked {
    /// The session's error for the message `id`.
    pub(super) fn into_error(self, id: String) -> SinkError {
        match self {
            NotAcked::Nats(source) => SinkError::Publish { id, source },
            NotAcked::Forged(source) => SinkError::Forged { id, source },
        }
    }
}

/// An answer to a publish: its ack, or why there is none.
pub(super) type Answer = Result<Ack, NotAcked>;

/// Whether the stream holds the message an ack says a publish duplicates ([`Publisher::holds`]).
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Holds {
    /// It does (or it is gone, at a sequence the stream has reached).
    Yes,
    /// It does not: why.
    No(String),
}

/// Answers kept out of turn at most: the subscription's own queue (async-nats' default).
const MAX_EARLY: usize = 65_536;

/// Sends publishes with reply subjects on the session's inbox and takes their answers off it. Owned
/// by the sink alone.
pub(super) struct Publisher {
    port: NatsPort,
    /// `<inbox>.`: a token is appended per publish.
    reply_prefix: String,
    /// The next token; every token below it has been issued.
    next: u64,
    /// How long handing a publish to the client may wait (its queue to the connection is bounded).
    send_timeout: Duration,
    sub: Answers,
    /// Answers that arrived before they were asked for, for tokens issued.
    early: HashMap<u64, async_nats::Message>,
    /// The subscription ended (the connection is gone for good).
    closed: bool,
    /// Why the inbox cannot be trusted any more (two different answers for one publish, a
    /// flood): every later `take` fails with it, so the session ends.
    broken: Option<String>,
    /// The stream every ack must name.
    stream: String,
}

/// A stored (or duplicate) message, as JetStream acknowledged it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Ack {
    /// The stream sequence it was stored at (for a duplicate: the original's).
    pub(crate) sequence: u64,
    /// JetStream already held a message with its `Nats-Msg-Id`.
    pub(crate) duplicate: bool,
}

impl Publisher {
    /// Subscribes to a new inbox on `port`; acks must name `stream`.
    pub(super) async fn start(
        port: NatsPort,
        stream: &str,
        send_timeout: Duration,
    ) -> Result<Publisher, NatsError> {
        let inbox = port.new_inbox();
        let sub = Answers::subscribe(&port, format!("{inbox}.*")).await?;
        Ok(Publisher {
            port,
            reply_prefix: format!("{inbox}."),
            next: 0,
            send_timeout,
            sub,
            early: HashMap::new(),
            closed: false,
            broken: None,
            stream: stream.to_owned(),
        })
    }

    /// Queues a publish whose answer will come under the returned token. The client refuses a
    /// message over the server's `max_payload` before sending it ([`NatsErrorKind::TooLarge`]).
    pub(super) async fn send(
        &mut self,
        subject: String,
        headers: HeaderMap,
        payload: Bytes,
    ) -> Result<u64, NatsError> {
        let token = self.next;
        self.next += 1;
        let mut reply = String::with_capacity(self.reply_prefix.len() + 20);
        reply.push_str(&self.reply_prefix);
        reply.push_str(itoa::Buffer::new().format(token));
        self.port
            .publish(subject, Some(reply), headers, payload, self.send_timeout)
            .await?;
        Ok(token)
    }

    /// Queues a core publish (an atomic batch member: settled by its commit's ack).
    pub(super) async fn send_member(
        &self,
        subject: String,
        headers: HeaderMap,
        payload: Bytes,
    ) -> Result<(), NatsError> {
        self.port
            .publish(subject, None, headers, payload, self.send_timeout)
            .await
    }

    /// The server's `max_payload`.
    pub(super) fn max_payload(&self) -> usize {
        self.port.max_payload()
    }

    /// Whether the stream's message `seq` is the event `id`, for an ack that says `id` was a
    /// duplicate of it. A message gone since (limits, purge) cannot be checked and counts as
    /// matching, but only at a sequence the stream has reached: `known_last` (the highest the sink
    /// knows stored), or else the stream's last sequence asked of the server. One that is there
    /// with another id, or one beyond the stream's last sequence, does not ([`Holds::No`]). `Err`
    /// when the stream could not be read.
    pub(super) async fn holds(
        &self,
        seq: u64,
        id: &str,
        known_last: u64,
    ) -> Result<Holds, NatsError> {
        let held = match self
            .port
            .message_headers(&self.stream, seq, self.send_timeout)
            .await?
        {
            None if seq <= known_last => Holds::Yes,
            None => {
                let last = self
                    .port
                    .last_sequence(&self.stream, self.send_timeout)
                    .await?;
                if seq <= last {
                    Holds::Yes
                } else {
                    Holds::No(format!(
                        "the ack says message {id} duplicates sequence {seq}, beyond the stream's last sequence {last}"
                    ))
                }
            }
            Some(h) => {
                let stored = Stamp::from_headers(&h).id;
                if stored.as_deref() == Some(id) {
                    Holds::Yes
                } else {
                    Holds::No(format!(
                        "the ack says message {id} duplicates sequence {seq}, which holds {}",
                        stored.as_deref().unwrap_or("a message without an id")
                    ))
                }
            }
        };
        Ok(held)
    }

    /// What the stream shows at `seq`, for the proof that an ack naming it is JetStream's
    /// (`prove.rs`): the `Outbox-Position` of its message, or, when it is gone, the stream's last
    /// sequence. Owns what it needs, so it can stay in flight while the sink goes on; each request
    /// is bounded by the ack timeout.
    pub(super) fn show(&self, seq: u64) -> Showing {
        let port = self.port.clone();
        let stream = self.stream.clone();
        let timeout = self.send_timeout;
        std::sync::Mutex::new(Box::pin(async move {
            match port.message_headers(&stream, seq, timeout).await? {
                Some(h) => Ok(Shown::Message(Stamp::from_headers(&h).position)),
                None => Ok(Shown::Gone {
                    last: port.last_sequence(&stream, timeout).await?,
                }),
            }
        }))
    }

    /// The headers of the stream's message `seq` (`None` when it is gone).
    pub(super) async fn stored(&self, seq: u64) -> Result<Option<HeaderMap>, NatsError> {
        self.port
            .message_headers(&self.stream, seq, self.send_timeout)
            .await
    }

    /// The stream's messages `from..=to` still stored, read back in bulk, headers only.
    pub(super) async fn read(&self, from: u64, to: u64) -> Result<Box<dyn HeaderRead>, NatsError> {
        self.port
            .read_headers(&self.stream, from, to, self.send_timeout)
            .await
    }

    /// The answer for `token` if it has arrived (takes every answer already queued, no waiting).
    /// `Err` once the subscription ended or the inbox is broken (flooded, or two different answers
    /// for one publish).
    pub(super) fn take(&mut self, token: u64) -> Result<Option<Answer>, NotAcked> {
        // Everything queued first: a second answer for the token may be right behind its first,
        // and once the first had been acted on the second could change nothing.
        while let Some(next) = self.sub.ready() {
            let Some(m) = next else {
                self.closed = true;
                break;
            };
            self.keep(m)?;
        }
        if let Some(why) = &self.broken {
            return Err(self.forged(why.clone()));
        }
        if let Some(m) = self.early.remove(&token) {
            return Ok(Some(parse(&m, &self.stream)));
        }
        if self.closed {
            return Err(NotAcked::Nats(NatsError::new(
                NatsErrorKind::Closed,
                "the inbox subscription ended",
            )));
        }
        Ok(None)
    }

    /// Whether the answer for `token` is here already (or the inbox is broken, which the next
    /// `take` reports).
    pub(super) fn has(&self, token: u64) -> bool {
        self.broken.is_some() || self.early.contains_key(&token)
    }

    /// Waits, until `timer` fires, for one more answer and keeps it (cancel safe: an answer taken
    /// off the subscription is kept before anything else can happen). False when the timer fired
    /// or the subscription ended. The caller keeps the timer across calls: registering a new one on
    /// every call (the session polls this once per replication message) cost a timer-wheel insert
    /// and removal each time.
    pub(super) async fn receive(&mut self, timer: Pin<&mut Sleep>) -> bool {
        if self.closed {
            return false;
        }
        let next = tokio::select! {
            biased;
            m = self.sub.next() => m,
            _ = timer => return false,
        };
        match next {
            None => {
                self.closed = true;
                false
            }
            // A flood is reported by the next `take`.
            Some(m) => self.keep(m).is_ok(),
        }
    }

    /// The answer for `token`, or `None` if none arrives within `timeout`.
    pub(super) async fn wait(&mut self, token: u64, timeout: Duration) -> Option<Answer> {
        // Set at the first wait: most answers are already queued, and taking them needs neither a
        // timer nor a clock read.
        let mut timer: Option<Pin<Box<Sleep>>> = None;
        loop {
            match self.take(token) {
                Ok(Some(answer)) => return Some(answer),
                Ok(None) => {}
                Err(e) => return Some(Err(e)),
            }
            let timer = timer.get_or_insert_with(|| Box::pin(tokio::time::sleep(timeout)));
            if !self.receive(timer.as_mut()).await && !self.closed && !self.has(token) {
                return None;
            }
        }
    }

    /// Keeps an answer that arrived before it was asked for. Answers are checked, not trusted:
    /// anyone allowed to publish to the inbox can plant one. One for a token never issued is
    /// dropped; one that names another stream or no sequence becomes an error ([`Forged`]) when
    /// it is taken, never an ack. JetStream answers a publish once: a second answer for a token
    /// that differs from the first is planted, and which of the two is JetStream's cannot be
    /// told, so neither is used: the inbox is broken ([`Publisher::take`] fails from then on). An
    /// identical second answer is dropped (whichever is JetStream's, they say the same).
    fn keep(&mut self, m: async_nats::Message) -> Result<(), NotAcked> {
        match token_of(&m.subject) {
            Some(t) if t < self.next => {
                if let Some(first) = self.early.get(&t) {
                    if same_answer(first, &m) {
                        tracing::debug!(subject = %m.subject, "dropping a second, identical answer");
                        return Ok(());
                    }
                    return Err(self.break_inbox(format!(
                        "two different answers arrived for one publish (reply subject {})",
                        m.subject
                    )));
                }
                // Answers for settled tokens (duplicated or planted) are never taken out again;
                // past this many, something floods the inbox.
                if self.early.len() >= MAX_EARLY {
                    return Err(self.break_inbox(format!(
                        "more than {MAX_EARLY} answers arrived out of turn"
                    )));
                }
                self.early.insert(t, m);
            }
            _ => tracing::debug!(subject = %m.subject, "ignoring an answer to no publish sent"),
        }
        Ok(())
    }

    /// The inbox cannot be trusted any more, for `why`: every later `take` fails.
    fn break_inbox(&mut self, why: String) -> NotAcked {
        let e = self.forged(why.clone());
        self.broken.get_or_insert(why);
        e
    }

    fn forged(&self, why: String) -> NotAcked {
        NotAcked::Forged(Forged {
            stream: self.stream.clone(),
            why,
        })
    }
}

/// Whether two answers say the same.
fn same_answer(a: &async_nats::Message, b: &async_nats::Message) -> bool {
    a.status == b.status && a.payload == b.payload && a.headers == b.headers
}

/// The token at the end of a reply subject.
fn token_of(subject: &str) -> Option<u64> {
    subject.rsplit_once('.')?.1.parse().ok()
}

/// An answer as an [`Ack`], or why it is none ([`NotAcked`]). An ack must name `stream` and a
/// sequence (JetStream's sequences start at 1): anything else is planted.
fn parse(m: &async_nats::Message, stream: &str) -> Answer {
    let answer = crate::nats::answer::read(m).map_err(NotAcked::Nats)?;
    let forged = |why: String| {
        NotAcked::Forged(Forged {
            stream: stream.to_owned(),
            why,
        })
    };
    match answer.stream.as_deref() {
        Some(s) if s == stream => {}
        Some(other) => return Err(forged(format!("it names stream {other:?}"))),
        None => return Err(forged("it names no stream".into())),
    }
    if answer.seq == 0 {
        return Err(forged("it names no sequence".into()));
    }
    Ok(Ack {
        sequence: answer.seq,
        duplicate: answer.duplicate,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(
        subject: &str,
        payload: &str,
        status: Option<async_nats::StatusCode>,
    ) -> async_nats::Message {
        async_nats::Message {
            subject: subject.into(),
            reply: None,
            payload: Bytes::from(payload.to_owned()),
            headers: None,
            status,
            description: None,
            length: payload.len(),
        }
    }

    #[test]
    fn token_is_the_last_subject_token() {
        assert_eq!(token_of("_INBOX.abc.17"), Some(17));
        assert_eq!(token_of("_INBOX.abc.x"), None);
        assert_eq!(token_of("nodot"), None);
    }

    #[test]
    fn an_ack_gives_sequence_and_duplicate() {
        let m = answer("i.1", r#"{"stream":"OUTBOX","seq":42}"#, None);
        assert_eq!(
            parse(&m, "OUTBOX").unwrap(),
            Ack {
                sequence: 42,
                duplicate: false
            }
        );
        let m = answer(
            "i.1",
            r#"{"stream":"OUTBOX","seq":7,"duplicate":true}"#,
            None,
        );
        assert!(parse(&m, "OUTBOX").unwrap().duplicate);
    }

    #[test]
    fn a_refusal_is_the_seams_error_of_its_kind() {
        let m = answer(
            "i.1",
            r#"{"error":{"code":400,"err_code":10071,"description":"wrong last sequence: 5"},"stream":"OUTBOX","seq":0}"#,
            None,
        );
        match parse(&m, "OUTBOX") {
            Err(NotAcked::Nats(e)) => assert_eq!(
                e.kind(),
                NatsErrorKind::Refused {
                    code: async_nats::jetstream::ErrorCode::STREAM_WRONG_LAST_SEQUENCE,
                    last_sequence: Some(5)
                }
            ),
            other => panic!("{other:?}"),
        }
        let m = answer("i.1", "", Some(async_nats::StatusCode::NO_RESPONDERS));
        assert!(
            matches!(parse(&m, "OUTBOX"), Err(NotAcked::Nats(e)) if e.kind() == NatsErrorKind::NoResponders)
        );
    }

    #[test]
    fn planted_answers_are_not_acks() {
        let forged = |payload: &str| {
            matches!(
                parse(&answer("i.1", payload, None), "OUTBOX"),
                Err(NotAcked::Forged(_))
            )
        };
        assert!(forged("{}"), "no stream, no sequence");
        assert!(forged(r#"{"stream":"OUTBOX","seq":0}"#), "sequence 0");
        assert!(forged(r#"{"stream":"OTHER","seq":5}"#), "another stream");
        assert!(forged(r#"{"seq":5}"#), "no stream");
        assert!(
            parse(
                &answer("i.1", r#"{"stream":"OUTBOX","seq":5}"#, None),
                "OUTBOX"
            )
            .is_ok()
        );
    }
}

/// The publisher against a stream whose state the test sets, and answers the test plants.
#[cfg(test)]
mod checked {
    use std::collections::HashMap;
    use std::sync::{Arc, Mutex};

    use async_nats::HeaderMap;
    use bytes::Bytes;
    use tokio::sync::mpsc;

    use super::*;
    use crate::message::NATS_MSG_ID;
    use futures_util::future::{self, BoxFuture};

    use crate::nats::{Answers as AnswerStream, JetStreamPort, StreamTail};

    /// A stream whose last sequence is `last` and which holds `stored` (sequence → id).
    #[derive(Default)]
    struct Stream {
        last: u64,
        stored: HashMap<u64, String>,
        inbox: Mutex<Option<mpsc::UnboundedSender<async_nats::Message>>>,
    }

    /// The port over a shared [`Stream`], so the test can plant answers after the publisher took it.
    struct Port(Arc<Stream>);

    impl JetStreamPort for Port {
        fn new_inbox(&self) -> String {
            "_INBOX.t".into()
        }
        fn subscribe(&self, _: String) -> BoxFuture<'_, Result<AnswerStream, NatsError>> {
            let (tx, mut rx) = mpsc::unbounded_channel();
            *self.0.inbox.lock().unwrap() = Some(tx);
            let answers = futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx));
            Box::pin(future::ready(Ok(Box::pin(answers) as AnswerStream)))
        }
        fn publish(
            &self,
            _: String,
            _: Option<String>,
            _: HeaderMap,
            _: Bytes,
            _: Duration,
        ) -> BoxFuture<'_, Result<(), NatsError>> {
            Box::pin(future::ready(Ok(())))
        }
        fn max_payload(&self) -> usize {
            1 << 20
        }
        fn last_sequence<'a>(
            &'a self,
            _: &'a str,
            _: Duration,
        ) -> BoxFuture<'a, Result<u64, NatsError>> {
            Box::pin(future::ready(Ok(self.0.last)))
        }
        fn tail<'a>(
            &'a self,
            _: &'a str,
            _: Duration,
        ) -> BoxFuture<'a, Result<StreamTail, NatsError>> {
            Box::pin(future::ready(Ok(StreamTail {
                last_sequence: self.0.last,
                ..StreamTail::default()
            })))
        }
        fn message_headers<'a>(
            &'a self,
            _: &'a str,
            seq: u64,
            _: Duration,
        ) -> BoxFuture<'a, Result<Option<HeaderMap>, NatsError>> {
            Box::pin(future::ready(Ok(self.0.stored.get(&seq).map(|id| {
                let mut h = HeaderMap::new();
                h.insert(NATS_MSG_ID, id.as_str());
                h
            }))))
        }
        fn read_headers<'a>(
            &'a self,
            _: &'a str,
            _: u64,
            _: u64,
            _: Duration,
        ) -> BoxFuture<'a, Result<Box<dyn HeaderRead>, NatsError>> {
            Box::pin(future::ready(Err(NatsError::new(
                NatsErrorKind::Other,
                "no bulk read in these tests",
            ))))
        }
    }

    async fn publisher(stream: Stream) -> (Publisher, Arc<Stream>) {
        let stream = Arc::new(stream);
        let port = NatsPort::new(Port(Arc::clone(&stream)));
        let p = Publisher::start(port, "OUTBOX", Duration::from_secs(1))
            .await
            .expect("publisher");
        (p, stream)
    }

    fn plant(stream: &Stream, token: u64, payload: &str) {
        let m = async_nats::Message {
            subject: format!("_INBOX.t.{token}").as_str().into(),
            reply: None,
            payload: Bytes::from(payload.to_owned()),
            headers: None,
            status: None,
            description: None,
            length: payload.len(),
        };
        stream
            .inbox
            .lock()
            .unwrap()
            .as_ref()
            .unwrap()
            .send(m)
            .unwrap();
    }

    fn is_forged(e: &NotAcked) -> bool {
        matches!(e, NotAcked::Forged(_))
    }

    #[tokio::test]
    async fn a_duplicate_of_a_gone_message_counts_only_up_to_the_streams_last_sequence() {
        let stream = Stream {
            last: 10,
            stored: HashMap::from([(4, "a".to_owned())]),
            ..Stream::default()
        };
        let (p, _) = publisher(stream).await;
        let holds = async |seq, id, known| p.holds(seq, id, known).await.expect("read");
        assert_eq!(holds(4, "a", 10).await, Holds::Yes, "the same id");
        assert_ne!(holds(4, "b", 10).await, Holds::Yes, "another id");
        assert_eq!(
            holds(7, "a", 10).await,
            Holds::Yes,
            "gone, below what the sink knows"
        );
        assert_eq!(
            holds(9, "a", 5).await,
            Holds::Yes,
            "gone, past what the sink knows but not the stream's last sequence"
        );
        let Holds::No(e) = holds(999_999_999, "a", 10).await else {
            panic!("held")
        };
        assert!(e.contains("beyond the stream's last sequence 10"), "{e}");
        assert_ne!(holds(11, "a", 10).await, Holds::Yes, "one past the last");
    }

    #[tokio::test]
    async fn two_different_answers_for_one_publish_break_the_inbox() {
        let (mut p, stream) = publisher(Stream::default()).await;
        let t0 = p
            .send("s".into(), HeaderMap::new(), Bytes::new())
            .await
            .unwrap();
        let t1 = p
            .send("s".into(), HeaderMap::new(), Bytes::new())
            .await
            .unwrap();
        // The answer awaited is t0's; t1's real refusal and a planted ack arrive before it.
        plant(
            &stream,
            t1,
            r#"{"error":{"code":400,"err_code":10077,"description":"maximum messages exceeded"}}"#,
        );
        plant(&stream, t1, r#"{"stream":"OUTBOX","seq":2}"#);
        plant(&stream, t0, r#"{"stream":"OUTBOX","seq":1}"#);
        let e = p.take(t0).unwrap_err();
        assert!(is_forged(&e), "{e:?}");
        assert!(p.has(t1), "the session is told at once");
        let e = p.take(t1).unwrap_err();
        assert!(is_forged(&e), "and stays told: {e:?}");
    }

    #[tokio::test]
    async fn a_second_answer_right_behind_the_first_is_seen_before_the_first_is_used() {
        let (mut p, stream) = publisher(Stream::default()).await;
        let t0 = p
            .send("s".into(), HeaderMap::new(), Bytes::new())
            .await
            .unwrap();
        plant(&stream, t0, r#"{"stream":"OUTBOX","seq":1}"#);
        plant(
            &stream,
            t0,
            r#"{"stream":"OUTBOX","seq":1,"duplicate":true}"#,
        );
        assert!(is_forged(&p.take(t0).unwrap_err()));
    }

    #[tokio::test]
    async fn an_identical_second_answer_is_dropped() {
        let (mut p, stream) = publisher(Stream::default()).await;
        let t0 = p
            .send("s".into(), HeaderMap::new(), Bytes::new())
            .await
            .unwrap();
        let t1 = p
            .send("s".into(), HeaderMap::new(), Bytes::new())
            .await
            .unwrap();
        plant(&stream, t0, r#"{"stream":"OUTBOX","seq":1}"#);
        plant(&stream, t0, r#"{"stream":"OUTBOX","seq":1}"#);
        plant(&stream, t1, r#"{"stream":"OUTBOX","seq":2}"#);
        assert_eq!(
            p.take(t0).unwrap().unwrap().unwrap(),
            Ack {
                sequence: 1,
                duplicate: false
            }
        );
        assert_eq!(p.take(t1).unwrap().unwrap().unwrap().sequence, 2);
    }
}
