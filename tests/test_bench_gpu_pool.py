"""bench/gpu_pool.py: what of it runs without a GPU. Its requests and answers read without
TensorFlow, checked against TensorFlow's own messages; a worker's answer through the wire
protocol; the call clock; the serving loop's ERROR answer through the real front door; the
report's arithmetic from reports shaped as a GPU run writes them. The run itself needs a GPU
and PyTorch (neither is here)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tensorflow as tf
from tensorflow_serving.apis import predict_pb2

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # bench/ is a folder of the checkout, not an installed package

from bench import echo_worker, gpu_pool, harness  # noqa: E402
from mpspool import dtypes, wire  # noqa: E402
from mpspool.demo_model import demo_inputs  # noqa: E402


def test_requests_without_tensorflow_are_the_official_clients_requests() -> None:
    inputs = demo_inputs(3, 1000, seed=7)
    ours = harness.predict_request("k", "demo", inputs)
    theirs = predict_pb2.PredictRequest()
    theirs.model_spec.name = "demo"
    theirs.model_spec.signature_name = "serving_default"
    for name, values in inputs.items():
        theirs.inputs[name].CopyFrom(tf.make_tensor_proto(values))
    assert ours.body[:1] == b"\x00"
    assert int.from_bytes(ours.body[1:5], "big") == len(ours.body) - 5
    assert ours.body[5:] == theirs.SerializeToString()  # the very bytes
    parsed = predict_pb2.PredictRequest.FromString(ours.body[5:])
    for name, values in inputs.items():
        np.testing.assert_array_equal(tf.make_ndarray(parsed.inputs[name]), values)
    assert (ours.path, ours.batch, ours.protocol) == (harness.PREDICT_PATH, 3, "tfserving")


def test_float_outputs_are_read_from_either_encoding_and_others_refused() -> None:
    request = harness.predict_request("k", "demo", demo_inputs(2, 1000))
    scores = np.array([[0.25], [0.75]], np.float32)
    response = predict_pb2.PredictResponse()
    response.outputs["score"].CopyFrom(tf.make_tensor_proto(scores))  # tensor_content
    assert response.outputs["score"].tensor_content
    np.testing.assert_array_equal(
        harness.answer_values(request, response.SerializeToString()), scores
    )
    typed = predict_pb2.PredictResponse()
    typed.outputs["score"].CopyFrom(tf.make_tensor_proto([[0.5], [1.5]], tf.float32))
    typed.outputs["score"].ClearField("tensor_content")
    typed.outputs["score"].float_val[:] = [0.5, 1.5]
    np.testing.assert_array_equal(
        harness.answer_values(request, typed.SerializeToString()), [[0.5], [1.5]]
    )
    ints = predict_pb2.PredictResponse()
    ints.outputs["score"].CopyFrom(tf.make_tensor_proto(np.ones((2, 1), np.int64)))
    with pytest.raises(RuntimeError, match="dtype 9, not DT_FLOAT"):
        harness.answer_values(request, ints.SerializeToString())
    with pytest.raises(RuntimeError, match=r"without output 'score': \['other'\]"):
        other = predict_pb2.PredictResponse()
        other.outputs["other"].CopyFrom(tf.make_tensor_proto(scores))
        harness.answer_values(request, other.SerializeToString())


def test_a_worker_answers_a_requests_tensors_with_its_calls_scores() -> None:
    inputs = demo_inputs(4, 1000)
    metas, frames = wire.encode_tensors(inputs)
    received = [memoryview(bytes(frame)) for frame in frames]  # as the socket hands them over

    def call(ids: np.ndarray, dense: np.ndarray) -> np.ndarray:
        return (ids.sum(1, keepdims=True) + dense.sum(1, keepdims=True)).astype(np.float64)

    out_metas, out_frames = gpu_pool.answerer(call)({"tensors": metas}, received)
    assert out_metas == [["score", dtypes.DT_FLOAT, [4, 1]]]  # float32, whatever call returns
    got = wire.decode_tensors(out_metas, [bytes(f) for f in out_frames])["score"]
    np.testing.assert_allclose(got, call(inputs["ids"], inputs["dense"]), rtol=1e-6)


def test_the_call_clock_counts_calls_rows_and_time_and_writes_them_often(tmp_path: Path) -> None:
    path = tmp_path / "w.json"
    clock = gpu_pool.CallClock(path)
    timed = clock.timed(lambda ids, dense: time.sleep(0.01) or ids)
    for batch in (1, 3):
        timed(np.zeros((batch, 16)), np.zeros((batch, 13)))
    time.sleep(3 * gpu_pool.STATS_EVERY_S)
    assert json.loads(path.read_text())["calls"] == 2  # written without a close
    with pytest.raises(ZeroDivisionError):  # a call that raises is counted too
        clock.timed(lambda ids: 1 / 0)(np.zeros((2, 16)))
    clock.close()
    totals = json.loads(path.read_text())
    assert totals["calls"] == 3 and totals["rows"] == 6
    assert totals["call_s"] >= 0.02 and 0 <= totals["call_cpu_s"] < totals["call_s"]


def test_per_model_call_figures_only_from_counters_that_kept_up() -> None:
    before = {"calls": 10.0, "rows": 10.0, "call_s": 1.0, "call_cpu_s": 0.5, "main_cpu_s": 2.0,
              "other_cpu_s": 0.0}  # fmt: skip
    after = {"calls": 110.0, "rows": 280.0, "call_s": 1.03, "call_cpu_s": 0.52,
             "main_cpu_s": 2.04, "other_cpu_s": 0.001}  # fmt: skip
    got = gpu_pool.per_model_call(before, after, rows_answered=250)
    assert got["rows_per_call"] == 2.7
    assert got["worker_us_per_call"] == pytest.approx(
        {"call_s": 300.0, "call_cpu_s": 200.0, "main_cpu_s": 400.0, "other_cpu_s": 10.0}
    )
    # A worker's stats file that stopped moving: fewer rows than were answered, no figure.
    stale = gpu_pool.per_model_call(before, after, rows_answered=300)
    assert stale["worker_us_per_call"] is None and "270 rows for 300" in stale["worker_counters"]
    assert gpu_pool.per_model_call(before, before, 0)["worker_us_per_call"] is None


# A worker on the pool's serving loop whose model call fails on a negative input.
FAILING_WORKER = """
import sys
from bench import echo_worker

