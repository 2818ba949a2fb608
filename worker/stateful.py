"""Which serving signatures change state when they run (a counter's `assign_add`, a table's
insert, a random generator's draw): such a signature must run exactly as often as it is
asked to.

A worker runs each signature on zeros at warm-up and checks its fast call against the public
one on the same inputs (worker/runtime.py); both are extra runs that TF Serving never makes.
For a signature that writes a variable, a table or a generator's state, they would change
what its clients see (a counter answering 4 to its first 2-row request where TF Serving
answers 2; a seeded generator's first draw), so such a signature is not run at warm-up and
is served through the public call, unchecked. Without shared weights only: with them, a
write to a shared variable is refused at warm-up as a copy (worker/shared_weights.py).
"""

from __future__ import annotations

from typing import Any

# Ops that write a variable, a lookup table or a random generator's state (tf.random.Generator's
# RngReadAndSkip and Stateful* draws; the older stateful draws, Random*, advance their op's
# own sequence). Stateless random ops (StatelessRandom*) and StatefulPartitionedCall (a call,
# looked into through the library) are not writes.
_WRITES_PREFIXES = (
    "Assign",  # AssignVariableOp, AssignAddVariableOp, AssignSubVariableOp, ref Assign*
    "ResourceScatter",
    "ResourceApply",
    "ResourceSparseApply",
    "ResourceStridedSliceAssign",
    "StridedSliceAssign",
    "ResourceCountUpTo",
    "CountUpTo",
    "LookupTableInsert",
    "LookupTableRemove",
    "LookupTableImport",
    "RngReadAndSkip",
    "RngSkip",
    "StatefulUniform",
    "StatefulStandardNormal",
    "StatefulTruncatedNormal",
    "StatefulRandomBinomial",
    "Random",  # RandomUniform, RandomStandardNormal, RandomShuffle, RandomGamma, ...
    "TruncatedNormal",
    "ParameterizedTruncatedNormal",
    "Multinomial",
)
# The ref-variable scatters; ScatterNd and TensorScatter* make new tensors and write nothing.
_SCATTERS = ("Update", "Add", "Sub", "Mul", "Div", "Min", "Max", "NdUpdate", "NdAdd", "NdSub")
_WRITES = frozenset(f"Scatter{kind}" for kind in (*_SCATTERS, "NdMin", "NdMax"))


def writes_state(function: Any) -> str:
    """The first op of ``function``'s graph, or of a function it calls, that writes a
    variable or a table (its type and node name), or "" when it writes none. A function
    TensorFlow cannot describe counts as writing nothing (its runs are checked as before)."""
    try:
        graph_def = function.graph.as_graph_def()
    except Exception:  # any failure to describe it: nothing known
        return ""
    scopes = [list(graph_def.node)] + [list(f.node_def) for f in graph_def.library.function]
    for nodes in scopes:
        for node in nodes:
            if node.op in _WRITES or node.op.startswith(_WRITES_PREFIXES):
                return f"{node.op} (node {node.name!r})"
    return ""
