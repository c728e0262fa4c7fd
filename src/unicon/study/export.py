"""Study results: shares, mean ranks, agreement, correlations with the drift metrics; ``study.json``,
``report.html`` and an optional W&B table.

Every annotation is an independent data point (the paper does not average annotators first).

* **Shares**: per section and model, the fraction of Good / Medium / Poor ratings.
* **Mean rank**: per section and model, the mean of its rank (1 = best) over all annotations.
* **Consistency** (paper Fig. 9): per model, how often the same annotator gave the same rating to its
  caption and its image of the same sample, and the counts of each (understanding, generation) pair.
* **Agreement**: Krippendorff's alpha (the ``krippendorff`` package, ordinal; poor=0 < medium=1 <
  good=2) over units (sample, model) with one value per annotator, per section and over both;
  on rankings, Kendall's W per (sample, section) averaged over the units, and the mean pairwise
  Kendall tau (scipy) over every pair of annotators of a unit. A value is ``null`` with a
  ``<key>_reason`` when it is undefined (one distinct value, fewer than two annotators per unit).
* **Correlations** (paper Appendix E, Figs. 12-13): Spearman's rho (scipy) between the models'
  human mean rank and each metric, per section. Directions: a *lower* human mean rank is better;
  a *higher* ``MCD_avg`` is better (more similarity to the input, less drift); a *higher* ``MGG``
  and a *higher* ``GenEval`` are better (more images pass). So agreement between humans and a metric
  shows as a **negative** rho; ``agreement = -rho`` is reported next to it (positive = agrees). The
  paper reports MCD_avg against both sections (Fig. 12) and GenEval / MGG against human judgement
  (Fig. 13, generation); all pairs are computed here.
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
    from scipy.stats import kendalltau

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
            taus.append(float(kendalltau(mat[x], mat[y]).statistic))
    out: dict[str, Any] = {"units": len(ws)}
    out["kendall_w"] = float(np.mean(ws)) if ws else None
    out["kendall_tau_pairwise"] = float(np.nanmean(taus)) if taus else None
    if not ws:
        out["kendall_w_reason"] = out["kendall_tau_pairwise_reason"] = "no sample was ranked by two annotators"
    return out


def spearman(human: list[float], metric: list[float | None]) -> dict[str, Any]:
    from scipy.stats import spearmanr

    pairs = [(h, m) for h, m in zip(human, metric) if m is not None and h is not None]
    if len(pairs) < 2:
        return {"rho": None, "p": None, "n": len(pairs), "reason": "fewer than two models have this metric"}
    h, m = zip(*pairs)
    if len(set(h)) < 2 or len(set(m)) < 2:
        return {"rho": None, "p": None, "n": len(pairs), "reason": "constant input (no ranking to correlate)"}
    res = spearmanr(h, m)
    rho, p = float(res.statistic), float(res.pvalue)
    return {"rho": rho, "agreement": -rho, "p": p if np.isfinite(p) else None, "n": len(pairs)}


def compute(engine: sa.Engine) -> dict[str, Any]:
    """The whole ``study.json`` content."""
    with engine.connect() as conn:
        meta = db.read_meta(conn)
        models = {r.name: json.loads(r.metrics) for r in conn.execute(
            sa.select(db.models_t.c.name, db.models_t.c.metrics).order_by(db.models_t.c.id))}
        annotators = [r.name for r in conn.execute(sa.select(db.annotators_t.c.name).order_by(db.annotators_t.c.id))]
        assigned = conn.execute(sa.select(sa.func.count()).select_from(db.assignments_t)).scalar_one()
        rows = db.all_judgements(conn)
    names = list(models)
    result: dict[str, Any] = {
        "models": names, "annotators": annotators, "overlap": meta.get("overlap"), "samples": meta.get("samples"),
        "judgements": len(rows) // (2 * len(names)) if names else 0, "assignments": assigned,
        "metrics": models, "directions": {"human_mean_rank": "lower is better", "MCD_avg": "higher is better",
                                          "MGG": "higher is better", "GenEval": "higher is better"},
        "sections": {},
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
        result["sections"][section] = {"models": per_model, "agreement": agreement, "spearman": corr}
    alpha, reason = _alpha(reliability_matrix(rows, annotators, db.SECTIONS))
    result["agreement"] = {"krippendorff_alpha": alpha}
    if reason:
        result["agreement"]["krippendorff_alpha_reason"] = reason
    result["consistency"] = consistency(rows, names)
    return jsonsafe.finite(result)


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


def figures(result: dict[str, Any]) -> dict[str, str]:
    """Data URIs: ``shares`` (stacked G/M/P bars per section) and ``scatter`` (human rank vs metrics)."""
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
    return {"shares": shares, "scatter": scatter}


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
        parts.append("<p>Spearman rho of human mean rank vs " + "; ".join(
            f"{k}: {_fmt(sec['spearman'][k]['rho'])}" for k in METRICS)
            + " (negative = the metric agrees with the humans).</p>")
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
