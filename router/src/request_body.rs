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
//!   waiting (RESOURCE_EXHAUSTED when the budget has not enough free, as decoding does); once
//!   the message is whole the share is handed to its decoding, whose cost counts its bytes
//!   too (`decode_budget::hand_over_gathered`; a compressed message's decompressed bytes,
//!   so that while it is decoded its compressed ones are not counted, as before);
//! - a REST body counts its bytes as they arrive too, its length or none, and waits for room
//!   when the budget has none (first come, first served, until the REST timeout: then
//!   DEADLINE_EXCEEDED, 504), its client held back by TCP meanwhile; the share goes to the
//!   reader when the body is whole. A length is not reserved before the bytes come: four
//!   connections that each declared 512 MiB and sent nothing held a 2 GiB budget for as
//!   long as they trickled a byte now and then, and every REST request and every gRPC
//!   message over 64 KiB waited or was refused meanwhile (found by a REST hunt). TF
//!   Serving, with no budget, holds only what came too. (Bodies that wait holding what they
//!   read could wait for one another only if such bodies filled the budget between them:
//!   four or more near --max-message-bytes at once; each then ends at its REST timeout.)
//! - a body that sends nothing for `stall` while the front door waits for more of it is
//!   ended (nginx's client_body_timeout, 60 s there too). The clock runs only while the
//!   front door waits on the client, never while a request is served.
//!
//! Like `decode_budget`, a body (a gRPC message) under UNCOUNTED_BYTES is not counted: the
//! small calls every client makes are not refused because large ones fill the budget, and
//! the fast path takes no lock or timer (the timer is made the first time a body is waited on).
//! Only while small bodies being gathered hold 32 MiB or less in all (RequestBudget::gather_small): past it
//! they count as any. Unfinished small messages, 200 streams a connection, each a byte short
//! and kept alive by a byte now and then, held 737 MiB with nothing counted (found by a hunt).

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
    /// (`take_held`).
    Whole,
}

/// Why reading a body failed.
#[derive(Debug)]
pub enum ReadError {
    /// The connection's own error (reset, closed, malformed framing).
    Body(BoxError),
    /// The budget had no room for more of it (RESOURCE_EXHAUSTED).
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

/// A wait for the budget's room for the frame that did not fit.
type RoomWait = Pin<Box<dyn Future<Output = Result<Held, ServingError>> + Send>>;

impl Reading {
    /// `inner` read as `framing` says: refused when the budget has no room (gRPC: its
    /// decoding cannot wait either).
    pub fn body<B>(&self, inner: B, framing: Framing) -> ReadingBody<B> {
        ReadingBody {
            inner,
            reading: self.clone(),
            framing,
            room_by: None,
            waiting: None,
            held: None,
            gathered: 0,
            messages: Messages::default(),
            read: 0,
            timer: None,
            deadline_at: None,
            deadline: None,
            small: 0,
            moved: false,
        }
    }
}

/// `inner` read with its bytes held to the budget and its stalls limited (`Reading`).
pub struct ReadingBody<B> {
    inner: B,
    reading: Reading,
    framing: Framing,
    /// Waits for room until then (None: refused at once when there is none).
    room_by: Option<Option<Instant>>,
    /// The room being waited for, and the frame it is for.
    waiting: Option<(RoomWait, Frame<Bytes>)>,
    /// The share of the bytes counted now (None while they are under UNCOUNTED_BYTES).
    held: Option<Held>,
    /// Bytes of the body so far (Whole), or of the message being gathered (Grpc).
    gathered: usize,
    /// Grpc: where the body is in its messages.
    messages: Messages,
    /// Bytes of the body read in all (the stall's message says how far it came).
    read: usize,
    timer: Option<Pin<Box<Sleep>>>,
    /// Its share of the small bodies being gathered uncounted (RequestBudget::gather_small).
    small: usize,
    /// The call's deadline (gRPC's grpc-timeout, from the call's start): a body still
    /// arriving then ends the call with DEADLINE_EXCEEDED. Its timer is made the first time
    /// the body is waited on (most bodies come whole in one poll).
    deadline_at: Option<Instant>,
    deadline: Option<Pin<Box<Sleep>>>,
    /// Data came since the timer was last set: set it again before waiting on it.
    moved: bool,
}

/// Whether the share held covers the bytes counted.
enum Room {
    Enough,
    /// Short of this many bytes.
    Short(usize),
}

impl<B> ReadingBody<B> {
    /// Waits for room when the budget has none, first come first served, until `deadline`
    /// (None: for as long as it takes) instead of being refused (REST).
    /// Ends the body with DEADLINE_EXCEEDED if it is still arriving at `deadline` (a gRPC
    /// call's: it ran from when the body was whole, and a call whose client kept its stream
    /// open past its deadline was answered long after; found by a hunt).
    pub fn until(mut self, deadline: Option<Instant>) -> Self {
        self.deadline_at = deadline;
        self
    }

