//! Prometheus metrics at http://host:metrics_port/metrics: what an operator (or a
//! HorizontalPodAutoscaler on `mpspool_inflight_requests`) watches. The exposition is written
//! by hand (a few families, no registry needed); recording a request costs a few relaxed
//! atomic adds and takes no lock.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::connection_limit::ConnectionLimit;
use crate::request_budget::RequestBudget;
use crate::state::{RouterState, SLOT_STATES};
use crate::status::Code;
use crate::tfs_metrics::TfServingMetrics;
pub use crate::tfs_metrics::{Api as TfApi, Entrypoint};
use crate::versions::{ModelId, Models};
use crate::{log_error, log_info};

/// Small-batch inference lives between a fraction of a millisecond and a few hundred; a
/// hand-over to a worker or a wait in an empty queue, in the tens to hundreds of µs.
pub const BUCKETS: [f64; 15] = [
    0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0,
];

pub const METHODS: [&str; 6] = [
    "Predict",
    "GetModelMetadata",
    "GetModelStatus",
    "Classify",
    "Regress",
    "MultiInference",
];

/// Every gRPC code, in the order their names sort (the order the counter's samples are
/// written in, as prometheus_client writes labels).
const CODES_BY_NAME: [Code; 17] = [
    Code::Aborted,
    Code::AlreadyExists,
    Code::Cancelled,
    Code::DataLoss,
    Code::DeadlineExceeded,
    Code::FailedPrecondition,
    Code::Internal,
    Code::InvalidArgument,
    Code::NotFound,
    Code::Ok,
    Code::OutOfRange,
    Code::PermissionDenied,
    Code::ResourceExhausted,
    Code::Unauthenticated,
    Code::Unavailable,
    Code::Unimplemented,
    Code::Unknown,
];

#[derive(Clone, Copy)]
pub enum Method {
    Predict = 0,
    GetModelMetadata = 1,
    GetModelStatus = 2,
    Classify = 3,
    Regress = 4,
    MultiInference = 5,
}

/// Prometheus histogram over `BUCKETS`, recorded with relaxed atomics from any thread. Its
/// count is the sum of its buckets, read once: a count kept apart could be read before a
/// bucket another thread had just added to, and the page then had `+Inf` below a bucket.
#[derive(Default)]
pub struct Histogram {
    buckets: [AtomicU64; BUCKETS.len()],
    /// Observations past the last bound (only `+Inf` holds them).
    beyond: AtomicU64,
    sum_ns: AtomicU64,
}

impl Histogram {
    pub fn observe(&self, took: Duration) {
        let secs = took.as_secs_f64();
        // One add in the first bucket that holds it; render() sums them into Prometheus's
        // cumulative buckets.
        match BUCKETS.iter().position(|le| secs <= *le) {
            Some(first) => self.buckets[first].fetch_add(1, Ordering::Relaxed),
            None => self.beyond.fetch_add(1, Ordering::Relaxed),
        };
        self.sum_ns
            .fetch_add(took.as_nanos() as u64, Ordering::Relaxed);
    }

    pub fn count(&self) -> u64 {
        let buckets = self.buckets.iter().map(|b| b.load(Ordering::Relaxed));
        buckets.sum::<u64>() + self.beyond.load(Ordering::Relaxed)
    }

    pub fn sum(&self) -> Duration {
        Duration::from_nanos(self.sum_ns.load(Ordering::Relaxed))
    }

    /// The `_bucket`, `_count` and `_sum` lines for `labels` (written before `le`).
    pub fn render(&self, out: &mut String, name: &str, labels: &str) {
        let mut cumulative = 0;
        for (bucket, le) in self.buckets.iter().zip(BUCKETS) {
            cumulative += bucket.load(Ordering::Relaxed);
            out.push_str(&format!(
                "{name}_bucket{{le=\"{le:?}\",{labels}}} {cumulative}\n"
            ));
        }
        let count = cumulative + self.beyond.load(Ordering::Relaxed);
        out.push_str(&format!("{name}_bucket{{le=\"+Inf\",{labels}}} {count}\n"));
        out.push_str(&format!("{name}_count{{{labels}}} {count}\n"));
        let sum = self.sum().as_nanos() as f64 / 1e9;
        out.push_str(&format!("{name}_sum{{{labels}}} {sum:?}\n"));
    }
}

