"""Study results: shares, mean ranks, agreement, correlations with the drift metrics; ``study.json``,
``report.html`` and an optional W&B table.

Every annotation is an independent data point (the paper does not average annotators first).

* **Shares**: per section and model, the fraction of Good / Medium / Poor ratings.
* **Mean rank**: per section and model, the mean of its rank (1 = best) over all annotations.
* **Consistency** (paper Fig. 9): per model, how often the same annotator gave the same rating to its
  caption and its image of the same sample, and the counts of each (understanding, generation) pair.
  ``report.html`` draws them as the paper's Fig. 14 (:func:`fidelity_matrix`): per model a 3 x 3 heatmap
  of generation fidelity (rows: Good, Medium, Poor from the top) against understanding fidelity
  (columns: Good, Medium, Poor from the left), each cell the percentage of that model's (annotator,
  sample) pairs, darker for more; the diagonal is consistent, the top-right corner (generation Good,
  understanding Poor) and the bottom-left corner (understanding Good, generation Poor) are the two
  kinds of inconsistency.
* **Agreement**: Krippendorff's alpha (the ``krippendorff`` package, ordinal; poor=0 < medium=1 <
  good=2) over units (sample, model) with one value per annotator, per section and over both;
  on rankings, Kendall's W per (sample, section) averaged over the units, and the mean pairwise
  Kendall tau_b (:func:`unicon.evaluation.correlation.kendall`; ranks have no ties, so tau_b = tau_a)
  over every pair of annotators of a unit. A value is ``null`` with a
  ``<key>_reason`` when it is undefined (one distinct value, fewer than two annotators per unit).
* **Correlations with the drift metrics**, per section and metric, in two forms (directions: a
  *lower* human rank is better; a *higher* ``MCD_avg`` (more similarity to the input, less drift),
  ``MGG`` and ``GenEval`` (more images pass) are better):

  - ``spearman`` (**across models**, the paper's comparison: Appendix E, Figs. 12-13 set each model's
    human mean rank against its metric, over 7 models, and report the plots, no coefficient):
    Spearman's rho (scipy) of the models' human mean rank and the metric, with ``n`` the models that
    have the metric. Agreement shows as a **negative** rho, so ``agreement = -rho`` is stored beside it
    (positive = agrees). Below :data:`MIN_MODELS` = 3 models no rho is reported (``rho`` null,
    ``reason`` says why: two points are always in perfect order, rho = +-1 whatever the data). The
    p-value is an **exact permutation** p (two-sided: the share of the n! orderings of the metric
    whose |rho| reaches the observed one; ``p_method``), never scipy's asymptotic t-approximation,
    which gives p = 0.0 for any perfect order; ``p_min`` is the smallest p that n models can reach
    (2/n!: 0.33 for 3 models, 0.083 for 4, 0.017 for 5), so a reader sees when no ordering of the
    models could be significant. Above :data:`EXACT_MAX` models the p is a Monte-Carlo permutation p.
  - ``per_item`` (**across items**, our addition, defined for any number of models and the statistic
    to read when there are few): every annotation of a page is one data point, as the paper treats
    them ("each annotation as an independent data point"). For each annotation and each pair of
    models whose metric values differ, the pair is *concordant* when the annotator ranked the model
    with the better metric higher, *discordant* otherwise; ``agreement = (C - D) / (C + D)`` (a
    Kendall-type concordance in [-1, 1], positive = the humans side with the metric; with two models
    it is ``2 * share - 1``, ``share = C / (C + D)`` the share of annotations that prefer the
    metric's better model). ``ci95`` is a percentile bootstrap interval over **samples** (all
    annotations of a resampled page travel together, since the annotators of one page are not
    independent), :data:`BOOTSTRAP_RESAMPLES` resamples, seed :data:`BOOTSTRAP_SEED`. It says how
    consistently the annotators, item by item, order the models as the metric does; with two models
    it still compares one metric ordering (a single bit), which is why the across-model rho is withheld.

  The paper reports MCD_avg against both sections (Fig. 12) and GenEval / MGG against human judgement
  (Fig. 13, generation); all pairs are computed here. The drift outputs hold the metrics per model
  only (``drift.json``), not per seed, so the per-item form uses each model's metric value; a per-seed
  metric would allow a correlation of ratings and metric values item by item.
"""

