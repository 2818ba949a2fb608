"""Shared weights in-process: publishing a version's variables into a segment, binding a
SavedModel's variables to it without copying, refusing what cannot be shared, reporting
what TensorFlow copied, and removing segments a dead pool left behind.

Every segment a test makes lies in /dev/shm under a "mpspool-test-" name and is unlinked at
teardown (with its ".partial"), whatever the test's outcome.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import re
import secrets
import shutil
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mpspool import dtypes, process, segment
from mpspool.demo_model import demo_inputs
from mpspool.errors import Code, in_context, split_status_text
from mpspool.worker import runtime, tensor_bundle
from mpspool.worker.publish import OBJECT_GRAPH_KEY, PublishError, publish
from mpspool.worker.runtime import ModelLoadError, ModelRefused, ModelRuntime, load_saved_model
from mpspool.worker.shared_weights import resolve, unescape_name

from conftest import DEMO_ROWS
from poolproc import Pool

SIG = "serving_default"
EMBEDDING_KEY = "embedding/.ATTRIBUTES/VARIABLE_VALUE"
OUT_BIAS_KEY = "dense_layers/2/1/.ATTRIBUTES/VARIABLE_VALUE"  # the demo's last bias, shape [1]
DATA_FILE = "variables.data-00000-of-00001"


class Segments:
    """Fresh segment names under /dev/shm; all of them are unlinked by `remove_all`."""

    def __init__(self, shm_dir: Path = segment.SHM_DIR) -> None:
        self.shm_dir = shm_dir
        self.paths: list[Path] = []

    def new(self, name: str) -> Path:
        path = self.shm_dir / f"mpspool-test-{os.getpid()}-{secrets.token_hex(4)}-{name}"
        self.paths.append(path)
        return path

    def remove_all(self) -> None:
        for path in self.paths:
            path.unlink(missing_ok=True)
            _partial(path).unlink(missing_ok=True)


@pytest.fixture
def segments() -> Iterator[Segments]:
    made = Segments()
    yield made
    made.remove_all()


@pytest.fixture(scope="module")
def module_segments() -> Iterator[Segments]:
    made = Segments()
    yield made
    made.remove_all()


def _partial(path: Path) -> Path:
    return path.with_name(path.name + ".partial")


def _owner() -> tuple[int, float]:
    return os.getpid(), process.started_at(os.getpid())


def _publish(model_dir: Path, path: Path, name: str = "m") -> segment.Manifest:
    return publish(model_dir, name, 1, path, *_owner())


def _prefix(model_dir: Path) -> str:
    return str(model_dir / "variables" / "variables")


def _run(runtime: ModelRuntime, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return runtime.run(SIG, inputs, list(runtime.specs[SIG].outputs))


def _assert_identical(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert got.keys() == want.keys()
    for alias in want:
        assert got[alias].dtype == want[alias].dtype, alias
        assert np.array_equal(got[alias], want[alias]), alias


def _load_shared(model_dir: Path, path: Path, name: str = "m") -> ModelRuntime:
    runtime = load_saved_model(str(model_dir), name, 1, weights_segment=str(path))
    runtime.warm_up()
    return runtime


def _load_plain(model_dir: Path, name: str = "m") -> ModelRuntime:
    runtime = load_saved_model(str(model_dir), name, 1)
    runtime.warm_up()
    return runtime


def _bound_variable(runtime: Any, key: str) -> Any:
    """The variable of a shared runtime bound to checkpoint `key` (runtime internals)."""
    _, bound = runtime.shared
    (variable,) = [v for v, entry in bound.values() if entry.key == key]
    return variable


def _save(module: Any, path: Path) -> Path:
    import tensorflow as tf

    tf.saved_model.save(module, str(path), signatures={SIG: module.serve.get_concrete_function()})
    return path


# --- the demo model ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def demo_version(demo_model_dir: Path) -> Path:
    return demo_model_dir / "1"


@pytest.fixture(scope="module")
def demo_segment(demo_version: Path, module_segments: Segments) -> tuple[Path, segment.Manifest]:
    path = module_segments.new("demo")
    return path, _publish(demo_version, path, "demo")


@pytest.fixture(scope="module")
def plain_demo(demo_version: Path) -> ModelRuntime:
    return _load_plain(demo_version, "demo")


@pytest.fixture(scope="module")
def shared_demo(demo_version: Path, demo_segment: tuple[Path, segment.Manifest]) -> ModelRuntime:
    return _load_shared(demo_version, demo_segment[0], "demo")


# 1. publish


def test_publish_writes_a_private_aligned_segment(
    demo_segment: tuple[Path, segment.Manifest],
) -> None:
    path, manifest = demo_segment
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert not _partial(path).exists()
    assert segment.read_manifest(path) == manifest
    assert manifest.unshared == ()
    assert manifest.data_offset % segment.PAGE == 0
    assert all(t.offset % segment.ALIGN == 0 for t in manifest.tensors)
    assert path.stat().st_size == manifest.data_offset + manifest.data_bytes


def test_publish_copies_every_variable_byte_for_byte(
    demo_version: Path, demo_segment: tuple[Path, segment.Manifest]
) -> None:
    import tensorflow as tf

    path, manifest = demo_segment
    reader = tf.train.load_checkpoint(_prefix(demo_version))
    expected = set(reader.get_variable_to_shape_map()) - {OBJECT_GRAPH_KEY}
    assert {t.key for t in manifest.tensors} == expected
    data = path.read_bytes()
    for entry in manifest.tensors:
        want = reader.get_tensor(entry.key)
        assert entry.dtype == dtypes.dt_of_array(want), entry.key
        assert entry.shape == want.shape
        start = manifest.data_offset + entry.offset
        assert data[start : start + entry.nbytes] == want.tobytes(), entry.key


# 2. the checkpoint index


def test_read_index_agrees_with_the_checkpoint_reader(demo_version: Path) -> None:
    import tensorflow as tf

    shards, entries = tensor_bundle.read_index(_prefix(demo_version))
    assert shards == 1
    reader = tf.train.load_checkpoint(_prefix(demo_version))
    shapes = reader.get_variable_to_shape_map()
    dts = reader.get_variable_to_dtype_map()
    assert set(entries) - {OBJECT_GRAPH_KEY} == set(shapes) - {OBJECT_GRAPH_KEY}
    for key, entry in entries.items():
        if key == OBJECT_GRAPH_KEY:
            continue
        assert entry.dtype == dts[key].as_datatype_enum, key
        assert [d.size for d in entry.shape.dim] == shapes[key], key
        itemsize = dtypes.numpy_dtype(entry.dtype).itemsize
        assert entry.size == int(np.prod(shapes[key])) * itemsize, key
        assert entry.shard_id == 0
    data_size = (demo_version / "variables" / DATA_FILE).stat().st_size
    assert max(e.offset + e.size for e in entries.values()) <= data_size


@pytest.mark.parametrize(
    "content", [b"not an index", os.urandom(4096)], ids=["too-short", "bad-magic"]
)
def test_read_index_refuses_a_file_that_is_not_an_index(tmp_path: Path, content: bytes) -> None:
    (tmp_path / "variables.index").write_bytes(content)
    with pytest.raises(tensor_bundle.BundleError, match="index"):
        tensor_bundle.read_index(tmp_path / "variables")


# 3. shared load vs plain load


@pytest.mark.parametrize("batch", [1, 256])
def test_shared_load_is_bit_identical_to_plain_load(
    shared_demo: ModelRuntime, plain_demo: ModelRuntime, reference_model: Any, batch: int
) -> None:
    inputs = demo_inputs(batch, DEMO_ROWS, seed=batch)
    shared = _run(shared_demo, inputs)
    _assert_identical(shared, _run(plain_demo, inputs))
    assert np.array_equal(shared["score"], reference_model(**inputs)["score"].numpy())


def test_shared_load_reports_every_variable_shared(
    shared_demo: ModelRuntime, demo_segment: tuple[Path, segment.Manifest]
) -> None:
    path, manifest = demo_segment
    _run(shared_demo, demo_inputs(4, DEMO_ROWS))  # after real use too, not only warm-up
    assert shared_demo.weights_report() == {
        "segment": str(path),
        "shared_bytes": sum(t.nbytes for t in manifest.tensors),
        "copied": {},
        "on_device": {},
        "at_risk": {},
    }


def test_variables_a_gpu_holds_are_its_own_copies_not_refused_ones(
    shared_demo: ModelRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a GPU, TensorFlow places variables in device memory: binding one to the segment
    copies it there (MPS clients share no memory), which verify() called COPIED, and every
    GPU worker refused to serve (found by a review of the GPU paths). Such a variable is
    reported on the device and is no refusal. Only the DLPack device type is faked here
    (kDLCUDA, 2): no GPU TensorFlow runs on this machine; the host reading is the real one."""
    from mpspool.worker import shared_weights

    before = shared_demo.weights_report()
    real = shared_weights._buffer
    table = next(v for v, _ in shared_demo.shared[1].values() if v.shape.rank == 2)

    def on_gpu(tf: Any, variable: Any) -> tuple[int, int]:
        address, device = real(tf, variable)
        assert device == shared_weights.DLPACK_CPU  # what the real reading says here
        return (address, 2) if variable is table else (address, device)

    monkeypatch.setattr(shared_weights, "_buffer", on_gpu)
    report = shared_demo.weights_report()
    nbytes = table.shape.num_elements() * table.dtype.size
    assert report["on_device"] == {table.name: nbytes}
    assert report["copied"] == {}
    assert report["shared_bytes"] == before["shared_bytes"] - nbytes
    from mpspool import cli

    shared, on_gpu_size = cli._size(report["shared_bytes"]), cli._size(nbytes)
    assert cli._weights(report) == f"shared {shared}, GPU {on_gpu_size}"  # the status column


