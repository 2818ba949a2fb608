"""Shared weights hold for the ways people export models, not only for the demo.

Each style below is built by the test (small tables, so the suite stays fast), published into a
weight segment and loaded by the worker runtime with its variables bound to the segment; after
warm-up no variable may have been copied out of it, and the answers must equal a plain
TensorFlow load's. Then every style is served by a real pool (one pool, a model each, one of
them on two workers) and answered through the official TF Serving client, compared with a
direct TensorFlow call of the same SavedModel.

The styles: `tf.nn.embedding_lookup(var, ids)`, `tf.gather(var, ids)`,
`tf.gather(var.read_value(), ids)`, a gather with `batch_dims`, `tf.gather_nd(var, ...)`, a table
split into several variables, a `tf.lookup.StaticHashTable` vocabulary (string input) in front
of the embedding, a bfloat16 table, a table read densely as well (a matmul over all of it), a
Keras 3 functional model with `keras.layers.Embedding` exported with `model.export()`, and a TF1
graph (SavedModelBuilder) with a vocabulary file in its assets.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from mpspool import process, segment
from mpspool.errors import Code
from mpspool.worker.publish import PublishError, publish
from mpspool.worker.runtime import ModelRefused, load_saved_model

from poolproc import Pool, mpspool_cmd

# The segments' owner as a pool's controller names itself: this process, by its start time.
# A start time of 0 named no live process, so a pool started meanwhile on the machine (a
# test beside these) took their segments for a dead pool's and removed them.
OWNER = (os.getpid(), process.started_at(os.getpid()))

SIG = "serving_default"
ROWS, DIM = 50, 8


def _tf() -> Any:
    import tensorflow as tf

    return tf


def _table(seed: int, rows: int = ROWS, dim: int = DIM) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, dim)).astype(np.float32)


def _save_tf1(session: Any, path: Path, inputs: dict, outputs: dict, **extra: Any) -> None:
    """The graph of ``session`` as a TF1 SavedModel (a Builder's, tag "serve") with one
    predict signature."""
    v1 = _tf().compat.v1
    builder = v1.saved_model.Builder(str(path))
    builder.add_meta_graph_and_variables(
        session,
        ["serve"],
        signature_def_map={SIG: v1.saved_model.predict_signature_def(inputs, outputs)},
        **extra,
    )
    builder.save()


def _save_module(module: Any, path: Path) -> None:
    tf = _tf()
    tf.saved_model.save(module, str(path), signatures={SIG: module.serve.get_concrete_function()})


def _ids(batch: int = 3, width: int = 4) -> np.ndarray:
    return np.random.default_rng(batch).integers(0, ROWS, (batch, width), dtype=np.int64)


# -- the styles: each builds its SavedModel version directory and gives example inputs ------
def embedding_lookup(path: Path) -> dict[str, np.ndarray]:
    tf = _tf()

    class M(tf.Module):
        def __init__(self) -> None:
            self.table = tf.Variable(_table(1), name="table")

        @tf.function(input_signature=[tf.TensorSpec([None, None], tf.int64, name="ids")])
        def serve(self, ids):
            return {"out": tf.reduce_mean(tf.nn.embedding_lookup(self.table, ids), axis=1)}

    _save_module(M(), path)
    return {"ids": _ids()}


def gather_on_variable(path: Path) -> dict[str, np.ndarray]:
    tf = _tf()

    class M(tf.Module):
        def __init__(self) -> None:
            self.table = tf.Variable(_table(2), name="table")

        @tf.function(input_signature=[tf.TensorSpec([None], tf.int64, name="ids")])
        def serve(self, ids):
            return {"out": tf.gather(self.table, ids) * 2.0}

    _save_module(M(), path)
    return {"ids": np.array([0, 49, 7, 7], np.int64)}


def gather_on_value(path: Path) -> dict[str, np.ndarray]:
    tf = _tf()

    class M(tf.Module):
        def __init__(self) -> None:
            self.table = tf.Variable(_table(3), name="table")

        @tf.function(input_signature=[tf.TensorSpec([None], tf.int64, name="ids")])
        def serve(self, ids):
            return {"out": tf.gather(self.table.read_value(), ids)}

    _save_module(M(), path)
    return {"ids": np.array([1, 2, 3], np.int64)}


def gather_batch_dims(path: Path) -> dict[str, np.ndarray]:
    tf = _tf()

    class M(tf.Module):
        def __init__(self) -> None:
            # One small table per "user slot": [4, ROWS, DIM], gathered per row (batch_dims=1).
            self.tables = tf.Variable(np.stack([_table(10 + i) for i in range(4)]), name="tables")

        @tf.function(input_signature=[tf.TensorSpec([4, None], tf.int32, name="ids")])
        def serve(self, ids):
            return {"out": tf.gather(self.tables, ids, axis=1, batch_dims=1)}

    _save_module(M(), path)
    return {"ids": np.random.default_rng(5).integers(0, ROWS, (4, 3), dtype=np.int32)}


def gather_nd_on_variable(path: Path) -> dict[str, np.ndarray]:
    tf = _tf()

    class M(tf.Module):
        def __init__(self) -> None:
            self.table = tf.Variable(_table(4), name="table")

        @tf.function(input_signature=[tf.TensorSpec([None, 2], tf.int64, name="coords")])
        def serve(self, coords):
            return {"out": tf.gather_nd(self.table, coords)}

    _save_module(M(), path)
    return {"coords": np.array([[0, 0], [49, 7], [3, 5]], np.int64)}


def split_table(path: Path) -> dict[str, np.ndarray]:
    tf = _tf()

    class M(tf.Module):
        def __init__(self) -> None:
            whole = _table(5, rows=48)
            self.shards = [
                tf.Variable(part, name=f"shard_{i}") for i, part in enumerate(np.split(whole, 3))
            ]

        @tf.function(input_signature=[tf.TensorSpec([None, None], tf.int64, name="ids")])
        def serve(self, ids):
            return {"out": tf.reduce_sum(tf.nn.embedding_lookup(self.shards, ids), axis=1)}

    _save_module(M(), path)
    return {"ids": np.random.default_rng(6).integers(0, 48, (3, 5), dtype=np.int64)}


def vocabulary_lookup(path: Path) -> dict[str, np.ndarray]:
    tf = _tf()
    words = [f"w{i}".encode() for i in range(ROWS - 1)]

    class M(tf.Module):
        def __init__(self) -> None:
            self.vocab = tf.lookup.StaticHashTable(
                tf.lookup.KeyValueTensorInitializer(
                    tf.constant(words), tf.range(1, ROWS, dtype=tf.int64)
                ),
                default_value=0,  # out-of-vocabulary → row 0
            )
            self.table = tf.Variable(_table(7), name="table")

        @tf.function(input_signature=[tf.TensorSpec([None], tf.string, name="words")])
        def serve(self, words):
            return {"out": tf.nn.embedding_lookup(self.table, self.vocab.lookup(words))}

    _save_module(M(), path)
    return {"words": np.array([b"w3", b"nope", b"w48"], dtype=object)}


def tf1_graph(path: Path) -> dict[str, np.ndarray]:
    """A TF1 SavedModel (graph, Session, SavedModelBuilder): a vocabulary file in assets/
    feeding a lookup table, tf.nn.embedding_lookup on a resource variable, a dense read of the
    whole table too."""
    tf = _tf()
    v1 = tf.compat.v1
    vocab = path.parent / "vocab.txt"
    vocab.parent.mkdir(parents=True, exist_ok=True)
    vocab.write_text("".join(f"w{i}\n" for i in range(ROWS)))
    with tf.Graph().as_default():
        table = v1.get_variable("table", initializer=_table(14), use_resource=True)
        words = v1.placeholder(tf.string, [None], name="words")
        ids = tf.lookup.StaticHashTable(
            tf.lookup.TextFileInitializer(
                str(vocab), tf.string, tf.lookup.TextFileIndex.WHOLE_LINE,
                tf.int64, tf.lookup.TextFileIndex.LINE_NUMBER,
            ),
            default_value=0,
        ).lookup(words)  # fmt: skip
        rows = tf.nn.embedding_lookup(table, ids)
        out = rows + tf.reduce_sum(tf.matmul(table, table, transpose_a=True))
        with v1.Session() as session:
            session.run([v1.global_variables_initializer(), v1.tables_initializer()])
            _save_tf1(
                session,
                path,
                {"words": words},
                {"out": out},
                assets_collection=v1.get_collection(v1.GraphKeys.ASSET_FILEPATHS),
                main_op=v1.tables_initializer(),
            )
    vocab.unlink()  # the model must read its own copy in assets/
    return {"words": np.array([b"w3", b"nope", b"w49"], dtype=object)}


def string_variable(path: Path) -> dict[str, np.ndarray]:
    """A tf.string variable (names for the ids) beside a float table: the segment carries
    numbers only, so each worker restores the strings from the checkpoint itself."""
    tf = _tf()

    class M(tf.Module):
        def __init__(self) -> None:
            self.table = tf.Variable(_table(16), name="table")
            self.names = tf.Variable([f"name{i}".encode() for i in range(ROWS)], name="names")

        @tf.function(input_signature=[tf.TensorSpec([None, None], tf.int64, name="ids")])
        def serve(self, ids):
            return {
                "out": tf.reduce_mean(tf.nn.embedding_lookup(self.table, ids), axis=1),
                "names": tf.gather(self.names, ids),
            }

    _save_module(M(), path)
    return {"ids": _ids()}


def tf1_no_variables(path: Path) -> dict[str, np.ndarray]:
    """A TF1 SavedModel of a graph without variables (parse-and-compute, or a frozen graph):
    the Builder leaves variables/ empty, and TensorFlow's loader restores nothing."""
    tf = _tf()
    v1 = tf.compat.v1
    with tf.Graph().as_default():
        x = v1.placeholder(tf.float32, [None, 2], name="x")
        out = tf.matmul(x, tf.constant([[1.0, 2.0], [3.0, 4.0]])) + 0.5
        with v1.Session() as session:
            _save_tf1(session, path, {"x": x}, {"out": out})
    assert not (path / "variables" / "variables.index").exists()
    return {"x": np.array([[1.0, 2.0], [-3.0, 0.25]], dtype=np.float32)}


def bfloat16_table(path: Path) -> dict[str, np.ndarray]:
    tf = _tf()

    class M(tf.Module):
        def __init__(self) -> None:
            self.table = tf.Variable(tf.cast(_table(8), tf.bfloat16), name="table")

        @tf.function(input_signature=[tf.TensorSpec([None], tf.int64, name="ids")])
        def serve(self, ids):
            return {"out": tf.cast(tf.nn.embedding_lookup(self.table, ids), tf.float32)}

    _save_module(M(), path)
    return {"ids": np.array([4, 0, 31], np.int64)}


def dense_and_sparse(path: Path) -> dict[str, np.ndarray]:
    tf = _tf()

    class M(tf.Module):
        def __init__(self) -> None:
            self.table = tf.Variable(_table(9), name="table")

        @tf.function(
            input_signature=[
                tf.TensorSpec([None], tf.int64, name="ids"),
                tf.TensorSpec([None, DIM], tf.float32, name="query"),
            ]
        )
        def serve(self, ids, query):
            scores = tf.matmul(query, self.table, transpose_b=True)  # every row, densely
            return {"scores": scores, "rows": tf.nn.embedding_lookup(self.table, ids)}

    _save_module(M(), path)
    return {
        "ids": np.array([2, 9], np.int64),
        "query": np.random.default_rng(9).standard_normal((2, DIM)).astype(np.float32),
    }


def keras_export(path: Path) -> dict[str, np.ndarray]:
    import keras

    ids = keras.Input(shape=(4,), dtype="int64", name="ids")
    dense = keras.Input(shape=(3,), dtype="float32", name="features")
    pooled = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(ROWS, DIM)(ids))
    hidden = keras.layers.Dense(5, activation="relu")(keras.layers.Concatenate()([pooled, dense]))
    model = keras.Model(inputs=[ids, dense], outputs=keras.layers.Dense(1)(hidden))
    model.export(str(path), verbose=False)
    return {"ids": _ids(2), "features": np.ones((2, 3), np.float32)}


