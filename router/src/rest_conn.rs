//! A REST client connection's socket, watched: the clocks that end a connection (idle
//! between requests, a request head that stops arriving, an answer its client does not
//! take) and its lingering close.
//!
//! hyper's one clock (`header_read_timeout`) ran from when it began waiting for a head, so
//! an idle keep-alive connection and a head in progress shared one deadline: a request sent
//! just before it lapsed was dropped unanswered (a load balancer's keep-alive of the same
//! length sends one then, and answers its client 502). Here the head's clock starts at its
//! first byte, as nginx's client_header_timeout, and idleness has a clock of its own, longer,
//! as nginx's keepalive_timeout (75 s against 60). An answer whose bytes have not moved for
//! the stall limit ends its connection, as nginx's send_timeout (and as the gRPC port's
//! answers): a client that stopped reading held its answer and its place for ever.
//!
//! A connection hyper closes with some of its request unread (an error answered before the
//! body, such as a 404 or a 413) was closed at once, and the kernel answered the client's
//! next bytes with a reset that could discard the answer before the client read it (Python's
//! `http.client`, `urllib` and wget saw a broken pipe, not the 4xx; found by a hunt). Its
//! sending side is shut first now, and what the client still sends is read and dropped
//! until it closes, pauses, or a bound passes: nginx's lingering close.

use std::future::Future as _;
use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::time::{Instant, Sleep};

/// A lingering close ends once its client has sent nothing for this long (nginx's
/// lingering_timeout is 5 s)...
const LINGER_PAUSE: Duration = Duration::from_secs(2);
/// ...or this long after it began (nginx's lingering_time).
const LINGER_MOST: Duration = Duration::from_secs(30);
/// The idle clock is the stall limit times this (nginx: 75 s of keepalive_timeout against
/// 60 of client_header_timeout), so that a client's or a balancer's keep-alive of the stall
/// limit ends first.
const IDLE_OVER_STALL: f64 = 1.25;

/// Why a connection's clocks end it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lapsed {
    /// No request and nothing to send for the idle limit.
    Idle,
    /// A request head began and did not complete within the stall limit.
    Head,
    /// An answer's bytes did not move for the stall limit.
    Answer,
}

/// What is left of a request's body, as the service reads it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum BodyLeft {
    Done,
    /// This many bytes (a body with a length).
    Bytes(u64),
    /// Some (a chunked body).
    Unknown,
}

#[derive(Debug)]
struct State {
    /// Requests handed to the service and not yet answered.
    handling: usize,
    /// What the service has not read of the body of the request it handles.
    body_left: BodyLeft,
    /// What the service left unread of the last request's body, which hyper reads and drops
    /// in the turn that finishes the answer (Unknown: as much as it reads then; `polled`
    /// ends it). Those bytes are no request head: they start no head clock.
    draining: BodyLeft,
    /// The last request's body was left unread: its connection's close lingers.
    unread: bool,
    /// hyper's turns ended since the last request was answered with its body unread.
    turns_since_answer: u8,
    /// When bytes of a request head began to come (read while no request was handled).
    head_since: Option<Instant>,
    /// When a write last found the socket full, while it still is.
    write_blocked_since: Option<Instant>,
    /// The last byte read or written.
    last_moved: Instant,
}

/// The clocks of one connection, shared by its socket, its service and its serving loop.
#[derive(Clone, Debug)]
pub struct Clocks {
    state: Arc<Mutex<State>>,
    stall: Option<Duration>,
}

