"""The UReason suite: ``unicon evaluate ureason`` and ``eval.ureason`` at epoch end, the three
settings (direct, reasoning-guided, de-contextualized) of a model, judged
(:func:`~unicon.evaluation.ureason.runner.evaluate_ureason`; files: :mod:`unicon.evaluation.ureason.runner`).

Scalars: ``ureason/<key>`` (``acc_s{1,2,3}``, ``delta_12``, ``delta_23``, ``chain_acc``,
``fallback_rate``, per category). A judge model is loaded only when ``judge`` names one; a merge loads
none (the shards judged every instance).
"""

from __future__ import annotations

import argparse
import dataclasses

from unicon.config import JUDGE_MAX_NEW_TOKENS, UReasonEvalConfig
from unicon.errors import UserError
from unicon.evaluation.cli_common import Flag
from unicon.evaluation.framework import EvalRun, EvalSuite, Outcome
from unicon.evaluation.suites import register

#: how ``eval.ureason``'s fields appear on the command line (the standalone defaults that differ are marked)
FLAGS = {
    "data": Flag("UReason directory (direct_<cat>.jsonl + <cat>.jsonl) or a ShapesWorld root", required=True),
    "judge": Flag("'exact' (ShapesWorld verifier) or 'vlm:<path>' (image-text-to-text model)"),
    "chain_judge": Flag("causal LM path for the reasoning-chain judge (Table 3)"),
    "max_samples": Flag("round-robin subset over categories (standalone default: all)", default=None),
    "max_new_tokens": Flag("token budget of the reasoning trace"),
    "batch_size": Flag("instances per model call"),
    "table_rows": Flag("samples in the W&B image table"),
}


class UReasonSuite(EvalSuite):
    name = "ureason"
    help = "UReason reasoning-to-image, three settings"
    description = "UReason: direct, reasoning-guided and de-contextualized generation, judged."
    config = UReasonEvalConfig
    flags = FLAGS
    judge_tokens = JUDGE_MAX_NEW_TOKENS
    figures = "unicon.evaluation.ureason.plots:FIGURES"
    report = "unicon.evaluation.ureason.report:section"
    title = "UReason"
    headline = ("ureason/acc_s1", "ureason/acc_s2", "ureason/acc_s3")

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        from unicon.data.ureason import SPLITS

        p.add_argument("--split", choices=SPLITS, default=None,
                       help="split of the UReason release (a ShapesWorld root has one split)")
        p.add_argument("--categories", nargs="+", default=None)

    def load(self, config, args, root):
        from unicon.data.ureason import load_instances, subset, world_root_of
        from unicon.evaluation.ureason.judges import check_judge_fits, check_judge_spec

        split = categories = None
        if args is not None:
            check_judge_spec(config.judge, config.chain_judge)
            split, categories = args.split, args.categories
            if split and world_root_of(config.data) is not None:
                raise UserError(f"--split {split}: {config.data} is a ShapesWorld root, which has one split; "
                                "--split selects a split of the UReason release")
        instances = subset(load_instances(config.data, split=split, categories=categories), config.max_samples)
        check_judge_fits(config.judge, instances)
        return instances

    def judge(self, run: EvalRun):
        """The judge: built once (kept across epoch ends); a merge's stand-in of the shards' judge."""
        from unicon.data.ureason import world_root_of
        from unicon.evaluation.ureason.judges import RecordedJudge, build_judge

        c = run.config
        if run.merging:  # no judge model is loaded: the shards judged every instance
            return RecordedJudge(**run.record("judge", None))
        if "judge" not in run.cache:
            run.cache["judge"] = build_judge(c.judge, chain=c.chain_judge, world_root=world_root_of(c.data),
                                             **run.judge_kwargs())
        judge = run.cache["judge"]
        run.record("judge", {"name": judge.name, "judges_reasoning": judge.judges_reasoning})
        return judge

    def run(self, run: EvalRun) -> Outcome:
        from unicon.evaluation.ureason.runner import TABLE_COLUMNS, evaluate_ureason, table_rows
        from unicon.loggers import environment_info

        c, args = run.config, run.args
        judge = self.judge(run)
        image_config = run.image_config()
        if args is None:
            info = {"epoch": run.epoch}
        else:
            info = {
                **run.checkpoint_info(), "data": str(c.data), "split": args.split,
                "categories": args.categories, "max_samples": c.max_samples,
                "generation": {"max_new_tokens": c.max_new_tokens, "batch_size": c.batch_size,
                               "image": dataclasses.asdict(image_config)},
                "judge_settings": run.judge_settings(judge=c.judge, chain_judge=c.chain_judge),
                "environment": environment_info(),
            }
        metrics, samples = evaluate_ureason(run.model, run.inputs, judge, run.out, c.max_new_tokens, c.batch_size,
                                            image_config, info, device=run.device)
        return Outcome({f"ureason/{k}": v for k, v in metrics.items()}, table_rows(samples, c.table_rows),
                       TABLE_COLUMNS, run.printed("ureason.json"))


register(UReasonSuite())
