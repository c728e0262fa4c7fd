"""``unicon evaluate cococon``: CocoCon on a checkpoint, standalone (:func:`cli`).

Flags that ``eval.cococon`` also has take their defaults from :class:`unicon.config.CocoConEvalConfig`,
except ``--max-samples``: the standalone benchmark scores the whole file unless told otherwise,
while ``eval.cococon.max_samples`` is the epoch-end subset. Writes ``results.json`` (metrics, the
data and checkpoint, the model's weights fingerprint, the generation settings, git commit and
package versions), ``per_sample.jsonl`` and the plots to ``--out``, and logs metrics, figures and
the sample table to ``--logger``.
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path
from typing import Sequence

import torch

from unicon.config import CocoConEvalConfig, LoggerConfig
from unicon.core import weights_fingerprint
from unicon.data.cococon import CocoConSample, load_cococon
from unicon.errors import UserError
from unicon.evaluation import preemption
from unicon.evaluation.callbacks import log_eval_config, log_figures, log_metrics, log_table
from unicon.evaluation.cli_common import (
    add_common_args,
    add_image_generation_args,
    check_common_args,
    image_generation_config,
    load_model_for,
)
from unicon.evaluation.cococon.callback import TABLE_COLUMNS, table_rows
from unicon.evaluation.cococon.metrics import MAX_K, TASKS, evaluated_tasks
from unicon.evaluation.cococon.plots import FIGURES
from unicon.evaluation.cococon.runner import evaluate_model, generation_settings, write_outputs
from unicon.loggers import environment_info, make_loggers

log = logging.getLogger(__name__)


def check_can_score_t2i(model, sample: CocoConSample) -> None:
    """Score one sample's text-to-image likelihood before the run: a model whose image tokenizer
    cannot encode these images (the ShapesWorld model on COCO photos) fails here, in seconds."""
    try:
        with torch.no_grad():
            model.score_image([[sample.caption]], [sample.load_image()])
    except UserError:
        raise
    except Exception as e:  # the backend's own complaint, whatever its type
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"the model cannot score text-to-image on {sample.file_name} ({first}); evaluate the other "
                        "tasks with --tasks vqa localization") from None


def parser() -> argparse.ArgumentParser:
    defaults = CocoConEvalConfig()
    p = argparse.ArgumentParser(prog="unicon evaluate cococon",
                                description="CocoCon cross-task consistency (C_k, rho) and task accuracies.")
    add_common_args(p, out_help="output folder (results.json, per_sample.jsonl, plots)")
    p.add_argument("--data", required=True, help="CocoCon-schema JSON file")
    p.add_argument("--images", default=defaults.images_root,
                   help="image root for file_name (default: the JSON's folder)")
    p.add_argument("--skip-missing", action="store_true", default=defaults.skip_missing,
                   help="skip samples whose image file is missing")
    p.add_argument("--max-samples", type=int, default=None,
                   help="evaluate the first N samples (default: all; eval.cococon.max_samples is the epoch-end subset)")
    p.add_argument("--batch-size", type=int, default=defaults.batch_size)
    p.add_argument("--max-k", type=int, default=MAX_K, help="report C_k, acc@k for k = 1..max_k")
    p.add_argument("--tasks", nargs="+", choices=list(TASKS), default=list(defaults.tasks),
                   help="tasks compared with captioning (t2i needs an image tokenizer that encodes the images)")
    p.add_argument("--no-generative", dest="generative", action="store_false", default=defaults.generative,
                   help="only likelihood scoring (no CIDEr/acc/FID)")
    p.add_argument("--probe-words", nargs="+", default=list(defaults.probe_words), metavar="WORD",
                   help="also report the samples whose gold answer names one of these words "
                        "(results.json 'probe'; e.g. a ShapesWorld --caption-gap concept)")
    p.add_argument("--fid-weights", default=None, help="local Inception weights for FID (else 'unavailable')")
    p.add_argument("--cider-tokenizer", choices=["auto", "ptb", "simple"], default="auto")
    p.add_argument("--table-rows", type=int, default=defaults.table_rows, help="samples in the W&B table")
    p.add_argument("--name", default=None, help="run name for the logger")
    add_image_generation_args(p)
    return p


def cli(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    out = check_common_args(args, ("batch_size", "max_samples", "max_k", "table_rows"), {"table_rows": 0})

    data = load_cococon(args.data, args.images, args.skip_missing).subset(args.max_samples)
    log.info(data.report.summary())
    if not data.samples:
        raise UserError(f"{args.data}: no sample left to evaluate ({data.report.summary()})")
    model = load_model_for(args)
    if "t2i" in args.tasks:
        check_can_score_t2i(model, data.samples[0])
    settings = dict(max_k=args.max_k, generative=args.generative, world_root=data.images_root,
                    fid_weights=args.fid_weights, cider_tokenizer=args.cider_tokenizer, tasks=args.tasks,
                    probe_words=args.probe_words, image_config=image_generation_config(model, args))
    start = time.perf_counter()
    with preemption.watch_signals():  # SIGTERM/SIGUSR1: stop at the next batch, exit 128 + signal
        result = evaluate_model(model, data.samples, args.batch_size, progress=True, **settings)
    seconds = time.perf_counter() - start
    result.results.update(
        data=str(args.data), ckpt=str(args.ckpt), checkpoint=str(Path(args.ckpt).resolve()),
        model_fingerprint=weights_fingerprint(model), seconds=seconds,
        num_samples_in_file=data.report.num_annotations,
        skipped_missing_images=len(data.report.missing_images),
        load_report={k: (len(v) if isinstance(v, list) else v) for k, v in data.report.to_dict().items()},
        generation=generation_settings(model, settings), environment=environment_info(),
    )
    write_outputs(result, out)
    loggers = make_loggers(LoggerConfig(type=args.logger), out, name=args.name or f"cococon-{Path(args.ckpt).name}")
    log_eval_config(loggers, args, result.results["model_fingerprint"])
    metrics = result.flat()
    metrics["cococon/seconds"] = seconds
    log_metrics(loggers, metrics, step=0)
    log_figures(loggers, "cococon", out, FIGURES, step=0)
    rows = table_rows(result, {s.index: s for s in data.samples}, args.table_rows)
    log_table(loggers, "cococon/samples", TABLE_COLUMNS, rows, step=0)
    for lg in loggers:
        lg.finalize("success")
    r = result.results
    print(f"cococon: {r['num_samples']} samples in {seconds:.1f}s -> {out}")
    for t in evaluated_tasks(r):
        print(f"  {t:12s} C_1={r[t]['C_k'][1]:.1f} (n={r[t]['n_k'][1]}, ties={r[t]['ties_k'][1]}) "
              f"rho={r[t]['rho']:.3f} (undefined {r[t]['rho_undefined']}) acc@1={r[t]['acc@k'][1]:.1f}")
    return 0
