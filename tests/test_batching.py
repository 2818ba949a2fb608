"""Batching in the front door, in a real pool with --enable-batching: requests that wait for
the worker share model calls and each gets its own answer; a bad request fails alone. (The
merge, pad and cut rules are the front door's unit tests, router/src/batch.rs.)"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import requests
import tensorflow as tf
from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc

from mpspool.demo_model import demo_inputs

from conftest import DEMO_ROWS
from poolproc import Pool, mpspool_cmd

METRICS_PATH = "/monitoring/prometheus/metrics"
BATCHING = ":tensorflow:serving:batching_session:"


# -- a real pool ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory, demo_model_dir: Path) -> Iterator[Pool]:
    tmp = tmp_path_factory.mktemp("batching")
    # TF Serving's file: calls of at most 8 rows, padded to 4 or 8 (the padding's answers are
    # the front door's to drop: every answer below is checked against the model).
    params = tmp / "batching.txt"
    params.write_text(
        "max_batch_size { value: 8 }\nbatch_timeout_micros { value: 0 }\n"
        "allowed_batch_sizes: 4\nallowed_batch_sizes: 8\n"
    )
    monitoring = tmp / "monitoring.config"
    monitoring.write_text(f'prometheus_config {{ enable: true, path: "{METRICS_PATH}" }}\n')
    pool = Pool(
        tmp,
        demo_model_dir,
        1,
        # TF Serving's own syntax, and one of its flags that has no use here (a warning).
        "--enable_batching=true",
        "--batching_parameters_file",
        str(params),
        "--monitoring_config_file",
        str(monitoring),
        "--rest_api_num_threads=4",
    ).start()
    try:
        pool.wait_ready(1)
        yield pool
        assert pool.stop() == 0
        assert pool.leftovers() == []
    finally:
        pool.kill()


def request_for(inputs: dict[str, np.ndarray]) -> predict_pb2.PredictRequest:
    request = predict_pb2.PredictRequest()
    request.model_spec.name = "demo"
    for name, array in inputs.items():
        request.inputs[name].CopyFrom(tf.make_tensor_proto(array))
    return request


def sent_while_held(
    pool: Pool,
    stub: prediction_service_pb2_grpc.PredictionServiceStub,
    requests: list[predict_pb2.PredictRequest],
    settle: Callable[[], None] = lambda: None,
) -> list[grpc.Future]:
    """The requests sent while the pool's one worker is stopped, so that they wait in the
    front door (all but the first, handed to the worker) while it "computes" (well within
    the 3 s the front door allows a silent worker); ``settle``, then 0.5 s, before it runs
    on. Their futures, in order."""
    (worker_pid,) = pool.worker_pids()
    os.kill(worker_pid, signal.SIGSTOP)
    try:
        futures = [stub.Predict.future(request, timeout=30) for request in requests]
        settle()
        time.sleep(0.5)
    finally:
        os.kill(worker_pid, signal.SIGCONT)
    return futures


def timeline(pool: Pool, *flags: str) -> list[list]:
    done = subprocess.run(
        mpspool_cmd("timeline", "--run-dir", str(pool.run_dir), *flags),
        capture_output=True, text=True, timeout=30, check=True,
    )  # fmt: skip
    return json.loads(done.stdout)["spans"]


def test_queued_requests_share_model_calls_and_each_gets_its_own_answer(
    pool: Pool, reference_model
) -> None:
    sizes = [1, 3, 2, 1, 4, 1, 2, 2, 5, 1]  # 22 rows: at least 3 calls of <= 8 rows
    inputs = [demo_inputs(rows, DEMO_ROWS, seed=100 + i) for i, rows in enumerate(sizes)]
    bad = demo_inputs(2, DEMO_ROWS, seed=7)
    bad["ids"][1, 3] = DEMO_ROWS + 5  # outside the table: this request alone must fail
    timeline(pool, "--clear")
    with pool.channel() as channel:
        stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
        stub.Predict(request_for(inputs[0]), timeout=30)  # the channel is up
        timeline(pool, "--clear")
        sent = [request_for(x) for x in [*inputs[:5], bad, *inputs[5:]]]
        futures = sent_while_held(pool, stub, sent)
        bad_future = futures.pop(5)
        answers = [f.result() for f in futures]
        with pytest.raises(grpc.RpcError) as info:
            bad_future.result()
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert f"{DEMO_ROWS + 5} is not in [0, {DEMO_ROWS})" in info.value.details()
    for x, answer in zip(inputs, answers, strict=True):
        got = tf.make_ndarray(answer.outputs["score"])
        want = reference_model(**{k: tf.constant(v) for k, v in x.items()})["score"].numpy()
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)

    # Requests answered by one call share their span; the failed call's group was rerun
    # one by one, so the bad request's neighbours still got answers.
    spans = timeline(pool)
    assert len(spans) == len(sizes)
    calls = Counter((start, end) for _, start, end in spans)
    assert max(calls.values()) > 1, spans
    assert pool.slot("cpu-0")["restarts"] == 0


def test_requests_share_a_call_whatever_order_their_inputs_come_in(
    pool: Pool, reference_model
) -> None:
    """The front door listed a request's inputs in the order of its map, which differs from
    one request to the next: requests of a model with several inputs (the demo has two)
    shared a call only when their orders happened to agree (found by a batching hunt; TF
    Serving keys its batches on the set of input names)."""
    inputs = [demo_inputs(1, DEMO_ROWS, seed=200 + i) for i in range(8)]
    with pool.channel() as channel:
        stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
        stub.Predict(request_for(inputs[0]), timeout=30)  # the channel is up
        timeline(pool, "--clear")
        sent = []
        for i, x in enumerate(inputs):
            names = sorted(x, reverse=bool(i % 2))  # and in both orders on the wire
            sent.append(request_for({name: x[name] for name in names}))
        answers = [f.result() for f in sent_while_held(pool, stub, sent)]
    for x, answer in zip(inputs, answers, strict=True):
        want = reference_model(**{k: tf.constant(v) for k, v in x.items()})["score"].numpy()
        np.testing.assert_allclose(tf.make_ndarray(answer.outputs["score"]), want, atol=1e-6)
    # The first went to the idle worker; the seven that waited (7 rows, at most 8 a call)
    # share one call. Before, with each request's order a coin toss, 6 or 7 of them agreed
    # one time in eight.
    calls = Counter((start, end) for _, start, end in timeline(pool))
    assert max(calls.values()) >= 6, calls


def batching_metrics(pool: Pool) -> dict[str, float]:
    """TF Serving's batching series on the pool's Prometheus page (REST port): line → value."""
    page = requests.get(f"{pool.rest_url}{METRICS_PATH}", timeout=30)
    assert page.status_code == 200, page.text
    samples = {}
    for line in page.text.splitlines():
        if line.startswith(BATCHING):
            name, value = line.rsplit(" ", 1)
            samples[name.removeprefix(BATCHING)] = float(value)
    return samples


def test_tf_servings_batching_metrics_count_each_call_and_each_wait(pool: Pool) -> None:
    # What the Grafana and alerting rules built for TF Serving read (queuing latency, runs),
    # under TF Serving's names, buckets and labels.
    sizes = [1, 3, 2, 1, 4, 1, 2, 2]  # 16 rows: at least 3 calls of <= 8 rows
    metrics_url = pool.status()["pool"]["metrics"]

    def all_but_the_first_queued() -> None:
        deadline = time.monotonic() + 20
        while (
            f"mpspool_queued_requests {len(sizes) - 1}\n"
            not in requests.get(metrics_url, timeout=10).text
        ):
            assert time.monotonic() < deadline, "the requests never all queued"
            time.sleep(0.02)

    with pool.channel() as channel:
        stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
        stub.Predict(request_for(demo_inputs(1, DEMO_ROWS)), timeout=30)  # the channel is up
        before = batching_metrics(pool)
        timeline(pool, "--clear")
        sent = [request_for(demo_inputs(n, DEMO_ROWS, seed=n)) for n in sizes]
        futures = sent_while_held(pool, stub, sent, all_but_the_first_queued)
        for future in futures:
            future.result()
    after = batching_metrics(pool)

    def grew(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    calls = len({(start, end) for _, start, end in timeline(pool)})
    assert 3 <= calls < len(sizes)
    assert grew("wrapped_run_count{}") == calls
    # Each request waited once; all but the first (sent to the stopped worker at once)
    # waited out the 0.5 s stop, in microseconds.
    waited = 'queuing_latency_{}{{thread_pool_name=""}}'
    assert grew(waited.format("count")) == len(sizes)
    assert grew(waited.format("sum")) >= 0.5e6 * (len(sizes) - 1)
    assert (
        after['queuing_latency_bucket{thread_pool_name="",le="+Inf"}']
        == after[waited.format("count")]
    )
    # Both inputs (ids, dense) of every request, by their rows.
    assert grew("input_batch_size_count{}") == 2 * len(sizes)
    assert grew("input_batch_size_sum{}") == 2 * sum(sizes)
    # Calls padded to the allowed sizes 4 or 8, the padding's rows counted by that size.
    assert grew("processed_batch_size_count{}") == calls
    grown = {name for name in after if name.startswith("padding_size_count{") and grew(name)}
    assert grown <= {f'padding_size_count{{execution_batch_size="{n}"}}' for n in (4, 8)}, grown
    padding = [name for name in after if name.startswith("padding_size_sum{")]
    padded_rows = sum(grew(name) for name in padding)
    assert grew("processed_batch_size_sum{}") - padded_rows == sum(sizes)


def test_a_request_above_max_batch_size_is_refused_as_tf_serving_does(pool: Pool) -> None:
    """It ran alone before: one call larger than the operator sized calls for (found by two
    hunts). TF Serving's scheduler refuses it before it is queued."""
    assert "mpspool: --rest_api_num_threads=4 has no use here and is ignored" in pool.output()
    with pool.channel() as channel:
        stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            stub.Predict(request_for(demo_inputs(12, DEMO_ROWS, seed=3)), timeout=30)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details() == "Task size 12 is larger than maximum input batch size 8"


