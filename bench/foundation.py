"""The foundation scenario: 1 worker vs 2 workers vs the in-process limit, on the demo model.

One command measures the in-process limit (P = 1 and P = 2 processes calling TensorFlow
directly), then starts a 1-worker pool and a 2-worker pool, sweeps closed-loop concurrency for
each batch size, samples the CPU time of every pool process over each measured window, and
writes the raw results to ``bench/out/foundation-<date>.json`` and a summary into the
foundation section of ``bench/RESULTS.md``.

Both pools stay up for the whole sweep and take turns point by point (1w, 2w at the same
batch and concurrency back to back, in alternating order), so that their ratio compares
measurements taken seconds apart: on a shared, noisy machine that matters more than any
absolute number. The idle pool costs little (heartbeats and the controller's 10 Hz tick).
The in-process limit runs before the pools start, not between their points: it keeps both
cores busy, and an idle pool (in its own session, hence its own scheduler autogroup) can then
be starved for seconds and have its workers declared dead. The code under test is frozen
into a temporary copy at the start (``--source``), so edits to the repository during the
run, or a worker restarted mid-run, cannot mix versions.

    .venv/bin/python -m bench.foundation                 # the full run (about 4 minutes)
    .venv/bin/python -m bench.foundation --quick         # a smoke run on a tiny model

Every process this starts is stopped before it exits, on errors and Ctrl-C included, and
the run checks that nothing was left behind (processes, run directories, /dev/shm files).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import importlib.metadata
import io
import json
import math
import os
import platform
import re
import shlex
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import psutil

from bench import loadgen
from bench.inprocess import InProcessLimit
from mpspool import process
from mpspool.config import default_cache_dir, usable_cores

REPO = Path(__file__).resolve().parent.parent
OUT_DIR = REPO / "bench" / "out"
RESULTS_MD = REPO / "bench" / "RESULTS.md"
BEGIN_MARK = "<!-- foundation:begin (written by bench/foundation.py; edits here are lost) -->"
END_MARK = "<!-- foundation:end -->"
MODEL_NAME = "demo"
READY_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 60.0
# The targets of the issue this scenario answers.
TARGET_2W_OVER_1W = 1.8
TARGET_2W_OVER_INPROCESS = 0.9
TARGET_ROUTER_US = 150.0


def _mpspool(*args: str) -> list[str]:
    return [sys.executable, "-m", "mpspool", *args]


# Subprocesses run outside the repository: `python -m` puts the cwd first on sys.path, and
# the repository's supervisor/ folder would shadow supervisord's package of that name.
_OUTSIDE = tempfile.gettempdir()


# -- the code under test ------------------------------------------------------------
# The repository's top-level folders and where they sit in the installed package (pyproject's
# [tool.setuptools.package-dir]); a frozen copy is laid out as installed.
PACKAGE_DIRS = {
    "mpspool": "mpspool",
    "supervisor": "mpspool/supervisor",
    "router": "mpspool/router",
    "worker": "mpspool/worker",
}


def _git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=REPO, capture_output=True, text=True, check=True, timeout=60
    ).stdout


def freeze_source(kind: str, dest: Path) -> dict[str, Any]:
    """Copy the code under test out of the repository, so that edits made while the run goes
    on (or a worker restarted mid-run) cannot mix versions; describe what was copied.

    ``kind``: "worktree" (the files as they are now, uncommitted changes included), "HEAD"
    (the last commit) or "live" (no copy: the installed package, whatever it is meanwhile).
    The pool's processes get the copy first on PYTHONPATH.
    """
    info: dict[str, Any] = {"kind": kind}
    with contextlib.suppress(subprocess.SubprocessError, OSError):
        info["commit"] = _git("rev-parse", "--short", "HEAD").strip()
        changed = _git("status", "--porcelain", "--", *PACKAGE_DIRS).splitlines()
        info["uncommitted"] = sorted(line[3:] for line in changed)
    if kind == "live":
        return info
    if kind == "HEAD":
        archive = subprocess.run(
            ["git", "archive", "--format=tar", "HEAD", "--", *PACKAGE_DIRS],
            cwd=REPO, capture_output=True, check=True, timeout=60,
        ).stdout  # fmt: skip
        files: dict[str, bytes] = {}
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            for member in tar.getmembers():
                stream = tar.extractfile(member) if member.isfile() else None
                if stream is not None:
                    files[member.name] = stream.read()
        info["uncommitted"] = []
    else:
        names = _git("ls-files", "-co", "--exclude-standard", "--", *PACKAGE_DIRS).splitlines()
        files = {name: (REPO / name).read_bytes() for name in names if (REPO / name).is_file()}
    for name, data in files.items():
        top, _, rest = name.partition("/")
        target = dest / PACKAGE_DIRS[top] / rest
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    info["path"] = str(dest)
    return info


# -- the model ----------------------------------------------------------------------
def ensure_model(rows: int, env: dict[str, str]) -> Path:
    """The demo model with ``rows`` embedding rows, built once into the cache (a base path).

    Built in a subprocess (the mpspool CLI), so this process — which is also the load
    generator — never imports TensorFlow and stays small.
    """
    base = default_cache_dir() / f"bench-demo-{rows}"
    if not (base / "1" / "saved_model.pb").is_file():
        print(f"foundation: building the demo model ({rows:,} rows) in {base}", file=sys.stderr)
        subprocess.run(
            _mpspool("demo-model", "--out", str(base), "--embedding-rows", str(rows)),
            cwd=_OUTSIDE,
            env=env,
            check=True,
            timeout=600,
        )
    return base


# -- a pool -------------------------------------------------------------------------
class Pool:
    """One `mpspool start` in its own session; a context manager that always stops it."""

    def __init__(
        self,
        model_base: Path,
        workers: int,
        log_dir: Path,
        env: dict[str, str],
        label: str = "",
        extra_args: Sequence[str] = (),
    ) -> None:
        """``label`` names the pool in messages and its run directory (default "<N>w");
        ``extra_args`` are appended to `mpspool start` (e.g. "--no-share-weights")."""
        self.workers = workers
        self.env = env
        self.label = label or f"{workers}w"
        # Short: ipc:// endpoints in it are unix socket paths (at most 107 bytes).
        self.run_dir = Path(_OUTSIDE) / f"mpb-{os.getpid()}-{self.label}"
        self.log_dir = log_dir
        self.args = [
            "start",
            "--model-base-path", str(model_base),
            "--model-name", MODEL_NAME,
            "--workers", str(workers),
            "--host", "127.0.0.1",
            "--port", "0",
            "--run-dir", str(self.run_dir),
            "--log-dir", str(log_dir),
            "--metrics-port", "0",
            *extra_args,
        ]  # fmt: skip
        self.proc: subprocess.Popen[bytes] | None = None
        self.target = ""
        self.pool_id = ""
        self.ready_s = 0.0
        self.roles: dict[str, list[psutil.Process]] = {}
        self._descendants: dict[int, psutil.Process] = {}

    def __enter__(self) -> Pool:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        out = open(self.log_dir / "start.out", "wb")
        try:
            # Own session: a Ctrl-C in the terminal reaches this script only, which then stops
            # the pool in order. Dying with us (SIGTERM) covers the case where we are killed.
            self.proc = subprocess.Popen(
                _mpspool(*self.args),
                cwd=_OUTSIDE,
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=process.die_with_parent_sigterm,
            )
        finally:
            out.close()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def status(self) -> dict[str, Any]:
        out = subprocess.run(
            _mpspool("status", "--json", "--run-dir", str(self.run_dir)),
            cwd=_OUTSIDE,
            env=self.env,
            capture_output=True,
            check=True,
            timeout=30,
        ).stdout
        return json.loads(out)

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Until every slot is READY and the router listens; then find the processes."""
        assert self.proc is not None
        started = psutil.Process(self.proc.pid).create_time()
        deadline = time.monotonic() + timeout_s
        status: dict[str, Any] = {}
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"pool {self.label} exited with {self.proc.returncode}; see {self.log_dir}"
                )
            with contextlib.suppress(subprocess.SubprocessError, json.JSONDecodeError):
                status = self.status()
                slots = status["slots"]
                if (
                    len(slots) == self.workers
                    and all(s["state"] == "READY" for s in slots)
                    and status["pool"]["listen"]
                ):
                    self.target = status["pool"]["listen"]
                    self.pool_id = status["pool"].get("pool_id", "")
                    self.ready_s = time.time() - started
                    self._find_processes()
                    return
            time.sleep(0.3)
        raise TimeoutError(
            f"pool {self.label} not ready within {timeout_s:.0f} s: {status}; see {self.log_dir}"
        )

    def _find_processes(self) -> None:
        assert self.proc is not None
        top = psutil.Process(self.proc.pid)
        self.roles = {"router": [], "workers": [], "control": [top]}
        for child in top.children(recursive=True):
            self._descendants[child.pid] = child
            cmdline = " ".join(child.cmdline())
            if "mpspool-router" in cmdline:
                self.roles["router"].append(child)
            elif "mpspool.worker" in cmdline:
                self.roles["workers"].append(child)
            else:  # supervisord
                self.roles["control"].append(child)
        if len(self.roles["router"]) != 1 or len(self.roles["workers"]) != self.workers:
            raise RuntimeError(
                f"pool {self.label}: expected 1 router and {self.workers} workers under pid "
                f"{top.pid}, found {self.roles}"
            )
        # The frozen copy must be what runs (a launcher that cleaned the environment would
        # silently bring back the live repository).
        wanted = self.env.get("PYTHONPATH")
        for proc in self.roles["router"] + self.roles["workers"]:
            got = proc.environ().get("PYTHONPATH")
            if wanted and got != wanted:
                raise RuntimeError(
                    f"pool {self.label}: pid {proc.pid} runs with PYTHONPATH={got!r}, "
                    f"not the frozen source {wanted!r}"
                )

    def replaced(self) -> list[str]:
        """Router or worker processes that are gone since the last look (restarted)."""
        gone = []
        for role in ("router", "workers"):
            for proc in self.roles.get(role, []):
                try:
                    alive = proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
                except psutil.Error:
                    alive = False
                if not alive:
                    gone.append(f"{role} pid {proc.pid}")
        return gone

    def ensure_ready(self) -> str | None:
        """Before a point: if a process was replaced, wait for READY again and say what
        happened (an incident worth reporting: something killed or restarted it)."""
        gone = self.replaced()
        if not gone:
            return None
        self.wait_ready()
        return f"pool {self.label}: {', '.join(gone)} gone; waited for READY again"

    def stop(self) -> None:
        """`mpspool stop`; if that fails, SIGTERM the controller; last, SIGKILL the tree."""
        if self.proc is None:
            return
        with contextlib.suppress(psutil.Error):
            self._descendants.update(
                (p.pid, p) for p in psutil.Process(self.proc.pid).children(recursive=True)
            )
        if self.proc.poll() is None:
            with contextlib.suppress(subprocess.SubprocessError):
                subprocess.run(
                    _mpspool("stop", "--run-dir", str(self.run_dir)),
                    cwd=_OUTSIDE,
                    env=self.env,
                    capture_output=True,
                    timeout=STOP_TIMEOUT_S,
                )
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.terminate()
                try:
                    self.proc.wait(30)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
        for child in self._descendants.values():
            with contextlib.suppress(psutil.Error):
                if child.is_running() and child.status() != psutil.STATUS_ZOMBIE:
                    child.kill()

    def leftovers(self) -> list[str]:
        """What of this pool outlived stop(): processes, and the run directory."""
        left = []
        for child in self._descendants.values():
            with contextlib.suppress(psutil.Error):
                if child.is_running() and child.status() != psutil.STATUS_ZOMBIE:
                    left.append(f"pool {self.label}: process {child.pid} still running")
        if self.run_dir.exists():
            left.append(f"pool {self.label}: run dir {self.run_dir} left behind")
        return left


