"""Bind a loaded SavedModel's variables to a weight segment, without copying them.

The model is loaded with `experimental_skip_checkpoint=True` (graph and functions, no
values); each variable is then assigned a DLPack tensor over its view of the segment.
TensorFlow adopts such a buffer instead of copying it when it is 64-byte aligned, and the
mapping is copy-on-write, so a write to a variable lands in a private page and never in
what the other workers read.

Never wrong, never silent:
- checkpointed state that is not a plain variable (a MutableHashTable's contents) would be
  silently dropped by skip_checkpoint, so such a model is refused, naming the objects;
- every variable of the loaded model must get its value from the segment, or the model is
  refused;
- after warm-up, `verify()` checks that each variable's buffer still lies inside the
  mapping: an op that puts a variable in copy-on-read mode (a write, a ResourceGather that
  worker/gather_rewrite.py did not rewrite) makes a private copy of the whole variable, and
  the worker then refuses to serve unless copies are allowed.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from mpspool import dtypes
from mpspool.errors import Code
from mpspool.segment import SLICE_MARK, AttachedSegment, TensorEntry

VARIABLE_SUFFIX = "/.ATTRIBUTES/VARIABLE_VALUE"


class NotShareable(Exception):
    """The model's weights cannot be served from shared memory; the message says why."""


class CheckpointUnreadable(Exception):
    """A value the segment does not carry could not be read from the checkpoint (a network
    file system's hiccup, a file still being copied): another try may read it, where a
    NotShareable model is refused the same way every time. ``code``: TensorFlow's status code
    for the failed read (NOT_FOUND, DATA_LOSS, ...)."""

    def __init__(self, message: str, code: int = Code.UNKNOWN) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class WeightsReport:
    segment: str
    shared_bytes: int = 0
    copied: dict[str, int] = field(default_factory=dict)  # variable name → bytes copied
    # variable name → bytes TensorFlow holds in device (GPU) memory: on a GPU it places
    # variables there, one copy per worker (MPS gives each client memory of its own), loaded
    # from the segment instead of from the checkpoint. Expected, not a copy refused.
    on_device: dict[str, int] = field(default_factory=dict)
    # variable name → why a served function may yet copy it (audit(): an op on a path that
    # warm-up did not take, say); not counted in `copied` until it happens.
    at_risk: dict[str, str] = field(default_factory=dict)

    def to_wire(self) -> dict[str, Any]:
        return {
            "segment": self.segment,
            "shared_bytes": self.shared_bytes,
            "copied": self.copied,
            "on_device": self.on_device,
            "at_risk": self.at_risk,
        }

    def summary(self) -> str:
        text = f"shared {self.shared_bytes / 2**20:.1f} MiB"
        if self.on_device:
            text += f"; on the GPU {sum(self.on_device.values()) / 2**20:.1f} MiB"
        if self.copied:
            names = ", ".join(f"{k} ({v / 2**20:.1f} MiB)" for k, v in self.copied.items())
            text += f"; COPIED: {names}"
        return text


def unescape_name(name: str) -> str:
    """Undo TensorFlow's checkpoint-key escaping of one path element ("." → "..", "/" → ".S")."""
    out = []
    i = 0
    while i < len(name):
        if name[i] == "." and i + 1 < len(name):
            out.append("/" if name[i + 1] == "S" else name[i + 1])
            i += 2
        else:
            out.append(name[i])
            i += 1
    return "".join(out)


def resolve(root: Any, key: str) -> Any | None:
    """The object a checkpoint key's path names in the loaded object graph, or None."""
    if not key.endswith(VARIABLE_SUFFIX):
        return None
    return _object_at(root, key[: -len(VARIABLE_SUFFIX)])


def _object_at(root: Any, path: str) -> Any | None:
    """The object at an object-graph path ("a/b/0"), or None."""
    import tensorflow as tf

    obj = root
    for raw in path.split("/"):
        # The checkpoint's own child names, not Python attributes: a dict key "items" or a
        # list index past the end must not resolve to a method or raise.
        obj = tf.train.TrackableView(obj).children(obj).get(unescape_name(raw))
        if obj is None:
            return None
    return obj


