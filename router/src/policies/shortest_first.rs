//! Shortest job first with aging: the waiting request with the smallest expected compute
//! time goes first — unless some request is at risk of waiting longer than `aging_bound`;
//! then the oldest goes first (the queue is served first come, first served until no request
//! is at risk).
//!
//! Why: with FCFS a batch-512 request at the head of the queue makes every batch-1 request
//! behind it wait for it; served shortest first, small requests overtake it and the mean and
//! tail wait of the many small ones fall (the OCR team's retrospective measured +8–15%
//! capacity). The hazard of plain SJF is starvation: under a steady stream of small requests
//! a large one never goes. Aging bounds that.
//!
//! The bound: once the queue goes oldest first, a request waits for the requests older than
//! it and for a worker to free. So a request is at risk when its wait so far, plus the
//! expected compute of the older waiting requests that are not longer than it (within a
//! factor of two) shared over the `servers` that drain the queue, plus one call (the longest
//! expected compute of a waiting request, at most half the bound: what a worker's current call
//! most likely takes at worst) reaches `aging_bound`. Counting the older requests' work is what
//! keeps a run of large requests that arrived close together within the bound: judged by its
//! own wait alone, the last of eight 3 ms requests on two workers would turn urgent only when
//! one call short of the bound and then wait for the seven ahead of it, 10 ms more. Older
//! *longer* requests are left out of a request's sum: shortest-first sends it before them, and
//! they are judged by their own sums (counted, a small request behind a large one would make
//! the queue send the large one first, the opposite of what it needs). While the pool keeps up
//! with its load and the cost model is right, no request waits longer than `aging_bound`; a
//! call that takes longer than its estimate adds its excess. Under overload every request is
//! at risk and the order is FCFS, the fair order when nothing can be served in time.
//!
//! The plan runs late in ways the estimates do not see: calls slower than the worker-reported
//! mean (a machine busier than it was), a request that turns at risk just after a pop and
//! waits for the next worker to free, a front door that gets its core late (2026-11-25, 2
//! cores at 70-80% load: sent 51-58 ms against 50). So the queue learns a margin from its near
//! misses, before any request is late: every request it sends after the point where it was
//! planned to go (its wait past the slack less the margin) shows how late plans run, and the
//! margin is the largest such overrun, faded by half every `MARGIN_HALF_LIFE` and capped at a
//! quarter of the bound. It is subtracted from the slack: requests turn at risk that much
//! sooner. Overruns are measured from the point the margin already moved, so a margin that
//! covers them stops growing. Under a pool that keeps up, requests go at risk many times a
//! second (every large request that small ones overtook does), so the margin is learned in a
//! pool's first seconds of load, not from its first late requests; under overload every
//! request overruns and the margin sits at its cap until the overload ends and it fades.
//!
//! Cost: a pop scans the waiting requests oldest first until one is at risk, keeping the older
//! work in power-of-two cost classes; a queue longer than `SCAN_LIMIT` counts as at risk (a
//! backlog, served in arrival order).

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use super::Order;

/// The most waiting requests a pop looks at before it treats the queue as a backlog.
const SCAN_LIMIT: usize = 512;

/// How fast the learned margin fades. The overruns that break the bound are rare spikes (a
/// call several times its estimate, a front door that gets its core late: 2026-11-25, one
/// 9.5 ms call among chunk calls of 1.2 ms median), so the margin remembers the largest of
/// the last minute or so, not of the last seconds (with 10 s, a pool sent a request 2 ms past
/// the bound); its cap (a quarter of the bound) limits what an overload leaves behind it.
const MARGIN_HALF_LIFE: Duration = Duration::from_secs(60);

/// A cost's class: ⌊log2(ns)⌋, so that requests within a factor of two share one.
fn cost_class(cost: u64) -> usize {
    (u64::BITS - cost.leading_zeros()) as usize
}

struct Entry<T> {
    item: T,
    arrived: Instant,
    cost: u64,
}

pub struct ShortestFirst<T> {
    aging_bound: Duration,
    entries: HashMap<u64, Entry<T>>,
    /// (cost in ns, arrival, id): the shortest first, the oldest among equals.
    by_cost: BTreeMap<(u64, Instant, u64), ()>,
    /// (arrival, id) → cost in ns: the oldest first.
    by_arrival: BTreeMap<(Instant, u64), u64>,
    /// The learned margin as of `margin_at` (see the module's doc); written by `pop` alone.
    margin: Duration,
    margin_at: Option<Instant>,
}

