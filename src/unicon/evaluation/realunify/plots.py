"""RealUnify figures from a ``metrics`` dict (:mod:`unicon.evaluation.realunify.metrics`' keys);
writes PNGs, reads nothing."""

from __future__ import annotations

from pathlib import Path

from matplotlib.figure import Figure

from unicon.evaluation.ureason.plots import accuracy_bars

#: the plots of :func:`plot_results`, logged as ``realunify/fig/<name>`` (``log_figures``)
FIGURES = ("settings_by_category",)
SETTINGS = (("direct", "Direct"), ("stepwise", "Stepwise"))


def groups(metrics: dict) -> list[str]:
    """The bar groups: the categories with a count ``n/<c>`` (in order), the axes, ``overall``."""
    cats = [k.split("/", 1)[1] for k in metrics if k.startswith("n/")]
    axes = [a for a in ("ueg", "geu") if any(f"acc_{s}/{a}" in metrics for s, _ in SETTINGS)]
    return [*cats, *axes, "overall"]


def settings_figure(metrics: dict) -> Figure:
    """Grouped bars: per category, axis and overall, the accuracy of the direct and stepwise settings in %."""
    names = groups(metrics)
    bars = {label: [metrics.get(f"acc_{k}/{g}" if g != "overall" else f"acc_{k}") or 0.0 for g in names]
            for k, label in SETTINGS}
    return accuracy_bars(names, bars, (0.9 * len(names) + 2.0, 3.0), 7, [g.replace("_", "\n") for g in names])


def plot_results(metrics: dict, out_dir: Path) -> None:
    """``settings_by_category.png`` (:func:`settings_figure`) in ``out_dir``."""
    settings_figure(metrics).savefig(Path(out_dir) / "settings_by_category.png", dpi=100)
