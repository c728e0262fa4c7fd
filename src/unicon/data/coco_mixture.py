"""The real training mixture (``data.source=coco``): rows of the ShapesWorld mixture's format
(:mod:`unicon.data.mixture`) read from COCO captions, VQAv2 and RefCOCO/+/g files.

Tasks and their files (config keys of ``configs/data/coco.yaml``; every path is resolved against
``data.coco_images``, the folder COCO's ``file_name`` values are relative to)::

    caption    data.captions_file            one row per caption: target = the caption
    t2i        data.captions_file            the same captions reversed: text = the caption, the
                                             target is the image's own codes (the backend tokenizes
                                             the PIL image in ``score_image``: OFA's VQGAN, Janus' VQ)
    vqa        data.vqa_questions_file +     one row per question: text = the question, target =
               data.vqa_annotations_file     ``multiple_choice_answer``
    grounding  data.refcoco_files +          one row per sentence of every ref whose ``split`` is
               data.refcoco_instances_file   ``data.refcoco_split``: text = the sentence, target = the
                                             box [x, y, w, h] of the ref's ``ann_id``

A task of ``data.tasks`` whose file key is empty (``null`` / ``[]``) is an error naming the key. The
COCO and VQAv2 files are streamed by :mod:`unicon.data.coco_format` (a malformed record is a
:class:`~unicon.data.coco_format.CocoFormatError` naming the file and the record). RefCOCO's
released ``refs(unc).p`` is a pickle, which can run code while it loads: it is read only with
``data.allow_pickle=true`` (and then by an unpickler that refuses every class, since refs are plain
lists and dicts). The default is a JSON conversion -- a list of refs, ``{"refs": [...]}`` (the
ShapesWorld export) or JSON lines -- made once with::

    python -c "import json, pickle; json.dump(pickle.load(open('refs(unc).p', 'rb')), open('refs_unc.json', 'w'))"

Images: rows whose image file is missing under ``data.coco_images`` are counted, reported once
(a warning with the count and examples) and skipped before training; a file that exists but does
not decode is an error at load time naming it. Images are opened lazily in the loader workers
(:class:`unicon.data.mixture.MixtureRowsDataset`), where :func:`image_resize_for` also does the
geometric part of the backend's own preprocessing (boxes scaled with the image), so that what
crosses from the workers is an image at the model's resolution.

What this module may touch: it reads files only; it never writes.
"""

from __future__ import annotations

import json
import logging
import pickle
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from unicon.data.coco_format import (
    read_captions,
    read_images,
    read_instances,
    read_questions,
    read_vqa_annotations,
)
from unicon.data.jsonl import read_jsonl
from unicon.data.mixture import ImageResize
from unicon.errors import UserError

log = logging.getLogger(__name__)

COCO_TASKS = ("caption", "vqa", "grounding", "t2i")
PICKLE_SUFFIXES = (".p", ".pkl", ".pickle")


class RefsFormatError(UserError, ValueError):
    """A referring-expression (RefCOCO) file is missing or malformed; the message names the file and the ref."""


def require_file(key: str, value: Any) -> Path:
    """``Path(value)`` of the config key ``data.<key>``, which must name an existing file."""
    if not value:
        raise UserError(f"data.{key} is not set (data.source=coco)")
    path = Path(value)
    if not path.is_file():
        raise UserError(f"data.{key}: file not found: {path}")
    return path


# ---- RefCOCO/+/g ----------------------------------------------------------------------------
class _PlainUnpickler(pickle.Unpickler):
    """Unpickles plain containers and scalars only: any class or function reference is refused."""

    def find_class(self, module: str, name: str):
        raise pickle.UnpicklingError(f"the file references {module}.{name}; a refs file holds plain lists and dicts")


def _refs_records(path: Path, allow_pickle: bool) -> list[tuple[str, Any]]:
    """``(where, record)`` of every ref in ``path`` (JSON list / {"refs": [...]} / JSONL / opted-in pickle)."""
    if path.suffix in PICKLE_SUFFIXES:
        if not allow_pickle:
            raise RefsFormatError(
                f"{path} is a pickle, which can run code while it loads; convert it to JSON once (see "
                "unicon.data.coco_mixture) and point data.refcoco_files at the .json, or set data.allow_pickle=true")
        try:
            with path.open("rb") as f:
                refs = _PlainUnpickler(f).load()
        except (pickle.UnpicklingError, EOFError, ValueError) as e:
            raise RefsFormatError(f"{path}: unreadable refs pickle ({e})") from None
        where = "refs"
    elif path.suffix == ".jsonl":
        return [(f"{path}:{n}", row) for n, row in read_jsonl(path, RefsFormatError, "refs file")]
    else:
        try:
            refs = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise RefsFormatError(f"{path}: malformed refs JSON ({str(e).splitlines()[0]}; truncated?)") from None
        where = "refs"
        if isinstance(refs, dict):
            if not isinstance(refs.get("refs"), list):
                raise RefsFormatError(f"{path}: expected a list of refs or an object with a list 'refs' "
                                      f"(top-level keys: {sorted(refs)})")
            refs = refs["refs"]
    if not isinstance(refs, list):
        raise RefsFormatError(f"{path}: expected a list of refs, got {type(refs).__name__}")
    return [(f"{path}: {where}[{i}]", r) for i, r in enumerate(refs)]


