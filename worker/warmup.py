"""Replay a model's recorded warm-up requests before the worker says READY, as TF Serving does
(`saved_model_warmup.cc`, `saved_model_warmup_util.cc`).

The file is `<version>/assets.extra/tf_serving_warmup_requests`: a TFRecord of
`tensorflow.serving.PredictionLog`, at most 1000 records, each replayed
`--num_request_iterations_for_warmup` times (default 1). Predict, Classify, Regress and
MultiInference records are run; a SessionRun record is refused (Unimplemented, as in TF
Serving); a record of a kind this reader does not know is skipped, as TF Serving skips one.
Any record that fails fails the load: a version that cannot answer its own recorded requests
must not take traffic, and the worker exits with the reason (`mpspool status` shows it).

The requests run through the same `ModelRuntime.run` as served ones. Classify, Regress and
MultiInference feed the serialized tf.Examples (the context's bytes in front of each: a
protobuf merge) to the signature's one `inputs` string tensor, as the front door does
(router/src/inference.rs), after the checks the front door makes of a served request
(TF Serving's `PreProcessClassification` / `PreProcessRegression`, and MultiInference's
method names, duplicate signatures and model names), and their answers are checked as the
front door checks a served one's (`PostProcessClassificationResult` and its twin): a record
that TF Serving's warm-up refuses fails the load here too, with its message.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
from google.protobuf.unknown_fields import UnknownFieldSet

from mpspool.dtypes import DT_FLOAT, DT_STRING, dt_of_array, dtype_name
from mpspool.errors import Code, ServingError
from mpspool.protos import prediction_log_pb2, tensorflow_pb2
from mpspool.signature import (
    MAX_STRING_RANK,
    PREDICT_METHOD,
    check_inputs,
    check_output_filter,
)

log = logging.getLogger("mpspool.worker")

WARMUP_FILE = Path("assets.extra") / "tf_serving_warmup_requests"
MAX_RECORDS = 1000  # TF Serving's WarmupConsts::kMaxNumRecords
DEFAULT_SIGNATURE = "serving_default"
INPUTS = "inputs"  # a classification or regression signature's one input
CLASSIFY_METHOD = "tensorflow/serving/classify"
REGRESS_METHOD = "tensorflow/serving/regress"
# PredictionLog's predict_streamed_log: a kind mpspool's copy of the proto does not declare,
# refused by TF Serving's warm-up (Unimplemented, naming the field's number).
PREDICT_STREAMED_LOG = 7
SESSION_RUN_LOG = 5


class WarmupError(Exception):
    """A warm-up record could not be read or run; the message says which and why, ``code``
    the status TF Serving's warm-up fails the load with (saved_model_warmup_util.cc: its
    checks of a record INVALID_ARGUMENT, a corrupt file DATA_LOSS, a record that runs and
    fails that request's own)."""

    def __init__(self, message: str, code: Code = Code.INVALID_ARGUMENT) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class WarmupReport:
    path: str
    records: int  # records in the file that were replayed
    runs: int  # model calls made (records × iterations, MultiInference tasks counted)
    seconds: float


def replay(
    tf: Any,
    runtime: Any,
    version_dir: str | Path,
    iterations: int = 1,
    check_method_names: bool = False,
) -> WarmupReport | None:
    """Run every record of the version's warm-up file `iterations` times; None when the
    version has no such file (warm-up data is optional). `check_method_names`:
    --enable_signature_method_name_check, which TF Serving turns on before anything loads,
    so its warm-up's Predict, Classify and Regress check signatures' methods as served ones
    do."""
    path = Path(version_dir) / WARMUP_FILE
    if not path.exists():
        return None
    started = time.monotonic()
    records = runs = 0
    for index, record in enumerate(_records(tf, path)):
        if index >= MAX_RECORDS:
            raise WarmupError(
                f"Number of warmup records exceeds the maximum ({MAX_RECORDS}) at {path}"
            )
        try:
            entry = prediction_log_pb2.PredictionLog.FromString(record)
        except Exception as exc:  # DecodeError: not a PredictionLog
            raise WarmupError(f"Failed to parse warmup record {index} from {path}: {exc}") from exc
        calls = _calls(entry, runtime.specs, check_method_names)
        if calls is None:
            # Read, as TF Serving counts a record of no kind it runs (saved_model_warmup_util).
            log.warning("warm-up record %d of %s: a kind not replayed; skipped", index, path)
            records += 1
            continue
        for _ in range(max(1, iterations)):
            for signature, inputs, outputs, method in calls:
                try:
                    answer = runtime.run(signature, inputs, outputs)
                    _postprocess(method, answer, len(inputs.get(INPUTS, ())))
                except ServingError as exc:
                    raise WarmupError(
                        f"warm-up record {index} of {path} failed: {exc.code.name}: {exc.message}",
                        exc.code,
                    ) from exc
                runs += 1
        records += 1
    return WarmupReport(str(path), records, runs, time.monotonic() - started)


