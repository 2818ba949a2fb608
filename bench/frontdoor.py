"""The native front door, measured with a native client: h2load sends a fixed gRPC Predict body.

Three measurements in one run, on one machine, so the ratios are taken under the same load:

1. **Echo ceiling.** The front door binary (`mpspool-router`) with workers that only echo
   (bench/echo_worker.py speaks the worker wire protocol and sends each request's tensor
   back), so the front door's own ceiling and CPU per request show without TensorFlow.
2. **In-process limit.** P processes calling the SavedModel directly (bench/inprocess.py),
   P = 1 and 2: no RPC at all.
3. **The pool.** `mpspool start` with 1 and 2 workers on the same model, batch 1 and 256.

CPU per request per process: psutil CPU time of the front door, of each worker, and of h2load
(the client) over each measured window, divided by the requests the front door answered OK in
it (its own Prometheus counter, read before and after: h2load counts HTTP 200s and cannot see
a gRPC status, so a window where the counter grew by less than h2load sent is an error).

    .venv/bin/python -m bench.frontdoor            # ~4 minutes on 2 cores; RESULTS.md updated
    .venv/bin/python -m bench.frontdoor --quick    # 1,000-row model, short windows, no RESULTS.md
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from bench.foundation import Pool, ensure_model, write_section
from bench.inprocess import InProcessLimit
from bench.tensors import array_to_tensor
from mpspool import process, wire
from mpspool.config import PoolConfig
from mpspool.demo_model import demo_inputs
from mpspool.protos import serving_pb2
from mpspool.router import binary_path

REPO = Path(__file__).resolve().parent.parent
RESULTS_MD = REPO / "bench" / "RESULTS.md"
BEGIN_MARK = "<!-- frontdoor:begin (written by bench/frontdoor.py; edits here are lost) -->"
END_MARK = "<!-- frontdoor:end -->"
PREDICT_PATH = "/tensorflow.serving.PredictionService/Predict"
ECHO_MODEL = "echo"


@dataclasses.dataclass
class Window:
    """One h2load run against one server: what it sent, what came back, what it cost."""

    label: str
    batch: int
    concurrency: int
    ok: int
    seconds: float
    p50_ms: float
    p99_ms: float
    cpu_us: dict[str, float]  # role → CPU µs per request answered OK

    @property
    def rps(self) -> float:
        return self.ok / self.seconds

    @property
    def rows_per_s(self) -> float:
        return self.rps * self.batch


# -- the request ---------------------------------------------------------------------
def grpc_body(model: str, inputs: dict[str, np.ndarray]) -> bytes:
    """A serialized PredictRequest in gRPC's length-prefixed framing (what h2load posts)."""
    request = serving_pb2.PredictRequest()
    request.model_spec.name = model
    request.model_spec.signature_name = "serving_default"
    for alias, values in inputs.items():
        array_to_tensor(values, request.inputs[alias])
    message = request.SerializeToString()
    return b"\x00" + len(message).to_bytes(4, "big") + message


# -- the client ----------------------------------------------------------------------
def h2load(
    port: int, body: bytes, concurrency: int, duration_s: float, workdir: Path
) -> tuple[float, float, int, float]:
    """(p50 ms, p99 ms, requests h2load counted done, CPU seconds h2load used)."""
    body_path = workdir / "body.bin"
    log_path = workdir / "h2load.log"
    body_path.write_bytes(body)
    log_path.unlink(missing_ok=True)
    # Concurrency as streams over a few connections, as a gRPC client pool would.
    connections = min(concurrency, 4)
    streams = max(1, concurrency // connections)
    argv = [
        shutil.which("h2load") or "h2load",
        f"--clients={connections}", f"--max-concurrent-streams={streams}",
        f"--duration={int(duration_s * 1000)}ms", "--threads=1",
        f"--data={body_path}", f"--log-file={log_path}",
        "-H", "content-type: application/grpc", "-H", "te: trailers",
        f"http://127.0.0.1:{port}{PREDICT_PATH}",
    ]  # fmt: skip
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run(argv, capture_output=True, text=True, timeout=duration_s + 60)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if out.returncode != 0:
        raise RuntimeError(f"h2load failed ({out.returncode}): {out.stderr or out.stdout}")
    done = re.search(r"requests: \d+ total, \d+ started, (\d+) done", out.stdout)
    latencies = []
    for line in log_path.read_text().splitlines():
        _, status, micros = line.split("\t")
        if status == "200":
            latencies.append(int(micros))
    p50, p99 = (np.percentile(latencies, [50, 99]) / 1e3) if latencies else (np.nan, np.nan)
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return float(p50), float(p99), int(done.group(1)) if done else 0, cpu


def ok_count(metrics_url: str) -> int:
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    return int(
        sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("mpspool_requests_total{")
            and 'code="OK"' in line
            and 'method="Predict"' in line
        )
    )


