"""The ShapesWorld suite: ``unicon evaluate shapes`` and ``eval.shapes`` at epoch end, the embedded
world's task accuracies (:func:`unicon.evaluation.shapes.runner.shapes_task_accuracies`) with a picture.

Writes ``shapes_eval.json`` (the numbers, the split; standalone also the checkpoint, its weights
fingerprint, the image-generation settings, the git commit and package versions) and
``shapes_eval.png`` (:func:`unicon.evaluation.shapes.plots.plot_examples`). Scalars:
``shapes/<task>/<key>`` (:func:`~unicon.evaluation.shapes.metrics.logged_scalars`). The picture shows
the first rows of each task whichever rank ran them, so two ranks, and shards plus their merge, write
what one process writes.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from unicon.config import ShapesEvalConfig
from unicon.evaluation.cli_common import Flag
from unicon.evaluation.framework import EvalRun, EvalSuite, Outcome
from unicon.evaluation.suites import register

#: how ``eval.shapes``'s fields appear on the command line: the old flag names, and the standalone defaults
FLAGS = {
    "data": Flag("ShapesWorld root (unicon build-data shapes)", names=("--world",), dest="world",
                 default="data/shapes"),
    "split": Flag("the split of the world's mixture"),
    "max_samples": Flag("examples per task (the first ones of the split)", names=("--limit",), dest="limit",
                        default=200),
    "batch_size": Flag("examples per model call"),
    "tasks": Flag("the tasks to evaluate"),
    "examples": Flag("examples per task in the picture"),
}


class ShapesSuite(EvalSuite):
    name = "shapes"
    help = "ShapesWorld task accuracies (VQA, caption, loc, T2I)"
    description = "ShapesWorld task accuracies of a checkpoint (JSON + picture grid)."
    config = ShapesEvalConfig
    flags = FLAGS
    out_help = "output folder (shapes_eval.json, shapes_eval.png)"
    figures = "unicon.evaluation.shapes.plots:FIGURES"

    def load(self, config, args, root):
        from unicon.evaluation.shapes.runner import check_world

        check_world(config.data, config.split, what="--world" if args is not None else "eval.shapes.data")
        return Path(config.data)

    def run(self, run: EvalRun) -> Outcome:
        from unicon import jsonsafe
        from unicon.evaluation.shapes.metrics import logged_scalars
        from unicon.evaluation.shapes.plots import plot_examples
        from unicon.evaluation.shapes.runner import shapes_task_accuracies
        from unicon.loggers import environment_info

        c, world = run.config, run.inputs
        image_config = run.image_config()
        examples: list[dict] = []
        metrics = shapes_task_accuracies(run.model, world, c.split, c.max_samples, c.batch_size, c.tasks,
                                         examples=examples, num_examples=c.examples, image_config=image_config,
                                         device=run.device)
        if run.is_writer:
            if run.standalone:
                result = {"metrics": metrics, "checkpoint": run.checkpoint_info()["checkpoint"],
                          "model_fingerprint": run.fingerprint, "world": str(world.resolve()), "split": c.split,
                          "limit": c.max_samples, "image_generation": dataclasses.asdict(image_config),
                          "environment": environment_info()}
            else:
                result = {"metrics": metrics, "world": str(world.resolve()), "split": c.split,
                          "limit": c.max_samples, "epoch": run.epoch}
            (run.out / "shapes_eval.json").write_text(jsonsafe.dumps(result, indent=1) + "\n")
            if examples and c.examples:
                plot_examples(examples, run.out / "shapes_eval.png", c.examples)
        summary = jsonsafe.dumps(metrics, indent=1) + f"\nwrote {run.out / 'shapes_eval.json'}" + (
            f" and {run.out / 'shapes_eval.png'}" if examples and c.examples else "")
        return Outcome(logged_scalars(metrics), summary=summary)


register(ShapesSuite())
