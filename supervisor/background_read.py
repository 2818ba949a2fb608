"""A read that may hang (a file on storage that stopped answering: NFS, a FUSE mount, a
FIFO) done on a thread of its own, so that the controller's loop goes on supervising (workers
replaced, status answered, stop obeyed) while it waits. TF Serving polls its config file on a
thread of its own too.

One read at a time: `start` begins one unless one is running; `wait` gives its outcome once
it is done. The look that starts a read waits a moment for it, so that a read that answers at
once is taken in that look, as before; later looks only check (several reads on one hung
mount, each waited for at every look, added up to a look of seconds). A read that never
returns keeps its (daemon) thread; no other is started meanwhile.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")

# The look that starts a read waits this long for it (one that answers is taken at once);
# past SLOW_S a read is said to hang, and the pool serves on meanwhile.
WAIT_S = 1.0
SLOW_S = 5.0


@dataclass(frozen=True)
class Outcome(Generic[T]):
    """What the read returned, or the exception it raised."""

    value: T | None = None
    error: BaseException | None = None
    started: float = 0.0  # when the read began (time.monotonic)


class BackgroundRead(Generic[T]):
    def __init__(self, read: Callable[[], T], name: str) -> None:
        self._read = read
        self._name = name
        self._thread: threading.Thread | None = None
        self._outcome: Outcome[T] | None = None
        self._started = 0.0

    def start(self) -> None:
        """A read begins, unless one is running."""
        if self._thread is not None:
            return
        self._outcome = None
        self._started = time.monotonic()
        self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._thread.start()

    def look(self) -> Outcome[T] | None:
        """A read begun unless one runs and waited for up to WAIT_S, or the running one
        checked: its outcome, or None while it runs."""
        started = self._thread is None
        self.start()
        return self.wait(WAIT_S if started else 0.0)

    def hung(self) -> bool:
        """Whether the running read has waited SLOW_S or more and still runs (one done
        whose outcome is not yet taken is not hung)."""
        thread = self._thread
        return thread is not None and thread.is_alive() and self.running_s() >= SLOW_S

    def running(self) -> bool:
        """Whether a read was started and its outcome not yet taken."""
        return self._thread is not None

    def running_s(self) -> float:
        """How long the running read has been waiting (0: none runs)."""
        return time.monotonic() - self._started if self._thread is not None else 0.0

    def join(self, timeout_s: float) -> bool:
        """Wait for the running read to end, its outcome kept for `wait`; whether it did."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout_s)
        return thread is None or not thread.is_alive()

    def wait(self, timeout_s: float) -> Outcome[T] | None:
        """The read's outcome once it is done (at most ``timeout_s`` waited for it), taken
        once; None while it runs, or when none was started."""
        thread = self._thread
        if thread is None:
            return None
        thread.join(timeout_s)
        if thread.is_alive():
            return None
        self._thread = None
        outcome, self._outcome = self._outcome, None
        if outcome is None:  # its thread ended without a word: never expected
            return Outcome(error=RuntimeError(f"{self._name}: the read left no outcome"))
        return outcome

    def _run(self) -> None:
        started = self._started
        try:
            self._outcome = Outcome(value=self._read(), started=started)
        except BaseException as exc:  # handed to the loop, which says what it was
            self._outcome = Outcome(error=exc, started=started)
