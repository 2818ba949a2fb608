"""Model versions served by groups of worker processes: the version policy, and a real pool
picking up new versions under load (supervisor/versions.py, the controller, the front door's
version table).

The pool test keeps 4 client threads sending Predicts (the official client) while versions
come and go under the base path; every answer is checked against a direct TensorFlow call of
the version its `model_spec.version` names, and no request may fail.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import requests
import tensorflow as tf
from google.protobuf import text_format
from tensorflow.core.protobuf import error_codes_pb2
from tensorflow_serving.apis import (
    get_model_status_pb2,
    model_management_pb2,
    model_service_pb2_grpc,
    predict_pb2,
    prediction_service_pb2_grpc,
)

from mpspool import segment
from mpspool.demo_model import build_demo_model, demo_inputs
from mpspool.supervisor.versions import VersionPolicy

from conftest import DEMO_ROWS
from poolproc import Pool, mpspool_cmd, prometheus_samples

ROWS = 2000


@pytest.mark.parametrize(
    "text, on_disk, failed, wanted",
    [
        ("latest", {1, 2, 3}, set(), {3}),
        ("latest:2", {1, 2, 3}, set(), {2, 3}),
        ("latest", {1, 2, 3}, {3}, {2}),  # a failed version is passed over
        ("all", {1, 2, 3}, {2}, {1, 3}),
        ("specific:1,3", {1, 2}, set(), {1}),
        ("latest", set(), set(), set()),
    ],
)
def test_the_version_policy_picks_as_tf_serving(
    text: str, on_disk: set[int], failed: set[int], wanted: set[int]
) -> None:
    assert VersionPolicy.parse(text).aspired(on_disk, failed) == wanted


@pytest.mark.parametrize("text", ["latest:0", "newest", "specific:", "all:2", "specific:a"])
def test_a_bad_version_policy_is_refused(text: str) -> None:
    with pytest.raises(ValueError):
        VersionPolicy.parse(text)


class CheckedLoad:
    """Client threads sending fixed inputs; each answer is compared with what the version
    it names computes, and the versions seen are kept in arrival order.

    Each thread pauses ``pause`` seconds between requests: a steady load (about 270 answers/s
    here), not a saturating one. New versions load at idle priority (--loading-priority's
    default), so under four closed loops on 2 cores they got the CPU only between requests and
    the test below took 150-168 s, most of it waiting for loads (47 s paced, 2026-11-25)."""

    def __init__(
        self,
        port: int,
        want: dict[int, np.ndarray],
        inputs: dict[str, np.ndarray],
        pause: float = 0.01,
    ):
        self.port = port
        self.pause = pause
        self.want = want
        self.request = predict_pb2.PredictRequest()
        self.request.model_spec.name = "demo"
        for name, array in inputs.items():
            self.request.inputs[name].CopyFrom(tf.make_tensor_proto(array))
        self.stop_flag = threading.Event()
        self.lock = threading.Lock()
        self.versions: list[int] = []
        self.problems: list[str] = []
        self.threads = [threading.Thread(target=self._loop, daemon=True) for _ in range(4)]

    def start(self) -> CheckedLoad:
        for thread in self.threads:
            thread.start()
        return self

    def _loop(self) -> None:
        with grpc.insecure_channel(f"127.0.0.1:{self.port}") as channel:
            stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
            while not self.stop_flag.is_set():
                try:
                    response = stub.Predict(self.request, timeout=30)
                except grpc.RpcError as exc:
                    with self.lock:
                        self.problems.append(f"{exc.code()}: {exc.details()}")
                    continue
                version = response.model_spec.version.value
                got = tf.make_ndarray(response.outputs["score"])
                want = self.want.get(version)
                with self.lock:
                    self.versions.append(version)
                    if want is None or not np.allclose(got, want, rtol=0, atol=1e-6):
                        self.problems.append(f"version {version} answered {got.ravel()[:3]}")
                self.stop_flag.wait(self.pause)

    def seen(self) -> list[int]:
        with self.lock:
            return list(self.versions)

    def stop(self) -> None:
        self.stop_flag.set()
        for thread in self.threads:
            thread.join(40)


def _direct(version_dir: Path, inputs: dict[str, np.ndarray]) -> np.ndarray:
    function = tf.saved_model.load(str(version_dir)).signatures["serving_default"]
    return function(**{k: tf.constant(v) for k, v in inputs.items()})["score"].numpy()


def _versions(status: dict[str, Any]) -> dict[int, tuple[str, str]]:
    return {v["version"]: (v["state"], v["error"]) for v in status["versions"]}


def _segments(pool_id: str) -> list[str]:
    return sorted(p.name for p in segment.SHM_DIR.glob(f"mpspool-{pool_id}-*"))


def test_new_versions_take_over_under_load_and_a_broken_one_never_serves(tmp_path: Path) -> None:
    base, staging = tmp_path / "model", tmp_path / "staging"
    build_demo_model(base, embedding_rows=ROWS, version=1, seed=1)
    build_demo_model(staging, embedding_rows=ROWS, version=2, seed=2)
    inputs = demo_inputs(3, ROWS, seed=7)
    want = {1: _direct(base / "1", inputs), 2: _direct(staging / "2", inputs)}
    assert not np.allclose(want[1], want[2]), "the versions must answer differently"

    (tmp_path / "pool").mkdir()
    monitoring = tmp_path / "monitoring.config"
    monitoring.write_text('prometheus_config { enable: true, path: "/metrics" }')
    # No load retries: the broken version 3 below ends at its first failure (a retried load:
    # test_a_version_copied_in_before_its_variables_serves_on_a_load_retry).
    pool = Pool(
        tmp_path / "pool",
        base,
        2,
        "--file_system_poll_wait_seconds",
        "0.2",
        "--max_num_load_retries",
        "0",
        "--monitoring_config_file",
        str(monitoring),
    ).start()
    load = None
    try:
        pool.wait_ready(2)
        load = CheckedLoad(pool.port, want, inputs).start()
        wait = pool.wait_for

        # Another local user who lists /dev/shm and reads version 1's segment name creates
        # the names version 2's would have by that pattern (and their ".partial"), to keep
        # version 2 from loading: the names end in a digest keyed by the pool's secret.
        # (Files of another owner need root to make here; the name's form is checked always.)
        [first] = _segments(pool.pool_id)
        assert re.fullmatch(rf"mpspool-{pool.pool_id}-demo-v1-[0-9a-f]{{16}}", first), first
        foreign = [
            segment.SHM_DIR / f"{name}{end}"
            for name in (first.replace("-v1-", "-v2-"), first.split("-v1-")[0] + "-v2")
            for end in ("", ".partial")
            if os.geteuid() == 0
        ]
        for path in foreign:
            path.write_bytes(b"not yours")
            os.chown(path, 65534, 65534)
        # Version 2 appears: its own workers load while 1 serves; then 1 retires.
        os.rename(staging / "2", base / "2")
        status = wait(
            lambda s: _versions(s) == {1: ("END", ""), 2: ("AVAILABLE", "")},
            timeout=90,
            what="version 2 serving, version 1 retired",
        )
        assert status["pool"]["version"] == 2
        assert {s["version"] for s in status["slots"]} == {2}
        assert {p.name for p in foreign} <= set(_segments(pool.pool_id)), "another's, kept"
        for path in foreign:
            path.unlink()
        assert len(_segments(pool.pool_id)) == 1, "version 1's segment is unlinked"
        # Loaded idle (--loading-priority's default) where the right to leave SCHED_IDLE is
        # there, else at normal priority; either way, serving, each worker's serving thread
        # (its main thread) is SCHED_BATCH (--worker-policy's default) and the others normal.
        for pid in pool.worker_pids():
            policies = {
                int(t): (os.sched_getscheduler(int(t)), os.getpriority(os.PRIO_PROCESS, int(t)))
                for t in os.listdir(f"/proc/{pid}/task")
            }
            assert policies.pop(pid) == (os.SCHED_BATCH, 0), f"worker {pid}"
            assert set(policies.values()) == {(os.SCHED_OTHER, 0)}, f"worker {pid}: {policies}"
        assert pool.output().count("its serving thread batch") >= 4
        seen = len(load.seen())
        time.sleep(1.0)
        assert set(load.seen()[seen:]) == {2}, "once 1 retired, everything is answered by 2"

        # Version 2 removed: 1 is the latest again and comes back in new workers.
        (base / "2").rename(tmp_path / "removed-2")
        wait(
            lambda s: (
                _versions(s).get(1) == ("AVAILABLE", "") and _versions(s).get(2) == ("END", "")
            ),
            timeout=90,
            what="version 1 serving again",
        )

        # A broken version 3 is never served; 1 goes on serving, and status says why.
        (base / "3").mkdir()
        (base / "3" / "saved_model.pb").write_bytes(b"this is not a SavedModel")
        status = wait(
            lambda s: _versions(s).get(3, ("", ""))[0] == "END" and _versions(s)[3][1],
            timeout=60,
            what="version 3 failed",
        )
        # A saved_model.pb that does not parse: its publish fails saying why, as its workers would.
        assert "unreadable saved model" in _versions(status)[3][1]
        assert _versions(status)[1] == ("AVAILABLE", "")
        # TensorFlow's load metrics count it: one failed attempt (its publish, which read
        # the SavedModel for every worker), and no success; version 1's loads succeeded.
        page = requests.get(f"{pool.rest_url}/metrics", timeout=30).text
        samples = prometheus_samples(page)
        attempts = ":tensorflow:cc:saved_model:load_attempt_count"
        assert samples[f'{attempts}{{model_path="{base / "3"}",status="fail"}}'] == 1, page
        assert f'model_path="{base / "3"}",status="success"' not in page
        assert samples[f'{attempts}{{model_path="{base / "1"}",status="success"}}'] >= 2, page
        seen = len(load.seen())
        time.sleep(1.0)
        assert set(load.seen()[seen:]) == {1}

        load.stop()
        assert load.problems == [], load.problems[:5]
        versions = load.seen()
        assert versions[0] == 1 and 2 in versions and versions[-1] == 1

        # GetModelStatus lists every version the pool knows, with the failed one's error.
        with pool.channel() as channel:
            stub = model_service_pb2_grpc.ModelServiceStub(channel)
            request = get_model_status_pb2.GetModelStatusRequest()
            request.model_spec.name = "demo"
            listed = stub.GetModelStatus(request, timeout=10).model_version_status
            states = {s.version: s.state for s in listed}
            assert states == {3: 50, 2: 50, 1: 30}, states  # END, END, AVAILABLE
            failed = next(s for s in listed if s.version == 3)
            assert "unreadable saved model" in failed.status.error_message
            # TF Serving's code for a saved_model.pb that does not parse ("Can't parse ...
            # as binary proto"), given apart from the message as TF Serving gives it.
            assert failed.status.error_code == error_codes_pb2.DATA_LOSS
            assert not failed.status.error_message.startswith("DATA_LOSS")
            # A retired version takes no requests.
            predict = predict_pb2.PredictRequest()
            predict.CopyFrom(load.request)
            predict.model_spec.version.value = 2
            pstub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
            with pytest.raises(grpc.RpcError) as refused:
                pstub.Predict(predict, timeout=10)
            assert refused.value.code() == grpc.StatusCode.NOT_FOUND
            assert refused.value.details() == "Servable not found for request: Specific(demo, 2)"
    finally:
        if load is not None:
            load.stop()
        assert pool.stop() == 0
    assert pool.leftovers() == []


def test_a_version_copied_in_before_its_variables_serves_on_a_load_retry(
    tmp_path: Path, demo_model_dir: Path, reference_model
) -> None:
    """`cp -r` (or `gsutil cp -r`) into the watched base path: saved_model.pb appears before
    variables/. The first load fails, saying so; the version stays LOADING (GetModelStatus:
    no error, as TF Serving while it retries) and version 1 serves on; once the variables are
    there, a retry (--load_retry_interval_micros later) loads it and it takes over. The same
    at the pool's start, with nothing serving yet: the pool exited at once."""
    base = tmp_path / "model"
    shutil.copytree(demo_model_dir / "1", base / "1", ignore=shutil.ignore_patterns("variables"))
    (tmp_path / "pool").mkdir()
    pool = Pool(
        tmp_path / "pool",
        base,
        1,
        "--file_system_poll_wait_seconds",
        "0.2",
        "--load_retry_interval_micros",
        "3000000",
    ).start()
    inputs = demo_inputs(3, DEMO_ROWS, seed=5)
    want = reference_model(**{k: tf.constant(v) for k, v in inputs.items()})["score"].numpy()
    try:
        status = pool.wait_for(
            lambda s: " of 4 failed, tried again" in _versions(s).get(1, ("", ""))[1],
            timeout=60,
            what="version 1's first load failed",
        )
        assert "variables/variables.index does not exist" in _versions(status)[1][1]
        shutil.copytree(demo_model_dir / "1" / "variables", tmp_path / "variables-1")
        os.rename(tmp_path / "variables-1", base / "1" / "variables")
        pool.wait_ready(1)
        # The copy's first half: everything but variables/.
        shutil.copytree(
            demo_model_dir / "1", base / "2", ignore=shutil.ignore_patterns("variables")
        )
        status = pool.wait_for(
            lambda s: " of 4 failed, tried again" in _versions(s).get(2, ("", ""))[1],
            timeout=60,
            what="version 2's first load failed",
        )
        error = _versions(status)[2][1]
        assert "variables/variables.index does not exist" in error, error
        assert "--no-share-weights" not in error, error
        assert _versions(status)[1] == ("AVAILABLE", "")
        with pool.channel() as channel:
            stub = model_service_pb2_grpc.ModelServiceStub(channel)
            request = get_model_status_pb2.GetModelStatusRequest()
            request.model_spec.name = "demo"
            listed = {
                s.version: s for s in stub.GetModelStatus(request, timeout=10).model_version_status
            }
            assert listed[2].state == get_model_status_pb2.ModelVersionStatus.LOADING
            assert listed[2].status.error_message == ""
        # The copy's second half (renamed in whole, so that no try reads half a checkpoint).
        shutil.copytree(demo_model_dir / "1" / "variables", tmp_path / "variables")
        os.rename(tmp_path / "variables", base / "2" / "variables")
        pool.wait_for(
            lambda s: _versions(s) == {1: ("END", ""), 2: ("AVAILABLE", "")},
            timeout=90,
            what="version 2 serving after a retry",
        )
        request = predict_pb2.PredictRequest()
        request.model_spec.name = "demo"
        for name, array in inputs.items():
            request.inputs[name].CopyFrom(tf.make_tensor_proto(array))
        with pool.channel() as channel:
            answer = prediction_service_pb2_grpc.PredictionServiceStub(channel).Predict(
                request, timeout=30
            )
        assert answer.model_spec.version.value == 2
        np.testing.assert_allclose(tf.make_ndarray(answer.outputs["score"]), want, atol=1e-6)
        # The error stays in the controller's log (`mpspool start`'s output).
        assert "version 2 failed to load (try 1 of 4; tried again in 3 s)" in pool.output()
        assert pool.stop() == 0
        assert pool.leftovers() == []
    finally:
        pool.kill()


