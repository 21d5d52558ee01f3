//! The CopyBoth phase: a reader task that frames XLogData and keepalives, and a writer task that sends
//! standby status updates on its own timer.
//!
//! # Progress tracking
//!
//! The consumer hands back, through [`ReplicationStream::confirm`], the LSN up to which everything is
//! durably processed: the `Commit.end_lsn` of the last fully acknowledged transaction, or a keepalive's
//! WAL end when nothing is pending (so idle slots advance, P5 in docs/guarantees.md).
//! The writer reports it as
//! `flush` (and `apply`) at least every `status_interval` and at once when the server asks for a reply.
//! The timer is independent of the consumer: a stalled sink fills the bounded event channel and stops
//! the reader, but status updates still go out, so `wal_sender_timeout` never kills a slow relay.
//! Reported LSNs never move backwards. Never confirm an XLogData position: the walsender would skip
//! the rest of a transaction whose commit record starts before it (logical.c).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use postgres_protocol::message::backend::Message;
use postgres_protocol::message::frontend;
use tokio::io::{AsyncWriteExt, ReadHalf, WriteHalf};
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore, mpsc, oneshot};
use tokio::task::JoinHandle;
use tracing::{debug, trace};

use super::error::SourceError;
use super::wire::{
    Backend, MAX_FRAME_BYTES, Transport, log_notice, parse_backend, read_backend, server_error,
};
use crate::Lsn;

/// Tuning of a replication stream.
#[derive(Clone, Debug)]
pub struct StreamConfig {
    /// How often a standby status update is sent even when nothing changed (≤ 1 s).
    pub status_interval: Duration,
    /// Events buffered between the reader task and the consumer; bounds memory and lets TCP
    /// backpressure reach the walsender when the consumer is slow.
    pub channel_capacity: usize,
    /// A connection that delivers nothing (no data, no keepalive) for this long is treated as dead.
    /// The writer asks the server for a keepalive every third of it, so a healthy idle connection
    /// always has traffic; without this, a black-holed network would hang the relay until TCP gives
    /// up, which can take many minutes.
    pub receive_timeout: Duration,
    /// The largest message the server may announce (its length prefix); a larger one ends the stream
    /// with [`SourceError::FrameTooLarge`] before anything is reserved for it.
    pub max_frame_bytes: usize,
}

impl Default for StreamConfig {
    fn default() -> Self {
        StreamConfig {
            status_interval: Duration::from_secs(1),
            channel_capacity: 1024,
            receive_timeout: Duration::from_secs(30),
            max_frame_bytes: MAX_FRAME_BYTES,
        }
    }
}

/// What the walsender sent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReplicationEvent {
    /// One pgoutput message. `wal_start`/`wal_end` are 0 for non-final messages (Relation, Type, …).
    XLogData {
        /// The WAL position of the message's record.
        wal_start: Lsn,
        /// The end of WAL the server reports with the message.
        wal_end: Lsn,
        /// The server's clock when it sent the message (µs since 2000-01-01).
        send_time: i64,
        /// The pgoutput message, after the 25-byte header.
        data: Bytes,
    },
    /// Primary keepalive: everything the walsender decoded before `wal_end` has been sent already.
    Keepalive {
        /// The server's current end of WAL.
        wal_end: Lsn,
        /// The server's clock when it sent the keepalive (µs since 2000-01-01).
        send_time: i64,
        /// The server asks for a status update at once (it nears `wal_sender_timeout`).
        reply_requested: bool,
    },
}

/// State shared by the consumer, the reader and the writer.
struct Shared {
    /// Highest WAL position received (XLogData end or keepalive end): reported as `write`.
    received: AtomicU64,
    /// Highest LSN the consumer confirmed: reported as `flush` and `apply`.
    confirmed: AtomicU64,
    /// The `flush` LSN of the last status update written to the server.
    reported: Arc<AtomicU64>,
    /// Wakes the writer for an immediate status update (reply requested, or a new confirm on stop).
    reply_now: Notify,
    /// Set once the consumer asked to stop: the reader then drains instead of forwarding.
    stopping: AtomicBool,
}

