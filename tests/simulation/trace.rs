//! What happened in a simulated world, one line per event with its virtual time: the last lines
//! are printed with a failing seed, the whole trace with `SIM_SEED=<n>`, and its digest is what the
//! determinism test compares between two runs of one seed.
//!
//! Only what the simulators see is traced (writes, deliveries, confirmations, faults), never how
//! often a relay timer fired: tokio's `select!` picks among ready branches at random (its seed
//! cannot be set without `--cfg tokio_unstable`), so the number of status updates the relay sends at
//! one instant may vary between runs while everything they say stays the same.

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

/// `trace!(t, "...", args)`: one line in `t`.
macro_rules! trace {
    ($t:expr, $($arg:tt)*) => {
        $t.log(format_args!($($arg)*))
    };
}
pub(crate) use trace;

/// The relay's own log lines (info and above, and the sink's debug lines about the fence and the
/// replay), into the world's trace: why it restarted, what it distrusted.
pub(crate) struct RelayLog(pub std::sync::Arc<Trace>);

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for RelayLog {
    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
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
        self.0.log(format_args!(
            "relay {} {}:{line}",
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
