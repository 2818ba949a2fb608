//! The dispatcher against real ZeroMQ sockets: fake workers are DEALER sockets on threads of
//! their own, speaking the wire protocol the way worker/serve.py does.

use std::sync::Arc;
use std::thread;
use std::time::Duration;

use super::*;
use crate::config::ModelEntry;

/// What a fake worker does with each request it receives.
#[derive(Clone, Copy)]
enum Behaviour {
    /// REPLY with the request's own tensors and frames.
    Echo,
    /// ERROR with INVALID_ARGUMENT.
    Refuse,
    /// Say BYE instead of answering, then stop.
    LeaveMidRequest,
    /// Close the socket with no BYE on receiving a request, as a process that dies on it.
    DieMidRequest,
    /// Never answer, never beat again.
    GoSilent,
    /// Echo after computing for this many ms (one request at a time, as a worker does).
    SlowEcho(u64),
    /// Echo after 20 ms, but refuse (INVALID_ARGUMENT) a call of more rows than this.
    RefuseAbove(i64),
    /// Echo after 20 ms, but die (as DieMidRequest) on a call of more rows than this.
    DieAbove(i64),
    /// ERROR (DEADLINE_EXCEEDED) then BYE, and stop: a worker whose call ran past
    /// --call-timeout.
    TimeOutThenLeave,
    /// Echo after 100 ms a call of at most this many rows, TimeOutThenLeave on a larger one.
    TimeOutThenLeaveAbove(i64),
}

struct FakeWorker {
    handle: Option<thread::JoinHandle<u32>>,
    stop: Arc<std::sync::atomic::AtomicBool>,
    /// The rows (first input's first dimension) of each request, in the order received.
    rows_seen: Arc<std::sync::Mutex<Vec<i64>>>,
}

impl FakeWorker {
    fn start(run_dir: &str, slot: &str, pid: i64, behaviour: Behaviour) -> FakeWorker {
        FakeWorker::serving(run_dir, slot, pid, 1, behaviour)
    }

    /// A worker of model version `version`.
    fn serving(
        run_dir: &str,
        slot: &str,
        pid: i64,
        version: i64,
        behaviour: Behaviour,
    ) -> FakeWorker {
        FakeWorker::of_model(run_dir, slot, pid, "m", version, behaviour)
    }

