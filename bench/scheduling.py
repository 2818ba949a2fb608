"""The front door's queue order under a mixed workload (issue 14): shortest-job-first with
aging against first-come-first-served, one run of several rounds.

The workload: 90% of requests batch 1, 10% batch 512, open loop — two h2load processes at
once, each sending its own size at Poisson arrival times (an h2load timing script), so a slow
answer does not slow the arrivals — at `--load` (default 80%) of the pool's measured capacity
for that mix. Every policy in a round gets the same arrival times. `--arrivals paced` uses
h2load's `--rps` instead, as runs before 2026-11-24 21:00 did: h2load 1.52 sends each
connection's share of a second in a burst every 10 ms, so the last of a burst of 12-16 small
requests queued behind the rest of it under every policy (at 1,400 batch-1 requests/s on an
otherwise idle 2-worker pool, p50 4.3 ms paced against 0.9 ms Poisson). The pools differ only
in scheduling:

- *push* (only with `--policies ...,push`): the pool's default — every request goes to a
  worker at once (round-robin) and queues in the worker's socket;
- *fcfs*: requests wait in the front door while each worker has `--worker-inflight` in
  flight, then go in arrival order;
- *sjf*: the same limit, shortest expected compute first, oldest first while a request is at
  risk of waiting longer than `--aging-bound-ms`;
- *sjf+split*, *fcfs+split*: the same with `--split-rows` (default 256): a batch-512 request
  runs as two 256-row calls. A model call cannot be preempted, so a small request that finds
  both workers on large calls waits for the sooner to end whatever the order; shorter calls
  bound that wait (sjf sends the small request before the next chunk), at the cost of one
  call's fixed overhead per chunk (128-row chunks, 2026-11-24 23:45: four calls per large
  request overloaded the pool at "70%", batch-1 p99 49-137 ms). *fcfs+split* shows what the
  chunks do without the order.

Capacity is found once, on the fcfs pool (the first to run): the highest rate of the mix,
open loop, that it keeps up with — answers what was sent, batch-1 p99 under the aging bound —
stepping up from 40% of an estimate from the sizes alone (closed loop) by 5% (`calibrate`).
Runs before 2026-11-25 03:00 took what the pool answered in one overloaded window instead, and
at 70-80% of that the fcfs pool fell behind in some runs and not in others. Not on the push
pool: holding requests in the front door costs capacity (a worker idles between answering and
being sent its next request), so 80% of the push pool's capacity overloaded fcfs and sjf alike
(2026-11-23 17:27: they answered 1,827 and 1,608 of 2,332 req/s offered), and a comparison
between two overloaded queues says nothing about their order. The order in a round is
rotated: `fcfs, sjf, sjf+split, fcfs+split`, then `sjf, sjf+split, fcfs+split, fcfs`, ...:
the machine's speed drifts within minutes, so every policy runs once per round (`--rounds`,
default 3) on a pool of its own, and ratios are taken within a round. Reported per pool:
per-size p50, p99 and max latency, throughput, failed requests (the front door's own
counters), the longest wait in the front door's queue over the measured window (`mpspool
timeline`, cleared before it; the aging bound is judged on this) and since the pool started,
calibration and warm-up included (`mpspool_queue_wait_max_seconds`), and sjf's learned
margin at the window's end (`mpspool_queue_aging_margin_seconds`); the task-density plot
(bench/out/scheduling.png) shows what each worker computed over one second, in the last
round.

    .venv/bin/python -m bench.scheduling            # ~14 minutes on 2 cores (3 rounds)
    .venv/bin/python -m bench.scheduling --quick    # 1,000-row model, short windows, no report
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime as dt
import json
import math
import os
import re
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

from bench import harness
from bench.harness import Checker, Pool, fmt
from mpspool.demo_model import demo_inputs

BEGIN_MARK = "<!-- scheduling:begin (written by bench/scheduling.py; edits here are lost) -->"
END_MARK = "<!-- scheduling:end -->"
SMALL, LARGE = 1, 512
LARGE_SHARE = 0.1
PLOT = harness.OUT_DIR / "scheduling.png"
# (sjf pool, the pool it is judged against): the reported ratios.
COMPARISONS = (("sjf", "fcfs"), ("sjf+split", "fcfs"), ("sjf+split", "fcfs+split"))


def policies(args: argparse.Namespace) -> dict[str, list[str]]:
    limit = ["--worker-inflight", str(args.worker_inflight)]
    common = ["--worker-policy", args.worker_policy] if args.worker_policy else []
    fcfs = ["--queue", "fcfs", *limit, *common]
    sjf = ["--queue", "sjf", *limit, "--aging-bound-ms", str(args.aging_bound_ms), *common]
    # fcfs first: the capacity every pool is offered a share of is measured on it.
    pools = {"fcfs": fcfs, "sjf": sjf}
    if args.split_rows:
        split = ["--split-rows", str(args.split_rows)]
        pools |= {"sjf+split": [*sjf, *split], "fcfs+split": [*fcfs, *split]}
    chosen = args.policies or list(pools)
    pools["push"] = common  # on request only: sjf / push measured 0.57-0.59× (2026-11-24)
    unknown = set(chosen) - set(pools)
    if unknown or chosen[0] != "fcfs":
        raise SystemExit(f"--policies: fcfs first, then some of {list(pools)} (got {chosen})")
    return {name: pools[name] for name in chosen}


def mix_rates(total: float) -> dict[int, float]:
    """Requests per second of each size for ``total`` requests per second of the mix."""
    return {SMALL: (1 - LARGE_SHARE) * total, LARGE: LARGE_SHARE * total}


def latencies_ms(log: Path) -> np.ndarray:
    """h2load's per-request log: µs to the end of each answered (HTTP 200) request."""
    rows = (line.split("\t") for line in log.read_text().splitlines())
    return np.array([int(f[2]) / 1e3 for f in rows if len(f) > 2 and f[1] == "200"])


