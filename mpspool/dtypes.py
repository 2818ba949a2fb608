"""TensorFlow DataType numbers ⇄ numpy dtypes, shared by router, worker and codec.

The wire protocol names tensor dtypes by TensorFlow's DataType number (the enum in
tensorflow/core/framework/types.proto), so that types numpy lacks (bfloat16) still
travel: the router never needs to interpret them, only carry their bytes.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

DT_INVALID = 0
DT_FLOAT = 1
DT_DOUBLE = 2
DT_INT32 = 3
DT_UINT8 = 4
DT_INT16 = 5
DT_INT8 = 6
DT_STRING = 7
DT_COMPLEX64 = 8
DT_INT64 = 9
DT_BOOL = 10
DT_BFLOAT16 = 14
DT_UINT16 = 17
DT_COMPLEX128 = 18
DT_HALF = 19
DT_UINT32 = 22
DT_UINT64 = 23

# Short names as TensorFlow prints them ("Expects arg[0] to be int64 but float is provided").
DTYPE_NAMES: dict[int, str] = {
    DT_FLOAT: "float",
    DT_DOUBLE: "double",
    DT_INT32: "int32",
    DT_UINT8: "uint8",
    DT_INT16: "int16",
    DT_INT8: "int8",
    DT_STRING: "string",
    DT_COMPLEX64: "complex64",
    DT_INT64: "int64",
    DT_BOOL: "bool",
    DT_BFLOAT16: "bfloat16",
    DT_UINT16: "uint16",
    DT_COMPLEX128: "complex128",
    DT_HALF: "half",
    DT_UINT32: "uint32",
    DT_UINT64: "uint64",
}


NUMPY_OF_DT: dict[int, np.dtype] = {
    DT_FLOAT: np.dtype("<f4"),
    DT_DOUBLE: np.dtype("<f8"),
    DT_INT32: np.dtype("<i4"),
    DT_UINT8: np.dtype("u1"),
    DT_INT16: np.dtype("<i2"),
    DT_INT8: np.dtype("i1"),
    DT_STRING: np.dtype(object),
    DT_COMPLEX64: np.dtype("<c8"),
    DT_INT64: np.dtype("<i8"),
    DT_BOOL: np.dtype("?"),
    # numpy has no bfloat16; ml_dtypes (a dependency, and TensorFlow's own) provides it.
    DT_BFLOAT16: np.dtype(ml_dtypes.bfloat16),
    DT_UINT16: np.dtype("<u2"),
    DT_COMPLEX128: np.dtype("<c16"),
    DT_HALF: np.dtype("<f2"),
    DT_UINT32: np.dtype("<u4"),
    DT_UINT64: np.dtype("<u8"),
}

_DT_OF_NUMPY: dict[np.dtype, int] = {
    dtype: dt for dt, dtype in NUMPY_OF_DT.items() if dt not in (DT_STRING, DT_BFLOAT16)
}


# Types a signature may declare that mpspool does not carry (no request can send them, no
# answer hold them): named in the refusal of such a signature (signature.py, _unservable).
_UNCARRIED_NAMES: dict[int, str] = {
    11: "qint8", 12: "quint8", 13: "qint32", 15: "qint16", 16: "quint16", 20: "resource",
    21: "variant", 24: "float8_e5m2", 25: "float8_e4m3fn", 26: "float8_e4m3fnuz",
    27: "float8_e4m3b11fnuz", 28: "float8_e5m2fnuz", 29: "int4", 30: "uint4", 31: "int2",
    32: "uint2", 33: "float4_e2m1fn",
}  # fmt: skip


def dtype_name(dt: int) -> str:
    return DTYPE_NAMES.get(dt) or _UNCARRIED_NAMES.get(dt, f"DataType({dt})")


def carried(dt: int) -> bool:
    """Whether tensors of DataType ``dt`` cross the wire (numpy_dtype knows it)."""
    return dt in NUMPY_OF_DT


def numpy_dtype(dt: int) -> np.dtype:
    """The numpy dtype for a TensorFlow DataType; KeyError for types mpspool does not carry."""
    return NUMPY_OF_DT[dt]


def dt_of_array(array: np.ndarray) -> int:
    """The TensorFlow DataType of a numpy array (bytes/str/object arrays are DT_STRING)."""
    kind = array.dtype.kind
    if kind in ("O", "S", "U"):
        return DT_STRING
    if array.dtype == NUMPY_OF_DT[DT_BFLOAT16]:
        return DT_BFLOAT16
    try:
        return _DT_OF_NUMPY[
            array.dtype.newbyteorder("<") if array.dtype.byteorder == ">" else array.dtype
        ]
    except KeyError:
        raise TypeError(f"numpy dtype {array.dtype} has no TensorFlow counterpart") from None