/// A running replication stream. Dropping it aborts both tasks and the connection.
pub struct ReplicationStream {
    /// Batches of events, one per socket read (see `read_loop`).
    events: mpsc::Receiver<Result<Batch, SourceError>>,
    /// The rest of the batch being consumed.
    pending: std::vec::IntoIter<ReplicationEvent>,
    /// The bytes the batch being consumed holds of [`MAX_BUFFERED_BYTES`], given back when the
    /// next batch is taken.
    _pending_bytes: Option<OwnedSemaphorePermit>,
    shared: Arc<Shared>,
    reader: JoinHandle<Option<ReadHalf<Box<dyn Transport>>>>,
    writer: JoinHandle<Option<WriteHalf<Box<dyn Transport>>>>,
    stop_writer: Option<oneshot::Sender<()>>,
    backend_pid: i32,
}

impl ReplicationStream {
    pub(crate) fn spawn(
        io: Box<dyn Transport>,
        rbuf: BytesMut,
        target: String,
        backend_pid: i32,
        start: Lsn,
        config: StreamConfig,
    ) -> Self {
        let shared = Arc::new(Shared {
            received: AtomicU64::new(start.0),
            confirmed: AtomicU64::new(start.0),
            reported: Arc::new(AtomicU64::new(start.0)),
            reply_now: Notify::new(),
            stopping: AtomicBool::new(false),
        });
        let (read_half, write_half) = tokio::io::split(io);
        // Slots hold batches of up to MAX_BATCH events; about `channel_capacity` events in all
        // when the reader is ahead.
        let (tx, events) = mpsc::channel((config.channel_capacity / 64).max(2));
        let budget = Arc::new(Semaphore::new(MAX_BUFFERED_BYTES));
        let (stop_writer, stop_rx) = oneshot::channel();
        let reader = tokio::spawn(read_loop(
            read_half,
            rbuf,
            target,
            Arc::clone(&shared),
            Outbox { tx, budget },
            config.receive_timeout,
            config.max_frame_bytes,
        ));
        let writer = tokio::spawn(write_loop(
            write_half,
            Arc::clone(&shared),
            config.status_interval,
            config.receive_timeout / 3,
            stop_rx,
        ));
        ReplicationStream {
            events,
            pending: Vec::new().into_iter(),
            _pending_bytes: None,
            shared,
            reader,
            writer,
            stop_writer: Some(stop_writer),
            backend_pid,
        }
    }

    /// A stream over `io`, already in CopyBoth at `start`, for the deterministic simulation: the
    /// simulated walsender holds the pipe's other end.
    pub fn over(io: tokio::io::DuplexStream, start: Lsn, config: StreamConfig) -> Self {
        Self::spawn(
            Box::new(io),
            BytesMut::new(),
            "simulated walsender".to_owned(),
            0,
            start,
            config,
        )
    }

    /// The same stream, naming `pid` as its walsender's (the simulation's walsenders have pids of
    /// their own, which the stop mark is made under: `Connector::session_ended`).
    #[cfg(feature = "test-support")]
    pub fn with_backend_pid(mut self, pid: i32) -> Self {
        self.backend_pid = pid;
        self
    }

    /// The next event, or an error (after which the stream is dead: reconnect from the confirmed LSN).
    /// `None` once the stream ended.
    /// Cancel safe: a batch taken from the channel is kept before anything else can happen.
    pub async fn recv(&mut self) -> Option<Result<ReplicationEvent, SourceError>> {
        loop {
            if let Some(ev) = self.pending.next() {
                return Some(Ok(ev));
            }
            match self.events.recv().await? {
                Ok(batch) => {
                    self.pending = batch.events.into_iter();
                    self._pending_bytes = Some(batch.bytes);
                }
                Err(e) => return Some(Err(e)),
            }
        }
    }

    /// Hands back the LSN up to which everything is durably processed. Never moves backwards; a
    /// smaller value is ignored. Sent with the next status update.
    pub fn confirm(&self, lsn: Lsn) {
        self.shared.confirmed.fetch_max(lsn.0, Ordering::AcqRel);
    }

    /// The highest LSN confirmed so far (the start LSN before any confirm).
    pub fn confirmed(&self) -> Lsn {
        Lsn(self.shared.confirmed.load(Ordering::Acquire))
    }

    /// The `flush` LSN of the last status update sent to the server, kept current by the writer:
    /// what the slot has been told is confirmed.
    pub(crate) fn reported(&self) -> Arc<AtomicU64> {
        Arc::clone(&self.shared.reported)
    }

    /// The highest WAL position received so far.
    pub(crate) fn received(&self) -> Lsn {
        Lsn(self.shared.received.load(Ordering::Acquire))
    }

