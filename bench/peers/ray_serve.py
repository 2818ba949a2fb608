"""Ray Serve: N replicas of a deployment answering TF Serving's PredictionService through Ray
Serve's gRPC proxy, on a local Ray cluster this process starts and stops.

Configured after Ray Serve's own advice for CPU serving (Performance Tuning: reserve cores per
replica with ``ray_actor_options={"num_cpus": ...}``, set ``OMP_NUM_THREADS`` for the deep
learning framework; gRPC guide: ``gRPCOptions`` with the service's
``add_..._Servicer_to_server`` function, a deployment method named like the RPC). Ray gets
the machine's cores (``num_cpus``), each of the N replicas ``cores / N`` of them, so all N fit;
each replica loads the SavedModel with ``tags=["serve"]`` and T intra-op / 1 inter-op
TensorFlow threads. Ray's defaults are kept otherwise: a replica's sync method runs in its
thread pool, up to ``max_ongoing_requests`` (5) at once, and requests are not batched.

The gRPC proxy decodes each PredictRequest with the generated servicer's deserializer and
hands it to a replica; ``Predict`` decodes inputs with ``tf.make_ndarray``, calls the
``serving_default`` signature and answers a PredictResponse of ``tf.make_tensor_proto``
outputs. One Serve application, so clients need no ``application`` metadata: the same
client (raw PredictRequest bytes to ``/tensorflow.serving.PredictionService/Predict``) drives
this peer and every other.

Binding: Ray 2.60's gRPC proxy listens on ``[::]:PORT`` with no option to change it; every Ray
worker this peer starts runs ``_bind_loopback`` (a ``worker_process_setup_hook``) that makes
the proxy listen on ``127.0.0.1:PORT`` and each replica's internal gRPC server on
``127.0.0.1:0``. The HTTP proxy listens on 127.0.0.1 on a free port (Serve has no switch to
turn it off while keeping the gRPC proxy). The dashboard is off. Ray's own services (GCS,
raylet, core workers, agents) still listen on all interfaces or the node's address: Ray turns
a loopback node address into the routable one, and has no bind option for them; they require
Ray's cluster token (on by default in Ray 2.60, kept in ``~/.ray/auth_token``).

Processes: the raylet and GCS die with this process (Ray sets PR_SET_PDEATHSIG on them) and
Ray's workers (controller, proxy, replicas) die with the raylet; Ray's two agents and Python
helpers share this process's process group, the workers do not (Ray gives each its own), but
all share its session. A SIGKILL of this process leaves the two agents running (seen for
over a minute): kill its process group after it. Ray runs its workers at nice 15
(``RAY_worker_niceness``), so they yield to any nice-0 process in the same scheduler
autogroup (session).

    bench/peers/setup-ray   # once: .tools/ray-venv
    .tools/ray-venv/bin/python -m bench.peers.ray_serve \\
        --model-dir ~/.cache/mpspool/bench-demo-1000/1 --port 18700 --instances 2

Follows the peer contract of ``bench.peers``.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mpspool import process

log = logging.getLogger("bench.peers.ray_serve")

SERVICER = (
    "tensorflow_serving.apis.prediction_service_pb2_grpc.add_PredictionServiceServicer_to_server"
)
APP_NAME = "predict"
# serve.shutdown() + ray.shutdown() take a few seconds; past this the peer kills what is left
# so that it still exits within the contract's ~20 s.
SHUTDOWN_DEADLINE_S = 12.0
KILL_GRACE_S = 3.0


class StopRequested(Exception):
    """SIGTERM or SIGINT arrived while Ray and Serve were starting."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.peers.ray_serve", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--model-dir", type=Path, required=True, help="a SavedModel version directory"
    )
    parser.add_argument("--port", type=int, required=True, help="gRPC port on 127.0.0.1")
    parser.add_argument("--instances", type=int, default=1, help="Serve replicas (%(default)s)")
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="TensorFlow intra-op threads per replica (default 0: max(1, cores // instances))",
    )
    parser.add_argument(
        "--model-name", default="demo", help="the name requests must give (%(default)s)"
    )
    return parser


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        return os.cpu_count() or 1


