"""Writes (or, with --check, verifies) the test vectors the Rust front door and the Python
side both read, so that neither can drift from TensorFlow or from the other:

- tensor_proto.json: serialized TensorProtos → what TensorFlow's C++ ``Tensor::FromProto``
  makes of them (run here through ``tf.io.parse_tensor``), as dtype, shape and little-endian
  bytes (or the byte strings of a DT_STRING tensor), or the front door's error text for the
  protos TensorFlow refuses, and for the front door's own rules (``"ours"``: an expanded size
  over its bound, which TensorFlow would try to allocate; dtypes it does not carry).
- wire.json: msgpack headers of the router ⇄ worker protocol as mpspool/wire.py packs them.

Run: ``python tests/vectors/make_vectors.py`` to rewrite, ``--check`` to compare.
"""

from __future__ import annotations

import argparse
import json
import sys
import zlib
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from mpspool import dtypes, wire  # noqa: E402
from mpspool.protos import tensorflow_pb2  # noqa: E402

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
SHAPES = [(), (1,), (5,), (2, 3), (3, 1, 4)]
MAX_TENSOR_BYTES = 2**31  # router/src/codec.rs


def _proto(dt: int, shape, content: bytes = b"", fields=None, unknown_rank=False) -> bytes:
    proto = tensorflow_pb2.TensorProto()
    proto.dtype = dt
    for d in shape:
        proto.tensor_shape.dim.add(size=d)
    proto.tensor_shape.unknown_rank = unknown_rank
    if content:
        proto.tensor_content = content
    for field, values in (fields or {}).items():
        getattr(proto, field).extend(values)
    return proto.SerializeToString()


def _values(dt: int, n: int, rng: np.random.Generator) -> list:
    """`n` values of `dt` as its typed field holds them, covering the type's edges."""
    if dt == dtypes.DT_STRING:
        return [rng.bytes(int(rng.integers(0, 6))) for _ in range(n)]
    if dt == dtypes.DT_BOOL:
        return [bool(v) for v in rng.integers(0, 2, n)]
    if dt in (dtypes.DT_HALF, dtypes.DT_BFLOAT16):
        return [int(v) for v in rng.integers(0, 1 << 16, n)]
    if dt in (dtypes.DT_COMPLEX64, dtypes.DT_COMPLEX128):
        return [float(v) for v in rng.standard_normal(2 * n)]
    dtype = dtypes.numpy_dtype(dt)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        values = [int(v) for v in rng.integers(info.min, info.max, n, dtype=dtype, endpoint=True)]
        values[: min(n, 2)] = [int(info.min), int(info.max)][: min(n, 2)]
        if dt in (dtypes.DT_INT8, dtypes.DT_UINT8, dtypes.DT_INT16, dtypes.DT_UINT16) and n > 2:
            values[2] = 70000 if dtype.kind == "u" else -70000  # int_val wraps on narrowing
        return values
    edges = [0.0, -0.0, 1.0, -1.5, float("inf"), float("-inf"), float("nan")]
    values = [float(v) for v in (rng.standard_normal(n) * 1e3).astype(dtype)]
    values[: min(n, len(edges))] = edges[: min(n, len(edges))]
    return values


def _content(dt: int, n: int, rng: np.random.Generator) -> bytes:
    if dt == dtypes.DT_BOOL:
        return rng.integers(0, 2, n).astype(np.uint8).tobytes()
    size = dtypes.numpy_dtype(dt).itemsize
    return rng.integers(0, 256, n * size, dtype=np.uint8).tobytes()


