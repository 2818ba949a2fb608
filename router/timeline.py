"""What each worker was doing, when: the worker-side span of every answered request.

Workers stamp each reply with the wall-clock microseconds their model call started and ended
(`t=[start_us, end_us]` in the REPLY header). The router keeps the most recent ones here so a
load test can draw per-worker task density over time (bench/compare.py): taken and cleared
over the control channel (`mpspool timeline`), never on the request path beyond one append.
"""

from __future__ import annotations

import collections
import time
from typing import Any

# ~200 s at 1,000 requests/s; a span costs ~100 bytes here, so the buffer stays ~20 MiB.
DEFAULT_CAPACITY = 200_000


class Timeline:
    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self._spans: collections.deque[tuple[str, int, int]] = collections.deque(maxlen=capacity)
        self.dropped = 0  # spans pushed out by newer ones since the last take(clear=True)

    def record(self, slot: str, timing: Any) -> None:
        """Keep one reply's span; a reply without a well-formed one is ignored."""
        if not (isinstance(timing, (list, tuple)) and len(timing) == 2):
            return
        start_us, end_us = timing
        if not (isinstance(start_us, int) and isinstance(end_us, int)):
            return
        spans = self._spans
        if len(spans) == spans.maxlen:
            self.dropped += 1
        spans.append((slot, start_us, end_us))

    def take(self, clear: bool = False) -> dict[str, Any]:
        """The spans kept so far, oldest first; with `clear`, forget them afterwards."""
        taken = {
            "now_us": time.time_ns() // 1000,
            "spans": [list(span) for span in self._spans],
            "dropped": self.dropped,
        }
        if clear:
            self._spans.clear()
            self.dropped = 0
        return taken
