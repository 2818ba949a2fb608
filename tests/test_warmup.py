"""Warm-up from a model's recorded requests (`assets.extra/tf_serving_warmup_requests`, TF
Serving's format), written here with the official `tensorflow_serving.apis` protos and
TensorFlow's own TFRecord writer, replayed by worker/warmup.py through the worker runtime.

Replay is checked call by call: a runtime wrapper records what each model call got and
answered, and those are compared with the records written and with a direct TensorFlow call.
Then a real pool: a version whose warm-up fails never serves and says why.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import requests
import tensorflow as tf
from tensorflow_serving.apis import (
    classification_pb2,
    inference_pb2,
    predict_pb2,
    prediction_log_pb2,
    regression_pb2,
)
from test_inference import build_example_model, example

from mpspool import cli
from mpspool.config import ConfigError, PoolConfig
from mpspool.dtypes import DT_FLOAT
from mpspool.errors import Code
from mpspool.signature import SignatureSpec, TensorSpec
from mpspool.worker.runtime import load_saved_model
from mpspool.worker.warmup import WarmupError, replay

from poolproc import Pool, prometheus_samples

SIG = "serving_default"


class Recording:
    """The runtime, with every model call it makes recorded (signature, inputs, answer)."""

    def __init__(self, runtime: Any) -> None:
        self.runtime = runtime
        self.specs = runtime.specs
        self.calls: list[tuple[str, dict[str, np.ndarray], dict[str, np.ndarray]]] = []

    def run(
        self, signature: str, inputs: dict[str, np.ndarray], outputs: list[str]
    ) -> dict[str, np.ndarray]:
        got = self.runtime.run(signature, inputs, outputs)
        self.calls.append((signature, inputs, got))
        return got


def write_records(version: Path, logs: list[Any]) -> Path:
    path = version / "assets.extra" / "tf_serving_warmup_requests"
    path.parent.mkdir(parents=True, exist_ok=True)
    with tf.io.TFRecordWriter(str(path)) as writer:
        for entry in logs:
            writer.write(entry.SerializeToString())
    return path


def predict_log(inputs: dict[str, np.ndarray], signature: str = "") -> Any:
    request = predict_pb2.PredictRequest()
    request.model_spec.name = "anything"  # TF Serving ignores the name in warm-up records
    request.model_spec.signature_name = signature
    for alias, value in inputs.items():
        request.inputs[alias].CopyFrom(tf.make_tensor_proto(value))
    return prediction_log_pb2.PredictionLog(
        predict_log=prediction_log_pb2.PredictLog(request=request)
    )


def keras_model(version: Path) -> None:
    import keras

    ids = keras.Input(shape=(4,), dtype="int64", name="ids")
    dense = keras.Input(shape=(3,), dtype="float32", name="features")
    pooled = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(50, 8)(ids))
    joined = keras.layers.Concatenate()([pooled, dense])
    model = keras.Model(inputs=[ids, dense], outputs=keras.layers.Dense(1)(joined))
    model.export(str(version), verbose=False)


def keras_inputs(batch: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(batch)
    return {
        "ids": rng.integers(0, 50, (batch, 4), dtype=np.int64),
        "features": rng.standard_normal((batch, 3)).astype(np.float32),
    }


@pytest.fixture(scope="module")
def keras_version(tmp_path_factory: pytest.TempPathFactory) -> Path:
    version = tmp_path_factory.mktemp("keras") / "1"
    keras_model(version)
    return version


@pytest.fixture(scope="module")
def examples_version(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_example_model(tmp_path_factory.mktemp("examples") / "ctr") / "1"


def linked_version(model: Path, version: Path) -> Path:
    """A version directory of its own (its files linked to a built model's), where a test
    writes the warm-up file it needs."""
    version.mkdir(parents=True)
    for entry in model.iterdir():
        (version / entry.name).symlink_to(entry)
    return version


def load(version: Path, tmp_path: Path) -> Recording:
    runtime = load_saved_model(str(version), "demo", 1, work_dir=str(tmp_path))
    runtime.warm_up()
    return Recording(runtime)


def test_no_file_means_no_replay(keras_version: Path, tmp_path: Path) -> None:
    recording = load(keras_version, tmp_path)
    assert replay(tf, recording, keras_version) is None
    assert recording.calls == []


def test_predict_records_are_replayed_in_order_each_iteration(
    keras_version: Path, tmp_path: Path
) -> None:
    served = linked_version(keras_version, tmp_path / "1")
    batches = [keras_inputs(n) for n in (1, 3, 2)]
    write_records(served, [predict_log(b) for b in batches])
    recording = load(served, tmp_path / "work")
    report = replay(tf, recording, served, iterations=2)
    assert report is not None
    assert (report.records, report.runs) == (3, 6)
    assert [call[0] for call in recording.calls] == [SIG] * 6
    direct = tf.saved_model.load(str(keras_version)).signatures[SIG]
    for index, (_, inputs, got) in enumerate(recording.calls):
        sent = batches[index // 2]
        assert inputs.keys() == sent.keys()
        for alias in sent:
            np.testing.assert_array_equal(inputs[alias], sent[alias])
        want = direct(**{k: tf.constant(v) for k, v in sent.items()})
        for alias, value in want.items():
            np.testing.assert_allclose(got[alias], value.numpy(), rtol=0, atol=1e-6)


def test_classify_regress_and_multi_inference_records(
    examples_version: Path, tmp_path: Path
) -> None:
    served = linked_version(examples_version, tmp_path / "1")
    classify = classification_pb2.ClassificationRequest()
    classify.input.example_list.examples.extend([example([1.0, 2.0]), example([0.5, -1.0])])
    regress = regression_pb2.RegressionRequest()
    regress.model_spec.signature_name = "regress"
    with_context = regress.input.example_list_with_context
    with_context.examples.extend([example([1.0, 2.0]), example([3.0, 0.25], b"de")])
    with_context.context.CopyFrom(example([0.0, 0.0], b"fr"))
    multi = inference_pb2.MultiInferenceRequest()
    multi.input.example_list.examples.extend([example([2.0, 2.0])])
    for signature, method in (("serving_default", "classify"), ("regress", "regress")):
        task = multi.tasks.add()
        task.model_spec.name = "ctr"  # TF Serving refuses a task with none
        task.model_spec.signature_name = signature
        task.method_name = f"tensorflow/serving/{method}"
    write_records(
        served,
        [
            prediction_log_pb2.PredictionLog(
                classify_log=prediction_log_pb2.ClassifyLog(request=classify)
            ),
            prediction_log_pb2.PredictionLog(
                regress_log=prediction_log_pb2.RegressLog(request=regress)
            ),
            prediction_log_pb2.PredictionLog(
                multi_inference_log=prediction_log_pb2.MultiInferenceLog(request=multi)
            ),
        ],
    )
    recording = load(served, tmp_path / "work")
    report = replay(tf, recording, served)
    assert report is not None
    assert (report.records, report.runs) == (3, 4)
    assert [c[0] for c in recording.calls] == [SIG, "regress", SIG, "regress"]
    assert recording.calls[0][2]["scores"].shape == (2, 3)
    # The context's features reach every example; the example's own win where both have one
    # (protobuf merge): the first is "fr" (+10), the second keeps "de".
    np.testing.assert_allclose(recording.calls[1][2]["outputs"].ravel(), [13.0, 3.25])
    np.testing.assert_allclose(recording.calls[3][2]["outputs"].ravel(), [4.0])


@pytest.mark.parametrize(
    "case, message",
    [
        ("extra input", "Sent extra: {nope}. Missing but required: {}."),
        ("unknown signature", 'Serving signature key "nope" not found.'),
        ("unknown output", "output tensor alias not found in signature: nope"),
        ("session run", "Unsupported log_type for warmup: 5"),
        ("too many", "Number of warmup records exceeds the maximum (1000)"),
        ("wrong dtype", 'input "ids": expects dtype int64 but string is provided'),
        ("not a TFRecord", "Please verify your warmup data is in TFRecord format"),
        # TensorFlow's conversion of it ended the worker at every load try (found by a review).
        ("string of rank 33", "is a string tensor of rank 33: the workers take string tensors"),
    ],
)
def test_a_bad_record_fails_the_warm_up_with_the_reason(
    case: str, message: str, keras_version: Path, tmp_path: Path
) -> None:
    """With TF Serving's status code for it (saved_model_warmup.cc and _util.cc, Predict's
    checks): the version's load fails with it, and GetModelStatus reports it."""
    served = linked_version(keras_version, tmp_path / "1")
    good = keras_inputs(1)
    if case == "extra input":
        logs = [predict_log({**good, "nope": np.zeros(1, np.float32)})]
    elif case == "unknown signature":
        logs = [predict_log(good, signature="nope")]
    elif case == "unknown output":
        entry = predict_log(good)
        entry.predict_log.request.output_filter.append("nope")
        logs = [entry]
    elif case == "session run":
        session_run = prediction_log_pb2.SessionRunLog()
        logs = [prediction_log_pb2.PredictionLog(session_run_log=session_run)]
    elif case == "too many":
        logs = [predict_log(good)] * 1001
    elif case == "wrong dtype":
        logs = [predict_log({**good, "ids": np.array([["a", "b", "c", "d"]])})]
    elif case == "string of rank 33":
        entry = predict_log(good)
        deep = entry.predict_log.request.inputs["ids"]
        deep.Clear()
        deep.dtype = tf.string.as_datatype_enum  # built by hand: numpy's conversion fails
        for _ in range(33):
            deep.tensor_shape.dim.add(size=1)
        deep.string_val.append(b"a")
        logs = [entry]
    else:
        logs = []
    path = write_records(served, logs)
    if case == "not a TFRecord":
        path.write_bytes(b"this is not a TFRecord file at all")
    recording = load(served, tmp_path / "work")
    with pytest.raises(WarmupError) as raised:
        replay(tf, recording, served)
    assert message in str(raised.value)
    # The reader's words as TF Serving gives them, not what tf.data wraps them in.
    assert "{{" not in str(raised.value) and "[Op:" not in str(raised.value)
    expected = {
        "unknown signature": Code.FAILED_PRECONDITION,
        "session run": Code.UNIMPLEMENTED,
        "not a TFRecord": Code.DATA_LOSS,
    }
    assert raised.value.code is expected.get(case, Code.INVALID_ARGUMENT)


