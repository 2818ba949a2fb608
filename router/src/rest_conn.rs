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

#[derive(Debug)]
struct State {
    /// Requests handed to the service and not yet answered.
    handling: usize,
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
    /// the connection is not idle.
    pub fn handling(&self) -> Handling {
        let mut state = self.lock();
        state.handling += 1;
        state.head_since = None;
        Handling(self.clone())
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
        if state.handling == 0 && state.head_since.is_none() {
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

/// A request in the service: the connection is not idle meanwhile.
pub struct Handling(Clocks);

impl Drop for Handling {
    fn drop(&mut self) {
        let mut state = self.0.lock();
        state.handling = state.handling.saturating_sub(1);
        state.last_moved = Instant::now();
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

use std::future::Future as _;

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
        let handling = clocks.handling(); // complete: handed to the service
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
        let handling = clocks.handling();
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
