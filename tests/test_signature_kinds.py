"""Signatures TF Serving serves that a pool must serve too, built here as a `tf.Module`:

- ones that refuse the zero example the worker's own warm-up runs (an assertion that ids are
  positive; one element reshaped to [-1, 3]). TF Serving never runs a signature at load, so
  they load there; here they failed the warm-up, and the pool gave up (its first model could
  not start);
- one that takes no inputs (a vocabulary): TF Serving's Predict runs it with none; here it was
  "not found" while GetModelMetadata listed it;
- one whose outputs are scalars, a string among them: TensorFlow gives a scalar string as
  bytes, not an array, and the worker's warm-up failed on it (the pool did not start);
- one that takes a SparseTensor (its components as three inputs, as TF Serving takes them):
  zeros are an index into a dense shape of [0, 0], which its kernel answers with INTERNAL,
  and the warm-up failed the load.

Served by a real 1-worker pool and called with the official client, curl and requests."""

from __future__ import annotations

import json
import re
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import requests
import tensorflow as tf
from tensorflow_serving.apis import (
    get_model_metadata_pb2,
    predict_pb2,
    prediction_service_pb2_grpc,
)

from poolproc import Pool

TABLE = np.arange(40, dtype=np.float32).reshape(10, 4)
VOCABULARY = [b"low", b"mid", b"high"]


class _Model(tf.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = tf.Variable(TABLE)
        self.vocabulary = tf.constant(VOCABULARY)

    @tf.function(input_signature=[tf.TensorSpec([None], tf.int64, name="ids")])
    def positive(self, ids: tf.Tensor) -> dict[str, tf.Tensor]:
        check = tf.debugging.assert_positive(ids, message="ids must be positive")
        with tf.control_dependencies([check]):
            return {"rows": tf.gather(self.table, ids)}

    @tf.function(input_signature=[tf.TensorSpec([None], tf.float32, name="x")])
    def triples(self, x: tf.Tensor) -> dict[str, tf.Tensor]:
        return {"sums": tf.reduce_sum(tf.reshape(x, [-1, 3]), axis=1)}

    @tf.function(input_signature=[])
    def words(self) -> dict[str, tf.Tensor]:
        return {"words": self.vocabulary, "size": tf.size(self.vocabulary)}

    @tf.function(
        input_signature=[
            tf.TensorSpec([], tf.string, name="prefix"),
            tf.TensorSpec([], tf.int64, name="id"),
        ]
    )
    def named(self, prefix: tf.Tensor, id: tf.Tensor) -> dict[str, tf.Tensor]:
        word = tf.strings.join([prefix, tf.gather(self.vocabulary, id)])
        return {"word": word, "length": tf.strings.length(word), "known": id < 3}

    @tf.function(input_signature=[tf.SparseTensorSpec([None, 4], tf.float32)])
    def sparse(self, s: tf.SparseTensor) -> dict[str, tf.Tensor]:
        return {"sums": tf.sparse.reduce_sum(s, axis=1)}

    @tf.function(
        input_signature=[tf.TensorSpec([None], tf.dtypes.experimental.float8_e4m3fn, name="q")]
    )
    def from_float8(self, q: tf.Tensor) -> dict[str, tf.Tensor]:
        return {"y": tf.cast(q, tf.float32)}

    @tf.function(input_signature=[tf.TensorSpec([None], tf.float32, name="x")])
    def to_int4(self, x: tf.Tensor) -> dict[str, tf.Tensor]:
        return {"q": tf.cast(tf.cast(x, tf.int8), tf.dtypes.experimental.int4)}

    @tf.function(input_signature=[tf.TensorSpec([1], tf.float32, name="x")])
    def deep_words(self, x: tf.Tensor) -> dict[str, tf.Tensor]:
        return {"w": tf.reshape(tf.strings.as_string(x), [1] * 33)}

    @tf.function(
        input_signature=[
            tf.TensorSpec([None], tf.string, name="s"),
            tf.TensorSpec([], tf.int32, name="rank"),
        ]
    )
    def any_rank_words(self, s: tf.Tensor, rank: tf.Tensor) -> dict[str, tf.Tensor]:
        # Its output's rank is known only when it runs.
        return {"w": tf.reshape(s, tf.ones([rank], tf.int32))}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("kinds") / "kinds"
    module = _Model()
    signatures = {
        "serving_default": module.positive.get_concrete_function(),
        "triples": module.triples.get_concrete_function(),
        "words": module.words.get_concrete_function(),
        "named": module.named.get_concrete_function(),
        "sparse": module.sparse.get_concrete_function(),
        "from_float8": module.from_float8.get_concrete_function(),
        "to_int4": module.to_int4.get_concrete_function(),
        "deep_words": module.deep_words.get_concrete_function(),
        "any_rank_words": module.any_rank_words.get_concrete_function(),
    }
    tf.saved_model.save(module, str(base / "1"), signatures=signatures)
    return base


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory, model: Path) -> Iterator[Pool]:
    pool = Pool(tmp_path_factory.mktemp("kinds-pool"), model, 1)
    try:
        pool.start().wait_ready(1)
        yield pool
        assert pool.stop() == 0
    finally:
        pool.kill()