from __future__ import annotations

import base64
import html
import io
import itertools
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import sqlalchemy as sa

from unicon import jsonsafe
from unicon.study import db

METRICS = ("MCD_avg", "MGG", "GenEval")


def _alpha(matrix: np.ndarray) -> tuple[float | None, str | None]:
    import krippendorff

    values = matrix[~np.isnan(matrix)]
    pairable = (np.sum(~np.isnan(matrix), axis=0) >= 2).sum() if matrix.size else 0
    if pairable == 0:
        return None, "no unit was rated by two annotators"
    if len(np.unique(values)) < 2:
        return None, "every rating has the same value (alpha is undefined without variation)"
    return float(krippendorff.alpha(reliability_data=matrix, level_of_measurement="ordinal")), None


def reliability_matrix(rows: list[dict], annotators: list[str], sections: tuple[str, ...]) -> np.ndarray:
    """Annotators x units ((section, sample, model)) of ordinal rating values, NaN where not rated."""
    units = sorted({(r["section"], r["sample"], r["model"]) for r in rows if r["section"] in sections})
    col = {u: i for i, u in enumerate(units)}
    m = np.full((len(annotators), len(units)), np.nan)
    ai = {a: i for i, a in enumerate(annotators)}
    for r in rows:
        if r["section"] in sections:
            m[ai[r["annotator"]], col[(r["section"], r["sample"], r["model"])]] = db.LEVEL_VALUE[r["rating"]]
    return m


def kendalls_w(ranks: np.ndarray) -> float:
    """Kendall's W of ``ranks`` (raters x objects, each row a permutation of 1..n; no ties)."""
    m, n = ranks.shape
    totals = ranks.sum(axis=0)
    s = float(((totals - totals.mean()) ** 2).sum())
    return 12.0 * s / (m ** 2 * (n ** 3 - n))


def ranking_agreement(rows: list[dict], section: str, models: list[str]) -> dict[str, Any]:
    from unicon.evaluation.correlation import kendall

    by_unit: dict[int, dict[str, dict[str, int]]] = {}
    for r in rows:
        if r["section"] == section:
            by_unit.setdefault(r["sample"], {}).setdefault(r["annotator"], {})[r["model"]] = r["rank"]
    ws, taus = [], []
    for per in by_unit.values():
        if len(per) < 2:
            continue
        mat = np.array([[per[a][m] for m in models] for a in sorted(per)], dtype=float)
        ws.append(kendalls_w(mat))
        for x, y in itertools.combinations(range(len(mat)), 2):
            tau = kendall(mat[x], mat[y])["tau_b"]  # None with fewer than two models
            if tau is not None:
                taus.append(tau)
    out: dict[str, Any] = {"units": len(ws)}
    out["kendall_w"] = float(np.mean(ws)) if ws else None
    out["kendall_tau_pairwise"] = float(np.mean(taus)) if taus else None
    if not ws:
        out["kendall_w_reason"] = out["kendall_tau_pairwise_reason"] = "no sample was ranked by two annotators"
    return out


#: fewer models than this: no across-model rho (two points always lie in perfect order)
MIN_MODELS = 3
#: up to this many models the permutation p enumerates every ordering (9! = 362,880)
EXACT_MAX = 9
#: Monte-Carlo permutations above :data:`EXACT_MAX` models
MONTE_CARLO_PERMUTATIONS = 100_000
#: bootstrap of the per-item concordance: resamples, seed, interval level
BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 0
BOOTSTRAP_LEVEL = 0.95


