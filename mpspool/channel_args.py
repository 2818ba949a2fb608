"""TF Serving's ``--grpc_channel_arguments``, read into the pool's settings.

TF Serving splits the text at commas and each argument at ``=``, and hands gRPC's server
builder the value as an int32 where it reads as one; gRPC ignores the arguments it does not
know. Here an argument the front door has a setting for sets it (router/src/lifespan.rs), one
it has none for is named in a warning and the pool starts as TF Serving's would, and one that
cannot be read is refused (TF Serving reads past the end of its list on an argument without
``=``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from mpspool.config import ConfigError

FLAG = "--grpc_channel_arguments"

# gRPC's int32 arguments.
_INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class Setting:
    """Where a gRPC argument lands: a PoolConfig field, and what one unit of it is there."""

    field: str
    per_unit: int  # the gRPC value over the field's (1000: milliseconds to seconds)
    what: str  # for messages: "milliseconds", "streams"


SETTINGS: dict[str, Setting] = {
    "grpc.max_connection_age_ms": Setting("max_connection_age_s", 1000, "milliseconds"),
    "grpc.max_connection_age_grace_ms": Setting("max_connection_age_grace_s", 1000, "milliseconds"),
    "grpc.max_connection_idle_ms": Setting("max_connection_idle_s", 1000, "milliseconds"),
    "grpc.keepalive_time_ms": Setting("keepalive_time_s", 1000, "milliseconds"),
    "grpc.keepalive_timeout_ms": Setting("keepalive_timeout_s", 1000, "milliseconds"),
    "grpc.max_concurrent_streams": Setting("max_concurrent_streams", 1, "streams"),
}

# Arguments people pass to TF Serving that have a setting of another name here.
_ELSEWHERE = {
    "grpc.max_receive_message_length": "--max-message-bytes",
    "grpc.max_send_message_length": "--max-message-bytes",
}


def key_for(field: str) -> str:
    """The gRPC argument that sets a PoolConfig field."""
    return next(key for key, setting in SETTINGS.items() if setting.field == field)


def pool_fields(text: str) -> tuple[dict[str, float | int], list[str]]:
    """The PoolConfig fields ``text`` sets, and a warning for each argument without effect
    here. Raises ConfigError for an argument that cannot be read or is given twice."""
    fields: dict[str, float | int] = {}
    warnings: list[str] = []
    seen: set[str] = set()
    for argument in text.split(","):
        if not argument.strip():
            continue
        key, equals, value = (part.strip() for part in argument.partition("="))
        if not equals or not key:
            raise ConfigError(f"{FLAG}: {argument.strip()!r} is not KEY=VALUE")
        if key in seen:
            raise ConfigError(f"{FLAG}: {key} is given twice")
        seen.add(key)
        setting = SETTINGS.get(key)
        if setting is None:
            warnings.append(_without_effect(key))
            continue
        number = _whole(value)
        if number is None or not 1 <= number <= _INT32_MAX:
            raise ConfigError(
                f"{FLAG}: {key} takes a whole number of {setting.what} in "
                f"1..{_INT32_MAX}, got {value!r}"
            )
        fields[setting.field] = number / setting.per_unit if setting.per_unit != 1 else number
    return fields, warnings


def _whole(text: str) -> int | None:
    """An integer as TensorFlow's safe_strto32 reads one: digits after an optional '-' (no '+',
    no underscores; TF Serving would hand gRPC anything else as a string, which gRPC ignores
    for these arguments)."""
    return int(text) if re.fullmatch(r"-?[0-9]+", text) else None


def _without_effect(key: str) -> str:
    elsewhere = _ELSEWHERE.get(key)
    if elsewhere is not None:
        return f"{FLAG}: {key} has no effect here: {elsewhere} sets it"
    return f"{FLAG}: {key} has no effect here (the front door takes {', '.join(SETTINGS)})"
