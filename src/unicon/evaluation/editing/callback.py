"""EditingScore at the end of training epochs: :class:`EditingCallback` (``eval.editing``).

Scores the first ``max_samples`` rows of ``data`` (default: ``<data.root>/editscore/editscore.jsonl``,
written by ``unicon build-data shapes``) and, with ``own_edits``, the model's own edits of the world's
first test edit rows (:func:`~unicon.evaluation.editing.runner.evaluate_editing`), sharded over the
trainer's ranks; writes ``<run_dir>/eval/editing/epoch-<e>/`` (rank 0) and logs Kendall's tau_b of the
score, its ablations and components against every criterion as ``editing/tau_b/<variant>/<criterion>``,
the figures and a table of samples. A bad data file fails before training starts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from unicon.config import EditingEvalConfig
from unicon.evaluation.callbacks import EvalCallback
from unicon.evaluation.logs import log_figures, log_table
from unicon.evaluation.editing.cli import default_data
from unicon.evaluation.editing.data import EditSample, load_samples
from unicon.evaluation.editing.plots import FIGURES
from unicon.evaluation.editing.runner import TABLE_COLUMNS, evaluate_editing, table_rows


class EditingCallback(EvalCallback):
    """Logs ``editing/tau_b/<variant>/<criterion>`` every ``every_n_epochs`` epochs.
    Defaults: :class:`unicon.config.EditingEvalConfig`."""

    name = "editing"

    def __init__(
        self,
        data: str | Path,
        world: str | Path | None = None,
        max_samples: int | None = EditingEvalConfig.max_samples,
        batch_size: int = EditingEvalConfig.batch_size,
        own_edits: int = EditingEvalConfig.own_edits,
        table_rows: int = EditingEvalConfig.table_rows,
        every_n_epochs: int = EditingEvalConfig.every_n_epochs,
        fail_on_error: bool = False,
    ):
        super().__init__(every_n_epochs=every_n_epochs, fail_on_error=fail_on_error)
        self.data, self.world = Path(data), Path(world) if world is not None else None
        self.max_samples, self.batch_size, self.own_edits, self.table_rows = max_samples, batch_size, own_edits, table_rows
        self._samples: list[EditSample] | None = None
        self.samples()  # a bad data file fails before training starts

    @classmethod
    def from_config(cls, cfg: Any) -> "EditingCallback":
        """From a RunConfig: ``eval.editing.*``; data defaults to the world's editscore file."""
        c = cfg.eval.editing
        return cls(data=c.data or default_data(cfg.data.root), world=cfg.data.root, max_samples=c.max_samples,
                   batch_size=c.batch_size, own_edits=c.own_edits, table_rows=c.table_rows,
                   every_n_epochs=c.every_n_epochs, fail_on_error=cfg.eval.fail_on_error)

    def samples(self) -> list[EditSample]:
        if self._samples is None:
            self._samples = load_samples(self.data, self.max_samples)
        return self._samples

    def evaluate(self, trainer, model) -> dict[str, float]:
        out = self.output_dir(trainer)
        results, records = evaluate_editing(
            model, self.samples(), out, self.batch_size, info={"epoch": trainer.current_epoch + 1, "data": str(self.data)},
            own_edits=self.own_edits, world_root=self.world if self.own_edits else None,
            data_root=self.data.resolve().parent)
        log_table(trainer.loggers, "editing/samples", TABLE_COLUMNS, table_rows(records, self.samples(), self.table_rows),
                  step=trainer.global_step)
        log_figures(trainer.loggers, "editing", out, FIGURES, step=trainer.global_step)
        return {f"editing/{k}": v for k, v in results["metrics"].items()}  # the names `unicon evaluate editing` logs