def permutation_p(x: list[float], y: list[float], seed: int = 0) -> tuple[float, str]:
    """Two-sided permutation p of Spearman's rho of ``x`` and ``y`` and how it was computed: the share
    of orderings of ``y``'s ranks (ties as average ranks, as scipy ranks them) whose |rho| is at least
    the observed |rho|; every ordering up to :data:`EXACT_MAX` values, else
    :data:`MONTE_CARLO_PERMUTATIONS` random ones (``(k + 1) / (B + 1)``)."""
    import math

    from scipy.stats import rankdata

    rx, ry = rankdata(x), rankdata(y)
    rx, ry = rx - rx.mean(), ry - ry.mean()
    scale = float(np.sqrt((rx ** 2).sum() * (ry ** 2).sum()))
    observed = abs(float(rx @ ry)) / scale
    n = len(rx)
    if n <= EXACT_MAX:
        perms = np.array(list(itertools.permutations(range(n))), dtype=np.int64)
        stats = np.abs(ry[perms] @ rx) / scale
        return float(np.mean(stats >= observed - 1e-12)), f"exact permutation ({math.factorial(n)} orderings)"
    rng = np.random.default_rng(seed)
    perms = np.argsort(rng.random((MONTE_CARLO_PERMUTATIONS, n)), axis=1)
    hits = int(np.sum(np.abs(ry[perms] @ rx) / scale >= observed - 1e-12))
    return (hits + 1) / (MONTE_CARLO_PERMUTATIONS + 1), f"Monte-Carlo permutation ({MONTE_CARLO_PERMUTATIONS} orderings)"


def spearman(human: list[float], metric: list[float | None]) -> dict[str, Any]:
    """Across models: ``{"n", "rho", "agreement", "p", "p_method", "p_min"}``, or ``rho`` None with a
    ``reason`` (fewer than :data:`MIN_MODELS` models with the metric, or a constant side)."""
    import math

    from scipy.stats import spearmanr

    pairs = [(h, m) for h, m in zip(human, metric) if m is not None and h is not None]
    n = len(pairs)
    out: dict[str, Any] = {"n": n, "rho": None, "agreement": None, "p": None}
    if n < MIN_MODELS:
        out["reason"] = (f"{n} model(s) with this metric and a human rank: Spearman's rho needs at least "
                         f"{MIN_MODELS} (two points are always in perfect order, rho = +1 or -1 whatever the "
                         "data); read per_item, the agreement across annotations")
        return out
    h, m = zip(*pairs)
    if len(set(h)) < 2 or len(set(m)) < 2:
        out["reason"] = "constant input (no ranking to correlate)"
        return out
    rho = float(spearmanr(h, m).statistic)
    p, method = permutation_p(list(h), list(m))
    out.update(rho=rho, agreement=-rho, p=p, p_method=method,
               p_min=2 / math.factorial(n) if n <= EXACT_MAX else None)
    return out


def item_concordance(rows: list[dict], section: str, metric: dict[str, float | None],
                     resamples: int = BOOTSTRAP_RESAMPLES, seed: int = BOOTSTRAP_SEED,
                     level: float = BOOTSTRAP_LEVEL) -> dict[str, Any]:
    """Across items (module docstring): the concordance of every annotation's ranking with the
    metric's order of the models, and its bootstrap interval over samples."""
    values = {m: float(v) for m, v in metric.items() if v is not None}
    per_annotation: dict[tuple[int, str], dict[str, int]] = {}
    for r in rows:
        if r["section"] == section and r["model"] in values:
            per_annotation.setdefault((r["sample"], r["annotator"]), {})[r["model"]] = r["rank"]
    by_sample: dict[int, list[int]] = {}
    for (sample, _), ranks in per_annotation.items():
        c = d = 0
        for a, b in itertools.combinations(sorted(ranks), 2):
            if values[a] == values[b]:
                continue
            better, worse = (a, b) if values[a] > values[b] else (b, a)
            if ranks[better] < ranks[worse]:
                c += 1
            else:
                d += 1
        tally = by_sample.setdefault(sample, [0, 0])
        tally[0] += c
        tally[1] += d
    counts = np.array([by_sample[s] for s in sorted(by_sample)], dtype=float).reshape(-1, 2)
    out: dict[str, Any] = {"statistic": "(C - D) / (C + D) over (annotation, model pair)",
                           "n_models": len(values), "n_annotations": len(per_annotation),
                           "n_samples": len(by_sample), "concordant": int(counts[:, 0].sum()),
                           "discordant": int(counts[:, 1].sum()), "agreement": None, "share": None,
                           "ci95": None, "bootstrap": {"resamples": resamples, "unit": "sample", "seed": seed,
                                                       "level": level}}
    total = counts.sum()
    if total == 0:
        out["reason"] = ("no annotation ranks two models with different values of this metric"
                         if len(values) >= 2 else "fewer than two models have this metric")
        return out
    c, d = counts[:, 0].sum(), counts[:, 1].sum()
    out["agreement"], out["share"] = float((c - d) / total), float(c / total)
    if len(counts) < 2:
        out["ci95_reason"] = "one sample: nothing to resample"
        return out
    rng = np.random.default_rng(seed)
    draws = counts[rng.integers(0, len(counts), size=(resamples, len(counts)))].sum(axis=1)
    keep = draws.sum(axis=1) > 0
    stats = (draws[keep, 0] - draws[keep, 1]) / draws[keep].sum(axis=1)
    alpha = (1 - level) / 2
    out["ci95"] = [float(np.quantile(stats, alpha)), float(np.quantile(stats, 1 - alpha))]
    return out


