"""bench/backlog.py's round, short: the two-model pool it builds serves both models with the
real front door binary (busy's requests wait in the front door, free's pass them), and the
round reports what it measured."""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # bench/ is a folder of the checkout, not an installed package

from bench import backlog  # noqa: E402
from mpspool.router import binary_path  # noqa: E402


@pytest.mark.skipif(shutil.which("h2load") is None, reason="h2load (nghttp2-client) not installed")
def test_a_short_round_answers_both_models_and_measures_the_front_door(tmp_path: Path):
    args = argparse.Namespace(seconds=1.0, backlog=20, delay_ms=20.0, concurrency=2)
    result = backlog.one_round(binary_path(), args, tmp_path)
    # free's requests were answered while busy's 20 waited on its one 20 ms worker.
    assert result["free_rps"] > 50, result
    # busy's worker takes a request at a time at its own pace (h2load ran 5 s): every one of
    # its answers is one call of 20 ms, so no more than its pace allows, and it kept going.
    assert 25 <= result["busy_done"] <= 5.0 / 0.02 + 1, result
    assert result["cpu_s"] > 0 and result["us_per_request"] > 0, result
