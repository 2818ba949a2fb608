"""Conventions every mpspool process follows: reserved exit codes, the fatal-reason
marker, and dying with the parent.

Reserved exit codes (after gunicorn's WORKER_BOOT_ERROR / APP_LOAD_ERROR) let the
controller tell "cannot start, stop retrying" from a crash worth a restart, and say why a
serving worker ended itself (a hung model call: restarted).
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import signal
import sys
import time
from typing import NoReturn

EXIT_OK = 0
EXIT_CONFIG_ERROR = 3  # bad configuration or environment: retrying cannot help
EXIT_LOAD_FAILED = 4  # the model could not be loaded
EXIT_CALL_TIMEOUT = 5  # a model call ran past --call-timeout: the worker is replaced
# The SavedModel itself could not be loaded (what TensorFlow's LoadSavedModel counts as a
# failed load attempt); EXIT_LOAD_FAILED: what came after it (warm-up) or around it failed.
EXIT_SAVED_MODEL_FAILED = 6
LOAD_FAILURES = (EXIT_LOAD_FAILED, EXIT_SAVED_MODEL_FAILED)
RESERVED_EXIT_CODES = (
    EXIT_CONFIG_ERROR, EXIT_LOAD_FAILED, EXIT_CALL_TIMEOUT, EXIT_SAVED_MODEL_FAILED
)  # fmt: skip

# A process that exits with a reserved code first writes one line starting with this to
# stderr; the controller shows the rest of the line as the reason (`mpspool status`).
FATAL_MARKER = "MPSPOOL-FATAL: "

_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Ask Linux to send `sig` when the parent exits, so no child outlives a killed pool.

    A no-op where prctl is unavailable. If the parent is already gone (it died between
    fork and here), exit at once.
    """
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):  # pragma: no cover - non-Linux
        return
    if os.getppid() != parent:
        os._exit(1)


def die_with_parent_sigterm() -> None:
    """For subprocess preexec_fn: children that can shut down cleanly get SIGTERM."""
    die_with_parent(signal.SIGTERM)


