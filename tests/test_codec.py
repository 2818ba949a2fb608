"""router/codec.py against TensorFlow itself, on the same serialized bytes.

Every case builds a TensorProto with one of the two protobuf definitions (mpspool's
``mpspool.tfs`` copies or TensorFlow's own ``tensor_pb2``), serializes it, and hands the
bytes to three parsers:

- ``tensor_to_array`` (over ``mpspool.tfs.TensorProto``), the code under test;
- ``tf.io.parse_tensor``, which runs C++ ``Tensor::FromProto`` — the rule TF Serving applies
  to a PredictRequest, and therefore the rule the codec must follow;
- ``tf.make_ndarray`` (over TensorFlow's ``TensorProto``), the Python reading that clients
  know. It agrees with the C++ rule except where noted:
  * more values than elements: C++ keeps the first N, Python raises (``np.pad`` with a
    negative width);
  * a string tensor with no values: C++ fills with empty bytes, Python with ``""`` (str);
  * an empty shape with a non-empty tensor_content: C++ ignores the bytes, Python raises;
  * a bool tensor_content byte other than 0/1: C++ refuses it, Python keeps it.

Results are compared bit for bit: dtype, shape and raw bytes (so NaN payloads, -0.0 and
half/bfloat16 bit patterns count).
"""

from __future__ import annotations

import itertools
import zlib

import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.framework import tensor_pb2 as tf_tensor_pb2

from mpspool import dtypes
from mpspool.errors import Code, ServingError
from mpspool.protos import tensorflow_pb2 as our_pb2
from mpspool.router.codec import array_to_tensor, tensor_shape, tensor_to_array

# ---------------------------------------------------------------------------------------
# dtypes, typed fields and value generators
# ---------------------------------------------------------------------------------------

# dtype number → the TensorProto field TensorFlow reads it from.
TYPED_FIELD = {
    dtypes.DT_FLOAT: "float_val",
    dtypes.DT_DOUBLE: "double_val",
    dtypes.DT_INT8: "int_val",
    dtypes.DT_INT16: "int_val",
    dtypes.DT_INT32: "int_val",
    dtypes.DT_INT64: "int64_val",
    dtypes.DT_UINT8: "int_val",
    dtypes.DT_UINT16: "int_val",
    dtypes.DT_UINT32: "uint32_val",
    dtypes.DT_UINT64: "uint64_val",
    dtypes.DT_BOOL: "bool_val",
    dtypes.DT_HALF: "half_val",
    dtypes.DT_BFLOAT16: "half_val",
    dtypes.DT_COMPLEX64: "scomplex_val",
    dtypes.DT_COMPLEX128: "dcomplex_val",
    dtypes.DT_STRING: "string_val",
}
ALL_FIELDS = sorted(set(TYPED_FIELD.values()))
ALL_DTS = list(TYPED_FIELD)
NUMERIC_DTS = [dt for dt in ALL_DTS if dt != dtypes.DT_STRING]
DT_IDS = [dtypes.dtype_name(dt) for dt in ALL_DTS]
NUMERIC_IDS = [dtypes.dtype_name(dt) for dt in NUMERIC_DTS]

SHAPES = [(), (1,), (5,), (2, 3), (3, 1, 4)]
SHAPE_IDS = ["scalar", "1", "5", "2x3", "3x1x4"]

# Values worth having in every float-like tensor.
_FLOAT_EDGES = [0.0, -0.0, 1.0, -1.5, np.inf, -np.inf, np.nan]


def np_dtype(dt: int) -> np.dtype:
    return np.dtype(tf.dtypes.as_dtype(dt).as_numpy_dtype)


def random_values(dt: int, n: int, rng: np.random.Generator) -> np.ndarray:
    """`n` values of dtype `dt`, covering its range and (for floats) its special values."""
    if dt == dtypes.DT_STRING:
        out = np.empty(n, dtype=object)
        for i in range(n):
            out[i] = rng.bytes(int(rng.integers(0, 6)))  # includes b"" and non-UTF-8 bytes
        return out
    dtype = np_dtype(dt)
    if dt == dtypes.DT_BOOL:
        return rng.integers(0, 2, n).astype(bool)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        values = rng.integers(info.min, info.max, n, dtype=dtype, endpoint=True)
        values[: min(n, 2)] = [info.min, info.max][: min(n, 2)]
        return values
    if dt in (dtypes.DT_HALF, dtypes.DT_BFLOAT16):
        # Any 16-bit pattern is a value (NaN payloads included): they travel as integers.
        return rng.integers(0, 1 << 16, n, dtype=np.uint16).view(dtype)
    if dtype.kind == "c":
        part = np.dtype(f"f{dtype.itemsize // 2}")
        values = np.empty(n, dtype=dtype)
        values.real = _float_values(part, n, rng)
        values.imag = _float_values(part, n, rng)[::-1]
        return values
    return _float_values(dtype, n, rng)


