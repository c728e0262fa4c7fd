"""From training checkpoints to ``save_pretrained`` model directories.

A Lightning ``.ckpt`` written by ``unicon train`` holds ``checkpoint["unicon_config"]`` (the
resolved RunConfig) and the ConsistencyModule's ``state_dict`` whose keys are ``model.<...>``.
With LoRA on (``model.lora.enabled``), the wrapped projections appear as
``<name>.base_layer.weight`` plus ``<name>.lora_A/B.default.weight``.

* :func:`export_model` writes ``save_pretrained``, the adapters merged (``merge=True``) or dropped
  by :func:`unicon.models.lora.merge_lora` (PEFT's ``merge_and_unload`` / ``unload``), so the
  model has its original parameter names again; the adapters themselves go to ``<export>/adapter/``
  in PEFT's format (:func:`save_lora_adapter`: ``adapter_config.json`` +
  ``adapter_model.safetensors``), which ``peft.PeftModel.from_pretrained(base, "<export>/adapter")``
  loads onto the run's base model (its ``init_from`` / ``model.pretrained``; with
  ``model.lora.merge_on_export=false`` the export itself);
* :func:`export_checkpoint`: ``.ckpt`` -> ``save_pretrained`` directory, through
  :func:`unicon.models.load_lightning_checkpoint` (which re-applies LoRA adapters).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from unicon.models import TRAINING_CONFIG_NAME, load_lightning_checkpoint
from unicon.models.lora import merge_lora


def has_lora(model: torch.nn.Module) -> bool:
    from peft.tuners.lora import LoraLayer

    return any(isinstance(m, LoraLayer) for m in model.modules())


ADAPTER_DIR = "adapter"  # <export>/adapter: the LoRA adapters in PEFT's format


def save_lora_adapter(model: torch.nn.Module, out_dir: str | Path, base_model_name_or_path: str | None = None) -> Path:
    """The LoRA adapters of :func:`unicon.models.lora.inject_lora` in PEFT's format, as
    ``PeftModel.save_pretrained`` writes them: ``adapter_model.safetensors`` (PEFT's
    ``get_peft_model_state_dict``: ``base_model.model.<layer>.lora_A/B.weight``, the adapter name
    dropped) and ``adapter_config.json`` (the injecting ``LoraConfig``, ``inference_mode`` on).
    ``PeftModel.from_pretrained(base_model, out_dir)`` loads them onto the unadapted model."""
    import copy

    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save_file

    from unicon.models.lora import _TUNER_ATTRIBUTE

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


def export_model(model: torch.nn.Module, out_dir: str | Path, merge: bool = True,
                 run_config: dict | None = None) -> Path:
    """``model.save_pretrained(out_dir)`` with LoRA adapters merged (``merge``) -- in place.

    The adapters are always also saved, in PEFT's format, to ``<out_dir>/adapter/``
    (:func:`save_lora_adapter`; ``PeftModel.from_pretrained`` loads them); with ``merge=False``
    the exported model is the base model without them. ``run_config`` (the
    resolved config of the run that trained it) is written as ``training_config.json``: a run
    started ``init_from`` this export checks its ``model:`` section against that record.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if has_lora(model):
        base = (run_config or {}).get("init_from") or ((run_config or {}).get("model") or {}).get("pretrained")
        save_lora_adapter(model, out / ADAPTER_DIR, base_model_name_or_path=base)
        merge_lora(model, merge=merge)
    model.save_pretrained(str(out))
    if run_config is not None:
        (out / TRAINING_CONFIG_NAME).write_text(json.dumps(run_config, indent=2, sort_keys=True) + "\n")
    return out


def export_checkpoint(ckpt_path: str | Path, out_dir: str | Path, merge: bool = True, **kw: Any) -> Path:
    """``.ckpt`` -> ``save_pretrained`` directory (merged LoRA)."""
    from omegaconf import OmegaConf

    model, cfg = load_lightning_checkpoint(ckpt_path, **kw)
    return export_model(model, out_dir, merge=merge, run_config=OmegaConf.to_container(cfg, resolve=True))
