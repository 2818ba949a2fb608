"""The chaos scenario (issue 15): steady load on a 2-worker pool for 10 minutes while a random
worker is killed (kill -9) every 5-20 s and the front door every 60 s.

Reported, in the chaos section of bench/RESULTS.md: requests and failed requests by cause
(status code and message), p50/p99 per minute, memory (RSS, USS, PSS) and open file
descriptors of every process role at the start and at the end, and what is left after the
pool stops (processes, run directory, shared-memory segments: none expected).

The load is closed-loop: client threads (the official gRPC client) each send the next
request when the last is answered; a failed request is followed by a 50 ms pause. Clients
reconnect within 20-100 ms (gRPC's default back-off of 1 s and more would measure the client).

    .venv/bin/python -m bench.chaos                 # 10 minutes
    .venv/bin/python -m bench.chaos --quick         # 10 s, 1,000 rows, no report
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime as dt
import json
import os
import random
import signal
import sys
import threading
import time
from typing import Any

import numpy as np
import psutil

from bench import harness
from bench.harness import Pool

BEGIN_MARK = "<!-- chaos:begin (written by bench/chaos.py; edits here are lost) -->"
END_MARK = "<!-- chaos:end -->"


class Load:
    """Closed-loop client threads recording (sent, seconds, code, message) per request."""

    def __init__(self, target: str, rows: int, threads: int) -> None:
        import tensorflow as tf
        from tensorflow_serving.apis import predict_pb2

        from mpspool.demo_model import demo_inputs

        self.target = target
        self.request = predict_pb2.PredictRequest()
        self.request.model_spec.name = harness.MODEL_NAME
        for name, values in demo_inputs(4, rows, seed=3).items():
            self.request.inputs[name].CopyFrom(tf.make_tensor_proto(values))
        self.outcomes: list[tuple[float, float, str, str]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._loop, daemon=True) for _ in range(threads)]

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(30)

    def _loop(self) -> None:
        import grpc
        from tensorflow_serving.apis import prediction_service_pb2_grpc

        options = [
            ("grpc.initial_reconnect_backoff_ms", 20),
            ("grpc.min_reconnect_backoff_ms", 20),
            ("grpc.max_reconnect_backoff_ms", 100),
        ]
        with grpc.insecure_channel(self.target, options=options) as channel:
            stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
            while not self._stop.is_set():
                sent = time.monotonic()
                try:
                    stub.Predict(self.request, timeout=10)
                    outcome = (sent, time.monotonic() - sent, "OK", "")
                except grpc.RpcError as exc:
                    outcome = (sent, time.monotonic() - sent, exc.code().name, exc.details() or "")
                    time.sleep(0.05)
                with self._lock:
                    self.outcomes.append(outcome)

    def ok(self) -> int:
        with self._lock:
            return sum(1 for o in self.outcomes if o[2] == "OK")


def processes(pool: Pool) -> dict[str, list[psutil.Process]]:
    """The pool's processes now, by role (workers and the front door change under chaos)."""
    assert pool.proc is not None
    top = psutil.Process(pool.proc.pid)
    roles: dict[str, list[psutil.Process]] = {
        "controller": [top], "supervisord": [], "front door": [], "workers": [],
    }  # fmt: skip
    for child in top.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if harness.is_front_door(child):
                roles["front door"].append(child)
            elif "mpspool.worker" in " ".join(child.cmdline()):
                roles["workers"].append(child)
            elif "supervisor" in " ".join(child.cmdline()):
                roles["supervisord"].append(child)
    return roles


def footprint(pool: Pool) -> dict[str, dict[str, float]]:
    """Per role: processes, RSS/USS/PSS (MiB, summed), open file descriptors (summed)."""
    out = {}
    for role, procs in processes(pool).items():
        rss = uss = pss = fds = 0.0
        for proc in procs:
            with contextlib.suppress(psutil.Error):
                info = proc.memory_full_info()
                rss, uss, pss = rss + info.rss, uss + info.uss, pss + info.pss
                fds += proc.num_fds()
        mib = 2**20
        out[role] = {
            "processes": len(procs), "rss_mib": rss / mib, "uss_mib": uss / mib,
            "pss_mib": pss / mib, "fds": fds,
        }  # fmt: skip
    return out