def read_refs(path: str | Path, split: str, allow_pickle: bool = False) -> list[dict[str, Any]]:
    """The refs of ``split`` in a RefCOCO-format file as ``{"ref_id", "ann_id", "image_id", "sentences"}``,
    ``sentences`` being the ``sent`` strings. Every ref is validated, whatever its split."""
    path = Path(path)
    if not path.is_file():
        raise RefsFormatError(f"refs file not found: {path}")
    out = []
    for where, ref in _refs_records(path, allow_pickle):
        if not isinstance(ref, dict):
            raise RefsFormatError(f"{where}: expected an object, got {type(ref).__name__}")
        if "ref_id" in ref:
            where += f" (ref_id {ref['ref_id']!r})"
        for key, types in (("ann_id", int), ("image_id", int), ("split", str), ("sentences", list)):
            if key not in ref:
                raise RefsFormatError(f"{where}: missing key '{key}'")
            if not isinstance(ref[key], types) or isinstance(ref[key], bool):
                raise RefsFormatError(f"{where}: '{key}' must be {types.__name__}, got {ref[key]!r}")
        sentences = []
        for j, s in enumerate(ref["sentences"]):
            if not (isinstance(s, dict) and isinstance(s.get("sent"), str)):
                raise RefsFormatError(f"{where}: sentences[{j}] must be an object with a string 'sent', got {s!r}")
            if s["sent"].strip():
                sentences.append(s["sent"].strip())
        if ref["split"] == split and sentences:
            out.append({"ref_id": ref.get("ref_id"), "ann_id": ref["ann_id"], "image_id": ref["image_id"],
                        "sentences": sentences})
    return out


# ---- the mixture ----------------------------------------------------------------------------
@dataclass
class CocoMixtureReport:
    """What reading the mixture found: rows per task, and the images missing on disk (skipped)."""

    rows: Counter = field(default_factory=Counter)
    missing_images: int = 0  # distinct image files
    skipped_rows: Counter = field(default_factory=Counter)  # per task, rows of missing images
    missing_examples: list[str] = field(default_factory=list)

    def summary(self) -> str:
        kept = ", ".join(f"{t} {n}" for t, n in sorted(self.rows.items()))
        missing = (f"; {self.missing_images} images missing on disk (e.g. {', '.join(self.missing_examples)}): "
                   f"skipped their rows ({dict(self.skipped_rows)})") if self.missing_images else ""
        return f"COCO mixture: {kept}{missing}"


Rows = list[dict[str, Any]]


def read_coco_mixture(data_cfg: Any, tasks: Sequence[str] | None = None) -> tuple[Rows, CocoMixtureReport]:
    """Rows ``{"id", "image", "task", "text", "target"}`` of the tasks in ``tasks`` (default
    ``data.tasks``) from the files named by ``data_cfg``; ``image`` is relative to ``data.coco_images``.
    Rows of missing images are dropped and counted in the report (also logged once)."""
    tasks = list(tasks if tasks is not None else data_cfg.tasks)
    unsupported = [t for t in tasks if t not in COCO_TASKS]
    if unsupported:
        raise UserError(f"data.tasks: {unsupported} have no COCO source (data.source=coco trains "
                        f"{', '.join(COCO_TASKS)}; the others are ShapesWorld's)")
    images_root = Path(data_cfg.coco_images or "")
    if not data_cfg.coco_images or not images_root.is_dir():
        raise UserError(f"data.coco_images: image folder not found: {data_cfg.coco_images}")
    captions_path = require_file("captions_file", data_cfg.captions_file)
    file_names = {im["id"]: im["file_name"] for im in read_images(captions_path, "COCO captions file")}

    def image_of(image_id: int, where: str) -> str:
        if image_id not in file_names:
            raise UserError(f"{where}: image_id {image_id} is not in the images of data.captions_file {captions_path}")
        return file_names[image_id]

    rows: list[dict[str, Any]] = []
    if "caption" in tasks or "t2i" in tasks:
        for ann in read_captions(captions_path):
            image = image_of(ann["image_id"], f"{captions_path}: caption id {ann['id']}")
            caption = ann["caption"].strip()
            if not caption:
                continue
            if "caption" in tasks:
                rows.append({"id": f"cap-{ann['id']}", "image": image, "task": "caption", "text": None,
                             "target": caption})
            if "t2i" in tasks:
                rows.append({"id": f"t2i-{ann['id']}", "image": image, "task": "t2i", "text": caption, "target": None})
    if "vqa" in tasks:
        questions_path = require_file("vqa_questions_file", data_cfg.vqa_questions_file)
        answers_path = require_file("vqa_annotations_file", data_cfg.vqa_annotations_file)
        questions = {q["question_id"]: q for q in read_questions(questions_path)}
        for ann in read_vqa_annotations(answers_path):
            q = questions.pop(ann["question_id"], None)
            if q is None:
                raise UserError(f"{answers_path}: question_id {ann['question_id']} is not in data.vqa_questions_file "
                                f"{questions_path} (files of different splits?)")
            if q["image_id"] != ann["image_id"]:
                raise UserError(f"{answers_path}: question_id {ann['question_id']}: image_id {ann['image_id']}, but "
                                f"{questions_path} says {q['image_id']}")
            image = image_of(ann["image_id"], f"{answers_path}: question_id {ann['question_id']}")
            rows.append({"id": f"vqa-{ann['question_id']}", "image": image, "task": "vqa", "text": q["question"],
                         "target": ann["multiple_choice_answer"]})
        if questions:
            log.warning("%s: %d questions have no annotation in %s; not trained on", questions_path, len(questions),
                        answers_path)
    if "grounding" in tasks:
        rows += _grounding_rows(data_cfg, image_of)
    return _drop_missing_images(rows, images_root)


