//! `mpspool-router --run-dir DIR`: mpspool's front door. Speaks TensorFlow Serving's gRPC API
//! (PredictionService, ModelService, grpc.health.v1) and Prometheus metrics, checks each
//! request against the model's signature, and runs it on one of the pool's Python workers
//! over ZeroMQ (`mpspool/wire.py`). No Python runs per request. Started and stopped by the
//! pool's supervisord; configured by the pool's `pool.json`; watched by the controller over
//! the control channel.

mod answer_body;
mod batch;
mod codec;
mod config;
mod connection_limit;
mod control;
mod decode_budget;
mod dispatch;
mod grpc;
mod grpc_headers;
mod hpack;
mod inference;
mod json_nonfinite;
mod json_tensor;
mod lifespan;
mod listen;
mod log;
mod metrics;
mod peer_uid;
mod policies;
mod preface;
mod proto;
mod reload;
mod request_body;
mod request_budget;
mod rest;
mod rest_conn;
mod server;
mod signature;
mod split;
mod state;
mod status;
mod tfs_metrics;
mod timeline;
mod tls;
mod uds_authority;
mod versions;
mod wire;
mod workers;
mod zmtp;

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use crate::config::{seconds, Config};
use crate::dispatch::Dispatcher;
use crate::state::{DrainRequest, RouterState};

/// Reserved exit codes and the fatal-reason marker of mpspool/process.py: the controller tells
/// "cannot start, stop retrying" from a crash worth a restart, and shows the reason.
const EXIT_CONFIG_ERROR: u8 = 3;
const FATAL_MARKER: &str = "MPSPOOL-FATAL: ";

fn fail(reason: impl std::fmt::Display) -> ExitCode {
    eprintln!("{FATAL_MARKER}{reason}");
    ExitCode::from(EXIT_CONFIG_ERROR)
}

fn run_dir_argument() -> Result<PathBuf, String> {
    let mut args = std::env::args().skip(1);
    let mut run_dir = None;
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--run-dir" => run_dir = args.next(),
            other => match other.strip_prefix("--run-dir=") {
                Some(value) => run_dir = Some(value.to_string()),
                None => {
                    return Err(format!(
                        "unknown argument {other:?}; usage: mpspool-router --run-dir DIR"
                    ))
                }
            },
        }
    }
    run_dir
        .map(PathBuf::from)
        .ok_or_else(|| "usage: mpspool-router --run-dir DIR".to_string())
}

/// Ask Linux to kill this process when its parent (supervisord) exits, so no front door
/// outlives a killed pool (what process.die_with_parent() does for the Python processes).
fn die_with_parent() {
    // SAFETY: prctl with PR_SET_PDEATHSIG takes a signal number and no pointers.
    unsafe {
        libc::prctl(
            libc::PR_SET_PDEATHSIG,
            libc::SIGKILL as libc::c_ulong,
            0,
            0,
            0,
        );
    }
}

/// Keep freed message buffers for the next request instead of giving them back to the kernel.
///
/// The allocator: mimalloc rather than glibc's malloc. A batch-1 request allocates and frees
/// a few dozen small blocks (h2's frames and header maps, prost's messages, the wire
/// encoding): glibc's malloc and free were 4% of the front door's CPU at concurrency 1
/// (`perf record`), and with mimalloc its CPU per batch-1 request was 0.91-1.01x glibc's
/// (bench/RESULTS.md, "The front door's wake-ups and allocator"). Freed memory stays in
/// mimalloc's segments for reuse, so a large request's buffers are not mapped and zero-filled
/// afresh each time, which glibc did from 128 KiB up until the front door raised its
/// thresholds with mallopt ("The front door's freed buffers"); 237 KiB echoes cost no more.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// `MPSPOOL_ROUTER_THREADS`: the async runtime's worker threads (default: one per core).
/// One means tokio's current-thread runtime: every task on the thread that started it. A
/// multi-thread runtime of one worker is two threads (the main thread polls `serve` while the
/// worker polls the tasks) with work-stealing's bookkeeping on every wake-up, for nothing.
fn runtime_threads() -> Option<usize> {
    let value = std::env::var("MPSPOOL_ROUTER_THREADS").ok()?;
    value.parse().ok().filter(|n| *n >= 1)
}

fn main() -> ExitCode {
    die_with_parent();
    let run_dir = match run_dir_argument() {
        Ok(run_dir) => run_dir,
        Err(usage) => return fail(usage),
    };
    let config = match Config::load(&run_dir) {
        Ok(config) => config,
        Err(error) => return fail(error),
    };
    let mut builder = match runtime_threads() {
        Some(1) => tokio::runtime::Builder::new_current_thread(),
        Some(threads) => {
            let mut builder = tokio::runtime::Builder::new_multi_thread();
            builder.worker_threads(threads);
            builder
        }
        None => tokio::runtime::Builder::new_multi_thread(),
    };
    let runtime = match builder.enable_all().build() {
        Ok(runtime) => runtime,
        Err(error) => return fail(format!("cannot start the async runtime: {error}")),
    };
    runtime.block_on(serve(config))
}

