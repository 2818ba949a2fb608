//! The requests waiting for a worker with room, one queue per model version, each in the
//! pool's `--queue` order.
//!
//! Why one per version: a worker serves one model version, so requests of different versions
//! never wait for the same worker. In one queue, a version whose workers were full left its
//! backlog in front of everything else: every pump took all of it out and put it back to
//! reach the requests of a version with room (600 waiting for a busy model, each pump looked
//! at 600 to send one of another's), and sjf judged a request's risk by the work of other
//! models ahead of it, work its own workers never do.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use crate::policies::{MakeOrder, Order};
use crate::versions::Servable;

pub(super) struct ServableQueues<T> {
    make: MakeOrder<T>,
    /// Kept when empty: an order may have learned something (sjf's margin).
    queues: BTreeMap<Servable, Box<dyn Order<T>>>,
    /// Where each waiting request is (for a cancel).
    at: HashMap<u64, Servable>,
}

impl<T> ServableQueues<T> {
    pub(super) fn new(make: MakeOrder<T>) -> ServableQueues<T> {
        ServableQueues {
            make,
            queues: BTreeMap::new(),
            at: HashMap::new(),
        }
    }

    pub(super) fn push(
        &mut self,
        servable: Servable,
        id: u64,
        item: T,
        arrived: Instant,
        cost: f64,
    ) {
        let make = &self.make;
        let queue = self.queues.entry(servable).or_insert_with(|| make());
        queue.push(id, item, arrived, cost);
        self.at.insert(id, servable);
    }

    /// The next request of `servable`'s queue; `servers`: how many workers drain it.
    pub(super) fn pop(
        &mut self,
        servable: Servable,
        now: Instant,
        servers: usize,
    ) -> Option<(u64, T)> {
        let (id, item) = self.queues.get_mut(&servable)?.pop(now, servers)?;
        self.at.remove(&id);
        Some((id, item))
    }

    pub(super) fn remove(&mut self, id: u64) -> Option<T> {
        let servable = self.at.remove(&id)?;
        self.queues.get_mut(&servable)?.remove(id)
    }

    /// Whether `servable` has requests waiting.
    pub(super) fn holds(&self, servable: Servable) -> bool {
        self.queues
            .get(&servable)
            .is_some_and(|queue| !queue.is_empty())
    }

    pub(super) fn len(&self) -> usize {
        self.at.len()
    }

    /// The versions with requests waiting, in order.
    pub(super) fn waiting(&self) -> Vec<Servable> {
        (self.queues.iter())
            .filter(|(_, queue)| !queue.is_empty())
            .map(|(servable, _)| *servable)
            .collect()
    }

    /// Every waiting request, taken out (each queue in its order).
    pub(super) fn take_all(&mut self, now: Instant) -> Vec<(u64, T)> {
        let mut all = Vec::with_capacity(self.len());
        for queue in self.queues.values_mut() {
            while let Some(entry) = queue.pop(now, 1) {
                all.push(entry);
            }
        }
        self.at.clear();
        all
    }

    /// Queues of versions that have no request waiting and that `keep` rejects are dropped
    /// (a retired version's, so that versions coming and going leave nothing behind).
    pub(super) fn retain_empty(&mut self, keep: impl Fn(&Servable) -> bool) {
        self.queues
            .retain(|servable, queue| !queue.is_empty() || keep(servable));
    }

    /// The largest of the queues' margins (`Order::margin`).
    pub(super) fn margin(&self, now: Instant) -> Duration {
        (self.queues.values())
            .map(|queue| queue.margin(now))
            .max()
            .unwrap_or(Duration::ZERO)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fcfs() -> ServableQueues<&'static str> {
        let make: MakeOrder<&'static str> =
            Box::new(|| crate::policies::order("fcfs", Duration::from_millis(50)).expect("fcfs"));
        ServableQueues::new(make)
    }

    const A: Servable = Servable {
        model: 0,
        version: 1,
    };
    const B: Servable = Servable {
        model: 1,
        version: 1,
    };

    #[test]
    fn each_version_has_its_own_queue_and_a_cancel_finds_its_request() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let mut queues = fcfs();
        queues.push(A, 1, "a1", t0, 1.0);
        queues.push(B, 2, "b1", t0 + ms(1), 1.0);
        queues.push(A, 3, "a2", t0 + ms(2), 1.0);
        queues.push(B, 4, "b2", t0 + ms(3), 1.0);
        assert_eq!((queues.len(), queues.waiting()), (4, vec![A, B]));
        // B's head without taking A's requests out.
        assert_eq!(queues.pop(B, t0, 1), Some((2, "b1")));
        assert_eq!(queues.remove(3), Some("a2"));
        assert_eq!(queues.remove(3), None);
        assert_eq!(queues.pop(A, t0, 1), Some((1, "a1")));
        assert_eq!(queues.pop(A, t0, 1), None);
        assert!(!queues.holds(A) && queues.holds(B));
        assert_eq!((queues.len(), queues.waiting()), (1, vec![B]));
        assert_eq!(queues.take_all(t0), vec![(4, "b2")]);
        assert!(queues.len() == 0 && queues.waiting().is_empty());
        queues.retain_empty(|s| *s == B);
        assert_eq!(queues.queues.keys().copied().collect::<Vec<_>>(), vec![B]);
    }
}
