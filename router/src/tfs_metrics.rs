//! TF Serving's own metrics, under its names, for dashboards and alerts built on TF Serving
//! (`util/prometheus_exporter.cc` writes them; `servables/tensorflow/util.cc` defines them):
//! - `:tensorflow:serving:request_count{model_name,status}`: every gRPC Predict, Classify and
//!   Regress, and every REST request under /v1/ that names a model (its GETs of status and
//!   metadata too), by status code name; not MultiInference, which TF Serving's
//!   PredictionServiceImpl does not count (prediction_service_impl.cc, http_server.cc);
//! - `:tensorflow:serving:request_latency{model_name,API,entrypoint}`: microseconds from
//!   receiving a request to answering it, successful ones only; API is the gRPC method name
//!   ("Predict") or the REST verb ("predict"; "" for a GET, whose method TF Serving's REST
//!   handler leaves empty), entrypoint "GRPC" or "REST";
//! - `:tensorflow:serving:runtime_latency{model_name,API,runtime}`: microseconds of the model
//!   call itself (the worker's span; runtime "TF1", TF Serving's name for the TensorFlow
//!   runtime as opposed to TFRT);
//! - `:tensorflow:serving:request_example_counts{model}` and `..._count_total{model}`:
//!   tf.Examples per MultiInference, the one caller of TF Serving's RecordRequestExampleCount
//!   (multi_inference.cc; Classify and Regress do not count theirs);
//! - with `--enable-batching`, the batching session's (`batching/batching_session.cc`,
//!   `batching/batching_util.h`), one set for the process as there: `queuing_latency`,
//!   `wrapped_run_count`, `input_batch_size`, `processed_batch_size`, `padding_size`
//!   (`BatchingMetrics`);
//! - TensorFlow's own `:tensorflow:core:graph_runs` and `graph_run_time_usecs`
//!   (`GraphRunMetrics`), which TF Serving's page carries as it exports every metric the
//!   process registered.
//!
//! Histograms have TF Serving's buckets (×1.8 from 10 µs, 33 of them; ×2 from 1 example, 15).
//! Only requests that name a served model are counted, each under its model: a client cannot
//! grow the label set by sending made-up names (TF Serving counts those under whatever name
//! they carry).

use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, PoisonError, RwLock};

use tokio::sync::watch;

use crate::json_tensor::format_g;
use crate::metrics::escape;
use crate::status::Code;
use crate::versions::{ModelId, Models, Servable};

/// The TF Serving APIs that are counted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Api {
    Predict = 0,
    Classify = 1,
    Regress = 2,
    /// A REST GET of a model's status or metadata (no method: API "").
    Get = 3,
}

const APIS: [Api; 4] = [Api::Predict, Api::Classify, Api::Regress, Api::Get];

impl Api {
    fn label(self, entrypoint: Entrypoint) -> &'static str {
        match (self, entrypoint) {
            (Api::Predict, Entrypoint::Grpc) => "Predict",
            (Api::Classify, Entrypoint::Grpc) => "Classify",
            (Api::Regress, Entrypoint::Grpc) => "Regress",
            (Api::Predict, Entrypoint::Rest) => "predict",
            (Api::Classify, Entrypoint::Rest) => "classify",
            (Api::Regress, Entrypoint::Rest) => "regress",
            (Api::Get, _) => "",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Entrypoint {
    Grpc = 0,
    Rest = 1,
}

const ENTRYPOINTS: [Entrypoint; 2] = [Entrypoint::Grpc, Entrypoint::Rest];

impl Entrypoint {
    fn label(self) -> &'static str {
        match self {
            Entrypoint::Grpc => "GRPC",
            Entrypoint::Rest => "REST",
        }
    }
}

/// A histogram over TensorFlow's exponential buckets: `count` bounds from `scale`, each
/// `growth` times the one before, then +Inf.
struct Exponential {
    bounds: Vec<f64>,
    /// Per bucket (not cumulative); the last is +Inf.
    buckets: Vec<AtomicU64>,
    sum: AtomicU64,
}

impl Exponential {
    fn new(scale: f64, growth: f64, count: usize) -> Exponential {
        let mut bounds = Vec::with_capacity(count);
        let mut bound = scale;
        for _ in 0..count {
            bounds.push(bound);
            bound *= growth;
        }
        let buckets = (0..=count).map(|_| AtomicU64::new(0)).collect();
        Exponential {
            bounds,
            buckets,
            sum: AtomicU64::new(0),
        }
    }

    fn observe(&self, value: u64) {
        let v = value as f64;
        // TensorFlow's buckets are [lower, upper): a value equal to a bound is in the next.
        let index = self.bounds.partition_point(|&b| b <= v);
        self.buckets[index].fetch_add(1, Ordering::Relaxed);
        self.sum.fetch_add(value, Ordering::Relaxed);
    }

    fn count(&self) -> u64 {
        self.buckets.iter().map(|b| b.load(Ordering::Relaxed)).sum()
    }