def _grounding_rows(data_cfg: Any, image_of) -> Rows:
    files = list(data_cfg.refcoco_files or [])
    if not files:
        raise UserError("data.refcoco_files is empty, but data.tasks lists grounding")
    refs = []
    for i, value in enumerate(files):
        path = require_file(f"refcoco_files[{i}]", value)
        refs += [(path, ref) for ref in read_refs(path, data_cfg.refcoco_split, bool(data_cfg.allow_pickle))]
    instances_path = require_file("refcoco_instances_file", data_cfg.refcoco_instances_file)
    wanted = {ref["ann_id"] for _, ref in refs}
    boxes = {a["id"]: (a["image_id"], a["bbox"]) for a in read_instances(instances_path) if a["id"] in wanted}
    rows = []
    for path, ref in refs:
        where = f"{path}: ref_id {ref['ref_id']!r}"
        if ref["ann_id"] not in boxes:
            raise UserError(f"{where}: ann_id {ref['ann_id']} is not in data.refcoco_instances_file {instances_path}")
        image_id, box = boxes[ref["ann_id"]]
        if image_id != ref["image_id"]:
            raise UserError(f"{where}: image_id {ref['image_id']}, but {instances_path} puts ann_id {ref['ann_id']} "
                            f"in image {image_id}")
        image = image_of(image_id, where)
        for j, sentence in enumerate(ref["sentences"]):
            rows.append({"id": f"ref-{path.stem}-{ref['ref_id']}-{j}", "image": image, "task": "grounding",
                         "text": sentence, "target": [float(v) for v in box]})
    return rows


def _drop_missing_images(rows: Rows, images_root: Path) -> tuple[Rows, CocoMixtureReport]:
    report = CocoMixtureReport()
    present = {name: (images_root / name).is_file() for name in {r["image"] for r in rows}}
    missing = sorted(name for name, ok in present.items() if not ok)
    report.missing_images = len(missing)
    report.missing_examples = missing[:3]
    kept = []
    for r in rows:
        if present[r["image"]]:
            kept.append(r)
            report.rows[r["task"]] += 1
        else:
            report.skipped_rows[r["task"]] += 1
    if missing:
        log.warning("%d of %d images are missing under data.coco_images=%s (e.g. %s); skipped their rows %s",
                    len(missing), len(present), images_root, ", ".join(missing[:3]), dict(report.skipped_rows))
    if not kept:
        raise UserError(f"data.source=coco: no training row has its image under data.coco_images={images_root}")
    return kept, report


# ---- per-backend preprocessing in the workers -------------------------------------------------
def image_resize_for(model: Any) -> ImageResize | None:
    """The resize the backend's own image processor applies, done in the loader workers instead:
    OFA resizes to a ``image_size`` square (bicubic; its ``prepare_images`` then finds the size
    right and only normalises); Janus resizes the longer side to the vision tower's side (its
    processor then pads to a square and normalises). None for another backend (full-size images)."""
    backend = getattr(model, "backend", None)
    if backend == "ofa":
        return ImageResize(int(model.settings.image_size), keep_aspect=False)
    if backend == "janus":
        processor = model.processor.image_processor
        return ImageResize(int(model.janus.config.vision_config.image_size), keep_aspect=True,
                           min_side=int(getattr(processor, "min_size", 1) or 1))
    return None
