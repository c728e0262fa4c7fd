"""Semantic drift's section of ``report.html``: MCD per mapping and MGG per evaluation, the drift
curves, the MGG heatmap and the chain strips (each chain's images across generations with its
captions).
"""

from __future__ import annotations

from pathlib import Path

from unicon.evaluation import html as h

#: the summary file that marks an output folder of the suite
FILE = "drift.json"
#: the figures the suite writes into its output folder (``<name>.png``), as logged to W&B
FIGURES = ("drift_curves", "mgg_heatmap", "strips")


def _evaluation(label: str, out: Path) -> str:
    rep = h.read_json(out / FILE) or {}
    mcd = rep.get("mcd") or {}
    html_ = ""
    if mcd.get("S"):
        gens = sorted({int(g) for S in mcd["S"].values() for g in S})
        rows = [[f"<td>{h.esc(m)}</td>", h.td((mcd.get("MCD") or {}).get(m)), h.td((mcd.get("embedder") or {}).get(m)),
                 *(h.td(S.get(str(g))) for g in gens)] for m, S in mcd["S"].items()]
        html_ += h.table(["mapping", "MCD", "embedder", *(f"S(g={g})" for g in gens)], rows, "drift-mcd")
    if "MGG" in rep:
        html_ += f'<p>MGG (GenEval overall, averaged over generations): {h.num(rep.get("MGG"))}</p>'
    html_ += h.figures(out, "drift", label, FIGURES)
    strips = rep.get("strips") or []
    if strips:
        rows = [[h.td(s.get("chain")), h.td(s.get("id")),
                 "<td>" + h.img(out / s["image"], f"chain {s.get('id')}", "strip", "drift/strip") + "</td>",
                 h.td(s.get("captions"))] for s in strips[:h.MAX_ROWS]]
        html_ += "<h3>Chain strips</h3>" + h.table(["chain", "id", "images across generations", "captions"], rows,
                                                  "drift-strips")
    return html_


def section(run_dir: Path) -> str:
    """The section's HTML for the run (or standalone output) folder ``run_dir``."""
    reports = [h.read_json(out / FILE) or {} for _, out in h.suite_outputs(run_dir, "drift", FILE)]
    mappings = list(dict.fromkeys(m for rep in reports for m in rep.get("MCD") or {}))
    columns = {"MCD_avg": lambda rep: rep.get("MCD_avg"),
               **{f"MCD_{m}": (lambda rep, m=m: (rep.get("MCD") or {}).get(m)) for m in mappings},
               "MGG": lambda rep: rep.get("MGG")}
    return h.section(run_dir, "drift", FILE, _evaluation, columns)