def attach(
    tf: Any, loaded: Any, segment: AttachedSegment, checkpoint: str
) -> dict[int, tuple[Any, TensorEntry]]:
    """Assign every variable of `loaded` its view of the segment; NotShareable otherwise.
    A variable of a dtype the segment does not carry (a tf.string vocabulary, say) is
    restored from the checkpoint at `checkpoint` (its prefix) into this worker instead."""
    manifest = segment.manifest
    tf1 = _tf1_variables(tf, loaded)
    if tf1 is not None:
        _refuse_reference_variables(loaded, manifest, checkpoint)
    restored, lost = _restore_unshared(tf, loaded, tf1, manifest.unshared, checkpoint)
    captured = {
        id(t) for signature in loaded.signatures.values() for t in signature.captured_inputs
    }
    # What serving reads: the signatures' captures, and those of every resource's
    # initializer (a table filled from another one as the model loads).
    read = captured | _initializer_captures(tf, loaded)
    lost = [key for key in lost if _may_be_read(loaded, key, read)]
    if lost:
        objects = sorted({k.split("/.ATTRIBUTES/")[0] for k in lost})
        raise NotShareable(
            "checkpointed state other than variables cannot be shared (it would be silently "
            f"lost): {', '.join(objects)} ({', '.join(lost)}); "
            "serve this model with --no-share-weights"
        )
    bound: dict[int, tuple[Any, TensorEntry]] = {}
    slices: dict[str, str] | None = None  # read when the first slice needs it
    for entry in manifest.tensors:
        if entry.key.endswith(VARIABLE_SUFFIX):
            variable = resolve(loaded, entry.key)
        elif tf1 is None:
            # not a TF2 object path, and the model is no TF1 graph: nothing to bind it to
            raise NotShareable(
                f"the checkpoint's tensor {entry.key} names no variable of the loaded model; "
                "serve this model with --no-share-weights"
            )
        elif SLICE_MARK in entry.key:
            # One part of a TF1 partitioned variable: the graph variable whose slice it is.
            if slices is None:
                slices = _tf1_slices(tf, Path(checkpoint).parent.parent)
            variable = tf1.get(slices.get(entry.key, ""))
            if variable is None:
                raise NotShareable(
                    f"the checkpoint's slice {entry.key} is no part of a variable of the TF1 "
                    "graph; serve this model with --no-share-weights"
                )
        else:
            variable = tf1.get(entry.key)
            if variable is None:
                raise NotShareable(
                    f"the checkpoint's tensor {entry.key} is no variable of the TF1 graph (a "
                    "lookup table's saved contents, or a variable a Saver saved under another "
                    "name): it would be lost; serve this model with --no-share-weights"
                )
        if not isinstance(variable, tf.Variable):
            continue  # not part of what was loaded (optimizer slots, say)
        view = segment.view(entry)
        # Compatible, not equal: a variable declared with a dimension (or its rank) left
        # open, `tf.Variable(..., shape=[None, 16])`, holds whatever the checkpoint does, as
        # a plain load restores it (refused, or a crash for an unknown rank; found by a hunt).
        if (
            not variable.shape.is_compatible_with(entry.shape)
            or variable.dtype.as_datatype_enum != entry.dtype
        ):
            raise NotShareable(
                f"variable {variable.name} is {variable.dtype.name}{variable.shape} but the "
                f"checkpoint holds {dtypes.dtype_name(entry.dtype)}{list(entry.shape)} under "
                f"{entry.key}"
            )
        if entry.dtype == dtypes.DT_BFLOAT16:
            # numpy exports no bfloat16 through DLPack: hand over the bits and reinterpret
            # them (a bitcast aliases the buffer, it does not copy it).
            bits = tf.experimental.dlpack.from_dlpack(view.view(np.uint16).__dlpack__())
            value = tf.bitcast(bits, tf.bfloat16)
        else:
            value = tf.experimental.dlpack.from_dlpack(view.__dlpack__())
        variable.assign(value)
        bound[id(variable)] = (variable, entry)
    # Every variable a serving signature captures must read from the segment; others (the
    # publisher leaves them out: optimizer state, Keras' second reference list) serve nothing.
    unbound = [
        t.name
        for t in tf.train.TrackableView(loaded).descendants()
        if isinstance(t, tf.Variable)
        and id(t) not in bound
        and id(t) not in restored
        and id(t.handle) in captured
    ]
    if unbound:
        raise NotShareable(
            f"variables {', '.join(sorted(unbound))} have no value in the weight segment "
            "(their checkpoint keys could not be matched); serve this model with --no-share-weights"
        )
    return bound


