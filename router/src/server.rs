//! The gRPC listener and the front door's lifecycle.
//!
//! One accept loop spawns a task per connection (HTTP/2, hyper), each holding a clone of a
//! `watch` shutdown signal and an `mpsc` sender it drops when done, so "every connection has
//! finished" is the receiver returning None (tokio's mini-redis pattern). A connection older
//! than `max_connection_age` is ended gracefully (GOAWAY; its calls get the same again to
//! finish), so clients balancing over several pods find new ones.
//!
//! Phases, one writer (`set_phase`): SERVING → DRAINING (health NOT_SERVING, still answering
//! for `delay` so load balancers notice; then no new connections, in-flight calls get
//! `grace`) → STOPPED. A signal ends the process after the drain; a drain the controller asked
//! for leaves it STOPPED until the controller stops it.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};
use tonic_health::server::HealthReporter;
use tonic_health::ServingStatus;

use crate::grpc::Api;
use crate::proto::tensorflow::serving::model_service_server::ModelServiceServer;
use crate::proto::tensorflow::serving::prediction_service_server::{
    PredictionServiceServer, SERVICE_NAME,
};
use crate::state::{DrainRequest, Phase, RouterState};
use crate::{log_info, log_warn};

const STREAM_WINDOW: u32 = 4 << 20;
const CONNECTION_WINDOW: u32 = 16 << 20;
const MAX_FRAME: u32 = 1 << 20;

pub struct Limits {
    pub max_message_bytes: usize,
    /// None: connections live as long as their clients keep them.
    pub max_connection_age: Option<Duration>,
}

/// Why the server is draining.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Cause {
    Signal,
    Controller,
}

pub struct Server {
    listener: TcpListener,
    api: Api,
    max_connection_age: Option<Duration>,
    state: Arc<RouterState>,
    health: HealthReporter,
    routes: tonic::service::Routes,
}

impl Server {
    pub fn new(listener: TcpListener, api: Api, limits: Limits, state: Arc<RouterState>) -> Server {
        let (health, health_service) = tonic_health::server::health_reporter();
        let routes = tonic::service::Routes::new(
            PredictionServiceServer::new(api.clone())
                .max_decoding_message_size(limits.max_message_bytes)
                .max_encoding_message_size(limits.max_message_bytes),
        )
        .add_service(
            ModelServiceServer::new(api.clone())
                .max_decoding_message_size(limits.max_message_bytes)
                .max_encoding_message_size(limits.max_message_bytes),
        )
        .add_service(health_service)
        .prepare();
        Server {
            listener,
            api,
            max_connection_age: limits.max_connection_age,
            state,
            health,
            routes,
        }
    }

    /// Serve until a signal (then drain and return) or a controller's drain (then drain and
    /// wait for a signal to return).
    pub async fn run(
        self,
        default_drain: DrainRequest,
        mut drains: mpsc::UnboundedReceiver<DrainRequest>,
    ) {
        let Server {
            listener,
            api,
            max_connection_age,
            state,
            health,
            routes,
        } = self;
        let mut terminate =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(signal) => Some(signal),
                Err(error) => {
                    log_warn!("cannot watch SIGTERM: {error}");
                    None
                }
            };
        let mut interrupt =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt()).ok();
        let health_task = tokio::spawn(follow_health(
            health,
            api.dispatcher.ready_workers(),
            state.phase.subscribe(),
        ));
        let (shutdown_tx, shutdown_rx) = watch::channel(false);
        let (done_tx, mut done_rx) = mpsc::channel::<()>(1);

        let (drain, cause) = loop {
            tokio::select! {
                accepted = listener.accept() => {
                    let (stream, _) = match accepted {
                        Ok(accepted) => accepted,
                        Err(error) => {
                            // EMFILE and friends: back off a little rather than spin.
                            log_warn!("accept failed: {error}");
                            tokio::time::sleep(Duration::from_millis(50)).await;
                            continue;
                        }
                    };
                    let _ = stream.set_nodelay(true);
                    let service = TowerToHyperService::new(routes.clone());
                    tokio::spawn(serve_connection(
                        stream,
                        service,
                        max_connection_age,
                        shutdown_rx.clone(),
                        done_tx.clone(),
                    ));
                }
                request = drains.recv() => {
                    if let Some(request) = request {
                        break (request, Cause::Controller);
                    }
                }
                _ = recv_signal(&mut terminate) => break (default_drain, Cause::Signal),
                _ = recv_signal(&mut interrupt) => break (default_drain, Cause::Signal),
            }
        };
        log_info!(
            "draining ({cause:?}): delay {:?}, grace {:?}",
            drain.delay,
            drain.grace
        );
        set_phase(&state, Phase::Draining);
        // Keep answering (new connections too) while load balancers notice NOT_SERVING.
        let until = tokio::time::Instant::now() + drain.delay;
        loop {
            tokio::select! {
                _ = tokio::time::sleep_until(until) => break,
                accepted = listener.accept() => {
                    if let Ok((stream, _)) = accepted {
                        let _ = stream.set_nodelay(true);
                        let service = TowerToHyperService::new(routes.clone());
                        tokio::spawn(serve_connection(stream, service, max_connection_age, shutdown_rx.clone(), done_tx.clone()));
                    }
                }
            }
        }
        drop(listener); // no new connections
        let _ = shutdown_tx.send(true);
        drop(done_tx);
        if tokio::time::timeout(drain.grace, done_rx.recv())
            .await
            .is_err()
        {
            log_warn!(
                "in-flight calls still running after {:?}: closing",
                drain.grace
            );
        }
        set_phase(&state, Phase::Stopped);
        if cause == Cause::Controller {
            // The controller stops this program through supervisord once the workers are down.
            tokio::select! {
                _ = recv_signal(&mut terminate) => {}
                _ = recv_signal(&mut interrupt) => {}
            }
        }
        health_task.abort();
        api.dispatcher.shutdown();
    }
}

