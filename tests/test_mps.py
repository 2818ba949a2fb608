"""MPS with the real nvidia-cuda-mps-control (its control daemon runs without a GPU), and
GPU pools whose GPUs are the one thing faked (MPSPOOL_FAKE_GPUS, behind mps/gpus.py's
interface): daemons, supervisord, router and workers are real."""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import psutil
import pytest

from mpspool.mps.claim import GpuClaimed, GpuClaims, claim_path
from mpspool.mps.control import (
    DaemonDown,
    DaemonHung,
    MpsDaemon,
    MpsError,
    fault_lines,
    find_control_binary,
)

from conftest import DEMO_ROWS
from poolproc import Pool, mpspool_cmd
from streamer import Streamer

FAKE_GPUS = [
    {
        "uuid": "GPU-0a0a0a0a-0000-4000-8000-000000000000",
        "name": "Fake GPU",
        "memory_total": 16 << 30,
    },
    {
        "uuid": "GPU-1b1b1b1b-1111-4111-8111-111111111111",
        "name": "Fake GPU",
        "memory_total": 16 << 30,
    },
]


@pytest.fixture
def daemon() -> Iterator[MpsDaemon]:
    base = Path(tempfile.mkdtemp(prefix="mps-", dir="/tmp"))
    d = MpsDaemon(0, FAKE_GPUS[0]["uuid"], find_control_binary(), base / "pipe", base / "log")
    d.prepare_dirs()
    yield d
    for proc in psutil.process_iter(["environ"]):
        try:
            if (proc.info["environ"] or {}).get("CUDA_MPS_PIPE_DIRECTORY") == str(d.pipe_dir):
                proc.kill()
        except psutil.Error:
            pass
    subprocess.run(["rm", "-rf", str(base)], check=False)


def spawn(daemon: MpsDaemon) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        daemon.command(),
        env={**os.environ, **daemon.environment()},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def test_terminating_clients_keeps_to_one_budget_however_many_clients(tmp_path: Path) -> None:
    """A daemon slow to answer, with many clients: the stop's terminate_client pass gives up
    once its budget is spent (a pod's stop budgets it: deploy/README.md), where each query
    had 5 s of its own. The stand-in control client answers as the real one does, slowly."""
    control = tmp_path / "nvidia-cuda-mps-control"
    control.write_text(
        "#!/bin/sh\nread command\nsleep 0.4\n"
        'case "$command" in\n'
        "  get_server_list) echo 100 ;;\n"
        '  get_client_list*) echo "11 12 13 14 15 16 17 18" ;;\n'
        "esac\n"
    )
    control.chmod(0o755)
    daemon = MpsDaemon(0, "GPU-x", str(control), tmp_path / "pipe", tmp_path / "log")
    with pytest.raises(DaemonHung):  # the budget spent: by a query cut short, or before one
        daemon.terminate_clients(budget_s=1.0)
    assert daemon.terminate_clients(budget_s=30.0) == [(100, c) for c in range(11, 19)]
    # No server: the empty list is told from a hang-up by a second query, in the same budget.
    control.write_text(
        "#!/bin/sh\nread command\nsleep 0.7\n"
        'case "$command" in\n'
        "  get_default_active_thread_percentage) echo 100.0 ;;\n"
        "esac\n"
    )
    with pytest.raises(DaemonHung):
        daemon.terminate_clients(budget_s=1.0)
    assert daemon.terminate_clients(budget_s=30.0) == []


def test_control_daemon_readiness_defaults_and_quit(daemon: MpsDaemon) -> None:
    assert not daemon.ready()
    with pytest.raises(DaemonDown):
        daemon.query("get_server_list")
    proc = spawn(daemon)
    try:
        daemon.wait_ready(10)
        assert daemon.apply_defaults(25, 2048) == {
            "active_thread_percentage": "25.0",
            "pinned_mem_limit": "2G",
        }
        with pytest.raises(MpsError, match="Unknown command"):
            daemon.query("no_such_command")
        assert daemon.servers() == []  # no GPU work, so no MPS server
        assert daemon.terminate_clients() == []

        proc.kill()
        proc.wait(10)
        # kill -9 leaves its socket files behind; they do not make a daemon.
        assert (daemon.pipe_dir / "control").exists()
        assert not daemon.ready()

        proc = spawn(daemon)
        daemon.wait_ready(10)
        assert daemon.defaults()["active_thread_percentage"] == "100.0"  # a new daemon
        daemon.quit()
        assert proc.wait(10) == 0
        assert not daemon.ready()
    finally:
        proc.kill()


