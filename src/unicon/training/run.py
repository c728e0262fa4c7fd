"""``unicon train``: compose the config, build model + data, fit with Lightning, export.

``train(cfg)`` is the whole run:

1. seed everything (``cfg.seed``), create ``<output_dir>/<name>/`` and write the resolved
   ``config.yaml`` there (the same config goes into every checkpoint);
2. build the model (``unicon.models.build_model``; ``init_from`` loads a checkpoint with
   ``unicon.models.load_model`` instead), turn on gradient checkpointing and LoRA if asked;
3. wrap it in :class:`~unicon.training.module.ConsistencyModule` (Algorithm 1) with the
   :class:`~unicon.training.datamodule.ConsistencyDataModule`;
4. ``Trainer.fit`` with the strategy of ``trainer.strategy`` (``auto``, ``ddp``, ``fsdp``,
   ``deepspeed_zero2[_offload]``, ``deepspeed_zero3[_offload]`` -- the DeepSpeed ones read
   ``configs/strategy/<name>.json``), ModelCheckpoint in the run directory, a rich progress bar,
   the loggers of ``unicon.training.loggers.make_loggers`` and the enabled epoch-end evaluations;
   ``resume=<ckpt>`` restores optimizer, scheduler, step and the γ generator;
5. export the final model with ``save_pretrained`` to ``<run_dir>/export`` (LoRA merged).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from unicon.config import GROUPS, ConfigError, compose, config_dir, to_yaml
from unicon.errors import UserError

STRATEGIES = ("auto", "ddp", "ddp_spawn", "fsdp", "deepspeed_zero2", "deepspeed_zero2_offload",
              "deepspeed_zero3", "deepspeed_zero3_offload")
# suite -> (module, callback class)
EVAL_CALLBACKS = {
    "cococon": ("unicon.evaluation.cococon", "CocoConCallback"),
    "drift": ("unicon.evaluation.drift", "DriftCallback"),
    "ureason": ("unicon.evaluation.ureason", "UReasonCallback"),
}

EXAMPLES = """\
examples:
  unicon train experiment=shapes_demo
  unicon train experiment=shapes_consistency loss=hinge seed=1
  unicon train experiment=shapes_consistency_control trainer.max_steps=200
  unicon train loss.lambda_=0.5 loss.gamma=0.5 optim.lr=1e-5 trainer.max_epochs=3
  unicon train model.lora.enabled=true model.lora.r=16 trainer=gpu trainer.precision=bf16-mixed
  unicon train trainer=gpu trainer.devices=4 trainer.strategy=deepspeed_zero2
  unicon train resume=checkpoints/run/last.ckpt

main keys:
  name, seed, output_dir (run dir = <output_dir>/<name>), init_from, resume
  loss.type (spearman|hinge|none)  loss.lambda_  loss.gamma  loss.regularization_strength
  loss.tasks  loss.on_nonfinite (stop|skip)  optim.lr  optim.warmup_ratio  optim.scheduler
  trainer.max_epochs  trainer.max_steps  trainer.devices  trainer.strategy  trainer.precision
  trainer.accumulate_grad_batches  data.root  data.batch_size  data.contrast_batch_size
  data.max_contrast  data.num_workers  model.gradient_checkpointing  model.lora.*
