"""`mpspool` — start, inspect and stop a pool; build the demo model."""

from __future__ import annotations

import argparse
import atexit
import contextlib
import dataclasses
import errno
import fcntl
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import zmq

from mpspool import __version__, process, rundir, tfs_flags, wire
from mpspool.config import (
    DISPATCH_POLICIES,
    QUEUE_ORDERS,
    VERSION_BATCHING_FILE,
    ConfigError,
    PoolConfig,
    ServedModel,
    batching_parameters_from,
    check_num_batch_threads,
    default_cache_dir,
    default_log_dir,
    default_run_dir,
    prometheus_path_from,
    read_text_proto,
    tls_from,
    usable_cores,
)
from mpspool.model_config import ModelEntry, NoVersionYet, first_version, local_base_path

DEMO_MODEL_NAME = "demo"


def _add_run_dir(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--run-dir",
        type=Path,
        default=default_run_dir(),
        help="private directory of the pool's sockets and state (default: %(default)s)",
    )


def _warmup_iterations(text: str) -> int:
    """TF Serving's flag: its default is 0, and only a value > 0 is read (server.cc), so 0 or
    less replays each record once."""
    return max(1, int(text))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mpspool", description=__doc__)
    parser.add_argument("--version", action="version", version=f"mpspool {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    start = sub.add_parser("start", help="start a pool in the foreground", epilog=tfs_flags.HELP)
    # One of these, or --model_config_file; beside a config file, --model_base_path (and
    # --model_name) are ignored, as TF Serving ignores them there (its Docker image always
    # passes both, and users add --model_config_file).
    model = start.add_mutually_exclusive_group()
    model.add_argument(
        "--model-base-path",
        "--model_base_path",
        dest="model_base_path",
        # A string, not a Path: Path("s3://b/m") is "s3:/b/m", no longer seen as a URI.
        help="TF Serving model directory (numeric version subdirectories)",
    )
    model.add_argument(
        "--demo",
        action="store_true",
        help="serve the built-in demo model as 'demo' (built on first use)",
    )
    start.add_argument(
        "--model-config-file",
        "--model_config_file",
        dest="model_config_file",
        type=Path,
        help="TF Serving's ModelServerConfig in text format: each model's name, base_path, "
        "model_version_policy and version_labels; every model listed gets workers of its own",
    )
    start.add_argument(
        "--model-name",
        "--model_name",
        dest="model_name",
        help="name clients use in model_spec.name (default: the directory's name)",
    )
    start.add_argument(
        "--workers",
        type=int,
        default=usable_cores(),
        help="worker processes (default: usable cores, %(default)s); each model's, when "
        "--model_config_file lists several",
    )
    start.add_argument(
        "--model-workers",
        action="append",
        default=[],
        metavar="NAME=N",
        help="a model of --model_config_file gets N workers (GPU pools: N contexts per GPU) "
        "instead of --workers (--contexts-per-gpu); repeat for each model",
    )
    start.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (containers: 0.0.0.0; default %(default)s)",
    )
    start.add_argument(
        "--metrics-port",
        type=int,
        default=8502,
        help="Prometheus metrics at http://HOST:PORT/metrics (default %(default)s; 0 picks a "
        "free port, -1 turns them off)",
    )
    start.add_argument(
        "--max-connection-age",
        type=float,
        help="seconds after which the router closes a client connection (gracefully), so "
        "clients balancing across pods find new ones (default 0: never)",
    )
    start.add_argument(
        "--max-connection-idle",
        type=float,
        help="seconds a gRPC connection may go without a call before the router ends it "
        "(GOAWAY; the client reconnects on its next call), giving its place under "
        "--max-connections back (default 0: never)",
    )
    start.add_argument(
        "--grpc-channel-arguments",
        "--grpc_channel_arguments",
        default="",
        help="TF Serving's comma-separated gRPC server arguments (KEY=VALUE): "
        "grpc.max_connection_age_ms, grpc.max_connection_age_grace_ms, "
        "grpc.max_connection_idle_ms, grpc.keepalive_time_ms, grpc.keepalive_timeout_ms and "
        "grpc.max_concurrent_streams are honoured; others are named in a warning",
    )
    start.add_argument(
        "--max-connections",
        type=int,
        default=1024,
        help="client connections the front door keeps open at once, gRPC and REST together; "
        "more are closed as they come (an HTTP/2 GOAWAY or a 503 saying why), and the limit "
        "is held under what the front door's open-file limit leaves for the pool's own "
        "sockets (0: only that; default %(default)s)",
    )
    start.add_argument(
        "--port", type=int, default=8500, help="gRPC port (default %(default)s; 0 picks a free one)"
    )
    start.add_argument(
        "--rest-api-port",
        "--rest_api_port",
        type=int,
        default=8501,
        help="TF Serving's REST API at http://HOST:PORT/v1/models/... (default %(default)s; 0 "
        "picks a free port, -1 turns it off)",
    )
    start.add_argument(
        "--rest-api-enable-cors-support",
        "--rest_api_enable_cors_support",
        dest="rest_api_enable_cors_support",
        type=_flag_value,
        nargs="?",
        const=True,
        default=False,
        metavar="true|false",
        help="every REST answer under /v1/ carries CORS headers allowing any origin "
        "(Access-Control-Allow-Origin: *, methods POST and GET, header Content-Type), as TF "
        "Serving's flag; preflights (OPTIONS with an http(s) Origin) are answered either way "
        "(default false)",
    )
    start.add_argument(
        "--rest-api-timeout-in-ms",
        "--rest_api_timeout_in_ms",
        type=_rest_timeout_ms,
        default=30_000,
        help="deadline of a REST Predict in ms (default %(default)s, as TF Serving; 0 or "
        "less: none)",
    )
    start.add_argument(
        "--ssl-config-file",
        "--ssl_config_file",
        type=Path,
        help="TF Serving's SSLConfig (text format: server_key, server_cert, custom_ca, "
        "client_verify): TLS on the gRPC port, clients verified against custom_ca with "
        "client_verify",
    )
    start.add_argument(
        "--monitoring-config-file",
        "--monitoring_config_file",
        type=Path,
        help="TF Serving's monitoring config (text format): with prometheus_config { enable: "
        "true }, TF Serving's metrics (:tensorflow:serving:...) are served on the REST port at "
        "its path (default /monitoring/prometheus/metrics)",
    )
    start.add_argument(
        "--enable-signature-method-name-check",
        "--enable_signature_method_name_check",
        dest="signature_method_name_check",
        type=_flag_value,
        nargs="?",
        const=True,
        default=False,
        metavar="true|false",
        help="Classify, Regress and MultiInference only run signatures whose method name is "
        "tensorflow/serving/classify or .../regress (TF Serving's flag; off: any signature "
        "with the right inputs and outputs)",
    )
    start.add_argument(
        "--version-policy",
        "--model-version-policy",
        help="which versions under the base path are served, as TF Serving's "
        "model_version_policy: latest[:N] (the newest N, default 1), all, or "
        "specific:V[,V...]; each version gets its own workers",
    )
    start.add_argument(
        "--model-config-file-poll-wait-seconds",
        "--model_config_file_poll_wait_seconds",
        dest="model_config_file_poll_wait_s",
        type=float,
        default=0.0,
        help="how often --model_config_file is read again, so that a new version policy or "
        "new labels apply while the pool serves (default 0: only at start, as TF Serving)",
    )
    start.add_argument(
        "--file-system-poll-wait-seconds",
        "--file_system_poll_wait_seconds",
        dest="file_system_poll_wait_s",
        type=float,
        default=1.0,
        help="how often the base path is read for new and removed versions (default "
        "%(default)s s, as TF Serving; 0: only at start)",
    )
    start.add_argument(
        "--worker-policy",
        choices=process.SERVING_POLICIES,
        default="batch",
        help="the Linux scheduling policy of a worker's serving thread (the one the front "
        "door wakes; TensorFlow's threads run normal): batch (SCHED_BATCH at nice 0: the same "
        "CPU share, but its wake-up does not preempt the front door in the middle of handing "
        "out a round of requests) or normal (default %(default)s)",
    )
    start.add_argument(
        "--loading-priority",
        choices=process.LOADING_PRIORITIES,
        default="idle",
        help="the CPU priority at which workers and weight publishers load: idle (Linux's "
        "SCHED_IDLE: a version loading beside one that serves gets only the CPU the serving "
        "workers leave; a worker leaves it when it takes traffic, its serving thread to "
        "--worker-policy and the rest to normal; needs "
        "CAP_SYS_NICE or RLIMIT_NICE to go back, else normal is used) or normal "
        "(default %(default)s)",
    )
    start.add_argument(
        "--enable-model-warmup",
        "--enable_model_warmup",
        dest="model_warmup",
        type=_flag_value,
        nargs="?",
        const=True,  # the bare flag, as absl's boolean flags take it
        default=True,
        metavar="true|false",
        help="replay the version's assets.extra/tf_serving_warmup_requests (TFRecord of "
        "PredictionLog, TF Serving's format) in every worker before it takes traffic; a "
        "record that fails keeps the worker from serving (default true, as TF Serving)",
    )
    start.add_argument(
        "--num-request-iterations-for-warmup",
        "--num_request_iterations_for_warmup",
        dest="warmup_iterations",
        type=_warmup_iterations,
        default=1,
        help="times each warm-up record is replayed (default %(default)s; 0 or less is 1, as TF "
        "Serving, whose default is 0, reads it only when > 0)",
    )
    start.add_argument(
        "--max-message-bytes",
        type=int,
        default=512 * 2**20,
        help="largest request or answer, gRPC message or REST body (default %(default)s; "
        "at most 2 GiB - 1, protobuf's limit)",
    )
    start.add_argument(
        "--enable-serialization-as-tensor-content",
        "--enable_serialization_as_tensor_content",
        dest="serialize_as_tensor_content",
        type=_flag_value,
        nargs="?",
        const=True,
        default=False,
        metavar="true|false",
        help="Predict answers carry outputs in tensor_content rather than in the typed "
        "fields (float_val, ...), as with TF Serving's flag of that name",
    )
    tfs_flags.add_to(start)
    _add_run_dir(start)
    start.add_argument(
        "--log-dir",
        type=Path,
        default=default_log_dir(),
        help="program logs (default: %(default)s)",
    )
    start.add_argument(
        "--demo-rows",
        type=int,
        default=100_000,
        help="embedding rows of the --demo model (default %(default)s)",
    )
    start.add_argument(
        "--worker-timeout",
        type=float,
        default=3.0,
        help="seconds of silence before a worker is declared dead (default %(default)s)",
    )
    start.add_argument(
        "--call-timeout",
        type=float,
        default=300.0,
        help="seconds a model call may run before it is taken for a hang: the request fails "
        "with DEADLINE_EXCEEDED and its worker is replaced (0: no limit; default %(default)s)",
    )
    start.add_argument(
        "--request-read-timeout",
        type=float,
        default=60.0,
        help="seconds a request may send nothing while the front door waits for more of it "
        "(its body, or a REST request's header; an idle REST connection too): it is ended and "
        "what it held is freed; and seconds a gRPC answer may wait without its client taking "
        "any of it: its connection is closed (0: wait for ever; default %(default)s)",
    )
    start.add_argument(
        "--drain-timeout",
        type=float,
        default=10.0,
        help="seconds in-flight requests get at shutdown (default %(default)s)",
    )
    start.add_argument(
        "--shutdown-delay",
        type=float,
        default=1.0,
        help="seconds health says NOT_SERVING before the server stops accepting "
        "(default %(default)s)",
    )
    start.add_argument(
        "--start-retries",
        type=int,
        default=None,
        help="starts of a worker tried again after its first fails (its model did not load, "
        "or it died before it was ready; a kill of a ready worker is not one), before its "
        "slot is FATAL; and the loads of a version that fails while the pool serves, "
        "--load_retry_interval_micros apart, before it ends (default 3)",
    )
    start.add_argument(
        "--grpc_socket_path",
        "--grpc-socket-path",
        dest="grpc_socket_path",
        default="",
        metavar="PATH",
        help="serve gRPC on this UNIX socket too (TF Serving's flag): a client on this host "
        "(a sidecar) skips TCP; its calls count as local ones. A socket left at the path is "
        "replaced, anything else there refused",
    )
    start.add_argument(
        "--saved_model_tags",
        "--saved-model-tags",
        dest="saved_model_tags",
        default="serve",
        metavar="TAG[,TAG...]",
        help="the tag set of the SavedModel's MetaGraphDef the workers load, as TF Serving's "
        "flag (default %(default)s; the set must be equal, as TensorFlow matches it)",
    )
    start.add_argument(
        "--allow_version_labels_for_unavailable_models",
        "--allow-version-labels-for-unavailable-models",
        dest="labels_for_unavailable",
        type=_flag_value,
        nargs="?",
        const=True,
        default=False,
        metavar="true|false",
        help="a version label not given to another version yet may name a version that is "
        "not AVAILABLE (requests by it get NOT_FOUND until it is), as with TF Serving's flag; "
        "moving a label still waits for its new version to serve",
    )
    start.add_argument(
        "--max_num_load_retries",
        "--max-num-load-retries",
        dest="max_num_load_retries",
        type=int,
        default=None,
        metavar="N",
        help="TF Serving's flag: --start-retries (the same count: loads tried again after the "
        "first failure)",
    )
    start.add_argument(
        "--load_retry_interval_micros",
        "--load-retry-interval-micros",
        dest="load_retry_interval_micros",
        type=int,
        default=60_000_000,
        metavar="MICROS",
        help="how long a version that failed to load while the pool serves waits before it is "
        "tried again (--max_num_load_retries times), as TF Serving's flag (default "
        "%(default)s: 60 s)",
    )
    start.add_argument(
        "--fatal-retry-after",
        type=float,
        default=60.0,
        help="seconds after which a FATAL slot is tried again (default %(default)s; 0: never)",
    )
    start.add_argument(
        "--intra-op-threads",
        type=int,
        default=None,
        help="TensorFlow intra-op threads per worker (default 0: the worker's cores when "
        "pinned, else cores / workers of every model, a CPU quota counting as cores when fewer)",
    )
    # TF Serving's threading flags, read as its server.cc reads them (_thread_fields), per
    # worker here; 0, TF Serving's "auto-configured", leaves mpspool's own choice.
    for name, what in (
        ("intra_op", "--intra-op-threads"),
        ("inter_op", "--inter-op-threads"),
        ("session", "both, when neither of the two above is above 0"),
    ):
        flag = f"tensorflow_{name}_parallelism"
        start.add_argument(
            f"--{flag}",
            f"--{flag.replace('_', '-')}",
            dest=flag,
            type=int,
            default=None,
            metavar="N",
            help=f"TF Serving's flag: {what} (0: mpspool's choice)",
        )
    start.add_argument(
        "--cpuset",
        # DeepRec SessionGroup's variable is the fallback; the flag wins when both are given.
        default=os.environ.get("SESSION_GROUP_CPUSET", ""),
        metavar="GROUPS|auto",
        help="pin workers to CPU cores: one group per worker, groups separated by ';', cores "
        "by ',', ranges a-b ('2-4;5-7'), or 'auto' (own cores per worker, one kept for the "
        "front door when cores allow); default $SESSION_GROUP_CPUSET, else no pinning",
    )
    start.add_argument(
        "--no-share-weights",
        dest="share_weights",
        action="store_false",
        help="each worker loads its own copy of the weights instead of mapping one shared copy",
    )
    start.add_argument(
        "--allow-copied-weights",
        action="store_true",
        help="serve even if TensorFlow copied shared variables into a worker (refused by "
        "default: each such worker would hold its own copy)",
    )
    start.add_argument(
        "--inter-op-threads",
        type=int,
        default=None,
        help="TensorFlow inter-op threads per worker (default 1: one request runs at a time)",
    )
    sched = start.add_argument_group("scheduling and batching (in the front door)")
    sched.add_argument(
        "--enable-batching",
        "--enable_batching",
        dest="batching",
        type=_flag_value,
        nargs="?",
        const=True,
        default=False,
        metavar="true|false",
        help="requests waiting for a worker share one model call where they fit (same "
        "signature, outputs and input shapes but the first dimension), as TF Serving's "
        "batching. Only for models whose output rows depend on their own input row",
    )
    sched.add_argument(
        "--batching-parameters-file",
        "--batching_parameters_file",
        type=Path,
        help="TF Serving's BatchingParameters (text format: max_batch_size, "
        "batch_timeout_micros, allowed_batch_sizes, max_enqueued_batches, "
        "enable_large_batch_splitting, max_execution_batch_size); needs --enable-batching",
    )
    sched.add_argument(
        "--enable-per-model-batching-parameters",
        "--enable_per_model_batching_parameters",
        dest="per_model_batching",
        type=_flag_value,
        nargs="?",
        const=True,
        default=False,
        metavar="true|false",
        help="with --enable-batching: each model version is batched by the "
        "batching_params.pbtxt in its directory (TF Serving's BatchingParameters), and a "
        "version without one is not batched, as in TF Serving",
    )
    sched.add_argument(
        "--max-batch-size",
        type=int,
        default=None,
        help="rows in one batched model call (default 1000, as TF Serving; overrides the "
        "parameters file)",
    )
    sched.add_argument(
        "--dispatch",
        choices=DISPATCH_POLICIES,
        default="round-robin",
        help="which worker takes a request: in turn (default), the fewest in flight (first "
        "slot among equals), the less loaded of two picked at random, or packed: the first "
        "worker already working with fewer than 4 in flight, else the fewest in flight (a "
        "sleeping worker costs a wake-up; see bench/RESULTS.md)",
    )
    sched.add_argument(
        "--queue",
        choices=QUEUE_ORDERS,
        default="fcfs",
        help="the order of requests waiting in the front door for a worker with room: "
        "arrival (default) or shortest expected compute first, with aging",
    )
    sched.add_argument(
        "--aging-bound-ms",
        type=float,
        default=50.0,
        help="with --queue sjf: the longest a request should wait while shorter ones overtake "
        "it; the queue goes oldest first early enough for the older work and a worker's "
        "current call to end (default %(default)s)",
    )
    sched.add_argument(
        "--worker-inflight",
        type=int,
        default=0,
        help="requests a worker may hold before the rest wait in the front door (default 0: "
        "no limit, every request goes to a worker at once; --queue sjf and "
        "--enable-batching make it 1)",
    )
    sched.add_argument(
        "--split-rows",
        type=int,
        default=0,
        help="a request with more rows runs as chunks of at most this many on several "
        "workers at once (default 0: off). Only for models whose rows are independent",
    )
    gpu = start.add_argument_group("GPUs and MPS")
    gpu.add_argument(
        "--gpus",
        help="GPU indices as this process sees them (after CUDA_VISIBLE_DEVICES), e.g. 0,2; "
        "one worker per (GPU, context). Without it: CPU workers",
    )
    gpu.add_argument(
        "--contexts-per-gpu",
        type=int,
        # A string: argparse converts it only when `start` is parsed, so a bad value in the
        # environment is refused there as the flag's, and other commands never read it.
        default=os.environ.get("CONTEXTS_COUNT_PER_GPU", "4"),
        help="workers per GPU (env CONTEXTS_COUNT_PER_GPU; default %(default)s; at most 48)",
    )
    gpu.add_argument(
        "--no-mps",
        dest="mps",
        action="store_false",
        default=os.environ.get("ENABLE_MPS", "1").lower() not in ("0", "false", "no", "off"),
        help="run the GPU workers without MPS, for comparison (env ENABLE_MPS=0)",
    )
    gpu.add_argument(
        "--active-thread-percentage",
        default="100",
        help="MPS default active-thread percentage per client: a number, or 'split' for "
        "100 / contexts-per-gpu, which partitions the GPU's SMs between the workers "
        "(default %(default)s: each may use all of them)",
    )
    gpu.add_argument(
        "--pinned-mem-limit",
        type=int,
        default=-1,
        help="MPS pinned device memory limit per client in MiB (default: device memory / "
        "contexts; 0: none)",
    )
    gpu.add_argument("--mps-control", help="path of nvidia-cuda-mps-control (default: PATH)")

    status = sub.add_parser("status", help="show the pool's slots")
    _add_run_dir(status)
    status.add_argument("--json", action="store_true", help="machine-readable output")

    stop = sub.add_parser("stop", help="stop the pool gracefully and wait for it")
    _add_run_dir(stop)
    stop.add_argument(
        "--timeout", type=_seconds, default=60.0, help="seconds to wait (default %(default)s)"
    )

    timeline = sub.add_parser(
        "timeline",
        help="print the worker-side span of each recently answered request (JSON)",
        description='Prints {"now_us", "spans": [[slot, start_us, end_us], ...], '
        '"dropped", "queue_wait_max_us"}: when each worker started and finished the model '
        "call of each request answered since the last --clear (wall clock, microseconds; the "
        "most recent 200,000), and the longest any request waited in the front door's queue "
        "since then.",
    )
    _add_run_dir(timeline)
    timeline.add_argument(
        "--clear",
        action="store_true",
        help="forget the spans and the longest wait after printing them",
    )

    demo = sub.add_parser("demo-model", help="write the demo SavedModel (TF Serving layout)")
    demo.add_argument(
        "--out", type=Path, required=True, help="the model's base path (versions go under it)"
    )
    demo.add_argument(
        "--embedding-rows", type=int, default=None, help="embedding table rows (default 1000)"
    )
    demo.add_argument(
        "--version",
        dest="model_version",
        type=int,
        default=1,
        help="the version folder to write (default %(default)s)",
    )
    demo.add_argument(
        "--exist-ok",
        action="store_true",
        help="a version already there is kept and the command succeeds (an init container "
        "that runs again, as Kubernetes may run it); without it, that is an error",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code = {
            "start": cmd_start,
            "status": cmd_status,
            "stop": cmd_stop,
            "timeline": cmd_timeline,
            "demo-model": cmd_demo_model,
        }[args.command](args)
        # Flushed here, not at exit: a reader gone (`mpspool status | head -1`) is then
        # met below, not in the interpreter's own flush, which cannot be caught.
        sys.stdout.flush()
        return code
    except ConfigError as exc:
        print(f"mpspool: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        if args.command not in ("status", "timeline"):
            raise  # a pool's own pipe that broke is no reader gone: said as it is
        # Whoever read stdout stopped reading: exit quietly, as Python's docs advise (note
        # on SIGPIPE): what is still buffered goes to devnull, so the flush at exit does not
        # fail again, and the exit status is 1, Python's own on EPIPE.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1


# -- start ------------------------------------------------------------------------
def _await_first_versions(
    models: list[tuple[Path, str, str]], pool_model: str, poll_wait_s: float
) -> list[int]:
    """Each model's first version (`first_version` of base path, policy, name). A model with
    none yet (no version folder, or no base path) is waited for, its base path read every
    `poll_wait_s`, as TF Serving waits at start (`fail_if_no_model_versions_found` is off
    in its model server): a model synced into place after the pod starts (a sidecar, an
    init step still copying) is served once it is there. Said once per change, in TF
    Serving's words. With polling off (0) the pool fails at once, saying why. Nothing is
    started meanwhile (`mpspool status` sees no pool): SIGTERM or Ctrl-C ends the wait."""
    told = ""
    while True:
        first: list[int] = []
        for path, policy, model in models:
            try:
                first.append(first_version(path, policy, model))
            except NoVersionYet as exc:
                if poll_wait_s <= 0:
                    raise
                if str(exc) != told:
                    told = str(exc)
                    logging.getLogger("mpspool.controller").warning(
                        "No versions of servable %s found under base path %s. Did you forget "
                        "to name your leaf directory as a number (eg. '/1/')? (%s; waiting, the "
                        "base path read every %g s)",
                        model or pool_model, path, exc, poll_wait_s,
                    )  # fmt: skip
                break
        else:
            return first
        try:
            time.sleep(poll_wait_s)
        except KeyboardInterrupt:  # Ctrl-C while waiting: nothing was started
            raise SystemExit(130) from None


def cmd_start(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s controller %(levelname)s %(message)s"
    )
    # Everything the pool makes is its user's alone, whatever umask it was started with:
    # under umask 000 the parents `mkdir(parents=True)` made for --log-dir or --run-dir were
    # 0777 (another user could swap the log dir under them) and the controller's admin
    # socket srwxrwxrwx (found by a hunt). Files meant to be shared say so with their mode.
    os.umask(0o077)
    if not (args.model_base_path or args.model_config_file or args.demo):
        raise ConfigError("give --model_base_path, --model_config_file or --demo")
    # TF Serving's flags without a setting here: refused before anything starts, or named.
    for warning in tfs_flags.check(args):
        print(f"mpspool: {warning}", file=sys.stderr)
    dropped = sorted(k for k in os.environ if k.startswith("CUDA_MPS_"))
    if dropped:
        # supervisord.pool_environment leaves them out of every process of the pool.
        print(
            f"mpspool: warning: {', '.join(dropped)} not passed to the pool's processes: the "
            "pool runs MPS itself (--active-thread-percentage, --pinned-mem-limit)",
            file=sys.stderr,
        )
    # GPUs first: a pool that cannot have its GPUs should say so at once, before any
    # model is built or loaded.
    # `--gpus ''` is refused by parse_gpus, not taken for a CPU pool.
    gpu_fields, selected_gpus = _resolve_gpus(args) if args.gpus is not None else ({}, [])
    # Likewise a pool without its front door (BinaryNotFound is a ConfigError).
    from mpspool.router import binary_path as router_binary

    router_binary()
    policy_text, labels = args.version_policy or "latest:1", {}
    entries: list[ModelEntry] = []
    if args.model_config_file:
        from mpspool.model_config import read_model_config

        if args.demo:
            raise ConfigError("--demo serves the demo model: leave out --model_config_file")
        if args.version_policy:
            raise ConfigError(
                "--model_config_file gives each model its version policy: leave out "
                "--version-policy"
            )
        ignored = [
            flag
            for flag, given in (
                ("--model_name", args.model_name),
                ("--model_base_path", args.model_base_path),
            )
            if given
        ]
        if ignored:
            print(
                f"mpspool: {' and '.join(ignored)} ignored: --model_config_file names the "
                "models and their base paths (as TF Serving ignores them there)",
                file=sys.stderr,
            )
        entries = read_model_config(args.model_config_file)
        base_path, name = Path(entries[0].base_path), entries[0].name
        policy_text, labels = entries[0].version_policy, entries[0].labels
    elif args.model_workers:
        raise ConfigError("--model-workers names models of --model_config_file: give one")
    elif args.demo:
        base_path = _demo_model(args.demo_rows)
        name = args.model_name or DEMO_MODEL_NAME
    else:
        # Absolute, links kept: a base path behind a link a deploy swaps (git-sync, a
        # `current` link) is read through the link at each poll, as TF Serving reads it.
        base_path = Path(local_base_path(args.model_base_path, "--model_base_path"))
        name = args.model_name or base_path.name
    workers = _model_workers(args.model_workers, [e.name for e in entries])
    wanted = [
        (base_path, policy_text, ""),
        *[(Path(e.base_path), e.version_policy, e.name) for e in entries],
    ]
    run_dir = rundir.absolute(args.run_dir)

    def make_config(first: list[int], models_on_disk: bool = True) -> PoolConfig:
        """The pool's configuration, checked (`PoolConfig.validate`), at each model's first
        version."""
        version = first[0]
        models = tuple(
            ServedModel(
                e.name,
                e.base_path,
                first[1 + i],
                e.version_policy,
                e.labels,
                workers.get(e.name, 0),
            )
            for i, e in enumerate(entries)
        )
        if len(models) == 1 and not models[0].workers:
            models = ()  # one model: the fields of the pool's model say it all
        return PoolConfig(
            model_name=name,
            model_base_path=str(base_path),
            model_version=version,
            run_dir=str(run_dir),
            log_dir=str(args.log_dir.resolve()),
            workers=args.workers,
            model_workers=workers,
            host=args.host,
            port=args.port,
            metrics_port=args.metrics_port,
            rest_api_port=args.rest_api_port,
            rest_api_timeout_ms=args.rest_api_timeout_in_ms,
            rest_api_enable_cors_support=args.rest_api_enable_cors_support,
            max_message_bytes=args.max_message_bytes,
            serialize_as_tensor_content=args.serialize_as_tensor_content,
            signature_method_name_check=args.signature_method_name_check,
            tls=tls_from(args.ssl_config_file) if args.ssl_config_file else None,
            prometheus_path=(
                prometheus_path_from(args.monitoring_config_file)
                if args.monitoring_config_file
                else ""
            ),
            **_connection_fields(args),
            max_connections=args.max_connections,
            worker_timeout_s=args.worker_timeout,
            call_timeout_s=args.call_timeout,
            request_read_timeout_s=args.request_read_timeout,
            drain_timeout_s=args.drain_timeout,
            shutdown_delay_s=args.shutdown_delay,
            start_retries=_start_retries(args),
            # Through float first: an int past a float's range (400 digits) is infinity
            # here, refused by name (PoolConfig.validate), not an OverflowError.
            load_retry_interval_s=float(
                max(-(10**300), min(args.load_retry_interval_micros, 10**300))
            )
            / 1e6,
            fatal_retry_s=args.fatal_retry_after,
            **_thread_fields(args),
            cpuset=args.cpuset,
            share_weights=args.share_weights,
            allow_copied_weights=args.allow_copied_weights,
            version_policy=policy_text,
            version_labels=labels,
            models=models,
            # Links kept, as for base paths: a ConfigMap's file is a link through `..data`,
            # which kubelet swaps for each update.
            model_config_file=os.path.abspath(args.model_config_file)
            if args.model_config_file
            else "",
            model_config_file_poll_wait_s=args.model_config_file_poll_wait_s,
            allow_version_labels_for_unavailable_models=args.labels_for_unavailable,
            saved_model_tags=args.saved_model_tags or "serve",  # empty: TF Serving's default
            # Absolute: the front door runs in the run directory, TF Serving from its own.
            grpc_socket_path=os.path.abspath(args.grpc_socket_path)
            if args.grpc_socket_path
            else "",
            file_system_poll_wait_s=args.file_system_poll_wait_s,
            loading_priority=args.loading_priority,
            worker_policy=args.worker_policy,
            model_warmup=args.model_warmup,
            warmup_iterations=args.warmup_iterations,
            **_batching_fields(args),
            dispatch=args.dispatch,
            queue=args.queue,
            aging_bound_ms=args.aging_bound_ms,
            worker_inflight=args.worker_inflight,
            contexts_per_gpu=args.contexts_per_gpu,
            mps=args.mps,
            # "split": shared by every model's contexts on a GPU.
            active_thread_percentage=_thread_percentage(
                args.active_thread_percentage,
                sum(m.workers or args.contexts_per_gpu for m in models) or args.contexts_per_gpu,
            ),
            pinned_mem_limit_mib=args.pinned_mem_limit,
            **gpu_fields,
        ).validate(models_on_disk)

    try:
        first = [first_version(path, policy, model) for path, policy, model in wanted]
    except NoVersionYet:
        if args.file_system_poll_wait_s <= 0:
            raise
        # Whatever can be refused is refused before the wait, not once the model is there:
        # the flags (at a stand-in version), and a run directory another pool holds.
        make_config([0] * len(wanted), models_on_disk=False)
        _make_log_dir(args.log_dir.resolve(), run_dir)
        _claim_gpus(selected_gpus, run_dir)
        if rundir.controller_alive(rundir.read_controller(run_dir)):
            rundir.prepare(run_dir)  # raises PoolRunning, saying so
        first = _await_first_versions(wanted, name, args.file_system_poll_wait_s)
    config = make_config(first)
    if selected_gpus and not config.mps:
        _check_without_mps(config, selected_gpus)
    elif selected_gpus:
        from mpspool.mps import gpus
        from mpspool.mps.control import MAX_CLIENTS_PER_GPU

        for warning in gpus.with_mps_warnings(_mps_clients(config), MAX_CLIENTS_PER_GPU):
            print(f"mpspool: warning: {warning}", file=sys.stderr)
    # The directories after every other check (a start refused by a flag makes neither),
    # and before the note below, so that a refusal is its one line.
    _make_log_dir(Path(config.log_dir), run_dir)
    _claim_gpus(selected_gpus, run_dir)
    try:
        created = rundir.prepare(run_dir)
    except OSError as exc:  # it cannot be made there, or read: a flag's error, not a crash
        raise _dir_error("--run-dir", run_dir, exc) from None
    if config.loading_priority != "normal" and not process.can_restore_priority():
        # A worker that loaded idle would serve idle for good.
        print(
            "mpspool: --loading-priority idle needs CAP_SYS_NICE or RLIMIT_NICE to put a "
            "loaded worker back to normal; loading at normal priority",
            file=sys.stderr,
        )
        config = dataclasses.replace(config, loading_priority="normal")
    config.save(run_dir)
    pid = os.getpid()
    rundir.write_controller(
        run_dir, {"pid": pid, "started": process.started_at(pid), "created_run_dir": created}
    )
    from mpspool.supervisor.controller import Controller

    for model in config.served_models():
        print(
            f"mpspool: starting {len(config.for_model(model.name).slots)} worker(s) for "
            f"{model.name!r} version {model.version} from {model.base_path} "
            f"(pool {config.pool_id})",
            flush=True,
        )
    return Controller(config, created).run()


# This process's hold on its --log-dir (_make_log_dir): open as long as the pool runs.
_log_dir_hold: int | None = None
LOG_DIR_OWNER = ".mpspool-pool"


def _make_log_dir(log_dir: Path, run_dir: Path) -> None:
    """--log-dir made as the controller makes it (its supervisord writes there first; private:
    TensorFlow's errors in the logs can quote request values; one that exists keeps its mode),
    checked writable, and held for this pool: a directory that cannot hold the logs, or that
    another running pool writes to, is refused before anything starts. Two pools in one log
    dir (the default is one per user) wrote into each other's logs, and the controller reads
    them for the reasons it reports."""
    global _log_dir_hold
    if _log_dir_hold is not None:
        return
    try:
        log_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise _dir_error("--log-dir", log_dir, exc) from None
    if not os.access(log_dir, os.W_OK | os.X_OK):
        raise ConfigError(f"--log-dir {log_dir}: {os.strerror(errno.EACCES)}")
    uid = log_dir.stat().st_uid
    if uid not in (os.getuid(), 0):
        # Its owner could put links there, which the pool's logs are opened through: another
        # user's directory had a pool running as root truncate and write files of root's
        # (found by a hunt). Root's stays allowed (a volume's root, an emptyDir).
        raise ConfigError(
            f"--log-dir {log_dir} belongs to uid {uid}, not to you ({os.getuid()}) or root: "
            "pass a directory of your own"
        )
    owner = log_dir / LOG_DIR_OWNER
    try:
        fd = os.open(owner, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise _dir_error("--log-dir", log_dir, exc) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 4096).decode(errors="replace").strip()
        os.close(fd)
        if holder == str(run_dir):
            # The same pool started twice; or a start still waiting for its model, which
            # has no controller file yet for rundir.prepare to find.
            raise rundir.PoolRunning(
                f"a pool is already running in {run_dir}, or a start of one waits for its "
                f"model (end that with Ctrl-C); stop a pool with `mpspool stop --run-dir "
                f"{run_dir}`, or pass another --run-dir"
            ) from None
        raise ConfigError(
            f"--log-dir {log_dir} is the log dir of the pool running with --run-dir "
            f"{holder or '(unknown)'}: give each pool its own --log-dir"
        ) from None
    os.ftruncate(fd, 0)
    os.write(fd, str(run_dir).encode())
    _log_dir_hold = fd


# This process's locks on its GPUs (_claim_gpus): held as long as the pool runs.
_gpu_claims: Any = None


def _claim_gpus(selected: list[Any], run_dir: Path) -> None:
    """Lock the pool's GPUs for it (mps/claim.py): a GPU another running pool has is
    refused before anything starts. Released (its files removed) at this process's exit."""
    global _gpu_claims
    if _gpu_claims is not None or not selected:
        return
    from mpspool.mps.claim import GpuClaimed, GpuClaims

    claims = GpuClaims()
    try:
        claims.take([(gpu.index, gpu.uuid) for gpu in selected], run_dir)
    except GpuClaimed as exc:
        if exc.holder == str(run_dir):  # the same pool started twice
            raise rundir.PoolRunning(
                f"a pool is already running in {run_dir}; stop it with `mpspool stop "
                f"--run-dir {run_dir}` or pass another --run-dir"
            ) from None
        raise
    atexit.register(claims.release)
    _gpu_claims = claims


def _dir_error(flag: str, path: Path, exc: OSError) -> ConfigError:
    """One line for a directory flag the OS refuses: the flag, the path and the OS's words
    (and the file they are about, when it is another: one inside it, or a parent)."""
    about = f" ({exc.filename})" if exc.filename and Path(exc.filename) != path else ""
    return ConfigError(f"{flag} {path}: {exc.strerror}{about}")


def _model_workers(given: list[str], models: list[str]) -> dict[str, int]:
    """--model-workers NAME=N, each naming a model of the config file once."""
    workers: dict[str, int] = {}
    for text in given:
        name, sep, count = text.partition("=")
        # ASCII digits: str.isdigit() takes '²', which int() refuses (a traceback).
        if not sep or not re.fullmatch(r"[0-9]+", count.strip()) or int(count) < 1:
            raise ConfigError(f"--model-workers takes NAME=N with N >= 1, got {text!r}")
        if name not in models:
            served = ", ".join(repr(m) for m in models)
            raise ConfigError(f"--model-workers {text!r}: the config file lists {served}")
        if name in workers:
            raise ConfigError(f"--model-workers names {name!r} twice")
        workers[name] = int(count)
    return workers


def _batching_fields(args: argparse.Namespace) -> dict[str, Any]:
    """--enable-batching with the parameters file's values, --max-batch-size over them;
    --split-rows, or the file's enable_large_batch_splitting (refused if the two differ)."""
    fields: dict[str, Any] = {"batching": args.batching, "split_rows": args.split_rows}
    if args.batching_parameters_file is not None and not args.batching:
        raise ConfigError("--batching_parameters_file needs --enable_batching")
    if args.per_model_batching:
        return _per_model_batching_fields(args)
    if args.batching_parameters_file is not None:
        from_file = batching_parameters_from(args.batching_parameters_file)
        split = from_file.get("split_rows", 0)
        if split and args.split_rows and split != args.split_rows:
            raise ConfigError(
                f"--split-rows {args.split_rows} and {args.batching_parameters_file}'s "
                f"enable_large_batch_splitting (max_execution_batch_size {split}) disagree: "
                "give one"
            )
        if split and args.max_batch_size is not None:
            raise ConfigError(
                f"--max-batch-size with {args.batching_parameters_file}'s "
                "enable_large_batch_splitting: the file's max_execution_batch_size bounds a "
                "call there; give it in the file"
            )
        fields.update(from_file)
        fields["split_rows"] = split or args.split_rows
    if args.max_batch_size is not None:
        fields["max_batch_size"] = args.max_batch_size
    return fields


def _per_model_batching_fields(args: argparse.Namespace) -> dict[str, Any]:
    """--enable_per_model_batching_parameters: each version's own file sets its batching and
    splitting, so the pool-wide settings are refused beside it; the pool-wide file is only
    parsed, as TF Serving parses it and takes nothing from it but its batch thread pool."""
    if not args.batching:
        print(
            "mpspool: --enable_per_model_batching_parameters has no effect without "
            "--enable_batching (as in TF Serving)",
            file=sys.stderr,
        )
        return {"batching": False, "split_rows": args.split_rows}
    if args.max_batch_size is not None or args.split_rows:
        raise ConfigError(
            "--max-batch-size and --split-rows with --enable_per_model_batching_parameters: "
            f"each version's {VERSION_BATCHING_FILE} says how it is batched and split"
        )
    if args.batching_parameters_file is not None:
        from mpspool.protos import server_config_pb2

        params = read_text_proto(
            args.batching_parameters_file,
            "--batching_parameters_file",
            server_config_pb2.BatchingParameters(),
            "a",
        )
        # TF Serving's server still makes its batch thread pool from it.
        check_num_batch_threads(args.batching_parameters_file, params)
        print(
            f"mpspool: {args.batching_parameters_file}: its batching parameters are not used "
            f"with --enable_per_model_batching_parameters (each version's "
            f"{VERSION_BATCHING_FILE} is; TF Serving takes only its batch thread pool from it, "
            "which has no use here)",
            file=sys.stderr,
        )
    return {"batching": True, "per_model_batching": True}


def _connection_fields(args: argparse.Namespace) -> dict[str, Any]:
    """--grpc_channel_arguments' settings, with --max-connection-age and
    --max-connection-idle; the same setting given both ways is refused."""
    from mpspool import channel_args

    fields, warnings = channel_args.pool_fields(args.grpc_channel_arguments)
    for flag, field, value in (
        ("--max-connection-age", "max_connection_age_s", args.max_connection_age),
        ("--max-connection-idle", "max_connection_idle_s", args.max_connection_idle),
    ):
        if value is None:
            continue
        if field in fields:
            raise ConfigError(
                f"{flag} and {channel_args.key_for(field)} in {channel_args.FLAG} set the "
                "same thing: give one"
            )
        fields[field] = value
    for warning in warnings:
        print(f"mpspool: {warning}", file=sys.stderr)
    return fields


def _start_retries(args: argparse.Namespace) -> int:
    """--start-retries, or TF Serving's --max_num_load_retries (the same count); not both."""
    ours, theirs = args.start_retries, args.max_num_load_retries
    if ours is not None and theirs is not None:
        raise ConfigError("--start-retries and --max_num_load_retries set the same thing: give one")
    retries = next((v for v in (ours, theirs) if v is not None), 3)
    if retries < 0:
        raise ConfigError(f"--start-retries must be >= 0, got {retries}")
    return retries


def _thread_fields(args: argparse.Namespace) -> dict[str, int]:
    """A worker's TensorFlow threads: --intra-op-threads and --inter-op-threads, or TF
    Serving's flags as its server.cc reads them: all three above 0 is refused with its
    message; else --tensorflow_intra_op_parallelism and --tensorflow_inter_op_parallelism
    when either is above 0, else --tensorflow_session_parallelism for both. A 0 (TF Serving's
    "auto-configured") leaves mpspool's choice: the worker's share of the cores for intra-op,
    1 for inter-op. mpspool's flags and TF Serving's set the same thing: one or the other."""
    ours = {"intra_op_threads": args.intra_op_threads, "inter_op_threads": args.inter_op_threads}
    intra, inter, session = (
        args.tensorflow_intra_op_parallelism,
        args.tensorflow_inter_op_parallelism,
        args.tensorflow_session_parallelism,
    )
    if all(not v for v in (intra, inter, session)):  # none, or TF Serving's "auto" (0)
        return {
            "intra_op_threads": 0 if ours["intra_op_threads"] is None else ours["intra_op_threads"],
            "inter_op_threads": 1 if ours["inter_op_threads"] is None else ours["inter_op_threads"],
        }
    if any(v is not None for v in ours.values()):
        raise ConfigError(
            "--intra-op-threads/--inter-op-threads and TF Serving's "
            "--tensorflow_*_parallelism flags set the same thing: give one or the other"
        )
    intra, inter, session = (v or 0 for v in (intra, inter, session))
    if min(intra, inter, session) < 0:
        raise ConfigError(
            "--tensorflow_intra_op_parallelism, --tensorflow_inter_op_parallelism and "
            f"--tensorflow_session_parallelism must be >= 0, got {intra}, {inter}, {session}"
        )
    if intra > 0 and inter > 0 and session > 0:
        raise ConfigError(  # TF Serving's words (model_servers/server.cc)
            "Either configure server_options.tensorflow_session_parallelism or "
            "(server_options.tensorflow_intra_op_parallelism, "
            "server_options.tensorflow_inter_op_parallelism) separately. "
            "You cannot configure all."
        )
    if intra == 0 and inter == 0:
        intra = inter = session
    return {"intra_op_threads": intra, "inter_op_threads": inter or 1}


def _seconds(text: str) -> float:
    """A flag's seconds: a number >= 0 (a negative wait would end before it began)."""
    try:
        seconds = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not seconds >= 0:  # NaN too
        raise argparse.ArgumentTypeError(f"expected seconds >= 0, got {text!r}")
    return seconds


def _flag_value(text: str) -> bool:
    """A TF Serving boolean flag's value (`--enable_model_warmup=false`)."""
    value = text.strip().lower()
    if value in ("true", "1", "yes"):
        return True
    if value in ("false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _rest_timeout_ms(text: str) -> int:
    """--rest_api_timeout_in_ms: TF Serving sets a deadline only for a value above 0
    (HttpRestApiHandler), so any other means none, stored as 0."""
    return max(0, int(text))


def _thread_percentage(text: str, contexts: int) -> float:
    if text == "split":
        return round(100.0 / max(1, contexts), 2)
    try:
        return float(text)
    except ValueError:
        raise ConfigError(
            f"--active-thread-percentage must be a number or 'split', got {text!r}"
        ) from None


def _resolve_gpus(args: argparse.Namespace) -> tuple[dict[str, Any], list[Any]]:
    """The selected GPUs' indices, UUIDs and memory, and the MPS binary (PoolConfig's
    fields), and the selected GPUs themselves (mps.gpus.GpuInfo); ConfigError (one line) when
    they cannot be had."""
    from mpspool.mps import gpus
    from mpspool.mps.control import MpsError, find_control_binary

    try:
        wanted = gpus.parse_gpus(args.gpus)
        backend = gpus.backend()
        try:
            selected = gpus.select(backend.devices(), wanted)
        finally:
            backend.close()
    except gpus.GpuError as exc:
        raise ConfigError(str(exc)) from None
    binary = ""
    # Without MPS, what the compute modes allow depends on the pool's contexts, which the
    # models decide: cmd_start checks that (_check_without_mps) once they are known.
    if args.mps:
        for warning in gpus.compute_mode_warnings(selected):
            print(f"mpspool: warning: {warning}", file=sys.stderr)
        try:
            binary = find_control_binary(args.mps_control)
        except MpsError as exc:
            raise ConfigError(str(exc)) from None
    fields = {
        "gpus": tuple(g.index for g in selected),
        "gpu_uuids": tuple(g.uuid for g in selected),
        "gpu_memory": tuple(g.memory_total for g in selected),
        "mps_control": binary,
    }
    return fields, selected


def _mps_clients(config: PoolConfig) -> list[tuple[int, int]]:
    """Each model's (contexts per GPU, versions its policy serves at once): `all` counts
    one, as the versions on disk later are not known now."""
    from mpspool.supervisor.versions import VersionPolicy

    groups = []
    for model in config.served_models():
        policy = VersionPolicy.parse(model.version_policy)
        versions = len(policy.specific) if policy.specific else 1 if policy.all else policy.latest
        groups.append((config.workers_of(model.name), versions))
    return groups


def _check_without_mps(config: PoolConfig, selected: list[Any]) -> None:
    """A `--no-mps` GPU pool: refused where the GPUs' compute modes cannot hold its contexts
    (every model's workers per GPU), warned where they will not serve it well (mps/gpus.py)."""
    from mpspool.mps import gpus

    try:
        warnings = gpus.without_mps_warnings(selected, config.contexts_on_gpu())
    except gpus.GpuError as exc:
        raise ConfigError(str(exc)) from None
    for warning in warnings:
        print(f"mpspool: warning: {warning}", file=sys.stderr)


def _demo_model(rows: int) -> Path:
    base = default_cache_dir() / f"demo-{rows}"
    if not (base / "1" / "saved_model.pb").is_file():
        print(f"mpspool: building the demo model ({rows} embedding rows) in {base}", flush=True)
        # In a child process: the controller lives as long as the pool and should not carry
        # TensorFlow's few hundred MiB for a one-off build.
        command = [sys.executable, "-m", "mpspool", "demo-model", "--out", str(base)]
        build = subprocess.run(
            [*command, "--embedding-rows", str(rows), "--version", "1"],
            cwd="/",  # not a source checkout, whose supervisor/ would shadow supervisord's
            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        if build.returncode != 0:
            tail = "\n".join(build.stderr.strip().splitlines()[-5:])
            raise ConfigError(f"building the demo model failed:\n{tail}")
    return base


# -- status and stop ----------------------------------------------------------------
# How long `mpspool stop` waits for the controller to take its request before it sends the
# same stop as SIGTERM.
STOP_ANSWER_WAIT_S = 15.0


class PoolNotAnswering(ConfigError):
    """A pool's controller is alive but did not answer (stopped, wedged, busy)."""


def _ask_pool(
    run_dir: Path,
    op: str,
    timeout_s: float = 5.0,
    endpoint: str = wire.ADMIN_ENDPOINT,
    **fields: Any,
) -> dict[str, Any]:
    """One request to the pool's controller (admin endpoint) or router (control endpoint),
    both unix sockets in the private run dir: admin actions are local only."""
    info = rundir.read_controller(run_dir)
    if not rundir.controller_alive(info):
        raise ConfigError(f"no pool is running in {run_dir}")
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(wire.endpoint(str(run_dir), endpoint))
        sock.send_multipart([b"", wire.pack(op=op, **fields)])
        if not sock.poll(int(timeout_s * 1000)):
            where = f"the pool in {run_dir} (pid {info['pid']})"
            path = wire.socket_path(str(run_dir), endpoint)
            if not os.path.exists(path):
                # Removed by hand or by a cleaner of old files: nothing can reach the pool
                # there, however long one waits (it said "did not answer", as if busy).
                raise PoolNotAnswering(f"{where} cannot be reached: its socket {path} is gone")
            raise PoolNotAnswering(f"{where} did not answer within {timeout_s:.0f} s")
        return wire.unpack(sock.recv_multipart()[-1])
    finally:
        sock.close()
        context.term()


def cmd_timeline(args: argparse.Namespace) -> int:
    taken = _ask_pool(
        args.run_dir.resolve(), "timeline", endpoint=wire.CONTROL_ENDPOINT, clear=args.clear
    )
    if "error" in taken:
        raise ConfigError(f"the router refused: {taken['error']}")
    taken.pop("n", None)
    print(json.dumps(taken, separators=(",", ":")))
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    status = _ask_pool(args.run_dir.resolve(), "status")
    if "error" in status:
        # The controller's refusal, said as such: it failed with a traceback (KeyError) where
        # a status could not be made (found by a hunt).
        print(f"mpspool: the pool could not give its status: {status['error']}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(status, indent=2))
        return 0
    pool = status["pool"]
    # While it starts, its version is not chosen yet and its front door not listening.
    version = pool["version"] if pool["version"] is not None else "-"
    print(
        f"pool {pool['pool_id']} (pid {pool['pid']}) {pool['phase']}: model {pool['model']!r} "
        f"version {version} on {pool['listen'] or 'no port yet'}, up {pool['uptime_s']} s"
    )
    if pool.get("grpc_socket"):
        print(f"gRPC also on: {pool['grpc_socket']}")
    if pool.get("rest"):
        print(f"REST API: {pool['rest']}")
    if pool.get("metrics"):
        print(f"metrics: {pool['metrics']}")
    if pool.get("models_waiting"):
        names = ", ".join(pool["models_waiting"])
        print(f"waiting for a first version (model config file): {names}")
    if pool.get("cpu_placement"):
        front = pool.get("router_cpus") or "-"
        print(f"CPUs: {pool['cpu_placement']} (front door now on {front})")
    models = status.get("models") or [
        {"name": pool["model"]}
        | {k: pool.get(k) for k in ("version_policy", "version_labels", "labels_in_effect")}
        | {"versions": status.get("versions", [])}
    ]
    for model in models:
        # A pool of several models: a line of each model's versions and labels, by name.
        which = f"model {model['name']!r} " if len(models) > 1 else ""
        versions = ", ".join(
            f"{v['version']} {v['state']}" + (f" ({v['error']})" if v["error"] else "")
            for v in model["versions"]
        )
        print(f"{which}versions ({model.get('version_policy')}): {versions or '-'}")
        if model.get("version_labels"):
            labels = _labels_text(model["version_labels"], model.get("labels_in_effect"))
            print(f"{which}labels: {labels}")
    print(
        f"{'SLOT':<10} {'VERSION':>7} {'STATE':<9} {'PID':>7} {'UPTIME':>8} {'RESTARTS':>8} "
        f"{'INFLIGHT':>8} {'SERVED':>9}  {'CPUS':<9} {'WEIGHTS':<25} REASON"
    )
    front = status.get("front_door")
    if front:
        # The front door's row: no version, in-flight count or weights of its own.
        uptime = f"{front['uptime_s']:.0f}s" if front["uptime_s"] is not None else "-"
        print(
            f"{'front-door':<10} {'-':>7} {front['state']:<9} {front['pid'] or '-':>7} "
            f"{uptime:>8} {front['restarts']:>8} {'-':>8} {'-':>9}  "
            f"{front.get('cpus') or '-':<9} {'-':<25} {front.get('reason') or ''}"
        )
    for s in status["slots"]:
        uptime = f"{s['uptime_s']:.0f}s" if s["uptime_s"] is not None else "-"
        slot = f"{s['model']}/{s['slot']}" if s.get("model") else s["slot"]
        print(
            f"{slot:<10} {s['version']:>7} {s['state']:<9} {s['pid'] or '-':>7} {uptime:>8} "
            f"{s['restarts']:>8} {s['inflight']:>8} {s['served']:>9}  {s.get('cpus') or '-':<9} "
            f"{_weights(s.get('weights')):<25} {s['reason']}"
        )
    for g in status.get("gpus", []):
        servers = g.get("servers", {})
        clients = sum(len(c) for c in servers.values()) if isinstance(servers, dict) else "?"
        usage = (
            f", {g['memory_used'] / 2**20:.0f} MiB used, {g['utilization_gpu']}% busy"
            if "memory_used" in g
            else ""
        )
        if "down" in g:
            # Its daemon did not answer after a fault: its workers wait for it.
            print(
                f"GPU {g['index']} {g['uuid']}: DOWN (MPS daemon {g['mps']}, try "
                f"{g['down']['tries']}): {g['down']['why']}{usage}"
            )
            continue
        print(
            f"GPU {g['index']} {g['uuid']}: MPS daemon {g['mps']}, "
            f"{len(servers) if isinstance(servers, dict) else '?'} server(s), {clients} client(s), "
            f"defaults {g.get('defaults', {})}{usage}"
        )
    return 0


def _weights(report: dict[str, Any] | None) -> str:
    """Short form of where a worker's variables live, for the status table: COPIED (what
    TensorFlow copied into it) or shared, what it holds on its GPU, and how many variables
    still shared a served function may yet copy (its worker watches them while it serves;
    `--json` names them and why)."""
    if not report:
        return "-"
    if report["copied"]:
        where = f"COPIED {_size(sum(report['copied'].values()))}"
    else:
        where = f"shared {_size(report['shared_bytes'])}"
    if report.get("on_device"):  # a GPU worker's own copy in device memory
        where += f", GPU {_size(sum(report['on_device'].values()))}"
    at_risk = len(set(report.get("at_risk") or {}) - set(report["copied"]))
    return f"{where}, {at_risk} at risk" if at_risk else where


def _size(n: int) -> str:
    """Bytes in the largest binary unit that leaves at least 1: 1.6KiB, 488MiB."""
    value, unit = float(n), "B"
    for larger in ("KiB", "MiB", "GiB", "TiB"):
        if value < 1023.5:  # what would print as 1024 goes up a unit
            break
        value, unit = value / 1024, larger
    return f"{value:.1f}{unit}" if value < 10 and unit != "B" else f"{value:.0f}{unit}"


def _labels_text(configured: dict[str, int], in_effect: dict[str, int] | None) -> str:
    """A model's labels as status shows them: each configured label, and for one that waits
    for its version to serve, where the front door resolves it meanwhile (`in_effect`, its
    labels; None from a pool that does not say). Status showed the configured label alone,
    while requests by it were answered by another version (found by a reload hunt)."""
    shown = []
    for label, version in sorted(configured.items()):
        now = version if in_effect is None else in_effect.get(label)
        if now == version:
            shown.append(f"{label}={version}")
        elif now is None:
            shown.append(f"{label}={version} (waits for version {version})")
        else:
            shown.append(f"{label}={version} (waits for version {version}; on {now} meanwhile)")
    return ", ".join(shown)


def cmd_stop(args: argparse.Namespace) -> int:
    run_dir = rundir.absolute(args.run_dir)
    rundir.check_owned(run_dir)
    info = rundir.read_controller(run_dir)
    try:
        # Longer than status's 5 s: a controller may be held that long (a GPU's daemon
        # waited for), and a SIGTERM after its stop began would end the drain early.
        _ask_pool(run_dir, "stop", timeout_s=STOP_ANSWER_WAIT_S)
    except PoolNotAnswering as exc:
        # SIGTERM is the same orderly stop (Kubernetes' way): taken as soon as the controller
        # runs again, where the request on its socket may wait behind whatever holds it.
        # Then SIGCONT, as systemd and a shell's `kill` do: a controller stopped (SIGSTOP,
        # or Ctrl-Z in its terminal) took the SIGTERM only once continued, and the stop
        # waited out its --timeout and failed.
        print(f"mpspool: {exc}; sending it SIGTERM", file=sys.stderr)
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(info["pid"]), signal.SIGTERM)
            os.kill(int(info["pid"]), signal.SIGCONT)
    deadline = time.monotonic() + args.timeout
    # Not psutil's wait(): the controller may be someone else's child, a zombie until reaped.
    while rundir.controller_alive(info):
        if time.monotonic() > deadline:
            print(
                f"mpspool: the pool (pid {info['pid']}) is still stopping "
                f"after {args.timeout:.0f} s",
                file=sys.stderr,
            )
            return 1
        time.sleep(0.1)
    print(f"mpspool: pool in {run_dir} stopped")
    return 0


def cmd_demo_model(args: argparse.Namespace) -> int:
    from mpspool.demo_model import DEFAULT_ROWS, build_demo_model

    rows = args.embedding_rows or DEFAULT_ROWS
    started = time.monotonic()
    target = args.out / str(args.model_version)
    if target.exists():
        # Versions are immutable, as TF Serving treats them: never written over.
        if args.exist_ok:
            print(f"mpspool: {target} is already there; kept as it is")
            return 0
        raise ConfigError(
            f"model version directory {target} already exists; versions are immutable: choose "
            "another --version, remove it, or pass --exist-ok to keep it"
        )
    path = build_demo_model(args.out, embedding_rows=rows, version=args.model_version)
    print(
        f"mpspool: wrote the demo model ({rows} rows) to {path} "
        f"in {time.monotonic() - started:.1f} s"
    )
    return 0
