"""The MPS control daemon: its command line, its environment, and talking to it.

mpspool runs one control daemon per GPU, each with its own pipe directory and
CUDA_VISIBLE_DEVICES set to that GPU alone. The MPS server a daemon spawns then serves one
GPU only, so a server fault takes down the clients of that GPU and no other — the unit of
recovery is the GPU. Daemons run in the foreground (`-f`) as supervisord programs under
the workers' UID (MPS refuses clients of another user).

Queries go through the same binary in client mode: `echo CMD | nvidia-cuda-mps-control`
with the daemon's CUDA_MPS_PIPE_DIRECTORY. What it answers, as observed:
- a known command: exit 0, the answer on stdout (possibly empty);
- an unknown one: exit 0 and `Unknown command "..."` — so exit codes alone prove nothing;
- no daemon behind the pipe directory: exit 1 and `Cannot find MPS control daemon
  process`. Socket files left by a daemon that was killed do not mean it runs;
- a daemon that takes the connection and hangs up (starting, or going away): exit 1 and
  `Cannot authenticate or connect to MPS control daemon process` or `Cannot send command to
  MPS control daemon process` (CI, 2026-11-25: a worker that asked 0.8 s after its daemon
  was spawned on a busy machine got the second). All three mean no daemon answers now.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

CONTROL_BINARY = "nvidia-cuda-mps-control"
BINARY_ENV = "MPSPOOL_MPS_CONTROL"  # an explicit path, e.g. one unpacked from a .deb

# Lines of a daemon's output (with -f, its log goes to stdout) that mean its MPS server,
# and so every client on that GPU, is gone.
FAULT_PATTERNS = (
    re.compile(r"Server encountered a fatal exception"),
    re.compile(r"Server \d+ exited"),
    re.compile(r"CUDA_ERROR_MPS_SERVER_NOT_READY"),
)

# What the client says when no daemon answers its command (the module's doc).
NOT_ANSWERING = (
    "Cannot find MPS control daemon",
    "Cannot authenticate or connect to MPS control daemon",
    "Cannot send command to MPS control daemon",
)

# MPS's own limit: a server accepts at most 48 client contexts per GPU (Volta and later).
MAX_CLIENTS_PER_GPU = 48


class MpsError(RuntimeError):
    """The daemon answered, but not as expected (an unknown command, a refused value)."""


class DaemonDown(MpsError):
    """No control daemon answers behind the pipe directory."""


class DaemonHung(MpsError):
    """A control daemon took the query but gave no answer in time (stopped, wedged)."""


def find_control_binary(explicit: str | None = None) -> str:
    """The control binary: an explicit path, $MPSPOOL_MPS_CONTROL, or PATH."""
    for candidate in (explicit, os.environ.get(BINARY_ENV)):
        if candidate:
            if not os.access(candidate, os.X_OK):
                raise MpsError(f"{candidate} is not an executable {CONTROL_BINARY}")
            # Absolute: supervisord starts the daemon from the run directory.
            return os.path.abspath(candidate)
    found = shutil.which(CONTROL_BINARY)
    if not found:
        raise MpsError(
            f"{CONTROL_BINARY} not found on PATH (it comes with the NVIDIA driver's utilities; "
            f"set {BINARY_ENV} to its path, or pass --no-mps)"
        )
    return found


def fault_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if any(p.search(line) for p in FAULT_PATTERNS)]


@dataclass(frozen=True)
class MpsDaemon:
    """One GPU's control daemon: where its pipes and logs live, and how to query it."""

    gpu_index: int
    gpu_uuid: str
    binary: str
    pipe_dir: Path
    log_dir: Path

    @property
    def program(self) -> str:
        return f"mps-gpu{self.gpu_index}"

    def command(self) -> list[str]:
        """Runs in the foreground under supervisord, and ends (SIGTERM) when supervisord does:
        a foreign binary cannot ask for that itself, so util-linux's setpriv sets the
        parent-death signal and execs it (same pid). An orphan daemon would hold its pipe
        directory, and the revived pool's own daemon would find "an instance already
        running"."""
        setpriv = shutil.which("setpriv")
        if setpriv is None:  # pragma: no cover - util-linux is in every Debian base image
            return [self.binary, "-f"]
        return [setpriv, "--pdeathsig", "TERM", "--", self.binary, "-f"]

    def environment(self) -> dict[str, str]:
        """For the daemon and for every client of it (workers, queries)."""
        return {
            "CUDA_VISIBLE_DEVICES": self.gpu_uuid,
            "CUDA_MPS_PIPE_DIRECTORY": str(self.pipe_dir),
            "CUDA_MPS_LOG_DIRECTORY": str(self.log_dir),
        }

    def prepare_dirs(self) -> None:
        for path in (self.pipe_dir, self.log_dir):
            path.mkdir(mode=0o700, parents=True, exist_ok=True)

    def query(self, command: str, timeout_s: float = 5.0) -> str:
        env = {**os.environ, **self.environment()}
        try:
            result = subprocess.run(
                [self.binary],
                input=command + "\n",
                env=env,
                capture_output=True,
                text=True,
                timeout=timeout_s,
            )
        except subprocess.TimeoutExpired:
            raise DaemonHung(
                f"{self.program}: {command!r} got no answer in {timeout_s:g} s"
            ) from None
        out = (result.stdout + result.stderr).strip()
        if result.returncode != 0:
            if any(says in out for says in NOT_ANSWERING):
                raise DaemonDown(f"{self.program}: no control daemon answers in {self.pipe_dir}")
            raise MpsError(f"{self.program}: {command!r} failed ({result.returncode}): {out}")
        if out.startswith("Unknown command"):
            raise MpsError(f"{self.program}: {command!r}: {out}")
        return out

    def ready(self, timeout_s: float = 5.0) -> bool:
        # Asks for a value a daemon always has. The client exits 0 with no output when a daemon
        # hangs up after its greeting (3 runs in 40 against a socket that does), and an empty
        # server list looks the same; an empty default does not.
        try:
            return self.query("get_default_active_thread_percentage", timeout_s) != ""
        except DaemonDown:
            return False

    def wait_ready(self, timeout_s: float = 15.0) -> None:
        deadline = time.monotonic() + timeout_s
        # Each query within what is left: a daemon that hangs (stopped) answers none.
        while not self.ready(max(0.5, min(5.0, deadline - time.monotonic()))):
            if time.monotonic() > deadline:
                raise DaemonDown(
                    f"{self.program}: the control daemon did not answer within {timeout_s:.0f} s"
                )
            time.sleep(0.1)

    def apply_defaults(
        self, active_thread_percentage: float, pinned_mem_limit_mib: int
    ) -> dict[str, str]:
        """Set the defaults every new MPS server of this daemon gives its clients, and read
        them back. Device 0: the daemon sees only its own GPU."""
        self.query(f"set_default_active_thread_percentage {active_thread_percentage:g}")
        if pinned_mem_limit_mib > 0:
            self.query(f"set_default_device_pinned_mem_limit 0 {pinned_mem_limit_mib}M")
        applied = self.defaults()
        # It answers with one decimal ("33.3" for 33.33).
        if abs(float(applied["active_thread_percentage"]) - active_thread_percentage) > 0.1:
            raise MpsError(f"{self.program}: active thread percentage reads back as {applied}")
        return applied

    def defaults(self) -> dict[str, str]:
        return {
            "active_thread_percentage": self.query("get_default_active_thread_percentage"),
            "pinned_mem_limit": self.query("get_default_device_pinned_mem_limit 0"),
        }

    def servers(self, timeout_s: float = 5.0) -> list[int]:
        """The daemon's MPS servers, within ``timeout_s`` in all."""
        deadline = time.monotonic() + timeout_s
        answer = self.query("get_server_list", timeout_s)
        # An empty list is also what the client prints when the daemon hangs up (ready()):
        # "no servers" only from a daemon that still answers.
        if not answer and not self.ready(max(0.1, deadline - time.monotonic())):
            raise DaemonDown(f"{self.program}: the control daemon hung up")
        return [int(x) for x in answer.split()]

    def clients(self, server: int, timeout_s: float = 5.0) -> list[int]:
        return [int(x) for x in self.query(f"get_client_list {server}", timeout_s).split()]

    def terminate_clients(self, budget_s: float = 5.0) -> list[tuple[int, int]]:
        """Ask the server to end each client's GPU work before the client is signalled: a
        client killed with work in flight can otherwise wedge the server. Within `budget_s`
        in all, as a pod's stop budgets it (deploy/README.md): each query gets what is left,
        so a daemon slow to answer each of several clients cannot take 5 s per client.
        DaemonHung once the budget is spent."""
        deadline = time.monotonic() + budget_s

        def left() -> float:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise DaemonHung(f"{self.program}: terminate_client not done in {budget_s:g} s")
            return remaining

        done = []
        for server in self.servers(left()):
            for client in self.clients(server, left()):
                self.query(f"terminate_client {server} {client}", left())
                done.append((server, client))
        return done

    def quit(self) -> None:
        try:
            self.query("quit")
        except DaemonDown:
            pass