def _float_values(dtype: np.dtype, n: int, rng: np.random.Generator) -> np.ndarray:
    values = (rng.standard_normal(n) * 10.0 ** rng.integers(-30, 30, n)).astype(dtype)
    edges = np.array([*_FLOAT_EDGES, np.finfo(dtype).smallest_subnormal], dtype=dtype)
    k = min(n, len(edges))
    values[rng.permutation(n)[:k]] = edges[:k]
    return values


def typed_values(dt: int, array: np.ndarray) -> list:
    """`array` as the Python values of its typed field, the way clients fill it."""
    flat = np.asarray(array).reshape(-1)
    if dt == dtypes.DT_STRING:
        return [bytes(v) for v in flat]
    if dt in (dtypes.DT_HALF, dtypes.DT_BFLOAT16):
        return [int(v) for v in flat.view(np.uint16)]
    if dt in (dtypes.DT_COMPLEX64, dtypes.DT_COMPLEX128):
        return [float(x) for v in flat for x in (v.real, v.imag)]
    return flat.tolist()


def rng_for(*key: object) -> np.random.Generator:
    """A generator seeded by the test's parameters: reproducible, different per case."""
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


# ---------------------------------------------------------------------------------------
# building and parsing the same bytes three ways
# ---------------------------------------------------------------------------------------

BUILDERS = {"ours": our_pb2, "tf": tf_tensor_pb2}


def serialize(
    side: str,
    dt: int,
    shape,
    *,
    content: bytes = b"",
    fields: dict[str, list] | None = None,
    unknown_rank: bool = False,
) -> bytes:
    proto = BUILDERS[side].TensorProto()
    proto.dtype = dt
    for d in shape:
        proto.tensor_shape.dim.add(size=d)
    proto.tensor_shape.unknown_rank = unknown_rank
    if content:
        proto.tensor_content = content
    for field, values in (fields or {}).items():
        getattr(proto, field).extend(values)
    return proto.SerializeToString()


def ours(data: bytes, name: str = "x") -> np.ndarray:
    return tensor_to_array(our_pb2.TensorProto.FromString(data), name)


def tf_python(data: bytes) -> np.ndarray:
    return tf.make_ndarray(tf_tensor_pb2.TensorProto.FromString(data))


def tf_cpp(data: bytes, dt: int) -> np.ndarray:
    """Tensor::FromProto's reading of `data` (raises InvalidArgumentError if it refuses)."""
    value = tf.io.parse_tensor(data, out_type=tf.dtypes.as_dtype(dt)).numpy()
    if dt == dtypes.DT_STRING:
        return np.array(value, dtype=object)  # a 0-d result comes back as bare bytes
    return np.asarray(value)


def assert_same(got: np.ndarray, want: np.ndarray) -> None:
    assert isinstance(got, np.ndarray)
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    assert got.shape == want.shape, (got.shape, want.shape)
    if got.dtype == object:
        assert [type(v) for v in got.reshape(-1)] == [type(v) for v in want.reshape(-1)]
        assert got.tolist() == want.tolist()
    else:
        assert got.tobytes() == want.tobytes(), f"\n got {got!r}\nwant {want!r}"


def assert_matches_tensorflow(data: bytes, dt: int, *, python_agrees: bool = True) -> np.ndarray:
    got = ours(data)
    assert_same(got, tf_cpp(data, dt))
    if python_agrees:
        assert_same(got, tf_python(data))
    return got


def assert_invalid(data: bytes, *, tf_refuses: bool = True, name: str = "x") -> ServingError:
    with pytest.raises(ServingError) as info:
        ours(data, name)
    assert info.value.code == Code.INVALID_ARGUMENT
    assert f'"{name}"' in info.value.message  # the client learns which input was wrong
    assert info.value.message.startswith("tensor parsing error")
    if tf_refuses:
        # ...and TF Serving would refuse the same bytes.
        with pytest.raises(tf.errors.InvalidArgumentError):
            tf_cpp(data, our_pb2.TensorProto.FromString(data).dtype)
    return info.value


