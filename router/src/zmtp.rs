//! The workers' socket, spoken natively: a ZeroMQ ROUTER (ZMTP 3.1, NULL mechanism) on a Unix
//! socket, run on the front door's own tokio runtime.
//!
//! Why not libzmq here: every request crossed libzmq's I/O thread twice (the actor wakes it
//! through a mailbox to send; it wakes the actor through another to deliver the answer), and
//! those hand-offs were a large part of the front door's CPU per batch-1 request (issue 11).
//! Here a send is one `write` from the dispatcher's task, and an answer is read by a task of
//! the same runtime; a connection is watched for reading only (`stream.rs` says why). The
//! workers speak ZMTP in their serving loop too (`worker/dealer.py`, no libzmq there either),
//! and any libzmq DEALER can connect: this speaks the protocol both speak
//! (rfc.zeromq.org/spec/23 and /37) — greeting, READY with the socket type and identity,
//! frames with MORE/LONG flags, PING answered with PONG.
//!
//! ROUTER semantics kept from libzmq as the front door used it: a peer is addressed by the
//! identity it announced (one is made up when it announced none); sending to an identity that
//! is not connected fails at once (ROUTER_MANDATORY), and so does sending to a peer with too
//! much unwritten (the high-water mark); a second connection announcing a connected identity
//! is refused (no hand-over); a departed peer's unread messages are still delivered.

use std::collections::{HashMap, VecDeque};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use tokio::net::UnixListener;
use tokio::sync::{mpsc, Notify};

use stream::PeerStream;

mod stream;

/// How long a new connection may take to greet and say READY.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Writes a peer may have waiting unwritten before sends to it fail (libzmq's SNDHWM).
pub const SEND_HIGH_WATER: usize = 1000;
/// Bytes queued for one peer between flushes past which they are written at once.
const CORK_LIMIT: usize = 64 * 1024;
/// A frame at least this long is written from its own buffer, not copied in behind its
/// header: a tensor of hundreds of MiB was copied whole on its way to its worker, its
/// request holding twice its size meanwhile, the copy counted by no budget (found by a hunt).
const SHARED_FRAME: usize = CORK_LIMIT;
/// A frame larger than this closes the connection (a peer that is not speaking ZMTP).
const MAX_FRAME: u64 = 1 << 32;

const FLAG_MORE: u8 = 0x01;
const FLAG_LONG: u8 = 0x02;
const FLAG_COMMAND: u8 = 0x04;

/// Why a send did not happen.
#[derive(Debug, PartialEq, Eq)]
pub enum SendError {
    /// No peer with that identity is connected (libzmq: EHOSTUNREACH).
    Unreachable,
    /// The peer has `SEND_HIGH_WATER` messages unwritten (libzmq: EAGAIN).
    Full,
}

/// One multipart message from a peer.
pub struct Message {
    /// Shared by every message of the connection (no allocation per message).
    pub identity: Bytes,
    pub frames: Vec<Bytes>,
    /// The connection it came on (a refused duplicate's messages are dropped by this).
    connection: u64,
}

/// What the socket delivers: a message, or the news that a peer's connection closed.
pub enum Incoming {
    Message(Message),
    /// The peer's connection ended (its process exited or closed the socket); messages it
    /// sent before were delivered first.
    Left(Vec<u8>),
}

enum Event {
    Joined {
        identity: Vec<u8>,
        connection: u64,
        out: Arc<PeerOut>,
    },
    Message(Message),
    Left {
        identity: Vec<u8>,
        connection: u64,
    },
}

/// The ROUTER socket: the dispatcher owns it and is its one reader and writer.
pub struct RouterSocket {
    peers: HashMap<Vec<u8>, (u64, Arc<PeerOut>)>,
    /// Messages sent since the last `flush`, per peer (a handful of peers: a list).
    corked: Vec<(Arc<PeerOut>, BytesMut, usize)>,
    events: mpsc::UnboundedReceiver<Event>,
    path: PathBuf,
    accept: tokio::task::JoinHandle<()>,
}

