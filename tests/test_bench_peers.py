"""bench/peers: the plain TF gRPC peer answers as the model and TF Serving do, stops on SIGTERM,
and the harness's PeerServer starts it, knows when it serves, and leaves nothing behind."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import tensorflow as tf
from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc

from mpspool.demo_model import demo_inputs

from conftest import DEMO_ROWS

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # bench/ is a folder of the checkout, not an installed package

from bench import harness  # noqa: E402
from bench.peers.run import PEERS, PeerServer  # noqa: E402


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _plain(model_dir: Path, port: int, *extra: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "bench.peers.plain", "--model-dir", str(model_dir),
         "--port", str(port), "--instances", "1", *extra],
        cwd=REPO, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip


@pytest.fixture(scope="module")
def plain_peer(demo_model_dir: Path) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    port = _free_port()
    proc = _plain(demo_model_dir / "1", port)
    try:
        yield proc, f"127.0.0.1:{port}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _request(inputs: dict[str, np.ndarray], name: str = "demo") -> predict_pb2.PredictRequest:
    request = predict_pb2.PredictRequest()
    request.model_spec.name = name
    for key, value in inputs.items():
        request.inputs[key].CopyFrom(tf.make_tensor_proto(value))
    return request


def _predict_when_up(stub: Any, request: Any, proc: subprocess.Popen[bytes]) -> Any:
    deadline = time.monotonic() + 120
    while True:
        try:
            return stub.Predict(request, timeout=30)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                raise
            assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
            time.sleep(0.2)


def test_plain_peer_answers_like_the_model_and_tf_serving(plain_peer, reference_model) -> None:
    proc, target = plain_peer
    with grpc.insecure_channel(target) as channel:
        stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
        for batch in (1, 256):
            inputs = demo_inputs(batch, DEMO_ROWS, seed=batch)
            response = _predict_when_up(stub, _request(inputs), proc)
            got = tf.make_ndarray(response.outputs["score"])
            want = reference_model(**{k: tf.constant(v) for k, v in inputs.items()})["score"]
            assert got.shape == (batch, 1)
            np.testing.assert_allclose(got, want.numpy(), rtol=0, atol=1e-6)
            assert response.model_spec.name == "demo"
            assert response.model_spec.version.value == 1
            assert response.model_spec.signature_name == "serving_default"
        with pytest.raises(grpc.RpcError) as info:
            stub.Predict(_request(demo_inputs(1, DEMO_ROWS), name="nope"), timeout=30)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        assert info.value.details() == "Servable not found for request: Latest(nope)"


def test_plain_peer_exits_cleanly_on_sigterm(plain_peer) -> None:
    proc, target = plain_peer
    with grpc.insecure_channel(target) as channel:
        stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
        _predict_when_up(stub, _request(demo_inputs(1, DEMO_ROWS)), proc)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(20) == 0


def test_plain_peer_is_one_instance_by_definition(demo_model_dir: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "bench.peers.plain", "--model-dir", str(demo_model_dir / "1"),
         "--port", "0", "--instances", "2"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "--instances must be 1" in proc.stderr


def test_peer_server_serves_the_official_clients_answer_and_stops(
    demo_model_dir: Path, reference_model, tmp_path: Path
) -> None:
    inputs = demo_inputs(4, DEMO_ROWS, seed=3)
    request = harness.predict_request("b4", "demo", inputs)
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    with PeerServer(PEERS["plain"], demo_model_dir / "1", 2, tmp_path / "p.log", env) as peer:
        server = peer.wait_ready(request)
        assert peer.instances == 1 and server.name == "plain TF gRPC (1 process)"
        assert [p.pid for p in server.roles["server"]] == [peer.proc.pid]
        raw = harness.call(server.target, request)
        want = reference_model(**{k: tf.constant(v) for k, v in inputs.items()})["score"]
        np.testing.assert_allclose(harness.answer_values(request, raw), want.numpy(), atol=1e-6)
    assert peer.proc.returncode == 0 and peer.leftovers() == []


def test_a_peer_without_its_venv_says_how_to_install_it() -> None:
    missing = PEERS["ray"].__class__(**{**PEERS["ray"].__dict__, "venv": ".tools/nowhere"})
    assert missing.unavailable() == "not installed: run bench/peers/setup-ray"
