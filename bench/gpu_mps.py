"""MPS on a real GPU: the pool's own GPU code driving NVIDIA's MPS, with K processes making
small-batch model calls on one GPU, with and without MPS.

What runs is the code a GPU pool runs: `mps/gpus.py` (NVML: the GPU, its compute mode and the
warning about it, usage, Xid events) and `mps/control.py` (one control daemon per GPU started
as the controller starts it, `-f` with the daemon's own pipe and log directories and the GPU's
UUID; readiness; the pool's defaults — active thread percentage and the per-client pinned
memory limit, device memory / contexts; the server and client lists `mpspool status` shows;
`terminate_client` then `quit` as on stop; the fault lines the controller watches for).

The clients stand in for pool workers. TensorFlow cannot be carried to the lent GPU machine,
so they are PyTorch processes running the demo model's shape (mpspool/demo_model.py: a
2,000,000 x 64 float32 table, 16 ids per example mean-pooled, 13 dense features, an MLP of
256 and 128 units) the way a worker runs a request: inputs from host memory to the GPU, the
forward pass, the answer back to the host, one call at a time, back to back. K processes, one
per context, all start their windows at the same instant.

Two steps, because the GPU machine has no TensorFlow and this repository's report helpers
import it indirectly:
  on the GPU machine:  python3 -m bench.gpu_mps --json OUT.json      (torch, nvidia-ml-py)
  here:                .venv/bin/python -m bench.gpu_mps --render OUT.json   (RESULTS.md;
                       earlier runs first, each with its own --render, for a line each)
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import itertools
import json
import os
import platform
import select
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

# The demo model's shape (mpspool/demo_model.py); copied, not imported, so that a client
# process needs nothing of mpspool.
ROWS = 2_000_000
ID_COUNT = 16
EMBEDDING_DIM = 64
DENSE_FEATURES = 13
HIDDEN_UNITS = (256, 128)
INPUT_SETS = 8  # distinct inputs cycled per batch size, made before the windows
GAP_S = 0.5  # between one batch size's window and the next
BEGIN = "<!-- gpu-mps:begin (written by bench/gpu_mps.py; edits here are lost) -->"
END = "<!-- gpu-mps:end -->"


# --- the model: what a worker's call does, in PyTorch ----------------------------------------


def demo_model_call(rows: int, seed: int, device_name: str = "cuda") -> Any:
    """The demo model's shape on the GPU (``device_name``: "cpu" for a dry run), its weights
    drawn from ``seed``: a function of (ids [b, 16] int64, dense [b, 13] float32), CPU
    tensors, to the scores [b, 1] on the CPU, waiting for the GPU as a worker waits for its
    answer."""
    import torch
    import torch.nn.functional as F

    device = torch.device(device_name)
    generator = torch.Generator().manual_seed(seed)
    with torch.inference_mode():
        # Drawn from the seed by a generator on the device, so that every process with one
        # seed has the same weights (the pool's workers answer alike).
        on_device = torch.Generator(device=device).manual_seed(seed)
        table = torch.empty(rows, EMBEDDING_DIM, device=device)
        table.normal_(0, 0.05, generator=on_device)
        sizes = (EMBEDDING_DIM + DENSE_FEATURES, *HIDDEN_UNITS, 1)
        layers = [
            (
                (torch.randn(n_in, n_out, generator=generator) / n_in**0.5).to(device),
                torch.zeros(n_out, device=device),
            )
            for n_in, n_out in itertools.pairwise(sizes)
        ]

    def call(ids: Any, dense: Any) -> Any:
        with torch.inference_mode():
            pooled = F.embedding(ids.to(device), table).mean(1)
            x = torch.cat([pooled, dense.to(device)], 1)
            for i, (weight, bias) in enumerate(layers):
                x = x @ weight + bias
                x = torch.relu(x) if i < len(layers) - 1 else torch.sigmoid(x)
            return x.cpu()  # waits for the GPU, as a worker waits for its answer

    return call


# --- a client: one process, one context ---------------------------------------------------------


def client_main(args: argparse.Namespace) -> int:
    """Build the model on the GPU, warm up, say ready, wait for the start time, then run one
    window per batch size; print the results and wait for "exit" on stdin (so that the
    parent can ask the MPS daemon about this client while it is still connected)."""
    import torch

    def say(message: dict[str, Any]) -> None:
        print(json.dumps(message), flush=True)

    batches = [int(b) for b in args.batches.split(",")]
    generator = torch.Generator().manual_seed(args.seed)
    call = demo_model_call(args.rows, args.seed, args.device)

    inputs = {
        b: [
            (
                torch.randint(0, args.rows, (b, ID_COUNT), generator=generator),
                torch.rand(b, DENSE_FEATURES, generator=generator),
            )
            for _ in range(INPUT_SETS)
        ]
        for b in batches
    }
    for b in batches:
        for i in range(30):
            call(*inputs[b][i % INPUT_SETS])
    on_gpu = args.device == "cuda"
    free, total = torch.cuda.mem_get_info() if on_gpu else (None, None)
    say({"ready": os.getpid(), "mem_get_info": [free, total]})
    start = float(json.loads(sys.stdin.readline())["start"])
    results = []
    for position, b in enumerate(batches):
        begin = start + position * (args.window + GAP_S)
        time.sleep(max(0.0, begin - time.time()))
        latencies: list[float] = []
        error = None
        cpu_before, wall_before = time.process_time(), time.time()
        try:
            while time.time() < begin + args.window:
                t = time.perf_counter()
                call(*inputs[b][len(latencies) % INPUT_SETS])
                latencies.append(time.perf_counter() - t)
                if args.gap_us:  # idle between calls, as a worker waits for its next request
                    if args.gap_spin:  # the thread stays on its core (no sleep)
                        until = time.perf_counter() + args.gap_us / 1e6
                        while time.perf_counter() < until:
                            pass
                    else:
                        time.sleep(args.gap_us / 1e6)
        except Exception as exc:
            error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        results.append(
            {
                "batch": b,
                "calls": len(latencies),
                "seconds": time.time() - wall_before,
                "cpu_s": time.process_time() - cpu_before,
                "p50_us": _quantile(latencies, 0.5),
                "p99_us": _quantile(latencies, 0.99),
                "error": error,
            }
        )
    say({"results": results})
    sys.stdin.readline()  # "exit", or EOF when the parent is gone
    return 0


def probe_main(args: argparse.Namespace) -> int:
    """What the pinned-memory limit does to one client: cudaMemGetInfo, then allocations of
    half the limit and of a whole limit more (1.5x in all)."""
    import torch

    free, total = torch.cuda.mem_get_info()
    held = []
    steps = []
    for mib in (args.probe_mib // 2, args.probe_mib):
        try:
            held.append(torch.empty(mib * 2**20, dtype=torch.uint8, device="cuda"))
            steps.append({"mib": mib, "ok": True})
        except torch.OutOfMemoryError as exc:
            steps.append({"mib": mib, "ok": False, "error": str(exc).splitlines()[0]})
    print(json.dumps({"mem_get_info": [free, total], "allocations": steps}), flush=True)
    return 0


def _quantile(samples: list[float], q: float) -> float | None:
    if not samples:
        return None
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e6


# --- the parent: the pool's GPU code around K clients -------------------------------------------


class Clients:
    """K client processes started together; each line they print is one JSON message."""

    def __init__(
        self,
        args: argparse.Namespace,
        env: dict[str, str],
        k: int,
        batches: str,
        gap_us: float | None = None,
    ):
        command = [sys.executable, "-m", "bench.gpu_mps", "--client", "--batches", batches]
        command += ["--rows", str(args.rows), "--window", str(args.window)]
        gap = args.gap_us if gap_us is None else gap_us
        command += ["--device", args.device, "--gap-us", str(gap)]
        if getattr(args, "gap_spin", False):
            command.append("--gap-spin")
        self.processes = [
            subprocess.Popen(
                [*command, "--seed", str(i)],
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            for i in range(k)
        ]

    def read_each(self, timeout_s: float = 180.0) -> list[dict[str, Any]]:
        """One message from each client; a client that says nothing in time (a CUDA call
        hung on a dead server, say) is an error, not a hang of the whole run."""
        deadline = time.monotonic() + timeout_s
        messages = []
        for process in self.processes:
            assert process.stdout is not None
            remaining = deadline - time.monotonic()
            if not select.select([process.stdout], [], [], max(0.0, remaining))[0]:
                raise RuntimeError(f"client {process.pid} said nothing in {timeout_s:.0f} s")
            line = process.stdout.readline()
            if not line:
                raise RuntimeError(f"client {process.pid} ended: exit {process.wait()}")
            messages.append(json.loads(line))
        return messages

    def start(self, delay_s: float = 0.5) -> float:
        start = time.time() + delay_s
        for process in self.processes:
            assert process.stdin is not None
            process.stdin.write(json.dumps({"start": start}) + "\n")
            process.stdin.flush()
        return start

    def exit(self, timeout_s: float = 30.0) -> list[int | None]:
        for process in self.processes:
            try:
                assert process.stdin is not None
                process.stdin.write("exit\n")
                process.stdin.close()
            except (BrokenPipeError, OSError):
                pass
        codes: list[int | None] = []
        for process in self.processes:
            try:
                codes.append(process.wait(timeout_s))
            except subprocess.TimeoutExpired:
                process.kill()
                codes.append(None)
        return codes

    def kill(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
                process.wait()


class UtilisationSampler:
    """NVML's utilisation and memory, through the backend `mpspool status` reads."""

    def __init__(self, backend: Any, uuid: str) -> None:
        self.backend, self.uuid = backend, uuid

    def during(self, begin: float, end: float, every_s: float = 0.2) -> dict[str, float]:
        time.sleep(max(0.0, begin - time.time()))
        return self.until(lambda: time.time() >= end, every_s)

    @contextlib.contextmanager
    def sampling(self, every_s: float = 0.2) -> Iterator[dict[str, Any]]:
        """Samples from a thread while the block runs; the dict yielded is filled at its end."""
        done = threading.Event()
        usage: dict[str, Any] = {}

        def sample() -> None:
            try:
                usage.update(self.until(done.is_set, every_s))
            except Exception as exc:  # NVML failed: the window says so instead of a figure
                usage["utilization_error"] = f"{type(exc).__name__}: {exc}"

        thread = threading.Thread(target=sample)
        thread.start()
        try:
            yield usage
        finally:
            done.set()
            thread.join()

    def until(self, stop: Callable[[], bool], every_s: float) -> dict[str, float]:
        samples = []
        while not stop():
            samples.append(self.backend.usage(self.uuid))
            time.sleep(every_s)
        if not samples:
            return {}
        return {
            "utilization_gpu_mean": statistics.fmean(s.utilization_gpu for s in samples),
            "memory_used_mib_max": max(s.memory_used for s in samples) / 2**20,
        }


