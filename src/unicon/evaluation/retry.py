"""Scoring a failed image instead of crashing on it: :func:`images_by_row` calls a batched image
method (``generate_image``, ``edit_image``) and, when the batch fails, each row on its own, so one
bad row costs only itself and comes back as ``None`` with its error text, which the suites count as
a failed sample."""

from __future__ import annotations

import logging
from typing import Callable, Sequence

from PIL import Image

from unicon.evaluation import preemption

log = logging.getLogger(__name__)


def images_by_row(call: Callable[[list[int]], Sequence], rows: Sequence[int],
                  what: str) -> tuple[list[Image.Image | None], list[str | None]]:
    """``call(rows)`` (the images of those rows), then ``call([r])`` for each row if the batch
    raises; ``(images, errors)`` in the order of ``rows``: a row that still fails, or whose result is
    not a PIL image, gives ``None`` and its error text (``what`` names the call in it). A wrong
    number of images fails the batch. :class:`~unicon.evaluation.preemption.Preempted` and
    ``NotImplementedError`` (a backend without the method) are raised, never scored."""
    rows = list(rows)
    try:
        out = list(call(rows))
        if len(out) != len(rows):
            raise RuntimeError(f"{what} returned {len(out)} images for {len(rows)} rows")
        errors: list[str | None] = [None if isinstance(im, Image.Image) else
                                    f"{what} returned {type(im).__name__}, not a PIL image" for im in out]
        return [im if e is None else None for im, e in zip(out, errors)], errors
    except (preemption.Preempted, NotImplementedError):
        raise
    except Exception as e:  # noqa: BLE001 -- a failed image is a scored failure, never a crash
        if len(rows) == 1:
            log.warning("%s failed: %s", what, e)
            return [None], [f"{type(e).__name__}: {e}"]
    images, errors = [], []
    for r in rows:
        im, err = images_by_row(call, [r], what)
        images += im
        errors += err
    return images, errors
