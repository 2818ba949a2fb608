//! The memory the front door's requests may take at once: REST's JSON documents while they
//! are parsed, and every request's built or decoded form until it is answered.
//!
//! A JSON body's document costs up to ~90 times its bytes (`json_tensor::parse_cost`), and a
//! gRPC message's decoded form many times its wire bytes (`decode_budget`). One request over
//! the budget is refused on its own; this makes the budget hold for all of them together, so
//! that many concurrent requests, each allowed, cannot take the front door's memory between
//! them. A request reserves its cost before it is built and holds what its built form takes
//! until its answer is sent. REST waits for its reservation, first come first served, until
//! its request's deadline; a gRPC message, whose decoding cannot wait, is refused when the
//! budget has not enough free at once (and while a REST body waits, since the semaphore is
//! fair: what is given back goes to the first in line).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

use crate::status::{Code, ServingError};

/// The memory a front door allows for its requests at once: 4 times the largest message
/// accepted (`max_message_bytes`), and at least BUDGET_MIN.
pub fn budget_bytes(max_message_bytes: usize) -> usize {
    max_message_bytes
        .saturating_mul(BUDGET_PER_MESSAGE_BYTE)
        .max(BUDGET_MIN)
}

const BUDGET_PER_MESSAGE_BYTE: usize = 4;
/// Over the most a JSON body short enough to parse in place could cost
/// (json_tensor::most_parse_cost of rest::BLOCKING_BODY_BYTES, 160 MiB): such a body is never
/// refused for it.
pub const BUDGET_MIN: usize = 256 << 20;

/// Reservations count KiB: tokio's `acquire_many` takes a u32, and a budget in bytes can
/// pass u32::MAX.
const UNIT: usize = 1024;

/// A share of the budget, given back when dropped.
pub type Held = OwnedSemaphorePermit;

/// A request's shares of the budget (its decoded form's, what building its frames added),
/// kept with its work for as long as the front door keeps that work's frames: by its caller,
/// and by each copy the dispatcher holds (queued, or at a worker until it answers). A caller
/// that goes away (cancelled, its client gone) leaves the shares with what still holds the
/// frames. Before, they went back with the caller: requests cancelled while at a slow worker
/// held 1.15 GB against a 256 MiB budget, new ones being let in (found by a hunt).
#[derive(Clone, Default)]
pub struct KeptShare(Option<Arc<std::sync::Mutex<Shares>>>);

struct Shares {
    request: Option<Held>,
    /// Held until the last copy of the frames goes (only its size is read).
    built: Option<Held>,
}

impl KeptShare {
    /// No allocation for a request that holds nothing (a small one).
    pub fn new(request: Option<Held>, built: Option<Held>) -> Self {
        if request.is_none() && built.is_none() {
            return Self(None);
        }
        Self(Some(Arc::new(std::sync::Mutex::new(Shares {
            request,
            built,
        }))))
    }

    /// What it holds now, in bytes.
    pub fn held_bytes(&self) -> usize {
        self.0.as_ref().map_or(0, |shares| {
            let shares = shares
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            share_bytes(shares.request.as_ref()) + share_bytes(shares.built.as_ref())
        })
    }

    /// The request's own share, back to its caller once the work is answered (its answer
    /// takes it over); what building took stays until the last copy of the frames goes.
    pub fn take_request(&self) -> Option<Held> {
        let shares = self.0.as_ref()?;
        // A poisoned lock still holds the shares: a panic elsewhere does not change them.
        let mut shares = shares
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        shares.request.take()
    }
}

pub struct RequestBudget {
    permits: Arc<Semaphore>,
    bytes: usize,
    /// Whole KiB the semaphore was made with (the budget, unless that passes its maximum).
    units: usize,
    /// What bodies under UNCOUNTED_BYTES being gathered hold now, uncounted, and the most
    /// they may (request_body.rs): past it they count as any.
    small: AtomicUsize,
    small_most: usize,
}

/// The most small bodies being gathered hold uncounted, in all.
const SMALL_GATHERING_BYTES: usize = 32 << 20;

