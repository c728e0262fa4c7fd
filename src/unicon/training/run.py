"""``unicon train``: compose the config, build model + data, fit with Lightning, export.

``train(cfg)`` is the whole run, in named steps:

1. :func:`check_start`: refuse, before any work, a run this machine cannot run (CUDA, the
   strategy: :mod:`unicon.training.strategy`) or a ``resume`` checkpoint that cannot be read or is
   older than another one in its folder (:mod:`unicon.training.resume`);
2. under SLURM, install the checkpoint-and-requeue on the warning signal
   (:mod:`unicon.training.requeue`);
3. claim the run folder ``<output_dir>/<name>/`` (a lock file; a folder that already holds a run
   is refused unless this run resumes it or ``overwrite=true`` deletes it:
   :mod:`unicon.training.run_folder`), seed everything (``cfg.seed``) and write the resolved
   ``config.yaml`` there (the same config goes into every checkpoint);
4. build the model, or load it from ``resume`` / ``init_from`` (a ``model:`` section that
   describes another network than that checkpoint is refused), and turn on gradient checkpointing
   and LoRA if asked: one call, ``unicon.models.checkpoints.load_for_training``, given the resume
   checkpoint's dict that step 1 read;
5. wrap it in :class:`~unicon.training.module.ConsistencyModule` (Algorithm 1) with the
   :class:`~unicon.training.datamodule.ConsistencyDataModule`;
6. ``Trainer.fit`` (:func:`unicon.training.trainer.fit`) with the strategy of
   ``trainer.strategy`` (``auto``, ``ddp``, ``fsdp``, ``deepspeed_zero2[_offload]``,
   ``deepspeed_zero3[_offload]`` -- the DeepSpeed ones read ``configs/strategy/<name>.json``),
   ModelCheckpoint in the run directory, Lightning's LearningRateMonitor (``train/lr/decay``,
   ``train/lr/no_decay``), a rich progress bar, the loggers of ``unicon.loggers.make_loggers`` (the
   W&B run id kept in ``<run_dir>/wandb_run_id``; the flattened config, git commit, package
   versions and weights fingerprint as the W&B config) and the enabled epoch-end evaluations;
   ``resume=<ckpt>`` restores optimizer, scheduler, step, the γ generator and the data order, and
   continues the same W&B run;
7. export the final model with ``save_pretrained`` to ``<run_dir>/export`` (LoRA merged; a
   DeepSpeed run's export is converted from its last checkpoint folder, ZeRO-2 and ZeRO-3 alike:
   :mod:`unicon.training.export`).

``unicon train resume=CKPT [overrides]`` (:func:`compose_run`) is the same run: its config is the
one stored in ``CKPT``, with the command-line overrides on top, each change printed.
Checkpoints load with ``weights_only=True``; unpickling needs ``model.allow_pickle=true``. One
start reads each checkpoint once (:class:`~unicon.training.resume.CheckpointReads`, shared by
composing, the checks and the model's weights); Lightning's load of ``ckpt_path`` is the other.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from unicon.config import GROUPS, ConfigError, config_dir, to_yaml
from unicon.errors import UserError
from unicon.evaluation.preemption import Preempted
from unicon.report import collect, headline_table, write_report
from unicon.training.export import export_run
from unicon.training.requeue import SlurmRequeue, install_slurm_requeue
from unicon.training.resume import (
    CheckpointReads,
    compose_resumed,
    requeue_checkpoint,
    resume_checkpoint,
    slurm_restart_count,
)
from unicon.training.run_folder import claimed_run_dir, run_dir_of, write_run_config
from unicon.training.strategy import check_strategy, keeps_running_statistics, make_strategy
from unicon.training.trainer import fit, make_eval_callbacks


EXAMPLES = """\
examples:
  unicon train experiment=shapes_demo
  unicon train experiment=shapes_consistency loss=hinge seed=1
  unicon train experiment=shapes_consistency_control trainer.max_steps=200
  unicon train loss.lambda_=0.5 loss.gamma=0.5 optim.lr=1e-5 trainer.max_epochs=3
  unicon train model.lora.enabled=true model.lora.r=16 trainer=gpu trainer.precision=bf16-mixed
  unicon train trainer=gpu trainer.devices=4 trainer.strategy=deepspeed_zero2
  unicon train resume=checkpoints/run/last.ckpt trainer.max_epochs=4

precedence (later wins): schema defaults < group files (config.yaml defaults < experiment defaults
< group=name on the command line) < config.yaml body < experiment body < group files chosen on the
command line < key=value overrides. An experiment file with `extends: <experiment>` comes after its
parent's defaults and body. With resume=CKPT: the config stored in CKPT < command line.

main keys:
  name, seed, output_dir (run dir = <output_dir>/<name>), init_from, resume, resume_older, overwrite
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
    reads = CheckpointReads()  # this start reads each checkpoint once: composing, the checks, the weights
    try:
        cfg = compose_run(args.overrides, announce=not args.print_config, reads=reads)
    except ConfigError as e:
        raise UserError(str(e)) from None
    if args.print_config:
        print(to_yaml(cfg), end="")
        return 0

    result = train(cfg, reads=reads)
    report = write_report(result["run_dir"])
    table = headline_table(collect(Path(result["run_dir"])))
    if table:
        print(table)
    print(f"checkpoint: {result['ckpt_path']}")
    print(f"export:     {result['export_dir']}")
    print(f"W&B run:    {result['wandb_dir'] or '(no W&B logger)'}")
    print(f"report:     {report}  (metrics: {result['run_dir']}/metrics.jsonl)")
    return 0


