"""Embedding models behind one small interface, used by the drift metrics (MCD).

``base.Embedder`` (embed_text / embed_image -> L2-normalised tensors) is implemented by
``clip.ClipEmbedder`` (open_clip; text<->image, text->text, image->image), ``dino.DinoEmbedder``
(transformers; image->image), ``sentence.SentenceEmbedder`` (sentence-transformers; text->text) and
``scene.SceneEmbedder`` (ShapesWorld's exact symbolic similarity, all four mappings).
``factory.load_embedders`` builds them by name from local weights.
"""

from unicon.embedders.base import Embedder, EmbedderNotFound, normalize

__all__ = ["Embedder", "EmbedderNotFound", "normalize"]
