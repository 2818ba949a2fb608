"""Triton's perf_analyzer against mpspool, over TF Serving's gRPC API.

perf_analyzer (``--service-kind=tfserving -i grpc``) is a load generator nobody here wrote:
it reads the model's signature through GetModelMetadata, builds its own PredictRequests and
sweeps closed-loop concurrency. This starts a 1-worker and a 2-worker pool on the demo model
(one at a time), runs perf_analyzer against each at batch 1 and 256, keeps its CSV files in
``bench/out/perf_analyzer-<date>/`` and writes a summary into the perf_analyzer section of
``bench/RESULTS.md``.

Caveat, repeated next to the numbers: perf_analyzer's tfserving backend writes INT64 inputs
into ``TensorProto.bool_val``, which TensorFlow reads as zeros, so every id it sends is 0.
That exercises the protocol path (decode, route, run, encode) but not realistic embedding
access: one row, always in cache. The headline figures come from ``bench.loadgen`` and
``bench.foundation``, which send real, random ids.

    .venv/bin/python -m bench.perf_analyzer                 # the full run
    .venv/bin/python -m bench.perf_analyzer --quick         # a smoke run on a tiny model

perf_analyzer is not a project dependency; see ``install_instructions()`` for the tools
venv it is looked for in. Every process this starts is stopped before it exits, on errors,
Ctrl-C and SIGTERM included.
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import json
import os
import re
import shlex
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench.foundation import (
    OUT_DIR,
    REPO,
    RESULTS_MD,
    Pool,
    _describe_source,
    _ints,
    command_line,
    ensure_model,
    frozen_code,
    machine,
    run_to_json,
    shm_leftovers,
    versions,
    write_section,
)

BEGIN_MARK = "<!-- perf_analyzer:begin (written by bench/perf_analyzer.py; edits here are lost) -->"
END_MARK = "<!-- perf_analyzer:end -->"
TOOLS = REPO / ".tools"
TOOLS_VENV = TOOLS / "perf-venv"
LIBB64_DIR = TOOLS / "libb64" / "usr" / "lib" / "x86_64-linux-gnu"
TRITONCLIENT_VERSION = "2.51.0"
CAVEAT = (
    "perf_analyzer's tfserving backend writes INT64 inputs into `bool_val`, which TensorFlow "
    "reads as zeros: every id these requests carry is 0. Good for the protocol path (decode, "
    "route, run, encode), not for realistic embedding access (one row, always cached); the "
    "headline figures are the foundation section's, from `bench.loadgen` with real ids."
)


def install_instructions() -> str:
    """How to install perf_analyzer where this script looks for it (the repository's
    git-ignored ``.tools/``), without touching the project's venv or the system.

    - The ``perf-analyzer`` PyPI package is an empty placeholder; the binary ships in the
      ``tritonclient`` wheels as ``bin/perf_analyzer``. 2.52 and later need glibc 2.38, so
      2.51.0 (glibc 2.36 suffices). ``--no-deps``: its numpy<2 pin would break TensorFlow.
    - It links libb64 (Debian's ``libb64-0d``, unpacked, not installed) and loads libcudart
      even without a GPU (PyPI's ``nvidia-cuda-runtime-cu12``); this script puts both on
      LD_LIBRARY_PATH for it.
    """
    return "\n".join(
        [
            "python3 -m venv .tools/perf-venv",
            f".tools/perf-venv/bin/pip install --no-deps tritonclient=={TRITONCLIENT_VERSION} "
            "nvidia-cuda-runtime-cu12",
            "(cd .tools && apt-get download libb64-0d && dpkg -x libb64-0d_*.deb libb64)",
        ]
    )


# -- the tool -----------------------------------------------------------------------
def find_perf_analyzer(explicit: Path | None) -> Path:
    candidates = [explicit] if explicit else [TOOLS_VENV / "bin" / "perf_analyzer"]
    for path in candidates:
        if path is not None and path.is_file() and os.access(path, os.X_OK):
            return path
    raise SystemExit(
        f"perf_analyzer not found at {candidates[0]}; install it from the repository root "
        f"with:\n{install_instructions()}\nor pass --perf-analyzer PATH"
    )


def tool_env(binary: Path) -> dict[str, str]:
    """The environment perf_analyzer runs with: libb64 and libcudart on LD_LIBRARY_PATH."""
    venv = binary.resolve().parent.parent
    dirs = [str(LIBB64_DIR)]
    dirs += sorted(str(p) for p in venv.glob("lib/python3*/site-packages/nvidia/*/lib"))
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(
        d for d in (*dirs, env.get("LD_LIBRARY_PATH", "")) if d
    )
    return env


def tool_version(binary: Path, env: dict[str, str]) -> str:
    out = subprocess.run(
        [str(binary), "--version"], env=env, capture_output=True, text=True, timeout=60
    )
    if out.returncode != 0:
        raise SystemExit(
            f"{binary} --version failed ({out.returncode}): {out.stderr.strip()[-500:]}\n"
            f"install steps:\n{install_instructions()}"
        )
    text = (out.stdout + out.stderr).strip()  # it prints its version on stderr
    return text.splitlines()[0] if text else "?"


def run_tool(
    binary: Path,
    env: dict[str, str],
    target: str,
    batch: int,
    concurrency: tuple[int, int, int],
    csv_path: Path,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """One perf_analyzer sweep; its CSV at ``csv_path``, its output next to it (.log)."""
    cmd = [
        str(binary),
        "-m", "demo",
        "--service-kind=tfserving",
        "-i", "grpc",
        "-u", target,
        "-b", str(batch),
        "--concurrency-range", ":".join(map(str, concurrency)),
        "--measurement-interval", str(args.interval_ms),
        "--stability-percentage", str(args.stability),
        "--max-trials", str(args.max_trials),
        "-f", str(csv_path),
    ]  # fmt: skip
    log = csv_path.with_suffix(".log")
    started = time.monotonic()
    with open(log, "wb") as out:
        # Killed on the way out whatever happens (Ctrl-C, SIGTERM, timeout).
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            rc = proc.wait(timeout=args.tool_timeout)
        except BaseException:
            proc.kill()
            proc.wait()
            raise
    text = log.read_text(errors="replace")
    return {
        "command": shlex.join(cmd),
        "returncode": rc,
        "wall_s": round(time.monotonic() - started, 1),
        "csv": str(csv_path.relative_to(REPO)),
        "log": str(log.relative_to(REPO)),
        "rows": read_csv(csv_path) if csv_path.is_file() else [],
        "failures": sorted(set(re.findall(r"(?im)^.*(?:error|fail|unavailable).*$", text)))[:20],
    }


def read_csv(path: Path) -> list[dict[str, Any]]:
    """perf_analyzer's CSV rows (sorted by throughput there), sorted by concurrency here;
    latencies in ms."""
    rows = []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):

            def us(name: str, row: dict[str, str] = row) -> float:
                value = row.get(name, "")
                return float(value) / 1000 if value not in ("", None) else float("nan")

            rows.append(
                {
                    "concurrency": int(row["Concurrency"]),
                    "throughput_per_s": float(row["Inferences/Second"]),
                    "p50_ms": us("p50 latency"),
                    "p90_ms": us("p90 latency"),
                    "p95_ms": us("p95 latency"),
                    "p99_ms": us("p99 latency"),
                    "avg_ms": us("Avg latency"),
                    "raw": row,
                }
            )
    return sorted(rows, key=lambda r: r["concurrency"])


# -- the pool's own account ---------------------------------------------------------
def request_counts(pool: Pool) -> dict[str, float]:
    """``mpspool_requests_total`` by method and code, from the pool's metrics endpoint."""
    url = pool.status()["pool"].get("metrics")
    if not url:
        return {}
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    counts: dict[str, float] = {}
    for match in re.finditer(r"^mpspool_requests_total\{([^}]*)\}\s+(\S+)$", text, re.M):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1)))
        key = f"{labels.get('method', '?')} {labels.get('code', '?')}"
        counts[key] = counts.get(key, 0.0) + float(match.group(2))
    return counts


