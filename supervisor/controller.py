"""The controller: the `mpspool start` process.

Renders the pool into supervisord programs, starts supervisord, then runs one loop that
owns every decision: which slot is READY, what to replace (a worker the router declared
dead), how to back off a worker that cannot load its model and when to give up on it, which
model versions are served (supervisor/model_versions.py, one object per model: new version
folders are published and get their own workers; versions the policy no longer wants drain
and stop), which models are served (added and removed by the model config file or a
HandleReloadConfigRequest), and the shutdown order (router drains → workers stop → router
stops → supervisord exits → run directory cleaned). Signal handlers and admin requests only
enqueue; the loop acts.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import math
import os
import shlex
import signal
import subprocess
import sys
import time
import xmlrpc.client
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import quote

import zmq

from mpspool import cpusets, process, rundir, segment, wire
from mpspool.config import ConfigError, PoolConfig
from mpspool.model_config import ModelEntry, model_entries, read_model_config
from mpspool.router import THREADS_ENV as ROUTER_THREADS_ENV
from mpspool.router import binary_path as router_binary
from mpspool.router import runtime_threads as router_threads
from mpspool.supervisor import config_reload
from mpspool.supervisor import supervisord as sd
from mpspool.supervisor.background_read import BackgroundRead
from mpspool.supervisor.disk_view import DiskView, read_disk_view
from mpspool.supervisor.gpu_watch import GpuWatch
from mpspool.supervisor.model_versions import ModelVersions
from mpspool.supervisor.slots import Slot, program_name
from mpspool.supervisor.states import FINAL_STATES, WorkerState
from mpspool.supervisor.versions import VersionGroup, VersionPolicy, VersionState

log = logging.getLogger("mpspool.controller")

# How often the controller reconciles; also the longest a dead worker's in-flight requests
# wait before the router hears of it (sends to a dead worker fail at once).
TICK_S = 0.2
# The signals that stop the pool with a drain (`run`); a second one cuts the drain short.
STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
# How often GPU memory and utilisation (NVML) are sent to the front door for its metrics.
GPU_METRICS_INTERVAL_S = 2.0
# How long the controller tolerates failing to see supervisord or the router.
MAX_BLIND_S = 10.0
ROUTER_PROGRAM = "router:router"
# supervisord killed more often than this within the window: the pool fails.
SUPERVISORD_DEATHS = 3
SUPERVISORD_DEATHS_WINDOW_S = 300.0
# Front doors in a row that die before they ever answer: a crash loop, and the pool fails.
ROUTER_SILENT_DEATHS = 5
# How long a stop of workers while the pool serves (a version retired, a model removed, a
# failed load try) is waited for before the loop goes on; what still runs then is looked at
# each tick until it has stopped (supervisord SIGKILLs it after its stopwaitsecs).
STOP_WAIT_S = 1.0
# A front door that answered the control channel and then says nothing for this long (stopped,
# or stuck: it answers within a tick while it serves, however busy) is killed and started
# again, as a worker silent past --worker-timeout is: before, a SIGSTOPped front door failed
# every request for as long as it stayed stopped, status said SERVING and nothing was logged
# (found by a hunt).
ROUTER_SILENT_S = 10.0
# Silent this long, status says so (a tick or two of silence is a busy moment).
ROUTER_QUIET_S = 2.0
# A worker not ready this long after it started is said (it goes on loading).
LONG_LOAD_S = 120.0
# The router's expected exit codes: supervisord restarts it after any other.
ROUTER_EXIT_CODES = (process.EXIT_OK, process.EXIT_CONFIG_ERROR)


class PoolPhase(enum.Enum):
    STARTING = "starting"
    SERVING = "serving"
    DRAINING = "draining"
    STOPPED = "stopped"


PHASES_ALLOWED: dict[PoolPhase, frozenset[PoolPhase]] = {
    PoolPhase.STARTING: frozenset({PoolPhase.SERVING, PoolPhase.DRAINING}),
    PoolPhase.SERVING: frozenset({PoolPhase.DRAINING}),
    PoolPhase.DRAINING: frozenset({PoolPhase.STOPPED}),
    PoolPhase.STOPPED: frozenset(),
}


class Clock(Protocol):
    """What the controller's decisions read the time from (the `time` module; a fake in
    tests). Waits on sockets and processes use the real clock."""

    def monotonic(self) -> float: ...

    def time(self) -> float: ...


def _router_down_for_good(info: dict[str, Any]) -> str:
    """Why the front door will not come back, or "" while it runs or supervisord is
    restarting it. A killed or crashed router passes through EXITED on its way back to
    STARTING (autorestart="unexpected"): seeing it there is no evidence of anything. The
    evidence is supervisord giving up (FATAL: it kept failing to start) or an exit code it
    does not restart (0, or the configuration error of a port that cannot be bound)."""
    state = info.get("state")
    if state == sd.FATAL:
        return "could not start"
    if state == sd.EXITED:
        code = int(info.get("exitstatus") or 0)
        if code == process.EXIT_CONFIG_ERROR:
            return "could not start"
        if code in ROUTER_EXIT_CODES:
            return f"exited with {code}"
    return ""


class ConfigNotSaved(Exception):
    """A new model configuration that pool.json could not take: nothing of it was applied."""


class RouterLink:
    """The controller's end of the control channel; None answers mean "router not up"."""

    def __init__(self, context: zmq.Context, run_dir: str) -> None:
        self._context = context
        self._endpoint = wire.endpoint(run_dir, wire.CONTROL_ENDPOINT)
        self._seq = 0
        self._socket = self._connect()

    def _connect(self) -> zmq.Socket:
        sock = self._context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self._endpoint)
        return sock

    def ask(self, op: str, timeout_s: float = 0.5, **fields: Any) -> dict[str, Any] | None:
        self._seq += 1
        try:
            message = [b"", wire.pack(op=op, n=self._seq, **fields)]
            self._socket.send_multipart(message, flags=zmq.NOBLOCK)
        except zmq.Again:  # its queue is full: a front door that does not read
            self._reconnect()
            return None
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            if not self._socket.poll(int(left * 1000) + 1):
                break
            reply = wire.unpack(self._socket.recv_multipart()[-1])
            if reply.get("n") == self._seq:  # older replies (after a timeout) are dropped
                return reply
        # Unanswered: what is still queued for it goes (a fresh socket, LINGER 0). A front
        # door alive but not reading (stopped, wedged) let a blocking send fill the queue in
        # about 25 minutes of ticks, then hang the controller for good: no tick, no stop, no
        # cleanup (found by a review).
        self._reconnect()
        return None

    def _reconnect(self) -> None:
        self._socket.close()
        self._socket = self._connect()

    def close(self) -> None:
        self._socket.close()


def url_host(host: str) -> str:
    """``host`` as a URL names it: an IPv6 address in brackets."""
    return f"[{host}]" if ":" in host else host


def rest_url(host: str, port: int, model: str) -> str:
    """A model's REST URL as a user pastes it: the model's name percent-encoded (a space or
    '#' in it cut the URL)."""
    return f"http://{url_host(host)}:{port}/v1/models/{quote(model, safe='')}"


def entries_in_force(config: PoolConfig) -> list[ModelEntry]:
    """The models a configuration serves, as a model config file's entries say them."""
    return [
        ModelEntry(m.name, m.base_path, m.version_policy, dict(m.version_labels))
        for m in config.served_models()
    ]


