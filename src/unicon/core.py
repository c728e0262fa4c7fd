"""The interface pieces that the model backends (``unicon.models``) and the worlds (``unicon.worlds``) share.

Imports go one way: ``unicon.models`` and ``unicon.worlds`` import this module; it imports neither.
What lives here:

* :class:`ImageTokenizer` -- the pixels <-> code-grid interface a world's exact tokenizer and a
  backend's VQ tokenizer both implement, with :func:`tensor_to_pil`;
* the **image tokenizer registry**: a saved model names its tokenizer by a spec
  ``{"type": kind, ...}``; the module that defines kind ``kind`` registers a builder with
  ``@register_image_tokenizer(kind)``, and :func:`build_image_tokenizer` finds it there or, for
  a module not yet imported, through the entry-point group :data:`IMAGE_TOKENIZER_ENTRY_POINTS`;
* :data:`DTYPES` / :func:`torch_dtype` -- the one map from config dtype names to torch dtypes;
* :func:`weights_fingerprint` -- the hash of a model's weights that loggers and evaluation
  outputs record;
* :func:`config_dict` -- a ``model:`` config section (DictConfig, mapping or dataclass) as a dict.

It may import torch, PIL and ``unicon.errors``, nothing else of unicon; torch only inside the functions
that take or make tensors, so that the worlds and the data builders start without it.
"""

from __future__ import annotations

import abc
import hashlib
import importlib.metadata
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence, Union

from PIL import Image

from unicon.errors import UserError

if TYPE_CHECKING:
    import torch

ImageBatch = Union[Sequence[Image.Image], "torch.Tensor"]


def tensor_to_pil(images: torch.Tensor) -> list[Image.Image]:
    """``[B, 3, H, W]`` floats in [0, 1] -> list of RGB PIL images."""
    import torch

    arr = (images.detach().clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
    return [Image.fromarray(a, mode="RGB") for a in arr]


class ImageTokenizer(abc.ABC):
    """Discrete image tokenizer: pixels <-> a grid of code indices.

    Implemented by the exact ShapesWorld tokenizer (one code per grid cell),
    and by VQ tokenizers (VQGAN for OFA, Janus's VQ-VAE).

    * ``encode(images)`` takes a float tensor ``[B, 3, H, W]`` in ``[0, 1]`` (or a
      list of PIL images) and returns ``LongTensor [B, h, w]`` of indices in
      ``[0, codebook_size)``.
    * ``decode(codes)`` takes ``LongTensor [B, h, w]`` and returns a float tensor
      ``[B, 3, H, W]`` in ``[0, 1]``.
    """

    codebook_size: int
    grid_size: tuple[int, int]  # (h, w) of the code grid
    image_size: tuple[int, int]  # (H, W) of decoded images

    @abc.abstractmethod
    def encode(self, images: ImageBatch) -> torch.Tensor: ...

    @abc.abstractmethod
    def decode(self, codes: torch.Tensor) -> torch.Tensor: ...

    def decode_to_pil(self, codes: torch.Tensor) -> list[Image.Image]:
        return tensor_to_pil(self.decode(codes))


# ---- image tokenizer registry -----------------------------------------------------------------
ImageTokenizerBuilder = Callable[[dict], ImageTokenizer]
IMAGE_TOKENIZER_ENTRY_POINTS = "unicon.image_tokenizers"
_IMAGE_TOKENIZER_BUILDERS: dict[str, ImageTokenizerBuilder] = {}


def register_image_tokenizer(kind: str) -> Callable[[ImageTokenizerBuilder], ImageTokenizerBuilder]:
    """Decorator: ``builder(spec) -> ImageTokenizer`` rebuilds tokenizers saved as ``{"type": kind, ...}``."""

    def register(builder: ImageTokenizerBuilder) -> ImageTokenizerBuilder:
        known = _IMAGE_TOKENIZER_BUILDERS.get(kind)
        if known is not None and known is not builder:
            raise ValueError(f"image tokenizer type {kind!r} is already registered by {known.__module__}")
        _IMAGE_TOKENIZER_BUILDERS[kind] = builder
        return builder

    return register


def build_image_tokenizer(spec: dict[str, Any]) -> ImageTokenizer:
    """The image tokenizer a spec ``{"type": kind, ...}`` describes (see :func:`register_image_tokenizer`)."""
    kind = spec.get("type")
    if kind not in _IMAGE_TOKENIZER_BUILDERS:
        for entry_point in importlib.metadata.entry_points(group=IMAGE_TOKENIZER_ENTRY_POINTS, name=kind):
            entry_point.load()  # its module registers the builder
    if kind not in _IMAGE_TOKENIZER_BUILDERS:
        raise UserError(f"image tokenizer type {kind!r} is not registered (known: {sorted(_IMAGE_TOKENIZER_BUILDERS)}); "
                        f"import the module that defines it, or install the plugin that declares it in the "
                        f"{IMAGE_TOKENIZER_ENTRY_POINTS!r} entry-point group")
    return _IMAGE_TOKENIZER_BUILDERS[kind](spec)


# ---- dtypes ----------------------------------------------------------------------------------
#: config dtype names (aliases included) -> the name of the torch dtype (``torch_dtype`` gives the dtype)
DTYPES = {
    "float32": "float32", "fp32": "float32",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "fp16": "float16",
}


def torch_dtype(name: str | torch.dtype, key: str = "model.dtype") -> torch.dtype:
    """The torch dtype a config value names (``float32``/``fp32``, ``bfloat16``/``bf16``,
    ``float16``/``fp16``); anything else is a :class:`UserError` naming ``key``."""
    import torch

    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise UserError(f"{key}: unknown dtype {name!r} (choose from {sorted(DTYPES)})")
    return getattr(torch, DTYPES[name])


# ---- weights ---------------------------------------------------------------------------------
def weights_fingerprint(model: torch.nn.Module) -> str:
    """A hash of a model's weights: BLAKE2b over every parameter and buffer (name, dtype, shape and
    bytes, in name order). Equal weights give equal fingerprints on any machine; it reads every
    byte once (about a second per few GB). Evaluation outputs record it so that a resumed
    evaluation can refuse to continue under another model."""
    import torch

    h = hashlib.blake2b(digest_size=16)
    state = model.state_dict()
    for name in sorted(state):
        t = state[name].detach()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        if t.numel():
            h.update(t.contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def config_dict(cfg: Any) -> dict:
    """A config section as a plain dict: an omegaconf ``DictConfig`` resolved, a mapping copied, a
    dataclass (``unicon.config.ModelConfig``) through ``asdict``; ``None`` is ``{}``."""
    if cfg is None:
        return {}
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(cfg, DictConfig):
            return OmegaConf.to_container(cfg, resolve=True)
    except ImportError:  # pragma: no cover
        pass
    if isinstance(cfg, Mapping):
        return dict(cfg)
    from dataclasses import asdict, is_dataclass

    if is_dataclass(cfg):
        return asdict(cfg)
    raise TypeError(f"expected a mapping/ModelConfig, got {type(cfg).__name__}")
