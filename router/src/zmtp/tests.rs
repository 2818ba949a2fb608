//! The native ROUTER against the real libzmq (the `zmq` crate's DEALER, as the Python workers
//! use through pyzmq) and against a hand-driven peer for what libzmq will not do on request
//! (stall, PING, garbage).

use std::io::{Read, Write};
use std::os::unix::net::UnixStream as StdUnixStream;
use std::path::PathBuf;
use std::time::Duration;

use super::*;

const WAIT: Duration = Duration::from_secs(5);

struct Fixture {
    runtime: tokio::runtime::Runtime,
    socket: Option<RouterSocket>,
    path: PathBuf,
    _dir: tempfile_dir::Dir,
}

/// A private temporary directory without another crate.
mod tempfile_dir {
    pub struct Dir(pub std::path::PathBuf);

    impl Dir {
        pub fn new() -> Dir {
            let unique = format!(
                "mpspool-zmtp-{}-{:?}",
                std::process::id(),
                std::thread::current().id()
            )
            .replace(['(', ')'], "");
            let path = std::env::temp_dir().join(unique);
            std::fs::create_dir_all(&path).unwrap();
            Dir(path)
        }
    }

    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

impl Fixture {
    fn new() -> Fixture {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let dir = tempfile_dir::Dir::new();
        let path = dir.0.join("workers.ipc");
        let socket = runtime.block_on(async { RouterSocket::bind(&path).unwrap() });
        Fixture {
            runtime,
            socket: Some(socket),
            path,
            _dir: dir,
        }
    }

    fn socket(&mut self) -> &mut RouterSocket {
        self.socket.as_mut().unwrap()
    }

    /// `send` then `flush`, as the dispatcher does at the end of a round.
    fn send_now<F: AsRef<[u8]>>(&mut self, identity: &[u8], frames: &[F]) -> Result<(), SendError> {
        let frames = owned(frames);
        let socket = self.socket();
        let sent = socket.send(identity, &frames);
        socket.flush();
        sent
    }

    fn endpoint(&self) -> String {
        format!("ipc://{}", self.path.display())
    }

    fn next(&mut self) -> Incoming {
        let socket = self.socket.as_mut().unwrap();
        self.runtime
            .block_on(async { tokio::time::timeout(WAIT, socket.recv()).await })
            .expect("something in time")
            .expect("the socket is open")
    }

    fn recv(&mut self) -> Message {
        match self.next() {
            Incoming::Message(message) => message,
            Incoming::Left(identity) => panic!("{identity:?} left instead"),
        }
    }

