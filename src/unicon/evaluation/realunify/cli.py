"""``unicon evaluate realunify``: RealUnify's direct and stepwise settings of a saved model, judged,
in one folder.

The flags of ``eval.realunify``'s fields are generated from :class:`unicon.config.RealUnifyEvalConfig`
(:func:`~unicon.evaluation.cli_common.add_config_args`), so the command and the epoch-end callback
agree; :data:`FLAGS` lists the exceptions: ``--data`` is required, the instances per category are
``--limit`` (standalone default: all; the config's value is the epoch-end subset), and
``--settings`` is comma-separated (``direct,stepwise``). ``--shard I/N`` and ``--merge`` split a run
into jobs whose merged files equal one run's, byte for byte. Writes ``--out`` (see
:mod:`unicon.evaluation.realunify.runner`) and prints ``table.md``; ``realunify.json`` also records
the checkpoint, the weights fingerprint, the settings, the generation and judge settings, the git
commit and the package versions. ``--stepwise-input auto`` is resolved once the data is read
(:func:`~unicon.evaluation.realunify.runner.resolve_stepwise_input`), before any model is loaded.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Sequence

from omegaconf import OmegaConf

from unicon.config import JUDGE_DTYPES, JUDGE_MAX_NEW_TOKENS, LoggerConfig, RealUnifyEvalConfig
from unicon.evaluation import preemption
from unicon.evaluation.cli_common import (
    Flag,
    add_common_args,
    add_config_args,
    add_image_generation_args,
    add_shard_args,
    check_common_args,
    config_argv,
    config_from_args,
    image_generation_config,
    load_model_for,
    sharding,
)
from unicon.evaluation.realunify.data import load_instances, subset, world_root_of
from unicon.evaluation.suites import register_suite

#: how ``eval.realunify``'s fields appear here (the standalone defaults that differ are marked)
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


class RecordedJudge:
    """The merge's stand-in for the shards' judge: its name; it judges nothing (a merge has no
    instance of its own)."""

    def __init__(self, name: str):
        self.name = name

    def judge(self, instances, images):
        if instances:
            raise RuntimeError("a merge of shards judges no image")
        return []


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="unicon evaluate realunify",
                                description="RealUnify: UEG and GEU, direct and stepwise, judged.")
    add_common_args(p, out_help="output folder (realunify.json, samples.jsonl, table.md, images/)")
    add_config_args(p, RealUnifyEvalConfig, FLAGS)
    p.add_argument("--judge-dtype", default="float32", choices=JUDGE_DTYPES)
    p.add_argument("--judge-max-new-tokens", type=int, default=JUDGE_MAX_NEW_TOKENS)
    p.add_argument("--trust-remote-code", action="store_true", help="allow custom code of judge models")
    add_image_generation_args(p)
    add_shard_args(p)
    return p


def argv_from_config(cfg) -> list[str]:
    """``eval.realunify`` of a run config as this command's arguments (data: ``data.root`` by
    default, as the epoch-end callback)."""
    c = OmegaConf.to_container(cfg.eval.realunify, resolve=True)
    c["data"] = c["data"] or str(cfg.data.root)
    return config_argv(c, RealUnifyEvalConfig, FLAGS)


@register_suite("realunify", "RealUnify UEG and GEU, direct and stepwise", section="realunify",
                argv=argv_from_config, callback="unicon.evaluation.realunify.callback:RealUnifyCallback",
                config=RealUnifyEvalConfig,
                report="unicon.evaluation.realunify.report:section", title="RealUnify",
                headline=("realunify/acc_direct", "realunify/acc_stepwise"))
def cli(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # heavy: imported once the arguments parse, not for --help
    from unicon.evaluation.logs import log_eval_config, log_figures, log_metrics, log_table
    from unicon.evaluation.realunify.judges import build_judge, check_judge_fits
    from unicon.evaluation.realunify.plots import FIGURES
    from unicon.evaluation.realunify.runner import (
        TABLE_COLUMNS,
        check_settings,
        evaluate_realunify,
        resolve_stepwise_input,
        table_rows,
    )
    from unicon.evaluation.ureason.judges import check_judge_spec
    from unicon.loggers import environment_info, make_loggers
    from unicon.worlds.shapes import load_world

    cfg = config_from_args(args, RealUnifyEvalConfig, FLAGS)
    settings = check_settings(cfg.settings)
    out = check_common_args(args, ("judge_max_new_tokens",))
    check_judge_spec(cfg.judge)
    instances = subset(load_instances(cfg.data), cfg.max_samples)
    check_judge_fits(cfg.judge, instances)
    stepwise_input = resolve_stepwise_input(cfg.stepwise_input, instances)  # "auto" by the rows' origin
    root = world_root_of(cfg.data)
    with sharding(args, out) as shards, preemption.watch_signals():  # SIGTERM/SIGUSR1: stop at the next batch
        if shards.mode == "merge":  # no judge model is loaded: the shards judged every instance
            judge = RecordedJudge(shards.record("judge", None))
        else:
            needs_judge = any(i.axis == "ueg" for i in instances)
            judge = build_judge(cfg.judge, world_root=str(root) if root else None, device=args.device,
                                dtype=args.judge_dtype, trust_remote_code=args.trust_remote_code,
                                max_new_tokens=args.judge_max_new_tokens) if needs_judge else RecordedJudge(cfg.judge)
            shards.record("judge", judge.name)
        model, fingerprint = shards.load_model(args, load_model_for)  # a merge: recorded, no weights
        image_config = image_generation_config(model, args)
        info = {
            "ckpt": str(args.ckpt), "checkpoint": str(Path(args.ckpt).resolve()), "model_fingerprint": fingerprint,
            "data": str(cfg.data), "limit": cfg.max_samples, "edit_prompt": cfg.edit_prompt,
            "answer_mode": cfg.answer_mode, "letter_parse": cfg.letter_parse,
            "generation": {"max_new_tokens": cfg.max_new_tokens, "batch_size": cfg.batch_size,
                           "image": dataclasses.asdict(image_config)},
            "judge_settings": {"judge": cfg.judge, "dtype": args.judge_dtype,
                               "max_new_tokens": args.judge_max_new_tokens},
            "environment": environment_info(),
        }
        metrics, samples = evaluate_realunify(
            model, instances, judge, out, settings, cfg.max_new_tokens, cfg.batch_size, image_config, info,
            edit_prompt_source=cfg.edit_prompt, answer_mode=cfg.answer_mode, letter_parse=cfg.letter_parse,
            stepwise_input=stepwise_input or cfg.stepwise_input, world_cfg=load_world(root).config if root else None,
            check_model=shards.mode != "merge")
    if shards.mode == "shard":
        print(f"realunify: shard {args.shard} done ({len(samples)} instances); "
              "merge with --merge once every shard is done")
        return 0
    loggers = make_loggers(LoggerConfig(type=args.logger), out, name=f"realunify-{out.name}", replace=True)
    log_eval_config(loggers, args, fingerprint)
    log_metrics(loggers, {f"realunify/{k}": v for k, v in metrics.items()}, step=0)
    log_table(loggers, "realunify/samples", TABLE_COLUMNS, table_rows(samples, cfg.table_rows), step=0)
    log_figures(loggers, "realunify", out, FIGURES, step=0)
    for lg in loggers:
        lg.finalize("success")
    print((out / "table.md").read_text(), end="")
    print(f"wrote {out / 'realunify.json'} and {out / 'samples.jsonl'}")
    return 0
