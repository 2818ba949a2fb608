"""The worker's model runtime against real TensorFlow: signatures, results, errors, loading."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from three_outputs import THREE_INPUTS, build_three_outputs

from mpspool import dtypes
from mpspool.demo_model import build_demo_model, demo_inputs
from mpspool.errors import Code, ServingError
from mpspool.protos import serving_pb2
from mpspool.signature import PREDICT_METHOD, SignatureSpec, TensorSpec
from mpspool.worker.runtime import ModelLoadError, ModelRuntime, load_saved_model

ROWS = 100
SIG = "serving_default"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_demo_model(tmp_path_factory.mktemp("demo"), embedding_rows=ROWS)


@pytest.fixture(scope="module")
def runtime(model_dir: Path) -> ModelRuntime:
    runtime = load_saved_model(str(model_dir), "demo", 1)
    runtime.warm_up()
    return runtime


@pytest.fixture(scope="module")
def direct(model_dir: Path) -> Any:
    """The same SavedModel called the plain TensorFlow way: the reference for results."""
    import tensorflow as tf

    loaded = tf.saved_model.load(str(model_dir))
    serve = loaded.signatures[SIG]
    serve.loaded = loaded  # keep the variables alive with the function
    return serve


@pytest.fixture(scope="module")
def two_output_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model with two outputs and loosely specified inputs."""
    import tensorflow as tf

    class TwoOutputs(tf.Module):
        @tf.function(
            input_signature=[
                tf.TensorSpec([None, None], tf.float32, name="x"),
                tf.TensorSpec(None, tf.int32, name="n"),  # unknown rank
            ]
        )
        def serve(self, x: tf.Tensor, n: tf.Tensor) -> dict[str, tf.Tensor]:
            return {"double": x * 2.0, "plus_n": x + tf.cast(tf.reduce_sum(n), tf.float32)}

    path = tmp_path_factory.mktemp("two") / "1"
    module = TwoOutputs()
    tf.saved_model.save(module, str(path), signatures={SIG: module.serve.get_concrete_function()})
    return path


def test_runtime_describes_itself(runtime: ModelRuntime) -> None:
    assert runtime.model_name == "demo"
    assert runtime.version == 1


def test_specs_match_the_demo_signature(runtime: ModelRuntime) -> None:
    assert runtime.specs == {
        SIG: SignatureSpec(
            key=SIG,
            method_name=PREDICT_METHOD,
            inputs={
                "ids": TensorSpec(dtypes.DT_INT64, (-1, 16)),
                "dense": TensorSpec(dtypes.DT_FLOAT, (-1, 13)),
            },
            outputs={"score": TensorSpec(dtypes.DT_FLOAT, (-1, 1))},
        )
    }


def test_signature_defs_are_the_saved_models_own(runtime: ModelRuntime, model_dir: Path) -> None:
    from tensorflow.core.protobuf import saved_model_pb2

    ours = serving_pb2.SignatureDefMap.FromString(runtime.signature_defs)
    saved = saved_model_pb2.SavedModel.FromString((model_dir / "saved_model.pb").read_bytes())
    (serve_graph,) = [m for m in saved.meta_graphs if "serve" in m.meta_info_def.tags]
    assert set(ours.signature_def) == set(serve_graph.signature_def)
    for key, tf_def in serve_graph.signature_def.items():
        # Byte-for-byte the same message: nothing lost in the translation to our protos.
        assert ours.signature_def[key].SerializeToString(deterministic=True) == (
            tf_def.SerializeToString(deterministic=True)
        )
    sig = ours.signature_def[SIG]
    assert sig.method_name == PREDICT_METHOD
    assert sig.inputs["ids"].name == "serving_default_ids:0"
    assert sig.inputs["dense"].name == "serving_default_dense:0"
    assert sig.outputs["score"].dtype == dtypes.DT_FLOAT


def test_signature_defs_parse_as_tf_servings_own_message(runtime: ModelRuntime) -> None:
    apis = pytest.importorskip("tensorflow_serving.apis.get_model_metadata_pb2")
    official = apis.SignatureDefMap.FromString(runtime.signature_defs)
    assert [d.size for d in official.signature_def[SIG].inputs["ids"].tensor_shape.dim] == [-1, 16]