def test_plain_load_has_no_weights_report(plain_demo: ModelRuntime) -> None:
    assert plain_demo.weights_report() is None


def test_variables_take_their_values_from_the_segment(
    demo_version: Path, plain_demo: ModelRuntime, segments: Segments
) -> None:
    """Not from the checkpoint: a segment whose last bias was changed changes the scores."""
    path = segments.new("edited")
    manifest = _publish(demo_version, path, "demo")
    (entry,) = [t for t in manifest.tensors if t.key == OUT_BIAS_KEY]
    edit = np.memmap(
        path,
        dtype=np.float32,
        mode="r+",
        offset=manifest.data_offset + entry.offset,
        shape=entry.shape,
    )
    edit[...] = 1000.0  # sigmoid saturates: every score becomes exactly 1
    edit.flush()
    del edit
    inputs = demo_inputs(8, DEMO_ROWS)
    runtime = _load_shared(demo_version, path, "demo")
    assert np.array_equal(_run(runtime, inputs)["score"], np.ones((8, 1), np.float32))
    assert not np.array_equal(_run(plain_demo, inputs)["score"], np.ones((8, 1), np.float32))


# 4. copy-on-write


def test_a_write_to_a_shared_variable_stays_in_its_process(
    demo_version: Path, plain_demo: ModelRuntime, segments: Segments
) -> None:
    path = segments.new("cow-variable")
    _publish(demo_version, path, "demo")
    before = path.read_bytes()
    writer = _load_shared(demo_version, path, "demo")
    reader = _load_shared(demo_version, path, "demo")
    inputs = demo_inputs(16, DEMO_ROWS)

    # A write from Python lands in the eager variable; the session call (worker/session_call.py)
    # reads its own variable over the same pages, which such a write does not reach (a model
    # whose ops write is never called in a session), so the writer serves through the direct
    # call, which reads the eager variable.
    writer._sessions = dict.fromkeys(writer._sessions)  # type: ignore[attr-defined]
    assert writer.call_paths == {"serving_default": "direct"}  # type: ignore[attr-defined]
    _bound_variable(writer, OUT_BIAS_KEY).assign_add([5.0])

    assert not np.array_equal(_run(writer, inputs)["score"], _run(plain_demo, inputs)["score"])
    # TensorFlow writes to an adopted buffer by copying it first (2.21): the report says so.
    # A write into the mapping itself is the next test's.
    assert writer.weights_report()["copied"] == {"dense_2/bias:0": 4}
    _assert_identical(_run(reader, inputs), _run(plain_demo, inputs))
    assert path.read_bytes() == before


def test_a_write_through_one_mapping_is_invisible_to_another(
    demo_version: Path, segments: Segments
) -> None:
    path = segments.new("cow-view")
    manifest = _publish(demo_version, path, "demo")
    before = path.read_bytes()
    (entry,) = [t for t in manifest.tensors if t.key == EMBEDDING_KEY]
    first, second = segment.AttachedSegment(path), segment.AttachedSegment(path)
    original = second.view(entry).copy()

    first.view(entry)[...] = 7.0

    assert np.all(first.view(entry) == 7.0)
    assert np.array_equal(second.view(entry), original)
    assert np.array_equal(segment.AttachedSegment(path).view(entry), original)
    assert path.read_bytes() == before


# 5. a static vocabulary table (what keras StringLookup builds)


