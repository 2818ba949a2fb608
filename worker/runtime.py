"""The model runtime a worker serves from: load a SavedModel, describe its signatures, run them.

The worker talks to a model only through ModelRuntime, so that how the model gets its weights
(plain loading here; attaching a shared-memory segment later) can change without touching
the serving loop. Errors leave this module in two forms only: ModelLoadError while loading
(the worker cannot serve; the supervisor should not respawn it in a loop), and
mpspool.errors.ServingError while running (one request failed; the worker keeps serving).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import re
import shutil
import tempfile
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from mpspool import dtypes
from mpspool.errors import Code, ServingError, code_of, code_of_os_error
from mpspool.protos import serving_pb2
from mpspool.signature import MAX_STRING_RANK, SignatureSpec, specs_from_signature_defs
from mpspool.worker.direct_call import DirectCall, direct_call
from mpspool.worker.session_call import SessionCall, has_loop, session_call
from mpspool.worker.stateful import calls_python, writes_a_variable, writes_state

log = logging.getLogger("mpspool.worker")

SERVE_TAG = "serve"
SAVED_MODEL_PB = "saved_model.pb"
SAVED_MODEL_PBTXT = "saved_model.pbtxt"


class ModelLoadError(Exception):
    """A model could not be loaded; the message says what failed and where, ``code`` the
    status TF Serving's loader gives that failure (what GetModelStatus reports for the
    version: NOT_FOUND for a missing SavedModel, DATA_LOSS for a corrupt one, ...)."""

    def __init__(self, message: str, code: Code = Code.UNKNOWN) -> None:
        super().__init__(message)
        self.code = code


class WeightsUnavailable(ModelLoadError):
    """The shared weights could not be had (their publish failed, the segment went): not a
    failure of the SavedModel, which the publisher's own failure counts once."""


class ModelRefused(ModelLoadError):
    """A model the pool's own settings refuse (weights it cannot share): no load retry can
    change that, only other flags (--no-share-weights) can."""

    def __init__(self, message: str, code: Code = Code.FAILED_PRECONDITION) -> None:
        super().__init__(message, code)


def load_failure_code(exc: BaseException) -> Code:
    """The status code of what TensorFlow or the file system raised while loading: an
    OpError's own (DataLossError, NotFoundError, ...; also when it is the cause of what was
    raised), an OSError's errno read as TensorFlow reads it, a protobuf that does not parse
    DATA_LOSS (TensorFlow's ReadBinaryProto)."""
    from google.protobuf.message import DecodeError
    from google.protobuf.text_format import ParseError

    cause: BaseException | None = exc
    while cause is not None:  # TensorFlow re-raises some as Python's: FileNotFoundError
        code = getattr(cause, "error_code", None)  # tf.errors.OpError, without importing TF
        if isinstance(code, int):
            return code_of(code)
        cause = cause.__cause__
    if isinstance(exc, OSError):
        return code_of_os_error(exc)
    if isinstance(exc, (DecodeError, ParseError)):
        return Code.DATA_LOSS
    return Code.UNKNOWN


class ModelRuntime(Protocol):
    """One loaded model version, ready to run its signatures."""

    model_name: str
    version: int
    # A serialized tensorflow.serving.SignatureDefMap: what GetModelMetadata returns.
    signature_defs: bytes
    specs: dict[str, SignatureSpec]

    def run(
        self,
        signature: str,
        inputs: Mapping[str, np.ndarray],
        outputs: list[str],
        cancel: Any = None,
    ) -> dict[str, np.ndarray]:
        """Run one signature on validated inputs; ServingError on failure. ``cancel``: what
        ``canceller`` gave for this call, or None."""
        ...

    def canceller(self, signature: str) -> Any:
        """A new handle whose ``start_cancel()`` (from another thread) stops a call of
        ``signature`` given it, where TensorFlow can stop it; None when its call cannot be
        stopped at all."""
        ...

    def warm_up(self, copies_allowed: bool = False) -> None:
        """Run every signature once so that the first real request is not the slow one."""
        ...

    @property
    def call_paths(self) -> dict[str, str]:
        """signature → how it is called ("session", "direct", "flat" or "keywords")."""
        ...


