"""TensorProto ⇄ numpy for the Python load generator and the tests' clients, without
TensorFlow (whose import costs ~2 s and 200 MiB per process). It follows TensorFlow's C++
``Tensor::FromProto`` rules (the front door's, router/src/codec.rs, checked against the same
shared vectors): a non-empty ``tensor_content`` holds the raw little-endian values; otherwise
the typed ``*_val`` field matching the dtype, its last value repeated to fill the shape, zeros
when empty, the first ``num_elements`` when there are more.
"""

from __future__ import annotations

import math

import numpy as np

from mpspool import dtypes
from mpspool.errors import Code, ServingError
from mpspool.protos import tensorflow_pb2

# dtype → (typed field, numpy dtype the field's values are read as)
_TYPED_FIELD: dict[int, tuple[str, str]] = {
    dtypes.DT_FLOAT: ("float_val", "<f4"),
    dtypes.DT_DOUBLE: ("double_val", "<f8"),
    dtypes.DT_INT32: ("int_val", "<i4"),
    dtypes.DT_INT16: ("int_val", "<i4"),
    dtypes.DT_INT8: ("int_val", "<i4"),
    dtypes.DT_UINT8: ("int_val", "<i4"),
    dtypes.DT_UINT16: ("int_val", "<i4"),
    dtypes.DT_INT64: ("int64_val", "<i8"),
    dtypes.DT_UINT32: ("uint32_val", "<u4"),
    dtypes.DT_UINT64: ("uint64_val", "<u8"),
    dtypes.DT_BOOL: ("bool_val", "?"),
    dtypes.DT_HALF: ("half_val", "<i4"),
    dtypes.DT_BFLOAT16: ("half_val", "<i4"),
    dtypes.DT_COMPLEX64: ("scomplex_val", "<f4"),
    dtypes.DT_COMPLEX128: ("dcomplex_val", "<f8"),
    dtypes.DT_STRING: ("string_val", ""),
}


# numpy's limit on ndim (TensorFlow's own is 254; no served model comes near either).
_MAX_RANK = 64
_INT64_MAX = 2**63 - 1


def _invalid(name: str, what: str) -> ServingError:
    return ServingError(Code.INVALID_ARGUMENT, f'tensor parsing error: input "{name}": {what}')


# The largest tensor a request may describe (2 GiB: protobuf's own limit on a message, so
# no request that spells its values out can be refused by this).
MAX_TENSOR_BYTES = 2**31


def tensor_shape(proto: tensorflow_pb2.TensorProto, name: str = "") -> tuple[int, ...]:
    shape_proto = proto.tensor_shape
    if shape_proto.unknown_rank:
        raise _invalid(name, "a tensor's shape must have a known rank")
    if len(shape_proto.dim) > _MAX_RANK:
        raise _invalid(name, f"rank {len(shape_proto.dim)} exceeds the maximum of {_MAX_RANK}")
    shape = tuple(int(d.size) for d in shape_proto.dim)
    if any(d < 0 for d in shape):
        raise _invalid(name, f"negative dimension in shape {list(shape)}")
    # TensorShape::IsValid multiplies dim by dim and rejects the shape as soon as the
    # running product overflows int64, even if a later dimension is 0.
    n = 1
    for d in shape:
        n *= d
        if n > _INT64_MAX:
            raise _invalid(name, f"shape {list(shape)} has more than 2^63-1 elements")
    return shape


def tensor_to_array(proto: tensorflow_pb2.TensorProto, name: str = "") -> np.ndarray:
    """The array TensorFlow would build from `proto`; ServingError(INVALID_ARGUMENT) if none."""
    dt = int(proto.dtype)
    if dt not in _TYPED_FIELD:
        raise _invalid(name, f"unsupported dtype {dtypes.dtype_name(dt)}")
    shape = tensor_shape(proto, name)
    n = math.prod(shape)
    dtype = dtypes.numpy_dtype(dt)
    if n == 0:
        # Tensor::FromProto reads no values for an empty shape: whatever tensor_content or
        # typed values came along are ignored, not checked.
        return np.zeros(shape, dtype=dtype)
    if n * dtype.itemsize > MAX_TENSOR_BYTES:
        # Typed fields repeat their last value to fill the shape, so a request of a few
        # bytes can ask for terabytes. TensorFlow would try; a shared front door must not.
        raise _invalid(
            name,
            f"shape {list(shape)} of {dtypes.dtype_name(dt)} needs {n * dtype.itemsize} bytes, "
            f"more than the {MAX_TENSOR_BYTES} one tensor may have",
        )
    content = proto.tensor_content
    if dt == dtypes.DT_STRING:
        if content:
            raise _invalid(name, "string tensors must use string_val, not tensor_content")
        return _fill(np.array(list(proto.string_val), dtype=object), n, dtype, shape)
    if content:
        if len(content) != n * dtype.itemsize:
            raise _invalid(
                name,
                f"tensor_content has {len(content)} bytes, "
                f"shape {list(shape)} of {dtypes.dtype_name(dt)} needs {n * dtype.itemsize}",
            )
        array = np.frombuffer(content, dtype=dtype)
        if dt == dtypes.DT_BOOL and np.frombuffer(content, dtype=np.uint8).max() > 1:
            # TensorFlow refuses bool bytes other than 0 and 1; numpy would keep them as
            # bools that are neither True nor False bit for bit.
            raise _invalid(name, "tensor_content of a bool tensor holds bytes other than 0 and 1")
        return array.reshape(shape)
    field, field_dtype = _TYPED_FIELD[dt]
    raw = np.asarray(getattr(proto, field), dtype=field_dtype)
    if dt in (dtypes.DT_COMPLEX64, dtypes.DT_COMPLEX128):
        raw = raw[: (raw.size // 2) * 2].view(dtype)  # (re, im) pairs; an odd tail is dropped
    elif dt in (dtypes.DT_HALF, dtypes.DT_BFLOAT16):
        raw = raw.astype("<u2").view(dtype)  # the low 16 bits are the value's bit pattern
    elif raw.dtype != dtype:
        raw = raw.astype(dtype)  # int_val → int8/int16/uint8/uint16 wraps like static_cast
    return _fill(raw, n, dtype, shape)


def _fill(values: np.ndarray, n: int, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    if values.size == 0:
        if dtype == np.dtype(object):
            out = np.empty(n, dtype=object)
            out[:] = b""
            return out.reshape(shape)
        return np.zeros(shape, dtype=dtype)
    if values.size >= n:
        return values[:n].reshape(shape)
    out = np.empty(n, dtype=dtype)
    out[: values.size] = values
    out[values.size :] = values[-1]
    return out.reshape(shape)


def array_to_tensor(
    array: np.ndarray, proto: tensorflow_pb2.TensorProto | None = None
) -> tensorflow_pb2.TensorProto:
    """Fill `proto` (or a new TensorProto) from an array: tensor_content for numbers,
    string_val for strings — both what TF Serving itself sends."""
    if proto is None:
        proto = tensorflow_pb2.TensorProto()
    dt = dtypes.dt_of_array(array)
    proto.dtype = dt
    proto.tensor_shape.dim.extend(
        tensorflow_pb2.TensorShapeProto.Dim(size=int(d)) for d in array.shape
    )
    if dt == dtypes.DT_STRING:
        proto.string_val.extend(
            v if isinstance(v, bytes) else str(v).encode() for v in array.reshape(-1)
        )
    else:
        little_endian = array.dtype.newbyteorder("<")
        proto.tensor_content = np.ascontiguousarray(array, dtype=little_endian).tobytes()
    return proto
