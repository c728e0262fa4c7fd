"""Unified model backends behind one interface (``base.UnifiedModel``), and the two ways to get one.

Backends are registered classes (:mod:`unicon.models.registry`): this package imports the in-tree
backend modules (OFA, Janus, and the VQGAN image tokenizer) so that their decorators run; plugins
come through the ``unicon.backends`` entry points. This package imports ``unicon.core``,
``unicon.config`` and ``unicon.data.jsonl``, never a world: a from-scratch model gets its
vocabulary from the world directory it is given, and a saved model's image tokenizer is rebuilt
through the registry of :mod:`unicon.core`.

* :func:`build_model` -- a fresh (or ``pretrained``) model from the ``model:`` config section.
* :func:`load_model` -- any checkpoint a user holds: a ``save_pretrained`` directory, an
  OFA-Sys checkpoint directory, a Lightning ``.ckpt`` written by ``unicon train``, or the
  ``.ckpt`` *folder* a DeepSpeed run writes (ZeRO-2/3 shards, converted by Lightning's
  ``convert_zero_checkpoint_to_fp32_state_dict``; :func:`read_deepspeed_checkpoint`).

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

import json
import logging
import tempfile
from pathlib import Path
from typing import Any

import torch

from unicon.core import config_dict, torch_dtype
from unicon.errors import UserError
from unicon.models import decoupled, janus, vqgan  # noqa: F401  (in-tree backends and image tokenizers register on import)
from unicon.models.base import UnifiedModel
from unicon.models.ofa import unified  # noqa: F401
from unicon.models.registry import backend_class, backend_for_model_type

logger = logging.getLogger(__name__)

__all__ = ["UnifiedModel", "apply_model_options", "build_model", "check_same_architecture", "is_deepspeed_checkpoint",
           "load_model", "read_deepspeed_checkpoint", "read_training_checkpoint", "recorded_model_section"]


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


def load_model(path: str | Path, **kwargs) -> UnifiedModel:
    """Any unicon/OFA checkpoint -> a ready :class:`UnifiedModel` (eval mode).

    ``path`` is a ``save_pretrained`` directory (``unicon_model.json`` names the backend), an
    OFA-Sys checkpoint directory (``config.json`` with ``model_type: ofa`` + BPE files), a
    Lightning ``.ckpt`` from ``unicon train`` (its ``unicon_config`` rebuilds the model, whose
    weights are the ``model.``-prefixed state-dict entries), or the checkpoint folder of a
    DeepSpeed run (``<run_dir>/last.ckpt/`` with ``latest`` and the ZeRO-2/3 shards), converted to
    the same ``.ckpt`` dict by :func:`read_deepspeed_checkpoint`. ``kwargs``: ``world_root``
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
    elif is_deepspeed_checkpoint(p):
        model = load_lightning_checkpoint(p, **kwargs)[0]
    else:
        model = _load_directory(p, **kwargs)
    return model.eval()


def _load_directory(p: Path, **kwargs) -> UnifiedModel:
    meta = p / "unicon_model.json"
    if meta.is_file():
        backend = _json_object(meta).get("backend", "ofa")
    elif (p / "config.json").is_file():
        model_type = _json_object(p / "config.json").get("model_type")
        backend = backend_for_model_type(model_type)
        if backend is None:
            raise UserError(f"{p}: not a unicon model directory (no unicon_model.json, and config.json "
                            f"model_type is {model_type!r})")
    else:
        raise UserError(f"{p}: not a unicon model directory (no unicon_model.json or config.json)")
    kwargs.pop("world_root", None)  # a saved directory holds its own vocabulary and image tokenizer spec
    map_location = kwargs.pop("map_location", None)
    model = backend_class(backend).from_pretrained(str(p), **kwargs)
    return model.to(map_location) if map_location else model


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
        return config_dict(checkpoint_config(read_training_checkpoint(p, allow_pickle=allow_pickle), p).model)
    if is_deepspeed_checkpoint(p):  # the config is in the client state: no conversion needed
        return config_dict(checkpoint_config(deepspeed_client_state(p), p).model)
    record = p / TRAINING_CONFIG_NAME
    if record.is_file():
        section = _json_object(record).get("model")
        return section if isinstance(section, dict) else None
    return None


