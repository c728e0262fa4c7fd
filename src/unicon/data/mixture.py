"""The standard pretraining mixture: ``mixture_<split>.jsonl`` of a ShapesWorld root.

One row per task example (layout in the team brief)::

    {"id", "scene_id", "image": "images/train/00042.png", "task": "caption"|"vqa"|"grounding"|"t2i",
     "text": question / referring expression / t2i caption / null, "target": caption / answer /
     [x, y, w, h] / null, "qtype", "scene"}

:class:`MixtureDataset` reads and validates the rows once (a bad row is a ``ValueError``
naming ``file:line`` and the key) and opens images lazily in ``__getitem__`` so that
multi-worker loading decodes PNGs in parallel. :func:`collate_mixture` keeps images as PIL
(``UnifiedModel.score_*`` accept them and know the image sizes needed for boxes).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Sequence

from PIL import Image
from torch.utils.data import Dataset

from unicon.data.jsonl import read_jsonl
from unicon.errors import UserError

log = logging.getLogger(__name__)

TASKS = ("caption", "vqa", "grounding", "t2i")


class MixtureFormatError(UserError, ValueError):
    """A pretraining-mixture file is missing or malformed; the message names ``file:line``."""


def _row_error(path: Path, line: int, msg: str) -> MixtureFormatError:
    return MixtureFormatError(f"{path}:{line}: {msg}")


def read_mixture(path: str | Path, tasks: Sequence[str] = TASKS) -> list[dict[str, Any]]:
    """Rows of a mixture file restricted to ``tasks`` (other tasks' rows are skipped), validated."""
    path = Path(path)
    if not path.is_file():
        raise MixtureFormatError(f"no pretraining-mixture file {path} (build it with `unicon build-data shapes`)")
    unknown = set(tasks) - set(TASKS)
    if unknown:
        raise ValueError(f"data.tasks: unknown task(s) {sorted(unknown)}; choose from {', '.join(TASKS)}")
    rows: list[dict[str, Any]] = []
    skipped: dict[str, int] = {}
    for n, row in read_jsonl(path, MixtureFormatError, "pretraining-mixture file"):
        if "task" not in row:
            raise _row_error(path, n, "missing key 'task'")
        task = row["task"]
        if task not in tasks:  # e.g. ShapesWorld's optional "reason" rows
            skipped[task] = skipped.get(task, 0) + 1
            continue
        for key in ("id", "image"):
            if key not in row:
                raise _row_error(path, n, f"missing key '{key}'")
        if task in ("vqa", "grounding", "t2i") and not row.get("text"):
            raise _row_error(path, n, f"task {task} needs a non-empty 'text'")
        if task in ("caption", "vqa") and not isinstance(row.get("target"), str):
            raise _row_error(path, n, f"task {task} needs a string 'target'")
        if task == "grounding":
            box = row.get("target")
            if not (isinstance(box, list) and len(box) == 4 and all(isinstance(v, (int, float)) for v in box)):
                raise _row_error(path, n, "task grounding needs 'target' = [x, y, w, h]")
        rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no rows for tasks {list(tasks)} (found {skipped or 'none'})")
    if skipped:
        log.info("%s: skipped rows of tasks not in data.tasks: %s", path, skipped)
    return rows


class MixtureDataset(Dataset):
    """Examples of ``<root>/mixture_<split>.jsonl`` with their images loaded as RGB PIL."""

    def __init__(self, root: str | Path, split: str = "train", tasks: Sequence[str] = TASKS):
        self.root = Path(root)
        self.path = self.root / f"mixture_{split}.jsonl"
        self.rows = read_mixture(self.path, tasks)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, idx: int) -> dict[str, Any]:
        row = self.rows[idx]
        image_path = self.root / row["image"]
        try:
            with Image.open(image_path) as im:
                image = im.convert("RGB")
        except (FileNotFoundError, OSError) as e:
            raise ValueError(f"{self.path}: row id={row['id']}: cannot open image {image_path} ({e})") from None
        return {
            "id": str(row["id"]),
            "task": row["task"],
            "text": row.get("text"),
            "target": row.get("target"),
            "image": image,
        }


def collate_mixture(examples: list[dict[str, Any]]) -> dict[str, Any]:
    """List of examples -> column lists (images stay PIL; tasks are grouped by the module)."""
    return {
        "ids": [e["id"] for e in examples],
        "tasks": [e["task"] for e in examples],
        "texts": [e["text"] for e in examples],
        "targets": [e["target"] for e in examples],
        "images": [e["image"] for e in examples],
    }
