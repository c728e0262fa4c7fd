"""BagelScore and the baselines over image-caption pairs: model calls, per-sample records, τ against the
human ratings and the output files, sharded over ranks.

For every batch of ``batch_size`` pairs of this rank (:func:`~unicon.evaluation.distributed.shard_indices`):

* BagelScore in each mode of ``bagel_modes`` (:mod:`.bagelscore`) on the run's rating scale
  (``bagel_scale``, :func:`resolve_bagel_scale`): ``expected``: one ``score_text`` call with the four
  answers as K = 4 candidates; ``decode``: one ``answer`` call, replies parsed strictly;
* with a CLIP (``clip``): CLIP-S and RefCLIP-S from the embeddings of the images, captions and
  references (:func:`~.metrics.clip_scores`), each text embedded after the run's ``clip_prefix``
  (:func:`resolve_clip_prefix`: Hessel et al.'s "A photo depicts " for a real CLIP, none for a
  ShapesWorld CLIP trained on the world's bare captions);
* with a judge (``vlm:<dir>``): the VLM asked the same prompt (:mod:`.judges`), parsed like ``decode``.

The records are gathered over ranks (or shards), then the reference metrics are computed over the
whole set (:func:`~.metrics.reference_metrics`) and every metric's Kendall τ_b and τ_c against the
ratings (:func:`~.metrics.summarize`).

Rank 0 (or the merge) writes into ``out_dir``:

* ``samples.jsonl``: one record per pair: ``id``, ``source``, ``image``, ``caption``, ``rating``,
  ``references``, ``scores`` (``{metric: score or null}``), ``bagel_reply`` (decode), ``bagel_probs``
  (expected, over ``"0", "0.3", "0.6", "1.0"``), ``judge_reply``;
* ``alignment.json``: ``{"metrics": {metric: {tau_b, tau_c, p_b, p_c, n, missing[, failures,
  failure_rate]}}, "n_pairs", "skipped" (ratings skipped by reason), "not_run" ({metric: why}),
  "tokenizer", "bertscore_model" (the model, layer and why its values are not the published
  BERTScore's; null without BERTScore), "settings", **info}`` (settings: the modes, baselines, CLIP,
  judge, batch size, ``bagel_scale`` (name, values, where its prompt comes from) and ``clip_prefix``
  (the setting and the text put before every caption); info: checkpoint, weights fingerprint,
  environment), strict JSON;
* ``table.md``: the τ table, the metrics not run and why, BERTScore's model;
  ``metrics_vs_rating.png``: each metric against the rating (:mod:`.plots`).
"""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path
from typing import Any, Sequence

import torch

from unicon.config import ALIGNMENT_BAGEL_MODES, ALIGNMENT_BASELINES, AlignmentEvalConfig
from unicon.errors import UserError
from unicon.evaluation import preemption
from unicon.evaluation.alignment.bagelscore import bagelscore
from unicon.evaluation.alignment.data import Pair, read_image
from unicon.evaluation.alignment.metrics import (
    HESSEL_PREFIX,
    NOTE_INFO,
    REFERENCE_METRICS,
    clip_scores,
    markdown_table,
    reference_metrics,
    summarize,
)
from unicon.evaluation.alignment.plots import plot_results
from unicon.evaluation.alignment.prompts import SCALES, scale_of
from unicon.evaluation.distributed import gather_records, owned_indices, shard_indices, writes_outputs
from unicon.evaluation.framework import eval_mode, write_results

log = logging.getLogger(__name__)

CLIP_METRICS = ("clip_s", "refclip_s")


def metric_names(bagel_modes: Sequence[str], baselines: Sequence[str], judge: bool) -> list[str]:
    """The metrics of a run, in report order."""
    names = [f"bagelscore_{m}" for m in ALIGNMENT_BAGEL_MODES if m in bagel_modes]
    if judge:
        names.append("vlm_judge")
    return names + [b for b in ALIGNMENT_BASELINES if b in baselines]


def not_run(baselines: Sequence[str], clip: str | None) -> dict[str, str]:
    """The asked-for baselines that cannot run in this configuration, and why."""
    return {m: "no --clip given (an open_clip model: python -m unicon.embedders.clip --train-shapes ...)"
            for m in CLIP_METRICS if m in baselines and not clip}


