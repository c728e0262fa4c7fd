"""RealUnify's section of ``report.html``: the direct and stepwise accuracies per category, axis and
overall with their difference, and, per sample, the direct and stepwise images side by side with
their outcome.
"""

from __future__ import annotations

from pathlib import Path

from unicon.evaluation import html as h

#: the summary file that marks an output folder of the suite
FILE = "realunify.json"


def _evaluation(label: str, out: Path) -> str:
    summary = h.read_json(out / FILE) or {}
    metrics = summary.get("metrics") or {}
    cats = [k.split("/", 1)[1] for k in metrics if k.startswith("n/")]
    groups = [*cats, *(a for a in ("ueg", "geu") if f"acc_direct/{a}" in metrics or f"acc_stepwise/{a}" in metrics),
              ""]
    rows = [[f"<td>{h.esc(g.upper() if g in ('ueg', 'geu') else g or 'overall')}</td>",
             *(h.td(metrics.get(f"{k}/{g}" if g else k)) for k in
               ("acc_direct", "acc_stepwise", "delta", "q_acc_direct", "q_acc_stepwise", "edit_acc"))]
            for g in groups]
    html_ = h.table(["category (accuracy %)", "direct", "stepwise", "Δ stepwise − direct", "per-question direct",
                    "per-question stepwise", "edit acc"], rows, "realunify-acc")
    if cats:
        html_ += '<div class="figures">' + h.figure_file(
            out / "settings_by_category.png", "realunify/fig/settings_by_category",
            f"direct and stepwise accuracy per category ({label or 'evaluation'})") + "</div>"
    unparseable = ", ".join(f"{k} {h.num(v)}" for k, v in metrics.items() if k.startswith("unparseable_"))
    html_ += (f'<p class="note">judge: {h.esc(summary.get("judge"))}; settings: {h.esc(", ".join(summary.get("settings") or []))}; '
              f'N = {h.num(metrics.get("n"))}; unparseable replies (failures): {h.esc(unparseable or "0")}</p>')
    samples = h.read_jsonl(out / "samples.jsonl")[:h.MAX_ROWS]
    if samples:
        body = []
        for s in samples:
            text = s.get("prompt") if s.get("axis") == "ueg" else s.get("question")
            cells = [h.td(s.get("category")), h.td(text)]
            for k in ("direct", "stepwise"):
                path = s.get(f"image_{k}") or (s.get("image") if s.get("axis") == "geu" and k == "direct" else None)
                correct = s.get(f"correct_{k}")
                img = h.img(out / path, k, "thumb", f"realunify/{k}", h.THUMB_SIDE) if path \
                    else f'<span class="empty">{h.esc(s.get(f"image_error_{k}") or "no image")}</span>'
                answer = s.get(f"pred_{k}") if s.get("axis") == "geu" else None
                verdict = "not run" if correct is None else ("right" if correct else "wrong")
                note = f"{verdict}" + (f" ({answer or 'unparseable'})" if correct is not None and s.get("axis") == "geu"
                                       else "")
                cells.append(f'<td>{img}<div class="{"ok" if correct else "bad"}">{h.esc(note)}</div></td>')
            body.append(cells)
        html_ += "<h3>Direct and stepwise side by side</h3>" + h.table(
            ["category", "prompt / question", "direct", "stepwise"], body, "realunify-side")
    return html_


def section(run_dir: Path) -> str:
    """The section's HTML for the run (or standalone output) folder ``run_dir``."""
    columns = {"acc direct": "acc_direct", "acc stepwise": "acc_stepwise", "Δ": "delta", "UEG direct": "acc_direct/ueg",
               "UEG stepwise": "acc_stepwise/ueg", "GEU direct": "acc_direct/geu", "GEU stepwise": "acc_stepwise/geu"}
    return h.section(run_dir, "realunify", FILE, _evaluation, columns)

