//! Sending requests to workers over ZeroMQ and matching their replies.
//!
//! One actor task owns both ZeroMQ sockets (a socket is not thread-safe: "one socket, one
//! owner"): the ROUTER the workers connect to and the ROUTER of the controller's control
//! channel. Request handlers talk to it through a channel; it reads the sockets through
//! their ZMQ_FD with `AsyncFd`. That FD is edge-triggered, and a send can swallow a pending
//! edge, so after it fires and after every batch of sends, everything queued is read.
//!
//! In-flight work when a worker dies: the request goes to another worker (inference is
//! idempotent) while the client's deadline allows; the caller (`call`) owns that loop.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tokio::io::unix::AsyncFd;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::time::Instant;

use crate::control;
use crate::policies::{self, CostModel, Order, Scheduling};
use crate::signature::{self, ModelSignatures};
use crate::split;
use crate::state::RouterState;
use crate::status::{Code, ServingError};
use crate::timeline::{Timeline, DEFAULT_CAPACITY};
use crate::wire::{self, TensorMeta, WorkerMessage};
use crate::workers::{Departure, WorkerTable};
use crate::{log_info, log_warn};

/// How long a request waits for some worker to become routable when none is (a restart in
/// progress) before it fails with UNAVAILABLE, if the client's deadline is longer.
pub const NO_WORKER_WAIT: Duration = Duration::from_secs(5);
const LIVENESS_SWEEP: Duration = Duration::from_millis(100);

pub struct WorkRequest {
    pub signature: String,
    pub tensors: Vec<TensorMeta>,
    pub frames: Vec<Bytes>,
    pub outputs: Vec<String>,
}

impl WorkRequest {
    /// Its rows: the first dimension of its first input (1 for a scalar or no input).
    pub fn rows(&self) -> u64 {
        self.tensors
            .first()
            .and_then(|(_, _, shape)| shape.first())
            .map_or(1, |&rows| rows.max(0) as u64)
    }
}

#[derive(Debug)]
pub struct WorkReply {
    pub tensors: Vec<TensorMeta>,
    /// The output tensors' bytes, each still in the ZeroMQ message it arrived in.
    pub frames: Vec<Bytes>,
    /// The worker that answered (the gRPC side has no use for it yet; tests check where a
    /// retried request went).
    #[cfg_attr(not(test), allow(dead_code))]
    pub slot: String,
    /// When the worker's model call started and ended (wall-clock µs), if it said.
    pub span: Option<(i64, i64)>,
}

/// What becomes of one sending of a request.
#[derive(Debug)]
enum Outcome {
    Reply(WorkReply),
    Error(ServingError),
    /// Its worker left before answering: send it again elsewhere.
    Lost(String),
    /// No worker is routable right now.
    NoWorker,
}

enum Command {
    Send {
        id: u64,
        request: Arc<WorkRequest>,
        answer: oneshot::Sender<Outcome>,
        /// When the client's request arrived (a retry keeps it).
        arrived: std::time::Instant,
    },
    /// The caller stopped waiting (deadline): forget the entry.
    Cancel {
        id: u64,
    },
    Shutdown,
}

#[derive(Debug, thiserror::Error)]
pub enum DispatchError {
    #[error("cannot bind the worker socket {endpoint}: {source}")]
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
    signatures: watch::Receiver<Option<Arc<ModelSignatures>>>,
    ready: watch::Receiver<usize>,
    copied: watch::Receiver<std::collections::BTreeMap<String, u64>>,
    state: Arc<RouterState>,
    /// NO_WORKER_WAIT, shorter in tests.
    no_worker_wait: Duration,
    /// `--split-rows` (0: off).
    split_rows: u64,
}

/// The served model, as the configuration names it: READY from anything else is not learned.
pub struct ServedModel {
    pub name: String,
    pub version: i64,
}

