"""Batching and splitting in the front door (issue 14), closed loop with h2load, in rounds:

- **batching**: batch-1 requests at concurrency 32 against a pool without batching and one
  with `--enable-batching` (TF Serving's parameters file: `max_batch_size`,
  `batch_timeout_micros`), requests/s and p50;
- **splitting**: batch-2,048 requests at concurrency 1 against the same plain pool and one
  with `--split-rows 1024` (two chunks, one per worker), p50 and p99; again with both pools
  pinned (`--cpuset auto`, a core per worker). The workers' model-call spans (`mpspool
  timeline`) say how often a request's two chunks ran side by side: when a worker woken on
  the front door's core preempts it (`--worker-policy normal`), the second chunk is sent only
  after the first one's model call, and the request takes both chunks' time;
- **CPU sets**: batch-1 requests at concurrency 4 against the plain pool and one with
  `--cpuset auto`, p99 (reported: 2 cores leave little to show).

Each window is the harness's: a checked answer (equal across pools: batching and splitting
must not change an answer), a warm-up, the measured window with CPU per request per process
role, a checked answer. Every pool runs once per round, the order rotated each round; ratios
are taken within a round and the report gives their median (the machine's speed drifts by
tens of percent within minutes).

    .venv/bin/python -m bench.batching            # ~8 minutes on 2 cores (3 rounds)
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

import numpy as np

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
        "split pinned": ["--split-rows", str(args.split_rows), "--cpuset", "auto"],
    }


# pool → (batch, concurrency) windows it serves
WINDOWS = {
    "plain": [("small", 32), ("large", 1), ("small", 4)],
    "batching": [("small", 32)],
    "split": [("large", 1)],
    "pinned": [("small", 4), ("large", 1)],
    "split pinned": [("large", 1)],
}

# (what is compared, numerator window, denominator window, the measure, the target):
# windows as (pool, batch size key, concurrency).
RATIOS = [
    ("batching / plain, batch 1, C 32: req/s", ("batching", "small", 32),
     ("plain", "small", 32), "rps", "≥ 2×"),
    ("split / unsplit, batch {large}, C 1: p99", ("split", "large", 1),
     ("plain", "large", 1), "p99_ms", "≤ 0.65×"),
    ("split / unsplit, both pinned, batch {large}, C 1: p99", ("split pinned", "large", 1),
     ("pinned", "large", 1), "p99_ms", "≤ 0.65×"),
    ("pinned / unpinned, batch 1, C 4: p99", ("pinned", "small", 4),
     ("plain", "small", 4), "p99_ms", "reported"),
]  # fmt: skip


def side_by_side(spans: list[list[Any]], chunks: int) -> tuple[int, int]:
    """(requests whose chunks ran side by side, requests) from the model-call spans of
    requests sent one at a time and split into ``chunks`` each: spans sorted by start come in
    groups of ``chunks``, and a group ran side by side when all its chunks were running at
    once for at least half of its shortest chunk's call."""
    ordered = sorted(spans, key=lambda span: span[1])
    together = total = 0
    for at in range(0, len(ordered) - chunks + 1, chunks):
        group = ordered[at : at + chunks]
        overlap = min(span[2] for span in group) - max(span[1] for span in group)
        shortest = min(span[2] - span[1] for span in group)
        total += 1
        together += overlap >= shortest / 2
    return together, total


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
        "rounds": args.rounds,
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
        chunks = -(-args.large // args.split_rows)
        for round_, name, extra in harness.alternating(pools(args, params), args.rounds):
            logs = harness.OUT_DIR / f"logs-batching-{stamp}-{name}-{round_}"  # git-ignored
            label = f"b{name.replace(' ', '')}"
            with Pool(base, args.workers, logs, env, label=label, extra_args=extra) as pool:
                pool.wait_ready()
                server = pool.server(name)
                for size, concurrency in WINDOWS[name]:
                    harness.timeline(pool, env)
                    row = measure(
                        server, requests[size], concurrency, args.duration, args.warmup,
                        workdir, checker,
                    )  # fmt: skip
                    if name.startswith("split") and size == "large":
                        spans = harness.timeline(pool, env)["spans"]
                        row["side_by_side"] = side_by_side(spans, chunks)
                    row["round"] = round_
                    row["load1"] = os.getloadavg()[0]
                    report["windows"].append(row)
                    print(line(row), flush=True)
    report["load_end"] = harness.load_average()
    return report


def line(w: dict[str, Any]) -> str:
    cpu = ", ".join(f"{role} {us:.0f}" for role, us in w["cpu_us"].items())
    together = ""
    if "side_by_side" in w:
        side, total = w["side_by_side"]
        together = f"; chunks side by side in {side} of {total} requests"
    return (
        f"{w['system']} (round {w['round']}) batch {w['batch']} c{w['concurrency']}: "
        f"{w['rps']:,.0f} req/s, p50 {w['p50_ms']:.2f} ms, p99 {w['p99_ms']:.2f} ms; "
        f"CPU µs/req: {cpu}{together}"
    )


def ratios(report: dict[str, Any]) -> list[tuple[str, list[float], str]]:
    """Each comparison of RATIOS, per round (rounds where both windows ran), with its target."""
    sizes = {"small": 1, "large": report["large"]}
    window = {(w["system"], w["batch"], w["concurrency"], w["round"]): w for w in report["windows"]}
    out = []
    for what, (pool, size, c), (base_pool, base_size, base_c), key, target in RATIOS:
        per_round = []
        for round_ in range(1, report["rounds"] + 1):
            top = window.get((pool, sizes[size], c, round_))
            bottom = window.get((base_pool, sizes[base_size], base_c, round_))
            if top and bottom:
                per_round.append(top[key] / bottom[key])
        out.append((what.format(large=report["large"]), per_round, target))
    return out


def render(report: dict[str, Any]) -> str:
    lines = [
        BEGIN_MARK,
        f"## Batching and splitting in the front door, closed loop, {report['rounds']} round(s)",
        "",
        f"- **When / where:** {report['date']}; {report['machine']}; load average "
        f"{report['load_start']} at the start, {report['load_end']} at the end.",
        f"- **Command:** `{report['command']}` ({report['source']}).",
        f"- **Pools:** {report['workers']} workers, the {report['rows']:,}-row demo model: "
        f"*plain* (defaults), *pinned* (`--cpuset auto`), *batching* (`--enable-batching`, "
        "parameters file "
        f"`max_batch_size {report['max_batch_size']}`, `batch_timeout_micros "
        f"{report['batch_timeout_micros']}`), *split* (`--split-rows {report['split_rows']}`), "
        "*split pinned* (both).",
        f"- **Windows:** h2load, {report['warmup_s']} s warm-up then {report['duration_s']} s; "
        "answers checked equal across pools before and after each window. Every pool once a "
        "round, the order rotated each round. CPU is µs per request. *Side by side*: split "
        "requests whose chunks' model calls overlapped for at least half of the shorter one "
        "(`mpspool timeline`, over the window with its warm-up and checks).",
        "",
        "| pool | round | batch | C | req/s | p50 ms | p99 ms | front door µs | workers µs "
        "| client µs | side by side |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for w in sorted(report["windows"], key=lambda w: (w["system"], w["batch"], w["round"])):
        cpu = w["cpu_us"]
        side = ""
        if "side_by_side" in w:
            together, total = w["side_by_side"]
            side = f"{together / total:.0%}" if total else "–"
        lines.append(
            f"| {w['system']} | {w['round']} | {w['batch']} | {w['concurrency']} "
            f"| {fmt(w['rps'])} | {w['p50_ms']:.2f} | {w['p99_ms']:.2f} "
            f"| {cpu.get('front door', 0):.0f} | {cpu.get('workers', 0):.0f} "
            f"| {cpu.get('client', 0):.0f} | {side} |"
        )
    lines.append("")
    for what, per_round, target in ratios(report):
        if not per_round:
            continue
        each = ", ".join(f"{r:.2f}×" for r in per_round)
        median = float(np.median(per_round))
        lines.append(f"- {what}: per round {each}; median **{median:.2f}×** (target {target}).")
    lines += [f"- {note}" for note in report.get("notes", [])]
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
    parser.add_argument("--rounds", type=int, default=3, help="every pool this many times")
    harness.add_run_arguments(parser, quick="1,000 rows, short windows, no report")
    args = parser.parse_args(argv)
    if args.quick:
        args.rows, args.duration, args.warmup, args.rounds = 1000, 1.0, 0.5, 1
    return harness.run_scenario(args, run, render, BEGIN_MARK, END_MARK)


if __name__ == "__main__":
    sys.exit(main())