STYLES: dict[str, Callable[[Path], dict[str, np.ndarray]]] = {
    "embedding_lookup": embedding_lookup,
    "gather_on_variable": gather_on_variable,
    "gather_on_value": gather_on_value,
    "gather_batch_dims": gather_batch_dims,
    "gather_nd": gather_nd_on_variable,
    "split_table": split_table,
    "vocabulary": vocabulary_lookup,
    "bfloat16": bfloat16_table,
    "dense_and_sparse": dense_and_sparse,
    "keras_export": keras_export,
    "tf1_graph": tf1_graph,
    "tf1_no_variables": tf1_no_variables,
    "string_variable": string_variable,
}


@pytest.fixture(scope="module")
def zoo(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict[str, np.ndarray]]]:
    """style → (model base path, example inputs); each built once, as version 1."""
    built = {}
    for name, build in STYLES.items():
        base = tmp_path_factory.mktemp(name)
        built[name] = (base, build(base / "1"))
    return built


def _direct(version_dir: Path, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """What TensorFlow itself answers, the SavedModel loaded plainly."""
    tf = _tf()
    function = tf.saved_model.load(str(version_dir)).signatures[SIG]
    result = function(**{k: tf.constant(v) for k, v in inputs.items()})
    return {k: v.numpy() for k, v in result.items()}


def _same(got: np.ndarray, want: np.ndarray, alias: str) -> None:
    if want.dtype == object:  # strings
        np.testing.assert_array_equal(got, want, err_msg=alias)
    else:
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6, err_msg=alias)


@pytest.fixture
def segment_path() -> Iterator[Path]:
    path = segment.SHM_DIR / f"mpspool-test-{os.getpid()}-{secrets.token_hex(4)}-zoo"
    yield path
    path.unlink(missing_ok=True)
    path.with_name(path.name + ".partial").unlink(missing_ok=True)


