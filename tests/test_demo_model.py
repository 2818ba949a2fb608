"""The demo model: TF Serving layout, version selection, reproducible weights, atomic writes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mpspool.demo_model import (
    DEFAULT_ROWS,
    NoServableVersionError,
    build_demo_model,
    demo_inputs,
    latest_version,
)

ROWS = 50  # small and unlike DEFAULT_ROWS, so a forgotten argument shows


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_demo_model(tmp_path_factory.mktemp("demo"), embedding_rows=ROWS)


def _scores(model_dir: Path, inputs: dict[str, np.ndarray]) -> np.ndarray:
    import tensorflow as tf

    serve = tf.saved_model.load(str(model_dir)).signatures["serving_default"]
    return serve(**{k: tf.constant(v) for k, v in inputs.items()})["score"].numpy()


def test_build_writes_tf_serving_layout(built: Path) -> None:
    base = built.parent
    assert built == base / "1"
    assert (built / "saved_model.pb").is_file()
    assert (built / "variables" / "variables.index").is_file()
    assert list((built / "variables").glob("variables.data-*"))
    # The staging directory was renamed into place, not left beside it.
    assert sorted(p.name for p in base.iterdir()) == ["1"]
    assert latest_version(base) == 1


def test_build_honours_version(tmp_path: Path) -> None:
    path = build_demo_model(tmp_path, embedding_rows=ROWS, version=7)
    assert path == tmp_path / "7"
    assert latest_version(tmp_path) == 7


def test_scores_are_probabilities_that_depend_on_the_inputs(built: Path) -> None:
    scores = _scores(built, demo_inputs(64, ROWS))
    assert scores.shape == (64, 1)
    assert scores.dtype == np.float32
    assert np.all((scores > 0) & (scores < 1))
    assert np.std(scores) > 1e-3  # not a constant (saturated or dead) model


def test_same_seed_gives_bit_identical_models(built: Path, tmp_path: Path) -> None:
    again = build_demo_model(tmp_path, embedding_rows=ROWS, seed=0)
    inputs = demo_inputs(128, ROWS, seed=3)
    np.testing.assert_array_equal(_scores(again, inputs), _scores(built, inputs))
    for name in ("variables.index", "variables.data-00000-of-00001"):
        assert (again / "variables" / name).read_bytes() == (
            built / "variables" / name
        ).read_bytes()


def test_other_seed_gives_other_weights(built: Path, tmp_path: Path) -> None:
    other = build_demo_model(tmp_path, embedding_rows=ROWS, seed=1)
    inputs = demo_inputs(16, ROWS)
    assert not np.array_equal(_scores(other, inputs), _scores(built, inputs))


def test_existing_version_is_not_overwritten(built: Path) -> None:
    before = (built / "saved_model.pb").read_bytes()
    with pytest.raises(FileExistsError, match="already exists"):
        build_demo_model(built.parent, embedding_rows=ROWS, version=1)
    assert (built / "saved_model.pb").read_bytes() == before


def test_the_command_keeps_an_existing_version_only_when_told(
    built: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An init container that runs again (Kubernetes may) over the volume it filled: with
    --exist-ok it succeeds and writes nothing; without, one line says what to do."""
    from mpspool.cli import main

    before = (built / "saved_model.pb").read_bytes()
    out = ["demo-model", "--out", str(built.parent), "--embedding-rows", str(ROWS)]
    assert main([*out, "--exist-ok"]) == 0
    assert "already there; kept as it is" in capsys.readouterr().out
    assert main(out) == 2
    assert "pass --exist-ok to keep it" in capsys.readouterr().err
    assert (built / "saved_model.pb").read_bytes() == before