impl RequestBudget {
    pub fn new(bytes: usize) -> Self {
        let units = units(bytes).min(Semaphore::MAX_PERMITS as u64) as usize;
        Self {
            permits: Arc::new(Semaphore::new(units)),
            bytes,
            units,
            small: AtomicUsize::new(0),
            small_most: SMALL_GATHERING_BYTES,
        }
    }

    /// The most small bodies being gathered may hold uncounted (tests).
    #[cfg(test)]
    pub fn with_small_most(mut self, bytes: usize) -> Self {
        self.small_most = bytes;
        self
    }

    /// Takes `more` bytes of a small body being gathered uncounted, unless small bodies
    /// would then hold more than they may in all (the body's bytes count then).
    pub fn gather_small(&self, more: usize) -> bool {
        self.small
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |now| {
                now.checked_add(more)
                    .filter(|&total| total <= self.small_most)
            })
            .is_ok()
    }

    /// Gives back `less` bytes taken by `gather_small`.
    pub fn release_small(&self, less: usize) {
        self.small.fetch_sub(less, Ordering::AcqRel);
    }

    /// What small bodies being gathered hold now, uncounted.
    #[cfg(test)]
    pub fn small_gathering(&self) -> usize {
        self.small.load(Ordering::Acquire)
    }

    /// The whole budget, in bytes.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// `cost` bytes, held until the reservation is dropped; waits for them until `deadline`
    /// (DEADLINE_EXCEEDED after it). A cost over the whole budget is the caller's to refuse
    /// first (`ParseCost::check`); here it is INTERNAL, since it could never be granted.
    pub async fn reserve(
        &self,
        cost: usize,
        deadline: Option<Instant>,
    ) -> Result<Held, ServingError> {
        let units = self.units_of(cost)?;
        let acquire = self.permits.clone().acquire_many_owned(units);
        let acquired = match deadline {
            None => acquire.await,
            Some(deadline) => tokio::time::timeout_at(deadline, acquire)
                .await
                .map_err(|_| {
                    ServingError::new(
                        Code::DeadlineExceeded,
                        "Deadline Exceeded while waiting for memory to read or parse the request body",
                    )
                })?,
        };
        // The semaphore is never closed.
        acquired.map_err(|error| ServingError::new(Code::Internal, error.to_string()))
    }

    /// `cost` bytes now, or None when others hold too much of the budget (or wait for it) to
    /// grant them without waiting.
    pub fn try_reserve(&self, cost: usize) -> Option<Held> {
        let units = self.units_of(cost).ok()?;
        self.permits.clone().try_acquire_many_owned(units).ok()
    }

    /// What requests hold now, in bytes (whole KiB).
    pub fn held_bytes(&self) -> usize {
        self.units
            .saturating_sub(self.permits.available_permits())
            .saturating_mul(UNIT)
    }

    fn units_of(&self, cost: usize) -> Result<u32, ServingError> {
        if cost > self.bytes {
            return Err(ServingError::new(
                Code::Internal,
                format!(
                    "a parse of {cost} bytes cannot fit the {} byte budget",
                    self.bytes
                ),
            ));
        }
        // At most units(self.bytes), which the semaphore was made with: a u32 unless the
        // budget is over 4 TiB (messages are limited to under 2 GiB, so budgets to 8 GiB).
        u32::try_from(units(cost)).map_err(|_| {
            ServingError::new(
                Code::Internal,
                format!("a parse of {cost} bytes is too large"),
            )
        })
    }

    /// RESOURCE_EXHAUSTED for a request that cannot go further (`doing`: "reading this one",
    /// "uncompressing this body") with `so_far` bytes of it taken, the budget not having the
    /// room free at once.
    pub fn no_room(&self, doing: &str, so_far: usize) -> ServingError {
        ServingError::new(
            Code::ResourceExhausted,
            format!(
                "requests being read or served (or a REST body waiting) hold {} MiB of the \
                 front door's memory, and {doing} further ({} MiB so far) would pass the {} \
                 MiB allowed for all of them at once (4 times --max-message-bytes, at least \
                 256); try again later",
                self.held_bytes() >> 20,
                so_far.div_ceil(1 << 20),
                self.bytes >> 20
            ),
        )
    }

    /// Holds `bytes`, what building a request's worker frames adds to what it holds already
    /// (`already`, its decoded form), without waiting: RESOURCE_EXHAUSTED when the two are over
    /// the whole budget (it could never fit: not "try again later"), or when the budget has
    /// not `bytes` free now. None under `uncounted` bytes (as small requests are not counted).
    /// Before, only the wire bytes were: an 81-byte Predict whose one value was repeated to
    /// fill [10000000, 13] built a 495 MiB frame, four at once 4 GiB, with the budget counting
    /// none of it (found by a hunt).
    pub fn hold_built(
        &self,
        bytes: u64,
        already: usize,
        uncounted: usize,
    ) -> Result<Option<Held>, ServingError> {
        let bytes = usize::try_from(bytes).unwrap_or(usize::MAX);
        if bytes < uncounted {
            return Ok(None);
        }
        if bytes.saturating_add(already) > self.bytes {
            return Err(ServingError::new(
                Code::ResourceExhausted,
                format!(
                    "this request's tensors would take {} MiB more once built (values given \
                     one by one, or the last one repeated to fill its shape), beside the {} \
                     MiB it holds: more than the {} MiB the front door allows for requests \
                     at once (4 times --max-message-bytes, at least 256); send fewer rows per \
                     request",
                    bytes.div_ceil(1 << 20),
                    already >> 20,
                    self.bytes >> 20
                ),
            ));
        }
        self.try_reserve(bytes).map(Some).ok_or_else(|| {
            ServingError::new(
                Code::ResourceExhausted,
                format!(
                    "requests being read or served (or a REST body waiting) hold {} MiB of \
                     the front door's memory, and building this one's tensors ({} MiB) would \
                     pass the {} MiB allowed for all of them at once (4 times \
                     --max-message-bytes, at least 256); try again later",
                    self.held_bytes() >> 20,
                    bytes.div_ceil(1 << 20),
                    self.bytes >> 20
                ),
            )
        })
    }

    #[cfg(test)]
    pub fn available_bytes(&self) -> usize {
        self.permits.available_permits() * UNIT
    }
}