@pytest.fixture(scope="module")
def stub(pool: Pool) -> Iterator[prediction_service_pb2_grpc.PredictionServiceStub]:
    with pool.channel() as channel:
        yield prediction_service_pb2_grpc.PredictionServiceStub(channel)


def _predict(stub: Any, signature: str, inputs: dict[str, np.ndarray], *only: str) -> dict:
    request = predict_pb2.PredictRequest()
    request.model_spec.name = "demo"
    request.model_spec.signature_name = signature
    for name, values in inputs.items():
        request.inputs[name].CopyFrom(tf.make_tensor_proto(values))
    request.output_filter.extend(only)
    answer = stub.Predict(request, timeout=30)
    return {name: tf.make_ndarray(tensor) for name, tensor in answer.outputs.items()}


def _refused(stub: Any, signature: str, inputs: dict[str, np.ndarray]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        _predict(stub, signature, inputs)
    return info.value


def test_signatures_that_refuse_zeros_load_and_serve(stub, pool: Pool) -> None:
    got = _predict(stub, "serving_default", {"ids": np.array([1, 3])})
    np.testing.assert_array_equal(got["rows"], TABLE[[1, 3]])
    # Its fast call is checked on that request's inputs once the answer is sent, by the
    # serving loop before it reads another request (none comes until the log says so).
    log_path = pool.log_dir / "worker-cpu-0-v1.log"
    checked = re.compile(r"signature 'serving_default': the \w+ call checked on its first request")
    deadline = time.monotonic() + 30
    while not checked.search(log_path.read_text()):
        assert time.monotonic() < deadline, log_path.read_text()[-2000:]
        time.sleep(0.1)
    got = _predict(stub, "triples", {"x": np.arange(6, dtype=np.float32)})
    np.testing.assert_array_equal(got["sums"], [3.0, 12.0])
    # What they refuse is the model's answer, with TensorFlow's words, and the worker serves on.
    error = _refused(stub, "serving_default", {"ids": np.array([2, 0])})
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "ids must be positive" in error.details()
    error = _refused(stub, "triples", {"x": np.ones(4, np.float32)})
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "requires a multiple of 3" in error.details()
    np.testing.assert_array_equal(
        _predict(stub, "serving_default", {"ids": np.array([9])})["rows"], TABLE[[9]]
    )
    assert pool.slot("cpu-0")["restarts"] == 0
    log = (pool.log_dir / "worker-cpu-0-v1.log").read_text()
    for signature in ("serving_default", "triples"):
        assert f"warm-up of signature {signature!r} skipped: it refused a zero example" in log


def test_a_signature_without_inputs_is_called_with_none(stub, pool: Pool) -> None:
    got = _predict(stub, "words", {})
    assert got["words"].tolist() == VOCABULARY and got["size"] == 3
    assert set(_predict(stub, "words", {}, "size")) == {"size"}
    # Inputs it does not take are refused as TF Serving refuses them (predict_util.cc).
    error = _refused(stub, "words", {"x": np.ones(1, np.float32)})
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details() == (
        "input size does not match signature: 1!=0 len({x}) != len({}). "
        "Sent extra: {x}. Missing but required: {}."
    )
    # The init op's entry is listed in the metadata, as TF Serving lists it, but not served.
    error = _refused(stub, "__saved_model_init_op", {})
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    request = get_model_metadata_pb2.GetModelMetadataRequest(metadata_field=["signature_def"])
    with pytest.raises(grpc.RpcError) as info:  # TF Serving's first check
        stub.GetModelMetadata(request, timeout=30)
    assert (info.value.code(), info.value.details()) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "Missing ModelSpec",
    )
    request.model_spec.name = "demo"
    answer = stub.GetModelMetadata(request, timeout=30)
    listed = get_model_metadata_pb2.SignatureDefMap()
    answer.metadata["signature_def"].Unpack(listed)
    assert set(listed.signature_def) == {
        "serving_default",
        "triples",
        "words",
        "named",
        "sparse",
        "from_float8",
        "to_int4",
        "deep_words",
        "any_rank_words",
        "__saved_model_init_op",
    }
    assert not listed.signature_def["words"].inputs


