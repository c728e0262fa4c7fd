"""The alignment suite: ``unicon evaluate alignment`` and ``eval.alignment`` at epoch end, BagelScore of a
model against human ratings of image-caption pairs, with the baselines of the paper's Table 1 and
optionally a VLM judge, side by side as Kendall τ_b and τ_c
(:func:`~unicon.evaluation.alignment.runner.evaluate_alignment`; files:
:mod:`unicon.evaluation.alignment.runner`).

Scalars: ``alignment/<metric>/{tau_b,tau_c,n}`` and the decode failure rate. The CLIP (``clip``) and
the VLM judge are loaded once (at the first epoch end); a merge loads neither (the shards scored every
pair; the reference metrics are computed in the merge, over all pairs).
"""

from __future__ import annotations

from typing import NamedTuple

from unicon.config import AlignmentEvalConfig
from unicon.errors import UserError
from unicon.evaluation.cli_common import Flag
from unicon.evaluation.framework import EvalRun, EvalSuite, Outcome
from unicon.evaluation.suites import register

#: how ``eval.alignment``'s fields appear on the command line (the standalone defaults that differ are marked)
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


class Pairs(NamedTuple):
    """What :meth:`AlignmentSuite.load` reads: the pairs to score, the skipped rows by reason, the
    resolved BagelScore scale."""

    pairs: list
    skipped: dict[str, int]
    bagel_scale: str


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


class AlignmentSuite(EvalSuite):
    name = "alignment"
    help = "BagelScore vs CLIPScore & co. against human ratings (Kendall τ)"
    description = "BagelScore vs CLIPScore & co. against human ratings (Kendall τ_b, τ_c)."
    config = AlignmentEvalConfig
    flags = FLAGS
    out_help = "output folder (alignment.json, samples.jsonl, table.md, metrics_vs_rating.png)"
    draws_images = False
    judge_tokens = 16
    figures = "unicon.evaluation.alignment.report:FIGURES"
    report = "unicon.evaluation.alignment.report:section"
    title = "Image-text alignment"

    def load(self, config, args, root):
        from unicon.evaluation.alignment.data import data_file, load_pairs, subset
        from unicon.evaluation.alignment.judges import check_judge
        from unicon.evaluation.alignment.runner import resolve_bagel_scale

        check_judge(config.judge)
        if args is not None and not config.bagel_modes and not config.baselines and not config.judge:
            raise UserError("--bagel-modes and --baselines are both empty: nothing to evaluate")
        bagel_scale = resolve_bagel_scale(config.bagel_scale, data_file(config.data))
        pairs, skipped = load_pairs(config.data, config.images, config.rating_min, config.rating_max)
        return Pairs(subset(pairs, config.max_samples), dict(skipped), bagel_scale)

    def scorers(self, run: EvalRun):
        """``(clip, judge)``: built once (kept across epoch ends); a merge loads neither."""
        from unicon.evaluation.alignment.judges import build_judge

        if run.merging:  # the shards scored every pair
            return None, None
        if "clip" not in run.cache:
            run.cache["clip"] = load_clip(run.config.clip, run.device)
        if "judge" not in run.cache:
            run.cache["judge"] = build_judge(run.config.judge, **{"device": run.device, **run.judge_kwargs()})
        return run.cache["clip"], run.cache["judge"]

    def run(self, run: EvalRun) -> Outcome:
        from unicon.evaluation.alignment.metrics import flat_metrics
        from unicon.evaluation.alignment.runner import evaluate_alignment, table_columns, table_rows
        from unicon.loggers import environment_info

        c, inputs = run.config, run.inputs
        judge_spec = run.record("judge", c.judge)
        clip_source = run.record("clip", c.clip)
        clip, judge = self.scorers(run)
        if run.standalone:
            info = {
                **run.checkpoint_info(), "backend": run.record("backend", getattr(run.model, "backend", None)),
                "data": str(c.data), "images": c.images, "limit": c.max_samples,
                "ratings": {"min": c.rating_min, "max": c.rating_max},
                "judge_settings": run.judge_settings(judge=c.judge) if c.judge else None,
                "environment": environment_info(),
            }
        else:
            info = {"epoch": run.epoch, "data": str(c.data)}
        results, records = evaluate_alignment(
            run.model, inputs.pairs, run.out, c.bagel_modes, c.baselines, clip=clip, judge=judge,
            batch_size=c.batch_size, skipped=dict(inputs.skipped), info=info, clip_source=clip_source,
            judge_spec=judge_spec, bagel_scale=inputs.bagel_scale, clip_prefix=c.clip_prefix)
        names = list(results["metrics"])
        rows = table_rows(records, inputs.pairs, names, c.table_rows) if run.is_writer else None
        return Outcome({f"alignment/{k}": v for k, v in flat_metrics(results["metrics"]).items()}, rows,
                       table_columns(names), run.printed("alignment.json"), results)


register(AlignmentSuite())