def cpu_seconds(processes: list[psutil.Process]) -> float:
    total = 0.0
    for proc in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            times = proc.cpu_times()
            total += times.user + times.system
    return total


def measure(
    label: str,
    port: int,
    metrics_url: str,
    roles: dict[str, list[psutil.Process]],
    body: bytes,
    batch: int,
    concurrency: int,
    duration_s: float,
    workdir: Path,
) -> Window:
    """Warm up, then one measured window; every request it sent must have been answered OK."""
    h2load(port, body, concurrency, min(1.0, duration_s), workdir)
    ok_before = ok_count(metrics_url)
    cpu_before = {role: cpu_seconds(procs) for role, procs in roles.items()}
    p50, p99, done, client_cpu = h2load(port, body, concurrency, duration_s, workdir)
    cpu = {role: cpu_seconds(procs) - cpu_before[role] for role, procs in roles.items()}
    ok = ok_count(metrics_url) - ok_before
    if done == 0 or ok < done:
        raise RuntimeError(f"{label}: h2load finished {done} requests but {ok} were answered OK")
    cpu["client"] = client_cpu
    return Window(
        label=label,
        batch=batch,
        concurrency=concurrency,
        ok=ok,
        seconds=duration_s,
        p50_ms=p50,
        p99_ms=p99,
        cpu_us={role: seconds / ok * 1e6 for role, seconds in cpu.items()},
    )


# -- the echo ceiling ----------------------------------------------------------------------
@contextlib.contextmanager
def echo_pool(workers: int) -> Iterator[tuple[int, str, dict[str, list[psutil.Process]]]]:
    """The front door binary over `workers` echo workers: (port, metrics URL, roles)."""
    run_dir = Path(tempfile.mkdtemp(prefix="mpfd-"))  # private (0700) by mkdtemp
    config = PoolConfig(
        model_name=ECHO_MODEL,
        model_base_path=str(run_dir),
        model_version=1,
        run_dir=str(run_dir),
        log_dir=str(run_dir),
        workers=workers,
        port=0,
        metrics_port=0,
    )
    config.save(run_dir)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        router = subprocess.Popen(
            [binary_path(), "--run-dir", str(run_dir)],
            stderr=open(run_dir / "router.log", "wb"),
            preexec_fn=process.die_with_parent_sigterm,
        )
        procs.append(router)
        for slot in range(workers):
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "bench.echo_worker", str(run_dir), f"echo-{slot}"],
                    cwd=REPO,
                    preexec_fn=process.die_with_parent_sigterm,
                )
            )
        port, metrics_port = wait_for_ports(run_dir, workers)
        roles = {
            "front door": [psutil.Process(router.pid)],
            "workers": [psutil.Process(p.pid) for p in procs[1:]],
        }
        yield port, f"http://127.0.0.1:{metrics_port}/metrics", roles
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(run_dir, ignore_errors=True)


def wait_for_ports(run_dir: Path, workers: int, timeout_s: float = 30.0) -> tuple[int, int]:
    """Ask the front door's control channel until every echo worker is registered."""
    import zmq

    context = zmq.Context.instance()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(wire.endpoint(str(run_dir), wire.CONTROL_ENDPOINT))
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            sock.send_multipart([b"", wire.pack(op="snapshot", n=1)])
            if sock.poll(500):
                snap = wire.unpack(sock.recv_multipart()[-1])
                if len(snap.get("workers", {})) == workers and snap.get("port"):
                    return int(snap["port"]), int(snap["metrics_port"])
            time.sleep(0.1)
    finally:
        sock.close()
    raise TimeoutError(f"the echo pool in {run_dir} did not come up in {timeout_s} s")