# -- CPU accounting -------------------------------------------------------------------
class CpuProbe:
    """CPU seconds (user + system, all threads) per role between window start and end."""

    def __init__(self, roles: dict[str, list[psutil.Process]]) -> None:
        self.roles = {**roles, "client": [psutil.Process()]}
        self._start: dict[str, float] = {}
        self.used: dict[str, float] = {}

        self.lost: list[str] = []  # processes that vanished mid-window: no CPU figure

    def _sample(self) -> dict[str, float]:
        sample = {}
        for role, procs in self.roles.items():
            total = 0.0
            for proc in procs:
                try:
                    times = proc.cpu_times()
                except psutil.Error:
                    # A worker replaced mid-window: its CPU cannot be accounted; the point is
                    # still reported, flagged, and left out of the CPU sums.
                    self.lost.append(f"{role} pid {proc.pid}")
                    total = math.nan
                    break
                total += times.user + times.system
            sample[role] = total
        return sample

    def __call__(self, edge: str) -> None:
        if edge == "start":
            self._start = self._sample()
        else:
            end = self._sample()
            self.used = {
                role: end[role] - self._start[role]
                for role in end
                if not (math.isnan(end[role]) or math.isnan(self._start[role]))
            }


# -- the scenario -------------------------------------------------------------------
def _point_line(index: int, total: int, label: str, result: dict[str, Any]) -> str:
    cpu = result.get("cpu_us_per_request", {})
    router = f" router {cpu['router']:.0f} µs/req" if "router" in cpu else ""
    return (
        f"[{index:2d}/{total}] {label:>4} batch={result['batch']:<4} "
        f"c={result.get('concurrency', result.get('processes'))}: "
        f"{result['throughput_rps']:8,.1f} req/s {result['rows_per_s']:10,.0f} rows/s "
        f"p50 {result['p50_ms']:6.2f} ms p99 {result['p99_ms']:6.2f} ms{router}"
    )


