//! The front door's view of its workers: who is registered, who is alive, what each has in
//! flight. Pure bookkeeping, time passed in (no sockets, no clock of its own), so the rules
//! are testable alone:
//! - a worker is routable from its READY until it says BYE, goes silent for longer than the
//!   liveness window (the Paranoid Pirate rule: any message refreshes it), or the controller
//!   reports its process gone;
//! - when a worker leaves for any of those reasons, every request it had in flight is handed
//!   back as lost, which the caller retries on another worker: inference is idempotent, and
//!   the alternative (losing the request) is worse;
//! - a new incarnation of a slot replaces the old one (keyed by slot, never by pid).

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use crate::policies::Choose;
use crate::versions::Servable;

/// The pace at which a worker is taken to get through the bytes it was sent without a word
/// (`WorkerTable::expire`): a third of the slowest copy measured, so a 1 GiB request adds
/// about 11 s to the liveness window and a 64 KiB one 0.6 ms.
const IN_FLIGHT_GRACE_BYTES_PER_S: f64 = 100e6;
/// The most a request's size widens the window (a 2 GiB request would take 21 s).
const MAX_IN_FLIGHT_GRACE: Duration = Duration::from_secs(30);

pub struct WorkerHandle<P> {
    pub slot: String,
    pub pid: i64,
    /// The model and version it serves (from its READY).
    pub servable: Servable,
    pub identity: Vec<u8>,
    pub last_seen: Instant,
    /// Request id → what waits for its answer.
    pub inflight: HashMap<u64, P>,
    pub answered: u64,
    /// Where its variables live, as the worker reported it in READY.
    pub weights: rmpv::Value,
}

/// A worker left; `pending` are the requests it had in flight, to retry elsewhere.
pub struct Departure<P> {
    pub slot: String,
    pub pid: i64,
    pub reason: String,
    pub pending: Vec<P>,
    /// It said BYE: it stopped taking work and left in order, so a request it held says
    /// nothing about that request. Otherwise (its connection broke, it went silent, its slot
    /// came back in a new process, the controller saw it exit) the request it held may be
    /// what ended it.
    pub orderly: bool,
}

pub struct WorkerTable<P> {
    pub timeout: Duration,
    /// Which of the workers with room takes a request (`--dispatch`).
    chooser: Box<dyn Choose>,
    by_identity: HashMap<Vec<u8>, WorkerHandle<P>>,
    /// slot → identity, in slot order (the routing order).
    by_slot: BTreeMap<String, Vec<u8>>,
    /// Per slot, the requests answered by its workers that have left: with the current
    /// one's, what `mpspool status` shows as the slot's served (`served`).
    departed_answered: BTreeMap<String, u64>,
    /// Incarnations declared dead by silence, per slot, until the slot registers anew: the
    /// controller reads these and replaces the process.
    pub declared_dead: BTreeMap<String, i64>,
}

impl<P> WorkerTable<P> {
    pub fn new(timeout: Duration, chooser: Box<dyn Choose>) -> WorkerTable<P> {
        WorkerTable {
            timeout,
            chooser,
            by_identity: HashMap::new(),
            by_slot: BTreeMap::new(),
            departed_answered: BTreeMap::new(),
            declared_dead: BTreeMap::new(),
        }
    }

    // -- membership ---------------------------------------------------------------
    /// A READY worker; the departure of the slot's previous incarnation, if any.
    pub fn register(
        &mut self,
        identity: &[u8],
        slot: &str,
        pid: i64,
        servable: Servable,
        weights: rmpv::Value,
        now: Instant,
    ) -> Option<Departure<P>> {
        let mut replaced = None;
        if let Some(old) = self.by_slot.get(slot).cloned() {
            if old != identity {
                replaced = self.drop_identity(
                    &old,
                    format!("slot {slot} re-registered by pid {pid}"),
                    false,
                );
            }
        }
        let handle = self
            .by_identity
            .entry(identity.to_vec())
            .or_insert_with(|| WorkerHandle {
                slot: slot.to_string(),
                pid,
                servable,
                identity: identity.to_vec(),
                last_seen: now,
                inflight: HashMap::new(),
                answered: 0,
                weights: rmpv::Value::Nil,
            });
        handle.last_seen = now;
        handle.servable = servable;
        handle.weights = weights;
        self.by_slot.insert(slot.to_string(), identity.to_vec());
        if self.declared_dead.get(slot) != Some(&pid) {
            self.declared_dead.remove(slot);
        }
        replaced
    }

    /// Refresh liveness on any message; None for an identity that is not registered.
    pub fn seen(&mut self, identity: &[u8], now: Instant) -> Option<&mut WorkerHandle<P>> {
        let handle = self.by_identity.get_mut(identity)?;
        handle.last_seen = now;
        Some(handle)
    }

