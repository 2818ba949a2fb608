"""Classify, Regress and MultiInference, over gRPC (the official client) and REST (`:classify`,
`:regress`), on an Estimator-style model built here: a TF1 graph that parses serialized
tf.Examples, with classification, regression and predict signatures as Estimators export
them. Answers are compared with a direct TensorFlow call on the same serialized examples."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import requests
import tensorflow as tf
from tensorflow_serving.apis import (
    classification_pb2,
    inference_pb2,
    predict_pb2,
    prediction_service_pb2_grpc,
    regression_pb2,
)

from poolproc import Pool, prometheus_samples

LABELS = [b"low", b"mid", b"high"]
WEIGHTS = [[1.0, -1.0, 0.5], [0.5, 2.0, -1.0]]


def build_example_model(base: Path, custom_method: str = "") -> Path:
    """serving_default: classify (classes + scores); "regress": regress; "predict": predict.
    Features: "x" (2 floats, required), "country" (bytes, default ""): +10 to the regression
    for "fr", so a context feature shows in the answer. With `custom_method`, a "custom"
    signature (the predict one's tensors) of that method name too."""
    v1 = tf.compat.v1
    with tf.Graph().as_default():
        serialized = v1.placeholder(tf.string, [None], name="tf_example")
        features = v1.io.parse_example(
            serialized,
            {
                "x": v1.io.FixedLenFeature([2], tf.float32),
                "country": v1.io.FixedLenFeature([], tf.string, default_value=""),
            },
        )
        weights = v1.get_variable("weights", initializer=WEIGHTS, use_resource=True)
        scores = tf.nn.softmax(tf.matmul(features["x"], weights))
        classes = tf.tile(tf.constant([LABELS]), [tf.shape(serialized)[0], 1])
        france = tf.cast(tf.equal(features["country"], "fr"), tf.float32) * 10.0
        value = tf.reduce_sum(features["x"], axis=1, keepdims=True) + france[:, None]
        # A regression signature whose input is not the serialized Examples (a mistake an
        # export can make): the Examples can never be fed to it.
        floats = v1.placeholder(tf.float32, [None, 2], name="floats")
        with v1.Session() as session:
            session.run(v1.global_variables_initializer())
            builder = v1.saved_model.Builder(str(base / "1"))
            sigs = v1.saved_model.signature_def_utils
            builder.add_meta_graph_and_variables(
                session,
                ["serve"],
                signature_def_map={
                    "serving_default": sigs.classification_signature_def(
                        serialized, classes, scores
                    ),
                    "regress": sigs.regression_signature_def(serialized, value),
                    "predict": sigs.predict_signature_def({"inputs": serialized}, {"s": scores}),
                    "float_in": sigs.build_signature_def(
                        {"inputs": v1.saved_model.utils.build_tensor_info(floats)},
                        {"outputs": v1.saved_model.utils.build_tensor_info(floats[:, :1])},
                        v1.saved_model.signature_constants.REGRESS_METHOD_NAME,
                    ),
                    **(
                        {
                            "custom": sigs.build_signature_def(
                                {"inputs": v1.saved_model.utils.build_tensor_info(serialized)},
                                {"s": v1.saved_model.utils.build_tensor_info(scores)},
                                custom_method,
                            )
                        }
                        if custom_method
                        else {}
                    ),
                },
            )
            builder.save()
    return base


def example(x: list[float], country: bytes | None = None) -> tf.train.Example:
    feature = {"x": tf.train.Feature(float_list=tf.train.FloatList(value=x))}
    if country is not None:
        feature["country"] = tf.train.Feature(bytes_list=tf.train.BytesList(value=[country]))
    return tf.train.Example(features=tf.train.Features(feature=feature))


XS = [[1.0, 2.0], [0.5, -1.0], [3.0, 0.25]]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_example_model(tmp_path_factory.mktemp("examples") / "ctr")


@pytest.fixture(scope="module")
def direct(model: Path):
    loaded = tf.saved_model.load(str(model / "1"))
    return loaded


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory, model: Path) -> Iterator[Pool]:
    tmp = tmp_path_factory.mktemp("inference")
    monitoring = tmp / "monitoring.config"
    monitoring.write_text('prometheus_config { enable: true, path: "/metrics" }')
    pool = Pool(tmp, model, 1, "--monitoring_config_file", str(monitoring))
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


