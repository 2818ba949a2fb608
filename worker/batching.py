"""Opportunistic batching: requests already queued at a worker run as one model call.

With `--enable-batching`, a worker that finds several requests waiting in its socket merges
those that can share a call (same signature, same outputs, inputs of the same dtypes and
trailing dimensions) along the first dimension, up to `--max-batch-size` rows, runs them
once and splits the answers back. Nothing waits for a batch to fill — TF Serving's
`batch_timeout_micros: 0` — so batching adds no latency; it only spends less per request
when requests queue anyway. Like TF Serving's batching it is opt-in: it is only correct
for models whose every output row depends on its own input row alone.

Pure numpy, so the merge and split rules are tested without TensorFlow.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import numpy as np


@dataclasses.dataclass
class Pending:
    """One checked request waiting to run."""

    request_id: Any
    signature: str
    outputs: list[str]
    inputs: Mapping[str, np.ndarray]

    @property
    def rows(self) -> int | None:
        """The first dimension all inputs share, or None (then it runs alone)."""
        sizes = {a.shape[0] if a.ndim else None for a in self.inputs.values()}
        if len(sizes) != 1:
            return None
        (rows,) = sizes
        return rows

    def merge_key(self) -> Hashable | None:
        rows = self.rows
        if not rows:
            return None
        inputs = tuple(
            (name, array.dtype.str, array.shape[1:]) for name, array in sorted(self.inputs.items())
        )
        return self.signature, tuple(self.outputs), inputs


def plan(pending: Sequence[Pending], max_rows: int) -> list[list[Pending]]:
    """Groups to run, one model call each, in arrival order of their first request.

    Requests with the same merge key join the open group of that key while it stays within
    `max_rows`; a request that cannot merge (or is larger than `max_rows` by itself) runs
    alone.
    """
    groups: list[list[Pending]] = []
    open_groups: dict[Hashable, tuple[list[Pending], int]] = {}
    for request in pending:
        key = request.merge_key()
        rows = request.rows or 0
        if key is None or rows > max_rows:
            groups.append([request])
            continue
        group, total = open_groups.get(key, (None, 0))
        if group is None or total + rows > max_rows:
            group, total = [], 0
            groups.append(group)
        group.append(request)
        open_groups[key] = (group, total + rows)
    return groups


def merge(group: Sequence[Pending]) -> dict[str, np.ndarray]:
    """The group's inputs, concatenated along the first dimension in group order."""
    names = group[0].inputs.keys()
    return {name: np.concatenate([p.inputs[name] for p in group]) for name in names}


def split(
    group: Sequence[Pending], outputs: Mapping[str, np.ndarray]
) -> list[dict[str, Any]] | None:
    """Each request's rows of the merged outputs; None when an output does not have one row
    per input row (a model that reduces over the batch cannot be split: run them alone)."""
    sizes = [p.rows or 0 for p in group]
    total = sum(sizes)
    if any(a.ndim == 0 or a.shape[0] != total for a in outputs.values()):
        return None
    bounds = np.cumsum([0, *sizes])
    return [
        {name: array[bounds[i] : bounds[i + 1]] for name, array in outputs.items()}
        for i in range(len(group))
    ]
