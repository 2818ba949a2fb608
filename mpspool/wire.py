"""The router ⇄ worker wire protocol, and the two small local control channels.

Both ends import this module and neither owns it (as the ZeroMQ guide's Majordomo keeps
MDP.py). Everything that crosses a socket is msgpack — never pickle — plus raw tensor
buffers as separate frames, sent without copies.

Worker channel: each worker's DEALER (worker/dealer.py: ZMTP spoken in the serving loop's
own thread) connects to the router's ROUTER at ``ipc://<run-dir>/workers.ipc`` with the
identity ``<slot>:<pid>`` (one per incarnation, so a late message from a replaced process is
recognisable); READY is its first message on every connection. A message is
``[header, *tensor frames]`` where header is a msgpack map ``{"v": 1, "k": kind, ...}``.

  worker → router
    READY      {slot, pid, model, version, weights[, warmup]}
                                                   + [serialized SignatureDefMap]
                                                   weights: where its variables live, or nil
                                                   warmup: [version dir, µs, records] when it
                                                   replayed a warm-up file (TF Serving's
                                                   warm-up metrics)
    HEARTBEAT  {slot, pid, served[, weights]}      sent from the serving loop
                                                   weights: READY's, sent again when
                                                   serving copied a variable at risk
    REPLY      {id, tensors, t}                    + one frame per output tensor
                                                   t: [start, end] of the model run, µs
                                                   since the epoch (for task-density plots)
    ERROR      {id, code, message}                 code: a gRPC status code number
    BYE        {slot, pid}                         draining: send nothing more
  router → worker
    REQUEST    {id, sig, tensors, outputs[, deadline]}
                                                   + one frame per input tensor
                                                   deadline: when the client stops waiting,
                                                   µs of CLOCK_MONOTONIC (the system's clock:
                                                   time.monotonic() here); none if it set none
    REREGISTER {}                                  "I do not know you": send READY again

``tensors`` is a list of ``[name, dtype, shape]`` with dtype a TensorFlow DataType number;
DT_STRING tensors travel as one msgpack list of bytes.

Control channel: the controller's DEALER talks to the router's ROUTER at
``ipc://<run-dir>/control.ipc``; admin channel: ``mpspool status|stop`` talk to the
controller's ROUTER at ``ipc://<run-dir>/admin.ipc``. Both are request/reply with a msgpack
map ``{"v": 1, "op": ..., ...}``; the run directory is private (0700), which is what makes
them local-only.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from typing import Any

import msgpack
import numpy as np

from mpspool import dtypes

PROTOCOL_VERSION = 1

WORKERS_ENDPOINT = "workers.ipc"
CONTROL_ENDPOINT = "control.ipc"
ADMIN_ENDPOINT = "admin.ipc"

# Heartbeat interval of the worker's serving loop; the router's liveness window is a
# configurable multiple of it (--worker-timeout, default 3 s).
HEARTBEAT_INTERVAL_S = 0.5


class Kind(str, enum.Enum):
    READY = "ready"
    HEARTBEAT = "hb"
    REPLY = "reply"
    ERROR = "error"
    BYE = "bye"
    REQUEST = "req"
    REREGISTER = "who"


class ProtocolError(ValueError):
    """A message that does not follow this protocol (wrong version, bad framing)."""


def socket_path(run_dir: str, name: str) -> str:
    """The Unix socket of a channel in the run directory (what workers connect to)."""
    return f"{run_dir}/{name}"


def endpoint(run_dir: str, name: str) -> str:
    """The same socket as a ZeroMQ endpoint (libzmq's sockets)."""
    return f"ipc://{socket_path(run_dir, name)}"


def slot_key(placement: str, version: int, model: str = "") -> str:
    """The slot a worker registers as: its placement and its model version ("cpu-0@2"), as
    two versions' workers share a placement while one replaces the other; in a pool of
    several models, other models' than the first also their model ("ranker/cpu-0@2")."""
    return f"{model}/{placement}@{version}" if model else f"{placement}@{version}"


def worker_identity(slot: str, pid: int) -> bytes:
    return f"{slot}:{pid}".encode()


def pack(kind: Kind | None = None, **fields: Any) -> bytes:
    """A header (kind set) or a control message (fields only)."""
    message: dict[str, Any] = {"v": PROTOCOL_VERSION}
    if kind is not None:
        message["k"] = kind.value
    message.update(fields)
    return msgpack.packb(message, use_bin_type=True)


def unpack(frame: bytes | memoryview) -> dict[str, Any]:
    try:
        message = msgpack.unpackb(frame, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(f"undecodable header: {exc}") from None
    if not isinstance(message, dict) or message.get("v") != PROTOCOL_VERSION:
        raise ProtocolError(f"expected protocol version {PROTOCOL_VERSION}, got {message!r:.80}")
    return message


def kind_of(message: Mapping[str, Any]) -> Kind:
    try:
        return Kind(message["k"])
    except (KeyError, ValueError):
        raise ProtocolError(f"unknown message kind {message.get('k')!r}") from None


TensorMeta = list  # [name, dtype, shape]


def encode_tensors(tensors: Mapping[str, np.ndarray]) -> tuple[list[TensorMeta], list[Any]]:
    """Header entries and frames for named arrays; numeric frames are the arrays themselves
    (the worker's socket writes them from their buffers, without copying)."""
    metas: list[TensorMeta] = []
    frames: list[Any] = []
    for name, array in tensors.items():
        dt = dtypes.dt_of_array(array)
        metas.append([name, dt, list(array.shape)])
        if dt == dtypes.DT_STRING:
            frames.append(string_frame(array))
        else:
            # Little-endian bytes, as uint8: a buffer export refuses some dtypes
            # (ml_dtypes' bfloat16), and the receiver reads the dtype from the header.
            little = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<"))
            frames.append(little.reshape(-1).view(np.uint8))
    return metas, frames


def decode_tensors(metas: Sequence[Sequence[Any]], frames: Sequence[Any]) -> dict[str, np.ndarray]:
    """Arrays over the received frames' buffers (views, no copy)."""
    if len(metas) != len(frames):
        raise ProtocolError(f"{len(metas)} tensors described but {len(frames)} frames sent")
    out: dict[str, np.ndarray] = {}
    for (name, dt, shape), frame in zip(metas, frames, strict=True):
        buffer = frame.buffer if hasattr(frame, "buffer") else frame
        if dt == dtypes.DT_STRING:
            values = string_values(buffer)
            array = np.empty(len(values), dtype=object)
            array[:] = values
            try:
                out[name] = array.reshape(shape)
            except ValueError:
                raise ProtocolError(
                    f"tensor {name!r}: {len(values)} strings for shape {shape}"
                ) from None
            continue
        try:
            dtype = dtypes.numpy_dtype(dt)
        except KeyError:
            raise ProtocolError(f"tensor {name!r}: unsupported dtype {dt}") from None
        if len(buffer) % dtype.itemsize:
            raise ProtocolError(
                f"tensor {name!r}: {len(buffer)} bytes is no whole number of {dtype}"
            )
        array = np.frombuffer(buffer, dtype=dtype)
        try:
            out[name] = array.reshape(shape)
        except ValueError:
            raise ProtocolError(f"tensor {name!r}: {array.size} values for shape {shape}") from None
    return out


def string_frame(array: np.ndarray) -> bytes:
    return msgpack.packb([_as_bytes(v) for v in array.reshape(-1)], use_bin_type=True)


def string_values(buffer: bytes | memoryview) -> list[bytes]:
    values = msgpack.unpackb(buffer, raw=True)
    if not isinstance(values, list):
        raise ProtocolError("a string tensor frame must hold a list")
    return values


def _as_bytes(value: Any) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, np.bytes_):
        return bytes(value)
    raise TypeError(f"string tensor element of type {type(value).__name__}")
