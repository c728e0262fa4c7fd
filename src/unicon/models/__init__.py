"""Unified model backends behind one interface (``base.UnifiedModel``), and the two ways to get one.

* :func:`build_model` -- a fresh (or ``pretrained``) model from the ``model:`` config section.
* :func:`load_model` -- any checkpoint a user holds: a ``save_pretrained`` directory, an
  OFA-Sys checkpoint directory, or a Lightning ``.ckpt`` written by ``unicon train``.

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
``ShapesTokenizer``; ``vocab_size`` is then text + codes + bins.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Any

import torch

from unicon.errors import UserError
from unicon.models.base import UnifiedModel

logger = logging.getLogger(__name__)

__all__ = ["UnifiedModel", "apply_model_options", "build_model", "check_same_architecture", "load_model",
           "read_training_checkpoint", "recorded_model_section", "weights_fingerprint"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _as_dict(cfg: Any) -> dict:
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(cfg, DictConfig):
            return OmegaConf.to_container(cfg, resolve=True)
    except ImportError:  # pragma: no cover
        pass
    if hasattr(cfg, "__dataclass_fields__"):
        from dataclasses import asdict

        return asdict(cfg)
    return dict(cfg)


def build_model(model_cfg: Any, world_root: str | Path | None = None) -> UnifiedModel:
    """The model described by a ``model:`` config section (``unicon.config.ModelConfig``)."""
    cfg = _as_dict(model_cfg)
    backend = cfg.get("backend", "ofa")
    if backend == "ofa":
        model = _build_ofa(cfg, world_root)
    elif backend == "janus":
        from unicon.models.janus import JanusUnifiedModel

        model = JanusUnifiedModel.from_config(model_cfg)
    else:
        raise UserError(f"model.backend {backend!r} is unknown; expected 'ofa' or 'janus'")
    return apply_model_options(model, cfg)


def apply_model_options(model: UnifiedModel, model_cfg: Any) -> UnifiedModel:
    """``model.dtype``, ``model.freeze_batchnorm`` and ``model.freeze`` of a config section, applied
    to a built or loaded model (``build_model`` does it; a run started ``init_from`` a checkpoint too)."""
    cfg = _as_dict(model_cfg)
    dtype = cfg.get("dtype", "float32")
    if dtype not in DTYPES:
        raise UserError(f"model.dtype {dtype!r} is not one of {sorted(DTYPES)}")
    if DTYPES[dtype] != torch.float32:
        model.to(DTYPES[dtype])
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


def _build_ofa(cfg: dict, world_root: str | Path | None) -> UnifiedModel:
    from unicon.models.ofa.configuration_ofa import OFA_PRESETS, preset_config
    from unicon.models.ofa.modeling_ofa import OFAModel
    from unicon.models.ofa.unified import OFAUnifiedModel, OFAWrapperConfig

    arch = dict(cfg.get("arch") or {})
    wrapper_keys = set(OFAWrapperConfig.__dataclass_fields__) - {"image_tokenizer", "backend"}
    settings = {k: arch.pop(k) for k in list(arch) if k in wrapper_keys}
    num_bins = arch.pop("num_bins", None)

    if cfg.get("pretrained"):
        if arch or num_bins is not None:
            raise UserError(f"model.arch keys {sorted(arch) + (['num_bins'] if num_bins else [])} cannot change "
                            f"the architecture of the pretrained model {cfg['pretrained']}")
        return OFAUnifiedModel.from_pretrained(cfg["pretrained"], settings=settings,
                                               allow_pickle=cfg.get("allow_pickle", False))

    preset = cfg.get("preset")
    if preset is None:
        raise UserError("model.preset is required for backend 'ofa' without model.pretrained "
                        f"(one of {sorted(OFA_PRESETS)})")
    if preset not in OFA_PRESETS:
        raise UserError(f"model.preset {preset!r} is unknown; choose one of {sorted(OFA_PRESETS)}")
    if world_root is None:
        raise UserError(f"model preset {preset!r} from scratch needs a world (data.root) for its vocabulary")
    tokenizer, image_tokenizer = _world_vocab(Path(world_root), num_bins or 1000,
                                              settings.get("max_target_length", 128))
    try:
        config = preset_config(preset, **arch, vocab_size=len(tokenizer))
    except (TypeError, ValueError) as e:
        raise UserError(f"model.arch: {e}") from None
    image_size = settings.pop("image_size", None) or config.patch_image_size or 64
    grid = image_tokenizer.grid_size[0]
    if config.code_image_size // 8 != grid:
        raise UserError(f"model.arch.code_image_size {config.code_image_size} gives a {config.code_image_size // 8}"
                        f"-wide decoder code grid, but the world's image tokenizer is {grid}x{grid}")
    spec = {"type": "shapes", "world": _world_config_dict(image_tokenizer)}
    wrapper = OFAWrapperConfig.from_dict({**settings, "image_size": image_size, "image_tokenizer": spec})
    return OFAUnifiedModel(OFAModel(config), tokenizer, wrapper, image_tokenizer)


def _world_vocab(root: Path, num_bins: int, max_length: int):
    """(OFATokenizer, ShapesTokenizer) of the ShapesWorld world at ``root``."""
    from unicon.models.ofa.tokenization import OFATokenizer
    from unicon.worlds.shapes import ShapesTokenizer, load_world

    if not (root / "tokenizer.json").is_file():
        raise UserError(f"{root}: no ShapesWorld tokenizer.json (build it: unicon build-data shapes --out {root})")
    world = load_world(root)
    image_tokenizer = ShapesTokenizer(world.config)
    tokenizer = OFATokenizer.from_file(root / "tokenizer.json", image_tokenizer.codebook_size, num_bins,
                                       max_length=max(max_length + 1, 128))
    return tokenizer, image_tokenizer


def _world_config_dict(image_tokenizer) -> dict:
    cfg = image_tokenizer.cfg if hasattr(image_tokenizer, "cfg") else image_tokenizer.config
    if hasattr(cfg, "to_dict"):
        return cfg.to_dict()
    from dataclasses import asdict

    return asdict(cfg)


def load_model(path: str | Path, **kwargs) -> UnifiedModel:
    """Any unicon/OFA checkpoint -> a ready :class:`UnifiedModel` (eval mode).

    ``path`` is a ``save_pretrained`` directory (``unicon_model.json`` names the backend), an
    OFA-Sys checkpoint directory (``config.json`` with ``model_type: ofa`` + BPE files), or a
    Lightning ``.ckpt`` from ``unicon train`` (its ``unicon_config`` rebuilds the model, whose
    weights are the ``model.``-prefixed state-dict entries). ``kwargs``: ``world_root``
    (a ShapesWorld whose vocabulary to use; default: the copy stored in the checkpoint, else the
    run's ``data.root``), ``map_location``, and
    for directories the backend's ``from_pretrained`` options (e.g. ``allow_pickle``).
    """
    p = Path(path)
    if not p.exists():
        raise UserError(f"checkpoint {p} does not exist")
    if p.is_file():
        if p.suffix != ".ckpt":
            raise UserError(f"{p}: expected a Lightning .ckpt file or a save_pretrained directory")
        model = load_lightning_checkpoint(p, **kwargs)[0]
    else:
        model = _load_directory(p, **kwargs)
    return model.eval()


def _load_directory(p: Path, **kwargs) -> UnifiedModel:
    meta = p / "unicon_model.json"
    backend = None
    if meta.is_file():
        backend = _json_object(meta).get("backend", "ofa")
    elif (p / "config.json").is_file():
        backend = _json_object(p / "config.json").get("model_type")
        backend = "ofa" if backend == "ofa" else backend
    if backend == "ofa":
        from unicon.models.ofa.unified import OFAUnifiedModel

        kwargs.pop("world_root", None)  # the directory holds its own vocabulary and world config
        map_location = kwargs.pop("map_location", None)
        model = OFAUnifiedModel.from_pretrained(str(p), **kwargs)
        return model.to(map_location) if map_location else model
    if backend == "janus" or (backend or "").startswith("multi_modality"):
        from unicon.models.janus import JanusUnifiedModel

        return JanusUnifiedModel.from_pretrained(str(p), **kwargs)
    raise UserError(f"{p}: not a unicon model directory (no unicon_model.json, and config.json "
                    f"model_type is {backend!r})")


def _json_object(path: Path) -> dict:
    from unicon.data.jsonl import read_json

    data = read_json(path, what="model metadata")
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a JSON object")
    return data


# ---- what a checkpoint says about the model it holds ----------------------------------------------
TRAINING_CONFIG_NAME = "training_config.json"  # written into exports by unicon.training.checkpoints
ARCHITECTURE_KEYS = ("backend", "preset", "pretrained", "arch")  # the model section's keys that fix the network


def recorded_model_section(path: str | Path, allow_pickle: bool = False) -> dict | None:
    """The ``model:`` section of the run that produced a checkpoint: a ``.ckpt``'s stored config, or
    an export's ``training_config.json``; ``None`` for directories without one (OFA-Sys, older exports)."""
    p = Path(path)
    if p.is_file():
        return _as_dict(checkpoint_config(read_training_checkpoint(p, allow_pickle=allow_pickle), p).model)
    record = p / TRAINING_CONFIG_NAME
    if record.is_file():
        section = _json_object(record).get("model")
        return section if isinstance(section, dict) else None
    return None


def check_same_architecture(model_cfg: Any, recorded: dict | None, source: str | Path, backend: str | None = None) -> None:
    """Refuse a ``model:`` config section that describes another network than checkpoint ``source``
    holds (``recorded``: its model section, see :func:`recorded_model_section`; ``backend``: the
    loaded model's backend, checked when nothing was recorded)."""
    mine = _as_dict(model_cfg)
    if recorded is None:
        if backend is not None and mine.get("backend") != backend:
            raise UserError(f"model.backend={mine.get('backend')!r} but init_from {source} holds a {backend!r} model; "
                            f"choose the matching model= group or drop init_from")
        return
    def flat(section: dict) -> dict:
        out = {k: section.get(k) or None for k in ARCHITECTURE_KEYS if k != "arch"}
        out.update({f"arch.{k}": v for k, v in (section.get("arch") or {}).items()})
        return out

    a, b = flat(mine), flat(recorded)
    diffs = [f"{k}: {a.get(k)!r} vs {b.get(k)!r}" for k in sorted(set(a) | set(b), key=lambda k: (k.startswith("arch."), k))
             if a.get(k) != b.get(k)]
    if diffs:
        diffs = diffs[:4] + ([f"{len(diffs) - 4} more"] if len(diffs) > 4 else [])
        raise UserError(f"the model section differs from the init_from checkpoint {source} ({'; '.join(diffs)}; "
                        "config vs checkpoint): drop the model= choice / model.* overrides, or init_from")


def weights_fingerprint(model: torch.nn.Module) -> str:
    """A hash of a model's weights: BLAKE2b over every parameter and buffer (name, dtype, shape and
    bytes, in name order). Equal weights give equal fingerprints on any machine; it reads every
    byte once (about a second per few GB). Evaluation outputs record it so that a resumed
    evaluation can refuse to continue under another model."""
    import hashlib

    h = hashlib.blake2b(digest_size=16)
    state = model.state_dict()
    for name in sorted(state):
        t = state[name].detach()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        if t.numel():
            h.update(t.contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


WORLD_VOCABULARY_FILES = ("tokenizer.json", "world.json")


def world_vocabulary(model_cfg: Any, world_root: str | Path | None) -> dict[str, str]:
    """Text of the world files a from-scratch OFA model's vocabulary comes from (``{}`` otherwise).

    ``unicon train`` stores them in every ``.ckpt`` (key ``unicon_world_files``), so a checkpoint
    loads without the world, and rebuilding the world cannot change an old run's vocabulary.
    """
    cfg = _as_dict(model_cfg)
    if cfg.get("backend", "ofa") != "ofa" or cfg.get("pretrained") or world_root is None:
        return {}
    root = Path(world_root)
    return {name: (root / name).read_text() for name in WORLD_VOCABULARY_FILES if (root / name).is_file()}


PICKLE_OPT_IN = "model.allow_pickle=true (unicon train) or --allow-pickle (unicon evaluate)"


def read_training_checkpoint(p: str | Path, map_location: str = "cpu", allow_pickle: bool = False,
                             mmap: bool = False) -> dict:
    """The dict of a Lightning ``.ckpt`` written by ``unicon train``, loaded with ``weights_only=True``.

    Such a checkpoint holds only tensors and plain containers, so it never needs unpickling of
    arbitrary objects. A file that does (which can run code while it loads) is refused unless
    ``allow_pickle``; a truncated or foreign file gets a one-line error naming it. ``mmap`` maps
    the tensors instead of reading them (cheap when only the config is needed).
    """
    import pickle
    import zipfile

    p = Path(p)
    if not p.exists():
        raise UserError(f"checkpoint {p} does not exist")
    if p.is_dir():
        raise UserError(f"{p} is a directory (a save_pretrained export?); expected a Lightning .ckpt file "
                        "written by unicon train, e.g. <run_dir>/last.ckpt")
    try:
        ckpt = torch.load(p, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if "Weights only load failed" not in first:
            raise UserError(f"{p}: not a readable PyTorch checkpoint ({first}); truncated or corrupt?") from None
        if not allow_pickle:
            raise UserError(f"{p}: refusing to unpickle Python objects stored in this checkpoint (loading it could "
                            f"run code); if you trust the file, opt in with {PICKLE_OPT_IN}") from None
        logger.warning("%s: unpickling with weights_only=False (allow_pickle)", p)
        ckpt = torch.load(p, map_location=map_location, weights_only=False)
    except (RuntimeError, EOFError, OSError, zipfile.BadZipFile, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"{p}: not a readable PyTorch checkpoint ({first}); truncated or corrupt?") from None
    if not isinstance(ckpt, dict) or "unicon_config" not in ckpt or "state_dict" not in ckpt:
        raise UserError(f"{p}: not a unicon training checkpoint (missing 'unicon_config' or 'state_dict')")
    return ckpt


def checkpoint_config(ckpt: dict, p: str | Path):
    """The validated run config stored in a training checkpoint."""
    from unicon.config import ConfigError, from_container

    try:
        return from_container(ckpt["unicon_config"], source=f"{p} (stored config)")
    except ConfigError as e:
        raise UserError(f"{p}: stored config is invalid: {e}") from None


def load_lightning_checkpoint(p: str | Path, world_root: str | Path | None = None, map_location: str = "cpu",
                              allow_pickle: bool = False, **kwargs):
    """A ``unicon train`` ``.ckpt`` -> ``(model, run config)``; LoRA adapters are re-applied, unmerged."""
    from unicon.models.lora import apply_lora

    p = Path(p)
    ckpt = read_training_checkpoint(p, map_location, allow_pickle)
    cfg = checkpoint_config(ckpt, p)
    # The architecture comes from the run's model section (a `pretrained` directory is read
    # for its config and tokenizer, a world's vocabulary from the copy stored in the checkpoint);
    # the weights are then replaced by the trained ones.
    stored = ckpt.get("unicon_world_files") or {}
    if world_root is None and stored:
        unknown = sorted(set(stored) - set(WORLD_VOCABULARY_FILES))
        if unknown:
            raise UserError(f"{p}: unexpected stored world files {unknown}")
        with tempfile.TemporaryDirectory() as tmp:
            for name, text in stored.items():
                (Path(tmp) / name).write_text(text)
            model = build_model(cfg.model, world_root=tmp)
    else:
        model = build_model(cfg.model, world_root=world_root or cfg.data.root)
    if cfg.model.lora.enabled:
        apply_lora(model, cfg.model.lora)
    state = {k[len("model."):]: v for k, v in ckpt["state_dict"].items() if k.startswith("model.")}
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as e:  # size mismatches
        detail = next((ln.strip() for ln in str(e).splitlines() if "size mismatch" in ln), str(e).splitlines()[0])
        raise UserError(f"{p}: weights do not fit the model its config describes ({detail}); "
                        "was it trained on another world's vocabulary? pass that world") from None
    if missing or unexpected:
        raise UserError(f"{p}: weights do not match the model; first missing: {missing[:1]}, "
                        f"first unexpected: {unexpected[:1]} ({len(missing)} missing, {len(unexpected)} unexpected)")
    return model, cfg
