"""A model from a ``model:`` config section: the registered backend builds it, the section's options apply.

* :func:`build_model` -- a fresh (or ``pretrained``) model, built by the class registered for the
  section's ``backend`` (:mod:`unicon.models.registry`), with :func:`apply_model_options`.
* :func:`apply_model_options` -- ``dtype``, ``freeze_batchnorm`` and ``freeze``, also applied to a
  model loaded from a checkpoint (:func:`unicon.models.checkpoints.load_for_training`).
* :func:`enable_gradient_checkpointing` -- ``model.gradient_checkpointing`` of a training run.
* :func:`world_vocabulary` -- the world files a from-scratch model's vocabulary comes from (stored
  in every training checkpoint).

Reading and writing model files (checkpoints, exports, adapters) is :mod:`unicon.models.checkpoints`'
business, never this module's. It may import :mod:`unicon.models.base`, :mod:`unicon.models.registry`,
``unicon.core``, ``unicon.errors`` and torch; it knows no backend by name (they register themselves on import of
``unicon.models``).

OFA model configs (``configs/model/ofa_*.yaml``)::

    backend: ofa
    preset: shapes-tiny        # unicon.models.ofa.configuration_ofa.OFA_PRESETS
    pretrained: null           # or a local directory (save_pretrained / OFA-Sys layout)
    arch:                      # OFAConfig overrides, plus the wrapper keys below
      d_model: 128
      num_bins: 64             # location bins (OFA: 1000)   -- wrapper key
      num_beams: 5             # any OFAWrapperConfig field   -- wrapper keys

Wrapper keys (``num_bins`` and the fields of :class:`OFAWrapperConfig`) are split off ``arch``;
everything else must be an ``OFAConfig`` key. Without ``pretrained``, the text vocabulary is the
ShapesWorld world's ``tokenizer.json`` under ``world_root`` and the image codes are its exact
``ShapesTokenizer``; ``vocab_size`` is then text + codes + bins (``OFAUnifiedModel.from_config``).
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import torch

from unicon.core import config_dict, torch_dtype
from unicon.errors import UserError
from unicon.models.base import UnifiedModel
from unicon.models.registry import backend_class

__all__ = ["apply_model_options", "build_model", "enable_gradient_checkpointing", "world_vocabulary"]


def build_model(model_cfg: Any, world_root: str | Path | None = None) -> UnifiedModel:
    """The model described by a ``model:`` config section (``unicon.config.ModelConfig``), built by
    the class registered for its ``backend`` (:mod:`unicon.models.registry`)."""
    cfg = config_dict(model_cfg)
    model = backend_class(cfg.get("backend", "ofa")).from_config(cfg, world_root=world_root)
    return apply_model_options(model, cfg)


def apply_model_options(model: UnifiedModel, model_cfg: Any) -> UnifiedModel:
    """``model.dtype``, ``model.freeze_batchnorm`` and ``model.freeze`` of a config section, applied
    to a built or loaded model (``build_model`` does it; a run started ``init_from`` a checkpoint too)."""
    cfg = config_dict(model_cfg)
    dtype = torch_dtype(cfg.get("dtype", "float32"))
    if dtype != torch.float32:
        model.to(dtype)
    if cfg.get("freeze_batchnorm"):
        model.freeze_batchnorm()
    prefixes = list(cfg.get("freeze") or [])
    if prefixes:
        names = [n for n, _ in model.named_parameters()]
        for p in prefixes:
            if not any(n.startswith(p) for n in names):
                raise UserError(f"model.freeze: no parameter name starts with {p!r} (e.g. {names[0]!r})")
        for n, param in model.named_parameters():
            if any(n.startswith(p) for p in prefixes):
                param.requires_grad_(False)
    return model


def enable_gradient_checkpointing(model: torch.nn.Module) -> None:
    """The backend's ``gradient_checkpointing_enable``, or that of its HF backbone (OFA keeps it inside)."""
    for module in model.modules():
        enable = getattr(module, "gradient_checkpointing_enable", None)
        if callable(enable) and getattr(module, "supports_gradient_checkpointing", True):
            if "gradient_checkpointing_kwargs" in inspect.signature(enable).parameters:  # HF PreTrainedModel
                enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            else:
                enable()
            return
    raise UserError(f"model.gradient_checkpointing: the {getattr(model, 'backend', type(model).__name__)} "
                    "backend has no gradient_checkpointing_enable()")


def world_vocabulary(model_cfg: Any, world_root: str | Path | None) -> dict[str, str]:
    """Text of the world files a from-scratch model's vocabulary comes from (``{}`` otherwise): the
    ``world_vocabulary_files`` its backend class names (OFA: ``tokenizer.json``, ``world.json``).

    ``unicon train`` stores them in every ``.ckpt`` (key ``unicon_world_files``), so a checkpoint
    loads without the world, and rebuilding the world cannot change an old run's vocabulary.
    """
    cfg = config_dict(model_cfg)
    if cfg.get("pretrained") or world_root is None:
        return {}
    names = getattr(backend_class(cfg.get("backend", "ofa")), "world_vocabulary_files", ())
    root = Path(world_root)
    return {name: (root / name).read_text() for name in names if (root / name).is_file()}
