"""The worker's end of the workers' socket: a ZeroMQ DEALER spoken in the worker's own thread.

What it replaces: a libzmq DEALER (pyzmq). libzmq moves every message through its I/O
thread: a request is read there and handed to the worker's thread through a mailbox (an
eventfd wake-up), and a reply is handed back the same way before the I/O thread writes it.
Two thread hand-offs and their wake-ups per request, on the cores the model runs on (issue
11's "lean worker path"). Here the serving loop reads and writes the Unix socket itself:
a request is one ``recv_into`` (often several requests, as the front door writes what it
has for a worker at once), a reply one ``sendmsg`` of its frames.

Protocol: ZMTP 3.1 with the NULL mechanism (rfc.zeromq.org/spec/37), what the front door's
ROUTER speaks (router/src/zmtp.rs) and what libzmq speaks: the 64-byte greeting, READY
with ``Socket-Type: DEALER`` and ``Identity``, frames with MORE/LONG flags, PING answered
with PONG. Kept from libzmq's DEALER as the worker used it: the connection is made again
whenever it ends (a front door killed and restarted by supervisord), and the *hello*
message (the worker's READY) is the first message on every connection, so the new front
door learns the worker at once. Not kept: queueing while disconnected — a message sent
with no connection is dropped (said by the return value), as a reply for a front door
that is gone has nobody to go to and a heartbeat is sent again half a second later.

Blocking I/O in one thread, so a signal handler's flag would wait for the next timeout:
``poll`` also watches Python's signal wake-up descriptor (``signal.set_wakeup_fd``), so a
SIGTERM ends the wait at once.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import select
import signal
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

log = logging.getLogger("mpspool.worker")

GREETING_LEN = 64
FLAG_MORE = 0x01
FLAG_LONG = 0x02
FLAG_COMMAND = 0x04
# A frame larger than this is not ZMTP from our front door: the connection is dropped.
MAX_FRAME = 1 << 32
READ_CHUNK = 64 * 1024
# Room kept free for a read from poll (less and the unparsed rest moves to a new buffer).
MIN_READ_ROOM = 4096
HANDSHAKE_TIMEOUT_S = 5.0
# A write the front door does not take, or a message it leaves half-sent, within this long
# (stopped, hung) ends the connection: the serving loop must not block for ever, and SIGTERM
# must be heard (libzmq queued instead).
IO_TIMEOUT_S = 5.0
# sendmsg takes at most this many buffers (two per frame: header and body).
MAX_IOV = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024
# How often a lost connection is tried again (libzmq's ZMQ_RECONNECT_IVL is 100 ms).
RECONNECT_INTERVAL_S = 0.1
# No front door listening for this long is said once (a restarted one listens within a second
# or two; a worker whose socket path was removed retried in silence for ever, its log saying
# it served; found by a hunt).
UNREACHABLE_SAY_S = 10.0

_LONG = struct.Struct(">Q")
_U32 = struct.Struct(">I")


class HandshakeError(ConnectionError):
    """The peer does not speak ZMTP 3 with the NULL mechanism as a ROUTER."""


def greeting() -> bytes:
    """ZMTP 3.1's greeting: signature, version 3.1, mechanism NULL, as-server 0, filler."""
    g = bytearray(GREETING_LEN)
    g[0] = 0xFF
    g[8] = 1  # the padding as a ZMTP 1.0 length (identity size + 1), as libzmq writes it
    g[9] = 0x7F
    g[10], g[11] = 3, 1
    g[12:16] = b"NULL"
    return bytes(g)


def check_greeting(g: bytes | memoryview) -> None:
    if g[0] != 0xFF or not g[9] & 0x01:
        raise HandshakeError("the peer's greeting is not ZMTP 3's")
    if g[10] < 3:
        raise HandshakeError(f"the peer speaks ZMTP {g[10]} (3 needed)")
    mechanism = bytes(g[12:32]).rstrip(b"\0")
    if mechanism != b"NULL":
        raise HandshakeError(f"the peer's security mechanism is {mechanism!r} (NULL needed)")


def frame_header(flags: int, size: int) -> bytes:
    if size > 255:
        return bytes((flags | FLAG_LONG,)) + _LONG.pack(size)
    return bytes((flags, size))


def command(name: bytes, body: bytes = b"") -> bytes:
    """One command frame: its header, the name with its length, then the body."""
    payload = bytes((len(name),)) + name + body
    return frame_header(FLAG_COMMAND, len(payload)) + payload


