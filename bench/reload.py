"""Reloading the model under steady load (issue 12), one run: a pool serving the demo model
gets a new version folder N times; each time its weights are published, a new group of
workers loads and warms up, traffic moves to it, and the old group drains and stops.

Per reload: requests that failed (the front door's counts by gRPC code; must be 0), p50 and
p99 of the open-loop load during the reload window against a steady window before any
reload (same rate, same length), the seconds from the folder appearing to the new version
taking traffic (AVAILABLE) and to the old one ending, and memory: total PSS of the pool's
processes (psutil) and the weight segments in /dev/shm before, at the peak during, and after.
Each version folder is a symlink to the same SavedModel, so answers are checked equal
before and after every window, and memory growth across reloads is what the process
replacement leaves behind, not a bigger model.

One pool per --loading-priority value (default idle, then normal), one after the other, so
that the two are compared in one run.

    .venv/bin/python -m bench.reload            # ~17 minutes on 2 cores (2,000,000 rows)
    .venv/bin/python -m bench.reload --quick    # 1,000-row model, 2 short reloads, no report
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil

from bench import harness
from bench.harness import Checker, Pool, fmt
from mpspool import segment
from mpspool.demo_model import demo_inputs

BEGIN_MARK = "<!-- reload:begin (written by bench/reload.py; edits here are lost) -->"
END_MARK = "<!-- reload:end -->"
PLOT = harness.OUT_DIR / "reload.png"

# Seed of the windows' Poisson arrival times (harness.poisson_script).
ARRIVALS_SEED = 1


def pool_processes(pool: Pool) -> list[psutil.Process]:
    assert pool.proc is not None
    top = psutil.Process(pool.proc.pid)
    return [top, *top.children(recursive=True)]


def shm_mib(pool_id: str) -> float:
    return sum(p.stat().st_size for p in segment.SHM_DIR.glob(f"mpspool-{pool_id}-*")) / 2**20


def versions(status: dict[str, Any]) -> dict[int, str]:
    return {v["version"]: v["state"] for v in status.get("versions", [])}


class Watcher:
    """Samples the pool beside a load window, every 0.2 s until stopped: the controller's
    status (versions and their states), total PSS and the weight segments. It runs as a
    SCHED_IDLE thread (its `mpspool status` children inherit that), and it samples in the
    steady window as in the reload windows, so that what watching costs the server is the
    same on both sides of the p99 ratio (until 2026-11-23 only the reload windows were
    watched, at normal priority)."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.stop_flag = threading.Event()
        self.lock = threading.Lock()
        self.states: dict[int, str] = {}
        # Wall time each thing was first seen: "v2 AVAILABLE", "v2 started" (a worker of
        # version 2 STARTING: its weights are published and its processes asked for).
        self.first_seen: dict[str, float] = {}
        self.peak_pss = self.peak_shm = 0.0
        self.thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> Watcher:
        self.thread.start()
        return self

    def _run(self) -> None:
        with contextlib.suppress(OSError):  # not Linux: sample at normal priority
            os.sched_setscheduler(threading.get_native_id(), os.SCHED_IDLE, os.sched_param(0))
        while not self.stop_flag.is_set():
            pss = harness.pss_mib(pool_processes(self.pool))
            shm = shm_mib(self.pool.pool_id)
            try:
                status = self.pool.status()
            except (subprocess.SubprocessError, ValueError):
                status = None  # a status that timed out or came back garbled: next time
            seen = time.time()
            with self.lock:
                self.peak_pss, self.peak_shm = max(self.peak_pss, pss), max(self.peak_shm, shm)
                if status is not None:
                    self.states = versions(status)
                    names = [f"v{v} {state}" for v, state in self.states.items()]
                    names += [
                        f"v{s['version']} started"
                        for s in status.get("slots", [])
                        if s["state"] in ("STARTING", "READY")
                    ]
                    for name in names:
                        self.first_seen.setdefault(name, seen)
            self.stop_flag.wait(0.2)

    def state(self, version: int) -> str | None:
        with self.lock:
            return self.states.get(version)

    def stop(self) -> None:
        self.stop_flag.set()
        self.thread.join(60)


