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

import logging
import xmlrpc.client
from pathlib import Path
from typing import Any

from mpspool.config import ConfigError, PoolConfig
from mpspool.mps.control import MpsDaemon, MpsError, fault_lines
from mpspool.supervisor import supervisord as sd

log = logging.getLogger("mpspool.controller")

# Set for MPS workers to the control binary: a worker refuses to start without its daemon.
WORKER_MPS_ENV = "MPSPOOL_REQUIRE_MPS"


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
                    # restarted by supervisord and handled as one by the controller.
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
        """Wait for every daemon to answer, then apply the pool's defaults to it."""
        for gpu, daemon in self.daemons.items():
            self._ready(gpu, daemon)
            self._daemon_pid[gpu] = int(infos.get(f"mps:{daemon.program}", {}).get("pid") or 0)

    def _ready(self, gpu: int, daemon: MpsDaemon) -> None:
        daemon.wait_ready()
        self.defaults[gpu] = daemon.apply_defaults(
            self.config.active_thread_percentage, self.config.pinned_limit_mib(gpu)
        )
        log.info("%s ready: %s", daemon.program, self.defaults[gpu])

    # -- watching -----------------------------------------------------------------
    def faults(self, supervisor: Any, infos: dict[str, dict[str, Any]]) -> dict[int, str]:
        """GPU → why its workers must restart, for what happened since the last look."""
        found: dict[int, str] = {}
        for gpu, daemon in self.daemons.items():
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
                if uuid in uuids:
                    found[uuids[uuid]] = f"NVML Xid {xid}"
        return found

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

    def recover(self, gpu: int, infos: dict[str, dict[str, Any]]) -> None:
        """After a fault: the daemon (restarted by supervisord if it died) must answer and
        carry the pool's defaults before that GPU's workers may start again."""
        daemon = self.daemons.get(gpu)
        if daemon is None:
            return
        self._ready(gpu, daemon)
        self._daemon_pid[gpu] = int(infos.get(f"mps:{daemon.program}", {}).get("pid") or 0)
        self._log_offset.pop(gpu, None)

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
                try:
                    entry["servers"] = {str(s): daemon.clients(s) for s in daemon.servers()}
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
