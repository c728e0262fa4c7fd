"""What every ``unicon evaluate <suite>`` command shares: the model, output, device, pickle and
logger arguments, and their checks, done before any model or data is loaded; the flags generated
from a suite's eval dataclass (:func:`add_config_args`); ``--shard``/``--merge`` (:func:`sharding`).

* ``--device cuda`` on a machine without CUDA, an ``--out`` that is a file or cannot be written,
  and a count below its minimum fail with one line naming the flag;
* one run per ``--out`` (:func:`claim_out`): ``OUT/evaluate-run.json`` records the command, the
  settings and the weights fingerprint of the run that writes the folder (the settings are checked
  before any work, the weights once the model is loaded, before anything is written); a non-empty
  ``--out`` written by another command, with other settings or weights, or by something else is
  refused, unless ``--overwrite`` deletes its contents first. The same command with the same
  settings and weights (a rerun, a resume, the shards and the merge of one split) is the same run
  and goes on;
* the model loads with :func:`unicon.models.load_model`; unpickling only with ``--allow-pickle``;
* ``--logger`` defaults to the training default (``LoggerConfig.type``), for every suite;
* commands that draw images expose the sampling recipe (:func:`add_image_generation_args`): each
  flag overrides the model's own ``image_generation_config``, and the result is recorded.

A suite's flags are generated from its section of the run config (``eval.cococon`` ...,
:mod:`unicon.config`): one flag per field, with the field's type, default and choices. Why
:func:`add_config_args` is hand-written rather than jsonargparse (not installed; Lightning only needs
it for ``LightningCLI``): it is about 80 lines on plain argparse, so the suites keep their argparse
parsers and ``--help`` text. A value is checked by the same :func:`unicon.config.field_problem` as at
compose time, so ``unicon evaluate`` and ``eval.<suite>`` accept the same values and a bad one is one
line naming the flag; per-field renames, default changes and comma-separated list flags
(:class:`Flag`) keep the flag names users know. jsonargparse would need custom types for the ``choice``/``bounded``
metadata and its own error messages for that.
"""

from __future__ import annotations

import argparse
import dataclasses
import fcntl
import json
import shutil
import tempfile
import typing
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

from unicon.config import JUDGE_DTYPES, LoggerConfig, field_problem
from unicon.errors import UserError

#: eval-section fields that only the epoch-end callbacks use
EPOCH_END_ONLY = ("enabled", "every_n_epochs")


@dataclasses.dataclass(frozen=True)
class Flag:
    """How one eval-config field appears on a command line (all optional): ``names`` (default
    ``--field-name``), ``dest`` (default the field name), ``default`` (default the config's),
    ``help``, ``comma`` (a list field given as one comma-separated string, e.g. ``scene,clip``)."""

    help: str = ""
    names: tuple[str, ...] = ()
    dest: str | None = None
    default: Any = "<config>"  # the config's default
    comma: bool = False
    required: bool = False


