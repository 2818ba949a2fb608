"""The demo model: a small recommendation-style SavedModel, and where to find a servable version.

It is what tests, benchmarks and the quick start serve: an embedding lookup (the part that
makes real recommendation models big, and the part mpspool shares between workers) feeding an
MLP. The table's row count is a parameter, so tests build a tiny one and benchmarks a
2,000,000-row one (488 MiB of float32) without changing anything else.

TensorFlow is imported inside the functions that need it: the router and the controller import
mpspool modules and must never pay for (or depend on) TensorFlow.
"""

from __future__ import annotations

import errno
import os
import secrets
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import tensorflow as tf

DEFAULT_ROWS = 1000
ID_COUNT = 16  # ids per example, mean-pooled
EMBEDDING_DIM = 64
DENSE_FEATURES = 13
HIDDEN_UNITS = (256, 128)
_FILL_ROWS = 1 << 16  # table rows drawn and written per step while building (16 MiB)

SAVED_MODEL_FILES = ("saved_model.pb", "saved_model.pbtxt")


class NoServableVersionError(FileNotFoundError):
    """A model base path holds no numeric version directory with a SavedModel in it."""


def build_demo_model(
    out_dir: str | Path,
    embedding_rows: int = DEFAULT_ROWS,
    version: int = 1,
    seed: int = 0,
) -> Path:
    """Write the demo SavedModel to ``out_dir/<version>`` (TF Serving's layout); return that path.

    The same ``seed`` gives bit-identical weights on every build (they come from numpy's
    generator, not TensorFlow's global RNG), so two builds serve the same scores. The model is
    written into a hidden directory beside the target and renamed into place only once it is
    complete and on disk: a crashed build never leaves a directory that looks like a version.
    Raises FileExistsError if the version already exists (versions are immutable, as TF Serving
    treats them).
    """
    if embedding_rows < 1:
        raise ValueError(f"embedding_rows must be at least 1, got {embedding_rows}")
    if version < 0:
        raise ValueError(f"version must be a non-negative integer, got {version}")
    base = Path(out_dir)
    target = base / str(version)
    if target.exists():
        raise FileExistsError(
            f"model version directory {target} already exists; versions are immutable, "
            "choose another --version or remove it"
        )
    base.mkdir(parents=True, exist_ok=True)

    import tensorflow as tf

    # Not numeric, so latest_version() never mistakes it for a version; named by PID so a
    # leftover from a crashed build is easy to attribute. os.mkdir honours the umask (mkdtemp
    # would make it 0700, and the rename would carry that onto the version directory).
    staging = base / f".{version}.partial-{os.getpid()}-{secrets.token_hex(4)}"
    staging.mkdir()
    try:
        module = _make_module_class(tf)(embedding_rows, seed)
        serve = module.serve.get_concrete_function()
        tf.saved_model.save(module, str(staging), signatures={"serving_default": serve})
        del module, serve
        _fsync_tree(staging)
        try:
            os.rename(staging, target)
        except OSError as exc:
            if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
            # Another build of the same version won the race; its model stands.
            raise FileExistsError(
                f"model version directory {target} was created by another build meanwhile"
            ) from exc
        _fsync_dir(base)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def demo_inputs(
    batch: int, embedding_rows: int = DEFAULT_ROWS, seed: int = 0
) -> dict[str, np.ndarray]:
    """A batch of realistic inputs: ids uniform over the table (int64), dense features N(0, 1)."""
    rng = np.random.default_rng(seed)
    return {
        "ids": rng.integers(0, embedding_rows, size=(batch, ID_COUNT), dtype=np.int64),
        "dense": rng.standard_normal((batch, DENSE_FEATURES), dtype=np.float32),
    }


# The largest version number: TF Serving parses a folder's name into an int64
# (`ParseVersionNumber`, absl::SimpleAtoi) and skips a folder whose name does not fit.
MAX_VERSION = 2**63 - 1


def _version_number(name: str) -> int | None:
    """The version a folder's name reads as, or None: digits only (isascii: str.isdigit()
    also accepts digits such as "²" that int() rejects), at most MAX_VERSION."""
    if not (name.isascii() and name.isdigit()):
        return None
    number = int(name)
    return number if number <= MAX_VERSION else None


def version_dir(base_path: str | Path, version: int) -> Path:
    """The folder version ``version`` loads from: ``<base>/<version>``, or else the folder
    under the base path whose name reads as that number, as TF Serving loads version 123
    from ``00000123/`` (its own tutorial model's layout; file_system_storage_path_source.cc
    joins the base path with the folder it found, the number being only the id). Only a
    folder holding a SavedModel counts (versions_on_disk's rule: not a copy in progress).
    Where two names read as one number, the plain one wins, else the last in name order (TF
    Serving takes the last in listing order). ``<base>/<version>`` when nothing matches."""
    base = Path(base_path)
    plain = base / str(version)
    plain_holds = _holds_saved_model(plain)
    if plain_holds:
        return plain  # the common case
    try:
        found = [
            (entry.name, _holds_saved_model(base / entry.name))
            for entry in os.scandir(base)
            if _version_number(entry.name) == version
        ]
    except OSError:
        return plain
    # One holding a SavedModel wins; else one that cannot be looked into is the version's
    # still (`versions_on_disk` lists it: its load says why it fails, at its own path).
    readable = sorted(name for name, holds in found if holds)
    if readable:
        return base / readable[-1]
    if plain_holds is None:
        return plain
    unreadable = sorted(name for name, holds in found if holds is None)
    return base / unreadable[-1] if unreadable else plain


