"""The Triton peer: the demo SavedModel behind Triton Inference Server, served through PyTriton.

    .tools/pytriton-venv/bin/python -m bench.peers.triton --model-dir VERSION_DIR --port PORT \\
        --instances N [--threads T]

(``bench/peers/setup-pytriton`` makes that virtualenv.) Clients speak KServe v2 gRPC
(``inference.GRPCInferenceService/ModelInfer``, model "demo") on 127.0.0.1:PORT; Triton's HTTP
endpoint, which PyTriton itself polls while starting, gets a free port on 127.0.0.1 and its
metrics endpoint is off.

How PyTriton runs it, and the choices made here (after PyTriton's docs):
- Processes: this one loads the model and runs the inference callables; PyTriton starts
  ``tritonserver``, which starts one Python-backend stub per model instance; one stub starts
  the manager of the shared-memory blocks that tensors travel in between the stubs and this
  process, and multiprocessing adds its resource trackers. tritonserver gets SIGTERM when
  this process dies (PyTriton sets that) and takes the rest with it, so even a SIGKILL here
  leaves no process behind (only files: PyTriton's workspace in ~/.cache/pytriton, Triton's
  copy of the model in /tmp).
- N instances: PyTriton's way is a list of N inference callables bound to one model, which
  becomes ``instance_group [{count: N, kind: KIND_CPU}]``; each callable serves one instance
  from its own thread here. The N callables share one loaded SavedModel: TensorFlow
  functions are thread-safe, and N copies of a 488 MiB embedding table would only cost
  memory (PyTriton's multi-instance example loads one copy per *device*; on a CPU there is
  one device).
- Threads: TensorFlow's thread pools belong to the process, not to a callable: the N
  instances share one intra-op pool of T threads and one inter-op thread. Each instance's
  own thread also does kernel work (TensorFlow runs a share of every sharded kernel, and all
  of it with T = 1, on the calling thread), so N concurrent instances keep up to N*T cores
  busy, as N workers with T threads each would. (Measured with 2 concurrent callers on 2
  cores: a pool of 2 instead of 1 gave no steady gain at batch 1 and less at batch 256.)
- Batching: the callables take ``@batch``-merged inputs, with Triton's dynamic batcher on
  (PyTriton's default, ``ModelConfig(batching=True)``, no queue delay) and
  ``max_batch_size`` = 256, so concurrent batch-1 requests are merged by Triton and a
  batch-256 request runs alone.

The Python backend stub links libpython: this interpreter's LIBDIR goes first on
LD_LIBRARY_PATH before Triton starts (the server's environment is copied from ours), so the
stub gets this Python's library and not the system's, which may be another patch release.
"""

from __future__ import annotations

import argparse
import logging
import os
import queue
import signal
import socket
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

import numpy as np

from mpspool.process import die_with_parent

MODEL_NAME = "demo"
SIGNATURE = "serving_default"
MAX_BATCH_SIZE = 256
# How often the main loop checks that Triton and the instances are still alive.
POLL_S = 1.0

log = logging.getLogger("bench.peers.triton")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.peers.triton", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--model-dir", type=Path, required=True, help="SavedModel version dir")
    parser.add_argument("--port", type=int, required=True, help="gRPC port on 127.0.0.1")
    parser.add_argument("--instances", type=int, default=1, help="Triton model instances")
    parser.add_argument(
        "--threads", type=int, default=0, help="intra-op threads per instance (cores // N)"
    )
    return parser


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        return os.cpu_count() or 1


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _put_libpython_first() -> str:
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    paths = [p for p in os.environ.get("LD_LIBRARY_PATH", "").split(":") if p]
    if libdir and (not paths or paths[0] != libdir):
        os.environ["LD_LIBRARY_PATH"] = ":".join([libdir, *paths])
    return libdir


