"""Hostile requests against a real pool while a good client keeps sending (issue 15): bodies
that are not protobuf, truncated ones, tensors whose declared size is huge and whose payload is
tiny (every dtype the front door carries, strings too), a 10 MiB string asked to fill a huge
shape, an empty model name. Each is refused quickly with a gRPC status, the front door and the
workers live on, and the good client's requests all succeed."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import re
import resource
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pytest
import requests
import tensorflow as tf
from tensorflow_serving.apis import (
    classification_pb2,
    predict_pb2,
    prediction_service_pb2_grpc,
)

from conftest import DEMO_ROWS
from poolproc import Pool, memory_mib
from streamer import Streamer

PREDICT = "/tensorflow.serving.PredictionService/Predict"
# "Answered in milliseconds": generous for a loaded 2-core machine, far below the seconds a
# request that is expanded before it is checked costs.
QUICK_S = 0.5


def build_string_model(base: Path) -> Path:
    """A model with one string input (`words`, [None]) and a float input (`dense`, [None, 2])."""

    class Strings(tf.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = tf.Variable(2.0)

        @tf.function(
            input_signature=[
                tf.TensorSpec([None], tf.string, name="words"),
                tf.TensorSpec([None, 2], tf.float32, name="dense"),
            ]
        )
        def serve(self, words, dense):
            length = tf.cast(tf.strings.length(words), tf.float32)
            return {"out": length + tf.reduce_sum(dense, axis=1) * self.scale}

    module = Strings()
    tf.saved_model.save(module, str(base / "1"), signatures={"serving_default": module.serve})
    return base


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    tmp = tmp_path_factory.mktemp("hostile")
    pool = Pool(tmp, build_string_model(tmp / "strings"), 2)
    try:
        pool.start().wait_ready(2)
        yield pool
        assert pool.stop() == 0
        assert pool.leftovers() == []
    finally:
        pool.kill()


def _good() -> predict_pb2.PredictRequest:
    request = predict_pb2.PredictRequest()
    request.model_spec.name = "demo"
    request.inputs["words"].CopyFrom(tf.make_tensor_proto(np.array([b"ab", b"cde"], object)))
    request.inputs["dense"].CopyFrom(tf.make_tensor_proto(np.ones((2, 2), np.float32)))
    return request


def _declared(dtype: tf.DType, shape: list[int], **values: object) -> predict_pb2.PredictRequest:
    """The good request with `dense` replaced by a tensor of `dtype` declaring `shape`."""
    request = _good()
    tensor = request.inputs["dense"]
    tensor.Clear()
    tensor.dtype = dtype.as_datatype_enum
    for size in shape:
        tensor.tensor_shape.dim.add(size=size)
    for field, value in values.items():
        getattr(tensor, field).extend(value)  # type: ignore[arg-type]
    return request


HUGE = [1 << 40, 2]  # a trillion rows of the right width: the shape passes the signature
# Tiny payloads in every typed field the front door reads.
TINY = {
    tf.float32: {"float_val": [1.0]},
    tf.float64: {"double_val": [1.0]},
    tf.int32: {"int_val": [1]},
    tf.int16: {"int_val": [1]},
    tf.int8: {"int_val": [1]},
    tf.uint8: {"int_val": [1]},
    tf.uint16: {"int_val": [1]},
    tf.int64: {"int64_val": [1]},
    tf.uint32: {"uint32_val": [1]},
    tf.uint64: {"uint64_val": [1]},
    tf.bool: {"bool_val": [True]},
    tf.half: {"half_val": [1]},
    tf.bfloat16: {"half_val": [1]},
    tf.complex64: {"scomplex_val": [1.0, 0.0]},
    tf.complex128: {"dcomplex_val": [1.0, 0.0]},
}


def _hostile() -> list[tuple[str, bytes, grpc.StatusCode, str]]:
    """(what, the raw request body, the code, a fragment of the message)."""
    cases = []
    rng = np.random.default_rng(15)
    cases.append(
        ("random bytes", rng.bytes(4096), grpc.StatusCode.INTERNAL, "failed to decode Protobuf")
    )
    whole = _good().SerializeToString()
    cases.append(
        ("truncated", whole[: len(whole) // 2], grpc.StatusCode.INTERNAL, "failed to decode")
    )
    # The right dtype, a huge shape, one value: refused by the bound on what one request may
    # expand to, before anything is allocated.
    cases.append((
        "float32 [2^40, 2] from one value", _declared(tf.float32, HUGE, float_val=[1.0])
        .SerializeToString(), grpc.StatusCode.INVALID_ARGUMENT, "more than the",
    ))  # fmt: skip
    for dtype, values in TINY.items():
        if dtype == tf.float32:
            continue
        request = _declared(dtype, HUGE, **values)
        cases.append((
            f"{dtype.name} [2^40, 2] from one value", request.SerializeToString(),
            grpc.StatusCode.INVALID_ARGUMENT, "expects dtype float",
        ))  # fmt: skip
    words = _good()
    words.inputs["words"].Clear()
    words.inputs["words"].dtype = tf.string.as_datatype_enum
    words.inputs["words"].tensor_shape.dim.add(size=1 << 40)
    words.inputs["words"].string_val.append(b"x")
    cases.append((
        "string [2^40] from one value", words.SerializeToString(),
        grpc.StatusCode.INVALID_ARGUMENT, "more than the",
    ))  # fmt: skip
    big = _good()
    big.inputs["words"].Clear()
    big.inputs["words"].dtype = tf.string.as_datatype_enum
    big.inputs["words"].tensor_shape.dim.add(size=1 << 20)
    big.inputs["words"].string_val.append(b"x" * (10 << 20))
    cases.append((
        "a 10 MiB string to fill [2^20]", big.SerializeToString(),
        grpc.StatusCode.INVALID_ARGUMENT, "more than the",
    ))  # fmt: skip
    wrong_rank = _good()
    wrong_rank.inputs["words"].tensor_shape.dim.add(size=16)
    wrong_rank.inputs["words"].tensor_shape.dim[0].size = 4
    del wrong_rank.inputs["words"].string_val[:]
    wrong_rank.inputs["words"].string_val.append(b"x" * (10 << 20))
    cases.append((
        "a 10 MiB string as [4, 16]", wrong_rank.SerializeToString(),
        grpc.StatusCode.INVALID_ARGUMENT, "is not compatible with the signature",
    ))  # fmt: skip
    specless = _good()
    specless.ClearField("model_spec")
    cases.append((
        "no model spec", specless.SerializeToString(),
        grpc.StatusCode.INVALID_ARGUMENT, "Missing ModelSpec",
    ))  # fmt: skip
    nameless = _good()
    nameless.model_spec.name = ""
    cases.append((
        "an empty model name", nameless.SerializeToString(),
        grpc.StatusCode.INVALID_ARGUMENT, "ModelSpec has no name specified.",
    ))  # fmt: skip
    return cases


CASES = _hostile()


@pytest.mark.parametrize(("what", "body", "code", "fragment"), CASES, ids=[c[0] for c in CASES])
def test_a_hostile_request_is_refused_quickly_and_harms_no_one(
    pool: Pool, what: str, body: bytes, code: grpc.StatusCode, fragment: str
) -> None:
    pids = {s["slot"]: s["pid"] for s in pool.status()["slots"]}
    streamer = Streamer(pool.port, DEMO_ROWS, request=_good()).start()
    try:
        streamer.wait_for_successes(5)
        options = [("grpc.max_send_message_length", 64 << 20)]
        with grpc.insecure_channel(f"127.0.0.1:{pool.port}", options=options) as channel:
            call = channel.unary_unary(PREDICT)
            for _ in range(3):
                started = time.monotonic()
                with pytest.raises(grpc.RpcError) as info:
                    call(body, timeout=30)
                took = time.monotonic() - started
                assert info.value.code() == code, (what, info.value.details())
                assert fragment in (info.value.details() or ""), (what, info.value.details())
                assert "\n" not in (info.value.details() or ""), "one line, no traceback"
                assert took < QUICK_S + len(body) / 50e6, (what, took)
        streamer.wait_for_successes(len(streamer.ok()) + 5)
    finally:
        streamer.stop()
    assert streamer.failed() == [], streamer.failed()[:3]
    assert {s["slot"]: s["pid"] for s in pool.status()["slots"]} == pids
    assert pool.slot("cpu-0")["state"] == "READY"


def test_good_requests_still_get_their_answer(pool: Pool) -> None:
    with pool.channel() as channel:
        stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
        answer = stub.Predict(_good(), timeout=30)
    np.testing.assert_allclose(tf.make_ndarray(answer.outputs["out"]), [6.0, 7.0])


def test_a_calls_deadline_runs_from_its_start_not_from_its_last_byte(pool: Pool) -> None:
    """A call with grpc-timeout 1S whose client sends its message and keeps its stream open
    (raw HTTP/2): its answer, trailers that end the stream, comes at about a second. Its
    deadline ran from when the body was whole, so it was answered only once the client ended
    the stream, however long after (found by a hunt)."""
    message = _good().SerializeToString()
    head = _h2_call_head((b"grpc-timeout", b"1S"))
    with socket.create_connection(("127.0.0.1", pool.port), timeout=30) as sock:
        sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + _h2_frame(4, 0, 0, b""))
        began = time.monotonic()
        body = b"\0" + len(message).to_bytes(4, "big") + message
        # HEADERS (END_HEADERS), then the whole message without END_STREAM.
        sock.sendall(_h2_frame(1, 4, 1, head) + _h2_frame(0, 0, 1, body))
        received = b""
        ended = None
        while ended is None:
            assert time.monotonic() - began < 10, "not answered while the stream stays open"
            sock.settimeout(max(0.1, 10 - (time.monotonic() - began)))
            chunk = sock.recv(65536)
            assert chunk, "closed"
            received += chunk
            while len(received) >= 9:
                length = int.from_bytes(received[:3], "big")
                if len(received) < 9 + length:
                    break
                kind, flags = received[3], received[4]
                stream = int.from_bytes(received[5:9], "big") & 0x7FFFFFFF
                received = received[9 + length :]
                if stream == 1 and kind == 1 and flags & 1:  # HEADERS with END_STREAM
                    ended = time.monotonic() - began
                    break  # (then a RST_STREAM NO_ERROR: the client's side still open)
                assert not (stream == 1 and kind == 3), "reset, not answered"
    assert 0.8 < ended < 5, f"answered after {ended:.1f} s"


def _metric(pool: Pool, name: str) -> float:
    """One unlabelled metric of the front door's Prometheus page."""
    page = urllib.request.urlopen(pool.status()["pool"]["metrics"], timeout=10).read().decode()
    [line] = [x for x in page.splitlines() if x.startswith(name + " ")]
    return float(line.split()[1])


