"""Epoch-end evaluation: the shared callback base and logging of scalars and tables.

Each suite (``cococon``, ``drift``, ``ureason``, ``shapes``) subclasses :class:`EvalCallback` in its
own module and implements only ``evaluate(trainer, model) -> {metric: value}``. The base decides
*when* to run (every ``every_n_epochs`` training epochs), puts the model in eval mode under
``torch.no_grad``, times the run, isolates failures (an exception is logged and reported as
``<suite>/failed = 1`` unless ``fail_on_error``), and sends the scalars to every logger of the
trainer (W&B or CSV, and ``metrics.jsonl``). A SIGTERM/SIGUSR1 during an evaluation
(:mod:`unicon.evaluation.preemption`) stops it at the next batch, writes ``<run_dir>/last.ckpt`` and
ends the run.

Logging helpers, used by the callbacks and by ``unicon evaluate ...``:

* :func:`log_metrics` -- scalars to every logger;
* :func:`log_table` -- a table whose cells may be PIL images: a ``wandb.Table`` on W&B,
  ``<dir>/tables/<key>.jsonl`` (+ PNGs) for the CSV/JSONL loggers;
* :func:`log_figures` -- the PNG plots a suite wrote, as ``wandb.Image`` under stable keys
  ``<suite>/fig/<file stem>`` (e.g. ``cococon/fig/consistency_by_k``); other loggers already have
  the files in the suite's output folder;
* :func:`log_wandb` -- any other W&B value (custom charts); the path the two above take to W&B;
* :func:`log_eval_config` -- a standalone evaluation's arguments, weights fingerprint and
  environment as the run config (training runs: :func:`unicon.loggers.log_run_config`).

Everything for W&B goes through ``WandbLogger.log_metrics(values, step)``: a new history row with
``trainer/global_step = step``, W&B numbering its own step. Never ``wandb.log(..., step=...)``:
W&B ignores a row whose explicit step is below its current one, and Lightning has moved that
step on by the time an epoch-end evaluation logs (see :mod:`unicon.loggers`).

Under DDP every rank calls ``evaluate`` (the suites shard their work and sync metric states);
the loggers write on rank zero only.
"""

from __future__ import annotations

import argparse
import logging
import re
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import Logger, WandbLogger
from lightning.pytorch.utilities import rank_zero_only
from PIL import Image

from unicon import jsonsafe
from unicon.evaluation import preemption
from unicon.loggers import environment_info, flatten_config

log = logging.getLogger(__name__)


def log_metrics(loggers: Sequence[Logger], metrics: Mapping[str, float], step: int | None = None) -> None:
    """Send finite-or-not scalar metrics to every logger (rank zero only inside the loggers)."""
    scalars = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float, torch.Tensor))}
    for lg in loggers:
        lg.log_metrics(scalars, step=step)