def _base_type(hint) -> tuple[type, bool]:
    """``(element type, is_list)`` of a field annotation (``Optional`` unwrapped)."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) is typing.Union and len(args) == 1:
        hint = args[0]
    if typing.get_origin(hint) is list:
        return typing.get_args(hint)[0], True
    if hint in (bool, int, float, str):
        return hint, False
    raise TypeError(f"no command-line form for a field of type {hint!r}")


def _flag_fields(cls: type, flags: Mapping[str, Flag] | None, skip: Sequence[str]) -> Iterator[tuple]:
    """``(field, its Flag, its flag names, element type, is_list)`` of each field of eval section ``cls``
    that gets a flag (``skip`` and :data:`EPOCH_END_ONLY` left out)."""
    flags = dict(flags or {})
    unknown = set(flags) - {f.name for f in dataclasses.fields(cls)}
    if unknown:
        raise TypeError(f"flags for fields {sorted(unknown)} that {cls.__name__} does not have")
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name not in (*EPOCH_END_ONLY, *skip):
            spec = flags.get(f.name, Flag())
            yield f, spec, spec.names or (f"--{f.name.replace('_', '-')}",), *_base_type(hints[f.name])


def add_config_args(p: argparse.ArgumentParser, cls: type, flags: Mapping[str, Flag] | None = None,
                    skip: Sequence[str] = ()) -> None:
    """One flag per field of the eval dataclass ``cls`` (see the module docstring)."""
    g = p.add_argument_group(f"settings shared with the run config ({cls.__name__})")
    for f, spec, names, kind, is_list in _flag_fields(cls, flags, skip):
        default = spec.default if spec.default != "<config>" else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default)
        kw: dict[str, Any] = {"dest": spec.dest or f.name, "help": spec.help}
        choices = f.metadata.get("choices")
        choices = None if callable(choices) else choices
        if spec.required:
            kw["required"] = True
        else:
            kw["default"] = ",".join(default) if spec.comma else default
            kw["help"] += " (default: %(default)s)"
        if kind is bool:
            kw["action"] = argparse.BooleanOptionalAction
        elif is_list and spec.comma:
            kw["metavar"] = "A,B,..."
        elif is_list:
            kw.update(nargs="*", type=kind, choices=choices, metavar=f.name.upper())
        else:
            kw.update(type=kind, choices=choices)
        g.add_argument(*names, **kw)


def config_from_args(args: argparse.Namespace, cls: type, flags: Mapping[str, Flag] | None = None,
                     skip: Sequence[str] = ()):
    """The eval section ``cls`` with the values of the flags :func:`add_config_args` made (fields
    without a flag keep the config's default); a value its field does not allow is a
    :class:`UserError` naming the flag."""
    values = {}
    for f, spec, names, _, _ in _flag_fields(cls, flags, skip):
        value = getattr(args, spec.dest or f.name)
        if spec.comma and isinstance(value, str):
            value = [v for v in value.split(",") if v]
        problem = None if spec.comma and value == [] else field_problem(f, value)  # a comma flag: '' = none
        if problem is not None:
            bad, what = problem
            if what.startswith("is out of range: "):
                raise UserError(f"{names[0]} {what[len('is out of range: '):]}, got {bad}")
            raise UserError(f"{names[0]} {bad!r} {what}")
        values[f.name] = value
    return cls(**values)


def add_common_args(p: argparse.ArgumentParser, out_help: str = "output directory") -> None:
    p.add_argument("--ckpt", required=True, help="model: save_pretrained directory or Lightning .ckpt")
    p.add_argument("--out", required=True, help=out_help)
    p.add_argument("--device", default=None,  # resolved by check_common_args: --help imports no torch
                   help="torch device (default: cuda when available)")
    p.add_argument("--allow-pickle", action="store_true",
                   help="accept checkpoints that need unpickling (pytorch_model.bin; can run code: trusted files only)")
    p.add_argument("--logger", choices=["wandb", "csv", "none"], default=LoggerConfig.type,
                   help=f"where the metrics also go (default: {LoggerConfig.type}, offline without an API key)")
    p.add_argument("--overwrite", action="store_true",
                   help="when --out holds the outputs of another run (another command, other settings, other "
                        "files), delete them first (default: refuse)")
    p.add_argument("--name", default=None, help="run name for the logger (default: <suite>-<out folder name>)")
    p.set_defaults(suite_command=p.prog)


def add_judge_args(p: argparse.ArgumentParser, max_new_tokens: int) -> None:
    """``--judge-dtype``, ``--judge-max-new-tokens`` (default ``max_new_tokens``) and ``--trust-remote-code``:
    how the judge models of a suite load and reply."""
    p.add_argument("--judge-dtype", default="float32", choices=JUDGE_DTYPES)
    p.add_argument("--judge-max-new-tokens", type=int, default=max_new_tokens)
    p.add_argument("--trust-remote-code", action="store_true", help="allow custom code of judge models")


def add_image_generation_args(p: argparse.ArgumentParser) -> None:
    """``--sample/--greedy``, ``--temperature``, ``--top-k``, ``--top-p``, ``--guidance-scale``,
    ``--image-seed``, ``--candidates``; unset flags keep the model's saved setting (:func:`image_generation_config`)."""
    g = p.add_argument_group("image generation (default: the model's saved settings)")
    g.add_argument("--sample", dest="do_sample", action="store_true", default=None, help="sample image tokens")
    g.add_argument("--greedy", dest="do_sample", action="store_false", help="argmax image tokens")
    g.add_argument("--temperature", type=float, default=None, help="sampling temperature (> 0)")
    g.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens (0: all)")
    g.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass in (0, 1]")
    g.add_argument("--guidance-scale", type=float, default=None,
                   help="classifier-free guidance scale s: l_u + s (l_c - l_u) (1: off)")
    g.add_argument("--image-seed", type=int, default=None, help="seed of the image sampling")
    g.add_argument("--candidates", dest="num_candidates", type=int, default=None,
                   help="draw N images per prompt, keep the one the model's captioner scores highest "
                        "(OFA's sampling_times + rerank, with the model as judge; needs sampling)")


def image_generation_config(model, args: argparse.Namespace):
    """The model's ``image_generation_config`` with the flags of :func:`add_image_generation_args`
    that were given; a value out of range is a one-line error naming the flag."""
    checks = {"temperature": (lambda v: v > 0, "> 0"), "top_k": (lambda v: v >= 0, ">= 0"),
              "top_p": (lambda v: 0 < v <= 1, "in (0, 1]"), "num_candidates": (lambda v: v >= 1, ">= 1")}
    for name, (ok, what) in checks.items():
        value = getattr(args, name)
        if value is not None and not ok(value):
            flag = "--candidates" if name == "num_candidates" else f"--{name.replace('_', '-')}"
            raise UserError(f"{flag} must be {what}, got {value}")
    given = {k: getattr(args, k) for k in ("do_sample", "temperature", "top_k", "top_p", "guidance_scale",
                                           "num_candidates") if getattr(args, k) is not None}
    if args.image_seed is not None:
        given["seed"] = args.image_seed
    config = dataclasses.replace(model.image_generation_config, **given)
    if config.num_candidates > 1 and not config.do_sample:
        raise UserError(f"--candidates {config.num_candidates} needs sampling (--sample): greedy decoding "
                        "draws the same image every time")
    return config


def check_common_args(args: argparse.Namespace, counts: Sequence[str] = ()) -> Path:
    """Validate the shared arguments (an unset ``--device`` becomes cuda when available, else cpu),
    ``--shard`` and the count flags ``counts`` (>= 1); then create ``--out`` and claim it for this run
    (:func:`claim_out`). Returns the output directory."""
    import torch  # heavy: imported when the command runs, not for --help

    from unicon.evaluation.distributed import Shard

    for name in counts:
        value = getattr(args, name)
        if value is not None and value < 1:
            raise UserError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    device = str(args.device)
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"--device {device}: CUDA is not available on this machine (torch.cuda.is_available() "
                        "is False); use --device cpu")
    if getattr(args, "shard", None):  # a bad --shard i/n fails before --out is created
        Shard.parse(args.shard)
    out = prepare_out(args.out)
    claim_out_weights(args, out, None)  # the settings now, the weights once the model is loaded
    return out