# ---------------------------------------------------------------------------------------
# tensor_content and full typed fields, every dtype, every shape, both builders
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("side", list(BUILDERS))
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("dt", NUMERIC_DTS, ids=NUMERIC_IDS)
def test_tensor_content_is_read_as_raw_little_endian_values(dt, shape, side):
    want = random_values(dt, int(np.prod(shape)), rng_for("content", dt, shape)).reshape(shape)
    data = serialize(side, dt, shape, content=want.astype(want.dtype.newbyteorder("<")).tobytes())
    got = assert_matches_tensorflow(data, dt)
    assert_same(got, want)


@pytest.mark.parametrize("side", list(BUILDERS))
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("dt", ALL_DTS, ids=DT_IDS)
def test_typed_field_with_every_value(dt, shape, side):
    want = random_values(dt, int(np.prod(shape)), rng_for("typed", dt, shape)).reshape(shape)
    data = serialize(side, dt, shape, fields={TYPED_FIELD[dt]: typed_values(dt, want)})
    got = assert_matches_tensorflow(data, dt)
    assert_same(got, want)


def test_values_are_not_all_alike():
    # Guards the generator: a case full of zeros would let "read nothing" pass.
    for dt in ALL_DTS:
        values = random_values(dt, 12, rng_for("guard", dt))
        distinct = {bytes(v) if dt == dtypes.DT_STRING else v.tobytes() for v in values}
        assert len(distinct) == 2 if dt == dtypes.DT_BOOL else len(distinct) > 3


# ---------------------------------------------------------------------------------------
# fewer, none, more, and misplaced values
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("given", [1, 2, 5])
@pytest.mark.parametrize("dt", ALL_DTS, ids=DT_IDS)
def test_fewer_values_than_elements_repeat_the_last(dt, given):
    shape = (2, 3)
    values = random_values(dt, given, rng_for("partial", dt, given))
    data = serialize("tf", dt, shape, fields={TYPED_FIELD[dt]: typed_values(dt, values)})
    got = assert_matches_tensorflow(data, dt)
    flat = got.reshape(-1)
    assert_same(flat[:given], values)
    for v in flat[given:]:
        assert_same(np.array([v], dtype=got.dtype), values[-1:])


def test_official_client_scalar_broadcast_over_a_shape():
    # tf.make_tensor_proto(5.0, shape=[2, 3]) sends one float_val and a [2, 3] shape.
    proto = tf.make_tensor_proto(5.0, dtype=tf.float32, shape=[2, 3])
    assert list(proto.float_val) == [5.0]
    data = proto.SerializeToString()
    got = assert_matches_tensorflow(data, dtypes.DT_FLOAT)
    assert_same(got, np.full((2, 3), 5.0, dtype=np.float32))


@pytest.mark.parametrize("side", list(BUILDERS))
@pytest.mark.parametrize("dt", ALL_DTS, ids=DT_IDS)
def test_no_values_give_zeros(dt, side):
    shape = (3, 2)
    data = serialize(side, dt, shape)
    if dt == dtypes.DT_STRING:
        # C++ fills with empty strings; make_ndarray pads with "" (str) instead of b"".
        got = assert_matches_tensorflow(data, dt, python_agrees=False)
        assert tf_python(data).tolist() == [[""] * 2] * 3
        assert got.tolist() == [[b""] * 2] * 3
    else:
        got = assert_matches_tensorflow(data, dt)
        assert_same(got, np.zeros(shape, dtype=np_dtype(dt)))


@pytest.mark.parametrize("dt", ALL_DTS, ids=DT_IDS)
def test_more_values_than_elements_keep_the_first_n(dt):
    shape = (2, 2)
    values = random_values(dt, 7, rng_for("more", dt))
    data = serialize("ours", dt, shape, fields={TYPED_FIELD[dt]: typed_values(dt, values)})
    got = assert_matches_tensorflow(data, dt, python_agrees=False)
    assert_same(got, values[:4].reshape(shape))
    # Python's make_ndarray refuses what the server accepts (np.pad by a negative width).
    with pytest.raises(ValueError):
        tf_python(data)


