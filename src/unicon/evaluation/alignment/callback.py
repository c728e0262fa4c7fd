"""BagelScore alignment at the end of training epochs: :class:`AlignmentCallback` (``eval.alignment``).

Scores the first ``max_samples`` pairs of ``data`` (default: the run's ``data.root``, a ShapesWorld root
with ``alignment/pairs.jsonl``) with BagelScore in ``bagel_modes`` and the ``baselines``
(:func:`~unicon.evaluation.alignment.runner.evaluate_alignment`), sharded over the trainer's ranks;
writes ``<run_dir>/eval/alignment/epoch-<e>/`` (rank 0) and logs every metric's τ_b / τ_c as
``alignment/<metric>/tau_b``, the decode failure rate, the scatter figure and a table of samples. The
CLIP (``clip``) and the VLM judge are loaded once, at the first evaluation; a bad data file fails
before training starts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from unicon.config import AlignmentEvalConfig
from unicon.evaluation.alignment.cli import load_clip
from unicon.evaluation.alignment.data import Pair, data_file, load_pairs, subset
from unicon.evaluation.alignment.judges import build_judge, check_judge
from unicon.evaluation.alignment.metrics import flat_metrics
from unicon.evaluation.alignment.plots import FIGURES
from unicon.evaluation.alignment.runner import evaluate_alignment, resolve_bagel_scale, table_columns, table_rows
from unicon.evaluation.callbacks import EvalCallback
from unicon.evaluation.logs import log_figures, log_table


class AlignmentCallback(EvalCallback):
    """Logs ``alignment/<metric>/{tau_b,tau_c,n}`` every ``every_n_epochs`` epochs.
    Defaults: :class:`unicon.config.AlignmentEvalConfig`."""

    name = "alignment"

    def __init__(
        self,
        data: str | Path,
        images: str | None = None,
        bagel_modes: Sequence[str] = tuple(AlignmentEvalConfig().bagel_modes),
        baselines: Sequence[str] = tuple(AlignmentEvalConfig().baselines),
        clip: str | None = None,
        judge: str | None = None,
        clip_prefix: str = AlignmentEvalConfig.clip_prefix,
        bagel_scale: str = AlignmentEvalConfig.bagel_scale,
        rating_min: float | None = None,
        rating_max: float | None = None,
        max_samples: int | None = AlignmentEvalConfig.max_samples,
        batch_size: int = AlignmentEvalConfig.batch_size,
        table_rows: int = AlignmentEvalConfig.table_rows,
        every_n_epochs: int = AlignmentEvalConfig.every_n_epochs,
        fail_on_error: bool = False,
    ):
        super().__init__(every_n_epochs=every_n_epochs, fail_on_error=fail_on_error)
        check_judge(judge)
        self.data, self.images, self.bagel_modes, self.baselines = data, images, list(bagel_modes), list(baselines)
        self.clip_source, self.judge_spec = clip, judge
        self.clip_prefix = clip_prefix
        self.bagel_scale = resolve_bagel_scale(bagel_scale, data_file(data))
        self.rating_min, self.rating_max, self.max_samples = rating_min, rating_max, max_samples
        self.batch_size, self.table_rows = batch_size, table_rows
        self._pairs: list[Pair] | None = None
        self._skipped: dict[str, int] = {}
        self._clip = self._judge = None
        self.pairs()  # a bad data file fails before training starts

    @classmethod
    def from_config(cls, cfg: Any) -> "AlignmentCallback":
        """From a RunConfig: ``eval.alignment.*``; data defaults to ``data.root``."""
        c = cfg.eval.alignment
        return cls(data=c.data or cfg.data.root, images=c.images, bagel_modes=list(c.bagel_modes),
                   baselines=list(c.baselines), clip=c.clip, judge=c.judge, clip_prefix=c.clip_prefix,
                   bagel_scale=c.bagel_scale, rating_min=c.rating_min,
                   rating_max=c.rating_max, max_samples=c.max_samples, batch_size=c.batch_size,
                   table_rows=c.table_rows, every_n_epochs=c.every_n_epochs,
                   fail_on_error=cfg.eval.fail_on_error)

    def pairs(self) -> list[Pair]:
        if self._pairs is None:
            pairs, skipped = load_pairs(self.data, self.images, self.rating_min, self.rating_max)
            self._pairs, self._skipped = subset(pairs, self.max_samples), dict(skipped)
        return self._pairs

    def evaluate(self, trainer, model) -> dict[str, float]:
        device = str(trainer.strategy.root_device)
        if self._clip is None and self.clip_source:
            self._clip = load_clip(self.clip_source, device)
        if self._judge is None and self.judge_spec:
            self._judge = build_judge(self.judge_spec, device=device)
        out = self.output_dir(trainer)
        results, records = evaluate_alignment(
            model, self.pairs(), out, self.bagel_modes, self.baselines, clip=self._clip, judge=self._judge,
            batch_size=self.batch_size, skipped=self._skipped,
            info={"epoch": trainer.current_epoch + 1, "data": str(self.data)}, clip_source=self.clip_source,
            judge_spec=self.judge_spec, bagel_scale=self.bagel_scale, clip_prefix=self.clip_prefix)
        names = list(results["metrics"])
        log_table(trainer.loggers, "alignment/samples", table_columns(names),
                  table_rows(records, self.pairs(), names, self.table_rows), step=trainer.global_step)
        log_figures(trainer.loggers, "alignment", out, FIGURES, step=trainer.global_step)
        return {f"alignment/{k}": v for k, v in flat_metrics(results["metrics"]).items()}