impl RouterSocket {
    /// Listen on `path` (a stale socket file there is replaced, as libzmq's ipc bind does).
    /// Must be called inside a tokio runtime.
    pub fn bind(path: &Path) -> io::Result<RouterSocket> {
        match std::fs::remove_file(path) {
            Ok(()) => {}
            Err(error) if error.kind() == io::ErrorKind::NotFound => {}
            Err(error) => return Err(error),
        }
        let listener = UnixListener::bind(path)?;
        let (events_tx, events) = mpsc::unbounded_channel();
        let accept = tokio::spawn(accept_loop(listener, events_tx));
        Ok(RouterSocket {
            peers: HashMap::new(),
            corked: Vec::new(),
            events,
            path: path.to_path_buf(),
            accept,
        })
    }

    /// The next message or departure; `None` only when the socket can never deliver again.
    pub async fn recv(&mut self) -> Option<Incoming> {
        loop {
            let event = self.events.recv().await?;
            if let Some(incoming) = self.take(event) {
                return Some(incoming);
            }
        }
    }

    /// One already received, without waiting.
    pub fn try_recv(&mut self) -> Option<Incoming> {
        while let Ok(event) = self.events.try_recv() {
            if let Some(incoming) = self.take(event) {
                return Some(incoming);
            }
        }
        None
    }

    fn take(&mut self, event: Event) -> Option<Incoming> {
        match event {
            Event::Message(message) => {
                let (connection, _) = self.peers.get(message.identity.as_ref())?;
                (*connection == message.connection).then_some(Incoming::Message(message))
            }
            Event::Joined {
                identity,
                connection,
                out,
            } => {
                match self.peers.entry(identity) {
                    std::collections::hash_map::Entry::Vacant(free) => {
                        free.insert((connection, out));
                    }
                    std::collections::hash_map::Entry::Occupied(taken) => {
                        // libzmq without ROUTER_HANDOVER: the first keeps the identity; the
                        // second's messages are dropped (it stays connected, so a DEALER
                        // does not reconnect in a loop).
                        crate::log_warn!(
                            "a second worker connection announced {}: its messages are dropped",
                            String::from_utf8_lossy(taken.key())
                        );
                    }
                }
                None
            }
            Event::Left {
                identity,
                connection,
            } => {
                if self
                    .peers
                    .get(&identity)
                    .is_some_and(|(c, _)| *c == connection)
                {
                    self.peers.remove(&identity);
                    return Some(Incoming::Left(identity));
                }
                None
            }
        }
    }

    /// Queue `frames` for the peer `identity` as one multipart message; they leave at the
    /// next `flush` (or at once past `CORK_LIMIT` bytes, or with a frame of `SHARED_FRAME` or
    /// more, which is written from its own buffer after what was queued before). Never waits.
    pub fn send(&mut self, identity: &[u8], frames: &[Bytes]) -> Result<(), SendError> {
        let Some((_, out)) = self.peers.get(identity) else {
            return Err(SendError::Unreachable);
        };
        out.can_take()?;
        let at = match self
            .corked
            .iter()
            .position(|(peer, _, _)| Arc::ptr_eq(peer, out))
        {
            Some(at) => at,
            None => {
                self.corked.push((out.clone(), BytesMut::new(), 0));
                self.corked.len() - 1
            }
        };
        let (_, corked, messages) = &mut self.corked[at];
        let flags = |i: usize| if i + 1 < frames.len() { FLAG_MORE } else { 0 };
        if frames.iter().any(|f| f.len() >= SHARED_FRAME) {
            // What was queued before, in order, then this message: its small frames and
            // every header copied, its large frames as they are.
            let mut parts = Vec::with_capacity(2 * frames.len() + 1);
            let mut copied = corked.split();
            for (i, frame) in frames.iter().enumerate() {
                if frame.len() >= SHARED_FRAME {
                    put_header(&mut copied, flags(i), frame.len());
                    parts.push(copied.split().freeze());
                    parts.push(frame.clone());
                } else {
                    put_frame(&mut copied, flags(i), frame);
                }
            }
            parts.push(copied.freeze());
            let queued = std::mem::take(messages);
            return out.write_parts(parts, queued + 1);
        }
        let size: usize = frames.iter().map(|f| 9 + f.len()).sum();
        corked.reserve(size);
        for (i, frame) in frames.iter().enumerate() {
            put_frame(corked, flags(i), frame);
        }
        *messages += 1;
        if corked.len() >= CORK_LIMIT {
            let data = corked.split().freeze();
            return out.write(data, std::mem::take(messages));
        }
        Ok(())
    }

