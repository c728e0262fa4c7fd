"""LoRA adapters through PEFT: which layers of a unified model get them, and nothing else trains.

``apply_lora(model, cfg.model.lora)`` is called by training (before the optimizer is built) and
by checkpoint loading (so that a ``.ckpt`` of a LoRA run loads its adapter weights). A backend
with an ``add_lora(lora_cfg)`` method places the adapters itself (Janus: the language model's
projections only, never the vision encoder); otherwise the adapters go on every ``nn.Linear``
whose name ends in ``lora.target_modules`` (default :data:`DEFAULT_LORA_TARGETS`).
"""

from __future__ import annotations

from typing import Any

import torch

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
    from peft import inject_adapter_in_model

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
    inject_adapter_in_model(peft_cfg, model)
    for name, p in model.named_parameters():
        p.requires_grad = "lora_" in name
    return wrapped