def _holds_saved_model(folder: Path) -> bool | None:
    """Whether ``folder`` holds a SavedModel; None when it cannot be looked into (no
    permission, a mount failing: EACCES, EIO, ESTALE, which Path.is_file raises). That
    escaped every look at a pool's versions: a served version's folder made unreadable
    (chmod 000) failed each tick of the controller, which gave up after 10 s and ended the
    pool (found by a hunt)."""
    try:
        return any((folder / name).is_file() for name in SAVED_MODEL_FILES)
    except OSError:
        return None


def _is_version_folder(entry: Path) -> bool:
    """Whether a numeric entry of a base path is a version on disk: a folder holding a
    SavedModel, or one that cannot be looked into, listed by its name alone as TF Serving
    lists them all (its load fails and says why: PERMISSION_DENIED). One such folder failed
    the whole listing, and every version beside it went unseen, a newer one never loaded,
    with nothing but a log line said (found by a hunt)."""
    try:
        if not entry.is_dir():
            return False
    except OSError:
        return True
    return _holds_saved_model(entry) is not False


def versions_on_disk(base_path: str | Path) -> set[int]:
    """The numeric subdirectories of ``base_path`` holding a SavedModel (TF Serving's rule).

    Non-numeric entries (staging directories, README files), numbers past MAX_VERSION (the
    controller crashed telling the front door of one) and numeric directories without
    saved_model.pb / saved_model.pbtxt (a copy still in progress) are ignored. OSError when
    the base path cannot be read.
    """
    found = ((entry, _version_number(entry.name)) for entry in Path(base_path).iterdir())
    return {number for entry, number in found if number is not None and _is_version_folder(entry)}


def latest_version(base_path: str | Path) -> int:
    """The highest version in ``base_path`` (`versions_on_disk`); the error says what was
    expected when there is none."""
    base = Path(base_path)
    expected = (
        f"expected a numeric version subdirectory (e.g. {base / '1'}) "
        f"containing {' or '.join(SAVED_MODEL_FILES)}"
    )
    if not base.is_dir():
        raise NoServableVersionError(
            f"model base path {base} does not exist or is not a directory; {expected}"
        )
    versions = versions_on_disk(base)
    if not versions:
        raise NoServableVersionError(f"no servable model version found in {base}: {expected}")
    return max(versions)


def _make_module_class(tf: Any) -> type:
    """The demo tf.Module class, defined here because its base class needs TensorFlow imported."""

    class DemoModel(tf.Module):
        def __init__(self, embedding_rows: int, seed: int) -> None:
            super().__init__(name="demo_model")
            # Separate streams, so the MLP's weights do not depend on the table's size.
            mlp_seed, table_seed = np.random.SeedSequence(seed).spawn(2)
            mlp_rng = np.random.default_rng(mlp_seed)
            self.dense_layers = []
            fan_in = EMBEDDING_DIM + DENSE_FEATURES
            for i, units in enumerate((*HIDDEN_UNITS, 1)):
                # He initialisation for the relu layers keeps activations (and so the scores)
                # away from sigmoid saturation.
                kernel = mlp_rng.standard_normal((fan_in, units), dtype=np.float32)
                kernel *= np.float32(np.sqrt(2.0 / fan_in))
                bias = (mlp_rng.standard_normal(units, dtype=np.float32) * 0.01).astype(np.float32)
                self.dense_layers.append(
                    (
                        tf.Variable(kernel, name=f"dense_{i}/kernel"),
                        tf.Variable(bias, name=f"dense_{i}/bias"),
                    )
                )
                fan_in = units
            # The table is the big allocation (488 MiB at 2,000,000 rows). tf.Variable(ndarray)
            # would hold three copies at once (numpy's, the converted tensor, the variable's),
            # so the variable starts as zeros (which it takes over without a copy) and is
            # filled in place, a chunk of numpy rows at a time: one copy plus a chunk.
            self.embedding = tf.Variable(
                tf.zeros([embedding_rows, EMBEDDING_DIM], tf.float32), name="embedding"
            )
            table_rng = np.random.default_rng(table_seed)
            for start in range(0, embedding_rows, _FILL_ROWS):
                stop = min(start + _FILL_ROWS, embedding_rows)
                rows = table_rng.standard_normal((stop - start, EMBEDDING_DIM), dtype=np.float32)
                rows *= np.float32(0.5)
                # A scatter writes into the variable's buffer; slicing the variable first
                # (v[a:b].assign) would read it, and that lingering read makes the next write
                # copy the whole table.
                self.embedding.scatter_update(tf.IndexedSlices(rows, tf.range(start, stop)))

        @tf.function(
            input_signature=[
                tf.TensorSpec([None, ID_COUNT], tf.int64, name="ids"),
                tf.TensorSpec([None, DENSE_FEATURES], tf.float32, name="dense"),
            ]
        )
        def serve(self, ids: tf.Tensor, dense: tf.Tensor) -> dict[str, tf.Tensor]:
            # Written the way recommendation models are: a lookup straight on the variable
            # (ResourceGather). Workers rewrite it to read-then-gather as they load the model
            # (worker/gather_rewrite.py), so the shared table is not copied.
            rows = tf.nn.embedding_lookup(self.embedding, ids)
            x = tf.concat([tf.reduce_mean(rows, axis=1), dense], axis=1)
            *hidden, (out_kernel, out_bias) = self.dense_layers
            for kernel, bias in hidden:
                x = tf.nn.relu(tf.matmul(x, kernel) + bias)
            return {"score": tf.sigmoid(tf.matmul(x, out_kernel) + out_bias)}

    return DemoModel


def _fsync_tree(root: Path) -> None:
    """Flush every file under root, so the rename publishes data that is on disk, not in cache."""
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