    /// Write what `send` queued: one write per peer for everything sent since the last flush
    /// (what libzmq's I/O thread did by batching its pipe). A peer whose write fails is closed;
    /// its departure comes back through `recv`.
    pub fn flush(&mut self) {
        for (out, corked, messages) in self.corked.drain(..) {
            if !corked.is_empty() {
                let _ = out.write(corked.freeze(), messages);
            }
        }
    }
}

impl Drop for RouterSocket {
    fn drop(&mut self) {
        self.accept.abort();
        for (_, out) in self.peers.values() {
            out.close();
        }
        let _ = std::fs::remove_file(&self.path);
    }
}

fn put_frame(buf: &mut BytesMut, flags: u8, body: &[u8]) {
    put_header(buf, flags, body.len());
    buf.put_slice(body);
}

/// A frame's header: its flags and its length, short or long.
fn put_header(buf: &mut BytesMut, flags: u8, len: usize) {
    if len > 255 {
        buf.put_u8(flags | FLAG_LONG);
        buf.put_u64(len as u64);
    } else {
        buf.put_u8(flags);
        buf.put_u8(len as u8);
    }
}

/// A peer's sending side: written directly while the kernel takes everything; what it does
/// not take waits here, in order, for the peer's writer task.
struct PeerOut {
    stream: Arc<PeerStream>,
    backlog: Mutex<Backlog>,
    wake_writer: Notify,
}

#[derive(Default)]
struct Backlog {
    /// Unwritten bytes, each with the number of messages it ends.
    queue: VecDeque<(Bytes, usize)>,
    /// Messages in `queue` (what the high-water mark counts).
    messages: usize,
    closed: bool,
}

impl Backlog {
    /// Whether one more message may be queued.
    fn can_take(&self) -> Result<(), SendError> {
        if self.closed {
            Err(SendError::Unreachable)
        } else if self.messages >= SEND_HIGH_WATER {
            Err(SendError::Full)
        } else {
            Ok(())
        }
    }
}

impl PeerOut {
    /// Whether a send to this peer can be accepted now.
    fn can_take(&self) -> Result<(), SendError> {
        self.backlog
            .lock()
            .map_err(|_| SendError::Unreachable)?
            .can_take()
    }

    /// Writes `data` (`messages` whole messages) now, or queues what the kernel did not take.
    fn write(&self, data: Bytes, messages: usize) -> Result<(), SendError> {
        self.write_parts([data], messages)
    }

    /// Writes `parts` one after another (`messages` whole messages in all) now, or queues
    /// what the kernel did not take: all of them or none, so a message is never cut.
    fn write_parts(
        &self,
        parts: impl IntoIterator<Item = Bytes>,
        messages: usize,
    ) -> Result<(), SendError> {
        let Ok(mut backlog) = self.backlog.lock() else {
            return Err(SendError::Unreachable);
        };
        backlog.can_take()?;
        // The lock is held across the writes so the writer task cannot slip data in between:
        // bytes leave in the order they were sent.
        let mut direct = backlog.queue.is_empty();
        let mut queued = false;
        for mut data in parts {
            if direct {
                match self.stream.try_write(&data) {
                    Ok(n) if n == data.len() => continue,
                    Ok(n) => data.advance(n),
                    Err(error) if error.kind() == io::ErrorKind::WouldBlock => {}
                    Err(_) => {
                        drop(backlog);
                        self.close();
                        return Err(SendError::Unreachable);
                    }
                }
                direct = false;
            }
            if !data.is_empty() {
                backlog.queue.push_back((data, 0));
                queued = true;
            }
        }
        if !queued {
            return Ok(());
        }
        // Counted with the last piece: they are written in order.
        if let Some((_, count)) = backlog.queue.back_mut() {
            *count += messages;
        }
        backlog.messages += messages;
        drop(backlog);
        self.wake_writer.notify_one();
        Ok(())
    }

    /// Ends the connection both ways (its reader sees end-of-file and reports it gone).
    fn close(&self) {
        if let Ok(mut backlog) = self.backlog.lock() {
            backlog.closed = true;
            backlog.queue.clear();
            backlog.messages = 0;
        }
        self.wake_writer.notify_one();
        self.shutdown_stream();
    }