def direct_call(direct, signature: str, examples: list[tf.train.Example]) -> dict:
    serialized = tf.constant([e.SerializeToString() for e in examples])
    return {k: v.numpy() for k, v in direct.signatures[signature](inputs=serialized).items()}


def test_classify_equals_tensorflow(stub, direct) -> None:
    examples = [example(x) for x in XS]
    request = classification_pb2.ClassificationRequest()
    request.model_spec.name = "demo"
    request.input.example_list.examples.extend(examples)
    response = stub.Classify(request, timeout=30)
    assert response.model_spec.signature_name == "serving_default"
    assert response.model_spec.version.value == 1
    want = direct_call(direct, "serving_default", examples)
    got_scores = [[c.score for c in cs.classes] for cs in response.result.classifications]
    got_labels = [[c.label.encode() for c in cs.classes] for cs in response.result.classifications]
    np.testing.assert_allclose(got_scores, want["scores"], atol=1e-6)
    assert got_labels == want["classes"].tolist()


def test_regress_with_a_shared_context(stub, direct) -> None:
    request = regression_pb2.RegressionRequest()
    request.model_spec.name = "demo"
    request.model_spec.signature_name = "regress"
    context = request.input.example_list_with_context
    context.context.CopyFrom(example([], b"fr"))
    # The context's "x" (empty) is overridden by each example's own.
    context.examples.extend(example(x) for x in XS)
    response = stub.Regress(request, timeout=30)
    want = direct_call(direct, "regress", [example(x, b"fr") for x in XS])["outputs"]
    np.testing.assert_allclose([r.value for r in response.result.regressions], want[:, 0])
    assert response.result.regressions[0].value == pytest.approx(13.0)


def test_multi_inference_runs_every_task(stub, direct) -> None:
    examples = [example(x, b"de") for x in XS]
    request = inference_pb2.MultiInferenceRequest()
    request.input.example_list.examples.extend(examples)
    for signature, method in (("", "classify"), ("regress", "regress")):
        task = request.tasks.add()
        task.model_spec.name = "demo"
        task.model_spec.signature_name = signature
        task.method_name = f"tensorflow/serving/{method}"
    response = stub.MultiInference(request, timeout=30)
    classify, regress = response.results
    assert classify.model_spec.signature_name == "serving_default"
    want = direct_call(direct, "serving_default", examples)["scores"]
    got = [[c.score for c in cs.classes] for cs in classify.classification_result.classifications]
    np.testing.assert_allclose(got, want, atol=1e-6)
    want = direct_call(direct, "regress", examples)["outputs"][:, 0]
    np.testing.assert_allclose([r.value for r in regress.regression_result.regressions], want)


def expect(stub_call, request, code: grpc.StatusCode, message: str) -> None:
    with pytest.raises(grpc.RpcError) as info:
        stub_call(request, timeout=30)
    assert info.value.code() == code, info.value.details()
    assert message in info.value.details()


