"""The one validated configuration object every process of a pool reads.

`mpspool start` builds it from CLI flags (and, later, a config file and the environment
variables of the seed documents), validates it once, and writes it to ``pool.json`` in the
run directory; the router and the workers read that file instead of re-parsing flags.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import math
import os
import re
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mpspool import process

if TYPE_CHECKING:
    from mpspool.cpusets import Placement

log = logging.getLogger("mpspool.config")

POOL_FILE = "pool.json"


class ConfigError(ValueError):
    """A configuration a pool cannot start with; the message says what to change."""


def default_run_dir() -> Path:
    """A per-user private directory: $XDG_RUNTIME_DIR/mpspool, else /tmp/mpspool-<uid>."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return Path(runtime) / "mpspool"
    return Path(f"/tmp/mpspool-{os.getuid()}")


def default_log_dir() -> Path:
    # Logs live outside the run directory so that they survive the pool's clean exit,
    # which removes every file it made there.
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "mpspool" / "logs"


def default_cache_dir() -> Path:
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "mpspool"


DEFAULT_PROMETHEUS_PATH = "/monitoring/prometheus/metrics"  # TF Serving's kPrometheusPath


def read_text_proto(path: Path, flag: str, message: Any, article: str) -> Any:
    """``message`` filled from a TF Serving configuration file in protobuf text format;
    ConfigError (one line) when it cannot be read or is not that message."""
    from google.protobuf import text_format

    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read {flag} {path}: {exc}") from None
    # Bytes that are not UTF-8 are kept as they are (surrogateescape), not an error: TF
    # Serving's C++ parser takes a comment saved in Latin-1 by an old editor; in a string
    # field they stop the parse, with its line and column. Before, a UnicodeDecodeError ended
    # the pool when such a file was read again while serving (found by an operator's hunt).
    text = data.decode("utf-8", "surrogateescape")
    try:
        return text_format.Parse(text, message)
    except text_format.ParseError as exc:
        name = type(message).__name__
        said = str(exc).encode("utf-8", "backslashreplace").decode()  # no lone surrogate
        raise ConfigError(f"{path} is not {article} {name}: {said}") from None


def prometheus_path_from(monitoring_config: Path) -> str:
    """The Prometheus path a TF Serving monitoring config file (text format,
    ``prometheus_config { enable: true path: "..." }``) turns on; "" when it does not."""
    from mpspool.protos import server_config_pb2

    config = read_text_proto(
        monitoring_config, "--monitoring_config_file", server_config_pb2.MonitoringConfig(), "a"
    )
    if not config.prometheus_config.enable:
        return ""
    return config.prometheus_config.path or DEFAULT_PROMETHEUS_PATH


# A PEM block of a certificate, and of a private key (PKCS#8, or a traditional RSA or EC one).
_PEM_CERTIFICATE = re.compile(
    r"-----BEGIN CERTIFICATE-----[A-Za-z0-9+/=\s]+-----END CERTIFICATE-----"
)
_PEM_KEY = re.compile(r"-----BEGIN (?:RSA |EC )?PRIVATE KEY-----[A-Za-z0-9+/=\s]+-----END")


def tls_from(ssl_config: Path) -> dict[str, Any]:
    """TF Serving's SSLConfig file (text format) as the front door's TLS settings, checked
    for what TF Serving requires: a key and a certificate, and a CA to verify clients with."""
    from mpspool.protos import server_config_pb2

    config = read_text_proto(ssl_config, "--ssl_config_file", server_config_pb2.SSLConfig(), "an")
    if not config.server_key or not config.server_cert:
        raise ConfigError(f"{ssl_config}: server_key and server_cert are required (PEM text)")
    if config.client_verify and not config.custom_ca:
        raise ConfigError(
            f"{ssl_config}: client_verify needs custom_ca, the CA that signs client certificates"
        )
    # What the front door refuses too (router/src/tls.rs), refused here before anything
    # starts: found there, a pool spawned its processes, drained and exited 1, not 2 with one
    # line (found by a hunt).
    if "ENCRYPTED" in config.server_key:
        raise ConfigError(
            f"{ssl_config}: server_key is encrypted: give it unencrypted (no passphrase), as "
            "TF Serving's gRPC takes it"
        )
    if not _PEM_KEY.search(config.server_key):
        raise ConfigError(f"{ssl_config}: server_key: no PEM private key in it")
    for field in ("server_cert", "custom_ca"):
        text = getattr(config, field)
        if text and not _PEM_CERTIFICATE.search(text):
            raise ConfigError(f"{ssl_config}: {field}: no PEM certificate in it")
    return {
        "server_key": config.server_key,
        "server_cert": config.server_cert,
        "custom_ca": config.custom_ca,
        "client_verify": config.client_verify,
    }


# TF Serving's default max_batch_size (SharedBatchScheduler's input_batch_size_limit) and
# max_enqueued_batches (BasicBatchScheduler's).
MAX_BATCH_SIZE = 1000
MAX_ENQUEUED_BATCHES = 10

# The front door's policies (router/src/policies/mod.rs: CHOOSERS, ORDERS).
DISPATCH_POLICIES = ("round-robin", "least-loaded", "power-of-two", "packed")
QUEUE_ORDERS = ("fcfs", "sjf")


def check_num_batch_threads(path: Path, params: Any) -> None:
    """The server-level file's batch threads: TF Serving's server does not start on fewer
    than one (SharedBatchScheduler::Create's words). A version's own file's are never read
    there, so not here either."""
    if params.HasField("num_batch_threads") and params.num_batch_threads.value < 1:
        raise ConfigError(
            f"{path}: num_batch_threads must be positive; was {params.num_batch_threads.value}"
        )


