"""CocoCon's section of ``report.html``: ``C_k`` / ``acc@k`` / ``rho`` per task at each evaluation, ``C_1``
and ``rho`` per evaluation, Fig. 5a/5b (``consistency_by_k.png``, ``consistency_vs_accuracy.png``)
and the sample rows of the run's ``tables/cococon_samples.jsonl``.

Also the suite's optional parts of the report (:mod:`unicon.report` calls them through the suite
registry, :meth:`unicon.evaluation.framework.EvalSuite.report_module`), all from the series of
``metrics.jsonl`` (metric name -> ``[(step, value), ...]``):

* :func:`headline_table`: the table ``unicon train`` prints at the end of a run;
* :func:`compare` (rows), :func:`comparison_text` and :func:`comparison_html`: the run against a
  baseline run (``unicon report RUN --baseline RUN_K``, e.g. the demo's row M against its control
  row K); :data:`NOT_COMPARED` says why a baseline gave no row.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from unicon.evaluation import html as h
from unicon.jsonsafe import finite

#: the summary file that marks an output folder of the suite
FILE = "results.json"
#: the figures the suite writes into its output folder (``<name>.png``), as logged to W&B
FIGURES = ("consistency_by_k", "consistency_vs_accuracy")
#: the tasks of the headline and comparison tables, compared with captioning
HEADLINE_TASKS = ("vqa", "localization", "t2i")


def _evaluation(label: str, out: Path) -> str:
    res = h.read_json(out / FILE) or {}
    tasks = [t for t in HEADLINE_TASKS if isinstance(res.get(t), dict)]
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
    if not h.suite_outputs(run_dir, "cococon", FILE):
        return h.not_evaluated("cococon", FILE)
    columns = {**{f"{t} C_1": (lambda res, t=t: (res.get(t) or {}).get("C_k", {}).get("1")) for t in HEADLINE_TASKS},
               **{f"{t} rho": (lambda res, t=t: (res.get(t) or {}).get("rho")) for t in HEADLINE_TASKS}}
    return h.section(run_dir, "cococon", FILE, _evaluation, columns) + _samples(run_dir / "tables")


def headline_table(series: dict[str, list[tuple[int, float]]]) -> str | None:
    """The run's CocoCon headline as plain text: per task, ``C_1`` and ``rho`` at the first and the
    last epoch-end evaluation, and their change; None when the run logged no CocoCon evaluation."""
    rows = []
    for task in HEADLINE_TASKS:
        c1, rho = series.get(f"cococon/{task}/C_1"), series.get(f"cococon/{task}/rho")
        if not c1:
            continue
        nan = (0, float("nan"))
        r0, r1 = (rho[0], rho[-1]) if rho else (nan, nan)
        rows.append((task, c1[0][1], c1[-1][1], r0[1], r1[1]))
    if not rows:
        return None
    n = len(series[f"cococon/{rows[0][0]}/C_1"])
    head = f"{'task':<14}{'C_1 first':>10}{'C_1 last':>10}{'change':>8}{'rho first':>11}{'rho last':>10}{'change':>8}"
    lines = [f"CocoCon at the first and last of {n} epoch-end evaluations:", head]
    for task, a, b, ra, rb in rows:  # as comparison_text: C_1 in percent to 0.1, rho to 0.001
        lines.append(f"{task:<14}{a:>10.1f}{b:>10.1f}{b - a:>+8.1f}{ra:>11.3f}{rb:>10.3f}{rb - ra:>+8.3f}")
    return "\n".join(lines)


#: why :func:`compare` gave no row: the end of ``unicon report --baseline``'s error, after the baseline folder
NOT_COMPARED = ("no CocoCon C_1 and rho logged for a task that this run logged too "
                "(the baseline must be a run with eval.cococon enabled)")


def _last(series: dict, baseline: dict, key: str) -> dict[str, float] | None:
    """``{run, baseline, difference}`` of ``key`` at each run's last logged value; None unless both logged it."""
    mine, base = series.get(key), baseline.get(key)
    if not mine or not base:
        return None
    return {"run": mine[-1][1], "baseline": base[-1][1], "difference": mine[-1][1] - base[-1][1]}


def _row(label: str, prefix: str, series: dict, baseline: dict) -> dict[str, Any]:
    """``{"task": label, metric: _last(...)}`` for each of ``C_1``, ``rho``, ``acc@1`` logged under
    ``<prefix>/<metric>`` by both runs."""
    return {"task": label, **{m: v for m in ("C_1", "rho", "acc@1") if (v := _last(series, baseline, f"{prefix}/{m}"))}}


def compare(series: dict, baseline: dict) -> list[dict[str, Any]]:
    """Per CocoCon task, ``C_1``, ``rho`` and ``acc@1`` at the last epoch-end evaluation of a run (e.g.
    the consistency-trained row M) and of a baseline run (e.g. its control K, the same data, seed and
    steps), with their difference ``run - baseline``; tasks whose ``C_1`` and ``rho`` both runs logged.
    Then captioning's ``acc@1`` and, for each probed word (``eval.cococon.probe_words``) both runs
    logged, the same rows on the samples about it (``<word>/caption``, ``<word>/<task>``)."""
    rows = [row for task in HEADLINE_TASKS
            if {"C_1", "rho"} <= (row := _row(task, f"cococon/{task}", series, baseline)).keys()]
    if not rows:
        return rows
    words = sorted({k.split("/")[2] for k in series if k.startswith("cococon/probe/") and k.endswith("/caption/acc@1")
                    and k.count("/") == 4})
    labelled = [("caption", "cococon/caption")] + [(f"{w}/{t}", f"cococon/probe/{w}/{t}")
                                                    for w in words for t in ("caption", *HEADLINE_TASKS)]
    return rows + [row for label, prefix in labelled if len(row := _row(label, prefix, series, baseline)) > 1]


