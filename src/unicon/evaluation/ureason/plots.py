"""UReason figures from a ``metrics`` dict (:func:`unicon.evaluation.ureason.metrics`' keys);
writes PNGs, reads nothing."""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

from matplotlib.figure import Figure

#: the plots of :func:`plot_results`, logged as ``ureason/fig/<name>`` (``log_figures``)
FIGURES = ("settings_by_category",)
#: the paper's three settings (section 3): (setting number, name)
SETTINGS = (("1", "Direct"), ("2", "Reasoning-guided"), ("3", "De-contextualized"))


def categories(metrics: dict) -> list[str]:
    """The categories with a per-category setting-1 accuracy (``acc_s1/<category>``), in order."""
    return [k.split("/", 1)[1] for k in metrics if k.startswith("acc_s1/")]


def accuracy_bars(groups: Sequence[str], bars: Mapping[str, Sequence[float]], figsize: tuple[float, float],
                  fontsize: int = 8, tick_labels: Sequence[str] | None = None) -> Figure:
    """Grouped bars from 0 to 100 %: per group, one bar of each entry of ``bars`` (its label: the
    group's accuracies), the legend right of the plot (RealUnify's settings figure draws with it too)."""
    fig = Figure(figsize=figsize)
    ax = fig.subplots()
    width = 0.8 / len(bars)
    for j, (label, values) in enumerate(bars.items()):
        ax.bar([i + (j - (len(bars) - 1) / 2) * width for i in range(len(groups))], values, width, label=label)
    ax.set_xticks(range(len(groups)), tick_labels or groups, fontsize=fontsize)
    ax.set_ylabel("accuracy %", fontsize=8)
    ax.set_ylim(0, 100)
    ax.tick_params(labelsize=fontsize)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    return fig


def settings_figure(metrics: dict) -> Figure:
    """Grouped bars: per category (and overall), the image accuracy of settings 1-3 in %."""
    groups = [*categories(metrics), "overall"]
    bars = {f"{k} {name}": [metrics.get(f"acc_s{k}/{c}" if c != "overall" else f"acc_s{k}") or 0.0 for c in groups]
            for k, name in SETTINGS}
    return accuracy_bars(groups, bars, (1.3 * len(groups) + 2.0, 2.8))


def plot_results(metrics: dict, out_dir: Path) -> None:
    """``settings_by_category.png`` (:func:`settings_figure`) in ``out_dir``."""
    settings_figure(metrics).savefig(Path(out_dir) / "settings_by_category.png", dpi=100)