    /// Asks the writer for a status update now instead of at the next tick.
    pub fn send_status_now(&self) {
        self.shared.reply_now.notify_one();
    }

    /// The walsender's pid.
    pub fn backend_pid(&self) -> i32 {
        self.backend_pid
    }

    /// Clean stop: a final status update with the confirmed LSN, CopyDone, drain the server's
    /// remaining messages until ReadyForQuery (bounded by `timeout`), then Terminate.
    pub async fn stop(mut self, timeout: Duration) -> Result<(), SourceError> {
        self.shared.stopping.store(true, Ordering::Release);
        if let Some(tx) = self.stop_writer.take() {
            let _ = tx.send(());
        }
        let drain = async {
            // Keep receiving so a reader blocked on a full channel can go on draining.
            while self.events.recv().await.is_some() {}
            let read_half = (&mut self.reader).await.ok().flatten();
            let write_half = (&mut self.writer).await.ok().flatten();
            if let (Some(r), Some(w)) = (read_half, write_half) {
                let mut io = r.unsplit(w);
                let mut buf = BytesMut::new();
                frontend::terminate(&mut buf);
                let _ = io.write_all(&buf).await;
                let _ = io.shutdown().await;
            }
        };
        if tokio::time::timeout(timeout, drain).await.is_err() {
            debug!("replication stream did not stop in time; closing the connection");
        }
        Ok(())
    }
}

impl Drop for ReplicationStream {
    fn drop(&mut self) {
        self.reader.abort();
        self.writer.abort();
    }
}

/// What one backend message means for the reader.
enum Step {
    /// Hand this event to the consumer.
    Event(ReplicationEvent),
    /// Nothing to hand on (a notice, the end of COPY while stopping, CommandComplete).
    Skip,
    /// The stream ended with this error (reported unless stopping).
    Fail(SourceError),
    /// Clean end after CopyDone: give the read half back.
    Done,
}

/// Most events handed over in one batch; bounds the memory one channel slot holds.
const MAX_BATCH: usize = 256;
/// A batch also ends once it holds this many bytes of XLogData.
const MAX_BATCH_BYTES: usize = 512 << 10;
/// The XLogData bytes the reader may have handed on and the consumer not yet finished (P6): the
/// channel's slots and the batch being consumed together. Counting slots alone would allow 16 large
/// rows, gigabytes. A batch larger than the whole budget (one row above it) takes all of it, so it
/// travels alone.
const MAX_BUFFERED_BYTES: usize = 8 << 20;

/// Events handed over together, with their share of [`MAX_BUFFERED_BYTES`].
struct Batch {
    events: Vec<ReplicationEvent>,
    bytes: OwnedSemaphorePermit,
}

/// Where the reader hands batches: the channel, and the byte budget a batch must take first.
struct Outbox {
    tx: mpsc::Sender<Result<Batch, SourceError>>,
    budget: Arc<Semaphore>,
}

impl Outbox {
    /// Waits for the batch's bytes to fit, then for a slot. `Err` when the consumer is gone.
    async fn send(&self, events: Vec<ReplicationEvent>, bytes: usize) -> Result<(), ()> {
        let permits = u32::try_from(bytes.clamp(1, MAX_BUFFERED_BYTES)).unwrap_or(u32::MAX);
        let bytes = Arc::clone(&self.budget)
            .acquire_many_owned(permits)
            .await
            .map_err(|_| ())?;
        self.tx
            .send(Ok(Batch { events, bytes }))
            .await
            .map_err(|_| ())
    }
}