PHASES = ("publishing", "loading", "switching", "after")


def phases(
    log: str, appeared_at: float, new: int, first_seen: dict[str, float], slow_ms: float
) -> dict[str, dict[str, float]]:
    """Where a reload window's slow requests (slower than ``slow_ms``, the steady window's
    p99) fell: publishing (the folder appeared; no worker of the new version yet), loading
    (its workers start, load, warm up), switching (it is AVAILABLE; the old version drains
    and ends) and after. Phase edges are the watcher's first sight, so within 0.2 s; a
    request belongs to the phase it started in (h2load's log: start µs, status, µs taken)."""
    edges = [
        appeared_at,
        first_seen.get(f"v{new} started", math.inf),
        first_seen.get(f"v{new} AVAILABLE", math.inf),
        first_seen.get(f"v{new - 1} END", math.inf),
    ]
    counts = {name: {"requests": 0, "slow": 0, "seconds": 0.0} for name in PHASES}
    for fields in (line.split("\t") for line in log.splitlines()):
        start_s, took_ms = int(fields[0]) / 1e6, int(fields[2]) / 1e3
        if start_s < appeared_at:
            continue
        name = PHASES[max(i for i, edge in enumerate(edges) if start_s >= edge)]
        counts[name]["requests"] += 1
        counts[name]["slow"] += took_ms > slow_ms
    for i, name in enumerate(PHASES[:-1]):
        if math.isfinite(edges[i + 1]) and math.isfinite(edges[i]):
            counts[name]["seconds"] = max(0.0, edges[i + 1] - edges[i])
    return counts


def window(
    pool: Pool, server: harness.Server, request: harness.Request, args: argparse.Namespace,
    workdir: Path, during: Any = None, slow_ms: float = math.inf,
) -> dict[str, Any]:  # fmt: skip
    """One open-loop h2load window, watched (Watcher); ``during`` runs beside it (the
    reload). Failures are the front door's non-OK answers in the window (gRPC errors travel
    in HTTP 200 responses)."""
    before = harness.request_counts(server.metrics_url)
    result: dict[str, Any] = {}

    def drive() -> None:
        # The same Poisson arrival times in every window: each is compared with the steady one.
        result["drive"] = harness.h2load(
            server.port, request, args.concurrency, args.window, workdir, rps=args.rps,
            poisson_seed=ARRIVALS_SEED,
        )  # fmt: skip

    watcher = Watcher(pool).start()
    driver = threading.Thread(target=drive)
    driver.start()
    extra = during(watcher) if during else {}
    driver.join()
    watcher.stop()
    if "appeared_at" in extra:
        extra["phases"] = phases(
            (workdir / "h2load.log").read_text(), extra.pop("appeared_at"), extra["version"],
            watcher.first_seen, slow_ms,
        )  # fmt: skip
    after = harness.request_counts(server.metrics_url)
    grew = {code: after.get(code, 0) - before.get(code, 0) for code in after}
    grew.pop("OK", None)
    # h2load resets the streams open when its window ends: CANCELLED, at most one per stream.
    if grew.get("CANCELLED", 0) <= args.concurrency:
        grew.pop("CANCELLED", None)
    drive = result["drive"]
    return {
        "requests": drive.done,
        "rps": drive.rps,
        "p50_ms": drive.p50_ms,
        "p99_ms": drive.p99_ms,
        "failed": sum(grew.values()),
        "failed_by_code": {k: v for k, v in grew.items() if v},
        "peak_pss_mib": watcher.peak_pss,
        "peak_shm_mib": watcher.peak_shm,
        **extra,
    }


def reload_once(base: Path, model_dir: Path, new: int, args: argparse.Namespace):
    """Returns the function run beside the load window: after a second of load, version
    ``new`` appears; it follows the watcher's status until the old version has ended."""
    old = new - 1

    def during(watcher: Watcher) -> dict[str, Any]:
        time.sleep(1.0)
        appeared, appeared_at = time.monotonic(), time.time()
        (base / str(new)).symlink_to(model_dir, target_is_directory=True)
        available_s = ended_s = None
        deadline = appeared + args.window + 60
        while time.monotonic() < deadline:
            now = time.monotonic() - appeared
            if available_s is None and watcher.state(new) == "AVAILABLE":
                available_s = now
            if available_s is not None and watcher.state(old) in (None, "END"):
                ended_s = now
                break
            time.sleep(0.1)
        (base / str(old)).unlink(missing_ok=True)  # tidy: the policy already retired it
        return {
            "version": new,
            "to_traffic_s": available_s,
            "to_old_ended_s": ended_s,
            "appeared_at": appeared_at,
        }

    return during


