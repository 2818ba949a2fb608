//! The front door's part of the pool's one validated configuration: `pool.json` in the run
//! directory, written by `mpspool start` (mpspool/config.py, PoolConfig). Only the fields the
//! front door reads; the rest are ignored.

use std::path::Path;
use std::time::Duration;

use serde::Deserialize;

use crate::batch::Batching;
use crate::lifespan::Lifespan;
use crate::policies::Scheduling;

pub const POOL_FILE: &str = "pool.json";

/// One model of a pool that serves several (`models` in pool.json).
#[derive(Clone, Debug, Deserialize, PartialEq)]
pub struct ModelEntry {
    pub name: String,
    /// The version it serves until the controller lists versions.
    pub version: i64,
}

impl ModelEntry {
    pub fn new(name: &str, version: i64) -> ModelEntry {
        ModelEntry {
            name: name.to_string(),
            version,
        }
    }
}

#[derive(Clone, Debug, Deserialize)]
pub struct Config {
    /// The pool's model (the first, when `models` lists several).
    pub model_name: String,
    pub model_version: i64,
    /// Every model the pool serves, in order (a model's place is its id); absent or empty:
    /// the one model of `model_name` and `model_version`.
    #[serde(default)]
    pub models: Vec<ModelEntry>,
    pub run_dir: String,
    #[serde(default = "default_host")]
    pub host: String,
    #[serde(default = "default_port")]
    pub port: u16,
    /// 0 picks a free port, -1 turns metrics off.
    #[serde(default = "default_metrics_port")]
    pub metrics_port: i32,
    /// TF Serving's REST API; 0 picks a free port, -1 turns it off.
    #[serde(default = "default_rest_api_port")]
    pub rest_api_port: i32,
    /// TF Serving's `--rest_api_timeout_in_ms`: a REST Predict's deadline (0: none).
    #[serde(default = "default_rest_api_timeout_ms")]
    pub rest_api_timeout_ms: u64,
    /// TF Serving's `--rest_api_enable_cors_support`: CORS headers on every REST answer.
    #[serde(default)]
    pub rest_api_enable_cors_support: bool,
    /// Predict outputs in `tensor_content` rather than the typed fields (TF Serving's
    /// `--enable_serialization_as_tensor_content`).
    #[serde(default)]
    pub serialize_as_tensor_content: bool,
    /// TLS on the gRPC port (TF Serving's --ssl_config_file, PEM inline); None: plaintext.
    #[serde(default)]
    pub tls: Option<crate::tls::TlsConfig>,
    /// The path of TF Serving's metrics on the REST port ("" when its monitoring config does
    /// not turn them on).
    #[serde(default)]
    pub prometheus_path: String,
    /// Classify/Regress/MultiInference check the signature's method name (TF Serving's
    /// `--enable_signature_method_name_check`).
    #[serde(default)]
    pub signature_method_name_check: bool,
    #[serde(default)]
    pub max_connection_age_s: f64,
    /// How long calls under way get after the age's GOAWAY (gRPC's
    /// max_connection_age_grace); absent: the age again.
    #[serde(default)]
    pub max_connection_age_grace_s: Option<f64>,
    /// `--max-connection-idle`: a gRPC connection without a call this long is ended (0: never).
    #[serde(default)]
    pub max_connection_idle_s: f64,
    /// An HTTP/2 PING on a gRPC connection silent this long (gRPC's keepalive_time; 0: not
    /// set), to be answered within `keepalive_timeout_s` (0: not set); lifespan.rs.
    #[serde(default)]
    pub keepalive_time_s: f64,
    #[serde(default)]
    pub keepalive_timeout_s: f64,
    /// Calls at once on one gRPC connection (0: hyper's 200).
    #[serde(default)]
    pub max_concurrent_streams: u32,
    /// `--max-connections`: client connections open at once, gRPC and REST together (0: as
    /// many as the descriptors allow); connection_limit.rs.
    #[serde(default = "default_max_connections")]
    pub max_connections: usize,
    /// TF Serving's `--grpc_socket_path`: gRPC on this UNIX socket as well (an absolute path;
    /// empty: none).
    #[serde(default)]
    pub grpc_socket_path: String,
    #[serde(default = "default_worker_timeout")]
    pub worker_timeout_s: f64,
    /// `--request-read-timeout`: how long a request may send nothing while the front door
    /// waits for more of it, its body (request_body) or a REST request's header, and how long
    /// a gRPC answer may wait without moving (its client taking none of it) before its
    /// connection is closed (answer_body) (0: for ever).
    #[serde(default = "default_request_read_timeout")]
    pub request_read_timeout_s: f64,
    #[serde(default = "default_shutdown_delay")]
    pub shutdown_delay_s: f64,
    #[serde(default = "default_drain_timeout")]
    pub drain_timeout_s: f64,
    #[serde(default = "default_max_message")]
    pub max_message_bytes: usize,
    #[serde(default = "default_dispatch")]
    pub dispatch: String,
    /// The front door's queue order when workers are full (`--queue`).
    #[serde(default = "default_queue")]
    pub queue: String,
    /// `--aging-bound-ms`: the longest a request should wait in the front door while shorter
    /// ones overtake it (policies/shortest_first.rs says how it is kept).
    #[serde(default = "default_aging_bound_ms")]
    pub aging_bound_ms: f64,
    /// `--worker-inflight`: requests a worker may hold before new ones wait in the front door
    /// (0: no limit).
    #[serde(default)]
    pub worker_inflight: usize,
    /// `--split-rows` (0: off).
    #[serde(default)]
    pub split_rows: u64,
    /// `--enable-batching` and TF Serving's batching parameters (`--batching-parameters-file`,
    /// read by mpspool/config.py).
    #[serde(default)]
    pub batching: bool,
    /// TF Serving's `--enable_per_model_batching_parameters` (with `batching`): each version
    /// is batched by its own `batching_params.pbtxt`, which the controller sends with the
    /// version table, and not at all without one; the fields below are then not used.
    #[serde(default)]
    pub per_model_batching: bool,
    #[serde(default = "default_max_batch_size")]
    pub max_batch_size: u64,
    #[serde(default)]
    pub batch_timeout_micros: u64,
    #[serde(default)]
    pub allowed_batch_sizes: Vec<u64>,
    #[serde(default = "default_max_enqueued_batches")]
    pub max_enqueued_batches: u64,
}