def multi_inference_log(*tasks: tuple[str, str, str]) -> Any:
    """A MultiInference record of one example; each task (model name, signature, method)."""
    multi = inference_pb2.MultiInferenceRequest()
    multi.input.example_list.examples.extend([example([2.0, 2.0])])
    for name, signature, method in tasks:
        task = multi.tasks.add()
        task.model_spec.name = name
        task.model_spec.signature_name = signature
        task.method_name = method
    return prediction_log_pb2.PredictionLog(
        multi_inference_log=prediction_log_pb2.MultiInferenceLog(request=multi)
    )


CLASSIFY = "tensorflow/serving/classify"
REGRESS = "tensorflow/serving/regress"


def classify_log(signature: str) -> Any:
    """A Classify record of one example on `signature`."""
    request = classification_pb2.ClassificationRequest()
    request.model_spec.signature_name = signature
    request.input.example_list.examples.extend([example([1.0, 2.0])])
    return prediction_log_pb2.PredictionLog(
        classify_log=prediction_log_pb2.ClassifyLog(request=request)
    )


@pytest.mark.parametrize(
    "case, message",
    [
        (
            "classify on a regression signature",
            "a Classify warm-up record is refused: INVALID_ARGUMENT: Expected classification "
            'signature outputs to contain at least one of "classes" or "scores". Signature was: '
            "regress",
        ),
        (
            "regress on a classification signature",
            "INVALID_ARGUMENT: Expected one output Tensor.",
        ),
        ("no method", "UNIMPLEMENTED: Unsupported signature method_name: "),
        # TF Serving looks the signature up before the method.
        ("no such signature, no method", "Requested signature not found in model graph: nope"),
        # INVALID_ARGUMENT, GetClassificationSignatureDef's words (FAILED_PRECONDITION before,
        # a Predict's; found by a hunt).
        ("classify on no such signature", "No signature was found with the name: nope"),
        ("same signature twice", "Duplicate evaluation of signature: regress"),
        ("no model name", "Found ModelSpec with an empty model name."),
        ("two models", "must access the same model name"),
        ("streamed predict", "Unsupported log_type for warmup: 7"),
        ("empty input", "a Classify warm-up record is refused: INVALID_ARGUMENT: Input is empty."),
        # Every task is checked before the input (found by a hunt).
        ("same signature twice, empty input", "Duplicate evaluation of signature: regress"),
    ],
)
def test_example_records_tf_serving_refuses_fail_the_warm_up(
    case: str, message: str, examples_version: Path, tmp_path: Path
) -> None:
    """Each was replayed and the version went AVAILABLE, where TF Serving's warm-up refuses
    it (classifier.cc, regressor.cc, multi_inference.cc, saved_model_warmup.cc)."""
    served = linked_version(examples_version, tmp_path / "1")
    if case == "classify on a regression signature":
        log = classify_log("regress")
    elif case == "regress on a classification signature":
        request = regression_pb2.RegressionRequest()
        request.input.example_list.examples.extend([example([1.0, 2.0])])
        log = prediction_log_pb2.PredictionLog(
            regress_log=prediction_log_pb2.RegressLog(request=request)
        )
    elif case == "classify on no such signature":
        log = classify_log("nope")
    elif case == "no method":
        log = multi_inference_log(("ctr", "regress", ""))
    elif case == "no such signature, no method":
        log = multi_inference_log(("ctr", "nope", ""))
    elif case == "same signature twice":
        log = multi_inference_log(("ctr", "regress", REGRESS), ("ctr", "regress", REGRESS))
    elif case == "no model name":
        log = multi_inference_log(("", "regress", REGRESS))
    elif case == "two models":
        log = multi_inference_log(("ctr", "regress", REGRESS), ("other", "", CLASSIFY))
    elif case == "empty input":
        log = classify_log(SIG)
        log.classify_log.request.input.example_list.ClearField("examples")
    elif case == "same signature twice, empty input":
        log = multi_inference_log(("ctr", "regress", REGRESS), ("ctr", "regress", REGRESS))
        log.multi_inference_log.request.input.ClearField("example_list")
    else:
        log = prediction_log_pb2.PredictionLog()
        log.predict_streamed_log.request.add().model_spec.name = "ctr"
    write_records(served, [log])
    recording = load(served, tmp_path / "work")
    with pytest.raises(WarmupError) as raised:
        replay(tf, recording, served)
    assert message in str(raised.value)
    assert recording.calls == []
    if case == "classify on no such signature":
        assert raised.value.code is Code.INVALID_ARGUMENT


