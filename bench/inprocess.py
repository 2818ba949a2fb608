"""The in-process limit: P processes calling the SavedModel directly, with no RPC at all.

This is the ceiling a pool of P workers can approach on the same machine: each process loads
the model with ``tf.saved_model.load`` and calls its serving signature back to back on
pre-built tensors, with the thread settings a pool worker gets (intra-op = usable cores / P,
inter-op 1). The inputs are the ones the front-door bench's request carries (``REQUEST_SEED``;
h2load posts that one body), so both sides gather the same rows: measured 2026-11-25, 8
distinct inputs per process instead cost 1.2-1.7x the CPU per batch-256 call, by how many
gathered rows missed cache, which changed from one start of the processes to the next. Each
process is one closed-loop client of itself, so P processes are the in-process counterpart of
a pool of P workers at concurrency P. Everything a served request adds — gRPC, protobuf, the
router, ZeroMQ, copies — is what the pool pays above this.

Processes start with multiprocessing's "spawn" (TensorFlow must not inherit a forked
runtime), load once, and then run one measurement per command, all P in lock step (a barrier,
then the same warm-up and window), so several batch sizes cost one model load.

    python -m bench.inprocess --model-dir ~/.cache/mpspool/bench-demo-2000000/1 \\
        --rows 2000000 --processes 2 --batches 1,256 --duration 3
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import signal
import sys
import time
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Barrier
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np

from mpspool import cpusets

# Loading a 488 MiB table from disk on a busy 2-core machine can take a while; a process that
# has not reported in this long is broken, not slow.
LOAD_TIMEOUT_S = 300.0
# The seed of demo_inputs behind the front-door bench's one request per batch size.
REQUEST_SEED = 1
FEEDS = ("tensor", "numpy", "session")


def _child(
    conn: Connection,
    barrier: Barrier,
    model_dir: str,
    rows: int,
    intra: int,
    inter: int,
    index: int,
) -> None:
    """One process: load, then answer ("run", batch, warmup, duration, feed, seeds) until
    ("exit",)."""
    from mpspool import process

    # A bench that dies (or is killed) must not leave model-sized processes behind; Ctrl-C
    # reaches the whole terminal process group, and the parent decides how to stop.
    process.die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    try:
        import tensorflow as tf

        from mpspool.demo_model import demo_inputs

        tf.config.threading.set_intra_op_parallelism_threads(intra)
        tf.config.threading.set_inter_op_parallelism_threads(inter)
        loaded = tf.saved_model.load(model_dir, tags=["serve"])
        serve = loaded.signatures["serving_default"]
        session_call: Any = None  # built on the first "session" run: it costs a second copy
        conn.send(("loaded", os.getpid()))
    except Exception as exc:  # report why, then exit: the parent raises it
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return

    while True:
        command = conn.recv()
        if command[0] != "run":
            return
        _, batch, warmup_s, duration_s, feed, seeds = command
        # Pre-built tensors ("tensor"), like the load generator's pre-serialized requests: the
        # loop measures the model call, not input preparation. "numpy" feeds the arrays as a
        # worker has them after decoding a request, so the call includes converting them.
        # "session" calls a TF1 session on this thread with the arrays (see _session_call).
        # Every process cycles the same inputs, each from its own offset.
        inputs = [
            {
                k: tf.constant(v) if feed == "tensor" else v
                for k, v in demo_inputs(batch, rows, seed=seed).items()
            }
            for seed in seeds[index % len(seeds) :] + seeds[: index % len(seeds)]
        ]
        if feed == "session":
            if session_call is None:
                session_call = _session_call(tf, model_dir, intra, inter)
            call = session_call
        else:
            # .numpy() as a worker does: the answer must reach host memory to be sent.
            def call(batch_inputs: dict[str, Any]) -> Any:
                return serve(**batch_inputs)["score"].numpy()

        call(inputs[0])  # the first call at a new shape traces; not timed
        barrier.wait(LOAD_TIMEOUT_S)
        start = time.perf_counter()
        window_start, window_end = start + warmup_s, start + warmup_s + duration_s
        latencies: list[float] = []
        i = 0
        cpu_start = 0.0
        while True:
            t0 = time.perf_counter()
            if t0 >= window_end:
                break
            if not cpu_start and t0 >= window_start:
                cpu_start = time.process_time()
            call(inputs[i % len(inputs)])
            i += 1
            t1 = time.perf_counter()
            # Attributed by completion time, as the load generator does.
            if window_start <= t1 < window_end:
                latencies.append(t1 - t0)
        cpu_s = time.process_time() - cpu_start if cpu_start else 0.0
        conn.send(("result", latencies, cpu_s))


def _session_call(tf: Any, model_dir: str, intra: int, inter: int) -> Any:
    """The serving signature as TensorFlow's cheapest call: the SavedModel loaded into a TF1
    session (weights restored from the checkpoint) and called through a session callable on
    the caller's thread, as a pool worker calls it (worker/session_call.py)."""
    from tensorflow.core.protobuf.config_pb2 import CallableOptions

    from mpspool.worker.session_call import CALLER_THREAD, SessionCall

    graph = tf.Graph()
    config = tf.compat.v1.ConfigProto(
        intra_op_parallelism_threads=intra, inter_op_parallelism_threads=inter
    )
    session = tf.compat.v1.Session(graph=graph, config=config)
    with graph.as_default():
        meta_graph = tf.compat.v1.saved_model.loader.load(session, ["serve"], model_dir)
    signature = meta_graph.signature_def["serving_default"]
    aliases = sorted(signature.inputs)
    options = CallableOptions(
        feed=[signature.inputs[a].name for a in aliases], fetch=[signature.outputs["score"].name]
    )
    options.run_options.inter_op_thread_pool = CALLER_THREAD
    return SessionCall(session, options, aliases, ["score"])