fn default_host() -> String {
    "127.0.0.1".to_string()
}
fn default_port() -> u16 {
    8500
}
fn default_metrics_port() -> i32 {
    8502
}
fn default_rest_api_port() -> i32 {
    8501
}
fn default_rest_api_timeout_ms() -> u64 {
    30_000
}
fn default_max_connections() -> usize {
    1024
}

fn default_worker_timeout() -> f64 {
    3.0
}
fn default_request_read_timeout() -> f64 {
    60.0
}
fn default_shutdown_delay() -> f64 {
    1.0
}
fn default_drain_timeout() -> f64 {
    10.0
}
fn default_max_message() -> usize {
    512 * 1024 * 1024
}
fn default_dispatch() -> String {
    "round-robin".to_string()
}
fn default_max_batch_size() -> u64 {
    Batching::default().max_batch_size
}
fn default_max_enqueued_batches() -> u64 {
    Batching::default().max_enqueued_batches
}
fn default_queue() -> String {
    "fcfs".to_string()
}
fn default_aging_bound_ms() -> f64 {
    50.0
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("{path} is not a pool configuration: {source}")]
    Parse {
        path: String,
        source: serde_json::Error,
    },
    #[error("{0}")]
    Invalid(String),
}

/// The longest time a setting may name (2^31 - 1 s, about 68 years), as the pool's own
/// check (`mpspool/config.py`, MAX_SECONDS): far from where a clock reading plus it
/// overflows (`Instant + 1e19 s` panicked on every connection; found by a hunt).
pub const MAX_SECONDS: f64 = 2_147_483_647.0;

/// `value` seconds as a Duration when it is finite and in [0, MAX_SECONDS]; None otherwise.
pub fn bounded_seconds(value: f64) -> Option<Duration> {
    (value <= MAX_SECONDS)
        .then(|| Duration::try_from_secs_f64(value).ok())
        .flatten()
}

/// Seconds from the configuration as a Duration; negative, non-finite or past MAX_SECONDS
/// values are refused.
pub fn seconds(name: &str, value: f64) -> Result<Duration, ConfigError> {
    bounded_seconds(value).ok_or_else(|| {
        ConfigError::Invalid(format!(
            "{name} must be seconds in [0, {MAX_SECONDS:e}], got {value}"
        ))
    })
}

impl Config {
    /// The models the front door serves, in order: `models`, or the one model.
    pub fn served_models(&self) -> Vec<ModelEntry> {
        if self.models.is_empty() {
            return vec![ModelEntry::new(&self.model_name, self.model_version)];
        }
        self.models.clone()
    }

