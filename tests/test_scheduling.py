"""The front door's scheduling, in a real pool: large requests split across workers and joined
back (answers equal to the model's), a bad row in a split request failing it with the
model's error, shortest-job-first with power-of-two dispatch answering a mixed stream
correctly; and the batching and scheduling settings read and checked as TF Serving's are.
(The policies' rules are the front door's unit tests: router/src/policies/, batch.rs,
split.rs.)"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import tensorflow as tf
from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc

from mpspool import cli
from mpspool.config import ConfigError, PoolConfig, batching_parameters_from, version_batching
from mpspool.demo_model import demo_inputs

from conftest import DEMO_ROWS
from poolproc import Pool, mpspool_cmd


# -- settings -----------------------------------------------------------------------------
def test_batching_parameters_files_are_read_as_tf_serving_reads_them(tmp_path: Path) -> None:
    path = tmp_path / "batching.txt"
    path.write_text(
        "max_batch_size { value: 128 }\nbatch_timeout_micros { value: 500 }\n"
        "max_enqueued_batches { value: 4 }\nnum_batch_threads { value: 8 }\n"
        'thread_pool_name { value: "batch" }\n'
        "allowed_batch_sizes: 32\nallowed_batch_sizes: 64\nallowed_batch_sizes: 128\n"
    )
    assert batching_parameters_from(path) == {
        "max_batch_size": 128,
        "batch_timeout_micros": 500,
        "max_enqueued_batches": 4,
        "allowed_batch_sizes": (32, 64, 128),
    }
    # enable_large_batch_splitting: calls of max_execution_batch_size rows, larger requests cut
    # into pieces of that many (--split-rows); without the field, max_batch_size's.
    path.write_text(
        "max_batch_size { value: 256 }\nenable_large_batch_splitting { value: true }\n"
        "max_execution_batch_size { value: 64 }\nallowed_batch_sizes: 32\n"
        "allowed_batch_sizes: 64\nallowed_batch_sizes: 256\n"
    )
    assert batching_parameters_from(path) == {
        "max_batch_size": 64,
        "split_rows": 64,
        "allowed_batch_sizes": (32, 64),
    }
    # A batch of up to 48 rows is padded to 64 there: calls of 64 rows at most, as there.
    path.write_text(
        "max_batch_size { value: 256 }\nenable_large_batch_splitting { value: true }\n"
        "max_execution_batch_size { value: 48 }\nallowed_batch_sizes: 32\n"
        "allowed_batch_sizes: 64\nallowed_batch_sizes: 256\n"
    )
    assert batching_parameters_from(path) == {
        "max_batch_size": 64,
        "split_rows": 48,
        "allowed_batch_sizes": (32, 64),
    }
    path.write_text("enable_large_batch_splitting { value: true }\n")
    assert batching_parameters_from(path) == {
        "max_batch_size": 1000,
        "split_rows": 1000,
        "allowed_batch_sizes": (),
    }
    path.write_text("max_execution_batch_size { value: 64 }\n")  # no use without splitting
    assert batching_parameters_from(path) == {"allowed_batch_sizes": ()}
    path.write_text(  # TF Serving's server checks this rule with splitting too
        "max_batch_size { value: 256 }\nenable_large_batch_splitting { value: true }\n"
        "max_execution_batch_size { value: 64 }\nallowed_batch_sizes: 32\n"
        "allowed_batch_sizes: 64\n"
    )
    with pytest.raises(
        ConfigError,
        match="Last entry in allowed_batch_sizes must match max_batch_size; last entry was "
        "64; expected 256",
    ):
        batching_parameters_from(path)
    path.write_text(
        "max_batch_size { value: 32 }\nenable_large_batch_splitting { value: true }\n"
        "max_execution_batch_size { value: 64 }\n"
    )
    with pytest.raises(ConfigError, match="between 1 and max_batch_size 32, got 64"):
        batching_parameters_from(path)
    path.write_text("pad_variable_length_inputs: true\n")
    with pytest.raises(ConfigError, match="pad_variable_length_inputs is not supported"):
        batching_parameters_from(path)
    for threads in (0, -2):  # TF Serving's server does not start, in its words
        path.write_text(f"num_batch_threads {{ value: {threads} }}\n")
        with pytest.raises(ConfigError, match=f"num_batch_threads must be positive; was {threads}"):
            batching_parameters_from(path)
    path.write_text("max_batch_size: 12\n")  # a wrapper, not a number
    with pytest.raises(ConfigError, match="is not a BatchingParameters"):
        batching_parameters_from(path)


def start_args(*flags: str) -> PoolConfig:
    """The PoolConfig `mpspool start` would build from these flags (before validation)."""
    args = cli.build_parser().parse_args(["start", "--model-base-path", "/m", *flags])
    return PoolConfig(
        model_name="m", model_base_path="/m", model_version=1, run_dir="/r", log_dir="/l",
        workers=2,
        **cli._batching_fields(args), dispatch=args.dispatch, queue=args.queue,
        aging_bound_ms=args.aging_bound_ms, worker_inflight=args.worker_inflight,
    )  # fmt: skip


def test_scheduling_flags_are_checked(tmp_path: Path) -> None:
    config = start_args("--queue", "sjf", "--dispatch", "power-of-two", "--split-rows", "64")
    assert (config.queue, config.dispatch, config.split_rows) == ("sjf", "power-of-two", 64)
    params = tmp_path / "b.txt"
    params.write_text("max_batch_size { value: 16 }\nallowed_batch_sizes: 8\n")
    with pytest.raises(ConfigError, match="needs --enable_batching"):
        start_args("--batching_parameters_file", str(params))
    config = start_args("--enable_batching", "--batching_parameters_file", str(params))
    with pytest.raises(ConfigError, match="last entry was 8; expected 16"):
        config._validate_batching()
    # The flag wins over the file.
    config = start_args(
        "--enable_batching", "--batching_parameters_file", str(params), "--max-batch-size", "8"
    )
    config._validate_batching()
    assert config.max_batch_size == 8
    # Pieces of a split request are batched calls: none may be above max_batch_size (the
    # pieces of 3 rows reached a model sized for 2).
    config = start_args("--enable_batching", "--max-batch-size", "2", "--split-rows", "3")
    with pytest.raises(ConfigError, match="--split-rows 3 is above max_batch_size 2"):
        config._validate_batching()
    start_args(
        "--enable_batching", "--max-batch-size", "2", "--split-rows", "2"
    )._validate_batching()
    # TF Serving's enable_large_batch_splitting is --split-rows: the same number, or one of them.
    splitting = tmp_path / "split.txt"
    splitting.write_text(
        "enable_large_batch_splitting { value: true }\nmax_execution_batch_size { value: 32 }\n"
    )
    batching = ("--enable_batching", "--batching_parameters_file", str(splitting))
    assert start_args(*batching).split_rows == 32
    assert start_args(*batching, "--split-rows", "32").split_rows == 32
    assert start_args("--enable_batching", "--split-rows", "16").split_rows == 16
    with pytest.raises(ConfigError, match=r"--split-rows 16 and .* disagree"):
        start_args(*batching, "--split-rows", "16")
    with pytest.raises(ConfigError, match="give it in the file"):
        start_args(*batching, "--max-batch-size", "16")
    with pytest.raises(SystemExit):
        start_args("--queue", "lifo")
    for bad, says in ((("--aging-bound-ms", "0"), "aging-bound-ms must be in"),
                      (("--worker-inflight", "-1"), "must be >= 0")):  # fmt: skip
        with pytest.raises(ConfigError, match=says):
            start_args(*bad).validate()


def test_per_model_batching_reads_each_versions_own_file_as_tf_serving(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--enable_per_model_batching_parameters: a version's batching_params.pbtxt, every
    field the front door takes (TF Serving's defaults where the file is silent); no file, no
    batching; a file TF Serving would refuse refuses the start for the first version."""
    version = tmp_path / "m" / "1"
    version.mkdir(parents=True)
    assert version_batching(version) is None
    (version / "batching_params.pbtxt").write_text(
        "max_batch_size { value: 32 }\nenable_large_batch_splitting { value: true }\n"
        "max_execution_batch_size { value: 8 }\nbatch_timeout_micros { value: 500 }\n"
    )
    assert version_batching(version) == {
        "max_batch_size": 8, "batch_timeout_micros": 500, "allowed_batch_sizes": [],
        "max_enqueued_batches": 10, "split_rows": 8,
    }  # fmt: skip

    def config(*flags: str) -> PoolConfig:
        return dataclasses.replace(start_args(*flags), model_base_path=str(tmp_path / "m"))

    per_model = ("--enable_batching", "--enable_per_model_batching_parameters")
    taken = config(*per_model)
    assert (taken.batching, taken.per_model_batching) == (True, True)
    taken._validate_batching()
    # Without --enable_batching it does nothing (TF Serving reads it only when batching).
    alone = config("--enable_per_model_batching_parameters")
    assert (alone.batching, alone.per_model_batching) == (False, False)
    assert "no effect without --enable_batching" in capsys.readouterr().err
    # The pool-wide file is read and checked, and its values go unused.
    params = tmp_path / "b.txt"
    params.write_text("max_batch_size { value: 16 }\n")
    assert config(*per_model, f"--batching_parameters_file={params}").max_batch_size == 1000
    assert "its batching parameters are not used" in capsys.readouterr().err
    # Only parsed, as TF Serving does: what the pool-wide reading refuses is no matter here,
    # what is not a BatchingParameters is.
    params.write_text("pad_variable_length_inputs: true\nmax_batch_size { value: 0 }\n")
    config(*per_model, f"--batching_parameters_file={params}")
    params.write_text("max_batch_size: 3\n")
    with pytest.raises(ConfigError, match="is not a BatchingParameters"):
        config(*per_model, f"--batching_parameters_file={params}")
    # Its batch threads still make TF Serving's thread pool, so fewer than one is refused; a
    # version's own num_batch_threads is never read there, so it is no matter.
    params.write_text("num_batch_threads { value: 0 }\n")
    with pytest.raises(ConfigError, match="num_batch_threads must be positive; was 0"):
        config(*per_model, f"--batching_parameters_file={params}")
    (version / "batching_params.pbtxt").write_text("num_batch_threads { value: 0 }\n")
    assert version_batching(version) is not None
    with pytest.raises(ConfigError, match="needs --enable_batching"):
        config("--enable_per_model_batching_parameters", f"--batching_parameters_file={params}")
    for flag in ("--max-batch-size=8", "--split-rows=4"):
        with pytest.raises(ConfigError, match=r"batching_params\.pbtxt says how"):
            config(*per_model, flag)
    (version / "batching_params.pbtxt").write_text(
        "max_batch_size { value: 32 }\nallowed_batch_sizes: 8\n"
    )
    with pytest.raises(
        ConfigError, match=r"1/batching_params.pbtxt: Last entry in allowed_batch_sizes must match"
    ):
        taken._validate_batching()
    (version / "batching_params.pbtxt").write_text("max_batch_size: 3\n")
    with pytest.raises(ConfigError, match="is not a BatchingParameters"):
        taken._validate_batching()


