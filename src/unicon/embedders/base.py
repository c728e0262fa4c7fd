"""The embedder interface used by the drift metric (MCD): texts and/or images -> unit vectors.

An embedder maps inputs of the modalities it supports to L2-normalised float tensors ``[N, D]``,
so the cosine similarity of two embeddings is their dot product. ``modalities`` says what it
embeds; a cross-modal similarity (text->image, image->text) is only meaningful for embedders
whose text and image vectors live in one space (``joint`` = True: CLIP, the ShapesWorld scene
vector).
"""

from __future__ import annotations

import abc
from typing import Sequence

import torch
from PIL import Image

from unicon.errors import UserError


class EmbedderNotFound(UserError, FileNotFoundError):
    """An embedder's weights are not on this machine; the message says where we looked and what to do."""


class Embedder(abc.ABC):
    #: short name used in metric keys, e.g. "clip", "dino", "text", "scene"
    name: str = "embedder"
    #: the modalities this embedder accepts: a subset of {"text", "image"}
    modalities: frozenset[str] = frozenset()
    #: True when text and image vectors share one space (cross-modal cosine is meaningful)
    joint: bool = False

    def embed_text(self, texts: Sequence[str]) -> torch.Tensor:
        """``[N, D]`` L2-normalised text embeddings."""
        raise NotImplementedError(f"the {self.name} embedder does not embed text")

    def embed_image(self, images: Sequence[Image.Image]) -> torch.Tensor:
        """``[N, D]`` L2-normalised image embeddings."""
        raise NotImplementedError(f"the {self.name} embedder does not embed images")

    #: where the weights came from (a path, hub id or "ShapesWorld"), recorded in drift.json
    source: str | None = None

    def describe(self) -> dict[str, str | None]:
        """``{"class", "source"}`` of this embedder, for the reports that must say which model measured."""
        return {"class": type(self).__name__, "source": self.source}

    def supports(self, source: str, target: str) -> bool:
        """Whether ``sim(source item, target item)`` is defined (e.g. ``("text", "image")``)."""
        if source not in self.modalities or target not in self.modalities:
            return False
        return source == target or self.joint

    def embed(self, modality: str, items: Sequence) -> torch.Tensor:
        if modality == "text":
            return self.embed_text(items)
        if modality == "image":
            return self.embed_image(items)
        raise ValueError(f"unknown modality {modality!r}")


def normalize(x: torch.Tensor) -> torch.Tensor:
    """Row-wise L2 normalisation in float32 (zero rows stay zero)."""
    x = x.float()
    return x / x.norm(dim=-1, keepdim=True).clamp_min(1e-12)

