"""RealUnify at the end of training epochs: :class:`RealUnifyCallback` (``eval.realunify``).

Runs the settings (:func:`~unicon.evaluation.realunify.runner.evaluate_realunify`) on the first
``max_samples`` instances per category of ``data`` (default: the run's ``data.root``, a ShapesWorld
root), sharded over the trainer's ranks; writes ``<run_dir>/eval/realunify/epoch-<e>/`` (rank 0) and
logs the headline metrics, the figure and an image table (direct and stepwise side by side).
``stepwise_input="auto"`` is resolved when the data is read, at construction
(:func:`~unicon.evaluation.realunify.runner.resolve_stepwise_input`). A GEU stepwise setting on a
model that does not edit images, or an ``original+edited`` one on a model that takes one image per
question, fails the run at ``setup``, before training.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from unicon.config import RealUnifyEvalConfig
from unicon.evaluation.callbacks import EvalCallback
from unicon.evaluation.logs import log_figures, log_table
from unicon.evaluation.realunify.data import Instance, load_instances, subset, world_root_of
from unicon.evaluation.realunify.judges import build_judge, check_judge_fits
from unicon.evaluation.realunify.plots import FIGURES
from unicon.evaluation.realunify.runner import (
    TABLE_COLUMNS,
    check_editing,
    check_settings,
    check_stepwise_input,
    evaluate_realunify,
    resolve_stepwise_input,
    table_rows,
)
from unicon.worlds.shapes import load_world

class RealUnifyCallback(EvalCallback):
    """Logs every RealUnify metric as ``realunify/<key>`` (``acc_{direct,stepwise}``, ``delta``, per axis
    and category, the UEG per-question accuracies, the stepwise edit accuracy, the counts), as
    ``unicon evaluate realunify`` does, every ``every_n_epochs`` epochs.
    Defaults: :class:`unicon.config.RealUnifyEvalConfig`."""

    name = "realunify"

    def __init__(
        self,
        data: str | Path,
        judge: str = RealUnifyEvalConfig.judge,
        settings: Sequence[str] = tuple(RealUnifyEvalConfig().settings),
        edit_prompt: str = RealUnifyEvalConfig.edit_prompt,
        answer_mode: str = RealUnifyEvalConfig.answer_mode,
        letter_parse: str = RealUnifyEvalConfig.letter_parse,
        stepwise_input: str = RealUnifyEvalConfig.stepwise_input,
        max_samples: int | None = RealUnifyEvalConfig.max_samples,
        max_new_tokens: int = RealUnifyEvalConfig.max_new_tokens,
        batch_size: int = RealUnifyEvalConfig.batch_size,
        table_rows: int = RealUnifyEvalConfig.table_rows,
        every_n_epochs: int = RealUnifyEvalConfig.every_n_epochs,
        fail_on_error: bool = False,
    ):
        super().__init__(every_n_epochs=every_n_epochs, fail_on_error=fail_on_error)
        self.data, self.judge_spec, self.settings = data, judge, check_settings(list(settings))
        self.edit_prompt, self.answer_mode, self.max_samples = edit_prompt, answer_mode, max_samples
        self.letter_parse = letter_parse
        self.max_new_tokens, self.batch_size, self.table_rows = max_new_tokens, batch_size, table_rows
        self._instances: list[Instance] | None = None
        self._judge = None
        root = world_root_of(data)
        self.world_root = str(root) if root is not None else None
        # a bad data file fails before training starts; "auto" resolved by the rows' origin
        self.stepwise_input = resolve_stepwise_input(stepwise_input, self.instances())

    @classmethod
    def from_config(cls, cfg: Any) -> "RealUnifyCallback":
        """From a RunConfig: ``eval.realunify.*``; data defaults to ``data.root``."""
        c = cfg.eval.realunify
        return cls(data=c.data or cfg.data.root, judge=c.judge, settings=list(c.settings), edit_prompt=c.edit_prompt,
                   answer_mode=c.answer_mode, letter_parse=c.letter_parse, stepwise_input=c.stepwise_input,
                   max_samples=c.max_samples,
                   max_new_tokens=c.max_new_tokens, batch_size=c.batch_size,
                   table_rows=c.table_rows, every_n_epochs=c.every_n_epochs,
                   fail_on_error=cfg.eval.fail_on_error)

    def instances(self) -> list[Instance]:
        if self._instances is None:
            self._instances = subset(load_instances(self.data), self.max_samples)
            check_judge_fits(self.judge_spec, self._instances)
        return self._instances

    def judge(self):
        if self._judge is None:
            self._judge = build_judge(self.judge_spec, world_root=self.world_root)
        return self._judge

    def setup(self, trainer, pl_module, stage: str) -> None:
        """Refuse a GEU stepwise setting the model cannot run (no image editing; one image per question
        for ``original+edited``), before training."""
        model = getattr(pl_module, "model", pl_module)
        check_editing(model, self.instances(), self.settings, self.edit_prompt)
        check_stepwise_input(model, self.instances(), self.settings, self.stepwise_input, self.answer_mode)

    def evaluate(self, trainer, model) -> dict[str, float]:
        out = self.output_dir(trainer)
        metrics, samples = evaluate_realunify(
            model, self.instances(), self.judge(), out_dir=out, settings=self.settings,
            max_new_tokens=self.max_new_tokens, batch_size=self.batch_size,
            info={"epoch": trainer.current_epoch + 1, "data": str(self.data), "answer_mode": self.answer_mode},
            device=trainer.strategy.root_device,
            edit_prompt_source=self.edit_prompt, answer_mode=self.answer_mode, letter_parse=self.letter_parse,
            stepwise_input=self.stepwise_input or "auto",
            world_cfg=load_world(self.world_root).config if self.world_root else None)
        log_table(trainer.loggers, "realunify/samples", TABLE_COLUMNS, table_rows(samples, self.table_rows),
                  step=trainer.global_step)
        log_figures(trainer.loggers, "realunify", out, FIGURES, step=trainer.global_step)
        return {f"realunify/{k}": v for k, v in metrics.items()}  # the names `unicon evaluate realunify` logs