def prepare_out(out: str | Path) -> Path:
    """Create the output directory and check that it can be written, before any work."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} exists and is not a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=".write-test-"):
            pass
    except OSError as e:
        raise UserError(f"--out {out}: cannot write there ({e.strerror})") from None
    return out


#: the file of ``--out`` that names the run writing the folder: ``{"command": ..., "settings": {...}}``
OUT_OWNER = "evaluate-run.json"


def _canonical(settings: Mapping[str, Any]) -> dict[str, Any]:
    """``settings`` as the JSON values :data:`OUT_OWNER` stores (paths and other objects as text)."""
    from unicon import jsonsafe  # numpy: imported when the command runs, not for --help

    return jsonsafe.finite(json.loads(json.dumps(dict(settings), sort_keys=True, default=str)))


def _read_owner(text: str) -> dict | None:
    """The content of :data:`OUT_OWNER`, or None when it is empty or not one."""
    try:
        old = json.loads(text)
    except json.JSONDecodeError:
        return None
    return old if isinstance(old, dict) and isinstance(old.get("settings"), dict) else None


def _other_run(owner_text: str, entries: Sequence[Path], want: Mapping[str, Any], fingerprint: str | None,
               checkpoint: str | None) -> str | None:
    """Why a non-empty ``--out`` (its :data:`OUT_OWNER` text and other ``entries``) belongs to another
    run than ``want`` (and the weights ``fingerprint`` of ``checkpoint``, when known); None when it is
    the same run."""
    if not owner_text.strip():
        return f"{len(entries)} entries, e.g. {entries[0].name}, and no {OUT_OWNER}"
    old = _read_owner(owner_text)
    if old is None:
        return f"its {OUT_OWNER} is unreadable"
    if old.get("command") != want["command"]:
        return f"written by {json.dumps(old.get('command'))[:60]}"
    was, now = old["settings"], want["settings"]
    diff = sorted(k for k in set(was) | set(now) if was.get(k) != now.get(k))
    if diff:
        shown = ", ".join(f"{k}={json.dumps(was.get(k))[:200]} (this run: {json.dumps(now.get(k))[:200]})"
                          for k in diff[:4])
        return f"written with other settings: {shown}" + (f" and {len(diff) - 4} more" if len(diff) > 4 else "")
    recorded = old.get("model_fingerprint")
    if fingerprint and recorded and recorded != fingerprint:
        return (f"written by another model ({old.get('checkpoint')}, weights {str(recorded)[:32]}) than "
                f"{checkpoint} (weights {fingerprint})")
    return None


def _check_deletable(out: Path) -> None:
    """``--overwrite`` deletes the contents of ``out``: never those of the working directory, one above
    it or the home folder."""
    target = out.resolve()
    cwd = Path.cwd().resolve()
    if target == cwd or target in cwd.parents or target == Path.home().resolve():
        raise UserError(f"--overwrite would delete everything in --out {out} ({target}: the working directory, "
                        "one above it or the home folder); give the output folder itself")


def claim_out(out: Path, command: str | None, settings: Mapping[str, Any], overwrite: bool = False,
              keep: Sequence[str] = (), fingerprint: str | None = None, checkpoint: str | None = None) -> None:
    """Claim ``out`` for the run of ``command`` with ``settings`` (see the module docstring) and, once
    the model is loaded, its weights ``fingerprint`` (of ``checkpoint``, recorded for the messages):
    record them in :data:`OUT_OWNER`. The checkpoint's path is not a setting: the weights decide.

    A non-empty ``out`` that another run wrote (another command, other settings, other weights, or
    files without :data:`OUT_OWNER`) is a :class:`UserError`, unless ``overwrite``: then its entries
    are deleted first (except the names in ``keep``, e.g. a merge's ``shards``). The same run (a
    rerun, a resume, sibling shards starting together) goes on; the claim holds a lock on
    :data:`OUT_OWNER` while it decides, so concurrent jobs see one another's claim."""
    want = {"command": command, "settings": _canonical(settings)}
    path = out / OUT_OWNER
    with open(path, "a+", encoding="utf-8") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        owner_text = f.read()
        entries = sorted(p for p in out.iterdir() if p.name != OUT_OWNER and not p.name.startswith(".write-test-"))
        # nothing but the record (a run that stopped before writing anything): the folder is free
        reason = _other_run(owner_text, entries, want, fingerprint, checkpoint) if entries else None
        if reason is not None:
            if not overwrite:
                if not owner_text:
                    path.unlink()  # created by this claim: the folder is left as it was
                raise UserError(f"--out {out} holds the outputs of another run ({reason}); use another --out, "
                                "or pass --overwrite to delete them first")
            _check_deletable(out)
            print(f"--overwrite: deleting the outputs of another run in {out} ({reason})")
            for p in entries:
                if p.name in keep:
                    continue
                shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
        old = _read_owner(owner_text)
        record = dict(want)
        if fingerprint:
            record.update(model_fingerprint=fingerprint, checkpoint=checkpoint)
        elif reason is None and old is not None and old.get("model_fingerprint") \
                and old.get("command") == command and old["settings"] == want["settings"]:
            # the same run, before its model is loaded: its weights stay recorded
            record.update(model_fingerprint=old["model_fingerprint"], checkpoint=old.get("checkpoint"))
        f.seek(0)
        f.truncate()
        f.write(json.dumps(record, indent=1, allow_nan=False) + "\n")
        f.flush()


