from mpspool.protos import serving_pb2 as _serving_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ExampleList(_message.Message):
    __slots__ = ("examples",)
    EXAMPLES_FIELD_NUMBER: _ClassVar[int]
    examples: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, examples: _Optional[_Iterable[bytes]] = ...) -> None: ...

class ExampleListWithContext(_message.Message):
    __slots__ = ("examples", "context")
    EXAMPLES_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_FIELD_NUMBER: _ClassVar[int]
    examples: _containers.RepeatedScalarFieldContainer[bytes]
    context: bytes
    def __init__(self, examples: _Optional[_Iterable[bytes]] = ..., context: _Optional[bytes] = ...) -> None: ...

class Input(_message.Message):
    __slots__ = ("example_list", "example_list_with_context")
    EXAMPLE_LIST_FIELD_NUMBER: _ClassVar[int]
    EXAMPLE_LIST_WITH_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    example_list: ExampleList
    example_list_with_context: ExampleListWithContext
    def __init__(self, example_list: _Optional[_Union[ExampleList, _Mapping]] = ..., example_list_with_context: _Optional[_Union[ExampleListWithContext, _Mapping]] = ...) -> None: ...

class ClassificationRequest(_message.Message):
    __slots__ = ("model_spec", "input")
    MODEL_SPEC_FIELD_NUMBER: _ClassVar[int]
    INPUT_FIELD_NUMBER: _ClassVar[int]
    model_spec: _serving_pb2.ModelSpec
    input: Input
    def __init__(self, model_spec: _Optional[_Union[_serving_pb2.ModelSpec, _Mapping]] = ..., input: _Optional[_Union[Input, _Mapping]] = ...) -> None: ...

class RegressionRequest(_message.Message):
    __slots__ = ("model_spec", "input")
    MODEL_SPEC_FIELD_NUMBER: _ClassVar[int]
    INPUT_FIELD_NUMBER: _ClassVar[int]
    model_spec: _serving_pb2.ModelSpec
    input: Input
    def __init__(self, model_spec: _Optional[_Union[_serving_pb2.ModelSpec, _Mapping]] = ..., input: _Optional[_Union[Input, _Mapping]] = ...) -> None: ...

class InferenceTask(_message.Message):
    __slots__ = ("model_spec", "method_name")
    MODEL_SPEC_FIELD_NUMBER: _ClassVar[int]
    METHOD_NAME_FIELD_NUMBER: _ClassVar[int]
    model_spec: _serving_pb2.ModelSpec
    method_name: str
    def __init__(self, model_spec: _Optional[_Union[_serving_pb2.ModelSpec, _Mapping]] = ..., method_name: _Optional[str] = ...) -> None: ...

class MultiInferenceRequest(_message.Message):
    __slots__ = ("tasks", "input")
    TASKS_FIELD_NUMBER: _ClassVar[int]
    INPUT_FIELD_NUMBER: _ClassVar[int]
    tasks: _containers.RepeatedCompositeFieldContainer[InferenceTask]
    input: Input
    def __init__(self, tasks: _Optional[_Iterable[_Union[InferenceTask, _Mapping]]] = ..., input: _Optional[_Union[Input, _Mapping]] = ...) -> None: ...

class ClassifyLog(_message.Message):
    __slots__ = ("request",)
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    request: ClassificationRequest
    def __init__(self, request: _Optional[_Union[ClassificationRequest, _Mapping]] = ...) -> None: ...

class RegressLog(_message.Message):
    __slots__ = ("request",)
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    request: RegressionRequest
    def __init__(self, request: _Optional[_Union[RegressionRequest, _Mapping]] = ...) -> None: ...

class PredictLog(_message.Message):
    __slots__ = ("request",)
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    request: _serving_pb2.PredictRequest
    def __init__(self, request: _Optional[_Union[_serving_pb2.PredictRequest, _Mapping]] = ...) -> None: ...

class MultiInferenceLog(_message.Message):
    __slots__ = ("request",)
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    request: MultiInferenceRequest
    def __init__(self, request: _Optional[_Union[MultiInferenceRequest, _Mapping]] = ...) -> None: ...

class SessionRunLog(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PredictionLog(_message.Message):
    __slots__ = ("classify_log", "regress_log", "predict_log", "multi_inference_log", "session_run_log")
    CLASSIFY_LOG_FIELD_NUMBER: _ClassVar[int]
    REGRESS_LOG_FIELD_NUMBER: _ClassVar[int]
    PREDICT_LOG_FIELD_NUMBER: _ClassVar[int]
    MULTI_INFERENCE_LOG_FIELD_NUMBER: _ClassVar[int]
    SESSION_RUN_LOG_FIELD_NUMBER: _ClassVar[int]
    classify_log: ClassifyLog
    regress_log: RegressLog
    predict_log: PredictLog
    multi_inference_log: MultiInferenceLog
    session_run_log: SessionRunLog
    def __init__(self, classify_log: _Optional[_Union[ClassifyLog, _Mapping]] = ..., regress_log: _Optional[_Union[RegressLog, _Mapping]] = ..., predict_log: _Optional[_Union[PredictLog, _Mapping]] = ..., multi_inference_log: _Optional[_Union[MultiInferenceLog, _Mapping]] = ..., session_run_log: _Optional[_Union[SessionRunLog, _Mapping]] = ...) -> None: ...
