"""Every model file in and out: checkpoints, exports and LoRA adapters, and what a run starts from.

The calls:

* :func:`load_model` -- any checkpoint a user holds -> a ready model: a ``save_pretrained``
  directory, an OFA-Sys checkpoint directory, a Lightning ``.ckpt`` written by ``unicon train``, or
  the ``.ckpt`` *folder* a DeepSpeed run writes (ZeRO-2/3 shards, converted by Lightning's
  ``convert_zero_checkpoint_to_fp32_state_dict``; :func:`read_deepspeed_checkpoint`).
* :func:`load_for_training` -- the model a ``unicon train`` run starts from: built from the
  ``model:`` section, or loaded from ``resume`` / ``init_from`` after one architecture check
  (:func:`check_same_architecture`), with the section's options, gradient checkpointing and LoRA.
* :func:`export_model` / :func:`export_checkpoint` -- a model / a ``.ckpt`` -> a ``save_pretrained``
  directory, LoRA adapters merged or dropped and also saved in PEFT's format
  (:func:`save_lora_adapter`), with the run's config as ``training_config.json``.

A Lightning ``.ckpt`` written by ``unicon train`` holds ``checkpoint["unicon_config"]`` (the
resolved RunConfig) and the ConsistencyModule's ``state_dict`` whose keys are ``model.<...>``.
With LoRA on (``model.lora.enabled``), the wrapped projections appear as
``<name>.base_layer.weight`` plus ``<name>.lora_A/B.default.weight``. The adapters of an export
go to ``<export>/adapter/`` in PEFT's format (``adapter_config.json`` +
``adapter_model.safetensors``), which ``peft.PeftModel.from_pretrained(base, "<export>/adapter")``
loads onto the run's base model (its ``init_from`` / ``model.pretrained``; with
``model.lora.merge_on_export=false`` the export itself). Checkpoints load with
``weights_only=True``; unpickling needs the user's consent (:data:`PICKLE_OPT_IN`).

Integrity: a ``.ckpt`` file and the ``*.pt`` files of a DeepSpeed folder are the zip archives
``torch.save`` writes, each member with a CRC-32 that ``torch.load`` does not check; every load of
their weights (resume, ``init_from``, ``unicon evaluate --ckpt``) checks them first
(:func:`check_archive`) and refuses a file that fails, naming it. Reads of the stored config alone
(``mmap=True``: composing a resume, choosing a requeue checkpoint) do not. A ``save_pretrained``
directory's ``model.safetensors`` has no checksum: its header and tensor sizes are checked as it
loads (a truncated file is refused), its bytes are not.

It may import :mod:`unicon.models.factory` (to build the network a checkpoint describes),
:mod:`unicon.models.lora` (PEFT mechanics), :mod:`unicon.models.registry`, ``unicon.core``,
``unicon.config`` and ``unicon.data.jsonl``; never a backend module or a world (a saved model's
image tokenizer is rebuilt through the registry of :mod:`unicon.core`), and nothing of training.
"""

from __future__ import annotations

import json
import logging
import tempfile
from pathlib import Path
from typing import Any

import torch

from unicon.config import ConfigError, from_container
from unicon.core import config_dict
from unicon.data.jsonl import read_json
from unicon.errors import UserError
from unicon.models import factory
from unicon.models.base import UnifiedModel
from unicon.models.lora import _TUNER_ATTRIBUTE, apply_lora, has_lora, merge_lora
from unicon.models.registry import backend_class, backend_for_model_type

logger = logging.getLogger(__name__)

__all__ = ["ADAPTER_DIR", "ARCHITECTURE_KEYS", "DEEPSPEED_COMPLETE_FILE", "DEEPSPEED_TAG_FILE", "PICKLE_OPT_IN",
           "TRAINING_CONFIG_NAME", "check_archive", "check_same_architecture", "checkpoint_config",
           "checkpoint_network",
           "deepspeed_checkpoint_step", "deepspeed_client_state", "export_checkpoint", "export_model",
           "is_deepspeed_checkpoint", "load_for_training", "load_lightning_checkpoint", "load_model",
           "read_deepspeed_checkpoint", "read_training_checkpoint", "recorded_model_section",
           "resumable_deepspeed_state", "save_lora_adapter"]


