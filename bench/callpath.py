"""How a worker calls its model (issue 11's lean worker path): CPU per call of each call path.

One child process loads the demo model as a pool worker does (worker/runtime.py's
load_saved_model and warm-up, the weights published into a shared segment and bound from it)
with a 2-worker pool's thread settings on this machine, then calls the signature back to back
through each path the runtime knows, alternating them round by round so that the machine's
noise falls on all alike:

- *keywords*: the public call, ``signature(**inputs)``;
- *flat*: ``ConcreteFunction._call_flat`` with tensors the worker converts itself;
- *direct*: worker/direct_call.py, TensorFlow's eager C API;
- *session*: worker/session_call.py, a session callable on the caller's thread (what a
  worker uses when it can).

A second series sleeps 2 ms between calls, as a worker waits between requests at low load:
a call after an idle gap costs more (caches, TensorFlow's pool threads parked), whichever path.

    .venv/bin/python -m bench.callpath            # ~1 minute
    .venv/bin/python -m bench.callpath --quick    # 1,000-row model, fewer calls, no report
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import harness
from mpspool.config import usable_cores

BEGIN_MARK = "<!-- callpath:begin (written by bench/callpath.py; edits here are lost) -->"
END_MARK = "<!-- callpath:end -->"
PATHS = ("keywords", "flat", "direct", "session")
SIG = "serving_default"


def measure_in_child(model_dir: str, rows: int, intra: int, calls: int, rounds: int) -> dict:
    """The child's work: load as a worker does, then time each path (CPU of every thread)."""
    from mpspool import segment
    from mpspool.worker.publish import publish

    shared = segment.SHM_DIR / f"mpspool-bench-callpath-{os.getpid()}"
    try:
        publish(model_dir, "demo", 1, shared, os.getpid(), 0.0)
        with tempfile.TemporaryDirectory() as work_dir:
            return _measure(model_dir, str(shared), work_dir, rows, intra, calls, rounds)
    finally:
        shared.unlink(missing_ok=True)