def _refuse_reference_variables(loaded: Any, manifest: Any, checkpoint: str) -> None:
    """NotShareable naming the TF1 graph's reference variables (VariableV2: TF1's default
    without use_resource=True, estimators') whose values the checkpoint holds, whole or in
    parts, in the segment or not: such a variable's buffer lives in the graph's own op,
    which nothing can point at the segment, and the loader lists none of them. Said before
    anything else is tried, which gave other reasons (a lookup table's contents, a slice of
    no variable; found by a hunt and a review)."""
    keys = [*(t.key for t in manifest.tensors), *manifest.unshared]
    names = {key.split(SLICE_MARK)[0] for key in keys}
    if any(SLICE_MARK in key for key in keys):
        names |= set(_tf1_slices(None, Path(checkpoint).parent.parent).values())
    refs = sorted(name for name in names if _reference_variable(loaded, name))
    if refs:
        listed = ", ".join(refs[:5]) + (f" and {len(refs) - 5} more" if len(refs) > 5 else "")
        raise NotShareable(
            f"the TF1 graph's variables {listed} are reference variables (VariableV2, TF1's "
            "default without use_resource=True), whose values cannot be read from shared "
            "memory; serve this model with --no-share-weights, or export it with resource "
            "variables"
        )


def _reference_variable(loaded: Any, name: str) -> bool:
    """Whether a TF1 graph's op of that name is a reference variable (VariableV2)."""
    try:
        return loaded.graph.get_operation_by_name(name).type in ("VariableV2", "Variable")
    except (KeyError, ValueError, AttributeError):
        return False


def _initializer_captures(tf: Any, loaded: Any) -> set[int]:
    """The ids of what each loaded resource's creation and initialization functions capture:
    a StaticHashTable whose initializer reads a MutableHashTable reads it as the model loads,
    before its state is restored (left out, it filled the static table from an empty one and
    the model answered wrongly; found by a review)."""
    ids: set[int] = set()
    for obj in tf.train.TrackableView(loaded).descendants():
        for name in ("_create_resource", "_initialize"):
            concrete = getattr(getattr(obj, name, None), "concrete_functions", None)
            if isinstance(concrete, list):
                ids.update(id(t) for function in concrete for t in function.captured_inputs)
    return ids


def _may_be_read(loaded: Any, key: str, captured: set[int]) -> bool:
    """Whether the object whose saved state `key` is (a mutable table's keys or values) may
    be read while serving: unless it is a resource that neither a signature nor another
    resource's initializer captures (`_initializer_captures`). An
    adapted Keras lookup layer keeps its adapt state (token counts) in such a table, which
    training fills and serving never reads: refused as state that would be lost, every
    such model needed --no-share-weights (found by a hunt of model exports)."""
    obj = _object_at(loaded, key.split("/.ATTRIBUTES/")[0])
    handle = getattr(obj, "resource_handle", None) if obj is not None else None
    return handle is None or id(handle) in captured