class Controller:
    def __init__(
        self,
        config: PoolConfig,
        created_run_dir: bool,
        clock: Clock = time,
        restore_priority: Callable[[int, str], int] = process.restore_priority,
    ) -> None:
        self.clock = clock
        # A pid's threads to the serving policy at nice 0.
        self._restore_priority = restore_priority
        self.config = config
        self.run_dir = Path(config.run_dir)
        self.created_run_dir = created_run_dir
        self.log_dir = Path(config.log_dir)
        self.phase = PoolPhase.STARTING  # changed only by _set_phase
        # Each model's versions: their worker groups, states and what the front door is told;
        # in the order of the configuration (the first is the pool's model).
        self.models = {m.name: ModelVersions(self, m.name) for m in config.served_models()}
        # --model_config_file read again (policy and labels) every its poll wait; 0: never.
        config_wait = config.model_config_file_poll_wait_s if config.model_config_file else 0
        self._next_config_read = clock.monotonic() + config_wait if config_wait else math.inf
        self._config_file_said = ""  # the last complaint about the file, said once
        # Each read of the file, on a thread of its own: one on storage that stopped
        # answering (a FIFO stood in for it) held the loop, and with it every worker's
        # replacement, status and stop (found by a hunt).
        self._config_hung = False  # its read has not returned, and that was said
        self._config_read: BackgroundRead[tuple[list[ModelEntry], DiskView | None]] = (
            BackgroundRead(self._read_config_file, "config-read")
        )
        # What the file said last: it is applied again only when it says something new (a
        # HandleReloadConfigRequest in between is not undone by an unchanged file).
        self._file_entries = entries_in_force(config)
        # Models the file's last edit added that had no version yet: the rest of that edit
        # applied, these are added alone over what is in force at the first read that finds
        # a version (TF Serving's file poll adds such a model and serves it once a version
        # is copied in). A HandleReloadConfigRequest applied meanwhile replaces them.
        self._file_waiting: tuple[ModelEntry, ...] = ()
        self._reloads: list[int] = []  # ids of HandleReloadConfigRequests not answered
        # Models those added: while they load, a changed model config file waits, as TF
        # Serving's ReloadConfig holds its lock until the models it adds are available (the
        # file, applied meanwhile, removed such a model before it served and the request was
        # answered OK).
        self._reload_adds: set[str] = set()
        # Those that came while one was in effect: each waits for the one before to be
        # answered, as TF Serving's ReloadConfig holds its lock for the whole call.
        self._reloads_waiting: list[tuple[int, bytes]] = []
        # Program → where its output log ended when its last process was started.
        self._log_from: dict[str, sd.LogEnd] = {}
        # Version folder → its failed load attempts (a worker whose SavedModel did not load,
        # a publisher that could not read it): TensorFlow's load_attempt_count{status="fail"},
        # counted per folder for the pool's life as TensorFlow counts per export dir (a model
        # removed and added back, or two models on one folder, count on).
        self._failed_loads: dict[str, int] = {}
        # Program groups whose stop failed, stopped again at each look (`stop_groups`).
        self._unstopped: set[str] = set()
        # The first waiting request's reads of the disk (its DiskView), on a thread of their
        # own, and whether their hang was said.
        self._reload_read: tuple[int, BackgroundRead[DiskView]] | None = None
        self._reload_hung_said = 0
        # (router pid, names, names being removed) of the models last told to the front door.
        self._models_told: tuple[int, list[str], list[str]] | None = None
        # The slots' states and restarts as the front door last took them (its metrics).
        self._slots_told: tuple[int, list[tuple[str, str, int, str, int]]] | None = None
        # Answers given to calls the front door still lists (a lost reply is sent again).
        self._reload_answers: dict[int, tuple[int, str]] = {}
        self.supervisord = sd.Supervisord(self.run_dir, self.log_dir)
        self.events: deque[str] = deque()  # signals and admin requests, in arrival order
        self.exit_code = 0
        self.exit_reason = ""
        self.port: int | None = None
        self.metrics_port = 0
        self.rest_port = 0
        self.started = self.clock.time()
        self._zmq = zmq.Context()
        self._admin = self._zmq.socket(zmq.ROUTER)
        self._admin.setsockopt(zmq.LINGER, 0)
        self._admin.bind(wire.endpoint(config.run_dir, wire.ADMIN_ENDPOINT))
        self.router = RouterLink(self._zmq, config.run_dir)
        self.gpu = GpuWatch(config, self.run_dir, _gpu_backend(config))
        self.placement = config.placement()  # validated at start: cannot fail here
        # The front door's runtime threads: the placement's, or MPSPOOL_ROUTER_THREADS's.
        self._router_threads = router_threads(self.placement.front_door_threads)
        self.placement_said = self._placement_in_effect()
        self._announced = False
        self._next_gpu_metrics = 0.0
        self._router_pid = 0  # the front door's incarnation seen last
        self._served_counted_by: Any = None  # the front door (pid) whose `served` slots hold
        self._router_answered = False  # whether that one has answered the control channel
        self._router_silent_deaths = 0  # incarnations in a row that died before answering
        self._router_replaced = 0  # front doors that ended and were started again, in all
        self._router_since = 0.0  # wall-clock time the current one was first seen
        # Monotonic time of the first ask the current one left unanswered since it last
        # answered (None: it answered the last; counted from an ask, not from its last
        # answer, so that a controller starved of CPU for a while does not take its own
        # pause for the front door's silence).
        self._router_silent_since: float | None = None
        self._router_killed = 0  # the pid of the silent one killed last
        self._router_running = False  # whether supervisord said last that one runs
        # Front doors started again after one could not bind the pool's ports once it had
        # served (_restart_router_later), since one last answered; and when the next is due.
        self._router_restarts = 0
        self._router_restart_at: float | None = None
        self._supervisord_config = ""  # the rendered configuration, to start it again
        self._supervisord_deaths: list[float] = []  # monotonic times it died
        # Programs whose command supervisord refused to spawn (NO_FILE, NOT_EXECUTABLE), with
        # its words: such a program stays STOPPED or EXITED as it was, which read as "exit
        # status 0" and counted as a failed load until the pool failed saying that (found by
        # a review).
        self._spawn_refused: dict[str, str] = {}
        self._config_unsaved = False  # pool.json is behind the configuration in force

    # -- programs -----------------------------------------------------------------
    def programs(self) -> list[sd.Program]:
        python = sys.executable
        env = {"PYTHONUNBUFFERED": "1", "TF_CPP_MIN_LOG_LEVEL": "2"}
        router = sd.Program(
            name="router",
            command=[router_binary(), "--run-dir", str(self.run_dir)],
            # supervisord stops programs in descending priority when it shuts down by
            # itself (the controller was killed): the front door first, so that it stops
            # taking requests and drains while the workers still answer, then the workers,
            # then the MPS daemons (5). Start order is the controller's: workers are not
            # autostarted, so the daemons and then the front door start first anyway.
            priority=30,
            environment={
                **env,
                ROUTER_THREADS_ENV: self._router_threads,
            },
            autorestart="unexpected",
            exitcodes=ROUTER_EXIT_CODES,
            # Every spawn counts as started: kills soon after a restart must not make
            # supervisord give up on the front door (FATAL). Crash loops: _router_crash_loop.
            startsecs=0,
            stopwaitsecs=int(self.config.shutdown_delay_s + self.config.drain_timeout_s + 5),
        )
        daemons = self.gpu.programs(env)
        workers = [
            sd.Program(
                name=program_name(slot.name, slot.version, slot.model),
                group=group.group,
                # Loads at --loading-priority, every thread of it (TensorFlow's pools
                # inherit it); _restore_priorities sets its serving policy when it takes
                # traffic.
                command=process.at_loading_priority(
                    [
                        python,
                        "-m",
                        "mpspool.worker",
                        "--run-dir",
                        str(self.run_dir),
                        # The pool's first model is the worker's default: its name, which
                        # may be anything (a leading '-', a ' #' supervisord's config would
                        # cut as a comment), stays out of the command line.
                        *([f"--model={slot.model}"] if slot.model else []),
                        "--slot",
                        slot.name,
                        "--version",
                        str(slot.version),
                    ],
                    self.config.loading_priority,
                ),
                priority=20,
                environment={**env, **self.gpu.worker_environment(slot.name)},
                # Started by the controller once what they need is ready (MPS daemons).
                autostart=False,
                # supervisord spawns and reports; the controller decides every restart, its
                # back-off and FATAL (one owner). startsecs=0: a process is RUNNING once
                # spawned, so supervisord never counts a kill as a failed start of its own.
                autorestart="false",
                exitcodes=(0, process.EXIT_CONFIG_ERROR, *process.LOAD_FAILURES),
                startsecs=0,
                startretries=0,
            )
            for model in self.models.values()
            for group in model.groups.values()
            if group.state is not VersionState.END
            for slot in group.slots.values()
        ]
        return [*daemons, router, *workers]

    @property
    def router_pid(self) -> int:
        """The front door's incarnation seen last (0: none yet)."""
        return self._router_pid

    @property
    def model(self) -> ModelVersions:
        """The pool's first model (its only one, unless the configuration lists several)."""
        return next(iter(self.models.values()))

    @property
    def policy(self) -> VersionPolicy:
        """The first model's version policy in force."""
        return self.model.policy

    @property
    def slots(self) -> dict[str, Slot]:
        """Every model's and version's slots, by key ("cpu-0@2", "ranker/cpu-0@2")."""
        return {key: slot for model in self.models.values() for key, slot in model.slots.items()}

    def groups(self) -> list[VersionGroup]:
        """Every model's version groups."""
        return [g for model in self.models.values() for g in model.groups.values()]

    # -- main loop ----------------------------------------------------------------
    def run(self) -> int:
        # SIGHUP too (the terminal of a foreground `mpspool start` closing), as a stop: by
        # default it ended the pool without a drain or a word. Not where it is ignored
        # (`nohup mpspool start`): the pool is meant to outlive its terminal there. SIGQUIT
        # (Ctrl-\) as supervisord takes it, an exit request: by default it ended the
        # controller as kill -9 does, its run dir and segments left (found by a hunt).
        stops = [signal.Signals[name] for name in STOP_SIGNALS]
        if signal.getsignal(signal.SIGHUP) != signal.SIG_DFL:
            stops.remove(signal.SIGHUP)
        for sig in stops:
            signal.signal(
                sig, lambda signum, _frame: self.events.append(signal.Signals(signum).name)
            )
        try:
            text = sd.render_config(
                self.run_dir, self.log_dir, f"mpspool-{self.config.pool_id}", self.programs()
            )
            for stale in segment.remove_stale():
                log.info("removed a weight segment left by a pool that died: %s", stale)
            # Each first version's publisher (when weights are shared) runs on while
            # supervisord, the front door and its workers start (ModelVersions.prepare_first).
            for model in self.models.values():
                failed = model.prepare_first()
                if failed:
                    model.first_publish_failed(failed, self.clock.monotonic())
                    if self.phase is not PoolPhase.STARTING:  # no try left: the pool failed
                        return self.exit_code
            if self.stop_asked():
                # Asked to stop while a first publisher ran (one stuck on a hung mount, say):
                # nothing more is started, and what runs is ended below (stop_everything).
                log.info("stopped before the pool started")
                return self.exit_code
            self._supervisord_config = text
            self._place_self()
            self._note_router_log_end()
            self.supervisord.start(text)
            # Order: MPS daemons answer (with the pool's defaults) → workers. A worker that
            # started before its daemon would silently run without MPS.
            self.gpu.start(self.supervisord.process_info())
            for model in self.models.values():
                first = model.groups[model.config.model_version]
                if first.retry_at is None:  # else started once a later try has published
                    model.start_workers(first, "spawned", False)
            failures = 0
            while self.phase in (PoolPhase.STARTING, PoolPhase.SERVING):
                self._serve_admin(TICK_S)
                if self.events:
                    self._dispatch(self.events.popleft())
                    continue
                if self.supervisord.proc is not None and self.supervisord.proc.poll() is not None:
                    if not self._revive_supervisord():
                        break
                    continue
                try:
                    self.tick()
                    failures = 0
                except (OSError, xmlrpc.client.Error, zmq.ZMQError) as exc:
                    # One failed look (a slow supervisord) is no reason to take the pool down;
                    # many in a row are.
                    failures += 1
                    log.warning("reconciling failed (%d in a row): %s", failures, exc)
                    if failures * TICK_S >= MAX_BLIND_S:
                        if not self._kill_unreachable_supervisord(exc):
                            raise
                        failures = 0  # started again, with the pool's processes, next
        except Exception as exc:
            log.exception("controller failed")
            self.exit_code, self.exit_reason = 1, f"controller failed: {exc}"
        finally:
            self.stop_everything()
        return self.exit_code

    def _place_self(self) -> None:
        """Log the CPU placement; with a core kept for the front door and controller, move
        this process there. Done after the first publishers started (they keep every core)
        and before supervisord starts: supervisord inherits the affinity and hands it to the
        front door at each (re)start. Workers set their own cores before TensorFlow loads."""
        placement = self.placement
        log.info("CPU placement: %s", self.placement_said)
        if placement.reserved:
            cpusets.pin(os.getpid(), placement.reserved)

    def _dispatch(self, event: str) -> None:
        if event in (*STOP_SIGNALS, "stop"):
            log.info("%s: shutting down", event)
            self._set_phase(PoolPhase.DRAINING, event)

    def tick(self) -> None:
        if self._config_unsaved:
            self._save_config()
        infos = self.supervisord.process_info()
        answer = self.router.ask("snapshot")
        # No answer (a router busy or restarting) is not "no workers registered": slots keep
        # the state they have until the router speaks again.
        router_answered = answer is not None
        snap = answer or {}
        self._take_served(snap)
        router_info = infos.get(ROUTER_PROGRAM, {})
        self._router_running = router_info.get("state") in (sd.STARTING, sd.RUNNING)
        router_down = _router_down_for_good(router_info)
        if router_down and self._router_may_bind_again(router_info):
            router_down = self._restart_router_later()
        router_down = router_down or self._router_crash_loop(router_info, router_answered)
        if router_down:
            # Its last words; failing those, why supervisord could not spawn it at all.
            why = self._tail_reason(ROUTER_PROGRAM) or router_info.get("spawnerr", "")
            self.fail_pool(f"the router {router_down}: {why or 'it said nothing'}")
            return
        if snap.get("port") and self.port is None:
            port = int(snap["port"])
            metrics_port = int(snap.get("metrics_port") or 0)
            rest_port = int(snap.get("rest_port") or 0)
            self.port, self.metrics_port, self.rest_port = port, metrics_port, rest_port
            if 0 in (self.config.port, self.config.metrics_port, self.config.rest_api_port):
                # Pin the ports the OS picked, so a restarted router binds the same ones.
                self.config = dataclasses.replace(
                    self.config,
                    port=port,
                    metrics_port=metrics_port or self.config.metrics_port,
                    rest_api_port=rest_port or self.config.rest_api_port,
                )
                self._save_config()
        for gpu, why in self.gpu.faults(self.supervisord, infos, self.clock.monotonic()).items():
            self._restart_gpu(gpu, why)
            infos = self.supervisord.process_info()
        for gpu in self.gpu.due(self.clock.monotonic()):
            self._bring_back_gpu(gpu)
            infos = self.supervisord.process_info()
        self._publish_gpu_usage(router_answered)
        self._stop_unstopped(infos)
        for group in self.groups():
            said = group.restore_segment_if_removed()
            if said:
                log.warning("%s: %s", group.label, said)
        workers = snap.get("workers", {})
        dead = snap.get("declared_dead", {})
        now = self.clock.monotonic()
        for slot in self.slots.values():
            if self.gpu.is_down(self.config.slot_gpu(slot.name)):
                continue  # stopped, waiting for its GPU's daemon (_bring_back_gpu)
            self._observe(
                slot,
                infos.get(slot.program, {}),
                workers.get(slot.key),
                dead.get(slot.key),
                now,
                router_answered,
            )
        for model in self.models.values():
            if not model.required or (model.has_served and self.config.fatal_retry_s > 0):
                # Added while serving: a version that cannot load just ends. Served: a pool
                # up and serving stays up while its slots are FATAL (health NOT_SERVING), as
                # supervisord keeps a FATAL program's siblings; each tries again after
                # --fatal-retry-after, and one whose files came back serves again. With no
                # retry (--fatal-retry-after 0) nothing would come back: the pool ends, so
                # that Kubernetes starts it again.
                continue
            # A version waiting to try its load again has no worker to count (its slots are
            # STOPPED until then).
            live = [
                s
                for g in model.groups.values()
                if g.state in (VersionState.LOADING, VersionState.AVAILABLE)
                and g.publisher is None
                and g.retry_at is None
                for s in g.slots.values()
            ]
            if live and all(s.state is WorkerState.FATAL for s in live):
                reasons = {s.reason for s in live}
                which = f" of model {model.name}" if len(self.models) > 1 else ""
                self.fail_pool(f"no worker{which} could start: " + "; ".join(sorted(reasons)))
                return
        if router_answered:
            self._take_reload_requests(snap.get("reload_requests") or [], now)
        self._reconcile_versions(now, snap, router_answered)
        self._tell_router_slots(router_answered)
        self._forget_removed_models()
        self._answer_reloads()
        self._restore_priorities()
        if self.phase is not PoolPhase.STARTING and self.phase is not PoolPhase.SERVING:
            return
        serving = all(m.serving_version() is not None for m in self.models.values() if m.required)
        if not self._announced and self.port and serving:
            self._announce()

    def _observe(
        self,
        slot: Slot,
        info: dict[str, Any],
        registered: dict[str, Any] | None,
        declared_dead_pid: int | None,
        now: float,
        router_answered: bool = True,
    ) -> None:
        """Bring one slot's state in line with what supervisord and the router report."""
        state = info.get("state")
        pid = int(info.get("pid") or 0)
        if slot.state is WorkerState.BACKOFF:
            if now >= slot.retry_at:
                self._start(slot, f"retry {slot.load_failures}")
            return
        if slot.state is WorkerState.FATAL:
            if self.config.fatal_retry_s > 0 and now >= slot.retry_at:
                # A cool-down, not forever: what failed may have been passing (a full disk,
                # a GPU being reset). The reason stays in status until it is READY again.
                slot.load_failures = 0
                self._start(slot, f"retrying {self.config.fatal_retry_s:g} s after FATAL")
            return
        if slot.state in FINAL_STATES or slot.state is WorkerState.DRAINING:
            return  # DRAINING: its version is retiring, which owns it now
        if state in (sd.STARTING, sd.RUNNING) and pid:
            slot.start_pending = False
            if pid != slot.pid:
                if slot.pid:
                    self.forget(slot, "replaced")
                slot.incarnations += 1
                slot.pid = pid
                slot.started_at = float(info.get("start") or self.clock.time())
                slot.change_state(WorkerState.STARTING, f"pid {pid}")
            if declared_dead_pid == pid:
                if slot.kill_sent_to != pid:
                    # Silent past the liveness window (stopped, wedged): the router already
                    # moved its requests elsewhere; replace the process.
                    log.warning(
                        "slot %s: pid %d declared dead by the router; killing it", slot.name, pid
                    )
                    slot.kill_sent_to = pid
                    self.rpc("signalProcess", slot.program, "KILL")
                return
            if registered and int(registered["pid"]) == pid:
                slot.inflight = int(registered["inflight"])
                slot.weights = registered.get("weights")
                if slot.state is WorkerState.STARTING:
                    slot.load_failures = 0
                    slot.reason = ""
                    slot.ready_pid = pid
                    slot.change_state(WorkerState.READY, "registered with the router")
            elif slot.state is WorkerState.READY and router_answered:
                # Not a crash: a front door started again has not met it yet (its exit, if it
                # died, is said when supervisord reports it).
                slot.change_state(
                    WorkerState.STARTING, "no longer registered with the router", logging.INFO
                )
            elif slot.state is WorkerState.STARTING:
                self._say_long_load(slot, pid)
            return
        if state == sd.BACKOFF:
            return  # supervisord is retrying a process that died right after spawn
        if state == sd.FATAL:
            # Only a spawn error gets here (startsecs=0): the command itself cannot run.
            self.forget(slot, "supervisord gave up")
            slot.reason = info.get("spawnerr") or self._tail_reason(slot.program)
            self._make_fatal(slot, now)
            return
        refused = self._spawn_refused.get(slot.program, "")
        if refused and state in (sd.EXITED, sd.STOPPED) and slot.start_pending and not slot.pid:
            # Never spawned: the first word of its command cannot run (the interpreter gone
            # after a redeploy, with --loading-priority normal; chrt missing, with idle, where
            # a missing interpreter is chrt's exit 127 instead). FATAL at once: its version's
            # load try failed (tried again while tries are left), and the slot is tried again
            # after its cool-down, when the command may be back.
            del self._spawn_refused[slot.program]
            self.forget(slot, "supervisord cannot start it")
            slot.start_pending = False
            slot.load_failures = self.config.start_retries + 1
            slot.reason = f"supervisord cannot start its command: {refused}"
            self._make_fatal(slot, now)
            return
        if state in (sd.EXITED, sd.STOPPED) and (slot.pid or slot.start_pending):
            self._exited(slot, int(info.get("exitstatus") or 0), now)

    def _exited(self, slot: Slot, exitstatus: int, now: float) -> None:
        """A worker process ended without being asked to: decide what comes next. Nothing
        restarts it but this (supervisord's autorestart is off for workers)."""
        ended = self.supervisord.exit_description(slot.program) or f"exit status {exitstatus}"
        who = f"pid {slot.pid}" if slot.pid else "its process"
        killed_by_us = slot.pid and slot.kill_sent_to == slot.pid
        # READY, or READY once: the router drops a worker the moment its connection closes
        # (or it says BYE), which the controller may see before supervisord reports the exit.
        was_ready = slot.state is WorkerState.READY or (slot.pid and slot.ready_pid == slot.pid)
        self.forget(slot, ended)
        slot.pid = 0
        if exitstatus == process.EXIT_CONFIG_ERROR:
            # Refused by the pool's own settings (the worker's last words say which flag
            # would serve it): backing off and trying again cannot change that.
            slot.refused = True
            slot.load_failures = self.config.start_retries + 1
            slot.reason = self._tail_reason(slot.program) or f"{who} {ended}"
            self._make_fatal(slot, now)
            return
        if exitstatus == process.EXIT_SAVED_MODEL_FAILED:
            self._model_of(slot).note_failed_load(slot.version)
        load_failed = exitstatus in process.LOAD_FAILURES
        if load_failed or not (was_ready or killed_by_us):
            # It could not load, or died before it was ever ready (a crash loop, or killed
            # while loading): a start failure, backed off and counted toward FATAL. Its own
            # last words say why; failing those, how it ended.
            slot.load_failures += 1
            last = self._tail_reason(slot.program)
            slot.reason = (
                last if load_failed and last else (f"{who} {ended}" + (f": {last}" if last else ""))
            )
            if slot.load_failures > self.config.start_retries:
                self._make_fatal(slot, now)
            else:
                slot.retry_at = now + self.config.backoff_s * 2 ** (slot.load_failures - 1)
                slot.change_state(WorkerState.BACKOFF, slot.reason)
            return
        # A healthy worker crashed, was killed from outside, was killed by us after the router
        # declared it dead, or ended a model call that hung: replace it now. Not a start
        # failure.
        if exitstatus == process.EXIT_CALL_TIMEOUT:
            ended = f"{ended}: a model call ran past --call-timeout"
        self._start(slot, f"{who} {ended}; restarting")

    def note_failed_load(self, path: str) -> None:
        self._failed_loads[path] = self._failed_loads.get(path, 0) + 1

    def failed_loads_at(self, path: str) -> int:
        return self._failed_loads.get(path, 0)

    def _model_of(self, slot: Slot) -> ModelVersions:
        """The model whose version ``slot`` serves."""
        return next(m for m in self.models.values() if slot.key in m.slots)

    def _start(self, slot: Slot, why: str) -> None:
        slot.start_pending = True
        self.rpc("startProcess", slot.program, False)
        slot.change_state(WorkerState.STARTING, why)

    def _make_fatal(self, slot: Slot, now: float) -> None:
        slot.retry_at = now + self.config.fatal_retry_s
        slot.change_state(WorkerState.FATAL, slot.reason)

    # -- model versions ------------------------------------------------------------
    def _reconcile_versions(self, now: float, snap: dict[str, Any], router_answered: bool) -> None:
        """Poll the base path (`--file_system_poll_wait_seconds`), start the versions the
        policy wants, move each group along, and tell the front door when anything changed."""
        if now >= self._next_config_read or self._config_read.running():
            self._read_model_config(now)
        # The models first: a model's version table is only taken for a model it serves.
        self._tell_router_models(router_answered)
        for model in self.models.values():
            model.reconcile(now, snap, router_answered)

    def _placement_in_effect(self) -> str:
        """The placement's line, and the thread counts given instead of its own (the log and
        status said the placement's while --intra-op-threads or MPSPOOL_ROUTER_THREADS
        set others; found by a hunt)."""
        given = []
        if self.config.intra_op_threads > 0:
            given.append(
                f"workers: {self.config.intra_op_threads} thread(s) each (--intra-op-threads)"
            )
        if int(self._router_threads) != self.placement.front_door_threads:
            given.append(f"front door: {self._router_threads} thread(s) ({ROUTER_THREADS_ENV})")
        said = self.placement.explanation
        return f"{said}; in effect instead: {', '.join(given)}" if given else said

    def _read_model_config(self, now: float) -> None:
        """--model_config_file again: a new version policy or new labels apply at once. A file
        that cannot be read, or that names other models, changes nothing (said once); one
        whose read does not return goes on being waited for, the pool serving on."""
        if not self._config_read.running():
            self._next_config_read = now + self.config.model_config_file_poll_wait_s
        read = self._config_read.look()
        if read is None:
            if self._config_read.hung() and not self._config_hung:
                log.warning(
                    "%s: reading it has not returned (storage not answering?); serving on "
                    "as before", self.config.model_config_file,
                )  # fmt: skip
                self._config_hung = True
            return
        if self._config_hung:
            log.info("%s: read again", self.config.model_config_file)
            self._config_hung = False
        if isinstance(read.error, ConfigError):
            self._say_once_of_config_file(f"{read.error}; serving on as before")
            return
        if read.error is not None:
            raise read.error  # not a file's fault: the loop's own handling says what
        entries, view = read.value or ([], None)
        unchanged = entries == self._file_entries
        if unchanged and (view is None or not self._file_waiting):
            return
        if self._reloads_waiting or (self._reloads and (unchanged or self._reload_adds)):
            # Requests queued before this change are older: TF Serving's file poll takes the
            # lock they wait on, so the file lands after them, and after one in effect that
            # adds a model, which holds that lock until the model serves. Applied at a later
            # read. (A model the file added waits for any in effect: it may replace them.)
            return
        if view is None or not self._view_is_current(view):
            # Read for another configuration (a reload applied meanwhile, or the file said
            # what was in force then): read again, now.
            self._next_config_read = now
            return
        if unchanged:
            self._add_waiting_models(view, now)
            return
        try:
            refused = self._apply_model_entries(view, now, self.config.model_config_file)
        except ConfigNotSaved as exc:
            refused = str(exc)  # the file is read again at the next poll
        if refused:
            self._say_once_of_config_file(refused)
            return
        self._config_file_said = ""
        self._file_entries = entries
        self._file_waiting = view.waiting_entries()
        self._say_waiting_models(view)
        # Newer than a HandleReloadConfigRequest still waiting: its labels are not given (as
        # TF Serving applies the two one after the other, the later winning); it is answered
        # on the labels now configured.
        self._forget_asked_labels()

    def _add_waiting_models(self, view: DiskView, now: float) -> None:
        """The models the file added that waited for a version, added alone over what is in
        force now (`view` read for them beside the models served) once one has a version;
        the file is not applied again (that undid a HandleReloadConfigRequest's labels and
        models at every read while a model waited; found by a review)."""
        if view.added is None and not view.refusal:
            return  # none has a version yet (said when the file was applied)
        # Models being removed drain on: listed, they would refuse the change.
        kept = tuple(
            e for e in view.entries if e.name not in self.models or not self.models[e.name].removed
        )
        try:
            refused = self._apply_model_entries(
                dataclasses.replace(view, entries=kept), now, self.config.model_config_file
            )
        except ConfigNotSaved as exc:
            refused = str(exc)  # tried again at the next read
        if refused:
            self._say_once_of_config_file(refused)
            return
        self._config_file_said = ""
        self._file_waiting = view.waiting_entries()
        self._say_waiting_models(view)

    def _say_waiting_models(self, view: DiskView) -> None:
        """Once, the models a config file adds that wait for a version (its other changes
        applied)."""
        if view.waiting:
            self._say_once_of_config_file(
                "; ".join(
                    f"model {name}: {why}; added once it has one" for name, why in view.waiting
                )
            )

    def _read_config_file(self) -> tuple[list[ModelEntry], DiskView | None]:
        """On the config read's thread: the file's models and, when they are not what it
        said last, what applying them needs of the disk. It reads only what the loop
        replaces whole (its configuration, the file's last models), never changes it."""
        config = self.config
        entries = read_model_config(Path(config.model_config_file))
        source = config.model_config_file
        if entries != self._file_entries:
            return entries, read_disk_view(config, entries, source, wait_for_versions=True)
        waiting = self._file_waiting
        if not waiting:
            return entries, None
        # Only the models that waited for a version, beside those served (the loop leaves
        # out any being removed).
        served = entries_in_force(config)
        return entries, read_disk_view(config, [*served, *waiting], source, wait_for_versions=True)

    def _view_is_current(self, view: DiskView) -> bool:
        """Whether a view was read for the configuration in force (else it is read again:
        a model added or removed, or a policy changed, while it read)."""
        return view.based_on is self.config

    def _apply_model_entries(self, view: DiskView, now: float, source: str) -> str:
        """A model config in force from now: each model's policy and labels, models not
        served added (their first version loads beside what serves), served models not
        listed removed (they drain, then end). The refusal ("" when applied), with nothing
        changed: a model at another base path, the pool's first model left out, a model
        still being removed, a new model that cannot be served. ConfigNotSaved, with nothing
        changed: pool.json could not take it. What it needs of the disk was read off the
        loop (`view`, read for the configuration in force now: `_view_is_current`)."""
        waiting = {name for name, _ in view.waiting}  # added later, once they have a version
        entries = [e for e in view.entries if e.name not in waiting]
        served = {m.name: m for m in self.config.served_models()}
        first = self.config.model_name
        named = {e.name for e in entries}
        for entry in entries:
            model = served.get(entry.name)
            # The same folder however it is named (a link kept as given, or its target).
            if model is not None and not view.same_folder(model.base_path, entry.base_path):
                return (
                    f"{source} names model {entry.name!r} at {entry.base_path}; it is served "
                    f"from {model.base_path}: a model's base path is fixed while it is served "
                    "(remove it, then add it back)"
                )
            if model is not None and self.models[entry.name].removed:
                return f"{source}: model {entry.name!r} is still being removed; ask again"
        if first not in named:
            return (
                f"{source} leaves out {first!r}, the model the pool started with, which "
                "cannot be removed while it serves: start a new pool without it"
            )
        config = self.config
        added = [e for e in entries if e.name not in served]
        if added:
            if view.refusal or view.added is None:
                return view.refusal or f"{source}: the models it adds were not read"
            config = view.added
            try:
                # Without MPS, more contexts per GPU than its compute mode admits (checked at
                # start for the models then).
                for warning in self.gpu.check_without_mps(config):
                    log.warning("%s: %s", source, warning)
            except ConfigError as exc:
                return f"{source}: {exc}"
        changed = []
        for entry in entries:
            model_config = config.for_model(entry.name)
            if entry.name in served and (entry.version_policy, entry.labels) != (
                model_config.version_policy, model_config.version_labels,
            ):  # fmt: skip
                config = config.with_versions(entry.name, entry.version_policy, entry.labels)
                changed.append(entry)
        # Saved before anything changes: a save that failed (a full disk) after the new
        # configuration was taken in left a model listed that no ModelVersions served, and
        # the next tick's lookup of it ended the controller (found by a review).
        try:
            config.save(self.run_dir)
            self._config_unsaved = False  # whatever was behind is written with it
        except OSError as exc:
            raise ConfigNotSaved(
                f"{source}: the pool's configuration cannot be saved: {exc}"
            ) from exc
        self.config = config
        for entry in changed:
            log.info(
                "%s: model %s: version policy %s, labels %s",
                source, entry.name, entry.version_policy, entry.labels or "none",
            )  # fmt: skip
            # The base path read again under the new policy, now.
            self.models[entry.name].set_policy(VersionPolicy.parse(entry.version_policy), now)
        for entry in added:
            log.info("%s: model %s added from %s", source, entry.name, entry.base_path)
            model = ModelVersions(self, entry.name, required=False)
            self.models[entry.name] = model
            model.start_added(now)
        for name in served.keys() - named:
            if not self.models[name].removed:
                self.models[name].remove(now)
        return ""

    def _tell_router_models(self, router_answered: bool) -> None:
        """The models to serve (all but those being removed), and those being removed whose
        workers still drain (UNLOADING in GetModelStatus until they end, then END), to the
        front door when that changed or the front door is a new one (which starts with
        pool.json's list)."""
        if not router_answered:
            return
        listed = [
            {"name": m.name, "version": m.version}
            for m in self.config.served_models()
            if not self.models[m.name].removed
        ]
        removing = sorted(name for name, m in self.models.items() if m.removed)
        told = (self._router_pid, [m["name"] for m in listed], removing)
        if told == self._models_told:
            return
        answer = self.router.ask("models", models=listed, removing=removing)
        if answer is not None and answer.get("ok"):
            self._models_told = told
        elif answer is not None:
            log.warning("the front door refused the models %s: %s", told[1], answer.get("error"))

    def _tell_router_slots(self, router_answered: bool) -> None:
        """Each slot's state, restarts, model and version, to the front door when they
        changed or the front door is a new one: its metrics show what only the controller
        sees (a slot in BACKOFF or FATAL has no worker there; restarts are of processes it
        never met), and a request for a version whose every slot is FATAL fails at once
        instead of waiting for a worker that cannot come."""
        if not router_answered:
            return
        rows = sorted(
            (slot.key, slot.state.value, slot.restarts, model.name, slot.version)
            for model in self.models.values()
            for slot in model.slots.values()
        )
        told = (self._router_pid, rows)
        if told == self._slots_told:
            return
        slots = [
            {"slot": key, "state": state, "restarts": n, "model": name, "version": version}
            for key, state, n, name, version in rows
        ]
        answer = self.router.ask("slots", slots=slots)
        if answer is None:
            return  # asked again at the next tick
        # Said once per change, not at every tick, if this front door refuses them.
        self._slots_told = told
        if not answer.get("ok"):
            log.warning("the front door refused the slots' states: %s", answer.get("error"))

    def _forget_removed_models(self) -> None:
        """A removed model whose versions have all ended leaves the pool's configuration."""
        for name in [n for n, m in self.models.items() if m.removed and not m.groups]:
            models = tuple(m for m in self.config.served_models() if m.name != name)
            self.config = dataclasses.replace(self.config, models=models)
            del self.models[name]
            self._save_config()
            log.info("model %s removed: its versions have ended", name)

    def _take_reload_requests(self, listed: list[Any], now: float) -> None:
        """The front door lists each HandleReloadConfigRequest until it is answered: a new
        one is taken, one answered already is answered again (that reply was lost)."""
        ids = {int(request_id) for request_id, _ in listed}
        self._reload_answers = {k: v for k, v in self._reload_answers.items() if k in ids}
        # One no longer listed was given up by its caller (or its front door): not applied.
        self._reloads_waiting = [(i, body) for i, body in self._reloads_waiting if i in ids]
        gone = [i for i in self._reloads if i not in ids]
        if gone:
            # One in effect no longer holds the requests behind it, nor the model config
            # file: a version it wants that keeps failing held them through every load
            # retry, minutes, while a caller with a deadline asked again and again (found
            # by a hunt). What it applied stays, as TF Serving's call runs on when its
            # caller leaves; its labels do not move, as a call answered OK alone moves them.
            self._reloads = [i for i in self._reloads if i in ids]
            log.info(
                "HandleReloadConfigRequest %s: its caller gave up; what it applied stays, "
                "its labels do not move", ", ".join(map(str, gone)),
            )  # fmt: skip
            if not self._reloads:
                self._forget_asked_labels()
        waiting = {i for i, _ in self._reloads_waiting}
        for request_id, body in listed:
            request_id = int(request_id)
            if request_id in self._reload_answers:
                code, message = self._reload_answers[request_id]
                self.router.ask("reload_done", id=request_id, code=code, message=message)
            elif request_id not in self._reloads and request_id not in waiting:
                self._reloads_waiting.append((request_id, bytes(body)))
        self._next_reload(now)

    def _next_reload(self, now: float) -> None:
        """The next waiting HandleReloadConfigRequest applied, once none is in effect: two
        at once were both answered with the later one's outcome (the earlier said OK for a
        model the later removed before it ever served; found by an operator test)."""
        while self._reloads_waiting and not self._reloads:
            request_id, body = self._reloads_waiting[0]
            if not self._reload_config_request(request_id, body, now):
                return  # its reads of the disk run on: looked at again at the next tick
            self._reloads_waiting.pop(0)

    def _reload_config_request(self, request_id: int, body: bytes, now: float) -> bool:
        """A HandleReloadConfigRequest the front door holds: applied now, answered when it
        has taken effect (`_answer_reloads`), or refused at once; False while what it needs
        of the disk is still being read (`_reload_disk_view`)."""
        from google.protobuf.message import DecodeError

        from mpspool.protos import server_config_pb2

        source = "HandleReloadConfigRequest"
        try:
            entries = model_entries(server_config_pb2.ModelServerConfig.FromString(body), source)
        except (DecodeError, ConfigError) as exc:
            self._tell_reload(request_id, config_reload.INVALID_ARGUMENT, str(exc))
            return True
        # Policies and models apply now, labels once the request has taken effect: TF Serving
        # builds its whole label map from the new config and swaps it in only if every label
        # is valid (ServerCore::UpdateModelVersionLabelMap), so a refused reload leaves every
        # label where it was, and none moves while the request's versions load.
        labels_now = {m.name: dict(m.version_labels) for m in self.config.served_models()}
        held = [dataclasses.replace(e, labels=labels_now.get(e.name, {})) for e in entries]
        view = self._reload_disk_view(request_id, held, source)
        if view is None:
            return False
        # A served model's new policy that wants none of its versions on disk is refused
        # before anything changes: applied, it went on to load a version copied in later,
        # though the caller was told its request failed (found by an operator's hunt).
        for entry in entries:
            model = self.models.get(entry.name)
            if model is None or model.removed:
                continue
            if not view.same_folder(model.config.model_base_path, entry.base_path):
                continue  # refused below, for that
            on_disk = view.versions(entry.base_path)
            if on_disk is None:
                continue  # the reload's answer says what the policy found, once settled
            policy = VersionPolicy.parse(entry.version_policy)
            unfit = config_reload.no_version_fits(entry.name, policy, on_disk)
            if unfit:
                self._tell_reload(request_id, config_reload.FAILED_PRECONDITION, unfit)
                return True
        hopeless = self._label_without_version(entries, view)
        if hopeless:
            self._tell_reload(request_id, config_reload.FAILED_PRECONDITION, hopeless)
            return True
        # Read before the request changes anything: a version that fails as it applies (an
        # added model's publisher cannot start) failed after it was asked.
        failing = {name: model.failing_versions() for name, model in self.models.items()}
        adds = {e.name for e in entries if e.name not in self.models}
        try:
            refused = self._apply_model_entries(view, now, source)
        except ConfigNotSaved as exc:  # nothing changed; asking again may succeed
            self._tell_reload(request_id, config_reload.UNAVAILABLE, str(exc))
            return True
        if refused:
            self._tell_reload(request_id, config_reload.INVALID_ARGUMENT, refused)
            return True
        for entry in entries:
            self.models[entry.name].labels_asked = dict(entry.labels)
        for name, model in self.models.items():
            model.note_reload_asked(failing.get(name, set()), first=not self._reloads, now=now)
        if not self._reloads:
            self._reload_adds = set()  # those answered before added theirs
        self._reloads.append(request_id)
        self._reload_adds |= adds
        if self._file_waiting:
            # Newer than the file's edit: what the request says is the configuration now.
            log.info(
                "HandleReloadConfigRequest %d: %s no longer waited for (the file's edit that "
                "added it is replaced)", request_id,
                ", ".join(f"model {e.name}" for e in self._file_waiting),
            )  # fmt: skip
            self._file_waiting = ()
        return True

    def _reload_disk_view(
        self, request_id: int, entries: list[ModelEntry], source: str
    ) -> DiskView | None:
        """What a reload needs of the disk (its base paths listed and followed, its added
        models' first versions), read on a thread of its own for the configuration in force
        now; None while that runs (said once when it hangs), or when the configuration
        changed meanwhile (read again at the next look). Other requests wait behind it, as
        behind a request in effect."""
        running = self._reload_read
        if running is not None and running[0] != request_id:
            # The reads of a request given up since still run: one read at a time (a client
            # that gives up and asks again, on storage that stopped answering, piled up a
            # thread per request). Its outcome, once it comes, is dropped.
            if running[1].wait(0.0) is None and running[1].running():
                self._say_reload_hung(running[1], request_id, source)
                return None
            self._reload_read = None
        if self._reload_read is None:
            config = self.config
            read: BackgroundRead[DiskView] = BackgroundRead(
                lambda: read_disk_view(config, entries, source), f"reload-{request_id}"
            )
            self._reload_read = (request_id, read)
        read = self._reload_read[1]
        outcome = read.look()
        if outcome is None:
            self._say_reload_hung(read, request_id, source)
            return None
        self._reload_read = None
        if outcome.error is not None:
            raise outcome.error  # not the disk's answer (read_disk_view keeps those)
        view = outcome.value
        if view is None or not self._view_is_current(view):
            return None  # read for a configuration no longer in force: again, now
        return view

    def _say_reload_hung(
        self, read: BackgroundRead[DiskView], request_id: int, source: str
    ) -> None:
        """Said once per request: the reads it waits for have not returned."""
        if read.hung() and self._reload_hung_said != request_id:
            self._reload_hung_said = request_id
            log.warning(
                "%s %d: reading its base paths has not returned (storage not answering?); "
                "it waits, and later requests wait behind it", source, request_id,
            )  # fmt: skip

    def _label_without_version(self, entries: list[ModelEntry], view: DiskView) -> str:
        """Why a label of the request can never take effect ("" when each can): it names a
        version the request's policy does not serve (one not on disk, or one the policy
        retires), and is not a label --allow_version_labels_for_unavailable_models lets point
        ahead. Such a request is refused once the pool settles under it (`_answer_reloads`);
        here it is refused before it changes anything, as TF Serving checks every label
        before it adds or updates a model (ServerCore::ReloadConfig runs
        UpdateModelVersionLabelMap first). Applied first, it removed the models it left out
        and retired versions, then answered FAILED_PRECONDITION (found by a reload hunt).
        A label on a version the request loads is still waited for."""
        allowed = self.config.allow_version_labels_for_unavailable_models
        for entry in entries:
            model = self.models.get(entry.name)
            served = model is not None and not model.removed
            told = model.labels_told() if served else {}
            failing = model.failing_versions() if served else set()
            on_disk = view.versions(entry.base_path) or set()
            wanted = VersionPolicy.parse(entry.version_policy).aspired(on_disk, failing)
            for label, version in sorted(entry.labels.items()):
                if version in wanted:
                    continue
                if config_reload.label_may_wait_for(label, version, told, allowed):
                    continue
                return config_reload.unavailable_label(entry.name, version)
        return ""

    def _answer_reloads(self) -> None:
        if not self._reloads:
            return
        if not all(m.listed_since_asked() for m in self.models.values()):
            return  # a base path read since the request came is still to be taken
        outcomes = [
            config_reload.outcome(
                model.name,
                model.policy,
                model.on_disk,
                model.available_versions(),
                model.failed,
                model.config.version_labels if model.labels_asked is None else model.labels_asked,
                model.labels_told(),
                model.config.allow_version_labels_for_unavailable_models,
                model.failed_before_reload(),
            )
            for model in self.models.values()
            if not model.removed
        ]
        if any(o is None for o in outcomes):
            return  # a model's versions are still on their way
        # The first model that did not take the change says why; else every one did.
        result = next((o for o in outcomes if o is not None and o[0]), (config_reload.OK, ""))
        if result[0] == config_reload.OK and not self._give_reload_labels():
            return  # answered once the front door has the labels (a later pass)
        self._forget_asked_labels()
        for request_id in self._reloads:
            self._tell_reload(request_id, *result)
        self._reloads = []
        self._next_reload(self.clock.monotonic())

    def _give_reload_labels(self) -> bool:
        """The labels of a HandleReloadConfigRequest that took effect, every model's at once,
        and whether the front door has them all now (its caller is answered only then, and
        may call by them at once)."""
        asked = [m for m in self.models.values() if m.labels_asked is not None and not m.removed]
        changed = False
        for model in asked:
            labels = model.labels_asked or {}
            if labels != model.config.version_labels:
                log.info(
                    "HandleReloadConfigRequest: model %s: labels %s", model.name, labels or "none"
                )
                self.config = self.config.with_versions(
                    model.name, model.config.version_policy, labels
                )
                changed = True
        if changed:
            self._save_config()
        return all([model.tell_router_labels() for model in asked])

    def _save_config(self) -> None:
        """pool.json from the configuration in force, for what reads it later (a restarted
        front door: its ports and labels). One that cannot be written now (a full disk) is
        written at a later tick, said once: a failure here escaped each tick, and ended the
        pool after ten seconds of them, or was never tried again (found by a review). An
        added model's is saved before it is applied instead (`ConfigNotSaved`): its
        workers read it from there."""
        try:
            self.config.save(self.run_dir)
        except OSError as exc:
            if not self._config_unsaved:
                log.warning("cannot save the pool's configuration (tried again): %s", exc)
            self._config_unsaved = True
            return
        if self._config_unsaved:
            log.info("the pool's configuration is saved again")
        self._config_unsaved = False

    def _forget_asked_labels(self) -> None:
        for model in self.models.values():
            model.labels_asked = None

    def _tell_reload(self, request_id: int, code: int, message: str) -> None:
        if code:
            log.warning("HandleReloadConfigRequest %d refused: %s", request_id, message)
        else:
            log.info("HandleReloadConfigRequest %d: in effect", request_id)
        self._reload_answers[request_id] = (code, message)
        self.router.ask("reload_done", id=request_id, code=code, message=message)

    def _say_once_of_config_file(self, what: str) -> None:
        if what != self._config_file_said:
            log.warning("%s", what)
        self._config_file_said = what

    def sync_supervisord(self) -> None:
        """supervisord's programs made to match the groups: the configuration rewritten and
        reloaded, groups added and removed (supervisord's own reloadConfig protocol)."""
        text = sd.render_config(
            self.run_dir, self.log_dir, f"mpspool-{self.config.pool_id}", self.programs()
        )
        self._supervisord_config = text
        added, _changed, removed = self.supervisord.update(text)
        for name in removed:
            if name in self._unstopped:
                continue  # removed at the sync after it has stopped (`_stop_unstopped`)
            self.rpc("removeProcessGroup", name)
        for name in added:
            self.rpc("addProcessGroup", name)
        for group in self.groups():
            group.in_supervisord = True

    def _restore_priorities(self) -> None:
        """Workers load at --loading-priority (idle), so that a version loading beside one
        that serves takes only the CPU the serving workers leave; a worker that takes traffic
        (READY, its version AVAILABLE) gets its serving thread to --worker-policy and every
        other thread to normal, all at nice 0, once per process (process.restore_priority).
        Loaded at normal priority under the normal policy, there is nothing to change."""
        if self.config.loading_priority == "normal" and self.config.worker_policy == "normal":
            return
        for group in self.groups():
            if group.state is not VersionState.AVAILABLE:
                continue
            for slot in group.slots.values():
                if slot.state is not WorkerState.READY or slot.priority_restored == slot.pid:
                    continue
                slot.priority_restored = slot.pid
                try:
                    threads = self._restore_priority(slot.pid, self.config.worker_policy)
                except ProcessLookupError:
                    continue  # gone: its exit is seen on the next tick
                except PermissionError as exc:
                    log.warning(
                        "slot %s: cannot put pid %d to its serving priority: %s",
                        slot.name,
                        slot.pid,
                        exc,
                    )
                    continue
                log.info(
                    "slot %s: pid %d serving (its serving thread %s, the others normal, "
                    "nice 0; %d threads changed)",
                    slot.name,
                    slot.pid,
                    self.config.worker_policy,
                    threads,
                )

    def _restart_gpu(self, gpu: int, why: str) -> None:
        """Every worker of one GPU goes, in slot order; its daemon must answer again; then
        they come back. Other GPUs' workers are not touched."""
        log.warning("GPU %d: restarting its workers: %s", gpu, why)
        going = [s for s in self._gpu_slots(gpu) if s.state not in FINAL_STATES]
        # Every one is taken out of rotation before any is stopped: one forgotten while its
        # neighbours still served would have its requests sent to them, to be lost again.
        # Blameless: the GPU's fault, not theirs (a request lost twice with no worker back
        # would be given up as one that ends workers).
        for slot in going:
            self.forget(slot, why, blameless=True)
        for slot in going:
            self.rpc("stopProcess", slot.program, True)
            if slot.state is WorkerState.DRAINING:
                # Its version is retiring: it does not come back, and what it held was lost
                # with the GPU. Its version ends once none runs.
                slot.change_state(WorkerState.STOPPED, f"GPU {gpu}: {why}")
            elif slot.state is not WorkerState.BACKOFF:
                slot.change_state(WorkerState.STARTING, f"GPU {gpu}: {why}")
        self._bring_back_gpu(gpu)

    def _bring_back_gpu(self, gpu: int) -> None:
        """Its workers start again once its daemon answers; until then the GPU is down, its
        workers stopped and tried again later (GpuWatch.due), while the other GPUs serve."""
        slots = self._gpu_slots(gpu)
        now = self.clock.monotonic()
        if not self.gpu.recover(gpu, self.supervisord, now):
            down = self.gpu.down[gpu]
            log.error(
                "GPU %d: its MPS control daemon does not answer (%s); its workers wait, "
                "tried again in %.0f s",
                gpu,
                down.why,
                down.retry_at - now,
            )
            for slot in slots:
                if slot.state is WorkerState.STARTING:
                    slot.reason = f"GPU {gpu} down: {down.why}"
            return
        for slot in slots:
            if slot.state is WorkerState.STARTING:
                slot.start_pending = True
                self.rpc("startProcess", slot.program, False)

    def _gpu_slots(self, gpu: int) -> list[Slot]:
        return [s for s in self.slots.values() if self.config.slot_gpu(s.name) == gpu]

    def rpc(self, method: str, *args: Any) -> Any:
        """A supervisord command whose refusal is news, not an error: between our look and
        our call supervisord may already have done it (ALREADY_STARTED, NOT_RUNNING)."""
        starting = method in ("startProcess", "startProcessGroup")
        ends = self._log_ends(method, str(args[0])) if starting else {}
        try:
            answer = getattr(self.supervisord.rpc(), method)(*args)
        except xmlrpc.client.Fault as fault:
            if method == "startProcess" and fault.faultCode in sd.SPAWN_REFUSALS:
                self.note_spawn_refused(str(args[0]), fault.faultString)
            else:
                log.info("supervisord refused %s%s: %s", method, args, fault.faultString)
            return None
        if method == "startProcess":
            self.note_spawn_refused(str(args[0]), "")
        # Taken once the start is: a refused one (ALREADY_STARTED) would have skipped what
        # the running process wrote.
        self._log_from.update(ends)
        return answer

    def _log_ends(self, method: str, name: str) -> dict[str, sd.LogEnd]:
        """Where the logs of the programs about to start end (their files' sizes): why each
        process stopped is read from there on (`_tail_reason`). Programs no longer the
        pool's are forgotten here."""
        programs = self._programs_of_group(name) if method == "startProcessGroup" else [name]
        known = {s.program for s in self.slots.values()} | {ROUTER_PROGRAM}
        self._log_from = {p: end for p, end in self._log_from.items() if p in known}
        ends = {}
        for program in programs:
            end = self.supervisord.log_end(program)
            if end is None:  # not to be looked at: the whole tail is read, as before
                self._log_from.pop(program, None)
            else:
                ends[program] = end
        return ends

    def _note_router_log_end(self) -> None:
        """The front door's log as supervisord is started (it starts it): its reasons come
        from this pool's front doors, not a previous pool's."""
        end = self.supervisord.log_end(ROUTER_PROGRAM)
        if end is not None:
            self._log_from[ROUTER_PROGRAM] = end

    def _programs_of_group(self, group: str) -> list[str]:
        return [s.program for s in self.slots.values() if s.program.split(":")[0] == group]

    def _tail_reason(self, program: str) -> str:
        """Why a program's last process says it stopped (supervisord.tail_reason), from
        what that process wrote."""
        return self.supervisord.tail_reason(program, self._log_from.get(program))

    def stop_asked(self) -> bool:
        """Whether a signal to stop is waiting to be dispatched."""
        return any(e in STOP_SIGNALS for e in self.events)

    def note_spawn_refused(self, program: str, why: str) -> None:
        """supervisord refused to spawn ``program``'s command (``why``: its words): its slot
        says so when next looked at (`_observe`); "": it took the last start asked, so an
        older refusal says nothing of what comes next."""
        if not why:
            self._spawn_refused.pop(program, None)
            return
        log.error("supervisord cannot start %s: %s", program, why)
        self._spawn_refused[program] = why

    def stop_groups(self, groups: list[str]) -> None:
        """Their workers stop, all at once; back when none runs, or after STOP_WAIT_S with
        what still runs left to the later looks. A group whose stop failed (supervisord slow
        to answer, or a process that outlived its SIGKILL) is stopped again at each look
        until none of it runs (`_stop_unstopped`): it was forgotten, and its workers ran on
        untracked until the pool's shutdown, each holding its memory and its mapping of a
        segment already unlinked. Not waited for to the end: a worker that ignores SIGTERM
        (stuck) held the loop until supervisord's SIGKILL 10 s later, and with it status,
        restarts, reloads and the file's polls (found by a review)."""
        try:
            left = self.supervisord.stop_groups(groups, timeout=STOP_WAIT_S)
        except (OSError, xmlrpc.client.Error) as exc:
            log.warning("stopping %s failed (stopped again at the next look): %s",
                        ", ".join(groups), exc)  # fmt: skip
            self._unstopped.update(groups)
            return
        self._unstopped.difference_update(groups)
        if left:
            log.info(
                "still running %g s after their stop, looked at again at each tick: %s",
                STOP_WAIT_S, ", ".join(left),
            )  # fmt: skip
            self._unstopped.update(program.split(":")[0] for program in left)

    def still_stopping(self, group: str) -> bool:
        """Whether processes of program group ``group`` were told to stop and may still run
        (`stop_groups`): starting it meanwhile spawns nothing (supervisord runs it still)."""
        return group in self._unstopped

    def _stop_unstopped(self, infos: dict[str, dict[str, Any]]) -> None:
        """The program groups whose stop failed, told again without waiting (a look that
        waited for them took a minute while a process sat in uninterruptible sleep); once
        none of a group runs (`infos`: this look's), supervisord's programs are synced, and
        a group that left the pool is removed then (removing one still running is refused,
        and that refusal ended the sync before any group was added)."""
        # (None is started again meanwhile: a load's start waits for them, `still_stopping`.)
        if not self._unstopped:
            return
        live = [i for i in infos.values() if i.get("group") in self._unstopped]
        running = {i["group"] for i in live if i.get("state") in sd.STOPPABLE_STATES}
        told = {i["group"] for i in live if i.get("state") in (sd.STARTING, sd.RUNNING, sd.BACKOFF)}
        for group in sorted(told):  # (those STOPPING were told already)
            try:
                self.rpc("stopProcessGroup", group, False)
            except (OSError, xmlrpc.client.Error) as exc:
                log.warning("stopping %s failed (stopped again at the next look): %s", group, exc)
        stopped = self._unstopped - running
        if not stopped:
            return
        self._unstopped &= running
        try:
            # Out of supervisord before the sync: one wanted again (a model added back) is
            # then added as its programs read now, not kept as they were (another base path).
            for group in sorted(stopped):
                self.rpc("removeProcessGroup", group)  # (a refusal, BAD_NAME: gone already)
            self.sync_supervisord()
        except (OSError, xmlrpc.client.Error) as exc:
            log.warning("syncing supervisord's programs failed: %s", exc)

    def _infos(self) -> dict[str, dict[str, Any]]:
        try:
            return self.supervisord.process_info()
        except (OSError, xmlrpc.client.Error):
            return {}

    def forget(
        self, slot: Slot, why: str, tell_router: bool = True, blameless: bool = False
    ) -> None:
        """The incarnation slot.pid is over: tell the router at once (its in-flight requests
        are retried elsewhere now, not after the liveness window). `blameless`: it ends for
        a reason that is not its requests' doing, which the router then does not count
        against them (a request lost that way is not taken for one that ends workers)."""
        if slot.pid and tell_router:
            self.router.ask("gone", slot=slot.key, pid=slot.pid, blameless=blameless)
        slot.inflight = 0
        slot.weights = None
        slot.pid = 0

    def _take_served(self, snap: dict[str, Any]) -> None:
        """Each slot's served, as the front door counts it (its departed workers' answers
        included: a poll of the current worker alone missed those after the last look). A
        front door started again counts from 0: what the last one counted is kept first."""
        served = snap.get("served")
        if served is None:
            return
        if snap.get("pid") != self._served_counted_by:
            for slot in self.slots.values():
                slot.served_before += slot.router_served
                slot.router_served = 0
            self._served_counted_by = snap.get("pid")
        for slot in self.slots.values():
            slot.router_served = int(served.get(slot.key, 0))

    def _set_phase(self, new: PoolPhase, why: str) -> None:
        """The one writer of the pool's phase; staying where it is, is no change."""
        if new is self.phase:
            return
        if new not in PHASES_ALLOWED[self.phase]:
            raise RuntimeError(f"pool phase {self.phase.value} -> {new.value} ({why})")
        log.info("pool: %s -> %s (%s)", self.phase.value, new.value, why)
        self.phase = new

    def fail_pool(self, reason: str) -> None:
        log.error("%s", reason)
        self.exit_code, self.exit_reason = 1, reason
        self._set_phase(PoolPhase.DRAINING, reason)

    def _kill_unreachable_supervisord(self, exc: BaseException) -> bool:
        """supervisord alive, its socket gone (removed from the run directory: nothing
        answers at its path): killed, so that the loop starts it again with the pool's
        processes, as one that died (the pool failed after MAX_BLIND_S, though every process
        served; found by a hunt). False for any other failure, or a supervisord that ended."""
        proc = self.supervisord.proc
        if not isinstance(exc, (FileNotFoundError, ConnectionRefusedError)):
            return False
        if proc is None or proc.poll() is not None:
            return False
        log.warning(
            "supervisord (pid %d) has not answered at its socket for %.0f s (%s): killing it, "
            "to start it again with the pool's processes", proc.pid, MAX_BLIND_S, exc,
        )  # fmt: skip
        proc.kill()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            return False
        return True

    def _revive_supervisord(self) -> bool:
        """supervisord died (killed from outside); every process it ran went with it (their
        parent-death signals). Start it again with the same programs and bring the pool back:
        MPS daemons, front door (same ports, pinned in pool.json), workers (the shared weights
        are still published). False, with the pool failed, when it keeps dying."""
        assert self.supervisord.proc is not None
        code = self.supervisord.proc.returncode
        now = self.clock.monotonic()
        self._supervisord_deaths = [
            t for t in self._supervisord_deaths if now - t < SUPERVISORD_DEATHS_WINDOW_S
        ] + [now]
        if len(self._supervisord_deaths) > SUPERVISORD_DEATHS:
            self.fail_pool(
                f"supervisord exited with {code}, {len(self._supervisord_deaths)} times in "
                f"{SUPERVISORD_DEATHS_WINDOW_S:.0f} s"
            )
            return False
        log.warning("supervisord exited with %s: starting it and the pool's processes again", code)
        for slot in self.slots.values():
            # The front door died too: nobody to tell that these processes are gone.
            self.forget(slot, "supervisord died", tell_router=False)
            slot.pid = 0
            if slot.state in (WorkerState.READY, WorkerState.STARTING):
                slot.change_state(WorkerState.STARTING, "supervisord died")
        if self._router_pid:
            self._router_replaced += 1  # the next one seen is not counted as a replacement
        self._router_pid, self._router_answered = 0, False
        self._note_router_log_end()
        self.supervisord.start(self._supervisord_config)
        # Each GPU's daemon as after a fault: its workers start once it answers, and one that
        # does not leaves its GPU down (tried again later), not the pool.
        for gpu in self.config.gpus:
            self._bring_back_gpu(gpu)
        for slot in self.slots.values():
            if slot.state is WorkerState.STARTING and self.config.slot_gpu(slot.name) is None:
                slot.start_pending = True
                self.rpc("startProcess", slot.program, False)
        return True

    def _router_may_bind_again(self, info: dict[str, Any]) -> bool:
        """Whether a front door that exited because it could not bind is worth starting
        again: one did serve on these ports (pinned), so another process took one in the
        moment between a restart's death and its bind (an ephemeral port the OS handed out
        meanwhile), which may let go. At the pool's start the same exit fails it at once."""
        return (
            self.port is not None
            and info.get("state") == sd.EXITED
            and int(info.get("exitstatus") or 0) == process.EXIT_CONFIG_ERROR
        )

    def _restart_router_later(self) -> str:
        """Start the front door again after a back-off (1, 2, 4, 8 s); "" meanwhile, or why
        the pool fails once ROUTER_SILENT_DEATHS restarts in a row could not bind."""
        now = self.clock.monotonic()
        if self._router_restarts >= ROUTER_SILENT_DEATHS:
            return f"could not start again ({self._router_restarts} tries)"
        if self._router_restart_at is None:
            wait = float(2**self._router_restarts)
            self._router_restart_at = now + wait
            log.warning(
                "the front door could not start again (%s): trying again in %g s",
                self._tail_reason(ROUTER_PROGRAM) or "exit status 3",
                wait,
            )
        elif now >= self._router_restart_at:
            self._router_restart_at = None
            self._router_restarts += 1
            self.rpc("startProcess", ROUTER_PROGRAM, False)
        return ""

    def _router_crash_loop(self, info: dict[str, Any], answered: bool) -> str:
        """ "keeps dying before it answers" when that happened to ROUTER_SILENT_DEATHS front
        doors in a row; "" otherwise. supervisord restarts the front door at once and never
        gives up on it (startsecs=0: a kill soon after a restart is not a failed start), so a
        crash loop is told here: by incarnations that never answered the control channel. A
        front door killed from outside has answered (it serves), however often it is killed."""
        pid = int(info.get("pid") or 0)
        if pid and pid != self._router_pid:
            if self._router_pid:
                # Said here too: the controller's log is the one `kubectl logs` shows, and
                # supervisord's own line about it is in its log file only.
                ended = self.supervisord.exit_description(ROUTER_PROGRAM) or "ended"
                log.warning(
                    "front door pid %d %s; pid %d started in its place",
                    self._router_pid,
                    ended,
                    pid,
                )
                if not self._router_answered:
                    self._router_silent_deaths += 1
                self._router_replaced += 1
            self._router_pid, self._router_answered = pid, False
            self._router_since = self.clock.time()
            self._router_silent_since = None
        if answered:
            self._router_answered = True
            self._router_silent_deaths = self._router_restarts = 0
            self._router_silent_since = None
        elif pid and self._router_answered:
            self._kill_router_if_silent(pid)
        if self._router_silent_deaths >= ROUTER_SILENT_DEATHS:
            return f"keeps dying before it answers ({self._router_silent_deaths} in a row)"
        return ""

    def _publish_gpu_usage(self, router_answered: bool) -> None:
        """Every GPU_METRICS_INTERVAL_S, the GPUs' memory and utilisation (NVML) to the front
        door, which exports them as Prometheus gauges beside its own metrics."""
        now = self.clock.monotonic()
        if not self.config.gpus or not router_answered or now < self._next_gpu_metrics:
            return
        self._next_gpu_metrics = now + GPU_METRICS_INTERVAL_S
        self.router.ask("gpus", gpus=self.gpu.usage_samples())

    def _announce(self) -> None:
        self._announced = True
        self._set_phase(
            PoolPhase.SERVING, "a version of each model is AVAILABLE and the front door listens"
        )
        host, model = self.config.host, self.config.model_name
        serving = ""
        for each in self.models.values():
            version = each.serving_version()
            slots = each.groups[version].slots.values() if version is not None else []
            ready = sum(s.state is WorkerState.READY for s in slots)
            serving += (
                f"mpspool: serving model {each.name!r} version {version} "
                f"on {host}:{self.port} ({ready}/{len(slots)} workers ready)\n"
            )
        print(
            serving + "  TF Serving gRPC API: PredictionService (Predict, Classify, Regress, "
            "MultiInference, GetModelMetadata), ModelService, grpc.health.v1\n"
            f"  query:  any TF Serving client at {host}:{self.port}, model_spec.name={model!r}\n"
            + (
                f"  REST:   curl {rest_url(host, self.rest_port, model)}   "
                f'(:predict with {{"instances": [...]}})\n'
                if self.rest_port
                else ""
            )
            # Lines to paste: a path with a space quoted, a name in a URL percent-encoded.
            + f"  status: mpspool status --run-dir {shlex.quote(str(self.run_dir))}\n"
            f"  stop:   mpspool stop --run-dir {shlex.quote(str(self.run_dir))}   (or Ctrl-C)\n"
            f"  logs:   {self.log_dir}",
            flush=True,
        )

    # -- admin channel ------------------------------------------------------------
    def _serve_admin(self, timeout_s: float) -> None:
        if not self._admin.poll(int(timeout_s * 1000)):
            return
        identity, *rest = self._admin.recv_multipart()
        try:
            request = wire.unpack(rest[-1])
            op = request.get("op")
            if op == "status":
                reply = self.status()
            elif op == "stop":
                self.events.append("stop")
                reply = {"ok": True}
            else:
                reply = {"error": f"unknown op {op!r}"}
        except wire.ProtocolError as exc:
            reply = {"error": str(exc)}
        except Exception as exc:  # a status the controller cannot make: said, never fatal
            log.exception("the admin request could not be answered")
            reply = {"error": f"the controller could not answer: {type(exc).__name__}: {exc}"}
        try:
            answer = wire.pack(**reply)
        except (TypeError, ValueError) as exc:  # what msgpack cannot carry (text not UTF-8)
            log.exception("the admin reply could not be packed")
            answer = wire.pack(error=f"the reply could not be packed: {exc}")
        self._admin.send_multipart([identity, *rest[:-1], answer])

    def status(self) -> dict[str, Any]:
        now = self.clock.time()
        return {
            "pool": {
                "pid": os.getpid(),
                "pool_id": self.config.pool_id,
                "phase": self.phase.value,
                "model": self.config.model_name,
                "version": self.model.serving_version(),
                "version_policy": self.model.policy.describe(),
                "version_labels": self.config.version_labels,
                # The labels the front door resolves now: a label waits for its version.
                "labels_in_effect": self.model.labels_told(),
                "model_base_path": self.config.model_base_path,
                "listen": f"{self.config.host}:{self.port}" if self.port else None,
                # TF Serving's --grpc_socket_path, as gRPC clients name it.
                "grpc_socket": (
                    f"unix:{self.config.grpc_socket_path}" if self.config.grpc_socket_path else None
                ),
                "metrics": (
                    f"http://{url_host(self.config.host)}:{self.metrics_port}/metrics"
                    if self.metrics_port
                    else None
                ),
                "rest": (
                    rest_url(self.config.host, self.rest_port, self.config.model_name)
                    if self.rest_port
                    else None
                ),
                "run_dir": str(self.run_dir),
                "log_dir": str(self.log_dir),
                "uptime_s": round(now - self.started, 1),
                "exit_reason": self.exit_reason,
                # Models the model config file added that wait for a first version.
                "models_waiting": [e.name for e in self._file_waiting],
                "cpu_placement": self.placement_said,
                # Read back from the live processes, not from the config: what the OS applies.
                "router_cpus": cpusets.affinity(self._router_pid) if self._router_pid else None,
                "router_pid": self._router_pid or None,
            },
            # The first model's versions, as before pools served several; then every model's.
            "versions": self.model.status_table(),
            "models": [
                {
                    "name": model.name,
                    "base_path": model.config.model_base_path,
                    "version": model.serving_version(),
                    "version_policy": model.policy.describe(),
                    "version_labels": model.config.version_labels,
                    "labels_in_effect": model.labels_told(),
                    "versions": model.status_table(),
                    "removing": model.removed,
                }
                for model in self.models.values()
            ],
            "front_door": self._describe_front_door(now),
            "slots": [self._describe(slot, now) for slot in self.slots.values()],
            "gpus": self.gpu.status(self._infos()) if self.config.gpus else [],
        }

    def _say_long_load(self, slot: Slot, pid: int) -> None:
        """A worker not ready LONG_LOAD_S after it started: said once (log, and its reason
        in status) for its process, which goes on loading (a large model, or a read that
        hangs: a worker stuck reading a dead NFS mount was STARTING for ever, with no
        reason anywhere; found by a hunt). TF Serving has no load timeout either."""
        loading = self.clock.time() - slot.started_at
        if slot.long_load_said == pid or not slot.started_at or loading < LONG_LOAD_S:
            return
        slot.long_load_said = pid
        slot.reason = (
            f"pid {pid} not ready {loading:.0f} s after it started: still loading (a large "
            "model, or a read that hangs); its log says more"
        )
        log.warning("slot %s: %s", slot.key, slot.reason)

    def _kill_router_if_silent(self, pid: int) -> None:
        """A front door silent on the control channel for ROUTER_SILENT_S since it last
        answered: killed, so that supervisord starts another (its replacement is told
        apart by its pid, as any front door that died)."""
        now = self.clock.monotonic()
        if self._router_silent_since is None:
            self._router_silent_since = now
        silent = now - self._router_silent_since
        if silent < ROUTER_SILENT_S:
            return
        log.warning(
            "front door pid %d has not answered the control channel for %.0f s (stopped or "
            "stuck): killed, to be started again", pid, silent,
        )  # fmt: skip
        self._router_silent_since = now  # once: its death is seen at a later tick
        self._router_killed = pid
        self.rpc("signalProcess", ROUTER_PROGRAM, "KILL")  # a refusal is logged there

    def _describe_front_door(self, now: float) -> dict[str, Any]:
        """The front door as a row beside the workers': SERVING once it answered the control
        channel, STARTING before, SILENT once silent for ROUTER_QUIET_S after that (it is
        replaced at ROUTER_SILENT_S; the reason says so), DOWN while none runs; restarts
        since the pool started."""
        pid = self._router_pid if self._router_running else 0
        state = "SERVING" if pid and self._router_answered else "STARTING" if pid else "DOWN"
        since, reason = self._router_silent_since, ""
        silent = 0.0 if since is None else self.clock.monotonic() - since
        killed = bool(pid) and self._router_killed == pid
        if state == "SERVING" and (silent >= ROUTER_QUIET_S or killed):
            state = "SILENT"
            reason = (
                f"killed after {ROUTER_SILENT_S:.0f} s without an answer; supervisord starts "
                "another"
                if killed
                else f"no answer on the control channel for {silent:.0f} s (killed at "
                f"{ROUTER_SILENT_S:.0f} s)"
            )
        return {
            "state": state,
            "pid": pid or None,
            "uptime_s": round(now - self._router_since, 1) if pid else None,
            "restarts": self._router_replaced,
            "reason": reason,
            "cpus": cpusets.affinity(pid) if pid else None,
        }

    def _describe(self, slot: Slot, now: float) -> dict[str, Any]:
        described = slot.describe(now)
        described["cpus"] = cpusets.affinity(slot.pid) if slot.pid else None
        return described

    # -- shutdown -----------------------------------------------------------------
    def stop_everything(self) -> None:
        """Drain the router, stop the workers, stop the router, stop supervisord, clean up.

        A second SIGINT/SIGTERM during the drain skips the rest of the drain."""
        self._set_phase(PoolPhase.DRAINING, "stopping")
        for slot in self.slots.values():
            if slot.state in (WorkerState.STARTING, WorkerState.READY):
                slot.change_state(WorkerState.DRAINING, "pool stopping")
        try:
            if self.supervisord.proc is not None and self.supervisord.proc.poll() is None:
                self._drain_router()
                self.gpu.terminate_clients()
                groups = [g.group for g in self.groups() if g.in_supervisord]
                groups += sorted(self._unstopped - set(groups))  # those that left, unstopped
                left = self.supervisord.stop_groups(groups)
                if left:
                    log.warning("still running after 60 s of stopping: %s", ", ".join(left))
                self.gpu.quit()
                self.supervisord.stop_groups(["router"])
        except (OSError, xmlrpc.client.Error) as exc:
            log.warning("orderly stop failed (%s); shutting supervisord down", exc)
        self.supervisord.shutdown()
        # The versions retire with the pool; workers, which map their segments, are gone.
        for model in self.models.values():
            model.stop()
        for slot in self.slots.values():
            if slot.state is not WorkerState.STOPPED:
                slot.change_state(WorkerState.STOPPED, "pool stopped")
        self._set_phase(PoolPhase.STOPPED, "stopped")
        self.router.close()
        self._admin.close()
        self._zmq.term()
        rundir.clean(self.run_dir)
        made_by_another_start = rundir.release(self.run_dir)
        if self.created_run_dir or made_by_another_start:
            try:
                self.run_dir.rmdir()
            except OSError:
                pass
        if self.exit_reason:
            print(f"mpspool: {self.exit_reason}", file=sys.stderr, flush=True)

    def _drain_router(self) -> None:
        if (
            self.router.ask(
                "drain", delay=self.config.shutdown_delay_s, grace=self.config.drain_timeout_s
            )
            is None
        ):
            return  # no router to drain
        deadline = time.monotonic() + self.config.shutdown_delay_s + self.config.drain_timeout_s + 2
        while time.monotonic() < deadline:
            self._serve_admin(TICK_S)
            if self.stop_asked():
                log.warning("second stop request: not waiting for in-flight requests")
                # The front door too: what is left of its delay and grace ends now.
                self.router.ask("drain", delay=0.0, grace=0.0)
                return
            snap = self.router.ask("snapshot")
            if snap is None or snap.get("phase") == "stopped":
                return


def _gpu_backend(config: PoolConfig) -> Any:
    """NVML (or the fake GPUs of MPSPOOL_FAKE_GPUS) for GPU pools; None for CPU pools."""
    if not config.gpus:
        return None
    from mpspool.mps.gpus import backend

    return backend()
