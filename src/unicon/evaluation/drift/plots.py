"""Drift figures and their logging: S_delta(g) curves (paper Fig. 6), the MGG task x generation
heatmap (Fig. 11), and chain strips (images and captions along a few chains).

Inputs are the report dictionaries of :mod:`.metrics` and the strip *trails* of :mod:`.runner`
(``(chain, id, items)`` with ``items[g]`` a caption or an image); nothing here reads chain folders.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any, Sequence

import numpy as np
from matplotlib.figure import Figure
from PIL import Image

from unicon.evaluation.drift.metrics import MAPPINGS, decay
from unicon.evaluation.drift.report import FIGURES
from unicon.evaluation.logs import log_figures, log_table, log_wandb
from unicon.loggers import is_wandb

#: columns of the chain-strip table
STRIP_COLUMNS = ["chain", "id", "images", "captions"]

Trail = tuple[str, str, Sequence[Any]]  # (chain, seed id, caption or image per generation)


def plot_curves(mcd: dict, path: Path, title: str = "") -> Path:
    """S_delta(g) per mapping (one panel each, one line per embedder, dashed: the decay fit), like Fig. 6."""
    fig = Figure(figsize=(16, 3.6))
    axes = fig.subplots(1, 4, squeeze=False)
    for ax, mapping in zip(axes[0], MAPPINGS):
        chain, _, src, tgt = MAPPINGS[mapping]
        for name, per in mcd["by_embedder"].items():
            if mapping in per:
                S = per[mapping]["S"]
                ax.plot(list(S), list(S.values()), marker="o", label=f"{name} (MCD {per[mapping]['MCD']:.3f})")
        fit = mcd["decay"].get(mapping, {})
        if "b" in fit and mapping in mcd["S"]:
            xs = np.linspace(min(mcd["S"][mapping]), max(mcd["S"][mapping]), 50)
            ax.plot(xs, decay(xs, fit["a"], fit["b"], fit["c"]), "k--", lw=1, label=f"fit b={fit['b']:.2f}")
        values = [v for line in ax.lines for v in line.get_ydata()]
        ax.set_ylim(min([0.0, *values]) - 0.02, 1.02)
        ax.set_title(f"{chain}: {src} -> {tgt}")
        ax.set_xlabel("generation g")
        ax.set_ylabel("S(g)")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    fig.suptitle(title or f"MCD_avg = {mcd['MCD_avg']:.3f}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def plot_mgg_heatmap(mgg: dict, path: Path) -> Path:
    """Task x generation GenEval accuracy heatmap, like Fig. 11."""
    gens = sorted(mgg["per_generation"])
    tasks = list(next(iter(mgg["per_generation"].values()))["tasks"])
    grid = np.array([[mgg["per_generation"][g]["tasks"].get(t, np.nan) for g in gens] for t in tasks])
    fig = Figure(figsize=(1.2 + 0.6 * len(gens), 0.8 + 0.5 * len(tasks)))
    ax = fig.subplots()
    im = ax.imshow(grid, vmin=0, vmax=1, cmap="viridis", aspect="auto")
    ax.set_xticks(range(len(gens)), [str(g) for g in gens])
    ax.set_yticks(range(len(tasks)), tasks)
    for r in range(len(tasks)):
        for c in range(len(gens)):
            ax.text(c, r, f"{grid[r, c]:.2f}", ha="center", va="center", fontsize=7,
                    color="k" if grid[r, c] > 0.6 else "w")
    ax.set_xlabel("generation")
    ax.set_title(f"MGG = {mgg['MGG']:.3f}")
    fig.colorbar(im, ax=ax, fraction=0.04)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def plot_strips(trails: Sequence[Trail], path: Path, max_gens: int = 8) -> Path:
    """One row per chain: its items at generations ``0..max_gens`` (images, or wrapped captions)."""
    G = min(len(trails[0][2]) - 1, max_gens)
    fig = Figure(figsize=(2.2 * (G + 1), 2.6 * len(trails)))
    axes = fig.subplots(len(trails), G + 1, squeeze=False)
    for r, (chain, id_, items) in enumerate(trails):
        for g in range(G + 1):
            ax = axes[r][g]
            ax.axis("off")
            if isinstance(items[g], str):
                ax.text(0.0, 0.5, "\n".join(textwrap.wrap(items[g], 28)[:9]), fontsize=6, va="center", wrap=True)
            else:
                ax.imshow(items[g])
            ax.set_title(f"{chain} {id_[:16]} g0" if g == 0 else f"g{g}", fontsize=7)
    fig.subplots_adjust(left=0.01, right=0.99, top=0.95, bottom=0.01, wspace=0.05, hspace=0.25)
    fig.savefig(path, dpi=90)
    return path


def chain_strip(items: Sequence[Any], thumb: int = 128) -> tuple[Image.Image, list[str]]:
    """One chain as a horizontal strip of its images (``thumb`` px squares) and its captions
    (``"g<g>: <caption>"``)."""
    images, captions = [], []
    for g, item in enumerate(items):
        if isinstance(item, str):
            captions.append(f"g{g}: {item}")
        else:
            images.append(item.resize((thumb, thumb)))
    strip = Image.new("RGB", (max(1, len(images)) * (thumb + 4), thumb), "white")
    for k, im in enumerate(images):
        strip.paste(im, (k * (thumb + 4), 0))
    return strip, captions


def _strip_file(chain: str, id_: str) -> str:
    return f"strips/{chain}-{id_}.png"


def strip_entries(trails: Sequence[Trail]) -> list[dict[str, str]]:
    """The strip table as recorded in ``drift.json``: chain, id, strip image (relative to the
    output folder, written by :func:`save_strip_images`) and the captions."""
    return [{"chain": chain, "id": id_, "image": _strip_file(chain, id_), "captions": "\n".join(chain_strip(items)[1])}
            for chain, id_, items in trails]


def save_strip_images(trails: Sequence[Trail], out: Path) -> None:
    """Write the strip images named by :func:`strip_entries` under ``out``."""
    for chain, id_, items in trails:
        path = out / _strip_file(chain, id_)
        path.parent.mkdir(parents=True, exist_ok=True)
        chain_strip(items)[0].save(path)


def log_plots(loggers, report: dict[str, Any], out: Path, step: int | None = None, prefix: str = "drift") -> None:
    """Send a drift report's pictures to the loggers: W&B line plots of S_delta(g) and of GenEval
    overall by generation, the figures in ``out`` (:data:`FIGURES`, as ``<prefix>/fig/<name>``)
    and the chain-strip table (``log_table``: a ``wandb.Table`` on W&B, ``tables/<key>.jsonl`` +
    PNGs for the other loggers). Reads ``out``: call it where ``out`` was written (rank 0)."""
    if any(is_wandb(lg) for lg in loggers):
        import wandb

        charts = {}
        for mapping, S in report.get("mcd", {}).get("S", {}).items():
            table = wandb.Table(data=[[g, v] for g, v in S.items()], columns=["generation", "S"])
            charts[f"{prefix}/S_{mapping}"] = wandb.plot.line(table, "generation", "S", title=f"S_{mapping}(g)")
        if "mgg" in report:
            data = [[g, v["overall"]] for g, v in report["mgg"]["per_generation"].items()]
            table = wandb.Table(data=data, columns=["generation", "GenEval overall"])
            charts[f"{prefix}/MGG_by_generation"] = wandb.plot.line(table, "generation", "GenEval overall",
                                                                   title="GenEval overall by generation")
        log_wandb(loggers, charts, step=step)
    log_figures(loggers, prefix, out, FIGURES, step=step)
    if report.get("strips"):
        rows = []
        for entry in report["strips"]:
            with Image.open(out / entry["image"]) as im:
                rows.append([entry["chain"], entry["id"], im.convert("RGB"), entry["captions"]])
        log_table(loggers, f"{prefix}/strips", STRIP_COLUMNS, rows, step=step)