def _restore_unshared(
    tf: Any, loaded: Any, tf1: dict[str, Any] | None, keys: list[str], checkpoint: str
) -> tuple[set[int], list[str]]:
    """The unshared checkpoint entries that are variables (of a dtype the segment does not
    carry), each restored from the checkpoint into its variable as TensorFlow's own load
    would (these are small: vocabularies, names); the ids of those variables, and the keys
    that name no variable (a lookup table's contents), which would be lost."""
    restored: set[int] = set()
    lost: list[str] = []
    for key in keys:
        if key.endswith(VARIABLE_SUFFIX):
            variable = resolve(loaded, key)
        else:
            variable = tf1.get(key) if tf1 is not None else None
        if not isinstance(variable, tf.Variable):
            lost.append(key)
            continue
        try:
            (value,) = tf.raw_ops.RestoreV2(
                prefix=checkpoint, tensor_names=[key], shape_and_slices=[""],
                dtypes=[variable.dtype],
            )  # fmt: skip
            variable.assign(value)
        except (tf.errors.OpError, ValueError) as exc:
            raise CheckpointUnreadable(
                f"variable {variable.name} ({key}) could not be restored from the checkpoint: "
                f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}",
                getattr(exc, "error_code", Code.UNKNOWN),
            ) from None
        restored.add(id(variable))
    return restored, lost


def _tf1_slices(tf: Any, model_dir: Path) -> dict[str, str]:
    """The parts of a TF1 SavedModel's partitioned variables: the segment key of each part's
    slice (checkpoint key, SLICE_MARK, slice spec: what the publisher writes) → the name its
    Saver keys the part with, from the graph's VariableDefs (their save_slice_info)."""
    from tensorflow.core.framework import variable_pb2
    from tensorflow.core.protobuf import saved_model_pb2

    saved = saved_model_pb2.SavedModel.FromString((model_dir / "saved_model.pb").read_bytes())
    parts: dict[str, str] = {}
    for meta_graph in saved.meta_graphs:
        for collection in ("variables", "trainable_variables"):
            for raw in meta_graph.collection_def[collection].bytes_list.value:
                variable = variable_pb2.VariableDef.FromString(raw)
                info = variable.save_slice_info_def
                if not info.full_name:
                    continue
                spec = " ".join(map(str, info.full_shape)) + " "
                spec += ":".join(
                    f"{o},{n}" for o, n in zip(info.var_offset, info.var_shape, strict=True)
                )
                parts[f"{info.full_name}{SLICE_MARK}{spec}"] = variable.variable_name.split(":")[0]
    return parts


def _tf1_variables(tf: Any, loaded: Any) -> dict[str, Any] | None:
    """A TF1 SavedModel's variables by the name its Saver keys them with (the variable's
    shared name: its op's name unless given one), or None for a TF2 model."""
    if not isinstance(getattr(loaded, "graph", None), tf.Graph):
        return None  # load_v1_in_v2 keeps the wrapped graph; a TF2 load has no such attribute
    variables = getattr(loaded, "variables", None)
    if not isinstance(variables, list):
        return None
    named = {}
    for variable in variables:
        name = getattr(variable, "_shared_name", None) or variable.name.split(":")[0]
        named[name] = variable
    return named


def weight_names(bound: dict[int, tuple[Any, TensorEntry]]) -> dict[int, str]:
    """How reports name each bound variable: its name, unless another bound variable has it
    too (every unnamed tf.Variable is "Variable:0", Keras names many "kernel"), then its name
    and the object path its checkpoint key gives. Reports keyed by the bare name merged two
    such variables: the second one's copy went unreported (found by a hunt)."""
    counts: dict[str, int] = {}
    for variable, _ in bound.values():
        counts[variable.name] = counts.get(variable.name, 0) + 1
    return {
        key: variable.name
        if counts[variable.name] == 1
        else f"{variable.name} ({entry.key.split('/.ATTRIBUTES/')[0]})"
        for key, (variable, entry) in bound.items()
    }


def verify(
    tf: Any,
    bound: dict[int, tuple[Any, TensorEntry]],
    segment: AttachedSegment,
    at_risk: dict[str, str] | None = None,
    names: dict[int, str] | None = None,
) -> WeightsReport:
    """Which variables still read from the segment, which TensorFlow copied into host
    memory, and which it holds on a GPU (where it places variables when it has one).
    ``names``: `weight_names` of every bound variable, where ``bound`` is only some."""
    names = weight_names(bound) if names is None else names
    report = WeightsReport(segment=str(segment.path), at_risk=dict(at_risk or {}))
    # Identical tensors are published once and bound to the same bytes: counted once (two
    # 64 MiB twins said `shared 128MiB` over a 64 MiB segment; found by a hunt).
    shared_at: set[int] = set()
    for key, (variable, entry) in bound.items():
        address, device = _buffer(tf, variable)
        name = names[key]
        if device != DLPACK_CPU:
            report.on_device[name] = entry.nbytes
            report.at_risk.pop(name, None)  # no host copy to watch for
        elif segment.contains(address):
            if address not in shared_at:
                shared_at.add(address)
                report.shared_bytes += entry.nbytes
        else:
            report.copied[name] = entry.nbytes
    return report


