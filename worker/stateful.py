"""Which serving signatures change state when they run (a counter's `assign_add`, a table's
insert, a random generator's draw): such a signature must run exactly as often as it is
asked to.

A worker runs each signature on zeros at warm-up and checks its fast call against the public
one on the same inputs (worker/runtime.py); both are extra runs that TF Serving never makes.
For a signature that writes a variable, a table or a generator's state, they would change
what its clients see (a counter answering 4 to its first 2-row request where TF Serving
answers 2; a seeded generator's first draw), so such a signature is not run at warm-up and
is served through the public call, unchecked. With shared weights and copies not allowed,
a signature that writes a variable is run at warm-up as before: the write copies the shared
variable into the worker, and that copy refuses the load (worker/shared_weights.py); state
that is no variable (a stateful random op's own sequence, a table) is left alone as without
shared weights.
"""

from __future__ import annotations

from typing import Any

# Ops that write state that is no variable: a lookup table, or a stateful random op's own
# sequence (Random*, ...). Stateless random ops (StatelessRandom*) write nothing.
_OP_STATE_PREFIXES = (
    "LookupTableInsert",
    "LookupTableRemove",
    "LookupTableImport",
    "Random",  # RandomUniform, RandomStandardNormal, RandomShuffle, RandomGamma, ...
    "TruncatedNormal",
    "ParameterizedTruncatedNormal",
    "Multinomial",
)
# Ops that write a variable (tf.random.Generator's state is one: RngReadAndSkip and the
# Stateful* draws). StatefulPartitionedCall (a call, looked into through the library) is not
# a write.
_VARIABLE_WRITES_PREFIXES = (
    "Assign",  # AssignVariableOp, AssignAddVariableOp, AssignSubVariableOp, ref Assign*
    "ResourceScatter",
    "ResourceApply",
    "ResourceSparseApply",
    "ResourceStridedSliceAssign",
    "StridedSliceAssign",
    "ResourceCountUpTo",
    "CountUpTo",
    "RngReadAndSkip",
    "RngSkip",
    "StatefulUniform",
    "StatefulStandardNormal",
    "StatefulTruncatedNormal",
    "StatefulRandomBinomial",
)
# The ref-variable scatters; ScatterNd and TensorScatter* make new tensors and write nothing.
_SCATTERS = ("Update", "Add", "Sub", "Mul", "Div", "Min", "Max", "NdUpdate", "NdAdd", "NdSub")
_WRITES = frozenset(f"Scatter{kind}" for kind in (*_SCATTERS, "NdMin", "NdMax"))


def writes_state(function: Any) -> str:
    """The first op of ``function``'s graph, or of a function it calls, that writes state
    (its type and node name), or "" when it writes none. A function TensorFlow cannot
    describe counts as writing nothing (its runs are checked as before)."""
    return _first_op(function, _OP_STATE_PREFIXES + _VARIABLE_WRITES_PREFIXES, _WRITES)


def writes_a_variable(function: Any) -> str:
    """As writes_state, for writes to a variable only."""
    return _first_op(function, _VARIABLE_WRITES_PREFIXES, _WRITES)


# The ops that call back into the exporting process's Python (tf.py_function,
# tf.numpy_function, tf1 py_func): a SavedModel keeps only a key into that process's registry.
_PYTHON_CALLS = frozenset({"EagerPyFunc", "PyFunc", "PyFuncStateless"})


def calls_python(function: Any) -> str:
    """The first op of ``function``'s graph, or of a function it calls, that calls Python
    code kept by the process that exported it (its type and node name), or "" if none."""
    return _first_op(function, (), _PYTHON_CALLS)


def _first_op(function: Any, prefixes: tuple[str, ...], exact: frozenset[str]) -> str:
    try:
        graph_def = function.graph.as_graph_def()
    except Exception:  # any failure to describe it: nothing known
        return ""
    scopes = [list(graph_def.node)] + [list(f.node_def) for f in graph_def.library.function]
    for nodes in scopes:
        for node in nodes:
            if node.op in exact or node.op.startswith(prefixes):
                return f"{node.op} (node {node.name!r})"
    return ""
