"""Publish a model version's variables into a weight segment, once, before its workers start.

Runs as a one-shot child of the controller (it needs TensorFlow; the controller must not
load it). Each variable's bytes are read from the checkpoint's data shard straight into
the segment (worker/tensor_bundle.py finds them), so the publisher's memory stays at one
copy of the weights: the segment itself.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import math
import os
import resource
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import google_crc32c
import numpy as np
from google.protobuf.message import DecodeError

from mpspool import process, segment
from mpspool.config import PoolConfig
from mpspool.errors import Code, code_of, code_of_os_error, status_text
from mpspool.rundir import read_controller
from mpspool.worker import tensor_bundle

log = logging.getLogger("mpspool.publish")

VARIABLE_SUFFIX = "/.ATTRIBUTES/VARIABLE_VALUE"
OBJECT_GRAPH_KEY = "_CHECKPOINTABLE_OBJECT_GRAPH"
READ_CHUNK = 64 * 2**20
SAVED_OBJECT_VARIABLE = 7  # SavedObject's `variable` field (saved_object_graph.proto)


class PublishError(RuntimeError):
    """The checkpoint could not be read into a segment; ``code``: the status TensorFlow's
    restore gives the same failure (NOT_FOUND for files that are not there, DATA_LOSS for
    bytes that do not check), which GetModelStatus reports for the version."""

    def __init__(self, message: str, code: int = Code.UNKNOWN) -> None:
        super().__init__(message)
        self.code = code


def publish(
    model_dir: str | Path,
    model_name: str,
    version: int,
    path: Path,
    owner_pid: int,
    owner_started: float,
) -> segment.Manifest:
    """Write `path` (a weight segment) from the SavedModel's checkpoint; its manifest back.

    The checkpoint's index says each tensor's dtype, shape and place in the data shards, so
    no TensorFlow is needed (its import costs seconds at every pool start): a variable
    stored in slices is read slice by slice; only an entry the index does not lay out so is
    read through TensorFlow's reader. saved_model.pb is read and parsed once, here."""
    prefix = str(Path(model_dir) / "variables" / "variables")
    variables = Path(model_dir) / "variables"
    graph = _read_graph(Path(model_dir))
    if graph is None and not (Path(model_dir) / "saved_model.pbtxt").exists():
        # TensorFlow's loader's words (reader.cc). A folder gone (or never there) was
        # published as an empty segment, once per try, before its workers failed to load it
        # (found by a review).
        raise PublishError(
            "Could not find SavedModel .pb or .pbtxt at supplied export directory path: "
            f"{model_dir}. Check that the directory exists and that you have the right "
            "permissions for accessing it.",
            Code.NOT_FOUND,
        )
    if not Path(prefix + ".index").exists() and _declares_variables(graph):
        # Said as it is: a version copied in before its variables/ (`cp -r`, `gsutil cp -r`)
        # is incomplete, not a model whose weights cannot be shared.
        raise PublishError(
            f"model {model_name!r} version {version} at {model_dir} has variables but no "
            f"checkpoint: {prefix}.index does not exist (its variables/ folder is missing or "
            "not completely copied yet)",
            Code.NOT_FOUND,
        )
    if not Path(prefix + ".index").exists() and not (
        variables.is_dir() and any(variables.iterdir())
    ):
        # A SavedModel without variables (a TF1 Builder's export of a graph that has none:
        # its variables/ is empty). TensorFlow's loader restores nothing then ("The specified
        # SavedModel has no variables; no checkpoints were restored"): nothing to share, and
        # the segment says so to the workers. Data shards without their index: the read
        # below says the index is missing.
        manifest = segment.plan(
            model_name,
            version,
            owner_pid,
            owner_started,
            [],
            [],
            {},
            _extra(Path(model_dir), graph),
        )
        segment.SegmentWriter(path, manifest).commit()
        return manifest
    try:
        bundle = tensor_bundle.read_index(prefix)
    except (OSError, tensor_bundle.BundleError, DecodeError) as exc:
        raise PublishError(
            f"cannot read the checkpoint of model {model_name!r} at {prefix}: {exc}",
            code_of_os_error(exc) if isinstance(exc, OSError) else Code.DATA_LOSS,
        ) from None
    served = served_keys(graph, bundle, prefix)
    # A TF1 Saver's checkpoint (no object graph) keys each variable by its name, not by an
    # object path: every numeric tensor is published, and the worker binds each to the graph
    # variable of that name or refuses the model (a lookup table's saved contents match none).
    tf1 = OBJECT_GRAPH_KEY not in bundle[1]
    shared, unshared = [], []
    for key, entry in sorted(bundle[1].items()):
        if key == OBJECT_GRAPH_KEY:
            continue
        if served is not None and key.endswith(VARIABLE_SUFFIX) and key not in served:
            continue  # no serving signature reads it (optimizer state, say): not in /dev/shm
        if tf1 and entry.slices and entry.dtype in _CARRIED:
            # A TF1 partitioned variable (a `partitioner=`, as an estimator's embedding): the
            # checkpoint keeps it whole under its name, the graph reads its parts
            # ("emb/part_0", ...). Each part is published on its own, so that each starts
            # 64-byte aligned (TensorFlow takes no other buffer) and binds to its variable.
            for spec, part_shape in slice_specs(entry):
                shared.append((f"{key}{segment.SLICE_MARK}{spec}", int(entry.dtype), part_shape))
            continue
        if (tf1 or key.endswith(VARIABLE_SUFFIX)) and entry.dtype in _CARRIED:
            shape = tuple(int(d.size) for d in entry.shape.dim)
            shared.append((key, int(entry.dtype), shape))
        else:
            unshared.append(key)
    same_as = _duplicates(bundle, prefix, shared)
    manifest = segment.plan(
        model_name,
        version,
        owner_pid,
        owner_started,
        shared,
        unshared,
        same_as,
        _extra(Path(model_dir), graph),
    )
    stored_slices: dict[tuple[str, tensor_bundle.Extents], Any] = {}
    if any(e.slices for e in bundle[1].values()):
        try:
            stored_slices = tensor_bundle.read_slices(prefix)
        except (OSError, tensor_bundle.BundleError):
            pass  # read through TensorFlow's reader, which says what is wrong
    writer = segment.SegmentWriter(path, manifest)
    try:
        for key, _dt, _shape in shared:
            if key not in same_as:
                _copy(bundle, prefix, key, writer.view(key), stored_slices)
        # Its own errors are the segment's (SegmentError), not the checkpoint's.
        writer.commit()
    except OSError as exc:
        writer.abort()
        raise PublishError(
            f"cannot read the checkpoint of model {model_name!r} at {prefix}: {exc}",
            code_of_os_error(exc),
        ) from None
    except BaseException:
        writer.abort()
        raise
    return manifest


