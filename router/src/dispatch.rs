//! Sending requests to workers over ZeroMQ and matching their replies.
//!
//! One actor task owns both sockets: the ROUTER the workers connect to (ZMTP spoken by
//! `zmtp`; what a round sends leaves at its end, one write per worker) and the libzmq ROUTER
//! of the controller's control channel (a libzmq socket is not thread-safe: "one socket, one
//! owner"). Request handlers talk to it through a channel; it reads the control socket
//! through its ZMQ_FD with `AsyncFd`. That FD is edge-triggered, and a send can swallow a
//! pending edge, so after it fires and after every batch of sends, everything queued is read.
//!
//! In-flight work when a worker dies: the request goes to another worker (inference is
//! idempotent) while the client's deadline allows; the caller (`call`) owns that loop.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tokio::io::unix::AsyncFd;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::time::Instant;

use crate::batch::{self, Batching};
use crate::config::ModelEntry;
use crate::control;
use crate::policies::{self, CostModel, Scheduling};
use crate::request_budget::KeptShare;
use crate::signature::{self, ModelSignatures};
use crate::split;
use crate::state::RouterState;
use crate::status::{Code, ServingError};
use crate::timeline::{wall_micros, Timeline, DEFAULT_CAPACITY};
use crate::versions::{ModelId, Models, Servable, Target};
use crate::wire::{self, TensorMeta, WorkerMessage};
use crate::workers::{Departure, WorkerTable};
use crate::zmtp::{self, RouterSocket, SendError};
use crate::{log_error, log_info, log_warn};

/// How long a request waits for some worker to become routable when none is (a restart in
/// progress) before it fails with UNAVAILABLE, if the client's deadline is longer.
pub const NO_WORKER_WAIT: Duration = Duration::from_secs(5);
const LIVENESS_SWEEP: Duration = Duration::from_millis(100);
/// How many times one request (or chunk) may be lost by a worker that did not leave in order
/// before it fails. A worker that leaves while holding it loses it, and it is sent again
/// elsewhere; a request that ends every worker it reaches (a query of death: an op that
/// aborts the process on its input) would otherwise take the whole pool down, over and over.
/// A worker that said BYE (drained, retired, stopped) left by choice and does not count.
pub const MAX_SENDS: u32 = 3;
/// The front door's exit status when its dispatcher panicked: not one the pool expects
/// (0, or 3 for a configuration it refuses), so supervisord starts it again.
const DISPATCHER_PANICKED: i32 = 70;

/// What a request gets when no worker comes back to take it again. Once workers have died
/// on it at least twice and none is left, it is as likely what ended them as not: INTERNAL,
/// which clients do not retry (UNAVAILABLE would have them send it again into the workers
/// restarting), as after MAX_SENDS. One loss (a killed worker, a restarting supervisord)
/// says nothing about the request: UNAVAILABLE, as for a request that never reached one.
fn given_up_without_workers(waited: ServingError, lost: u32, last_loss: &str) -> ServingError {
    if lost < 2 || waited.code != Code::Unavailable {
        return waited;
    }
    let message = format!(
        "the request was sent to a worker {lost} times and each left before answering (last: \
         {last_loss}); it is not sent again, as it may be what ends them, and {}",
        lowercase_first(&waited.message)
    );
    ServingError::new(Code::Internal, message)
}

fn lowercase_first(text: &str) -> String {
    let mut chars = text.chars();
    chars.next().map_or_else(String::new, |first| {
        first.to_lowercase().chain(chars).collect()
    })
}

pub struct WorkRequest {
    /// The model version it runs on (`VersionTable::resolve`).
    pub target: Target,
    pub signature: String,
    pub tensors: Vec<TensorMeta>,
    pub frames: Vec<Bytes>,
    pub outputs: Vec<String>,
    /// Its signature declares each output it asks for with one row per input row (or says
    /// nothing of the output's shape): only then may it share a call with other requests
    /// or be cut into chunks, as such a call's answer is cut back into rows.
    pub row_wise: bool,
    /// Its shares of the request budget, given back when the last copy of its frames goes
    /// (`KeptShare`); none for a small request.
    pub memory: KeptShare,
}

impl WorkRequest {
    /// Its rows: the first dimension of its first input (1 for a scalar or no input).
    pub fn rows(&self) -> u64 {
        self.tensors
            .first()
            .and_then(|(_, _, shape)| shape.first())
            .map_or(1, |&rows| rows.max(0) as u64)
    }

    /// Whether every input's first dimension is its rows: only then can it be cut into
    /// chunks, merged with others, or sized by its rows.
    pub fn one_first_dimension(&self) -> bool {
        let rows = self.rows() as i64;
        (self.tensors.iter()).all(|(_, _, shape)| shape.first() == Some(&rows))
    }
}

#[derive(Debug)]
pub struct WorkReply {
    pub tensors: Vec<TensorMeta>,
    /// The output tensors' bytes, each a slice of the buffer its frame was read into.
    pub frames: Vec<Bytes>,
    /// The worker that answered (the gRPC side has no use for it yet; tests check where a
    /// retried request went).
    #[cfg_attr(not(test), allow(dead_code))]
    pub slot: String,
    /// The model version that answered (the response's `model_spec.version`).
    pub version: i64,
    /// When the worker's model call started and ended (wall-clock µs), if it said.
    pub span: Option<(i64, i64)>,
}

/// What becomes of one sending of a request.
#[derive(Debug)]
enum Outcome {
    Reply(WorkReply),
    Error(ServingError),
    /// Its worker left before answering: send it again elsewhere. `orderly`: the worker
    /// said BYE (`Departure::orderly`), which does not count against the request.
    Lost {
        why: String,
        orderly: bool,
        /// It shared that call with other requests: any of them may be what ended the worker.
        merged: bool,
        /// It already runs by itself (a merged call it was in failed before).
        alone: bool,
    },
    /// No worker is routable right now. `alone`: the request must run by itself when sent
    /// again (a merged call it was in failed), not merge or pad with others.
    NoWorker {
        alone: bool,
    },
}

/// Which send of a request a `Command::Send` is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Sending {
    First,
    /// Sent again after its worker left (or none was ready).
    Again,
    /// Sent again after a worker left in the middle of a merged call it was in: from then on
    /// it runs by itself, so that a request that ends workers (a query of death) takes no
    /// other request down with it again, and is given up alone after `MAX_SENDS`.
    AgainAlone,
}

enum Command {
    Send {
        id: u64,
        request: Arc<WorkRequest>,
        answer: oneshot::Sender<Outcome>,
        /// When the client's request arrived (a retry keeps it).
        arrived: std::time::Instant,
        /// When the client stops waiting, if it said: the worker does not start a call
        /// after it, and stops one it can (`wire::encode_request`).
        deadline: Option<Instant>,
        /// The first send, or a retry (already counted on arrival), and whether it may share
        /// a call.
        sending: Sending,
    },
    /// The caller stopped waiting (deadline): forget the entry.
    Cancel {
        id: u64,
    },
    /// The caller went away (its call dropped: the client cancelled or left): the entry leaves
    /// the queue, if it waits there; sent to a worker, it stays until answered (its frames and
    /// its shares of the budget with it).
    Withdraw {
        id: u64,
    },
    Shutdown,
}