def resolve_bagel_scale(setting: str, data: str | Path | None) -> str:
    """The BagelScore scale of ``--bagel-scale``: ``cf`` or ``expert`` as given; ``auto``: ``expert`` for
    a Flickr8K-Expert file (a ``.json`` in the CLIPScore repository's Flickr8K layout whose name does not
    say ``crowdflower``), else ``cf`` (Flickr8K-CF, JSONL sets, and ShapesWorld, whose instruction rows
    train the CF prompt). The paper prints no prompt for Composite; ``cf`` is used there unless set."""
    if setting in SCALES:
        return setting
    if setting != "auto":
        raise UserError(f"--bagel-scale {setting!r}: choose auto, {', '.join(SCALES)}")
    path = Path(data) if data is not None else None
    if path is not None and path.suffix == ".json" and "crowdflower" not in path.name.lower():
        return "expert"
    return "cf"


def resolve_clip_prefix(setting: str, clip_source: str | None) -> str:
    """The text put before every caption and reference CLIP embeds: ``hessel`` -> ``"A photo depicts "``
    (Hessel et al.), ``none`` -> ``""``; ``auto``: none for a ShapesWorld CLIP (a folder with the
    ``train_log.json`` that ``python -m unicon.embedders.clip --train-shapes`` writes: it was trained on
    the world's captions without a prefix), Hessel's prefix for any other CLIP."""
    if setting == "hessel":
        return HESSEL_PREFIX
    if setting == "none":
        return ""
    if setting != "auto":
        raise UserError(f"--clip-prefix {setting!r}: choose auto, hessel or none")
    if clip_source:
        log_file = Path(clip_source).expanduser() / "train_log.json"
        try:
            if "world" in json.loads(log_file.read_text()):
                return ""
        except (OSError, ValueError, TypeError):
            pass
    return HESSEL_PREFIX


def score_batch(model, pairs: Sequence[Pair], bagel_modes: Sequence[str], clip=None, judge=None,
                baselines: Sequence[str] = ALIGNMENT_BASELINES, scale: str = "cf",
                clip_prefix: str = HESSEL_PREFIX) -> list[dict[str, Any]]:
    """The model-side scores of one batch: ``[{"scores": {...}, "bagel_reply", "bagel_probs", "judge_reply"}]``."""
    images = [read_image(p) for p in pairs]
    captions = [p.caption for p in pairs]
    out: list[dict[str, Any]] = [{"scores": {}, "bagel_reply": None, "bagel_probs": None, "judge_reply": None}
                                 for _ in pairs]
    for mode in ALIGNMENT_BAGEL_MODES:
        if mode not in bagel_modes:
            continue
        for o, r in zip(out, bagelscore(model, images, captions, mode, scale)):
            o["scores"][f"bagelscore_{mode}"] = r.score
            if mode == "decode":
                o["bagel_reply"] = r.reply
            else:
                o["bagel_probs"] = r.probs
    if judge is not None:
        for o, r in zip(out, judge.rate(images, captions, scale)):
            o["scores"]["vlm_judge"], o["judge_reply"] = r.score, r.reply
    if clip is not None and any(m in baselines for m in CLIP_METRICS):
        # one image / text per forward pass: a value does not depend on the batch it was scored in,
        # so shards and their merge give one run's numbers exactly
        img = torch.cat([clip.embed_image([im]) for im in images])
        cap = torch.cat([clip.embed_text([clip_prefix + c]) for c in captions])
        flat = [r for p in pairs for r in p.references]
        ref_all = torch.cat([clip.embed_text([clip_prefix + r]) for r in flat]) if flat else None
        refs, k = [], 0
        for p in pairs:
            refs.append(ref_all[k:k + len(p.references)] if p.references else None)
            k += len(p.references)
        clip_s, ref_s = clip_scores(img, cap, refs)
        for o, c, r in zip(out, clip_s, ref_s):
            if "clip_s" in baselines:
                o["scores"]["clip_s"] = c
            if "refclip_s" in baselines:
                o["scores"]["refclip_s"] = r
    return out


def sample_record(pair: Pair, scored: dict[str, Any]) -> dict[str, Any]:
    return {"id": pair.id, "source": pair.source, "image": pair.image, "caption": pair.caption,
            "rating": pair.rating, "references": list(pair.references), **scored}


TABLE_FIXED = ["id", "image", "caption", "rating"]


def table_columns(names: Sequence[str]) -> list[str]:
    return [*TABLE_FIXED, *names, "bagel_reply"]


def table_rows(records: Sequence[dict], pairs: Sequence[Pair], names: Sequence[str], limit: int | None) -> list[list]:
    """Rows for :func:`unicon.evaluation.logs.log_table`: the image, caption, rating, every score."""
    rows = []
    by_id = {p.id: p for p in pairs}
    for rec in records[:limit]:
        pair = by_id.get(rec["id"])
        image = read_image(pair) if pair is not None else None
        rows.append([rec["id"], image, rec["caption"], rec["rating"], *(rec["scores"].get(n) for n in names),
                     rec.get("bagel_reply")])
    return rows


