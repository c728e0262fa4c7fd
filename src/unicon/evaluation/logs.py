"""Logging of evaluation results to a run's loggers: scalars, tables, figures, W&B values, the config.

Used by the epoch-end callback (:mod:`unicon.evaluation.callbacks`) and by ``unicon evaluate ...``
(:meth:`unicon.evaluation.framework.EvalSuite.log_media`, the same keys for both).

Everything for W&B goes through ``WandbLogger.log_metrics(values, step)``: a new history row with
``trainer/global_step = step``, W&B numbering its own step. Never ``wandb.log(..., step=...)``:
W&B ignores a row whose explicit step is below its current one, and Lightning has moved that
step on by the time an epoch-end evaluation logs (see :mod:`unicon.loggers`).

The loggers are those of :func:`unicon.loggers.make_loggers` (Lightning's, or
:class:`~unicon.loggers.JsonlLogger`), used through their methods: this module imports no Lightning,
so that a standalone evaluation reaches its first batch, and with ``--logger none`` its end, without
it. The helpers write on global rank zero only (:func:`unicon.loggers.on_rank_zero`).
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
from PIL import Image

from unicon import jsonsafe
from unicon.loggers import environment_info, flatten_config, is_wandb, on_rank_zero


def log_metrics(loggers: Sequence[Any], metrics: Mapping[str, float], step: int | None = None) -> None:
    """Send finite-or-not scalar metrics to every logger (rank zero only inside the loggers)."""
    scalars = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float, torch.Tensor))}
    for lg in loggers:
        lg.log_metrics(scalars, step=step)


def _safe_key(key: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", key)


@on_rank_zero
def log_wandb(loggers: Sequence[Any], values: Mapping[str, Any], step: int | None = None) -> None:
    """Log W&B values (tables, images, charts) as one history row of every W&B logger, at
    ``trainer/global_step = step`` (see the module docstring)."""
    if values:
        for lg in loggers:
            if is_wandb(lg):
                lg.log_metrics(dict(values), step=step)


@on_rank_zero
def log_figures(loggers: Sequence[Any], suite: str, out_dir: str | Path, names: Sequence[str],
                step: int | None = None) -> dict[str, Path]:
    """Log the figures ``<out_dir>/<name>.png`` that exist as ``wandb.Image`` under
    ``<suite>/fig/<name>``, in one history row (other loggers have the files in the suite's output
    folder). Returns ``{key: path}`` of those logged."""
    figures = {f"{suite}/fig/{name}": Path(out_dir) / f"{name}.png" for name in names}
    figures = {key: path for key, path in figures.items() if path.is_file()}
    if figures and any(is_wandb(lg) for lg in loggers):
        import wandb

        log_wandb(loggers, {key: wandb.Image(str(path)) for key, path in figures.items()}, step=step)
    return figures


@on_rank_zero
def log_eval_config(loggers: Sequence[Any], args: argparse.Namespace, fingerprint: str | None) -> None:
    """The config of a standalone ``unicon evaluate`` run: its arguments (``args.<name>``), the
    weights fingerprint (``weights.fingerprint``) and the environment (git commit, versions); a
    training run's is :func:`unicon.loggers.log_run_config`."""
    params = {**flatten_config({"args": vars(args)}), **environment_info()}
    if fingerprint:
        params["weights.fingerprint"] = fingerprint
    for lg in loggers:
        lg.log_hyperparams(params)


@on_rank_zero
def log_table(
    loggers: Sequence[Any], key: str, columns: Sequence[str], rows: Sequence[Sequence[Any]],
    step: int | None = None,
) -> None:
    """Log a table whose cells may be PIL images.

    W&B gets a ``wandb.Table`` (images as ``wandb.Image``). Every logger with a directory also
    gets ``<dir>/tables/<key>.jsonl`` with images saved beside it as PNG, so nothing depends on W&B.
    """
    written: set[str] = set()
    for lg in loggers:
        if is_wandb(lg):
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