def test_rest_refuses_a_signature_without_inputs_and_names_dtypes_as_tf_serving(
    pool: Pool,
) -> None:
    # TF Serving's REST API has no way to send zero inputs: json_tensor.cc refuses the
    # signature ("Failed to get input map for signature"). It looks the name up in the whole
    # SignatureDefMap, where the init op's entry is one without inputs.
    def predict(signature: str) -> tuple[str, object]:
        body = json.dumps({"signature_name": signature, "instances": [1]})
        url = f"{pool.rest_url}/v1/models/demo:predict"
        out = subprocess.run(
            ["curl", "-sS", "-w", "\n%{http_code}", "-d", body, url],
            capture_output=True,
            check=True,
            timeout=30,
        ).stdout.decode()
        text, code = out.rsplit("\n", 1)
        return code, json.loads(text)

    for name in ("words", "__saved_model_init_op"):
        assert predict(name) == ("400", {"error": f"Failed to get input map for signature: {name}"})
    assert predict("nope") == (
        "400",
        {"error": 'Serving signature name: "nope" not found in signature def'},
    )
    # The metadata names every dtype as protobuf's JSON does, the init op's DT_INVALID too.
    metadata = requests.get(f"{pool.rest_url}/v1/models/demo/metadata", timeout=30).json()
    defs = metadata["metadata"]["signature_def"]["signature_def"]
    init = defs["__saved_model_init_op"]["outputs"]["__saved_model_init_op"]
    assert init["dtype"] == "DT_INVALID"
    assert defs["words"]["inputs"] == {}
    assert defs["words"]["outputs"]["words"]["dtype"] == "DT_STRING"


def test_scalar_outputs_a_string_among_them_are_served(stub, pool: Pool) -> None:
    inputs = {"prefix": np.array(b"very "), "id": np.array(2, np.int64)}
    got = _predict(stub, "named", inputs)
    assert {name: (value.shape, value.tolist()) for name, value in got.items()} == {
        "word": ((), b"very high"),
        "length": ((), 9),
        "known": ((), True),
    }
    assert _predict(stub, "named", inputs, "word")["word"].tolist() == b"very high"
    body = {"signature_name": "named", "inputs": {"prefix": "so ", "id": 0}}
    answer = requests.post(f"{pool.rest_url}/v1/models/demo:predict", json=body, timeout=30)
    assert answer.status_code == 200, answer.text
    assert answer.json() == {"outputs": {"word": "so low", "length": 6, "known": True}}
    assert pool.slot("cpu-0")["restarts"] == 0


def test_a_signature_of_a_type_not_carried_is_refused_and_the_others_serve(
    stub, pool: Pool
) -> None:
    """A float8 input failed the warm-up, and with it the whole model's load (the pool did
    not start); an int4 output failed each request with INTERNAL, saying numpy's type had no
    TensorFlow counterpart (found by a hunt)."""
    error = _refused(stub, "to_int4", {"x": np.ones(2, np.float32)})
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
    assert error.details() == (
        "signature 'to_int4' cannot be called: its output 'q' is int4, a type mpspool does "
        "not carry"
    )
    error = _refused(stub, "from_float8", {"q": np.ones(2, np.float32)})
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
    assert error.details() == 'input "q": expects dtype float8_e4m3fn but float is provided'
    np.testing.assert_array_equal(
        _predict(stub, "serving_default", {"ids": np.array([2])})["rows"], TABLE[[2]]
    )
    assert pool.slot("cpu-0")["restarts"] == 0