def run(args: argparse.Namespace) -> dict[str, Any]:
    report: dict[str, Any] = {
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": harness.command_line("bench.reload"),
        "machine": harness.describe_machine(),
        "load_start": harness.load_average(),
        "rows": args.rows,
        "workers": args.workers,
        "rps": args.rps,
        "concurrency": args.concurrency,
        "window_s": args.window,
        "pools": [],
    }
    checker = Checker()
    leftovers: list[str] = []
    with (
        harness.frozen_code(args.source) as (source, env),
        tempfile.TemporaryDirectory(prefix="mpreload-") as tmp,
    ):
        workdir = Path(tmp)
        report["source"] = harness._describe_source(source)
        model_dir = (harness.ensure_model(args.rows, env) / "1").resolve()
        request = harness.predict_request("batch 1", "demo", demo_inputs(1, args.rows, seed=1))
        stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        for priority in args.loading_priority:
            base = workdir / f"model-{priority}"
            base.mkdir()
            (base / "1").symlink_to(model_dir, target_is_directory=True)
            logs = harness.OUT_DIR / f"logs-reload-{stamp}-{priority}"  # git-ignored
            extra = [
                "--file_system_poll_wait_seconds", str(args.poll),
                "--loading-priority", priority,
            ]  # fmt: skip
            with Pool(base, args.workers, logs, env, label="reload", extra_args=extra) as pool:
                pool.wait_ready()
                server = pool.server("reload")
                checker.check(server, request)
                harness.h2load(
                    server.port, request, args.concurrency, 2.0, workdir, rps=args.rps,
                    poisson_seed=ARRIVALS_SEED + 1,
                )  # fmt: skip
                run_ = {"loading_priority": priority, "reloads": []}
                run_["pss_start_mib"] = harness.pss_mib(pool_processes(pool))
                run_["shm_start_mib"] = shm_mib(pool.pool_id)
                run_["steady"] = window(pool, server, request, args, workdir)
                print(line(f"{priority}: steady", run_["steady"]), flush=True)
                for new in range(2, args.reloads + 2):
                    row = window(
                        pool, server, request, args, workdir,
                        during=reload_once(base, model_dir, new, args),
                        slow_ms=run_["steady"]["p99_ms"],
                    )  # fmt: skip
                    time.sleep(1.0)  # the old workers' memory is gone once they have exited
                    row["pss_after_mib"] = harness.pss_mib(pool_processes(pool))
                    row["shm_after_mib"] = shm_mib(pool.pool_id)
                    checker.check(server, request)
                    run_["reloads"].append(row)
                    print(line(f"{priority}: reload to {new}", row), flush=True)
                report["pools"].append(run_)
            leftovers += pool.leftovers() + harness.shm_leftovers([pool.pool_id])
    report["leftovers"] = leftovers
    report["load_end"] = harness.load_average()
    return report


def line(name: str, w: dict[str, Any]) -> str:
    text = (
        f"{name}: {w['rps']:,.0f} req/s, p50 {w['p50_ms']:.2f} ms, p99 {w['p99_ms']:.2f} ms, "
        f"failed {w['failed']}"
    )
    if "to_traffic_s" in w:
        text += (
            f"; traffic on it after {fmt(w['to_traffic_s'], 1)} s, old ended after "
            f"{fmt(w['to_old_ended_s'], 1)} s; PSS peak {w['peak_pss_mib']:.0f} MiB, after "
            f"{w['pss_after_mib']:.0f} MiB"
        )
    return text


