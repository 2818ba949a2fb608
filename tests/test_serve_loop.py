"""The worker's serving loop (worker/serve.py) on a stand-in runtime: what it answers when a
model call's result is something the wire cannot carry."""

from __future__ import annotations

import types
from typing import Any

import numpy as np

from mpspool import wire
from mpspool.errors import Code
from mpspool.worker.serve import CopyWatch, Pending, Worker


class _Runtime:
    """Answers each call with ``answer``."""

    def __init__(self, answer: dict[str, Any]) -> None:
        self.answer = answer

    def canceller(self, signature: str) -> None:
        return None

    def run(self, signature: str, inputs: Any, outputs: list[str], cancel: Any) -> Any:
        return self.answer


def _worker(runtime: _Runtime) -> Worker:
    """A Worker without its socket: _execute needs only its runtime and its watches."""
    worker = Worker.__new__(Worker)
    worker.runtime = runtime
    worker.served = 0
    worker._busy_beats = types.SimpleNamespace(running=None)
    worker._copies = CopyWatch(allowed=False)
    return worker


def test_an_answer_the_wire_cannot_carry_is_an_internal_error_not_a_dead_worker() -> None:
    """Before, encoding the answer was outside the loop's guard: the exception ended the
    worker, and the front door's retry of the request ended the next one (found by a user
    test with a scalar string output, which TensorFlow gives as bytes)."""
    request = Pending("r1", "serving_default", ["x"], {})
    worker = _worker(_Runtime({"x": object()}))
    reply = worker._execute(request)
    header = wire.unpack(reply[0])
    assert wire.kind_of(header) is wire.Kind.ERROR
    assert header["id"] == "r1" and header["code"] == Code.INTERNAL
    assert header["message"].startswith("the model's answer could not be encoded: ")
    assert worker.served == 0, "not counted as served"

    worker = _worker(_Runtime({"x": np.arange(3, dtype=np.float32)}))
    header = wire.unpack(worker._execute(request)[0])
    assert wire.kind_of(header) is wire.Kind.REPLY and header["tensors"] == [["x", 1, [3]]]
    assert worker.served == 1
