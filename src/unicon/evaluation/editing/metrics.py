"""EditingScore (BagelScore/EditingScore paper, section 3) and its Kendall correlations; pure, no I/O.

The paper's definition::

    cosine_sim(x_s, x^_t) = <f(x_s), f(x^_t)> / (||f(x_s)|| ||f(x^_t)||)
    rls(x_s, x_t)         = ||z_s - z_t||_2 / sqrt(d)
    sim_text(p, f^(x_t))  = <p, f^(x_t)> / (||p|| ||f^(x_t)||)
    EditingScore          = cosine_sim(x_s, x^_t) * sim_text(p, f^(x_t)) / (rls(x_s, x_t)^2 + eps),  eps = 1e-10

Choices where the paper is ambiguous (it never defines x^_t apart from x_t, nor f apart from z):

* ``x^_t`` and ``x_t`` are the same image, the edited image under evaluation (Edit-1K has no separate
  reference target; the paper calls both "the edited/target image");
* ``f`` and ``z`` are the same latent, :meth:`UnifiedModel.image_latents` (the model's generative image
  latent, flattened, ``d`` its length), so ``cos_image`` and ``rls`` read one vector per image;
* ``f^`` is :meth:`UnifiedModel.embed_image` and ``p`` is :meth:`UnifiedModel.embed_text` of the
  instruction: pooled embeddings in one space (the "text embedding p" of the paper is taken as an
  embedding of the instruction by the same model);
* everything is computed in float64 from the float32 latents, with plain dot products and norms
  (no clamping of small norms, so a zero latent gives NaN, which is skipped and counted).

**The direction: the paper's text against its formula and its results.** The text says the score
"is normalized to the range [0, 1], with lower values indicating high-quality edits". The formula is
not normalised (``cos * sim`` lies in [-1, 1] and is divided by ``rls^2 + 1e-10``, so an edit that
changes nothing scores up to 1e10) and it *grows* as the edit gets smaller (an unchanged image,
rls = 0, gets the largest score) and as the edited image stays closer to the source (``cos``). The
paper's own results side with the formula read as **higher is better**: Table 2's Pearson correlation
of EditScore with the human score is **+0.14** (with Image RLS -0.78, with Image Cosine +0.78, as the
formula implies), Table 3's Kendall tau against the human score is **tau_b +0.259, tau_c +0.253**
(the GPT-based score +0.192), and every Table 4 ablation is positive. A score where lower were better
would have correlated negatively. So we report the **raw** value (no normalisation, no sign flip),
and a positive tau agrees with the paper's results; a negative one disagrees with them (it sides only
with the sentence of its text). ``summarize`` records the measured direction (``score_direction``:
the sign of tau_b against each criterion), the paper's (:data:`PAPER_DIRECTION`) and, per criterion,
whether they agree (``agrees_with_paper``). The ablations of Table 4 drop one factor each:
``no_cos`` = sim / (rls^2 + eps), ``no_sim_text`` = cos / (rls^2 + eps), ``no_rls`` = cos * sim.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import numpy as np
import torch
from scipy.stats import kendalltau

from unicon.config import EDITING_EPS
from unicon.evaluation.editing.data import CRITERIA

EPS = EDITING_EPS
COMPONENTS = ("cos_image", "sim_text", "rls")
#: the full score and the ablations of Table 4 (one factor dropped each)
VARIANTS = ("score", "no_cos", "no_sim_text", "no_rls")
#: everything correlated with the ratings: the variants, then each component alone
CORRELATED = (*VARIANTS, *COMPONENTS)


def _cos(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1))


def editing_components(z_source: torch.Tensor, z_edited: torch.Tensor, image_edited: torch.Tensor,
                       text: torch.Tensor, eps: float = EPS) -> dict[str, torch.Tensor]:
    """Per row (float64 ``[B]``): ``cos_image``, ``sim_text``, ``rls``, ``score`` and the ablations.

    ``z_source`` / ``z_edited``: ``[B, d]`` image latents (f = z); ``image_edited`` / ``text``: ``[B, e]``
    f^(x_t) and p in one space."""
    if z_source.shape != z_edited.shape or z_source.dim() != 2:
        raise ValueError(f"latents must be [B, d] of one shape, got {tuple(z_source.shape)} and {tuple(z_edited.shape)}")
    if image_edited.shape != text.shape or image_edited.shape[0] != z_source.shape[0]:
        raise ValueError(f"image/text embeddings must be [B, e] of one shape, got {tuple(image_edited.shape)} "
                         f"and {tuple(text.shape)}")
    zs, zt = z_source.double(), z_edited.double()
    cos_image = _cos(zs, zt)
    sim_text = _cos(image_edited.double(), text.double())
    rls = (zs - zt).norm(dim=-1) / math.sqrt(zs.shape[-1])
    denom = rls ** 2 + eps
    return {"cos_image": cos_image, "sim_text": sim_text, "rls": rls, "score": cos_image * sim_text / denom,
            "no_cos": sim_text / denom, "no_sim_text": cos_image / denom, "no_rls": cos_image * sim_text}


def rating_pairs(records: Sequence[Mapping[str, Any]], key: str, criterion: str) -> tuple[list[float], list[float]]:
    """``(values, ratings)`` of the records with a usable rating of ``criterion`` and a finite ``key``."""
    xs, ys = [], []
    for r in records:
        y = (r.get("ratings") or {}).get(criterion)
        x = r.get(key)
        if y is None or x is None or not math.isfinite(x):
            continue
        xs.append(float(x))
        ys.append(float(y))
    return xs, ys


def kendall(xs: Sequence[float], ys: Sequence[float]) -> dict[str, Any]:
    """``tau_b``, ``tau_c`` (scipy), the tau_b p-value and ``n``; NaN when fewer than 2 pairs or a constant side."""
    n = len(xs)
    if n < 2 or len(set(xs)) < 2 or len(set(ys)) < 2:
        return {"tau_b": float("nan"), "tau_c": float("nan"), "p_value": float("nan"), "n": n}
    b = kendalltau(xs, ys, variant="b")
    c = kendalltau(xs, ys, variant="c")
    return {"tau_b": float(b.statistic), "tau_c": float(c.statistic), "p_value": float(b.pvalue), "n": n}


#: the direction of the raw score in the paper's results (Tables 2-4), and what shows it
PAPER_DIRECTION = {"direction": "higher score = better rating",
                   "evidence": "Table 2: Pearson(EditScore, human) = +0.14; Table 3: tau_b +0.259, tau_c +0.253; "
                               "Table 4: every ablation positive"}


def summarize(records: Sequence[Mapping[str, Any]], skipped: Mapping[str, Mapping[str, int]]) -> dict[str, Any]:
    """``editing.json``'s results from the per-sample records (each: the :data:`CORRELATED` values and
    ``ratings`` {criterion: usable float}); ``skipped``: per criterion, rows whose rating was missing /
    unusable. Criteria with no usable rating at all are left out."""
    present = [c for c in CRITERIA if any((r.get("ratings") or {}).get(c) is not None for r in records)]
    table = {key: {c: kendall(*rating_pairs(records, key, c)) for c in present} for key in CORRELATED}
    nonfinite = sum(1 for r in records if r.get("score") is None or not math.isfinite(r["score"]))
    direction, agrees = {}, {}
    for c in present:
        t = table["score"][c]["tau_b"]
        direction[c] = ("higher score = better rating" if t > 0 else "lower score = better rating" if t < 0
                        else "none") if not math.isnan(t) else "undefined"
        agrees[c] = bool(t > 0) if not math.isnan(t) and t != 0 else None
    flat = {"n": len(records)}
    for key in CORRELATED:
        for c in present:
            flat[f"tau_b/{key}/{c}"] = table[key][c]["tau_b"]
    summary: dict[str, Any] = {"n": len(records), "criteria": present, "kendall": table,
                               "score_direction": direction, "paper_direction": PAPER_DIRECTION,
                               "agrees_with_paper": agrees, "nonfinite_scores": nonfinite,
                               "skipped_ratings": {c: dict(skipped.get(c, {})) for c in CRITERIA},
                               "metrics": flat}
    groups = sorted({r["candidate"] for r in records if r.get("candidate") is not None})
    if groups:
        summary["by_candidate"] = {g: group_means([r for r in records if r.get("candidate") == g]) for g in groups}
    return summary


def group_means(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Count, mean of each component, mean and median of the raw score, mean overall rating."""
    out: dict[str, Any] = {"n": len(records)}
    for key in (*COMPONENTS, "score"):
        v = np.array([r[key] for r in records if r.get(key) is not None and math.isfinite(r[key])], dtype=np.float64)
        out[f"mean_{key}"] = float(v.mean()) if v.size else float("nan")
        if key == "score":
            out["median_score"] = float(np.median(v)) if v.size else float("nan")
    ratings = [r["ratings"]["overall"] for r in records if (r.get("ratings") or {}).get("overall") is not None]
    if ratings:
        out["mean_overall_rating"] = float(np.mean(ratings))
    return out