    /// How gRPC connections live and are kept (lifespan); 0 s: not set.
    pub fn lifespan(&self) -> Result<Lifespan, ConfigError> {
        let set = |name: &str, value: f64| -> Result<Option<Duration>, ConfigError> {
            seconds(name, value).map(|duration| (!duration.is_zero()).then_some(duration))
        };
        Ok(Lifespan {
            max_age: set("max_connection_age_s", self.max_connection_age_s)?,
            age_grace: self
                .max_connection_age_grace_s
                .map(|grace| seconds("max_connection_age_grace_s", grace))
                .transpose()?,
            max_idle: set("max_connection_idle_s", self.max_connection_idle_s)?,
            keepalive_time: set("keepalive_time_s", self.keepalive_time_s)?,
            keepalive_timeout: set("keepalive_timeout_s", self.keepalive_timeout_s)?,
            max_concurrent_streams: (self.max_concurrent_streams > 0)
                .then_some(self.max_concurrent_streams),
        })
    }

    /// The scheduling settings. The queue order and batching only apply to requests that
    /// wait in the front door, so without a `worker_inflight` limit both get a limit of 1:
    /// every request that is not computing waits here, where it can be ordered or merged
    /// (bench/RESULTS.md: with 2, one request waiting in each worker's socket, SJF's small
    /// requests did worse than FCFS's on 2 cores; with 1, better).
    pub fn scheduling(&self) -> Scheduling {
        let worker_inflight = match (self.batching, self.queue.as_str(), self.worker_inflight) {
            (_, _, limit) if limit > 0 => limit,
            (true, _, _) | (false, "sjf", _) => 1,
            _ => 0,
        };
        let per_model_batching = self.batching && self.per_model_batching;
        let batching = (self.batching && !per_model_batching).then(|| Batching {
            max_batch_size: self.max_batch_size,
            timeout: Duration::from_micros(self.batch_timeout_micros),
            allowed_batch_sizes: self.allowed_batch_sizes.clone(),
            max_enqueued_batches: self.max_enqueued_batches,
        });
        Scheduling {
            dispatch: self.dispatch.clone(),
            queue: self.queue.clone(),
            aging_bound: Duration::try_from_secs_f64(self.aging_bound_ms / 1000.0)
                .unwrap_or_default(),
            worker_inflight,
            split_rows: self.split_rows,
            batching,
            per_model_batching,
        }
    }

    pub fn load(run_dir: &Path) -> Result<Config, ConfigError> {
        let path = run_dir.join(POOL_FILE);
        let shown = path.display().to_string();
        let text = std::fs::read_to_string(&path).map_err(|source| ConfigError::Read {
            path: shown.clone(),
            source,
        })?;
        Config::parse(&text).map_err(|error| match error {
            ConfigError::Parse { source, .. } => ConfigError::Parse {
                path: shown,
                source,
            },
            other => other,
        })
    }

    pub fn parse(text: &str) -> Result<Config, ConfigError> {
        let config: Config = serde_json::from_str(text).map_err(|source| ConfigError::Parse {
            path: POOL_FILE.to_string(),
            source,
        })?;
        config.lifespan()?;
        for (name, value) in [
            ("worker_timeout_s", config.worker_timeout_s),
            ("request_read_timeout_s", config.request_read_timeout_s),
            ("shutdown_delay_s", config.shutdown_delay_s),
            ("drain_timeout_s", config.drain_timeout_s),
        ] {
            seconds(name, value)?;
        }
        seconds("aging_bound_ms", config.aging_bound_ms / 1000.0)?;
        config.scheduling().check().map_err(ConfigError::Invalid)?;
        let models = config.served_models();
        for (i, model) in models.iter().enumerate() {
            if model.name.is_empty() || models[..i].iter().any(|m| m.name == model.name) {
                return Err(ConfigError::Invalid(format!(
                    "models: each needs a name of its own, not {:?}",
                    model.name
                )));
            }
        }
        Ok(config)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_what_it_needs_and_ignores_the_rest() {
        let config = Config::parse(
            r#"{"model_name": "demo", "model_version": 3, "run_dir": "/r", "port": 0,
                "metrics_port": -1, "workers": 2, "gpus": [], "dispatch": "least-loaded"}"#,
        )
        .unwrap();
        assert_eq!(config.model_name, "demo");
        assert_eq!(config.port, 0);
        assert_eq!(config.metrics_port, -1);
        assert_eq!(config.worker_timeout_s, 3.0);
    }