_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


# DLPack's device type of host memory (dlpack.h, DLDeviceType kDLCPU); a GPU's is kDLCUDA (2).
DLPACK_CPU = 1


def _buffer(tf: Any, variable: Any) -> tuple[int, int]:
    """Where the variable's current buffer lives: its address, and the DLPack device type of
    the memory it is in. Through DLPack of its value, because `variable.numpy()` would itself
    make a copy."""
    # Not variable.value(): once a variable is in copy-on-read mode a ReadVariableOp copies
    # the whole buffer, and the check itself would make the copy it looks for.
    value = variable.read_value_no_copy() if hasattr(variable, "read_value_no_copy") else None
    capsule = tf.experimental.dlpack.to_dlpack(value if value is not None else variable.value())
    dl_tensor = _capsule_pointer(capsule, b"dltensor")
    # DLTensor starts with `void* data`, then `DLDevice device` (int32 device_type, int32
    # device_id); byte_offset (after 3 more fields) is 0 for TF.
    address = ctypes.cast(dl_tensor, ctypes.POINTER(ctypes.c_void_p))[0]
    device = ctypes.cast(dl_tensor + ctypes.sizeof(ctypes.c_void_p), ctypes.POINTER(ctypes.c_int32))
    return address or 0, device[0]


# -- what the served functions do with each shared variable's handle ---------------------
# Ops that take a variable's handle and leave its buffer as it is: they read it through
# ReadVariableOp (which aliases the buffer of a variable not in copy-on-read mode), look at
# its shape, or only pass the handle on.
_READS = frozenset(
    {"ReadVariableOp", "VariableShape", "VarIsInitializedOp", "_ReadVariablesOp", "_Retval"}
)
_PASS = frozenset(
    {
        "Identity",
        "IdentityN",
        "Switch",
        "RefSwitch",
        "Merge",
        "RefMerge",
        "Enter",
        "RefEnter",
        "Exit",
        "RefExit",
        "NextIteration",
        "RefNextIteration",
    }
)
_CALLS = frozenset({"PartitionedCall", "StatefulPartitionedCall"})
_IFS = frozenset({"If", "StatelessIf", "_If"})
_CASES = frozenset({"Case", "StatelessCase"})
_WHILES = frozenset({"While", "StatelessWhile", "_While"})
_WRITE_PREFIXES = (
    "Assign",
    "ResourceScatter",
    "ResourceApply",
    "ResourceSparseApply",
    "ResourceStridedSliceAssign",
    "ResourceCountUpTo",
)


def copy_reason(op: str) -> str:
    """Why TensorFlow gives a variable that `op` takes a private copy of its buffer."""
    if op.startswith(_WRITE_PREFIXES):
        return (
            f"{op} writes it, and a written variable gets a buffer of its own (its first write "
            "copies the whole shared tensor into the worker)"
        )
    if op in ("ResourceGather", "ResourceGatherNd"):
        return (
            f"{op} reads it in place, which copies the whole shared tensor and puts the variable "
            "in copy-on-read mode (mpspool rewrites this op where it can; this one was not)"
        )
    return (
        f"{op} takes its handle, and mpspool cannot tell that it leaves the shared buffer as it is "
        "(only ReadVariableOp and the gathers mpspool rewrites are known to)"
    )