def _wait_for_metric(pool: Pool, name: str, want: float, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while (seen := _metric(pool, name)) != want:
        assert time.monotonic() < deadline, f"{name} {seen}, not {want}"
        time.sleep(0.1)


def _until_closed(sock: socket.socket, timeout: float = 20.0) -> bytes:
    """Everything the server sends on `sock` until it closes the connection."""
    sock.settimeout(timeout)
    said = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(65536):
            said += chunk
    return said


def _request_memory(pool: Pool) -> float:
    """The front door's mpspool_request_memory_bytes, in MiB."""
    return _metric(pool, "mpspool_request_memory_bytes") / (1 << 20)


def _wait_for_memory(pool: Pool, low: float, high: float, timeout: float = 30.0) -> float:
    """Waits until the request memory (MiB) reads within [low, high) three times running."""
    deadline, inside = time.monotonic() + timeout, 0
    while inside < 3:
        held = _request_memory(pool)
        inside = inside + 1 if low <= held < high else 0
        assert time.monotonic() < deadline, f"request memory {held:.1f} MiB, not in [{low}, {high})"
        time.sleep(0.1)
    return held


def test_requests_held_at_once_share_the_front_doors_memory_budget(tmp_path: Path) -> None:
    """What the requests being served hold counts against one budget (4x --max-message-bytes,
    at least 256 MiB) until each is answered: with the worker stopped, a REST request keeps the
    ~2 MiB its tensors take (not its ~30 MiB parse), five 46 MiB gRPC requests are held, and a
    sixth, which would pass 256 MiB, is refused with RESOURCE_EXHAUSTED without harm. Each
    request alone was always allowed; before, all six were taken. Once the worker runs on,
    every held request is answered, the memory is given back and the sixth goes through."""
    rows = 6_000_000
    # 64 MiB messages: the budget is its floor, 256 MiB (the default's is 2 GiB).
    args = ("--worker-timeout", "120", "--max-message-bytes", str(64 << 20))
    pool = Pool(tmp_path, build_string_model(tmp_path / "strings"), 1, *args)
    worker = 0
    try:
        pool.start().wait_ready(1)
        assert _request_memory(pool) == 0
        [worker] = pool.worker_pids()
        os.kill(worker, signal.SIGSTOP)
        dense = np.ones((rows, 2), np.float32)
        big = _good()
        big.inputs["words"].CopyFrom(tf.make_tensor_proto(np.array([b"ab"], object)))
        big.inputs["dense"].CopyFrom(tf.make_tensor_proto(dense))
        body = big.SerializeToString()
        assert 45 << 20 < len(body) < 47 << 20
        rest_body = {"inputs": {"words": ["ab"], "dense": [[1.0, 1.0]] * 200_000}}
        options = [
            ("grpc.max_send_message_length", 64 << 20),
            ("grpc.max_receive_message_length", 64 << 20),
        ]
        with (
            ThreadPoolExecutor(8) as clients,
            grpc.insecure_channel(f"127.0.0.1:{pool.port}", options=options) as channel,
        ):
            url = f"{pool.rest_url}/v1/models/demo:predict"
            rest_answer = clients.submit(requests.post, url, json=rest_body, timeout=120)
            # 200,000 x 2 floats built (1.5-3.1 MiB of vectors) and held; the parse's share
            # (tens of MiB of document) given back.
            _wait_for_memory(pool, 1.4, 8)
            call = channel.unary_unary(PREDICT)
            calls = [clients.submit(call, body, timeout=120) for _ in range(6)]
            first = next(concurrent.futures.as_completed(calls, timeout=120))
            refused = first.exception()
            assert isinstance(refused, grpc.RpcError), refused
            assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.details()
            # The others held what left this one no room: more than 256 - 46 MiB. Not yet all
            # five whole: their bytes count as they arrive, and one may still be arriving.
            said = re.search(r"hold (\d+) MiB of the front door's memory", refused.details())
            assert said and 256 - 47 <= int(said[1]) < 256, refused.details()
            assert "256 MiB allowed" in refused.details(), refused.details()
            held = _wait_for_memory(pool, 5 * 45.5, 256)
            assert sum(c.done() for c in calls) == 1, f"{held:.0f} MiB held"
            os.kill(worker, signal.SIGCONT)
            answers = [c.result(timeout=120) for c in calls if c is not first]
            assert rest_answer.result(timeout=120).status_code == 200
        assert len(answers) == 5
        for raw in answers:
            reply = predict_pb2.PredictResponse.FromString(raw)
            out = tf.make_ndarray(reply.outputs["out"])
            assert out.shape == (rows,) and out[0] == out[-1] == 6.0
        _wait_for_memory(pool, 0, 0.001)
        with grpc.insecure_channel(f"127.0.0.1:{pool.port}", options=options) as channel:
            assert channel.unary_unary(PREDICT)(body, timeout=120)
        assert pool.worker_pids() == [worker], "no worker was replaced"
        assert pool.stop() == 0
        assert pool.leftovers() == []
    finally:
        if worker and pool.proc and pool.proc.poll() is None:
            # A failed assertion would leave it stopped through the pool's teardown.
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker, signal.SIGCONT)
        pool.kill()


