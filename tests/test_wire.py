"""mpspool/wire.py: headers, tensor framing, and one trip over real ZeroMQ sockets."""

from __future__ import annotations

import ml_dtypes
import msgpack
import numpy as np
import pytest
import zmq

from mpspool import dtypes, wire

# ---------------------------------------------------------------------------------------
# headers
# ---------------------------------------------------------------------------------------


def test_header_round_trip():
    header = wire.pack(
        wire.Kind.REQUEST,
        id=7,
        sig="serving_default",
        tensors=[["x", dtypes.DT_FLOAT, [2, 3]]],
        outputs=["y"],
        blob=b"\x00\xff",
    )
    assert isinstance(header, bytes)
    message = wire.unpack(header)
    assert message == {
        "v": wire.PROTOCOL_VERSION,
        "k": "req",
        "id": 7,
        "sig": "serving_default",
        "tensors": [["x", dtypes.DT_FLOAT, [2, 3]]],
        "outputs": ["y"],
        "blob": b"\x00\xff",  # bytes stay bytes (use_bin_type), str stays str
    }
    assert wire.kind_of(message) is wire.Kind.REQUEST


@pytest.mark.parametrize("kind", list(wire.Kind))
def test_every_kind_survives_the_trip(kind):
    assert wire.kind_of(wire.unpack(wire.pack(kind))) is kind


def test_unpack_reads_a_memoryview():
    # zmq.Frame.buffer is a memoryview: headers must decode from it without a copy.
    header = wire.pack(wire.Kind.HEARTBEAT, slot="g0/s1", pid=42, served=3)
    assert wire.unpack(memoryview(header))["slot"] == "g0/s1"


def test_control_message_has_no_kind():
    message = wire.unpack(wire.pack(op="status"))
    assert message == {"v": wire.PROTOCOL_VERSION, "op": "status"}
    with pytest.raises(wire.ProtocolError, match="unknown message kind None"):
        wire.kind_of(message)


@pytest.mark.parametrize(
    "frame",
    [
        msgpack.packb({"v": wire.PROTOCOL_VERSION + 1, "k": "req"}),
        msgpack.packb({"v": 0, "k": "req"}),
        msgpack.packb({"k": "req"}),
        msgpack.packb({"v": str(wire.PROTOCOL_VERSION), "k": "req"}),
        msgpack.packb([wire.PROTOCOL_VERSION, "req"]),
        msgpack.packb(wire.PROTOCOL_VERSION),
    ],
    ids=["next-version", "version-0", "no-version", "version-as-str", "list", "int"],
)
def test_wrong_version_is_a_protocol_error(frame):
    with pytest.raises(wire.ProtocolError, match="expected protocol version 1"):
        wire.unpack(frame)


@pytest.mark.parametrize(
    "frame",
    [b"", b"\xc1", wire.pack(wire.Kind.BYE) + b"\x00", wire.pack(wire.Kind.BYE)[:-1]],
    ids=["empty", "reserved-byte", "trailing-data", "truncated"],
)
def test_undecodable_header_is_a_protocol_error(frame):
    with pytest.raises(wire.ProtocolError, match="undecodable header"):
        wire.unpack(frame)


def test_unknown_kind_is_a_protocol_error():
    with pytest.raises(wire.ProtocolError, match="unknown message kind 'nope'"):
        wire.kind_of(wire.unpack(msgpack.packb({"v": wire.PROTOCOL_VERSION, "k": "nope"})))


def test_endpoints_and_identities():
    assert wire.endpoint("/run/x", wire.WORKERS_ENDPOINT) == "ipc:///run/x/workers.ipc"
    assert wire.worker_identity("g0/s1", 1234) == b"g0/s1:1234"


# ---------------------------------------------------------------------------------------
# tensors
# ---------------------------------------------------------------------------------------

_rng = np.random.default_rng(20240607)
_NUMERIC = {
    dt: dtype
    for dt, dtype in dtypes.NUMPY_OF_DT.items()
    if dt not in (dtypes.DT_STRING, dtypes.DT_BOOL)
}


def _random(dtype: np.dtype, shape) -> np.ndarray:
    raw = _rng.integers(0, 256, int(np.prod(shape)) * dtype.itemsize, dtype=np.uint8)
    return raw.view(dtype).reshape(shape)  # every bit pattern, NaN payloads included


