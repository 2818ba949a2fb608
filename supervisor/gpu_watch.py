"""The controller's GPU side: one MPS control daemon per GPU, and the faults that force a
GPU's workers to restart.

Owns the daemons' supervisord programs, their readiness and defaults, and three fault
signals, each reported as "GPU g must restart its workers":
- the daemon died (supervisord restarts it; its new server knows none of the old clients);
- the daemon's output reports its MPS server failed (every client of that GPU is dead or
  about to be);
- NVML reports a critical Xid error on the GPU.
The controller decides what a fault means for the slots (supervisor/controller.py
`_restart_gpu`); this module only watches and talks to the daemons.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
import xmlrpc.client
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mpspool.config import ConfigError, PoolConfig
from mpspool.mps import server_start
from mpspool.mps.control import DaemonHung, MpsDaemon, MpsError, fault_lines
from mpspool.mps.gpus import FAKE_GPUS_ENV
from mpspool.supervisor import supervisord as sd

# Xids NVML reports that leave the GPU and every other context as they were: row remapping
# and page retirement recorded (63, 64), a high single-bit ECC rate (92).
INFORMATIONAL_XIDS = frozenset({63, 64, 92})
# Xids of one process's context, faulted or ended: NVIDIA's device plugin keeps a GPU
# healthy through 13, 31, 43, 45 and 68 ("application errors"); 94 is an ECC error contained
# to the process it hit (docs.nvidia.com/deploy/xid-errors). 45 ("preemptive cleanup") comes
# when a context's process ends, the pool's own restarts too.
CONTEXT_XIDS = frozenset({13, 31, 43, 45, 68, 94})
# After a GPU's workers are restarted for a fault, the context Xids for this long are that
# fault's (its workers' stop wait is 10 s, then SIGKILL).
XID_SETTLE_S = 30.0
# How long a GPU's MPS server is waited for before its workers start (mps/server_start.py),
# at most: a recovering GPU's wait is its daemon's (the controller's loop waits meanwhile).
SERVER_START_S = 15.0
SERVER_START_MIN_S = 2.0

log = logging.getLogger("mpspool.controller")

# Set for MPS workers to the control binary: a worker refuses to start without its daemon.
WORKER_MPS_ENV = "MPSPOOL_REQUIRE_MPS"
# How long a fault's recovery waits for a daemon to answer: the controller's tick waits with
# it, so a GPU whose daemon does not come back is tried again later (RETRY_FIRST_S) instead,
# each later try a short look (a daemon started again answers within a fraction of that).
RECOVER_WAIT_S = 5.0
RETRY_WAIT_S = 1.0
# Seconds before a GPU whose daemon did not come back is tried again, doubling per try.
RETRY_FIRST_S = 5.0
RETRY_MAX_S = 60.0
# A status query's wait for each daemon's answer.
STATUS_QUERY_S = 1.0


@dataclass
class GpuDown:
    """A GPU whose daemon did not answer after a fault: its workers wait, the others serve."""

    why: str
    tries: int
    retry_at: float  # the controller's monotonic clock


class GpuWatch:
    def __init__(self, config: PoolConfig, run_dir: Path, backend: Any = None) -> None:
        self.config = config
        self.backend = backend  # mps.gpus.GpuBackend, for usage and Xid events
        self.daemons: dict[int, MpsDaemon] = {}
        if config.gpus and config.mps:
            for gpu in config.gpus:
                self.daemons[gpu] = MpsDaemon(
                    gpu_index=gpu,
                    gpu_uuid=config.gpu_uuid(gpu),
                    binary=config.mps_control,
                    pipe_dir=run_dir / "mps" / f"gpu{gpu}" / "pipe",
                    log_dir=run_dir / "mps" / f"gpu{gpu}" / "log",
                )
        self._daemon_pid: dict[int, int] = {}
        self._log_offset: dict[int, int] = {}
        self.defaults: dict[int, dict[str, str]] = {}
        self.down: dict[int, GpuDown] = {}
        # When each GPU's last fault was found (monotonic): the Xids its teardown causes
        # (45, 43) come after, and are not a second fault.
        self._fault_at: dict[int, float] = {}

    # -- configuration ------------------------------------------------------------
    def check_without_mps(self, config: PoolConfig) -> list[str]:
        """For a `--no-mps` GPU pool about to run `config` (a model added while it serves):
        ConfigError where the GPUs' compute modes, read now, cannot hold its contexts (every
        model's workers per GPU), else the warnings; the rule `mpspool start` checks
        (mps/gpus.py `without_mps_warnings`). Nothing to check with MPS or on CPUs; where NVML
        cannot be read now, a warning that it was not checked."""
        if config.mps or not config.gpus or self.backend is None:
            return []
        from mpspool.mps import gpus

        try:
            visible = {g.uuid: g for g in self.backend.devices()}
        except gpus.GpuError as exc:
            return [f"the GPUs' compute modes cannot be read now ({exc}); not checked"]
        selected = [visible[uuid] for uuid in config.gpu_uuids if uuid in visible]
        try:
            warnings = gpus.without_mps_warnings(selected, config.contexts_on_gpu())
        except gpus.GpuError as exc:
            raise ConfigError(str(exc)) from None
        # The controller sees the GPUs `mpspool start` selected (it inherits their
        # CUDA_VISIBLE_DEVICES); one gone since (fallen off the bus) cannot be checked.
        missing = [uuid for uuid in config.gpu_uuids if uuid not in visible]
        return warnings + [
            f"GPU {uuid} is not visible now; its compute mode is not checked" for uuid in missing
        ]

    def programs(self, base_env: dict[str, str]) -> list[sd.Program]:
        programs = []
        for daemon in self.daemons.values():
            daemon.prepare_dirs()
            programs.append(
                sd.Program(
                    name=daemon.program,
                    group="mps",
                    command=daemon.command(),
                    priority=5,
                    environment={**base_env, **daemon.environment()},
                    # `quit` ends it with 0 at shutdown; anything else (a kill) is a fault,
                    # restarted by supervisord and handled as one by the controller (which
                    # starts again one that ended with 0 while serving, or that supervisord
                    # gave up on: `recover`).
                    autorestart="unexpected",
                    exitcodes=(0,),
                    startsecs=1,
                    startretries=10,
                )
            )
        return programs

    def worker_environment(self, slot: str) -> dict[str, str]:
        gpu = self.config.slot_gpu(slot)
        if gpu is None:
            return {}
        env = {
            "CUDA_VISIBLE_DEVICES": self.config.gpu_uuid(gpu),
            # Memory grows as needed instead of one worker taking the whole device.
            "TF_FORCE_GPU_ALLOW_GROWTH": "true",
        }
        daemon = self.daemons.get(gpu)
        if daemon is not None:
            env.update(daemon.environment())
            env[WORKER_MPS_ENV] = daemon.binary
        return env

    # -- start --------------------------------------------------------------------
    def start(self, infos: dict[str, dict[str, Any]]) -> None:
        """Wait for every daemon to answer, then apply the pool's defaults to it; then start
        each GPU's MPS server, all at once (each may take seconds)."""
        for gpu, daemon in self.daemons.items():
            self._ready(gpu, daemon, start_server=False)
            self._daemon_pid[gpu] = int(infos.get(f"mps:{daemon.program}", {}).get("pid") or 0)
        if self.daemons:
            with ThreadPoolExecutor(len(self.daemons)) as starting:
                for daemon in self.daemons.values():
                    starting.submit(self._start_server, daemon, SERVER_START_S)

    def _ready(
        self, gpu: int, daemon: MpsDaemon, timeout_s: float = 15.0, start_server: bool = True
    ) -> None:
        deadline = time.monotonic() + timeout_s
        daemon.wait_ready(timeout_s)
        self.defaults[gpu] = daemon.apply_defaults(
            self.config.active_thread_percentage, self.config.pinned_limit_mib(gpu)
        )
        log.info("%s ready: %s", daemon.program, self.defaults[gpu])
        if start_server:
            # A GPU coming back while the pool serves: within what is left of the daemon's
            # wait, which the controller's loop waits for (a review measured 13-15 s where
            # the wait is 5 s, when they were bounded apart).
            self._start_server(daemon, min(SERVER_START_S, deadline - time.monotonic()))

    def _start_server(self, daemon: MpsDaemon, timeout_s: float) -> None:
        """Its MPS server started before its workers connect: workers that connected while
        it initialised were refused, saw no GPU and failed their load (mps/server_start.py).
        Within ``timeout_s`` in all, and not tried with less than SERVER_START_MIN_S (a
        start cut short gains nothing). Not for GPUs faked for tests, which have no CUDA;
        one that cannot be started ahead is said, and the workers start anyway (they start
        it, as before)."""
        if os.environ.get(FAKE_GPUS_ENV, "").strip():
            return
        if timeout_s < SERVER_START_MIN_S:
            log.info(
                "%s: no time left to start its MPS server ahead of the workers", daemon.program
            )
            return
        deadline = time.monotonic() + timeout_s
        env = {**sd.pool_environment(os.environ), **daemon.environment()}
        why = server_start.start_server(env, timeout_s - 0.5)  # (the check below: the rest)
        if not why:
            try:
                if not daemon.servers(max(0.2, deadline - time.monotonic())):
                    # CUDA runs without MPS when it cannot reach the daemon (its man page).
                    why = "its client ran, but the daemon lists no server: it ran without MPS"
            except MpsError as exc:
                why = str(exc)
        if why:
            log.warning(
                "%s: its MPS server was not started ahead of the workers (%s); they start it",
                daemon.program, why,
            )  # fmt: skip

    # -- watching -----------------------------------------------------------------
    def faults(
        self, supervisor: Any, infos: dict[str, dict[str, Any]], now: float
    ) -> dict[int, str]:
        """GPU → why its workers must restart, for what happened since the last look
        (``now``: the controller's monotonic clock)."""
        found: dict[int, str] = {}
        for gpu, daemon in self.daemons.items():
            if gpu in self.down:
                continue  # its workers already wait for it: tried again when due
            info = infos.get(f"mps:{daemon.program}", {})
            pid = int(info.get("pid") or 0)
            # STARTING is fine: supervisord says so for startsecs after a spawn, while the
            # daemon already answers.
            alive = info.get("state") in (sd.STARTING, sd.RUNNING)
            if not alive or pid != self._daemon_pid.get(gpu):
                found[gpu] = f"its MPS control daemon exited ({info.get('statename', '?')})"
                continue
            for line in self._new_output(supervisor, gpu, daemon):
                found[gpu] = f"MPS server fault: {line.strip()}"
        if self.backend is not None:
            uuids = {self.config.gpu_uuid(g): g for g in self.config.gpus}
            for uuid, xid in self.backend.xid_events():
                # A down GPU's workers are already stopped; its next try keeps its back-off.
                if uuid not in uuids or uuids[uuid] in self.down:
                    continue
                gpu = uuids[uuid]
                ignored = self._xid_ignored(xid, now - self._fault_at.get(gpu, -math.inf))
                if ignored:
                    log.info("GPU %d: NVML Xid %d, its workers kept: %s", gpu, xid, ignored)
                else:
                    found[gpu] = f"NVML Xid {xid}"
        for gpu in found:
            self._fault_at[gpu] = now
        return found

    def _xid_ignored(self, xid: int, since_fault_s: float) -> str:
        """Why an Xid on one of the pool's GPUs does not restart its workers ("": it does).
        NVML reports nearly every Xid as critical, some of which only record or count:
        restarting every worker of the GPU for them took a pod's only GPU down for an ECC
        record. And one fault's teardown (its workers stopped, or killed after their stop
        wait) brings the Xids of ended contexts (45, 43, ...): those that come within
        XID_SETTLE_S of a restart are that fault's, not a second one. Any other, a context's
        fault included, restarts the GPU's workers: the faulted context may be a worker's (its
        MPS server's fault is not always said in its daemon's output), and a pool's GPU has
        no other tenants to be restarted for."""
        if xid in INFORMATIONAL_XIDS:
            return "it records an event, the GPU and its contexts are unharmed"
        if xid in CONTEXT_XIDS and since_fault_s < XID_SETTLE_S:
            return f"a context ended within {XID_SETTLE_S:.0f} s of the fault the GPU restarted for"
        return ""

    def _new_output(self, supervisor: Any, gpu: int, daemon: MpsDaemon) -> list[str]:
        try:
            text, offset, _ = supervisor.rpc().tailProcessStdoutLog(
                f"mps:{daemon.program}", self._log_offset.get(gpu, 0), 65536
            )
        except (OSError, xmlrpc.client.Error):
            return []
        first = gpu not in self._log_offset
        self._log_offset[gpu] = offset
        return [] if first else fault_lines(text)

    def recover(self, gpu: int, supervisor: Any, now: float) -> bool:
        """After a fault: the daemon must answer and carry the pool's defaults before that
        GPU's workers may start again. supervisord restarts one that was killed; one that
        ended with 0 (a `quit` not ours) or that supervisord gave up on (FATAL) is started
        here. False when it does not answer within RECOVER_WAIT_S: the GPU is down
        (`self.down`, the reason) until a later try (`due`) brings it back."""
        daemon = self.daemons.get(gpu)
        if daemon is None:
            return True
        name = f"mps:{daemon.program}"
        try:
            state = supervisor.process_info().get(name, {}).get("state")
            if state in (sd.EXITED, sd.FATAL, sd.STOPPED):
                with contextlib.suppress(xmlrpc.client.Fault):  # started meanwhile
                    supervisor.rpc().startProcess(name, False)
            self._ready(gpu, daemon, RETRY_WAIT_S if gpu in self.down else RECOVER_WAIT_S)
            pid = int(supervisor.process_info().get(name, {}).get("pid") or 0)
        except (MpsError, OSError, xmlrpc.client.Error) as exc:
            if isinstance(exc, DaemonHung):
                # Running but not answering (stopped, wedged): supervisord restarts a daemon
                # only once it ends, so it is ended (a kill is unexpected: restarted).
                with contextlib.suppress(OSError, xmlrpc.client.Error):
                    supervisor.rpc().signalProcess(name, "KILL")
            tries = self.down[gpu].tries + 1 if gpu in self.down else 1
            wait = min(RETRY_MAX_S, RETRY_FIRST_S * 2 ** (tries - 1))
            self.down[gpu] = GpuDown(str(exc), tries, now + wait)
            return False
        self._daemon_pid[gpu] = pid
        self._log_offset.pop(gpu, None)
        self.down.pop(gpu, None)
        return True

    def due(self, now: float) -> list[int]:
        """The GPUs that are down and due another try."""
        return [gpu for gpu, down in self.down.items() if now >= down.retry_at]

    def is_down(self, gpu: int | None) -> bool:
        return gpu in self.down

    # -- stop ---------------------------------------------------------------------
    def terminate_clients(self) -> None:
        for daemon in self.daemons.values():
            try:
                for server, client in daemon.terminate_clients():
                    log.info("%s: terminate_client %d %d", daemon.program, server, client)
            except MpsError as exc:
                log.warning("%s: %s", daemon.program, exc)

    def quit(self) -> None:
        for daemon in self.daemons.values():
            try:
                daemon.quit()
            except MpsError as exc:
                log.warning("%s: %s", daemon.program, exc)

    # -- status -------------------------------------------------------------------
    def usage_samples(self) -> list[dict[str, Any]]:
        """Each GPU's memory (used and total, bytes) and utilisation (percent), for the front
        door's metrics; a GPU whose usage cannot be read now is left out."""
        samples = []
        if self.backend is None:
            return samples
        totals = dict(zip(self.config.gpus, self.config.gpu_memory, strict=False))
        for gpu in self.config.gpus:
            uuid = self.config.gpu_uuid(gpu)
            try:
                usage = self.backend.usage(uuid)
            except Exception:  # NVML errors vary by driver; the next sample may succeed
                continue
            samples.append({
                "gpu": gpu,
                "uuid": uuid,
                "memory_used": int(usage.memory_used),
                "memory_total": int(totals.get(gpu, 0)),
                "utilization": int(usage.utilization_gpu),
            })  # fmt: skip
        return samples

    def status(self, infos: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
        out = []
        for gpu in self.config.gpus:
            entry: dict[str, Any] = {"index": gpu, "uuid": self.config.gpu_uuid(gpu)}
            daemon = self.daemons.get(gpu)
            if daemon is None:
                entry["mps"] = "off"
            else:
                entry["mps"] = infos.get(f"mps:{daemon.program}", {}).get("statename", "?")
                entry["defaults"] = self.defaults.get(gpu, {})
                down = self.down.get(gpu)
                if down is not None:
                    entry["down"] = {"why": down.why, "tries": down.tries}
                try:
                    # Short: `mpspool status` waits 5 s for the whole answer, and a daemon
                    # that hangs (stopped) would take all of it.
                    entry["servers"] = {
                        str(s): daemon.clients(s, STATUS_QUERY_S)
                        for s in daemon.servers(STATUS_QUERY_S)
                    }
                except MpsError as exc:
                    entry["servers"] = f"unavailable: {exc}"
            if self.backend is not None:
                try:
                    usage = self.backend.usage(self.config.gpu_uuid(gpu))
                    entry["memory_used"] = usage.memory_used
                    entry["utilization_gpu"] = usage.utilization_gpu
                except Exception as exc:  # NVML errors vary by driver; status must answer
                    entry["usage"] = f"unavailable: {exc}"
            out.append(entry)
        return out
