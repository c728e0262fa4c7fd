"""Image-caption pairs with a human rating, from the file ``--data`` names.

``--data`` may be

* a **Flickr8K JSON file** in the CLIPScore repository's layout (``flickr8k.json`` for Flickr8K-Expert,
  ``crowdflower_flickr8k.json`` for Flickr8K-CF)::

      {"<key>": {"image_path": "...", "ground_truth": ["ref 1", ...],
                 "human_judgement": [{"caption": "...", "rating": 2.33, "image_path": "..."}, ...]}, ...}

  one pair per ``human_judgement`` entry (its ``image_path``, else the key's); the references are the
  key's ``ground_truth`` without an exact copy of the candidate itself (Flickr8K-Expert draws candidates
  from reference sets; a reference metric that sees the candidate among its references is trivially
  perfect). Which τ the papers quote: τ_c for Expert, τ_b for CrowdFlower; both are always reported.
* a **JSONL file** (``.jsonl``), one pair per line, for Composite-style sets and ShapesWorld's set:
  ``{"image": "...", "caption": "...", "rating": 3.0, "references": ["..."]?, "id": ...?}``;
* a **ShapesWorld root** (it has ``world.json``): its ``alignment/pairs.jsonl``
  (:mod:`unicon.worlds.shapes_alignment`), image paths relative to the root.

Image paths resolve against ``--images`` when given (a path relative to it, else its base name inside
it), otherwise against the data file's folder (the world root for a ShapesWorld). A missing image file
is a :class:`~unicon.errors.UserError` naming the file and the row (``<data file>:<line>`` or
``<data file>:<key>[<i>]``), raised while loading, before any model call; an image that exists but does
not decode fails the same way when it is read (:func:`read_image`).

A rating that is missing, not a number, NaN/infinite or outside ``[rating_min, rating_max]`` (when
given) makes its pair **skipped and counted** by reason (``rating_missing``, ``rating_not_a_number``,
``rating_nan``, ``rating_out_of_range``); ratings are never averaged or repaired. A row without a caption
or an image path, or a malformed file, is a :class:`UserError` naming the row.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from PIL import Image, UnidentifiedImageError

from unicon.data.jsonl import read_jsonl
from unicon.errors import UserError

SKIP_REASONS = ("rating_missing", "rating_not_a_number", "rating_nan", "rating_out_of_range")


@dataclass
class Pair:
    """One image-caption pair with its human rating; ``source`` names its row for error messages."""

    id: str
    image_path: Path
    image: str  # the path as the data file wrote it
    caption: str
    rating: float
    references: list[str] = field(default_factory=list)
    source: str = ""


def world_alignment_file(root: Path) -> Path:
    return Path(root) / "alignment" / "pairs.jsonl"


def data_file(data: str | Path) -> Path:
    """The pairs file of ``--data`` (a ShapesWorld root gives its ``alignment/pairs.jsonl``)."""
    path = Path(data)
    if path.is_dir():
        if (path / "world.json").is_file():
            f = world_alignment_file(path)
            if not f.is_file():
                raise UserError(f"--data {path}: the world has no alignment set ({f}); rebuild it with "
                                f"`unicon build-data shapes` (--alignment-pairs) or write one with "
                                f"unicon.worlds.shapes_alignment.write_alignment_set")
            return f
        raise UserError(f"--data {path} is a folder without world.json: give a Flickr8K .json, a .jsonl "
                        "file or a ShapesWorld root")
    if not path.is_file():
        raise UserError(f"--data {path} does not exist")
    return path


def _rating(value: Any, lo: float | None, hi: float | None) -> tuple[float | None, str | None]:
    """``(rating, None)`` or ``(None, skip reason)``."""
    if value is None:
        return None, "rating_missing"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None, "rating_not_a_number"
    v = float(value)
    if not math.isfinite(v):
        return None, "rating_nan"
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        return None, "rating_out_of_range"
    return v, None


def _resolve_image(image: str, base: Path, images_dir: Path | None, source: str) -> Path:
    p = Path(image).expanduser()
    if p.is_absolute():
        candidates = [p]
    elif images_dir is not None:
        candidates = [images_dir / p, images_dir / p.name]
    else:
        candidates = [base / p]
    for c in candidates:
        if c.is_file():
            return c
    raise UserError(f"{source}: image file not found: {candidates[0]}"
                    + (f" (nor {candidates[1]})" if len(candidates) > 1 and candidates[1] != candidates[0] else ""))


def _text(value: Any, what: str, source: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise UserError(f"{source}: '{what}' must be a non-empty string, got {value!r}")
    return value


def load_jsonl_pairs(path: Path, images_dir: Path | None = None, rating_min: float | None = None,
                     rating_max: float | None = None) -> tuple[list[Pair], Counter]:
    """Pairs of the plain JSONL layout, and the skipped rows counted by reason."""
    pairs, skipped = [], Counter()
    for lineno, row in read_jsonl(path, what="alignment pairs file"):
        source = f"{path}:{lineno}"
        for key in ("image", "caption"):
            if key not in row:
                raise UserError(f"{source}: missing '{key}' (the JSONL layout has image, caption, rating, "
                                "optional references)")
        caption = _text(row["caption"], "caption", source)
        image = _text(row["image"], "image", source)
        refs = row.get("references") or []
        if not isinstance(refs, list) or not all(isinstance(r, str) for r in refs):
            raise UserError(f"{source}: 'references' must be a list of strings, got {refs!r}")
        rating, why = _rating(row.get("rating"), rating_min, rating_max)
        if why:
            skipped[why] += 1
            continue
        pairs.append(Pair(str(row.get("id", lineno)), _resolve_image(image, path.parent, images_dir, source), image,
                          caption, rating, [r for r in refs if r.strip()], source))
    return pairs, skipped


def load_flickr8k_pairs(path: Path, images_dir: Path | None = None, rating_min: float | None = None,
                        rating_max: float | None = None) -> tuple[list[Pair], Counter]:
    """Pairs of the CLIPScore repository's Flickr8K layout, and the skipped judgements by reason."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise UserError(f"{path}:{e.lineno}: malformed JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected an object {{key: {{image_path, ground_truth, human_judgement}}}}, "
                        f"got {type(data).__name__}")
    pairs, skipped = [], Counter()
    for key, entry in data.items():
        where = f"{path}:{key}"
        if not isinstance(entry, dict) or "human_judgement" not in entry:
            raise UserError(f"{where}: expected {{image_path, ground_truth, human_judgement}}")
        refs = entry.get("ground_truth") or []
        if not isinstance(refs, list) or not all(isinstance(r, str) for r in refs):
            raise UserError(f"{where}: 'ground_truth' must be a list of strings")
        judgements = entry["human_judgement"]
        if not isinstance(judgements, list):
            raise UserError(f"{where}: 'human_judgement' must be a list")
        for i, j in enumerate(judgements):
            source = f"{where}[{i}]"
            if not isinstance(j, dict) or "caption" not in j:
                raise UserError(f"{source}: a human_judgement needs 'caption' and 'rating'")
            caption = _text(j["caption"], "caption", source)
            image = j.get("image_path") or entry.get("image_path")
            image = _text(image, "image_path", source)
            rating, why = _rating(j.get("rating"), rating_min, rating_max)
            if why:
                skipped[why] += 1
                continue
            own = " ".join(caption.lower().split())
            pairs.append(Pair(f"{key}/{i}", _resolve_image(image, path.parent, images_dir, source), image, caption,
                              rating, [r for r in refs if r.strip() and " ".join(r.lower().split()) != own], source))
    return pairs, skipped


