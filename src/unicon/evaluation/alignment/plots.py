"""The alignment figure from per-sample records; writes a PNG, reads nothing."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence

from matplotlib.figure import Figure

from unicon.evaluation.correlation import kendall


def scatter_figure(records: Sequence[dict], names: Sequence[str]) -> Figure:
    """One panel per metric: its score (y) against the human rating (x), a little horizontal jitter-free
    transparency so that tied ratings show as dense columns; the panel title has τ_b."""
    cols = min(4, max(1, len(names)))
    rows = max(1, math.ceil(len(names) / cols))
    fig = Figure(figsize=(3.0 * cols, 2.6 * rows))
    axes = fig.subplots(rows, cols, squeeze=False)
    ratings = [r["rating"] for r in records]
    for k, name in enumerate(names):
        ax = axes[k // cols][k % cols]
        pts = [(r["rating"], r["scores"].get(name)) for r in records if r["scores"].get(name) is not None]
        if pts:
            x, y = zip(*pts)
            ax.scatter(x, y, s=8, alpha=0.35, linewidths=0)
        tau = kendall([r["scores"].get(name) for r in records], ratings)["tau_b"]
        ax.set_title(f"{name}  τ_b={'–' if tau is None else f'{tau:.3f}'}  n={len(pts)}", fontsize=8)
        ax.set_xlabel("human rating", fontsize=7)
        ax.tick_params(labelsize=7)
    for k in range(len(names), rows * cols):
        axes[k // cols][k % cols].axis("off")
    fig.tight_layout()
    return fig


def plot_results(records: Sequence[dict], names: Sequence[str], out_dir: Path) -> None:
    """``metrics_vs_rating.png`` (:func:`scatter_figure`) in ``out_dir``."""
    if names:
        scatter_figure(records, names).savefig(Path(out_dir) / "metrics_vs_rating.png", dpi=100)