# -- a real pool --------------------------------------------------------------------------
AGING_BOUND_S = 0.05


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory, demo_model_dir: Path) -> Iterator[Pool]:
    pool = Pool(
        tmp_path_factory.mktemp("scheduling"), demo_model_dir, 2, "--split-rows", "4",
        "--queue", "sjf", "--dispatch", "power-of-two",
        "--aging-bound-ms", str(AGING_BOUND_S * 1e3),
    ).start()  # fmt: skip
    try:
        pool.wait_ready(2)
        yield pool
        assert pool.stop() == 0
        assert pool.leftovers() == []
    finally:
        pool.kill()


def predict(stub, inputs: dict[str, np.ndarray]) -> np.ndarray:
    request = predict_pb2.PredictRequest()
    request.model_spec.name = "demo"
    for name, array in inputs.items():
        request.inputs[name].CopyFrom(tf.make_tensor_proto(array))
    return tf.make_ndarray(stub.Predict(request, timeout=30).outputs["score"])


def want(reference_model, inputs: dict[str, np.ndarray]) -> np.ndarray:
    return reference_model(**{k: tf.constant(v) for k, v in inputs.items()})["score"].numpy()


def spans(pool: Pool, *flags: str) -> list[list]:
    done = subprocess.run(
        mpspool_cmd("timeline", "--run-dir", str(pool.run_dir), *flags),
        capture_output=True, text=True, timeout=30, check=True,
    )  # fmt: skip
    return json.loads(done.stdout)["spans"]


