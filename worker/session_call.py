"""Run a loaded signature in a TensorFlow session, on the calling thread.

The eager call of a function, even straight through the C API (worker/direct_call.py), sets
up an eager operation, a multi-device function run, a rendezvous and a cancellation scope
per call, and hands the function's graph to TensorFlow's inter-op thread (``tf_Compute``),
waiting for it: one thread switch per request. A session (the API TF Serving's own predictor
runs models through) does the set-up once per callable (``Session::MakeCallable``), and with
``RunOptions.inter_op_thread_pool = -1`` runs the graph on the caller's thread; that is done
with one inter-op thread, the pool's default (more are for running a graph's branches side
by side). Measured on the 2,000,000-row demo model at batch 1, one process calling back to
back with one intra-op and one inter-op thread: 68-81 µs of CPU per direct call (and one
``tf_Compute`` switch), 17-19 µs per session call, same answers (bench/RESULTS.md, "Worker
call path").

The session's graph is the signature function itself, called with placeholders for its
inputs and one session variable per captured variable. Each session variable is assigned
the same bytes the eager variable reads: its view of the shared weight segment, fed as an
aligned numpy array, which TensorFlow adopts without copying (as it adopts the eager side's
DLPack buffer). So the session path is built only for shared weights (the gathers already
rewritten so that reads do not copy) with nothing that may write or copy a variable, and
only on the host: on a GPU the eager context's placement and memory settings stay in charge.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from mpspool.signature import SignatureSpec

log = logging.getLogger("mpspool.worker")

# RunOptions.inter_op_thread_pool: "-1 uses the caller thread to execute Session::Run()".
CALLER_THREAD = -1
# EIGEN_MAX_ALIGN_BYTES: a fed array aligned to it is adopted, any other is copied.
ALIGNMENT = 64


class SessionCall:
    """One signature as a session callable: numpy arrays in, numpy arrays out."""

    def __init__(
        self,
        session: Any,
        callable_options: Any,
        order: Sequence[str],
        outputs: Sequence[str],
        has_loop: bool = False,
    ) -> None:
        # The session must outlive its callable; both live as long as this object.
        self._session = session
        self._callable = session._make_callable_from_options(callable_options)
        self._order = list(order)  # input aliases, in the callable's feed order
        self.outputs = list(outputs)  # alias of each fetch, in order
        # Whether a cancellation could stop its graph halfway (worker/runtime.py, canceller):
        # TensorFlow stops a call at a loop's next turn, never inside an op. A session call
        # cannot be stopped at all (its run options are fixed when it is made, and on the
        # caller's thread even their timeout stops nothing).
        self.has_loop = has_loop

    def __call__(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """alias → array of every output; TensorFlow's OpError subclasses on failure.

        ``inputs`` hold every input alias (checked against the signature by the front door)."""
        fetched = self._callable(*[inputs[alias] for alias in self._order])
        return dict(zip(self.outputs, fetched, strict=True))

    def close(self) -> None:
        self._callable = None
        self._session.close()


def session_call(
    function: Any,
    order: Sequence[str] | None,
    spec: SignatureSpec,
    shared_views: Mapping[int, np.ndarray],
    intra_op_threads: int,
    inter_op_threads: int,
) -> SessionCall | None:
    """The session call of a loaded signature function, or None (the reason logged at debug
    level) when it cannot be built as described above; then the direct call serves.

    ``order`` is the signature's input aliases in the graph's argument order; ``shared_views``
    maps id() of each variable bound to the weight segment to its view of the segment.
    """
    if not order:
        return None
    import tensorflow as tf

    if tf.config.list_logical_devices("GPU"):
        log.debug("no session call for %s: a GPU is visible", spec.key)
        return None
    try:
        captured = list(function.captured_inputs)
        variables = {id(v.handle): v for v in function.variables}
        input_specs = function.structured_input_signature[1]
    except (AttributeError, TypeError, IndexError) as exc:
        log.debug("no session call for %s: %s", spec.key, exc)
        return None
    # Every capture must be a variable read from the segment: a lookup table, a captured
    # constant or a variable with a private buffer has no session counterpart built here.
    bound = [variables.get(id(c)) for c in captured]
    if any(v is None or id(v) not in shared_views for v in bound):
        log.debug("no session call for %s: a capture is not a shared variable", spec.key)
        return None
    if set(input_specs) != set(order):
        return None
    # What TensorFlow would take without a word and get wrong: a buffer it must copy (not
    # aligned as its own allocator aligns), or one of another shape or type than the variable.
    for variable in bound:
        view = shared_views[id(variable)]
        if (
            view.ctypes.data % ALIGNMENT
            or not variable.shape.is_compatible_with(view.shape)  # one left open: any fits
            or view.dtype != variable.dtype.as_numpy_dtype
        ):
            log.debug("no session call for %s: the view of %s", spec.key, variable.name)
            return None

    graph = tf.Graph()
    with graph.as_default():
        feeds = [
            tf.compat.v1.placeholder(input_specs[a].dtype, input_specs[a].shape) for a in order
        ]
        handles, values, assigns = [], [], []
        for index, variable in enumerate(bound):
            handle = tf.raw_ops.VarHandleOp(
                dtype=variable.dtype, shape=variable.shape, shared_name=f"capture_{index}"
            )
            # No static shape: Grappler kept 1 bit per element (16 MiB of a 488 MiB table)
            # when optimizing an assignment from a fully defined placeholder.
            value = tf.compat.v1.placeholder(variable.dtype)
            assigns.append(tf.raw_ops.AssignVariableOp(resource=handle, value=value))
            handles.append(handle)
            values.append(value)
        try:
            result = function._call_flat(feeds, handles)
        except Exception as exc:  # any refusal to be called in a graph means "not plain"
            log.debug("no session call for %s: calling it in a graph failed: %s", spec.key, exc)
            return None
    if not isinstance(result, dict) or set(result) != set(spec.outputs):
        return None
    # A resource the function creates or finds by name (a TF1 graph's lookup table, its
    # queue) lives in the eager context, filled by its initializer there; in the session
    # the same name would be a new, empty resource.
    ours = {h.op.name for h in handles}
    graph_def = graph.as_graph_def()
    named = _named_resources(graph_def, ours)
    if named:
        log.debug("no session call for %s: it creates resources by name: %s", spec.key, named)
        return None
    outputs = sorted(result)

    from tensorflow.core.protobuf.config_pb2 import CallableOptions

    options = CallableOptions(
        feed=[t.name for t in feeds], fetch=[result[alias].name for alias in outputs]
    )
    if inter_op_threads == 1:
        # One inter-op thread (the pool's default) runs one op at a time anyway; so does the
        # caller, without the hand-off. Asked for more, the graph's branches get them.
        options.run_options.inter_op_thread_pool = CALLER_THREAD
        # The caller's thread (the worker's main thread, which builds and makes every call)
        # flushes denormals as TensorFlow's own threads do.
        flush_denormals_on_this_thread(tf)
    config = tf.compat.v1.ConfigProto(
        intra_op_parallelism_threads=intra_op_threads,
        inter_op_parallelism_threads=inter_op_threads,
    )
    session = tf.compat.v1.Session(graph=graph, config=config)
    try:
        # TensorFlow adopts a fed array's buffer when it is 64-byte aligned (the segment's
        # tensors are, for DLPack's sake) and AssignVariableOp keeps the tensor it is given.
        # A model without variables has nothing to assign (a callable of no target is
        # refused: such models lost their session call; found by a hunt).
        if assigns:
            assign = session._make_callable_from_options(
                CallableOptions(feed=[v.name for v in values], target=[a.name for a in assigns])
            )
            assign(*[shared_views[id(v)] for v in bound])
            del assign
        return SessionCall(session, options, order, outputs, has_loop=has_loop(graph_def))
    except Exception as exc:  # TensorFlow's refusal of this graph: the direct call serves
        session.close()
        log.info("no session call for %s: %s: %s", spec.key, type(exc).__name__, exc)
        return None


# tsl::port::SetDenormalState(const DenormalState&), which TensorFlow's thread pools call
# (ScopedFlushDenormal) on each thread they make; its older name in tensorflow::port.
_SET_DENORMAL_STATE = (
    "_ZN3tsl4port16SetDenormalStateERKNS0_13DenormalStateE",
    "_ZN10tensorflow4port16SetDenormalStateERKNS0_13DenormalStateE",
)


def flush_denormals_on_this_thread(tf: Any) -> bool:
    """This thread flushes denormal floats to zero, and reads them as zero, as every thread
    TensorFlow runs kernels on does: kernels a session runs on the caller's thread (above)
    kept denormals, so a model's answers differed from TensorFlow's and TF Serving's, and
    with the batch size (1e-40 stayed 1e-40 up to 100,000 values, and became 0 at 1,000,000,
    where Eigen moved the work to its pool; found by a hunt). Set by TensorFlow's own
    function, through its library; False, said in the log, where that cannot be done."""
    import ctypes
    from pathlib import Path

    library = Path(tf.sysconfig.get_lib()) / "libtensorflow_framework.so.2"
    try:
        framework = ctypes.CDLL(str(library))
    except OSError as exc:
        log.warning("denormals are not flushed on the session call's thread: %s", exc)
        return False
    for name in _SET_DENORMAL_STATE:
        set_state = getattr(framework, name, None)
        if set_state is not None:
            break
    else:
        log.warning("denormals are not flushed on the session call's thread: %s has no "
                    "SetDenormalState", library)  # fmt: skip
        return False
    set_state.argtypes = [ctypes.c_void_p]
    set_state.restype = ctypes.c_bool
    # DenormalState: bool flush_to_zero_, bool denormals_are_zero_.
    state = (ctypes.c_bool * 2)(True, True)
    if not set_state(ctypes.byref(state)):  # a platform without the setting
        log.warning("denormals are not flushed on the session call's thread: TensorFlow "
                    "cannot set that on this platform")  # fmt: skip
        return False
    return True


def _library_nodes(graph_def: Any) -> Iterator[Any]:
    """Every node of the graph's function library."""
    for function in graph_def.library.function:
        yield from function.node_def


def _named_resources(graph_def: Any, ours: set[str]) -> list[str]:
    """The ops in the graph and its function library that take a ``shared_name``."""
    nodes = itertools.chain(
        (n for n in graph_def.node if n.name not in ours), _library_nodes(graph_def)
    )
    return sorted({n.op for n in nodes if "shared_name" in n.attr})


# Ops that make a loop: TF2's While (StatelessWhile when nothing in it is stateful) and the
# TF1 control flow it is lowered to, which a TF1 graph may hold as it is.
LOOP_OPS = frozenset({"While", "StatelessWhile", "_While", "Enter", "LoopCond"})


def has_loop(graph_def: Any) -> bool:
    """Whether the graph (or a function of its library) holds a loop."""
    nodes = itertools.chain(graph_def.node, _library_nodes(graph_def))
    return any(n.op in LOOP_OPS for n in nodes)
