"""bench/scheduling.py's judgement of an open-loop window and its report of the capacity
search, on recorded windows (the search itself runs pools and h2load: the bench's own run)."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # bench/ is a folder of the checkout, not an installed package

from bench import scheduling  # noqa: E402
from bench.scheduling import LARGE, SMALL  # noqa: E402


def _window(sent: tuple[float, float], answered: float, small_p99_ms: float) -> dict[str, Any]:
    return {
        "requests_per_s": answered,
        "sizes": {
            SMALL: {"sent_rps": sent[0], "p99_ms": small_p99_ms},
            LARGE: {"sent_rps": sent[1], "p99_ms": 3 * small_p99_ms},
        },
    }


def test_a_window_is_kept_up_when_answered_as_sent_and_the_small_tail_stays_under_the_bound():
    assert scheduling.kept_up(_window((900, 100), 990, 12.0), 1_050, 50.0)
    # Fell behind: answered less than 97% of what h2load sent (not of what it was asked).
    assert not scheduling.kept_up(_window((900, 100), 960, 12.0), 1_000, 50.0)
    assert scheduling.kept_up(_window((850, 95), 930, 12.0), 1_000, 50.0)
    # A backlog: everything answered, but small requests waited the aging bound.
    assert not scheduling.kept_up(_window((900, 100), 1_000, 50.0), 1_000, 50.0)
    # Paced arrivals log no send times: what was asked is what was sent.
    paced = _window((math.nan, math.nan), 985, 8.0)
    assert scheduling.kept_up(paced, 1_000, 50.0)
    assert not scheduling.kept_up(paced, 1_100, 50.0)


def test_the_report_states_every_step_of_the_search_and_the_capacity_it_found():
    steps = [
        {"share": share, "rate": rate, "sent_rps": 0.96 * rate, "answered_rps": answered,
         "small_p99_ms": p99, "kept_up": ok}
        for share, rate, answered, p99, ok in (
            (0.40, 1_000.0, 960.0, 4.0, True),
            (0.45, 1_125.0, 1_079.0, 9.5, True),
            (0.50, 1_250.0, 1_050.0, 180.0, False),
        )
    ]  # fmt: skip
    report = {
        "alone_rps": {SMALL: 3_600.0, LARGE: 800.0},
        "estimate_rps": 2_500.0,
        "knee_steps": steps,
        "capacity_rps": 1_125.0,
        "calibrate_s": 5.0,
    }
    text = scheduling.capacity_text(report)
    assert "1,000 (40%)" in text and "1,125 (45%)" in text and "1,250 (50%)" in text
    assert text.count("fell behind") == 1 and "p99 180.0 ms, **fell behind**" in text
    assert "up to **1,125 req/s: the capacity**" in text and "5 s a step" in text
    # A report of a run before the search (one overloaded window) still renders.
    old = {k: v for k, v in report.items() if k != "knee_steps"} | {"mixed_rps": 2_158.0}
    assert "it answered 2,158 req/s" in scheduling.capacity_text(old)


def test_steady_ratios_leave_out_rounds_in_which_either_pool_fell_behind():
    def measured(policy: str, round_: int, small_p99_ms: float, answered: float = 1_000.0):
        window = _window((900, 100), answered, small_p99_ms)
        return window | {"policy": policy, "round": round_}

    report = {
        "rates": {SMALL: 900.0, LARGE: 100.0},
        "aging_bound_ms": 50.0,
        "windows": [
            measured("fcfs", 1, 10.0), measured("sjf", 1, 4.0),
            measured("fcfs", 2, 180.0), measured("sjf", 2, 5.0),  # fcfs's spell
            measured("fcfs", 3, 12.0), measured("sjf", 3, 6.0, answered=900.0),  # sjf's
            measured("fcfs", 4, 8.0), measured("sjf", 4, 6.0),
        ],
    }  # fmt: skip
    assert scheduling.ratios(report, "sjf", "fcfs")["p99"] == [0.4, 5.0 / 180.0, 0.5, 0.75]
    assert scheduling.ratios(report, "sjf", "fcfs", steady=True)["p99"] == [0.4, 0.75]
    assert not scheduling.window_kept_up(report, report["windows"][5])