def test_requests_their_clients_cancel_count_until_their_worker_lets_them_go(
    tmp_path: Path,
) -> None:
    """A request whose client cancels it (RST_STREAM, no deadline) while its worker has it
    still holds its frames in the front door until the worker answers: its share of the budget
    stays held until then. Before, it went back with the cancelled call, and new requests were
    let in beside the frames still held (cancelled requests at a slow worker held 1.15 GB
    against a 256 MiB budget; found by a hunt). Here four cancelled 46 MiB requests still count
    while the worker is stopped, so of two more one is held and one refused; once the worker
    runs on, everything is given back."""
    rows = 6_000_000
    args = ("--worker-timeout", "120", "--max-message-bytes", str(64 << 20))
    pool = Pool(tmp_path, build_string_model(tmp_path / "strings"), 1, *args)
    worker = 0
    try:
        pool.start().wait_ready(1)
        [worker] = pool.worker_pids()
        os.kill(worker, signal.SIGSTOP)
        big = _good()
        big.inputs["words"].CopyFrom(tf.make_tensor_proto(np.array([b"ab"], object)))
        big.inputs["dense"].CopyFrom(tf.make_tensor_proto(np.ones((rows, 2), np.float32)))
        body = big.SerializeToString()
        options = [
            ("grpc.max_send_message_length", 64 << 20),
            ("grpc.max_receive_message_length", 64 << 20),
        ]
        with grpc.insecure_channel(f"127.0.0.1:{pool.port}", options=options) as channel:
            call = channel.unary_unary(PREDICT)
            cancelled = [call.future(body) for _ in range(4)]
            _wait_for_memory(pool, 4 * 45.5, 4 * 47)
            for future in cancelled:
                assert future.cancel()
            # Still held: the frames wait for the stopped worker.
            _wait_for_memory(pool, 4 * 45.5, 4 * 47)
            with ThreadPoolExecutor(2) as clients:
                calls = [clients.submit(call, body, timeout=120) for _ in range(2)]
                first = next(concurrent.futures.as_completed(calls, timeout=120))
                refused = first.exception()
                assert isinstance(refused, grpc.RpcError), refused
                assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.details()
                os.kill(worker, signal.SIGCONT)
                [answer] = [c.result(timeout=120) for c in calls if c is not first]
        reply = predict_pb2.PredictResponse.FromString(answer)
        assert tf.make_ndarray(reply.outputs["out"]).shape == (rows,)
        _wait_for_memory(pool, 0, 0.001)
        assert pool.worker_pids() == [worker], "no worker was replaced"
        assert pool.stop() == 0
        assert pool.leftovers() == []
    finally:
        if worker and pool.proc and pool.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker, signal.SIGCONT)
        pool.kill()


