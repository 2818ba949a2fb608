//! A gRPC answer on its way to its client: its bytes held to the request budget until they are
//! handed to the connection, and a connection whose answers stop moving ended.
//!
//! hyper hands an answer's body to h2 only while its stream has flow-control window (it polls
//! one frame ahead and keeps it), so a client that grants no window leaves every answer it
//! asked for in the front door: measured with an 8 MB answer and a client whose stream
//! windows were 0, one connection held 1.6 GB (hyper's 200 streams), and a client may open
//! many connections (up to `--max-connections`, connection_limit.rs). Here:
//! - an answer (`hold_answer`, called as a Predict returns) takes over its request's share of
//!   the budget, trimmed or topped up to the answer's size (its encoded bytes, or its decoded
//!   tensors' if more), and is refused with RESOURCE_EXHAUSTED when the budget has not the room
//!   (the worker's work is lost, as a request refused for its size loses its own; the client
//!   may ask again);
//! - its body hands the bytes over in copied pieces of `PIECE` and keeps the share until the
//!   answer's own buffer is gone (`AnswerBody`);
//! - a connection with an answer that has not moved for the stall limit
//!   (`--request-read-timeout`, the limit on a client that stops sending) is closed by its
//!   serving loop (`server.rs`), as nginx's send_timeout closes one: from inside a body hyper
//!   does not poll, nothing can be seen or done. The same loop sends HTTP/2 pings, so a client
//!   that stops reading its socket (and leaves answers in h2's send buffers) is closed too.
//!
//! Answers under UNCOUNTED_BYTES are not counted, as requests under it are not, and neither
//! are what h2 holds of a stream beyond its window once the body has handed it over (copies,
//! at most its send buffer per stream). REST answers are held by `rest.rs` the same way
//! (`hold_answer`, `HeldAnswer`), once their JSON is written; the connection's own clocks close
//! one whose client stops reading.

use std::cell::RefCell;
use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Buf, Bytes};
use hyper::body::{Body, Frame, SizeHint};
use tokio::time::Instant;

use crate::decode_budget::{self, UNCOUNTED_BYTES};
use crate::request_budget::{self, Held, RequestBudget};
use crate::status::{Code, ServingError};

/// The most of an answer handed to the connection at once.
pub const PIECE: usize = 64 << 10;

tokio::task_local! {
    /// The share the answer being returned holds (`hold_answer`), for `answering` to give to
    /// its body.
    static ANSWER: RefCell<Option<Held>>;
}

/// Holds `bytes` of the budget for the answer the request being served returns (its encoded
/// size): the request's own share (its decoded form, no longer needed) is taken over, trimmed
/// or topped up. RESOURCE_EXHAUSTED when the budget has not the room. Outside `answering`
/// nothing is held.
pub fn hold_answer(bytes: usize) -> Result<(), ServingError> {
    let carried = decode_budget::take_request_share();
    if bytes < UNCOUNTED_BYTES || ANSWER.try_with(|_| ()).is_err() {
        return Ok(());
    }
    let held = take_over(carried, bytes, decode_budget::budget())?;
    let _ = ANSWER.try_with(|answer| *answer.borrow_mut() = Some(held));
    Ok(())
}

/// `carried` made a share of `bytes`: trimmed, or topped up from `budget` without waiting.
pub(crate) fn take_over(
    carried: Option<Held>,
    bytes: usize,
    budget: &RequestBudget,
) -> Result<Held, ServingError> {
    if bytes > budget.bytes() {
        return Err(ServingError::new(
            Code::ResourceExhausted,
            format!(
                "this answer ({} MiB) is larger than the {} MiB the front door allows for \
                 requests and answers at once (4 times --max-message-bytes, at least 256); ask \
                 for fewer rows or outputs per request",
                bytes.div_ceil(1 << 20),
                budget.bytes() >> 20
            ),
        ));
    }
    request_budget::resize(carried, bytes, budget).ok_or_else(|| {
        ServingError::new(
            Code::ResourceExhausted,
            format!(
                "answers not yet taken by their clients and requests being served hold {} MiB \
                 of the front door's memory, and this answer ({} MiB) would pass the {} MiB \
                 allowed for all of them at once (4 times --max-message-bytes, at least 256); \
                 try again later",
                budget.held_bytes() >> 20,
                bytes.div_ceil(1 << 20),
                budget.bytes() >> 20
            ),
        )
    })
}