    /// A worker gone without saying BYE (its connection broke).
    pub fn leave(&mut self, identity: &[u8], reason: &str) -> Option<Departure<P>> {
        self.drop_identity(identity, reason.to_string(), false)
    }

    /// A worker that said BYE: it leaves in order.
    pub fn bye(&mut self, identity: &[u8]) -> Option<Departure<P>> {
        self.drop_identity(identity, "said bye".to_string(), true)
    }

    /// The controller saw the process of (slot, pid) exit, or is stopping it. `blameless`:
    /// it goes for a reason that is not its requests' doing (its GPU restarts after a fault),
    /// so they are sent again as after an orderly leave, not counted towards MAX_SENDS.
    pub fn gone(&mut self, slot: &str, pid: i64, blameless: bool) -> Option<Departure<P>> {
        let identity = self.by_slot.get(slot)?.clone();
        if self.by_identity.get(&identity).map(|h| h.pid) != Some(pid) {
            return None;
        }
        self.drop_identity(
            &identity,
            format!("process {pid} of slot {slot} exited"),
            blameless,
        )
    }

    /// Declare dead every worker silent for longer than the liveness window, widened for the
    /// largest request it holds (`bytes_of`, at `IN_FLIGHT_GRACE_BYTES_PER_S`, at most
    /// `MAX_IN_FLIGHT_GRACE`): TensorFlow copies a request's inputs into its tensors holding
    /// Python's GIL, so a worker given a 1 GiB input beats from no thread for seconds
    /// (1.6-3.3 s per GiB on the 2-core machine) and would be declared dead, killed, and its
    /// request retried on the next worker, to the same end. The largest, not the sum: a worker
    /// copies one request at a time and beats between them, and a sum would let a hung worker
    /// that keeps being sent requests stay alive.
    pub fn expire(&mut self, now: Instant, bytes_of: impl Fn(&P) -> u64) -> Vec<Departure<P>> {
        let silent: Vec<(Vec<u8>, Duration)> = self
            .by_identity
            .values()
            .filter_map(|h| {
                let quiet = now.saturating_duration_since(h.last_seen);
                let largest = h.inflight.values().map(&bytes_of).max().unwrap_or(0);
                let grace = Duration::from_secs_f64(largest as f64 / IN_FLIGHT_GRACE_BYTES_PER_S)
                    .min(MAX_IN_FLIGHT_GRACE);
                (quiet > self.timeout + grace).then(|| (h.identity.clone(), quiet))
            })
            .collect();
        let mut gone = Vec::new();
        for (identity, quiet) in silent {
            if let Some(handle) = self.by_identity.get(&identity) {
                self.declared_dead.insert(handle.slot.clone(), handle.pid);
            }
            if let Some(departure) = self.drop_identity(
                &identity,
                format!("silent for {:.1} s", quiet.as_secs_f64()),
                false,
            ) {
                gone.push(departure);
            }
        }
        gone
    }

    fn drop_identity(
        &mut self,
        identity: &[u8],
        reason: String,
        orderly: bool,
    ) -> Option<Departure<P>> {
        let handle = self.by_identity.remove(identity)?;
        if self.by_slot.get(&handle.slot).map(Vec::as_slice) == Some(identity) {
            self.by_slot.remove(&handle.slot);
        }
        *self
            .departed_answered
            .entry(handle.slot.clone())
            .or_insert(0) += handle.answered;
        Some(Departure {
            slot: handle.slot,
            pid: handle.pid,
            reason,
            pending: handle.inflight.into_values().collect(),
            orderly,
        })
    }

    // -- routing ------------------------------------------------------------------
    pub fn ready(&self) -> usize {
        self.by_slot.len()
    }

    /// Routable workers of one model version.
    pub fn ready_of(&self, servable: Servable) -> usize {
        (self.by_slot.values())
            .filter_map(|identity| self.by_identity.get(identity))
            .filter(|handle| handle.servable == servable)
            .count()
    }

    /// Routable workers per model version.
    pub fn ready_by_servable(&self) -> BTreeMap<Servable, usize> {
        let mut counts = BTreeMap::new();
        for identity in self.by_slot.values() {
            if let Some(handle) = self.by_identity.get(identity) {
                *counts.entry(handle.servable).or_insert(0) += 1;
            }
        }
        counts
    }

    /// Whether any routable worker has fewer than `limit` requests in flight (0: no limit).
    pub fn has_room(&self, limit: usize) -> bool {
        self.by_slot.values().any(|identity| {
            self.by_identity
                .get(identity)
                .is_some_and(|h| limit == 0 || h.inflight.len() < limit)
        })
    }