def _records(tf: Any, path: Path) -> Iterator[bytes]:
    """The file's records, read by TensorFlow's own TFRecord reader (it checks each CRC)."""
    try:
        for record in tf.data.TFRecordDataset(str(path)):
            yield record.numpy()
    except tf.errors.DataLossError as exc:
        raise WarmupError(
            f"{_reader_words(exc.message)}. Please verify your warmup data is in TFRecord "
            f"format. ({path})",
            Code.DATA_LOSS,
        ) from exc


def _reader_words(message: str) -> str:
    """The record reader's own words ("corrupted record at 0"), as TF Serving passes them
    on, without what tf.data wraps them in (the function's name, the op's)."""
    message = re.sub(r"^\{\{[^}]*\}\}\s*", "", message)
    return re.sub(r"\s*\[Op:[^\]]*\].*$", "", message, flags=re.DOTALL)


# A model call: its signature, inputs and outputs, and the task whose answer TF Serving
# checks (CLASSIFY_METHOD or REGRESS_METHOD; "" for a Predict, whose answer is not).
Call = tuple[str, dict[str, np.ndarray], list[str], str]


def _calls(entry: Any, specs: Mapping[str, Any], check: bool = False) -> list[Call] | None:
    """The model calls one record makes; None for a kind that is not replayed. `check`: the
    signatures' method names are checked (`replay`)."""
    kind = entry.WhichOneof("log_type")
    if kind == "predict_log":
        return [_predict(entry.predict_log.request, specs, check)]
    if kind in ("classify_log", "regress_log"):
        method = CLASSIFY_METHOD if kind == "classify_log" else REGRESS_METHOD
        request = getattr(entry, kind).request
        signature = request.model_spec.signature_name
        return [_examples_call(signature, method, request, specs, check)]
    if kind == "multi_inference_log":
        return _multi_inference(entry.multi_inference_log.request, specs, check)
    if kind == "session_run_log":
        # TF Serving names the kind by its number (the log_type case), as for field 7 below.
        raise WarmupError(f"Unsupported log_type for warmup: {SESSION_RUN_LOG}", Code.UNIMPLEMENTED)
    if kind is None and any(f.field_number == PREDICT_STREAMED_LOG for f in UnknownFieldSet(entry)):
        raise WarmupError(
            f"Unsupported log_type for warmup: {PREDICT_STREAMED_LOG}", Code.UNIMPLEMENTED
        )
    return None


def _multi_inference(request: Any, specs: Mapping[str, Any], check: bool = False) -> list[Call]:
    """TF Serving's `TensorFlowMultiInferenceRunner::Infer` checks, in its order."""
    if not request.tasks:
        raise WarmupError("a MultiInference warm-up record has no tasks")
    model = ""
    seen: set[str] = set()
    calls = []
    for task in request.tasks:
        name = task.model_spec.name
        if not name:
            _refuse(
                "MultiInference", "INVALID_ARGUMENT", "Found ModelSpec with an empty model name."
            )
        if model and name != model:
            _refuse(
                "MultiInference",
                "INVALID_ARGUMENT",
                "All ModelSpecs in a MultiInferenceRequest must access the same model name.",
            )
        model = name
        signature = task.model_spec.signature_name or DEFAULT_SIGNATURE
        if signature in seen:
            _refuse(
                "MultiInference",
                "INVALID_ARGUMENT",
                f"Duplicate evaluation of signature: {signature}",
            )
        seen.add(signature)
        if signature not in specs:
            _refuse(
                "MultiInference",
                "INVALID_ARGUMENT",
                f"Requested signature not found in model graph: {signature}",
            )
        if task.method_name not in (CLASSIFY_METHOD, REGRESS_METHOD):
            _refuse(
                "MultiInference",
                "UNIMPLEMENTED",
                f"Unsupported signature method_name: {task.method_name}",
            )
    # Every task's signature checked first (PreProcess of each), then the one input and the
    # feed: an empty input was said before a later task's duplicate signature or its
    # signature's refusal (found by a hunt and a review).
    tasks = [
        _examples_task(
            task.model_spec.signature_name or DEFAULT_SIGNATURE,
            task.method_name,
            specs,
            check,
            "MultiInference",
        )
        for task in request.tasks
    ]
    examples = _examples(request, "MultiInference")
    for (spec, outputs), task in zip(tasks, request.tasks, strict=True):
        calls.append(_examples_feed(spec, outputs, task.method_name, examples, "MultiInference"))
    return calls


