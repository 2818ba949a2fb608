"""The memory scenario: what N workers cost with shared weights, with plain loading, and with
no weights at all (the TF-runtime-only reference); worker cold start against weight size.

For N = 1..4 it starts, one at a time, three pools of N workers and measures each once it is
READY and has answered a few requests (batch 1 and batch 256, spread over its workers):

- *runtime*: the 100-row demo model (25 KiB), weights shared. Its workers are the
  TF-runtime-only reference: the same graph, the same serving path, almost no weights. It is
  measured in a pool of the same N because USS depends on who else maps TensorFlow's shared
  libraries: a page of libtensorflow mapped by one process only is private to it (in its
  USS), the same page mapped by two workers is not. A lone process (the SavedModel loaded
  with ``experimental_skip_checkpoint``, one call) is measured too, before any pool starts.
- *shared*: the 2,000,000-row demo model (488 MiB), weights published once into /dev/shm and
  mapped by every worker.
- *plain*: the same model with ``--no-share-weights``: each worker loads its own copy.

Per process it records USS and PSS (psutil ``memory_full_info``) and, from /proc/<pid>/smaps,
what of the weight segment is resident in it. Segment pages that only one worker happens to
have touched count as private (USS) to that worker although they live in /dev/shm whatever
the worker does, so a worker's own memory is its USS less the segment's clean private pages
(copy-on-write copies, which are dirty, stay counted). The pool's footprint charges the whole
segment once: the workers' PSS outside the segment plus the segment's size.

A *one-process server* (bench/peers/plain.py: TF Serving's Predict API in one Python
process that loads the model plainly, what one writes before a serving system) serves the
488 MiB model alone, before any pool: the pools' total PSS (workers, segment, front door,
controller) and their spawn → first correct answer are compared with its own; "correct" is the
same answer, bit for bit, as it gives to the same request.

Cold start is measured in the N = 2 pools of the 100-row and the 488 MiB model (shared), plus
extra rounds in the opposite order: per worker, from its process's creation to the
controller's READY (its log line), and for the pool, from spawning `mpspool start` to the last
worker READY (publishing included). Status is polled through the pool's admin socket (what
`mpspool status --json` asks) instead of a CLI process per poll, which would compete with the
starting workers for the CPU.

    .venv/bin/python -m bench.memory                 # the full run (about 5 minutes on 2 cores)
    .venv/bin/python -m bench.memory --quick         # a smoke run: smaller model, N = 1, 2

Writes ``bench/out/memory-<date>.json`` and rewrites the memory section of
``bench/RESULTS.md``. Every process it starts is stopped before it exits, on errors and Ctrl-C
included, and it checks that nothing was left behind (processes, run directories, /dev/shm).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import datetime as dt
import itertools
import json
import math
import os
import re
import select
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import TracebackType
from typing import Any

import psutil

from bench import harness
from bench.harness import (
    _OUTSIDE,
    MODEL_NAME,
    OUT_DIR,
    REPO,
    Pool,
    _describe_source,
    _ints,
    add_output_arguments,
    command_line,
    ensure_model,
    frozen_code,
    machine,
    scenario_main,
    shm_leftovers,
    versions,
    write_section,
)
from mpspool import process
from mpspool.demo_model import demo_inputs
from mpspool.wire import slot_key

BEGIN_MARK = "<!-- memory:begin (written by bench/memory.py; edits here are lost) -->"
END_MARK = "<!-- memory:end -->"
SMALL_ROWS = 100  # 25 KiB of float32 × 64: the runtime-only reference and small cold start
QUICK_ROWS = 131_072  # 32 MiB: --quick's "big" model
COLD_START_WORKERS = 2
REQUESTS_PER_WORKER = 4  # per batch size
BATCHES = (1, 256)
REFERENCE_TIMEOUT_S = 300.0
LONE_QUIET_WAIT_S = 30.0
MIB = 2**20
# The targets of the issue this scenario answers.
TARGET_ADDED_WORKER = 1.10  # an added worker's USS / the TF runtime's
TARGET_RUNTIMES_PER_WORKER = 1.10  # PSS(N workers) <= weights + 1.1·N × runtime (4.4 at N=4)
TARGET_COLD_START = 1.15  # worker cold start, 488 MiB / 100-row model
# Against the one-process server on the same model (bench/peers/plain.py):
TARGET_POOL_PSS = {2: 1.3, 4: 1.8}  # N → the pool's total PSS / the server's PSS
TARGET_FIRST_ANSWER = 1.5  # 2-worker pool spawn → first correct answer / the server's
TARGET_START_PEAK = 0.05  # a worker's VmHWM at READY ≤ the runtime-only worker's + 5% of table
FIRST_ANSWER_TIMEOUT_S = 300.0
FIRST_ANSWER_POLL_S = 0.05
FIRST_ANSWER_SEED = 7

CONFIGS = {
    "runtime": "runtime-only reference (100-row model, shared)",
    "shared": "shared weights",
    "plain": "plain load (--no-share-weights)",
}


# -- the lone TF runtime --------------------------------------------------------------
# Run with `python -c`, outside the repository (see foundation._OUTSIDE). It must call the
# serving signature once without the weights: with no checkpoint read, the variables exist but
# hold nothing; each gets zeros, and a table (first dimension = the model's rows) one row only,
# assigned without shape validation, so that ids of 0 can be looked up and nothing of the
# table's size is ever allocated.
_REFERENCE_CHILD = """
import json, os, sys
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
from mpspool import process
process.die_with_parent()
import tensorflow as tf
from mpspool.demo_model import demo_inputs
model_dir, rows = sys.argv[1], int(sys.argv[2])
options = tf.saved_model.LoadOptions(experimental_skip_checkpoint=True)
loaded = tf.saved_model.load(model_dir, tags=["serve"], options=options)
serve = loaded.signatures["serving_default"]
for v in serve.variables:
    shape = [1, *v.shape[1:]] if v.shape.rank and v.shape[0] == rows else v.shape
    tf.raw_ops.AssignVariableOp(
        resource=v.handle, value=tf.zeros(shape, v.dtype), validate_shape=False
    )