#[derive(Debug, thiserror::Error)]
pub enum DispatchError {
    #[error("cannot bind the worker socket {endpoint}: {source}")]
    BindWorkers {
        endpoint: String,
        source: std::io::Error,
    },
    #[error("cannot bind the control socket {endpoint}: {source}")]
    Bind {
        endpoint: String,
        source: zmq::Error,
    },
    #[error("cannot set up ZeroMQ: {0}")]
    Zmq(#[from] zmq::Error),
    #[error("cannot watch a ZeroMQ socket: {0}")]
    Io(#[from] std::io::Error),
    #[error("{0}")]
    Scheduling(String),
}

#[derive(Clone)]
pub struct Dispatcher {
    commands: mpsc::UnboundedSender<Command>,
    ids: Arc<AtomicU64>,
    signatures: watch::Receiver<Signatures>,
    versions: watch::Receiver<Arc<Models>>,
    routable: watch::Receiver<Routable>,
    ready: watch::Receiver<usize>,
    serving: watch::Receiver<usize>,
    copied: watch::Receiver<std::collections::BTreeMap<String, u64>>,
    state: Arc<RouterState>,
    /// NO_WORKER_WAIT, shorter in tests.
    no_worker_wait: Duration,
    /// `--split-rows` (0: off).
    split_rows: u64,
    /// Each version's own batching and splitting (`Scheduling::per_model_batching`).
    per_model_batching: bool,
}

/// Each servable's signatures, as its workers reported them in READY.
pub type Signatures = std::collections::BTreeMap<Servable, Arc<ModelSignatures>>;

/// Which servables a request can be sent to now: routable workers per model version, and
/// each model's latest AVAILABLE version (where requests that named none go).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Routable {
    pub by_servable: std::collections::BTreeMap<Servable, usize>,
    pub latest: std::collections::BTreeMap<ModelId, i64>,
}

impl Routable {
    /// Where a request goes now: its own version while that has a worker; one that named no
    /// version moves to its model's latest if its own has none left (it retired). None: no
    /// worker can take it.
    pub fn route(&self, target: Target) -> Option<Servable> {
        let at = |version: i64| Servable {
            model: target.model,
            version,
        };
        let has = |s: &Servable| self.by_servable.get(s).is_some_and(|n| *n > 0);
        if has(&target.servable()) {
            return Some(target.servable());
        }
        let latest = self.latest.get(&target.model).map(|v| at(*v));
        latest.filter(|l| !target.pinned && has(l))
    }
}

impl Dispatcher {
    /// Bind the sockets in `run_dir` and start the actor on the current runtime.
    pub fn start(
        run_dir: &str,
        models: &[ModelEntry],
        worker_timeout: Duration,
        scheduling: &Scheduling,
        state: Arc<RouterState>,
    ) -> Result<Dispatcher, DispatchError> {
        scheduling.check().map_err(DispatchError::Scheduling)?;
        let (Some(chooser), Some(make_queue)) = (
            policies::chooser(&scheduling.dispatch),
            policies::order_maker(&scheduling.queue, scheduling.aging_bound),
        ) else {
            return Err(DispatchError::Scheduling(format!("{scheduling:?}")));
        };
        let context = zmq::Context::new();
        let path = std::path::Path::new(run_dir).join(wire::WORKERS_ENDPOINT);
        let workers = RouterSocket::bind(&path).map_err(|source| DispatchError::BindWorkers {
            endpoint: wire::endpoint(run_dir, wire::WORKERS_ENDPOINT),
            source,
        })?;
        let control = context.socket(zmq::ROUTER)?;
        control.set_linger(0)?;
        let endpoint = wire::endpoint(run_dir, wire::CONTROL_ENDPOINT);
        control
            .bind(&endpoint)
            .map_err(|source| DispatchError::Bind {
                endpoint: endpoint.clone(),
                source,
            })?;
        let (commands, commands_rx) = mpsc::unbounded_channel();
        let (signatures_tx, signatures) = watch::channel(Signatures::new());
        // READY from a model not listed here is not learned.
        let Some(tables) = Models::configured(models) else {
            return Err(DispatchError::Scheduling(format!(
                "a pool serves 1 to {} models, not {}",
                ModelId::MAX,
                models.len()
            )));
        };
        let (versions_tx, versions) = watch::channel(Arc::new(tables));
        let (routable_tx, routable) = watch::channel(Routable::default());
        let (ready_tx, ready) = watch::channel(0);
        let (serving_tx, serving) = watch::channel(0);
        let (copied_tx, copied) = watch::channel(Default::default());
        let actor = Actor {
            control_fd: signal_fd(&control)?,
            workers,
            control,
            table: WorkerTable::new(worker_timeout, chooser),
            requests: HashMap::new(),
            queue: ServableQueues::new(make_queue),
            reroute: false,
            queued_rows: HashMap::new(),
            queued_by_model: BTreeMap::new(),
            worker_inflight: scheduling.worker_inflight,
            costs: CostModel::default(),
            batching: scheduling.batching.clone().map(Arc::new),
            per_model_batching: scheduling.per_model_batching,
            split_rows: scheduling.split_rows,
            next_batch_id: FIRST_BATCH_ID,
            wake_at: None,
            timeline: Timeline::new(DEFAULT_CAPACITY),
            signatures: signatures_tx,
            versions: versions_tx,
            routable: routable_tx,
            ready: ready_tx,
            serving: serving_tx,
            copied: copied_tx,
            state: state.clone(),
            _context: context,
        };
        let actor = tokio::spawn(actor.run(commands_rx));
        // The dispatcher is the front door's one owner of its workers: after a panic in it
        // (which tokio contains) every request was answered "the front door is shutting
        // down" while status said SERVING, and nothing restarted it (found by a hunt). The
        // process ends instead, and supervisord starts another.
        tokio::spawn(async move {
            if let Err(ended) = actor.await {
                if ended.is_panic() {
                    log_error!("the dispatcher panicked: the front door exits to be restarted");
                    std::process::exit(DISPATCHER_PANICKED);
                }
            }
        });
        Ok(Dispatcher {
            commands,
            ids: Arc::new(AtomicU64::new(1)),
            signatures,
            versions,
            routable,
            ready,
            serving,
            copied,
            state,
            no_worker_wait: NO_WORKER_WAIT,
            split_rows: scheduling.split_rows,
            per_model_batching: scheduling.per_model_batching,
        })
    }

    pub fn signatures(&self) -> watch::Receiver<Signatures> {
        self.signatures.clone()
    }

    /// The served models' versions and labels (the controller's word).
    pub fn versions(&self) -> Arc<Models> {
        self.versions.borrow().clone()
    }

    /// The served models, as they change.
    pub fn models(&self) -> watch::Receiver<Arc<Models>> {
        self.versions.clone()
    }

    pub fn ready_workers(&self) -> watch::Receiver<usize> {
        self.ready.clone()
    }

    /// The READY workers whose version the controller has said AVAILABLE: what health
    /// says SERVING by. A worker is READY a controller tick before its version is
    /// AVAILABLE, and at the pool's start its model's requests were refused as still
    /// loading for that tick while health said SERVING (a readiness probe's traffic failed;
    /// found by a README hunt).
    pub fn serving_workers(&self) -> watch::Receiver<usize> {
        self.serving.clone()
    }

    /// Slot → bytes of shared weights TensorFlow copied into its worker, for the
    /// `mpspool_worker_copied_weight_bytes` gauge.
    pub fn copied_weights(&self) -> watch::Receiver<std::collections::BTreeMap<String, u64>> {
        self.copied.clone()
    }

    pub fn shutdown(&self) {
        let _ = self.commands.send(Command::Shutdown);
    }

    /// Run one request; `deadline` bounds the whole call, retries included. A request above
    /// `--split-rows` runs as chunks on several workers at once (`split`); the first chunk
    /// to fail fails the request with its error, and the others are dropped.
    pub async fn call(
        &self,
        request: WorkRequest,
        deadline: Option<Instant>,
    ) -> Result<WorkReply, ServingError> {
        let target = Servable {
            model: request.target.model,
            version: request.target.version,
        };
        let split_rows = split_rows_of(
            &self.versions.borrow(),
            self.per_model_batching,
            self.split_rows,
            target,
        );
        let Some(chunks) = split::split(&request, split_rows) else {
            return self.call_whole(request, deadline).await;
        };
        drop(request);
        let count = chunks.len();
        // A window of chunks at the workers at once, the next sent as one is answered: all
        // at once, a request of 10,000 chunks passed a worker's send queue (1,000 messages)
        // and was refused "too many requests queued" (found by a review).
        let window = chunks_in_flight(*self.ready.borrow());
        let mut waiting = chunks.into_iter().enumerate();
        let mut running = tokio::task::JoinSet::new();
        let send = |running: &mut tokio::task::JoinSet<_>, (index, (chunk, rows))| {
            let dispatcher = self.clone();
            running
                .spawn(async move { (index, rows, dispatcher.call_whole(chunk, deadline).await) });
        };
        for next in waiting.by_ref().take(window) {
            send(&mut running, next);
        }
        let mut answers: Vec<Option<(WorkReply, u64)>> = (0..count).map(|_| None).collect();
        while let Some(done) = running.join_next().await {
            if let Some(next) = waiting.next() {
                send(&mut running, next);
            }
            match done {
                Ok((index, rows, Ok(reply))) => answers[index] = Some((reply, rows)),
                Ok((_, _, Err(error))) => return Err(error),
                Err(error) => {
                    let message = format!("a chunk of a split request failed: {error}");
                    return Err(ServingError::new(Code::Internal, message));
                }
            }
        }
        split::join(answers.into_iter().flatten().collect())
    }