    /// Nothing arrives within `wait`.
    fn quiet(&mut self, wait: Duration) -> bool {
        let socket = self.socket.as_mut().unwrap();
        self.runtime
            .block_on(async { tokio::time::timeout(wait, socket.recv()).await })
            .is_err()
    }
}

/// Frames as the dispatcher sends them.
fn owned<F: AsRef<[u8]>>(frames: &[F]) -> Vec<Bytes> {
    frames
        .iter()
        .map(|f| Bytes::copy_from_slice(f.as_ref()))
        .collect()
}

fn dealer(context: &zmq::Context, endpoint: &str, identity: Option<&[u8]>) -> zmq::Socket {
    let socket = context.socket(zmq::DEALER).unwrap();
    if let Some(identity) = identity {
        socket.set_identity(identity).unwrap();
    }
    socket.set_linger(0).unwrap();
    socket.connect(endpoint).unwrap();
    socket
}

fn dealer_recv(socket: &zmq::Socket) -> Vec<Vec<u8>> {
    assert_eq!(
        socket.poll(zmq::POLLIN, WAIT.as_millis() as i64).unwrap(),
        1,
        "the DEALER heard nothing"
    );
    socket.recv_multipart(0).unwrap()
}

fn frames_of(message: &Message) -> Vec<Vec<u8>> {
    message.frames.iter().map(|f| f.to_vec()).collect()
}

#[test]
fn a_libzmq_dealer_and_the_router_exchange_multipart_messages_of_every_size() {
    let mut fixture = Fixture::new();
    let context = zmq::Context::new();
    let worker = dealer(&context, &fixture.endpoint(), Some(b"cpu-0:41"));
    let big: Vec<u8> = (0..(1 << 20)).map(|i| (i % 251) as u8).collect();
    let sent = vec![b"head".to_vec(), Vec::new(), vec![7u8; 300], big.clone()];
    worker.send_multipart(sent.clone(), 0).unwrap();
    let message = fixture.recv();
    assert_eq!(message.identity, b"cpu-0:41"[..]);
    assert_eq!(frames_of(&message), sent);

    let reply: [&[u8]; 3] = [b"answer", &big, b""];
    fixture.send_now(b"cpu-0:41", &reply).unwrap();
    let received = dealer_recv(&worker);
    assert_eq!(
        received,
        reply.iter().map(|f| f.to_vec()).collect::<Vec<_>>()
    );

    // Many in a row keep their order both ways.
    for i in 0..500u32 {
        worker.send(i.to_be_bytes().as_slice(), 0).unwrap();
    }
    for i in 0..500u32 {
        assert_eq!(frames_of(&fixture.recv()), vec![i.to_be_bytes().to_vec()]);
        fixture
            .socket()
            .send(b"cpu-0:41", &owned(&[i.to_be_bytes()]))
            .unwrap();
    }
    fixture.socket().flush(); // all 500 leave in one write
    for i in 0..500u32 {
        assert_eq!(dealer_recv(&worker), vec![i.to_be_bytes().to_vec()]);
    }
}

#[test]
fn a_peer_without_an_identity_gets_one_made_up_and_can_be_answered() {
    let mut fixture = Fixture::new();
    let context = zmq::Context::new();
    let anonymous = dealer(&context, &fixture.endpoint(), None);
    anonymous.send("hello", 0).unwrap();
    let message = fixture.recv();
    assert_eq!(message.identity.len(), 5, "{:?}", message.identity);
    assert_eq!(
        message.identity[0], 0,
        "libzmq's made-up identities start with 0"
    );
    fixture.send_now(&message.identity, &[b"back"]).unwrap();
    assert_eq!(dealer_recv(&anonymous), vec![b"back".to_vec()]);
}

#[test]
fn sending_to_an_unknown_or_departed_peer_fails_at_once() {
    let mut fixture = Fixture::new();
    assert_eq!(
        fixture.socket().send(b"nobody", &owned(&[b"x"])),
        Err(SendError::Unreachable)
    );
    let context = zmq::Context::new();
    let worker = dealer(&context, &fixture.endpoint(), Some(b"cpu-1:7"));
    worker.send("hi", 0).unwrap();
    assert_eq!(fixture.recv().identity, b"cpu-1:7"[..]);
    fixture.send_now(b"cpu-1:7", &[b"x"]).unwrap();
    drop(worker); // its connection closes (kill -9 looks the same to the front door)
    match fixture.next() {
        Incoming::Left(identity) => assert_eq!(identity, b"cpu-1:7"),
        Incoming::Message(_) => panic!("a message instead of the departure"),
    }
    assert_eq!(
        fixture.socket().send(b"cpu-1:7", &owned(&[b"x"])),
        Err(SendError::Unreachable)
    );
    // The identity is free again: the worker's next incarnation reconnects with it.
    let again = dealer(&context, &fixture.endpoint(), Some(b"cpu-1:7"));
    again.send("back", 0).unwrap();
    let message = fixture.recv();
    assert_eq!(frames_of(&message), vec![b"back".to_vec()]);
    fixture.send_now(b"cpu-1:7", &[b"welcome"]).unwrap();
    assert_eq!(dealer_recv(&again), vec![b"welcome".to_vec()]);
}

#[test]
fn a_second_connection_with_a_connected_identity_is_not_heard() {
    let mut fixture = Fixture::new();
    let context = zmq::Context::new();
    let first = dealer(&context, &fixture.endpoint(), Some(b"dup"));
    first.send("one", 0).unwrap();
    assert_eq!(frames_of(&fixture.recv()), vec![b"one".to_vec()]);
    let second = dealer(&context, &fixture.endpoint(), Some(b"dup"));
    second.send("two", 0).unwrap();
    assert!(fixture.quiet(Duration::from_millis(300)));
    // Answers still reach the first.
    first.send("three", 0).unwrap();
    assert_eq!(frames_of(&fixture.recv()), vec![b"three".to_vec()]);
    fixture.send_now(b"dup", &[b"four"]).unwrap();
    assert_eq!(dealer_recv(&first), vec![b"four".to_vec()]);
}

/// A peer driven by hand over a blocking Unix socket.
struct RawPeer {
    stream: StdUnixStream,
    buffer: Vec<u8>,
}

impl RawPeer {
    fn connect(path: &Path) -> RawPeer {
        let stream = StdUnixStream::connect(path).unwrap();
        stream.set_read_timeout(Some(WAIT)).unwrap();
        RawPeer {
            stream,
            buffer: Vec::new(),
        }
    }

