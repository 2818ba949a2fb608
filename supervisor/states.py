"""Worker slot states: data only, no dependencies.

One enum and one table of allowed transitions; `Slot.change_state` in slots.py is the only
writer. Slots are keyed by name ("cpu-0"; later (gpu, context)), never by pid: a replaced
process takes its slot.
"""

from __future__ import annotations

import enum


class WorkerState(enum.Enum):
    STARTING = "STARTING"  # process spawned (or respawned); not yet routable
    READY = "READY"  # registered with the router and receiving requests
    DRAINING = "DRAINING"  # pool shutting down: finishing what it has
    STOPPED = "STOPPED"  # not running, by decision
    BACKOFF = "BACKOFF"  # could not load its model; waiting before the next try
    FATAL = "FATAL"  # retries exhausted: waits out a cool-down, then tries again; the reason
    # is shown by `mpspool status`


S = WorkerState
ALLOWED: dict[WorkerState, frozenset[WorkerState]] = {
    S.STOPPED: frozenset({S.STARTING}),
    # STARTING -> STARTING: the process was replaced before it became ready.
    S.STARTING: frozenset({S.STARTING, S.READY, S.BACKOFF, S.FATAL, S.DRAINING, S.STOPPED}),
    # READY -> STARTING: the process exited, was killed or declared dead; a new one is coming.
    # READY -> FATAL: supervisord reports FATAL before the controller saw the exit (its
    # command can no longer be spawned: the interpreter or model path went away).
    S.READY: frozenset({S.STARTING, S.FATAL, S.DRAINING, S.STOPPED}),
    S.BACKOFF: frozenset({S.STARTING, S.FATAL, S.STOPPED}),
    S.DRAINING: frozenset({S.STOPPED}),
    # FATAL -> STARTING: tried again after the cool-down (--fatal-retry-after).
    S.FATAL: frozenset({S.STARTING, S.STOPPED}),
}

RUNNING_STATES = frozenset({S.STARTING, S.READY, S.DRAINING})
FINAL_STATES = frozenset({S.FATAL, S.STOPPED})


class IllegalTransition(RuntimeError):
    pass