# The manifest's record of the graph the weights were published with (segment.Manifest.extra).
GRAPH_DIGEST_KEY = "graph_sha256"


def graph_digest(graph: bytes) -> str:
    """What a worker compares to tell that a version's saved_model.pb is the one its
    segment was published from."""
    return hashlib.sha256(graph).hexdigest()


@dataclass(frozen=True)
class SavedGraph:
    """saved_model.pb as read once: its bytes (for the digest) and what they parse to."""

    raw: bytes
    saved: Any  # mpspool.protos.tensorflow_pb2.SavedModel


def _read_graph(model_dir: Path) -> SavedGraph | None:
    """saved_model.pb (None: there is none, a .pbtxt perhaps), once it parses as a
    SavedModel with a graph. One that does not (a file still being copied in, or created
    and not yet written) fails the publish as TensorFlow's loader fails it (DATA_LOSS): it
    was published, its digest recorded, and the workers that then read the whole file were
    refused as a re-push of the version (found by a hunt). The digest is taken of these
    same bytes (`_extra`): read again, the file could have grown meanwhile."""
    from mpspool.protos import tensorflow_pb2 as pb

    graph = model_dir / "saved_model.pb"
    try:
        raw = graph.read_bytes()
        saved = pb.SavedModel.FromString(raw)
        meta_graphs = len(saved.meta_graphs)
    except FileNotFoundError:
        return None  # TensorFlow's loader says what is missing
    except OSError as exc:
        raise PublishError(f"cannot read {graph}: {exc}", code_of_os_error(exc)) from None
    except DecodeError as exc:
        meta_graphs, why = 0, f"cannot parse it as binary proto: {exc}"
    else:
        why = "it holds no graph"  # an empty file parses, as one cut between two fields
    if not meta_graphs:
        raise PublishError(
            f"unreadable saved model {graph} (not completely copied yet?): {why}",
            Code.DATA_LOSS,
        )
    return SavedGraph(raw, saved)


