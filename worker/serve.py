"""The worker process: load the model, warm up, then serve the router until told to stop.

One process, one model runtime, one (slot). The serving loop is single-threaded and is
also what sends heartbeats, so a heartbeat proves the loop turns — not merely that the
process exists (a side thread would keep beating while the loop is stuck). One exception:
while the loop is inside a model call, a side thread beats for it (`BusyBeats`). A call
longer than the front door's liveness window (--worker-timeout) is work, not silence:
without those beats the worker computing it was declared dead, killed, and the request
sent to the next worker, which met the same end. TensorFlow releases the GIL while it runs
a graph, so the side thread gets to beat; a stopped process (SIGSTOP) beats from no thread.

A request carries its client's deadline, if the client set one (TF Serving runs the model
with it: ``enforce_session_run_timeout``). A request whose deadline passed before its turn
came (it waited behind a long call) is not run; a call that outlives it is stopped by the
side thread where TensorFlow can stop it (worker/runtime.py, canceller). Either way its
answer is DEADLINE_EXCEEDED, which nobody reads: the front door answered the client at the
deadline. What it saves is the worker's time for the requests behind.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from mpspool import cpusets, process, rundir, wire
from mpspool.config import PoolConfig
from mpspool.errors import Code, ServingError, status_text
from mpspool.signature import check_output_filter, select_signature
from mpspool.worker.dealer import Dealer

log = logging.getLogger("mpspool.worker")


@dataclasses.dataclass
class Pending:
    """One checked request ready to run."""

    request_id: Any
    signature: str
    outputs: list[str]
    inputs: dict[str, Any]
    # When its client stops waiting, on time.monotonic()'s clock; None: never.
    deadline: float | None = None


# The messages of a request past its deadline (code DEADLINE_EXCEEDED).
NOT_RUN = "the client's deadline passed before its model call could start; it was not run"
STOPPED = "the client's deadline passed during its model call, which was stopped"


# How often the side thread looks whether a model call is running. A quarter of the
# heartbeat interval: a worker that enters a long call just before its loop would have beaten
# is silent for at most ~0.75 s (0.5 since the loop's last beat, 0.25 until the thread's
# first), well inside the default 3 s liveness window (--worker-timeout).
BUSY_CHECK_S = wire.HEARTBEAT_INTERVAL_S / 4


class Running(NamedTuple):
    """The model call in progress, as the serving loop tells the side thread."""

    started: float  # time.monotonic()
    request_id: Any
    deadline: float | None = None  # its client's, on the same clock
    cancel: Any = None  # the call's canceller (ModelRuntime.canceller), if it has one


_new_running = tuple.__new__


class BusyBeats:
    """Heartbeats from a side thread while the serving loop is inside a model call, the stop
    of a call its client no longer waits for, and the end of a call that runs past its limit.

    The loop stores ``running`` (a Running) before a call and None after it (one attribute
    store each, nothing a request would notice: no lock, no wake-up); the thread looks every
    BUSY_CHECK_S and beats (``beat``) at least every half interval while a call has run
    longer than that. Outside calls it beats nothing, so a loop stuck anywhere else is still
    silent. A call with a canceller is cancelled once its deadline has passed: within
    BUSY_CHECK_S of it, as the thread sees a new call only when it looks. A call running
    longer than ``limit_s`` (0: none) is taken for a hang: the thread hands it to ``overrun``
    (``running`` as it read it, seconds run), which says whether it took it (then the thread
    beats no more) or found it ended."""

    def __init__(
        self,
        beat: Callable[[], Any],
        limit_s: float,
        overrun: Callable[[Running, float], bool],
    ) -> None:
        self.running: Running | None = None
        self._beat = beat
        self._limit_s = limit_s
        self._overrun = overrun
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="busy-beats", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        last = 0.0
        wait = BUSY_CHECK_S
        cancelled: Running | None = None
        while not self._stop.wait(wait):
            running, now = self.running, time.monotonic()
            wait = BUSY_CHECK_S
            if running is None:
                continue
            started, _, deadline, cancel = running
            if cancel is not None and deadline is not None and running is not cancelled:
                if now >= deadline:
                    # Its own manager: a call that ended meanwhile is cancelled for nobody.
                    cancel.start_cancel()
                    cancelled = running
                else:
                    wait = min(BUSY_CHECK_S, deadline - now)
            if self._limit_s and now - started > self._limit_s:
                if self._overrun(running, now - started):
                    return  # the process is ending
                continue  # the call ended meanwhile
            if now - started >= BUSY_CHECK_S and now - last >= 2 * BUSY_CHECK_S:
                self._beat()
                last = now


class CopyWatch:
    """Whether the requests run since the last look copied a shared variable out of the
    segment. A variable audit() found at risk is copied by the request that takes its path,
    which warm-up may not have (a write in a branch that zeros never take, a signature that
    refused warm-up's zeros); only those are looked at, and only while one is still shared.

    Such a copy is reported, not refused: the memory is spent by then, and failing the worker
    would take the model down for one request (its replacement would copy again on the same
    request). Warm-up's copies still refuse the load (unless --allow-copied-weights); these
    show in `mpspool status` (COPIED) and the mpspool_worker_copied_weight_bytes gauge, and
    the log names them."""

    def __init__(self, allowed: bool) -> None:
        self.calls = 0  # requests run (answered or failed), counted by the serving loop
        self._calls_looked_at = 0
        self._allowed = allowed  # --allow-copied-weights: a warning, else an error
        self._broken = False  # looking failed once: it must never end the serving loop

    def look(self, runtime: Any, weights: dict[str, Any] | None) -> dict[str, Any] | None:
        """The new weights report when a copy was made since the last look, else None. From
        the serving loop only, between requests: looking runs TensorFlow ops of its own."""
        if self.calls == self._calls_looked_at or self._broken or weights is None:
            return None
        if set(weights["at_risk"]) <= set(weights["copied"]):
            return None  # nothing at risk, or all of it copied already
        self._calls_looked_at = self.calls
        try:
            report: dict[str, Any] = runtime.weights_rechecked(weights)
        except Exception:
            log.exception("looking at the shared weights again failed; not looked at again")
            self._broken = True
            return None
        new = {k: v for k, v in report["copied"].items() if k not in weights["copied"]}
        if not new:
            return None
        (log.warning if self._allowed else log.error)(
            "TensorFlow copied shared variables into this worker while serving: %s (%s); each "
            "worker that runs it holds its own copy. Serve this model with --no-share-weights, "
            "or change the op",
            ", ".join(f"{k} ({v / 2**20:.1f} MiB)" for k, v in new.items()),
            "; ".join(report["at_risk"].get(k, "not reported at risk") for k in new),
        )
        return report


class Worker:
    def __init__(
        self,
        config: PoolConfig,
        slot: str,
        runtime: Any,
        weights: dict[str, Any] | None = None,
        warmup: list[Any] | None = None,
        load: list[Any] | None = None,
    ) -> None:
        self.config = config
        self.weights = weights  # where this worker's variables live (shared_weights.verify)
        self.warmup = warmup  # READY's: [version dir, µs, records] of a replayed warm-up file
        self.load = load  # READY's: [version dir, µs] of its SavedModel's load
        self.slot = slot
        self.runtime = runtime
        self.pid = os.getpid()
        self.served = 0
        self.stop_requested = False
        self._copies = CopyWatch(config.allow_copied_weights)
        # The front door's ROUTER; READY is the first message on every connection, so a
        # restarted front door knows this worker at once.
        self._socket = Dealer(
            wire.socket_path(config.run_dir, wire.WORKERS_ENDPOINT),
            wire.worker_identity(slot, self.pid),
            self._ready_message(),
            wake_on_signals=True,
        )

    def request_stop(self, *_: Any) -> None:
        # Signal handler: only record the wish; the loop acts on it between requests.
        self.stop_requested = True

    def _ready_message(self) -> list[bytes]:
        header = wire.pack(
            wire.Kind.READY,
            slot=self.slot,
            pid=self.pid,
            model=self.runtime.model_name,
            version=self.runtime.version,
            weights=self.weights,
            **({} if self.warmup is None else {"warmup": self.warmup}),
            **({} if self.load is None else {"load": self.load}),
        )
        return [header, self.runtime.signature_defs]

    def _heartbeat(self, weights: dict[str, Any] | None = None) -> bytes:
        # weights only when they changed: most heartbeats carry none.
        extra = {} if weights is None else {"weights": weights}
        return wire.pack(
            wire.Kind.HEARTBEAT, slot=self.slot, pid=self.pid, served=self.served, **extra
        )

    def serve(self) -> None:
        self._busy_beats = BusyBeats(
            lambda: self._socket.send_from_thread(self._heartbeat()),
            self.config.call_timeout_s,
            self._call_overrun,
        )
        try:
            self._serve()
        finally:
            self._busy_beats.stop()

    def _serve(self) -> None:
        next_beat = time.monotonic() + wire.HEARTBEAT_INTERVAL_S
        while not self.stop_requested:
            timeout_ms = max(0, int((next_beat - time.monotonic()) * 1000))
            if self._socket.poll(timeout_ms):  # a signal ends the wait early
                self._handle_queued()
            now = time.monotonic()
            if now >= next_beat:
                copied = self._copies.look(self.runtime, self.weights)
                if copied is not None:
                    self.weights = copied
                    # A front door that connects again (restarted) learns it from READY.
                    self._socket.hello = self._ready_message()
                self._socket.send(self._heartbeat(copied))
                next_beat = now + wire.HEARTBEAT_INTERVAL_S
        # BYE: the router stops routing here and retries whatever it still had queued for
        # this worker on another one, so stopping a worker loses no request.
        self._socket.send(wire.pack(wire.Kind.BYE, slot=self.slot, pid=self.pid))
        self._socket.close()

    def _handle_queued(self) -> None:
        """Answer one message. Batching is the front door's (router/src/batch.rs): a merged
        call arrives here as one request like any other."""
        try:
            frames = self._socket.recv_multipart()
        except ConnectionError:  # the front door went away mid-message; it is reconnected
            return
        request = self._accept(frames)
        if request is not None:
            self._socket.send_multipart(self._execute(request))
            if self.runtime.has_deferred_check:
                self._check_deferred()

    def _check_deferred(self) -> None:
        """A signature's first request has been answered by the public call; its fast call
        is checked now, before the next request is read (runtime.check_deferred). It is a
        model call: the busy beats cover it as they cover a request's, and the copy watch
        counts it."""
        fields = (time.monotonic(), None, None, None)
        self._busy_beats.running = _new_running(Running, fields)
        self._copies.calls += 1
        try:
            self.runtime.check_deferred()
        except Exception:  # a check must never end the serving loop
            log.exception("checking a signature's fast call failed")
        finally:
            self._busy_beats.running = None

    def _accept(self, frames: list[memoryview]) -> Pending | None:
        """A checked request ready to run; anything else is handled (or refused) here."""
        try:
            header = wire.unpack(frames[0])
            kind = wire.kind_of(header)
        except wire.ProtocolError as exc:
            log.warning("dropping undecodable message: %s", exc)
            return None
        if kind is wire.Kind.REREGISTER:
            self._socket.send_multipart(self._socket.hello)
            return None
        if kind is not wire.Kind.REQUEST:
            log.warning("unexpected %s message from the router", kind.value)
            return None
        request_id = header.get("id")
        try:
            return self._check(request_id, header, frames[1:])
        except ServingError as exc:
            self._socket.send(self._error(request_id, exc.code, exc.message))
        except Exception as exc:  # a bad request must never kill the worker
            log.exception("request %s failed", request_id)
            self._socket.send(self._error(request_id, Code.INTERNAL, str(exc)))
        return None

    def _check(self, request_id: Any, header: dict[str, Any], frames: list[memoryview]) -> Pending:
        try:
            inputs = wire.decode_tensors(header["tensors"], frames)
        except (wire.ProtocolError, KeyError, TypeError, ValueError) as exc:
            raise ServingError(Code.INVALID_ARGUMENT, f"malformed request: {exc}") from None
        spec = select_signature(self.runtime.specs, header.get("sig", ""))
        # The inputs' names, dtypes and shapes were checked against this signature by the
        # front door (router/src/signature.rs), the one place that answers a bad request;
        # checking them again here cost ~2 us a request. What the worker still owns: frames
        # that fit their described shape (decode_tensors), and TensorFlow's own checks of
        # what it is fed, whose errors reach the client with their codes.
        outputs = check_output_filter(spec, header.get("outputs") or [])
        deadline = header.get("deadline")
        if deadline is not None and (type(deadline) is not int or deadline < 0):
            raise ServingError(Code.INVALID_ARGUMENT, f"malformed request: deadline {deadline!r}")
        # µs of CLOCK_MONOTONIC, the clock time.monotonic() reads on Linux.
        at = None if deadline is None else deadline / 1e6
        return Pending(request_id, spec.key, outputs, inputs, at)

    def _execute(self, request: Pending) -> list[Any]:
        """The reply to a checked request: its outputs, or its error."""
        start_us = time.time_ns() // 1000
        now = time.monotonic()
        cancel = None
        if request.deadline is not None:
            if now >= request.deadline:
                return [self._error(request.request_id, Code.DEADLINE_EXCEEDED, NOT_RUN)]
            cancel = self.runtime.canceller(request.signature)
        # tuple.__new__: a NamedTuple's own constructor costs 0.6 µs a request, this 0.3.
        fields = (now, request.request_id, request.deadline, cancel)
        self._busy_beats.running = _new_running(Running, fields)
        self._copies.calls += 1
        try:
            result = self.runtime.run(request.signature, request.inputs, request.outputs, cancel)
        except ServingError as exc:
            # Not the manager's is_cancelled: TensorFlow cancels it itself when an op fails,
            # to end the rest of the call, and that error is the client's to read.
            if (
                exc.code == Code.CANCELLED
                and request.deadline is not None
                and time.monotonic() >= request.deadline
            ):
                return [self._error(request.request_id, Code.DEADLINE_EXCEEDED, STOPPED)]
            return [self._error(request.request_id, exc.code, exc.message)]
        except Exception as exc:  # a bad request must never kill the worker
            log.exception("request %s failed", request.request_id)
            return [self._error(request.request_id, Code.INTERNAL, str(exc))]
        finally:
            self._busy_beats.running = None
        try:
            reply = self._reply(request.request_id, result, start_us, time.time_ns() // 1000)
        except Exception as exc:  # nor must an answer the wire cannot carry
            log.exception("request %s: its answer could not be encoded", request.request_id)
            message = f"the model's answer could not be encoded: {exc}"
            return [self._error(request.request_id, Code.INTERNAL, message)]
        self.served += 1
        return reply

    def _call_overrun(self, running: Running, ran_s: float) -> bool:
        """From the side thread: the call ``running`` has run past --call-timeout and is
        taken for a hang, which nothing in this process can end (TensorFlow stops a call only
        between a loop's turns, and a hang is inside an op or a session call; the loop's thread
        is inside it). Its request fails with
        DEADLINE_EXCEEDED, then BYE (what else the front door had queued here is not this
        worker's fault: it goes elsewhere without counting against those requests), and the
        process exits; the controller starts a new worker in its place. False, and nothing
        done, if the call ended before the socket was ours."""
        request_id = running.request_id
        limit = self.config.call_timeout_s
        reason = (
            f"the model call ran for more than {limit:g} s (--call-timeout) and was taken for "
            f"a hang; worker {self.slot} (pid {self.pid}) exits to be replaced"
        )
        last = [wire.pack(wire.Kind.BYE, slot=self.slot, pid=self.pid)]
        if request_id is not None:  # None: a first request's check (_check_deferred)
            last.insert(0, self._error(request_id, Code.DEADLINE_EXCEEDED, reason))
        sent = self._socket.send_last_from_thread(last, lambda: self._busy_beats.running is running)
        if sent is None:
            return False
        what = "a fast call's check" if request_id is None else f"request {request_id}"
        log.error("%s: %s (ran %.1f s)", what, reason, ran_s)
        if not sent:
            log.error("the front door did not take the error for request %s", request_id)
        process.exit_now(process.EXIT_CALL_TIMEOUT)

    @staticmethod
    def _reply(request_id: Any, result: dict[str, Any], start_us: int, end_us: int) -> list[Any]:
        metas, out_frames = wire.encode_tensors(result)
        head = wire.pack(wire.Kind.REPLY, id=request_id, tensors=metas, t=[start_us, end_us])
        return [head, *out_frames]

    @staticmethod
    def _error(request_id: Any, code: int, message: str) -> bytes:
        return wire.pack(wire.Kind.ERROR, id=request_id, code=int(code), message=message)


def _require_mps_daemon(timeout_s: float = 20.0) -> None:
    """A GPU worker of an MPS pool must not start while its GPU's control daemon is down:
    CUDA would silently run it without MPS. Wait a little (the controller restarts the
    daemon), then give up as a load failure, which the controller backs off and retries."""
    binary = os.environ.get("MPSPOOL_REQUIRE_MPS")  # set by the controller for MPS workers
    if not binary:
        return
    from mpspool.mps.control import DaemonDown, MpsDaemon

    daemon = MpsDaemon(
        gpu_index=-1,
        gpu_uuid=os.environ.get("CUDA_VISIBLE_DEVICES", ""),
        binary=binary,
        pipe_dir=Path(os.environ["CUDA_MPS_PIPE_DIRECTORY"]),
        log_dir=Path(os.environ.get("CUDA_MPS_LOG_DIRECTORY", "")),
    )
    try:
        daemon.wait_ready(timeout_s)
    except DaemonDown:
        process.fail(
            process.EXIT_LOAD_FAILED,
            f"no MPS control daemon answers in {daemon.pipe_dir}: refusing to run without MPS",
        )


def _require_gpu(config: PoolConfig, slot: str) -> None:
    """A GPU worker must run its model on its GPU. TensorFlow that cannot use it (a build
    without CUDA; `pip install tensorflow` without its CUDA libraries; CUDA failing to start in
    this process, as when the GPU's MPS server already has the 48 clients it takes) runs the
    model on the CPU instead, saying so only in warnings TF_CPP_MIN_LOG_LEVEL hides: a GPU
    pool served at CPU speed, its workers fighting over the host's cores. Refused instead,
    before the model loads. GPUs faked for tests (MPSPOOL_FAKE_GPUS) have no CUDA to ask."""
    from mpspool.mps.gpus import FAKE_GPUS_ENV, VISIBLE_DEVICES_ENV

    if config.slot_gpu(slot) is None or os.environ.get(FAKE_GPUS_ENV, "").strip():
        return
    import tensorflow as tf

    if not tf.test.is_built_with_cuda():
        process.fail(
            process.EXIT_CONFIG_ERROR,  # every try would find the same build
            status_text(
                Code.FAILED_PRECONDITION,
                f"this TensorFlow ({tf.__version__}) is built without CUDA, so a GPU worker "
                "would run its model on the CPU: install TensorFlow's GPU build (pip install "
                "'tensorflow[and-cuda]', or the tensorflow/tensorflow:*-gpu image), or start "
                "the pool without --gpus",
            ),
        )
    if not tf.config.list_physical_devices("GPU"):
        process.fail(
            process.EXIT_LOAD_FAILED,  # tried again: the GPU's clients may have ended
            status_text(
                Code.UNAVAILABLE,
                f"TensorFlow sees no GPU ({VISIBLE_DEVICES_ENV}="
                f"{os.environ.get(VISIBLE_DEVICES_ENV, '')}), so this worker would run its "
                "model on the CPU: CUDA did not start here (its libraries missing: pip install "
                "'tensorflow[and-cuda]'; a driver too old for them; the GPU's MPS server not "
                "ready, starting or recovering from a fault; or it refusing more clients than "
                "its 48)",
            ),
        )


def _replay_warmup(runtime: Any, config: PoolConfig, version: int) -> Any:
    """The version's recorded warm-up requests (worker/warmup.py), after the synthetic
    warm-up (which also checks the fast call path); a record that fails is a load failure.
    Its WarmupReport, or None when the version has no warm-up file."""
    import tensorflow as tf

    from mpspool.worker.runtime import ModelLoadError
    from mpspool.worker.warmup import WarmupError, replay

    try:
        report = replay(
            tf,
            runtime,
            config.version_path(version),
            config.warmup_iterations,
            config.signature_method_name_check,
        )
    except WarmupError as exc:
        raise ModelLoadError(
            f"warm-up of model {config.model_name!r} version {version} failed: {exc}", exc.code
        ) from exc
    if report is None:
        log.info("no warm-up requests at %s", Path(config.version_path(version), "assets.extra"))
        return None
    log.info(
        "warm-up: replayed %d records (%d model calls, %d iterations each) from %s in %.2f s",
        report.records,
        report.runs,
        config.warmup_iterations,
        report.path,
        report.seconds,
    )
    return report


def _freeze_loaded_objects() -> None:
    """Keep the cyclic garbage collector away from what loading made.

    A loaded model leaves ~320,000 Python objects (TensorFlow's function graphs, trackables,
    protobufs) that live as long as the worker. A full collection walks them all: 130 ms on
    the demo model here, during which a request waits. Collected once and frozen now, they
    are never walked again; what requests allocate is still collected as before.
    """
    gc.collect()
    gc.freeze()


def _keep_plotting_out() -> None:
    """Before TensorFlow is imported: make matplotlib unimportable in this process.

    TensorFlow's import loads Keras (to register its objects), and Keras imports matplotlib
    for its plotting utilities whenever it is installed (bench/ installs it): 0.4 s of CPU
    and 28 MiB of private memory per worker (`import tensorflow` here: 2.00 → 1.60 s of CPU,
    USS 516 → 488 MiB), for nothing a served model calls. Keras does without it (its
    plotting is optional), as it does where matplotlib is not installed."""
    sys.modules.setdefault("matplotlib", None)  # type: ignore[arg-type]


def stop_while_loading() -> None:
    """Until the serving loop exists, SIGTERM ends the start-up where it is: importing
    TensorFlow, loading, waiting for the weights and warming up take seconds (longer than
    supervisord's stop wait for a large model, which then kills), and nothing a loading
    worker holds needs more than the exit handlers (its private copy of a rewritten model).
    SystemExit, which no load step catches."""

    def stop(_signum: int, _frame: object) -> None:
        raise SystemExit(process.EXIT_OK)

    signal.signal(signal.SIGTERM, stop)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mpspool.worker")
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--slot", required=True, help="its placement (cores, GPU context)")
    parser.add_argument("--model", help="the model it is for (default: the pool's first)")
    parser.add_argument(
        "--version", type=int, help="the model version to serve (default: the pool's first)"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s worker {args.slot} %(levelname)s %(message)s"
    )
    process.die_with_parent()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    _keep_plotting_out()

    pool = PoolConfig.load(args.run_dir)
    config = pool.for_model(args.model) if args.model else pool
    version = config.model_version if args.version is None else args.version
    # Before TensorFlow is imported: its thread pools are created on this process's cores
    # and sized from the intra-op setting (the worker's core count when pinned).
    cores = config.cpu_set(args.slot)
    if cores:
        cpusets.pin(os.getpid(), cores)
        log.info("pinned to CPU cores %s", cpusets.format_cores(cores))
    stop_while_loading()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the controller decides, not the terminal

    _require_mps_daemon()
    _require_gpu(config, args.slot)
    from mpspool.worker.runtime import (
        ModelLoadError,
        ModelRefused,
        WeightsUnavailable,
        load_failure_code,
        load_saved_model,
    )

    load_started = time.monotonic()
    # Until the SavedModel has loaded, a failure is a failed load attempt (TensorFlow's
    # load_attempt_count{status="fail"}, counted by the controller from the exit code).
    failed = process.EXIT_SAVED_MODEL_FAILED
    try:
        runtime = load_saved_model(
            config.version_path(version),
            config.model_name,
            version,
            intra_op_threads=config.threads_per_worker(args.slot),
            inter_op_threads=config.inter_op_threads,
            weights_segment=config.segment_for(version),
            work_dir=str(Path(config.run_dir) / rundir.MODELS_DIR),
            tags=config.saved_model_tags.split(","),
        )
        # TensorFlow's load_latency: the SavedModel's load, not the warm-up after it.
        load_us = round((time.monotonic() - load_started) * 1e6)
        failed = process.EXIT_LOAD_FAILED
        runtime.warm_up(copies_allowed=config.allow_copied_weights)
        replayed = _replay_warmup(runtime, config, version) if config.model_warmup else None
        # A recorded request's check of its fast call, before the weights are looked at: a
        # copy it makes is warm-up's.
        runtime.check_deferred()
        weights = runtime.weights_report()
    # Each reason carries its status code (errors.status_text): GetModelStatus reports it.
    except ModelRefused as exc:  # another try would be refused the same way
        process.fail(
            process.EXIT_CONFIG_ERROR,
            status_text(exc.code, f"cannot load model {config.model_name}: {exc}"),
        )
    except ModelLoadError as exc:
        if isinstance(exc, WeightsUnavailable):  # the publisher's failure, counted there
            failed = process.EXIT_LOAD_FAILED
        process.fail(failed, status_text(exc.code, f"cannot load model {config.model_name}: {exc}"))
    except Exception as exc:  # a load or warm-up that fails: the model cannot serve either
        log.exception("loading or warming up the model failed")
        process.fail(
            failed,
            status_text(
                load_failure_code(exc),
                f"model {config.model_name} failed to load or warm up: {type(exc).__name__}: {exc}",
            ),
        )
    if weights and weights["copied"]:
        copied = ", ".join(f"{k} ({v / 2**20:.1f} MiB)" for k, v in weights["copied"].items())
        # A worker holding private copies of the weights defeats the pool's memory promise
        # (N workers, N copies): refused by default, like any other model that cannot load
        # as asked; --allow-copied-weights serves it anyway, and status shows COPIED.
        if not config.allow_copied_weights:
            process.fail(
                process.EXIT_CONFIG_ERROR,  # every try copies the same: no retry helps
                status_text(
                    Code.FAILED_PRECONDITION,
                    f"TensorFlow copied shared variables into this worker: {copied}; an op "
                    "that writes a variable, or reads it other than by ReadVariableOp and the "
                    "gathers mpspool rewrites, does that. Serve it with --allow-copied-weights "
                    "(each worker then holds its own copy) or --no-share-weights",
                ),
            )
        log.warning("TensorFlow copied shared variables into this worker: %s", copied)
    elif weights:
        log.info(
            "weights: %.1f MiB shared from %s", weights["shared_bytes"] / 2**20, weights["segment"]
        )
    if weights and weights.get("on_device"):
        # TensorFlow places variables on the GPU: loaded from the segment, not the checkpoint.
        log.info(
            "weights: %.1f MiB on the GPU (this worker's own, as MPS clients share no memory)",
            sum(weights["on_device"].values()) / 2**20,
        )
    # Known to the front door by placement and version (and model, but the first's): two
    # versions share a placement while one replaces the other.
    key = wire.slot_key(args.slot, version, pool.model_prefix(config.model_name))
    warmup = None
    if replayed is not None:  # for TF Serving's warm-up metrics, which the front door keeps
        warmup = [config.version_path(version), round(replayed.seconds * 1e6), replayed.records]
    # For TensorFlow's load metrics, which the front door keeps.
    load = [config.version_path(version), load_us]
    worker = Worker(config, key, runtime, weights, warmup, load)
    _freeze_loaded_objects()
    signal.signal(signal.SIGTERM, worker.request_stop)
    log.info("serving %s version %d (pid %d)", config.model_name, version, worker.pid)
    # session / direct / flat / keywords: worker/runtime.py; a signature that refused
    # warm-up's zero example is checked on its first request and may fall back then.
    log.info("call paths: %s", ", ".join(f"{k}: {v}" for k, v in runtime.call_paths.items()))
    worker.serve()
    log.info("stopped after %d requests", worker.served)
    return process.EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
