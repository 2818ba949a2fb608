"""TF Serving's --grpc_socket_path: the pool's gRPC API on a UNIX socket beside its TCP port,
for a client on the same host (a sidecar) -- the official client with a `unix:` target --
with the same calls, health and drain, its calls local ones (HandleReloadConfigRequest is
taken); a socket left at the path by a front door that was killed is replaced, and the
socket is gone once the pool stops.

gRPC's C core (Python, C++) names a `unix:` target's percent-encoded path as the call's
:authority, which the front door's HTTP/2 library (h2) alone would refuse as malformed
(hyperium/h2#487, grpc/grpc#38142); the front door makes it `localhost` on this listener
(router/src/uds_authority.rs), so the official client works with its defaults, as with
TF Serving, and with `grpc.default_authority` set as grpc-go and tonic send it."""

from __future__ import annotations

import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import grpc
import numpy as np
import pytest

from mpspool.demo_model import demo_inputs

from conftest import DEMO_ROWS
from poolproc import Pool, mpspool_cmd


def test_the_pool_answers_on_its_unix_socket_and_removes_it_when_it_stops(
    tmp_path: Path, demo_model_dir: Path
) -> None:
    import tensorflow as tf
    from google.protobuf import text_format
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from tensorflow_serving.apis import (
        model_management_pb2,
        model_service_pb2_grpc,
        predict_pb2,
        prediction_service_pb2_grpc,
    )

    path = Path(f"/tmp/mpspool-test-{os.getpid()}.sock")  # short: a socket path's limit
    left = socket.socket(socket.AF_UNIX)
    left.bind(str(path))  # as a killed front door leaves its socket
    left.close()
    assert stat.S_ISSOCK(path.lstat().st_mode)
    pool = Pool(tmp_path, demo_model_dir, 1, f"--grpc_socket_path={path}").start()
    try:
        status = pool.wait_ready(1)
        assert status["pool"]["grpc_socket"] == f"unix:{path}"
        local = [("grpc.default_authority", "localhost")]
        with grpc.insecure_channel(f"unix:{path}", options=local) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            assert (
                health.Check(health_pb2.HealthCheckRequest(), timeout=5).status
                == health_pb2.HealthCheckResponse.SERVING
            )
        # The C core's own authority (the socket's path, percent-encoded), many calls on one
        # connection: the first indexes it in HPACK's table, the next ones refer to it.
        with grpc.insecure_channel(f"unix:{path}") as channel:
            stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
            request = predict_pb2.PredictRequest()
            request.model_spec.name = "demo"
            inputs = demo_inputs(3, DEMO_ROWS, seed=5)
            for name, array in inputs.items():
                request.inputs[name].CopyFrom(tf.make_tensor_proto(array))
            answers = [stub.Predict(request, timeout=30).outputs["score"] for _ in range(5)]
            over_unix = tf.make_ndarray(answers[0])
            assert all(np.array_equal(tf.make_ndarray(a), over_unix) for a in answers)
            health = health_pb2_grpc.HealthStub(channel)
            assert (
                health.Check(health_pb2.HealthCheckRequest(), timeout=5).status
                == health_pb2.HealthCheckResponse.SERVING
            )
            # An admin call: taken, as from this host (a TCP client elsewhere is refused).
            reload = model_management_pb2.ReloadConfigRequest()
            text_format.Parse(
                f'model_config_list {{ config {{ name: "demo" base_path: "{demo_model_dir}" '
                'model_platform: "tensorflow" } }',
                reload.config,
            )
            answer = model_service_pb2_grpc.ModelServiceStub(channel).HandleReloadConfigRequest(
                reload, timeout=60
            )
            assert answer.status.error_code == 0, answer.status.error_message
        with pool.channel() as channel:
            over_tcp = prediction_service_pb2_grpc.PredictionServiceStub(channel).Predict(
                request, timeout=30
            )
        np.testing.assert_array_equal(over_unix, tf.make_ndarray(over_tcp.outputs["score"]))
        # Headers past the front door's limits, over both listeners alike (the socket's through
        # its rewrite): past 16 KiB that call is refused (431), past 64 KiB its connection
        # ends with h2's GOAWAY; the channel's next call is answered either way.
        for target in (f"127.0.0.1:{pool.port}", f"unix:{path}"):
            with grpc.insecure_channel(target) as channel:
                stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
                for size, code, says in [
                    (20_000, grpc.StatusCode.UNKNOWN, "status: 431"),
                    (70_000, grpc.StatusCode.UNAVAILABLE, "header_list_way_too_large"),
                ]:
                    with pytest.raises(grpc.RpcError) as refused:
                        stub.Predict(request, timeout=30, metadata=[("x-big", "v" * size)])
                    assert refused.value.code() == code, (target, refused.value)
                    assert says in refused.value.details(), (target, refused.value.details())
                    stub.Predict(request, timeout=30)
        shown = subprocess.run(
            mpspool_cmd("status", "--run-dir", str(pool.run_dir)),
            capture_output=True, text=True, timeout=30, check=True,
        ).stdout  # fmt: skip
        assert f"gRPC also on: unix:{path}" in shown
        assert pool.stop() == 0
        assert not path.exists(), "the socket goes with the front door"
        assert pool.leftovers() == []
    finally:
        pool.kill()
        path.unlink(missing_ok=True)


