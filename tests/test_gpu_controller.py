"""GPU pools in the controller, against the fakes of test_controller.py and a fake GPU
backend (mps/gpus.py's FakeGpuBackend, behind the same interface as NVML): slot layout,
and a fault on one GPU restarting exactly that GPU's workers, in slot order."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
from test_controller import Pool, attempts, make_pool, told  # noqa: F401 - fixtures

from mpspool.config import ConfigError, PoolConfig, ServedModel
from mpspool.mps.gpus import EXCLUSIVE_PROCESS, FakeGpuBackend, GpuInfo
from mpspool.supervisor import controller as controller_module
from mpspool.supervisor import supervisord as sd
from mpspool.supervisor.gpu_watch import GpuWatch
from mpspool.supervisor.states import WorkerState

U0 = "GPU-00000000-0000-4000-8000-000000000000"
U1 = "GPU-11111111-1111-4111-8111-111111111111"
PIDS = {"gpu0-0": 101, "gpu0-1": 102, "gpu1-0": 103, "gpu1-1": 104}


def gpu_pool(make_pool: Any, monkeypatch: pytest.MonkeyPatch) -> tuple[Pool, FakeGpuBackend]:
    fake = FakeGpuBackend(
        [
            GpuInfo(0, U0, "Fake", 16 << 30, EXCLUSIVE_PROCESS),
            GpuInfo(1, U1, "Fake", 16 << 30, EXCLUSIVE_PROCESS),
        ]
    )
    monkeypatch.setattr(controller_module, "_gpu_backend", lambda config: fake)
    pool = make_pool(
        gpus=(0, 1),
        gpu_uuids=(U0, U1),
        gpu_memory=(16 << 30, 16 << 30),
        contexts_per_gpu=2,
        mps=False,
    )
    return pool, fake


def test_slots_are_gpu_context_pairs_with_their_gpu(
    make_pool: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    pool, _ = gpu_pool(make_pool, monkeypatch)
    slots = pool.controller.slots.values()
    assert [s.name for s in slots] == ["gpu0-0", "gpu0-1", "gpu1-0", "gpu1-1"]
    assert list(pool.controller.slots) == ["gpu0-0@1", "gpu0-1@1", "gpu1-0@1", "gpu1-1@1"]
    env = {s.name: pool.controller.gpu.worker_environment(s.name) for s in slots}
    assert env["gpu0-1"]["CUDA_VISIBLE_DEVICES"] == U0
    assert env["gpu1-0"]["CUDA_VISIBLE_DEVICES"] == U1
    assert "MPSPOOL_REQUIRE_MPS" not in env["gpu1-0"]  # --no-mps: no daemon to require


def test_an_xid_on_one_gpu_restarts_exactly_its_workers_in_order(
    make_pool: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    pool, fake = gpu_pool(make_pool, monkeypatch)
    pool.start(PIDS)
    for name in PIDS:
        pool.make_ready(name)
    pool.sd.calls.clear()

    fake.queue_xid(U1, 79)  # "GPU has fallen off the bus"
    pool.tick()
    gpu1 = ["v1:worker-gpu1-0-v1", "v1:worker-gpu1-1-v1"]
    assert pool.sd.calls == [
        ("stopProcess", gpu1[0]),
        ("stopProcess", gpu1[1]),
        ("startProcess", gpu1[0]),
        ("startProcess", gpu1[1]),
    ]
    assert pool.router.gone == [("gpu1-0@1", 103), ("gpu1-1@1", 104)]
    # The GPU's fault, not their requests': not counted against what they held.
    assert pool.router.blameless == pool.router.gone
    for name in ("gpu0-0", "gpu0-1"):  # the other GPU keeps serving, same processes
        assert pool.slot(name).state is WorkerState.READY
        assert pool.slot(name).pid == PIDS[name]
    for name in ("gpu1-0", "gpu1-1"):
        assert pool.slot(name).state is WorkerState.STARTING
        pool.sd.run(name, pool.sd.pid_of(name))
        pool.tick()
        pool.make_ready(name)
        assert pool.slot(name).restarts == 1
    assert pool.slot("gpu0-0").restarts == 0


def test_every_models_contexts_share_each_gpu_and_its_faults(
    make_pool: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    fake = FakeGpuBackend([GpuInfo(0, U0, "Fake", 12 << 30, EXCLUSIVE_PROCESS)])
    monkeypatch.setattr(controller_module, "_gpu_backend", lambda config: fake)
    demo, ranker = tmp_path / "demo", tmp_path / "ranker"
    pool = make_pool(
        gpus=(0,), gpu_uuids=(U0,), gpu_memory=(12 << 30,), contexts_per_gpu=2, mps=False,
        model_base_path=str(demo),
        models=(
            ServedModel("demo", str(demo), 1), ServedModel("ranker", str(ranker), 1, workers=1),
        ),
    )  # fmt: skip
    config = pool.controller.config
    assert list(pool.controller.slots) == ["gpu0-0@1", "gpu0-1@1", "ranker/gpu0-0@1"]
    # Three MPS clients on the GPU: each one's pinned-memory share is a third.
    assert config.contexts_on_gpu() == 3
    assert config.pinned_limit_mib(0) == config.for_model("ranker").pinned_limit_mib(0) == 4096
    env = pool.controller.gpu.worker_environment(pool.slot("ranker/gpu0-0").name)
    assert env["CUDA_VISIBLE_DEVICES"] == U0

    pids = {"gpu0-0": 101, "gpu0-1": 102}
    pool.start(pids)
    for name in ("gpu0-0", "gpu0-1", "ranker/gpu0-0"):
        pool.make_ready(name)
    pool.sd.calls.clear()
    fake.queue_xid(U0, 79)
    pool.tick()
    stopped = [c[1] for c in pool.sd.calls if c[0] == "stopProcess"]
    assert stopped == [
        "v1:worker-gpu0-0-v1", "v1:worker-gpu0-1-v1", "ranker-v1:worker-ranker-gpu0-0-v1",
    ]  # fmt: skip


def test_more_contexts_than_mps_serves_are_refused_counting_every_model(tmp_path: Path) -> None:
    base = tmp_path / "m"
    (base / "1").mkdir(parents=True)
    (base / "1" / "saved_model.pb").write_bytes(b"")
    models = (ServedModel("a", str(base), 1), ServedModel("b", str(base), 1, workers=30))
    config = PoolConfig(
        model_name="a", model_base_path=str(base), model_version=1, run_dir=str(tmp_path),
        log_dir=str(tmp_path), workers=1, gpus=(0,), gpu_uuids=(U0,), gpu_memory=(1 << 30,),
        contexts_per_gpu=20, models=models,
    )  # fmt: skip
    with pytest.raises(ConfigError, match=r"every model's together, must be at most 48 .*got 50"):
        config.validate()


def test_contexts_added_without_mps_are_checked_against_the_compute_modes_read_now(
    tmp_path: Path,
) -> None:
    """GpuWatch.check_without_mps, which a model added while the pool serves goes through:
    the start rule (mps/gpus.py) on the compute modes NVML reports now; with MPS nothing to
    check; NVML unreadable now is said, not a refusal."""
    fake = FakeGpuBackend([GpuInfo(0, U0, "Fake", 16 << 30, EXCLUSIVE_PROCESS)])
    config = PoolConfig(
        model_name="demo", model_base_path="/m", model_version=1, run_dir=str(tmp_path),
        log_dir=str(tmp_path / "logs"), workers=1, gpus=(0,), gpu_uuids=(U0,),
        gpu_memory=(16 << 30,), contexts_per_gpu=1, mps=False,
    )  # fmt: skip
    watch = GpuWatch(config, tmp_path, fake)
    [warning] = watch.check_without_mps(config)
    assert "a new model version's worker cannot start" in warning
    two = dataclasses.replace(config, contexts_per_gpu=2)
    with pytest.raises(ConfigError, match="admits one process at a time, and this pool would"):
        watch.check_without_mps(two)
    assert watch.check_without_mps(dataclasses.replace(two, mps=True)) == []
    gone = dataclasses.replace(config, gpus=(0, 1), gpu_uuids=(U0, U1), gpu_memory=(1, 1))
    assert f"GPU {U1} is not visible now" in watch.check_without_mps(gone)[-1]
    fake.close()  # NVML gone: every call raises GpuError
    [warning] = watch.check_without_mps(two)
    assert "compute modes cannot be read now" in warning


class _TailRPC:
    def __init__(self, log: list[str]) -> None:
        self.log = log

    def tailProcessStdoutLog(self, name: str, offset: int, length: int) -> list[Any]:
        text = "".join(self.log)
        return [text[offset:], len(text), False]


class _TailSupervisor:
    def __init__(self) -> None:
        self.log: list[str] = []

    def rpc(self) -> _TailRPC:
        return _TailRPC(self.log)


def test_daemon_output_and_daemon_death_are_faults_of_their_gpu(tmp_path: Path) -> None:
    config = PoolConfig(
        model_name="demo", model_base_path="/m", model_version=1, run_dir=str(tmp_path),
        log_dir=str(tmp_path / "logs"), workers=1, gpus=(0, 1), gpu_uuids=(U0, U1),
        gpu_memory=(16 << 30, 16 << 30), contexts_per_gpu=1, mps=True, mps_control="/bin/false",
    )  # fmt: skip
    watch = GpuWatch(config, tmp_path)
    supervisor = _TailSupervisor()
    infos = {
        "mps:mps-gpu0": {"state": sd.RUNNING, "statename": "RUNNING", "pid": 50},
        "mps:mps-gpu1": {"state": sd.RUNNING, "statename": "RUNNING", "pid": 51},
    }
    watch._daemon_pid = {0: 50, 1: 51}
    supervisor.log.append("[t Control 50] Starting control daemon\n")
    assert watch.faults(supervisor, infos, 0.0) == {}  # the first look only sets the offset
    supervisor.log.append("[t Control 50] Server encountered a fatal exception. Shutting down\n")
    faults = watch.faults(supervisor, infos, 0.0)
    assert set(faults) == {0, 1}  # both tail the same fake log here
    assert all("MPS server fault" in why for why in faults.values())
    assert watch.faults(supervisor, infos, 0.0) == {}  # reported once

    infos["mps:mps-gpu1"] = {"state": sd.RUNNING, "statename": "RUNNING", "pid": 77}
    assert list(watch.faults(supervisor, infos, 0.0)) == [1]  # a new daemon pid: it died
    infos["mps:mps-gpu0"] = {"state": sd.BACKOFF, "statename": "BACKOFF", "pid": 0}
    assert 0 in watch.faults(supervisor, infos, 0.0)


def test_xids_that_leave_the_gpu_working_or_repeat_a_fault_restart_nothing(
    tmp_path: Path,
) -> None:
    """NVML reports nearly every Xid as critical. An ECC record (63, 64) or a high single-bit
    rate (92) keeps the workers; a context's fault (13, 31, 43, 45, 68, 94) restarts them
    (it may be a worker's), except within 30 s of a restart for a fault, when such Xids are
    that fault's teardown. A fatal Xid restarts them whenever it comes."""
    backend = FakeGpuBackend([GpuInfo(0, U0, "Fake", 16 << 30, EXCLUSIVE_PROCESS)])
    config = PoolConfig(
        model_name="demo", model_base_path="/m", model_version=1, run_dir=str(tmp_path),
        log_dir=str(tmp_path / "logs"), workers=1, gpus=(0,), gpu_uuids=(U0,),
        gpu_memory=(16 << 30,), contexts_per_gpu=1, mps=True, mps_control="/bin/false",
    )  # fmt: skip
    supervisor = _TailSupervisor()
    infos = {"mps:mps-gpu0": {"state": sd.RUNNING, "statename": "RUNNING", "pid": 50}}

    def faults(watch: GpuWatch, xids: list[int], now: float) -> dict[int, str]:
        for xid in xids:
            backend.queue_xid(U0, xid)
        return watch.faults(supervisor, infos, now)

    watch = GpuWatch(config, tmp_path, backend)
    watch._daemon_pid = {0: 50}
    assert faults(watch, [63, 64, 92], 100.0) == {}
    assert faults(watch, [31], 101.0) == {0: "NVML Xid 31"}  # a worker's context, maybe
    assert faults(watch, [45, 43, 13], 120.0) == {}  # its teardown, within 30 s
    assert faults(watch, [79], 125.0) == {0: "NVML Xid 79"}  # fatal: fallen off the bus
    assert faults(watch, [45], 150.0) == {}  # within 30 s of that one
    assert faults(watch, [13], 160.0) == {0: "NVML Xid 13"}  # a new fault


def test_gpu_usage_is_sent_to_the_front_door_every_interval(
    make_pool: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    pool, fake = gpu_pool(make_pool, monkeypatch)
    fake.set_usage(U1, memory_used=3 << 30, utilization_gpu=75)
    pool.start(PIDS)
    pool.tick()
    (first,) = pool.router.gpu_samples
    by_gpu = {s["gpu"]: s for s in first}
    assert by_gpu[1] == {
        "gpu": 1, "uuid": U1, "memory_used": 3 << 30,
        "memory_total": 16 << 30, "utilization": 75,
    }  # fmt: skip
    pool.tick(1.0)
    assert len(pool.router.gpu_samples) == 1, "once per interval"
    pool.tick(1.0)
    assert len(pool.router.gpu_samples) == 2


def test_a_fault_while_a_retired_version_drains_stops_its_workers_and_restarts_the_new(
    make_pool: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A GPU fault while a retired version's workers drain: they stop (their version is
    going; what they held was lost with the GPU), the serving version's workers restart, and
    the retired version ends. They were moved DRAINING -> STARTING, a transition the slot
    refuses, and the controller ended, taking every model down (found by a review)."""
    fake = FakeGpuBackend([GpuInfo(0, U0, "Fake", 16 << 30, EXCLUSIVE_PROCESS)])
    monkeypatch.setattr(controller_module, "_gpu_backend", lambda config: fake)
    pool = make_pool(
        gpus=(0,), gpu_uuids=(U0,), gpu_memory=(16 << 30,), contexts_per_gpu=2, mps=False,
        share_weights=False, start_retries=0,
    )  # fmt: skip
    base = Path(pool.controller.config.model_base_path)
    (base / "1").mkdir(parents=True)
    (base / "1" / "saved_model.pb").write_bytes(b"")
    pool.start()
    pool.make_ready("gpu0-0")
    pool.make_ready("gpu0-1")
    (base / "2").mkdir()
    (base / "2" / "saved_model.pb").write_bytes(b"")
    pool.tick(after_s=1.0)  # polled: version 2 loads
    for name in ("gpu0-0", "gpu0-1"):
        pool.router.register(f"{name}@2", pool.sd.pid_of(f"{name}@2"))
    pool.router.workers["gpu0-0@1"]["inflight"] = 1  # version 1 still holds a request
    pool.tick()
    assert told(pool) == {1: "UNLOADING", 2: "AVAILABLE"}
    assert pool.slot("gpu0-0@1").state is WorkerState.DRAINING
    pool.sd.calls.clear()

    fake.queue_xid(U0, 79)
    pool.tick()
    for name in ("gpu0-0@1", "gpu0-1@1"):
        assert pool.slot(name).state is WorkerState.STOPPED
    for name in ("gpu0-0@2", "gpu0-1@2"):
        assert pool.slot(name).state is WorkerState.STARTING
    started = [c[1] for c in pool.sd.calls if c[0] == "startProcess"]
    assert started == ["v2:worker-gpu0-0-v2", "v2:worker-gpu0-1-v2"]
    pool.tick(after_s=0.2)  # nothing of version 1 is running any more: it ends
    assert told(pool)[1] == "END"
    assert ("removeProcessGroup", "v1") in pool.sd.calls


def test_a_gpu_worker_whose_tensorflow_cannot_use_its_gpu_refuses_to_serve(
    tmp_path: Path, demo_model_dir: Path
) -> None:
    """The real worker process, in the slot of a GPU this TensorFlow cannot use: the
    tensorflow-cpu installed here is what a GPU host with a CPU-only build runs. It would have
    loaded the model on the CPU and served, its GPU idle; it refuses before loading, saying
    why, with the code that tells the controller not to try again."""
    import os
    import subprocess
    import sys

    import tensorflow as tf

    from mpspool import process

    if tf.test.is_built_with_cuda():
        pytest.skip("this TensorFlow is built with CUDA: the CPU-only build's refusal is not it")

    config = PoolConfig(
        model_name="demo", model_base_path=str(demo_model_dir), model_version=1,
        run_dir=str(tmp_path), log_dir=str(tmp_path), workers=1, gpus=(0,), gpu_uuids=(U0,),
        gpu_memory=(16 << 30,), contexts_per_gpu=1, mps=False, share_weights=False,
    )  # fmt: skip
    config.save(tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "MPSPOOL_FAKE_GPUS"}
    env["CUDA_VISIBLE_DEVICES"] = U0  # as the controller starts a GPU worker
    worker = subprocess.run(
        [sys.executable, "-m", "mpspool.worker", "--run-dir", str(tmp_path), "--slot", "gpu0-0"],
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
    assert worker.returncode == process.EXIT_CONFIG_ERROR, worker.stderr
    assert "FAILED_PRECONDITION: this TensorFlow (" in worker.stderr, worker.stderr
    assert "is built without CUDA, so a GPU worker would run its model on the CPU" in worker.stderr


def test_a_gpu_worker_whose_cuda_build_sees_no_gpu_refuses_and_is_tried_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """TensorFlow built with CUDA that finds no GPU (its CUDA libraries missing, the MPS
    server refusing a 49th client): the worker refuses as a failed load, which the controller
    tries again. Only the build is faked here (no CUDA build runs on this machine); the
    listing of GPUs is tensorflow-cpu's own (none)."""
    import tensorflow as tf

    from mpspool import process
    from mpspool.worker import serve

    config = PoolConfig(
        model_name="demo", model_base_path="/m", model_version=1, run_dir=str(tmp_path),
        log_dir=str(tmp_path), workers=1, gpus=(0,), gpu_uuids=(U0,), gpu_memory=(1 << 30,),
        contexts_per_gpu=1, mps=False,
    )  # fmt: skip
    monkeypatch.delenv("MPSPOOL_FAKE_GPUS", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", U0)
    monkeypatch.setattr(tf.test, "is_built_with_cuda", lambda: True)
    with pytest.raises(SystemExit) as ended:
        serve._require_gpu(config, "gpu0-0")
    assert ended.value.code == process.EXIT_LOAD_FAILED
    said = capsys.readouterr().err
    assert f"UNAVAILABLE: TensorFlow sees no GPU (CUDA_VISIBLE_DEVICES={U0})" in said, said
    # A CPU slot, and a GPU faked for tests, are not asked.
    serve._require_gpu(config, "cpu-0")
    monkeypatch.setenv("MPSPOOL_FAKE_GPUS", "[]")
    serve._require_gpu(config, "gpu0-0")


def test_the_start_warning_counts_each_models_contexts_for_each_version_it_serves(
    tmp_path: Path,
) -> None:
    """`mpspool start`'s count of MPS clients (cli._mps_clients): each model's contexts per
    GPU, times the versions its policy serves at once (`all` counts one: later versions are
    not known at start)."""
    from mpspool import cli

    models = (
        ServedModel("a", "/a", 1, version_policy="latest:2"),
        ServedModel("b", "/b", 1, version_policy="specific:1,2,3", workers=3),
        ServedModel("c", "/c", 1, version_policy="all", workers=1),
    )
    config = PoolConfig(
        model_name="a", model_base_path="/a", model_version=1, run_dir=str(tmp_path),
        log_dir=str(tmp_path), workers=1, gpus=(0,), gpu_uuids=(U0,), gpu_memory=(1 << 30,),
        contexts_per_gpu=4, models=models,
    )  # fmt: skip
    assert cli._mps_clients(config) == [(4, 2), (3, 3), (1, 1)]