def compute(engine: sa.Engine) -> dict[str, Any]:
    """The whole ``study.json`` content."""
    with engine.connect() as conn:
        meta = db.read_meta(conn)
        models = {r.name: json.loads(r.metrics) for r in conn.execute(
            sa.select(db.models_t.c.name, db.models_t.c.metrics).order_by(db.models_t.c.id))}
        annotators = [r.name for r in conn.execute(sa.select(db.annotators_t.c.name).order_by(db.annotators_t.c.id))]
        assigned = conn.execute(sa.select(sa.func.count()).select_from(db.assignments_t)).scalar_one()
        plan = conn.execute(sa.select(db.annotators_t.c.name, db.assignments_t.c.sample_id)
                            .select_from(db.assignments_t.join(db.annotators_t))).all()
        rows = db.all_judgements(conn)
    names = list(models)
    result: dict[str, Any] = {
        "models": names, "annotators": annotators, "overlap": meta.get("overlap"), "samples": meta.get("samples"),
        "judgements": len(rows) // (2 * len(names)) if names else 0, "assignments": assigned,
        "metrics": models, "directions": {"human_mean_rank": "lower is better", "MCD_avg": "higher is better",
                                          "MGG": "higher is better", "GenEval": "higher is better"},
        "correlation_settings": {"spearman": {"across": "models", "min_models": MIN_MODELS,
                                              "p": f"exact permutation up to {EXACT_MAX} models, Monte Carlo above"},
                                 "per_item": {"across": "annotations", "bootstrap_unit": "sample",
                                              "resamples": BOOTSTRAP_RESAMPLES, "seed": BOOTSTRAP_SEED,
                                              "level": BOOTSTRAP_LEVEL}},
        "sections": {},
        "workload": workload(plan, annotators),
    }
    for section in db.SECTIONS:
        per_model = {}
        for m in names:
            mine = [r for r in rows if r["section"] == section and r["model"] == m]
            n = len(mine)
            shares = {lv: (sum(r["rating"] == lv for r in mine) / n if n else None) for lv in db.LEVELS}
            per_model[m] = {"n": n, "shares": shares,
                            "mean_rank": float(np.mean([r["rank"] for r in mine])) if n else None}
        alpha, reason = _alpha(reliability_matrix(rows, annotators, (section,)))
        agreement = {"krippendorff_alpha": alpha, **ranking_agreement(rows, section, names)}
        if reason:
            agreement["krippendorff_alpha_reason"] = reason
        human = [per_model[m]["mean_rank"] for m in names]
        corr = {k: spearman(human, [models[m].get(k) for m in names]) for k in METRICS}
        per_item = {k: item_concordance(rows, section, {m: models[m].get(k) for m in names}) for k in METRICS}
        result["sections"][section] = {"models": per_model, "agreement": agreement, "spearman": corr,
                                       "per_item": per_item}
    alpha, reason = _alpha(reliability_matrix(rows, annotators, db.SECTIONS))
    result["agreement"] = {"krippendorff_alpha": alpha}
    if reason:
        result["agreement"]["krippendorff_alpha_reason"] = reason
    result["consistency"] = consistency(rows, names)
    return jsonsafe.finite(result)