def test_a_path_that_cannot_be_the_socket_is_refused_before_anything_starts(
    tmp_path: Path, demo_model_dir: Path
) -> None:
    taken = tmp_path / "notes.txt"
    taken.write_text("mine")
    live = socket.socket(socket.AF_UNIX)
    live.bind(str(tmp_path / "live.sock"))
    live.listen()
    cases = [
        (taken, "exists and is not a socket"),
        (tmp_path / "live.sock", "is a socket another server listens on"),
        (Path("/tmp") / ("s" * 120), "at most 107 bytes"),
        (tmp_path / "missing" / "tfs.sock", "its directory does not exist"),
    ]
    if os.geteuid() == 0:
        # Another user's directory: its owner could put their own socket in the pool's
        # place (found by a hunt).
        theirs = tmp_path / "theirs"
        theirs.mkdir()
        os.chown(theirs, NOBODY, NOBODY)
        cases.append((theirs / "tfs.sock", f"is of uid {NOBODY}, not yours"))
    for path, says in cases:
        done = subprocess.run(
            mpspool_cmd("start", "--model-base-path", str(demo_model_dir),
                        "--run-dir", str(tmp_path / "run"), "--grpc_socket_path", str(path)),
            capture_output=True, text=True, timeout=60, cwd=tmp_path,
        )  # fmt: skip
        assert done.returncode == 2, done.stderr
        assert says in done.stderr, done.stderr
    live.close()
    assert taken.read_text() == "mine"


@pytest.mark.parametrize("flag", ["--grpc_socket_path", "--grpc-socket-path"])
def test_a_relative_path_is_made_absolute_at_start(flag: str, tmp_path: Path) -> None:
    from mpspool.cli import build_parser

    args = build_parser().parse_args(["start", "--demo", flag, "tfs.sock"])
    assert args.grpc_socket_path == "tfs.sock"
    # Empty, TF Serving's default: no socket.
    assert build_parser().parse_args(["start", "--demo", f"{flag}="]).grpc_socket_path == ""


NOBODY = 65534
AS_NOBODY = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
# A raw unary call as another user: only grpc imported (no TensorFlow), the request's bytes
# made by the test; prints the status code's name.
_RAW_CALL = """
import sys, grpc
target, body = sys.argv[1], open(sys.argv[2], "rb").read()
with grpc.insecure_channel(target) as channel:
    call = channel.unary_unary("/tensorflow.serving.ModelService/HandleReloadConfigRequest")
    try:
        call(body, timeout=60)
        print("OK")
    except grpc.RpcError as exc:
        print(exc.code().name, exc.details())
"""


def test_an_admin_call_over_tcp_is_taken_from_the_pools_user_only(
    tmp_path: Path, demo_model_dir: Path
) -> None:
    """HandleReloadConfigRequest from this host, but from another user: refused. Any local
    user could add a model to a pool running as root, whose workers then ran that user's
    SavedModel as root (found by a hunt)."""
    from google.protobuf import text_format
    from tensorflow_serving.apis import model_management_pb2

    probe = subprocess.run([*AS_NOBODY, sys.executable, "-c", "import grpc"], capture_output=True)
    if os.getuid() != 0 or probe.returncode != 0:
        pytest.skip("needs root and setpriv to call as another user")
    # Where the other user can read them (pytest's own directories are root's alone).
    shared = Path(tempfile.mkdtemp(prefix="mpt-nobody-", dir="/tmp"))
    shared.chmod(0o755)
    script = shared / "call.py"
    script.write_text(_RAW_CALL)
    request = model_management_pb2.ReloadConfigRequest()
    text_format.Parse(
        f'model_config_list {{ config {{ name: "demo" base_path: "{demo_model_dir}" '
        'model_platform: "tensorflow" } }',
        request.config,
    )
    body = shared / "request.bin"
    body.write_bytes(request.SerializeToString())
    for path in (script, body):
        path.chmod(0o644)
    pool = Pool(tmp_path, demo_model_dir, 1).start()
    try:
        pool.wait_ready(1)
        target = f"127.0.0.1:{pool.port}"

        def call(*as_user: str) -> str:
            done = subprocess.run(
                [*as_user, sys.executable, str(script), target, str(body)],
                capture_output=True, text=True, timeout=90,
            )  # fmt: skip
            assert done.returncode == 0, done.stderr[-2000:]
            return done.stdout.strip()

        refused = call(*AS_NOBODY)
        assert refused == (
            "PERMISSION_DENIED HandleReloadConfigRequest changes the pool's configuration, an "
            "admin action: it is taken only from the user the pool runs as (or root)"
        ), refused
        assert call() == "OK"
        assert pool.stop() == 0
    finally:
        pool.kill()
        shutil.rmtree(shared)
