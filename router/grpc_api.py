"""TensorFlow Serving's gRPC API in front of the pool.

PredictionService (Predict, GetModelMetadata) and ModelService (GetModelStatus) are
registered under TF Serving's own service names with generic handlers over mpspool's
wire-compatible messages, so any TF Serving client works unchanged and this process never
imports TensorFlow. Status codes and messages follow TF Serving's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import grpc

from mpspool import signature as sigs
from mpspool import wire
from mpspool.errors import Code, ServingError
from mpspool.protos import serving_pb2, tensorflow_pb2
from mpspool.router import codec
from mpspool.router.dispatch import Dispatcher
from mpspool.router.metrics import Metrics

PREDICTION_SERVICE = "tensorflow.serving.PredictionService"
MODEL_SERVICE = "tensorflow.serving.ModelService"
SIGNATURE_DEF_MAP_URL = "type.googleapis.com/tensorflow.serving.SignatureDefMap"

_GRPC_CODE = {c.value[0]: c for c in grpc.StatusCode}


@dataclass
class ServedModel:
    """The model this pool serves; its signatures arrive with the first worker's READY."""

    name: str
    version: int
    signature_defs: bytes = b""
    specs: dict[str, sigs.SignatureSpec] = field(default_factory=dict)

    def learn_signatures(self, model: str, version: int, signature_defs: bytes) -> None:
        if model != self.name or version != self.version or signature_defs == self.signature_defs:
            return
        parsed = serving_pb2.SignatureDefMap.FromString(signature_defs)
        self.specs = sigs.specs_from_signature_defs(parsed.signature_def)
        self.signature_defs = signature_defs

    def check(self, spec: serving_pb2.ModelSpec) -> None:
        """NOT_FOUND unless the request names this model and (if any) this version."""
        choice = spec.WhichOneof("version_choice")
        if spec.name != self.name or (choice == "version" and spec.version.value != self.version):
            wanted = (
                f"Specific({spec.name}, {spec.version.value})"
                if choice == "version"
                else f"Latest({spec.name})"
            )
            raise ServingError(Code.NOT_FOUND, f"Servable not found for request: {wanted}")
        # TF Serving resolves labels from its model config; this pool serves one version,
        # which answers to its own number as a label (perf_analyzer sends -x that way).
        if choice == "version_label" and spec.version_label != str(self.version):
            raise ServingError(
                Code.INVALID_ARGUMENT, f"Unrecognized servable version label: {spec.version_label}"
            )

    def fill_spec(self, out: serving_pb2.ModelSpec, signature_name: str = "") -> None:
        out.name = self.name
        out.version.value = self.version
        if signature_name:
            out.signature_name = signature_name


