"""Scoring a failed image instead of crashing on it: :func:`images_by_row` calls a batched image
method (``generate_image``, ``edit_image``) and, when the batch fails, each row on its own, so one
bad row costs only itself and comes back as ``None`` with its error text, which the suites count as
a failed sample; :func:`draw_images` draws the images of a batch of samples that way."""

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


def draw_images(model, samples: Sequence, key, prompts: Sequence[str], image_config, context: Sequence | None = None,
                empty: str | None = None) -> None:
    """Set each sample's ``images[key]`` and ``errors[key]`` to ``model.generate_image`` of its prompt (and
    its ``context``) under ``image_config``, through :func:`images_by_row`. With ``empty``, a sample whose
    prompt is empty draws nothing and gets the error ``empty``."""
    rows = []
    for r, (s, prompt) in enumerate(zip(samples, prompts)):
        if empty is not None and not prompt:
            s.images[key], s.errors[key] = None, empty
        else:
            rows.append(r)
    if not rows:
        return

    def call(batch):  # the rows of one generate_image call: all of them, or one on a retry
        extra = {} if context is None else {"context": [context[r] for r in batch]}
        return model.generate_image([prompts[r] for r in batch], config=image_config, **extra)

    for r, im, err in zip(rows, *images_by_row(call, rows, "generate_image")):
        samples[r].images[key], samples[r].errors[key] = im, err
