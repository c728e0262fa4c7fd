"""Every model file in and out: what a checkpoint says to build, the two loads built on that, and exports.

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
  (:func:`unicon.models.lora.save_lora_adapter`), with the run's config as ``training_config.json``.

Both loads read first and build second: :func:`checkpoint_plan` (any checkpoint) and
:func:`training_plan` (what a run starts from) read what a checkpoint says to build, a
:class:`~unicon.models.factory.ModelPlan` (the backend, the model section, the vocabulary, the LoRA
adapters and weights of a training checkpoint), and :func:`unicon.models.factory.build` builds it.

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

It may import :mod:`unicon.models.factory` (the plan, and building it), :mod:`unicon.models.lora`
(PEFT mechanics), :mod:`unicon.models.registry`, ``unicon.core``, ``unicon.config`` and
``unicon.data.jsonl``; never a backend module or a world (a saved model's image tokenizer is
rebuilt through the registry of :mod:`unicon.core`), and nothing of training.
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any, Callable

import torch

from unicon.config import ConfigError, from_container
from unicon.core import config_dict
from unicon.data.jsonl import read_json
from unicon.errors import UserError
from unicon.models.base import UnifiedModel
from unicon.models.factory import ModelPlan, build
from unicon.models.lora import has_lora, merge_lora, save_lora_adapter
from unicon.models.registry import backend_for_model_type

logger = logging.getLogger(__name__)

__all__ = ["ADAPTER_DIR", "ARCHITECTURE_KEYS", "DEEPSPEED_COMPLETE_FILE", "DEEPSPEED_TAG_FILE", "PICKLE_OPT_IN",
           "TRAINING_CONFIG_NAME", "check_archive", "check_same_architecture", "checkpoint_config",
           "checkpoint_plan", "deepspeed_checkpoint_step", "deepspeed_client_state", "export_checkpoint",
           "export_model", "is_deepspeed_checkpoint", "load_for_training", "load_lightning_checkpoint", "load_model",
           "read_deepspeed_checkpoint", "read_training_checkpoint", "recorded_model_section",
           "resumable_deepspeed_state", "training_plan"]


# ---- the calls -----------------------------------------------------------------------------------
def load_model(path: str | Path, **kwargs) -> UnifiedModel:
    """Any unicon/OFA checkpoint -> a ready :class:`UnifiedModel` (eval mode): what
    :func:`checkpoint_plan` reads, built.

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
    plan = checkpoint_plan(path, **kwargs)
    return build(plan).eval()


def load_for_training(cfg: Any, resumed: dict | None = None) -> UnifiedModel:
    """The UnifiedModel a run of ``cfg`` (a RunConfig: its ``model``, ``data.root``, ``resume`` and
    ``init_from``) starts from: what :func:`training_plan` reads, built, with the config's model
    options (dtype, freezing), gradient checkpointing and LoRA applied. ``resumed``: the dict of
    ``cfg.resume`` when the caller has read it already (:func:`read_training_checkpoint`,
    memory-mapped), instead of a second read."""
    plan = training_plan(cfg, resumed)
    return build(plan)


def load_lightning_checkpoint(p: str | Path, world_root: str | Path | None = None, map_location: str = "cpu",
                              allow_pickle: bool = False):
    """A ``unicon train`` ``.ckpt`` (or DeepSpeed checkpoint folder) -> ``(model, run config)``; LoRA
    adapters are re-applied, unmerged."""
    plan = _read_training_plan(p, world_root, map_location, allow_pickle)
    return build(plan), plan.run_config


# ---- what a checkpoint says to build -------------------------------------------------------------
TRAINING_CONFIG_NAME = "training_config.json"  # written into exports by export_model
ARCHITECTURE_KEYS = ("backend", "preset", "pretrained", "arch")  # the model section's keys that fix the network


