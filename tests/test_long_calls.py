"""Model calls longer than the liveness window, calls that hang, and a request that ends every
worker it reaches, in a real pool (the official client, a model these tests export).

A worker inside a long call is working, not silent: it beats from a side thread while the
call runs (worker/serve.py, BusyBeats), so it is neither declared dead nor killed, and the
request is answered once. A call past --call-timeout is taken for a hang: its request fails
with DEADLINE_EXCEEDED and its worker exits to be replaced. A request whose worker dies
while running it is sent again elsewhere, but at most MAX_SENDS (3) times
(router/src/dispatch.rs): an input that aborts the process (TensorFlow's Abort op here, a
crashing kernel in the wild) must not take the pool down over and over."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import tensorflow as tf
from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc

from poolproc import Pool

WORKERS = 3
# Short, so that a long call outlasts it by far; not so short that a READY worker starved of
# the 2 cores while its neighbours restart (three TensorFlow imports at once) misses it.
WORKER_TIMEOUT_S = 1.5
# What a long call is meant to last: well past the liveness window, so that without beats its
# worker would be declared dead at least once. Timed in the test's process, which a loaded
# machine can slow more than the worker (a CI run measured 1.97 s for a 2.5 s aim): aimed
# high, checked against 1.5 windows.
LONG_CALL_S = 4.0
# A call this long is taken for a hang: far past LONG_CALL_S, which a loaded machine may
# stretch, and short enough for a test to wait out.
CALL_TIMEOUT_S = 10.0
# Steps of a call that would run for hours: a hang.
HANG_STEPS = 2**31 - 1


class Spin(tf.Module):
    """``n`` [batch] int32 → ``out`` [batch]: max(n) steps of x ← tanh(x · w) on a 64×256 x;
    any negative n aborts the process (tf.raw_ops.Abort, as a kernel that crashes would)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = tf.Variable(tf.random.stateless_normal([256, 256], seed=[1, 2]) * 0.05)

    @tf.function(input_signature=[tf.TensorSpec([None], tf.int32, name="n")])
    def serve(self, n: tf.Tensor) -> dict[str, tf.Tensor]:
        def crash() -> tf.Tensor:
            with tf.control_dependencies([tf.raw_ops.Abort(error_msg="a query of death")]):
                return tf.zeros([64, 256])

        def spin() -> tf.Tensor:
            steps = tf.reduce_max(tf.concat([n, [0]], axis=0))
            _, x = tf.while_loop(
                lambda i, x: i < steps,
                lambda i, x: (i + 1, tf.tanh(tf.matmul(x, self.w))),
                (tf.constant(0), tf.ones([64, 256])),
            )
            return x

        x = tf.cond(tf.reduce_min(tf.concat([n, [0]], axis=0)) < 0, crash, spin)
        return {"out": tf.zeros_like(n, tf.float32) + tf.reduce_sum(x)}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Spin]:
    base = tmp_path_factory.mktemp("spin") / "spin"
    module = Spin()
    tf.saved_model.save(module, str(base / "1"), signatures={"serving_default": module.serve})
    return base, module


@pytest.fixture(scope="module")
def long_steps(model: tuple[Path, Spin]) -> int:
    """Steps for a call of about LONG_CALL_S on this machine (timed in this process)."""
    module = model[1]
    module.serve(tf.constant([10]))
    per_step = math.inf
    for _ in range(3):  # the fastest of three: the machine's noise only slows a timing
        started = time.perf_counter()
        module.serve(tf.constant([2000]))
        per_step = min(per_step, (time.perf_counter() - started) / 2000)
    return int(LONG_CALL_S / per_step)


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory, model: tuple[Path, Spin]) -> Iterator[Pool]:
    pool = Pool(
        tmp_path_factory.mktemp("longpool"),
        model[0],
        WORKERS,
        "--worker-timeout",
        str(WORKER_TIMEOUT_S),
        "--call-timeout",
        str(CALL_TIMEOUT_S),
    )
    try:
        pool.start().wait_ready(WORKERS)
        yield pool
        assert pool.stop() == 0
        assert pool.leftovers() == []
    finally:
        pool.kill()


def predict(pool: Pool, n: list[int], timeout: float) -> predict_pb2.PredictResponse:
    request = predict_pb2.PredictRequest()
    request.model_spec.name = "demo"
    request.inputs["n"].CopyFrom(tf.make_tensor_proto(np.array(n, np.int32)))
    with pool.channel() as channel:
        stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
        return stub.Predict(request, timeout=timeout)


