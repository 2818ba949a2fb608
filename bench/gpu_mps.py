"""GPU scenario: 1 worker vs W workers without MPS vs W workers with MPS, on one GPU.

The question this answers is the one mpspool exists for: does sharing one GPU between several
worker processes through NVIDIA MPS beat both one process and the same processes time-sliced
by the driver? For each configuration and batch size it starts W fresh worker processes (this
same module in ``--worker`` mode), each with ``CUDA_VISIBLE_DEVICES=<uuid>`` like mpspool's
workers, lets them warm up, releases them at one instant (a ``go`` file holding a wall-clock
start time) and has each run a closed loop of inference calls for the duration: copy a batch
host→GPU, forward, copy the scores back, synchronise — what a serving worker does per request.
Meanwhile the parent samples NVML utilisation every 100 ms through mps/gpus.py.

The workers' model is recommendation-shaped (an embedding of 100,000 × 64 mean-pooled over 16
ids, plus 13 dense features, into an MLP 256-128-1), small enough that one process leaves the
GPU mostly idle at batch ≤ 32: exactly where MPS should help. It is built in TensorFlow when
TensorFlow can use the GPU, otherwise in PyTorch (GPU machines often carry PyTorch and a
CPU-only or no TensorFlow); the report says which and why. The weights are the same numbers
in both (drawn with numpy from a fixed seed).

The MPS control daemon is started through mps/control.py (``MpsDaemon``) with its own pipe and
log directories in a private temporary directory, active thread percentage 100 and no pinned
memory limit, and stopped with ``quit``. The no-MPS workers get an empty pipe directory of
their own, so that a system-wide MPS daemon (``/tmp/nvidia-mps``) cannot capture them.

Where there is no GPU (``NoGpuDriver``), the script runs its CPU-side checks — the control
binary is found, a daemon started through ``MpsDaemon`` becomes ready, ``apply_defaults``
round-trips, ``quit`` stops it with exit 0, nothing is left behind — prints
``GPU numbers missing: <reason>`` and exits 0. Without the control binary it exits 1. The
checks also run first on a GPU machine.

    python -m bench.gpu_mps                                   # from the repository root
    python -m bench.gpu_mps --gpu 0 --duration 5 --batches 1,8,32 --workers 4 \\
        --json bench/out/gpu-mps.json --markdown bench/out/gpu-mps.md

Results go only to the ``--json`` and ``--markdown`` paths (the markdown is a section for
bench/RESULTS.md, between markers; merging it is someone else's job). Every process this
starts — workers, framework probes, control daemons and the MPS servers they spawn — is
stopped on every exit path, Ctrl-C and SIGTERM included, and every wait is bounded.

Runs with the repository's venv or with a bare ``python3`` that has PyTorch (mpspool need not
be installed: mps/ is then imported from the checkout; psutil is not needed).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import math
import os
import platform
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

try:
    from mpspool.mps import control, gpus
except ImportError:  # a checkout that is not pip-installed, e.g. a GPU machine's own python3
    from mps import control, gpus  # type: ignore[no-redef]

REPO = Path(__file__).resolve().parent.parent

# Where the driver's utilities usually live when they are not on PATH (containers mount the
# driver under /usr/local/nvidia), and where dev/setup unpacks the binary on machines without
# a driver.
SEARCH_DIRS = (
    "/usr/bin",
    "/usr/local/nvidia/bin",
    "/usr/local/bin",
    str(REPO / ".tools" / "nvidia-cuda-mps" / "usr" / "bin"),
)

# A well-formed UUID that names no GPU: the CPU-side daemon check needs some value for
# CUDA_VISIBLE_DEVICES, as mpspool always sets one.
PLACEHOLDER_UUID = "GPU-00000000-0000-4000-8000-000000000000"

# The model: recommendation-shaped and small.
VOCAB = 100_000
EMB_DIM = 64
IDS_PER_ROW = 16
DENSE = 13
HIDDEN = (256, 128)
DISTINCT_BATCHES = 8  # inputs cycled per worker, so no call repeats the previous one's

# Targets from the issue, checked per batch size ≤ 32.
TARGET_VS_ONE = 2.0
TARGET_VS_NO_MPS = 1.2
TARGET_MAX_BATCH = 32

SAMPLE_PERIOD_S = 0.1
CHECK_DEFAULTS = (25.0, 1024)  # active thread %, pinned MiB: the CPU-side round trip
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_NO_FRAMEWORK = 0, 1, 2, 3


def log(message: str) -> None:
    """Progress on stderr, so that stdout stays the report."""
    print(message, file=sys.stderr, flush=True)


# --- Finding the binary ------------------------------------------------------------------------


def locate_control_binary(explicit: str | None) -> tuple[str | None, str]:
    """(path, how it was found) or (None, why not).

    mps/control.find_control_binary() covers an explicit path, $MPSPOOL_MPS_CONTROL and PATH;
    a GPU machine's shell often lacks the driver's bin directory on PATH, so the usual places
    are searched after it. An explicit path or variable that is wrong is an error, not a reason
    to search: the user asked for that binary.
    """
    try:
        found = control.find_control_binary(explicit)
        how = (
            "--mps-control"
            if explicit
            else (f"${control.BINARY_ENV}" if os.environ.get(control.BINARY_ENV) else "PATH")
        )
        return found, how
    except control.MpsError as e:
        if explicit or os.environ.get(control.BINARY_ENV):
            return None, str(e)
        reason = str(e)
    for directory in SEARCH_DIRS:
        candidate = os.path.join(directory, control.CONTROL_BINARY)
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate, f"searched {directory}"
    return None, f"{reason}; not in {', '.join(SEARCH_DIRS)} either"


# --- Processes: starting, stopping, and proving nothing is left -------------------------------


class Terminated(Exception):
    """SIGTERM or SIGHUP arrived: unwind through the finally blocks like Ctrl-C does."""


def _raise_terminated(signum: int, _frame: FrameType | None) -> None:
    raise Terminated(f"signal {signum}")


def processes_under(base: Path) -> list[int]:
    """Pids of processes whose CUDA_MPS_PIPE_DIRECTORY lies under `base`.

    Every process this script starts gets such a directory (the daemons and the MPS servers
    they fork, the workers, the probes), so this finds them wherever they were reparented,
    without psutil. /proc/<pid>/environ is the environment at exec, which is what we set.
    """
    prefix = str(base)
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            raw = Path("/proc", entry, "environ").read_bytes()
        except OSError:
            continue  # gone, or another user's
        for item in raw.split(b"\0"):
            if item.startswith(b"CUDA_MPS_PIPE_DIRECTORY="):
                value = item.split(b"=", 1)[1].decode(errors="replace")
                if value == prefix or value.startswith(prefix + "/"):
                    found.append(int(entry))
                break
    return found


def sweep(base: Path, timeout_s: float = 5.0) -> list[int]:
    """SIGKILL whatever `processes_under(base)` finds and wait (bounded) until it is gone.

    The last line of defence: the normal paths stop everything themselves, so on a clean run
    this returns [].
    """
    pids = processes_under(base)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and processes_under(base):
        time.sleep(0.05)
    return pids


def stop_process(proc: subprocess.Popen[bytes], grace_s: float = 5.0) -> None:
    """SIGTERM the process's group (each was started in its own session), then SIGKILL."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace_s)
        return
    except subprocess.TimeoutExpired:
        pass
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(grace_s)


