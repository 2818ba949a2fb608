"""The worker's session call (worker/session_call.py) against real TensorFlow: it runs the
graph on the worker's own thread, answers and fails as the public call does, and is used
only where its variables are the shared segment's."""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from three_outputs import THREE_INPUTS, build_three_outputs

from mpspool import process, segment
from mpspool.demo_model import build_demo_model
from mpspool.errors import Code, ServingError
from mpspool.worker.publish import publish
from mpspool.worker.runtime import load_saved_model

# The segments' owner as a pool's controller names itself: this process, by its start time.
# A start time of 0 named no live process, so a pool started meanwhile on the machine (a
# test beside these) took their segments for a dead pool's and removed them.
OWNER = (os.getpid(), process.started_at(os.getpid()))

ROWS = 1000
SIG = "serving_default"
CALLS = 400

# Run in a fresh process: thread counts are fixed at TensorFlow's first op. Prints the CPU
# time (µs per call, from each thread's schedstat) of every thread but the caller's over
# CALLS calls, for the call path the runtime chose and for the direct call beside it.
OTHER_THREADS_CPU = """
import json, os, sys
from pathlib import Path
from mpspool.demo_model import demo_inputs
from mpspool.worker.runtime import load_saved_model

model_dir, shared, work_dir, inter, calls = sys.argv[1:6]
rt = load_saved_model(model_dir, "demo", 1, intra_op_threads=1, inter_op_threads=int(inter),
                      weights_segment=shared, work_dir=work_dir)
rt.warm_up()
inputs = demo_inputs(1, 1000)

def others():
    total = 0
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        if task.name != str(os.getpid()):
            total += int((task / "schedstat").read_text().split()[0])  # ns on a CPU
    return total

def count():
    for _ in range(20):
        rt.run("serving_default", inputs, ["score"])
    before = others()
    for _ in range(int(calls)):
        rt.run("serving_default", inputs, ["score"])
    return (others() - before) / 1000 / int(calls)

found = {"path": rt.call_paths["serving_default"], "chosen": count()}
rt._sessions["serving_default"] = None
found["direct"] = count()
print(json.dumps(found))
"""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_demo_model(tmp_path_factory.mktemp("demo"), embedding_rows=ROWS)


@pytest.fixture
def shared(model_dir: Path) -> Iterator[Path]:
    path = segment.SHM_DIR / f"mpspool-test-{os.getpid()}-{secrets.token_hex(4)}-session"
    publish(model_dir, "demo", 1, path, *OWNER)
    yield path
    path.unlink(missing_ok=True)


def _other_threads_cpu(model_dir: Path, shared: Path, work_dir: Path, inter: int) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", OTHER_THREADS_CPU, str(model_dir), str(shared), str(work_dir),
         str(inter), str(CALLS)],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_session_call_runs_on_the_workers_thread(
    model_dir: Path, shared: Path, tmp_path: Path
) -> None:
    found = _other_threads_cpu(model_dir, shared, tmp_path, inter=1)
    assert found["path"] == "session"
    # The direct call hands every call to TensorFlow's inter-op thread and waits for it
    # (38-51 µs of that thread's CPU per call here); the session call runs the graph itself
    # (0.0).
    assert found["direct"] >= 10, found
    assert found["chosen"] <= 2, found


def test_more_inter_op_threads_leave_the_graph_to_them(
    model_dir: Path, shared: Path, tmp_path: Path
) -> None:
    found = _other_threads_cpu(model_dir, shared, tmp_path, inter=2)
    assert found["path"] == "session"
    assert found["chosen"] >= 10, found


@pytest.fixture(scope="module")
def three_output_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_three_outputs(tmp_path_factory.mktemp("three") / "1")


@pytest.fixture
def three_shared(three_output_dir: Path) -> Iterator[Path]:
    path = segment.SHM_DIR / f"mpspool-test-{os.getpid()}-{secrets.token_hex(4)}-three"
    publish(three_output_dir, "three", 1, path, *OWNER)
    yield path
    path.unlink(missing_ok=True)


