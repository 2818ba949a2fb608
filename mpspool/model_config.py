"""TF Serving's `--model_config_file` (a ModelServerConfig in protobuf text format) read into
what a pool serves: each model's name and base path, its version policy and its version labels.

    model_config_list {
      config {
        name: "wdl"
        base_path: "/models/wdl"
        model_platform: "tensorflow"
        model_version_policy { specific { versions: 1 versions: 2 } }
        version_labels { key: "stable" value: 1 }
        version_labels { key: "canary" value: 2 }
      }
    }

Every model listed gets workers of its own (`mpspool start --model-workers NAME=N` sets how
many; by default each gets --workers, or --contexts-per-gpu on GPUs), its own versions and
weight segments; the front door routes by the name a request gives. Read again every
`--model_config_file_poll_wait_seconds`, or sent with `ModelService/HandleReloadConfigRequest`,
each model's policy and labels change while the pool serves, models not served are added
and served models left out are removed (the controller's `_apply_model_entries`); a model at
another base path, or the pool's first model left out, is refused (said, nothing changed).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from mpspool.config import ConfigError, read_text_proto

FLAG = "--model_config_file"


@dataclass(frozen=True)
class ModelEntry:
    """One `config { ... }` of the file, checked."""

    name: str
    base_path: str  # absolute
    version_policy: str  # supervisor/versions.py's text: "latest:N", "all", "specific:V,..."
    labels: dict[str, int] = field(default_factory=dict)


def read_model_config(path: Path) -> list[ModelEntry]:
    """The file's models, in its order; ConfigError (one line, naming the file) for anything
    a pool cannot serve as written."""
    from mpspool.protos import server_config_pb2

    config = read_text_proto(path, FLAG, server_config_pb2.ModelServerConfig(), "a")
    return model_entries(config, str(path))


def model_entries(config: object, source: str) -> list[ModelEntry]:
    """The models of a ModelServerConfig (from a file, or a HandleReloadConfigRequest), each
    named once; ConfigError whose message starts with `source`."""
    from mpspool.protos import server_config_pb2

    assert isinstance(config, server_config_pb2.ModelServerConfig)
    if config.WhichOneof("config") != "model_config_list":
        if source == "HandleReloadConfigRequest":  # TF Serving's words (model_service_impl.cc)
            raise ConfigError(
                "ServerModelConfig type not supported by HandleReloadConfigRequest. Only "
                "ModelConfigList is currently supported"
            )
        raise ConfigError(f"{source}: no model_config_list")
    models = list(config.model_config_list.config)
    if not models:
        raise ConfigError(f"{source}: model_config_list lists no model (config {{ ... }})")
    entries = [_entry(source, model) for model in models]
    names = [e.name for e in entries]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        # TF Serving refuses the same (ServerCore: "Illegal to list model ... multiple times").
        raise ConfigError(
            f"{source}: Illegal to list model {twice[0]} multiple times in config list"
        )
    return entries


def _entry(source: str, model: object) -> ModelEntry:
    from mpspool.protos import server_config_pb2

    assert isinstance(model, server_config_pb2.ModelConfig)
    where = f"{source}: model {model.name!r}"
    if not model.name:
        raise ConfigError(f"{source}: a model config needs a name")
    if not model.base_path:
        raise ConfigError(f"{where}: base_path is required")
    if model.model_platform not in ("", "tensorflow"):
        raise ConfigError(
            f"{where}: model_platform {model.model_platform!r}; mpspool serves tensorflow "
            "SavedModels"
        )
    if model.model_type == server_config_pb2.OTHER:
        raise ConfigError(f"{where}: model_type OTHER; mpspool serves tensorflow SavedModels")
    if model.HasField("logging_config"):
        raise ConfigError(f"{where}: logging_config (request logging) is not supported")
    labels = dict(model.version_labels)
    for label, version in labels.items():
        if not label:
            raise ConfigError(f"{where}: a version label needs a name")
        if version < 0:
            raise ConfigError(f"{where}: label {label!r} names version {version}, not >= 0")
    return ModelEntry(
        name=model.name,
        # A relative path is taken from where the pool started (TF Serving's server refuses
        # one: ValidateModelConfigList, with no model_config_list_root_dir). Links kept: the
        # path is read through them at each poll, as TF Serving reads it.
        base_path=local_base_path(model.base_path, where),
        version_policy=_policy_text(where, model.model_version_policy),
        labels=labels,
    )


_URI = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")


def local_base_path(path: str, where: str) -> str:
    """A base path as the pool reads it: absolute (a relative one from where the pool
    starts, which TF Serving refuses), links kept, `file://` taken as the path it names.
    ConfigError for another URI (gs://, s3://, hdfs://), which TF Serving reads through its
    file systems: made absolute it named a folder of the working directory that never came,
    and the pool waited for it for good."""
    if "\0" in path:  # (every read of it raised ValueError: a reload's ended the controller)
        raise ConfigError(f"{where}: base path {path!r} holds a NUL byte, which no path can")
    if path.startswith("file://"):
        path = path.removeprefix("file://")
    elif _URI.match(path):
        raise ConfigError(
            f"{where}: base path {path} is a URI; mpspool reads models from a local path "
            "(copy the model onto a volume the pool can read, and give that path)"
        )
    return os.path.abspath(path)


def _policy_text(where: str, policy: object) -> str:
    """TF Serving's ServableVersionPolicy as supervisor/versions.py's policy text; none set is
    TF Serving's default, the latest version."""
    from mpspool.protos import server_config_pb2

    assert isinstance(policy, server_config_pb2.ServableVersionPolicy)
    choice = policy.WhichOneof("policy_choice")
    if choice == "all":
        return "all"
    if choice == "specific":
        versions = sorted(set(policy.specific.versions))
        if not versions:
            raise ConfigError(f"{where}: model_version_policy specific lists no versions")
        if versions[0] < 0:
            raise ConfigError(f"{where}: model_version_policy specific: versions are >= 0")
        return "specific:" + ",".join(str(v) for v in versions)
    # latest { num_versions: 0 } or no policy: one version, as TF Serving.
    return f"latest:{max(1, policy.latest.num_versions) if choice == 'latest' else 1}"


class NoVersionYet(ConfigError):
    """A base path with no version the policy wants (or no base path yet): TF Serving waits
    for one at start, polling."""


def first_version(base_path: Path, policy_text: str, model: str = "") -> int:
    """The newest version under a base path that the policy wants: what a model serves first.
    NoVersionYet when there is none (yet)."""
    from mpspool.demo_model import NoServableVersionError, latest_version, versions_on_disk
    from mpspool.supervisor.versions import VersionPolicy

    flag = f"model {model!r}: version policy" if model else "--version-policy"
    try:
        policy = VersionPolicy.parse(policy_text)
    except ValueError as exc:
        raise ConfigError(f"{flag}: {exc}") from None
    try:
        latest_version(base_path)  # says what was expected when there is no version at all
        wanted = policy.aspired(versions_on_disk(base_path), set())
    except NoServableVersionError as exc:  # no base path, or nothing in it yet
        raise NoVersionYet(str(exc)) from None
    except OSError as exc:  # not readable
        raise ConfigError(str(exc)) from None
    if not wanted:
        found = ", ".join(str(v) for v in sorted(versions_on_disk(base_path)))
        raise NoVersionYet(
            f"no version in {base_path} fits {flag} {policy.describe()} (found {found})"
        )
    return max(wanted)