@pytest.mark.parametrize("style", list(STYLES))
def test_worker_runtime_serves_each_style_without_copying(
    style: str, zoo, segment_path: Path, tmp_path: Path
) -> None:
    base, inputs = zoo[style]
    manifest = publish(base / "1", style, 1, segment_path, *OWNER)
    runtime = load_saved_model(
        str(base / "1"), style, 1, weights_segment=str(segment_path), work_dir=str(tmp_path)
    )
    runtime.warm_up()
    # Every style runs in a session on the worker's thread (worker/session_call.py) but the
    # two whose graphs hold a lookup table (initialized in the eager context) and the one
    # with a variable the segment does not carry (restored in the worker), which run on
    # TensorFlow's eager C API (worker/direct_call.py); checked against the keyword call at
    # warm-up and here against plain TensorFlow. (The TF1 graph without variables ran there
    # too until its session had nothing to assign: found by a hunt.)
    direct = ("vocabulary", "tf1_graph", "string_variable")
    path = "direct" if style in direct else "session"
    assert runtime.call_paths == dict.fromkeys(runtime.specs, path)
    got = runtime.run(SIG, inputs, list(runtime.specs[SIG].outputs))
    report = runtime.weights_report()
    assert report["copied"] == {}, f"{style}: TensorFlow copied {report['copied']}"
    assert report["at_risk"] == {}, f"{style}: {report['at_risk']}"
    assert report["shared_bytes"] == sum(t.nbytes for t in manifest.tensors)
    want = _direct(base / "1", inputs)
    assert got.keys() == want.keys()
    for alias in want:
        _same(got[alias], want[alias], alias)


def test_a_keras_export_publishes_what_its_signatures_read(zoo, segment_path: Path) -> None:
    """Keras 3 checkpoints each variable under `_all_variables/N` and `variables/M`, and they
    load as two variables; the signatures capture one of each pair, so only those are in
    /dev/shm (the other list serves nothing)."""
    base, _ = zoo["keras_export"]
    manifest = publish(base / "1", "k", 1, segment_path, *OWNER)
    keys = sorted(t.key for t in manifest.tensors)
    assert keys and all(k.startswith("variables/") for k in keys), keys
    assert [t.shape for t in manifest.tensors].count((ROWS, DIM)) == 1


def test_state_no_signature_reads_is_left_out_not_refused(
    tmp_path: Path, segment_path: Path
) -> None:
    """An adapted Keras lookup layer keeps its adapt state (token counts) in a mutable table
    that the checkpoint saves and no serving signature reads; a tf.Module may keep such a
    table too. Both were refused as state that would be lost (found by a hunt of model
    exports); they are left out as unread optimizer state is, and serve as TensorFlow does.
    A mutable table a signature does read is still refused, by name."""
    import keras

    tf = _tf()
    lookup = keras.layers.StringLookup()
    lookup.adapt(np.array(["red", "green", "blue", "red"]))
    color = keras.Input(shape=(), dtype="string", name="color")
    out = keras.layers.Dense(1)(keras.layers.Embedding(lookup.vocabulary_size(), 2)(lookup(color)))
    adapted = tmp_path / "adapted" / "1"
    keras.Model(color, out).export(str(adapted), verbose=False)
    inputs = {"color": np.array([b"red", b"blue", b"purple"], object)}

    class Unread(tf.Module):
        def __init__(self) -> None:
            self.table = tf.Variable(_table(23), name="table")
            self.seen = tf.lookup.experimental.MutableHashTable(tf.int64, tf.int64, -1)
            self.seen.insert(tf.constant([1, 2], tf.int64), tf.constant([5, 6], tf.int64))

        @tf.function(input_signature=[tf.TensorSpec([None], tf.int64, name="ids")])
        def serve(self, ids):
            return {"out": tf.gather(self.table, ids)}

        @tf.function(input_signature=[tf.TensorSpec([None], tf.int64, name="ids")])
        def read(self, ids):
            return {"out": self.seen.lookup(ids)}

    unread = Unread()
    unread_dir = tmp_path / "unread" / "1"
    tf.saved_model.save(unread, str(unread_dir), signatures={SIG: unread.serve})
    read_dir = tmp_path / "read" / "1"
    tf.saved_model.save(unread, str(read_dir), signatures={SIG: unread.read})
    for n, (version, example) in enumerate(
        [(adapted, inputs), (unread_dir, {"ids": np.array([1, 2], np.int64)})]
    ):
        segment = segment_path.with_name(f"{segment_path.name}-{n}")
        try:
            publish(version, "m", 1, segment, *OWNER)
            runtime = load_saved_model(
                str(version), "m", 1, weights_segment=str(segment), work_dir=str(tmp_path / "w")
            )
            runtime.warm_up()
            got = runtime.run(SIG, example, list(_direct(version, example)))
            for alias, want in _direct(version, example).items():
                _same(got[alias], want, alias)
            assert runtime.weights_report()["copied"] == {}
        finally:
            segment.unlink(missing_ok=True)
    publish(read_dir, "m", 1, segment_path, *OWNER)
    with pytest.raises(ModelRefused, match="checkpointed state other than variables"):
        load_saved_model(
            str(read_dir), "m", 1, weights_segment=str(segment_path), work_dir=str(tmp_path / "w")
        )
    # Read as the model loads: a static table filled from the mutable one by its initializer,
    # which no signature captures (it was left out, and the model answered -1 for every id).
    from tensorflow.python.ops import lookup_ops

    class FromMutable(lookup_ops.TableInitializerBase):
        def __init__(self, source: Any) -> None:
            self.source = source
            super().__init__(tf.int64, tf.int64)

        def initialize(self, table: Any) -> Any:
            keys, values = self.source.export()
            # With a fixed entry: importing nothing is an error, which would end the load
            # before the choice tested here.
            keys = tf.concat([tf.constant([0], tf.int64), keys], 0)
            values = tf.concat([tf.constant([0], tf.int64), values], 0)
            return lookup_ops.gen_lookup_ops.lookup_table_import_v2(
                table.resource_handle, keys, values
            )

    class Initialized(tf.Module):
        def __init__(self) -> None:
            self.seen = tf.lookup.experimental.MutableHashTable(tf.int64, tf.int64, -1)
            self.seen.insert(tf.constant([1, 2], tf.int64), tf.constant([5, 6], tf.int64))
            self.static = tf.lookup.StaticHashTable(FromMutable(self.seen), -1)

        @tf.function(input_signature=[tf.TensorSpec([None], tf.int64, name="ids")])
        def serve(self, ids):
            return {"out": self.static.lookup(ids)}

    initialized = Initialized()
    initialized_dir = tmp_path / "initialized" / "1"
    tf.saved_model.save(initialized, str(initialized_dir), signatures={SIG: initialized.serve})
    segment_path.unlink(missing_ok=True)
    publish(initialized_dir, "m", 1, segment_path, *OWNER)
    with pytest.raises(ModelRefused, match=r"silently lost\): seen \(seen/"):
        load_saved_model(
            str(initialized_dir), "m", 1, weights_segment=str(segment_path),
            work_dir=str(tmp_path / "w"),
        )  # fmt: skip