impl Clocks {
    /// `stall`: the stall limit (--request-read-timeout; None: no clock ends a connection).
    pub fn new(stall: Option<Duration>) -> Self {
        Clocks {
            state: Arc::new(Mutex::new(State {
                handling: 0,
                body_left: BodyLeft::Done,
                draining: BodyLeft::Done,
                unread: false,
                turns_since_answer: 0,
                head_since: None,
                write_blocked_since: None,
                last_moved: Instant::now(),
            })),
            stall,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A request is handed to the service: its head is complete; until `Handling` drops,
    /// the connection is not idle. Its body: read to its end already (`done`), or so many
    /// bytes (`length`; None: chunked), followed by `WatchedBody`.
    pub fn handling(&self, done: bool, length: Option<u64>) -> Handling {
        let mut state = self.lock();
        state.handling += 1;
        state.head_since = None;
        state.body_left = match length {
            _ if done => BodyLeft::Done,
            Some(0) => BodyLeft::Done,
            Some(length) => BodyLeft::Bytes(length),
            None => BodyLeft::Unknown,
        };
        state.draining = BodyLeft::Done;
        state.unread = false;
        Handling(self.clone())
    }

    /// Whether closing the connection lingers: a request's body is left unread, or one is
    /// still being handled (nginx lingers only then).
    fn lingers(&self) -> bool {
        let state = self.lock();
        // A head in progress too: hyper's own answer to one it refuses (400, 431) is written
        // with the rest of it unread.
        state.unread || state.handling > 0 || state.head_since.is_some()
    }

    /// hyper's turn over the connection ended with the connection still open. With no
    /// request handled and the answer written, hyper drops what is left of the last request's
    /// body in the turn the service let it go or the next: once two such turns have ended
    /// with the connection open, it was read to its end (nothing to linger on) and what hyper
    /// reads next is a head. True when the caller is to give hyper that next turn at once
    /// (wake the connection): a body hyper had whole wakes nothing when it is let go, and
    /// the state stayed until the client's next bytes (a graceful drain then lingered).
    pub fn polled(&self) -> bool {
        let mut state = self.lock();
        if state.handling > 0 || state.write_blocked_since.is_some() {
            return false;
        }
        if state.draining == BodyLeft::Done {
            state.unread = false;
            return false;
        }
        state.turns_since_answer = state.turns_since_answer.saturating_add(1);
        if state.turns_since_answer >= 2 {
            state.draining = BodyLeft::Done;
            state.unread = false;
            return false;
        }
        true
    }

    fn body_read(&self, bytes: usize, ended: bool) {
        let mut state = self.lock();
        state.body_left = match state.body_left {
            _ if ended => BodyLeft::Done,
            BodyLeft::Bytes(left) => match left.saturating_sub(bytes as u64) {
                0 => BodyLeft::Done,
                left => BodyLeft::Bytes(left),
            },
            left => left,
        };
    }

    /// Whether a clock has run out at `now`, and if none has, when to look again (None: no
    /// clock runs: the stall limit is zero).
    pub fn check(&self, now: Instant) -> Result<Option<Instant>, Lapsed> {
        let Some(stall) = self.stall else {
            return Ok(None);
        };
        let state = self.lock();
        let mut next = now + stall;
        if let Some(since) = state.write_blocked_since {
            let at = since + stall;
            if now >= at {
                return Err(Lapsed::Answer);
            }
            next = next.min(at);
        }
        if let Some(since) = state.head_since {
            let at = since + stall;
            if now >= at {
                return Err(Lapsed::Head);
            }
            next = next.min(at);
        } else if state.handling == 0 && state.write_blocked_since.is_none() {
            let at = state.last_moved + stall.mul_f64(IDLE_OVER_STALL);
            if now >= at {
                return Err(Lapsed::Idle);
            }
            next = next.min(at);
        }
        Ok(Some(next))
    }

    fn read(&self, bytes: usize) {
        if bytes == 0 {
            return;
        }
        let now = Instant::now();
        let mut state = self.lock();
        state.last_moved = now;
        if state.handling > 0 {
            return;
        }
        // Bytes of a body the service left unread come first: hyper drops them.
        let head_bytes = match state.draining {
            BodyLeft::Done => bytes as u64,
            BodyLeft::Unknown => 0,
            BodyLeft::Bytes(left) => {
                let dropped = left.min(bytes as u64);
                state.draining = match left - dropped {
                    0 => BodyLeft::Done,
                    left => BodyLeft::Bytes(left),
                };
                bytes as u64 - dropped
            }
        };
        if head_bytes > 0 && state.head_since.is_none() {
            state.head_since = Some(now);
        }
    }

    fn wrote(&self, outcome: &Poll<io::Result<usize>>) {
        let now = Instant::now();
        let mut state = self.lock();
        match outcome {
            Poll::Pending => {
                state.write_blocked_since.get_or_insert(now);
            }
            Poll::Ready(Ok(written)) if *written > 0 => {
                state.write_blocked_since = None;
                state.last_moved = now;
            }
            Poll::Ready(_) => {}
        }
    }
}

/// One turn of hyper's connection future, told to the clocks (`Clocks::polled`), the next
/// given at once when they ask for it.
pub fn turn<F: std::future::Future>(
    connection: Pin<&mut F>,
    clocks: &Clocks,
    cx: &mut Context<'_>,
) -> Poll<F::Output> {
    let turn = connection.poll(cx);
    if turn.is_pending() && clocks.polled() {
        cx.waker().wake_by_ref();
    }
    turn
}

/// A request in the service: the connection is not idle meanwhile.
pub struct Handling(Clocks);

impl Drop for Handling {
    fn drop(&mut self) {
        let mut state = self.0.lock();
        state.handling = state.handling.saturating_sub(1);
        state.last_moved = Instant::now();
        if state.body_left != BodyLeft::Done {
            state.draining = state.body_left;
            state.unread = true;
            state.turns_since_answer = 0;
            state.body_left = BodyLeft::Done;
        }
    }
}

/// A request's body as the service reads it, followed by the clocks (what is left of it
/// decides whether the bytes read after its answer are a new head, and whether a close
/// lingers).
pub struct WatchedBody {
    inner: hyper::body::Incoming,
    clocks: Clocks,
}

impl Clocks {
    /// A request's body handed to the service: the request counted as handled until
    /// `Handling` drops, and its body followed as the service reads it.
    pub fn watch(&self, body: hyper::body::Incoming) -> (Handling, WatchedBody) {
        use hyper::body::Body as _;
        let handling = self.handling(body.is_end_stream(), body.size_hint().exact());
        let body = WatchedBody {
            inner: body,
            clocks: self.clone(),
        };
        (handling, body)
    }
}

impl hyper::body::Body for WatchedBody {
    type Data = bytes::Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<hyper::body::Frame<bytes::Bytes>, hyper::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        match &polled {
            Poll::Ready(Some(Ok(frame))) => {
                let read = frame.data_ref().map_or(0, bytes::Bytes::len);
                self.clocks.body_read(read, self.inner.is_end_stream());
            }
            Poll::Ready(None) => self.clocks.body_read(0, true),
            _ => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.inner.size_hint()
    }
}

/// Where a lingering close is.
enum Closing {
    Open,
    /// Our side shut; reading what the client still sends, until its end or the bounds.
    Lingering {
        pause: Pin<Box<Sleep>>,
        most: Pin<Box<Sleep>>,
    },
    Closed,
}

/// The connection's socket as hyper sees it.
pub struct WatchedStream {
    inner: TcpStream,
    clocks: Clocks,
    closing: Closing,
}

impl WatchedStream {
    pub fn new(inner: TcpStream, clocks: Clocks) -> Self {
        WatchedStream {
            inner,
            clocks,
            closing: Closing::Open,
        }
    }

    /// Reads and drops what the client still sends: Ready once it closed, paused for
    /// LINGER_PAUSE, or LINGER_MOST passed.
    fn poll_linger(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        let Closing::Lingering { pause, most } = &mut self.closing else {
            return Poll::Ready(());
        };
        let mut scratch = [0u8; 16 * 1024];
        loop {
            if most.as_mut().poll(cx).is_ready() || pause.as_mut().poll(cx).is_ready() {
                return Poll::Ready(());
            }
            let mut buf = ReadBuf::new(&mut scratch);
            match Pin::new(&mut self.inner).poll_read(cx, &mut buf) {
                Poll::Ready(Ok(())) if buf.filled().is_empty() => return Poll::Ready(()),
                Poll::Ready(Ok(())) => pause.as_mut().reset(Instant::now() + LINGER_PAUSE),
                Poll::Ready(Err(_)) => return Poll::Ready(()),
                Poll::Pending => return Poll::Pending,
            }
        }
    }
}

impl AsyncRead for WatchedStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let outcome = Pin::new(&mut this.inner).poll_read(cx, buf);
        if let Poll::Ready(Ok(())) = outcome {
            this.clocks.read(buf.filled().len() - before);
        }
        outcome
    }
}