fn set_phase(state: &RouterState, phase: Phase) {
    let old = state.phase.send_replace(phase);
    if old != phase {
        log_info!("phase {} -> {}", old.name(), phase.name());
    }
}

async fn recv_signal(signal: &mut Option<tokio::signal::unix::Signal>) {
    match signal {
        Some(signal) => {
            signal.recv().await;
        }
        None => std::future::pending().await,
    }
}

async fn serve_connection<S>(
    stream: tokio::net::TcpStream,
    service: S,
    max_age: Option<Duration>,
    mut shutdown: watch::Receiver<bool>,
    _done: mpsc::Sender<()>,
) where
    S: hyper::service::Service<
            http::Request<hyper::body::Incoming>,
            Response = http::Response<tonic::body::Body>,
        > + Send
        + 'static,
    S::Future: Send + 'static,
    S::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let mut builder = hyper::server::conn::http2::Builder::new(TokioExecutor::new());
    builder.timer(hyper_util::rt::TokioTimer::new());
    // HTTP/2's default 64 KiB windows make a batch-256 request (~46 KiB) cost a
    // WINDOW_UPDATE round per call; tensors are what this server receives, so open them wide.
    builder
        .initial_stream_window_size(STREAM_WINDOW)
        .initial_connection_window_size(CONNECTION_WINDOW)
        .max_frame_size(MAX_FRAME);
    let connection = builder.serve_connection(TokioIo::new(stream), service);
    tokio::pin!(connection);
    let aged = async {
        match max_age {
            Some(age) => tokio::time::sleep(age).await,
            None => std::future::pending().await,
        }
    };
    tokio::pin!(aged);
    let mut ending = false;
    loop {
        tokio::select! {
            _ = &mut connection => return,
            _ = &mut aged, if !ending => {
                connection.as_mut().graceful_shutdown();
                // The calls under way get the same age again to finish, then the connection goes.
                if let Some(age) = max_age {
                    let _ = tokio::time::timeout(age, &mut connection).await;
                }
                return;
            }
            changed = shutdown.changed(), if !ending => {
                if changed.is_err() || *shutdown.borrow() {
                    ending = true;
                    connection.as_mut().graceful_shutdown();
                }
            }
        }
    }
}

/// Health is SERVING only while the phase is SERVING and at least one worker is READY, for
/// "" and for TF Serving's PredictionService.
async fn follow_health(
    reporter: HealthReporter,
    mut ready: watch::Receiver<usize>,
    mut phase: watch::Receiver<Phase>,
) {
    let mut last = None;
    loop {
        let serving =
            *phase.borrow_and_update() == Phase::Serving && *ready.borrow_and_update() > 0;
        if last != Some(serving) {
            let status = if serving {
                ServingStatus::Serving
            } else {
                ServingStatus::NotServing
            };
            for service in ["", SERVICE_NAME] {
                reporter.set_service_status(service, status).await;
            }
            last = Some(serving);
        }
        tokio::select! {
            changed = ready.changed() => if changed.is_err() { return },
            changed = phase.changed() => if changed.is_err() { return },
        }
    }
}

/// The ports for the controller's snapshot.
pub fn record_port(state: &RouterState, port: u16) {
    state.grpc_port.store(port, Ordering::Relaxed);
}