def tail(path: Path, lines: int = 15) -> str:
    """The end of a log file, for an error message that explains itself."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.strip().splitlines()[-lines:])


def stop_daemon(daemon: control.MpsDaemon, proc: subprocess.Popen[bytes]) -> int | None:
    """`quit` (which also ends the MPS server it spawned), then SIGKILL if it lingers.

    Returns the daemon's exit status (None if it had to be killed and did not exit).
    """
    if proc.poll() is None:
        try:
            daemon.quit()
        except control.MpsError as e:
            log(f"  quit failed ({e}); killing the daemon")
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            log("  the daemon did not exit within 10 s of quit; killing it")
            stop_process(proc, grace_s=2.0)
    return proc.poll()


def start_daemon(daemon: control.MpsDaemon, log_path: Path) -> subprocess.Popen[bytes]:
    """Start the control daemon in the foreground (``-f``, as mpspool's supervisord does) in
    its own session, and wait until it answers; the caller stops it (stop_daemon)."""
    daemon.prepare_dirs()
    with open(log_path, "ab") as out:
        proc = subprocess.Popen(
            daemon.command(),
            env={**os.environ, **daemon.environment()},
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 15.0
        while not daemon.ready():
            if proc.poll() is not None:
                raise control.DaemonDown(
                    f"the control daemon exited with {proc.returncode} before answering: "
                    f"{tail(log_path)}"
                )
            if time.monotonic() > deadline:
                raise control.DaemonDown("the control daemon did not answer within 15 s")
            time.sleep(0.1)
    except BaseException:
        stop_daemon(daemon, proc)
        raise
    return proc


@contextlib.contextmanager
def running_daemon(daemon: control.MpsDaemon, log_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A ready control daemon for the duration of the block, quit (or killed) after it."""
    proc = start_daemon(daemon, log_path)
    try:
        yield proc
    finally:
        stop_daemon(daemon, proc)


# --- CPU-side checks ---------------------------------------------------------------------------


@dataclass
class Check:
    """One CPU-side check and what it showed."""

    name: str
    ok: bool
    detail: str


def parse_mib(text: str) -> float | None:
    """MPS's pinned-memory readback ("1G", "1024M", "512.5M") in MiB; None if unparsable."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGT]?)i?B?\s*", text, re.IGNORECASE)
    if not m:
        return None
    scale = {"": 1 / 2**20, "K": 1 / 1024, "M": 1, "G": 1024, "T": 1024**2}[m.group(2).upper()]
    return float(m.group(1)) * scale


def cpu_checks(binary: str, gpu_index: int, gpu_uuid: str, base: Path) -> list[Check]:
    """Start a control daemon through MpsDaemon, round-trip its defaults, `quit` it.

    These need no GPU (the control daemon starts its MPS server only when a client connects),
    so they show on any machine that mps/ drives the real binary correctly.
    """
    checks = [Check("control binary", True, binary)]
    daemon = control.MpsDaemon(gpu_index, gpu_uuid, binary, base / "pipe", base / "log")
    daemon.prepare_dirs()
    proc: subprocess.Popen[bytes] | None = None
    try:
        checks.append(
            Check(
                "no daemon behind the private pipe directory before start",
                not daemon.ready(),
                str(daemon.pipe_dir),
            )
        )
        t0 = time.monotonic()
        proc = start_daemon(daemon, base / "daemon.log")
        checks.append(
            Check(
                "daemon started through MpsDaemon answers",
                True,
                f"pid {proc.pid}, ready in {time.monotonic() - t0:.2f} s, "
                f"CUDA_VISIBLE_DEVICES={gpu_uuid}",
            )
        )
        pct, mib = CHECK_DEFAULTS
        applied = daemon.apply_defaults(pct, mib)
        got_pct = float(applied["active_thread_percentage"])
        got_mib = parse_mib(applied["pinned_mem_limit"])
        checks.append(
            Check(
                f"apply_defaults({pct:g}, {mib} MiB) round-trips",
                got_pct == pct and got_mib == mib,
                f"read back {applied}",
            )
        )
        servers = daemon.servers()
        checks.append(Check("no MPS server before any client", servers == [], f"{servers}"))
        daemon.quit()
        try:
            rc: int | None = proc.wait(10)
        except subprocess.TimeoutExpired:
            rc = None
        checks.append(
            Check(
                "quit stops the daemon with exit 0",
                rc == 0 and not daemon.ready(),
                f"exit status {rc}",
            )
        )
    except (control.MpsError, OSError, KeyError, ValueError) as e:
        checks.append(Check("daemon round trip", False, f"{type(e).__name__}: {e}"))
    finally:
        if proc is not None:
            stop_daemon(daemon, proc)
        leftover = sweep(base)
        checks.append(
            Check(
                "no process left behind",
                not leftover,
                f"killed {leftover}" if leftover else "none found",
            )
        )
    return checks


# --- The worker side (runs in the worker processes) -------------------------------------------


def model_weights(seed: int) -> tuple[Any, list[tuple[Any, Any]]]:
    """The embedding table and (W, b) of each dense layer, as float32 numpy arrays."""
    import numpy as np

    rng = np.random.default_rng(seed)
    table = rng.normal(0.0, 0.05, (VOCAB, EMB_DIM)).astype(np.float32)
    layers = []
    fan_in = EMB_DIM + DENSE
    for width in (*HIDDEN, 1):
        w = rng.normal(0.0, math.sqrt(2.0 / fan_in), (fan_in, width)).astype(np.float32)
        layers.append((w, np.zeros(width, np.float32)))
        fan_in = width
    return table, layers


def model_inputs(batch: int, seed: int) -> list[tuple[Any, Any]]:
    """DISTINCT_BATCHES (ids int64 [B, 16], dense float32 [B, 13]) pairs, on the host."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return [
        (
            rng.integers(0, VOCAB, (batch, IDS_PER_ROW), dtype=np.int64),
            rng.normal(0.0, 1.0, (batch, DENSE)).astype(np.float32),
        )
        for _ in range(DISTINCT_BATCHES)
    ]


