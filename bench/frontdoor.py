"""The front door scenario (issue 11): every system on the same model, driven by h2load, one run.

Systems, one at a time (``--systems``, this order by default):

- ``echo-1``, ``echo-2``: the front door binary over 1 or 2 workers that only echo
  (bench/echo_worker.py): its own ceiling and CPU per request, without TensorFlow.
- ``inprocess-1``, ``inprocess-2``: the in-process limit, P processes calling the SavedModel
  back to back (bench/inprocess.py), no RPC, on the inputs of the served systems' request.
- ``mpspool-1``, ``mpspool-2``: `mpspool start` with 1 and 2 workers.
- ``plain``, ``ray``, ``triton``: the peers (bench/peers/) with 2 instances where they have
  instances; one whose virtualenv is missing is skipped and named in the report.

Each served system gets every batch size at every concurrency: a checked answer, an h2load
warm-up, the measured window with CPU per request per process role, a checked answer (see
bench/harness.py). The report is the front-door section of bench/RESULTS.md with the issue's
targets as ratios of this one run, and bench/out/frontdoor.png.

    .venv/bin/python -m bench.frontdoor              # ~6 minutes on 2 cores
    .venv/bin/python -m bench.frontdoor --quick      # 1,000-row model, short windows, no report
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from bench import harness
from bench.echo_worker import echo_pool
from bench.harness import Checker, Pool, Server, fmt, measure
from bench.inprocess import REQUEST_SEED, InProcessLimit
from bench.peers.run import PEERS, PeerServer
from mpspool.demo_model import demo_inputs
from mpspool.router import BINARY_ENV

BEGIN_MARK = "<!-- frontdoor:begin (written by bench/frontdoor.py; edits here are lost) -->"
END_MARK = "<!-- frontdoor:end -->"
SYSTEMS = (
    "echo-1", "echo-2", "inprocess-1", "inprocess-2", "mpspool-1", "mpspool-2",
    "plain", "ray", "triton",
)  # fmt: skip
# The in-process limit calls the SavedModel's public signature ("tensor": the limit)
# and, for reading beside it, a TF1 session on the caller's thread ("session": the call a
# pool worker makes; bench/inprocess.py).
INPROCESS_CALLS = ("tensor", "session")
CALL_NAMES = {"tensor": "public call", "session": "session call"}
PLOT = harness.OUT_DIR / "frontdoor.png"
RESULTS_DIR = harness.RESULTS_MD.parent  # the plot's link is relative to RESULTS.md
INSTANCES = 2  # the peers' replicas/instances, as mpspool-2's workers


def requests(rows: int, batches: list[int]) -> dict[tuple[str, int], harness.Request]:
    """(protocol, batch) → the request every system of that protocol gets; the same ids."""
    out = {}
    for b in batches:
        inputs = demo_inputs(b, rows, seed=REQUEST_SEED)
        out["tfserving", b] = harness.predict_request(f"demo batch {b}", "demo", inputs)
        out["kserve", b] = harness.kserve_request(f"demo batch {b}", "demo", inputs)
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    report: dict[str, Any] = {
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": front_door_env() + harness.command_line("bench.frontdoor"),
        "machine": harness.describe_machine(),
        "load_start": harness.load_average(),
        "rows": args.rows,
        "duration_s": args.duration,
        "warmup_s": args.warmup,
        "windows": [],
        "inprocess": [],
        "systems": [],
        "skipped": {},
        "peer_versions": {},
    }
    checker = Checker()
    echo_rows = np.zeros((args.echo_rows, 29), np.float32)
    echo = harness.predict_request("echo", "echo", {"x": echo_rows})
    echo.output = "x"
    with (
        harness.frozen_code(args.source) as (source, env),
        tempfile.TemporaryDirectory(prefix="mpfd-") as tmp,
    ):
        workdir = Path(tmp)
        stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        logs = harness.OUT_DIR / f"logs-frontdoor-{stamp}"  # git-ignored
        report["logs"] = str(logs.relative_to(harness.REPO))
        report["source"] = harness._describe_source(source)
        base = harness.ensure_model(args.rows, env)
        reqs = requests(args.rows, args.batches)

        def sweep(server: Server, batches: list[int], concurrency: list[int]) -> None:
            for b in batches:
                request = echo if server.name.startswith("echo") else reqs[server.protocol, b]
                for c in concurrency:
                    row = measure(server, request, c, args.duration, args.warmup, workdir, checker)
                    row["load1"], row["round"] = os.getloadavg()[0], round_
                    report["windows"].append(row)
                    print(line(row), flush=True)

        def served(server: Server, processes: int, start_s: float) -> None:
            report["systems"].append({
                "system": server.name, "round": round_, "processes": processes,
                "start_s": start_s, "memory_mib": footprint_mib(server),
            })  # fmt: skip

        # Rounds: every system again, in the same order; interference only slows a system
        # down, so the targets take each point's best round.
        for round_, system in [(r, s) for r in range(args.rounds) for s in args.systems]:
            kind, _, n = system.partition("-")
            if kind == "echo":
                with echo_pool(int(n)) as server:
                    sweep(server, [1], args.echo_concurrency)
            elif kind == "inprocess":
                with InProcessLimit(base / "1", args.rows, int(n)) as limit:
                    for feed, b in [(f, b) for f in INPROCESS_CALLS for b in args.batches]:
                        point = limit.run(b, args.duration, args.warmup, feed)
                        point["load1"], point["round"] = os.getloadavg()[0], round_
                        report["inprocess"].append(point)
                        print(f"in-process P={n} {CALL_NAMES[feed]} batch {b}: "
                              f"{point['rows_per_s']:,.0f} rows/s, "
                              f"p50 {point['p50_ms']:.2f} ms", flush=True)  # fmt: skip
            elif kind == "mpspool":
                label = f"mpspool {n}w"
                with Pool(base, int(n), logs / f"{system}-r{round_}", env, label=f"fd{n}w") as pool:
                    pool.wait_ready()
                    server = pool.server(label)
                    sweep(server, args.batches, args.concurrency)
                    served(server, len(server.processes()), pool.ready_s)
            else:
                peer = PEERS[system]
                why = peer.unavailable()
                if why:
                    report["skipped"][system] = why
                    print(f"{system}: skipped, {why}", file=sys.stderr)
                    continue
                report["peer_versions"][system] = peer.versions()
                log = logs / f"{system}-r{round_}.log"
                try:
                    with PeerServer(peer, base / "1", INSTANCES, log, env) as ps:
                        server = ps.wait_ready(reqs[peer.protocol, args.batches[0]])
                        sweep(server, args.batches, args.concurrency)
                        served(server, len(server.processes()), ps.start_s)
                except (RuntimeError, TimeoutError) as exc:
                    # A peer that fails is reported, not fatal: the run's other systems stand.
                    report["skipped"][system] = f"failed: {exc}; log {log}"
                    print(f"{system}: FAILED: {exc}", file=sys.stderr)
                    report["windows"] = [w for w in report["windows"] if w["system"] != ps.name]
    report["load_end"] = harness.load_average()
    report["summary"] = summarise(report)
    return report


def front_door_env() -> str:
    override = os.environ.get(BINARY_ENV)
    return f"{BINARY_ENV}={override} " if override else ""


def footprint_mib(server: Server) -> float:
    """Σ PSS of the system's processes, with mpspool's weight segment counted once and whole
    (its pages are shared between the workers and sit in /dev/shm whether mapped or not)."""
    total, segments = 0, {}
    for proc in server.processes():
        try:
            maps = proc.memory_maps()
        except psutil.Error:
            continue
        for m in maps:
            if m.path.startswith("/dev/shm/mpspool"):
                segments[m.path] = os.path.getsize(m.path) if os.path.exists(m.path) else 0
            else:
                total += m.pss
    return (total + sum(segments.values())) / 2**20


def line(w: dict[str, Any]) -> str:
    cpu = ", ".join(f"{role} {us:.0f}" for role, us in w["cpu_us"].items())
    return (
        f"{w['system']} batch {w['batch']} c{w['concurrency']}: {w['rps']:,.0f} req/s "
        f"({w['rows_per_s']:,.0f} rows/s), p50 {w['p50_ms']:.2f} ms, p99 {w['p99_ms']:.2f} ms; "
        f"CPU µs/req: {cpu}"
    )


# -- targets -------------------------------------------------------------------------------
SERVER_ROLES = ("front door", "workers", "control", "server")


def summarise(report: dict[str, Any]) -> dict[str, Any]:
    """The issue's targets as ratios of this run (a target whose systems did not run: none)."""
    windows, inproc = report["windows"], report["inprocess"]

    def of(system: str, batch: int) -> list[dict[str, Any]]:
        return [w for w in windows if w["system"] == system and w["batch"] == batch]

    def best(system: str, batch: int) -> float:
        return max((w["rows_per_s"] for w in of(system, batch)), default=np.nan)

    def cpu(system: str, batch: int, roles: tuple[str, ...]) -> float:
        """CPU µs per request of ``roles`` over every window of (system, batch)."""
        ws = of(system, batch)
        spent = sum(w["cpu_us"].get(r, 0.0) * w["requests"] for w in ws for r in roles)
        return spent / sum(w["requests"] for w in ws) if ws else np.nan

    def limit(processes: int, batch: int, key: str, feed: str = "tensor") -> float:
        """Of the in-process point's best round."""
        points = [
            p
            for p in inproc
            if p["processes"] == processes
            and p["batch"] == batch
            and p.get("feed", "tensor") == feed
        ]
        return max(points, key=lambda p: p["rows_per_s"])[key] if points else np.nan

    def p50(system: str, batch: int, c: int) -> float:
        return min(
            (w["p50_ms"] for w in of(system, batch) if w["concurrency"] == c), default=np.nan
        )

    one, two = "mpspool 1w", "mpspool 2w"
    big = max(b for b in {w["batch"] for w in windows} | {1})
    peers = list(
        dict.fromkeys(
            s["system"] for s in report["systems"] if not s["system"].startswith("mpspool")
        )
    )
    ahead = [best(two, b) / best(p, b) for p in peers for b in (1, big)]
    echo = [w["rps"] for w in windows if w["system"].startswith("echo")]
    fd = ("front door",)

    def worse(*values: float) -> float:
        """The largest, or NaN when one was not measured: Python's max(x, nan) is x, which
        made a target of 1 and 2 workers read 1 worker's alone (found by a bench hunt)."""
        return float(np.max(values))

    front_door_batch_1 = worse(cpu(one, 1, fd), cpu(two, 1, fd))
    targets = [
        ("one front door over echo workers ≥ 10,000 req/s", max(echo, default=np.nan),
         "req/s", lambda v: v >= 10_000),
        ("front-door CPU per batch-1 Predict ≤ 60 µs (worse of 1 and 2 workers, all C)",
         front_door_batch_1, "µs", lambda v: v <= 60),
        ("all-in server CPU per batch-1 request (front door + workers) ≤ 2× the in-process "
         "call's (1w / P=1 and 2w / P=2, the worse)",
         worse(cpu(one, 1, ("front door", "workers")) / limit(1, 1, "cpu_us_per_call"),
               cpu(two, 1, ("front door", "workers")) / limit(2, 1, "cpu_us_per_call")),
         "×", lambda v: v <= 2),
        ("batch 1: 2 workers ≥ 0.6× the in-process limit (P=2), rows/s best over C",
         best(two, 1) / limit(2, 1, "rows_per_s"), "×", lambda v: v >= 0.6),
        (f"batch {big}: 2 workers ≥ 0.85× the in-process limit (P=2)",
         best(two, big) / limit(2, big, "rows_per_s"), "×", lambda v: v >= 0.85),
        (f"batch {big}: 2 workers ≥ 1.6× 1 worker", best(two, big) / best(one, big), "×",
         lambda v: v >= 1.6),
        (f"2 workers ahead of every peer at batch 1 and {big} (smallest ratio; peers: "
         f"{', '.join(peers) or 'none ran'})", float(np.min(ahead)) if ahead else np.nan, "×",
         lambda v: v > 1),
        ("p50 at concurrency 1, batch 1 ≤ the in-process call's + 150 µs (1 worker vs P=1)",
         (p50(one, 1, 1) - limit(1, 1, "p50_ms")) * 1e3, "µs over", lambda v: v <= 150),
        # Not targets: the same ratios against processes making the worker's own call.
        ("for reading, not a target: batch 1, 2 workers / P=2 calling a session",
         best(two, 1) / limit(2, 1, "rows_per_s", "session"), "×", lambda v: None),
        (f"for reading, not a target: batch {big}, 2 workers / P=2 calling a session",
         best(two, big) / limit(2, big, "rows_per_s", "session"), "×", lambda v: None),
        # The 60 µs above is absolute, and hosts behind the same name have differed 3-4x in
        # it; the issue set it at a third of the P=2 call's CPU then (0.18 ms).
        ("for reading, not a target: the front door's CPU per batch-1 Predict (as above) / "
         "the in-process call's (P=2)",
         front_door_batch_1 / limit(2, 1, "cpu_us_per_call"), "×", lambda v: None),
    ]  # fmt: skip
    return {
        "targets": [
            {"target": t, "measured": float(v), "unit": u, "met": None if np.isnan(v) else ok(v)}
            for t, v, u, ok in targets
        ]
    }