impl<T> ShortestFirst<T> {
    pub fn new(aging_bound: Duration) -> ShortestFirst<T> {
        ShortestFirst {
            aging_bound,
            entries: HashMap::new(),
            by_cost: BTreeMap::new(),
            by_arrival: BTreeMap::new(),
            margin: Duration::ZERO,
            margin_at: None,
        }
    }
}

impl<T> ShortestFirst<T> {
    /// The bound less one call: the longest compute time expected of a waiting request (what
    /// a worker's current call most likely takes at worst), never less than half the bound,
    /// so that shortest-first still orders the rest.
    fn slack(&self) -> Duration {
        let longest = self
            .by_cost
            .last_key_value()
            .map_or(0, |(&(cost, _, _), _)| cost);
        self.aging_bound - Duration::from_nanos(longest).min(self.aging_bound / 2)
    }

    /// Out of every index.
    fn take(&mut self, id: u64) -> Option<Entry<T>> {
        let entry = self.entries.remove(&id)?;
        self.by_cost.remove(&(entry.cost, entry.arrived, id));
        self.by_arrival.remove(&(entry.arrived, id));
        Some(entry)
    }

    /// The learned margin at `now`: what it was last set to, halved per `MARGIN_HALF_LIFE`
    /// since.
    fn margin(&self, now: Instant) -> Duration {
        let Some(at) = self.margin_at else {
            return Duration::ZERO;
        };
        let half_lives =
            now.saturating_duration_since(at).as_secs_f64() / MARGIN_HALF_LIFE.as_secs_f64();
        self.margin.mul_f64(0.5f64.powf(half_lives))
    }

    /// The wait at which a request with nothing ahead of it turns at risk: the slack less the
    /// learned margin.
    fn threshold(&self, now: Instant) -> Duration {
        self.slack().saturating_sub(self.margin(now))
    }

    /// A request leaves the queue at `now` after waiting `waited`, planned to go at a wait of
    /// `threshold` at the latest: an overrun of the plan larger than the margin becomes the
    /// margin (the largest, not a sum: overruns are measured past the margin already in use).
    fn learn(&mut self, now: Instant, waited: Duration, threshold: Duration) {
        let overrun = waited.saturating_sub(threshold);
        if overrun <= self.margin(now) {
            return; // `margin(now)` fades it from `margin_at` meanwhile
        }
        self.margin = overrun.min(self.aging_bound / 4);
        self.margin_at = Some(now);
    }

    /// Whether some waiting request, served after the older ones not longer than it by
    /// `servers` workers, would start later than the bound allows.
    fn at_risk(&self, now: Instant, servers: usize, threshold: Duration) -> bool {
        let servers = servers.max(1) as u64;
        // Expected compute of the requests scanned so far, by cost class.
        let mut older_work = [0u64; u64::BITS as usize + 1];
        for (seen, (&(arrived, _), &cost)) in self.by_arrival.iter().enumerate() {
            if seen == SCAN_LIMIT {
                return true;
            }
            let class = cost_class(cost);
            let ahead: u64 = older_work[..=class]
                .iter()
                .fold(0u64, |sum, &work| sum.saturating_add(work));
            let ahead = Duration::from_nanos(ahead / servers);
            if now.saturating_duration_since(arrived) + ahead >= threshold {
                return true;
            }
            older_work[class] = older_work[class].saturating_add(cost);
        }
        false
    }
}

impl<T: Send> Order<T> for ShortestFirst<T> {
    fn push(&mut self, id: u64, item: T, arrived: Instant, cost: f64) {
        // µs → ns, saturating (a NaN or negative estimate counts as free).
        let cost = (cost.max(0.0) * 1000.0).min(u64::MAX as f64) as u64;
        self.by_cost.insert((cost, arrived, id), ());
        self.by_arrival.insert((arrived, id), cost);
        self.entries.insert(
            id,
            Entry {
                item,
                arrived,
                cost,
            },
        );
    }