def test_a_tf1_model_of_reference_variables_is_refused_saying_so(
    tmp_path: Path, segment_path: Path
) -> None:
    """TF1's default variables (VariableV2, without use_resource) cannot read from shared
    memory: refused naming them, a partitioned one's parts too, where the reason given was a
    lookup table's contents, a renamed Saver or a slice of no variable (found by a hunt of
    model exports and a review). Built in a process of its own: TF1 behaviour is switched on
    for a whole process."""
    version = tmp_path / "ref" / "1"
    build = f"""
import numpy as np, tensorflow as tf
tf.compat.v1.disable_v2_behavior()
tf.compat.v1.disable_resource_variables()
with tf.Graph().as_default():
    x = tf.compat.v1.placeholder(tf.float32, [None, 3], name="x")
    w = tf.compat.v1.get_variable("W", initializer=tf.ones([3, 2]))
    e = tf.compat.v1.get_variable(
        "E", shape=[10, 2], initializer=tf.compat.v1.ones_initializer(),
        partitioner=tf.compat.v1.fixed_size_partitioner(2),
    )
    y = x @ w + tf.reduce_sum(tf.nn.embedding_lookup(e, [1, 7]))
    with tf.compat.v1.Session() as session:
        session.run(tf.compat.v1.global_variables_initializer())
        tf.compat.v1.saved_model.simple_save(session, {str(version)!r}, {{"x": x}}, {{"y": y}})
"""
    subprocess.run([sys.executable, "-c", build], check=True, capture_output=True, timeout=120)
    publish(version, "m", 1, segment_path, *OWNER)
    refused = r"variables E/part_0, E/part_1, W are reference variables \(VariableV2"
    with pytest.raises(ModelRefused, match=refused):
        load_saved_model(
            str(version), "m", 1, weights_segment=str(segment_path), work_dir=str(tmp_path / "w")
        )


def test_identical_tensors_are_published_once(tmp_path: Path, segment_path: Path) -> None:
    tf = _tf()

    class Twins(tf.Module):
        def __init__(self) -> None:
            self.a = tf.Variable(_table(12), name="a")
            self.b = tf.Variable(_table(12), name="b")  # the same bytes

        @tf.function(input_signature=[tf.TensorSpec([None], tf.int64, name="ids")])
        def serve(self, ids):
            return {"out": tf.gather(self.a, ids) - 2.0 * tf.gather(self.b, ids)}

    _save_module(Twins(), tmp_path / "1")
    manifest = publish(tmp_path / "1", "t", 1, segment_path, *OWNER)
    a, b = (t for t in manifest.tensors if t.shape == (ROWS, DIM))
    assert a.offset == b.offset
    runtime = load_saved_model(
        str(tmp_path / "1"), "t", 1, weights_segment=str(segment_path), work_dir=str(tmp_path)
    )
    runtime.warm_up()
    got = runtime.run(SIG, {"ids": np.array([3, 4], np.int64)}, ["out"])["out"]
    np.testing.assert_array_equal(got, -_table(12)[[3, 4]])
    assert runtime.weights_report()["copied"] == {}


def test_a_checkpoint_without_its_index_is_refused_naming_it(
    zoo, segment_path: Path, tmp_path: Path
) -> None:
    """Only a SavedModel with nothing in variables/ has no variables (an empty segment);
    data shards without their index are a broken checkpoint, said as such."""
    base, _ = zoo["embedding_lookup"]
    broken = tmp_path / "1"
    shutil.copytree(base / "1", broken)
    (broken / "variables" / "variables.index").unlink()
    with pytest.raises(PublishError, match=r"variables\.index") as info:
        publish(broken, "broken", 1, segment_path, *OWNER)
    assert info.value.code == Code.NOT_FOUND  # the files that are not there


def test_a_tf1_checkpoint_tensor_that_is_no_variable_is_refused(
    tmp_path: Path, segment_path: Path
) -> None:
    """A TF1 MutableHashTable's contents are saved as plain tensors ("<table>-keys",
    "<table>-values"): no graph variable takes them, so sharing would lose them."""
    tf = _tf()
    v1 = tf.compat.v1
    version = tmp_path / "m" / "1"
    with tf.Graph().as_default():
        table = v1.get_variable("table", initializer=_table(15), use_resource=True)
        # int64 → int64: its saved contents are numeric tensors, as a variable's are
        counts = tf.lookup.experimental.MutableHashTable(tf.int64, tf.int64, 0, name="counts")
        insert = counts.insert(tf.constant([7], tf.int64), tf.constant([3], tf.int64))
        words = v1.placeholder(tf.int64, [None], name="words")
        out = tf.nn.embedding_lookup(table, counts.lookup(words))
        with v1.Session() as session:
            session.run([v1.global_variables_initializer(), insert])
            _save_tf1(session, version, {"words": words}, {"out": out})
    manifest = publish(version, "m", 1, segment_path, *OWNER)
    assert "table" in {t.key for t in manifest.tensors}
    with pytest.raises(Exception, match=r"tensor counts-keys is no variable of the TF1 graph"):
        load_saved_model(
            str(version), "m", 1, weights_segment=str(segment_path), work_dir=str(tmp_path / "w")
        )