def run_set(
    args: argparse.Namespace,
    env: dict[str, str],
    k: int,
    sampler: UtilisationSampler,
    daemon: Any = None,
) -> tuple[dict[str, Any], Clients]:
    """K clients through one window per batch size; returns the record and the clients, still
    connected (the caller ends them)."""
    clients = Clients(args, env, k, args.batches)
    try:
        return _windows(args, clients, sampler, daemon), clients
    except BaseException:
        clients.kill()
        raise


def _windows(
    args: argparse.Namespace, clients: Clients, sampler: UtilisationSampler, daemon: Any
) -> dict[str, Any]:
    batches = [int(b) for b in args.batches.split(",")]
    k = len(clients.processes)
    ready = clients.read_each(timeout_s=120)
    start = clients.start()
    record: dict[str, Any] = {"k": k, "mem_get_info": ready[0].get("mem_get_info"), "windows": []}
    for position, batch in enumerate(batches):
        begin = start + position * (args.window + GAP_S)
        usage = sampler.during(begin + 0.5, begin + args.window - 0.2)
        window: dict[str, Any] = {"batch": batch, **usage}
        if daemon is not None and position == 0:
            servers = daemon.servers()
            window["mps_servers"] = servers
            window["mps_clients"] = sum(len(daemon.clients(s)) for s in servers)
        record["windows"].append(window)
    for message in clients.read_each(timeout_s=len(batches) * (args.window + GAP_S) + 60):
        for window, result in zip(record["windows"], message["results"], strict=True):
            window.setdefault("clients", []).append(result)
    for window in record["windows"]:
        per_client = window["clients"]
        calls = sum(c["calls"] for c in per_client)
        window["calls_per_s"] = sum(c["calls"] / c["seconds"] for c in per_client)
        window["rows_per_s"] = window["calls_per_s"] * window["batch"]
        window["cpu_us_per_call"] = sum(c["cpu_s"] for c in per_client) / max(calls, 1) * 1e6
        window["p50_us"] = statistics.median(c["p50_us"] or 0 for c in per_client)
        window["p99_us"] = max(c["p99_us"] or 0 for c in per_client)
        window["errors"] = [c["error"] for c in per_client if c["error"]]
    return record


