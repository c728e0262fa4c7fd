"""The CocoCon suite: ``unicon evaluate cococon`` and ``eval.cococon`` at epoch end (C_k, rho, task
accuracies; :mod:`unicon.evaluation.cococon.metrics`).

Writes ``results.json`` (metrics; standalone also the data and checkpoint, the model's weights
fingerprint, the generation settings, git commit and package versions), ``per_sample.jsonl`` and the
plots. A merge of shards equals one run's files, except ``results.json``'s :data:`TIMING_FIELDS` (the
shards' sum).
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

from unicon.config import COCOCON_MAX_K, CocoConEvalConfig
from unicon.errors import UserError
from unicon.evaluation.cli_common import Flag
from unicon.evaluation.framework import EvalRun, EvalSuite, Outcome
from unicon.evaluation.suites import register

#: how ``eval.cococon``'s fields appear on the command line: the old flag names, and the standalone defaults
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


def check_can_score_t2i(model, sample) -> None:
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


class CocoConSuite(EvalSuite):
    name = "cococon"
    help = "CocoCon cross-task consistency C_k, rho_rank, accuracies"
    description = "CocoCon cross-task consistency (C_k, rho) and task accuracies."
    config = CocoConEvalConfig
    flags = FLAGS
    out_help = "output folder (results.json, per_sample.jsonl, plots)"
    counts = ("max_k",)
    figures = "unicon.evaluation.cococon.report:FIGURES"
    report = "unicon.evaluation.cococon.report:section"
    title = "CocoCon"
    headline = ("cococon/vqa/C_1", "cococon/localization/C_1", "cococon/t2i/C_1", "cococon/vqa/rho")

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("--max-k", type=int, default=COCOCON_MAX_K, help="report C_k, acc@k for k = 1..max_k")
        p.add_argument("--fid-weights", default=None, help="local Inception weights for FID (else 'unavailable')")
        p.add_argument("--cider-tokenizer", choices=["auto", "ptb", "simple"], default="auto")

    def default_data(self, run_cfg) -> str:
        return str(Path(run_cfg.data.root) / "cococon_test.json")

    def load(self, config, args, root):
        from unicon.data.cococon import load_cococon

        data = load_cococon(config.data, config.images_root, config.skip_missing).subset(config.max_samples)
        if args is not None:
            logging.getLogger(__name__).info(data.report.summary())
            if not data.samples:
                raise UserError(f"{config.data}: no sample left to evaluate ({data.report.summary()})")
        return data

    def run(self, run: EvalRun) -> Outcome:
        from unicon.evaluation.cococon.metrics import evaluated_tasks
        from unicon.evaluation.cococon.runner import (
            TABLE_COLUMNS, evaluate_model, generation_settings, table_rows, write_outputs,
        )
        from unicon.loggers import environment_info

        c, data, args = run.config, run.inputs, run.args
        settings = dict(generative=c.generative, world_root=data.images_root, tasks=c.tasks,
                        probe_words=c.probe_words)
        if args is not None:
            if "t2i" in c.tasks and not run.merging:
                check_can_score_t2i(run.model, data.samples[0])
            settings.update(max_k=args.max_k, fid_weights=args.fid_weights, cider_tokenizer=args.cider_tokenizer,
                            image_config=run.image_config())
        start = time.perf_counter()
        result = evaluate_model(run.model, data.samples, c.batch_size, **settings)
        seconds = time.perf_counter() - start
        if run.shards is not None:
            run.shards.extra["seconds"] = seconds
            if run.merging:  # the model time is the shards'
                seconds = sum(info["extra"]["seconds"] for info in run.shards.done)
        rows = None
        if run.is_writer:
            if args is not None:
                result.results.update(
                    data=str(c.data), **run.checkpoint_info(), seconds=seconds,
                    num_samples_in_file=data.report.num_annotations,
                    skipped_missing_images=len(data.report.missing_images),
                    load_report={k: (len(v) if isinstance(v, list) else v) for k, v in data.report.to_dict().items()},
                    generation=generation_settings(run.model, settings), environment=environment_info(),
                )
            write_outputs(result, run.out)
            if c.table_rows or args is not None:
                rows = table_rows(result, {s.index: s for s in data.samples}, c.table_rows)
        metrics = result.flat()
        r = result.results
        summary = [f"cococon: {r['num_samples']} samples in {seconds:.1f}s -> {run.out}"]
        summary += [f"  {t:12s} C_1={r[t]['C_k'][1]:.1f} (n={r[t]['n_k'][1]}, ties={r[t]['ties_k'][1]}) "
                    f"rho={r[t]['rho']:.3f} (undefined {r[t]['rho_undefined']}) acc@1={r[t]['acc@k'][1]:.1f}"
                    for t in evaluated_tasks(r)]
        return Outcome(metrics, rows, TABLE_COLUMNS, "\n".join(summary), result)


register(CocoConSuite())