def ready_command(socket_type: bytes, identity: bytes) -> bytes:
    properties = b"".join(
        bytes((len(name),)) + name + _U32.pack(len(value)) + value
        for name, value in ((b"Socket-Type", socket_type), (b"Identity", identity))
    )
    return command(b"READY", properties)


def parse_properties(body: memoryview) -> dict[str, bytes]:
    """A READY command's body after its name: property name → value."""
    out: dict[str, bytes] = {}
    at = 0
    while at < len(body):
        size = body[at]
        name = bytes(body[at + 1 : at + 1 + size])
        at += 1 + size
        if at + 4 > len(body):
            raise HandshakeError("a truncated READY property")
        (length,) = _U32.unpack_from(body, at)
        at += 4
        if at + length > len(body):
            raise HandshakeError("a truncated READY property")
        out[name.decode("ascii", "replace").lower()] = bytes(body[at : at + length])
        at += length
    return out


class _Reader:
    """Bytes read from the socket, cut into frames without copying them.

    A frame handed out is a memoryview of the buffer it was read into, and a buffer is never
    written where a view was handed out: reads go after the data read so far, and when the
    room there runs short the unparsed rest moves to a new buffer (the old one lives on
    while views of it do). So a request's arrays stay valid while it runs."""

    def __init__(self) -> None:
        self.buffer = bytearray(READ_CHUNK)
        self.view = memoryview(self.buffer)
        self.start = 0  # first unparsed byte
        self.end = 0  # one past the last byte read

    def make_room(self, need: int) -> None:
        """At least ``need`` bytes free after ``end``."""
        if len(self.buffer) - self.end >= need:
            return
        rest = self.end - self.start
        fresh = bytearray(max(READ_CHUNK, rest + need))
        fresh[:rest] = self.view[self.start : self.end]
        self.buffer, self.view = fresh, memoryview(fresh)
        self.start, self.end = 0, rest

    def fill(self, sock: socket.socket, need: int) -> None:
        """Read until ``need`` more bytes are in (blocking); the peer closing raises."""
        self.make_room(need)
        target = self.end + need
        while self.end < target:
            got = sock.recv_into(self.view[self.end :])
            if not got:
                raise ConnectionResetError(errno.ECONNRESET, "closed by the front door")
            self.end += got

    def frame(self) -> tuple[int, memoryview] | None:
        """The next whole frame (flags, body), or None while it is not all read."""
        have = self.end - self.start
        if have < 2:
            return None
        flags = self.buffer[self.start]
        head, size = self._size(flags, have)
        if size < 0 or have < head + size:
            return None
        body = self.view[self.start + head : self.start + head + size]
        self.start += head + size
        return flags, body

    def missing(self) -> int:
        """How many more bytes the next frame needs at least (its header's, while its size
        is not read yet)."""
        have = self.end - self.start
        if have < 2:
            return 2 - have
        head, size = self._size(self.buffer[self.start], have)
        if size < 0:
            return head - have
        return max(1, head + size - have)

    def _size(self, flags: int, have: int) -> tuple[int, int]:
        """(header length, body size); size -1 while the header is not all read."""
        if not flags & FLAG_LONG:
            return 2, self.buffer[self.start + 1]
        if have < 9:
            return 9, -1
        (size,) = _LONG.unpack_from(self.buffer, self.start + 1)
        if size > MAX_FRAME:
            raise HandshakeError(f"a frame of {size} bytes")
        return 9, size