    /// The `_bucket`, `_sum` and `_count` lines for one label set (`labels` without braces;
    /// empty for none: `name_bucket{le="1"}`, `name_sum{}`, as TF Serving's exporter writes).
    fn render(&self, out: &mut String, name: &str, labels: &str) {
        let comma = if labels.is_empty() { "" } else { "," };
        let mut cumulative = 0;
        for (i, bucket) in self.buckets.iter().enumerate() {
            cumulative += bucket.load(Ordering::Relaxed);
            let le = self
                .bounds
                .get(i)
                .map_or("+Inf".to_string(), |b| format_g(*b, 6));
            let _ = writeln!(
                out,
                "{name}_bucket{{{labels}{comma}le=\"{le}\"}} {cumulative}"
            );
        }
        let _ = writeln!(
            out,
            "{name}_sum{{{labels}}} {}",
            self.sum.load(Ordering::Relaxed)
        );
        let _ = writeln!(out, "{name}_count{{{labels}}} {cumulative}");
    }
}

fn latency_histogram() -> Exponential {
    Exponential::new(10.0, 1.8, 33)
}

/// One model's series.
struct ModelSeries {
    /// The model's name, escaped for a label value.
    label: String,
    /// By status code number.
    request_count: [AtomicU64; 17],
    /// By API, then entrypoint.
    request_latency: Vec<[Exponential; 2]>,
    runtime_latency: Vec<Exponential>,
    example_counts: Exponential,
    example_total: AtomicU64,
}

impl ModelSeries {
    fn new(model: &str) -> ModelSeries {
        ModelSeries {
            label: escape(model),
            request_count: Default::default(),
            request_latency: APIS
                .iter()
                .map(|_| [latency_histogram(), latency_histogram()])
                .collect(),
            runtime_latency: APIS.iter().map(|_| latency_histogram()).collect(),
            example_counts: Exponential::new(1.0, 2.0, 15),
            example_total: AtomicU64::new(0),
        }
    }
}

/// Every model's series, by `ModelId`; a family's lines for all models come under its one
/// `# TYPE` line, as the exposition format requires. A model added while the pool serves gets
/// its series when it is first counted or shown; a removed model's stay (TF Serving's
/// counters outlive an unloaded model too).
pub struct TfServingMetrics {
    models: RwLock<Vec<Arc<ModelSeries>>>,
    /// Where the names of models added later come from (None: a fixed list).
    names: Option<watch::Receiver<Arc<Models>>>,
}

impl TfServingMetrics {
    /// Series for a fixed list of models.
    #[cfg(test)]
    pub fn new(models: &[String]) -> TfServingMetrics {
        TfServingMetrics {
            models: RwLock::new(
                models
                    .iter()
                    .map(|m| Arc::new(ModelSeries::new(m)))
                    .collect(),
            ),
            names: None,
        }
    }

    /// Series for the models of `models`, now and as it changes.
    pub fn following(models: watch::Receiver<Arc<Models>>) -> TfServingMetrics {
        let metrics = TfServingMetrics {
            models: RwLock::new(Vec::new()),
            names: Some(models),
        };
        metrics.catch_up();
        metrics
    }

    /// Series for every model id given since the last look.
    fn catch_up(&self) {
        let Some(names) = &self.names else { return };
        let models = names.borrow().clone();
        let mut series = self.models.write().unwrap_or_else(PoisonError::into_inner);
        let known = series.len();
        series.extend(
            models
                .ids()
                .skip(known)
                .map(|(_, name)| Arc::new(ModelSeries::new(name))),
        );
    }

    /// `record` on a model's series, under the read lock (no copy on the request path); a
    /// model not known yet is looked up once among those added since.
    fn with(&self, model: ModelId, record: impl FnOnce(&ModelSeries)) {
        let read = || self.models.read().unwrap_or_else(PoisonError::into_inner);
        if usize::from(model) >= read().len() {
            self.catch_up();
        }
        if let Some(series) = read().get(usize::from(model)) {
            record(series);
        }
    }

