"""Typed run configuration, composed from ``configs/`` with OmegaConf.

A run's config is ``RunConfig`` (the schema below) merged, in order, with:

1. ``configs/config.yaml`` -- the base, whose ``defaults:`` picks one file per group;
2. the group files ``configs/<group>/<name>.yaml`` chosen by the defaults, by the
   experiment's own ``defaults:``, or on the command line as ``group=name``;
3. ``configs/experiment/<name>.yaml`` (``experiment=<name>``) -- a small override file;
4. command-line dotlist overrides such as ``trainer.max_epochs=3``.

Groups are ``model data trainer loss eval logger``; a group file holds the body of
that section (``configs/loss/spearman.yaml`` holds ``type: spearman`` ...).
Every layer is validated against the schema: an unknown key or a wrong type raises
:class:`ConfigError` naming the key and the file (or "command line") it came from.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

GROUPS = ("model", "data", "trainer", "loss", "eval", "logger")


class ConfigError(ValueError):
    """A user mistake in a config file or override; its message is one readable line."""


# ---------------------------------------------------------------------------------------------
# Schema
# ---------------------------------------------------------------------------------------------
@dataclass
class LoraConfig:
    enabled: bool = False
    r: int = 8
    alpha: int = 16
    dropout: float = 0.05
    # module-name suffixes wrapped by PEFT; empty = the backend's default attention+MLP projections
    target_modules: list[str] = field(default_factory=list)
    merge_on_export: bool = True


@dataclass
class ModelConfig:
    backend: str = "ofa"  # ofa | janus
    preset: Optional[str] = None  # named architecture preset of the backend (e.g. "shapes-tiny")
    pretrained: Optional[str] = None  # local directory or hub id for from_pretrained
    arch: dict[str, Any] = field(default_factory=dict)  # overrides of the backend config class
    dtype: str = "float32"
    gradient_checkpointing: bool = False
    allow_pickle: bool = False  # accept pytorch_model.bin (pickle) checkpoints
    trust_remote_code: bool = False
    freeze: list[str] = field(default_factory=list)  # parameter-name prefixes kept frozen
    freeze_batchnorm: bool = False  # BatchNorm on running statistics, not trained (exact DDP, small batches)
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass
class DataConfig:
    world: str = "shapes"  # shapes | cococon (real CocoCon-format file + images)
    root: str = "data/shapes"  # directory written by `unicon build-data shapes`
    build: dict[str, Any] = field(default_factory=dict)  # builder options when root is missing
    contrast_file: Optional[str] = None  # CocoCon-schema JSON; default <root>/cococon_train.json
    images_root: Optional[str] = None
    batch_size: int = 32  # pretraining-mixture examples per step
    contrast_batch_size: int = 8  # contrast samples per consistency step
    max_contrast: int = 5
    num_workers: int = 0
    tasks: list[str] = field(default_factory=lambda: ["caption", "vqa", "grounding", "t2i", "reason"])


@dataclass
class TrainerConfig:
    max_epochs: int = 1
    max_steps: int = -1
    accelerator: str = "auto"
    devices: Any = 1
    num_nodes: int = 1
    strategy: str = "auto"  # auto | ddp | deepspeed_zero2[_offload] | deepspeed_zero3[_offload] | fsdp
    precision: str = "32-true"
    accumulate_grad_batches: int = 1
    gradient_clip_val: Optional[float] = 1.0
    log_every_n_steps: int = 10
    limit_train_batches: Optional[float] = None
    check_val_every_n_epoch: int = 1
    deterministic: bool = False
    enable_progress_bar: bool = True
    checkpoint_every_n_steps: Optional[int] = None  # also save every N optimizer steps (default: epoch ends)


@dataclass
class OptimConfig:
    lr: float = 1e-6
    weight_decay: float = 0.01
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    warmup_ratio: float = 0.1
    scheduler: str = "linear"  # linear | cosine | constant


@dataclass
class LossConfig:
    type: str = "spearman"  # spearman | hinge | none
    lambda_: float = 0.25
    gamma: float = 0.5  # probability that a step is a consistency update
    regularization: str = "l2"  # torchsort soft_rank regularization
    regularization_strength: float = 1.0
    hinge_margin: float = 0.1
    label_smoothing: float = 0.0
    tasks: list[str] = field(default_factory=lambda: ["vqa", "localization", "t2i"])  # evaluation tasks t_i
    on_nonfinite: str = "stop"  # stop | skip


@dataclass
class CocoConEvalConfig:
    enabled: bool = True
    every_n_epochs: int = 1
    data: Optional[str] = None  # CocoCon-schema JSON; default the world's eval file
    images_root: Optional[str] = None
    max_samples: Optional[int] = 200
    batch_size: int = 16
    generative: bool = True  # also compute CIDEr / VQA / loc / T2I accuracies
    table_rows: int = 16
    skip_missing: bool = False  # skip (and count) samples whose image file is missing
    tasks: list[str] = field(default_factory=lambda: ["vqa", "localization", "t2i"])  # compared with captioning


@dataclass
class DriftEvalConfig:
    enabled: bool = True
    every_n_epochs: int = 1
    seeds: Optional[str] = None  # seed set file; default the world's drift seeds
    num_chains: int = 8
    generations: int = 4
    i2t_prompt: Optional[str] = None
    embedders: list[str] = field(default_factory=lambda: ["scene", "clip", "text"])
    geneval: bool = True
    geneval_prompts: Optional[str] = None  # GenEval metadata file for MGG; default the world's geneval_metadata.jsonl
    long_prompts: bool = False  # use 'detailed_caption' (BLIP3-o rewrite) as T0
    clip: Optional[str] = "checkpoints/shapes_clip"  # open_clip dir / '<arch>:<weights>' (python -m unicon.embedders.clip)
    dino: Optional[str] = None  # transformers DINO directory (image->image)
    sentence: Optional[str] = None  # sentence-transformers dir; default the bundled all-MiniLM-L6-v2
    batch_size: int = 8
    strips: int = 2  # chains shown in the strip plot / W&B table


@dataclass
class UReasonEvalConfig:
    enabled: bool = True
    every_n_epochs: int = 1
    data: Optional[str] = None  # directory of UReason JSONL files; default the world's prompts
    judge: str = "exact"  # exact | vlm:<path> | ...
    chain_judge: Optional[str] = None  # causal-LM path for the reasoning-chain judge (exact judges chains itself)
    max_samples: Optional[int] = 32  # round-robin over categories
    max_new_tokens: int = 128
    batch_size: int = 8
    table_rows: int = 8  # samples in the W&B table (three images side by side)


@dataclass
class EvalConfig:
    fail_on_error: bool = False  # an exception inside an epoch-end evaluation kills the run
    cococon: CocoConEvalConfig = field(default_factory=CocoConEvalConfig)
    drift: DriftEvalConfig = field(default_factory=DriftEvalConfig)
    ureason: UReasonEvalConfig = field(default_factory=UReasonEvalConfig)


@dataclass
class LoggerConfig:
    type: str = "wandb"  # wandb | csv
    project: Optional[str] = None  # default $WANDB_PROJECT or "unicon"
    entity: Optional[str] = None
    mode: Optional[str] = None  # online | offline | disabled; default $WANDB_MODE, else offline without an API key
    tags: list[str] = field(default_factory=list)


@dataclass
class RunConfig:
    name: str = "run"
    seed: int = 0
    output_dir: str = "checkpoints"  # runs write to <output_dir>/<name>/
    init_from: Optional[str] = None  # checkpoint (.ckpt or save_pretrained dir) to start from
    resume: Optional[str] = None  # Lightning .ckpt to resume (optimizer, step, RNG)
    experiment: Optional[str] = None
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)


# ---------------------------------------------------------------------------------------------
# Composition
# ---------------------------------------------------------------------------------------------
def config_dir() -> Path:
    """``$UNICON_CONFIG_DIR`` or the repository's ``configs/``."""
    env = os.environ.get("UNICON_CONFIG_DIR")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2] / "configs"