def workload(plan: list, annotators: list[str]) -> dict[str, Any]:
    """Per annotator the pages and items (two per page) assigned, and how many pairs of annotators
    share at least one sample (the pairings agreement rests on) out of all pairs."""
    pages = {a: 0 for a in annotators}
    groups: dict[int, list[str]] = {}
    for name, sample in plan:
        pages[name] += 1
        groups.setdefault(sample, []).append(name)
    shared = {tuple(sorted(p)) for g in groups.values() for p in itertools.combinations(g, 2)}
    return {"per_annotator": {a: {"pages": n, "items": len(db.SECTIONS) * n} for a, n in pages.items()},
            "pairs_sharing_a_sample": len(shared), "pairs": len(annotators) * (len(annotators) - 1) // 2}


def consistency(rows: list[dict], models: list[str]) -> dict[str, Any]:
    """Per model: share of (annotator, sample) whose caption and image got the same rating, and the
    counts of each ``"<understanding>/<generation>"`` rating pair (paper Fig. 9)."""
    both: dict[tuple, dict[str, str]] = {}
    for r in rows:
        both.setdefault((r["model"], r["annotator"], r["sample"]), {})[r["section"]] = r["rating"]
    out = {}
    for m in models:
        pairs = [v for (mm, _, _), v in both.items() if mm == m and len(v) == 2]
        counts: dict[str, int] = {}
        for v in pairs:
            key = f"{v['understanding']}/{v['generation']}"
            counts[key] = counts.get(key, 0) + 1
        out[m] = {"n": len(pairs), "consistent": (sum(v["understanding"] == v["generation"] for v in pairs) / len(pairs)
                                                  if pairs else None), "pairs": dict(sorted(counts.items()))}
    return out


# ---------------------------------------------------------------------------------------------------------
# report.html
# ---------------------------------------------------------------------------------------------------------
def _png_uri(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def fidelity_matrix(entry: dict[str, Any]) -> np.ndarray:
    """Fig. 14's cells for one model's ``consistency`` entry: ``M[g, u] = 100 * count("<u>/<g>") / n``,
    rows ``g`` and columns ``u`` in :data:`db.LEVELS` order (good, medium, poor); all zero when ``n`` is 0."""
    m = np.zeros((len(db.LEVELS), len(db.LEVELS)))
    n = entry.get("n") or 0
    if not n:
        return m
    for key, count in (entry.get("pairs") or {}).items():
        u, g = key.split("/")
        m[db.LEVELS.index(g), db.LEVELS.index(u)] = 100.0 * count / n
    return m


def heatmap_figure(result: dict[str, Any]):
    """Fig. 14: one heatmap per model with rated pairs (:func:`fidelity_matrix`), the percentage in every
    cell, one shared colour scale from 0 to 100 % (Blues: darker = more); None when no model has a
    sample whose caption and image one annotator both rated."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    names = [m for m in result["models"] if (result.get("consistency", {}).get(m) or {}).get("n")]
    if not names:
        return None
    cols = min(3, len(names))
    rows = -(-len(names) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.8 * cols + 0.8, 3.6 * rows), squeeze=False,
                             layout="constrained")
    labels = [lv.capitalize() for lv in db.LEVELS]
    image = None
    for k, m in enumerate(names):
        ax = axes[k // cols][k % cols]
        mat = fidelity_matrix(result["consistency"][m])
        image = ax.imshow(mat, cmap="Blues", vmin=0.0, vmax=100.0)
        for g in range(len(db.LEVELS)):
            for u in range(len(db.LEVELS)):
                ax.text(u, g, f"{mat[g, u]:.1f}", ha="center", va="center", fontsize=9,
                        color="white" if mat[g, u] > 60 else "black")
        ax.set_xticks(range(len(labels)), labels)
        ax.set_yticks(range(len(labels)), labels)
        ax.set_xlabel("understanding fidelity")
        ax.set_ylabel("generation fidelity")
        ax.set_title(f"{m}\nGeneration vs Understanding fidelity (%)\nn = {result['consistency'][m]['n']}",
                     fontsize=9)
    for k in range(len(names), rows * cols):
        axes[k // cols][k % cols].axis("off")
    fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.8, label="% of rated pairs")
    return fig


def figures(result: dict[str, Any]) -> dict[str, str]:
    """Data URIs: ``shares`` (stacked G/M/P bars per section), ``scatter`` (human rank vs metrics) and,
    once a caption and an image of one sample were both rated, ``heatmap`` (Fig. 14, :func:`heatmap_figure`)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    names = result["models"]
    colors = {"good": "#2a9d4b", "medium": "#e9b949", "poor": "#c8453a"}
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), sharey=True)
    for ax, section in zip(axes, db.SECTIONS):
        bottom = np.zeros(len(names))
        for lv in db.LEVELS:
            vals = np.array([result["sections"][section]["models"][m]["shares"][lv] or 0.0 for m in names]) * 100
            ax.bar(names, vals, bottom=bottom, color=colors[lv], label=lv.capitalize())
            bottom += vals
        ax.set_title(section.capitalize())
        ax.set_ylabel("% of ratings")
        ax.tick_params(axis="x", rotation=30)
    axes[0].legend(loc="lower left")
    shares = _png_uri(fig)
    plt.close(fig)
    fig, axes = plt.subplots(2, len(METRICS), figsize=(4 * len(METRICS), 7), squeeze=False)
    for i, section in enumerate(db.SECTIONS):
        human = [result["sections"][section]["models"][m]["mean_rank"] for m in names]
        for j, key in enumerate(METRICS):
            ax = axes[i][j]
            pts = [(h, result["metrics"][m].get(key), m) for h, m in zip(human, names)
                   if h is not None and result["metrics"][m].get(key) is not None]
            for h, v, m in pts:
                ax.scatter([v], [h])
                ax.annotate(m, (v, h), fontsize=8)
            rho = result["sections"][section]["spearman"][key]["rho"]
            ax.set_title(f"{section}: rank vs {key}" + (f" (rho={rho:.2f})" if rho is not None else ""), fontsize=9)
            ax.set_xlabel(f"{key} (higher is better)")
            ax.set_ylabel("human mean rank (lower is better)")
            if not pts:
                ax.text(0.5, 0.5, "no data", ha="center", transform=ax.transAxes)
    fig.tight_layout()
    scatter = _png_uri(fig)
    plt.close(fig)
    out = {"shares": shares, "scatter": scatter}
    fig = heatmap_figure(result)
    if fig is not None:
        out["heatmap"] = _png_uri(fig)
        plt.close(fig)
    return out