def _arrays() -> list:
    cases = []
    for dt, dtype in _NUMERIC.items():
        name = dtypes.dtype_name(dt)
        cases.append(pytest.param(_random(dtype, (3, 4)), id=name))
    cases += [
        pytest.param(_rng.integers(0, 2, (2, 5)).astype(bool), id="bool"),
        pytest.param(np.array([1.5, -0.0, np.inf, np.nan], dtype=np.float16), id="half-values"),
        pytest.param(
            np.array([1.5, -2.0], dtype=ml_dtypes.bfloat16),
            id="bfloat16-values",
        ),
        pytest.param(
            np.array([[b"a", b""], [b"\xff\x00", b"long" * 50]], dtype=object), id="bytes"
        ),
        pytest.param(np.array(["héllo", "", "x"]), id="unicode-str"),
        pytest.param(np.array([b"ab", b"c"], dtype="S2"), id="fixed-bytes"),
        pytest.param(np.arange(40, dtype=np.int32).reshape(5, 8)[::2, 1::3], id="non-contiguous"),
        pytest.param(np.arange(6, dtype=np.float64).reshape(2, 3).T, id="transposed"),
        pytest.param(np.array(3.25, dtype=np.float32), id="0-d-float"),
        pytest.param(np.array(True), id="0-d-bool"),
        pytest.param(np.array(b"only", dtype=object), id="0-d-string"),
        pytest.param(np.zeros((0, 3), dtype=np.int64), id="empty-int64"),
        pytest.param(np.empty((2, 0), dtype=object), id="empty-string"),
    ]
    return cases


def _expected(array: np.ndarray) -> np.ndarray:
    if array.dtype.kind in "OSU":
        out = np.empty(array.shape, dtype=object)
        for index, v in np.ndenumerate(array):
            out[index] = v.encode() if isinstance(v, str) else bytes(v)
        return out
    return array


def _assert_same(got: np.ndarray, want: np.ndarray) -> None:
    assert got.dtype == want.dtype
    assert got.shape == want.shape
    if want.dtype == object:
        assert all(type(v) is bytes for v in got.reshape(-1))
        assert got.tolist() == want.tolist()
    else:
        assert got.tobytes() == np.ascontiguousarray(want).tobytes()


def _as_sent(frames) -> list[zmq.Frame]:
    """The frames as a socket would take them: send_multipart first requires each part to
    give a memoryview, then wraps it in a zmq.Frame."""
    for i, frame in enumerate(frames):
        try:
            memoryview(frame)
        except Exception:
            raise TypeError(f"Frame {i} does not support the buffer interface.") from None
    return [zmq.Frame(frame) for frame in frames]


def _through_header(metas):
    """The metas as the other side sees them: msgpack'd into a header and back."""
    return wire.unpack(wire.pack(wire.Kind.REQUEST, id=1, tensors=metas))["tensors"]


@pytest.mark.parametrize("array", _arrays())
def test_tensors_round_trip(array):
    metas, frames = wire.encode_tensors({"t": array})
    assert metas == [["t", dtypes.dt_of_array(array), list(array.shape)]]
    decoded = wire.decode_tensors(_through_header(metas), _as_sent(frames))
    assert list(decoded) == ["t"]
    _assert_same(decoded["t"], _expected(array))


def test_numeric_frames_share_the_arrays_memory():
    contiguous = np.arange(12, dtype=np.float32).reshape(3, 4)
    strided = contiguous[:, ::2]
    _, frames = wire.encode_tensors({"a": contiguous, "b": strided})
    assert np.shares_memory(frames[0], contiguous)  # a C-ordered array is sent in place
    assert frames[1].flags.c_contiguous  # a strided view is copied once, into C order
    assert bytes(memoryview(frames[1]).cast("B")) == strided.tobytes()


def test_several_tensors_keep_their_order_and_names():
    tensors = {
        "ids": np.array([[3, 1, 2]], dtype=np.int64),
        "words": np.array([b"a", b"bc"], dtype=object),
        "mask": np.array([True, False]),
    }
    metas, frames = wire.encode_tensors(tensors)
    assert [m[0] for m in metas] == ["ids", "words", "mask"]
    decoded = wire.decode_tensors(_through_header(metas), _as_sent(frames))
    assert list(decoded) == ["ids", "words", "mask"]
    for name, array in tensors.items():
        _assert_same(decoded[name], _expected(array))


def test_decoded_arrays_are_views_of_the_frames():
    frame = bytearray(np.arange(4, dtype=np.int32).tobytes())
    decoded = wire.decode_tensors([["x", dtypes.DT_INT32, [2, 2]]], [frame])["x"]
    frame[0] = 9  # the frame's memory is the array's memory
    assert decoded[0, 0] == 9


def test_unsupported_array_dtype_is_refused_on_encode():
    with pytest.raises(TypeError):
        wire.encode_tensors({"t": np.zeros(2, dtype=np.datetime64)})


def test_frame_count_mismatch_is_a_protocol_error():
    metas, frames = wire.encode_tensors({"a": np.zeros(2), "b": np.ones(3)})
    with pytest.raises(wire.ProtocolError, match="2 tensors described but 1 frames sent"):
        wire.decode_tensors(metas, frames[:1])
    with pytest.raises(wire.ProtocolError, match="1 tensors described but 2 frames sent"):
        wire.decode_tensors(metas[:1], frames)


