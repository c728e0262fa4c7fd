"""Correlations with human ratings, and the reference-based caption metrics; pure, no model.

* :func:`kendall`: Kendall's τ_b and τ_c (``scipy.stats.kendalltau(variant=...)``) of a metric's scores
  against the ratings, over the pairs where the metric has a score (a ``decode`` failure, a pair
  without references for a reference metric: left out and counted in ``missing``);
* :func:`reference_metrics`: per-pair BLEU-4, METEOR and CIDEr-D (pycocoevalcap) of each caption
  against its references. They are computed over the **whole** set at once (CIDEr's document
  frequencies are corpus statistics), so a sharded run computes them in the merge, from the gathered
  records. METEOR runs pycocoevalcap's Java jar and is skipped, with the reason recorded, when
  ``java`` is not on the PATH; captions are tokenised with the PTB tokenizer when ``java`` is there,
  else lower-cased with punctuation dropped (``tokenizer`` in the summary says which);
* :func:`clip_scores`: CLIP-S = w·max(cos(image, caption), 0) and RefCLIP-S = the harmonic mean of
  CLIP-S and max(max_r cos(caption, reference r), 0), w = 2.5 (Hessel et al., 2021, eqs. 1-2). Hessel
  et al. embed every caption and reference with the prefix "A photo depicts " (:data:`HESSEL_PREFIX`;
  their section 3 and their released ``clipscore.py``); the runner prefixes the texts as its
  ``clip_prefix`` setting says (:func:`unicon.evaluation.alignment.runner.resolve_clip_prefix`);
* :func:`summarize`: the summary of ``alignment.json``.
"""

from __future__ import annotations

import math
import shutil
from typing import Any, Mapping, Sequence

import numpy as np
import torch

#: CLIPScore's rescaling weight w (Hessel et al., 2021)
CLIP_W = 2.5
#: the text Hessel et al. put before every caption and reference they embed with CLIP
HESSEL_PREFIX = "A photo depicts "
#: the reference-based caption metrics
REFERENCE_METRICS = ("bleu4", "meteor", "cider")


def kendall(scores: Sequence[float | None], ratings: Sequence[float]) -> dict[str, Any]:
    """τ_b, τ_c and their p-values over the pairs with a score; ``n`` used, ``missing`` left out.
    Fewer than two pairs, or a constant side: the τ values are None (scipy returns NaN)."""
    from scipy.stats import kendalltau

    keep = [(float(s), float(r)) for s, r in zip(scores, ratings) if s is not None and math.isfinite(float(s))]
    out: dict[str, Any] = {"n": len(keep), "missing": len(scores) - len(keep)}
    for variant in ("b", "c"):
        tau = p = None
        if len(keep) >= 2:
            x, y = zip(*keep)
            res = kendalltau(x, y, variant=variant)
            if math.isfinite(res.statistic):
                tau, p = float(res.statistic), float(res.pvalue)
        out[f"tau_{variant}"], out[f"p_{variant}"] = tau, p
    return out


def _simple_tokenize(text: str) -> str:
    import re

    return " ".join(re.sub(r"[^\w\s]", " ", text.lower()).split())