@pytest.mark.parametrize("dt", ALL_DTS, ids=DT_IDS)
def test_values_in_other_typed_fields_are_ignored(dt):
    shape = (4,)
    fields = {}
    for field in ALL_FIELDS:
        if field == TYPED_FIELD[dt]:
            continue
        fields[field] = {
            "string_val": [b"a", b"b"],
            "bool_val": [True, True],
        }.get(field, [7, 9])
    data = serialize("tf", dt, shape, fields=fields)
    if dt == dtypes.DT_STRING:
        got = assert_matches_tensorflow(data, dt, python_agrees=False)
        assert got.tolist() == [b""] * 4
    else:
        got = assert_matches_tensorflow(data, dt)
        assert_same(got, np.zeros(shape, dtype=np_dtype(dt)))


def test_int64_sent_in_bool_val_parses_as_zeros():
    # What Triton's perf_analyzer 2.51 sends for an INT64 input: the values in bool_val.
    data = serialize("tf", dtypes.DT_INT64, (1, 3), fields={"bool_val": [True, False, True]})
    got = assert_matches_tensorflow(data, dtypes.DT_INT64)
    assert_same(got, np.zeros((1, 3), dtype=np.int64))


def test_tensor_content_wins_over_typed_values():
    content = np.array([1.0, 2.0], dtype="<f4").tobytes()
    data = serialize("ours", dtypes.DT_FLOAT, (2,), content=content, fields={"float_val": [9.0]})
    got = assert_matches_tensorflow(data, dtypes.DT_FLOAT)
    assert got.tolist() == [1.0, 2.0]


# ---------------------------------------------------------------------------------------
# narrowing and bit patterns
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dt",
    [dtypes.DT_INT8, dtypes.DT_INT16, dtypes.DT_UINT8, dtypes.DT_UINT16],
    ids=["int8", "int16", "uint8", "uint16"],
)
def test_out_of_range_int_val_wraps_like_static_cast(dt):
    sent = [300, -200, 70000, -1, 2**31 - 1, -(2**31)]
    data = serialize("tf", dt, (6,), fields={"int_val": sent})
    got = ours(data)
    # Python's make_ndarray raises OverflowError here; the server truncates.
    assert_same(got, tf_cpp(data, dt))
    assert_same(got, np.array(sent, dtype=np.int64).astype(np_dtype(dt)))


@pytest.mark.parametrize("dt", [dtypes.DT_HALF, dtypes.DT_BFLOAT16], ids=["half", "bfloat16"])
def test_half_val_keeps_only_the_low_16_bits(dt):
    sent = [0x3C00, 0x1_3C00, -1, 0x7E01]  # 1.0, 1.0 with junk above bit 15, 0xFFFF, NaN payload
    data = serialize("ours", dt, (4,), fields={"half_val": sent})
    got = ours(data)
    assert_same(got, tf_cpp(data, dt))
    assert got.view(np.uint16).tolist() == [0x3C00, 0x3C00, 0xFFFF, 0x7E01]


@pytest.mark.parametrize(
    ("dt", "field"),
    [(dtypes.DT_COMPLEX64, "scomplex_val"), (dtypes.DT_COMPLEX128, "dcomplex_val")],
    ids=["complex64", "complex128"],
)
def test_complex_values_are_pairs_and_an_odd_tail_is_dropped(dt, field):
    data = serialize("tf", dt, (3,), fields={field: [1.0, 2.0, 3.0, 4.0, 5.0]})
    got = assert_matches_tensorflow(data, dt)
    assert got.tolist() == [1 + 2j, 3 + 4j, 3 + 4j]
    # A lone real part is no value at all: zeros.
    data = serialize("tf", dt, (2,), fields={field: [7.0]})
    got = assert_matches_tensorflow(data, dt)
    assert got.tolist() == [0j, 0j]


def test_bfloat16_is_ml_dtypes_bfloat16():
    data = serialize("ours", dtypes.DT_BFLOAT16, (2,), fields={"half_val": [0x3F80, 0xC000]})
    got = assert_matches_tensorflow(data, dtypes.DT_BFLOAT16)
    assert got.dtype == np.dtype(ml_dtypes.bfloat16)
    assert got.astype(np.float32).tolist() == [1.0, -2.0]


