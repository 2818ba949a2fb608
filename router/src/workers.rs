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

/// How the front door picks a worker for a request (`--dispatch`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Policy {
    /// In turn, whatever each holds.
    RoundRobin,
    /// The fewest requests in flight, the first slot in order among equals: no request queues
    /// behind a long one while another worker is idle, and at low load one worker takes the
    /// requests and stays warm.
    LeastLoaded,
}

impl Policy {
    pub fn parse(name: &str) -> Option<Policy> {
        match name {
            "round-robin" => Some(Policy::RoundRobin),
            "least-loaded" => Some(Policy::LeastLoaded),
            _ => None,
        }
    }
}

pub struct WorkerHandle<P> {
    pub slot: String,
    pub pid: i64,
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
}

pub struct WorkerTable<P> {
    pub timeout: Duration,
    policy: Policy,
    by_identity: HashMap<Vec<u8>, WorkerHandle<P>>,
    /// slot → identity, in slot order (the routing order).
    by_slot: BTreeMap<String, Vec<u8>>,
    rotation: usize,
    /// Incarnations declared dead by silence, per slot, until the slot registers anew: the
    /// controller reads these and replaces the process.
    pub declared_dead: BTreeMap<String, i64>,
}

impl<P> WorkerTable<P> {
    pub fn new(timeout: Duration, policy: Policy) -> WorkerTable<P> {
        WorkerTable {
            timeout,
            policy,
            by_identity: HashMap::new(),
            by_slot: BTreeMap::new(),
            rotation: 0,
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
        weights: rmpv::Value,
        now: Instant,
    ) -> Option<Departure<P>> {
        let mut replaced = None;
        if let Some(old) = self.by_slot.get(slot).cloned() {
            if old != identity {
                replaced =
                    self.drop_identity(&old, format!("slot {slot} re-registered by pid {pid}"));
            }
        }
        let handle = self
            .by_identity
            .entry(identity.to_vec())
            .or_insert_with(|| WorkerHandle {
                slot: slot.to_string(),
                pid,
                identity: identity.to_vec(),
                last_seen: now,
                inflight: HashMap::new(),
                answered: 0,
                weights: rmpv::Value::Nil,
            });
        handle.last_seen = now;
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

    pub fn leave(&mut self, identity: &[u8], reason: &str) -> Option<Departure<P>> {
        self.drop_identity(identity, reason.to_string())
    }

    /// The controller saw the process of (slot, pid) exit.
    pub fn gone(&mut self, slot: &str, pid: i64) -> Option<Departure<P>> {
        let identity = self.by_slot.get(slot)?.clone();
        if self.by_identity.get(&identity).map(|h| h.pid) != Some(pid) {
            return None;
        }
        self.drop_identity(&identity, format!("process {pid} of slot {slot} exited"))
    }

    /// Declare dead every worker silent for longer than the liveness window.
    pub fn expire(&mut self, now: Instant) -> Vec<Departure<P>> {
        let silent: Vec<(Vec<u8>, Duration)> = self
            .by_identity
            .values()
            .map(|h| {
                (
                    h.identity.clone(),
                    now.saturating_duration_since(h.last_seen),
                )
            })
            .filter(|(_, quiet)| *quiet > self.timeout)
            .collect();
        let mut gone = Vec::new();
        for (identity, quiet) in silent {
            if let Some(handle) = self.by_identity.get(&identity) {
                self.declared_dead.insert(handle.slot.clone(), handle.pid);
            }
            if let Some(departure) = self.drop_identity(
                &identity,
                format!("silent for {:.1} s", quiet.as_secs_f64()),
            ) {
                gone.push(departure);
            }
        }
        gone
    }

    fn drop_identity(&mut self, identity: &[u8], reason: String) -> Option<Departure<P>> {
        let handle = self.by_identity.remove(identity)?;
        if self.by_slot.get(&handle.slot).map(Vec::as_slice) == Some(identity) {
            self.by_slot.remove(&handle.slot);
        }
        Some(Departure {
            slot: handle.slot,
            pid: handle.pid,
            reason,
            pending: handle.inflight.into_values().collect(),
        })
    }

    // -- routing ------------------------------------------------------------------
    pub fn ready(&self) -> usize {
        self.by_slot.len()
    }

    /// The worker for the next request; None when none is routable.
    pub fn pick(&mut self) -> Option<&mut WorkerHandle<P>> {
        if self.by_slot.is_empty() {
            return None;
        }
        let identity = match self.policy {
            Policy::RoundRobin => {
                let index = self.rotation % self.by_slot.len();
                self.rotation = self.rotation.wrapping_add(1);
                self.by_slot.values().nth(index)?.clone()
            }
            Policy::LeastLoaded => self
                .by_slot
                .values()
                .min_by_key(|id| {
                    self.by_identity
                        .get(*id)
                        .map_or(usize::MAX, |h| h.inflight.len())
                })?
                .clone(),
        };
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
    use super::*;

    type Table = WorkerTable<u32>;

    fn table(policy: Policy) -> (Table, Instant) {
        (
            WorkerTable::new(Duration::from_secs(3), policy),
            Instant::now(),
        )
    }

    fn join(t: &mut Table, slot: &str, pid: i64, now: Instant) -> Option<Departure<u32>> {
        let identity = format!("{slot}:{pid}");
        t.register(identity.as_bytes(), slot, pid, rmpv::Value::Nil, now)
    }

    #[test]
    fn round_robin_in_slot_order() {
        let (mut t, now) = table(Policy::RoundRobin);
        join(&mut t, "cpu-1", 11, now);
        join(&mut t, "cpu-0", 10, now);
        let picks: Vec<String> = (0..4).map(|_| t.pick().unwrap().slot.clone()).collect();
        assert_eq!(picks, ["cpu-0", "cpu-1", "cpu-0", "cpu-1"]);
    }

    #[test]
    fn least_loaded_prefers_the_idle_then_the_first() {
        let (mut t, now) = table(Policy::LeastLoaded);
        join(&mut t, "cpu-0", 10, now);
        join(&mut t, "cpu-1", 11, now);
        t.pick().unwrap().inflight.insert(1, 1);
        assert_eq!(t.pick().unwrap().slot, "cpu-1");
        t.pick().unwrap().inflight.insert(2, 2);
        assert_eq!(t.pick().unwrap().slot, "cpu-0");
    }

    #[test]
    fn a_new_incarnation_replaces_the_old_and_hands_back_its_requests() {
        let (mut t, now) = table(Policy::RoundRobin);
        join(&mut t, "cpu-0", 10, now);
        t.pick().unwrap().inflight.insert(7, 70);
        let departure = join(&mut t, "cpu-0", 12, now).unwrap();
        assert_eq!(departure.pid, 10);
        assert_eq!(departure.pending, vec![70]);
        assert_eq!(t.ready(), 1);
        assert_eq!(t.pick().unwrap().pid, 12);
    }

    #[test]
    fn silence_declares_dead_until_the_slot_registers_anew() {
        let (mut t, now) = table(Policy::RoundRobin);
        join(&mut t, "cpu-0", 10, now);
        join(&mut t, "cpu-1", 11, now);
        t.seen(b"cpu-1:11", now + Duration::from_secs(2));
        let gone = t.expire(now + Duration::from_millis(3100));
        assert_eq!(gone.len(), 1);
        assert_eq!(gone[0].slot, "cpu-0");
        assert_eq!(t.declared_dead.get("cpu-0"), Some(&10));
        assert_eq!(t.ready(), 1);
        join(&mut t, "cpu-0", 13, now + Duration::from_secs(4));
        assert!(t.declared_dead.is_empty());
    }

    #[test]
    fn gone_only_for_the_pid_registered() {
        let (mut t, now) = table(Policy::RoundRobin);
        join(&mut t, "cpu-0", 10, now);
        assert!(t.gone("cpu-0", 9).is_none());
        assert!(t.gone("cpu-0", 10).is_some());
        assert_eq!(t.ready(), 0);
        assert!(t.pick().is_none());
    }

    #[test]
    fn copied_bytes_come_from_each_workers_report() {
        let (mut t, now) = table(Policy::RoundRobin);
        let report = rmpv::Value::Map(vec![(
            rmpv::Value::from("copied"),
            rmpv::Value::Map(vec![
                (rmpv::Value::from("a:0"), rmpv::Value::from(8u64)),
                (rmpv::Value::from("b:0"), rmpv::Value::from(4u64)),
            ]),
        )]);
        t.register(b"cpu-0:10", "cpu-0", 10, report, now);
        join(&mut t, "cpu-1", 11, now);
        let copied = t.copied_bytes();
        assert_eq!(copied.get("cpu-0"), Some(&12));
        assert_eq!(copied.get("cpu-1"), Some(&0));
    }

    #[test]
    fn late_replies_resolve_nothing() {
        let (mut t, now) = table(Policy::RoundRobin);
        join(&mut t, "cpu-0", 10, now);
        t.pick().unwrap().inflight.insert(1, 100);
        assert_eq!(t.resolve(b"cpu-0:10", 1), Some(100));
        assert_eq!(t.resolve(b"cpu-0:10", 1), None);
        assert_eq!(t.resolve(b"nobody", 1), None);
        assert_eq!(t.get_mut(b"cpu-0:10").unwrap().answered, 1);
    }
}