def claim_out_weights(args: argparse.Namespace, out: Path, fingerprint: str | None) -> None:
    """:func:`claim_out` for the command's ``args``; once the model is loaded with its weights'
    ``fingerprint`` (None before): ``--out`` must not hold the outputs of other weights (the checkpoint
    file may have changed since the outputs were written). Call it before writing."""
    ckpt = getattr(args, "ckpt", None)
    settings = {k: v for k, v in settings_key(args).items() if k != "ckpt"}  # the weights stand for the model
    claim_out(out, getattr(args, "suite_command", None), settings,
              overwrite=getattr(args, "overwrite", False), keep=("shards",) if getattr(args, "merge", False) else (),
              fingerprint=fingerprint, checkpoint=str(Path(ckpt).resolve()) if ckpt else None)


def load_model_for(args: argparse.Namespace):
    """The model of ``--ckpt`` on ``--device``, in eval mode."""
    from unicon.models import load_model  # lazy: tests patch unicon.models.load_model at its source

    if not Path(args.ckpt).exists():
        raise UserError(f"--ckpt {args.ckpt} does not exist")
    return load_model(args.ckpt, allow_pickle=args.allow_pickle).to(args.device).eval()


def config_argv(section: Mapping[str, Any], cls: type, flags: Mapping[str, Flag] | None = None,
                skip: Sequence[str] = ()) -> list[str]:
    """The arguments that give the flags of :func:`add_config_args` the values of ``section`` (an
    eval section of a composed run config): what ``unicon evaluate all`` passes each suite. A
    ``None`` value leaves the flag at its default (the standalone meaning of "unset")."""
    argv: list[str] = []
    for f, spec, (name, *_), kind, is_list in _flag_fields(cls, flags, skip):
        value = section[f.name]
        if value is None:
            continue
        if kind is bool:
            argv.append(name if value else f"--no-{name[2:]}")
        elif is_list and spec.comma:
            argv.append(f"{name}={','.join(map(str, value))}")
        elif is_list:
            argv += [name, *map(str, value)]
        else:
            argv.append(f"{name}={value}")
    return argv