def torch_model(batch: int, seed: int) -> tuple[Callable[[int], None], str]:
    """A PyTorch call(i): inputs[i] host→GPU, forward, scores back, synchronise."""
    import torch
    import torch.nn.functional as F

    if not torch.cuda.is_available():
        raise RuntimeError(f"torch {torch.__version__}: torch.cuda.is_available() is False")
    dev = torch.device("cuda", 0)
    table, layers = model_weights(seed)
    emb = torch.from_numpy(table).to(dev)
    params = [(torch.from_numpy(w).to(dev), torch.from_numpy(b).to(dev)) for w, b in layers]
    inputs = [(torch.from_numpy(i), torch.from_numpy(d)) for i, d in model_inputs(batch, seed)]

    def forward(ids: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        x = torch.cat([F.embedding_bag(ids, emb, mode="mean"), dense], dim=1)
        for k, (w, b) in enumerate(params):
            x = x @ w + b
            x = torch.relu(x) if k < len(params) - 1 else torch.sigmoid(x)
        return x

    def call(i: int) -> None:
        ids, dense = inputs[i % len(inputs)]
        with torch.inference_mode():
            forward(ids.to(dev), dense.to(dev)).cpu()
        torch.cuda.synchronize()

    return call, f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}"


def tensorflow_model(batch: int, seed: int) -> tuple[Callable[[int], None], str]:
    """The same model in TensorFlow: memory growth on (else each worker would reserve the
    whole GPU), one traced function, numpy in and out (``.numpy()`` waits for the GPU)."""
    import tensorflow as tf

    devices = tf.config.list_physical_devices("GPU")
    if not devices:
        raise RuntimeError(f"TensorFlow {tf.__version__} sees no GPU")
    for device in devices:
        tf.config.experimental.set_memory_growth(device, True)
    table, layers = model_weights(seed)
    with tf.device("/GPU:0"):
        emb = tf.constant(table)
        params = [(tf.constant(w), tf.constant(b)) for w, b in layers]
    inputs = model_inputs(batch, seed)

    @tf.function(
        input_signature=[
            tf.TensorSpec([None, IDS_PER_ROW], tf.int64),
            tf.TensorSpec([None, DENSE], tf.float32),
        ]
    )
    def forward(ids: Any, dense: Any) -> Any:
        with tf.device("/GPU:0"):
            x = tf.concat([tf.reduce_mean(tf.gather(emb, ids), axis=1), dense], axis=1)
            for k, (w, b) in enumerate(params):
                x = tf.matmul(x, w) + b
                x = tf.nn.relu(x) if k < len(params) - 1 else tf.sigmoid(x)
            return x

    def call(i: int) -> None:
        ids, dense = inputs[i % len(inputs)]
        forward(ids, dense).numpy()

    return call, f"TensorFlow {tf.__version__}, {devices[0].name}"


def numpy_model(batch: int, seed: int) -> tuple[Callable[[int], None], str]:
    """The same model in numpy on the CPU. Never chosen by ``auto``: it exists so that the
    orchestration (workers, barrier, daemon, NVML sampling, report) can be exercised on a
    machine without a GPU (``--framework numpy`` with MPSPOOL_FAKE_GPUS); its numbers say
    nothing about GPUs."""
    import numpy as np

    table, layers = model_weights(seed)
    inputs = model_inputs(batch, seed)

    def call(i: int) -> None:
        ids, dense = inputs[i % len(inputs)]
        x = np.concatenate([table[ids].mean(axis=1), dense], axis=1)
        for k, (w, b) in enumerate(layers):
            x = x @ w + b
            x = np.maximum(x, 0) if k < len(layers) - 1 else 1 / (1 + np.exp(-x))

    return call, f"numpy {np.__version__} on the CPU (orchestration test, not a GPU number)"


BUILDERS: dict[str, Callable[[int, int], tuple[Callable[[int], None], str]]] = {
    "tensorflow": tensorflow_model,
    "torch": torch_model,
    "numpy": numpy_model,
}