pub struct Metrics {
    /// The `model` label of mpspool's own series: the pool's model (its models,
    /// comma-separated, for a pool of several; TF Serving's series are per model), as served
    /// when the page is made.
    models: watch::Receiver<Arc<Models>>,
    /// The same requests under TF Serving's names (served at its Prometheus path).
    pub tf_serving: TfServingMetrics,
    /// The worker's model call of each request (where the rest of its time went, the
    /// dispatcher records in `state`: the front door's queue, the hand-over to the worker).
    compute: Histogram,
    /// Answers by method and code (indexed by the code's number, 0..=16).
    requests: [[AtomicU64; 17]; METHODS.len()],
    latency: [Histogram; METHODS.len()],
    inflight: AtomicI64,
    ready: watch::Receiver<usize>,
    copied: watch::Receiver<BTreeMap<String, u64>>,
    state: Arc<RouterState>,
    /// What requests hold of the front door's memory budget, and the budget.
    request_memory: Arc<RequestBudget>,
    /// Client connections open, their limit, and those refused for it.
    connections: Arc<ConnectionLimit>,
}

/// Counts a request as in flight until dropped; `finish` records its code and latency.
pub struct InFlight<'a> {
    metrics: &'a Metrics,
    method: Method,
    started: std::time::Instant,
    code: Code,
    /// Counted in TF Serving's metrics too, under the served model it names.
    tf_serving: Option<(ModelId, TfApi, Entrypoint)>,
    /// The client's deadline, if it gave one.
    deadline: Option<tokio::time::Instant>,
}

/// A handler dropped this close to its client's deadline (at most a tenth of its timeout),
/// or after it, was dropped for the deadline: the client resets the stream when its
/// deadline passes, and that reset can come a little before the front door's own deadline
/// (taken from `grpc-timeout` on arrival). A client that cancels earlier, however short its
/// timeout, cancelled.
const DEADLINE_RESET_SLACK: Duration = Duration::from_millis(50);

