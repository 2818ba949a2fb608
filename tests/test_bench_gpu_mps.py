"""bench/gpu_mps.py's report: rendered here from a run made on a GPU machine.

The run itself needs a GPU and PyTorch (neither is here); what this checks is the arithmetic
of the rendered section, from a report shaped as the run writes it.
"""

from __future__ import annotations

from typing import Any

from bench import gpu_mps


def window(batch: int, calls: int, *, error: str | None = None) -> dict[str, Any]:
    client = {"calls": calls, "seconds": 4.0, "cpu_s": calls * 150e-6, "p50_us": 140.0,
              "p99_us": 300.0, "error": error}  # fmt: skip
    return {"batch": batch, "calls_per_s": calls / 4.0, "p50_us": 140.0, "p99_us": 300.0,
            "cpu_us_per_call": 150.0, "utilization_gpu_mean": 50.0, "clients": [client],
            "errors": [error] if error else [], "mps_servers": [646], "mps_clients": 1}  # fmt: skip


def report() -> dict[str, Any]:
    def run(mode: str, k: int, calls: int, error: str | None = None) -> dict[str, Any]:
        return {"mode": mode, "k": k, "exit_codes": [0] * k,
                "windows": [window(1, calls, error=error), window(256, calls // 2)]}  # fmt: skip

    return {
        "date": "2026-11-25 23:30 UTC", "command": "python3 -m bench.gpu_mps", "cpus": 16,
        "kernel": "k", "window_s": 4.0, "rows": 2_000_000, "nvidia_smi": "NVIDIA H200",
        "gpu": {"described": "0 (NVIDIA H200, GPU-x)", "memory_total_mib": 143771,
                "compute_mode": "DEFAULT", "compute_mode_warnings": [], "xid_events": []},
        "mps_control": "nvidia-cuda-mps-control", "mps_defaults": {}, "pinned_limit_mib": 71885,
        "probe_mps": {"mem_get_info": [2**34, 2**37], "allocations": [
            {"mib": 100, "ok": True},
            {"mib": 200, "ok": False, "error": "CUDA out of memory. Tried to allocate 1 GiB. GPU"},
        ]},
        "sets": [run("mps", 1, 4000), run("mps", 2, 7600), run("plain", 1, 4000),
                 run("plain", 2, 1000, error="AcceleratorError: boom")],
        "failed": [],
    }  # fmt: skip


def test_each_batch_gets_its_table_with_ratios_taken_in_the_run() -> None:
    text = gpu_mps.render(report())
    assert text.startswith(gpu_mps.BEGIN) and text.rstrip().endswith(gpu_mps.END)
    batch1 = text[text.index("### Batch 1\n") : text.index("### Batch 256")]
    # K=2: MPS 1,900 calls/s = 1.90x its K=1; no MPS 250 = 0.25x; MPS over no MPS 7.60x.
    row = next(line for line in batch1.splitlines() if line.startswith("| 2 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1:3] == ["1,900", "1.90×"] and cells[7:9] == ["250", "0.25×"]
    assert cells[-1] == "7.60×"
    assert cells[12] == "50 (1 failed)"  # a window with a failed client says so
    assert "refused (CUDA out of memory. Tried to allocate 1 GiB)" in text


def test_a_run_without_a_control_binary_renders_what_it_has() -> None:
    plain_only = report()
    plain_only["sets"] = [s for s in plain_only["sets"] if s["mode"] == "plain"]
    plain_only["mps_error"] = "nvidia-cuda-mps-control not found on PATH"
    text = gpu_mps.render(plain_only)
    assert "MPS: not run (nvidia-cuda-mps-control not found on PATH)" in text
    assert "| 1 | – | – |" in text  # no MPS column values, no ratio


def test_earlier_runs_get_a_line_each_of_the_same_ratios() -> None:
    text = gpu_mps.render(report(), [report()])
    runs = text[text.index("### Every run of this section") :].splitlines()
    # K=2 (the largest here): MPS 1.90x its K=1, no MPS 0.25x, MPS over no MPS 7.60x.
    assert runs[4] == runs[5]
    assert runs[4].startswith("| 2026-11-25 23:30 UTC | MPS sets first | 1.90× | 0.25× | 7.60× |")