    pub fn waiting_for_room(mut self, deadline: Option<Instant>) -> Self {
        self.room_by = Some(deadline);
        self
    }

    /// The share of what was read (Whole), for the reader to hold while it works on the body.
    pub fn take_held(&mut self) -> Option<Held> {
        self.held.take()
    }

    /// Counts `data`, just read: whether the share held covers what is counted now.
    fn count(&mut self, data: &[u8]) -> Room {
        self.read = self.read.saturating_add(data.len());
        match self.framing {
            Framing::Whole => self.gathered = self.gathered.saturating_add(data.len()),
            Framing::Grpc => {
                let (completed, gathering) = self.messages.advance(data);
                if completed {
                    // A whole message is tonic's to decode now, in this same poll.
                    if let Some(held) = self.held.take() {
                        crate::decode_budget::hand_over_gathered(held);
                    }
                }
                self.gathered = gathering;
            }
        }
        let held_bytes = crate::request_budget::share_bytes(self.held.as_ref());
        if self.gathered < UNCOUNTED_BYTES && self.gather_uncounted() {
            return Room::Enough;
        }
        self.release_small();
        if self.gathered <= held_bytes {
            Room::Enough
        } else {
            Room::Short(self.gathered - held_bytes)
        }
    }

    /// The small message being gathered left uncounted, if small bodies in all stay within
    /// their bound.
    fn gather_uncounted(&mut self) -> bool {
        if self.gathered <= self.small {
            if self.gathered < self.small {
                self.reading
                    .budget
                    .release_small(self.small - self.gathered);
                self.small = self.gathered;
            }
            return true;
        }
        if self.reading.budget.gather_small(self.gathered - self.small) {
            self.small = self.gathered;
            return true;
        }
        false
    }

    /// Its share of the small bodies' given back (its message counts now, or it ended).
    fn release_small(&mut self) {
        let small = std::mem::take(&mut self.small);
        if small > 0 {
            self.reading.budget.release_small(small);
        }
    }

    /// `frame`, with the budget holding `short` more bytes of the body for it; refused when it
    /// has not the room free at once, unless the body waits for room (None: waiting now).
    fn make_room(
        &mut self,
        short: usize,
        frame: Frame<Bytes>,
        cx: &mut Context<'_>,
    ) -> Option<Result<Frame<Bytes>, ReadError>> {
        let budget = &self.reading.budget;
        if let Some(more) = budget.try_reserve(short) {
            self.hold(more);
            return Some(Ok(frame));
        }
        let Some(deadline) = self.room_by else {
            return Some(Err(ReadError::Refused(
                budget.no_room("reading this one", self.gathered),
            )));
        };
        let budget = budget.clone();
        let wait: RoomWait = Box::pin(async move { budget.reserve(short, deadline).await });
        self.waiting = Some((wait, frame));
        self.poll_room(cx)
    }

    /// The room waited for: the frame it was for once it is had (None: still waiting).
    fn poll_room(&mut self, cx: &mut Context<'_>) -> Option<Result<Frame<Bytes>, ReadError>> {
        let (wait, _) = self.waiting.as_mut()?;
        let granted = match wait.as_mut().poll(cx) {
            Poll::Pending => return None,
            Poll::Ready(granted) => granted,
        };
        let (_, frame) = self.waiting.take()?;
        Some(match granted {
            Ok(more) => {
                self.hold(more);
                Ok(frame)
            }
            Err(error) => Err(ReadError::Refused(error)),
        })
    }

