"""Rewrite a SavedModel's gathers on variables so that shared weights stay shared.

`tf.nn.embedding_lookup(variable, ids)`, `tf.gather(variable, ids)` and Keras' `Embedding` run
``ResourceGather`` (``ResourceGatherNd`` for `tf.gather_nd`). Its kernel calls
``EnsureSparseVariableAccess`` (tensorflow/core/kernels/training_op_helpers.h), which copies
the variable's whole buffer and switches the variable to copy-on-read mode unless the buffer
is uniquely owned, and a buffer imported through DLPack (what worker/shared_weights.py binds
each variable to) never counts as owned. So the first lookup of every worker would copy the
table out of the shared segment, and every later dense read would copy it again.

The same result comes from reading the variable first and gathering from the value:
``ResourceGather(v, ids, batch_dims=b)`` ≡ ``GatherV2(ReadVariableOp(v), ids, axis=b,
batch_dims=b)``, and ``ResourceGatherNd(v, ids)`` ≡ ``GatherNd(ReadVariableOp(v), ids)``. A
``ReadVariableOp`` on a variable that is not in copy-on-read mode aliases its buffer, and
GatherV2 reads only the rows it needs: nothing is copied, and the answers are the same bits
(out-of-range ids fail with TensorFlow's own INVALID_ARGUMENT text).

The rewrite works on the serialized graph, before TensorFlow loads it: every FunctionDef of the
SavedModel's function library (TF2 `tf.function`s, Keras `model.export()`) and every
MetaGraph's top-level GraphDef (TF1 models). The gather node keeps its name (GatherV2 and
GatherNd name their output ``output`` as ResourceGather does), so every consumer still finds
it. The rewritten model lives in a private directory whose other entries (variables/, assets/,
assets.extra/) are symbolic links to the original's, kept for the worker's life: lookup
tables read their vocabulary files from assets/ when they load.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SAVED_MODEL_PB = "saved_model.pb"
# The fingerprint describes the original saved_model.pb; the rewritten one has none.
_NOT_LINKED = {SAVED_MODEL_PB, "fingerprint.pb", "saved_model.pbtxt"}
DT_INT32 = 3
# A private copy's directory: "model-<pid of its worker>-<random>".
_PRIVATE_PREFIX = "model-"


@dataclass
class Rewritten:
    """Where the rewritten model is, and how many gathers were rewritten where."""

    model_dir: Path
    gathers: dict[str, int] = field(default_factory=dict)  # function (or "graph") → count

    @property
    def count(self) -> int:
        return sum(self.gathers.values())

    def remove(self) -> None:
        shutil.rmtree(self.model_dir.parent, ignore_errors=True)


def rewrite_saved_model(model_dir: Path, work_dir: Path) -> Rewritten | None:
    """A copy of the SavedModel in `model_dir` with its variable gathers rewritten, made in
    a new private directory under `work_dir`; None when the model has no such gather."""
    from tensorflow.core.protobuf import saved_model_pb2

    saved = saved_model_pb2.SavedModel()
    saved.ParseFromString((model_dir / SAVED_MODEL_PB).read_bytes())
    gathers: dict[str, int] = {}
    for meta_graph in saved.meta_graphs:
        n = rewrite_nodes(meta_graph.graph_def.node, in_function=False)
        if n:
            gathers["graph"] = gathers.get("graph", 0) + n
        for function in meta_graph.graph_def.library.function:
            n = rewrite_nodes(function.node_def, in_function=True)
            if n:
                gathers[function.signature.name] = gathers.get(function.signature.name, 0) + n
    if not gathers:
        return None
    private = new_private_dir(work_dir)
    target = private / model_dir.name
    try:
        target.mkdir()
        (target / SAVED_MODEL_PB).write_bytes(saved.SerializeToString())
        for entry in os.listdir(model_dir):
            if entry not in _NOT_LINKED:
                (target / entry).symlink_to(model_dir.resolve() / entry)
    except BaseException:  # a failed write, or a worker stopped while loading (SystemExit)
        shutil.rmtree(private, ignore_errors=True)
        raise
    return Rewritten(target, gathers)


# The work dirs this process has cleaned (remove_copies_of_ended_processes): only before
# its first private dir there, since that removes this pid's too (a dead worker's, reused).
_cleaned: set[Path] = set()


def new_private_dir(work_dir: Path) -> Path:
    """A new directory of this process's in ``work_dir`` (0700; the pid in its name says
    whose it is), those of processes that ended removed before the first."""
    work_dir.mkdir(parents=True, exist_ok=True)
    if work_dir not in _cleaned:
        remove_copies_of_ended_processes(work_dir)
        _cleaned.add(work_dir)
    return Path(tempfile.mkdtemp(prefix=f"{_PRIVATE_PREFIX}{os.getpid()}-", dir=work_dir))


def remove_copies_of_ended_processes(work_dir: Path) -> list[Path]:
    """Remove the copies in ``work_dir`` whose process has ended; the ones removed.

    A worker removes its own copy when it exits normally (atexit), but not when it is killed
    (a hang, an MPS fault, the OOM killer): each such death left one copy until the pool
    stopped, in a run directory that a pod keeps in a size-limited emptyDir (deploy/k8s),
    whose kubelet evicts the pod once it is full. A worker started in a dead one's place
    removes what the dead left before making its own."""
    removed = []
    for entry in work_dir.glob(f"{_PRIVATE_PREFIX}*-*"):
        pid = entry.name[len(_PRIVATE_PREFIX) :].split("-", 1)[0]
        # This process's pid on a copy it has not made yet: a dead worker's, the pid reused.
        if pid.isdigit() and (int(pid) == os.getpid() or not _alive(int(pid))):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive, and not ours to judge
        return True
    return True


def rewrite_nodes(nodes: Any, in_function: bool) -> int:
    """Rewrite every ResourceGather / ResourceGatherNd in a repeated NodeDef field, in place;
    how many. Inside a FunctionDef outputs are named `node:arg:index`, in a GraphDef `node`."""
    count = 0
    for index in range(len(nodes)):
        node = nodes[index]
        if node.op not in ("ResourceGather", "ResourceGatherNd"):
            continue
        data = [i for i in node.input if not i.startswith("^")]
        control = [i for i in node.input if i.startswith("^")]
        if len(data) != 2:
            continue  # not the op as TensorFlow defines it: leave it to fail as it would
        resource, indices = data
        dtype = node.attr["dtype"].type
        read = nodes.add()
        read.name = f"{node.name}/mpspool_read"
        read.op = "ReadVariableOp"
        read.input.extend([resource, *control])
        read.attr["dtype"].type = dtype
        _copy_placement(node, read)
        read_out = f"{read.name}:value:0" if in_function else read.name
        gather = type(node)()
        gather.name = node.name
        _copy_placement(node, gather)
        for key in ("_output_shapes",):
            if key in node.attr:
                gather.attr[key].CopyFrom(node.attr[key])
        gather.attr["Tparams"].type = dtype
        gather.attr["Tindices"].CopyFrom(node.attr["Tindices"])
        if node.op == "ResourceGather":
            batch_dims = node.attr["batch_dims"].i if "batch_dims" in node.attr else 0
            axis = nodes.add()
            axis.name = f"{node.name}/mpspool_axis"
            axis.op = "Const"
            # A control input from the read puts the constant in the gather's frame (TF1
            # while loops); in a function it only orders two cheap nodes.
            axis.input.append(f"^{read.name}")
            axis.attr["dtype"].type = DT_INT32
            axis.attr["value"].tensor.dtype = DT_INT32
            axis.attr["value"].tensor.int_val.append(batch_dims)
            _copy_placement(node, axis)
            gather.op = "GatherV2"
            gather.input.extend(
                [read_out, indices, f"{axis.name}:output:0" if in_function else axis.name]
            )
            gather.attr["Taxis"].type = DT_INT32
            gather.attr["batch_dims"].i = batch_dims
        else:
            gather.op = "GatherNd"
            gather.input.extend([read_out, indices])
        nodes[index].CopyFrom(gather)
        count += 1
    return count


def _copy_placement(source: Any, dest: Any) -> None:
    if source.device:
        dest.device = source.device
