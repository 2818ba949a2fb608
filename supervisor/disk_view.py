"""What a model config about to apply needs from the disk, read on a thread of its own
(background_read.py) instead of on the controller's loop: each base path listed and followed
through its links, and each model the config adds given its first version and checked.

A HandleReloadConfigRequest, or a changed --model_config_file, that named a base path on
storage that stopped answering held the loop while it read: no worker replaced, no status
answered, a stop only by SIGTERM. Now the loop serves on and the config applies once its
reads return. A view is read for one configuration (`based_on`): the controller applies it
only while that configuration is still the pool's, else reads the disk again.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

from mpspool.config import ConfigError, PoolConfig, ServedModel
from mpspool.demo_model import versions_on_disk
from mpspool.model_config import ModelEntry, NoVersionYet, first_version


@dataclass(frozen=True)
class DiskView:
    based_on: PoolConfig  # the pool's configuration when the reads began
    entries: tuple[ModelEntry, ...]  # the config to apply, as given
    # Each base path (the entries', and those of the served models they keep) → its versions
    # on disk (None: it could not be read) and where its links lead.
    listed: dict[str, frozenset[int] | None]
    real: dict[str, str]
    # `based_on` with the models the entries add (each at its first version), checked;
    # None when none is added or when they cannot be (`refusal` says why).
    added: PoolConfig | None
    refusal: str
    # Models the config adds that have no version to serve yet, left out of `added` (only
    # when the read was asked to wait for them: `read_disk_view`'s `wait_for_versions`),
    # with why: TF Serving's file poll adds such a model and serves it once a version is
    # copied in, and applies the rest of the file meanwhile.
    waiting: tuple[tuple[str, str], ...] = ()

    def waiting_entries(self) -> tuple[ModelEntry, ...]:
        """The entries of the models in `waiting`."""
        names = {name for name, _ in self.waiting}
        return tuple(e for e in self.entries if e.name in names)

    def versions(self, base_path: str) -> set[int] | None:
        """The versions under a base path as read (None: unreadable)."""
        listed = self.listed.get(base_path)
        return None if listed is None else set(listed)

    def same_folder(self, a: str, b: str) -> bool:
        """Whether two paths name one folder: equal, or the same once their links are
        followed (as read)."""
        return a == b or self.real.get(a, a) == self.real.get(b, b)


def read_disk_view(
    config: PoolConfig, entries: list[ModelEntry], source: str, wait_for_versions: bool = False
) -> DiskView:
    """The reads (on a background thread: nothing here touches the controller's state).
    ConfigError and OSError of an added model become the view's refusal; other exceptions
    are the caller's. With `wait_for_versions`, an added model with no version yet is left
    out and named in `waiting` instead of refusing the whole view."""
    served = {m.name: m for m in config.served_models()}
    named = {e.name for e in entries}
    # Only what the config keeps or adds: a model it drops may be on the storage that
    # stopped answering, and its removal would wait on it.
    paths = {e.base_path for e in entries} | {
        m.base_path for m in served.values() if m.name in named
    }
    listed: dict[str, frozenset[int] | None] = {}
    real: dict[str, str] = {}
    for path in sorted(paths):
        try:
            listed[path] = frozenset(versions_on_disk(path))
        except OSError:
            listed[path] = None
        real[path] = os.path.realpath(path)
    added_entries = [e for e in entries if e.name not in served]
    waiting: list[tuple[str, str]] = []
    refusal = ""
    if wait_for_versions:
        for entry in added_entries:
            try:
                # A name it cannot have is refused now, not promised "added once it has
                # one" and refused then, holding back the others waiting with it (found by
                # a review).
                config.check_added_name(entry.name)
            except ConfigError as exc:
                refusal = f"{source}: {exc}"
                break
            try:
                first_version(Path(entry.base_path), entry.version_policy, entry.name)
            except NoVersionYet as exc:
                waiting.append((entry.name, str(exc)))
            except (ConfigError, OSError):
                pass  # refused below, with the others' reasons
        left_out = {name for name, _ in waiting}
        added_entries = [e for e in added_entries if e.name not in left_out]
    added: PoolConfig | None = None
    if refusal:
        return DiskView(config, tuple(entries), listed, real, None, refusal, tuple(waiting))
    if added_entries:
        try:
            added = _with_added(config, added_entries)
        except (ConfigError, OSError) as exc:
            refusal = f"{source}: {exc}"
    return DiskView(config, tuple(entries), listed, real, added, refusal, tuple(waiting))


def _with_added(config: PoolConfig, added: list[ModelEntry]) -> PoolConfig:
    """`config` with each added model at the newest version its policy wants, checked (a
    SavedModel there, a name fit for process and file names)."""
    models = list(config.served_models())
    for entry in added:
        version = first_version(Path(entry.base_path), entry.version_policy, entry.name)
        workers = config.model_workers.get(entry.name, 0)
        models.append(
            ServedModel(
                entry.name,
                entry.base_path,
                version,
                entry.version_policy,
                dict(entry.labels),
                workers,
            )
        )
    config = dataclasses.replace(config, models=tuple(models))
    for entry in added:
        config.validate_added(entry.name)
    return config