def write_json_atomic(path: Path, data: Any) -> None:
    """Write then rename, so that the reader never sees half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def worker_main(spec: dict[str, Any]) -> int:
    """One worker: build, warm up, report ready, wait for the start time, run the closed loop,
    write counts and latencies. Gives up by itself if the parent dies or never says go."""
    rundir = Path(spec["dir"])
    index = int(spec["index"])
    result_path = rundir / f"result-{index}.json"
    try:
        call, device = BUILDERS[spec["framework"]](int(spec["batch"]), int(spec["seed"]))
        warm_end = time.monotonic() + float(spec["warmup_s"])
        n = 0
        while n < 20 or time.monotonic() < warm_end:
            call(n)
            n += 1
        write_json_atomic(rundir / f"ready-{index}", {"pid": os.getpid(), "device": device})
        go = rundir / "go"
        give_up = time.monotonic() + float(spec["go_timeout_s"])
        while not go.exists():
            if os.getppid() != int(spec["parent_pid"]) or time.monotonic() > give_up:
                raise RuntimeError("no go signal: the parent is gone or gave up")
            time.sleep(0.002)
        start_at = float(json.loads(go.read_text())["start_at"])
        time.sleep(max(0.0, start_at - time.time()))
        end_at = start_at + float(spec["duration_s"])
        latencies: list[float] = []
        perf = time.perf_counter
        i = 0
        while time.time() < end_at:
            t0 = perf()
            call(i)
            latencies.append(perf() - t0)
            i += 1
        elapsed = time.time() - start_at
        write_json_atomic(
            result_path,
            {
                "calls": len(latencies),
                "elapsed_s": elapsed,
                "latencies_ms": [round(x * 1e3, 4) for x in latencies],
                "device": device,
            },
        )
        return 0
    except Exception as e:
        traceback.print_exc()
        with contextlib.suppress(OSError):
            write_json_atomic(result_path, {"error": f"{type(e).__name__}: {e}"})
        return 1


def probe_main(framework: str) -> int:
    """Can `framework` run a kernel on the GPU in CUDA_VISIBLE_DEVICES? One JSON line."""
    info: dict[str, Any] = {"framework": framework, "ok": False}
    try:
        if framework == "numpy":
            info.update(ok=True, why="numpy on the CPU: an orchestration test, not a GPU number")
        elif framework == "tensorflow":
            import tensorflow as tf

            info["version"] = tf.__version__
            devices = tf.config.list_physical_devices("GPU")
            if not devices:
                info["why"] = f"TensorFlow {tf.__version__} is installed but sees no GPU"
            else:
                tf.config.experimental.set_memory_growth(devices[0], True)
                with tf.device("/GPU:0"):
                    float(tf.reduce_sum(tf.ones([4])).numpy())
                info.update(ok=True, why=f"TensorFlow {tf.__version__} runs on the GPU")
        else:
            import torch

            info["version"] = torch.__version__
            if not torch.cuda.is_available():
                info["why"] = f"torch {torch.__version__}: torch.cuda.is_available() is False"
            else:
                float(torch.ones(4, device="cuda").sum().item())
                info.update(
                    ok=True,
                    why=f"torch {torch.__version__} (CUDA {torch.version.cuda}) runs on the GPU",
                    device=torch.cuda.get_device_name(0),
                )
    except Exception as e:  # ImportError, or a CUDA error: both mean "not this framework"
        info["why"] = f"{framework}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    print(json.dumps(info), flush=True)
    return 0


# --- The parent side ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    """One configuration: how many workers, and whether they are MPS clients."""

    key: str
    label: str
    workers: int
    mps: bool


def configs(workers: int) -> list[Config]:
    """The three configurations of the issue. The single worker runs without MPS: it is the
    baseline a user has today, one process owning its own context."""
    return [
        Config("1w", "1 worker", 1, False),
        Config(f"{workers}w-nomps", f"{workers} workers, no MPS", workers, False),
        Config(f"{workers}w-mps", f"{workers} workers, MPS", workers, True),
    ]


def worker_environment(uuid: str, mps_env: dict[str, str]) -> dict[str, str]:
    """The environment for a worker or probe: ours, minus any CUDA/MPS selection we inherited,
    plus the GPU by UUID and the MPS (or deliberately empty) pipe directory."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("CUDA_MPS_") and k != gpus.VISIBLE_DEVICES_ENV
    }
    env.update(
        {
            gpus.VISIBLE_DEVICES_ENV: uuid,
            "PYTHONPATH": os.pathsep.join(
                p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p
            ),
            "PYTHONUNBUFFERED": "1",
            "TF_CPP_MIN_LOG_LEVEL": os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2"),
        }
    )
    env.update(mps_env)
    return env


def self_command(*args: str) -> list[str]:
    """This module, run by this interpreter from the repository root."""
    return [sys.executable, "-m", "bench.gpu_mps", *args]