    fn pop(&mut self, now: Instant, servers: usize) -> Option<(u64, T)> {
        let threshold = self.threshold(now);
        let id = if self.at_risk(now, servers, threshold) {
            let (&(_, oldest), _) = self.by_arrival.first_key_value()?;
            oldest
        } else {
            let (&(_, _, shortest), _) = self.by_cost.first_key_value()?;
            shortest
        };
        let entry = self.take(id)?;
        self.learn(now, now.saturating_duration_since(entry.arrived), threshold);
        Some((id, entry.item))
    }

    fn remove(&mut self, id: u64) -> Option<T> {
        self.take(id).map(|entry| entry.item)
    }

    fn len(&self) -> usize {
        self.entries.len()
    }

    fn margin(&self, now: Instant) -> Duration {
        ShortestFirst::margin(self, now)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BOUND: Duration = Duration::from_millis(50);

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    fn us(n: u64) -> Duration {
        Duration::from_micros(n)
    }

    #[test]
    fn shortest_first_oldest_among_equals() {
        let t0 = Instant::now();
        let mut queue = ShortestFirst::new(BOUND);
        queue.push(1, "big", t0, 5000.0);
        queue.push(2, "small, later", t0 + ms(2), 250.0);
        queue.push(3, "small, earlier", t0 + ms(1), 250.0);
        queue.push(4, "medium", t0 + ms(3), 900.0);
        let now = t0 + ms(5);
        let order: Vec<_> = std::iter::from_fn(|| queue.pop(now, 1))
            .map(|(_, s)| s)
            .collect();
        assert_eq!(order, ["small, earlier", "small, later", "medium", "big"]);
    }

    #[test]
    fn an_overdue_request_goes_before_shorter_ones_and_overdue_ones_go_oldest_first() {
        let t0 = Instant::now();
        let mut queue = ShortestFirst::new(BOUND);
        queue.push(1, "big", t0, 5000.0);
        queue.push(2, "bigger, later", t0 + ms(10), 9000.0);
        queue.push(3, "small", t0 + ms(40), 1.0);
        // The longest waiting request is expected to take 9 ms: at risk after 50 - 9 = 41 ms.
        // At 41 ms only "big" is ("bigger, later" has waited 31 ms, and "big", older but not
        // within a factor of two of it, is not counted ahead of it).
        assert_eq!(queue.pop(t0 + ms(41), 1), Some((1, "big")));
        assert_eq!(queue.pop(t0 + ms(41), 1), Some((3, "small")));
        assert_eq!(queue.pop(t0 + ms(52), 1), Some((2, "bigger, later")));
    }

    /// The work of older requests counts: a request that would start late behind them makes
    /// the queue go oldest first before its own wait alone says so.
    #[test]
    fn older_work_of_the_same_size_brings_the_risk_forward() {
        let t0 = Instant::now();
        // Eight 3 ms requests that arrived together and a small one: slack 50 - 3 = 47 ms.
        // The eighth has 7 × 3 ms of older work ahead of it: on two workers 10.5 ms (at risk
        // once it has waited 36.5 ms), on one 21 ms (at risk from 26 ms).
        for (servers, at_risk) in [(2, us(36_500)), (1, ms(26))] {
            let mut queue = ShortestFirst::new(BOUND);
            for id in 0..8 {
                queue.push(id, "large", t0, 3000.0);
            }
            queue.push(8, "small", t0 + ms(20), 250.0);
            queue.push(9, "small", t0 + ms(20), 250.0);
            let just_before = at_risk - us(100);
            assert_eq!(queue.pop(t0 + just_before, servers), Some((8, "small")));
            assert_eq!(queue.pop(t0 + at_risk, servers), Some((0, "large")));
        }
    }

    #[test]
    fn a_small_request_behind_a_large_one_is_not_sent_after_it() {
        let t0 = Instant::now();
        let mut queue = ShortestFirst::new(BOUND);
        queue.push(1, "large", t0, 100_000.0);
        queue.push(2, "small", t0 + us(1), 250.0);
        // Counted behind the large one, the small one would be at risk at once (100 ms of
        // work ahead) and the queue would send the large one first.
        assert_eq!(queue.pop(t0 + ms(1), 1), Some((2, "small")));
        assert_eq!(queue.pop(t0 + ms(1), 1), Some((1, "large")));
    }

    #[test]
    fn cancelled_requests_leave_every_index() {
        let t0 = Instant::now();
        let mut queue = ShortestFirst::new(BOUND);
        queue.push(1, "a", t0, 10.0);
        queue.push(2, "b", t0 + ms(1), 1.0);
        assert_eq!(queue.remove(1), Some("a"));
        assert_eq!(queue.remove(1), None);
        assert_eq!(queue.len(), 1);
        // "a" was at risk at 100 ms but is gone: nothing of it is left to pop.
        assert_eq!(queue.pop(t0 + ms(100), 1), Some((2, "b")));
        assert_eq!(queue.pop(t0 + ms(100), 1), None);
        assert!(queue.by_cost.is_empty() && queue.by_arrival.is_empty());
    }

    /// The bound is the wait's, not the moment a request turns urgent: with one worker slot
    /// busy with a 20 ms call, a 20 ms request that arrived just after it is at risk at 30 ms
    /// and — the slot freeing every 20 ms — is sent by the 40 ms mark, within 50 ms; at risk
    /// only at the bound itself it would have been sent at 60 ms.
    #[test]
    fn a_request_that_waits_for_a_call_to_end_is_sent_within_the_bound() {
        let t0 = Instant::now();
        let mut queue = ShortestFirst::new(BOUND);
        queue.push(0, "large", t0, 20_000.0);
        let mut clock = t0;
        let mut id = 1;
        let sent = loop {
            // A small request arrives just before every slot frees and would overtake forever.
            queue.push(id, "small", clock + ms(19), 250.0);
            id += 1;
            clock += ms(20); // the slot is busy with a 20 ms call
            match queue.pop(clock, 1) {
                Some((_, "large")) => break clock,
                Some(_) => {}
                None => panic!("empty"),
            }
            assert!(clock - t0 < ms(500), "the large request starved");
        };
        assert_eq!(sent - t0, ms(40));
        assert!(sent - t0 <= BOUND);
    }

    #[test]
    fn the_slack_gives_up_at_most_half_the_bound() {
        let t0 = Instant::now();
        let mut queue: ShortestFirst<&str> = ShortestFirst::new(BOUND);
        assert_eq!(queue.slack(), BOUND);
        queue.push(1, "small", t0, 250.0);
        assert_eq!(queue.slack(), BOUND - Duration::from_micros(250));
        queue.push(2, "huge", t0, 10_000_000.0);
        assert_eq!(queue.slack(), BOUND / 2);
        queue.remove(2);
        assert_eq!(queue.slack(), BOUND - Duration::from_micros(250));
    }

    /// A discrete-event run: `servers` workers, each taking the queue's next request the
    /// moment it frees, every call lasting exactly its expected cost. `arrivals`: (offset,
    /// µs, label), in time order. Returns (label, wait) in the order sent.
    fn simulate(
        arrivals: &[(Duration, f64, &'static str)],
        servers: usize,
    ) -> Vec<(&'static str, Duration)> {
        simulate_slow(arrivals, servers, |_| 1.0)
            .into_iter()
            .map(|(label, _, wait)| (label, wait))
            .collect()
    }

    fn median(waits: impl Iterator<Item = Duration>) -> Duration {
        let mut waits: Vec<_> = waits.collect();
        waits.sort();
        waits[waits.len() / 2]
    }

    /// `simulate` with every call lasting `overrun` times its expected cost; returns (label,
    /// when sent, wait).
    fn simulate_slow(
        arrivals: &[(Duration, f64, &'static str)],
        servers: usize,
        overrun: impl Fn(Duration) -> f64,
    ) -> Vec<(&'static str, Duration, Duration)> {
        let t0 = Instant::now();
        let mut queue = ShortestFirst::new(BOUND);
        let mut free_at = vec![t0; servers];
        let mut next = 0;
        let mut sent = Vec::new();
        loop {
            let (worker, free) = free_at
                .iter()
                .copied()
                .enumerate()
                .min_by_key(|&(_, at)| at)
                .expect("servers > 0");
            while next < arrivals.len() && t0 + arrivals[next].0 <= free {
                let (offset, cost, label) = arrivals[next];
                queue.push(next as u64, (label, t0 + offset, cost), t0 + offset, cost);
                next += 1;
            }
            let Some((_, (label, arrived, cost))) = queue.pop(free, servers) else {
                if next == arrivals.len() {
                    return sent;
                }
                free_at[worker] = t0 + arrivals[next].0; // idle until the next arrival
                continue;
            };
            sent.push((label, free - t0, free - arrived));
            free_at[worker] = free + Duration::from_secs_f64(cost * overrun(free - t0) / 1e6);
        }
    }

    /// Every 100 ms a run of eight large requests and 60 ms of small ones at what the
    /// estimates say is 70% of two workers, then 40 ms of them at 20%; calls take
    /// `overrun(since start)` times their estimates. Returns (label, when sent, wait).
    fn runs_of_large_requests(
        phases: u64,
        overrun: impl Fn(Duration) -> f64,
    ) -> Vec<(&'static str, Duration, Duration)> {
        let mut arrivals = Vec::new();
        for phase in 0..phases {
            let start = ms(100 * phase);
            for _ in 0..8 {
                arrivals.push((start, 2000.0, "large"));
            }
            let mut at = start;
            while at < start + ms(100) {
                arrivals.push((at, 250.0, "small"));
                // 2 workers × 0.7 / 250 µs (estimated), then 2 × 0.2 / 250 µs.
                at += if at < start + ms(60) {
                    us(179)
                } else {
                    us(625)
                };
            }
        }
        let sent = simulate_slow(&arrivals, 2, overrun);
        assert_eq!(sent.len(), arrivals.len());
        sent
    }

    /// How many of `sent` were sent in [from, to) after waiting longer than the bound.
    fn late(sent: &[(&str, Duration, Duration)], from: Duration, to: Duration) -> usize {
        sent.iter()
            .filter(|&&(_, when, wait)| when >= from && when < to && wait > BOUND)
            .count()
    }

    /// Calls 1.5× slower than their estimates (a machine busier than when they were learned;
    /// 105% of the workers in fact): the work counted ahead of the last large requests of a
    /// run falls short, and without a margin every run would send one past the bound. The
    /// first run's overruns teach the margin, and later runs are sent within it.
    #[test]
    fn calls_slower_than_their_estimates_teach_a_margin_that_keeps_the_bound() {
        let sent = runs_of_large_requests(30, |_| 1.5);
        assert!(
            late(&sent, ms(0), ms(100)) > 0,
            "no request was late at first"
        );
        assert_eq!(
            late(&sent, ms(100), ms(3000)),
            0,
            "late after the first run"
        );
        // And shortest-first still did its work: the small ones did not wait for the large.
        let small = median(sent.iter().filter(|(l, _, _)| *l == "small").map(|s| s.2));
        assert!(small < ms(5), "{small:?}");
    }

    /// The margin is learned from near misses, not only from requests sent late: calls 1.4×
    /// their estimates from a cold start send the first run's last large request past the
    /// bound; after a second of calls 1.3× their estimates — no request late, but plans
    /// overrun — the same 1.4× runs are all sent within it.
    #[test]
    fn near_misses_teach_the_margin_before_a_request_is_late() {
        let cold = runs_of_large_requests(10, |_| 1.4);
        assert!(
            late(&cold, ms(0), ms(100)) > 0,
            "the cold start was not late"
        );
        let warm = runs_of_large_requests(20, |t| if t < ms(1000) { 1.3 } else { 1.4 });
        assert_eq!(late(&warm, ms(0), ms(2000)), 0);
    }

    #[test]
    fn the_margin_is_the_largest_overrun_capped_and_fading() {
        let t0 = Instant::now();
        let mut queue: ShortestFirst<&str> = ShortestFirst::new(BOUND);
        queue.learn(t0, ms(40), ms(45)); // sent before its planned point
        assert_eq!(queue.margin(t0), Duration::ZERO);
        // Sent 4 ms after it was planned to go: within the bound, and yet learned from.
        queue.learn(t0, ms(49), ms(45));
        assert_eq!(queue.margin(t0), ms(4));
        queue.learn(t0, ms(47), ms(45)); // a smaller overrun: covered already
        assert_eq!(queue.margin(t0), ms(4));
        let later = t0 + MARGIN_HALF_LIFE;
        assert_eq!(queue.margin(later).as_micros(), 2000);
        queue.learn(later, ms(500), ms(45)); // overload: capped
        assert_eq!(queue.margin(later), BOUND / 4);
        // Subtracted from the slack: a request turns at risk that much sooner.
        queue.push(1, "large", later, 2000.0);
        queue.push(2, "small", later + ms(1), 250.0);
        let at_risk = BOUND - ms(2) - BOUND / 4; // the slack less the margin
        let before = later + at_risk - ms(1);
        assert!(!queue.at_risk(before, 1, queue.threshold(before)));
        let after = later + at_risk + us(100); // the margin fades meanwhile
        assert!(queue.at_risk(after, 1, queue.threshold(after)));
    }

    /// Two workers kept busy by small requests (104% of what they can do for 60 ms, then
    /// 50%), and a run of eight 3 ms requests arriving together at 1 ms: judged by its own
    /// wait alone each would turn urgent one call short of the bound, and the last would then
    /// wait for the seven ahead of it (56 ms).
    #[test]
    fn a_run_of_large_requests_is_sent_within_the_bound_while_the_pool_keeps_up() {
        let mut arrivals = Vec::new();
        let mut at = Duration::ZERO;
        while at < ms(200) {
            if arrivals.len() == 8 {
                for _ in 0..8 {
                    arrivals.push((at, 3000.0, "large"));
                }
            }
            arrivals.push((at, 250.0, "small"));
            arrivals.push((at, 250.0, "small"));
            at += if at < ms(60) { us(240) } else { us(500) };
        }
        let sent = simulate(&arrivals, 2);
        assert_eq!(sent.len(), arrivals.len());
        let large: Vec<_> = sent.iter().filter(|(l, _)| *l == "large").collect();
        assert_eq!(large.len(), 8);
        let longest = sent.iter().map(|&(_, wait)| wait).max().unwrap();
        assert!(longest <= BOUND, "longest wait {longest:?}");
        // And shortest-first still did its work: the large ones waited, the small ones not.
        assert!(large[0].1 > ms(20), "{:?}", large[0].1);
        let small = median(sent.iter().filter(|(l, _)| *l == "small").map(|s| s.1));
        assert!(small < ms(5), "{small:?}");
    }

    /// The adversary: one worker slot, a large request, and a small request arriving every
    /// 0.1 ms forever, each served in 0.25 ms — more small work than the slot can do, so
    /// without aging the large one would never go. With aging it is sent within the bound:
    /// the small ones pile up, the newest of them is at risk behind the older ones, and the
    /// queue goes oldest first.
    #[test]
    fn aging_bound_holds_under_an_endless_stream_of_small_requests() {
        let t0 = Instant::now();
        let mut queue = ShortestFirst::new(BOUND);
        queue.push(0, "large", t0, 100_000.0);
        let mut next_id = 1;
        let mut arrivals = t0;
        let mut clock = t0;
        let mut large_sent_at = None;
        while clock < t0 + ms(1000) {
            // Small requests that arrived by now.
            while arrivals <= clock {
                queue.push(next_id, "small", arrivals, 250.0);
                next_id += 1;
                arrivals += us(100);
            }
            let (_, what) = queue.pop(clock, 1).expect("never empty");
            if what == "large" {
                large_sent_at = Some(clock);
                break;
            }
            clock += us(250); // the slot frees after the small request's compute time
        }
        let sent = large_sent_at.expect("the large request starved");
        let waited = sent - t0;
        // 100 ms of expected compute: at most half the bound's slack, sent by the next free
        // slot after something turned at risk.
        assert!(waited <= BOUND / 2 + us(250), "waited {waited:?}");
        // Without aging (an unreachable bound) the same stream starves it.
        let mut plain = ShortestFirst::new(Duration::from_secs(3600));
        plain.push(0, "large", t0, 100_000.0);
        for id in 1..10_000u64 {
            plain.push(id, "small", t0 + us(id * 100), 250.0);
            assert_eq!(
                plain.pop(t0 + us(id * 100), 1).map(|(_, w)| w),
                Some("small")
            );
        }
    }

    #[test]
    fn a_backlog_longer_than_the_scan_goes_oldest_first() {
        let t0 = Instant::now();
        let mut queue = ShortestFirst::new(BOUND);
        queue.push(0, "oldest", t0, 10.0);
        for id in 1..=SCAN_LIMIT as u64 {
            queue.push(id, "tiny", t0 + us(1), 0.0);
        }
        assert_eq!(queue.pop(t0 + ms(1), 1), Some((0, "oldest")));
        assert_eq!(queue.pop(t0 + ms(1), 1).map(|(_, w)| w), Some("tiny"));
    }
}
