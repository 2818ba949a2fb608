"""bench/gpu_mps.py without a GPU: its CPU-side checks against the real nvidia-cuda-mps-control,
its orchestration (workers, start barrier, MPS daemon, report) with the model on the CPU, and
its arithmetic. The GPU measurement itself needs a GPU machine and is not tested here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # bench/ is a folder of the checkout, not an installed package

from bench import gpu_mps  # noqa: E402

FAKE_GPU = json.dumps(
    [
        {
            "uuid": "GPU-0a0a0a0a-0000-4000-8000-000000000000",
            "name": "Fake GPU",
            "compute_mode": "DEFAULT",
        }
    ]
)


def _binary_or_skip() -> str:
    path, why = gpu_mps.locate_control_binary(None)
    if path is None:
        pytest.skip(f"no nvidia-cuda-mps-control here: {why}")
    return path


def _bench(fake_gpus: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "MPSPOOL_FAKE_GPUS": fake_gpus}
    return subprocess.run(
        [sys.executable, "-m", "bench.gpu_mps", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _cleaned_up(report: dict[str, object]) -> None:
    """Nothing the bench started runs on (every process it starts has its MPS pipe directory
    under the bench's private directory), and that directory is gone."""
    workdir = Path(str(report["workdir"]))
    assert gpu_mps.processes_under(workdir) == []
    assert not workdir.exists()


def test_no_gpu_runs_the_cpu_side_checks_and_says_the_numbers_are_missing(
    tmp_path: Path,
) -> None:
    _binary_or_skip()
    out_json, out_md = tmp_path / "r.json", tmp_path / "r.md"
    # An empty fake GPU list is "no GPU" (NoGpuDriver) even on a machine that has one.
    done = _bench("[]", "--json", str(out_json), "--markdown", str(out_md))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "GPU numbers missing: no GPU on this machine" in done.stdout
    assert "FAIL" not in done.stdout
    report = json.loads(out_json.read_text())
    assert report["cpu_checks"] and all(c["ok"] for c in report["cpu_checks"])
    assert report["gpu_numbers_missing"]
    text = out_md.read_text()
    assert "**GPU numbers missing:**" in text and "<!-- gpu_mps:end -->" in text
    _cleaned_up(report)


def test_a_missing_control_binary_fails(tmp_path: Path) -> None:
    done = _bench("[]", "--mps-control", str(tmp_path / "nowhere"))
    assert done.returncode == 1
    assert "not found" in done.stdout


def test_orchestration_end_to_end_with_the_model_on_the_cpu(tmp_path: Path) -> None:
    """A fake GPU and --framework numpy: real worker processes, start barrier, a real MPS
    control daemon (its server never starts: no CUDA client), NVML sampling through the fake
    backend, targets and report. Proves the plumbing, not any GPU number."""
    _binary_or_skip()
    out_json = tmp_path / "r.json"
    done = _bench(
        FAKE_GPU,
        "--framework",
        "numpy",
        "--workers",
        "2",
        "--batches",
        "1,4",
        "--duration",
        "0.3",
        "--warmup",
        "0",
        "--json",
        str(out_json),
    )
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out_json.read_text())
    points = report["points"]
    assert [(p["config"], p["batch"]) for p in points] == [
        ("1w", 1),
        ("1w", 4),
        ("2w-nomps", 1),
        ("2w-nomps", 4),
        ("2w-mps", 1),
        ("2w-mps", 4),
    ]
    for p in points:
        assert "error" not in p, p
        assert len(p["per_worker_calls"]) == p["workers"] and min(p["per_worker_calls"]) > 0
        assert p["rows_per_s"] == pytest.approx(p["calls_per_s"] * p["batch"])
        assert p["p50_ms"] <= p["p99_ms"]
        assert p["gpu_util_samples"] > 0
    assert all(p["mps_clients"] == 0 for p in points if p["mps"])  # no CUDA, no MPS client
    assert len(report["targets"]) == 4
    assert "Not GPU numbers" in done.stdout
    _cleaned_up(report)


def test_percentile_and_pinned_memory_readback() -> None:
    assert gpu_mps.percentile([1.0, 2.0, 3.0, 4.0, 5.0], 50) == 3.0
    assert gpu_mps.percentile([1.0, 2.0], 99) == pytest.approx(1.99)
    assert gpu_mps.parse_mib("1G") == 1024
    assert gpu_mps.parse_mib("1024M") == 1024
    assert gpu_mps.parse_mib("") is None


def test_targets_compare_mps_with_one_worker_and_with_no_mps() -> None:
    points = [
        {"config": "1w", "batch": 8, "rows_per_s": 100.0},
        {"config": "4w-nomps", "batch": 8, "rows_per_s": 180.0},
        {"config": "4w-mps", "batch": 8, "rows_per_s": 210.0},
        {"config": "1w", "batch": 64, "rows_per_s": 100.0},  # above 32: no target
    ]
    got = {t["goal"]: (round(t["ratio"], 3), t["met"]) for t in gpu_mps.targets(points, 4)}
    assert got == {2.0: (2.1, True), 1.2: (1.167, False)}
