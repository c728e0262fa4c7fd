"""Epoch-end evaluation: :class:`SuiteCallback`, the one callback of every registered suite
(:mod:`unicon.evaluation.framework`). It decides *when* to run (every ``every_n_epochs`` training
epochs), puts the model in eval mode under ``torch.no_grad``, times the run, isolates failures (an
exception is logged and reported as ``<suite>/failed = 1`` unless ``fail_on_error``), and sends the
scalars to every logger of the trainer (W&B or CSV, and ``metrics.jsonl``). A SIGTERM/SIGUSR1 during
an evaluation (:mod:`unicon.evaluation.preemption`) stops it at the next batch, writes
``<run_dir>/last.ckpt`` and ends the run.
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from unicon.evaluation import preemption
from unicon.evaluation.framework import EvalRun, eval_mode
from unicon.evaluation.logs import log_metrics

log = logging.getLogger(__name__)


def gathered_parameters(trainer: Trainer, model: torch.nn.Module):
    """The context an epoch-end evaluation runs in: the strategy's ``gathered_parameters(model)``
    where it has one (DeepSpeed ZeRO-3, whose partitioned parameters are gathered on every rank
    for the evaluation: :class:`unicon.training.zero.ZeroStrategy`), else nothing."""
    gather = getattr(getattr(trainer, "strategy", None), "gathered_parameters", None)
    return gather(model) if callable(gather) else contextlib.nullcontext()


class SuiteCallback(Callback):
    """The epoch-end run of a suite (:class:`unicon.evaluation.framework.EvalSuite`) at the end of every
    ``every_n_epochs``-th training epoch: its data is loaded and checked at construction (a bad file
    fails before training), the model checked at ``setup``; every rank runs
    :meth:`~unicon.evaluation.framework.EvalSuite.run` into ``<run_dir>/eval/<suite>/epoch-<e>/``,
    rank 0 logs its figures and table, and every logger its scalars: the names the suite's command
    logs."""

    def __init__(self, suite, config, root: str | None = None, every_n_epochs: int = 1, fail_on_error: bool = False):
        if every_n_epochs < 1:
            raise ValueError(f"every_n_epochs must be >= 1, got {every_n_epochs}")
        self.every_n_epochs = every_n_epochs
        self.fail_on_error = fail_on_error
        self.last_metrics: dict[str, float] = {}
        self.suite, self.config, self.name = suite, config, suite.name  # name: metric prefix and folder name
        self.inputs = suite.load(config, None, root)
        self.cache: dict = {}  # what the suite keeps across epoch ends (judges, embedders)

    @classmethod
    def from_config(cls, suite, run_cfg) -> "SuiteCallback":
        """``suite``'s callback of a composed run config: ``eval.<section>`` (its data defaulted as
        :meth:`~unicon.evaluation.framework.EvalSuite.default_data` says), ``data.root`` and
        ``eval.fail_on_error``."""
        return cls(suite, suite.config_of(run_cfg), root=str(run_cfg.data.root),
                   every_n_epochs=run_cfg.eval[suite.section].every_n_epochs, fail_on_error=run_cfg.eval.fail_on_error)

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self.suite.check_model(getattr(pl_module, "model", pl_module), self.inputs, self.config)

    def output_dir(self, trainer: Trainer) -> Path:
        """``<run_dir>/eval/<name>/epoch-<e>``: where the suite writes per-sample files and plots."""
        d = Path(trainer.default_root_dir) / "eval" / self.name / f"epoch-{trainer.current_epoch + 1}"
        d.mkdir(parents=True, exist_ok=True)
        return d

    def evaluate(self, trainer: Trainer, model: torch.nn.Module) -> dict[str, float]:
        out = self.output_dir(trainer)
        run = EvalRun(self.config, self.inputs, model, out, str(trainer.strategy.root_device),
                      epoch=trainer.current_epoch + 1, is_writer=trainer.is_global_zero, cache=self.cache)
        outcome = self.suite.run(run)
        if trainer.is_global_zero:
            self.suite.log_media(trainer.loggers, outcome, out, step=trainer.global_step)
        return outcome.metrics

    # -- Lightning hook -------------------------------------------------------------------------
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if (trainer.current_epoch + 1) % self.every_n_epochs:
            return
        if trainer.sanity_checking:
            return
        model = getattr(pl_module, "model", pl_module)
        start = time.perf_counter()
        try:  # eval_mode restores the model's training mode before any handler below runs
            with eval_mode(model), preemption.watch_signals(), gathered_parameters(trainer, model):
                metrics = dict(self.evaluate(trainer, model))
            metrics[f"{self.name}/failed"] = 0.0
        except preemption.Preempted as e:
            # the epoch's training is complete: save it, so that a resumed run starts the next epoch
            # (this evaluation is not redone), and end the run
            e.checkpoint = str(Path(trainer.default_root_dir) / "last.ckpt")
            log.warning("%s evaluation preempted (%s) at epoch %d; writing %s", self.name, e,
                        trainer.current_epoch, e.checkpoint)
            trainer.save_checkpoint(e.checkpoint)
            raise
        except Exception:
            if self.fail_on_error:
                raise
            log.exception("%s evaluation failed at epoch %d; training continues", self.name, trainer.current_epoch)
            metrics = {f"{self.name}/failed": 1.0}
        metrics[f"{self.name}/seconds"] = time.perf_counter() - start
        self.last_metrics = metrics
        log_metrics(trainer.loggers, metrics, step=trainer.global_step)
