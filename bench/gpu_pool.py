"""The pool on a real GPU: h2load → the front door → K workers sharing one GPU through MPS,
against K processes calling the same model directly, in the same run.

bench/gpu_mps.py measured what MPS gives K processes that call the model back to back. This
asks what is left of it when the calls come through the pool: a native client (h2load) over
gRPC to the front door binary (`mpspool-router`, started as the controller starts it), the
wire protocol to K worker processes with the pool's own serving loop and socket
(bench/echo_worker.py `serve`, worker/dealer.py), each making the model call on the GPU as an
MPS client of the pool's daemon (mps/control.py). TensorFlow cannot be carried to the lent GPU
machine, so the model call is bench/gpu_mps.py's PyTorch stand-in for the demo model (same
shape, same weights in every worker); everything around the call is the pool's.

For each K: the K direct processes (gpu_mps's clients, one call at a time each), then the pool
with K workers at K streams (one request per worker, as the direct processes) and at 4K (a
queue at the front door, so a worker's next request is there when it answers). Then the front
door's own ceiling on this machine's cores: echo workers, h2load with several threads.

Two steps (the GPU machine has no TensorFlow, which this repository's report helpers need):
  on the GPU machine:  python3 -m bench.gpu_pool --json OUT.json --mps-control PATH
  here:                .venv/bin/python -m bench.gpu_pool --render OUT.json   (RESULTS.md)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from bench import echo_worker, gpu_mps, harness
from mpspool import dtypes, wire
from mpspool.demo_model import DENSE_FEATURES, ID_COUNT, demo_inputs

MODEL = "demo"
OUTPUT = "score"
BEGIN = "<!-- gpu-pool:begin (written by bench/gpu_pool.py; edits here are lost) -->"
END = "<!-- gpu-pool:end -->"
STREAMS_PER_WORKER = (1, 4)
ECHO_CONCURRENCY = (64, 256)
WORKER_READY_S = 240.0  # K processes importing torch and building a 2M-row table at once
STATS_DIR_ENV = "MPSPOOL_BENCH_WORKER_STATS"
# --enable-batching as bench/batching.py runs it: a batch is what waits while a worker
# computes, up to 64 rows (at least the largest request sent: the front door refuses a
# request above max_batch_size, as TF Serving does), no timeout.
BATCHING = {"batching": True, "max_batch_size": 64, "batch_timeout_micros": 0}
STATS_EVERY_S = 0.25


# --- the worker: the pool's serving loop around the stand-in model call ----------------------


def signature_defs() -> bytes:
    """The demo model's serving signature: ids int64 [-1, 16], dense float [-1, 13] → score."""
    from mpspool.protos import serving_pb2

    sigs = serving_pb2.SignatureDefMap()
    sig = sigs.signature_def["serving_default"]
    sig.method_name = "tensorflow/serving/predict"
    for side, name, dtype, width in (
        (sig.inputs, "ids", dtypes.DT_INT64, ID_COUNT),
        (sig.inputs, "dense", dtypes.DT_FLOAT, DENSE_FEATURES),
        (sig.outputs, OUTPUT, dtypes.DT_FLOAT, 1),
    ):
        info = side[name]
        info.name = f"{name}:0"
        info.dtype = dtype
        info.tensor_shape.dim.add(size=-1)
        info.tensor_shape.dim.add(size=width)
    return sigs.SerializeToString()


def answerer(
    call: Callable[[np.ndarray, np.ndarray], np.ndarray],
) -> Callable[[dict[str, Any], list[memoryview]], tuple[list[Any], list[Any]]]:
    """A REQUEST's tensors → ``call(ids, dense)`` → the REPLY's tensors."""

    def answer(header: dict[str, Any], frames: list[memoryview]) -> tuple[list[Any], list[Any]]:
        inputs = wire.decode_tensors(header["tensors"], frames)
        scores = call(inputs["ids"], inputs["dense"])
        return wire.encode_tensors({OUTPUT: np.asarray(scores, dtype=np.float32)})

    return answer


