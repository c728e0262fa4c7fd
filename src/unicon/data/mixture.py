"""The pretraining mixture's row format and datasets: ``mixture_<split>.jsonl`` of a ShapesWorld root,
whose rows the COCO source (:mod:`unicon.data.coco_mixture`) also produces.

One row per task example::

    {"id", "scene_id", "image": "images/train/00042.png" | null,
     "task": "caption" | "vqa" | "grounding" | "t2i" | "reason" | "reason_t2i" | "instruct",
     "text": question / referring expression / t2i caption / think prompt / null,
     "target": caption / answer / [x, y, w, h] / reasoning trace / null, "qtype", "scene",
     "context": reasoning trace (reason_t2i only)}

``reason`` rows (ShapesWorld's think-then-draw prompts) have no image: the model is trained to
write the trace ``R`` (ending in ``refined prompt: ...``) from the prompt alone, through
``UnifiedModel.score_text(None, ...)`` -- the text-only format ``UnifiedModel.reason`` generates in.
``reason_t2i`` rows are the same items drawn: the image from ``[P, R]`` (prompt ``text``, trace
``context``), through ``UnifiedModel.score_image(..., contexts=...)`` -- the input UReason's
setting 2 gives ``generate_image``. ``instruct`` rows ask a suite's own prompt format about an image
(RealUnify's multiple choice, BagelScore's rating; ``data_builders.shapes_instruct``): image + prompt ->
short text, the prompt given as ``UnifiedModel.answer`` gives it. Every task but ``reason`` needs an image. Which tasks a run
trains on is ``data.tasks``.

``edit`` rows (:data:`EDIT_TASK`) live in the world's ``edit_<split>.jsonl``, not in the mixture file
(:mod:`unicon.worlds.shapes_edit`)::

    {"id", "task": "edit", "kind", "image": <source png>, "text": <instruction>,
     "target_image": <target png>, "source_scene", "target_scene"}

:class:`MixtureDataset` reads them only when ``tasks`` lists ``edit`` (after the mixture rows, so the
other rows keep their indices); an edit example has ``image`` = the source, ``target`` = the target
image (both PIL, decoded lazily through the same cache) and ``text`` = the instruction. Without
``edit`` in ``tasks`` nothing is read and the rows are exactly the mixture file's.

:class:`MixtureDataset` reads and validates the rows once (a bad row is a ``ValueError``
naming ``file:line`` and the key); its base :class:`MixtureRowsDataset` (also the dataset of the
COCO mixture, :mod:`unicon.data.coco_mixture`) opens images lazily in ``__getitem__`` so that
multi-worker loading decodes PNGs in parallel. Decoded images are kept in a least-recently-used
cache of ``image_cache_mb`` megabytes per process (``data.image_cache_mb``): a ShapesWorld
image is shared by ~10 rows and the whole train split (6000 images of 64x64) takes 74 MB, so
every PNG is decoded once per run instead of once per example. :func:`collate_mixture` keeps
images as PIL (``UnifiedModel.score_*`` accept them and know the image sizes needed for boxes).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from PIL import Image
from torch.utils.data import Dataset

from unicon.data.jsonl import read_jsonl
from unicon.errors import UserError

log = logging.getLogger(__name__)

TASKS = ("caption", "vqa", "grounding", "t2i", "reason", "reason_t2i", "instruct")
IMAGE_FREE_TASKS = ("reason",)
#: image editing: rows of ``edit_<split>.jsonl`` (module docstring); a task of data.tasks besides TASKS
EDIT_TASK = "edit"
TRAINABLE_TASKS = TASKS + (EDIT_TASK,)


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
        if task == "instruct" and not (isinstance(row.get("text"), str) and row["text"].strip()):
            raise _row_error(path, n, "task instruct needs a non-empty string 'text' (the prompt)")
        if task in ("caption", "vqa", "reason", "instruct") and not (isinstance(row.get("target"), str) and row["target"]):
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


def read_edits(path: str | Path) -> list[dict[str, Any]]:
    """The rows of an ``edit_<split>.jsonl`` file, validated (a bad row is a :class:`MixtureFormatError`
    naming ``file:line`` and the key)."""
    path = Path(path)
    if not path.is_file():
        raise MixtureFormatError(f"no image-edit file {path} (data.tasks lists edit; build the world with "
                                 "`unicon build-data shapes`, --edits-per-scene >= 1)")
    rows = []
    for n, row in read_jsonl(path, MixtureFormatError, "image-edit file"):
        for key in ("id", "task"):
            if key not in row:
                raise _row_error(path, n, f"missing key {key!r}")
        if row["task"] != EDIT_TASK:
            raise _row_error(path, n, f"key 'task' is {row['task']!r}; an image-edit file holds task {EDIT_TASK!r} only")
        for key in ("image", "target_image"):
            if not (isinstance(row.get(key), str) and row[key]):
                raise _row_error(path, n, f"task edit needs {key!r} (a path relative to {path.parent})")
        if not (isinstance(row.get("text"), str) and row["text"]):
            raise _row_error(path, n, "task edit needs a non-empty string 'text' (the instruction)")
        rows.append(row)
    if not rows:
        raise MixtureFormatError(f"{path}: no image-edit rows (data.tasks lists edit)")
    return rows


@dataclass(frozen=True)
class ImageResize:
    """The geometric part of a backend's image preprocessing, done where the image is decoded (the
    loader workers): ``keep_aspect=False`` resizes to ``side x side``; ``keep_aspect=True`` makes the
    longer side ``side`` (the other ``max(round(s * side / longer), min_side)``). Bicubic, as the
    backends resize. A grounding box is scaled with its image, so that the box normalised by the
    image size -- what the models' ``score_boxes`` encode -- is unchanged."""

    side: int
    keep_aspect: bool
    min_side: int = 1

    def size(self, width: int, height: int) -> tuple[int, int]:
        if not self.keep_aspect:
            return self.side, self.side
        scale = self.side / max(width, height)
        return max(round(width * scale), self.min_side), max(round(height * scale), self.min_side)

    def __call__(self, image: Image.Image) -> Image.Image:
        size = self.size(*image.size)
        return image if image.size == size else image.resize(size, Image.BICUBIC)