# -- the report ----------------------------------------------------------------------------
def render(report: dict[str, Any], plot: Path | None) -> str:
    lines = [
        BEGIN_MARK,
        "## Front door: every system on the same model, native client (h2load), one run",
        "",
        f"- **Date:** {report['date']}",
        f"- **Command:** `{report['command']}` (from the repository root)",
        f"- **Machine:** {report['machine']}; shared with other work: load average "
        f"{report['load_start']} at start, {report['load_end']} at end (1/5/15 min); the "
        "client runs on the same cores",
        # The source names its front door binary; reports from before it did carry their own.
        f"- **Code under test:** {report.get('source', '?')}"
        + (f"; the front door is {report['front_door']}" if "front_door" in report else ""),
        f"- **Model:** demo, {report['rows']:,} embedding rows; one fixed request per batch "
        "size (the same ids for every system)",
        f"- **Windows:** {report['warmup_s']} s h2load warm-up, then {report['duration_s']} s "
        "measured; concurrency = h2load streams over at most "
        f"{harness.MAX_CONNECTIONS} connections",
    ]
    if report["peer_versions"]:
        lines.append(
            "- **Peers:** " + "; ".join(f"{k}: {v}" for k, v in report["peer_versions"].items())
        )
    lines += [f"- **Note:** {note}" for note in report.get("notes", [])]
    if report["skipped"]:
        lines.append(
            "- **Skipped:** " + "; ".join(f"{k}: {v}" for k, v in report["skipped"].items())
        )
    lines += ["", "### Targets (issue 11)", ""]
    rows = []
    for t in report["summary"]["targets"]:
        met = "–" if t["met"] is None else "yes" if t["met"] else "**no**"
        rows.append(
            (
                t["target"],
                f"{fmt(t['measured'], 0 if abs(t['measured']) >= 100 else 2)} {t['unit']}",
                met,
            )
        )
    lines += harness.table(("Target", "Measured", "Met"), rows)
    lines += [
        "",
        "### Windows",
        "",
        "CPU per request answered, per process role, over the measured window (psutil user + "
        "system time): *front door* is `mpspool-router`, *workers* the worker (or echo) "
        "processes, *server* every process of the system (mpspool: front door, workers, "
        "controller and supervisord), *client* h2load itself.",
        "",
    ]
    rounds = 1 + max((w.get("round", 0) for w in report["windows"]), default=0)

    def name(item: dict[str, Any], text: str) -> str:
        return f"{text}, round {item.get('round', 0) + 1}" if rounds > 1 else text

    order = {s: i for i, s in enumerate(dict.fromkeys(w["system"] for w in report["windows"]))}
    windows = sorted(
        report["windows"],
        key=lambda w: (order[w["system"]], w["batch"], w["concurrency"], w.get("round", 0)),
    )
    rows = []
    for w in windows:
        c = w["cpu_us"]
        server = sum(v for r, v in c.items() if r in SERVER_ROLES)
        rows.append((
            name(w, w["system"]), w["batch"], w["concurrency"], fmt(w["rps"]), fmt(w["rows_per_s"]),
            fmt(w["p50_ms"], 2), fmt(w["p99_ms"], 2), fmt(server), fmt(c.get("front door")),
            fmt(c.get("workers")), fmt(c.get("client")), fmt(w["load1"], 1),
        ))  # fmt: skip
    lines += harness.table(
        ("System", "Batch", "C", "req/s", "rows/s", "p50 ms", "p99 ms", "server µs/req",
         "front door µs/req", "workers µs/req", "client µs/req", "load"), rows,
    )  # fmt: skip
    lines += [
        "",
        "In-process limit (P processes calling the SavedModel back to back, no RPC, with the "
        "inputs of the request h2load posts, so both sides gather the same rows; *public "
        "call*: its serving signature on pre-built tensors, the targets' limit; *session "
        "call*: a TF1 session callable on the caller's thread with numpy arrays, as a pool "
        "worker calls it):",
        "",
    ]
    rows = [
        (name(p, f"P={p['processes']}, {CALL_NAMES[p.get('feed', 'tensor')]}"), p["batch"],
         fmt(p["throughput_rps"]), fmt(p["rows_per_s"]),
         fmt(p["p50_ms"], 2), fmt(p["p99_ms"], 2), fmt(p["cpu_us_per_call"]), fmt(p["load1"], 1))
        for p in report["inprocess"]
    ]  # fmt: skip
    lines += harness.table(
        ("Processes", "Batch", "calls/s", "rows/s", "p50 ms", "p99 ms", "CPU µs/call", "load"), rows
    )
    if report["systems"]:
        lines += [
            "",
            "Memory (Σ PSS of the system's processes after its sweep; mpspool's weight segment "
            "counted once and whole) and start (spawn to all workers READY for mpspool, to the "
            "first answer for a peer):",
            "",
        ]
        rows = [
            (name(s, s["system"]), s["processes"], fmt(s["memory_mib"]), fmt(s["start_s"], 1))
            for s in report["systems"]
        ]
        lines += harness.table(("System", "processes", "MiB", "start s"), rows)
    if plot is not None:
        lines += [
            "",
            f"![rows/s and p99 against concurrency]({os.path.relpath(plot, RESULTS_DIR)})",
        ]
    lines.append(END_MARK)
    return "\n".join(lines) + "\n"