# ---------------------------------------------------------------------------------------
# empty shapes
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("with_values", [False, True], ids=["no-values", "values"])
@pytest.mark.parametrize("shape", [(0,), (2, 0, 3), (0, 0)], ids=["0", "2x0x3", "0x0"])
@pytest.mark.parametrize("dt", ALL_DTS, ids=DT_IDS)
def test_zero_element_shapes(dt, shape, with_values):
    values = random_values(dt, 3 if with_values else 0, rng_for("empty", dt))
    data = serialize("tf", dt, shape, fields={TYPED_FIELD[dt]: typed_values(dt, values)})
    # Values for an empty tensor are "more values than elements": make_ndarray raises.
    got = assert_matches_tensorflow(data, dt, python_agrees=not with_values)
    assert got.shape == shape
    assert got.dtype == np_dtype(dt)


@pytest.mark.parametrize("dt", ALL_DTS, ids=DT_IDS)
def test_zero_element_shape_ignores_tensor_content(dt):
    # Tensor::FromProto never looks at the bytes of an empty tensor (make_ndarray raises).
    data = serialize("ours", dt, (0, 4), content=b"\x01\x02\x03")
    got = assert_matches_tensorflow(data, dt, python_agrees=False)
    assert got.shape == (0, 4)
    assert got.dtype == np_dtype(dt)


# ---------------------------------------------------------------------------------------
# what is refused
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("delta", [-1, 1, -4])
@pytest.mark.parametrize("dt", NUMERIC_DTS, ids=NUMERIC_IDS)
def test_wrong_tensor_content_length_is_invalid_argument(dt, delta):
    size = 6 * np_dtype(dt).itemsize + delta
    data = serialize("tf", dt, (2, 3), content=bytes(max(size, 1)))
    error = assert_invalid(data)
    assert "tensor_content" in error.message


def test_tensor_content_sized_for_another_shape_is_invalid_argument():
    # 24 bytes are six floats, not the three of the shape (nor three doubles' worth of floats).
    data = serialize("ours", dtypes.DT_FLOAT, (3,), content=np.arange(6, dtype="<f4").tobytes())
    assert_invalid(data)
    with pytest.raises(ValueError):
        tf_python(data)


def test_bool_tensor_content_other_than_0_and_1_is_invalid_argument():
    assert_matches_tensorflow(
        serialize("tf", dtypes.DT_BOOL, (3,), content=b"\x01\x00\x01"), dtypes.DT_BOOL
    )
    assert_invalid(serialize("tf", dtypes.DT_BOOL, (3,), content=b"\x01\x02\x00"))


@pytest.mark.parametrize("shape", [(-1,), (2, -3), (-1, 0)], ids=["-1", "2x-3", "-1x0"])
def test_negative_dimensions_are_invalid_argument(shape):
    error = assert_invalid(serialize("tf", dtypes.DT_FLOAT, shape, fields={"float_val": [1.0]}))
    assert "negative" in error.message


def test_unknown_rank_is_invalid_argument():
    # Deliberately stricter than TensorFlow: C++ TensorShape ignores unknown_rank (a request
    # with no dims becomes a scalar), but a request that does not know its own rank is
    # malformed and mpspool says so.
    data = serialize("tf", dtypes.DT_FLOAT, (), fields={"float_val": [1.0]}, unknown_rank=True)
    error = assert_invalid(data, tf_refuses=False)
    assert "rank" in error.message
    assert_same(tf_cpp(data, dtypes.DT_FLOAT), np.array(1.0, dtype=np.float32))


@pytest.mark.parametrize(
    "shape", [(2**62, 4), (2**32, 2**32), (2**62, 2**62, 0)], ids=["2^64", "2^64b", "then-0"]
)
def test_element_count_overflowing_int64_is_invalid_argument(shape):
    # TensorShape::IsValid rejects a running product that overflows, even before a 0.
    assert_invalid(serialize("tf", dtypes.DT_FLOAT, shape, fields={"float_val": [1.0]}))


def test_rank_beyond_numpy_is_invalid_argument():
    # numpy stops at 64 dimensions (TensorFlow at 254): refused rather than crashing.
    assert_matches_tensorflow(serialize("tf", dtypes.DT_FLOAT, (1,) * 64), dtypes.DT_FLOAT)
    assert_invalid(serialize("tf", dtypes.DT_FLOAT, (1,) * 65), tf_refuses=False)


def test_string_tensor_content_is_invalid_argument():
    # TensorFlow would decode an encoded string list here (Tensor::AsProtoTensorContent's
    # format); no TF Serving client sends one, and mpspool refuses it.
    error = assert_invalid(
        serialize("tf", dtypes.DT_STRING, (1,), content=b"\x01a"), tf_refuses=False
    )
    assert "string_val" in error.message


