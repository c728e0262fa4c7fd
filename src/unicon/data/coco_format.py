"""Streaming readers for COCO and VQAv2 files in their released formats, and atomic JSON writers.

Used by ``unicon build-data cococon`` (``data_builders/cococon.py``), which must read the full COCO
and VQAv2 training annotations without holding them in memory, and by the ShapesWorld COCO-format
export (:mod:`unicon.data.shapes_coco`), whose output these readers accept. The formats::

    captions_<split>.json    {"images": [{"id", "file_name", "width"?, "height"?}], "annotations":
                              [{"id", "image_id", "caption"}]}
    instances_<split>.json   {"images": [...], "categories": [{"id", "name", "supercategory"?}],
                              "annotations": [{"id", "image_id", "category_id", "bbox": [x, y, w, h],
                                               "iscrowd"?, "area"?}]}
    VQAv2 questions          {"questions": [{"image_id", "question", "question_id"}]}
    VQAv2 annotations        {"annotations": [{"question_id", "image_id", "answer_type", "question_type",
                                               "multiple_choice_answer", "answers": [{"answer", ...}]}]}

Each top-level list is streamed record by record with ``ijson`` (its C backend when available).
A malformed or truncated file, a missing top-level list, or a record without a required key (or
with a value of the wrong type) raises :class:`CocoFormatError` naming the file and the record
(``questions[17] (question_id 4200)``), so that a user can find it.
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import ijson

from unicon.errors import UserError


class CocoFormatError(UserError, ValueError):
    """A COCO / VQAv2 input file is unusable; the message names the file and the record."""


# required keys and their types, per record kind
_INT = (int,)
_STR = (str,)
SCHEMAS: dict[str, dict[str, tuple[type, ...]]] = {
    "images": {"id": _INT, "file_name": _STR},
    "captions": {"id": _INT, "image_id": _INT, "caption": _STR},
    "instances": {"id": _INT, "image_id": _INT, "category_id": _INT, "bbox": (list,)},
    "categories": {"id": _INT, "name": _STR},
    "questions": {"question_id": _INT, "image_id": _INT, "question": _STR},
    "vqa_annotations": {"question_id": _INT, "image_id": _INT, "question_type": _STR, "answer_type": _STR,
                        "multiple_choice_answer": _STR, "answers": (list,)},
}
_ID_KEY = {"images": "id", "captions": "id", "instances": "id", "categories": "id", "questions": "question_id",
           "vqa_annotations": "question_id"}


def _check(path: Path, key: str, i: int, rec: Any, kind: str) -> dict:
    where = f"{path}: {key}[{i}]"
    if not isinstance(rec, dict):
        raise CocoFormatError(f"{where}: expected an object, got {type(rec).__name__}")
    idk = _ID_KEY[kind]
    if idk in rec:
        where += f" ({idk} {rec[idk]!r})"
    for name, types in SCHEMAS[kind].items():
        if name not in rec:
            raise CocoFormatError(f"{where}: missing key '{name}'")
        v = rec[name]
        if not isinstance(v, types) or isinstance(v, bool):
            raise CocoFormatError(f"{where}: '{name}' must be {'/'.join(t.__name__ for t in types)}, got {v!r}")
    if kind == "instances":
        box = rec["bbox"]
        if len(box) != 4 or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in box):
            raise CocoFormatError(f"{where}: 'bbox' must be [x, y, w, h] numbers, got {box!r}")
    if kind == "vqa_annotations":
        for j, a in enumerate(rec["answers"]):
            if not (isinstance(a, dict) and isinstance(a.get("answer"), str)):
                raise CocoFormatError(f"{where}: answers[{j}] must be an object with a string 'answer', got {a!r}")
    return rec


def _top_level_keys(path: Path) -> list[str]:
    """The keys of the top-level object (a cheap event scan that stops at the first nested value)."""
    keys = []
    with path.open("rb") as f:
        try:
            for prefix, event, value in ijson.parse(f):
                if prefix == "" and event == "map_key":
                    keys.append(value)
                elif prefix == "" and event in ("start_array", "string", "number"):
                    break
        except ijson.JSONError:
            pass
    return keys


def _ijson_reason(e: Exception) -> str:
    """The first line of an ijson error (ijson appends a multi-line pointer into the text)."""
    return str(e).splitlines()[0] if str(e) else type(e).__name__


def stream_records(path: str | Path, key: str, kind: str, what: str) -> Iterator[dict]:
    """Yield the validated records of the top-level list ``key`` of the JSON object in ``path``.

    ``kind`` selects the schema (:data:`SCHEMAS`); ``what`` names the file in messages ("VQAv2
    questions file"). Floats are returned as ``float`` (not ``Decimal``).
    """
    path = Path(path)
    if not path.is_file():
        raise CocoFormatError(f"{what} not found: {path}")
    n = 0
    try:
        with path.open("rb") as f:
            for n, rec in enumerate(ijson.items(f, f"{key}.item", use_float=True), 1):
                yield _check(path, key, n - 1, rec, kind)
    except ijson.JSONError as e:  # IncompleteJSONError is a subclass
        after = f"after record {key}[{n - 1}]" if n else f"before the first record of '{key}'"
        raise CocoFormatError(f"{path}: malformed or truncated {what} {after}: {_ijson_reason(e)}") from None
    except UnicodeDecodeError as e:
        raise CocoFormatError(f"{path}: {what} is not UTF-8 text (byte {e.start})") from None
    if n == 0 and key not in _top_level_keys(path):
        raise CocoFormatError(f"{path}: not a {what}: no top-level list '{key}' "
                              f"(top-level keys: {_top_level_keys(path) or 'none'})")


# ---- the four inputs --------------------------------------------------------------------------
def read_images(path: str | Path, what: str = "COCO file") -> Iterator[dict]:
    return stream_records(path, "images", "images", what)


def read_captions(path: str | Path) -> Iterator[dict]:
    return stream_records(path, "annotations", "captions", "COCO captions file")


def read_instances(path: str | Path) -> Iterator[dict]:
    return stream_records(path, "annotations", "instances", "COCO instances file")


def read_categories(path: str | Path) -> Iterator[dict]:
    return stream_records(path, "categories", "categories", "COCO instances file")


def read_questions(path: str | Path) -> Iterator[dict]:
    return stream_records(path, "questions", "questions", "VQAv2 questions file")


def read_vqa_annotations(path: str | Path) -> Iterator[dict]:
    return stream_records(path, "annotations", "vqa_annotations", "VQAv2 annotations file")


def stream_candidate_file(path: str | Path) -> Iterator[tuple[int, list[str]]]:
    """``{"<question_id>": ["answer", ...]}`` streamed as ``(question_id, answers)``."""
    path = Path(path)
    if not path.is_file():
        raise CocoFormatError(f"candidate file not found: {path}")
    n = 0
    try:
        with path.open("rb") as f:
            for n, (k, v) in enumerate(ijson.kvitems(f, "", use_float=True), 1):
                try:
                    qid = int(k)
                except ValueError:
                    raise CocoFormatError(f"{path}: key {k!r} is not a question id") from None
                if not (isinstance(v, list) and all(isinstance(a, str) for a in v)):
                    raise CocoFormatError(f"{path}: question {k}: expected a list of answer strings, got {v!r}")
                yield qid, v
    except ijson.JSONError as e:
        raise CocoFormatError(f"{path}: malformed or truncated candidate file after {n} entries: "
                              f"{_ijson_reason(e)}") from None


# ---- writers -----------------------------------------------------------------------------------
@contextmanager
def atomic_open(path: str | Path, mode: str = "w"):
    """Write to ``<path>.tmp`` and ``os.replace`` it onto ``path`` on success: readers (and a
    resumed build) never see a half-written file. On an exception the temporary file is removed."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    f = open(tmp, mode, encoding=None if "b" in mode else "utf-8")
    try:
        yield f
        f.flush()
        os.fsync(f.fileno())
        f.close()
        os.replace(tmp, path)
    except BaseException:
        f.close()
        tmp.unlink(missing_ok=True)
        raise


def write_json(path: str | Path, obj: Any, indent: int | None = None) -> None:
    with atomic_open(path) as f:
        json.dump(obj, f, indent=indent)
        f.write("\n")


@dataclass(frozen=True)
class Fingerprint:
    """What identifies an input file for resuming: its resolved path, size and modification time."""

    path: str
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, path: str | Path) -> "Fingerprint":
        p = Path(path).resolve()
        st = p.stat()
        return cls(str(p), st.st_size, st.st_mtime_ns)

    def to_dict(self) -> dict:
        return {"path": self.path, "size": self.size, "mtime_ns": self.mtime_ns}