def draw(report: dict[str, Any], path: Path) -> Path:
    from bench.plots import plot_windows

    references: dict[int, dict[str, float]] = {}
    for p in report["inprocess"]:
        refs = references.setdefault(p["batch"], {})
        label = f"in-process P={p['processes']}"
        if p.get("feed", "tensor") != "tensor":
            label += f", {CALL_NAMES[p['feed']]}"
        refs[label] = max(refs.get(label, 0.0), p["rows_per_s"])
    best: dict[tuple[str, int, int], dict[str, Any]] = {}
    for w in report["windows"]:
        key = (w["system"], w["batch"], w["concurrency"])
        if not w["system"].startswith("echo") and w["rps"] > best.get(key, {}).get("rps", -1):
            best[key] = w
    served = list(best.values())
    return plot_windows(
        served, references, path, f"{report['rows']:,}-row demo model, {report['date']}"
    )


def main(argv: list[str] | None = None) -> int:
    ints = harness._ints
    parser = argparse.ArgumentParser(
        prog="python -m bench.frontdoor", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--systems", type=lambda s: s.split(","), default=list(SYSTEMS))
    parser.add_argument("--rows", type=int, default=2_000_000, help="embedding rows")
    parser.add_argument("--duration", type=float, default=4.0, help="measured seconds per window")
    parser.add_argument("--warmup", type=float, default=1.0, help="warm-up seconds per window")
    parser.add_argument("--batches", type=ints, default=[1, 256])
    parser.add_argument("--concurrency", type=ints, default=[1, 4, 16])
    parser.add_argument("--echo-concurrency", type=ints, default=[16, 64])
    parser.add_argument(
        "--echo-rows", type=int, default=1,
        help="rows of the echo workers' request (29 float32 each; they answer it back)",
    )  # fmt: skip
    parser.add_argument("--rounds", type=int, default=1, help="every system this many times")
    parser.add_argument(
        "--source", choices=("worktree", "HEAD", "live"), default="worktree",
        help="Python code under test, frozen into a temporary copy at the start (%(default)s)",
    )  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="1,000 rows, 1 s windows, no report")
    parser.add_argument("--no-results", action="store_true", help="leave RESULTS.md and the plot")
    parser.add_argument("--json", type=Path, help="also write the raw report here")
    parser.add_argument("--render", type=Path, help="run nothing: report a --json file again")
    parser.add_argument("--note", action="append", default=[], help="a line for the report")
    args = parser.parse_args(argv)
    unknown = set(args.systems) - set(SYSTEMS)
    if unknown:
        parser.error(f"unknown systems {sorted(unknown)}; known: {', '.join(SYSTEMS)}")
    if args.quick:
        args.rows, args.duration, args.warmup = 1000, 1.0, 0.5
        args.concurrency, args.echo_concurrency = [1, 4], [16]
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if args.render:
        report = json.loads(args.render.read_text())
        report["summary"] = summarise(report)  # the targets as this code reads them
    else:
        with harness.sigterm_as_exit():
            report = run(args)
    report["notes"] = report.get("notes", []) + args.note
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    write = not (args.quick or args.no_results)
    text = render(report, draw(report, PLOT) if write else None)
    print(text)
    if write:
        harness.write_section(harness.RESULTS_MD, text, BEGIN_MARK, END_MARK)
    return 0


if __name__ == "__main__":
    sys.exit(main())
