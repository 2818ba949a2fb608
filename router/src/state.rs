//! What the front door's parts share: the lifecycle phase (one writer: `server`), the ports
//! it got, counters the dispatcher bumps and metrics read, and the controller's drain request.

use std::sync::atomic::{AtomicU16, AtomicU64};
use std::sync::Mutex;
use std::time::Duration;

use tokio::sync::{mpsc, watch};

use crate::metrics::Histogram;
use crate::tfs_metrics::{BatchingMetrics, GraphRunMetrics, LoadMetrics, WarmupMetrics};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Accepting requests (health follows worker readiness).
    Serving,
    /// Health NOT_SERVING; finishing in-flight requests.
    Draining,
    /// gRPC server stopped; waiting to be told to exit.
    Stopped,
}

impl Phase {
    /// The name the controller reads in a snapshot (`phase`).
    pub fn name(self) -> &'static str {
        match self {
            Phase::Serving => "serving",
            Phase::Draining => "draining",
            Phase::Stopped => "stopped",
        }
    }
}

/// The controller asked the front door to drain: say NOT_SERVING, keep answering for `delay`,
/// then stop accepting and give in-flight requests up to `grace`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DrainRequest {
    pub delay: Duration,
    pub grace: Duration,
}

pub struct RouterState {
    /// Written only by the server's lifecycle code.
    pub phase: watch::Sender<Phase>,
    pub grpc_port: AtomicU16,
    /// 0 when metrics are off or could not be served.
    pub metrics_port: AtomicU16,
    /// 0 when the REST API is off or could not be served.
    pub rest_port: AtomicU16,
    /// Requests sent again because their worker left before answering.
    pub retries: AtomicU64,
    /// Requests waiting in the front door for a worker with room (the dispatcher writes it).
    pub queued: AtomicU64,
    /// The longest any request has waited in that queue since start, µs.
    pub queue_wait_max_us: AtomicU64,
    /// How much sooner than its aging bound the queue turns requests urgent (sjf's learned
    /// margin) as of the dispatcher's last look, µs.
    pub queue_margin_us: AtomicU64,
    /// Every request's wait in that queue (the dispatcher records; metrics render).
    pub front_door_wait: Histogram,
    /// From sending a request to a worker until its model call started, per request.
    pub handoff: Histogram,
    /// From the end of a request's model call until the front door read the answer.
    pub reply: Histogram,
    /// TF Serving's batching metrics (the dispatcher records while batching is on; its
    /// metrics page renders them).
    pub batching: BatchingMetrics,
    /// TF Serving's model warm-up metrics, from the workers' READY (the dispatcher records).
    pub warmup: WarmupMetrics,
    /// TensorFlow's SavedModel load metrics, from the workers' READY (the dispatcher records).
    pub loads: LoadMetrics,
    /// TensorFlow's graph run metrics, from the workers' answers (the dispatcher records).
    pub graph_runs: GraphRunMetrics,
    /// The controller's latest NVML sample of each GPU (empty for CPU pools).
    gpus: Mutex<Vec<GpuSample>>,
    /// Every worker slot's state and restarts as the controller last told them (the
    /// metrics' view of what only the controller sees: a slot in BACKOFF or FATAL has no
    /// worker here).
    slots: Mutex<Vec<SlotSample>>,
    /// Drain requests from the control channel; the server acts on the first.
    pub drain: mpsc::UnboundedSender<DrainRequest>,
    /// HandleReloadConfigRequest calls waiting for the controller's answer.
    pub reloads: crate::reload::Reloads,
}

impl RouterState {
    pub fn new() -> (RouterState, mpsc::UnboundedReceiver<DrainRequest>) {
        let (drain, drain_rx) = mpsc::unbounded_channel();
        let (phase, _) = watch::channel(Phase::Serving);
        (
            RouterState {
                phase,
                grpc_port: AtomicU16::new(0),
                metrics_port: AtomicU16::new(0),
                rest_port: AtomicU16::new(0),
                retries: AtomicU64::new(0),
                queued: AtomicU64::new(0),
                queue_wait_max_us: AtomicU64::new(0),
                queue_margin_us: AtomicU64::new(0),
                front_door_wait: Histogram::default(),
                handoff: Histogram::default(),
                reply: Histogram::default(),
                batching: BatchingMetrics::default(),
                warmup: WarmupMetrics::default(),
                loads: LoadMetrics::default(),
                graph_runs: GraphRunMetrics::default(),
                gpus: Mutex::new(Vec::new()),
                slots: Mutex::new(Vec::new()),
                drain,
                reloads: crate::reload::Reloads::default(),
            },
            drain_rx,
        )
    }
}

/// One GPU's memory and utilisation, as the controller read it through NVML.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuSample {
    pub gpu: u64,
    pub uuid: String,
    pub memory_used: u64,
    pub memory_total: u64,
    /// Percent of the last sample period with a kernel running.
    pub utilization: u64,
}

/// The states a worker slot can be in (the controller's `WorkerState`), in the order the
/// metrics list them: a state outside it is refused, so the metric's labels stay these.
pub const SLOT_STATES: [&str; 6] = [
    "STARTING", "READY", "DRAINING", "STOPPED", "BACKOFF", "FATAL",
];

/// One worker slot as the controller sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SlotSample {
    /// Its key ("cpu-0@1", "ranker/cpu-0@2"), as the workers register by.
    pub slot: String,
    /// One of SLOT_STATES.
    pub state: &'static str,
    /// Processes it has had since the pool started, less one.
    pub restarts: u64,
    /// The model (its configured name) and version its workers serve.
    pub model: String,
    pub version: i64,
}

impl RouterState {
    /// A request left the front door's queue after waiting `waited`.
    pub fn note_queue_wait(&self, waited: Duration) {
        let micros = u64::try_from(waited.as_micros()).unwrap_or(u64::MAX);
        self.queue_wait_max_us
            .fetch_max(micros, std::sync::atomic::Ordering::Relaxed);
        self.front_door_wait.observe(waited);
    }

    /// Replaces the GPU samples (the control channel's `gpus` op is the one writer).
    pub fn set_gpus(&self, samples: Vec<GpuSample>) {
        if let Ok(mut gpus) = self.gpus.lock() {
            *gpus = samples;
        }
    }

    pub fn gpus(&self) -> Vec<GpuSample> {
        self.gpus.lock().map(|g| g.clone()).unwrap_or_default()
    }

    /// Replaces the slot samples (the control channel's `slots` op is the one writer).
    pub fn set_slots(&self, samples: Vec<SlotSample>) {
        if let Ok(mut slots) = self.slots.lock() {
            *slots = samples;
        }
    }

    pub fn slots(&self) -> Vec<SlotSample> {
        self.slots.lock().map(|s| s.clone()).unwrap_or_default()
    }

    /// Whether the controller said that every slot of `model` `version` is FATAL: none has
    /// a process, and none tries again before `--fatal-retry-after`, so a request waiting
    /// for a worker there waits for nothing. False while it said nothing of that version
    /// (a front door just started, a version just added): those requests wait as before.
    pub fn every_slot_fatal(&self, model: &str, version: i64) -> bool {
        let Ok(slots) = self.slots.lock() else {
            return false;
        };
        let mut of_version = slots
            .iter()
            .filter(|s| s.model == model && s.version == version)
            .peekable();
        of_version.peek().is_some() && of_version.all(|s| s.state == "FATAL")
    }
}
