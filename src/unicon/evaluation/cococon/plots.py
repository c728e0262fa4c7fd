"""CocoCon figures (the paper's Fig. 5) from a ``results`` dict; writes PNGs, reads nothing."""

from __future__ import annotations

from pathlib import Path

from matplotlib.figure import Figure

from unicon.evaluation.cococon.metrics import evaluated_tasks

COLORS = {"vqa": "tab:blue", "localization": "tab:red", "t2i": "tab:green"}


def plot_results(results: dict, out_dir: Path) -> None:
    """``consistency_by_k.png`` (Fig. 5a: C_k against k) and ``consistency_vs_accuracy.png``
    (Fig. 5b: C_k against acc@k, one point per k) for every evaluated task."""
    fig = Figure(figsize=(4.5, 3.5))
    ax = fig.subplots()
    for t in evaluated_tasks(results):
        ks = [k for k, n in results[t]["n_k"].items() if n > 0]
        ax.plot(ks, [results[t]["C_k"][k] for k in ks], "o-", color=COLORS[t], label=t)
    ax.set_xlabel("difficulty k (1 = hardest contrast)")
    ax.set_ylabel("% consistency C_k")
    ax.set_ylim(0, 100)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "consistency_by_k.png", dpi=120)

    fig = Figure(figsize=(4.5, 4.5))
    ax = fig.subplots()
    ax.plot([0, 100], [0, 100], "k--", lw=0.8)
    for t in evaluated_tasks(results):
        ks = [k for k, n in results[t]["n_k"].items() if n > 0]
        xs = [results[t]["acc@k"][k] for k in ks]
        ys = [results[t]["C_k"][k] for k in ks]
        ax.plot(xs, ys, "o-", color=COLORS[t], lw=0.8, label=t)
        for k, x, y in zip(ks, xs, ys):
            ax.annotate(f"k={k}", (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("% ranking accuracy@k (task alone)")
    ax.set_ylabel("% consistency C_k")
    ax.set_xlim(0, 100)
    ax.set_ylim(0, 100)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "consistency_vs_accuracy.png", dpi=120)
