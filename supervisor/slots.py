"""A worker slot's record, and the one place that changes its state."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from mpspool.supervisor.states import ALLOWED, IllegalTransition, WorkerState
from mpspool.wire import slot_key

log = logging.getLogger("mpspool.controller")


@dataclass
class Slot:
    name: str  # its placement ("cpu-0", "gpu1-2"): cores, GPU and MPS context
    version: int = 0  # the model version its workers serve
    # Its model's prefix (ModelVersions.prefix): "" for the pool's first model, else its name.
    model: str = ""
    state: WorkerState = WorkerState.STOPPED
    pid: int = 0  # the incarnation we have accounted for; 0 when none
    started_at: float = 0.0  # wall-clock start of the current incarnation
    incarnations: int = 0  # processes this slot has had
    # Restarts of the earlier slots of its key (its version served, retired, and serves
    # again): what the metrics' restarts counter showed must not go back.
    restarts_before: int = 0
    load_failures: int = 0
    # Its last process was refused by the pool's own settings (exit EXIT_CONFIG_ERROR:
    # weights that cannot be shared): FATAL at once, and its version is not tried again.
    refused: bool = False
    retry_at: float = 0.0  # monotonic time of the next start, in BACKOFF or FATAL
    reason: str = ""
    # Requests its workers answered, as counted by front doors before the current one.
    served_before: int = 0
    # As the current front door counts them: every worker of the slot it has seen.
    router_served: int = 0
    inflight: int = 0
    kill_sent_to: int = 0  # the pid a KILL was already sent to (declared dead)
    # The pid that registered with the router (it loaded its model): a process that ends
    # after that is a serving worker's end, even if the router forgot it first.
    ready_pid: int = 0
    start_pending: bool = False  # a start was asked for and its process not yet seen
    weights: dict[str, Any] | None = None  # where the current process's variables live
    priority_restored: int = 0  # the pid moved to its serving policy after loading
    long_load_said: int = 0  # the pid whose long load was said (Controller._say_long_load)

    @property
    def restarts(self) -> int:
        return self.restarts_before + max(0, self.incarnations - 1)

    @property
    def key(self) -> str:
        """What it is known by to the router and in status: placement and version."""
        return slot_key(self.name, self.version, self.model)

    @property
    def program(self) -> str:
        """Its supervisord program: one group per (model, version)."""
        group = group_name(self.version, self.model)
        return f"{group}:{program_name(self.name, self.version, self.model)}"

    def change_state(self, new: WorkerState, why: str = "", level: int | None = None) -> None:
        if new is self.state and new is not WorkerState.STARTING:
            return
        if new not in ALLOWED[self.state]:
            raise IllegalTransition(f"slot {self.key}: {self.state.value} -> {new.value}")
        # A worker that died under load, or cannot load its model, is what an operator
        # looks for in the log: a warning, not one line among the routine transitions.
        crashed = self.state is WorkerState.READY and new is WorkerState.STARTING
        failing = new in (WorkerState.BACKOFF, WorkerState.FATAL)
        if level is None:
            level = logging.WARNING if crashed or failing else logging.INFO
        log.log(
            level,
            "slot %s: %s -> %s%s",
            self.key,
            self.state.value,
            new.value,
            f" ({why})" if why else "",
        )
        if new is WorkerState.STARTING:
            self.refused = False  # a new try: its own verdict
        self.state = new

    def describe(self, now: float | None = None) -> dict[str, Any]:
        now = time.time() if now is None else now
        running = self.pid and self.state in (
            WorkerState.STARTING,
            WorkerState.READY,
            WorkerState.DRAINING,
        )
        return {
            "slot": self.name,
            "model": self.model,
            "version": self.version,
            "state": self.state.value,
            "pid": self.pid or None,
            "uptime_s": round(now - self.started_at, 1) if running and self.started_at else None,
            "restarts": self.restarts,
            "inflight": self.inflight,
            "served": self.served_before + self.router_served,
            "reason": self.reason,
            "weights": self.weights,
        }


def program_name(placement: str, version: int, model: str = "") -> str:
    """A worker's supervisord program ("worker-cpu-0-v2", "worker-ranker-cpu-0-v2")."""
    return f"worker-{model}-{placement}-v{version}" if model else f"worker-{placement}-v{version}"


def group_name(version: int, model: str = "") -> str:
    """A version's supervisord program group ("v2", "ranker-v2")."""
    return f"{model}-v{version}" if model else f"v{version}"