def load_saved_model(
    model_dir: str,
    model_name: str,
    version: int,
    intra_op_threads: int = 0,
    inter_op_threads: int = 0,
    weights_segment: str = "",
    work_dir: str = "",
    tags: Sequence[str] = (SERVE_TAG,),
) -> ModelRuntime:
    """Load the SavedModel in ``model_dir`` (a version directory): its MetaGraphDef whose tag
    set is ``tags`` (TF Serving's --saved_model_tags, "serve" by default), as TensorFlow's and
    TF Serving's loaders pick it: the set equal, not merely containing "serve".

    Thread counts of 0 leave TensorFlow's defaults. They can only be set before TensorFlow
    runs its first op in this process, so a worker calls this before anything else touches
    TensorFlow; asking for different counts afterwards is a ModelLoadError, not a silent no-op.

    With `weights_segment`, the variables come from that published weight segment, mapped
    and bound without copying (worker/shared_weights.py), instead of from the checkpoint; the
    model's gathers on variables are rewritten first (worker/gather_rewrite.py), in a private
    copy under `work_dir` that lives as long as this process, so that they do not copy them.
    """
    path = Path(model_dir)
    where = f"model {model_name!r} version {version} at {path}"
    try:
        found = path.is_dir()
    except OSError as exc:  # a base path that may not be read (EACCES is no "not there")
        raise ModelLoadError(f"cannot load {where}: {exc}", code_of_os_error(exc)) from exc
    if not found:
        raise ModelLoadError(f"cannot load {where}: the directory does not exist", Code.NOT_FOUND)
    try:
        import tensorflow as tf
    except ImportError as exc:
        raise ModelLoadError(f"cannot load {where}: TensorFlow is not installed ({exc})") from exc
    signature_defs, digest = _read_signature_defs(path, where, tags)

    _set_threads(tf, intra_op_threads, inter_op_threads, where)
    options = tf.saved_model.LoadOptions(experimental_skip_checkpoint=bool(weights_segment))
    private = Path(work_dir or tempfile.gettempdir())
    # Where TensorFlow reads the version: its checkpoint's reader takes the path as a glob.
    path_read = _without_glob(path, private, where)
    load_from, rewritten = path_read, None
    if weights_segment:
        rewritten = _rewrite_gathers(path, private, where)
        if rewritten is not None:
            load_from = rewritten.model_dir
    try:
        loaded = tf.saved_model.load(str(load_from), tags=list(tags), options=options)
    except Exception as exc:  # TF raises OpError, ValueError, OSError, ... for broken models
        if rewritten is not None:
            rewritten.remove()
        raise ModelLoadError(
            f"cannot load {where}: {_first_line(exc)}", load_failure_code(exc)
        ) from exc
    checkpoint = str(path_read / "variables" / "variables")
    shared = (
        _attach_weights(tf, loaded, weights_segment, checkpoint, where, digest)
        if weights_segment
        else None
    )

    specs = specs_from_signature_defs(
        serving_pb2.SignatureDefMap.FromString(signature_defs).signature_def
    )
    missing = sorted(set(specs) - set(loaded.signatures.keys()))
    if missing:
        raise ModelLoadError(
            f"cannot load {where}: signatures {missing} are in saved_model.pb "
            "but TensorFlow did not restore them"
        )
    for key in sorted(specs):
        python = calls_python(loaded.signatures[key])
        if python:
            # Each request would fail ("Could not find callback with key=pyfunc_0"); TF
            # Serving refuses the load ("Op type not registered 'EagerPyFunc'").
            raise ModelLoadError(
                f"cannot load {where}: signature {key!r} calls Python code through {python} "
                "(tf.py_function, tf.numpy_function): a SavedModel does not keep that code, "
                "only the exporting process had it; TF Serving refuses such a model too",
                Code.NOT_FOUND,  # TF Serving's: "Op type not registered 'EagerPyFunc'"
            )
    runtime = SavedModelRuntime(model_name, version, signature_defs, specs, loaded)
    if shared is not None:
        runtime.shared, runtime.at_risk = shared[:2], shared[2]
        if not runtime.at_risk:
            segment, bound = shared[:2]
            views = {key: segment.view(entry) for key, (_, entry) in bound.items()}
            runtime.build_session_calls(views, intra_op_threads, inter_op_threads)
    return runtime


# What TensorFlow's checkpoint reader takes for a glob in a path (tsl's GetMatchingPaths).
_GLOB_CHARACTERS = frozenset("*?[\\")


def _without_glob(path: Path, work_dir: Path, where: str) -> Path:
    """``path``, or a private link to it when it holds a glob character: TensorFlow reads a
    checkpoint's files through a glob of their prefix, so a base path such as "/models/g[1]"
    failed every load ("Failed to find any matching files"; found by a hunt). The link
    lives in a private directory (gather_rewrite's kind, removed as its copies are) as long
    as this process."""
    if not _GLOB_CHARACTERS & set(str(path)):
        return path
    from mpspool.worker.gather_rewrite import new_private_dir

    try:
        private = new_private_dir(work_dir)
        link = private / "version"
        link.symlink_to(path, target_is_directory=True)
    except OSError as exc:
        raise ModelLoadError(
            f"cannot load {where}: a link to it without glob characters cannot be made in "
            f"{work_dir}: {exc}",
            code_of_os_error(exc),
        ) from exc
    atexit.register(shutil.rmtree, private, True)
    return link


def _rewrite_gathers(path: Path, work_dir: Path, where: str) -> Any:
    """The model with its variable gathers rewritten (None if it has none), removed when
    this process exits normally; a pool's stop removes what a killed worker left."""
    from mpspool.worker.gather_rewrite import rewrite_saved_model

    try:
        rewritten = rewrite_saved_model(path, work_dir)
    except Exception as exc:  # a saved_model.pb protobuf cannot parse, an unwritable dir
        raise ModelLoadError(
            f"cannot load {where}: rewriting its gathers failed: {exc}", load_failure_code(exc)
        ) from exc
    if rewritten is not None:
        atexit.register(rewritten.remove)
        log.info(
            "rewrote %d gather(s) on variables to read-then-gather so they do not copy the "
            "shared weights (%s)",
            rewritten.count,
            ", ".join(f"{name}: {n}" for name, n in sorted(rewritten.gathers.items())),
        )
    return rewritten