# -- the run ---------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> dict[str, Any]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    base = ensure_model(args.rows, env)
    workdir = Path(tempfile.mkdtemp(prefix="mpfd-client-"))
    windows: list[Window] = []
    inprocess: dict[str, dict[str, Any]] = {}
    bodies = {b: grpc_body("demo", demo_inputs(b, args.rows, seed=1)) for b in args.batches}
    echo_body = grpc_body(ECHO_MODEL, {"x": np.zeros((1, 29), dtype=np.float32)})
    try:
        for workers in () if "echo" in args.skip else (1, 2):
            with echo_pool(workers) as (port, metrics, roles):
                for c in args.echo_concurrency:
                    windows.append(measure(
                        f"echo {workers}w", port, metrics, roles, echo_body, 1, c,
                        args.duration, workdir,
                    ))  # fmt: skip
                    print_window(windows[-1])
        for processes in () if "inprocess" in args.skip else (1, 2):
            with InProcessLimit(base / "1", args.rows, processes) as limit:
                for b in args.batches:
                    point = limit.run(b, args.duration, warmup_s=1.0)
                    inprocess[f"{processes}p b{b}"] = point
                    print(
                        f"in-process P={processes} batch {b}: {point['rows_per_s']:,.0f} rows/s "
                        f"p50 {point['p50_ms']:.2f} ms, {point['cpu_us_per_call']:.0f} µs CPU/call",
                        flush=True,
                    )
        for workers in (1, 2):
            log_dir = workdir / f"logs-{workers}w"
            with Pool(base, workers, log_dir, env, label=f"fd{workers}w") as pool:
                pool.wait_ready()
                port = int(pool.target.rsplit(":", 1)[1])
                metrics = pool.status()["pool"]["metrics"]
                roles = {
                    "front door": pool.roles["router"],
                    "workers": pool.roles["workers"],
                }
                for b in args.batches:
                    for c in args.concurrency:
                        windows.append(measure(
                            f"mpspool {workers}w", port, metrics, roles, bodies[b], b, c,
                            args.duration, workdir,
                        ))  # fmt: skip
                        print_window(windows[-1])
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": machine(),
        "command": "python -m bench.frontdoor " + " ".join(sys.argv[1:]),
        "rows": args.rows,
        "duration_s": args.duration,
        "windows": [
            dataclasses.asdict(w) | {"rps": w.rps, "rows_per_s": w.rows_per_s} for w in windows
        ],
        "inprocess": inprocess,
    }


def print_window(w: Window) -> None:
    cpu = ", ".join(f"{role} {us:.0f}" for role, us in w.cpu_us.items())
    print(
        f"{w.label} batch {w.batch} c{w.concurrency}: {w.rps:,.0f} req/s "
        f"({w.rows_per_s:,.0f} rows/s), p50 {w.p50_ms:.2f} ms, p99 {w.p99_ms:.2f} ms; "
        f"CPU µs/req: {cpu}",
        flush=True,
    )


def machine() -> str:
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return (
        f"{psutil.cpu_count()} cores, {psutil.virtual_memory().total / 2**30:.0f} GiB, load {load}"
    )


# -- the report ----------------------------------------------------------------------------
def best(report: dict[str, Any], label: str, batch: int) -> dict[str, Any]:
    points = [w for w in report["windows"] if w["label"] == label and w["batch"] == batch]
    return max(points, key=lambda w: w["rps"])


