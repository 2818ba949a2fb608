"""The worker's own DEALER (worker/dealer.py) against libzmq's ROUTER (pyzmq): the protocol
as libzmq speaks it, messages both ways, large and many frames, PING/PONG heartbeats,
reconnection to a new ROUTER on the same path, and signals ending a wait.

The front door's ROUTER (router/src/zmtp.rs) is the other peer it meets; the pool tests
cover that pairing (every request of the suite crosses it)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from mpspool.worker import dealer as dealer_module
from mpspool.worker.dealer import Dealer

HELLO = [b"hello", b"second frame"]


@pytest.fixture
def path(tmp_path: Path) -> str:
    return str(tmp_path / "workers.ipc")


@pytest.fixture
def context() -> Iterator[zmq.Context]:
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


def router(ctx: zmq.Context, path: str, **options: int) -> zmq.Socket:
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # sending to a peer not connected raises
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    for name, value in options.items():
        sock.setsockopt(getattr(zmq, name), value)
    sock.bind(f"ipc://{path}")
    return sock


def pump(d: Dealer, until: float = 5.0) -> list[list[bytes]]:
    """Poll the dealer (connecting it) until it has a message or ``until`` seconds pass."""
    deadline = time.monotonic() + until
    while time.monotonic() < deadline:
        if d.poll(50):
            return [[bytes(f) for f in d.recv_multipart()]]
    return []


def connect(d: Dealer, r: zmq.Socket) -> None:
    """Poll until the dealer is connected and the ROUTER has its hello."""
    deadline = time.monotonic() + 5
    while not d.connected and time.monotonic() < deadline:
        d.poll(20)
    assert d.connected
    assert r.recv_multipart() == [b"w-1", *HELLO]


def test_hello_identity_and_messages_both_ways(context: zmq.Context, path: str) -> None:
    r = router(context, path)
    d = Dealer(path, b"w-1", HELLO)
    assert not d.connected  # nothing before the first poll
    connect(d, r)
    assert d.send_multipart([b"a", memoryview(b"bc"), bytearray(b"")])
    assert r.recv_multipart() == [b"w-1", b"a", b"bc", b""]
    r.send_multipart([b"w-1", b"x", b"yz"])
    assert pump(d) == [[b"x", b"yz"]]
    assert d.send(b"one")
    assert r.recv_multipart() == [b"w-1", b"one"]
    d.close()


def test_large_frames_and_many_messages_in_one_read(context: zmq.Context, path: str) -> None:
    r = router(context, path)
    d = Dealer(path, b"w-1", HELLO)
    connect(d, r)
    big = os.urandom(5 * 2**20)  # a LONG frame, many reads
    medium = os.urandom(300)  # just past the short-frame limit
    r.send_multipart([b"w-1", medium, big, b"end"])
    assert pump(d) == [[medium, big, b"end"]]
    assert d.send_multipart([big, medium])
    assert r.recv_multipart() == [b"w-1", big, medium]
    # Many messages written at once reach the dealer in few reads, and come out in order.
    for i in range(500):
        r.send_multipart([b"w-1", b"m%d" % i, os.urandom(i)])
    got: list[bytes] = []
    deadline = time.monotonic() + 10
    while len(got) < 500 and time.monotonic() < deadline:
        if d.poll(50):
            frames = d.recv_multipart()
            assert len(frames[1]) == int(bytes(frames[0])[1:])
            got.append(bytes(frames[0]))
    assert got == [b"m%d" % i for i in range(500)]


def test_a_message_held_stays_intact_while_later_ones_are_read(
    context: zmq.Context, path: str
) -> None:
    """Frames are views of the read buffer: later reads must never write under them (a
    request's input arrays are such views while the model runs)."""
    r = router(context, path)
    d = Dealer(path, b"w-1", HELLO)
    connect(d, r)
    first = os.urandom(1000)
    r.send_multipart([b"w-1", first])
    held = None
    while held is None:
        if d.poll(50):
            held = d.recv_multipart()
    for i in range(300):  # several buffers' worth, read and parsed after it
        r.send_multipart([b"w-1", os.urandom(997 + i)])
    taken = 0
    while taken < 300:
        if d.poll(50):
            d.recv_multipart()
            taken += 1
    assert bytes(held[0]) == first


def test_pings_are_answered_so_a_heartbeating_router_keeps_the_peer(
    context: zmq.Context, path: str
) -> None:
    # libzmq's ROUTER pings every 50 ms and drops a peer silent for 1.5 s (a peer that never
    # answers is dropped within the test's 2.5 s; a loaded machine's stalls are shorter).
    r = router(context, path, HEARTBEAT_IVL=50, HEARTBEAT_TIMEOUT=1500, HEARTBEAT_TTL=0)
    d = Dealer(path, b"w-1", HELLO)
    connect(d, r)
    deadline = time.monotonic() + 2.5
    while time.monotonic() < deadline:
        d.poll(20)
    r.send_multipart([b"w-1", b"still there"])  # EHOSTUNREACH had the peer been dropped
    assert pump(d) == [[b"still there"]]
    assert d.connections == 1


def test_a_new_router_on_the_same_path_gets_the_hello_again(
    context: zmq.Context, path: str
) -> None:
    r = router(context, path)
    d = Dealer(path, b"w-1", HELLO)
    connect(d, r)
    r.close(linger=0)
    os.unlink(path)
    # The loss is noticed at the next read or write; what is sent meanwhile is dropped.
    deadline = time.monotonic() + 5
    while d.connected and time.monotonic() < deadline:
        d.poll(20)
    assert not d.connected
    assert d.send(b"into the void") is False
    r2 = router(context, path)
    connect(d, r2)  # the hello, before anything else
    assert d.connections == 2
    assert d.send(b"after")
    assert r2.recv_multipart() == [b"w-1", b"after"]


def test_no_router_yet_then_one(context: zmq.Context, path: str) -> None:
    d = Dealer(path, b"w-1", HELLO)
    assert pump(d, until=0.3) == []
    assert not d.connected
    r = router(context, path)
    connect(d, r)


def test_no_front_door_for_long_is_said_once(
    context: zmq.Context,
    path: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A socket path nobody listens on (removed from the run directory) is said once, then
    again after a connection came and went (it was retried in silence for ever)."""
    monkeypatch.setattr(dealer_module, "UNREACHABLE_SAY_S", 0.2)
    d = Dealer(path, b"w-1", HELLO)
    with caplog.at_level("WARNING", logger="mpspool.worker"):
        pump(d, until=0.6)
    said = [
        r.getMessage() for r in caplog.records if "no front door has listened" in r.getMessage()
    ]
    assert len(said) == 1 and path in said[0] and "No such file or directory" in said[0], said
    connect(d, router(context, path))
    assert d._unreachable_since is None and not d._unreachable_said


def test_a_peer_that_is_not_a_router_is_refused(context: zmq.Context, path: str) -> None:
    pub = context.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind(f"ipc://{path}")
    d = Dealer(path, b"w-1", HELLO)
    assert pump(d, until=0.5) == []
    assert d.connections == 0  # counted only after a handshake that succeeded


def test_a_signal_ends_a_wait(
    monkeypatch: pytest.MonkeyPatch, context: zmq.Context, path: str
) -> None:
    monkeypatch.setattr(dealer_module, "_WAKEUP_FD", None)
    caught: list[int] = []
    previous = signal.signal(signal.SIGALRM, lambda signum, _: caught.append(signum))
    try:
        r = router(context, path)
        d = Dealer(path, b"w-1", HELLO, wake_on_signals=True)
        connect(d, r)
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        start = time.monotonic()
        assert d.poll(3000) is False
        assert caught == [signal.SIGALRM]
        assert time.monotonic() - start < 1.0  # not the 3 s asked for
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        signal.set_wakeup_fd(-1)


def test_a_message_with_many_frames_is_written_whole(context: zmq.Context, path: str) -> None:
    """More frames than one sendmsg takes (two buffers each: header and body)."""
    r = router(context, path)
    d = Dealer(path, b"w-1", HELLO)
    connect(d, r)
    frames = [b"%d" % i for i in range(3000)]
    assert d.send_multipart(frames)
    assert r.recv_multipart() == [b"w-1", *frames]
    assert d.connections == 1


def test_a_message_that_came_with_the_handshake_is_delivered_at_once(path: str) -> None:
    """A peer that writes its READY and a message in one go (a scripted ROUTER): the message
    must not wait in the buffer for bytes that never come."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    d = Dealer(path, b"w-1", HELLO)
    done: dict[str, bytes] = {}

    def peer() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.sendall(
                dealer_module.greeting()
                + dealer_module.ready_command(b"ROUTER", b"")
                + dealer_module.frame_header(0, 5)
                + b"first"
            )
            got = b""
            while b"hello" not in got or len(got) < 100:
                chunk = conn.recv(4096)
                if not chunk:
                    break
                got += chunk
            done["heard"] = got
            time.sleep(1.0)  # keep the connection open, and silent

    thread = threading.Thread(target=peer, daemon=True)
    thread.start()
    try:
        assert d.poll(0) is True  # connects, and the message is there already
        assert [bytes(f) for f in d.recv_multipart()] == [b"first"]
    finally:
        thread.join(5)
        listener.close()
    assert b"hello" in done["heard"]


@contextlib.contextmanager
def stalled_front_door(path: str) -> Iterator[tuple[Dealer, socket.socket]]:
    """A Dealer connected to a peer that completes the handshake and then reads nothing
    (hung, stopped), and the peer's end of the connection."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    accepted: list[socket.socket] = []

    def handshake_then_stall() -> None:
        conn, _ = listener.accept()
        accepted.append(conn)
        conn.sendall(dealer_module.greeting() + dealer_module.ready_command(b"ROUTER", b""))

    peer = threading.Thread(target=handshake_then_stall)
    peer.start()
    d = Dealer(path, b"w-1", HELLO)
    try:
        deadline = time.monotonic() + 5
        while not d.connected and time.monotonic() < deadline:
            d.poll(20)
        assert d.connected
        peer.join()
        yield d, accepted[0]
    finally:
        d.close()
        for conn in accepted:
            conn.close()
        listener.close()


def test_a_front_door_that_stops_reading_ends_the_connection_within_the_io_timeout(
    monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    """A peer that completes the handshake and then reads nothing (hung, stopped): the
    worker's write gives up after the I/O timeout, kept by the kernel (SO_SNDTIMEO), drops
    the connection and says so, instead of blocking its serving loop for ever."""
    monkeypatch.setattr(dealer_module, "IO_TIMEOUT_S", 0.3)
    with stalled_front_door(path) as (d, _):
        frame = bytes(4 << 20)
        start = time.monotonic()
        sent = 0
        while d.send_multipart([frame]):  # until the kernel's buffers are full
            sent += 1
            assert time.monotonic() - start < 5.0
        assert time.monotonic() - start < 5.0
        assert not d.connected
        assert sent < 16  # the socket's buffers hold a few MiB at most


def test_a_side_thread_beat_that_would_wait_is_skipped_and_leaves_the_stream_whole(
    monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    """The side thread's heartbeats (`send_from_thread`) never wait for a front door that
    stops reading: waiting would hold the write lock, and the loop's replies behind it, for
    the I/O timeout. A beat the socket has no room for is skipped at once, the connection is
    left to the loop, and what was written is whole frames (none cut short)."""
    monkeypatch.setattr(dealer_module, "IO_TIMEOUT_S", 30.0)  # a wait would show

    def read_all(conn: socket.socket) -> bytes:
        chunks = []
        while True:
            try:
                chunk = conn.recv(1 << 20)
            except (BlockingIOError, TimeoutError):
                return b"".join(chunks)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)

    with stalled_front_door(path) as (d, conn):
        conn.settimeout(0.5)
        read_all(conn)  # the dealer's handshake and hello: what comes next is beats only
        # A heartbeat's size: one small write, which a Unix socket takes whole or not at
        # all (a bigger one could go out in part, and its rest would have to wait).
        beat = bytes(range(64))
        start = time.monotonic()
        beats = 0
        while d.send_from_thread(beat):
            beats += 1
            assert beats < 100_000, "the socket never filled"
        assert time.monotonic() - start < 5.0, "a beat waited for room"
        assert beats > 0
        assert d.connected, "a skipped beat is not a lost connection"
        written = read_all(conn)
        framed = dealer_module.frame_header(0, len(beat)) + beat
        assert written == framed * beats


def test_last_words_from_a_side_thread_go_only_while_still_due(path: str) -> None:
    """A worker ending a hung call (worker/serve.py) sends its last messages from the side
    thread only if the call is still running once the write lock is its own; a reply of the
    loop's that got there first makes them moot, and nothing is written."""
    with stalled_front_door(path) as (d, conn):
        conn.settimeout(0.5)
        conn.recv(1 << 16)  # the dealer's handshake and hello
        assert d.send_last_from_thread([b"error", b"bye"], lambda: False) is None
        assert d.send_last_from_thread([b"error", b"bye"], lambda: True) is True
        frame = dealer_module.frame_header
        assert conn.recv(1 << 16) == frame(0, 5) + b"error" + frame(0, 3) + b"bye"


def test_a_spinning_dealer_reads_without_sleeping_and_still_waits_when_nothing_comes(
    context: zmq.Context, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    r = router(context, path)
    d = Dealer(path, b"w-1", HELLO, spin_s=0.2)
    connect(d, r)
    waits: list[float] = []
    wait = d._wait
    monkeypatch.setattr(d, "_wait", lambda sock, t: waits.append(t) or wait(sock, t))

    def later() -> None:
        time.sleep(0.05)
        r.send_multipart([b"w-1", b"request"])

    sender = threading.Thread(target=later)
    sender.start()
    assert d.poll(1000)  # came within the spin: no wait in the kernel
    sender.join()
    assert [bytes(f) for f in d.recv_multipart()] == [b"request"]
    assert waits == []

    started = time.monotonic()
    assert not d.poll(300)  # nothing comes: 0.2 s spinning, then the rest asleep
    assert waits and time.monotonic() - started >= 0.29
    assert waits[-1] <= 0.11, "the wait after the spin is the rest of the 0.3 s, not all of it"
    d.close()