def metric(url: str, name: str) -> float:
    """The front door's ``name``, its labelled series summed (NaN: not exposed)."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    found = re.findall(rf"^{name}(?:\{{[^}}]*\}})? (\S+)$", text, re.M)
    return sum(map(float, found)) if found else float("nan")


def drain(url: str, timeout: float = 60.0) -> None:
    """Wait until the front door holds no request: a window starts from an empty queue, not
    from what an earlier one left (the capacity search's last step falls behind, and its
    backlog outlived the warm-up in a short run: fcfs p50 71 ms at 80% of a rate it had kept
    up with)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        held = (metric(url, f"mpspool_{gauge}_requests") for gauge in ("queued", "inflight"))
        if not any(v > 0 for v in held):  # NaN (not exposed) holds nothing
            return
        time.sleep(0.1)


# Poisson arrivals per h2load process at most (more: several processes, each its share):
# above this, h2load's timer lag is no longer the ~0.5 ms its scripts are drawn for
# (harness.H2LOAD_TIMER_LAG_MS; at 1,800 req/s in one process it sent 2,759).
POISSON_RPS_PER_CLIENT = 500.0


def mixed_window(
    pool: Pool, requests: dict[int, harness.Request], rates: dict[int, float], seconds: float,
    workdir: Path, nice: int = 0, seed: int | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Both sizes at once, open loop, ``seconds`` long; per-size latencies and counts. With
    ``seed``, Poisson arrivals drawn from it (the same seed, the same arrival times), from
    as many h2load processes per size as keep each under POISSON_RPS_PER_CLIENT; else one
    h2load per size with its ``--rps`` pacing."""
    server = pool.server("pool")
    drain(server.metrics_url)
    before = harness.request_counts(server.metrics_url)
    clients: dict[int, list[Path]] = {}
    for batch in requests:
        n = 1 if seed is None else max(1, math.ceil(rates[batch] / POISSON_RPS_PER_CLIENT))
        clients[batch] = [workdir / f"b{batch}-{k}" for k in range(n)]
        for d in clients[batch]:
            d.mkdir(exist_ok=True)
    with concurrent.futures.ThreadPoolExecutor(sum(map(len, clients.values()))) as threads:
        drives = {
            # Room for many outstanding requests: arrivals must not wait for answers.
            (batch, k): threads.submit(
                harness.h2load,
                server.port,
                request,
                64,
                seconds,
                d,
                rates[batch] / len(clients[batch]),
                nice,
                None if seed is None else seed * 100 + index * 10 + k,
            )
            for index, (batch, request) in enumerate(requests.items())
            for k, d in enumerate(clients[batch])
        }
        done = {key: d.result() for key, d in drives.items()}
    after = harness.request_counts(server.metrics_url)
    grew = {code: after.get(code, 0) - before.get(code, 0) for code in after}
    ok = grew.pop("OK", 0)
    grew.pop("CANCELLED", None)  # streams h2load resets at the end of its window
    sizes = {}
    for batch in requests:
        lat = np.concatenate([latencies_ms(d / "h2load.log") for d in clients[batch]])
        p50, p99 = np.percentile(lat, [50, 99]) if len(lat) else (np.nan, np.nan)
        mine = [drive for (b, _), drive in done.items() if b == batch]
        sizes[batch] = {
            "answered": len(lat),
            "rps": sum(d.rps for d in mine),
            "sent_rps": sum(d.sent_rps for d in mine),
            "clients": len(mine),
            "p50_ms": float(p50),
            "p99_ms": float(p99),
            "max_ms": float(lat.max()) if len(lat) else float("nan"),
            # Every answer's latency: the rounds' windows pooled (`pooled_p99`).
            "latencies_us": sorted(int(v * 1e3) for v in lat),
        }
    return {
        "ok": ok,
        "failed": {code: n for code, n in grew.items() if n},
        "sizes": sizes,
        "rows_per_s": sum(s["rps"] * batch for batch, s in sizes.items()),
        "requests_per_s": sum(s["rps"] for s in sizes.values()),
        "queue_wait_max_ms": metric(server.metrics_url, "mpspool_queue_wait_max_seconds") * 1e3,
        # sjf's learned margin at the window's end (NaN: a front door without one).
        "aging_margin_ms": metric(server.metrics_url, "mpspool_queue_aging_margin_seconds") * 1e3,
    }


# The shares of the sizes-alone estimate offered, rising, to find the fcfs pool's knee.
KNEE_SHARES = tuple(round(0.40 + 0.05 * k, 2) for k in range(13))  # 40% ... 100%
# The share of what h2load sent that a window must answer to have kept up (`kept_up`).
KEPT_UP_ANSWERED = 0.97


def kept_up(window: dict[str, Any], asked_rps: float, aging_bound_ms: float) -> bool:
    """Whether an open-loop window was served, not queued: the pool answered what was sent
    (h2load's own send times; paced, what was asked), and the batch-1 p99 stayed under the
    aging bound (a queue that holds small requests that long is a backlog: under it sjf serves
    in arrival order too, and two backlogs compare nothing)."""
    sent = sum(s["sent_rps"] for s in window["sizes"].values())
    if math.isnan(sent):
        sent = asked_rps
    answered = window["requests_per_s"]
    return answered >= KEPT_UP_ANSWERED * sent and window["sizes"][SMALL]["p99_ms"] < aging_bound_ms


def calibrate(
    pool: Pool, requests: dict[int, harness.Request], args: argparse.Namespace, workdir: Path,
    report: dict[str, Any],
) -> float:  # fmt: skip
    """The mix's capacity on ``pool`` (fcfs), in requests/s as asked of h2load: the highest
    rate of the mix, open loop, that the pool kept up with (``kept_up``), stepping up from 40%
    of the sizes-alone estimate by 5% until a step is not kept up.

    Why a search: the throughput of one overloaded window (what runs before 2026-11-25 03:00
    took) is what the pool does with a backlog, not the load it sustains; at 70-80% of it the
    fcfs pool fell behind in some runs and not in others (1,846-2,288 req/s measured on the
    same machine within an hour)."""
    # Closed loop, each size alone: an estimate for the mix, where the search starts from.
    alone = {
        batch: harness.h2load(
            pool.server("pool").port, request, 8, args.calibrate, workdir, nice=args.client_nice
        ).rps
        for batch, request in requests.items()
    }
    estimate = 1 / ((1 - LARGE_SHARE) / alone[SMALL] + LARGE_SHARE / alone[LARGE])
    steps = []
    for k, share in enumerate(KNEE_SHARES):
        rate = share * estimate
        window = mixed_window(
            pool, requests, mix_rates(rate), args.calibrate, workdir, args.client_nice,
            seeds(args, 0, 10 + k),
        )  # fmt: skip
        step = {
            "share": share,
            "rate": rate,
            "sent_rps": sum(s["sent_rps"] for s in window["sizes"].values()),
            "answered_rps": window["requests_per_s"],
            "small_p99_ms": window["sizes"][SMALL]["p99_ms"],
            "kept_up": kept_up(window, rate, args.aging_bound_ms),
        }
        steps.append(step)
        print(
            f"knee: {rate:,.0f} req/s asked, {step['sent_rps']:,.0f} sent, "
            f"{step['answered_rps']:,.0f} answered, batch-1 p99 {step['small_p99_ms']:.1f} ms: "
            f"{'kept up' if step['kept_up'] else 'fell behind'}",
            flush=True,
        )
        if not step["kept_up"]:
            break
    kept = [s["rate"] for s in steps if s["kept_up"]]
    if not kept:
        raise SystemExit(f"the fcfs pool fell behind at {steps[0]['rate']:,.0f} req/s already")
    report["alone_rps"] = alone
    report["estimate_rps"] = estimate
    report["knee_steps"] = steps
    report["capacity_rps"] = max(kept)
    return max(kept)


def seeds(args: argparse.Namespace, round_: int, window: int) -> int | None:
    """The arrival times' seed of a round's window (None: h2load's own pacing)."""
    return round_ * 100 + window if args.arrivals == "poisson" else None


def run(args: argparse.Namespace) -> dict[str, Any]:
    report: dict[str, Any] = {
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": harness.command_line("bench.scheduling"),
        "machine": harness.describe_machine(),
        "load_start": harness.load_average(),
        "rows": args.rows,
        "workers": args.workers,
        "duration_s": args.duration,
        "load": args.load,
        "rate": args.rate,
        "calibrate_s": args.calibrate,
        "aging_bound_ms": args.aging_bound_ms,
        "worker_inflight": args.worker_inflight,
        "split_rows": args.split_rows,
        "client_nice": args.client_nice,
        "worker_policy": args.worker_policy,
        "arrivals": args.arrivals,
        "windows": [],
        "spans": {},
    }
    checker = Checker()
    with (
        harness.frozen_code(args.source) as (source, env),
        tempfile.TemporaryDirectory(prefix="mpsched-") as tmp,
    ):
        workdir = Path(tmp)
        report["source"] = harness._describe_source(source)
        base = harness.ensure_model(args.rows, env)
        requests = {
            batch: harness.predict_request(
                f"batch {batch}", "demo", demo_inputs(batch, args.rows, seed=batch)
            )
            for batch in (SMALL, LARGE)
        }
        stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        rates: dict[int, float] = {}
        # Round 1 starts with fcfs, the first policy: the capacity is measured on its pool.
        for round_, name, extra in harness.alternating(policies(args), args.rounds):
            logs = harness.OUT_DIR / f"logs-scheduling-{stamp}-{name}-{round_}"  # git-ignored
            with Pool(base, args.workers, logs, env, label=f"s{name}", extra_args=extra) as pool:
                pool.wait_ready()
                server = pool.server(name)
                for request in requests.values():
                    checker.check(server, request)
                if not rates:
                    capacity = calibrate(pool, requests, args, workdir, report)
                    rates = mix_rates(args.rate or args.load * capacity)
                    report["rates"] = rates
                    print(f"capacity {capacity:,.0f} req/s; offering {rates}", flush=True)
                # Warm-up at the same load, then the measured window.
                mixed_window(
                    pool, requests, rates, args.warmup, workdir, args.client_nice,
                    seeds(args, round_, 1),
                )  # fmt: skip
                harness.timeline(pool, env)
                # The same arrival times for every policy of the round.
                window = mixed_window(
                    pool, requests, rates, args.duration, workdir, args.client_nice,
                    seeds(args, round_, 2),
                )  # fmt: skip
                spans = harness.timeline(pool, env)
                # Cleared before the window: the longest wait of the measured window alone
                # (the gauge counts calibration and warm-up too).
                window["window_wait_max_ms"] = spans["queue_wait_max_us"] / 1e3
                for request in requests.values():
                    checker.check(server, request)
                window["policy"] = name
                window["round"] = round_
                window["load1"] = os.getloadavg()[0]
                report["windows"].append(window)
                report["spans"][name] = spans["spans"]
                print(line(window), flush=True)
    report["load_end"] = harness.load_average()
    return report


def line(w: dict[str, Any]) -> str:
    s, g = w["sizes"][SMALL], w["sizes"][LARGE]
    return (
        f"{w['policy']} (round {w.get('round', 1)}): {w['requests_per_s']:,.0f} req/s; "
        f"batch 1 p50 {s['p50_ms']:.2f} "
        f"p99 {s['p99_ms']:.2f} ms; batch 512 p50 {g['p50_ms']:.2f} p99 {g['p99_ms']:.2f} max "
        f"{g['max_ms']:.1f} ms; failed {w['failed'] or 0}; queue wait max "
        f"{w.get('window_wait_max_ms', float('nan')):.1f} ms in the window, "
        f"{w['queue_wait_max_ms']:.1f} ms since start; sjf margin {margin_text(w)} ms"
    )


def margin_text(window: dict[str, Any]) -> str:
    """sjf's learned margin at the end of ``window``, in ms ("–": not measured)."""
    margin = window.get("aging_margin_ms", float("nan"))
    return "–" if math.isnan(margin) else f"{margin:.1f}"


def plot(report: dict[str, Any], path: Path) -> Path:
    """Per policy, one row per worker: what it computed over one second of the window, small
    requests blue and large ones orange."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["spans"])
    fig, axes = plt.subplots(len(names), 1, figsize=(12, 1.6 * len(names) + 0.6), squeeze=False)
    for ax, name in zip(axes[:, 0], names, strict=True):
        spans = report["spans"][name]
        if not spans:
            continue
        # One second from the middle of the window.
        middle = sorted(start for _, start, _ in spans)[len(spans) // 2]
        lo, hi = middle - 500_000, middle + 500_000
        slots = sorted({slot for slot, _, _ in spans})
        for row, slot in enumerate(slots):
            for kind, color in (("small", "tab:blue"), ("large", "tab:orange")):
                bars = [
                    ((start - lo) / 1e3, (end - start) / 1e3)
                    for s, start, end in spans
                    if s == slot and start < hi and end > lo
                    and ((end - start) >= report["split_us"]) == (kind == "large")
                ]  # fmt: skip
                ax.broken_barh(bars, (row - 0.4, 0.8), color=color)
        ax.set_yticks(range(len(slots)), slots)
        ax.set_xlim(0, 1000)
        ax.set_title(
            f"{name}: worker model calls over one second (blue batch 1, orange batch 512 or "
            "its chunks)"
        )
    axes[-1, 0].set_xlabel("ms")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def arrivals(report: dict[str, Any]) -> str:
    if report.get("arrivals", "paced") == "poisson":
        sent = {
            batch: [w["sizes"][batch].get("sent_rps", math.nan) for w in report["windows"]]
            for batch in (SMALL, LARGE)
        }
        first = report["windows"][0]["sizes"] if report["windows"] else {}
        clients = {batch: first.get(batch, {}).get("clients", 1) for batch in (SMALL, LARGE)}
        return (
            f"at Poisson arrival times (timing scripts, {clients[SMALL]} and {clients[LARGE]} "
            "h2load processes of one connection each; the same times for every policy of a "
            f"round; sent at {fmt(float(np.nanmedian(sent[SMALL])))} and "
            f"{fmt(float(np.nanmedian(sent[LARGE])))} req/s, median over the windows, "
            "read back from h2load's logs)"
        )
    return "with `--rps` (h2load 1.52: each connection's share in a burst every 10 ms)"


def worker_policy(report: dict[str, Any]) -> str:
    policy = report.get("worker_policy")
    return f" Every pool `--worker-policy {policy}`." if policy else ""


def capacity_text(report: dict[str, Any]) -> str:
    """How the capacity was found (``calibrate``)."""
    alone = (
        f"closed loop, batch 1 alone {fmt(report['alone_rps'][SMALL])} req/s, batch 512 alone "
        f"{fmt(report['alone_rps'][LARGE])} req/s, so {fmt(report['estimate_rps'])} req/s for "
        "the 90/10 mix"
    )
    if "knee_steps" not in report:  # runs before 2026-11-25 03:00: one overloaded window
        return (
            f"Capacity measured on the fcfs pool: {alone}; offered that mix, open loop, it "
            f"answered {fmt(report['mixed_rps'])} req/s: capacity "
            f"{fmt(report['capacity_rps'])} req/s."
        )
    steps = "; ".join(
        f"{fmt(s['rate'])} ({s['share']:.0%}): {fmt(s['answered_rps'])} of "
        f"{fmt(s['sent_rps'])} sent, p99 {s['small_p99_ms']:.1f} ms"
        + ("" if s["kept_up"] else ", **fell behind**")
        for s in report["knee_steps"]
    )
    return (
        f"Capacity found on the fcfs pool: {alone}; then the mix, open loop, "
        f"{report['calibrate_s']:g} s a step, at rising shares of that (req/s asked: "
        f"answered of sent, batch-1 p99): {steps}. It kept up (answered ≥ "
        f"{KEPT_UP_ANSWERED:.0%} of what was sent, batch-1 p99 under the aging bound) up to "
        f"**{fmt(report['capacity_rps'])} req/s: the capacity**."
    )


def offered_share(report: dict[str, Any]) -> str:
    if report.get("rate"):
        share = report["rate"] / report["capacity_rps"]
        return f"a fixed {fmt(report['rate'])} req/s (`--rate`; {share:.0%} of that)"
    return f"{report['load']:.0%} of that"


def split_rows(report: dict[str, Any]) -> str:
    rows = report.get("split_rows", 0)
    return f"; sjf+split and fcfs+split `--split-rows {rows}`" if rows else ""


def client_nice(report: dict[str, Any]) -> str:
    nice = report.get("client_nice", 0)
    return f", at nice {nice}" if nice else ""


def ratios(
    report: dict[str, Any], of: str, to: str, steady: bool = False
) -> dict[str, list[float]]:
    """Per round, `of`'s batch-1 p99 and req/s over `to`'s (rounds where both ran; with
    `steady`, only those where both pools kept up: `window_kept_up`)."""
    by = {(w.get("round", 1), w["policy"]): w for w in report["windows"]}
    rounds = sorted({r for r, _ in by})
    pairs = [(by[(r, of)], by[(r, to)]) for r in rounds if (r, of) in by and (r, to) in by]
    if steady:
        pairs = [(a, b) for a, b in pairs
                 if window_kept_up(report, a) and window_kept_up(report, b)]  # fmt: skip
    return {
        "p99": [a["sizes"][SMALL]["p99_ms"] / b["sizes"][SMALL]["p99_ms"] for a, b in pairs],
        "rps": [a["requests_per_s"] / b["requests_per_s"] for a, b in pairs],
    }


def window_kept_up(report: dict[str, Any], window: dict[str, Any]) -> bool:
    """Whether a measured window kept up with the load, judged as the capacity search judges
    its steps (`kept_up`). On this shared machine a pool falls behind for a spell in some
    windows whatever its policy (2026-11-25, three runs within half an hour: 1, 4 and 8 of 12
    windows, of every policy), and a round in which one of two pools did compares a backlog
    with an order."""
    asked = sum(report["rates"].values())
    return kept_up(window, asked, report["aging_bound_ms"])


def pooled_p99(report: dict[str, Any], policy: str) -> float:
    """The batch-1 p99 over every measured window of ``policy``, the rounds pooled: every
    policy got the same arrival times in a round, so each pool's answers cover the same
    arrivals, three draws of them instead of one. The tail at this load is set by rare
    clusters of large requests, and which clusters a 20 s draw holds moves a round's p99 more
    than the machine does (fcfs, batch 1, the round with seed 202: 5.30 and 5.45 ms in two runs
    of 2026-11-24; the other rounds 13-17 ms)."""
    lat = [v for w in report["windows"] if w["policy"] == policy
           for v in w["sizes"][SMALL].get("latencies_us", [])]  # fmt: skip
    return float(np.percentile(lat, 99)) / 1e3 if lat else math.nan


def listed(values: list[float]) -> str:
    each = ", ".join(f"{v:.2f}×" for v in values)
    return f"{each} (median **{float(np.median(values)):.2f}×**)" if len(values) > 1 else each


def render(report: dict[str, Any]) -> str:
    windows = report["windows"]
    rates = report["rates"]
    rounds = 1 + max((w.get("round", 1) - 1 for w in windows), default=0)
    offered = sum(rates.values())
    lines = [
        BEGIN_MARK,
        "## Scheduling: shortest-job-first with aging vs first-come-first-served, mixed load, "
        "one run",
        "",
        f"- **When / where:** {report['date']}; {report['machine']}; load average "
        f"{report['load_start']} at the start, {report['load_end']} at the end.",
        f"- **Command:** `{report['command']}` ({report['source']}).",
        f"- **Pool:** {report['workers']} workers, the {report['rows']:,}-row demo model. "
        f"{capacity_text(report)}",
        f"- **Load:** open loop at {offered_share(report)}: {fmt(rates[SMALL])} batch-1 "
        f"and {fmt(rates[LARGE])} batch-512 requests/s, h2load {arrivals(report)} "
        f"(64 streams each{client_nice(report)}), {report['duration_s']} s measured after a "
        "warm-up. fcfs and sjf: "
        f"`--worker-inflight {report['worker_inflight']}`; sjf `--aging-bound-ms "
        f"{report['aging_bound_ms']}`{split_rows(report)}.{worker_policy(report)}",
        f"- **Rounds:** {rounds}, each policy once per round on a pool of its own, the order "
        "rotated each round (the machine's speed drifts within minutes); ratios are taken "
        "within a round.",
        "",
        "| policy | round | req/s (of offered) | batch 1 p50 ms | batch 1 p99 ms "
        "| batch 512 p50 ms | batch 512 p99 ms | batch 512 max ms "
        "| longest front-door wait ms: window | since start | sjf margin ms at the end | failed "
        "| kept up |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for w in sorted(windows, key=lambda w: (w["policy"], w.get("round", 1))):
        s, g = w["sizes"][SMALL], w["sizes"][LARGE]
        lines.append(
            f"| {w['policy']} | {w.get('round', 1)} | {fmt(w['requests_per_s'])} "
            f"({w['requests_per_s'] / offered:.0%}) "
            f"| {s['p50_ms']:.2f} | {s['p99_ms']:.2f} | {g['p50_ms']:.2f} | {g['p99_ms']:.2f} "
            f"| {g['max_ms']:.1f} | {w.get('window_wait_max_ms', float('nan')):.1f} "
            f"| {w['queue_wait_max_ms']:.1f} | {margin_text(w)} "
            f"| {sum(w['failed'].values()) if w['failed'] else 0} "
            f"| {'yes' if window_kept_up(report, w) else '**no**'} |"
        )
    lines.append("")
    for sjf, to in COMPARISONS:
        both = ratios(report, sjf, to)
        if not both["p99"]:
            continue
        waits = [w.get("window_wait_max_ms", float("nan")) for w in windows
                 if w["policy"] == sjf]  # fmt: skip
        lines.append(
            f"{sjf} / {to} per round: batch-1 p99 {listed(both['p99'])} (target ≤ 0.5×), "
            f"throughput {listed(both['rps'])} (target ≥ 1.0×); longest front-door wait "
            f"under {sjf} in a measured window **{max(waits):.1f} ms** against an aging bound "
            f"of {report['aging_bound_ms']} ms."
        )
        steady = ratios(report, sjf, to, steady=True)
        lines.append(
            f"{sjf} / {to} in the rounds where both pools kept up: "
            + (f"batch-1 p99 {listed(steady['p99'])}." if steady["p99"] else "none.")
        )
    pooled = {w["policy"]: pooled_p99(report, w["policy"]) for w in windows}
    if rounds > 1 and not any(math.isnan(v) for v in pooled.values()):
        each = ", ".join(f"{name} {p99:.2f} ms" for name, p99 in sorted(pooled.items()))
        lines.append(f"Batch-1 p99 over the {rounds} rounds' windows pooled: {each}.")
        lines += [
            f"Pooled, {sjf} / {to}: **{pooled[sjf] / pooled[to]:.2f}×** (target ≤ 0.5×)."
            for sjf, to in COMPARISONS
            if sjf in pooled and to in pooled
        ]
    sjf_push = ratios(report, "sjf", "push")
    if sjf_push["p99"]:
        lines.append(f"sjf / push (the pool's default) per round: batch-1 p99 "
                     f"{listed(sjf_push['p99'])}.")  # fmt: skip
    lines += ["", f"![worker task density]({PLOT.relative_to(harness.RESULTS_MD.parent)})", ""]
    lines += [f"- {note}" for note in report.get("notes", [])]
    lines.append(END_MARK)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.scheduling", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--rows", type=int, default=2_000_000, help="embedding rows")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--duration", type=float, default=20.0, help="measured seconds")
    parser.add_argument("--warmup", type=float, default=3.0, help="warm-up seconds")
    parser.add_argument(
        "--calibrate", type=float, default=5.0,
        help="seconds of each window of the capacity search: each size alone, then each step",
    )  # fmt: skip
    parser.add_argument("--load", type=float, default=0.8, help="share of capacity offered")
    parser.add_argument(
        "--rate", type=float, default=0.0,
        help="offer this many requests/s of the mix instead of --load × the capacity measured "
        "at the start (which moved 1,846-2,288 req/s between three runs of 2026-11-25, so "
        "'70%%' overloaded every pool in one of them)",
    )  # fmt: skip
    parser.add_argument("--aging-bound-ms", type=float, default=50.0)
    parser.add_argument("--worker-inflight", type=int, default=1)
    parser.add_argument(
        "--split-rows", type=int, default=256,
        help="the --split-rows of the pools sjf+split and fcfs+split (0: no such pools)",
    )  # fmt: skip
    parser.add_argument(
        "--policies", type=lambda s: s.split(","), default=None,
        help="the pools to run, fcfs first: fcfs, sjf, sjf+split, fcfs+split, push "
        "(default: all but push)",
    )  # fmt: skip
    parser.add_argument("--rounds", type=int, default=3, help="every policy this many times")
    parser.add_argument(
        "--client-nice", type=int, default=0,
        help="run the h2load clients at this nice value (0: the server's priority)",
    )  # fmt: skip
    parser.add_argument(
        "--arrivals", choices=["poisson", "paced"], default="poisson",
        help="open-loop arrival times: Poisson (h2load timing scripts) or h2load's --rps, which "
        "sends a burst every 10 ms (default %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--worker-policy", choices=["batch", "normal"], default=None,
        help="every pool's --worker-policy (default: the pool's own default)",
    )  # fmt: skip
    harness.add_run_arguments(parser, quick="1,000 rows, short windows, no report")
    args = parser.parse_args(argv)
    if args.quick:
        args.rows, args.duration, args.warmup, args.calibrate = 1000, 2.0, 0.5, 1.0
        args.rounds = 1
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    with harness.sigterm_as_exit():
        report = run(args)
    report["notes"] = args.note
    # A span longer than the geometric mean of the 5th percentile (a batch-1 call) and the 99th
    # (a batch-512 call) is a large request's.
    spans = [end - start for s in report["spans"].values() for _, start, end in s]
    ends = np.percentile(spans, [5, 99]) if spans else np.ones(2)
    report["split_us"] = float(np.sqrt(ends[0] * ends[1]))
    if not (args.quick or args.no_results):
        plot(report, PLOT)  # beside the section it belongs to, and only then
    if args.json:
        args.json.write_text(json.dumps(report))
    text = render(report)
    print(text)
    if not (args.quick or args.no_results):
        harness.write_section(harness.RESULTS_MD, text, BEGIN_MARK, END_MARK)
    return 0


if __name__ == "__main__":
    sys.exit(main())