# Seconds between worker kills, drawn uniformly: the run's, and --quick's (its 10 s must
# see a worker killed: the test checks both kinds).
WORKER_EVERY_S = (5.0, 20.0)
QUICK_WORKER_EVERY_S = (2.0, 5.0)


def chaos(
    pool: Pool,
    until: float,
    rng: random.Random,
    router_every: float,
    events: list[dict],
    worker_every: tuple[float, float] = WORKER_EVERY_S,
) -> None:
    """Kill a random worker every `worker_every` s (drawn between its bounds) and the front
    door every `router_every` s."""
    started = time.monotonic()
    next_worker = started + rng.uniform(*worker_every)
    next_router = started + router_every
    while time.monotonic() < until:
        now = time.monotonic()
        if now >= next_router:
            victims = processes(pool)["front door"]
            kind, next_router = "front door", now + router_every
        elif now >= next_worker:
            victims = processes(pool)["workers"]
            kind, next_worker = "worker", now + rng.uniform(*worker_every)
        else:
            time.sleep(min(next_router, next_worker, until) - now)
            continue
        if victims:
            victim = rng.choice(victims)
            with contextlib.suppress(psutil.Error):
                victim.send_signal(signal.SIGKILL)
                events.append({"t": round(now - started, 1), "killed": kind, "pid": victim.pid})


def run(args: argparse.Namespace) -> dict[str, Any]:
    report: dict[str, Any] = {
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": harness.command_line("bench.chaos"),
        "machine": harness.describe_machine(),
        "load_start": harness.load_average(),
        "rows": args.rows, "workers": args.workers, "threads": args.threads,
        "duration_s": args.duration, "seed": args.seed, "kills": [],
        "router_every": args.router_every,
        "worker_every": QUICK_WORKER_EVERY_S if args.quick else WORKER_EVERY_S,
    }  # fmt: skip
    with harness.frozen_code(args.source) as (source, env):
        report["source"] = harness._describe_source(source)
        base = harness.ensure_model(args.rows, env)
        stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        logs = harness.OUT_DIR / f"logs-chaos-{stamp}"  # git-ignored
        pool = Pool(base, args.workers, logs, env, label="chaos")
        with pool:
            pool.wait_ready()
            report["start"] = footprint(pool)
            with Load(pool.target, args.rows, args.threads) as load:
                deadline = time.monotonic() + 30
                while load.ok() < 10 and time.monotonic() < deadline:
                    time.sleep(0.1)
                began = time.monotonic()
                chaos(
                    pool, began + args.duration, random.Random(args.seed), args.router_every,
                    report["kills"], report["worker_every"],
                )  # fmt: skip
            # Settle: every slot READY again before the end's footprint.
            with contextlib.suppress(TimeoutError):
                pool.wait_ready(120)
            report["end"] = footprint(pool)
            report["status_end"] = pool.status()
            pool_id = pool.pool_id
        report["leftovers"] = pool.leftovers() + harness.shm_leftovers([pool_id])
        report["pool_exit"] = pool.proc.returncode if pool.proc else None
    report["load_end"] = harness.load_average()
    report["summary"] = summarise(load.outcomes, began, args.duration)
    return report


def summarise(
    outcomes: list[tuple[float, float, str, str]], began: float, duration: float
) -> dict[str, Any]:
    window = [o for o in outcomes if began <= o[0] < began + duration]
    causes = collections.Counter(
        (code, message[:70]) for _, _, code, message in window if code != "OK"
    )
    minutes = []
    for m in range(int(np.ceil(duration / 60))):
        this = [o for o in window if 60 * m <= o[0] - began < 60 * (m + 1)]
        lat = [seconds * 1e3 for _, seconds, code, _ in this if code == "OK"]
        p50, p99 = np.percentile(lat, [50, 99]) if lat else (np.nan, np.nan)
        minutes.append({
            "minute": m + 1, "ok": len(lat), "failed": len(this) - len(lat),
            "p50_ms": float(p50), "p99_ms": float(p99),
        })  # fmt: skip
    return {
        "requests": len(window),
        "failed": sum(causes.values()),
        "causes": [{"code": c, "message": m, "n": n} for (c, m), n in causes.most_common()],
        "minutes": minutes,
    }