def run_point(
    pool: Pool,
    payloads: list[bytes],
    batch: int,
    concurrency: int,
    args: argparse.Namespace,
    incidents: list[str],
) -> dict[str, Any]:
    incident = pool.ensure_ready()
    if incident:
        incidents.append(f"before {pool.label} batch={batch} c={concurrency}: {incident}")
        print(f"foundation: {incident}", file=sys.stderr)
    probe = CpuProbe(pool.roles)
    result = asyncio.run(
        loadgen.closed_loop(
            pool.target,
            payloads,
            batch,
            concurrency,
            duration_s=args.duration,
            warmup_s=args.warmup,
            on_window=probe,
        )
    )
    result["config"] = pool.label
    result["cpu_s"] = probe.used
    if probe.lost:
        result["disturbed"] = f"gone during the window: {', '.join(probe.lost)}"
        incidents.append(f"{pool.label} batch={batch} c={concurrency}: {result['disturbed']}")
    ok = result["ok"]
    result["cpu_us_per_request"] = {
        role: seconds / ok * 1e6 for role, seconds in probe.used.items() if ok
    }
    return result


@contextlib.contextmanager
def frozen_code(kind: str) -> Iterator[tuple[dict[str, Any], dict[str, str]]]:
    """The code under test frozen into a temporary copy (see freeze_source), and the
    environment whose processes run that copy."""
    with tempfile.TemporaryDirectory(prefix="mpb-src-") as frozen:
        source = freeze_source(kind, Path(frozen))
        env = dict(os.environ)
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        if "path" in source:
            env["PYTHONPATH"] = os.pathsep.join(
                p for p in (source["path"], env.get("PYTHONPATH", "")) if p
            )
        yield source, env