def _extra(model_dir: Path, graph: SavedGraph | None) -> dict[str, str]:
    """The graph's digest, for the manifest (of saved_model.pb's bytes as `_read_graph`
    checked them, or else of saved_model.pbtxt): a version's folder replaced under the same
    number (a Kubernetes ConfigMap's ..data swap, a re-push) gives a worker started later a
    new graph beside the weights published from the old one."""
    if graph is not None:
        return {GRAPH_DIGEST_KEY: graph_digest(graph.raw)}
    text = model_dir / "saved_model.pbtxt"
    try:
        return {GRAPH_DIGEST_KEY: graph_digest(text.read_bytes())}
    except FileNotFoundError:
        return {}
    except OSError as exc:  # unreadable: said as a failed publish, not a traceback
        raise PublishError(f"cannot read {text}: {exc}", code_of_os_error(exc)) from None


def _copy(
    bundle: tuple[int, dict[str, Any]],
    prefix: str,
    key: str,
    dest: np.ndarray,
    slices: dict[tuple[str, tensor_bundle.Extents], Any],
) -> bool:
    """One variable into its place in the segment. Straight from the data shards when the
    index says where its bytes are, whole or slice by slice (``slices``:
    tensor_bundle.read_slices), with no copy in this process; through TensorFlow's reader
    otherwise (an unusual entry). True when read directly."""
    shards, entries = bundle
    if segment.SLICE_MARK in key and not key.endswith(VARIABLE_SUFFIX):  # TF1 names have no @
        # One part of a TF1 partitioned variable: one slice of its entry.
        name, spec = key.split(segment.SLICE_MARK, 1)
        entry = entries.get(name)
        pieces = zip(entry.slices, slice_specs(entry), strict=True) if entry else []
        piece = next((p for p, (s, _shape) in pieces if s == spec), None)
        stored = slices.get((name, _extents(piece))) if piece is not None else None
        if stored is None or stored.size != dest.nbytes:
            dest[...] = _read_through_tensorflow(prefix, name, spec, dest.dtype)
            return False
        _read_into(_bytes_of(dest), prefix, shards, stored, key)
        return True
    entry = entries.get(key)
    if entry is not None and not entry.slices and entry.size == dest.nbytes:
        _read_into(_bytes_of(dest), prefix, shards, entry, key)
        return True
    stored = [slices.get((key, _extents(p))) for p in entry.slices] if entry else []
    if stored and all(s is not None for s in stored) and _tile(entry.slices, dest.shape):
        # Stored in slices (a TF2 checkpoint saved with a shard size policy): each into its
        # region; TensorFlow's reader assembled a fresh copy of the whole variable, and the
        # publisher imported TensorFlow for it (found by a hunt).
        for piece, part in zip(entry.slices, stored, strict=True):
            region = dest[_region(piece, dest.ndim)]
            if part.size != region.nbytes:
                break  # not what the index says it is: TensorFlow's reader says why
            if region.flags.c_contiguous:
                _read_into(_bytes_of(region), prefix, shards, part, key)
            else:  # a slice of an inner dimension: one slice's bytes in this process
                staged = np.empty(region.shape, region.dtype)
                _read_into(_bytes_of(staged), prefix, shards, part, key)
                region[...] = staged
        else:
            return True
    dest[...] = _read_through_tensorflow(prefix, key)
    return False


def _tile(pieces: Any, shape: tuple[int, ...]) -> bool:
    """Whether the slices lie within ``shape`` and cover it once, as TensorFlow's reader
    requires ("Overlapping slices", "Does not have sufficient slices"): read slice by slice,
    a part no slice covers would have been served as zeros. Else that reader says what is
    wrong."""
    boxes = []
    for piece in pieces:
        if len(piece.extent) != len(shape):
            return False  # TensorFlow's "Mismatching ranks"
        box = []
        for extent, size in zip(piece.extent, shape, strict=True):
            start = int(extent.start)
            end = start + int(extent.length) if extent.HasField("length") else size
            if (not extent.HasField("length") and start != 0) or not 0 <= start < end <= size:
                return False
            box.append((start, end))
        boxes.append(box)
    for i, box in enumerate(boxes):
        for other in boxes[:i]:
            if all(a < d and c < b for (a, b), (c, d) in zip(box, other, strict=True)):
                return False  # they overlap
    total = math.prod(shape)
    return sum(math.prod(end - start for start, end in box) for box in boxes) == total


