"""TF Serving's model-server flags that mpspool has no setting of its own for.

A TF Serving command line (`tensorflow_model_server --port=8500 --model_name=m ...`) should
start a pool as it is, or say exactly which flag stops it. mpspool takes the flags it
implements under their own names (cli.py); the others, listed here, are taken in both
spellings and are either

- *without use here*: what they tune is done another way in a pool (the front door's
  threads, loading in worker processes); given, they are named in a warning and the pool
  starts, as TF Serving's own gRPC names arguments it does not know and starts; or
- *refused* unless they ask for TF Serving's default: they would change what is served (a
  TensorFlow Lite model, mixed precision, another platform), and serving
  something else quietly is worse than not starting.

TF Serving's flag parser takes `--flag=value` and, for booleans, the bare `--flag` (true);
`--flag value` is taken here too (argparse's way), where TF Serving would read `value` as a
stray argument.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from mpspool.config import ConfigError

_TRUE = ("true", "1", "yes")
_FALSE = ("false", "0", "no")


@dataclass(frozen=True)
class Flag:
    name: str
    kind: str  # "bool", "int", "float" or "str": how a value is compared
    refused: bool
    #: Values (as `_normal` writes them) taken without a word: TF Serving's default where the
    #: flag is refused, or what the pool does anyway.
    quiet: tuple[str, ...]
    why: str


FLAGS: tuple[Flag, ...] = (
    # Without use here.
    Flag("rest_api_num_threads", "int", False, (), "the REST API runs on the front door's "
         "async runtime, whose threads are the cores the workers leave"),
    Flag("grpc_max_threads", "int", False, (), "gRPC runs on the front door's async runtime, "
         "whose threads are the cores the workers leave"),
    Flag("num_load_threads", "int", False, ("0",), "each version loads in worker processes "
         "of its own, in parallel"),
    Flag("num_unload_threads", "int", False, ("0",), "each version unloads by its worker "
         "processes ending"),
    Flag("flush_filesystem_caches", "bool", False, ("true", "false"), ""),
    Flag("remove_unused_fields_from_bundle_metagraph", "bool", False, ("true",),
         "the workers keep no MetaGraphDef after loading"),
    Flag("enable_grpc_healthcheck_service", "bool", False, ("true",),
         "grpc.health.v1 is always served"),
    Flag("enable_profiler", "bool", False, ("false",), "there is no profiler service"),
    Flag("xla_cpu_compilation_enabled", "bool", False, ("false",),
         "mpspool does not change TensorFlow's XLA setting in its workers"),
    Flag("xla_gpu_compilation_enabled", "bool", False, ("false",),
         "mpspool does not change TensorFlow's XLA setting in its workers"),
    Flag("skip_initialize_tpu", "bool", False, ("true", "false"), ""),
    Flag("num_tflite_pools", "int", False, (), "TensorFlow Lite models are not served"),
    Flag("num_tflite_interpreters_per_pool", "int", False, (),
         "TensorFlow Lite models are not served"),
    # Refused unless TF Serving's default.
    Flag("per_process_gpu_memory_fraction", "float", True, ("0",), "workers take GPU memory "
         "as they need it (TF_FORCE_GPU_ALLOW_GROWTH); with MPS, --pinned-mem-limit bounds "
         "each worker's pinned memory"),
    Flag("prefer_tflite_model", "bool", True, ("false",),
         "TensorFlow Lite models are not served"),
    Flag("mixed_precision", "str", True, ("",), "models run in the precision they were saved "
         "in"),
    Flag("platform_config_file", "str", True, ("",),
         "the TensorFlow platform, configured by mpspool's own flags, is the only one"),
    Flag("tensorflow_session_config_file", "str", True, ("",), "the workers' sessions take "
         "their threads from --tensorflow_*_parallelism and no other ConfigProto options"),
    Flag("thread_pool_factory_config_file", "str", True, ("",),
         "the workers' thread pools are TensorFlow's own"),
    Flag("use_alts_credentials", "bool", True, ("false",), "TLS is --ssl_config_file's"),
)  # fmt: skip


#: What `mpspool start --help` says of them (each flag's reason is in its warning or refusal).
HELP = (
    "TF Serving's other model-server flags are taken too: named in a warning when they have no "
    "use in a pool, refused unless they ask for TF Serving's default when they would change "
    "what is served (README: TF Serving compatibility)."
)


def add_to(parser: argparse.ArgumentParser) -> None:
    """Each flag in both spellings, its value kept as text for `check`; not listed one by one
    in --help (HELP says what becomes of them)."""
    for flag in FLAGS:
        extra = {"nargs": "?", "const": "true"} if flag.kind == "bool" else {}
        parser.add_argument(
            f"--{flag.name}",
            f"--{flag.name.replace('_', '-')}",
            dest=_dest(flag),
            metavar="VALUE",
            help=argparse.SUPPRESS,
            **extra,
        )


def check(args: argparse.Namespace) -> list[str]:
    """The warnings for the flags given; ConfigError for the first refused one, or for a
    value its flag cannot take."""
    warnings = []
    for flag in FLAGS:
        value = getattr(args, _dest(flag), None)
        if value is None:
            continue
        normal = _normal(flag, value)
        if normal in flag.quiet:
            continue
        if flag.refused:
            default = flag.quiet[0] or "empty"
            raise ConfigError(
                f"--{flag.name}={value} is not supported: {flag.why} (only TF Serving's "
                f"default, {default}, is taken)"
            )
        warnings.append(f"--{flag.name}={value} has no use here and is ignored: {flag.why}")
    return warnings


def _dest(flag: Flag) -> str:
    return f"tfs_{flag.name}"


def _normal(flag: Flag, value: str) -> str:
    text = value.strip()
    try:
        if flag.kind == "bool":
            if text.lower() in _TRUE:
                return "true"
            if text.lower() in _FALSE:
                return "false"
            raise ValueError(text)
        if flag.kind == "int":
            return str(int(text))
        if flag.kind == "float":
            return f"{float(text):g}"
    except ValueError:
        raise ConfigError(
            f"--{flag.name} takes {'true or false' if flag.kind == 'bool' else 'a number'}, "
            f"got {value!r}"
        ) from None
    return text