    fn all(&self) -> Vec<Arc<ModelSeries>> {
        self.catch_up();
        self.models
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// A finished request: counted by status; its latency kept when it succeeded.
    pub fn record_request(
        &self,
        model: ModelId,
        api: Api,
        entrypoint: Entrypoint,
        code: Code,
        micros: u64,
    ) {
        self.with(model, |series| {
            series.request_count[code as usize].fetch_add(1, Ordering::Relaxed);
            if code == Code::Ok {
                series.request_latency[api as usize][entrypoint as usize].observe(micros);
            }
        });
    }

    /// One model call's duration on its worker.
    pub fn record_runtime(&self, model: ModelId, api: Api, micros: u64) {
        self.with(model, |series| {
            series.runtime_latency[api as usize].observe(micros);
        });
    }

    /// The number of tf.Examples of a MultiInference.
    pub fn record_examples(&self, model: ModelId, examples: usize) {
        self.with(model, |series| {
            series.example_counts.observe(examples as u64);
            series
                .example_total
                .fetch_add(examples as u64, Ordering::Relaxed);
        });
    }

    /// The page TF Serving serves at its Prometheus path.
    pub fn render(&self) -> String {
        let models = self.all();
        let mut out = String::new();
        let name = ":tensorflow:serving:request_count";
        let _ = writeln!(out, "# TYPE {name} counter");
        for series in &models {
            let model = &series.label;
            for code in 0..17 {
                let n = series.request_count[code].load(Ordering::Relaxed);
                if n > 0 {
                    let status = Code::from_i32(code as i32).name();
                    let _ = writeln!(
                        out,
                        "{name}{{model_name=\"{model}\",status=\"{status}\"}} {n}"
                    );
                }
            }
        }
        let name = ":tensorflow:serving:request_latency";
        let _ = writeln!(out, "# TYPE {name} histogram");
        for series in &models {
            for api in APIS {
                for entrypoint in ENTRYPOINTS {
                    let histogram = &series.request_latency[api as usize][entrypoint as usize];
                    if histogram.count() > 0 {
                        let labels = format!(
                            "model_name=\"{}\",API=\"{}\",entrypoint=\"{}\"",
                            series.label,
                            api.label(entrypoint),
                            entrypoint.label()
                        );
                        histogram.render(&mut out, name, &labels);
                    }
                }
            }
        }
        let name = ":tensorflow:serving:runtime_latency";
        let _ = writeln!(out, "# TYPE {name} histogram");
        for series in &models {
            for api in APIS {
                let histogram = &series.runtime_latency[api as usize];
                if histogram.count() > 0 {
                    let labels = format!(
                        "model_name=\"{}\",API=\"{}\",runtime=\"TF1\"",
                        series.label,
                        api.label(Entrypoint::Grpc)
                    );
                    histogram.render(&mut out, name, &labels);
                }
            }
        }
        let name = ":tensorflow:serving:request_example_counts";
        let _ = writeln!(out, "# TYPE {name} histogram");
        for series in &models {
            if series.example_counts.count() > 0 {
                let labels = format!("model=\"{}\"", series.label);
                series.example_counts.render(&mut out, name, &labels);
            }
        }
        let name = ":tensorflow:serving:request_example_count_total";
        let _ = writeln!(out, "# TYPE {name} counter");
        for series in &models {
            let total = series.example_total.load(Ordering::Relaxed);
            if total > 0 {
                let _ = writeln!(out, "{name}{{model=\"{}\"}} {total}", series.label);
            }
        }
        out
    }
}

/// TF Serving's batching metrics, recorded where the front door batches (the dispatcher,
/// with `--enable-batching`). There, every request goes through a batch queue and each batch
/// is one `Run` of the wrapped session; here, every call the dispatcher hands to a worker
/// while batching is on is such a batch, of one request or several (a request whose inputs
/// cannot merge runs alone, and the members of a merged call that failed run again one by
/// one: those calls count as batches of their own too; one above `max_batch_size` is
/// refused before it is queued, as in TF Serving).
/// A request's inputs are sized once, on arrival; its wait is counted each time it leaves
/// the queue, from when it last entered it (a request sent again after its worker left, or
/// back from a failed merged call, queued again). TF Serving keeps one set for the process,
/// not one per model, and so does this.
pub struct BatchingMetrics {
    /// µs from a request entering the dispatcher's queue to its batch leaving for a worker,
    /// per request (`thread_pool_name` is empty in TF Serving's server, which names no pool).
    queuing_latency: Exponential,
    wrapped_run_count: AtomicU64,
    /// The first dimension of each input tensor of each request (TF Serving records every
    /// input's, so a request of three inputs adds three samples).
    input_batch_size: Exponential,
    /// Each batch's rows, padding included.
    processed_batch_size: Exponential,
    /// Each batch's padding rows, by its rows with padding (`execution_batch_size`). Only
    /// batches of at most `max_batch_size` rows are counted here, so the labels stay within
    /// what the operator configured (a larger request, which only a request moved to
    /// another version's smaller batching can be, runs alone, with no padding).
    padding_size: std::sync::Mutex<std::collections::BTreeMap<u64, Exponential>>,
}

impl Default for BatchingMetrics {
    fn default() -> Self {
        BatchingMetrics {
            // "Scale of 100, power of 1.2 with bucket count 52 (~1 second)."
            queuing_latency: Exponential::new(100.0, 1.2, 52),
            wrapped_run_count: AtomicU64::new(0),
            input_batch_size: batch_size_histogram(),
            processed_batch_size: batch_size_histogram(),
            padding_size: Default::default(),
        }
    }
}

/// TensorFlow's `/tensorflow/core/graph_runs` and `/tensorflow/core/graph_run_time_usecs`
/// (core/framework/metrics.cc): graph executions, and the µs they took, which a session
/// adds to on each run that succeeds. Here the model calls the workers answered requests
/// with (a merged call once, its rerun members each), timed by the workers' spans; their
/// warm-up runs are not counted. What the Grafana TF Serving mixin's "Graph Runs" and
/// "Graph Run Time" panels read.
#[derive(Default)]
pub struct GraphRunMetrics {
    runs: AtomicU64,
    run_time_us: AtomicU64,
}

impl GraphRunMetrics {
    /// One model call a worker answered, `micros` long.
    pub fn record(&self, micros: u64) {
        self.runs.fetch_add(1, Ordering::Relaxed);
        self.run_time_us.fetch_add(micros, Ordering::Relaxed);
    }

