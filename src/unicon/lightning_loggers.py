"""The loggers of :mod:`unicon.loggers` that are built on Lightning's classes.

* :class:`UniconWandbLogger` -- Lightning's ``WandbLogger`` that defines a summary for the keys of
  :data:`SUMMARY_RULES` and finishes its W&B run when the run ends;
* :class:`KeepingCSVLogger` -- Lightning's ``CSVLogger`` that appends to a resumed run's ``metrics.csv``.

What they do and why: the docstring of :mod:`unicon.loggers`, whose :func:`~unicon.loggers.make_loggers`
imports this module when it makes one of them (a run without them imports no Lightning there).
"""

from __future__ import annotations

import csv
import os
import re
from typing import Any, Mapping

from lightning.pytorch.loggers import CSVLogger, WandbLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.utilities import rank_zero_only


class _KeepingCSVWriter(ExperimentWriter):
    """Lightning's CSV writer deletes an existing ``metrics.csv`` when it starts; this one appends
    to it (a resumed run), keeping its columns."""

    def _check_log_dir_exists(self) -> None:
        if self._fs.isfile(self.metrics_file_path):
            with self._fs.open(self.metrics_file_path, "r", newline="") as f:
                self.metrics_keys = sorted(next(csv.reader(f), []))


class KeepingCSVLogger(CSVLogger):
    """``CSVLogger`` that appends to the run's ``metrics.csv`` instead of deleting it on resume."""

    @property
    def experiment(self) -> ExperimentWriter:
        if self._experiment is None:
            os.makedirs(self.root_dir, exist_ok=True)
            self._experiment = _KeepingCSVWriter(log_dir=self.log_dir)
        return self._experiment


# ---- W&B: one step axis, summaries ----------------------------------------------------------------
STEP_KEY = "trainer/global_step"  # Lightning's x-axis for every W&B key (``define_metric("*", step_metric=...)``)

#: ``(pattern, summary)``: a logged key matching ``pattern`` gets ``define_metric(key, summary=...)``
#: (W&B globs only allow a trailing ``*``, hence patterns on the first use of each key). MCD is a
#: mean cosine *similarity* to the chain's input: higher means less drift.
SUMMARY_RULES: tuple[tuple[re.Pattern, str], ...] = (
    (re.compile(r"^cococon/.+/(C_\d+|acc@\d+|rho)$"), "max,last"),
    (re.compile(r"^drift/(.+/)?(MCD_\w+|MGG(_\w+)?)$"), "max,last"),
    (re.compile(r"^drift/drift_rate_\w+$"), "min,last"),
    (re.compile(r"^ureason/(acc_s\d|chain_acc)$"), "max,last"),
    (re.compile(r"^train/loss(_ce|_const)?$"), "min,last"),
)


def summary_for(key: str) -> str | None:
    """The W&B summary aggregation of a metric key (:data:`SUMMARY_RULES`), or None."""
    return next((summary for pattern, summary in SUMMARY_RULES if pattern.match(key)), None)


def _is_scalar(value: Any) -> bool:
    if hasattr(value, "numel"):  # a tensor
        return value.numel() == 1
    return isinstance(value, (int, float))


class UniconWandbLogger(WandbLogger):
    """Lightning's ``WandbLogger`` that defines the summary of each :data:`SUMMARY_RULES` key the
    first time it is logged (with ``trainer/global_step`` as its x-axis: a key's own definition
    replaces the ``"*"`` glob's)."""

    def __init__(self, *args, artifacts: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        # Lightning passes wandb.init anonymous=None, a setting wandb deprecates (it warns when one is given)
        self._wandb_init.pop("anonymous", None)
        self._defined: set[str] = set()
        self.artifacts = artifacts  # logger.log_model: log_run_artifacts logs, then finishes the run
        self._finish_pending = False

    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        for key, value in metrics.items():
            if key in self._defined or not _is_scalar(value):  # tables, images, charts: no summary
                continue
            self._defined.add(key)
            summary = summary_for(key)
            if summary:
                self.experiment.define_metric(key, step_metric=STEP_KEY, step_sync=True, summary=summary)
        super().log_metrics(metrics, step)

    @rank_zero_only
    def finalize(self, status: str) -> None:
        """Lightning's finalize, then finish the W&B run when the run is over (``success`` /
        ``failed``; not ``finished``, which Lightning's SLURM requeue handler sends while training
        goes on until the job is killed). Lightning would leave it open until the process exits,
        and a later ``WandbLogger`` in the same process would log into it. One ``fit`` per logger."""
        super().finalize(status)
        if status in ("success", "failed") and self._experiment is not None:
            if status == "success" and self.artifacts:
                self._finish_pending = True  # the export comes after fit: log_run_artifacts finishes the run
                return
            self._experiment.finish(exit_code=0 if status == "success" else 1)

    def finish_run(self) -> None:
        """Finish the W&B run that ``finalize("success")`` left open for the artifacts."""
        if self._experiment is not None:
            self._experiment.finish(exit_code=0)
        self._finish_pending = False