def _extents(piece: Any) -> tensor_bundle.Extents:
    """A TensorSliceProto as its stored slice's key names it: (start, length), -1 for a
    whole dimension."""
    return tuple(
        (int(e.start), int(e.length) if e.HasField("length") else -1) for e in piece.extent
    )


def _region(piece: Any, ndim: int) -> tuple[slice, ...]:
    """The part of the whole variable a TensorSliceProto is (dimensions it does not list,
    and those without a length, whole)."""
    region = [slice(None)] * ndim
    for d, extent in enumerate(piece.extent):
        if extent.HasField("length"):
            region[d] = slice(int(extent.start), int(extent.start) + int(extent.length))
    return tuple(region)


def _bytes_of(array: np.ndarray) -> memoryview:
    """A C-contiguous array's bytes, writable, not copied."""
    return memoryview(array.reshape(-1).view(np.uint8))


def _read_into(target: memoryview, prefix: str, shards: int, entry: Any, key: str) -> None:
    """``entry``'s bytes (a tensor, or one slice of one) from its data shard into ``target``,
    checked against the index's checksum as TensorFlow's reader checks them."""
    with open(tensor_bundle.shard_path(prefix, entry.shard_id, shards), "rb") as shard:
        shard.seek(entry.offset)
        done = 0
        crc = 0
        while done < entry.size:
            # bytes, not a view of the segment: google_crc32c takes read-only buffers only.
            chunk = shard.read(min(READ_CHUNK, entry.size - done))
            if not chunk:
                raise PublishError(f"checkpoint shard ends inside {key}", Code.DATA_LOSS)
            target[done : done + len(chunk)] = chunk
            crc = google_crc32c.extend(crc, chunk)
            done += len(chunk)
    if _masked(crc) != entry.crc32c:
        # What TensorFlow's own reader checks: without it a corrupted checkpoint that a
        # plain load refuses would be served with wrong weights.
        raise PublishError(
            f"checkpoint data of {key} in {shard.name} is corrupted: checksum does not "
            f"match (stored {entry.crc32c:#010x}, computed {_masked(crc):#010x})",
            Code.DATA_LOSS,
        )


def _read_through_tensorflow(
    prefix: str, key: str, spec: str = "", dtype: np.dtype | None = None
) -> np.ndarray:
    """A tensor the index does not lay out in one piece (a partitioned variable's slices),
    assembled by TensorFlow's checkpoint reader: one extra copy of that tensor. With
    ``spec`` (a slice spec, as TF1's SaveSliceInfo writes it), only that slice."""
    import tensorflow as tf

    try:
        if not spec:
            return tf.train.load_checkpoint(prefix).get_tensor(key)
        (value,) = tf.raw_ops.RestoreV2(
            prefix=prefix, tensor_names=[key], shape_and_slices=[spec],
            dtypes=[tf.as_dtype(dtype)],
        )  # fmt: skip
        return value.numpy()
    except Exception as exc:  # NotFoundError, DataLossError, ValueError
        what = f"{key} ({spec})" if spec else key
        raise PublishError(
            f"cannot read {what} from the checkpoint at {prefix}: {exc}",
            code_of(getattr(exc, "error_code", Code.UNKNOWN)),
        ) from None


