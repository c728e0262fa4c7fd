"""``unicon evaluate cococon``: CocoCon on a checkpoint, standalone (:func:`cli`).

The flags of ``eval.cococon``'s fields are generated from :class:`unicon.config.CocoConEvalConfig`
(:func:`~unicon.evaluation.cli_common.add_config_args`: its types, defaults, choices and ranges), with
:data:`FLAGS`' exceptions: ``--data`` is required, ``images_root`` keeps its flag ``--images``, and
``--max-samples`` defaults to the whole file (``eval.cococon.max_samples`` is the epoch-end subset).
``--shard I/N`` and ``--merge`` split a run into jobs (:mod:`unicon.evaluation.distributed`); the
merged files equal one run's, except ``results.json``'s :data:`TIMING_FIELDS` (the shards' sum).
Writes ``results.json`` (metrics, the data and checkpoint, the model's weights fingerprint, the
generation settings, git commit and package versions), ``per_sample.jsonl`` and the plots to
``--out``, and logs metrics, figures and the sample table to ``--logger``.
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path
from typing import Sequence

from omegaconf import OmegaConf

from unicon.config import COCOCON_MAX_K, CocoConEvalConfig, LoggerConfig
from unicon.data.cococon import CocoConSample, load_cococon
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

log = logging.getLogger(__name__)


def check_can_score_t2i(model, sample: CocoConSample) -> None:
    """Score one sample's text-to-image likelihood before the run: a model whose image tokenizer
    cannot encode these images (the ShapesWorld model on COCO photos) fails here, in seconds."""
    import torch

    try:
        with torch.no_grad():
            model.score_image([[sample.caption]], [sample.load_image()])
    except UserError:
        raise
    except Exception as e:  # the backend's own complaint, whatever its type
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"the model cannot score text-to-image on {sample.file_name} ({first}); evaluate the other "
                        "tasks with --tasks vqa localization") from None


#: how ``eval.cococon``'s fields appear here: the old flag names, and the standalone defaults
FLAGS = {
    "data": Flag("CocoCon-schema JSON file", required=True),
    "images_root": Flag("image root for file_name (default: the JSON's folder)", names=("--images",)),
    "skip_missing": Flag("skip samples whose image file is missing"),
    "max_samples": Flag("evaluate the first N samples (eval.cococon.max_samples is the epoch-end subset)", default=None),
    "batch_size": Flag("samples per model call"),
    "generative": Flag("also the generative metrics (CIDEr/acc/FID); --no-generative: only likelihood scoring"),
    "table_rows": Flag("samples in the W&B table"),
    "tasks": Flag("tasks compared with captioning (t2i needs an image tokenizer that encodes the images)"),
    "probe_words": Flag("also report the samples whose gold answer names one of these words "
                        "(results.json 'probe'; e.g. a ShapesWorld --caption-gap concept)"),
}

#: results.json fields that measure time: the only ones a merge of shards cannot reproduce
TIMING_FIELDS = ("seconds",)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="unicon evaluate cococon",
                                description="CocoCon cross-task consistency (C_k, rho) and task accuracies.")
    add_common_args(p, out_help="output folder (results.json, per_sample.jsonl, plots)")
    add_config_args(p, CocoConEvalConfig, FLAGS)
    p.add_argument("--max-k", type=int, default=COCOCON_MAX_K, help="report C_k, acc@k for k = 1..max_k")
    p.add_argument("--fid-weights", default=None, help="local Inception weights for FID (else 'unavailable')")
    p.add_argument("--cider-tokenizer", choices=["auto", "ptb", "simple"], default="auto")
    p.add_argument("--name", default=None, help="run name for the logger")
    add_image_generation_args(p)
    add_shard_args(p)
    return p


def argv_from_config(cfg) -> list[str]:
    """``eval.cococon`` of a run config as this command's arguments (data: ``<data.root>/cococon_test.json``
    by default, as the epoch-end callback)."""
    c = OmegaConf.to_container(cfg.eval.cococon, resolve=True)
    c["data"] = c["data"] or str(Path(cfg.data.root) / "cococon_test.json")
    return config_argv(c, CocoConEvalConfig, FLAGS)


@register_suite("cococon", "CocoCon cross-task consistency C_k, rho_rank, accuracies", section="cococon",
                argv=argv_from_config,
                callback="unicon.evaluation.cococon.callback:CocoConCallback",
                config=CocoConEvalConfig,
                report="unicon.evaluation.cococon.report:section", title="CocoCon",
                headline=("cococon/vqa/C_1", "cococon/localization/C_1", "cococon/t2i/C_1", "cococon/vqa/rho"))
def cli(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    # heavy: imported once the arguments parse, not for --help
    from unicon.evaluation.cococon.metrics import evaluated_tasks
    from unicon.evaluation.cococon.plots import FIGURES
    from unicon.evaluation.cococon.runner import (
        TABLE_COLUMNS, evaluate_model, generation_settings, table_rows, write_outputs,
    )
    from unicon.evaluation.logs import log_eval_config, log_figures, log_metrics, log_table
    from unicon.loggers import environment_info, make_loggers

    cfg = config_from_args(args, CocoConEvalConfig, FLAGS)
    out = check_common_args(args, ("max_k",))

    data = load_cococon(cfg.data, cfg.images_root, cfg.skip_missing).subset(cfg.max_samples)
    log.info(data.report.summary())
    if not data.samples:
        raise UserError(f"{cfg.data}: no sample left to evaluate ({data.report.summary()})")
    with sharding(args, out) as shards, preemption.watch_signals():  # SIGTERM/SIGUSR1: stop at the next batch
        model, fingerprint = shards.load_model(args, load_model_for)  # a merge: recorded, no weights
        if "t2i" in cfg.tasks and shards.mode != "merge":
            check_can_score_t2i(model, data.samples[0])
        settings = dict(max_k=args.max_k, generative=cfg.generative, world_root=data.images_root,
                        fid_weights=args.fid_weights, cider_tokenizer=args.cider_tokenizer, tasks=cfg.tasks,
                        probe_words=cfg.probe_words, image_config=image_generation_config(model, args))
        start = time.perf_counter()
        result = evaluate_model(model, data.samples, cfg.batch_size, progress=True, **settings)
        seconds = time.perf_counter() - start
        shards.extra["seconds"] = seconds
    if shards.mode == "shard":
        print(f"cococon: shard {args.shard} done in {seconds:.1f}s; merge with --merge once every shard is done")
        return 0
    if shards.mode == "merge":  # the model time is the shards'
        seconds = sum(info["extra"]["seconds"] for info in shards.done)
    result.results.update(
        data=str(cfg.data), ckpt=str(args.ckpt), checkpoint=str(Path(args.ckpt).resolve()),
        model_fingerprint=fingerprint, seconds=seconds,
        num_samples_in_file=data.report.num_annotations,
        skipped_missing_images=len(data.report.missing_images),
        load_report={k: (len(v) if isinstance(v, list) else v) for k, v in data.report.to_dict().items()},
        generation=generation_settings(model, settings), environment=environment_info(),
    )
    write_outputs(result, out)
    loggers = make_loggers(LoggerConfig(type=args.logger), out, name=args.name or f"cococon-{Path(args.ckpt).name}",
                           replace=True)
    log_eval_config(loggers, args, result.results["model_fingerprint"])
    metrics = result.flat()
    metrics["cococon/seconds"] = seconds
    log_metrics(loggers, metrics, step=0)
    log_figures(loggers, "cococon", out, FIGURES, step=0)
    rows = table_rows(result, {s.index: s for s in data.samples}, cfg.table_rows)
    log_table(loggers, "cococon/samples", TABLE_COLUMNS, rows, step=0)
    for lg in loggers:
        lg.finalize("success")
    r = result.results
    print(f"cococon: {r['num_samples']} samples in {seconds:.1f}s -> {out}")
    for t in evaluated_tasks(r):
        print(f"  {t:12s} C_1={r[t]['C_k'][1]:.1f} (n={r[t]['n_k'][1]}, ties={r[t]['ties_k'][1]}) "
              f"rho={r[t]['rho']:.3f} (undefined {r[t]['rho_undefined']}) acc@1={r[t]['acc@k'][1]:.1f}")
    return 0