@pytest.mark.parametrize("batch", [1, 256])
def test_results_equal_plain_tensorflow_bit_for_bit(
    runtime: ModelRuntime, direct: Any, batch: int
) -> None:
    import tensorflow as tf

    inputs = demo_inputs(batch, ROWS, seed=batch)
    got = runtime.run(SIG, inputs, ["score"])
    want = direct(**{k: tf.constant(v) for k, v in inputs.items()})["score"].numpy()
    assert set(got) == {"score"}
    assert isinstance(got["score"], np.ndarray)
    assert got["score"].shape == (batch, 1) and got["score"].dtype == np.float32
    np.testing.assert_array_equal(got["score"], want)


@pytest.mark.parametrize("bad_id", [ROWS, -1])
def test_id_outside_the_table_is_invalid_argument(
    runtime: ModelRuntime, direct: Any, bad_id: int
) -> None:
    inputs = demo_inputs(3, ROWS)
    inputs["ids"][2, 5] = bad_id
    with pytest.raises(ServingError) as info:
        runtime.run(SIG, inputs, ["score"])
    assert info.value.code == Code.INVALID_ARGUMENT
    # The kernel's words, not TensorFlow's "Graph execution error:" wrapper.
    assert info.value.message == f"indices[2,5] = {bad_id} is not in [0, {ROWS})"

    # The failure was one request's: the runtime keeps serving, with the same results.
    good = demo_inputs(3, ROWS)
    want = direct(**good)["score"].numpy()
    np.testing.assert_array_equal(runtime.run(SIG, good, ["score"])["score"], want)


def test_non_tensorflow_failure_is_internal(runtime: ModelRuntime) -> None:
    with pytest.raises(ServingError) as info:
        runtime.run("no_such_signature", demo_inputs(1, ROWS), ["score"])
    assert info.value.code == Code.INTERNAL
    assert "no_such_signature" in info.value.message


def test_outputs_are_filtered_to_the_requested_aliases(two_output_dir: Path) -> None:
    runtime = load_saved_model(str(two_output_dir), "two", 1)
    assert runtime.specs[SIG].inputs["n"].shape is None
    inputs = {"x": np.array([[1.0, 2.0]], np.float32), "n": np.array([3, 4], np.int32)}

    got = runtime.run(SIG, inputs, ["plus_n"])
    assert list(got) == ["plus_n"]
    np.testing.assert_array_equal(got["plus_n"], [[8.0, 9.0]])
    got = runtime.run(SIG, inputs, ["double"])
    assert list(got) == ["double"]
    np.testing.assert_array_equal(got["double"], [[2.0, 4.0]])
    assert set(runtime.run(SIG, inputs, ["double", "plus_n"])) == {"double", "plus_n"}
    assert runtime.run(SIG, inputs, []) == {}