    /// Run one request, whole, on some worker.
    async fn call_whole(
        &self,
        request: WorkRequest,
        deadline: Option<Instant>,
    ) -> Result<WorkReply, ServingError> {
        let request = Arc::new(request);
        let arrived = std::time::Instant::now();
        let deadline_exceeded = || ServingError::new(Code::DeadlineExceeded, "Deadline Exceeded");
        let mut lost = 0;
        let mut last_loss = String::new();
        let mut sending = Sending::First;
        // The send waiting for its outcome, withdrawn if this call is dropped meanwhile: a
        // queued request stayed queued until it reached the head, its frames and shares of the
        // budget held for nobody, new requests refused for them (found by a review).
        let mut waiting = Withdrawn {
            commands: &self.commands,
            id: None,
        };
        loop {
            // A retry after the deadline passed would only make a worker do work nobody reads.
            if deadline.is_some_and(|d| d <= Instant::now()) {
                return Err(deadline_exceeded());
            }
            let id = self.ids.fetch_add(1, Ordering::Relaxed);
            let (answer, outcome) = oneshot::channel();
            let command = Command::Send {
                id,
                request: request.clone(),
                answer,
                arrived,
                deadline,
                sending,
            };
            if sending == Sending::First {
                sending = Sending::Again;
            }
            if self.commands.send(command).is_err() {
                return Err(ServingError::new(
                    Code::Unavailable,
                    "the front door is shutting down",
                ));
            }
            waiting.id = Some(id);
            let outcome = match deadline {
                None => outcome.await,
                Some(deadline) => match tokio::time::timeout_at(deadline, outcome).await {
                    Ok(outcome) => outcome,
                    Err(_) => {
                        waiting.id = None;
                        let _ = self.commands.send(Command::Cancel { id });
                        return Err(deadline_exceeded());
                    }
                },
            };
            waiting.id = None;
            match outcome {
                Ok(Outcome::Reply(reply)) => return Ok(reply),
                Ok(Outcome::Error(error)) => return Err(error),
                Ok(Outcome::Lost {
                    why,
                    orderly,
                    merged,
                    alone,
                }) => {
                    lost += u32::from(!orderly);
                    if (merged && !orderly) || alone {
                        sending = Sending::AgainAlone;
                    }
                    if lost >= MAX_SENDS {
                        log_warn!("request {id} given up after {lost} sends: {why}");
                        let message = format!(
                            "the request was sent to a worker {lost} times and each left before \
                             answering (last: {why}); it is not sent again, as it may be what \
                             ends them"
                        );
                        return Err(ServingError::new(Code::Internal, message));
                    }
                    log_info!("retrying request {id} elsewhere: {why}");
                    self.state.retries.fetch_add(1, Ordering::Relaxed);
                    if !orderly {
                        last_loss = why;
                    }
                }
                Ok(Outcome::NoWorker { alone }) => {
                    if alone {
                        sending = Sending::AgainAlone;
                    }
                    if let Err(error) = self.wait_for_worker(request.target, deadline).await {
                        return Err(given_up_without_workers(error, lost, &last_loss));
                    }
                }
                Err(_) => {
                    return Err(ServingError::new(
                        Code::Unavailable,
                        "the front door is shutting down",
                    ))
                }
            }
        }
    }

    async fn wait_for_worker(
        &self,
        target: Target,
        deadline: Option<Instant>,
    ) -> Result<(), ServingError> {
        if let Some(failed) = self.failed_version(target) {
            return Err(failed);
        }
        let mut limit = Instant::now() + self.no_worker_wait;
        let by_deadline = deadline.is_some_and(|d| d <= limit);
        if let Some(deadline) = deadline {
            limit = limit.min(deadline);
        }
        let mut routable = self.routable.clone();
        let waited =
            tokio::time::timeout_at(limit, routable.wait_for(|r| r.route(target).is_some())).await;
        match waited {
            Ok(Ok(_)) => Ok(()),
            _ if by_deadline => Err(ServingError::new(
                Code::DeadlineExceeded,
                "Deadline Exceeded",
            )),
            _ => Err(ServingError::new(
                Code::Unavailable,
                "no worker is ready to serve the request",
            )),
        }
    }

    /// UNAVAILABLE at once for a request whose version no worker can serve and every slot
    /// of which the controller reported FATAL: none comes back before `--fatal-retry-after`,
    /// so waiting NO_WORKER_WAIT for one would only hold the caller. A version whose slots
    /// restart or back off is waited for, as a worker's restart is.
    fn failed_version(&self, target: Target) -> Option<ServingError> {
        if self.routable.borrow().route(target).is_some() {
            return None;
        }
        let model = self.versions.borrow().get(target.model)?.model.clone();
        if !self.state.every_slot_fatal(&model, target.version) {
            return None;
        }
        let message = format!(
            "no worker can serve model {model} version {}: each of its workers failed (FATAL; \
             `mpspool status` says why)",
            target.version
        );
        Some(ServingError::new(Code::Unavailable, message))
    }
}

/// The rows above which a request to `servable` is cut into chunks (0: not cut): the pool's
/// `--split-rows`, or with per-model batching the version's own.
fn split_rows_of(models: &Models, per_model_batching: bool, pool: u64, servable: Servable) -> u64 {
    if !per_model_batching {
        return pool;
    }
    (models.get(servable.model))
        .and_then(|table| table.versions.get(&servable.version))
        .map_or(0, |entry| entry.split_rows)
}

/// Resolves at `at`; never without one.
async fn wake(at: Option<std::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(Instant::from_std(at)).await,
        None => std::future::pending().await,
    }
}

/// Whether a liveness sweep woke more than a sweep after it was due (`interval.tick()` yields
/// the instant it was due, however late the task got to run).
fn sweep_was_late(scheduled: Instant, woke: Instant) -> bool {
    woke.saturating_duration_since(scheduled) > LIVENESS_SWEEP
}

/// A request waiting in the front door for a worker with room.
struct Queued {
    request: Arc<WorkRequest>,
    answer: oneshot::Sender<Outcome>,
    arrived: std::time::Instant,
    /// When it last entered the queue (arrived, sent again, or back from a merged call that
    /// failed): TF Serving's batch queue wait is measured from here.
    enqueued: std::time::Instant,
    deadline: Option<Instant>,
    /// The model version it goes to (its request's, or the latest if that one retired).
    servable: Servable,
    /// Expected compute µs (the queue order's input).
    cost: f64,
    /// What must match for it to share a call (batching only), taken once on arrival. None:
    /// it runs by itself — batching is off, its inputs cannot merge, or the merged call it
    /// was part of failed and alone it says whose fault that was.
    merge_key: Option<batch::MergeKey>,
    /// A merged call it was in failed: from then on it runs by itself, whatever version it
    /// moves to and however often it is sent again.
    alone: bool,
    /// The batching its model version has (the pool's, or with per-model batching the
    /// version's own), taken on arrival; None: not batched.
    batching: Option<Arc<Batching>>,
}

/// The rows waiting in one of a model version's batch queues (`Actor::queued_rows`).
struct QueuedRows {
    signature: String,
    outputs: Vec<String>,
    rows: u64,
}

impl QueuedRows {
    fn holds(&self, request: &WorkRequest) -> bool {
        self.signature == request.signature && self.outputs == request.outputs
    }
}