def checkpoint_plan(path: str | Path, world_root: str | Path | None = None, map_location: str | None = None,
                    **options) -> ModelPlan:
    """What any checkpoint :func:`load_model` takes says to build (its ``kwargs``)."""
    p = Path(path)
    if not p.exists():
        raise UserError(f"checkpoint {p} does not exist")
    if p.is_file() and p.suffix != ".ckpt":
        raise UserError(f"{p}: expected a Lightning .ckpt file or a save_pretrained directory")
    if p.is_file() or is_deepspeed_checkpoint(p):
        return _read_training_plan(p, world_root, map_location or "cpu", bool(options.get("allow_pickle")))
    return _directory_plan(p, map_location, options)


def training_plan(cfg: Any, resumed: dict | None = None) -> ModelPlan:
    """What a run of ``cfg`` starts from, with the run's ``model:`` section to apply
    (``ModelPlan.training``), which is checked once against the network the checkpoint recorded
    (:func:`check_same_architecture`; a directory that recorded none, for its backend) before its
    weights load:

    * ``resume``: the network and weights of that checkpoint (``resumed``: its dict, already read;
      a memory-mapped read is checked here with :func:`check_archive`). A DeepSpeed folder's weights
      are not gathered: DeepSpeed's engine loads every rank's partition itself (Lightning restores a
      ``.ckpt``'s again afterwards);
    * ``init_from``: a ``.ckpt``, a DeepSpeed folder or a ``save_pretrained`` / OFA-Sys directory,
      with the vocabulary of ``data.root``;
    * neither: the ``model:`` section, with the vocabulary of ``data.root``.
    """
    allow_pickle = bool(cfg.model.allow_pickle)
    if cfg.resume:
        path = Path(cfg.resume)
        ckpt = resumed if resumed is not None else read_training_checkpoint(path, allow_pickle=allow_pickle, mmap=True)
        deepspeed = is_deepspeed_checkpoint(path)
        for archive in sorted(_deepspeed_tag_dir(path).glob("*.pt")) if deepspeed else [path]:
            check_archive(archive)  # a memory-mapped read checks no CRC
        plan = _training_checkpoint_plan(ckpt, path, weights=None if deepspeed else partial(_model_weights, ckpt))
    elif cfg.init_from:
        plan = checkpoint_plan(_init_from(cfg.init_from), world_root=cfg.data.root, allow_pickle=allow_pickle)
    else:
        plan = ModelPlan(backend=cfg.model.backend, model=cfg.model, world_root=cfg.data.root)
    if plan.source is not None:
        check_same_architecture(cfg.model, plan.model, plan.source, backend=plan.backend)
    return replace(plan, training=cfg.model)


def _init_from(init_from: str | Path) -> Path:
    """``init_from``, refused unless it is a checkpoint: a ``.ckpt`` file or a folder."""
    source = Path(init_from)
    if not source.exists():
        raise UserError(f"init_from: {init_from} does not exist")
    if source.is_file() and source.suffix != ".ckpt":
        inside = next((f" (the model directory {source.parent}?)" for name in ("unicon_model.json", "config.json")
                       if (source.parent / name).is_file()), "")
        raise UserError(f"init_from: {source} is not a checkpoint; expected a Lightning .ckpt written by unicon train, "
                        f"a DeepSpeed checkpoint folder or a model directory (save_pretrained or OFA-Sys){inside}")
    return source


def _read_training_plan(p: str | Path, world_root: str | Path | None = None, map_location: str = "cpu",
                       allow_pickle: bool = False) -> ModelPlan:
    """What a ``unicon train`` ``.ckpt`` or DeepSpeed checkpoint folder says to build. A folder's
    config is its client state (:func:`deepspeed_client_state`); its weights are gathered from every
    rank (:func:`read_deepspeed_checkpoint`) only when the plan is built."""
    p = Path(p)
    if is_deepspeed_checkpoint(p):
        ckpt = deepspeed_client_state(p, allow_pickle)
        weights = partial(_gathered_weights, p, allow_pickle)
    else:
        ckpt = read_training_checkpoint(p, map_location, allow_pickle)
        weights = partial(_model_weights, ckpt)
    return _training_checkpoint_plan(ckpt, p, world_root, weights)