out = serve(**{k: tf.constant(a) for k, a in demo_inputs(1, 1).items()})
print(json.dumps({k: v.shape.as_list() for k, v in out.items()}), flush=True)
sys.stdin.read()
"""


class LoneRuntime:
    """One process holding the TF runtime and the model's graph, without weights; a context
    manager that always stops it."""

    def __init__(self, model_dir: Path, rows: int, log_path: Path, env: dict[str, str]) -> None:
        self.args = [sys.executable, "-c", _REFERENCE_CHILD, str(model_dir), str(rows)]
        self.log_path = log_path
        self.env = env
        self.proc: subprocess.Popen[str] | None = None

    def __enter__(self) -> LoneRuntime:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                self.args,
                cwd=_OUTSIDE,
                env=self.env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
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
        if self.proc is None:
            return
        with contextlib.suppress(OSError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()  # its cue to exit
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def measure(self) -> dict[str, Any]:
        """Wait for its one call, then measure it."""
        assert self.proc is not None and self.proc.stdout is not None
        started = time.monotonic()
        line = ""
        ready, _, _ = select.select([self.proc.stdout], [], [], REFERENCE_TIMEOUT_S)
        if ready:
            line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the lone TF runtime did not come up; see {self.log_path}")
        load_and_call_s = round(time.monotonic() - started, 2)
        # Alone means alone: give another tenant's TensorFlow process a moment to finish.
        deadline = time.monotonic() + LONE_QUIET_WAIT_S
        while tf_mappers({self.proc.pid}) and time.monotonic() < deadline:
            time.sleep(1.0)
        result = memory_of(psutil.Process(self.proc.pid))
        result["other_tf_processes"] = tf_mappers({self.proc.pid})
        result["outputs"] = json.loads(line)
        result["load_and_call_s"] = load_and_call_s
        return result


# -- the one-process server -------------------------------------------------------------
def first_answer_request(rows: int) -> Any:
    """The request whose answer every system must give alike: a batch of one."""
    return harness.predict_request(
        "first", MODEL_NAME, demo_inputs(1, rows, seed=FIRST_ANSWER_SEED)
    )


def wait_first_answer(
    target: str, request: Any, since: float, given_up: threading.Event | None = None
) -> tuple[float, list[float]]:
    """Seconds from `since` (wall clock) to the first answer `target` gives `request`, and the
    answer; asks every FIRST_ANSWER_POLL_S until then, or until `given_up` is set (the pool
    failed to start: RuntimeError)."""
    deadline = time.monotonic() + FIRST_ANSWER_TIMEOUT_S
    while True:
        try:
            values = harness.answer_values(request, harness.call(target, request, timeout_s=30.0))
            return time.time() - since, values.reshape(-1).tolist()
        except RuntimeError:
            if time.monotonic() > deadline or (given_up is not None and given_up.is_set()):
                raise
            time.sleep(FIRST_ANSWER_POLL_S)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_plain_server(
    model_dir: Path, rows: int, round_: int, log_root: Path, env: dict[str, str]
) -> dict[str, Any]:
    """Spawn the one-process server, time its first correct answer, exercise it as a 1-worker
    pool is exercised, measure it, stop it."""
    port = _free_port()
    target = f"127.0.0.1:{port}"
    log_path = log_root / f"plain-server-r{round_}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    # bench/ is not in the frozen copy of the code under test; the server is bench code.
    child_env = dict(
        env, PYTHONPATH=os.pathsep.join(p for p in (env.get("PYTHONPATH"), str(REPO)) if p)
    )
    args = [sys.executable, "-m", "bench.peers.plain", "--model-dir", str(model_dir)]
    args += ["--port", str(port), "--instances", "1", "--model-name", MODEL_NAME]
    record: dict[str, Any] = {"round": round_, "load_average": os.getloadavg()[0]}
    request = first_answer_request(rows)
    with open(log_path, "wb") as log:
        spawned = time.time()
        proc = subprocess.Popen(
            args,
            cwd=_OUTSIDE,
            env=child_env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=process.die_with_parent_sigterm,
        )
    try:
        record["spawn_to_first_answer_s"], record["first_answer"] = wait_first_answer(
            target, request, spawned
        )
        ps = psutil.Process(proc.pid)
        record["hwm_at_first_answer"] = peak_rss(proc.pid)
        record["requests"] = exercise(target, rows, 1)
        record["memory"] = memory_of(ps)
        record["alone"] = alone_footprint([proc.pid])
        record["other_tf_processes"] = tf_mappers({proc.pid})
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return record


# -- memory of one process ------------------------------------------------------------
_VMA_HEADER = re.compile(r"^[0-9a-f]+-[0-9a-f]+ \S+ \S+ \S+ \S+\s*(.*)$")
_SMAPS_FIELDS = {
    "Rss:": "segment_rss",
    "Pss:": "segment_pss",
    "Private_Clean:": "segment_private_clean",
    "Private_Dirty:": "segment_private_dirty",
    "Anonymous:": "segment_anonymous",
}


def segment_resident(pid: int) -> dict[str, int]:
    """Bytes of the weight segment's mappings resident in ``pid`` (from /proc/<pid>/smaps).

    Only workers map the segment (the publisher has exited), so the segment's Pss summed over
    the workers is what of it any worker has touched. Its pages are tmpfs pages, which smaps
    shows as dirty; the copy-on-write copies a worker made are the anonymous ones.
    """
    found = dict.fromkeys(_SMAPS_FIELDS.values(), 0)
    inside = False
    with open(f"/proc/{pid}/smaps") as smaps:
        for line in smaps:
            header = _VMA_HEADER.match(line)
            if header:
                inside = header.group(1).startswith("/dev/shm/mpspool-")
                continue
            if inside:
                key, _, rest = line.partition(" ")
                if key in _SMAPS_FIELDS:
                    found[_SMAPS_FIELDS[key]] += int(rest.split()[0]) * 1024
    return found


def peak_rss(pid: int) -> int:
    """VmHWM: the process's peak RSS so far, in bytes (a transient copy of the weights at
    start would show here even after it was freed); 0 if it cannot be read."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def memory_of(proc: psutil.Process) -> dict[str, Any]:
    """USS, PSS, RSS (psutil) and the weight segment's share of them, in bytes."""
    full = proc.memory_full_info()
    result: dict[str, Any] = {
        "pid": proc.pid,
        "uss": full.uss,
        "pss": full.pss,
        "rss": full.rss,
        "swap": full.swap,
        "hwm": peak_rss(proc.pid),
    }
    result.update(segment_resident(proc.pid))
    # Its own memory: USS less the segment pages it maps alone (they stay in /dev/shm without
    # it); its copy-on-write copies (anonymous) remain counted.
    private = result["segment_private_clean"] + result["segment_private_dirty"]
    result["own_uss"] = full.uss - max(0, private - result["segment_anonymous"])
    result["pss_outside_segment"] = full.pss - result["segment_pss"]
    return result


_SMAPS_PAGES = ("Private_Clean:", "Private_Dirty:", "Shared_Clean:", "Shared_Dirty:")


def alone_footprint(pids: list[int], segment_bytes: int = 0) -> int:
    """What a group of processes would occupy if nothing else ran: their private pages, each
    mapped file's shared pages once (the most any of them has resident), and the weight
    segment whole. PSS splits a shared page among every process mapping it, this benchmark's
    own process and other tenants' TensorFlow included, so a group's PSS drops when others
    run; this does not. Approximate where group members touch different pages of a file."""
    private = 0
    shared: dict[str, int] = {}
    for pid in pids:
        path = ""
        per_file: dict[str, int] = {}
        with contextlib.suppress(OSError), open(f"/proc/{pid}/smaps") as smaps:
            for line in smaps:
                header = _VMA_HEADER.match(line)
                if header:
                    path = header.group(1)
                    continue
                key, _, rest = line.partition(" ")
                if key not in _SMAPS_PAGES or path.startswith("/dev/shm/mpspool-"):
                    continue
                size = int(rest.split()[0]) * 1024
                if key.startswith("Private") or not path.startswith("/"):
                    private += size
                else:
                    per_file[path] = per_file.get(path, 0) + size
        for path, size in per_file.items():
            shared[path] = max(shared.get(path, 0), size)
    return private + sum(shared.values()) + segment_bytes


def tf_libraries(pid: int) -> set[str]:
    """The TensorFlow shared libraries process ``pid`` maps (paths)."""
    paths = set()
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/maps").read_text(errors="replace").splitlines():
            path = line.split(maxsplit=5)[-1] if line.count(" ") >= 5 else ""
            if "libtensorflow" in path or "_pywrap_tensorflow" in path:
                paths.add(path)
    return paths