def build_odd_answers_model(base: Path) -> Path:
    """Classification and regression signatures on serialized tf.Examples whose answers TF
    Serving refuses (classifier.cc, regressor.cc): int64 classes, double scores, a regression
    of two columns, and one answering one row whatever the examples. Built by hand:
    TensorFlow's signature_def_utils refuse to build such signatures, which exports do not."""
    v1 = tf.compat.v1
    with tf.Graph().as_default():
        serialized = v1.placeholder(tf.string, [None], name="tf_example")
        features = v1.io.parse_example(serialized, {"x": v1.io.FixedLenFeature([2], tf.float32)})
        x = features["x"]
        rows = tf.shape(serialized)[0]
        info = v1.saved_model.utils.build_tensor_info
        constants = v1.saved_model.signature_constants

        def signature(method: str, inputs: Any = None, **outputs: Any) -> Any:
            return v1.saved_model.signature_def_utils.build_signature_def(
                inputs or {"inputs": info(serialized)},
                {k: info(v) for k, v in outputs.items()},
                method,
            )

        floats = v1.placeholder(tf.float32, [None, 2], name="floats")

        classify, regress = constants.CLASSIFY_METHOD_NAME, constants.REGRESS_METHOD_NAME
        labels = tf.tile(tf.constant([["a", "b"]]), [rows, 1])
        with v1.Session() as session:
            builder = v1.saved_model.Builder(str(base / "1"))
            builder.add_meta_graph_and_variables(
                session,
                ["serve"],
                signature_def_map={
                    "int_classes": signature(
                        classify,
                        classes=tf.tile(tf.constant([[7, 8]], tf.int64), [rows, 1]),
                        scores=x,
                    ),
                    "double_scores": signature(
                        classify, classes=labels, scores=tf.cast(x, tf.float64)
                    ),
                    "two_columns": signature(regress, outputs=x),
                    "one_row": signature(
                        regress, outputs=tf.reduce_sum(x, axis=0, keepdims=True)[:, :1]
                    ),
                    "float_inputs": signature(classify, {"inputs": info(floats)}, scores=floats),
                    "two_inputs": signature(
                        classify,
                        {"inputs": info(serialized), "other": info(floats)},
                        scores=x,
                    ),
                },
            )
            builder.save()
    return base / "1"