    fn hold(&mut self, more: Held) {
        match &mut self.held {
            Some(held) => held.merge(more),
            None => self.held = Some(more),
        }
    }

    /// Whether the client has sent nothing for the stall limit (and the error to end with);
    /// called when the body has nothing ready, so the timer wakes this task when it fires.
    fn poll_stalled(&mut self, cx: &mut Context<'_>) -> Option<ReadError> {
        let stall = self.reading.stall?;
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

impl<B> Drop for ReadingBody<B> {
    fn drop(&mut self) {
        self.release_small();
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
            // Not read further while it waits: its client is held back by TCP meanwhile.
            return this
                .poll_room(cx)
                .map_or(Poll::Pending, |result| Poll::Ready(Some(result)));
        }
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                let data = frame.data_ref().map_or(&[][..], |data| &data[..]);
                // An empty DATA frame is no progress: it does not put the stall clock back.
                this.moved |= !data.is_empty() || !frame.is_data();
                match this.count(data) {
                    Room::Enough => Poll::Ready(Some(Ok(frame))),
                    Room::Short(short) => this
                        .make_room(short, frame, cx)
                        .map_or(Poll::Pending, |result| Poll::Ready(Some(result))),
                }
            }
            Poll::Ready(Some(Err(error))) => Poll::Ready(Some(Err(ReadError::Body(error.into())))),
            Poll::Ready(None) => Poll::Ready(None),
            Poll::Pending => {
                let past_deadline = this.deadline_at.is_some_and(|at| {
                    let timer = this
                        .deadline
                        .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(at)));
                    timer.as_mut().poll(cx).is_ready()
                });
                if past_deadline {
                    return Poll::Ready(Some(Err(ReadError::Stalled(ServingError::new(
                        Code::DeadlineExceeded,
                        "Deadline Exceeded",
                    )))));
                }
                match this.poll_stalled(cx) {
                    Some(error) => Poll::Ready(Some(Err(error))),
                    None => Poll::Pending,
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        // A frame held back for room is still to come.
        self.waiting.is_none() && self.inner.is_end_stream()
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
        let reading = Reading {
            budget: budget.clone(),
            stall,
        };
        (send, reading.body(Chunked(receive), framing))
    }

    async fn send(chunks: &Chunks, bytes: &[u8]) {
        chunks.send(Bytes::copy_from_slice(bytes)).await.unwrap();
    }

    async fn next(body: &mut ReadingBody<Chunked>) -> Option<Result<Frame<Bytes>, ReadError>> {
        body.frame().await
    }

