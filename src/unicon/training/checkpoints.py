"""From training checkpoints to ``save_pretrained`` model directories.

A Lightning ``.ckpt`` written by ``unicon train`` holds ``checkpoint["unicon_config"]`` (the
resolved RunConfig) and the ConsistencyModule's ``state_dict`` whose keys are ``model.<...>``.
With LoRA on (``model.lora.enabled``), the wrapped projections appear as
``<name>.base_layer.weight`` plus ``<name>.lora_A/B.default.weight``.

* :func:`export_model` writes ``save_pretrained``, the adapters merged (``merge=True``) or dropped
  by :func:`unicon.models.lora.merge_lora` (PEFT's ``merge_and_unload`` / ``unload``), so the
  model has its original parameter names again;
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


def export_model(model: torch.nn.Module, out_dir: str | Path, merge: bool = True,
                 run_config: dict | None = None) -> Path:
    """``model.save_pretrained(out_dir)`` with LoRA adapters merged (``merge``) -- in place.

    The adapters are always also saved as ``<out_dir>/lora_adapters.safetensors``; with
    ``merge=False`` the exported model is the base model without them. ``run_config`` (the
    resolved config of the run that trained it) is written as ``training_config.json``: a run
    started ``init_from`` this export checks its ``model:`` section against that record.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if has_lora(model):
        from safetensors.torch import save_file

        adapters = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items() if "lora_" in k}
        save_file(adapters, str(out / "lora_adapters.safetensors"))
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