def tf_mappers(ours: set[int]) -> list[str]:
    """Other processes mapping the same TensorFlow libraries as ours (tests, other sessions
    on the machine using the same install).

    Their mappings make those pages shared, which takes them out of our processes' USS: a
    measurement taken while one runs is not comparable with one taken without. Processes of
    another install (another venv) map other files and change nothing. The bench's own
    process counts too: it builds and reads its requests without TensorFlow so that it maps
    none (it did, and a lone worker's USS read 201 MiB instead of its runtime's ~500).
    """
    libraries: set[str] = set()
    for pid in ours:
        libraries |= tf_libraries(pid)
    if not libraries:
        return []
    found = []
    for proc_dir in Path("/proc").glob("[0-9]*"):
        pid = int(proc_dir.name)
        if pid in ours or not tf_libraries(pid) & libraries:
            continue
        with contextlib.suppress(OSError):
            cmdline = (proc_dir / "cmdline").read_bytes().replace(b"\0", b" ")
            found.append(f"{pid} {cmdline.decode(errors='replace').strip()[:120]}")
    return found


# -- a pool ---------------------------------------------------------------------------
class MemoryPool(Pool):
    """A foundation Pool remembering when each worker pid was first seen READY."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.seen_ready: dict[int, float] = {}

    def __enter__(self) -> MemoryPool:
        super().__enter__()
        return self

    def status(self) -> dict[str, Any]:
        status = super().status()
        now = time.time()
        for slot in status["slots"]:
            if slot["state"] == "READY" and slot["pid"]:
                self.seen_ready.setdefault(slot["pid"], now)
        return status


def _boot_time() -> float:
    """Boot time to 10 ms (psutil's comes from /proc/stat in whole seconds, which would put up
    to a second of error into every process's creation time)."""
    uptime = float(Path("/proc/uptime").read_text().split()[0])
    return time.time() - uptime


def spawned_at(proc: psutil.Process, boot: float) -> float:
    return proc.create_time() - psutil.boot_time() + boot


_LOG_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) controller \w+ (.*)$")
_READY = re.compile(r"^slot (\S+): STARTING -> READY")
# "weights of version 1 published to /dev/shm/mpspool-... (488.3 MiB) in 1.2 s"
_PUBLISHED = re.compile(r"weights of .* published to (\S+) \(([\d.]+) MiB\) in ([\d.]+) s")
_PUBLISHER = re.compile(
    r"published (\d+) tensors, ([\d.]+) MiB, to (\S+) in ([\d.]+) s \(peak RSS (\d+) MiB\)"
)


def read_controller_log(log_dir: Path) -> dict[str, Any]:
    """READY times per slot (wall clock, from the controller's log) and the publish lines."""
    found: dict[str, Any] = {"ready_at": {}, "publish": None}
    with contextlib.suppress(OSError):
        for line in (log_dir / "start.out").read_text(errors="replace").splitlines():
            match = _LOG_LINE.match(line)
            if not match:
                continue
            stamp, message = match.groups()
            ready = _READY.match(message)
            if ready:
                when = dt.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()
                found["ready_at"].setdefault(ready.group(1), when)
            published = _PUBLISHED.search(message)
            if published:
                found["publish"] = {
                    "segment": published.group(1),
                    "mib": float(published.group(2)),
                    "controller_s": float(published.group(3)),
                }
    with contextlib.suppress(OSError):
        match = _PUBLISHER.search((log_dir / "publish.log").read_text(errors="replace"))
        if match and found["publish"] is not None:
            found["publish"].update(
                tensors=int(match.group(1)),
                publisher_s=float(match.group(4)),
                publisher_peak_rss_mib=int(match.group(5)),
            )
    return found


def exercise(target: str, rows: int, workers: int) -> int:
    """A few requests per worker at each batch size (the router spreads them round-robin),
    each answer's shape checked: the serving path has run in every worker before it is
    measured."""
    sent = 0
    for batch in BATCHES:
        for i in range(REQUESTS_PER_WORKER * workers):
            inputs = demo_inputs(batch, rows, seed=batch + i)
            request = harness.predict_request("", MODEL_NAME, inputs)
            values = harness.answer_values(request, harness.call(target, request))
            if values.shape[:1] != (batch,):
                raise RuntimeError(f"{target} answered shape {values.shape} to a batch of {batch}")
            sent += 1
    return sent


def run_pool(
    config: str,
    model_base: Path,
    rows: int,
    workers: int,
    round_: int,
    log_root: Path,
    env: dict[str, str],
) -> dict[str, Any]:
    """Start one pool, wait for READY, exercise it, measure it, stop it, check the leftovers."""
    label = f"{config}-{workers}w-r{round_}"
    # A port known at spawn, so the first answer is asked for from then on, as the
    # one-process server's is (the last --port given wins over the harness's 0).
    port = _free_port()
    extra = ["--shutdown-delay", "0", "--port", str(port)]
    if config == "plain":
        extra.append("--no-share-weights")
    boot = _boot_time()
    record: dict[str, Any] = {
        "config": config,
        "rows": rows,
        "workers": workers,
        "round": round_,
        "load_average": os.getloadavg()[0],
    }
    pool = MemoryPool(model_base, workers, log_root / label, env, label=label, extra_args=extra)
    given_up = threading.Event()
    with pool, concurrent.futures.ThreadPoolExecutor(1) as asker:
        # Spawn → first correct answer, asked every FIRST_ANSWER_POLL_S from the spawn on:
        # the front door holds a request until a worker is READY, so the first READY worker
        # answers it while the others may still be starting.
        first = asker.submit(
            wait_first_answer,
            f"127.0.0.1:{port}",
            first_answer_request(rows),
            pool.spawned_at,
            given_up,
        )
        try:
            pool.wait_ready()
        except BaseException:
            given_up.set()  # else the executor's exit would wait out the asker's timeout
            raise
        seen_all_ready = time.time()
        record["target"] = pool.target
        record["spawn_to_first_answer_s"], record["first_answer"] = first.result()
        record["pool_id"] = pool.pool_id
        # Peak RSS through start-up (load, bind, warm-up), before requests touch table rows:
        # a transient copy of the weights would show here; rows read while serving are
        # shared pages, which RSS counts too, so later readings say nothing about copies.
        start_hwm = {proc.pid: peak_rss(proc.pid) for proc in pool.roles["workers"]}
        record["requests"] = exercise(pool.target, rows, workers)
        status = settled_status(pool, record["requests"])
        slots = {s["pid"]: s for s in status["slots"]}
        memory: dict[str, list[dict[str, Any]]] = {}
        for role, procs in pool.roles.items():
            memory[role] = []
            for proc in procs:
                entry = memory_of(proc)
                if proc.pid in start_hwm:
                    entry["hwm_at_ready"] = start_hwm[proc.pid]
                slot = slots.get(proc.pid)
                if slot is not None:
                    entry.update(
                        slot=slot["slot"],
                        served=slot["served"],
                        restarts=slot["restarts"],
                        weights=slot["weights"],
                    )
                memory[role].append(entry)
        memory["workers"].sort(key=lambda e: e.get("slot", ""))
        record["memory"] = memory
        ours = {proc.pid for procs in pool.roles.values() for proc in procs}
        record["other_tf_processes"] = tf_mappers(ours)
        segments = sorted(Path("/dev/shm").glob(f"mpspool-{pool.pool_id}-*"))
        record["segment"] = {p.name: p.stat().st_size for p in segments}
        record["segment_bytes"] = sum(record["segment"].values())
        record["alone"] = alone_footprint(list(ours), record["segment_bytes"])
        log = read_controller_log(pool.log_dir)
        cold = []
        for proc in pool.roles["workers"]:
            described = slots.get(proc.pid, {})
            slot = described.get("slot", "")
            born = spawned_at(proc, boot)
            # The controller's log names a slot by its key (placement and version, "cpu-0@1").
            key = slot_key(slot, described.get("version", 0), described.get("model") or "")
            ready_at = log["ready_at"].get(key)
            cold.append(
                {
                    "slot": slot,
                    "pid": proc.pid,
                    "spawn_to_ready_s": ready_at - born if ready_at else math.nan,
                    "spawn_to_seen_ready_s": pool.seen_ready.get(proc.pid, math.nan) - born,
                }
            )
        last_ready = max(log["ready_at"].values(), default=math.nan)
        record["cold_start"] = {
            "pool_s": last_ready - pool.spawned_at,
            "pool_seen_s": seen_all_ready - pool.spawned_at,
            "workers": sorted(cold, key=lambda c: c["slot"]),
        }
        record["publish"] = log["publish"]
    record["leftovers"] = pool.leftovers() + shm_leftovers([pool.pool_id] if pool.pool_id else [])
    return record