def compose_run(overrides: list[str], announce: bool = True, reads: CheckpointReads | None = None) -> DictConfig:
    """The config of ``unicon train OVERRIDES``. With ``resume=CKPT`` it is the config stored in
    CKPT with the other overrides applied on top (each change printed when ``announce``).

    In a requeued SLURM job (``SLURM_RESTART_COUNT`` > 0) the command line is the one of the first
    start, so it says nothing about where the run got to: the run resumes from the newest
    checkpoint of its run folder (:func:`~unicon.training.resume.requeue_checkpoint`), exactly as
    with ``resume=``. ``reads``: the start's checkpoint reads, for :func:`train` to share."""
    reads = reads if reads is not None else CheckpointReads()
    restarts = slurm_restart_count()
    if restarts:
        ckpt = requeue_checkpoint(overrides, reads)
        if ckpt is not None:
            if announce:
                print(f"SLURM job {os.environ.get('SLURM_JOB_ID', '?')} restarted ({restarts}x): resuming from {ckpt}")
            overrides = [o for o in overrides if not o.startswith("resume=")] + [f"resume={ckpt}"]
    return compose_resumed(overrides, announce, reads)


def train(cfg: DictConfig, extra_callbacks: list | None = None,
          reads: CheckpointReads | None = None) -> dict[str, Any]:
    """Run one training job, the steps of the module docstring in order; returns ``{run_dir,
    ckpt_path, export_dir, wandb_dir, metrics, global_step, counts}``. ``reads``: the checkpoint
    reads of this start so far (:func:`compose_run`'s), shared."""
    import lightning as L
    import torch

    from unicon.data.coco_mixture import image_resize_for
    from unicon.loggers import log_run_artifacts, log_run_config, make_loggers, wandb_run_dir  # not for --help
    from unicon.models.checkpoints import load_for_training  # lazy: pulls in every model backend (transformers)
    from unicon.training.datamodule import ConsistencyDataModule  # lazy: pulls in Lightning
    from unicon.training.module import ConsistencyModule  # lazy: pulls in Lightning

    reads = reads if reads is not None else CheckpointReads()
    resumed = check_start(cfg, reads)
    requeue = install_slurm_requeue(run_dir_of(cfg))  # before the model loads: SIGUSR1 can come then
    try:
        with claimed_run_dir(cfg) as run_dir:
            eval_callbacks = make_eval_callbacks(cfg)  # a suite that cannot be built fails before any work
            if cfg.trainer.cpu_threads:
                torch.set_num_threads(int(cfg.trainer.cpu_threads))
            L.seed_everything(cfg.seed, workers=True, verbose=False)
            model = load_for_training(cfg, resumed)
            del resumed  # the weights are in the model; the reads map files that ModelCheckpoint rewrites
            reads.release()
            # built with the model: it decides whether DDP broadcasts buffers before every forward
            strategy = make_strategy(cfg.trainer.strategy, cfg.data.batch_size,
                                     broadcast_buffers=keeps_running_statistics(model))
            write_run_config(run_dir, cfg)  # after the checks: a refused run leaves no files
            module = ConsistencyModule(model, cfg)
            datamodule = ConsistencyDataModule(cfg.data, seed=cfg.seed, with_contrast=cfg.loss.gamma > 0,
                                               image_resize=image_resize_for(model))
            loggers = make_loggers(cfg, run_dir, persist_run_id=True)  # resume / requeue: the same W&B run
            log_run_config(loggers, cfg, model)  # flattened config, git commit, versions, weights fingerprint
            trainer, checkpoint = fit(cfg, run_dir, module, datamodule, strategy, loggers, requeue,
                                      [*eval_callbacks, *(extra_callbacks or [])])
            export_dir = export_run(trainer, module, checkpoint.last_model_path, run_dir, cfg)
            log_run_artifacts(loggers, cfg, export_dir, run_dir, step=trainer.global_step)  # logger.log_model=true
            return {
                "run_dir": str(run_dir),
                "ckpt_path": checkpoint.last_model_path or checkpoint.best_model_path or None,
                "export_dir": str(export_dir),
                "wandb_dir": wandb_run_dir(loggers),
                "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()
                            if torch.is_tensor(v) and v.numel() == 1},
                "global_step": trainer.global_step,
                "counts": dict(module.counts),
            }
    except Preempted:
        if requeue is not None:
            requeue.on_preempted()  # requeue the job (rank 0); the other ranks exit 0
        raise
    finally:
        reads.release()
        if requeue is not None:
            requeue.uninstall()


def check_start(cfg: DictConfig, reads: CheckpointReads) -> dict | None:
    """Refuse, before any work, what this run cannot start with: ``trainer.accelerator=gpu`` without
    CUDA, a strategy this machine cannot run (:func:`~unicon.training.strategy.check_strategy`:
    DeepSpeed without its package or its CPU Adam op), a ``resume`` checkpoint that cannot be read or
    is older than another one in its folder. Returns that checkpoint's dict
    (:func:`~unicon.training.resume.resume_checkpoint`), which the network and its weights come
    from; None without ``resume``."""
    import torch  # here, not at the top: unicon train --help needs no torch

    if cfg.trainer.accelerator in ("gpu", "cuda") and not torch.cuda.is_available():
        raise UserError(f"trainer.accelerator={cfg.trainer.accelerator} needs CUDA, but torch.cuda.is_available() is "
                        "False on this machine; use trainer=cpu")
    check_strategy(cfg.trainer.strategy, cfg.data.batch_size)
    return resume_checkpoint(cfg, reads) if cfg.resume else None


def train_from_overrides(overrides: list[str]) -> dict[str, Any]:
    """``train(compose_run(overrides))`` -- convenient in notebooks and tests."""
    reads = CheckpointReads()
    return train(compose_run(overrides, reads=reads), reads=reads)