    #[test]
    fn scheduling_defaults_and_sjf_gets_an_inflight_limit() {
        let base = r#""model_name": "m", "model_version": 1, "run_dir": "/r""#;
        let config = Config::parse(&format!("{{{base}}}")).unwrap();
        assert_eq!(config.scheduling(), Scheduling::default());
        let config = Config::parse(&format!(
            r#"{{{base}, "queue": "sjf", "aging_bound_ms": 20, "dispatch": "power-of-two"}}"#
        ))
        .unwrap();
        let scheduling = config.scheduling();
        assert_eq!(scheduling.worker_inflight, 1);
        assert_eq!(scheduling.aging_bound, Duration::from_millis(20));
        assert_eq!(scheduling.dispatch, "power-of-two");
        let config = Config::parse(&format!(
            r#"{{{base}, "queue": "sjf", "worker_inflight": 3}}"#
        ))
        .unwrap();
        assert_eq!(config.scheduling().worker_inflight, 3);
        for bad in [r#""queue": "lifo""#, r#""aging_bound_ms": -1"#] {
            let error = Config::parse(&format!("{{{base}, {bad}}}")).unwrap_err();
            assert!(matches!(error, ConfigError::Invalid(_)), "{bad}: {error}");
        }
    }

    #[test]
    fn per_model_batching_leaves_the_pools_parameters_unused_and_needs_batching() {
        let base = r#""model_name": "m", "model_version": 1, "run_dir": "/r", "max_batch_size": 8"#;
        let config = Config::parse(&format!(
            r#"{{{base}, "batching": true, "per_model_batching": true}}"#
        ))
        .unwrap();
        let scheduling = config.scheduling();
        assert!(scheduling.per_model_batching);
        assert_eq!(scheduling.batching, None);
        assert_eq!(
            scheduling.worker_inflight, 1,
            "requests wait here to be merged"
        );
        // Without --enable_batching it does nothing, as in TF Serving.
        let config = Config::parse(&format!(r#"{{{base}, "per_model_batching": true}}"#)).unwrap();
        assert_eq!(config.scheduling(), Scheduling::default());
    }

    #[test]
    fn refuses_what_it_cannot_run_with() {
        let bad =
            r#"{"model_name": "m", "model_version": 1, "run_dir": "/r", "drain_timeout_s": -1}"#;
        assert!(Config::parse(bad)
            .unwrap_err()
            .to_string()
            .contains("drain_timeout_s"));
        let bad =
            r#"{"model_name": "m", "model_version": 1, "run_dir": "/r", "dispatch": "random"}"#;
        assert!(Config::parse(bad).is_err());
        assert!(Config::parse("{").is_err());
    }

    #[test]
    fn connection_lifespans_read_zero_as_unset_and_refuse_negatives() {
        let base = r#""model_name": "m", "model_version": 1, "run_dir": "/r""#;
        let plain = Config::parse(&format!("{{{base}}}")).unwrap();
        assert_eq!(plain.lifespan().unwrap(), Lifespan::default());
        let set = Config::parse(&format!(
            r#"{{{base}, "max_connection_age_s": 300, "max_connection_age_grace_s": 0,
                "max_connection_idle_s": 1.5, "keepalive_time_s": 10,
                "keepalive_timeout_s": 0, "max_concurrent_streams": 8}}"#
        ))
        .unwrap();
        let second = Duration::from_secs(1);
        assert_eq!(
            set.lifespan().unwrap(),
            Lifespan {
                max_age: Some(300 * second),
                age_grace: Some(Duration::ZERO),
                max_idle: Some(Duration::from_millis(1500)),
                keepalive_time: Some(10 * second),
                keepalive_timeout: None,
                max_concurrent_streams: Some(8),
            }
        );
        for bad in [
            "max_connection_age_s",
            "max_connection_age_grace_s",
            "max_connection_idle_s",
            "keepalive_time_s",
            "keepalive_timeout_s",
        ] {
            let error = Config::parse(&format!(r#"{{{base}, "{bad}": -1}}"#)).unwrap_err();
            assert!(error.to_string().contains(bad), "{bad}: {error}");
        }
    }

    #[test]
    fn several_models_are_listed_in_order_and_each_named_once() {
        let base = r#""model_name": "wdl", "model_version": 3, "run_dir": "/r""#;
        let one = Config::parse(&format!("{{{base}}}")).unwrap();
        let wdl = ModelEntry::new("wdl", 3);
        assert_eq!(one.served_models(), std::slice::from_ref(&wdl));
        let two = Config::parse(&format!(
            r#"{{{base}, "models": [{{"name": "wdl", "version": 3}},
                {{"name": "ranker", "version": 1}}]}}"#
        ))
        .unwrap();
        let ranker = ModelEntry::new("ranker", 1);
        assert_eq!(two.served_models(), [wdl, ranker]);
        let twice = Config::parse(&format!(
            r#"{{{base}, "models": [{{"name": "wdl", "version": 3}},
                {{"name": "wdl", "version": 1}}]}}"#
        ))
        .unwrap_err();
        assert!(twice.to_string().contains("a name of its own"), "{twice}");
    }
}