def _attach_weights(
    tf: Any, loaded: Any, segment_path: str, checkpoint: str, where: str, digest: str
) -> Any:
    from mpspool.segment import AttachedSegment, SegmentError
    from mpspool.worker.publish import GRAPH_DIGEST_KEY
    from mpspool.worker.shared_weights import CheckpointUnreadable, NotShareable, attach, audit

    try:
        _wait_for_publisher(Path(segment_path))
        segment = AttachedSegment(Path(segment_path))
        published = segment.manifest.extra.get(GRAPH_DIGEST_KEY)
        if published and published != digest:
            # Bound anyway, its variables would be the old model's under the new graph: a
            # shape mismatch blamed on the checkpoint, or, shapes equal, silently wrong.
            raise ModelLoadError(
                f"cannot load {where}: its saved_model.pb changed since the pool published "
                "this version's weights (the folder replaced under the same version number: "
                "a re-push, a ConfigMap's ..data swap). A version's files must stay as they "
                "were while it serves; serve new content as a new version number",
                Code.FAILED_PRECONDITION,
            )
        bound = attach(tf, loaded, segment, checkpoint)
    except SegmentError as exc:  # another try may get past it
        raise WeightsUnavailable(f"cannot share the weights of {where}: {exc}") from exc
    except CheckpointUnreadable as exc:  # as TensorFlow's restore of that value would fail
        raise ModelLoadError(
            f"cannot share the weights of {where}: {exc}", code_of(exc.code)
        ) from exc
    except NotShareable as exc:
        raise ModelRefused(f"cannot share the weights of {where}: {exc}") from exc
    # Said at start, before warm-up: what in the served functions may copy a variable out of
    # the segment, and why. Warm-up then shows what did (refused unless copies are allowed);
    # what it did not run (a write in a branch) is reported with the weights as at_risk.
    at_risk = audit(loaded, bound)
    for name, reason in sorted(at_risk.items()):
        log.warning("shared variable %s may be copied into this worker: %s", name, reason)
    return segment, bound, at_risk


# How often a worker waiting for the weights looks for the finished segment, and how often it
# checks that the pool publishing them (the manifest's owner) still lives.
PUBLISH_POLL_S = 0.02
PUBLISH_OWNER_CHECK_S = 1.0
# How often a long wait says it still waits (a publisher may be stuck on slow storage).
PUBLISH_WAIT_LOG_S = 60.0


def _wait_for_publisher(path: Path) -> None:
    """Wait while the segment is being published. A worker needs the weights only now, after
    importing TensorFlow and loading the graph, so it can be started while the publisher
    copies them (the two overlap); the publisher renames the finished segment into place, so
    its name appearing means it is complete. Neither name there: nothing to wait for, and
    AttachedSegment says the segment is missing.

    However long a large model takes to publish, the wait has no deadline of its own: the
    pool's controller owns a publish that fails (it removes the ".partial" file and stops the
    workers beside it), and the wait ends if that controller, the owner the partial
    segment's manifest names, is gone."""
    import time

    from mpspool.segment import SegmentError, owner_alive, read_manifest

    partial = path.with_name(path.name + ".partial")
    manifest = None  # the partial segment's, once its header is written
    began = checked = said = time.monotonic()
    waited = False
    while not path.exists() and partial.exists():
        if not waited:
            log.info("waiting for the weights to be published into %s", path)
            waited = True
        now = time.monotonic()
        if now - said >= PUBLISH_WAIT_LOG_S:
            said = now
            log.info("still waiting for the weights of %s after %.0f s", path, now - began)
        if now - checked >= PUBLISH_OWNER_CHECK_S:
            checked = now
            if manifest is None:
                try:
                    manifest = read_manifest(partial)
                except SegmentError:
                    pass  # gone or not written yet: the loop's test or the next check says
            if manifest is not None and not owner_alive(manifest):
                log.warning("the pool publishing %s is gone (pid %d)", path, manifest.owner_pid)
                return
        time.sleep(PUBLISH_POLL_S)