def evaluate_alignment(
    model,
    pairs: Sequence[Pair],
    out_dir: str | Path | None = None,
    bagel_modes: Sequence[str] = tuple(AlignmentEvalConfig().bagel_modes),
    baselines: Sequence[str] = tuple(AlignmentEvalConfig().baselines),
    clip=None,
    judge=None,
    batch_size: int = AlignmentEvalConfig.batch_size,
    skipped: dict[str, int] | None = None,
    info: dict | None = None,
    clip_source: str | None = None,
    judge_spec: str | None = None,
    bagel_scale: str = "cf",
    clip_prefix: str = "auto",
) -> tuple[dict[str, Any], list[dict]]:
    """Score ``pairs`` on every rank of the process group (or alone, a shard, a merge: ``model`` may
    then be a stand-in that is never called; ``clip_source``/``judge_spec`` name the CLIP and judge the
    shards used, so that a merge, which loads neither, reports their metrics). Returns ``(results, records)``: the summary that
    ``alignment.json`` holds and every pair's record, in pair order (complete where the files are written;
    other ranks and shards leave the reference metrics out)."""
    if not pairs:
        raise UserError("alignment: no pairs to evaluate")
    unknown = [m for m in bagel_modes if m not in ALIGNMENT_BAGEL_MODES]
    if unknown:
        raise UserError(f"unknown BagelScore mode(s) {unknown}; choose from {', '.join(ALIGNMENT_BAGEL_MODES)}")
    clip_source = clip_source if clip_source is not None else getattr(clip, "source", None)
    if bagel_scale not in SCALES:
        raise UserError(f"unknown BagelScore scale {bagel_scale!r}; choose from {', '.join(SCALES)}")
    scale = scale_of(bagel_scale)
    prefix_text = resolve_clip_prefix(clip_prefix, clip_source)
    names = metric_names(bagel_modes, baselines, judge is not None or bool(judge_spec))
    mine = shard_indices(len(pairs))
    scored: dict[int, dict] = {}
    with eval_mode(model) if mine else contextlib.nullcontext():  # a merge's model is a stand-in
        for idx in preemption.batches(mine, batch_size, "alignment: scoring pairs"):
            for i, o in zip(idx, score_batch(model, [pairs[i] for i in idx], bagel_modes, clip, judge, baselines,
                                             scale.name, prefix_text)):
                scored[i] = o
    records = {i: sample_record(pairs[i], scored[i]) for i in owned_indices(len(pairs))}
    gathered = list(gather_records(records).values())
    # the reference metrics are corpus-level (CIDEr's document frequencies): computed where the files are
    # written (one process, rank 0, the merge), over every pair; a shard or another rank skips them
    ref_scores, notes = reference_metrics([r["caption"] for r in gathered], [r["references"] for r in gathered],
                                          [m for m in REFERENCE_METRICS if m in baselines] if writes_outputs() else [])
    for name, values in ref_scores.items():
        for rec, v in zip(gathered, values):
            rec["scores"][name] = v
    skipped_metrics = {**not_run(baselines, clip_source), **{k: v for k, v in notes.items() if k not in NOTE_INFO}}
    names = [n for n in names if n not in skipped_metrics]
    for rec in gathered:  # every record lists every metric of the run, in order (null: not scored)
        rec["scores"] = {n: rec["scores"].get(n) for n in names}
    results = {"metrics": summarize(gathered, names), "n_pairs": len(gathered),
               "skipped": {k: int(v) for k, v in sorted((skipped or {}).items())},
               "not_run": skipped_metrics, "tokenizer": notes.get("tokenizer"),
               "bertscore_model": notes.get("bertscore_model"),
               "settings": {"bagel_modes": list(bagel_modes), "baselines": list(baselines), "clip": clip_source,
                            "judge": judge_spec or getattr(judge, "name", None), "batch_size": batch_size,
                            "bagel_scale": scale.describe(),
                            "clip_prefix": {"setting": clip_prefix, "text": prefix_text} if clip_source else None},
               **(info or {})}
    out = Path(out_dir) if out_dir is not None else None
    if out is not None and writes_outputs():
        out.mkdir(parents=True, exist_ok=True)
        write_results(out, "alignment.json", results, gathered, markdown_table(
            results["metrics"], results["n_pairs"], results["skipped"], results["not_run"], results["bertscore_model"]))
        plot_results(gathered, list(results["metrics"]), out)
    return results, gathered
