"""EditingScore figures from the per-sample records and the summary; writes PNGs, reads nothing."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from unicon.evaluation.editing.metrics import CORRELATED


def tau_figure(results: dict) -> Figure:
    """Grouped bars: Kendall tau_b of the score, each ablation and each component, per criterion."""
    crit = results["criteria"]
    fig = Figure(figsize=(1.0 * len(CORRELATED) + 2.0, 3.0))
    ax = fig.subplots()
    width = 0.8 / max(len(crit), 1)
    for j, c in enumerate(crit):
        vals = [results["kendall"][k][c]["tau_b"] for k in CORRELATED]
        vals = [0.0 if v is None else v for v in vals]  # an undefined tau (None) is drawn at 0
        ax.bar([i + (j - (len(crit) - 1) / 2) * width for i in range(len(CORRELATED))], vals, width, label=c)
    ax.axhline(0, color="black", lw=0.5)
    ax.set_xticks(range(len(CORRELATED)), [k.replace("_", "\n") for k in CORRELATED], fontsize=7)
    ax.set_ylabel("Kendall tau_b", fontsize=8)
    ax.set_ylim(-1, 1)
    ax.tick_params(labelsize=7)
    if crit:
        ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    return fig


def scatter_figure(records: list[dict], criterion: str = "overall") -> Figure:
    """log10 of the raw score (clipped to its finite positive part) against the ``criterion`` rating."""
    xs, ys = [], []
    for r in records:
        y = (r.get("ratings") or {}).get(criterion)
        s = r.get("score")
        if y is None or s is None or not math.isfinite(s):
            continue
        xs.append(y)
        ys.append(math.log10(max(s, 1e-12)))
    fig = Figure(figsize=(4.0, 3.0))
    ax = fig.subplots()
    if xs:
        jitter = np.random.default_rng(0).uniform(-0.01, 0.01, len(xs))
        ax.scatter(np.array(xs) + jitter, ys, s=6, alpha=0.6)
    ax.set_xlabel(f"rating: {criterion}", fontsize=8)
    ax.set_ylabel("log10 EditingScore (raw, <= 0 shown at -12)", fontsize=7)
    ax.tick_params(labelsize=7)
    fig.tight_layout()
    return fig


def plot_results(records: list[dict], results: dict, out_dir: Path) -> None:
    """``tau_by_variant.png`` and ``score_vs_rating.png`` in ``out_dir``."""
    tau_figure(results).savefig(Path(out_dir) / "tau_by_variant.png", dpi=100)
    crit = "overall" if "overall" in results["criteria"] else (results["criteria"] or ["overall"])[0]
    scatter_figure(records, crit).savefig(Path(out_dir) / "score_vs_rating.png", dpi=100)
