"""The RealUnify suite: ``unicon evaluate realunify`` and ``eval.realunify`` at epoch end, the direct and
stepwise settings of UEG and GEU, judged (:func:`~unicon.evaluation.realunify.runner.evaluate_realunify`;
files: :mod:`unicon.evaluation.realunify.runner`).

Scalars: ``realunify/<key>`` (``acc_{direct,stepwise}``, ``delta``, per axis and category, the UEG
per-question accuracies, the stepwise edit accuracy, the counts). ``stepwise_input="auto"`` is
resolved once the data is read, before any model is loaded; a GEU stepwise setting the model cannot
run is refused before any generation (at epoch end: before training). Standalone, a judge model is
loaded only for UEG instances; a merge loads none (the shards judged every instance).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from unicon.config import JUDGE_MAX_NEW_TOKENS, RealUnifyEvalConfig
from unicon.evaluation.cli_common import Flag
from unicon.evaluation.framework import EvalRun, EvalSuite, Outcome
from unicon.evaluation.suites import register

#: how ``eval.realunify``'s fields appear on the command line (the standalone defaults that differ are marked)
FLAGS = {
    "data": Flag("ShapesWorld root, GEU .parquet file or folder of them, or UEG .jsonl file", required=True),
    "judge": Flag("UEG polling judge: 'exact' (ShapesWorld) or 'vlm:<local model directory>'"),
    "settings": Flag("settings to run: direct, stepwise or both", comma=True),
    "edit_prompt": Flag("GEU stepwise edit prompt: 'paper' (Tables 10-13) or 'row' (the row's edit_instruction)"),
    "answer_mode": Flag("GEU answers: 'generate' (Table 8, the letter read per --letter-parse) or 'likelihood' "
                        "(the option text with the lowest mean NLL after the bare question)"),
    "letter_parse": Flag("GEU reply reading: 'strict' (a letter alone or after 'The best answer is'/'Answer:') or "
                         "'lenient' (the first capital A-D anywhere: the authors' scorer, reproduces the paper)"),
    "stepwise_input": Flag("images GEU stepwise answers on: 'original+edited' (the input image, then the edited "
                           "one, the prompt saying so: the public release's runner), 'edited' (the edited image "
                           "alone) or 'auto' (edited for a ShapesWorld root, original+edited for the release's "
                           "files; realunify.json records the resolved value)"),
    "max_samples": Flag("instances per category, the first ones (standalone default: all)", names=("--limit",),
                        dest="limit", default=None),
    "max_new_tokens": Flag("token budget of the stepwise UEG refined prompt (Table 9)"),
    "batch_size": Flag("instances per model call"),
    "table_rows": Flag("samples in the W&B image table"),
}


@dataclass
class RealUnifyInputs:
    """What :meth:`RealUnifySuite.load` reads and resolves before any model is loaded."""

    instances: list  # the first max_samples per category
    settings: list[str]  # in SETTINGS order
    stepwise_input: str | None  # "auto" resolved; None without GEU instances
    world_root: str | None  # data, when it is a ShapesWorld root


class RealUnifySuite(EvalSuite):
    name = "realunify"
    help = "RealUnify UEG and GEU, direct and stepwise"
    description = "RealUnify: UEG and GEU, direct and stepwise, judged."
    config = RealUnifyEvalConfig
    flags = FLAGS
    out_help = "output folder (realunify.json, samples.jsonl, table.md, images/)"
    judge_tokens = JUDGE_MAX_NEW_TOKENS
    figures = "unicon.evaluation.realunify.plots:FIGURES"
    report = "unicon.evaluation.realunify.report:section"
    title = "RealUnify"
    headline = ("realunify/acc_direct", "realunify/acc_stepwise")

    def load(self, config, args, root):
        from unicon.evaluation.realunify.data import load_instances, subset, world_root_of
        from unicon.evaluation.realunify.judges import check_judge_fits
        from unicon.evaluation.realunify.runner import check_settings, resolve_stepwise_input
        from unicon.evaluation.ureason.judges import check_judge_spec

        settings = check_settings(list(config.settings))
        if args is not None:
            check_judge_spec(config.judge)
        instances = subset(load_instances(config.data), config.max_samples)
        check_judge_fits(config.judge, instances)
        world = world_root_of(config.data)
        return RealUnifyInputs(instances, settings, resolve_stepwise_input(config.stepwise_input, instances),
                               str(world) if world else None)

    def check_model(self, model, inputs, config) -> None:
        """Refuse a GEU stepwise setting the model cannot run (no image editing; one image per question
        for ``original+edited``), before training."""
        from unicon.evaluation.realunify.runner import check_can_run

        check_can_run(model, inputs.instances, inputs.settings, inputs.stepwise_input, config.edit_prompt,
                      config.answer_mode)

    def judge(self, run: EvalRun):
        """The UEG judge: at epoch end built once (kept across epoch ends); standalone built only for UEG
        instances (else its name); a merge's stand-in names the shards' judge."""
        from unicon.evaluation.realunify.judges import build_judge
        from unicon.evaluation.ureason.judges import RecordedJudge

        c, args, inputs = run.config, run.args, run.inputs
        if run.merging:  # no judge model is loaded: the shards judged every instance
            return RecordedJudge(run.record("judge", None))
        if args is None:
            if "judge" not in run.cache:
                run.cache["judge"] = build_judge(c.judge, world_root=inputs.world_root)
            return run.cache["judge"]
        if any(i.axis == "ueg" for i in inputs.instances):
            judge = build_judge(c.judge, world_root=inputs.world_root, **run.judge_kwargs())
        else:
            judge = RecordedJudge(c.judge)
        run.record("judge", judge.name)
        return judge

    def run(self, run: EvalRun) -> Outcome:
        from unicon.evaluation.realunify.runner import TABLE_COLUMNS, evaluate_realunify, table_rows
        from unicon.loggers import environment_info
        from unicon.worlds.shapes import load_world

        c, args, inputs = run.config, run.args, run.inputs
        judge = self.judge(run)
        image_config = run.image_config()
        if args is None:
            info = {"epoch": run.epoch, "data": str(c.data), "answer_mode": c.answer_mode}
        else:
            info = {
                **run.checkpoint_info(), "data": str(c.data), "limit": c.max_samples, "edit_prompt": c.edit_prompt,
                "answer_mode": c.answer_mode, "letter_parse": c.letter_parse,
                "generation": {"max_new_tokens": c.max_new_tokens, "batch_size": c.batch_size,
                               "image": asdict(image_config)},
                "judge_settings": run.judge_settings(judge=c.judge),
                "environment": environment_info(),
            }
        world_cfg = load_world(inputs.world_root).config if inputs.world_root else None
        metrics, samples = evaluate_realunify(
            run.model, inputs.instances, judge, run.out, inputs.settings, c.max_new_tokens, c.batch_size,
            image_config, info, device=run.device, edit_prompt_source=c.edit_prompt, world_cfg=world_cfg,
            check_model=not run.merging, answer_mode=c.answer_mode, letter_parse=c.letter_parse,
            stepwise_input=inputs.stepwise_input or c.stepwise_input)
        return Outcome({f"realunify/{k}": v for k, v in metrics.items()}, table_rows(samples, c.table_rows),
                       TABLE_COLUMNS, run.printed("realunify.json"))


register(RealUnifySuite())
