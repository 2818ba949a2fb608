"""--model_config_file: TF Serving's ModelServerConfig, written with the official
`tensorflow_serving` messages, read into what a pool serves; every file a pool cannot serve
as written refused with a one-line reason."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf import text_format, unknown_fields
from tensorflow_serving.config import model_server_config_pb2 as official

from mpspool.config import ConfigError, PoolConfig, ServedModel
from mpspool.model_config import ModelEntry, read_model_config
from mpspool.protos import server_config_pb2
from mpspool.supervisor.disk_view import read_disk_view


def official_config(**policy: object) -> official.ModelServerConfig:
    config = official.ModelServerConfig()
    model = config.model_config_list.config.add()
    model.name = "wdl"
    model.base_path = "/models/wdl"
    model.model_platform = "tensorflow"
    model.version_labels["stable"] = 1
    model.version_labels["canary"] = 2
    for kind, value in policy.items():
        choice = getattr(model.model_version_policy, kind)
        if kind == "latest":
            choice.num_versions = value
        elif kind == "specific":
            choice.versions.extend(value)
        else:
            choice.SetInParent()
    return config


def write(tmp_path: Path, config: object | str) -> Path:
    path = tmp_path / "models.config"
    path.write_text(config if isinstance(config, str) else text_format.MessageToString(config))
    return path


@pytest.mark.parametrize(
    "policy, text",
    [
        ({}, "latest:1"),
        ({"latest": 0}, "latest:1"),  # TF Serving's default number of versions
        ({"latest": 3}, "latest:3"),
        ({"all": None}, "all"),
        ({"specific": [3, 1, 3]}, "specific:1,3"),
    ],
)
def test_a_file_tf_serving_reads_is_read_the_same(tmp_path: Path, policy: dict, text: str):
    (entry,) = read_model_config(write(tmp_path, official_config(**policy)))
    assert entry == ModelEntry(
        name="wdl",
        base_path="/models/wdl",
        version_policy=text,
        labels={"stable": 1, "canary": 2},
    )


def test_the_binary_form_is_tf_servings_field_for_field():
    theirs = official_config(specific=[1, 2])
    ours = server_config_pb2.ModelServerConfig.FromString(theirs.SerializeToString())
    assert len(unknown_fields.UnknownFieldSet(ours.model_config_list.config[0])) == 0
    assert ours.SerializeToString(deterministic=True) == theirs.SerializeToString(
        deterministic=True
    )


def test_a_relative_base_path_is_taken_from_where_the_pool_starts(tmp_path: Path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = write(tmp_path, 'model_config_list { config { name: "m" base_path: "models/m" } }')
    assert read_model_config(path)[0].base_path == str(tmp_path / "models" / "m")
    # Through a link, the link stays: a deploy that swaps it (git-sync, a `current` link) is
    # read at the next poll, as TF Serving reads its base path; resolved once, the pool kept
    # the old target (and failed a worker's restart once that was removed).
    (tmp_path / "rel1").mkdir()
    (tmp_path / "current").symlink_to("rel1")
    path = write(tmp_path, 'model_config_list { config { name: "m" base_path: "current" } }')
    assert read_model_config(path)[0].base_path == str(tmp_path / "current")


def test_every_model_of_the_list_is_read_in_its_order(tmp_path: Path):
    path = write(
        tmp_path,
        'model_config_list { config { name: "wdl" base_path: "/m/wdl" } '
        'config { name: "ranker" base_path: "/m/ranker" '
        "model_version_policy { all { } } "
        'version_labels { key: "stable" value: 3 } } }',
    )
    assert read_model_config(path) == [
        ModelEntry(name="wdl", base_path="/m/wdl", version_policy="latest:1"),
        ModelEntry(
            name="ranker", base_path="/m/ranker", version_policy="all", labels={"stable": 3}
        ),
    ]


@pytest.mark.parametrize(
    "text, says",
    [
        (
            'model_config_list { config { name: "a" base_path: "/a" } '
            'config { name: "a" base_path: "/b" } }',
            "Illegal to list model a multiple times in config list",
        ),
        ("model_config_list { }", "model_config_list lists no model"),
        ("", "no model_config_list"),
        ('model_config_list { config { base_path: "/a" } }', "a model config needs a name"),
        ('model_config_list { config { name: "a" } }', "model 'a': base_path is required"),
        (
            'model_config_list { config { name: "a" base_path: "/a" model_platform: "pytorch" } }',
            "model 'a': model_platform 'pytorch'; mpspool serves tensorflow SavedModels",
        ),
        (
            'model_config_list { config { name: "a" base_path: "/a" '
            "logging_config { sampling_config { sampling_rate: 0.1 } } } }",
            "model 'a': logging_config (request logging) is not supported",
        ),
        (
            'model_config_list { config { name: "a" base_path: "/a" '
            'version_labels { key: "old" value: -1 } } }',
            "label 'old' names version -1, not >= 0",
        ),
        (
            'model_config_list { config { name: "a" base_path: "/a" '
            "model_version_policy { specific { } } } }",
            "model_version_policy specific lists no versions",
        ),
        (
            'model_config_list { config { name: "a" base_path: "gs://bucket/models/a" } }',
            "model 'a': base path gs://bucket/models/a is a URI; mpspool reads models from a "
            "local path",
        ),
        (
            'model_config_list { config { name: "a" base_pth: "/a" } }',
            'is not a ModelServerConfig: 1:40 : Message type "mpspool.tfs.ModelConfig" has no '
            'field named "base_pth".',
        ),
    ],
)
def test_a_file_a_pool_cannot_serve_is_refused_with_why(tmp_path: Path, text: str, says: str):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as refused:
        read_model_config(path)
    assert says in str(refused.value)
    assert str(path) in str(refused.value)


def test_bytes_that_are_not_utf8_pass_in_a_comment_and_are_refused_in_a_value(tmp_path: Path):
    """A comment saved in Latin-1 is read, as TF Serving's parser reads it; in a string field
    such a byte is a one-line refusal naming its line and column. Before, either was a
    UnicodeDecodeError: a traceback at start, and the end of a pool that read the file
    again while serving (found by an operator's hunt)."""
    path = tmp_path / "models.config"
    body = b'model_config_list { config { name: "a" base_path: "/a" } }\n'
    path.write_bytes(b"# r\xe9glages du mod\xe8le\n" + body)
    (entry,) = read_model_config(path)
    assert (entry.name, entry.base_path) == ("a", "/a")
    path.write_bytes(body.replace(b"/a", b"/r\xe9"))
    with pytest.raises(ConfigError) as refused:
        read_model_config(path)
    said = str(refused.value)
    assert said.startswith(f"{path} is not a ModelServerConfig: 1:") and "\n" not in said, said
    said.encode("utf-8")  # printable and loggable: no lone surrogate left in it


def test_a_file_uri_is_the_path_it_names(tmp_path: Path):
    path = write(tmp_path, 'model_config_list { config { name: "a" base_path: "file:///m/a" } }')
    (entry,) = read_model_config(path)
    assert entry.base_path == "/m/a"


def test_start_refuses_a_uri_base_path_in_one_line(tmp_path: Path):
    """It was made absolute (<cwd>/s3:/bucket/m) and the start waited for good."""
    out = subprocess.run(
        [sys.executable, "-m", "mpspool", "start", "--model_base_path=s3://bucket/m",
         "--run-dir", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines() == [
        "mpspool: --model_base_path: base path s3://bucket/m is a URI; mpspool reads models "
        "from a local path (copy the model onto a volume the pool can read, and give that path)"
    ]


def test_a_missing_file_is_refused(tmp_path: Path):
    with pytest.raises(ConfigError, match=r"cannot read --model_config_file .*nope\.config"):
        read_model_config(tmp_path / "nope.config")


def test_start_ignores_a_model_name_and_base_path_beside_the_file_as_tf_serving(
    tmp_path: Path,
):
    """TF Serving's Docker image passes --model_name and --model_base_path to every start,
    and users add --model_config_file: TF Serving ignores the two there; they were refused.
    (The file here is refused once read, so that nothing starts.)"""
    path = write(tmp_path, 'model_config_list { config { name: "a" base_path: "gs://b/a" } }')
    out = subprocess.run(
        [sys.executable, "-m", "mpspool", "start", "--model_name=other",
         "--model_base_path=/models/other", f"--model_config_file={path}",
         "--run-dir", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 2
    said = out.stderr.strip().splitlines()
    assert said[0] == (
        "mpspool: --model_name and --model_base_path ignored: --model_config_file names the "
        "models and their base paths (as TF Serving ignores them there)"
    )
    assert said[1].startswith(f"mpspool: {path}: model 'a': base path gs://b/a is a URI"), said
    out = subprocess.run(
        [sys.executable, "-m", "mpspool", "start", "--run-dir", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
    )  # fmt: skip
    assert (out.returncode, out.stderr) == (
        2,
        "mpspool: give --model_base_path, --model_config_file or --demo\n",
    )


@pytest.mark.parametrize(
    "given, says",
    [
        (["--model-workers", "wdl=0"], "--model-workers takes NAME=N with N >= 1, got 'wdl=0'"),
        (
            ["--model-workers", "ranker=2"],
            "--model-workers 'ranker=2': the config file lists 'wdl'",
        ),
        (["--model-workers", "wdl=1", "--model-workers", "wdl=2"], "names 'wdl' twice"),
        # str.isdigit() takes a superscript two, int() does not: a traceback before.
        (["--model-workers", "wdl=\u00b2"], "--model-workers takes NAME=N with N >= 1"),
    ],
)
def test_start_refuses_model_workers_for_models_the_file_does_not_list(
    tmp_path: Path, given: list[str], says: str
):
    path = write(tmp_path, official_config())
    out = subprocess.run(
        [sys.executable, "-m", "mpspool", "start", "--model_config_file", str(path), *given,
         "--run-dir", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr
    assert says in out.stderr


def test_model_workers_needs_a_config_file(tmp_path: Path):
    out = subprocess.run(
        [sys.executable, "-m", "mpspool", "start", "--demo", "--model-workers", "demo=2",
         "--run-dir", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 2
    assert "--model-workers names models of --model_config_file" in out.stderr


def _saved_models(root: Path, *names: str) -> dict[str, str]:
    """A version 1 folder with a saved_model.pb (empty: only its presence is read) for each
    name; name → base path."""
    for name in names:
        (root / name / "1").mkdir(parents=True)
        (root / name / "1" / "saved_model.pb").write_bytes(b"")
    return {name: str(root / name) for name in names}


def test_a_model_added_while_serving_gets_the_workers_model_workers_gave_it(tmp_path: Path):
    """A model --model-workers sized, removed by a reload and added back, came back with
    --workers (found by a hunt: capacity halved without a word)."""
    paths = _saved_models(tmp_path, "a", "b")
    config = PoolConfig(
        model_name="a", model_base_path=paths["a"], model_version=1, run_dir="/r",
        log_dir="/l", workers=1, model_workers={"b": 2},
    )  # fmt: skip
    entries = [ModelEntry("a", paths["a"], "latest:1"), ModelEntry("b", paths["b"], "latest:1")]
    view = read_disk_view(config, entries, "the test")
    assert view.refusal == "" and view.added is not None
    assert (view.added.workers_of("a"), view.added.workers_of("b")) == (1, 2)


def test_the_first_models_name_is_free_as_a_pool_of_one_models_is(tmp_path: Path):
    """It names no process or file (its slots are cpu-N): a name a reload could add to a pool
    that started with it alone was refused at start beside a second model."""
    paths = _saved_models(tmp_path, "my model", "b")
    config = PoolConfig(
        model_name="my model", model_base_path=paths["my model"], model_version=1,
        run_dir="/r", log_dir="/l", workers=1, models=(
            ServedModel("my model", paths["my model"], 1, "latest:1", {}),
            ServedModel("b", paths["b"], 1, "latest:1", {}),
        ),
    )  # fmt: skip
    config._validate_models()
    named = dataclasses.replace(
        config, models=(config.models[0], ServedModel("_b", paths["b"], 1, "latest:1", {}))
    )
    with pytest.raises(ConfigError, match="that begin with a letter or digit"):
        named._validate_models()
