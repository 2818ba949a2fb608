"""The front-door scenario's plot (matplotlib, PNG): rows/s and p99 latency against concurrency,
one line per system and one column per batch size; the in-process limit, which has no
concurrency axis, as dashed lines."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


def plot_windows(
    windows: Sequence[Mapping[str, Any]],
    references: Mapping[int, Mapping[str, float]],
    path: Path,
    title: str,
) -> Path:
    """``windows``: the scenario's table rows; ``references[batch][label]``: rows/s lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({w["batch"] for w in windows})
    systems = list(dict.fromkeys(w["system"] for w in windows))
    colors = {s: plt.get_cmap("tab10")(i % 10) for i, s in enumerate(systems)}
    fig, axes = plt.subplots(2, len(batches), figsize=(6 * len(batches), 8), squeeze=False)
    for col, batch in enumerate(batches):
        for row, (key, label) in enumerate((("rows_per_s", "rows/s"), ("p99_ms", "p99 ms"))):
            ax = axes[row][col]
            for system in systems:
                points = sorted(
                    (w["concurrency"], w[key])
                    for w in windows
                    if w["system"] == system and w["batch"] == batch
                )
                if points:
                    xs, ys = zip(*points, strict=True)
                    ax.plot(xs, ys, marker="o", color=colors[system], label=system)
            if key == "rows_per_s":
                # A style of its own for each reference (up to eight), so none reads as another.
                styles = ("--", ":", "-.", (0, (5, 1, 1, 1, 1, 1)))
                for i, (name, value) in enumerate(references.get(batch, {}).items()):
                    ax.axhline(
                        value,
                        color=("black", "dimgray")[i // len(styles) % 2],
                        linestyle=styles[i % len(styles)],
                        label=name,
                    )
            ax.set_xscale("log", base=2)
            ticks = sorted({w["concurrency"] for w in windows})
            ax.set_xticks(ticks, [str(t) for t in ticks])
            ax.set_yscale("log")
            ax.set_xlabel("concurrency (h2load streams)")
            ax.set_ylabel(label)
            ax.set_title(f"batch {batch}: {label}")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