/// `--max-connections`, held under what this process's descriptors allow (its soft limit
/// raised to the hard one first), logged when that is less than asked.
fn connections_allowed(config: &Config) -> usize {
    let descriptors = match connection_limit::raise_descriptor_limit() {
        Ok(descriptors) => descriptors,
        Err(error) => {
            log_warn!("cannot read the limit on open files: {error}");
            // 0 asked for the descriptors' limit alone, and it is not known.
            return match config.max_connections {
                0 => usize::MAX,
                wanted => wanted,
            };
        }
    };
    let open = connection_limit::open_descriptors().unwrap_or(64);
    let allowed = connection_limit::connections_allowed(config.max_connections, descriptors, open);
    if config.max_connections == 0 || allowed < config.max_connections {
        log_info!(
            "client connections: at most {allowed} at once (--max-connections {}; {descriptors} \
             open files allowed, {open} open, {} kept for workers and the rest)",
            config.max_connections,
            connection_limit::RESERVED_DESCRIPTORS
        );
    }
    allowed
}

async fn serve(config: Config) -> ExitCode {
    let (state, drains) = RouterState::new();
    let state = Arc::new(state);
    let durations = (
        seconds("worker_timeout_s", config.worker_timeout_s),
        seconds("shutdown_delay_s", config.shutdown_delay_s),
        seconds("drain_timeout_s", config.drain_timeout_s),
        config.lifespan(),
        seconds("request_read_timeout_s", config.request_read_timeout_s),
    );
    let (Ok(worker_timeout), Ok(delay), Ok(grace), Ok(lifespan), Ok(read_timeout)) = durations
    else {
        return fail("pool.json holds a negative duration"); // Config::parse refuses these
    };
    let scheduling = config.scheduling();
    let models = config.served_models();
    let dispatcher = match Dispatcher::start(
        &config.run_dir,
        &models,
        worker_timeout,
        &scheduling,
        state.clone(),
    ) {
        Ok(dispatcher) => dispatcher,
        Err(error) => return fail(error),
    };
    let listener = match listen::bind(&config.host, config.port).await {
        Ok(listener) => listener,
        Err(error) => {
            return fail(format!(
                "cannot listen on {}:{}: {error}",
                config.host, config.port
            ))
        }
    };
    let port = listener
        .local_addr()
        .map(|a| a.port())
        .unwrap_or(config.port);
    let unix = if config.grpc_socket_path.is_empty() {
        None
    } else {
        match server::UnixSocket::bind(std::path::Path::new(&config.grpc_socket_path)) {
            Ok(socket) => {
                log_info!("gRPC also on the UNIX socket {}", config.grpc_socket_path);
                Some(socket)
            }
            Err(error) => return fail(error),
        }
    };
    server::record_port(&state, port);
    let connections = connection_limit::ConnectionLimit::new(connections_allowed(&config));
    // One budget for every request's memory, gRPC and REST alike (request_budget).
    let request_memory = Arc::new(request_budget::RequestBudget::new(
        request_budget::budget_bytes(config.max_message_bytes),
    ));
    let metrics = Arc::new(metrics::Metrics::new(
        dispatcher.models(),
        dispatcher.ready_workers(),
        dispatcher.copied_weights(),
        state.clone(),
        request_memory.clone(),
        connections.clone(),
    ));
    if let Ok(metrics_port) = u16::try_from(config.metrics_port) {
        let bound = metrics::serve(metrics.clone(), &config.host, metrics_port).await;
        state.metrics_port.store(bound, Ordering::Relaxed);
    }
    let api = grpc::Api {
        dispatcher,
        metrics,
        tensor_content_outputs: config.serialize_as_tensor_content,
        method_name_check: config.signature_method_name_check,
        state: state.clone(),
    };
    let tls = match config.tls.as_ref().map(tls::acceptor).transpose() {
        Ok(tls) => tls,
        Err(error) => return fail(format!("--ssl_config_file: {error}")),
    };
    let limits = server::Limits {
        tls,
        max_message_bytes: config.max_message_bytes,
        request_memory: request_memory.clone(),
        lifespan,
        request_read_timeout: (!read_timeout.is_zero()).then_some(read_timeout),
        connections,
    };
    let rest = match u16::try_from(config.rest_api_port) {
        Err(_) => None, // -1: off
        Ok(rest_port) => {
            let listener = match listen::bind(&config.host, rest_port).await {
                Ok(listener) => listener,
                Err(error) => {
                    return fail(format!(
                        "cannot listen on {}:{rest_port} (REST API): {error}",
                        config.host
                    ))
                }
            };
            let bound = listener.local_addr().map(|a| a.port()).unwrap_or(rest_port);
            state.rest_port.store(bound, Ordering::Relaxed);
            log_info!("REST API on http://{}:{bound}/v1/models", config.host);
            let timeout = std::time::Duration::from_millis(config.rest_api_timeout_ms);
            let handler = rest::Rest::new(
                api.clone(),
                config.max_message_bytes,
                request_body::Reading {
                    budget: request_memory,
                    stall: limits.request_read_timeout,
                },
                (!timeout.is_zero()).then_some(timeout),
                (!config.prometheus_path.is_empty()).then(|| config.prometheus_path.clone()),
                config.rest_api_enable_cors_support,
            );
            Some((listener, Arc::new(handler)))
        }
    };
    log_info!(
        "listening on {}:{port}{}",
        config.host,
        if config.tls.is_some() { " (TLS)" } else { "" }
    );
    server::Server::new(listener, unix, rest, api, limits, state)
        .run(DrainRequest { delay, grace }, drains)
        .await;
    log_info!("stopped");
    ExitCode::SUCCESS
}
