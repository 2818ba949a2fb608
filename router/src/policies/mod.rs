//! Scheduling policies: which worker takes a request (`Choose`) and, when requests wait in the
//! front door because every worker has as many in flight as it may, which waiting request
//! goes next (`Order`). Each policy is one module; adding one is a module and a line in
//! `chooser` or `order` below (and its name in mpspool/config.py's list).
//!
//! Policies hold no clock and no sockets: time is passed in, so their rules are unit-tested
//! on a fake clock.

use std::time::{Duration, Instant};

use crate::batch::Batching;

pub mod cost;
mod fcfs;
mod least_loaded;
mod packed;
mod power_of_two;
mod round_robin;
mod shortest_first;

pub use cost::CostModel;

/// Picks the worker for the next request among those that can take one.
pub trait Choose: Send {
    /// `inflight[i]` is what candidate `i` (slot order) has in flight; never empty. Returns
    /// an index into it.
    fn choose(&mut self, inflight: &[usize]) -> usize;
}

/// The front door's queue of requests waiting for a worker with room.
pub trait Order<T>: Send {
    /// `arrived`: when the client's request reached the front door (a retried request keeps
    /// its first arrival); `cost`: its expected compute time, in µs (`CostModel`).
    fn push(&mut self, id: u64, item: T, arrived: Instant, cost: f64);
    /// The request to send next, and its id; `servers`: how many workers drain the queue at
    /// once (what a wait's estimate divides the work ahead by).
    fn pop(&mut self, now: Instant, servers: usize) -> Option<(u64, T)>;
    /// Take a request out (its caller gave up).
    fn remove(&mut self, id: u64) -> Option<T>;
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// How much sooner than its bound the order turns a request urgent at `now` (sjf's
    /// learned margin); zero for an order without a bound.
    fn margin(&self, _now: Instant) -> Duration {
        Duration::ZERO
    }
}

/// Worker choices by their `--dispatch` names.
pub const CHOOSERS: [&str; 4] = ["round-robin", "least-loaded", "power-of-two", "packed"];
/// Queue orders by their `--queue` names.
pub const ORDERS: [&str; 2] = ["fcfs", "sjf"];

pub fn chooser(name: &str) -> Option<Box<dyn Choose>> {
    match name {
        "round-robin" => Some(Box::new(round_robin::RoundRobin::default())),
        "least-loaded" => Some(Box::new(least_loaded::LeastLoaded)),
        "power-of-two" => Some(Box::new(power_of_two::PowerOfTwo::seeded(seed()))),
        "packed" => Some(Box::new(packed::Packed::new(packed::DEFAULT_DEPTH))),
        _ => None,
    }
}

/// `aging_bound`: for `sjf`, how long a request may wait before it goes ahead of shorter ones.
pub fn order<T: Send + 'static>(name: &str, aging_bound: Duration) -> Option<Box<dyn Order<T>>> {
    match name {
        "fcfs" => Some(Box::new(fcfs::Fcfs::default())),
        "sjf" => Some(Box::new(shortest_first::ShortestFirst::new(aging_bound))),
        _ => None,
    }
}

/// Makes an empty queue in one order.
pub type MakeOrder<T> = Box<dyn Fn() -> Box<dyn Order<T>> + Send>;

/// A maker of empty queues in `name`'s order (one queue per model version: the dispatcher's
/// `ServableQueues`).
pub fn order_maker<T: Send + 'static>(name: &str, aging_bound: Duration) -> Option<MakeOrder<T>> {
    order::<T>(name, aging_bound)?;
    let name = name.to_owned();
    Some(Box::new(move || {
        order::<T>(&name, aging_bound).unwrap_or_else(|| Box::new(fcfs::Fcfs::default()))
    }))
}

/// A seed that differs between processes (two front doors should not make the same choices);
/// not security-sensitive.
fn seed() -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    nanos ^ (u64::from(std::process::id()) << 32) | 1
}

/// The front door's scheduling settings, from the pool configuration.
#[derive(Clone, Debug, PartialEq)]
pub struct Scheduling {
    /// A `CHOOSERS` name.
    pub dispatch: String,
    /// An `ORDERS` name.
    pub queue: String,
    /// For `sjf`: the wait after which a request goes ahead of shorter ones.
    pub aging_bound: Duration,
    /// Requests a worker may have in flight before new ones wait in the front door's queue;
    /// 0: no limit (every request goes to a worker at once and queues in its socket, so the
    /// queue order never applies).
    pub worker_inflight: usize,
    /// `--split-rows`: requests with more rows run as chunks of at most this many (0: off).
    pub split_rows: u64,
    /// Merge waiting requests into one worker call (`--enable-batching`), with TF Serving's
    /// batching parameters.
    pub batching: Option<Batching>,
    /// `--enable_per_model_batching_parameters`: each version's own batching and splitting
    /// (`VersionEntry`) instead of `batching` and `split_rows`.
    pub per_model_batching: bool,
}

impl Default for Scheduling {
    fn default() -> Self {
        Scheduling {
            dispatch: "round-robin".to_string(),
            queue: "fcfs".to_string(),
            aging_bound: Duration::from_millis(50),
            worker_inflight: 0,
            split_rows: 0,
            batching: None,
            per_model_batching: false,
        }
    }
}

impl Scheduling {
    /// Why these settings cannot run, if they cannot.
    pub fn check(&self) -> Result<(), String> {
        if !CHOOSERS.contains(&self.dispatch.as_str()) {
            return Err(format!(
                "dispatch must be one of {}, got {:?}",
                CHOOSERS.join(", "),
                self.dispatch
            ));
        }
        if !ORDERS.contains(&self.queue.as_str()) {
            return Err(format!(
                "queue must be one of {}, got {:?}",
                ORDERS.join(", "),
                self.queue
            ));
        }
        match &self.batching {
            Some(batching) => batching.check(),
            None => Ok(()),
        }
    }
}