/// A call sent to a worker and not answered yet: one request, or several merged into one.
struct Pending {
    id: u64,
    /// What was sent (teaches the cost model when the answer comes).
    sent: Arc<WorkRequest>,
    /// Who waits for the answer, with their request ids, in row order.
    members: Vec<(u64, Queued)>,
    /// The answer must be cut into the members' rows.
    merged: bool,
    /// Wall-clock µs when it was written to the worker (the worker stamps its model call on
    /// the same clock).
    sent_us: i64,
}

impl Pending {
    fn tell_all(self, outcome: impl Fn() -> Outcome) {
        for (_, member) in self.members {
            let _ = member.answer.send(outcome());
        }
    }
}

/// What the queue's head leaves with: itself alone or with the requests that share its call,
/// padded to `padded` rows; or nothing yet, the batch (`members`) waiting to fill until
/// `until`.
enum Gathered {
    Send {
        members: Vec<(u64, Queued)>,
        padded: u64,
    },
    Wait {
        until: std::time::Instant,
        members: Vec<(u64, Queued)>,
    },
}

/// The deadline of a call: its request's, or for a merged call the last of its members' (it
/// runs while any of them still waits); none if any member has none.
fn call_deadline(members: &[(u64, Queued)]) -> Option<Instant> {
    let mut last: Option<Instant> = None;
    for (_, member) in members {
        let deadline = member.deadline?;
        last = Some(last.map_or(deadline, |l| l.max(deadline)));
    }
    last
}

/// Requests looked at past the head for a batch, so a pump's work stays bounded.
const GATHER_SCAN: usize = 256;
/// Requests one version's batches look at past their heads in one pump (`Actor::pump_version`).
const PUMP_SCAN: usize = 2 * GATHER_SCAN;
/// Merged calls get ids of their own, apart from the callers' (which count up from 1).
const FIRST_BATCH_ID: u64 = 1 << 62;

/// A ZeroMQ socket's signalling FD, watched by tokio; the socket itself stays with the actor
/// (`zmq::Socket` is not `Sync`, so no future may hold a reference to it across an await).
struct SignalFd(std::os::fd::RawFd);

impl std::os::fd::AsRawFd for SignalFd {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        self.0
    }
}

fn signal_fd(socket: &zmq::Socket) -> Result<AsyncFd<SignalFd>, DispatchError> {
    let fd = SignalFd(socket.get_fd()?);
    // SAFETY: the FD belongs to a socket the actor owns in a field declared after this
    // watcher's, so the watcher is dropped (deregistered) before the socket closes the FD.
    let watcher = unsafe { AsyncFd::register_with_interest(fd, tokio::io::Interest::READABLE) };
    Ok(watcher.map_err(std::io::Error::from)?)
}

struct Actor {
    // The FD watcher first: fields drop in order, and it must be gone before the socket
    // closes the FD it watches.
    control_fd: AsyncFd<SignalFd>,
    /// The workers' DEALER sockets connect here (ZMTP spoken natively: `zmtp`).
    workers: RouterSocket,
    control: zmq::Socket,
    table: WorkerTable<Pending>,
    /// Request id → the worker it was sent to (for Cancel).
    requests: HashMap<u64, Vec<u8>>,
    /// Requests waiting for a worker with room (only with a `worker_inflight` limit), a queue
    /// per model version.
    queue: ServableQueues<Queued>,
    /// What is routable changed since the queues were last sorted (`reroute_queued`).
    reroute: bool,
    /// Rows of batched requests waiting in `queue`, by batch queue: as in TF Serving, each
    /// signature (with the outputs asked for) of each model version has a queue of its own,
    /// bounded by its `max_enqueued_batches`.
    queued_rows: HashMap<Servable, Vec<QueuedRows>>,
    /// Requests waiting in `queue`, by model (what the controller's retiring waits for).
    queued_by_model: BTreeMap<ModelId, u64>,
    worker_inflight: usize,
    costs: CostModel,
    /// The pool's batching (`--enable-batching`, not per model).
    batching: Option<Arc<Batching>>,
    /// Each version's own batching instead (`VersionEntry::batching`).
    per_model_batching: bool,
    /// `--split-rows` (0: off), as the Dispatcher's.
    split_rows: u64,
    next_batch_id: u64,
    /// When a batch waiting to fill must leave (`batch_timeout_micros`).
    wake_at: Option<std::time::Instant>,
    timeline: Timeline,
    signatures: watch::Sender<Signatures>,
    versions: watch::Sender<Arc<Models>>,
    routable: watch::Sender<Routable>,
    ready: watch::Sender<usize>,
    /// The READY workers of AVAILABLE versions (`Dispatcher::serving_workers`).
    serving: watch::Sender<usize>,
    copied: watch::Sender<std::collections::BTreeMap<String, u64>>,
    state: Arc<RouterState>,
    _context: zmq::Context,
}

