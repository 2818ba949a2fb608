//! A request's body while the front door reads it: the bytes gathered so far held to the
//! request budget, and a client that stops sending in the middle of a request ended.
//!
//! Until a body is whole nothing else counts it: tonic gathers a gRPC message in one buffer
//! before decoding it (where `decode_budget` takes over), and REST gathers the whole body
//! before parsing it (where `rest::parse_within` takes over). Those buffers were outside the
//! budget, up to --max-message-bytes each, for as many streams as clients open. And a client
//! that sent part of a request, or a whole gRPC message without ending its stream, held what
//! it had sent (and the decoded share) for as long as it kept its connection open. Here:
//! - the bytes of the gRPC message being gathered reserve their share as they arrive, without
//!   waiting (RESOURCE_EXHAUSTED when the budget has not enough free, as decoding does); the
//!   share goes back once the message is whole, when tonic decodes it and its decoded cost,
//!   its bytes included, is held instead;
//! - a REST body's bytes so far do the same, but wait for room (first come, first served,
//!   until the request's deadline) as its parse does, the client held back by TCP meanwhile;
//!   a body waits holding nothing (what it held is given back first), so bodies waiting for
//!   room cannot wait for each other; the share goes to the reader when the body is whole;
//! - a body that sends nothing for `stall` while the front door waits for more of it is
//!   ended (nginx's client_body_timeout, 60 s there too). The clock runs only while the
//!   front door waits on the client, never while a request is served.
//!
//! Like `decode_budget`, a body (a gRPC message) under UNCOUNTED_BYTES is not counted: the
//! small calls every client makes are not refused because large ones fill the budget, and
//! the fast path takes no lock or timer (the timer is made the first time a body is waited on).

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use hyper::body::{Body, Frame, SizeHint};
use tokio::time::{Instant, Sleep};

use crate::decode_budget::UNCOUNTED_BYTES;
use crate::request_budget::{Held, RequestBudget};
use crate::status::{Code, ServingError};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// How a body's bytes become requests: what is counted, and when it is given back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Framing {
    /// gRPC's length-prefixed messages: each message's bytes, until it is whole.
    Grpc,
    /// One request, the whole body: every byte, until the reader takes the share
    /// (`take_held`); waiting for room until the deadline (None: for ever).
    Whole(Option<Instant>),
}

/// Why reading a body failed.
#[derive(Debug)]
pub enum ReadError {
    /// The connection's own error (reset, closed, malformed framing).
    Body(BoxError),
    /// The budget had no room for more of it: at once (gRPC: RESOURCE_EXHAUSTED), or by the
    /// request's deadline (REST: DEADLINE_EXCEEDED).
    Refused(ServingError),
    /// The client sent nothing for the stall limit.
    Stalled(ServingError),
}

impl ReadError {
    /// As tonic takes a body's error: its own for the connection's, a Status for ours (tonic
    /// answers the call with it).
    pub fn into_grpc(self) -> BoxError {
        match self {
            ReadError::Body(error) => error,
            ReadError::Refused(error) | ReadError::Stalled(error) => {
                Box::new(tonic::Status::from(error))
            }
        }
    }
}

impl std::fmt::Display for ReadError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ReadError::Body(error) => write!(f, "{error}"),
            ReadError::Refused(error) | ReadError::Stalled(error) => write!(f, "{}", error.message),
        }
    }
}

impl std::error::Error for ReadError {}

/// How the front door reads bodies: the budget their bytes are held to, and how long one may
/// send nothing while the front door waits for more (None: for ever).
#[derive(Clone)]
pub struct Reading {
    pub budget: std::sync::Arc<RequestBudget>,
    pub stall: Option<Duration>,
}

impl Reading {
    pub fn body<B>(&self, inner: B, framing: Framing) -> ReadingBody<B> {
        ReadingBody::new(inner, self.budget.clone(), framing, self.stall)
    }
}