def start_daemon(daemon: Any, log_path: Path) -> subprocess.Popen[bytes]:
    """As supervisord runs it for the controller (supervisor/gpu_watch.py's program)."""
    daemon.prepare_dirs()
    with log_path.open("wb") as log:
        return subprocess.Popen(
            daemon.command(),
            env={**os.environ, **daemon.environment()},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def mps_server_pids() -> list[int]:
    import psutil

    return [
        p.pid for p in psutil.process_iter(["name"]) if p.info["name"] == "nvidia-cuda-mps-server"
    ]


def run_on_gpu(args: argparse.Namespace) -> dict[str, Any]:
    from mpspool.mps import gpus
    from mpspool.mps.control import MpsDaemon, MpsError, fault_lines, find_control_binary

    report = {**run_header("bench.gpu_mps"), "window_s": args.window, "rows": args.rows,
              "sets": [], "failed": []}  # fmt: skip
    save = saver(args.json, report)
    backend = gpus.backend()  # NVML here; MPSPOOL_FAKE_GPUS for a dry run without a GPU
    run_dir = Path(tempfile.mkdtemp(prefix="mpspool-gpu-"))  # 0700, as the pool's run dir
    daemons: list[subprocess.Popen[bytes]] = []  # every one started: the finally ends them
    try:
        gpu = backend.devices()[0]
        report["gpu"] = {
            "described": gpu.describe(),
            "compute_mode": gpu.compute_mode,
            "memory_total_mib": gpu.memory_total // 2**20,
            "compute_mode_warnings": gpus.compute_mode_warnings([gpu]),
            "xid_events": backend.xid_events(),
        }
        sampler = UtilisationSampler(backend, gpu.uuid)
        plain_env = {**os.environ, "CUDA_VISIBLE_DEVICES": gpu.uuid}
        try:
            binary = find_control_binary(args.mps_control)
        except MpsError as exc:
            report["mps_error"] = str(exc)
            binary = None
        if args.plain_first:
            run_sets(args, "plain", plain_env, sampler, report, save)
        if binary:
            report["mps_control"] = binary
            daemon = MpsDaemon(0, gpu.uuid, binary, run_dir / "pipe", run_dir / "log")
            log_path = run_dir / "daemon.out"
            daemon_process = start_daemon(daemon, log_path)
            daemons.append(daemon_process)
            daemon.wait_ready()
            contexts = max(args.contexts)
            limit_mib = gpu.memory_total // contexts // 2**20  # config.pinned_limit_mib
            report["mps_defaults"] = daemon.apply_defaults(100.0, limit_mib)
            report["pinned_limit_mib"] = limit_mib
            mps_env = {**plain_env, **daemon.environment()}
            try:
                probe = subprocess.run(
                    [sys.executable, "-m", "bench.gpu_mps", "--probe-mib", str(limit_mib)],
                    env=mps_env, capture_output=True, text=True, timeout=120,
                )  # fmt: skip
                report["probe_mps"] = _last_json(probe.stdout) or probe.stderr[-2000:]
            except subprocess.TimeoutExpired:
                report["failed"].append("pinned-limit probe: no answer in 120 s")
            save()
            run_sets(args, "mps", mps_env, sampler, report, save, daemon=daemon)
            try:
                report["fault"] = fault_step(args, mps_env, daemon, log_path, fault_lines)
            except Exception as exc:
                report["failed"].append(f"fault step: {type(exc).__name__}: {exc}")
            save()
            daemon.quit()
            try:
                report["daemon_exit"] = daemon_process.wait(15)
            except subprocess.TimeoutExpired:
                report["daemon_exit"] = "no exit 15 s after quit"
            report["daemon_output"] = log_path.read_text(errors="replace")[-6000:]
            for name in ("control.log", "server.log"):
                if (run_dir / "log" / name).exists():
                    report[name] = (run_dir / "log" / name).read_text(errors="replace")[-4000:]
            report["server_pids_after_quit"] = mps_server_pids()
            if args.split:
                k = max(args.contexts)
                split_dirs = (run_dir / "split-pipe", run_dir / "split-log")
                split = MpsDaemon(0, gpu.uuid, binary, *split_dirs)
                daemons.append(start_daemon(split, run_dir / "split.out"))
                try:
                    split.wait_ready()
                    # --active-thread-percentage split: 100 / contexts of the SMs each.
                    percentage = round(100.0 / k, 2)
                    report["split_defaults"] = split.apply_defaults(percentage, limit_mib)
                    split_env = {**plain_env, **split.environment()}
                    run_sets(args, "mps-split", split_env, sampler, report, save, split, [k])
                    split.quit()
                    daemons[-1].wait(15)
                except Exception as exc:
                    report["failed"].append(f"mps split k={k}: {type(exc).__name__}: {exc}")
                save()
        if not args.plain_first:
            run_sets(args, "plain", plain_env, sampler, report, save)
        report["xid_events_after"] = backend.xid_events()
    finally:
        end_run(daemons, backend, run_dir, save)
    return report


def run_header(module: str) -> dict[str, Any]:
    """When, how and where a GPU run ran."""
    header: dict[str, Any] = {
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": shlex.join(["python3", "-m", module, *sys.argv[1:]]),
        "cpus": os.cpu_count(),
        "kernel": platform.release(),
    }
    smi = shutil.which("nvidia-smi")
    if smi:
        query = "name,driver_version,compute_mode,memory.total"
        header["nvidia_smi"] = subprocess.run(
            [smi, f"--query-gpu={query}", "--format=csv,noheader"], capture_output=True, text=True
        ).stdout.strip()
    return header


def end_run(
    daemons: Sequence[subprocess.Popen[bytes]], backend: Any, run_dir: Path, save: Any
) -> None:
    """On every way out of a run: the daemons it started killed (their servers with them),
    NVML closed, the run directory removed, the report saved."""
    for daemon_process in daemons:
        if daemon_process.poll() is None:
            os.killpg(daemon_process.pid, signal.SIGKILL)
            daemon_process.wait()
    backend.close()
    shutil.rmtree(run_dir, ignore_errors=True)
    save()


def run_sets(
    args: argparse.Namespace,
    mode: str,
    env: dict[str, str],
    sampler: UtilisationSampler,
    report: dict[str, Any],
    save: Any,
    daemon: Any = None,
    ks: Sequence[int] | None = None,
) -> None:
    """One set per K (``args.contexts`` unless ``ks``) in ``env``: "plain" is each process's
    own CUDA context, time-sliced; with ``daemon``, its MPS clients, the last set ended as
    the pool stops: terminate_client for every client, then the workers. A set that fails is
    recorded and the next one runs."""
    ks = list(args.contexts if ks is None else ks)
    for k in ks:
        try:
            record, clients = run_set(args, env, k, sampler, daemon)
        except Exception as exc:
            report["failed"].append(f"{mode} k={k}: {type(exc).__name__}: {exc}")
            continue
        record["mode"] = mode
        if daemon is not None and k == ks[-1]:
            record["terminated"] = daemon.terminate_clients()
        record["exit_codes"] = clients.exit(timeout_s=15)
        report["sets"].append(record)
        save()
        print(f"{mode} k={k}: {_brief(record)}", file=sys.stderr, flush=True)


def fault_step(
    args: argparse.Namespace, env: dict[str, str], daemon: Any, log_path: Path, fault_lines: Any
) -> dict[str, Any]:
    """Kill the MPS server under two busy clients: what the clients see, and whether the
    daemon's output carries a line the controller takes for a server fault."""
    seen_before = len(log_path.read_text(errors="replace"))
    clients = Clients(args, env, 2, "1", gap_us=0.0)  # busy clients, whatever --gap-us says
    try:
        clients.read_each()
        start = clients.start()  # one window of batch 1; the server dies a third of the way
        time.sleep(max(0.0, start + args.window / 3 - time.time()))
        servers = daemon.servers()  # this daemon's own: not another user's on the machine
        for pid in servers:
            os.kill(pid, signal.SIGKILL)
        results = [m["results"][0] for m in clients.read_each(timeout_s=args.window + 30)]
        codes = clients.exit(timeout_s=15)
    finally:
        clients.kill()
    time.sleep(1.0)  # the daemon notices its server's end
    text = log_path.read_text(errors="replace")[seen_before:]
    return {
        "killed_server_pids": servers,
        "client_calls": [r["calls"] for r in results],
        "client_errors": [r["error"] for r in results],
        "client_exit_codes": codes,
        "fault_lines": fault_lines(text),
        "daemon_output": text[-3000:],
        "daemon_answers_after": daemon.ready(),
    }


def saver(path: Path | None, report: dict[str, Any]) -> Callable[[], None]:
    """A function that writes ``report`` to ``path`` as JSON (nothing without a path)."""

    def save() -> None:  # after every step: a run cut off still leaves what it measured
        if path is not None:
            path.write_text(json.dumps(report, indent=1, default=str))

    return save


def _last_json(text: str) -> Any:
    for line in reversed(text.splitlines()):
        try:
            return json.loads(line)
        except ValueError:
            continue
    return None


def _brief(record: dict[str, Any]) -> str:
    return ", ".join(
        f"b{w['batch']} {w['calls_per_s']:,.0f} calls/s p50 {w['p50_us']:.0f} us "
        f"util {w.get('utilization_gpu_mean', 0):.0f}%{' ERR' if w['errors'] else ''}"
        for w in record["windows"]
    )


# --- the report (here, with the repository's report helpers) ---------------------------------


def render(report: dict[str, Any], others: Sequence[dict[str, Any]] = ()) -> str:
    """The section: ``report`` in full, then one line of each run in ``others`` and it."""
    from bench.harness import fmt, table

    if not any(s["mode"] in ("mps", "plain") for s in report["sets"]):
        raise SystemExit(f"the report holds no set that ran: {report.get('failed')}")
    sets = {(s["mode"], s["k"]): s for s in report["sets"]}
    ks = sorted({s["k"] for s in report["sets"] if s["mode"] in ("mps", "plain")})
    batches = [w["batch"] for w in report["sets"][0]["windows"]]
    lines = [
        BEGIN,
        "## MPS on a real GPU: K processes on one GPU, with and without the pool's MPS daemon",
        "",
        f"{report['date']}, on a lent GPU machine: {report.get('nvidia_smi', '?')} "
        f"(name, driver, compute mode, memory), {report['cpus']} CPU cores, kernel "
        f"{report['kernel']}. Command there: `{report['command']}`; this section rendered here "
        "with `.venv/bin/python -m bench.gpu_mps --render FILE` (a `--render` per run, this "
        "one last). Unlike every other section, "
        "this one did not run on the 2-core machine, and its clients are PyTorch stand-ins for "
        "workers (TensorFlow cannot be carried to that machine): the demo model's shape "
        f"({report['rows']:,} × {EMBEDDING_DIM} table) on the GPU, inputs copied in and the "
        "answer copied out on every call, one call at a time per process, "
        f"{report['window_s']:g} s windows starting together. The daemon, its defaults, its "
        "queries, the stop sequence and NVML are the pool's own code (`mps/control.py`, "
        f"`mps/gpus.py`). One run; {_order(report)}.",
        "",
    ]
    for position, batch in enumerate(batches):
        lines += [f"### Batch {batch}", ""]
        header = ["K"]
        for mode in ("MPS", "no MPS"):
            header += [f"{mode} calls/s", "× K=1", "p50 µs", "p99 µs", "CPU µs/call", "GPU %"]
        header.append("MPS / no MPS")
        rows = []
        for k in ks:
            row: list[Any] = [k]
            both = []
            for mode in ("mps", "plain"):
                record, one = sets.get((mode, k)), sets.get((mode, ks[0]))
                if record is None:
                    row += ["–"] * 6
                    both.append(None)
                    continue
                window = record["windows"][position]
                base = one["windows"][position]["calls_per_s"] if one else None
                util = fmt(window.get("utilization_gpu_mean"))
                if window["errors"]:
                    util += f" ({len(window['errors'])} failed)"
                row += [
                    fmt(window["calls_per_s"]),
                    fmt(window["calls_per_s"] / base, 2) + "×" if base else "–",
                    fmt(window["p50_us"]),
                    fmt(window["p99_us"]),
                    fmt(window["cpu_us_per_call"]),
                    util,
                ]
                both.append(window["calls_per_s"])
            mps, plain = both
            row.append(fmt(mps / plain, 2) + "×" if mps and plain else "–")
            rows.append(row)
        lines += [*table(header, rows), ""]
    split = [s for s in report["sets"] if s["mode"] == "mps-split"]
    if split:
        k = split[0]["k"]
        lines += [
            f"### K = {k} with `--active-thread-percentage split` "
            f"({report['split_defaults']['active_thread_percentage']}% of the SMs each)",
            "",
        ]
        rows = []
        for record in (sets.get(("mps", k)), split[0]):
            if record is None:
                continue
            label = "split" if record["mode"] == "mps-split" else "100% (the default)"
            for window in record["windows"]:
                rows.append([label, window["batch"], fmt(window["calls_per_s"]),
                             fmt(window["p50_us"]), fmt(window["p99_us"]),
                             fmt(window.get("utilization_gpu_mean"))])  # fmt: skip
        header = ["active threads", "batch", "calls/s", "p50 µs", "p99 µs", "GPU %"]
        lines += [*table(header, rows, right_from=1), ""]
    runs = [*others, report]
    if len(runs) > 1:
        lines += ["### Every run of this section", ""]
        header = ["run", "order"]
        for b in batches:
            header += [f"b{b} MPS K={ks[-1]} × K=1", f"b{b} no MPS × K=1", f"b{b} MPS / no MPS"]
        lines += [*table(header, [_run_row(r, ks[-1], batches) for r in runs], right_from=2), ""]
    lines += [
        "calls/s: all K processes together; × K=1: over one process in the same mode; p50: "
        "the median of the processes' medians, p99: the worst process's; CPU: all threads of "
        "the K processes per call; GPU %: NVML's utilisation (a kernel running), mean of "
        "samples every 0.2 s.",
        "",
        "### The pool's MPS code against the real daemon",
        "",
        *(f"- {line}" for line in checks(report)),
        "",
        END,
        "",
    ]
    return "\n".join(lines)


def _order(report: dict[str, Any]) -> str:
    if report.get("command", "").find("--plain-first") != -1:
        return "the sets without MPS first, then the same sets with MPS"
    return "MPS sets first, then the same sets without MPS"


def _run_row(report: dict[str, Any], k: int, batches: list[int]) -> list[str]:
    from bench.harness import fmt

    sets = {(s["mode"], s["k"]): s for s in report["sets"]}
    row = [report["date"], _order(report).split(",")[0]]
    for position, _ in enumerate(batches):
        rate = {key: record["windows"][position]["calls_per_s"] for key, record in sets.items()}
        m, m1 = rate.get(("mps", k)), rate.get(("mps", 1))
        p, p1 = rate.get(("plain", k)), rate.get(("plain", 1))
        row += [fmt(m / m1, 2) + "×" if m and m1 else "–",
                fmt(p / p1, 2) + "×" if p and p1 else "–",
                fmt(m / p, 2) + "×" if m and p else "–"]  # fmt: skip
    return row


def checks(report: dict[str, Any]) -> list[str]:
    """What the run showed of each piece of the pool's GPU code, in words."""
    out = []
    gpu = report.get("gpu", {})
    warnings = gpu.get("compute_mode_warnings") or []
    out.append(
        f"NVML (`NvmlBackend`): GPU {gpu.get('described')}, {gpu.get('memory_total_mib'):,} "
        f"MiB, compute mode {gpu.get('compute_mode')}"
        + (f'; the start-up warning: "{warnings[0]}"' if warnings else "; no warning")
        + f". Xid events at the start {gpu.get('xid_events')}, at the end "
        f"{report.get('xid_events_after')}."
    )
    if "mps_error" in report:
        out.append(f"MPS: not run ({report['mps_error']}).")
        return out
    contexts = max(s["k"] for s in report["sets"])
    out.append(
        f"Control daemon (`{report.get('mps_control')} -f`, own pipe and log directories, the "
        f"GPU's UUID): answered; the defaults applied and read back "
        f"{report.get('mps_defaults')}: 100% of the threads, and the pinned-memory limit the "
        f"pool sets by default, device memory / {contexts} contexts = "
        f"{report.get('pinned_limit_mib'):,} MiB."
    )
    probe = report.get("probe_mps") or {}
    if isinstance(probe, dict) and "allocations" in probe:
        free, total = probe["mem_get_info"]
        steps = "; ".join(
            f"{a['mib']:,} MiB {'allocated' if a['ok'] else 'refused (' + _first(a['error']) + ')'}"
            for a in probe["allocations"]
        )
        out.append(
            f"A client under that limit: cudaMemGetInfo says {free / 2**20:,.0f} MiB free of "
            f"{total / 2**20:,.0f}; then {steps}."
        )
    else:
        out.append(f"The pinned-limit probe failed: {probe}.")
    for record in report["sets"]:
        if record["mode"] != "mps":
            continue
        first = record["windows"][0]
        out.append(
            f"K={record['k']}: with the clients connected (after the first window) the daemon "
            f"listed server(s) {first.get('mps_servers')} with {first.get('mps_clients')} "
            "client(s) (what `mpspool status` shows); the "
            f"clients exited {record['exit_codes']}"
            + (
                f" after `terminate_client` for each of {len(record['terminated'])} "
                "(the pool's stop sequence)"
                if "terminated" in record
                else ""
            )
            + "."
        )
    if report.get("failed"):
        out.append(f"Steps that failed: {report['failed']}.")
    fault = report.get("fault")
    if fault:
        out.append(
            f"The MPS server killed (SIGKILL, pid {fault['killed_server_pids']}) under 2 busy "
            f"clients, a third of the way into a batch-1 window: the clients made "
            f"{fault['client_calls']} calls, then each failed with "
            f"{sorted(set(map(str, fault['client_errors'])))}; the daemon's output carried "
            f"{fault['fault_lines']}, which `mps/control.py`'s FAULT_PATTERNS match (the "
            "controller restarts that GPU's workers on it); the daemon answered afterwards: "
            f"{fault['daemon_answers_after']}."
        )
    out.append(
        f"`quit`: the daemon exited {report.get('daemon_exit')}; MPS servers left running: "
        f"{report.get('server_pids_after_quit') or 'none'}."
    )
    return out


def _first(message: str) -> str:
    """PyTorch's out-of-memory text up to its second sentence (the rest is advice)."""
    return ". ".join(message.split(". ")[:2])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the raw report here (GPU machine)")
    parser.add_argument(
        "--render", type=Path, action="append",
        help="write RESULTS.md's section from this report (the last given; the others as one "
        "line each)",
    )  # fmt: skip
    parser.add_argument("--results", type=Path, default=Path(__file__).parent / "RESULTS.md")
    parser.add_argument("--contexts", default="1,2,4,8", help="K values (%(default)s)")
    parser.add_argument("--batches", default="1,256", help="batch sizes (%(default)s)")
    parser.add_argument("--window", type=float, default=4.0, help="seconds per window")
    parser.add_argument("--rows", type=int, default=ROWS, help="embedding rows (%(default)s)")
    parser.add_argument("--mps-control", help="the control binary (else PATH)")
    parser.add_argument("--device", default="cuda", help="where the model runs (cpu: dry run)")
    parser.add_argument(
        "--gap-us", type=float, default=0.0,
        help="each client sleeps this long after every call (p50/p99 still time the call)",
    )  # fmt: skip
    parser.add_argument(
        "--gap-spin", action="store_true",
        help="with --gap-us: spin on the CPU for the gap instead of sleeping",
    )  # fmt: skip
    parser.add_argument(
        "--plain-first", action="store_true", help="the sets without MPS before those with it"
    )
    parser.add_argument(
        "--split", action="store_true",
        help="also the largest K with --active-thread-percentage split (100/K %% each)",
    )  # fmt: skip
    parser.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--probe-mib", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.client:
        return client_main(args)
    if args.probe_mib:
        return probe_main(args)
    if args.render:
        from bench.harness import write_section

        reports = [json.loads(path.read_text()) for path in args.render]
        write_section(args.results, render(reports[-1], reports[:-1]), BEGIN, END)
        return 0
    args.contexts = [int(k) for k in args.contexts.split(",")]
    report = run_on_gpu(args)
    print(json.dumps({k: v for k, v in report.items() if k != "sets"}, default=str)[:4000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
