"""ShapesWorld's exact reference similarity: a symbolic content vector for captions and images.

Both modalities map into one space (``joint``), so all four drift mappings are defined:

* an **image** is parsed exactly with ``unicon.worlds.shapes.parse`` into its scene;
* a **caption** is parsed with ``unicon.worlds.shapes.parse_caption`` (the world grammar).

The vector is ``[n(color, shape) for every kind] ++ [n(shape) for every shape]``: object counts
per (colour, shape) kind and per shape (a caption noun phrase without a colour only adds to the
shape block). Positions are not part of it, because captions fix only relations, not cells.
The cosine of two such vectors is 1 exactly when both describe the same multiset of objects.
An image that is not a ShapesWorld rendering, or a caption outside the grammar, describes
nothing recognisable and gets the zero vector (cosine 0 with everything).
"""

from __future__ import annotations

from typing import Sequence

import torch
from PIL import Image

from unicon.embedders.base import Embedder, normalize
from unicon.worlds.shapes import NotAShapesWorldImage, parse
from unicon.worlds.shapes_text import CaptionParseError, parse_caption


class SceneEmbedder(Embedder):
    name = "scene"
    modalities = frozenset({"text", "image"})
    joint = True

    def __init__(self, world_cfg):
        self.cfg = world_cfg
        self.kinds = [(c, s) for s in world_cfg.shapes for c in world_cfg.color_names]
        self._kind_index = {k: i for i, k in enumerate(self.kinds)}
        self._shape_index = {s: len(self.kinds) + i for i, s in enumerate(world_cfg.shapes)}
        self.dim = len(self.kinds) + len(world_cfg.shapes)
        self.failures = {"text": 0, "image": 0}  # items that mapped to the zero vector
        self.source = "ShapesWorld world.json (exact scene parser)"

    def scene_vector(self, scene) -> torch.Tensor:
        v = torch.zeros(self.dim)
        for obj in scene.objects:
            v[self._kind_index[(obj.color, obj.shape)]] += 1
            v[self._shape_index[obj.shape]] += 1
        return v

    def caption_vector(self, text: str) -> torch.Tensor:
        v = torch.zeros(self.dim)
        try:
            spec = parse_caption(text, self.cfg)
        except CaptionParseError:
            self.failures["text"] += 1
            return v
        for np_ in spec.noun_phrases():
            if np_.color is not None:
                v[self._kind_index[(np_.color, np_.shape)]] += np_.count
            v[self._shape_index[np_.shape]] += np_.count
        return v

    def embed_text(self, texts: Sequence[str]) -> torch.Tensor:
        if not texts:
            return torch.zeros(0, self.dim)
        return normalize(torch.stack([self.caption_vector(t) for t in texts]))

    def embed_image(self, images: Sequence[Image.Image]) -> torch.Tensor:
        rows = []
        for im in images:
            try:
                rows.append(self.scene_vector(parse(im, self.cfg)))
            except NotAShapesWorldImage:
                self.failures["image"] += 1
                rows.append(torch.zeros(self.dim))
        return normalize(torch.stack(rows)) if rows else torch.zeros(0, self.dim)