def test_crashed_build_leaves_no_version(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import tensorflow as tf

    real_save = tf.saved_model.save

    def save_then_crash(*args: object, **kwargs: object) -> None:
        real_save(*args, **kwargs)  # a complete model on disk, then the build dies
        raise RuntimeError("killed mid-build")

    monkeypatch.setattr(tf.saved_model, "save", save_then_crash)
    with pytest.raises(RuntimeError, match="killed mid-build"):
        build_demo_model(tmp_path, embedding_rows=ROWS)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(NoServableVersionError):
        latest_version(tmp_path)


def test_build_that_loses_a_race_keeps_the_winner(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tensorflow as tf

    real_save = tf.saved_model.save

    def save_while_another_build_finishes(*args: object, **kwargs: object) -> None:
        real_save(*args, **kwargs)
        (tmp_path / "1").mkdir()
        (tmp_path / "1" / "saved_model.pb").write_bytes(b"the winner")

    monkeypatch.setattr(tf.saved_model, "save", save_while_another_build_finishes)
    with pytest.raises(FileExistsError, match="another build"):
        build_demo_model(tmp_path, embedding_rows=ROWS)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["1"]  # staging removed
    assert (tmp_path / "1" / "saved_model.pb").read_bytes() == b"the winner"


def test_latest_version_picks_highest_numeric_servable(tmp_path: Path) -> None:
    def version(name: str, marker: str | None = "saved_model.pb") -> None:
        (tmp_path / name).mkdir()
        if marker:
            (tmp_path / name / marker).touch()

    version("1")
    version("2")
    version("10", "saved_model.pbtxt")  # numeric order, not string order: 10 > 2
    version("11", None)  # a copy still in progress: no saved_model.pb yet
    version("latest")
    version(".12.partial-1-abcd")
    version("²")  # str.isdigit() says yes; int() says no
    (tmp_path / "13").write_text("a file, not a version")
    # Past int64, as TF Serving's parse skips them: the controller crashed on one (msgpack
    # could not carry it to the front door), or the front door refused its worker.
    version(str(2**63))
    version("99999999999999999999")
    assert latest_version(tmp_path) == 10
    assert latest_version(str(tmp_path)) == 10
    version(str(2**63 - 1))
    assert latest_version(tmp_path) == 2**63 - 1


def test_latest_version_without_versions_says_what_was_expected(tmp_path: Path) -> None:
    (tmp_path / "not-a-version").mkdir()
    (tmp_path / "3").mkdir()  # numeric but empty
    with pytest.raises(NoServableVersionError) as info:
        latest_version(tmp_path)
    assert isinstance(info.value, FileNotFoundError)
    message = str(info.value)
    assert str(tmp_path) in message
    assert "numeric version subdirectory" in message
    assert "saved_model.pb" in message


def test_latest_version_of_missing_base_path(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError, match="does not exist") as info:
        latest_version(missing)
    assert str(missing) in str(info.value)


def test_demo_inputs_shapes_dtypes_and_ranges() -> None:
    inputs = demo_inputs(300, embedding_rows=7, seed=5)
    assert set(inputs) == {"ids", "dense"}
    assert inputs["ids"].shape == (300, 16) and inputs["ids"].dtype == np.int64
    assert inputs["dense"].shape == (300, 13) and inputs["dense"].dtype == np.float32
    assert inputs["ids"].min() >= 0 and inputs["ids"].max() < 7
    assert len(np.unique(inputs["ids"])) == 7  # uniform over the whole table
    again = demo_inputs(300, embedding_rows=7, seed=5)
    np.testing.assert_array_equal(again["ids"], inputs["ids"])
    np.testing.assert_array_equal(again["dense"], inputs["dense"])
    assert not np.array_equal(demo_inputs(300, 7, seed=6)["dense"], inputs["dense"])
    assert demo_inputs(4)["ids"].max() < DEFAULT_ROWS


def test_importing_the_module_does_not_import_tensorflow() -> None:
    # The router imports mpspool modules and must never load TensorFlow.
    code = (
        "import sys, mpspool.demo_model; "
        "sys.exit(1 if any(m == 'tensorflow' or m.startswith('tensorflow.') for m in sys.modules)"
        " else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0