/// Reads frames until the connection ends. Returns the read half after a clean end of COPY.
///
/// Every message already in the buffer after a socket read is parsed and handed on as one batch:
/// one channel send and one consumer wake-up per read instead of per message, which is most of what
/// the hop costs when a walsender sends transactions of many small messages.
async fn read_loop(
    mut io: ReadHalf<Box<dyn Transport>>,
    mut buf: BytesMut,
    target: String,
    shared: Arc<Shared>,
    out: Outbox,
    receive_timeout: Duration,
    max_frame: usize,
) -> Option<ReadHalf<Box<dyn Transport>>> {
    let mut copy_done = false;
    let mut batch: Vec<ReplicationEvent> = Vec::new();
    let mut batch_bytes = 0usize;
    loop {
        // The first message of a batch may wait for the socket; the rest are what is buffered.
        let read = tokio::time::timeout(
            receive_timeout,
            read_backend(&mut io, &mut buf, &target, max_frame),
        );
        let first = read.await.unwrap_or_else(|_| {
            Err(SourceError::Timeout {
                target: target.clone(),
                secs: receive_timeout.as_secs(),
            })
        });
        let mut next: Option<Result<Backend, SourceError>> = Some(first);
        let mut end: Option<Option<SourceError>> = None;
        while let Some(msg) = next.take() {
            let step = match msg {
                Ok(m) => on_message(m, &shared, &mut copy_done),
                Err(e) => Step::Fail(e),
            };
            match step {
                Step::Event(ev) => {
                    if !shared.stopping.load(Ordering::Acquire) {
                        if let ReplicationEvent::XLogData { data, .. } = &ev {
                            batch_bytes += data.len();
                        }
                        batch.push(ev);
                    }
                }
                Step::Skip => {}
                Step::Fail(e) => {
                    end = Some(Some(e));
                    break;
                }
                Step::Done => {
                    end = Some(None);
                    break;
                }
            }
            if batch.len() < MAX_BATCH && batch_bytes < MAX_BATCH_BYTES {
                next = parse_backend(&mut buf, max_frame).transpose();
            }
        }
        if !batch.is_empty() {
            let events = std::mem::replace(&mut batch, Vec::with_capacity(16));
            let bytes = std::mem::take(&mut batch_bytes);
            if out.send(events, bytes).await.is_err() {
                // The consumer is gone; keep draining only while stopping.
                if !shared.stopping.load(Ordering::Acquire) {
                    return None;
                }
            }
        }
        match end {
            None => {}
            Some(None) => return Some(io),
            Some(Some(e)) => {
                if !shared.stopping.load(Ordering::Acquire) {
                    let _ = out.tx.send(Err(e)).await;
                }
                return None;
            }
        }
    }
}

/// Interprets one backend message of the CopyBoth phase.
fn on_message(msg: Backend, shared: &Shared, copy_done: &mut bool) -> Step {
    let Backend::Message(msg) = msg else {
        return Step::Fail(SourceError::Protocol(
            "unexpected message in replication stream".into(),
        ));
    };
    let event = match msg {
        Message::CopyData(body) => match parse_copy_data(body.into_bytes()) {
            Ok(ev) => ev,
            Err(e) => return Step::Fail(e),
        },
        Message::NoticeResponse(body) => {
            log_notice(body.fields());
            return Step::Skip;
        }
        Message::ErrorResponse(body) => {
            return Step::Fail(match server_error(body.fields()) {
                Ok(error) => SourceError::Server {
                    context: "replication stream",
                    error: Box::new(error),
                },
                Err(e) => e,
            });
        }
        Message::CopyDone => {
            *copy_done = true;
            if !shared.stopping.load(Ordering::Acquire) {
                // The server ended the stream on its own (shutdown): reconnect later.
                return Step::Fail(SourceError::Closed(
                    "the server ended the replication stream",
                ));
            }
            return Step::Skip;
        }
        Message::CommandComplete(_) => return Step::Skip,
        Message::ReadyForQuery(_) if *copy_done => return Step::Done,
        _ => {
            return Step::Fail(SourceError::Protocol(
                "unexpected message in replication stream".into(),
            ));
        }
    };
    match &event {
        ReplicationEvent::XLogData { wal_end, .. } => {
            if !wal_end.is_zero() {
                shared.received.fetch_max(wal_end.0, Ordering::AcqRel);
            }
        }
        ReplicationEvent::Keepalive {
            wal_end,
            reply_requested,
            ..
        } => {
            shared.received.fetch_max(wal_end.0, Ordering::AcqRel);
            if *reply_requested {
                // Answer before queueing: the consumer may be slow.
                shared.reply_now.notify_one();
            }
        }
    }
    Step::Event(event)
}