/// Keeps `bytes` of `held` (whole KiB, at most what it holds) and gives the rest back: what a
/// request's built form takes, once what building it took is no longer needed.
pub fn keep(mut held: Held, bytes: usize) -> Held {
    let keep = usize::try_from(units(bytes)).unwrap_or(usize::MAX);
    if let Some(rest) = held.split(held.num_permits().saturating_sub(keep)) {
        drop(rest);
    }
    held
}

/// `carried` (what a request held so far, if anything) made a share of `bytes`: trimmed, or
/// topped up from `budget` without waiting; None when the budget has not the room (`carried`
/// is given back then).
pub fn resize(carried: Option<Held>, bytes: usize, budget: &RequestBudget) -> Option<Held> {
    let have = share_bytes(carried.as_ref());
    match carried {
        Some(carried) if have >= bytes => Some(keep(carried, bytes)),
        carried => {
            let more = budget.try_reserve(bytes - have)?;
            Some(match carried {
                Some(mut carried) => {
                    carried.merge(more);
                    carried
                }
                None => more,
            })
        }
    }
}

/// The bytes `held` holds (whole KiB); 0 for none.
pub fn share_bytes(held: Option<&Held>) -> usize {
    held.map_or(0, |held| held.num_permits().saturating_mul(UNIT))
}

