from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ModelType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MODEL_TYPE_UNSPECIFIED: _ClassVar[ModelType]
    TENSORFLOW: _ClassVar[ModelType]
    OTHER: _ClassVar[ModelType]
MODEL_TYPE_UNSPECIFIED: ModelType
TENSORFLOW: ModelType
OTHER: ModelType

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

class BoolValue(_message.Message):
    __slots__ = ("value",)
    VALUE_FIELD_NUMBER: _ClassVar[int]
    value: bool
    def __init__(self, value: _Optional[bool] = ...) -> None: ...

class StringValue(_message.Message):
    __slots__ = ("value",)
    VALUE_FIELD_NUMBER: _ClassVar[int]
    value: str
    def __init__(self, value: _Optional[str] = ...) -> None: ...

class BatchingParameters(_message.Message):
    __slots__ = ("max_batch_size", "batch_timeout_micros", "max_enqueued_batches", "num_batch_threads", "thread_pool_name", "enable_large_batch_splitting", "max_execution_batch_size", "allowed_batch_sizes", "pad_variable_length_inputs")
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    BATCH_TIMEOUT_MICROS_FIELD_NUMBER: _ClassVar[int]
    MAX_ENQUEUED_BATCHES_FIELD_NUMBER: _ClassVar[int]
    NUM_BATCH_THREADS_FIELD_NUMBER: _ClassVar[int]
    THREAD_POOL_NAME_FIELD_NUMBER: _ClassVar[int]
    ENABLE_LARGE_BATCH_SPLITTING_FIELD_NUMBER: _ClassVar[int]
    MAX_EXECUTION_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_BATCH_SIZES_FIELD_NUMBER: _ClassVar[int]
    PAD_VARIABLE_LENGTH_INPUTS_FIELD_NUMBER: _ClassVar[int]
    max_batch_size: Int64Value
    batch_timeout_micros: Int64Value
    max_enqueued_batches: Int64Value
    num_batch_threads: Int64Value
    thread_pool_name: StringValue
    enable_large_batch_splitting: BoolValue
    max_execution_batch_size: Int64Value
    allowed_batch_sizes: _containers.RepeatedScalarFieldContainer[int]
    pad_variable_length_inputs: bool
    def __init__(self, max_batch_size: _Optional[_Union[Int64Value, _Mapping]] = ..., batch_timeout_micros: _Optional[_Union[Int64Value, _Mapping]] = ..., max_enqueued_batches: _Optional[_Union[Int64Value, _Mapping]] = ..., num_batch_threads: _Optional[_Union[Int64Value, _Mapping]] = ..., thread_pool_name: _Optional[_Union[StringValue, _Mapping]] = ..., enable_large_batch_splitting: _Optional[_Union[BoolValue, _Mapping]] = ..., max_execution_batch_size: _Optional[_Union[Int64Value, _Mapping]] = ..., allowed_batch_sizes: _Optional[_Iterable[int]] = ..., pad_variable_length_inputs: _Optional[bool] = ...) -> None: ...

class ModelServerConfig(_message.Message):
    __slots__ = ("model_config_list",)
    MODEL_CONFIG_LIST_FIELD_NUMBER: _ClassVar[int]
    model_config_list: ModelConfigList
    def __init__(self, model_config_list: _Optional[_Union[ModelConfigList, _Mapping]] = ...) -> None: ...

class ModelConfigList(_message.Message):
    __slots__ = ("config",)
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    config: _containers.RepeatedCompositeFieldContainer[ModelConfig]
    def __init__(self, config: _Optional[_Iterable[_Union[ModelConfig, _Mapping]]] = ...) -> None: ...

class ModelConfig(_message.Message):
    __slots__ = ("name", "base_path", "model_type", "model_platform", "model_version_policy", "version_labels", "logging_config")
    class VersionLabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    BASE_PATH_FIELD_NUMBER: _ClassVar[int]
    MODEL_TYPE_FIELD_NUMBER: _ClassVar[int]
    MODEL_PLATFORM_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_POLICY_FIELD_NUMBER: _ClassVar[int]
    VERSION_LABELS_FIELD_NUMBER: _ClassVar[int]
    LOGGING_CONFIG_FIELD_NUMBER: _ClassVar[int]
    name: str
    base_path: str
    model_type: ModelType
    model_platform: str
    model_version_policy: ServableVersionPolicy
    version_labels: _containers.ScalarMap[str, int]
    logging_config: LoggingConfig
    def __init__(self, name: _Optional[str] = ..., base_path: _Optional[str] = ..., model_type: _Optional[_Union[ModelType, str]] = ..., model_platform: _Optional[str] = ..., model_version_policy: _Optional[_Union[ServableVersionPolicy, _Mapping]] = ..., version_labels: _Optional[_Mapping[str, int]] = ..., logging_config: _Optional[_Union[LoggingConfig, _Mapping]] = ...) -> None: ...

class ServableVersionPolicy(_message.Message):
    __slots__ = ("latest", "all", "specific")
    class Latest(_message.Message):
        __slots__ = ("num_versions",)
        NUM_VERSIONS_FIELD_NUMBER: _ClassVar[int]
        num_versions: int
        def __init__(self, num_versions: _Optional[int] = ...) -> None: ...
    class All(_message.Message):
        __slots__ = ()
        def __init__(self) -> None: ...
    class Specific(_message.Message):
        __slots__ = ("versions",)
        VERSIONS_FIELD_NUMBER: _ClassVar[int]
        versions: _containers.RepeatedScalarFieldContainer[int]
        def __init__(self, versions: _Optional[_Iterable[int]] = ...) -> None: ...
    LATEST_FIELD_NUMBER: _ClassVar[int]
    ALL_FIELD_NUMBER: _ClassVar[int]
    SPECIFIC_FIELD_NUMBER: _ClassVar[int]
    latest: ServableVersionPolicy.Latest
    all: ServableVersionPolicy.All
    specific: ServableVersionPolicy.Specific
    def __init__(self, latest: _Optional[_Union[ServableVersionPolicy.Latest, _Mapping]] = ..., all: _Optional[_Union[ServableVersionPolicy.All, _Mapping]] = ..., specific: _Optional[_Union[ServableVersionPolicy.Specific, _Mapping]] = ...) -> None: ...

class LoggingConfig(_message.Message):
    __slots__ = ("log_collector_config", "sampling_config")
    LOG_COLLECTOR_CONFIG_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_CONFIG_FIELD_NUMBER: _ClassVar[int]
    log_collector_config: LogCollectorConfig
    sampling_config: SamplingConfig
    def __init__(self, log_collector_config: _Optional[_Union[LogCollectorConfig, _Mapping]] = ..., sampling_config: _Optional[_Union[SamplingConfig, _Mapping]] = ...) -> None: ...

class LogCollectorConfig(_message.Message):
    __slots__ = ("type", "filename_prefix")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    FILENAME_PREFIX_FIELD_NUMBER: _ClassVar[int]
    type: str
    filename_prefix: str
    def __init__(self, type: _Optional[str] = ..., filename_prefix: _Optional[str] = ...) -> None: ...

class SamplingConfig(_message.Message):
    __slots__ = ("sampling_rate", "attributes")
    SAMPLING_RATE_FIELD_NUMBER: _ClassVar[int]
    ATTRIBUTES_FIELD_NUMBER: _ClassVar[int]
    sampling_rate: float
    attributes: int
    def __init__(self, sampling_rate: _Optional[float] = ..., attributes: _Optional[int] = ...) -> None: ...
