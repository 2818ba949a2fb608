//! Power of two choices: two distinct candidates at random, the one with fewer in flight
//! (Mitzenmacher; Ray Serve's `pow_2_router.py`). Constant work per request whatever the
//! pool's size, and the maximum load stays within a small factor of least-loaded's.
//!
//! Hazard: random, so at low load requests spread over every worker (none stays warm alone);
//! with two candidates it is least-loaded with a coin for ties.

use super::Choose;

pub struct PowerOfTwo {
    state: u64,
}

impl PowerOfTwo {
    /// A fixed seed makes the choices repeatable (tests).
    pub fn seeded(seed: u64) -> PowerOfTwo {
        PowerOfTwo { state: seed | 1 }
    }

    /// xorshift64*: enough randomness to spread load; no dependency.
    fn next(&mut self) -> u64 {
        self.state ^= self.state >> 12;
        self.state ^= self.state << 25;
        self.state ^= self.state >> 27;
        self.state.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

impl Choose for PowerOfTwo {
    fn choose(&mut self, inflight: &[usize]) -> usize {
        let n = inflight.len();
        if n == 1 {
            return 0;
        }
        let first = self.below(n);
        // A second index different from the first: shift by 1..n-1.
        let second = (first + 1 + self.below(n - 1)) % n;
        if inflight[second] < inflight[first] {
            second
        } else {
            first
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn never_picks_the_loaded_one_of_two() {
        let mut policy = PowerOfTwo::seeded(7);
        for _ in 0..100 {
            assert_eq!(policy.choose(&[5, 0]), 1);
            assert_eq!(policy.choose(&[0, 5]), 0);
        }
    }

    #[test]
    fn spreads_equal_loads_over_every_worker() {
        let mut policy = PowerOfTwo::seeded(42);
        let mut picks = [0u32; 8];
        for _ in 0..8000 {
            picks[policy.choose(&[0; 8])] += 1;
        }
        // Each of 8 gets about 1000; a pick that never happens or takes a quarter is a bug.
        assert!(picks.iter().all(|&p| (700..1300).contains(&p)), "{picks:?}");
    }

    #[test]
    fn avoids_the_most_loaded_worker() {
        // The most loaded of n only wins when both draws are itself, which cannot happen.
        let mut policy = PowerOfTwo::seeded(3);
        for _ in 0..1000 {
            assert_ne!(policy.choose(&[1, 9, 1, 1]), 1);
        }
    }
}