def test_warm_up_runs_each_signature_on_one_zero_example(
    two_output_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runtime = load_saved_model(str(two_output_dir), "two", 1)
    calls: list[tuple[str, dict[str, np.ndarray], list[str]]] = []
    real_run = runtime.run

    def spy(
        signature: str, inputs: dict[str, np.ndarray], outputs: list[str], cancel: Any = None
    ) -> Any:
        calls.append((signature, inputs, outputs))
        return real_run(signature, inputs, outputs, cancel)

    monkeypatch.setattr(runtime, "run", spy)
    runtime.warm_up()
    # Twice: the flat call, then the keyword call it is checked against.
    assert len(calls) == 2 and runtime.call_paths == {SIG: "direct"}
    assert calls[0][0] == calls[1][0] and calls[0][1] is calls[1][1]
    signature, inputs, outputs = calls[0]
    assert signature == SIG
    assert sorted(outputs) == ["double", "plus_n"]
    assert inputs["x"].shape == (1, 1) and inputs["x"].dtype == np.float32
    assert inputs["n"].shape == () and inputs["n"].dtype == np.int32  # unknown rank: a scalar
    assert not any(a.any() for a in inputs.values())


def test_a_signature_that_writes_state_runs_once_per_request(tmp_path: Path) -> None:
    """A counter (assign_add of the batch size) answers 2 to its first 2-row request, as TF
    Serving's does: no warm-up run on zeros, no second run to check a fast call; a signature
    beside it that writes nothing is warmed up and called fast as before."""
    import tensorflow as tf

    from mpspool.worker.stateful import writes_state

    class Counter(tf.Module):
        def __init__(self) -> None:
            self.seen = tf.Variable(0, dtype=tf.int64)

        @tf.function(input_signature=[tf.TensorSpec([None], tf.float32, name="x")])
        def count(self, x):
            self.seen.assign_add(tf.shape(x, out_type=tf.int64)[0])
            return {"seen": self.seen.read_value()}

        @tf.function(input_signature=[tf.TensorSpec([None], tf.float32, name="x")])
        def double(self, x):
            return {"y": 2.0 * x}

    class Draw(tf.Module):
        def __init__(self) -> None:
            self.generator = tf.random.Generator.from_seed(1)

        @tf.function(input_signature=[tf.TensorSpec([None], tf.float32, name="x")])
        def draw(self, x):
            return {"r": x + self.generator.uniform([3])}

    module = Counter()
    module.drawing = Draw()
    signatures = {
        "count": module.count.get_concrete_function(),
        "double": module.double.get_concrete_function(),
        "draw": module.drawing.draw.get_concrete_function(),
    }
    tf.saved_model.save(module, str(tmp_path / "1"), signatures=signatures)
    first_draw = tf.saved_model.load(str(tmp_path / "1")).signatures["draw"](x=tf.zeros(3))
    runtime = load_saved_model(str(tmp_path / "1"), "counter", 1)
    assert "AssignAddVariableOp" in writes_state(runtime._functions["count"])
    assert writes_state(runtime._functions["draw"])  # the generator's state
    assert writes_state(runtime._functions["double"]) == ""
    runtime.warm_up()
    assert runtime.call_paths == {"count": "keywords", "double": "direct", "draw": "keywords"}
    two = {"x": np.zeros(2, np.float32)}
    assert runtime.run("count", two, ["seen"])["seen"] == 2
    assert runtime.run("count", two, ["seen"])["seen"] == 4
    # A seeded generator's first draw is plain TensorFlow's first draw.
    got = runtime.run("draw", {"x": np.zeros(3, np.float32)}, ["r"])["r"]
    np.testing.assert_array_equal(got, first_draw["r"].numpy())
    assert not runtime.has_deferred_check


def test_sigterm_ends_a_workers_start_up_where_it_is(tmp_path: Path, model_dir: Path) -> None:
    """A worker told to stop while it loads (here: waiting for weights still being
    published, which has no deadline of its own) exits at once and cleanly, rather than
    loading on until supervisord's stop wait runs out and it is killed."""
    segment = tmp_path / "segment"
    (tmp_path / "segment.partial").write_bytes(b"")  # a publisher that has just begun
    script = (
        "import logging, sys\n"
        "logging.basicConfig(level=logging.INFO)\n"
        "from mpspool.worker import serve\n"
        "from mpspool.worker.runtime import load_saved_model\n"
        "serve.stop_while_loading()\n"
        "load_saved_model(sys.argv[1], 'demo', 1, weights_segment=sys.argv[2],\n"
        "                 work_dir=sys.argv[3])\n"
        "print('loaded', flush=True)\n"
    )
    worker = subprocess.Popen(
        [sys.executable, "-c", script, str(model_dir), str(segment), str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: list[str] = []
    waiting = threading.Event()

    def read(stream: Any) -> None:
        for line in stream:
            lines.append(line)
            if "waiting for the weights to be published" in line:
                waiting.set()  # TensorFlow imported, the graph loaded: now it waits

    reader = threading.Thread(target=read, args=(worker.stderr,), daemon=True)
    reader.start()
    try:
        assert waiting.wait(timeout=120), "".join(lines)
        worker.send_signal(signal.SIGTERM)
        out, _ = worker.communicate(timeout=30)
    finally:
        worker.kill()
    reader.join(timeout=10)
    err = "".join(lines)
    assert worker.returncode == 0, err
    assert "loaded" not in out
    assert "Traceback" not in err


def test_missing_directory_is_a_load_error(tmp_path: Path) -> None:
    missing = tmp_path / "demo" / "1"
    with pytest.raises(ModelLoadError, match="does not exist") as info:
        load_saved_model(str(missing), "demo", 1)
    assert str(missing) in str(info.value)
    assert info.value.code is Code.NOT_FOUND  # what GetModelStatus reports, as TF Serving


def test_an_unreadable_base_path_is_a_load_error_naming_it(tmp_path: Path) -> None:
    """chmod 000 on the base path: the worker said its warm-up failed, with a traceback
    (found by an operator test). Root reads any directory, so as root the load runs with
    the capabilities that allow that dropped (setpriv), as the operator's test did."""
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0)
    drop = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--"]
    script = (
        "import sys\n"
        "from mpspool.worker.runtime import ModelLoadError, load_saved_model\n"
        "try:\n"
        "    load_saved_model(sys.argv[1], 'demo', 1)\n"
        "except ModelLoadError as exc:\n"
        "    print(exc.code.name, exc)\n"
    )
    try:
        done = subprocess.run(
            [*(drop if os.geteuid() == 0 else []), sys.executable, "-c", script, str(locked / "1")],
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        locked.chmod(0o700)
    said = done.stdout.strip()
    assert said.startswith("PERMISSION_DENIED cannot load model 'demo' version 1"), (
        done.stdout + done.stderr
    )
    assert "Permission denied" in said


def test_a_base_path_with_glob_characters_loads(
    tmp_path: Path, model_dir: Path, runtime: ModelRuntime
) -> None:
    """TensorFlow reads a checkpoint through a glob of its prefix: "/models/g[1]" failed
    every load without shared weights ("Failed to find any matching files"; found by a
    hunt). It is read through a private link now."""
    version = tmp_path / "g[1]*?" / "1"
    shutil.copytree(model_dir, version)
    work = tmp_path / "work"
    loaded = load_saved_model(str(version), "demo", 1, work_dir=str(work))
    inputs = demo_inputs(3, ROWS, seed=4)
    got = loaded.run(SIG, inputs, ["score"])["score"]
    np.testing.assert_array_equal(got, runtime.run(SIG, inputs, ["score"])["score"])
    [link] = work.glob("model-*/version")
    assert link.resolve() == version.resolve()


def test_directory_without_saved_model_is_a_load_error(tmp_path: Path, model_dir: Path) -> None:
    shutil.copytree(model_dir / "variables", tmp_path / "variables")  # weights but no graph
    with pytest.raises(ModelLoadError, match=r"no saved_model\.pb") as info:
        load_saved_model(str(tmp_path), "demo", 1)
    assert str(tmp_path) in str(info.value)
    assert info.value.code is Code.NOT_FOUND


def test_corrupt_saved_model_is_a_load_error(tmp_path: Path) -> None:
    (tmp_path / "saved_model.pb").write_bytes(b"\xff\xff\xff not a protobuf")
    with pytest.raises(ModelLoadError, match="unreadable") as info:
        load_saved_model(str(tmp_path), "demo", 1)
    assert str(tmp_path) in str(info.value)
    assert info.value.code is Code.DATA_LOSS  # TensorFlow's "Can't parse ... as binary proto"


def test_tensorflow_load_failure_is_a_load_error(tmp_path: Path, model_dir: Path) -> None:
    # The graph is fine, the weights are gone: TensorFlow itself refuses to restore.
    shutil.copy(model_dir / "saved_model.pb", tmp_path / "saved_model.pb")
    with pytest.raises(ModelLoadError) as info:
        load_saved_model(str(tmp_path), "demo", 1)
    assert str(tmp_path) in str(info.value)
    assert info.value.__cause__ is not None  # TensorFlow's own error stays attached
    # NOT_FOUND: TensorFlow's loader finds no checkpoint files. (TF Serving's C++ loader
    # would load the graph without its variables, "no checkpoints were restored", and fail
    # each request instead.)
    assert info.value.code is Code.NOT_FOUND, repr(info.value.__cause__)


@pytest.mark.parametrize("wrap", ["py_function", "numpy_function"])
def test_a_signature_calling_python_is_a_load_error(tmp_path: Path, wrap: str) -> None:
    """tf.py_function / tf.numpy_function keep their Python in the exporting process: once
    loaded elsewhere every request would fail ("Could not find callback"), and TF Serving
    refuses the load. So does the worker, naming the op, even inside a called function."""
    import tensorflow as tf

    def doubled(x: Any) -> Any:
        return x * 2

    @tf.function
    def inner(x):  # a function in the graph's library, called by the signature
        if wrap == "py_function":
            return tf.py_function(doubled, [x], tf.float32)
        return tf.numpy_function(doubled, [x], tf.float32)

    class Module(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([None], tf.float32, name="x")])
        def serve(self, x):
            return {"y": inner(x)}

    module = Module()
    tf.saved_model.save(module, str(tmp_path / "1"), signatures={"serving_default": module.serve})
    refusal = r"calls Python code through (EagerPyFunc|PyFunc)"
    with pytest.raises(ModelLoadError, match=refusal) as e:
        load_saved_model(str(tmp_path / "1"), "py", 1)
    assert e.value.code is Code.NOT_FOUND  # TF Serving: "Op type not registered 'EagerPyFunc'"


def test_thread_counts_cannot_change_after_tensorflow_started(
    runtime: ModelRuntime, model_dir: Path
) -> None:
    import tensorflow as tf

    current = tf.config.threading.get_intra_op_parallelism_threads()
    with pytest.raises(ModelLoadError, match="intra-op threads") as info:
        load_saved_model(str(model_dir), "demo", 1, intra_op_threads=current + 3)
    assert info.value.code is Code.FAILED_PRECONDITION


def test_thread_counts_apply_in_a_fresh_process(model_dir: Path) -> None:
    code = (
        "import sys, tensorflow as tf\n"
        "from mpspool.worker.runtime import load_saved_model\n"
        "from mpspool.demo_model import demo_inputs\n"
        "rt = load_saved_model(sys.argv[1], 'demo', 1, intra_op_threads=1, inter_op_threads=2)\n"
        f"rt.run('{SIG}', demo_inputs(2, {ROWS}), ['score'])\n"
        "t = tf.config.threading\n"
        "print(t.get_intra_op_parallelism_threads(), t.get_inter_op_parallelism_threads())\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(model_dir)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["1", "2"]


def test_signatures_are_called_flat_when_their_parameters_are_their_aliases(
    runtime: ModelRuntime,
) -> None:
    # The demo model: TensorFlow's flat argument list, checked against the keyword call at
    # warm-up (test_results_equal_plain_tensorflow_bit_for_bit covers the answers).
    assert runtime.call_paths == {SIG: "direct"}


def test_an_alias_tensorflow_sanitizes_is_called_with_keywords(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    import tensorflow as tf

    class Dashed(tf.Module):
        @tf.function(
            input_signature=[
                tf.TensorSpec([None, 2], tf.float32, name="in-put"),
                tf.TensorSpec([None], tf.int32, name="n"),
            ]
        )
        def serve(self, x: tf.Tensor, n: tf.Tensor) -> dict[str, tf.Tensor]:
            return {"out": x * 2.0, "n": n + 1}

    path = tmp_path_factory.mktemp("dashed") / "1"
    module = Dashed()
    tf.saved_model.save(module, str(path), signatures={SIG: module.serve.get_concrete_function()})
    runtime = load_saved_model(str(path), "dashed", 1)
    runtime.warm_up()
    assert runtime.call_paths == {SIG: "keywords"}
    (alias,) = [a for a in runtime.specs[SIG].inputs if a != "n"]
    got = runtime.run(
        SIG, {alias: np.ones((2, 2), np.float32), "n": np.arange(2, dtype=np.int32)}, ["out", "n"]
    )
    np.testing.assert_array_equal(got["out"], np.full((2, 2), 2.0, np.float32))
    np.testing.assert_array_equal(got["n"], np.array([1, 2], np.int32))


@pytest.fixture(scope="module")
def three_output_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_three_outputs(tmp_path_factory.mktemp("three") / "1")


def test_the_direct_call_answers_as_the_keyword_call(three_output_dir: Path) -> None:
    runtime = load_saved_model(str(three_output_dir), "three", 1)
    runtime.warm_up()
    assert runtime.call_paths == {SIG: "direct"}
    got = runtime.run(SIG, THREE_INPUTS, ["aa_next", "mm_shout", "zz_scaled"])
    np.testing.assert_array_equal(got["zz_scaled"], [[1.0, 20.0], [3.0, 40.0]])
    np.testing.assert_array_equal(got["aa_next"], np.array([8, 9], np.int32))
    assert got["aa_next"].dtype == np.int32
    assert list(got["mm_shout"]) == [b"AB", b"C"]
    # The same bits as the public keyword call, output by output.
    runtime._direct[SIG] = None  # type: ignore[attr-defined]
    want = runtime.run(SIG, THREE_INPUTS, ["aa_next", "mm_shout", "zz_scaled"])
    for alias in want:
        assert got[alias].tobytes() == want[alias].tobytes() or alias == "mm_shout"
    assert list(want["mm_shout"]) == list(got["mm_shout"])


def test_a_direct_call_that_disagrees_at_warm_up_falls_back_to_keywords(
    three_output_dir: Path,
) -> None:
    runtime = load_saved_model(str(three_output_dir), "three", 1)
    direct = runtime._direct[SIG]  # type: ignore[attr-defined]
    assert direct is not None
    direct.outputs.reverse()  # as if TensorFlow's output order were misread
    runtime.warm_up()
    assert runtime.call_paths == {SIG: "keywords"}
    got = runtime.run(SIG, THREE_INPUTS, ["aa_next"])
    np.testing.assert_array_equal(got["aa_next"], np.array([8, 9], np.int32))


def test_an_op_failure_through_the_direct_call_keeps_the_kernels_words(
    three_output_dir: Path,
) -> None:
    runtime = load_saved_model(str(three_output_dir), "three", 1)
    runtime.warm_up()
    assert runtime.call_paths == {SIG: "direct"}
    bad = dict(THREE_INPUTS, x=np.ones((2, 3), np.float32))  # cannot broadcast with [1, 2]
    with pytest.raises(ServingError) as info:
        runtime.run(SIG, bad, ["zz_scaled"])
    assert info.value.code == Code.INVALID_ARGUMENT
    assert info.value.message == "Incompatible shapes: [1,2] vs. [2,3]"
    # The runtime goes on serving, and the keyword call words the same failure the same way.
    assert runtime.run(SIG, THREE_INPUTS, ["aa_next"])["aa_next"].tolist() == [8, 9]
    runtime._direct[SIG] = None  # type: ignore[attr-defined]
    with pytest.raises(ServingError) as keyword_info:
        runtime.run(SIG, bad, ["zz_scaled"])
    assert (keyword_info.value.code, keyword_info.value.message) == (
        info.value.code,
        info.value.message,
    )


@pytest.mark.parametrize(
    ("code", "empty_runs", "loads"),
    [
        (Code.INVALID_ARGUMENT, False, True),
        (Code.RESOURCE_EXHAUSTED, False, False),
        (Code.INTERNAL, False, False),
        # A kernel answering nonsense zeros with INTERNAL (a SparseTensor's components) that
        # runs on an empty example can run; out of memory on one row is no such thing, even
        # when an empty run (which allocates next to nothing) passes.
        (Code.INTERNAL, True, True),
        (Code.RESOURCE_EXHAUSTED, True, False),
    ],
)
def test_warm_up_forgives_refused_data_but_not_a_model_that_cannot_run(
    two_output_dir: Path, monkeypatch: pytest.MonkeyPatch, code: Code, empty_runs: bool, loads: bool
) -> None:
    runtime = load_saved_model(str(two_output_dir), "two", 1)

    def failing(signature: str, inputs: Any, outputs: Any, cancel: Any = None) -> Any:
        if empty_runs and all(0 in a.shape for a in inputs.values() if a.ndim):
            return {}
        raise ServingError(code, "no")

    monkeypatch.setattr(runtime, "run", failing)
    if loads:
        runtime.warm_up()  # left to its first request
        assert runtime._unchecked == {SIG}
    else:
        with pytest.raises(ModelLoadError, match=f"signature '{SIG}' failed: {code.name}") as info:
            runtime.warm_up()
        assert info.value.code is code


@pytest.mark.parametrize(
    ("code", "loads"),
    [(Code.INTERNAL, True), (Code.UNKNOWN, True), (Code.RESOURCE_EXHAUSTED, False)],
)
def test_a_signature_that_fails_beside_one_that_runs_leaves_the_version_loading(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: Code, loads: bool
) -> None:
    """TF Serving would serve the signature that runs, and the failing one's requests would
    get its error: so here, but out of memory still fails the load."""
    import tensorflow as tf

    class Two(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([None], tf.float32, name="x")])
        def good(self, x):
            return {"y": x + 1.0}

        @tf.function(input_signature=[tf.TensorSpec([None], tf.float32, name="x")])
        def bad(self, x):
            return {"y": x - 1.0}

    module = Two()
    signatures = {SIG: module.good.get_concrete_function(), "bad": module.bad}
    tf.saved_model.save(module, str(tmp_path / "1"), signatures=signatures)
    runtime = load_saved_model(str(tmp_path / "1"), "two", 1)
    real_run = runtime.run

    def failing(signature: str, inputs: Any, outputs: Any, cancel: Any = None) -> Any:
        if signature == "bad":
            raise ServingError(code, "no")
        return real_run(signature, inputs, outputs, cancel)

    monkeypatch.setattr(runtime, "run", failing)
    if loads:
        runtime.warm_up()
        assert runtime._unchecked == {"bad"}
    else:
        with pytest.raises(ModelLoadError, match=f"signature 'bad' failed: {code.name}"):
            runtime.warm_up()


def _parse_example_models(base: Path) -> dict[str, Path]:
    """A tf.Example parser exported the TF2 way (a tf.function, called directly) and the TF1
    way (a graph through a session)."""
    import tensorflow as tf

    features = {"x": tf.io.FixedLenFeature([2], tf.float32)}

    class Parser(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([None], tf.string, name="examples")])
        def serve(self, examples: tf.Tensor) -> dict[str, tf.Tensor]:
            return {"x": tf.io.parse_example(examples, features)["x"]}

    module = Parser()
    tf2 = base / "tf2" / "1"
    tf.saved_model.save(module, str(tf2), signatures={SIG: module.serve})
    tf1 = base / "tf1" / "1"
    graph = tf.Graph()
    with graph.as_default(), tf.compat.v1.Session(graph=graph) as session:
        examples = tf.compat.v1.placeholder(tf.string, [None], name="examples")
        x = tf.io.parse_example(examples, features)["x"]
        builder = tf.compat.v1.saved_model.Builder(str(tf1))
        signature = tf.compat.v1.saved_model.predict_signature_def({"examples": examples}, {"x": x})
        builder.add_meta_graph_and_variables(session, ["serve"], signature_def_map={SIG: signature})
        builder.save()
    return {"tf2": tf2, "tf1": tf1}


def test_a_kernel_error_quoting_bytes_that_are_not_utf8_is_invalid_argument(
    tmp_path: Path,
) -> None:
    """TensorFlow cannot make such a message a str: it raises UnicodeDecodeError in place of
    the kernel's InvalidArgumentError. The client gets TF Serving's code and the kernel's words,
    the bytes escaped; it was answered INTERNAL with a Python error (found by a user test)."""
    for style, path in _parse_example_models(tmp_path).items():
        runtime = load_saved_model(str(path), "parser", 1)
        good = _example(1.0, 2.0)
        np.testing.assert_array_equal(
            runtime.run(SIG, {"examples": np.array([good], object)}, ["x"])["x"], [[1.0, 2.0]]
        )
        with pytest.raises(ServingError) as info:
            runtime.run(SIG, {"examples": np.array([b"garbage\xff"], object)}, ["x"])
        assert info.value.code == Code.INVALID_ARGUMENT, (style, info.value.message)
        assert info.value.message.startswith(
            "Could not parse example input, value: 'garbage\\xff'"
        ), (style, info.value.message)
        assert runtime.run(SIG, {"examples": np.array([good], object)}, ["x"])


def _example(*values: float) -> bytes:
    import tensorflow as tf

    feature = tf.train.Feature(float_list=tf.train.FloatList(value=values))
    example = tf.train.Example(features=tf.train.Features(feature={"x": feature}))
    return example.SerializeToString()
