"""``unicon evaluate alignment``: BagelScore of a saved model against human ratings of image-caption
pairs, with the baselines of the paper's Table 1, CLIP-S, RefCLIP-S, BLEU-1, BLEU-4, ROUGE-L, METEOR,
CIDEr-D, SPICE and BERTScore (and optionally a VLM judge), side by side.

The flags of ``eval.alignment``'s fields are generated from :class:`unicon.config.AlignmentEvalConfig`
(:func:`~unicon.evaluation.cli_common.add_config_args`), so the command and the epoch-end callback
agree; :data:`FLAGS` lists the exceptions: ``--data`` is required, the pairs are ``--limit``
(standalone default: all; the config's value is the epoch-end subset), ``--bagel-modes`` and
``--baselines`` are comma-separated. ``--shard I/N`` and ``--merge`` split a run into jobs whose merged
files equal one run's, byte for byte (the reference metrics are computed in the merge, over all
pairs). Writes ``--out`` (see :mod:`unicon.evaluation.alignment.runner`) and prints ``table.md``;
``alignment.json`` also records the checkpoint, the weights fingerprint, the settings, the git commit
and the package versions.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Sequence

from omegaconf import OmegaConf

from unicon.config import JUDGE_DTYPES, AlignmentEvalConfig, LoggerConfig
from unicon.errors import UserError
from unicon.evaluation import preemption
from unicon.evaluation.alignment.data import data_file, load_pairs, subset
from unicon.evaluation.cli_common import (
    Flag,
    add_common_args,
    add_config_args,
    add_shard_args,
    check_common_args,
    config_argv,
    config_from_args,
    load_model_for,
    sharding,
)
from unicon.evaluation.suites import register_suite

#: how ``eval.alignment``'s fields appear here (the standalone defaults that differ are marked)
FLAGS = {
    "data": Flag("Flickr8K .json (CLIPScore layout), .jsonl pairs (image, caption, rating, references?) "
                 "or a ShapesWorld root (its alignment/pairs.jsonl)", required=True),
    "images": Flag("folder the image paths are relative to (default: the data file's folder / the world root)"),
    "bagel_modes": Flag("BagelScore modes: expected (likelihood-weighted, ours), decode (generated, the paper's)",
                        comma=True),
    "baselines": Flag("baselines side by side: clip_s, refclip_s (need --clip); bleu1, bleu4, rouge_l, meteor, "
                      "cider, spice, bertscore (need references; meteor and spice need java, spice the Stanford "
                      "CoreNLP jars; bertscore uses the local all-MiniLM-L6-v2, not the published roberta-large)",
                      comma=True),
    "clip": Flag("open_clip model for CLIP-S / RefCLIP-S: a directory, '<arch>:<weights file>' or hf-hub:<repo>"),
    "clip_prefix": Flag("text before every caption and reference CLIP embeds: 'hessel' (\"A photo depicts \", "
                        "Hessel et al.), 'none', or 'auto' (none for a ShapesWorld CLIP, hessel otherwise)"),
    "bagel_scale": Flag("BagelScore rating scale: 'cf' (the paper's Flickr8K-CF prompt, 0/0.3/0.6/1.0), 'expert' "
                        "(its 1-4 form for Flickr8K-Expert, ours) or 'auto' (expert for a Flickr8K-Expert "
                        "file, cf otherwise)"),
    "judge": Flag("optional VLM judge asked the same prompt: vlm:<local model directory>"),
    "rating_min": Flag("ratings below are skipped and counted"),
    "rating_max": Flag("ratings above are skipped and counted"),
    "max_samples": Flag("pairs to evaluate, the first ones (standalone default: all)", names=("--limit",),
                        dest="limit", default=None),
    "batch_size": Flag("pairs per model call"),
    "table_rows": Flag("pairs in the W&B table"),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="unicon evaluate alignment",
                                description="BagelScore vs CLIPScore & co. against human ratings (Kendall τ_b, τ_c).")
    add_common_args(p, out_help="output folder (alignment.json, samples.jsonl, table.md, metrics_vs_rating.png)")
    add_config_args(p, AlignmentEvalConfig, FLAGS)
    p.add_argument("--judge-dtype", default="float32", choices=JUDGE_DTYPES)
    p.add_argument("--judge-max-new-tokens", type=int, default=16)
    p.add_argument("--trust-remote-code", action="store_true", help="allow custom code of judge models")
    add_shard_args(p)
    return p


def argv_from_config(cfg) -> list[str]:
    """``eval.alignment`` of a run config as this command's arguments (data: ``data.root`` by default,
    as the epoch-end callback)."""
    c = OmegaConf.to_container(cfg.eval.alignment, resolve=True)
    c["data"] = c["data"] or str(cfg.data.root)
    return config_argv(c, AlignmentEvalConfig, FLAGS)


def load_clip(source: str | None, device: str = "cpu"):
    """The :class:`~unicon.embedders.clip.ClipEmbedder` of ``--clip`` (None without one); a missing
    model is a :class:`UserError` naming the path."""
    if not source:
        return None
    from unicon.embedders.base import EmbedderNotFound
    from unicon.embedders.clip import ClipEmbedder

    try:
        return ClipEmbedder(source, device=device)
    except EmbedderNotFound as e:
        raise UserError(f"--clip {source}: {e}") from None


@register_suite("alignment", "BagelScore vs CLIPScore & co. against human ratings (Kendall τ)", section="alignment",
                argv=argv_from_config, callback="unicon.evaluation.alignment.callback:AlignmentCallback",
                config=AlignmentEvalConfig,
                report="unicon.evaluation.alignment.report:section", title="Image-text alignment")
def cli(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # heavy: imported once the arguments parse, not for --help
    from unicon.evaluation.alignment.judges import build_judge, check_judge
    from unicon.evaluation.alignment.metrics import flat_metrics
    from unicon.evaluation.alignment.plots import FIGURES
    from unicon.evaluation.alignment.runner import evaluate_alignment, resolve_bagel_scale, table_columns, table_rows
    from unicon.evaluation.logs import log_eval_config, log_figures, log_metrics, log_table
    from unicon.loggers import environment_info, make_loggers

    cfg = config_from_args(args, AlignmentEvalConfig, FLAGS)
    out = check_common_args(args, ("judge_max_new_tokens",))
    check_judge(cfg.judge)
    if not cfg.bagel_modes and not cfg.baselines and not cfg.judge:
        raise UserError("--bagel-modes and --baselines are both empty: nothing to evaluate")
    pairs, skipped = load_pairs(cfg.data, cfg.images, cfg.rating_min, cfg.rating_max)
    pairs = subset(pairs, cfg.max_samples)
    with sharding(args, out) as shards, preemption.watch_signals():  # SIGTERM/SIGUSR1: stop at the next batch
        judge_spec = shards.record("judge", cfg.judge)
        clip_source = shards.record("clip", cfg.clip)
        if shards.mode == "merge":  # neither CLIP nor judge is loaded: the shards scored every pair
            clip = judge = None
        else:
            clip = load_clip(cfg.clip, args.device)
            judge = build_judge(cfg.judge, device=args.device, dtype=args.judge_dtype,
                                trust_remote_code=args.trust_remote_code, max_new_tokens=args.judge_max_new_tokens)
        model, fingerprint = shards.load_model(args, load_model_for)  # a merge: recorded, no weights
        info = {
            "ckpt": str(args.ckpt), "checkpoint": str(Path(args.ckpt).resolve()), "model_fingerprint": fingerprint,
            "backend": getattr(model, "backend", None) if shards.mode != "merge" else shards.record("backend", None),
            "data": str(cfg.data), "images": cfg.images, "limit": cfg.max_samples,
            "ratings": {"min": cfg.rating_min, "max": cfg.rating_max},
            "judge_settings": {"judge": cfg.judge, "dtype": args.judge_dtype,
                               "max_new_tokens": args.judge_max_new_tokens} if cfg.judge else None,
            "environment": environment_info(),
        }
        if shards.mode == "shard":
            shards.record("backend", info["backend"])
        results, records = evaluate_alignment(
            model, pairs, out, cfg.bagel_modes, cfg.baselines, clip=clip, judge=judge, batch_size=cfg.batch_size,
            skipped=dict(skipped), info=info, clip_source=clip_source, judge_spec=judge_spec,
            bagel_scale=resolve_bagel_scale(cfg.bagel_scale, data_file(cfg.data)), clip_prefix=cfg.clip_prefix)
    if shards.mode == "shard":
        print(f"alignment: shard {args.shard} done; merge with --merge once every shard is done")
        return 0
    loggers = make_loggers(LoggerConfig(type=args.logger), out, name=f"alignment-{out.name}", replace=True)
    log_eval_config(loggers, args, fingerprint)
    log_metrics(loggers, {f"alignment/{k}": v for k, v in flat_metrics(results["metrics"]).items()}, step=0)
    names = list(results["metrics"])
    log_table(loggers, "alignment/samples", table_columns(names), table_rows(records, pairs, names, cfg.table_rows),
              step=0)
    log_figures(loggers, "alignment", out, FIGURES, step=0)
    for lg in loggers:
        lg.finalize("success")
    print((out / "table.md").read_text(), end="")
    print(f"wrote {out / 'alignment.json'} and {out / 'samples.jsonl'}")
    return 0
