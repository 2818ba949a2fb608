//! The gRPC listener and the front door's lifecycle.
//!
//! One accept loop spawns a task per connection (HTTP/2, hyper), each holding a clone of a
//! `watch` shutdown signal and an `mpsc` sender it drops when done, so "every connection has
//! finished" is the receiver returning None (tokio's mini-redis pattern). A connection past
//! its age or idle too long is ended gracefully (lifespan: gRPC's max_connection_age and
//! max_connection_idle). A connection past `--max-connections` is refused as it comes
//! (connection_limit), and one whose client sends no HTTP/2 preface within the read timeout
//! is closed (preface).
//!
//! Phases, one writer (`set_phase`): SERVING → DRAINING (health NOT_SERVING, still answering
//! for `delay` so load balancers notice; then no new connections, in-flight calls get
//! `grace`, then their connections are closed) → STOPPED. A signal ends the process after the
//! drain; a drain the controller asked for leaves it STOPPED until the controller stops it.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use http_body_util::BodyExt;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};
use tonic::codec::CompressionEncoding;
use tonic_health::server::HealthReporter;
use tonic_health::ServingStatus;
use tower::ServiceExt;

use crate::answer_body::{answering, AnswerWatch};
use crate::connection_limit::{self, Admitted, ConnectionLimit};
use crate::grpc::Api;
use crate::lifespan::{Age, AgeStep, Answering, Calls, Ended, Idle, IdleStep, Lifespan};
use crate::log::Throttle;
use crate::preface::{self, Rewound};
use crate::proto::tensorflow::serving::model_service_server::ModelServiceServer;
use crate::proto::tensorflow::serving::prediction_service_server::PredictionServiceServer;
use crate::status::Code;
use crate::uds_authority::AuthorityFix;

/// The names grpc.health.v1 answers for: the server as a whole, and TF Serving's services by
/// their full and short names (what TF Serving's own health checks and load balancers ask).
const HEALTH_SERVICES: [&str; 5] = [
    "",
    "tensorflow.serving.PredictionService",
    "tensorflow.serving.ModelService",
    "PredictionService",
    "ModelService",
];
use crate::request_body::{Framing, ReadError, Reading, ReadingBody};
use crate::rest::{self, Rest};
use crate::state::{DrainRequest, Phase, RouterState};
use crate::{log_info, log_warn};

const STREAM_WINDOW: u32 = 4 << 20;
const CONNECTION_WINDOW: u32 = 16 << 20;
/// The largest HTTP/2 frame a client may send: h2 holds a frame whole until it has all of
/// it, so a connection that stalls partway through one held a megabyte outside the memory
/// budget (1,024 connections: a gigabyte; found by a hunt). At least 64 KiB + 64: the UNIX
/// socket's rewrite writes a header block in one frame (uds_authority.rs).
pub const MAX_FRAME: u32 = 128 << 10;
/// The largest header list a call may have (each field's name and value plus 32, as HTTP/2
/// counts them); h2 answers a larger one with 431 and REFUSED_STREAM, that call only. Hyper's
/// default, set here so that the UNIX socket's rewrite (uds_authority.rs) knows it.
pub const MAX_HEADER_LIST: u32 = 16 << 10;

pub struct Limits {
    pub max_message_bytes: usize,
    /// What requests may take at once (request_budget): REST's too, the same one.
    pub request_memory: Arc<crate::request_budget::RequestBudget>,
    /// TLS on the gRPC port (TF Serving's --ssl_config_file); None: plaintext.
    pub tls: Option<tokio_rustls::TlsAcceptor>,
    /// How long gRPC connections live and how their HTTP/2 is kept (lifespan).
    pub lifespan: Lifespan,
    /// How long a request may send nothing while the front door waits for more of it (None:
    /// for ever); REST's header too, and a gRPC connection's preface (preface.rs).
    pub request_read_timeout: Option<Duration>,
    /// Client connections open at once (`--max-connections`).
    pub connections: Arc<ConnectionLimit>,
}

/// What the lifecycle tells every connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ending {
    /// Serving as usual.
    No,
    /// GOAWAY: finish the calls under way, take no new ones.
    Gracefully,
    /// The drain's grace is over: close now (calls still running are cancelled).
    Now,
}

/// Why the server is draining.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Cause {
    Signal,
    Controller,
}

pub struct Server {
    listener: TcpListener,
    /// TF Serving's `--grpc_socket_path`: gRPC on a UNIX socket too; None: TCP only.
    unix: Option<UnixSocket>,
    tls: Option<tokio_rustls::TlsAcceptor>,
    /// TF Serving's REST API, when it is on: drained with the gRPC listener.
    rest: Option<(TcpListener, Arc<Rest>)>,
    api: Api,
    lifespan: Lifespan,
    state: Arc<RouterState>,
    health: HealthReporter,
    routes: tonic::service::Routes,
    /// How each call's body is read (request_body).
    reading: Reading,
    /// Client connections open at once, gRPC and REST together (connection_limit).
    connections: Arc<ConnectionLimit>,
}