def _delta(before: dict[str, float], after: dict[str, float]) -> dict[str, int]:
    keys = set(before) | set(after)
    return {k: int(after.get(k, 0) - before.get(k, 0)) for k in sorted(keys) if after.get(k, 0)
            - before.get(k, 0)}  # fmt: skip


# -- the scenario -------------------------------------------------------------------
def run_scenario(args: argparse.Namespace, stamp: str, binary: Path) -> dict[str, Any]:
    env_tool = tool_env(binary)
    report: dict[str, Any] = {
        "scenario": "perf_analyzer",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": command_line("bench.perf_analyzer"),
        "machine": machine(),
        "versions": versions(),
        "perf_analyzer": {"path": str(binary), "version": tool_version(binary, env_tool)},
        "settings": {
            "rows": args.rows,
            "workers": args.workers,
            "batches": args.batches,
            "concurrency": list(args.concurrency),
            "measurement_interval_ms": args.interval_ms,
            "stability_percentage": args.stability,
            "max_trials": args.max_trials,
        },
        "load_average_start": os.getloadavg(),
        "runs": [],
        "leftovers": [],
    }
    out_dir = OUT_DIR / f"perf_analyzer-{'quick-' if args.quick else ''}{stamp}"
    out_dir.mkdir(parents=True, exist_ok=True)
    report["out_dir"] = str(out_dir.relative_to(REPO))
    pool_ids: list[str] = []
    with frozen_code(args.source) as (source, env):
        report["source"] = source
        model_base = ensure_model(args.rows, env)
        for workers in args.workers:
            pool = Pool(model_base, workers, out_dir / f"logs-{workers}w", env)
            try:
                with pool:
                    pool.wait_ready()
                    pool_ids.append(pool.pool_id)
                    print(
                        f"perf_analyzer: pool {pool.label} ready in {pool.ready_s:.1f} s on "
                        f"{pool.target}",
                        file=sys.stderr,
                    )
                    for batch in args.batches:
                        before = request_counts(pool)
                        csv_path = out_dir / f"{pool.label}-b{batch}.csv"
                        run = run_tool(
                            binary, env_tool, pool.target, batch, args.concurrency, csv_path, args
                        )
                        run["requests"] = _delta(before, request_counts(pool))
                        run["replaced"] = pool.replaced()
                        run.update(config=pool.label, batch=batch)
                        report["runs"].append(run)
                        print(_run_line(run), file=sys.stderr)
                    report.setdefault("worker_restarts", {})[pool.label] = {
                        s["slot"]: s["restarts"] for s in pool.status()["slots"]
                    }
            finally:
                report["leftovers"].extend(pool.leftovers())
    report["leftovers"].extend(shm_leftovers(pool_ids))
    report["load_average_end"] = os.getloadavg()
    return report