def _load_yaml(path: Path) -> DictConfig:
    if not path.is_file():
        options = sorted(p.stem for p in path.parent.glob("*.yaml")) if path.parent.is_dir() else []
        raise ConfigError(f"no config file {path} (available: {', '.join(options) or 'none'})")
    try:
        cfg = OmegaConf.load(path)
    except Exception as e:  # yaml.YAMLError and friends
        raise ConfigError(f"{path}: cannot parse YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(cfg, DictConfig):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    return cfg


def _merge(base: DictConfig, layer: DictConfig | dict, source: str) -> DictConfig:
    try:
        return OmegaConf.merge(base, layer)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or ""
        msg = str(e).splitlines()[0]
        raise ConfigError(f"{source}: invalid key '{key}': {msg}") from None


def split_overrides(overrides: list[str]) -> tuple[dict[str, str], list[str]]:
    """Split ``group=name`` choices (and ``experiment=``) from dotlist overrides."""
    choices, dotlist = {}, []
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"command line: override '{item}' is not of the form key=value")
        key, value = item.split("=", 1)
        if key in GROUPS or key == "experiment":
            choices[key] = value
        else:
            dotlist.append(item)
    return choices, dotlist


def compose(overrides: list[str] | None = None, configs: Path | None = None) -> DictConfig:
    """Build the validated run config from base + groups + experiment + ``overrides``."""
    configs = configs or config_dir()
    choices, dotlist = split_overrides(list(overrides or []))
    base = _load_yaml(configs / "config.yaml")
    defaults = dict(base.pop("defaults", {}) or {})

    experiment_cfg = None
    exp_name = choices.pop("experiment", None) or defaults.pop("experiment", None)
    if exp_name:
        experiment_cfg = _load_yaml(configs / "experiment" / f"{exp_name}.yaml")
        defaults.update(dict(experiment_cfg.pop("defaults", {}) or {}))
    defaults.update(choices)

    cfg = OmegaConf.structured(RunConfig)
    for group in GROUPS:
        name = defaults.pop(group, None)
        if name is None:
            continue
        path = configs / group / f"{name}.yaml"
        cfg = _merge(cfg, {group: _load_yaml(path)}, str(path))
    if defaults:
        raise ConfigError(f"{configs / 'config.yaml'}: unknown config group(s) in defaults: {sorted(defaults)}")
    cfg = _merge(cfg, base, str(configs / "config.yaml"))
    if experiment_cfg is not None:
        cfg = _merge(cfg, experiment_cfg, str(configs / "experiment" / f"{exp_name}.yaml"))
        cfg.experiment = exp_name
    try:
        cli = OmegaConf.from_dotlist(dotlist)
    except Exception as e:
        raise ConfigError(f"command line: {str(e).splitlines()[0]}") from None
    cfg = _merge(cfg, cli, "command line")
    try:
        OmegaConf.resolve(cfg)
    except OmegaConfBaseException as e:
        raise ConfigError(f"cannot resolve interpolation: {str(e).splitlines()[0]}") from None
    return cfg


def to_yaml(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml(cfg, resolve=True)


def from_container(data: dict) -> DictConfig:
    """Re-validate a plain dict (e.g. the config stored in a checkpoint) against the schema."""
    return _merge(OmegaConf.structured(RunConfig), data, "checkpoint config")
