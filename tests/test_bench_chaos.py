"""bench/chaos.py, short: a real pool under closed-loop load while workers and the front door
are killed; the report counts every request, names each failure's cause, and finds nothing
left behind after the pool stops."""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # bench/ is a folder of the checkout, not an installed package

from bench import chaos  # noqa: E402


def test_a_short_chaos_run(tmp_path: Path) -> None:
    out = tmp_path / "chaos.json"
    assert chaos.main(["--quick", "--threads", "2", "--no-results", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    killed = {k["killed"] for k in report["kills"]}
    assert killed == {"worker", "front door"}, report["kills"]
    summary = report["summary"]
    assert summary["requests"] > summary["failed"] > 0
    assert sum(c["n"] for c in summary["causes"]) == summary["failed"]
    assert {c["code"] for c in summary["causes"]} <= {"UNAVAILABLE"}, summary["causes"]
    assert report["leftovers"] == [] and report["pool_exit"] == 0
    assert report["status_end"]["pool"]["phase"] == "serving"
    text = chaos.render(report)
    assert chaos.BEGIN_MARK in text and "nothing (no process" in text