    /// The writer task: empties the backlog whenever the socket can take more.
    async fn write_backlog(self: Arc<Self>) {
        loop {
            self.wake_writer.notified().await;
            let mut wait = None;
            loop {
                match self.backlog.lock() {
                    Ok(backlog) if backlog.closed => return,
                    Ok(backlog) if backlog.queue.is_empty() => break,
                    Ok(_) => {}
                    Err(_) => return,
                }
                // Registered for writing only while there is something to write (stream.rs).
                if self.stream.writable(&mut wait).await.is_err() {
                    self.close();
                    return;
                }
                let Ok(mut backlog) = self.backlog.lock() else {
                    return;
                };
                while let Some((front, messages)) = backlog.queue.front_mut() {
                    match self.stream.try_write(front) {
                        Ok(n) if n == front.len() => {
                            let messages = *messages;
                            backlog.queue.pop_front();
                            backlog.messages -= messages;
                        }
                        Ok(n) => front.advance(n),
                        Err(error) if error.kind() == io::ErrorKind::WouldBlock => break,
                        Err(_) => {
                            drop(backlog);
                            self.close();
                            return;
                        }
                    }
                }
            }
        }
    }

    /// Both directions closed; an error (already closed) changes nothing.
    fn shutdown_stream(&self) {
        use std::os::fd::AsRawFd;
        // SAFETY: shutdown(2) on a descriptor this stream owns and keeps open; it only makes
        // the reader see end-of-file.
        unsafe { libc::shutdown(self.stream.as_raw_fd(), libc::SHUT_RDWR) };
    }
}

