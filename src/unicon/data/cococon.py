"""Loader for CocoCon-schema contrast-set files.

One schema, three producers: the official CocoCon benchmark (``cococon.json``, COCO val2014
images), ShapesWorld's ``cococon_<split>.json`` (written by ``unicon build-data shapes``, adds
``category`` and ``scene``) and COCO-built training files. The file is a JSON object::

    {"annotations": [{"id", "question_id", "image_id", "caption", "query", "answer",
                      "contrast_sets": [{"mutex_caption", "mutex_answer", "mutex_detection"?}, ...],
                      "detection"?, "boxes"? [[x, y, w, h], ...], "category"?, "scene"?}, ...],
     "images": [{"id", "file_name", "width"?, "height"?}, ...]}

``file_name`` is resolved against ``images_root`` (default: the JSON file's folder, which is the
ShapesWorld convention of names relative to the world root). Problems are handled as:

* malformed JSON or a missing required key -> :class:`CocoConFormatError` naming the file and the
  line/column (or the annotation index and key);
* a missing image -> :class:`CocoConFormatError` naming the file, or with ``skip_missing=True``
  the sample is dropped and counted in :attr:`LoadReport.missing_images`;
* a sample without contrast sets, or with ``boxes`` but no ``detection`` (or the reverse), is kept
  and listed in the :class:`LoadReport` (it cannot contribute to ``C_k`` resp. localization).

``CocoConData`` is a plain sequence of :class:`CocoConSample`. This module reads the JSON file
and, on request (:meth:`CocoConSample.load_image`), one image; it calls no model.
"""

from __future__ import annotations

import json
import math
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from PIL import Image

from unicon.errors import UserError

log = logging.getLogger(__name__)

REQUIRED_KEYS = ("id", "image_id", "caption", "query", "answer", "contrast_sets")


class CocoConFormatError(UserError, ValueError):
    """The CocoCon file (or an image it names) is unusable; the message says where."""


@dataclass
class ContrastSet:
    """One perturbation of the sample's semantic concept, shared by all tasks."""

    caption: str  # ``mutex_caption``: the contrast caption (captioning output, T2I input)
    answer: str  # ``mutex_answer``: the contrast VQA answer
    detection: str | None = None  # ``mutex_detection``: the contrast referring expression, if any


@dataclass
class CocoConSample:
    """A pivot instance (gold caption, VQA pair, optional localization) with its contrast sets."""

    index: int  # position in the file's ``annotations`` list (stable join key across ranks)
    id: Any
    question_id: Any
    image_id: Any
    file_name: str
    image_path: Path
    caption: str
    query: str
    answer: str
    contrast_sets: list[ContrastSet]
    detection: str | None = None
    boxes: list[list[float]] | None = None  # gold boxes [x, y, w, h] in pixels
    answers: list[str] | None = None  # all VQA annotator answers (10 in VQAv2), when present
    references: list[str] = field(default_factory=list)  # captioning references for CIDEr
    category: str | None = None
    scene: dict | None = None  # ShapesWorld scene dict
    image_size: tuple[int, int] | None = None  # (width, height) from the ``images`` table

    @property
    def has_localization(self) -> bool:
        return self.detection is not None and bool(self.boxes)

    def load_image(self) -> Image.Image:
        try:
            with Image.open(self.image_path) as im:
                return im.convert("RGB")
        except OSError as e:
            raise CocoConFormatError(f"cannot read image {self.image_path} (sample id {self.id}): {e}") from None


@dataclass
class LoadReport:
    """What the loader noticed; nothing in here is fatal."""

    path: str
    num_annotations: int = 0
    num_samples: int = 0  # after skipping missing images
    num_contrast_sets: int = 0
    num_localization: int = 0
    no_contrast_sets: list = field(default_factory=list)  # sample ids
    boxes_without_detection: list = field(default_factory=list)
    detection_without_boxes: list = field(default_factory=list)
    missing_images: list[str] = field(default_factory=list)  # skipped files (skip_missing=True)

    def summary(self) -> str:
        return (
            f"{self.path}: {self.num_samples}/{self.num_annotations} samples, {self.num_contrast_sets} contrast sets, "
            f"{self.num_localization} with localization; {len(self.no_contrast_sets)} without contrast sets, "
            f"{len(self.boxes_without_detection)} with boxes but no detection, "
            f"{len(self.detection_without_boxes)} with detection but no boxes, "
            f"{len(self.missing_images)} skipped for missing images"
        )

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


