"""TF Serving's command line: its spellings of the flags mpspool implements, its boolean
syntax, and each of its other flags either named in a warning or refused saying why
(mpspool/tfs_flags.py)."""

from __future__ import annotations

import argparse
import subprocess
from pathlib import Path

import pytest

from mpspool import tfs_flags
from mpspool.cli import build_parser
from mpspool.config import ConfigError

from poolproc import mpspool_cmd


def start(*flags: str) -> argparse.Namespace:
    return build_parser().parse_args(["start", *flags])


def test_tf_servings_own_spellings_and_boolean_syntax_are_taken() -> None:
    # The command line of TF Serving's docs and Docker image.
    args = start(
        "--port=8500", "--rest_api_port=8501", "--model_name=wdl", "--model_base_path=/models/wdl",
        "--enable_batching=true", "--enable_signature_method_name_check",
        "--enable_serialization_as_tensor_content=false", "--rest_api_enable_cors_support=1",
    )  # fmt: skip
    assert (args.port, args.rest_api_port) == (8500, 8501)
    assert (args.model_name, args.model_base_path) == ("wdl", "/models/wdl")
    assert args.batching and args.signature_method_name_check
    assert not args.serialize_as_tensor_content and args.rest_api_enable_cors_support
    assert not start("--demo", "--enable_batching=false").batching
    assert start("--demo", "--enable-batching").batching  # mpspool's spelling, bare
    assert not start("--demo").batching
    assert start("--demo", "--allow_version_labels_for_unavailable_models").labels_for_unavailable
    # A REST deadline only above 0, as TF Serving's HttpRestApiHandler sets one.
    assert start("--demo", "--rest_api_timeout_in_ms=-1").rest_api_timeout_in_ms == 0
    assert start("--demo", "--rest_api_timeout_in_ms", "250").rest_api_timeout_in_ms == 250
    with pytest.raises(SystemExit):
        start("--demo", "--enable_batching=maybe")


def test_flags_without_use_here_are_named_with_why_and_defaults_pass_quietly() -> None:
    args = start(
        "--demo", "--rest_api_num_threads=16", "--grpc_max_threads", "8",
        "--enable_grpc_healthcheck_service", "--flush_filesystem_caches=false",
        "--num_load_threads=0", "--per_process_gpu_memory_fraction=0.0",
        "--prefer-tflite-model=false", "--mixed_precision=",
    )  # fmt: skip
    warnings = tfs_flags.check(args)
    assert len(warnings) == 2, warnings
    assert warnings[0].startswith("--rest_api_num_threads=16 has no use here and is ignored: ")
    assert "front door's async runtime" in warnings[0]
    assert warnings[1].startswith("--grpc_max_threads=8 has no use here")
    assert tfs_flags.check(start("--demo")) == []
    # TF Serving's default passes without a word.
    assert tfs_flags.check(start("--demo", "--remove_unused_fields_from_bundle_metagraph")) == []
    (said,) = tfs_flags.check(start("--demo", "--remove_unused_fields_from_bundle_metagraph=0"))
    assert said.endswith("the workers keep no MetaGraphDef after loading")
    # Health is served even when asked not to be; a profiler is not, even when asked.
    said = tfs_flags.check(start("--demo", "--enable_grpc_healthcheck_service=false"))
    assert said == [
        "--enable_grpc_healthcheck_service=false has no use here and is ignored: "
        "grpc.health.v1 is always served"
    ]
    assert tfs_flags.check(start("--demo", "--enable_profiler=false")) == []
    (said,) = tfs_flags.check(start("--demo", "--enable_profiler"))
    assert said.endswith("there is no profiler service")


@pytest.mark.parametrize(
    ("flag", "says"),
    [
        ("--per_process_gpu_memory_fraction=0.5", "TF_FORCE_GPU_ALLOW_GROWTH"),
        ("--prefer_tflite_model", "TensorFlow Lite models are not served"),
        ("--mixed_precision=bfloat16", "in the precision they were saved in"),
        ("--platform_config_file=/p.txt", "the only one"),
    ],
)
def test_flags_that_would_change_what_is_served_are_refused_unless_default(
    flag: str, says: str
) -> None:
    with pytest.raises(ConfigError, match="is not supported: ") as info:
        tfs_flags.check(start("--demo", flag))
    assert says in str(info.value)
    assert "only TF Serving's default" in str(info.value)


def test_max_num_load_retries_is_start_retries_under_tf_servings_name() -> None:
    from mpspool.cli import _start_retries

    assert _start_retries(start("--demo")) == 3
    assert _start_retries(start("--demo", "--max_num_load_retries=0")) == 0
    assert _start_retries(start("--demo", "--start-retries", "5")) == 5
    with pytest.raises(ConfigError, match="set the same thing: give one"):
        _start_retries(start("--demo", "--start-retries=1", "--max_num_load_retries=1"))
    with pytest.raises(ConfigError, match="must be >= 0, got -1"):
        _start_retries(start("--demo", "--max-num-load-retries", "-1"))


def test_a_value_a_flag_cannot_take_is_refused() -> None:
    with pytest.raises(ConfigError, match="--num_load_threads takes a number, got 'many'"):
        tfs_flags.check(start("--demo", "--num_load_threads=many"))
    with pytest.raises(ConfigError, match="--enable_profiler takes true or false"):
        tfs_flags.check(start("--demo", "--enable_profiler=on"))


def test_every_flag_is_taken_in_both_spellings_and_none_shadows_one_of_mpspools() -> None:
    parser = build_parser()
    ours = {
        option
        for action in parser._subparsers._group_actions[0].choices["start"]._actions  # type: ignore[union-attr]
        if not action.dest.startswith("tfs_")
        for option in action.option_strings
    }
    for flag in tfs_flags.FLAGS:
        assert f"--{flag.name}" not in ours and f"--{flag.name.replace('_', '-')}" not in ours
        dashed = start("--demo", f"--{flag.name.replace('_', '-')}=1")
        assert getattr(dashed, f"tfs_{flag.name}") == "1"
        # A refused flag's quiet value is TF Serving's default: taken without a word.
        if flag.refused:
            default = start("--demo", f"--{flag.name}={flag.quiet[0]}")
            assert tfs_flags.check(default) == []


def test_the_cli_refuses_before_starting_anything(tmp_path: Path, demo_model_dir: Path) -> None:
    run_dir = tmp_path / "run"
    done = subprocess.run(
        mpspool_cmd("start", f"--model_base_path={demo_model_dir}", "--model_name=demo",
                    "--run-dir", str(run_dir), "--prefer_tflite_model=true"),
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("mpspool: --prefer_tflite_model=true is not supported: ")
    assert not run_dir.exists()