def _model_config(path: Path, base: Path, versions: list[int], labels: dict[str, int]) -> None:
    """A TF Serving model config file, written with the official messages."""
    from tensorflow_serving.config import model_server_config_pb2

    config = model_server_config_pb2.ModelServerConfig()
    model = config.model_config_list.config.add(name="demo", base_path=str(base))
    model.model_platform = "tensorflow"
    model.model_version_policy.specific.versions.extend(versions)
    model.version_labels.update(labels)
    path.write_text(text_format.MessageToString(config))


def _configmap_update(mount: Path, n: int, write: Callable[[Path], None]) -> None:
    """A ConfigMap's mount made or updated as kubelet does it: the files written in a new
    folder `..n`, the `..data` link swapped to it in one rename, the folder before removed."""
    folder = mount / f"..{n}"
    folder.mkdir(parents=True)
    write(folder / "models.config")
    data = mount / "..data"
    before = os.readlink(data) if data.is_symlink() else None
    (mount / "..data_tmp").symlink_to(folder.name)
    os.replace(mount / "..data_tmp", data)
    if not (mount / "models.config").is_symlink():
        (mount / "models.config").symlink_to("..data/models.config")
    if before is not None:
        shutil.rmtree(mount / before)


def _predict_by_label(channel: grpc.Channel, inputs: dict[str, np.ndarray], label: str):
    request = predict_pb2.PredictRequest()
    request.model_spec.name = "demo"
    request.model_spec.version_label = label
    for name, array in inputs.items():
        request.inputs[name].CopyFrom(tf.make_tensor_proto(array))
    stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
    return stub.Predict(request, timeout=30)