def _load(model_dir: Path, intra: int, inter: int) -> tuple[Any, Any]:
    """The serving signature of the SavedModel, with TensorFlow's threads set, warmed up."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    # Before anything runs: TensorFlow fixes its pools on first use.
    tf.config.threading.set_intra_op_parallelism_threads(intra)
    tf.config.threading.set_inter_op_parallelism_threads(inter)
    model = tf.saved_model.load(str(model_dir), tags=["serve"])
    if SIGNATURE not in model.signatures:
        raise ValueError(
            f"{model_dir} has no signature {SIGNATURE!r}: got {sorted(model.signatures)}"
        )
    signature = model.signatures[SIGNATURE]
    # The first call builds the function's kernels; do it before Triton answers anyone.
    _, specs = signature.structured_input_signature
    signature(
        **{name: tf.zeros([1, *spec.shape[1:]], dtype=spec.dtype) for name, spec in specs.items()}
    )
    return model, signature


def _tensors(specs: dict[str, Any], what: str) -> list[Any]:
    """PyTriton tensor specs (per example: the batch dimension is Triton's) of TF specs."""
    from pytriton.model_config import Tensor

    tensors = []
    for name, spec in sorted(specs.items()):
        dims = spec.shape.as_list()
        if not dims or dims[0] is not None:
            raise ValueError(f"{what} {name!r} has shape {dims}: expected a batch dimension")
        tensors.append(
            Tensor(
                name=name,
                dtype=spec.dtype.as_numpy_dtype,
                shape=tuple(-1 if d is None else d for d in dims[1:]),
            )
        )
    return tensors


def _infer_callables(model: Any, signature: Any, count: int) -> list[Any]:
    """``count`` inference callables over the one signature, one per Triton instance."""
    import tensorflow as tf
    from pytriton.decorators import batch

    _, input_specs = signature.structured_input_signature

    class Instance:
        """One instance's callable (PyTriton's class form). It holds ``model`` as well: a
        signature alone does not keep the loaded object's variables alive."""

        def __init__(self) -> None:
            self.model = model
            self.signature = signature

        @batch
        def __call__(self, **inputs: np.ndarray) -> dict[str, np.ndarray]:
            feeds = {
                name: tf.convert_to_tensor(inputs[name], dtype=spec.dtype)
                for name, spec in input_specs.items()
            }
            return {name: value.numpy() for name, value in self.signature(**feeds).items()}

    return [Instance() for _ in range(count)]


def serve(args: argparse.Namespace, signals: queue.SimpleQueue[int]) -> int:
    from pytriton.model_config import ModelConfig
    from pytriton.triton import Triton, TritonConfig

    instances = args.instances
    threads = args.threads or max(1, _usable_cores() // instances)
    started = time.perf_counter()
    model, signature = _load(args.model_dir, intra=threads, inter=1)
    log.info(
        "loaded %s in %.1f s (%d instances sharing %d intra-op and 1 inter-op threads)",
        args.model_dir, time.perf_counter() - started, instances, threads,
    )  # fmt: skip

    _, input_specs = signature.structured_input_signature
    config = TritonConfig(
        grpc_address="127.0.0.1",
        grpc_port=args.port,
        http_address="127.0.0.1",
        http_port=_free_port(),
        allow_metrics=False,
        allow_gpu_metrics=False,
        allow_cpu_metrics=False,
        # When asked to stop, Triton waits up to this long for in-flight requests and for
        # the model to unload (about 4 s here: the stubs finalize), then exits regardless; cut
        # short, it leaves its copy of the model in /tmp. Its default is 30 s.
        exit_timeout_secs=10,
    )
    triton = Triton(config=config)
    try:
        triton.bind(
            model_name=MODEL_NAME,
            infer_func=_infer_callables(model, signature, instances),
            inputs=_tensors(input_specs, "input"),
            outputs=_tensors(signature.structured_outputs, "output"),
            config=ModelConfig(max_batch_size=MAX_BATCH_SIZE),
        )
        triton.run()
        log.info(
            "serving %r on 127.0.0.1:%d (KServe v2 gRPC) after %.1f s",
            MODEL_NAME, args.port, time.perf_counter() - started,
        )  # fmt: skip
        while True:
            try:
                sig = signals.get(timeout=POLL_S)
            except queue.Empty:
                if not triton.is_alive():
                    log.error("Triton or a model instance stopped; shutting down")
                    return 1
                continue
            log.info("%s: stopping", signal.Signals(sig).name)
            return 0
    finally:
        triton.stop()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # PyTriton echoes tritonserver's output with print(); a peer logs to stderr only.
    sys.stdout.flush()
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    logging.basicConfig(
        stream=sys.stderr, level=logging.INFO, format="%(asctime)s %(name)s: %(message)s"
    )
    if args.instances < 1 or args.threads < 0:
        print("triton: --instances must be >= 1 and --threads >= 0", file=sys.stderr)
        return 2
    if not (args.model_dir / "saved_model.pb").is_file():
        print(f"triton: no SavedModel in {args.model_dir}", file=sys.stderr)
        return 2
    # A parent that dies sends us SIGTERM, the signal that stops everything below cleanly;
    # tritonserver and PyTriton's helper process in turn die with this process.
    die_with_parent(signal.SIGTERM)
    signals: queue.SimpleQueue[int] = queue.SimpleQueue()
    for sig in (signal.SIGTERM, signal.SIGINT):
        # Only enqueue: the main loop decides (SimpleQueue.put is safe in a handler).
        signal.signal(sig, lambda signum, _frame: signals.put_nowait(signum))
    libdir = _put_libpython_first()
    log.info("libpython for the Python backend stub from %s", libdir)
    return serve(args, signals)


if __name__ == "__main__":
    sys.exit(main())