def restarts(pool: Pool) -> dict[str, tuple[int, int]]:
    """slot → (pid, restarts)."""
    return {s["slot"]: (s["pid"], s["restarts"]) for s in pool.status()["slots"]}


def test_a_call_longer_than_the_liveness_window_is_answered_once(
    pool: Pool, long_steps: int
) -> None:
    before = restarts(pool)
    steps, took = long_steps, 0.0
    for _ in range(3):
        started = time.monotonic()
        reply = predict(pool, [steps, 1], timeout=60)
        took = time.monotonic() - started
        if took > 1.5 * WORKER_TIMEOUT_S:
            break
        # The steps were timed here while the machine was busier than the worker found it
        # (a CI run: 1.91 s for a 4 s aim): aimed again at the worker's own pace.
        steps = int(steps * LONG_CALL_S / took)
    # Without this the test would prove nothing: the call must outlast the window.
    assert took > 1.5 * WORKER_TIMEOUT_S, f"the call took {took:.2f} s"
    assert list(tf.make_ndarray(reply.outputs["out"]).shape) == [2]
    assert restarts(pool) == before, "no worker was declared dead, killed or restarted"
    assert predict(pool, [1], timeout=10).outputs["out"].float_val


def test_a_call_past_the_call_timeout_fails_and_only_its_worker_is_replaced(pool: Pool) -> None:
    before = restarts(pool)
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as hung:
        predict(pool, [HANG_STEPS], timeout=120)
    took = time.monotonic() - started
    assert hung.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, hung.value.details()
    assert "--call-timeout" in hung.value.details(), hung.value.details()
    assert CALL_TIMEOUT_S <= took < CALL_TIMEOUT_S + 10, f"answered after {took:.1f} s"

    def replaced(status: dict) -> bool:
        slots = {s["slot"]: s for s in status["slots"]}
        return all(s["state"] == "READY" for s in slots.values()) and any(
            slots[slot]["pid"] != pid for slot, (pid, _) in before.items()
        )

    pool.wait_for(replaced, 120, "the hung worker replaced and every worker READY")
    after = restarts(pool)
    assert sorted(after[slot][1] - before[slot][1] for slot in before) == [0] * (WORKERS - 1) + [
        1
    ], (before, after)
    assert predict(pool, [1], timeout=10).outputs["out"].float_val


def test_busy_beats_end_a_call_past_its_limit_once_and_stop_beating() -> None:
    """The side thread alone: beats while a call runs, then at the limit hands the call over
    (as it read it, and how long it ran) and beats no more; with no limit it beats on."""
    from mpspool.worker.serve import BUSY_CHECK_S, BusyBeats, Running

    beats: list[float] = []
    overruns: list[tuple[Running, float]] = []

    def overrun(running: Running, ran_s: float) -> bool:
        overruns.append((running, ran_s))
        return True

    limited = BusyBeats(lambda: beats.append(time.monotonic()), 0.6, overrun)
    unlimited_beats: list[float] = []
    unlimited = BusyBeats(lambda: unlimited_beats.append(time.monotonic()), 0.0, pytest.fail)
    try:
        limited.running = unlimited.running = Running(time.monotonic(), "r1")
        time.sleep(1.5)
        assert [running[1] for running, _ in overruns] == ["r1"]
        assert overruns[0][1] > 0.6
        assert beats and beats[-1] - limited.running[0] <= 0.6 + BUSY_CHECK_S, "beats stopped"
        assert unlimited_beats[-1] - unlimited.running[0] > 1.0, "no limit: still beating"
    finally:
        limited.stop()
        unlimited.stop()