def reference_metrics(captions: Sequence[str], references: Sequence[Sequence[str]],
                      names: Sequence[str] = REFERENCE_METRICS) -> tuple[dict[str, list[float | None]], dict[str, str]]:
    """Per-pair scores ``{metric: [score or None per pair]}`` (None: the pair has no references) and
    ``{metric: why it was skipped}`` plus ``{"tokenizer": "ptb"|"simple"}``."""
    notes: dict[str, str] = {}
    scores: dict[str, list[float | None]] = {}
    names = [n for n in names if n in REFERENCE_METRICS]
    if not names:
        return scores, notes
    keys = [i for i, refs in enumerate(references) if refs]
    if not keys:
        for n in names:
            notes[n] = "no pair has references"
        return scores, notes
    java = shutil.which("java") is not None
    if java:
        from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer

        ptb = PTBTokenizer()
        gts = ptb.tokenize({i: [{"caption": r} for r in references[i]] for i in keys})
        res = ptb.tokenize({i: [{"caption": captions[i]}] for i in keys})
    else:
        gts = {i: [_simple_tokenize(r) for r in references[i]] for i in keys}
        res = {i: [_simple_tokenize(captions[i])] for i in keys}
    notes["tokenizer"] = "ptb" if java else "simple"
    # pycocoevalcap iterates over gts.keys(): keep the same order for every scorer
    gts = {i: gts[i] for i in keys}
    res = {i: res[i] if res[i] and res[i][0] else [""] for i in keys}
    for name in names:
        if name == "meteor" and not java:
            notes[name] = "java is not on the PATH (pycocoevalcap's METEOR runs a Java jar)"
            continue
        if name == "bleu4":
            from pycocoevalcap.bleu.bleu import Bleu

            _, per = Bleu(4).compute_score(gts, res, verbose=0)
            values = per[3]
        elif name == "meteor":
            from pycocoevalcap.meteor.meteor import Meteor

            meteor = Meteor()
            try:
                _, values = meteor.compute_score(gts, res)
            finally:
                close = getattr(meteor, "close", None)
                if close is not None:
                    close()
        else:
            from pycocoevalcap.cider.cider import Cider

            _, values = Cider().compute_score(gts, res)
        out: list[float | None] = [None] * len(captions)
        for i, v in zip(keys, np.asarray(values, dtype=float).tolist()):
            out[i] = float(v)
        scores[name] = out
    return scores, notes


def clip_scores(image_emb: torch.Tensor, caption_emb: torch.Tensor,
                reference_embs: Sequence[torch.Tensor | None], w: float = CLIP_W) -> tuple[list[float], list[float | None]]:
    """``(CLIP-S, RefCLIP-S)`` per pair from L2-normalised embeddings (``reference_embs[i]``: ``[R_i, D]``
    or None without references, whose RefCLIP-S is None)."""
    cos = (image_emb.double() * caption_emb.double()).sum(-1)
    clip_s = (w * cos.clamp(min=0)).tolist()
    ref_s: list[float | None] = []
    for c, cap, refs in zip(clip_s, caption_emb.double(), reference_embs):
        if refs is None or len(refs) == 0:
            ref_s.append(None)
            continue
        r = max(float((refs.double() @ cap).max()), 0.0)
        ref_s.append(0.0 if c + r == 0 else 2 * c * r / (c + r))
    return clip_s, ref_s


def summarize(records: Sequence[Mapping[str, Any]], metric_names: Sequence[str]) -> dict[str, Any]:
    """Per metric: Kendall τ_b/τ_c against ``rating`` (:func:`kendall`), plus for ``bagelscore_decode``
    its ``failures`` and ``failure_rate`` (unparseable replies among the pairs it scored)."""
    ratings = [r["rating"] for r in records]
    out: dict[str, Any] = {}
    for name in metric_names:
        scores = [r["scores"].get(name) for r in records]
        out[name] = kendall(scores, ratings)
        if name == "bagelscore_decode":
            fails = out[name]["missing"]
            out[name]["failures"] = fails
            out[name]["failure_rate"] = fails / len(records) if records else None
    return out


def flat_metrics(summary: Mapping[str, Any]) -> dict[str, float]:
    """``{"<metric>/tau_b": ..., "<metric>/tau_c": ..., "<metric>/n": ..., "bagelscore_decode/failure_rate"}``
    (None values left out) for the loggers."""
    flat = {}
    for name, s in summary.items():
        for key in ("tau_b", "tau_c", "n", "failure_rate"):
            if s.get(key) is not None:
                flat[f"{name}/{key}"] = float(s[key])
    return flat


def markdown_table(summary: Mapping[str, Any], n_pairs: int, skipped: Mapping[str, int]) -> str:
    lines = ["| metric | τ_b | τ_c | n | not scored |", "| --- | --- | --- | --- | --- |"]

    def f(v):
        return "–" if v is None else f"{100 * v:.1f}"

    for name, s in summary.items():
        extra = f"{s['missing']}" + (f" ({100 * s['failure_rate']:.1f}% unparseable)" if s.get("failure_rate") else "")
        lines.append(f"| {name} | {f(s['tau_b'])} | {f(s['tau_c'])} | {s['n']} | {extra} |")
    lines.append("")
    lines.append(f"τ × 100 against the human ratings; {n_pairs} pairs"
                 + (f", skipped: {', '.join(f'{k} {v}' for k, v in sorted(skipped.items()) if v)}" if any(skipped.values()) else "")
                 + ".")
    return "\n".join(lines) + "\n"
