"""TF Serving's Predict over one SavedModel, written with the official APIs only: what the
plain and Ray Serve peers both serve (each behind its own server).

``tf.saved_model.load``, the ``serving_default`` signature, requests decoded with
``tf.make_ndarray`` and answers encoded with ``tf.make_tensor_proto``; refusals with TF
Serving's status codes and messages for the cases a client meets (unknown model or version,
unknown signature, bad inputs or outputs). TensorFlow and tensorflow-serving-api are
imported here, so only the peers' own processes pay for them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import tensorflow as tf
from tensorflow_serving.apis import predict_pb2

SIGNATURE = "serving_default"


class Refused(Exception):
    """A request TF Serving would refuse: ``code`` is a grpc.StatusCode name."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class PredictModel:
    """One loaded SavedModel version answering PredictRequests."""

    def __init__(self, model_dir: str | Path, name: str, intra_op_threads: int) -> None:
        # Before anything runs: TensorFlow fixes its thread pools on first use.
        tf.config.threading.set_intra_op_parallelism_threads(intra_op_threads)
        tf.config.threading.set_inter_op_parallelism_threads(1)
        self.name = name
        # TF Serving's layout: the version is the directory's name.
        base = Path(model_dir).name
        self.version = int(base) if base.isdigit() else 0
        self.loaded = tf.saved_model.load(str(model_dir), tags=["serve"])
        self.serve = self.loaded.signatures[SIGNATURE]
        self.input_names = sorted(self.serve.structured_input_signature[1])

    def predict(self, request: Any) -> Any:
        """The PredictResponse for ``request``; Refused for what TF Serving refuses."""
        spec = request.model_spec
        choice = spec.WhichOneof("version_choice")
        if spec.name != self.name or (choice == "version" and spec.version.value != self.version):
            wanted = (
                f"Specific({spec.name}, {spec.version.value})"
                if choice == "version"
                else f"Latest({spec.name})"
            )
            raise Refused("NOT_FOUND", f"Servable not found for request: {wanted}")
        if choice == "version_label" and spec.version_label != str(self.version):
            raise Refused(
                "INVALID_ARGUMENT", f"Unrecognized servable version label: {spec.version_label}"
            )
        signature = spec.signature_name or SIGNATURE
        if signature != SIGNATURE:
            raise Refused("FAILED_PRECONDITION", f'Serving signature key "{signature}" not found.')
        sent = sorted(request.inputs)
        if sent != self.input_names:
            raise Refused(
                "INVALID_ARGUMENT",
                f"input size does not match signature: {len(sent)}!={len(self.input_names)} "
                f"for inputs {sent}, signature expects {self.input_names}",
            )
        try:
            inputs = {k: tf.make_ndarray(v) for k, v in request.inputs.items()}
            outputs = self.serve(**inputs)
        except (tf.errors.InvalidArgumentError, TypeError, ValueError) as exc:
            raise Refused("INVALID_ARGUMENT", str(exc).strip()[:1000]) from None
        wanted_outputs = list(request.output_filter) or list(outputs)
        unknown = [k for k in wanted_outputs if k not in outputs]
        if unknown:
            raise Refused(
                "INVALID_ARGUMENT", f"output tensor alias not found in signature: {unknown[0]}"
            )
        response = predict_pb2.PredictResponse()
        response.model_spec.name = self.name
        response.model_spec.version.value = self.version
        response.model_spec.signature_name = signature
        for key in wanted_outputs:
            response.outputs[key].CopyFrom(tf.make_tensor_proto(outputs[key].numpy()))
        return response