def test_a_daemon_ends_with_the_process_that_started_it(daemon: MpsDaemon) -> None:
    """supervisord killed (-9): its daemon must not live on holding its pipe directory, where
    the revived pool's daemon would find "an instance already running"."""
    parent = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys, time; subprocess.Popen(sys.argv[1:]); "
         "time.sleep(600)", *daemon.command()],
        env={**os.environ, **daemon.environment()},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        daemon.wait_ready(10)
        (child,) = psutil.Process(parent.pid).children()
        assert child.cmdline()[-2:] == [daemon.binary, "-f"]  # setpriv exec'd it: same pid
        parent.kill()
        parent.wait(10)
        child.wait(10)
        assert not daemon.ready()
    finally:
        parent.kill()


def test_the_operators_mps_variables_stay_out_of_the_pool(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pool runs MPS itself: an operator's CUDA_MPS_PIPE_DIRECTORY joined `--no-mps`
    workers to whatever daemon listened there, and CUDA_MPS_ACTIVE_THREAD_PERCENTAGE capped
    each worker below what status showed. A relative --mps-control path is made absolute
    (supervisord starts the daemon from the run directory, where it did not resolve)."""
    from mpspool.supervisor.supervisord import pool_environment, publisher_environment

    env = {
        "PATH": "/usr/bin",
        "CUDA_MPS_PIPE_DIRECTORY": "/tmp/mps",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "10",
        "CUDA_VISIBLE_DEVICES": "0",
    }
    assert pool_environment(env) == {"PATH": "/usr/bin", "CUDA_VISIBLE_DEVICES": "0"}
    # A weight publisher reads on the CPU: a TensorFlow with CUDA would open the GPU outside
    # MPS and map most of its memory beside the workers.
    assert publisher_environment(env) == {
        "PATH": "/usr/bin", "CUDA_VISIBLE_DEVICES": "", "TF_CPP_MIN_LOG_LEVEL": "2",
    }  # fmt: skip
    control = tmp_path / "nvidia-cuda-mps-control"
    control.write_text("#!/bin/sh\n")
    control.chmod(0o755)
    monkeypatch.chdir(tmp_path)
    assert find_control_binary("./nvidia-cuda-mps-control") == str(control)


def _hang_up_once(path: Path) -> threading.Thread:
    """A socket where a daemon's would be that greets one client as the daemon does and hangs
    up: a daemon starting or going away, as a client can meet it."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(str(path))
    listener.listen(1)

    def serve() -> None:
        with listener:
            conn, _ = listener.accept()
            with conn:
                creds = struct.pack("iII", os.getpid(), os.getuid(), os.getgid())
                conn.sendmsg([b"OUTBHELL\0"], [(socket.SOL_SOCKET, socket.SCM_CREDENTIALS, creds)])

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


def test_a_daemon_that_hangs_up_is_not_ready_and_is_waited_for(daemon: MpsDaemon) -> None:
    # Before, the client's "Cannot ... connect" or "Cannot send command" was an MpsError, and a
    # worker started beside its daemon exited instead of waiting (CI, 2026-11-25).
    path = daemon.pipe_dir / "control_privileged"
    served = _hang_up_once(path)
    assert not daemon.ready()
    served.join(10)
    path.unlink()
    proc = spawn(daemon)
    try:
        daemon.wait_ready(10)
        daemon.quit()
        assert proc.wait(10) == 0
    finally:
        proc.kill()


def _hang_up_unanswered(path: Path, connections: int) -> threading.Thread:
    """A socket where a daemon's would be that greets each of ``connections`` clients and
    hangs up 0.1 s later without an answer: a daemon going away mid-query. The real client
    then prints nothing and exits 0 (15 runs in 15; hanging up at once is "Cannot authenticate
    or connect", after reading the command mostly "Cannot send command")."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(str(path))
    listener.listen(connections)

    def serve() -> None:
        with listener:
            for _ in range(connections):
                conn, _ = listener.accept()
                with conn:
                    creds = struct.pack("iII", os.getpid(), os.getuid(), os.getgid())
                    conn.sendmsg(
                        [b"OUTBHELL\0"], [(socket.SOL_SOCKET, socket.SCM_CREDENTIALS, creds)]
                    )
                    time.sleep(0.1)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


def test_a_daemon_that_hangs_up_mid_query_has_no_server_list(daemon: MpsDaemon) -> None:
    """The real client prints nothing and exits 0 when the daemon hangs up without an answer,
    as for an empty server list: servers() asks whether the daemon still answers before it
    says there are none."""
    path = daemon.pipe_dir / "control_privileged"
    served = _hang_up_unanswered(path, 2)
    assert daemon.query("get_server_list") == ""  # what the client makes of it
    served.join(10)
    path.unlink()
    served = _hang_up_unanswered(path, 2)
    with pytest.raises(DaemonDown, match="hung up"):
        daemon.servers()
    served.join(10)
    path.unlink()
    proc = spawn(daemon)
    try:
        daemon.wait_ready(10)
        assert daemon.servers() == []  # a daemon that answers, with no GPU work: truly none
        daemon.quit()
        assert proc.wait(10) == 0
    finally:
        proc.kill()


def test_fault_lines_pick_out_server_failures() -> None:
    text = (
        "[2026-11-21 10:00:00.000 Control 12] Accepting connection...\n"
        "[2026-11-21 10:00:01.000 Control 12] Server encountered a fatal exception. Shutting down\n"
        "[2026-11-21 10:00:01.100 Control 12] Server 4242 exited with status 1\n"
        "[2026-11-21 10:00:02.000 Control 12] NEW UI\n"
    )
    assert len(fault_lines(text)) == 2


def _daemon_pid(pool: Pool, uuid: str) -> int:
    for pid in pool._descendants | {
        c.pid for c in psutil.Process(pool.proc.pid).children(recursive=True)
    }:
        try:
            proc = psutil.Process(pid)
            if "nvidia-cuda-mps-control" in " ".join(proc.cmdline()):
                if proc.environ().get("CUDA_VISIBLE_DEVICES") == uuid:
                    return pid
        except psutil.Error:
            continue
    raise AssertionError(f"no MPS daemon for {uuid}")


def _mps_dirs(pool: Pool, gpu: int) -> tuple[Path, Path]:
    """A GPU's daemon's pipe and log directories in the pool's run directory."""
    base = pool.run_dir / "mps" / f"gpu{gpu}"
    return base / "pipe", base / "log"


def test_gpu_pool_with_mps_restarts_only_the_faulted_gpu(
    tmp_path: Path, demo_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MPSPOOL_FAKE_GPUS", json.dumps(FAKE_GPUS))
    # The real control binary, except that its daemon mode refuses to start while `refuse`
    # exists: a daemon that cannot come back.
    refuse = tmp_path / "refuse"
    control = tmp_path / "nvidia-cuda-mps-control"
    control.write_text(
        f'#!/bin/sh\nif [ "$1" = -f ] && [ -e {refuse} ]; then echo refused; exit 1; fi\n'
        f'exec {find_control_binary()} "$@"\n'
    )
    control.chmod(0o755)
    pool = Pool(
        tmp_path, demo_model_dir, 1,
        "--gpus", "0,1", "--contexts-per-gpu", "1", "--active-thread-percentage", "50",
        "--mps-control", str(control),
    )  # fmt: skip
    pool.start()
    try:
        status = pool.wait_ready(2)
        assert [s["slot"] for s in status["slots"]] == ["gpu0-0", "gpu1-0"]
        gpus = status["gpus"]
        assert [g["uuid"] for g in gpus] == [g["uuid"] for g in FAKE_GPUS]
        assert all(g["mps"] == "RUNNING" for g in gpus)
        assert all(g["defaults"]["active_thread_percentage"] == "50.0" for g in gpus)
        # Each worker runs with its GPU's UUID and its daemon's pipe directory.
        for slot, fake in zip(status["slots"], FAKE_GPUS, strict=True):
            env = psutil.Process(slot["pid"]).environ()
            assert env["CUDA_VISIBLE_DEVICES"] == fake["uuid"]
            assert env["CUDA_MPS_PIPE_DIRECTORY"].endswith(f"mps/gpu{slot['slot'][3]}/pipe")
            assert env["MPSPOOL_REQUIRE_MPS"] == str(control)
        # Each GPU's memory and utilisation (NVML; here the fake's) reach the front door's
        # metrics within the controller's sampling interval.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            text = urllib.request.urlopen(status["pool"]["metrics"], timeout=5).read().decode()
            if "mpspool_gpu_memory_total_bytes" in text:
                break
            time.sleep(0.5)
        for gpu, fake in enumerate(FAKE_GPUS):
            labels = f'{{gpu="{gpu}",uuid="{fake["uuid"]}"}}'
            assert f"mpspool_gpu_memory_total_bytes{labels} {fake['memory_total']}" in text
            assert f"mpspool_gpu_memory_used_bytes{labels} 0" in text
            assert f"mpspool_gpu_utilization_ratio{labels} 0.0" in text

        before = {s["slot"]: s["pid"] for s in status["slots"]}
        # Paced: the replacement loads at idle priority, starved by a closed loop on 2 cores.
        streamer = Streamer(pool.port, DEMO_ROWS, pause_s=0.005).start()
        try:
            streamer.wait_for_successes(10)
            os.kill(_daemon_pid(pool, FAKE_GPUS[1]["uuid"]), signal.SIGKILL)

            def gpu1_back(st: dict) -> bool:
                s = {x["slot"]: x for x in st["slots"]}["gpu1-0"]
                return s["state"] == "READY" and s["pid"] != before["gpu1-0"]

            status = pool.wait_for(gpu1_back, 90, "gpu1-0 replaced and READY")
            streamer.wait_for_successes(len(streamer.ok()) + 10)
        finally:
            streamer.stop()
        slots = {s["slot"]: s for s in status["slots"]}
        assert slots["gpu0-0"]["pid"] == before["gpu0-0"]  # the other GPU is untouched
        assert slots["gpu0-0"]["restarts"] == 0
        assert slots["gpu1-0"]["restarts"] == 1
        assert streamer.failed() == []
        assert "GPU 1: restarting its workers" in pool.output()
        assert "GPU 0: restarting" not in pool.output()

        # A daemon that ends itself with 0 while serving (an operator's `quit`), and that
        # cannot start again: its GPU is down, its worker waits, the other GPU serves; once
        # it can start, the GPU comes back. It ended the whole pool before.
        refuse.touch()
        before = {s["slot"]: s["pid"] for s in status["slots"]}
        streamer = Streamer(pool.port, DEMO_ROWS, pause_s=0.005).start()
        try:
            streamer.wait_for_successes(10)
            gpu1 = MpsDaemon(1, FAKE_GPUS[1]["uuid"], str(control), *_mps_dirs(pool, 1))
            gpu1.quit()

            def gpu1_down(st: dict) -> bool:
                return "down" in {g["index"]: g for g in st["gpus"]}[1]

            status = pool.wait_for(gpu1_down, 60, "GPU 1 down")
            down = {g["index"]: g for g in status["gpus"]}[1]["down"]
            assert "did not answer" in down["why"], down
            slots = {s["slot"]: s for s in status["slots"]}
            assert slots["gpu1-0"]["state"] == "STARTING"
            assert slots["gpu1-0"]["reason"].startswith("GPU 1 down: ")
            assert slots["gpu0-0"]["state"] == "READY"
            served = len(streamer.ok())
            streamer.wait_for_successes(served + 20)  # GPU 0 alone
            refuse.unlink()
            status = pool.wait_for(gpu1_back, 120, "GPU 1 back and its worker READY")
            streamer.wait_for_successes(len(streamer.ok()) + 10)
        finally:
            streamer.stop()
        assert streamer.failed() == []
        assert pool.proc.poll() is None
        assert {s["slot"]: s["pid"] for s in status["slots"]}["gpu0-0"] == before["gpu0-0"]
        assert "GPU 1: its MPS control daemon does not answer" in pool.output()

        # kill -9 of supervisord: the daemons go with it (their parent-death signal) and the
        # revived supervisord's own daemons serve; an orphan daemon held its pipe directory
        # and the new one went FATAL ("an instance of this daemon is already running").
        daemons = [psutil.Process(_daemon_pid(pool, gpu["uuid"])) for gpu in FAKE_GPUS]
        (supervisord,) = [
            c
            for c in psutil.Process(pool.proc.pid).children()
            if "supervisor.supervisord" in " ".join(c.cmdline())
        ]
        before = {s["slot"]: s["pid"] for s in status["slots"]}
        supervisord.kill()
        _, alive = psutil.wait_procs(daemons, timeout=10)
        assert alive == []

        def both_back(st: dict) -> bool:
            slots = {x["slot"]: x for x in st["slots"]}
            return all(
                slots[name]["state"] == "READY" and slots[name]["pid"] != before[name]
                for name in before
            ) and all(g["mps"] == "RUNNING" and "down" not in g for g in st["gpus"])

        pool.wait_for(both_back, 120, "both GPUs' workers back after supervisord's kill")
        assert pool.proc.poll() is None

        assert pool.stop() == 0
        assert pool.leftovers() == []
        # `quit` on stop: each daemon ended itself (exit 0), not killed.
        for gpu in (0, 1):
            assert "Exit with status 0" in (pool.log_dir / f"mps-gpu{gpu}.log").read_text()
    finally:
        pool.kill()


def test_gpus_on_a_machine_without_them_fail_fast(
    tmp_path: Path, demo_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("MPSPOOL_FAKE_GPUS", raising=False)
    started = time.monotonic()
    result = subprocess.run(
        mpspool_cmd("start", "--gpus", "0", "--model-base-path", str(demo_model_dir),
                    "--run-dir", str(tmp_path / "r")),
        cwd=tmp_path, capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert result.returncode != 0
    assert time.monotonic() - started < 10
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "NVIDIA" in lines[0], result.stderr
    assert not (tmp_path / "r").exists()


def test_a_gpu_that_is_not_visible_is_named(
    tmp_path: Path, demo_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MPSPOOL_FAKE_GPUS", json.dumps(FAKE_GPUS))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", FAKE_GPUS[1]["uuid"])
    result = subprocess.run(
        mpspool_cmd("start", "--gpus", "1", "--model-base-path", str(demo_model_dir),
                    "--run-dir", str(tmp_path / "r")),
        cwd=tmp_path, capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert result.returncode == 2
    assert "no such GPU 1" in result.stderr and "CUDA_VISIBLE_DEVICES" in result.stderr


@pytest.mark.parametrize("models", [1, 2])
def test_no_mps_on_an_exclusive_gpu_with_several_contexts_is_refused_at_start(
    models: int, tmp_path: Path, demo_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two contexts on the GPU: two workers of one model, or one worker each of two models
    (contexts count every model's workers)."""
    exclusive = [{"uuid": "GPU-eeee0000-0000", "compute_mode": "EXCLUSIVE_PROCESS"}]
    monkeypatch.setenv("MPSPOOL_FAKE_GPUS", json.dumps(exclusive))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    if models == 1:
        serve = ["--contexts-per-gpu", "2", "--model-base-path", str(demo_model_dir)]
    else:
        config = tmp_path / "models.config"
        config.write_text(
            "model_config_list {\n"
            + "".join(
                f'  config {{ name: "{name}" base_path: "{demo_model_dir}" '
                'model_platform: "tensorflow" }\n'
                for name in ("a", "b")
            )
            + "}\n"
        )
        serve = ["--contexts-per-gpu", "1", "--model_config_file", str(config)]
    result = subprocess.run(
        mpspool_cmd("start", "--gpus", "0", "--no-mps", *serve, "--run-dir", str(tmp_path / "r")),
        cwd=tmp_path, capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "compute mode EXCLUSIVE_PROCESS: without MPS it admits one process at a time, and " \
        "this pool would run 2 on it" in result.stderr  # fmt: skip
    assert not (tmp_path / "r").exists()


def test_no_mps_refuses_a_model_added_past_an_exclusive_gpus_one_context(
    tmp_path: Path, demo_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One model's one worker fits an EXCLUSIVE_PROCESS GPU without MPS (warned at start). A
    second model added while the pool serves would be a second context on it, which such a
    GPU cannot admit: the reload is refused with the start check's words, nothing is started,
    and the first model serves on. (Before, the new model's worker was started to fail.)"""
    from tensorflow_serving.apis import model_management_pb2, model_service_pb2_grpc

    exclusive = [{"uuid": "GPU-eeee0000-0000", "compute_mode": "EXCLUSIVE_PROCESS"}]
    monkeypatch.setenv("MPSPOOL_FAKE_GPUS", json.dumps(exclusive))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    args = ("--gpus", "0", "--no-mps", "--contexts-per-gpu", "1")
    pool = Pool(tmp_path, demo_model_dir, 1, *args)
    pool.start()
    try:
        status = pool.wait_ready(1)
        assert "admits one process at a time, so a new model version's worker" in pool.output()
        # A second pool on the same GPU is refused before anything starts, naming this one.
        (tmp_path / "other").mkdir()
        other = subprocess.run(
            mpspool_cmd(
                "start", "--model-base-path", str(demo_model_dir), *args,
                "--run-dir", str(tmp_path / "other" / "run"),
                "--log-dir", str(tmp_path / "other" / "logs"),
            ),
            cwd=tmp_path / "other", capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        assert other.returncode == 2, other.stderr
        assert (
            f"GPU 0 (GPU-eeee0000-0000) is in use by the pool running with --run-dir "
            f"{pool.run_dir}: give each pool its own GPUs (--gpus)"
        ) in other.stderr
        assert not (tmp_path / "other" / "run").exists()
        request = model_management_pb2.ReloadConfigRequest()
        models = request.config.model_config_list
        base = status["models"][0]["base_path"]
        models.config.add(name="demo", base_path=base, model_platform="tensorflow")
        models.config.add(name="second", base_path=base, model_platform="tensorflow")
        with pool.channel() as channel, pytest.raises(grpc.RpcError) as refused:
            model_service_pb2_grpc.ModelServiceStub(channel).HandleReloadConfigRequest(
                request, timeout=60
            )
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value
        assert "compute mode EXCLUSIVE_PROCESS: without MPS it admits one process at a time, " \
            "and this pool would run 2 on it" in refused.value.details()  # fmt: skip
        status = pool.status()
        assert [m["name"] for m in status["models"]] == ["demo"]
        assert [s["slot"] for s in status["slots"]] == ["gpu0-0"]
        streamer = Streamer(pool.port, DEMO_ROWS).start()
        try:
            streamer.wait_for_successes(5)
        finally:
            streamer.stop()
        assert streamer.failed() == []
        assert pool.stop() == 0
        assert pool.leftovers() == []
        assert not claim_path("GPU-eeee0000-0000").exists()
    finally:
        pool.kill()


def test_a_gpu_is_claimed_by_one_pool_at_a_time(tmp_path: Path) -> None:
    """Locks per GPU UUID (flock, per open file: two claims in one process conflict as two
    processes' do): all of a pool's GPUs or none, the holder's run dir named, and a lock
    file a pool killed outright left behind (unlocked) taken over."""
    first, second = GpuClaims(tmp_path), GpuClaims(tmp_path)
    first.take([(0, "GPU-aaaa"), (1, "GPU-bbbb")], Path("/run/first"))
    with pytest.raises(GpuClaimed) as refused:
        second.take([(2, "GPU-cccc"), (1, "GPU-bbbb")], Path("/run/second"))
    assert refused.value.holder == "/run/first"
    assert str(refused.value) == (
        "GPU 1 (GPU-bbbb) is in use by the pool running with --run-dir /run/first: give each "
        "pool its own GPUs (--gpus)"
    )
    # GPU 2's lock, taken before GPU 1 was refused, was given back with its file.
    assert not claim_path("GPU-cccc", tmp_path).exists()
    assert claim_path("GPU-bbbb", tmp_path).read_text() == "/run/first"
    assert oct(claim_path("GPU-aaaa", tmp_path).stat().st_mode & 0o777) == "0o600"
    first.release()
    assert list(tmp_path.iterdir()) == []
    claim_path("GPU-bbbb", tmp_path).write_text("/run/killed")  # left unlocked
    second.take([(2, "GPU-cccc"), (1, "GPU-bbbb")], Path("/run/second"))
    assert claim_path("GPU-bbbb", tmp_path).read_text() == "/run/second"
    assert claim_path("GPU/x", tmp_path).name == "mpspool.gpu-GPU_x.claim"
    second.release()


@pytest.mark.skipif(os.getuid() != 0, reason="making another user's file needs root")
def test_another_users_claim_file_that_no_pool_holds_is_replaced_not_adopted(
    tmp_path: Path,
) -> None:
    """A lock file another user left (or put there to be adopted), unlocked: the pool makes
    its own, 0600 and its user's, instead of writing its run dir into theirs (which stayed
    theirs and readable by all). One they hold is refused as any holder's is."""
    planted = claim_path("GPU-aaaa", tmp_path)
    planted.write_text("/planted")
    planted.chmod(0o666)
    os.chown(planted, 65534, 65534)
    claims = GpuClaims(tmp_path)
    claims.take([(0, "GPU-aaaa")], Path("/run/ours"))
    st = planted.stat()
    assert (st.st_uid, oct(st.st_mode & 0o777)) == (os.getuid(), "0o600")
    assert planted.read_text() == "/run/ours"
    claims.release()


def test_split_active_thread_percentage_divides_the_gpu() -> None:
    from mpspool.cli import _thread_percentage
    from mpspool.config import ConfigError

    assert _thread_percentage("split", 4) == 25.0
    assert _thread_percentage("split", 3) == 33.33
    assert _thread_percentage("60", 4) == 60.0
    with pytest.raises(ConfigError, match="'split'"):
        _thread_percentage("half", 4)


def test_a_gpus_mps_server_is_started_before_its_workers_and_waited_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Clients that connect while an MPS server initialises are refused (NOT_READY), and a
    process cannot initialise CUDA twice: workers started together failed their load. The
    controller runs mps/server_start.py first, again while it is refused, within a bound.
    Here the start itself (no CUDA driver on this machine) and stand-ins for a driver that
    refuses twice, then takes it; one that fails otherwise; one refused past the bound."""
    from mpspool.mps import server_start
    from mpspool.supervisor import gpu_watch

    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:  # as here: the real module finds no driver, and says so
        said = server_start.start_server({}, 10)
        assert said.startswith("no CUDA driver to start it with (libcuda.so.1: "), said

    runs = tmp_path / "runs"
    refusing = tmp_path / "refusing"
    refusing.write_text(
        f"#!/bin/sh\necho x >> {runs}\n"
        f'[ "$(wc -l < {runs})" -ge 3 ] && exit 0\n'
        "echo 'cuInit: CUDA_ERROR_MPS_SERVER_NOT_READY'\nexit 75\n"
    )
    refusing.chmod(0o755)
    assert server_start.start_server({}, 10, [str(refusing)]) == ""
    assert runs.read_text().count("x") == 3
    runs.write_text("")
    said = server_start.start_server({}, 0.8, [str(refusing)])
    assert said == "cuInit: CUDA_ERROR_MPS_SERVER_NOT_READY for 1 s", said
    failing = tmp_path / "failing"
    failing.write_text("#!/bin/sh\necho 'cuInit: CUDA_ERROR_NO_DEVICE'\nexit 1\n")
    failing.chmod(0o755)
    assert server_start.start_server({}, 10, [str(failing)]) == "cuInit: CUDA_ERROR_NO_DEVICE"

    # The controller's wiring: each GPU's daemon's environment, and then the daemon asked
    # whether it started a server (CUDA runs without MPS when it cannot reach the daemon);
    # nothing for faked GPUs.
    started: list[dict[str, str]] = []
    monkeypatch.setattr(
        server_start, "start_server", lambda env, timeout_s: started.append(dict(env)) or ""
    )
    control = tmp_path / "no-server"
    control.write_text(
        "#!/bin/sh\nread command\n"
        '[ "$command" = get_default_active_thread_percentage ] && echo 100.0\nexit 0\n'
    )
    control.chmod(0o755)
    daemon = MpsDaemon(0, "GPU-x", str(control), tmp_path / "pipe", tmp_path / "log")
    watch = gpu_watch.GpuWatch.__new__(gpu_watch.GpuWatch)
    monkeypatch.delenv("MPSPOOL_FAKE_GPUS", raising=False)
    with caplog.at_level(logging.WARNING, logger="mpspool.controller"):
        watch._start_server(daemon, 5.0)
    [env] = started
    assert env["CUDA_VISIBLE_DEVICES"] == "GPU-x"
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == str(tmp_path / "pipe")
    assert "the daemon lists no server: it ran without MPS" in caplog.text
    # A GPU coming back: within what is left of its daemon's wait, and not cut short.
    watch._start_server(daemon, 1.0)
    assert len(started) == 1
    monkeypatch.setenv("MPSPOOL_FAKE_GPUS", "[]")
    watch._start_server(daemon, 5.0)
    assert len(started) == 1
