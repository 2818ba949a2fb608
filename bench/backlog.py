"""One model's backlog waiting in the front door while another model's worker has room: what
the front door spends per request of the other model, for two front door binaries
(alternating rounds, one run).

The pool: model ``busy`` on one worker that takes ``--delay-ms`` per call, model ``free`` on
one that echoes at once, ``--worker-inflight 1``, so that ``--backlog`` requests for busy
wait in the front door (an h2load with that many streams) while a second h2load drives free
closed-loop. Workers are bench/echo_worker.py's loop, without TensorFlow: the front door's
own cost is what is measured. Reported: free's answers per second, and the front door's CPU
per answered request (both models' answers in the window), per binary.

Why: with one queue for every model, each pass of the front door's dispatcher took the whole
backlog out and put it back to reach free's requests behind it; with a queue per model
version it looks at busy's only when busy's worker has room.

    python -m bench.backlog --before /path/to/old/mpspool-router [--write]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from bench import harness
from bench.echo_worker import _wait_registered, serve, signature_defs, stop_processes
from mpspool import process
from mpspool.config import PoolConfig, ServedModel
from mpspool.router import binary_path

BEGIN_MARK = "<!-- backlog:begin (written by bench/backlog.py; edits here are lost) -->"
END_MARK = "<!-- backlog:end -->"


def worker_main(run_dir: str, slot: str, model: str, delay_ms: float) -> int:
    """An echo worker of ``model`` that takes ``delay_ms`` per call."""

    def answer(header: dict[str, Any], frames: list[memoryview]) -> tuple[list[Any], list[Any]]:
        if delay_ms:
            time.sleep(delay_ms / 1e3)
        return header["tensors"], frames

    return serve(run_dir, slot, model, signature_defs(), answer)


@contextlib.contextmanager
def two_model_pool(binary: str, delay_ms: float) -> Iterator[tuple[int, psutil.Process]]:
    """The front door ``binary`` over a busy and a free worker; (gRPC port, its process)."""
    run_dir = Path(tempfile.mkdtemp(prefix="mpbl-"))  # 0700, short: ipc:// paths in it
    procs: list[subprocess.Popen[bytes]] = []
    try:
        models = tuple(ServedModel(name, str(run_dir), 1, workers=1) for name in ("busy", "free"))
        config = PoolConfig(
            model_name="busy", model_base_path=str(run_dir), model_version=1,
            run_dir=str(run_dir), log_dir=str(run_dir), workers=1, port=0, metrics_port=0,
            worker_inflight=1, models=models,
        )  # fmt: skip
        config.save(run_dir)
        with open(run_dir / "router.log", "wb") as log:
            procs.append(subprocess.Popen(
                [binary, "--run-dir", str(run_dir)], stderr=log,
                preexec_fn=process.die_with_parent_sigterm,
            ))  # fmt: skip
        workers = [("busy", "cpu-0@1", delay_ms), ("free", "free/cpu-0@1", 0.0)]
        for model, slot, delay in workers:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "bench.backlog", "worker", str(run_dir), slot, model,
                 str(delay)],
                cwd=harness.REPO, preexec_fn=process.die_with_parent_sigterm,
            ))  # fmt: skip
        port, _ = _wait_registered(run_dir, procs, 30.0)
        yield port, psutil.Process(procs[0].pid)
    finally:
        stop_processes(procs)
        shutil.rmtree(run_dir, ignore_errors=True)


def one_round(binary: str, args: argparse.Namespace, workdir: Path) -> dict[str, float]:
    """busy's backlog filled, then free driven for ``args.seconds``: free's rate and the front
    door's CPU per answered request over that window."""
    rows = np.ones((1, 8), np.float32)
    busy = harness.predict_request("busy", "busy", {"x": rows})
    free = harness.predict_request("free", "free", {"x": rows})
    with two_model_pool(binary, args.delay_ms) as (port, front_door):
        (workdir / "busy").mkdir(exist_ok=True)
        (workdir / "free").mkdir(exist_ok=True)
        backlog: dict[str, Any] = {}
        # Longer than the window: the backlog stays queued for the whole of it.
        busy_s = args.seconds + 4.0

        def drive_busy() -> None:
            backlog["drive"] = harness.h2load(
                port, busy, args.backlog, busy_s, workdir / "busy", connections=1,
                headers=["grpc-timeout: 600S"],
            )  # fmt: skip

        thread = threading.Thread(target=drive_busy)
        thread.start()
        time.sleep(2.0)  # the backlog builds up
        cpu_before = harness.cpu_seconds([front_door])
        drive = harness.h2load(port, free, args.concurrency, args.seconds, workdir / "free")
        cpu = harness.cpu_seconds([front_door]) - cpu_before
        thread.join()
    busy_in_window = args.seconds * 1e3 / args.delay_ms  # its worker's pace
    answered = drive.done + busy_in_window
    return {
        "free_rps": drive.rps,
        "free_p50_ms": drive.p50_ms,
        "us_per_request": cpu / answered * 1e6,
        "cpu_s": cpu,
        "busy_done": backlog["drive"].done if "drive" in backlog else float("nan"),
    }


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        return worker_main(sys.argv[2], sys.argv[3], sys.argv[4], float(sys.argv[5]))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="the front door binary to compare")
    parser.add_argument("--after", default="", help="default: the installed front door")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--backlog", type=int, default=300)
    parser.add_argument("--delay-ms", type=float, default=20.0)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--write", action="store_true", help=f"update {harness.RESULTS_MD}")
    args = parser.parse_args()
    binaries = {"before": args.before, "after": args.after or binary_path()}
    results: dict[str, list[dict[str, float]]] = {name: [] for name in binaries}
    with tempfile.TemporaryDirectory(prefix="mpbl-work-") as work:
        for round_no in range(args.rounds):
            order = list(binaries) if round_no % 2 == 0 else list(reversed(binaries))
            for name in order:
                result = one_round(binaries[name], args, Path(work))
                results[name].append(result)
                print(f"round {round_no + 1} {name}: {result}", flush=True)
    rows = []
    for name, runs in results.items():
        rows.append([
            name, f"`{binaries[name]}`",
            harness.fmt(float(np.median([r["free_rps"] for r in runs]))),
            harness.fmt(float(np.median([r["free_p50_ms"] for r in runs])), 2),
            harness.fmt(float(np.median([r["us_per_request"] for r in runs])), 1),
        ])  # fmt: skip
    before_us = float(np.median([r["us_per_request"] for r in results["before"]]))
    after_us = float(np.median([r["us_per_request"] for r in results["after"]]))
    lines = [
        BEGIN_MARK,
        f"## A backlog of one model while another has room: before and after, {args.rounds} "
        "rounds alternating",
        "",
        f"{harness.describe_machine()}; {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC; "
        f"load average {harness.load_average()}.",
        f"Command: `python -m bench.backlog --before BINARY --rounds {args.rounds} "
        f"--seconds {args.seconds:g} --backlog {args.backlog} --delay-ms {args.delay_ms:g} "
        f"--concurrency {args.concurrency}`. Model busy: one worker, {args.delay_ms:g} ms a "
        f"call, {args.backlog} requests waiting (one h2load connection); model free: one echo "
        f"worker, h2load closed loop at {args.concurrency} streams for {args.seconds:g} s; "
        "`--worker-inflight 1`; echo workers (no TensorFlow). CPU: the front door's, over "
        "free's window, per request answered in it (free's, and busy's at its worker's pace). "
        "Medians of the rounds.",
        "",
        *harness.table(
            ["front door", "binary", "free req/s", "free p50 ms", "front door µs CPU / request"],
            rows,
            right_from=2,
        ),
        "",
        f"after / before, front door CPU per request: {after_us / before_us:.2f}×.",
        END_MARK,
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if args.write:
        harness.write_section(harness.RESULTS_MD, text, BEGIN_MARK, END_MARK)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.exit(main())