def batching_parameters_from(
    path: Path, flag: str = "--batching_parameters_file", server_level: bool = True
) -> dict[str, Any]:
    """TF Serving's BatchingParameters file (text format) as PoolConfig fields; what has no
    meaning here is refused (pad_variable_length_inputs) or logged (num_batch_threads)."""
    from mpspool.protos import server_config_pb2

    params = read_text_proto(path, flag, server_config_pb2.BatchingParameters(), "a")
    if params.pad_variable_length_inputs:
        raise ConfigError(
            f"{path}: pad_variable_length_inputs is not supported: requests merge only when "
            "their inputs agree on every dimension but the first"
        )
    if server_level:
        check_num_batch_threads(path, params)
    if params.HasField("num_batch_threads"):
        log.info(
            "%s: num_batch_threads %d has no use here: each worker runs one merged call at a "
            "time, so the pool runs as many at once as it has workers (--worker-inflight)",
            path, params.num_batch_threads.value,
        )  # fmt: skip
    fields: dict[str, Any] = {"allowed_batch_sizes": tuple(params.allowed_batch_sizes)}
    for name in ("max_batch_size", "batch_timeout_micros", "max_enqueued_batches"):
        if params.HasField(name):
            fields[name] = getattr(params, name).value
    if params.enable_large_batch_splitting.value:
        fields.update(_large_batch_splitting(path, params))
    elif params.HasField("max_execution_batch_size"):
        log.info(
            "%s: max_execution_batch_size has no use without enable_large_batch_splitting "
            "(as in TF Serving)",
            path,
        )
    return fields


def _large_batch_splitting(path: Path, params: Any) -> dict[str, Any]:
    """TF Serving's enable_large_batch_splitting: max_batch_size bounds a request's rows and
    max_execution_batch_size (default max_batch_size) a batch's; a request with more rows
    than a batch takes is cut into pieces that go into separate batches. Here that is
    --split-rows at max_execution_batch_size (the pieces run on several workers at once,
    each merging with other requests as any request does) and merged calls of at most that
    many rows, or of the allowed batch size TF Serving would pad such a batch to. A request
    over max_batch_size is cut too, where TF Serving refuses it."""
    # Unset, TF Serving's own default (its scheduler's input_batch_size_limit), where TF
    # Serving would take the execution size from an unset field (0).
    limit = params.max_batch_size.value if params.HasField("max_batch_size") else MAX_BATCH_SIZE
    execution = (
        params.max_execution_batch_size.value
        if params.HasField("max_execution_batch_size")
        else limit
    )
    if not 1 <= execution <= limit:
        raise ConfigError(
            f"{path}: with enable_large_batch_splitting, max_execution_batch_size must be "
            f"between 1 and max_batch_size {limit}, got {execution}"
        )
    sizes = list(params.allowed_batch_sizes)
    if sizes and sizes[-1] != limit:
        # TF Serving's server checks this with splitting too, in its words
        # (bundle_factory_util.cc, WrapSessionForBatching).
        raise ConfigError(
            f"{path}: Last entry in allowed_batch_sizes must match max_batch_size; last "
            f"entry was {sizes[-1]}; expected {limit}"
        )
    # A batch of up to `execution` rows is padded to the first allowed size that holds it, so
    # that size bounds a call as it bounds one in TF Serving.
    call = next((size for size in sizes if size >= execution), execution)
    return {
        "max_batch_size": call,
        "split_rows": execution,
        "allowed_batch_sizes": tuple(size for size in sizes if size <= call),
    }


# A model version's own batching parameters, beside its SavedModel, read with
# --enable_per_model_batching_parameters (TF Serving's kBatchingParamsFilename).
VERSION_BATCHING_FILE = "batching_params.pbtxt"


def _is_file(path: Path) -> bool:
    """Path.is_file, with a file that cannot be looked at (EACCES, EIO: Path.is_file raises
    them) a ConfigError saying so: a pool started on a version folder it may not enter
    failed with a traceback (found by a review)."""
    try:
        return path.is_file()
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror or exc}") from None


def version_batching(version_dir: Path) -> dict[str, Any] | None:
    """--enable_per_model_batching_parameters: how a model version is batched, from the
    BatchingParameters file in its directory, as every field the front door takes (the
    version table carries it: router/src/versions.rs); None without the file, and then the
    version is not batched, as in TF Serving (GetPerModelBatchingParams). ConfigError when
    the file cannot be read or breaks TF Serving's rules: the version does not load."""
    path = version_dir / VERSION_BATCHING_FILE
    try:
        if not path.is_file():
            return None
    except PermissionError:
        # A directory that cannot be looked into: no such file, as TF Serving's FileExists
        # answers; its load then fails saying why, with its retries (it ended at once,
        # INVALID_ARGUMENT, as a file breaking the rules does; found by a review).
        return None
    fields: dict[str, Any] = {
        "max_batch_size": MAX_BATCH_SIZE,
        "batch_timeout_micros": 0,
        "allowed_batch_sizes": (),
        "max_enqueued_batches": MAX_ENQUEUED_BATCHES,
        "split_rows": 0,
    }
    fields.update(
        batching_parameters_from(path, "the version's batching parameters", server_level=False)
    )
    try:
        check_batching(
            fields["max_batch_size"],
            fields["max_enqueued_batches"],
            fields["batch_timeout_micros"],
            fields["allowed_batch_sizes"],
        )
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    fields["allowed_batch_sizes"] = list(fields["allowed_batch_sizes"])
    return fields


def check_batching(
    max_batch_size: int,
    max_enqueued_batches: int,
    batch_timeout_micros: int,
    allowed_batch_sizes: tuple[int, ...],
) -> None:
    """TF Serving's rules for its batching parameters, in its words where it has a message
    (batching_session.cc, bundle_factory_util.cc); the front door checks them again
    (router/src/batch.rs, Batching::check)."""
    if max_batch_size < 1:
        raise ConfigError(f"max_batch_size must be at least 1, got {max_batch_size}")
    if max_enqueued_batches < 1:
        raise ConfigError(f"max_enqueued_batches must be at least 1, got {max_enqueued_batches}")
    if batch_timeout_micros < 0:
        raise ConfigError(f"batch_timeout_micros must be >= 0, got {batch_timeout_micros}")
    sizes = list(allowed_batch_sizes)
    if sizes:
        if sizes[0] < 1 or any(a >= b for a, b in itertools.pairwise(sizes)):
            raise ConfigError(
                "allowed_batch_sizes entries must be monotonically increasing (and positive), "
                f"got {sizes}"
            )
        if sizes[-1] != max_batch_size:
            # TF Serving's words (bundle_factory_util.cc, WrapSessionForBatching): a version's
            # status shows them with per-model batching.
            raise ConfigError(
                "Last entry in allowed_batch_sizes must match max_batch_size; last entry was "
                f"{sizes[-1]}; expected {max_batch_size}"
            )


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        return os.cpu_count() or 1