def test_tf_servings_large_batch_splitting_answers_a_large_request_in_calls_it_allows(
    tmp_path: Path, demo_model_dir: Path, reference_model
) -> None:
    """TF Serving's file with enable_large_batch_splitting and max_execution_batch_size 8: a
    20-row request is answered whole and right, in model calls of at most 8 rows (8, 8, 4)."""
    params = tmp_path / "batching.txt"
    params.write_text(
        "max_batch_size { value: 32 }\nenable_large_batch_splitting { value: true }\n"
        "max_execution_batch_size { value: 8 }\nallowed_batch_sizes: 4\nallowed_batch_sizes: 8\n"
        "allowed_batch_sizes: 32\n"
    )
    monitoring = tmp_path / "monitoring.config"
    monitoring.write_text(f'prometheus_config {{ enable: true, path: "{METRICS_PATH}" }}\n')
    pool = Pool(
        tmp_path,
        demo_model_dir,
        1,
        "--enable_batching",
        f"--batching_parameters_file={params}",
        f"--monitoring_config_file={monitoring}",
    ).start()
    try:
        pool.wait_ready(1)
        x = demo_inputs(20, DEMO_ROWS, seed=11)
        before = batching_metrics(pool)
        with pool.channel() as channel:
            stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
            got = tf.make_ndarray(stub.Predict(request_for(x), timeout=30).outputs["score"])
        after = batching_metrics(pool)
        want = reference_model(**{k: tf.constant(v) for k, v in x.items()})["score"].numpy()
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)

        def grew(name: str) -> float:
            return after[name] - before.get(name, 0.0)

        assert grew("wrapped_run_count{}") == 3
        # TF Serving's buckets hold values below their bound: 8 rows count under le="16".
        assert grew('processed_batch_size_bucket{le="16"}') == 3
        assert grew('processed_batch_size_bucket{le="8"}') == 1
        assert grew("processed_batch_size_sum{}") == 20, "8, 8 and 4 rows, no padding"
        assert pool.stop() == 0
        assert pool.leftovers() == []
    finally:
        pool.kill()