@pytest.mark.parametrize("axis", [0, 1])
def test_a_tf1_partitioned_variable_is_shared_part_by_part(
    tmp_path: Path, segment_path: Path, axis: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A TF1 estimator's embedding split by a partitioner is saved whole under its own name
    ("emb", in slices), its graph variables are the parts ("emb/part_0", ...). Each part is
    published on its own (aligned) and bound to its variable, along either axis; the answers
    are plain TensorFlow's and nothing is copied. It was refused, as a lookup table's
    contents (found by a user test)."""
    tf = _tf()
    v1 = tf.compat.v1
    version = tmp_path / "m" / "1"
    with tf.Graph().as_default():
        emb = v1.get_variable(
            "emb",
            shape=[10, 6],
            partitioner=v1.fixed_size_partitioner(3, axis=axis),
            use_resource=True,
        )
        table = _table(16, rows=10, dim=6)
        fill = []  # each part its slice of the table, as its SaveSliceInfo places it
        for part in emb:
            info = part._save_slice_info
            where = zip(info.var_offset, info.var_shape, strict=True)
            fill.append(part.assign(table[tuple(slice(o, o + n) for o, n in where)]))
        ids = v1.placeholder(tf.int64, [None], name="ids")
        out = tf.nn.embedding_lookup(emb, ids) if axis == 0 else tf.gather(tf.concat(
            list(emb), axis=1), ids)  # fmt: skip
        with v1.Session() as session:
            session.run(v1.global_variables_initializer())
            session.run(fill)
            _save_tf1(session, version, {"ids": ids}, {"out": out})
    # Each part read from its shard as a slice, not assembled by TensorFlow's reader (which
    # made the publisher import TensorFlow: 30 s at a busy start; found by a hunt).
    from mpspool.worker import publish as publish_module

    def no_tensorflow(*args: Any) -> None:
        raise AssertionError("read through TensorFlow's reader")

    monkeypatch.setattr(publish_module, "_read_through_tensorflow", no_tensorflow)
    manifest = publish(version, "m", 1, segment_path, *OWNER)
    assert len(manifest.tensors) == 3
    assert all(t.key.startswith("emb@10 6 ") for t in manifest.tensors)
    runtime = load_saved_model(
        str(version), "m", 1, weights_segment=str(segment_path), work_dir=str(tmp_path / "w")
    )
    runtime.warm_up()
    inputs = {"ids": np.array([9, 0, 4, 7], np.int64)}
    got = runtime.run(SIG, inputs, ["out"])["out"]
    np.testing.assert_array_equal(got, _table(16, rows=10, dim=6)[[9, 0, 4, 7]])
    report = runtime.weights_report()
    assert report["copied"] == {}
    assert report["shared_bytes"] == 10 * 6 * 4


def test_a_worker_loads_while_the_weights_are_still_being_published(
    zoo, segment_path: Path, tmp_path: Path
) -> None:
    """A worker started beside the publisher (cold start overlapped) imports TensorFlow and
    loads the graph, then waits for the segment while its ".partial" is being written."""
    import threading
    import time

    base, inputs = zoo["embedding_lookup"]
    finished = segment_path.with_name(segment_path.name + "-done")
    partial = segment_path.with_name(segment_path.name + ".partial")
    try:
        publish(base / "1", "m", 1, finished, *OWNER)
        partial.write_bytes(b"")  # the publisher at work

        def publisher_finishes() -> None:
            time.sleep(1.0)
            os.rename(finished, segment_path)
            partial.unlink()

        thread = threading.Thread(target=publisher_finishes)
        started = time.monotonic()
        thread.start()
        runtime = load_saved_model(
            str(base / "1"), "m", 1, weights_segment=str(segment_path), work_dir=str(tmp_path)
        )
        thread.join()
        assert time.monotonic() - started >= 1.0
        runtime.warm_up()
        assert runtime.weights_report()["copied"] == {}
        got = runtime.run(SIG, inputs, ["out"])
        np.testing.assert_allclose(got["out"], _direct(base / "1", inputs)["out"], atol=1e-6)
    finally:
        finished.unlink(missing_ok=True)
        partial.unlink(missing_ok=True)


def test_an_out_of_range_id_keeps_tensorflows_error(zoo, segment_path: Path, tmp_path: Path):
    from mpspool.errors import ServingError

    base, _ = zoo["gather_on_variable"]
    publish(base / "1", "g", 1, segment_path, *OWNER)
    runtime = load_saved_model(
        str(base / "1"), "g", 1, weights_segment=str(segment_path), work_dir=str(tmp_path)
    )
    runtime.warm_up()
    with pytest.raises(ServingError) as caught:
        runtime.run(SIG, {"ids": np.array([ROWS + 5], np.int64)}, ["out"])
    assert caught.value.code is Code.INVALID_ARGUMENT
    assert f"indices[0] = {ROWS + 5} is not in [0, {ROWS})" in caught.value.message
    assert runtime.weights_report()["copied"] == {}


# The styles whose difference lies in publishing and loading only (the runtime test above
# covers both) are left out.
POOLED = [s for s in STYLES if s not in ("tf1_no_variables", "string_variable")]
# The style two workers serve (the others one each): a segment both map without copying.
TWO_WORKERS = "keras_export"


@pytest.fixture(scope="module")
def zoo_pool(zoo, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    """One pool serving every pooled style as a model of one model config file: a pool per
    style cost CI ~8.5 s each, mostly its processes starting, for nothing more."""
    from google.protobuf import text_format
    from tensorflow_serving.config import model_server_config_pb2

    tmp = tmp_path_factory.mktemp("zoopool")
    config = model_server_config_pb2.ModelServerConfig()
    for style in POOLED:
        config.model_config_list.config.add(name=style, base_path=str(zoo[style][0]))
    config_file = tmp / "models.config"
    config_file.write_text(text_format.MessageToString(config))
    pool = Pool(tmp, zoo[POOLED[0]][0], 1, "--model-workers", f"{TWO_WORKERS}=2")
    at = pool.args.index("--model-base-path")
    pool.args[at : at + 4] = ["--model_config_file", str(config_file)]  # names: the file's
    pool.start()
    try:
        pool.wait_ready(len(POOLED) + 1, timeout=240)
        yield pool
        assert pool.stop() == 0
        assert pool.leftovers() == []
    finally:
        pool.kill()


@pytest.mark.parametrize("style", POOLED)
def test_a_pool_serves_each_style_shared(style: str, zoo, zoo_pool: Pool) -> None:
    """The official client against a real pool: the answers TensorFlow gives, no copies."""
    import tensorflow as tf
    from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc

    base, inputs = zoo[style]
    # The pool's first model is its default: its slots carry no model name.
    slots = [
        s
        for s in zoo_pool.status()["slots"]
        if (s["model"] or POOLED[0]) == style and s["state"] == "READY"
    ]
    assert len(slots) == (2 if style == TWO_WORKERS else 1), slots
    segments = set()
    for slot in slots:
        weights = slot["weights"]
        assert weights and weights["copied"] == {}, slot
        segments.add(weights["segment"])
    assert len(segments) == 1, "the workers of a version map one segment"
    request = predict_pb2.PredictRequest()
    request.model_spec.name = style
    for alias, values in inputs.items():
        request.inputs[alias].CopyFrom(tf.make_tensor_proto(values))
    want = _direct(base / "1", inputs)
    with zoo_pool.channel() as channel:
        stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
        for _ in range(2 * len(slots)):  # every worker
            try:
                response = stub.Predict(request, timeout=30)
            except grpc.RpcError as exc:
                pytest.fail(f"{style}: {exc.code()} {exc.details()}\n{zoo_pool.output()[-3000:]}")
            for alias in want:
                got = tf.make_ndarray(response.outputs[alias])
                _same(got, want[alias], alias)


def _writing_model(path: Path) -> dict[str, np.ndarray]:
    """A model that writes a variable as it serves (a request counter): TensorFlow must copy
    the written variable out of the shared segment."""
    tf = _tf()

    class M(tf.Module):
        def __init__(self) -> None:
            self.table = tf.Variable(_table(11), name="table")
            self.calls = tf.Variable(tf.zeros([2], tf.float32), name="calls")

        @tf.function(input_signature=[tf.TensorSpec([None], tf.int64, name="ids")])
        def serve(self, ids):
            self.calls.assign_add(tf.ones([2]))
            return {"out": tf.gather(self.table, ids)}

    _save_module(M(), path)
    return {"ids": np.array([1], np.int64)}


def _branch_writing_model(path: Path) -> dict[str, np.ndarray]:
    """Writes its table only when the ids sum past 1000, which warm-up's zeros never do, and
    counts its calls inside a called function and a loop."""
    tf = _tf()

    class M(tf.Module):
        def __init__(self) -> None:
            self.table = tf.Variable(_table(12), name="table")
            self.calls = tf.Variable(tf.zeros([], tf.int64), name="calls")
            self.clean = tf.Variable(_table(13), name="clean")

        @tf.function
        def count(self):
            for _ in tf.range(2):
                self.calls.assign_add(1)

        @tf.function(input_signature=[tf.TensorSpec([None], tf.int64, name="ids")])
        def serve(self, ids):
            def poison():
                self.table.scatter_add(tf.IndexedSlices(tf.ones([1, DIM]), [0]))
                return tf.constant(1)

            tf.cond(tf.reduce_sum(ids) > 1000, poison, lambda: tf.constant(0))
            self.count()
            dense = tf.reduce_sum(self.clean)
            return {"out": tf.gather(self.table, ids) + tf.gather(self.clean, ids) + dense}

    _save_module(M(), path)
    return {"ids": np.array([1, 2], np.int64)}


def _request_writing_model(path: Path) -> None:
    """Writes its table only when the ids sum past 40, which warm-up's zeros never do: it
    loads with nothing copied and copies on such a request."""
    tf = _tf()

    class M(tf.Module):
        def __init__(self) -> None:
            self.table = tf.Variable(_table(14), name="table")

        @tf.function(input_signature=[tf.TensorSpec([None], tf.int64, name="ids")])
        def serve(self, ids):
            def poison():
                self.table.scatter_add(tf.IndexedSlices(tf.ones([1, DIM]), [0]))
                return tf.constant(1)

            tf.cond(tf.reduce_sum(ids) > 40, poison, lambda: tf.constant(0))
            return {"out": tf.gather(self.table, ids)}

    _save_module(M(), path)


def test_variables_of_one_name_are_reported_apart(tmp_path: Path, segment_path: Path) -> None:
    """Every unnamed tf.Variable is "Variable:0": two such tables, each written by its own
    signature only for ids past 40 (warm-up's zeros never are), are at risk apart and copied
    apart. Keyed by the bare name they were one entry, and once one was copied the other was
    no longer looked at: its copy went unreported (found by a hunt)."""
    tf = _tf()

    class M(tf.Module):
        def __init__(self) -> None:
            self.a = tf.Variable(_table(21))
            self.b = tf.Variable(_table(22))

        def _write(self, table: Any, ids: Any) -> Any:
            def write() -> Any:
                table.scatter_add(tf.IndexedSlices(tf.ones([1, DIM]), [0]))
                return tf.constant(1)

            tf.cond(tf.reduce_sum(ids) > 40, write, lambda: tf.constant(0))
            return {"out": tf.gather(self.a, ids) + tf.gather(self.b, ids)}

        @tf.function(input_signature=[tf.TensorSpec([None], tf.int64, name="ids")])
        def write_a(self, ids):
            return self._write(self.a, ids)

        @tf.function(input_signature=[tf.TensorSpec([None], tf.int64, name="ids")])
        def write_b(self, ids):
            return self._write(self.b, ids)

    module = M()
    version = tmp_path / "m" / "1"
    tf.saved_model.save(
        module, str(version), signatures={"write_a": module.write_a, "write_b": module.write_b}
    )
    publish(version, "m", 1, segment_path, *OWNER)
    runtime = load_saved_model(
        str(version), "m", 1, weights_segment=str(segment_path), work_dir=str(tmp_path / "w")
    )
    runtime.warm_up()
    a, b = "Variable:0 (a)", "Variable:0 (b)"
    report = runtime.weights_report()
    assert set(report["at_risk"]) == {a, b} and report["copied"] == {}, report
    past = {"ids": np.array([ROWS - 1], np.int64)}
    runtime.run("write_a", past, ["out"])
    report = runtime.weights_rechecked(report)
    assert set(report["copied"]) == {a}, report
    runtime.run("write_b", past, ["out"])
    report = runtime.weights_rechecked(report)
    assert set(report["copied"]) == {a, b}, report
    assert report == runtime.weights_report()


def test_what_may_copy_a_variable_is_said_at_start_with_its_name_and_op(
    tmp_path: Path, segment_path: Path
) -> None:
    """audit() follows each variable's handle through the served functions (calls, branches,
    loops): the write in a branch that warm-up never takes is reported before it happens, the
    loop's write (which warm-up runs) is both at risk and copied, and a variable that is only
    read is neither."""
    version = tmp_path / "m" / "1"
    inputs = _branch_writing_model(version)
    publish(version, "m", 1, segment_path, *OWNER)
    runtime = load_saved_model(
        str(version), "m", 1, weights_segment=str(segment_path), work_dir=str(tmp_path / "w")
    )
    runtime.warm_up()
    report = runtime.weights_report()
    assert set(report["at_risk"]) == {"table:0", "calls:0"}, report
    assert report["at_risk"]["table:0"].startswith("ResourceScatterAdd writes it"), report
    assert "AssignAddVariableOp writes it" in report["at_risk"]["calls:0"], report
    assert report["copied"] == {"calls:0": 8}, report
    got = runtime.run(SIG, inputs, ["out"])
    np.testing.assert_allclose(got["out"], _direct(version, inputs)["out"], rtol=0, atol=1e-6)
    # What a serving worker looks at again: only the variables at risk it still shares.
    assert runtime.weights_rechecked(report) == report
    runtime.run(SIG, {"ids": np.full(25, ROWS - 1, np.int64)}, ["out"])  # sums past 1000
    again = runtime.weights_rechecked(report)
    assert again["copied"] == {"calls:0": 8, "table:0": ROWS * DIM * 4}, again
    assert again["shared_bytes"] == report["shared_bytes"] - ROWS * DIM * 4, again
    assert again == runtime.weights_report()


def test_a_worker_with_copied_weights_refuses_to_serve(tmp_path: Path) -> None:
    base = tmp_path / "writer"
    _writing_model(base / "1")
    (tmp_path / "refused").mkdir()
    pool = Pool(tmp_path / "refused", base, 1, "--start-retries", "0").start()
    try:
        assert pool.proc is not None
        assert pool.proc.wait(120) == 1, pool.output()
        out = pool.output()
        assert "no worker could start" in out, out
        assert "copied shared variables into this worker: calls:0" in out, out
        assert "--allow-copied-weights" in out
        # Why, said by the worker at start, before its warm-up made the copy.
        logs = "".join(
            p.read_text(errors="replace") for p in pool.log_dir.rglob("*") if p.is_file()
        )
        assert "shared variable calls:0 may be copied into this worker: AssignAddVariableOp" in logs
    finally:
        pool.kill()
    assert pool.leftovers() == []


def test_a_copy_made_while_serving_is_shown_and_survives_a_front_door_restart(
    tmp_path: Path,
) -> None:
    """A variable at risk that warm-up left shared and a request copied: the worker serves on
    (refusing then would take the model down for one request) and says so, in its log and
    through the front door, so status shows COPIED and the gauge its bytes; a front door
    restarted later learns it from the worker's READY."""
    import psutil
    import tensorflow as tf
    from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc

    base = tmp_path / "writer"
    _request_writing_model(base / "1")
    (tmp_path / "pool").mkdir()
    pool = Pool(tmp_path / "pool", base, 1).start()
    table_bytes = ROWS * DIM * 4
    try:
        status = pool.wait_ready(1)
        (slot,) = status["slots"]
        assert slot["weights"]["copied"] == {}, slot
        assert list(slot["weights"]["at_risk"]) == ["table:0"], slot
        table = _status_table(pool)
        assert re.search(r" shared [0-9.]+KiB, 1 at risk ", table), table
        stub = prediction_service_pb2_grpc.PredictionServiceStub(pool.channel())

        def predict(ids: list[int]) -> np.ndarray:
            request = predict_pb2.PredictRequest()
            request.model_spec.name = "demo"
            request.inputs["ids"].CopyFrom(tf.make_tensor_proto(np.array(ids, np.int64)))
            return tf.make_ndarray(stub.Predict(request, timeout=30).outputs["out"])

        np.testing.assert_array_equal(predict([1, 2]), _table(14)[[1, 2]])
        np.testing.assert_array_equal(predict([49]), _table(14)[[49]])  # writes row 0
        status = pool.wait_for(
            lambda s: (s["slots"][0]["weights"] or {}).get("copied") == {"table:0": table_bytes},
            timeout=10,
            what="the copy shown in status",
        )
        assert status["slots"][0]["pid"] == slot["pid"], "the worker was replaced"
        table = _status_table(pool)
        assert " COPIED 1.6KiB " in table and "at risk" not in table, table  # 1,600 bytes
        metrics_url = status["pool"]["metrics"]
        metrics = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
        gauge = f'mpspool_worker_copied_weight_bytes{{slot="cpu-0@1"}} {table_bytes}'
        assert gauge in metrics, metrics
        logs = "".join(
            p.read_text(errors="replace") for p in pool.log_dir.rglob("*") if p.is_file()
        )
        assert "copied shared variables into this worker while serving: table:0" in logs, logs
        assert "ResourceScatterAdd writes it" in logs, logs
        # Still served, from its own copy now.
        want = _table(14)[[0, 1]] + np.array([[1.0] * DIM, [0.0] * DIM], np.float32)
        np.testing.assert_array_equal(predict([0, 1]), want)

        (router,) = (
            c
            for c in psutil.Process(pool.proc.pid).children(recursive=True)
            if c.name() == "mpspool-router"
        )
        router.kill()
        router.wait(10)
        # The new front door's own gauge (0 for a worker that reported no copy).
        deadline = time.monotonic() + 30
        while True:
            status = pool.status()
            try:
                url = status["pool"]["metrics"]
                metrics = urllib.request.urlopen(url, timeout=10).read().decode()
            except (OSError, KeyError, TypeError):
                metrics = ""
            if gauge in metrics:
                break
            assert time.monotonic() < deadline, f"no gauge from a new front door: {metrics}"
            time.sleep(0.2)
        assert status["slots"][0]["weights"]["copied"] == {"table:0": table_bytes}, status
    finally:
        assert pool.stop() == 0
    assert pool.leftovers() == []


def _status_table(pool: Pool) -> str:
    """`mpspool status`'s table, as an operator reads it."""
    done = subprocess.run(
        mpspool_cmd("status", "--run-dir", str(pool.run_dir)),
        capture_output=True, text=True, timeout=30, check=True,
    )  # fmt: skip
    return done.stdout


def test_the_copy_watch_looks_after_requests_only_at_what_is_at_risk_and_never_fails(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """CopyWatch (worker/serve.py) on a stand-in runtime: it looks only when requests ran
    since its last look and a variable at risk is still shared, reports a new copy once, and
    a look that fails is logged and not tried again, never raised into the serving loop."""
    from mpspool.worker.serve import CopyWatch

    shared = {"segment": "s", "shared_bytes": 96, "copied": {}, "at_risk": {"t:0": "why"}}
    copied = {**shared, "shared_bytes": 32, "copied": {"t:0": 64}}

    class Runtime:
        def __init__(self, answers: list[Any]) -> None:
            self.answers, self.looks = answers, 0

        def weights_rechecked(self, before: dict[str, Any]) -> dict[str, Any]:
            self.looks += 1
            answer = self.answers.pop(0)
            if isinstance(answer, Exception):
                raise answer
            return answer

    watch, runtime = CopyWatch(allowed=False), Runtime([shared, copied])
    assert watch.look(runtime, shared) is None and runtime.looks == 0  # no request yet
    watch.calls += 1
    assert watch.look(runtime, shared) is None and runtime.looks == 1  # nothing copied
    assert watch.look(runtime, shared) is None and runtime.looks == 1  # no request since
    watch.calls += 1
    assert watch.look(runtime, shared) == copied
    assert "while serving: t:0 (0.0 MiB) (why)" in caplog.text
    watch.calls += 1
    assert watch.look(runtime, copied) is None and runtime.looks == 2  # nothing left at risk
    assert watch.look(runtime, {**shared, "at_risk": {}}) is None and runtime.looks == 2
    assert watch.look(runtime, None) is None  # weights not shared

    watch, runtime = CopyWatch(allowed=True), Runtime([RuntimeError("boom")])
    watch.calls += 1
    assert watch.look(runtime, shared) is None
    assert "looking at the shared weights again failed" in caplog.text
    watch.calls += 1
    assert watch.look(runtime, shared) is None and runtime.looks == 1


def test_allow_copied_weights_serves_and_shows_the_copy(tmp_path: Path) -> None:
    base = tmp_path / "writer"
    inputs = _writing_model(base / "1")
    (tmp_path / "allowed").mkdir()
    pool = Pool(tmp_path / "allowed", base, 1, "--allow-copied-weights").start()
    try:
        status = pool.wait_ready(1)
        (slot,) = status["slots"]
        # With copies allowed a signature that writes a variable is not run at warm-up (its
        # first request is the first write, as in TF Serving): the copy comes with it.
        assert slot["weights"]["copied"] == {}, slot
        assert list(slot["weights"]["at_risk"]) == ["calls:0"], slot
        import tensorflow as tf
        from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc

        stub = prediction_service_pb2_grpc.PredictionServiceStub(pool.channel())
        request = predict_pb2.PredictRequest()
        request.model_spec.name = "demo"
        request.inputs["ids"].CopyFrom(tf.make_tensor_proto(inputs["ids"]))
        got = tf.make_ndarray(stub.Predict(request, timeout=30).outputs["out"])
        np.testing.assert_array_equal(got, _table(11)[[1]])
        pool.wait_for(
            lambda s: s["slots"][0]["weights"]["copied"] == {"calls:0": 8},
            what="the copy its first request made shown",
        )
        # The operator sees it as a metric too.
        metrics = urllib.request.urlopen(status["pool"]["metrics"], timeout=10).read().decode()
        assert 'mpspool_worker_copied_weight_bytes{slot="cpu-0@1"} 8' in metrics, metrics
    finally:
        assert pool.stop() == 0
    assert pool.leftovers() == []


def test_with_shared_weights_state_that_is_no_shared_variable_is_not_run_at_warm_up(
    tmp_path: Path, segment_path: Path
) -> None:
    """A seeded stateful random op keeps its own sequence, which no copy of the weights
    shows: its first request gets plain TensorFlow's first draw, as in TF Serving (before,
    warm-up and its fast-call check drew first with shared weights). A counter on a variable
    is run at warm-up as before when copies are refused (its copy refuses the load), and not
    when they are allowed (its first 2-row request answers 2, not 4)."""
    tf = _tf()

    class Stateful(tf.Module):
        def __init__(self) -> None:
            self.table = tf.Variable(_table(12))
            self.seen = tf.Variable(0, dtype=tf.int64)

        @tf.function(input_signature=[tf.TensorSpec([None], tf.int64, name="ids")])
        def noisy(self, ids):
            rows = tf.gather(self.table, ids)
            return {"out": rows + tf.random.uniform(tf.shape(rows), seed=42)}

        @tf.function(input_signature=[tf.TensorSpec([None], tf.int64, name="ids")])
        def count(self, ids):
            # A random op beside the write: the write still decides (found by a review).
            self.seen.assign_add(tf.shape(ids, out_type=tf.int64)[0])
            return {"seen": self.seen.read_value(), "noise": tf.random.uniform([1])}

    module = Stateful()
    signatures = {SIG: module.noisy.get_concrete_function(), "count": module.count}
    tf.saved_model.save(module, str(tmp_path / "1"), signatures=signatures)
    ids = {"ids": np.array([3, 4], np.int64)}
    first = tf.saved_model.load(str(tmp_path / "1")).signatures[SIG](**ids)["out"].numpy()
    publish(tmp_path / "1", "s", 1, segment_path, *OWNER)

    def load(copies_allowed: bool) -> Any:
        runtime = load_saved_model(
            str(tmp_path / "1"), "s", 1, weights_segment=str(segment_path), work_dir=str(tmp_path)
        )
        runtime.warm_up(copies_allowed=copies_allowed)
        return runtime

    runtime = load(copies_allowed=False)
    np.testing.assert_array_equal(runtime.run(SIG, ids, ["out"])["out"], first)
    assert runtime.call_paths[SIG] == "keywords"
    # The counter ran at warm-up: its copy (8 bytes) is what refuses the load.
    assert list(runtime.weights_report()["copied"].values()) == [8]
    runtime = load(copies_allowed=True)
    assert runtime.run("count", ids, ["seen"])["seen"] == 2


def _tf1_with_a_file_and_a_sparse_signature(version: Path, tmp_path: Path) -> None:
    """A TF1 model beside its predict signature: one that reads the file its input names
    (NOT_FOUND on the empty path of a zero example) and one fed a SparseTensor through a
    sparse placeholder (a `coo_sparse` TensorInfo: what TF1 estimators' raw serving input
    receivers make of sparse features)."""
    tf = _tf()
    v1 = tf.compat.v1
    info = v1.saved_model.build_tensor_info
    predict = v1.saved_model.signature_def_utils.build_signature_def
    with tf.Graph().as_default():
        x = v1.placeholder(tf.float32, [None, 2], name="x")
        w = v1.get_variable("w", initializer=tf.constant([[1.0], [2.0]]), use_resource=True)
        y = tf.matmul(x, w)
        path = v1.placeholder(tf.string, [], name="path")
        size = tf.strings.length(tf.io.read_file(path))
        sparse = v1.sparse_placeholder(tf.float32, [None, 4], name="sp")
        total = v1.sparse_reduce_sum(sparse, axis=1)
        method = "tensorflow/serving/predict"
        signatures = {
            SIG: predict({"x": info(x)}, {"y": info(y)}, method),
            "from_path": predict({"path": info(path)}, {"n": info(size)}, method),
            "sparse_in": predict({"sp": info(sparse)}, {"sum": info(total)}, method),
        }
        with v1.Session() as session:
            session.run(v1.global_variables_initializer())
            builder = v1.saved_model.Builder(str(version))
            builder.add_meta_graph_and_variables(session, ["serve"], signature_def_map=signatures)
            builder.save()


@pytest.mark.parametrize("shared", [False, True])
def test_a_model_whose_other_signatures_cannot_run_zeros_or_be_called_loads(
    tmp_path: Path, segment_path: Path, shared: bool
) -> None:
    """TF Serving runs no signature at load, so it serves such a model: the predict
    signature answers, the file reader reads real files, and a request to the sparse one is
    refused with INVALID_ARGUMENT (TF Serving feeds a tensor by its name, which a coo_sparse
    input has none of). Both made the load fail here (found by a user test)."""
    from mpspool.errors import Code, ServingError

    version = tmp_path / "m" / "1"
    _tf1_with_a_file_and_a_sparse_signature(version, tmp_path)
    if shared:
        publish(version, "m", 1, segment_path, *OWNER)
    runtime = load_saved_model(
        str(version),
        "m",
        1,
        weights_segment=str(segment_path) if shared else "",
        work_dir=str(tmp_path / "w"),
    )
    runtime.warm_up()
    x = np.array([[1.0, 1.0]], np.float32)
    assert runtime.run(SIG, {"x": x}, ["y"])["y"].tolist() == [[3.0]]
    data = tmp_path / "data.txt"
    data.write_bytes(b"12345")
    got = runtime.run("from_path", {"path": np.array(str(data).encode(), dtype=object)}, ["n"])
    assert got["n"] == 5
    with pytest.raises(ServingError) as info:
        runtime.run("sparse_in", {"sp": np.zeros((1, 4), np.float32)}, ["sum"])
    assert info.value.code == Code.INVALID_ARGUMENT
    assert "'sp' is a SparseTensor (coo_sparse encoding)" in info.value.message


def test_a_loop_that_ends_only_on_real_data_does_not_hold_the_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A signature iterating until its steps add up to a target never ends on zeros: warm-up
    stops it (at WARM_UP_RUN_LIMIT_S) and the version loads; real requests end. The load
    hung for ever, --call-timeout or not (found by a user test)."""
    from mpspool.worker import runtime as runtime_module

    tf = _tf()

    class Until(tf.Module):
        @tf.function(
            input_signature=[
                tf.TensorSpec([], tf.float32, name="target"),
                tf.TensorSpec([], tf.float32, name="step"),
            ]
        )
        def until(self, target: Any, step: Any) -> dict[str, Any]:
            total = tf.constant(0.0)
            while total <= target:
                total += step
            return {"total": total}

    module = Until()
    tf.saved_model.save(module, str(tmp_path / "1"), signatures={SIG: module.until})
    monkeypatch.setattr(runtime_module, "WARM_UP_RUN_LIMIT_S", 1.0)
    runtime = load_saved_model(str(tmp_path / "1"), "until", 1)
    started = time.monotonic()
    runtime.warm_up()
    assert time.monotonic() - started < 30
    inputs = {"target": np.float32(5.0), "step": np.float32(2.0)}
    assert runtime.run(SIG, inputs, ["total"])["total"] == 6.0