    /// Greeting and READY as a DEALER announcing `identity`; reads the router's.
    fn handshake(path: &Path, identity: &[u8]) -> RawPeer {
        let mut peer = RawPeer::connect(path);
        let mut hello = BytesMut::new();
        hello.put_slice(&greeting());
        let mut ready = BytesMut::new();
        put_command_name(&mut ready, b"READY");
        put_property(&mut ready, b"Socket-Type", b"DEALER");
        put_property(&mut ready, b"Identity", identity);
        put_frame(&mut hello, FLAG_COMMAND, &ready);
        peer.stream.write_all(&hello).unwrap();
        let theirs = peer.read_exact(GREETING_LEN);
        check_greeting(&theirs).unwrap();
        let (flags, body) = peer.frame();
        assert_eq!(flags & FLAG_COMMAND, FLAG_COMMAND);
        let properties = parse_ready(&body).unwrap();
        assert!(properties.contains(&(b"Socket-Type".to_vec(), b"ROUTER".to_vec())));
        peer
    }

    fn read_exact(&mut self, n: usize) -> Vec<u8> {
        while self.buffer.len() < n {
            let mut chunk = [0u8; 65536];
            let got = self.stream.read(&mut chunk).unwrap();
            assert!(got > 0, "the router closed the connection");
            self.buffer.extend_from_slice(&chunk[..got]);
        }
        self.buffer.drain(..n).collect()
    }

    fn frame(&mut self) -> (u8, Vec<u8>) {
        let flags = self.read_exact(1)[0];
        let size = if flags & FLAG_LONG != 0 {
            let mut size = [0u8; 8];
            size.copy_from_slice(&self.read_exact(8));
            u64::from_be_bytes(size) as usize
        } else {
            usize::from(self.read_exact(1)[0])
        };
        (flags, self.read_exact(size))
    }

    fn send_frame(&mut self, flags: u8, body: &[u8]) {
        let mut out = BytesMut::new();
        put_frame(&mut out, flags, body);
        self.stream.write_all(&out).unwrap();
    }

