"""Image->image similarity with DINO features (the paper's image embedder), via transformers.

``DinoEmbedder(path)`` loads any transformers vision backbone saved with ``save_pretrained``
together with its image processor (e.g. ``facebook/dinov2-base`` or ``facebook/dino-vitb16``
downloaded once) and embeds an image as the final-layer CLS token (``last_hidden_state[:, 0]``,
the DINO convention), L2-normalised. A hub id works too when the HF cache holds it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch
from PIL import Image

from unicon.embedders.base import Embedder, EmbedderNotFound, normalize

HINT = (
    "download a DINO backbone once, e.g. "
    "`AutoModel.from_pretrained('facebook/dinov2-base').save_pretrained(DIR)` "
    "and `AutoImageProcessor.from_pretrained('facebook/dinov2-base').save_pretrained(DIR)`, and pass DIR"
)


class DinoEmbedder(Embedder):
    name = "dino"
    modalities = frozenset({"image"})

    def __init__(self, path: str | Path, device: str = "cpu", batch_size: int = 32):
        from transformers import AutoImageProcessor, AutoModel

        local = Path(path).expanduser()
        if not local.exists() and (str(path).startswith((".", "/", "~")) or str(path).count("/") != 1):
            raise EmbedderNotFound(f"DINO model not found at {local.resolve()}: {HINT}")
        try:
            self.processor = AutoImageProcessor.from_pretrained(str(path))
            self.model = AutoModel.from_pretrained(str(path)).to(device).eval()
        except OSError as e:
            reason = str(e).splitlines()[0]
            raise EmbedderNotFound(f"cannot load DINO model from {path!r} ({reason}): {HINT}") from None
        self.device = device
        self.batch_size = batch_size
        self.source = str(path)

    @torch.no_grad()
    def embed_image(self, images: Sequence[Image.Image]) -> torch.Tensor:
        out = []
        for s in range(0, len(images), self.batch_size):
            batch = [im.convert("RGB") for im in images[s : s + self.batch_size]]
            inputs = self.processor(images=batch, return_tensors="pt").to(self.device)
            out.append(self.model(**inputs).last_hidden_state[:, 0].float().cpu())
        return normalize(torch.cat(out))
