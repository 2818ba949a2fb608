//! What ends a gRPC client connection by time, and how its HTTP/2 is kept: gRPC servers'
//! channel arguments (TF Serving's `--grpc_channel_arguments`) that the front door honours.
//!
//! - **Age** (`grpc.max_connection_age_ms`, `..._grace_ms`): at its age a connection is told
//!   GOAWAY, so clients balancing over several pods re-resolve; its calls under way get the
//!   grace to end (the age again unless set), then it is closed.
//! - **Idleness** (`grpc.max_connection_idle_ms`): a connection with no call under way for
//!   that long is told GOAWAY, and closes once its client has acknowledged it (h2 waits for
//!   the answer to its shutdown PING), or when the limit has passed again with no call under
//!   way, whichever comes first. Its place under `--max-connections` comes back; a gRPC client
//!   whose channel was idle reconnects on its next call. A call is under way from its headers
//!   until hyper drops its answer's body, once the last of it is handed over (a health Watch
//!   for as long as it streams), as gRPC counts streams.
//! - **Keepalive** (`grpc.keepalive_time_ms`, `grpc.keepalive_timeout_ms`): an HTTP/2 PING on
//!   a connection its client has sent nothing on for that long, the connection closed when
//!   the client does not answer in time.
//! - **Streams** (`grpc.max_concurrent_streams`): calls at once on one connection.

use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use hyper::body::{Body, Frame, SizeHint};

use tokio::time::Instant;

/// The rules every gRPC connection is served under (one set per front door).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Lifespan {
    /// None: connections live as long as their clients keep them.
    pub max_age: Option<Duration>,
    /// How long calls under way get after the age's GOAWAY; None: the age again.
    pub age_grace: Option<Duration>,
    /// None: an idle connection stays.
    pub max_idle: Option<Duration>,
    /// A PING on a connection silent this long (None: only those the read timeout asks for).
    pub keepalive_time: Option<Duration>,
    /// How long a ping may go unanswered (None: gRPC's 20 s when `keepalive_time` is set).
    pub keepalive_timeout: Option<Duration>,
    /// Calls at once on one connection; None: hyper's 200.
    pub max_concurrent_streams: Option<u32>,
}

/// gRPC's default for `grpc.keepalive_timeout_ms`.
const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(20);

impl Lifespan {
    /// The HTTP/2 pings a connection gets, as (interval, timeout), whichever of this
    /// lifespan's keepalive and `reader_check` (a ping at the read timeout closes a connection
    /// whose client stopped reading its socket, answer_body) pings sooner; None: no pings.
    /// gRPC's 20 s default timeout applies only where the keepalive's pings are the ones sent;
    /// a timeout given on its own shortens the reader check's.
    pub fn pings(&self, reader_check: Option<Duration>) -> Option<(Duration, Duration)> {
        let keepalive = self
            .keepalive_time
            .map(|time| (time, self.keepalive_timeout.unwrap_or(KEEPALIVE_TIMEOUT)));
        match (keepalive, reader_check) {
            (None, None) => None,
            (Some(keepalive), None) => Some(keepalive),
            (Some((time, timeout)), Some(limit)) if time < limit => {
                Some((time, timeout.min(limit)))
            }
            (_, Some(limit)) => Some((
                limit,
                self.keepalive_timeout
                    .map_or(limit, |timeout| timeout.min(limit)),
            )),
        }
    }
}

/// How a gRPC connection's serving ended (what the connection counts keep).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ended {
    /// Its client closed it, or it closed after a GOAWAY for its age or a drain.
    Closed,
    /// It closed after a GOAWAY for idleness.
    Idle,
    /// The front door cut it: calls past the age's or the drain's grace, answers stalled.
    Cut,
}

/// What a connection does when it is looked at for idleness.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IdleStep {
    Stay,
    /// Idle for the limit: tell its client GOAWAY.
    GoAway,
    /// Told GOAWAY the limit ago and still open with no call under way (its client did not
    /// acknowledge it): close.
    Close,
}

/// What a connection does when its age timer fires: first GOAWAY, then (its grace later)
/// close whatever is still running.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AgeStep {
    GoAway,
    Close,
}

/// A connection's max-connection-age clock (no age: it may live forever).
pub struct Age {
    max_age: Option<Duration>,
    grace: Option<Duration>,
    fired: u8,
}

impl Age {
    pub fn new(lifespan: &Lifespan) -> Age {
        Age {
            max_age: lifespan.max_age,
            grace: lifespan.age_grace.or(lifespan.max_age),
            fired: 0,
        }
    }