impl AsyncWrite for WatchedStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let outcome = Pin::new(&mut this.inner).poll_write(cx, buf);
        this.clocks.wrote(&outcome);
        outcome
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let outcome = Pin::new(&mut this.inner).poll_write_vectored(cx, bufs);
        this.clocks.wrote(&outcome);
        outcome
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    /// The lingering close: our side shut (the client reads its answer, then its end),
    /// then what it still sends read and dropped, so that closing does not reset the
    /// connection under an answer it has not read.
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        loop {
            match this.closing {
                Closing::Open if !this.clocks.lingers() => {
                    // Nothing of a request unread (an idle connection drained, a client that
                    // asked to close): shut, not lingered on.
                    this.closing = Closing::Closed;
                    return Pin::new(&mut this.inner).poll_shutdown(cx);
                }
                Closing::Open => {
                    if let Err(error) =
                        std::task::ready!(Pin::new(&mut this.inner).poll_shutdown(cx))
                    {
                        this.closing = Closing::Closed;
                        return Poll::Ready(Err(error));
                    }
                    let now = Instant::now();
                    this.closing = Closing::Lingering {
                        pause: Box::pin(tokio::time::sleep_until(now + LINGER_PAUSE)),
                        most: Box::pin(tokio::time::sleep_until(now + LINGER_MOST)),
                    };
                }
                Closing::Lingering { .. } => {
                    std::task::ready!(this.poll_linger(cx));
                    this.closing = Closing::Closed;
                }
                Closing::Closed => return Poll::Ready(Ok(())),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const STALL: Duration = Duration::from_secs(60);

    #[tokio::test(start_paused = true)]
    async fn an_idle_connection_ends_after_the_idle_limit_not_the_stall() {
        let clocks = Clocks::new(Some(STALL));
        let start = Instant::now();
        assert!(
            clocks.check(start + STALL).is_ok(),
            "idle: 1.25 × the stall limit"
        );
        assert_eq!(
            clocks.check(start + Duration::from_secs(75)),
            Err(Lapsed::Idle)
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_head_has_the_stall_limit_from_its_first_byte() {
        let clocks = Clocks::new(Some(STALL));
        tokio::time::advance(Duration::from_secs(59)).await;
        clocks.read(10); // a head begins just before the idle connection's old deadline
        let began = Instant::now();
        assert!(clocks.check(began + Duration::from_secs(59)).is_ok());
        assert_eq!(clocks.check(began + STALL), Err(Lapsed::Head));
        let handling = clocks.handling(true, None); // complete: handed to the service
        assert!(
            clocks.check(began + Duration::from_secs(600)).is_ok(),
            "a request runs"
        );
        drop(handling);
        let answered = Instant::now();
        assert!(clocks.check(answered + STALL).is_ok());
        assert_eq!(
            clocks.check(answered + Duration::from_secs(75)),
            Err(Lapsed::Idle)
        );
    }

    #[tokio::test(start_paused = true)]
    async fn an_answer_that_does_not_move_ends_its_connection() {
        let clocks = Clocks::new(Some(STALL));
        let handling = clocks.handling(true, None);
        clocks.wrote(&Poll::Pending);
        let blocked = Instant::now();
        assert!(clocks.check(blocked + Duration::from_secs(59)).is_ok());
        tokio::time::advance(Duration::from_secs(30)).await;
        clocks.wrote(&Poll::Ready(Ok(100))); // it moved: the clock starts again
        clocks.wrote(&Poll::Pending);
        assert!(clocks.check(blocked + Duration::from_secs(80)).is_ok());
        assert_eq!(
            clocks.check(blocked + Duration::from_secs(90)),
            Err(Lapsed::Answer)
        );
        drop(handling);
    }

    #[tokio::test(start_paused = true)]
    async fn a_close_lingers_only_with_something_of_a_request_unread() {
        let clocks = Clocks::new(Some(STALL));
        assert!(!clocks.lingers(), "idle: nothing unread");
        clocks.read(10); // a head in progress (hyper may refuse it: 400, 431)
        assert!(clocks.lingers());
        let handling = clocks.handling(false, Some(100));
        drop(handling); // answered with its body unread
        assert!(clocks.lingers());
        assert!(
            clocks.polled(),
            "the turn that answered: the next wanted at once"
        );
        assert!(clocks.lingers());
        assert!(
            !clocks.polled(),
            "the next, which dropped the body: the connection kept"
        );
        assert!(!clocks.lingers());
    }

    #[tokio::test(start_paused = true)]
    async fn no_clock_runs_without_a_stall_limit() {
        let clocks = Clocks::new(None);
        clocks.read(1);
        clocks.wrote(&Poll::Pending);
        assert_eq!(
            clocks.check(Instant::now() + Duration::from_secs(1 << 30)),
            Ok(None)
        );
    }
}

/// A real hyper HTTP/1.1 connection over WatchedStream, served by the same loop as rest.rs's
/// serve_connection (tests written by a review).
#[cfg(test)]
mod connection_tests {
    use super::*;
    use bytes::Bytes;
    use http_body_util::Full;
    use hyper::{Request, Response, StatusCode};
    use std::convert::Infallible;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    /// rest.rs's serve_connection, with a service that waits `delay` and answers 404 without
    /// reading the body (as the 404/400/status/metrics paths do). `going`: true = graceful.
    async fn serve(
        stream: TcpStream,
        clocks: Clocks,
        delay: Duration,
        mut going: tokio::sync::watch::Receiver<bool>,
    ) -> &'static str {
        let watched = clocks.clone();
        let service = hyper::service::service_fn(move |request: Request<hyper::body::Incoming>| {
            let (_, body) = request.into_parts();
            let (handling, body) = watched.watch(body);
            async move {
                let _handling = handling;
                tokio::time::sleep(delay).await;
                drop(body);
                let mut response = Response::new(Full::new(Bytes::from_static(b"nope")));
                *response.status_mut() = StatusCode::NOT_FOUND;
                Ok::<_, Infallible>(response)
            }
        });
        let mut builder = hyper::server::conn::http1::Builder::new();
        builder
            .timer(hyper_util::rt::TokioTimer::new())
            .header_read_timeout(None)
            .half_close(true);
        let io = hyper_util::rt::TokioIo::new(WatchedStream::new(stream, clocks.clone()));
        let connection = builder.serve_connection(io, service);
        tokio::pin!(connection);
        let mut going_away = false;
        loop {
            let look_again = match clocks.check(Instant::now()) {
                Ok(next) => next,
                Err(Lapsed::Idle) => return "idle",
                Err(Lapsed::Head) => return "head",
                Err(Lapsed::Answer) => return "answer",
            };
            tokio::select! {
                _ = std::future::poll_fn(|cx| turn(connection.as_mut(), &clocks, cx)) => return "closed",
                _ = going.changed() => if !going_away {
                    going_away = true;
                    connection.as_mut().graceful_shutdown();
                },
                _ = tokio::time::sleep_until(look_again.unwrap()) => {}
            }
        }
    }

    async fn read_answer(client: &mut TcpStream) -> String {
        let mut got = Vec::new();
        let mut buf = [0u8; 4096];
        while !got.ends_with(b"nope") {
            let n = client.read(&mut buf).await.unwrap();
            assert!(
                n > 0,
                "closed before the answer: {:?}",
                String::from_utf8_lossy(&got)
            );
            got.extend_from_slice(&buf[..n]);
        }
        String::from_utf8_lossy(&got).into_owned()
    }

    /// `serve` on the first connection to a fresh listener, with `clocks` and no delay: the
    /// client's end, the serving task (how it ended), and the drain's sender (true: graceful).
    async fn serving(
        clocks: Clocks,
    ) -> (
        TcpStream,
        tokio::task::JoinHandle<&'static str>,
        tokio::sync::watch::Sender<bool>,
    ) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let (drain, going) = tokio::sync::watch::channel(false);
        let server = tokio::spawn(async move {
            let (stream, _) = listener.accept().await.unwrap();
            serve(stream, clocks, Duration::ZERO, going).await
        });
        (TcpStream::connect(address).await.unwrap(), server, drain)
    }

    /// A graceful drain of a connection whose request was answered: how long its close took,
    /// and how it ended.
    async fn drained(
        server: tokio::task::JoinHandle<&'static str>,
        drain: tokio::sync::watch::Sender<bool>,
    ) -> (Duration, &'static str) {
        let began = Instant::now();
        drain.send(true).unwrap();
        let how = server.await.unwrap();
        (began.elapsed(), how)
    }

    /// A body hyper drains after the service answered (its reads come while `handling` is 0)
    /// starts no head clock on a connection kept alive: it started one, and the idle
    /// connection was ended as a stalled head after the stall limit, not the idle limit (a
    /// request sent between the two, a balancer's keep-alive of the stall limit, was dropped).
    #[tokio::test]
    async fn a_drained_body_starts_no_head_clock_on_an_idle_connection() {
        let stall = Duration::from_millis(800);
        let clocks = Clocks::new(Some(stall));
        let (mut client, server, _drain) = serving(clocks.clone()).await;
        // One write: head and a 12 000-byte body (a POST to a misspelled path: 404 or 400
        // before the body is read). hyper's first read takes 8 KiB; the rest is drained
        // after the answer, in one read, while `handling` is 0.
        let mut request =
            b"POST /nowhere HTTP/1.1\r\nHost: x\r\nContent-Length: 12000\r\n\r\n".to_vec();
        request.extend_from_slice(&[b'x'; 12000]);
        client.write_all(&request).await.unwrap();
        let answer = read_answer(&mut client).await;
        assert!(
            !answer.to_ascii_lowercase().contains("connection: close"),
            "kept alive: {answer}"
        );
        let answered = Instant::now();
        let head_since = clocks.lock().head_since;
        // Past the stall limit, within the idle limit (1.25 x): an idle connection serves on.
        tokio::time::sleep_until(answered + stall.mul_f64(1.1)).await;
        client
            .write_all(b"GET /again HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        let mut buf = [0u8; 4096];
        let n = client.read(&mut buf).await.unwrap_or(0);
        let ended = if n == 0 {
            Some(server.await.unwrap())
        } else {
            None
        };
        assert!(
            head_since.is_none() && n > 0,
            "an idle keep-alive connection had a head clock (head_since {head_since:?}) \
             and was ended as {ended:?} {:?} after its answer, under the idle limit {:?}",
            answered.elapsed(),
            stall.mul_f64(1.25)
        );
    }

    /// A body hyper had whole in its first read, dropped without a socket read after the
    /// answer: the next head's bytes start its clock (they were taken for the body's, and a
    /// head trickled a byte a minute held its connection for days; found by a review).
    #[tokio::test]
    async fn a_body_read_with_its_head_leaves_the_next_heads_clock_to_run() {
        let stall = Duration::from_millis(800);
        let (mut client, server, _drain) = serving(Clocks::new(Some(stall))).await;
        let mut request =
            b"POST /nowhere HTTP/1.1\r\nHost: x\r\nContent-Length: 4000\r\n\r\n".to_vec();
        request.extend_from_slice(&[b'x'; 4000]);
        client.write_all(&request).await.unwrap();
        read_answer(&mut client).await;
        // A head trickled: its first read may still be taken for the body's (one turn), the
        // next starts its clock.
        client.write_all(b"GET /again").await.unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        let began = Instant::now();
        client.write_all(b" HTTP/1.1\r\n").await.unwrap();
        let how = server.await.unwrap();
        assert_eq!(how, "head", "the head's clock ran");
        assert!(
            began.elapsed() < stall.mul_f64(1.2),
            "{:?}",
            began.elapsed()
        );
    }

    /// A small body hyper had whole, answered without being read (a 404): a graceful drain
    /// closes the connection at once. Nothing woke hyper's next turn, which drops the body,
    /// so the close still took it for unread and lingered (found by a review).
    #[tokio::test]
    async fn a_small_unread_body_does_not_make_a_drain_linger() {
        let clocks = Clocks::new(Some(Duration::from_secs(60)));
        let (mut client, server, drain) = serving(clocks).await;
        client
            .write_all(b"POST /nowhere HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n0123456789")
            .await
            .unwrap();
        read_answer(&mut client).await;
        tokio::time::sleep(Duration::from_millis(50)).await;
        let (took, how) = drained(server, drain).await;
        assert!(
            took < Duration::from_millis(500),
            "its close took {took:?} ({how})"
        );
        drop(client);
    }

    /// A graceful drain closes an idle keep-alive connection at once: nothing of a request is
    /// unread, so no lingering close (it waited LINGER_PAUSE for a pooled client that does not
    /// look at its idle socket, requests.Session or urllib3: every drain was 2 s longer).
    #[tokio::test]
    async fn a_graceful_drain_does_not_linger_on_idle_keep_alive_connections() {
        let clocks = Clocks::new(Some(Duration::from_secs(60)));
        let (mut client, server, drain) = serving(clocks).await;
        client
            .write_all(b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        read_answer(&mut client).await;
        // The client keeps its idle connection in its pool, unread.
        let (took, how) = drained(server, drain).await;
        assert!(
            took < Duration::from_millis(500),
            "an idle connection's graceful close took {took:?} ({how})"
        );
        drop(client);
    }
}