class SavedModelRuntime:
    """A SavedModel loaded in this process with tf.saved_model.load."""

    def __init__(
        self,
        model_name: str,
        version: int,
        signature_defs: bytes,
        specs: dict[str, SignatureSpec],
        loaded: Any,
    ) -> None:
        self.model_name = model_name
        self.version = version
        self.signature_defs = signature_defs
        self.specs = specs
        # Holding the loaded object keeps its variables alive: signature functions alone do
        # not, and would fail with "resource does not exist" once it is collected.
        self._loaded = loaded
        import tensorflow as tf

        self._tf = tf
        self._functions = {key: loaded.signatures[key] for key in specs}
        # How each signature is called: "session" (worker/session_call.py: a session
        # callable on this thread; shared weights only, see build_session_calls), "direct"
        # (worker/direct_call.py: TensorFlow's eager C API, no Python layers), "flat" (see
        # _flat_order) or "keywords" (the public call, which binds and converts every
        # argument against the signature in Python). Warm-up checks the one in use against
        # the last and falls back to it when they disagree.
        # Signatures with an output that may be a scalar string (a string of rank 0 or of
        # unknown rank): only their answers need _array, decided here, not per request.
        self._scalar_string_outputs = {
            key
            for key, spec in specs.items()
            if any(out.dtype == dtypes.DT_STRING and not out.shape for out in spec.outputs.values())
        }
        # Signatures with a string output of unknown rank: its rank is looked at before
        # numpy holds it (`_numpy`), as TensorFlow's conversion of a string tensor of more
        # than MAX_STRING_RANK dimensions ends the process (one request killed a worker at
        # each try; found by a review). They get no session call, whose fetch converts
        # before anything can look.
        self._unknown_rank_strings = {
            key: frozenset(
                alias
                for alias, out in spec.outputs.items()
                if out.dtype == dtypes.DT_STRING and out.shape is None
            )
            for key, spec in specs.items()
        }
        self._flat_orders = {
            key: _flat_order(function, specs[key]) for key, function in self._functions.items()
        }
        self._direct: dict[str, DirectCall | None] = {
            key: direct_call(function, self._flat_orders[key], specs[key])
            for key, function in self._functions.items()
        }
        self._sessions: dict[str, SessionCall | None] = dict.fromkeys(self._functions)
        # Signatures whose fast call warm-up could not check (they refused its zero example):
        # their first request checks it (_run_unchecked), once answered (check_deferred).
        self._unchecked: set[str] = set()
        # That check, waiting: (signature, the request's inputs, the public call's answer).
        self._deferred: tuple[str, dict[str, np.ndarray], dict[str, np.ndarray]] | None = None
        self._op_error: type[Exception] = tf.errors.OpError
        from tensorflow.python.eager import cancellation

        self._cancellation = cancellation
        self.shared: Any = None  # (AttachedSegment, bound variables) when weights are shared
        # variable name → why a served function may copy it (shared_weights.audit)
        self.at_risk: dict[str, str] = {}

    @property
    def call_paths(self) -> dict[str, str]:
        paths = {key: self._call_path(key) for key in self._functions}
        for key, session in self._sessions.items():
            if session is not None and session.has_loop:
                paths[key] = f"session, {self._eager_path(key)} with a deadline"
        return paths

    def build_session_calls(
        self, shared_views: Mapping[int, np.ndarray], intra_op_threads: int, inter_op_threads: int
    ) -> None:
        """Serve each signature that allows it from a session whose variables are the weight
        segment's views (``shared_views``: id() of each bound variable → its view)."""
        for key, function in self._functions.items():
            if self.specs[key].unservable:
                continue  # never called
            if self._unknown_rank_strings[key]:
                # Its fetch would convert a string output before its rank could be looked at.
                log.debug("no session call for %s: a string output of unknown rank", key)
                continue
            self._sessions[key] = session_call(
                function,
                self._flat_orders[key],
                self.specs[key],
                shared_views,
                intra_op_threads,
                inter_op_threads,
            )

    def _call_path(self, key: str) -> str:
        if self._sessions[key] is not None:
            return "session"
        return self._eager_path(key)

    def _eager_path(self, key: str) -> str:
        if self._direct[key] is not None:
            return "direct"
        return "flat" if self._flat_orders[key] else "keywords"

    def weights_report(self) -> dict[str, Any] | None:
        """Where the variables' buffers live now (call after warm-up); None if not shared."""
        if self.shared is None:
            return None
        import tensorflow as tf

        from mpspool.worker.shared_weights import verify

        segment, bound = self.shared
        return verify(tf, bound, segment, self.at_risk).to_wire()

    def weights_rechecked(self, before: dict[str, Any]) -> dict[str, Any]:
        """``before`` (this runtime's weights report) with its variables at risk that it
        shows shared looked at again: only those can have been copied since (a variable
        audit() did not find at risk has only known reads on its paths), and looking at
        every variable would cost a model of hundreds a few eager calls each."""
        import tensorflow as tf

        from mpspool.worker.shared_weights import verify, weight_names

        segment, bound = self.shared
        names = weight_names(bound)
        suspects = set(before["at_risk"]) - set(before["copied"])
        again = verify(
            tf, {k: vb for k, vb in bound.items() if names[k] in suspects}, segment, names=names
        ).copied
        return {
            **before,
            "shared_bytes": before["shared_bytes"] - sum(again.values()),
            "copied": {**before["copied"], **again},
        }

    def run(
        self,
        signature: str,
        inputs: Mapping[str, np.ndarray],
        outputs: list[str],
        cancel: Any = None,
    ) -> dict[str, np.ndarray]:
        """Run ``signature`` on ``inputs``, keep ``outputs``. The inputs were checked against
        ``specs`` before: by the front door for a request, by warm-up's replay for a record.

        TensorFlow's own error codes are gRPC's, so an op failure (an id outside the
        embedding table: INVALID_ARGUMENT) reaches the client with its code and message.
        ``cancel`` (from ``canceller``, or None): its start_cancel() from another thread
        stops the call where TensorFlow can, which fails it with CANCELLED.
        """
        spec = self.specs.get(signature)
        if spec is not None and spec.unservable:
            raise ServingError(Code.INVALID_ARGUMENT, spec.unservable)
        if self._deferred is not None:
            self.check_deferred()  # no call takes a fast path before its check
        if signature in self._unchecked:
            return self._run_unchecked(signature, inputs, outputs, cancel)
        return self._run(signature, inputs, outputs, cancel)

    def canceller(self, signature: str) -> Any:
        """A CancellationManager for one call of ``signature`` that has a deadline, or None
        where nothing could use it.

        TensorFlow stops a cancelled call at its next turn of a loop (or wait on a queue or a
        rendezvous), not inside an op: a graph of plain ops runs to its end whatever happens,
        as under TF Serving's session timeout, and keeps its session call. A session callable
        takes no options per call, so a session call cannot be cancelled: a graph with a loop
        runs its calls that have a deadline eagerly instead (_run), stoppable as under TF
        Serving, and its calls without one in its session. The price, a signature of a
        tf.map_fn over 64x64 rows at batch 1: 2.1-3.2x the CPU of the session call (213-237
        against 70-99 µs), 0.86-1.24x at batch 32 (/tmp/s49/loop_cost.py, 5 rounds).
        One manager per call: once cancelled, it stays so."""
        session = self._sessions[signature]
        if session is not None and not session.has_loop:
            return None
        return self._cancellation.CancellationManager()

    def _call_function(
        self,
        signature: str,
        inputs: Mapping[str, np.ndarray],
        outputs: list[str],
        cancel: Any,
    ) -> dict[str, Any]:
        """``signature`` called flat (in its arguments' order) or with keywords, the public
        call; its outputs as numpy values."""
        function = self._functions[signature]
        order = self._flat_orders[signature]
        # TensorFlow's own calls read the manager from this context (Context.call_function).
        scope = (
            contextlib.nullcontext()
            if cancel is None
            else self._cancellation.CancellationManagerContext(cancel)
        )
        with scope:
            if order:
                constant = self._tf.constant
                result = function._call_flat(
                    [constant(inputs[alias]) for alias in order], function.captured_inputs
                )
            else:
                result = function(**inputs)
        return self._numpy(signature, result, outputs)

    def _numpy(self, signature: str, result: Any, outputs: list[str]) -> dict[str, Any]:
        """The outputs as numpy values; INVALID_ARGUMENT for a string output of more than
        MAX_STRING_RANK dimensions, looked at first (`_unknown_rank_strings`)."""
        for alias in self._unknown_rank_strings.get(signature, ()):
            rank = result[alias].shape.rank if alias in outputs else None
            if rank is not None and rank > MAX_STRING_RANK:
                raise ServingError(
                    Code.INVALID_ARGUMENT,
                    f"output {alias!r} is a string tensor of rank {rank}: TensorFlow's Python "
                    f"side, which the workers call the model through, holds string tensors of "
                    f"rank {MAX_STRING_RANK} at most",
                )
        return {alias: result[alias].numpy() for alias in outputs}

    def _run(
        self,
        signature: str,
        inputs: Mapping[str, np.ndarray],
        outputs: list[str],
        cancel: Any = None,
    ) -> dict[str, np.ndarray]:
        try:
            session = self._sessions[signature]
            direct = self._direct[signature]
            if session is not None and cancel is None:
                answer = session(inputs)
                got = {alias: answer[alias] for alias in outputs}
            elif direct is not None:
                got = self._numpy(signature, direct(inputs, cancel), outputs)
            else:
                got = self._call_function(signature, inputs, outputs, cancel)
            if signature in self._scalar_string_outputs:
                # TensorFlow gives a scalar string as bytes (numpy() and a session's fetch
                # alike), which has no dtype or shape: a 0-d object array holds it, as every
                # string output is held. Other scalars come as numpy scalars, which have both.
                got = {alias: _array(value) for alias, value in got.items()}
            return got
        except self._op_error as exc:
            raise ServingError(exc.error_code, _op_error_message(exc.message)) from exc
        except ServingError:
            raise
        except UnicodeDecodeError as exc:
            if not isinstance(exc.object, bytes):
                raise ServingError(Code.INTERNAL, f"{type(exc).__name__}: {exc}") from exc
            # A kernel's error quoting the request's bytes ("Could not parse example input,
            # value: 'garbage\xff'"): TensorFlow cannot make it a str, so its OpError is lost
            # and this is raised instead, the whole message in `object`, its code gone. Such
            # a kernel refused the data it was fed (a parser, a conversion), which TF Serving
            # answers with the kernel's INVALID_ARGUMENT; the bytes it quotes are escaped.
            message = exc.object.decode("utf-8", "backslashreplace")
            raise ServingError(Code.INVALID_ARGUMENT, _op_error_message(message)) from exc
        except Exception as exc:
            raise ServingError(
                Code.INTERNAL,
                f"running signature {signature!r} of model {self.model_name!r} "
                f"version {self.version} failed: {type(exc).__name__}: {_first_line(exc)}",
            ) from exc

    def warm_up(self, copies_allowed: bool = False) -> None:
        """Run each signature on a batch of one zero example (unknown dimensions become 1).

        The first call of a function pays for graph optimisation and kernel set-up; paying
        here keeps it off a client's request. A signature that refuses zeros is not a load
        failure: TF Serving never runs a signature at load (only recorded warm-up requests),
        and many refuse zeros by design (a tf.Example parser with required features given
        empty strings, an assertion that ids are positive, one element reshaped to [-1, 3]).
        Its first real request pays the set-up instead, and checks the fast call against
        the public one (_run_unchecked). Refusals of the data are forgiven (a file or key
        the zeros name not found too), and any failure of a signature while another of the
        version runs its zeros: TF Serving would serve the others, and that one's requests
        get its errors. Out of memory still fails the load, and so does any other code (an
        internal or device error) when no signature runs, so a version that can run nothing
        never takes traffic. A zero run that may loop is stopped after WARM_UP_RUN_LIMIT_S
        (a loop that ends only on real data) and left to its first request. A signature
        without inputs is not run: it may exist for its side effects (a reset, a counter),
        and TF Serving would not run it. ``copies_allowed``: --allow-copied-weights (below).
        """
        ran = 0  # signatures that answered their zeros
        failed: list[tuple[str, ServingError]] = []  # and those that failed otherwise
        for key, spec in self.specs.items():
            if not spec.inputs or spec.unservable:
                continue  # an unservable one: its requests are refused (run)
            # With shared weights one that writes a variable is run as before: the write
            # copies the shared variable into this worker, and that copy refuses the load
            # unless --allow-copied-weights (``copies_allowed``: N workers would hold N
            # diverging copies of the state). Other state (a random op's sequence) is its own.
            writes = writes_state(self._functions[key])
            if writes and self.shared is not None and not copies_allowed:
                if writes_a_variable(self._functions[key]):
                    writes = ""  # run: its copy refuses the load, whatever else it writes
            if writes:
                # Runs it needs none of: not at warm-up, and no second run to check a fast
                # call against (worker/stateful.py).
                log.info(
                    "signature %r writes state (%s): not run at warm-up, served through the "
                    "public call so that it runs once per request",
                    key,
                    writes,
                )
                self._drop_fast_calls(key)
                continue
            inputs = {alias: _zeros(info.dtype, info.shape) for alias, info in spec.inputs.items()}
            try:
                got = self._zero_run(key, inputs, list(spec.outputs))
            except (ServingError, _ZeroRunTooLong) as exc:
                if isinstance(exc, _ZeroRunTooLong):
                    log.warning(
                        "warm-up of signature %r stopped after %g s: it does not end on a "
                        "zero example (a loop that ends on real data); its first request "
                        "pays the set-up",
                        key,
                        WARM_UP_RUN_LIMIT_S,
                    )
                elif exc.code is Code.RESOURCE_EXHAUSTED:
                    raise self._warm_up_error(key, exc) from exc
                elif exc.code in _REFUSALS_OF_DATA or (
                    exc.code == Code.INTERNAL and self._runs_empty(key, spec)
                ):
                    log.warning(
                        "warm-up of signature %r skipped: it refused a zero example (%s: %s); "
                        "its first request pays the set-up",
                        key,
                        exc.code.name,
                        exc.message.splitlines()[0][:200] if exc.message else "",
                    )
                else:
                    failed.append((key, exc))  # judged once every signature had its run
                if self._call_path(key) != "keywords":
                    self._unchecked.add(key)
                continue
            ran += 1
            path = self._call_path(key)
            if path != "keywords" and not self._fast_call_agrees(key, inputs, got):
                log.warning(
                    "signature %r: the %s call disagrees with the keyword call; using the "
                    "keyword call",
                    key,
                    path,
                )
                self._drop_fast_calls(key)
                continue
            session = self._sessions[key]
            if session is not None and session.has_loop:
                # Its calls with a deadline are eager (canceller): that call is checked too.
                eager = self._eager_path(key)
                try:
                    eager_got = self._run(key, inputs, list(got), self.canceller(key))
                    agrees = _same_answers(got, eager_got)
                except ServingError:
                    agrees = False
                if not agrees:
                    log.warning(
                        "signature %r: the %s call disagrees with the session call; its calls "
                        "with a deadline use the keyword call",
                        key,
                        eager,
                    )
                    self._direct[key] = self._flat_orders[key] = None
        if failed and not ran:
            key, exc = failed[0]
            raise self._warm_up_error(key, exc) from exc
        for key, exc in failed:
            log.warning(
                "warm-up of signature %r failed (%s: %s); the version loads, as its other "
                "signatures run (TF Serving runs none at load): its requests will get the error "
                "if it is the model's",
                key,
                exc.code.name,
                exc.message.splitlines()[0][:200] if exc.message else "",
            )

    def _warm_up_error(self, key: str, exc: ServingError) -> ModelLoadError:
        return ModelLoadError(
            f"warm-up of model {self.model_name!r} version {self.version}, "
            f"signature {key!r} failed: {exc.code.name}: {exc.message}",
            exc.code,
        )

    def _zero_run(
        self, key: str, inputs: Mapping[str, np.ndarray], outputs: list[str]
    ) -> dict[str, np.ndarray]:
        """Warm-up's run of ``key`` on zeros. One whose graph holds a loop runs first with a
        canceller, stopped (_ZeroRunTooLong) after WARM_UP_RUN_LIMIT_S: a loop may end only
        on real data. A graph without a loop always ends, however long its first call's
        set-up takes. A session (with a loop) then runs as it serves: on the same inputs it
        ends too, and where the eager call failed the session's own run says whether the
        signature runs (warm_up then checks the eager call against it)."""
        session = self._sessions[key]
        if not (session.has_loop if session is not None else self._graph_loops(key)):
            return self.run(key, inputs, outputs)
        cancel = self._cancellation.CancellationManager()
        stopped = threading.Event()

        def stop() -> None:
            stopped.set()
            cancel.start_cancel()

        timer = threading.Timer(WARM_UP_RUN_LIMIT_S, stop)
        timer.daemon = True
        timer.start()
        try:
            got = self.run(key, inputs, outputs, cancel)
        except ServingError as exc:
            if stopped.is_set() and exc.code is Code.CANCELLED:
                raise _ZeroRunTooLong() from None
            if session is None:
                raise
        finally:
            timer.cancel()
        if session is None:
            return got
        return self.run(key, inputs, outputs)

    def _graph_loops(self, key: str) -> bool:
        """Whether ``key``'s function holds a loop (one TensorFlow cannot describe: yes)."""
        try:
            return has_loop(self._functions[key].graph.as_graph_def())
        except Exception:
            return True

    def _runs_empty(self, key: str, spec: SignatureSpec) -> bool:
        """Whether ``key`` runs on an empty example (its unknown dimensions 0), after the
        one-row zeros failed with INTERNAL (only that: an empty run allocates next to
        nothing, so out of memory or a device error would pass it). Some kernels answer
        nonsense data with INTERNAL: a SparseTensor input's components as zeros are an
        index 0 into a dense shape of [0, 0] ("Obtained a write index of 0 which is outside
        of bounds of [0, 0)"). A signature that runs empty can run, and TF Serving, which runs
        none at load, serves it: its first request pays the set-up, as for a refusal."""
        if not any(info.shape and min(info.shape) < 0 for info in spec.inputs.values()):
            return False  # no unknown dimension: the same example again
        empty = {a: _zeros(i.dtype, i.shape, unknown=0) for a, i in spec.inputs.items()}
        with self._keywords_only(key):
            try:
                self._zero_run(key, empty, list(spec.outputs))
            except (ServingError, _ZeroRunTooLong):
                return False
        return True

    def _run_unchecked(
        self, key: str, inputs: Mapping[str, np.ndarray], outputs: list[str], cancel: Any
    ) -> dict[str, np.ndarray]:
        """A signature whose fast call warm-up could not check: the public call answers, and
        the fast call is checked on the same inputs once that answer is sent
        (check_deferred), so that the first request waits neither for a second call nor for
        the fast call's own first-call set-up (a session's, a graph's optimisation)."""
        with self._keywords_only(key):
            want = self._run(key, inputs, list(self.specs[key].outputs), cancel)
        self._unchecked.discard(key)
        # Copied: a request's inputs are views of its socket's buffer.
        copied = {alias: np.array(value, copy=True) for alias, value in inputs.items()}
        self._deferred = (key, copied, want)
        return {alias: want[alias] for alias in outputs}

    @property
    def has_deferred_check(self) -> bool:
        return self._deferred is not None

    def check_deferred(self) -> None:
        """The check a first request left (_run_unchecked), if any: the fast call on its
        inputs against the public call's answer; the public call from now on if they
        disagree. The serving loop runs it once the answer is sent, before it reads the
        next request (and run() before any call, whoever makes it)."""
        if self._deferred is None:
            return
        key, inputs, want = self._deferred
        self._deferred = None
        path = self._call_path(key)
        try:
            agrees = _same_answers(want, self._run(key, inputs, list(want)))
        except ServingError:
            agrees = False
        if agrees:
            log.info("signature %r: the %s call checked on its first request", key, path)
        else:
            log.warning(
                "signature %r: the %s call disagrees with the keyword call on its first "
                "request; using the keyword call",
                key,
                path,
            )
            self._drop_fast_calls(key)

    def _drop_fast_calls(self, key: str) -> None:
        """From now on call ``key`` with keywords, the public call."""
        session = self._sessions[key]
        if session is not None:
            session.close()
        self._sessions[key] = self._direct[key] = self._flat_orders[key] = None

    def _fast_call_agrees(
        self, key: str, inputs: Mapping[str, np.ndarray], got: Mapping[str, np.ndarray]
    ) -> bool:
        """The session, direct and flat calls rely on TensorFlow's argument and output
        order; check the one in use once against the public call on the warm-up inputs, not
        trust it."""
        with self._keywords_only(key):
            want = self.run(key, inputs, list(got))
        return _same_answers(want, got)

    @contextlib.contextmanager
    def _keywords_only(self, key: str) -> Iterator[None]:
        """Call ``key`` with keywords, the public call, inside the block; its fast calls
        come back after it."""
        fast = self._sessions[key], self._direct[key], self._flat_orders[key]
        self._sessions[key] = self._direct[key] = self._flat_orders[key] = None
        try:
            yield
        finally:
            self._sessions[key], self._direct[key], self._flat_orders[key] = fast


