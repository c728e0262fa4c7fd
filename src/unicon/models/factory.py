"""Every model is built here: from a :class:`ModelPlan`, what a checkpoint or a run's config says to build.

* :class:`ModelPlan` -- what to build: a ``save_pretrained`` / OFA-Sys directory, or a ``model:``
  section with the vocabulary it uses, and the LoRA adapters and weights of a training checkpoint.
  :mod:`unicon.models.checkpoints` reads one out of any checkpoint (and out of a run's config);
* :func:`build` -- the model of a plan: the registered backend's ``from_pretrained`` or
  :func:`build_model`, then the adapters, then the weights, then what a training run adds (its
  options over a checkpoint's, gradient checkpointing, LoRA);
* :func:`build_model` -- the model of a ``model:`` section: the class registered for its
  ``backend`` (:mod:`unicon.models.registry`) builds it, :func:`apply_model_options` follows;
* :func:`apply_model_options` -- ``dtype``, ``freeze_batchnorm`` and ``freeze``, also applied to a
  model a run starts from a checkpoint with (:func:`build` of its plan);
* :func:`enable_gradient_checkpointing` -- ``model.gradient_checkpointing`` of a training run.

Reading and writing model files (checkpoints, exports) is :mod:`unicon.models.checkpoints`' business,
never this module's: a plan arrives with what was read (a training checkpoint's weights as a function
that returns them).
It may import :mod:`unicon.models.base`, :mod:`unicon.models.registry`, :mod:`unicon.models.lora`,
``unicon.core``, ``unicon.errors`` and torch; it knows no backend by name (they register
themselves on import of ``unicon.models``).

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
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from unicon.core import config_dict, torch_dtype
from unicon.errors import UserError
from unicon.models.base import UnifiedModel
from unicon.models.lora import apply_lora
from unicon.models.registry import backend_class

__all__ = ["ModelPlan", "apply_model_options", "build", "build_model", "enable_gradient_checkpointing"]


@dataclass
class ModelPlan:
    """What to build, as a checkpoint (or a run's config) describes it; :func:`build` builds it.

    ``model`` is the ``model:`` section that describes the network: a training checkpoint's stored
    one, an export's recorded one (``training_config.json``), a run's own; None when nothing
    recorded it (an OFA-Sys directory, an older export). A run's architecture check compares its
    own section with it (:func:`unicon.models.checkpoints.check_same_architecture`)."""

    backend: str  # the registered backend that builds it
    model: Any = None
    source: Path | None = None  # the checkpoint it was read from (named in messages); None: a run's config
    #: ``source`` is a ``save_pretrained`` / OFA-Sys directory, which the backend's ``from_pretrained``
    #: loads whole with ``pretrained_options`` (e.g. ``allow_pickle``; ``map_location``: where the
    #: loaded model is moved); otherwise :func:`build_model` builds ``model``
    directory: bool = False
    pretrained_options: dict = field(default_factory=dict)
    #: the vocabulary a ``model`` built from scratch uses: the world at ``world_root``, or the world
    #: files a training checkpoint stored (``{name: text}``, written to a temporary folder)
    world_root: str | Path | None = None
    world_files: dict[str, str] = field(default_factory=dict)
    lora: Any = None  # the LoRA section of the adapters ``weights`` hold (applied unmerged, before them)
    weights: Callable[[], dict] | None = None  # reads the state dict the built model loads, every key matched
    run_config: Any = None  # the run config a training checkpoint stored
    #: for a model a run trains, the run's ``model:`` section: its options over those of a checkpoint
    #: (the model then in training mode), its gradient checkpointing, and its LoRA adapters unless the
    #: checkpoint brought some
    training: Any = None


def build(plan: ModelPlan) -> UnifiedModel:
    """The model a plan describes, the one way a model is made from a checkpoint or a run's config:
    the registered backend's ``from_pretrained`` of a directory; otherwise :func:`build_model` of
    ``plan.model`` with its vocabulary, then the LoRA adapters, then the weights (refused, naming
    ``plan.source``, when they do not fit); then what a run adds (``plan.training``)."""
    cls = backend_class(plan.backend)
    if plan.directory:
        options = dict(plan.pretrained_options)
        device = options.pop("map_location", None)
        model = cls.from_pretrained(str(plan.source), **options)
        model = model.to(device) if device else model
    else:
        with _vocabulary(plan, cls) as world_root:
            model = build_model(plan.model, world_root)
        if plan.lora is not None:
            apply_lora(model, plan.lora)
        if plan.weights is not None:
            _load_weights(model, plan.weights(), plan.source)
    if plan.training is not None:
        model = _for_training(model, plan)
    return model


def _for_training(model: UnifiedModel, plan: ModelPlan) -> UnifiedModel:
    """The run's ``model:`` section (``plan.training``) applied to the model it starts from: its
    options (a model built from that section has them already), gradient checkpointing, and its LoRA
    adapters unless the checkpoint brought some (``plan.lora``: a LoRA run's checkpoint)."""
    model_cfg = plan.training
    if plan.source is not None:
        model = apply_model_options(model, model_cfg).train()
    if model_cfg.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    if model_cfg.lora.enabled and plan.lora is None:
        try:
            apply_lora(model, model_cfg.lora)
        except ValueError as e:
            raise UserError(str(e)) from None
    return model


@contextmanager
def _vocabulary(plan: ModelPlan, cls: type[UnifiedModel]) -> Iterator[str | Path | None]:
    """The world root a plan's ``model`` is built with: ``world_root``, or a temporary folder holding
    the stored ``world_files`` (only names the backend reads: nothing is written elsewhere)."""
    if not plan.world_files:
        yield plan.world_root
        return
    unknown = sorted(set(plan.world_files) - set(cls.world_vocabulary_files))
    if unknown:
        raise UserError(f"{plan.source}: unexpected stored world files {unknown}")
    with tempfile.TemporaryDirectory() as tmp:
        for name, text in plan.world_files.items():
            (Path(tmp) / name).write_text(text)
        yield tmp


def _load_weights(model: torch.nn.Module, state: dict, source: Path | None) -> None:
    """``model.load_state_dict(state)``, every key matched; a mismatch is one line naming ``source``."""
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as e:  # size mismatches
        detail = next((ln.strip() for ln in str(e).splitlines() if "size mismatch" in ln), str(e).splitlines()[0])
        raise UserError(f"{source}: weights do not fit the model its config describes ({detail}); "
                        "was it trained on another world's vocabulary? pass that world") from None
    if missing or unexpected:
        raise UserError(f"{source}: weights do not match the model; first missing: {missing[:1]}, "
                        f"first unexpected: {unexpected[:1]} ({len(missing)} missing, {len(unexpected)} unexpected)")


def build_model(model_cfg: Any, world_root: str | Path | None = None) -> UnifiedModel:
    """The model described by a ``model:`` config section (``unicon.config.ModelConfig``), built by
    the class registered for its ``backend`` (:mod:`unicon.models.registry`), with its options."""
    cfg = config_dict(model_cfg)
    model = backend_class(cfg.get("backend", "ofa")).from_config(cfg, world_root=world_root)
    return apply_model_options(model, cfg)


def apply_model_options(model: UnifiedModel, model_cfg: Any) -> UnifiedModel:
    """``model.dtype``, ``model.freeze_batchnorm`` and ``model.freeze`` of a config section, applied
    to a built or loaded model (``build_model`` does it; :func:`build` for a run that starts from a
    checkpoint too)."""
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
