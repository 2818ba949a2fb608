"""Plain single-process serving: one TensorFlow process behind a gRPC server speaking TF
Serving's PredictionService, written with the official APIs only.

This is the baseline a user writes before reaching for a serving system (the "one session"
of the seed documents): ``tf.saved_model.load``, the ``serving_default`` signature called
from the handler threads of a synchronous ``grpc.server``, requests decoded with
``tf.make_ndarray`` and answers encoded with ``tf.make_tensor_proto``, the servicer
registered through ``tensorflow_serving.apis.prediction_service_pb2_grpc``. One process and
one loaded model: the signature is called concurrently by the handler threads, sharing one
intra-op thread pool of all cores (TF Serving's CPU advice: intra-op threads = cores,
inter-op threads small).

    .venv/bin/python -m bench.peers.plain --model-dir ~/.cache/mpspool/bench-demo-1000/1 \\
        --port 18600 --instances 1

Follows the peer contract of ``bench.peers``; ``--instances`` exists for that contract and
must be 1.

matplotlib is kept out of its TensorFlow import, as the pool's workers keep it out
(worker/serve.py, ``_keep_plotting_out``): bench/ installs it for its plots, and Keras, which
TensorFlow loads, would import it (0.4 s of CPU, 28 MiB), so the server is measured as it
runs where matplotlib is not installed, and like for like with the workers.
"""

from __future__ import annotations

import sys

sys.modules.setdefault("matplotlib", None)  # type: ignore[arg-type]

import argparse
import logging
import os
import signal
import threading
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
from tensorflow_serving.apis import prediction_service_pb2_grpc

from bench.peers.tfserving import PredictModel, Refused
from mpspool import process
from mpspool.config import usable_cores

log = logging.getLogger("bench.peers.plain")

# Enough handler threads for the comparison's highest concurrency (16): every request in
# flight is being served, none waits for a thread.
DEFAULT_GRPC_THREADS = 16
MAX_MESSAGE_BYTES = 512 * 1024 * 1024
STOP_GRACE_S = 5.0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.peers.plain", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--model-dir", type=Path, required=True, help="a SavedModel version directory"
    )
    parser.add_argument("--port", type=int, required=True, help="port on 127.0.0.1 (0: any)")
    parser.add_argument(
        "--instances",
        type=int,
        default=1,
        help="must be 1: this peer is one process with one loaded model by definition",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="TensorFlow intra-op threads (default 0: usable cores)",
    )
    parser.add_argument(
        "--model-name", default="demo", help="the name requests must give (%(default)s)"
    )
    parser.add_argument(
        "--grpc-threads",
        type=int,
        default=DEFAULT_GRPC_THREADS,
        help="gRPC handler threads (%(default)s)",
    )
    return parser


class PlainPredictionService(prediction_service_pb2_grpc.PredictionServiceServicer):
    """PredictionService.Predict over one loaded SavedModel (bench.peers.tfserving); the
    other methods answer UNIMPLEMENTED (the generated base class)."""

    def __init__(self, model_dir: Path, name: str, intra_op_threads: int) -> None:
        self.model = PredictModel(model_dir, name, intra_op_threads)

    def Predict(self, request: Any, context: Any) -> Any:
        try:
            return self.model.predict(request)
        except Refused as refused:
            context.abort(getattr(grpc.StatusCode, refused.code), refused.message)


def serve(args: argparse.Namespace) -> int:
    stop = threading.Event()

    def on_signal(signum: int, _frame: Any) -> None:
        # Only record it; the main thread stops the server.
        if stop.is_set():
            os._exit(0)  # a second signal: the user is in a hurry
        log.info("signal %d: stopping", signum)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    threads = args.threads or usable_cores()
    log.info("loading %s (intra-op threads %d, inter-op 1)", args.model_dir, threads)
    service = PlainPredictionService(args.model_dir, args.model_name, threads)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=args.grpc_threads, thread_name_prefix="predict"),
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            # Fail on a port in use instead of sharing it with another server.
            ("grpc.so_reuseport", 0),
        ],
    )
    prediction_service_pb2_grpc.add_PredictionServiceServicer_to_server(service, server)
    try:
        port = server.add_insecure_port(f"127.0.0.1:{args.port}")
    except RuntimeError as exc:
        log.error("cannot listen on 127.0.0.1:%d: %s", args.port, exc)
        return 1
    if not port:
        log.error("cannot listen on 127.0.0.1:%d", args.port)
        return 1
    server.start()
    log.info("serving %r version %d on 127.0.0.1:%d", args.model_name, service.model.version, port)
    while not stop.wait(1.0):
        pass
    server.stop(STOP_GRACE_S).wait()
    log.info("stopped")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.instances != 1:
        build_parser().error(f"--instances must be 1 for this peer, got {args.instances}")
    if args.threads < 0 or args.grpc_threads < 1:
        build_parser().error("--threads must be >= 0 and --grpc-threads >= 1")
    process.die_with_parent()
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="%(asctime)s plain %(levelname)s %(message)s"
    )
    return serve(args)


if __name__ == "__main__":
    sys.exit(main())
