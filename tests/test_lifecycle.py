"""Starting and stopping a real pool: graceful stop and SIGTERM under load, refusals at
start, and a controller killed outright — nothing may be left behind."""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from pathlib import Path

import grpc
import psutil
import pytest
from grpc_health.v1 import health_pb2

from mpspool import rundir

from conftest import DEMO_ROWS
from poolproc import Pool, mpspool_cmd
from streamer import Streamer

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def watch_health(pool: Pool, seen: list[int], stop: threading.Event) -> None:
    with pool.channel() as channel:
        while not stop.is_set():
            try:
                seen.append(pool.health(channel))
            except grpc.RpcError:
                seen.append(-1)  # the server stopped accepting
            time.sleep(0.05)


@pytest.mark.parametrize("how", ["mpspool stop", "SIGTERM"])
def test_graceful_stop_under_load(tmp_path: Path, demo_model_dir: Path, how: str) -> None:
    pool = Pool(tmp_path, demo_model_dir, 1, "--shutdown-delay", "1.5").start()
    try:
        pool.wait_ready(1)
        streamer = Streamer(pool.port, DEMO_ROWS, threads=3).start()
        seen: list[int] = []
        stop_watch = threading.Event()
        watcher = threading.Thread(target=watch_health, args=(pool, seen, stop_watch))
        watcher.start()
        try:
            streamer.wait_for_successes(30)
            signalled_at = time.monotonic()
            if how == "SIGTERM":
                pool.signal(signal.SIGTERM)
                assert pool.proc is not None
                code = pool.proc.wait(60)
            else:
                code = pool.stop()
        finally:
            stop_watch.set()
            watcher.join()
            streamer.stop()
        assert code == 0, pool.output()
        # Health went SERVING → NOT_SERVING while the server still answered.
        assert SERVING in seen
        assert NOT_SERVING in seen[seen.index(SERVING) :]
        # Every request sent before the signal was answered.
        assert streamer.failed(sent_before=signalled_at) == []
        assert len(streamer.ok()) >= 30
        assert pool.leftovers() == []
    finally:
        pool.kill()


def test_refusals_at_start(tmp_path: Path, demo_model_dir: Path) -> None:
    started = time.monotonic()
    result = subprocess.run(
        mpspool_cmd(
            "start",
            "--model-base-path",
            str(tmp_path / "missing"),
            "--run-dir",
            str(tmp_path / "r"),
        ),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 2
    assert time.monotonic() - started < 10
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "missing" in lines[0], result.stderr

    pool = Pool(tmp_path, demo_model_dir, 1).start()
    try:
        pool.wait_ready(1)
        again = subprocess.run(
            mpspool_cmd(
                "start", "--model-base-path", str(demo_model_dir), "--run-dir", str(pool.run_dir)
            ),
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert again.returncode == 2
        assert "already running" in again.stderr
        assert pool.slot("cpu-0")["state"] == "READY"  # the running pool is untouched
        assert pool.stop() == 0
        assert pool.leftovers() == []
    finally:
        pool.kill()


def test_killed_controller_takes_its_processes_along(tmp_path: Path, demo_model_dir: Path) -> None:
    """kill -9 of `mpspool start`: supervisord and through it every worker and the router
    die with it; the next start in that run directory cleans what was left there."""
    pool = Pool(tmp_path, demo_model_dir, 1).start()
    try:
        pool.wait_ready(1)
        pool.signal(signal.SIGKILL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and [
            x for x in pool.leftovers() if x.startswith("process")
        ]:
            time.sleep(0.2)
        assert [x for x in pool.leftovers() if x.startswith("process")] == []
        status = subprocess.run(
            mpspool_cmd("status", "--run-dir", str(pool.run_dir)),
            cwd=tmp_path,
            capture_output=True,
            text=True,
        )
        assert status.returncode == 2 and "no pool is running" in status.stderr
        rundir.prepare(pool.run_dir)  # what `mpspool start` does first
        assert list(pool.run_dir.iterdir()) == []
        pool.run_dir.rmdir()
    finally:
        pool.kill()
    leftover = [
        p.info["cmdline"]
        for p in psutil.process_iter(["cmdline"])
        if p.info["cmdline"] and str(pool.run_dir) in " ".join(p.info["cmdline"])
    ]
    assert leftover == []
