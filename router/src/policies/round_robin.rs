//! Round-robin: each request to the next candidate in turn, whatever each holds.
//!
//! Hazard: blind to load. A long request holds its worker while the turn keeps coming back to
//! it, so short requests queue behind it when another worker is idle; with a front-door
//! in-flight limit the busy worker drops out of the candidates and the turn skips it.

use super::Choose;

#[derive(Default)]
pub struct RoundRobin {
    turn: usize,
}

impl Choose for RoundRobin {
    fn choose(&mut self, inflight: &[usize]) -> usize {
        let index = self.turn % inflight.len();
        self.turn = self.turn.wrapping_add(1);
        index
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn takes_turns_whatever_the_load() {
        let mut policy = RoundRobin::default();
        let picks: Vec<usize> = (0..5).map(|_| policy.choose(&[9, 0, 0])).collect();
        assert_eq!(picks, [0, 1, 2, 0, 1]);
    }
}
