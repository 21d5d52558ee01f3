//! The sustained-load bench's consumer: an ordered JetStream consumer on the phase's fresh stream, on
//! a thread of its own (named [`CONSUMER_THREAD`], with a current-thread runtime) so its CPU is told
//! apart from the writers'. For each event it keeps the moment it received it and the stream
//! message's timestamp (when JetStream stored it, nats-server's clock) and the database's clock at
//! the INSERT that the writers put in the payload, all wall-clock nanoseconds,
//! indexed by the event's number taken from its id (`Nats-Msg-Id`, or `Outbox-Event-Id` in atomic
//! batches, which carry no `Nats-Msg-Id`).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicUsize, Ordering};
use std::time::Duration;

use anyhow::Context;
use async_nats::jetstream::{self, consumer::DeliverPolicy, consumer::pull::OrderedConfig};
use futures_util::StreamExt;

use crate::cpu_share::CONSUMER_THREAD;
use crate::writers::{change_ns, event_index, wall_ns};

/// What the consumer saw, per event number (0 = not received).
pub(crate) struct Receipts {
    pub(crate) received_ns: Vec<AtomicI64>,
    pub(crate) stored_ns: Vec<AtomicI64>,
    pub(crate) change_ns: Vec<AtomicI64>,
    pub(crate) count: AtomicUsize,
    /// Messages whose id is not one of this phase's events (none expected on a fresh stream).
    pub(crate) foreign: AtomicUsize,
}

/// The running consumer.
pub(crate) struct Consumer {
    receipts: Arc<Receipts>,
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<anyhow::Result<()>>,
}

impl Consumer {
    /// Starts consuming `stream` from its first message, for `events` events of `phase`; returns
    /// once the consumer exists on the server.
    pub(crate) fn start(
        nats_url: String,
        stream: &'static str,
        phase: u32,
        events: usize,
    ) -> anyhow::Result<Consumer> {
        let receipts = Arc::new(Receipts {
            received_ns: (0..events).map(|_| AtomicI64::new(0)).collect(),
            stored_ns: (0..events).map(|_| AtomicI64::new(0)).collect(),
            change_ns: (0..events).map(|_| AtomicI64::new(0)).collect(),
            count: AtomicUsize::new(0),
            foreign: AtomicUsize::new(0),
        });
        let stop = Arc::new(AtomicBool::new(false));
        let (ready_tx, ready_rx) = std::sync::mpsc::channel::<anyhow::Result<()>>();
        let thread = {
            let (receipts, stop) = (Arc::clone(&receipts), Arc::clone(&stop));
            std::thread::Builder::new()
                .name(CONSUMER_THREAD.into())
                .spawn(move || {
                    let rt = tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()?;
                    rt.block_on(consume(nats_url, stream, phase, &receipts, &stop, ready_tx))
                })?
        };
        match ready_rx.recv_timeout(Duration::from_secs(30)) {
            Ok(Ok(())) => Ok(Consumer {
                receipts,
                stop,
                thread,
            }),
            Ok(Err(e)) => Err(e),
            Err(_) => match thread.join() {
                Ok(Err(e)) => Err(e.context("the consumer did not start")),
                _ => anyhow::bail!("the consumer did not start in 30 s"),
            },
        }
    }

    /// Events received so far.
    pub(crate) fn received(&self) -> usize {
        self.receipts.count.load(Ordering::Relaxed)
    }

    /// Stops consuming and hands over what was received.
    pub(crate) fn finish(self) -> anyhow::Result<Arc<Receipts>> {
        self.stop.store(true, Ordering::Relaxed);
        match self.thread.join() {
            Ok(result) => result?,
            Err(_) => anyhow::bail!("the consumer thread panicked"),
        }
        Ok(self.receipts)
    }
}

async fn consume(
    nats_url: String,
    stream: &str,
    phase: u32,
    receipts: &Receipts,
    stop: &AtomicBool,
    ready: std::sync::mpsc::Sender<anyhow::Result<()>>,
) -> anyhow::Result<()> {
    let setup = async {
        let client = async_nats::connect(&nats_url).await?;
        let js = jetstream::new(client);
        let consumer = js
            .get_stream(stream)
            .await?
            .create_consumer(OrderedConfig {
                deliver_policy: DeliverPolicy::All,
                ..Default::default()
            })
            .await?;
        anyhow::Ok(consumer.messages().await?)
    };
    let mut messages = match setup.await.context("create the ordered consumer") {
        Ok(m) => {
            let _ = ready.send(Ok(()));
            m
        }
        Err(e) => {
            let _ = ready.send(Err(e));
            return Ok(());
        }
    };
    while !stop.load(Ordering::Relaxed) {
        let next = tokio::time::timeout(Duration::from_millis(100), messages.next()).await;
        let Ok(next) = next else { continue };
        let Some(message) = next else {
            anyhow::bail!("the consumer's message stream ended");
        };
        let message = message.context("consumer")?;
        let now = wall_ns();
        let stored = message
            .info()
            .map_or(0, |i| i.published.unix_timestamp_nanos() as i64);
        let index = message
            .headers
            .as_ref()
            .and_then(|h| h.get("Nats-Msg-Id").or_else(|| h.get("Outbox-Event-Id")))
            .and_then(|id| event_index(id.as_str(), phase));
        match index.filter(|&i| i < receipts.received_ns.len()) {
            // The first receipt counts (an ordered consumer that resets can deliver again).
            Some(i) => {
                let first = receipts.received_ns[i]
                    .compare_exchange(0, now, Ordering::Relaxed, Ordering::Relaxed)
                    .is_ok();
                if first {
                    receipts.stored_ns[i].store(stored, Ordering::Relaxed);
                    let change = change_ns(&message.payload).unwrap_or(0);
                    receipts.change_ns[i].store(change, Ordering::Relaxed);
                    receipts.count.fetch_add(1, Ordering::Relaxed);
                }
            }
            None => {
                receipts.foreign.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
    Ok(())
}