    /// Their part of TF Serving's page: typed from the start (TensorFlow registers them when
    /// it loads), a value once a graph ran (its cell is made then).
    pub fn render(&self, out: &mut String) {
        // The time first: read after it, the count is never below the runs the time holds.
        let micros = self.run_time_us.load(Ordering::Relaxed);
        let runs = self.runs.load(Ordering::Relaxed);
        for (family, value) in [("graph_runs", runs), ("graph_run_time_usecs", micros)] {
            let name = format!(":tensorflow:core:{family}");
            let _ = writeln!(out, "# TYPE {name} counter");
            if runs > 0 {
                let _ = writeln!(out, "{name}{{}} {value}");
            }
        }
    }
}

/// "Exponential buckets [1*2^0, ..., 1*2^13, DBL_MAX]."
fn batch_size_histogram() -> Exponential {
    Exponential::new(1.0, 2.0, 14)
}

impl BatchingMetrics {
    /// A request entered the batch queue, with these first dimensions of its inputs.
    pub fn record_input(&self, first_dimensions: impl IntoIterator<Item = u64>) {
        for rows in first_dimensions {
            self.input_batch_size.observe(rows);
        }
    }

    /// A request left the batch queue without its batch: its deadline passed there, or its
    /// caller cancelled. TF Serving records its wait too (every task of a batch it takes from
    /// the queue, those whose deadline passed included), then fails it.
    pub fn record_expired(&self, waited_us: u64) {
        self.queuing_latency.observe(waited_us);
    }

    /// A batch left for a worker: `rows` of its requests padded to `padded`, after each
    /// request waited `waited_us`; `max_batch_size` bounds the padding series' labels.
    pub fn record_batch(
        &self,
        waited_us: impl IntoIterator<Item = u64>,
        rows: u64,
        padded: u64,
        max_batch_size: u64,
    ) {
        for waited in waited_us {
            self.queuing_latency.observe(waited);
        }
        self.processed_batch_size.observe(padded);
        if padded <= max_batch_size {
            let mut padding = self
                .padding_size
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            padding
                .entry(padded)
                .or_insert_with(batch_size_histogram)
                .observe(padded.saturating_sub(rows));
        }
        self.wrapped_run_count.fetch_add(1, Ordering::Relaxed);
    }

    /// Their part of TF Serving's page. `queuing_latency` and `wrapped_run_count` are typed
    /// even before a batch (TF Serving registers them at start); the others once recorded
    /// (registered on first use there).
    pub fn render(&self, out: &mut String) {
        let name = ":tensorflow:serving:batching_session:queuing_latency";
        let _ = writeln!(out, "# TYPE {name} histogram");
        if self.queuing_latency.count() > 0 {
            self.queuing_latency
                .render(out, name, "thread_pool_name=\"\"");
        }
        let name = ":tensorflow:serving:batching_session:wrapped_run_count";
        let _ = writeln!(out, "# TYPE {name} counter");
        let runs = self.wrapped_run_count.load(Ordering::Relaxed);
        if runs > 0 {
            let _ = writeln!(out, "{name}{{}} {runs}");
        }
        for (family, histogram) in [
            ("input_batch_size", &self.input_batch_size),
            ("processed_batch_size", &self.processed_batch_size),
        ] {
            if histogram.count() > 0 {
                let name = format!(":tensorflow:serving:batching_session:{family}");
                let _ = writeln!(out, "# TYPE {name} histogram");
                histogram.render(out, &name, "");
            }
        }
        let padding = self
            .padding_size
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if !padding.is_empty() {
            let name = ":tensorflow:serving:batching_session:padding_size";
            let _ = writeln!(out, "# TYPE {name} histogram");
            for (execution_batch_size, histogram) in padding.iter() {
                let labels = format!("execution_batch_size=\"{execution_batch_size}\"");
                histogram.render(out, name, &labels);
            }
        }
    }
}

/// TF Serving's model warm-up metrics (`servables/tensorflow/saved_model_warmup_util.cc`):
/// `:tensorflow:serving:model_warmup_latency{model_path,status}` (µs to replay a version's
/// warm-up file; ×1.8 from 10 µs, 33 buckets) and `model_warmup_records_read{model_path,
/// status}` (its records, each run the configured number of times), `model_path` the version's
/// folder. Recorded once per worker process, as each of them loads and warms the version up
/// (TF Serving's one process: once per load), from its READY. Only a warm-up that read its
/// file to the end is recorded (status "OK"): one whose record failed keeps its worker from
/// coming up, and TF Serving returns before it records in most of those cases too (a record
/// that does not parse or does not run); a version without the file is not recorded, as
/// there. Both families are typed from the start (TF Serving registers them at start).
/// A version's series are kept while the controller lists the version (serving, loading, or
/// among the few retired ones it shows END), then dropped: one pair of series per version
/// ever loaded grew the page by 37 lines a deploy, for ever (found by a hunt).
#[derive(Default)]
pub struct WarmupMetrics {
    /// Its latency histogram and records read (status "OK": the only one recorded).
    by_path: ByVersionFolder<WarmedUp>,
}

struct WarmedUp {
    latency: Exponential,
    read: u64,
}

impl WarmupMetrics {
    /// A worker of `servable` replayed `path`'s warm-up file, `records` records in `micros`.
    pub fn record(&self, servable: Servable, path: &str, micros: u64, records: u64) {
        let new = || WarmedUp {
            latency: latency_histogram(),
            read: 0,
        };
        self.by_path.update(servable, path, new, |warmed| {
            warmed.latency.observe(micros);
            warmed.read += records;
        });
    }