def render(report: dict[str, Any]) -> str:
    lines = [
        "## Front door: the native (Rust) front door, native client (h2load)",
        "",
        f"{report['date']}, {report['machine']}, `{report['command']}`, "
        f"{report['rows']:,}-row demo model, {report['duration_s']} s windows. "
        "CPU is per request answered, per process role, over the measured window.",
        "",
        "| system | batch | concurrency | req/s | rows/s | p50 ms | p99 ms | CPU µs/req |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for w in report["windows"]:
        cpu = ", ".join(f"{role} {us:.0f}" for role, us in w["cpu_us"].items())
        lines.append(
            f"| {w['label']} | {w['batch']} | {w['concurrency']} | {w['rps']:,.0f} | "
            f"{w['rows_per_s']:,.0f} | {w['p50_ms']:.2f} | {w['p99_ms']:.2f} | {cpu} |"
        )
    lines += ["", "| in-process | rows/s | p50 ms | CPU µs/call |", "|---|---:|---:|---:|"]
    for key, p in report["inprocess"].items():
        lines.append(
            f"| {key} | {p['rows_per_s']:,.0f} | {p['p50_ms']:.2f} | {p['cpu_us_per_call']:.0f} |"
        )
    lines += ["", "Ratios, from this one run:", ""]
    ratios = targets(report)
    lines += ["| measure | value | target |", "|---|---:|---|"]
    lines += [f"| {name} | {value} | {target} |" for name, value, target in ratios]
    return "\n".join(lines) + "\n"


def targets(report: dict[str, Any]) -> list[tuple[str, str, str]]:
    out: list[tuple[str, str, str]] = []
    echo = [w for w in report["windows"] if w["label"].startswith("echo")]
    if echo:
        top = max(echo, key=lambda w: w["rps"])
        out.append(("echo ceiling, req/s", f"{top['rps']:,.0f}", "≥ 10,000"))
    pool1 = [w for w in report["windows"] if w["label"] == "mpspool 1w" and w["batch"] == 1]
    if pool1:
        fd = min(w["cpu_us"]["front door"] for w in pool1)
        out.append(("front-door CPU per batch-1 Predict, µs", f"{fd:.0f}", "≤ 60"))
    batches = sorted({w["batch"] for w in report["windows"] if w["label"] == "mpspool 2w"})
    inproc = report["inprocess"]
    for b in batches:
        two = best(report, "mpspool 2w", b)
        ref = inproc.get(f"2p b{b}")
        if ref:
            goal = "≥ 0.6" if b == 1 else "≥ 0.85"
            out.append((f"2 workers / in-process P=2, batch {b}",
                        f"{two['rows_per_s'] / ref['rows_per_s']:.2f}", goal))  # fmt: skip
        one = best(report, "mpspool 1w", b)
        out.append((f"2 workers / 1 worker, batch {b}",
                    f"{two['rows_per_s'] / one['rows_per_s']:.2f}", "≥ 1.6 at 256"))  # fmt: skip
        if b == 1 and ref:
            allin = min(w["cpu_us"]["front door"] + w["cpu_us"]["workers"]
                        for w in report["windows"] if w["label"] == "mpspool 2w" and w["batch"] == 1)  # fmt: skip  # noqa: E501
            out.append(("all-in server CPU per batch-1 request / in-process call",
                        f"{allin / ref['cpu_us_per_call']:.2f}", "≤ 2"))  # fmt: skip
    c1 = [w for w in report["windows"] if w["label"] == "mpspool 1w" and w["batch"] == 1
          and w["concurrency"] == 1]  # fmt: skip
    ref1 = inproc.get("1p b1")
    if c1 and ref1:
        out.append(("p50 at concurrency 1, batch 1, minus the in-process call's, µs",
                    f"{(c1[0]['p50_ms'] - ref1['p50_ms']) * 1e3:.0f}", "≤ 150"))  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2_000_000)
    parser.add_argument("--duration", type=float, default=4.0)
    parser.add_argument(
        "--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 256]
    )
    parser.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")],
                        default=[1, 4, 16])  # fmt: skip
    parser.add_argument("--echo-concurrency", type=lambda s: [int(x) for x in s.split(",")],
                        default=[16, 64])  # fmt: skip
    parser.add_argument(
        "--quick", action="store_true", help="1,000 rows, 1 s windows, no RESULTS.md"
    )
    parser.add_argument("--json", type=Path, help="also write the raw report here")
    parser.add_argument("--no-results", action="store_true", help="leave RESULTS.md alone")
    parser.add_argument("--skip", default="", help="parts to skip: echo,inprocess (comma list)")
    args = parser.parse_args(argv)
    if args.quick:
        args.rows, args.duration = 1000, 1.0
        args.concurrency, args.echo_concurrency = [1, 4], [16]
    report = run(args)
    text = render(report)
    print(text)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    if not (args.quick or args.no_results):
        write_section(RESULTS_MD, f"{BEGIN_MARK}\n{text}{END_MARK}\n", BEGIN_MARK, END_MARK)
    return 0


if __name__ == "__main__":
    sys.exit(main())