def answer(header, frames):
    x = echo_worker.wire.decode_tensors(header["tensors"], frames)["x"]
    if (x < 0).any():
        raise ValueError("negative input")
    return header["tensors"], frames

sys.exit(echo_worker.serve(sys.argv[1], sys.argv[2], "echo", echo_worker.signature_defs(), answer))
"""


def test_a_failed_call_is_answered_internal_and_the_worker_serves_on() -> None:
    command = [sys.executable, "-c", FAILING_WORKER]
    good = harness.predict_request("good", "echo", {"x": np.ones((1, 3), np.float32)})
    bad = harness.predict_request("bad", "echo", {"x": -np.ones((1, 3), np.float32)})
    good.output = bad.output = "x"
    with echo_worker.worker_pool(1, "echo", command) as server:
        worker = server.roles["workers"][0]
        with pytest.raises(RuntimeError, match="INTERNAL: ValueError: negative input"):
            harness.call(server.target, bad)
        answer = harness.answer_values(good, harness.call(server.target, good))
        np.testing.assert_array_equal(answer, np.ones((1, 3)))
        assert worker.is_running() and harness.request_counts(server.metrics_url) == {
            "INTERNAL": 1,
            "OK": 1,
        }


def test_a_pool_whose_worker_dies_at_start_fails_at_once() -> None:
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="lost a process"):
        with echo_worker.worker_pool(1, "echo", [sys.executable, "-c", "raise SystemExit(3)"]):
            pass
    assert time.monotonic() - started < 20  # not the 30 s of waiting for registration


# --- the report ------------------------------------------------------------------------------


def _pool_window(batch: int, concurrency: int, rps: float, **extra: Any) -> dict[str, Any]:
    return {"batch": batch, "concurrency": concurrency, "requests": int(rps * 4), "rps": rps,
            "p50_ms": 0.5, "p99_ms": 1.5, "utilization_gpu_mean": 40.0,
            "cpu_us": {"front door": 80.0, "workers": 300.0, "client": 10.0},
            "worker_us_per_call": {"call_s": 250.0, "call_cpu_s": 240.0, "main_cpu_s": 320.0,
                                   "other_cpu_s": 2.0},
            "rows_per_call": 1.0, **extra}  # fmt: skip


def _direct(mode: str, k: int, calls_per_s: float) -> dict[str, Any]:
    window = {"batch": 1, "calls_per_s": calls_per_s, "p50_us": 160.0, "p99_us": 300.0,
              "cpu_us_per_call": 180.0, "utilization_gpu_mean": 95.0, "errors": []}  # fmt: skip
    return {"mode": mode, "k": k, "windows": [window]}


def report() -> dict[str, Any]:
    return {
        "date": "2026-11-26 13:58 UTC", "command": "python3 -m bench.gpu_pool", "cpus": 16,
        "cpu": "Xeon", "kernel": "k", "window_s": 4.0, "warmup_s": 1.0, "rows": 2_000_000,
        "nvidia_smi": "NVIDIA H100", "gpu": "0 (NVIDIA H100, GPU-x)",
        "mps_defaults": {"active_thread_percentage": "100.0"}, "daemon_exit": 0, "failed": [],
        "sets": [_direct("mps", 8, 40_000.0), _direct("plain", 1, 5_000.0),
                 _direct("mps", 1, 8_000.0)],
        "pool": [
            {"mode": "mps", "k": 8, "batching": False, "mps_clients": 8,
             "windows": [_pool_window(1, 8, 10_000.0), _pool_window(1, 32, 16_000.0)]},
            {"mode": "mps", "k": 8, "batching": True, "mps_clients": 8,
             "windows": [_pool_window(1, 32, 40_000.0, rows_per_call=2.7)]},
            {"mode": "plain", "k": 1, "batching": False,
             "windows": [_pool_window(1, 1, 2_000.0)]},
            {"mode": "mps", "k": 1, "batching": False, "mps_clients": 1,
             "windows": [_pool_window(1, 1, 2_000.0)]},
        ],
        "echo": [{"concurrency": 64, "rps": 110_000.0, "p50_ms": 0.5, "p99_ms": 1.0,
                  "cpu_us": {"front door": 60.0, "workers": 28.0, "client": 14.0},
                  "workers": 8, "connections": 8, "client_threads": 4}],
    }  # fmt: skip


def _row(text: str, start: str) -> list[str]:
    line = next(line for line in text.splitlines() if line.startswith(start))
    return [cell.strip() for cell in line.strip("|").split("|")]


def test_each_pool_window_is_a_ratio_of_the_direct_processes_in_its_own_run() -> None:
    text = gpu_pool.render([report()])
    assert text.startswith(gpu_pool.BEGIN) and text.rstrip().endswith(gpu_pool.END)
    assert _row(text, "| 1 | 8 | direct |")[3:5] == ["40,000", "1"]
    assert _row(text, "| 1 | 8 | pool, 32 in flight |")[3:5] == ["16,000", "0.40×"]
    assert _row(text, "| 1 | 8 | pool, batching, 32 in flight |")[3:5] == ["40,000", "1.00×"]
    # Each mode over its own direct processes: 2,000 is 0.40x of 5,000 and 0.25x of 8,000.
    assert _row(text, "| 1 | 1 | pool, no MPS, 1 in flight |")[4] == "0.40×"
    assert _row(text, "| 1 | 1 | pool, 1 in flight |")[4] == "0.25×"
    assert text.count("| 1 | 8 | direct |") == 1  # batching's windows share the direct row
    # Where the CPU goes: outside the call is the serving thread's CPU less the call's.
    assert _row(text, "| 1 | 8 | batching | 32 |")[4:] == ["2.7", "180", "250", "240", "80", "2"]
    assert "K=8 (batching), with the pool's workers up, the daemon listed 8" in text
    assert "K=1, no MPS: 8,000 requests answered OK" in text
    assert "| 64 | 110,000 | 500 | 1,000 | 60.0 | 28.0 | 14.0 |" in text


def test_each_run_is_measured_against_its_own_direct_processes() -> None:
    second = report() | {"date": "2026-11-26 14:07 UTC"}
    second["sets"] = [_direct("mps", 8, 20_000.0)]  # the same pool over a slower direct rate
    text = gpu_pool.render([report(), second])
    first_run, second_run = text.split("### Run 2: 2026-11-26 14:07 UTC")
    assert "### Run 1: 2026-11-26 13:58 UTC" in first_run
    assert _row(first_run, "| 1 | 8 | pool, 32 in flight |")[4] == "0.40×"
    assert _row(second_run, "| 1 | 8 | pool, 32 in flight |")[4] == "0.80×"
    assert _row(second_run, "| 1 | 1 | pool, 1 in flight |")[4] == "–"  # no direct K=1 there


def test_idle_gaps_get_their_own_table_from_the_processes_without_mps() -> None:
    gap = {"date": "2026-11-26 14:04 UTC", "nvidia_smi": "NVIDIA H100",
           "command": "python3 -m bench.gpu_mps --contexts 1 --gap-us 400",
           "sets": [_direct("plain", 1, 1_183.0), _direct("mps", 1, 9_999.0)]}  # fmt: skip
    text = gpu_pool.render([report()], [gap])
    assert "| 2026-11-26 14:04 UTC | 400 | 1 | 1,183 | 160 | 300 | 180 |" in text
    assert "9,999" not in text
    assert "`python3 -m bench.gpu_mps --contexts 1 --gap-us 400`, then" in text
    assert "1 runs back to back" in text


def test_pools_whose_workers_spin_are_rows_of_their_own_over_one_direct_row() -> None:
    spun = report()
    spun["pool"] = [
        {"mode": "mps", "k": 8, "batching": False, "spin_us": 0.0, "mps_clients": 8,
         "windows": [_pool_window(1, 8, 10_000.0)]},
        {"mode": "mps", "k": 8, "batching": False, "spin_us": 200.0, "mps_clients": 8,
         "windows": [_pool_window(1, 8, 12_000.0)]},
    ]  # fmt: skip
    text = gpu_pool.render([spun])
    assert text.count("| 1 | 8 | direct |") == 1
    assert _row(text, "| 1 | 8 | pool, 8 in flight |")[3:5] == ["10,000", "0.25×"]
    assert _row(text, "| 1 | 8 | pool, spin 200 µs, 8 in flight |")[3:5] == ["12,000", "0.30×"]
    assert _row(text, "| 1 | 8 | spin 200 µs | 8 |")[4] == "1.0"
    assert _row(text, "| 1 | 8 |  | 8 |")[4] == "1.0"


def test_a_gap_spent_spinning_is_told_from_one_spent_asleep() -> None:
    def gap(command: str, calls: float) -> dict[str, Any]:
        return {"date": "2026-11-27 16:56 UTC", "nvidia_smi": "NVIDIA H200",
                "command": command, "sets": [_direct("plain", 1, calls)]}  # fmt: skip

    base = "python3 -m bench.gpu_mps --contexts 1 --gap-us"
    text = gpu_pool.render(
        [report()],
        [gap(f"{base} 400", 1_152.0), gap(f"{base} 400 --gap-spin", 1_461.0),
         gap(f"{base} 0 --gap-spin", 4_945.0)],
    )  # fmt: skip
    assert "| 2026-11-27 16:56 UTC | 400 | 1 | 1,152 |" in text
    assert "| 2026-11-27 16:56 UTC | 400, spinning | 1 | 1,461 |" in text
    assert "| 2026-11-27 16:56 UTC | 0 | 1 | 4,945 |" in text  # no gap: nothing to spin


def test_a_report_without_a_pool_set_is_refused() -> None:
    empty = report() | {"pool": [], "failed": ["pool mps k=8: TimeoutError: no"]}
    with pytest.raises(SystemExit, match="run 1 holds no pool set that ran"):
        gpu_pool.render([empty])


def test_a_window_without_worker_figures_says_why() -> None:
    stale = report()
    window = stale["pool"][0]["windows"][0]
    window.update(worker_us_per_call=None, rows_per_call=None,
                  worker_counters="0 calls, 0 rows for 40000 rows answered")  # fmt: skip
    text = gpu_pool.render([stale])
    assert "| 1 | 8 |  | 8 |" not in text  # no split row for it
    assert ("K=8, batch 1, 8 in flight: no worker counters figure (0 calls, 0 rows for 40000 "
            "rows answered).") in text  # fmt: skip