    /// `model`'s versions are now `listed`: the series of its other versions go.
    pub fn keep_versions_of(&self, model: ModelId, listed: &BTreeSet<i64>) {
        self.by_path.keep_versions_of(model, listed);
    }

    /// The pool serves only `served` now: a removed model's series go (a model added back
    /// is told its counts again with its version table).
    pub fn keep_models(&self, served: &BTreeSet<ModelId>) {
        self.by_path.keep_models(served);
    }

    /// Their part of TF Serving's page.
    pub fn render(&self, out: &mut String) {
        let by_path = self.by_path.lock();
        let labels = |path: &str| format!("model_path=\"{}\",status=\"OK\"", escape(path));
        let name = ":tensorflow:serving:model_warmup_latency";
        let _ = writeln!(out, "# TYPE {name} histogram");
        for (path, Folder { value: warmed, .. }) in by_path.iter() {
            warmed.latency.render(out, name, &labels(path));
        }
        let name = ":tensorflow:serving:model_warmup_records_read";
        let _ = writeln!(out, "# TYPE {name} counter");
        for (path, Folder { value: warmed, .. }) in by_path.iter() {
            let _ = writeln!(out, "{name}{{{}}} {}", labels(path), warmed.read);
        }
    }
}

/// TensorFlow's SavedModel load metrics (`tensorflow/cc/saved_model/loader.cc`), which TF
/// Serving's page carries as every TensorFlow metric:
/// `:tensorflow:cc:saved_model:load_attempt_count{model_path,status}` (loads of the version
/// folder) and `:tensorflow:cc:saved_model:load_latency{model_path}` (the µs of those that
/// succeeded, summed). A success is recorded once per worker process, as each loads the
/// version (TF Serving's one process: once per load), from its READY; a failure (a worker
/// whose SavedModel did not load, a publisher that could not read it) is counted by the
/// controller, which sends its count with the version table. Kept while the controller lists
/// the version, as the warm-up metrics are.
#[derive(Default)]
pub struct LoadMetrics {
    by_path: ByVersionFolder<Loaded>,
}

#[derive(Default)]
struct Loaded {
    successes: u64,
    failures: u64,
    micros: u64,
}

impl LoadMetrics {
    /// A worker of `servable` loaded the SavedModel at `path` in `micros`.
    pub fn record(&self, servable: Servable, path: &str, micros: u64) {
        self.by_path
            .update(servable, path, Loaded::default, |loaded| {
                loaded.successes += 1;
                loaded.micros = loaded.micros.saturating_add(micros);
            });
    }

    /// The controller counts `failures` load attempts of `servable` at `path` so far (a
    /// counter: a smaller count, from a table sent before, changes nothing).
    pub fn record_failures(&self, servable: Servable, path: &str, failures: u64) {
        self.by_path
            .update(servable, path, Loaded::default, |loaded| {
                loaded.failures = loaded.failures.max(failures);
            });
    }

    /// `model`'s versions are now `listed`: the series of its other versions go.
    pub fn keep_versions_of(&self, model: ModelId, listed: &BTreeSet<i64>) {
        self.by_path.keep_versions_of(model, listed);
    }

    /// The pool serves only `served` now: a removed model's series go (a model added back
    /// is told its counts again with its version table).
    pub fn keep_models(&self, served: &BTreeSet<ModelId>) {
        self.by_path.keep_models(served);
    }

    /// Their part of TF Serving's page (both families typed from the start, as TensorFlow
    /// registers them; a status's series once a load has had it).
    pub fn render(&self, out: &mut String) {
        let by_path = self.by_path.lock();
        let name = ":tensorflow:cc:saved_model:load_attempt_count";
        let _ = writeln!(out, "# TYPE {name} counter");
        for (path, Folder { value: loaded, .. }) in by_path.iter() {
            for (status, count) in [("success", loaded.successes), ("fail", loaded.failures)] {
                if count > 0 {
                    let labels = format!("model_path=\"{}\",status=\"{status}\"", escape(path));
                    let _ = writeln!(out, "{name}{{{labels}}} {count}");
                }
            }
        }
        let name = ":tensorflow:cc:saved_model:load_latency";
        let _ = writeln!(out, "# TYPE {name} counter");
        for (path, Folder { value: loaded, .. }) in by_path.iter() {
            let path = escape(path);
            let _ = writeln!(out, "{name}{{model_path=\"{path}\"}} {}", loaded.micros);
        }
    }
}

/// Series kept per version folder (`model_path`), each with the versions it is, dropped once
/// the controller lists none of them: one set per version ever loaded grew the page by dozens
/// of lines a deploy, for ever (found by a hunt). A folder may be a version of two models
/// (two names on one base path, as TF Serving allows): its series, one as TF Serving's are
/// keyed by the path alone, stay while either model lists it.
struct ByVersionFolder<T> {
    series: std::sync::Mutex<std::collections::BTreeMap<String, Folder<T>>>,
}

struct Folder<T> {
    /// The versions this folder is (one per model that loaded it).
    of: BTreeSet<Servable>,
    value: T,
}

impl<T> Default for ByVersionFolder<T> {
    fn default() -> Self {
        ByVersionFolder {
            series: Default::default(),
        }
    }
}

impl<T> ByVersionFolder<T> {
    /// `update` the series of `path` (a version folder of `servable`), made by `new` first.
    fn update(
        &self,
        servable: Servable,
        path: &str,
        new: impl FnOnce() -> T,
        update: impl FnOnce(&mut T),
    ) {
        let mut series = self.lock();
        let folder = series.entry(path.to_string()).or_insert_with(|| Folder {
            of: BTreeSet::new(),
            value: new(),
        });
        folder.of.insert(servable);
        update(&mut folder.value);
    }

