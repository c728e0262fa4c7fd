"""Builds embedders by name (``scene``, ``clip``, ``text``/``sentence``, ``dino``) for the drift metric.

Only this module knows which class serves which name; the embedder modules import their heavy
dependencies (open_clip, transformers, sentence-transformers) when built, so naming one does not
load the others. Weights are read from local paths only.
"""

from __future__ import annotations

import logging
from typing import Sequence

from unicon.embedders.base import Embedder, EmbedderNotFound
from unicon.embedders.clip import ClipEmbedder
from unicon.embedders.dino import HINT, DinoEmbedder
from unicon.embedders.scene import SceneEmbedder
from unicon.embedders.sentence import SentenceEmbedder
from unicon.errors import UserError

log = logging.getLogger(__name__)

#: embedder names accepted by :func:`load_embedders` (``sentence`` is an alias of ``text``)
EMBEDDER_NAMES = ("scene", "clip", "text", "dino")


def load_embedders(names: Sequence[str], clip: str | None = None, dino: str | None = None,
                   sentence: str | None = None, world_config=None, strict: bool = True) -> dict[str, Embedder]:
    """The named embedders, keyed by their metric name (``sentence`` is built as ``text``).

    ``clip``/``dino``/``sentence`` are the model locations (``sentence=None``: the bundled
    all-MiniLM-L6-v2); ``world_config`` is the ShapesWorld ``WorldConfig`` the ``scene`` embedder
    needs. ``strict=False`` logs an embedder whose weights are missing (with the path looked for)
    and skips it instead of raising :class:`EmbedderNotFound`.
    """
    out: dict[str, Embedder] = {}
    for name in names:
        try:
            if name == "scene":
                if world_config is None:
                    raise UserError("the scene embedder needs a ShapesWorld (its world.json config)")

                out["scene"] = SceneEmbedder(world_config)
            elif name == "clip":
                if clip is None:
                    raise EmbedderNotFound("no CLIP model given: pass --clip DIR (or eval.drift.clip=DIR); "
                                           "for ShapesWorld train one with `python -m unicon.embedders.clip "
                                           "--train-shapes data/shapes --out checkpoints/shapes_clip`")
                out["clip"] = ClipEmbedder(clip)
            elif name in ("text", "sentence"):
                out["text"] = SentenceEmbedder(sentence)
            elif name == "dino":
                if dino is None:
                    raise EmbedderNotFound(f"no DINO model given (--dino DIR): {HINT}")
                out["dino"] = DinoEmbedder(dino)
            else:
                raise UserError(f"unknown embedder {name!r}; use {', '.join(EMBEDDER_NAMES)}")
        except EmbedderNotFound as e:
            if strict:
                raise
            log.warning("skipping the %s embedder: %s", name, e)
    return out
