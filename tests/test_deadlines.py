"""A client's deadline reaches the model call, as TF Serving's does (its
``enforce_session_run_timeout`` runs the session with the request's deadline): in a real
one-worker pool, with the official client and a model these tests export.

The front door answers DEADLINE_EXCEEDED at the deadline whatever the worker does; what the
deadline on the wire saves is the worker's time. A request whose deadline passed while it
waited behind a long call is not run at all, and a call with a loop is stopped at its next
turn once its deadline passes (worker/serve.py, worker/runtime.py). Without either, a client
that gave up still holds the worker, and every request behind it waits."""

from __future__ import annotations

import json
import math
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pytest
import tensorflow as tf
from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc

from poolproc import Pool

# Steps of a loop that would run for days: only a stop ends it (or --call-timeout).
ENDLESS_STEPS = 2**31 - 1
# Long enough that the pool's own noise (a request's few ms) does not matter beside it.
GRIND_S = 3.0
# Layers of GRIND: plain ops one after the other, nothing TensorFlow can stop halfway.
GRIND_LAYERS = 16
# Far past a test's own waits: a call that reaches it is a failure, and the pool recovers.
CALL_TIMEOUT_S = 60.0
# A REST Predict's deadline (TF Serving's --rest_api_timeout_in_ms; 5 s by default).
REST_TIMEOUT_S = 2.0


class Slow(tf.Module):
    """Two signatures on ``n`` [batch] int32 → ``out`` [batch]: ``spin`` runs max(n) turns of
    a loop, ``grind`` pushes max(n) rows through GRIND_LAYERS dense layers, no loop."""

    def __init__(self) -> None:
        super().__init__()
        self.w = tf.Variable(tf.random.stateless_normal([256, 256], seed=[1, 2]) * 0.05)

    @tf.function(input_signature=[tf.TensorSpec([None], tf.int32, name="n")])
    def spin(self, n: tf.Tensor) -> dict[str, tf.Tensor]:
        tf.debugging.assert_non_negative(n, message="n must not be negative")
        steps = tf.reduce_max(tf.concat([n, [0]], axis=0))
        _, x = tf.while_loop(
            lambda i, x: i < steps,
            lambda i, x: (i + 1, tf.tanh(tf.matmul(x, self.w))),
            (tf.constant(0), tf.ones([64, 256])),
        )
        return {"out": tf.zeros_like(n, tf.float32) + tf.reduce_sum(x)}

    @tf.function(input_signature=[tf.TensorSpec([None], tf.int32, name="n")])
    def grind(self, n: tf.Tensor) -> dict[str, tf.Tensor]:
        rows = tf.reduce_max(tf.concat([n, [1]], axis=0))
        x = tf.ones(tf.stack([rows, 256]))
        for _ in range(GRIND_LAYERS):
            x = tf.tanh(tf.matmul(x, self.w))
        return {"out": tf.zeros_like(n, tf.float32) + tf.reduce_sum(x)}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Slow]:
    base = tmp_path_factory.mktemp("slow") / "slow"
    module = Slow()
    tf.saved_model.save(
        module,
        str(base / "1"),
        signatures={"serving_default": module.spin, "grind": module.grind},
    )
    return base, module


@pytest.fixture(scope="module")
def grind_rows(model: tuple[Path, Slow]) -> int:
    """Rows for a grind of about GRIND_S on this machine (timed in this process, which has
    at least the worker's threads: the worker's call is as long or longer)."""
    module = model[1]
    module.grind(tf.constant([10]))
    per_row = math.inf
    for _ in range(3):  # the fastest of three: noise only slows a timing
        started = time.perf_counter()
        module.grind(tf.constant([4000]))
        per_row = min(per_row, (time.perf_counter() - started) / 4000)
    return int(GRIND_S / per_row)


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory, model: tuple[Path, Slow]) -> Iterator[Pool]:
    pool = Pool(
        tmp_path_factory.mktemp("deadlinepool"),
        model[0],
        1,
        "--call-timeout",
        str(CALL_TIMEOUT_S),
        "--rest_api_timeout_in_ms",
        str(int(REST_TIMEOUT_S * 1000)),
    )
    try:
        pool.start().wait_ready(1)
        yield pool
        assert pool.stop() == 0
        assert pool.leftovers() == []
    finally:
        pool.kill()


def predict(pool: Pool, signature: str, n: list[int], timeout: float) -> float:
    """Seconds until the answer; the RpcError if it failed."""
    request = predict_pb2.PredictRequest()
    request.model_spec.name = "demo"
    request.model_spec.signature_name = signature
    request.inputs["n"].CopyFrom(tf.make_tensor_proto(np.array(n, np.int32)))
    with pool.channel() as channel:
        stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
        started = time.monotonic()
        reply = stub.Predict(request, timeout=timeout)
        assert reply.outputs["out"].float_val
        return time.monotonic() - started