def _array(value: Any) -> Any:
    """An output as an array: ``bytes`` (a scalar string) as a 0-d object array."""
    if type(value) is bytes:
        return np.array(value, dtype=object)
    return value


def _same_answers(want: Mapping[str, np.ndarray], got: Mapping[str, np.ndarray]) -> bool:
    """Bit for bit, alias by alias; strings by value (an object array's bytes are pointers)."""
    return want.keys() == got.keys() and all(
        want[alias].dtype == got[alias].dtype
        and want[alias].shape == got[alias].shape
        and (
            want[alias].tolist() == got[alias].tolist()
            if want[alias].dtype == object
            else want[alias].tobytes() == got[alias].tobytes()
        )
        for alias in want
    )


def _read_signature_defs(
    path: Path, where: str, tags: Sequence[str] = (SERVE_TAG,)
) -> tuple[bytes, str]:
    """The signature_def map of the MetaGraphDef whose tag set is ``tags``, as a serialized
    SignatureDefMap, and the digest of the file it was read from (publish.graph_digest).
    The set must be equal, as tf.saved_model.load and TF Serving's loader match it: a
    model saved with {serve, gpu} before {serve} serves the second by default.

    Read from saved_model.pb with TensorFlow's protos rather than rebuilt from the loaded
    functions, so clients see exactly what TF Serving would show for the same model (tensor
    names included). TensorFlow's SignatureDef bytes parse into mpspool's wire-compatible
    copy; fields the copy lacks ride along as unknown fields.
    """
    from tensorflow.core.protobuf import saved_model_pb2

    saved_model = saved_model_pb2.SavedModel()
    pb, pbtxt = path / SAVED_MODEL_PB, path / SAVED_MODEL_PBTXT
    try:
        if pb.is_file():
            graph = pb.read_bytes()
            saved_model.ParseFromString(graph)
        elif pbtxt.is_file():
            from google.protobuf import text_format

            graph = pbtxt.read_bytes()
            text_format.Parse(graph.decode(), saved_model)
        else:
            raise ModelLoadError(
                f"cannot load {where}: no {SAVED_MODEL_PB} or {SAVED_MODEL_PBTXT} in the directory",
                Code.NOT_FOUND,
            )
    except ModelLoadError:
        raise
    except Exception as exc:  # DecodeError, ParseError, OSError
        raise ModelLoadError(
            f"cannot load {where}: unreadable saved model: {exc}", load_failure_code(exc)
        ) from exc

    for meta_graph in saved_model.meta_graphs:
        if set(meta_graph.meta_info_def.tags) == set(tags):
            break
    else:
        found = [sorted(m.meta_info_def.tags) for m in saved_model.meta_graphs]
        raise ModelLoadError(
            f"cannot load {where}: no MetaGraphDef with the tag set {sorted(set(tags))} "
            f"(found tag sets {found}; --saved_model_tags picks one)",
            Code.NOT_FOUND,  # TF Serving's "Could not find meta graph def matching ..."
        )

    signature_map = serving_pb2.SignatureDefMap()
    for key, signature_def in meta_graph.signature_def.items():
        signature_map.signature_def[key].ParseFromString(signature_def.SerializeToString())
    from mpspool.worker.publish import graph_digest

    # Deterministic: the same model always yields the same bytes (map order is otherwise free).
    return signature_map.SerializeToString(deterministic=True), graph_digest(graph)