def test_the_session_call_answers_and_fails_as_the_keyword_call(
    three_output_dir: Path, three_shared: Path, tmp_path: Path
) -> None:
    runtime = load_saved_model(
        str(three_output_dir), "three", 1, weights_segment=str(three_shared), work_dir=str(tmp_path)
    )
    runtime.warm_up()
    assert runtime.call_paths == {SIG: "session"}
    aliases = ["aa_next", "mm_shout", "zz_scaled"]
    got = runtime.run(SIG, THREE_INPUTS, aliases)
    np.testing.assert_array_equal(got["zz_scaled"], [[1.0, 20.0], [3.0, 40.0]])
    assert got["aa_next"].dtype == np.int32 and got["aa_next"].tolist() == [8, 9]
    assert list(got["mm_shout"]) == [b"AB", b"C"]
    assert list(runtime.run(SIG, THREE_INPUTS, ["aa_next"])) == ["aa_next"]

    bad = dict(THREE_INPUTS, x=np.ones((2, 3), np.float32))  # cannot broadcast with [1, 2]
    with pytest.raises(ServingError) as info:
        runtime.run(SIG, bad, ["zz_scaled"])
    # The kernel's own words, without the session's node and function tags (the operands'
    # order is the optimized graph's).
    assert info.value.code == Code.INVALID_ARGUMENT
    assert re.fullmatch(r"Incompatible shapes: \[\d,\d\] vs\. \[\d,\d\]", info.value.message)
    # and it serves on
    assert runtime.run(SIG, THREE_INPUTS, ["aa_next"])["aa_next"].tolist() == [8, 9]

    runtime._drop_fast_calls(SIG)  # type: ignore[attr-defined]
    assert runtime.call_paths == {SIG: "keywords"}
    want = runtime.run(SIG, THREE_INPUTS, aliases)
    for alias in aliases:
        assert want[alias].dtype == got[alias].dtype
        assert want[alias].tolist() == got[alias].tolist()


def test_a_model_without_variables_gets_the_session_call(tmp_path: Path) -> None:
    """Nothing to assign: the callable of no target that would assign it was refused
    ("Must specify at least one target"), and such models were called directly (found by
    a hunt)."""
    import tensorflow as tf

    class Plain(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([None], tf.float32, name="x")])
        def double(self, x: tf.Tensor) -> dict[str, tf.Tensor]:
            return {"y": x * 2}

    module = Plain()
    version = tmp_path / "plain" / "1"
    tf.saved_model.save(module, str(version), signatures={SIG: module.double})
    path = segment.SHM_DIR / f"mpspool-test-{os.getpid()}-{secrets.token_hex(4)}-plain"
    try:
        publish(version, "plain", 1, path, *OWNER)
        runtime = load_saved_model(
            str(version), "plain", 1, weights_segment=str(path), work_dir=str(tmp_path / "w")
        )
        runtime.warm_up()
        assert runtime.call_paths == {SIG: "session"}
        x = np.array([1.5, -2.0], np.float32)
        assert runtime.run(SIG, {"x": x}, ["y"])["y"].tolist() == [3.0, -4.0]
    finally:
        path.unlink(missing_ok=True)


# Run in a fresh process (the caller's thread is changed for good): a session call and
# TensorFlow's own call of the same signature, on denormal inputs.
DENORMALS = """
import json, os, sys
from pathlib import Path
import numpy as np
import tensorflow as tf
from mpspool.worker.publish import publish
from mpspool.worker.runtime import load_saved_model

version, shared, work_dir, pid, started = sys.argv[1:6]
publish(version, "tiny", 1, Path(shared), int(pid), float(started))
rt = load_saved_model(version, "tiny", 1, intra_op_threads=1, inter_op_threads=1,
                      weights_segment=shared, work_dir=work_dir)
rt.warm_up()
x = np.array([1e-40, 1e-39, 1.0], np.float32)
session = rt.run("serving_default", {"x": x}, ["y"])["y"]
direct = tf.saved_model.load(version).signatures["serving_default"](x=tf.constant(x))["y"]
print(json.dumps({"path": rt.call_paths["serving_default"], "session": session.tolist(),
                  "tensorflow": direct.numpy().tolist()}))
"""