async fn accept_loop(listener: UnixListener, events: mpsc::UnboundedSender<Event>) {
    let mut connections: u64 = 0;
    // A failure lasts as long as its cause (descriptors run out): one line per 10 s, and the
    // count left when it ends.
    let failures = crate::log::Throttle::new();
    let mut looks = tokio::time::interval(crate::log::Throttle::EVERY);
    looks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            _ = looks.tick() => {
                if let Some(count) = failures.trailing(std::time::Instant::now()) {
                    crate::log_warn!(
                        "accepting a worker connection failed {count} more time(s) since the \
                         last line"
                    );
                }
                continue;
            }
        };
        match accepted {
            Ok((stream, _)) => {
                connections += 1;
                tokio::spawn(serve_peer(stream, connections, events.clone()));
            }
            Err(error) => {
                // EMFILE and the like: wait instead of spinning; the listener stays.
                if let Some(count) = failures.note(std::time::Instant::now()) {
                    crate::log_warn!(
                        "accepting a worker connection failed ({count} since the last line): \
                         {error}"
                    );
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        if events.is_closed() {
            return;
        }
    }
}

/// One connection: the handshake, then every message it sends, until it closes.
async fn serve_peer(
    stream: tokio::net::UnixStream,
    connection: u64,
    events: mpsc::UnboundedSender<Event>,
) {
    let stream = match PeerStream::new(stream) {
        Ok(stream) => Arc::new(stream),
        Err(error) => {
            crate::log_warn!("a worker connection could not be watched: {error}");
            return;
        }
    };
    let mut reader = FrameReader::default();
    // Frames read with READY stay here and are delivered first.
    let mut frames = VecDeque::new();
    let identity = match tokio::time::timeout(
        HANDSHAKE_TIMEOUT,
        handshake(&stream, &mut reader, &mut frames, connection),
    )
    .await
    {
        Ok(Ok(identity)) => identity,
        Ok(Err(error)) => {
            crate::log_warn!("a worker connection failed its ZMTP handshake: {error}");
            return;
        }
        Err(_) => {
            crate::log_warn!("a worker connection did not finish its ZMTP handshake in time");
            return;
        }
    };
    let out = Arc::new(PeerOut {
        stream: stream.clone(),
        backlog: Mutex::new(Backlog::default()),
        wake_writer: Notify::new(),
    });
    let writer = tokio::spawn(out.clone().write_backlog());
    let joined = Event::Joined {
        identity: identity.clone(),
        connection,
        out: out.clone(),
    };
    let shared_identity = Bytes::from(identity.clone());
    if events.send(joined).is_ok() {
        let mut message: Vec<Bytes> = Vec::with_capacity(4);
        // What came with READY is parsed before anything more is read.
        loop {
            let ok = reader.frames(&mut frames);
            let mut delivered = true;
            while let Some((flags, body)) = frames.pop_front() {
                if flags & FLAG_COMMAND != 0 {
                    if let Some(pong) = pong_for(&body) {
                        let _ = out.write(pong, 1);
                    }
                    continue;
                }
                message.push(body);
                if flags & FLAG_MORE == 0 {
                    let delivery = Event::Message(Message {
                        identity: shared_identity.clone(),
                        frames: std::mem::replace(&mut message, Vec::with_capacity(4)),
                        connection,
                    });
                    delivered = events.send(delivery).is_ok();
                    if !delivered {
                        break;
                    }
                }
            }
            if !ok {
                crate::log_warn!(
                    "worker {} sent a frame larger than {MAX_FRAME} bytes: disconnected",
                    String::from_utf8_lossy(&identity)
                );
                break;
            }
            if !delivered {
                break;
            }
            if let Err(error) = reader.fill(&stream).await {
                if error.kind() != io::ErrorKind::UnexpectedEof {
                    crate::log_warn!(
                        "reading from worker {} failed: {error}",
                        String::from_utf8_lossy(&identity)
                    );
                }
                break;
            }
        }
    }
    out.close();
    writer.abort();
    let _ = events.send(Event::Left {
        identity,
        connection,
    });
}

/// Greeting and READY both ways; the peer's identity (made up when it announced none).
async fn handshake(
    stream: &PeerStream,
    reader: &mut FrameReader,
    frames: &mut VecDeque<(u8, Bytes)>,
    connection: u64,
) -> io::Result<Vec<u8>> {
    let mut ours = BytesMut::with_capacity(128);
    ours.put_slice(&greeting());
    let mut ready = BytesMut::new();
    put_command_name(&mut ready, b"READY");
    put_property(&mut ready, b"Socket-Type", b"ROUTER");
    put_frame(&mut ours, FLAG_COMMAND, &ready);
    write_all(stream, &ours).await?;

    while reader.buffer.len() < GREETING_LEN {
        reader.fill(stream).await?;
    }
    let theirs = reader.buffer.split_to(GREETING_LEN);
    check_greeting(&theirs)?;
    let body = loop {
        if !reader.frames(frames) {
            return Err(invalid("a frame too large"));
        }
        if let Some((flags, body)) = frames.pop_front() {
            if flags & FLAG_COMMAND == 0 {
                return Err(invalid("a message before READY"));
            }
            break body;
        }
        reader.fill(stream).await?;
    };
    let properties = parse_ready(&body)?;
    let socket_type = properties
        .iter()
        .find(|(name, _)| name.eq_ignore_ascii_case(b"Socket-Type"))
        .map(|(_, value)| value.clone())
        .unwrap_or_default();
    if !matches!(socket_type.as_slice(), b"DEALER" | b"REQ" | b"ROUTER") {
        return Err(invalid(&format!(
            "a {} socket cannot talk to a ROUTER",
            String::from_utf8_lossy(&socket_type)
        )));
    }
    let identity = properties
        .into_iter()
        .find(|(name, _)| name.eq_ignore_ascii_case(b"Identity"))
        .map(|(_, value)| value)
        .filter(|value| !value.is_empty() && value[0] != 0)
        .unwrap_or_else(|| made_up_identity(connection));
    Ok(identity)
}

/// libzmq's identities for peers that set none: a zero byte, then a number.
fn made_up_identity(connection: u64) -> Vec<u8> {
    let mut identity = vec![0u8];
    identity.extend_from_slice(&(connection as u32).to_be_bytes());
    identity
}

const GREETING_LEN: usize = 64;

fn greeting() -> [u8; GREETING_LEN] {
    let mut g = [0u8; GREETING_LEN];
    g[0] = 0xFF;
    g[8] = 1; // the 8 padding bytes: a ZMTP 1.0 length (identity size + 1)
    g[9] = 0x7F;
    g[10] = 3; // version 3.1
    g[11] = 1;
    g[12..16].copy_from_slice(b"NULL");
    // as-server 0 and the filler: zeros
    g
}

fn check_greeting(g: &[u8]) -> io::Result<()> {
    if g[0] != 0xFF || g[9] & 0x01 == 0 {
        return Err(invalid("not a ZMTP 3 greeting"));
    }
    if g[10] < 3 {
        return Err(invalid(&format!("ZMTP version {} (3 needed)", g[10])));
    }
    let mechanism = &g[12..32];
    let name_end = mechanism.iter().position(|b| *b == 0).unwrap_or(20);
    if &mechanism[..name_end] != b"NULL" {
        return Err(invalid(&format!(
            "security mechanism {} (NULL needed)",
            String::from_utf8_lossy(&mechanism[..name_end])
        )));
    }
    Ok(())
}

fn put_command_name(buf: &mut BytesMut, name: &[u8]) {
    buf.put_u8(name.len() as u8);
    buf.put_slice(name);
}

fn put_property(buf: &mut BytesMut, name: &[u8], value: &[u8]) {
    buf.put_u8(name.len() as u8);
    buf.put_slice(name);
    buf.put_u32(value.len() as u32);
    buf.put_slice(value);
}

type Properties = Vec<(Vec<u8>, Vec<u8>)>;

fn parse_ready(mut body: &[u8]) -> io::Result<Properties> {
    let name = take_name(&mut body)?;
    if name != b"READY" {
        return Err(invalid(&format!(
            "command {} where READY was expected",
            String::from_utf8_lossy(name)
        )));
    }
    let mut properties = Vec::new();
    while !body.is_empty() {
        let name = take_name(&mut body)?.to_vec();
        if body.len() < 4 {
            return Err(invalid("a truncated READY property"));
        }
        let size = body.get_u32() as usize;
        if body.len() < size {
            return Err(invalid("a truncated READY property"));
        }
        properties.push((name, body[..size].to_vec()));
        body.advance(size);
    }
    Ok(properties)
}

fn take_name<'a>(body: &mut &'a [u8]) -> io::Result<&'a [u8]> {
    let Some((&size, rest)) = body.split_first() else {
        return Err(invalid("an empty command"));
    };
    let size = usize::from(size);
    if rest.len() < size {
        return Err(invalid("a truncated command name"));
    }
    let (name, rest) = rest.split_at(size);
    *body = rest;
    Ok(name)
}

