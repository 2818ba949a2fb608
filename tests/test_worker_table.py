"""router/workers.py: the WorkerTable's membership, liveness and routing rules, on a fake clock.

No sockets: the table is pure bookkeeping. Futures need a running loop, so each test runs
its body with asyncio.run; the teardown invariant of every test is that no future a test
created is left pending (a request nobody will ever complete).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from mpspool.router.workers import WorkerLost, WorkerTable

TIMEOUT_S = 3.0


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def ident(slot: str, pid: int) -> bytes:
    return f"{slot}:{pid}".encode()


class Harness:
    """A table on a fake clock, plus every future handed out, checked at teardown."""

    def __init__(self, policy: str = "round-robin") -> None:
        self.clock = FakeClock()
        self.table = WorkerTable(TIMEOUT_S, clock=self.clock, policy=policy)
        self.futures: list[asyncio.Future[Any]] = []

    def join(self, slot: str, pid: int) -> bytes:
        identity = ident(slot, pid)
        self.table.register(identity, slot, pid, "demo", 1)
        return identity

    def send(self, identity: bytes, request_id: int) -> asyncio.Future[Any]:
        """What Dispatcher.call does before sending: park a future on the handle."""
        handle = self.table.seen(identity)
        assert handle is not None, f"{identity!r} is not registered"
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        handle.inflight[request_id] = future
        self.futures.append(future)
        return future

    def check_nothing_pending(self) -> None:
        pending = [f for f in self.futures if not f.done()]
        assert not pending, f"{len(pending)} request(s) left waiting forever"
        for future in self.futures:  # retrieve exceptions: no "never retrieved" noise
            if not future.cancelled():
                future.exception()


def run(body: Callable[[Harness], Coroutine[Any, Any, None]], policy: str = "round-robin") -> None:
    async def main() -> None:
        harness = Harness(policy)
        await body(harness)
        # Leave the table empty: every request still parked must fail, none stay pending.
        for handle in harness.table.ready():
            harness.table.leave(handle.identity, "test over")
        assert harness.table.inflight_total() == 0
        harness.check_nothing_pending()

    asyncio.run(main())


def lost_message(future: asyncio.Future[Any]) -> str:
    assert future.done()
    error = future.exception()
    assert isinstance(error, WorkerLost), f"expected WorkerLost, got {error!r}"
    return str(error)


# ---------------------------------------------------------------------------------------
# membership
# ---------------------------------------------------------------------------------------


def test_register_makes_a_worker_routable():
    async def body(h: Harness) -> None:
        assert h.table.ready() == []
        assert h.table.pick() is None
        h.table.changed.clear()
        identity = h.join("cpu-0", 101)
        assert h.table.changed.is_set()
        [handle] = h.table.ready()
        assert (handle.slot, handle.pid, handle.identity) == ("cpu-0", 101, identity)
        assert (handle.model, handle.version) == ("demo", 1)
        assert handle.last_seen == h.clock.now
        assert h.table.pick() is handle

    run(body)


def test_seen_refreshes_liveness_and_ignores_strangers():
    async def body(h: Harness) -> None:
        identity = h.join("cpu-0", 101)
        h.clock.advance(2.0)
        handle = h.table.seen(identity)
        assert handle is not None and handle.last_seen == h.clock.now
        assert h.table.seen(ident("cpu-0", 999)) is None
        assert h.table.seen(b"nobody") is None

    run(body)


def test_registering_again_with_the_same_identity_keeps_the_handle_and_its_requests():
    # A worker answering REREGISTER sends READY again from the same incarnation.
    async def body(h: Harness) -> None:
        identity = h.join("cpu-0", 101)
        [first] = h.table.ready()
        future = h.send(identity, 1)
        h.clock.advance(1.0)
        again = h.table.register(identity, "cpu-0", 101, "demo", 1)
        assert again is first
        assert again.last_seen == h.clock.now
        assert not future.done()
        assert h.table.resolve(identity, 1, "answer", None)
        assert future.result() == "answer"

    run(body)


def test_leave_fails_inflight_requests_with_worker_lost():
    async def body(h: Harness) -> None:
        a = h.join("cpu-0", 101)
        b = h.join("cpu-1", 102)
        on_a = [h.send(a, 1), h.send(a, 2)]
        on_b = h.send(b, 3)
        h.table.changed.clear()
        left = h.table.leave(a, "said bye")
        assert left is not None and left.slot == "cpu-0"
        assert left.inflight == {}
        assert h.table.changed.is_set()
        for future in on_a:
            message = lost_message(future)
            assert "cpu-0" in message and "101" in message and "said bye" in message
        assert not on_b.done(), "a worker leaving must not touch another worker's requests"
        assert [w.slot for w in h.table.ready()] == ["cpu-1"]
        assert h.table.leave(a, "again") is None  # already gone: nothing to do
        assert h.table.inflight_total() == 1

    run(body)


def test_gone_drops_only_the_named_incarnation():
    async def body(h: Harness) -> None:
        a = h.join("cpu-0", 101)
        future = h.send(a, 1)
        # The controller reports an older pid of the slot (already replaced): ignored.
        assert h.table.gone("cpu-0", 100) is None
        assert h.table.gone("cpu-9", 101) is None
        assert not future.done()
        handle = h.table.gone("cpu-0", 101)
        assert handle is not None and handle.pid == 101
        assert "exited" in lost_message(future)
        assert h.table.ready() == []
        assert "cpu-0" not in h.table.declared_dead  # an exit is not a liveness verdict

    run(body)


def test_a_new_incarnation_replaces_the_old_one_and_fails_its_requests():
    async def body(h: Harness) -> None:
        old = h.join("cpu-0", 101)
        future = h.send(old, 1)
        new = h.join("cpu-0", 202)
        assert "re-registered by pid 202" in lost_message(future)
        [handle] = h.table.ready()
        assert (handle.pid, handle.identity) == (202, new)
        assert h.table.seen(old) is None, "the old incarnation must be forgotten"
        # A late reply from the old process is dropped, not delivered to anyone.
        assert h.table.resolve(old, 1, "late", None) is False
        # And a late "gone" for the old pid does not remove the new incarnation.
        assert h.table.gone("cpu-0", 101) is None
        assert [w.pid for w in h.table.ready()] == [202]

    run(body)


# ---------------------------------------------------------------------------------------
# liveness
# ---------------------------------------------------------------------------------------


def test_expire_declares_silent_workers_dead_and_fails_their_requests():
    async def body(h: Harness) -> None:
        quiet = h.join("cpu-0", 101)
        chatty = h.join("cpu-1", 102)
        lost = h.send(quiet, 1)
        kept = h.send(chatty, 2)

        h.clock.advance(TIMEOUT_S)  # exactly the window: still alive
        h.table.seen(chatty)
        assert h.table.expire() == []

        h.clock.advance(0.5)
        h.table.seen(chatty)
        expired = h.table.expire()
        assert [(w.slot, w.pid) for w in expired] == [("cpu-0", 101)]
        assert h.table.declared_dead == {"cpu-0": 101}
        assert "silent for 3.5 s" in lost_message(lost)
        assert not kept.done()
        assert [w.slot for w in h.table.ready()] == ["cpu-1"]
        assert h.table.expire() == []  # declared once, not again
        assert h.table.declared_dead == {"cpu-0": 101}
        assert h.table.resolve(chatty, 2, "ok", None)

    run(body)


def test_declared_dead_is_kept_until_the_slot_registers_a_new_pid():
    async def body(h: Harness) -> None:
        h.join("cpu-0", 101)
        h.clock.advance(TIMEOUT_S + 1)
        h.table.expire()
        assert h.table.declared_dead == {"cpu-0": 101}
        # The dead incarnation registering again (the dispatcher refuses this, but the
        # table must not forget the verdict either way).
        h.table.register(ident("cpu-0", 101), "cpu-0", 101, "demo", 1)
        assert h.table.declared_dead == {"cpu-0": 101}
        h.table.leave(ident("cpu-0", 101), "test")
        # Its replacement clears the verdict.
        h.join("cpu-0", 202)
        assert h.table.declared_dead == {}

    run(body)


# ---------------------------------------------------------------------------------------
# routing
# ---------------------------------------------------------------------------------------


def test_round_robin_alternates_over_slots_in_order():
    async def body(h: Harness) -> None:
        # Registered out of order, pids in yet another order: the rotation follows slot
        # order, not arrival or pid order.
        h.join("cpu-2", 101)
        h.join("cpu-0", 303)
        h.join("cpu-1", 202)
        picks = [h.table.pick().slot for _ in range(7)]
        start = picks.index("cpu-0")
        expected = ["cpu-0", "cpu-1", "cpu-2"]
        assert picks[start : start + 3] == expected
        assert all(picks[i] != picks[i + 1] for i in range(len(picks) - 1))
        assert sorted(picks[:6]) == sorted(expected * 2)

        h.table.leave(ident("cpu-1", 202), "bye")
        picks = [h.table.pick().slot for _ in range(4)]
        assert sorted(picks) == ["cpu-0", "cpu-0", "cpu-2", "cpu-2"]
        assert all(picks[i] != picks[i + 1] for i in range(3))

    run(body)


def test_least_loaded_picks_the_fewest_in_flight_first_slot_among_equals():
    async def body(h: Harness) -> None:
        c2, c0, c1 = h.join("cpu-2", 101), h.join("cpu-0", 303), h.join("cpu-1", 202)
        # All idle: the first in slot order, every time (it stays warm).
        assert [h.table.pick().slot for _ in range(3)] == ["cpu-0"] * 3
        long_request = h.send(c0, 1)
        assert h.table.pick().slot == "cpu-1"
        h.send(c1, 2)
        h.send(c1, 3)
        assert h.table.pick().slot == "cpu-2"  # cpu-0 has 1, cpu-1 has 2
        h.send(c2, 4)
        assert h.table.pick().slot == "cpu-0"  # 1, 2, 1: first among equals
        h.table.resolve(c1, 2, "done", None)
        h.table.resolve(c1, 3, "done", None)
        assert h.table.pick().slot == "cpu-1"  # idle again
        h.table.resolve(c0, 1, "done", None)
        h.table.resolve(c2, 4, "done", None)
        assert long_request.done()

    run(body, "least-loaded")


def test_an_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="least-loaded"):
        WorkerTable(TIMEOUT_S, policy="random")


def test_resolve_completes_once_and_refuses_unknown_or_late_replies():
    async def body(h: Harness) -> None:
        a = h.join("cpu-0", 101)
        ok = h.send(a, 1)
        failed = h.send(a, 2)
        assert h.table.resolve(a, 1, "result", None) is True
        assert ok.result() == "result"
        assert h.table.resolve(a, 1, "duplicate", None) is False
        assert h.table.resolve(a, 77, "never asked", None) is False
        assert h.table.resolve(b"stranger", 2, "x", None) is False
        error = ValueError("worker said no")
        assert h.table.resolve(a, 2, None, error) is True
        assert failed.exception() is error
        [handle] = h.table.ready()
        assert handle.answered == 2  # the error counts as an answer
        assert handle.inflight == {}

        # The caller gave up (deadline): its future is cancelled, the reply comes late.
        late = h.send(a, 3)
        late.cancel()
        assert h.table.resolve(a, 3, "too late", None) is False
        assert handle.answered == 2
        assert h.table.inflight_total() == 0

    run(body)


def test_snapshot_reports_each_slot():
    async def body(h: Harness) -> None:
        a = h.join("cpu-0", 101)
        h.send(a, 1)
        h.send(a, 2)
        h.clock.advance(0.25)
        b = h.join("cpu-1", 102)
        h.send(b, 3)
        assert h.table.resolve(b, 3, "ok", None)
        h.clock.advance(1.5)
        h.table.seen(b)
        assert h.table.inflight_total() == 2
        assert h.table.snapshot() == {
            "cpu-0": {"pid": 101, "inflight": 2, "answered": 0, "silent_s": 1.75, "weights": None},
            "cpu-1": {"pid": 102, "inflight": 0, "answered": 1, "silent_s": 0.0, "weights": None},
        }
        h.join("cpu-0", 201)  # replaced: the snapshot shows the new incarnation only
        assert h.table.snapshot()["cpu-0"] == {
            "pid": 201,
            "inflight": 0,
            "answered": 0,
            "silent_s": 0.0,
            "weights": None,
        }

    run(body)


@pytest.mark.parametrize("how", ["leave", "gone", "expire", "replace"])
def test_every_way_out_fails_every_inflight_request(how: str):
    async def body(h: Harness) -> None:
        a = h.join("cpu-0", 101)
        futures = [h.send(a, i) for i in range(5)]
        if how == "leave":
            h.table.leave(a, "bye")
        elif how == "gone":
            h.table.gone("cpu-0", 101)
        elif how == "expire":
            h.clock.advance(TIMEOUT_S + 0.1)
            h.table.expire()
        else:
            h.join("cpu-0", 202)
        for future in futures:
            lost_message(future)
        assert h.table.inflight_total() == 0

    run(body)