def test_labels_from_a_model_config_file_route_and_move_while_serving(tmp_path: Path) -> None:
    """--model_config_file with two versions and two labels: requests by label (gRPC with the
    official client, REST with curl) reach the version the label names; an unknown label is
    TF Serving's INVALID_ARGUMENT; the file rewritten (policy and label) applies live, and so
    does a HandleReloadConfigRequest."""
    base = tmp_path / "model"
    for version in (1, 2):
        build_demo_model(base, embedding_rows=ROWS, version=version, seed=version)
    inputs = demo_inputs(3, ROWS, seed=7)
    want = {v: _direct(base / str(v), inputs) for v in (1, 2)}
    # Mounted as Kubernetes mounts a ConfigMap: models.config -> ..data/models.config, and
    # ..data -> ..1, which kubelet swaps for a new folder at each update.
    configmap = tmp_path / "configmap"
    labels = {"stable": 1, "canary": 2}
    _configmap_update(configmap, 1, lambda p: _model_config(p, base, [1, 2], labels))
    config_file = configmap / "models.config"

    (tmp_path / "pool").mkdir()
    pool = Pool(
        tmp_path / "pool",
        base,
        1,
        "--model_config_file_poll_wait_seconds",
        "0.2",
        "--allow_version_labels_for_unavailable_models",  # changes nothing above its use below
    )
    at = pool.args.index("--model-base-path")
    pool.args[at : at + 4] = ["--model_config_file", str(config_file)]  # name and path: the file
    pool.start()
    try:
        status = pool.wait_for(
            lambda s: _versions(s) == {1: ("AVAILABLE", ""), 2: ("AVAILABLE", "")},
            timeout=90,
            what="versions 1 and 2 serving",
        )
        pool.wait_ready(2)
        assert status["pool"]["version_labels"] == {"stable": 1, "canary": 2}
        with pool.channel() as channel:
            for label, version in (("stable", 1), ("canary", 2)):
                answer = _predict_by_label(channel, inputs, label)
                assert answer.model_spec.version.value == version
                np.testing.assert_allclose(
                    tf.make_ndarray(answer.outputs["score"]), want[version], atol=1e-6
                )
            with pytest.raises(grpc.RpcError) as refused:
                _predict_by_label(channel, inputs, "beta")
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert refused.value.details() == "Unrecognized servable version label: beta"

        body = json.dumps({"inputs": {k: v.tolist() for k, v in inputs.items()}})
        out = subprocess.run(
            ["curl", "-sS", "-X", "POST", "-d", body,
             f"{pool.rest_url}/v1/models/demo/labels/canary:predict"],
            capture_output=True, text=True, timeout=30, check=True,
        )  # fmt: skip
        outputs = json.loads(out.stdout)["outputs"]
        np.testing.assert_allclose(np.array(outputs, dtype=np.float32), want[2], atol=1e-6)

        # Version 1 dropped from the policy, stable moved to 2: applied while serving, from
        # the ConfigMap's update (the file the pool started from is gone with its folder).
        updated = {"stable": 2, "canary": 2}
        _configmap_update(configmap, 2, lambda p: _model_config(p, base, [2], updated))
        status = pool.wait_for(
            lambda s: _versions(s).get(1, ("", ""))[0] == "END",
            timeout=60,
            what="version 1 retired by the new policy",
        )
        assert status["pool"]["version_labels"] == {"stable": 2, "canary": 2}
        with pool.channel() as channel:
            assert _predict_by_label(channel, inputs, "stable").model_spec.version.value == 2
        shown = subprocess.run(
            mpspool_cmd("status", "--run-dir", str(pool.run_dir)),
            capture_output=True, text=True, timeout=30, check=True,
        ).stdout  # fmt: skip
        assert "labels: canary=2, stable=2" in shown
        assert "versions (specific:2)" in shown
        # --json: what the tests' Pool.status() reads in-process, as the CLI prints it.
        printed = json.loads(subprocess.run(
            mpspool_cmd("status", "--json", "--run-dir", str(pool.run_dir)),
            capture_output=True, text=True, timeout=30, check=True,
        ).stdout)  # fmt: skip
        asked = pool.status()
        assert printed["pool"]["pool_id"] == asked["pool"]["pool_id"]
        assert printed["pool"]["version_labels"] == {"stable": 2, "canary": 2}

        # HandleReloadConfigRequest (the official client): version 1 back, stable on it; the
        # call returns once that is in effect. The file, unchanged, does not undo it.
        with pool.channel() as channel:
            stub = model_service_pb2_grpc.ModelServiceStub(channel)
            request = model_management_pb2.ReloadConfigRequest()
            _model_config(config_file.with_suffix(".rpc"), base, [1, 2], {"stable": 1})
            text_format.Parse(config_file.with_suffix(".rpc").read_text(), request.config)
            answer = stub.HandleReloadConfigRequest(request, timeout=90)
            assert answer.status.error_code == 0
            assert _versions(pool.status())[1] == ("AVAILABLE", "")
            assert _predict_by_label(channel, inputs, "stable").model_spec.version.value == 1
            time.sleep(1.0)  # five reads of the unchanged file
            assert _predict_by_label(channel, inputs, "stable").model_spec.version.value == 1
            # A config moving the model to another base path: refused, nothing changed.
            moved = model_management_pb2.ReloadConfigRequest()
            moved.config.CopyFrom(request.config)
            moved.config.model_config_list.config[0].base_path = str(tmp_path)
            with pytest.raises(grpc.RpcError) as refused:
                stub.HandleReloadConfigRequest(moved, timeout=30)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert f"it is served from {base}" in refused.value.details()
            assert pool.status()["pool"]["version_labels"] == {"stable": 1}

            # A new label naming a version not on disk yet: taken, with TF Serving's flag;
            # requests by it find nothing until that version serves.
            ahead = model_management_pb2.ReloadConfigRequest()
            rpc = config_file.with_suffix(".rpc")
            _model_config(rpc, base, [1, 2], {"stable": 1, "next": 3})
            text_format.Parse(rpc.read_text(), ahead.config)
            assert stub.HandleReloadConfigRequest(ahead, timeout=90).status.error_code == 0
            with pytest.raises(grpc.RpcError) as missing:
                _predict_by_label(channel, inputs, "next")
            assert missing.value.code() == grpc.StatusCode.NOT_FOUND
            assert missing.value.details() == "Servable not found for request: Specific(demo, 3)"
            assert _predict_by_label(channel, inputs, "stable").model_spec.version.value == 1
    finally:
        assert pool.stop() == 0
    assert pool.leftovers() == []


