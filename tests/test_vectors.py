"""The shared test vectors (tests/vectors/) are what TensorFlow and mpspool/wire.py make today.

The Rust front door's own tests (`cargo test`: codec.rs, wire.rs) read the same files, so the
two sides of the wire cannot drift apart, and the front door cannot drift from TensorFlow's
parsing: make_vectors.py recomputes every expectation with TensorFlow's C++ parser
(`tf.io.parse_tensor`) and the Python protocol module, and the files must be unchanged.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

VECTORS = Path(__file__).resolve().parent / "vectors"
_spec = importlib.util.spec_from_file_location("make_vectors", VECTORS / "make_vectors.py")
assert _spec is not None and _spec.loader is not None
make_vectors = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_vectors)


@pytest.fixture(scope="module")
def built():
    return make_vectors.build()


def test_committed_vectors_are_what_tensorflow_and_wire_py_make_now(built):
    for path, text in make_vectors.files(built).items():
        assert path.read_text() == text, f"{path.name} is stale: run {make_vectors.__file__}"


def test_the_vectors_cover_every_rule(built):
    cases = built["tensor_proto"]
    names = " | ".join(c["name"] for c in cases)
    for rule in ("the last repeats", "zeros", "the first n", "another field", "tensor_content"):
        assert rule in names
    refused_by_tf = [c for c in cases if c["expect"].get("error") == ""]
    ours = [c for c in cases if c["ours"]]
    assert len(refused_by_tf) >= 50, "malformed protos TensorFlow refuses"
    assert len(ours) >= 16, "every dtype's declared-huge case, and the rest of our own rules"
    dtypes_seen = {c["expect"].get("dtype") for c in cases}
    assert len(dtypes_seen - {None}) == 16


def test_wire_vectors_decode_with_wire_py():
    from mpspool import wire

    vectors = json.loads((VECTORS / "wire.json").read_text())
    for case in vectors["requests"]:
        request = wire.unpack(bytes.fromhex(case["bytes"]))
        assert wire.kind_of(request) is wire.Kind.REQUEST
        assert {k: v for k, v in request.items() if k not in ("v", "k")} == case["fields"]
    kinds = [wire.kind_of(wire.unpack(bytes.fromhex(c["bytes"]))).value for c in vectors["worker"]]
    assert kinds == [c["kind"] for c in vectors["worker"]]
    values = wire.string_values(bytes.fromhex(vectors["strings"]["bytes"]))
    assert [v.hex() for v in values] == vectors["strings"]["values"]
