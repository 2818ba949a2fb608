"""bench/frontdoor.py's own parts: the echo pool over the real front door binary, one h2load
window checked against the front door's counters, and the report's targets."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # bench/ is a folder of the checkout, not an installed package

from bench import frontdoor  # noqa: E402


def test_an_echo_window_is_measured_and_checked(tmp_path: Path) -> None:
    body = frontdoor.grpc_body(frontdoor.ECHO_MODEL, {"x": np.ones((1, 3), np.float32)})
    with frontdoor.echo_pool(1) as (port, metrics, roles):
        window = frontdoor.measure("echo 1w", port, metrics, roles, body, 1, 4, 0.5, tmp_path)
    assert window.ok > 10
    assert window.p50_ms > 0 and window.p99_ms >= window.p50_ms
    assert set(window.cpu_us) == {"front door", "workers", "client"}
    assert all(us > 0 for us in window.cpu_us.values())


def test_a_wrong_model_name_fails_the_window(tmp_path: Path) -> None:
    """h2load sees HTTP 200 for a gRPC NOT_FOUND; the front door's counters do not."""
    body = frontdoor.grpc_body("nope", {"x": np.ones((1, 3), np.float32)})
    with frontdoor.echo_pool(1) as (port, metrics, roles):
        try:
            frontdoor.measure("bad", port, metrics, roles, body, 1, 2, 0.3, tmp_path)
        except RuntimeError as exc:
            assert "answered OK" in str(exc)
        else:
            raise AssertionError("a window of failed requests was accepted")


def test_targets_are_ratios_of_one_run() -> None:
    def window(label: str, batch: int, c: int, rps: float, fd: float, wk: float, p50: float):
        return {"label": label, "batch": batch, "concurrency": c, "rps": rps,
                "rows_per_s": rps * batch, "p50_ms": p50, "p99_ms": p50 * 2,
                "cpu_us": {"front door": fd, "workers": wk, "client": 10.0}}  # fmt: skip

    report = {
        "date": "d", "machine": "m", "command": "c", "rows": 1000, "duration_s": 1.0,
        "windows": [
            window("echo 1w", 1, 16, 12000, 40, 30, 0.5),
            window("mpspool 1w", 1, 1, 2000, 50, 300, 0.4),
            window("mpspool 2w", 1, 4, 3000, 45, 320, 0.6),
            window("mpspool 1w", 256, 4, 400, 60, 2000, 3.0),
            window("mpspool 2w", 256, 4, 700, 60, 2100, 3.0),
        ],
        "inprocess": {
            "1p b1": {"rows_per_s": 4000, "p50_ms": 0.3, "cpu_us_per_call": 250},
            "2p b1": {"rows_per_s": 5000, "p50_ms": 0.3, "cpu_us_per_call": 250},
            "2p b256": {"rows_per_s": 200000, "p50_ms": 2.0, "cpu_us_per_call": 2000},
        },
    }  # fmt: skip
    targets = {name: value for name, value, _ in frontdoor.targets(report)}
    assert targets["echo ceiling, req/s"] == "12,000"
    assert targets["front-door CPU per batch-1 Predict, µs"] == "50"
    assert targets["2 workers / in-process P=2, batch 1"] == "0.60"
    assert targets["2 workers / 1 worker, batch 256"] == "1.75"
    assert targets["all-in server CPU per batch-1 request / in-process call"] == "1.46"
    assert targets["p50 at concurrency 1, batch 1, minus the in-process call's, µs"] == "100"
    assert "| mpspool 2w | 256 | 4 |" in frontdoor.render(report)