def slice_specs(entry: Any) -> list[tuple[str, tuple[int, ...]]]:
    """Each slice of a partitioned variable's index entry: its spec as TF1's SaveSliceInfo
    writes it ("10 4 4,3:0,4": the full shape, then each dimension's start and length; what
    the graph's VariableDef of that part says), and its shape."""
    full = [int(d.size) for d in entry.shape.dim]
    out = []
    for piece in entry.slices:
        extents = list(piece.extent) + [None] * (len(full) - len(piece.extent))
        starts, lengths = [], []
        for size, extent in zip(full, extents, strict=True):
            if extent is None or not extent.HasField("length"):  # the whole dimension
                starts.append(0 if extent is None else int(extent.start))
                lengths.append(size - starts[-1])
            else:
                starts.append(int(extent.start))
                lengths.append(int(extent.length))
        spec = " ".join(map(str, full)) + " "
        spec += ":".join(f"{start},{length}" for start, length in zip(starts, lengths, strict=True))
        out.append((spec, tuple(lengths)))
    return out


def served_keys(
    graph: SavedGraph | None, bundle: tuple[int, dict[str, Any]], prefix: str
) -> set[str] | None:
    """The checkpoint keys of the variables the SavedModel's signatures capture, or None when
    that cannot be told (no saved_model.pb, a TF1 model without an object graph, anything
    unexpected): then every variable is published.

    The signatures are children of the object graph's root ("signatures"); each names its
    concrete function, whose `bound_inputs` are the object-graph nodes it captures. A TF2
    SavedModel's checkpoint object graph numbers its nodes the same way, and a variable
    node's VARIABLE_VALUE attribute is its checkpoint key.
    """
    from mpspool.protos import tensorflow_pb2 as pb

    if graph is None:
        return None
    objects = graph.saved.meta_graphs[0].object_graph_def  # _read_graph: there is one
    entry = bundle[1].get(OBJECT_GRAPH_KEY)
    if not objects.nodes or entry is None:
        return None
    try:
        checkpoint = pb.TrackableObjectGraph.FromString(_string_scalar(prefix, bundle[0], entry))
    except (OSError, DecodeError, ValueError):
        return None
    signatures = [c.node_id for c in objects.nodes[0].children if c.local_name == "signatures"]
    if not signatures:
        return None
    bound: set[int] = set()
    for child in objects.nodes[signatures[0]].children:
        node = objects.nodes[child.node_id]
        kind = node.WhichOneof("kind")
        if kind == "bare_concrete_function":
            names = [node.bare_concrete_function.concrete_function_name]
        elif kind == "function":
            names = list(node.function.concrete_functions)
        else:
            return None
        for name in names:
            if name not in objects.concrete_functions:
                return None
            bound.update(objects.concrete_functions[name].bound_inputs)
    keys = set()
    for node_id in bound:
        if node_id >= len(checkpoint.nodes) or node_id >= len(objects.nodes):
            return None
        if objects.nodes[node_id].WhichOneof("kind") is not None:
            continue  # a function or another captured object, not a variable
        for attribute in checkpoint.nodes[node_id].attributes:
            if attribute.checkpoint_key.endswith(VARIABLE_SUFFIX):
                keys.add(attribute.checkpoint_key)
    return keys


def _declares_variables(graph: SavedGraph | None) -> bool:
    """Whether the SavedModel's object graph (TF2) has a variable node, so that TensorFlow's
    loader needs its checkpoint. A TF1 graph is not looked into (without an index its loader
    restores nothing), nor a model with no saved_model.pb (the workers say why)."""
    from google.protobuf import unknown_fields

    if graph is None:
        return False
    # SavedObject.variable, which mpspool's trimmed proto does not name: an unknown field.
    return any(
        field.field_number == SAVED_OBJECT_VARIABLE
        for meta in graph.saved.meta_graphs
        for node in meta.object_graph_def.nodes
        for field in unknown_fields.UnknownFieldSet(node)
    )


def _string_scalar(prefix: str, shards: int, entry: Any) -> bytes:
    """A DT_STRING scalar's bytes in a bundle shard: its length as a varint, a 4-byte
    checksum of the lengths, then the bytes."""
    with open(tensor_bundle.shard_path(prefix, entry.shard_id, shards), "rb") as shard:
        shard.seek(entry.offset)
        data = shard.read(entry.size)
    length, shift, pos = 0, 0, 0
    while True:
        if pos >= len(data):
            raise ValueError("truncated string tensor")
        byte = data[pos]
        length |= (byte & 0x7F) << shift
        pos += 1
        shift += 7
        if not byte & 0x80:
            break
    if pos + 4 + length != len(data):
        raise ValueError("not a scalar string tensor")
    return data[pos + 4 :]