_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def started_at(pid: int) -> float:
    """When process ``pid`` started, in seconds since boot: with its pid, what tells it from
    a later process given the same pid (a pool's controller, a segment's owner). Not
    psutil's create_time(), which adds the boot time as the wall clock has it: a clock step
    (NTP at boot, a VM resumed, `date -s`) moved that, and `mpspool status` and `stop` took
    a live pool for gone while `start` asked for its processes to be ended (found by a
    hunt). ProcessLookupError when no such process is there."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as file:
            stat = file.read()
    except FileNotFoundError:
        raise ProcessLookupError(pid) from None
    # Fields after the command name, which is in parentheses and may hold anything: the
    # 22nd field, its start time in clock ticks since boot, is the 20th of these.
    fields = stat[stat.rindex(b")") + 2 :].split()
    return int(fields[19]) / _CLOCK_TICKS


def is_process_started_at(pid: int, started: float) -> bool:
    """Whether ``pid`` is the process that started at ``started`` (`started_at`). A value an
    mpspool before this one wrote (psutil's create_time(): seconds since the epoch, far
    past any time since boot) is compared as it was then: a pool started by it and still
    running is not taken for gone. OSError when no such process is there."""
    if started > time.clock_gettime(time.CLOCK_BOOTTIME) + 1.0:
        import psutil

        try:
            return abs(psutil.Process(pid).create_time() - started) < 1.0
        except psutil.NoSuchProcess:
            raise ProcessLookupError(pid) from None
    return abs(started_at(pid) - started) < 1.0


def fail(code: int, reason: str) -> NoReturn:
    """Report `reason` in the marker format and exit with a reserved code."""
    sys.stderr.write(f"{FATAL_MARKER}{reason}\n")
    sys.stderr.flush()
    raise SystemExit(code)


def exit_now(code: int) -> NoReturn:
    """End this process at once, from any thread: for a process whose main thread cannot be
    reached (it is stuck in a call). Nothing else runs (no atexit handlers, no other
    thread's cleanup); what logging holds is flushed first. No fatal-reason line: that marks
    a start that failed, and a later incarnation's log would show it as its own."""
    sys.stderr.flush()
    for handler in logging.getLogger().handlers:
        handler.flush()
    os._exit(code)


def fatal_reason(text: str) -> str:
    """The reason in the last FATAL_MARKER line of a process's output, or ""."""
    for line in reversed(text.splitlines()):
        if line.startswith(FATAL_MARKER):
            return line[len(FATAL_MARKER) :]
    return ""


# CPU priority while loading. Linux lets any process lower its own priority (SCHED_IDLE, or a
# higher nice value) but only CAP_SYS_NICE, or an RLIMIT_NICE that reaches nice 0, may take it
# back; and the policy is per thread, inherited by the threads a thread creates.
_CAP_SYS_NICE = 23
LOADING_PRIORITIES = ("idle", "normal")

# The policy a worker's serving thread (its main thread: the serving loop, the one the front
# door's writes wake) runs under once it serves; its other threads (TensorFlow's) run normal.
# "batch" is Linux's SCHED_BATCH at nice 0: the same CPU share, but its wake-ups do not
# preempt the thread running on its core; it runs when that thread blocks or its tick comes.
# What it is for: the front door hands a request to a worker and goes on with the rest of its
# round (another worker's chunk, the next answer); a worker woken on the front door's own core
# used to take that core at once, and hand it to its model call, while the rest of the round
# waited. Measured on 2 cores (bench/RESULTS.md, "Batching and splitting"): the 2 chunks of
# split requests (2 pinned workers) ran side by side in 76-99% of requests with every thread
# normal, 99.8-99.9% with the serving thread batch (p99 0.75-0.81x); batch 1 with one worker
# at concurrency 1 equal (0.98-1.02x). Every thread batch did as well for the chunks but cost
# one worker with two TensorFlow threads 0.83-0.86x the requests/s at concurrency 1 (a
# TensorFlow thread woken on a core the front door or the client held waited for it). Any
# thread may move between the two at nice 0 (sched(7)).
SERVING_POLICIES = ("batch", "normal")
_POLICY = {"batch": os.SCHED_BATCH, "normal": os.SCHED_OTHER}


def at_loading_priority(argv: list[str], priority: str) -> list[str]:
    """`argv` run at the loading priority from its first instruction: "idle" is Linux's
    SCHED_IDLE (util-linux's chrt execs it: same pid), so that its interpreter start and
    imports are idle too, and every thread it makes; "normal" leaves it as it is. A
    SCHED_IDLE thread runs only on CPU time no normal thread wants, and gives way the moment
    one wakes up (a nice value only weighs the shares, and the waking serving thread can wait
    out the loader's slice)."""
    if priority == "normal":
        return argv
    return [shutil.which("chrt") or "/usr/bin/chrt", "--idle", "0", *argv]


def can_restore_priority() -> bool:
    """Whether this process (and so its children, same user) may put a thread back to the
    normal policy at nice 0: CAP_SYS_NICE in its effective set, or an RLIMIT_NICE soft limit
    of 20 or more."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("CapEff:"):
                    if int(line.split()[1], 16) >> _CAP_SYS_NICE & 1:
                        return True
                    break
    except OSError:  # pragma: no cover - no procfs
        return False
    import resource

    # Leaving SCHED_IDLE at nice n is allowed when 20 - n <= RLIMIT_NICE (sched(7)): 0 needs 20.
    soft, _hard = resource.getrlimit(resource.RLIMIT_NICE)
    return soft == resource.RLIM_INFINITY or soft >= 20


def restore_priority(pid: int, serving: str = "batch") -> int:
    """The main thread of `pid` (its serving loop) to the ``serving`` policy at nice 0
    (SERVING_POLICIES: SCHED_BATCH or SCHED_OTHER), every other thread to SCHED_OTHER at nice
    0; returns how many were changed. Threads are listed until no new one appears, so one
    created while we walk is not missed. PermissionError without the right
    (can_restore_priority); ProcessLookupError when the process is gone."""
    done: set[int] = set()
    changed = 0
    while True:
        try:
            tids = {int(t) for t in os.listdir(f"/proc/{pid}/task")}
        except FileNotFoundError:
            raise ProcessLookupError(pid) from None
        new = tids - done
        if not new:
            return changed
        for tid in new:
            policy = _POLICY[serving] if tid == pid else os.SCHED_OTHER
            try:
                there = os.sched_getscheduler(tid) == policy
                if not there or os.getpriority(os.PRIO_PROCESS, tid) != 0:
                    os.sched_setscheduler(tid, policy, os.sched_param(0))
                    os.setpriority(os.PRIO_PROCESS, tid, 0)
                    changed += 1
            except ProcessLookupError:
                pass  # that thread ended meanwhile
        done |= new
