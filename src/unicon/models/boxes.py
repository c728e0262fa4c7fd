"""Boxes written as text: ``[x, y, w, h]`` pixels <-> ``"[x1, y1, x2, y2]"`` in thousandths of the image.

The convention of Qwen-VL and DeepSeek-VL2 (integer corner coordinates normalised to 0..1000 of
the original image's width and height), used by every backend that has no box format of its own:
Janus writes and reads its grounding answers this way, and the decoupled backend uses it for VLMs
without a format of their own (its ``"thousandths"`` box format). It lives here, not in one of
those backends, so that no backend imports another.

It may import the standard library and :mod:`unicon.models.base` (for the ``Box`` type), nothing else.
"""

from __future__ import annotations

import re

from unicon.models.base import Box

_NUM = r"\s*(-?\d+(?:\.\d+)?)\s*"
_BOX_RE = re.compile(r"\[" + ",".join([_NUM] * 4) + r"\]")


def format_box(box: Box, width: float, height: float) -> str:
    """``[x, y, w, h]`` pixels -> ``"[x1, y1, x2, y2]"`` integers in 0..1000 of (width, height)."""
    if len(box) != 4:
        raise ValueError(f"box {list(box)} must have 4 numbers [x, y, w, h]")
    x, y, w, h = (float(v) for v in box)
    corners = (x / width, y / height, (x + w) / width, (y + h) / height)
    return "[" + ", ".join(str(int(round(1000 * min(max(c, 0.0), 1.0)))) for c in corners) + "]"


def parse_box(text: str, width: float, height: float) -> list[float] | None:
    """Inverse of :func:`format_box`: first ``[x1, y1, x2, y2]`` in ``text`` -> ``[x, y, w, h]`` pixels."""
    m = _BOX_RE.search(text)
    if m is None:
        return None
    x1, y1, x2, y2 = (float(g) / 1000.0 for g in m.groups())
    x1, x2 = sorted((x1, x2))
    y1, y2 = sorted((y1, y2))
    return [x1 * width, y1 * height, (x2 - x1) * width, (y2 - y1) * height]