def _usable_cpus() -> tuple[int, ...]:
    return tuple(sorted(os.sched_getaffinity(0)))


# A model name that is also safe in supervisord program and group names, log file names and
# shared-memory segment names (every model of a pool that serves several has its own).
MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
MODEL_NAME_RULE = (
    "a pool of several models needs names of letters, digits, '_', '.' and '-' that begin "
    "with a letter or digit (they name its processes and files)"
)
# A model's name is part of file names (its weight segment, /dev/shm/mpspool-<pool>-<name>-v<N>
# and its ".partial"; its publisher's log; its workers' supervisord programs and logs), which
# Linux caps at 255 bytes: with room for the rest of each, a name is at most this long.
MAX_MODEL_NAME_BYTES = 128
# The longest time any setting may name: 2**31 - 1 s (about 68 years), TF Serving's own
# bound where its flags are int32 seconds (the common "never" of its poll waits), "for ever"
# in practice, and far from where the front door's clock arithmetic (an Instant plus 2**64
# s) overflows.
MAX_SECONDS = 2**31 - 1


def check_utf8(what: str, value: str) -> None:
    """Refuse a name or path that is not UTF-8 text (os.fsdecode's surrogates for its other
    bytes): the pool's messages, pool.json and its admin replies carry it as text, and one
    such base path served until the first `mpspool status` took the pool down."""
    try:
        value.encode()
    except UnicodeEncodeError:
        raise ConfigError(
            f"{what} {os.fsencode(value).decode(errors='backslashreplace')} is not UTF-8 text; "
            "rename it"
        ) from None


def check_model_name_length(name: str) -> None:
    check_utf8("model name", name)
    size = len(name.encode())
    if size > MAX_MODEL_NAME_BYTES:
        shown = name if len(name) <= 40 else name[:40] + "..."
        raise ConfigError(
            f"model name {shown!r} is {size} bytes long, more than {MAX_MODEL_NAME_BYTES} "
            "(it names the pool's files and processes)"
        )


@dataclass(frozen=True)
class ServedModel:
    """One model of a pool that serves several: its name, where its versions are, the
    version it starts with, its policy and labels, and its share of the pool's workers."""

    name: str
    base_path: str
    version: int
    version_policy: str = "latest:1"
    version_labels: dict[str, int] = dataclasses.field(default_factory=dict)
    # Its worker processes (CPU pools) or contexts per GPU (GPU pools); 0: the pool's
    # --workers or --contexts-per-gpu.
    workers: int = 0