    /// Whether the router closes the connection within `WAIT`.
    fn closed_by_router(&mut self) -> bool {
        let mut chunk = [0u8; 4096];
        loop {
            match self.stream.read(&mut chunk) {
                Ok(0) => return true,
                Ok(_) => {}
                Err(error) if error.kind() == io::ErrorKind::ConnectionReset => return true,
                Err(_) => return false, // timed out
            }
        }
    }
}

#[test]
fn a_stalled_peer_takes_sends_up_to_the_high_water_mark_and_loses_none() {
    let mut fixture = Fixture::new();
    let mut peer = RawPeer::handshake(&fixture.path, b"slow");
    peer.send_frame(0, b"here");
    assert_eq!(fixture.recv().identity, b"slow"[..]);
    // The peer reads nothing: the kernel's buffer fills, then the backlog, then sends fail.
    let body = vec![0xAB_u8; 1000];
    let mut accepted = 0u32;
    let refused = loop {
        let mut numbered = accepted.to_be_bytes().to_vec();
        numbered.extend_from_slice(&body);
        match fixture.send_now(b"slow", &[&numbered]) {
            Ok(()) => accepted += 1,
            Err(error) => break error,
        }
        assert!(accepted < 1_000_000, "never refused");
    };
    assert_eq!(refused, SendError::Full);
    assert!(accepted as usize > SEND_HIGH_WATER, "{accepted}");
    // Everything accepted arrives, in order, once the peer reads.
    for i in 0..accepted {
        let (flags, frame) = peer.frame();
        assert_eq!(flags & (FLAG_MORE | FLAG_COMMAND), 0);
        assert_eq!(frame[..4], i.to_be_bytes(), "message {i}");
        assert_eq!(frame.len(), 1004);
    }
    // Room again.
    fixture.send_now(b"slow", &[b"after"]).unwrap();
    assert_eq!(peer.frame().1, b"after");
}

#[test]
fn a_large_frame_is_written_from_its_own_buffer_in_order_with_what_was_queued() {
    let mut fixture = Fixture::new();
    let mut peer = RawPeer::handshake(&fixture.path, b"big");
    peer.send_frame(0, b"here");
    assert_eq!(fixture.recv().identity, b"big"[..]);
    // The peer reads nothing yet: what the kernel does not take waits in the backlog.
    let large = Bytes::from(vec![0xCD_u8; 8 << 20]);
    let socket = fixture.socket();
    socket.send(b"big", &owned(&[b"before"])).unwrap(); // corked
    let message = [
        Bytes::from_static(b"header"),
        large.clone(),
        Bytes::from_static(b"tail"),
    ];
    socket.send(b"big", &message).unwrap();
    socket.send(b"big", &owned(&[b"after"])).unwrap();
    {
        let (_, out) = &socket.peers[&b"big"[..]];
        let backlog = out.backlog.lock().unwrap();
        // Not copied: the backlog holds the frame's own bytes (what the kernel left of them).
        let end = large.as_ptr() as usize + large.len();
        assert!(
            backlog
                .queue
                .iter()
                .any(|(part, _)| part.as_ptr() as usize + part.len() == end),
            "the large frame was copied"
        );
        assert_eq!(
            backlog.messages, 2,
            "'before' and the large message wait whole"
        );
    }
    socket.flush();
    assert_eq!(peer.frame(), (0, b"before".to_vec()));
    assert_eq!(peer.frame(), (FLAG_MORE, b"header".to_vec()));
    let (flags, frame) = peer.frame();
    assert_eq!(flags, FLAG_MORE | FLAG_LONG);
    assert!(frame == large[..], "the large frame arrives whole");
    assert_eq!(peer.frame(), (0, b"tail".to_vec()));
    assert_eq!(peer.frame(), (0, b"after".to_vec()));
}

#[test]
fn ping_is_answered_with_pong_and_its_context() {
    let fixture = Fixture::new();
    let mut peer = RawPeer::handshake(&fixture.path, b"pinger");
    let mut ping = BytesMut::new();
    put_command_name(&mut ping, b"PING");
    ping.put_u16(100); // TTL, tenths of a second
    ping.put_slice(b"ctx-1");
    peer.send_frame(FLAG_COMMAND, &ping);
    let (flags, body) = peer.frame();
    assert_eq!(flags, FLAG_COMMAND);
    assert_eq!(body, b"\x04PONGctx-1");
}

#[test]
fn a_peer_that_does_not_speak_zmtp_is_dropped_and_others_are_served() {
    let mut fixture = Fixture::new();
    let mut http = RawPeer::connect(&fixture.path);
    http.stream
        .write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" as &[u8])
        .unwrap();
    let _ = http.stream.write_all(&[0u8; 64]);
    assert!(http.closed_by_router());

    // Version 2 and a CURVE peer are refused too.
    for (at, value) in [(10, 2u8), (12, b'C')] {
        let mut old = RawPeer::connect(&fixture.path);
        let mut hello = greeting();
        hello[at] = value;
        old.stream.write_all(&hello).unwrap();
        assert!(old.closed_by_router(), "greeting byte {at} = {value}");
    }

    let context = zmq::Context::new();
    let worker = dealer(&context, &fixture.endpoint(), Some(b"fine"));
    worker.send("still here", 0).unwrap();
    assert_eq!(frames_of(&fixture.recv()), vec![b"still here".to_vec()]);
}

#[test]
fn dropping_the_socket_disconnects_peers_and_removes_the_socket_file() {
    let mut fixture = Fixture::new();
    let mut peer = RawPeer::handshake(&fixture.path, b"bye");
    peer.send_frame(0, b"x");
    let _ = fixture.recv();
    assert!(fixture.path.exists());
    let socket = fixture.socket.take();
    fixture.runtime.block_on(async move { drop(socket) });
    assert!(!fixture.path.exists());
    assert!(peer.closed_by_router());
}
