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

from mpspool import wire
from mpspool.errors import Code, ServingError
from mpspool.router.timeline import Timeline
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
        socket: zmq.Socket,
        table: WorkerTable,
        on_ready: Callable[[str, int, bytes], None],
        on_retry: Callable[[], None] = lambda: None,
        timeline: Timeline | None = None,
    ) -> None:
        self._on_retry = on_retry
        self.timeline = timeline if timeline is not None else Timeline()
        self._socket = socket
        self._table = table
        self._on_ready = on_ready  # (model, version, serialized SignatureDefMap)
        self._ids = itertools.count(1)
        self._drain_scheduled = False
        self._loop: asyncio.AbstractEventLoop = None  # type: ignore[assignment]  # start()

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
            loop = self._loop
            future: asyncio.Future[Reply] = loop.create_future()
            handle.inflight[request_id] = future
            header = wire.pack(
                wire.Kind.REQUEST, id=request_id, sig=signature, tensors=metas, outputs=outputs
            )
            try:
                self._send([handle.identity, header, *frames])
            except zmq.ZMQError as exc:
                handle.inflight.pop(request_id, None)
                if exc.errno == zmq.EHOSTUNREACH:
                    # ROUTER_MANDATORY: the worker's connection is gone (killed); do not
                    # wait for the liveness window to notice.
                    self._table.leave(handle.identity, "its connection is gone")
                    continue
                if exc.errno == zmq.EAGAIN:
                    raise ServingError(
                        Code.RESOURCE_EXHAUSTED,
                        f"worker {handle.slot} has too many requests queued",
                    ) from None
                raise
            # A timer, not asyncio.wait_for: that wraps every request in a task of its own.
            timer = None
            if deadline is not None:
                timer = loop.call_at(loop.time() + deadline - time.monotonic(), _expire, future)
            try:
                return await future
            except WorkerLost as lost:
                log.info("retrying request %d elsewhere: %s", request_id, lost)
                self._on_retry()
                continue
            except _DeadlinePassed:
                handle.inflight.pop(request_id, None)
                raise ServingError(Code.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
            finally:
                if timer is not None:
                    timer.cancel()

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

    # -- the socket ----------------------------------------------------------------
    # A plain (not zmq.asyncio) socket, read from the event loop through its FD: pyzmq's
    # asyncio layer costs a future, callbacks and bookkeeping per message, a large share of
    # the router's CPU per request. The FD is edge-triggered: after it fires, and after any
    # send (which can swallow a pending edge), everything queued must be read.
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._socket.getsockopt(zmq.FD), self._drain)
        self._loop.call_soon(self._drain)

    def stop(self) -> None:
        self._loop.remove_reader(self._socket.getsockopt(zmq.FD))

    def _send(self, frames: list[Any]) -> None:
        self._socket.send_multipart(frames, zmq.NOBLOCK, copy=False)
        if not self._drain_scheduled:
            self._drain_scheduled = True
            self._loop.call_soon(self._drain)

    def _drain(self) -> None:
        self._drain_scheduled = False
        socket = self._socket
        while socket.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            try:
                frames = socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
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
            slot = handle.slot if handle else ""
            timing = header.get("t")
            self.timeline.record(slot, timing)
            self._table.resolve(
                identity, header["id"], Reply(header["tensors"], frames[2:], slot, timing), None
            )
        elif kind is wire.Kind.ERROR:
            self._table.seen(identity)
            error = ServingError(header.get("code", Code.INTERNAL), header.get("message", ""))
            self._table.resolve(identity, header["id"], None, error)
        elif kind is wire.Kind.HEARTBEAT:
            if self._table.seen(identity) is None:
                # A worker we do not know (this router restarted, or it was declared dead
                # and woke up): ask it to introduce itself again.
                self._send([identity, wire.pack(wire.Kind.REREGISTER)])
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


class _DeadlinePassed(Exception):
    pass


def _expire(future: asyncio.Future[Any]) -> None:
    if not future.done():
        future.set_exception(_DeadlinePassed())