def phase_summary(rows: list[dict[str, Any]]) -> str:
    """Each phase's slow requests over all reloads, their share, and its median length."""
    parts = []
    for name in PHASES:
        counted = [r["phases"][name] for r in rows if "phases" in r]
        requests = sum(c["requests"] for c in counted)
        slow = sum(c["slow"] for c in counted)
        seconds = sorted(c["seconds"] for c in counted)
        share = f"{slow / requests:.1%}" if requests else "-"
        length = f", ~{seconds[len(seconds) // 2]:.1f} s" if seconds and name != "after" else ""
        parts.append(f"{name} {slow:,} of {requests:,} ({share}{length})")
    return "; ".join(parts)


def median_p99_ms(run_: dict[str, Any]) -> float:
    """The median over its reloads of the p99 during each."""
    rows = sorted(r["p99_ms"] for r in run_["reloads"])
    return rows[len(rows) // 2]


def median_p99_ratio(run_: dict[str, Any]) -> float:
    """That median against the p99 of its steady window."""
    return median_p99_ms(run_) / run_["steady"]["p99_ms"]


def plot(report: dict[str, Any], path: Path) -> Path:
    """Per pool (loading priority) and reload: p99 during it against its steady window, and
    PSS at the peak and after."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (lat, mem) = plt.subplots(1, 2, figsize=(12, 4))
    runs = report["pools"]
    width = 0.8 / len(runs)
    for i, run_ in enumerate(runs):
        rows, priority = run_["reloads"], run_["loading_priority"]
        n = [r["version"] + (i - (len(runs) - 1) / 2) * width for r in rows]
        steady = run_["steady"]["p99_ms"]
        lat.bar(n, [r["p99_ms"] / steady for r in rows], width, label=f"loading {priority}")
        mem.plot([r["version"] for r in rows], [r["peak_pss_mib"] for r in rows], "o-",
                 label=f"PSS peak, {priority}")  # fmt: skip
        mem.plot([r["version"] for r in rows], [r["pss_after_mib"] for r in rows], "s--",
                 label=f"PSS after, {priority}")  # fmt: skip
    lat.axhline(1.5, color="tab:gray", ls=":", label="target 1.5×")
    lat.set_xlabel("reload to version")
    lat.set_ylabel("p99 during the reload / p99 steady")
    lat.legend()
    mem.set_xlabel("reload to version")
    mem.set_ylabel("MiB (all the pool's processes)")
    mem.set_ylim(bottom=0)
    mem.legend(fontsize="small")
    fig.suptitle(f"{report['rows']:,}-row demo model, {report['rps']:.0f} req/s open loop")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def render(report: dict[str, Any]) -> str:
    runs = report["pools"]
    lines = [
        BEGIN_MARK,
        "## Reloading a version under load (issue 12), one run",
        "",
        f"- **When / where:** {report['date']}; {report['machine']}; load average "
        f"{report['load_start']} at the start, {report['load_end']} at the end.",
        f"- **Command:** `{report['command']}` ({report['source']}).",
        f"- **Pools:** one after the other, one per `--loading-priority` "
        f"({', '.join(r['loading_priority'] for r in runs)}): {report['workers']} workers, the "
        f"{report['rows']:,}-row demo model, `--file_system_poll_wait_seconds` 0.2; each new "
        "version is a symlink to the same SavedModel, so memory growth is what replacement "
        "leaves behind.",
        f"- **Load:** h2load open loop, {report['rps']:.0f} req/s of batch 1 at Poisson arrival "
        "times (a timing script, the same times in every window; before 2026-11-24 21:55, "
        "h2load's `--rps`, which sends a burst every 10 ms), up to "
        f"{report['concurrency']} outstanding, {report['window_s']:.0f} s windows: per pool one "
        "steady window, then one per reload (the version folder appears 1 s in); every window "
        "watched alike (status and PSS every 0.2 s from a SCHED_IDLE thread). Failed: the "
        "front door's non-OK answers in the window.",
        "",
        "| loading | window | req/s | p50 ms | p99 ms | p99 / steady | failed "
        "| to traffic s | old ended s | PSS peak MiB | PSS after MiB | shm peak MiB |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for run_ in runs:
        steady, priority = run_["steady"], run_["loading_priority"]
        lines.append(
            f"| {priority} | steady | {fmt(steady['rps'])} | {steady['p50_ms']:.2f} "
            f"| {steady['p99_ms']:.2f} | 1.00 | {steady['failed']} | | "
            f"| {steady['peak_pss_mib']:.0f} | | {steady['peak_shm_mib']:.0f} |"
        )
        for r in run_["reloads"]:
            lines.append(
                f"| {priority} | reload to {r['version']} | {fmt(r['rps'])} | {r['p50_ms']:.2f} "
                f"| {r['p99_ms']:.2f} | {r['p99_ms'] / steady['p99_ms']:.2f} | {r['failed']} "
                f"| {fmt(r['to_traffic_s'], 1)} | {fmt(r['to_old_ended_s'], 1)} "
                f"| {r['peak_pss_mib']:.0f} | {r['pss_after_mib']:.0f} "
                f"| {r['peak_shm_mib']:.0f} |"
            )
    lines.append("")
    for run_ in runs:
        rows = run_["reloads"]
        if not rows:
            continue
        failed = sum(r["failed"] for r in rows)
        worst = max(r["p99_ms"] for r in rows) / run_["steady"]["p99_ms"]
        first, last = rows[0]["pss_after_mib"], rows[-1]["pss_after_mib"]
        to_traffic = sorted(r["to_traffic_s"] or 0.0 for r in rows)[len(rows) // 2]
        lines.append(
            f"- `--loading-priority {run_['loading_priority']}`: failed requests across "
            f"{len(rows)} reloads **{failed}** (target 0); p99 during a reload / steady: median "
            f"**{median_p99_ratio(run_):.2f}×**, worst **{worst:.2f}×** (target ≤ 1.5×); "
            f"median time to traffic {to_traffic:.1f} s; PSS after the last reload / after "
            f"the first **{last / first:.3f}** (back to baseline: within 5%)."
        )
        lines.append(
            f"  Slower than its steady p99, by phase of the reload (all {len(rows)}; a steady "
            "window has 1% so): " + phase_summary(rows) + "."
        )
    if len(runs) == 2 and all(r["reloads"] for r in runs):
        a, b = runs
        lines.append(
            f"- Median p99 during a reload, loading {a['loading_priority']} / "
            f"{b['loading_priority']} (ms / ms, this run): "
            f"**{median_p99_ms(a) / median_p99_ms(b):.2f}×**."
        )
    if report.get("plot"):
        lines += ["", f"![reload]({report['plot']})"]
    lines += [""] + [f"- {note}" for note in report.get("notes", [])]
    lines.append(END_MARK)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.reload", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--rows", type=int, default=2_000_000, help="embedding rows")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--reloads", type=int, default=10, help="per pool")
    parser.add_argument("--rps", type=float, default=200.0, help="open-loop requests/s")
    parser.add_argument("--concurrency", type=int, default=16, help="most outstanding")
    parser.add_argument("--window", type=float, default=40.0, help="seconds per window")
    parser.add_argument("--poll", type=float, default=0.2, help="file system poll, s")
    parser.add_argument(
        "--loading-priority",
        type=lambda text: text.split(","),
        default=["idle", "normal"],
        help="one pool per value, one after the other, each reloaded --reloads times "
        "(default idle,normal: the default against loading at normal priority)",
    )
    harness.add_run_arguments(parser, quick="1,000 rows, 2 short reloads, no report")
    args = parser.parse_args(argv)
    if args.quick:
        args.rows, args.reloads, args.window = 1000, 2, 12.0
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    with harness.sigterm_as_exit():
        report = run(args)
    report["notes"] = args.note
    if any(r["reloads"] for r in report["pools"]) and not args.quick:
        report["plot"] = os.path.relpath(plot(report, PLOT), harness.RESULTS_MD.parent)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    text = render(report)
    print(text)
    for item in report["leftovers"]:
        print(f"reload: LEFT BEHIND: {item}", file=sys.stderr)
    if not (args.quick or args.no_results):
        harness.write_section(harness.RESULTS_MD, text, BEGIN_MARK, END_MARK)
    return 1 if report["leftovers"] else 0


if __name__ == "__main__":
    sys.exit(main())
