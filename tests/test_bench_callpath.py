"""bench/callpath.py: every call path of the worker runtime gives the same answer and is
timed; a short run of the real scenario (a child process loading the demo model)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # bench/ is a folder of the checkout, not an installed package

from bench import callpath  # noqa: E402


def test_a_quick_run_times_every_path_at_both_batches(tmp_path: Path) -> None:
    out = tmp_path / "callpath.json"
    assert callpath.main(["--quick", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    cells = {(r["batch"], r["gap_ms"], r["path"]) for r in report["results"]}
    # The child refuses to time a path whose answer differs from the others' (SystemExit).
    assert cells == {
        (batch, gap, path) for batch in (1, 256) for gap in (0.0, 2.0) for path in callpath.PATHS
    }
    assert all(r["cpu_us"] > 0 and r["calls"] > 0 for r in report["results"])
    text = callpath.render(report)
    assert text.startswith(callpath.BEGIN_MARK) and text.endswith(callpath.END_MARK)
    assert "| 1 | 0 ms |" in text and "| 256 | 2 ms |" in text