impl Actor {
    async fn run(mut self, mut commands: mpsc::UnboundedReceiver<Command>) {
        let mut sweep = tokio::time::interval(LIVENESS_SWEEP);
        sweep.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                command = commands.recv() => {
                    let Some(command) = command else { break };
                    if !self.handle(command) {
                        break;
                    }
                    // Take whatever else is queued before looking at the socket again.
                    while let Ok(command) = commands.try_recv() {
                        if !self.handle(command) {
                            return;
                        }
                    }
                    self.drain_workers();
                }
                incoming = self.workers.recv() => {
                    let Some(incoming) = incoming else { break };
                    self.incoming(incoming);
                    self.drain_workers();
                }
                guard = self.control_fd.readable() => {
                    if let Ok(mut guard) = guard {
                        guard.clear_ready();
                    }
                    self.drain_control();
                }
                () = wake(self.wake_at) => {
                    self.wake_at = None;
                }
                scheduled = sweep.tick() => {
                    // Silence is only evidence if this front door was listening: after a late
                    // wake-up (the machine starved of CPU) heartbeats may be queued unread, some
                    // still in the socket's reader tasks. Read what is there, judge next round.
                    let woke = Instant::now();
                    self.drain_workers();
                    if !sweep_was_late(scheduled, woke) {
                        self.expire(woke);
                    }
                }
            }
            // Answers and arrivals free and add room: send what waits.
            self.pump();
            // Everything this round sent to a worker leaves in one write per worker.
            self.workers.flush();
        }
    }

    /// False when the actor should stop.
    fn handle(&mut self, command: Command) -> bool {
        match command {
            Command::Send {
                id,
                request,
                answer,
                arrived,
                deadline,
                sending,
            } => self.enqueue(id, request, answer, arrived, deadline, sending),
            Command::Cancel { id } => {
                if let Some(queued) = self.queue_remove(id) {
                    self.left_unanswered(&queued);
                    self.publish_queue();
                } else if let Some(identity) = self.requests.remove(&id) {
                    if let Some(handle) = self.table.get_mut(&identity) {
                        handle.inflight.remove(&id);
                    }
                }
            }
            Command::Withdraw { id } => {
                if let Some(queued) = self.queue_remove(id) {
                    self.left_unanswered(&queued);
                    self.publish_queue();
                }
            }
            Command::Shutdown => return false,
        }
        true
    }

    fn enqueue(
        &mut self,
        id: u64,
        request: Arc<WorkRequest>,
        answer: oneshot::Sender<Outcome>,
        arrived: std::time::Instant,
        deadline: Option<Instant>,
        sending: Sending,
    ) {
        let alone = sending == Sending::AgainAlone;
        let Some(servable) = self.routable.borrow().route(request.target) else {
            let _ = answer.send(Outcome::NoWorker { alone });
            return;
        };
        let rows = request.rows();
        let mut merge_key = None;
        let batching = self.batching_of(servable);
        if let Some(batching) = &batching {
            if sending == Sending::First {
                // Before the queue's limit, as TF Serving sizes a request before scheduling it.
                let first_dimensions = (request.tensors.iter())
                    .map(|(_, _, shape)| shape.first().map_or(0, |rows| rows.unsigned_abs()));
                self.state.batching.record_input(first_dimensions);
            }
            // A batched call's inputs are cut along one first dimension: TF Serving's batching
            // session refuses one without (batching_util.h, ComputeTensorBatchSize).
            if let Some(error) = batch::unbatchable(&request) {
                let _ = answer.send(Outcome::Error(error));
                return;
            }
            // TF Serving's scheduler refuses it (shared_batch_scheduler.h): max_batch_size is
            // what an operator sizes a call's memory by. With splitting (--split-rows,
            // enable_large_batch_splitting), where max_batch_size is the chunks' size, one
            // that could not be cut runs alone, as before. (Its inputs share one first
            // dimension: `unbatchable` refused any other.)
            let splits = || {
                let models = self.versions.borrow();
                split_rows_of(&models, self.per_model_batching, self.split_rows, servable) > 0
            };
            if rows > batching.max_batch_size && !splits() {
                let _ = answer.send(Outcome::Error(batch::too_large(rows, batching)));
                return;
            }
            let key = batch::merge_key(&request).map(|(key, _)| key);
            let queued_rows = (self.queued_rows.get(&servable))
                .and_then(|queues| queues.iter().find(|q| q.holds(&request)))
                .map_or(0, |q| q.rows);
            if queued_rows.saturating_add(rows) > batching.queue_rows() {
                let full = ServingError::new(Code::Unavailable, batch::QUEUE_FULL);
                let _ = answer.send(Outcome::Error(full));
                return;
            }
            merge_key = key.filter(|_| !alone);
        }
        let cost = self
            .costs
            .estimate(request.target.model, &request.signature, rows);
        let queued = Queued {
            request,
            answer,
            arrived,
            enqueued: std::time::Instant::now(),
            deadline,
            servable,
            cost,
            merge_key,
            alone,
            batching,
        };
        self.queue_push(id, queued);
        self.pump();
    }

    /// A request that named no version goes to `servable`, its model's latest, as its own
    /// version has no worker left: it is batched as that version's requests are (with
    /// per-model batching a version without parameters must get no merged or padded call).
    fn moved(&self, queued: &mut Queued, servable: Servable) {
        queued.servable = servable;
        let batching = self.batching_of(servable);
        queued.merge_key = match (&queued.batching, &batching) {
            (_, None) => None,
            (Some(_), Some(_)) => queued.merge_key.take(),
            (None, Some(_)) => batch::merge_key(&queued.request).map(|(key, _)| key),
        }
        .filter(|_| !queued.alone)
        .filter(|_| {
            batching
                .as_ref()
                .is_some_and(|b| queued.request.rows() <= b.max_batch_size)
        });
        queued.batching = batching;
    }

    /// The batching of a model version's requests: the pool's, or with per-model batching
    /// the version's own as the controller last listed it.
    fn batching_of(&self, servable: Servable) -> Option<Arc<Batching>> {
        if !self.per_model_batching {
            return self.batching.clone();
        }
        let models = self.versions.borrow();
        let table = models.get(servable.model)?;
        table.versions.get(&servable.version)?.batching.clone()
    }

    fn queue_push(&mut self, id: u64, queued: Queued) {
        if queued.batching.is_some() {
            let queues = self.queued_rows.entry(queued.servable).or_default();
            let request = &queued.request;
            match queues.iter_mut().find(|q| q.holds(request)) {
                Some(queue) => queue.rows += request.rows(),
                None => queues.push(QueuedRows {
                    signature: request.signature.clone(),
                    outputs: request.outputs.clone(),
                    rows: request.rows(),
                }),
            }
        }
        *self
            .queued_by_model
            .entry(queued.servable.model)
            .or_default() += 1;
        let (servable, arrived, cost) = (queued.servable, queued.arrived, queued.cost);
        self.queue.push(servable, id, queued, arrived, cost);
    }

    /// The next of `servable`'s waiting requests.
    fn queue_pop(&mut self, servable: Servable, now: std::time::Instant) -> Option<(u64, Queued)> {
        let servers = self.table.ready_of(servable);
        let (id, queued) = self.queue.pop(servable, now, servers)?;
        self.left_queue(&queued);
        Some((id, queued))
    }

    fn queue_remove(&mut self, id: u64) -> Option<Queued> {
        let queued = self.queue.remove(id)?;
        self.left_queue(&queued);
        Some(queued)
    }

    fn left_queue(&mut self, queued: &Queued) {
        if let (Some(queues), Some(_)) =
            (self.queued_rows.get_mut(&queued.servable), &queued.batching)
        {
            let request = &queued.request;
            if let Some(queue) = queues.iter_mut().find(|q| q.holds(request)) {
                queue.rows = queue.rows.saturating_sub(request.rows());
            }
            queues.retain(|q| q.rows > 0);
            if queues.is_empty() {
                self.queued_rows.remove(&queued.servable);
            }
        }
        let model = queued.servable.model;
        if let Some(n) = self.queued_by_model.get_mut(&model) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.queued_by_model.remove(&model);
            }
        }
    }

    /// Send waiting requests, each version's in its queue's order, while its workers have
    /// room.
    fn pump(&mut self) {
        let mut wake: Option<std::time::Instant> = None;
        loop {
            if std::mem::take(&mut self.reroute) {
                self.reroute_queued();
            }
            for servable in self.queue.waiting() {
                // Every worker full (the common case under load): leave the queues as they are.
                if !self.table.has_room(self.worker_inflight) {
                    break;
                }
                if let Some(until) = self.pump_version(servable) {
                    wake = Some(wake.map_or(until, |w| w.min(until)));
                }
            }
            // A worker that left while requests were sent: theirs go where they route now.
            if !self.reroute {
                break;
            }
        }
        if wake.is_some() {
            self.wake_at = wake;
        }
        self.publish_queue();
    }

    /// Send `servable`'s waiting requests while one of its workers has room; when a batch
    /// left filling must leave, if one is.
    fn pump_version(&mut self, servable: Servable) -> Option<std::time::Instant> {
        // Requests this version's batches may look at past their heads, together: once
        // spent, a head leaves or waits with no others gathered to it this round (they join
        // at the next pump), so that many batches filling at once (inputs of many lengths,
        // each a batch of its own) do not make each pump scan the queue once per batch
        // (found by a review: 15× the front door's CPU with 200 filling), and the loop still
        // reaches every request. Each version has a budget of its own, as each has queues of
        // its own: with one shared by all, the first versions' filling batches spent it and a
        // later version's batch left with one row of its 20 (found by a review).
        let mut scan_left = PUMP_SCAN;
        // Batches short of full waiting out their `batch_timeout_micros`: they go back, while
        // what is behind them (other signatures, a full batch) goes on, as each of TF
        // Serving's batch queues is a queue of its own.
        let mut filling: Vec<(u64, Queued)> = Vec::new();
        let mut held: Vec<(u64, Queued)> = Vec::new();
        let mut wake: Option<std::time::Instant> = None;
        // Picked only for a request there (the chooser moves on at each pick: round-robin
        // picking once more per pump sent every request to the same worker).
        while self.queue.holds(servable) {
            let Some(handle) = self.table.pick(self.worker_inflight, servable) else {
                break;
            };
            let identity = handle.identity.clone();
            let now = std::time::Instant::now();
            let Some((id, head)) = self.queue_pop(servable, now) else {
                break;
            };
            if head.answer.is_closed() {
                // Its caller went away (cancelled, or its deadline passed just before its
                // Cancel comes): nobody would read the answer.
                self.left_unanswered(&head);
                continue;
            }
            // One behind a batch that fills (beyond the requests it looked at) joins it later.
            let joins_filling = head.merge_key.is_some()
                && (filling.iter()).any(|(_, m)| m.merge_key == head.merge_key);
            if joins_filling {
                held.push((id, head));
                continue;
            }
            match self.gather(id, head, now, &mut scan_left) {
                Gathered::Send { members, padded } => {
                    for (_, member) in &members {
                        let waited = now.saturating_duration_since(member.arrived);
                        self.state.note_queue_wait(waited);
                        self.timeline.note_queue_wait(waited);
                    }
                    self.transmit(identity, members, padded);
                }
                Gathered::Wait { until, members } => {
                    wake = Some(wake.map_or(until, |w| w.min(until)));
                    filling.extend(members);
                }
            }
        }
        for (id, queued) in held.into_iter().chain(filling) {
            self.queue_push(id, queued);
        }
        wake
    }

    /// What is routable changed (a worker came or left, a version retired): each waiting
    /// request goes to the version it routes to now (one that named no version follows its
    /// model's latest when its own has no worker left), or its caller is told there is no
    /// worker (it waits for one).
    fn reroute_queued(&mut self) {
        let now = std::time::Instant::now();
        for (id, queued) in self.queue.take_all(now) {
            self.left_queue(&queued);
            if queued.answer.is_closed() {
                self.left_unanswered(&queued);
                continue;
            }
            self.route_back(id, queued);
        }
        let ready = self.table.ready_by_servable();
        self.queue
            .retain_empty(|servable| ready.contains_key(servable));
    }

    /// Without batching, the head alone. With it, the head and the waiting requests (in the
    /// queue's order) that can share its call, up to `max_batch_size` rows; while that is
    /// short of full and the oldest of them has waited less than `batch_timeout_micros`,
    /// they all wait on, unless a request that could share it did not fit (TF Serving then
    /// closes the batch and starts the next: the closed one leaves at once).
    fn gather(
        &mut self,
        id: u64,
        head: Queued,
        now: std::time::Instant,
        scan_left: &mut usize,
    ) -> Gathered {
        let rows = head.request.rows();
        let (Some(batching), Some(_)) = (head.batching.clone(), &head.merge_key) else {
            // Running alone (a merged call it was in failed, or could not be held), it is
            // still padded to an allowed batch size, as every batched call: a model made
            // for those sizes only got one of a size it was not made for (found by a review).
            let padded = match &head.batching {
                Some(batching) if head.alone && batch::can_merge(&head.request) => {
                    batching.padded(rows)
                }
                _ => rows,
            };
            return Gathered::Send {
                members: vec![(id, head)],
                padded,
            };
        };
        let (max, timeout) = (batching.max_batch_size, batching.timeout);
        let servable = head.servable;
        let mut total = rows;
        let mut members = vec![(id, head)];
        let mut passed_over = Vec::new();
        let mut closed = false;
        for _ in 0..GATHER_SCAN {
            if total >= max || *scan_left == 0 {
                break;
            }
            let Some((other_id, other)) = self.queue_pop(servable, now) else {
                break;
            };
            *scan_left -= 1;
            if other.answer.is_closed() {
                self.left_unanswered(&other); // cancelled by its caller
                continue;
            }
            let shares = other.merge_key.is_some() && other.merge_key == members[0].1.merge_key;
            let fits = shares && total + other.request.rows() <= max;
            closed |= shares && !fits;
            if fits {
                total += other.request.rows();
                members.push((other_id, other));
            } else {
                passed_over.push((other_id, other));
            }
        }
        for (other_id, other) in passed_over {
            self.queue_push(other_id, other);
        }
        let oldest = members.iter().map(|(_, m)| m.arrived).min().unwrap_or(now);
        if total < max && !closed && now < oldest + timeout {
            return Gathered::Wait {
                until: oldest + timeout,
                members,
            };
        }
        let padded = batching.padded(total);
        Gathered::Send { members, padded }
    }

    fn publish_queue(&self) {
        self.state
            .queued
            .store(self.queue.len() as u64, Ordering::Relaxed);
        let margin = self.queue.margin(std::time::Instant::now());
        self.state.queue_margin_us.store(
            u64::try_from(margin.as_micros()).unwrap_or(u64::MAX),
            Ordering::Relaxed,
        );
    }

    /// The members of a merged call that failed (or whose answer cannot be cut) go back to
    /// the queue to run one by one, keeping their place: the error of the one at fault then
    /// reaches only its own caller.
    /// A member whose caller stopped waiting (its deadline passed: `Cancel` cannot find a
    /// member of a call in flight) is dropped, not run for nobody.
    fn rerun_alone(&mut self, members: Vec<(u64, Queued)>) {
        for (id, mut member) in members {
            if member.answer.is_closed() {
                continue;
            }
            member.merge_key = None;
            member.alone = true;
            member.enqueued = std::time::Instant::now();
            self.queue_push(id, member);
        }
    }

    fn transmit(&mut self, identity: Vec<u8>, members: Vec<(u64, Queued)>, padded: u64) {
        let Some(handle) = self.table.get_mut(&identity) else {
            return;
        };
        let slot = handle.slot.clone();
        let rows: u64 = members.iter().map(|(_, m)| m.request.rows()).sum();
        let merged = members.len() > 1 || padded > rows;
        let (id, sent) = if merged {
            let requests: Vec<&WorkRequest> = members.iter().map(|(_, m)| &*m.request).collect();
            // The merged call is a copy of its members' frames (kept until it is answered, for
            // retries) with its padding: held from the request budget first. Padding one 8 MiB
            // request to an allowed batch size of 128 built 1.05 GB, counted by no budget
            // (found by a hunt).
            let bytes = batch::merged_bytes(&requests, padded).unwrap_or(0);
            let already = (requests.iter()).map(|r| r.memory.held_bytes()).sum();
            let held = match hold_merged(bytes, already, padded, rows) {
                Ok(held) => held,
                // Alone, each member's frames go as they are (no copy), unless it is padded.
                Err(_) if members.len() > 1 => {
                    self.rerun_alone(members);
                    return;
                }
                Err(error) => {
                    for (_, member) in members {
                        let _ = member.answer.send(Outcome::Error(error.clone()));
                    }
                    return;
                }
            };
            let Some(mut call) = batch::merge(&requests, padded) else {
                self.rerun_alone(members);
                return;
            };
            call.memory = KeptShare::new(None, held);
            self.next_batch_id += 1;
            (self.next_batch_id, Arc::new(call))
        } else {
            (members[0].0, members[0].1.request.clone())
        };
        let deadline = call_deadline(&members).map(wire::deadline_micros);
        let header =
            wire::encode_request(id, &sent.signature, &sent.tensors, &sent.outputs, deadline);
        // Header and small tensor frames are copied once, into the bytes written to the
        // worker; large ones are written from their own buffers (zmtp::SHARED_FRAME).
        let mut frames: Vec<Bytes> = Vec::with_capacity(1 + sent.frames.len());
        frames.push(Bytes::from(header));
        frames.extend(sent.frames.iter().cloned());
        let sent_now = self.workers.send(&identity, &frames);
        // TF Serving's batching metrics, for a call that left: with batching on, every call is
        // a batch (of one request or more), its members' waits since they entered the queue.
        let batching = members
            .first()
            .and_then(|(_, first)| first.batching.as_ref());
        let batch_record = batching.map(|batching| {
            let now = std::time::Instant::now();
            let waits: Vec<u64> = (members.iter())
                .map(|(_, m)| now.saturating_duration_since(m.enqueued).as_micros())
                .map(|waited| u64::try_from(waited).unwrap_or(u64::MAX))
                .collect();
            (waits, batching.max_batch_size)
        });
        let pending = Pending {
            id,
            sent,
            members,
            merged,
            sent_us: wall_micros(),
        };
        match sent_now {
            Ok(()) => {
                if let Some((waits, max)) = batch_record {
                    self.state.batching.record_batch(waits, rows, padded, max);
                }
                if let Some(handle) = self.table.get_mut(&identity) {
                    handle.inflight.insert(id, pending);
                }
                self.requests.insert(id, identity);
            }
            Err(SendError::Unreachable) => {
                // The worker's connection is gone (killed); do not wait for the liveness
                // window to notice. The requests go back to wait for another.
                if let Some(departure) = self.table.leave(&identity, "its connection is gone") {
                    self.departed(departure);
                }
                for (member_id, member) in pending.members {
                    self.requeue(member_id, member);
                }
            }
            Err(SendError::Full) => {
                let message = format!("worker {slot} has too many requests queued");
                let error = ServingError::new(Code::ResourceExhausted, message);
                pending.tell_all(|| Outcome::Error(error.clone()));
            }
        }
    }

    fn departed(&mut self, departure: Departure<Pending>) {
        log_info!(
            "worker {} (pid {}) left: {}",
            departure.slot,
            departure.pid,
            departure.reason
        );
        let why = format!(
            "worker {} (pid {}) left: {}",
            departure.slot, departure.pid, departure.reason
        );
        for pending in departure.pending {
            self.requests.remove(&pending.id);
            let merged = pending.members.len() > 1;
            for (_, member) in pending.members {
                let _ = member.answer.send(Outcome::Lost {
                    why: why.clone(),
                    orderly: departure.orderly,
                    merged,
                    alone: member.alone,
                });
            }
        }
        // Requests no worker left here can take: their callers wait for one to come back
        // (or they go to the latest version, if theirs retired), at the next pump.
        self.publish_ready();
    }

    /// Back to the queue, as if it had just arrived.
    fn requeue(&mut self, id: u64, mut queued: Queued) {
        queued.enqueued = std::time::Instant::now();
        self.route_back(id, queued);
    }

    /// Into the queue of the version it routes to now if some worker can take it; NoWorker
    /// to its caller otherwise.
    fn route_back(&mut self, id: u64, mut queued: Queued) {
        let route = self.routable.borrow().route(queued.request.target);
        match route {
            Some(servable) => {
                if servable != queued.servable {
                    self.moved(&mut queued, servable);
                }
                self.queue_push(id, queued);
            }
            None => {
                let alone = queued.alone;
                let _ = queued.answer.send(Outcome::NoWorker { alone });
            }
        }
    }

    /// A request that left the queue without being sent, its caller gone (a deadline, a
    /// cancel): with batching, its wait is in TF Serving's queuing latency, as TF Serving
    /// records every task it takes from a batch queue, those it then fails included (the
    /// longest waits are what the queuing latency alert is for).
    fn left_unanswered(&self, queued: &Queued) {
        if queued.batching.is_some() {
            let waited = queued.enqueued.elapsed().as_micros();
            let waited = u64::try_from(waited).unwrap_or(u64::MAX);
            self.state.batching.record_expired(waited);
        }
    }

    /// Membership or versions changed: what is routable, the ready count and the
    /// copied-weights gauge follow.
    fn publish_ready(&mut self) {
        let models = self.versions.borrow().clone();
        let mut by_servable = self.table.ready_by_servable();
        if self.per_model_batching {
            // A version's batching comes with the controller's version table: until the
            // controller has listed a model's versions, its requests wait rather than run
            // unbatched (a front door that restarted hears from it within a tick).
            by_servable.retain(|s, _| models.get(s.model).is_some_and(|t| t.from_controller));
        }
        let serving: usize = by_servable
            .iter()
            .filter(|(s, _)| models.is_served(s.model))
            .filter(|(s, _)| models.get(s.model).is_some_and(|t| t.available(s.version)))
            .map(|(_, n)| n)
            .sum();
        self.serving
            .send_if_modified(|n| std::mem::replace(n, serving) != serving);
        let routable = Routable {
            by_servable,
            latest: models.latest(),
        };
        if (self.routable).send_if_modified(|r| std::mem::replace(r, routable.clone()) != routable)
        {
            self.reroute = true; // the waiting requests are sorted again at the next pump
        }
        let copied = self.table.copied_bytes();
        self.copied
            .send_if_modified(|c| std::mem::replace(c, copied.clone()) != copied);
        let ready = self.table.ready();
        self.ready
            .send_if_modified(|n| std::mem::replace(n, ready) != ready);
    }

    fn expire(&mut self, now: Instant) {
        let bytes_of = |p: &Pending| p.sent.frames.iter().map(|f| f.len() as u64).sum::<u64>();
        for departure in self.table.expire(now.into_std(), bytes_of) {
            log_warn!(
                "worker {} (pid {}) declared dead: silent > {:.1} s",
                departure.slot,
                departure.pid,
                self.table.timeout.as_secs_f64()
            );
            self.departed(departure);
        }
    }

    /// Everything already received, without waiting.
    fn drain_workers(&mut self) {
        while let Some(incoming) = self.workers.try_recv() {
            self.incoming(incoming);
        }
    }

    fn incoming(&mut self, incoming: zmtp::Incoming) {
        match incoming {
            zmtp::Incoming::Message(message) => self.receive(message),
            // The process is gone or closed its socket: what it had in flight is retried
            // now, not when its silence is noticed or the controller reports its exit.
            zmtp::Incoming::Left(identity) => {
                if let Some(departure) = self.table.leave(&identity, "its connection closed") {
                    self.departed(departure);
                }
            }
        }
    }

    fn receive(&mut self, message: zmtp::Message) {
        let now = Instant::now().into_std();
        let zmtp::Message {
            identity,
            mut frames,
            ..
        } = message;
        if frames.is_empty() {
            return;
        }
        let message = match wire::decode_worker_header(&frames[0]) {
            Ok(message) => message,
            Err(error) => {
                log_warn!(
                    "dropping a message from {}: {error}",
                    String::from_utf8_lossy(&identity)
                );
                self.fail_unreadable_answer(&identity, &frames[0], &error, now);
                return;
            }
        };
        match message {
            WorkerMessage::Reply { id, tensors, t } => {
                let Some(handle) = self.table.seen(&identity, now) else {
                    return;
                };
                let (slot, servable) = (handle.slot.clone(), handle.servable);
                self.requests.remove(&id);
                let Some(pending) = self.table.resolve(&identity, id) else {
                    if let Some((start, end)) = t {
                        self.timeline.record(&slot, start, end); // late: nobody waits
                    }
                    return;
                };
                if let Some((start, end)) = t {
                    // One span (hand-over and way back) per request answered, merged or not.
                    let handoff = u64::try_from(start - pending.sent_us).unwrap_or(0);
                    let back = u64::try_from(wall_micros() - end).unwrap_or(0);
                    for _ in &pending.members {
                        self.timeline.record(&slot, start, end);
                        self.state.handoff.observe(Duration::from_micros(handoff));
                        self.state.reply.observe(Duration::from_micros(back));
                    }
                    self.state
                        .graph_runs
                        .record(u64::try_from(end - start).unwrap_or(0));
                    let micros = end.saturating_sub(start) as f64;
                    let sent = &pending.sent;
                    let model = servable.model;
                    self.costs
                        .observe(model, &sent.signature, sent.rows(), micros);
                }
                frames.remove(0);
                let reply = WorkReply {
                    tensors,
                    frames,
                    slot,
                    version: servable.version,
                    span: t,
                };
                self.answer(pending, reply);
            }
            WorkerMessage::Error { id, code, message } => {
                if self.table.seen(&identity, now).is_none() {
                    return;
                }
                self.requests.remove(&id);
                if let Some(pending) = self.table.resolve(&identity, id) {
                    // Whose request failed a call of several is not known: each runs again
                    // by itself. A lone request's error is its own, padded or not (TF
                    // Serving answers a padded batch's error too).
                    if pending.members.len() > 1 {
                        self.rerun_alone(pending.members);
                    } else {
                        let error = ServingError::new(Code::of_error(code), message);
                        pending.tell_all(|| Outcome::Error(error.clone()));
                    }
                }
            }
            WorkerMessage::Heartbeat { weights, .. } => match self.table.seen(&identity, now) {
                // A worker we do not know (this front door restarted, or it was declared
                // dead and woke up): ask it to introduce itself again.
                None => {
                    let _ = self
                        .workers
                        .send(&identity, &[Bytes::from(wire::encode_reregister())]);
                }
                // Serving copied a variable out of the segment: status and the gauge follow.
                Some(handle) => {
                    if let Some(weights) = weights {
                        handle.weights = weights;
                        self.publish_ready();
                    }
                }
            },
            WorkerMessage::Ready {
                slot,
                pid,
                model,
                version,
                weights,
                warmup,
                load,
            } => {
                if self.table.declared_dead.get(&slot) == Some(&pid) {
                    return; // declared dead and about to be replaced: it does not come back
                }
                let Some(signature_defs) = frames.get(1) else {
                    log_warn!("READY from {slot} without its signatures: ignored");
                    return;
                };
                let Some(id) = self.versions.borrow().named(&model).map(|t| t.id) else {
                    log_warn!("READY from {slot} for model {model:?}, not served here: ignored");
                    return;
                };
                let servable = Servable { model: id, version };
                self.learn_signatures(servable, Bytes::copy_from_slice(signature_defs));
                let weights = weights.unwrap_or(rmpv::Value::Nil);
                // Once per worker process: READY comes again on each reconnection and
                // REREGISTER, from a warm-up that ran once.
                if self.table.get_mut(&identity).is_none() {
                    if let Some((path, micros, records)) = warmup {
                        self.state.warmup.record(servable, &path, micros, records);
                    }
                    if let Some((path, micros)) = load {
                        self.state.loads.record(servable, &path, micros);
                    }
                }
                let joined = self
                    .table
                    .register(&identity, &slot, pid, servable, weights, now);
                if let Some(departure) = joined {
                    self.departed(departure);
                }
                log_info!("worker {slot} (pid {pid}) ready");
                self.publish_ready();
            }
            WorkerMessage::Bye { .. } => {
                if let Some(departure) = self.table.bye(&identity) {
                    self.departed(departure);
                }
            }
        }
    }

    /// A REPLY or ERROR header that does not decode still names the request it answers, most
    /// likely: fail that request (INTERNAL) rather than leave its caller waiting for an answer
    /// that has come and gone.
    fn fail_unreadable_answer(
        &mut self,
        identity: &[u8],
        header: &[u8],
        error: &wire::ProtocolError,
        now: std::time::Instant,
    ) {
        let Ok(rmpv::Value::Map(fields)) = rmpv::decode::read_value(&mut &header[..]) else {
            return;
        };
        let get = |name: &str| {
            fields
                .iter()
                .find(|(k, _)| k.as_str() == Some(name))
                .map(|(_, v)| v)
        };
        let answers = matches!(
            get("k").and_then(rmpv::Value::as_str),
            Some("reply" | "error")
        );
        let Some(id) = get("id").and_then(rmpv::Value::as_u64).filter(|_| answers) else {
            return;
        };
        let Some(handle) = self.table.seen(identity, now) else {
            return;
        };
        let slot = handle.slot.clone();
        self.requests.remove(&id);
        if let Some(pending) = self.table.resolve(identity, id) {
            let message = format!("worker {slot} sent an answer that cannot be read: {error}");
            let error = ServingError::new(Code::Internal, message);
            pending.tell_all(|| Outcome::Error(error.clone()));
        }
    }

    /// A call's answer to whoever waits: whole to a request sent alone, cut into rows for
    /// merged ones (which run again one by one when it cannot be cut).
    fn answer(&mut self, pending: Pending, reply: WorkReply) {
        if !pending.merged {
            if let Some((_, member)) = pending.members.into_iter().next() {
                let _ = member.answer.send(Outcome::Reply(reply));
            }
            return;
        }
        let rows: Vec<u64> = pending
            .members
            .iter()
            .map(|(_, m)| m.request.rows())
            .collect();
        match batch::unmerge(&reply, &rows, pending.sent.rows()) {
            Some(parts) => {
                for ((_, member), part) in pending.members.into_iter().zip(parts) {
                    let _ = member.answer.send(Outcome::Reply(part));
                }
            }
            None => self.rerun_alone(pending.members),
        }
    }

    fn learn_signatures(&mut self, servable: Servable, signature_defs: Bytes) {
        let known = self
            .signatures
            .borrow()
            .get(&servable)
            .map(|s| s.signature_defs.clone());
        if known.as_ref() == Some(&signature_defs) {
            return;
        }
        match signature::parse(signature_defs) {
            Ok(parsed) => {
                self.signatures.send_modify(|all| {
                    all.insert(servable, Arc::new(parsed));
                });
            }
            Err(error) => {
                log_warn!("undecodable signatures from a worker of {servable:?}: {error}")
            }
        }
    }

    fn drain_control(&mut self) {
        loop {
            let socket = &self.control;
            match socket.get_events() {
                Ok(events) if events.contains(zmq::POLLIN) => {}
                _ => return,
            }
            let Ok(mut frames) = socket.recv_multipart(zmq::DONTWAIT) else {
                return;
            };
            let Some(body) = frames.pop() else { continue };
            let reply = control::answer(
                &body,
                &mut control::Pool {
                    table: &mut self.table,
                    timeline: &mut self.timeline,
                    versions: &self.versions,
                    state: &self.state,
                    queued_by_model: &self.queued_by_model,
                    now: Instant::now().into_std(),
                },
            );
            let departures = reply.departures;
            frames.push(reply.message);
            let _ = self.control.send_multipart(frames, zmq::DONTWAIT);
            for departure in departures {
                self.departed(departure);
            }
            self.forget_retired_signatures();
            self.publish_ready(); // the versions may have changed
        }
    }

    /// Signatures of versions the controller no longer lists and no worker serves (of a
    /// model the controller has spoken of: until then only the configured version is known).
    fn forget_retired_signatures(&mut self) {
        let models = self.versions.borrow().clone();
        // A removed model's signatures go with its last worker.
        let kept = |s: &Servable| {
            models.is_served(s.model)
                && models
                    .get(s.model)
                    .is_none_or(|t| !t.from_controller || t.versions.contains_key(&s.version))
        };
        let served = self.table.ready_by_servable();
        self.signatures.send_if_modified(|all| {
            let before = all.len();
            all.retain(|s, _| kept(s) || served.contains_key(s));
            all.len() != before
        });
    }
}