impl Server {
    pub fn new(
        listener: TcpListener,
        unix: Option<UnixSocket>,
        rest: Option<(TcpListener, Arc<Rest>)>,
        api: Api,
        limits: Limits,
        state: Arc<RouterState>,
    ) -> Server {
        let (health, health_service) = tonic_health::server::health_reporter();
        // Requests compressed with gzip or deflate are taken, as gRPC C++ (TF Serving) takes
        // them; the size limit holds for the decompressed message. Answers go out
        // uncompressed, as TF Serving's do unless configured otherwise. What a request may take
        // once decoded is held to the request budget, with every other request's (its codec checks).
        let reading = Reading {
            budget: crate::decode_budget::install(limits.request_memory.clone()),
            stall: limits.request_read_timeout,
        };
        let routes = tonic::service::Routes::new(
            PredictionServiceServer::new(api.clone())
                .accept_compressed(CompressionEncoding::Gzip)
                .accept_compressed(CompressionEncoding::Deflate)
                .max_decoding_message_size(limits.max_message_bytes)
                .max_encoding_message_size(limits.max_message_bytes),
        )
        .add_service(
            ModelServiceServer::new(api.clone())
                .accept_compressed(CompressionEncoding::Gzip)
                .accept_compressed(CompressionEncoding::Deflate)
                .max_decoding_message_size(limits.max_message_bytes)
                .max_encoding_message_size(limits.max_message_bytes),
        )
        .add_service(
            health_service
                .accept_compressed(CompressionEncoding::Gzip)
                .accept_compressed(CompressionEncoding::Deflate),
        )
        .prepare();
        Server {
            listener,
            unix,
            tls: limits.tls,
            rest,
            api,
            lifespan: limits.lifespan,
            state,
            health,
            routes,
            reading,
            connections: limits.connections,
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
            unix,
            tls,
            rest,
            api,
            lifespan,
            state,
            health,
            routes,
            reading,
            connections,
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
        // tonic-health starts "" as SERVING; nothing is ready yet.
        for service in HEALTH_SERVICES {
            health
                .set_service_status(service, ServingStatus::NotServing)
                .await;
        }
        let health_task = tokio::spawn(follow_health(
            health,
            api.dispatcher.serving_workers(),
            state.phase.subscribe(),
        ));
        let (shutdown_tx, shutdown_rx) = watch::channel(Ending::No);
        let (done_tx, mut done_rx) = mpsc::channel::<()>(1);
        let accepting = Accepting {
            tls,
            routes,
            reading,
            lifespan,
            connections,
            ending: shutdown_rx,
            done: done_tx,
        };
        let mut drains_open = true;
        let mut throttle_looks = tokio::time::interval(Throttle::EVERY);
        throttle_looks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);

        let (drain, cause) = loop {
            tokio::select! {
                accepted = listener.accept() => accepting.grpc(accepted).await,
                accepted = accept_unix(&unix) => accepting.grpc_unix(accepted).await,
                _ = throttle_looks.tick() => log_trailing(std::time::Instant::now()),
                accepted = accept_rest(&rest) => {
                    if let Some((stream, handler)) = accepted {
                        accepting.rest(stream, handler);
                    }
                }
                request = drains.recv(), if drains_open => match request {
                    Some(request) => break (request, Cause::Controller),
                    None => drains_open = false,
                },
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
        // The controller takes no HandleReloadConfigRequest now: answered at once, not held
        // (a call left waiting held the drain for its whole grace).
        state.reloads.close((
            Code::Unavailable as i32,
            "the pool is stopping: its configuration changes no more, and what this call \
             asked may have been applied in part (ask the pool that replaces it)"
                .to_string(),
        ));
        // A second stop request (a second Ctrl-C through the controller's drain of 0 and 0,
        // or a signal here) shortens what is left: the delay, then the grace.
        let mut grace = drain.grace;
        // A signal taken here is the one a controller's drain would wait for at its end.
        let mut signalled = cause == Cause::Signal;
        // Keep answering (new connections too) while load balancers notice NOT_SERVING.
        let mut until = after(drain.delay);
        loop {
            tokio::select! {
                _ = tokio::time::sleep_until(until) => break,
                accepted = listener.accept() => accepting.grpc(accepted).await,
                accepted = accept_unix(&unix) => accepting.grpc_unix(accepted).await,
                accepted = accept_rest(&rest) => {
                    if let Some((stream, handler)) = accepted {
                        accepting.rest(stream, handler);
                    }
                }
                request = drains.recv(), if drains_open => match request {
                    Some(later) => sooner(later.delay, later, &mut until, &mut grace),
                    None => drains_open = false,
                },
                _ = recv_signal(&mut terminate) => {
                    signalled = true;
                    sooner(NOW.delay, NOW, &mut until, &mut grace);
                }
                _ = recv_signal(&mut interrupt) => {
                    signalled = true;
                    sooner(NOW.delay, NOW, &mut until, &mut grace);
                }
            }
        }
        drop(listener); // no new connections
        drop(unix); // and its file is gone
        drop(rest);
        let _ = shutdown_tx.send(Ending::Gracefully);
        drop(accepting); // its `done` sender: the connections' are the only ones left
        let mut grace_end = after(grace);
        let finished = loop {
            tokio::select! {
                // Done first: with a grace of 0 and nothing in flight, both are ready, and
                // only this one is the truth (the others would warn of calls still running).
                biased;
                _ = done_rx.recv() => break true,
                _ = tokio::time::sleep_until(grace_end) => break false,
                request = drains.recv(), if drains_open => match request {
                    Some(later) => sooner(later.grace, later, &mut grace_end, &mut grace),
                    None => drains_open = false,
                },
                _ = recv_signal(&mut terminate) => {
                    signalled = true;
                    break false;
                }
                _ = recv_signal(&mut interrupt) => {
                    signalled = true;
                    break false;
                }
            }
        };
        if !finished {
            log_warn!("in-flight calls still running after the drain's grace: closing");
            let _ = shutdown_tx.send(Ending::Now);
            // Closing is immediate; this only lets the connection tasks observe it.
            let _ = tokio::time::timeout(Duration::from_secs(1), done_rx.recv()).await;
        }
        set_phase(&state, Phase::Stopped);
        if !signalled {
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

/// A drain asked for while one runs (a second stop request) shortens it: the running phase
/// (the delay or the grace) ends within `left` (`later`'s own delay or grace), so by `until`
/// moved sooner, and the grace to come is at most `later`'s.
fn sooner(
    left: Duration,
    later: DrainRequest,
    until: &mut tokio::time::Instant,
    grace: &mut Duration,
) {
    log_info!(
        "asked to drain again: delay {:?}, grace {:?}",
        later.delay,
        later.grace
    );
    *until = (*until).min(after(left));
    *grace = (*grace).min(later.grace);
}

/// `span` from now; a span no clock reaches (the config takes up to 2**64 s) is 100 years,
/// not an overflow's panic.
fn after(span: Duration) -> tokio::time::Instant {
    let now = tokio::time::Instant::now();
    now.checked_add(span)
        .unwrap_or_else(|| now + Duration::from_secs(100 * 365 * 24 * 3600))
}

/// A second stop request's drain: no more delay, no more grace.
const NOW: DrainRequest = DrainRequest {
    delay: Duration::ZERO,
    grace: Duration::ZERO,
};

/// What serving a connection just accepted needs, for the accept loops (the only holder):
/// dropped when the listeners are, its `done` sender with it.
struct Accepting {
    tls: Option<tokio_rustls::TlsAcceptor>,
    routes: tonic::service::Routes,
    reading: Reading,
    lifespan: Lifespan,
    connections: Arc<ConnectionLimit>,
    ending: watch::Receiver<Ending>,
    done: mpsc::Sender<()>,
}

/// Connections refused for the limit come in floods: one line per `Throttle::EVERY`.
static REFUSALS: Throttle = Throttle::new();

/// Failed accepts (EMFILE and friends) come in floods too; one count per listener.
static ACCEPT_FAILURES: Throttle = Throttle::new();
static REST_ACCEPT_FAILURES: Throttle = Throttle::new();
pub static METRICS_ACCEPT_FAILURES: Throttle = Throttle::new();

/// Writes what each of the listeners' throttles counted after its last line (the serving
/// loop looks every `Throttle::EVERY`).
fn log_trailing(now: std::time::Instant) {
    for (throttle, what) in [
        (
            &REFUSALS,
            "client connection(s) refused (--max-connections)",
        ),
        (&ACCEPT_FAILURES, "failed accept(s) of gRPC connections"),
        (
            &REST_ACCEPT_FAILURES,
            "failed accept(s) of REST connections",
        ),
        (
            &METRICS_ACCEPT_FAILURES,
            "failed accept(s) of metrics connections",
        ),
        (&TLS_FAILURES, "failed or timed-out TLS handshake(s)"),
        (
            &UNSTARTED,
            "gRPC connection(s) closed without an HTTP/2 preface (--request-read-timeout)",
        ),
    ] {
        if let Some(count) = throttle.trailing(now) {
            log_warn!("{count} more {what} since the last line");
        }
    }
}

impl Accepting {
    /// Serves a gRPC connection the listener gave, or refuses it at the limit; after a failed
    /// accept, backs off a little rather than spin.
    async fn grpc(&self, accepted: std::io::Result<(tokio::net::TcpStream, std::net::SocketAddr)>) {
        let Some((stream, _)) = accepted_or_back_off(accepted, &ACCEPT_FAILURES, "").await else {
            return;
        };
        let Some(admitted) = self.connections.admit() else {
            let words = self.grpc_refusal();
            self.refuse(stream, &words);
            return;
        };
        let _ = stream.set_nodelay(true);
        let peer = stream.peer_addr().ok();
        let local = stream.local_addr().ok();
        let who = peer.map_or_else(|| "?".to_string(), |a| a.to_string());
        let tagged = peer.map(|peer| Peer::Tcp { peer, local });
        self.serve_grpc(stream, tagged, who, admitted);
    }

    /// A connection to the UNIX socket (`--grpc_socket_path`): served as a TCP one is, under
    /// the same limit, drain and TLS, its calls local to this host.
    async fn grpc_unix(&self, accepted: std::io::Result<tokio::net::UnixStream>) {
        let Some(stream) = accepted_or_back_off(accepted, &ACCEPT_FAILURES, "").await else {
            return;
        };
        let Some(admitted) = self.connections.admit() else {
            self.note_refusal();
            connection_limit::refuse_unix(stream, &self.grpc_refusal());
            return;
        };
        self.serve_grpc(stream, Some(Peer::Unix), "the UNIX socket".into(), admitted);
    }

    /// What a gRPC client refused at the limit is told: plain words would be noise to a TLS
    /// client, which is only closed.
    fn grpc_refusal(&self) -> Vec<u8> {
        match self.tls {
            None => connection_limit::grpc_refusal(self.connections.most()),
            Some(_) => Vec::new(),
        }
    }

    fn serve_grpc<I>(&self, stream: I, peer: Option<Peer>, who: String, admitted: Admitted)
    where
        I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    {
        let watch = AnswerWatch::new(self.reading.stall);
        let service = connection_service(&self.routes, &self.reading, peer, &watch);
        // The UNIX socket's calls get an :authority h2 takes (gRPC's C core sends the
        // socket's path): uds_authority, on the decrypted frames.
        let fixing = matches!(peer, Some(Peer::Unix));
        tokio::spawn(serve_accepted(
            stream,
            (who, fixing),
            self.tls.clone(),
            service,
            watch,
            self.lifespan,
            self.reading.stall,
            self.ending.clone(),
            (self.done.clone(), admitted),
        ));
    }

    /// Serves a REST connection, or refuses it at the limit.
    fn rest(&self, stream: tokio::net::TcpStream, handler: Arc<Rest>) {
        let Some(admitted) = self.connections.admit() else {
            self.refuse(
                stream,
                &connection_limit::rest_refusal(self.connections.most()),
            );
            return;
        };
        tokio::spawn(rest::serve_connection(
            stream,
            handler,
            self.ending.clone(),
            (self.done.clone(), admitted),
        ));
    }

    fn refuse(&self, stream: tokio::net::TcpStream, words: &[u8]) {
        self.note_refusal();
        connection_limit::refuse(stream, words);
    }

    /// Refusals for the limit come in floods: one line per `Throttle::EVERY`.
    fn note_refusal(&self) {
        if let Some(count) = REFUSALS.note(std::time::Instant::now()) {
            log_warn!(
                "refused {count} client connection(s) since the last line: {} are open, the \
                 most kept at once (--max-connections)",
                self.connections.most()
            );
        }
    }
}

/// An accepted connection, or None after a failed accept (EMFILE and friends), which is
/// logged through its listener's `throttle` (`what`: the listener's name in the line) and
/// followed by a short pause rather than a spin.
pub async fn accepted_or_back_off<T>(
    accepted: std::io::Result<T>,
    throttle: &Throttle,
    what: &str,
) -> Option<T> {
    match accepted {
        Ok(stream) => Some(stream),
        Err(error) => {
            if let Some(count) = throttle.note(std::time::Instant::now()) {
                log_warn!("{what}accept failed ({count} since the last line): {error}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
            None
        }
    }
}

/// The gRPC UNIX socket of `--grpc_socket_path`, bound: its file is removed when it is
/// dropped (the drain), so clients find no socket rather than one nobody answers.
pub struct UnixSocket {
    listener: tokio::net::UnixListener,
    path: std::path::PathBuf,
    /// The file this process bound (device, inode): only that one is removed.
    file: (u64, u64),
}

impl UnixSocket {
    /// Binds `path`, first removing a socket left there that nobody answers on (a front
    /// door that was killed leaves its file). A socket some server still listens on, or
    /// anything that is not a socket, is left alone and refused.
    pub fn bind(path: &std::path::Path) -> Result<UnixSocket, String> {
        use std::os::unix::fs::{FileTypeExt, MetadataExt};
        match std::fs::symlink_metadata(path) {
            Ok(meta) if meta.file_type().is_socket() => {
                if std::os::unix::net::UnixStream::connect(path).is_ok() {
                    return Err(format!(
                        "{} is a socket another server listens on: not replaced",
                        path.display()
                    ));
                }
                std::fs::remove_file(path)
                    .map_err(|e| format!("cannot remove the old socket {}: {e}", path.display()))?
            }
            Ok(_) => {
                return Err(format!(
                    "{} exists and is not a socket: not replaced",
                    path.display()
                ))
            }
            Err(_) => {} // nothing there
        }
        let listener = tokio::net::UnixListener::bind(path)
            .map_err(|e| format!("cannot listen on the UNIX socket {}: {e}", path.display()))?;
        let meta = std::fs::symlink_metadata(path)
            .map_err(|e| format!("cannot read the socket {} just bound: {e}", path.display()))?;
        Ok(UnixSocket {
            listener,
            path: path.to_path_buf(),
            file: (meta.dev(), meta.ino()),
        })
    }
}

impl Drop for UnixSocket {
    fn drop(&mut self) {
        use std::os::unix::fs::MetadataExt;
        // Another server may have bound the path since (after removing ours): not ours.
        let ours = std::fs::symlink_metadata(&self.path)
            .is_ok_and(|meta| (meta.dev(), meta.ino()) == self.file);
        if ours {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// The next connection to the UNIX socket; never ready without one.
async fn accept_unix(unix: &Option<UnixSocket>) -> std::io::Result<tokio::net::UnixStream> {
    let Some(unix) = unix else {
        return std::future::pending().await;
    };
    unix.listener.accept().await.map(|(stream, _)| stream)
}

/// The next REST connection (None after a failed accept, which is logged and slowed down);
/// never ready when the REST API is off.
async fn accept_rest(
    rest: &Option<(TcpListener, Arc<Rest>)>,
) -> Option<(tokio::net::TcpStream, Arc<Rest>)> {
    let Some((listener, handler)) = rest else {
        return std::future::pending().await;
    };
    let (stream, _) =
        accepted_or_back_off(listener.accept().await, &REST_ACCEPT_FAILURES, "REST ").await?;
    let _ = stream.set_nodelay(true);
    Some((stream, handler.clone()))
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

/// The client, in the extensions of every request of its connection: admin calls
/// (HandleReloadConfigRequest) are taken only from this host.
#[derive(Clone, Copy, Debug)]
pub enum Peer {
    /// A TCP client at `peer`, connected to this front door's `local` address (its end of
    /// the connection; None when it could not be read).
    Tcp {
        peer: std::net::SocketAddr,
        local: Option<std::net::SocketAddr>,
    },
    /// A client of the UNIX socket (`--grpc_socket_path`): on this host by definition.
    Unix,
}

impl Peer {
    /// Whether a request came from this host; false when its peer is not known. Loopback
    /// means 127.0.0.1 and ::1 only, not all of 127/8: a mesh's sidecar hands the pod its
    /// inbound traffic from other loopback addresses (Istio's 127.0.0.6), so every remote
    /// client would pass for a local one.
    pub fn is_local(extensions: &tonic::Extensions) -> bool {
        extensions.get::<Peer>().is_some_and(|peer| match peer {
            Peer::Tcp { peer: address, .. } => match address.ip() {
                std::net::IpAddr::V4(ip) => ip == std::net::Ipv4Addr::LOCALHOST,
                std::net::IpAddr::V6(ip) => {
                    ip == std::net::Ipv6Addr::LOCALHOST
                        || ip.to_ipv4_mapped() == Some(std::net::Ipv4Addr::LOCALHOST)
                }
            },
            Peer::Unix => true,
        })
    }

    /// Whether a local peer (`is_local`) is this process's user or root. The UNIX socket is
    /// 0700, so its peers are; a loopback TCP peer is whoever owns the client's socket (the
    /// kernel's socket table), and any local user could connect there.
    pub fn is_this_user(extensions: &tonic::Extensions) -> bool {
        // SAFETY: getuid has no preconditions and cannot fail.
        let ours = unsafe { libc::getuid() };
        extensions.get::<Peer>().is_some_and(|peer| match peer {
            Peer::Tcp {
                peer,
                local: Some(local),
            } => crate::peer_uid::loopback_peer_uid(*peer, *local)
                .is_some_and(|uid| uid == ours || uid == 0),
            Peer::Tcp { local: None, .. } => false,
            Peer::Unix => true,
        })
    }
}

/// One connection's gRPC service: calls the C core refuses by their headers refused
/// (grpc_headers), each other call tagged with the peer, its body read as
/// `reading` says (request_body), holding its request's share of the request budget until it
/// ends (decode_budget), and its answer's until the answer is handed over, the answers
/// watched by `watch` (answer_body).
fn connection_service(
    routes: &tonic::service::Routes,
    reading: &Reading,
    peer: Option<Peer>,
    watch: &AnswerWatch,
) -> TowerToHyperService<
    impl tower::Service<
            http::Request<hyper::body::Incoming>,
            Response = http::Response<tonic::body::Body>,
            Error = std::convert::Infallible,
            Future = impl std::future::Future<
                Output = Result<http::Response<tonic::body::Body>, std::convert::Infallible>,
            > + Send
                         + 'static,
        > + Clone
        + Send,
> {
    let answers = watch.answers.clone();
    TowerToHyperService::new(
        crate::grpc_headers::WellFormed(routes.clone())
            .map_request(prepare_call(reading.clone(), peer))
            .map_future(move |call| {
                answering(
                    crate::decode_budget::holding_request_memory(call),
                    answers.clone(),
                )
            }),
    )
}

type CallBody = http_body_util::combinators::MapErr<
    ReadingBody<hyper::body::Incoming>,
    fn(ReadError) -> Box<dyn std::error::Error + Send + Sync>,
>;

fn prepare_call(
    reading: Reading,
    peer: Option<Peer>,
) -> impl Fn(http::Request<hyper::body::Incoming>) -> http::Request<CallBody> + Clone {
    move |request| {
        let into_grpc: fn(ReadError) -> _ = ReadError::into_grpc;
        let deadline = crate::grpc::deadline_in(request.headers(), tokio::time::Instant::now());
        let mut request = request.map(|body| {
            reading
                .body(body, Framing::Grpc)
                .until(deadline)
                .map_err(into_grpc)
        });
        if let Some(deadline) = deadline {
            request
                .extensions_mut()
                .insert(crate::grpc::CallDeadline(deadline));
        }
        if let Some(peer) = peer {
            request.extensions_mut().insert(peer);
        }
        request
    }
}

/// A TLS handshake longer than this is a client that will not finish one.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Serves an accepted connection, after its TLS handshake when the port has TLS (a failed
/// handshake ends only that connection, logged as a warning) and once its client has sent
/// HTTP/2's preface within `start_limit` (`preface`). `held` (the drain's count and the
/// connection's place under the limit) is kept until the connection ends.
#[allow(clippy::too_many_arguments)]
async fn serve_accepted<I, S>(
    stream: I,
    (peer, fixing): (String, bool),
    tls: Option<tokio_rustls::TlsAcceptor>,
    service: S,
    answers: AnswerWatch,
    lifespan: Lifespan,
    start_limit: Option<Duration>,
    mut ending: watch::Receiver<Ending>,
    held: (mpsc::Sender<()>, Admitted),
) where
    S: hyper::service::Service<
            http::Request<hyper::body::Incoming>,
            Response = http::Response<tonic::body::Body>,
        > + Send
        + 'static,
    S::Future: Send + 'static,
    S::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (done, admitted) = held;
    let Some(tls) = tls else {
        let stream = AuthorityFix::new(stream, fixing);
        if let Some(stream) = started(stream, start_limit, &mut ending).await {
            let end = serve_connection(stream, service, Some(answers), lifespan, ending, done);
            admitted.ended(end.await);
        }
        return;
    };
    match tokio::time::timeout(HANDSHAKE_TIMEOUT, tls.accept(stream)).await {
        Ok(Ok(stream)) => {
            let stream = AuthorityFix::new(stream, fixing);
            if let Some(stream) = started(stream, start_limit, &mut ending).await {
                let end = serve_connection(stream, service, Some(answers), lifespan, ending, done);
                admitted.ended(end.await);
            }
        }
        Ok(Err(error)) => {
            if let Some(count) = TLS_FAILURES.note(std::time::Instant::now()) {
                let hint = crate::tls::client_certificate_hint(&error.to_string());
                log_warn!(
                    "TLS handshake with {peer} failed ({count} since the last line): {error}{hint}"
                );
            }
        }
        Err(_) => {
            if let Some(count) = TLS_FAILURES.note(std::time::Instant::now()) {
                log_warn!("TLS handshake with {peer} timed out ({count} since the last line)");
            }
        }
    }
}

/// Failed TLS handshakes (a client without the right certificate, or a flood) are logged as
/// refusals are.
static TLS_FAILURES: Throttle = Throttle::new();

/// Connections closed because their clients sent no preface in time come in floods too.
static UNSTARTED: Throttle = Throttle::new();

/// `stream` once its client has sent HTTP/2's preface; None (the connection to be closed)
/// when `limit` passed first, the client closed, or the drain's grace is over. A drain that
/// starts meanwhile is left to `serve_connection`, which answers the preface with GOAWAY.
async fn started<I>(
    stream: I,
    limit: Option<Duration>,
    ending: &mut watch::Receiver<Ending>,
) -> Option<Rewound<I>>
where
    I: tokio::io::AsyncRead + Unpin,
{
    let start = preface::read_start(stream, limit);
    tokio::pin!(start);
    loop {
        tokio::select! {
            started = &mut start => return match started {
                Ok(stream) => Some(stream),
                Err(error) => {
                    if error.kind() == std::io::ErrorKind::TimedOut {
                        if let Some(count) = UNSTARTED.note(std::time::Instant::now()) {
                            log_warn!(
                                "closed {count} gRPC connection(s) since the last line whose \
                                 client sent no HTTP/2 preface within {} s \
                                 (--request-read-timeout)",
                                limit.unwrap_or_default().as_secs_f64()
                            );
                        }
                    }
                    None
                }
            },
            changed = ending.changed() => {
                if changed.is_err() || *ending.borrow() == Ending::Now {
                    return None;
                }
            }
        }
    }
}

/// Serves one gRPC connection until it ends, and says how it ended.
async fn serve_connection<I, S>(
    stream: I,
    service: S,
    answers: Option<AnswerWatch>,
    lifespan: Lifespan,
    mut ending: watch::Receiver<Ending>,
    _done: mpsc::Sender<()>,
) -> Ended
where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
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
        .max_frame_size(MAX_FRAME)
        .max_header_list_size(MAX_HEADER_LIST)
        // What h2 queues of a stream's answer beyond what its client takes (answer_body hands
        // it over in pieces of PIECE): two pieces, not h2's 400 KiB.
        .max_send_buf_size(2 * crate::answer_body::PIECE);
    if let Some(streams) = lifespan.max_concurrent_streams {
        builder.max_concurrent_streams(streams);
    }
    // A client that stops reading its socket answers no ping: closed after the read timeout,
    // with whatever h2 had queued for it; sooner where keepalive asks for it.
    let reader_check = answers.as_ref().and_then(|watch| watch.limit);
    if let Some((interval, timeout)) = lifespan.pings(reader_check) {
        builder
            .keep_alive_interval(interval)
            .keep_alive_timeout(timeout);
    }
    // Calls are counted only where idleness is watched (two atomic adds and the answer's
    // body boxed once more, a call), each until its answer's body is dropped.
    let mut idle = lifespan.max_idle.map(|limit| {
        let calls = Arc::new(Calls::default());
        (Idle::new(limit, tokio::time::Instant::now()), calls)
    });
    let service = {
        let calls = idle.as_ref().map(|(_, calls)| calls.clone());
        hyper::service::service_fn(move |request| {
            let under_way = calls.as_ref().map(Calls::begin);
            let call = hyper::service::Service::call(&service, request);
            async move {
                let answer = call.await;
                match under_way {
                    None => answer,
                    Some(under_way) => answer.map(|response| {
                        response.map(|body| tonic::body::Body::new(Answering::new(body, under_way)))
                    }),
                }
            }
        })
    };
    let connection = builder.serve_connection(TokioIo::new(stream), service);
    tokio::pin!(connection);
    let mut age = Age::new(&lifespan);
    let timer = tokio::time::sleep_until(age.next_deadline(tokio::time::Instant::now()));
    tokio::pin!(timer);
    // Why the connection was told GOAWAY, once it was.
    let mut going_away: Option<Ended> = None;
    // A drain that began while the connection was being accepted (its change already seen).
    match *ending.borrow_and_update() {
        Ending::No => {}
        Ending::Gracefully => {
            going_away = Some(Ended::Closed);
            connection.as_mut().graceful_shutdown();
        }
        Ending::Now => return Ended::Cut,
    }
    // A connection whose answers stopped moving is closed: hyper does not poll their bodies
    // while the client grants no window, so nothing else would end them.
    let period = answers.as_ref().and_then(AnswerWatch::period);
    let mut looks = tokio::time::interval(period.unwrap_or(Duration::from_secs(3600)));
    looks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut idle_looks = tokio::time::interval(
        idle.as_ref()
            .map_or(Duration::from_secs(3600), |(idle, _)| idle.period()),
    );
    idle_looks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = &mut connection => return going_away.unwrap_or(Ended::Closed),
            now = looks.tick(), if period.is_some() => {
                if let Some(AnswerWatch { answers, limit: Some(limit) }) = &answers {
                    if answers.stalled(now, *limit) {
                        log_warn!(
                            "closed a gRPC connection: an answer on it had not moved for {} s, \
                             its client taking none of it (--request-read-timeout)",
                            limit.as_secs_f64()
                        );
                        return Ended::Cut;
                    }
                }
            },
            _ = idle_looks.tick(), if idle.is_some()
                && matches!(going_away, None | Some(Ended::Idle)) => {
                if let Some((idle, calls)) = idle.as_mut() {
                    match idle.look(tokio::time::Instant::now(), calls.quiet()) {
                        IdleStep::Stay => {}
                        IdleStep::GoAway => {
                            going_away = Some(Ended::Idle);
                            connection.as_mut().graceful_shutdown();
                        }
                        // Its client never acknowledged the GOAWAY (h2 waits for that).
                        IdleStep::Close => return Ended::Idle,
                    }
                }
            },
            _ = &mut timer, if lifespan.max_age.is_some() => match age.expired() {
                AgeStep::GoAway => {
                    if going_away.is_none() {
                        going_away = Some(Ended::Closed);
                        connection.as_mut().graceful_shutdown();
                    }
                    let now = tokio::time::Instant::now();
                    timer.as_mut().reset(age.next_deadline(now));
                }
                AgeStep::Close => return Ended::Cut,
            },
            changed = ending.changed() => {
                let now = if changed.is_err() { Ending::Now } else { *ending.borrow_and_update() };
                match now {
                    Ending::No => {}
                    Ending::Gracefully => if going_away.is_none() {
                        going_away = Some(Ended::Closed);
                        connection.as_mut().graceful_shutdown();
                    },
                    // Dropping the connection resets its streams; hyper drops their handlers.
                    Ending::Now => return Ended::Cut,
                }
            }
        }
    }
}

/// Health is SERVING only while the phase is SERVING and at least one worker of a version
/// the controller said AVAILABLE is READY (`serving`, the dispatcher's count), for "" and for
/// TF Serving's services.
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
            for service in HEALTH_SERVICES {
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::convert::Infallible;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;
    use tokio::time::Instant;

    const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

    #[tokio::test]
    async fn a_drain_span_no_clock_reaches_is_far_away_not_a_panic() {
        let far = after(Duration::MAX);
        assert!(far > tokio::time::Instant::now() + Duration::from_secs(50 * 365 * 24 * 3600));
        let mut until = after(Duration::from_secs(30));
        let mut grace = Duration::from_secs(10);
        sooner(NOW.delay, NOW, &mut until, &mut grace);
        assert!(until <= tokio::time::Instant::now() && grace == Duration::ZERO);
    }

    #[test]
    fn only_a_loopback_peer_is_local() {
        let tagged = |addr: &str| {
            let mut extensions = tonic::Extensions::new();
            extensions.insert(Peer::Tcp {
                peer: addr.parse().expect("an address"),
                local: None,
            });
            Peer::is_local(&extensions)
        };
        assert!(tagged("127.0.0.1:5000"));
        assert!(tagged("[::1]:5000"));
        assert!(tagged("[::ffff:127.0.0.1]:5000"));
        assert!(
            !tagged("127.0.0.6:5000"),
            "Istio's sidecar forwards remote clients from 127.0.0.6"
        );
        assert!(!tagged("10.1.2.3:5000"));
        assert!(!tagged("[2001:db8::1]:5000"));
        assert!(!Peer::is_local(&tonic::Extensions::new()), "unknown peer");
        let mut unix = tonic::Extensions::new();
        unix.insert(Peer::Unix);
        assert!(
            Peer::is_local(&unix),
            "a UNIX socket's client is on this host"
        );
    }

    #[tokio::test]
    async fn the_unix_socket_replaces_a_left_socket_refuses_other_files_and_goes_when_dropped() {
        let dir = std::env::temp_dir().join(format!("mpspool-uds-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("tfs.sock");
        // A socket a killed front door left: replaced.
        drop(std::os::unix::net::UnixListener::bind(&path).unwrap());
        assert!(path.exists());
        let socket = UnixSocket::bind(&path).expect("the left socket replaced");
        let client = tokio::net::UnixStream::connect(&path).await;
        assert!(client.is_ok(), "{client:?}");
        assert!(accept_unix(&Some(socket)).await.is_ok());
        assert!(!path.exists(), "dropped with its listener");
        // A socket a live server listens on is not taken over.
        let live = std::os::unix::net::UnixListener::bind(&path).unwrap();
        let refused = UnixSocket::bind(&path).err().unwrap();
        assert!(refused.contains("another server listens on"), "{refused}");
        drop(live);
        // The path bound again by another after ours was removed: ours does not remove it.
        let socket = UnixSocket::bind(&path).expect("a dead socket replaced");
        std::fs::remove_file(&path).unwrap();
        let other = std::os::unix::net::UnixListener::bind(&path).unwrap();
        drop(socket);
        assert!(path.exists(), "the other server's socket stays");
        drop(other);
        std::fs::remove_file(&path).unwrap();
        // Anything else at the path is not ours to remove.
        std::fs::write(&path, b"data").unwrap();
        let refused = UnixSocket::bind(&path).err().unwrap();
        assert!(refused.contains("exists and is not a socket"), "{refused}");
        assert_eq!(std::fs::read(&path).unwrap(), b"data");
        std::fs::remove_dir_all(&dir).unwrap();
    }
    const SETTINGS: u8 = 4;
    const PING: u8 = 6;
    const GOAWAY: u8 = 7;
    const HEADERS: u8 = 1;
    const ACK: u8 = 1;

    fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
        let len = payload.len() as u32;
        let mut out = vec![(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags];
        out.extend_from_slice(&stream.to_be_bytes());
        out.extend_from_slice(payload);
        out
    }

    /// What a bare HTTP/2 client saw, in time since `started`.
    #[derive(Debug)]
    struct Seen {
        goaway: Option<Duration>,
        closed: Duration,
        /// The server's first SETTINGS, as (identifier, value).
        settings: Vec<(u16, u32)>,
        /// PINGs the server sent.
        pings: usize,
        /// Whether the connection was still open when the client stopped watching it.
        open: bool,
    }

    /// Speaks just enough HTTP/2 (preface, SETTINGS, PING acks when `ping_acks`; with
    /// `call`, one POST) to watch how the server ends the connection, until `until` (then
    /// `open` when the connection still was).
    async fn watch_for(
        mut stream: TcpStream,
        call: bool,
        started: Instant,
        until: Option<Instant>,
        ping_acks: bool,
    ) -> Seen {
        let mut hello = PREFACE.to_vec();
        hello.extend(frame(SETTINGS, 0, 0, &[]));
        if call {
            // :method POST, :scheme http, :path / (HPACK static table 3, 6, 4); END_HEADERS.
            hello.extend(frame(HEADERS, 0x4, 1, &[0x83, 0x86, 0x84]));
        }
        stream.write_all(&hello).await.unwrap();
        let mut goaway = None;
        let mut settings = None;
        let mut pings = 0;
        let mut open = false;
        let far = started + Duration::from_secs(3600);
        loop {
            let mut head = [0u8; 9];
            match tokio::time::timeout_at(until.unwrap_or(far), stream.read_exact(&mut head)).await
            {
                Err(_) => {
                    open = true;
                    break;
                }
                Ok(Err(_)) => break,
                Ok(Ok(_)) => {}
            }
            let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
            let mut payload = vec![0u8; len];
            if stream.read_exact(&mut payload).await.is_err() {
                break;
            }
            let (kind, flags) = (head[3], head[4]);
            let reply = match kind {
                GOAWAY => {
                    goaway.get_or_insert(started.elapsed());
                    None
                }
                SETTINGS if flags & ACK == 0 => {
                    settings.get_or_insert_with(|| {
                        payload
                            .chunks_exact(6)
                            .map(|s| {
                                let id = u16::from_be_bytes([s[0], s[1]]);
                                (id, u32::from_be_bytes([s[2], s[3], s[4], s[5]]))
                            })
                            .collect()
                    });
                    Some(frame(SETTINGS, ACK, 0, &[]))
                }
                PING if flags & ACK == 0 => {
                    pings += 1;
                    ping_acks.then(|| frame(PING, ACK, 0, &payload))
                }
                _ => None,
            };
            if let Some(reply) = reply {
                if stream.write_all(&reply).await.is_err() {
                    break;
                }
            }
        }
        Seen {
            goaway,
            closed: started.elapsed(),
            settings: settings.unwrap_or_default(),
            pings,
            open,
        }
    }

    /// When `seen` was told GOAWAY, which must be between `limit` and twice it.
    fn goaway_between(seen: &Seen, limit: Duration) -> Duration {
        let goaway = seen.goaway.expect("a GOAWAY");
        assert!(goaway >= limit && goaway < 2 * limit, "{seen:?}");
        goaway
    }

    fn aged(age: Duration) -> Lifespan {
        Lifespan {
            max_age: Some(age),
            ..Lifespan::default()
        }
    }

    fn idling(idle: Duration) -> Lifespan {
        Lifespan {
            max_idle: Some(idle),
            ..Lifespan::default()
        }
    }

    /// What the client saw, the drain's sender, and how the server ended the connection.
    type Connected = (
        tokio::task::JoinHandle<Seen>,
        watch::Sender<Ending>,
        tokio::task::JoinHandle<Ended>,
    );

    /// A connection served as the server serves one, whose calls never answer.
    async fn connect(lifespan: Lifespan, call: bool) -> Connected {
        connect_acking(lifespan, call, true).await
    }

    /// `connect`, its client acknowledging PINGs only with `ping_acks`.
    async fn connect_acking(lifespan: Lifespan, call: bool, ping_acks: bool) -> Connected {
        let listener = TcpListener::bind(("127.0.0.1", 0)).await.unwrap();
        let address = listener.local_addr().unwrap();
        let (ending_tx, ending_rx) = watch::channel(Ending::No);
        let (done_tx, _done_rx) = mpsc::channel(1);
        let server = tokio::spawn(async move {
            let (stream, _) = listener.accept().await.unwrap();
            let service = hyper::service::service_fn(|_request| {
                std::future::pending::<Result<http::Response<tonic::body::Body>, Infallible>>()
            });
            serve_connection(stream, service, None, lifespan, ending_rx, done_tx).await
        });
        let started = Instant::now();
        let stream = TcpStream::connect(address).await.unwrap();
        (
            tokio::spawn(watch_for(stream, call, started, None, ping_acks)),
            ending_tx,
            server,
        )
    }

    /// A connection served with `watch`, whose calls never answer: how long until it closed.
    async fn watched(watch: AnswerWatch) -> (tokio::task::JoinHandle<Duration>, TcpStream) {
        let listener = TcpListener::bind(("127.0.0.1", 0)).await.unwrap();
        let address = listener.local_addr().unwrap();
        let server = tokio::spawn(async move {
            let (ending_tx, ending_rx) = watch::channel(Ending::No);
            let (done_tx, _done_rx) = mpsc::channel(1);
            let (stream, _) = listener.accept().await.unwrap();
            let service = hyper::service::service_fn(|_request| {
                std::future::pending::<Result<http::Response<tonic::body::Body>, Infallible>>()
            });
            let started = Instant::now();
            let lifespan = Lifespan::default();
            serve_connection(stream, service, Some(watch), lifespan, ending_rx, done_tx).await;
            drop(ending_tx);
            started.elapsed()
        });
        (server, TcpStream::connect(address).await.unwrap())
    }

    #[tokio::test]
    async fn a_connection_whose_answer_stops_moving_is_closed_after_the_limit() {
        let limit = Duration::from_millis(400);
        let watch = AnswerWatch::new(Some(limit));
        let (server, _client) = watched(watch.clone()).await;
        // An answer its client takes none of (hyper would not poll it without window).
        let budget = crate::request_budget::RequestBudget::new(1 << 20);
        let stuck = crate::answer_body::AnswerBody::new(
            http_body_util::Empty::<bytes::Bytes>::new(),
            budget.try_reserve(1).unwrap(),
            watch.answers.clone(),
        );
        let closed = tokio::time::timeout(Duration::from_secs(10), server)
            .await
            .expect("the connection was not closed")
            .unwrap();
        assert!(closed >= limit, "closed after {closed:?}");
        assert!(closed < limit * 3, "closed after {closed:?}");
        drop(stuck);
    }

    #[tokio::test]
    async fn a_connection_without_waiting_answers_is_left_open() {
        let watch = AnswerWatch::new(Some(Duration::from_millis(100)));
        let (server, _client) = watched(watch).await;
        let waited = tokio::time::timeout(Duration::from_millis(800), server).await;
        assert!(waited.is_err(), "closed with no answer waiting");
    }

    #[tokio::test]
    async fn a_drain_that_begins_during_the_preface_wait_leaves_the_connection_to_say_goaway() {
        let (ending_tx, mut ending) = watch::channel(Ending::No);
        let (mut client, server) = tokio::io::duplex(1024);
        let waiting = tokio::spawn(async move {
            let started = started(server, Some(Duration::from_secs(5)), &mut ending).await;
            (started.is_some(), *ending.borrow_and_update())
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        ending_tx.send(Ending::Gracefully).unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!waiting.is_finished(), "still waiting for the preface");
        client.write_all(PREFACE).await.unwrap();
        let (started, ending) = waiting.await.unwrap();
        assert!(started, "the preface came: served, to be told GOAWAY");
        assert_eq!(ending, Ending::Gracefully);
    }

    #[tokio::test]
    async fn the_drains_end_ends_the_preface_wait() {
        let (ending_tx, mut ending) = watch::channel(Ending::Gracefully);
        let (_client, server) = tokio::io::duplex(1024);
        let waiting =
            tokio::spawn(async move { started(server, None, &mut ending).await.is_some() });
        let waiting_for_ever = tokio::spawn({
            let mut ending = ending_tx.subscribe();
            let (client, server) = tokio::io::duplex(1024);
            async move {
                let started = started(server, Some(Duration::from_secs(600)), &mut ending).await;
                drop(client); // open, silent, until then
                started.is_some()
            }
        });
        // Without a limit nothing is awaited: served at once.
        assert!(waiting.await.unwrap());
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!waiting_for_ever.is_finished());
        ending_tx.send(Ending::Now).unwrap();
        let started = tokio::time::timeout(Duration::from_secs(2), waiting_for_ever)
            .await
            .expect("ended at once")
            .unwrap();
        assert!(!started);
    }

    #[tokio::test]
    async fn an_idle_connection_gets_goaway_at_its_age_and_closes() {
        let age = Duration::from_millis(300);
        let (seen, _ending, _server) = connect(aged(age), false).await;
        let seen = seen.await.unwrap();
        goaway_between(&seen, age);
        assert!(seen.closed < 2 * age, "nothing to wait for: {seen:?}");
    }

    #[tokio::test]
    async fn a_call_outliving_its_connection_gets_the_age_again_as_grace() {
        let age = Duration::from_millis(300);
        let (seen, _ending, _server) = connect(aged(age), true).await;
        let seen = seen.await.unwrap();
        goaway_between(&seen, age);
        assert!(seen.closed >= 2 * age && seen.closed < 3 * age, "{seen:?}");
    }

    #[tokio::test]
    async fn an_age_grace_of_its_own_closes_calls_under_way_after_it() {
        let (age, grace) = (Duration::from_millis(300), Duration::from_millis(100));
        let lifespan = Lifespan {
            age_grace: Some(grace),
            ..aged(age)
        };
        let (seen, _ending, server) = connect(lifespan, true).await;
        let seen = seen.await.unwrap();
        goaway_between(&seen, age);
        assert!(seen.closed >= age + grace, "{seen:?}");
        assert!(seen.closed < age + Duration::from_millis(250), "{seen:?}");
        assert_eq!(server.await.unwrap(), Ended::Cut);
    }

    #[tokio::test]
    async fn a_connection_without_calls_gets_goaway_once_idle_and_closes() {
        let idle = Duration::from_millis(200);
        let (seen, _ending, server) = connect(idling(idle), false).await;
        let seen = seen.await.unwrap();
        goaway_between(&seen, idle);
        assert!(seen.closed < 3 * idle, "nothing to wait for: {seen:?}");
        assert_eq!(server.await.unwrap(), Ended::Idle);
    }

    #[tokio::test]
    async fn an_idle_connection_whose_client_does_not_acknowledge_goaway_is_closed_later() {
        let idle = Duration::from_millis(200);
        let (seen, _ending, server) = connect_acking(idling(idle), false, false).await;
        let seen = tokio::time::timeout(Duration::from_secs(5), seen)
            .await
            .expect("never closed")
            .unwrap();
        let goaway = goaway_between(&seen, idle);
        assert!(seen.closed >= goaway + idle, "{seen:?}");
        assert!(seen.closed < goaway + 3 * idle, "{seen:?}");
        assert_eq!(server.await.unwrap(), Ended::Idle);
    }

    #[tokio::test]
    async fn a_call_under_way_keeps_its_connection_from_idling() {
        let idle = Duration::from_millis(100);
        let (seen, ending, server) = connect(idling(idle), true).await;
        tokio::time::sleep(6 * idle).await;
        assert!(!seen.is_finished(), "closed with a call under way");
        ending.send(Ending::Now).unwrap();
        let seen = seen.await.unwrap();
        assert_eq!(server.await.unwrap(), Ended::Cut);
        assert!(seen.goaway.is_none(), "{seen:?}");
    }

    /// Serves one connection under `lifespan` whose one call is answered after ANSWER_AFTER
    /// with a body `answer` makes: what its client saw in 2 s (the connection then ended).
    async fn served_with<S, B>(
        answer: S,
        lifespan: Lifespan,
    ) -> (Seen, watch::Sender<Ending>, tokio::task::JoinHandle<Ended>)
    where
        S: Fn() -> B + Send + Sync + 'static,
        B: hyper::body::Body<Data = bytes::Bytes, Error = tonic::Status> + Send + 'static,
    {
        let listener = TcpListener::bind(("127.0.0.1", 0)).await.unwrap();
        let address = listener.local_addr().unwrap();
        let (ending_tx, ending_rx) = watch::channel(Ending::No);
        let (done_tx, _done_rx) = mpsc::channel(1);
        let answer = Arc::new(answer);
        let server = tokio::spawn(async move {
            let (stream, _) = listener.accept().await.unwrap();
            let service = hyper::service::service_fn(move |_request| {
                let answer = answer.clone();
                async move {
                    tokio::time::sleep(ANSWER_AFTER).await;
                    let body = tonic::body::Body::new(answer());
                    Ok::<_, Infallible>(http::Response::new(body))
                }
            });
            serve_connection(stream, service, None, lifespan, ending_rx, done_tx).await
        });
        let started = Instant::now();
        let stream = TcpStream::connect(address).await.unwrap();
        let until = Some(started + Duration::from_secs(2));
        let seen = watch_for(stream, true, started, until, true).await;
        if seen.open {
            ending_tx.send(Ending::Now).unwrap();
        }
        (seen, ending_tx, server)
    }

    /// How long `served_with`'s service takes to answer.
    const ANSWER_AFTER: Duration = Duration::from_millis(250);

    #[tokio::test]
    async fn an_answered_call_starts_the_idle_clock_again() {
        let idle = Duration::from_millis(300);
        let (seen, _ending, server) = served_with(
            || http_body_util::Empty::new().map_err(|never| match never {}),
            idling(idle),
        )
        .await;
        let goaway = seen.goaway.expect("a GOAWAY");
        // Quiet from its answer at 250 ms: not before 550 (from the start it would be 300).
        assert!(goaway >= ANSWER_AFTER + idle, "{seen:?}");
        assert!(goaway < ANSWER_AFTER + 2 * idle, "{seen:?}");
        assert_eq!(server.await.unwrap(), Ended::Idle);
    }

    /// An answer that streams for ever (a health Watch).
    struct Endless;

    impl hyper::body::Body for Endless {
        type Data = bytes::Bytes;
        type Error = tonic::Status;

        fn poll_frame(
            self: std::pin::Pin<&mut Self>,
            _cx: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Option<Result<hyper::body::Frame<Self::Data>, Self::Error>>> {
            std::task::Poll::Pending
        }
    }

    #[tokio::test]
    async fn an_answer_still_streaming_keeps_its_connection_from_idling() {
        let idle = Duration::from_millis(100);
        let (seen, _ending, server) = served_with(|| Endless, idling(idle)).await;
        assert!(
            seen.open && seen.goaway.is_none(),
            "idle while streaming: {seen:?}"
        );
        assert_eq!(server.await.unwrap(), Ended::Cut, "ended by the test");
    }

    #[tokio::test]
    async fn streams_and_pings_follow_the_lifespan() {
        let lifespan = Lifespan {
            max_concurrent_streams: Some(8),
            keepalive_time: Some(Duration::from_millis(100)),
            ..Lifespan::default()
        };
        let (seen, ending, _server) = connect(lifespan, false).await;
        tokio::time::sleep(Duration::from_millis(550)).await;
        ending.send(Ending::Now).unwrap();
        let seen = seen.await.unwrap();
        const MAX_CONCURRENT_STREAMS: u16 = 3;
        assert!(
            seen.settings.contains(&(MAX_CONCURRENT_STREAMS, 8)),
            "{seen:?}"
        );
        assert!(seen.pings >= 3, "{seen:?}");
        let (plain, ending, _server) = connect(Lifespan::default(), false).await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        ending.send(Ending::Now).unwrap();
        let plain = plain.await.unwrap();
        assert_eq!(plain.pings, 0, "{plain:?}");
        assert!(
            plain.settings.contains(&(MAX_CONCURRENT_STREAMS, 200)),
            "hyper's default: {plain:?}"
        );
    }

    #[tokio::test]
    async fn without_an_age_connections_stay_until_the_drain() {
        let (seen, ending, _server) = connect(Lifespan::default(), false).await;
        tokio::time::sleep(Duration::from_millis(400)).await;
        assert!(!seen.is_finished());
        ending.send(Ending::Gracefully).unwrap();
        let seen = tokio::time::timeout(Duration::from_secs(2), seen)
            .await
            .expect("closed after GOAWAY")
            .unwrap();
        assert!(seen.goaway.is_some(), "{seen:?}");
    }

    #[tokio::test]
    async fn a_drain_past_its_grace_closes_connections_with_calls_under_way() {
        let (seen, ending, server) = connect(Lifespan::default(), true).await;
        tokio::time::sleep(Duration::from_millis(100)).await;
        ending.send(Ending::Gracefully).unwrap();
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(!seen.is_finished(), "the call under way keeps it open");
        ending.send(Ending::Now).unwrap();
        let seen = tokio::time::timeout(Duration::from_secs(2), seen)
            .await
            .expect("closed at once")
            .unwrap();
        assert!(seen.goaway.is_some(), "{seen:?}");
        tokio::time::timeout(Duration::from_secs(2), server)
            .await
            .expect("connection task ended")
            .unwrap();
    }
}
