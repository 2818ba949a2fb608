"""A worker that only echoes: the front door's own ceiling, without TensorFlow.

Speaks the worker side of mpspool/wire.py like worker/serve.py does (READY with a
SignatureDefMap, heartbeats from the serving loop, one REPLY per REQUEST) for a model whose
serving signature maps a float tensor `x` [-1, -1] to itself, and answers each request with
its own tensor frames. `python -m bench.echo_worker RUN_DIR SLOT`; ``echo_pool`` starts the
front door binary (`mpspool-router --run-dir DIR`, as the controller does) over N of them.
``serve`` and ``worker_pool`` are the same loop and pool for other stand-ins
(bench/gpu_pool.py's GPU workers).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import psutil
import zmq

from bench.harness import REPO, Server
from mpspool import dtypes, process, wire
from mpspool.config import PoolConfig
from mpspool.errors import Code
from mpspool.protos import serving_pb2
from mpspool.router import THREADS_ENV, binary_path, runtime_threads
from mpspool.worker.dealer import Dealer

MODEL = "echo"


def signature_defs() -> bytes:
    sigs = serving_pb2.SignatureDefMap()
    sig = sigs.signature_def["serving_default"]
    sig.method_name = "tensorflow/serving/predict"
    for side in (sig.inputs, sig.outputs):
        info = side["x"]
        info.name = "x:0"
        info.dtype = dtypes.DT_FLOAT
        info.tensor_shape.dim.add(size=-1)
        info.tensor_shape.dim.add(size=-1)
    return sigs.SerializeToString()


def serve(
    run_dir: str,
    slot: str,
    model: str,
    signatures: bytes,
    answer: Callable[[dict[str, Any], list[memoryview]], tuple[list[Any], list[Any]]],
    spin_s: float = 0.0,
) -> int:
    """A worker's serving loop over the pool's socket: READY, heartbeats, and for each REQUEST
    ``answer(header, tensor frames)`` -> (REPLY's tensor metas, its frames); a call that
    raises is answered with ERROR (INTERNAL), as a worker answers a failed model call."""
    process.die_with_parent()
    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
    pid = os.getpid()
    ready = [wire.pack(wire.Kind.READY, slot=slot, pid=pid, model=model, version=1, weights=None),
             signatures]  # fmt: skip
    sock = Dealer(
        wire.socket_path(run_dir, wire.WORKERS_ENDPOINT),
        wire.worker_identity(slot, pid),
        ready,
        wake_on_signals=True,
        spin_s=spin_s,
    )
    next_beat = time.monotonic() + wire.HEARTBEAT_INTERVAL_S
    while not stop["now"]:
        if sock.poll(max(0, int((next_beat - time.monotonic()) * 1000))):
            frames = sock.recv_multipart()
            header = wire.unpack(frames[0])
            kind = wire.kind_of(header)
            if kind is wire.Kind.REQUEST:
                try:
                    metas, out = answer(header, frames[1:])
                except Exception as exc:
                    message = f"{type(exc).__name__}: {exc}"
                    sock.send(wire.pack(wire.Kind.ERROR, id=header["id"], code=Code.INTERNAL,
                                        message=message))  # fmt: skip
                else:
                    head = wire.pack(wire.Kind.REPLY, id=header["id"], tensors=metas)
                    sock.send_multipart([head, *out])
            elif kind is wire.Kind.REREGISTER:
                sock.send_multipart(ready)
        if time.monotonic() >= next_beat:
            sock.send(wire.pack(wire.Kind.HEARTBEAT, slot=slot, pid=pid, served=0))
            next_beat = time.monotonic() + wire.HEARTBEAT_INTERVAL_S
    sock.send(wire.pack(wire.Kind.BYE, slot=slot, pid=pid))
    sock.close()
    return 0


def main(run_dir: str, slot: str) -> int:
    return serve(run_dir, slot, MODEL, signature_defs(),
                 lambda header, frames: (header["tensors"], frames))  # fmt: skip


@contextlib.contextmanager
def echo_pool(workers: int) -> Iterator[Server]:
    """The front door binary over ``workers`` echo workers, in a private run directory."""
    with worker_pool(workers, MODEL, [sys.executable, "-m", "bench.echo_worker"]) as server:
        yield server


@contextlib.contextmanager
def worker_pool(
    workers: int,
    model: str,
    command: Sequence[str],
    env: dict[str, str] | None = None,
    ready_timeout_s: float = 30.0,
    **settings: Any,
) -> Iterator[Server]:
    """The front door binary, as the controller starts it, over ``workers`` processes of
    ``command RUN_DIR SLOT`` (run from the repository, with ``env``) serving ``model``;
    ``settings``: the pool's other PoolConfig fields (batching, say)."""
    run_dir = Path(tempfile.mkdtemp(prefix="mpfd-"))  # 0700, and short: ipc:// paths in it
    procs: list[subprocess.Popen[bytes]] = []
    try:
        config = PoolConfig(
            model_name=model, model_base_path=str(run_dir), model_version=1,
            run_dir=str(run_dir), log_dir=str(run_dir), workers=workers, port=0,
            metrics_port=0, **settings,
        )  # fmt: skip
        config.save(run_dir)
        # The front door's threads as a pool's controller gives them (cpusets.py decides).
        threads = runtime_threads(config.placement().front_door_threads)
        with open(run_dir / "router.log", "wb") as log:
            procs.append(subprocess.Popen(
                [binary_path(), "--run-dir", str(run_dir)], stderr=log,
                env={**os.environ, THREADS_ENV: threads},
                preexec_fn=process.die_with_parent_sigterm,
            ))  # fmt: skip
        for slot in range(workers):
            procs.append(subprocess.Popen(
                [*command, str(run_dir), f"{model}-{slot}"], cwd=REPO, env=env,
                preexec_fn=process.die_with_parent_sigterm,
            ))  # fmt: skip
        port, metrics_port = _wait_registered(run_dir, procs, ready_timeout_s)
        yield Server(
            name=f"{model} {workers}w",
            port=port,
            roles={
                "front door": [psutil.Process(procs[0].pid)],
                "workers": [psutil.Process(p.pid) for p in procs[1:]],
            },
            metrics_url=f"http://127.0.0.1:{metrics_port}/metrics",
            model=model,
        )
    finally:
        stop_processes(procs)
        shutil.rmtree(run_dir, ignore_errors=True)


def stop_processes(procs: Sequence[subprocess.Popen[bytes]]) -> None:
    """SIGTERM to each, then each waited for (10 s, then SIGKILL)."""
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _wait_registered(
    run_dir: Path, procs: Sequence[subprocess.Popen[bytes]], timeout_s: float
) -> tuple[int, int]:
    """Ask the front door's control channel until every worker is registered; its ports.
    A process that ends meanwhile fails the wait at once."""
    workers = len(procs) - 1
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(wire.endpoint(str(run_dir), wire.CONTROL_ENDPOINT))
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            ended = [(p.args, p.returncode) for p in procs if p.poll() is not None]
            if ended:
                raise RuntimeError(f"the pool in {run_dir} lost a process: {ended}")
            sock.send_multipart([b"", wire.pack(op="snapshot", n=1)])
            if sock.poll(500):
                snap = wire.unpack(sock.recv_multipart()[-1])
                if len(snap.get("workers", {})) == workers and snap.get("port"):
                    return int(snap["port"]), int(snap["metrics_port"])
            time.sleep(0.1)
    finally:
        sock.close()
    raise TimeoutError(f"the pool in {run_dir} did not come up in {timeout_s} s")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
