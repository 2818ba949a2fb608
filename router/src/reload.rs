//! `ModelService/HandleReloadConfigRequest` calls waiting for the controller, which owns the
//! pool's configuration: the front door holds each call, lists it in every `snapshot` until
//! the controller answers it with `reload_done` (the code and message TF Serving's call
//! returns), and passes the config on as the bytes the client sent (the controller parses
//! it; the front door never needs to).
//!
//! Listing a call until it is answered, rather than once, means a snapshot reply the
//! controller gave up on loses nothing; the controller recognises the ids it has taken.

use std::collections::BTreeMap;
use std::sync::Mutex;

use tokio::sync::oneshot;

/// What the controller answered: a TF Serving status code (0 OK) and its message.
pub type Outcome = (i32, String);

struct Waiting {
    config: Vec<u8>,
    answer: oneshot::Sender<Outcome>,
}

pub struct Reloads {
    inner: Mutex<Inner>,
}

struct Inner {
    next_id: u64,
    waiting: BTreeMap<u64, Waiting>,
    /// The front door drains: every call is answered this at once (`close`).
    closed: Option<Outcome>,
}

impl Default for Reloads {
    /// Ids counted from the front door's start in µs of the wall clock: a front door started
    /// again (kill -9, a crash) never gives an id the controller still holds for one of the
    /// last one's calls, which a count from 1 did (a new call was taken for an old one).
    fn default() -> Self {
        let micros = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX / 2));
        Self::starting_at(micros)
    }
}

impl Reloads {
    /// Ids after `first`: the next call's is `first + 1`.
    fn starting_at(first: u64) -> Self {
        Self {
            inner: Mutex::new(Inner {
                next_id: first,
                waiting: BTreeMap::new(),
                closed: None,
            }),
        }
    }

    /// A call with its serialized ModelServerConfig; the receiver gets the controller's answer
    /// (or is closed if the call is dropped from the table, which only a new front door does).
    pub fn submit(&self, config: Vec<u8>) -> oneshot::Receiver<Outcome> {
        let (answer, receiver) = oneshot::channel();
        if let Ok(mut inner) = self.inner.lock() {
            if let Some(outcome) = &inner.closed {
                let _ = answer.send(outcome.clone());
                return receiver;
            }
            // Calls whose client went away (deadline, cancel) leave with the next submit.
            inner.waiting.retain(|_, w| !w.answer.is_closed());
            inner.next_id += 1;
            let id = inner.next_id;
            inner.waiting.insert(id, Waiting { config, answer });
        }
        receiver
    }

    /// Every call not yet answered whose client still waits, oldest first: (id, config
    /// bytes). One whose client went away is not listed: the controller does not apply a
    /// call queued behind another once its caller has given up.
    pub fn listed(&self) -> Vec<(u64, Vec<u8>)> {
        self.inner
            .lock()
            .map(|inner| {
                inner
                    .waiting
                    .iter()
                    .filter(|(_, w)| !w.answer.is_closed())
                    .map(|(id, w)| (*id, w.config.clone()))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// The front door drains (the pool stops): the calls waiting, and every call from now
    /// on, are answered `outcome` at once. The controller takes no call once it stops, and
    /// one left waiting held the drain for its whole grace (10 s by default, a minute or
    /// more where a pod's grace period is long), then was cut by the GOAWAY (found by a hunt).
    pub fn close(&self, outcome: Outcome) {
        let waiting = match self.inner.lock() {
            Ok(mut inner) => {
                inner.closed = Some(outcome.clone());
                std::mem::take(&mut inner.waiting)
            }
            Err(_) => return,
        };
        for (_, call) in waiting {
            let _ = call.answer.send(outcome.clone());
        }
    }

    /// The controller's answer to call `id`; false when no such call waits (answered
    /// already, or its client gave up and it was dropped).
    pub fn answer(&self, id: u64, outcome: Outcome) -> bool {
        let waiting = self
            .inner
            .lock()
            .ok()
            .and_then(|mut i| i.waiting.remove(&id));
        match waiting {
            Some(w) => w.answer.send(outcome).is_ok(),
            None => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_call_is_listed_until_answered_and_gets_the_answer() {
        let reloads = Reloads::starting_at(0);
        let mut first = reloads.submit(b"one".to_vec());
        let _second = reloads.submit(b"two".to_vec());
        assert_eq!(
            reloads.listed(),
            vec![(1, b"one".to_vec()), (2, b"two".to_vec())]
        );
        assert_eq!(reloads.listed().len(), 2, "listing takes nothing away");
        assert!(reloads.answer(1, (0, String::new())));
        assert_eq!(first.try_recv().ok(), Some((0, String::new())));
        assert_eq!(reloads.listed(), vec![(2, b"two".to_vec())]);
        assert!(!reloads.answer(1, (0, String::new())), "answered once");
        assert!(!reloads.answer(9, (3, "x".to_string())), "no such call");
    }

    #[test]
    fn a_call_whose_client_left_is_dropped() {
        let reloads = Reloads::starting_at(0);
        let kept = reloads.submit(b"kept".to_vec());
        drop(reloads.submit(b"gone".to_vec()));
        // Not listed from the moment its client left, before any later call comes.
        assert_eq!(reloads.listed(), vec![(1, b"kept".to_vec())]);
        let _later = reloads.submit(b"later".to_vec());
        assert!(!reloads.answer(2, (0, String::new())));
        drop(kept);
    }

    #[test]
    fn a_draining_front_door_answers_every_call_at_once() {
        let reloads = Reloads::starting_at(0);
        let mut waiting = reloads.submit(b"one".to_vec());
        reloads.close((14, "stopping".to_string()));
        assert_eq!(waiting.try_recv().ok(), Some((14, "stopping".to_string())));
        assert!(reloads.listed().is_empty(), "the controller is given none");
        let mut later = reloads.submit(b"two".to_vec());
        assert_eq!(later.try_recv().ok(), Some((14, "stopping".to_string())));
        assert!(reloads.listed().is_empty());
    }

    #[test]
    fn a_front_door_started_later_gives_ids_after_the_last_ones() {
        let before = Reloads::default();
        let _one = before.submit(b"one".to_vec());
        let (first, _) = before.listed()[0].clone();
        std::thread::sleep(std::time::Duration::from_millis(2));
        let after = Reloads::default();
        let _two = after.submit(b"two".to_vec());
        assert!(after.listed()[0].0 > first + 1);
    }
}
