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

**Table 2** (:func:`pearson_matrix`): Pearson's r between every pair of EditScore, Image RLS, Image
Cosine Sim., Text Similarity and the Human Score (the paper's five), plus the judge's score when a
judge ran (the paper's text lists GPT-based scoring among Table 2's metrics; its table prints none)::

    r(a, b) = sum_i (a_i - mean a)(b_i - mean b) / sqrt(sum_i (a_i - mean a)^2 * sum_i (b_i - mean b)^2)

(``scipy.stats.pearsonr``, with its two-sided p), over the samples where both ``a`` and ``b`` are
finite (pairwise complete; ``n`` per entry). The Human Score is Edit-1K's ``overall`` rating (its
"Overall Effect", the one holistic criterion; the paper does not say which it used). The score enters
**raw**, as the paper's formula gives it: its values span many orders of magnitude (an unchanged image
scores up to 1e10), so r is dominated by the largest scores; Kendall's tau, which reads ranks only, is
the statistic the paper's other tables use. r is undefined (null) with fewer than two samples or a
constant variable; the diagonal is 1 wherever r is defined.

**Table 3** (``table3`` in :func:`summarize`): Kendall tau_b / tau_c against the Human Score of the
Human Score itself (tau_b = 1; tau_c, computed, is below 1 when ratings tie, where the paper prints
1.000), of EditingScore and of the judge's score
(:mod:`~unicon.evaluation.editing.judges`, the stand-in for the paper's GPT-based scoring; its
failures, unparseable replies, are left out and counted), beside the paper's values.

Every Kendall row (:func:`kendall_row`: ``tau_b``, ``tau_c``, ``p_value`` of tau_b, ``n``) comes from
:func:`unicon.evaluation.correlation.kendall`, which states the equations: with fewer than two pairs or a
constant side the row's tau and p are None (``null`` in ``editing.json``, "n/a" in ``table.md``).
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from unicon.config import EDITING_EPS
from unicon.evaluation.correlation import kendall
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


def kendall_row(xs: Sequence[float], ys: Sequence[float]) -> dict[str, Any]:
    """``tau_b``, ``tau_c``, the tau_b p-value and ``n`` of :func:`unicon.evaluation.correlation.kendall`
    (None when fewer than 2 pairs or a constant side)."""
    k = kendall(xs, ys)
    return {"tau_b": k["tau_b"], "tau_c": k["tau_c"], "p_value": k["p_b"], "n": k["n"]}


#: Table 2's Human Score: Edit-1K's holistic criterion
HUMAN = "overall"
#: Table 2's variables, in its order (the judge's score follows when a judge ran)
PEARSON_VARIABLES = ("score", "rls", "cos_image", "sim_text", "human")
PEARSON_LABELS = {"score": "EditScore", "rls": "Image RLS", "cos_image": "Image Cosine Sim.",
                  "sim_text": "Text Similarity", "human": "Human Score", "judge": "Judge score"}
#: the paper's Table 2 (Pearson's r, upper triangle) and Table 3 (Kendall tau against the Human Score)
PAPER_TABLE2 = {("score", "rls"): -0.78, ("score", "cos_image"): 0.78, ("score", "sim_text"): 0.05,
                ("score", "human"): 0.14, ("rls", "cos_image"): -0.74, ("rls", "sim_text"): 0.00,
                ("rls", "human"): -0.12, ("cos_image", "sim_text"): 0.01, ("cos_image", "human"): 0.09,
                ("sim_text", "human"): 0.05}
PAPER_TABLE3 = {"human": {"tau_b": 1.0, "tau_c": 1.0}, "score": {"tau_b": 0.259, "tau_c": 0.253},
                "judge": {"tau_b": 0.192, "tau_c": 0.189, "judge": "GPT-based score"}}


def _value(record: Mapping[str, Any], key: str, human: str) -> float | None:
    if key == "human":
        v = (record.get("ratings") or {}).get(human)
    elif key == "judge":
        v = record.get("judge_score")
    else:
        v = record.get(key)
    return float(v) if v is not None and math.isfinite(float(v)) else None


