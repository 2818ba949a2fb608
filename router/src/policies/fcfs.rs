//! First come, first served: the request that reached the front door first goes first (a
//! retried request keeps its place: its arrival is the client's, not the retry's).
//!
//! Hazard: head-of-line blocking — one large request at the head makes every small request
//! behind it wait for its whole compute time.

use std::collections::{BTreeMap, HashMap};
use std::time::Instant;

use super::Order;

pub struct Fcfs<T> {
    by_arrival: BTreeMap<(Instant, u64), T>,
    arrival: HashMap<u64, Instant>,
}

impl<T> Default for Fcfs<T> {
    fn default() -> Self {
        Fcfs {
            by_arrival: BTreeMap::new(),
            arrival: HashMap::new(),
        }
    }
}

impl<T: Send> Order<T> for Fcfs<T> {
    fn push(&mut self, id: u64, item: T, arrived: Instant, _cost: f64) {
        self.by_arrival.insert((arrived, id), item);
        self.arrival.insert(id, arrived);
    }

    fn pop(&mut self, _now: Instant, _servers: usize) -> Option<(u64, T)> {
        let ((_, id), item) = self.by_arrival.pop_first()?;
        self.arrival.remove(&id);
        Some((id, item))
    }

    fn remove(&mut self, id: u64) -> Option<T> {
        let arrived = self.arrival.remove(&id)?;
        self.by_arrival.remove(&(arrived, id))
    }

    fn len(&self) -> usize {
        self.by_arrival.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arrival_order_whatever_the_cost_or_id() {
        let t0 = Instant::now();
        let ms = std::time::Duration::from_millis;
        let mut queue = Fcfs::default();
        queue.push(1, "second", t0 + ms(2), 1.0);
        queue.push(2, "big first", t0, 1e9);
        // A retry: a new id, the first arrival.
        queue.push(3, "retried", t0 + ms(1), 5.0);
        queue.push(4, "cancelled", t0 + ms(3), 1.0);
        assert_eq!(queue.remove(4), Some("cancelled"));
        assert_eq!(queue.remove(4), None);
        let order: Vec<_> = std::iter::from_fn(|| queue.pop(t0, 1)).collect();
        assert_eq!(order, [(2, "big first"), (3, "retried"), (1, "second")]);
        assert!(queue.is_empty());
    }
}