    /// The worker of `servable` for the next request, among those with fewer than `limit`
    /// requests in flight (0: no limit); None when none is routable or every one is full.
    pub fn pick(&mut self, limit: usize, servable: Servable) -> Option<&mut WorkerHandle<P>> {
        let mut candidates: Vec<&Vec<u8>> = Vec::with_capacity(self.by_slot.len());
        let mut inflight: Vec<usize> = Vec::with_capacity(self.by_slot.len());
        for identity in self.by_slot.values() {
            let Some(handle) = self.by_identity.get(identity) else {
                continue;
            };
            if handle.servable != servable {
                continue;
            }
            let load = handle.inflight.len();
            if limit == 0 || load < limit {
                candidates.push(identity);
                inflight.push(load);
            }
        }
        if candidates.is_empty() {
            return None;
        }
        let index = self.chooser.choose(&inflight).min(candidates.len() - 1);
        let identity = candidates[index].clone();
        self.by_identity.get_mut(&identity)
    }

    pub fn get_mut(&mut self, identity: &[u8]) -> Option<&mut WorkerHandle<P>> {
        self.by_identity.get_mut(identity)
    }

    /// Take what waits for a request's answer; None when nobody does any more (a late reply
    /// after a retry or a timeout, which the caller drops).
    pub fn resolve(&mut self, identity: &[u8], request_id: u64) -> Option<P> {
        let handle = self.by_identity.get_mut(identity)?;
        let pending = handle.inflight.remove(&request_id)?;
        handle.answered += 1;
        Some(pending)
    }

    /// Per routable slot, the bytes of shared weights its worker reported TensorFlow copied
    /// into it (READY's `weights.copied`, variable name → bytes; 0 when it shares them all).
    pub fn copied_bytes(&self) -> std::collections::BTreeMap<String, u64> {
        self.by_slot
            .iter()
            .filter_map(|(slot, identity)| self.by_identity.get(identity).map(|h| (slot, h)))
            .map(|(slot, h)| {
                let copied = h.weights.as_map().and_then(|fields| {
                    fields
                        .iter()
                        .find(|(k, _)| k.as_str() == Some("copied"))
                        .map(|(_, v)| v)
                });
                let bytes = copied
                    .and_then(rmpv::Value::as_map)
                    .map(|entries| entries.iter().filter_map(|(_, v)| v.as_u64()).sum())
                    .unwrap_or(0);
                (slot.clone(), bytes)
            })
            .collect()
    }

    pub fn inflight_total(&self) -> usize {
        self.by_identity.values().map(|h| h.inflight.len()).sum()
    }

    /// The controller's slots are now `slots` (it lists every slot it has at each change):
    /// what is kept of those it no longer has is forgotten, so that the table does not grow
    /// with every version a long-lived pool ever loaded. Their answered counts (a slot whose
    /// model is removed and added again counts from 0, not from what its old workers
    /// answered), and their incarnations declared dead (one declared dead while its version
    /// retired was never replaced, so never registered again, and stayed in every snapshot;
    /// found by a hunt).
    pub fn forget_slots_not_in<'a>(&mut self, slots: impl IntoIterator<Item = &'a str>) {
        let kept: std::collections::BTreeSet<&str> = slots.into_iter().collect();
        self.departed_answered
            .retain(|slot, _| kept.contains(slot.as_str()));
        self.declared_dead
            .retain(|slot, _| kept.contains(slot.as_str()));
    }

    /// Per slot, every request its workers answered since this front door started, those
    /// that left included: the controller polls it, and a worker's last answers before it
    /// died would be missed by a poll of the current worker's count alone.
    pub fn served(&self) -> rmpv::Value {
        let mut served = self.departed_answered.clone();
        for handle in self.by_identity.values() {
            *served.entry(handle.slot.clone()).or_insert(0) += handle.answered;
        }
        rmpv::Value::Map(
            served
                .into_iter()
                .map(|(slot, n)| (rmpv::Value::from(slot), rmpv::Value::from(n)))
                .collect(),
        )
    }

    /// Per slot: pid, inflight, answered, silent_s, weights (what `mpspool status` shows).
    pub fn snapshot(&self, now: Instant) -> rmpv::Value {
        let entries = self
            .by_slot
            .iter()
            .filter_map(|(slot, identity)| self.by_identity.get(identity).map(|h| (slot, h)))
            .map(|(slot, h)| {
                let silent = now.saturating_duration_since(h.last_seen).as_secs_f64();
                let fields = vec![
                    (rmpv::Value::from("pid"), rmpv::Value::from(h.pid)),
                    (
                        rmpv::Value::from("version"),
                        rmpv::Value::from(h.servable.version),
                    ),
                    (
                        rmpv::Value::from("inflight"),
                        rmpv::Value::from(h.inflight.len() as u64),
                    ),
                    (rmpv::Value::from("answered"), rmpv::Value::from(h.answered)),
                    (
                        rmpv::Value::from("silent_s"),
                        rmpv::Value::from((silent * 1000.0).round() / 1000.0),
                    ),
                    (rmpv::Value::from("weights"), h.weights.clone()),
                ];
                (rmpv::Value::from(slot.as_str()), rmpv::Value::Map(fields))
            })
            .collect();
        rmpv::Value::Map(entries)
    }
}