def _safe_key(key: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", key)


@rank_zero_only
def log_wandb(loggers: Sequence[Logger], values: Mapping[str, Any], step: int | None = None) -> None:
    """Log W&B values (tables, images, charts) as one history row of every W&B logger, at
    ``trainer/global_step = step`` (see the module docstring)."""
    if values:
        for lg in loggers:
            if isinstance(lg, WandbLogger):
                lg.log_metrics(dict(values), step=step)


@rank_zero_only
def log_figures(loggers: Sequence[Logger], suite: str, out_dir: str | Path, names: Sequence[str],
                step: int | None = None) -> dict[str, Path]:
    """Log the figures ``<out_dir>/<name>.png`` that exist as ``wandb.Image`` under
    ``<suite>/fig/<name>``, in one history row. Returns ``{key: path}`` of those logged."""
    figures = {f"{suite}/fig/{name}": Path(out_dir) / f"{name}.png" for name in names}
    figures = {key: path for key, path in figures.items() if path.is_file()}
    if figures and any(isinstance(lg, WandbLogger) for lg in loggers):
        import wandb

        log_wandb(loggers, {key: wandb.Image(str(path)) for key, path in figures.items()}, step=step)
    return figures


@rank_zero_only
def log_eval_config(loggers: Sequence[Logger], args: argparse.Namespace, fingerprint: str | None) -> None:
    """The config of a standalone ``unicon evaluate`` run: its arguments (``args.<name>``), the
    weights fingerprint (``weights.fingerprint``) and the environment (git commit, versions)."""
    params = {**flatten_config({"args": vars(args)}), **environment_info()}
    if fingerprint:
        params["weights.fingerprint"] = fingerprint
    for lg in loggers:
        lg.log_hyperparams(params)


@rank_zero_only
def log_table(
    loggers: Sequence[Logger], key: str, columns: Sequence[str], rows: Sequence[Sequence[Any]], step: int | None = None
) -> None:
    """Log a table whose cells may be PIL images.

    W&B gets a ``wandb.Table`` (images as ``wandb.Image``). Every logger with a directory also
    gets ``<dir>/tables/<key>.jsonl`` with images saved beside it as PNG, so nothing depends on W&B.
    """
    written: set[str] = set()
    for lg in loggers:
        if isinstance(lg, WandbLogger):
            import wandb

            data = [[wandb.Image(c) if isinstance(c, Image.Image) else c for c in row] for row in rows]
            log_wandb([lg], {key: wandb.Table(columns=list(columns), data=data)}, step=step)
            continue
        base = getattr(lg, "log_dir", None) or getattr(lg, "save_dir", None)
        if not base or base in written:
            continue
        written.add(base)
        out = Path(base) / "tables"
        img_dir = out / _safe_key(key)
        out.mkdir(parents=True, exist_ok=True)
        with (out / f"{_safe_key(key)}.jsonl").open("a") as f:
            for i, row in enumerate(rows):
                rec = {"step": step}
                for col, cell in zip(columns, row):
                    if isinstance(cell, Image.Image):
                        img_dir.mkdir(parents=True, exist_ok=True)
                        p = img_dir / f"step{step}_{i}_{_safe_key(col)}.png"
                        cell.save(p)
                        cell = str(p.relative_to(out))
                    rec[col] = cell
                f.write(jsonsafe.dumps(rec, default=str) + "\n")  # non-finite numbers: null


def gathered_parameters(trainer: Trainer, model: torch.nn.Module):
    """The context an epoch-end evaluation runs in: the strategy's ``gathered_parameters(model)``
    where it has one (DeepSpeed ZeRO-3, whose partitioned parameters are gathered on every rank
    for the evaluation: :class:`unicon.training.zero.ZeroStrategy`), else nothing."""
    import contextlib

    gather = getattr(getattr(trainer, "strategy", None), "gathered_parameters", None)
    return gather(model) if callable(gather) else contextlib.nullcontext()


class EvalCallback(Callback):
    """Runs a suite's ``evaluate`` at the end of every ``every_n_epochs``-th training epoch."""

    #: metric prefix and artefact folder name, e.g. "cococon"
    name: str = "eval"

    def __init__(self, every_n_epochs: int = 1, fail_on_error: bool = False):
        if every_n_epochs < 1:
            raise ValueError(f"every_n_epochs must be >= 1, got {every_n_epochs}")
        self.every_n_epochs = every_n_epochs
        self.fail_on_error = fail_on_error
        self.last_metrics: dict[str, float] = {}

    # -- to implement -------------------------------------------------------------------------
    def evaluate(self, trainer: Trainer, model: torch.nn.Module) -> dict[str, float]:
        raise NotImplementedError

    # -- helpers for subclasses -----------------------------------------------------------------
    def output_dir(self, trainer: Trainer) -> Path:
        """``<run_dir>/eval/<name>/epoch-<e>``: where a suite writes per-sample files and plots."""
        d = Path(trainer.default_root_dir) / "eval" / self.name / f"epoch-{trainer.current_epoch + 1}"
        d.mkdir(parents=True, exist_ok=True)
        return d

    # -- Lightning hook -------------------------------------------------------------------------
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if (trainer.current_epoch + 1) % self.every_n_epochs:
            return
        if trainer.sanity_checking:
            return
        model = getattr(pl_module, "model", pl_module)
        was_training = model.training
        model.eval()
        start = time.perf_counter()
        try:
            with torch.no_grad(), preemption.watch_signals(), gathered_parameters(trainer, model):
                metrics = dict(self.evaluate(trainer, model))
            metrics[f"{self.name}/failed"] = 0.0
        except preemption.Preempted as e:
            # the epoch's training is complete: save it, so that a resumed run starts the next epoch
            # (this evaluation is not redone), and end the run
            model.train(was_training)
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
        finally:
            model.train(was_training)
        metrics[f"{self.name}/seconds"] = time.perf_counter() - start
        self.last_metrics = metrics
        log_metrics(trainer.loggers, metrics, step=trainer.global_step)