def _fmt(v: Any) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return f"{v:.3f}"
    return html.escape(str(v))


def report_html(result: dict[str, Any]) -> str:
    figs = figures(result)
    parts = ["<!doctype html><html lang='en'><head><meta charset='utf-8'><title>Cross-consistency study</title>",
             "<style>body{font-family:sans-serif;max-width:70rem;margin:auto}table{border-collapse:collapse}"
             "td,th{border:1px solid #bbb;padding:.2rem .5rem;text-align:right}</style></head><body>",
             f"<h1>Cross-consistency study</h1><p>{len(result['models'])} models, {len(result['annotators'])} "
             f"annotators, {result['judgements']} of {result['assignments']} assignments judged, overlap "
             f"{_fmt(result['overlap'])}.</p>",
             f"<h2>Fidelity ratings</h2><img alt='shares' src='{figs['shares']}'>"]
    for section in db.SECTIONS:
        sec = result["sections"][section]
        parts.append(f"<h3>{section.capitalize()}</h3><table><tr><th>model</th><th>n</th><th>Good</th><th>Medium</th>"
                     "<th>Poor</th><th>mean rank</th>" + "".join(f"<th>{k}</th>" for k in METRICS) + "</tr>")
        for m in result["models"]:
            r = sec["models"][m]
            parts.append(f"<tr><td>{html.escape(m)}</td><td>{r['n']}</td>" + "".join(
                f"<td>{_fmt(r['shares'][lv])}</td>" for lv in db.LEVELS) + f"<td>{_fmt(r['mean_rank'])}</td>" + "".join(
                f"<td>{_fmt(result['metrics'][m].get(k))}</td>" for k in METRICS) + "</tr>")
        a = sec["agreement"]
        parts.append(f"</table><p>Krippendorff's alpha (ordinal): {_fmt(a['krippendorff_alpha'])}; Kendall's W: "
                     f"{_fmt(a['kendall_w'])}; mean pairwise Kendall tau: {_fmt(a['kendall_tau_pairwise'])}.</p>")
        parts.append("<p>Across models, Spearman rho of human mean rank vs " + "; ".join(
            f"{k}: {_fmt(sec['spearman'][k]['rho'])} (n = {sec['spearman'][k]['n']}"
            + (f", exact p = {_fmt(sec['spearman'][k]['p'])}" if sec['spearman'][k]['p'] is not None else "") + ")"
            for k in METRICS)
            + f" (negative = the metric agrees with the humans; no rho below {MIN_MODELS} models).</p>")
        parts.append("<p>Across items, agreement (C - D) / (C + D) of each annotation's ranking with the metric's "
                     "order [95% bootstrap interval over samples] (positive = the humans side with the metric): "
                     + "; ".join(f"{k}: {_fmt(sec['per_item'][k]['agreement'])}" + (
                         f" [{_fmt(sec['per_item'][k]['ci95'][0])}, {_fmt(sec['per_item'][k]['ci95'][1])}]"
                         if sec['per_item'][k]['ci95'] else "") + f" (n = {sec['per_item'][k]['n_annotations']} "
                         "annotations)" for k in METRICS) + ".</p>")
    parts.append("<h2>Generation vs understanding fidelity</h2>")
    if "heatmap" in figs:
        parts.append("<p>Per model, the percentage of (annotator, sample) pairs with each rating of the caption "
                     "(understanding, columns) and of the image (generation, rows), as the paper's Fig. 14; the "
                     "diagonal is consistent, the top-right and bottom-left corners are the two kinds of "
                     f"inconsistency.</p><img alt='fidelity heatmap' src='{figs['heatmap']}'>")
    else:
        parts.append("<p>No sample has both its caption and its image rated by one annotator yet.</p>")
    parts.append(f"<h2>Human rank vs metrics</h2><img alt='scatter' src='{figs['scatter']}'></body></html>")
    return "".join(parts)


