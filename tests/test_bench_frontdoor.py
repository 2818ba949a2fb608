"""bench/harness.py and bench/frontdoor.py: h2load windows against the real front door binary
over echo workers, failures h2load cannot see, the targets of one run, a short run of
every kind of system, and REST windows beside gRPC (bench/rest.py). Needs h2load
(nghttp2-client, installed by ./dev/setup)."""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # bench/ is a folder of the checkout, not an installed package

from bench import frontdoor, harness, inprocess  # noqa: E402
from bench.echo_worker import echo_pool  # noqa: E402


def _echo(model: str = "echo") -> harness.Request:
    request = harness.predict_request("echo", model, {"x": np.ones((1, 3), np.float32)})
    request.output = "x"
    return request


class _NoCheck(harness.Checker):
    """Skips the Python client's check, so that only h2load's window judges."""

    def __init__(self, answer_bytes: int) -> None:
        super().__init__()
        self.answer_bytes = answer_bytes

    def check(self, server: harness.Server, request: harness.Request) -> int:
        return self.answer_bytes


def test_an_echo_window_is_measured_and_checked(tmp_path: Path) -> None:
    with echo_pool(1) as server:
        assert harness.is_front_door(server.roles["front door"][0])
        row = harness.measure(server, _echo(), 4, 0.5, 0.1, tmp_path, harness.Checker())
    assert row["requests"] > 10 and row["rps"] > 0
    assert 0 < row["p50_ms"] <= row["p99_ms"]
    assert set(row["cpu_us"]) == {"front door", "workers", "client"}
    assert all(us > 0 for us in row["cpu_us"].values())


def test_failures_h2load_counts_as_done_fail_the_window(tmp_path: Path) -> None:
    """A gRPC NOT_FOUND is an HTTP 200 to h2load: the Python check refuses it first, and with
    that check skipped, the missing answer bytes and the front door's counters do."""
    with echo_pool(1) as server:
        good = harness.Checker().check(server, _echo())
        with pytest.raises(RuntimeError, match="NOT_FOUND"):
            harness.measure(server, _echo("nope"), 2, 0.3, 0, tmp_path, harness.Checker())
        with pytest.raises(RuntimeError, match="requests failed") as info:
            harness.measure(server, _echo("nope"), 2, 0.3, 0, tmp_path, _NoCheck(good))
        assert "answers of" in str(info.value) and "NOT_FOUND" in str(info.value)


def test_answers_must_agree_between_systems(tmp_path: Path) -> None:
    checker = harness.Checker()
    with echo_pool(1) as server:
        checker.check(server, _echo())
        other = harness.predict_request("echo", "echo", {"x": np.full((1, 3), 2, np.float32)})
        other.output = "x"
        with pytest.raises(RuntimeError, match="differs from the first system's"):
            checker.check(server, other)


H2LOAD_OUT = """finished in 1.00s, 10121.00 req/s, 1.97MB/s
requests: 10121 total, 10137 started, 10121 done, 10121 succeeded, 0 failed, 0 errored, 0 timeout
status codes: 10121 2xx, 0 3xx, 0 4xx, 0 5xx
traffic: 1.97MB (2065180) total, 29.88KB (30595) headers (space savings 95.74%), \
1.67MB (1750933) data
"""


def test_results_name_the_cpu_closely_enough_to_tell_hosts_apart() -> None:
    # Two hosts that both call themselves "AMD EPYC" ran the model call 8x apart.
    zen1 = (
        "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 23\nmodel\t\t: 1\n"
        "model name\t: AMD EPYC\nflags\t\t: fpu sse4_2 avx fma avx2\n\n"
        "processor\t: 1\ncpu family\t: 23\nmodel\t\t: 1\nmodel name\t: AMD EPYC\n"
    )
    assert harness.describe_cpu(zen1) == "AMD EPYC (family 23 model 1, AVX2)"
    spr = "cpu family\t: 6\nmodel\t\t: 143\nmodel name\t: Intel Xeon\nflags\t: avx2 avx512f\n"
    assert harness.describe_cpu(spr) == "Intel Xeon (family 6 model 143, AVX512F)"
    # An ARM /proc/cpuinfo has none of these fields: the name falls back, nothing is made up.
    assert "family" not in harness.describe_cpu("processor\t: 0\nFeatures\t: fp asimd\n")


