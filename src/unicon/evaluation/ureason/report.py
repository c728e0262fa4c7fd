"""UReason's section of ``report.html``: the three settings' accuracies per category and, per
sample, the three settings' images side by side with their verdicts.
"""

from __future__ import annotations

from pathlib import Path

from unicon.evaluation import html as h
from unicon.evaluation.ureason.plots import SETTINGS, categories

#: the summary file that marks an output folder of the suite
FILE = "ureason.json"


def _evaluation(label: str, out: Path) -> str:
    summary = h.read_json(out / FILE) or {}
    metrics = summary.get("metrics") or {}
    cats = categories(metrics)
    rows = [[f"<td>{k} {name}</td>", *(h.td(metrics.get(f"acc_s{k}/{c}")) for c in cats), h.td(metrics.get(f"acc_s{k}"))]
            for k, name in SETTINGS]
    rows.append(["<td>reasoning chain</td>", *(h.td(metrics.get(f"chain_acc/{c}")) for c in cats),
                 h.td(metrics.get("chain_acc"))])
    html_ = h.table(["setting (accuracy %)", *(h.esc(c) for c in cats), "overall"], rows, "ureason-acc")
    if cats:
        html_ += '<div class="figures">' + h.figure_file(
            out / "settings_by_category.png", "ureason/fig/settings_by_category",
            f"accuracy of the three settings per category ({label or 'evaluation'})") + "</div>"
    html_ += f'<p class="note">judge: {h.esc(summary.get("judge"))}; N = {h.num(metrics.get("n"))}</p>'
    samples = h.read_jsonl(out / "samples.jsonl")[:h.MAX_ROWS]
    if samples:
        body = []
        for s in samples:
            cells = [h.td(s.get("category")), h.td(s.get("expect_en")), h.td(s.get("refined_prompt"))]
            for k, _ in SETTINGS:
                verdict = "yes" if s.get(f"correct_s{k}") else "no"
                img = h.img(out / s[f"image_s{k}"], f"setting {k}", "thumb", f"ureason/s{k}", h.THUMB_SIDE) \
                    if s.get(f"image_s{k}") \
                    else f'<span class="empty">{h.esc(s.get(f"image_error_s{k}") or "no image")}</span>'
                cells.append(f'<td>{img}<div class="{"ok" if verdict == "yes" else "bad"}">{verdict}</div></td>')
            body.append(cells)
        html_ += "<h3>Three settings side by side</h3>" + h.table(
            ["category", "expected", "refined prompt (setting 3)", "1 direct", "2 reasoning-guided",
             "3 de-contextualized"], body, "ureason-side")
    return html_


def section(run_dir: Path) -> str:
    """The section's HTML for the run (or standalone output) folder ``run_dir``."""
    columns = {"acc s1": "acc_s1", "acc s2": "acc_s2", "acc s3": "acc_s3", "Δ12": "delta_12", "Δ23": "delta_23",
               "chain acc": "chain_acc"}
    return h.section(run_dir, "ureason", FILE, _evaluation, columns)

