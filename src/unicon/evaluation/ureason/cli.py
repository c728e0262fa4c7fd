"""``unicon evaluate ureason``: the three UReason settings of a saved model, judged, in one folder.

Flag defaults come from :class:`unicon.config.UReasonEvalConfig` where it has the field (judge,
chain judge, token budget, batch size, table rows), so the command and the epoch-end callback
agree; ``--max-samples`` alone differs: the config's value is the size of the epoch-end subset,
while the command evaluates every instance unless told otherwise. Writes ``--out`` (see
:mod:`unicon.evaluation.ureason.runner`); ``ureason.json`` also records the checkpoint, the
weights fingerprint, the generation and judge settings, the git commit and the package versions.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Sequence

from unicon.config import LoggerConfig, UReasonEvalConfig
from unicon.data.ureason import SPLITS, load_instances, subset, world_root_of
from unicon.errors import UserError
from unicon.evaluation import preemption
from unicon.evaluation.callbacks import log_eval_config, log_metrics, log_table
from unicon.evaluation.cli_common import (
    add_common_args,
    add_image_generation_args,
    check_common_args,
    image_generation_config,
    load_model_for,
)
from unicon.evaluation.ureason.judges import (
    JUDGE_DTYPES,
    JUDGE_MAX_NEW_TOKENS,
    build_judge,
    check_judge_fits,
    check_judge_spec,
)
from unicon.evaluation.ureason.runner import TABLE_COLUMNS, evaluate_ureason, table_rows


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="unicon evaluate ureason",
        description="UReason: direct, reasoning-guided and de-contextualized generation, judged.",
    )
    add_common_args(p)
    p.add_argument("--data", required=True,
                   help="UReason directory (direct_<cat>.jsonl + <cat>.jsonl) or a ShapesWorld root")
    p.add_argument("--judge", default=UReasonEvalConfig.judge,
                   help="'exact' (ShapesWorld verifier) or 'vlm:<path>' (image-text-to-text model)")
    p.add_argument("--chain-judge", default=UReasonEvalConfig.chain_judge,
                   help="causal LM path for the reasoning-chain judge (Table 3)")
    p.add_argument("--split", choices=SPLITS, default=None,
                   help="split of the UReason release (a ShapesWorld root has one split)")
    p.add_argument("--categories", nargs="+", default=None)
    p.add_argument("--max-samples", type=int, default=None, help="round-robin subset over categories (default: all)")
    p.add_argument("--max-new-tokens", type=int, default=UReasonEvalConfig.max_new_tokens,
                   help="token budget of the reasoning trace")
    p.add_argument("--batch-size", type=int, default=UReasonEvalConfig.batch_size)
    p.add_argument("--judge-dtype", default="float32", choices=JUDGE_DTYPES)
    p.add_argument("--judge-max-new-tokens", type=int, default=JUDGE_MAX_NEW_TOKENS)
    p.add_argument("--trust-remote-code", action="store_true", help="allow custom code of judge models")
    p.add_argument("--table-rows", type=int, default=UReasonEvalConfig.table_rows,
                   help="samples in the W&B image table")
    add_image_generation_args(p)
    return p


def cli(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from unicon.loggers import environment_info, make_loggers
    from unicon.core import weights_fingerprint

    out = check_common_args(args, ("max_samples", "max_new_tokens", "batch_size", "judge_max_new_tokens",
                                   "table_rows"), {"table_rows": 0})
    check_judge_spec(args.judge, args.chain_judge)
    if args.split and world_root_of(args.data) is not None:
        raise UserError(f"--split {args.split}: {args.data} is a ShapesWorld root, which has one split; "
                        "--split selects a split of the UReason release")
    instances = subset(load_instances(args.data, split=args.split, categories=args.categories), args.max_samples)
    check_judge_fits(args.judge, instances)
    judge = build_judge(args.judge, chain=args.chain_judge, world_root=world_root_of(args.data),
                        device=args.device, dtype=args.judge_dtype,
                        trust_remote_code=args.trust_remote_code, max_new_tokens=args.judge_max_new_tokens)
    model = load_model_for(args)
    image_config = image_generation_config(model, args)
    info = {
        "ckpt": str(args.ckpt), "checkpoint": str(Path(args.ckpt).resolve()),
        "model_fingerprint": weights_fingerprint(model), "data": str(args.data), "split": args.split,
        "categories": args.categories, "max_samples": args.max_samples,
        "generation": {"max_new_tokens": args.max_new_tokens, "batch_size": args.batch_size,
                       "image": dataclasses.asdict(image_config)},
        "judge_settings": {"judge": args.judge, "chain_judge": args.chain_judge, "dtype": args.judge_dtype,
                           "max_new_tokens": args.judge_max_new_tokens},
        "environment": environment_info(),
    }
    with preemption.watch_signals():  # SIGTERM/SIGUSR1: stop at the next batch, exit 128 + signal
        metrics, samples = evaluate_ureason(model, instances, judge, out, args.max_new_tokens, args.batch_size,
                                            image_config, info)
    loggers = make_loggers(LoggerConfig(type=args.logger), out, name=f"ureason-{out.name}")
    log_eval_config(loggers, args, info["model_fingerprint"])
    log_metrics(loggers, {f"ureason/{k}": v for k, v in metrics.items()}, step=0)
    log_table(loggers, "ureason/samples", TABLE_COLUMNS, table_rows(samples, args.table_rows), step=0)
    for lg in loggers:
        lg.finalize("success")
    print((out / "table.md").read_text(), end="")
    print(f"wrote {out / 'ureason.json'} and {out / 'samples.jsonl'}")
    return 0
