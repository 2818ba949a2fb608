"""The router process: gRPC front door, worker socket, liveness, and the control channel.

One asyncio loop runs everything: the grpc.aio server, the ZeroMQ receive loop, the
liveness sweep and the controller's control channel. Lifecycle phases are one enum with
one writer (`_set_phase`): SERVING → DRAINING → STOPPED.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import enum
import logging
import signal
import sys
from typing import Any

import grpc
import zmq
import zmq.asyncio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from mpspool import process, wire
from mpspool.config import PoolConfig
from mpspool.router.dispatch import Dispatcher
from mpspool.router.grpc_api import PREDICTION_SERVICE, ServedModel, TFServingAPI
from mpspool.router.metrics import Metrics
from mpspool.router.workers import WorkerTable

log = logging.getLogger("mpspool.router")

LIVENESS_SWEEP_S = 0.1


class Phase(enum.Enum):
    SERVING = "serving"  # accepting requests (health follows worker readiness)
    DRAINING = "draining"  # health NOT_SERVING; finishing in-flight requests
    STOPPED = "stopped"  # gRPC server stopped; waiting to be told to exit


class Router:
    def __init__(self, config: PoolConfig) -> None:
        self.config = config
        self.phase = Phase.SERVING
        self.table = WorkerTable(timeout_s=config.worker_timeout_s, policy=config.dispatch)
        self.model = ServedModel(config.model_name, config.model_version)
        self.health = health.aio.HealthServicer()
        self._zmq = zmq.asyncio.Context()
        # The worker socket is a plain one, read through its FD (see dispatch.py).
        self._zmq_sync = zmq.Context()
        self._workers = self._zmq_sync.socket(zmq.ROUTER)
        self._workers.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._workers.setsockopt(zmq.LINGER, 0)
        self._workers.bind(wire.endpoint(config.run_dir, wire.WORKERS_ENDPOINT))
        self._control = self._zmq.socket(zmq.ROUTER)
        self._control.setsockopt(zmq.LINGER, 0)
        self._control.bind(wire.endpoint(config.run_dir, wire.CONTROL_ENDPOINT))
        self.metrics = Metrics(config.model_name)
        self.dispatcher = Dispatcher(
            self._workers, self.table, self.model.learn_signatures, self.metrics.retries.inc
        )
        self.api = TFServingAPI(
            self.model, self.dispatcher, lambda: bool(self.table.ready()), self.metrics
        )
        options = [
            ("grpc.max_receive_message_length", config.max_message_bytes),
            ("grpc.max_send_message_length", config.max_message_bytes),
            ("grpc.so_reuseport", 0),
        ]
        if config.max_connection_age_s > 0:
            age_ms = int(config.max_connection_age_s * 1000)
            options += [
                ("grpc.max_connection_age_ms", age_ms),
                ("grpc.max_connection_age_grace_ms", age_ms),
            ]
        self.server = grpc.aio.server(options=options)
        self.server.add_generic_rpc_handlers(self.api.handlers())
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.port = self.server.add_insecure_port(f"{config.host}:{config.port}")
        self._serving_health: bool | None = None
        self._background: set[asyncio.Future[Any]] = set()  # health updates in flight
        self._stopped = asyncio.Event()
        self._drain_task: asyncio.Task[None] | None = None

    # -- phase and health (the only writers) --------------------------------------
    def _set_phase(self, phase: Phase) -> None:
        log.info("phase %s -> %s", self.phase.value, phase.value)
        self.phase = phase
        self._update_health()

    def _update_health(self) -> None:
        ready = len(self.table.ready())
        self.metrics.ready_workers.set(ready)
        serving = self.phase is Phase.SERVING and bool(ready)
        if serving == self._serving_health:
            return
        self._serving_health = serving
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for service in ("", PREDICTION_SERVICE):
            task = asyncio.ensure_future(self.health.set(service, status))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    # -- tasks --------------------------------------------------------------------
    async def sweep_liveness(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + LIVENESS_SWEEP_S
            await asyncio.sleep(LIVENESS_SWEEP_S)
            # Silence is only evidence if this router was listening: after a late wake-up
            # (the machine was starved of CPU) the heartbeats may be queued unread. Read
            # them first (the receive loop runs before the next sweep), judge next round.
            if loop.time() - due > LIVENESS_SWEEP_S:
                continue
            for handle in self.table.expire():
                log.warning(
                    "worker %s (pid %d) declared dead: silent > %.1f s",
                    handle.slot,
                    handle.pid,
                    self.table.timeout_s,
                )
            self._update_health()

    async def serve_control(self) -> None:
        while True:
            identity, *rest = await self._control.recv_multipart()
            request: dict[str, Any] = {}
            try:
                request = wire.unpack(rest[-1])
                reply = self._control_op(request)
            except Exception as exc:  # a bad control message must not stop the router
                reply = {"error": str(exc)}
            reply["n"] = request.get("n")  # lets the controller drop replies it gave up on
            await self._control.send_multipart([identity, *rest[:-1], wire.pack(**reply)])

    def _control_op(self, request: dict[str, Any]) -> dict[str, Any]:
        op = request.get("op")
        if op == "snapshot":
            return {
                "phase": self.phase.value,
                "port": self.port,
                "metrics_port": self.metrics.port,
                "workers": self.table.snapshot(),
                "declared_dead": self.table.declared_dead,
                "inflight": self.table.inflight_total(),
            }
        if op == "gone":
            handle = self.table.gone(request["slot"], int(request["pid"]))
            if handle is not None:
                log.info("worker %s (pid %d) exited", handle.slot, handle.pid)
            self._update_health()
            return {"ok": True}
        if op == "timeline":
            return self.dispatcher.timeline.take(clear=bool(request.get("clear")))
        if op == "drain":
            if self._drain_task is None:
                self._drain_task = asyncio.ensure_future(
                    self.drain(float(request["delay"]), float(request["grace"]))
                )
            return {"ok": True}
        return {"error": f"unknown op {op!r}"}

    async def drain(self, delay: float, grace: float) -> None:
        """Say NOT_SERVING, keep answering for `delay` (so load balancers notice), then stop
        accepting and give in-flight requests up to `grace` to finish."""
        self._set_phase(Phase.DRAINING)
        await asyncio.sleep(delay)
        await self.server.stop(grace)
        self._set_phase(Phase.STOPPED)

    async def run(self) -> None:
        # The health servicer starts out SERVING for ""; nothing is ready yet.
        self._serving_health = False
        for service in ("", PREDICTION_SERVICE):
            await self.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        if self.config.metrics_port >= 0:
            self.metrics.serve(self.config.host, self.config.metrics_port)
        await self.server.start()
        log.info("listening on %s:%d", self.config.host, self.port)
        loop = asyncio.get_running_loop()
        # Handlers only record the request; draining happens on the loop.
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stopped.set)
        self.dispatcher.start()
        tasks = [
            asyncio.ensure_future(self.sweep_liveness()),
            asyncio.ensure_future(self.serve_control()),
        ]
        await self._stopped.wait()
        if self._drain_task is None:
            self._drain_task = asyncio.ensure_future(
                self.drain(self.config.shutdown_delay_s, self.config.drain_timeout_s)
            )
        await self._drain_task
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self.dispatcher.stop()
        self._workers.close()
        self._control.close()
        self._zmq.term()
        self._zmq_sync.term()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mpspool.router")
    parser.add_argument("--run-dir", required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s router %(levelname)s %(message)s")
    process.die_with_parent()
    config = PoolConfig.load(args.run_dir)

    async def amain() -> None:
        try:
            router = Router(config)
        except RuntimeError as exc:  # grpc: the port cannot be bound
            process.fail(
                process.EXIT_CONFIG_ERROR, f"cannot listen on {config.host}:{config.port}: {exc}"
            )
        await router.run()

    asyncio.run(amain())
    return process.EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
