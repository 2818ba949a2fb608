"""router/dispatch.py: the Dispatcher over a real ZeroMQ ROUTER socket, with fake workers.

The fake workers are DEALER sockets in the test's own event loop that speak mpspool/wire.py
the way worker/serve.py does (READY + SignatureDefMap, HEARTBEAT, REPLY, ERROR, BYE), so each
test scripts exactly when a worker answers, goes quiet, leaves or disappears. The WorkerTable
runs on a fake clock (liveness is tested in test_worker_table.py); deadlines are real time.

Teardown invariants: no request is left parked in the table, no background send is left
running, every socket is closed with linger 0 and the context terminates.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import shutil
import tempfile
import time
from collections.abc import Callable, Coroutine
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq
import zmq.asyncio

from mpspool import wire
from mpspool.errors import Code, ServingError
from mpspool.protos import serving_pb2
from mpspool.router import dispatch
from mpspool.router.dispatch import Dispatcher, Reply
from mpspool.router.workers import WorkerTable

pytestmark = pytest.mark.timeout(30)

WAIT_S = 5.0  # how long a test waits for something that should happen at once


def signature_defs() -> bytes:
    sigs = serving_pb2.SignatureDefMap()
    sigs.signature_def["serving_default"].method_name = "tensorflow/serving/predict"
    return sigs.SerializeToString()


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def wait_until(predicate: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting until {what}")
        await asyncio.sleep(0.002)


class FakeWorker:
    """One worker incarnation: a DEALER with the identity ``<slot>:<pid>``."""

    def __init__(self, rig: Rig, slot: str, pid: int) -> None:
        self.rig = rig
        self.slot = slot
        self.pid = pid
        self.identity = wire.worker_identity(slot, pid)
        self.socket = rig.worker_context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.IDENTITY, self.identity)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(rig.endpoint)
        self.requests: list[dict[str, Any]] = []  # every REQUEST header received
        self._task: asyncio.Task[None] | None = None

    # -- worker → router ---------------------------------------------------------
    async def ready(self) -> None:
        header = wire.pack(wire.Kind.READY, slot=self.slot, pid=self.pid, model="demo", version=1)
        await self.socket.send_multipart([header, signature_defs()])

    async def join(self) -> FakeWorker:
        """READY, then wait until the router routes to this worker."""
        await self.ready()
        await wait_until(lambda: self.registered, f"{self.slot} is registered")
        return self

    @property
    def registered(self) -> bool:
        return any(h.identity == self.identity for h in self.rig.table.ready())

    async def heartbeat(self) -> None:
        header = wire.pack(wire.Kind.HEARTBEAT, slot=self.slot, pid=self.pid, served=0)
        await self.socket.send(header)

    async def bye(self) -> None:
        await self.socket.send(wire.pack(wire.Kind.BYE, slot=self.slot, pid=self.pid))

    async def answer(self, request: dict[str, Any], frames: list[zmq.Frame]) -> None:
        """Reply y = 2x, as a real worker would for the demo signature."""
        x = wire.decode_tensors(request["tensors"], frames)["x"]
        metas, out = wire.encode_tensors({"y": x * 2})
        head = wire.pack(wire.Kind.REPLY, id=request["id"], tensors=metas, t=[10, 20])
        await self.socket.send_multipart([head, *out], copy=False)

    async def fail(self, request_id: int, **fields: Any) -> None:
        await self.socket.send(wire.pack(wire.Kind.ERROR, id=request_id, **fields))

    # -- router → worker ---------------------------------------------------------
    async def receive(self) -> tuple[dict[str, Any], list[zmq.Frame]]:
        frames = await asyncio.wait_for(self.socket.recv_multipart(copy=False), WAIT_S)
        return wire.unpack(frames[0].buffer), frames[1:]

    async def next_request(self) -> tuple[dict[str, Any], list[zmq.Frame]]:
        header, frames = await self.receive()
        assert wire.kind_of(header) is wire.Kind.REQUEST, header
        self.requests.append(header)
        return header, frames

    def serve(self) -> FakeWorker:
        """Answer every request from now on, in the background."""

        async def loop() -> None:
            while True:
                frames = await self.socket.recv_multipart(copy=False)
                header = wire.unpack(frames[0].buffer)
                if wire.kind_of(header) is wire.Kind.REQUEST:
                    self.requests.append(header)
                    await self.answer(header, frames[1:])

        self._task = asyncio.ensure_future(loop())
        return self

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if not self.socket.closed:
            self.socket.close(linger=0)


class Rig:
    """The router's half: a ROUTER socket (as router/server.py sets it up), a table and a
    Dispatcher whose receive loop runs for the duration of the test."""

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="mpsd-", dir="/tmp")  # short: ipc paths ≤ 107 bytes
        self.endpoint = wire.endpoint(self.dir, wire.WORKERS_ENDPOINT)
        self.context = zmq.Context()  # the router's worker socket is a plain one
        self.worker_context = zmq.asyncio.Context()  # the fake workers are asyncio
        self.router = self.context.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind(self.endpoint)
        self.clock = FakeClock()
        self.table = WorkerTable(timeout_s=3.0, clock=self.clock)
        self.learned: list[tuple[str, int, bytes]] = []
        self.dispatcher = Dispatcher(
            self.router, self.table, lambda m, v, sigs: self.learned.append((m, v, sigs))
        )
        self.workers: list[FakeWorker] = []
        self._receiver: asyncio.Task[None] | None = None

    def worker(self, slot: str, pid: int) -> FakeWorker:
        worker = FakeWorker(self, slot, pid)
        self.workers.append(worker)
        return worker

    async def call(self, x: list[float], deadline: float | None = None) -> Reply:
        metas, frames = wire.encode_tensors({"x": np.asarray(x, dtype=np.float32)})
        return await self.dispatcher.call("serving_default", metas, frames, ["y"], deadline)

    async def __aenter__(self) -> Rig:
        self.dispatcher.start()
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        try:
            if exc_info[0] is None:
                assert self.table.inflight_total() == 0, "a request was left parked"
        finally:
            for worker in self.workers:
                await worker.close()
            self.dispatcher.stop()
            self.router.close(linger=0)
            self.context.term()
            self.worker_context.term()
            shutil.rmtree(self.dir, ignore_errors=True)


def run(body: Callable[[Rig], Coroutine[Any, Any, None]]) -> None:
    async def main() -> None:
        async with Rig() as rig:
            await body(rig)

    asyncio.run(main())


def y_of(reply: Reply) -> list[float]:
    return wire.decode_tensors(reply.tensors, reply.frames)["y"].tolist()


# ---------------------------------------------------------------------------------------
# the normal path
# ---------------------------------------------------------------------------------------


def test_a_request_is_answered():
    async def body(rig: Rig) -> None:
        worker = await rig.worker("cpu-0", 101).join()
        assert rig.learned == [("demo", 1, signature_defs())]
        worker.serve()
        reply = await rig.call([1.0, 2.5])
        assert y_of(reply) == [2.0, 5.0]
        assert reply.slot == "cpu-0"
        assert reply.timing == [10, 20]
        [request] = worker.requests
        assert request["sig"] == "serving_default"
        assert request["outputs"] == ["y"]
        assert request["tensors"] == [["x", 1, [2]]]  # DT_FLOAT, shape [2]
        assert rig.table.ready()[0].answered == 1

    run(body)


def test_requests_alternate_over_two_workers():
    async def body(rig: Rig) -> None:
        a = (await rig.worker("cpu-0", 101).join()).serve()
        b = (await rig.worker("cpu-1", 102).join()).serve()
        slots = [(await rig.call([float(i)])).slot for i in range(6)]
        assert all(slots[i] != slots[i + 1] for i in range(5)), slots
        assert len(a.requests) == len(b.requests) == 3

    run(body)


def test_concurrent_requests_are_matched_to_their_replies():
    async def body(rig: Rig) -> None:
        (await rig.worker("cpu-0", 101).join()).serve()
        (await rig.worker("cpu-1", 102).join()).serve()
        replies = await asyncio.gather(*(rig.call([float(i)]) for i in range(20)))
        assert [y_of(r) for r in replies] == [[2.0 * i] for i in range(20)]

    run(body)


def test_a_request_waits_for_a_worker_that_is_starting(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(dispatch, "NO_WORKER_WAIT_S", 5.0)

    async def body(rig: Rig) -> None:
        call = asyncio.ensure_future(rig.call([3.0]))
        await asyncio.sleep(0.05)
        assert not call.done()
        (await rig.worker("cpu-0", 101).join()).serve()
        reply = await asyncio.wait_for(call, WAIT_S)
        assert y_of(reply) == [6.0]

    run(body)


# ---------------------------------------------------------------------------------------
# workers leaving with a request in flight: retried elsewhere
# ---------------------------------------------------------------------------------------


async def hold_request_on_a(rig: Rig) -> tuple[FakeWorker, asyncio.Future[Reply], dict]:
    """Start a call while only cpu-0 is registered, so it surely goes there; then bring up
    cpu-1 (serving) as the place to retry."""
    a = await rig.worker("cpu-0", 101).join()
    call = asyncio.ensure_future(rig.call([4.0]))
    request, _ = await a.next_request()
    (await rig.worker("cpu-1", 102).join()).serve()
    assert not call.done()
    return a, call, request


def test_a_worker_saying_bye_has_its_request_retried_elsewhere():
    async def body(rig: Rig) -> None:
        a, call, _ = await hold_request_on_a(rig)
        await a.bye()
        reply = await asyncio.wait_for(call, WAIT_S)
        assert reply.slot == "cpu-1"
        assert y_of(reply) == [8.0]
        assert not a.registered

    run(body)


def test_a_worker_reported_gone_has_its_request_retried_and_its_late_reply_dropped():
    async def body(rig: Rig) -> None:
        a, call, request = await hold_request_on_a(rig)
        assert rig.table.gone("cpu-0", 101) is not None  # the controller saw it exit
        reply = await asyncio.wait_for(call, WAIT_S)
        assert reply.slot == "cpu-1"
        assert y_of(reply) == [8.0]
        # The first worker was only presumed gone and answers after all: dropped.
        await a.answer(request, wire.encode_tensors({"x": np.float32([4.0])})[1])
        b = rig.workers[1]
        assert y_of(await rig.call([1.0])) == [2.0]
        assert len(b.requests) == 2

    run(body)


def test_a_worker_whose_connection_is_gone_is_dropped_at_send():
    async def body(rig: Rig) -> None:
        a = await rig.worker("cpu-0", 101).join()
        b = (await rig.worker("cpu-1", 102).join()).serve()
        await a.close()  # killed: its connection closes, no BYE

        async def router_knows() -> None:
            # Until the ROUTER has processed the disconnect a send would be queued to the
            # dead pipe and lost; the dispatcher relies on EHOSTUNREACH, so wait for it.
            while True:
                try:
                    rig.router.send_multipart([a.identity, b"probe"], zmq.NOBLOCK)
                except zmq.ZMQError as exc:
                    assert exc.errno == errno.EHOSTUNREACH
                    return
                await asyncio.sleep(0.005)

        await asyncio.wait_for(router_knows(), WAIT_S)
        assert a.registered, "nothing told the table yet: the send must find out"
        # Round-robin over two workers: one of the first two picks is the dead one.
        replies = [await rig.call([float(i)], time.monotonic() + WAIT_S) for i in range(4)]
        assert [r.slot for r in replies] == ["cpu-1"] * 4
        assert [y_of(r) for r in replies] == [[0.0], [2.0], [4.0], [6.0]]
        assert not a.registered
        assert [w.slot for w in rig.table.ready()] == ["cpu-1"]
        assert len(b.requests) == 4

    run(body)


# ---------------------------------------------------------------------------------------
# failures a client sees
# ---------------------------------------------------------------------------------------


def test_a_deadline_passing_fails_the_request_with_deadline_exceeded():
    async def body(rig: Rig) -> None:
        worker = await rig.worker("cpu-0", 101).join()
        start = time.monotonic()
        call = asyncio.ensure_future(rig.call([1.0], deadline=start + 0.3))
        request, frames = await worker.next_request()  # and never answers in time
        with pytest.raises(ServingError) as caught:
            await asyncio.wait_for(call, WAIT_S)
        assert caught.value.code is Code.DEADLINE_EXCEEDED
        assert 0.25 <= time.monotonic() - start < 3.0
        assert rig.table.inflight_total() == 0, "the timed-out request must not stay parked"
        # Its late answer is dropped, and the worker goes on serving.
        await worker.answer(request, frames)
        worker.serve()
        assert y_of(await rig.call([5.0], time.monotonic() + WAIT_S)) == [10.0]

    run(body)


def test_no_worker_at_all_is_unavailable_after_the_wait(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(dispatch, "NO_WORKER_WAIT_S", 0.2)

    async def body(rig: Rig) -> None:
        start = time.monotonic()
        with pytest.raises(ServingError) as caught:
            await rig.call([1.0])
        elapsed = time.monotonic() - start
        assert caught.value.code is Code.UNAVAILABLE
        assert "no worker" in caught.value.message
        assert 0.15 <= elapsed < 2.0

        # A deadline shorter than the wait: the deadline is what the client hears about.
        monkeypatch.setattr(dispatch, "NO_WORKER_WAIT_S", 5.0)
        start = time.monotonic()
        with pytest.raises(ServingError) as caught:
            await rig.call([1.0], deadline=start + 0.05)
        assert caught.value.code is Code.DEADLINE_EXCEEDED
        assert time.monotonic() - start < 2.5, "it waited for a worker past the deadline"

    run(body)


def test_an_error_reply_surfaces_with_the_workers_code_and_is_not_retried():
    async def body(rig: Rig) -> None:
        worker = await rig.worker("cpu-0", 101).join()
        call = asyncio.ensure_future(rig.call([1.0]))
        request, _ = await worker.next_request()
        message = "input size does not match signature: 2!=1"
        await worker.fail(request["id"], code=int(Code.INVALID_ARGUMENT), message=message)
        with pytest.raises(ServingError) as caught:
            await asyncio.wait_for(call, WAIT_S)
        assert caught.value.code is Code.INVALID_ARGUMENT
        assert caught.value.message == message

        call = asyncio.ensure_future(rig.call([1.0]))
        request, _ = await worker.next_request()
        await worker.fail(request["id"])  # no code: INTERNAL
        with pytest.raises(ServingError) as caught:
            await asyncio.wait_for(call, WAIT_S)
        assert caught.value.code is Code.INTERNAL
        assert len(worker.requests) == 2, "an error is an answer: no retry"
        assert worker.registered

    run(body)


# ---------------------------------------------------------------------------------------
# registration
# ---------------------------------------------------------------------------------------


def test_a_heartbeat_from_an_unknown_worker_asks_it_to_register_again():
    async def body(rig: Rig) -> None:
        worker = rig.worker("cpu-0", 101)
        await worker.heartbeat()  # e.g. the router restarted under a running worker
        header, frames = await worker.receive()
        assert wire.kind_of(header) is wire.Kind.REREGISTER
        assert frames == []
        assert not worker.registered
        await worker.join()

        # A known worker's heartbeat refreshes its liveness instead.
        rig.clock.now += 2.0
        await worker.heartbeat()
        [handle] = rig.table.ready()
        await wait_until(lambda: handle.last_seen == rig.clock.now, "the heartbeat is seen")

    run(body)


def test_ready_from_a_declared_dead_incarnation_is_ignored():
    async def body(rig: Rig) -> None:
        dead = await rig.worker("cpu-0", 101).join()
        rig.clock.now += 10.0
        assert [h.pid for h in rig.table.expire()] == [101]
        assert rig.table.declared_dead == {"cpu-0": 101}

        await dead.ready()  # it woke up: too late, it is being replaced
        # Messages on one connection arrive in order: once the heartbeat is answered
        # with REREGISTER, the READY before it was handled (and refused).
        await dead.heartbeat()
        header, _ = await dead.receive()
        assert wire.kind_of(header) is wire.Kind.REREGISTER
        assert not dead.registered
        assert rig.table.declared_dead == {"cpu-0": 101}
        assert len(rig.learned) == 1

        # Its replacement registers normally and clears the verdict.
        await rig.worker("cpu-0", 202).join()
        assert rig.table.declared_dead == {}
        assert [h.pid for h in rig.table.ready()] == [202]

    run(body)


def test_bad_messages_do_not_stop_the_receive_loop():
    async def body(rig: Rig) -> None:
        worker = rig.worker("cpu-0", 101)
        await worker.socket.send(b"\xc1 not msgpack")
        await worker.socket.send(msgpack_header(v=99, k="ready"))
        await worker.socket.send(msgpack_header(v=wire.PROTOCOL_VERSION, k="nonsense"))
        # READY without its SignatureDefMap frame.
        await worker.socket.send(
            wire.pack(wire.Kind.READY, slot="cpu-0", pid=101, model="demo", version=1)
        )
        await worker.join()
        worker.serve()
        assert y_of(await rig.call([1.0])) == [2.0]

    run(body)


def msgpack_header(**fields: Any) -> bytes:
    return msgpack.packb(fields)
