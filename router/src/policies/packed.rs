//! Packed: the first candidate (slot order) that is already working and holds fewer than
//! `depth` requests; when none is, the least loaded (first slot among equals).
//!
//! Why: a worker with nothing to do sleeps, and a request sent to it pays for waking it: on
//! the 2-core virtual machine of bench/RESULTS.md a wake-up across cores costs ~24 µs, and two
//! workers at batch 1 and concurrency 4 spent 80–86 µs of worker CPU per request spread
//! round-robin against 37–40 when one worker took them all (it never slept), serving 2.2× the
//! requests. A request queued behind at most `depth - 1` others on an awake worker is cheaper
//! than a wake-up while the others are short. Hazards: at low load the other workers (GPU
//! contexts) idle; a request waits behind up to `depth - 1` others where another worker is
//! free, which at long calls (batch 256 here: ~250 µs each) adds their time to its latency;
//! past `depth` in flight on every working worker it spreads like least-loaded.

use super::least_loaded::LeastLoaded;
use super::Choose;

/// Requests an awake worker may hold before the next one goes elsewhere: the one it runs and
/// three queued (the depth measured in bench/RESULTS.md).
pub const DEFAULT_DEPTH: usize = 4;

pub struct Packed {
    depth: usize,
}

impl Packed {
    pub fn new(depth: usize) -> Self {
        Self {
            depth: depth.max(1),
        }
    }
}

impl Choose for Packed {
    fn choose(&mut self, inflight: &[usize]) -> usize {
        inflight
            .iter()
            .position(|&load| load > 0 && load < self.depth)
            .unwrap_or_else(|| LeastLoaded.choose(inflight))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_awake_worker_with_room_first() {
        let mut policy = Packed::new(4);
        assert_eq!(policy.choose(&[0, 2, 1]), 1); // the first working one, not the idle one
        assert_eq!(policy.choose(&[3, 1]), 0);
    }

    #[test]
    fn idle_or_full_workers_are_chosen_as_least_loaded_does() {
        let mut policy = Packed::new(4);
        assert_eq!(policy.choose(&[0, 0]), 0); // nobody awake: the first slot
        assert_eq!(policy.choose(&[4, 0]), 1); // the awake one is full: wake the next
        assert_eq!(policy.choose(&[4, 5, 4]), 0); // every one full: fewest in flight
        assert_eq!(policy.choose(&[6, 4, 5]), 1);
    }

    #[test]
    fn requests_arriving_together_fill_one_worker_then_the_next() {
        let mut policy = Packed::new(DEFAULT_DEPTH);
        let mut inflight = vec![0usize; 3];
        let picks: Vec<usize> = (0..9)
            .map(|_| {
                let i = policy.choose(&inflight);
                inflight[i] += 1;
                i
            })
            .collect();
        assert_eq!(picks, [0, 0, 0, 0, 1, 1, 1, 1, 2]);
    }

    #[test]
    fn a_depth_of_one_never_queues_behind_a_working_worker() {
        let mut policy = Packed::new(1);
        assert_eq!(policy.choose(&[1, 0]), 1);
        assert_eq!(Packed::new(0).choose(&[1, 0]), 1); // 0 is read as 1
    }
}
