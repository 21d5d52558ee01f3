//! What happened in a simulated world, one line per event with its virtual time: the last lines
//! are printed with a failing seed, the whole trace with `SIM_SEED=<n>`, and its digest is what the
//! determinism test compares between two runs of one seed.
//!
//! Only what the simulators see is traced (writes, deliveries, confirmations, faults), never how
//! often a relay timer fired. A run depends on its seed alone: the relay's `select!`s on the
//! simulated path are biased (an unbiased one picks with a generator tokio seeds anew per runtime,
//! which cannot be set without `--cfg tokio_unstable`), and a large payload's schema check runs on
//! the runtime's thread (`outbox_relay::schema::check_on_the_calling_thread`), not on the blocking
//! pool, whose answer came at a moment of real time. `SIM_DICE_LOG=1` prints where each draw is
//! made (stderr): two runs of a seed that part, part at the first line their logs differ.

use std::collections::VecDeque;
use std::fmt::Write as _;
use std::sync::Mutex;

use tokio::time::Instant;

/// Lines kept for a failure report.
const RECENT: usize = 60;

pub(crate) struct Trace {
    start: Instant,
    inner: Mutex<Inner>,
}

struct Inner {
    recent: VecDeque<String>,
    /// Every line, when the run is replayed on its own (`SIM_SEED`) or compared.
    all: Option<Vec<String>>,
    /// FNV-1a over every line.
    digest: u64,
    lines: u64,
}

impl Trace {
    pub(crate) fn new(keep_all: bool) -> Self {
        Trace {
            start: Instant::now(),
            inner: Mutex::new(Inner {
                recent: VecDeque::with_capacity(RECENT),
                all: keep_all.then(Vec::new),
                digest: 0xcbf2_9ce4_8422_2325,
                lines: 0,
            }),
        }
    }

    /// Seconds of virtual time since the world began.
    pub(crate) fn now(&self) -> f64 {
        self.start.elapsed().as_secs_f64()
    }

    pub(crate) fn log(&self, what: std::fmt::Arguments<'_>) {
        let mut line = String::with_capacity(80);
        let _ = write!(line, "{:>9.3}s {what}", self.now());
        let mut inner = self.inner.lock().unwrap();
        for b in line.bytes() {
            inner.digest = (inner.digest ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
        }
        inner.lines += 1;
        if inner.recent.len() == RECENT {
            inner.recent.pop_front();
        }
        inner.recent.push_back(line.clone());
        if let Some(all) = &mut inner.all {
            all.push(line);
        }
    }

    pub(crate) fn recent(&self) -> Vec<String> {
        self.inner.lock().unwrap().recent.iter().cloned().collect()
    }

    pub(crate) fn all(&self) -> Vec<String> {
        self.inner.lock().unwrap().all.clone().unwrap_or_default()
    }

    /// (digest, number of lines).
    pub(crate) fn digest(&self) -> (u64, u64) {
        let inner = self.inner.lock().unwrap();
        (inner.digest, inner.lines)
    }
}

/// FNV-1a over the stream as it ends: each message's sequence, subject, headers and payload, so
/// that two runs of a seed compare by what they published, not only by what they traced.
pub(crate) fn published(stream: &[super::jetstream::Stored]) -> u64 {
    let mut digest = 0xcbf2_9ce4_8422_2325_u64;
    let mut eat = |bytes: &[u8]| {
        for b in bytes {
            digest = (digest ^ u64::from(*b)).wrapping_mul(0x100_0000_01b3);
        }
    };
    for m in stream {
        eat(&m.seq.to_le_bytes());
        eat(m.subject.as_bytes());
        // A header map's own order differs from one run to the next: by name.
        let mut headers: Vec<_> = m.headers.iter().map(|(n, v)| (n.to_string(), v)).collect();
        headers.sort_by(|a, b| a.0.cmp(&b.0));
        for (name, values) in headers {
            eat(name.as_bytes());
            for v in values {
                // An atomic batch's id names the process and its start (`Nats-Batch-Id`): only
                // its length is the run's.
                if name == "Nats-Batch-Id" {
                    eat(&v.as_str().len().to_le_bytes());
                } else {
                    eat(v.as_str().as_bytes());
                }
            }
        }
        eat(&m.payload);
    }
    digest
}

/// `trace!(t, "...", args)`: one line in `t`.
macro_rules! trace {
    ($t:expr, $($arg:tt)*) => {
        $t.log(format_args!($($arg)*))
    };
}
pub(crate) use trace;

/// The relay's own log lines (info and above, and the sink's debug lines about the fence and the
/// replay), into the world's trace: why it restarted, what it distrusted. A line logged inside a
/// span `process` (the world runs each relay process in one, with its number `n`) says which
/// process wrote it: `relay 2 INFO ...`.
pub(crate) struct RelayLog(pub std::sync::Arc<Trace>);

/// The number of the relay process a span runs, kept in the span's extensions.
struct ProcessNumber(u64);

struct NumberField(Option<u64>);

impl tracing::field::Visit for NumberField {
    fn record_u64(&mut self, field: &tracing::field::Field, value: u64) {
        if field.name() == "n" {
            self.0 = Some(value);
        }
    }

    fn record_debug(&mut self, _: &tracing::field::Field, _: &dyn std::fmt::Debug) {}
}

impl<S> tracing_subscriber::Layer<S> for RelayLog
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    fn on_new_span(
        &self,
        attrs: &tracing::span::Attributes<'_>,
        id: &tracing::span::Id,
        ctx: tracing_subscriber::layer::Context<'_, S>,
    ) {
        if attrs.metadata().name() != "process" {
            return;
        }
        let mut n = NumberField(None);
        attrs.record(&mut n);
        if let (Some(n), Some(span)) = (n.0, ctx.span(id)) {
            span.extensions_mut().insert(ProcessNumber(n));
        }
    }

    fn on_event(&self, event: &tracing::Event<'_>, ctx: tracing_subscriber::layer::Context<'_, S>) {
        let meta = event.metadata();
        let fence = meta.target().starts_with("outbox_relay::sink");
        if *meta.level() > tracing::Level::INFO
            && !(fence && *meta.level() == tracing::Level::DEBUG)
        {
            return;
        }
        let mut line = String::new();
        event.record(&mut Fields(&mut line));
        // Dead-letter reasons and error chains run long; the start says what happened.
        if let Some((cut, _)) = line.char_indices().nth(240) {
            line.truncate(cut);
            line.push('…');
        }
        let process = ctx.event_scope(event).and_then(|scope| {
            scope
                .from_root()
                .find_map(|span| span.extensions().get::<ProcessNumber>().map(|p| p.0))
        });
        let process = process.map(|n| format!(" {n}")).unwrap_or_default();
        self.0.log(format_args!(
            "relay{process} {} {}:{line}",
            meta.level(),
            meta.target()
        ));
    }
}

struct Fields<'a>(&'a mut String);

impl tracing::field::Visit for Fields<'_> {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            let _ = write!(self.0, " {value:?}");
        } else {
            let _ = write!(self.0, " {}={value:?}", field.name());
        }
    }
}