def log_wandb(result: dict[str, Any]) -> bool:
    """A ``study/models`` table and the agreement scalars on the active W&B run, if there is one
    (this never starts a run or imports wandb by itself)."""
    wandb = sys.modules.get("wandb")
    if wandb is None or getattr(wandb, "run", None) is None:
        return False
    cols = ["model", "section", "n", "good", "medium", "poor", "mean_rank", *METRICS]
    data = []
    for section in db.SECTIONS:
        for m in result["models"]:
            r = result["sections"][section]["models"][m]
            data.append([m, section, r["n"], *(r["shares"][lv] for lv in db.LEVELS), r["mean_rank"],
                         *(result["metrics"][m].get(k) for k in METRICS)])
    scalars = {f"study/{s}/krippendorff_alpha": result["sections"][s]["agreement"]["krippendorff_alpha"]
               for s in db.SECTIONS}
    wandb.log({"study/models": wandb.Table(columns=cols, data=data),
               **{k: v for k, v in scalars.items() if v is not None}})
    return True


def export(engine: sa.Engine, out: str | Path) -> dict[str, Any]:
    """Write ``OUT/study.json`` and ``OUT/report.html`` (and the W&B table when a run is active)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    result = compute(engine)
    (out / "study.json").write_text(jsonsafe.dumps(result, indent=1))
    (out / "report.html").write_text(report_html(result))
    log_wandb(result)
    return result
