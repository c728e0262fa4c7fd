"""The ShapesWorld task accuracies at the end of training epochs: :class:`ShapesCallback`.

Runs :func:`~unicon.evaluation.shapes.runner.shapes_task_accuracies` on the first ``max_samples``
rows per task of a split of the world (default: the run's ``data.root``, test split), sharded over
the trainer's ranks. Rank 0 writes ``<run_dir>/eval/shapes/epoch-<e>/shapes_eval.json`` (the
numbers, as ``unicon evaluate shapes`` writes them) and ``shapes_eval.png`` (its examples, logged as
``shapes/fig/shapes_eval``); the base class logs the scalars ``shapes/<task>/<key>``
(:func:`~unicon.evaluation.shapes.metrics.logged_scalars`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from unicon import jsonsafe
from unicon.config import ShapesEvalConfig
from unicon.evaluation.callbacks import EvalCallback
from unicon.evaluation.logs import log_figures
from unicon.evaluation.shapes.metrics import DEFAULT_TASKS, logged_scalars
from unicon.evaluation.shapes.plots import FIGURES, plot_examples
from unicon.evaluation.shapes.runner import check_world, shapes_task_accuracies


class ShapesCallback(EvalCallback):
    """Logs ``shapes/vqa/vqa_accuracy``, ``shapes/caption/caption_match``, ``shapes/grounding/loc_iou50``,
    ``shapes/t2i/t2i_match`` (with their counts, slices and miss causes) every ``every_n_epochs``
    epochs. Defaults: :class:`unicon.config.ShapesEvalConfig`."""

    name = "shapes"

    def __init__(
        self,
        world: str | Path,
        split: str = ShapesEvalConfig.split,
        max_samples: int = ShapesEvalConfig.max_samples,
        batch_size: int = ShapesEvalConfig.batch_size,
        tasks: Sequence[str] = DEFAULT_TASKS,
        examples: int = ShapesEvalConfig.examples,
        every_n_epochs: int = ShapesEvalConfig.every_n_epochs,
        fail_on_error: bool = False,
    ):
        super().__init__(every_n_epochs=every_n_epochs, fail_on_error=fail_on_error)
        check_world(world, split, what="eval.shapes.data")  # before training starts
        self.world, self.split, self.max_samples = Path(world), split, max_samples
        self.batch_size, self.tasks, self.examples = batch_size, tuple(tasks), examples

    @classmethod
    def from_config(cls, cfg) -> "ShapesCallback":
        """From a RunConfig: ``eval.shapes.*``; the world defaults to ``data.root``."""
        c = cfg.eval.shapes
        return cls(world=c.data or cfg.data.root, split=c.split, max_samples=c.max_samples,
                   batch_size=c.batch_size, tasks=list(c.tasks), examples=c.examples,
                   every_n_epochs=c.every_n_epochs, fail_on_error=cfg.eval.fail_on_error)

    def evaluate(self, trainer, model) -> dict[str, float]:
        examples: list[dict] = []
        metrics = shapes_task_accuracies(model, self.world, self.split, self.max_samples, self.batch_size,
                                         self.tasks, examples=examples, num_examples=self.examples,
                                         device=trainer.strategy.root_device)
        if trainer.is_global_zero:
            out = self.output_dir(trainer)
            result = {"metrics": metrics, "world": str(self.world.resolve()), "split": self.split,
                      "limit": self.max_samples, "epoch": trainer.current_epoch + 1}
            (out / "shapes_eval.json").write_text(jsonsafe.dumps(result, indent=1) + "\n")
            if examples and self.examples:
                plot_examples(examples, out / "shapes_eval.png", self.examples)
                log_figures(trainer.loggers, "shapes", out, FIGURES, step=trainer.global_step)
        return logged_scalars(metrics)