def _measure(
    model_dir: str, shared: str, work_dir: str, rows: int, intra: int, calls: int, rounds: int
) -> dict:
    from mpspool.demo_model import demo_inputs
    from mpspool.worker.runtime import load_saved_model

    runtime: Any = load_saved_model(
        model_dir,
        "demo",
        1,
        intra_op_threads=intra,
        inter_op_threads=1,
        weights_segment=shared,
        work_dir=work_dir,
    )
    runtime.warm_up()
    if runtime.call_paths != {SIG: "session"}:
        raise SystemExit(f"the demo model is not called in a session: {runtime.call_paths}")
    session, direct, order = runtime._sessions[SIG], runtime._direct[SIG], runtime._flat_orders[SIG]
    if direct is None:
        raise SystemExit("the runtime has no direct call of the demo model")
    setting = {
        "keywords": (None, None, None),
        "flat": (None, None, order),
        "direct": (None, direct, order),
        "session": (session, direct, order),
    }
    results: list[dict[str, Any]] = []
    for batch in (1, 256):
        inputs = demo_inputs(batch, rows, seed=1)
        n = calls if batch == 1 else max(1, calls // 8)
        want = runtime.run(SIG, inputs, ["score"])["score"]
        for gap_s in (0.0, 0.002):
            for round_ in range(rounds):
                for path in PATHS:
                    (
                        runtime._sessions[SIG],
                        runtime._direct[SIG],
                        runtime._flat_orders[SIG],
                    ) = setting[path]
                    got = runtime.run(SIG, inputs, ["score"])["score"]
                    if got.tobytes() != want.tobytes():
                        raise SystemExit(f"{path} answered differently at batch {batch}")
                    for _ in range(n // 10):
                        runtime.run(SIG, inputs, ["score"])
                    cpu0, wall0 = time.process_time(), time.perf_counter()
                    for _ in range(n):
                        runtime.run(SIG, inputs, ["score"])
                        if gap_s:
                            time.sleep(gap_s)
                    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
                    results.append({
                        "batch": batch, "gap_ms": gap_s * 1e3, "round": round_, "path": path,
                        "calls": n, "cpu_us": 1e6 * cpu / n,
                        "wall_us": 1e6 * (wall / n - gap_s),
                    })  # fmt: skip
    return {"intra": intra, "results": results}


def run(args: argparse.Namespace) -> dict[str, Any]:
    intra = max(1, usable_cores() // 2)  # a 2-worker pool's worker on this machine
    report: dict[str, Any] = {
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": harness.command_line("bench.callpath"),
        "machine": harness.describe_machine(),
        "load_start": harness.load_average(),
        "rows": args.rows,
        "calls": args.calls,
        "rounds": args.rounds,
    }
    with harness.frozen_code(args.source) as (source, env), tempfile.TemporaryDirectory() as tmp:
        report["source"] = harness._describe_source(source)
        base = harness.ensure_model(args.rows, env)
        out = Path(tmp) / "child.json"
        child = [
            sys.executable, "-m", "bench.callpath", "--child", str(out), "--rows", str(args.rows),
            "--calls", str(args.calls), "--rounds", str(args.rounds),
            "--model-dir", str(base / "1"), "--intra", str(intra),
        ]  # fmt: skip
        subprocess.run(child, env=env, cwd=harness.REPO, check=True, timeout=1800)
        report.update(json.loads(out.read_text()))
    report["load_end"] = harness.load_average()
    return report


def summary(report: dict[str, Any]) -> dict[tuple[int, float, str], float]:
    """(batch, gap, path) → median CPU µs per call over the rounds."""
    cells: dict[tuple[int, float, str], list[float]] = {}
    for r in report["results"]:
        cells.setdefault((r["batch"], r["gap_ms"], r["path"]), []).append(r["cpu_us"])
    return {k: sorted(v)[len(v) // 2] for k, v in cells.items()}


def render(report: dict[str, Any]) -> str:
    med = summary(report)
    lines = [
        BEGIN_MARK,
        "## Worker call path: CPU per model call, one process, one run",
        "",
        f"- **When / where:** {report['date']}; {report['machine']}; load average "
        f"{report['load_start']} at the start, {report['load_end']} at the end.",
        f"- **Command:** `{report['command']}` ({report['source']}).",
        f"- **Model:** demo, {report['rows']:,} embedding rows, loaded as a pool worker loads "
        "it (weights bound from a shared segment; intra-op threads "
        f"{report['intra']}, inter-op 1: a 2-worker pool's worker here).",
        f"- **Calls:** {report['calls']:,} per window at batch 1, an eighth of that at batch "
        f"256, after a tenth as warm-up; paths alternate, {report['rounds']} rounds; the "
        "table shows each cell's median round. CPU is every thread of the process.",
        "",
        "| batch | gap between calls | keywords µs | flat µs | direct µs | session µs "
        "| session / direct |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for batch in (1, 256):
        for gap in (0.0, 2.0):
            k, f, d, s = (med.get((batch, gap, p)) for p in PATHS)
            ratio = f"{s / d:.2f}×" if s and d else "–"
            lines.append(
                f"| {batch} | {gap:g} ms | {harness.fmt(k)} | {harness.fmt(f)} | "
                f"{harness.fmt(d)} | {harness.fmt(s)} | {ratio} |"
            )
    notes = report.get("notes", [])
    lines += [""] + [f"- {note}" for note in notes] if notes else []
    lines.append(END_MARK)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.callpath", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--rows", type=int, default=2_000_000, help="embedding rows")
    parser.add_argument("--calls", type=int, default=4000, help="calls per batch-1 window")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--intra", type=int, default=1, help=argparse.SUPPRESS)
    harness.add_run_arguments(parser, quick="1,000 rows, 500 calls, 1 round, no report")
    args = parser.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if args.child:
        found = measure_in_child(args.model_dir, args.rows, args.intra, args.calls, args.rounds)
        args.child.write_text(json.dumps(found))
        return 0
    if args.quick:
        args.rows, args.calls, args.rounds = 1000, 500, 1
    return harness.run_scenario(args, run, render, BEGIN_MARK, END_MARK)


if __name__ == "__main__":
    sys.exit(main())
