"""CocoCon at the end of training epochs: :class:`CocoConCallback`.

Every rank evaluates its shard (:func:`.runner.evaluate_model`); rank zero writes
``<run_dir>/eval/cococon/epoch-<e>/`` (results, per-sample rows, plots) and logs the figures and
the sample table (:func:`.runner.table_rows`, as ``unicon evaluate cococon``); the base class logs
the scalars.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from unicon.config import CocoConEvalConfig
from unicon.data.cococon import CocoConData, load_cococon
from unicon.evaluation.callbacks import EvalCallback
from unicon.evaluation.cococon.metrics import TASKS
from unicon.evaluation.cococon.plots import FIGURES
from unicon.evaluation.cococon.runner import TABLE_COLUMNS, evaluate_model, table_rows, write_outputs
from unicon.evaluation.logs import log_figures, log_table


class CocoConCallback(EvalCallback):
    """Runs CocoCon on a fixed subset at the end of every ``every_n_epochs``-th epoch."""

    name = "cococon"

    def __init__(self, data: str | Path, images_root: str | Path | None = None,
                 max_samples: int | None = CocoConEvalConfig.max_samples,
                 batch_size: int = CocoConEvalConfig.batch_size, generative: bool = CocoConEvalConfig.generative,
                 table_rows: int = CocoConEvalConfig.table_rows,
                 skip_missing: bool = CocoConEvalConfig.skip_missing, tasks: Sequence[str] = TASKS,
                 every_n_epochs: int = CocoConEvalConfig.every_n_epochs, fail_on_error: bool = False,
                 probe_words: Sequence[str] = ()):
        super().__init__(every_n_epochs=every_n_epochs, fail_on_error=fail_on_error)
        self.probe_words = tuple(probe_words)
        self.data_path = Path(data)
        self.images_root = images_root
        self.max_samples = max_samples
        self.batch_size = batch_size
        self.generative = generative
        self.table_rows = table_rows
        self.skip_missing = skip_missing
        self.tasks = tuple(tasks)
        self._data: CocoConData | None = None

    @classmethod
    def from_config(cls, cfg) -> "CocoConCallback":
        """From a RunConfig: ``eval.cococon`` with defaults ``<data.root>/cococon_test.json``."""
        c = cfg.eval.cococon
        data = c.data or str(Path(cfg.data.root) / "cococon_test.json")
        return cls(data=data, images_root=c.images_root, max_samples=c.max_samples, batch_size=c.batch_size,
                   generative=c.generative, table_rows=c.table_rows, skip_missing=c.skip_missing, tasks=list(c.tasks),
                   every_n_epochs=c.every_n_epochs, fail_on_error=cfg.eval.fail_on_error,
                   probe_words=list(c.probe_words))

    def dataset(self) -> CocoConData:
        if self._data is None:
            self._data = load_cococon(self.data_path, self.images_root, self.skip_missing).subset(self.max_samples)
        return self._data

    def evaluate(self, trainer, model) -> dict[str, float]:
        data = self.dataset()
        result = evaluate_model(model, data.samples, self.batch_size, generative=self.generative,
                                world_root=data.images_root, tasks=self.tasks, probe_words=self.probe_words)
        if trainer.is_global_zero:
            out = self.output_dir(trainer)
            write_outputs(result, out)
            log_figures(trainer.loggers, "cococon", out, FIGURES, step=trainer.global_step)
            if self.table_rows:
                rows = table_rows(result, {s.index: s for s in data.samples}, self.table_rows)
                log_table(trainer.loggers, "cococon/samples", TABLE_COLUMNS, rows, step=trainer.global_step)
        return result.flat()