@pytest.fixture(scope="module")
def vocab_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import tensorflow as tf

    class Vocabulary(tf.Module):
        def __init__(self) -> None:
            super().__init__()
            words = tf.constant(["apple", "banana", "cherry"])
            self.vocabulary = tf.lookup.StaticHashTable(
                tf.lookup.KeyValueTensorInitializer(words, tf.constant([0, 1, 2], tf.int64)),
                default_value=3,
            )
            self.word_vectors = tf.Variable(
                np.arange(16, dtype=np.float32).reshape(4, 4), name="word_vectors"
            )

        @tf.function(input_signature=[tf.TensorSpec([None], tf.string, name="words")])
        def serve(self, words: tf.Tensor) -> dict[str, tf.Tensor]:
            ids = self.vocabulary.lookup(words)
            return {"ids": ids, "vectors": tf.gather(self.word_vectors.read_value(), ids)}

    return _save(Vocabulary(), tmp_path_factory.mktemp("vocab") / "1")


def test_a_static_hash_table_model_is_shared(vocab_model_dir: Path, segments: Segments) -> None:
    path = segments.new("vocab")
    manifest = _publish(vocab_model_dir, path)
    assert manifest.unshared == ()
    shared = _load_shared(vocab_model_dir, path)
    plain = _load_plain(vocab_model_dir)
    inputs = {"words": np.array([b"cherry", b"durian", b"apple", b"banana"], dtype=object)}

    got = _run(shared, inputs)

    _assert_identical(got, _run(plain, inputs))
    assert got["ids"].tolist() == [2, 3, 0, 1]
    assert np.array_equal(
        got["vectors"], np.arange(16, dtype=np.float32).reshape(4, 4)[[2, 3, 0, 1]]
    )
    assert shared.weights_report()["copied"] == {}
    assert shared.weights_report()["shared_bytes"] == 64


# 6. a mutable table: its contents are checkpointed state that cannot be shared


@pytest.fixture(scope="module")
def mutable_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import tensorflow as tf

    class Counts(tf.Module):
        def __init__(self) -> None:
            super().__init__()
            self.user_counts = tf.lookup.experimental.MutableHashTable(
                tf.string, tf.int64, default_value=-1
            )
            self.user_counts.insert(tf.constant(["ann", "bob"]), tf.constant([3, 5], tf.int64))
            self.scale = tf.Variable([2.0], name="scale")

        @tf.function(input_signature=[tf.TensorSpec([None], tf.string, name="users")])
        def serve(self, users: tf.Tensor) -> dict[str, tf.Tensor]:
            counts = tf.cast(self.user_counts.lookup(users), tf.float32)
            return {"scaled": counts * self.scale}

    return _save(Counts(), tmp_path_factory.mktemp("mutable") / "1")


def test_publish_lists_a_mutable_tables_contents_as_unshared(
    mutable_model_dir: Path, segments: Segments
) -> None:
    manifest = _publish(mutable_model_dir, segments.new("mutable-publish"))
    assert manifest.unshared == (
        "user_counts/.ATTRIBUTES/table-keys",
        "user_counts/.ATTRIBUTES/table-values",
    )
    assert [t.key for t in manifest.tensors] == ["scale/.ATTRIBUTES/VARIABLE_VALUE"]


def test_a_mutable_table_model_is_refused_with_shared_weights(
    mutable_model_dir: Path, segments: Segments
) -> None:
    path = segments.new("mutable")
    _publish(mutable_model_dir, path)
    with pytest.raises(ModelRefused) as info:  # by the pool's settings: no retry helps
        load_saved_model(str(mutable_model_dir), "m", 1, weights_segment=str(path))
    message = str(info.value)
    assert re.search(r"\buser_counts\b(?!/)", message), message  # the object, not only its keys
    assert "--no-share-weights" in message


