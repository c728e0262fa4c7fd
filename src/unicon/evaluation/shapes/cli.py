"""``unicon evaluate shapes``: the embedded world's task accuracies of a checkpoint, with a picture.

Runs :func:`unicon.evaluation.shapes.runner.shapes_task_accuracies` (VQA exact match, caption exact
scene match, localization IoU >= 0.5 and mean IoU, generated-image scene match; definitions in
that module) on a split of a ShapesWorld world, writes ``<out>/shapes_eval.json`` (the numbers,
the checkpoint, its weights fingerprint, the split, the image-generation settings, the git commit and
package versions) and
``<out>/shapes_eval.png``: for each task the first examples, with the input image and predicted
box (localization, gold box dashed), the generated caption or answer, or the generated image, and
whether the world's verifier accepted it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Sequence

from unicon.errors import UserError
from unicon.evaluation import preemption
from unicon.evaluation.suites import register_suite
from unicon.evaluation.cli_common import (
    add_common_args,
    add_image_generation_args,
    check_common_args,
    image_generation_config,
    load_model_for,
)


@register_suite("shapes", "ShapesWorld task accuracies (VQA, caption, loc, T2I)")
def cli(argv: Sequence[str] | None = None) -> int:
    from unicon.evaluation.shapes.plots import plot_examples
    from unicon.evaluation.shapes.runner import TASKS, shapes_task_accuracies

    p = argparse.ArgumentParser(prog="unicon evaluate shapes",
                                description="ShapesWorld task accuracies of a checkpoint (JSON + picture grid).")
    add_common_args(p, out_help="output folder (shapes_eval.json, shapes_eval.png)")
    p.add_argument("--world", default="data/shapes", help="ShapesWorld root (unicon build-data shapes)")
    p.add_argument("--split", default="test", choices=["train", "val", "test"])
    p.add_argument("--limit", type=int, default=200, help="examples per task (the first ones of the split)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--tasks", nargs="+", choices=list(TASKS), default=list(TASKS))
    p.add_argument("--examples", type=int, default=6, help="examples per task in the picture")
    add_image_generation_args(p)
    args = p.parse_args(argv)
    out = check_common_args(args, ("limit", "batch_size", "examples"), {"examples": 0})
    world = Path(args.world)
    if not (world / "world.json").is_file():
        raise UserError(f"--world {world}: not a ShapesWorld root (no world.json); build one with "
                        f"`unicon build-data shapes --out {world}`")
    if not (world / f"mixture_{args.split}.jsonl").is_file():
        raise UserError(f"{world / f'mixture_{args.split}.jsonl'} not found: the world has no {args.split} split")
    from unicon.core import weights_fingerprint
    from unicon.loggers import environment_info

    model = load_model_for(args)
    image_config = image_generation_config(model, args)
    examples: list[dict] = []
    with preemption.watch_signals():
        metrics = shapes_task_accuracies(model, world, args.split, args.limit, args.batch_size, args.tasks,
                                         examples=examples, num_examples=args.examples, image_config=image_config)
    result = {"metrics": metrics, "checkpoint": str(Path(args.ckpt).resolve()),
              "model_fingerprint": weights_fingerprint(model), "world": str(world.resolve()),
              "split": args.split, "limit": args.limit, "image_generation": dataclasses.asdict(image_config),
              "environment": environment_info()}
    (out / "shapes_eval.json").write_text(json.dumps(result, indent=1) + "\n")
    if examples and args.examples:
        plot_examples(examples, out / "shapes_eval.png", args.examples)
    if args.logger != "none":
        from unicon.config import LoggerConfig
        from unicon.evaluation.callbacks import log_metrics
        from unicon.loggers import make_loggers

        loggers = make_loggers(LoggerConfig(type=args.logger, tags=["shapes"]), out, name=f"shapes-{out.name}")
        log_metrics(loggers, {f"shapes/{k}": v for k, v in metrics.items()}, step=0)
        for lg in loggers:
            lg.finalize("success")
    print(json.dumps(metrics, indent=1))
    print(f"wrote {out / 'shapes_eval.json'}" + (f" and {out / 'shapes_eval.png'}" if examples else ""))
    return 0
