//! Least-loaded: the candidate with the fewest requests in flight, the first in slot order
//! among equals.
//!
//! The counts are exact (the front door owns them and updates them as it sends), so there is
//! no herding on a stale view. Hazards: a scan of every worker per request (fine for the ≤ 48
//! slots of one pod), and at low load the first slot takes every request — which keeps one
//! worker warm, but also puts all the traffic on one GPU context while others idle.

use super::Choose;

pub struct LeastLoaded;

impl Choose for LeastLoaded {
    fn choose(&mut self, inflight: &[usize]) -> usize {
        let mut best = 0;
        for (index, &load) in inflight.iter().enumerate() {
            if load < inflight[best] {
                best = index;
            }
        }
        best
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fewest_in_flight_first_slot_among_equals() {
        assert_eq!(LeastLoaded.choose(&[2, 1, 1, 3]), 1);
        assert_eq!(LeastLoaded.choose(&[0, 0]), 0);
        assert_eq!(LeastLoaded.choose(&[4]), 0);
    }
}