def probe(framework: str, env: dict[str, str], base: Path, timeout_s: float) -> dict[str, Any]:
    """Run probe_main in a subprocess (its own process, so a framework that fails to load, or
    two frameworks' CUDA libraries, cannot disturb anything else)."""
    log_path = base / f"probe-{framework}.log"
    with open(log_path, "wb") as err:
        proc = subprocess.Popen(
            self_command("--probe", framework),
            cwd=REPO,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=err,
            start_new_session=True,
        )
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"framework": framework, "ok": False, "why": f"probe took over {timeout_s:.0f} s"}
    finally:
        stop_process(proc)
    for line in reversed(out.decode(errors="replace").splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    return {
        "framework": framework,
        "ok": False,
        "why": f"probe exited {proc.returncode}: {tail(log_path, 3)}",
    }


def choose_framework(
    wanted: str, env: dict[str, str], base: Path, timeout_s: float
) -> tuple[str | None, str, list[dict[str, Any]]]:
    """(framework, why, probes). TensorFlow first — mpspool's workers run TensorFlow — then
    PyTorch, the stand-in the issue allows where TensorFlow cannot use the GPU."""
    order = ["tensorflow", "torch"] if wanted == "auto" else [wanted]
    probes = []
    for name in order:
        result = probe(name, env, base, timeout_s)
        probes.append(result)
        log(f"  probe {name}: {result.get('why')}")
        if result.get("ok"):
            if name == "torch" and wanted == "auto":
                why = (
                    f"{result['why']}; PyTorch stands in for TensorFlow because "
                    f"{probes[0].get('why')}"
                )
            elif name != "tensorflow":
                why = f"{result['why']}; asked for with --framework {name}"
            else:
                why = result["why"]
            return name, why, probes
    return None, "; ".join(str(p.get("why")) for p in probes), probes


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), on sorted data."""
    if not sorted_values:
        return math.nan
    pos = (len(sorted_values) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


@dataclass
class PointSpec:
    """What one measured point needs to know."""

    config: Config
    batch: int
    framework: str
    uuid: str
    env: dict[str, str]
    warmup_s: float
    duration_s: float
    startup_timeout_s: float


def run_point(
    spec: PointSpec,
    rundir: Path,
    backend: gpus.GpuBackend,
    daemon: control.MpsDaemon | None,
) -> dict[str, Any]:
    """Start the workers, release them together, sample NVML, collect, stop them.

    Returns the point's summary; on failure the summary carries "error" and no numbers.
    """
    rundir.mkdir(parents=True)
    cfg = spec.config
    point: dict[str, Any] = {
        "config": cfg.key,
        "label": cfg.label,
        "workers": cfg.workers,
        "mps": cfg.mps,
        "batch": spec.batch,
    }
    procs: list[subprocess.Popen[bytes]] = []
    ok = False
    try:
        t_start = time.monotonic()
        for i in range(cfg.workers):
            worker_spec = {
                "index": i,
                "framework": spec.framework,
                "batch": spec.batch,
                "seed": 1000 + i,
                "dir": str(rundir),
                "warmup_s": spec.warmup_s,
                "duration_s": spec.duration_s,
                "parent_pid": os.getpid(),
                "go_timeout_s": spec.startup_timeout_s + 30.0,
            }
            with open(rundir / f"worker-{i}.log", "wb") as out:
                procs.append(
                    subprocess.Popen(
                        self_command("--worker", json.dumps(worker_spec)),
                        cwd=REPO,
                        env=spec.env,
                        stdin=subprocess.DEVNULL,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
        deadline = t_start + spec.startup_timeout_s
        while not all((rundir / f"ready-{i}").exists() for i in range(cfg.workers)):
            for i, proc in enumerate(procs):
                if proc.poll() is not None and not (rundir / f"ready-{i}").exists():
                    raise RuntimeError(
                        f"worker {i} exited with {proc.returncode} before it was ready: "
                        f"{tail(rundir / f'worker-{i}.log', 8)}"
                    )
            if time.monotonic() > deadline:
                raise RuntimeError(f"workers not ready within {spec.startup_timeout_s:.0f} s")
            time.sleep(0.05)
        point["startup_s"] = round(time.monotonic() - t_start, 2)
        if daemon is not None:
            # Proof that the workers really are MPS clients, not contexts of their own.
            try:
                servers = daemon.servers()
                point["mps_servers"] = servers
                point["mps_clients"] = sum(len(daemon.clients(s)) for s in servers)
                if point["mps_clients"] != cfg.workers:
                    point["mps_warning"] = (
                        f"the MPS server lists {point['mps_clients']} clients for "
                        f"{cfg.workers} ready workers: they are not (all) sharing it"
                    )
            except control.MpsError as e:
                point["mps_clients_error"] = str(e)
        start_at = time.time() + 0.5
        write_json_atomic(rundir / "go", {"start_at": start_at})
        utilisation: list[int] = []
        memory: list[int] = []
        sample_errors: list[str] = []
        time.sleep(max(0.0, start_at - time.time()))
        while time.time() < start_at + spec.duration_s:
            try:
                usage = backend.usage(spec.uuid)
                utilisation.append(usage.utilization_gpu)
                memory.append(usage.memory_used)
            except gpus.GpuError as e:
                sample_errors.append(str(e))
            time.sleep(SAMPLE_PERIOD_S)
        results = []
        collect_deadline = time.monotonic() + 60.0
        for i, proc in enumerate(procs):
            try:
                proc.wait(max(0.1, collect_deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"worker {i} did not finish within 60 s of the end") from None
            path = rundir / f"result-{i}.json"
            if not path.exists():
                raise RuntimeError(
                    f"worker {i} exited with {proc.returncode} and no result: "
                    f"{tail(rundir / f'worker-{i}.log', 8)}"
                )
            result = json.loads(path.read_text())
            if "error" in result:
                raise RuntimeError(f"worker {i}: {result['error']}")
            results.append(result)
        point.update(summarise(results, spec.batch, utilisation, memory))
        if sample_errors:
            point["nvml_errors"] = sample_errors[:3]
        ok = True
    except (RuntimeError, OSError, ValueError) as e:
        point["error"] = str(e)
    finally:
        if not ok and daemon is not None:
            # A client killed with work in flight can wedge the MPS server: ask it first.
            with contextlib.suppress(control.MpsError):
                daemon.terminate_clients()
        for proc in procs:
            stop_process(proc)
    return point


def summarise(
    results: list[dict[str, Any]], batch: int, utilisation: list[int], memory: list[int]
) -> dict[str, Any]:
    """Throughput is the sum of the workers' own rates (their windows start together and are
    equally long); latencies are pooled over all workers' calls."""
    latencies = sorted(x for r in results for x in r["latencies_ms"])
    calls_per_s = sum(r["calls"] / r["elapsed_s"] for r in results if r["elapsed_s"] > 0)
    return {
        "calls": sum(r["calls"] for r in results),
        "calls_per_s": calls_per_s,
        "rows_per_s": calls_per_s * batch,
        "p50_ms": percentile(latencies, 50),
        "p90_ms": percentile(latencies, 90),
        "p99_ms": percentile(latencies, 99),
        "max_ms": latencies[-1] if latencies else math.nan,
        "per_worker_calls": [r["calls"] for r in results],
        "gpu_util_mean": sum(utilisation) / len(utilisation) if utilisation else None,
        "gpu_util_samples": len(utilisation),
        "gpu_mem_max_mib": round(max(memory) / 2**20) if memory else None,
        "device": results[0].get("device") if results else None,
    }


