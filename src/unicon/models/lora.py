"""LoRA adapters through PEFT: which layers of a unified model get them, nothing else trains, and merging.

``apply_lora(model, cfg.model.lora)`` is called by training (before the optimizer is built) and
by checkpoint loading (so that a ``.ckpt`` of a LoRA run loads its adapter weights). A backend
with an ``add_lora(lora_cfg)`` method places the adapters itself (Janus: the language model's
projections only, never the vision encoder) through :func:`inject_lora`; otherwise the adapters
go on every ``nn.Linear`` whose name ends in ``lora.target_modules`` (default
:data:`DEFAULT_LORA_TARGETS`).

The adapters are injected in place (parameter names stay ``<layer>.base_layer.weight`` plus
``<layer>.lora_A/B.default.weight``, so checkpoints keep their keys). :func:`inject_lora` keeps
PEFT's ``LoraModel`` tuner that did the injection in the model's ``__dict__`` (not as a submodule,
so it is no part of ``state_dict``), and :func:`merge_lora` unloads through it with PEFT's own
``merge_and_unload`` / ``unload``; :func:`has_lora` says whether a model holds adapters;
:func:`save_lora_adapter` writes them in PEFT's format, as ``PeftModel.save_pretrained`` does.

It may import torch, PEFT and safetensors, nothing of unicon: exporting a LoRA model (its adapters
beside it) belongs to :mod:`unicon.models.checkpoints`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

_TUNER_ATTRIBUTE = "_lora_tuner"

# suffixes of the attention and MLP projections of common backbones (OFA/BART, LLaMA-style, ViT)
DEFAULT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "out_proj", "o_proj", "fc1", "fc2",
                        "gate_proj", "up_proj", "down_proj")


def apply_lora(model: torch.nn.Module, lora_cfg: Any) -> list[str]:
    """Inject PEFT LoRA adapters into the attention/MLP projections; only adapters stay trainable.

    Returns the names of the wrapped modules. A backend with an ``add_lora(lora_cfg)`` method
    (Janus: only the language model, never the vision encoder) places the adapters itself;
    otherwise ``lora_cfg.target_modules`` (name suffixes) defaults to :data:`DEFAULT_LORA_TARGETS`
    present in the model.
    """
    from peft import LoraConfig as PeftLoraConfig

    if hasattr(model, "add_lora"):  # the backend knows which projections are its language model's
        model.add_lora(lora_cfg)
        return [n for n, m in model.named_modules() if hasattr(m, "lora_A")]
    linear_names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    targets = list(lora_cfg.target_modules) or [
        t for t in DEFAULT_LORA_TARGETS if any(n.split(".")[-1] == t for n in linear_names)
    ]
    wrapped = [n for n in linear_names if n.split(".")[-1] in targets]
    if not wrapped:
        raise ValueError(
            f"model.lora.target_modules {targets} match no nn.Linear of the model "
            f"(examples of its linear layers: {linear_names[:8]})"
        )
    peft_cfg = PeftLoraConfig(
        r=lora_cfg.r, lora_alpha=lora_cfg.alpha, lora_dropout=lora_cfg.dropout, target_modules=targets
    )
    inject_lora(model, peft_cfg)
    return wrapped


def inject_lora(model: torch.nn.Module, peft_config: Any) -> None:
    """Inject the adapters of a PEFT ``LoraConfig`` into ``model`` in place (what
    ``peft.inject_adapter_in_model`` does) and keep the tuner for :func:`merge_lora`; afterwards
    only the adapters are trainable."""
    from peft.tuners.lora import LoraModel

    if _TUNER_ATTRIBUTE in model.__dict__:
        raise ValueError(f"{type(model).__name__} already has LoRA adapters")
    model.__dict__[_TUNER_ATTRIBUTE] = LoraModel(model, peft_config, adapter_name="default")
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)


def merge_lora(model: torch.nn.Module, merge: bool = True) -> None:
    """Fold the adapters of :func:`inject_lora` into their base layers (PEFT's ``merge_and_unload``;
    ``merge=False``: ``unload``, the adapters are dropped and the base weights kept) and unwrap them,
    in place. The model has its original parameter names again, all of them trainable."""
    tuner = model.__dict__.pop(_TUNER_ATTRIBUTE, None)
    if tuner is None:
        raise ValueError(f"{type(model).__name__} has no LoRA adapters injected by unicon.models.lora.inject_lora")
    if merge:
        tuner.merge_and_unload()
    else:
        tuner.unload()
    for p in model.parameters():
        p.requires_grad_(True)


def has_lora(model: torch.nn.Module) -> bool:
    """Whether ``model`` holds PEFT LoRA layers (those of :func:`apply_lora` / :func:`inject_lora`)."""
    from peft.tuners.lora import LoraLayer

    return any(isinstance(m, LoraLayer) for m in model.modules())


def save_lora_adapter(model: torch.nn.Module, out_dir: str | Path, base_model_name_or_path: str | None = None) -> Path:
    """The LoRA adapters of :func:`inject_lora` in PEFT's format, as
    ``PeftModel.save_pretrained`` writes them: ``adapter_model.safetensors`` (PEFT's
    ``get_peft_model_state_dict``: ``base_model.model.<layer>.lora_A/B.weight``, the adapter name
    dropped) and ``adapter_config.json`` (the injecting ``LoraConfig``, ``inference_mode`` on).
    ``PeftModel.from_pretrained(base_model, out_dir)`` loads them onto the unadapted model."""
    import copy

    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save_file

    tuner = model.__dict__.get(_TUNER_ATTRIBUTE)
    if tuner is None:
        raise ValueError(f"{type(model).__name__} has no LoRA adapters injected by unicon.models.lora.inject_lora")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # PEFT selects the adapter entries of the tuner (keys "model.<layer>.lora_A.weight", the tuner holding
    # our model as .model); a PeftModel holds that tuner as .base_model, hence its keys' "base_model." prefix
    adapters = get_peft_model_state_dict(tuner, adapter_name="default", save_embedding_layers=False)
    if not adapters:
        raise ValueError(f"{type(model).__name__}: PEFT found no adapter weights to save")
    save_file({f"base_model.{k}": v.detach().cpu().contiguous() for k, v in adapters.items()},
              str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = copy.deepcopy(tuner.peft_config["default"])
    config.inference_mode = True
    if base_model_name_or_path:
        config.base_model_name_or_path = str(base_model_name_or_path)
    config.save_pretrained(str(out))
    return out