@pytest.mark.parametrize(
    "log, message",
    [
        ("classify int_classes", "Expected classes Tensor of DT_STRING. Got: DT_INT64"),
        ("classify double_scores", "Expected scores Tensor of DT_FLOAT. Got: DT_DOUBLE"),
        (
            "regress two_columns",
            "Expected output Tensor shape to be either [batch_size] or [batch_size, 1] but got "
            "[3,2]",
        ),
        ("regress one_row", "Input batch size did not match output batch size: 3 vs. 1"),
        ("multi one_row", "Input batch size did not match output batch size: 3 vs. 1"),
        # TF Serving's order: the input is read (and found empty) before the feed is refused,
        # and every task's signature is checked before the input (found by a review).
        ("classify float_inputs empty", "INVALID_ARGUMENT: Input is empty."),
        (
            "multi two_inputs empty",
            "MultiInference warm-up record is refused: INVALID_ARGUMENT: "
            "Expected one input Tensor.",
        ),
    ],
)
def test_a_warm_up_answer_tf_serving_refuses_fails_the_warm_up(
    log: str, message: str, tmp_path: Path
) -> None:
    """TF Serving's warm-up checks each Classify, Regress and MultiInference answer as a
    served one (PostProcessClassificationResult, PostProcessRegressionResult): such a
    version went AVAILABLE here and then failed every request on that signature (found by a
    hunt). INVALID_ARGUMENT, with TF Serving's words."""
    served = build_odd_answers_model(tmp_path / "odd")
    kind, signature, *empty = log.split()
    three = [] if empty else [example([1.0, 2.0]), example([3.0, 4.0]), example([5.0, 6.0])]
    if kind == "classify":
        request = classification_pb2.ClassificationRequest()
        request.model_spec.signature_name = signature
        request.input.example_list.examples.extend(three)
        entry = prediction_log_pb2.PredictionLog(
            classify_log=prediction_log_pb2.ClassifyLog(request=request)
        )
    elif kind == "regress":
        regress = regression_pb2.RegressionRequest()
        regress.model_spec.signature_name = signature
        regress.input.example_list.examples.extend(three)
        entry = prediction_log_pb2.PredictionLog(
            regress_log=prediction_log_pb2.RegressLog(request=regress)
        )
    else:
        # Behind a task whose signature is sound, for the order's sake.
        sound = [("odd", "one_row", REGRESS)] if signature == "two_inputs" else []
        method = CLASSIFY if signature == "two_inputs" else REGRESS
        entry = multi_inference_log(*sound, ("odd", signature, method))
        request_input = entry.multi_inference_log.request.input
        request_input.example_list.ClearField("examples")
        request_input.example_list.examples.extend(three)
    write_records(served, [entry])
    recording = load(served, tmp_path / "work")
    with pytest.raises(WarmupError) as raised:
        replay(tf, recording, served)
    assert message in str(raised.value)
    assert raised.value.code is Code.INVALID_ARGUMENT


