"""The standard pretraining mixture: ``mixture_<split>.jsonl`` of a ShapesWorld root.

One row per task example::

    {"id", "scene_id", "image": "images/train/00042.png" | null,
     "task": "caption" | "vqa" | "grounding" | "t2i" | "reason" | "reason_t2i",
     "text": question / referring expression / t2i caption / think prompt / null,
     "target": caption / answer / [x, y, w, h] / reasoning trace / null, "qtype", "scene",
     "context": reasoning trace (reason_t2i only)}

``reason`` rows (ShapesWorld's think-then-draw prompts) have no image: the model is trained to
write the trace ``R`` (ending in ``refined prompt: ...``) from the prompt alone, through
``UnifiedModel.score_text(None, ...)`` -- the text-only format ``UnifiedModel.reason`` generates in.
``reason_t2i`` rows are the same items drawn: the image from ``[P, R]`` (prompt ``text``, trace
``context``), through ``UnifiedModel.score_image(..., contexts=...)`` -- the input UReason's
setting 2 gives ``generate_image``. Every task but ``reason`` needs an image. Which tasks a run
trains on is ``data.tasks``.

:class:`MixtureDataset` reads and validates the rows once (a bad row is a ``ValueError``
naming ``file:line`` and the key) and opens images lazily in ``__getitem__`` so that
multi-worker loading decodes PNGs in parallel. Decoded images are kept in a least-recently-used
cache of ``image_cache_mb`` megabytes per process (``data.image_cache_mb``): a ShapesWorld
image is shared by ~10 rows and the whole train split (6000 images of 64x64) takes 74 MB, so
every PNG is decoded once per run instead of once per example. :func:`collate_mixture` keeps
images as PIL (``UnifiedModel.score_*`` accept them and know the image sizes needed for boxes).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from pathlib import Path
from typing import Any, Sequence

from PIL import Image
from torch.utils.data import Dataset

from unicon.data.jsonl import read_jsonl
from unicon.errors import UserError

log = logging.getLogger(__name__)

TASKS = ("caption", "vqa", "grounding", "t2i", "reason", "reason_t2i")
IMAGE_FREE_TASKS = ("reason",)


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
        if task not in tasks:  # e.g. the "reason" rows of a run that trains on the image tasks only
            skipped[task] = skipped.get(task, 0) + 1
            continue
        if "id" not in row:
            raise _row_error(path, n, "missing key 'id'")
        if task not in IMAGE_FREE_TASKS and not isinstance(row.get("image"), str):
            raise _row_error(path, n, f"task {task} needs 'image' (a path relative to {path.parent})")
        if task in ("vqa", "grounding", "t2i", "reason", "reason_t2i") and not row.get("text"):
            raise _row_error(path, n, f"task {task} needs a non-empty 'text'")
        if task == "reason_t2i" and not (isinstance(row.get("context"), str) and row["context"]):
            raise _row_error(path, n, "task reason_t2i needs a non-empty string 'context' (the reasoning trace)")
        if task in ("caption", "vqa", "reason") and not (isinstance(row.get("target"), str) and row["target"]):
            raise _row_error(path, n, f"task {task} needs a non-empty string 'target'")
        if task == "grounding":
            box = row.get("target")
            if not (isinstance(box, list) and len(box) == 4 and all(isinstance(v, (int, float)) for v in box)):
                raise _row_error(path, n, "task grounding needs 'target' = [x, y, w, h]")
        rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no rows for tasks {list(tasks)} (found {skipped or 'none'})")
    if skipped:
        log.info("%s: skipped rows of tasks not in data.tasks: %s", path, skipped)
    found = {r["task"] for r in rows}
    absent = [t for t in tasks if t not in found]
    if absent:
        log.warning("%s has no rows of task(s) %s listed in data.tasks; training on the others", path, absent)
    return rows


class MixtureDataset(Dataset):
    """Examples of ``<root>/mixture_<split>.jsonl`` with their images loaded as RGB PIL (see the
    module docstring for ``image_cache_mb``; 0 decodes every time)."""

    def __init__(self, root: str | Path, split: str = "train", tasks: Sequence[str] = TASKS,
                 image_cache_mb: float = 256.0):
        if image_cache_mb < 0:
            raise ValueError(f"image_cache_mb must be >= 0, got {image_cache_mb}")
        self.root = Path(root)
        self.path = self.root / f"mixture_{split}.jsonl"
        self.rows = read_mixture(self.path, tasks)
        self.cache_bytes = int(image_cache_mb * 2**20)
        self._cache: OrderedDict[str, Image.Image] = OrderedDict()
        self._cached_bytes = 0

    def __len__(self) -> int:
        return len(self.rows)

    def _image(self, row: dict[str, Any]) -> Image.Image:
        key = row["image"]
        image = self._cache.get(key)
        if image is not None:
            self._cache.move_to_end(key)
            return image
        image_path = self.root / key
        try:
            with Image.open(image_path) as im:
                image = im.convert("RGB")
        except (FileNotFoundError, OSError) as e:
            raise ValueError(f"{self.path}: row id={row['id']}: cannot open image {image_path} ({e})") from None
        size = image.width * image.height * 3
        if size <= self.cache_bytes:
            self._cache[key] = image
            self._cached_bytes += size
            while self._cached_bytes > self.cache_bytes:
                _, old = self._cache.popitem(last=False)
                self._cached_bytes -= old.width * old.height * 3
        return image

    def __getitem__(self, idx: int) -> dict[str, Any]:
        row = self.rows[idx]
        image = None if row["task"] in IMAGE_FREE_TASKS else self._image(row)
        return {
            "id": str(row["id"]),
            "task": row["task"],
            "text": row.get("text"),
            "target": row.get("target"),
            "context": row.get("context"),
            "image": image,
        }


def collate_mixture(examples: list[dict[str, Any]]) -> dict[str, Any]:
    """List of examples -> column lists (images stay PIL, None for ``reason`` rows; the module groups tasks)."""
    return {
        "ids": [e["id"] for e in examples],
        "tasks": [e["task"] for e in examples],
        "texts": [e["text"] for e in examples],
        "targets": [e["target"] for e in examples],
        "contexts": [e.get("context") for e in examples],
        "images": [e["image"] for e in examples],
    }
