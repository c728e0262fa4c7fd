"""UReason at the end of training epochs: :class:`UReasonCallback`.

Runs the three settings (:func:`~unicon.evaluation.ureason.runner.evaluate_ureason`) on a fixed
round-robin subset, sharded over the trainer's ranks, writes ``<run_dir>/eval/ureason/epoch-<e>/``
(rank 0) and logs the headline metrics and an image table. Reads the data directory; loads a judge
model only when ``judge`` names one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from unicon.config import UReasonEvalConfig
from unicon.data.ureason import UReasonInstance, load_instances, subset, world_root_of
from unicon.evaluation.callbacks import EvalCallback
from unicon.evaluation.logs import log_figures, log_table
from unicon.evaluation.ureason.judges import Judge, build_judge, check_judge_fits
from unicon.evaluation.ureason.plots import FIGURES
from unicon.evaluation.ureason.runner import TABLE_COLUMNS, evaluate_ureason, table_rows

class UReasonCallback(EvalCallback):
    """Logs every UReason metric as ``ureason/<key>`` (``acc_s{1,2,3}``, ``delta_12``, ``delta_23``,
    ``chain_acc``, ``fallback_rate``, per category), as ``unicon evaluate ureason`` does, every
    ``every_n_epochs`` epochs. Defaults: :class:`unicon.config.UReasonEvalConfig`."""

    name = "ureason"

    def __init__(
        self,
        data: str | Path,
        judge: str | Judge = UReasonEvalConfig.judge,
        chain_judge: str | None = UReasonEvalConfig.chain_judge,
        max_samples: int | None = UReasonEvalConfig.max_samples,
        max_new_tokens: int = UReasonEvalConfig.max_new_tokens,
        batch_size: int = UReasonEvalConfig.batch_size,
        table_rows: int = UReasonEvalConfig.table_rows,
        every_n_epochs: int = UReasonEvalConfig.every_n_epochs,
        fail_on_error: bool = False,
    ):
        super().__init__(every_n_epochs=every_n_epochs, fail_on_error=fail_on_error)
        self.data, self.max_samples = data, max_samples
        self.max_new_tokens, self.batch_size, self.table_rows = max_new_tokens, batch_size, table_rows
        self._judge_spec, self._chain_spec = judge, chain_judge
        self._judge: Judge | None = judge if isinstance(judge, Judge) else None
        self._instances: list[UReasonInstance] | None = None

    @classmethod
    def from_config(cls, cfg: Any) -> "UReasonCallback":
        """From a RunConfig: ``eval.ureason.*``; data defaults to ``<data.root>`` (its ``ureason/``)."""
        u = cfg.eval.ureason
        return cls(
            data=u.data or cfg.data.root,
            judge=u.judge,
            chain_judge=u.chain_judge,
            max_samples=u.max_samples,
            max_new_tokens=u.max_new_tokens,
            batch_size=u.batch_size,
            table_rows=u.table_rows,
            every_n_epochs=u.every_n_epochs,
            fail_on_error=cfg.eval.fail_on_error,
        )

    def instances(self) -> list[UReasonInstance]:
        if self._instances is None:
            self._instances = subset(load_instances(self.data), self.max_samples)
            check_judge_fits(self._judge_spec, self._instances)
        return self._instances

    def judge(self) -> Judge:
        if self._judge is None:
            self._judge = build_judge(str(self._judge_spec), chain=self._chain_spec,
                                      world_root=world_root_of(self.data))
        return self._judge

    def evaluate(self, trainer, model) -> dict[str, float]:
        metrics, samples = evaluate_ureason(
            model, self.instances(), self.judge(), out_dir=self.output_dir(trainer),
            max_new_tokens=self.max_new_tokens, batch_size=self.batch_size,
            info={"epoch": trainer.current_epoch + 1}, device=trainer.strategy.root_device)
        log_table(trainer.loggers, "ureason/samples", TABLE_COLUMNS, table_rows(samples, self.table_rows),
                  step=trainer.global_step)
        log_figures(trainer.loggers, "ureason", self.output_dir(trainer), FIGURES, step=trainer.global_step)
        return {f"ureason/{k}": v for k, v in metrics.items()}  # the names `unicon evaluate ureason` logs