    /// A worker of `model`'s version `version`.
    fn of_model(
        run_dir: &str,
        slot: &str,
        pid: i64,
        model: &str,
        version: i64,
        behaviour: Behaviour,
    ) -> FakeWorker {
        let model = model.to_string();
        let endpoint = wire::endpoint(run_dir, wire::WORKERS_ENDPOINT);
        let slot = slot.to_string();
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let stopping = stop.clone();
        let rows_seen = Arc::new(std::sync::Mutex::new(Vec::new()));
        let seen = rows_seen.clone();
        let handle = thread::spawn(move || {
            let context = zmq::Context::new();
            let socket = context.socket(zmq::DEALER).unwrap();
            socket
                .set_identity(format!("{slot}:{pid}").as_bytes())
                .unwrap();
            socket.set_linger(0).unwrap();
            socket.connect(&endpoint).unwrap();
            let ready = rmp_serde::to_vec_named(&serde_json::json!({
                "v": 1, "k": "ready", "slot": slot, "pid": pid, "model": model,
                "version": version, "weights": null
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
                let rows = header["tensors"][0][2][0].as_i64().unwrap_or(-1);
                seen.lock().unwrap().push(rows);
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
                    Behaviour::DieMidRequest => break,
                    Behaviour::TimeOutThenLeaveAbove(most) if rows <= most => {
                        thread::sleep(Duration::from_millis(100));
                        serde_json::json!({"v": 1, "k": "reply", "id": id, "tensors": header["tensors"], "t": [0, 100_000]})
                    }
                    Behaviour::TimeOutThenLeave | Behaviour::TimeOutThenLeaveAbove(_) => {
                        let error = serde_json::json!({"v": 1, "k": "error", "id": id, "code": 4, "message": "the model call ran too long"});
                        let bye = serde_json::json!({"v": 1, "k": "bye", "slot": slot, "pid": pid});
                        for message in [error, bye] {
                            let message = rmp_serde::to_vec_named(&message).unwrap();
                            socket.send(message, 0).unwrap();
                        }
                        break;
                    }
                    Behaviour::DieAbove(most) if rows > most => break,
                    Behaviour::GoSilent => continue,
                    Behaviour::RefuseAbove(most) if rows > most => {
                        thread::sleep(Duration::from_millis(20));
                        serde_json::json!({"v": 1, "k": "error", "id": id, "code": 3, "message": "too many rows"})
                    }
                    Behaviour::RefuseAbove(_) | Behaviour::DieAbove(_) => {
                        thread::sleep(Duration::from_millis(20));
                        serde_json::json!({"v": 1, "k": "reply", "id": id, "tensors": header["tensors"], "t": [0, 20_000]})
                    }
                    Behaviour::SlowEcho(ms) => {
                        // Stamped on the wall clock, as a worker stamps its model call.
                        let start = wall_micros();
                        thread::sleep(Duration::from_millis(ms));
                        serde_json::json!({"v": 1, "k": "reply", "id": id, "tensors": header["tensors"], "t": [start, wall_micros()]})
                    }
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
            rows_seen,
        }
    }

    fn rows_seen(&self) -> Vec<i64> {
        self.rows_seen.lock().unwrap().clone()
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
    let models = [ModelEntry::new("m", 1)];
    let dispatcher = Dispatcher::start(
        run_dir,
        &models,
        timeout,
        &Scheduling::default(),
        state.clone(),
    )
    .unwrap();
    (dispatcher, state)
}

fn start_scheduled(run_dir: &str, scheduling: &Scheduling) -> (Dispatcher, Arc<RouterState>) {
    let (state, _drains) = RouterState::new();
    let state = Arc::new(state);
    let models = [ModelEntry::new("m", 1)];
    let timeout = Duration::from_secs(3);
    let dispatcher =
        Dispatcher::start(run_dir, &models, timeout, scheduling, state.clone()).unwrap();
    (dispatcher, state)
}

/// A request of `rows` rows of one float.
fn rows_request(rows: usize) -> WorkRequest {
    WorkRequest {
        target: Target {
            model: 0,
            version: 1,
            pinned: false,
        },
        signature: "serving_default".into(),
        tensors: vec![("x".into(), 1, vec![rows as i64, 1])],
        frames: vec![Bytes::from(vec![0u8; 4 * rows])],
        outputs: vec!["x".into()],
        row_wise: true,
        memory: Default::default(),
    }
}

/// With one worker busy on a first request: a large request arrives, then three small ones;
/// the order in which the worker gets them.
async fn order_received(scheduling: Scheduling) -> (Vec<i64>, Arc<RouterState>) {
    let (_dir, dir) = run_dir();
    let (dispatcher, state) = start_scheduled(&dir, &scheduling);
    let worker = FakeWorker::start(&dir, "cpu-0", 100, Behaviour::SlowEcho(40));
    ready(&dispatcher, 1).await;
    let mut calls = Vec::new();
    for rows in [1, 512, 2, 3, 4] {
        let d = dispatcher.clone();
        calls.push(tokio::spawn(async move {
            d.call(rows_request(rows), None).await
        }));
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    for call in calls {
        assert!(call.await.unwrap().is_ok());
    }
    assert_eq!(state.queued.load(Ordering::Relaxed), 0);
    let seen = worker.rows_seen();
    dispatcher.shutdown();
    (seen, state)
}

fn scheduling(queue: &str, aging_ms: u64) -> Scheduling {
    Scheduling {
        queue: queue.into(),
        aging_bound: Duration::from_millis(aging_ms),
        worker_inflight: 1,
        ..Scheduling::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fcfs_sends_in_arrival_order_when_the_worker_is_full() {
    let (seen, state) = order_received(scheduling("fcfs", 50)).await;
    assert_eq!(seen, [1, 512, 2, 3, 4]);
    // The last one waited for the four before it: ~4 × 40 ms less its 20 ms head start.
    let waited = state.queue_wait_max_us.load(Ordering::Relaxed);
    assert!(waited > 100_000, "{waited}");
    // Every request's wait is in the histogram: about 35 + 70 + 105 + 140 ms for the four
    // behind the first (each arrived 5 ms after the one before it, each call takes 40).
    assert_eq!(state.front_door_wait.count(), 5);
    assert!(state.front_door_wait.sum() > Duration::from_millis(200));
    // The hand-over to the worker (sent until its call started) is one per request, and a
    // worker that was waiting starts within much less than a call.
    assert_eq!(state.handoff.count(), 5);
    assert_eq!(state.reply.count(), 5);
    assert!(state.handoff.sum() < Duration::from_millis(5 * 40));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sjf_lets_small_requests_overtake_a_large_one() {
    let (seen, _) = order_received(scheduling("sjf", 1000)).await;
    assert_eq!(seen, [1, 2, 3, 4, 512]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sjf_aging_sends_an_overdue_large_request_first() {
    // Bound 10 ms: by the time the first request is done (40 ms) the large one is at risk.
    let (seen, _) = order_received(scheduling("sjf", 10)).await;
    assert_eq!(seen, [1, 512, 2, 3, 4]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queued_request_past_its_deadline_leaves_the_queue() {
    let (_dir, dir) = run_dir();
    let (dispatcher, state) = start_scheduled(&dir, &scheduling("sjf", 50));
    let worker = FakeWorker::start(&dir, "cpu-0", 100, Behaviour::SlowEcho(300));
    ready(&dispatcher, 1).await;
    let d = dispatcher.clone();
    let first = tokio::spawn(async move { d.call(rows_request(1), None).await });
    tokio::time::sleep(Duration::from_millis(20)).await;
    let error = dispatcher
        .call(
            rows_request(1),
            Some(Instant::now() + Duration::from_millis(50)),
        )
        .await
        .unwrap_err();
    assert_eq!(error.code, Code::DeadlineExceeded);
    assert!(first.await.unwrap().is_ok());
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(state.queued.load(Ordering::Relaxed), 0);
    // The timed-out request never reached the worker.
    assert_eq!(worker.rows_seen(), [1]);
    dispatcher.shutdown();
}

fn request() -> WorkRequest {
    WorkRequest {
        target: Target {
            model: 0,
            version: 1,
            pinned: false,
        },
        signature: "serving_default".into(),
        tensors: vec![("x".into(), 1, vec![1, 2])],
        frames: vec![Bytes::from_static(&[0, 0, 128, 63, 0, 0, 0, 64])],
        outputs: vec!["x".into()],
        row_wise: true,
        memory: Default::default(),
    }
}

/// `n` workers of the same behaviour, slots cpu-0.. and pids 100..
fn workers(run_dir: &str, n: i64, behaviour: Behaviour) -> Vec<FakeWorker> {
    (0..n)
        .map(|i| FakeWorker::start(run_dir, &format!("cpu-{i}"), 100 + i, behaviour))
        .collect()
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
        dispatcher.signatures().borrow().contains_key(&V1),
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
async fn a_request_every_worker_dies_on_is_given_up_after_max_sends() {
    let (_dir, dir) = run_dir();
    let (dispatcher, state) = start(&dir, Duration::from_secs(3));
    let dying = workers(&dir, 4, Behaviour::DieMidRequest);
    ready(&dispatcher, 4).await;
    let error = dispatcher
        .call(request(), Some(Instant::now() + Duration::from_secs(5)))
        .await
        .expect_err("every worker dies on it");
    assert_eq!(error.code, Code::Internal);
    assert!(
        error.message.contains("sent to a worker 3 times"),
        "{}",
        error.message
    );
    let reached = dying.iter().filter(|w| !w.rows_seen().is_empty()).count();
    assert_eq!(reached as u32, MAX_SENDS, "one worker is left standing");
    assert_eq!(
        state.retries.load(Ordering::Relaxed),
        u64::from(MAX_SENDS - 1)
    );
    dispatcher.shutdown();
}

/// A query of death in a pool of two: both workers die on it and none is back within the
/// wait. It is given up as after MAX_SENDS (INTERNAL: a client would retry UNAVAILABLE into
/// the restarting workers); one worker lost (killed, not the request's doing as far as
/// anyone knows) leaves a request UNAVAILABLE, as one that never reached a worker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_every_worker_of_the_pool_died_on_is_internal_when_none_comes_back() {
    let (_dir, dir) = run_dir();
    let (mut dispatcher, _state) = start(&dir, Duration::from_secs(3));
    dispatcher.no_worker_wait = Duration::from_millis(300);
    let dying = workers(&dir, 2, Behaviour::DieMidRequest);
    ready(&dispatcher, 2).await;
    let error = dispatcher.call(request(), None).await.unwrap_err();
    assert_eq!(error.code, Code::Internal, "{}", error.message);
    assert!(
        error
            .message
            .starts_with("the request was sent to a worker 2 times")
            && error
                .message
                .ends_with("and no worker is ready to serve the request"),
        "{}",
        error.message
    );
    assert!(dying.iter().all(|w| !w.rows_seen().is_empty()));

    let _lone = FakeWorker::start(&dir, "cpu-7", 107, Behaviour::DieMidRequest);
    ready(&dispatcher, 1).await;
    let error = dispatcher.call(request(), None).await.unwrap_err();
    assert_eq!(
        error,
        ServingError::new(Code::Unavailable, "no worker is ready to serve the request")
    );
    dispatcher.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_that_leave_in_order_do_not_count_against_the_request() {
    // Four workers say BYE on it (drained, retired): more than MAX_SENDS losses, none the
    // request's doing, so it goes on to the worker that answers.
    let (_dir, dir) = run_dir();
    let (dispatcher, state) = start(&dir, Duration::from_secs(3));
    let leaving = workers(&dir, 4, Behaviour::LeaveMidRequest);
    ready(&dispatcher, 4).await;
    let reply = {
        let call = dispatcher.call(request(), Some(Instant::now() + Duration::from_secs(5)));
        // The answering worker joins once the four have each been sent the request (or
        // after 5 s: it then finds the request given up, and the test fails).
        let late = async {
            let give_up = Instant::now() + Duration::from_secs(5);
            while leaving.iter().any(|w| w.rows_seen().is_empty()) && Instant::now() < give_up {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            FakeWorker::start(&dir, "cpu-9", 109, Behaviour::Echo)
        };
        let (reply, answering) = tokio::join!(call, late);
        let reply = reply.expect("answered after four orderly losses");
        assert_eq!(answering.served(), 1);
        reply
    };
    assert_eq!(reply.slot, "cpu-9");
    assert_eq!(state.retries.load(Ordering::Relaxed), 4);
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

// ---------------------------------------------------------------------------------------
// Scripted workers: a bare DEALER the test drives step by step (blocking calls on the test's
// own thread while the dispatcher runs on the runtime's threads), as the Python tests did.
// ---------------------------------------------------------------------------------------

const WAIT: Duration = Duration::from_secs(5);

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

fn pack(value: serde_json::Value) -> Vec<u8> {
    rmp_serde::to_vec_named(&value).unwrap()
}

struct Scripted {
    socket: zmq::Socket,
    slot: String,
    pid: i64,
    _context: zmq::Context,
}

impl Scripted {
    fn connect(run_dir: &str, slot: &str, pid: i64) -> Scripted {
        let context = zmq::Context::new();
        let socket = context.socket(zmq::DEALER).unwrap();
        socket
            .set_identity(format!("{slot}:{pid}").as_bytes())
            .unwrap();
        socket.set_linger(0).unwrap();
        socket
            .connect(&wire::endpoint(run_dir, wire::WORKERS_ENDPOINT))
            .unwrap();
        Scripted {
            socket,
            slot: slot.to_string(),
            pid,
            _context: context,
        }
    }

    /// Connected, READY sent, and known to the front door.
    fn registered(run_dir: &str, slot: &str, pid: i64) -> Scripted {
        let worker = Scripted::connect(run_dir, slot, pid);
        worker.ready();
        wait_until(&format!("{slot} registered"), || {
            registered(run_dir, slot, pid)
        });
        worker
    }

    fn ready(&self) {
        let header = pack(serde_json::json!({
            "v": 1, "k": "ready", "slot": self.slot, "pid": self.pid, "model": "m", "version": 1
        }));
        self.socket.send_multipart([header, Vec::new()], 0).unwrap();
    }

    fn heartbeat(&self) {
        let header = pack(serde_json::json!({
            "v": 1, "k": "hb", "slot": self.slot, "pid": self.pid, "served": 0
        }));
        self.socket.send(header, 0).unwrap();
    }

    /// The next message from the front door: its header and the frames after it.
    fn receive(&self) -> (serde_json::Value, Vec<Vec<u8>>) {
        let timeout = WAIT.as_millis() as i64;
        assert_eq!(
            self.socket.poll(zmq::POLLIN, timeout).unwrap(),
            1,
            "{} heard nothing",
            self.slot
        );
        let mut frames = self.socket.recv_multipart(0).unwrap();
        let header = rmp_serde::from_slice(&frames.remove(0)).unwrap();
        (header, frames)
    }

    fn next_request(&self) -> (serde_json::Value, Vec<Vec<u8>>) {
        let (header, frames) = self.receive();
        assert_eq!(header["k"], "req", "{header}");
        (header, frames)
    }

    /// REPLY with the request's own tensors and frames.
    fn answer(&self, request: &serde_json::Value, frames: Vec<Vec<u8>>) {
        let head = pack(serde_json::json!({
            "v": 1, "k": "reply", "id": request["id"], "tensors": request["tensors"], "t": [10, 20]
        }));
        let mut out = vec![head];
        out.extend(frames);
        self.socket.send_multipart(out, 0).unwrap();
    }
}

/// One request/reply on the control channel, as the controller's RouterLink does it.
fn control(run_dir: &str, body: Vec<u8>) -> serde_json::Value {
    let context = zmq::Context::new();
    let socket = context.socket(zmq::DEALER).unwrap();
    socket.set_linger(0).unwrap();
    socket
        .connect(&wire::endpoint(run_dir, wire::CONTROL_ENDPOINT))
        .unwrap();
    socket.send_multipart([Vec::new(), body], 0).unwrap();
    assert_eq!(
        socket.poll(zmq::POLLIN, WAIT.as_millis() as i64).unwrap(),
        1,
        "the control channel answered"
    );
    let mut frames = socket.recv_multipart(0).unwrap();
    assert_eq!(frames.len(), 2, "[empty delimiter, reply]");
    rmp_serde::from_slice(&frames.pop().unwrap()).unwrap()
}

fn ask(run_dir: &str, request: serde_json::Value) -> serde_json::Value {
    control(run_dir, pack(request))
}

fn snapshot(run_dir: &str) -> serde_json::Value {
    ask(
        run_dir,
        serde_json::json!({"v": 1, "op": "snapshot", "n": 1}),
    )
}

fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let until = std::time::Instant::now() + WAIT;
    while !done() {
        assert!(std::time::Instant::now() < until, "timed out: {what}");
        thread::sleep(Duration::from_millis(5));
    }
}

fn registered(run_dir: &str, slot: &str, pid: i64) -> bool {
    snapshot(run_dir)["workers"][slot]["pid"] == pid
}

fn start_in(runtime: &tokio::runtime::Runtime, dir: &str, timeout: Duration) -> Dispatcher {
    runtime.block_on(async { start(dir, timeout).0 })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_requests_are_matched_to_their_replies() {
    let (_dir, dir) = run_dir();
    let (dispatcher, _state) = start(&dir, Duration::from_secs(3));
    let _a = FakeWorker::start(&dir, "cpu-0", 100, Behaviour::Echo);
    let _b = FakeWorker::start(&dir, "cpu-1", 101, Behaviour::Echo);
    ready(&dispatcher, 2).await;
    let calls = (0..20u8).map(|i| {
        let dispatcher = dispatcher.clone();
        tokio::spawn(async move {
            let mut request = request();
            request.frames = vec![Bytes::from(vec![i; 8])];
            dispatcher.call(request, None).await
        })
    });
    let mut slots = std::collections::BTreeSet::new();
    for (i, call) in calls.collect::<Vec<_>>().into_iter().enumerate() {
        let reply = call.await.unwrap().unwrap();
        assert_eq!(&reply.frames[0][..], &[i as u8; 8]);
        slots.insert(reply.slot);
    }
    assert_eq!(slots.len(), 2, "both workers served");
    dispatcher.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_waits_for_a_worker_that_is_starting() {
    let (_dir, dir) = run_dir();
    let (dispatcher, _state) = start(&dir, Duration::from_secs(3));
    let call = tokio::spawn({
        let dispatcher = dispatcher.clone();
        async move { dispatcher.call(request(), None).await }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!call.is_finished());
    let _worker = FakeWorker::start(&dir, "cpu-0", 100, Behaviour::Echo);
    let reply = tokio::time::timeout(WAIT, call).await.unwrap().unwrap();
    assert_eq!(reply.unwrap().slot, "cpu-0");
    dispatcher.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_worker_at_all_is_unavailable_after_the_wait() {
    let (_dir, dir) = run_dir();
    let (mut dispatcher, _state) = start(&dir, Duration::from_secs(3));
    dispatcher.no_worker_wait = Duration::from_millis(200);
    let started = Instant::now();
    let error = dispatcher.call(request(), None).await.unwrap_err();
    assert_eq!(
        error,
        ServingError::new(Code::Unavailable, "no worker is ready to serve the request")
    );
    assert!(started.elapsed() >= Duration::from_millis(150));
    // A deadline shorter than the wait: the deadline is what the client hears about.
    dispatcher.no_worker_wait = NO_WORKER_WAIT;
    let started = Instant::now();
    let error = dispatcher
        .call(request(), Some(started + Duration::from_millis(50)))
        .await
        .unwrap_err();
    assert_eq!(error.code, Code::DeadlineExceeded);
    assert!(started.elapsed() < Duration::from_secs(2));
    dispatcher.shutdown();
}

fn slot(state: &'static str, version: i64) -> crate::state::SlotSample {
    crate::state::SlotSample {
        slot: format!("cpu-{state}@{version}"),
        state,
        restarts: 3,
        model: "m".to_string(),
        version,
    }
}

/// Every slot of the version FATAL (the controller's word): nothing comes back before
/// --fatal-retry-after, so the request fails at once and says why. One slot still backing off
/// (or nothing said of the version) keeps the wait, as a restart does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_version_whose_every_slot_is_fatal_is_unavailable_at_once() {
    let (_dir, dir) = run_dir();
    let (mut dispatcher, state) = start(&dir, Duration::from_secs(3));
    dispatcher.no_worker_wait = Duration::from_millis(300);
    state.set_slots(vec![slot("FATAL", 1), slot("FATAL", 1), slot("READY", 2)]);
    let started = Instant::now();
    let error = dispatcher.call(request(), None).await.unwrap_err();
    assert_eq!(error.code, Code::Unavailable);
    assert_eq!(
        error.message,
        "no worker can serve model m version 1: each of its workers failed (FATAL; \
         `mpspool status` says why)"
    );
    assert!(started.elapsed() < Duration::from_millis(250));

    for waited_for in [
        vec![slot("FATAL", 1), slot("BACKOFF", 1)],
        vec![slot("FATAL", 2)],
        vec![],
    ] {
        state.set_slots(waited_for);
        let started = Instant::now();
        let error = dispatcher.call(request(), None).await.unwrap_err();
        assert_eq!(error.message, "no worker is ready to serve the request");
        assert!(started.elapsed() >= Duration::from_millis(250));
    }

    // A worker back (its slot's retry after the cool-down) serves, whatever was said before.
    state.set_slots(vec![slot("FATAL", 1)]);
    let worker = FakeWorker::start(&dir, "cpu-0", 100, Behaviour::Echo);
    ready(&dispatcher, 1).await;
    dispatcher.call(request(), None).await.unwrap();
    assert_eq!(worker.served(), 1);
    dispatcher.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_error_reply_is_an_answer_and_is_not_retried() {
    let (_dir, dir) = run_dir();
    let (dispatcher, state) = start(&dir, Duration::from_secs(3));
    let refuser = FakeWorker::start(&dir, "cpu-0", 100, Behaviour::Refuse);
    let _good = FakeWorker::start(&dir, "cpu-1", 101, Behaviour::Echo);
    ready(&dispatcher, 2).await;
    // Round-robin: the first call goes to cpu-0.
    let error = dispatcher.call(request(), None).await.unwrap_err();
    assert_eq!(error.code, Code::InvalidArgument);
    assert_eq!(state.retries.load(Ordering::Relaxed), 0);
    assert_eq!(refuser.served(), 1);
    dispatcher.shutdown();
}

#[test]
fn a_heartbeat_with_weights_replaces_readys_and_the_copied_gauge_follows() {
    // A worker whose serving copied a variable out of the segment says so in a heartbeat;
    // heartbeats without weights leave what it said before.
    let runtime = runtime();
    let (_dir, dir) = run_dir();
    let (dispatcher, _state) = runtime.block_on(async { start(&dir, Duration::from_secs(30)) });
    let copied = dispatcher.copied_weights();
    let worker = Scripted::registered(&dir, "cpu-0", 100);
    worker.heartbeat();
    let weights = serde_json::json!({
        "segment": "/dev/shm/x", "shared_bytes": 512, "copied": {"table:0": 256},
        "at_risk": {"table:0": "ResourceScatterAdd writes it"}
    });
    worker
        .socket
        .send(
            pack(serde_json::json!({
                "v": 1, "k": "hb", "slot": "cpu-0", "pid": 100, "served": 3, "weights": weights
            })),
            0,
        )
        .unwrap();
    wait_until("the copy shown", || {
        snapshot(&dir)["workers"]["cpu-0"]["weights"] == weights
    });
    assert_eq!(
        copied.borrow().clone(),
        std::collections::BTreeMap::from([("cpu-0".to_string(), 256)])
    );
    worker.heartbeat();
    // An answer sent after it: once it is back, the heartbeat before it was read.
    let call = runtime.spawn({
        let dispatcher = dispatcher.clone();
        async move { dispatcher.call(request(), None).await }
    });
    let (held, frames) = worker.next_request();
    worker.answer(&held, frames);
    runtime.block_on(call).unwrap().unwrap();
    assert_eq!(snapshot(&dir)["workers"]["cpu-0"]["weights"], weights);
    assert_eq!(copied.borrow().get("cpu-0"), Some(&256));
    dispatcher.shutdown();
}

#[test]
fn a_warm_up_is_recorded_once_per_worker_process() {
    // READY comes again from the same process on each reconnection and REREGISTER; its
    // warm-up ran once. A second process of the slot warmed up again.
    let runtime = runtime();
    let (_dir, dir) = run_dir();
    let (dispatcher, state) = runtime.block_on(async { start(&dir, Duration::from_secs(30)) });
    let ready_with_warmup = |worker: &Scripted| {
        let header = pack(serde_json::json!({
            "v": 1, "k": "ready", "slot": worker.slot, "pid": worker.pid, "model": "m",
            "version": 1, "warmup": ["/models/m/1", 1000, 3]
        }));
        worker
            .socket
            .send_multipart([header, Vec::new()], 0)
            .unwrap();
    };
    let first = Scripted::connect(&dir, "cpu-0", 100);
    ready_with_warmup(&first);
    wait_until("cpu-0 registered", || registered(&dir, "cpu-0", 100));
    ready_with_warmup(&first);
    // An answer on the same connection after it: once it is back, that READY was read.
    let call = runtime.spawn({
        let dispatcher = dispatcher.clone();
        async move { dispatcher.call(request(), None).await }
    });
    let (held, frames) = first.next_request();
    first.answer(&held, frames);
    runtime.block_on(call).unwrap().unwrap();
    let second = Scripted::connect(&dir, "cpu-0", 101);
    ready_with_warmup(&second);
    wait_until("its next process registered", || {
        registered(&dir, "cpu-0", 101)
    });
    let page = || {
        let mut page = String::new();
        state.warmup.render(&mut page);
        page
    };
    let labels = "model_path=\"/models/m/1\",status=\"OK\"";
    assert!(
        page().contains(&format!(
            ":tensorflow:serving:model_warmup_records_read{{{labels}}} 6\n"
        )),
        "{}",
        page()
    );
    assert!(page().contains(&format!(
        ":tensorflow:serving:model_warmup_latency_count{{{labels}}} 2\n"
    )));
    drop(first);
    dispatcher.shutdown();
}

#[test]
fn a_worker_reported_gone_has_its_request_retried_and_its_late_reply_dropped() {
    let runtime = runtime();
    let (_dir, dir) = run_dir();
    let (dispatcher, state) = runtime.block_on(async { start(&dir, Duration::from_secs(30)) });
    let a = Scripted::registered(&dir, "cpu-0", 100);
    let call = runtime.spawn({
        let dispatcher = dispatcher.clone();
        async move { dispatcher.call(request(), None).await }
    });
    let (held, frames) = a.next_request();
    let b = FakeWorker::start(&dir, "cpu-1", 101, Behaviour::Echo);
    wait_until("cpu-1 registered", || registered(&dir, "cpu-1", 101));
    let gone = ask(
        &dir,
        serde_json::json!({"v": 1, "op": "gone", "slot": "cpu-0", "pid": 100, "n": 5}),
    );
    assert_eq!(gone["ok"], true);
    assert_eq!(gone["n"], 5);
    let reply = runtime.block_on(call).unwrap().unwrap();
    assert_eq!(reply.slot, "cpu-1");
    assert_eq!(state.retries.load(Ordering::Relaxed), 1);
    // The first worker was only presumed gone and answers after all: dropped.
    a.answer(&held, frames);
    let reply = runtime
        .block_on(dispatcher.call(request(), Some(Instant::now() + WAIT)))
        .unwrap();
    assert_eq!(reply.slot, "cpu-1");
    assert_eq!(b.served(), 2);
    assert_eq!(snapshot(&dir)["inflight"], 0);
    dispatcher.shutdown();
}

#[test]
fn a_worker_whose_connection_closes_leaves_at_once_and_its_request_is_retried() {
    let runtime = runtime();
    let (_dir, dir) = run_dir();
    // A long liveness window and no controller: only the closed connection can tell.
    let (dispatcher, state) = runtime.block_on(async { start(&dir, Duration::from_secs(30)) });
    let a = Scripted::registered(&dir, "cpu-0", 100);
    let call = runtime.spawn({
        let dispatcher = dispatcher.clone();
        async move { dispatcher.call(request(), None).await }
    });
    let _held = a.next_request();
    let b = FakeWorker::start(&dir, "cpu-1", 101, Behaviour::Echo);
    wait_until("cpu-1 registered", || registered(&dir, "cpu-1", 101));
    let closed = std::time::Instant::now();
    drop(a); // killed mid-request: its connection closes, no BYE, no answer
    let reply = runtime.block_on(call).unwrap().unwrap();
    assert_eq!(reply.slot, "cpu-1");
    assert!(
        closed.elapsed() < Duration::from_secs(5),
        "{:?}",
        closed.elapsed()
    );
    assert_eq!(state.retries.load(Ordering::Relaxed), 1);
    let snap = snapshot(&dir);
    assert_eq!(snap["workers"].as_object().unwrap().len(), 1, "{snap}");
    assert!(
        snap["declared_dead"].as_object().unwrap().is_empty(),
        "a closed connection is not a liveness verdict"
    );
    for _ in 0..3 {
        let reply = runtime
            .block_on(dispatcher.call(request(), Some(Instant::now() + WAIT)))
            .unwrap();
        assert_eq!(reply.slot, "cpu-1");
    }
    assert_eq!(b.served(), 4);
    dispatcher.shutdown();
}

#[test]
fn ready_from_a_declared_dead_incarnation_is_ignored() {
    let runtime = runtime();
    let (_dir, dir) = run_dir();
    let dispatcher = start_in(&runtime, &dir, Duration::from_millis(300));
    let dead = Scripted::connect(&dir, "cpu-0", 100);
    dead.ready();
    wait_until("cpu-0 declared dead", || {
        snapshot(&dir)["declared_dead"] == serde_json::json!({"cpu-0": 100})
    });
    assert_eq!(*dispatcher.ready_workers().borrow(), 0);
    // It woke up: too late, it is being replaced. Messages on one connection arrive in
    // order: once the heartbeat is answered with REREGISTER, the READY before it was
    // handled (and refused).
    dead.ready();
    dead.heartbeat();
    let (header, frames) = dead.receive();
    assert_eq!(header["k"], "who");
    assert!(frames.is_empty());
    let snap = snapshot(&dir);
    assert_eq!(snap["workers"], serde_json::json!({}));
    assert_eq!(snap["declared_dead"], serde_json::json!({"cpu-0": 100}));
    // Its replacement registers normally and clears the verdict.
    let new = Scripted::connect(&dir, "cpu-0", 200);
    new.ready();
    wait_until("cpu-0 replaced", || registered(&dir, "cpu-0", 200));
    assert_eq!(snapshot(&dir)["declared_dead"], serde_json::json!({}));
    dispatcher.shutdown();
}

#[test]
fn bad_messages_do_not_stop_the_actor() {
    let runtime = runtime();
    let (_dir, dir) = run_dir();
    let dispatcher = start_in(&runtime, &dir, Duration::from_secs(30));
    let worker = Scripted::connect(&dir, "cpu-0", 100);
    worker.socket.send(&b"\xc1 not msgpack"[..], 0).unwrap();
    worker
        .socket
        .send(pack(serde_json::json!({"v": 99, "k": "ready"})), 0)
        .unwrap();
    worker
        .socket
        .send(pack(serde_json::json!({"v": 1, "k": "nonsense"})), 0)
        .unwrap();
    // READY without its SignatureDefMap frame.
    let ready = serde_json::json!({
        "v": 1, "k": "ready", "slot": "cpu-0", "pid": 100, "model": "m", "version": 1
    });
    worker.socket.send(pack(ready), 0).unwrap();
    // An empty message (one frame, the identity, at the ROUTER).
    worker.socket.send(Vec::new(), 0).unwrap();
    // A reply to nobody, from nobody.
    let stray = serde_json::json!({"v": 1, "k": "reply", "id": 9, "tensors": []});
    worker.socket.send(pack(stray), 0).unwrap();
    // The control channel shrugs off garbage too.
    let bad = control(&dir, b"\xc1".to_vec());
    assert!(
        bad["error"].as_str().unwrap().contains("undecodable"),
        "{bad}"
    );
    assert_eq!(bad["n"], serde_json::Value::Null);
    let unknown = ask(&dir, serde_json::json!({"v": 1, "op": "dance", "n": 3}));
    assert_eq!(unknown["error"], "unknown op 'dance'");
    assert_eq!(unknown["n"], 3);

    assert!(!registered(&dir, "cpu-0", 100));
    worker.ready();
    wait_until("cpu-0 registered", || registered(&dir, "cpu-0", 100));
    let call = runtime.spawn({
        let dispatcher = dispatcher.clone();
        async move { dispatcher.call(request(), None).await }
    });
    let (held, frames) = worker.next_request();
    worker.answer(&held, frames);
    let reply = runtime.block_on(call).unwrap().unwrap();
    assert_eq!(&reply.frames[0][..], &[0, 0, 128, 63, 0, 0, 0, 64]);
    dispatcher.shutdown();
}

#[test]
fn an_answer_that_cannot_be_read_fails_its_request_instead_of_stranding_it() {
    let runtime = runtime();
    let (_dir, dir) = run_dir();
    let dispatcher = start_in(&runtime, &dir, Duration::from_secs(30));
    let worker = Scripted::registered(&dir, "cpu-0", 100);
    let call = runtime.spawn({
        let dispatcher = dispatcher.clone();
        async move { dispatcher.call(request(), None).await }
    });
    let (held, _) = worker.next_request();
    let broken = serde_json::json!({"v": 1, "k": "reply", "id": held["id"], "tensors": "x"});
    worker.socket.send(pack(broken), 0).unwrap();
    let error = runtime.block_on(call).unwrap().unwrap_err();
    assert_eq!(error.code, Code::Internal);
    assert!(error.message.contains("worker cpu-0"), "{error:?}");
    assert_eq!(snapshot(&dir)["inflight"], 0);
    dispatcher.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_control_snapshot_and_timeline_carry_what_the_controller_reads() {
    let (_dir, dir) = run_dir();
    let (dispatcher, state) = start(&dir, Duration::from_secs(3));
    state.grpc_port.store(8500, Ordering::Relaxed);
    state.metrics_port.store(9090, Ordering::Relaxed);
    let _worker = FakeWorker::start(&dir, "cpu-0", 100, Behaviour::Echo);
    ready(&dispatcher, 1).await;
    dispatcher.call(request(), None).await.unwrap();
    let dir2 = dir.clone();
    let (snap, timeline, cleared) = tokio::task::spawn_blocking(move || {
        (
            snapshot(&dir2),
            ask(
                &dir2,
                serde_json::json!({"v": 1, "op": "timeline", "clear": true, "n": 2}),
            ),
            ask(&dir2, serde_json::json!({"v": 1, "op": "timeline", "n": 3})),
        )
    })
    .await
    .unwrap();
    assert_eq!(snap["phase"], "serving");
    assert_eq!(snap["port"], 8500);
    assert_eq!(snap["metrics_port"], 9090);
    assert_eq!(snap["inflight"], 0);
    assert_eq!(snap["declared_dead"], serde_json::json!({}));
    let worker = &snap["workers"]["cpu-0"];
    assert_eq!(worker["pid"], 100);
    assert_eq!(worker["inflight"], 0);
    assert_eq!(worker["answered"], 1);
    assert!(worker["silent_s"].as_f64().unwrap() < 1.0);
    assert_eq!(worker["weights"], serde_json::Value::Null);
    assert_eq!(timeline["spans"], serde_json::json!([["cpu-0", 1, 2]]));
    assert_eq!(timeline["dropped"], 0);
    assert!(timeline["now_us"].as_i64().unwrap() > 0);
    assert_eq!(timeline["n"], 2);
    assert_eq!(cleared["spans"], serde_json::json!([]));
    dispatcher.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_request_reaches_the_server() {
    let (_dir, dir) = run_dir();
    let (state, mut drains) = RouterState::new();
    let models = [ModelEntry::new("m", 1)];
    let dispatcher = Dispatcher::start(
        &dir,
        &models,
        Duration::from_secs(3),
        &Scheduling::default(),
        Arc::new(state),
    )
    .unwrap();
    let dir2 = dir.clone();
    let answer = tokio::task::spawn_blocking(move || {
        ask(
            &dir2,
            serde_json::json!({"v": 1, "op": "drain", "delay": 1.5, "grace": 10, "n": 4}),
        )
    })
    .await
    .unwrap();
    assert_eq!(answer["ok"], true);
    let drain = drains.try_recv().unwrap();
    assert_eq!(drain.delay, Duration::from_millis(1500));
    assert_eq!(drain.grace, Duration::from_secs(10));
    dispatcher.shutdown();
}

#[test]
fn a_sweep_that_wakes_more_than_a_sweep_late_does_not_judge() {
    let due = Instant::now();
    assert!(!sweep_was_late(due, due));
    assert!(!sweep_was_late(due, due + LIVENESS_SWEEP));
    assert!(sweep_was_late(due, due + LIVENESS_SWEEP * 2));
    assert!(!sweep_was_late(due + LIVENESS_SWEEP, due), "clock order");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_split_request_runs_on_several_workers_and_comes_back_whole() {
    let (_dir, dir) = run_dir();
    let split = Scheduling {
        split_rows: 2,
        ..Scheduling::default()
    };
    let (dispatcher, _state) = start_scheduled(&dir, &split);
    let a = FakeWorker::start(&dir, "cpu-0", 100, Behaviour::Echo);
    let b = FakeWorker::start(&dir, "cpu-1", 101, Behaviour::Echo);
    ready(&dispatcher, 2).await;
    let mut whole = rows_request(5);
    whole.frames = vec![Bytes::from((0u8..20).collect::<Vec<u8>>())];
    let reply = dispatcher.call(whole, None).await.unwrap();
    assert_eq!(reply.tensors, vec![("x".to_string(), 1, vec![5, 1])]);
    assert_eq!(&reply.frames[0][..], &(0u8..20).collect::<Vec<u8>>()[..]);
    let mut seen = [a.rows_seen(), b.rows_seen()].concat();
    seen.sort_unstable();
    assert_eq!(seen, [1, 2, 2]);
    assert!(
        a.served() >= 1 && b.served() >= 1,
        "both workers took chunks"
    );
    dispatcher.shutdown();
}

/// A split request whose caller goes away while its chunks are at the workers keeps its
/// shares of the budget until the last chunk is answered (`KeptShare`); one answered gives the
/// request's own share back to its caller, and the rest goes with the last copy of its frames.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_requests_shares_stay_held_while_any_copy_of_its_frames_is_kept() {
    use crate::request_budget::RequestBudget;
    let (_dir, dir) = run_dir();
    let split = Scheduling {
        split_rows: 2,
        ..Scheduling::default()
    };
    let (dispatcher, _state) = start_scheduled(&dir, &split);
    let _a = FakeWorker::start(&dir, "cpu-0", 100, Behaviour::SlowEcho(300));
    let _b = FakeWorker::start(&dir, "cpu-1", 101, Behaviour::SlowEcho(300));
    ready(&dispatcher, 2).await;
    let budget = RequestBudget::new(1 << 20);
    let shares = |budget: &RequestBudget| {
        KeptShare::new(budget.try_reserve(100 << 10), budget.try_reserve(50 << 10))
    };

    let mut cancelled = rows_request(4);
    cancelled.memory = shares(&budget);
    let call = dispatcher.call(cancelled, None);
    let gone = tokio::time::timeout(Duration::from_millis(100), call).await;
    assert!(gone.is_err(), "the caller went away before the answers");
    assert_eq!(
        budget.held_bytes(),
        150 << 10,
        "held while the chunks are at workers"
    );
    let released = tokio::time::timeout(Duration::from_secs(5), async {
        while budget.held_bytes() > 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    });
    released
        .await
        .expect("given back once the workers answered");

    let mut answered = rows_request(4);
    answered.memory = shares(&budget);
    let kept = answered.memory.clone();
    dispatcher.call(answered, None).await.unwrap();
    let request_share = kept.take_request().expect("the request's share comes back");
    assert_eq!(request_share.num_permits(), 100, "its own share (100 KiB)");
    drop(kept);
    let built_gone = tokio::time::timeout(Duration::from_secs(5), async {
        while budget.held_bytes() > 100 << 10 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    });
    built_gone
        .await
        .expect("what building took goes with the frames");
    drop(request_share);
    assert_eq!(budget.held_bytes(), 0);
    dispatcher.shutdown();
}

/// A request cut into more chunks than a worker's send queue holds is not refused for it:
/// its chunks go a window at a time. All at once, 10,000 chunks were refused "too many
/// requests queued" (found by a review). Here the worker stalls on its first chunk (it reads
/// no more), and the request waits until its deadline instead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_of_more_chunks_than_a_send_queue_holds_is_not_refused_for_it() {
    let (_dir, dir) = run_dir();
    let split = Scheduling {
        split_rows: 1,
        ..Scheduling::default()
    };
    let (dispatcher, _state) = start_scheduled(&dir, &split);
    let _stalls = FakeWorker::start(&dir, "cpu-0", 100, Behaviour::SlowEcho(30_000));
    ready(&dispatcher, 1).await;
    let rows = 5 * zmtp::SEND_HIGH_WATER;
    let mut whole = rows_request(rows);
    whole.frames = vec![Bytes::from(vec![7u8; 4 * rows])];
    let deadline = Instant::now() + Duration::from_millis(1500);
    let error = dispatcher.call(whole, Some(deadline)).await.unwrap_err();
    assert_eq!(error.code, Code::DeadlineExceeded, "{}", error.message);
    dispatcher.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_chunk_fails_the_split_request_with_its_error() {
    let (_dir, dir) = run_dir();
    let split = Scheduling {
        split_rows: 2,
        ..Scheduling::default()
    };
    let (dispatcher, _state) = start_scheduled(&dir, &split);
    let _good = FakeWorker::start(&dir, "cpu-0", 100, Behaviour::Echo);
    let _bad = FakeWorker::start(&dir, "cpu-1", 101, Behaviour::Refuse);
    ready(&dispatcher, 2).await;
    let error = dispatcher.call(rows_request(4), None).await.unwrap_err();
    assert_eq!(error, ServingError::new(Code::InvalidArgument, "bad id"));
    dispatcher.shutdown();
}

fn batching(max: u64, timeout_ms: u64, allowed: Vec<u64>, enqueued: u64) -> Scheduling {
    Scheduling {
        worker_inflight: 1,
        batching: Some(Batching {
            max_batch_size: max,
            timeout: Duration::from_millis(timeout_ms),
            allowed_batch_sizes: allowed,
            max_enqueued_batches: enqueued,
        }),
        ..Scheduling::default()
    }
}

/// A request of `rows` rows whose bytes say which request and row they are.
fn marked_request(rows: usize, mark: u8) -> WorkRequest {
    let bytes: Vec<u8> = (0..rows).flat_map(|r| [mark, r as u8, 0, 0]).collect();
    WorkRequest {
        frames: vec![Bytes::from(bytes)],
        ..rows_request(rows)
    }
}

type MarkedCall = tokio::task::JoinHandle<(Result<WorkReply, ServingError>, Vec<Bytes>)>;

/// Calls of `sizes` rows, each marked by its index (`marked_request`), started 2 ms apart,
/// each with `deadline` from its start; each resolves to its answer and the frames it sent.
async fn marked_calls(
    dispatcher: &Dispatcher,
    sizes: &[usize],
    deadline: Option<Duration>,
) -> Vec<MarkedCall> {
    let mut calls = Vec::new();
    for (mark, &rows) in sizes.iter().enumerate() {
        let dispatcher = dispatcher.clone();
        let request = marked_request(rows, mark as u8);
        let want = request.frames.clone();
        let deadline = deadline.map(|after| Instant::now() + after);
        calls.push(tokio::spawn(async move {
            (dispatcher.call(request, deadline).await, want)
        }));
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    calls
}

async fn each_gets_its_own_rows(calls: Vec<MarkedCall>) {
    for call in calls {
        let (reply, want) = call.await.unwrap();
        let reply = reply.expect("answered");
        assert_eq!(reply.frames, want, "each request gets its own rows");
    }
}

/// While the one worker computes a first request, requests of `sizes` rows arrive; each
/// must get its own rows back. The rows of each call the worker received.
async fn batched_calls(scheduling: Scheduling, behaviour: Behaviour, sizes: &[usize]) -> Vec<i64> {
    batched_calls_with_state(scheduling, behaviour, sizes)
        .await
        .0
}

/// `batched_calls`, with what the dispatcher recorded.
async fn batched_calls_with_state(
    scheduling: Scheduling,
    behaviour: Behaviour,
    sizes: &[usize],
) -> (Vec<i64>, Arc<RouterState>) {
    let (_dir, dir) = run_dir();
    let (dispatcher, state) = start_scheduled(&dir, &scheduling);
    let worker = FakeWorker::start(&dir, "cpu-0", 100, behaviour);
    ready(&dispatcher, 1).await;
    let sizes: Vec<usize> = std::iter::once(1).chain(sizes.iter().copied()).collect();
    let calls = marked_calls(&dispatcher, &sizes, None).await;
    each_gets_its_own_rows(calls).await;
    assert_eq!(state.queued.load(Ordering::Relaxed), 0);
    let seen = worker.rows_seen();
    dispatcher.shutdown();
    (seen, state)
}

/// TF Serving's batching page as the dispatcher left it: `name` → value, for each line.
fn batching_page(state: &RouterState) -> std::collections::BTreeMap<String, u64> {
    let mut page = String::new();
    state.batching.render(&mut page);
    page.lines()
        .filter(|line| !line.starts_with('#'))
        .filter_map(|line| line.rsplit_once(' '))
        .map(|(name, value)| (name.to_string(), value.parse().unwrap()))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_requests_share_one_call_up_to_max_batch_size() {
    let seen = batched_calls(
        batching(8, 0, vec![], 10),
        Behaviour::SlowEcho(40),
        &[1, 2, 3, 1, 4],
    )
    .await;
    // The first alone; then 1+2+3+1 = 7 (4 more would make 11 > 8); then 4.
    assert_eq!(seen, [1, 7, 4]);
}

/// A call padded to an allowed batch size holds what it builds from the request budget while
/// it is at its worker; one that could never fit is refused saying why, and nothing is built
/// (one 8 MiB request padded to 128 rows built 1.05 GB, counted by no budget; a hunt).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_padded_call_holds_what_it_builds_and_one_that_cannot_fit_is_refused() {
    let budget = crate::decode_budget::budget();
    let (_dir, dir) = run_dir();
    let (dispatcher, _state) = start_scheduled(&dir, &batching(128, 0, vec![128], 10));
    let worker = FakeWorker::start(&dir, "cpu-0", 100, Behaviour::SlowEcho(300));
    ready(&dispatcher, 1).await;
    // One row of budget/64 bytes: 128 of them are twice the budget.
    let row = budget.bytes() / 64;
    let mut huge = rows_request(1);
    huge.tensors[0].2 = vec![1, (row / 4) as i64];
    huge.frames = vec![Bytes::from(vec![1u8; row])];
    huge.tensors.push(("y".into(), 1, vec![1, 1]));
    huge.frames.push(Bytes::from(vec![2u8; 4]));
    let mut padded = rows_request(3);
    padded.frames = vec![Bytes::from(vec![3u8; 3 * 4 * 2048])];
    padded.tensors[0].2 = vec![3, 2048];
    let Err(error) = dispatcher.call(huge, None).await else {
        panic!("a call padded past the budget was sent");
    };
    assert_eq!(error.code, Code::ResourceExhausted);
    let said = format!(
        "the batch this request is in (1 rows padded to 128, an allowed batch size) would take \
         {} MiB beside the 0 MiB its requests hold: more than the {} MiB",
        (2 * budget.bytes() + 512).div_ceil(1 << 20),
        budget.bytes() >> 20
    );
    assert!(error.message.contains(&said), "{}", error.message);
    // 3 rows of 8 KiB padded to 128: 1 MiB, held while the worker has it.
    let call = tokio::spawn({
        let dispatcher = dispatcher.clone();
        async move { dispatcher.call(padded, None).await }
    });
    tokio::time::sleep(Duration::from_millis(150)).await;
    assert!(budget.held_bytes() >= 1 << 20, "{}", budget.held_bytes());
    let reply = call.await.unwrap().unwrap();
    assert_eq!(reply.tensors[0].2, vec![3, 2048], "the padding is cut off");
    assert_eq!(worker.rows_seen(), [128]);
    dispatcher.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_are_padded_to_an_allowed_batch_size() {
    let (seen, state) = batched_calls_with_state(
        batching(8, 0, vec![2, 4, 8], 10),
        Behaviour::SlowEcho(40),
        &[2, 3],
    )
    .await;
    assert_eq!(seen, [2, 8]); // 1 padded to 2, then 2+3 = 5 padded to 8
                              // TF Serving's batching metrics: two runs, three requests (one input each) queued.
    let page = batching_page(&state);
    let name = |family: &str| format!(":tensorflow:serving:batching_session:{family}");
    assert_eq!(page[&format!("{}{{}}", name("wrapped_run_count"))], 2);
    let pool = "{thread_pool_name=\"\"}";
    assert_eq!(page[&format!("{}_count{pool}", name("queuing_latency"))], 3);
    // In µs: the two requests that waited for the first call (40 ms) waited tens of ms.
    assert!(page[&format!("{}_sum{pool}", name("queuing_latency"))] >= 20_000);
    assert_eq!(page[&format!("{}_sum{{}}", name("input_batch_size"))], 6);
    assert_eq!(
        page[&format!("{}_sum{{}}", name("processed_batch_size"))],
        10
    );
    let padding = |size: u64, what: &str| {
        page[&format!(
            "{}_{what}{{execution_batch_size=\"{size}\"}}",
            name("padding_size")
        )]
    };
    assert_eq!((padding(2, "count"), padding(2, "sum")), (1, 1));
    assert_eq!((padding(8, "count"), padding(8, "sum")), (1, 3));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_sent_again_is_sized_once_and_each_call_it_left_in_counts() {
    let (_dir, dir) = run_dir();
    let (dispatcher, state) = start_scheduled(&dir, &batching(8, 0, vec![], 10));
    let _leaver = FakeWorker::start(&dir, "cpu-0", 100, Behaviour::LeaveMidRequest);
    let good = FakeWorker::start(&dir, "cpu-1", 101, Behaviour::Echo);
    ready(&dispatcher, 2).await;
    // Round-robin starts at cpu-0, the one that leaves: the request goes out twice.
    let reply = dispatcher
        .call(
            rows_request(3),
            Some(Instant::now() + Duration::from_secs(5)),
        )
        .await;
    assert!(reply.is_ok(), "{reply:?}");
    assert_eq!(state.retries.load(Ordering::Relaxed), 1);
    assert_eq!(good.served(), 1);
    let page = batching_page(&state);
    let name = |family: &str| format!(":tensorflow:serving:batching_session:{family}");
    assert_eq!(page[&format!("{}_count{{}}", name("input_batch_size"))], 1);
    assert_eq!(page[&format!("{}_sum{{}}", name("input_batch_size"))], 3);
    assert_eq!(page[&format!("{}{{}}", name("wrapped_run_count"))], 2);
    let pool = "{thread_pool_name=\"\"}";
    assert_eq!(page[&format!("{}_count{pool}", name("queuing_latency"))], 2);
    dispatcher.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_batching_nothing_is_recorded_as_a_batch() {
    let scheduling = Scheduling {
        worker_inflight: 1,
        ..Scheduling::default()
    };
    let (seen, state) =
        batched_calls_with_state(scheduling, Behaviour::SlowEcho(20), &[2, 3]).await;
    assert_eq!(seen, [1, 2, 3]);
    assert!(batching_page(&state).is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_merged_call_runs_its_requests_one_by_one() {
    let (seen, state) = batched_calls_with_state(
        batching(8, 0, vec![], 10),
        Behaviour::RefuseAbove(1),
        &[1, 1, 1],
    )
    .await;
    assert_eq!(seen, [1, 3, 1, 1, 1]);
    // Every call sent counts as a run of the batching session, the reruns too.
    let runs = ":tensorflow:serving:batching_session:wrapped_run_count{}";
    assert_eq!(batching_page(&state)[runs], 5);
}

/// One request alone (the worker was idle), then three merged into one call, which fails
/// on a worker that `behaviour` makes leave with it; the next worker, which comes once they
/// wait, gets the three one by one, though they queue behind each other there and batching
/// would merge them.
async fn a_failed_merged_calls_requests_run_alone_on_the_next_worker(behaviour: Behaviour) {
    let (_dir, dir) = run_dir();
    let (dispatcher, _state) = start_scheduled(&dir, &batching(8, 0, vec![], 10));
    let fails = FakeWorker::start(&dir, "cpu-0", 100, behaviour);
    ready(&dispatcher, 1).await;
    let calls = marked_calls(&dispatcher, &[1, 1, 1, 1], Some(Duration::from_secs(20))).await;
    for _ in 0..200 {
        if fails.rows_seen().len() == 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(fails.rows_seen(), [1, 3]);
    tokio::time::sleep(Duration::from_millis(100)).await; // they wait for a worker
    let next = FakeWorker::start(&dir, "cpu-1", 101, Behaviour::RefuseAbove(1));
    each_gets_its_own_rows(calls).await;
    assert_eq!(next.rows_seen(), [1, 1, 1], "never merged again");
    dispatcher.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_requests_of_a_merged_call_whose_worker_died_run_alone_from_then_on() {
    // A query of death merged with others: sent again merged, it would take them down with
    // it on every worker it reaches.
    a_failed_merged_calls_requests_run_alone_on_the_next_worker(Behaviour::DieAbove(1)).await;
}

/// Run alone after their merged call failed, requests are still padded to an allowed batch
/// size: every batched call is (a model made for those sizes got calls of one row).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_run_alone_after_their_merged_call_failed_are_still_padded() {
    let (_dir, dir) = run_dir();
    let (dispatcher, _state) = start_scheduled(&dir, &batching(8, 0, vec![2, 8], 10));
    let fails = FakeWorker::start(&dir, "cpu-0", 100, Behaviour::DieAbove(2));
    ready(&dispatcher, 1).await;
    let calls = marked_calls(&dispatcher, &[1, 1, 1, 1], Some(Duration::from_secs(20))).await;
    for _ in 0..200 {
        if fails.rows_seen().len() == 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        fails.rows_seen(),
        [2, 8],
        "1 padded to 2, then 3 merged padded to 8"
    );
    tokio::time::sleep(Duration::from_millis(100)).await; // they wait for a worker
    let next = FakeWorker::start(&dir, "cpu-1", 101, Behaviour::RefuseAbove(2));
    each_gets_its_own_rows(calls).await;
    assert_eq!(next.rows_seen(), [2, 2, 2], "alone, each padded");
    dispatcher.shutdown();
}

/// A queued request whose caller goes away (the client cancelled: its call dropped, no
/// deadline) leaves the queue at once, its shares of the budget with it; it waited there
/// until it reached the head, held for nobody.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queued_request_whose_caller_goes_away_leaves_the_queue_at_once() {
    use crate::request_budget::RequestBudget;
    let (_dir, dir) = run_dir();
    let one_at_a_time = Scheduling {
        worker_inflight: 1,
        ..Scheduling::default()
    };
    let (dispatcher, state) = start_scheduled(&dir, &one_at_a_time);
    let worker = FakeWorker::start(&dir, "cpu-0", 100, Behaviour::SlowEcho(500));
    ready(&dispatcher, 1).await;
    let busy = tokio::spawn({
        let dispatcher = dispatcher.clone();
        async move { dispatcher.call(rows_request(1), None).await }
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    let budget = RequestBudget::new(1 << 20);
    let mut queued = rows_request(2);
    queued.memory = KeptShare::new(budget.try_reserve(100 << 10), None);
    let gone = tokio::time::timeout(Duration::from_millis(50), dispatcher.call(queued, None));
    assert!(gone.await.is_err(), "still queued behind the first");
    let left = tokio::time::timeout(Duration::from_millis(200), async {
        while budget.held_bytes() > 0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    });
    left.await
        .expect("withdrawn while the worker still computes the first");
    assert_eq!(state.queued.load(Ordering::Relaxed), 0);
    assert!(busy.await.unwrap().is_ok());
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(worker.rows_seen(), [1], "the withdrawn one never ran");
    dispatcher.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_waits_for_the_timeout_to_fill_then_leaves() {
    let (_dir, dir) = run_dir();
    let (dispatcher, _state) = start_scheduled(&dir, &batching(8, 150, vec![], 10));
    let worker = FakeWorker::start(&dir, "cpu-0", 100, Behaviour::Echo);
    ready(&dispatcher, 1).await;
    let started = Instant::now();
    let d = dispatcher.clone();
    let first = tokio::spawn(async move { d.call(rows_request(2), None).await });
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert!(dispatcher.call(rows_request(3), None).await.is_ok());
    assert!(first.await.unwrap().is_ok());
    assert!(
        started.elapsed() >= Duration::from_millis(140),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(worker.rows_seen(), [5]);
    // A full batch does not wait.
    let started = Instant::now();
    assert!(dispatcher.call(rows_request(8), None).await.is_ok());
    assert!(started.elapsed() < Duration::from_millis(140));
    dispatcher.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn beyond_max_enqueued_batches_requests_are_refused_as_tf_serving_does() {
    let (_dir, dir) = run_dir();
    let (dispatcher, _state) = start_scheduled(&dir, &batching(2, 0, vec![], 1));
    let _worker = FakeWorker::start(&dir, "cpu-0", 100, Behaviour::SlowEcho(200));
    ready(&dispatcher, 1).await;
    let mut waiting = Vec::new();
    for _ in 0..3 {
        // One computing, then two rows waiting: the queue's one batch of 2.
        let d = dispatcher.clone();
        waiting.push(tokio::spawn(
            async move { d.call(rows_request(1), None).await },
        ));
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let error = dispatcher.call(rows_request(1), None).await.unwrap_err();
    assert_eq!(
        error,
        ServingError::new(Code::Unavailable, batch::QUEUE_FULL)
    );
    for call in waiting {
        assert!(call.await.unwrap().is_ok());
    }
    dispatcher.shutdown();
}

/// A request of `rows` rows for signature `signature`.
fn signature_request(signature: &str, rows: usize) -> WorkRequest {
    WorkRequest {
        signature: signature.into(),
        ..rows_request(rows)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_enqueued_batches_bounds_each_signatures_queue_on_its_own() {
    // TF Serving's batching session has a batch queue per signature (and output filter):
    // one signature's full queue refuses only its own requests.
    let (_dir, dir) = run_dir();
    let (dispatcher, _state) = start_scheduled(&dir, &batching(2, 0, vec![], 1));
    let _worker = FakeWorker::start(&dir, "cpu-0", 100, Behaviour::SlowEcho(300));
    ready(&dispatcher, 1).await;
    let mut waiting = Vec::new();
    for request in [
        signature_request("a", 1), // computing
        signature_request("a", 2), // signature a's queue: its one batch
        signature_request("b", 2), // signature b's
        WorkRequest {
            outputs: vec!["y".into()], // a with another output filter: a queue of its own
            ..signature_request("a", 2)
        },
    ] {
        let d = dispatcher.clone();
        waiting.push(tokio::spawn(async move { d.call(request, None).await }));
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let error = dispatcher.call(signature_request("a", 1), None).await;
    let full = ServingError::new(Code::Unavailable, batch::QUEUE_FULL);
    assert_eq!(error.unwrap_err(), full);
    for call in waiting {
        assert!(call.await.unwrap().is_ok());
    }
    dispatcher.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_filling_up_holds_back_no_other_signatures_request() {
    // A batch short of full waits out its timeout; a full batch of another signature behind
    // it has a queue of its own in TF Serving and leaves at once (it waited the whole
    // timeout behind the other, found by a hunt).
    let (_dir, dir) = run_dir();
    let (dispatcher, _state) = start_scheduled(&dir, &batching(4, 3_000, vec![], 10));
    let worker = FakeWorker::start(&dir, "cpu-0", 100, Behaviour::Echo);
    ready(&dispatcher, 1).await;
    let d = dispatcher.clone();
    let filling = tokio::spawn(async move { d.call(signature_request("a", 1), None).await });
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert!(dispatcher
        .call(signature_request("b", 4), None)
        .await
        .is_ok());
    assert!(!filling.is_finished(), "the batch of a still fills");
    assert_eq!(worker.rows_seen(), [4]);
    // So does one of the same signature that does not fit the batch: TF Serving closes the
    // batch then, and it leaves without waiting out its timeout.
    let d = dispatcher.clone();
    let closing = tokio::spawn(async move { d.call(signature_request("a", 4), None).await });
    assert!(filling.await.unwrap().is_ok());
    assert_eq!(worker.rows_seen()[..2], [4, 1]);
    assert!(closing.await.unwrap().is_ok());
    assert_eq!(worker.rows_seen(), [4, 1, 4]);
    dispatcher.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_filling_in_front_of_a_backlog_hold_back_no_other_models_request() {
    // Two of model r's batches fill at the front; behind them 300 of model m's, whose worker
    // is busy; then a full batch for r, whose worker is idle. The batches' scans of m's
    // backlog (256 each) spent the pump's budget and the pump stopped there: r's full batch
    // waited for a filling batch's timeout (found by a review).
    let (_dir, dir) = run_dir();
    let (state, _drains) = RouterState::new();
    let models = [ModelEntry::new("m", 1), ModelEntry::new("r", 4)];
    let timeout = Duration::from_secs(3);
    let scheduling = batching(4, 8_000, vec![], 10_000);
    let dispatcher = Dispatcher::start(&dir, &models, timeout, &scheduling, Arc::new(state))
        .expect("a dispatcher");
    let _m = FakeWorker::of_model(&dir, "cpu-0@1", 100, "m", 1, Behaviour::SlowEcho(8_000));
    let _r = FakeWorker::of_model(&dir, "r/cpu-0@4", 200, "r", 4, Behaviour::Echo);
    ready(&dispatcher, 2).await;
    let m = Target {
        model: 0,
        version: 1,
        pinned: false,
    };
    let r = Target {
        model: 1,
        version: 4,
        pinned: false,
    };
    let call = |target: Target, signature: &str, rows: usize| {
        let d = dispatcher.clone();
        let work = WorkRequest {
            target,
            ..signature_request(signature, rows)
        };
        tokio::spawn(async move { d.call(work, None).await })
    };
    let computing = call(m, "x", 4); // full: sent at once, m's worker busy for 8 s
    tokio::time::sleep(Duration::from_millis(20)).await;
    let filling = [call(r, "a", 1), call(r, "b", 1)];
    tokio::time::sleep(Duration::from_millis(20)).await;
    let backlog: Vec<_> = (0..300).map(|_| call(m, "x", 4)).collect();
    tokio::time::sleep(Duration::from_millis(50)).await;
    let full = call(r, "c", 4);
    let answered = tokio::time::timeout(Duration::from_secs(4), full).await;
    assert!(
        answered.is_ok(),
        "r's full batch waited behind the filling ones"
    );
    assert!(filling.iter().all(|f| !f.is_finished()), "they still fill");
    drop((computing, backlog));
    dispatcher.shutdown();
}

/// A lone request of one row, padded to 2 by `allowed_batch_sizes`, on a worker that
/// `behaviour` makes fail its call: its error, and the rows of each call the worker got.
async fn a_padded_requests_failure(behaviour: Behaviour) -> (ServingError, Vec<i64>) {
    let (_dir, dir) = run_dir();
    let (dispatcher, _state) = start_scheduled(&dir, &batching(4, 0, vec![2, 4], 10));
    let worker = FakeWorker::start(&dir, "cpu-0", 100, behaviour);
    ready(&dispatcher, 1).await;
    let error = dispatcher.call(rows_request(1), None).await.unwrap_err();
    dispatcher.shutdown();
    (error, worker.rows_seen())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_padded_requests_error_is_its_own_and_it_runs_once() {
    // Padded to an allowed batch size, a lone request's call failing is not a merged call's
    // failure: the error goes to its caller (TF Serving answers a padded batch's error) and
    // the model is not run again for it.
    let (error, seen) = a_padded_requests_failure(Behaviour::Refuse).await;
    assert_eq!(error, ServingError::new(Code::InvalidArgument, "bad id"));
    assert_eq!(seen, [2]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_padded_call_that_timed_out_answers_its_caller_deadline_exceeded() {
    // A worker ends a call past --call-timeout with DEADLINE_EXCEEDED, then leaves. Padded,
    // the request was taken for a merged call's member and run alone again; with no worker
    // left it was merged and padded again on the next, each time, and its caller got
    // UNAVAILABLE after killing a second worker (found by a hunt).
    let (error, seen) = a_padded_requests_failure(Behaviour::TimeOutThenLeave).await;
    let expected = ServingError::new(Code::DeadlineExceeded, "the model call ran too long");
    assert_eq!(error, expected);
    assert_eq!(seen, [2]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_requests_of_a_failed_merged_call_stay_alone_while_they_wait_for_a_worker() {
    // The merged call fails (DEADLINE_EXCEEDED) and its worker leaves with it: sent again
    // after waiting for a worker, they were merged again (found by a hunt).
    let behaviour = Behaviour::TimeOutThenLeaveAbove(1);
    a_failed_merged_calls_requests_run_alone_on_the_next_worker(behaviour).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_whose_deadline_passes_in_the_batch_queue_has_its_wait_recorded() {
    // The longest waits left no sample in TF Serving's queuing_latency, which the Grafana
    // mixin's high batch queuing latency alert reads (found by a hunt).
    let (_dir, dir) = run_dir();
    let (dispatcher, state) = start_scheduled(&dir, &batching(4, 5_000, vec![], 10));
    let _worker = FakeWorker::start(&dir, "cpu-0", 100, Behaviour::Echo);
    ready(&dispatcher, 1).await;
    // A full batch first, so that the worker is known to take calls: otherwise the request
    // may wait for a worker (not in the batch queue) until its short deadline.
    assert!(dispatcher.call(rows_request(4), None).await.is_ok());
    let count = ":tensorflow:serving:batching_session:queuing_latency_count{thread_pool_name=\"\"}";
    assert_eq!(
        batching_page(&state).get(count),
        Some(&1),
        "the full batch's wait"
    );
    let deadline = Instant::now() + Duration::from_millis(100);
    let error = dispatcher.call(rows_request(1), Some(deadline)).await;
    assert_eq!(error.unwrap_err().code, Code::DeadlineExceeded);
    for _ in 0..100 {
        if batching_page(&state).get(count) == Some(&2) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(batching_page(&state).get(count), Some(&2));
    dispatcher.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queued_request_its_caller_cancelled_is_not_sent() {
    // A client that cancels (RST_STREAM) drops its call: what it left in the queue must not
    // reach a worker (the worker ran 251 of 300 cancelled requests, found by a hunt).
    let (_dir, dir) = run_dir();
    let (dispatcher, _state) = start_scheduled(&dir, &scheduling("fcfs", 500));
    let worker = FakeWorker::start(&dir, "cpu-0", 100, Behaviour::SlowEcho(200));
    ready(&dispatcher, 1).await;
    let spawn = |rows: usize| {
        let d = dispatcher.clone();
        tokio::spawn(async move { d.call(rows_request(rows), None).await })
    };
    let computing = spawn(1);
    tokio::time::sleep(Duration::from_millis(30)).await;
    let cancelled = spawn(2);
    tokio::time::sleep(Duration::from_millis(30)).await;
    let waiting = spawn(3);
    tokio::time::sleep(Duration::from_millis(30)).await;
    cancelled.abort();
    assert!(computing.await.unwrap().is_ok());
    assert!(waiting.await.unwrap().is_ok());
    assert_eq!(worker.rows_seen(), [1, 3]);
    dispatcher.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_above_max_batch_size_is_refused_as_tf_serving_does() {
    // It ran alone before, as one call larger than the operator sized calls for.
    let (_dir, dir) = run_dir();
    let (dispatcher, _state) = start_scheduled(&dir, &batching(4, 0, vec![2, 4], 10));
    let worker = FakeWorker::start(&dir, "cpu-0", 100, Behaviour::Echo);
    ready(&dispatcher, 1).await;
    let error = dispatcher.call(rows_request(5), None).await.unwrap_err();
    assert_eq!(
        error,
        ServingError::new(
            Code::InvalidArgument,
            "Task size 5 is larger than maximum input batch size 4"
        )
    );
    assert!(dispatcher.call(rows_request(4), None).await.is_ok());
    // Inputs of two first dimensions, or a scalar, have no one size: a batched call cannot
    // take them, as TF Serving's batching session says (they ran alone, unchecked, before).
    let mut uneven = rows_request(2);
    uneven.tensors.push(("scale".into(), 1, vec![1]));
    uneven.frames.push(Bytes::from(vec![0u8; 4]));
    let error = dispatcher.call(uneven, None).await.unwrap_err();
    let expected = "Batching Run() input tensors must have equal 0th-dimension size";
    assert_eq!(error, ServingError::new(Code::InvalidArgument, expected));
    let mut scalar = rows_request(2);
    scalar.tensors.push(("scale".into(), 1, vec![]));
    scalar.frames.push(Bytes::from(vec![0u8; 4]));
    let error = dispatcher.call(scalar, None).await.unwrap_err();
    let expected = "Batching Run() input tensors must have at least one dimension";
    assert_eq!(error, ServingError::new(Code::InvalidArgument, expected));
    assert_eq!(worker.rows_seen(), [4]);
    dispatcher.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_splitting_a_request_that_cannot_be_cut_runs_alone_above_max_batch_size() {
    // enable_large_batch_splitting: max_batch_size is the chunks' size, so a request that
    // asks for a fixed-size output (never cut) is not refused by it.
    let (_dir, dir) = run_dir();
    let scheduling = Scheduling {
        split_rows: 4,
        ..batching(4, 0, vec![], 10)
    };
    let (dispatcher, _state) = start_scheduled(&dir, &scheduling);
    let worker = FakeWorker::start(&dir, "cpu-0", 100, Behaviour::Echo);
    ready(&dispatcher, 1).await;
    let mut whole = rows_request(6);
    whole.row_wise = false;
    assert!(dispatcher.call(whole, None).await.is_ok());
    assert!(dispatcher.call(rows_request(6), None).await.is_ok());
    // The other is cut into chunks of 4 and 2, sent at once (in either order).
    let seen = worker.rows_seen();
    let mut chunks = seen[1..].to_vec();
    chunks.sort_unstable();
    assert_eq!((seen[0], chunks), (6, vec![2, 4]));
    dispatcher.shutdown();
}

/// Health follows the workers of AVAILABLE versions, not every READY worker: at the pool's
/// start a worker is READY a controller tick before its version is AVAILABLE, and health
/// said SERVING while requests were refused as still loading (found by a README hunt).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serving_counts_the_ready_workers_of_available_versions_only() {
    let (_dir, dir) = run_dir();
    let (dispatcher, _state) = start(&dir, Duration::from_secs(3));
    let listed = ask(
        &dir,
        serde_json::json!({"v": 1, "op": "versions", "n": 1, "starting": true,
            "versions": [{"version": 1, "state": "LOADING"}]}),
    );
    assert_eq!(listed["ok"], true);
    let _one = FakeWorker::serving(&dir, "cpu-0@1", 100, 1, Behaviour::Echo);
    ready(&dispatcher, 1).await;
    assert_eq!(*dispatcher.serving_workers().borrow(), 0);
    ask(
        &dir,
        serde_json::json!({"v": 1, "op": "versions", "n": 2,
            "versions": [{"version": 1, "state": "AVAILABLE"}]}),
    );
    let mut serving = dispatcher.serving_workers();
    tokio::time::timeout(Duration::from_secs(10), serving.wait_for(|n| *n == 1))
        .await
        .expect("serving once its version is AVAILABLE")
        .unwrap();
    // A version of a worker that retires takes it out again.
    ask(
        &dir,
        serde_json::json!({"v": 1, "op": "versions", "n": 3,
            "versions": [{"version": 1, "state": "UNLOADING"}]}),
    );
    tokio::time::timeout(Duration::from_secs(10), serving.wait_for(|n| *n == 0))
        .await
        .expect("not serving once its version unloads")
        .unwrap();
    assert_eq!(*dispatcher.ready_workers().borrow(), 1);
    dispatcher.shutdown();
}

fn aimed(version: i64, pinned: bool) -> WorkRequest {
    WorkRequest {
        target: Target {
            model: 0,
            version,
            pinned,
        },
        ..request()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_run_on_their_version_and_unnamed_ones_follow_the_latest() {
    use crate::proto::mpspool::tfs::ModelSpec;
    let (_dir, dir) = run_dir();
    let (dispatcher, _state) = start(&dir, Duration::from_secs(3));
    let _one = FakeWorker::serving(&dir, "cpu-0@1", 100, 1, Behaviour::Echo);
    let _two = FakeWorker::serving(&dir, "cpu-0@2", 200, 2, Behaviour::Echo);
    ready(&dispatcher, 2).await;
    let unnamed = ModelSpec {
        name: "m".into(),
        ..ModelSpec::default()
    };
    // Until the controller lists versions, the configured one (1) is the latest.
    let target = dispatcher.versions().resolve(Some(&unnamed)).unwrap();
    assert_eq!(
        target,
        Target {
            model: 0,
            version: 1,
            pinned: false
        }
    );
    for (target, answered_by) in [
        (target, 1),
        (
            Target {
                model: 0,
                version: 2,
                pinned: true,
            },
            2,
        ),
    ] {
        let work = WorkRequest {
            target,
            ..request()
        };
        assert_eq!(
            dispatcher.call(work, None).await.unwrap().version,
            answered_by
        );
    }
    let signatures = dispatcher.signatures().borrow().clone();
    let versions: Vec<i64> = signatures.keys().map(|s| s.version).collect();
    assert_eq!(versions, vec![1, 2]);

    // Version 2 takes over; 1 retires: new requests resolve to 2, one already aimed at 1
    // still runs there while 1 has a worker, and moves to 2 once it has none.
    let listed = ask(
        &dir,
        serde_json::json!({"v": 1, "op": "versions", "n": 1, "versions": [
            {"version": 1, "state": "UNLOADING"}, {"version": 2, "state": "AVAILABLE"}]}),
    );
    assert_eq!(listed["ok"], true);
    let target = dispatcher.versions().resolve(Some(&unnamed)).unwrap();
    assert_eq!(
        target,
        Target {
            model: 0,
            version: 2,
            pinned: false
        }
    );
    assert_eq!(
        dispatcher
            .call(aimed(1, false), None)
            .await
            .unwrap()
            .version,
        1
    );
    let gone = ask(
        &dir,
        serde_json::json!({"v": 1, "op": "gone", "n": 2, "slot": "cpu-0@1", "pid": 100}),
    );
    assert_eq!(gone["ok"], true);
    assert_eq!(
        dispatcher
            .call(aimed(1, false), None)
            .await
            .unwrap()
            .version,
        2
    );
    // One that named version 1 does not: it waits for a worker of 1, then gives up.
    let mut dispatcher = dispatcher;
    dispatcher.no_worker_wait = Duration::from_millis(200);
    let refused = dispatcher.call(aimed(1, true), None).await.unwrap_err();
    assert_eq!(refused.code, Code::Unavailable);

    // Once the controller lists 1 no more, its signatures go.
    ask(
        &dir,
        serde_json::json!({"v": 1, "op": "versions", "n": 3, "versions": [
            {"version": 2, "state": "AVAILABLE"}]}),
    );
    let signatures = dispatcher.signatures().borrow().clone();
    let versions: Vec<i64> = signatures.keys().map(|s| s.version).collect();
    assert_eq!(versions, vec![2]);
    dispatcher.shutdown();
}

/// The one model's version 1 (what `start` serves).
const V1: Servable = Servable {
    model: 0,
    version: 1,
};

fn spawn_call(
    dispatcher: &Dispatcher,
    target: Target,
) -> tokio::task::JoinHandle<Result<WorkReply, ServingError>> {
    let dispatcher = dispatcher.clone();
    let work = WorkRequest {
        target,
        ..request()
    };
    tokio::spawn(async move { dispatcher.call(work, None).await })
}

/// Two models behind one front door: each request runs on its own model's workers; requests
/// for a model whose workers are all busy wait without holding up the other model's; a READY
/// for a model the pool does not serve is not learned.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_models_run_on_their_own_workers_and_neither_waits_behind_the_other() {
    use crate::proto::mpspool::tfs::ModelSpec;
    let (_dir, dir) = run_dir();
    let (state, _drains) = RouterState::new();
    let models = [ModelEntry::new("m", 1), ModelEntry::new("r", 4)];
    // One request per worker at a time: the rest wait in the front door's queue.
    let scheduling = Scheduling {
        worker_inflight: 1,
        ..Scheduling::default()
    };
    let timeout = Duration::from_secs(3);
    let dispatcher =
        Dispatcher::start(&dir, &models, timeout, &scheduling, Arc::new(state)).unwrap();
    let m_worker = FakeWorker::of_model(&dir, "cpu-0@1", 100, "m", 1, Behaviour::SlowEcho(1000));
    let r_worker = FakeWorker::of_model(&dir, "r/cpu-0@4", 200, "r", 4, Behaviour::Echo);
    let _stray = FakeWorker::of_model(&dir, "x/cpu-0@1", 300, "x", 1, Behaviour::Echo);
    ready(&dispatcher, 2).await;
    let resolve = |name: &str| {
        let spec = ModelSpec {
            name: name.into(),
            ..ModelSpec::default()
        };
        dispatcher.versions().resolve(Some(&spec)).unwrap()
    };
    let (m, r) = (resolve("m"), resolve("r"));
    assert_eq!((m.model, m.version, r.model, r.version), (0, 1, 1, 4));

    // m's worker computes for a second; a second request for m waits at the queue's head.
    let busy = spawn_call(&dispatcher, m);
    tokio::time::sleep(Duration::from_millis(100)).await;
    let waiting = spawn_call(&dispatcher, m);
    tokio::time::sleep(Duration::from_millis(100)).await;
    let snap = snapshot(&dir);
    assert_eq!(snap["queued_by_model"], serde_json::json!({"m": 1}));
    let started = std::time::Instant::now();
    let reply = spawn_call(&dispatcher, r).await.unwrap().unwrap();
    let took = started.elapsed();
    assert_eq!((reply.slot.as_str(), reply.version), ("r/cpu-0@4", 4));
    assert!(
        took < Duration::from_millis(600),
        "r's request waited {took:?} behind m's"
    );
    for call in [busy, waiting] {
        let reply = call.await.unwrap().unwrap();
        assert_eq!((reply.slot.as_str(), reply.version), ("cpu-0@1", 1));
    }
    assert_eq!(
        *dispatcher.ready_workers().borrow(),
        2,
        "x is not served here"
    );
    let learned: Vec<Servable> = dispatcher.signatures().borrow().keys().copied().collect();
    let r4 = Servable {
        model: 1,
        version: 4,
    };
    assert_eq!(learned, vec![V1, r4]);
    assert_eq!((m_worker.served(), r_worker.served()), (2, 1));
    assert_eq!(snapshot(&dir)["queued_by_model"], serde_json::json!({}));
    dispatcher.shutdown();
}

/// The `deadline` of a REQUEST header the scripted worker received, if it has one; checked
/// to lie `ahead` past CLOCK_MONOTONIC's `before` (with the time the test itself took).
fn deadline_ahead(header: &serde_json::Value, before: u64, ahead: Duration) -> Option<()> {
    let deadline = header.get("deadline")?.as_u64().expect("a number");
    let ahead = ahead.as_micros() as u64;
    // Read in whole µs: what is left may read 1 µs short.
    assert!(
        deadline + 1 >= before + ahead && deadline <= wire::monotonic_micros() + ahead,
        "{deadline} is not {ahead} µs past {before}"
    );
    Some(())
}

#[test]
fn a_requests_deadline_reaches_its_worker_on_the_monotonic_clock() {
    let runtime = runtime();
    let (_dir, dir) = run_dir();
    let dispatcher = start_in(&runtime, &dir, Duration::from_secs(30));
    let worker = Scripted::registered(&dir, "cpu-0", 100);
    // Without one: no key at all (what older workers read).
    let call = runtime.spawn({
        let dispatcher = dispatcher.clone();
        async move { dispatcher.call(request(), None).await }
    });
    let (header, frames) = worker.next_request();
    assert!(header.get("deadline").is_none(), "{header}");
    worker.answer(&header, frames);
    runtime.block_on(call).unwrap().unwrap();
    // With one, 2 s ahead.
    let before = wire::monotonic_micros();
    let call = runtime.spawn({
        let dispatcher = dispatcher.clone();
        async move {
            let deadline = Instant::now() + Duration::from_secs(2);
            dispatcher.call(request(), Some(deadline)).await
        }
    });
    let (header, frames) = worker.next_request();
    deadline_ahead(&header, before, Duration::from_secs(2)).expect("a deadline");
    worker.answer(&header, frames);
    runtime.block_on(call).unwrap().unwrap();
    dispatcher.shutdown();
}

#[test]
fn a_merged_call_runs_until_its_last_members_deadline_and_is_not_rerun_past_it() {
    let runtime = runtime();
    let (_dir, dir) = run_dir();
    let (dispatcher, state) =
        runtime.block_on(async { start_scheduled(&dir, &batching(8, 0, vec![], 10)) });
    let worker = Scripted::registered(&dir, "cpu-0", 100);
    let call = |rows: usize, ahead: Option<Duration>| {
        let dispatcher = dispatcher.clone();
        runtime.spawn(async move {
            let deadline = ahead.map(|a| Instant::now() + a);
            dispatcher.call(rows_request(rows), deadline).await
        })
    };
    // The worker holds a first call while two with deadlines (2 s and 3 s) wait and merge.
    let first = call(1, None);
    let (held, held_frames) = worker.next_request();
    let before = wire::monotonic_micros();
    let soon = call(1, Some(Duration::from_secs(2)));
    let later = call(2, Some(Duration::from_secs(3)));
    wait_until("both queued", || state.queued.load(Ordering::Relaxed) == 2);
    worker.answer(&held, held_frames);
    runtime.block_on(first).unwrap().unwrap();
    let (merged, _) = worker.next_request();
    assert_eq!(merged["tensors"][0][2][0], 3, "{merged}");
    deadline_ahead(&merged, before, Duration::from_secs(3)).expect("the later deadline");
    // Both callers give up at their deadlines while the worker computes (and beats)...
    while !(soon.is_finished() && later.is_finished()) {
        worker.heartbeat();
        thread::sleep(Duration::from_millis(100));
    }
    for member in [soon, later] {
        let error = runtime.block_on(member).unwrap().unwrap_err();
        assert_eq!(error.code, Code::DeadlineExceeded);
    }
    // ... and when its answer is an error, as a worker's after the deadline is, neither is
    // run again alone: nobody waits for them.
    let error = pack(serde_json::json!({
        "v": 1, "k": "error", "id": merged["id"], "code": 4, "message": "past its deadline"
    }));
    worker.socket.send(error, 0).unwrap();
    assert_eq!(worker.socket.poll(zmq::POLLIN, 300).unwrap(), 0, "rerun");
    dispatcher.shutdown();
}

/// While `version`'s one worker computes a first request, requests of `sizes` rows arrive
/// for it; each must get its own rows back.
async fn calls_on_version(dispatcher: &Dispatcher, version: i64, sizes: &[usize]) {
    let mut calls = Vec::new();
    for (mark, rows) in std::iter::once(1).chain(sizes.iter().copied()).enumerate() {
        let d = dispatcher.clone();
        let request = WorkRequest {
            target: Target {
                model: 0,
                version,
                pinned: true,
            },
            ..marked_request(rows, mark as u8)
        };
        let want = request.frames.clone();
        calls.push(tokio::spawn(
            async move { (d.call(request, None).await, want) },
        ));
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    for call in calls {
        let (reply, want) = call.await.unwrap();
        assert_eq!(reply.expect("answered").frames, want);
    }
}

/// --enable_per_model_batching_parameters: a version is batched by the parameters the
/// controller lists with it (its batching_params.pbtxt), a version listed without any is
/// not batched, and until the controller has listed them no request runs (it would run
/// unbatched).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_model_batching_follows_each_versions_own_parameters() {
    let (_dir, dir) = run_dir();
    let scheduling = Scheduling {
        worker_inflight: 1,
        per_model_batching: true,
        ..Scheduling::default()
    };
    let (mut dispatcher, _state) = start_scheduled(&dir, &scheduling);
    let one = FakeWorker::serving(&dir, "cpu-0@1", 100, 1, Behaviour::SlowEcho(40));
    let two = FakeWorker::serving(&dir, "cpu-0@2", 200, 2, Behaviour::SlowEcho(40));
    ready(&dispatcher, 2).await;
    dispatcher.no_worker_wait = Duration::from_millis(200);
    let early = dispatcher.call(aimed(1, true), None).await.unwrap_err();
    assert_eq!(
        early.code,
        Code::Unavailable,
        "no table from the controller yet"
    );

    let listed = ask(
        &dir,
        serde_json::json!({"v": 1, "op": "versions", "n": 1, "versions": [
            {"version": 1, "state": "AVAILABLE", "batching": {
                "max_batch_size": 8, "batch_timeout_micros": 0, "allowed_batch_sizes": [],
                "max_enqueued_batches": 10, "split_rows": 4}},
            {"version": 2, "state": "AVAILABLE", "batching": null}]}),
    );
    assert_eq!(listed["ok"], true, "{listed}");
    calls_on_version(&dispatcher, 1, &[1, 2, 3]).await;
    calls_on_version(&dispatcher, 2, &[1, 2, 3]).await;
    assert_eq!(one.rows_seen(), [1, 6], "version 1 merges");
    assert_eq!(two.rows_seen(), [1, 1, 2, 3], "version 2 does not");

    // Version 1's split_rows cuts a 6-row request into 4 and 2; version 2 takes it whole.
    for version in [1, 2] {
        let whole = WorkRequest {
            target: Target {
                model: 0,
                version,
                pinned: true,
            },
            ..marked_request(6, 9)
        };
        let want = whole.frames.clone();
        let reply = dispatcher.call(whole, None).await.unwrap();
        assert_eq!(reply.frames, want);
    }
    let mut cut = one.rows_seen()[2..].to_vec();
    cut.sort();
    assert_eq!(cut, [2, 4]);
    assert_eq!(two.rows_seen()[4..], [6]);
    dispatcher.shutdown();
}

/// A version listed with parameters TF Serving would refuse is refused as a whole table.
#[test]
fn a_versions_batching_that_breaks_tf_servings_rules_is_refused() {
    let runtime = runtime();
    let (_dir, dir) = run_dir();
    let scheduling = Scheduling {
        worker_inflight: 1,
        per_model_batching: true,
        ..Scheduling::default()
    };
    let _dispatcher = runtime.block_on(async { start_scheduled(&dir, &scheduling).0 });
    let refused = ask(
        &dir,
        serde_json::json!({"v": 1, "op": "versions", "n": 1, "versions": [
            {"version": 1, "state": "AVAILABLE", "batching": {
                "max_batch_size": 8, "batch_timeout_micros": 0, "allowed_batch_sizes": [2, 4],
                "max_enqueued_batches": 10}}]}),
    );
    let error = refused["error"].as_str().unwrap_or_default();
    assert!(
        error.contains("version 1's batching: the last of allowed_batch_sizes must equal"),
        "{refused}"
    );
}

/// Each model version has a batch queue of its own, bounded by its max_enqueued_batches (as
/// TF Serving's queues are per servable): a full queue of one model refuses its own
/// requests, not another model's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_batch_queue_of_one_model_does_not_refuse_anothers() {
    let (_dir, dir) = run_dir();
    let (state, _drains) = RouterState::new();
    let models = [ModelEntry::new("m", 1), ModelEntry::new("r", 4)];
    let timeout = Duration::from_secs(3);
    let dispatcher = Dispatcher::start(
        &dir,
        &models,
        timeout,
        &batching(2, 0, vec![], 1),
        Arc::new(state),
    )
    .unwrap();
    let _m = FakeWorker::of_model(&dir, "cpu-0@1", 100, "m", 1, Behaviour::SlowEcho(300));
    let _r = FakeWorker::of_model(&dir, "r/cpu-0@4", 200, "r", 4, Behaviour::SlowEcho(300));
    ready(&dispatcher, 2).await;
    let m = Target {
        model: 0,
        version: 1,
        pinned: false,
    };
    let r = Target {
        model: 1,
        version: 4,
        pinned: false,
    };
    // m: one computing, then two rows waiting, its queue's one batch of 2; r: one computing.
    let mut waiting = Vec::new();
    for target in [m, m, m, r] {
        waiting.push(spawn_call(&dispatcher, target));
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let full = dispatcher
        .call(
            WorkRequest {
                target: m,
                ..request()
            },
            None,
        )
        .await
        .unwrap_err();
    assert_eq!(
        full,
        ServingError::new(Code::Unavailable, batch::QUEUE_FULL)
    );
    let reply = spawn_call(&dispatcher, r).await.unwrap();
    assert_eq!(reply.map(|reply| reply.version).ok(), Some(4));
    for call in waiting {
        assert!(call.await.unwrap().is_ok());
    }
    dispatcher.shutdown();
}

/// A queued request that named no version moves to the latest when its own version's
/// workers are gone, and is batched as that version's requests are: version 2 has no
/// batching parameters, so no padded or merged call reaches it (version 1 pads to 8).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_that_moves_to_another_version_takes_that_versions_batching() {
    let (_dir, dir) = run_dir();
    let scheduling = Scheduling {
        worker_inflight: 1,
        per_model_batching: true,
        ..Scheduling::default()
    };
    let (dispatcher, _state) = start_scheduled(&dir, &scheduling);
    let one = FakeWorker::serving(&dir, "cpu-0@1", 100, 1, Behaviour::SlowEcho(400));
    let two = FakeWorker::serving(&dir, "cpu-0@2", 200, 2, Behaviour::Echo);
    ready(&dispatcher, 2).await;
    let listed = ask(
        &dir,
        serde_json::json!({"v": 1, "op": "versions", "n": 1, "versions": [
            {"version": 1, "state": "AVAILABLE", "batching": {
                "max_batch_size": 8, "batch_timeout_micros": 0, "allowed_batch_sizes": [8],
                "max_enqueued_batches": 10}},
            {"version": 2, "state": "AVAILABLE", "batching": null}]}),
    );
    assert_eq!(listed["ok"], true, "{listed}");
    let unnamed = Target {
        model: 0,
        version: 1,
        pinned: false,
    };
    let computing = spawn_call(&dispatcher, unnamed);
    tokio::time::sleep(Duration::from_millis(50)).await;
    let queued = spawn_call(&dispatcher, unnamed);
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(one.rows_seen(), [8], "version 1 pads to its allowed size");
    let gone = ask(
        &dir,
        serde_json::json!({"v": 1, "op": "gone", "n": 2, "slot": "cpu-0@1", "pid": 100}),
    );
    assert_eq!(gone["ok"], true, "{gone}");
    for call in [computing, queued] {
        assert_eq!(call.await.unwrap().map(|reply| reply.version).ok(), Some(2));
    }
    assert_eq!(
        two.rows_seen(),
        [1, 1],
        "neither padded nor merged on version 2"
    );
    dispatcher.shutdown();
}

fn of_width(width: usize, version: i64) -> WorkRequest {
    WorkRequest {
        target: Target {
            model: 0,
            version,
            pinned: true,
        },
        signature: "serving_default".into(),
        tensors: vec![("x".into(), 1, vec![1, width as i64])],
        frames: vec![Bytes::from(vec![0u8; 4 * width])],
        outputs: vec!["x".into()],
        row_wise: true,
        memory: Default::default(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_versions_filling_batches_do_not_cut_anothers_batch_short() {
    // Version 2's 20 requests of one shape arrive first; then 700 for version 1, each of
    // its own width (a batch of its own, all filling). With one scan budget for every
    // version, version 1's batches spent it and version 2's left with 1 row, then 19
    // (found by a review); each version's batches now look at its own queue on their own.
    let (_dir, dir) = run_dir();
    let (dispatcher, state) = start_scheduled(&dir, &batching(64, 1_000, vec![], 100_000));
    let _one = FakeWorker::serving(&dir, "cpu-0@1", 100, 1, Behaviour::Echo);
    let two = FakeWorker::serving(&dir, "cpu-0@2", 200, 2, Behaviour::Echo);
    ready(&dispatcher, 2).await;
    let call = |work: WorkRequest| {
        let d = dispatcher.clone();
        tokio::spawn(async move { d.call(work, None).await })
    };
    let mut calls = Vec::new();
    for _ in 0..20 {
        calls.push(call(of_width(2, 2)));
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    calls.extend((0..700).map(|width| call(of_width(3 + width, 1))));
    for answered in calls {
        let answered = tokio::time::timeout(Duration::from_secs(20), answered).await;
        assert!(answered.expect("answered in time").expect("joined").is_ok());
    }
    assert_eq!(two.rows_seen(), vec![20], "one call of all 20 rows");
    assert_eq!(state.queued.load(Ordering::Relaxed), 0);
    dispatcher.shutdown();
}
