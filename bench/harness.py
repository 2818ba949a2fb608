"""The one bench harness: servers, a native load driver, CPU per process, and the report.

A scenario (bench/frontdoor.py, bench/memory.py) is a short script over these parts:

- **Servers.** ``Pool`` runs `mpspool start` in its own process group and finds its processes by
  role (the front door is the process running `mpspool-router`); bench/echo_worker.py and
  bench/peers/ start the other systems. Each is described to the driver as a ``Server``: a
  port, a protocol, its processes by role, and (mpspool only) its own request counters.
- **Requests.** ``Request`` is one serialized request in gRPC's framing, built once with the
  official messages (tensorflow-serving-api's PredictRequest, or KServe v2's ModelInferRequest
  for Triton) and posted unchanged by the driver.
- **Windows.** ``measure`` runs h2load (nghttp2-client) for a warm-up and then a measured
  window: req/s from its summary, p50/p99 from its per-request log. h2load counts HTTP 200s
  and cannot see a gRPC status, so failures are caught three ways: the Python client checks an
  answer before and after the window (shape, and values equal to the first system's answer
  for the same request); every answer of the window must have carried the answer's size in
  DATA bytes (an error is trailers only); and for mpspool the front door's own Prometheus
  counters must show the window's requests answered OK and no other code.
- **CPU per request per process role**: psutil CPU time (user + system, all threads) of each
  role's processes over the window, and h2load's own (the client), divided by the requests
  answered.
- **The report**: a markdown table per scenario in its own section of bench/RESULTS.md, plots
  beside it in bench/out/; no raw JSON is kept in the repository.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as dt
import importlib.metadata
import io
import json
import math
import os
import platform
import re
import resource
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np
import psutil

from mpspool import process
from mpspool.config import default_cache_dir, usable_cores

REPO = Path(__file__).resolve().parent.parent
OUT_DIR = REPO / "bench" / "out"
RESULTS_MD = REPO / "bench" / "RESULTS.md"
MODEL_NAME = "demo"
READY_TIMEOUT_S = 300.0
# One status poll's wait for the pool's answer (it is busy publishing for a moment at start).
STATUS_TIMEOUT_S = 2.0
STOP_TIMEOUT_S = 60.0
PREDICT_PATH = "/tensorflow.serving.PredictionService/Predict"
KSERVE_INFER_PATH = "/inference.GRPCInferenceService/ModelInfer"
MAX_MESSAGE_BYTES = 512 * 1024 * 1024
# h2load's concurrency: streams over at most this many connections, as a gRPC client pool.
MAX_CONNECTIONS = 4

# Subprocesses run outside the repository: `python -m` puts the cwd first on sys.path, and
# the repository's supervisor/ folder would shadow supervisord's package of that name.
_OUTSIDE = tempfile.gettempdir()


def _mpspool(*args: str) -> list[str]:
    return [sys.executable, "-m", "mpspool", *args]


# -- the code under test -------------------------------------------------------------------
# The repository's top-level folders and where they sit in the installed package (pyproject's
# [tool.setuptools.package-dir]); a frozen copy is laid out as installed. The front door is a
# binary: it is not frozen, the installed one runs.
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


# The front door's sources: built into the installed binary by pip or cargo, not copied with
# the Python code (a run measures whatever binary is installed).
RUST_SOURCES = ("router/src/", "router/proto/", "router/build.rs", "router/Cargo.")


def _is_rust_source(name: str) -> bool:
    return name.startswith(RUST_SOURCES)


def front_door_build(kind: str) -> dict[str, Any]:
    """The front door binary the pools will run, when it was built, and whether it can be the
    code under test: a binary older than a file of its sources, or (``kind`` "HEAD") built
    from a working tree whose sources differ from HEAD, is not (found by a bench hunt: a run
    said "commit X (frozen copy)" over a binary built before the edits it listed)."""
    from mpspool.router import BINARY_ENV, BinaryNotFound, binary_path

    try:
        path = binary_path()
        built = os.stat(path).st_mtime
    except (BinaryNotFound, OSError) as exc:
        return {"path": "", "problem": f"no front door binary: {exc}"}
    build: dict[str, Any] = {"path": path, "built": built, "problem": ""}
    if os.environ.get(BINARY_ENV):
        return build  # a binary chosen by hand: what it was built from is the chooser's word
    with contextlib.suppress(subprocess.SubprocessError, OSError):
        names = _git("ls-files", "-co", "--exclude-standard", "--", "router").splitlines()
        newer = sorted(
            name
            for name in names
            if _is_rust_source(name)
            and (REPO / name).is_file()
            and (REPO / name).stat().st_mtime > built
        )
        changed = [
            line[3:]
            for line in _git("status", "--porcelain", "--", "router").splitlines()
            if _is_rust_source(line[3:])
        ]
        if newer:
            build["problem"] = (
                f"older than its sources ({', '.join(newer[:4])}"
                f"{' …' if len(newer) > 4 else ''} changed since): rebuild it"
            )
        elif kind == "HEAD" and changed:
            build["problem"] = (
                f"built from the working tree, whose {', '.join(changed[:4])} differ from HEAD"
            )
    return build


def freeze_source(kind: str, dest: Path) -> dict[str, Any]:
    """Copy the Python code under test out of the repository ("worktree": the files as they are;
    "HEAD": the last commit; "live": no copy), so that edits made during a run cannot mix
    versions; describe what was copied, and the front door binary beside it. Processes get
    the copy first on PYTHONPATH."""
    info: dict[str, Any] = {"kind": kind, "front_door": front_door_build(kind)}
    if info["front_door"]["problem"]:
        print(f"bench: the front door binary is {info['front_door']['problem']}", file=sys.stderr)
    with contextlib.suppress(subprocess.SubprocessError, OSError):
        info["commit"] = _git("rev-parse", "--short", "HEAD").strip()
        changed = _git("status", "--porcelain", "--", *PACKAGE_DIRS).splitlines()
        info["uncommitted"] = sorted(line[3:] for line in changed if not _is_rust_source(line[3:]))
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


@contextlib.contextmanager
def frozen_code(kind: str) -> Iterator[tuple[dict[str, Any], dict[str, str]]]:
    """The code under test frozen into a temporary copy, and the environment that runs it."""
    with tempfile.TemporaryDirectory(prefix="mpb-src-") as frozen:
        source = freeze_source(kind, Path(frozen))
        env = dict(os.environ)
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        if "path" in source:
            env["PYTHONPATH"] = os.pathsep.join(
                p for p in (source["path"], env.get("PYTHONPATH", "")) if p
            )
        yield source, env


def _describe_source(source: dict[str, Any]) -> str:
    commit = source.get("commit", "unknown commit")
    if source.get("kind") == "HEAD":
        described = f"commit {commit} (frozen copy)"
    else:
        changed = source.get("uncommitted") or []
        extra = f" plus uncommitted changes to {', '.join(changed)}" if changed else ""
        frozen = "frozen copy of the working tree" if "path" in source else "live working tree"
        described = f"commit {commit}{extra} ({frozen})"
    build = source.get("front_door")
    if not build:
        return described
    if not build["path"]:
        return f"{described}; **{build['problem']}**"
    built = dt.datetime.fromtimestamp(build["built"], dt.timezone.utc)
    binary = f"front door `{build['path']}` built {built:%Y-%m-%d %H:%M} UTC"
    problem = f", **{build['problem']}**" if build["problem"] else ""
    return f"{described}; {binary}{problem}"


# -- the model -----------------------------------------------------------------------------
def ensure_model(rows: int, env: dict[str, str] | None = None) -> Path:
    """The demo model with ``rows`` embedding rows, built once into the cache (a base path),
    by the mpspool CLI in a subprocess."""
    base = default_cache_dir() / f"bench-demo-{rows}"
    if not (base / "1" / "saved_model.pb").is_file():
        print(f"bench: building the demo model ({rows:,} rows) in {base}", file=sys.stderr)
        subprocess.run(
            _mpspool("demo-model", "--out", str(base), "--embedding-rows", str(rows)),
            cwd=_OUTSIDE, env=env, check=True, timeout=600,
        )  # fmt: skip
    return base


# -- a pool --------------------------------------------------------------------------------
class Pool:
    """One `mpspool start` in its own process group (the bench's session); a context manager
    that always stops it.

    ``roles`` (after wait_ready): "router" (the `mpspool-router` process), "workers",
    "control" (the controller and supervisord)."""

    def __init__(
        self,
        model_base: Path,
        workers: int,
        log_dir: Path,
        env: dict[str, str],
        label: str = "",
        extra_args: Sequence[str] = (),
    ) -> None:
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
            "--rest-api-port", "0",
            *extra_args,
        ]  # fmt: skip
        self.proc: subprocess.Popen[bytes] | None = None
        self.target = ""
        self.metrics_url = ""
        self.rest_port = 0  # TF Serving's REST API (after wait_ready)
        self.pool_id = ""
        self.ready_s = 0.0
        self.spawned_at = 0.0
        self.roles: dict[str, list[psutil.Process]] = {}
        self._descendants: dict[int, psutil.Process] = {}

    def __enter__(self) -> Pool:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_dir / "start.out", "wb") as out:
            # Own process group: a Ctrl-C reaches this script only, which then stops the pool
            # in order; dying with us (SIGTERM) covers the case where we are killed. Our
            # session: under Linux's autogroup (a CPU group per session) the pool and the
            # load generator are one group, as a client on another machine would leave the
            # pool's scheduling alone; in a session of its own the pool's idle-priority work
            # (a loading version) competed with the client as a group of equal weight.
            # The start time is the clock read here: psutil's create_time() rests on a boot
            # time in whole seconds, up to a second early.
            self.spawned_at = time.time()
            self.proc = subprocess.Popen(
                _mpspool(*self.args), cwd=_OUTSIDE, env=self.env, stdout=out,
                stderr=subprocess.STDOUT, process_group=0,
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

    def status(self) -> dict[str, Any]:
        """What `mpspool status --json` prints, asked of the pool's admin socket: a CLI
        process per poll cost 0.2-0.45 s and 0.36 s of CPU, which the starting workers lost
        on 2 cores (a 1-worker pool read 8.2-8.9 s to start polled so, 4.5-5.5 s polled
        here; found by a bench hunt). SubprocessError while the pool cannot answer yet."""
        import zmq

        from mpspool.cli import _ask_pool
        from mpspool.config import ConfigError

        try:
            status = _ask_pool(self.run_dir, "status", timeout_s=STATUS_TIMEOUT_S)
        except (ConfigError, OSError, zmq.ZMQError, ValueError) as exc:
            raise subprocess.SubprocessError(str(exc)) from exc
        if "slots" not in status:
            raise subprocess.SubprocessError(f"no status: {status}")
        return status

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Until every slot is READY and the front door listens; then find the processes."""
        assert self.proc is not None
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
                    self.metrics_url = status["pool"].get("metrics") or ""
                    rest = status["pool"].get("rest") or ""
                    self.rest_port = int(rest.split("/v1/")[0].rsplit(":", 1)[1]) if rest else 0
                    self.pool_id = status["pool"].get("pool_id", "")
                    self.ready_s = time.time() - self.spawned_at
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
            if is_front_door(child):
                self.roles["router"].append(child)
            elif "mpspool.worker" in " ".join(child.cmdline()):
                self.roles["workers"].append(child)
            else:  # supervisord
                self.roles["control"].append(child)
        if len(self.roles["router"]) != 1 or len(self.roles["workers"]) != self.workers:
            raise RuntimeError(
                f"pool {self.label}: expected 1 front door and {self.workers} workers under "
                f"pid {top.pid}, found {self.roles}"
            )
        # The frozen copy must be what runs (a launcher that cleaned the environment would
        # silently bring back the live repository).
        wanted = self.env.get("PYTHONPATH")
        for proc in self.roles["workers"]:
            got = proc.environ().get("PYTHONPATH")
            if wanted and got != wanted:
                raise RuntimeError(
                    f"pool {self.label}: pid {proc.pid} runs with PYTHONPATH={got!r}, "
                    f"not the frozen source {wanted!r}"
                )

    def server(self, name: str, rest: bool = False) -> Server:
        """What the load driver needs of this pool (after wait_ready): its gRPC port, or with
        ``rest`` its REST port."""
        return Server(
            name=name,
            port=self.rest_port if rest else int(self.target.rsplit(":", 1)[1]),
            protocol="rest" if rest else "tfserving",
            roles={
                "front door": self.roles["router"],
                "workers": self.roles["workers"],
                "control": self.roles["control"],
            },
            metrics_url=self.metrics_url,
        )

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
                    _mpspool("stop", "--run-dir", str(self.run_dir)), cwd=_OUTSIDE,
                    env=self.env, capture_output=True, timeout=STOP_TIMEOUT_S,
                )  # fmt: skip
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
            if alive(child):
                with contextlib.suppress(psutil.Error):
                    child.kill()

    def leftovers(self) -> list[str]:
        """What of this pool outlived stop(): processes, and the run directory."""
        left = [
            f"pool {self.label}: process {c.pid} still running"
            for c in self._descendants.values()
            if alive(c)
        ]
        if self.run_dir.exists():
            left.append(f"pool {self.label}: run dir {self.run_dir} left behind")
        return left