def worker_log(pool: Pool) -> str:
    return "".join(
        p.read_text(errors="replace") for p in sorted(pool.log_dir.rglob("*")) if p.is_file()
    )


def test_a_loop_with_a_deadline_takes_the_call_a_deadline_can_stop(pool: Pool) -> None:
    """A session call cannot be stopped (worker/session_call.py), so a signature with a loop
    makes its calls with a deadline eagerly, the others in its session; the one without a
    loop keeps the session for all."""
    log = worker_log(pool)
    assert "serving_default: session, direct with a deadline" in log, log[-2000:]
    assert "grind: session" in log, log[-2000:]


def test_a_loop_past_its_deadline_is_stopped_and_the_worker_serves_the_next_request(
    pool: Pool,
) -> None:
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as late:
        predict(pool, "serving_default", [ENDLESS_STEPS], timeout=1.0)
    assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, late.value.details()
    assert time.monotonic() - started < 5
    # The one worker is free again once the loop's next turn sees the stop: at once, not
    # at --call-timeout, and it was neither killed nor replaced.
    pid = pool.status()["slots"][0]["pid"]
    took = predict(pool, "serving_default", [1], timeout=CALL_TIMEOUT_S / 2)
    assert took < 5, f"the next request waited {took:.1f} s behind the abandoned loop"
    status = pool.status()["slots"][0]
    assert (status["pid"], status["restarts"]) == (pid, 0), status


def test_a_rest_predict_past_the_rest_timeout_stops_its_loop_too(pool: Pool) -> None:
    def post(steps: int) -> int:
        body = json.dumps({"instances": [steps]})
        url = f"{pool.rest_url}/v1/models/demo:predict"
        done = subprocess.run(
            ["curl", "-sS", "-o", "/dev/null", "-w", "%{http_code}", "-d", body, url],
            capture_output=True,
            text=True,
            timeout=CALL_TIMEOUT_S,
        )
        return int(done.stdout)

    assert post(ENDLESS_STEPS) == 504  # DEADLINE_EXCEEDED
    # Behind a loop that ran on, it would be 504 too (its own deadline is as short).
    assert post(1) == 200


def test_a_failing_call_with_a_deadline_keeps_its_own_error(pool: Pool) -> None:
    """TensorFlow cancels a failing call's cancellation manager itself (to end the rest of
    the call): that is not the deadline's doing, and the client reads the op's error."""
    with pytest.raises(grpc.RpcError) as refused:
        predict(pool, "serving_default", [-1], timeout=30)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value.details()
    assert "n must not be negative" in refused.value.details()


def test_a_request_whose_deadline_passes_while_it_waits_is_not_run(
    pool: Pool, grind_rows: int
) -> None:
    with ThreadPoolExecutor(1) as background:
        first = background.submit(predict, pool, "grind", [grind_rows], CALL_TIMEOUT_S)
        # The first is on the worker (a third of its grind), and this one goes behind it.
        time.sleep(GRIND_S / 3)
        with pytest.raises(grpc.RpcError) as late:
            predict(pool, "grind", [grind_rows], timeout=0.5)
        assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, late.value.details()
        first_took = first.result()
    # Without this the test would prove nothing: the abandoned call, run, would be long, and
    # it was sent while the first ran.
    assert first_took > 2 * GRIND_S / 3, f"the first grind took {first_took:.2f} s"
    took = predict(pool, "grind", [1], timeout=CALL_TIMEOUT_S)
    assert took < first_took / 2, (
        f"the next request waited {took:.2f} s: the abandoned one ran ({first_took:.2f} s)"
    )


def test_busy_beats_cancel_a_call_once_its_deadline_passes_and_no_other() -> None:
    """The side thread alone, with TensorFlow's own cancellation managers: the call due is
    cancelled within BUSY_CHECK_S of its deadline, not before; one with a later deadline,
    or none, is not."""
    from tensorflow.python.eager.cancellation import CancellationManager

    from mpspool.worker.serve import BUSY_CHECK_S, BusyBeats, Running

    beats = BusyBeats(lambda: None, 0.0, pytest.fail)
    try:
        due, later, endless = CancellationManager(), CancellationManager(), CancellationManager()
        start = time.monotonic()
        beats.running = Running(start, "due", start + 0.4, due)
        while not due.is_cancelled and time.monotonic() < start + 5:
            time.sleep(0.002)
        cancelled_after = time.monotonic() - start
        assert due.is_cancelled
        # Within BUSY_CHECK_S, with room for a loaded machine waking the thread late.
        assert 0.4 <= cancelled_after < 0.4 + BUSY_CHECK_S + 0.5, cancelled_after
        start = time.monotonic()
        beats.running = Running(start, "later", start + 60, later)
        time.sleep(3 * BUSY_CHECK_S)
        beats.running = Running(time.monotonic(), "endless", None, endless)
        time.sleep(3 * BUSY_CHECK_S)
        assert not later.is_cancelled and not endless.is_cancelled
    finally:
        beats.stop()