def targets(points: list[dict[str, Any]], workers: int) -> list[dict[str, Any]]:
    """The issue's two targets per batch size ≤ 32, on rows/s (calls/s gives the same ratio)."""
    by = {(p["config"], p["batch"]): p for p in points}
    out = []
    for batch in sorted({p["batch"] for p in points}):
        if batch > TARGET_MAX_BATCH:
            continue
        mps = by.get((f"{workers}w-mps", batch), {})
        for other, goal, text in (
            ("1w", TARGET_VS_ONE, f"{workers} workers with MPS ≥ {TARGET_VS_ONE:g}× 1 worker"),
            (
                f"{workers}w-nomps",
                TARGET_VS_NO_MPS,
                f"{workers} workers with MPS ≥ {TARGET_VS_NO_MPS:g}× {workers} without MPS",
            ),
        ):
            base = by.get((other, batch), {})
            ratio = None
            if mps.get("rows_per_s") and base.get("rows_per_s"):
                ratio = mps["rows_per_s"] / base["rows_per_s"]
            out.append(
                {
                    "batch": batch,
                    "target": f"batch {batch}: {text}",
                    "goal": goal,
                    "ratio": ratio,
                    "met": None if ratio is None else ratio >= goal,
                }
            )
    return out


def unmeasured(cfg: Config, batches: Sequence[int], reason: str) -> list[dict[str, Any]]:
    """Points that carry only why they have no numbers."""
    return [
        {
            "config": cfg.key,
            "label": cfg.label,
            "workers": cfg.workers,
            "mps": cfg.mps,
            "batch": b,
            "error": reason,
        }
        for b in batches
    ]


def measure(
    args: argparse.Namespace,
    gpu: gpus.GpuInfo,
    backend: gpus.GpuBackend,
    binary: str,
    framework: str,
    base: Path,
) -> list[dict[str, Any]]:
    """Every (configuration, batch) point, configuration by configuration; the MPS daemon is
    up only for the MPS configuration."""
    no_mps_dir = base / "no-mps-pipe"  # empty on purpose: no daemon answers there
    no_mps_dir.mkdir(mode=0o700)
    points: list[dict[str, Any]] = []
    for cfg in configs(args.workers):
        if (
            not cfg.mps
            and cfg.workers > 1
            and gpu.compute_mode in (gpus.EXCLUSIVE_PROCESS, gpus.EXCLUSIVE_THREAD)
        ):
            reason = (
                f"skipped: the GPU is in compute mode {gpu.compute_mode}, which allows one "
                "context, so several processes need MPS"
            )
            log(f"{cfg.label}: {reason}")
            points += unmeasured(cfg, args.batches, reason)
            continue
        with contextlib.ExitStack() as stack:
            daemon = None
            if cfg.mps:
                daemon = control.MpsDaemon(
                    gpu.index, gpu.uuid, binary, base / "mps" / "pipe", base / "mps" / "log"
                )
                try:
                    stack.enter_context(running_daemon(daemon, base / "mps-daemon.log"))
                    applied = daemon.apply_defaults(100, 0)
                except control.MpsError as e:
                    log(f"{cfg.label}: the MPS daemon failed: {e}")
                    points += unmeasured(cfg, args.batches, f"the MPS daemon failed: {e}")
                    continue
                log(f"{cfg.label}: MPS daemon ready in {daemon.pipe_dir}, defaults {applied}")
                env = worker_environment(gpu.uuid, daemon.environment())
            else:
                env = worker_environment(gpu.uuid, {"CUDA_MPS_PIPE_DIRECTORY": str(no_mps_dir)})
            startup_failure: str | None = None
            for batch in args.batches:
                if startup_failure:
                    # Workers that cannot start at one batch size will not at the next: do not
                    # spend another start-up timeout on them.
                    reason = f"skipped: the workers failed to start at {startup_failure}"
                    points += unmeasured(cfg, [batch], reason)
                    continue
                spec = PointSpec(
                    cfg,
                    batch,
                    framework,
                    gpu.uuid,
                    env,
                    args.warmup,
                    args.duration,
                    args.startup_timeout,
                )
                point = run_point(spec, base / f"{cfg.key}-b{batch}", backend, daemon)
                points.append(point)
                if "startup_s" not in point:
                    startup_failure = f"batch {batch}"
                log(f"{cfg.label}, batch {batch}: {describe_point(point)}")
    return points


def describe_point(point: dict[str, Any]) -> str:
    """One progress line."""
    if "error" in point:
        return f"FAILED: {point['error']}"
    util = point.get("gpu_util_mean")
    clients = f", MPS clients {point['mps_clients']}" if "mps_clients" in point else ""
    if "mps_warning" in point:
        clients += f" (warning: {point['mps_warning']})"
    return (
        f"{point['calls_per_s']:,.0f} calls/s, {point['rows_per_s']:,.0f} rows/s, "
        f"p50 {point['p50_ms']:.3f} ms, p99 {point['p99_ms']:.3f} ms, "
        f"GPU util {'–' if util is None else f'{util:.0f} %'}{clients}"
    )


# --- Reports -----------------------------------------------------------------------------------