# ---------------------------------------------------------------------------------------------
# --shard i/n and --merge (unicon.evaluation.distributed: sharded_run, merged_run)
# ---------------------------------------------------------------------------------------------
#: arguments that do not change a suite's results files: shards and their merge may differ in them
NOT_IN_SHARD_KEY = ("shard", "merge", "out", "device", "logger", "name", "allow_pickle", "table_rows", "overwrite",
                    "suite_command")


def settings_key(args: argparse.Namespace) -> dict[str, Any]:
    """The arguments that decide a suite's results files (all but :data:`NOT_IN_SHARD_KEY`): what the
    shards and their merge must share, and what makes a rerun into ``--out`` the same run."""
    return {k: v for k, v in sorted(vars(args).items()) if k not in NOT_IN_SHARD_KEY}


def add_shard_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sharded runs (e.g. SLURM array jobs; slurm/evaluate_array.sbatch)")
    x = g.add_mutually_exclusive_group()
    x.add_argument("--shard", default=None, metavar="I/N",
                   help="evaluate shard I of N (0-based): the samples rank I of N ranks gets (DistributedSampler); "
                        "its parts go to OUT/shards/, no final files")
    x.add_argument("--merge", action="store_true",
                   help="after every shard of OUT/shards/ finished: write the files one unsharded run writes "
                        "(byte-identical; no model is loaded: the shards recorded its settings)")


def _merge_makes_no_model_call(*args, **kwargs):
    raise RuntimeError("a merge of shards makes no model call")


