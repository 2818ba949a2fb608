//! The dispatcher against real ZeroMQ sockets: fake workers are DEALER sockets on threads of
//! their own, speaking the wire protocol the way worker/serve.py does.

use std::sync::Arc;
use std::thread;
use std::time::Duration;

use super::*;

/// What a fake worker does with each request it receives.
#[derive(Clone, Copy)]
enum Behaviour {
    /// REPLY with the request's own tensors and frames.
    Echo,
    /// ERROR with INVALID_ARGUMENT.
    Refuse,
    /// Say BYE instead of answering, then stop.
    LeaveMidRequest,
    /// Never answer, never beat again.
    GoSilent,
}

struct FakeWorker {
    handle: Option<thread::JoinHandle<u32>>,
    stop: Arc<std::sync::atomic::AtomicBool>,
}

impl FakeWorker {
    fn start(run_dir: &str, slot: &str, pid: i64, behaviour: Behaviour) -> FakeWorker {
        let endpoint = wire::endpoint(run_dir, wire::WORKERS_ENDPOINT);
        let slot = slot.to_string();
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let stopping = stop.clone();
        let handle = thread::spawn(move || {
            let context = zmq::Context::new();
            let socket = context.socket(zmq::DEALER).unwrap();
            socket
                .set_identity(format!("{slot}:{pid}").as_bytes())
                .unwrap();
            socket.set_linger(0).unwrap();
            socket.connect(&endpoint).unwrap();
            let ready = rmp_serde::to_vec_named(&serde_json::json!({
                "v": 1, "k": "ready", "slot": slot, "pid": pid, "model": "m", "version": 1,
                "weights": null
            }))
            .unwrap();
            socket.send_multipart([ready, Vec::new()], 0).unwrap();
            let mut served = 0;
            let mut beat = std::time::Instant::now();
            while !stopping.load(Ordering::Relaxed) {
                if beat.elapsed() > Duration::from_millis(100)
                    && !matches!(behaviour, Behaviour::GoSilent)
                {
                    let hb = rmp_serde::to_vec_named(&serde_json::json!({
                        "v": 1, "k": "hb", "slot": slot, "pid": pid, "served": served
                    }))
                    .unwrap();
                    socket.send(hb, 0).unwrap();
                    beat = std::time::Instant::now();
                }
                if socket.poll(zmq::POLLIN, 20).unwrap() == 0 {
                    continue;
                }
                let frames = socket.recv_multipart(0).unwrap();
                let header: serde_json::Value = rmp_serde::from_slice(&frames[0]).unwrap();
                if header["k"] != "req" {
                    continue;
                }
                let id = header["id"].as_u64().unwrap();
                served += 1;
                let reply = match behaviour {
                    Behaviour::Echo => {
                        serde_json::json!({"v": 1, "k": "reply", "id": id, "tensors": header["tensors"], "t": [1, 2]})
                    }
                    Behaviour::Refuse => {
                        serde_json::json!({"v": 1, "k": "error", "id": id, "code": 3, "message": "bad id"})
                    }
                    Behaviour::LeaveMidRequest => {
                        let bye = serde_json::json!({"v": 1, "k": "bye", "slot": slot, "pid": pid});
                        socket
                            .send(rmp_serde::to_vec_named(&bye).unwrap(), 0)
                            .unwrap();
                        break;
                    }
                    Behaviour::GoSilent => continue,
                };
                let mut out = vec![rmp_serde::to_vec_named(&reply).unwrap()];
                out.extend(frames.into_iter().skip(1));
                socket.send_multipart(out, 0).unwrap();
            }
            served
        });
        FakeWorker {
            handle: Some(handle),
            stop,
        }
    }

    fn served(mut self) -> u32 {
        self.stop.store(true, Ordering::Relaxed);
        self.handle.take().map(|h| h.join().unwrap()).unwrap_or(0)
    }
}

impl Drop for FakeWorker {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

fn run_dir() -> (tempdir::Dir, String) {
    let dir = tempdir::Dir::new();
    let path = dir.path.to_string_lossy().to_string();
    (dir, path)
}

mod tempdir {
    pub struct Dir {
        pub path: std::path::PathBuf,
    }
    impl Dir {
        pub fn new() -> Dir {
            let path = std::env::temp_dir().join(format!(
                "mpr-{}-{}",
                std::process::id(),
                super::COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            ));
            std::fs::create_dir_all(&path).unwrap();
            Dir { path }
        }
    }
    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.path);
        }
    }
}

static COUNTER: AtomicU64 = AtomicU64::new(0);

fn start(run_dir: &str, timeout: Duration) -> (Dispatcher, Arc<RouterState>) {
    let (state, _drains) = RouterState::new();
    let state = Arc::new(state);
    let model = ServedModel {
        name: "m".into(),
        version: 1,
    };
    let dispatcher =
        Dispatcher::start(run_dir, model, timeout, Policy::RoundRobin, state.clone()).unwrap();
    (dispatcher, state)
}

fn request() -> WorkRequest {
    WorkRequest {
        signature: "serving_default".into(),
        tensors: vec![("x".into(), 1, vec![1, 2])],
        frames: vec![Bytes::from_static(&[0, 0, 128, 63, 0, 0, 0, 64])],
        outputs: vec!["x".into()],
    }
}