def settled_status(pool: MemoryPool, sent: int, timeout_s: float = 3.0) -> dict[str, Any]:
    """Status once the router's counts include the requests just answered (they reach the
    controller in its periodic snapshot), or whatever it says after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        status = pool.status()
        if sum(s["served"] for s in status["slots"]) >= sent or time.monotonic() > deadline:
            return status
        time.sleep(0.2)


def _pool_line(record: dict[str, Any]) -> str:
    workers = record["memory"]["workers"]
    uss = statistics.mean(w["own_uss"] for w in workers) / MIB
    pss = sum(w["pss"] for w in workers) / MIB
    cold = ", ".join(f"{c['spawn_to_ready_s']:.1f}" for c in record["cold_start"]["workers"])
    return (
        f"{record['config']:>7} N={record['workers']} round {record['round']}: "
        f"worker own USS {uss:6.0f} MiB, sum PSS {pss:6.0f} MiB, "
        f"segment {record['segment_bytes'] / MIB:5.0f} MiB; ready in "
        f"{record['cold_start']['pool_s']:.1f} s (workers {cold} s)"
    )


# -- the scenario ---------------------------------------------------------------------
def run_scenario(args: argparse.Namespace, stamp: str) -> dict[str, Any]:
    with frozen_code(args.source) as (source, env):
        return _run_scenario(args, stamp, source, env)


def _run_scenario(
    args: argparse.Namespace, stamp: str, source: dict[str, Any], env: dict[str, str]
) -> dict[str, Any]:
    big = ensure_model(args.rows, env)
    small = ensure_model(SMALL_ROWS, env)
    log_root = OUT_DIR / f"logs-memory-{stamp}"
    report: dict[str, Any] = {
        "scenario": "memory",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": command_line("bench.memory"),
        "machine": machine(),
        "versions": versions(),
        "source": source,
        "settings": {
            "rows": args.rows,
            "small_rows": SMALL_ROWS,
            "model": str(big),
            "small_model": str(small),
            "workers": args.workers,
            "cold_start_workers": COLD_START_WORKERS,
            "cold_start_rounds": args.rounds,
            "requests_per_worker_per_batch": REQUESTS_PER_WORKER,
            "batches": list(BATCHES),
            "quick": args.quick,
        },
        "load_average_start": os.getloadavg(),
    }
    print("memory: the lone TF runtime (no pool running)", file=sys.stderr)
    with LoneRuntime(big / "1", args.rows, log_root / "lone-runtime.log", env) as lone:
        report["lone_runtime"] = lone.measure()
    print(
        f"memory: lone TF runtime: USS {report['lone_runtime']['uss'] / MIB:.0f} MiB, "
        f"PSS {report['lone_runtime']['pss'] / MIB:.0f} MiB",
        file=sys.stderr,
    )
    report["plain_server"] = []
    models = {"runtime": (small, SMALL_ROWS), "shared": (big, args.rows), "plain": (big, args.rows)}
    pools: list[dict[str, Any]] = []

    def run(config: str, workers: int, round_: int) -> None:
        base, rows = models[config]
        record = run_pool(config, base, rows, workers, round_, log_root, env)
        pools.append(record)
        print(f"memory: {_pool_line(record)}", file=sys.stderr)

    def run_server(round_: int) -> None:
        # Beside the cold-start pools of the same round: on a shared machine, start times
        # taken minutes apart compare the load, not the systems.
        server = run_plain_server(big / "1", args.rows, round_, log_root, env)
        report["plain_server"].append(server)
        print(
            f"memory: one-process server round {round_}: PSS "
            f"{server['memory']['pss'] / MIB:.0f} MiB, alone {server['alone'] / MIB:.0f} MiB, "
            f"first answer in {server['spawn_to_first_answer_s']:.1f} s",
            file=sys.stderr,
        )

    for workers in args.workers:
        if workers == COLD_START_WORKERS:
            run_server(0)
        for config in ("runtime", "shared", "plain"):
            run(config, workers, 0)
    # Cold start: the sweep's N = 2 pools are round 0 (small, then big); further rounds
    # alternate the order, so a drift in the machine's load favours neither model.
    first = 1 if COLD_START_WORKERS in args.workers else 0
    for round_ in range(first, args.rounds):
        order = ("shared", "runtime") if round_ % 2 else ("runtime", "shared")
        if round_ % 2 == 0:
            run_server(round_)
        for config in order:
            run(config, COLD_START_WORKERS, round_)
        if round_ % 2:
            run_server(round_)
    report["load_average_end"] = os.getloadavg()
    report["pools"] = pools
    report["leftovers"] = [item for p in pools for item in p["leftovers"]]
    report["summary"] = summarise(report)
    return report


# -- the numbers the targets name -----------------------------------------------------
def _mean(values: list[float]) -> float:
    return statistics.mean(values) if values else math.nan


def _ratio(a: float, b: float) -> float:
    return a / b if b and not math.isnan(b) else math.nan


def summarise(report: dict[str, Any]) -> dict[str, Any]:
    settings = report["settings"]
    sweep = {(p["config"], p["workers"]): p for p in report["pools"] if p["round"] == 0}
    per_n: dict[str, dict[str, Any]] = {}
    for n in settings["workers"]:
        row: dict[str, Any] = {}
        for config in CONFIGS:
            pool = sweep.get((config, n))
            if pool is None:
                continue
            w = pool["memory"]["workers"]
            pss_sum = sum(x["pss"] for x in w)
            touched = sum(x["segment_pss"] for x in w)
            row[config] = {
                "uss_mean": _mean([x["uss"] for x in w]),
                "own_uss_mean": _mean([x["own_uss"] for x in w]),
                "own_uss_max": max(x["own_uss"] for x in w),
                "hwm_mean": _mean([x.get("hwm_at_ready", 0) for x in w]),
                "pss_mean": _mean([x["pss"] for x in w]),
                "pss_outside_segment_mean": _mean([x["pss_outside_segment"] for x in w]),
                "pss_sum": pss_sum,
                "segment_touched": touched,
                "segment_bytes": pool["segment_bytes"],
                # The whole segment charged once, touched or not.
                "footprint": pss_sum - touched + pool["segment_bytes"],
                "router_pss": sum(x["pss"] for x in pool["memory"]["router"]),
                "control_pss": sum(x["pss"] for x in pool["memory"]["control"]),
            }
        if "runtime" in row and "shared" in row:
            row["added_worker_ratio"] = _ratio(
                row["shared"]["own_uss_mean"], row["runtime"]["own_uss_mean"]
            )
            row["added_worker_ratio_uss"] = _ratio(
                row["shared"]["uss_mean"], row["runtime"]["uss_mean"]
            )
        if "plain" in row and "shared" in row:
            row["plain_over_shared"] = _ratio(row["plain"]["footprint"], row["shared"]["footprint"])
            row["saved_bytes"] = row["plain"]["footprint"] - row["shared"]["footprint"]
        per_n[str(n)] = row
    # What one more worker adds to the pool: the footprint's step from N - 1 to N.
    sizes = sorted(settings["workers"])
    for before, n in itertools.pairwise(sizes):
        if n != before + 1:
            continue
        row, prev = per_n[str(n)], per_n[str(before)]
        row["added_worker_bytes"] = {
            config: row[config]["footprint"] - prev[config]["footprint"]
            for config in CONFIGS
            if config in row and config in prev
        }

    cold: dict[str, Any] = {}
    for config in ("runtime", "shared"):
        chosen = [
            p
            for p in report["pools"]
            if p["config"] == config and p["workers"] == settings["cold_start_workers"]
        ]
        workers = [c["spawn_to_ready_s"] for p in chosen for c in p["cold_start"]["workers"]]
        cold[config] = {
            "worker_s": workers,
            "worker_median_s": statistics.median(workers) if workers else math.nan,
            "pool_s": [p["cold_start"]["pool_s"] for p in chosen],
            "pool_median_s": (
                statistics.median(p["cold_start"]["pool_s"] for p in chosen) if chosen else math.nan
            ),
            "publish_s": [p["publish"]["controller_s"] for p in chosen if p["publish"]],
        }
    cold["ratio"] = _ratio(cold["shared"]["worker_median_s"], cold["runtime"]["worker_median_s"])
    # Each round's two pools ran seconds apart; their ratio shows how much of the spread is the
    # machine's load rather than the model.
    cold["rounds"] = []
    for round_ in range(settings["cold_start_rounds"]):
        pair = {
            p["config"]: p
            for p in report["pools"]
            if p["round"] == round_ and p["workers"] == settings["cold_start_workers"]
        }
        if "runtime" in pair and "shared" in pair:
            medians = {
                config: statistics.median(
                    c["spawn_to_ready_s"] for c in pair[config]["cold_start"]["workers"]
                )
                for config in ("runtime", "shared")
            }
            cold["rounds"].append(
                {
                    "round": round_,
                    "order": sorted(pair, key=lambda c: report["pools"].index(pair[c])),
                    "runtime_s": medians["runtime"],
                    "shared_s": medians["shared"],
                    "ratio": _ratio(medians["shared"], medians["runtime"]),
                }
            )
    cold["pool_ratio"] = _ratio(cold["shared"]["pool_median_s"], cold["runtime"]["pool_median_s"])

    targets = []
    ratios = {n: r["added_worker_ratio"] for n, r in per_n.items() if "added_worker_ratio" in r}
    if ratios:
        worst_n = max(ratios, key=lambda n: ratios[n])
        targets.append(
            {
                "target": f"an added worker ≤ {TARGET_ADDED_WORKER:.2f}× the TF runtime's USS "
                f"(own USS, shared vs runtime-only, same N; worst N = {worst_n})",
                "measured": ratios[worst_n],
                "unit": "×",
                "met": ratios[worst_n] <= TARGET_ADDED_WORKER,
            }
        )
    top = str(max(settings["workers"]))
    row = per_n.get(top, {})
    if "shared" in row and "runtime" in row:
        factor = TARGET_RUNTIMES_PER_WORKER * int(top)
        runtime = row["runtime"]["pss_outside_segment_mean"]
        bound = row["shared"]["segment_bytes"] + factor * runtime
        measured = row["shared"]["footprint"]
        targets.append(
            {
                "target": f"PSS({top} workers) ≤ weights + {factor:.1f}× runtime "
                f"({row['shared']['segment_bytes'] / MIB:,.0f} + {factor:.1f} × "
                f"{runtime / MIB:,.0f} = {bound / MIB:,.0f} MiB; measured: the workers' PSS "
                f"outside the segment + the whole segment)",
                "measured": measured / MIB,
                "unit": "MiB",
                "met": measured <= bound,
                "bound": bound / MIB,
            }
        )
    if not math.isnan(cold["ratio"]):
        targets.append(
            {
                "target": f"worker cold start {settings['rows'] * 256 / MIB:,.0f} MiB / "
                f"{_size(SMALL_ROWS * 256)} model ≤ {TARGET_COLD_START:.2f} "
                f"(median spawn → READY, N = {settings['cold_start_workers']}, "
                f"{settings['cold_start_rounds']} rounds)",
                "measured": cold["ratio"],
                "unit": "×",
                "met": cold["ratio"] <= TARGET_COLD_START,
            }
        )
    server = summarise_plain_server(report, per_n)
    targets += server.pop("targets")
    return {
        "per_n": per_n,
        "cold_start": cold,
        "plain_server": server,
        "targets": targets,
        "oddities": oddities(report),
    }


def _same_answer(got: list[float] | None, want: list[float]) -> bool:
    """The issue's tolerance for "the same answer": max abs diff ≤ 1e-6."""
    return (
        got is not None
        and len(got) == len(want)
        and all(abs(a - b) <= 1e-6 for a, b in zip(got, want, strict=True))
    )