def test_a_few_bytes_asking_for_a_huge_tensor_count_what_they_would_build(
    tmp_path: Path,
) -> None:
    """A value repeated to fill a declared shape is built whole for the worker: what that
    takes counts against the request budget before it is built, and a request that would
    pass it is refused with RESOURCE_EXHAUSTED. Before, an 81-byte Predict filling
    [10000000, 13] built a 495 MiB frame (and a copy of it on its way to the worker) that
    no budget counted: four at once took the front door to 4 GiB (found by a hunt). What
    a build holds stays held while it runs when its caller goes away (callers that cancel
    took the front door past 7 GiB against this budget), and a request's own tensors are
    not counted twice (strings the decoding counted, counted again as they were built,
    refused half of twelve 19 MiB requests the budget had room for; found by a review)."""
    args = ("--max-message-bytes", str(64 << 20))  # the budget is its floor, 256 MiB
    pool = Pool(tmp_path, build_string_model(tmp_path / "strings"), 1, *args)
    worker = 0
    try:
        pool.start().wait_ready(1)
        front_door = pool.status()["front_door"]["pid"]
        [worker] = pool.worker_pids()
        # One string request of 20 MiB held at its worker (stopped): counted once.
        strings = _good()
        strings.inputs["words"].CopyFrom(
            tf.make_tensor_proto(np.array([b"w" * 200_000] * 100, object))
        )
        # In float_val: a tensor_content would be sent as it came, keeping the whole message
        # (its strings too) beside their frame, which is then counted as well.
        strings.inputs["dense"].CopyFrom(_declared(tf.float32, [100, 2]).inputs["dense"])
        strings.inputs["dense"].float_val.append(1.0)
        options = [("grpc.max_send_message_length", 64 << 20)]
        os.kill(worker, signal.SIGSTOP)
        with (
            ThreadPoolExecutor(1) as client,
            grpc.insecure_channel(f"127.0.0.1:{pool.port}", options=options) as channel,
        ):
            held = client.submit(channel.unary_unary(PREDICT), strings.SerializeToString(), 60)
            _wait_for_memory(pool, 19, 25)  # counted twice: 38 MiB
            os.kill(worker, signal.SIGCONT)
            answer = predict_pb2.PredictResponse.FromString(held.result(timeout=60))
            assert tf.make_ndarray(answer.outputs["out"])[0] == 200_004.0
        fill = _good()
        dense = fill.inputs["dense"]
        dense.Clear()
        dense.dtype = tf.float32.as_datatype_enum
        dense.tensor_shape.dim.add(size=40_000_000)  # 305 MiB once built
        dense.tensor_shape.dim.add(size=2)
        dense.float_val.append(1.0)
        body = fill.SerializeToString()
        assert len(body) < 100
        with grpc.insecure_channel(f"127.0.0.1:{pool.port}") as channel:
            call = channel.unary_unary(PREDICT)
            with pytest.raises(grpc.RpcError) as refused:
                call(body, timeout=30)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            details = refused.value.details() or ""
            assert "would take 306 MiB more once built" in details, details
            assert "256 MiB" in details, details
            answer = predict_pb2.PredictResponse.FromString(
                call(_good().SerializeToString(), timeout=30)
            )
        np.testing.assert_allclose(tf.make_ndarray(answer.outputs["out"]), [6.0, 7.0])
        # Callers that give up at once, four at a time, each asking for a 229 MiB fill: one
        # build at a time holds the budget, the others are refused.
        dense.tensor_shape.dim[0].size = 30_000_000
        body = fill.SerializeToString()

        def impatient(_: int) -> None:
            with grpc.insecure_channel(f"127.0.0.1:{pool.port}") as channel:
                for _ in range(3):
                    with contextlib.suppress(grpc.RpcError):
                        channel.unary_unary(PREDICT)(body, timeout=0.005)

        with ThreadPoolExecutor(4) as clients:
            list(clients.map(impatient, range(4)))
        peak = memory_mib(front_door, "VmHWM")
        assert peak < 600, f"the front door peaked at {peak:.0f} MiB"
        _wait_for_memory(pool, 0, 0.001)
        assert pool.status()["front_door"]["pid"] == front_door
        assert pool.stop() == 0
        assert pool.leftovers() == []
    finally:
        if worker and pool.proc and pool.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker, signal.SIGCONT)
        pool.kill()


def _rest_request(declared: int) -> bytes:
    """A REST Predict request's head, declaring a body of `declared` bytes."""
    return (
        "POST /v1/models/demo:predict HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Content-Type: application/json\r\nContent-Length: {declared}\r\n\r\n"
    ).encode()


def _answer(sock: socket.socket) -> bytes:
    """What the server sends until it closes the connection (or 60 s pass)."""
    sock.settimeout(60)
    received = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(65536):
            received += chunk
            if b"\r\n\r\n" in received and received.endswith(b"}"):
                break
    return received