def test_errors_are_tf_servings(stub, pool: Pool) -> None:
    request = classification_pb2.ClassificationRequest()
    # No model_spec at all: TF Serving's first check (has_model_spec), before the input's.
    expect(stub.Classify, request, grpc.StatusCode.INVALID_ARGUMENT, "Missing ModelSpec")
    expect(
        stub.Regress,
        regression_pb2.RegressionRequest(),
        grpc.StatusCode.INVALID_ARGUMENT,
        "Missing ModelSpec",
    )
    request.model_spec.name = "demo"
    expect(stub.Classify, request, grpc.StatusCode.INVALID_ARGUMENT, "Input is empty.")
    request.input.example_list.examples.add()  # no "x": the model's own parse error
    expect(stub.Classify, request, grpc.StatusCode.INVALID_ARGUMENT, "x")
    request.model_spec.signature_name = "nope"
    expect(
        stub.Classify,
        request,
        grpc.StatusCode.INVALID_ARGUMENT,
        "No signature was found with the name: nope",
    )
    request.model_spec.signature_name = "regress"
    expect(
        stub.Classify,
        request,
        grpc.StatusCode.INVALID_ARGUMENT,
        'Expected classification signature outputs to contain at least one of "classes" or '
        '"scores"',
    )
    # The Examples fed to a float input: TensorFlow's session refuses it, TF Serving says so.
    regress = regression_pb2.RegressionRequest()
    regress.model_spec.name = "demo"
    regress.model_spec.signature_name = "float_in"
    regress.input.example_list.examples.extend([example([1.0, 2.0])])
    expect(
        stub.Regress,
        regress,
        grpc.StatusCode.INVALID_ARGUMENT,
        "Expects arg[0] to be float but string is provided",
    )
    # In a MultiInference that error is the session's too: after the examples are read.
    floats = inference_pb2.MultiInferenceRequest()
    task = floats.tasks.add()
    task.model_spec.name = "demo"
    task.model_spec.signature_name = "float_in"
    task.method_name = "tensorflow/serving/regress"
    expect(stub.MultiInference, floats, grpc.StatusCode.INVALID_ARGUMENT, "Input is empty.")
    floats.input.example_list.examples.extend([example([1.0, 2.0])])
    expect(
        stub.MultiInference,
        floats,
        grpc.StatusCode.INVALID_ARGUMENT,
        "Expects arg[0] to be float but string is provided",
    )
    request.model_spec.name = "other"
    expect(stub.Classify, request, grpc.StatusCode.NOT_FOUND, "Servable not found")
    multi = inference_pb2.MultiInferenceRequest()
    multi.input.example_list.examples.extend([example([1.0, 2.0])])
    for name in ("demo", "other"):
        task = multi.tasks.add()
        task.model_spec.name = name
        task.method_name = "tensorflow/serving/classify"
    expect(
        stub.MultiInference,
        multi,
        grpc.StatusCode.INVALID_ARGUMENT,
        "All ModelSpecs in a MultiInferenceRequest must access the same model name.",
    )
    multi.tasks[1].model_spec.name = "demo"
    expect(
        stub.MultiInference,
        multi,
        grpc.StatusCode.INVALID_ARGUMENT,
        "Duplicate evaluation of signature: serving_default",
    )
    multi.tasks[1].model_spec.signature_name = "predict"
    multi.tasks[1].method_name = "tensorflow/serving/predict"
    expect(
        stub.MultiInference,
        multi,
        grpc.StatusCode.UNIMPLEMENTED,
        "Unsupported signature method_name: tensorflow/serving/predict",
    )
    # TF Serving's order (found by a user test): the first task's servable before any task's
    # checks, a signature looked up before its method, and no task's version but the first's.
    multi.tasks[1].model_spec.signature_name = "nope"
    expect(
        stub.MultiInference,
        multi,
        grpc.StatusCode.INVALID_ARGUMENT,
        "Requested signature not found in model graph: nope",
    )
    multi.tasks[1].model_spec.signature_name = "serving_default"
    for task in multi.tasks:
        task.model_spec.name = "other"
    expect(stub.MultiInference, multi, grpc.StatusCode.NOT_FOUND, "Servable not found")
    expect(
        stub.MultiInference,
        inference_pb2.MultiInferenceRequest(),
        grpc.StatusCode.INVALID_ARGUMENT,
        "ModelSpec has no name specified.",
    )
    request.model_spec.name = "demo"
    request.model_spec.signature_name = "nope"
    del request.input.example_list.examples[:]  # no examples: the signature is named first
    expect(
        stub.Classify,
        request,
        grpc.StatusCode.INVALID_ARGUMENT,
        "No signature was found with the name: nope",
    )
    # A bad request never costs the worker its life.
    assert pool.status()["slots"][0]["restarts"] == 0


