"""``unicon evaluate ureason``: the three UReason settings of a saved model, judged, in one folder.

The flags of ``eval.ureason``'s fields are generated from :class:`unicon.config.UReasonEvalConfig`
(:func:`~unicon.evaluation.cli_common.add_config_args`), so the command and the epoch-end callback
agree; :data:`FLAGS` lists the exceptions: ``--data`` is required, and ``--max-samples`` defaults to
every instance (the config's value is the size of the epoch-end subset). ``--shard I/N`` and
``--merge`` split a run into jobs whose merged files equal one run's, byte for byte. Writes ``--out`` (see
:mod:`unicon.evaluation.ureason.runner`); ``ureason.json`` also records the checkpoint, the
weights fingerprint, the generation and judge settings, the git commit and the package versions.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Sequence

from omegaconf import OmegaConf

from unicon.config import JUDGE_DTYPES, JUDGE_MAX_NEW_TOKENS, LoggerConfig, UReasonEvalConfig
from unicon.data.ureason import SPLITS, load_instances, subset, world_root_of
from unicon.errors import UserError
from unicon.evaluation import preemption
from unicon.evaluation.suites import register_suite
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

#: how ``eval.ureason``'s fields appear here (the standalone defaults that differ are marked)
FLAGS = {
    "data": Flag("UReason directory (direct_<cat>.jsonl + <cat>.jsonl) or a ShapesWorld root", required=True),
    "judge": Flag("'exact' (ShapesWorld verifier) or 'vlm:<path>' (image-text-to-text model)"),
    "chain_judge": Flag("causal LM path for the reasoning-chain judge (Table 3)"),
    "max_samples": Flag("round-robin subset over categories (standalone default: all)", default=None),
    "max_new_tokens": Flag("token budget of the reasoning trace"),
    "batch_size": Flag("instances per model call"),
    "table_rows": Flag("samples in the W&B image table"),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="unicon evaluate ureason",
        description="UReason: direct, reasoning-guided and de-contextualized generation, judged.",
    )
    add_common_args(p)
    add_config_args(p, UReasonEvalConfig, FLAGS)
    p.add_argument("--split", choices=SPLITS, default=None,
                   help="split of the UReason release (a ShapesWorld root has one split)")
    p.add_argument("--categories", nargs="+", default=None)
    p.add_argument("--judge-dtype", default="float32", choices=JUDGE_DTYPES)
    p.add_argument("--judge-max-new-tokens", type=int, default=JUDGE_MAX_NEW_TOKENS)
    p.add_argument("--trust-remote-code", action="store_true", help="allow custom code of judge models")
    add_image_generation_args(p)
    add_shard_args(p)
    return p


def argv_from_config(cfg) -> list[str]:
    """``eval.ureason`` of a run config as this command's arguments (data: ``data.root`` by default,
    as the epoch-end callback)."""
    c = OmegaConf.to_container(cfg.eval.ureason, resolve=True)
    c["data"] = c["data"] or str(cfg.data.root)
    return config_argv(c, UReasonEvalConfig, FLAGS)


@register_suite("ureason", "UReason reasoning-to-image, three settings", section="ureason",
                argv=argv_from_config, callback="unicon.evaluation.ureason.callback:UReasonCallback",
                config=UReasonEvalConfig,
                report="unicon.evaluation.ureason.report:section", title="UReason",
                headline=("ureason/acc_s1", "ureason/acc_s2", "ureason/acc_s3"))
def cli(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # heavy: imported once the arguments parse, not for --help
    from unicon.evaluation.logs import log_eval_config, log_figures, log_metrics, log_table
    from unicon.evaluation.ureason.judges import Judge, RecordedJudge, build_judge, check_judge_fits, check_judge_spec
    from unicon.evaluation.ureason.plots import FIGURES
    from unicon.evaluation.ureason.runner import TABLE_COLUMNS, evaluate_ureason, table_rows
    from unicon.loggers import environment_info, make_loggers

    cfg = config_from_args(args, UReasonEvalConfig, FLAGS)
    out = check_common_args(args, ("judge_max_new_tokens",))
    check_judge_spec(cfg.judge, cfg.chain_judge)
    if args.split and world_root_of(cfg.data) is not None:
        raise UserError(f"--split {args.split}: {cfg.data} is a ShapesWorld root, which has one split; "
                        "--split selects a split of the UReason release")
    instances = subset(load_instances(cfg.data, split=args.split, categories=args.categories), cfg.max_samples)
    check_judge_fits(cfg.judge, instances)
    with sharding(args, out) as shards, preemption.watch_signals():  # SIGTERM/SIGUSR1: stop at the next batch
        if shards.mode == "merge":  # no judge model is loaded: the shards judged every instance
            judge: Judge = RecordedJudge(**shards.record("judge", None))
        else:
            judge = build_judge(cfg.judge, chain=cfg.chain_judge, world_root=world_root_of(cfg.data),
                                device=args.device, dtype=args.judge_dtype, trust_remote_code=args.trust_remote_code,
                                max_new_tokens=args.judge_max_new_tokens)
            shards.record("judge", {"name": judge.name, "judges_reasoning": judge.judges_reasoning})
        model, fingerprint = shards.load_model(args, load_model_for)  # a merge: recorded, no weights
        image_config = image_generation_config(model, args)
        info = {
            "ckpt": str(args.ckpt), "checkpoint": str(Path(args.ckpt).resolve()),
            "model_fingerprint": fingerprint, "data": str(cfg.data), "split": args.split,
            "categories": args.categories, "max_samples": cfg.max_samples,
            "generation": {"max_new_tokens": cfg.max_new_tokens, "batch_size": cfg.batch_size,
                           "image": dataclasses.asdict(image_config)},
            "judge_settings": {"judge": cfg.judge, "chain_judge": cfg.chain_judge, "dtype": args.judge_dtype,
                               "max_new_tokens": args.judge_max_new_tokens},
            "environment": environment_info(),
        }
        metrics, samples = evaluate_ureason(model, instances, judge, out, cfg.max_new_tokens, cfg.batch_size,
                                            image_config, info)
    if shards.mode == "shard":
        print(f"ureason: shard {args.shard} done ({len(samples)} instances); "
              "merge with --merge once every shard is done")
        return 0
    loggers = make_loggers(LoggerConfig(type=args.logger), out, name=f"ureason-{out.name}", replace=True)
    log_eval_config(loggers, args, info["model_fingerprint"])
    log_metrics(loggers, {f"ureason/{k}": v for k, v in metrics.items()}, step=0)
    log_table(loggers, "ureason/samples", TABLE_COLUMNS, table_rows(samples, cfg.table_rows), step=0)
    log_figures(loggers, "ureason", out, FIGURES, step=0)
    for lg in loggers:
        lg.finalize("success")
    print((out / "table.md").read_text(), end="")
    print(f"wrote {out / 'ureason.json'} and {out / 'samples.jsonl'}")
    return 0
