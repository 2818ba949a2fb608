"""The peer comparison (bench/compare.py): the task-density arithmetic, the report rendered from
recorded results, the plain single-process peer serving the demo model through the official
client, and a quick run of the comparison itself (plain and a 1-worker pool; Ray and PyTriton
are not needed)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import tensorflow as tf
from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc

from mpspool.demo_model import demo_inputs

from conftest import DEMO_ROWS

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # bench/ is a folder of the checkout, not an installed package

from bench import compare, plots  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
WALL = 1_795_310_000_000_000  # a wall-clock time in µs, as the router records spans


# -- occupancy ------------------------------------------------------------------------
def test_occupancy_counts_overlapping_spans_per_slot_and_bin() -> None:
    spans = [
        ["cpu/s0", 0, 1500],
        ["cpu/s0", 1500, 2000],
        ["cpu/s0", 500, 1000],  # overlaps the first: two requests at once on one worker
        ["cpu/s1", 500, 2500],
    ]
    occ = plots.occupancy(spans, bin_us=1000)
    assert occ.slots == ["cpu/s0", "cpu/s1"]
    assert occ.start_us == 0
    # The last bin ends at the last span's end: 500 µs wide.
    assert occ.edges_us.tolist() == [0, 1000, 2000, 2500]
    assert occ.busy.tolist() == [[1.5, 1.0, 0.0], [0.5, 1.0, 1.0]]
    assert occ.total.tolist() == [2.0, 2.0, 1.0]


def test_occupancy_of_spans_on_bin_edges_and_inside_one_bin() -> None:
    on_edges = plots.occupancy([["w", 1000, 2000]], bin_us=1000, start_us=0, end_us=3000)
    assert on_edges.busy.tolist() == [[0.0, 1.0, 0.0]]
    inside = plots.occupancy([["w", 1200, 1450]], bin_us=1000, start_us=0, end_us=3000)
    assert inside.busy.tolist() == [[0.0, 0.25, 0.0]]
    zero_length = plots.occupancy([["w", 1200, 1200]], bin_us=1000, start_us=0, end_us=2000)
    assert zero_length.busy.tolist() == [[0.0, 0.0]]


def test_occupancy_counts_only_the_window_and_is_exact_on_wall_clock_microseconds() -> None:
    spans = [
        [7, WALL - 400, WALL + 100],  # started before the window
        [7, WALL + 2900, WALL + 3700],  # ends after it
        [7, WALL + 1001, WALL + 1002],
    ]
    occ = plots.occupancy(spans, bin_us=1000, start_us=WALL, end_us=WALL + 3000)
    assert occ.slots == ["7"]
    assert occ.busy.tolist() == [[0.1, 0.001, 0.1]]


def test_occupancy_of_nothing() -> None:
    empty = plots.occupancy([])
    assert empty.slots == [] and empty.busy.shape == (0, 0) and empty.edges_us.tolist() == [0]
    window = plots.occupancy([], bin_us=1000, start_us=WALL, end_us=WALL + 2000)
    assert window.busy.shape == (0, 2) and window.total.tolist() == [0.0, 0.0]


def test_occupancy_refuses_backwards_spans_and_empty_bins() -> None:
    with pytest.raises(ValueError, match="ends before it starts"):
        plots.occupancy([["w", 10, 5]])
    with pytest.raises(ValueError, match="bin_us"):
        plots.occupancy([["w", 0, 5]], bin_us=0)


# -- rendering a recorded run ----------------------------------------------------------
def _point(system: str, batch: int, c: int, rps: float, p99: float, cpu: float, **extra: Any):
    errors = extra.pop("errors", {})
    return {
        "system": system, "round": 0, "mode": "closed", "batch": batch, "concurrency": c,
        "channels": 1, "warmup_s": 1.0, "duration_s": 3.0, "ok": int(rps * 3),
        "errors": errors, "error_count": sum(errors.values()), "errors_outside_window": 0,
        "error_examples": {k: "worker gone" for k in errors}, "sent_total": int(rps * 4),
        "throughput_rps": rps, "rows_per_s": rps * batch, "p50_ms": p99 / 2, "p90_ms": p99 * 0.8,
        "p99_ms": p99, "mean_ms": p99 / 2, "min_ms": p99 / 5, "max_ms": p99 * 1.5,
        "client_cpu_us_per_request": 90.0 if system != "inprocess" else None,
        "server_cpu_us_per_request": cpu, **extra,
    }  # fmt: skip


def _round(cold: float, pss_mib: float, processes: int, **extra: Any) -> dict[str, Any]:
    share = int(pss_mib * 2**20) // processes
    return {
        "status": "ok", "round": 0, "wall_s": 40.0, "cold_start_s": cold,
        "cold_start_is": "spawn to the first answered request",
        "memory": {
            "pss_total_bytes": share * processes, "segment_bytes": 0,
            "processes": [
                {"pid": 100 + i, "name": "python", "pss": share, "uss": share, "rss": share,
                 "segment_pss": 0}
                for i in range(processes)
            ],
        },
        **extra,
    }  # fmt: skip


# Per system: (batch 1 req/s, batch 256 req/s) at C = 1, 4, 16; shaped after the reference
# figures of issue #5 (2,000,000 rows, 2 cores).
CURVES = {
    "plain": ([700, 1200, 1321], [500, 800, 814]),
    "triton": ([400, 900, 984], [200, 330, 364]),
    "mpspool-1": ([800, 1500, 1600], [600, 900, 950]),
    "mpspool-N": ([900, 2800, 3600], [700, 1500, 1700]),
}


def recorded_report() -> dict[str, Any]:
    points = [
        _point("inprocess", 1, 2, 6946.0, 0.4, 350.0),
        _point("inprocess", 256, 2, 2012.2, 1.4, 990.0),
    ]
    for system, per_batch in CURVES.items():
        for batch, values in zip((1, 256), per_batch, strict=True):
            for c, rps in zip((1, 4, 16), values, strict=True):
                errors = {"UNAVAILABLE": 3} if (system, batch, c) == ("mpspool-1", 1, 16) else {}
                points.append(_point(system, batch, c, rps, 2.0 * c, 1100.0, errors=errors))
    # A second, slower round of one point: the tables take the best.
    points.append({**_point("mpspool-N", 256, 16, 1200.0, 40.0, 1200.0), "round": 1})
    spans = []
    for slot in range(2):
        t = WALL + 300 * slot
        while t < WALL + 60_000:
            spans.append([f"cpu/s{slot}", t, t + 2300])
            t += 2600
    systems = {
        "inprocess": {"label": "in-process P=2", "instances": 2,
                      "rounds": [_round(6.6, 1190, 2)], "status": "ok"},
        "plain": {"label": "plain (1 process)", "instances": 1, "protocol": "tfserving",
                  "rounds": [_round(7.5, 888, 1, stop={"exit_code": 0})], "status": "ok"},
        "ray": {"label": "Ray Serve (2 replicas)", "instances": 2, "protocol": "tfserving",
                "rounds": [], "status": "skipped",
                "reason": "not installed: run bench/peers/setup-ray"},
        "triton": {"label": "PyTriton (2 instances)", "instances": 2, "protocol": "kserve",
                   "rounds": [_round(16.0, 1183, 8)], "status": "ok"},
        "mpspool-1": {"label": "mpspool 1 worker", "instances": 1,
                      "rounds": [_round(10.3, 400, 4, all_ready_s=10.4)], "status": "ok"},
        "mpspool-N": {"label": "mpspool 2 workers", "instances": 2,
                      "rounds": [_round(11.3, 700, 5, all_ready_s=11.5)], "status": "ok"},
    }  # fmt: skip
    return {
        "scenario": "compare",
        "date": "2026-11-22T02:00:00+00:00",
        "command": ".venv/bin/python -m bench.compare",
        "machine": {"cpu_model": "AMD EPYC", "logical_cpus": 2, "usable_cores": 2,
                    "memory_gib": 23.5, "kernel": "6.18"},
        "versions": {"python": "3.11.7", "tensorflow-cpu": "2.21.0", "grpcio": "1.85.1",
                     "protobuf": "7.36.2",
                     "peers": {"triton": {"python": "3.11.7", "nvidia-pytriton": "0.7.0",
                                          "tensorflow-cpu": "2.21.0", "numpy": "1.26.4",
                                          "server": "2.51.0"}}},
        "source": {"kind": "worktree", "commit": "abc1234", "uncommitted": []},
        "settings": {"rows": 2_000_000, "model": "/cache/bench-demo-2000000", "instances": 2,
                     "systems": list(compare.SYSTEMS), "batches": [1, 256],
                     "concurrency": [1, 4, 16], "duration_s": 3.0, "warmup_s": 1.0,
                     "repeat": 2, "distinct_requests": 8, "density": [256, 16], "quick": False},
        "load_average_start": [1.0, 1.0, 1.0],
        "load_average_end": [2.5, 2.0, 1.5],
        "systems": systems,
        "points": points,
        "density": {"bin_us": 1000, "batch": 256, "concurrency": 16, "start_us": WALL,
                    "end_us": WALL + 60_000, "spans": spans, "dropped": 0,
                    "throughput_rps": 1700.0, "rows_per_s": 435_200.0, "p50_ms": 16.0,
                    "p99_ms": 32.0, "error_count": 0, "separate_run": False},
        "incidents": [],
        "leftovers": [],
        "wall_s": 600.0,
    }  # fmt: skip


def test_summary_of_a_recorded_run_gives_the_targets_and_ratios() -> None:
    summary = compare.summarise(recorded_report())
    targets = {t["target"].split(":")[0].split(" (")[0]: t for t in summary["targets"]}
    big = targets["batch 256"]
    assert big["measured"] == pytest.approx(1700 * 256 / (2012.2 * 256))
    assert big["met"] is False
    small = targets["batch 1"]
    assert small["measured"] == pytest.approx(3600 / 6946) and small["met"] is True
    ahead = next(t for t in summary["targets"] if "ahead of every peer" in t["target"])
    assert ahead["measured"] == pytest.approx(1700 / 814) and ahead["met"] is True
    assert "measured: plain, triton; not measured: ray" in ahead["target"]
    memory = next(t for t in summary["targets"] if "PSS" in t["target"])
    assert memory["measured"] == pytest.approx(700 / 1183, rel=1e-6) and memory["met"] is True
    assert summary["ratios"]["plain"]["batch 1"] == pytest.approx(3600 / 1321)
    assert summary["systems"]["ray"]["per_batch"]["1"]["best"] is None
    best = summary["systems"]["mpspool-N"]["per_batch"]["256"]["best"]
    assert best["concurrency"] == 16 and best["throughput_rps"] == 1700  # the better round
    assert summary["systems"]["mpspool-1"]["per_batch"]["1"]["errors"] == {"UNAVAILABLE": 3}


def test_render_writes_the_peers_section_and_every_plot(tmp_path: Path) -> None:
    json_path = tmp_path / "out" / "compare-20261122T020000Z.json"
    json_path.parent.mkdir()
    json_path.write_text(json.dumps(recorded_report()))
    results = tmp_path / "RESULTS.md"
    results.write_text(
        "# mpspool benchmark results\n\n<!-- memory:begin (x) -->\nkept\n<!-- memory:end -->\n"
    )
    assert compare.main(["--render", str(json_path), "--results", str(results)]) == 0
    for kind in ("throughput", "p99", "density"):
        png = tmp_path / "out" / f"compare-20261122T020000Z-{kind}.png"
        assert png.read_bytes()[:8] == PNG_MAGIC and png.stat().st_size > 10_000
    text = results.read_text()
    assert "kept\n<!-- memory:end -->" in text  # the other sections are left alone
    section = text[text.index(compare.BEGIN_MARK) : text.index(compare.END_MARK)]
    for fragment in (
        "](out/compare-20261122T020000Z-throughput.png)",
        "](out/compare-20261122T020000Z-p99.png)",
        "](out/compare-20261122T020000Z-density.png)",
        "| batch 256: mpspool 2 workers ≥ 0.9× the in-process limit",
        "| 0.84 × | **no** |",
        "| 0.52 × | yes |",
        "Ray Serve (2 replicas) | – | – | – | – | – | – | – | skipped: not installed: run "
        "bench/peers/setup-ray |",
        "**3 UNAVAILABLE**",
        "**1,600 (3 errors)**",
        "| mpspool 2 workers / X | rows/s batch 1 | rows/s batch 256 | total PSS |",
        "| PyTriton (2 instances) | 3.66 | 4.67 | 0.59 |",
        "PyTriton 0.7.0 (tritonserver 2.51.0",
        "| plain (1 process) | 1 | 888 | 7.5 |",
        "| mpspool 2 workers | 5 | 700 | 11.3 (all workers READY 11.5) |",
        "the 47 requests mpspool 2 workers answered in the measured window",
    ):
        assert fragment in section, fragment
    # Rendering again replaces the section instead of adding one.
    assert compare.main(["--render", str(json_path), "--results", str(results)]) == 0
    assert results.read_text().count(compare.BEGIN_MARK) == 1


# -- the plain peer -----------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _plain(model_dir: Path, port: int, *extra: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "bench.peers.plain", "--model-dir", str(model_dir),
         "--port", str(port), "--instances", "1", *extra],
        cwd=REPO, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip


@pytest.fixture(scope="module")
def plain_peer(demo_model_dir: Path) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    port = _free_port()
    proc = _plain(demo_model_dir / "1", port)
    try:
        yield proc, f"127.0.0.1:{port}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _request(inputs: dict[str, np.ndarray], name: str = "demo") -> predict_pb2.PredictRequest:
    request = predict_pb2.PredictRequest()
    request.model_spec.name = name
    for key, value in inputs.items():
        request.inputs[key].CopyFrom(tf.make_tensor_proto(value))
    return request


def _predict_when_up(stub: Any, request: Any, proc: subprocess.Popen[bytes]) -> Any:
    deadline = time.monotonic() + 120
    while True:
        try:
            return stub.Predict(request, timeout=30)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                raise
            assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
            time.sleep(0.2)


def test_plain_peer_answers_like_the_model_and_tf_serving(plain_peer, reference_model) -> None:
    proc, target = plain_peer
    with grpc.insecure_channel(target) as channel:
        stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
        for batch in (1, 256):
            inputs = demo_inputs(batch, DEMO_ROWS, seed=batch)
            response = _predict_when_up(stub, _request(inputs), proc)
            got = tf.make_ndarray(response.outputs["score"])
            want = reference_model(**{k: tf.constant(v) for k, v in inputs.items()})["score"]
            assert got.shape == (batch, 1)
            np.testing.assert_allclose(got, want.numpy(), rtol=0, atol=1e-6)
            assert response.model_spec.name == "demo"
            assert response.model_spec.version.value == 1
            assert response.model_spec.signature_name == "serving_default"
        with pytest.raises(grpc.RpcError) as info:
            stub.Predict(_request(demo_inputs(1, DEMO_ROWS), name="nope"), timeout=30)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        assert info.value.details() == "Servable not found for request: Latest(nope)"


def test_plain_peer_exits_cleanly_on_sigterm(plain_peer) -> None:
    proc, target = plain_peer
    with grpc.insecure_channel(target) as channel:
        stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
        _predict_when_up(stub, _request(demo_inputs(1, DEMO_ROWS)), proc)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(20) == 0


def test_plain_peer_is_one_instance_by_definition(demo_model_dir: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "bench.peers.plain", "--model-dir", str(demo_model_dir / "1"),
         "--port", "0", "--instances", "2"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "--instances must be 1" in proc.stderr


# -- the comparison, quick --------------------------------------------------------------
def test_quick_comparison_of_plain_and_one_worker(tmp_path: Path, demo_model_dir: Path) -> None:
    # The 1,000-row model the quick run asks for, from the session's demo model (same seed,
    # same rows), through a private cache instead of the user's.
    cache = tmp_path / "cache" / "mpspool"
    cache.mkdir(parents=True)
    (cache / f"bench-demo-{DEMO_ROWS}").symlink_to(demo_model_dir)
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "-m", "bench.compare", "--quick", "--systems", "plain,mpspool-1",
         "--no-results", "--out", str(out)],
        cwd=REPO, env={**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")},
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    (json_path,) = out.glob("compare-quick-*.json")
    report = json.loads(json_path.read_text())
    assert report["leftovers"] == [] and report["incidents"] == []
    assert {name: s["status"] for name, s in report["systems"].items()} == {
        "plain": "ok",
        "mpspool-1": "ok",
    }
    points = report["points"]
    assert sorted((p["system"], p["batch"], p["concurrency"]) for p in points) == sorted(
        (system, batch, c)
        for system in ("plain", "mpspool-1")
        for batch in (1, 256)
        for c in (1, 4)
    )
    for point in points:
        assert point["ok"] > 0 and point["error_count"] == 0
        assert point["server_cpu_us_per_request"] > 0
    for system in report["systems"].values():
        (round_,) = system["rounds"]
        assert round_["cold_start_s"] > 0 and round_["memory"]["pss_total_bytes"] > 100 * 2**20
    assert report["systems"]["plain"]["rounds"][0]["stop"]["exit_code"] == 0
    for kind in ("throughput", "p99"):
        assert (out / f"{json_path.stem}-{kind}.png").read_bytes()[:8] == PNG_MAGIC