#[cfg(test)]
mod tests {
    //! The rules of router/workers.py's tests, on a fake clock (`now` passed in). A pending
    //! request is a number; "handed back" means it came out in a Departure.

    use super::*;

    /// The one model's version 1.
    const V1: Servable = Servable {
        model: 0,
        version: 1,
    };

    type Table = WorkerTable<u32>;
    const TIMEOUT: Duration = Duration::from_secs(3);

    fn table(policy: &str) -> (Table, Instant) {
        let chooser = crate::policies::chooser(policy).expect("a known policy");
        (WorkerTable::new(TIMEOUT, chooser), Instant::now())
    }

    fn ident(slot: &str, pid: i64) -> Vec<u8> {
        format!("{slot}:{pid}").into_bytes()
    }

    fn join(t: &mut Table, slot: &str, pid: i64, now: Instant) -> Option<Departure<u32>> {
        t.register(&ident(slot, pid), slot, pid, V1, rmpv::Value::Nil, now)
    }

    /// What the dispatcher does before sending: park the request on the worker.
    fn send(t: &mut Table, slot: &str, pid: i64, request: u32) {
        let handle = t.get_mut(&ident(slot, pid)).expect("registered");
        handle.inflight.insert(u64::from(request), request);
    }

    fn slots(t: &mut Table, n: usize) -> Vec<String> {
        (0..n)
            .map(|_| t.pick(0, V1).unwrap().slot.clone())
            .collect()
    }

    fn sorted(mut pending: Vec<u32>) -> Vec<u32> {
        pending.sort_unstable();
        pending
    }

    // -- membership ---------------------------------------------------------------

    #[test]
    fn register_makes_a_worker_routable() {
        let (mut t, now) = table("round-robin");
        assert_eq!(t.ready(), 0);
        assert!(t.pick(0, V1).is_none());
        assert!(join(&mut t, "cpu-0", 101, now).is_none());
        assert_eq!(t.ready(), 1);
        let handle = t.pick(0, V1).unwrap();
        assert_eq!(
            (handle.slot.as_str(), handle.pid, handle.identity.clone()),
            ("cpu-0", 101, ident("cpu-0", 101))
        );
        assert_eq!(handle.last_seen, now);
    }

    #[test]
    fn seen_refreshes_liveness_and_ignores_strangers() {
        let (mut t, now) = table("round-robin");
        join(&mut t, "cpu-0", 101, now);
        let later = now + Duration::from_secs(2);
        assert_eq!(
            t.seen(&ident("cpu-0", 101), later).map(|h| h.last_seen),
            Some(later)
        );
        assert!(t.seen(&ident("cpu-0", 999), later).is_none());
        assert!(t.seen(b"nobody", later).is_none());
    }

    #[test]
    fn registering_again_with_the_same_identity_keeps_the_handle_and_its_requests() {
        // A worker answering REREGISTER sends READY again from the same incarnation.
        let (mut t, now) = table("round-robin");
        join(&mut t, "cpu-0", 101, now);
        send(&mut t, "cpu-0", 101, 1);
        let later = now + Duration::from_secs(1);
        assert!(join(&mut t, "cpu-0", 101, later).is_none());
        assert_eq!(t.get_mut(&ident("cpu-0", 101)).unwrap().last_seen, later);
        assert_eq!(t.resolve(&ident("cpu-0", 101), 1), Some(1));
    }

    #[test]
    fn leave_hands_back_the_requests_in_flight() {
        let (mut t, now) = table("round-robin");
        join(&mut t, "cpu-0", 101, now);
        join(&mut t, "cpu-1", 102, now);
        send(&mut t, "cpu-0", 101, 1);
        send(&mut t, "cpu-0", 101, 2);
        send(&mut t, "cpu-1", 102, 3);
        let left = t.bye(&ident("cpu-0", 101)).unwrap();
        assert_eq!((left.slot.as_str(), left.pid), ("cpu-0", 101));
        assert_eq!(left.reason, "said bye");
        assert!(left.orderly);
        assert_eq!(sorted(left.pending), vec![1, 2]);
        // A worker leaving does not touch another worker's requests.
        assert_eq!(t.inflight_total(), 1);
        assert_eq!(slots(&mut t, 2), ["cpu-1", "cpu-1"]);
        assert!(t.leave(&ident("cpu-0", 101), "again").is_none());
        // Gone without a BYE: not in order.
        let broken = t
            .leave(&ident("cpu-1", 102), "its connection closed")
            .unwrap();
        assert!(!broken.orderly);
        assert_eq!(broken.pending, vec![3]);
    }