    /// When the timer should next fire, from `now`: the age, then the grace after GOAWAY;
    /// far away when there is no age limit.
    pub fn next_deadline(&self, now: Instant) -> Instant {
        const FOREVER: Duration = Duration::from_secs(100 * 365 * 86_400);
        let wait = if self.fired == 0 {
            self.max_age
        } else {
            self.grace
        };
        // Checked: a reading plus any Duration may overflow (the pool bounds its settings).
        let wait = wait.unwrap_or(FOREVER);
        now.checked_add(wait).unwrap_or(now + FOREVER)
    }

    pub fn expired(&mut self) -> AgeStep {
        self.fired = self.fired.saturating_add(1);
        if self.fired == 1 {
            AgeStep::GoAway
        } else {
            AgeStep::Close
        }
    }
}

/// One connection's calls: how many began and how many ended (two counters rather than one
/// in-flight count, so that a look between two calls can tell "none since" from "one came and
/// went").
#[derive(Default)]
pub struct Calls {
    began: AtomicU64,
    ended: AtomicU64,
}

/// A call under way on its connection, counted as ended when dropped (answered or cancelled).
pub struct CallUnderWay(Arc<Calls>);

/// An answer's body holding its call under way until hyper drops it: when the last of it is
/// handed to the connection, or its stream is reset.
pub struct Answering<B> {
    body: B,
    _call: CallUnderWay,
}

impl<B> Answering<B> {
    pub fn new(body: B, call: CallUnderWay) -> Self {
        Answering { body, _call: call }
    }
}

impl<B: Body + Unpin> Body for Answering<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

impl Drop for CallUnderWay {
    fn drop(&mut self) {
        self.0.ended.fetch_add(1, Ordering::Release);
    }
}

impl Calls {
    pub fn begin(self: &Arc<Self>) -> CallUnderWay {
        self.began.fetch_add(1, Ordering::Relaxed);
        CallUnderWay(Arc::clone(self))
    }

    /// Some(calls begun so far) when none is under way; None while one is.
    pub fn quiet(&self) -> Option<u64> {
        // `ended` first: a call begun after this read makes `began` larger, never equal.
        let ended = self.ended.load(Ordering::Acquire);
        let began = self.began.load(Ordering::Relaxed);
        (began == ended).then_some(began)
    }
}

/// A connection's idleness, as its serving loop sees it every `period`.
pub struct Idle {
    limit: Duration,
    /// The calls begun when the connection was first seen quiet, and when that was.
    quiet_since: Option<(u64, Instant)>,
    /// When it was told GOAWAY for idleness.
    told: Option<Instant>,
}

impl Idle {
    /// A connection just served, quiet from `now` (no call yet).
    pub fn new(limit: Duration, now: Instant) -> Idle {
        Idle {
            limit,
            quiet_since: Some((0, now)),
            told: None,
        }
    }

    /// How often to look: an idle connection is ended between `limit` and 1.25 × `limit`
    /// after its last call.
    pub fn period(&self) -> Duration {
        (self.limit / 4).max(Duration::from_millis(10))
    }

