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
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import tensorflow as tf
from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc

from mpspool import process
from mpspool.config import usable_cores

log = logging.getLogger("bench.peers.plain")

SIGNATURE = "serving_default"
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
    """PredictionService.Predict over one loaded SavedModel, answering like TF Serving does
    for the cases a client meets: unknown model or version, unknown signature, bad inputs.
    The other methods answer UNIMPLEMENTED (the generated base class)."""

    def __init__(self, model_dir: Path, name: str, intra_op_threads: int) -> None:
        tf.config.threading.set_intra_op_parallelism_threads(intra_op_threads)
        tf.config.threading.set_inter_op_parallelism_threads(1)
        self.name = name
        # TF Serving's layout: the version is the directory's name.
        self.version = int(model_dir.name) if model_dir.name.isdigit() else 0
        self.loaded = tf.saved_model.load(str(model_dir), tags=["serve"])
        self.serve = self.loaded.signatures[SIGNATURE]
        self.input_names = sorted(self.serve.structured_input_signature[1])

    def Predict(self, request: Any, context: Any) -> Any:
        spec = request.model_spec
        choice = spec.WhichOneof("version_choice")
        if spec.name != self.name or (choice == "version" and spec.version.value != self.version):
            wanted = (
                f"Specific({spec.name}, {spec.version.value})"
                if choice == "version"
                else f"Latest({spec.name})"
            )
            context.abort(grpc.StatusCode.NOT_FOUND, f"Servable not found for request: {wanted}")
        if choice == "version_label" and spec.version_label != str(self.version):
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"Unrecognized servable version label: {spec.version_label}",
            )
        signature = spec.signature_name or SIGNATURE
        if signature != SIGNATURE:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f'Serving signature key "{signature}" not found.',
            )
        sent = sorted(request.inputs)
        if sent != self.input_names:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"input size does not match signature: {len(sent)}!={len(self.input_names)} "
                f"for inputs {sent}, signature expects {self.input_names}",
            )
        try:
            inputs = {k: tf.make_ndarray(v) for k, v in request.inputs.items()}
            outputs = self.serve(**inputs)
        except (tf.errors.InvalidArgumentError, TypeError, ValueError) as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc).strip()[:1000])
        wanted_outputs = list(request.output_filter) or list(outputs)
        unknown = [k for k in wanted_outputs if k not in outputs]
        if unknown:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"output tensor alias not found in signature: {unknown[0]}",
            )
        response = predict_pb2.PredictResponse()
        response.model_spec.name = self.name
        response.model_spec.version.value = self.version
        response.model_spec.signature_name = signature
        for key in wanted_outputs:
            response.outputs[key].CopyFrom(tf.make_tensor_proto(outputs[key].numpy()))
        return response


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
    log.info("serving %r version %d on 127.0.0.1:%d", args.model_name, service.version, port)
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
