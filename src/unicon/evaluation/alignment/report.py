"""Image-text alignment's section of ``report.html``: Kendall's tau_b and tau_c of BagelScore (decode
and expected, with the decode failure rate) and of each baseline against the ratings, per
evaluation, and the scatter plots.
"""

from __future__ import annotations

from pathlib import Path

from unicon.evaluation import html as h

#: the summary file that marks an output folder of the suite
FILE = "alignment.json"
#: the figures the suite writes into its output folder (``<name>.png``), as logged to W&B
FIGURES = ("metrics_vs_rating",)


def _evaluation(label: str, out: Path) -> str:
    summary = h.read_json(out / FILE) or {}
    metrics = summary.get("metrics") or {}
    rows = [[f"<td>{h.esc(name)}</td>", *(h.td(m.get(k)) for k in ("tau_b", "tau_c", "n", "missing", "failure_rate"))]
            for name, m in metrics.items()]
    html_ = h.table(["metric", "Kendall τ_b", "τ_c", "n", "missing", "unparseable rate"], rows, "alignment-tau")
    not_run = "; ".join(f"{k}: {v}" for k, v in (summary.get("not_run") or {}).items())
    skipped = ", ".join(f"{k} {v}" for k, v in (summary.get("skipped") or {}).items())
    html_ += (f'<p class="note">pairs: {h.num(summary.get("n_pairs"))}; ratings skipped: {h.esc(skipped or "none")}'
              f'{"; not run: " + h.esc(not_run) if not_run else ""}</p>')
    return html_ + h.figures(out, "alignment", label, FIGURES)


def section(run_dir: Path) -> str:
    """The section's HTML for the run (or standalone output) folder ``run_dir``."""
    def tau_b(key):
        return lambda results: (h.metric(key)(results) or {}).get("tau_b")

    columns = {"BagelScore expected τ_b": tau_b("bagelscore_expected"), "BagelScore decode τ_b": tau_b("bagelscore_decode"),
               "CLIP-S τ_b": tau_b("clip_s")}
    return h.section(run_dir, "alignment", FILE, _evaluation, columns)

