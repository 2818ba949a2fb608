"""A pool of several models, from one TF Serving `--model_config_file`: each model has its own
workers, versions, weight segments and labels, and the front door routes by the name (then
the version or label) a request gives.

The pool serves the demo model as "wdl" (versions 1 and 2, labels stable and canary) and a
Keras 3 model exported with `model.export()` as "ranker" (test_model_zoo's `keras_export`;
its own worker count, from `--model-workers`). Every answer is compared with a direct
TensorFlow call of the version it names; the official client, `curl` for REST.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import psutil
import pytest
import tensorflow as tf
from google.protobuf import text_format
from tensorflow_serving.apis import (
    get_model_metadata_pb2,
    get_model_status_pb2,
    model_service_pb2_grpc,
    predict_pb2,
    prediction_service_pb2_grpc,
)
from test_model_zoo import _direct, keras_export
from test_rest import curl

from mpspool.demo_model import build_demo_model, demo_inputs

from poolproc import Pool, mpspool_cmd

ROWS = 2000


def _config_file(path: Path, wdl: Path, ranker: Path) -> None:
    """The file TF Serving would read, written with its own messages."""
    from tensorflow_serving.config import model_server_config_pb2

    config = model_server_config_pb2.ModelServerConfig()
    model = config.model_config_list.config.add(name="wdl", base_path=str(wdl))
    model.model_platform = "tensorflow"
    model.model_version_policy.specific.versions.extend([1, 2])
    model.version_labels.update({"stable": 1, "canary": 2})
    config.model_config_list.config.add(name="ranker", base_path=str(ranker))
    path.write_text(text_format.MessageToString(config))


def _config_file_pool(tmp_path: Path, first: Path, config_file: Path, *extra: str) -> Pool:
    """A pool (not started) serving the models of `config_file`, one worker each by default;
    `first` stands in for the base path the harness names (the file's names and paths win)."""
    (tmp_path / "pool").mkdir()
    pool = Pool(tmp_path / "pool", first, 1, *extra)
    at = pool.args.index("--model-base-path")
    pool.args[at : at + 4] = ["--model_config_file", str(config_file)]
    return pool


def _predict(
    channel: grpc.Channel,
    model: str,
    inputs: dict[str, np.ndarray],
    version: int | None = None,
    label: str = "",
) -> predict_pb2.PredictResponse:
    request = predict_pb2.PredictRequest()
    request.model_spec.name = model
    if version is not None:
        request.model_spec.version.value = version
    if label:
        request.model_spec.version_label = label
    for name, array in inputs.items():
        request.inputs[name].CopyFrom(tf.make_tensor_proto(array))
    stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
    return stub.Predict(request, timeout=30)


def _check(answer: predict_pb2.PredictResponse, want: dict[str, np.ndarray]) -> None:
    for name, values in want.items():
        got = tf.make_ndarray(answer.outputs[name])
        np.testing.assert_allclose(got, values, rtol=0, atol=1e-5, err_msg=name)


def _states(status: dict[str, Any]) -> dict[str, dict[int, str]]:
    return {
        m["name"]: {v["version"]: v["state"] for v in m["versions"]}
        for m in status.get("models", [])
    }


def test_two_models_from_one_config_file_each_on_its_own_workers(tmp_path: Path) -> None:
    wdl, ranker = tmp_path / "wdl", tmp_path / "ranker"
    for version in (1, 2):
        build_demo_model(wdl, embedding_rows=ROWS, version=version, seed=version)
    ranker_inputs = keras_export(ranker / "1")
    wdl_inputs = demo_inputs(3, ROWS, seed=7)
    want = {
        ("wdl", 1): _direct(wdl / "1", wdl_inputs),
        ("wdl", 2): _direct(wdl / "2", wdl_inputs),
        ("ranker", 1): _direct(ranker / "1", ranker_inputs),
    }
    config_file = tmp_path / "models.config"
    _config_file(config_file, wdl, ranker)

    pool = _config_file_pool(tmp_path, wdl, config_file, "--model-workers", "ranker=2")
    pool.start()
    try:
        status = pool.wait_for(
            lambda s: (
                _states(s) == {"wdl": {1: "AVAILABLE", 2: "AVAILABLE"}, "ranker": {1: "AVAILABLE"}}
            ),
            timeout=120,
            what="both models serving",
        )
        status = pool.wait_ready(4)
        # Each model's own workers: wdl one per version (--workers 1), ranker two.
        slots = sorted((s["model"], s["slot"], s["version"]) for s in status["slots"])
        assert slots == [
            ("", "cpu-0", 1),
            ("", "cpu-0", 2),
            ("ranker", "cpu-0", 1),
            ("ranker", "cpu-1", 1),
        ]
        for slot in status["slots"]:
            assert slot["weights"] and slot["weights"]["copied"] == {}, slot
        segments = {s["weights"]["segment"] for s in status["slots"]}
        assert len(segments) == 3, "one weight segment per (model, version)"
        assert [(m["name"], m["version_labels"]) for m in status["models"]] == [
            ("wdl", {"stable": 1, "canary": 2}),
            ("ranker", {}),
        ]

        with pool.channel() as channel:
            # By name: the newest version of each.
            answer = _predict(channel, "wdl", wdl_inputs)
            assert (answer.model_spec.name, answer.model_spec.version.value) == ("wdl", 2)
            _check(answer, want["wdl", 2])
            for _ in range(3):  # both of ranker's workers
                answer = _predict(channel, "ranker", ranker_inputs)
                assert (answer.model_spec.name, answer.model_spec.version.value) == ("ranker", 1)
                _check(answer, want["ranker", 1])
            # By version, and by label.
            _check(_predict(channel, "wdl", wdl_inputs, version=1), want["wdl", 1])
            for label, version in (("stable", 1), ("canary", 2)):
                answer = _predict(channel, "wdl", wdl_inputs, label=label)
                assert answer.model_spec.version.value == version
                _check(answer, want["wdl", version])
            # Labels are each model's own: ranker has none; an unknown one is TF Serving's error.
            for model in ("wdl", "ranker"):
                with pytest.raises(grpc.RpcError) as refused:
                    _predict(channel, model, wdl_inputs, label="beta")
                assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert refused.value.details() == "Unrecognized servable version label: beta"
            with pytest.raises(grpc.RpcError) as refused:
                _predict(channel, "ranker", ranker_inputs, version=2)
            assert refused.value.code() == grpc.StatusCode.NOT_FOUND
            with pytest.raises(grpc.RpcError) as refused:
                _predict(channel, "nope", ranker_inputs)
            assert refused.value.code() == grpc.StatusCode.NOT_FOUND
            assert "nope" in refused.value.details()
            # A request shaped for the other model: its own signature's error, nothing dies.
            with pytest.raises(grpc.RpcError) as refused:
                _predict(channel, "ranker", wdl_inputs)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT

            # Status and metadata per model.
            stub = model_service_pb2_grpc.ModelServiceStub(channel)
            request = get_model_status_pb2.GetModelStatusRequest()
            request.model_spec.name = "ranker"
            states = stub.GetModelStatus(request, timeout=30).model_version_status
            assert [(s.version, s.state) for s in states] == [
                (1, get_model_status_pb2.ModelVersionStatus.AVAILABLE)
            ]
            metadata = get_model_metadata_pb2.GetModelMetadataRequest()
            metadata.model_spec.name = "ranker"
            metadata.metadata_field.append("signature_def")
            answer = prediction_service_pb2_grpc.PredictionServiceStub(channel).GetModelMetadata(
                metadata, timeout=30
            )
            assert answer.model_spec.name == "ranker"
            signatures = get_model_metadata_pb2.SignatureDefMap()
            answer.metadata["signature_def"].Unpack(signatures)
            assert set(signatures.signature_def["serving_default"].inputs) == {"ids", "features"}

        body = json.dumps({"inputs": {k: v.tolist() for k, v in ranker_inputs.items()}})
        _, answer = curl(pool, "ranker:predict", body)
        outputs = np.array(answer["outputs"], dtype=np.float32)
        np.testing.assert_allclose(outputs, next(iter(want["ranker", 1].values())), atol=1e-5)

        shown = subprocess.run(
            mpspool_cmd("status", "--run-dir", str(pool.run_dir)),
            capture_output=True, text=True, timeout=30, check=True,
        ).stdout  # fmt: skip
        assert "model 'wdl' labels: canary=2, stable=1" in shown
        assert "model 'ranker' versions (latest:1): 1 AVAILABLE" in shown
        assert "ranker/cpu-1" in shown
    finally:
        assert pool.stop() == 0
    assert pool.leftovers() == []


def test_models_are_added_and_removed_while_another_serves_without_a_failed_request(
    tmp_path: Path,
) -> None:
    """The config file rewritten with a second model: it loads on workers of its own and
    serves; a HandleReloadConfigRequest without it: it leaves at once (NOT_FOUND; its status
    END), its workers and weight segment go, and the file, unchanged, does not bring it back.
    The first model answers throughout, every answer right."""
    import threading

    from tensorflow_serving.apis import model_management_pb2
    from tensorflow_serving.config import model_server_config_pb2

    wdl, ranker = tmp_path / "wdl", tmp_path / "ranker"
    build_demo_model(wdl, embedding_rows=ROWS, version=1, seed=1)
    ranker_inputs = keras_export(ranker / "1")
    wdl_inputs = demo_inputs(3, ROWS, seed=7)
    want_wdl = _direct(wdl / "1", wdl_inputs)
    want_ranker = _direct(ranker / "1", ranker_inputs)
    config_file = tmp_path / "models.config"
    one = model_server_config_pb2.ModelServerConfig()
    one.model_config_list.config.add(name="wdl", base_path=str(wdl))
    config_file.write_text(text_format.MessageToString(one))

    pool = _config_file_pool(
        tmp_path, wdl, config_file, "--model_config_file_poll_wait_seconds", "0.2"
    )
    pool.start()
    answered, failed = [0], []
    stop = threading.Event()

    def load() -> None:
        with pool.channel() as channel:
            while not stop.is_set():
                try:
                    _check(_predict(channel, "wdl", wdl_inputs), want_wdl)
                    answered[0] += 1
                except (grpc.RpcError, AssertionError) as exc:
                    failed.append(repr(exc))

    try:
        pool.wait_ready(1)
        loader = threading.Thread(target=load)
        loader.start()
        two = model_server_config_pb2.ModelServerConfig()
        two.CopyFrom(one)
        two.model_config_list.config.add(name="ranker", base_path=str(ranker))
        config_file.write_text(text_format.MessageToString(two))
        status = pool.wait_for(
            lambda s: _states(s).get("ranker") == {1: "AVAILABLE"},
            timeout=90,
            what="ranker added and serving",
        )
        assert [s["model"] for s in status["slots"]] == ["", "ranker"]
        with pool.channel() as channel:
            _check(_predict(channel, "ranker", ranker_inputs), want_ranker)
            segment = next(s for s in status["slots"] if s["model"] == "ranker")
            segment = segment["weights"]["segment"]
            assert Path(segment).exists()

            # Removed by a reload. The file, unchanged since it was read, does not undo it.
            request = model_management_pb2.ReloadConfigRequest()
            request.config.CopyFrom(one)
            answer = model_service_pb2_grpc.ModelServiceStub(channel).HandleReloadConfigRequest(
                request, timeout=60
            )
            assert answer.status.error_code == 0
            with pytest.raises(grpc.RpcError) as refused:
                _predict(channel, "ranker", ranker_inputs)
            assert refused.value.code() == grpc.StatusCode.NOT_FOUND
            # Its status stays known: UNLOADING while its workers drain, then END, as TF
            # Serving's state monitor says them.
            request = get_model_status_pb2.GetModelStatusRequest()
            request.model_spec.name = "ranker"
            states = get_model_status_pb2.ModelVersionStatus
            leaving = model_service_pb2_grpc.ModelServiceStub(channel).GetModelStatus(request)
            assert [v.version for v in leaving.model_version_status] == [1]
            assert leaving.model_version_status[0].state in (states.UNLOADING, states.END)
        status = pool.wait_for(
            lambda s: [m["name"] for m in s["models"]] == ["wdl"] and len(s["slots"]) == 1,
            timeout=60,
            what="ranker's workers ended",
        )
        with pool.channel() as channel:
            stub = model_service_pb2_grpc.ModelServiceStub(channel)
            for _ in range(50):  # told at the controller's next tick
                ended = stub.GetModelStatus(request)
                if ended.model_version_status[0].state == states.END:
                    break
                time.sleep(0.1)
            assert [(v.version, v.state) for v in ended.model_version_status] == [(1, states.END)]
        assert not Path(segment).exists(), "its weight segment unlinked"
        time.sleep(1.0)  # five reads of the file, which still lists ranker
        assert [m["name"] for m in pool.status()["models"]] == ["wdl"]
        stop.set()
        loader.join(timeout=30)
        assert failed == [], failed[:3]
        assert answered[0] > 20
    finally:
        stop.set()
        assert pool.stop() == 0
    assert pool.leftovers() == []


def test_a_reload_waiting_when_the_pool_stops_is_answered_at_once(tmp_path: Path) -> None:
    """A HandleReloadConfigRequest in effect (a model it adds still loading) when the pool is
    told to stop: answered UNAVAILABLE at once, and the stop does not wait for it. The
    controller takes no request once it stops, and the call held the front door's drain for
    its whole grace (10 s), then was cut by the GOAWAY (found by a hunt); a request sent
    during the drain is answered so at once too. A model added while the pool serves is
    NOT_FOUND until its first version loads, never UNAVAILABLE (it was, for a moment)."""
    from tensorflow_serving.apis import model_management_pb2
    from tensorflow_serving.config import model_server_config_pb2

    wdl, ranker = tmp_path / "wdl", tmp_path / "ranker"
    build_demo_model(wdl, embedding_rows=ROWS, version=1, seed=1)
    build_demo_model(ranker, embedding_rows=ROWS, version=1, seed=2)
    wdl_inputs = demo_inputs(3, ROWS, seed=7)
    (tmp_path / "pool").mkdir()
    pool = Pool(tmp_path / "pool", wdl, 1, "--shutdown-delay", "2").start()
    try:
        pool.wait_ready(1)
        two = model_server_config_pb2.ModelServerConfig()
        two.model_config_list.config.add(name="demo", base_path=str(wdl))
        two.model_config_list.config.add(name="ranker", base_path=str(ranker))
        request = model_management_pb2.ReloadConfigRequest()
        request.config.CopyFrom(two)
        with pool.channel() as channel:
            stub = model_service_pb2_grpc.ModelServiceStub(channel)
            waiting = stub.HandleReloadConfigRequest.future(request, timeout=120)
            pool.wait_for(
                lambda s: "ranker" in _states(s),
                timeout=60,
                what="ranker added, loading",
            )
            with pytest.raises(grpc.RpcError) as loading:
                _predict(channel, "ranker", wdl_inputs)
            assert loading.value.code() == grpc.StatusCode.NOT_FOUND, loading.value.details()
            assert not waiting.done(), "in effect until ranker serves"
            began = time.monotonic()
            pool.signal(signal.SIGTERM)
            with pytest.raises(grpc.RpcError) as stopping:
                waiting.result(timeout=30)
            took = time.monotonic() - began
            assert stopping.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "the pool is stopping" in stopping.value.details()
            assert took < 5, f"answered after {took:.1f} s"
            # During the drain's delay: a new request is answered at once as well.
            with pytest.raises(grpc.RpcError) as later:
                stub.HandleReloadConfigRequest(request, timeout=30)
            assert later.value.code() == grpc.StatusCode.UNAVAILABLE
        assert pool.proc is not None and pool.proc.wait(timeout=30) == 0
        assert time.monotonic() - began < 9, "the stop did not wait the drain's grace"
    finally:
        pool.kill()
    assert pool.leftovers() == []


def test_removing_a_model_whose_worker_ignores_its_stop_holds_nothing_else(
    tmp_path: Path,
) -> None:
    """A removed model's worker that does not end at SIGTERM (stopped: SIGSTOP) is left to
    supervisord's SIGKILL 10 s later while the controller goes on: status answers meanwhile
    (the controller waited the 10 s out, deaf to status, restarts, reloads and the file's
    polls; found by a review). The model added back meanwhile reuses that worker's program
    group: it loads once the old process has ended (its start spawned nothing, and the old
    process's SIGKILL then failed the load; found by a review), and serves."""
    from tensorflow_serving.apis import model_management_pb2
    from tensorflow_serving.config import model_server_config_pb2

    wdl, ranker = tmp_path / "wdl", tmp_path / "ranker"
    build_demo_model(wdl, embedding_rows=ROWS, version=1, seed=1)
    build_demo_model(ranker, embedding_rows=ROWS, version=1, seed=2)
    inputs = demo_inputs(3, ROWS, seed=7)
    want = _direct(ranker / "1", inputs)
    config_file = tmp_path / "models.config"
    both = model_server_config_pb2.ModelServerConfig()
    both.model_config_list.config.add(name="wdl", base_path=str(wdl))
    both.model_config_list.config.add(name="ranker", base_path=str(ranker))
    config_file.write_text(text_format.MessageToString(both))
    # No load retries: a load the old process's end failed is seen, not tried again.
    pool = _config_file_pool(tmp_path, wdl, config_file, "--max_num_load_retries", "0")
    pool.start()
    stopped = 0
    try:
        status = pool.wait_ready(2)
        (stuck,) = [s for s in status["slots"] if s["model"] == "ranker"]
        stopped = stuck["pid"]
        os.kill(stopped, signal.SIGSTOP)
        removed_at = time.monotonic()
        wdl_only = model_management_pb2.ReloadConfigRequest()
        wdl_only.config.model_config_list.config.add(name="wdl", base_path=str(wdl))
        with pool.channel() as channel:
            service = model_service_pb2_grpc.ModelServiceStub(channel)
            answer = service.HandleReloadConfigRequest(wdl_only, timeout=60)
            assert answer.status.error_code == 0, answer
            # Each status answers (within the CLI's 5 s) while supervisord waits to SIGKILL it.
            status = pool.wait_for(
                lambda s: [m["name"] for m in s["models"]] == ["wdl"] and len(s["slots"]) == 1,
                timeout=8,
                what="ranker removed from the pool's models",
            )
            pool.status()
            assert psutil.Process(stopped).status() == psutil.STATUS_STOPPED
            assert time.monotonic() - removed_at < 9, "added back before its SIGKILL"
            again = model_management_pb2.ReloadConfigRequest()
            again.config.CopyFrom(both)
            answer = service.HandleReloadConfigRequest(again, timeout=90)
            assert answer.status.error_code == 0, answer
            answer = _predict(channel, "ranker", inputs)
            assert answer.model_spec.version.value == 1
            _check(answer, want)
        with contextlib.suppress(psutil.NoSuchProcess):
            assert psutil.Process(stopped).status() == psutil.STATUS_ZOMBIE
        status = pool.status()
        (ranker_slot,) = [s for s in status["slots"] if s["model"] == "ranker"]
        assert ranker_slot["pid"] != stopped and ranker_slot["state"] == "READY"
    finally:
        with contextlib.suppress(ProcessLookupError):
            if stopped:
                os.kill(stopped, signal.SIGCONT)
        assert pool.stop() == 0
    assert pool.leftovers() == []