@dataclass(frozen=True)
class PoolConfig:
    model_name: str
    model_base_path: str
    model_version: int
    run_dir: str
    log_dir: str
    workers: int
    host: str = "127.0.0.1"
    port: int = 8500
    metrics_port: int = 8502  # Prometheus /metrics; 0 picks a free port, -1 turns it off
    # TF Serving's REST API (/v1/models/...); 0 picks a free port, -1 turns it off.
    rest_api_port: int = 8501
    # A REST Predict's deadline (TF Serving's --rest_api_timeout_in_ms); 0: none.
    rest_api_timeout_ms: int = 30_000
    # TF Serving's --rest_api_enable_cors_support: every REST answer carries CORS headers
    # allowing any origin, so a browser page on another origin can call the REST API.
    rest_api_enable_cors_support: bool = False
    # Predict outputs in tensor_content instead of the typed fields (float_val, ...), as TF
    # Serving's --enable_serialization_as_tensor_content; off by default, as there.
    serialize_as_tensor_content: bool = False
    # TLS on the gRPC port, from --ssl_config_file (TF Serving's SSLConfig: server_key,
    # server_cert, custom_ca PEM text, client_verify); None: plaintext. pool.json is 0600.
    tls: dict[str, Any] | None = None
    # TF Serving's metrics page on the REST port ("" off), from --monitoring_config_file.
    prometheus_path: str = ""
    # Classify/Regress/MultiInference require the signature's method name to match, as TF
    # Serving's --enable_signature_method_name_check (off by default there too).
    signature_method_name_check: bool = False
    # Close client connections after this long (0: never), so clients balancing over
    # several pods re-resolve and find new ones; in-flight calls get the same again to end
    # (max_connection_age_grace_s when set).
    max_connection_age_s: float = 0.0
    # What calls under way get after the age's GOAWAY (gRPC's max_connection_age_grace, from
    # --grpc_channel_arguments); None: the age again.
    max_connection_age_grace_s: float | None = None
    # A gRPC connection without a call under way this long is ended with GOAWAY (0: never), so
    # channels clients leave open give their places under --max-connections back. gRPC's
    # max_connection_idle.
    max_connection_idle_s: float = 0.0
    # An HTTP/2 PING on a gRPC connection silent this long, to be answered within the timeout
    # (gRPC's keepalive_time and keepalive_timeout; 0: not set). The front door pings silent
    # connections at the read timeout anyway, to close those whose clients stopped reading.
    keepalive_time_s: float = 0.0
    keepalive_timeout_s: float = 0.0
    # Calls at once on one gRPC connection (gRPC's max_concurrent_streams; 0: hyper's 200).
    max_concurrent_streams: int = 0
    # Client connections the front door keeps open at once, gRPC and REST together (0: as
    # many as its open-file limit allows after a reserve for the pool's own sockets; it holds
    # any value under that too). Each holds a descriptor and buffers no budget counts: 300
    # idle ones against a limit of 256 kept a restarted worker from connecting.
    max_connections: int = 1024
    # A worker silent this long is declared dead by the router (its requests are retried
    # elsewhere) and replaced by the controller.
    worker_timeout_s: float = 3.0
    # A model call running longer than this (0: no limit) is taken for a hang (a stuck
    # kernel, a wedged GPU): its request fails with DEADLINE_EXCEEDED and its worker exits to
    # be replaced. A call beats from a side thread while it runs (worker/serve.py), so without
    # this a hung call would hold its worker for ever. TorchServe's default_response_timeout
    # does the same (120 s there).
    call_timeout_s: float = 300.0
    # A request that sends nothing this long while the front door waits for more of it (its
    # body; a REST header, or an idle REST connection) is ended, and what it held of the
    # front door's memory budget is freed (0: wait for ever). nginx's client_body_timeout.
    request_read_timeout_s: float = 60.0
    # On shutdown: health says NOT_SERVING this long before the server stops accepting
    # (time for load balancers to notice), then in-flight requests get drain_timeout_s.
    shutdown_delay_s: float = 1.0
    drain_timeout_s: float = 10.0
    # A worker that cannot load its model is retried this many times, with exponential
    # back-off from backoff_s, then marked FATAL.
    start_retries: int = 3
    backoff_s: float = 1.0
    # A version loaded while the pool serves (or a model added then) that fails to load is
    # tried again start_retries times, this long apart, as TF Serving's LoaderHarness retries
    # (--load_retry_interval_micros, 60 s there too): a folder copied in non-atomically
    # (saved_model.pb before variables/) loads once the copy is complete.
    load_retry_interval_s: float = 60.0
    # A FATAL slot is tried again this long after it became FATAL (0: never).
    fatal_retry_s: float = 60.0
    intra_op_threads: int = 0  # 0: the worker's pinned cores, else usable cores / workers
    inter_op_threads: int = 1
    max_message_bytes: int = 512 * 1024 * 1024
    # Batching in the front door (router/src/batch.rs): requests waiting for a worker share
    # one model call, with TF Serving's parameters (defaults as TF Serving's; the file of
    # --batching_parameters_file sets them). Off by default, as in TF Serving: only correct
    # for models whose rows are independent.
    batching: bool = False
    max_batch_size: int = MAX_BATCH_SIZE
    batch_timeout_micros: int = 0
    allowed_batch_sizes: tuple[int, ...] = ()
    max_enqueued_batches: int = MAX_ENQUEUED_BATCHES
    # TF Serving's --enable_per_model_batching_parameters (with batching): each version is
    # batched by the batching_params.pbtxt in its directory (`version_batching`), read by
    # the controller as the version loads and sent to the front door with the version
    # table; a version without one is not batched. The five fields above are then unused.
    per_model_batching: bool = False
    # Scheduling in the front door (router/src/policies/): which worker takes a request, the
    # order of requests waiting for one (only with a limit in flight per worker; 0: none,
    # which sjf and batching make 1), and when sjf lets a waiting request go first.
    dispatch: str = "round-robin"
    queue: str = "fcfs"
    aging_bound_ms: float = 50.0
    worker_inflight: int = 0
    # Requests with more rows run as chunks of at most this many on several workers (0: off).
    split_rows: int = 0
    # Which versions under the base path are served (supervisor/versions.py, TF Serving's
    # model_version_policy: "latest:N", "all", "specific:V,..."), and how often the base path
    # is read for new and removed versions (0: only at start).
    version_policy: str = "latest:1"
    # version_labels of TF Serving's model config: label ("stable", "canary") → version.
    # The front door resolves a label only while its version is AVAILABLE.
    version_labels: dict[str, int] = dataclasses.field(default_factory=dict)
    # --model-workers as given (model name → workers): a model of that name added while the
    # pool serves (again, after a reload removed it) gets them too.
    model_workers: dict[str, int] = dataclasses.field(default_factory=dict)
    # TF Serving's --grpc_socket_path: gRPC on this UNIX socket too (absolute; "": none).
    grpc_socket_path: str = ""
    # TF Serving's --saved_model_tags: the tag set of the MetaGraphDef the workers load,
    # comma-separated (every model's, as TF Serving's is the server's).
    saved_model_tags: str = "serve"
    # TF Serving's --allow_version_labels_for_unavailable_models: a label not yet given to
    # another version may name one that is not AVAILABLE (config_reload.label_may_wait_for).
    allow_version_labels_for_unavailable_models: bool = False
    # --model_config_file (mpspool/model_config.py), read again every this many seconds
    # (0: only at start), when the pool was started from one.
    model_config_file: str = ""
    model_config_file_poll_wait_s: float = 0.0
    # Every model when the pool serves several (a --model_config_file listing more than one),
    # the first being the model of the fields above (model_name, ..., version_labels), which
    # keeps every name a one-model pool has; empty: the pool serves that one model. Each
    # model has its own workers (`for_model`), versions and weight segments.
    models: tuple[ServedModel, ...] = ()
    file_system_poll_wait_s: float = 1.0
    # Workers and weight publishers load at this CPU priority: "idle" (SCHED_IDLE), so that a
    # version loading beside one that serves takes only the CPU the serving workers leave, or
    # "normal"; once a worker takes traffic the controller puts its serving thread to
    # worker_policy and the rest back to normal (process.restore_priority). Idle needs
    # the right to go back (CAP_SYS_NICE or RLIMIT_NICE): without it, `mpspool start` says so
    # and uses normal (process.can_restore_priority).
    loading_priority: str = "idle"
    # The policy a worker's serving thread runs under once it serves (process.SERVING_POLICIES):
    # "batch" (SCHED_BATCH: its wake-up does not take the front door's core in the middle of
    # the front door's round) or "normal"; its TensorFlow threads run normal either way.
    worker_policy: str = "batch"
    # Before a worker says READY it replays the version's recorded requests
    # (assets.extra/tf_serving_warmup_requests, worker/warmup.py) this many times each, as TF
    # Serving's --enable_model_warmup and --num_request_iterations_for_warmup; a version
    # without the file gets the synthetic warm-up (each signature on zeros) only.
    model_warmup: bool = True
    warmup_iterations: int = 1
    # Publish the variables once into shared memory and map them in every worker (the
    # default); off, each worker loads its own copy from the checkpoint.
    share_weights: bool = True
    # A worker whose TensorFlow copied shared variables at warm-up (an op that writes them,
    # say) refuses to serve unless this is set: then each such worker holds its own copy.
    allow_copied_weights: bool = False
    # GPU mode: the GPUs (indices as this process sees them) and, resolved at start, their
    # UUIDs (what workers get in CUDA_VISIBLE_DEVICES) and memory. Empty: CPU workers.
    gpus: tuple[int, ...] = ()
    gpu_uuids: tuple[str, ...] = ()
    gpu_memory: tuple[int, ...] = ()
    contexts_per_gpu: int = 4
    # MPS: one control daemon per GPU; off (--no-mps, ENABLE_MPS=0), the same workers
    # time-slice the GPU, for comparison.
    mps: bool = True
    mps_control: str = ""  # the nvidia-cuda-mps-control binary
    active_thread_percentage: float = 100.0
    pinned_mem_limit_mib: int = -1  # per client; -1: device memory / contexts; 0: none
    pool_id: str = dataclasses.field(default_factory=lambda: secrets.token_hex(4))
    # The secret that makes its weight segments' names unguessable (segment.segment_path);
    # only pool.json (0600, in the 0700 run directory) holds it.
    segment_key: str = dataclasses.field(default_factory=lambda: secrets.token_hex(16))
    # CPU placement (mpspool/cpusets.py): DeepRec's SESSION_GROUP_CPUSET text ("2-4;5-7"),
    # "auto", or "" (no pinning). The usable cores are those of the process that made the
    # config (`mpspool start`), kept here so that every worker resolves the same placement
    # even though the controller may have narrowed its own affinity (and so its children's).
    cpuset: str = ""
    usable_cpus: tuple[int, ...] = dataclasses.field(default_factory=lambda: _usable_cpus())

    @property
    def model_path(self) -> str:
        """The version the pool started with."""
        return self.version_path(self.model_version)

    def version_path(self, version: int) -> str:
        """Where ``version`` of the pool's model is (a zero-padded folder too, as in TF
        Serving: `demo_model.version_dir`)."""
        from mpspool.demo_model import version_dir

        return str(version_dir(self.model_base_path, version))

    @property
    def weights_segment(self) -> str:
        return self.segment_for(self.model_version)

    def segment_for(self, version: int) -> str:
        """The shared-memory file of a model version's weights; "" when not sharing."""
        if not self.share_weights:
            return ""
        from mpspool.segment import segment_path

        return str(segment_path(self.pool_id, self.model_name, version, self.segment_key))

    @property
    def slots(self) -> list[str]:
        """Worker slot names: "cpu-<i>", or "gpu<g>-<context>" for each (GPU, context)."""
        if self.gpus:
            contexts = self.workers_of(self.model_name)
            return [f"gpu{g}-{c}" for g in self.gpus for c in range(contexts)]
        return [f"cpu-{i}" for i in range(self.workers_of(self.model_name))]

    def slot_gpu(self, slot: str) -> int | None:
        """The GPU index of a slot, None for a CPU slot."""
        if not slot.startswith("gpu"):
            return None
        return int(slot[3:].split("-", 1)[0])

    def gpu_uuid(self, gpu: int) -> str:
        return self.gpu_uuids[self.gpus.index(gpu)]

    def pinned_limit_mib(self, gpu: int) -> int:
        if self.pinned_mem_limit_mib >= 0:
            return self.pinned_mem_limit_mib
        return self.gpu_memory[self.gpus.index(gpu)] // self.contexts_on_gpu() // 2**20

    # -- the models it serves -------------------------------------------------------
    def served_models(self) -> tuple[ServedModel, ...]:
        """Every model the pool serves, the first being the model of `model_name`."""
        if self.models:
            return self.models
        return (
            ServedModel(
                self.model_name, self.model_base_path, self.model_version,
                self.version_policy, dict(self.version_labels),
            ),
        )  # fmt: skip

    def model_prefix(self, name: str) -> str:
        """What tells a model's slots, programs and groups apart from the others': "" for the
        first (a one-model pool keeps its names: "cpu-0@2", "worker-cpu-0-v2", "v2"), the
        model's name for the others ("ranker/cpu-0@2", "worker-ranker-cpu-0-v2")."""
        return "" if name == self.model_name else name

    def for_model(self, name: str) -> PoolConfig:
        """The configuration one model's workers, publishers and versions read: that model's
        name, base path, version, policy, labels and workers; the pool's everything else."""
        for model in self.served_models():
            if model.name == name:
                if name == self.model_name:
                    return self
                # Its workers: `slots` finds its entry in `models` by name.
                return dataclasses.replace(
                    self,
                    model_name=model.name,
                    model_base_path=model.base_path,
                    model_version=model.version,
                    version_policy=model.version_policy,
                    version_labels=dict(model.version_labels),
                )
        served = ", ".join(repr(m.name) for m in self.served_models())
        raise ConfigError(f"this pool serves no model {name!r} (it serves {served})")

    def with_versions(self, name: str, version_policy: str, labels: dict[str, int]) -> PoolConfig:
        """This configuration with one model's version policy and labels replaced."""
        config = self
        if name == self.model_name:
            config = dataclasses.replace(
                config, version_policy=version_policy, version_labels=dict(labels)
            )
        models = tuple(
            dataclasses.replace(m, version_policy=version_policy, version_labels=dict(labels))
            if m.name == name
            else m
            for m in self.models
        )
        return dataclasses.replace(config, models=models)

    def workers_of(self, name: str) -> int:
        """A model's workers (CPU pools) or contexts per GPU (GPU pools): its own number, or
        the pool's --workers or --contexts-per-gpu."""
        default = self.contexts_per_gpu if self.gpus else self.workers
        return next((m.workers for m in self.models if m.name == name), 0) or default

    def contexts_on_gpu(self) -> int:
        """MPS clients per GPU: every model's contexts."""
        return sum(self.workers_of(m.name) for m in self.served_models())

    def placement(self) -> Placement:
        """Which cores each slot runs on (cpusets.py owns the rule)."""
        from mpspool import cpusets

        # Every model's workers keep cores busy (they share the first model's placement):
        # each model's workers (CPU pools) or contexts on each GPU.
        every_worker = self.contexts_on_gpu() * max(1, len(self.gpus))
        return cpusets.plan(
            self.cpuset, len(self.slots), self.usable_cpus, every_worker, cpusets.quota_cores()
        )

    def cpu_set(self, slot: str) -> frozenset[int]:
        """The cores of one worker slot; empty when workers are not pinned."""
        placement = self.placement()
        return placement.workers[self.slots.index(slot)] if placement.pinned else frozenset()

    def _validate_grpc_socket_path(self) -> None:
        """What the front door would refuse when it binds (router/src/server.rs, UnixSocket),
        said at start instead: a path a UNIX socket cannot have, or something other than a
        socket already there (a socket left there is replaced, as gRPC's servers do)."""
        import stat

        path = self.grpc_socket_path
        if not os.path.isabs(path) or len(os.fsencode(path)) > 107:
            raise ConfigError(
                f"--grpc_socket_path must be an absolute path of at most 107 bytes (a UNIX "
                f"socket's), got {path!r}"
            )
        parent = os.path.dirname(path)
        if not os.path.isdir(parent):
            raise ConfigError(f"--grpc_socket_path {path}: its directory does not exist")
        owner = os.stat(parent).st_uid
        if owner not in (os.getuid(), 0):
            # Its owner could put their own socket in the pool's place, and the pool's clients
            # would talk to it (found by a hunt). Root's stays allowed: an emptyDir a sidecar
            # shares is root's (and 0777).
            raise ConfigError(
                f"--grpc_socket_path {path}: its directory {parent} is of uid {owner}, not "
                f"yours ({os.getuid()}) or root's: its owner could replace the socket there"
            )
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            mode = None
        except OSError as exc:
            raise ConfigError(f"--grpc_socket_path {path}: {exc.strerror}") from None
        if mode is not None and not stat.S_ISSOCK(mode):
            raise ConfigError(f"--grpc_socket_path {path} exists and is not a socket")
        if mode is not None:
            import socket

            with socket.socket(socket.AF_UNIX) as probe:
                if probe.connect_ex(path) == 0:
                    raise ConfigError(
                        f"--grpc_socket_path {path} is a socket another server listens on"
                    )

    def threads_per_worker(self, slot: str) -> int:
        """A worker's TensorFlow intra-op threads: --intra-op-threads, else the placement's
        (cpusets decides: its own cores when pinned, else its share of the pool's)."""
        if self.intra_op_threads > 0:
            return self.intra_op_threads
        return self.placement().worker_threads(self.slots.index(slot))

    def validate(self, models_on_disk: bool = True) -> PoolConfig:
        """Self, checked. ``models_on_disk``: False checks everything but the models' version
        folders (a start that waits for its model checks its flags first)."""
        for flag, path in (
            ("--model-base-path", self.model_base_path),
            ("--run-dir", self.run_dir),
            ("--log-dir", self.log_dir),
        ):
            check_utf8(flag, str(path))
        from mpspool.supervisor.supervisord import config_value_problem

        for flag, path in (("--run-dir", self.run_dir), ("--log-dir", self.log_dir)):
            problem = config_value_problem(str(path))
            if problem:  # supervisord's configuration names both
                raise ConfigError(f"{flag} {str(path)!r} cannot be used: {problem}")
        # Length first: its message shows a long name cut, this one whole.
        check_model_name_length(self.model_name)
        if not self.model_name or "/" in self.model_name:
            raise ConfigError(f"--model-name must be a plain name, got {self.model_name!r}")
        if any(ord(c) < 0x20 or ord(c) == 0x7F for c in self.model_name):
            # It is written into supervisord's configuration and the pool's logs, line by line.
            raise ConfigError(
                f"model name {self.model_name!r} holds a control character (a newline, a tab); "
                "name the model without one"
            )
        self._validate_models(models_on_disk)
        if self.workers < 1:
            raise ConfigError(f"--workers must be at least 1, got {self.workers}")
        if self.grpc_socket_path:
            self._validate_grpc_socket_path()
        if not self.saved_model_tags or "" in self.saved_model_tags.split(","):
            raise ConfigError(
                "--saved_model_tags is a comma-separated list of tags, none empty, got "
                f"{self.saved_model_tags!r}"
            )
        if self.intra_op_threads < 0 or self.inter_op_threads < 0:
            # Refused here, not by each worker at load (its slot would fail its starts).
            raise ConfigError(
                "--intra-op-threads and --inter-op-threads must be >= 0, got "
                f"{self.intra_op_threads} and {self.inter_op_threads}"
            )
        if self.dispatch not in DISPATCH_POLICIES:
            raise ConfigError(
                f"--dispatch must be one of {', '.join(DISPATCH_POLICIES)}, got {self.dispatch!r}"
            )
        if self.queue not in QUEUE_ORDERS:
            raise ConfigError(
                f"--queue must be one of {', '.join(QUEUE_ORDERS)}, got {self.queue!r}"
            )
        if not 0 < self.aging_bound_ms < 3_600_000:
            raise ConfigError(
                f"--aging-bound-ms must be in (0, 3600000), got {self.aging_bound_ms}"
            )
        if self.worker_inflight < 0 or self.split_rows < 0:
            raise ConfigError("--worker-inflight and --split-rows must be >= 0")
        if self.file_system_poll_wait_s < 0:
            raise ConfigError(
                f"--file_system_poll_wait_seconds must be >= 0, got {self.file_system_poll_wait_s}"
            )
        if self.model_config_file_poll_wait_s < 0:
            raise ConfigError(
                "--model_config_file_poll_wait_seconds must be >= 0, "
                f"got {self.model_config_file_poll_wait_s}"
            )
        bad = {k: v for k, v in self.version_labels.items() if not k or v < 0}
        if bad:
            raise ConfigError(f"version labels need a name and a version >= 0, got {bad}")
        if self.worker_policy not in process.SERVING_POLICIES:
            raise ConfigError(
                f"--worker-policy must be one of {', '.join(process.SERVING_POLICIES)}, "
                f"got {self.worker_policy!r}"
            )
        if self.loading_priority not in process.LOADING_PRIORITIES:
            raise ConfigError(
                f"--loading-priority must be one of {', '.join(process.LOADING_PRIORITIES)}, "
                f"got {self.loading_priority!r}"
            )
        from mpspool.supervisor.versions import VersionPolicy

        try:
            VersionPolicy.parse(self.version_policy)
        except ValueError as exc:
            raise ConfigError(f"--version-policy: {exc}") from None
        if self.warmup_iterations < 1:
            raise ConfigError(
                f"--num_request_iterations_for_warmup must be >= 1, got {self.warmup_iterations}"
            )
        self._validate_batching()
        if self.gpus and not 1 <= self.contexts_per_gpu <= 48:
            # MPS serves at most 48 client contexts per GPU. Checked before the placement,
            # which divides by it; a CPU pool does not read it.
            raise ConfigError(
                "--contexts-per-gpu must be in 1..48 (MPS's limit per GPU), "
                f"got {self.contexts_per_gpu}"
            )
        self.placement()  # ConfigError when the cpuset cannot be applied here
        if self.fatal_retry_s < 0:
            raise ConfigError(f"--fatal-retry-after must be >= 0, got {self.fatal_retry_s}")
        if not self.load_retry_interval_s >= 0:  # NaN too
            raise ConfigError(
                "--load_retry_interval_micros must be >= 0, got "
                f"{self.load_retry_interval_s * 1e6:.0f}"
            )
        if self.gpus and self.contexts_on_gpu() > 48:
            raise ConfigError(
                "contexts per GPU, every model's together, must be at most 48 (MPS's limit "
                f"per GPU), got {self.contexts_on_gpu()}"
            )
        # At least 0.1: the MPS control daemon keeps the default with one decimal, and a
        # smaller value (0.04) reads back as 0.0, a GPU share of nothing.
        if not 0.1 <= self.active_thread_percentage <= 100:
            raise ConfigError(
                "--active-thread-percentage must be in [0.1, 100] (the MPS daemon keeps one "
                f"decimal), got {self.active_thread_percentage:g}"
            )
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"--port must be in 0..65535, got {self.port}")
        if not -1 <= self.rest_api_port <= 65535:
            raise ConfigError(
                f"--rest-api-port must be in 0..65535 or -1 (off), got {self.rest_api_port}"
            )
        if not 1024 <= self.max_message_bytes < 2**31:
            raise ConfigError(
                f"--max-message-bytes must be in 1024..2147483647, got {self.max_message_bytes}"
            )
        for flag, seconds in (
            ("--max-connection-age", self.max_connection_age_s),
            ("--max-connection-idle", self.max_connection_idle_s),
            ("grpc.max_connection_age_grace_ms", self.max_connection_age_grace_s or 0.0),
            ("grpc.keepalive_time_ms", self.keepalive_time_s),
            ("grpc.keepalive_timeout_ms", self.keepalive_timeout_s),
        ):
            if not seconds >= 0:  # NaN too
                raise ConfigError(f"{flag} must be >= 0, got {seconds}")
        if not 0 <= self.max_concurrent_streams < 2**32:
            raise ConfigError(
                "grpc.max_concurrent_streams must be in 0..4294967295 (0: hyper's 200), "
                f"got {self.max_concurrent_streams}"
            )
        if self.max_connections < 0:
            raise ConfigError(
                f"--max-connections must be >= 0 (0: as the open-file limit allows), "
                f"got {self.max_connections}"
            )
        if self.rest_api_timeout_ms < 0:
            raise ConfigError(
                f"--rest-api-timeout-in-ms must be >= 0, got {self.rest_api_timeout_ms}"
            )
        if self.prometheus_path and self.rest_api_port == -1:
            raise ConfigError(
                "--monitoring_config_file turns on Prometheus metrics, which are served on "
                "the REST port: give --rest-api-port"
            )
        if self.prometheus_path and (
            not self.prometheus_path.startswith("/") or self.prometheus_path.startswith("/v1/")
        ):
            raise ConfigError(
                f"the monitoring config's path must start with / and not /v1/ (the REST "
                f"API's), got {self.prometheus_path!r}"
            )
        if self.rest_api_port > 0 and self.rest_api_port in (self.port, self.metrics_port):
            raise ConfigError(
                f"--rest-api-port {self.rest_api_port} is also the gRPC or the metrics port"
            )
        # Refused here: the front door cannot bind a port outside 1..65535 and would serve
        # no metrics, saying nothing.
        if not -1 <= self.metrics_port <= 65535:
            raise ConfigError(
                f"--metrics-port must be in 0..65535 or -1 (off), got {self.metrics_port}"
            )
        if self.metrics_port > 0 and self.metrics_port == self.port:
            raise ConfigError(f"--metrics-port {self.metrics_port} is also the gRPC port (--port)")
        if self.worker_timeout_s <= 0.5:
            raise ConfigError(
                "--worker-timeout must exceed the 0.5 s heartbeat interval, "
                f"got {self.worker_timeout_s}"
            )
        if not self.call_timeout_s >= 0:  # NaN too
            raise ConfigError(
                f"--call-timeout must be >= 0 (0: no limit), got {self.call_timeout_s}"
            )
        if not self.request_read_timeout_s >= 0:  # NaN too
            raise ConfigError(
                "--request-read-timeout must be >= 0 (0: wait for ever), "
                f"got {self.request_read_timeout_s}"
            )
        for flag, seconds in (
            ("--drain-timeout", self.drain_timeout_s),
            ("--shutdown-delay", self.shutdown_delay_s),
        ):
            # The front door refuses what no Duration holds (negative, NaN, infinite or past
            # 2**64 s) only once the workers run: refused here, before anything starts.
            if not 0 <= seconds < 2**64:
                raise ConfigError(f"{flag} must be seconds >= 0, got {seconds}")
        self._validate_time_bounds()
        model_pb = Path(self.model_path) / "saved_model.pb"
        if models_on_disk and not _is_file(model_pb):
            raise ConfigError(f"no SavedModel at {self.model_path}: expected {model_pb}")
        # ipc:// paths are unix socket paths: at most 107 bytes on Linux. The longest is an
        # MPS daemon's (its pipe directory is in the run directory), else supervisord's.
        sockets = [Path(self.run_dir) / "supervisord.sock"]
        if self.gpus and self.mps:
            sockets += [
                Path(self.run_dir) / "mps" / f"gpu{gpu}" / "pipe" / "control_privileged"
                for gpu in self.gpus
            ]
        longest = max(sockets, key=lambda path: len(os.fsencode(path)))
        if len(os.fsencode(longest)) > 100:  # bytes, as the kernel counts (not characters)
            raise ConfigError(
                f"--run-dir {self.run_dir} is too long for unix sockets ({longest} is "
                f"{len(os.fsencode(longest))} bytes, at most 100); use a shorter path"
            )
        return self

    def _validate_time_bounds(self) -> None:
        """Every time setting finite and at most MAX_SECONDS, after each one's own rule: NaN
        and infinity passed those, reached pool.json as JSON it does not allow, and the
        front door refused it naming the file, not the flag; 1e19 s passed, and adding it to
        a clock reading panicked the front door on every connection (found by hunts)."""
        for flag, seconds, shown in (
            ("--file_system_poll_wait_seconds", self.file_system_poll_wait_s, None),
            ("--model_config_file_poll_wait_seconds", self.model_config_file_poll_wait_s, None),
            ("--fatal-retry-after", self.fatal_retry_s, None),
            ("--load_retry_interval_micros", self.load_retry_interval_s, 1e6),
            ("--worker-timeout", self.worker_timeout_s, None),
            ("--call-timeout", self.call_timeout_s, None),
            ("--request-read-timeout", self.request_read_timeout_s, None),
            ("--drain-timeout", self.drain_timeout_s, None),
            ("--shutdown-delay", self.shutdown_delay_s, None),
            ("--max-connection-age", self.max_connection_age_s, None),
            ("--max-connection-idle", self.max_connection_idle_s, None),
            ("grpc.max_connection_age_grace_ms", self.max_connection_age_grace_s or 0.0, 1e3),
            ("grpc.keepalive_time_ms", self.keepalive_time_s, 1e3),
            ("grpc.keepalive_timeout_ms", self.keepalive_timeout_s, 1e3),
            ("--rest-api-timeout-in-ms", self.rest_api_timeout_ms / 1e3, 1e3),
        ):
            if not (math.isfinite(seconds) and seconds <= MAX_SECONDS):
                unit = "" if shown is None else f" ({shown:g} per second)"
                given = seconds if shown is None else seconds * shown
                raise ConfigError(
                    f"{flag} must be at most {MAX_SECONDS} seconds (about 68 years){unit}, "
                    f"got {given}"
                )

    def _validate_models(self, models_on_disk: bool = True) -> None:
        """A pool of several models: each named once, with a name safe in process and file
        names, the first being the pool's model; each one's own settings valid."""
        if not self.models:
            return
        first = self.models[0]
        if (first.name, first.base_path, first.version) != (
            self.model_name, self.model_base_path, self.model_version,
        ):  # fmt: skip
            raise ConfigError(f"models: the first must be the pool's model {self.model_name!r}")
        seen: set[str] = set()
        for model in self.models:
            check_model_name_length(model.name)
            # The first model's name is in no process or file name (its slots are cpu-N,
            # as a pool of one model's, whose name may be anything): only the others'.
            if model is not first and not MODEL_NAME.fullmatch(model.name):
                raise ConfigError(f"model name {model.name!r}: {MODEL_NAME_RULE}")
            if model.name in seen:
                raise ConfigError(f"model {model.name!r} is listed twice")
            seen.add(model.name)
            if model.workers < 0:
                raise ConfigError(f"model {model.name!r}: workers must be >= 0")
            if model is not first:
                self.for_model(model.name)._validate_model(models_on_disk)

    def validate_added(self, name: str) -> None:
        """A model added while the pool serves: a name safe in process and file names, a
        SavedModel at its first version, and room for its contexts on each GPU."""
        self.check_added_name(name)
        if self.gpus and self.contexts_on_gpu() > 48:
            raise ConfigError(
                f"model {name!r} would make {self.contexts_on_gpu()} contexts per GPU, more "
                "than MPS's 48"
            )
        self.for_model(name)._validate_model()

    def check_added_name(self, name: str) -> None:
        """A name a model added while the pool serves may have (checked before its
        versions: a model waiting for its first one is not promised a name it cannot have)."""
        check_model_name_length(name)
        if not MODEL_NAME.fullmatch(name):
            raise ConfigError(f"model name {name!r}: {MODEL_NAME_RULE}")
        from mpspool.segment import segment_path

        # A pool's segment names end in a keyed digest of the model's own name, so names that
        # read alike once made safe for a file name (the first model's "my model" and an
        # added "my_model") do not share one; only a pool begun before the key existed
        # (pool.json without one) names them by the safe name alone.
        for model in [] if self.segment_key else self.served_models():
            if model.name != name and segment_path("", model.name, 0) == segment_path("", name, 0):
                raise ConfigError(
                    f"model name {name!r} is too like {model.name!r}'s: their weight segments "
                    "would share a name"
                )

    def _validate_model(self, models_on_disk: bool = True) -> None:
        """The settings each model has of its own."""
        from mpspool.supervisor.versions import VersionPolicy

        where = f"model {self.model_name!r}"
        try:
            VersionPolicy.parse(self.version_policy)
        except ValueError as exc:
            raise ConfigError(f"{where}: version policy: {exc}") from None
        bad = {k: v for k, v in self.version_labels.items() if not k or v < 0}
        if bad:
            raise ConfigError(f"{where}: version labels need a name and a version >= 0: {bad}")
        model_pb = Path(self.model_path) / "saved_model.pb"
        if models_on_disk and not _is_file(model_pb):
            raise ConfigError(f"{where}: no SavedModel at {self.model_path}: expected {model_pb}")
        self.placement()

    def _validate_batching(self) -> None:
        """TF Serving's rules for its batching parameters; with per-model batching, each
        model's first version's own file (a later version's is read as it loads)."""
        check_batching(
            self.max_batch_size,
            self.max_enqueued_batches,
            self.batch_timeout_micros,
            self.allowed_batch_sizes,
        )
        if self.batching and self.split_rows > self.max_batch_size:
            # Its pieces would be calls above max_batch_size, which bounds every batched call
            # (the file's enable_large_batch_splitting has the same rule, in its words).
            raise ConfigError(
                f"--split-rows {self.split_rows} is above max_batch_size "
                f"{self.max_batch_size}: with batching, a request is cut into pieces of at "
                "most max_batch_size rows"
            )
        if not self.per_model_batching:
            return
        if not self.batching:
            raise ConfigError("per-model batching parameters need --enable_batching")
        from mpspool.demo_model import version_dir

        for model in self.served_models():
            version_batching(version_dir(model.base_path, model.version))

    def save(self, run_dir: Path) -> Path:
        path = run_dir / POOL_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(dataclasses.asdict(self), indent=1))
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, run_dir: str | Path) -> PoolConfig:
        data = json.loads((Path(run_dir) / POOL_FILE).read_text())
        for name in ("gpus", "gpu_uuids", "gpu_memory", "allowed_batch_sizes", "usable_cpus"):
            if name in data:  # absent: the field's default
                data[name] = tuple(data[name])
        data["models"] = tuple(ServedModel(**m) for m in data.get("models", ()))
        # Written before the key existed: its segments' names had none (not a new random
        # key at each load, which would give each reader other names).
        data.setdefault("segment_key", "")
        return cls(**data)