def _set_threads(tf: Any, intra: int, inter: int, where: str) -> None:
    threading = tf.config.threading
    for kind, wanted, setter, getter in (
        (
            "intra-op",
            intra,
            threading.set_intra_op_parallelism_threads,
            threading.get_intra_op_parallelism_threads,
        ),
        (
            "inter-op",
            inter,
            threading.set_inter_op_parallelism_threads,
            threading.get_inter_op_parallelism_threads,
        ),
    ):
        if wanted < 0:
            raise ModelLoadError(
                f"cannot load {where}: {kind} threads must be >= 0, got {wanted}",
                Code.INVALID_ARGUMENT,
            )
        if wanted == 0:
            continue
        try:
            setter(wanted)
        except RuntimeError as exc:
            raise ModelLoadError(
                f"cannot load {where}: cannot set {kind} threads to {wanted}: TensorFlow is "
                f"already initialized in this process with {getter()} ({exc})",
                Code.FAILED_PRECONDITION,
            ) from exc
    # 0 read back: TensorFlow sizes that pool itself (its cores).
    log.info(
        "TensorFlow threads: intra-op %s, inter-op %s",
        *(n or "TensorFlow's choice" for n in (intra, inter)),
    )


def _flat_order(function: Any, spec: SignatureSpec) -> list[str] | None:
    """The input aliases in the order the signature's graph takes them, or None.

    Calling a signature with keywords costs ~25% of a worker's CPU per request at batch 256:
    TensorFlow binds the arguments against the signature in Python and converts each array
    through TensorSpec.cast. Every input's dtype and shape was checked against the same
    signature before (router/src/signature.rs; warm-up records: check_inputs), so the worker
    converts the arrays itself and calls the graph with its flat argument list, as the keyword
    call ends up doing. Only when the signature's parameters are exactly its input aliases
    (names TensorFlow had to sanitize are not) and the function has the flat entry point;
    warm_up() then compares both calls.
    """
    try:
        parameters = list(function.function_type.parameters)
        flat_call = function._call_flat
    except AttributeError:
        return None
    if not callable(flat_call) or sorted(parameters) != sorted(spec.inputs):
        return None
    return parameters