    #[test]
    fn gone_drops_only_the_named_incarnation() {
        let (mut t, now) = table("round-robin");
        join(&mut t, "cpu-0", 101, now);
        send(&mut t, "cpu-0", 101, 1);
        // The controller reports an older pid of the slot (already replaced): ignored.
        assert!(t.gone("cpu-0", 100, false).is_none());
        assert!(t.gone("cpu-9", 101, false).is_none());
        assert_eq!(t.inflight_total(), 1);
        let gone = t.gone("cpu-0", 101, false).unwrap();
        assert_eq!(gone.pid, 101);
        assert!(gone.reason.contains("exited"), "{}", gone.reason);
        assert!(!gone.orderly);
        assert_eq!(gone.pending, vec![1]);
        // Stopped by the controller for its GPU's fault: its requests are not counted
        // against (sent again as after an orderly leave).
        join(&mut t, "cpu-1", 102, now);
        send(&mut t, "cpu-1", 102, 2);
        assert!(t.gone("cpu-1", 102, true).unwrap().orderly);
        assert_eq!(t.ready(), 0);
        assert!(t.pick(0, V1).is_none());
        // An exit is not a liveness verdict.
        assert!(t.declared_dead.is_empty());
    }

    #[test]
    fn a_new_incarnation_replaces_the_old_one_and_hands_back_its_requests() {
        let (mut t, now) = table("round-robin");
        join(&mut t, "cpu-0", 101, now);
        send(&mut t, "cpu-0", 101, 1);
        let replaced = join(&mut t, "cpu-0", 202, now).unwrap();
        assert_eq!(replaced.pid, 101);
        assert!(replaced.reason.contains("re-registered by pid 202"));
        assert_eq!(replaced.pending, vec![1]);
        assert_eq!(t.ready(), 1);
        assert_eq!(t.pick(0, V1).unwrap().identity, ident("cpu-0", 202));
        assert!(
            t.seen(&ident("cpu-0", 101), now).is_none(),
            "the old incarnation is forgotten"
        );
        // A late reply from the old process is dropped, not delivered to anyone.
        assert_eq!(t.resolve(&ident("cpu-0", 101), 1), None);
        // And a late "gone" for the old pid does not remove the new incarnation.
        assert!(t.gone("cpu-0", 101, false).is_none());
        assert_eq!(t.pick(0, V1).unwrap().pid, 202);
    }

    // -- liveness -----------------------------------------------------------------

    #[test]
    fn expire_declares_silent_workers_dead_and_hands_back_their_requests() {
        let (mut t, now) = table("round-robin");
        join(&mut t, "cpu-0", 101, now);
        join(&mut t, "cpu-1", 102, now);
        send(&mut t, "cpu-0", 101, 1);
        send(&mut t, "cpu-1", 102, 2);

        let window = now + TIMEOUT; // exactly the window: still alive
        t.seen(&ident("cpu-1", 102), window);
        assert!(t.expire(window, |_| 0).is_empty());

        let past = window + Duration::from_millis(500);
        t.seen(&ident("cpu-1", 102), past);
        let expired = t.expire(past, |_| 0);
        assert_eq!(expired.len(), 1);
        assert_eq!((expired[0].slot.as_str(), expired[0].pid), ("cpu-0", 101));
        assert_eq!(expired[0].reason, "silent for 3.5 s");
        assert_eq!(expired[0].pending, vec![1]);
        assert_eq!(
            t.declared_dead,
            BTreeMap::from([("cpu-0".to_string(), 101)])
        );
        assert_eq!(slots(&mut t, 2), ["cpu-1", "cpu-1"]);
        assert!(t.expire(past, |_| 0).is_empty(), "declared once, not again");
        assert_eq!(t.declared_dead.len(), 1);
        assert_eq!(t.resolve(&ident("cpu-1", 102), 2), Some(2));
    }

    #[test]
    fn the_bytes_a_worker_holds_widen_its_window() {
        let (mut t, now) = table("round-robin");
        join(&mut t, "cpu-0", 101, now);
        join(&mut t, "cpu-1", 102, now);
        send(&mut t, "cpu-0", 101, 1); // request 1: a GB of inputs, 10 s at 100 MB/s
        send(&mut t, "cpu-1", 102, 2); // requests 2, 3, 4: 200 MB each, 2 s
        send(&mut t, "cpu-1", 102, 3);
        send(&mut t, "cpu-1", 102, 4);
        let bytes_of = |request: &u32| {
            if *request == 1 {
                1_000_000_000
            } else {
                200_000_000
            }
        };
        // The largest request counts, not the sum: requests sent to a hung worker do not
        // keep it alive.
        let gone = t.expire(now + TIMEOUT + Duration::from_millis(2100), bytes_of);
        assert_eq!(gone.iter().map(|d| d.pid).collect::<Vec<_>>(), [102]);
        assert!(t
            .expire(now + TIMEOUT + Duration::from_secs(9), bytes_of)
            .is_empty());
        let gone = t.expire(now + TIMEOUT + Duration::from_secs(11), bytes_of);
        assert_eq!(gone.iter().map(|d| d.pid).collect::<Vec<_>>(), [101]);

        // However large the request, at most MAX_IN_FLIGHT_GRACE.
        join(&mut t, "cpu-2", 103, now);
        send(&mut t, "cpu-2", 103, 5);
        let huge = |_: &u32| u64::MAX;
        let later = now + TIMEOUT + MAX_IN_FLIGHT_GRACE;
        assert!(t.expire(later, huge).is_empty());
        let gone = t.expire(later + Duration::from_millis(100), huge);
        assert_eq!(gone.iter().map(|d| d.pid).collect::<Vec<_>>(), [103]);
    }

