"""Plots of the bench scenarios (matplotlib, PNG), and the task-density computation behind one.

- ``plot_curves``: a metric (rows/s, p99 latency) against closed-loop concurrency, one line per
  system, one panel per batch size; a reference (the in-process limit, which has no
  concurrency axis of its own) as a dashed line or a single marker.
- ``occupancy`` / ``plot_density``: per-worker task density over time, after the
  GPU-scheduling retrospective's chart: from the worker-side start and end of each request,
  how many requests each worker was executing, per time bin, stacked, with the total.

``occupancy`` is pure numpy, exact on integer microseconds, and needs no matplotlib; the
plotting functions import matplotlib when called (the Agg backend: files only, no display).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# One color per system, the same in every plot; systems not listed take the next free ones.
SYSTEM_ORDER = (
    "inprocess", "plain", "ray", "triton", "mpspool-1", "mpspool-N", "mpspool-N-batching",
)  # fmt: skip


@dataclass(frozen=True)
class Occupancy:
    """Requests in execution per worker and time bin.

    ``edges_us`` holds the bin edges in µs since ``start_us`` (``len(edges_us) - 1`` bins;
    every bin is ``bin_us`` wide except the last, which ends at the window's end). ``busy``
    has one row per slot (in ``slots`` order) and one column per bin: the time-averaged
    number of that slot's requests in execution during the bin (1.0: one request for the
    whole bin; 0.25: one request for a quarter of it; 2.0: two overlapping requests).
    """

    slots: list[str]
    start_us: int
    edges_us: np.ndarray
    busy: np.ndarray

    @property
    def total(self) -> np.ndarray:
        """The sum over slots, per bin."""
        return self.busy.sum(axis=0)


def occupancy(
    spans: Iterable[Sequence[Any]],
    bin_us: int = 1000,
    start_us: int | None = None,
    end_us: int | None = None,
) -> Occupancy:
    """Per-slot occupancy of ``spans`` ([slot, start_us, end_us], wall-clock µs) in bins of
    ``bin_us`` over [start_us, end_us) (default: the first start to the last end).

    Exact: a span's share of a bin is its overlap with the bin divided by the bin's width,
    computed on integers. For each slot, the integral of its in-execution count up to t is
    sum_i (max(0, t - s_i) - max(0, t - e_i)), evaluated at every bin edge with sorted starts
    and ends and prefix sums; consecutive differences are the busy time per bin. Spans
    reaching outside the window count only inside it.
    """
    if bin_us <= 0:
        raise ValueError(f"bin_us must be positive, got {bin_us}")
    by_slot: dict[str, tuple[list[int], list[int]]] = {}
    for span in spans:
        slot, start, end = span
        start, end = int(start), int(end)
        if end < start:
            raise ValueError(f"span of slot {slot} ends before it starts: {start} > {end}")
        starts, ends = by_slot.setdefault(str(slot), ([], []))
        starts.append(start)
        ends.append(end)
    every_start = [s for starts, _ in by_slot.values() for s in starts]
    every_end = [e for _, ends in by_slot.values() for e in ends]
    origin = int(start_us) if start_us is not None else min(every_start, default=0)
    stop = int(end_us) if end_us is not None else max(every_end, default=origin)
    length = max(0, stop - origin)
    bins = -(-length // bin_us)  # ceil
    edges = np.minimum(np.arange(bins + 1, dtype=np.int64) * bin_us, length)
    slots = sorted(by_slot)
    busy = np.zeros((len(slots), bins), dtype=np.float64)
    if bins:
        widths = np.diff(edges).astype(np.float64)
        for row, slot in enumerate(slots):
            # Relative to the window's start, so that products stay far from int64's limit.
            starts = np.sort(np.asarray(by_slot[slot][0], dtype=np.int64) - origin)
            ends = np.sort(np.asarray(by_slot[slot][1], dtype=np.int64) - origin)
            integral = _ramp_sum(starts, edges) - _ramp_sum(ends, edges)
            busy[row] = np.diff(integral) / widths
    return Occupancy(slots=slots, start_us=origin, edges_us=edges, busy=busy)


def _ramp_sum(points: np.ndarray, at: np.ndarray) -> np.ndarray:
    """sum_i max(0, t - points_i) for every t in ``at``; ``points`` sorted."""
    prefix = np.concatenate(([0], np.cumsum(points)))
    count = np.searchsorted(points, at, side="right")
    return count * at - prefix[count]


# -- plotting -----------------------------------------------------------------------
def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def system_colors(systems: Iterable[str]) -> dict[str, Any]:
    """A stable color per system (tab10, in SYSTEM_ORDER first)."""
    plt = _pyplot()
    palette = plt.get_cmap("tab10").colors
    names = [s for s in SYSTEM_ORDER if s in systems] + sorted(
        s for s in systems if s not in SYSTEM_ORDER
    )
    fixed = {name: palette[i % len(palette)] for i, name in enumerate(SYSTEM_ORDER)}
    extra = iter(palette[len(SYSTEM_ORDER) :])
    return {name: fixed.get(name) or next(extra, "black") for name in names}


# A curve: (concurrency, value, errors) per point, in concurrency order.
Curve = Sequence[tuple[int, float, int]]


def plot_curves(
    curves: Mapping[int, Mapping[str, Curve]],
    path: Path,
    ylabel: str,
    title: str,
    labels: Mapping[str, str] | None = None,
    references: Mapping[int, Mapping[str, tuple[int, float]]] | None = None,
    reference_as_line: bool = True,
    log_y: bool = True,
) -> Path:
    """One panel per batch size (``curves[batch][system]``), x = concurrency (log 2).

    ``references[batch][system] = (x, value)``: a system without a concurrency sweep (the
    in-process limit), drawn as a dashed horizontal line at ``value`` (``reference_as_line``)
    or as a single marker at ``x``. Points that had errors are circled in red.
    """
    plt = _pyplot()
    labels = labels or {}
    references = references or {}
    batches = sorted(curves)
    systems = {s for per in curves.values() for s in per} | {
        s for per in references.values() for s in per
    }
    colors = system_colors(systems)
    fig, axes = plt.subplots(1, max(1, len(batches)), figsize=(6 * max(1, len(batches)), 4.5))
    axes = np.atleast_1d(axes)
    for ax, batch in zip(axes, batches, strict=False):
        for system, (x, value) in references.get(batch, {}).items():
            if not np.isfinite(value):
                continue
            label = labels.get(system, system)
            if reference_as_line:
                ax.axhline(value, color=colors[system], linestyle="--", linewidth=1.2, label=label)
            else:
                ax.plot(
                    [x], [value], marker="D", linestyle="none", color=colors[system], label=label
                )
        for system in colors:
            curve = curves[batch].get(system)
            if not curve:
                continue
            xs = [c for c, _, _ in curve]
            ys = [v for _, v, _ in curve]
            ax.plot(xs, ys, marker="o", color=colors[system], label=labels.get(system, system))
            bad = [(c, v) for c, v, errors in curve if errors]
            if bad:
                ax.plot(
                    [c for c, _ in bad], [v for _, v in bad], marker="o", markersize=12,
                    markerfacecolor="none", markeredgecolor="red", linestyle="none",
                )  # fmt: skip
        ax.set_xscale("log", base=2)
        ticks = sorted({c for curve in curves[batch].values() for c, _, _ in curve})
        if ticks:
            ax.set_xticks(ticks)
            ax.set_xticklabels([str(t) for t in ticks])
        if log_y:
            ax.set_yscale("log")
            _plain_log_labels(ax)
        ax.set_xlabel("concurrency (closed-loop clients)")
        ax.set_ylabel(ylabel)
        ax.set_title(f"batch {batch}")
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plain_log_labels(ax: Any) -> None:
    """Log-scale y labels as plain numbers (1,000 rather than 10^3); minor ticks labelled
    only when the axis spans less than a decade (otherwise they crowd)."""
    from matplotlib.ticker import FuncFormatter, NullFormatter

    plain = FuncFormatter(lambda v, _pos: f"{v:,.0f}" if v >= 10 else f"{v:g}")
    ax.yaxis.set_major_formatter(plain)
    low, high = ax.get_ylim()
    ax.yaxis.set_minor_formatter(plain if low > 0 and high / low < 10 else NullFormatter())


def plot_density(
    panels: Sequence[tuple[Occupancy, str]],
    path: Path,
    title: str,
    xlabel: str = "ms since the first span",
) -> Path:
    """Stacked per-worker occupancy over time (one color per worker) and the total, one
    panel per (occupancy, subtitle): e.g. the whole window in coarse bins, then an excerpt
    in fine ones where single requests show."""
    plt = _pyplot()
    fig, axes = plt.subplots(len(panels), 1, figsize=(12, 3.2 * len(panels)), squeeze=False)
    palette = plt.get_cmap("tab10").colors
    for ax, (occ, subtitle) in zip(axes[:, 0], panels, strict=True):
        if occ.busy.size:
            left_ms = occ.edges_us[:-1] / 1000.0
            # Steps: each bin's value holds over the whole bin.
            x = np.repeat(occ.edges_us / 1000.0, 2)[1:-1]
            stacked = np.repeat(occ.busy, 2, axis=1)
            ax.stackplot(
                x,
                stacked,
                labels=[f"worker {slot}" for slot in occ.slots],
                colors=[palette[i % len(palette)] for i in range(len(occ.slots))],
                alpha=0.8,
                linewidth=0,
            )
            ax.plot(x, np.repeat(occ.total, 2), color="black", linewidth=0.8, label="total")
            ax.set_xlim(left_ms[0], left_ms[-1] + np.diff(occ.edges_us)[-1] / 1000.0)
            ax.legend(loc="upper right", fontsize=8)
        else:
            ax.text(0.5, 0.5, "no spans", ha="center", va="center", transform=ax.transAxes)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("requests in execution")
        ax.set_title(subtitle, fontsize=10)
        ax.grid(True, alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