def test_requests_that_stop_arriving_are_ended_and_their_bytes_count_while_they_arrive(
    tmp_path: Path,
) -> None:
    """A request's bytes count against the front door's memory budget while they arrive, and
    a request that stops sending is ended after --request-read-timeout, freeing what it held.
    Before, a body being gathered was outside the budget (as many as clients opened, up to
    --max-message-bytes each), and a client that sent part of a request, or a whole gRPC
    message without ending its stream, held its memory until it disconnected. Checked with
    the clients still connected: REST bodies that declare 60 MiB and send nothing hold
    nothing (a length reserved before its bytes came let four such heads, a byte trickled now
    and then, hold a 2 GiB budget); four REST bodies that sent 62 MiB each hold 248 MiB; a
    gRPC message is refused (RESOURCE_EXHAUSTED) as it passes the 256 MiB budget, and a
    chunked REST body and a fifth with a length wait for room instead, holding what came;
    once silent, the four are answered 408 after the timeout, the two waiting go on and
    stall in turn (408), and the memory is freed; a REST header that stalls has its
    connection closed; a gRPC call whose 46 MiB message came whole
    but whose stream was never ended holds 46 MiB (its bytes' share handed to its decoding,
    not counted twice), then gets DEADLINE_EXCEEDED and frees it; a
    gRPC message stalled halfway (curl, HTTP/2) holds its bytes, then gets DEADLINE_EXCEEDED;
    the worker serves on."""
    stall_s = 3
    args = ("--max-message-bytes", str(64 << 20), "--request-read-timeout", str(stall_s))
    pool = Pool(tmp_path, build_string_model(tmp_path / "strings"), 1, *args)
    sockets: list[socket.socket] = []
    done = threading.Event()
    try:
        pool.start().wait_ready(1)
        [worker] = pool.worker_pids()

        def connect() -> socket.socket:
            port = int(pool.rest_url.rsplit(":", 1)[1])
            sock = socket.create_connection(("127.0.0.1", port), timeout=60)
            sockets.append(sock)
            return sock

        # Built first: what follows runs within the stall limit.
        dense = np.ones((6_000_000, 2), np.float32)
        big = _good()
        big.inputs["dense"].CopyFrom(tf.make_tensor_proto(dense))
        body = big.SerializeToString()
        options = [("grpc.max_send_message_length", 64 << 20)]

        def send_in_background(sock: socket.socket, data: bytes) -> None:
            def send() -> None:
                with contextlib.suppress(OSError):
                    sock.sendall(data)

            threading.Thread(target=send, daemon=True).start()

        # Four REST heads declaring 60 MiB, nothing of their bodies sent: they hold nothing
        # (and are ended after the timeout, silent).
        declared_only = [connect() for _ in range(4)]
        for sock in declared_only:
            sock.sendall(_rest_request(60 << 20))
        time.sleep(0.5)
        assert _request_memory(pool) < 0.01, "declared lengths held before their bytes came"
        # Four REST bodies declaring 63 MiB: 62 MiB sent (248 MiB held as it came), then a
        # byte every half second until the checks below are done, so that none stalls before.
        stalled = [connect() for _ in range(4)]
        for sock in stalled:
            sock.sendall(_rest_request(63 << 20) + b" " * (62 << 20))
        trickling = threading.Event()
        trickling.set()

        def trickle() -> None:
            while trickling.is_set():
                for sock in stalled:
                    with contextlib.suppress(OSError):
                        sock.send(b" ")
                time.sleep(0.5)

        threading.Thread(target=trickle, daemon=True).start()
        _wait_for_memory(pool, 247.9, 249)
        # A gRPC message arriving meanwhile is refused as it passes the budget.
        with grpc.insecure_channel(f"127.0.0.1:{pool.port}", options=options) as channel:
            with pytest.raises(grpc.RpcError) as refused:
                channel.unary_unary(PREDICT)(body, timeout=60)
        said = refused.value.details()
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, said
        assert "reading this one further" in said and "256 MiB allowed" in said, said
        # A REST body without a length (chunked) and a fifth with one wait for room as their
        # bytes come, holding what came (TCP holds their clients back meanwhile).
        chunked = connect()
        head = _rest_request(0).replace(b"Content-Length: 0", b"Transfer-Encoding: chunked")
        send_in_background(chunked, head + f"{20 << 20:x}\r\n".encode() + b" " * (20 << 20))
        fifth = connect()
        send_in_background(fifth, _rest_request(60 << 20) + b" " * (20 << 20))
        held = _wait_for_memory(pool, 255.9, 256.001)
        # A header that stops halfway: its connection is closed after the timeout.
        header = connect()
        header.sendall(b"POST /v1/models/demo:predict HTTP/1.1\r\nHost: x\r\n")
        # All silent from now: 408 after the timeout, the memory freed; the chunked body and
        # the fifth, which had room once the four were ended, read what they sent and stalled
        # in turn.
        trickling.clear()
        for sock in [*declared_only, *stalled, chunked, fifth]:
            answer = _answer(sock)
            assert answer.startswith(b"HTTP/1.1 408"), (held, answer[:300])
            assert b"--request-read-timeout" in answer, answer[-400:]
        _wait_for_memory(pool, 0, 0.001)
        assert _answer(header) in (b"", b"HTTP/1.1 408 Request Timeout\r\n"), "still open"

        # gRPC: a whole 46 MiB message, its stream never ended (the client keeps it open).

        def one_message_then_silence() -> Iterator[bytes]:
            yield body
            done.wait(120)

        with grpc.insecure_channel(f"127.0.0.1:{pool.port}", options=options) as channel:
            future = channel.stream_unary(PREDICT).future(one_message_then_silence(), timeout=60)
            # Decoded while the stream stays open, it holds its share once: what its bytes
            # held as they arrived went to its decoding, not beside it (that would be 92 MiB).
            whole = len(body) / 2**20
            _wait_for_memory(pool, whole - 0.1, whole + 0.5)
            time.sleep(0.5)
            assert whole - 0.1 <= _request_memory(pool) < whole + 0.5
            with pytest.raises(grpc.RpcError) as ended:
                future.result()
            assert ended.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, ended.value.details()
            assert "--request-read-timeout" in ended.value.details(), ended.value.details()
            _wait_for_memory(pool, 0, 0.001)
            # The connection serves on.
            assert channel.unary_unary(PREDICT)(_good().SerializeToString(), timeout=30)

        # gRPC over curl (HTTP/2): a message stalled at 20 MiB of 40 holds its bytes, then ends.
        headers = tmp_path / "grpc-headers"
        curl = subprocess.Popen(
            ["curl", "-s", "--http2-prior-knowledge", "-o", "/dev/null", "-D", str(headers),
             "-H", "content-type: application/grpc", "-H", "te: trailers",
             "-X", "POST", "-T", "-", f"http://127.0.0.1:{pool.port}{PREDICT}"],
            stdin=subprocess.PIPE,
        )  # fmt: skip
        assert curl.stdin is not None
        curl.stdin.write(b"\0" + (40 << 20).to_bytes(4, "big") + b"\1" * (20 << 20))
        curl.stdin.flush()
        _wait_for_memory(pool, 19.9, 21)
        # Freed with curl still connected (it waits on its input), then its answer read.
        _wait_for_memory(pool, 0, 0.001)
        curl.stdin.close()
        assert curl.wait(timeout=60) == 0
        said = headers.read_text()
        assert "grpc-status: 4" in said and "request-read-timeout" in said, said

        assert pool.worker_pids() == [worker], "no worker was replaced"
        assert pool.stop() == 0
        assert pool.leftovers() == []
    finally:
        done.set()
        for sock in sockets:
            sock.close()
        pool.kill()


def build_big_answer_model(base: Path) -> Path:
    """A model whose answer is large from a tiny request: `x` ([None] float32) → `out`, x[0]
    float32 values (an 8 MB answer for x = [2e6])."""

    class BigAnswer(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([None], tf.float32, name="x")])
        def serve(self, x):
            return {"out": tf.zeros([tf.cast(x[0], tf.int32)], tf.float32) + x[0]}

    module = BigAnswer()
    tf.saved_model.save(module, str(base / "1"), signatures={"serving_default": module.serve})
    return base


def _asking_for(values: int) -> bytes:
    request = predict_pb2.PredictRequest()
    request.model_spec.name = "demo"
    request.inputs["x"].CopyFrom(tf.make_tensor_proto(np.array([values], np.float32)))
    return request.SerializeToString()


def _h2_frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    return (
        len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream.to_bytes(4, "big") + payload
    )


