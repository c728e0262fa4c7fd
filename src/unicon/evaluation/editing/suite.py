"""The EditingScore suite: ``unicon evaluate editing`` and ``eval.editing`` at epoch end, the score of
(source, edited image, instruction) samples with ratings, its Table 4 ablations and their Kendall
correlations with the ratings (:func:`~unicon.evaluation.editing.runner.evaluate_editing`; files:
:mod:`unicon.evaluation.editing.runner`).

``data`` is an Edit-1K-like JSONL file (``docs/editing_score.md``; ShapesWorld writes one with exact
ratings to ``<world>/editscore/editscore.jsonl``, the epoch-end default). ``own_edits`` N also edits the
first N test edit rows of a ShapesWorld root with the model itself and reports the score per edit kind
beside exact match (standalone the root is ``--world``, default: the world the data file lies in, when
it has a ``world.json`` two folders up; at epoch end ``data.root``). ``--judge`` adds the baseline of
the paper's Table 3 (:mod:`~unicon.evaluation.editing.judges`). Scalars: ``editing/<key>`` (Kendall's
tau_b of the score, its ablations and components against every criterion,
``editing/tau_b/<variant>/<criterion>``).
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass
from pathlib import Path

from unicon.config import EDITING_EPS, EditingEvalConfig
from unicon.errors import UserError
from unicon.evaluation.cli_common import Flag
from unicon.evaluation.framework import EvalRun, EvalSuite, Outcome
from unicon.evaluation.suites import register

#: how ``eval.editing``'s fields appear on the command line (the standalone defaults that differ are marked)
FLAGS = {
    "data": Flag("Edit-1K-like .jsonl (docs/editing_score.md), e.g. data/shapes/editscore/editscore.jsonl",
                 required=True),
    "max_samples": Flag("the first N rows only (standalone default: all)", names=("--limit",), dest="limit",
                        default=None),
    "batch_size": Flag("samples per model call"),
    "own_edits": Flag("also edit the first N test edit rows of the ShapesWorld --world with the model and report "
                      "the score per edit kind beside exact match (0: off)"),
    "table_rows": Flag("samples in the W&B table"),
}


def default_data(root: str | Path) -> Path:
    """The EditingScore file of a ShapesWorld root (written by ``unicon build-data shapes``)."""
    return Path(root) / "editscore" / "editscore.jsonl"


def world_of(world: str | None, data: str) -> Path | None:
    """The ShapesWorld root of ``--own-edits``: ``--world``, else two folders above ``--data`` when that
    holds ``world.json``, else None."""
    if world is not None:
        root = Path(world)
        if not (root / "world.json").is_file():
            raise UserError(f"--world {root} is not a ShapesWorld root (no world.json)")
        return root
    guess = Path(data).resolve().parent.parent
    return guess if (guess / "world.json").is_file() else None


@dataclass
class EditingInputs:
    """What :meth:`EditingSuite.load` reads before any model is loaded."""

    samples: list  # the first max_samples rows of data
    world: Path | None  # the ShapesWorld root of own_edits (None without own_edits)


class EditingSuite(EvalSuite):
    name = "editing"
    help = "EditingScore vs edit-quality ratings (Kendall tau_b, Table 4 ablations)"
    description = ("EditingScore (cos_image * sim_text / (rls^2 + eps)) vs edit ratings: "
                   "Kendall tau_b of the score and of its ablations.")
    config = EditingEvalConfig
    flags = FLAGS
    out_help = "output folder (editing.json, samples.jsonl, table.md, figures)"
    judge_tokens = 16
    figures = "unicon.evaluation.editing.report:FIGURES"
    report = "unicon.evaluation.editing.report:section"
    title = "EditingScore"

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("--eps", type=float, default=EDITING_EPS,
                       help="epsilon of rls^2 + eps (default: %(default)s, the paper's)")
        p.add_argument("--world", default=None, help="ShapesWorld root for --own-edits (default: two folders above "
                                                     "--data when it holds world.json)")
        p.add_argument("--judge", default=None,
                       help="Table 3's baseline, a judge rating every edit 0/0.3/0.6/1.0 (the paper's is GPT-based, "
                            "not available offline): 'model' (the evaluated model, shown the edited image) or "
                            "'vlm:<local model directory>' (shown the source and the edited image); default: none")

    def default_data(self, run_cfg) -> str:
        return str(default_data(run_cfg.data.root))

    def load(self, config, args, root):
        from unicon.evaluation.editing.data import load_samples
        from unicon.evaluation.editing.judges import check_judge

        if args is not None:
            check_judge(args.judge)
            if not args.eps > 0:
                raise UserError(f"--eps must be > 0, got {args.eps}")
        samples = load_samples(config.data, config.max_samples)
        if not config.own_edits:
            return EditingInputs(samples, None)
        if args is None:
            return EditingInputs(samples, Path(root) if root is not None else None)
        world = world_of(args.world, config.data)
        if world is None:
            raise UserError("--own-edits needs a ShapesWorld root: pass --world (none found two folders above --data)")
        return EditingInputs(samples, world)

    def run(self, run: EvalRun) -> Outcome:
        from unicon.evaluation.editing.judges import build_judge
        from unicon.evaluation.editing.runner import TABLE_COLUMNS, evaluate_editing, table_rows
        from unicon.loggers import environment_info

        c, args, inputs = run.config, run.args, run.inputs
        image_config = run.image_config()  # None at epoch end: the model's own
        judge = judge_spec = None
        info = {"epoch": run.epoch, "data": str(Path(c.data))}
        if args is not None:
            judge_spec = run.record("judge", args.judge)
            judge = None if run.merging else build_judge(args.judge, run.model, **run.judge_kwargs())
            info = {
                **run.checkpoint_info(), "backend": run.record("backend", getattr(run.model, "backend", None)),
                "data": str(c.data), "limit": c.max_samples, "batch_size": c.batch_size,
                "own_edits_requested": c.own_edits, "world": str(inputs.world) if inputs.world else None,
                "image_generation": asdict(image_config) if c.own_edits else None,
                "judge_settings": run.judge_settings(judge=args.judge) if args.judge else None,
                "environment": environment_info(),
            }
        results, records = evaluate_editing(
            run.model, inputs.samples, run.out, c.batch_size, EDITING_EPS if args is None else args.eps, info,
            own_edits=c.own_edits, world_root=inputs.world, image_config=image_config, check=not run.merging,
            data_root=Path(c.data).resolve().parent, judge=judge, judge_spec=judge_spec)
        own = "".join(f"own edits {kind:<10} n={b['n']:<4} exact={b['exact_match']:.2f} "
                      f"median score={b['median_score']:.4g}\n"
                      for kind, b in results.get("own_edits", {"by_kind": {}})["by_kind"].items())
        return Outcome({f"editing/{k}": v for k, v in results["metrics"].items()},
                       table_rows(records, inputs.samples, c.table_rows), TABLE_COLUMNS,
                       run.printed("editing.json", own))


register(EditingSuite())