def cases() -> list[dict[str, Any]]:
    """{name, proto (hex), ours} for every rule the codec follows."""
    out: list[dict[str, Any]] = []

    def add(name: str, data: bytes, ours: str = "") -> None:
        out.append({"name": name, "proto": data.hex(), "ours": ours})

    for dt, field in TYPED_FIELD.items():
        dn = dtypes.dtype_name(dt)
        for shape in SHAPES:
            n = int(np.prod(shape))
            rng = np.random.default_rng(zlib.crc32(f"{dn}{shape}".encode()))
            tag = f"{dn}{list(shape)}"
            add(f"{tag} typed, all values", _proto(dt, shape, fields={field: _values(dt, n, rng)}))
            add(f"{tag} no values: zeros", _proto(dt, shape))
            if n > 1:
                add(
                    f"{tag} fewer values: the last repeats",
                    _proto(dt, shape, fields={field: _values(dt, 2, rng)[:1]}),
                )
            add(
                f"{tag} more values: the first n",
                _proto(dt, shape, fields={field: _values(dt, n + 3, rng)}),
            )
            other = "int64_val" if field != "int64_val" else "float_val"
            add(
                f"{tag} values in another field are ignored",
                _proto(dt, shape, fields={other: [7] * n if other == "int64_val" else [7.0] * n}),
            )
            if dt != dtypes.DT_STRING:
                add(f"{tag} tensor_content", _proto(dt, shape, content=_content(dt, n, rng)))
                if n:
                    add(
                        f"{tag} tensor_content one byte short",
                        _proto(dt, shape, content=_content(dt, n, rng)[:-1]),
                    )
        # Declared huge, a few bytes sent: refused by the bound before anything is expanded.
        add(
            f"{dn} declared [2^21,16,1024] with one value",
            _proto(dt, (1 << 21, 16, 1024), fields={field: _values(dt, 1, rng)}),
            ours="more than the 2147483648 one tensor may have",
        )
    s = dtypes.DT_STRING
    add(
        "string of 64 KiB x [2^15] (repeated: over 2 GiB)",
        _proto(s, (1 << 15,), fields={"string_val": [b"x" * (1 << 16)]}),
        ours="more than the 2147483648 one tensor may have",
    )
    add(
        "string [2^30] of one empty value (a 2^31+5-byte frame)",
        _proto(s, (1 << 30,), fields={"string_val": [b""]}),
        ours="needs 2147483653 bytes, more than the 2147483648 one tensor may have",
    )
    # Strings in tensor_content: TensorFlow's own encoding (each one's length as a varint32,
    # then their bytes, exactly filling it), read before string_val.
    add("string [1] in tensor_content", _proto(s, (1,), content=b"\x01a"))
    add(
        "string [2] in tensor_content, not UTF-8, string_val ignored",
        _proto(s, (2,), content=b"\x01\x02a\xff\x00", fields={"string_val": [b"zz"]}),
    )
    add(
        "string [2] in tensor_content, one of 200 bytes (a 2-byte length)",
        _proto(s, (2,), content=b"\xc8\x01\x00" + b"y" * 200),
    )
    add("string [2] in tensor_content, a byte too many", _proto(s, (2,), content=b"\x01\x01abc"))
    add("string [2] in tensor_content, a byte short", _proto(s, (2,), content=b"\x01\x02ab"))
    add("string [3] in tensor_content holding 2", _proto(s, (3,), content=b"\x01\x01ab"))
    add("string [1] in tensor_content, a length cut", _proto(s, (1,), content=b"\x80"))
    add(
        "rank 65 (TensorFlow allows 254; numpy, which the workers use, 64)",
        _proto(dtypes.DT_FLOAT, (1,) * 65),
        ours="rank 65 exceeds the maximum of 64",
    )
    add(
        "string of rank 33 (TensorFlow's numpy conversion of strings ends the process past 32)",
        _proto(s, (1,) * 33, fields={"string_val": [b"a"]}),
        ours="a string tensor of rank 33: the workers take string tensors of rank 32 at most",
    )
    add("string of rank 32", _proto(s, (1,) * 32, fields={"string_val": [b"a"]}))
    no_shape = tensorflow_pb2.TensorProto(dtype=dtypes.DT_INT32, int_val=[5])
    add("no tensor_shape at all (a scalar)", no_shape.SerializeToString())
    add("empty shape ignores tensor_content", _proto(dtypes.DT_FLOAT, (0, 3), content=b"\x01\x02"))
    add("bool tensor_content byte 2", _proto(dtypes.DT_BOOL, (2,), content=b"\x01\x02"))
    add("negative dimension", _proto(dtypes.DT_FLOAT, (2, -1)))
    add("unknown rank, no dimensions (a scalar)", _proto(dtypes.DT_FLOAT, (), unknown_rank=True))
    add("unknown rank with dimensions", _proto(dtypes.DT_FLOAT, (2,), unknown_rank=True))
    add("element count over int64", _proto(dtypes.DT_FLOAT, (1 << 40, 1 << 40, 0)))
    add("unsupported dtype (qint8)", _proto(11, (1,)), ours="unsupported dtype qint8")
    add(
        "complex64 odd number of parts",
        _proto(dtypes.DT_COMPLEX64, (2,), fields={"scomplex_val": [1.0, 2.0, 3.0]}),
    )
    return out