# ---- the calls -----------------------------------------------------------------------------------
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


def load_for_training(cfg: Any, resumed: dict | None = None) -> UnifiedModel:
    """The UnifiedModel a run of ``cfg`` (a RunConfig: its ``model``, ``data.root``, ``resume`` and
    ``init_from``) starts from, with the config's model options (dtype, freezing), gradient
    checkpointing and LoRA applied. ``resumed``: the dict of ``cfg.resume`` when the caller has read
    it already (:func:`read_training_checkpoint`, memory-mapped): the network and its weights come
    from it, with the archive checked (:func:`check_archive`), instead of from a second read.

    * ``resume``: the network the checkpoint holds (a ``.ckpt``'s weights are loaded, and restored
      by Lightning afterwards; a DeepSpeed folder's are not gathered: DeepSpeed's engine loads
      every rank's partition itself);
    * ``init_from``: a ``.ckpt``, a DeepSpeed folder or a ``save_pretrained`` / OFA-Sys directory,
      loaded with the vocabulary of ``data.root``;
    * neither: :func:`unicon.models.factory.build_model` of the ``model:`` section.

    A checkpoint whose recorded model section describes another network than ``cfg.model`` is
    refused (:func:`check_same_architecture`, run once, before the weights load; a directory that
    recorded none is checked for its backend once loaded).
    """
    model_cfg, allow_pickle = cfg.model, bool(cfg.model.allow_pickle)
    if cfg.resume or cfg.init_from:
        if cfg.resume:
            model = _resumed_network(cfg.resume, model_cfg, allow_pickle, resumed)
        else:
            model = _initial_model(cfg.init_from, model_cfg, cfg.data.root, allow_pickle)
        model = factory.apply_model_options(model, model_cfg).train()
    else:
        model = factory.build_model(model_cfg, cfg.data.root)
    if model_cfg.gradient_checkpointing:
        factory.enable_gradient_checkpointing(model)
    if model_cfg.lora.enabled and not has_lora(model):
        try:
            apply_lora(model, model_cfg.lora)
        except ValueError as e:
            raise UserError(str(e)) from None
    return model


def _resumed_network(path: str | Path, model_cfg: Any, allow_pickle: bool, ckpt: dict | None = None) -> UnifiedModel:
    """The network a checkpoint to resume from holds, its stored model section checked against
    ``model_cfg``; ``ckpt``: its dict, already read (:func:`load_for_training`)."""
    if is_deepspeed_checkpoint(path):
        # the network the folder's stored config and vocabulary describe; DeepSpeed's engine loads
        # every rank's partition of the weights itself, so none is gathered here
        state = ckpt if ckpt is not None else resumable_deepspeed_state(path, allow_pickle)
        for f in sorted(_deepspeed_tag_dir(Path(path)).glob("*.pt")):
            check_archive(f)
        return checkpoint_network(state, path, expected_model=model_cfg)[0]
    # the network the checkpoint holds (its weights are restored by Lightning afterwards)
    if ckpt is None:
        return load_lightning_checkpoint(path, allow_pickle=allow_pickle, expected_model=model_cfg)[0]
    check_archive(path)  # a memory-mapped read checks no CRC
    return _checkpoint_model(ckpt, Path(path), expected_model=model_cfg)[0]


