"""TF Serving's REST API beside gRPC (issue 13): one mpspool pool, the same model and inputs,
driven by h2load over HTTP/2 gRPC and over HTTP/1.1 JSON (`:predict`, columnar `inputs`, one
request at a time per connection, as REST clients send them), one run.

Each window: a checked answer (REST's equal to gRPC's), an h2load warm-up, the measured
window with CPU per request per process role, a checked answer (bench/harness.py). The report
is the REST section of bench/RESULTS.md, with REST/gRPC ratios of this run.

    .venv/bin/python -m bench.rest              # ~3 minutes on 2 cores
    .venv/bin/python -m bench.rest --quick      # 1,000-row model, short windows, no report
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

BEGIN_MARK = "<!-- rest:begin (written by bench/rest.py; edits here are lost) -->"
END_MARK = "<!-- rest:end -->"
PROTOCOLS = ("gRPC", "REST")


def run(args: argparse.Namespace) -> dict[str, Any]:
    report: dict[str, Any] = {
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": harness.command_line("bench.rest"),
        "machine": harness.describe_machine(),
        "load_start": harness.load_average(),
        "rows": args.rows,
        "workers": args.workers,
        "duration_s": args.duration,
        "warmup_s": args.warmup,
        "windows": [],
    }
    checker = Checker()
    with (
        harness.frozen_code(args.source) as (source, env),
        tempfile.TemporaryDirectory(prefix="mprest-") as tmp,
    ):
        workdir = Path(tmp)
        report["source"] = harness._describe_source(source)
        base = harness.ensure_model(args.rows, env)
        stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        logs = harness.OUT_DIR / f"logs-rest-{stamp}"  # git-ignored
        with Pool(base, args.workers, logs, env, label="rest") as pool:
            pool.wait_ready()
            servers = {
                "gRPC": pool.server("gRPC"),
                "REST": pool.server("REST", rest=True),
            }
            for batch in args.batches:
                inputs = demo_inputs(batch, args.rows, seed=1)
                requests = {
                    "gRPC": harness.predict_request(f"batch {batch}", "demo", inputs),
                    "REST": harness.rest_request(f"batch {batch}", "demo", inputs),
                }
                for c in args.concurrency:
                    # Interleaved per point, so that drift in the machine's load hits both.
                    for protocol in PROTOCOLS:
                        row = measure(
                            servers[protocol], requests[protocol], c, args.duration,
                            args.warmup, workdir, checker,
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
        "## REST beside gRPC: the same pool, model and inputs, native client (h2load), one run",
        "",
        f"- **When / where:** {report['date']}; {report['machine']}; load average "
        f"{report['load_start']} at the start, {report['load_end']} at the end.",
        f"- **Command:** `{report['command']}` ({report['source']}).",
        f"- **Pool:** {report['workers']} workers, the {report['rows']:,}-row demo model. "
        "gRPC: h2load over HTTP/2, streams over at most "
        f"{harness.MAX_CONNECTIONS} connections. REST: h2load `--h1`, one connection per "
        "concurrent client, one request at a time each; TF Serving's columnar JSON "
        '(`{"inputs": {...}}`), answers `{"outputs": ...}`.',
        f"- **Windows:** {report['warmup_s']} s warm-up, then {report['duration_s']} s measured; "
        "gRPC and REST alternate point by point. CPU is µs per request: *front door* "
        "(mpspool-router), *workers*, *control* (controller and supervisord), *client* "
        "(h2load).",
        "",
        "| batch | C | protocol | req/s | p50 ms | p99 ms | front door µs | workers µs "
        "| client µs |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for w in report["windows"]:
        cpu = w["cpu_us"]
        lines.append(
            f"| {w['batch']} | {w['concurrency']} | {w['system']} | {fmt(w['rps'])} "
            f"| {w['p50_ms']:.2f} | {w['p99_ms']:.2f} | {cpu.get('front door', 0):.0f} "
            f"| {cpu.get('workers', 0):.0f} | {cpu.get('client', 0):.0f} |"
        )
    lines += ["", "REST / gRPC, same batch and concurrency:", ""]
    lines += ["| batch | C | req/s | front-door CPU per request |", "|---:|---:|---:|---:|"]
    by_point: dict[tuple[int, int], dict[str, dict[str, Any]]] = {}
    for w in report["windows"]:
        by_point.setdefault((w["batch"], w["concurrency"]), {})[w["system"]] = w
    for (batch, c), point in sorted(by_point.items()):
        if set(point) != set(PROTOCOLS):
            continue
        rest, grpc = point["REST"], point["gRPC"]
        fd = rest["cpu_us"]["front door"] / grpc["cpu_us"]["front door"]
        lines.append(f"| {batch} | {c} | {rest['rps'] / grpc['rps']:.2f}× | {fd:.2f}× |")
    lines += [""] + [f"- {note}" for note in report.get("notes", [])]
    lines.append(END_MARK)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ints = harness._ints
    parser = argparse.ArgumentParser(
        prog="python -m bench.rest", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--rows", type=int, default=2_000_000, help="embedding rows")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--duration", type=float, default=4.0, help="measured seconds per window")
    parser.add_argument("--warmup", type=float, default=1.0, help="warm-up seconds per window")
    parser.add_argument("--batches", type=ints, default=[1, 256])
    parser.add_argument("--concurrency", type=ints, default=[1, 4, 16])
    harness.add_run_arguments(parser, quick="1,000 rows, 1 s windows, no report")
    args = parser.parse_args(argv)
    if args.quick:
        args.rows, args.duration, args.warmup, args.concurrency = 1000, 1.0, 0.5, [1, 4]
    return harness.run_scenario(args, run, render, BEGIN_MARK, END_MARK)


if __name__ == "__main__":
    sys.exit(main())