def _duplicates(
    bundle: tuple[int, dict[str, Any]], prefix: str, shared: list[tuple[str, int, tuple[int, ...]]]
) -> dict[str, str]:
    """key → an earlier key with the same dtype, shape and bytes (checked byte for byte after
    the index's checksums agree). Keras 3's `model.export()` checkpoints every variable under
    two keys (`_all_variables/N` and `variables/M`), which load as two variables over one
    value: published once, both are bound to the same bytes."""
    shards, entries = bundle
    first: dict[tuple[Any, ...], list[str]] = {}
    same_as: dict[str, str] = {}
    for key, dt, shape in shared:
        entry = entries.get(key)
        if entry is None or entry.slices:
            continue
        signature = (dt, shape, entry.size, entry.crc32c)
        for earlier in first.get(signature, []):
            if _same_bytes(prefix, shards, entry, entries[earlier]):
                same_as[key] = earlier
                break
        else:
            first.setdefault(signature, []).append(key)
    return same_as


def _same_bytes(prefix: str, shards: int, a: Any, b: Any) -> bool:
    if a.size != b.size:
        return False
    path_a = tensor_bundle.shard_path(prefix, a.shard_id, shards)
    path_b = tensor_bundle.shard_path(prefix, b.shard_id, shards)
    with open(path_a, "rb") as fa, open(path_b, "rb") as fb:
        fa.seek(a.offset)
        fb.seek(b.offset)
        left = a.size
        while left:
            n = min(READ_CHUNK, left)
            if fa.read(n) != fb.read(n):
                return False
            left -= n
    return True


def _masked(crc: int) -> int:
    """TensorFlow stores crc32c masked (tsl::crc32c::Mask)."""
    return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + 0xA282EAD8) & 0xFFFFFFFF


def _carried() -> frozenset[int]:
    from mpspool import dtypes

    return frozenset(dt for dt in dtypes.NUMPY_OF_DT if dt != dtypes.DT_STRING)


_CARRIED = _carried()


def _end_on_sigterm(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mpspool.worker.publish")
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--version", type=int, help="default: the version the pool started with")
    parser.add_argument("--model", help="the model it is for (default: the pool's first)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s publish %(levelname)s %(message)s")
    # Ended by SIGTERM (the controller's stop, or its death), not SIGKILL: the half-written
    # segment is removed on the way out (SegmentWriter.abort). Killed outright with a
    # controller killed outright, it stayed in /dev/shm until a later start (found by a hunt).
    signal.signal(signal.SIGTERM, _end_on_sigterm)
    process.die_with_parent(signal.SIGTERM)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    pool = PoolConfig.load(args.run_dir)
    config = pool.for_model(args.model) if args.model else pool
    version = config.model_version if args.version is None else args.version
    destination = config.segment_for(version)
    owner = read_controller(Path(args.run_dir)) or {}
    started = time.monotonic()
    try:
        manifest = publish(
            config.version_path(version),
            config.model_name,
            version,
            Path(destination),
            int(owner.get("pid", os.getppid())),
            float(owner.get("started", 0.0)),
        )
    except segment.SegmentError as exc:  # RESOURCE_EXHAUSTED: /dev/shm too small, say
        process.fail(process.EXIT_CONFIG_ERROR, status_text(exc.code, str(exc)))
    except PublishError as exc:
        process.fail(process.EXIT_LOAD_FAILED, status_text(exc.code, str(exc)))
    except Exception as exc:  # a SavedModel malformed in a way no check foresaw, say
        # Its reason in the fatal line, with its code (a traceback alone read "exit code 1").
        log.exception("publishing failed")
        process.fail(
            process.EXIT_LOAD_FAILED,
            status_text(
                Code.UNKNOWN,
                f"publishing the weights of model {config.model_name!r} failed: "
                f"{type(exc).__name__}: {exc}",
            ),
        )
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    log.info(
        "published %d tensors, %.1f MiB, to %s in %.2f s (peak RSS %.0f MiB)%s",
        len(manifest.tensors),
        manifest.data_bytes / 2**20,
        destination,
        time.monotonic() - started,
        peak_kib / 1024,
        f"; not shareable: {', '.join(manifest.unshared)}" if manifest.unshared else "",
    )
    return process.EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