def expectation(case: dict[str, Any], tf: Any) -> dict[str, Any]:
    """What the front door must make of `case`: TensorFlow's own parse, or an error."""
    data = bytes.fromhex(case["proto"])
    proto = tensorflow_pb2.TensorProto.FromString(data)
    if case["ours"]:  # a rule of the front door's own: TensorFlow is not asked
        return {"error": case["ours"]}
    try:
        tensor = tf.io.parse_tensor(data, out_type=tf.dtypes.as_dtype(proto.dtype))
    except Exception:  # TensorFlow refuses: the front door must too (its text is its own)
        return {"error": ""}
    array = np.asarray(tensor.numpy())  # a scalar string comes back as bytes
    shape = list(array.shape)
    if proto.dtype == dtypes.DT_STRING:
        return {
            "dtype": proto.dtype,
            "shape": shape,
            "strings": [v.hex() for v in array.reshape(-1)],
        }
    little = array.astype(array.dtype.newbyteorder("<"), copy=False)
    return {"dtype": proto.dtype, "shape": shape, "content": little.tobytes().hex()}


def wire_vectors() -> dict[str, Any]:
    metas = [["ids", dtypes.DT_INT64, [2, 16]], ["names", dtypes.DT_STRING, [2]]]
    return {
        # Rust builds REQUEST headers: byte-equal to what Python packs (same key order), with
        # and without a deadline (µs of CLOCK_MONOTONIC; past 2^32, so a uint64 in msgpack).
        "requests": [
            {"fields": fields, "bytes": wire.pack(wire.Kind.REQUEST, **fields).hex()}
            for fields in (
                {"id": 42, "sig": "serving_default", "tensors": metas, "outputs": ["score"]},
                {
                    "id": 43,
                    "sig": "serving_default",
                    "tensors": metas,
                    "outputs": [],
                    "deadline": 86_400_000_123_456,
                },
            )
        ],
        "reregister": wire.pack(wire.Kind.REREGISTER).hex(),
        # Python workers build these; Rust must decode them.
        "worker": [
            {
                "kind": "ready",
                "bytes": wire.pack(
                    wire.Kind.READY,
                    slot="cpu-0",
                    pid=7,
                    model="demo",
                    version=3,
                    weights={"segment": "/dev/shm/x", "copied": {}},
                ).hex(),
            },
            {
                "kind": "ready",
                "bytes": wire.pack(
                    wire.Kind.READY, slot="cpu-1", pid=8, model="demo", version=3, weights=None
                ).hex(),
            },
            {
                "kind": "ready",
                "bytes": wire.pack(
                    wire.Kind.READY,
                    slot="cpu-2",
                    pid=9,
                    model="demo",
                    version=3,
                    weights=None,
                    warmup=["/models/demo/3", 250_000, 2],
                    load=["/models/demo/3", 1_750_000],
                ).hex(),
            },
            {
                "kind": "hb",
                "bytes": wire.pack(wire.Kind.HEARTBEAT, slot="cpu-0", pid=7, served=12).hex(),
            },
            {
                "kind": "hb",
                "bytes": wire.pack(
                    wire.Kind.HEARTBEAT,
                    slot="cpu-0",
                    pid=7,
                    served=13,
                    weights={"segment": "/dev/shm/x", "copied": {"table:0": 256}},
                ).hex(),
            },
            {
                "kind": "reply",
                "bytes": wire.pack(
                    wire.Kind.REPLY,
                    id=2**40,
                    tensors=[["score", 1, [2, 1]]],
                    t=[1_700_000_000_000_000, 1_700_000_000_000_250],
                ).hex(),
            },
            {
                "kind": "error",
                "bytes": wire.pack(wire.Kind.ERROR, id=5, code=3, message="bad id 99").hex(),
            },
            {"kind": "bye", "bytes": wire.pack(wire.Kind.BYE, slot="cpu-0", pid=7).hex()},
        ],
        "strings": {
            "values": [b"".hex(), b"a".hex(), bytes(range(256)).hex(), (b"z" * 300).hex()],
            "bytes": wire.string_frame(
                np.array([b"", b"a", bytes(range(256)), b"z" * 300], dtype=object)
            ).hex(),
        },
    }


def build() -> dict[str, Any]:
    import tensorflow as tf

    tensors = []
    for case in cases():
        tensors.append({**case, "expect": expectation(case, tf)})
    return {"tensor_proto": tensors, "wire": wire_vectors()}


def files(vectors: dict[str, Any]) -> dict[Path, str]:
    return {
        HERE / "tensor_proto.json": json.dumps(vectors["tensor_proto"], indent=0) + "\n",
        HERE / "wire.json": json.dumps(vectors["wire"], indent=1) + "\n",
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    args = parser.parse_args()
    stale = []
    for path, text in files(build()).items():
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(path.name)
        else:
            path.write_text(text)
    if stale:
        print(f"stale: {', '.join(stale)}; run python {Path(__file__).name}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
