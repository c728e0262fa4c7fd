"""``unicon evaluate editing``: EditingScore of (source, edited image, instruction) samples with ratings,
its Table 4 ablations and their Kendall correlations with the ratings, in one folder.

``--data`` is an Edit-1K-like JSONL file (``docs/editing_score.md``; ShapesWorld writes one with exact
ratings to ``<world>/editscore/editscore.jsonl``). ``--own-edits N`` also edits the first N test edit rows
of a ShapesWorld root (``--world``; default: the world the data file lies in, when it has a ``world.json``
two folders up) with the model itself and reports the score per edit kind beside exact match.
``--judge`` adds the baseline of the paper's Table 3 (a judge's rating of each edit, in place of its
GPT-based score: ``model``, the evaluated model, or ``vlm:<local directory>``;
:mod:`~unicon.evaluation.editing.judges`); ``editing.json`` and ``table.md`` always hold Table 2 (the
Pearson matrix) and Table 3 (without a judge its row says why).
``--shard I/N`` and ``--merge`` split a run into jobs whose merged files equal one run's. At epoch end
it is ``eval.editing`` (:class:`unicon.config.EditingEvalConfig`, ``eval=editing``;
:class:`~unicon.evaluation.editing.callback.EditingCallback`). The flags of its fields are generated from
that dataclass (:func:`~unicon.evaluation.cli_common.add_config_args`), so the command and the callback
agree; :data:`FLAGS` lists the exceptions: ``--data`` is required and the rows are ``--limit`` (standalone
default: all; the config's value is the epoch-end subset). :func:`argv_from_config` turns a run config into
these flags for ``unicon evaluate all``. Writes ``--out`` (see
:mod:`unicon.evaluation.editing.runner`) and prints ``table.md``; ``editing.json`` also records the
checkpoint, the weights fingerprint, the settings and the environment.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Sequence

from omegaconf import OmegaConf

from unicon.config import EDITING_EPS, JUDGE_DTYPES, EditingEvalConfig, LoggerConfig
from unicon.errors import UserError
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
from unicon.evaluation.editing.data import load_samples
from unicon.evaluation.suites import register_suite

#: how ``eval.editing``'s fields appear here (the standalone defaults that differ are marked)
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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="unicon evaluate editing",
                                description="EditingScore (cos_image * sim_text / (rls^2 + eps)) vs edit ratings: "
                                            "Kendall tau_b of the score and of its ablations.")
    add_common_args(p, out_help="output folder (editing.json, samples.jsonl, table.md, figures)")
    add_config_args(p, EditingEvalConfig, FLAGS)
    p.add_argument("--eps", type=float, default=EDITING_EPS, help="epsilon of rls^2 + eps (default: %(default)s, the paper's)")
    p.add_argument("--world", default=None, help="ShapesWorld root for --own-edits (default: two folders above --data "
                                                 "when it holds world.json)")
    p.add_argument("--judge", default=None,
                   help="Table 3's baseline, a judge rating every edit 0/0.3/0.6/1.0 (the paper's is GPT-based, "
                        "not available offline): 'model' (the evaluated model, shown the edited image) or "
                        "'vlm:<local model directory>' (shown the source and the edited image); default: none")
    p.add_argument("--judge-dtype", default="float32", choices=JUDGE_DTYPES)
    p.add_argument("--judge-max-new-tokens", type=int, default=16)
    p.add_argument("--trust-remote-code", action="store_true", help="allow custom code of judge models")
    add_image_generation_args(p)
    add_shard_args(p)
    return p


def world_of(args: argparse.Namespace) -> Path | None:
    if args.world is not None:
        root = Path(args.world)
        if not (root / "world.json").is_file():
            raise UserError(f"--world {root} is not a ShapesWorld root (no world.json)")
        return root
    guess = Path(args.data).resolve().parent.parent
    return guess if (guess / "world.json").is_file() else None


def default_data(root: str | Path) -> Path:
    """The EditingScore file of a ShapesWorld root (written by ``unicon build-data shapes``)."""
    return Path(root) / "editscore" / "editscore.jsonl"


def argv_from_config(cfg) -> list[str]:
    """``eval.editing`` of a run config as this command's arguments (data: the world's editscore file
    by default, as the epoch-end callback)."""
    c = OmegaConf.to_container(cfg.eval.editing, resolve=True)
    c["data"] = str(c["data"] or default_data(cfg.data.root))
    return config_argv(c, EditingEvalConfig, FLAGS)


@register_suite("editing", "EditingScore vs edit-quality ratings (Kendall tau_b, Table 4 ablations)",
                section="editing", argv=argv_from_config,
                callback="unicon.evaluation.editing.callback:EditingCallback",
                config=EditingEvalConfig,
                report="unicon.evaluation.editing.report:section", title="EditingScore")
def cli(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # heavy: imported once the arguments parse, not for --help
    from unicon.evaluation.logs import log_eval_config, log_figures, log_metrics, log_table
    from unicon.evaluation.editing.judges import build_judge, check_judge
    from unicon.evaluation.editing.plots import FIGURES
    from unicon.evaluation.editing.runner import TABLE_COLUMNS, evaluate_editing, table_rows
    from unicon.loggers import environment_info, make_loggers

    cfg = config_from_args(args, EditingEvalConfig, FLAGS)
    out = check_common_args(args)
    check_judge(args.judge)
    if args.judge_max_new_tokens < 1:
        raise UserError(f"--judge-max-new-tokens must be >= 1, got {args.judge_max_new_tokens}")
    if not args.eps > 0:
        raise UserError(f"--eps must be > 0, got {args.eps}")
    samples = load_samples(args.data, args.limit)
    world = world_of(args) if args.own_edits else None
    if args.own_edits and world is None:
        raise UserError("--own-edits needs a ShapesWorld root: pass --world (none found two folders above --data)")
    with sharding(args, out) as shards, preemption.watch_signals():
        model, fingerprint = shards.load_model(args, load_model_for)
        judge_spec = shards.record("judge", args.judge)
        judge = None if shards.mode == "merge" else build_judge(
            args.judge, model, device=args.device, dtype=args.judge_dtype, trust_remote_code=args.trust_remote_code,
            max_new_tokens=args.judge_max_new_tokens)
        image_config = image_generation_config(model, args)
        info = {
            "ckpt": str(args.ckpt), "checkpoint": str(Path(args.ckpt).resolve()), "model_fingerprint": fingerprint,
            "backend": shards.record("backend", getattr(model, "backend", None)),
            "data": str(args.data), "limit": args.limit, "batch_size": args.batch_size,
            "own_edits_requested": args.own_edits, "world": str(world) if world else None,
            "image_generation": dataclasses.asdict(image_config) if args.own_edits else None,
            "judge_settings": {"judge": args.judge, "dtype": args.judge_dtype,
                               "max_new_tokens": args.judge_max_new_tokens} if args.judge else None,
            "environment": environment_info(),
        }
        results, records = evaluate_editing(
            model, samples, out, args.batch_size, args.eps, info, own_edits=args.own_edits, world_root=world,
            image_config=image_config, check=shards.mode != "merge", data_root=Path(args.data).resolve().parent,
            judge=judge, judge_spec=judge_spec)
    if shards.mode == "shard":
        print(f"editing: shard {args.shard} done; merge with --merge once every shard is done")
        return 0
    loggers = make_loggers(LoggerConfig(type=args.logger), out, name=f"editing-{out.name}", replace=True)
    log_eval_config(loggers, args, fingerprint)
    log_metrics(loggers, {f"editing/{k}": v for k, v in results["metrics"].items()}, step=0)
    log_table(loggers, "editing/samples", TABLE_COLUMNS, table_rows(records, samples, cfg.table_rows),
              step=0)
    log_figures(loggers, "editing", out, FIGURES, step=0)
    for lg in loggers:
        lg.finalize("success")
    print((out / "table.md").read_text(), end="")
    if "own_edits" in results:
        for kind, b in results["own_edits"]["by_kind"].items():
            print(f"own edits {kind:<10} n={b['n']:<4} exact={b['exact_match']:.2f} median score={b['median_score']:.4g}")
    print(f"wrote {out / 'editing.json'} and {out / 'samples.jsonl'}")
    return 0