def test_a_hung_fast_call_check_ends_its_worker_with_bye_and_no_error_for_nobody(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The check a signature's first request leaves (Worker._check_deferred) has no request:
    past --call-timeout its worker says BYE and exits, sending no ERROR for an id the front
    door cannot read; a request's overrun still sends its error first."""
    from types import SimpleNamespace

    from mpspool import process, wire
    from mpspool.worker import serve
    from mpspool.worker.serve import Running, Worker

    sent: list[list[bytes]] = []

    class Exited(Exception):
        pass

    def exit_now(code: int) -> None:
        raise Exited(code)

    monkeypatch.setattr(process, "exit_now", exit_now)
    worker = object.__new__(Worker)
    worker.config = SimpleNamespace(call_timeout_s=1.0)
    worker.slot, worker.pid = "cpu-0", 4242
    worker._socket = SimpleNamespace(
        send_last_from_thread=lambda frames, due: sent.append(frames) or True
    )
    for request_id in (None, 7):
        running = Running(time.monotonic() - 2, request_id, None, None)
        worker._busy_beats = SimpleNamespace(running=running)
        with pytest.raises(Exited):
            worker._call_overrun(running, 2.0)
    kinds = [[wire.kind_of(wire.unpack(frame)) for frame in frames] for frames in sent]
    assert kinds == [[wire.Kind.BYE], [wire.Kind.ERROR, wire.Kind.BYE]]
    assert wire.unpack(sent[1][0])["id"] == 7
    assert serve.process is process


def test_a_request_that_ends_every_worker_it_reaches_is_sent_three_times(pool: Pool) -> None:
    before = restarts(pool)
    with pytest.raises(grpc.RpcError) as refused:
        predict(pool, [-1], timeout=60)
    assert refused.value.code() == grpc.StatusCode.INTERNAL, refused.value.details()
    assert "sent to a worker 3 times" in refused.value.details()

    # Each of the three workers ran it once and died; the pool comes back whole, and no
    # fourth send ends a worker again.
    def back(status: dict) -> bool:
        slots = {s["slot"]: s for s in status["slots"]}
        return all(
            slots[slot]["state"] == "READY" and slots[slot]["pid"] != pid
            for slot, (pid, _) in before.items()
        )

    pool.wait_for(back, 120, "every worker READY again")
    time.sleep(2 * WORKER_TIMEOUT_S)
    after = restarts(pool)
    assert {slot: r - before[slot][1] for slot, (_, r) in after.items()} == {
        slot: 1 for slot in before
    }, (before, after)
    assert predict(pool, [1], timeout=10).outputs["out"].float_val


class Total(tf.Module):
    """``x`` [batch] float32 → ``total``, its sum: a request as large as its input."""

    @tf.function(input_signature=[tf.TensorSpec([None], tf.float32, name="x")])
    def serve(self, x: tf.Tensor) -> dict[str, tf.Tensor]:
        return {"total": tf.reduce_sum(x)}


def test_a_worker_copying_a_gigabyte_input_is_not_taken_for_dead(tmp_path: Path) -> None:
    """TensorFlow copies a request's inputs into its tensors holding Python's GIL, so no
    thread of the worker beats meanwhile: about 1.6-3.3 s a GB on this 2-core machine. The
    front door widens a worker's liveness window by the bytes it holds (100 MB a second);
    before, this request (4 bytes sent, a GB once the front door repeated its value) got its
    worker declared dead, killed, and the request retried on the next, to the same end."""
    module = Total()
    base = tmp_path / "total"
    tf.saved_model.save(module, str(base / "1"), signatures={"serving_default": module.serve})
    (tmp_path / "pool").mkdir()
    pool = Pool(tmp_path / "pool", base, 1, "--worker-timeout", str(WORKER_TIMEOUT_S))
    rows = 250_000_000
    request = predict_pb2.PredictRequest()
    request.model_spec.name = "demo"
    x = request.inputs["x"]
    x.dtype = tf.float32.as_datatype_enum
    x.tensor_shape.dim.add(size=rows)
    x.float_val.append(0.5)  # repeated to fill the shape, as TensorFlow reads a TensorProto
    try:
        pool.start().wait_ready(1)
        before = restarts(pool)
        started = time.monotonic()
        with pool.channel() as channel:
            reply = prediction_service_pb2_grpc.PredictionServiceStub(channel).Predict(
                request, timeout=120
            )
        took = time.monotonic() - started
        assert tf.make_ndarray(reply.outputs["total"]) == pytest.approx(rows / 2, rel=1e-2)
        # Without this the test would prove nothing: the worker had to be silent that long.
        assert took > 1.5 * WORKER_TIMEOUT_S, f"the request took {took:.2f} s"
        assert restarts(pool) == before, "no worker was declared dead, killed or restarted"
        assert pool.stop() == 0
        assert pool.leftovers() == []
    finally:
        pool.kill()