def summarise_plain_server(report: dict[str, Any], per_n: dict[str, Any]) -> dict[str, Any]:
    """The shared pools against the one-process server, and the start-up peak: the targets of
    shared weights for the models people export."""
    settings = report["settings"]
    runs = report.get("plain_server") or []
    out: dict[str, Any] = {"targets": [], "pool_over_server": {}}
    targets = out["targets"]
    peaks = {
        n: (r["shared"]["hwm_mean"] - r["runtime"]["hwm_mean"]) / r["shared"]["segment_bytes"]
        for n, r in per_n.items()
        if "shared" in r and "runtime" in r and r["shared"]["segment_bytes"]
    }
    if peaks:
        worst = max(peaks, key=lambda n: peaks[n])
        targets.append(
            {
                "target": "peak RSS (VmHWM at READY) of a shared-weights worker ≤ the "
                f"runtime-only worker's + {TARGET_START_PEAK:.0%} of the table (worst N = "
                f"{worst}; measured: the excess as a share of the table)",
                "measured": peaks[worst] * 100,
                "unit": "%",
                "met": peaks[worst] <= TARGET_START_PEAK,
            }
        )
    if not runs:
        return out
    server_pss = _mean([r["memory"]["pss"] for r in runs])
    server_alone = _mean([r["alone"] for r in runs])
    server_first = statistics.median(r["spawn_to_first_answer_s"] for r in runs)
    out.update(pss=server_pss, alone=server_alone, first_answer_median_s=server_first)
    sweep = {
        p["workers"]: p for p in report["pools"] if p["config"] == "shared" and p["round"] == 0
    }
    reference = runs[0]["first_answer"]
    wrong = [
        f"{p['config']} N={p['workers']} round {p['round']}"
        for p in report["pools"]
        if p["rows"] == settings["rows"] and not _same_answer(p.get("first_answer"), reference)
    ]
    wrong += [
        f"server round {r['round']}" for r in runs if not _same_answer(r["first_answer"], reference)
    ]
    out["wrong_answers"] = wrong
    for n, limit in TARGET_POOL_PSS.items():
        row = per_n.get(str(n), {})
        if "shared" not in row:
            continue
        total = row["shared"]["footprint"] + row["shared"]["router_pss"]
        total += row["shared"]["control_pss"]
        alone = sweep[n]["alone"] if n in sweep else math.nan
        ratio = _ratio(alone, server_alone)
        out["pool_over_server"][str(n)] = {
            "pool_pss": total,
            "pss_ratio": _ratio(total, server_pss),
            "pool_alone": alone,
            "ratio": ratio,
        }
        targets.append(
            {
                "target": f"total memory of a {n}-worker pool ≤ {limit}× the one-process "
                f"server's, each as if alone on the machine ({alone / MIB:,.0f} vs "
                f"{server_alone / MIB:,.0f} MiB: every process of the pool, the whole segment; "
                f"by PSS as measured: {total / MIB:,.0f} vs {server_pss / MIB:,.0f} MiB, "
                f"{_ratio(total, server_pss):.2f}×)",
                "measured": ratio,
                "unit": "×",
                "met": ratio <= limit,
            }
        )
    firsts = [
        p["spawn_to_first_answer_s"]
        for p in report["pools"]
        if p["config"] == "shared" and p["workers"] == settings["cold_start_workers"]
    ]
    if firsts:
        pool_first = statistics.median(firsts)
        ratio = _ratio(pool_first, server_first)
        out.update(pool_first_answer_median_s=pool_first, first_answer_ratio=ratio)
        targets.append(
            {
                "target": f"spawn → first correct answer, {settings['cold_start_workers']}-worker "
                f"pool ≤ {TARGET_FIRST_ANSWER}× the one-process server's (medians "
                f"{pool_first:.1f} s vs {server_first:.1f} s; both asked from their spawn on)",
                "measured": ratio,
                "unit": "×",
                "met": ratio <= TARGET_FIRST_ANSWER and not wrong,
            }
        )
    return out