def _refuse(kind: str, code: str, message: str) -> NoReturn:
    raise WarmupError(f"a {kind} warm-up record is refused: {code}: {message}", Code[code])


def _signature(name: str, specs: Mapping[str, Any], code: Code = Code.FAILED_PRECONDITION) -> Any:
    """The record's signature. Missing: FAILED_PRECONDITION for a Predict (TF Serving's
    "Serving signature key ... not found"), INVALID_ARGUMENT for a Classify or Regress (its
    "No signature was found with the name")."""
    key = name or DEFAULT_SIGNATURE
    spec = specs.get(key)
    if spec is None:
        has = f"it has {', '.join(sorted(specs)) or 'none'}"
        if code is Code.INVALID_ARGUMENT:
            raise WarmupError(f"No signature was found with the name: {key} ({has})", code)
        raise WarmupError(f'Serving signature key "{key}" not found. ({has})', code)
    return spec


def _predict(request: Any, specs: Mapping[str, Any], check: bool = False) -> Call:
    """Checked as a served Predict is (the same messages), then converted."""
    spec = _signature(request.model_spec.signature_name, specs)
    if check and spec.method_name not in (PREDICT_METHOD, CLASSIFY_METHOD, REGRESS_METHOD):
        # predict_util.cc, VerifySignature
        _refuse(
            "Predict",
            "INTERNAL",
            "Expected prediction signature method_name to be one of {"
            f"{PREDICT_METHOD}, {CLASSIFY_METHOD}, {REGRESS_METHOD}}}. Was: {spec.method_name}",
        )
    inputs = {alias: _ndarray(request.inputs[alias], alias) for alias in sorted(request.inputs)}
    try:
        check_inputs(
            spec,
            {alias: (request.inputs[alias].dtype, a.shape) for alias, a in inputs.items()},
        )
        outputs = check_output_filter(spec, request.output_filter)
    except ServingError as exc:
        raise WarmupError(
            f"a Predict warm-up record does not fit signature {spec.key!r}: "
            f"{exc.code.name}: {exc.message}",
            exc.code,
        ) from exc
    return spec.key, inputs, outputs, ""


def _examples_call(
    signature: str, method: str, request: Any, specs: Mapping[str, Any], check: bool = False
) -> Call:
    """A Classify or Regress on the record's tf.Examples, asking for the outputs a served one
    asks for; checked in TF Serving's order (its signature, then its input, then the feed)."""
    kind = "Classify" if method == CLASSIFY_METHOD else "Regress"
    spec, outputs = _examples_task(signature, method, specs, check, kind)
    return _examples_feed(spec, outputs, method, _examples(request, kind), kind)


def _examples_task(
    signature: str, method: str, specs: Mapping[str, Any], check: bool, kind: str
) -> tuple[Any, list[str]]:
    """The task's signature, checked (classifier.cc / regressor.cc: its method, then
    PreProcess), and the outputs to run."""
    spec = _signature(signature, specs, Code.INVALID_ARGUMENT)
    if check and spec.method_name != method:
        # classifier.cc / regressor.cc, GetClassificationSignatureDef and its twin
        noun = "classification" if method == CLASSIFY_METHOD else "regression"
        _refuse(
            kind,
            "INVALID_ARGUMENT",
            f"Expected {noun} signature method_name to be {method}. Was: {spec.method_name}",
        )
    return spec, _preprocess(spec, method, kind)


def _examples(request: Any, kind: str) -> list[bytes]:
    """The record's serialized tf.Examples (the context's bytes in front of each)."""
    request_input = request.input
    which = request_input.WhichOneof("kind")
    if which == "example_list":
        examples = list(request_input.example_list.examples)
    elif which == "example_list_with_context":
        listed = request_input.example_list_with_context
        examples = [listed.context + example for example in listed.examples]
    else:
        examples = []
    if not examples:  # util.cc's words, as a served request's
        _refuse(kind, "INVALID_ARGUMENT", "Input is empty.")
    return examples


def _examples_feed(
    spec: Any, outputs: list[str], method: str, examples: list[bytes], kind: str
) -> Call:
    if spec.inputs[INPUTS].dtype != DT_STRING:
        # TensorFlow's own refusal of the feed, as TF Serving passes it on.
        _refuse(
            kind,
            "INVALID_ARGUMENT",
            f"Expects arg[0] to be {dtype_name(spec.inputs[INPUTS].dtype)} but string is provided",
        )
    return spec.key, {INPUTS: np.array(examples, dtype=object)}, outputs, method