def check_same_architecture(model_cfg: Any, recorded: dict | None, source: str | Path, backend: str | None = None) -> None:
    """Refuse a ``model:`` config section that describes another network than checkpoint ``source``
    holds (``recorded``: its model section, see :func:`recorded_model_section`; ``backend``: the
    loaded model's backend, checked when nothing was recorded)."""
    mine = config_dict(model_cfg)
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


PICKLE_OPT_IN = "model.allow_pickle=true (unicon train) or --allow-pickle (unicon evaluate)"


def _first_line(e: BaseException) -> str:
    """The first line of an exception's message (torch's load errors run to many lines), or its type."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _unreadable(path: Path, e: BaseException) -> UserError:
    """The one-line error for a file ``torch.load`` cannot read at all (truncated, corrupt, not a checkpoint)."""
    return UserError(f"{path}: not a readable PyTorch checkpoint ({_first_line(e)}); truncated or corrupt?")


def read_training_checkpoint(p: str | Path, map_location: str = "cpu", allow_pickle: bool = False,
                             mmap: bool = False) -> dict:
    """The dict of a Lightning ``.ckpt`` written by ``unicon train``, loaded with ``weights_only=True``;
    for a DeepSpeed checkpoint folder, :func:`resumable_deepspeed_state` (the dict without the
    weights, which DeepSpeed's engine loads itself).

    Such a checkpoint holds only tensors and plain containers, so it never needs unpickling of
    arbitrary objects. A file that does (which can run code while it loads) is refused unless
    ``allow_pickle``; a truncated or foreign file gets a one-line error naming it. ``mmap`` maps
    the tensors instead of reading them (cheap when only the config is needed).
    """
    import pickle

    p = Path(p)
    if not p.exists():
        raise UserError(f"checkpoint {p} does not exist")
    if is_deepspeed_checkpoint(p):
        return resumable_deepspeed_state(p, allow_pickle)
    if p.is_dir():
        raise UserError(f"{p} is a directory (a save_pretrained export?); expected a Lightning .ckpt file "
                        "written by unicon train, e.g. <run_dir>/last.ckpt")
    try:
        ckpt = torch.load(p, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        if "Weights only load failed" not in _first_line(e):
            raise _unreadable(p, e) from None
        if not allow_pickle:
            raise UserError(f"{p}: refusing to unpickle Python objects stored in this checkpoint (loading it could "
                            f"run code); if you trust the file, opt in with {PICKLE_OPT_IN}") from None
        logger.warning("%s: unpickling with weights_only=False (allow_pickle)", p)
        ckpt = torch.load(p, map_location=map_location, weights_only=False)
    except Exception as e:  # noqa: BLE001 -- the weights-only unpickler runs no code, but on arbitrary
        # bytes it fails with whatever the opcodes it misreads raise (IndexError, KeyError, struct.error, ...)
        raise _unreadable(p, e) from None
    if not isinstance(ckpt, dict) or "unicon_config" not in ckpt or "state_dict" not in ckpt:
        raise UserError(f"{p}: not a unicon training checkpoint (missing 'unicon_config' or 'state_dict')")
    return ckpt


# ---- DeepSpeed checkpoint folders ---------------------------------------------------------------
# Under a DeepSpeed strategy Lightning's ModelCheckpoint writes ``<name>.ckpt/`` as a folder:
# ``latest`` (the tag, "checkpoint"), ``<tag>/mp_rank_00_model_states.pt`` (ZeRO-2: the module's
# weights; ZeRO-3: one ``zero_pp_rank_<r>_mp_rank_00_model_states.pt`` per rank) holding Lightning's
# checkpoint dict without ``state_dict`` (DeepSpeed's "client state": our ``unicon_config``, loops,
# ``global_step``, ...), and ``zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` per rank (the fp32
# master weights' partitions and the optimizer state).
DEEPSPEED_TAG_FILE = "latest"
#: written by ``unicon train`` (training.zero.ZeroStrategy) into a DeepSpeed checkpoint folder once
#: every rank finished writing it, and removed before the next save into the same folder begins
DEEPSPEED_COMPLETE_FILE = "complete.json"


def is_deepspeed_checkpoint(path: str | Path) -> bool:
    """A folder written by DeepSpeed's ``save_checkpoint`` (a ``latest`` file naming its tag folder)."""
    p = Path(path)
    return p.is_dir() and (p / DEEPSPEED_TAG_FILE).is_file()


def _deepspeed_tag_dir(p: Path) -> Path:
    tag = (p / DEEPSPEED_TAG_FILE).read_text().strip()
    tag_dir = p / tag
    if not tag or not tag_dir.is_dir():
        raise UserError(f"{p / DEEPSPEED_TAG_FILE} names the tag {tag!r}, but {tag_dir} is not a folder: "
                        "an incomplete DeepSpeed checkpoint?")
    models = sorted(tag_dir.glob("*model_states.pt"))
    optims = sorted(tag_dir.glob("*optim_states.pt"))
    if not models or not optims:
        raise UserError(f"{tag_dir}: a DeepSpeed checkpoint needs *model_states.pt and *optim_states.pt files, found "
                        f"{[f.name for f in models + optims] or 'neither'}")
    return tag_dir


def _deepspeed_safe_globals() -> list:
    """The classes DeepSpeed pickles into its checkpoint files besides tensors and containers (the
    loss scaler objects, the ZeRO stage enum and the parameter-fragment addresses of the optimizer
    state): data holders, whose unpickling runs no code of the file's choosing."""
    try:
        from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
        from deepspeed.runtime.zero.config import ZeroStageEnum
        from deepspeed.utils.tensor_fragment import fragment_address
    except ImportError as e:
        raise UserError(f"reading a DeepSpeed checkpoint folder needs deepspeed ({e}); "
                        "pip install -c constraints.txt -e '.[deepspeed]'") from None
    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def _load_deepspeed_file(f: Path, allow_pickle: bool):
    """``torch.load(f, weights_only=True)`` with DeepSpeed's data classes allowed (memory-mapped, so
    a large optimizer shard is not read); a file that needs anything else is refused unless
    ``allow_pickle``. Returns the loaded object, or None when it was let through by ``allow_pickle``."""
    import pickle

    try:
        with torch.serialization.safe_globals(_deepspeed_safe_globals()):
            return torch.load(f, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as e:
        if "Weights only load failed" not in _first_line(e):
            raise _unreadable(f, e) from None
        if not allow_pickle:
            lines = str(e).strip().splitlines()
            why = next((ln.strip() for ln in lines if "Unsupported global" in ln), lines[0])
            raise UserError(f"{f}: refusing to unpickle Python objects stored in this DeepSpeed checkpoint file "
                            f"({why[:200]}; loading it could run code); if you trust the folder, opt in with "
                            f"{PICKLE_OPT_IN}") from None
        logger.warning("%s: unpickling with weights_only=False (allow_pickle)", f)
        return None
    except Exception as e:  # noqa: BLE001 -- as in read_training_checkpoint: garbage fails in any way
        raise _unreadable(f, e) from None


def deepspeed_client_state(path: str | Path, allow_pickle: bool = False) -> dict:
    """Rank 0's model-states file of a DeepSpeed checkpoint folder: Lightning's checkpoint dict
    without the weights (``unicon_config``, ``global_step``, loops, ...). Cheap (memory-mapped)."""
    p = Path(path)
    tag_dir = _deepspeed_tag_dir(p)
    first = next(f for f in (tag_dir / "mp_rank_00_model_states.pt", tag_dir / "zero_pp_rank_0_mp_rank_00_model_states.pt",
                             *sorted(tag_dir.glob("*model_states.pt"))) if f.is_file())
    state = _load_deepspeed_file(first, allow_pickle)
    if state is None:  # allowed to unpickle
        state = torch.load(first, map_location="cpu", weights_only=False)
    if not isinstance(state, dict) or "unicon_config" not in state:
        raise UserError(f"{p}: not a unicon training checkpoint ({first.name} has no 'unicon_config')")
    return state


def deepspeed_checkpoint_step(path: str | Path) -> int | None:
    """The global step recorded in a DeepSpeed checkpoint folder's ``complete.json``, or None when
    the folder has none (a save cut short, or a folder not written by ``unicon train``)."""
    marker = Path(path) / DEEPSPEED_COMPLETE_FILE
    try:
        return int(json.loads(marker.read_text())["global_step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def resumable_deepspeed_state(path: str | Path, allow_pickle: bool = False) -> dict:
    """The client state (:func:`deepspeed_client_state`) of a DeepSpeed checkpoint folder that a run
    can resume from: complete (:func:`deepspeed_checkpoint_step` agrees with the stored step) and
    holding nothing but tensors, containers and DeepSpeed's data classes in any of its files
    (checked before anything unpickles; ``allow_pickle`` lets other objects through)."""
    p = Path(path)
    step = deepspeed_checkpoint_step(p)
    if step is None:
        raise UserError(f"{p}: an incomplete DeepSpeed checkpoint (no {DEEPSPEED_COMPLETE_FILE}: its save was cut "
                        "short, or it was not written by unicon train); resume from another checkpoint of the run")
    for f in sorted(_deepspeed_tag_dir(p).glob("*.pt")):
        _load_deepspeed_file(f, allow_pickle)
    state = deepspeed_client_state(p, allow_pickle)
    if int(state.get("global_step", -1)) != step:
        raise UserError(f"{p}: {DEEPSPEED_COMPLETE_FILE} says step {step}, its files step {state.get('global_step')}: "
                        "an incomplete DeepSpeed checkpoint")
    return state


def read_deepspeed_checkpoint(path: str | Path, allow_pickle: bool = False) -> dict:
    """A DeepSpeed checkpoint folder (ZeRO-2 or ZeRO-3, any number of ranks) -> the dict of a
    Lightning ``.ckpt`` (:func:`read_training_checkpoint`'s result): Lightning's
    ``convert_zero_checkpoint_to_fp32_state_dict`` gathers the fp32 master weights from every
    rank's partition (DeepSpeed's ``zero_to_fp32``) into ``state_dict`` and keeps the client state.

    That converter unpickles every file (``weights_only=False``), so each file is first loaded
    with ``weights_only=True`` and only DeepSpeed's loss-scaler and ZeRO-stage classes allowed
    (memory-mapped: the shards are not read); a file holding anything else is refused unless
    ``allow_pickle``. The converted dict is not written anywhere (the converter's output file is
    ``os.devnull``): to keep one, call Lightning's function yourself.
    """
    import os

    p = Path(path)
    if not p.exists():
        raise UserError(f"checkpoint {p} does not exist")
    if not is_deepspeed_checkpoint(p):
        raise UserError(f"{p}: not a DeepSpeed checkpoint folder (no {DEEPSPEED_TAG_FILE!r} file)")
    tag_dir = _deepspeed_tag_dir(p)
    for f in sorted(tag_dir.glob("*.pt")):
        _load_deepspeed_file(f, allow_pickle)  # refuses foreign objects before anything unpickles
    from lightning.pytorch.utilities.deepspeed import convert_zero_checkpoint_to_fp32_state_dict

    try:
        ckpt = convert_zero_checkpoint_to_fp32_state_dict(str(p), os.devnull)
    except (ValueError, FileNotFoundError, KeyError, IndexError, AssertionError) as e:
        raise UserError(f"{p}: DeepSpeed checkpoint conversion failed ({type(e).__name__}: {e})") from None
    if "unicon_config" not in ckpt or "state_dict" not in ckpt:
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
    """A ``unicon train`` ``.ckpt`` (or DeepSpeed checkpoint folder) -> ``(model, run config)``; LoRA
    adapters are re-applied, unmerged."""
    p = Path(p)
    if is_deepspeed_checkpoint(p):
        ckpt = read_deepspeed_checkpoint(p, allow_pickle)
    else:
        ckpt = read_training_checkpoint(p, map_location, allow_pickle)
    model, cfg = checkpoint_network(ckpt, p, world_root)
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


def checkpoint_network(ckpt: dict, p: str | Path, world_root: str | Path | None = None):
    """``(model, run config)``: the network a training checkpoint's dict describes, with freshly
    initialised weights (LoRA adapters applied, unmerged). The architecture comes from the run's
    model section (a ``pretrained`` directory is read for its config and tokenizer, a world's
    vocabulary from the copy stored in the checkpoint, unless ``world_root`` names one)."""
    from unicon.models.lora import apply_lora

    cfg = checkpoint_config(ckpt, p)
    stored = ckpt.get("unicon_world_files") or {}
    if world_root is None and stored:
        known = getattr(backend_class(cfg.model.backend), "world_vocabulary_files", ())
        unknown = sorted(set(stored) - set(known))
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
    return model, cfg