def oddities(report: dict[str, Any]) -> list[str]:
    """What a reader should know about: copied weights, restarts, idle workers."""
    found = []
    for r in report.get("plain_server") or []:
        if r.get("other_tf_processes"):
            found.append(
                f"the one-process server (round {r['round']}) was measured while other "
                f"processes mapped TensorFlow: {r['other_tf_processes']}"
            )
    lone = report["lone_runtime"].get("other_tf_processes")
    if lone:
        found.append(
            f"the lone runtime was measured while other processes mapped TensorFlow: {lone}"
        )
    for p in report["pools"]:
        where = f"{p['config']} N={p['workers']} round {p['round']}"
        if p.get("other_tf_processes"):
            found.append(
                f"{where}: measured while other processes mapped TensorFlow: "
                f"{p['other_tf_processes']}"
            )
        for w in p["memory"]["workers"]:
            weights = w.get("weights")
            if p["config"] != "plain" and not weights:
                found.append(f"{where}: {w.get('slot')} reports no shared weights")
            if weights and weights.get("copied"):
                copied = sum(weights["copied"].values()) / MIB
                found.append(f"{where}: {w.get('slot')} COPIED {copied:.1f} MiB of its weights")
            if w.get("restarts"):
                found.append(f"{where}: {w.get('slot')} restarted {w['restarts']}×")
            if not w.get("served"):
                found.append(f"{where}: {w.get('slot')} answered no request before measuring")
            if w.get("swap"):
                found.append(f"{where}: {w.get('slot')} has {w['swap'] / MIB:.0f} MiB in swap")
    return found


# -- RESULTS.md -----------------------------------------------------------------------
def _m(value: float, digits: int = 0) -> str:
    """Bytes as MiB."""
    return "–" if value is None or math.isnan(value) else f"{value / MIB:,.{digits}f}"


def _size(nbytes: float) -> str:
    """A model's weights, in the unit that shows them (the reference model has 25 KiB)."""
    return f"{nbytes / MIB:,.0f} MiB" if nbytes >= MIB else f"{nbytes / 1024:,.0f} KiB"


def _x(value: float, digits: int = 2) -> str:
    return "–" if value is None or math.isnan(value) else f"{value:,.{digits}f}"


