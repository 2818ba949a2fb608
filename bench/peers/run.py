"""How the bench starts a peer (see the contract in bench/peers/__init__.py), knows when it
serves, charges its processes' CPU and memory to it, and stops it leaving nothing behind.

Kept apart from the peer modules themselves, which run in the peers' own virtualenvs."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import psutil

from bench.harness import REPO, Request, Server, alive, call
from mpspool import process

READY_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 25.0


@dataclass(frozen=True)
class Peer:
    name: str
    label: str  # "{n}": the instance count
    module: str
    venv: str  # relative to the repository; "" for the project's own interpreter
    setup: str  # the script that makes its venv
    protocol: str  # "tfserving" or "kserve"
    single: bool  # one instance by definition
    dists: tuple[str, ...]  # whose versions the report gives

    @property
    def python(self) -> Path:
        return REPO / self.venv / "bin" / "python" if self.venv else Path(sys.executable)

    def unavailable(self) -> str | None:
        """Why this peer cannot run here, or None."""
        return None if self.python.exists() else f"not installed: run {self.setup}"

    def versions(self) -> str:
        """The versions of ``dists`` in the peer's own interpreter."""
        script = (
            "import sys\nfrom importlib.metadata import version\n"
            "print(', '.join(f'{d} {version(d)}' for d in sys.argv[1:]))"
        )
        out = subprocess.run(
            [str(self.python), "-c", script, *self.dists],
            capture_output=True, text=True, timeout=60, cwd="/",
        )  # fmt: skip
        return out.stdout.strip() or out.stderr.strip()[-200:]


PEERS = {
    "plain": Peer(
        "plain", "plain TF gRPC (1 process)", "bench.peers.plain", "", "", "tfserving", True,
        ("tensorflow-cpu", "grpcio", "tensorflow-serving-api"),
    ),
    "ray": Peer(
        "ray", "Ray Serve ({n} replicas)", "bench.peers.ray_serve", ".tools/ray-venv",
        "bench/peers/setup-ray", "tfserving", False, ("ray", "tensorflow-cpu"),
    ),
    "triton": Peer(
        "triton", "PyTriton ({n} instances)", "bench.peers.triton", ".tools/pytriton-venv",
        "bench/peers/setup-pytriton", "kserve", False, ("nvidia-pytriton", "tensorflow-cpu"),
    ),
}  # fmt: skip


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class PeerServer:
    """One peer in its own session; a context manager that always stops it and everything
    of its session and process tree."""

    def __init__(
        self, peer: Peer, model_dir: Path, instances: int, log_path: Path, env: dict[str, str]
    ) -> None:
        self.peer = peer
        self.instances = 1 if peer.single else instances
        self.port = free_port()
        self.log_path = log_path
        self.env = env
        self.args = [
            str(peer.python), "-m", peer.module, "--model-dir", str(model_dir),
            "--port", str(self.port), "--instances", str(self.instances),
        ]  # fmt: skip
        self.proc: subprocess.Popen[bytes] | None = None
        self.start_s = 0.0  # spawn → first answer
        self.spawned_at = 0.0
        self._seen: dict[int, psutil.Process] = {}

    def __enter__(self) -> PeerServer:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            # The clock read at the spawn, not psutil's create_time(): that rests on a boot
            # time in whole seconds, up to a second early (bench/harness.py's Pool does the same).
            self.spawned_at = time.time()
            self.proc = subprocess.Popen(
                self.args, cwd=REPO, env=self.env, stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True,
                preexec_fn=process.die_with_parent_sigterm,
            )  # fmt: skip
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    @property
    def name(self) -> str:
        return self.peer.label.format(n=self.instances)

    def wait_ready(self, request: Request, timeout_s: float = READY_TIMEOUT_S) -> Server:
        """Poll with a real request until one is answered (the contract's only readiness)."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                tail = self.log_path.read_text(errors="replace").splitlines()[-5:]
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}: {tail}")
            try:
                call(f"127.0.0.1:{self.port}", request, timeout_s=10)
                break
            except RuntimeError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.25)
        self.start_s = time.time() - self.spawned_at
        return Server(self.name, self.port, {"server": self.processes()}, request.protocol)

    def processes(self) -> list[psutil.Process]:
        """Every live process of the peer: its session's members and its descendants."""
        if self.proc is None:
            return []
        found: dict[int, psutil.Process] = {}
        with contextlib.suppress(psutil.Error):
            top = psutil.Process(self.proc.pid)
            found = {p.pid: p for p in [top, *top.children(recursive=True)]}
        for proc in psutil.process_iter():
            with contextlib.suppress(psutil.Error, OSError):
                if os.getsid(proc.pid) == self.proc.pid:
                    found.setdefault(proc.pid, proc)
        live = [p for p in found.values() if alive(p)]
        self._seen.update((p.pid, p) for p in live)
        return live

    def stop(self) -> None:
        """SIGTERM (the contract's way to stop a peer), wait, then SIGKILL whatever is left."""
        if self.proc is None:
            return
        self.processes()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and any(alive(p) for p in self._seen.values()):
            time.sleep(0.1)
        for proc in self._seen.values():
            if alive(proc):
                with contextlib.suppress(psutil.Error):
                    proc.kill()

    def leftovers(self) -> list[str]:
        return [
            f"{self.name}: process {p.pid} still running" for p in self._seen.values() if alive(p)
        ]
