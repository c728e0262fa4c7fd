"""EditingScore samples from an Edit-1K-like JSONL file (``docs/editing_score.md``).

One JSON object per line::

    {"id": "e1/exact",                       # optional (default: "line <n>")
     "source_image": "images/e1/source.png",  # x_s: relative to the JSONL's folder, or absolute
     "edited_image": "images/e1/exact.png",   # x_t: the edit under evaluation
     "instruction": "paint the red circle blue",
     "ratings": {"editing_accuracy": 1.0, "visual_quality": 0.9, "content_preservation": 1.0,
                 "style_consistency": 1.0, "overall": 0.95},   # each in [0, 1] (Edit-1K's scale)
     ...}                                     # any other key (kind, candidate, scenes) is kept as extra

Refused with a :class:`~unicon.errors.UserError` naming the file and line: a line that is not a JSON
object, a missing or empty ``source_image`` / ``edited_image`` / ``instruction``, ``ratings`` that is
not an object, a rating key outside :data:`CRITERIA`, an image file that does not exist (and, when read,
one that cannot be decoded). A rating that is missing, null, NaN, not a number or outside [0, 1] is
**skipped** for that criterion (the row still counts for the others) and counted per criterion
(:func:`rating_or_none`); a row without any usable rating still gets its score.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from PIL import Image

from unicon.data.jsonl import read_jsonl
from unicon.errors import UserError

#: Edit-1K's five criteria, ``overall`` last (the paper's "Overall Effect")
CRITERIA = ("editing_accuracy", "visual_quality", "content_preservation", "style_consistency", "overall")
RATING_RANGE = (0.0, 1.0)
REQUIRED = ("source_image", "edited_image", "instruction")


@dataclass(frozen=True)
class EditSample:
    """One (source, edited image, instruction) with its raw ratings (validated lazily per criterion)."""

    id: str
    source_image: Path
    edited_image: Path
    instruction: str
    ratings: dict[str, Any]
    file: Path
    line: int
    extra: dict[str, Any] = field(default_factory=dict)

    def image(self, which: str) -> Image.Image:
        """``source`` or ``edited`` image as RGB; an unreadable file is a :class:`UserError` naming it and the row."""
        path = self.source_image if which == "source" else self.edited_image
        try:
            with Image.open(path) as im:
                return im.convert("RGB")
        except (OSError, ValueError) as e:
            raise UserError(f"{self.file}:{self.line}: {which}_image {path} cannot be read as an image ({e})") from None


def rating_or_none(value: Any) -> float | None:
    """The rating as a float when usable (a finite number in :data:`RATING_RANGE`), else None (skipped)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    v = float(value)
    if not math.isfinite(v) or not RATING_RANGE[0] <= v <= RATING_RANGE[1]:
        return None
    return v


def load_samples(path: str | Path, limit: int | None = None) -> list[EditSample]:
    """The rows of ``path`` (the first ``limit`` when given); see the module docstring for what is refused."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"--data {path} does not exist (an Edit-1K-like .jsonl file, docs/editing_score.md)")
    base = path.parent
    out: list[EditSample] = []
    for n, row in read_jsonl(path, what="EditingScore data file"):
        if limit is not None and len(out) >= limit:
            break
        for key in REQUIRED:
            if not isinstance(row.get(key), str) or not row[key].strip():
                raise UserError(f"{path}:{n}: '{key}' is missing or not a non-empty string")
        ratings = row.get("ratings", {})
        if not isinstance(ratings, dict):
            raise UserError(f"{path}:{n}: 'ratings' must be an object of {', '.join(CRITERIA)}")
        unknown = sorted(set(ratings) - set(CRITERIA))
        if unknown:
            raise UserError(f"{path}:{n}: unknown rating key '{unknown[0]}' (expected {', '.join(CRITERIA)})")
        images = {}
        for key in ("source_image", "edited_image"):
            p = Path(row[key])
            p = p if p.is_absolute() else base / p
            if not p.is_file():
                raise UserError(f"{path}:{n}: {key} {p} does not exist")
            images[key] = p
        extra = {k: v for k, v in row.items() if k not in (*REQUIRED, "ratings", "id")}
        out.append(EditSample(str(row.get("id", f"line {n}")), images["source_image"], images["edited_image"],
                              row["instruction"], dict(ratings), path, n, extra))
    if not out:
        raise UserError(f"--data {path} has no rows")
    return out