/// Whole KiB, rounded up; at least one, so that every parse holds some of the budget.
fn units(bytes: usize) -> u64 {
    (bytes.div_ceil(UNIT) as u64).max(1)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn what_building_a_request_takes_is_held_or_refused_saying_why() {
        let budget = RequestBudget::new(100 * UNIT);
        assert!(budget
            .hold_built(10 * UNIT as u64, 0, 16 * UNIT)
            .unwrap()
            .is_none());
        let held = budget.hold_built(60 * UNIT as u64, 0, 16 * UNIT).unwrap();
        assert_eq!(budget.available_bytes(), 40 * UNIT);
        let refused = budget
            .hold_built(41 * UNIT as u64, 0, 16 * UNIT)
            .unwrap_err();
        assert_eq!(refused.code, Code::ResourceExhausted);
        assert!(
            refused
                .message
                .contains("building this one's tensors (1 MiB) would pass"),
            "{}",
            refused.message
        );
        let over = budget.hold_built(u64::MAX, 0, 16 * UNIT).unwrap_err();
        assert_eq!(over.code, Code::ResourceExhausted);
        assert!(over.message.contains("once built"), "{}", over.message);
        // With what the request holds beside, it could never fit: said so, not "later".
        let never = budget
            .hold_built(40 * UNIT as u64, 70 * UNIT, 16 * UNIT)
            .unwrap_err();
        assert!(
            never.message.contains("beside the 0 MiB it holds"),
            "{}",
            never.message
        );
        assert!(
            !never.message.contains("try again later"),
            "{}",
            never.message
        );
        drop(held);
        assert_eq!(budget.available_bytes(), 100 * UNIT);
    }

    #[tokio::test]
    async fn reservations_wait_until_enough_is_given_back() {
        let budget = Arc::new(RequestBudget::new(100 * UNIT));
        let first = budget.reserve(60 * UNIT, None).await.unwrap();
        assert_eq!(budget.available_bytes(), 40 * UNIT);
        assert!(budget.try_reserve(41 * UNIT).is_none());
        let second = tokio::spawn({
            let budget = budget.clone();
            async move { budget.reserve(50 * UNIT, None).await.map(|_| ()) }
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!second.is_finished(), "granted while 60 of 100 were held");
        drop(first);
        tokio::time::timeout(Duration::from_secs(5), second)
            .await
            .expect("granted once given back")
            .unwrap()
            .unwrap();
        assert_eq!(budget.available_bytes(), 100 * UNIT);
    }

    #[tokio::test]
    async fn a_wait_ends_at_the_deadline_and_takes_nothing() {
        let budget = RequestBudget::new(10 * UNIT);
        let held = budget.try_reserve(8 * UNIT).unwrap();
        let deadline = Instant::now() + Duration::from_millis(30);
        let error = budget.reserve(5 * UNIT, Some(deadline)).await.unwrap_err();
        assert_eq!(error.code, Code::DeadlineExceeded);
        assert!(Instant::now() >= deadline);
        drop(held);
        assert_eq!(budget.available_bytes(), 10 * UNIT);
    }

    #[tokio::test]
    async fn a_cost_past_the_whole_budget_is_never_waited_for() {
        let budget = RequestBudget::new(10 * UNIT);
        let error = budget.reserve(10 * UNIT + 1, None).await.unwrap_err();
        assert_eq!(error.code, Code::Internal);
        assert!(budget.try_reserve(10 * UNIT + 1).is_none());
        // Costs round up to whole KiB, never below one: the budget still fits its own size.
        drop(budget.try_reserve(10 * UNIT).unwrap());
        assert!(budget.try_reserve(0).is_some());
    }

    #[test]
    fn a_request_keeps_what_its_built_form_takes_and_gives_back_the_rest() {
        let budget = RequestBudget::new(100 * UNIT);
        let held = budget.try_reserve(60 * UNIT).unwrap();
        assert_eq!(budget.held_bytes(), 60 * UNIT);
        let kept = keep(held, 10 * UNIT + 1);
        assert_eq!(budget.held_bytes(), 11 * UNIT, "whole KiB, rounded up");
        // Never more than it held: a built form larger than its reservation keeps that.
        let kept = keep(kept, 500 * UNIT);
        assert_eq!(budget.held_bytes(), 11 * UNIT);
        drop(kept);
        assert_eq!(budget.held_bytes(), 0);
        assert_eq!(budget.available_bytes(), 100 * UNIT);
    }
}
