"""A read that may hang (a file on storage that stopped answering: NFS, a FUSE mount, a
FIFO) done on a thread of its own, so that the controller's loop goes on supervising (workers
replaced, status answered, stop obeyed) while it waits. TF Serving polls its config file on a
thread of its own too.

One read at a time: `start` begins one unless one is running; `wait` gives its outcome once
it is done, waiting at most a moment for it, so that a read that answers at once is taken in
the same look, as before. A read that never returns keeps its (daemon) thread; no other is
started meanwhile.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Outcome(Generic[T]):
    """What the read returned, or the exception it raised."""

    value: T | None = None
    error: BaseException | None = None


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

    def running_s(self) -> float:
        """How long the running read has been waiting (0: none runs)."""
        return time.monotonic() - self._started if self._thread is not None else 0.0

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
        return outcome

    def _run(self) -> None:
        try:
            self._outcome = Outcome(value=self._read())
        except BaseException as exc:  # handed to the loop, which says what it was
            self._outcome = Outcome(error=exc)
