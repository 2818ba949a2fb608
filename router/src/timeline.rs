//! What each worker was doing, when: the worker-side span of every answered request.
//!
//! Workers stamp each reply with the wall-clock microseconds their model call started and
//! ended; the front door keeps the most recent ones so a load test can draw per-worker task
//! density (`mpspool timeline`), taken and cleared over the control channel, never on the
//! request path beyond one push. Beside the spans, the longest any request waited in the front
//! door's queue since the last clear: a load test clears before its measured window, so this
//! is that window's, where the `mpspool_queue_wait_max_seconds` gauge counts since start.

use std::collections::VecDeque;
use std::time::{SystemTime, UNIX_EPOCH};

/// Wall-clock µs since the epoch: the clock workers stamp their model calls with.
pub fn wall_micros() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX))
}

/// ~200 s at 1,000 requests/s.
pub const DEFAULT_CAPACITY: usize = 200_000;

pub struct Timeline {
    spans: VecDeque<(String, i64, i64)>,
    capacity: usize,
    /// Spans pushed out by newer ones since the last take(clear).
    pub dropped: u64,
    /// The longest wait in the front door's queue since the last take(clear), µs.
    queue_wait_max_us: u64,
}

impl Timeline {
    pub fn new(capacity: usize) -> Timeline {
        Timeline {
            spans: VecDeque::new(),
            capacity,
            dropped: 0,
            queue_wait_max_us: 0,
        }
    }

    /// A request left the front door's queue after waiting `waited`.
    pub fn note_queue_wait(&mut self, waited: std::time::Duration) {
        let micros = u64::try_from(waited.as_micros()).unwrap_or(u64::MAX);
        self.queue_wait_max_us = self.queue_wait_max_us.max(micros);
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

    /// `{now_us, spans: [[slot, start, end], ...], dropped, queue_wait_max_us}`, spans oldest
    /// first; with `clear`, forget them (and the longest wait) afterwards.
    pub fn take(&mut self, clear: bool) -> Vec<(&'static str, rmpv::Value)> {
        let now_us = wall_micros();
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
            (
                "queue_wait_max_us",
                rmpv::Value::from(self.queue_wait_max_us),
            ),
        ];
        if clear {
            self.spans.clear();
            self.dropped = 0;
            self.queue_wait_max_us = 0;
        }
        taken
    }
}

#[cfg(test)]
mod tests {
    //! router/timeline.py's tests. Well-formedness of `t` (two integers) is the wire
    //! decoder's part: a span reaches `record` only as two i64s.

    use super::*;

    fn json(taken: Vec<(&'static str, rmpv::Value)>) -> serde_json::Value {
        let map = taken
            .into_iter()
            .map(|(k, v)| (rmpv::Value::from(k), v))
            .collect();
        serde_json::to_value(rmpv::Value::Map(map)).unwrap()
    }

    #[test]
    fn keeps_spans_in_order_and_clears_on_request() {
        let mut t = Timeline::new(10);
        t.record("cpu/s0", 100, 250);
        t.record("cpu/s1", 120, 300);
        let first = json(t.take(false));
        assert_eq!(
            first["spans"],
            serde_json::json!([["cpu/s0", 100, 250], ["cpu/s1", 120, 300]])
        );
        assert_eq!(first["dropped"], 0);
        assert!(first["now_us"].as_i64().unwrap() > 1_700_000_000_000_000);
        assert_eq!(json(t.take(true))["spans"], first["spans"]);
        assert_eq!(json(t.take(false))["spans"], serde_json::json!([]));
    }

    #[test]
    fn bounded_and_counts_what_it_dropped() {
        let mut t = Timeline::new(3);
        for i in 0..5 {
            t.record("s", i, i + 1);
        }
        let taken = json(t.take(true));
        let starts: Vec<i64> = taken["spans"]
            .as_array()
            .unwrap()
            .iter()
            .map(|span| span[1].as_i64().unwrap())
            .collect();
        assert_eq!(starts, [2, 3, 4]);
        assert_eq!(taken["dropped"], 2);
        assert_eq!(json(t.take(false))["dropped"], 0);
    }

    #[test]
    fn the_longest_queue_wait_is_the_one_since_the_last_clear() {
        let mut t = Timeline::new(10);
        assert_eq!(json(t.take(false))["queue_wait_max_us"], 0);
        t.note_queue_wait(std::time::Duration::from_micros(70_000));
        t.note_queue_wait(std::time::Duration::from_micros(3_000));
        assert_eq!(json(t.take(true))["queue_wait_max_us"], 70_000);
        t.note_queue_wait(std::time::Duration::from_micros(4_000));
        assert_eq!(json(t.take(false))["queue_wait_max_us"], 4_000);
    }

    #[test]
    fn without_room_nothing_is_kept() {
        let mut t = Timeline::new(0);
        t.record("s", 1, 2);
        assert_eq!(json(t.take(false))["spans"], serde_json::json!([]));
    }
}