    #[test]
    fn declared_dead_is_kept_until_the_slot_registers_a_new_pid() {
        let (mut t, now) = table("round-robin");
        join(&mut t, "cpu-0", 101, now);
        let later = now + TIMEOUT + Duration::from_secs(1);
        assert_eq!(t.expire(later, |_| 0).len(), 1);
        let verdict = BTreeMap::from([("cpu-0".to_string(), 101)]);
        assert_eq!(t.declared_dead, verdict);
        // The dead incarnation registering again (the dispatcher refuses this, but the table
        // must not forget the verdict either way).
        join(&mut t, "cpu-0", 101, later);
        assert_eq!(t.declared_dead, verdict);
        t.leave(&ident("cpu-0", 101), "test");
        // Its replacement clears the verdict.
        join(&mut t, "cpu-0", 202, later);
        assert!(t.declared_dead.is_empty());
    }

    #[test]
    fn silence_declares_dead_until_the_slot_registers_anew() {
        let (mut t, now) = table("round-robin");
        join(&mut t, "cpu-0", 10, now);
        join(&mut t, "cpu-1", 11, now);
        t.seen(b"cpu-1:11", now + Duration::from_secs(2));
        let gone = t.expire(now + Duration::from_millis(3100), |_| 0);
        assert_eq!(gone.len(), 1);
        assert_eq!(gone[0].slot, "cpu-0");
        assert_eq!(t.declared_dead.get("cpu-0"), Some(&10));
        assert_eq!(t.ready(), 1);
        join(&mut t, "cpu-0", 13, now + Duration::from_secs(4));
        assert!(t.declared_dead.is_empty());
    }

    // -- routing ------------------------------------------------------------------

    #[test]
    fn round_robin_alternates_over_slots_in_order() {
        // Registered out of order, pids in yet another order: the rotation follows slot
        // order, not arrival or pid order.
        let (mut t, now) = table("round-robin");
        join(&mut t, "cpu-2", 101, now);
        join(&mut t, "cpu-0", 303, now);
        join(&mut t, "cpu-1", 202, now);
        assert_eq!(
            slots(&mut t, 7),
            ["cpu-0", "cpu-1", "cpu-2", "cpu-0", "cpu-1", "cpu-2", "cpu-0"]
        );
        t.leave(&ident("cpu-1", 202), "bye");
        let mut picks = slots(&mut t, 4);
        assert!(picks.windows(2).all(|w| w[0] != w[1]), "{picks:?}");
        picks.sort();
        assert_eq!(picks, ["cpu-0", "cpu-0", "cpu-2", "cpu-2"]);
    }

    #[test]
    fn least_loaded_picks_the_fewest_in_flight_first_slot_among_equals() {
        let (mut t, now) = table("least-loaded");
        join(&mut t, "cpu-2", 101, now);
        join(&mut t, "cpu-0", 303, now);
        join(&mut t, "cpu-1", 202, now);
        // All idle: the first in slot order, every time (it stays warm).
        assert_eq!(slots(&mut t, 3), ["cpu-0"; 3]);
        send(&mut t, "cpu-0", 303, 1);
        assert_eq!(slots(&mut t, 1), ["cpu-1"]);
        send(&mut t, "cpu-1", 202, 2);
        send(&mut t, "cpu-1", 202, 3);
        assert_eq!(slots(&mut t, 1), ["cpu-2"]); // cpu-0 has 1, cpu-1 has 2
        send(&mut t, "cpu-2", 101, 4);
        assert_eq!(slots(&mut t, 1), ["cpu-0"]); // 1, 2, 1: first among equals
        t.resolve(&ident("cpu-1", 202), 2);
        t.resolve(&ident("cpu-1", 202), 3);
        assert_eq!(slots(&mut t, 1), ["cpu-1"]); // idle again
    }

    #[test]
    fn policies_are_named_as_the_configuration_names_them() {
        for name in crate::policies::CHOOSERS {
            assert!(crate::policies::chooser(name).is_some(), "{name}");
        }
        assert!(crate::policies::chooser("random").is_none());
    }