@pytest.mark.parametrize(
    "dt", [0, 11, 20, 21, 99], ids=["invalid", "qint8", "resource", "variant", "unknown-99"]
)
def test_unsupported_dtype_is_invalid_argument(dt):
    data = serialize("ours", dt, (1,), fields={"int_val": [1]})
    with pytest.raises(ServingError) as info:
        ours(data)
    assert info.value.code == Code.INVALID_ARGUMENT
    assert "unsupported dtype" in info.value.message


def test_tensor_shape_reads_dims():
    proto = our_pb2.TensorProto.FromString(serialize("tf", dtypes.DT_FLOAT, (2, 0, 5)))
    assert tensor_shape(proto) == (2, 0, 5)
    assert tensor_shape(our_pb2.TensorProto()) == ()


# ---------------------------------------------------------------------------------------
# round trips
# ---------------------------------------------------------------------------------------


def _round_trip_arrays(*, big_endian: bool = True) -> list:
    arrays = list(_generate_round_trip_arrays())
    if big_endian:
        return arrays
    return [p for p in arrays if not p.id.startswith("big-endian")]


def _generate_round_trip_arrays():
    for dt, shape in itertools.product(ALL_DTS, [(), (3,), (2, 3), (0, 2)]):
        name = f"{dtypes.dtype_name(dt)}-{'x'.join(map(str, shape)) or 'scalar'}"
        n = int(np.prod(shape))
        yield pytest.param(random_values(dt, n, rng_for("rt", dt, shape)).reshape(shape), id=name)
    base = np.arange(24, dtype=np.float32).reshape(4, 6)
    yield pytest.param(base[:, ::2], id="non-contiguous")
    yield pytest.param(base.T, id="transposed")
    yield pytest.param(np.arange(6, dtype=">i4").reshape(2, 3), id="big-endian-int32")
    yield pytest.param(np.array([1.5, -2.25], dtype=">f8"), id="big-endian-double")
    yield pytest.param(np.array(["héllo", "", "x"]), id="unicode-str")
    yield pytest.param(np.array([b"ab", b"\xff\x00"], dtype="S2"), id="fixed-bytes")


def _expected(array: np.ndarray) -> np.ndarray:
    """What comes back: native byte order; strings as an object array of bytes."""
    if array.dtype.kind in "OSU":
        out = np.empty(array.shape, dtype=object)
        for index, v in np.ndenumerate(array):
            out[index] = v.encode() if isinstance(v, str) else bytes(v)
        return out
    return array.astype(array.dtype.newbyteorder("="), order="C")


@pytest.mark.parametrize("array", _round_trip_arrays())
def test_array_to_tensor_is_read_back_by_tensorflow(array):
    data = array_to_tensor(array).SerializeToString()
    want = _expected(array)
    dt = dtypes.dt_of_array(array)
    assert_same(tf_cpp(data, dt), want)
    assert_same(tf_python(data), want)
    assert_same(ours(data), want)


def test_array_to_tensor_fills_a_given_proto():
    request_input = our_pb2.TensorProto()
    assert array_to_tensor(np.array([1, 2], dtype=np.int64), request_input) is request_input
    assert request_input.dtype == dtypes.DT_INT64
    assert [d.size for d in request_input.tensor_shape.dim] == [2]


# tf.make_tensor_proto copies a big-endian array's bytes into tensor_content unswapped
# (TensorFlow reads them back wrong too), so those arrays are left out here.
@pytest.mark.parametrize("array", _round_trip_arrays(big_endian=False))
def test_make_tensor_proto_is_read_back_by_the_codec(array):
    data = tf.make_tensor_proto(array).SerializeToString()
    assert_same(ours(data), _expected(array))


def test_a_tiny_request_cannot_ask_for_a_huge_tensor() -> None:
    """One value and a shape of 2^40 floats: TensorFlow would repeat the value 2^40 times."""
    proto = our_pb2.TensorProto(dtype=our_pb2.DT_FLOAT, float_val=[1.0])
    proto.tensor_shape.dim.add(size=2**40)
    with pytest.raises(ServingError) as info:
        tensor_to_array(proto, "x")
    assert info.value.code == Code.INVALID_ARGUMENT
    assert "more than the" in info.value.message
