"""The router's view of its workers: who is registered, who is alive, what each has in flight.

Pure bookkeeping with an injected clock — no sockets — so the rules are testable alone:
- a worker is routable from its READY until it says BYE, goes silent for longer than the
  liveness window (the Paranoid Pirate rule: any message refreshes it), or the controller
  reports its process gone;
- when a worker leaves for any of those reasons, every request it had in flight fails
  with WorkerLost, which the caller treats as "retry on another worker": inference is
  idempotent, and the alternative — losing the request — is worse;
- a new incarnation of a slot replaces the old one (keyed by slot, never by pid).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


def _inflight(handle: WorkerHandle) -> int:
    return len(handle.inflight)


class WorkerLost(Exception):
    """The worker a request was sent to left before answering; the request may be retried."""


@dataclass
class WorkerHandle:
    slot: str
    pid: int
    identity: bytes
    model: str
    version: int
    last_seen: float
    inflight: dict[int, asyncio.Future[Any]] = field(default_factory=dict)
    answered: int = 0
    weights: dict[str, Any] | None = None  # as the worker reported it in READY


# How the router picks a worker for a request (--dispatch).
DISPATCH_POLICIES = ("round-robin", "least-loaded")


class WorkerTable:
    def __init__(
        self,
        timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
        policy: str = "round-robin",
    ) -> None:
        if policy not in DISPATCH_POLICIES:
            raise ValueError(f"dispatch policy must be one of {DISPATCH_POLICIES}, got {policy!r}")
        self.timeout_s = timeout_s
        self.policy = policy
        self._clock = clock
        self._by_identity: dict[bytes, WorkerHandle] = {}
        self._by_slot: dict[str, WorkerHandle] = {}
        self._rotation = itertools.count()
        self._routable: list[WorkerHandle] = []  # sorted by slot; rebuilt on membership change
        # Incarnations declared dead by silence, per slot, until the slot registers anew:
        # the controller reads these and replaces the process.
        self.declared_dead: dict[str, int] = {}
        self.changed = asyncio.Event()  # set whenever the set of routable workers changes

    # -- membership ---------------------------------------------------------------
    def register(
        self, identity: bytes, slot: str, pid: int, model: str, version: int
    ) -> WorkerHandle:
        old = self._by_slot.get(slot)
        if old is not None and old.identity != identity:
            self._drop(old, f"slot {slot} re-registered by pid {pid}")
        handle = self._by_identity.get(identity)
        if handle is None:
            handle = WorkerHandle(slot, pid, identity, model, version, self._clock())
            self._by_identity[identity] = handle
            self._by_slot[slot] = handle
            self._routable = sorted(self._by_slot.values(), key=lambda h: h.slot)
        handle.last_seen = self._clock()
        if self.declared_dead.get(slot) != pid:
            self.declared_dead.pop(slot, None)
        self.changed.set()
        return handle

    def seen(self, identity: bytes) -> WorkerHandle | None:
        """Refresh liveness on any message; None for an identity that is not registered."""
        handle = self._by_identity.get(identity)
        if handle is not None:
            handle.last_seen = self._clock()
        return handle

    def leave(self, identity: bytes, reason: str) -> WorkerHandle | None:
        handle = self._by_identity.get(identity)
        if handle is not None:
            self._drop(handle, reason)
        return handle

    def gone(self, slot: str, pid: int) -> WorkerHandle | None:
        """The controller saw the process of (slot, pid) exit."""
        handle = self._by_slot.get(slot)
        if handle is not None and handle.pid == pid:
            self._drop(handle, f"process {pid} of slot {slot} exited")
            return handle
        return None

    def expire(self) -> list[WorkerHandle]:
        """Declare dead every worker silent for longer than the liveness window."""
        now = self._clock()
        silent = [h for h in self._by_identity.values() if now - h.last_seen > self.timeout_s]
        for handle in silent:
            self.declared_dead[handle.slot] = handle.pid
            self._drop(handle, f"silent for {now - handle.last_seen:.1f} s")
        return silent

    def _drop(self, handle: WorkerHandle, reason: str) -> None:
        self._by_identity.pop(handle.identity, None)
        if self._by_slot.get(handle.slot) is handle:
            del self._by_slot[handle.slot]
        self._routable = sorted(self._by_slot.values(), key=lambda h: h.slot)
        lost = WorkerLost(f"worker {handle.slot} (pid {handle.pid}) left: {reason}")
        for future in handle.inflight.values():
            if not future.done():
                future.set_exception(lost)
        handle.inflight.clear()
        self.changed.set()

    # -- routing ------------------------------------------------------------------
    def ready(self) -> list[WorkerHandle]:
        return list(self._routable)

    def pick(self) -> WorkerHandle | None:
        """The worker for the next request, None when none is routable.

        round-robin: in turn, whatever each holds. least-loaded: the one with the fewest
        requests in flight, the first in slot order among equals, so no request queues
        behind a long one while another worker is idle, and at low load one worker takes
        the requests and stays warm (a worker idle between requests pays for waking its
        threads). On the 2-core bench machine the two measured the same within its noise.
        """
        workers = self._routable
        if not workers:
            return None
        if self.policy == "round-robin":
            return workers[next(self._rotation) % len(workers)]
        return min(workers, key=_inflight)

    def resolve(
        self, identity: bytes, request_id: int, outcome: Any, error: BaseException | None
    ) -> bool:
        """Complete a request's future; False if nobody waits for it any more (a late
        reply after a retry or a timeout), which the caller just drops."""
        handle = self._by_identity.get(identity)
        if handle is None:
            return False
        future = handle.inflight.pop(request_id, None)
        if future is None or future.done():
            return False
        handle.answered += 1
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(outcome)
        return True

    def inflight_total(self) -> int:
        return sum(len(h.inflight) for h in self._by_identity.values())

    def snapshot(self) -> dict[str, dict[str, Any]]:
        now = self._clock()
        return {
            h.slot: {
                "pid": h.pid,
                "inflight": len(h.inflight),
                "answered": h.answered,
                "silent_s": round(now - h.last_seen, 3),
                "weights": h.weights,
            }
            for h in self._by_slot.values()
        }