class Dealer:
    """A DEALER connected to the front door's ROUTER at a Unix socket path.

    ``hello`` is sent first on every connection; the first ``poll`` makes the first one.
    ``wake_on_signals`` makes ``poll`` return when a signal arrives (it installs this
    process's ``signal.set_wakeup_fd``: main thread only, one per process). ``spin_s``: how
    long ``poll`` keeps reading the socket without sleeping before it waits in the kernel
    (0: it waits at once)."""

    def __init__(
        self,
        path: str,
        identity: bytes,
        hello: Sequence[bytes],
        wake_on_signals: bool = False,
        spin_s: float = 0.0,
    ) -> None:
        self.path = path
        self.spin_s = spin_s
        self.identity = identity
        self.hello = list(hello)
        self.connections = 0  # connections made so far, the first one included
        self._sock: socket.socket | None = None
        # Held by every write and by whatever replaces or closes the socket: a second thread
        # may send (`send_from_thread`), and a message's frames must not interleave.
        self._write_lock = threading.Lock()
        self._reader = _Reader()
        self._frames: list[memoryview] = []  # the message being read: its frames so far
        self._messages: deque[list[memoryview]] = deque()  # whole messages not yet taken
        self._retry_at = 0.0
        # Since when no front door listens (None: connected, or not tried yet), and whether
        # that was said.
        self._unreachable_since: float | None = None
        self._unreachable_said = False
        self._wakeup = _signal_wakeup_fd() if wake_on_signals else None
        self._poller: select.poll | None = None  # what _wait polls: made once per connection
        self._polled: socket.socket | None = None
        # Not connected yet: the first poll connects (and says hello), so nothing reaches
        # this process before its owner is ready to serve.

    # -- the connection ---------------------------------------------------------------------
    @property
    def connected(self) -> bool:
        return self._sock is not None

    def _connect(self) -> bool:
        """One attempt: connect, handshake, send the hello. False (tried again after
        RECONNECT_INTERVAL_S) when no front door listens yet or the handshake fails."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        reader = _Reader()
        try:
            sock.settimeout(HANDSHAKE_TIMEOUT_S)
            sock.connect(self.path)
            self._handshake(sock, reader)
            _kernel_timeouts(sock, IO_TIMEOUT_S)
            _send_all(sock, _message_buffers(self.hello))
        except (OSError, HandshakeError, MemoryError) as exc:
            sock.close()
            if isinstance(exc, (FileNotFoundError, ConnectionRefusedError)):
                self._note_unreachable(exc)
            else:
                log.warning("connecting to the front door at %s failed: %s", self.path, exc)
            self._retry_at = time.monotonic() + RECONNECT_INTERVAL_S
            return False
        self._unreachable_since, self._unreachable_said = None, False
        with self._write_lock:
            self._sock, self._reader = sock, reader
        self._frames, self._messages = [], deque()
        self.connections += 1
        if self.connections > 1:
            log.info("connected to the front door again (connection %d)", self.connections)
        self._parse()  # what came with the peer's READY is not left waiting for more bytes
        return True

    def _note_unreachable(self, exc: OSError) -> None:
        """No front door listens (yet): said once it has lasted UNREACHABLE_SAY_S."""
        now = time.monotonic()
        if self._unreachable_since is None:
            self._unreachable_since = now
        elif not self._unreachable_said and now - self._unreachable_since >= UNREACHABLE_SAY_S:
            log.warning(
                "no front door has listened at %s for %.0f s (%s); trying on",
                self.path, now - self._unreachable_since, exc.strerror or exc,
            )  # fmt: skip
            self._unreachable_said = True

    def _handshake(self, sock: socket.socket, reader: _Reader) -> None:
        sock.sendall(greeting() + ready_command(b"DEALER", self.identity))
        reader.fill(sock, GREETING_LEN)
        check_greeting(reader.view[reader.start : reader.start + GREETING_LEN])
        reader.start += GREETING_LEN
        while (frame := reader.frame()) is None:
            reader.fill(sock, reader.missing())
        flags, body = frame
        name = bytes(body[1 : 1 + body[0]]) if len(body) else b""
        if not flags & FLAG_COMMAND or name != b"READY":
            raise HandshakeError("the peer's first frame is not READY")
        socket_type = parse_properties(body[1 + len(name) :]).get("socket-type", b"")
        if socket_type != b"ROUTER":
            raise HandshakeError(f"the peer is a {socket_type.decode(errors='replace')} socket")

    def _lost(self, why: BaseException) -> None:
        log.warning("lost the front door's connection (%s); connecting again", why)
        with self._write_lock:
            if self._sock is not None:
                self._sock.close()
            self._sock = None
        self._frames, self._messages = [], deque()
        self._retry_at = time.monotonic() + RECONNECT_INTERVAL_S

    # -- receiving ------------------------------------------------------------------------------
    def poll(self, timeout_ms: int) -> bool:
        """Whether a message can be taken now. Waits up to ``timeout_ms`` for one, or less:
        a signal, a connection attempt falling due or part of a message arriving end the
        wait early (the caller loops until its own deadline)."""
        if self._messages:
            return True
        if self._sock is None:
            wait_s = self._retry_at - time.monotonic()
            if wait_s > 0:
                self._wait(None, min(timeout_ms / 1000, wait_s))
                return False
            return self._connect() and bool(self._messages)
        # Under load the next request is in the socket by the time this one is answered:
        # read first, and wait (a poll syscall and its Python) only when nothing is there.
        self._read_available()
        if self._messages:
            return True
        if self.spin_s > 0:
            spun_s = min(self.spin_s, timeout_ms / 1000)
            if self._spin(spun_s):
                return True
            timeout_ms = max(0, timeout_ms - int(spun_s * 1000))  # the wait is the rest
        if self._sock is None or not self._wait(self._sock, timeout_ms / 1000):
            return False
        self._read_available()
        return bool(self._messages)

    def _spin(self, seconds: float) -> bool:
        """Reads without sleeping for up to ``seconds``: whether a message came. A thread
        that sleeps between requests can find its next call slower (its core idled)."""
        until = time.perf_counter() + seconds
        while self._sock is not None and time.perf_counter() < until:
            self._read_available()
            if self._messages:
                return True
        return False

    def _read_available(self) -> None:
        """One read of what the socket holds now, parsed into ``_messages``. A lost
        connection reads nothing (a later poll makes it again)."""
        sock, reader = self._sock, self._reader
        if sock is None:
            return
        try:
            reader.make_room(max(MIN_READ_ROOM, reader.missing()))
            got = sock.recv_into(reader.view[reader.end :], 0, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return
        except (OSError, HandshakeError, MemoryError) as exc:  # MemoryError: a bad frame size
            self._lost(exc)
            return
        if not got:
            self._lost(ConnectionResetError("closed by the front door"))
            return
        reader.end += got
        self._parse()

    def recv_multipart(self) -> list[memoryview]:
        """The next message's frames, as views valid while the caller holds them; blocks
        until one is whole. ConnectionError if the connection ends meanwhile."""
        while not self._messages:
            if self._sock is None:
                raise ConnectionResetError(errno.ENOTCONN, "not connected to the front door")
            try:
                self._reader.fill(self._sock, self._reader.missing())
            except (OSError, HandshakeError, MemoryError) as exc:
                self._lost(exc)
                raise ConnectionResetError(f"lost the front door: {exc}") from exc
            self._parse()
        return self._messages.popleft()

    def _parse(self) -> None:
        """Whole frames read so far into messages; commands answered on the way."""
        try:
            while (frame := self._reader.frame()) is not None:
                flags, body = frame
                if flags & FLAG_COMMAND:
                    self._command(body)
                    if self._sock is None:
                        return
                    continue
                self._frames.append(body)
                if not flags & FLAG_MORE:
                    self._messages.append(self._frames)
                    self._frames = []
        except HandshakeError as exc:  # a frame too large: not our front door speaking
            self._lost(exc)

    def _command(self, body: memoryview) -> None:
        """ZMTP 3.1's PING gets a PONG with its context; ERROR ends the connection."""
        size = body[0] if len(body) else 0
        name, rest = bytes(body[1 : 1 + size]), body[1 + size :]
        if name == b"PING" and len(rest) >= 2:
            self._send_raw([command(b"PONG", bytes(rest[2:18]))])
        elif name == b"ERROR":
            reason = bytes(rest[1:]).decode(errors="replace")
            self._lost(ConnectionResetError(f"the front door said ERROR: {reason}"))

    # -- sending ----------------------------------------------------------------------------------
    def send_multipart(self, frames: Sequence[Any]) -> bool:
        """Write one message (bytes-like frames) whole; False when there is no connection
        (the message is dropped: see the module's docstring)."""
        return self._send_raw(_message_buffers(frames))

    def send(self, frame: Any) -> bool:
        return self._send_raw(_message_buffers((frame,)))

    def send_from_thread(self, frame: Any) -> bool:
        """``send`` for a thread other than the one that reads, for what may be skipped (a
        heartbeat: another follows). A write that fails is left for the reading thread to find
        (the connection's state is that thread's), and one that would wait is not made: the
        socket is full because the front door is not reading, and waiting out the socket's
        timeout here would hold the write lock, and the loop's replies behind it."""
        with self._write_lock:
            if self._sock is None:
                return False
            try:
                _send_all(self._sock, _message_buffers((frame,)), socket.MSG_DONTWAIT)
            except OSError:  # BlockingIOError among them: nothing was written
                return False
        return True

    def send_last_from_thread(
        self, frames: list[Any], still_due: Callable[[], bool]
    ) -> bool | None:
        """For a thread other than the one that reads, about to end the process: ``frames``,
        one message each, if ``still_due()`` holds under the write lock (None when it does
        not: the reading thread got there first, and its reply makes them moot). Each may
        wait for room up to the socket's timeout, since nothing follows them. Whether they
        all went (a failed write is left as it is: the process is ending)."""
        with self._write_lock:
            if not still_due():
                return None
            if self._sock is None:
                return False
            try:
                for frame in frames:
                    _send_all(self._sock, _message_buffers((frame,)))
            except OSError:
                return False
        return True

    def _send_raw(self, buffers: list[Any]) -> bool:
        with self._write_lock:
            if self._sock is None:
                return False
            try:
                _send_all(self._sock, buffers)
                return True
            except OSError as exc:
                failed = exc
        self._lost(failed)
        return False

    def close(self) -> None:
        with self._write_lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None

    # -- waiting --------------------------------------------------------------------------------
    def _wait(self, sock: socket.socket | None, timeout_s: float) -> bool:
        """Whether ``sock`` (the connection's, or None) became readable within
        ``timeout_s``; a signal ends the wait."""
        if self._poller is None or self._polled is not sock:
            self._poller, self._polled = select.poll(), sock
            if sock is not None:
                self._poller.register(sock, select.POLLIN)
            if self._wakeup is not None:
                self._poller.register(self._wakeup, select.POLLIN)
        readable = False
        for fd, _ in self._poller.poll(max(0, int(timeout_s * 1000))):
            if fd == self._wakeup:
                with contextlib.suppress(BlockingIOError):
                    os.read(fd, 512)
            else:
                readable = True
        return readable