def free_port() -> int:
    """A port free on 127.0.0.1 now (for the HTTP proxy nobody uses)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _bind_loopback() -> None:
    """Runs in every Ray worker of this job: Serve's gRPC servers listen on loopback only.

    Ray Serve 2.60 hard-codes ``[::]`` for its gRPC proxy (``grpc_util.start_grpc_server``
    through ``default_impl.add_grpc_address``) and for each replica's inter-deployment server
    (``replica.add_port_to_grpc_server``); both look the helper up at call time, so replacing
    the module attribute is enough. A Ray without these names binds as it always does, and
    the warning says so.
    """
    import importlib

    def loopback(address: str) -> str:
        return "127.0.0.1:" + address.rsplit(":", 1)[1] if address.startswith("[::]:") else address

    for module_name, attr in (
        ("ray.serve._private.default_impl", "add_grpc_address"),
        ("ray.serve._private.replica", "add_port_to_grpc_server"),
    ):
        try:
            module = importlib.import_module(module_name)
            original = getattr(module, attr)
        except (ImportError, AttributeError):
            logging.getLogger("bench.peers.ray_serve").warning(
                "cannot find %s.%s: Serve binds it on all interfaces", module_name, attr
            )
            continue

        def bind(server: Any, address: str, _original: Any = original) -> Any:
            return _original(server, loopback(address))

        setattr(module, attr, bind)


class PredictReplica:
    """One Serve replica: the SavedModel's serving signature behind ``Predict``.

    Answers like TF Serving for the cases a client meets (unknown model or version, unknown
    signature, bad inputs) through Serve's gRPC context; other PredictionService methods are
    not deployed (Serve answers UNIMPLEMENTED).
    """

    def __init__(self, model_dir: str, model_name: str, intra_op_threads: int) -> None:
        from bench.peers.tfserving import PredictModel

        self.model = PredictModel(model_dir, model_name, intra_op_threads)

    def _refuse(self, grpc_context: Any, code_name: str, details: str) -> Any:
        import grpc
        from tensorflow_serving.apis import predict_pb2

        grpc_context.set_code(getattr(grpc.StatusCode, code_name))
        grpc_context.set_details(details)
        return predict_pb2.PredictResponse()

    def Predict(self, request: Any, grpc_context: Any) -> Any:  # the RPC's name
        from bench.peers.tfserving import Refused

        try:
            return self.model.predict(request)
        except Refused as refused:
            return self._refuse(grpc_context, refused.code, refused.message)


def start(
    args: argparse.Namespace, cores: int, threads: int, install_handlers: Callable[[], None]
) -> None:
    """Start the local Ray cluster, Serve's proxies and the application; returns when every
    replica has loaded the model."""
    import ray
    from ray import serve
    from ray.serve.config import HTTPOptions, gRPCOptions

    ray.init(
        address="local",
        num_cpus=cores,
        include_dashboard=False,
        # The driver's stdout is stderr already (see main); keep the workers' lines too.
        log_to_driver=True,
        runtime_env={"worker_process_setup_hook": _bind_loopback},
    )
    # ray.init installs its own SIGTERM handlers (Python's sys.exit, and the core worker's
    # failure handler, which aborts): take the signals back so that stopping stays clean.
    install_handlers()
    serve.start(
        http_options=HTTPOptions(host="127.0.0.1", port=free_port()),
        grpc_options=gRPCOptions(port=args.port, grpc_servicer_functions=[SERVICER]),
    )
    deployment = serve.deployment(
        PredictReplica,
        name="PredictReplica",
        num_replicas=args.instances,
        ray_actor_options={
            "num_cpus": cores / args.instances,
            # Merged with the job's runtime_env (its setup hook included).
            "runtime_env": {"env_vars": {"OMP_NUM_THREADS": str(threads)}},
        },
    )
    app = deployment.bind(str(args.model_dir.resolve()), args.model_name, threads)
    # A route prefix makes the app an endpoint of the proxies; with one endpoint the gRPC
    # proxy needs no `application` metadata.
    serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)


def stop(started: list[Any]) -> None:
    """Stop Serve and Ray, then kill whatever of ``started`` is still alive.

    ``started`` is a snapshot of this process's descendants taken while serving: Ray's
    workers are children of the raylet and would be orphaned (reparented) if it went first.
    """
    import psutil

    def shut_down() -> None:
        ray = sys.modules.get("ray")
        # Serve's calls start a new local cluster when none is connected (a stop during
        # ray.init): then only the kill below applies.
        if ray is None or not ray.is_initialized():
            return
        try:
            from ray import serve

            serve.shutdown()
        except Exception:
            log.exception("serve.shutdown() failed")
        try:
            ray.shutdown()
        except Exception:
            log.exception("ray.shutdown() failed")

    worker = threading.Thread(target=shut_down, name="shutdown", daemon=True)
    worker.start()
    worker.join(SHUTDOWN_DEADLINE_S)
    if worker.is_alive():
        log.warning(
            "Serve/Ray shutdown took over %.0f s: killing what is left", SHUTDOWN_DEADLINE_S
        )
    try:
        started = started + psutil.Process().children(recursive=True)
    except psutil.Error:
        pass
    alive = []
    names = set()
    for proc in {p.pid: p for p in started}.values():
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                names.add(_name(proc))
                alive.append(proc)
                proc.terminate()
        except psutil.Error:
            pass
    _, still = psutil.wait_procs(alive, timeout=KILL_GRACE_S)
    for proc in still:
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(still, timeout=KILL_GRACE_S)
    if alive:
        log.info("stopped %d leftover process(es): %s", len(alive), ", ".join(sorted(names)))


def _name(proc: Any) -> str:
    try:
        return proc.name()
    except Exception:
        return str(proc.pid)


def serve_forever(args: argparse.Namespace) -> int:
    import psutil

    stop_requested = threading.Event()

    # While Ray is starting, a signal interrupts the start; once it serves (or stops), the
    # main thread's loop handles it.
    interruptible = [True]

    def on_signal(signum: int, _frame: Any) -> None:
        # Only record it, and the main thread stops Serve and Ray; while Ray is still
        # starting (tens of seconds), interrupt the start instead of waiting for it.
        log.info("signal %d: stopping", signum)
        stop_requested.set()
        if interruptible[0]:
            interruptible[0] = False
            raise StopRequested(signum)

    def install_handlers() -> None:
        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)

    install_handlers()
    cores = usable_cores()
    threads = args.threads or max(1, cores // args.instances)
    log.info(
        "Ray with %d CPUs, %d replica(s) of %.2f CPU, %d intra-op / 1 inter-op threads each",
        cores,
        args.instances,
        cores / args.instances,
        threads,
    )
    began = time.monotonic()
    started: list[Any] = []
    try:
        start(args, cores, threads, install_handlers)
        started = psutil.Process().children(recursive=True)
        interruptible[0] = False
        log.info(
            "serving %r on 127.0.0.1:%d (%d replica(s), ready in %.1f s)",
            args.model_name,
            args.port,
            args.instances,
            time.monotonic() - began,
        )
        while not stop_requested.wait(1.0):
            pass
        return 0
    except StopRequested:
        return 0
    except SystemExit as exc:
        # ray.init's own SIGTERM handler (sys.exit(signum)), active while it starts.
        if exc.code != signal.SIGTERM:
            raise
        log.info("signal %d: stopping", exc.code)
        return 0
    except Exception:
        log.exception("Ray Serve failed")
        return 1
    finally:
        interruptible[0] = False
        stop(started)
        log.info("stopped")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.instances < 1 or args.threads < 0:
        parser.error("--instances must be >= 1 and --threads >= 0")
    if not (args.model_dir / "saved_model.pb").is_file():
        parser.error(f"--model-dir {args.model_dir} holds no saved_model.pb")
    # Parent gone: stop cleanly (SIGTERM reaches on_signal), so Ray is shut down too; Ray's
    # raylet and GCS are themselves fate-shared with this process (PR_SET_PDEATHSIG).
    process.die_with_parent(signal.SIGTERM)
    # Logs to stderr only: Ray forwards the workers' stdout to the driver's stdout, and its
    # own processes inherit this descriptor.
    sys.stdout.flush()
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s ray_serve %(levelname)s %(message)s",
    )
    return serve_forever(args)


if __name__ == "__main__":
    sys.exit(main())