"""


def _available() -> str:
    root = config_dir()
    lines = ["config groups (group=name):"]
    for group in (*GROUPS, "experiment"):
        names = sorted(p.stem for p in (root / group).glob("*.yaml"))
        lines.append(f"  {group:<11} {', '.join(names) or '-'}")
    jsons = sorted(p.stem for p in (root / "strategy").glob("*.json"))
    lines.append(f"  trainer.strategy: auto, ddp, fsdp{', ' + ', '.join(jsons) if jsons else ''}")
    return "\n".join(lines)


def cli(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="unicon train",
        description="Consistency training (CocoCon Algorithm 1) of a unified model with Lightning. "
        "Positional arguments are config overrides: group=name picks configs/<group>/<name>.yaml, "
        "experiment=name applies configs/experiment/<name>.yaml, key.sub=value sets one key.",
        epilog=_available() + "\n\n" + EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("overrides", nargs="*", help="group=name and key=value overrides")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    args = parser.parse_args(argv)
    try:
        cfg = compose(args.overrides)
    except ConfigError as e:
        raise UserError(str(e)) from None
    if args.print_config:
        print(to_yaml(cfg), end="")
        return 0
    from unicon.report import write_report

    result = train(cfg)
    print(f"checkpoint: {result['ckpt_path']}")
    print(f"export:     {result['export_dir']}")
    print(f"W&B run:    {result['wandb_dir'] or '(no W&B logger)'}")
    print(f"report:     {write_report(result['run_dir'])}  (metrics: {result['run_dir']}/metrics.jsonl)")
    return 0


# ---- pieces of train() ------------------------------------------------------------------------
def make_strategy(name: str):
    """Lightning strategy object/name for ``trainer.strategy``; checks CUDA for DeepSpeed up front."""
    if name not in STRATEGIES:
        raise UserError(f"trainer.strategy must be one of {', '.join(STRATEGIES)}, got {name!r}")
    if name.startswith("deepspeed"):
        if not torch.cuda.is_available():
            raise UserError(f"trainer.strategy={name} needs CUDA GPUs, but torch.cuda.is_available() is False "
                            "on this machine; use trainer.strategy=ddp or auto")
        path = config_dir() / "strategy" / f"{name}.json"
        if not path.is_file():
            raise UserError(f"no DeepSpeed config {path}")
        from lightning.pytorch.strategies import DeepSpeedStrategy

        return DeepSpeedStrategy(config=json.loads(path.read_text()))
    if name in ("ddp", "ddp_spawn"):
        from lightning.pytorch.strategies import DDPStrategy

        # A step uses a task-dependent subset of the parameters (e.g. OFA's image-code decoder
        # embeddings only in T2I, its ResNet only with image inputs), and ranks mix tasks differently.
        return DDPStrategy(find_unused_parameters=True, start_method="spawn" if name == "ddp_spawn" else "popen")
    if name == "fsdp":
        from lightning.pytorch.strategies import FSDPStrategy

        return FSDPStrategy(sharding_strategy="FULL_SHARD")
    return name


def build_training_model(cfg: DictConfig):
    """The UnifiedModel a run starts from, with the config's model options (dtype, freezing),
    gradient checkpointing and LoRA applied."""
    from unicon.models import apply_model_options, build_model, load_model
    from unicon.models.lora import apply_lora

    if cfg.init_from:
        if not Path(cfg.init_from).exists():
            raise UserError(f"init_from: {cfg.init_from} does not exist")
        model = apply_model_options(load_model(cfg.init_from, world_root=cfg.data.root), cfg.model)
        model.train()
    else:
        model = build_model(cfg.model, cfg.data.root)
    if cfg.model.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    if cfg.model.lora.enabled:
        try:
            apply_lora(model, cfg.model.lora)
        except ValueError as e:
            raise UserError(str(e)) from None
    return model


def enable_gradient_checkpointing(model: torch.nn.Module) -> None:
    """The backend's ``gradient_checkpointing_enable``, or that of its HF backbone (OFA keeps it inside)."""
    for module in model.modules():
        enable = getattr(module, "gradient_checkpointing_enable", None)
        if callable(enable) and getattr(module, "supports_gradient_checkpointing", True):
            if "gradient_checkpointing_kwargs" in inspect.signature(enable).parameters:  # HF PreTrainedModel
                enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            else:
                enable()
            return
    raise UserError(f"model.gradient_checkpointing: the {getattr(model, 'backend', type(model).__name__)} "
                    "backend has no gradient_checkpointing_enable()")


def make_eval_callbacks(cfg: DictConfig) -> list:
    """Epoch-end evaluation callbacks of the enabled suites whose module exists."""
    callbacks = []
    for suite, (module_name, cls_name) in EVAL_CALLBACKS.items():
        if not cfg.eval[suite].enabled:
            continue
        try:
            cls = getattr(importlib.import_module(module_name), cls_name)
        except (ImportError, AttributeError) as e:
            print(f"warning: eval.{suite} is enabled but {module_name}.{cls_name} is unavailable ({e}); skipped")
            continue
        callbacks.append(_make_callback(suite, cls, cfg))
    return callbacks