def test_string_tensors_of_more_than_32_dimensions_are_refused_not_run(stub, pool: Pool) -> None:
    """TensorFlow's Python side ends the process (SIGSEGV) on a string tensor of rank 33 or
    more: a request of one was sent to up to three workers, each killed by it, and a model
    with a signature answering one never loaded, its warm-up killing the worker at every try
    (found by a hunt). Such requests and such signatures are refused; the worker lives."""
    from tensorflow.core.framework import tensor_pb2, tensor_shape_pb2

    deep = tensor_pb2.TensorProto(  # built by hand: numpy's conversion is what fails
        dtype=tf.string.as_datatype_enum,
        tensor_shape=tensor_shape_pb2.TensorShapeProto(
            dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=1)] * 33
        ),
        string_val=[b"very "],
    )
    request = predict_pb2.PredictRequest()
    request.model_spec.name = "demo"
    request.model_spec.signature_name = "named"
    request.inputs["prefix"].CopyFrom(deep)
    request.inputs["id"].CopyFrom(tf.make_tensor_proto(np.array(1, np.int64)))
    with pytest.raises(grpc.RpcError) as refused:
        stub.Predict(request, timeout=30)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "a string tensor of rank 33: the workers take string tensors of rank 32 at most" in (
        refused.value.details()
    )
    nested: Any = "very "
    for _ in range(33):
        nested = [nested]
    body = {"signature_name": "named", "inputs": {"prefix": nested, "id": 1}}
    answer = requests.post(f"{pool.rest_url}/v1/models/demo:predict", json=body, timeout=30)
    assert answer.status_code == 400 and "rank 33" in answer.text, answer.text
    error = _refused(stub, "deep_words", {"x": np.ones(1, np.float32)})
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
    assert error.details() == (
        "signature 'deep_words' cannot be called: its output 'w' is a string tensor of rank 33, "
        "and TensorFlow's Python side, which the workers call the model through, holds string "
        "tensors of rank 32 at most"
    )
    # An output whose rank is known only when it runs is looked at before it is converted
    # (such a request killed the worker at every send; found by a review).
    words = np.array([b"a"], object)
    got = _predict(stub, "any_rank_words", {"s": words, "rank": np.array(32, np.int32)})
    assert got["w"].shape == (1,) * 32
    error = _refused(stub, "any_rank_words", {"s": words, "rank": np.array(33, np.int32)})
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
    assert error.details() == (
        "output 'w' is a string tensor of rank 33: TensorFlow's Python side, which the workers "
        "call the model through, holds string tensors of rank 32 at most"
    )
    assert pool.slot("cpu-0")["restarts"] == 0


def test_a_sparse_tensor_input_is_served_by_its_components(stub, pool: Pool) -> None:
    components = {
        "s": np.array([[0, 1], [1, 3], [1, 0]], np.int64),  # indices
        "s_1": np.array([1.5, 2.0, 0.25], np.float32),  # values
        "s_2": np.array([2, 4], np.int64),  # dense shape
    }
    np.testing.assert_array_equal(_predict(stub, "sparse", components)["sums"], [1.5, 2.25])
    log = (pool.log_dir / "worker-cpu-0-v1.log").read_text()
    assert "warm-up of signature 'sparse' skipped: it refused a zero example (INTERNAL" in log
    assert pool.slot("cpu-0")["restarts"] == 0


class _FixedBesideRows(tf.Module):
    """A batch of rows beside an input of fixed size: 4 weights added to every row."""

    @tf.function(
        input_signature=[
            tf.TensorSpec([None, 2], tf.float32, name="x"),
            tf.TensorSpec([4], tf.float32, name="table"),
        ]
    )
    def offset(self, x: tf.Tensor, table: tf.Tensor) -> dict[str, tf.Tensor]:
        return {"y": x + tf.reduce_sum(table)}


def test_an_input_of_fixed_size_is_never_cut_or_stacked_with_the_rows(
    tmp_path: Path,
) -> None:
    """With --split-rows 2, 4 rows beside 4 weights were cut into 2 chunks of 2 rows and 2
    weights each, and with batching the weights of merged requests were stacked: wrong
    answers with status OK, whenever the table's size equalled the rows (found by a hunt). A
    signature with an input of fixed size is now neither split nor merged."""
    module = _FixedBesideRows()
    base = tmp_path / "fixed"
    signatures = {"serving_default": module.offset.get_concrete_function()}
    tf.saved_model.save(module, str(base / "1"), signatures=signatures)
    (tmp_path / "pool").mkdir()
    pool = Pool(tmp_path / "pool", base, 1, "--split-rows", "2", "--enable_batching").start()
    try:
        pool.wait_ready(1)
        x = np.arange(8, dtype=np.float32).reshape(4, 2)
        table = np.ones(4, np.float32)
        with pool.channel() as channel:
            stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
            got = _predict(stub, "serving_default", {"x": x, "table": table})["y"]
            np.testing.assert_array_equal(got, x + 4)

            def one(i: int) -> np.ndarray:
                weights = np.full(4, float(i), np.float32)
                return _predict(stub, "serving_default", {"x": x, "table": weights})["y"]

            with ThreadPoolExecutor(16) as calls:
                answers = list(calls.map(one, range(64)))
        for i, answer in enumerate(answers):
            np.testing.assert_array_equal(answer, x + 4 * i, err_msg=f"request {i}")
        body = {"inputs": {"x": x.tolist(), "table": table.tolist()}}
        answer = requests.post(f"{pool.rest_url}/v1/models/demo:predict", json=body, timeout=30)
        assert answer.json() == {"outputs": (x + 4).tolist()}
        assert pool.stop() == 0
    finally:
        pool.kill()
