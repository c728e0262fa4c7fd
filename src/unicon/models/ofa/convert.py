"""Checkpoint I/O for the native OFA model: the one place where stored keys are mapped to ours.

A checkpoint directory holds ``config.json`` and ``model.safetensors`` (the OFA-Sys Hugging
Face port writes ``pytorch_model.bin``; that pickle file is read only with
``allow_pickle=True`` and is then converted once to ``model.safetensors``, with a log line).

Key mapping (everything else must match one-to-one, or loading fails naming the first
missing and the first unexpected key -- never a partial load):

* prefix: ``OFAForConditionalGeneration`` keys are ``model.encoder.*``/``model.decoder.*``;
  ``OFAModel`` keys have no ``model.`` prefix. A checkpoint of either class loads into both.
* tied embedding: ``encoder.embed_tokens.weight``, ``decoder.embed_tokens.weight`` and
  ``decoder.output_projection.weight`` are one tensor. The reference stores three identical
  copies (accepted; they must be equal); any one of them suffices; ``save_pretrained`` stores
  only the encoder's.
* derived index buffers (``token_rp_bucket``, ``image_rp_bucket``, ``image_position_idx``) are
  computed from the config. If a checkpoint carries them they must equal ours and are dropped.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from unicon.data.jsonl import read_json
from unicon.errors import UserError

from .configuration_ofa import OFAConfig, check_config_dict

logger = logging.getLogger(__name__)

SAFE_NAME = "model.safetensors"
PICKLE_NAME = "pytorch_model.bin"
CONFIG_NAME = "config.json"
TIED_ALIASES = ("decoder.embed_tokens.weight", "decoder.output_projection.weight")
CANONICAL_EMBEDDING = "encoder.embed_tokens.weight"
DERIVED_SUFFIXES = (".token_rp_bucket", ".image_rp_bucket", ".image_position_idx")


class CheckpointError(UserError, ValueError):
    """A checkpoint that does not fit the model (missing/unexpected keys, shapes, unsafe format)."""


def read_safetensors(file: Path) -> dict[str, torch.Tensor]:
    """``safetensors.torch.load_file`` with a one-line error naming a truncated or foreign file."""
    try:
        return load_file(file)
    except Exception as e:  # SafetensorError, or OSError for an unreadable file
        raise CheckpointError(f"{file}: not a readable safetensors file ({str(e).splitlines()[0]}); "
                              "truncated or corrupt?") from None


def read_config(path: str | Path) -> OFAConfig:
    """``OFAConfig`` from ``<dir>/config.json``, refusing other architectures by the field that shows it."""
    file = Path(path) / CONFIG_NAME
    if not file.is_file():
        raise FileNotFoundError(f"{file}: no config.json in the checkpoint directory")
    data = read_json(file, CheckpointError, "model config")
    check_config_dict(data, source=str(file))
    return OFAConfig.from_dict(data, _source=str(file))


def read_state_dict(path: str | Path, allow_pickle: bool = False) -> tuple[dict[str, torch.Tensor], Path]:
    """Tensors of ``model.safetensors`` (or, with ``allow_pickle``, of ``pytorch_model.bin``,
    converted once to ``model.safetensors``), and the file they came from."""
    path = Path(path)
    safe, pickle_file = path / SAFE_NAME, path / PICKLE_NAME
    if safe.is_file():
        return read_safetensors(safe), safe
    if pickle_file.is_file():
        if not allow_pickle:
            raise CheckpointError(
                f"{pickle_file}: refusing to unpickle a checkpoint (loading it could run code); if you trust it, "
                "opt in with model.allow_pickle=true (unicon train) or --allow-pickle (unicon evaluate) to read "
                f"it once and convert it to {SAFE_NAME}"
            )
        state = torch.load(pickle_file, map_location="cpu", weights_only=True)
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise CheckpointError(
                f"{pickle_file}: not a flat state_dict of tensors (a fairseq OFA checkpoint? convert it to "
                f"the OFA-Sys transformers layout first)"
            )
        # drop aliases that share memory (safetensors refuses them); the canonical copy is kept
        seen: dict[int, str] = {}
        unique = {}
        for key, value in state.items():
            ptr = value.data_ptr() if value.numel() else -1
            if ptr in seen and ptr != -1:
                continue
            seen[ptr] = key
            unique[key] = value.contiguous()
        save_file(unique, safe, metadata={"format": "pt", "converted_from": PICKLE_NAME})
        logger.warning("converted %s to %s (%d tensors); later loads read the safetensors file",
                       pickle_file, safe, len(unique))
        return read_safetensors(safe), safe
    raise FileNotFoundError(f"{path}: neither {SAFE_NAME} nor {PICKLE_NAME} found")


def map_state_dict(
    state: dict[str, torch.Tensor], model: torch.nn.Module, source: str
) -> dict[str, torch.Tensor]:
    """Map checkpoint keys onto ``model.state_dict()`` keys exactly, or raise ``CheckpointError``."""
    expected = model.state_dict()
    prefix = "model." if next(iter(expected)).startswith("model.") else ""
    has_prefix = all(k.startswith("model.") for k in state)
    mapped = {}
    for key, value in state.items():
        bare = key[len("model."):] if has_prefix else key
        mapped[prefix + bare] = value

    for key in [k for k in mapped if k.endswith(DERIVED_SUFFIXES)]:
        value = mapped.pop(key)
        ours = dict(model.named_buffers()).get(key)
        if ours is None or ours.shape != value.shape or not torch.equal(ours.cpu(), value.to(ours.dtype)):
            raise CheckpointError(
                f"{source}: derived buffer {key!r} differs from the one computed from config.json"
            )

    tied = [prefix + k for k in (CANONICAL_EMBEDDING, *TIED_ALIASES)]
    present = [k for k in tied if k in mapped]
    if present:  # the first stored copy stands for all three
        for key in present[1:]:
            if not torch.equal(mapped[key], mapped[present[0]]):
                raise CheckpointError(
                    f"{source}: {key!r} should be tied to {present[0]!r} but the values differ"
                )
        for key in tied:
            mapped[key] = mapped[present[0]]

    missing = [k for k in expected if k not in mapped]
    unexpected = [k for k in mapped if k not in expected]
    if missing or unexpected:
        raise CheckpointError(
            f"{source}: keys do not match {type(model).__name__}: "
            f"first missing {missing[0] if missing else None!r} ({len(missing)} missing), "
            f"first unexpected {unexpected[0] if unexpected else None!r} ({len(unexpected)} unexpected)"
        )
    for key, value in expected.items():
        if mapped[key].shape != value.shape:
            raise CheckpointError(
                f"{source}: {key!r} has shape {tuple(mapped[key].shape)}, "
                f"the model expects {tuple(value.shape)}"
            )
    return mapped


def load_pretrained(cls, path: str | Path, allow_pickle: bool = False, config: OFAConfig | None = None,
                    dtype: torch.dtype | None = None, device: str | torch.device | None = None,
                    attn_implementation: str | None = None):
    """Build ``cls(config)`` and load the directory's weights with exact key matching.

    ``attn_implementation``: ``"sdpa"`` (default) or ``"eager"`` (bitwise reference order).
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: OFA checkpoint directory not found")
    config = config if config is not None else read_config(path)
    if attn_implementation is not None:
        if attn_implementation not in ("sdpa", "eager"):
            raise ValueError(f"attn_implementation must be 'sdpa' or 'eager', got {attn_implementation!r}")
        config._attn_implementation = attn_implementation
    state, file = read_state_dict(path, allow_pickle)
    model = cls(config)
    model.load_state_dict(map_state_dict(state, model, str(file)), strict=True)
    model.eval()
    if dtype is not None or device is not None:
        model.to(device=device, dtype=dtype)
    return model


def save_pretrained(model, path: str | Path) -> None:
    """Write ``config.json`` and ``model.safetensors`` (the tied embedding once)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = model.config.to_dict()
    (path / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    state = {
        k: v.detach().cpu().contiguous()
        for k, v in model.state_dict().items()
        if not k.endswith(TIED_ALIASES)
    }
    save_file(state, path / SAFE_NAME, metadata={"format": "pt"})