/// `inner` read with its bytes held to `budget` and its stalls limited to `stall` (None: it
/// may wait for ever).
pub struct ReadingBody<B> {
    inner: B,
    budget: std::sync::Arc<RequestBudget>,
    framing: Framing,
    stall: Option<Duration>,
    /// The share of the bytes counted now (None while they are under UNCOUNTED_BYTES).
    held: Option<Held>,
    /// Bytes of the body so far (Whole), or of the message being gathered (Grpc).
    gathered: usize,
    /// Grpc: where the body is in its messages.
    messages: Messages,
    /// Bytes of the body read in all (the stall's message says how far it came).
    read: usize,
    timer: Option<Pin<Box<Sleep>>>,
    /// A frame came since the timer was last set: set it again before waiting on it.
    moved: bool,
    /// Whole: the wait for room to hold the body so far, and the frame that needs it.
    waiting: Option<(Reservation, Frame<Bytes>)>,
}

type Reservation = Pin<Box<dyn Future<Output = Result<Held, ServingError>> + Send>>;

/// Whether the share held covers the bytes counted.
enum Room {
    Enough,
    /// Short of this many bytes in all.
    Short(usize),
}

impl<B> ReadingBody<B> {
    pub fn new(
        inner: B,
        budget: std::sync::Arc<RequestBudget>,
        framing: Framing,
        stall: Option<Duration>,
    ) -> Self {
        Self {
            inner,
            budget,
            framing,
            stall,
            held: None,
            gathered: 0,
            messages: Messages::default(),
            read: 0,
            timer: None,
            moved: false,
            waiting: None,
        }
    }

    /// The share of what was read (Whole), for the reader to hold while it works on the body.
    pub fn take_held(&mut self) -> Option<Held> {
        self.gathered = 0;
        self.held.take()
    }

    /// Counts `data`, just read: whether the share held covers what is counted now.
    fn count(&mut self, data: &[u8]) -> Room {
        self.read = self.read.saturating_add(data.len());
        match self.framing {
            Framing::Whole(_) => self.gathered = self.gathered.saturating_add(data.len()),
            Framing::Grpc => {
                let (completed, gathering) = self.messages.advance(data);
                if completed {
                    // Whole messages are tonic's to decode now, their cost held by the
                    // decoder (decode_budget::admit counts their bytes too).
                    self.held = None;
                }
                self.gathered = gathering;
            }
        }
        if self.gathered < UNCOUNTED_BYTES {
            self.held = None;
            return Room::Enough;
        }
        let held_bytes = self
            .held
            .as_ref()
            .map_or(0, |held| held.num_permits() * crate::request_budget::UNIT);
        if self.gathered <= held_bytes {
            Room::Enough
        } else {
            Room::Short(self.gathered)
        }
    }