def is_front_door(proc: psutil.Process) -> bool:
    with contextlib.suppress(psutil.Error):
        return proc.name() == "mpspool-router" or Path(proc.exe()).name == "mpspool-router"
    return False


def alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def shm_leftovers(pool_ids: list[str]) -> list[str]:
    """Shared-memory files of these pools (mpspool-<pool id>-...) still present."""
    shm = Path("/dev/shm")
    if not shm.is_dir():
        return []
    return [
        f"/dev/shm/{p.name} left behind"
        for p in shm.iterdir()
        if p.name.startswith("mpspool") and any(pool_id in p.name for pool_id in pool_ids)
    ]


# -- requests and the Python client's checks -----------------------------------------------
@dataclasses.dataclass
class Server:
    """A system under load as the driver sees it."""

    name: str
    port: int
    roles: dict[str, list[psutil.Process]]  # role → processes whose CPU is charged to it
    protocol: str = "tfserving"  # or "kserve"
    metrics_url: str = ""  # mpspool: the front door's Prometheus endpoint
    model: str = MODEL_NAME

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def processes(self) -> list[psutil.Process]:
        return [p for procs in self.roles.values() for p in procs]


@dataclasses.dataclass
class Request:
    """One request as h2load posts it: gRPC's framing (flag byte, 4-byte big-endian length),
    or for protocol "rest" a JSON body over HTTP/1.1."""

    key: str  # requests with the same key must get the same answer from every system
    protocol: str
    path: str
    body: bytes
    batch: int
    output: str = "score"