def _h2_call_head(*extra: tuple[bytes, bytes], path: str = "") -> bytes:
    """A Predict call's header block (another method's at `path`; HPACK literals: no indexing,
    no Huffman), and `extra`."""

    def literal(name: bytes, value: bytes) -> bytes:
        return b"\0" + bytes([len(name)]) + name + bytes([len(value)]) + value

    return b"".join(
        literal(name, value)
        for name, value in [
            (b":method", b"POST"), (b":scheme", b"http"), (b":path", (path or PREDICT).encode()),
            (b":authority", b"127.0.0.1"), (b"content-type", b"application/grpc"),
            (b"te", b"trailers"), *extra,
        ]
    )  # fmt: skip


def _h2_unread_predicts(port: int, message: bytes, count: int, path: str = "") -> socket.socket:
    """A raw HTTP/2 connection that grants no window for answers (SETTINGS_INITIAL_WINDOW_SIZE
    0) and sends `count` Predicts (or calls of `path`) of `message` on it; the caller never
    reads it."""

    head = _h2_call_head(path=path)
    body = b"\0" + len(message).to_bytes(4, "big") + message
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)
    sock.sendall(
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + _h2_frame(4, 0, 0, (4).to_bytes(2, "big") + bytes(4))
    )
    sock.sendall(_h2_frame(4, 1, 0, b""))  # the server's settings, acknowledged
    for i in range(count):
        sock.sendall(_h2_frame(1, 4, 2 * i + 1, head) + _h2_frame(0, 1, 2 * i + 1, body))
    return sock


def test_answers_a_client_does_not_take_count_and_its_connection_is_closed(
    tmp_path: Path,
) -> None:
    """A client that takes none of its answers (it grants no HTTP/2 window) cannot fill the
    front door with them: the answers count against the memory budget until they are handed
    over, answers past it are refused with RESOURCE_EXHAUSTED, and after --request-read-timeout
    without progress the connection is closed and the memory given back. Before, a connection
    held every answer it asked for (1.6 GB for 200 answers of 8 MB, hyper's stream limit) and
    nothing counted them."""
    # Long enough for the worker to make the 36 answers (~2 s here) and the checks below,
    # with room to spare on a slow machine: the clock starts at the first answer.
    stall_s = 12
    args = ("--max-message-bytes", str(64 << 20), "--request-read-timeout", str(stall_s))
    pool = Pool(tmp_path, build_big_answer_model(tmp_path / "big"), 1, *args)
    sockets: list[socket.socket] = []
    try:
        pool.start().wait_ready(1)
        [worker] = pool.worker_pids()
        big, answer_mib = _asking_for(2_000_000), 2_000_000 * 4 / 2**20
        options = [("grpc.max_receive_message_length", 64 << 20)]
        with grpc.insecure_channel(f"127.0.0.1:{pool.port}", options=options) as channel:
            predict = channel.unary_unary(PREDICT)
            assert len(predict(big, timeout=60)) > 8_000_000
            _wait_for_memory(pool, 0, 0.001)  # a taken answer holds nothing
            # 36 answers of 7.6 MiB asked for and never taken: 33 fit the 256 MiB budget (each
            # counted whole: hyper has polled its first piece, but it is still in the front door).
            sockets.append(_h2_unread_predicts(pool.port, big, 36))
            held = _wait_for_memory(pool, 33 * answer_mib, 256)
            # Meanwhile a big answer has no room: refused; a small one is not counted.
            with pytest.raises(grpc.RpcError) as refused:
                predict(big, timeout=60)
            said = refused.value.details()
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, said
            assert "answers not yet taken" in said and "256 MiB allowed" in said, said
            assert len(predict(_asking_for(10), timeout=30)) < 1000
            # Nothing moved for the stall limit: the connection is closed, the memory freed.
            _until_closed(sockets[0], timeout=30)
            _wait_for_memory(pool, 0, 0.001)
            assert len(predict(big, timeout=60)) > 8_000_000, held
        assert pool.worker_pids() == [worker], "no worker was replaced"
        assert pool.stop() == 0
        assert pool.leftovers() == []
    finally:
        for sock in sockets:
            sock.close()
        pool.kill()


def build_big_classifier(base: Path) -> Path:
    """A classifier of serialized tf.Examples whose answer is large from a tiny request: each
    example's int64 feature `k` → k scores of 0.5 (no classes)."""
    v1 = tf.compat.v1
    with tf.Graph().as_default():
        serialized = v1.placeholder(tf.string, [None], name="tf_example")
        k = v1.io.parse_example(serialized, {"k": v1.io.FixedLenFeature([], tf.int64)})["k"]
        scores = tf.fill([tf.shape(serialized)[0], tf.cast(k[0], tf.int32)], 0.5)
        with v1.Session() as session:
            builder = v1.saved_model.Builder(str(base / "1"))
            signature = v1.saved_model.signature_def_utils.classification_signature_def(
                serialized, None, scores
            )
            builder.add_meta_graph_and_variables(
                session, ["serve"], signature_def_map={"serving_default": signature}
            )
            builder.save()
    return base


def test_classify_answers_a_client_does_not_take_count_as_predicts_do(tmp_path: Path) -> None:
    """Only Predict's answers were held to the memory budget until their client took them:
    twenty 33-byte Classify calls on a connection that granted no window held 1.1 GB, the
    budget counting none, and the connection was never closed (found by a hunt). Now a
    Classify answer counts (its decoded form: a Class per score), past the budget it is
    refused, and the stalled connection is closed."""
    stall_s = 12
    args = ("--max-message-bytes", str(64 << 20), "--request-read-timeout", str(stall_s))
    pool = Pool(tmp_path, build_big_classifier(tmp_path / "big"), 1, *args)
    sockets: list[socket.socket] = []
    try:
        pool.start().wait_ready(1)
        request = classification_pb2.ClassificationRequest()
        request.model_spec.name = "demo"
        example = request.input.example_list.examples.add()
        example.features.feature["k"].int64_list.value.append(1_000_000)
        big = request.SerializeToString()
        classify = "/tensorflow.serving.PredictionService/Classify"
        options = [("grpc.max_receive_message_length", 64 << 20)]
        with grpc.insecure_channel(f"127.0.0.1:{pool.port}", options=options) as channel:
            call = channel.unary_unary(classify)
            assert len(call(big, timeout=60)) > 5_000_000
            _wait_for_memory(pool, 0, 0.001)
            # Each answer held as its decoded form, about 30.5 MiB: 8 fit the 256 MiB budget.
            sockets.append(_h2_unread_predicts(pool.port, big, 12, classify))
            _wait_for_memory(pool, 7 * 30, 256)
            with pytest.raises(grpc.RpcError) as refused:
                call(big, timeout=60)
            said = refused.value.details()
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, said
            assert "answers not yet taken" in said, said
            _until_closed(sockets[0], timeout=30)
            _wait_for_memory(pool, 0, 0.001)
        assert pool.stop() == 0
    finally:
        for sock in sockets:
            sock.close()
        pool.kill()