impl InFlight<'_> {
    pub fn set_code(&mut self, code: Code) {
        self.code = code;
    }

    /// The client's deadline: dropped at it, the request counts as DEADLINE_EXCEEDED (as TF
    /// Serving's, whose call ends at the deadline), not CANCELLED.
    pub fn expires(&mut self, deadline: Option<tokio::time::Instant>) {
        self.deadline = deadline;
    }

    /// Count this request in TF Serving's metrics as `model`'s `api` through `entrypoint`.
    pub fn tf_serving(&mut self, model: ModelId, api: TfApi, entrypoint: Entrypoint) {
        self.tf_serving = Some((model, api, entrypoint));
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        let took = self.started.elapsed();
        let now = tokio::time::Instant::now();
        let expired = (self.deadline).is_some_and(|deadline| {
            let timeout = deadline.into_std().saturating_duration_since(self.started);
            now + DEADLINE_RESET_SLACK.min(timeout / 10) >= deadline
        });
        if self.code == Code::Cancelled && expired {
            self.code = Code::DeadlineExceeded;
        }
        self.metrics.record(self.method, self.code, took);
        if let Some((model, api, entrypoint)) = self.tf_serving {
            let micros = u64::try_from(took.as_micros()).unwrap_or(u64::MAX);
            self.metrics
                .tf_serving
                .record_request(model, api, entrypoint, self.code, micros);
        }
        self.metrics.inflight.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Metrics {
    pub fn new(
        models: watch::Receiver<Arc<Models>>,
        ready: watch::Receiver<usize>,
        copied: watch::Receiver<BTreeMap<String, u64>>,
        state: Arc<RouterState>,
        request_memory: Arc<RequestBudget>,
        connections: Arc<ConnectionLimit>,
    ) -> Metrics {
        Metrics {
            tf_serving: TfServingMetrics::following(models.clone()),
            models,
            compute: Histogram::default(),
            requests: Default::default(),
            latency: Default::default(),
            inflight: AtomicI64::new(0),
            ready,
            copied,
            state,
            request_memory,
            connections,
        }
    }

    /// One request of `method`: counted in flight now, finished when the guard drops (with
    /// code CANCELLED unless the handler set one: a handler dropped because its client went
    /// away counts too).
    pub fn start(&self, method: Method) -> InFlight<'_> {
        self.inflight.fetch_add(1, Ordering::Relaxed);
        InFlight {
            metrics: self,
            method,
            started: std::time::Instant::now(),
            code: Code::Cancelled,
            tf_serving: None,
            deadline: None,
        }
    }

    fn record(&self, method: Method, code: Code, took: Duration) {
        self.latency[method as usize].observe(took);
        self.requests[method as usize][code as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// A worker's model call of one request, `compute_us` long; in TF Serving's
    /// runtime_latency as `api`'s (None: a call TF Serving does not time there, a
    /// MultiInference task's).
    pub fn record_compute(&self, model: ModelId, api: Option<TfApi>, compute_us: u64) {
        self.compute.observe(Duration::from_micros(compute_us));
        if let Some(api) = api {
            self.tf_serving.record_runtime(model, api, compute_us);
        }
    }

    /// The page TF Serving serves at its Prometheus path: its request metrics, then its
    /// batching session's and its model warm-up's.
    pub fn render_tf_serving(&self) -> String {
        let mut page = self.tf_serving.render();
        self.state.batching.render(&mut page);
        self.state.warmup.render(&mut page);
        self.state.loads.render(&mut page);
        self.state.graph_runs.render(&mut page);
        page
    }

    /// The Prometheus text exposition (labels in name order, as prometheus_client writes them).
    pub fn render(&self) -> String {
        let names: Vec<String> = self
            .models
            .borrow()
            .iter()
            .map(|t| t.model.clone())
            .collect();
        let model = escape(&names.join(","));
        let mut out = String::new();
        out.push_str(
            "# HELP mpspool_requests_total Requests answered, by method and gRPC status code.\n",
        );
        out.push_str("# TYPE mpspool_requests_total counter\n");
        for (method, counts) in METHODS.iter().zip(&self.requests) {
            for code in CODES_BY_NAME {
                let n = counts[code as usize].load(Ordering::Relaxed);
                if n > 0 {
                    out.push_str(&format!(
                        "mpspool_requests_total{{code=\"{}\",method=\"{method}\",model=\"{model}\"}} {n}\n",
                        code.name()
                    ));
                }
            }
        }
        out.push_str("# HELP mpspool_request_duration_seconds Time from receiving a request to answering it.\n");
        out.push_str("# TYPE mpspool_request_duration_seconds histogram\n");
        for (method, histogram) in METHODS.iter().zip(&self.latency) {
            if histogram.count() > 0 {
                let labels = format!("method=\"{method}\",model=\"{model}\"");
                histogram.render(&mut out, "mpspool_request_duration_seconds", &labels);
            }
        }
        out.push_str("# HELP mpspool_request_front_door_queue_seconds How long a request waited in the front door's queue for a worker with room (--queue fcfs or sjf, --worker-inflight, batching).\n");
        out.push_str("# TYPE mpspool_request_front_door_queue_seconds histogram\n");
        let labels = format!("model=\"{model}\"");
        self.state.front_door_wait.render(
            &mut out,
            "mpspool_request_front_door_queue_seconds",
            &labels,
        );
        out.push_str("# HELP mpspool_request_queue_seconds From the front door sending a request to a worker until its model call started (the socket, the worker's wake-up and its queue).\n");
        out.push_str("# TYPE mpspool_request_queue_seconds histogram\n");
        self.state
            .handoff
            .render(&mut out, "mpspool_request_queue_seconds", &labels);
        out.push_str("# HELP mpspool_request_reply_seconds From the end of a request's model call until the front door read its answer.\n");
        out.push_str("# TYPE mpspool_request_reply_seconds histogram\n");
        self.state
            .reply
            .render(&mut out, "mpspool_request_reply_seconds", &labels);
        out.push_str(
            "# HELP mpspool_request_compute_seconds The worker's model call of a request.\n",
        );
        out.push_str("# TYPE mpspool_request_compute_seconds histogram\n");
        self.compute
            .render(&mut out, "mpspool_request_compute_seconds", &labels);
        out.push_str("# HELP mpspool_inflight_requests Requests this front door is handling now (a per-pod load signal).\n");
        out.push_str("# TYPE mpspool_inflight_requests gauge\n");
        out.push_str(&format!(
            "mpspool_inflight_requests{{model=\"{model}\"}} {}\n",
            self.inflight.load(Ordering::Relaxed)
        ));
        out.push_str("# HELP mpspool_request_memory_bytes Memory the front door's requests hold now by its estimate (JSON documents being parsed, requests decoded or built until answered), in whole KiB.\n");
        out.push_str("# TYPE mpspool_request_memory_bytes gauge\n");
        out.push_str(&format!(
            "mpspool_request_memory_bytes {}\n",
            self.request_memory.held_bytes()
        ));
        out.push_str("# HELP mpspool_request_memory_limit_bytes The most they may hold at once (4 times --max-message-bytes, at least 256 MiB); a gRPC request that would pass it is refused with RESOURCE_EXHAUSTED, a REST body waits.\n");
        out.push_str("# TYPE mpspool_request_memory_limit_bytes gauge\n");
        out.push_str(&format!(
            "mpspool_request_memory_limit_bytes {}\n",
            self.request_memory.bytes()
        ));
        out.push_str("# HELP mpspool_client_connections Client connections open now, gRPC and REST together.\n");
        out.push_str("# TYPE mpspool_client_connections gauge\n");
        out.push_str(&format!(
            "mpspool_client_connections {}\n",
            self.connections.open()
        ));
        out.push_str("# HELP mpspool_client_connections_limit The most kept open at once (--max-connections, held under what the front door's open-file limit allows); more are closed as they come.\n");
        out.push_str("# TYPE mpspool_client_connections_limit gauge\n");
        out.push_str(&format!(
            "mpspool_client_connections_limit {}\n",
            self.connections.most()
        ));
        out.push_str("# HELP mpspool_client_connections_refused_total Connections closed as they came because the limit was reached.\n");
        out.push_str("# TYPE mpspool_client_connections_refused_total counter\n");
        out.push_str(&format!(
            "mpspool_client_connections_refused_total {}\n",
            self.connections.refused()
        ));
        out.push_str("# HELP mpspool_client_connections_idle_closed_total gRPC connections ended (GOAWAY) after --max-connection-idle without a call.\n");
        out.push_str("# TYPE mpspool_client_connections_idle_closed_total counter\n");
        out.push_str(&format!(
            "mpspool_client_connections_idle_closed_total {}\n",
            self.connections.idle_closed()
        ));
        out.push_str("# HELP mpspool_workers_ready Workers registered and receiving requests.\n");
        out.push_str("# TYPE mpspool_workers_ready gauge\n");
        out.push_str(&format!("mpspool_workers_ready {}\n", *self.ready.borrow()));
        // Zero rows too: an alert on FATAL > 0 needs the series before the first FATAL.
        let slots = self.state.slots();
        out.push_str("# HELP mpspool_worker_slots Worker slots in each state, as the controller last saw them (BACKOFF: its model could not load and it waits to try again; FATAL: its tries ran out).\n");
        out.push_str("# TYPE mpspool_worker_slots gauge\n");
        for state in SLOT_STATES {
            let n = slots.iter().filter(|s| s.state == state).count();
            out.push_str(&format!("mpspool_worker_slots{{state=\"{state}\"}} {n}\n"));
        }
        out.push_str("# HELP mpspool_worker_restarts_total Processes a worker slot has had since the pool started, less its first (a crash, a kill, a failed load, a restart by the pool).\n");
        out.push_str("# TYPE mpspool_worker_restarts_total counter\n");
        for s in &slots {
            out.push_str(&format!(
                "mpspool_worker_restarts_total{{slot=\"{}\"}} {}\n",
                escape(&s.slot),
                s.restarts
            ));
        }
        out.push_str("# HELP mpspool_worker_copied_weight_bytes Bytes of shared weights TensorFlow copied into the worker of each slot (0: it shares them all; more only with --allow-copied-weights).\n");
        out.push_str("# TYPE mpspool_worker_copied_weight_bytes gauge\n");
        for (slot, bytes) in self.copied.borrow().iter() {
            out.push_str(&format!(
                "mpspool_worker_copied_weight_bytes{{slot=\"{}\"}} {bytes}\n",
                escape(slot)
            ));
        }
        let gpus = self.state.gpus();
        if !gpus.is_empty() {
            let gauges: [(&str, &str, GpuValue); 3] = [
                (
                    "mpspool_gpu_utilization_ratio",
                    "Share of the last NVML sample period with a kernel running on the GPU.",
                    |g| format!("{:?}", g.utilization as f64 / 100.0),
                ),
                (
                    "mpspool_gpu_memory_used_bytes",
                    "GPU memory in use (all processes), as NVML reports it.",
                    |g| g.memory_used.to_string(),
                ),
                (
                    "mpspool_gpu_memory_total_bytes",
                    "GPU memory in all.",
                    |g| g.memory_total.to_string(),
                ),
            ];
            for (name, help, value) in gauges {
                out.push_str(&format!("# HELP {name} {help}\n# TYPE {name} gauge\n"));
                for g in &gpus {
                    out.push_str(&format!(
                        "{name}{{gpu=\"{}\",uuid=\"{}\"}} {}\n",
                        g.gpu,
                        escape(&g.uuid),
                        value(g)
                    ));
                }
            }
        }
        out.push_str("# HELP mpspool_worker_retries_total Requests sent again because their worker left before answering.\n");
        out.push_str("# TYPE mpspool_worker_retries_total counter\n");
        out.push_str(&format!(
            "mpspool_worker_retries_total {}\n",
            self.state.retries.load(Ordering::Relaxed)
        ));
        out.push_str("# HELP mpspool_queued_requests Requests waiting in the front door for a worker with room (--worker-inflight).\n");
        out.push_str("# TYPE mpspool_queued_requests gauge\n");
        out.push_str(&format!(
            "mpspool_queued_requests {}\n",
            self.state.queued.load(Ordering::Relaxed)
        ));
        out.push_str("# HELP mpspool_queue_wait_max_seconds The longest any request has waited in the front door's queue since start.\n");
        out.push_str("# TYPE mpspool_queue_wait_max_seconds gauge\n");
        out.push_str(&format!(
            "mpspool_queue_wait_max_seconds {}\n",
            self.state.queue_wait_max_us.load(Ordering::Relaxed) as f64 / 1e6
        ));
        out.push_str("# HELP mpspool_queue_aging_margin_seconds How much sooner than --aging-bound-ms the sjf queue turns requests urgent: the largest margin a model version's queue learned from requests sent later than planned (0 for fcfs).\n");
        out.push_str("# TYPE mpspool_queue_aging_margin_seconds gauge\n");
        out.push_str(&format!(
            "mpspool_queue_aging_margin_seconds {}\n",
            self.state.queue_margin_us.load(Ordering::Relaxed) as f64 / 1e6
        ));
        out
    }
}

/// How a GPU gauge's value is read from a sample.
type GpuValue = fn(&crate::state::GpuSample) -> String;

/// Prometheus label values escape backslash and double quote.
pub fn escape(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// Scrapes served at once: Prometheus holds one connection per target, a few dashboards or
/// `curl`s more. The metrics port's connections come out of the descriptors kept back from
/// --max-connections (connection_limit::RESERVED_DESCRIPTORS), so they are bounded too: idle
/// connections there must not take the descriptors the workers and clients need.
const METRICS_CONNECTIONS: usize = 32;
/// A connection whose request header is not in within this (or idle this long between
/// requests) is closed; a scrape's request is one small header.
const METRICS_HEADER_WAIT: Duration = Duration::from_secs(10);
/// The longest a metrics connection lives: a client that sends requests and never reads
/// the answers holds its place in a write that never completes, which the header wait does
/// not end. A scraper's keep-alive connection is closed too, and it opens another.
const METRICS_CONNECTION_LIFE: Duration = Duration::from_secs(120);

/// Serve /metrics on `host:port` (0: any free port); the port it got, 0 if it could not:
/// metrics are for watching the pool, and losing them must not stop it serving.
pub async fn serve(metrics: Arc<Metrics>, host: &str, port: u16) -> u16 {
    let listener = match crate::listen::bind(host, port).await {
        Ok(listener) => listener,
        Err(error) => {
            log_error!("metrics endpoint {host}:{port} unavailable: {error}");
            return 0;
        }
    };
    let bound = listener.local_addr().map(|a| a.port()).unwrap_or(0);
    log_info!("metrics on http://{host}:{bound}/metrics");
    tokio::spawn(serve_on(
        listener,
        metrics,
        ConnectionLimit::new(METRICS_CONNECTIONS),
        (METRICS_HEADER_WAIT, METRICS_CONNECTION_LIFE),
    ));
    bound
}

/// `waits`: the header wait and the connection's longest life.
async fn serve_on(
    listener: TcpListener,
    metrics: Arc<Metrics>,
    connections: Arc<ConnectionLimit>,
    (header_wait, life): (Duration, Duration),
) {
    use crate::server::{accepted_or_back_off, METRICS_ACCEPT_FAILURES};
    loop {
        let accepted = listener.accept().await;
        let Some((stream, _)) =
            accepted_or_back_off(accepted, &METRICS_ACCEPT_FAILURES, "metrics ").await
        else {
            continue;
        };
        let Some(admitted) = connections.admit() else {
            crate::connection_limit::refuse(stream, &metrics_refusal(connections.most()));
            continue;
        };
        let metrics = metrics.clone();
        tokio::spawn(async move {
            let _admitted = admitted;
            let service =
                hyper::service::service_fn(move |request: Request<hyper::body::Incoming>| {
                    let metrics = metrics.clone();
                    async move { Ok::<_, std::convert::Infallible>(answer(&metrics, &request)) }
                });
            let connection = hyper::server::conn::http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(header_wait)
                .serve_connection(TokioIo::new(stream), service);
            // Dropped at the end of its life: the socket closes, its place is given back.
            let _ = tokio::time::timeout(life, connection).await;
        });
    }
}

fn metrics_refusal(most: usize) -> Vec<u8> {
    crate::connection_limit::http_503(
        "text/plain",
        &format!(
            "the metrics port has {most} connections open, the most it serves at once; try \
             again later or reuse a connection\n"
        ),
    )
}

fn answer(metrics: &Metrics, request: &Request<hyper::body::Incoming>) -> Response<Full<Bytes>> {
    let (status, content_type, body) = if request.uri().path() == "/metrics" {
        (
            200,
            "text/plain; version=0.0.4; charset=utf-8",
            metrics.render(),
        )
    } else {
        (404, "text/plain", "not found: try /metrics\n".to_string())
    };
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = hyper::StatusCode::from_u16(status).unwrap_or(hyper::StatusCode::OK);
    if let Ok(value) = hyper::header::HeaderValue::from_str(content_type) {
        response
            .headers_mut()
            .insert(hyper::header::CONTENT_TYPE, value);
    }
    response
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ModelEntry;

    fn test_budget() -> Arc<RequestBudget> {
        Arc::new(RequestBudget::new(256 << 20))
    }

    /// Metrics of one model, with no worker ready, nothing copied and 16 client connections
    /// allowed.
    fn metrics_of(model: &str) -> Metrics {
        let (state, _drain) = RouterState::new();
        Metrics::new(
            models_of(model),
            watch::channel(0usize).1,
            watch::channel(BTreeMap::new()).1,
            Arc::new(state),
            test_budget(),
            ConnectionLimit::new(16),
        )
    }

    fn models_of(name: &str) -> watch::Receiver<Arc<Models>> {
        let models = Models::configured(&[ModelEntry::new(name, 1)]).expect("one model");
        watch::channel(Arc::new(models)).1
    }

    #[test]
    fn a_page_made_while_other_threads_record_has_monotone_buckets_ending_at_the_count() {
        // A count kept apart from the buckets was read first, so a request recorded between
        // the two reads was in a bucket but not in `+Inf` (found by a hunt: 15 pages of
        // 3,988 under load on a front door of two threads).
        let histogram = Arc::new(Histogram::default());
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let recorders: Vec<_> = (0..2)
            .map(|_| {
                let (histogram, stop) = (histogram.clone(), stop.clone());
                std::thread::spawn(move || {
                    while !stop.load(Ordering::Relaxed) {
                        histogram.observe(Duration::from_micros(1));
                    }
                })
            })
            .collect();
        let mut bad = Vec::new();
        for _ in 0..20_000 {
            let mut page = String::new();
            histogram.render(&mut page, "h", "m=\"x\"");
            let values: Vec<u64> = (page.lines())
                .filter_map(|line| line.rsplit_once(' ')?.1.parse().ok())
                .collect();
            // The buckets, +Inf, then _count (the _sum is not a whole number).
            let (buckets, count) = values.split_at(values.len() - 1);
            if buckets.windows(2).any(|w| w[0] > w[1]) || buckets.last() != count.first() {
                bad.push(page);
            }
            if bad.len() > 2 {
                break;
            }
        }
        stop.store(true, Ordering::Relaxed);
        for recorder in recorders {
            recorder.join().expect("a recorder");
        }
        assert!(
            bad.is_empty(),
            "{} pages wrong, e.g.\n{}",
            bad.len(),
            bad[0]
        );
    }

    #[test]
    fn a_request_dropped_at_its_deadline_counts_as_deadline_exceeded_not_cancelled() {
        // Its client resets the stream when its deadline passes, often just before the
        // front door's own timer fires: half of such requests were counted CANCELLED (found
        // by a hunt), where TF Serving counts DEADLINE_EXCEEDED.
        let metrics = metrics_of("m");
        let now = tokio::time::Instant::now();
        for deadline in [
            Some(now + Duration::from_millis(10)), // 10 ms before a 60 s deadline
            Some(now - Duration::from_millis(1)),
        ] {
            let mut request = metrics.start(Method::Predict);
            request.started -= Duration::from_secs(60);
            request.expires(deadline);
        }
        // Clients that went away well before their deadline: a short one's too (a client
        // that hedges with a 45 ms timeout and cancels the slower copy; found by a review).
        for deadline in [
            None,
            Some(now + Duration::from_secs(60)),
            Some(now + Duration::from_millis(43)),
        ] {
            let mut request = metrics.start(Method::Predict);
            request.expires(deadline);
        }
        let text = metrics.render();
        let line = |code: &str, n: u32| {
            format!(
                "mpspool_requests_total{{code=\"{code}\",method=\"Predict\",model=\"m\"}} {n}\n"
            )
        };
        assert!(text.contains(&line("DEADLINE_EXCEEDED", 2)), "{text}");
        assert!(text.contains(&line("CANCELLED", 3)), "{text}");
    }

    #[test]
    fn latency_buckets_are_cumulative() {
        let metrics = metrics_of("m");
        for ms in [0, 3, 3, 40, 9000] {
            metrics.record(Method::Predict, Code::Ok, Duration::from_millis(ms));
        }
        let text = metrics.render();
        let bucket = |le: &str| {
            format!("mpspool_request_duration_seconds_bucket{{le=\"{le}\",method=\"Predict\",model=\"m\"}} ")
        };
        for (le, n) in [
            ("0.0005", 1),
            ("0.002", 1),
            ("0.005", 3),
            ("0.05", 4),
            ("5.0", 4),
            ("+Inf", 5),
        ] {
            assert!(
                text.contains(&format!("{}{n}\n", bucket(le))),
                "{le}: {text}"
            );
        }
        assert!(
            text.contains(
                "mpspool_request_duration_seconds_sum{method=\"Predict\",model=\"m\"} 9.046\n"
            ),
            "{text}"
        );
    }

    #[test]
    fn codes_are_listed_once_each_in_name_order() {
        let names: Vec<&str> = CODES_BY_NAME.iter().map(|c| c.name()).collect();
        let mut sorted = names.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(names, sorted);
        let mut numbers: Vec<i32> = CODES_BY_NAME.iter().map(|c| *c as i32).collect();
        numbers.sort_unstable();
        assert_eq!(numbers, (0..=16).collect::<Vec<_>>());
    }

    #[test]
    fn a_dropped_handler_counts_as_cancelled_and_leaves_the_gauge() {
        let metrics = metrics_of("m\"x");
        let request = metrics.start(Method::GetModelStatus);
        assert!(metrics
            .render()
            .contains("mpspool_inflight_requests{model=\"m\\\"x\"} 1\n"));
        drop(request);
        let text = metrics.render();
        assert!(
            text.contains("mpspool_inflight_requests{model=\"m\\\"x\"} 0\n"),
            "{text}"
        );
        assert!(text.contains(
            "mpspool_requests_total{code=\"CANCELLED\",method=\"GetModelStatus\",model=\"m\\\"x\"} 1\n"
        ));
        assert!(
            !text.contains("method=\"Predict\""),
            "no samples for unused methods"
        );
    }

    #[test]
    fn renders_counts_latency_and_gauges() {
        let (state, _drain) = RouterState::new();
        state.set_slots(vec![
            crate::state::SlotSample {
                slot: "cpu-0@1".to_string(),
                state: "READY",
                restarts: 3,
                model: "demo".to_string(),
                version: 1,
            },
            crate::state::SlotSample {
                slot: "ranker/cpu-1@2".to_string(),
                state: "FATAL",
                restarts: 4,
                model: "ranker".to_string(),
                version: 2,
            },
        ]);
        let (_tx, ready) = watch::channel(2usize);
        let copied = BTreeMap::from([("cpu-0".to_string(), 0u64), ("cpu-1".to_string(), 8)]);
        let (_copied_tx, copied) = watch::channel(copied);
        let budget = test_budget();
        let connections = ConnectionLimit::new(2);
        let metrics = Metrics::new(
            models_of("demo"),
            ready,
            copied,
            Arc::new(state),
            budget.clone(),
            connections.clone(),
        );
        let _held = budget.try_reserve(3 << 10).expect("room");
        let _open = [connections.admit(), connections.admit()];
        assert!(connections.admit().is_none());
        if let Some(admitted) = &_open[0] {
            admitted.ended(crate::lifespan::Ended::Idle);
            admitted.ended(crate::lifespan::Ended::Closed);
        }
        {
            let mut request = metrics.start(Method::Predict);
            request.set_code(Code::Ok);
        }
        {
            let mut request = metrics.start(Method::Predict);
            request.set_code(Code::NotFound);
        }
        let text = metrics.render();
        assert!(
            text.contains(
                "mpspool_requests_total{code=\"OK\",method=\"Predict\",model=\"demo\"} 1\n"
            ),
            "{text}"
        );
        assert!(text.contains(
            "mpspool_requests_total{code=\"NOT_FOUND\",method=\"Predict\",model=\"demo\"} 1\n"
        ));
        assert!(text.contains(
            "mpspool_request_duration_seconds_count{method=\"Predict\",model=\"demo\"} 2\n"
        ));
        assert!(text.contains("mpspool_request_duration_seconds_bucket{le=\"+Inf\",method=\"Predict\",model=\"demo\"} 2\n"));
        assert!(text.contains("mpspool_inflight_requests{model=\"demo\"} 0\n"));
        assert!(text.contains("mpspool_workers_ready 2\n"));
        assert!(text.contains("mpspool_worker_retries_total 0\n"));
        assert!(text.contains("mpspool_worker_copied_weight_bytes{slot=\"cpu-1\"} 8\n"));
        for (state, n) in [("READY", 1), ("FATAL", 1), ("BACKOFF", 0), ("STARTING", 0)] {
            let row = format!("mpspool_worker_slots{{state=\"{state}\"}} {n}\n");
            assert!(text.contains(&row), "{row}{text}");
        }
        assert!(text.contains("mpspool_worker_restarts_total{slot=\"cpu-0@1\"} 3\n"));
        assert!(text.contains("mpspool_worker_restarts_total{slot=\"ranker/cpu-1@2\"} 4\n"));
        assert!(text.contains("mpspool_worker_copied_weight_bytes{slot=\"cpu-0\"} 0\n"));
        assert!(
            text.contains("mpspool_request_memory_bytes 3072\n"),
            "{text}"
        );
        assert!(text.contains("mpspool_request_memory_limit_bytes 268435456\n"));
        assert!(text.contains("mpspool_client_connections 2\n"), "{text}");
        assert!(text.contains("mpspool_client_connections_limit 2\n"));
        assert!(text.contains("mpspool_client_connections_refused_total 1\n"));
        assert!(text.contains("mpspool_client_connections_idle_closed_total 1\n"));
    }

    /// Idle or half-sent connections to the metrics port are bounded in number and in time:
    /// 700 of them took every descriptor of a front door held to `ulimit -n 600`, and gRPC
    /// and REST clients were turned away (accept: EMFILE).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_metrics_port_bounds_its_connections_in_number_and_time() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let metrics = Arc::new(metrics_of("m"));
        let listener = TcpListener::bind(("127.0.0.1", 0)).await.unwrap();
        let address = listener.local_addr().unwrap();
        let limit = ConnectionLimit::new(2);
        tokio::spawn(serve_on(
            listener,
            metrics,
            limit.clone(),
            (Duration::from_millis(300), Duration::from_secs(2)),
        ));
        let mut stalled = Vec::new();
        for _ in 0..2 {
            let mut stream = tokio::net::TcpStream::connect(address).await.unwrap();
            stream.write_all(b"GET /metr").await.unwrap();
            stalled.push(stream);
        }
        while limit.open() < 2 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let mut third = tokio::net::TcpStream::connect(address).await.unwrap();
        let mut answer = String::new();
        third.read_to_string(&mut answer).await.unwrap();
        assert!(answer.starts_with("HTTP/1.1 503 "), "{answer}");
        assert!(answer.contains("the metrics port has 2 connections open"));

        // Their header never completes: closed after the wait, their places given back.
        for mut stream in stalled {
            let mut rest = Vec::new();
            let read = tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut rest));
            assert!(read.await.is_ok(), "closed by the server");
        }
        while limit.open() > 0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let mut scrape = tokio::net::TcpStream::connect(address).await.unwrap();
        scrape
            .write_all(b"GET /metrics HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            .await
            .unwrap();
        let mut page = String::new();
        scrape.read_to_string(&mut page).await.unwrap();
        assert!(page.starts_with("HTTP/1.1 200 OK"), "{page}");
        assert!(page.contains("mpspool_client_connections_limit 16"));

        // A client that asks again and again and never reads its answers: its connection
        // ends with its life (the write it is stuck in does not hold its place for good).
        let mut greedy = tokio::net::TcpStream::connect(address).await.unwrap();
        let ask = b"GET /metrics HTTP/1.1\r\nhost: x\r\n\r\n".repeat(2000);
        let _ = tokio::time::timeout(Duration::from_secs(1), greedy.write_all(&ask)).await;
        while limit.open() == 0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let ended = tokio::time::timeout(Duration::from_secs(10), async {
            while limit.open() > 0 {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        });
        assert!(ended.await.is_ok(), "its place is given back");
    }
}
