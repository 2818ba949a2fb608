"""The two calls bench/memory.py makes of the former Python load generator, over
bench/harness.py's Python client. Delete this file once bench/memory.py uses bench.harness."""

from __future__ import annotations

from bench import harness
from mpspool.demo_model import demo_inputs


def demo_requests(
    batch: int, rows: int, count: int = 8, model_name: str = "demo", seed: int = 0
) -> list[bytes]:
    """``count`` distinct serialized PredictRequests for the demo model at ``batch``."""
    return [
        harness.predict_request("", model_name, demo_inputs(batch, rows, seed=seed + i)).body[5:]
        for i in range(count)
    ]


async def check_target(target: str, payload: bytes, batch: int) -> None:
    """One Predict with ``payload``; its answer must have ``batch`` rows."""
    request = harness.Request("", "tfserving", harness.PREDICT_PATH, harness._frame(payload), batch)
    values = harness.answer_values(request, harness.call(target, request))
    if values.shape[:1] != (batch,):
        raise RuntimeError(f"{target} answered shape {values.shape} to a batch of {batch}")