@pytest.mark.parametrize(
    ("shape", "nbytes"),
    [([3], 8), ([3], 16), ([2, 2], 4), ([], 0), ([], 8)],
    ids=["short", "long", "2x2-of-1", "scalar-empty", "scalar-of-2"],
)
def test_frame_size_mismatch_is_a_protocol_error(shape, nbytes):
    with pytest.raises(wire.ProtocolError, match="values for shape"):
        wire.decode_tensors([["x", dtypes.DT_FLOAT, shape]], [bytes(nbytes)])


def test_unknown_dtype_number_is_a_protocol_error():
    with pytest.raises(wire.ProtocolError, match="unsupported dtype 20"):
        wire.decode_tensors([["x", 20, [1]]], [bytes(8)])


def test_partial_item_frame_is_a_protocol_error():
    with pytest.raises(wire.ProtocolError):
        wire.decode_tensors([["x", dtypes.DT_FLOAT, [2]]], [bytes(7)])


def test_string_count_mismatch_is_a_protocol_error():
    frame = msgpack.packb([b"a", b"b"], use_bin_type=True)
    with pytest.raises(wire.ProtocolError):
        wire.decode_tensors([["s", dtypes.DT_STRING, [3]]], [frame])


def test_big_endian_array_round_trips():
    array = np.arange(3, dtype=">i4")
    metas, frames = wire.encode_tensors({"x": array})
    decoded = wire.decode_tensors(metas, frames)["x"]
    assert decoded.tolist() == [0, 1, 2]


# ---------------------------------------------------------------------------------------
# real ZeroMQ: DEALER → ROUTER over ipc://, zero copies on both sides
# ---------------------------------------------------------------------------------------


@pytest.fixture
def zmq_pair(tmp_path):
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    dealer = context.socket(zmq.DEALER)
    try:
        address = wire.endpoint(str(tmp_path), wire.WORKERS_ENDPOINT)
        router.bind(address)
        dealer.setsockopt(zmq.IDENTITY, wire.worker_identity("g0/s0", 4321))
        dealer.connect(address)
        yield router, dealer
    finally:
        router.close(linger=0)
        dealer.close(linger=0)
        context.term()


def _receive(socket: zmq.Socket) -> list[zmq.Frame]:
    assert socket.poll(5000, zmq.POLLIN), "nothing arrived within 5 s"
    return socket.recv_multipart(copy=False)


@pytest.mark.timeout(30)
def test_tensors_cross_real_zmq_sockets_without_copies(zmq_pair):
    router, dealer = zmq_pair
    big = np.arange(1 << 16, dtype=np.float32).reshape(256, 256)  # above pyzmq's copy threshold
    tensors = {
        "big": big,
        "strided": big[::64, ::128],
        "half": np.array([0.5, -1.0], dtype=np.float16),
        "flag": np.array(False),
        "words": np.array([b"x", b"yz"], dtype=object),
    }
    metas, frames = wire.encode_tensors(tensors)
    header = wire.pack(wire.Kind.REPLY, id=99, tensors=metas, busy_us=5)
    dealer.send_multipart([header, *frames], copy=False)

    identity, head, *tensor_frames = _receive(router)
    assert identity.bytes == b"g0/s0:4321"
    message = wire.unpack(head.buffer)
    assert wire.kind_of(message) is wire.Kind.REPLY
    assert message["id"] == 99
    decoded = wire.decode_tensors(message["tensors"], tensor_frames)

    assert list(decoded) == list(tensors)
    for name, array in tensors.items():
        _assert_same(decoded[name], _expected(array))
    # Numeric arrays are views of the received messages' memory, not copies of it.
    for name, frame in zip(tensors, tensor_frames, strict=True):
        if name == "words":
            continue
        frame_memory = np.frombuffer(frame.buffer, dtype=np.uint8)
        assert np.shares_memory(decoded[name], frame_memory), name

    # And back: the router answers the worker through its identity.
    back_metas, back_frames = wire.encode_tensors({"y": decoded["big"][:2]})
    router.send_multipart(
        [identity, wire.pack(wire.Kind.REQUEST, id=100, tensors=back_metas), *back_frames],
        copy=False,
    )
    head, *frames_back = _receive(dealer)
    message = wire.unpack(head.buffer)
    y = wire.decode_tensors(message["tensors"], frames_back)["y"]
    _assert_same(y, big[:2])


@pytest.mark.timeout(30)
def test_bfloat16_tensor_crosses_real_zmq_sockets(zmq_pair):
    router, dealer = zmq_pair
    array = np.array([[1.5, -2.0, 0.0]], dtype=ml_dtypes.bfloat16)
    metas, frames = wire.encode_tensors({"b": array})
    dealer.send_multipart([wire.pack(wire.Kind.REPLY, id=1, tensors=metas), *frames], copy=False)
    _, head, *tensor_frames = _receive(router)
    decoded = wire.decode_tensors(wire.unpack(head.buffer)["tensors"], tensor_frames)
    _assert_same(decoded["b"], array)