def _initial_model(init_from: str | Path, model_cfg: Any, world_root: str | Path | None,
                   allow_pickle: bool) -> UnifiedModel:
    """The model of ``init_from``, its recorded model section checked against ``model_cfg`` once."""
    source = Path(init_from)
    if not source.exists():
        raise UserError(f"init_from: {init_from} does not exist")
    if source.is_file() and source.suffix != ".ckpt":
        inside = next((f" (the model directory {source.parent}?)" for name in ("unicon_model.json", "config.json")
                       if (source.parent / name).is_file()), "")
        raise UserError(f"init_from: {source} is not a checkpoint; expected a Lightning .ckpt written by unicon train, "
                        f"a DeepSpeed checkpoint folder or a model directory (save_pretrained or OFA-Sys){inside}")
    if source.is_file():  # a .ckpt: its stored config is checked before the network is built
        return load_lightning_checkpoint(source, world_root=world_root, allow_pickle=allow_pickle,
                                         expected_model=model_cfg)[0]
    recorded = recorded_model_section(source, allow_pickle=allow_pickle)
    if recorded is not None:
        check_same_architecture(model_cfg, recorded, source)  # before the (possibly large) load
    model = load_model(source, world_root=world_root, allow_pickle=allow_pickle)
    if recorded is None:  # nothing recorded (an OFA-Sys directory, an older export): the backend at least
        check_same_architecture(model_cfg, None, source, backend=getattr(model, "backend", None))
    return model


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


# ---- what a checkpoint says about the model it holds ----------------------------------------------
TRAINING_CONFIG_NAME = "training_config.json"  # written into exports by export_model
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


# ---- save_pretrained and OFA-Sys directories -------------------------------------------------------
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
    data = read_json(path, what="model metadata")
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a JSON object")
    return data


# ---- Lightning .ckpt files ----------------------------------------------------------------------
PICKLE_OPT_IN = "model.allow_pickle=true (unicon train) or --allow-pickle (unicon evaluate)"