def run_scenario(args: argparse.Namespace, stamp: str) -> dict[str, Any]:
    with frozen_code(args.source) as (source, env):
        return _run_scenario(args, stamp, source, env)


def _run_scenario(
    args: argparse.Namespace, stamp: str, source: dict[str, Any], env: dict[str, str]
) -> dict[str, Any]:
    rows = args.rows
    model_base = ensure_model(rows, env)
    log_root = OUT_DIR / f"logs-{stamp}"
    report: dict[str, Any] = {
        "scenario": "foundation",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": command_line(),
        "machine": machine(),
        "versions": versions(),
        "source": source,
        "settings": {
            "rows": rows,
            "model": str(model_base),
            "duration_s": args.duration,
            "warmup_s": args.warmup,
            "concurrency": args.concurrency,
            "batches": args.batches,
            "distinct_requests": args.distinct,
            "repeat": args.repeat,
            "quick": args.quick,
        },
        "load_average_start": os.getloadavg(),
    }
    points: list[dict[str, Any]] = []
    inprocess: list[dict[str, Any]] = []
    leftovers: list[str] = []
    incidents: list[str] = []
    restarts: dict[str, dict[str, int]] = {}
    pools: list[Pool] = []
    total = args.repeat * len(args.batches) * (2 + 2 * len(args.concurrency))
    done = 0
    requests = {
        batch: loadgen.demo_requests(batch, rows, args.distinct, MODEL_NAME)
        for batch in args.batches
    }
    startup: dict[str, float] = {}
    # The in-process limit first, with no pool running. A pool lives in its own session
    # (supervisord's), so Linux puts it in its own autogroup; on this kind of machine an idle
    # pool in another autogroup can wait seconds for the CPU while the in-process processes
    # keep both cores busy, and its router then declares its workers dead (see README).
    with contextlib.ExitStack() as stack:
        limits = {}
        for procs in (2, 1):
            limits[procs] = stack.enter_context(
                InProcessLimit(model_base / "1", rows, processes=procs)
            )
            startup[f"inprocess-P{procs}"] = round(limits[procs].load_s, 2)
            print(
                f"foundation: in-process P={procs} loaded in {limits[procs].load_s:.1f} s",
                file=sys.stderr,
            )
        for round_ in range(args.repeat):
            for batch in args.batches:
                for procs in (2, 1) if round_ % 2 == 0 else (1, 2):
                    result = limits[procs].run(batch, args.duration, args.warmup)
                    result.update(config=f"inprocess-P{procs}", round=round_)
                    inprocess.append(result)
                    done += 1
                    print(_point_line(done, total, f"P={procs}", result), file=sys.stderr)
    with contextlib.ExitStack() as stack:
        # One at a time, so that each start-up time means something.
        for workers in (1, 2):
            pool = Pool(model_base, workers, log_root / f"pool-{workers}w", env)
            pools.append(stack.enter_context(pool))
            pool.wait_ready()
            startup[pool.label] = round(pool.ready_s, 2)
            print(
                f"foundation: pool {pool.label} ready in {pool.ready_s:.1f} s on {pool.target}",
                file=sys.stderr,
            )
        report["startup_s"] = startup
        report["rss_mib_at_ready"] = {
            p.label: {
                proc_role: [round(pr.memory_info().rss / 2**20) for pr in procs]
                for proc_role, procs in p.roles.items()
            }
            for p in pools
        }
        for batch, payloads in requests.items():
            for pool in pools:
                asyncio.run(loadgen.check_target(pool.target, payloads[0], batch))
        for round_ in range(args.repeat):
            for batch, payloads in requests.items():
                for i, concurrency in enumerate(args.concurrency):
                    # Alternate the order, so a drift in machine load favours neither.
                    order = pools if (i + round_) % 2 == 0 else pools[::-1]
                    for pool in order:
                        result = run_point(pool, payloads, batch, concurrency, args, incidents)
                        result["round"] = round_
                        points.append(result)
                        done += 1
                        print(_point_line(done, total, pool.label, result), file=sys.stderr)
        for pool in pools:
            with contextlib.suppress(subprocess.SubprocessError, json.JSONDecodeError):
                restarts[pool.label] = {s["slot"]: s["restarts"] for s in pool.status()["slots"]}
        stack.close()
        for pool in pools:
            leftovers.extend(pool.leftovers())
    leftovers.extend(shm_leftovers([p.pool_id for p in pools if p.pool_id]))
    report["load_average_end"] = os.getloadavg()
    report["points"] = points
    report["inprocess"] = inprocess
    report["best"] = {
        "points": best_of(points, ("config", "batch", "concurrency")),
        "inprocess": best_of(inprocess, ("config", "batch")),
    }
    report["summary"] = summarise(report, args)
    report["leftovers"] = leftovers
    report["incidents"] = incidents
    report["worker_restarts"] = restarts
    return report


