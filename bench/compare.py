"""The peer comparison: mpspool against what a user would run instead, on the same demo model,
the same machine, in one run.

Systems, one at a time (started, measured, stopped and checked for leftovers before the next):

- ``inprocess``: the in-process limit, P = N processes calling the SavedModel directly
  (bench.inprocess); no RPC, the reference of every "× in-process" ratio.
- ``plain``: plain single-process serving (bench.peers.plain): one TensorFlow process behind
  a grpcio server speaking TF Serving's API, intra-op threads = cores.
- ``ray``: Ray Serve with N replicas (bench.peers.ray_serve, in .tools/ray-venv).
- ``triton``: PyTriton with N instances (bench.peers.triton, in .tools/pytriton-venv), over
  KServe v2 gRPC.
- ``mpspool-1`` and ``mpspool-N``: pools of 1 and N workers, running a frozen copy of the
  code under test (bench.foundation).

A peer whose virtualenv is missing is recorded as not installed and skipped. For each system
it measures the cold start (spawn to the first successful answer to a real request, polled),
the total PSS of every process the system started (after the sweep, batch 256 included), and
for every batch size and closed-loop concurrency the throughput, p50/p99, errors, and the CPU
per request of the server's processes and of the client. For one mpspool-N point it also
collects the worker-side span of every request (`mpspool timeline`) and draws the per-worker
task density. Writes ``bench/out/compare-<stamp>.json``, three PNGs beside it, and the peers
section of ``bench/RESULTS.md``.

    .venv/bin/python -m bench.compare                  # the whole comparison (~6 minutes)
    .venv/bin/python -m bench.compare --quick          # a smoke run on a 1,000-row model
    .venv/bin/python -m bench.compare --systems plain,mpspool-N --repeat 2
    .venv/bin/python -m bench.compare --render bench/out/compare-<stamp>.json

Every process it starts is stopped before it exits, on errors, Ctrl-C and SIGTERM included;
each peer runs in its own session, and whatever is left of that session is killed and
reported.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import psutil

from bench import loadgen, plots
from bench.foundation import (
    _OUTSIDE,
    MODEL_NAME,
    OUT_DIR,
    REPO,
    RESULTS_MD,
    CpuProbe,
    Pool,
    _describe_source,
    _f,
    _ints,
    add_output_arguments,
    best_of,
    command_line,
    ensure_model,
    frozen_code,
    machine,
    print_targets,
    run_to_json,
    shm_leftovers,
    versions,
    write_section,
)
from bench.inprocess import InProcessLimit
from bench.memory import memory_of
from mpspool import process, wire
from mpspool.cli import _ask_pool

BEGIN_MARK = "<!-- peers:begin (written by bench/compare.py; edits here are lost) -->"
END_MARK = "<!-- peers:end -->"
SYSTEMS = ("inprocess", "plain", "ray", "triton", "mpspool-1", "mpspool-N", "mpspool-N-batching")
PEER_SYSTEMS = ("plain", "ray", "triton")
FULL_ROWS = 2_000_000
QUICK_ROWS = 1000
# Ray Serve on a busy 2-core machine takes a minute to start; a system that has not answered
# in this long is broken, not slow.
READY_TIMEOUT_S = 300.0
POLL_INTERVAL_S = 0.25
POLL_REQUEST_TIMEOUT_S = 10.0
# The peer contract asks for an exit within ~20 s of SIGTERM.
PEER_STOP_TIMEOUT_S = 25.0
DENSITY_BIN_US = 1000
DENSITY_OVERVIEW_BIN_US = 20_000  # the whole window, time-averaged
DENSITY_EXCERPT_US = 200_000  # then its start, fine enough to see single requests
MIB = 2**20
# The targets of issue #5.
TARGET_BIG_OVER_INPROCESS = 0.9
TARGET_SMALL_OVER_INPROCESS = 0.5


# -- peers ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Peer:
    """A peer server module (see bench.peers) and how to run it."""

    name: str
    module: str
    venv: str  # relative to the repository; "" for the project's own interpreter
    setup: str  # the script that installs its venv
    protocol: str  # what loadgen speaks to it: "tfserving" or "kserve"
    single: bool  # one instance by definition
    dists: tuple[str, ...]  # whose versions the report gives
    # Python run in the peer's venv with the target as argv[1], printing the server's own
    # version (for servers whose version is not a Python distribution's).
    server_version_probe: str = ""

    @property
    def python(self) -> Path:
        return REPO / self.venv / "bin" / "python" if self.venv else Path(sys.executable)

    @property
    def module_file(self) -> Path:
        return REPO / (self.module.replace(".", "/") + ".py")

    def unavailable(self) -> str | None:
        """Why this peer cannot run here, or None."""
        if not self.python.exists():
            return f"not installed: run {self.setup}"
        if not self.module_file.exists():
            return f"not available: {self.module_file.relative_to(REPO)} is missing"
        return None


PEERS = {
    "plain": Peer(
        "plain", "bench.peers.plain", "", "", "tfserving", True,
        ("tensorflow-cpu", "grpcio", "tensorflow-serving-api"),
    ),
    "ray": Peer(
        "ray", "bench.peers.ray_serve", ".tools/ray-venv", "bench/peers/setup-ray", "tfserving",
        False, ("ray", "tensorflow-cpu", "grpcio", "numpy"),
    ),
    "triton": Peer(
        "triton", "bench.peers.triton", ".tools/pytriton-venv", "bench/peers/setup-pytriton",
        "kserve", False, ("nvidia-pytriton", "tritonclient", "tensorflow-cpu", "numpy"),
        server_version_probe=(
            "import sys, tritonclient.grpc as g\n"
            "print(g.InferenceServerClient(sys.argv[1]).get_server_metadata().version)"
        ),
    ),
}  # fmt: skip

_VERSIONS_SCRIPT = """
import json, sys
from importlib.metadata import PackageNotFoundError, version
found = {"python": sys.version.split()[0]}
for dist in sys.argv[1:]:
    try:
        found[dist] = version(dist)
    except PackageNotFoundError:
        pass
