"""Sending requests to workers over ZeroMQ and matching their replies.

Owns the ROUTER socket the workers connect to. `call()` picks a worker, sends the
request's tensors as frames without copying them, and awaits the reply; if the worker
leaves first (WorkerLost) the request goes to another worker while the client's deadline
allows. `receive_forever()` handles everything workers send.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import zmq
import zmq.asyncio

from mpspool import wire
from mpspool.errors import Code, ServingError
from mpspool.router.workers import WorkerLost, WorkerTable

log = logging.getLogger("mpspool.router")

# How long a request waits for some worker to become routable when none is (a restart in
# progress) before it fails with UNAVAILABLE, if the client's deadline is longer.
NO_WORKER_WAIT_S = 5.0


class Reply:
    __slots__ = ("frames", "slot", "tensors", "timing")

    def __init__(self, tensors: list[Any], frames: list[zmq.Frame], slot: str, timing: Any) -> None:
        self.tensors = tensors
        self.frames = frames
        self.slot = slot
        self.timing = timing


class Dispatcher:
    def __init__(
        self,
        socket: zmq.asyncio.Socket,
        table: WorkerTable,
        on_ready: Callable[[str, int, bytes], None],
    ) -> None:
        self._socket = socket
        self._table = table
        self._on_ready = on_ready  # (model, version, serialized SignatureDefMap)
        self._ids = itertools.count(1)
        self._background: set[asyncio.Future[Any]] = set()  # sends nobody awaits

    async def call(
        self,
        signature: str,
        metas: list[Any],
        frames: Sequence[Any],
        outputs: list[str],
        deadline: float | None,
    ) -> Reply:
        """Run one request on some worker; `deadline` is a time.monotonic() value or None."""
        while True:
            handle = self._table.pick()
            if handle is None:
                await self._wait_for_worker(deadline)
                continue
            request_id = next(self._ids)
            future: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
            handle.inflight[request_id] = future
            header = wire.pack(
                wire.Kind.REQUEST, id=request_id, sig=signature, tensors=metas, outputs=outputs
            )
            try:
                await self._socket.send_multipart([handle.identity, header, *frames], copy=False)
            except zmq.ZMQError as exc:
                # ROUTER_MANDATORY: the worker's connection is gone (killed); do not wait
                # for the liveness window to notice.
                if exc.errno != zmq.EHOSTUNREACH:
                    raise
                self._table.leave(handle.identity, "its connection is gone")
                continue
            try:
                if deadline is None:
                    return await future
                return await asyncio.wait_for(future, max(0.0, deadline - time.monotonic()))
            except WorkerLost as lost:
                log.info("retrying request %d elsewhere: %s", request_id, lost)
                continue
            except asyncio.TimeoutError:  # not TimeoutError: they differ before Python 3.11
                handle.inflight.pop(request_id, None)
                raise ServingError(Code.DEADLINE_EXCEEDED, "Deadline Exceeded") from None

    async def _wait_for_worker(self, deadline: float | None) -> None:
        limit = (
            NO_WORKER_WAIT_S
            if deadline is None
            else min(NO_WORKER_WAIT_S, deadline - time.monotonic())
        )
        if deadline is not None and deadline <= time.monotonic():
            raise ServingError(Code.DEADLINE_EXCEEDED, "Deadline Exceeded")
        if limit <= 0:
            raise ServingError(Code.UNAVAILABLE, "no worker is ready to serve the request")
        self._table.changed.clear()
        try:
            await asyncio.wait_for(self._table.changed.wait(), limit)
        except asyncio.TimeoutError:
            if deadline is not None and time.monotonic() >= deadline:
                raise ServingError(Code.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
            raise ServingError(
                Code.UNAVAILABLE, "no worker is ready to serve the request"
            ) from None

    async def receive_forever(self) -> None:
        while True:
            frames = await self._socket.recv_multipart(copy=False)
            try:
                self._receive(frames)
            except Exception:  # one bad message must not stop the router
                log.exception("dropping a message from %r", frames[0].bytes if frames else b"")

    def _receive(self, frames: list[zmq.Frame]) -> None:
        identity = frames[0].bytes
        try:
            header = wire.unpack(frames[1].buffer)
            kind = wire.kind_of(header)
        except (wire.ProtocolError, IndexError) as exc:
            log.warning("undecodable message from %r: %s", identity, exc)
            return
        if kind is wire.Kind.REPLY:
            handle = self._table.seen(identity)
            reply = Reply(
                header["tensors"], frames[2:], handle.slot if handle else "", header.get("t")
            )
            self._table.resolve(identity, header["id"], reply, None)
        elif kind is wire.Kind.ERROR:
            self._table.seen(identity)
            error = ServingError(header.get("code", Code.INTERNAL), header.get("message", ""))
            self._table.resolve(identity, header["id"], None, error)
        elif kind is wire.Kind.HEARTBEAT:
            if self._table.seen(identity) is None:
                # A worker we do not know (this router restarted, or it was declared dead
                # and woke up): ask it to introduce itself again.
                task = asyncio.ensure_future(
                    self._socket.send_multipart([identity, wire.pack(wire.Kind.REREGISTER)])
                )
                self._background.add(task)
                task.add_done_callback(self._background.discard)
        elif kind is wire.Kind.READY:
            if self._table.declared_dead.get(header["slot"]) == header["pid"]:
                return  # declared dead and about to be replaced: it does not come back
            self._on_ready(header["model"], int(header["version"]), frames[2].bytes)
            handle = self._table.register(
                identity,
                header["slot"],
                int(header["pid"]),
                header["model"],
                int(header["version"]),
            )
            handle.weights = header.get("weights")
            log.info("worker %s (pid %s) ready", header["slot"], header["pid"])
        elif kind is wire.Kind.BYE:
            self._table.leave(identity, "said bye")
        else:
            log.warning("unexpected %s message from %r", kind.value, identity)