# What a model says of inputs it will not take (an assertion, a reshape, a parse): TensorFlow's
# codes for bad data, not for a broken model or device.
# Codes of a kernel refusing the data it was fed; NOT_FOUND: a file or key the zeros name.
_REFUSALS_OF_DATA = frozenset(
    {Code.INVALID_ARGUMENT, Code.OUT_OF_RANGE, Code.FAILED_PRECONDITION, Code.NOT_FOUND}
)
# How long warm-up lets a zero run that may loop go on: one whose loop ends only on real data
# (iterate until a step adds up to a target) would hold the load for ever.
WARM_UP_RUN_LIMIT_S = 10.0


class _ZeroRunTooLong(Exception):
    """A warm-up run stopped after WARM_UP_RUN_LIMIT_S."""


def _zeros(dt: int, shape: tuple[int, ...] | None, unknown: int = 1) -> np.ndarray:
    """A zero example of ``shape``, its unknown dimensions ``unknown`` long (an unknown rank:
    a scalar)."""
    dims = () if shape is None else tuple(unknown if d < 0 else d for d in shape)
    if dt == dtypes.DT_STRING:
        return np.full(dims, b"", dtype=object)
    return np.zeros(dims, dtype=dtypes.numpy_dtype(dt))


_GRAPH_ERROR_HEADER = "Graph execution error:"
_OP_SUFFIX = re.compile(r"\s*\[Op:[^\]]*\]\s*$")
_ROOT_ERRORS = re.compile(r"^\d+ root error\(s\) found\.?$")
# The status of a function called through the C API (worker/direct_call.py) names the
# function (and nested ones) it failed in; the Python call path interpolates these away.
_FUNCTION_TAGS = re.compile(r"^(\{\{function_node [^}]*\}\}\s*)+")