def test_h2load_output_is_parsed() -> None:
    log = "".join(f"1795354497{i:06d}\t200\t{100 * (i + 1)}\n" for i in range(100)) + "1\t500\t9\n"
    done, rps, data, p50, p99 = harness.parse_h2load(H2LOAD_OUT, log)
    assert (done, rps, data) == (10121, 10121.0, 1750933)
    assert p50 == pytest.approx(5.05) and p99 == pytest.approx(9.901)
    with pytest.raises(RuntimeError, match="unexpected h2load output"):
        harness.parse_h2load("connect failed", "")


def test_h2load_streams_make_the_concurrency_asked_for() -> None:
    for concurrency in (1, 2, 4, 5, 6, 7, 10, 16, 64):
        connections, streams = harness.spread_streams(concurrency, harness.MAX_CONNECTIONS)
        assert connections * streams == concurrency and connections <= harness.MAX_CONNECTIONS
    assert harness.spread_streams(16, 4) == (4, 4)  # as many connections as allowed
    assert harness.spread_streams(6, 4) == (3, 2)


def test_a_front_door_binary_older_than_its_sources_is_said_to_be(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The binary is not frozen with the Python code: a run over one built before its sources
    changed says so beside the code it claims to measure."""
    import mpspool.router

    binary = tmp_path / "mpspool-router"
    binary.write_bytes(b"")
    monkeypatch.delenv(mpspool.router.BINARY_ENV, raising=False)
    monkeypatch.setattr(mpspool.router, "binary_path", lambda: str(binary))
    os.utime(binary, (0, 0))  # built in 1970: every source file changed since
    source = harness.freeze_source("live", tmp_path)
    assert "older than its sources (router/" in source["front_door"]["problem"]
    described = harness._describe_source(source)
    assert f"front door `{binary}` built 1970-01-01 00:00 UTC, **older than its" in described
    future = time.time() + 3600
    os.utime(binary, (future, future))
    source = harness.freeze_source("live", tmp_path)
    assert source["front_door"]["problem"] == ""
    assert harness._describe_source(source).endswith(
        f"front door `{binary}` built " + (time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(future)))
    )


def _window(system: str, batch: int, c: int, rps: float, fd: float, wk: float, p50: float):
    return {
        "system": system, "batch": batch, "concurrency": c, "requests": int(rps), "rps": rps,
        "rows_per_s": rps * batch, "p50_ms": p50, "p99_ms": p50 * 2, "load1": 1.0,
        "cpu_us": {"front door": fd, "workers": wk, "client": 10.0},
    }  # fmt: skip


def _inprocess(
    p: int, batch: int, rows_per_s: float, p50: float, cpu: float, feed: str = "tensor"
) -> dict[str, Any]:
    return {
        "processes": p, "batch": batch, "throughput_rps": rows_per_s / batch,
        "rows_per_s": rows_per_s, "p50_ms": p50, "p99_ms": p50, "cpu_us_per_call": cpu,
        "load1": 1.0, "feed": feed,
    }  # fmt: skip


REPORT = {
    "date": "2026-11-22 13:00 UTC", "command": "c", "machine": "m", "load_start": "1",
    "load_end": "2", "rows": 1000, "duration_s": 1.0, "warmup_s": 0.5, "source": "s",
    "front_door": "f",
    "skipped": {"ray": "not installed: run bench/peers/setup-ray"}, "peer_versions": {},
    "windows": [
        _window("echo 1w", 1, 16, 12000, 40, 30, 0.5),
        _window("mpspool 1w", 1, 1, 2000, 50, 300, 0.4),
        _window("mpspool 2w", 1, 4, 3000, 45, 320, 0.6),
        _window("mpspool 1w", 256, 4, 400, 60, 2000, 3.0),
        _window("mpspool 2w", 256, 4, 700, 60, 2100, 3.0),
        {**_window("mpspool 2w", 256, 4, 500, 60, 2100, 3.0), "round": 1},  # a slower round
        {**_window("plain TF gRPC (1 process)", 1, 4, 1000, 0, 0, 1.0), "cpu_us": {"server": 9}},
        {**_window("plain TF gRPC (1 process)", 256, 4, 800, 0, 0, 1.0), "cpu_us": {"server": 9}},
    ],
    "inprocess": [
        _inprocess(1, 1, 4000, 0.3, 350),  # P=1 costs more per call than P=2 here
        _inprocess(2, 1, 5000, 0.3, 250),
        _inprocess(2, 256, 200000, 2.0, 2000),
        # Processes calling a session: beside the limit, never in a target.
        _inprocess(1, 1, 16000, 0.1, 60, "session"),
        _inprocess(2, 1, 20000, 0.1, 60, "session"),
        _inprocess(2, 256, 250000, 1.5, 1500, "session"),
    ],
    "systems": [{"system": "plain TF gRPC (1 process)", "processes": 1, "memory_mib": 900,
                 "start_s": 5.0}],
}  # fmt: skip


def test_targets_are_ratios_of_one_run(tmp_path: Path) -> None:
    report = {**REPORT, "summary": frontdoor.summarise(REPORT)}
    got = {t["target"].split(" (")[0]: (round(t["measured"], 2), t["met"]) for t in
           report["summary"]["targets"]}  # fmt: skip
    assert got["one front door over echo workers ≥ 10,000 req/s"] == (12000, True)
    assert got["front-door CPU per batch-1 Predict ≤ 60 µs"] == (50, True)
    assert got["all-in server CPU per batch-1 request"] == (1.46, True)  # (45 + 320) / 250
    assert got["batch 1: 2 workers ≥ 0.6× the in-process limit"] == (0.6, True)
    assert got["batch 256: 2 workers ≥ 0.85× the in-process limit"] == (0.9, True)
    assert got["batch 256: 2 workers ≥ 1.6× 1 worker"] == (1.75, True)
    assert got["2 workers ahead of every peer at batch 1 and 256"] == (0.88, False)
    assert got["p50 at concurrency 1, batch 1 ≤ the in-process call's + 150 µs"] == (100, True)
    reading = "for reading, not a target: batch {}, 2 workers / P=2 calling a session"
    assert got[reading.format(1)] == (0.15, None)  # 3000 / 20000
    assert got[reading.format(256)] == (0.72, None)  # 179200 / 250000
    assert got["for reading, not a target: the front door's CPU per batch-1 Predict"] == (
        0.2,
        None,
    )  # 50 / 250, P=2's call
    text = frontdoor.render(report, frontdoor.draw(report, tmp_path / "fd.png"))
    assert (tmp_path / "fd.png").read_bytes()[:4] == b"\x89PNG"
    assert text.startswith(frontdoor.BEGIN_MARK) and text.endswith(frontdoor.END_MARK + "\n")
    for fragment in (
        "| mpspool 2w, round 1 | 256 | 4 | 700 | 179,200 | 3.00 | 6.00 | 2,160 | 60 | 2,100 | 10 |",
        "| mpspool 2w, round 2 | 256 | 4 | 500 |",
        "| 0.88 × | **no** |",
        "ray: not installed: run bench/peers/setup-ray",
        "| plain TF gRPC (1 process), round 1 | 1 | 900 | 5.0 |",
        "| P=2, session call, round 1 | 256 | 977 | 250,000 | 1.50 | 1.50 | 1,500 | 1.0 |",
        "| 0.15 × | – |",
    ):
        assert fragment in text, fragment
    results = tmp_path / "RESULTS.md"
    results.write_text("# r\n\n<!-- memory:begin -->\nkept\n<!-- memory:end -->\n")
    for _ in range(2):
        harness.write_section(results, text, frontdoor.BEGIN_MARK, frontdoor.END_MARK)
    assert results.read_text().count(frontdoor.BEGIN_MARK) == 1 and "kept" in results.read_text()


def test_a_target_over_1_and_2_workers_is_unmeasured_when_one_of_them_is() -> None:
    """A window whose workers' CPU could not be measured (a worker restarted in it: NaN)
    leaves "the worse of 1 and 2 workers" unmeasured; it read 1 worker's figure alone, and
    the all-in target went from 2.84x (not met) to 0.50x (met) in a hunt's run."""
    windows = [
        {**w, "cpu_us": {**w["cpu_us"], "workers": float("nan")}}
        if (w["system"], w["batch"]) == ("mpspool 2w", 1)
        else w
        for w in REPORT["windows"]
    ]
    summary = frontdoor.summarise({**REPORT, "windows": windows})
    got = {t["target"].split(" (")[0]: t for t in summary["targets"]}
    all_in = got["all-in server CPU per batch-1 request"]
    assert np.isnan(all_in["measured"]) and all_in["met"] is None
    # The front door's own CPU was measured in both: still the worse of the two.
    assert got["front-door CPU per batch-1 Predict ≤ 60 µs"]["measured"] == 50
    no_two = [w for w in REPORT["windows"] if w["system"] != "mpspool 2w"]
    summary = frontdoor.summarise({**REPORT, "windows": no_two})
    got = {t["target"].split(" (")[0]: t for t in summary["targets"]}
    assert got["front-door CPU per batch-1 Predict ≤ 60 µs"]["met"] is None


def test_each_generated_section_of_results_md_holds_its_own_heading_alone() -> None:
    """A scenario rewrites everything between its markers: a section written by hand inside
    them is lost at its next run (three were, inside rest's and gpu-mps's markers)."""
    text = harness.RESULTS_MD.read_text()
    marks = re.findall(r"<!-- ([a-z-]+):(begin|end)\b", text)
    assert marks and len(marks) % 2 == 0, marks
    for begin, end in zip(marks[::2], marks[1::2], strict=True):
        assert begin[0] == end[0] and (begin[1], end[1]) == ("begin", "end"), (begin, end)
        inside = text.split(f"<!-- {begin[0]}:begin", 1)[1].split(f"<!-- {begin[0]}:end", 1)[0]
        headings = [line for line in inside.splitlines() if line.startswith("## ")]
        assert len(headings) == 1, (begin[0], headings)


def test_a_short_run_of_each_kind_of_system(tmp_path: Path) -> None:
    """Echo workers, the in-process limit, a pool and the plain peer, end to end: every window
    checked, every process stopped."""
    out = tmp_path / "report.json"
    assert frontdoor.main([
        "--systems", "echo-1,inprocess-1,mpspool-1,plain", "--rows", "1000", "--duration", "0.3",
        "--warmup", "0.1", "--batches", "1,8", "--concurrency", "2", "--echo-concurrency", "4",
        "--no-results", "--json", str(out),
    ]) == 0  # fmt: skip
    report = json.loads(out.read_text())
    assert [(w["system"], w["batch"]) for w in report["windows"]] == [
        ("echo 1w", 1), ("mpspool 1w", 1), ("mpspool 1w", 8),
        ("plain TF gRPC (1 process)", 1), ("plain TF gRPC (1 process)", 8),
    ]  # fmt: skip
    assert [(p["feed"], p["batch"]) for p in report["inprocess"]] == [
        ("tensor", 1), ("tensor", 8), ("session", 1), ("session", 8),
    ]  # fmt: skip
    assert all(p["ok"] > 0 for p in report["inprocess"])
    # The limit ran on the inputs of the request the served systems got (see the next test).
    assert all(p["seeds"] == [inprocess.REQUEST_SEED] for p in report["inprocess"])
    assert {s["system"] for s in report["systems"]} == {"mpspool 1w", "plain TF gRPC (1 process)"}
    assert all(w["requests"] > 0 for w in report["windows"])


def test_the_limit_and_the_served_systems_get_the_same_inputs() -> None:
    """The request h2load posts carries demo_inputs(seed=REQUEST_SEED), the inputs the
    in-process limit calls the model with by default: both sides gather the same rows (8
    inputs of the limit's own cost it 1.2-1.7x the CPU per batch-256 call, RESULTS.md)."""
    import tensorflow as tf
    from tensorflow_serving.apis import predict_pb2

    from mpspool.demo_model import demo_inputs

    request = frontdoor.requests(1000, [8])["tfserving", 8]
    sent = predict_pb2.PredictRequest.FromString(request.body[5:])
    expected = demo_inputs(8, 1000, seed=inprocess.REQUEST_SEED)
    assert sorted(sent.inputs) == sorted(expected)
    for name, values in expected.items():
        np.testing.assert_array_equal(tf.make_ndarray(sent.inputs[name]), values)


def test_rest_windows_beside_grpc(tmp_path: Path) -> None:
    """bench/rest.py: one pool, each point over gRPC and over REST (h2load --h1), every window
    checked (REST's answer equal to gRPC's) and the ratios written."""
    from bench import rest

    out = tmp_path / "report.json"
    assert rest.main([
        "--rows", "1000", "--workers", "1", "--duration", "0.3", "--warmup", "0.1",
        "--batches", "1,8", "--concurrency", "2", "--no-results", "--json", str(out),
    ]) == 0  # fmt: skip
    report = json.loads(out.read_text())
    assert [(w["system"], w["batch"]) for w in report["windows"]] == [
        ("gRPC", 1), ("REST", 1), ("gRPC", 8), ("REST", 8),
    ]  # fmt: skip
    assert all(w["requests"] > 0 and w["cpu_us"]["front door"] > 0 for w in report["windows"])
    text = rest.render(report)
    assert "| 8 | 2 |" in text and text.count("×") >= 4