def pearson_matrix(records: Sequence[Mapping[str, Any]], human: str = HUMAN,
                   variables: Sequence[str] = PEARSON_VARIABLES) -> dict[str, Any]:
    """Table 2 (module docstring): ``{"variables", "labels", "human", "r", "p", "n"}``, ``r``/``p``/``n``
    square lists in the order of ``variables`` (NaN where undefined; ``p`` NaN on the diagonal)."""
    from scipy.stats import pearsonr

    k = len(variables)
    r = [[float("nan")] * k for _ in range(k)]
    p = [[float("nan")] * k for _ in range(k)]
    n = [[0] * k for _ in range(k)]
    values = [[_value(rec, v, human) for rec in records] for v in variables]
    for a in range(k):
        for b in range(a, k):
            pts = [(x, y) for x, y in zip(values[a], values[b]) if x is not None and y is not None]
            n[a][b] = n[b][a] = len(pts)
            if len(pts) < 2:
                continue
            xs, ys = zip(*pts)
            if len(set(xs)) < 2 or len(set(ys)) < 2:
                continue
            if a == b:
                r[a][a] = 1.0
                continue
            res = pearsonr(xs, ys)
            r[a][b] = r[b][a] = float(res.statistic)
            p[a][b] = p[b][a] = float(res.pvalue)
    labels = {v: PEARSON_LABELS.get(v, v) + (f" ({human})" if v == "human" else "") for v in variables}
    return {"variables": list(variables), "labels": labels, "human": human, "pairs": "pairwise complete",
            "r": r, "p": p, "n": n,
            "paper": {f"{a}/{b}": v for (a, b), v in PAPER_TABLE2.items()}}


def judge_failures(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The judged samples, the unparseable replies among them and their share."""
    judged = [r for r in records if "judge_reply" in r]
    fails = sum(1 for r in judged if r.get("judge_score") is None)
    return {"judged": len(judged), "failures": fails, "failure_rate": fails / len(judged) if judged else float("nan")}


#: the direction of the raw score in the paper's results (Tables 2-4), and what shows it
PAPER_DIRECTION = {"direction": "higher score = better rating",
                   "evidence": "Table 2: Pearson(EditScore, human) = +0.14; Table 3: tau_b +0.259, tau_c +0.253; "
                               "Table 4: every ablation positive"}


def summarize(records: Sequence[Mapping[str, Any]], skipped: Mapping[str, Mapping[str, int]],
              judge: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``editing.json``'s results from the per-sample records (each: the :data:`CORRELATED` values,
    ``ratings`` {criterion: usable float} and, when a judge ran, ``judge_score``/``judge_reply``);
    ``skipped``: per criterion, rows whose rating was missing / unusable; ``judge``: the judge's
    ``{"spec", "sees", "prompt"}`` (None: no judge ran, :data:`~.judges.NO_JUDGE` says why). Criteria with
    no usable rating at all are left out. Adds Table 2 (``pearson``) and Table 3 (``table3``)."""
    from unicon.evaluation.editing.judges import NO_JUDGE

    present = [c for c in CRITERIA if any((r.get("ratings") or {}).get(c) is not None for r in records)]
    judged = judge is not None
    keys = (*CORRELATED, "judge") if judged else CORRELATED
    scored = [{**r, "judge": r.get("judge_score")} for r in records] if judged else records
    table = {key: {c: kendall_row(*rating_pairs(scored, key, c)) for c in present} for key in keys}
    nonfinite = sum(1 for r in records if r.get("score") is None or not math.isfinite(r["score"]))
    direction, agrees = {}, {}
    for c in present:
        t = table["score"][c]["tau_b"]
        direction[c] = ("higher score = better rating" if t > 0 else "lower score = better rating" if t < 0
                        else "none") if t is not None else "undefined"
        agrees[c] = bool(t > 0) if t is not None and t != 0 else None
    pearson = pearson_matrix(records, HUMAN, (*PEARSON_VARIABLES, "judge") if judged else PEARSON_VARIABLES)
    if judged:
        pearson["labels"]["judge"] = f"Judge score ({judge.get('spec')})"
    flat = {"n": len(records)}
    for key in keys:  # the loggers take floats: an undefined tau is logged as NaN, as an undefined r is
        for c in present:
            tau = table[key][c]["tau_b"]
            flat[f"tau_b/{key}/{c}"] = float("nan") if tau is None else tau
    h = pearson["variables"].index("human")
    for i, v in enumerate(pearson["variables"]):
        if v != "human":
            flat[f"pearson/{v}/human"] = pearson["r"][i][h]
    undefined = kendall_row([], [])
    table3 = {"human": HUMAN, "rows": {
        "human": kendall_row(*rating_pairs(
            [{**r, "human": (r.get("ratings") or {}).get(HUMAN)} for r in records], "human", HUMAN)),
        "score": table["score"].get(HUMAN, undefined),
        "judge": table["judge"].get(HUMAN, undefined) if judged else None},
        "judge": ({**judge, **judge_failures(records)} if judged else {"spec": None, "not_run": NO_JUDGE}),
        "paper": PAPER_TABLE3}
    summary: dict[str, Any] = {"n": len(records), "criteria": present, "kendall": table,
                               "score_direction": direction, "paper_direction": PAPER_DIRECTION,
                               "agrees_with_paper": agrees, "nonfinite_scores": nonfinite,
                               "skipped_ratings": {c: dict(skipped.get(c, {})) for c in CRITERIA},
                               "pearson": pearson, "table3": table3, "metrics": flat}
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