def fmt(value: float | None, spec: str = ",.1f") -> str:
    """A table cell: '–' for no value."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return format(value, spec)


def one_line(text: str) -> str:
    """An error for a table cell: its last line (a traceback's verdict), without pipes."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    first = lines[0] if lines else ""
    last = lines[-1] if lines else ""
    return (first if first == last else f"{first.split(':')[0]}: … {last}").replace("|", "/")


def markdown(report: dict[str, Any]) -> str:
    """The section for bench/RESULTS.md, between markers so that it can be replaced whole."""
    w = report["settings"]["workers"]
    lines = [
        "<!-- gpu_mps:begin (written by bench/gpu_mps.py; edits here are lost) -->",
        f"## GPU: 1 worker vs {w} workers without MPS vs {w} workers with MPS",
        "",
        f"- **Date:** {report['date']}",
        f"- **Command:** `{report['command']}` (from the repository root)",
        f"- **Host:** {report['host']}",
    ]
    gpu = report.get("gpu")
    if gpu:
        driver = report.get("driver") or {}
        drv = ", ".join(f"{k} {v}" for k, v in driver.items()) or "driver version not reported"
        lines.append(
            f"- **GPU:** {gpu['name']} ({gpu['uuid']}), {gpu['memory_total'] / 2**20:,.0f} MiB, "
            f"compute mode {gpu['compute_mode']}; {drv}"
        )
    binary = report.get("control_binary") or {}
    lines.append(
        f"- **MPS control binary:** `{binary.get('path') or 'not found'}` ({binary.get('how')})"
    )
    checks = report.get("cpu_checks") or []
    if checks:
        passed = sum(c["ok"] for c in checks)
        lines.append(
            f"- **CPU-side checks:** {passed}/{len(checks)} passed: "
            + "; ".join(
                f"{c['name']} {'✓' if c['ok'] else '✗ (' + c['detail'] + ')'}" for c in checks
            )
        )
    missing = report.get("gpu_numbers_missing")
    if missing:
        lines += ["", f"**GPU numbers missing:** {missing}", "<!-- gpu_mps:end -->", ""]
        return "\n".join(lines)
    s = report["settings"]
    if report.get("framework") == "numpy":
        lines += [
            "",
            "**Not GPU numbers:** `--framework numpy` ran the model on the CPU to test the "
            "orchestration; do not merge this section as a GPU result.",
            "",
        ]
    lines += [
        f"- **Framework:** {report['framework']} — {report['framework_why']}",
        f"- **Model:** embedding {VOCAB:,} × {EMB_DIM} mean-pooled over {IDS_PER_ROW} ids + "
        f"{DENSE} dense → MLP {'-'.join(str(h) for h in HIDDEN)}-1, float32; "
        f"{DISTINCT_BATCHES} distinct input batches per worker, cycled",
        f"- **Load:** each worker one closed loop (host→GPU copy, forward, scores back, "
        f"synchronise per call); fresh workers per point, {s['warmup_s']:g} s warm-up, "
        f"{s['duration_s']:g} s measured, all released at one instant; NVML utilisation "
        f"sampled every {SAMPLE_PERIOD_S * 1000:.0f} ms",
        "- **MPS:** control daemon started through mps/ (`MpsDaemon`), private pipe directory, "
        "active thread percentage 100, no pinned-memory limit, `quit` at the end; the "
        "no-MPS workers get an empty pipe directory so no system daemon can capture them",
    ]
    tg = report.get("targets") or []
    if tg:
        lines += ["", "### Targets", "", "| Target | Measured | Met |", "|---|---:|:---:|"]
        for t in tg:
            met = "–" if t["met"] is None else ("yes" if t["met"] else "**no**")
            lines.append(f"| {t['target']} | {fmt(t['ratio'], '.2f')} × | {met} |")
    lines += [
        "",
        "### Results",
        "",
        "| Batch | Config | calls/s | rows/s | p50 ms | p99 ms | GPU util % | MPS clients "
        "| vs 1 worker |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    one = {p["batch"]: p for p in report["points"] if p["config"] == "1w"}
    for p in sorted(report["points"], key=lambda p: p["batch"]):
        if "error" in p:
            lines.append(f"| {p['batch']} | {p['label']} | {one_line(p['error'])} |" + " – |" * 6)
            continue
        base = one.get(p["batch"], {}).get("rows_per_s")
        ratio = p["rows_per_s"] / base if base else None
        clients = f"{p['mps_clients']}/{p['workers']}" if "mps_clients" in p else "–"
        lines.append(
            f"| {p['batch']} | {p['label']} | {fmt(p['calls_per_s'])} | "
            f"{fmt(p['rows_per_s'], ',.0f')} | {fmt(p['p50_ms'], '.3f')} | "
            f"{fmt(p['p99_ms'], '.3f')} | {fmt(p.get('gpu_util_mean'), '.0f')} | "
            f"{clients} | {fmt(ratio, '.2f')} |"
        )
    warnings = [
        f"{p['label']}, batch {p['batch']}: {p['mps_warning']}"
        for p in report["points"]
        if "mps_warning" in p
    ]
    if warnings:
        lines += ["", *(f"- **Warning:** {w}" for w in warnings)]
    lines += ["<!-- gpu_mps:end -->", ""]
    return "\n".join(lines)


def driver_versions() -> dict[str, str]:
    """The driver and its CUDA version, if NVML (already initialised by the backend) says."""
    found: dict[str, str] = {}
    try:
        import pynvml
    except ImportError:
        return found
    for key, getter in (
        ("driver", "nvmlSystemGetDriverVersion"),
        ("CUDA driver API", "nvmlSystemGetCudaDriverVersion_v2"),
    ):
        try:
            value = getattr(pynvml, getter)()
        except Exception:  # NVMLError, AttributeError on old bindings: just leave it out
            continue
        if isinstance(value, bytes):
            value = value.decode()
        if isinstance(value, int):  # 13000 -> "13.0"
            value = f"{value // 1000}.{value % 1000 // 10}"
        found[key] = str(value)
    return found


def write_outputs(report: dict[str, Any], args: argparse.Namespace) -> None:
    """JSON and markdown to the paths asked for (never bench/RESULTS.md: the lead merges)."""
    for path, text in (
        (args.json, lambda: json.dumps(report, indent=2, default=str) + "\n"),
        (args.markdown, lambda: markdown(report)),
    ):
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(text())
            log(f"wrote {path}")


def parse_batches(text: str) -> list[int]:
    """'1,8,32' -> [1, 8, 32]."""
    try:
        batches = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--batches {text!r}: expected e.g. 1,8,32") from None
    if not batches or any(b < 1 for b in batches):
        raise argparse.ArgumentTypeError(f"--batches {text!r}: positive integers")
    return batches


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(
        prog="python -m bench.gpu_mps",
        description="1 worker vs W workers without/with MPS on one GPU; CPU-side MPS checks "
        "where there is no GPU.",
    )
    p.add_argument("--gpu", type=int, default=0, help="GPU index as this process sees it")
    p.add_argument("--duration", type=float, default=5.0, help="measured seconds per point")
    p.add_argument("--warmup", type=float, default=1.0, help="warm-up seconds per worker")
    p.add_argument("--batches", type=parse_batches, default=[1, 8, 32])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument(
        "--framework",
        choices=("auto", "tensorflow", "torch", "numpy"),
        default="auto",
        help="auto: TensorFlow if it can use the GPU, else PyTorch; numpy runs on the CPU and "
        "only tests the orchestration",
    )
    p.add_argument("--mps-control", help="path of nvidia-cuda-mps-control")
    p.add_argument(
        "--startup-timeout",
        type=float,
        default=180.0,
        help="seconds for all workers of a point to be warm",
    )
    p.add_argument("--json", help="write the raw report here")
    p.add_argument("--markdown", help="write the RESULTS.md section here")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--probe", choices=tuple(BUILDERS), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.workers < 2:
        p.error("--workers must be at least 2 (it is compared with 1 worker)")
    if args.duration <= 0 or args.warmup < 0:
        p.error("--duration must be > 0 and --warmup >= 0")
    return args


def private_dir() -> Path:
    """A fresh directory for pipes, logs and hand-over files, directly under /tmp.

    Not under $TMPDIR: MPS puts Unix sockets in its pipe directory, and a socket path longer
    than 107 bytes makes the daemon exit at once (pytest's or a CI's TMPDIR can be that long).
    """
    parent = "/tmp" if os.path.isdir("/tmp") else tempfile.gettempdir()
    return Path(tempfile.mkdtemp(prefix="gpu-mps-", dir=parent))


def main(argv: Sequence[str] | None = None) -> int:
    """Run the checks, and the measurement where there is a GPU."""
    args = parse_args(argv)
    if args.worker:
        return worker_main(json.loads(args.worker))
    if args.probe:
        return probe_main(args.probe)

    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _raise_terminated)
    command = shlex.join(["python", "-m", "bench.gpu_mps", *(argv or sys.argv[1:])])
    report: dict[str, Any] = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": command,
        "host": f"{platform.node()}, Linux {platform.release()}, Python "
        f"{platform.python_version()}, {os.cpu_count()} CPUs",
        "settings": {
            "workers": args.workers,
            "batches": args.batches,
            "duration_s": args.duration,
            "warmup_s": args.warmup,
            "framework": args.framework,
        },
        "gpu_numbers_missing": None,
        "points": [],
    }
    base = private_dir()
    report["workdir"] = str(base)
    try:
        return run(args, report, base)
    finally:
        leftover = sweep(base)
        if leftover:
            log(f"killed processes left behind: {leftover}")
        subprocess.run(["rm", "-rf", str(base)], check=False)