class RecordedModel:
    """The merge's stand-in for the shards' model: what the suites read of a model besides its calls
    (``caption_prompt``, ``image_generation_config``, the weights fingerprint), as the shards recorded
    it, and no weights; every model call raises. A merge job needs no GPU and no memory for the model."""

    def __new__(cls, recorded: Mapping[str, Any]):
        from unicon.models.base import ImageGenerationConfig, UnifiedModel

        class Recorded(UnifiedModel):
            backend = "recorded"

        for name in Recorded.__abstractmethods__:
            setattr(Recorded, name, _merge_makes_no_model_call)
        Recorded.__abstractmethods__ = frozenset()
        model = Recorded()
        model.caption_prompt = recorded["caption_prompt"]
        config = ImageGenerationConfig(**recorded["image_generation_config"])
        Recorded.image_generation_config = property(lambda self: config)
        model.fingerprint = recorded["model_fingerprint"]
        return model


def model_record(model, fingerprint: str) -> dict[str, Any]:
    """What :class:`RecordedModel` needs, from the real model of a shard."""
    return {"caption_prompt": model.caption_prompt, "model_fingerprint": fingerprint,
            "image_generation_config": dataclasses.asdict(model.image_generation_config)}


@dataclasses.dataclass
class ShardState:
    """What a CLI needs to know inside :func:`sharding`: ``mode`` is None (one run), ``"shard"`` or
    ``"merge"``; ``extra`` is stored in the shard's ``done.json``; ``done`` holds every shard's
    ``done.json`` in a merge."""

    mode: str | None
    extra: dict
    done: list[dict]
    out: Path | None = None

    def load_model(self, args: argparse.Namespace, loader=None):
        """``(model, weights fingerprint)``: the model of ``--ckpt`` (``loader(args)``, default
        :func:`load_model_for`; one run, a shard: which records it for the merge), or in a merge the
        shards' :class:`RecordedModel` (all shards must agree)."""
        from unicon.core import weights_fingerprint  # lazy: tests patch it at its source, unicon.core

        if self.mode != "merge":
            model = (loader or load_model_for)(args)
            fingerprint = weights_fingerprint(model)
            if self.mode == "shard":  # the merge checks the weights of every shard against --out
                self.extra["model"] = model_record(model, fingerprint)
            elif self.out is not None:
                claim_out_weights(args, self.out, fingerprint)
            return model, fingerprint
        records = [info["extra"]["model"] for info in self.done]
        for info, record in zip(self.done, records):
            if record != records[0]:
                diff = sorted(k for k in record if record[k] != records[0].get(k))
                raise UserError(f"merge: shard {info['shard']} evaluated another model than shard 0 ({', '.join(diff)} "
                                "differ); rerun it")
        if self.out is not None:
            claim_out_weights(args, self.out, records[0]["model_fingerprint"])
        return RecordedModel(records[0]), records[0]["model_fingerprint"]

    def record(self, name: str, value: Any) -> Any:
        """A value the shards record and the merge reads back (all shards must agree): ``value`` in a
        shard or one run, the shards' value in a merge (``value`` is not used there)."""
        if self.mode == "shard":
            self.extra[name] = value
        if self.mode != "merge":
            return value
        values = [info["extra"][name] for info in self.done]
        if any(v != values[0] for v in values):
            raise UserError(f"merge: the shards recorded different {name} values {values}; rerun them")
        return values[0]


@contextmanager
def sharding(args: argparse.Namespace, out: Path) -> Iterator[ShardState]:
    """Run the block as one run, as ``--shard I/N`` or as ``--merge`` of ``OUT/shards``."""
    from unicon.evaluation.distributed import Shard, merged_run, sharded_run  # heavy: torch.distributed

    key = settings_key(args)
    root = out / "shards"
    if getattr(args, "shard", None):
        with sharded_run(root, Shard.parse(args.shard), key) as extra:
            yield ShardState("shard", extra, [], out)
    elif getattr(args, "merge", False):
        with merged_run(root, key) as done:
            yield ShardState("merge", {}, done, out)
    else:
        yield ShardState(None, {}, [], out)
