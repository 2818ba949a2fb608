"""Batching and splitting in the front door (issue 14), closed loop with h2load, one run:

- **batching**: batch-1 requests at concurrency 32 against a pool without batching and one
  with `--enable-batching` (TF Serving's parameters file: `max_batch_size`,
  `batch_timeout_micros`), requests/s and p50;
- **splitting**: batch-2,048 requests at concurrency 1 against the same plain pool and one
  with `--split-rows 1024` (two chunks, one per worker), p50 and p99;
- **CPU sets**: batch-1 requests at concurrency 4 against the plain pool and one with
  `--cpuset auto`, p99 (reported: 2 cores leave little to show).

Each window is the harness's: a checked answer (equal across pools: batching and splitting
must not change an answer), a warm-up, the measured window with CPU per request per process
role, a checked answer.

    .venv/bin/python -m bench.batching            # ~3 minutes on 2 cores
    .venv/bin/python -m bench.batching --quick    # 1,000-row model, short windows, no report
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench import harness
from bench.harness import Checker, Pool, fmt, measure
from mpspool.demo_model import demo_inputs

BEGIN_MARK = "<!-- batching:begin (written by bench/batching.py; edits here are lost) -->"
END_MARK = "<!-- batching:end -->"


def pools(args: argparse.Namespace, params: Path) -> dict[str, list[str]]:
    return {
        "plain": [],
        "batching": ["--enable-batching", "--batching-parameters-file", str(params)],
        "split": ["--split-rows", str(args.split_rows)],
        "pinned": ["--cpuset", "auto"],
    }


# pool → (batch, concurrency) windows it serves
WINDOWS = {
    "plain": [("small", 32), ("large", 1), ("small", 4)],
    "batching": [("small", 32)],
    "split": [("large", 1)],
    "pinned": [("small", 4)],
}


def run(args: argparse.Namespace) -> dict[str, Any]:
    report: dict[str, Any] = {
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": harness.command_line("bench.batching"),
        "machine": harness.describe_machine(),
        "load_start": harness.load_average(),
        "rows": args.rows,
        "workers": args.workers,
        "duration_s": args.duration,
        "warmup_s": args.warmup,
        "max_batch_size": args.max_batch_size,
        "batch_timeout_micros": args.batch_timeout_micros,
        "split_rows": args.split_rows,
        "large": args.large,
        "windows": [],
    }
    checker = Checker()
    with (
        harness.frozen_code(args.source) as (source, env),
        tempfile.TemporaryDirectory(prefix="mpbatch-") as tmp,
    ):
        workdir = Path(tmp)
        params = workdir / "batching.txt"
        params.write_text(
            f"max_batch_size {{ value: {args.max_batch_size} }}\n"
            f"batch_timeout_micros {{ value: {args.batch_timeout_micros} }}\n"
        )
        report["source"] = harness._describe_source(source)
        base = harness.ensure_model(args.rows, env)
        requests = {
            "small": harness.predict_request("batch 1", "demo", demo_inputs(1, args.rows, seed=1)),
            "large": harness.predict_request(
                f"batch {args.large}", "demo", demo_inputs(args.large, args.rows, seed=2)
            ),
        }
        stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        for name, extra in pools(args, params).items():
            logs = harness.OUT_DIR / f"logs-batching-{stamp}-{name}"  # git-ignored
            with Pool(base, args.workers, logs, env, label=f"b{name}", extra_args=extra) as pool:
                pool.wait_ready()
                server = pool.server(name)
                for size, concurrency in WINDOWS[name]:
                    row = measure(
                        server, requests[size], concurrency, args.duration, args.warmup,
                        workdir, checker,
                    )  # fmt: skip
                    row["load1"] = os.getloadavg()[0]
                    report["windows"].append(row)
                    print(line(row), flush=True)
    report["load_end"] = harness.load_average()
    return report


def line(w: dict[str, Any]) -> str:
    cpu = ", ".join(f"{role} {us:.0f}" for role, us in w["cpu_us"].items())
    return (
        f"{w['system']} batch {w['batch']} c{w['concurrency']}: {w['rps']:,.0f} req/s, "
        f"p50 {w['p50_ms']:.2f} ms, p99 {w['p99_ms']:.2f} ms; CPU µs/req: {cpu}"
    )


def render(report: dict[str, Any]) -> str:
    lines = [
        BEGIN_MARK,
        "## Batching and splitting in the front door, closed loop, one run",
        "",
        f"- **When / where:** {report['date']}; {report['machine']}; load average "
        f"{report['load_start']} at the start, {report['load_end']} at the end.",
        f"- **Command:** `{report['command']}` ({report['source']}).",
        f"- **Pools:** {report['workers']} workers, the {report['rows']:,}-row demo model: "
        f"*plain* (defaults), *pinned* (`--cpuset auto`), *batching* (`--enable-batching`, "
        "parameters file "
        f"`max_batch_size {report['max_batch_size']}`, `batch_timeout_micros "
        f"{report['batch_timeout_micros']}`), *split* (`--split-rows {report['split_rows']}`).",
        f"- **Windows:** h2load, {report['warmup_s']} s warm-up then {report['duration_s']} s; "
        "answers checked equal across pools before and after each window. CPU is µs per "
        "request.",
        "",
        "| pool | batch | C | req/s | p50 ms | p99 ms | front door µs | workers µs | client µs |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    by: dict[tuple[str, int], dict[str, Any]] = {}
    for w in report["windows"]:
        cpu = w["cpu_us"]
        by[(w["system"], w["batch"])] = w
        lines.append(
            f"| {w['system']} | {w['batch']} | {w['concurrency']} | {fmt(w['rps'])} "
            f"| {w['p50_ms']:.2f} | {w['p99_ms']:.2f} | {cpu.get('front door', 0):.0f} "
            f"| {cpu.get('workers', 0):.0f} | {cpu.get('client', 0):.0f} |"
        )
    plain_small = next((w for w in report["windows"] if w["system"] == "plain"
                        and w["batch"] == 1 and w["concurrency"] == 32), None)  # fmt: skip
    plain_c4 = next((w for w in report["windows"] if w["system"] == "plain"
                     and w["batch"] == 1 and w["concurrency"] == 4), None)  # fmt: skip
    batched, pinned = by.get(("batching", 1)), by.get(("pinned", 1))
    plain_large, split = by.get(("plain", report["large"])), by.get(("split", report["large"]))
    lines.append("")
    if plain_small and batched:
        gain = batched["rps"] / plain_small["rps"]
        lines.append(
            f"Batching / plain at batch 1, C 32: requests/s **{gain:.2f}×**"
            f" (target ≥ 2×); p50 {batched['p50_ms']:.2f} ms vs {plain_small['p50_ms']:.2f} ms."
        )
    if plain_large and split:
        lines.append(
            f"Split / unsplit at batch {report['large']}, C 1: p99 "
            f"**{split['p99_ms'] / plain_large['p99_ms']:.2f}×** (target ≤ 0.65×), p50 "
            f"{split['p50_ms'] / plain_large['p50_ms']:.2f}×."
        )
    if plain_c4 and pinned:
        ratio = pinned["p99_ms"] / plain_c4["p99_ms"]
        lines.append(
            f"Pinned / unpinned at batch 1, C 4: p99 **{ratio:.2f}×**"
            f", requests/s {pinned['rps'] / plain_c4['rps']:.2f}× (reported; with 2 cores and 2 "
            "workers, `auto` gives each worker one core and the front door shares them)."
        )
    lines += [""] + [f"- {note}" for note in report.get("notes", [])]
    lines.append(END_MARK)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.batching", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--rows", type=int, default=2_000_000, help="embedding rows")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--duration", type=float, default=10.0, help="measured seconds")
    parser.add_argument("--warmup", type=float, default=2.0, help="warm-up seconds")
    parser.add_argument("--max-batch-size", type=int, default=64)
    parser.add_argument("--batch-timeout-micros", type=int, default=0)
    parser.add_argument("--large", type=int, default=2048, help="rows of the split request")
    parser.add_argument("--split-rows", type=int, default=1024)
    harness.add_run_arguments(parser, quick="1,000 rows, short windows, no report")
    args = parser.parse_args(argv)
    if args.quick:
        args.rows, args.duration, args.warmup = 1000, 1.0, 0.5
    return harness.run_scenario(args, run, render, BEGIN_MARK, END_MARK)


if __name__ == "__main__":
    sys.exit(main())
