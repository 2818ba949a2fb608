"""Conventions every mpspool process follows: reserved exit codes, the fatal-reason
marker, and dying with the parent.

Reserved exit codes (after gunicorn's WORKER_BOOT_ERROR / APP_LOAD_ERROR) let the
controller tell "cannot start, stop retrying" from a crash worth a restart.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from typing import NoReturn

EXIT_OK = 0
EXIT_CONFIG_ERROR = 3  # bad configuration or environment: retrying cannot help
EXIT_LOAD_FAILED = 4  # the model could not be loaded
RESERVED_EXIT_CODES = (EXIT_CONFIG_ERROR, EXIT_LOAD_FAILED)

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


def fail(code: int, reason: str) -> NoReturn:
    """Report `reason` in the marker format and exit with a reserved code."""
    sys.stderr.write(f"{FATAL_MARKER}{reason}\n")
    sys.stderr.flush()
    raise SystemExit(code)


def fatal_reason(text: str) -> str:
    """The reason in the last FATAL_MARKER line of a process's output, or ""."""
    for line in reversed(text.splitlines()):
        if line.startswith(FATAL_MARKER):
            return line[len(FATAL_MARKER) :]
    return ""


# CPU priority while loading. Linux lets any process lower its own priority (raise its nice
# value) but only CAP_SYS_NICE, or an RLIMIT_NICE that reaches the old value, may raise it
# back; and nice is per thread, inherited by the threads a thread creates.
_CAP_SYS_NICE = 23


def can_restore_priority() -> bool:
    """Whether this process (and so its children, same user) may put a nice value back to 0:
    CAP_SYS_NICE in its effective set, or an RLIMIT_NICE soft limit of 20 or more."""
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

    # A nice value n may be set when 20 - n <= RLIMIT_NICE (setrlimit(2)): 0 needs 20.
    soft, _hard = resource.getrlimit(resource.RLIMIT_NICE)
    return soft == resource.RLIM_INFINITY or soft >= 20


def restore_priority(pid: int) -> int:
    """Every thread of `pid` back to nice 0; returns how many were changed. Threads are
    listed until no new one appears, so one created while we walk is not missed.
    PermissionError without the right (can_restore_priority); ProcessLookupError when the
    process is gone."""
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
            try:
                if os.getpriority(os.PRIO_PROCESS, tid) != 0:
                    os.setpriority(os.PRIO_PROCESS, tid, 0)
                    changed += 1
            except ProcessLookupError:
                pass  # that thread ended meanwhile
        done |= new