    #[tokio::test]
    async fn small_messages_being_gathered_count_once_they_hold_their_bound() {
        let budget = Arc::new(RequestBudget::new(1 << 20).with_small_most(100 << 10));
        let (first_chunks, mut first) = body(&budget, Framing::Grpc, None);
        let (second_chunks, mut second) = body(&budget, Framing::Grpc, None);
        let small = message(60 << 10);
        // Each a small message short of its end: the first is left uncounted...
        send(&first_chunks, &small[..small.len() - 1]).await;
        assert!(next(&mut first).await.unwrap().is_ok());
        assert_eq!(budget.held_bytes(), 0);
        assert_eq!(budget.small_gathering(), small.len() - 1);
        // ...the second would pass the bound: it counts, as a large one does.
        send(&second_chunks, &small[..small.len() - 1]).await;
        assert!(next(&mut second).await.unwrap().is_ok());
        let counted = budget.held_bytes(); // (in whole KiB)
        assert!(
            (small.len() - 1..small.len() + 1024).contains(&counted),
            "{counted}"
        );
        assert_eq!(budget.small_gathering(), small.len() - 1);
        // The first whole: its share goes back; a body dropped gives back its own.
        send(&first_chunks, &small[small.len() - 1..]).await;
        assert!(next(&mut first).await.unwrap().is_ok());
        assert_eq!(budget.small_gathering(), 0);
        send(&first_chunks, &small[..1000]).await;
        assert!(next(&mut first).await.unwrap().is_ok());
        assert_eq!(budget.small_gathering(), 1000);
        drop(first);
        assert_eq!(budget.small_gathering(), 0);
        drop(second);
        assert_eq!(budget.held_bytes(), 0);
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
    async fn a_whole_messages_share_is_handed_to_its_decoding() {
        let budget = Arc::new(RequestBudget::new(1 << 20));
        let seen = budget.clone();
        crate::decode_budget::holding_request_memory(async move {
            let (chunks, mut body) = body(&seen, Framing::Grpc, None);
            let big = message(300 << 10);
            send(&chunks, &big[..200 << 10]).await;
            assert!(next(&mut body).await.unwrap().is_ok());
            send(&chunks, &big[200 << 10..]).await;
            assert!(next(&mut body).await.unwrap().is_ok());
            // Not given back for another request to take before the decoder tops it up.
            assert_eq!(seen.held_bytes(), 200 << 10);
        })
        .await;
        assert_eq!(budget.held_bytes(), 0, "given back with the call");
    }

    #[tokio::test]
    async fn a_whole_body_holds_what_came_and_is_refused_past_the_room() {
        let budget = Arc::new(RequestBudget::new(1 << 20));
        let reading = Reading {
            budget: budget.clone(),
            stall: None,
        };
        let others = budget.try_reserve(824 << 10).unwrap();
        let (chunks, receive) = mpsc::channel(16);
        let mut body = reading.body(Chunked(receive), Framing::Whole);
        assert_eq!(
            budget.held_bytes(),
            824 << 10,
            "nothing held before its bytes come"
        );
        send(&chunks, &[1; 200 << 10]).await;
        assert!(next(&mut body).await.unwrap().is_ok(), "within the room");
        assert_eq!(budget.held_bytes(), 1 << 20);
        send(&chunks, &[1; 1024]).await;
        let Some(Err(ReadError::Refused(_))) = next(&mut body).await else {
            panic!("read past its room");
        };
        drop((body, others));
        assert_eq!(budget.held_bytes(), 0);
    }

    #[tokio::test]
    async fn a_rest_body_waits_for_room_holding_what_came_until_its_deadline() {
        let budget = Arc::new(RequestBudget::new(1 << 20));
        let reading = Reading {
            budget: budget.clone(),
            stall: None,
        };
        let others = budget.try_reserve(900 << 10).unwrap();
        let (chunks, receive) = mpsc::channel(16);
        let mut body = reading
            .body(Chunked(receive), Framing::Whole)
            .waiting_for_room(None);
        send(&chunks, &[1; 100 << 10]).await;
        assert!(next(&mut body).await.unwrap().is_ok(), "within the room");
        send(&chunks, &[1; 100 << 10]).await;
        let waiting = tokio::time::timeout(Duration::from_millis(50), next(&mut body)).await;
        assert!(waiting.is_err(), "it waits for room, not refused");
        // Holding what came, and what is free goes to it as it waits (tokio's fair
        // semaphore hands permits to the first waiter as they come back).
        assert_eq!(budget.held_bytes(), 1 << 20);
        drop(others);
        assert!(
            next(&mut body).await.unwrap().is_ok(),
            "read once there is room"
        );
        assert_eq!(budget.held_bytes(), 200 << 10);

        // Until its deadline: then DEADLINE_EXCEEDED, what it held given back.
        let others = budget.try_reserve(824 << 10).unwrap();
        let (chunks, receive) = mpsc::channel(16);
        let deadline = Instant::now() + Duration::from_millis(50);
        let mut late = reading
            .body(Chunked(receive), Framing::Whole)
            .waiting_for_room(Some(deadline));
        send(&chunks, &[1; 100 << 10]).await;
        let Some(Err(ReadError::Refused(error))) = next(&mut late).await else {
            panic!("not ended at its deadline");
        };
        assert_eq!(error.code, Code::DeadlineExceeded);
        drop((late, body, others));
        assert_eq!(budget.held_bytes(), 0);
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

    #[tokio::test]
    async fn a_whole_body_keeps_its_share_for_its_reader() {
        let budget = Arc::new(RequestBudget::new(1 << 20));
        let (chunks, mut body) = body(&budget, Framing::Whole, None);
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