def grpc_frame(message: bytes) -> bytes:
    """A message in gRPC's framing: not compressed, 4-byte big-endian length."""
    return b"\x00" + len(message).to_bytes(4, "big") + message


def predict_request(key: str, model: str, inputs: dict[str, np.ndarray]) -> Request:
    """A TF Serving PredictRequest, the bytes the official client sends (tensor_content,
    little-endian; tests/test_bench_gpu_pool.py compares them), built from the pool's own copy
    of TF Serving's protos: the bench process never maps TensorFlow, whose library pages it
    would otherwise share with the processes it measures (a lone worker's USS read 201 MiB
    where it is its TensorFlow's only mapper; found by a bench hunt), and where it is not
    installed (the GPU machine) it still runs."""
    from mpspool import dtypes
    from mpspool.protos import serving_pb2

    request = serving_pb2.PredictRequest()
    request.model_spec.name = model
    request.model_spec.signature_name = "serving_default"
    for name, values in inputs.items():
        tensor = request.inputs[name]
        tensor.dtype = dtypes.dt_of_array(values)
        for size in values.shape:
            tensor.tensor_shape.dim.add(size=size)
        tensor.tensor_content = np.ascontiguousarray(
            values, values.dtype.newbyteorder("<")
        ).tobytes()
    batch = len(next(iter(inputs.values())))
    return Request(key, "tfserving", PREDICT_PATH, grpc_frame(request.SerializeToString()), batch)