def load_pairs(data: str | Path, images: str | Path | None = None, rating_min: float | None = None,
               rating_max: float | None = None) -> tuple[list[Pair], Counter]:
    """The pairs of ``--data`` (see the module docstring) and the skipped rows by reason."""
    if rating_min is not None and rating_max is not None and rating_min > rating_max:
        raise UserError(f"--rating-min {rating_min} is above --rating-max {rating_max}")
    path = data_file(data)
    images_dir = Path(images).expanduser() if images else None
    if images_dir is not None and not images_dir.is_dir():
        raise UserError(f"--images {images_dir} is not a folder")
    if Path(data).is_dir():  # a ShapesWorld root: image paths are relative to it
        images_dir = images_dir or Path(data)
    loader = load_jsonl_pairs if path.suffix == ".jsonl" else load_flickr8k_pairs
    pairs, skipped = loader(path, images_dir, rating_min, rating_max)
    if not pairs:
        raise UserError(f"{path}: no pair with a valid rating (skipped: {dict(skipped) or 'none'})")
    return pairs, skipped


def subset(pairs: Sequence[Pair], limit: int | None) -> list[Pair]:
    """The first ``limit`` pairs (all with None)."""
    return list(pairs if limit is None else pairs[:limit])


def read_image(pair: Pair) -> Image.Image:
    """The pair's image as RGB; an unreadable file is a :class:`UserError` naming it and the row."""
    try:
        with Image.open(pair.image_path) as im:
            return im.convert("RGB")
    except (OSError, UnidentifiedImageError) as e:
        raise UserError(f"{pair.source}: cannot read image {pair.image_path} ({type(e).__name__}: {e})") from None
