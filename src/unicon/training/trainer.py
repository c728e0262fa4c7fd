"""The Lightning ``Trainer`` of a run and its ``fit`` (:func:`fit`): the trainer's callbacks
(``ModelCheckpoint`` in the run folder, the log files, the SLURM requeue hooks, Lightning's
``LearningRateMonitor`` (``train/lr/decay``, ``train/lr/no_decay``), the epoch-end evaluations of the
enabled suites (:func:`make_eval_callbacks`), a rich progress bar) and plugins (:func:`make_trainer`)."""

from __future__ import annotations

import signal
from pathlib import Path

from omegaconf import DictConfig

from unicon.evaluation.suites import suites
from unicon.training.requeue import SlurmRequeue


def make_eval_callbacks(cfg: DictConfig) -> list:
    """Epoch-end evaluation callbacks of the enabled suites. A suite that cannot be built fails the
    run here, before training starts (never silently skipped). A plugin suite's section is in every
    composed config (:func:`unicon.config.set_eval_sections`), so its callback is built like an in-tree one."""
    from unicon.evaluation.callbacks import SuiteCallback  # lazy: pulls in Lightning

    return [SuiteCallback.from_config(s, cfg) for s in suites().values() if cfg.eval[s.section].enabled]


def make_trainer(cfg: DictConfig, run_dir: Path, strategy, loggers: list, requeue: SlurmRequeue | None,
                 more_callbacks: list):
    """``(trainer, checkpoint)``: the ``Trainer`` of ``cfg.trainer`` and its ``ModelCheckpoint``.
    ``more_callbacks`` (the epoch-end evaluations, then the caller's) come after the built-in ones."""
    import lightning as L
    from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint, RichProgressBar

    from unicon.training.log_files import LogFilesCallback  # lazy: pulls in Lightning

    tcfg = cfg.trainer
    # no version counter: last.ckpt is always the newest checkpoint. With one, a resume whose checkpoint
    # names another folder (the run folder moved, output_dir= changed) does not own the last.ckpt it
    # finds, so it writes last-v1.ckpt and leaves last.ckpt at the old step (resume=<run>/last.ckpt
    # would then go back); "{epoch}-{step}" names never collide between steps
    checkpoint = ModelCheckpoint(dirpath=str(run_dir), filename="{epoch}-{step}", save_last=True, save_top_k=1,
                                 every_n_train_steps=tcfg.checkpoint_every_n_steps, enable_version_counter=False)
    # SlurmRequeue's hooks before the LR monitor's and the evaluations': a stop requested at a batch
    # start or an epoch end comes before anything logs a row for a step the checkpoint does not hold
    callbacks = [checkpoint, LogFilesCallback(loggers), *([requeue.callback] if requeue else []),
                 LearningRateMonitor(logging_interval="step"), *more_callbacks]
    plugins = []
    if requeue is not None:
        from lightning.fabric.plugins.environments import SLURMEnvironment

        # Lightning would pick SLURMEnvironment by itself, with auto_requeue=True: its SIGUSR1
        # handler checkpoints mid-step (see SlurmRequeue); SlurmRequeue owns the signal instead.
        plugins.append(SLURMEnvironment(auto_requeue=False))
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
        plugins=plugins or None,
    )
    return trainer, checkpoint


def fit(cfg: DictConfig, run_dir: Path, module, datamodule, strategy, loggers: list, requeue: SlurmRequeue | None,
        more_callbacks: list):
    """``(trainer, checkpoint)`` of :func:`make_trainer`, after ``trainer.fit`` of ``module`` on
    ``datamodule``, from ``cfg.resume`` when set (optimizer, scheduler, step, loops).

    When ``fit`` fails, the ranks this process launched are killed. With ``trainer.devices`` > 1
    outside SLURM (or torchrun), Lightning's subprocess launcher starts ranks 1.. as children of
    rank 0 at the start of ``fit``. A failing child ends them all (Lightning's observer kills every
    process); a failing rank 0 left the children waiting for it: in the process group's rendezvous
    (rank 0 hosts its store) for the 30-minute timeout, or in a collective forever. Under SLURM each
    rank is a task of its own, which ``srun --kill-on-bad-exit=1`` (slurm/train.sbatch) ends when
    another one fails. Nothing is killed in the launched ranks and with one process."""
    from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher

    trainer, checkpoint = make_trainer(cfg, run_dir, strategy, loggers, requeue, more_callbacks)
    try:
        trainer.fit(module, datamodule=datamodule, ckpt_path=cfg.resume, weights_only=not cfg.model.allow_pickle)
    except BaseException:
        launcher = getattr(trainer.strategy, "launcher", None)
        if isinstance(launcher, _SubprocessScriptLauncher):
            launcher.kill(signal.SIGKILL)
        raise
    return trainer, checkpoint