REST_PREDICT_PATH = "/v1/models/{model}:predict"


def rest_request(key: str, model: str, inputs: dict[str, np.ndarray]) -> Request:
    """The same inputs as TF Serving's REST Predict, columnar (`inputs`): what a feature
    service posts."""
    body = json.dumps({"inputs": {name: values.tolist() for name, values in inputs.items()}})
    batch = len(next(iter(inputs.values())))
    return Request(key, "rest", REST_PREDICT_PATH.format(model=model), body.encode(), batch)


KSERVE_DATATYPES = {np.dtype(np.int64): "INT64", np.dtype(np.float32): "FP32"}


def kserve_request(key: str, model: str, inputs: dict[str, np.ndarray]) -> Request:
    """The same inputs as a KServe v2 ModelInferRequest, tensors in raw_input_contents."""
    from bench.protos import kserve_pb2

    request = kserve_pb2.ModelInferRequest(model_name=model)
    for name, values in inputs.items():
        request.inputs.add(name=name, datatype=KSERVE_DATATYPES[values.dtype], shape=values.shape)
        little = np.ascontiguousarray(values, dtype=values.dtype.newbyteorder("<"))
        request.raw_input_contents.append(little.tobytes())
    batch = len(next(iter(inputs.values())))
    return Request(key, "kserve", KSERVE_INFER_PATH, grpc_frame(request.SerializeToString()), batch)


