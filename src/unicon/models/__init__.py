"""Unified model backends behind one interface (``base.UnifiedModel``); this file only gathers names.

Where things live:

* :mod:`unicon.models.base` -- the interface every backend implements;
* :mod:`unicon.models.registry` -- ``backend:`` names -> classes (``@register_backend``; plugins
  through the ``unicon.backends`` entry points);
* :mod:`unicon.models.factory` -- every model is built there: :func:`build` of a :class:`ModelPlan`
  (what a checkpoint or a config says to build), :func:`build_model` of a ``model:`` config section;
* :mod:`unicon.models.checkpoints` -- every model file in and out: :func:`load_model` (any
  checkpoint), :func:`load_for_training` (what ``unicon train`` starts from), both a read
  (:func:`checkpoint_plan`, :func:`training_plan`) then :func:`build`; :func:`export_model`, the
  ``.ckpt`` / DeepSpeed / ``save_pretrained`` readers and the architecture check;
* :mod:`unicon.models.lora` -- PEFT LoRA adapters: placement, merging, :func:`has_lora`, saving them in
  PEFT's format;
* :mod:`unicon.models.boxes` -- boxes written as text, shared by the backends;
* the backends: :mod:`unicon.models.ofa`, :mod:`unicon.models.janus`, :mod:`unicon.models.decoupled`,
  and the image tokenizer :mod:`unicon.models.vqgan`. They are imported here so that their
  ``@register_backend`` decorators run on ``import unicon.models``; no backend imports another.
"""

from __future__ import annotations

from unicon.models import decoupled, janus, vqgan  # noqa: F401  (in-tree backends and image tokenizers register on import)
from unicon.models.ofa import unified  # noqa: F401
from unicon.models.base import EditingNotSupported, ImageGenerationConfig, UnifiedModel
from unicon.models.factory import (
    ModelPlan, apply_model_options, build, build_model, enable_gradient_checkpointing,
)
from unicon.models.checkpoints import (
    ARCHITECTURE_KEYS, DEEPSPEED_COMPLETE_FILE, DEEPSPEED_TAG_FILE, PICKLE_OPT_IN, TRAINING_CONFIG_NAME,
    check_same_architecture, checkpoint_config, checkpoint_plan, deepspeed_checkpoint_step, deepspeed_client_state,
    export_checkpoint, export_model, is_deepspeed_checkpoint, load_for_training, load_lightning_checkpoint,
    load_model, read_deepspeed_checkpoint, read_training_checkpoint, recorded_model_section,
    resumable_deepspeed_state, training_plan,
)
from unicon.models.lora import has_lora

__all__ = ["ARCHITECTURE_KEYS", "DEEPSPEED_COMPLETE_FILE", "DEEPSPEED_TAG_FILE", "EditingNotSupported",
           "ImageGenerationConfig", "ModelPlan", "PICKLE_OPT_IN", "TRAINING_CONFIG_NAME", "UnifiedModel",
           "apply_model_options", "build", "build_model", "check_same_architecture", "checkpoint_config",
           "checkpoint_plan", "deepspeed_checkpoint_step", "deepspeed_client_state", "enable_gradient_checkpointing",
           "export_checkpoint", "export_model", "has_lora", "is_deepspeed_checkpoint", "load_for_training",
           "load_lightning_checkpoint", "load_model", "read_deepspeed_checkpoint", "read_training_checkpoint",
           "recorded_model_section", "resumable_deepspeed_state", "training_plan"]