#[cfg(test)]
mod tests;

mod queues;
/// How many chunks of one split request are at the workers at once: enough to keep every
/// ready worker busy with two (one computing, one waiting), far under a worker's send queue.
fn chunks_in_flight(ready_workers: usize) -> usize {
    ready_workers
        .saturating_mul(2)
        .clamp(2, MOST_CHUNKS_IN_FLIGHT)
}

/// Under a worker's send queue (zmtp::SEND_HIGH_WATER, 1,000 messages) with room to spare for
/// other requests, were every chunk sent to one worker.
const MOST_CHUNKS_IN_FLIGHT: usize = 256;

/// A send whose outcome a call waits for (`id`), withdrawn from the queue when the call is
/// dropped before it comes (`Command::Withdraw`).
struct Withdrawn<'a> {
    commands: &'a mpsc::UnboundedSender<Command>,
    id: Option<u64>,
}

impl Drop for Withdrawn<'_> {
    fn drop(&mut self) {
        if let Some(id) = self.id {
            let _ = self.commands.send(Command::Withdraw { id });
        }
    }
}

/// Holds `bytes`, a merged call of `rows` rows padded to `padded`, from the request budget
/// without waiting (None under what a request may hold uncounted); RESOURCE_EXHAUSTED when
/// the budget has not the room, saying so without "try again" when it never could beside
/// what its members hold already (`already`).
fn hold_merged(
    bytes: u64,
    already: usize,
    padded: u64,
    rows: u64,
) -> Result<Option<crate::request_budget::Held>, ServingError> {
    let budget = crate::decode_budget::budget();
    let bytes = usize::try_from(bytes).unwrap_or(usize::MAX);
    if bytes < crate::decode_budget::UNCOUNTED_BYTES {
        return Ok(None);
    }
    let padding = if padded > rows {
        format!(" ({rows} rows padded to {padded}, an allowed batch size)")
    } else {
        String::new()
    };
    if bytes.saturating_add(already) > budget.bytes() {
        return Err(ServingError::new(
            Code::ResourceExhausted,
            format!(
                "the batch this request is in{padding} would take {} MiB beside the {} MiB its \
                 requests hold: more than the {} MiB the front door allows for requests at \
                 once (4 times --max-message-bytes, at least 256); send fewer rows per request",
                bytes.div_ceil(1 << 20),
                already >> 20,
                budget.bytes() >> 20
            ),
        ));
    }
    budget.try_reserve(bytes).map(Some).ok_or_else(|| {
        ServingError::new(
            Code::ResourceExhausted,
            format!(
                "requests being read or served hold {} MiB of the front door's memory, and \
                 the batch this request is in{padding} would take {} MiB more, passing the {} \
                 MiB allowed for all of them at once (4 times --max-message-bytes, at least \
                 256); try again later",
                budget.held_bytes() >> 20,
                bytes.div_ceil(1 << 20),
                budget.bytes() >> 20
            ),
        )
    })
}

use queues::ServableQueues;