def _op_error_message(message: str) -> str:
    """The kernel's own words from a TF function error, as TF Serving would report them.

    Eager function calls wrap the kernel's status as "Graph execution error:", then per node
    "Detected at node X defined at (most recent call last):" with its Python stack (indented
    frames, or "<stack traces unavailable>" for a loaded SavedModel), then the original
    message ("indices[1,3] = 5000 is not in [0, 1000)"), which is what a client can act on.
    """
    lines = message.strip().splitlines()
    if lines and lines[0].strip() == _GRAPH_ERROR_HEADER:
        lines = lines[1:]
        while lines and (
            not lines[0].strip()
            or lines[0].startswith(("Detected at node", "<stack traces unavailable>", " "))
        ):
            lines = lines[1:]
    lines = [line.strip() for line in lines if line.strip()]
    if not lines:
        return message.strip() or "TensorFlow op failed"
    first = _OP_SUFFIX.sub("", _FUNCTION_TAGS.sub("", lines[0]))
    if _ROOT_ERRORS.match(first) and len(lines) > 1:
        first = f"{first} {_OP_SUFFIX.sub('', _FUNCTION_TAGS.sub('', lines[1]))}"
    return first


def _first_line(exc_or_text: BaseException | str) -> str:
    text = str(exc_or_text).strip()
    if text:
        return text.splitlines()[0]
    return "" if isinstance(exc_or_text, str) else type(exc_or_text).__name__