def scale_box(box: Sequence[float], from_size: tuple[int, int], to_size: tuple[int, int]) -> list[float]:
    """``[x, y, w, h]`` in pixels of an image of ``from_size`` -> pixels of the same image at ``to_size``."""
    sx, sy = to_size[0] / from_size[0], to_size[1] / from_size[1]
    return [box[0] * sx, box[1] * sy, box[2] * sx, box[3] * sy]


class MixtureRowsDataset(Dataset):
    """Validated mixture rows with their images loaded lazily as RGB PIL (in the loader workers).

    ``image`` values are relative to ``images_root``; ``source`` names the rows' origin in messages.
    Decoded images are kept in a least-recently-used cache of ``image_cache_mb`` megabytes per
    process (0 decodes every time). ``image_resize`` (:class:`ImageResize`), when given, is applied
    before caching, and grounding targets are scaled with the image."""

    def __init__(self, rows: list[dict[str, Any]], images_root: str | Path, source: str,
                 image_cache_mb: float = 256.0, image_resize: ImageResize | None = None):
        if image_cache_mb < 0:
            raise ValueError(f"image_cache_mb must be >= 0, got {image_cache_mb}")
        self.rows = rows
        self.images_root = Path(images_root)
        self.source = source
        self.image_resize = image_resize
        self.cache_bytes = int(image_cache_mb * 2**20)
        # image key -> (image as the model receives it, size of the file's image)
        self._cache: OrderedDict[str, tuple[Image.Image, tuple[int, int]]] = OrderedDict()
        self._cached_bytes = 0

    def __len__(self) -> int:
        return len(self.rows)

    def _image(self, row: dict[str, Any], field: str = "image") -> tuple[Image.Image, tuple[int, int]]:
        """The row's image ``row[field]`` (as the model receives it) and the file's image size, cached."""
        key = row[field]
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return hit
        image_path = self.images_root / key
        try:
            with Image.open(image_path) as im:
                image = im.convert("RGB")
        except (FileNotFoundError, OSError) as e:
            raise ValueError(f"{self.source}: row id={row['id']}: cannot open image {image_path} ({e})") from None
        entry = (image if self.image_resize is None else self.image_resize(image), image.size)
        size = entry[0].width * entry[0].height * 3
        if size <= self.cache_bytes:
            self._cache[key] = entry
            self._cached_bytes += size
            while self._cached_bytes > self.cache_bytes:
                _, (old, _) = self._cache.popitem(last=False)
                self._cached_bytes -= old.width * old.height * 3
        return entry

    def __getitem__(self, idx: int) -> dict[str, Any]:
        row = self.rows[idx]
        image, target = None, row.get("target")
        if row["task"] not in IMAGE_FREE_TASKS:
            image, file_size = self._image(row)
            if row["task"] == "grounding" and image.size != file_size:
                target = scale_box(target, file_size, image.size)
            elif row["task"] == EDIT_TASK:
                target = self._image(row, "target_image")[0]
        return {
            "id": str(row["id"]),
            "task": row["task"],
            "text": row.get("text"),
            "target": target,
            "context": row.get("context"),
            "image": image,
        }


class MixtureDataset(MixtureRowsDataset):
    """Examples of a ShapesWorld's ``<root>/mixture_<split>.jsonl`` (images relative to the world root),
    followed by those of ``<root>/edit_<split>.jsonl`` when ``tasks`` lists ``edit``."""

    def __init__(self, root: str | Path, split: str = "train", tasks: Sequence[str] = TASKS,
                 image_cache_mb: float = 256.0):
        self.root = Path(root)
        self.path = self.root / f"mixture_{split}.jsonl"
        if EDIT_TASK not in tasks:
            super().__init__(read_mixture(self.path, tasks), self.root, str(self.path), image_cache_mb)
            return
        self.edit_path = self.root / f"edit_{split}.jsonl"
        others = [t for t in tasks if t != EDIT_TASK]
        rows = read_mixture(self.path, others) if others else []
        super().__init__(rows + read_edits(self.edit_path), self.root, f"{self.path} + {self.edit_path.name}",
                         image_cache_mb)


def collate_mixture(examples: list[dict[str, Any]]) -> dict[str, Any]:
    """List of examples -> column lists (images stay PIL, None for ``reason`` rows; an ``edit`` row's
    target is its target image, PIL; the module groups tasks)."""
    return {
        "ids": [e["id"] for e in examples],
        "tasks": [e["task"] for e in examples],
        "texts": [e["text"] for e in examples],
        "targets": [e["target"] for e in examples],
        "contexts": [e.get("context") for e in examples],
        "images": [e["image"] for e in examples],
    }