/// The payload of one CopyData of the replication stream: XLogData (`'w'`) or primary keepalive
/// (`'k'`). Any other tag is an error: a newer server feature we do not understand must not be skipped.
///
/// Pure and zero-copy (the XLogData payload is a slice of `data`), so the framing fuzz target
/// (`fuzz/fuzz_targets/framing.rs`) can drive it with arbitrary bytes. Layouts: "Streaming Replication
/// Protocol" in the Postgres docs (<https://www.postgresql.org/docs/current/protocol-replication.html>).
pub fn parse_copy_data(mut data: Bytes) -> Result<ReplicationEvent, SourceError> {
    let bad = |reason: String| SourceError::BadFrame {
        lsn: Lsn::ZERO,
        reason,
    };
    let Some(&tag) = data.first() else {
        return Err(bad("empty CopyData".into()));
    };
    match tag {
        b'w' => {
            if data.len() < 25 {
                return Err(bad(format!("XLogData of {} bytes, need 25", data.len())));
            }
            data.advance(1);
            let wal_start = Lsn(data.get_u64());
            let wal_end = Lsn(data.get_u64());
            let send_time = data.get_i64();
            trace!(%wal_start, len = data.len(), "xlogdata");
            Ok(ReplicationEvent::XLogData {
                wal_start,
                wal_end,
                send_time,
                data,
            })
        }
        b'k' => {
            if data.len() < 18 {
                return Err(bad(format!("keepalive of {} bytes, need 18", data.len())));
            }
            data.advance(1);
            let wal_end = Lsn(data.get_u64());
            let send_time = data.get_i64();
            let reply_requested = data.get_u8() != 0;
            Ok(ReplicationEvent::Keepalive {
                wal_end,
                send_time,
                reply_requested,
            })
        }
        other => Err(bad(format!(
            "unknown replication message tag {:?}",
            char::from(other)
        ))),
    }
}

/// Sends status updates every `interval`, at once when woken, and a final one before CopyDone.
async fn write_loop(
    mut io: WriteHalf<Box<dyn Transport>>,
    shared: Arc<Shared>,
    interval: Duration,
    ping_interval: Duration,
    mut stop: oneshot::Receiver<()>,
) -> Option<WriteHalf<Box<dyn Transport>>> {
    let mut last_ping = tokio::time::Instant::now();
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut buf = BytesMut::with_capacity(64);
    let mut last_flush = 0u64;
    loop {
        // Biased, like every `select!` on the relay's path: tokio's unbiased pick draws from a
        // generator seeded anew by each runtime, so two runs of one simulated world made different
        // numbers of status updates and parted. Stop first; a wake-up and a tick send the same update.
        let stopping = tokio::select! {
            biased;
            _ = &mut stop => true,
            _ = shared.reply_now.notified() => false,
            _ = tick.tick() => false,
        };
        let write = shared.received.load(Ordering::Acquire);
        let flush = shared.confirmed.load(Ordering::Acquire);
        debug_assert!(flush >= last_flush, "confirmed LSN moved backwards");
        last_flush = flush;
        // Ask for a keepalive now and then: proof, for the reader's timeout, that the path is alive.
        let ping = last_ping.elapsed() >= ping_interval;
        if ping {
            last_ping = tokio::time::Instant::now();
        }
        status_update(&mut buf, Lsn(write.max(flush)), Lsn(flush), ping);
        if stopping {
            frontend::copy_done(&mut buf);
        }
        if io.write_all(&buf).await.is_err() || io.flush().await.is_err() {
            // The reader sees the broken connection and reports it.
            return None;
        }
        buf.clear();
        shared.reported.fetch_max(flush, Ordering::AcqRel);
        trace!(write = %Lsn(write), flush = %Lsn(flush), "status update");
        if stopping {
            return Some(io);
        }
    }
}