def test_per_model_batching_parameters_batch_each_version_by_its_own_file(
    tmp_path: Path, demo_model_dir: Path, reference_model
) -> None:
    """--enable_per_model_batching_parameters, as TF Serving: version 1's
    batching_params.pbtxt (splitting at 8 rows) answers a 20-row request in calls of 8, 8 and
    4; version 2, without that file, is not batched; version 3, whose file TF Serving would
    refuse, never serves and says why, while 2 serves on."""
    base, staging = tmp_path / "m", tmp_path / "staging"
    shutil.copytree(demo_model_dir / "1", base / "1")
    (base / "1" / "batching_params.pbtxt").write_text(
        "max_batch_size { value: 32 }\nenable_large_batch_splitting { value: true }\n"
        "max_execution_batch_size { value: 8 }\n"
    )
    monitoring = tmp_path / "monitoring.config"
    monitoring.write_text(f'prometheus_config {{ enable: true, path: "{METRICS_PATH}" }}\n')
    (tmp_path / "pool").mkdir()
    pool = Pool(
        tmp_path / "pool",
        base,
        1,
        "--enable_batching",
        "--enable_per_model_batching_parameters",
        f"--monitoring_config_file={monitoring}",
        "--file_system_poll_wait_seconds=0.2",
    ).start()
    x = demo_inputs(20, DEMO_ROWS, seed=11)
    want = reference_model(**{k: tf.constant(v) for k, v in x.items()})["score"].numpy()

    def predict() -> dict[str, float]:
        """A right answer to the 20 rows; how TF Serving's batching series grew meanwhile."""
        before = batching_metrics(pool)
        with pool.channel() as channel:
            stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
            got = tf.make_ndarray(stub.Predict(request_for(x), timeout=30).outputs["score"])
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
        after = batching_metrics(pool)
        return {name: after[name] - before.get(name, 0.0) for name in after}

    def versions(status: dict[str, Any]) -> dict[int, tuple[str, str]]:
        return {v["version"]: (v["state"], v["error"]) for v in status["versions"]}

    try:
        status = pool.wait_ready(1)
        assert status["versions"][0]["batching"]["split_rows"] == 8
        grew = predict()
        assert grew["wrapped_run_count{}"] == 3
        assert grew["processed_batch_size_sum{}"] == 20, "8, 8 and 4 rows"

        (staging / "2").parent.mkdir()
        shutil.copytree(base / "1", staging / "2", ignore=shutil.ignore_patterns("*.pbtxt"))
        os.rename(staging / "2", base / "2")
        pool.wait_for(
            lambda s: versions(s) == {1: ("END", ""), 2: ("AVAILABLE", "")},
            timeout=90,
            what="version 2 serving, version 1 retired",
        )
        assert predict().get("wrapped_run_count{}", 0) == 0, "version 2 is not batched"

        shutil.copytree(base / "2", staging / "3")
        (staging / "3" / "batching_params.pbtxt").write_text(
            "max_batch_size { value: 32 }\nallowed_batch_sizes: 8\n"
        )
        os.rename(staging / "3", base / "3")
        status = pool.wait_for(
            lambda s: versions(s).get(3, ("", ""))[0] == "END",
            timeout=60,
            what="version 3 failed",
        )
        error = versions(status)[3][1]
        assert "3/batching_params.pbtxt: Last entry in allowed_batch_sizes must match" in error, (
            error
        )
        assert versions(status)[2] == ("AVAILABLE", "")
        assert predict().get("wrapped_run_count{}", 0) == 0
        assert pool.stop() == 0
        assert pool.leftovers() == []
    finally:
        pool.kill()