def test_multi_inference_runs_every_task_on_the_first_tasks_version(stub) -> None:
    """TF Serving takes the servable from the first task's spec only: a later task naming a
    version the pool does not serve, or a label it does not know, changes nothing."""
    request = inference_pb2.MultiInferenceRequest()
    request.input.example_list.examples.extend([example([1.0, 2.0], b"de")])
    for signature, method in (("", "classify"), ("regress", "regress")):
        task = request.tasks.add()
        task.model_spec.name = "demo"
        task.model_spec.signature_name = signature
        task.method_name = f"tensorflow/serving/{method}"
    request.tasks[1].model_spec.version.value = 7
    assert len(stub.MultiInference(request, timeout=30).results) == 2
    request.tasks[1].model_spec.version_label = "nolabel"
    assert len(stub.MultiInference(request, timeout=30).results) == 2


def test_rest_classify_and_regress(pool: Pool, direct) -> None:
    rows = [{"x": x} for x in XS]
    url = f"{pool.rest_url}/v1/models/demo"
    answer = requests.post(f"{url}:classify", json={"examples": rows}, timeout=30)
    assert answer.status_code == 200, answer.text
    want = direct_call(direct, "serving_default", [example(x) for x in XS])
    results = answer.json()["results"]
    assert [[label for label, _ in r] for r in results] == [[b.decode() for b in LABELS]] * 3
    np.testing.assert_allclose([[s for _, s in r] for r in results], want["scores"], atol=1e-6)
    body = json.dumps({"signature_name": "regress", "context": {"country": "fr"}, "examples": rows})
    out = subprocess.run(
        ["curl", "-sS", "-X", "POST", "-d", body, f"{url}/versions/1:regress"],
        capture_output=True,
        check=True,
        timeout=30,
    ).stdout
    want = direct_call(direct, "regress", [example(x, b"fr") for x in XS])["outputs"][:, 0]
    np.testing.assert_allclose(json.loads(out)["results"], want, rtol=1e-6)
    # A feature given as [] (TF Serving makes it a Feature of no kind: here the default
    # applies) and one with an empty name (which the model ignores) reach the model as map
    # entries with their keys and values, as C++ protobuf writes them: without, TensorFlow's
    # parser refused the Example ("Could not parse example input").
    odd = [{"x": XS[0], "country": []}, {"x": XS[1], "": [1.5]}]
    answer = requests.post(
        f"{url}:regress", json={"signature_name": "regress", "examples": odd}, timeout=30
    )
    assert answer.status_code == 200, answer.text
    want = direct_call(direct, "regress", [example(XS[0]), example(XS[1])])["outputs"][:, 0]
    np.testing.assert_allclose(answer.json()["results"], want, rtol=1e-6)
    answer = requests.post(f"{url}:regress", json={"examples": [{"x": None}]}, timeout=30)
    assert answer.status_code == 400
    assert answer.json() == {"error": "Feature: x has element with unexpected JSON type: Null"}


