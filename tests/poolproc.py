"""A real `mpspool start` process for tests: start, wait, query, stop, and check that
nothing is left behind."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import psutil
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mpspool.cli import _ask_pool
from mpspool.config import ConfigError

REPO = Path(__file__).resolve().parent.parent


def prometheus_samples(text: str) -> dict[str, float]:
    """A Prometheus text page's samples: name and labels as the page writes them → value."""
    rows = (line.rsplit(" ", 1) for line in text.splitlines() if line and line[0] != "#")
    return {key: float(value) for key, value in rows}


def mpspool_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "mpspool", *args]


def memory_mib(pid: int, field: str) -> float:
    """A memory line of /proc/PID/status, in MiB: VmRSS (held now), VmHWM (the most held at
    once)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no {field} for pid {pid}")


class Pool:
    def __init__(
        self,
        tmp: Path,
        model_base_path: Path,
        workers: int = 2,
        *extra: str,
        run_dir: Path | None = None,
        open_files: int | None = None,
        prefix: tuple[str, ...] = (),
    ) -> None:
        self.tmp = tmp
        # A command the pool runs under (setpriv dropping capabilities, say).
        self.prefix = prefix
        # The pool's limit on open files (soft and hard, so no process of it can raise it), as
        # a container's would be; None: this process's.
        self.open_files = open_files
        # Short paths: ipc:// endpoints are unix socket paths (≤ 107 bytes).
        self.run_dir = run_dir or Path(f"/tmp/mpt-{os.getpid()}-{tmp.name[-12:]}")
        self.log_dir = tmp / "logs"
        self.out_path = tmp / "start.out"
        self.model_base_path = model_base_path
        self.args = [
            "start",
            "--model-base-path",
            str(model_base_path),
            "--model-name",
            "demo",
            "--workers",
            str(workers),
            "--port",
            "0",
            "--run-dir",
            str(self.run_dir),
            "--log-dir",
            str(self.log_dir),
            "--metrics-port",
            "0",
            "--rest-api-port",
            "0",
            # No load balancer watches a test's pool: its stop need not give one the default
            # second to see health go NOT_SERVING. A test of that delay passes its own (the
            # last value given wins).
            "--shutdown-delay",
            "0",
            *extra,
        ]
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0
        self.rest_url = ""  # http://host:port of the REST API
        self.pool_id = ""
        self._descendants: set[int] = set()

    # -- lifecycle ------------------------------------------------------------------
    def start(self) -> Pool:
        out = open(self.out_path, "wb")
        # cwd outside the repository: `python -m` puts the cwd on sys.path, and the
        # repository's supervisor/ folder must not shadow supervisord's package. Its own
        # process group, as a shell starts a job: a terminal's Ctrl-C (ctrl_c) is a signal
        # to that group.
        # prlimit (util-linux) rather than a preexec_fn: this process has gRPC's threads.
        limit = [] if self.open_files is None else ["prlimit", f"--nofile={self.open_files}", "--"]
        self.proc = subprocess.Popen(
            [*self.prefix, *limit, *mpspool_cmd(*self.args)],
            cwd=self.tmp,
            stdout=out,
            stderr=subprocess.STDOUT,
            process_group=0,
        )
        return self

    def wait_ready(self, workers: int, timeout: float = 90.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        status: dict[str, Any] = {}
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(f"pool exited with {self.proc.returncode}:\n{self.output()}")
            try:
                status = self.status()
            except ConfigError:  # not up yet
                time.sleep(0.2)
                continue
            ready = [s for s in status["slots"] if s["state"] == "READY"]
            if len(ready) >= workers and status["pool"]["listen"]:
                self.port = int(status["pool"]["listen"].rsplit(":", 1)[1])
                rest = status["pool"].get("rest") or ""
                self.rest_url = rest.split("/v1/", 1)[0]
                self.pool_id = status["pool"]["pool_id"]
                self._remember_descendants()
                return status
            time.sleep(0.2)
        raise AssertionError(
            f"{workers} workers not READY within {timeout} s: {status}\n{self.output()}"
        )

    def wait_for(
        self, predicate: Any, timeout: float = 60.0, what: str = "condition"
    ) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        status: dict[str, Any] = {}
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(f"pool exited with {self.proc.returncode}:\n{self.output()}")
            try:
                status = self.status()
            except ConfigError:
                # The controller can be busy for a few seconds (restarting a GPU's workers
                # waits for its daemon); ask again.
                time.sleep(0.2)
                continue
            if predicate(status):
                return status
            time.sleep(0.1)
        raise AssertionError(
            f"{what} not reached within {timeout} s: {json.dumps(status, indent=1)}"
        )

    def status(self) -> dict[str, Any]:
        """What `mpspool status --json` prints, asked in this process through the CLI's own
        request: the tests poll this every 0.1-0.2 s while workers start, and a CLI process
        per poll cost 0.4 s of CPU, a third of this 2-core machine taken from the workers
        being waited for. Through JSON as the CLI prints it (int map keys become strings).
        ConfigError (mpspool.config) while no controller answers."""
        return json.loads(json.dumps(_ask_pool(self.run_dir.resolve(), "status")))

    def slot(self, name: str) -> dict[str, Any]:
        return next(s for s in self.status()["slots"] if s["slot"] == name)

    def stop(self, timeout: float = 60.0, cli: bool = False) -> int:
        """Stops the pool and returns its exit code. ``cli``: through `mpspool stop` (a test
        of that command); else with the request it sends, from this process: a CLI process
        per stop cost 0.3-0.5 s of CPU, and most tests stop a pool."""
        if cli:
            subprocess.run(
                mpspool_cmd("stop", "--run-dir", str(self.run_dir)),
                cwd=self.tmp,
                check=True,
                timeout=timeout,
                capture_output=True,
            )
        else:
            _ask_pool(self.run_dir.resolve(), "stop")
        assert self.proc is not None
        return self.proc.wait(timeout)

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def ctrl_c(self) -> None:
        """What a terminal's Ctrl-C does: SIGINT to the job's whole process group."""
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGINT)

    def kill(self) -> None:
        """Last resort at teardown: the whole tree, so a failed test leaks nothing."""
        self._remember_descendants()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for pid in self._descendants:
            try:
                psutil.Process(pid).kill()
            except psutil.Error:
                pass
        # What a pool whose controller was killed could not remove itself: its run dir (one
        # per test under /tmp, so a test that SIGKILLs the controller left one behind at every
        # run) and its segments. Tests that check for leftovers do so before this.
        for segment in self.segments():
            segment.unlink(missing_ok=True)
        shutil.rmtree(self.run_dir, ignore_errors=True)

    def output(self) -> str:
        return self.out_path.read_text(errors="replace") if self.out_path.exists() else ""

    def _remember_descendants(self) -> None:
        if self.proc is None:
            return
        try:
            self._descendants |= {
                p.pid for p in psutil.Process(self.proc.pid).children(recursive=True)
            }
        except psutil.Error:
            pass

    def leftovers(self) -> list[str]:
        """Processes of this pool still alive, and files left in its run directory."""
        left = []
        for pid in self._descendants:
            try:
                proc = psutil.Process(pid)
                if proc.status() != psutil.STATUS_ZOMBIE:
                    left.append(f"process {pid}: {' '.join(proc.cmdline())[:120]}")
            except psutil.Error:
                pass
        if self.run_dir.exists():
            left.extend(f"file {p}" for p in self.run_dir.iterdir())
            left.append(f"run dir {self.run_dir}")
        left.extend(f"segment {p}" for p in self.segments())
        return left

    def segments(self) -> list[Path]:
        """This pool's shared-memory weight segments."""
        return sorted(Path("/dev/shm").glob(f"mpspool-{self.pool_id}-*")) if self.pool_id else []

    def worker_pids(self) -> list[int]:
        return [s["pid"] for s in self.status()["slots"] if s["pid"]]

    # -- clients --------------------------------------------------------------------
    def channel(self) -> grpc.Channel:
        return grpc.insecure_channel(f"127.0.0.1:{self.port}")

    def health(self, channel: grpc.Channel, service: str = "") -> int:
        stub = health_pb2_grpc.HealthStub(channel)
        return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status