def render(report: dict[str, Any]) -> str:
    s = report["summary"]
    kills = collections.Counter(k["killed"] for k in report["kills"])
    lo, hi = report.get("worker_every", WORKER_EVERY_S)  # reports before it said none
    lines = [
        BEGIN_MARK,
        "## Chaos: steady load while workers and the front door are killed",
        "",
        f"- **When / where:** {report['date']}; {report['machine']}; load average "
        f"{report['load_start']} at the start, {report['load_end']} at the end.",
        f"- **Command:** `{report['command']}` ({report['source']}).",
        f"- **Pool and load:** {report['workers']} workers, the {report['rows']:,}-row demo model; "
        f"{report['threads']} closed-loop client threads (official gRPC client, batch 4, "
        "reconnecting within 20-100 ms), for "
        f"{report['duration_s']:.0f} s. Kills (kill -9, seed {report['seed']}): "
        f"{kills.get('worker', 0)} of a random worker (every {lo:g}-{hi:g} s), "
        f"{kills.get('front door', 0)} of the front door (every "
        f"{report['router_every']:.0f} s).",
        f"- **Requests:** {s['requests']:,}, of which {s['failed']:,} failed "
        f"({100 * s['failed'] / max(1, s['requests']):.2f}%).",
        "",
        "Failed requests by cause:",
        "",
        "| code | message | requests |",
        "|---|---|---:|",
    ]
    lines += [f"| {c['code']} | {c['message']} | {c['n']:,} |" for c in s["causes"]] or [
        "| – | none | 0 |"
    ]
    lines += ["", "Per minute:", "", "| minute | answered | failed | p50 ms | p99 ms |",
              "|---:|---:|---:|---:|---:|"]  # fmt: skip
    lines += [
        f"| {m['minute']} | {m['ok']:,} | {m['failed']:,} | {harness.fmt(m['p50_ms'], 2)} "
        f"| {harness.fmt(m['p99_ms'], 2)} |"
        for m in s["minutes"]
    ]
    lines += ["", "Processes at the start and at the end (after every slot was READY again; "
              "workers and the front door are new processes by then):", "",
              "| role | processes | RSS MiB | USS MiB | PSS MiB | open fds |",
              "|---|---|---|---|---|---|"]  # fmt: skip
    for role in report["start"]:
        a, b = report["start"][role], report["end"].get(role, {})

        def pair(key: str, digits: int = 0, a: dict = a, b: dict = b) -> str:
            return f"{harness.fmt(a.get(key), digits)} → {harness.fmt(b.get(key), digits)}"

        lines.append(
            f"| {role} | {pair('processes')} | {pair('rss_mib')} | {pair('uss_mib')} "
            f"| {pair('pss_mib')} | {pair('fds')} |"
        )
    left = report["leftovers"]
    lines += [
        "",
        f"- **After stop:** exit code {report['pool_exit']}; left behind: "
        + ("; ".join(left) if left else "nothing (no process, run directory or segment)")
        + ".",
    ]
    lines += [f"- {note}" for note in report.get("notes", [])]
    lines.append(END_MARK)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.chaos", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--rows", type=int, default=2_000_000, help="embedding rows")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=3, help="client threads")
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of chaos")
    parser.add_argument("--seed", type=int, default=15)
    parser.add_argument("--router-every", type=float, default=60.0, help="seconds between kills")
    harness.add_run_arguments(parser, quick="10 s, 1,000 rows, no report")
    args = parser.parse_args(argv)
    if args.quick:
        args.rows, args.duration, args.router_every = 1000, 10.0, 4.0
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    with harness.sigterm_as_exit():
        report = run(args)
    report["notes"] = args.note
    if args.json:
        args.json.write_text(json.dumps(report, indent=1, default=str))
    text = render(report)
    print(text)
    if not (args.quick or args.no_results):
        harness.write_section(harness.RESULTS_MD, text, BEGIN_MARK, END_MARK)
    return 0 if not report["leftovers"] else 1


if __name__ == "__main__":
    sys.exit(main())
