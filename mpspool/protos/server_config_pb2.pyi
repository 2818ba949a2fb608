from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrometheusConfig(_message.Message):
    __slots__ = ("enable", "path")
    ENABLE_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    enable: bool
    path: str
    def __init__(self, enable: _Optional[bool] = ..., path: _Optional[str] = ...) -> None: ...

class MonitoringConfig(_message.Message):
    __slots__ = ("prometheus_config",)
    PROMETHEUS_CONFIG_FIELD_NUMBER: _ClassVar[int]
    prometheus_config: PrometheusConfig
    def __init__(self, prometheus_config: _Optional[_Union[PrometheusConfig, _Mapping]] = ...) -> None: ...

class SSLConfig(_message.Message):
    __slots__ = ("server_key", "server_cert", "custom_ca", "client_verify")
    SERVER_KEY_FIELD_NUMBER: _ClassVar[int]
    SERVER_CERT_FIELD_NUMBER: _ClassVar[int]
    CUSTOM_CA_FIELD_NUMBER: _ClassVar[int]
    CLIENT_VERIFY_FIELD_NUMBER: _ClassVar[int]
    server_key: str
    server_cert: str
    custom_ca: str
    client_verify: bool
    def __init__(self, server_key: _Optional[str] = ..., server_cert: _Optional[str] = ..., custom_ca: _Optional[str] = ..., client_verify: _Optional[bool] = ...) -> None: ...

class Int64Value(_message.Message):
    __slots__ = ("value",)
    VALUE_FIELD_NUMBER: _ClassVar[int]
    value: int
    def __init__(self, value: _Optional[int] = ...) -> None: ...

class StringValue(_message.Message):
    __slots__ = ("value",)
    VALUE_FIELD_NUMBER: _ClassVar[int]
    value: str
    def __init__(self, value: _Optional[str] = ...) -> None: ...

class BatchingParameters(_message.Message):
    __slots__ = ("max_batch_size", "batch_timeout_micros", "max_enqueued_batches", "num_batch_threads", "thread_pool_name", "allowed_batch_sizes", "pad_variable_length_inputs")
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    BATCH_TIMEOUT_MICROS_FIELD_NUMBER: _ClassVar[int]
    MAX_ENQUEUED_BATCHES_FIELD_NUMBER: _ClassVar[int]
    NUM_BATCH_THREADS_FIELD_NUMBER: _ClassVar[int]
    THREAD_POOL_NAME_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_BATCH_SIZES_FIELD_NUMBER: _ClassVar[int]
    PAD_VARIABLE_LENGTH_INPUTS_FIELD_NUMBER: _ClassVar[int]
    max_batch_size: Int64Value
    batch_timeout_micros: Int64Value
    max_enqueued_batches: Int64Value
    num_batch_threads: Int64Value
    thread_pool_name: StringValue
    allowed_batch_sizes: _containers.RepeatedScalarFieldContainer[int]
    pad_variable_length_inputs: bool
    def __init__(self, max_batch_size: _Optional[_Union[Int64Value, _Mapping]] = ..., batch_timeout_micros: _Optional[_Union[Int64Value, _Mapping]] = ..., max_enqueued_batches: _Optional[_Union[Int64Value, _Mapping]] = ..., num_batch_threads: _Optional[_Union[Int64Value, _Mapping]] = ..., thread_pool_name: _Optional[_Union[StringValue, _Mapping]] = ..., allowed_batch_sizes: _Optional[_Iterable[int]] = ..., pad_variable_length_inputs: _Optional[bool] = ...) -> None: ...