def audit(loaded: Any, bound: dict[int, tuple[Any, TensorEntry]]) -> dict[str, str]:
    """Variable name → why a serving signature may copy it out of the segment: every op that
    the variable's handle reaches in the signature's graph, through calls, conditionals and
    loops, that is not a known read. Static, so it also sees what warm-up does not run (a
    write in a branch that zeros never take); `verify()` says what was copied."""
    names = weight_names(bound)
    handles = {id(variable.handle): names[key] for key, (variable, _) in bound.items()}
    risks: dict[str, str] = {}
    for key in sorted(loaded.signatures.keys()):
        function = loaded.signatures[key]
        try:
            graph_def = function.graph.as_graph_def()
            captures = list(function.graph.captures)
        except Exception:  # a function TensorFlow cannot describe; verify() still checks it
            continue
        starts = [
            (internal.op.name, handles[id(external)])
            for external, internal in captures
            if id(external) in handles
        ]
        for where, name, op, node in _handle_uses(graph_def, starts):
            risks.setdefault(
                name, f"{copy_reason(op)} (node {node!r} in {where}, signature {key!r})"
            )
    return risks


def _handle_uses(graph_def: Any, starts: list[tuple[str, str]]) -> list[tuple[str, str, str, str]]:
    """(function, variable, op, node) for each op outside _READS and _PASS that a variable's
    handle reaches, following it from the graph's placeholders into called functions."""
    library = {f.signature.name: f for f in graph_def.library.function}
    scopes: dict[str, tuple[list[Any], bool]] = {
        "the signature's graph": (list(graph_def.node), False)
    }
    for name, fdef in library.items():
        scopes[name] = (list(fdef.node_def), True)
    consumers: dict[str, dict[str, list[tuple[Any, int]]]] = {}

    def users(scope: str, ref: str) -> list[tuple[Any, int]]:
        """The nodes of `scope` that take `ref` as a data input, with its position. A
        function names a value `arg` or `node:output:index`; a graph `node` or `node:index`
        (an output index other than a pass-through's first cannot matter here)."""
        if scope not in consumers:
            table: dict[str, list[tuple[Any, int]]] = {}
            nodes, in_function = scopes[scope]
            for node in nodes:
                data = [i for i in node.input if not i.startswith("^")]
                for position, source in enumerate(data):
                    key = source if in_function else source.split(":")[0]
                    table.setdefault(key, []).append((node, position))
            consumers[scope] = table
        return consumers[scope].get(ref, [])

    found: list[tuple[str, str, str, str]] = []
    seen: set[tuple[str, str, str]] = set()
    work = [("the signature's graph", ref, name) for ref, name in starts]
    while work:
        scope, ref, name = work.pop()
        if (scope, ref, name) in seen:
            continue
        seen.add((scope, ref, name))
        in_function = scopes[scope][1]
        for node, position in users(scope, ref):
            op = node.op
            if op in _READS:
                continue
            callees: list[tuple[str, int]] = []
            if op in _PASS:
                if not in_function:
                    work.append((scope, node.name, name))
                elif op in ("Switch", "RefSwitch"):
                    work.append((scope, f"{node.name}:output_true:0", name))
                    work.append((scope, f"{node.name}:output_false:0", name))
                else:
                    index = position if op == "IdentityN" else 0
                    work.append((scope, f"{node.name}:output:{index}", name))
                continue
            if op in _CALLS:
                callees = [(node.attr["f"].func.name, position)]
            elif op in library:
                callees = [(op, position)]
            elif op in _IFS:
                if position == 0:
                    continue
                callees = [
                    (node.attr[b].func.name, position - 1) for b in ("then_branch", "else_branch")
                ]
            elif op in _CASES:
                if position == 0:
                    continue
                callees = [(f.name, position - 1) for f in node.attr["branches"].list.func]
            elif op in _WHILES:
                callees = [(node.attr[b].func.name, position) for b in ("cond", "body")]
            if callees:
                for callee, index in callees:
                    fdef = library.get(callee)
                    if fdef is not None and index < len(fdef.signature.input_arg):
                        work.append((callee, fdef.signature.input_arg[index].name, name))
                    else:
                        found.append((scope, name, op, node.name))  # cannot follow: say so
                continue
            found.append((scope, name, op, node.name))
    return found