class InProcessLimit:
    """P loaded processes, ready to run closed loops at any batch size on command.

    A context manager: leaving it (normally, on an exception or on Ctrl-C) stops and reaps
    every process it started.
    """

    def __init__(
        self,
        model_dir: str | Path,
        rows: int,
        processes: int,
        intra_op_threads: int = 0,
        inter_op_threads: int = 1,
    ) -> None:
        if processes < 1:
            raise ValueError(f"processes must be at least 1, got {processes}")
        self.model_dir = str(model_dir)
        self.rows = rows
        self.processes = processes
        # The pool's rule for unpinned workers (cpusets.plan): the core budget shared.
        unpinned = cpusets.plan("", processes, os.sched_getaffinity(0), None, cpusets.quota_cores())
        self.intra = intra_op_threads or unpinned.worker_threads(0)
        self.inter = inter_op_threads
        self.pids: list[int] = []
        self.load_s = 0.0
        self._procs: list[mp.process.BaseProcess] = []
        self._conns: list[Connection] = []

    def __enter__(self) -> InProcessLimit:
        ctx = mp.get_context("spawn")
        barrier = ctx.Barrier(self.processes)
        started = time.monotonic()
        try:
            for index in range(self.processes):
                parent, child = ctx.Pipe()
                proc = ctx.Process(
                    target=_child,
                    args=(child, barrier, self.model_dir, self.rows, self.intra, self.inter, index),
                    name=f"inprocess-{index}",
                    daemon=True,
                )
                proc.start()
                child.close()
                self._procs.append(proc)
                self._conns.append(parent)
            for conn in self._conns:
                kind, value = self._receive(conn, LOAD_TIMEOUT_S)
                if kind != "loaded":
                    raise RuntimeError(f"an in-process benchmark process failed to load: {value}")
                self.pids.append(int(value))
        except BaseException:
            self.close()
            raise
        self.load_s = time.monotonic() - started
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _receive(self, conn: Connection, timeout_s: float) -> tuple[Any, ...]:
        if not conn.poll(timeout_s):
            raise TimeoutError(f"an in-process benchmark process was silent for {timeout_s} s")
        try:
            return conn.recv()
        except EOFError:
            codes = [p.exitcode for p in self._procs]
            raise RuntimeError(
                f"an in-process benchmark process died (exit codes {codes})"
            ) from None

    def run(
        self,
        batch: int,
        duration_s: float,
        warmup_s: float = 1.0,
        feed: str = "tensor",
        seeds: tuple[int, ...] = (REQUEST_SEED,),
    ) -> dict[str, Any]:
        """All P processes run a closed loop at ``batch`` together; the summed throughput.

        ``seeds``: the demo_inputs every process cycles through; the default is the front-door
        bench's request, several make the gathered rows miss cache as varied traffic does.

        ``feed``: "tensor" (pre-built tf.constant inputs: the model call alone), "numpy"
        (the arrays a worker decodes, converted by the call) or "session" (the arrays fed to a
        TF1 session callable on the caller's thread, the call a pool worker makes). Latency
        percentiles are over every call of every process in the window.
        """
        if feed not in FEEDS:
            raise ValueError(f"feed must be one of {', '.join(FEEDS)}, got {feed!r}")
        if not seeds:
            raise ValueError("seeds must name at least one input")
        for conn in self._conns:
            conn.send(("run", batch, warmup_s, duration_s, feed, list(seeds)))
        latencies: list[float] = []
        cpu_s = 0.0
        per_process = []
        for conn in self._conns:
            # Tracing a new batch shape plus the run itself; generous on a noisy machine.
            _, lat, cpu = self._receive(conn, warmup_s + duration_s + 120.0)
            latencies.extend(lat)
            cpu_s += cpu
            per_process.append(len(lat) / duration_s)
        lat_ms = np.asarray(latencies) * 1e3
        calls = int(lat_ms.size)
        p50, p90, p99 = (
            (float(v) for v in np.percentile(lat_ms, [50, 90, 99]))
            if calls
            else (float("nan"),) * 3
        )
        return {
            "mode": "inprocess",
            "processes": self.processes,
            "intra_op_threads": self.intra,
            "inter_op_threads": self.inter,
            "batch": batch,
            "feed": feed,
            "seeds": list(seeds),
            "warmup_s": warmup_s,
            "duration_s": duration_s,
            "ok": calls,
            "throughput_rps": calls / duration_s,
            "rows_per_s": calls * batch / duration_s,
            "per_process_rps": per_process,
            "p50_ms": p50,
            "p90_ms": p90,
            "p99_ms": p99,
            "mean_ms": float(lat_ms.mean()) if calls else float("nan"),
            "cpu_us_per_call": cpu_s / calls * 1e6 if calls else None,
        }

    def close(self) -> None:
        """Ask each process to exit, then terminate and reap whatever is left."""
        for conn in self._conns:
            try:
                conn.send(("exit",))
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + 10.0
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.terminate()
                proc.join(5.0)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self._conns:
            conn.close()
        self._procs.clear()
        self._conns.clear()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.inprocess", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--model-dir", type=Path, required=True, help="a version directory")
    parser.add_argument("--rows", type=int, required=True, help="the model's embedding rows")
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--batches", default="1,256", help="comma-separated batch sizes")
    parser.add_argument("--duration", type=float, default=3.0)
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument(
        "--feed",
        default="tensor",
        help="comma-separated: tensor (pre-built tensors), numpy (arrays, as a worker has "
        "them), session (arrays, a TF1 session callable on the caller's thread)",
    )
    parser.add_argument(
        "--seeds",
        type=lambda s: tuple(int(x) for x in s.split(",")),
        default=(REQUEST_SEED,),
        help="comma-separated demo_inputs seeds every process cycles through (default: the "
        "front-door bench's request; several make the gathered rows miss cache)",
    )
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    results = []
    with InProcessLimit(args.model_dir, args.rows, args.processes) as limit:
        for batch in (int(b) for b in args.batches.split(",")):
            for feed in args.feed.split(","):
                result = limit.run(batch, args.duration, args.warmup, feed, args.seeds)
                results.append(result)
                print(
                    f"P={args.processes} batch={batch} feed={feed}: "
                    f"{result['throughput_rps']:,.1f} calls/s "
                    f"{result['rows_per_s']:,.0f} rows/s p50={result['p50_ms']:.2f} ms "
                    f"p99={result['p99_ms']:.2f} ms cpu {result['cpu_us_per_call']:,.0f} µs/call"
                )
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