def test_with_the_method_name_check_warm_up_checks_methods_as_served_calls_do(
    examples_version: Path, tmp_path: Path
) -> None:
    """--enable_signature_method_name_check is on before TF Serving loads anything, so its
    warm-up refuses what its served calls would (the version served instead; found by a
    hunt): a Classify on a regression signature says so by its method, and a Predict on a
    signature of none of the three methods (INTERNAL, predict_util.cc)."""
    served = linked_version(examples_version, tmp_path / "1")
    write_records(served, [classify_log("regress")])
    recording = load(served, tmp_path / "work")
    with pytest.raises(WarmupError) as raised:
        replay(tf, recording, served, check_method_names=True)
    assert raised.value.code is Code.INVALID_ARGUMENT
    assert (
        "Expected classification signature method_name to be tensorflow/serving/classify. "
        "Was: tensorflow/serving/regress" in str(raised.value)
    )

    class CustomMethod:
        """A runtime whose one signature has a method of its own."""

        def __init__(self) -> None:
            x, y = TensorSpec(DT_FLOAT, (-1,)), TensorSpec(DT_FLOAT, (-1,))
            self.specs = {SIG: SignatureSpec(SIG, "custom/method", {"x": x}, {"y": y})}
            self.runs = 0

        def run(self, *_: Any) -> None:
            self.runs += 1

    custom = tmp_path / "custom" / "1"
    write_records(custom, [predict_log({"x": np.zeros(2, np.float32)})])
    runtime = CustomMethod()
    with pytest.raises(WarmupError) as raised:
        replay(tf, runtime, custom, check_method_names=True)
    assert raised.value.code is Code.INTERNAL
    assert "Expected prediction signature method_name to be one of {" in str(raised.value)
    assert "Was: custom/method" in str(raised.value)
    report = replay(tf, runtime, custom)  # the check off: as before
    assert report is not None and runtime.runs == 1