/// `call` (a gRPC call's future, inside `decode_budget::holding_request_memory`), its answer's
/// body holding what `hold_answer` held, watched by `answers`.
pub fn answering<F, E>(
    call: F,
    answers: Arc<ConnectionAnswers>,
) -> impl Future<Output = Result<http::Response<tonic::body::Body>, E>>
where
    F: Future<Output = Result<http::Response<tonic::body::Body>, E>>,
{
    ANSWER.scope(RefCell::new(None), async move {
        let result = call.await;
        let held = ANSWER.with(|answer| answer.borrow_mut().take());
        match (result, held) {
            (Ok(response), Some(held)) => {
                Ok(response
                    .map(|body| tonic::body::Body::new(AnswerBody::new(body, held, answers))))
            }
            (result, _) => result,
        }
    })
}

/// One connection's answers that still have bytes to hand over, and when each last moved.
#[derive(Default)]
pub struct ConnectionAnswers {
    waiting: Mutex<Waiting>,
}

#[derive(Default)]
struct Waiting {
    next: u64,
    moved: HashMap<u64, Instant>,
}

impl ConnectionAnswers {
    fn start(&self) -> u64 {
        let mut waiting = self.lock();
        let id = waiting.next;
        waiting.next += 1;
        waiting.moved.insert(id, Instant::now());
        id
    }

    fn moved(&self, id: u64) {
        if let Some(moved) = self.lock().moved.get_mut(&id) {
            *moved = Instant::now();
        }
    }

    fn done(&self, id: u64) {
        self.lock().moved.remove(&id);
    }