def _make_callback(suite: str, cls, cfg: DictConfig):
    """Each suite's constructor: ``from_config(RunConfig)`` where it has one, else ``(section, world_root)``."""
    if hasattr(cls, "from_config"):
        if suite == "ureason":
            return cls.from_config(cfg, fail_on_error=cfg.eval.fail_on_error)
        return cls.from_config(cfg)
    return cls(cfg.eval[suite], world_root=cfg.data.root, fail_on_error=cfg.eval.fail_on_error)


def _run_dir(cfg: DictConfig) -> Path:
    return Path(cfg.output_dir) / cfg.name


def train(cfg: DictConfig, extra_callbacks: list | None = None) -> dict[str, Any]:
    """Run one training job; returns ``{run_dir, ckpt_path, export_dir, wandb_dir, metrics}``."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint, RichProgressBar

    from unicon.training.checkpoints import export_model
    from unicon.training.datamodule import ConsistencyDataModule
    from unicon.training.loggers import make_loggers, wandb_run_dir
    from unicon.training.module import ConsistencyModule

    tcfg = cfg.trainer
    strategy = make_strategy(tcfg.strategy)  # fail early (DeepSpeed without CUDA)
    if cfg.resume and not Path(cfg.resume).exists():
        raise UserError(f"resume: checkpoint {cfg.resume} does not exist")
    run_dir = _run_dir(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(to_yaml(cfg))

    L.seed_everything(cfg.seed, workers=True, verbose=False)
    model = build_training_model(cfg)
    module = ConsistencyModule(model, cfg)
    datamodule = ConsistencyDataModule(cfg.data, seed=cfg.seed)
    loggers = make_loggers(cfg, run_dir)

    checkpoint = ModelCheckpoint(dirpath=str(run_dir), filename="{epoch}-{step}", save_last=True, save_top_k=1,
                                 every_n_train_steps=tcfg.checkpoint_every_n_steps)
    callbacks = [checkpoint, *make_eval_callbacks(cfg), *(extra_callbacks or [])]
    if tcfg.enable_progress_bar:
        callbacks.append(RichProgressBar())
    trainer = L.Trainer(
        default_root_dir=str(run_dir),
        max_epochs=tcfg.max_epochs,
        max_steps=tcfg.max_steps,
        accelerator=tcfg.accelerator,
        devices=tcfg.devices,
        num_nodes=tcfg.num_nodes,
        strategy=strategy,
        precision=tcfg.precision,
        accumulate_grad_batches=tcfg.accumulate_grad_batches,
        gradient_clip_val=tcfg.gradient_clip_val,
        log_every_n_steps=tcfg.log_every_n_steps,
        limit_train_batches=tcfg.limit_train_batches,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        deterministic=tcfg.deterministic,
        enable_progress_bar=tcfg.enable_progress_bar,
        logger=loggers,
        callbacks=callbacks,
    )
    trainer.fit(module, datamodule=datamodule, ckpt_path=cfg.resume)

    export_dir = run_dir / "export"
    if trainer.is_global_zero:
        if str(tcfg.strategy).startswith("deepspeed_zero3"):
            export_dir = None  # parameters are sharded; export from the checkpoint instead
            print("ZeRO-3: parameters are sharded across ranks; export with "
                  "unicon.training.checkpoints.export_checkpoint after zero_to_fp32 conversion")
        else:
            export_model(module.model, export_dir, merge=cfg.model.lora.merge_on_export)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if torch.is_tensor(v) and v.numel() == 1}
    return {
        "run_dir": str(run_dir),
        "ckpt_path": checkpoint.last_model_path or checkpoint.best_model_path or None,
        "export_dir": str(export_dir) if export_dir else None,
        "wandb_dir": wandb_run_dir(loggers),
        "metrics": metrics,
        "global_step": trainer.global_step,
        "counts": dict(module.counts),
    }


def train_from_overrides(overrides: list[str]) -> dict[str, Any]:
    """``train(compose(overrides))`` -- convenient in notebooks and tests."""
    return train(compose(overrides))
