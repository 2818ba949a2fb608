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
(router/src/inference.rs).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mpspool.errors import ServingError
from mpspool.protos import prediction_log_pb2, tensorflow_pb2
from mpspool.signature import check_inputs, check_output_filter

log = logging.getLogger("mpspool.worker")

WARMUP_FILE = Path("assets.extra") / "tf_serving_warmup_requests"
MAX_RECORDS = 1000  # TF Serving's WarmupConsts::kMaxNumRecords
DEFAULT_SIGNATURE = "serving_default"
INPUTS = "inputs"  # a classification or regression signature's one input


class WarmupError(Exception):
    """A warm-up record could not be read or run; the message says which and why."""


@dataclass(frozen=True)
class WarmupReport:
    path: str
    records: int  # records in the file that were replayed
    runs: int  # model calls made (records × iterations, MultiInference tasks counted)
    seconds: float


def replay(
    tf: Any, runtime: Any, version_dir: str | Path, iterations: int = 1
) -> WarmupReport | None:
    """Run every record of the version's warm-up file `iterations` times; None when the
    version has no such file (warm-up data is optional)."""
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
        calls = _calls(entry, runtime.specs)
        if calls is None:
            log.warning("warm-up record %d of %s: a kind not replayed; skipped", index, path)
            continue
        for _ in range(max(1, iterations)):
            for signature, inputs, outputs in calls:
                try:
                    runtime.run(signature, inputs, outputs)
                except ServingError as exc:
                    raise WarmupError(
                        f"warm-up record {index} of {path} failed: {exc.code.name}: {exc.message}"
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
            f"{exc.message}. Please verify your warmup data is in TFRecord format. ({path})"
        ) from exc


Call = tuple[str, dict[str, np.ndarray], list[str]]


def _calls(entry: Any, specs: Mapping[str, Any]) -> list[Call] | None:
    """The model calls one record makes; None for a kind that is not replayed."""
    kind = entry.WhichOneof("log_type")
    if kind == "predict_log":
        return [_predict(entry.predict_log.request, specs)]
    if kind == "classify_log":
        request = entry.classify_log.request
        return [_examples_call(request.model_spec.signature_name, request.input, specs)]
    if kind == "regress_log":
        request = entry.regress_log.request
        return [_examples_call(request.model_spec.signature_name, request.input, specs)]
    if kind == "multi_inference_log":
        request = entry.multi_inference_log.request
        if not request.tasks:
            raise WarmupError("a MultiInference warm-up record has no tasks")
        return [
            _examples_call(task.model_spec.signature_name, request.input, specs)
            for task in request.tasks
        ]
    if kind == "session_run_log":
        raise WarmupError("Unsupported log_type for warmup: session_run_log")
    return None


def _signature(name: str, specs: Mapping[str, Any]) -> Any:
    key = name or DEFAULT_SIGNATURE
    spec = specs.get(key)
    if spec is None:
        raise WarmupError(
            f"a warm-up record names signature {key!r}, which the model does not have "
            f"(it has {', '.join(sorted(specs)) or 'none'})"
        )
    return spec


def _predict(request: Any, specs: Mapping[str, Any]) -> Call:
    """Checked as a served Predict is (the same messages), then converted."""
    spec = _signature(request.model_spec.signature_name, specs)
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
            f"{exc.code.name}: {exc.message}"
        ) from exc
    return spec.key, inputs, outputs


def _examples_call(signature: str, request_input: Any, specs: Mapping[str, Any]) -> Call:
    spec = _signature(signature, specs)
    if len(spec.inputs) != 1 or INPUTS not in spec.inputs:
        raise WarmupError(
            f"signature {spec.key!r} cannot take tf.Examples: it needs exactly one input "
            f"named {INPUTS!r} (it has {sorted(spec.inputs)})"
        )
    kind = request_input.WhichOneof("kind")
    if kind == "example_list":
        examples = list(request_input.example_list.examples)
    elif kind == "example_list_with_context":
        listed = request_input.example_list_with_context
        examples = [listed.context + example for example in listed.examples]
    else:
        raise WarmupError("a warm-up record's Input has no examples")
    if not examples:
        raise WarmupError("a warm-up record's Input has an empty example list")
    return spec.key, {INPUTS: np.array(examples, dtype=object)}, list(spec.outputs)


def _ndarray(tensor: tensorflow_pb2.TensorProto, alias: str) -> np.ndarray:
    """A request's TensorProto as the array the runtime takes: parsed by TensorFlow's own
    converter (the same message, read as tensorflow.TensorProto)."""
    from tensorflow.core.framework import tensor_pb2
    from tensorflow.python.framework import tensor_util

    try:
        parsed = tensor_pb2.TensorProto.FromString(tensor.SerializeToString())
        return tensor_util.MakeNdarray(parsed)
    except Exception as exc:
        raise WarmupError(f"warm-up input {alias!r} is not a valid tensor: {exc}") from exc