print(json.dumps(found))
"""


def peer_versions(peer: Peer) -> dict[str, str]:
    """The versions of ``peer.dists`` in the peer's own interpreter (no import of them)."""
    try:
        out = subprocess.run(
            [str(peer.python), "-c", _VERSIONS_SCRIPT, *peer.dists],
            cwd=_OUTSIDE, capture_output=True, text=True, check=True, timeout=60,
        ).stdout  # fmt: skip
        return json.loads(out)
    except (subprocess.SubprocessError, OSError, json.JSONDecodeError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"[:200]}


def label(system: str, n: int) -> str:
    return {
        "inprocess": f"in-process P={n}",
        "plain": "plain (1 process)",
        "ray": f"Ray Serve ({n} replicas)",
        "triton": f"PyTriton ({n} instances)",
        "mpspool-1": "mpspool 1 worker",
        "mpspool-N": f"mpspool {n} workers",
        "mpspool-N-batching": f"mpspool {n} workers, --enable-batching",
    }.get(system, system)


def free_port() -> int:
    """A port free on 127.0.0.1 right now (the servers bind it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


class PeerServer:
    """One peer process in its own session; a context manager that always stops it and
    everything left of its session (and of its process tree, for children that left it)."""

    def __init__(
        self,
        peer: Peer,
        model_dir: Path,
        instances: int,
        log_path: Path,
        env: dict[str, str],
        threads: int = 0,
    ) -> None:
        self.peer = peer
        self.port = free_port()
        self.target = f"127.0.0.1:{self.port}"
        self.log_path = log_path
        self.env = env
        self.args = [
            str(peer.python), "-m", peer.module,
            "--model-dir", str(model_dir),
            "--port", str(self.port),
            "--instances", str(instances),
            *(["--threads", str(threads)] if threads else []),
        ]  # fmt: skip
        self.proc: subprocess.Popen[bytes] | None = None
        self.spawned = 0.0  # time.monotonic() at spawn
        self._seen: dict[int, psutil.Process] = {}
        self.stop_record: dict[str, Any] = {}

    def __enter__(self) -> PeerServer:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.spawned = time.monotonic()
            # Own session: a Ctrl-C in the terminal reaches this script only, which stops the
            # peer in order; SIGTERM if this script dies.
            self.proc = subprocess.Popen(
                self.args,
                cwd=REPO,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=process.die_with_parent_sigterm,
            )
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def exited(self) -> str | None:
        if self.proc is not None and self.proc.poll() is not None:
            return f"exited with {self.proc.returncode}; last lines: {self.log_tail()}"
        return None

    def log_tail(self, lines: int = 5) -> str:
        with contextlib.suppress(OSError):
            return " | ".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def processes(self) -> list[psutil.Process]:
        """Every live process of the peer: its session's members and its descendants."""
        if self.proc is None:
            return []
        found: dict[int, psutil.Process] = {}
        with contextlib.suppress(psutil.Error):
            top = psutil.Process(self.proc.pid)
            found[top.pid] = top
            for child in top.children(recursive=True):
                found[child.pid] = child
        for proc in psutil.process_iter():
            with contextlib.suppress(psutil.Error, OSError):
                if os.getsid(proc.pid) == self.proc.pid:
                    found.setdefault(proc.pid, proc)
        live = [p for p in found.values() if _alive(p)]
        self._seen.update((p.pid, p) for p in live)
        return live

    def stop(self) -> None:
        """SIGTERM (the contract's way to stop a peer), wait, then SIGKILL whatever is left."""
        if self.proc is None or self.stop_record:
            return
        self.processes()
        started = time.monotonic()
        record: dict[str, Any] = {}
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(PEER_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                record["incident"] = f"did not exit within {PEER_STOP_TIMEOUT_S:.0f} s of SIGTERM"
                self.proc.kill()
                self.proc.wait()
        record["exit_code"] = self.proc.returncode
        record["stop_s"] = round(time.monotonic() - started, 2)
        # Children must be gone with the peer; give them a moment, then count and kill.
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and any(_alive(p) for p in self._seen.values()):
            time.sleep(0.1)
        left = [p for p in self._seen.values() if _alive(p)]
        with contextlib.suppress(psutil.Error, OSError):
            left += [
                p
                for p in psutil.process_iter()
                if p.pid not in self._seen and os.getsid(p.pid) == self.proc.pid and _alive(p)
            ]
        record["killed_after_stop"] = [f"{p.pid} {_name(p)}" for p in left]
        for proc in left:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        self.stop_record = record

    def leftovers(self) -> list[str]:
        """Processes of this peer still alive after stop()."""
        gone = [p for p in self._seen.values() if _alive(p)]
        return [f"{self.peer.name}: process {p.pid} {_name(p)} still running" for p in gone]


def _name(proc: psutil.Process) -> str:
    with contextlib.suppress(psutil.Error):
        return " ".join(proc.cmdline())[:100] or proc.name()
    return "?"


# -- requests and measurements --------------------------------------------------------
def make_requests(protocol: str, batch: int, rows: int, distinct: int) -> list[bytes]:
    """Serialized demo-model requests in the protocol the system speaks."""
    if protocol == "kserve":
        return loadgen.kserve_requests(batch, rows, count=distinct, model_name=MODEL_NAME)
    return loadgen.demo_requests(batch, rows, distinct, MODEL_NAME)


async def _poll_first_answer(
    target: str, payload: bytes, protocol: str, exited: Callable[[], str | None], deadline: float
) -> None:
    last = ""
    next_note = time.monotonic() + 30.0
    while time.monotonic() < deadline:
        if time.monotonic() > next_note:
            _say(f"compare: {target} not answering yet: {last[:200]}")
            next_note += 30.0
        reason = exited()
        if reason:
            raise RuntimeError(f"{target}: the server {reason}")
        try:
            await loadgen.check_target(
                target, payload, 1, timeout_s=POLL_REQUEST_TIMEOUT_S, protocol=protocol
            )
            return
        except (RuntimeError, ValueError, OSError) as exc:
            last = str(exc)
        await asyncio.sleep(POLL_INTERVAL_S)
    raise TimeoutError(f"{target} did not answer within {READY_TIMEOUT_S:.0f} s: {last}")


def wait_first_answer(
    target: str, payload: bytes, protocol: str, spawned: float, exited: Callable[[], str | None]
) -> float:
    """Poll with a real request until one is answered; seconds from ``spawned``."""
    asyncio.run(_poll_first_answer(target, payload, protocol, exited, spawned + READY_TIMEOUT_S))
    return time.monotonic() - spawned


def measure_point(
    target: str,
    protocol: str,
    payloads: list[bytes],
    batch: int,
    concurrency: int,
    procs: list[psutil.Process],
    args: argparse.Namespace,
    spans: SpanRecorder | None = None,
) -> dict[str, Any]:
    """One closed-loop point, with the server's CPU over exactly the measured window (and,
    with ``spans``, the worker-side span of each request answered in it)."""
    probe = CpuProbe({"server": procs})
    result = asyncio.run(
        loadgen.closed_loop(
            target,
            payloads,
            batch,
            concurrency,
            duration_s=args.duration,
            warmup_s=args.warmup,
            on_window=probe if spans is None else _both(spans, probe),
            protocol=protocol,
        )
    )
    ok = result["ok"]
    server_s = probe.used.get("server")
    result["server_cpu_s"] = server_s
    result["server_processes"] = len(procs)
    result["server_cpu_us_per_request"] = (
        server_s / ok * 1e6 if ok and server_s is not None else None
    )
    if probe.lost:
        result["disturbed"] = f"gone during the window: {', '.join(probe.lost)}"
    return result


def measure_memory(procs: list[psutil.Process], segment_bytes: int = 0) -> dict[str, Any]:
    """Total PSS of ``procs``. mpspool's weight segment is charged whole, once: the processes'
    PSS outside it plus its size (pages nobody touched are in /dev/shm all the same)."""
    entries = []
    for proc in procs:
        with contextlib.suppress(psutil.Error, OSError):
            entry = memory_of(proc)
            entry["name"] = _name(proc)
            entries.append(entry)
    total = sum(e["pss_outside_segment"] for e in entries) + segment_bytes
    return {
        "pss_total_bytes": total,
        "segment_bytes": segment_bytes,
        "processes": [
            {k: e[k] for k in ("pid", "name", "pss", "uss", "rss", "segment_pss")} for e in entries
        ],
    }


def _point(system: str, round_: int, result: dict[str, Any]) -> dict[str, Any]:
    result = dict(result)
    result.pop("target", None)
    result.update(system=system, round=round_)
    return result


def _line(result: dict[str, Any], n: str = "") -> str:
    errors = f" ERRORS {result['errors']}" if result.get("error_count") else ""
    cpu = result.get("server_cpu_us_per_request") or result.get("cpu_us_per_call")
    return (
        f"compare: {result['system']:>9} batch={result['batch']:<4} "
        f"c={result['concurrency']:<3}{n}: {result['throughput_rps']:8,.1f} req/s "
        f"{result['rows_per_s']:10,.0f} rows/s p50 {result['p50_ms']:7.2f} ms "
        f"p99 {result['p99_ms']:7.2f} ms server {_f(cpu or math.nan, 0)} µs/req{errors}"
    )


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


# -- the systems --------------------------------------------------------------------
@dataclass
class Context:
    args: argparse.Namespace
    model_base: Path
    rows: int
    log_root: Path
    pool_env: dict[str, str]  # runs the frozen copy of the code under test
    peer_env: dict[str, str]
    points: list[dict[str, Any]]
    incidents: list[str]
    leftovers: list[str]
    density: dict[str, Any]


def run_inprocess(ctx: Context, round_: int) -> dict[str, Any]:
    n = ctx.args.instances
    record: dict[str, Any] = {}
    with InProcessLimit(ctx.model_base / "1", ctx.rows, processes=n) as limit:
        # Spawn to every process loaded (it has no RPC to poll; its first call traces the
        # signature and is not timed).
        record["cold_start_s"] = round(limit.load_s, 2)
        record["cold_start_is"] = "spawn to all processes loaded (no RPC)"
        _say(f"compare: inprocess loaded in {limit.load_s:.1f} s")
        procs = [psutil.Process(pid) for pid in limit.pids]
        for batch in ctx.args.batches:
            result = limit.run(batch, ctx.args.duration, ctx.args.warmup)
            result["concurrency"] = n
            result["error_count"] = 0
            result["errors"] = {}
            result["server_cpu_us_per_request"] = result["cpu_us_per_call"]
            result["client_cpu_us_per_request"] = None
            point = _point("inprocess", round_, result)
            ctx.points.append(point)
            _say(_line(point, " (P)"))
        record["memory"] = measure_memory(procs)
    left = [f"inprocess: process {p.pid} still running" for p in procs if _alive(p)]
    ctx.leftovers.extend(left)
    return record


def _sweep(
    ctx: Context,
    system: str,
    round_: int,
    target: str,
    protocol: str,
    requests: dict[int, list[bytes]],
    processes: Callable[[], list[psutil.Process]],
    run_dir: Path | None = None,
) -> None:
    """Every batch size and concurrency, one closed-loop point each. With ``run_dir`` (a
    pool's), the density point's worker-side spans are kept, once per comparison."""
    for batch, payloads in requests.items():
        asyncio.run(loadgen.check_target(target, payloads[0], batch, protocol=protocol))
        for concurrency in ctx.args.concurrency:
            spans = None
            if run_dir is not None and not ctx.density and (batch, concurrency) == ctx.args.density:
                spans = SpanRecorder(run_dir)
            result = measure_point(
                target, protocol, payloads, batch, concurrency, processes(), ctx.args, spans
            )
            if spans is not None:
                ctx.density.update(density_record(spans, result), separate_run=False)
            point = _point(system, round_, result)
            if "disturbed" in point:
                ctx.incidents.append(
                    f"{system} batch={batch} c={concurrency}: {point['disturbed']}"
                )
            ctx.points.append(point)
            _say(_line(point))


def run_peer(ctx: Context, system: str, round_: int) -> dict[str, Any]:
    peer = PEERS[system]
    n = 1 if peer.single else ctx.args.instances
    requests = {
        batch: make_requests(peer.protocol, batch, ctx.rows, ctx.args.distinct)
        for batch in ctx.args.batches
    }
    probe_payload = make_requests(peer.protocol, 1, ctx.rows, 1)[0]
    record: dict[str, Any] = {"instances": n}
    server = PeerServer(
        peer, ctx.model_base / "1", n, ctx.log_root / f"{system}-r{round_}.log", ctx.peer_env
    )
    record["log"] = str(server.log_path)
    with server:
        record["cold_start_s"] = round(
            wait_first_answer(server.target, probe_payload, peer.protocol, server.spawned,
                              server.exited), 2
        )  # fmt: skip
        record["cold_start_is"] = "spawn to the first answered request"
        _say(f"compare: {system} answered {record['cold_start_s']:.1f} s after spawn")
        if peer.server_version_probe and round_ == 0:
            record["server_version"] = _server_version(peer, server.target)
        _sweep(ctx, system, round_, server.target, peer.protocol, requests, server.processes)
        record["memory"] = measure_memory(server.processes())
    record["stop"] = server.stop_record
    if server.stop_record.get("incident"):
        ctx.incidents.append(f"{system}: {server.stop_record['incident']}")
    if server.stop_record.get("killed_after_stop"):
        ctx.incidents.append(
            f"{system}: still running after the peer exited, killed: "
            + ", ".join(server.stop_record["killed_after_stop"])
        )
    ctx.leftovers.extend(server.leftovers())
    return record


def _server_version(peer: Peer, target: str) -> str:
    with contextlib.suppress(subprocess.SubprocessError, OSError):
        return subprocess.run(
            [str(peer.python), "-c", peer.server_version_probe, target],
            cwd=_OUTSIDE, capture_output=True, text=True, check=True, timeout=60,
        ).stdout.strip()  # fmt: skip
    return ""


def run_mpspool(ctx: Context, system: str, round_: int) -> dict[str, Any]:
    workers = 1 if system == "mpspool-1" else ctx.args.instances
    requests = {
        batch: make_requests("tfserving", batch, ctx.rows, ctx.args.distinct)
        for batch in ctx.args.batches
    }
    probe_payload = make_requests("tfserving", 1, ctx.rows, 1)[0]
    port = free_port()
    pool = Pool(
        ctx.model_base,
        workers,
        ctx.log_root / f"{system}-r{round_}",
        ctx.pool_env,
        label=f"{workers}w-r{round_}",
        # A known port, so the first answer can be polled for from the spawn on.
        extra_args=[
            "--port", str(port), "--shutdown-delay", "0",
            *(["--enable-batching"] if system == "mpspool-N-batching" else []),
        ],
    )  # fmt: skip
    target = f"127.0.0.1:{port}"
    record: dict[str, Any] = {"instances": workers, "log": str(pool.log_dir)}

    def exited() -> str | None:
        if pool.proc is not None and pool.proc.poll() is not None:
            return f"exited with {pool.proc.returncode}; see {pool.log_dir}"
        return None

    spawned = time.monotonic()
    with pool:
        record["cold_start_s"] = round(
            wait_first_answer(target, probe_payload, "tfserving", spawned, exited), 2
        )
        record["cold_start_is"] = "spawn to the first answered request"
        pool.wait_ready()
        record["pool_id"] = pool.pool_id
        record["all_ready_s"] = round(time.monotonic() - spawned, 2)
        _say(
            f"compare: {system} answered {record['cold_start_s']:.1f} s after spawn, "
            f"all workers READY at {record['all_ready_s']:.1f} s"
        )

        def processes() -> list[psutil.Process]:
            incident = pool.ensure_ready()
            if incident:
                ctx.incidents.append(f"{system}: {incident}")
            return [p for procs in pool.roles.values() for p in procs]

        density = system == "mpspool-N"
        run_dir = pool.run_dir if density else None
        _sweep(ctx, system, round_, target, "tfserving", requests, processes, run_dir)
        segments = sorted(Path("/dev/shm").glob(f"mpspool-{pool.pool_id}-*"))
        record["memory"] = measure_memory(processes(), sum(p.stat().st_size for p in segments))
        batch, concurrency = ctx.args.density
        if density and not ctx.density and batch in requests:
            # The density point is not in the sweep: a run of its own, outside the tables.
            spans = SpanRecorder(pool.run_dir)
            result = measure_point(
                target, "tfserving", requests[batch], batch, concurrency, processes(), ctx.args,
                spans,
            )  # fmt: skip
            ctx.density.update(density_record(spans, result), separate_run=True)
        with contextlib.suppress(subprocess.SubprocessError, json.JSONDecodeError):
            record["restarts"] = {s["slot"]: s["restarts"] for s in pool.status()["slots"]}
    ctx.leftovers.extend(pool.leftovers())
    ctx.leftovers.extend(shm_leftovers([pool.pool_id] if pool.pool_id else []))
    return record


# -- task density -------------------------------------------------------------------
class SpanRecorder:
    """A window hook keeping the worker-side span of every request a pool answers in the
    measured window: the pool's timeline is cleared at the window's start and read at its
    end (what `mpspool timeline [--clear]` does).

    It asks the router over the pool's run directory directly, as the CLI does, rather than
    running the CLI: a Python process started at the window's edge costs about a second of
    CPU on a small machine, which would both delay the clear and load the server while it is
    measured. A failure is kept in ``error``, never raised into the load run.
    """

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.record: dict[str, Any] = {"bin_us": DENSITY_BIN_US}
        self.error = ""

    def _take(self, clear: bool) -> dict[str, Any]:
        taken = _ask_pool(self.run_dir, "timeline", endpoint=wire.CONTROL_ENDPOINT, clear=clear)
        if "error" in taken or "spans" not in taken:
            raise RuntimeError(f"the router refused the timeline: {taken}")
        return taken

    def __call__(self, edge: str) -> None:
        if self.error:
            return
        try:
            if edge == "start":
                began = time.perf_counter()
                self.record["start_us"] = int(self._take(clear=True)["now_us"])
                # The load generator sends nothing while this runs (it is on its loop).
                self.record["clear_ms"] = round((time.perf_counter() - began) * 1000, 1)
            else:
                taken = self._take(clear=False)
                self.record["end_us"] = int(taken["now_us"])
                self.record["spans"] = taken["spans"]
                self.record["dropped"] = taken.get("dropped", 0)
        except Exception as exc:  # the run goes on; the chart is missing, and says why
            self.error = f"{type(exc).__name__}: {exc}"[:300]


def _both(*hooks: Callable[[str], None]) -> Callable[[str], None]:
    """One window hook calling ``hooks`` in order at the start, in reverse at the end (so
    that the CPU window nests inside the span window)."""

    def hook(edge: str) -> None:
        for one in hooks if edge == "start" else hooks[::-1]:
            one(edge)

    return hook


def density_record(recorder: SpanRecorder, result: dict[str, Any]) -> dict[str, Any]:
    record = dict(recorder.record)
    record.update(batch=result["batch"], concurrency=result["concurrency"])
    record.update(
        {k: result[k] for k in ("throughput_rps", "rows_per_s", "p50_ms", "p99_ms", "error_count")}
    )
    if recorder.error:
        record["error"] = recorder.error
        _say(f"compare: task density not collected: {recorder.error}")
    else:
        _say(
            f"compare: task density: {len(record['spans'])} spans at batch {record['batch']} "
            f"c={record['concurrency']}"
        )
    return record


# -- the run ------------------------------------------------------------------------
def run_system(ctx: Context, system: str, round_: int) -> dict[str, Any]:
    """Start, measure, stop one system; a failure is recorded, not raised (the others still
    run); an interrupt is raised."""
    started = time.monotonic()
    _say(f"compare: --- {system} (round {round_ + 1}) ---")
    try:
        if system == "inprocess":
            record = run_inprocess(ctx, round_)
        elif system in PEERS:
            record = run_peer(ctx, system, round_)
        else:
            record = run_mpspool(ctx, system, round_)
        record["status"] = "ok"
    except (RuntimeError, TimeoutError, OSError, subprocess.SubprocessError, ValueError) as exc:
        record = {"status": "failed", "reason": f"{type(exc).__name__}: {exc}"[:1000]}
        ctx.incidents.append(f"{system} round {round_ + 1} failed: {record['reason']}")
        _say(f"compare: {system} FAILED: {record['reason']}")
    record["round"] = round_
    record["wall_s"] = round(time.monotonic() - started, 1)
    return record


def run_comparison(args: argparse.Namespace, stamp: str) -> dict[str, Any]:
    with frozen_code(args.source) as (source, pool_env):
        return _run_comparison(args, stamp, source, pool_env)


def _run_comparison(
    args: argparse.Namespace, stamp: str, source: dict[str, Any], pool_env: dict[str, str]
) -> dict[str, Any]:
    rows = args.rows
    model_base = ensure_model(rows, pool_env)
    peer_env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    peer_env.update(TF_CPP_MIN_LOG_LEVEL="2", RAY_USAGE_STATS_ENABLED="0")
    n = args.instances
    report: dict[str, Any] = {
        "scenario": "compare",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": command_line("bench.compare"),
        "machine": machine(),
        "versions": versions(),
        "source": source,
        "settings": {
            "rows": rows,
            "model": str(model_base),
            "instances": n,
            "systems": args.systems,
            "batches": args.batches,
            "concurrency": args.concurrency,
            "duration_s": args.duration,
            "warmup_s": args.warmup,
            "repeat": args.repeat,
            "distinct_requests": args.distinct,
            "density": list(args.density),
            "quick": args.quick,
        },
        "load_average_start": os.getloadavg(),
    }
    systems: dict[str, dict[str, Any]] = {}
    peer_versions_: dict[str, dict[str, str]] = {}
    for system in args.systems:
        entry: dict[str, Any] = {
            "label": label(system, 1 if system in ("plain", "mpspool-1") else n),
            "instances": 1 if system in ("plain", "mpspool-1") else n,
            "rounds": [],
        }
        if system in PEERS:
            peer = PEERS[system]
            entry["protocol"] = peer.protocol
            entry["interpreter"] = str(peer.python)
            reason = peer.unavailable()
            if reason:
                entry.update(status="skipped", reason=reason)
                _say(f"compare: {system} skipped: {reason}")
            else:
                peer_versions_[system] = peer_versions(peer)
        systems[system] = entry
    report["versions"]["peers"] = peer_versions_
    ctx = Context(
        args=args,
        model_base=model_base,
        rows=rows,
        log_root=args.out / f"logs-compare-{stamp}",
        pool_env=pool_env,
        peer_env=peer_env,
        points=[],
        incidents=[],
        leftovers=[],
        density={},
    )
    runnable = [s for s in args.systems if systems[s].get("status") != "skipped"]
    for round_ in range(args.repeat):
        # Alternate the order, so a drift in machine load favours nobody.
        for system in runnable if round_ % 2 == 0 else runnable[::-1]:
            record = run_system(ctx, system, round_)
            systems[system]["rounds"].append(record)
            server_version = record.pop("server_version", "")
            if server_version:
                peer_versions_.setdefault(system, {})["server"] = server_version
    for entry in systems.values():
        if "status" not in entry:
            states = {r["status"] for r in entry["rounds"]}
            entry["status"] = (
                "ok" if states == {"ok"} else "failed" if "ok" not in states else "partial"
            )
            reasons = [r["reason"] for r in entry["rounds"] if "reason" in r]
            if reasons:
                entry["reason"] = reasons[0]
    report["load_average_end"] = os.getloadavg()
    report["systems"] = systems
    report["points"] = ctx.points
    report["density"] = ctx.density
    report["incidents"] = ctx.incidents
    report["leftovers"] = ctx.leftovers
    return report


# -- summary --------------------------------------------------------------------------
BEST_FIELDS = (
    "concurrency",
    "throughput_rps",
    "rows_per_s",
    "p50_ms",
    "p99_ms",
    "server_cpu_us_per_request",
    "client_cpu_us_per_request",
)


def summarise(report: dict[str, Any]) -> dict[str, Any]:
    """Per system and batch size the best point over C (each point its best round), memory
    and cold start over rounds (PSS: the largest; cold start: the shortest), the ratios of
    mpspool-N to every other system, and the issue's targets."""
    s = report["settings"]
    best = best_of(report["points"], ("system", "batch", "concurrency"))
    per_system: dict[str, Any] = {}
    for system, entry in report["systems"].items():
        rounds = [r for r in entry["rounds"] if r.get("status") == "ok"]
        pss = [r["memory"]["pss_total_bytes"] for r in rounds if "memory" in r]
        cold = [r["cold_start_s"] for r in rounds if "cold_start_s" in r]
        per_batch = {}
        for batch in s["batches"]:
            mine = sorted(
                (p for p in best if p["system"] == system and p["batch"] == batch),
                key=lambda p: p["concurrency"],
            )
            every = [p for p in report["points"] if p["system"] == system and p["batch"] == batch]
            codes: dict[str, int] = {}
            for p in every:
                for code, count in p.get("errors", {}).items():
                    codes[code] = codes.get(code, 0) + count
            top = max(mine, key=lambda p: p["rows_per_s"], default=None)
            per_batch[str(batch)] = {
                "curve": [
                    [p["concurrency"], p["rows_per_s"], p["p99_ms"], p.get("error_count", 0)]
                    for p in mine
                ],
                "best": None if top is None else {k: top.get(k) for k in BEST_FIELDS},
                "errors": codes,
                "error_count": sum(codes.values()),
            }
        per_system[system] = {
            "label": entry["label"],
            "status": entry.get("status", "?"),
            "reason": entry.get("reason", ""),
            "instances": entry.get("instances"),
            "pss_bytes": max(pss) if pss else None,
            "pss_rounds": pss,
            "processes": max(
                (len(r["memory"]["processes"]) for r in rounds if "memory" in r), default=None
            ),
            "cold_start_s": min(cold) if cold else None,
            "cold_start_rounds": cold,
            "all_ready_s": min(
                (r["all_ready_s"] for r in rounds if "all_ready_s" in r), default=None
            ),
            "per_batch": per_batch,
        }
    big, small = str(max(s["batches"])), str(min(s["batches"]))

    def rows(system: str, batch: str) -> float:
        entry = per_system.get(system)
        top = entry and entry["per_batch"][batch]["best"]
        return top["rows_per_s"] if top else math.nan

    def ratio(a: float | None, b: float | None) -> float:
        return (
            a / b if a is not None and b and not math.isnan(a) and not math.isnan(b) else math.nan
        )

    ours = per_system.get("mpspool-N")
    ratios = {}
    if ours:
        for system, entry in per_system.items():
            if system == "mpspool-N":
                continue
            ratios[system] = {
                **{
                    f"batch {b}": ratio(rows("mpspool-N", b), rows(system, b)) for b in (small, big)
                },
                "pss": ratio(ours["pss_bytes"], entry["pss_bytes"]),
            }
    n = s["instances"]
    targets = []
    for batch, goal in ((big, TARGET_BIG_OVER_INPROCESS), (small, TARGET_SMALL_OVER_INPROCESS)):
        measured = ratio(rows("mpspool-N", batch), rows("inprocess", batch))
        targets.append(
            {
                "target": f"batch {batch}: mpspool {n} workers ≥ {goal}× the in-process limit "
                f"(P={n}), rows/s, best over C",
                "measured": measured,
                "unit": "×",
                "met": None if math.isnan(measured) else measured >= goal,
            }
        )
    peers = [p for p in PEER_SYSTEMS if p in per_system]
    measured_peers = [
        p for p in peers if not math.isnan(rows(p, big)) or not math.isnan(rows(p, small))
    ]
    missing = [p for p in PEER_SYSTEMS if p not in measured_peers]
    ahead = [ratio(rows("mpspool-N", b), rows(p, b)) for p in measured_peers for b in (small, big)]
    ahead = [a for a in ahead if not math.isnan(a)]
    worst = min(ahead, default=math.nan)
    targets.append(
        {
            "target": f"mpspool {n} workers ahead of every peer at batch {small} and {big} "
            f"(smallest mpspool/peer rows/s ratio; measured: {', '.join(measured_peers) or 'none'}"
            + (f"; not measured: {', '.join(missing)})" if missing else ")"),
            "measured": worst,
            "unit": "×",
            "met": None if math.isnan(worst) else worst > 1.0,
        }
    )
    multi = [p for p in measured_peers if not PEERS[p].single]
    pss_ratios = [
        r
        for r in (ratio(ours and ours["pss_bytes"], per_system[p]["pss_bytes"]) for p in multi)
        if not math.isnan(r)
    ]
    highest = max(pss_ratios, default=math.nan)
    targets.append(
        {
            "target": f"mpspool {n} workers' total PSS below every multi-instance peer's "
            f"(largest mpspool/peer PSS ratio; measured: {', '.join(multi) or 'none'})",
            "measured": highest,
            "unit": "×",
            "met": None if math.isnan(highest) else highest < 1.0,
        }
    )
    return {"systems": per_system, "ratios": ratios, "targets": targets}


# -- rendering ------------------------------------------------------------------------
def plot_paths(json_path: Path) -> dict[str, Path]:
    return {
        kind: json_path.with_name(f"{json_path.stem}-{kind}.png")
        for kind in ("throughput", "p99", "density")
    }


def render_plots(
    report: dict[str, Any], summary: dict[str, Any], json_path: Path
) -> dict[str, Path]:
    """The PNGs beside ``json_path``; returns those written."""
    paths = plot_paths(json_path)
    systems = summary["systems"]
    labels = {name: entry["label"] for name, entry in systems.items()}
    n = report["settings"]["instances"]
    throughput: dict[int, dict[str, list[tuple[int, float, int]]]] = {}
    p99: dict[int, dict[str, list[tuple[int, float, int]]]] = {}
    references: dict[int, dict[str, tuple[int, float]]] = {}
    p99_refs: dict[int, dict[str, tuple[int, float]]] = {}
    for batch in report["settings"]["batches"]:
        throughput[batch], p99[batch], references[batch], p99_refs[batch] = {}, {}, {}, {}
        for name, entry in systems.items():
            curve = entry["per_batch"][str(batch)]["curve"]
            if not curve:
                continue
            if name == "inprocess":
                _, rows_s, p99_ms, _ = curve[0]
                references[batch][name] = (n, rows_s)
                p99_refs[batch][name] = (n, p99_ms)
                labels[name] = f"{entry['label']} (no RPC)"
                continue
            throughput[batch][name] = [(c, r, e) for c, r, _, e in curve]
            p99[batch][name] = [(c, q, e) for c, _, q, e in curve]
    written = {}
    written["throughput"] = plots.plot_curves(
        throughput, paths["throughput"], "rows/s", "Throughput vs concurrency (closed loop)",
        labels=labels, references=references,
    )  # fmt: skip
    written["p99"] = plots.plot_curves(
        p99, paths["p99"], "p99 latency, ms", "p99 latency vs concurrency (closed loop)",
        labels=labels, references=p99_refs, reference_as_line=False,
    )  # fmt: skip
    density = report.get("density") or {}
    if density.get("spans"):
        start_us = density.get("start_us")
        fine = plots.occupancy(density["spans"], density["bin_us"], start_us, density.get("end_us"))
        coarse = plots.occupancy(
            density["spans"], DENSITY_OVERVIEW_BIN_US, start_us, density.get("end_us")
        )
        excerpt_end = fine.start_us + DENSITY_EXCERPT_US
        excerpt = plots.occupancy(
            density["spans"], density["bin_us"], fine.start_us,
            min(excerpt_end, int(fine.edges_us[-1]) + fine.start_us),
        )  # fmt: skip
        written["density"] = plots.plot_density(
            [
                (coarse, f"the whole window, {DENSITY_OVERVIEW_BIN_US / 1000:g} ms bins "
                 "(time-averaged)"),
                (excerpt, f"its first {DENSITY_EXCERPT_US / 1000:g} ms, "
                 f"{density['bin_us'] / 1000:g} ms bins"),
            ],
            paths["density"],
            f"{labels.get('mpspool-N', 'mpspool')}: requests in execution per worker, batch "
            f"{density['batch']}, C={density['concurrency']}",
            xlabel="ms since the measured window's start",
        )  # fmt: skip
    return written


def _ms(value: float | None) -> str:
    return _f(math.nan if value is None else value, 2)


def _mib(value: float | None) -> str:
    return _f(math.nan if value is None else value / MIB, 0)


def _x(value: float) -> str:
    return _f(value, 2)


def _met(met: bool | None) -> str:
    return "–" if met is None else "yes" if met else "**no**"


def _errors(codes: dict[str, int]) -> str:
    if not codes:
        return "0"
    return "**" + ", ".join(f"{count} {code}" for code, count in sorted(codes.items())) + "**"


def render_markdown(
    report: dict[str, Any], summary: dict[str, Any], json_path: Path, results_md: Path,
    plot_files: dict[str, Path],
) -> str:  # fmt: skip
    """The peers section of RESULTS.md, markers included."""
    m, v, s = report["machine"], report["versions"], report["settings"]
    systems = summary["systems"]
    n = s["instances"]
    peers_v = v.get("peers", {})

    def rel(path: Path) -> str:
        with contextlib.suppress(ValueError):
            return str(path.resolve().relative_to(REPO))
        return str(path)

    def link(path: Path) -> str:
        return os.path.relpath(path.resolve(), results_md.resolve().parent)

    version_bits = [
        f"TensorFlow {v.get('tensorflow-cpu', v.get('tensorflow', '?'))}",
        f"grpcio {v.get('grpcio', '?')}",
        f"protobuf {v.get('protobuf', '?')}",
        f"Python {v['python']}",
    ]
    if "ray" in peers_v:
        r = peers_v["ray"]
        version_bits.append(
            f"Ray {r.get('ray', '?')} (TensorFlow {r.get('tensorflow-cpu', '?')}, "
            f"Python {r.get('python', '?')})"
        )
    if "triton" in peers_v:
        t = peers_v["triton"]
        version_bits.append(
            f"PyTriton {t.get('nvidia-pytriton', '?')} (tritonserver "
            f"{t.get('server') or '?'}, TensorFlow {t.get('tensorflow-cpu', '?')}, numpy "
            f"{t.get('numpy', '?')}, Python {t.get('python', '?')})"
        )
    skipped = [
        f"{name}: {entry['reason']}" for name, entry in systems.items() if entry["status"] != "ok"
    ]
    lines = [
        BEGIN_MARK,
        "## Peers: the same model served by each system, one run",
        "",
        f"- **Date:** {report['date']}",
        f"- **Command:** `{report['command']}` (from the repository root)",
        f"- **Machine:** {m['cpu_model']}, {m['usable_cores']} usable cores "
        f"({m['logical_cpus']} logical), {m['memory_gib']} GiB, Linux {m['kernel']}; load "
        f"average {report['load_average_start'][0]:.2f} at start, "
        f"{report['load_average_end'][0]:.2f} at end",
        f"- **Versions:** {', '.join(version_bits)}",
        f"- **Model:** demo, {s['rows']:,} embedding rows (`{s['model']}`); "
        f"{s['distinct_requests']} distinct requests per batch size, cycled",
        f"- **Load:** the Python load generator (bench/loadgen.py, real random ids), closed "
        f"loop, concurrency {', '.join(map(str, s['concurrency']))} at batch "
        f"{' and '.join(map(str, s['batches']))}; {s['warmup_s']:g} s warm-up then "
        f"{s['duration_s']:g} s measured per point; {s['repeat']} round"
        f"{'s' if s['repeat'] > 1 else ''}, each system started and stopped in each, one "
        "at a time; tables show each point's best round",
        f"- **Systems:** N = {n}. "
        + "; ".join(f"{entry['label']}" for entry in systems.values())
        + (f". Not measured: {'; '.join(skipped)}" if skipped else ""),
        f"- **Code under test:** {_describe_source(report['source'])}",
        f"- **Raw results:** `{rel(json_path)}`",
        "",
        "The client runs on the same cores as the servers and takes CPU from them (its cost "
        "per request is in the tables). The in-process limit is N processes calling the "
        "SavedModel directly, one call at a time each (no RPC); its C is its process count. "
        "Best over C: the concurrency with the most rows/s, and p50/p99 at that concurrency. "
        "Server CPU: user + system CPU time of every process of the system over the measured "
        "window, per answered request.",
        "",
        "### Targets (issue #5)",
        "",
        "| Target | Measured | Met |",
        "|---|---:|:---:|",
    ]
    for t in summary["targets"]:
        lines.append(f"| {t['target']} | {_x(t['measured'])} {t['unit']} | {_met(t['met'])} |")
    for batch in s["batches"]:
        lines += [
            "",
            f"### Batch {batch}",
            "",
            "| System | rows/s (best over C) | req/s | at C | p50 ms | p99 ms "
            "| server CPU µs/req | client CPU µs/req | errors (all points) |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---|",
        ]
        for name, entry in systems.items():
            b = entry["per_batch"][str(batch)]
            top = b["best"]
            if top is None:
                why = (
                    f"{entry['status']}: {entry['reason']}" if entry["reason"] else entry["status"]
                )
                lines.append(f"| {entry['label']} | – | – | – | – | – | – | – | {why} |")
                continue
            at = f"P={top['concurrency']}" if name == "inprocess" else str(top["concurrency"])
            lines.append(
                f"| {entry['label']} | {_f(top['rows_per_s'], 0)} | {_f(top['throughput_rps'])} "
                f"| {at} | {_ms(top['p50_ms'])} | {_ms(top['p99_ms'])} "
                f"| {_f(top['server_cpu_us_per_request'] or math.nan, 0)} "
                f"| {_f(top['client_cpu_us_per_request'] or math.nan, 0)} "
                f"| {_errors(b['errors'])} |"
            )
        swept = [
            name
            for name, entry in systems.items()
            if name != "inprocess" and entry["per_batch"][str(batch)]["curve"]
        ]
        lines += [
            "",
            f"rows/s per concurrency at batch {batch} (errors in bold):",
            "",
            "| C | " + " | ".join(systems[name]["label"] for name in swept) + " |",
            "|---:|" + "---:|" * len(swept),
        ]
        for c in s["concurrency"]:
            cells = [str(c)]
            for name in swept:
                point = next(
                    (q for q in systems[name]["per_batch"][str(batch)]["curve"] if q[0] == c), None
                )
                if point is None:
                    cells.append("–")
                else:
                    text = _f(point[1], 0)
                    cells.append(f"**{text} ({point[3]} errors)**" if point[3] else text)
            lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "### Memory and cold start",
        "",
        "Total PSS: the proportional set size (psutil) of every process the system started, "
        "summed, after the sweep (batch 256 included); mpspool's shared weight segment is "
        "counted once, whole. Cold start: from spawning the system to the first answered "
        "request (polled with real requests); for the in-process limit, to all processes "
        "loaded. Over several rounds: the largest PSS, the shortest cold start.",
        "",
        "| System | processes | total PSS MiB | cold start s |",
        "|---|---:|---:|---:|",
    ]
    for entry in systems.values():
        cold = _f(math.nan if entry["cold_start_s"] is None else entry["cold_start_s"], 1)
        if entry.get("all_ready_s") is not None:
            cold += f" (all workers READY {entry['all_ready_s']:.1f})"
        lines.append(
            f"| {entry['label']} | {entry['processes'] if entry['processes'] is not None else '–'} "
            f"| {_mib(entry['pss_bytes'])} | {cold} |"
        )
    if summary["ratios"]:
        big, small = str(max(s["batches"])), str(min(s["batches"]))
        ours = systems["mpspool-N"]["label"]
        lines += [
            "",
            "### Ratios",
            "",
            f"{ours} divided by each other system: rows/s best over C, and total PSS "
            "(below 1: less memory).",
            "",
            f"| {ours} / X | rows/s batch {small} | rows/s batch {big} | total PSS |",
            "|---|---:|---:|---:|",
        ]
        for name, r in summary["ratios"].items():
            lines.append(
                f"| {systems[name]['label']} | {_x(r[f'batch {small}'])} | "
                f"{_x(r[f'batch {big}'])} | {_x(r['pss'])} |"
            )
    lines += ["", "### Plots", ""]
    if "throughput" in plot_files:
        lines += [f"![rows/s vs concurrency]({link(plot_files['throughput'])})", ""]
    if "p99" in plot_files:
        lines += [f"![p99 vs concurrency]({link(plot_files['p99'])})", ""]
    density = report.get("density") or {}
    if "density" in plot_files:
        lines += [
            f"Task density: the worker-side spans (`mpspool timeline`) of the "
            f"{len(density['spans']):,} requests {systems['mpspool-N']['label']} answered in "
            + ("a separate run" if density.get("separate_run") else "the measured window")
            + f" of batch {density['batch']}, C={density['concurrency']} "
            f"({_f(density['rows_per_s'], 0)} rows/s, p99 {_ms(density['p99_ms'])} ms, "
            f"{density['error_count']} errors); per bin, the time-averaged number of "
            "requests each worker was executing, stacked, and the total: the whole window in "
            f"{DENSITY_OVERVIEW_BIN_US / 1000:g} ms bins, then its first "
            f"{DENSITY_EXCERPT_US / 1000:g} ms in {density['bin_us'] / 1000:g} ms bins. A "
            "worker runs one request at a time, so 1.0 is a worker fully busy; below 1.0 it "
            "waited for the router. Empty stretches in the first tens of ms coincide with the "
            "load generator's own work at the window's start (it clears the router's timeline "
            "and samples CPU times from its event loop, sending nothing meanwhile)"
            + (
                f"; the clear alone held it {density['clear_ms']:g} ms."
                if "clear_ms" in density
                else "; that cause is inferred, not measured."
            )
            + (
                f" {density['dropped']} spans were dropped (buffer full)."
                if density.get("dropped")
                else ""
            ),
            "",
            f"![task density]({link(plot_files['density'])})",
        ]
    elif density.get("error"):
        lines.append(f"Task density: not collected ({density['error']}).")
    if report["incidents"]:
        lines += ["", "**Incidents:** " + "; ".join(report["incidents"])]
    if report["leftovers"]:
        lines += ["", "**Left behind after the run:** " + "; ".join(report["leftovers"])]
    lines.append(END_MARK)
    return "\n".join(lines) + "\n"


def render(report: dict[str, Any], json_path: Path, results_md: Path | None) -> dict[str, Any]:
    """Summary, plots (beside the JSON) and, if ``results_md``, its peers section."""
    summary = summarise(report)
    plot_files = render_plots(report, summary, json_path)
    if results_md is not None:
        section = render_markdown(report, summary, json_path, results_md, plot_files)
        write_section(results_md, section, BEGIN_MARK, END_MARK)
    return {"summary": summary, "plots": plot_files}


# -- command line -------------------------------------------------------------------
def _systems(text: str) -> list[str]:
    names = [v.strip() for v in text.split(",") if v.strip()]
    unknown = [name for name in names if name not in SYSTEMS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown systems {unknown}: choose from {', '.join(SYSTEMS)}"
        )
    return [s for s in SYSTEMS if s in names]  # the canonical order


def _point_arg(text: str) -> tuple[int, int]:
    values = _ints(text)
    if len(values) != 2:
        raise argparse.ArgumentTypeError(f"expected BATCH,CONCURRENCY, got {text!r}")
    return values[0], values[1]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.compare", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--systems", type=_systems, default=list(SYSTEMS), help=f"subset of {','.join(SYSTEMS)}"
    )
    parser.add_argument(
        "--instances", type=int, default=2, help="N: processes, replicas, instances, workers"
    )
    parser.add_argument("--rows", type=int, default=FULL_ROWS, help="embedding rows")
    parser.add_argument("--batches", type=_ints, default=[1, 256])
    parser.add_argument("--concurrency", type=_ints, default=[1, 2, 4, 8, 16])
    parser.add_argument("--duration", type=float, default=3.0, help="measured seconds per point")
    parser.add_argument("--warmup", type=float, default=1.0, help="warm-up seconds per point")
    parser.add_argument("--distinct", type=int, default=8, help="distinct requests per batch")
    parser.add_argument(
        "--repeat", type=int, default=1, help="rounds; tables show each point's best (%(default)s)"
    )
    parser.add_argument(
        "--density",
        type=_point_arg,
        default=(256, 8),
        metavar="BATCH,C",
        help="the mpspool-N point whose task density is drawn (%(default)s)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: 1,000-row model, C 1,4, 1 s points; RESULTS.md untouched unless --results",
    )
    parser.add_argument("--out", type=Path, default=OUT_DIR, help="raw results and plots")
    add_output_arguments(parser, writes="the JSON and the plots")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.instances < 2:
        parser.error("--instances must be at least 2 (mpspool-1 is the single-worker case)")
    if args.quick:
        args.rows = QUICK_ROWS if args.rows == FULL_ROWS else args.rows
        args.concurrency = [1, 4] if args.concurrency == [1, 2, 4, 8, 16] else args.concurrency
        args.duration = min(args.duration, 1.0)
        args.warmup = min(args.warmup, 0.5)
    if args.render is not None:
        report = json.loads(args.render.read_text())
        results_md = None if args.no_results else args.results or RESULTS_MD
        rendered = render(report, args.render, results_md)
        _say(
            f"compare: rendered {len(rendered['plots'])} plots beside {args.render}"
            + (f" and {results_md}" if results_md else "")
        )
        return 0
    results_md = None if args.no_results else args.results or (None if args.quick else RESULTS_MD)

    def summarise_for_readers(report: dict[str, Any]) -> None:
        report["summary"] = summarise(report)  # for readers of the JSON; --render recomputes it

    done = run_to_json(
        "compare",
        args.quick,
        lambda stamp: run_comparison(args, stamp),
        out_dir=args.out,
        before_writing=summarise_for_readers,
    )
    if done is None:
        return 130
    report, json_path = done
    rendered = render(report, json_path, results_md)
    for path in rendered["plots"].values():
        _say(f"compare: plot {path}")
    if results_md is not None:
        _say(f"compare: updated {results_md}")
    print_targets(rendered["summary"]["targets"], _x)
    for item in report["leftovers"]:
        _say(f"compare: LEFT BEHIND: {item}")
    failed = [name for name, e in report["systems"].items() if e["status"] in ("failed", "partial")]
    for name in failed:
        _say(f"compare: {name} FAILED: {report['systems'][name].get('reason', '')}")
    _say(f"compare: done in {report['wall_s']:.0f} s")
    return 1 if report["leftovers"] or failed else 0


if __name__ == "__main__":
    sys.exit(main())