def run(args: argparse.Namespace, report: dict[str, Any], base: Path) -> int:
    """The body of main, with its temporary directory already owned by main's cleanup."""
    binary, how = locate_control_binary(args.mps_control)
    report["control_binary"] = {"path": binary, "how": how}
    if binary is None:
        print(f"FAILED: {control.CONTROL_BINARY} not found: {how}")
        report["gpu_numbers_missing"] = f"{control.CONTROL_BINARY} not found ({how})"
        write_outputs(report, args)
        return EXIT_FAILED
    print(f"{control.CONTROL_BINARY}: {binary} ({how})")

    backend: gpus.GpuBackend | None = None
    no_gpu: str | None = None
    try:
        backend = gpus.backend()
    except gpus.NoGpuDriver as e:
        # Without mpspool's CLI advice ("run without --gpus"), which means nothing here.
        no_gpu = re.sub(r"; run without --gpus.*$", "", str(e))
    try:
        gpu: gpus.GpuInfo | None = None
        if backend is not None:
            try:
                gpu = gpus.select(backend.devices(), [args.gpu])[0]
            except gpus.GpuError as e:
                print(f"FAILED: {e}")
                return EXIT_USAGE
            report["gpu"] = {
                "index": gpu.index,
                "uuid": gpu.uuid,
                "name": gpu.name,
                "memory_total": gpu.memory_total,
                "compute_mode": gpu.compute_mode,
            }
            report["driver"] = driver_versions()
            drivers = ", ".join(f"{k} {v}" for k, v in report["driver"].items())
            print(
                f"GPU {gpu.describe()}, compute mode {gpu.compute_mode}; "
                f"{drivers or 'no driver version from NVML'}"
            )
            for warning in gpus.compute_mode_warnings([gpu]):
                log(f"warning: {warning}")

        print("CPU-side checks:")
        checks = cpu_checks(
            binary,
            gpu.index if gpu else 0,
            gpu.uuid if gpu else PLACEHOLDER_UUID,
            base / "check",
        )
        report["cpu_checks"] = [vars(c) for c in checks]
        for c in checks:
            print(f"  {'PASS' if c.ok else 'FAIL'}  {c.name}: {c.detail}")
        if not all(c.ok for c in checks):
            report["gpu_numbers_missing"] = "the CPU-side MPS checks failed"
            write_outputs(report, args)
            print("FAILED: CPU-side checks")
            return EXIT_FAILED

        if gpu is None or backend is None:
            report["gpu_numbers_missing"] = f"no GPU on this machine ({no_gpu})"
            write_outputs(report, args)
            print(f"GPU numbers missing: {report['gpu_numbers_missing']}")
            return EXIT_OK

        probe_env = worker_environment(
            gpu.uuid, {"CUDA_MPS_PIPE_DIRECTORY": str(base / "probe-pipe")}
        )
        log("choosing the framework:")
        framework, why, probes = choose_framework(
            args.framework, probe_env, base, args.startup_timeout
        )
        report["probes"] = probes
        if framework is None:
            report["gpu_numbers_missing"] = f"no framework can use the GPU here: {why}"
            write_outputs(report, args)
            print(f"GPU numbers missing: {report['gpu_numbers_missing']}")
            return EXIT_NO_FRAMEWORK
        report["framework"], report["framework_why"] = framework, why
        print(f"framework: {framework} ({why})")
        points_total = 3 * len(args.batches)
        log(
            f"{points_total} points, each up to {args.startup_timeout:.0f} s start-up + "
            f"{args.duration:g} s measured"
        )
        report["points"] = measure(args, gpu, backend, binary, framework, base)
        report["targets"] = targets(report["points"], args.workers)
        print(markdown(report))
        write_outputs(report, args)
        failed = [p for p in report["points"] if "error" in p and "skipped" not in p["error"]]
        return EXIT_FAILED if failed else EXIT_OK
    finally:
        if backend is not None:
            backend.close()


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        log("interrupted; everything started was stopped")
        sys.exit(130)
    except Terminated as e:
        log(f"terminated ({e}); everything started was stopped")
        sys.exit(143)