def comparison_text(rows: list[dict[str, Any]], run: str, baseline: str) -> str:
    """:func:`compare` as plain text, one line per row (``-`` where a row has no such metric)."""
    head = (f"{'task':<20}{'C_1 run':>9}{'C_1 base':>10}{'change':>8}{'rho run':>9}{'rho base':>10}{'change':>8}"
            f"{'acc@1 run':>11}{'acc@1 base':>12}{'change':>8}")
    lines = [f"CocoCon at the last epoch end: {run} (run) against {baseline} (base)", head]
    formats = {"C_1": (9, 10, ".1f"), "rho": (9, 10, ".3f"), "acc@1": (11, 12, ".1f")}
    for r in rows:
        cells = []
        for metric, (w_run, w_base, f) in formats.items():
            v = r.get(metric)
            cells.append("-".rjust(w_run) + "-".rjust(w_base) + "-".rjust(8) if v is None else
                         f"{v['run']:>{w_run}{f}}{v['baseline']:>{w_base}{f}}{v['difference']:>+8{f}}")
        lines.append(f"{r['task']:<20}" + "".join(cells))
    return "\n".join(lines)


#: the two runs of a comparison figure: (label, matplotlib format, colour)
RUNS = (("this run", "o-", "C0"), ("baseline", "s--", "C1"))


def _pair_figure(panels: dict[str, dict[str, list[tuple[int, float]]]], ylabel: str, key: str,
                 caption: str) -> str:
    """One small plot per panel (a task) of each run's points (value against step), as
    :func:`unicon.evaluation.html.figure_png` with the plotted points in its ``data-series``:
    ``{panel: {"this run": [[step, value], ...], "baseline": [...]}}`` (a run without the panel's
    metric is left out of it)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(2.8 * len(panels), 2.3))
    for ax, (panel, lines) in zip(fig.subplots(1, len(panels), squeeze=False)[0], panels.items()):
        for label, fmt, color in RUNS:
            if label in lines:
                steps, values = zip(*lines[label])
                ax.plot(steps, values, fmt, color=color, ms=4 if len(values) < 30 else 0, label=label)
        ax.set_title(panel, fontsize=8)
        ax.set_xlabel("step", fontsize=7)
        ax.set_ylabel(ylabel, fontsize=7)
        ax.tick_params(labelsize=7)
        ax.legend(fontsize=6)
    fig.tight_layout()
    return h.figure_png(fig, key, caption, data=finite(panels))


def comparison_html(rows: list[dict[str, Any]], baseline: str | Path, series: dict,
                    baseline_series: dict) -> str:
    """:func:`compare` as a table with the differences coloured by sign, then both runs' curves: per
    compared task, ``C_1`` at each epoch-end evaluation, and each task's training-batch ρ
    (``train/rho/<task>/ema``, logged on consistency steps) where either run logged it."""

    def diff(v: float) -> str:
        cls = "ok" if v > 0 else "bad" if v < 0 else ""
        return f'<td class="num {cls}">{h.num(v)}</td>'

    def cells(v: dict[str, float] | None) -> list[str]:
        return ['<td class="num">-</td>'] * 3 if v is None else [h.td(v["run"]), h.td(v["baseline"]), diff(v["difference"])]

    body = [[f"<td>{h.esc(r['task'])}</td>", *cells(r.get("C_1")), *cells(r.get("rho")), *cells(r.get("acc@1"))]
            for r in rows]
    out = (h.table(["task", "C_1 this run", "C_1 baseline", "change", "rho this run", "rho baseline", "change",
                    "acc@1 this run", "acc@1 baseline", "change"], body, "comparison")
           + '<p class="note">CocoCon at the last epoch-end evaluation of each run; a probed word\'s rows '
             '(<code>word/task</code>) are on the samples about it.</p>')
    runs = {"this run": series, "baseline": baseline_series}
    c1 = {r["task"]: {label: list(s[f"cococon/{r['task']}/C_1"]) for label, s in runs.items()}
          for r in rows if r["task"] in HEADLINE_TASKS}
    figures = [_pair_figure(c1, "C_1 (%)", "comparison/C_1", "C_1 at each epoch-end evaluation, both runs")]
    rho = {t: lines for t in HEADLINE_TASKS
           if (lines := {label: list(s[f"train/rho/{t}/ema"]) for label, s in runs.items() if f"train/rho/{t}/ema" in s})}
    if rho:
        figures.append(_pair_figure(rho, "training-batch ρ", "comparison/rho",
                                    "training-batch ρ per task (moving average)"))
    out += '<div class="figures">' + "".join(figures) + "</div>"
    logged = tuple(label for label in runs if any(label in lines for lines in rho.values()))
    said = {(): "Neither run logged a training-batch ρ",
            ("this run",): "The baseline logged no training-batch ρ",
            ("baseline",): "This run logged no training-batch ρ"}
    plotted = {("this run",): ": only this run's is plotted", ("baseline",): ": only the baseline's is plotted"}
    if logged in said:
        out += (f'<p class="note">{said[logged]} (train/rho/&lt;task&gt;/ema, logged on consistency steps only)'
                f"{plotted.get(logged, '')}.</p>")
    return out