def test_the_session_call_flushes_denormals_as_tensorflows_threads_do(tmp_path: Path) -> None:
    """Run on the worker's own thread, the graph kept denormal floats where TensorFlow's
    threads (its call of the signature, TF Serving's session runs) flush them to zero: a
    model's answers differed from TensorFlow's, and with the batch size (found by a hunt)."""
    import tensorflow as tf

    class Tiny(tf.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = tf.Variable(1.0)

        @tf.function(input_signature=[tf.TensorSpec([None], tf.float32, name="x")])
        def scale(self, x: tf.Tensor) -> dict[str, tf.Tensor]:
            return {"y": x * self.w}

    module = Tiny()
    version = tmp_path / "tiny" / "1"
    tf.saved_model.save(module, str(version), signatures={SIG: module.scale})
    path = segment.SHM_DIR / f"mpspool-test-{os.getpid()}-{secrets.token_hex(4)}-tiny"
    try:
        out = subprocess.run(
            [sys.executable, "-c", DENORMALS, str(version), str(path), str(tmp_path / "w"),
             *map(str, OWNER)],
            capture_output=True, text=True, timeout=120, check=True,
        ).stdout  # fmt: skip
    finally:
        path.unlink(missing_ok=True)
    found = json.loads(out.strip().splitlines()[-1])
    assert found["path"] == "session"
    assert found["session"] == found["tensorflow"] == [0.0, 0.0, 1.0], found


def test_weights_not_shared_are_called_directly(three_output_dir: Path) -> None:
    # Without a segment the variables' buffers are the eager context's own: nothing for a
    # session to adopt without a copy, so the eager direct call serves.
    runtime = load_saved_model(str(three_output_dir), "three", 1)
    runtime.warm_up()
    assert runtime.call_paths == {SIG: "direct"}


@pytest.fixture(scope="module")
def parsing_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Serialized tf.Examples in, a required feature (so warm-up's empty strings fail), a
    string output (a label) and a float one out."""
    import tensorflow as tf

    class Parse(tf.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weights = tf.Variable([[1.0, -1.0, 0.5], [0.5, 2.0, -1.0]])

        @tf.function(input_signature=[tf.TensorSpec([None], tf.string, name="examples")])
        def serve(self, examples: tf.Tensor) -> dict[str, tf.Tensor]:
            features = tf.io.parse_example(examples, {"x": tf.io.FixedLenFeature([2], tf.float32)})
            scores = tf.matmul(features["x"], self.weights)
            labels = tf.constant([b"low", b"mid", b"high"])
            return {"scores": scores, "label": tf.gather(labels, tf.argmax(scores, axis=1))}

    path = tmp_path_factory.mktemp("parse") / "1"
    module = Parse()
    tf.saved_model.save(module, str(path), signatures={SIG: module.serve.get_concrete_function()})
    return path


def _examples(*xs: tuple[float, float]) -> dict[str, np.ndarray]:
    import tensorflow as tf

    serialized = [
        tf.train.Example(
            features=tf.train.Features(
                feature={"x": tf.train.Feature(float_list=tf.train.FloatList(value=list(x)))}
            )
        ).SerializeToString()
        for x in xs
    ]
    return {"examples": np.array(serialized, dtype=object)}


@pytest.fixture
def parsing_runtime(parsing_dir: Path, tmp_path: Path) -> Iterator[object]:
    path = segment.SHM_DIR / f"mpspool-test-{os.getpid()}-{secrets.token_hex(4)}-parse"
    publish(parsing_dir, "parse", 1, path, *OWNER)
    try:
        runtime = load_saved_model(
            str(parsing_dir), "parse", 1, weights_segment=str(path), work_dir=str(tmp_path)
        )
        runtime.warm_up()  # skipped: the examples lack their required feature
        yield runtime
    finally:
        path.unlink(missing_ok=True)


def test_a_signature_warm_up_cannot_run_is_checked_on_its_first_request(
    parsing_runtime: Any,
) -> None:
    runtime = parsing_runtime
    assert runtime.call_paths == {SIG: "session"} and runtime._unchecked == {SIG}
    inputs = _examples((1.0, 2.0), (3.0, -1.0))
    want = {"label": [b"mid", b"low"], "scores": [[2.0, 3.0, -1.5], [2.5, -5.0, 2.5]]}
    for _ in range(2):  # the first answered by the keyword call, the second by the session
        got = runtime.run(SIG, inputs, ["label", "scores"])
        assert got["label"].tolist() == want["label"]  # strings compared by value, not pointer
        np.testing.assert_allclose(got["scores"], want["scores"])
        assert runtime.call_paths == {SIG: "session"} and runtime._unchecked == set()


def test_a_first_request_that_disagrees_leaves_the_keyword_call(parsing_runtime: Any) -> None:
    runtime = parsing_runtime
    runtime._sessions[SIG].outputs.reverse()  # as if TensorFlow's fetch order were misread
    got = runtime.run(SIG, _examples((1.0, 2.0)), ["label"])
    assert got["label"].tolist() == [b"mid"]
    runtime.check_deferred()  # the serving loop's step once the answer is sent
    assert runtime.call_paths == {SIG: "keywords"}


def test_a_first_request_waits_for_one_call_and_its_check_comes_after(
    parsing_runtime: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first request is answered by the public call alone; the fast call, with its own
    first-call set-up, is checked afterwards on a copy of the request's inputs (which were
    views of the socket's buffer), and before any other call."""
    runtime = parsing_runtime
    paths: list[str] = []
    run = runtime._run

    def counted(key: str, *args: Any) -> Any:
        paths.append(runtime._call_path(key))
        return run(key, *args)

    monkeypatch.setattr(runtime, "_run", counted)
    inputs = _examples((1.0, 2.0))
    got = runtime.run(SIG, inputs, ["label"])
    assert got["label"].tolist() == [b"mid"]
    assert paths == ["keywords"] and runtime.has_deferred_check
    inputs["examples"][0] = b"changed after the answer"  # the socket's buffer, reused
    runtime.check_deferred()
    assert paths == ["keywords", "session"] and not runtime.has_deferred_check
    assert runtime.call_paths == {SIG: "session"}  # the copy was checked, and agreed
    # A check left waiting runs before the next call, whoever makes it.
    runtime._unchecked.add(SIG)
    runtime.run(SIG, _examples((1.0, 2.0)), ["label"])
    runtime.run(SIG, _examples((3.0, -1.0)), ["label"])
    assert paths[2:] == ["keywords", "session", "session"]


def test_a_bad_first_request_fails_as_the_public_call_and_checks_nothing(
    parsing_runtime: Any,
) -> None:
    runtime = parsing_runtime
    with pytest.raises(ServingError) as info:
        runtime.run(SIG, {"examples": np.array([b"not a tf.Example"], dtype=object)}, ["label"])
    assert info.value.code == Code.INVALID_ARGUMENT
    assert runtime._unchecked == {SIG}
    assert runtime.run(SIG, _examples((0.0, 1.0)), ["label"])["label"].tolist() == [b"mid"]
    assert runtime.call_paths == {SIG: "session"} and runtime._unchecked == set()


def test_a_session_tensorflow_refuses_leaves_the_direct_call(three_output_dir: Path) -> None:
    import tensorflow as tf

    from mpspool.worker.session_call import session_call

    runtime = load_saved_model(str(three_output_dir), "three", 1)
    spec = runtime.specs[SIG]
    loaded = tf.saved_model.load(str(three_output_dir))
    function = loaded.signatures[SIG]
    order = list(function.function_type.parameters)
    (variable,) = function.variables
    right = _aligned(variable.numpy())
    call = session_call(function, order, spec, {id(variable): right}, 1, 1)
    assert call is not None
    assert call(THREE_INPUTS)["zz_scaled"].tolist() == [[1.0, 20.0], [3.0, 40.0]]
    for wrong in (
        _aligned(np.zeros((2, 1), np.float32)),  # the variable is [1, 2]
        _aligned(right.astype(np.float64)),
        _aligned(right, offset=4),  # TensorFlow would copy it
    ):
        assert session_call(function, order, spec, {id(variable): wrong}, 1, 1) is None
    assert session_call(function, order, spec, {}, 1, 1) is None  # not a shared variable


def _aligned(array: np.ndarray, offset: int = 0) -> np.ndarray:
    """A copy of ``array`` starting ``offset`` bytes past a 64-byte boundary."""
    raw = np.zeros(array.nbytes + 128, np.uint8)
    start = -raw.ctypes.data % 64 + offset
    out = raw[start : start + array.nbytes].view(array.dtype).reshape(array.shape)
    out[...] = array
    return out