def _message_buffers(frames: Sequence[Any]) -> list[Any]:
    """Frame headers and bodies, interleaved, for one ``sendmsg``."""
    out: list[Any] = []
    last = len(frames) - 1
    for i, frame in enumerate(frames):
        body = frame if isinstance(frame, (bytes, bytearray)) else memoryview(frame).cast("B")
        out.append(frame_header(FLAG_MORE if i < last else 0, len(body)))
        out.append(body)
    return out


def _send_all(sock: socket.socket, buffers: list[Any], first_flags: int = 0) -> None:
    """``sendmsg`` until every byte is written (a signal can cut a blocking write short),
    at most MAX_IOV buffers per call. ``first_flags`` go with the first call only: once part
    of a message is written the rest must follow, or the stream's framing is broken."""
    if len(buffers) > MAX_IOV:
        for at in range(0, len(buffers), MAX_IOV):
            _send_all(sock, buffers[at : at + MAX_IOV], first_flags if at == 0 else 0)
        return
    total = sum(len(b) for b in buffers)
    sent = sock.sendmsg(buffers, (), first_flags)
    if sent == total:
        return
    views = [memoryview(b) for b in buffers]
    while views:
        while views and sent >= len(views[0]):
            sent -= len(views[0])
            views.pop(0)
        if not views:
            return
        views[0] = views[0][sent:]
        sent = sock.sendmsg(views)


def _kernel_timeouts(sock: socket.socket, timeout_s: float) -> None:
    """Make ``sock`` blocking with its read and write timeouts kept by the kernel
    (SO_RCVTIMEO, SO_SNDTIMEO: a call that waits that long fails with EAGAIN).

    Not Python's ``settimeout``: with it, every recv and sendmsg first polls the socket and
    only then makes the call, two syscalls for one (strace under load: 3.5 polls per request
    before this). The serving loop does its own waiting (``Dealer._wait``)."""
    sock.settimeout(None)
    seconds = int(timeout_s)
    timeval = struct.pack("ll", seconds, int((timeout_s - seconds) * 1_000_000))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)


def _signal_wakeup_fd() -> int | None:
    """A descriptor that becomes readable when a signal arrives (Python writes a byte to
    it from its C-level handler), made once per process; None outside the main thread."""
    global _WAKEUP_FD
    if _WAKEUP_FD is not None:
        return _WAKEUP_FD
    read_fd, write_fd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    except ValueError:  # not the main thread
        os.close(read_fd)
        os.close(write_fd)
        return None
    _WAKEUP_FD = read_fd
    return read_fd


_WAKEUP_FD: int | None = None