@dataclass
class CocoConData:
    """The loaded file: ``samples`` in file order plus the :class:`LoadReport`."""

    path: Path
    images_root: Path
    samples: list[CocoConSample]
    report: LoadReport

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> CocoConSample:
        return self.samples[i]

    def __iter__(self) -> Iterator[CocoConSample]:
        return iter(self.samples)

    def subset(self, max_samples: int | None) -> "CocoConData":
        """The first ``max_samples`` samples (all when ``None``); the report is shared."""
        if max_samples is None or max_samples >= len(self.samples):
            return self
        if max_samples < 1:
            raise ValueError(f"max_samples must be >= 1, got {max_samples}")
        return CocoConData(self.path, self.images_root, self.samples[:max_samples], self.report)


def _read_json(path: Path) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise CocoConFormatError(f"CocoCon file not found: {path}") from None
    except UnicodeDecodeError as e:
        raise CocoConFormatError(f"{path}: not UTF-8 text (byte {e.start})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise CocoConFormatError(f"{path}: malformed JSON at line {e.lineno}, column {e.colno}: {e.msg}") from None


def _expect(cond: bool, path: Path, where: str, msg: str) -> None:
    if not cond:
        raise CocoConFormatError(f"{path}: {where}: {msg}")


MAX_BOX_PIXELS = 100_000  # no image is this large: a coordinate beyond it is a units or format error


def _parse_box(box: Any, path: Path, where: str) -> list[float]:
    ok = isinstance(box, (list, tuple)) and len(box) == 4 and all(
        isinstance(v, (int, float)) and not isinstance(v, bool) for v in box)
    _expect(ok, path, where, f"a box must be [x, y, w, h] numbers, got {box!r}")
    x, y, w, h = (float(v) for v in box)
    _expect(all(math.isfinite(v) for v in (x, y, w, h)), path, where, f"box {box!r} has a non-finite coordinate")
    _expect(w > 0 and h > 0, path, where, f"box {box!r} must have width and height > 0 ([x, y, w, h] in pixels)")
    _expect(x >= 0 and y >= 0 and x + w <= MAX_BOX_PIXELS and y + h <= MAX_BOX_PIXELS, path, where,
            f"box {box!r} lies outside any image ([x, y, w, h] in pixels, 0 <= x, y and x + w, y + h <= "
            f"{MAX_BOX_PIXELS})")
    return [x, y, w, h]


def _parse_annotation(
    i: int, ann: Any, path: Path, images: dict, images_root: Path
) -> CocoConSample:
    where = f"annotations[{i}]"
    _expect(isinstance(ann, dict), path, where, f"expected an object, got {type(ann).__name__}")
    for key in REQUIRED_KEYS:
        _expect(key in ann, path, where, f"missing key '{key}' (sample id {ann.get('id')})")
    where = f"annotations[{i}] (id {ann['id']})"
    for key in ("caption", "query", "answer"):
        _expect(isinstance(ann[key], str), path, where, f"'{key}' must be a string, got {ann[key]!r}")
    _expect(isinstance(ann["contrast_sets"], list), path, where, "'contrast_sets' must be a list")

    contrasts = []
    for j, cs in enumerate(ann["contrast_sets"]):
        cwhere = f"{where}.contrast_sets[{j}]"
        _expect(isinstance(cs, dict), path, cwhere, "expected an object")
        for key in ("mutex_caption", "mutex_answer"):
            _expect(isinstance(cs.get(key), str), path, cwhere, f"missing or non-string '{key}'")
        det = cs.get("mutex_detection")
        _expect(det is None or isinstance(det, str), path, cwhere, "'mutex_detection' must be a string")
        contrasts.append(ContrastSet(cs["mutex_caption"], cs["mutex_answer"], det))

    boxes = ann.get("boxes")
    if boxes is not None:
        _expect(isinstance(boxes, list), path, where, "'boxes' must be a list of [x, y, w, h]")
        if boxes and not isinstance(boxes[0], (list, tuple)):  # a single box written flat
            boxes = [boxes]
        boxes = [_parse_box(b, path, f"{where}.boxes[{k}]") for k, b in enumerate(boxes)]

    # image: the annotation's own ``file_name`` (COCO-built files may inline it) or the ``images`` table
    image_entry = images.get(ann["image_id"], {})
    file_name = ann.get("file_name") or image_entry.get("file_name")
    _expect(
        isinstance(file_name, str),
        path,
        where,
        f"image_id {ann['image_id']!r} has no entry with a 'file_name' in 'images'",
    )
    size = None
    if "width" in image_entry and "height" in image_entry:
        size = (int(image_entry["width"]), int(image_entry["height"]))

    answers = ann.get("answers")
    if answers is not None:  # VQAv2 style: strings or {"answer": ...} objects
        answers = [a["answer"] if isinstance(a, dict) else a for a in answers]
        _expect(all(isinstance(a, str) for a in answers), path, where, "'answers' must hold strings")
    refs = ann.get("references") or ann.get("captions") or [ann["caption"]]
    _expect(all(isinstance(r, str) for r in refs), path, where, "'references' must hold strings")

    return CocoConSample(
        index=i,
        id=ann["id"],
        question_id=ann.get("question_id"),
        image_id=ann["image_id"],
        file_name=file_name,
        image_path=images_root / file_name,
        caption=ann["caption"],
        query=ann["query"],
        answer=ann["answer"],
        contrast_sets=contrasts,
        detection=ann.get("detection"),
        boxes=boxes,
        answers=answers,
        references=list(refs),
        category=ann.get("category"),
        scene=ann.get("scene"),
        image_size=size,
    )


def load_cococon(
    path: str | Path, images_root: str | Path | None = None, skip_missing: bool = False
) -> CocoConData:
    """Load a CocoCon-schema file; see the module docstring for the error policy."""
    path = Path(path)
    root = Path(images_root) if images_root is not None else path.parent
    if images_root is not None and not root.is_dir():
        raise CocoConFormatError(f"images root {root} is not a directory")
    data = _read_json(path)
    _expect(isinstance(data, dict), path, "top level", "expected an object with 'annotations' and 'images'")
    _expect(isinstance(data.get("annotations"), list), path, "top level", "missing list 'annotations'")
    images_list = data.get("images", [])
    _expect(isinstance(images_list, list), path, "top level", "'images' must be a list")
    images = {}
    for k, im in enumerate(images_list):
        _expect(isinstance(im, dict) and "id" in im, path, f"images[{k}]", "expected an object with an 'id'")
        images[im["id"]] = im

    report = LoadReport(path=str(path), num_annotations=len(data["annotations"]))
    samples = []
    for i, ann in enumerate(data["annotations"]):
        s = _parse_annotation(i, ann, path, images, root)
        if not s.image_path.is_file():
            if not skip_missing:
                raise CocoConFormatError(
                    f"{path}: annotations[{i}] (id {s.id}): image file not found: {s.image_path} "
                    f"(images root {root}: set it with images_root / --images, or skip such samples "
                    f"with skip_missing / --skip-missing)"
                )
            report.missing_images.append(str(s.image_path))
            continue
        if not s.contrast_sets:
            report.no_contrast_sets.append(s.id)
        if s.boxes and s.detection is None:
            report.boxes_without_detection.append(s.id)
        if s.detection is not None and not s.boxes:
            report.detection_without_boxes.append(s.id)
        report.num_contrast_sets += len(s.contrast_sets)
        report.num_localization += s.has_localization
        samples.append(s)
    report.num_samples = len(samples)
    if report.no_contrast_sets or report.boxes_without_detection or report.detection_without_boxes:
        log.warning(report.summary())
    if report.missing_images:
        log.warning("%s: skipped %d samples whose image is missing (first: %s)",
                    path, len(report.missing_images), report.missing_images[0])
    return CocoConData(path=path, images_root=root, samples=samples, report=report)