async fn ready(dispatcher: &Dispatcher, n: usize) {
    let mut ready = dispatcher.ready_workers();
    tokio::time::timeout(Duration::from_secs(10), ready.wait_for(|r| *r >= n))
        .await
        .expect("workers registered in time")
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_is_answered_with_the_workers_frames() {
    let (_dir, dir) = run_dir();
    let (dispatcher, _state) = start(&dir, Duration::from_secs(3));
    let worker = FakeWorker::start(&dir, "cpu-0", 100, Behaviour::Echo);
    ready(&dispatcher, 1).await;
    let reply = dispatcher.call(request(), None).await.unwrap();
    assert_eq!(reply.tensors, vec![("x".to_string(), 1, vec![1, 2])]);
    assert_eq!(&reply.frames[0][..], &[0, 0, 128, 63, 0, 0, 0, 64]);
    assert!(
        dispatcher.signatures().borrow().is_some(),
        "learned from READY"
    );
    assert_eq!(worker.served(), 1);
    dispatcher.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_workers_error_reaches_the_caller_with_its_code() {
    let (_dir, dir) = run_dir();
    let (dispatcher, _state) = start(&dir, Duration::from_secs(3));
    let _worker = FakeWorker::start(&dir, "cpu-0", 100, Behaviour::Refuse);
    ready(&dispatcher, 1).await;
    let error = dispatcher.call(request(), None).await.unwrap_err();
    assert_eq!(error, ServingError::new(Code::InvalidArgument, "bad id"));
    dispatcher.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_whose_worker_leaves_is_retried_on_another() {
    let (_dir, dir) = run_dir();
    let (dispatcher, state) = start(&dir, Duration::from_secs(3));
    let _leaver = FakeWorker::start(&dir, "cpu-0", 100, Behaviour::LeaveMidRequest);
    let good = FakeWorker::start(&dir, "cpu-1", 101, Behaviour::Echo);
    ready(&dispatcher, 2).await;
    // Round-robin starts at cpu-0, the one that leaves.
    let reply = dispatcher
        .call(request(), Some(Instant::now() + Duration::from_secs(5)))
        .await;
    assert!(reply.is_ok(), "{reply:?}");
    assert_eq!(state.retries.load(Ordering::Relaxed), 1);
    assert_eq!(good.served(), 1);
    dispatcher.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_worker_is_declared_dead_and_its_request_retried() {
    let (_dir, dir) = run_dir();
    let (dispatcher, state) = start(&dir, Duration::from_millis(400));
    let _silent = FakeWorker::start(&dir, "cpu-0", 100, Behaviour::GoSilent);
    let good = FakeWorker::start(&dir, "cpu-1", 101, Behaviour::Echo);
    ready(&dispatcher, 2).await;
    let started = Instant::now();
    let reply = dispatcher
        .call(request(), Some(Instant::now() + Duration::from_secs(5)))
        .await;
    assert!(reply.is_ok(), "{reply:?}");
    assert!(
        started.elapsed() >= Duration::from_millis(300),
        "waited for the liveness window"
    );
    assert_eq!(state.retries.load(Ordering::Relaxed), 1);
    assert_eq!(good.served(), 1);
    dispatcher.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_workers_a_deadline_ends_the_wait() {
    let (_dir, dir) = run_dir();
    let (dispatcher, _state) = start(&dir, Duration::from_secs(3));
    let error = dispatcher
        .call(request(), Some(Instant::now() + Duration::from_millis(200)))
        .await
        .unwrap_err();
    assert_eq!(error.code, Code::DeadlineExceeded);
    dispatcher.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_outliving_its_deadline_is_forgotten() {
    let (_dir, dir) = run_dir();
    let (dispatcher, _state) = start(&dir, Duration::from_secs(30));
    let _silent = FakeWorker::start(&dir, "cpu-0", 100, Behaviour::GoSilent);
    ready(&dispatcher, 1).await;
    let error = dispatcher
        .call(request(), Some(Instant::now() + Duration::from_millis(200)))
        .await
        .unwrap_err();
    assert_eq!(
        error,
        ServingError::new(Code::DeadlineExceeded, "Deadline Exceeded")
    );
    dispatcher.shutdown();
}

#[test]
fn an_unknown_heartbeat_is_asked_to_register_again() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let (_dir, dir) = run_dir();
    let (dispatcher, _state) = runtime.block_on(async { start(&dir, Duration::from_secs(3)) });
    let context = zmq::Context::new();
    let socket = context.socket(zmq::DEALER).unwrap();
    socket.set_identity(b"cpu-9:9").unwrap();
    socket.set_linger(0).unwrap();
    socket
        .connect(&wire::endpoint(&dir, wire::WORKERS_ENDPOINT))
        .unwrap();
    let hb = rmp_serde::to_vec_named(
        &serde_json::json!({"v": 1, "k": "hb", "slot": "cpu-9", "pid": 9, "served": 0}),
    )
    .unwrap();
    socket.send(hb, 0).unwrap();
    assert_eq!(socket.poll(zmq::POLLIN, 5000).unwrap(), 1);
    let frames = socket.recv_multipart(0).unwrap();
    let header: serde_json::Value = rmp_serde::from_slice(&frames[0]).unwrap();
    assert_eq!(header["k"], "who");
    dispatcher.shutdown();
}