def call(target: str, request: Request, timeout_s: float = 60.0) -> bytes:
    """One call with the request's own bytes; the answer's bytes (gRPC errors raise)."""
    if request.protocol == "rest":
        post = urllib.request.Request(
            f"http://{target}{request.path}",
            data=request.body,
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(post, timeout=timeout_s) as answer:
                return answer.read()
        except urllib.error.HTTPError as exc:
            raise RuntimeError(
                f"{target} did not answer {request.key}: HTTP {exc.code}: {exc.read()[:500]!r}"
            ) from exc
    import grpc

    options = [
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ]
    with grpc.insecure_channel(target, options=options) as channel:
        try:
            return channel.unary_unary(request.path)(request.body[5:], timeout=timeout_s)
        except grpc.RpcError as exc:
            raise RuntimeError(
                f"{target} did not answer {request.key}: {exc.code().name}: {exc.details()}"
            ) from exc


def answer_values(request: Request, raw: bytes) -> np.ndarray:
    """The float output of an answer, read without TensorFlow (predict_request says why) from
    either encoding a server may use (KServe: its own messages; REST: TF Serving's columnar
    JSON)."""
    if request.protocol == "rest":
        return np.array(json.loads(raw)["outputs"], dtype=np.float32)
    if request.protocol == "kserve":
        from bench.protos import kserve_pb2

        response = kserve_pb2.ModelInferResponse.FromString(raw)
        names = [t.name for t in response.outputs]
        if request.output not in names:
            raise RuntimeError(f"answer without output {request.output!r}: {names}")
        i = names.index(request.output)
        shape = tuple(response.outputs[i].shape)
        return np.frombuffer(response.raw_output_contents[i], "<f4").reshape(shape)
    from mpspool import dtypes
    from mpspool.protos import serving_pb2

    outputs = serving_pb2.PredictResponse.FromString(raw).outputs
    if request.output not in outputs:
        raise RuntimeError(f"answer without output {request.output!r}: {sorted(outputs)}")
    tensor = outputs[request.output]
    if tensor.dtype != dtypes.DT_FLOAT:
        raise RuntimeError(f"output {request.output!r} has dtype {tensor.dtype}, not DT_FLOAT")
    shape = [d.size for d in tensor.tensor_shape.dim]
    if tensor.tensor_content:
        values = np.frombuffer(tensor.tensor_content, "<f4")
    else:
        values = np.array(tensor.float_val, np.float32)
    return values.reshape(shape)


class Checker:
    """The Python client's correctness checks around every window: an answer with ``batch``
    rows, equal to the first answer any system gave for the same request key."""

    def __init__(self, values: Callable[[Request, bytes], np.ndarray] | None = None) -> None:
        """``values``: how an answer is read (answer_values, the official messages, unless a
        machine without TensorFlow needs another reader)."""
        self.reference: dict[str, np.ndarray] = {}
        self.values = values or answer_values

    def check(self, server: Server, request: Request) -> int:
        """Check one answer; its size in gRPC's framing (what h2load counts as DATA bytes)."""
        raw = call(server.target, request)
        values = self.values(request, raw)
        if values.shape[:1] != (request.batch,):
            raise RuntimeError(
                f"{server.name}: answer of shape {values.shape} to a batch of {request.batch}"
            )
        ref = self.reference.setdefault(request.key, values)
        if values.shape != ref.shape or not np.allclose(values, ref, rtol=1e-5, atol=1e-6):
            raise RuntimeError(
                f"{server.name}: answer to {request.key} (shape {values.shape}) differs from the "
                f"first system's (shape {ref.shape}): {values.ravel()[:4]} vs {ref.ravel()[:4]}"
            )
        # h2load counts gRPC's 5-byte message prefix as data; a REST answer is its body.
        return len(raw) if request.protocol == "rest" else len(raw) + 5


# -- the native driver ---------------------------------------------------------------------
@dataclasses.dataclass
class Drive:
    """What one h2load run reported."""

    done: int
    rps: float
    data_bytes: int
    p50_ms: float
    p99_ms: float
    cpu_s: float  # h2load's own CPU time
    sent_rps: float = math.nan  # open loop: the arrival rate achieved (its log's start times)


_FINISHED = re.compile(r"finished in ([\d.]+)(m?s), ([\d.]+) req/s")
_REQUESTS = re.compile(r"requests: \d+ total, \d+ started, (\d+) done")
_TRAFFIC = re.compile(r"traffic: .*, \S+ \((\d+)\) data")


def parse_h2load(stdout: str, log: str) -> tuple[int, float, int, float, float]:
    """(done, req/s, DATA bytes received, p50 ms, p99 ms) from h2load's summary and its
    per-request log (start µs, HTTP status, µs to the end of the response)."""
    finished, requests, traffic = (r.search(stdout) for r in (_FINISHED, _REQUESTS, _TRAFFIC))
    if not (finished and requests and traffic):
        raise RuntimeError(f"unexpected h2load output: {stdout[-2000:]}")
    latencies = [
        int(f[2]) for f in (line.split("\t") for line in log.splitlines()) if f[1] == "200"
    ]
    p50, p99 = np.percentile(latencies, [50, 99]) / 1e3 if latencies else (math.nan, math.nan)
    done = int(requests.group(1))
    return done, float(finished.group(3)), int(traffic.group(1)), float(p50), float(p99)


# h2load 1.52 arms each timing-script request's timer from the moment the one before it was
# sent (libev, millisecond epoll timeouts), so every gap comes out this much longer (measured
# 2026-11-24, one connection: 0.4-0.8 ms at 100-1,800 req/s); scripts are drawn that much
# shorter per gap, and what was achieved is read back from the log (Drive.sent_rps).
H2LOAD_TIMER_LAG_MS = 0.5


def poisson_script(path: Path, url: str, rps: float, duration_s: float, seed: int) -> int:
    """An h2load timing script (offset ms, tab, URI per line) of Poisson arrivals at ``rps``
    over ``duration_s`` as h2load will send them (each gap less h2load's timer lag, at least
    a quarter of the mean); the number of requests in it."""
    rng = np.random.default_rng(seed)
    mean_ms = 1e3 / rps
    drawn_ms = max(mean_ms - H2LOAD_TIMER_LAG_MS, mean_ms / 4)
    gaps = rng.exponential(drawn_ms, size=int(rps * duration_s * 1.2) + 16)
    offsets = np.cumsum(gaps)
    # When h2load will send them: each gap about one lag longer than written.
    sent = np.cumsum(gaps + (mean_ms - drawn_ms))
    offsets = offsets[sent < duration_s * 1e3]
    path.write_text("".join(f"{ms:.3f}\t{url}\n" for ms in offsets))
    return len(offsets)


def spread_streams(concurrency: int, most_connections: int) -> tuple[int, int]:
    """Connections and streams per connection that make exactly ``concurrency`` streams:
    the most connections up to ``most_connections`` that divide it. min(C, 4) connections of
    C // 4 streams ran C = 6 as 4 and C = 10 as 8 while the tables said 6 and 10 (found by a
    bench hunt)."""
    connections = max(
        n for n in range(1, max(1, min(concurrency, most_connections)) + 1) if concurrency % n == 0
    )
    return connections, max(1, concurrency // connections)


def h2load(
    port: int,
    request: Request,
    concurrency: int,
    duration_s: float,
    workdir: Path,
    rps: float = 0.0,
    nice: int = 0,
    poisson_seed: int | None = None,
    connections: int = MAX_CONNECTIONS,
    threads: int = 1,
    headers: Sequence[str] = (),
) -> Drive:
    """One h2load run posting ``request`` for ``duration_s`` with ``concurrency`` streams;
    with ``rps``, open loop: that many requests per second in all, whatever the answers do
    (up to ``concurrency`` outstanding). Paced by h2load's ``--rps`` per connection, or with
    ``poisson_seed``, at Poisson arrival times (a timing script, one connection): h2load
    1.52's ``--rps`` sends each connection's share in a burst every 10 ms (measured
    2026-11-24: bursts of 12-16 requests at 1,400 req/s, 87% of 1 ms bins empty), which
    queues a burst's last request behind the rest of it whatever the server does. ``nice``
    runs the client at that lower priority: on a machine whose cores the client shares with
    the server, the nearest this can come to a client on another machine. gRPC's streams go
    over at most ``connections`` connections, driven by ``threads`` h2load threads (more
    than one only where the client has cores of its own). ``headers``: more request headers
    ("grpc-timeout: 30m": each request's deadline)."""
    body_path, log_path = workdir / "body.bin", workdir / "h2load.log"
    body_path.write_bytes(request.body)
    log_path.unlink(missing_ok=True)
    url = f"http://127.0.0.1:{port}{request.path}"
    seed = poisson_seed if rps > 0 else None  # Poisson arrivals: open loop only
    if request.protocol == "rest":
        # HTTP/1.1: one request at a time per connection (no pipelining), as REST clients do.
        protocol = ["--h1", "-H", "content-type: application/json"]
        connections, streams = concurrency, 1
    else:
        protocol = ["-H", "content-type: application/grpc", "-H", "te: trailers"]
        connections, streams = spread_streams(concurrency, connections)
    if seed is not None:
        if request.protocol == "rest":
            raise ValueError("Poisson arrivals need HTTP/2 streams (one connection)")
        # Every client replays the whole script: one connection carries all the arrivals.
        script = workdir / "arrivals.tsv"
        poisson_script(script, url, rps, duration_s, seed)
        connections, streams, threads = 1, concurrency, 1
        pacing = [f"--timing-script-file={script}"]
    else:
        pacing = [f"--duration={int(duration_s * 1000)}ms"]
        pacing += [f"--rps={rps / connections:.3f}"] if rps > 0 else []
    argv = [
        *(["nice", "-n", str(nice)] if nice else []),
        shutil.which("h2load") or "h2load",
        f"--clients={connections}",
        f"--max-concurrent-streams={streams}",
        f"--threads={min(threads, connections)}", *pacing,
        f"--data={body_path}", f"--log-file={log_path}",
        *protocol,
        *(arg for header in headers for arg in ("-H", header)),
        *([] if seed is not None else [url]),
    ]  # fmt: skip
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run(argv, capture_output=True, text=True, timeout=duration_s + 60)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if out.returncode != 0:
        raise RuntimeError(f"h2load failed ({out.returncode}): {out.stderr or out.stdout}")
    log = log_path.read_text()
    done, rps, data, p50, p99 = parse_h2load(out.stdout, log)
    sent_rps = math.nan
    if seed is not None:
        # h2load's own rate counts its start-up; here: answers over the time from the first
        # request sent to the last answer (the script's length when the pool keeps up).
        rows = [f for f in (line.split("\t") for line in log.splitlines()) if len(f) > 2]
        if rows:
            starts = sorted(int(f[0]) for f in rows)
            last = max(int(f[0]) + int(f[2]) for f in rows)
            rps = done / max((last - starts[0]) / 1e6, duration_s)
            if starts[-1] > starts[0]:
                sent_rps = (len(starts) - 1) / ((starts[-1] - starts[0]) / 1e6)
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return Drive(done, rps, data, p50, p99, cpu, sent_rps)


def request_counts(metrics_url: str) -> dict[str, int]:
    """The front door's Predict answers by gRPC code (mpspool_requests_total)."""
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    counts: dict[str, int] = {}
    for line in text.splitlines():
        if line.startswith("mpspool_requests_total{") and 'method="Predict"' in line:
            code = re.search(r'code="([^"]+)"', line)
            if code:
                counts[code.group(1)] = int(float(line.rsplit(" ", 1)[1]))
    return counts


def cpu_seconds(processes: Sequence[psutil.Process]) -> float:
    total = 0.0
    for proc in processes:
        try:
            times = proc.cpu_times()
        except psutil.Error:
            return math.nan  # gone mid-window (restarted): no CPU figure for this role
        total += times.user + times.system
    return total


def measure(
    server: Server,
    request: Request,
    concurrency: int,
    duration_s: float,
    warmup_s: float,
    workdir: Path,
    checker: Checker,
    connections: int = MAX_CONNECTIONS,
    client_threads: int = 1,
) -> dict[str, Any]:
    """A checked answer, a warm-up, the measured window, a checked answer: one table row.

    Raises if any request of the window failed, whatever h2load says."""
    answer_bytes = checker.check(server, request)
    client = {"connections": connections, "threads": client_threads}
    if warmup_s > 0:
        h2load(server.port, request, concurrency, warmup_s, workdir, **client)
    counts = request_counts(server.metrics_url) if server.metrics_url else {}
    cpu = {role: cpu_seconds(procs) for role, procs in server.roles.items()}
    drive = h2load(server.port, request, concurrency, duration_s, workdir, **client)
    cpu = {role: cpu_seconds(procs) - cpu[role] for role, procs in server.roles.items()}
    problems = []
    if drive.done == 0:
        problems.append("h2load finished no request")
    if drive.data_bytes // answer_bytes < drive.done:
        problems.append(
            f"{drive.done} requests done but {drive.data_bytes} answer bytes came back, "
            f"{drive.data_bytes // answer_bytes} answers of {answer_bytes} bytes"
        )
    if server.metrics_url:
        after = request_counts(server.metrics_url)
        grew = {code: after.get(code, 0) - counts.get(code, 0) for code in after}
        ok = grew.pop("OK", 0)
        # h2load resets the streams still open when its window ends: the front door counts
        # them CANCELLED, at most one per stream — the warm-up's too, when the front door
        # counts those after the counter was read. More than that is a failure.
        if grew.get("CANCELLED", 0) <= (2 if warmup_s > 0 else 1) * concurrency:
            grew.pop("CANCELLED", None)
        errors = {code: n for code, n in grew.items() if n}
        if ok < drive.done or errors:
            problems.append(
                f"the front door answered {ok} OK and {errors or 'nothing else'} while h2load "
                f"finished {drive.done}"
            )
    if problems:
        raise RuntimeError(
            f"{server.name}, batch {request.batch}, concurrency {concurrency}: requests failed: "
            + "; ".join(problems)
        )
    checker.check(server, request)
    cpu["client"] = drive.cpu_s
    return {
        "system": server.name,
        "batch": request.batch,
        "concurrency": concurrency,
        "requests": drive.done,
        "rps": drive.rps,
        "rows_per_s": drive.rps * request.batch,
        "p50_ms": drive.p50_ms,
        "p99_ms": drive.p99_ms,
        "cpu_us": {role: s / drive.done * 1e6 for role, s in cpu.items()},
    }


def alternating(pools: dict[str, list[str]], rounds: int) -> list[tuple[int, str, list[str]]]:
    """(round, pool, arguments) in running order: every pool once per round, the order rotated
    each round so that none always runs first or last while the machine's speed drifts; round
    1 runs them in the order given."""
    names = list(pools)
    order = []
    for round_ in range(rounds):
        turn = names[round_ % len(names) :] + names[: round_ % len(names)]
        order += [(round_ + 1, name, pools[name]) for name in turn]
    return order


def timeline(pool: Pool, env: dict[str, str]) -> dict[str, Any]:
    """`mpspool timeline --clear`: the workers' model-call spans since the last clear."""
    out = subprocess.run(
        _mpspool("timeline", "--clear", "--run-dir", str(pool.run_dir)),
        cwd=tempfile.gettempdir(), env=env, capture_output=True, check=True, timeout=30,
    ).stdout  # fmt: skip
    return json.loads(out)


def pss_mib(processes: Sequence[psutil.Process]) -> float:
    """Total proportional set size of ``processes``."""
    total = 0
    for proc in processes:
        with contextlib.suppress(psutil.Error):
            total += proc.memory_full_info().pss
    return total / 2**20


# -- context -------------------------------------------------------------------------------
def command_line(module: str) -> str:
    python = sys.executable
    if python.startswith(f"{REPO}{os.sep}"):
        python = os.path.relpath(python, REPO)
    return shlex.join([python, "-m", module, *sys.argv[1:]])


def cpu_model() -> str:
    """The CPU's name, with its family, model and widest vector unit where /proc/cpuinfo says.

    A cloud VM's name is often just "AMD EPYC", and the same name has come with hosts whose
    model call differed 8x at batch 256 (a Zen 1 host with AVX2 against a newer one), so a
    result names what it ran on closely enough to tell such hosts apart.
    """
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or "unknown"
    return describe_cpu(cpuinfo)


def describe_cpu(cpuinfo: str) -> str:
    """cpu_model's words for the text of a /proc/cpuinfo (its first processor's fields)."""

    def field(name: str) -> str | None:
        match = re.search(rf"^{name}\s*:\s*(.+)$", cpuinfo, re.M)
        return match.group(1).strip() if match else None

    name = field("model name") or platform.processor() or "unknown"
    details = []
    family, model = field("cpu family"), field("model")
    if family is not None and model is not None:
        details.append(f"family {family} model {model}")
    flags = set((field("flags") or "").split())
    widest = next((f for f in ("avx512f", "avx2", "avx", "sse4_2") if f in flags), None)
    if widest is not None:
        details.append(widest.upper().replace("_", "."))
    return f"{name} ({', '.join(details)})" if details else name


def machine() -> dict[str, Any]:
    model = cpu_model()
    return {
        "cpu_model": model,
        "logical_cpus": os.cpu_count(),
        "usable_cores": usable_cores(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "kernel": platform.release(),
    }


def describe_machine() -> str:
    m = machine()
    return (
        f"{m['cpu_model']}, {m['usable_cores']} usable cores ({m['logical_cpus']} logical), "
        f"{m['memory_gib']} GiB, Linux {m['kernel']}"
    )


def load_average() -> str:
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


def versions() -> dict[str, str]:
    found = {"python": platform.python_version()}
    for dist in ("tensorflow-cpu", "tensorflow", "grpcio", "protobuf", "pyzmq", "numpy", "mpspool"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            found[dist] = importlib.metadata.version(dist)
    return found


# -- RESULTS.md ----------------------------------------------------------------------------
def write_section(path: Path, section: str, begin_mark: str, end_mark: str) -> None:
    """Replace one scenario's section of ``path`` (between its markers), or add it, leaving
    the rest alone: each scenario owns its own section of RESULTS.md."""
    text = path.read_text() if path.exists() else "# mpspool benchmark results\n\n"
    begin, end = text.find(begin_mark), text.find(end_mark)
    if begin != -1 and end != -1:
        rest = text[end + len(end_mark) :].lstrip("\n")
        text = text[:begin] + section + ("\n" + rest if rest else "")
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.write_text(text)


def table(header: Sequence[str], rows: Sequence[Sequence[Any]], right_from: int = 1) -> list[str]:
    """A markdown table; columns from ``right_from`` on are right-aligned."""
    align = ["---" if i < right_from else "---:" for i in range(len(header))]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines


def fmt(value: float | None, digits: int = 0) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return f"{value:,.{digits}f}"


# -- the scenario's main -------------------------------------------------------------------
def add_run_arguments(parser: argparse.ArgumentParser, quick: str) -> None:
    """The options the scenarios share: which code to freeze, a quick run (``quick`` says
    what it is), whether RESULTS.md is written, the raw report, notes for the report."""
    parser.add_argument(
        "--source", choices=("worktree", "HEAD", "live"), default="worktree",
        help="Python code under test, frozen into a temporary copy at the start (%(default)s)",
    )  # fmt: skip
    parser.add_argument("--quick", action="store_true", help=quick)
    parser.add_argument("--no-results", action="store_true", help="leave RESULTS.md alone")
    parser.add_argument("--json", type=Path, help="also write the raw report here")
    parser.add_argument("--note", action="append", default=[], help="a line for the report")


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


def add_output_arguments(parser: argparse.ArgumentParser, writes: str = "the JSON") -> None:
    """--source, --results, --no-results, --render (bench/memory.py's)."""
    parser.add_argument(
        "--source", choices=("worktree", "HEAD", "live"), default="worktree",
        help="Python code under test, frozen into a temporary copy at the start (%(default)s)",
    )  # fmt: skip
    parser.add_argument("--results", type=Path, help=f"markdown to update (default {RESULTS_MD})")
    parser.add_argument("--no-results", action="store_true", help=f"write {writes} only")
    parser.add_argument(
        "--render", type=Path, metavar="JSON", help="run nothing: render a raw file"
    )


def run_scenario(
    args: argparse.Namespace,
    run: Callable[[argparse.Namespace], dict[str, Any]],
    render: Callable[[dict[str, Any]], str],
    begin_mark: str,
    end_mark: str,
) -> int:
    """A scenario's main after its arguments (add_run_arguments): run it, SIGTERM unwinding
    what it started, keep its notes, write the raw report (--json), print its section and
    write it into RESULTS.md unless --quick or --no-results."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    with sigterm_as_exit():
        report = run(args)
    report["notes"] = args.note
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    text = render(report)
    print(text)
    if not (args.quick or args.no_results):
        write_section(RESULTS_MD, text, begin_mark, end_mark)
    return 0


@contextlib.contextmanager
def sigterm_as_exit() -> Iterator[None]:
    """SIGTERM unwinds like Ctrl-C, so every context manager on the way stops what it started.

    Raising from the handler is deliberate: a run is a sequence of blocking steps (h2load, a
    wait on the in-process pipes, a subprocess) with no loop that could poll a flag in time."""

    def handler(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def scenario_main(
    name: str,
    args: argparse.Namespace,
    run: Callable[[str], dict[str, Any]],
    render_markdown: Callable[[dict[str, Any], Path], str],
    notes: Callable[[dict[str, Any]], Sequence[str]] = lambda report: (),
    write_results: Callable[[Path, str], None] | None = None,
) -> int:
    """bench/memory.py's main(): --render, or the run with its raw JSON in bench/out/ (not
    committed), its section of RESULTS.md, its targets, notes and leftovers on stderr. Exit
    code 130 when interrupted, 1 when the run left anything behind."""
    assert write_results is not None
    results_md = None if args.no_results else args.results or (None if args.quick else RESULTS_MD)
    if args.render is not None:
        report = json.loads(args.render.read_text())
        write_results(args.results or RESULTS_MD, render_markdown(report, args.render.resolve()))
        return 0
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    started = time.monotonic()
    try:
        with sigterm_as_exit():
            report = run(stamp)
    except KeyboardInterrupt:
        print(f"{name}: interrupted; everything it started has been stopped", file=sys.stderr)
        return 130
    report["wall_s"] = round(time.monotonic() - started, 1)
    json_path = OUT_DIR / f"{name}-{'quick-' if args.quick else ''}{stamp}.json"
    json_path.write_text(json.dumps(report, indent=2) + "\n")
    if results_md is not None:
        write_results(results_md, render_markdown(report, json_path))
        print(f"{name}: updated {results_md}", file=sys.stderr)
    for t in report["summary"]["targets"]:
        state = "----" if t["met"] is None else "MET " if t["met"] else "MISS"
        print(f"{state} {t['target']}: {t['measured']:.2f} {t['unit']}", file=sys.stderr)
    for line in notes(report):
        print(f"{name}: {line}", file=sys.stderr)
    for item in report["leftovers"]:
        print(f"{name}: LEFT BEHIND: {item}", file=sys.stderr)
    return 1 if report["leftovers"] else 0