def render_markdown(report: dict[str, Any], json_path: Path) -> str:
    """The memory section of RESULTS.md, markers included."""
    m, v, s = report["machine"], report["versions"], report["settings"]
    summary, lone = report["summary"], report["lone_runtime"]
    big_mib = s["rows"] * 256 / MIB
    small = _size(s["small_rows"] * 256)
    lines = [
        BEGIN_MARK,
        "## Memory: N workers with shared weights vs plain loading vs the TF runtime alone",
        "",
        f"- **Date:** {report['date']}",
        f"- **Command:** `{report['command']}` (from the repository root)",
        f"- **Machine:** {m['cpu_model']}, {m['usable_cores']} usable cores "
        f"({m['logical_cpus']} logical), {m['memory_gib']} GiB, Linux {m['kernel']}; shared and "
        f"noisy (load average {report['load_average_start'][0]:.2f} at start, "
        f"{report['load_average_end'][0]:.2f} at end)",
        f"- **Versions:** TensorFlow {v.get('tensorflow-cpu', v.get('tensorflow', '?'))}, "
        f"psutil {psutil.__version__}, Python {v['python']}",
        f"- **Models:** demo, {s['rows']:,} embedding rows ({big_mib:,.0f} MiB of weights) and "
        f"{s['small_rows']:,} rows ({small}, the runtime-only reference)",
        f"- **Each pool:** started alone, measured once READY and after "
        f"{s['requests_per_worker_per_batch']} requests per worker at batch "
        f"{' and '.join(str(b) for b in s['batches'])}; then stopped and checked for leftovers",
        f"- **Code under test:** {_describe_source(report['source'])}",
        f"- **Raw results:** `{json_path.relative_to(REPO)}`"
        + (f"; run took {report['wall_s']:.0f} s" if "wall_s" in report else ""),
        "",
        "USS and PSS from psutil's `memory_full_info()`. A page of TensorFlow's shared "
        "libraries mapped by one process only is private to it, so USS depends on N: the "
        "runtime-only reference is a pool of the same N serving the "
        f"{small} model. *Own USS* is USS less the weight-segment pages the "
        "worker happens to be the only one to map (pages of /dev/shm, there whether it "
        "runs or not; its copy-on-write copies stay counted). *Footprint* charges the segment "
        "once and whole: the workers' PSS outside the segment plus the segment's size. "
        "Plain-load workers have no segment: their footprint is their PSS. *+1 worker* is the "
        "footprint's step from N − 1 to N workers (runtime-only: Σ PSS).",
        "",
        "### Targets",
        "",
        "| Target | Measured | Met |",
        "|---|---:|:---:|",
    ]
    for t in summary["targets"]:
        digits = 0 if t["unit"] == "MiB" else 2
        lines.append(
            f"| {t['target']} | {_x(t['measured'], digits)} {t['unit']} | "
            f"{'yes' if t['met'] else '**no**'} |"
        )
    lines += [
        "",
        "### Per worker (MiB, mean over the N workers)",
        "",
        "| N | runtime-only own USS | shared own USS | shared USS | plain USS "
        "| shared / runtime (own USS) | runtime-only PSS | shared PSS | plain PSS |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    nan = {
        key: math.nan
        for key in ("own_uss_mean", "uss_mean", "pss_mean", "pss_sum", "footprint", "router_pss")
    }
    nan.update(segment_bytes=math.nan, segment_touched=math.nan, control_pss=math.nan)
    for n in s["workers"]:
        row = summary["per_n"][str(n)]
        rt, sh, pl = (row.get(c, nan) for c in ("runtime", "shared", "plain"))
        lines.append(
            f"| {n} | {_m(rt['own_uss_mean'])} | {_m(sh['own_uss_mean'])} | "
            f"{_m(sh['uss_mean'])} | {_m(pl['uss_mean'])} | "
            f"{_x(row.get('added_worker_ratio', math.nan))} | {_m(rt['pss_mean'])} | "
            f"{_m(sh['pss_mean'])} | {_m(pl['pss_mean'])} |"
        )
    lines += [
        "",
        "### Whole pool (MiB)",
        "",
        "| N | runtime-only Σ PSS | shared Σ PSS | segment | of it touched | shared footprint "
        "| plain Σ PSS | plain / shared | saved | +1 worker: runtime-only / shared / plain "
        "| router PSS | controller + supervisord PSS |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n in s["workers"]:
        row = summary["per_n"][str(n)]
        rt, sh, pl = (row.get(c, nan) for c in ("runtime", "shared", "plain"))
        step = row.get("added_worker_bytes", {})
        added = (
            " / ".join(_m(step.get(c, math.nan)) for c in ("runtime", "shared", "plain"))
            if step
            else "–"
        )
        lines.append(
            f"| {n} | {_m(rt['pss_sum'])} | {_m(sh['pss_sum'])} | {_m(sh['segment_bytes'])} | "
            f"{_m(sh['segment_touched'])} | {_m(sh['footprint'])} | {_m(pl['pss_sum'])} | "
            f"{_x(row.get('plain_over_shared', math.nan))} | "
            f"{_m(row.get('saved_bytes', math.nan))} | {added} | {_m(sh['router_pss'])} | "
            f"{_m(sh['control_pss'])} |"
        )
    peaks = []
    for n in s["workers"]:
        row = summary["per_n"][str(n)]
        if "runtime" in row and "shared" in row:
            extra = row["shared"]["hwm_mean"] - row["runtime"]["hwm_mean"]
            peaks.append(
                f"N={n}: {_m(row['shared']['hwm_mean'])} vs {_m(row['runtime']['hwm_mean'])} "
                f"(+{_m(extra)}, "
                f"{extra / max(1, row['shared']['segment_bytes']) * 100:.1f}% of the segment)"
            )
    lines += [
        "",
        "**Peak RSS (VmHWM) of a worker through start-up, shared weights vs runtime-only, "
        "MiB** (read when every worker is READY, before any request; a transient copy of the "
        "table at load, bind or warm-up would show here): "
        + "; ".join(peaks)
        + ". Target: ≤ runtime + 5% of the table.",
    ]
    in_pool = ", ".join(
        f"N={n} {_m(summary['per_n'][str(n)]['runtime']['own_uss_mean'])}"
        for n in s["workers"]
        if "runtime" in summary["per_n"][str(n)]
    )
    lines += [
        "",
        f"**The TF runtime alone:** one process, the {big_mib:,.0f} MiB SavedModel loaded "
        "with `experimental_skip_checkpoint=True` (graph and functions, no weights) and "
        f"called once, no pool running: USS {_m(lone['uss'])} MiB, PSS {_m(lone['pss'])} MiB, "
        f"RSS {_m(lone['rss'])} MiB. In a pool, per worker (runtime-only own USS): {in_pool} MiB.",
    ]
    lines += server_section(report)
    cold = summary["cold_start"]
    lines += [
        "",
        f"### Cold start (N = {s['cold_start_workers']}, weights shared, "
        f"{s['cold_start_rounds']} rounds alternating; seconds)",
        "",
        "| Round | Model | load avg | worker spawn → READY (each) | pool spawn → all READY "
        "| publish |",
        "|---:|---|---:|---|---:|---:|",
    ]
    for p in report["pools"]:
        if p["workers"] != s["cold_start_workers"] or p["config"] == "plain":
            continue
        workers = ", ".join(_x(c["spawn_to_ready_s"], 1) for c in p["cold_start"]["workers"])
        pub = p["publish"] or {}
        lines.append(
            f"| {p['round']} | {_size(p['rows'] * 256)} | "
            f"{_x(p.get('load_average', math.nan), 1)} | {workers} | "
            f"{_x(p['cold_start']['pool_s'], 1)} | {_x(pub.get('controller_s', math.nan), 1)} |"
        )
    per_round = ", ".join(f"round {r['round']} {_x(r['ratio'])}" for r in cold["rounds"])
    lines += [
        "",
        f"Medians over every worker of every round: {_x(cold['shared']['worker_median_s'], 1)} s "
        f"({big_mib:,.0f} MiB) vs {_x(cold['runtime']['worker_median_s'], 1)} s "
        f"({small}), ratio {_x(cold['ratio'])}; per round (pools seconds apart): "
        f"{per_round}. Whole pool (publishing included): {_x(cold['shared']['pool_median_s'], 1)}"
        f" s vs {_x(cold['runtime']['pool_median_s'], 1)} s, ratio {_x(cold['pool_ratio'])}. "
        "A worker's cold start runs from its process's creation to the controller's READY "
        "line; both workers start together and share the cores.",
        "",
        "### Publishing (shared pools)",
        "",
        "| Model | N | round | publish (controller, s) | publisher (s) | tensors | MiB "
        "| publisher peak RSS MiB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for p in report["pools"]:
        pub = p["publish"]
        if not pub:
            continue
        lines.append(
            f"| {_size(p['rows'] * 256)} | {p['workers']} | {p['round']} | "
            f"{_x(pub['controller_s'], 1)} | {_x(pub.get('publisher_s', math.nan), 1)} | "
            f"{pub.get('tensors', '–')} | {_x(pub['mib'], 1)} | "
            f"{pub.get('publisher_peak_rss_mib', '–')} |"
        )
    lines += [
        "",
        "The publisher's peak RSS counts the segment pages it writes through its own mapping "
        "of /dev/shm (shared, not a copy) on top of the TF runtime it imports.",
        "",
        "### Reading",
        "",
        *reading(report),
    ]
    if summary["oddities"]:
        lines += ["", "**Oddities:** " + "; ".join(summary["oddities"])]
    if report["leftovers"]:
        lines += ["", "**Left behind after the run:** " + "; ".join(report["leftovers"])]
    lines.append(END_MARK)
    return "\n".join(lines) + "\n"


def server_section(report: dict[str, Any]) -> list[str]:
    """The one-process server's runs and the pools against it."""
    runs = report.get("plain_server") or []
    server = report["summary"].get("plain_server") or {}
    if not runs:
        return []
    lines = [
        "",
        "### Against a one-process server (`bench/peers/plain.py`, the same model loaded "
        "plainly, TF Serving's Predict API)",
        "",
        "| Round | load avg | spawn → first correct answer (s) | PSS | USS | alone | VmHWM at "
        "first answer (MiB) |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in runs:
        lines.append(
            f"| {r['round']} | {_x(r['load_average'], 1)} | "
            f"{_x(r['spawn_to_first_answer_s'], 1)} | {_m(r['memory']['pss'])} | "
            f"{_m(r['memory']['uss'])} | {_m(r['alone'])} | {_m(r['hwm_at_first_answer'])} |"
        )
    ratios = ", ".join(
        f"N={n}: {_m(v['pool_alone'])} MiB alone ({_x(v['ratio'])}×), {_m(v['pool_pss'])} MiB "
        f"by PSS ({_x(v['pss_ratio'])}×)"
        for n, v in server.get("pool_over_server", {}).items()
    )
    firsts = [
        f"{p['config']} N={p['workers']} r{p['round']} {_x(p['spawn_to_first_answer_s'], 1)}"
        for p in report["pools"]
        if "spawn_to_first_answer_s" in p
    ]
    wrong = server.get("wrong_answers") or []
    lines += [
        "",
        "*Alone* is what a group of processes would occupy with nothing else running: private "
        "pages, each mapped file's shared pages once, the weight segment whole (PSS splits "
        "TensorFlow's library pages with every other process mapping them, this benchmark's own "
        "and other tenants' included). Shared pools against the server's "
        f"{_m(server.get('alone', math.nan))} MiB alone ({_m(server.get('pss', math.nan))} MiB "
        f"PSS): {ratios}. Spawn → first correct answer of every pool, asked from its spawn on "
        f"as the server's (s): {', '.join(firsts)}. "
        + (
            f"**Answers differing from the server's (max abs diff > 1e-6): {', '.join(wrong)}.**"
            if wrong
            else "Every answer to the first request equals the server's (max abs diff ≤ 1e-6)."
        ),
    ]
    return lines


def _span(values: list[float], signed: bool = False) -> str:
    """A range of byte counts in MiB ("192" or "190 to 193"; "+0" with ``signed``)."""
    low, high = (f"{round(v / MIB):{'+' if signed else ''},d}" for v in (min(values), max(values)))
    return low if low == high else f"{low} to {high}"


def reading(report: dict[str, Any]) -> list[str]:
    """A few sentences from the numbers themselves, so they cannot drift from the tables."""
    s, summary = report["settings"], report["summary"]
    per_n, cold = summary["per_n"], summary["cold_start"]
    table_mib = s["rows"] * 256 / MIB
    out = []
    full = [n for n in s["workers"] if {"runtime", "shared", "plain"} <= set(per_n[str(n)])]
    if full:
        rows = [per_n[str(n)] for n in full]
        extra = [r["shared"]["own_uss_mean"] - r["runtime"]["own_uss_mean"] for r in rows]
        plain_extra = [r["plain"]["uss_mean"] - r["runtime"]["own_uss_mean"] for r in rows]
        out.append(
            f"- A shared-weights worker's own memory is the runtime-only worker's "
            f"{_span(extra, signed=True)} MiB (N = {full[0]}..{full[-1]}); a plain-load worker "
            f"carries {_span(plain_extra)} MiB more than the runtime: its own copy of the "
            f"{table_mib:,.0f} MiB table and then some."
        )
        steps = [r["added_worker_bytes"] for r in rows if "added_worker_bytes" in r]
        if steps:
            out.append(
                f"- One more worker adds {_span([x['shared'] for x in steps])} MiB to the shared "
                f"pool (runtime-only: {_span([x['runtime'] for x in steps])} MiB) and "
                f"{_span([x['plain'] for x in steps])} MiB to the plain one."
            )
        top = rows[-1]
        out.append(
            f"- At N = {full[-1]} the shared pool's workers take {_m(top['shared']['footprint'])}"
            f" MiB with the segment counted whole, plain loading {_m(top['plain']['footprint'])}"
            f" MiB ({_x(top['plain_over_shared'])}×, {_m(top['saved_bytes'])} MiB saved)."
        )
        first = rows[0]
        out.append(
            f"- Read USS at equal N only: TensorFlow's library pages are private to a process "
            f"that is their only mapper, so the runtime-only worker's own USS is "
            f"{_m(first['runtime']['own_uss_mean'])} MiB at N = {full[0]} and "
            f"{_m(top['runtime']['own_uss_mean'])} MiB at N = {full[-1]} (the lone process: "
            f"{_m(report['lone_runtime']['uss'])} MiB). Likewise psutil's USS of a shared "
            f"worker counts the segment pages only it has touched: "
            f"{_m(first['shared']['uss_mean'])} MiB at N = {full[0]}, which is why the table "
            f"shows own USS."
        )
        touched = [r["shared"]["segment_touched"] / r["shared"]["segment_bytes"] for r in rows]
        out.append(
            f"- After {s['requests_per_worker_per_batch']} requests per worker and batch size, "
            f"{min(touched):.0%} to {max(touched):.0%} of the segment was resident in the "
            f"workers (the kernel maps a fault's neighbouring pages too): shared pages, in PSS "
            f"split between the workers, charged once in the footprint."
        )
    if not math.isnan(cold["ratio"]):
        rounds = [r["ratio"] for r in cold["rounds"]]
        verdict = "within" if cold["ratio"] <= TARGET_COLD_START else "over"
        listed = ", ".join(_x(r) for r in rounds)
        # Noise when the rounds fall on both sides of 1 or spread wider than the difference.
        if min(rounds) <= 1 <= max(rounds) or max(rounds) - min(rounds) >= abs(cold["ratio"] - 1):
            rounds_say = (
                f"but the rounds disagree ({listed}) and absolute times moved with the "
                "machine's load: the difference is of the order of the noise"
            )
        else:
            slower = "slower" if cold["ratio"] > 1 else "faster"
            rounds_say = f"and each round finds it {slower} ({listed})"
        out.append(
            f"- Worker cold start with {table_mib:,.0f} MiB of shared weights is "
            f"{_x(cold['ratio'])}× that with {_size(s['small_rows'] * 256)} "
            f"({verdict} the {TARGET_COLD_START:.2f} target), {rounds_say}. The pool's first "
            f"workers start beside the publisher and wait for its segment only after importing "
            f"TensorFlow, so a bigger table lengthens the pool's start only by what publishing "
            f"takes beyond that import, and by the cores the publisher shares with it."
        )
    out.append(
        "- Memory figures do not depend on the machine's load; they do depend on other "
        "processes mapping the same TensorFlow install (none was seen during the measurements "
        "unless listed under oddities)."
    )
    return out


def write_results_md(path: Path, section: str) -> None:
    """Replace the memory section of ``path`` (or add it), leaving the rest alone."""
    write_section(path, section, BEGIN_MARK, END_MARK)


# -- command line -------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.memory", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--rows", type=int, default=2_000_000, help="embedding rows")
    parser.add_argument(
        "--workers", type=_ints, default=[1, 2, 3, 4], help="pool sizes N (%(default)s)"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=2,
        help=f"cold-start rounds at N = {COLD_START_WORKERS}, alternating (%(default)s)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"smoke run: {QUICK_ROWS:,}-row model, N = 1, 2; RESULTS.md untouched unless "
        "--results",
    )
    add_output_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.rows = QUICK_ROWS if args.rows == 2_000_000 else args.rows
        args.workers = [1, 2] if args.workers == [1, 2, 3, 4] else args.workers
    if args.rows <= SMALL_ROWS:
        print(f"memory: --rows must exceed the reference's {SMALL_ROWS:,}", file=sys.stderr)
        return 2
    return scenario_main(
        "memory",
        args,
        lambda stamp: run_scenario(args, stamp),
        render_markdown,
        notes=lambda report: [f"ODD: {item}" for item in report["summary"]["oddities"]],
        write_results=write_results_md,
    )


if __name__ == "__main__":
    sys.exit(main())