    #[test]
    fn a_request_goes_only_to_workers_of_its_model_and_version() {
        let (mut t, now) = table("round-robin");
        let servable = |model, version| Servable { model, version };
        join(&mut t, "cpu-0@1", 101, now);
        for (slot, pid, model) in [
            ("cpu-0@2", 201, 0),
            ("cpu-1@2", 202, 0),
            ("r/cpu-0@2", 301, 1),
        ] {
            let at = servable(model, 2);
            t.register(&ident(slot, pid), slot, pid, at, rmpv::Value::Nil, now);
        }
        assert_eq!(
            t.ready_by_servable(),
            BTreeMap::from([(V1, 1), (servable(0, 2), 2), (servable(1, 2), 1)])
        );
        for _ in 0..4 {
            assert_eq!(t.pick(0, V1).unwrap().servable, V1);
            assert_eq!(t.pick(0, servable(0, 2)).unwrap().servable, servable(0, 2));
            // Another model's version 2 is another group of workers.
            assert_eq!(t.pick(0, servable(1, 2)).unwrap().slot, "r/cpu-0@2");
        }
        assert!(t.pick(0, servable(0, 3)).is_none());
        assert!(t.pick(0, servable(1, 1)).is_none());
        t.leave(&ident("cpu-0@1", 101), "bye");
        assert_eq!(
            t.ready_by_servable(),
            BTreeMap::from([(servable(0, 2), 2), (servable(1, 2), 1)])
        );
        assert!(t.pick(0, V1).is_none());
    }

    #[test]
    fn a_full_worker_is_skipped_and_none_is_picked_when_all_are_full() {
        let (mut t, now) = table("round-robin");
        join(&mut t, "cpu-0", 1, now);
        join(&mut t, "cpu-1", 2, now);
        send(&mut t, "cpu-0", 1, 1);
        // Limit 1: only cpu-1 has room, whatever the turn says.
        for _ in 0..3 {
            assert_eq!(t.pick(1, V1).unwrap().slot, "cpu-1");
        }
        send(&mut t, "cpu-1", 2, 2);
        assert!(t.pick(1, V1).is_none());
        assert!(!t.has_room(1) && t.has_room(2) && t.has_room(0));
        assert!(t.pick(2, V1).is_some());
        assert!(t.pick(0, V1).is_some()); // no limit
        t.resolve(&ident("cpu-0", 1), 1);
        assert_eq!(t.pick(1, V1).unwrap().slot, "cpu-0");
    }

    /// What a slot served counts its departed workers' answers too: the controller's poll of
    /// the current worker alone missed those after its last look (166 of 19,114 requests in
    /// three kills under load).
    #[test]
    fn served_counts_a_slots_departed_workers() {
        let (mut t, now) = table("round-robin");
        join(&mut t, "cpu-0", 101, now);
        for request in 1..=3 {
            send(&mut t, "cpu-0", 101, request);
            t.resolve(&ident("cpu-0", 101), u64::from(request));
        }
        assert!(t.leave(&ident("cpu-0", 101), "killed").is_some());
        join(&mut t, "cpu-0", 102, now);
        send(&mut t, "cpu-0", 102, 4);
        t.resolve(&ident("cpu-0", 102), 4);
        join(&mut t, "cpu-1", 103, now);
        assert_eq!(
            serde_json::to_value(t.served()).unwrap(),
            serde_json::json!({"cpu-0": 4, "cpu-1": 0})
        );
    }

    /// A slot the controller no longer lists (its version ended, its model was removed)
    /// is forgotten: a model added again under the same slot counts from 0, and a pool that
    /// rolls versions for months does not keep a count per version it ever loaded.
    #[test]
    fn what_is_kept_of_slots_the_controller_no_longer_has_is_forgotten() {
        let (mut t, now) = table("round-robin");
        for (slot, pid) in [("cpu-0@1", 101), ("cpu-0@2", 102)] {
            join(&mut t, slot, pid, now);
            send(&mut t, slot, pid, pid as u32);
            t.resolve(&ident(slot, pid), pid as u64);
            assert!(t.leave(&ident(slot, pid), "version ended").is_some());
        }
        assert_eq!(
            serde_json::to_value(t.served()).unwrap(),
            serde_json::json!({"cpu-0@1": 1, "cpu-0@2": 1})
        );
        // A worker of each of two versions declared dead by silence.
        join(&mut t, "cpu-0@1", 104, now);
        join(&mut t, "cpu-0@3", 105, now);
        assert_eq!(t.expire(now + TIMEOUT * 2, |_| 0).len(), 2);
        assert_eq!(t.declared_dead.len(), 2);
        t.forget_slots_not_in(["cpu-0@2", "cpu-0@3"]);
        assert_eq!(
            serde_json::to_value(t.served()).unwrap(),
            serde_json::json!({"cpu-0@2": 1, "cpu-0@3": 0})
        );
        // The slot the controller still has keeps its dead incarnation (it replaces it).
        assert_eq!(
            t.declared_dead,
            BTreeMap::from([("cpu-0@3".to_string(), 105)])
        );
        t.forget_slots_not_in([]);
        assert!(t.declared_dead.is_empty());
        join(&mut t, "cpu-0@2", 103, now);
        assert_eq!(
            serde_json::to_value(t.served()).unwrap(),
            serde_json::json!({"cpu-0@2": 0})
        );
    }