class CallClock:
    """What a worker's model calls take: calls, seconds inside them, and the serving
    thread's CPU seconds inside them, written to ``path`` (JSON, replaced whole) every
    STATS_EVERY_S by a thread of its own. The parent reads it around each window: how much of
    a worker's CPU per request is the model call, and how much the loop around it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.totals = {"calls": 0, "rows": 0, "call_s": 0.0, "call_cpu_s": 0.0}
        self._stop = threading.Event()
        self._writer = threading.Thread(target=self._write_often, daemon=True)
        self._writer.start()

    def close(self) -> None:
        """The last totals written, and the writer ended (a worker's ends with it)."""
        self._stop.set()
        self._writer.join()

    def timed(self, call: Callable[..., Any]) -> Callable[..., Any]:
        def timed_call(*args: Any) -> Any:
            cpu, wall = time.thread_time(), time.perf_counter()
            try:
                return call(*args)
            finally:
                wall = time.perf_counter() - wall
                cpu = time.thread_time() - cpu
                self.totals = {"calls": self.totals["calls"] + 1,
                               "rows": self.totals["rows"] + len(args[0]),
                               "call_s": self.totals["call_s"] + wall,
                               "call_cpu_s": self.totals["call_cpu_s"] + cpu}  # fmt: skip

        return timed_call

    def _write_often(self) -> None:
        partial = self.path.with_suffix(".partial")
        while True:
            partial.write_text(json.dumps(self.totals))  # one snapshot: a new dict per call
            os.replace(partial, self.path)
            if self._stop.wait(STATS_EVERY_S):
                partial.write_text(json.dumps(self.totals))
                os.replace(partial, self.path)
                return


def worker_main(
    run_dir: str, slot: str, rows: int, device: str, spin_us: float = 0.0, premade: bool = False
) -> int:
    import torch

    model = gpu_mps.demo_model_call(rows, seed=0, device_name=device)
    made = {b: [torch.from_numpy(a) for a in demo_inputs(b, rows, seed=7).values()]
            for b in (1, 256)}  # fmt: skip

    def call(ids: np.ndarray, dense: np.ndarray) -> np.ndarray:
        if premade:  # the request's own values, as tensors made once (an experiment)
            return model(*made[len(ids)]).numpy()
        # Copies: the arrays are views of the socket's buffer, which the next read reuses.
        return model(torch.from_numpy(ids.copy()), torch.from_numpy(dense.copy())).numpy()

    for batch in (1, 256):  # as a worker warms up before READY
        inputs = demo_inputs(batch, rows, seed=1)
        for _ in range(10):
            call(inputs["ids"], inputs["dense"])
    stats_dir = os.environ.get(STATS_DIR_ENV)
    if stats_dir:
        call = CallClock(Path(stats_dir) / f"{slot}.json").timed(call)
    return echo_worker.serve(run_dir, slot, MODEL, signature_defs(), answerer(call),
                             spin_s=spin_us / 1e6)  # fmt: skip


def worker_counters(stats_dir: Path, workers: Sequence[psutil.Process]) -> dict[str, float]:
    """The workers' CallClock totals and CPU seconds, summed: the serving thread's (the
    process's main thread) and every other thread's (CUDA's, PyTorch's)."""
    out = {"calls": 0.0, "rows": 0.0, "call_s": 0.0, "call_cpu_s": 0.0, "main_cpu_s": 0.0,
           "other_cpu_s": 0.0}  # fmt: skip
    for path in stats_dir.glob("*.json"):
        for key, value in json.loads(path.read_text()).items():
            out[key] += value
    for proc in workers:
        for thread in proc.threads():
            key = "main_cpu_s" if thread.id == proc.pid else "other_cpu_s"
            out[key] += thread.user_time + thread.system_time
    return out


# --- the run, on the GPU machine ---------------------------------------------------------------


def run_on_gpu(args: argparse.Namespace) -> dict[str, Any]:
    from mpspool.mps import gpus
    from mpspool.mps.control import MpsDaemon, find_control_binary

    report: dict[str, Any] = {
        **gpu_mps.run_header("bench.gpu_pool"),
        "cpu": harness.cpu_model(),
        "window_s": args.window,
        "warmup_s": args.warmup,
        "rows": args.rows,
        "sets": [],  # the direct processes (gpu_mps's records)
        "pool": [],
        "echo": [],
        "failed": [],
    }
    save = gpu_mps.saver(args.json, report)
    backend = gpus.backend()
    run_dir = Path(tempfile.mkdtemp(prefix="mpspool-gpu-"))
    daemons: list[subprocess.Popen[bytes]] = []
    try:
        gpu = backend.devices()[0]
        report["gpu"] = gpu.describe()
        sampler = gpu_mps.UtilisationSampler(backend, gpu.uuid)
        daemon = MpsDaemon(0, gpu.uuid, find_control_binary(args.mps_control),
                           run_dir / "pipe", run_dir / "log")  # fmt: skip
        daemon_process = gpu_mps.start_daemon(daemon, run_dir / "daemon.out")
        daemons.append(daemon_process)
        daemon.wait_ready()
        limit_mib = gpu.memory_total // max(args.contexts) // 2**20  # config.pinned_limit_mib
        report["mps_defaults"] = daemon.apply_defaults(100.0, limit_mib)
        plain_env = {**os.environ, "CUDA_VISIBLE_DEVICES": gpu.uuid}
        env = {**plain_env, **daemon.environment()}
        requests = {
            b: harness.predict_request(f"demo batch {b}", MODEL, demo_inputs(b, args.rows, seed=7))
            for b in args.batch_list
        }
        checker = harness.Checker()
        with tempfile.TemporaryDirectory() as workdir:
            sets = [("mps", k, env) for k in args.contexts]
            sets += [("plain", k, plain_env) for k in args.no_mps]
            for mode, k, set_env in sets:
                if mode == "plain" and daemon_process.poll() is None:
                    quit_daemon(daemon, daemon_process, report)  # no daemon at all for these
                mps = daemon if mode == "mps" else None
                gpu_mps.run_sets(args, mode, set_env, sampler, report, save, mps, [k])
                for batching in (False, True) if args.batching else (False,):
                    for spin_us in args.spins:
                        record = {"mode": mode, "k": k, "batching": batching,
                                  "spin_us": spin_us, "windows": []}  # fmt: skip
                        report["pool"].append(record)
                        try:
                            pool_set(args, record, set_env, sampler, mps, requests, checker,
                                     Path(workdir), save)  # fmt: skip
                        except Exception as exc:
                            report["failed"].append(
                                f"pool {mode} k={k} spin {spin_us}: {type(exc).__name__}: {exc}"
                            )
                        save()
            if daemon_process.poll() is None:
                quit_daemon(daemon, daemon_process, report)
            if args.echo_workers:
                report["echo"] = echo_ceiling(args, Path(workdir))
    except Exception as exc:
        report["failed"].append(f"{type(exc).__name__}: {exc}")
    finally:
        gpu_mps.end_run(daemons, backend, run_dir, save)
    return report


def quit_daemon(daemon: Any, process: subprocess.Popen[bytes], report: dict[str, Any]) -> None:
    """`quit`, as the pool stops; how the daemon ended goes into the report."""
    daemon.quit()
    try:
        report["daemon_exit"] = process.wait(15)
    except subprocess.TimeoutExpired:
        report["daemon_exit"] = "no exit 15 s after quit"  # end_run kills it


def pool_set(
    args: argparse.Namespace,
    record: dict[str, Any],
    env: dict[str, str],
    sampler: gpu_mps.UtilisationSampler,
    daemon: Any,
    requests: dict[int, harness.Request],
    checker: harness.Checker,
    workdir: Path,
    save: Callable[[], None],
) -> None:
    """The front door over ``record["k"]`` stand-in workers, each batch size at K and 4K
    streams, each window appended to ``record`` as it ends (a failure later keeps it); with
    ``daemon``, the workers are its MPS clients; with ``record["batching"]``, the front door
    merges the requests waiting while each worker computes (--enable-batching)."""
    k = record["k"]
    command = [sys.executable, "-m", "bench.gpu_pool", "--worker", "--rows", str(args.rows),
               "--device", args.device, "--spin-us", str(record["spin_us"])]  # fmt: skip
    command += ["--premade-inputs"] if args.premade_inputs else []
    most = max([BATCHING["max_batch_size"], *requests])
    settings = {**BATCHING, "max_batch_size": most} if record["batching"] else {}
    stats_dir = Path(tempfile.mkdtemp(prefix="worker-stats-", dir=workdir))
    env = {**env, STATS_DIR_ENV: str(stats_dir)}
    with echo_worker.worker_pool(k, MODEL, command, env, WORKER_READY_S, **settings) as server:
        if daemon is not None:
            record["mps_clients"] = sum(len(daemon.clients(s)) for s in daemon.servers())
        workers = server.roles["workers"]
        for batch, request in requests.items():
            for streams in STREAMS_PER_WORKER:
                time.sleep(2 * STATS_EVERY_S)  # the last window's totals written
                before = worker_counters(stats_dir, workers)
                with sampler.sampling() as usage:
                    window = harness.measure(server, request, streams * k, args.window,
                                             args.warmup, workdir, checker)  # fmt: skip
                time.sleep(2 * STATS_EVERY_S)
                after = worker_counters(stats_dir, workers)
                window.update(usage, **per_model_call(before, after, window["requests"] * batch))
                record["windows"].append(window)
                save()
                print(f"pool k={k} b{batch} C{streams * k}: {window['rps']:,.0f} req/s",
                      file=sys.stderr, flush=True)  # fmt: skip


def per_model_call(
    before: dict[str, float], after: dict[str, float], rows_answered: int
) -> dict[str, Any]:
    """The workers' counters over one measure() (its checks and warm-up too: the same load)
    per model call. Counters that did not move as far as the window's answered rows (a
    worker's stats file missing or stale) give None, not a figure."""
    calls, rows = after["calls"] - before["calls"], after["rows"] - before["rows"]
    if calls <= 0 or rows < rows_answered:
        stale = f"{calls:g} calls, {rows:g} rows for {rows_answered} rows answered"
        return {"worker_us_per_call": None, "rows_per_call": None, "worker_counters": stale}
    per_call = {
        key: (after[key] - before[key]) / calls * 1e6
        for key in after
        if key not in ("calls", "rows")
    }
    return {"worker_us_per_call": per_call, "rows_per_call": rows / calls}


def echo_ceiling(args: argparse.Namespace, workdir: Path) -> list[dict[str, Any]]:
    """The front door over echo workers, the client with threads of its own: its ceiling
    on this machine's cores, no GPU."""
    rows = np.zeros((1, 29), np.float32)
    request = harness.predict_request("echo", echo_worker.MODEL, {"x": rows})
    request.output = "x"
    windows = []
    checker = harness.Checker()  # every answer equal to the first
    with echo_worker.echo_pool(args.echo_workers) as server:
        for concurrency in ECHO_CONCURRENCY:
            window = harness.measure(
                server, request, concurrency, args.window, args.warmup, workdir,
                checker, connections=args.echo_connections,
                client_threads=args.echo_client_threads,
            )  # fmt: skip
            window.update(workers=args.echo_workers, connections=args.echo_connections,
                          client_threads=args.echo_client_threads)  # fmt: skip
            windows.append(window)
    return windows


# --- the report (here) -------------------------------------------------------------------------


def render(reports: Sequence[dict[str, Any]], gaps: Sequence[dict[str, Any]] = ()) -> str:
    """The section: every run in ``reports`` in order, then ``gaps`` (bench/gpu_mps.py
    reports of one process with --gap-us) as one table."""
    lines = [
        BEGIN,
        "## The pool on a real GPU: the front door over K workers sharing the GPU through MPS",
        "",
        "On lent GPU machines, not the 2-core machine; rendered here with `.venv/bin/python -m "
        "bench.gpu_pool --render FILE …` from the runs' reports. The model call is a "
        "stand-in (TensorFlow cannot be carried there): bench/gpu_mps.py's PyTorch demo model "
        f"({reports[0]['rows']:,} × 64 table, 16 ids mean-pooled, an MLP; the same weights in "
        "every worker) on the GPU, inputs copied in and the answer copied out. Everything "
        "around the call is the pool's: h2load (gRPC, TF Serving's Predict) → `mpspool-router` "
        "→ the wire protocol → K worker processes with the pool's serving loop and socket "
        "(bench/echo_worker.py `serve`, worker/dealer.py), MPS clients of the pool's daemon "
        "(mps/control.py, 100% of the threads). *direct*: gpu_mps's K processes calling the "
        "same model back to back, in the same run just before the pool with the same K. Every "
        "answer is counted by the front door and two per window are checked (batch rows, the "
        "same values as the first answer).",
        "",
    ]
    for number, report in enumerate(reports, 1):
        lines += _run_lines(number, report)
    if gaps:
        lines += _gap_lines(gaps)
    lines += [
        "calls/s: answers per second, all K together; × direct: over the direct processes at "
        "the same K and batch; p50/p99: h2load's per request (direct: each call, the median "
        "of the processes' medians, the worst process's p99); CPU per call: psutil user + "
        "system time of the process role over the window (workers: all K; direct: the K "
        "processes); GPU %: NVML's utilisation, mean of samples every 0.2 s, for the pool over "
        "the whole window with its checks and warm-up, for the direct processes inside their "
        "window (so the pool's reads a little low). *batching*: "
        "the pool with `--enable-batching` (max_batch_size 64 or the largest batch sent, no "
        "timeout: a batch is what "
        "waits while a worker computes). *Where a worker's CPU goes*: the serving thread's "
        "time inside the model call (PyTorch's call, the inputs copied from the socket's "
        "buffer to tensors and the answer back to numpy) and outside it (the loop: socket "
        "reads and writes, the wire protocol's headers and tensors), timed in the worker "
        "(`CallClock`) and from its threads' CPU times over each window with its checks and "
        "warm-up; per model call, which with batching serves *rows per call* rows (at batch 1, "
        "that many requests).",
        "",
        END,
        "",
    ]
    return "\n".join(lines)


def _run_lines(number: int, report: dict[str, Any]) -> list[str]:
    from bench.harness import fmt, table

    if not report["pool"]:
        raise SystemExit(f"run {number} holds no pool set that ran: {report.get('failed')}")
    direct = {(s["mode"], s["k"], w["batch"]): w for s in report["sets"] for w in s["windows"]}
    lines = [
        f"### Run {number}: {report['date']}",
        "",
        f"{report.get('nvidia_smi', '?')} (name, driver, compute mode, memory), "
        f"{report['cpus']} CPU cores ({report['cpu']}), kernel {report['kernel']}. Command "
        f"there: `{report['command']}`. Windows: {report['warmup_s']:g} s warm-up, "
        f"{report['window_s']:g} s measured.",
        "",
    ]
    header = ["batch", "K", "how", "calls/s", "× direct", "p50 µs", "p99 µs",
              "front door µs/call", "workers µs/call", "GPU %"]  # fmt: skip
    rows: list[list[Any]] = []
    shown: set[tuple[str, int, int]] = set()  # direct rows written
    for batch in report_batches(report):
        for record in report["pool"]:
            k, mode = record["k"], record.get("mode", "mps")
            base = direct.get((mode, k, batch))
            how = ("" if mode == "mps" else ", no MPS") + (
                ", batching" if record.get("batching") else ""
            )
            spin = record.get("spin_us", 0)
            spun = f", spin {spin:g} µs" if spin else ""
            if base and not record.get("batching") and (mode, k, batch) not in shown:
                shown.add((mode, k, batch))
                rows.append([batch, k, f"direct{how}", fmt(base["calls_per_s"]), "1",
                             fmt(base["p50_us"]), fmt(base["p99_us"]), "–",
                             fmt(base["cpu_us_per_call"]),
                             fmt(base.get("utilization_gpu_mean"))])  # fmt: skip
            for w in (w for w in record["windows"] if w["batch"] == batch):
                ratio = fmt(w["rps"] / base["calls_per_s"], 2) + "×" if base else "–"
                cpu = w["cpu_us"]
                rows.append([batch, k, f"pool{how}{spun}, {w['concurrency']} in flight",
                             fmt(w["rps"]), ratio,
                             fmt(w["p50_ms"] * 1e3), fmt(w["p99_ms"] * 1e3),
                             fmt(cpu["front door"]), fmt(cpu["workers"]),
                             fmt(w.get("utilization_gpu_mean"))])  # fmt: skip
    lines += [*table(header, rows, right_from=3), ""]
    split = worker_split_rows(report, direct)
    if split:
        header = ["batch", "K", "", "in flight", "rows per call", "direct CPU µs/call",
                  "call wall µs", "call CPU µs", "serving thread outside the call µs",
                  "other threads µs"]  # fmt: skip
        lines += ["Where a worker's CPU goes, per model call:", "",
                  *table(header, split, right_from=3), ""]  # fmt: skip
    if report["echo"]:
        first = report["echo"][0]
        lines += [
            f"The front door's own ceiling on these {report['cpus']} cores, no GPU: "
            f"{first['workers']} echo workers (bench/echo_worker.py), a 1-row request, h2load "
            f"with {first['client_threads']} threads over {first['connections']} connections:",
            "",
        ]
        header = ["streams", "req/s", "p50 µs", "p99 µs", "front door µs/req",
                  "workers µs/req", "client µs/req"]  # fmt: skip
        rows = [[w["concurrency"], fmt(w["rps"]), fmt(w["p50_ms"] * 1e3),
                 fmt(w["p99_ms"] * 1e3), fmt(w["cpu_us"]["front door"], 1),
                 fmt(w["cpu_us"]["workers"], 1), fmt(w["cpu_us"]["client"], 1)]
                for w in report["echo"]]  # fmt: skip
        lines += [*table(header, rows), ""]
    lines += [*(f"- {line}" for line in checks(report)), ""]
    return lines


def _gap_lines(gaps: Sequence[dict[str, Any]]) -> list[str]:
    """One process (K=1, no MPS) calling back to back and idling between calls."""
    from bench.harness import fmt, table

    rows = []
    for report in gaps:
        gap = re.search(r"--gap-us (\S+)", report["command"])
        for record in (s for s in report["sets"] if s["k"] == 1 and s["mode"] == "plain"):
            for w in record["windows"]:
                idle = fmt(float(gap.group(1)) if gap else 0.0)
                spun = gap and float(gap.group(1)) and "--gap-spin" in report["command"]
                rows.append([report["date"], f"{idle}, spinning" if spun else idle,
                             w["batch"], fmt(w["calls_per_s"]), fmt(w["p50_us"]),
                             fmt(w["p99_us"]), fmt(w["cpu_us_per_call"])])  # fmt: skip
    header = ["run", "idle after each call µs", "batch", "calls/s", "call p50 µs",
              "call p99 µs", "CPU µs/call"]  # fmt: skip
    return [
        "### One direct process idling between calls, as a worker waits for its next request",
        "",
        f"`{gaps[0]['command']}`, then the same with each other --gap-us listed: one process, "
        f"its own CUDA context, no MPS; {len(gaps)} runs back to back on one machine "
        f"({gaps[0].get('nvidia_smi', '?')}), in the order listed. p50 and p99 time the call "
        "alone, not the idle time. *spinning*: with --gap-spin, the process spins on its CPU "
        "through the idle time instead of sleeping.",
        "",
        *table(header, rows, right_from=1),
        "",
    ]


def worker_split_rows(
    report: dict[str, Any], direct: dict[tuple[str, int, int], dict[str, Any]]
) -> list[list[Any]]:
    from bench.harness import fmt

    rows = []
    for batch in report_batches(report):
        for record in report["pool"]:
            mode = record.get("mode", "mps")
            base = direct.get((mode, record["k"], batch))
            for w in (w for w in record["windows"] if w["batch"] == batch):
                split = w.get("worker_us_per_call")
                if not split:
                    continue
                how = ["no MPS"] if mode != "mps" else []
                how += ["batching"] if record.get("batching") else []
                how += [f"spin {record['spin_us']:g} µs"] if record.get("spin_us") else []
                rows.append([batch, record["k"], ", ".join(how),
                             w["concurrency"], fmt(w.get("rows_per_call"), 1),
                             fmt(base["cpu_us_per_call"]) if base else "–",
                             fmt(split["call_s"]), fmt(split["call_cpu_s"]),
                             fmt(split["main_cpu_s"] - split["call_cpu_s"]),
                             fmt(split["other_cpu_s"])])  # fmt: skip
    return rows


def report_batches(report: dict[str, Any]) -> list[int]:
    return sorted({w["batch"] for r in report["pool"] for w in r["windows"]})


def checks(report: dict[str, Any]) -> list[str]:
    out = [f"GPU {report.get('gpu')}; the daemon's defaults read back {report['mps_defaults']}."]
    for record in report["pool"]:
        answered = sum(w["requests"] for w in record["windows"])
        seen = (
            f"with the pool's workers up, the daemon listed {record['mps_clients']} client(s)"
            if "mps_clients" in record
            else "no MPS"
        )
        batching = " (batching)" if record.get("batching") else ""
        out.append(
            f"K={record['k']}{batching}, {seen}: {answered:,} requests answered OK over its "
            "windows, none failed."
        )
    for record in report["pool"]:
        for w in record["windows"]:
            for note in ("worker_counters", "utilization_error"):
                if w.get(note):
                    where = f"K={record['k']}, batch {w['batch']}, {w['concurrency']} in flight"
                    out.append(f"{where}: no {note.replace('_', ' ')} figure ({w[note]}).")
    for record in report["sets"]:
        errors = sorted({e for w in record["windows"] for e in w["errors"]})
        if errors:
            out.append(f"direct {record['mode']} K={record['k']}: failed calls: {errors}.")
    if report.get("failed"):
        out.append(f"Steps that failed: {report['failed']}.")
    out.append(f"`quit`: the daemon exited {report.get('daemon_exit')}.")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the raw report here (GPU machine)")
    parser.add_argument(
        "--render", type=Path, action="append",
        help="write RESULTS.md's section from these reports, a table each, in order",
    )  # fmt: skip
    parser.add_argument(
        "--gaps", type=Path, action="append", default=[],
        help="with --render: bench/gpu_mps.py reports made with --gap-us, one table",
    )  # fmt: skip
    parser.add_argument("--results", type=Path, default=harness.RESULTS_MD)
    parser.add_argument("--contexts", default="1,2,4,8", help="K values (%(default)s)")
    parser.add_argument(
        "--no-mps", default="1",
        help="K values also run without MPS, after the daemon's quit (%(default)s; '' none)",
    )  # fmt: skip
    parser.add_argument("--batches", default="1,256", help="batch sizes (%(default)s)")
    parser.add_argument("--window", type=float, default=4.0, help="seconds measured per window")
    parser.add_argument("--warmup", type=float, default=1.0, help="seconds of h2load warm-up")
    parser.add_argument("--rows", type=int, default=gpu_mps.ROWS, help="embedding rows")
    parser.add_argument("--mps-control", help="the control binary (else PATH)")
    parser.add_argument("--device", default="cuda", help="where the model runs (cpu: dry run)")
    parser.add_argument(
        "--batching", action="store_true",
        help="each pool also with --enable-batching (max_batch_size 64 or the largest batch, "
        "no timeout)",
    )  # fmt: skip
    parser.add_argument(
        "--worker-spin-us", default="0",
        help="each pool once per value: how long a worker reads its socket without sleeping "
        "before it waits (%(default)s)",
    )  # fmt: skip
    parser.add_argument("--spin-us", type=float, default=0.0, help=argparse.SUPPRESS)
    parser.add_argument(
        "--premade-inputs", action="store_true",
        help="workers call the model with tensors made at start from the same values as the "
        "request's, not from the request (an experiment: what the request's path costs)",
    )  # fmt: skip
    parser.add_argument("--echo-workers", type=int, default=8, help="0: no echo ceiling")
    parser.add_argument("--echo-connections", type=int, default=8)
    parser.add_argument("--echo-client-threads", type=int, default=4)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("rest", nargs="*", help=argparse.SUPPRESS)  # --worker: RUN_DIR SLOT
    parser.set_defaults(gap_us=0.0)  # gpu_mps's direct clients: back to back
    args = parser.parse_args(argv)
    if args.worker:
        return worker_main(*args.rest, rows=args.rows, device=args.device,
                           spin_us=args.spin_us, premade=args.premade_inputs)  # fmt: skip
    if args.rest:
        parser.error(f"unrecognized arguments: {' '.join(args.rest)}")
    if args.render:
        reports = [json.loads(path.read_text()) for path in args.render]
        gaps = [json.loads(path.read_text()) for path in args.gaps]
        harness.write_section(args.results, render(reports, gaps), BEGIN, END)
        return 0
    args.contexts = [int(k) for k in args.contexts.split(",")]
    args.no_mps = [int(k) for k in args.no_mps.split(",") if k]
    args.batch_list = [int(b) for b in args.batches.split(",")]
    args.spins = [float(s) for s in args.worker_spin_us.split(",")]
    report = run_on_gpu(args)
    brief = {k: v for k, v in report.items() if k not in ("sets", "pool", "echo")}
    print(json.dumps(brief, default=str)[:4000])
    return 0 if not report["failed"] else 1


if __name__ == "__main__":
    sys.exit(main())