def _run_line(run: dict[str, Any]) -> str:
    points = ", ".join(
        f"c={r['concurrency']} {r['throughput_per_s']:,.0f}/s p99 {r['p99_ms']:.2f} ms"
        for r in run["rows"]
    )
    return (
        f"perf_analyzer: {run['config']} batch={run['batch']} rc={run['returncode']} "
        f"({run['wall_s']:.0f} s): {points or 'no CSV rows'}; pool counted {run['requests']}"
    )


def run_ok(run: dict[str, Any]) -> bool:
    """perf_analyzer succeeded, wrote rows, and the pool answered only OK."""
    codes = {key.split()[-1] for key in run["requests"]}
    return run["returncode"] == 0 and bool(run["rows"]) and codes <= {"OK"} and not run["replaced"]


# -- RESULTS.md -----------------------------------------------------------------------
def _f(value: float, digits: int = 1) -> str:
    return "–" if value != value else f"{value:,.{digits}f}"


def render_markdown(report: dict[str, Any], json_path: Path) -> str:
    """The perf_analyzer section of RESULTS.md, markers included."""
    m, v, s = report["machine"], report["versions"], report["settings"]
    lo, hi, step = s["concurrency"]
    lines = [
        BEGIN_MARK,
        "## perf_analyzer (Triton) against the pool, TF Serving gRPC",
        "",
        f"- **Date:** {report['date']}",
        f"- **Command:** `{report['command']}` (from the repository root)",
        f"- **Tool:** {report['perf_analyzer']['version']} (tritonclient "
        f"{TRITONCLIENT_VERSION} wheel), `--service-kind=tfserving -i grpc`, concurrency "
        f"{', '.join(map(str, range(lo, hi + 1, step)))} (`--concurrency-range {lo}:{hi}:{step}`), "
        f"{s['measurement_interval_ms']} ms windows, stable within "
        f"{s['stability_percentage']}% (average latency and throughput) over 3 windows "
        f"(at most {s['max_trials']} tries)",
        f"- **Machine:** {m['cpu_model']}, {m['usable_cores']} usable cores "
        f"({m['logical_cpus']} logical), {m['memory_gib']} GiB, Linux {m['kernel']}; load "
        f"average {report['load_average_start'][0]:.2f} at start, "
        f"{report['load_average_end'][0]:.2f} at end",
        f"- **Versions:** TensorFlow {v.get('tensorflow-cpu', v.get('tensorflow', '?'))}, "
        f"grpcio {v.get('grpcio', '?')}, Python {v['python']}",
        f"- **Model:** demo, {s['rows']:,} embedding rows; pools of "
        + " and ".join(f"{w}" for w in s["workers"])
        + " workers, started one at a time",
        f"- **Code under test:** {_describe_source(report['source'])}",
        f"- **Raw results:** `{json_path.relative_to(REPO)}`, CSVs and logs in "
        f"`{report['out_dir']}/`",
        "",
        f"**Caveat:** {CAVEAT}",
        "",
        "perf_analyzer runs on the same cores as the pool. Throughput is inferences/s as it "
        "reports them (requests/s × batch); latencies are its client-side figures. Rows sorted "
        "by concurrency (its CSV sorts them by throughput).",
        "",
        "| Pool | Batch | C | infer/s | req/s | p50 ms | p90 ms | p99 ms | pool answered |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    problems = []
    for run in report["runs"]:
        answered = ", ".join(f"{k} ×{n:,}" for k, n in run["requests"].items()) or "nothing"
        for i, r in enumerate(run["rows"]):
            lines.append(
                f"| {run['config']} | {run['batch']} | {r['concurrency']} | "
                f"{_f(r['throughput_per_s'])} | {_f(r['throughput_per_s'] / run['batch'])} | "
                f"{_f(r['p50_ms'], 2)} | {_f(r['p90_ms'], 2)} | {_f(r['p99_ms'], 2)} | "
                f"{answered if i == 0 else '〃'} |"
            )
        if not run_ok(run):
            problems.append(
                f"{run['config']} batch {run['batch']}: exit {run['returncode']}, "
                f"{len(run['rows'])} CSV rows, pool answered {answered}"
                + (f", replaced {', '.join(run['replaced'])}" if run["replaced"] else "")
                + (f"; its output: {' / '.join(run['failures'][:3])}" if run["failures"] else "")
            )
    lines += [
        "",
        "*pool answered*: the router's `mpspool_requests_total` over the whole sweep (warm-up "
        "and stability windows included), by method and gRPC code.",
    ]
    if problems:
        lines += ["", "**Problems:** " + "; ".join(problems)]
    restarted = {
        f"{label} {slot}": n
        for label, slots in report.get("worker_restarts", {}).items()
        for slot, n in slots.items()
        if n
    }
    if restarted:
        lines += [
            "",
            "**Worker restarts:** " + ", ".join(f"{k} ×{n}" for k, n in restarted.items()),
        ]
    if report["leftovers"]:
        lines += ["", "**Left behind after the run:** " + "; ".join(report["leftovers"])]
    lines.append(END_MARK)
    return "\n".join(lines) + "\n"


def write_results_md(path: Path, section: str) -> None:
    """Replace the perf_analyzer section of ``path`` (or add it), leaving the rest alone."""
    write_section(path, section, BEGIN_MARK, END_MARK)


# -- command line -------------------------------------------------------------------
def _range(text: str) -> tuple[int, int, int]:
    parts = [int(p) for p in text.split(":")]
    if len(parts) == 2:
        parts.append(1)
    if len(parts) != 3 or min(parts) < 1 or parts[0] > parts[1]:
        raise argparse.ArgumentTypeError(f"expected START:END[:STEP], got {text!r}")
    return parts[0], parts[1], parts[2]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.perf_analyzer",
        description=__doc__.split("\n\n")[0],
        epilog="install perf_analyzer (from the repository root):\n" + install_instructions(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--perf-analyzer", type=Path, help="the binary (default: .tools venv)")
    parser.add_argument("--rows", type=int, default=2_000_000, help="embedding rows")
    parser.add_argument("--workers", type=_ints, default=[1, 2], help="pool sizes, in turn")
    parser.add_argument("--batches", type=_ints, default=[1, 256])
    parser.add_argument("--concurrency", type=_range, default=(1, 8, 2), help="START:END:STEP")
    parser.add_argument("--interval-ms", type=int, default=2000, help="measurement window")
    parser.add_argument("--stability", type=int, default=50, help="stability percentage")
    parser.add_argument("--max-trials", type=int, default=10, help="windows per point, at most")
    parser.add_argument(
        "--tool-timeout", type=float, default=900.0, help="seconds per perf_analyzer sweep"
    )
    parser.add_argument(
        "--source", choices=("worktree", "HEAD", "live"), default="worktree",
        help="code under test, as in bench.foundation (%(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: 1,000-row model, 1 worker, batch 1, C=1:2; RESULTS.md untouched",
    )
    parser.add_argument("--results", type=Path, help=f"markdown to update (default {RESULTS_MD})")
    parser.add_argument("--no-results", action="store_true", help="write the JSON only")
    parser.add_argument("--render", type=Path, metavar="JSON", help="run nothing: re-render")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.render is not None:
        report = json.loads(args.render.read_text())
        write_results_md(args.results or RESULTS_MD, render_markdown(report, args.render.resolve()))
        return 0
    if args.quick:
        args.rows = 1000 if args.rows == 2_000_000 else args.rows
        args.workers, args.batches, args.concurrency = [1], [1], (1, 2, 1)
        args.interval_ms = min(args.interval_ms, 1000)
    results_md = None if args.no_results else args.results or (None if args.quick else RESULTS_MD)
    binary = find_perf_analyzer(args.perf_analyzer)

    def drop_raw_rows(report: dict[str, Any]) -> None:
        for run in report["runs"]:
            for row in run["rows"]:
                row.pop("raw", None)  # the CSV is kept; the JSON keeps the parsed figures

    done = run_to_json(
        "perf_analyzer",
        args.quick,
        lambda stamp: run_scenario(args, stamp, binary),
        before_writing=drop_raw_rows,
    )
    if done is None:
        return 130
    report, json_path = done
    if results_md is not None:
        write_results_md(results_md, render_markdown(report, json_path))
        print(f"perf_analyzer: updated {results_md}", file=sys.stderr)
    bad = [r for r in report["runs"] if not run_ok(r)]
    for run in bad:
        print(f"perf_analyzer: PROBLEM: {_run_line(run)}", file=sys.stderr)
    for item in report["leftovers"]:
        print(f"perf_analyzer: LEFT BEHIND: {item}", file=sys.stderr)
    return 1 if bad or report["leftovers"] else 0


if __name__ == "__main__":
    sys.exit(main())