def _training_checkpoint_plan(ckpt: dict, p: Path, world_root: str | Path | None = None,
                              weights: Callable[[], dict] | None = None) -> ModelPlan:
    """What a training checkpoint's dict says to build: the network of its stored model section (a
    ``pretrained`` directory is read for its config and tokenizer), with the vocabulary of
    ``world_root``, else the world files stored in it, else its run's ``data.root``; its LoRA
    adapters, unmerged; ``weights``: where the weights come from (None: none loaded)."""
    cfg = checkpoint_config(ckpt, p)
    return ModelPlan(backend=cfg.model.backend, model=cfg.model, source=p,
                     world_root=world_root or cfg.data.root,
                     world_files=dict(ckpt.get("unicon_world_files") or {}) if world_root is None else {},
                     lora=cfg.model.lora if cfg.model.lora.enabled else None, weights=weights, run_config=cfg)


def _model_weights(ckpt: dict) -> dict:
    """The model's entries of a training checkpoint's ``state_dict`` (the ``model.`` prefix dropped)."""
    return {k[len("model."):]: v for k, v in ckpt["state_dict"].items() if k.startswith("model.")}


def _gathered_weights(p: Path, allow_pickle: bool) -> dict:
    """The model's weights of a DeepSpeed checkpoint folder, gathered from every rank."""
    return _model_weights(read_deepspeed_checkpoint(p, allow_pickle))


def _directory_plan(p: Path, map_location: str | None, options: dict) -> ModelPlan:
    """What a ``save_pretrained`` or OFA-Sys directory says to build: the backend its
    ``unicon_model.json`` names (or that reads its ``config.json``'s ``model_type``), loading it
    whole with ``options``; the model section its ``training_config.json`` recorded, if any."""
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
    # a saved directory holds its own vocabulary and image tokenizer spec: no world_root
    return ModelPlan(backend=backend, model=recorded_model_section(p), source=p, directory=True,
                     pretrained_options={**options, "map_location": map_location})


def recorded_model_section(path: str | Path, allow_pickle: bool = False) -> dict | None:
    """The ``model:`` section of the run that produced a checkpoint: a ``.ckpt``'s stored config (a
    DeepSpeed folder's is in its client state: no conversion needed), or an export's
    ``training_config.json``; ``None`` for directories without one (OFA-Sys, older exports)."""
    p = Path(path)
    if p.is_file():
        ckpt = read_training_checkpoint(p, allow_pickle=allow_pickle)
    elif is_deepspeed_checkpoint(p):
        ckpt = deepspeed_client_state(p, allow_pickle)
    else:
        record = p / TRAINING_CONFIG_NAME
        section = _json_object(record).get("model") if record.is_file() else None
        return section if isinstance(section, dict) else None
    section = checkpoint_config(ckpt, p).model
    return config_dict(section)


def check_same_architecture(model_cfg: Any, recorded: dict | None, source: str | Path, backend: str | None = None) -> None:
    """Refuse a ``model:`` config section that describes another network than checkpoint ``source``
    holds (``recorded``: its model section, see :func:`recorded_model_section`; ``backend``: its
    backend, checked when nothing was recorded)."""
    mine = config_dict(model_cfg)
    recorded = None if recorded is None else config_dict(recorded)
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


def _json_object(path: Path) -> dict:
    data = read_json(path, what="model metadata")
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a JSON object")
    return data


# ---- exports -------------------------------------------------------------------------------------
ADAPTER_DIR = "adapter"  # <export>/adapter: the LoRA adapters in PEFT's format


def export_model(model: torch.nn.Module, out_dir: str | Path, merge: bool = True,
                 run_config: dict | None = None) -> Path:
    """``model.save_pretrained(out_dir)`` with LoRA adapters merged (``merge``) -- in place.

    The adapters are always also saved, in PEFT's format, to ``<out_dir>/adapter/``
    (:func:`~unicon.models.lora.save_lora_adapter`; ``PeftModel.from_pretrained`` loads them); with ``merge=False``
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