    /// What to do at `now` (the time of the look, not of its tick: a late look must not date
    /// the quiet before a call's end), given what the connection's calls say (`Calls::quiet`).
    pub fn look(&mut self, now: Instant, quiet: Option<u64>) -> IdleStep {
        if let Some(told) = self.told {
            let waited = now.saturating_duration_since(told) >= self.limit;
            return if waited && quiet.is_some() {
                IdleStep::Close
            } else {
                IdleStep::Stay
            };
        }
        let idle = match (quiet, self.quiet_since) {
            (None, _) => {
                self.quiet_since = None;
                false
            }
            (Some(began), Some((seen, since))) if began == seen => {
                now.saturating_duration_since(since) >= self.limit
            }
            (Some(began), _) => {
                self.quiet_since = Some((began, now));
                false
            }
        };
        if idle {
            self.told = Some(now);
            IdleStep::GoAway
        } else {
            IdleStep::Stay
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Duration = Duration::from_secs(1);
    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn the_age_timer_first_says_goaway_then_closes_after_the_grace() {
        let now = Instant::now();
        let mut age = Age::new(&Lifespan {
            max_age: Some(5 * S),
            ..Lifespan::default()
        });
        assert_eq!(age.next_deadline(now), now + 5 * S);
        assert_eq!(age.expired(), AgeStep::GoAway);
        assert_eq!(
            age.next_deadline(now),
            now + 5 * S,
            "the age again as grace"
        );
        assert_eq!(age.expired(), AgeStep::Close);
        assert_eq!(age.expired(), AgeStep::Close);

        let mut graced = Age::new(&Lifespan {
            max_age: Some(5 * S),
            age_grace: Some(2 * S),
            ..Lifespan::default()
        });
        assert_eq!(graced.next_deadline(now), now + 5 * S);
        assert_eq!(graced.expired(), AgeStep::GoAway);
        assert_eq!(graced.next_deadline(now), now + 2 * S);

        let ageless = Age::new(&Lifespan::default());
        assert!(ageless.next_deadline(now) > now + 86_400 * 365 * S);
    }

    #[test]
    fn calls_are_quiet_only_with_none_under_way() {
        let calls = Arc::new(Calls::default());
        assert_eq!(calls.quiet(), Some(0));
        let first = calls.begin();
        let second = calls.begin();
        assert_eq!(calls.quiet(), None);
        drop(first);
        assert_eq!(calls.quiet(), None);
        drop(second);
        assert_eq!(calls.quiet(), Some(2));
    }

    #[test]
    fn a_connection_is_idle_once_quiet_for_the_limit_since_its_last_call() {
        use IdleStep::{GoAway, Stay};
        let start = Instant::now();
        let mut idle = Idle::new(4 * S, start);
        assert_eq!(idle.period(), S);
        assert_eq!(idle.look(start + 3 * S, Some(0)), Stay);
        assert_eq!(
            idle.look(start + 4 * S, Some(0)),
            GoAway,
            "never called: idle from the start"
        );

        let mut idle = Idle::new(4 * S, start);
        assert_eq!(idle.look(start + S, None), Stay, "a call under way");
        assert_eq!(idle.look(start + 2 * S, Some(1)), Stay, "quiet from here");
        assert_eq!(idle.look(start + 5 * S, Some(1)), Stay);
        assert_eq!(idle.look(start + 6 * S, Some(1)), GoAway);

        // A call that came and went between two looks starts the clock again.
        let mut idle = Idle::new(4 * S, start);
        assert_eq!(idle.look(start + 3 * S, Some(0)), Stay);
        assert_eq!(idle.look(start + 4 * S, Some(1)), Stay);
        assert_eq!(idle.look(start + 7 * S, Some(1)), Stay);
        assert_eq!(idle.look(start + 8 * S, Some(1)), GoAway);
        assert_eq!(Idle::new(Duration::from_millis(1), start).period(), 10 * MS);
    }

    #[test]
    fn a_connection_told_goaway_is_closed_after_the_limit_again_unless_a_call_came() {
        use IdleStep::{Close, GoAway, Stay};
        let start = Instant::now();
        let mut idle = Idle::new(4 * S, start);
        assert_eq!(idle.look(start + 4 * S, Some(0)), GoAway);
        assert_eq!(idle.look(start + 7 * S, Some(0)), Stay);
        assert_eq!(idle.look(start + 8 * S, Some(0)), Close);

        // A call that came in just before the GOAWAY runs to its end first.
        let mut idle = Idle::new(4 * S, start);
        assert_eq!(idle.look(start + 4 * S, Some(0)), GoAway);
        assert_eq!(idle.look(start + 9 * S, None), Stay);
        assert_eq!(idle.look(start + 10 * S, Some(1)), Close);
    }

    #[test]
    fn pings_are_the_sooner_of_keepalive_and_the_readers_check() {
        let none = Lifespan::default();
        assert_eq!(none.pings(None), None);
        assert_eq!(none.pings(Some(60 * S)), Some((60 * S, 60 * S)));
        let keepalive = Lifespan {
            keepalive_time: Some(10 * S),
            ..Lifespan::default()
        };
        assert_eq!(
            keepalive.pings(None),
            Some((10 * S, 20 * S)),
            "gRPC's 20 s timeout"
        );
        assert_eq!(keepalive.pings(Some(15 * S)), Some((10 * S, 15 * S)));
        // A keepalive slower than the reader check leaves the reader check as it was.
        let slow = Lifespan {
            keepalive_time: Some(7200 * S),
            ..Lifespan::default()
        };
        assert_eq!(slow.pings(Some(60 * S)), Some((60 * S, 60 * S)));
        let slow_short_timeout = Lifespan {
            keepalive_timeout: Some(S),
            ..slow
        };
        assert_eq!(slow_short_timeout.pings(Some(60 * S)), Some((60 * S, S)));
        let timeout_alone = Lifespan {
            keepalive_timeout: Some(5 * S),
            ..Lifespan::default()
        };
        assert_eq!(timeout_alone.pings(None), None, "no pings to time");
        assert_eq!(timeout_alone.pings(Some(60 * S)), Some((60 * S, 5 * S)));
    }
}
