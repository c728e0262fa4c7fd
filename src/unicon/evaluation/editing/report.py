"""EditingScore's section of ``report.html``: Kendall's tau_b of EditingScore, its Table 4 ablations
and each component against every rating criterion, the score's measured direction, the mean
components per candidate kind, and the figures.
"""

from __future__ import annotations

from pathlib import Path

from unicon.evaluation import html as h

#: the summary file that marks an output folder of the suite
FILE = "editing.json"
#: the figures the suite writes into its output folder (``<name>.png``), as logged to W&B
FIGURES = ("tau_by_variant", "score_vs_rating")


def _evaluation(label: str, out: Path) -> str:
    summary = h.read_json(out / FILE) or {}
    results = summary.get("results") or {}
    criteria, kendall = results.get("criteria") or [], results.get("kendall") or {}
    rows = [[f"<td>{h.esc(key)}</td>", *(h.td((kendall[key].get(c) or {}).get("tau_b")) for c in criteria)]
            for key in kendall]
    html_ = h.table(["Kendall τ_b vs rating", *criteria], rows, "editing-tau")
    direction = ", ".join(f"{c}: {d}" for c, d in (results.get("score_direction") or {}).items())
    html_ += (f'<p class="note">N = {h.num(results.get("n"))}; raw score (not normalised); direction: '
              f'{h.esc(direction or "-")}; non-finite scores: {h.num(results.get("nonfinite_scores"))}</p>')
    by_candidate = results.get("by_candidate") or {}
    if by_candidate:
        keys = ("n", "mean_cos_image", "mean_sim_text", "mean_rls", "median_score", "mean_overall_rating")
        html_ += "<h3>By candidate kind</h3>" + h.table(
            ["candidate", *keys], [[f"<td>{h.esc(g)}</td>", *(h.td(v.get(k)) for k in keys)]
                                   for g, v in by_candidate.items()], "editing-candidates")
    own = (summary.get("own_edits") or {}).get("by_kind") or {}
    if own:
        keys = sorted({k for v in own.values() for k in v})
        html_ += "<h3>The model's own edits</h3>" + h.table(
            ["edit kind", *keys], [[f"<td>{h.esc(kind)}</td>", *(h.td(v.get(k)) for k in keys)]
                                   for kind, v in own.items()], "editing-own")
    return html_ + h.figures(out, "editing", label, FIGURES)


def section(run_dir: Path) -> str:
    """The section's HTML for the run (or standalone output) folder ``run_dir``."""
    return h.section(run_dir, "editing", FILE, _evaluation)

