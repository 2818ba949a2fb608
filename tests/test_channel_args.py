"""TF Serving's --grpc_channel_arguments, read into the pool's settings (mpspool/channel_args.py),
and the connection flags beside it. What the front door does with them: router/src/lifespan.rs
(cargo tests) and test_lifecycle.py (a real pool)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from mpspool import channel_args, cli
from mpspool.config import ConfigError, PoolConfig


def test_each_argument_the_front_door_takes_sets_its_field_in_its_units():
    fields, warnings = channel_args.pool_fields(
        "grpc.max_connection_age_ms=300000, grpc.max_connection_age_grace_ms=5000,"
        "grpc.max_connection_idle_ms=1500,grpc.keepalive_time_ms=10000,"
        "grpc.keepalive_timeout_ms=2000,grpc.max_concurrent_streams=64"
    )
    assert fields == {
        "max_connection_age_s": 300.0,
        "max_connection_age_grace_s": 5.0,
        "max_connection_idle_s": 1.5,
        "keepalive_time_s": 10.0,
        "keepalive_timeout_s": 2.0,
        "max_concurrent_streams": 64,
    }
    assert warnings == []
    assert channel_args.pool_fields("") == ({}, [])
    assert channel_args.pool_fields(" , ") == ({}, [])


def test_an_argument_without_a_setting_here_is_named_in_a_warning():
    fields, warnings = channel_args.pool_fields(
        "grpc.http2.max_pings_without_data=0,grpc.max_receive_message_length=1000,"
        "grpc.max_connection_idle_ms=60000"
    )
    assert fields == {"max_connection_idle_s": 60.0}
    assert len(warnings) == 2
    assert "grpc.http2.max_pings_without_data has no effect here" in warnings[0]
    assert "grpc.max_connection_idle_ms" in warnings[0], "says what it takes"
    assert warnings[1] == (
        "--grpc_channel_arguments: grpc.max_receive_message_length has no effect here: "
        "--max-message-bytes sets it"
    )


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("grpc.max_connection_idle_ms", "'grpc.max_connection_idle_ms' is not KEY=VALUE"),
        ("=5", "'=5' is not KEY=VALUE"),
        (
            "grpc.max_connection_idle_ms=1,grpc.max_connection_idle_ms=2",
            "grpc.max_connection_idle_ms is given twice",
        ),
        ("grpc.max_connection_idle_ms=soon", "takes a whole number of milliseconds"),
        ("grpc.max_connection_idle_ms=1.5", "in 1..2147483647, got '1.5'"),
        ("grpc.max_connection_idle_ms=1_000", "got '1_000'"),
        ("grpc.max_connection_idle_ms=+1000", "got '+1000'"),
        ("grpc.max_connection_age_ms=0", "got '0'"),
        ("grpc.keepalive_time_ms=-5", "got '-5'"),
        ("grpc.max_concurrent_streams=2147483648", "whole number of streams in 1..2147483647"),
    ],
)
def test_an_argument_that_cannot_be_read_is_refused_saying_why(text: str, says: str):
    with pytest.raises(ConfigError, match=f"^--grpc_channel_arguments: .*{re.escape(says)}"):
        channel_args.pool_fields(text)


def _connection_fields(*flags: str) -> dict[str, object]:
    args = cli.build_parser().parse_args(["start", "--model-base-path", "/m", *flags])
    return cli._connection_fields(args)


def test_the_flags_and_the_channel_arguments_land_together_but_not_twice():
    assert _connection_fields() == {}
    fields = _connection_fields(
        "--max-connection-age", "300", "--max-connection-idle", "60",
        "--grpc_channel_arguments", "grpc.keepalive_time_ms=20000",
    )  # fmt: skip
    assert fields == {
        "max_connection_age_s": 300.0,
        "max_connection_idle_s": 60.0,
        "keepalive_time_s": 20.0,
    }
    twice = re.escape(
        "--max-connection-idle and grpc.max_connection_idle_ms in --grpc_channel_arguments set "
        "the same thing: give one"
    )
    with pytest.raises(ConfigError, match=twice):
        _connection_fields(
            "--max-connection-idle", "60",
            "--grpc-channel-arguments", "grpc.max_connection_idle_ms=1000",
        )  # fmt: skip


def test_every_setting_is_a_pool_field_the_front_door_reads():
    """The fields the arguments land in are PoolConfig's, saved in pool.json, and named alike
    in the front door's Config (router/src/config.rs), which ignores names it does not know."""
    rust = (Path(__file__).resolve().parents[1] / "router" / "src" / "config.rs").read_text()
    pool_fields = {field.name for field in dataclasses.fields(PoolConfig)}
    for key, setting in channel_args.SETTINGS.items():
        assert setting.field in pool_fields, key
        assert f"pub {setting.field}:" in rust, key
        assert channel_args.key_for(setting.field) == key