def _first_line(e: BaseException) -> str:
    """The first line of an exception's message (torch's load errors run to many lines), or its type."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _unreadable(path: Path, e: BaseException) -> UserError:
    """The one-line error for a file ``torch.load`` cannot read at all (truncated, corrupt, not a checkpoint)."""
    return UserError(f"{path}: not a readable PyTorch checkpoint ({_first_line(e)}); truncated or corrupt?")


def check_archive(path: str | Path) -> None:
    """Refuse a ``torch.save`` zip archive (a ``.ckpt``, a DeepSpeed ``*.pt``) that fails its
    integrity check: every member (the pickled structure, one record per tensor) is read and its
    CRC-32 compared (``zipfile.ZipFile.testzip``), one pass over the file. ``torch.load`` checks
    none of them, so a file with bytes zeroed or flipped inside a tensor (a disk error, a copy cut
    short) would load with other weights. One line naming the file and the first bad member."""
    import zipfile

    p = Path(path)
    try:
        with zipfile.ZipFile(p) as archive:
            bad = archive.testzip()
    except Exception as e:  # noqa: BLE001 -- a damaged archive fails in many ways (BadZipFile, zlib.error, ...)
        raise UserError(f"{p}: the checkpoint archive fails its integrity check ({_first_line(e)}); the file is "
                        "corrupt: copy it again, or use another checkpoint") from None
    if bad is not None:
        raise UserError(f"{p}: the checkpoint archive fails its integrity check (CRC of {bad}); the file is corrupt: "
                        "copy it again, or use another checkpoint")


def read_training_checkpoint(p: str | Path, map_location: str = "cpu", allow_pickle: bool = False,
                             mmap: bool = False) -> dict:
    """The dict of a Lightning ``.ckpt`` written by ``unicon train``, loaded with ``weights_only=True``;
    for a DeepSpeed checkpoint folder, :func:`resumable_deepspeed_state` (the dict without the
    weights, which DeepSpeed's engine loads itself).

    Such a checkpoint holds only tensors and plain containers, so it never needs unpickling of
    arbitrary objects. A file that does (which can run code while it loads) is refused unless
    ``allow_pickle``; a truncated or foreign file (not the zip archive ``torch.save`` writes) gets
    a one-line error naming it. ``mmap`` maps the tensors instead of reading them (cheap when only
    the config is needed); without it the archive's CRCs are checked first (:func:`check_archive`).
    """
    import pickle
    import zipfile

    p = Path(p)
    if not p.exists():
        raise UserError(f"checkpoint {p} does not exist")
    if is_deepspeed_checkpoint(p):
        return resumable_deepspeed_state(p, allow_pickle)
    if p.is_dir():
        raise UserError(f"{p} is a directory (a save_pretrained export?); expected a Lightning .ckpt file "
                        "written by unicon train, e.g. <run_dir>/last.ckpt")
    if not zipfile.is_zipfile(p):
        raise UserError(f"{p}: not a PyTorch checkpoint (expected the zip archive torch.save writes, e.g. "
                        "<run_dir>/last.ckpt); truncated, or another kind of file?")
    if not mmap:
        check_archive(p)
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


def checkpoint_config(ckpt: dict, p: str | Path):
    """The validated run config stored in a training checkpoint."""
    try:
        return from_container(ckpt["unicon_config"], source=f"{p} (stored config)")
    except ConfigError as e:
        raise UserError(f"{p}: stored config is invalid: {e}") from None


def load_lightning_checkpoint(p: str | Path, world_root: str | Path | None = None, map_location: str = "cpu",
                              allow_pickle: bool = False, expected_model: Any = None, **kwargs):
    """A ``unicon train`` ``.ckpt`` (or DeepSpeed checkpoint folder) -> ``(model, run config)``; LoRA
    adapters are re-applied, unmerged. ``expected_model``: see :func:`checkpoint_network`."""
    p = Path(p)
    if is_deepspeed_checkpoint(p):
        ckpt = read_deepspeed_checkpoint(p, allow_pickle)
    else:
        ckpt = read_training_checkpoint(p, map_location, allow_pickle)
    return _checkpoint_model(ckpt, p, world_root, expected_model=expected_model)


def _checkpoint_model(ckpt: dict, p: Path, world_root: str | Path | None = None, expected_model: Any = None):
    """``(model, run config)`` of a training checkpoint's dict: :func:`checkpoint_network` with the
    ``model.``-prefixed weights of its ``state_dict`` loaded."""
    model, cfg = checkpoint_network(ckpt, p, world_root, expected_model=expected_model)
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


def checkpoint_network(ckpt: dict, p: str | Path, world_root: str | Path | None = None, expected_model: Any = None):
    """``(model, run config)``: the network a training checkpoint's dict describes, with freshly
    initialised weights (LoRA adapters applied, unmerged). The architecture comes from the run's
    model section (a ``pretrained`` directory is read for its config and tokenizer, a world's
    vocabulary from the copy stored in the checkpoint, unless ``world_root`` names one).

    ``expected_model``: a ``model:`` section that must describe the same network as the stored one
    (:func:`check_same_architecture`), checked before anything is built; None: no check."""
    cfg = checkpoint_config(ckpt, p)
    if expected_model is not None:
        check_same_architecture(expected_model, config_dict(cfg.model), p)
    stored = ckpt.get("unicon_world_files") or {}
    if world_root is None and stored:
        known = getattr(backend_class(cfg.model.backend), "world_vocabulary_files", ())
        unknown = sorted(set(stored) - set(known))
        if unknown:
            raise UserError(f"{p}: unexpected stored world files {unknown}")
        with tempfile.TemporaryDirectory() as tmp:
            for name, text in stored.items():
                (Path(tmp) / name).write_text(text)
            model = factory.build_model(cfg.model, world_root=tmp)
    else:
        model = factory.build_model(cfg.model, world_root=world_root or cfg.data.root)
    if cfg.model.lora.enabled:
        apply_lora(model, cfg.model.lora)
    return model, cfg


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


def _client_state_file(tag_dir: Path) -> Path:
    """Rank 0's model-states file of a tag folder (ZeRO-2: ``mp_rank_00_...``, ZeRO-3: ``zero_pp_rank_0_...``)."""
    return next(f for f in (tag_dir / "mp_rank_00_model_states.pt", tag_dir / "zero_pp_rank_0_mp_rank_00_model_states.pt",
                            *sorted(tag_dir.glob("*model_states.pt"))) if f.is_file())


def _client_state(p: Path, first: Path, loaded, allow_pickle: bool) -> dict:
    """The client state from ``loaded``, :func:`_load_deepspeed_file`'s result for ``first`` (rank 0's
    model-states file of folder ``p``); None (let through by ``allow_pickle``) unpickles it now."""
    state = loaded
    if state is None and allow_pickle:
        state = torch.load(first, map_location="cpu", weights_only=False)
    if not isinstance(state, dict) or "unicon_config" not in state:
        raise UserError(f"{p}: not a unicon training checkpoint ({first.name} has no 'unicon_config')")
    return state


def deepspeed_client_state(path: str | Path, allow_pickle: bool = False) -> dict:
    """Rank 0's model-states file of a DeepSpeed checkpoint folder: Lightning's checkpoint dict
    without the weights (``unicon_config``, ``global_step``, loops, ...). Cheap (memory-mapped)."""
    p = Path(path)
    first = _client_state_file(_deepspeed_tag_dir(p))
    return _client_state(p, first, _load_deepspeed_file(first, allow_pickle), allow_pickle)


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
    (checked before anything unpickles; ``allow_pickle`` lets other objects through). Each file is
    loaded once (memory-mapped): the check's load of rank 0's model states is the client state."""
    p = Path(path)
    step = deepspeed_checkpoint_step(p)
    if step is None:
        raise UserError(f"{p}: an incomplete DeepSpeed checkpoint (no {DEEPSPEED_COMPLETE_FILE}: its save was cut "
                        "short, or it was not written by unicon train); resume from another checkpoint of the run")
    tag_dir = _deepspeed_tag_dir(p)
    first, loaded = _client_state_file(tag_dir), None
    for f in sorted(tag_dir.glob("*.pt")):
        state = _load_deepspeed_file(f, allow_pickle)
        if f == first:
            loaded = state
    state = _client_state(p, first, loaded, allow_pickle)
    if int(state.get("global_step", -1)) != step:
        raise UserError(f"{p}: {DEEPSPEED_COMPLETE_FILE} says step {step}, its files step {state.get('global_step')}: "
                        "an incomplete DeepSpeed checkpoint")
    return state


def read_deepspeed_checkpoint(path: str | Path, allow_pickle: bool = False) -> dict:
    """A DeepSpeed checkpoint folder (ZeRO-2 or ZeRO-3, any number of ranks) -> the dict of a
    Lightning ``.ckpt`` (:func:`read_training_checkpoint`'s result): Lightning's
    ``convert_zero_checkpoint_to_fp32_state_dict`` gathers the fp32 master weights from every
    rank's partition (DeepSpeed's ``zero_to_fp32``) into ``state_dict`` and keeps the client state.

    That converter unpickles every file (``weights_only=False``), so each file is first checked
    (:func:`check_archive`) and loaded with ``weights_only=True`` and only DeepSpeed's loss-scaler
    and ZeRO-stage classes allowed (memory-mapped); a file holding anything else is refused unless
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
        check_archive(f)
        _load_deepspeed_file(f, allow_pickle)  # refuses foreign objects before anything unpickles
    from lightning.pytorch.utilities.deepspeed import convert_zero_checkpoint_to_fp32_state_dict

    try:
        ckpt = convert_zero_checkpoint_to_fp32_state_dict(str(p), os.devnull)
    except (ValueError, FileNotFoundError, KeyError, IndexError, AssertionError) as e:
        raise UserError(f"{p}: DeepSpeed checkpoint conversion failed ({type(e).__name__}: {e})") from None
    if "unicon_config" not in ckpt or "state_dict" not in ckpt:
        raise UserError(f"{p}: not a unicon training checkpoint (missing 'unicon_config' or 'state_dict')")
    return ckpt


# ---- LoRA adapters in PEFT's format --------------------------------------------------------------
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