    /// `frame`, once the budget holds `total` bytes of the body for it: at once if it has
    /// them free; otherwise a gRPC message is refused and a REST body waits.
    fn make_room(
        &mut self,
        total: usize,
        frame: Frame<Bytes>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, ReadError>>> {
        let held_bytes = self
            .held
            .as_ref()
            .map_or(0, |held| held.num_permits() * crate::request_budget::UNIT);
        if let Some(more) = self.budget.try_reserve(total.saturating_sub(held_bytes)) {
            match &mut self.held {
                Some(held) => held.merge(more),
                None => self.held = Some(more),
            }
            return Poll::Ready(Some(Ok(frame)));
        }
        let Framing::Whole(deadline) = self.framing else {
            return Poll::Ready(Some(Err(ReadError::Refused(ServingError::new(
                Code::ResourceExhausted,
                format!(
                    "requests being read or served (or a REST body waiting) hold {} MiB of the \
                     front door's memory, and reading this one further ({} MiB so far) would \
                     pass the {} MiB allowed for all of them at once (4 times \
                     --max-message-bytes, at least 256); try again later",
                    self.budget.held_bytes() >> 20,
                    self.gathered.div_ceil(1 << 20),
                    self.budget.bytes() >> 20
                ),
            )))));
        };
        // Waits holding nothing: a body that held its share while waiting for more could
        // wait for room that other waiting bodies hold, and they for its.
        self.held = None;
        let budget = self.budget.clone();
        let reservation = Box::pin(async move { budget.reserve(total, deadline).await });
        self.waiting = Some((reservation, frame));
        self.poll_waiting(cx)
    }

    /// The frame that waits for room, once the budget has it.
    fn poll_waiting(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, ReadError>>> {
        let Some((reservation, _)) = &mut self.waiting else {
            return Poll::Pending;
        };
        let granted = std::task::ready!(reservation.as_mut().poll(cx));
        let frame = self.waiting.take().map(|(_, frame)| frame);
        Poll::Ready(match (granted, frame) {
            (Ok(held), Some(frame)) => {
                self.held = Some(held);
                Some(Ok(frame))
            }
            (Err(error), _) => Some(Err(ReadError::Refused(error))),
            (Ok(_), None) => None, // not reached: the frame waits beside its reservation
        })
    }

    /// Whether the client has sent nothing for the stall limit (and the error to end with);
    /// called when the body has nothing ready, so the timer wakes this task when it fires.
    fn poll_stalled(&mut self, cx: &mut Context<'_>) -> Option<ReadError> {
        let stall = self.stall?;
        let timer = match &mut self.timer {
            Some(timer) => {
                if self.moved {
                    timer.as_mut().reset(Instant::now() + stall);
                }
                timer
            }
            None => self.timer.insert(Box::pin(tokio::time::sleep(stall))),
        };
        self.moved = false;
        timer.as_mut().poll(cx).is_ready().then(|| {
            ReadError::Stalled(ServingError::new(
                Code::DeadlineExceeded,
                format!(
                    "the request stopped arriving: nothing came for {} s with {} bytes of it \
                     read (--request-read-timeout); the request was ended",
                    stall.as_secs_f64(),
                    self.read
                ),
            ))
        })
    }
}

impl<B> Body for ReadingBody<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = ReadError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, ReadError>>> {
        let this = self.get_mut();
        if this.waiting.is_some() {
            // Waiting for the budget, not for the client: no stall clock.
            return this.poll_waiting(cx);
        }
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                this.moved = true;
                let data = frame.data_ref().map_or(&[][..], |data| &data[..]);
                match this.count(data) {
                    Room::Enough => Poll::Ready(Some(Ok(frame))),
                    Room::Short(total) => this.make_room(total, frame, cx),
                }
            }
            Poll::Ready(Some(Err(error))) => Poll::Ready(Some(Err(ReadError::Body(error.into())))),
            Poll::Ready(None) => Poll::Ready(None),
            Poll::Pending => match this.poll_stalled(cx) {
                Some(error) => Poll::Ready(Some(Err(error))),
                None => Poll::Pending,
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// Where a gRPC body is in its messages: each is a 5-byte prefix (compressed flag, length as
/// a big-endian u32) and that many bytes.
#[derive(Debug, Default)]
struct Messages {
    prefix: [u8; 5],
    /// Bytes of the current message's prefix read (5: its payload is being read).
    prefix_read: usize,
    /// Payload bytes of the current message still to come.
    left: usize,
    /// Bytes of the current message read, prefix included.
    gathered: usize,
}

impl Messages {
    /// Follows `data` through the messages: whether it completed one (or more), and the
    /// bytes of the one being gathered after it.
    fn advance(&mut self, mut data: &[u8]) -> (bool, usize) {
        let mut completed = false;
        while !data.is_empty() {
            if self.prefix_read < self.prefix.len() {
                let take = (self.prefix.len() - self.prefix_read).min(data.len());
                self.prefix[self.prefix_read..self.prefix_read + take]
                    .copy_from_slice(&data[..take]);
                self.prefix_read += take;
                self.gathered += take;
                data = &data[take..];
                if self.prefix_read == self.prefix.len() {
                    let [_, a, b, c, d] = self.prefix;
                    self.left = u32::from_be_bytes([a, b, c, d]) as usize;
                }
            } else {
                let take = self.left.min(data.len());
                self.left -= take;
                self.gathered += take;
                data = &data[take..];
            }
            if self.prefix_read == self.prefix.len() && self.left == 0 {
                completed = true;
                *self = Messages::default();
            }
        }
        (completed, self.gathered)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use http_body_util::BodyExt;
    use tokio::sync::mpsc;

    use super::*;

    fn message(len: usize) -> Vec<u8> {
        let mut bytes = vec![0u8];
        bytes.extend_from_slice(&(len as u32).to_be_bytes());
        bytes.resize(5 + len, 7);
        bytes
    }

    #[test]
    fn messages_are_followed_across_and_within_chunks() {
        let mut messages = Messages::default();
        let two = [message(3), message(0), message(100)].concat();
        // Byte by byte: the prefix split too.
        let mut completed = 0;
        for (i, byte) in two.iter().enumerate() {
            let (done, gathering) = messages.advance(std::slice::from_ref(byte));
            completed += usize::from(done);
            if i == 7 {
                // The first message's 8 bytes, just completed.
                assert!(done);
                assert_eq!(gathering, 0);
            }
        }
        assert_eq!(completed, 3);
        assert_eq!(messages.gathered, 0);
        // All at once, ending inside a third message.
        let mut messages = Messages::default();
        let mut data = two.clone();
        data.extend_from_slice(&message(50)[..20]);
        assert_eq!(messages.advance(&data), (true, 20));
        assert_eq!(messages.left, 35);
    }

    /// A body whose frames the test sends.
    struct Chunked(mpsc::Receiver<Bytes>);

    impl Body for Chunked {
        type Data = Bytes;
        type Error = std::convert::Infallible;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
            self.0
                .poll_recv(cx)
                .map(|data| data.map(|data| Ok(Frame::data(data))))
        }
    }

    type Chunks = mpsc::Sender<Bytes>;

    fn body(
        budget: &Arc<RequestBudget>,
        framing: Framing,
        stall: Option<Duration>,
    ) -> (Chunks, ReadingBody<Chunked>) {
        let (send, receive) = mpsc::channel(16);
        let body = ReadingBody::new(Chunked(receive), budget.clone(), framing, stall);
        (send, body)
    }

    async fn send(chunks: &Chunks, bytes: &[u8]) {
        chunks.send(Bytes::copy_from_slice(bytes)).await.unwrap();
    }

    async fn next(body: &mut ReadingBody<Chunked>) -> Option<Result<Frame<Bytes>, ReadError>> {
        body.frame().await
    }

    #[tokio::test]
    async fn a_grpc_message_holds_its_bytes_until_it_is_whole() {
        let budget = Arc::new(RequestBudget::new(1 << 20));
        let (chunks, mut body) = body(&budget, Framing::Grpc, None);
        let big = message(300 << 10);
        send(&chunks, &big[..200 << 10]).await;
        assert!(next(&mut body).await.unwrap().is_ok());
        assert_eq!(budget.held_bytes(), 200 << 10);
        send(&chunks, &big[200 << 10..]).await;
        assert!(next(&mut body).await.unwrap().is_ok());
        assert_eq!(
            budget.held_bytes(),
            0,
            "a whole message is the decoder's to count"
        );
        // Small messages are never counted.
        send(&chunks, &message(1000)).await;
        assert!(next(&mut body).await.unwrap().is_ok());
        assert_eq!(budget.held_bytes(), 0);
        // What remains of the next message after a whole one is counted.
        let mut data = message(10);
        data.extend_from_slice(&message(500 << 10)[..100 << 10]);
        send(&chunks, &data).await;
        assert!(next(&mut body).await.unwrap().is_ok());
        assert_eq!(budget.held_bytes(), 100 << 10);
        drop(body);
        assert_eq!(
            budget.held_bytes(),
            0,
            "a body dropped gives its share back"
        );
    }

    #[tokio::test]
    async fn a_grpc_message_the_budget_has_no_room_for_is_refused() {
        let budget = Arc::new(RequestBudget::new(1 << 20));
        let other = budget.try_reserve(900 << 10).unwrap();
        let (chunks, mut body) = body(&budget, Framing::Grpc, None);
        let big = message(300 << 10);
        send(&chunks, &big[..100 << 10]).await;
        assert!(next(&mut body).await.unwrap().is_ok());
        send(&chunks, &big[100 << 10..200 << 10]).await;
        let Some(Err(ReadError::Refused(error))) = next(&mut body).await else {
            panic!("not refused");
        };
        assert_eq!(error.code, Code::ResourceExhausted);
        assert!(
            error.message.contains("try again later"),
            "{}",
            error.message
        );
        drop(other);
        drop(body);
        assert_eq!(budget.held_bytes(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_whole_body_waits_for_room_holding_nothing_until_its_deadline() {
        let budget = Arc::new(RequestBudget::new(1 << 20));
        let other = budget.try_reserve(900 << 10).unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        let (chunks, mut body) = body(&budget, Framing::Whole(Some(deadline)), None);
        send(&chunks, &[1; 100 << 10]).await;
        assert!(next(&mut body).await.unwrap().is_ok());
        assert_eq!(budget.held_bytes(), 1000 << 10);
        // 200 KiB do not fit beside the other's 900: it waits.
        send(&chunks, &[1; 100 << 10]).await;
        let waited = tokio::time::timeout(Duration::from_secs(10), next(&mut body)).await;
        assert!(waited.is_err(), "did not wait");
        drop(other);
        assert!(next(&mut body).await.unwrap().is_ok());
        assert_eq!(budget.held_bytes(), 200 << 10);
        // Past its deadline: DEADLINE_EXCEEDED.
        let other = budget.try_reserve(800 << 10).unwrap();
        send(&chunks, &[1; 100 << 10]).await;
        let Some(Err(ReadError::Refused(error))) = next(&mut body).await else {
            panic!("not ended");
        };
        assert_eq!(error.code, Code::DeadlineExceeded);
        assert_eq!(Instant::now(), deadline);
        drop((body, other));
        assert_eq!(budget.held_bytes(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn whole_bodies_waiting_for_room_do_not_wait_for_each_other() {
        let budget = Arc::new(RequestBudget::new(1 << 20));
        let (a_chunks, mut a) = body(&budget, Framing::Whole(None), None);
        let (b_chunks, mut b) = body(&budget, Framing::Whole(None), None);
        send(&a_chunks, &[1; 600 << 10]).await;
        assert!(next(&mut a).await.unwrap().is_ok());
        send(&b_chunks, &[1; 300 << 10]).await;
        assert!(next(&mut b).await.unwrap().is_ok());
        // A needs 800 KiB in all and B 400: each has room only with what the other holds.
        // Holding their shares while waiting, each would wait for the other for ever.
        send(&a_chunks, &[1; 200 << 10]).await;
        send(&b_chunks, &[1; 100 << 10]).await;
        let a_first = tokio::time::timeout(Duration::from_secs(10), next(&mut a)).await;
        assert!(a_first.is_err(), "A had room");
        let b_first = tokio::time::timeout(Duration::from_secs(10), next(&mut b)).await;
        assert!(b_first.is_err(), "B had room beside A");
        // First come, first served: A, then B once A is done.
        let a_then = tokio::time::timeout(Duration::from_secs(10), next(&mut a)).await;
        assert!(matches!(a_then, Ok(Some(Ok(_)))), "A waits for B");
        assert_eq!(a.take_held().map(|held| held.num_permits()), Some(800));
        drop(a);
        let b_then = tokio::time::timeout(Duration::from_secs(10), next(&mut b)).await;
        assert!(matches!(b_then, Ok(Some(Ok(_)))), "B waits");
        drop(b);
        assert_eq!(budget.held_bytes(), 0);
    }

    #[tokio::test]
    async fn a_whole_body_keeps_its_share_for_its_reader() {
        let budget = Arc::new(RequestBudget::new(1 << 20));
        let (chunks, mut body) = body(&budget, Framing::Whole(None), None);
        send(&chunks, &[1; 70 << 10]).await;
        assert!(next(&mut body).await.unwrap().is_ok());
        drop(chunks);
        assert!(next(&mut body).await.is_none());
        let held = body.take_held();
        drop(body);
        assert_eq!(budget.held_bytes(), 70 << 10);
        drop(held);
        assert_eq!(budget.held_bytes(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_body_that_stops_arriving_is_ended_after_the_stall_limit() {
        let budget = Arc::new(RequestBudget::new(1 << 20));
        let stall = Duration::from_secs(60);
        let (chunks, mut body) = body(&budget, Framing::Grpc, Some(stall));
        let big = message(300 << 10);
        send(&chunks, &big[..100 << 10]).await;
        assert!(next(&mut body).await.unwrap().is_ok());
        // Data every 50 s keeps it going: the limit is between arrivals, not for the whole.
        let started = Instant::now();
        for part in big[100 << 10..].chunks(100 << 10).take(1) {
            let chunks = chunks.clone();
            let part = part.to_vec();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_secs(50)).await;
                send(&chunks, &part).await;
            });
            assert!(next(&mut body).await.unwrap().is_ok());
        }
        assert_eq!(budget.held_bytes(), 200 << 10);
        let Some(Err(ReadError::Stalled(error))) = next(&mut body).await else {
            panic!("not ended");
        };
        assert_eq!(started.elapsed(), Duration::from_secs(110));
        assert_eq!(error.code, Code::DeadlineExceeded);
        assert!(error.message.contains("204800 bytes"), "{}", error.message);
        drop(body);
        assert_eq!(budget.held_bytes(), 0);
        drop(chunks);
    }
}