    /// `model`'s versions are now `listed`: its other versions' folders go, unless another
    /// model's version is the same folder.
    fn keep_versions_of(&self, model: ModelId, listed: &BTreeSet<i64>) {
        self.keep(|s| s.model != model || listed.contains(&s.version));
    }

    fn keep_models(&self, served: &BTreeSet<ModelId>) {
        self.keep(|s| served.contains(&s.model));
    }

    /// Each folder keeps the versions `kept` keeps, and goes with its last.
    fn keep(&self, kept: impl Fn(&Servable) -> bool) {
        self.lock().retain(|_, folder| {
            folder.of.retain(|servable| kept(servable));
            !folder.of.is_empty()
        });
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, std::collections::BTreeMap<String, Folder<T>>> {
        self.series.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn servable(model: ModelId, version: i64) -> Servable {
        Servable { model, version }
    }

    #[test]
    fn pages_have_tf_servings_names_labels_and_buckets() {
        let metrics = TfServingMetrics::new(&["de\"mo".to_string()]);
        metrics.record_request(0, Api::Predict, Entrypoint::Grpc, Code::Ok, 10);
        metrics.record_request(0, Api::Predict, Entrypoint::Grpc, Code::Ok, 250);
        metrics.record_request(0, Api::Predict, Entrypoint::Rest, Code::InvalidArgument, 99);
        metrics.record_runtime(0, Api::Classify, 20);
        metrics.record_examples(0, 3);
        let page = metrics.render();
        assert!(page.contains(
            ":tensorflow:serving:request_count{model_name=\"de\\\"mo\",status=\"OK\"} 2\n"
        ));
        assert!(page.contains("status=\"INVALID_ARGUMENT\"} 1\n"));
        let labels = "model_name=\"de\\\"mo\",API=\"Predict\",entrypoint=\"GRPC\"";
        // 10 µs is not below the first bound (10): it is in [10, 18).
        assert!(page.contains(&format!(
            ":tensorflow:serving:request_latency_bucket{{{labels},le=\"10\"}} 0\n"
        )));
        assert!(page.contains(&format!(
            ":tensorflow:serving:request_latency_bucket{{{labels},le=\"18\"}} 1\n"
        )));
        assert!(page.contains(&format!(
            ":tensorflow:serving:request_latency_bucket{{{labels},le=\"+Inf\"}} 2\n"
        )));
        assert!(page.contains(&format!(
            ":tensorflow:serving:request_latency_sum{{{labels}}} 260\n"
        )));
        // Failed requests have no latency sample, as in TF Serving.
        assert!(!page.contains("entrypoint=\"REST\""));
        assert!(page.contains("API=\"Classify\",runtime=\"TF1\",le=\"32.4\"} 1\n"));
        assert!(page
            .contains(":tensorflow:serving:request_example_count_total{model=\"de\\\"mo\"} 3\n"));
        assert_eq!(page.matches("request_latency_bucket").count(), 34);

        // A REST GET (status, metadata): API "", as TF Serving's REST handler leaves it.
        metrics.record_request(0, Api::Get, Entrypoint::Rest, Code::Ok, 40);
        assert!(metrics.render().contains(
            ":tensorflow:serving:request_latency_count{model_name=\"de\\\"mo\",API=\"\",entrypoint=\"REST\"} 1\n"
        ));
    }

    #[test]
    fn graph_runs_are_typed_from_the_start_and_counted_with_their_time() {
        let graph = GraphRunMetrics::default();
        let mut page = String::new();
        graph.render(&mut page);
        assert_eq!(
            page,
            "# TYPE :tensorflow:core:graph_runs counter\n\
             # TYPE :tensorflow:core:graph_run_time_usecs counter\n"
        );
        graph.record(250);
        graph.record(40);
        let mut page = String::new();
        graph.render(&mut page);
        assert!(page.contains(":tensorflow:core:graph_runs{} 2\n"), "{page}");
        assert!(
            page.contains(":tensorflow:core:graph_run_time_usecs{} 290\n"),
            "{page}"
        );
    }

    #[test]
    fn batching_has_tf_servings_names_buckets_and_unlabelled_lines() {
        let batching = BatchingMetrics::default();
        let mut page = String::new();
        batching.render(&mut page);
        // Before any batch: the two families TF Serving registers at start, typed, empty.
        assert_eq!(
            page,
            "# TYPE :tensorflow:serving:batching_session:queuing_latency histogram\n\
             # TYPE :tensorflow:serving:batching_session:wrapped_run_count counter\n"
        );
        batching.record_input([2, 2]); // one request, two inputs of 2 rows
        batching.record_input([3, 3]);
        batching.record_batch([150, 1_000_000], 5, 8, 8);
        batching.record_batch([99], 2, 2, 8);
        batching.record_batch([100], 12, 12, 8); // above max_batch_size: ran alone
        let mut page = String::new();
        batching.render(&mut page);
        let latency = ":tensorflow:serving:batching_session:queuing_latency";
        let pool = "thread_pool_name=\"\"";
        // 99 µs is below the first bound, 100 is in [100, 120), 150 in [144, 172.8).
        assert!(page.contains(&format!("{latency}_bucket{{{pool},le=\"100\"}} 1\n")));
        assert!(page.contains(&format!("{latency}_bucket{{{pool},le=\"120\"}} 2\n")));
        assert!(page.contains(&format!("{latency}_bucket{{{pool},le=\"144\"}} 2\n")));
        assert!(page.contains(&format!("{latency}_bucket{{{pool},le=\"172.8\"}} 3\n")));
        assert!(page.contains(&format!("{latency}_bucket{{{pool},le=\"+Inf\"}} 4\n")));
        assert!(page.contains(&format!("{latency}_sum{{{pool}}} 1000349\n")));
        assert_eq!(page.matches(&format!("{latency}_bucket")).count(), 53);
        assert!(page.contains(":tensorflow:serving:batching_session:wrapped_run_count{} 3\n"));
        let input = ":tensorflow:serving:batching_session:input_batch_size";
        assert!(page.contains(&format!("{input}_bucket{{le=\"2\"}} 0\n")));
        assert!(page.contains(&format!("{input}_bucket{{le=\"4\"}} 4\n")));
        assert!(page.contains(&format!("{input}_sum{{}} 10\n{input}_count{{}} 4\n")));
        assert_eq!(page.matches(&format!("{input}_bucket")).count(), 15);
        let processed = ":tensorflow:serving:batching_session:processed_batch_size";
        assert!(page.contains(&format!(
            "{processed}_sum{{}} 22\n{processed}_count{{}} 3\n"
        )));
        let padding = ":tensorflow:serving:batching_session:padding_size";
        assert!(page.contains(&format!("{padding}_sum{{execution_batch_size=\"8\"}} 3\n")));
        assert!(page.contains(&format!(
            "{padding}_bucket{{execution_batch_size=\"2\",le=\"1\"}} 1\n"
        )));
        assert!(!page.contains("execution_batch_size=\"12\""));
        assert_eq!(page.matches(&format!("# TYPE {padding} ")).count(), 1);
    }

    #[test]
    fn loads_are_counted_per_version_folder_and_dropped_with_the_version() {
        let loads = LoadMetrics::default();
        let mut page = String::new();
        loads.render(&mut page);
        assert_eq!(
            page,
            "# TYPE :tensorflow:cc:saved_model:load_attempt_count counter\n\
             # TYPE :tensorflow:cc:saved_model:load_latency counter\n"
        );
        let v1 = servable(0, 1);
        loads.record(v1, "/models/a/1", 2_000_000);
        loads.record(v1, "/models/a/1", 1_500_000); // a second worker of that version
        let mut page = String::new();
        loads.render(&mut page);
        assert!(page.contains(
            ":tensorflow:cc:saved_model:load_attempt_count{model_path=\"/models/a/1\",\
             status=\"success\"} 2\n"
        ));
        assert!(page.contains(
            ":tensorflow:cc:saved_model:load_latency{model_path=\"/models/a/1\"} 3500000\n"
        ));
        assert!(!page.contains("status=\"fail\""), "no failure: no series");
        // Failed attempts, as the controller counts them: a version that never loaded has a
        // fail series and no success series; a count sent again, or an older one, adds none.
        let v2 = servable(0, 2);
        loads.record_failures(v2, "/models/a/2", 2);
        loads.record_failures(v2, "/models/a/2", 2);
        loads.record_failures(v2, "/models/a/2", 1);
        let mut page = String::new();
        loads.render(&mut page);
        assert!(page.contains(
            ":tensorflow:cc:saved_model:load_attempt_count{model_path=\"/models/a/2\",\
             status=\"fail\"} 2\n"
        ));
        assert!(!page.contains("model_path=\"/models/a/2\",status=\"success\""));
        loads.keep_versions_of(0, &BTreeSet::from([2]));
        let mut page = String::new();
        loads.render(&mut page);
        assert!(!page.contains("/models/a/1"));
        assert!(page.contains("/models/a/2"));
    }

    #[test]
    fn a_folder_two_models_load_keeps_its_series_while_either_lists_it() {
        let loads = LoadMetrics::default();
        let a = servable(0, 1);
        let b = servable(1, 1);
        loads.record(a, "/models/shared/1", 10);
        loads.record(b, "/models/shared/1", 20);
        let page = || {
            let mut page = String::new();
            loads.render(&mut page);
            page
        };
        let latency =
            ":tensorflow:cc:saved_model:load_latency{model_path=\"/models/shared/1\"} 30\n";
        assert!(page().contains(latency), "{}", page());
        // The model that made the series removed, then its version retired: the other
        // model still lists the folder, and its counts stay.
        loads.keep_models(&BTreeSet::from([1]));
        assert!(page().contains(latency), "{}", page());
        loads.keep_versions_of(0, &BTreeSet::new());
        assert!(page().contains(latency), "{}", page());
        loads.keep_versions_of(1, &BTreeSet::from([2]));
        assert!(!page().contains("/models/shared/1"), "{}", page());
    }

    #[test]
    fn warmup_is_typed_from_the_start_and_kept_per_version_folder() {
        let warmup = WarmupMetrics::default();
        let mut page = String::new();
        warmup.render(&mut page);
        assert_eq!(
            page,
            "# TYPE :tensorflow:serving:model_warmup_latency histogram\n\
             # TYPE :tensorflow:serving:model_warmup_records_read counter\n"
        );
        let a1 = servable(0, 1);
        let b2 = servable(1, 2);
        warmup.record(a1, "/models/a/1", 250_000, 3);
        warmup.record(a1, "/models/a/1", 20, 3); // a second worker of that version
        warmup.record(b2, "/models/\"b\"/2", 5, 1);
        let mut page = String::new();
        warmup.render(&mut page);
        let labels = "model_path=\"/models/a/1\",status=\"OK\"";
        let name = ":tensorflow:serving:model_warmup_latency";
        assert!(
            page.contains(&format!("{name}_count{{{labels}}} 2\n")),
            "{page}"
        );
        assert!(
            page.contains(&format!("{name}_sum{{{labels}}} 250020\n")),
            "{page}"
        );
        // ×1.8 from 10 µs: 20 µs falls in the bucket that ends at 32.4.
        assert!(page.contains(&format!("{name}_bucket{{{labels},le=\"32.4\"}} 1\n")));
        let read = ":tensorflow:serving:model_warmup_records_read";
        assert!(page.contains(&format!("{read}{{{labels}}} 6\n")), "{page}");
        assert!(page.contains(&format!(
            "{read}{{model_path=\"/models/\\\"b\\\"/2\",status=\"OK\"}} 1\n"
        )));
        // Model 0's version 1 is no longer listed (retired long ago): its series go; model
        // 1's are not its business.
        warmup.keep_versions_of(0, &BTreeSet::from([2, 3]));
        let mut page = String::new();
        warmup.render(&mut page);
        assert!(!page.contains("/models/a/1"), "{page}");
        assert!(page.contains(&format!(
            "{read}{{model_path=\"/models/\\\"b\\\"/2\",status=\"OK\"}} 1\n"
        )));
    }

    #[test]
    fn a_model_added_while_serving_gets_its_series() {
        use crate::config::ModelEntry;

        let models = Models::configured(&[ModelEntry::new("wdl", 1)]).unwrap();
        let (tx, rx) = watch::channel(Arc::new(models.clone()));
        let metrics = TfServingMetrics::following(rx);
        let mut grown = models;
        let listed = [ModelEntry::new("wdl", 1), ModelEntry::new("tower", 1)];
        grown.serve(&listed).unwrap();
        tx.send_replace(Arc::new(grown));
        metrics.record_request(1, Api::Predict, Entrypoint::Grpc, Code::Ok, 100);
        metrics.record_request(7, Api::Predict, Entrypoint::Grpc, Code::Ok, 100); // no such id
        let page = metrics.render();
        assert!(page.contains("request_count{model_name=\"tower\",status=\"OK\"} 1\n"));
        assert_eq!(page.matches("status=\"OK\"").count(), 1);
    }

    #[test]
    fn each_model_counts_under_its_name_and_each_family_is_typed_once() {
        let metrics = TfServingMetrics::new(&["wdl".to_string(), "ranker".to_string()]);
        metrics.record_request(0, Api::Predict, Entrypoint::Grpc, Code::Ok, 100);
        metrics.record_request(1, Api::Predict, Entrypoint::Grpc, Code::Ok, 100);
        metrics.record_request(1, Api::Predict, Entrypoint::Grpc, Code::NotFound, 5);
        metrics.record_request(7, Api::Predict, Entrypoint::Grpc, Code::Ok, 5); // no such model
        let page = metrics.render();
        let count = ":tensorflow:serving:request_count";
        assert!(page.contains(&format!("{count}{{model_name=\"wdl\",status=\"OK\"}} 1\n")));
        assert!(page.contains(&format!(
            "{count}{{model_name=\"ranker\",status=\"OK\"}} 1\n"
        )));
        assert!(page.contains(&format!(
            "{count}{{model_name=\"ranker\",status=\"NOT_FOUND\"}} 1\n"
        )));
        assert_eq!(page.matches(&format!("# TYPE {count} counter")).count(), 1);
        assert_eq!(
            page.matches("# TYPE :tensorflow:serving:request_latency ")
                .count(),
            1
        );
        assert_eq!(page.matches("request_latency_count{").count(), 2);
    }
}