def _preprocess(spec: Any, method: str, kind: str) -> list[str]:
    """TF Serving's `PreProcessClassification` / `PreProcessRegression`, as the front door
    checks a served request (router/src/inference.rs `preprocess`): the outputs to run."""
    classify = method == CLASSIFY_METHOD
    noun = "classification" if classify else "regression"
    if len(spec.inputs) != 1:
        _refuse(kind, "INVALID_ARGUMENT", "Expected one input Tensor.")
    if classify and len(spec.outputs) not in (1, 2):
        _refuse(
            kind,
            "INVALID_ARGUMENT",
            f"Expected one or two output Tensors, found {len(spec.outputs)}",
        )
    if not classify and len(spec.outputs) != 1:
        _refuse(kind, "INVALID_ARGUMENT", "Expected one output Tensor.")
    if INPUTS not in spec.inputs:
        _refuse(kind, "INVALID_ARGUMENT", f"No {noun} inputs found in SignatureDef: {spec.key}")
    if classify:
        outputs = [name for name in ("classes", "scores") if name in spec.outputs]
        if not outputs:
            _refuse(
                kind,
                "INVALID_ARGUMENT",
                'Expected classification signature outputs to contain at least one of "classes" '
                f'or "scores". Signature was: {spec.key}',
            )
        return outputs
    if "outputs" not in spec.outputs:
        _refuse(
            kind, "INVALID_ARGUMENT", f"No regression outputs found in SignatureDef: {spec.key}"
        )
    return ["outputs"]


def _postprocess(method: str, answer: Mapping[str, np.ndarray], examples: int) -> None:
    """TF Serving's `PostProcessClassificationResult` / `PostProcessRegressionResult`, which
    its warm-up runs too (classifier.cc, regressor.cc, multi_inference.cc), as the front door
    checks a served one (router/src/inference.rs): a version whose classifier answers int64
    classes passed its warm-up here and then failed every Classify (found by a hunt). A
    Predict's answer is not checked."""
    if method == REGRESS_METHOD:
        _check_regression(answer["outputs"], examples)
    if method != CLASSIFY_METHOD:
        return
    width = None
    for what, want in (("classes", DT_STRING), ("scores", DT_FLOAT)):
        if what not in answer:
            continue
        array = np.asarray(answer[what])
        shape, dtype = array.shape, dt_of_array(array)
        if len(shape) != 2:
            _invalid(f"Expected Tensor shape: [batch_size num_classes] but got {_shape(shape)}")
        if dtype != want:
            _invalid(f"Expected {what} Tensor of {_dt(want)}. Got: {_dt(dtype)}")
        if shape[0] != examples:
            _invalid(f"Expected {what} output batch size of {examples}. Got: {shape[0]}")
        if width is not None and width != shape[1]:
            _invalid(
                f"Tensors class and score should match in dim_size(1). Got {width} vs. {shape[1]}"
            )
        width = shape[1]


def _check_regression(answer: np.ndarray, examples: int) -> None:
    array = np.asarray(answer)
    shape = array.shape
    if not (len(shape) == 1 or (len(shape) == 2 and shape[1] == 1)):
        _invalid(
            "Expected output Tensor shape to be either [batch_size] or [batch_size, 1] but got "
            + _shape(shape)
        )
    if shape[0] != examples:
        _invalid(f"Input batch size did not match output batch size: {examples} vs. {shape[0]}")
    if dt_of_array(array) != DT_FLOAT:
        _invalid(f"Expected output Tensor of DT_FLOAT.  Got: {_dt(dt_of_array(array))}")


def _invalid(message: str) -> NoReturn:
    raise ServingError(Code.INVALID_ARGUMENT, message)


def _dt(dtype: int) -> str:
    return f"DT_{dtype_name(dtype).upper()}"


def _shape(shape: tuple[int, ...]) -> str:
    """A shape as TensorFlow writes it: [2,3]."""
    return "[" + ",".join(str(d) for d in shape) + "]"


def _ndarray(tensor: tensorflow_pb2.TensorProto, alias: str) -> np.ndarray:
    """A request's TensorProto as the array the runtime takes: parsed by TensorFlow's own
    converter (the same message, read as tensorflow.TensorProto)."""
    from tensorflow.core.framework import tensor_pb2
    from tensorflow.python.framework import tensor_util

    rank = len(tensor.tensor_shape.dim)
    if tensor.dtype == DT_STRING and rank > MAX_STRING_RANK:
        # As the front door refuses a request of one (TensorFlow's conversion of it ends the
        # process: every load try of such a warm-up file did; found by a review).
        raise WarmupError(
            f"warm-up input {alias!r} is a string tensor of rank {rank}: the workers take "
            f"string tensors of rank {MAX_STRING_RANK} at most"
        )
    try:
        parsed = tensor_pb2.TensorProto.FromString(tensor.SerializeToString())
        return tensor_util.MakeNdarray(parsed)
    except Exception as exc:
        raise WarmupError(f"warm-up input {alias!r} is not a valid tensor: {exc}") from exc
