"""CocoCon's section of ``report.html``: ``C_k`` / ``acc@k`` / ``rho`` per task at each evaluation, ``C_1``
and ``rho`` per evaluation, Fig. 5a/5b (``consistency_by_k.png``, ``consistency_vs_accuracy.png``)
and the sample rows of the run's ``tables/cococon_samples.jsonl``.
"""

from __future__ import annotations

from pathlib import Path

from unicon.evaluation import html as h

#: the summary file that marks an output folder of the suite
FILE = "results.json"
#: the figures the suite writes into its output folder (``<name>.png``), as logged to W&B
FIGURES = ("consistency_by_k", "consistency_vs_accuracy")


def _evaluation(label: str, out: Path, tables_dir: Path, step: int | None) -> str:
    res = h.read_json(out / FILE) or {}
    tasks = [t for t in ("vqa", "localization", "t2i") if isinstance(res.get(t), dict)]
    max_k = int(res.get("max_k") or max((len(res[t].get("C_k", {})) for t in tasks), default=0))
    ks = [str(k) for k in range(1, max_k + 1)]
    rows = []
    for t in tasks:
        r = res[t]
        rows.append([f"<td>{h.esc(t)}</td>", *(h.td(r.get("C_k", {}).get(k)) for k in ks),
                     *(h.td(r.get("acc@k", {}).get(k)) for k in ks[:1]), h.td(r.get("rho")), h.td(r.get("num_samples"))])
    html_ = h.table(["task", *(f"C_{k}" for k in ks), "acc@1", "rho", "n"], rows, "cococon-ck") if rows else \
        '<p class="empty">results.json holds no task.</p>'
    html_ += h.figures(out, "cococon", label, FIGURES)
    return html_


def _samples(tables_dir: Path) -> str:
    rows = h.read_jsonl(tables_dir / "cococon_samples.jsonl")
    if not rows:
        return ""
    last = max(r.get("step") or 0 for r in rows)
    rows = [r for r in rows if (r.get("step") or 0) == last][:h.MAX_ROWS]
    flags = [c for c in rows[0] if c.endswith("_consistent")]
    body = []
    for r in rows:
        img = h.img(tables_dir / r["image"], f"sample {r.get('id')}", "thumb", max_side=h.THUMB_SIDE) \
            if r.get("image") else ""
        body.append([f"<td>{img}</td>", h.td(r.get("id")), h.td(r.get("caption")), h.td(r.get("hardest_contrast")),
                     h.td(r.get("answer")), h.td(r.get("contrast_answer")),
                     *(f'<td class="{"ok" if r.get(c) else "bad"}">{"yes" if r.get(c) else "no"}</td>' for c in flags)])
    return (f"<h3>Samples (step {last})</h3>"
            + h.table(["image", "id", "caption", "hardest contrast", "answer", "contrast answer",
                      *(h.esc(c.replace("_consistent", " consistent")) for c in flags)], body, "cococon-samples"))


def section(run_dir: Path) -> str:
    """The section's HTML for the run (or standalone output) folder ``run_dir``."""
    evals = h.suite_outputs(run_dir, "cococon", FILE)
    if not evals:
        return h.not_evaluated("cococon", FILE)
    tasks = ("vqa", "localization", "t2i")
    columns = {**{f"{t} C_1": (lambda res, t=t: (res.get(t) or {}).get("C_k", {}).get("1")) for t in tasks},
               **{f"{t} rho": (lambda res, t=t: (res.get(t) or {}).get("rho")) for t in tasks}}
    html_ = h.trend(evals, FILE, columns, "cococon-trend")
    html_ += h.earlier(evals, lambda label, out: _evaluation(label, out, run_dir / "tables", None))
    return html_ + _samples(run_dir / "tables")