impl Dispatcher {
    /// Bind the sockets in `run_dir` and start the actor on the current runtime.
    pub fn start(
        run_dir: &str,
        model: ServedModel,
        worker_timeout: Duration,
        scheduling: &Scheduling,
        state: Arc<RouterState>,
    ) -> Result<Dispatcher, DispatchError> {
        scheduling.check().map_err(DispatchError::Scheduling)?;
        let (Some(chooser), Some(queue)) = (
            policies::chooser(&scheduling.dispatch),
            policies::order(&scheduling.queue, scheduling.aging_bound),
        ) else {
            return Err(DispatchError::Scheduling(format!("{scheduling:?}")));
        };
        let context = zmq::Context::new();
        let workers = context.socket(zmq::ROUTER)?;
        workers.set_router_mandatory(true)?;
        workers.set_linger(0)?;
        let endpoint = wire::endpoint(run_dir, wire::WORKERS_ENDPOINT);
        workers
            .bind(&endpoint)
            .map_err(|source| DispatchError::Bind {
                endpoint: endpoint.clone(),
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
        let (signatures_tx, signatures) = watch::channel(None);
        let (ready_tx, ready) = watch::channel(0);
        let (copied_tx, copied) = watch::channel(Default::default());
        let actor = Actor {
            workers_fd: signal_fd(&workers)?,
            control_fd: signal_fd(&control)?,
            workers,
            control,
            table: WorkerTable::new(worker_timeout, chooser),
            requests: HashMap::new(),
            queue,
            worker_inflight: scheduling.worker_inflight,
            costs: CostModel::default(),
            timeline: Timeline::new(DEFAULT_CAPACITY),
            model,
            signatures: signatures_tx,
            ready: ready_tx,
            copied: copied_tx,
            state: state.clone(),
            _context: context,
        };
        tokio::spawn(actor.run(commands_rx));
        Ok(Dispatcher {
            commands,
            ids: Arc::new(AtomicU64::new(1)),
            signatures,
            ready,
            copied,
            state,
            no_worker_wait: NO_WORKER_WAIT,
            split_rows: scheduling.split_rows,
        })
    }

    pub fn signatures(&self) -> watch::Receiver<Option<Arc<ModelSignatures>>> {
        self.signatures.clone()
    }

    pub fn ready_workers(&self) -> watch::Receiver<usize> {
        self.ready.clone()
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
        let Some(chunks) = split::split(&request, self.split_rows) else {
            return self.call_whole(request, deadline).await;
        };
        drop(request);
        let count = chunks.len();
        let mut running = tokio::task::JoinSet::new();
        for (index, (chunk, rows)) in chunks.into_iter().enumerate() {
            let dispatcher = self.clone();
            running
                .spawn(async move { (index, rows, dispatcher.call_whole(chunk, deadline).await) });
        }
        let mut answers: Vec<Option<(WorkReply, u64)>> = (0..count).map(|_| None).collect();
        while let Some(done) = running.join_next().await {
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
            };
            if self.commands.send(command).is_err() {
                return Err(ServingError::new(
                    Code::Unavailable,
                    "the front door is shutting down",
                ));
            }
            let outcome = match deadline {
                None => outcome.await,
                Some(deadline) => match tokio::time::timeout_at(deadline, outcome).await {
                    Ok(outcome) => outcome,
                    Err(_) => {
                        let _ = self.commands.send(Command::Cancel { id });
                        return Err(deadline_exceeded());
                    }
                },
            };
            match outcome {
                Ok(Outcome::Reply(reply)) => return Ok(reply),
                Ok(Outcome::Error(error)) => return Err(error),
                Ok(Outcome::Lost(why)) => {
                    log_info!("retrying request {id} elsewhere: {why}");
                    self.state.retries.fetch_add(1, Ordering::Relaxed);
                }
                Ok(Outcome::NoWorker) => self.wait_for_worker(deadline).await?,
                Err(_) => {
                    return Err(ServingError::new(
                        Code::Unavailable,
                        "the front door is shutting down",
                    ))
                }
            }
        }
    }

    async fn wait_for_worker(&self, deadline: Option<Instant>) -> Result<(), ServingError> {
        let mut limit = Instant::now() + self.no_worker_wait;
        let by_deadline = deadline.is_some_and(|d| d <= limit);
        if let Some(deadline) = deadline {
            limit = limit.min(deadline);
        }
        let mut ready = self.ready.clone();
        let waited = tokio::time::timeout_at(limit, ready.wait_for(|n| *n > 0)).await;
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
}

/// Whether a liveness sweep woke more than a sweep after it was due (`interval.tick()` yields
/// the instant it was due, however late the task got to run).
fn sweep_was_late(scheduled: Instant, woke: Instant) -> bool {
    woke.saturating_duration_since(scheduled) > LIVENESS_SWEEP
}

/// A request sent to a worker and not answered yet.
struct Pending {
    id: u64,
    answer: oneshot::Sender<Outcome>,
    /// Its signature and rows teach the cost model when the answer comes.
    request: Arc<WorkRequest>,
}

/// A request waiting in the front door for a worker with room.
struct Queued {
    request: Arc<WorkRequest>,
    answer: oneshot::Sender<Outcome>,
    arrived: std::time::Instant,
}

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

/// A received message's frame, kept in the ZeroMQ message it arrived in (no copy).
struct Frame(zmq::Message);

impl AsRef<[u8]> for Frame {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

struct Actor {
    // The FD watchers first: fields drop in order, and they must be gone before the sockets
    // close the FDs they watch.
    workers_fd: AsyncFd<SignalFd>,
    control_fd: AsyncFd<SignalFd>,
    workers: zmq::Socket,
    control: zmq::Socket,
    table: WorkerTable<Pending>,
    /// Request id → the worker it was sent to (for Cancel).
    requests: HashMap<u64, Vec<u8>>,
    /// Requests waiting for a worker with room (only with a `worker_inflight` limit).
    queue: Box<dyn Order<Queued>>,
    worker_inflight: usize,
    costs: CostModel,
    timeline: Timeline,
    model: ServedModel,
    signatures: watch::Sender<Option<Arc<ModelSignatures>>>,
    ready: watch::Sender<usize>,
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
                guard = self.workers_fd.readable() => {
                    if let Ok(mut guard) = guard {
                        guard.clear_ready();
                    }
                    self.drain_workers();
                }
                guard = self.control_fd.readable() => {
                    if let Ok(mut guard) = guard {
                        guard.clear_ready();
                    }
                    self.drain_control();
                }
                scheduled = sweep.tick() => {
                    // Silence is only evidence if this front door was listening: after a late
                    // wake-up (the machine starved of CPU) heartbeats may be queued unread, some
                    // still in ZeroMQ's I/O thread. Read what is there, judge next round.
                    let woke = Instant::now();
                    self.drain_workers();
                    if !sweep_was_late(scheduled, woke) {
                        self.expire(woke);
                    }
                }
            }
            // Answers and arrivals free and add room: send what waits.
            self.pump();
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
            } => self.enqueue(
                id,
                Queued {
                    request,
                    answer,
                    arrived,
                },
            ),
            Command::Cancel { id } => {
                if self.queue.remove(id).is_some() {
                    self.publish_queue();
                } else if let Some(identity) = self.requests.remove(&id) {
                    if let Some(handle) = self.table.get_mut(&identity) {
                        handle.inflight.remove(&id);
                    }
                }
            }
            Command::Shutdown => return false,
        }
        true
    }

    fn enqueue(&mut self, id: u64, queued: Queued) {
        if self.table.ready() == 0 {
            let _ = queued.answer.send(Outcome::NoWorker);
            return;
        }
        let cost = self
            .costs
            .estimate(&queued.request.signature, queued.request.rows());
        let arrived = queued.arrived;
        self.queue.push(id, queued, arrived, cost);
        self.pump();
    }

    /// Send waiting requests, in the queue's order, while some worker has room.
    fn pump(&mut self) {
        while !self.queue.is_empty() {
            let Some(handle) = self.table.pick(self.worker_inflight) else {
                break; // all full (or none left: `departed` answers the queue then)
            };
            let identity = handle.identity.clone();
            let now = Instant::now();
            let Some((id, queued)) = self.queue.pop(now.into_std()) else {
                break;
            };
            let waited = now.into_std().saturating_duration_since(queued.arrived);
            self.state.note_queue_wait(waited);
            self.transmit(id, identity, queued);
        }
        self.publish_queue();
    }

    fn publish_queue(&self) {
        self.state
            .queued
            .store(self.queue.len() as u64, Ordering::Relaxed);
    }

    fn transmit(&mut self, id: u64, identity: Vec<u8>, queued: Queued) {
        let Some(handle) = self.table.get_mut(&identity) else {
            return;
        };
        let slot = handle.slot.clone();
        let request = &queued.request;
        let header =
            wire::encode_request(id, &request.signature, &request.tensors, &request.outputs);
        // Tensor frames are copied into ZeroMQ messages here (a memcpy; the request's
        // protobuf buffer cannot be handed to libzmq without an unsafe lifetime bridge).
        let mut frames: Vec<zmq::Message> = Vec::with_capacity(2 + request.frames.len());
        frames.push(zmq::Message::from(identity.as_slice()));
        frames.push(zmq::Message::from(header));
        frames.extend(request.frames.iter().map(|f| zmq::Message::from(&f[..])));
        match self.workers.send_multipart(frames, zmq::DONTWAIT) {
            Ok(()) => {
                if let Some(handle) = self.table.get_mut(&identity) {
                    let pending = Pending {
                        id,
                        answer: queued.answer,
                        request: queued.request,
                    };
                    handle.inflight.insert(id, pending);
                }
                self.requests.insert(id, identity);
            }
            Err(zmq::Error::EHOSTUNREACH) => {
                // ROUTER_MANDATORY: the worker's connection is gone (killed); do not wait for
                // the liveness window to notice. The request goes back to wait for another.
                if let Some(departure) = self.table.leave(&identity, "its connection is gone") {
                    self.departed(departure);
                }
                let arrived = queued.arrived;
                let cost = self
                    .costs
                    .estimate(&queued.request.signature, queued.request.rows());
                if self.table.ready() == 0 {
                    let _ = queued.answer.send(Outcome::NoWorker);
                } else {
                    self.queue.push(id, queued, arrived, cost);
                }
            }
            Err(zmq::Error::EAGAIN) => {
                let message = format!("worker {slot} has too many requests queued");
                let _ = queued.answer.send(Outcome::Error(ServingError::new(
                    Code::ResourceExhausted,
                    message,
                )));
            }
            Err(error) => {
                let message = format!("sending to worker {slot} failed: {error}");
                let _ = queued
                    .answer
                    .send(Outcome::Error(ServingError::new(Code::Internal, message)));
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
            let _ = pending.answer.send(Outcome::Lost(why.clone()));
        }
        if self.table.ready() == 0 {
            // Nobody left to wait for here: the callers wait for a worker to come back.
            while let Some((_, queued)) = self.queue.pop(std::time::Instant::now()) {
                let _ = queued.answer.send(Outcome::NoWorker);
            }
            self.publish_queue();
        }
        self.publish_ready();
    }

    /// Membership changed: the ready count and the copied-weights gauge follow.
    fn publish_ready(&self) {
        let copied = self.table.copied_bytes();
        self.copied
            .send_if_modified(|c| std::mem::replace(c, copied.clone()) != copied);
        let ready = self.table.ready();
        self.ready
            .send_if_modified(|n| std::mem::replace(n, ready) != ready);
    }

    fn expire(&mut self, now: Instant) {
        for departure in self.table.expire(now.into_std()) {
            log_warn!(
                "worker {} (pid {}) declared dead: silent > {:.1} s",
                departure.slot,
                departure.pid,
                self.table.timeout.as_secs_f64()
            );
            self.departed(departure);
        }
    }

    fn drain_workers(&mut self) {
        loop {
            let socket = &self.workers;
            match socket.get_events() {
                Ok(events) if events.contains(zmq::POLLIN) => {}
                _ => return,
            }
            let mut frames = Vec::with_capacity(4);
            while let Ok(message) = socket.recv_msg(zmq::DONTWAIT) {
                let more = message.get_more();
                frames.push(message);
                if !more {
                    break;
                }
            }
            if frames.len() >= 2 {
                self.receive(frames);
            }
        }
    }

    fn receive(&mut self, mut frames: Vec<zmq::Message>) {
        let now = Instant::now().into_std();
        let identity = frames[0].to_vec();
        let message = match wire::decode_worker_header(&frames[1]) {
            Ok(message) => message,
            Err(error) => {
                log_warn!(
                    "dropping a message from {}: {error}",
                    String::from_utf8_lossy(&identity)
                );
                self.fail_unreadable_answer(&identity, &frames[1], &error, now);
                return;
            }
        };
        match message {
            WorkerMessage::Reply { id, tensors, t } => {
                let Some(handle) = self.table.seen(&identity, now) else {
                    return;
                };
                let slot = handle.slot.clone();
                if let Some((start, end)) = t {
                    self.timeline.record(&slot, start, end);
                }
                self.requests.remove(&id);
                if let Some(pending) = self.table.resolve(&identity, id) {
                    if let Some((start, end)) = t {
                        let request = &pending.request;
                        let micros = end.saturating_sub(start) as f64;
                        self.costs
                            .observe(&request.signature, request.rows(), micros);
                    }
                    let frames: Vec<Bytes> = frames
                        .drain(2..)
                        .map(|m| Bytes::from_owner(Frame(m)))
                        .collect();
                    let _ = pending.answer.send(Outcome::Reply(WorkReply {
                        tensors,
                        frames,
                        slot,
                        span: t,
                    }));
                }
            }
            WorkerMessage::Error { id, code, message } => {
                if self.table.seen(&identity, now).is_none() {
                    return;
                }
                self.requests.remove(&id);
                if let Some(pending) = self.table.resolve(&identity, id) {
                    let error = ServingError::new(Code::from_i32(code), message);
                    let _ = pending.answer.send(Outcome::Error(error));
                }
            }
            WorkerMessage::Heartbeat { .. } => {
                if self.table.seen(&identity, now).is_none() {
                    // A worker we do not know (this front door restarted, or it was declared
                    // dead and woke up): ask it to introduce itself again.
                    let reply = [
                        zmq::Message::from(identity.as_slice()),
                        zmq::Message::from(wire::encode_reregister()),
                    ];
                    let _ = self.workers.send_multipart(reply, zmq::DONTWAIT);
                }
            }
            WorkerMessage::Ready {
                slot,
                pid,
                model,
                version,
                weights,
            } => {
                if self.table.declared_dead.get(&slot) == Some(&pid) {
                    return; // declared dead and about to be replaced: it does not come back
                }
                let Some(signature_defs) = frames.get(2) else {
                    log_warn!("READY from {slot} without its signatures: ignored");
                    return;
                };
                self.learn_signatures(&model, version, Bytes::copy_from_slice(signature_defs));
                let weights = weights.unwrap_or(rmpv::Value::Nil);
                if let Some(departure) = self.table.register(&identity, &slot, pid, weights, now) {
                    self.departed(departure);
                }
                log_info!("worker {slot} (pid {pid}) ready");
                self.publish_ready();
            }
            WorkerMessage::Bye { .. } => {
                if let Some(departure) = self.table.leave(&identity, "said bye") {
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
            let _ = pending
                .answer
                .send(Outcome::Error(ServingError::new(Code::Internal, message)));
        }
    }

    fn learn_signatures(&mut self, model: &str, version: i64, signature_defs: Bytes) {
        if model != self.model.name || version != self.model.version {
            return;
        }
        let known = self
            .signatures
            .borrow()
            .as_ref()
            .map(|s| s.signature_defs.clone());
        if known.as_ref() == Some(&signature_defs) {
            return;
        }
        match signature::parse(signature_defs) {
            Ok(parsed) => {
                self.signatures.send_replace(Some(Arc::new(parsed)));
            }
            Err(error) => log_warn!("undecodable signatures from a worker of {model}: {error}"),
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
                    state: &self.state,
                    now: Instant::now().into_std(),
                },
            );
            let departures = reply.departures;
            frames.push(reply.message);
            let _ = self.control.send_multipart(frames, zmq::DONTWAIT);
            for departure in departures {
                self.departed(departure);
            }
        }
    }
}

#[cfg(test)]
mod tests;