    #[test]
    fn resolve_completes_once_and_refuses_unknown_or_late_replies() {
        let (mut t, now) = table("round-robin");
        join(&mut t, "cpu-0", 101, now);
        let a = ident("cpu-0", 101);
        send(&mut t, "cpu-0", 101, 1);
        send(&mut t, "cpu-0", 101, 2);
        assert_eq!(t.resolve(&a, 1), Some(1));
        assert_eq!(t.resolve(&a, 1), None, "a duplicate");
        assert_eq!(t.resolve(&a, 77), None, "never asked");
        assert_eq!(t.resolve(b"stranger", 2), None);
        assert_eq!(t.resolve(&a, 2), Some(2)); // an error answer is resolved the same way
        let handle = t.get_mut(&a).unwrap();
        assert_eq!(handle.answered, 2);
        assert!(handle.inflight.is_empty());
        // The caller gave up (deadline) and its entry was removed: the reply comes late.
        send(&mut t, "cpu-0", 101, 3);
        t.get_mut(&a).unwrap().inflight.remove(&3);
        assert_eq!(t.resolve(&a, 3), None);
        assert_eq!(t.get_mut(&a).unwrap().answered, 2);
        assert_eq!(t.inflight_total(), 0);
    }

    #[test]
    fn snapshot_reports_each_slot() {
        let (mut t, now) = table("round-robin");
        join(&mut t, "cpu-0", 101, now);
        send(&mut t, "cpu-0", 101, 1);
        send(&mut t, "cpu-0", 101, 2);
        let then = now + Duration::from_millis(250);
        join(&mut t, "cpu-1", 102, then);
        send(&mut t, "cpu-1", 102, 3);
        assert_eq!(t.resolve(&ident("cpu-1", 102), 3), Some(3));
        let later = then + Duration::from_millis(1500);
        t.seen(&ident("cpu-1", 102), later);
        assert_eq!(t.inflight_total(), 2);
        let json = |v: rmpv::Value| serde_json::to_value(v).unwrap();
        assert_eq!(
            json(t.snapshot(later)),
            serde_json::json!({
                "cpu-0": {"pid": 101, "version": 1, "inflight": 2, "answered": 0, "silent_s": 1.75, "weights": null},
                "cpu-1": {"pid": 102, "version": 1, "inflight": 0, "answered": 1, "silent_s": 0.0, "weights": null},
            })
        );
        // Replaced: the snapshot shows the new incarnation only.
        join(&mut t, "cpu-0", 201, later);
        assert_eq!(
            json(t.snapshot(later))["cpu-0"],
            serde_json::json!({"pid": 201, "version": 1, "inflight": 0, "answered": 0, "silent_s": 0.0, "weights": null})
        );
    }

    #[test]
    fn every_way_out_hands_back_every_request_in_flight() {
        for how in ["leave", "gone", "expire", "replace"] {
            let (mut t, now) = table("round-robin");
            join(&mut t, "cpu-0", 101, now);
            for request in 0..5 {
                send(&mut t, "cpu-0", 101, request);
            }
            let departed = match how {
                "leave" => t.leave(&ident("cpu-0", 101), "bye"),
                "gone" => t.gone("cpu-0", 101, false),
                "expire" => t
                    .expire(now + TIMEOUT + Duration::from_millis(100), |_| 0)
                    .into_iter()
                    .next(),
                _ => join(&mut t, "cpu-0", 202, now),
            };
            let departed = departed.unwrap_or_else(|| panic!("{how}: nobody left"));
            assert_eq!(sorted(departed.pending), vec![0, 1, 2, 3, 4], "{how}");
            assert_eq!(t.inflight_total(), 0, "{how}");
        }
    }

    #[test]
    fn copied_bytes_come_from_each_workers_report() {
        let (mut t, now) = table("round-robin");
        let report = rmpv::Value::Map(vec![(
            rmpv::Value::from("copied"),
            rmpv::Value::Map(vec![
                (rmpv::Value::from("a:0"), rmpv::Value::from(8u64)),
                (rmpv::Value::from("b:0"), rmpv::Value::from(4u64)),
            ]),
        )]);
        t.register(b"cpu-0:10", "cpu-0", 10, V1, report, now);
        join(&mut t, "cpu-1", 11, now);
        let copied = t.copied_bytes();
        assert_eq!(copied.get("cpu-0"), Some(&12));
        assert_eq!(copied.get("cpu-1"), Some(&0));
    }
}