class TFServingAPI:
    def __init__(
        self, model: ServedModel, dispatcher: Dispatcher, is_ready: Any, metrics: Metrics
    ) -> None:
        self.metrics = metrics
        self.model = model
        self.dispatcher = dispatcher
        self._is_ready = is_ready  # () -> bool: at least one worker routable

    def handlers(self) -> list[grpc.GenericRpcHandler]:
        def unary(fn: Any, request_type: Any, response_type: Any) -> grpc.RpcMethodHandler:
            return grpc.unary_unary_rpc_method_handler(
                fn,
                request_deserializer=request_type.FromString,
                response_serializer=response_type.SerializeToString,
            )

        return [
            grpc.method_handlers_generic_handler(
                PREDICTION_SERVICE,
                {
                    "Predict": unary(
                        self.predict, serving_pb2.PredictRequest, serving_pb2.PredictResponse
                    ),
                    "GetModelMetadata": unary(
                        self.get_model_metadata,
                        serving_pb2.GetModelMetadataRequest,
                        serving_pb2.GetModelMetadataResponse,
                    ),
                },
            ),
            grpc.method_handlers_generic_handler(
                MODEL_SERVICE,
                {
                    "GetModelStatus": unary(
                        self.get_model_status,
                        serving_pb2.GetModelStatusRequest,
                        serving_pb2.GetModelStatusResponse,
                    ),
                },
            ),
        ]

    # -- PredictionService --------------------------------------------------------
    async def predict(
        self, request: serving_pb2.PredictRequest, context: grpc.aio.ServicerContext
    ) -> serving_pb2.PredictResponse:
        with self.metrics.request("Predict") as outcome:
            try:
                return await self._predict(request, context)
            except ServingError as exc:
                outcome[0] = exc.code.name
                await context.abort(_GRPC_CODE[int(exc.code)], exc.message)
                raise  # unreachable: abort raises

    async def _predict(
        self, request: serving_pb2.PredictRequest, context: grpc.aio.ServicerContext
    ) -> serving_pb2.PredictResponse:
        remaining = context.time_remaining()
        deadline = None if remaining is None else time.monotonic() + remaining
        self.model.check(request.model_spec)
        spec = self._signature(request.model_spec.signature_name)
        inputs = {
            alias: codec.tensor_to_array(proto, alias) for alias, proto in request.inputs.items()
        }
        metas, frames = wire.encode_tensors(inputs)
        sigs.check_inputs(spec, {alias: (dt, shape) for alias, dt, shape in metas})
        outputs = sigs.check_output_filter(spec, request.output_filter)
        reply = await self.dispatcher.call(spec.key, metas, frames, outputs, deadline)
        response = serving_pb2.PredictResponse()
        self.model.fill_spec(response.model_spec, spec.key)
        for (name, dt, shape), frame in zip(reply.tensors, reply.frames, strict=True):
            out = response.outputs[name]
            out.dtype = dt
            out.tensor_shape.dim.extend(tensorflow_pb2.TensorShapeProto.Dim(size=d) for d in shape)
            if dt == tensorflow_pb2.DT_STRING:
                out.string_val.extend(wire.string_values(frame.buffer))
            else:
                out.tensor_content = frame.bytes
        return response

    def _signature(self, name: str) -> sigs.SignatureSpec:
        if not self.model.specs:
            raise ServingError(
                Code.UNAVAILABLE,
                f"model {self.model.name} version {self.model.version} is still loading",
            )
        return sigs.select_signature(self.model.specs, name)

    async def get_model_metadata(
        self, request: serving_pb2.GetModelMetadataRequest, context: grpc.aio.ServicerContext
    ) -> serving_pb2.GetModelMetadataResponse:
        with self.metrics.request("GetModelMetadata") as outcome:
            return await self._get_model_metadata(request, context, outcome)

    async def _get_model_metadata(
        self,
        request: serving_pb2.GetModelMetadataRequest,
        context: grpc.aio.ServicerContext,
        outcome: list[str],
    ) -> serving_pb2.GetModelMetadataResponse:
        try:
            self.model.check(request.model_spec)
            if not request.metadata_field:
                raise ServingError(
                    Code.INVALID_ARGUMENT,
                    "GetModelMetadataRequest must specify at least one metadata_field",
                )
            for name in request.metadata_field:
                if name != "signature_def":
                    raise ServingError(
                        Code.INVALID_ARGUMENT, f"Metadata field {name} is not supported"
                    )
            self._signature("")
        except ServingError as exc:
            outcome[0] = exc.code.name
            await context.abort(_GRPC_CODE[int(exc.code)], exc.message)
            raise
        response = serving_pb2.GetModelMetadataResponse()
        self.model.fill_spec(response.model_spec)
        entry = response.metadata["signature_def"]
        entry.type_url = SIGNATURE_DEF_MAP_URL
        entry.value = self.model.signature_defs
        return response

    # -- ModelService -------------------------------------------------------------
    async def get_model_status(
        self, request: serving_pb2.GetModelStatusRequest, context: grpc.aio.ServicerContext
    ) -> serving_pb2.GetModelStatusResponse:
        spec = request.model_spec
        if spec.name != self.model.name:
            await context.abort(
                grpc.StatusCode.NOT_FOUND, f"Could not find any versions of model {spec.name}"
            )
        if (
            spec.WhichOneof("version_choice") == "version"
            and spec.version.value != self.model.version
        ):
            await context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"Could not find version {spec.version.value} of model {spec.name}",
            )
        response = serving_pb2.GetModelStatusResponse()
        status = response.model_version_status.add()
        status.version = self.model.version
        status.state = (
            serving_pb2.ModelVersionStatus.AVAILABLE
            if self._is_ready() and self.model.specs
            else serving_pb2.ModelVersionStatus.LOADING
        )
        status.status.error_code = 0
        return response