def test_method_name_check_flag(tmp_path: Path) -> None:
    model = build_example_model(tmp_path / "ctr", custom_method="custom/method")
    pool = Pool(tmp_path, model, 1, "--enable-signature-method-name-check")
    try:
        pool.start().wait_ready(1)
        request = regression_pb2.RegressionRequest()
        request.model_spec.name = "demo"
        request.model_spec.signature_name = "predict"
        request.input.example_list.examples.extend([example([1.0, 2.0])])
        with pool.channel() as channel:
            stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
            expect(
                stub.Regress,
                request,
                grpc.StatusCode.INVALID_ARGUMENT,
                "Expected regression signature method_name to be tensorflow/serving/regress. "
                "Was: tensorflow/serving/predict",
            )
            request.model_spec.signature_name = "regress"
            assert len(stub.Regress(request, timeout=30).result.regressions) == 1
            # Predict takes a signature of any of the three methods, and refuses another
            # with INTERNAL, TF Serving's VerifySignature (it was answered; found by a hunt).
            predict = predict_pb2.PredictRequest()
            predict.model_spec.name = "demo"
            predict.inputs["inputs"].CopyFrom(
                tf.make_tensor_proto([example([1.0, 2.0]).SerializeToString()])
            )
            for signature in ("predict", "regress"):
                predict.model_spec.signature_name = signature
                stub.Predict(predict, timeout=30)
            predict.model_spec.signature_name = "custom"
            expect(
                stub.Predict,
                predict,
                grpc.StatusCode.INTERNAL,
                "Expected prediction signature method_name to be one of "
                "{tensorflow/serving/predict, tensorflow/serving/classify, "
                "tensorflow/serving/regress}. Was: custom/method",
            )
        assert pool.stop() == 0
    finally:
        pool.kill()


def _tf_serving_samples(pool: Pool) -> dict[str, float]:
    return prometheus_samples(requests.get(f"{pool.rest_url}/metrics", timeout=30).text)


def test_tf_servings_metrics_count_what_tf_serving_counts(stub, pool: Pool) -> None:
    """As TF Serving records them: Classify and Regress in request_count, request_latency and
    runtime_latency, their examples not counted; a MultiInference in none of those, its
    examples counted (multi_inference.cc, the one caller of RecordRequestExampleCount); a
    REST GET of status or metadata in request_count and request_latency with API ""."""
    before = _tf_serving_samples(pool)
    classify = classification_pb2.ClassificationRequest()
    classify.model_spec.name = "demo"
    classify.input.example_list.examples.extend([example(x) for x in XS])
    stub.Classify(classify, timeout=30)
    regress = regression_pb2.RegressionRequest()
    regress.model_spec.name = "demo"
    regress.model_spec.signature_name = "regress"
    regress.input.example_list.examples.extend([example(XS[0])])
    stub.Regress(regress, timeout=30)
    multi = inference_pb2.MultiInferenceRequest()
    multi.input.example_list.examples.extend([example(x) for x in XS[:2]])
    for signature, method in (("serving_default", "classify"), ("regress", "regress")):
        task = multi.tasks.add()
        task.model_spec.name = "demo"
        task.model_spec.signature_name = signature
        task.method_name = f"tensorflow/serving/{method}"
    stub.MultiInference(multi, timeout=30)
    for path in ("/v1/models/demo", "/v1/models/demo/metadata"):
        assert requests.get(f"{pool.rest_url}{path}", timeout=30).status_code == 200
    after = _tf_serving_samples(pool)

    def grew(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    tfs = ":tensorflow:serving:"
    assert grew(f'{tfs}request_count{{model_name="demo",status="OK"}}') == 4
    for api in ("Classify", "Regress"):
        latency = f'model_name="demo",API="{api}",entrypoint="GRPC"'
        assert grew(f"{tfs}request_latency_count{{{latency}}}") == 1
        assert (
            grew(f'{tfs}runtime_latency_count{{model_name="demo",API="{api}",runtime="TF1"}}') == 1
        )
    assert (
        f'{tfs}request_latency_count{{model_name="demo",API="MultiInference",entrypoint="GRPC"}}'
        not in after
    )
    assert grew(f'{tfs}request_latency_count{{model_name="demo",API="",entrypoint="REST"}}') == 2
    assert grew(f'{tfs}request_example_counts_count{{model="demo"}}') == 1
    assert grew(f'{tfs}request_example_count_total{{model="demo"}}') == 2
    # The page answers any method at its path, as TF Serving's server matches it.
    head = requests.head(f"{pool.rest_url}/metrics", timeout=30)
    assert head.status_code == 200 and head.content == b""
    assert requests.post(f"{pool.rest_url}/metrics", timeout=30).status_code == 200