/// Appends a CopyData-wrapped standby status update (`'r'`): write, flush, apply, clock, and whether
/// the server should answer with a keepalive at once.
fn status_update(out: &mut BytesMut, write: Lsn, flush: Lsn, reply_requested: bool) {
    let mut payload = [0u8; 34];
    let mut p = &mut payload[..];
    p.put_u8(b'r');
    p.put_u64(write.0);
    p.put_u64(flush.0);
    p.put_u64(flush.0);
    p.put_i64(crate::lsn::pg_now_micros());
    p.put_u8(u8::from(reply_requested));
    // CopyData::new only fails for bodies over i32::MAX bytes.
    if let Ok(msg) = frontend::CopyData::new(&payload[..]) {
        msg.write(out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncReadExt;

    #[test]
    fn parses_xlogdata_without_copying_payload() {
        let mut b = BytesMut::new();
        b.put_u8(b'w');
        b.put_u64(0x10);
        b.put_u64(0x20);
        b.put_i64(7);
        b.put_slice(b"Bpayload");
        let frame = b.freeze();
        match parse_copy_data(frame.clone()).unwrap() {
            ReplicationEvent::XLogData {
                wal_start,
                wal_end,
                send_time,
                data,
            } => {
                assert_eq!((wal_start, wal_end, send_time), (Lsn(0x10), Lsn(0x20), 7));
                assert_eq!(&data[..], b"Bpayload");
                assert_eq!(data.as_ptr(), frame[25..].as_ptr(), "payload is a slice");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn parses_keepalive() {
        let mut b = BytesMut::new();
        b.put_u8(b'k');
        b.put_u64(0xABCD);
        b.put_i64(1);
        b.put_u8(1);
        assert_eq!(
            parse_copy_data(b.freeze()).unwrap(),
            ReplicationEvent::Keepalive {
                wal_end: Lsn(0xABCD),
                send_time: 1,
                reply_requested: true
            }
        );
    }

    #[test]
    fn short_or_unknown_frames_are_errors() {
        assert!(parse_copy_data(Bytes::from_static(b"w\0\0")).is_err());
        assert!(parse_copy_data(Bytes::from_static(b"k\0")).is_err());
        assert!(parse_copy_data(Bytes::new()).is_err());
        let e = parse_copy_data(Bytes::from_static(b"s\0\0\0")).unwrap_err();
        assert!(e.to_string().contains("'s'"), "{e}");
    }

    #[test]
    fn status_update_layout() {
        let mut out = BytesMut::new();
        status_update(&mut out, Lsn(0x30), Lsn(0x20), false);
        // 'd', i32 len = 4 + 34, then 'r' write flush apply ts reply
        assert_eq!(out.len(), 1 + 4 + 34);
        assert_eq!(out[0], b'd');
        assert_eq!(&out[1..5], &38u32.to_be_bytes());
        assert_eq!(out[5], b'r');
        assert_eq!(&out[6..14], &0x30u64.to_be_bytes());
        assert_eq!(&out[14..22], &0x20u64.to_be_bytes());
        assert_eq!(&out[22..30], &0x20u64.to_be_bytes());
        assert_eq!(out[38], 0);
        out.clear();
        status_update(&mut out, Lsn(0x30), Lsn(0x20), true);
        assert_eq!(out[38], 1, "reply requested");
    }

    /// One XLogData CopyData frame carrying `len` payload bytes.
    fn xlogdata_frame(len: usize) -> Vec<u8> {
        let mut b = BytesMut::new();
        b.put_u8(b'd');
        b.put_u32((4 + 25 + len) as u32);
        b.put_u8(b'w');
        b.put_u64(0x10);
        b.put_u64(0x20);
        b.put_i64(0);
        b.put_bytes(b'x', len);
        b.to_vec()
    }

    /// P6 with large rows: a consumer that does not read stops the reader once about
    /// `MAX_BUFFERED_BYTES` are handed on, whatever the number of channel slots (16 slots of 2 MiB
    /// rows would be 32 MiB). Everything still arrives once the consumer reads.
    #[tokio::test]
    async fn large_rows_are_buffered_up_to_the_byte_budget() {
        const ROW: usize = 2 << 20;
        const ROWS: usize = 20;
        let (relay_end, mut server_end) = tokio::io::duplex(64 << 10);
        let config = StreamConfig {
            receive_timeout: Duration::from_secs(600),
            status_interval: Duration::from_secs(600),
            ..StreamConfig::default()
        };
        let mut stream = ReplicationStream::over(relay_end, Lsn(0x10), config);
        let written = Arc::new(AtomicU64::new(0));
        let counter = Arc::clone(&written);
        let server = tokio::spawn(async move {
            let frame = xlogdata_frame(ROW);
            for _ in 0..ROWS {
                server_end.write_all(&frame).await.unwrap();
                counter.fetch_add(1, Ordering::AcqRel);
            }
            // Keep the server's end open (and drain status updates) until the test ends.
            let mut sink = [0u8; 1024];
            while server_end.read(&mut sink).await.is_ok_and(|n| n > 0) {}
        });
        // Until the writer stops making progress: the reader waits for the budget.
        let mut last = u64::MAX;
        while written.load(Ordering::Acquire) != last {
            last = written.load(Ordering::Acquire);
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        // Handed on (8 MiB: four rows), one waiting in the reader, one half-written into the pipe;
        // far below the channel's 16 slots.
        assert!(
            last <= 6,
            "{last} rows of 2 MiB read ahead of a stalled consumer"
        );
        for _ in 0..ROWS {
            match stream.recv().await {
                Some(Ok(ReplicationEvent::XLogData { data, .. })) => assert_eq!(data.len(), ROW),
                other => panic!("{other:?}"),
            }
        }
        server.abort();
    }
}