def test_rest_answers_a_client_does_not_read_count_until_written(tmp_path: Path) -> None:
    """A REST answer holds its share of the memory budget until its last piece is written,
    as a gRPC one does: three clients that read none of their ~40 MB answers keep them
    counted, and once they go the memory is given back. REST answers were counted by
    nothing: four 60-byte requests made 2.4 GB of answers at once, held for the stall limit
    by clients that did not read them (found by a hunt)."""
    pool = Pool(tmp_path, build_big_answer_model(tmp_path / "big"), 1)
    sockets: list[socket.socket] = []
    try:
        pool.start().wait_ready(1)
        body = json.dumps({"instances": [4_000_000.0]}).encode()
        head = (
            f"POST /v1/models/demo:predict HTTP/1.1\r\nHost: x\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode()
        for _ in range(3):
            rest_port = int(pool.rest_url.rsplit(":", 1)[1])
            sock = socket.create_connection(("127.0.0.1", rest_port), timeout=60)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.sendall(head + body)
            sockets.append(sock)
        # Each answer is 4,000,000 values of 4000000.0: about 57 MiB of JSON.
        held = _wait_for_memory(pool, 3 * 50, 3 * 65)
        for sock in sockets:
            sock.close()
        _wait_for_memory(pool, 0, 0.001)
        answer = requests.post(
            f"{pool.rest_url}/v1/models/demo:predict", json={"instances": [3.0]}, timeout=30
        )
        assert answer.json() == {"predictions": [3.0, 3.0, 3.0]}, held
        assert pool.stop() == 0
    finally:
        for sock in sockets:
            sock.close()
        pool.kill()


def test_rest_connections_keep_their_answers_and_their_clocks_apart(tmp_path: Path) -> None:
    """REST connections, as the clients that met each case: an error answered before its
    body was read reaches Python's http.client whole (the connection was closed with the
    body unread, the kernel reset it, and the client saw a broken pipe, not the 400); a
    request whose head starts just before an idle connection's limit and ends after it is
    answered (one clock served both, and it was dropped unanswered); an idle connection is
    closed after 1.25 times the stall limit; a client that reads none of its answers has its
    connection closed after the stall limit (it held them for ever); a body sent a byte per
    chunk takes about its size in the front door, not 37 times it (found by a hunt)."""
    import http.client

    import psutil

    stall_s = 3
    args = ("--request-read-timeout", str(stall_s))
    pool = Pool(tmp_path, build_big_answer_model(tmp_path / "big"), 1, *args)
    sockets: list[socket.socket] = []
    try:
        pool.start().wait_ready(1)
        [worker] = pool.worker_pids()
        port = int(pool.rest_url.rsplit(":", 1)[1])

        def connect() -> socket.socket:
            sock = socket.create_connection(("127.0.0.1", port), timeout=60)
            sockets.append(sock)
            return sock

        # An error before the body: its 1 MB is read and dropped until the client reads.
        client = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        client.request("POST", "/v1/models/demo:predictt", body=b" " * 1_000_000)
        refused = client.getresponse()
        assert refused.status == 400, refused.read()
        assert b"Malformed request" in refused.read()
        client.close()

        # A head begun just before the idle limit would have lapsed under one clock.
        asked = json.dumps({"instances": [3.0]}).encode()
        head = (
            f"POST /v1/models/demo:predict HTTP/1.1\r\nHost: x\r\nContent-Length: {len(asked)}\r\n"
        ).encode()
        sock = connect()
        time.sleep(stall_s - 0.3)
        sock.sendall(head)
        time.sleep(0.6)  # past the stall limit since the connection went idle
        sock.sendall(b"\r\n" + asked)
        answer = _answer(sock)
        assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
        # Idle, it is closed after 1.25 times the stall limit, not before.
        began = time.monotonic()
        assert _until_closed(sock, timeout=30) == b""
        assert 1.25 * stall_s - 0.5 < time.monotonic() - began < 1.25 * stall_s + 3

        # A client that reads none of its answers: closed once nothing moved for the limit.
        front_door = psutil.Process(pool.status()["front_door"]["pid"])
        unread = connect()
        unread.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        many = json.dumps({"instances": [2e6]}).encode()
        request = (
            f"POST /v1/models/demo:predict HTTP/1.1\r\nHost: x\r\n"
            f"Content-Length: {len(many)}\r\n\r\n"
        ).encode() + many
        unread.sendall(request * 4)
        began = time.monotonic()

        def open_in_front_door() -> bool:
            return any(c.status == psutil.CONN_ESTABLISHED and c.raddr and
                       c.raddr[1] == unread.getsockname()[1]
                       for c in front_door.net_connections("tcp"))  # fmt: skip

        # Seen open first: right after the connect the front door may not list it yet
        # (the loop below then ended at once; seen once in CI).
        while not open_in_front_door():
            assert time.monotonic() - began < 10, "never seen open"
            time.sleep(0.05)
        while open_in_front_door():
            assert time.monotonic() - began < 60, "still open: its answer held for ever"
            time.sleep(0.5)
        assert time.monotonic() - began > stall_s - 1

        # A body a byte per chunk: the front door holds about what the budget counts.
        before = front_door.memory_info().rss
        tiny = connect()
        tiny.sendall(
            b"POST /v1/models/demo:predict HTTP/1.1\r\nHost: x\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        piece = b"1\r\n \r\n" * 65536
        for _ in range(32):  # 2 MiB of data in 1-byte chunks
            tiny.sendall(piece)
        _wait_for_memory(pool, 1.99, 2.01)
        grew = (front_door.memory_info().rss - before) / 2**20
        assert grew < 24, f"{grew:.0f} MiB for a 2 MiB body (it took 75 MiB)"

        assert pool.worker_pids() == [worker], "no worker was replaced"
        assert pool.stop() == 0
        assert pool.leftovers() == []
    finally:
        for sock in sockets:
            sock.close()
        pool.kill()


def _own_connection(pool: Pool) -> grpc.Channel:
    """A channel with a connection of its own (gRPC shares one between channels with the same
    target and options otherwise)."""
    options = [("grpc.use_local_subchannel_pool", 1)]
    return grpc.insecure_channel(f"127.0.0.1:{pool.port}", options=options)


def _predict_through(channel: grpc.Channel) -> None:
    stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
    answer = stub.Predict(_good(), timeout=30)
    np.testing.assert_allclose(tf.make_ndarray(answer.outputs["out"]), [6.0, 7.0])


def test_connections_past_the_limit_are_refused_saying_why_and_silent_ones_closed(
    tmp_path: Path,
) -> None:
    """--max-connections holds the client connections open at once, gRPC and REST together:
    past it a gRPC connection gets the server's SETTINGS and a GOAWAY (ENHANCE_YOUR_CALM)
    whose debug text says why, a REST one a 503 in TF Serving's error shape, and both are
    closed, while the connections already open are served as before; a place is given back
    when a connection closes. A connection whose client sends no HTTP/2 preface is closed
    after --request-read-timeout: before, hyper waited for ever, and such connections could
    hold every place."""
    args = ("--max-connections", "4", "--request-read-timeout", "3")
    pool = Pool(tmp_path, build_string_model(tmp_path / "strings"), 1, *args)
    channels: list[grpc.Channel] = []
    try:
        pool.start().wait_ready(1)
        for _ in range(4):
            channels.append(_own_connection(pool))
            _predict_through(channels[-1])
        _wait_for_metric(pool, "mpspool_client_connections", 4)
        assert _metric(pool, "mpspool_client_connections_limit") == 4
        # A fifth gRPC connection is told why and closed at once.
        started = time.monotonic()
        with socket.create_connection(("127.0.0.1", pool.port)) as refused:
            said = _until_closed(refused)
        assert time.monotonic() - started < 5, "closed at once, not after a timeout"
        assert said[3] == 0x4 and said[9 + 3] == 0x7, f"SETTINGS then GOAWAY: {said[:24]!r}"
        assert said[9 + 13 : 9 + 17] == (0xB).to_bytes(4, "big"), "ENHANCE_YOUR_CALM"
        assert b"4 client connections open" in said and b"--max-connections" in said, said
        # So is a REST one, with a 503 in TF Serving's error shape.
        rest = subprocess.run(
            ["curl", "-s", "-w", "\n%{http_code}", f"{pool.rest_url}/v1/models/demo"],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        body, code = rest.stdout.rsplit("\n", 1)
        assert code == "503", rest.stdout
        assert "--max-connections" in json.loads(body)["error"], body
        assert _metric(pool, "mpspool_client_connections_refused_total") >= 2
        # The connections already open are served as before.
        for channel in channels:
            _predict_through(channel)
        # A connection that closes gives its place back.
        channels.pop().close()
        _wait_for_metric(pool, "mpspool_client_connections", 3)
        with _own_connection(pool) as channel:
            _predict_through(channel)
        _wait_for_metric(pool, "mpspool_client_connections", 3)
        # A client that sends nothing holds its place for the read timeout only.
        silent = socket.create_connection(("127.0.0.1", pool.port))
        started = time.monotonic()
        _wait_for_metric(pool, "mpspool_client_connections", 4)
        assert _until_closed(silent) == b"", "closed without a word: it never spoke HTTP/2"
        waited = time.monotonic() - started
        assert 2.5 < waited < 10, f"closed after {waited:.1f} s, the limit being 3 s"
        _wait_for_metric(pool, "mpspool_client_connections", 3)
        silent.close()
        assert "sent no HTTP/2 preface within 3 s" in (pool.log_dir / "router.log").read_text()
        assert pool.stop() == 0
        assert pool.leftovers() == []
    finally:
        for channel in channels:
            channel.close()
        pool.kill()


def test_a_flood_of_connections_leaves_the_pool_the_descriptors_to_replace_a_worker(
    tmp_path: Path,
) -> None:
    """The connection limit is held under what the front door's open-file limit leaves for the
    pool's own sockets. Measured before: 300 idle connections against a limit of 256 took
    every descriptor, and a worker started in place of one killed could not connect (STARTING
    for as long as the flood lasted; the log took an "accept failed" line every 50 ms). Here
    the pool runs under a limit of 1,024 open files (supervisord's minimum): the front door
    keeps fewer than 1,024 - 256 connections, refuses the rest of a flood of 1,100, and a killed
    worker's replacement connects and serves."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    flood = 1100
    if hard < flood + 100:
        pytest.skip(f"this process may open {hard} files, the flood needs {flood + 100}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, flood + 100), hard))
    # The flood's connections send nothing: a long read timeout keeps them for the whole test.
    args = ("--request-read-timeout", "600")
    pool = Pool(tmp_path, build_string_model(tmp_path / "strings"), 2, *args, open_files=1024)
    sockets: list[socket.socket] = []
    try:
        pool.start().wait_ready(2)
        with _own_connection(pool) as channel:
            _predict_through(channel)
            most = _metric(pool, "mpspool_client_connections_limit")
            assert 1024 - 256 - 64 < most <= 1024 - 256, most
            for _ in range(flood):
                sockets.append(socket.create_connection(("127.0.0.1", pool.port)))
            _wait_for_metric(pool, "mpspool_client_connections", most)
            assert _metric(pool, "mpspool_client_connections_refused_total") >= flood + 1 - most
            killed = pool.worker_pids()[0]
            os.kill(killed, signal.SIGKILL)
            pool.wait_for(
                lambda status: (
                    sum(s["state"] == "READY" for s in status["slots"]) == 2
                    and killed not in [s["pid"] for s in status["slots"]]
                ),
                timeout=60,
                what="the killed worker replaced and READY",
            )
            # READY is the controller's word; the front door must have taken its connection.
            _wait_for_metric(pool, "mpspool_workers_ready", 2)
            for _ in range(4):  # both workers, whichever the front door picks
                _predict_through(channel)
        # Not a descriptor ran out: without the limit below them, accepting workers and
        # clients failed every 50-100 ms, and a replacement got in only when a scrape of the
        # metrics happened to free one.
        log = (pool.log_dir / "router.log").read_text()
        assert "Too many open files" not in log, log[-2000:]
        for sock in sockets:
            sock.close()
        assert pool.stop() == 0
        assert pool.leftovers() == []
    finally:
        for sock in sockets:
            sock.close()
        pool.kill()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
