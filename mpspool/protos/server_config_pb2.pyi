from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
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