    /// Whether an answer has waited `limit` or longer since it last moved.
    pub fn stalled(&self, now: Instant, limit: Duration) -> bool {
        self.lock()
            .moved
            .values()
            .any(|moved| now.saturating_duration_since(*moved) >= limit)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Waiting> {
        // The map stays whole whatever a panicking holder did: entries are plain values.
        self.waiting
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// What a connection's serving loop needs to close it when its answers stop moving.
#[derive(Clone)]
pub struct AnswerWatch {
    pub answers: Arc<ConnectionAnswers>,
    /// None: answers may wait for ever.
    pub limit: Option<Duration>,
}

impl AnswerWatch {
    /// A new connection's: no answers yet, `limit` on how long one may wait without moving.
    pub fn new(limit: Option<Duration>) -> Self {
        AnswerWatch {
            answers: Arc::new(ConnectionAnswers::default()),
            limit,
        }
    }

    /// How often the serving loop looks: a stalled connection is closed within a quarter of
    /// the limit after it.
    pub fn period(&self) -> Option<Duration> {
        self.limit
            .map(|limit| (limit / 4).max(Duration::from_millis(10)))
    }
}

/// An answer's body: `inner`'s data handed over in pieces of at most `PIECE`, holding the
/// answer's share until none of the answer's own buffers is left here.
///
/// tonic gives a unary answer as one chunk and then its trailers. A piece cut from that chunk
/// (`split_to`) would keep the whole buffer alive for as long as h2 holds the piece, so the
/// pieces of a chunk larger than `PIECE` are copies; and `inner` is polled on for its
/// trailers as soon as the chunk comes, so that it can be dropped with its own view of the
/// buffer. Once the chunk is handed over and `inner` is gone, the share is given back: what
/// h2 still holds then is copies, at most its send buffer (`server.rs` sets it) per stream.
pub struct AnswerBody<B: Body<Data = Bytes>> {
    /// None once it has given everything (or failed).
    inner: Option<B>,
    /// Frames taken from `inner` ahead of their turn (its trailers, after the chunk).
    ahead: VecDeque<Result<Frame<Bytes>, B::Error>>,
    /// What is left of the chunk being handed over.
    rest: Option<Bytes>,
    held: Option<Held>,
    answers: Arc<ConnectionAnswers>,
    /// Its entry in `answers` until it has handed over its last frame.
    id: Option<u64>,
}

impl<B: Body<Data = Bytes>> AnswerBody<B> {
    pub fn new(inner: B, held: Held, answers: Arc<ConnectionAnswers>) -> Self {
        let id = Some(answers.start());
        AnswerBody {
            inner: Some(inner),
            ahead: VecDeque::new(),
            rest: None,
            held: Some(held),
            answers,
            id,
        }
    }

    /// The next piece of `rest` (a copy unless it is the whole of a small chunk).
    fn next_piece(&mut self) -> Option<Bytes> {
        let rest = self.rest.as_mut()?;
        let piece = if rest.len() > PIECE {
            let piece = Bytes::copy_from_slice(&rest[..PIECE]);
            rest.advance(PIECE);
            piece
        } else {
            let piece = Bytes::copy_from_slice(rest);
            self.rest = None;
            piece
        };
        if let Some(id) = self.id {
            self.answers.moved(id);
        }
        self.release_if_handed_over();
        Some(piece)
    }

    /// A data chunk to hand over: a small one as it is, a larger one in copied pieces.
    fn start_chunk(&mut self, chunk: Bytes) -> Bytes {
        if chunk.len() <= PIECE {
            if let Some(id) = self.id {
                self.answers.moved(id);
            }
            self.release_if_handed_over();
            return chunk;
        }
        self.rest = Some(chunk);
        self.next_piece().unwrap_or_default()
    }

    /// Takes what `inner` has ready after a chunk (its trailers), so that it can be dropped.
    fn read_ahead(&mut self, cx: &mut Context<'_>)
    where
        B: Unpin,
    {
        while let Some(inner) = self.inner.as_mut() {
            match Pin::new(inner).poll_frame(cx) {
                Poll::Ready(Some(frame)) => self.ahead.push_back(frame),
                Poll::Ready(None) => self.inner = None,
                Poll::Pending => return,
            }
        }
    }

    /// The share goes back once nothing of the answer's own buffers is here.
    fn release_if_handed_over(&mut self) {
        let data_ahead = self
            .ahead
            .iter()
            .any(|frame| frame.as_ref().is_ok_and(Frame::is_data));
        if self.inner.is_none() && self.rest.is_none() && !data_ahead {
            self.held = None;
        }
    }

    /// Everything is handed over (or the answer ended): nothing held, nothing waiting.
    fn finish(&mut self) {
        self.held = None;
        if let Some(id) = self.id.take() {
            self.answers.done(id);
        }
    }
}

impl<B: Body<Data = Bytes>> Drop for AnswerBody<B> {
    fn drop(&mut self) {
        self.finish();
    }
}

impl<B> Body for AnswerBody<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Unpin,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        let this = self.get_mut();
        if let Some(piece) = this.next_piece() {
            return Poll::Ready(Some(Ok(Frame::data(piece))));
        }
        let next = match this.ahead.pop_front() {
            Some(frame) => Poll::Ready(Some(frame)),
            None => match this.inner.as_mut() {
                Some(inner) => Pin::new(inner).poll_frame(cx),
                None => Poll::Ready(None),
            },
        };
        match next {
            Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                Ok(chunk) => {
                    this.read_ahead(cx);
                    Poll::Ready(Some(Ok(Frame::data(this.start_chunk(chunk)))))
                }
                Err(trailers) => {
                    this.finish();
                    Poll::Ready(Some(Ok(trailers)))
                }
            },
            Poll::Ready(Some(Err(error))) => {
                this.finish();
                Poll::Ready(Some(Err(error)))
            }
            Poll::Ready(None) => {
                this.inner = None;
                this.finish();
                Poll::Ready(None)
            }
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.rest.is_none()
            && self.ahead.is_empty()
            && self.inner.as_ref().is_none_or(Body::is_end_stream)
    }

    fn size_hint(&self) -> SizeHint {
        // Not known exactly once frames are read ahead; tonic's is not known either.
        SizeHint::default()
    }
}

#[cfg(test)]
mod tests {
    use http_body_util::BodyExt;

    use super::*;

    const KIB: usize = 1024;

    /// A tonic-like answer body: the message in one chunk, then the trailers.
    struct Answer(std::collections::VecDeque<Frame<Bytes>>);

    impl Body for Answer {
        type Data = Bytes;
        type Error = std::convert::Infallible;

        fn poll_frame(
            self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
            Poll::Ready(self.get_mut().0.pop_front().map(Ok))
        }
    }

    fn answer(len: usize) -> Answer {
        answer_of(Bytes::from(vec![7u8; len]))
    }

    fn answer_of(data: Bytes) -> Answer {
        let mut trailers = http::HeaderMap::new();
        trailers.insert("grpc-status", http::HeaderValue::from_static("0"));
        Answer([Frame::data(data), Frame::trailers(trailers)].into())
    }

    #[tokio::test]
    async fn an_answer_is_handed_over_in_copied_pieces_and_its_share_kept_until_the_last() {
        let budget = RequestBudget::new(1024 * KIB);
        let answers = Arc::new(ConnectionAnswers::default());
        let len = 3 * PIECE + 100;
        let original = Bytes::from(vec![7u8; len]);
        let held = budget.try_reserve(len).unwrap();
        let mut body = AnswerBody::new(answer_of(original.clone()), held, answers.clone());
        let mut pieces = Vec::new();
        let mut counted = Vec::new();
        while let Some(frame) = body.frame().await {
            let frame = frame.unwrap();
            if frame.is_data() {
                pieces.push(frame.into_data().unwrap());
            } else {
                assert!(frame.is_trailers());
            }
            counted.push(budget.held_bytes());
        }
        let sizes: Vec<usize> = pieces.iter().map(Bytes::len).collect();
        assert_eq!(sizes, [PIECE, PIECE, PIECE, 100]);
        assert_eq!(pieces.concat(), original);
        // The whole answer counts until its last piece is handed over (its buffer lives until
        // then), then nothing: what h2 holds is copies, not the answer's buffer.
        let whole = 3 * PIECE + KIB;
        assert_eq!(counted, [whole, whole, whole, 0, 0], "{counted:?}");
        assert!(
            !answers.stalled(Instant::now(), Duration::ZERO),
            "still waiting"
        );
        drop(body);
        assert!(
            original.is_unique(),
            "a piece handed over keeps the answer's buffer"
        );
    }

    #[tokio::test]
    async fn a_small_answer_is_handed_over_whole() {
        let budget = RequestBudget::new(1024 * KIB);
        let answers = Arc::new(ConnectionAnswers::default());
        let held = budget.try_reserve(PIECE).unwrap();
        let mut body = AnswerBody::new(answer(PIECE), held, answers.clone());
        let data = body.frame().await.unwrap().unwrap().into_data().unwrap();
        assert_eq!(data.len(), PIECE);
        assert_eq!(
            budget.held_bytes(),
            0,
            "handed over, its body done: nothing held"
        );
        assert!(body.frame().await.unwrap().unwrap().is_trailers());
        assert!(body.frame().await.is_none());
    }

    #[tokio::test]
    async fn a_dropped_answer_gives_its_share_back_and_stops_waiting() {
        let budget = RequestBudget::new(1024 * KIB);
        let answers = Arc::new(ConnectionAnswers::default());
        let held = budget.try_reserve(2 * PIECE).unwrap();
        let mut body = AnswerBody::new(answer(2 * PIECE), held, answers.clone());
        let first = body.frame().await.unwrap().unwrap();
        assert_eq!(first.data_ref().map(Bytes::len), Some(PIECE));
        assert_eq!(
            budget.held_bytes(),
            2 * PIECE,
            "the answer's buffer is still here"
        );
        assert!(answers.stalled(Instant::now(), Duration::ZERO));
        drop(body); // the client reset the stream, or the connection closed
        assert_eq!(budget.held_bytes(), 0);
        assert!(!answers.stalled(Instant::now(), Duration::ZERO));
    }

    #[tokio::test(start_paused = true)]
    async fn a_connection_is_stalled_when_one_answer_has_not_moved_for_the_limit() {
        let budget = RequestBudget::new(1024 * KIB);
        let answers = Arc::new(ConnectionAnswers::default());
        let limit = Duration::from_secs(3);
        let mut moving = AnswerBody::new(
            answer(8 * PIECE),
            budget.try_reserve(8 * PIECE).unwrap(),
            answers.clone(),
        );
        let _stuck = AnswerBody::new(
            answer(PIECE),
            budget.try_reserve(PIECE).unwrap(),
            answers.clone(),
        );
        for _ in 0..4 {
            tokio::time::advance(Duration::from_secs(1)).await;
            moving.frame().await.unwrap().unwrap();
        }
        // One answer moved every second; the other has not, for 4 s.
        let now = Instant::now();
        assert!(answers.stalled(now, limit));
        assert!(!answers.stalled(now, Duration::from_secs(5)));
    }

    #[test]
    fn an_answer_takes_over_its_requests_share_trimmed_or_topped_up() {
        let budget = RequestBudget::new(1024 * KIB);
        let request = budget.try_reserve(300 * KIB).unwrap();
        let answer = take_over(Some(request), 100 * KIB, &budget).unwrap();
        assert_eq!(budget.held_bytes(), 100 * KIB);
        drop(answer);
        let request = budget.try_reserve(300 * KIB).unwrap();
        let answer = take_over(Some(request), 900 * KIB, &budget).unwrap();
        assert_eq!(budget.held_bytes(), 900 * KIB);
        // Larger than the whole budget: refused for good, not "later".
        let error = take_over(None, 2048 * KIB, &budget).unwrap_err();
        assert_eq!(error.code, Code::ResourceExhausted);
        assert!(error.message.contains("fewer rows"), "{}", error.message);
        // No room for another: refused, with what holds the memory.
        let error = take_over(None, 200 * KIB, &budget).unwrap_err();
        assert_eq!(error.code, Code::ResourceExhausted);
        assert!(
            error.message.contains("answers not yet taken"),
            "{}",
            error.message
        );
        assert!(
            error.message.contains("try again later"),
            "{}",
            error.message
        );
        drop(answer);
        assert_eq!(budget.held_bytes(), 0);
    }
}