/// ZMTP 3.1's PING gets a PONG with its context; other commands need no answer here.
fn pong_for(command: &[u8]) -> Option<Bytes> {
    let mut body = command;
    let name = take_name(&mut body).ok()?;
    if name != b"PING" || body.len() < 2 {
        return None;
    }
    let context = &body[2..body.len().min(2 + 16)];
    let mut pong = BytesMut::new();
    put_command_name(&mut pong, b"PONG");
    pong.put_slice(context);
    let mut frame = BytesMut::new();
    put_frame(&mut frame, FLAG_COMMAND, &pong);
    Some(frame.freeze())
}

fn invalid(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what.to_string())
}

async fn write_all(stream: &PeerStream, mut data: &[u8]) -> io::Result<()> {
    let mut wait = None;
    while !data.is_empty() {
        match stream.try_write(data) {
            Ok(n) => data = &data[n..],
            Err(error) if error.kind() == io::ErrorKind::WouldBlock => {
                stream.writable(&mut wait).await?;
            }
            Err(error) => return Err(error),
        }
    }
    Ok(())
}

/// Bytes read from a connection, cut into frames.
#[derive(Default)]
struct FrameReader {
    buffer: BytesMut,
    /// The size of the frame at the head of the buffer, once its header is complete, so a
    /// large frame's allocation is made once.
    want: usize,
}

impl FrameReader {
    /// Read what the connection has (at least one byte); end-of-file is an error.
    async fn fill(&mut self, stream: &PeerStream) -> io::Result<()> {
        let wanted = self.want.saturating_sub(self.buffer.len()).max(16 * 1024);
        self.buffer.reserve(wanted);
        match stream.read_buf(&mut self.buffer).await? {
            0 => Err(io::ErrorKind::UnexpectedEof.into()),
            _ => Ok(()),
        }
    }

    /// Moves every complete frame into `out`; false when the stream cannot be ZMTP.
    fn frames(&mut self, out: &mut VecDeque<(u8, Bytes)>) -> bool {
        loop {
            let Some(&flags) = self.buffer.first() else {
                return true;
            };
            let (header, size) = if flags & FLAG_LONG != 0 {
                if self.buffer.len() < 9 {
                    return true;
                }
                let mut size = [0u8; 8];
                size.copy_from_slice(&self.buffer[1..9]);
                (9, u64::from_be_bytes(size))
            } else {
                if self.buffer.len() < 2 {
                    return true;
                }
                (2, u64::from(self.buffer[1]))
            };
            if size > MAX_FRAME {
                return false;
            }
            let total = header + size as usize;
            if self.buffer.len() < total {
                self.want = total;
                return true;
            }
            self.want = 0;
            let mut frame = self.buffer.split_to(total);
            frame.advance(header);
            out.push_back((flags, frame.freeze()));
        }
    }
}

#[cfg(test)]
mod tests;