# Root without the capabilities that pass over file permissions: a folder made unreadable
# (chmod 000) is unreadable to the pool, as to any other user.
WITHOUT_DAC_OVERRIDE = (
    "setpriv",
    "--inh-caps=-dac_override,-dac_read_search",
    "--bounding-set=-dac_override,-dac_read_search",
)


def test_an_unreadable_version_folder_fails_its_own_load_and_hides_nothing(
    tmp_path: Path, demo_model_dir: Path
) -> None:
    """A version folder that cannot be looked into (chmod 000, a mount failing) is listed by
    its name, as TF Serving lists them, and its load fails saying why: a newer one beside it
    loads, and the served version's folder made unreadable leaves it serving. Before, the
    first failed every tick of the controller, which gave up after 10 s and ended the pool;
    the second failed the whole listing, so that a newer version never loaded (found by a
    hunt)."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to drop the capability to read any file")
    base = tmp_path / "m"
    shutil.copytree(demo_model_dir / "1", base / "1")
    (tmp_path / "pool").mkdir()
    pool = Pool(
        tmp_path / "pool", base, 1, "--file_system_poll_wait_seconds", "0.2",
        prefix=WITHOUT_DAC_OVERRIDE,
    )  # fmt: skip
    try:
        pool.start().wait_ready(1)
        shutil.copytree(demo_model_dir / "1", base / "2")
        os.chmod(base / "2", 0)
        shutil.copytree(demo_model_dir / "1", base / "3")
        pool.wait_for(
            lambda s: _versions(s).get(3, ("",))[0] == "AVAILABLE",
            timeout=90,
            what="version 3 serving past the unreadable version 2",
        )
        os.chmod(base / "3", 0)  # the one it serves
        time.sleep(12)  # longer than the 10 s after which a failing controller gave up
        assert _versions(pool.status())[3] == ("AVAILABLE", "")
        with pool.channel() as channel:
            request = predict_pb2.PredictRequest()
            request.model_spec.name = "demo"
            for name, array in demo_inputs(2, DEMO_ROWS, seed=1).items():
                request.inputs[name].CopyFrom(tf.make_tensor_proto(array))
            stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
            assert stub.Predict(request, timeout=30).model_spec.version.value == 3
        os.chmod(base / "2", 0o755)
        os.chmod(base / "3", 0o755)
        assert pool.stop() == 0
        assert pool.leftovers() == []
    finally:
        for version in ("2", "3"):
            with contextlib.suppress(FileNotFoundError):
                os.chmod(base / version, 0o755)
        pool.kill()


def test_a_pool_started_on_an_unreadable_newest_version_is_refused_saying_why(
    tmp_path: Path, demo_model_dir: Path
) -> None:
    """The newest version is the one a pool starts on, as TF Serving's (which fails to start
    when it cannot load it): refused in one line naming the file and why. It failed with a
    Python traceback (PermissionError; found by a review)."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to drop the capability to read any file")
    base = tmp_path / "m"
    shutil.copytree(demo_model_dir / "1", base / "1")
    shutil.copytree(demo_model_dir / "1", base / "2")
    os.chmod(base / "2", 0)
    (tmp_path / "pool").mkdir()
    pool = Pool(tmp_path / "pool", base, 1, prefix=WITHOUT_DAC_OVERRIDE)
    try:
        pool.start()
        assert pool.proc is not None and pool.proc.wait(60) != 0
        output = pool.output()
        assert f"cannot read {base / '2' / 'saved_model.pb'}: Permission denied" in output
        assert "Traceback" not in output, output
    finally:
        os.chmod(base / "2", 0o755)
        pool.kill()


