//! What each worker was doing, when: the worker-side span of every answered request.
//!
//! Workers stamp each reply with the wall-clock microseconds their model call started and
//! ended; the front door keeps the most recent ones so a load test can draw per-worker task
//! density (`mpspool timeline`), taken and cleared over the control channel, never on the
//! request path beyond one push.

use std::collections::VecDeque;
use std::time::{SystemTime, UNIX_EPOCH};

/// ~200 s at 1,000 requests/s.
pub const DEFAULT_CAPACITY: usize = 200_000;

pub struct Timeline {
    spans: VecDeque<(String, i64, i64)>,
    capacity: usize,
    /// Spans pushed out by newer ones since the last take(clear).
    pub dropped: u64,
}

impl Timeline {
    pub fn new(capacity: usize) -> Timeline {
        Timeline {
            spans: VecDeque::new(),
            capacity,
            dropped: 0,
        }
    }

    pub fn record(&mut self, slot: &str, start_us: i64, end_us: i64) {
        if self.capacity == 0 {
            return;
        }
        if self.spans.len() == self.capacity {
            self.spans.pop_front();
            self.dropped += 1;
        }
        self.spans.push_back((slot.to_string(), start_us, end_us));
    }

    /// `{now_us, spans: [[slot, start, end], ...], dropped}`, oldest first; with `clear`,
    /// forget them afterwards.
    pub fn take(&mut self, clear: bool) -> Vec<(&'static str, rmpv::Value)> {
        let now_us = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_micros() as i64)
            .unwrap_or(0);
        let spans: Vec<rmpv::Value> = self
            .spans
            .iter()
            .map(|(slot, start, end)| {
                rmpv::Value::Array(vec![
                    rmpv::Value::from(slot.as_str()),
                    rmpv::Value::from(*start),
                    rmpv::Value::from(*end),
                ])
            })
            .collect();
        let taken = vec![
            ("now_us", rmpv::Value::from(now_us)),
            ("spans", rmpv::Value::Array(spans)),
            ("dropped", rmpv::Value::from(self.dropped)),
        ];
        if clear {
            self.spans.clear();
            self.dropped = 0;
        }
        taken
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_the_newest_and_counts_what_it_dropped() {
        let mut t = Timeline::new(2);
        t.record("a", 1, 2);
        t.record("b", 3, 4);
        t.record("c", 5, 6);
        let taken = t.take(true);
        let spans = taken[1].1.as_array().unwrap();
        assert_eq!(spans.len(), 2);
        assert_eq!(spans[0].as_array().unwrap()[0].as_str(), Some("b"));
        assert_eq!(taken[2].1.as_u64(), Some(1));
        assert_eq!(t.take(false)[1].1.as_array().unwrap().len(), 0);
        assert_eq!(t.dropped, 0);
    }
}