def test_a_version_whose_graph_changed_since_it_was_published_is_refused_as_such(
    tmp_path: Path, demo_version: Path, segments: Segments
) -> None:
    """A version folder replaced under the same number (a ConfigMap's ..data swap) while
    its segment serves: a worker started later read the new graph and bound it to the old
    weights, and the error blamed the checkpoint for a shape the segment holds (found by an
    operator test). The manifest keeps the published graph's digest; the worker compares."""
    from mpspool.demo_model import build_demo_model

    version = tmp_path / "m" / "1"
    shutil.copytree(demo_version, version)
    path = segments.new("swapped")
    manifest = _publish(version, path)
    assert len(manifest.extra["graph_sha256"]) == 64
    smaller = build_demo_model(tmp_path / "new", embedding_rows=DEMO_ROWS // 2)
    shutil.copy(smaller / "saved_model.pb", version / "saved_model.pb")
    with pytest.raises(ModelLoadError, match=r"saved_model\.pb changed since the pool published"):
        load_saved_model(str(version), "m", 1, weights_segment=str(path), work_dir=str(tmp_path))


def test_a_pool_refused_by_its_settings_fails_its_start_without_retries(
    tmp_path: Path, mutable_model_dir: Path
) -> None:
    """The same model in a pool: its worker exits as refused (3), is FATAL at once and the
    start fails with the worker's words, instead of three load retries with back-off (about
    40 s) that could only be refused the same way."""
    pool = Pool(tmp_path, mutable_model_dir.parent, 1, "--start-retries", "3").start()
    try:
        assert pool.proc is not None
        assert pool.proc.wait(60) == 1, pool.output()
        output = pool.output()
        assert "STARTING -> FATAL" in output and "BACKOFF" not in output, output
        assert "--no-share-weights" in output.strip().splitlines()[-1], output
    finally:
        pool.kill()


def test_a_mutable_table_model_loads_plainly(mutable_model_dir: Path) -> None:
    plain = _load_plain(mutable_model_dir)
    got = _run(plain, {"users": np.array([b"bob", b"eve", b"ann"], dtype=object)})
    assert got["scaled"].tolist() == [10.0, -2.0, 6.0]


# 7. a gather straight on a variable: rewritten at load (worker/gather_rewrite.py), so that
# TensorFlow's ResourceGather does not copy the variable out of the segment


@pytest.fixture(scope="module")
def gather_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import tensorflow as tf

    class Lookup(tf.Module):
        def __init__(self) -> None:
            super().__init__()
            self.item_embedding = tf.Variable(
                np.arange(40, dtype=np.float32).reshape(10, 4), name="item_embedding"
            )
            self.offset = tf.Variable(np.full(4, 0.5, np.float32), name="offset")

        @tf.function(input_signature=[tf.TensorSpec([None], tf.int64, name="ids")])
        def serve(self, ids: tf.Tensor) -> dict[str, tf.Tensor]:
            # ResourceGather on the variable itself, not on its value.
            return {"vectors": tf.nn.embedding_lookup(self.item_embedding, ids) + self.offset}

    return _save(Lookup(), tmp_path_factory.mktemp("gather") / "1")


def test_a_gather_on_a_variable_stays_shared(
    gather_model_dir: Path, segments: Segments, tmp_path: Path
) -> None:
    path = segments.new("gather")
    manifest = _publish(gather_model_dir, path)
    sizes = {t.key.split("/")[0]: t.nbytes for t in manifest.tensors}
    # What a killed worker left (its process ended) is removed; a live one's copy is not.
    ended = subprocess.Popen(["true"])
    ended.wait()
    left = tmp_path / f"model-{ended.pid}-abc" / "1"
    live = tmp_path / "model-1-def" / "1"
    for copy in (left, live):
        copy.mkdir(parents=True)
        (copy / "saved_model.pb").write_bytes(b"x")
    shared = load_saved_model(
        str(gather_model_dir), "m", 1, weights_segment=str(path), work_dir=str(tmp_path)
    )
    assert not left.parent.exists() and live.exists()
    live.parent.rename(tmp_path / "live-copy")
    assert shared.weights_report()["copied"] == {}

    shared.warm_up()

    report = shared.weights_report()
    assert report["copied"] == {}
    assert report["shared_bytes"] == sizes["item_embedding"] + sizes["offset"]
    # The rewritten copy lives in the work dir, linking to the original's files.
    (rewritten,) = tmp_path.glob(f"model-{os.getpid()}-*/1")
    assert (rewritten / "variables").is_symlink()
    ids = {"ids": np.array([9, 0, 3, 3], np.int64)}
    got = _run(shared, ids)
    _assert_identical(got, _run(_load_plain(gather_model_dir), ids))
    want = np.arange(40, dtype=np.float32).reshape(10, 4)[[9, 0, 3, 3]] + np.float32(0.5)
    assert np.array_equal(got["vectors"], want)


@pytest.mark.parametrize("declared", [[None, 16], None], ids=["a dimension open", "no rank"])
def test_a_variable_declared_with_an_open_shape_is_shared(
    declared: list[int | None] | None, segments: Segments, tmp_path: Path
) -> None:
    """`tf.Variable(..., shape=[None, 16])` (a table that grows between exports) holds what
    its checkpoint holds: bound to the segment, no copy, the plain load's answers. It was
    refused ("float32[None, 16] but the checkpoint holds float[1000, 16]"), and one of no
    rank crashed the load (found by a hunt)."""
    import tensorflow as tf

    rng = np.random.default_rng(9)

    class Table(tf.Module):
        def __init__(self) -> None:
            self.emb = tf.Variable(
                rng.standard_normal((1000, 16)).astype(np.float32),
                shape=tf.TensorShape(declared),
                name="emb",
            )
            self.w = tf.Variable(rng.standard_normal((16, 2)).astype(np.float32), name="w")

        @tf.function(input_signature=[tf.TensorSpec([None], tf.int64, name="ids")])
        def serve(self, ids: tf.Tensor) -> dict[str, tf.Tensor]:
            rows = tf.reshape(tf.gather(self.emb, ids % 1000), [-1, 16])
            return {"out": rows @ self.w}

    table = Table()
    model_dir = tmp_path / "table"
    tf.saved_model.save(table, str(model_dir), signatures={SIG: table.serve})
    path = segments.new("open")
    _publish(model_dir, path)
    shared = _load_shared(model_dir, path)
    assert shared.weights_report()["copied"] == {}
    ids = {"ids": np.array([3, 999, 1000, 7], np.int64)}
    _assert_identical(_run(shared, ids), _run(_load_plain(model_dir), ids))


def test_a_checkpoint_stored_in_slices_is_published_slice_by_slice(
    segments: Segments, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A TF2 checkpoint saved with a shard size policy stores a big variable as slices across
    shards (some of them slices of an inner dimension): each is read from its shard into its
    place, checked, with no TensorFlow. TensorFlow's reader assembled a fresh copy of each
    variable instead (a 1 GiB table: a 2.9 GiB publisher; found by a hunt)."""
    import tensorflow as tf
    from tensorflow.python.checkpoint.sharding import sharding_policies

    from mpspool.worker import publish as publish_module

    rng = np.random.default_rng(1)

    class Wide(tf.Module):
        def __init__(self) -> None:
            self.emb = tf.Variable(rng.standard_normal((1000, 16)).astype(np.float32))
            self.wide = tf.Variable(rng.standard_normal((3, 7000)).astype(np.float32))

        @tf.function(input_signature=[tf.TensorSpec([None], tf.int64, name="ids")])
        def serve(self, ids: tf.Tensor) -> dict[str, tf.Tensor]:
            rows = tf.gather(self.emb, ids % 1000)
            return {"rows": rows, "wide": tf.gather(self.wide, ids % 3)}

    wide = Wide()
    model_dir = tmp_path / "sliced"
    policy = sharding_policies.MaxShardSizePolicy(max_shard_size=20_000)
    options = tf.saved_model.SaveOptions(experimental_sharding_callback=policy)
    tf.saved_model.save(wide, str(model_dir), signatures={SIG: wide.serve}, options=options)
    prefix = _prefix(model_dir)
    _, entries = tensor_bundle.read_index(prefix)
    pieces = [p for e in entries.values() for p in e.slices]
    assert any(len(p.extent) > 1 and p.extent[1].HasField("length") for p in pieces)
    assert len(tensor_bundle.read_slices(prefix)) == len(pieces)

    def no_tensorflow(*args: Any) -> None:
        raise AssertionError("read through TensorFlow's reader")

    monkeypatch.setattr(publish_module, "_read_through_tensorflow", no_tensorflow)
    path = segments.new("sliced")
    _publish(model_dir, path)
    shared = _load_shared(model_dir, path)
    assert shared.weights_report()["copied"] == {}
    ids = {"ids": np.array([0, 999, 5, 1001], np.int64)}
    _assert_identical(_run(shared, ids), _run(_load_plain(model_dir), ids))


# 8. checkpoint keys to objects


@pytest.mark.parametrize(
    ("escaped", "name"),
    [("a..S", "a.S"), ("a.Sb", "a/b"), ("plain", "plain"), ("x..y.Sz", "x.y/z"), ("", "")],
)
def test_unescape_name(escaped: str, name: str) -> None:
    assert unescape_name(escaped) == name


def test_resolve_finds_variables_and_nothing_else(shared_demo: Any) -> None:
    import tensorflow as tf

    loaded = shared_demo._loaded
    embedding = resolve(loaded, EMBEDDING_KEY)
    assert isinstance(embedding, tf.Variable) and embedding.name == "embedding:0"
    assert resolve(loaded, OUT_BIAS_KEY).name == "dense_2/bias:0"
    assert resolve(loaded, "no_such_object/.ATTRIBUTES/VARIABLE_VALUE") is None
    assert resolve(loaded, "embedding/no_such_child/.ATTRIBUTES/VARIABLE_VALUE") is None
    assert resolve(loaded, "table/.ATTRIBUTES/table-keys") is None
    assert resolve(loaded, OBJECT_GRAPH_KEY) is None


# 9. space and stale segments


def test_check_space_refuses_an_impossible_segment() -> None:
    with pytest.raises(segment.SegmentError, match="shared memory too small: need") as info:
        segment.check_space(1 << 62)
    assert "/dev/shm" in str(info.value)
    # GetModelStatus says RESOURCE_EXHAUSTED for the version it held back (it said UNKNOWN;
    # found by a hunt).
    assert info.value.code is Code.RESOURCE_EXHAUSTED


def test_a_segment_that_no_longer_fits_is_refused_before_it_is_written(
    shm_subdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Room taken by another /dev/shm user after the check: the writer's allocation says
    so, where writing through the mapping was a SIGBUS that killed the publisher with nothing
    said (found by an operator test). Bigger than the whole of /dev/shm, so that the kernel
    refuses it before allocating a page."""
    monkeypatch.setattr(segment, "check_space", lambda need, shm_dir=None: None)
    floats = (shutil.disk_usage(shm_subdir).total + (1 << 30)) // 4
    manifest = segment.plan("m", 1, os.getpid(), time.time(), [("w", dtypes.DT_FLOAT, (floats,))])
    path = shm_subdir / "mpspool-p-m-v1"
    with pytest.raises(segment.SegmentError, match="shared memory too small: need") as info:
        segment.SegmentWriter(path, manifest)
    assert info.value.code is Code.RESOURCE_EXHAUSTED
    assert list(shm_subdir.iterdir()) == [], "nothing left behind"


@pytest.mark.parametrize(
    ("text", "code", "message"),
    [
        ("DATA_LOSS: the shard ends in bias", Code.DATA_LOSS, "the shard ends in bias"),
        ("checkpoint: no code", Code.UNKNOWN, "checkpoint: no code"),
        ("OK: not a failure's code", Code.UNKNOWN, "OK: not a failure's code"),
        ("NOT_FOUND:no space after", Code.UNKNOWN, "NOT_FOUND:no space after"),
    ],
)  # fmt: skip
def test_a_reason_put_in_context_keeps_its_code_first(text: str, code: Code, message: str) -> None:
    """ "publishing the weights failed: " put before "DATA_LOSS: ..." hid the code from the
    front door, which read UNKNOWN (found by a hunt): the context goes after the code."""
    assert split_status_text(text) == (code, message)
    said = in_context("publishing the weights failed: ", text)
    assert split_status_text(said) == (code, f"publishing the weights failed: {message}")


@pytest.fixture
def shm_subdir() -> Iterator[Path]:
    """A private directory in /dev/shm, so that remove_stale sees only this test's files.
    Its own name does not start with "mpspool-": a pool's remove_stale must not meet it."""
    path = Path(f"/dev/shm/mpspool_test_dir-{os.getpid()}-{secrets.token_hex(4)}")
    path.mkdir(mode=0o700)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _tiny_segment(
    path: Path, owner_pid: int, owner_started: float, commit: bool = True, pid_ns: int = 0
) -> Path:
    manifest = segment.plan("m", 1, owner_pid, owner_started, [("w", dtypes.DT_FLOAT, (4,))])
    if pid_ns:
        manifest = dataclasses.replace(manifest, owner_pid_ns=pid_ns)
    writer = segment.SegmentWriter(path, manifest)
    writer.view("w")[...] = 1.0
    if commit:
        return writer.commit()
    # Leave the ".partial" behind, as a publisher killed mid-write would: its lock goes too.
    writer._map.close()
    os.close(writer._held)
    return _partial(path)


def test_a_removed_segment_is_restored_from_its_hold(shm_subdir: Path) -> None:
    """The controller's hold keeps a removed segment's content: `restore` writes it back,
    byte for byte and private, and holds the new file; with no room it says so and leaves
    nothing behind."""
    path = _tiny_segment(shm_subdir / "mpspool-p-m-v1", os.getpid(), time.time())
    content = path.read_bytes()
    held = segment.hold(path)
    try:
        assert not segment.removed(held)
        path.unlink()
        assert segment.removed(held)
        restored = segment.restore(held, path)
        try:
            assert path.read_bytes() == content
            assert stat.S_IMODE(path.stat().st_mode) == 0o600
            assert not segment.removed(restored) and segment.held(path)
        finally:
            os.close(restored)
        path.unlink()
        (shm_subdir / "mpspool-p-m-v1.partial").mkdir()  # in the way: the copy cannot start
        with pytest.raises(segment.SegmentError, match="cannot write"):
            segment.restore(held, path)
        assert sorted(p.name for p in shm_subdir.iterdir()) == ["mpspool-p-m-v1.partial"]
    finally:
        os.close(held)


def test_a_segment_that_cannot_be_created_or_put_in_place_says_so_and_leaves_nothing(
    shm_subdir: Path, demo_version: Path
) -> None:
    """Its name taken (another publisher's ".partial", a user's file), or its place taken
    when it is renamed in: a SegmentError naming the segment. The first escaped as a bare
    OSError (the publisher died with a traceback, "exit code 1"), the second read "cannot
    read the checkpoint" (found by a review)."""
    manifest = segment.plan("m", 1, *_owner(), [("w", dtypes.DT_FLOAT, (4,))])
    path = shm_subdir / "mpspool-p-m-v1"
    _partial(path).write_bytes(b"someone else's")
    with pytest.raises(segment.SegmentError, match=r"cannot create weight segment .*\.partial"):
        segment.SegmentWriter(path, manifest)
    assert _partial(path).read_bytes() == b"someone else's"  # not theirs to remove
    _partial(path).unlink()
    (path / "in the way").mkdir(parents=True)  # a non-empty directory at its name
    with pytest.raises(segment.SegmentError, match="cannot publish weight segment"):
        _publish(demo_version, path)
    assert sorted(p.name for p in shm_subdir.iterdir()) == [path.name], "its .partial went"


def test_a_publisher_failing_in_a_way_no_check_foresaw_says_why_with_its_code(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """An exception no check names (an IndexError from a SavedModel malformed in a new way)
    ends the publisher with its fatal line, type and message (UNKNOWN): it ended in a
    bare traceback, which the controller read as "exit code 1" (found by a review)."""
    from mpspool.config import PoolConfig
    from mpspool.worker import publish as publish_module

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    PoolConfig(
        model_name="m", model_base_path=str(tmp_path / "m"), model_version=1,
        run_dir=str(run_dir), log_dir=str(tmp_path / "logs"), workers=1,
    ).save(run_dir)  # fmt: skip

    def malformed(*args: Any) -> None:
        raise IndexError("list index out of range")

    monkeypatch.setattr(publish_module, "publish", malformed)
    monkeypatch.setattr(process, "die_with_parent", lambda *_: None)
    # Not pytest's own SIGTERM handler to be replaced (the publisher's ends it).
    monkeypatch.setattr(publish_module.signal, "signal", lambda *_: None)
    with pytest.raises(SystemExit) as ended:
        publish_module.main(["--run-dir", str(run_dir)])
    assert ended.value.code == process.EXIT_LOAD_FAILED
    reason = process.fatal_reason(capsys.readouterr().err)
    # UNKNOWN is left unsaid (errors.status_text): a reason without a code is UNKNOWN.
    assert reason == (
        "publishing the weights of model 'm' failed: IndexError: list index out of range"
    )


@pytest.mark.parametrize(
    "manifest",
    [b"", b"[" * 100_000 + b"]" * 100_000, b"1", b'"x"', b"null", b'{"tensors": [{"key": 1}]}'],
    ids=["length past its end", "deep", "a number", "a string", "null", "a tensor of no shape"],
)
def test_a_stray_file_with_a_segments_magic_is_refused_not_raised(
    shm_subdir: Path, manifest: bytes
) -> None:
    """A file with the magic and a manifest length of 2**63, or a manifest nested deeper
    than the JSON parser goes: read_manifest says it is no segment it can read, and
    remove_stale goes on (it raised OverflowError or RecursionError, which the controller's
    start did not catch: no pool could start; found by a review)."""
    stray = shm_subdir / "mpspool-test-stray"
    length = 2**63 if not manifest else len(manifest)
    stray.write_bytes(segment.MAGIC + length.to_bytes(8, "little") + manifest)
    with pytest.raises(segment.SegmentError, match=r"cannot read weight segment|runs past"):
        segment.read_manifest(stray)
    os.utime(stray, (0, 0))  # old: a file no manifest names an owner of is stale
    assert segment.remove_stale(shm_subdir) == [stray]


def test_a_stray_manifest_naming_its_owner_in_other_types_is_stale(shm_subdir: Path) -> None:
    """A manifest that reads, its owner's start time a string: no live owner, not a
    TypeError out of remove_stale (found by a review)."""
    fields = json.loads(segment.plan("m", 1, os.getpid(), 0.0, []).to_json())
    raw = json.dumps({**fields, "owner_started": "x"}).encode()
    stray = shm_subdir / "mpspool-test-stray"
    stray.write_bytes(segment.MAGIC + len(raw).to_bytes(8, "little") + raw)
    os.utime(stray, (0, 0))
    assert segment.remove_stale(shm_subdir) == [stray]


def test_remove_stale_removes_only_what_a_dead_owner_left(shm_subdir: Path) -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # reaped: its pid names no process (or, reused, one with another start time)
    # Its owner in this PID namespace and dead: removed at once (a pool killed and started
    # again gets its memory back at once).
    dead = _tiny_segment(shm_subdir / "mpspool-test-dead", child.pid, time.time())
    dead_partial = _tiny_segment(
        shm_subdir / "mpspool-test-dead-half", child.pid, time.time(), commit=False
    )
    mine = _tiny_segment(shm_subdir / "mpspool-test-mine", *_owner())
    mine_partial = _tiny_segment(shm_subdir / "mpspool-test-mine-half", *_owner(), commit=False)
    unrelated = shm_subdir / "someone-else"
    unrelated.write_bytes(b"")
    assert sorted(segment.remove_stale(shm_subdir)) == sorted([dead, dead_partial])
    # No manifest to name an owner: removed once old, unless held.
    garbage = shm_subdir / "mpspool-test-garbage"
    garbage.write_bytes(b"this is no weight segment")
    empty = shm_subdir / "mpspool-test-empty"
    empty.touch()
    # A pool in another PID namespace (containers sharing /dev/shm): its owner's pid names
    # nothing here. Its controller holds its segment, its publisher one it writes; and one
    # just written may be between its publisher's end and its controller's hold.
    other_ns = segment.pid_namespace() + 1
    foreign = _tiny_segment(
        shm_subdir / "mpspool-test-foreign", child.pid, time.time(), pid_ns=other_ns
    )
    foreign_hold = segment.hold(foreign)
    manifest = segment.plan("m", 1, child.pid, time.time(), [("w", dtypes.DT_FLOAT, (4,))])
    manifest = dataclasses.replace(manifest, owner_pid_ns=other_ns)
    writing = segment.SegmentWriter(shm_subdir / "mpspool-test-foreign-half", manifest)
    young = _tiny_segment(
        shm_subdir / "mpspool-test-foreign-young", child.pid, time.time(), pid_ns=other_ns
    )
    assert segment.remove_stale(shm_subdir) == []
    old = time.time() - segment.STALE_MIN_AGE_S - 1
    for path in (garbage, empty, foreign, writing._tmp):
        os.utime(path, (old, old))

    removed = segment.remove_stale(shm_subdir)

    assert sorted(removed) == sorted([garbage, empty])
    assert sorted(p.name for p in shm_subdir.iterdir()) == sorted(
        [mine.name, mine_partial.name, unrelated.name, foreign.name, writing._tmp.name, young.name]
    )
    # Let go (the controller stopped; the publisher was killed): stale from then on, and the
    # young one once old.
    os.close(foreign_hold)
    writing.abort()
    os.utime(young, (old, old))
    assert sorted(segment.remove_stale(shm_subdir)) == sorted([foreign, young])


def _waiting_for(path: Path) -> threading.Thread:
    """A thread in a worker's wait for the weights published into ``path``."""
    thread = threading.Thread(target=runtime._wait_for_publisher, args=(path,), daemon=True)
    thread.start()
    return thread


def test_a_worker_waits_for_a_publish_as_long_as_its_pool_lives(
    shm_subdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A large model's publish may take many minutes: the wait has no deadline of its own
    (it had 600 s, after which the workers started beside the publisher failed). Here each
    reading of the clock is 1000 s after the last, and the wait goes on while the partial
    segment's owner lives; it ends once the segment is renamed into place."""
    monkeypatch.setattr(runtime, "PUBLISH_POLL_S", 0.005)
    final = shm_subdir / "mpspool-test-slow"
    partial = _tiny_segment(final, *_owner(), commit=False)
    checks = []
    alive = segment.owner_alive
    monkeypatch.setattr(segment, "owner_alive", lambda m: checks.append(m) or alive(m))
    real_clock = time.monotonic
    clock = itertools.count(0.0, 1000.0)
    monkeypatch.setattr(time, "monotonic", lambda: next(clock))
    thread = _waiting_for(final)
    deadline = real_clock() + 30
    while len(checks) < 20 and thread.is_alive() and real_clock() < deadline:
        time.sleep(0.01)
    assert thread.is_alive(), "the wait ended before the segment was published"
    assert len(checks) >= 20, "20 owner checks: 20,000 s on the wait's clock"
    partial.rename(final)
    thread.join(5)
    assert not thread.is_alive()


def test_a_worker_stops_waiting_when_the_partial_segment_is_removed(shm_subdir: Path) -> None:
    """The controller's cleanup of a failed publish removes the ".partial"; the worker then
    finds no segment (AttachedSegment says so) instead of waiting."""
    final = shm_subdir / "mpspool-test-failed"
    partial = _tiny_segment(final, *_owner(), commit=False)
    thread = _waiting_for(final)
    thread.join(0.2)
    assert thread.is_alive()
    partial.unlink()
    thread.join(5)
    assert not thread.is_alive()


def test_a_worker_stops_waiting_for_a_publish_whose_pool_is_gone(
    shm_subdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(runtime, "PUBLISH_OWNER_CHECK_S", 0.05)
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    final = shm_subdir / "mpspool-test-orphan"
    partial = _tiny_segment(final, child.pid, time.time(), commit=False)
    thread = _waiting_for(final)
    thread.join(5)
    assert not thread.is_alive(), "still waiting for a publisher whose pool is gone"
    assert partial.exists() and not final.exists()


# 10. a damaged checkpoint


@pytest.fixture
def damaged_copy(demo_version: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "1"
    shutil.copytree(demo_version, copy)
    return copy


def test_publish_refuses_a_truncated_data_file(damaged_copy: Path, segments: Segments) -> None:
    data = damaged_copy / "variables" / DATA_FILE
    os.truncate(data, data.stat().st_size // 2)
    path = segments.new("truncated")
    with pytest.raises(PublishError, match="ends inside") as info:
        _publish(damaged_copy, path)
    assert info.value.code == Code.DATA_LOSS  # GetModelStatus's code for the version
    assert not path.exists()
    assert not _partial(path).exists()


@pytest.mark.parametrize("kept", [0.5, 0.0], ids=["half of it", "created, nothing written"])
def test_publish_refuses_a_saved_model_pb_still_being_copied(
    damaged_copy: Path, segments: Segments, kept: float
) -> None:
    """Half a saved_model.pb, or one created and not yet written (`cp` makes it first; an
    empty file parses, with no graph), is DATA_LOSS, as TensorFlow's loader says of it, and
    no segment: it was published, its digest recorded, and the workers that read the whole
    file later were refused as a re-push (found by a hunt and a review)."""
    graph = damaged_copy / "saved_model.pb"
    os.truncate(graph, int(graph.stat().st_size * kept))
    path = segments.new("half-graph")
    with pytest.raises(PublishError, match=r"unreadable saved model .*saved_model\.pb") as info:
        _publish(damaged_copy, path)
    assert info.value.code == Code.DATA_LOSS
    assert not path.exists() and not _partial(path).exists()


def test_publish_of_a_folder_without_a_saved_model_is_not_found(
    tmp_path: Path, segments: Segments
) -> None:
    """A folder gone (or never there) is NOT_FOUND in TensorFlow's loader's words, and no
    segment: it was published empty, once per try, before its workers failed to load it
    (found by a review)."""
    path = segments.new("no-model")
    with pytest.raises(PublishError, match=r"Could not find SavedModel \.pb or \.pbtxt") as info:
        _publish(tmp_path / "gone", path)
    assert info.value.code == Code.NOT_FOUND
    assert str(tmp_path / "gone") in str(info.value)
    assert not path.exists() and not _partial(path).exists()


def test_slices_that_do_not_tile_their_variable_go_to_tensorflows_reader(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Slices read one by one must cover their variable once, within its bounds: a part no
    slice covers was left zero and served (found by a review). Else TensorFlow's reader,
    which refuses them, is asked."""
    from mpspool.protos import tensorflow_pb2 as pb
    from mpspool.worker import publish as publish_module

    def piece(*extents: tuple[int, int] | None) -> Any:
        proto = pb.TensorSliceProto()
        for extent in extents:
            added = proto.extent.add()
            if extent is not None:
                added.start, added.length = extent
        return proto

    tile = publish_module._tile
    assert tile([piece((0, 5), None), piece((5, 5), None)], (10, 4))
    assert tile([piece((0, 10), (0, 2)), piece((0, 10), (2, 2))], (10, 4))
    assert not tile([piece((0, 5), None)], (10, 4)), "rows 5-9 covered by none"
    assert not tile([piece((0, 6), None), piece((4, 6), None)], (10, 4)), "overlapping"
    assert not tile([piece((-3, 1), None), piece((0, 9), None)], (10, 4)), "out of bounds"
    assert not tile([piece((0, 10))], (10, 4)), "another rank"
    assert not tile([piece((0, 5), None, None), piece((5, 5), None, None)], (10, 4))


# Found by these tests and fixed: corrupt data, missing shards, odd object graphs, bfloat16,
# odd files in /dev/shm, truncated and misaligned segments.


def test_publish_refuses_a_corrupted_data_file(damaged_copy: Path, segments: Segments) -> None:
    import tensorflow as tf

    _, entries = tensor_bundle.read_index(_prefix(damaged_copy))
    data = damaged_copy / "variables" / DATA_FILE
    raw = bytearray(data.read_bytes())
    raw[entries[EMBEDDING_KEY].offset + 100] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(tf.errors.DataLossError):  # what a plain load does
        tf.saved_model.load(str(damaged_copy))
    path = segments.new("corrupted")
    with pytest.raises(PublishError) as info:
        _publish(damaged_copy, path)
    assert info.value.code == Code.DATA_LOSS  # as TensorFlow's DataLossError above
    assert not path.exists()
    assert not _partial(path).exists()


def test_publish_refuses_a_missing_data_file(damaged_copy: Path, segments: Segments) -> None:
    (damaged_copy / "variables" / DATA_FILE).unlink()
    path = segments.new("missing")
    try:
        with pytest.raises(PublishError) as info:
            _publish(damaged_copy, path)
        assert info.value.code == Code.NOT_FOUND
    finally:
        assert not path.exists()
        assert not _partial(path).exists()


@pytest.fixture(scope="module")
def dict_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import tensorflow as tf

    class Named(tf.Module):
        def __init__(self) -> None:
            super().__init__()
            # Checkpoint keys "by_name/a..b/...", "by_name/c.Sd/...", "by_name/items/...".
            self.by_name = {
                "a.b": tf.Variable([2.0], name="a_b"),
                "c/d": tf.Variable([3.0], name="c_d"),
                "items": tf.Variable([4.0], name="items"),
            }

        @tf.function(input_signature=[tf.TensorSpec([None], tf.float32, name="x")])
        def serve(self, x: tf.Tensor) -> dict[str, tf.Tensor]:
            named = self.by_name
            return {"y": x * named["a.b"] + named["c/d"] * named["items"]}

    return _save(Named(), tmp_path_factory.mktemp("named") / "1")


def test_variables_in_a_dict_with_escaped_and_shadowing_keys_are_shared(
    dict_model_dir: Path, segments: Segments
) -> None:
    path = segments.new("named")
    _publish(dict_model_dir, path)
    shared = _load_shared(dict_model_dir, path)
    x = {"x": np.array([1.0, -1.0], np.float32)}
    assert _run(shared, x)["y"].tolist() == [14.0, 10.0]
    assert shared.weights_report()["copied"] == {}


def test_resolve_returns_none_for_a_list_index_out_of_range(shared_demo: Any) -> None:
    assert resolve(shared_demo._loaded, "dense_layers/7/0/.ATTRIBUTES/VARIABLE_VALUE") is None


@pytest.fixture(scope="module")
def bfloat16_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import tensorflow as tf

    class Half(tf.Module):
        def __init__(self) -> None:
            super().__init__()
            self.table = tf.Variable(tf.constant([1.5, -2.0, 3.25], tf.bfloat16), name="table")

        @tf.function(input_signature=[tf.TensorSpec([None], tf.int64, name="ids")])
        def serve(self, ids: tf.Tensor) -> dict[str, tf.Tensor]:
            return {"values": tf.cast(tf.gather(self.table.read_value(), ids), tf.float32)}

    return _save(Half(), tmp_path_factory.mktemp("bfloat16") / "1")


def test_a_bfloat16_variable_is_shared(bfloat16_model_dir: Path, segments: Segments) -> None:
    path = segments.new("bfloat16")
    _publish(bfloat16_model_dir, path)
    shared = _load_shared(bfloat16_model_dir, path)
    got = _run(shared, {"ids": np.array([2, 0, 1], np.int64)})
    assert got["values"].tolist() == [3.25, 1.5, -2.0]
    assert shared.weights_report()["copied"] == {}


def test_remove_stale_skips_what_is_not_a_plain_file(shm_subdir: Path) -> None:
    directory = shm_subdir / "mpspool-test-a-directory"
    directory.mkdir()
    garbage = shm_subdir / "mpspool-test-garbage"
    garbage.write_bytes(b"junk")
    assert segment.remove_stale(shm_subdir, min_age_s=0) == [garbage]
    assert directory.is_dir()


def test_a_truncated_segment_is_refused(demo_version: Path, segments: Segments) -> None:
    path = segments.new("short")
    _publish(demo_version, path, "demo")
    os.truncate(path, path.stat().st_size - 4096)
    with pytest.raises(ModelLoadError, match="weights"):
        load_saved_model(str(demo_version), "demo", 1, weights_segment=str(path))


def test_a_misaligned_segment_is_refused_or_copied(
    vocab_model_dir: Path, segments: Segments
) -> None:
    import dataclasses

    path = segments.new("misaligned")
    good = _publish(vocab_model_dir, path)
    path.unlink()
    (entry,) = good.tensors
    manifest = dataclasses.replace(good, tensors=(dataclasses.replace(entry, offset=4),))
    writer = segment.SegmentWriter(path, manifest)
    writer.view(entry.key)[...] = np.arange(16, dtype=np.float32).reshape(4, 4)
    writer.commit()
    try:
        runtime = load_saved_model(str(vocab_model_dir), "m", 1, weights_segment=str(path))
    except ModelLoadError:
        return  # refused: fine
    # Bound anyway: only safe to run if the variable no longer reads the misaligned bytes.
    assert runtime.weights_report()["copied"] == {"word_vectors:0": 64}
    got = _run(runtime, {"words": np.array([b"banana"], dtype=object)})
    assert got["vectors"].tolist() == [[4.0, 5.0, 6.0, 7.0]]


def test_a_clock_step_does_not_make_a_live_owner_look_dead(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """psutil's create_time() is the boot time as the wall clock has it plus the process's
    start: after a clock step (NTP at boot, a VM resumed) a live pool's controller and a
    segment's owner read as ended, `mpspool stop` found no pool and `start` asked for the
    live one's processes to be ended (found by a hunt). Identity is the start in ticks since
    boot now; the step is made here as the kernel would report it to psutil."""
    import psutil._pslinux

    from mpspool import rundir

    me = {"pid": os.getpid(), "started": process.started_at(os.getpid())}
    manifest = segment.plan("m", 1, me["pid"], me["started"], [])
    assert rundir.controller_alive(me) and segment.owner_alive(manifest)
    real = psutil._pslinux.boot_time
    for step in (3600.0, -3600.0, 2.0):
        monkeypatch.setattr(psutil._pslinux, "boot_time", lambda step=step: real() + step)
        assert rundir.controller_alive(me), step
        assert segment.owner_alive(manifest), step
    # Another process's start, or none, is still told apart.
    assert not rundir.controller_alive({**me, "started": me["started"] - 5})
    assert not segment.owner_alive(segment.plan("m", 1, 2**22 + 7, 0.0, []))
    # What an mpspool before this one wrote (psutil's seconds since the epoch) still names
    # its live pool: one upgraded in place while it runs is not taken for gone.
    monkeypatch.setattr(psutil._pslinux, "boot_time", real)
    epoch = psutil.Process().create_time()
    assert rundir.controller_alive({**me, "started": epoch})
    assert segment.owner_alive(segment.plan("m", 1, me["pid"], epoch, []))
    assert not rundir.controller_alive({**me, "started": epoch - 5})


def test_identical_variables_are_published_once_and_counted_once(
    tmp_path: Path, segments: Segments
) -> None:
    """Two variables of the same values share one region of the segment: `shared_bytes`
    counts it once (it said twice the segment's size; found by a hunt)."""
    import tensorflow as tf

    values = np.arange(24, dtype=np.float32).reshape(6, 4)

    class Twins(tf.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = tf.Variable(values, name="a")
            self.b = tf.Variable(values.copy(), name="b")

        @tf.function(input_signature=[tf.TensorSpec([None], tf.int64, name="ids")])
        def serve(self, ids: tf.Tensor) -> dict[str, tf.Tensor]:
            return {"y": tf.gather(self.a, ids) - 2 * tf.gather(self.b, ids)}

    model_dir = _save(Twins(), tmp_path / "twins" / "1")
    path = segments.new("twins")
    manifest = _publish(model_dir, path)
    assert manifest.data_bytes == values.nbytes, "published once"
    shared = _load_shared(model_dir, path)
    ids = {"ids": np.array([5, 0], dtype=np.int64)}
    _assert_identical(_run(shared, ids), _run(_load_plain(model_dir), ids))
    report = shared.weights_report()
    assert report["copied"] == {} and report["shared_bytes"] == values.nbytes, report