def test_a_version_is_loaded_from_the_folder_that_holds_it_or_else_that_cannot_be_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A folder named for the version that holds a SavedModel wins over one that cannot be
    looked into, plain or zero-padded; one that cannot be looked into is the version's over
    none (its load says why it fails, at its own path: a zero-padded one was loaded from the
    plain path, which did not exist, NOT_FOUND; found by a review)."""
    from mpspool import demo_model

    holds: dict[str, bool | None] = {}
    monkeypatch.setattr(
        demo_model, "_holds_saved_model", lambda folder: holds.get(folder.name, False)
    )
    for name in ("4", "004", "0003", "7"):
        (tmp_path / name).mkdir()
    holds.update({"4": None, "004": True})  # the plain one unreadable: the readable alias
    assert demo_model.version_dir(tmp_path, 4) == tmp_path / "004"
    holds.update({"0003": None})  # no plain folder, an unreadable alias: that alias
    assert demo_model.version_dir(tmp_path, 3) == tmp_path / "0003"
    holds.update({"7": None})  # the plain one unreadable, no alias: the plain one
    assert demo_model.version_dir(tmp_path, 7) == tmp_path / "7"
    assert demo_model.version_dir(tmp_path, 9) == tmp_path / "9", "none: the plain name"


def test_a_batching_file_in_a_folder_that_cannot_be_looked_into_is_no_file(
    tmp_path: Path,
) -> None:
    """As TF Serving's FileExists answers: the version is not batched, and its load fails
    saying why, with its retries (it ended at once as INVALID_ARGUMENT, as a file breaking
    the rules does; found by a review)."""
    from mpspool.config import version_batching

    class Denied(type(Path())):  # type: ignore[misc]
        def is_file(self) -> bool:
            raise PermissionError(13, "Permission denied", str(self))

    assert version_batching(Denied(tmp_path)) is None


def test_a_zero_padded_version_folder_is_that_version_as_in_tf_serving(
    tmp_path: Path, demo_model_dir: Path, reference_model
) -> None:
    """TF Serving loads version 123 from `00000123/` (its own tutorial model's layout): the
    number is the id, the folder is where it loads from, for the first version and for one
    added while serving."""
    from mpspool.demo_model import version_dir

    base, staging = tmp_path / "hp", tmp_path / "staging"
    shutil.copytree(demo_model_dir / "1", base / "00000123")
    (base / "0000123").mkdir()  # a copy in progress: no SavedModel yet
    assert version_dir(base, 123) == base / "00000123"
    assert version_dir(base, 7) == base / "7", "nothing reads as 7: the plain name"
    (tmp_path / "pool").mkdir()
    pool = Pool(tmp_path / "pool", base, 1, "--file_system_poll_wait_seconds", "0.2").start()
    inputs = demo_inputs(3, DEMO_ROWS, seed=3)
    want = reference_model(**{k: tf.constant(v) for k, v in inputs.items()})["score"].numpy()

    def answered_by(version: int) -> None:
        request = predict_pb2.PredictRequest()
        request.model_spec.name = "demo"
        request.model_spec.version.value = version
        for name, array in inputs.items():
            request.inputs[name].CopyFrom(tf.make_tensor_proto(array))
        with grpc.insecure_channel(f"127.0.0.1:{pool.port}") as channel:
            stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
            answer = stub.Predict(request, timeout=30)
        assert answer.model_spec.version.value == version
        np.testing.assert_allclose(tf.make_ndarray(answer.outputs["score"]), want, atol=1e-6)

    try:
        status = pool.wait_ready(1)
        assert status["pool"]["version"] == 123
        answered_by(123)
        shutil.copytree(demo_model_dir / "1", staging / "0124")
        os.rename(staging / "0124", base / "0124")
        pool.wait_for(
            lambda s: _versions(s) == {123: ("END", ""), 124: ("AVAILABLE", "")},
            timeout=90,
            what="version 124 serving from 0124/",
        )
        answered_by(124)
        assert pool.stop() == 0
        assert pool.leftovers() == []
    finally:
        pool.kill()