def shm_leftovers(pool_ids: list[str]) -> list[str]:
    """Shared-memory files of these pools (named mpspool-<pool id>-...) still present; other
    pools on the machine (tests, other sessions) are none of this run's business."""
    shm = Path("/dev/shm")
    if not shm.is_dir():
        return []
    return [
        f"/dev/shm/{p.name} left behind"
        for p in shm.iterdir()
        if p.name.startswith("mpspool") and any(pool_id in p.name for pool_id in pool_ids)
    ]


def best_of(results: list[dict[str, Any]], key: tuple[str, ...]) -> list[dict[str, Any]]:
    """Per ``key``, the repeat with the highest throughput, plus the spread over repeats.

    Interference from other tenants only ever slows a run down, so the best repeat is the
    better estimate of what the configuration can do; the spread says how noisy it was.
    """
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for result in results:
        groups.setdefault(tuple(result[k] for k in key), []).append(result)
    chosen = []
    for group in groups.values():
        best = dict(max(group, key=lambda r: r["throughput_rps"]))
        best["repeats_rps"] = [r["throughput_rps"] for r in group]
        chosen.append(best)
    return chosen


def summarise(report: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The numbers the targets name (from the best repeats), plus CPU per request (over all
    repeats: CPU time per request is a cost, not a capacity, so it is averaged)."""
    points, inprocess = report["best"]["points"], report["best"]["inprocess"]
    all_points = report["points"]

    def peak(config: str, batch: int) -> float:
        values = [
            p["throughput_rps"] for p in points if p["config"] == config and p["batch"] == batch
        ]
        return max(values, default=float("nan"))

    def limit(procs: int, batch: int) -> float:
        return next(
            (
                r["throughput_rps"]
                for r in inprocess
                if r["processes"] == procs and r["batch"] == batch
            ),
            float("nan"),
        )

    def cpu_per_request(config: str, batch: int, role: str) -> float:
        chosen = [p for p in all_points if p["config"] == config and p["batch"] == batch]
        chosen = [p for p in chosen if role in p["cpu_s"]]
        ok = sum(p["ok"] for p in chosen)
        seconds = sum(p["cpu_s"][role] for p in chosen)
        return seconds / ok * 1e6 if ok else float("nan")

    summary: dict[str, Any] = {"per_batch": {}}
    for batch in args.batches:
        one, two, lim = peak("1w", batch), peak("2w", batch), limit(2, batch)
        summary["per_batch"][str(batch)] = {
            "peak_rps_1w": one,
            "peak_rps_2w": two,
            "inprocess_rps_P1": limit(1, batch),
            "inprocess_rps_P2": lim,
            "ratio_2w_over_1w": two / one if one else float("nan"),
            "ratio_2w_over_inprocess_P2": two / lim if lim else float("nan"),
            "cpu_us_per_request": {
                config: {
                    role: cpu_per_request(config, batch, role)
                    for role in ("router", "workers", "control", "client")
                }
                for config in ("1w", "2w")
            },
        }
    big, small = str(max(args.batches)), str(min(args.batches))
    b = summary["per_batch"]
    router_us = max(b[small]["cpu_us_per_request"][c]["router"] for c in ("1w", "2w"))
    summary["targets"] = [
        {
            "target": f"batch {big}: 2 workers ≥ {TARGET_2W_OVER_1W}× 1 worker (peak over C)",
            "measured": b[big]["ratio_2w_over_1w"],
            "unit": "×",
            "met": b[big]["ratio_2w_over_1w"] >= TARGET_2W_OVER_1W,
        },
        {
            "target": (
                f"batch {big}: 2 workers ≥ {TARGET_2W_OVER_INPROCESS}× in-process limit (P=2)"
            ),
            "measured": b[big]["ratio_2w_over_inprocess_P2"],
            "unit": "×",
            "met": b[big]["ratio_2w_over_inprocess_P2"] >= TARGET_2W_OVER_INPROCESS,
        },
        {
            "target": (
                f"batch {small}: router CPU ≤ {TARGET_ROUTER_US:.0f} µs per request "
                "(worse of 1w and 2w)"
            ),
            "measured": router_us,
            "unit": "µs",
            "met": router_us <= TARGET_ROUTER_US,
        },
    ]
    return summary


# -- context --------------------------------------------------------------------------
def command_line(module: str = "bench.foundation") -> str:
    python = sys.executable
    if python.startswith(f"{REPO}{os.sep}"):
        python = os.path.relpath(python, REPO)
    return shlex.join([python, "-m", module, *sys.argv[1:]])


def machine() -> dict[str, Any]:
    model = platform.processor() or "unknown"
    with contextlib.suppress(OSError):
        match = re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.M)
        if match:
            model = match.group(1).strip()
    return {
        "cpu_model": model,
        "logical_cpus": os.cpu_count(),
        "usable_cores": usable_cores(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "kernel": platform.release(),
    }


def versions() -> dict[str, str]:
    found = {"python": platform.python_version()}
    for dist in ("tensorflow-cpu", "tensorflow", "grpcio", "protobuf", "pyzmq", "numpy", "mpspool"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            found[dist] = importlib.metadata.version(dist)
    return found


# -- RESULTS.md -----------------------------------------------------------------------
def _f(value: float, digits: int = 1) -> str:
    return "–" if value is None or math.isnan(value) else f"{value:,.{digits}f}"


def _describe_source(source: dict[str, Any]) -> str:
    commit = source.get("commit", "unknown commit")
    if source.get("kind") == "HEAD":
        return f"commit {commit} (frozen copy)"
    changed = source.get("uncommitted") or []
    extra = f" plus uncommitted changes to {', '.join(changed)}" if changed else ""
    frozen = "frozen copy of the working tree" if "path" in source else "live working tree"
    return f"commit {commit}{extra} ({frozen})"


def render_markdown(report: dict[str, Any], json_path: Path) -> str:
    """The foundation section of RESULTS.md, markers included."""
    m, v, s = report["machine"], report["versions"], report["settings"]
    spreads = sorted(
        1 - min(r["repeats_rps"]) / max(r["repeats_rps"])
        for r in report["best"]["points"] + report["best"]["inprocess"]
        if len(r["repeats_rps"]) > 1 and max(r["repeats_rps"]) > 0
    )
    noise = (
        f"the worst round of a point was {spreads[len(spreads) // 2]:.0%} below its best at "
        f"the median, {spreads[-1]:.0%} at the worst"
        if spreads
        else "one round"
    )
    lines = [
        BEGIN_MARK,
        "## Foundation: 1 worker vs 2 workers vs the in-process limit",
        "",
        f"- **Date:** {report['date']}",
        f"- **Command:** `{report['command']}` (from the repository root)",
        f"- **Machine:** {m['cpu_model']}, {m['usable_cores']} usable cores "
        f"({m['logical_cpus']} logical), {m['memory_gib']} GiB, Linux {m['kernel']}; shared and "
        f"noisy (load average {report['load_average_start'][0]:.2f} at start, "
        f"{report['load_average_end'][0]:.2f} at end)",
        f"- **Versions:** TensorFlow {v.get('tensorflow-cpu', v.get('tensorflow', '?'))}, "
        f"grpcio {v.get('grpcio', '?')}, protobuf {v.get('protobuf', '?')}, "
        f"pyzmq {v.get('pyzmq', '?')}, Python {v['python']}",
        f"- **Model:** demo, {s['rows']:,} embedding rows; {s['distinct_requests']} distinct "
        f"requests per batch size, cycled",
        f"- **Load:** closed loop, {s['warmup_s']:g} s warm-up then {s['duration_s']:g} s "
        f"measured per point, {s['repeat']} round{'s' if s['repeat'] > 1 else ''}; the two "
        f"pools take turns point by point, the in-process limit runs before they start; "
        f"tables show each point's best round ({noise})",
        f"- **Code under test:** {_describe_source(report['source'])}",
        "- **Start-up (to all READY):** "
        + ", ".join(f"{k} {v_:.1f} s" for k, v_ in report["startup_s"].items()),
        f"- **Raw results:** `{json_path.relative_to(REPO)}`",
        "",
        "The load generator runs on the same cores as the pool and competes with it for CPU "
        "(its own cost per request is in the CPU table), so absolute numbers understate a "
        "dedicated server. Read the ratios, which compare runs taken seconds apart. "
        "1w = one worker (intra-op threads = 2), 2w = two workers (1 thread each); the "
        "in-process limit P=2 is two processes calling the SavedModel directly (1 thread "
        "each, one call at a time each), P=1 one process with 2 threads.",
        "",
        "### Targets",
        "",
        "| Target | Measured | Met |",
        "|---|---:|:---:|",
    ]
    for t in report["summary"]["targets"]:
        digits = 0 if t["unit"] == "µs" else 2
        lines.append(
            f"| {t['target']} | {_f(t['measured'], digits)} {t['unit']} | "
            f"{'yes' if t['met'] else '**no**'} |"
        )
    for batch in s["batches"]:
        b = report["summary"]["per_batch"][str(batch)]
        lines += [
            "",
            f"### Batch {batch}",
            "",
            "| C | 1w req/s | 1w rows/s | 1w p50 ms | 1w p99 ms "
            "| 2w req/s | 2w rows/s | 2w p50 ms | 2w p99 ms | 2w/1w | 2w/in-process P=2 |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        lim = b["inprocess_rps_P2"]
        for c in s["concurrency"]:
            row = {
                p["config"]: p
                for p in report["best"]["points"]
                if p["batch"] == batch and p["concurrency"] == c
            }
            one, two = row.get("1w"), row.get("2w")
            cells = [str(c)]
            for p in (one, two):
                cells += (
                    [
                        _f(p["throughput_rps"]),
                        _f(p["rows_per_s"], 0),
                        _f(p["p50_ms"], 2),
                        _f(p["p99_ms"], 2),
                    ]
                    if p
                    else ["–"] * 4
                )
            ratio = two["throughput_rps"] / one["throughput_rps"] if one and two else math.nan
            vs_lim = two["throughput_rps"] / lim if two and lim else math.nan
            cells += [_f(ratio, 2), _f(vs_lim, 2)]
            errs = sum(p["error_count"] for p in (one, two) if p)
            if errs:
                cells[0] += f" ({errs} errors)"
            lines.append("| " + " | ".join(cells) + " |")
        lines += [
            "",
            "| In-process limit | calls/s | rows/s | p50 ms | p99 ms |",
            "|---|---:|---:|---:|---:|",
        ]
        for r in sorted(report["best"]["inprocess"], key=lambda r: r["processes"]):
            if r["batch"] == batch:
                lines.append(
                    f"| P={r['processes']} ({r['intra_op_threads']} intra-op thread"
                    f"{'s' if r['intra_op_threads'] > 1 else ''} each) | "
                    f"{_f(r['throughput_rps'])} | {_f(r['rows_per_s'], 0)} | "
                    f"{_f(r['p50_ms'], 2)} | {_f(r['p99_ms'], 2)} |"
                )
        lines += [
            "",
            f"Peak over C: 1w {_f(b['peak_rps_1w'])} req/s, 2w {_f(b['peak_rps_2w'])} req/s; "
            f"2w/1w = {_f(b['ratio_2w_over_1w'], 2)}, 2w/in-process P=2 = "
            f"{_f(b['ratio_2w_over_inprocess_P2'], 2)}.",
        ]
    lines += [
        "",
        "### CPU per request (µs, all C of a batch size together)",
        "",
        "Process CPU time (user + system, psutil) over the measured windows divided by the "
        "requests answered in them. *control* is the controller plus supervisord; *client* is "
        "the load generator itself; for the in-process rows, *workers* is the CPU per call of "
        "the processes calling TensorFlow directly. *Ceiling* is what that much CPU per "
        f"request allows on {m['usable_cores']} cores: no configuration can exceed it here.",
        "",
        "| Batch | Config | router | workers | control | client | total | ceiling req/s |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    cores = m["usable_cores"]
    for batch in s["batches"]:
        per = report["summary"]["per_batch"][str(batch)]["cpu_us_per_request"]
        for config in ("1w", "2w"):
            c = per[config]
            total = sum(c[role] for role in ("router", "workers", "control", "client"))
            lines.append(
                f"| {batch} | {config} | {_f(c['router'], 0)} | {_f(c['workers'], 0)} | "
                f"{_f(c['control'], 0)} | {_f(c['client'], 0)} | {_f(total, 0)} | "
                f"{_f(cores / total * 1e6 if total else math.nan, 0)} |"
            )
        for r in sorted(report["best"]["inprocess"], key=lambda r: r["processes"]):
            if r["batch"] == batch:
                per_call = r["cpu_us_per_call"] or math.nan
                lines.append(
                    f"| {batch} | in-process P={r['processes']} | – | {_f(per_call, 0)} | – | – | "
                    f"{_f(per_call, 0)} | {_f(cores / per_call * 1e6, 0)} |"
                )
    small = min(s["batches"])
    per_c: dict[tuple[str, int], list[float]] = {}
    for p in report["points"]:
        if p["batch"] == small and p["ok"] and "router" in p["cpu_s"]:
            cpu = per_c.setdefault((p["config"], p["concurrency"]), [0.0, 0.0])
            cpu[0] += p["cpu_s"]["router"]
            cpu[1] += p["ok"]
    lines += [
        "",
        f"Router CPU per request at batch {small}, per C: "
        + "; ".join(
            f"{config} C={c} {seconds / ok * 1e6:,.0f}"
            for (config, c), (seconds, ok) in sorted(per_c.items())
        )
        + " µs.",
    ]
    restarted = {
        f"{label} {slot}": n
        for label, slots in report["worker_restarts"].items()
        for slot, n in slots.items()
        if n
    }
    if restarted or report["incidents"]:
        lines += [
            "",
            "**Incidents:** worker restarts during the run: "
            + (", ".join(f"{k} ×{n}" for k, n in restarted.items()) or "none")
            + ("; " + "; ".join(report["incidents"]) if report["incidents"] else ""),
        ]
    if report["leftovers"]:
        lines += ["", "**Left behind after the run:** " + "; ".join(report["leftovers"])]
    lines.append(END_MARK)
    return "\n".join(lines) + "\n"


def write_section(path: Path, section: str, begin_mark: str, end_mark: str) -> None:
    """Replace one scenario's section of ``path`` (between its markers), or add it, leaving
    the rest alone: each bench script owns its own section of RESULTS.md."""
    text = path.read_text() if path.exists() else "# mpspool benchmark results\n\n"
    begin, end = text.find(begin_mark), text.find(end_mark)
    if begin != -1 and end != -1:
        rest = text[end + len(end_mark) :].lstrip("\n")
        text = text[:begin] + section + ("\n" + rest if rest else "")
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.write_text(text)


def write_foundation_md(path: Path, section: str) -> None:
    """Replace the foundation section of ``path`` (or add it), leaving the rest alone."""
    write_section(path, section, BEGIN_MARK, END_MARK)


# -- command line -------------------------------------------------------------------
def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.foundation", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--rows", type=int, default=2_000_000, help="embedding rows")
    parser.add_argument("--duration", type=float, default=3.0, help="measured seconds per point")
    parser.add_argument("--warmup", type=float, default=1.0, help="warm-up seconds per point")
    parser.add_argument("--concurrency", type=_ints, default=[1, 2, 4, 8])
    parser.add_argument("--batches", type=_ints, default=[1, 256])
    parser.add_argument("--distinct", type=int, default=8, help="distinct requests per batch")
    parser.add_argument(
        "--repeat",
        type=int,
        default=2,
        help="rounds over every point; tables show the best round (%(default)s)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: 1,000-row model, 1 s points; RESULTS.md untouched unless --results",
    )
    add_output_arguments(parser)
    return parser


def add_output_arguments(parser: argparse.ArgumentParser, writes: str = "the JSON") -> None:
    """--source, --results, --no-results, --render: what every scenario script takes."""
    parser.add_argument(
        "--source",
        choices=("worktree", "HEAD", "live"),
        default="worktree",
        help="code under test, frozen into a temporary copy at the start: the working tree "
        "(uncommitted changes included), the last commit, or live (no copy) (%(default)s)",
    )
    parser.add_argument("--results", type=Path, help=f"markdown to update (default {RESULTS_MD})")
    parser.add_argument("--no-results", action="store_true", help=f"write {writes} only")
    parser.add_argument(
        "--render",
        type=Path,
        metavar="JSON",
        help=f"run nothing: rewrite {writes.replace('the JSON', 'the markdown section')} "
        "from a raw results file",
    )


@contextlib.contextmanager
def _sigterm_as_exit() -> Iterator[None]:
    """SIGTERM unwinds like Ctrl-C does, so the pools and processes are stopped on the way.

    Raising from the handler is deliberate: the run is a sequence of blocking steps (a load
    run, a wait on the in-process pipes, a subprocess), and unwinding through their context
    managers is what stops everything; there is no loop that could poll a flag in time.
    """

    def handler(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_to_json(
    name: str,
    quick: bool,
    run: Callable[[str], dict[str, Any]],
    out_dir: Path = OUT_DIR,
    before_writing: Callable[[dict[str, Any]], None] = lambda report: None,
) -> tuple[dict[str, Any], Path] | None:
    """What every scenario's main() does around its run: a UTC stamp, the run with SIGTERM
    unwinding like Ctrl-C, its wall time, and the raw JSON in ``out_dir``
    (``<name>-[quick-]<stamp>.json``). None, said on stderr, when it was interrupted."""
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    out_dir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    started = time.monotonic()
    try:
        with _sigterm_as_exit():
            report = run(stamp)
    except (KeyboardInterrupt, asyncio.CancelledError):
        # An interrupt inside a load run surfaces as the run's cancellation; either way the
        # context managers have stopped every pool and process by now.
        print(f"{name}: interrupted; everything it started has been stopped", file=sys.stderr)
        return None
    report["wall_s"] = round(time.monotonic() - started, 1)
    before_writing(report)
    json_path = out_dir / f"{name}-{'quick-' if quick else ''}{stamp}.json"
    json_path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"{name}: raw results in {json_path}", file=sys.stderr)
    return report, json_path


def print_targets(targets: Sequence[dict[str, Any]], measured: Callable[[float], str]) -> None:
    for t in targets:
        state = "----" if t["met"] is None else "MET " if t["met"] else "MISS"
        print(f"{state} {t['target']}: {measured(t['measured'])} {t['unit']}", file=sys.stderr)


def scenario_main(
    name: str,
    args: argparse.Namespace,
    run: Callable[[str], dict[str, Any]],
    render_markdown: Callable[[dict[str, Any], Path], str],
    notes: Callable[[dict[str, Any]], Sequence[str]] = lambda report: (),
    write_results: Callable[[Path, str], None] | None = None,
) -> int:
    """A scenario's main() after its arguments are settled: --render, or the run, its raw
    JSON, its section of RESULTS.md (through ``write_results``, which knows the scenario's
    own markers), the targets, ``notes`` and leftovers on stderr. Exit code 130 when
    interrupted, 1 when the run left anything behind."""
    write_results_md = write_results or write_foundation_md
    results_md = None if args.no_results else args.results or (None if args.quick else RESULTS_MD)
    if args.render is not None:
        report = json.loads(args.render.read_text())
        write_results_md(args.results or RESULTS_MD, render_markdown(report, args.render.resolve()))
        print(f"{name}: rendered {args.render} into {args.results or RESULTS_MD}")
        return 0
    done = run_to_json(name, args.quick, run)
    if done is None:
        return 130
    report, json_path = done
    if results_md is not None:
        write_results_md(results_md, render_markdown(report, json_path))
        print(f"{name}: updated {results_md}", file=sys.stderr)
    print_targets(report["summary"]["targets"], lambda v: f"{v:.2f}")
    for line in notes(report):
        print(f"{name}: {line}", file=sys.stderr)
    for item in report["leftovers"]:
        print(f"{name}: LEFT BEHIND: {item}", file=sys.stderr)
    print(f"{name}: done in {report['wall_s']:.0f} s", file=sys.stderr)
    return 1 if report["leftovers"] else 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.rows = 1000 if args.rows == 2_000_000 else args.rows
        args.duration = min(args.duration, 1.0)
        args.warmup = min(args.warmup, 0.5)
        args.repeat = 1
    return scenario_main(
        "foundation", args, lambda stamp: run_scenario(args, stamp), render_markdown
    )


if __name__ == "__main__":
    sys.exit(main())