def test_a_split_request_equals_the_unsplit_model_call(pool: Pool, reference_model) -> None:
    x = demo_inputs(10, DEMO_ROWS, seed=5)
    spans(pool, "--clear")
    with pool.channel() as channel:
        got = predict(prediction_service_pb2_grpc.PredictionServiceStub(channel), x)
    assert got.shape[0] == 10
    np.testing.assert_allclose(got, want(reference_model, x), rtol=0, atol=1e-6)
    # 10 rows at --split-rows 4: three model calls, 4 + 4 + 2 rows.
    assert len(spans(pool)) == 3


def test_a_bad_row_fails_its_split_request_with_the_models_error(pool: Pool) -> None:
    x = demo_inputs(10, DEMO_ROWS, seed=6)
    x["ids"][7, 0] = DEMO_ROWS + 3  # in the second chunk
    with pool.channel() as channel:
        stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            predict(stub, x)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"{DEMO_ROWS + 3} is not in [0, {DEMO_ROWS})" in info.value.details()
        ok = demo_inputs(3, DEMO_ROWS, seed=7)
        assert predict(stub, ok).shape[0] == 3  # nothing lost
    assert all(pool.slot(s)["restarts"] == 0 for s in ("cpu-0", "cpu-1"))


def test_sjf_answers_a_mixed_stream_each_with_its_own_rows(pool: Pool, reference_model) -> None:
    sizes = [1, 9, 1, 2, 1, 12, 1, 1, 3, 1] * 3
    inputs = [demo_inputs(n, DEMO_ROWS, seed=20 + i) for i, n in enumerate(sizes)]
    with pool.channel() as channel:
        stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
        with concurrent.futures.ThreadPoolExecutor(8) as threads:
            answers = list(threads.map(lambda x: predict(stub, x), inputs))
    for x, got in zip(inputs, answers, strict=True):
        np.testing.assert_allclose(got, want(reference_model, x), rtol=0, atol=1e-6)
    url = pool.status()["pool"]["metrics"]
    metrics = urllib.request.urlopen(url, timeout=10).read().decode()
    assert "mpspool_queued_requests 0\n" in metrics
    assert "mpspool_queue_wait_max_seconds " in metrics
    # sjf's learned margin: exported, and never more than its cap, a quarter of the bound.
    (margin,) = [float(line.split()[1]) for line in metrics.splitlines()
                 if line.startswith("mpspool_queue_aging_margin_seconds ")]  # fmt: skip
    assert 0 <= margin <= AGING_BOUND_S / 4