def test_a_record_of_no_kind_is_read_not_replayed(keras_version: Path, tmp_path: Path) -> None:
    """TF Serving counts it in the records its warm-up read (model_warmup_records_read)."""
    served = linked_version(keras_version, tmp_path / "1")
    write_records(served, [prediction_log_pb2.PredictionLog(), predict_log(keras_inputs(1))])
    recording = load(served, tmp_path / "work")
    report = replay(tf, recording, served)
    assert report is not None and (report.records, report.runs) == (2, 1)


def test_warm_up_flags_are_tf_servings() -> None:
    def parsed(*flags: str) -> Any:
        return cli.build_parser().parse_args(["start", "--model-base-path", "/m", *flags])

    assert (parsed().model_warmup, parsed().warmup_iterations) == (True, 1)
    assert parsed("--enable_model_warmup=false").model_warmup is False
    assert parsed("--enable-model-warmup", "true").model_warmup is True
    assert parsed("--enable_model_warmup").model_warmup is True  # absl's bare boolean flag
    assert parsed("--num_request_iterations_for_warmup", "4").warmup_iterations == 4
    # TF Serving's default is 0, read only when > 0: a manifest passing it must start.
    for unset in ("0", "-3"):
        assert parsed(f"--num_request_iterations_for_warmup={unset}").warmup_iterations == 1
    with pytest.raises(SystemExit):
        parsed("--enable_model_warmup=maybe")
    config = PoolConfig(
        model_name="m", model_base_path="/m", model_version=1, run_dir="/r", log_dir="/l",
        workers=1, warmup_iterations=0,
    )  # fmt: skip
    with pytest.raises(ConfigError, match="num_request_iterations_for_warmup must be >= 1"):
        config.validate()


def test_a_pool_replays_the_records_and_a_failing_warm_up_never_serves(
    keras_version: Path, tmp_path: Path
) -> None:
    base = tmp_path / "model"
    served = linked_version(keras_version, base / "1")
    path = write_records(served, [predict_log(keras_inputs(2)), predict_log(keras_inputs(1))])

    (tmp_path / "good").mkdir()
    monitoring = tmp_path / "monitoring.config"
    monitoring.write_text('prometheus_config { enable: true, path: "/metrics" }')
    pool = Pool(
        tmp_path / "good", base, 2, "--num_request_iterations_for_warmup", "3",
        "--monitoring_config_file", str(monitoring),
    ).start()  # fmt: skip
    try:
        pool.wait_ready(2)
        log = (pool.log_dir / "worker-cpu-0-v1.log").read_text(errors="replace")
        assert f"warm-up: replayed 2 records (6 model calls, 3 iterations each) from {path}" in log
        # TF Serving's warm-up metrics, by the version's folder: each worker's warm-up (each
        # loads the version), records counted once whatever the iterations.
        page = requests.get(f"{pool.rest_url}/metrics", timeout=30).text
        samples = prometheus_samples(page)
        labels = f'model_path="{base / "1"}",status="OK"'
        assert samples[f":tensorflow:serving:model_warmup_records_read{{{labels}}}"] == 4, page
        assert samples[f":tensorflow:serving:model_warmup_latency_count{{{labels}}}"] == 2, page
        assert samples[f":tensorflow:serving:model_warmup_latency_sum{{{labels}}}"] > 0
        # TensorFlow's SavedModel load metrics beside them: each worker's load, its µs.
        path_label = f'model_path="{base / "1"}"'
        load = f':tensorflow:cc:saved_model:load_attempt_count{{{path_label},status="success"}}'
        assert samples[load] == 2, page
        assert samples[f":tensorflow:cc:saved_model:load_latency{{{path_label}}}"] > 0, page
    finally:
        assert pool.stop() == 0
    assert pool.leftovers() == []

    write_records(served, [predict_log({"ids": keras_inputs(1)["ids"]})])
    (tmp_path / "bad").mkdir()
    # TF Serving's spelling of --start-retries: no load tried again after the first fails.
    pool = Pool(tmp_path / "bad", base, 1, "--max_num_load_retries=0").start()
    try:
        assert pool.proc is not None
        assert pool.proc.wait(120) == 1, pool.output()
        out = pool.output()
        assert "no worker could start" in out, out
        assert "warm-up of model 'demo' version 1 failed" in out, out
        assert "Missing but required: {features}." in out, out
        log = (pool.log_dir / "worker-cpu-0-v1.log").read_text(errors="replace")
        assert log.count("warm-up of model 'demo' version 1 failed") == 1, log[-3000:]
    finally:
        pool.kill()
    assert pool.leftovers() == []
