"""The picture of ``unicon evaluate shapes``: per task, the first examples with the input image (or
the generated image; for edits the source beside the edited image), the predicted box (gold box
dashed), the generated caption or answer, and the world verifier's verdict."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Sequence

import matplotlib.patches as patches
import numpy as np
from matplotlib.figure import Figure

#: the picture, ``<out>/<name>.png``, logged as ``shapes/fig/<name>``
FIGURES = ("shapes_eval",)

NAMES = {"vqa": "VQA", "caption": "caption", "grounding": "localization", "t2i": "text-to-image",
         "edit": "image editing"}


def plot_examples(examples: Sequence[dict], path: Path, per_task: int) -> Path:
    """A grid: one row per task, ``per_task`` examples each (see the module docstring)."""
    tasks = [t for t in NAMES if any(e["task"] == t for e in examples)]
    fig = Figure(figsize=(2.4 * per_task, 2.9 * len(tasks)))
    axes = fig.subplots(len(tasks), per_task, squeeze=False)
    for row, task in zip(axes, tasks):
        items = [e for e in examples if e["task"] == task][:per_task]
        for ax, e in zip(row, items):
            if task == "edit":  # the source and the edited image side by side
                shown = np.concatenate([np.asarray(e["image"].convert("RGB")),
                                        np.asarray(e["prediction"].convert("RGB").resize(e["image"].size))], axis=1)
            else:
                shown = e["prediction"] if task == "t2i" else e["image"]
            ax.imshow(shown)
            if task == "grounding":
                for box, style in ((e["target"], "--"), (e["prediction"], "-")):
                    x, y, w, h = box
                    ax.add_patch(patches.Rectangle((x, y), w, h, fill=False, lw=1.5, ls=style,
                                                   edgecolor="lime" if style == "-" else "white"))
            mark = "ok" if e["correct"] else "wrong"
            text = {"vqa": f"Q: {e['text']}\nA: {e['prediction']} ({mark})",
                    "caption": f"{e['prediction']}\n({mark})",
                    "grounding": f"{e['text']}\n({mark})",
                    "t2i": f"{e['text']}\n({mark})",
                    "edit": f"{e['text']}\n({mark})"}[task]
            lines = [ln for part in text.split("\n") for ln in textwrap.wrap(part, 30) or [""]]
            if len(lines) > 4:  # a runaway generation: keep the start and the verdict
                lines = lines[:3] + ["…", lines[-1]]
            ax.set_title("\n".join(lines), fontsize=6, color="black" if e["correct"] else "crimson")
            ax.axis("off")
        for ax in row[len(items):]:
            ax.axis("off")
        row[0].text(-0.15, 0.5, NAMES[task], transform=row[0].transAxes, rotation=90, va="center", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path
