"""``unicon report RUN_DIR``: a human summary of a run, from its files alone (no W&B needed).

Reads ``<run_dir>/metrics.jsonl`` (every scalar logged during training and evaluation) and
writes ``<run_dir>/report.md`` with

* the final value of each metric, grouped by suite (``train/``, ``cococon/``, ``drift/``, ...),
* each metric's value at every logged step of its suite's epoch-end evaluations (a trend table),
* ``report_curves.png``: the training loss and each suite's headline metrics against the step.

and ``<run_dir>/report.html`` (:func:`write_html`), one self-contained page -- plain HTML and CSS,
every image inlined as a ``data:`` URI, no script and no network reference -- with the sections

* ``summary``: the headline metrics' first and final values;
* ``training``: the training curves (losses, learning rates, rank diagnostics) and the headline
  evaluation curves against the step;
* ``cococon``: ``C_k`` / ``acc@k`` / ``rho`` per task at the last evaluation, ``C_1`` per epoch,
  Fig. 5a/5b (``consistency_by_k.png``, ``consistency_vs_accuracy.png``) and sample rows;
* ``drift``: MCD per mapping and MGG per epoch, the drift curves, the MGG heatmap and the chain
  strips (each chain's images across generations with its captions);
* ``ureason``: the three settings' accuracies per category and, per sample, the three settings'
  images side by side with their verdicts;
* ``realunify``: the direct and stepwise accuracies per category, axis and overall with their
  difference, and, per sample, the direct and stepwise images side by side with their outcome;
* ``alignment``: Kendall's tau_b and tau_c of BagelScore (decode and expected, with the decode
  failure rate) and of each baseline against the ratings, per evaluation, and the scatter plots;
* ``editing``: Kendall's tau_b of EditingScore, its Table 4 ablations and each component against
  every rating criterion, the score's measured direction, the mean components per candidate kind,
  and the figures;
* ``config``: the resolved run config (``config.yaml``), flattened to dotted keys.

A suite's section reads ``<run_dir>/eval/<suite>/epoch-<n>/`` (epoch-end evaluation) or, for the
output folder of a standalone ``unicon evaluate``, the suite's files in the folder itself. The
same summary is printed as rich tables. ``write_report`` (both files) is called at the end of
``unicon train``.
"""

from __future__ import annotations

import argparse
import base64
import datetime
import html
import io
import json
import math
import os
import re
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable, Sequence

from unicon.errors import UserError

HEADLINE = (
    "train/loss",
    "cococon/vqa/C_1",
    "cococon/localization/C_1",
    "cococon/t2i/C_1",
    "cococon/vqa/rho",
    "drift/MCD_avg",
    "drift/MGG",
    "ureason/acc_s1",
    "ureason/acc_s2",
    "ureason/acc_s3",
    "realunify/acc_direct",
    "realunify/acc_stepwise",
)

#: the sections of report.html, in page order: ``(id, title)``
SECTIONS = (
    ("summary", "Summary"),
    ("training", "Training curves"),
    ("cococon", "CocoCon"),
    ("drift", "Semantic drift"),
    ("ureason", "UReason"),
    ("realunify", "RealUnify"),
    ("alignment", "Image-text alignment"),
    ("editing", "EditingScore"),
    ("config", "Run config"),
)
#: the figures each suite writes into its output folder (``<name>.png``), as logged to W&B
SUITE_FIGURES = {
    "cococon": ("consistency_by_k", "consistency_vs_accuracy"),
    "drift": ("drift_curves", "mgg_heatmap", "strips"),
    "alignment": ("metrics_vs_rating",),
    "editing": ("tau_by_variant", "score_vs_rating"),
}
#: the summary file that marks a suite's output folder
SUITE_FILES = {"cococon": "results.json", "drift": "drift.json", "ureason": "ureason.json",
               "realunify": "realunify.json", "alignment": "alignment.json", "editing": "editing.json"}
#: how many sample rows (CocoCon, UReason) and chain strips the page shows per evaluation
MAX_ROWS = 12


def read_rows(path: Path) -> tuple[list[dict], int]:
    """The readable rows of ``metrics.jsonl`` and the number of unreadable lines skipped (a line
    cut by a kill, or garbage): a report of what is there beats no report."""
    rows, bad = [], 0
    with path.open(encoding="utf-8", errors="replace") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                bad += 1
                continue
            if isinstance(row, dict):
                rows.append(row)
            else:
                bad += 1
    return rows, bad


def collect(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """metric name -> [(step, value), ...] in logging order (unreadable lines are skipped and
    counted under ``report/unreadable_lines``)."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise UserError(f"{path} not found: is {run_dir} a unicon run directory?")
    series: dict[str, list[tuple[int, float]]] = defaultdict(list)
    rows, bad = read_rows(path)
    if bad:
        print(f"warning: {path}: skipped {bad} unreadable line(s)")
        series["report/unreadable_lines"].append((0, float(bad)))
    for row in rows:
        step = row.get("step") or 0
        for key, value in row.items():
            if key in ("step", "time", "epoch"):
                continue
            try:
                series[key].append((int(step), float(value)))
            except (TypeError, ValueError):
                continue
    return dict(series)


#: the tasks of the headline table, compared with captioning by CocoCon
HEADLINE_TASKS = ("vqa", "localization", "t2i")


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
    for task, a, b, ra, rb in rows:  # as comparison_table: C_1 in percent to 0.1, rho to 0.001
        lines.append(f"{task:<14}{a:>10.1f}{b:>10.1f}{b - a:>+8.1f}{ra:>11.3f}{rb:>10.3f}{rb - ra:>+8.3f}")
    return "\n".join(lines)


def comparison(series: dict, baseline: dict) -> list[dict[str, Any]]:
    """Per CocoCon task, ``C_1`` and ``rho`` at the last epoch-end evaluation of a run (e.g. the
    consistency-trained row M) and of a baseline run (e.g. its control K, the same data, seed and
    steps), with their difference ``run - baseline``. Tasks logged by both runs only."""
    rows = []
    for task in HEADLINE_TASKS:
        row: dict[str, Any] = {"task": task}
        for metric in ("C_1", "rho"):
            mine, base = series.get(f"cococon/{task}/{metric}"), baseline.get(f"cococon/{task}/{metric}")
            if not mine or not base:
                break
            row[metric] = {"run": mine[-1][1], "baseline": base[-1][1], "difference": mine[-1][1] - base[-1][1]}
        else:
            rows.append(row)
    return rows


def comparison_table(rows: list[dict[str, Any]], run: str, baseline: str) -> str:
    """:func:`comparison` as plain text, one line per task."""
    head = f"{'task':<14}{'C_1 run':>9}{'C_1 base':>10}{'change':>8}{'rho run':>9}{'rho base':>10}{'change':>8}"
    lines = [f"CocoCon at the last epoch end: {run} (run) against {baseline} (base)", head]
    for r in rows:
        c, p = r["C_1"], r["rho"]
        lines.append(f"{r['task']:<14}{c['run']:>9.1f}{c['baseline']:>10.1f}{c['difference']:>+8.1f}"
                     f"{p['run']:>9.3f}{p['baseline']:>10.3f}{p['difference']:>+8.3f}")
    return "\n".join(lines)


def _fmt(v: float) -> str:
    return "nan" if math.isnan(v) else f"{v:.4g}"


def write_report(run_dir: str | Path, baseline: str | Path | None = None) -> Path:
    """Write ``report.md`` (+ ``report_curves.png``) and ``report.html`` (:func:`write_html`) into
    ``run_dir`` and return the path of ``report.md``. With ``baseline`` (another run folder, e.g.
    the control run K of a consistency run M), both files start with :func:`comparison`."""
    run_dir = Path(run_dir)
    series = collect(run_dir)
    compared = _compared(series, baseline)
    groups: dict[str, list[str]] = defaultdict(list)
    for key in sorted(series):
        groups[key.split("/", 1)[0] if "/" in key else "other"].append(key)

    lines = [f"# unicon report: {run_dir.name}", "", f"Run directory: `{run_dir}`", "",
             "The same run as one page with every figure: [report.html](report.html)", ""]
    if compared:
        lines += [f"## Against the baseline run `{baseline}`", "", "```", comparison_table(compared, run_dir.name, Path(baseline).name),
                  "```", ""]
    for group, keys in groups.items():
        lines += [f"## {group}", "", "| metric | final | first | n |", "| --- | ---: | ---: | ---: |"]
        for k in keys:
            vals = series[k]
            lines.append(f"| `{k}` | {_fmt(vals[-1][1])} | {_fmt(vals[0][1])} | {len(vals)} |")
        lines.append("")
    plot = _plot(run_dir, series)
    if plot:
        lines += ["## Curves", "", f"![curves]({plot.name})", ""]
    out = run_dir / "report.md"
    _atomic_write(out, "\n".join(lines).encode("utf-8"))
    write_html(run_dir, series, baseline)
    return out


def _compared(series: dict, baseline: str | Path | None) -> list[dict[str, Any]] | None:
    """:func:`comparison` of a run's series with the baseline run folder's (None without one); a
    baseline that logged no CocoCon task of the run is an error naming it."""
    if baseline is None:
        return None
    rows = comparison(series, collect(Path(baseline)))
    if not rows:
        raise UserError(f"baseline {baseline}: no CocoCon C_1 and rho logged for a task that this run logged too "
                        "(the baseline must be a run with eval.cococon enabled)")
    return rows


def _curves_figure(series: dict, keys: Sequence[str], max_cols: int = 5, cell: tuple[float, float] = (3.2, 2.6)):
    """A grid of line plots, one per key (value against step); a matplotlib ``Figure`` (no pyplot)."""
    from matplotlib.figure import Figure

    cols = min(max_cols, len(keys))
    rows = -(-len(keys) // cols)
    fig = Figure(figsize=(cell[0] * cols, cell[1] * rows))
    axes = fig.subplots(rows, cols, squeeze=False)
    for ax in axes.flat[len(keys):]:
        ax.axis("off")
    for ax, k in zip(axes.flat, keys):
        steps, vals = zip(*series[k])
        ax.plot(steps, vals, marker="o" if len(vals) < 30 else None, ms=3)
        ax.set_title(k, fontsize=8)
        ax.set_xlabel("step", fontsize=7)
        ax.tick_params(labelsize=7)
    fig.tight_layout()
    return fig


def _plot(run_dir: Path, series: dict) -> Path | None:
    keys = [k for k in HEADLINE if k in series]
    if not keys:
        return None
    path = run_dir / "report_curves.png"
    buf = io.BytesIO()
    _curves_figure(series, keys).savefig(buf, format="png", dpi=110)
    _atomic_write(path, buf.getvalue())
    return path


# ---- report.html --------------------------------------------------------------------------------
CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 0; color: #1d232a; background: #f6f7f9; }
header { background: #1f3a5f; color: #fff; padding: 14px 24px; }
header h1 { margin: 0 0 4px 0; font-size: 22px; }
header p { margin: 0; font-size: 13px; opacity: .85; }
nav { position: sticky; top: 0; background: #fff; border-bottom: 1px solid #d8dde3; padding: 8px 24px; z-index: 1; }
nav a { margin-right: 18px; color: #1f3a5f; text-decoration: none; font-weight: 600; font-size: 14px; }
main { padding: 8px 24px 40px 24px; max-width: 1400px; }
section { background: #fff; border: 1px solid #d8dde3; border-radius: 6px; padding: 4px 18px 16px 18px; margin: 16px 0; }
h2 { border-bottom: 2px solid #1f3a5f; padding-bottom: 4px; }
h3 { margin: 18px 0 6px 0; font-size: 16px; }
table { border-collapse: collapse; font-size: 13px; margin: 6px 0 12px 0; }
th, td { border: 1px solid #d8dde3; padding: 3px 8px; vertical-align: top; }
th { background: #eef1f5; text-align: left; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
td.text { max-width: 360px; white-space: pre-wrap; }
.figures { display: flex; flex-wrap: wrap; gap: 12px; }
figure { margin: 0; border: 1px solid #e3e7ec; padding: 6px; background: #fff; }
figure img { max-width: 100%; display: block; }
figcaption { font-size: 12px; color: #56606b; margin-top: 4px; }
img.thumb { width: 96px; height: 96px; object-fit: contain; image-rendering: pixelated; border: 1px solid #d8dde3; background: #eef1f5; }
img.strip { max-height: 110px; image-rendering: pixelated; }
.ok { color: #17702f; font-weight: 600; }
.bad { color: #a4161a; font-weight: 600; }
.note { color: #56606b; font-size: 13px; }
.empty { color: #8a6d00; font-style: italic; }
details summary { cursor: pointer; color: #1f3a5f; margin: 6px 0; }
pre { background: #f3f5f8; padding: 8px; font-size: 12px; overflow-x: auto; }
"""


def _e(value: Any) -> str:
    return html.escape("" if value is None else str(value), quote=True)


def _num(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return _e(value if value is not None else "-")
    return "nan" if isinstance(value, float) and math.isnan(value) else f"{value:.4g}"


def _data_uri(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode('ascii')}"


#: sample images (CocoCon, UReason) are inlined at most this many pixels a side (COCO photos are 640)
THUMB_SIDE = 192


def _img(path: Path, alt: str, cls: str = "", key: str | None = None, max_side: int | None = None) -> str:
    """An ``<img>`` with the file inlined (downscaled to ``max_side`` pixels a side, as PNG, when it
    is larger), or a visible note when the file is missing or unreadable (never a broken image)."""
    if not path.is_file():
        return f'<span class="empty">missing: {_e(path.name)}</span>'
    mime = "image/jpeg" if path.suffix.lower() in (".jpg", ".jpeg") else "image/png"
    data = path.read_bytes()
    if max_side:
        from PIL import Image, UnidentifiedImageError

        try:
            with Image.open(io.BytesIO(data)) as im:
                if max(im.size) > max_side:
                    im = im.convert("RGB")
                    im.thumbnail((max_side, max_side))
                    buf = io.BytesIO()
                    im.save(buf, format="PNG")
                    data, mime = buf.getvalue(), "image/png"
        except (UnidentifiedImageError, OSError) as e:
            return f'<span class="empty">unreadable image {_e(path.name)}: {_e(e)}</span>'
    attrs = f' class="{cls}"' if cls else ""
    attrs += f' data-key="{_e(key)}"' if key else ""
    return f'<img src="{_data_uri(data, mime)}" alt="{_e(alt)}"{attrs}>'


def _figure_png(fig, key: str, caption: str) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    return (f'<figure data-key="{_e(key)}"><img src="{_data_uri(buf.getvalue())}" alt="{_e(caption)}">'
            f"<figcaption>{_e(caption)}</figcaption></figure>")


def _figure_file(path: Path, key: str, caption: str) -> str:
    return f'<figure data-key="{_e(key)}">{_img(path, caption)}<figcaption>{_e(caption)}</figcaption></figure>'


def _table(header: Sequence[str], rows: Iterable[Sequence[str]], cls: str = "") -> str:
    """A table from already-escaped cell HTML."""
    head = "".join(f"<th>{h}</th>" for h in header)
    body = "".join("<tr>" + "".join(cells) + "</tr>" for cells in rows)
    return f'<table class="{cls}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def _td(value: Any) -> str:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return f'<td class="num">{_num(value)}</td>'
    return f'<td class="text">{_e(value)}</td>'


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except ValueError as e:
        raise UserError(f"{path}: not valid JSON ({e})") from None


def _read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return read_rows(path)[0]


def suite_outputs(run_dir: Path, suite: str) -> list[tuple[str, Path]]:
    """``[(label, folder), ...]`` of a suite's evaluations in ``run_dir``: ``("epoch 1",
    <run_dir>/eval/<suite>/epoch-1)``, ... in epoch order, or ``[("", run_dir)]`` when ``run_dir``
    is a standalone evaluation's output folder of that suite."""
    found = []
    for d in (run_dir / "eval" / suite).glob("epoch-*"):
        m = re.fullmatch(r"epoch-(\d+)", d.name)
        if m and (d / SUITE_FILES[suite]).is_file():
            found.append((int(m.group(1)), d))
    if found:
        return [(f"epoch {n}", d) for n, d in sorted(found)]
    return [("", run_dir)] if (run_dir / SUITE_FILES[suite]).is_file() else []


def _not_evaluated(suite: str) -> str:
    return (f'<p class="empty">No {suite} evaluation in this run (neither eval/{suite}/epoch-*/'
            f"{SUITE_FILES[suite]} nor {SUITE_FILES[suite]}).</p>")


def _figures(out: Path, suite: str, label: str) -> str:
    return '<div class="figures">' + "".join(
        _figure_file(out / f"{name}.png", f"{suite}/fig/{name}", f"{name} ({label or 'evaluation'})")
        for name in SUITE_FIGURES[suite] if (out / f"{name}.png").is_file()) + "</div>"


def _earlier(evals: list[tuple[str, Path]], render) -> str:
    """The last evaluation in full; earlier ones folded under ``<details>``."""
    parts = []
    for label, out in evals[:-1]:
        parts.append(f"<details><summary>{_e(label)}</summary>{render(label, out)}</details>")
    label, out = evals[-1]
    return f"<h3>{_e(label or 'Evaluation')}</h3>" + render(label, out) + "".join(parts)


def _section_comparison(baseline: str | Path | None, rows: list[dict[str, Any]] | None) -> str:
    """The run against its baseline run (:func:`comparison`), differences coloured by sign."""
    if not rows:
        return ""

    def diff(v: float) -> str:
        cls = "ok" if v > 0 else "bad" if v < 0 else ""
        return f'<td class="num {cls}">{_num(v)}</td>'

    body = [[f"<td>{_e(r['task'])}</td>", _td(r["C_1"]["run"]), _td(r["C_1"]["baseline"]), diff(r["C_1"]["difference"]),
             _td(r["rho"]["run"]), _td(r["rho"]["baseline"]), diff(r["rho"]["difference"])] for r in rows]
    return (f"<h3>Against the baseline run {_e(baseline)}</h3>"
            + _table(["task", "C_1 this run", "C_1 baseline", "change", "rho this run", "rho baseline", "change"],
                     body, "comparison")
            + '<p class="note">CocoCon at the last epoch-end evaluation of each run.</p>')


def _section_summary(run_dir: Path, series: dict) -> str:
    keys = [k for k in HEADLINE if k in series]
    run_id = (run_dir / "wandb_run_id").read_text().strip() if (run_dir / "wandb_run_id").is_file() else None
    rows = [[f"<td>{_e(k)}</td>", _td(series[k][0][1]), _td(series[k][-1][1]), _td(len(series[k]))] for k in keys]
    out = _table(["metric", "first", "final", "n"], rows, "headline") if rows else \
        '<p class="empty">No headline metric in metrics.jsonl.</p>'
    steps = max((s for vals in series.values() for s, _ in vals), default=0)
    out += f'<p class="note">Last logged step: {steps}. W&amp;B run id: {_e(run_id or "(none)")}.</p>'
    return out


def _rho_figure(series: dict):
    """Each task's training-batch ρ against the step: its moving average (``train/rho/<task>/ema``)
    as a line and its epoch means (``.../epoch_mean``) as markers; None when none was logged."""
    from matplotlib.figure import Figure

    tasks = sorted({k.split("/")[2] for k in series if k.startswith("train/rho/") and k.count("/") == 3})
    if not tasks:
        return None
    fig = Figure(figsize=(5.2, 3.0))
    ax = fig.subplots()
    for i, task in enumerate(tasks):
        color = f"C{i}"
        if f"train/rho/{task}/ema" in series:
            steps, vals = zip(*series[f"train/rho/{task}/ema"])
            ax.plot(steps, vals, color=color, label=f"{task} (moving average)")
        if f"train/rho/{task}/epoch_mean" in series:
            steps, vals = zip(*series[f"train/rho/{task}/epoch_mean"])
            ax.plot(steps, vals, "o--", color=color, ms=5, label=f"{task} (epoch mean)")
    ax.set_xlabel("step", fontsize=8)
    ax.set_ylabel("Spearman ρ, captioning vs task", fontsize=8)
    ax.tick_params(labelsize=7)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def _section_training(series: dict) -> str:
    train = [k for k in sorted(series) if k.startswith("train/")]
    parts = []
    rho = _rho_figure(series)
    if rho is not None:
        parts.append(_figure_png(rho, "training/rho", "training-batch ρ per task: is the consistency objective "
                                 "moving what it optimises?"))
    if train:
        parts.append(_figure_png(_curves_figure(series, train, 6, (2.6, 2.0)), "training/curves",
                                 "training metrics against step"))
    evals = [k for k in HEADLINE if k in series and not k.startswith("train/")]
    if evals:
        parts.append(_figure_png(_curves_figure(series, evals, 6, (2.6, 2.0)), "evaluation/curves",
                                 "headline evaluation metrics against step"))
    if not parts:
        return '<p class="empty">No training metric in metrics.jsonl.</p>'
    groups: dict[str, list[str]] = defaultdict(list)
    for key in sorted(series):
        groups[key.split("/", 1)[0] if "/" in key else "other"].append(key)
    tables = "".join(
        f"<details><summary>{_e(g)}: {len(keys)} metrics, first and final values</summary>"
        + _table(["metric", "first", "final", "n"],
                 [[f"<td>{_e(k)}</td>", _td(series[k][0][1]), _td(series[k][-1][1]), _td(len(series[k]))] for k in keys])
        + "</details>" for g, keys in groups.items())
    return '<div class="figures">' + "".join(parts) + "</div>" + tables


def _cococon_eval(label: str, out: Path, tables_dir: Path, step: int | None) -> str:
    res = _read_json(out / SUITE_FILES["cococon"]) or {}
    tasks = [t for t in ("vqa", "localization", "t2i") if isinstance(res.get(t), dict)]
    max_k = int(res.get("max_k") or max((len(res[t].get("C_k", {})) for t in tasks), default=0))
    ks = [str(k) for k in range(1, max_k + 1)]
    rows = []
    for t in tasks:
        r = res[t]
        rows.append([f"<td>{_e(t)}</td>", *(_td(r.get("C_k", {}).get(k)) for k in ks),
                     *(_td(r.get("acc@k", {}).get(k)) for k in ks[:1]), _td(r.get("rho")), _td(r.get("num_samples"))])
    html_ = _table(["task", *(f"C_{k}" for k in ks), "acc@1", "rho", "n"], rows, "cococon-ck") if rows else \
        '<p class="empty">results.json holds no task.</p>'
    html_ += _figures(out, "cococon", label)
    return html_


def _cococon_samples(tables_dir: Path) -> str:
    rows = _read_jsonl(tables_dir / "cococon_samples.jsonl")
    if not rows:
        return ""
    last = max(r.get("step") or 0 for r in rows)
    rows = [r for r in rows if (r.get("step") or 0) == last][:MAX_ROWS]
    flags = [c for c in rows[0] if c.endswith("_consistent")]
    body = []
    for r in rows:
        img = _img(tables_dir / r["image"], f"sample {r.get('id')}", "thumb", max_side=THUMB_SIDE) \
            if r.get("image") else ""
        body.append([f"<td>{img}</td>", _td(r.get("id")), _td(r.get("caption")), _td(r.get("hardest_contrast")),
                     _td(r.get("answer")), _td(r.get("contrast_answer")),
                     *(f'<td class="{"ok" if r.get(c) else "bad"}">{"yes" if r.get(c) else "no"}</td>' for c in flags)])
    return (f"<h3>Samples (step {last})</h3>"
            + _table(["image", "id", "caption", "hardest contrast", "answer", "contrast answer",
                      *(_e(c.replace("_consistent", " consistent")) for c in flags)], body, "cococon-samples"))


def _section_cococon(run_dir: Path) -> str:
    evals = suite_outputs(run_dir, "cococon")
    if not evals:
        return _not_evaluated("cococon")
    trend = []
    for label, out in evals:
        res = _read_json(out / SUITE_FILES["cococon"]) or {}
        trend.append([f"<td>{_e(label or '-')}</td>",
                      *(_td((res.get(t) or {}).get("C_k", {}).get("1")) for t in ("vqa", "localization", "t2i")),
                      *(_td((res.get(t) or {}).get("rho")) for t in ("vqa", "localization", "t2i"))])
    html_ = _table(["evaluation", "vqa C_1", "localization C_1", "t2i C_1", "vqa rho", "localization rho", "t2i rho"],
                   trend, "cococon-trend")
    html_ += _earlier(evals, lambda label, out: _cococon_eval(label, out, run_dir / "tables", None))
    return html_ + _cococon_samples(run_dir / "tables")


def _drift_eval(label: str, out: Path) -> str:
    rep = _read_json(out / SUITE_FILES["drift"]) or {}
    mcd = rep.get("mcd") or {}
    html_ = ""
    if mcd.get("S"):
        gens = sorted({int(g) for S in mcd["S"].values() for g in S})
        rows = [[f"<td>{_e(m)}</td>", _td((mcd.get("MCD") or {}).get(m)), _td((mcd.get("embedder") or {}).get(m)),
                 *(_td(S.get(str(g))) for g in gens)] for m, S in mcd["S"].items()]
        html_ += _table(["mapping", "MCD", "embedder", *(f"S(g={g})" for g in gens)], rows, "drift-mcd")
    if "MGG" in rep:
        html_ += f'<p>MGG (GenEval overall, averaged over generations): {_num(rep.get("MGG"))}</p>'
    html_ += _figures(out, "drift", label)
    strips = rep.get("strips") or []
    if strips:
        rows = [[_td(s.get("chain")), _td(s.get("id")),
                 "<td>" + _img(out / s["image"], f"chain {s.get('id')}", "strip", "drift/strip") + "</td>",
                 _td(s.get("captions"))] for s in strips[:MAX_ROWS]]
        html_ += "<h3>Chain strips</h3>" + _table(["chain", "id", "images across generations", "captions"], rows,
                                                  "drift-strips")
    return html_


def _section_drift(run_dir: Path) -> str:
    evals = suite_outputs(run_dir, "drift")
    if not evals:
        return _not_evaluated("drift")
    mappings: list[str] = []
    reps = [(label, _read_json(out / SUITE_FILES["drift"]) or {}) for label, out in evals]
    for _, rep in reps:
        mappings += [m for m in (rep.get("MCD") or {}) if m not in mappings]
    trend = [[f"<td>{_e(label or '-')}</td>", _td(rep.get("MCD_avg")),
              *(_td((rep.get("MCD") or {}).get(m)) for m in mappings), _td(rep.get("MGG"))] for label, rep in reps]
    html_ = _table(["evaluation", "MCD_avg", *(f"MCD_{m}" for m in mappings), "MGG"], trend, "drift-trend")
    return html_ + _earlier(evals, _drift_eval)


def _ureason_categories(metrics: dict) -> list[str]:
    return [k.split("/", 1)[1] for k in metrics if k.startswith("acc_s1/")]


def _ureason_eval(label: str, out: Path) -> str:
    summary = _read_json(out / SUITE_FILES["ureason"]) or {}
    metrics = summary.get("metrics") or {}
    cats = _ureason_categories(metrics)
    settings = (("1", "Direct"), ("2", "Reasoning-guided"), ("3", "De-contextualized"))
    rows = [[f"<td>{k} {name}</td>", *(_td(metrics.get(f"acc_s{k}/{c}")) for c in cats), _td(metrics.get(f"acc_s{k}"))]
            for k, name in settings]
    rows.append(["<td>reasoning chain</td>", *(_td(metrics.get(f"chain_acc/{c}")) for c in cats),
                 _td(metrics.get("chain_acc"))])
    html_ = _table(["setting (accuracy %)", *(_e(c) for c in cats), "overall"], rows, "ureason-acc")
    if cats:
        html_ += '<div class="figures">' + _figure_file(
            out / "settings_by_category.png", "ureason/fig/settings_by_category",
            f"accuracy of the three settings per category ({label or 'evaluation'})") + "</div>"
    html_ += f'<p class="note">judge: {_e(summary.get("judge"))}; N = {_num(metrics.get("n"))}</p>'
    samples = _read_jsonl(out / "samples.jsonl")[:MAX_ROWS]
    if samples:
        body = []
        for s in samples:
            cells = [_td(s.get("category")), _td(s.get("expect_en")), _td(s.get("refined_prompt"))]
            for k, _ in settings:
                verdict = "yes" if s.get(f"correct_s{k}") else "no"
                img = _img(out / s[f"image_s{k}"], f"setting {k}", "thumb", f"ureason/s{k}", THUMB_SIDE) \
                    if s.get(f"image_s{k}") \
                    else f'<span class="empty">{_e(s.get(f"image_error_s{k}") or "no image")}</span>'
                cells.append(f'<td>{img}<div class="{"ok" if verdict == "yes" else "bad"}">{verdict}</div></td>')
            body.append(cells)
        html_ += "<h3>Three settings side by side</h3>" + _table(
            ["category", "expected", "refined prompt (setting 3)", "1 direct", "2 reasoning-guided",
             "3 de-contextualized"], body, "ureason-side")
    return html_


def _section_ureason(run_dir: Path) -> str:
    evals = suite_outputs(run_dir, "ureason")
    if not evals:
        return _not_evaluated("ureason")
    trend = []
    for label, out in evals:
        m = (_read_json(out / SUITE_FILES["ureason"]) or {}).get("metrics") or {}
        trend.append([f"<td>{_e(label or '-')}</td>", *(_td(m.get(k)) for k in
                                                          ("acc_s1", "acc_s2", "acc_s3", "delta_12", "delta_23", "chain_acc"))])
    html_ = _table(["evaluation", "acc s1", "acc s2", "acc s3", "Δ12", "Δ23", "chain acc"], trend, "ureason-trend")
    return html_ + _earlier(evals, _ureason_eval)


def _realunify_eval(label: str, out: Path) -> str:
    summary = _read_json(out / SUITE_FILES["realunify"]) or {}
    metrics = summary.get("metrics") or {}
    cats = [k.split("/", 1)[1] for k in metrics if k.startswith("n/")]
    groups = [*cats, *(a for a in ("ueg", "geu") if f"acc_direct/{a}" in metrics or f"acc_stepwise/{a}" in metrics),
              ""]
    rows = [[f"<td>{_e(g.upper() if g in ('ueg', 'geu') else g or 'overall')}</td>",
             *(_td(metrics.get(f"{k}/{g}" if g else k)) for k in
               ("acc_direct", "acc_stepwise", "delta", "q_acc_direct", "q_acc_stepwise", "edit_acc"))]
            for g in groups]
    html_ = _table(["category (accuracy %)", "direct", "stepwise", "Δ stepwise − direct", "per-question direct",
                    "per-question stepwise", "edit acc"], rows, "realunify-acc")
    if cats:
        html_ += '<div class="figures">' + _figure_file(
            out / "settings_by_category.png", "realunify/fig/settings_by_category",
            f"direct and stepwise accuracy per category ({label or 'evaluation'})") + "</div>"
    unparseable = ", ".join(f"{k} {_num(v)}" for k, v in metrics.items() if k.startswith("unparseable_"))
    html_ += (f'<p class="note">judge: {_e(summary.get("judge"))}; settings: {_e(", ".join(summary.get("settings") or []))}; '
              f'N = {_num(metrics.get("n"))}; unparseable replies (failures): {_e(unparseable or "0")}</p>')
    samples = _read_jsonl(out / "samples.jsonl")[:MAX_ROWS]
    if samples:
        body = []
        for s in samples:
            text = s.get("prompt") if s.get("axis") == "ueg" else s.get("question")
            cells = [_td(s.get("category")), _td(text)]
            for k in ("direct", "stepwise"):
                path = s.get(f"image_{k}") or (s.get("image") if s.get("axis") == "geu" and k == "direct" else None)
                correct = s.get(f"correct_{k}")
                img = _img(out / path, k, "thumb", f"realunify/{k}", THUMB_SIDE) if path \
                    else f'<span class="empty">{_e(s.get(f"image_error_{k}") or "no image")}</span>'
                answer = s.get(f"pred_{k}") if s.get("axis") == "geu" else None
                verdict = "not run" if correct is None else ("right" if correct else "wrong")
                note = f"{verdict}" + (f" ({answer or 'unparseable'})" if correct is not None and s.get("axis") == "geu"
                                       else "")
                cells.append(f'<td>{img}<div class="{"ok" if correct else "bad"}">{_e(note)}</div></td>')
            body.append(cells)
        html_ += "<h3>Direct and stepwise side by side</h3>" + _table(
            ["category", "prompt / question", "direct", "stepwise"], body, "realunify-side")
    return html_


def _section_realunify(run_dir: Path) -> str:
    evals = suite_outputs(run_dir, "realunify")
    if not evals:
        return _not_evaluated("realunify")
    trend = []
    for label, out in evals:
        m = (_read_json(out / SUITE_FILES["realunify"]) or {}).get("metrics") or {}
        trend.append([f"<td>{_e(label or '-')}</td>", *(_td(m.get(k)) for k in
                                                          ("acc_direct", "acc_stepwise", "delta", "acc_direct/ueg",
                                                           "acc_stepwise/ueg", "acc_direct/geu", "acc_stepwise/geu"))])
    html_ = _table(["evaluation", "acc direct", "acc stepwise", "Δ", "UEG direct", "UEG stepwise", "GEU direct",
                    "GEU stepwise"], trend, "realunify-trend")
    return html_ + _earlier(evals, _realunify_eval)


def _alignment_eval(label: str, out: Path) -> str:
    summary = _read_json(out / SUITE_FILES["alignment"]) or {}
    metrics = summary.get("metrics") or {}
    rows = [[f"<td>{_e(name)}</td>", *(_td(m.get(k)) for k in ("tau_b", "tau_c", "n", "missing", "failure_rate"))]
            for name, m in metrics.items()]
    html_ = _table(["metric", "Kendall τ_b", "τ_c", "n", "missing", "unparseable rate"], rows, "alignment-tau")
    not_run = "; ".join(f"{k}: {v}" for k, v in (summary.get("not_run") or {}).items())
    skipped = ", ".join(f"{k} {v}" for k, v in (summary.get("skipped") or {}).items())
    html_ += (f'<p class="note">pairs: {_num(summary.get("n_pairs"))}; ratings skipped: {_e(skipped or "none")}'
              f'{"; not run: " + _e(not_run) if not_run else ""}</p>')
    return html_ + _figures(out, "alignment", label)


def _section_alignment(run_dir: Path) -> str:
    evals = suite_outputs(run_dir, "alignment")
    if not evals:
        return _not_evaluated("alignment")
    trend = []
    for label, out in evals:
        m = (_read_json(out / SUITE_FILES["alignment"]) or {}).get("metrics") or {}
        trend.append([f"<td>{_e(label or '-')}</td>", *(_td((m.get(k) or {}).get("tau_b")) for k in
                                                          ("bagelscore_expected", "bagelscore_decode", "clip_s"))])
    html_ = _table(["evaluation", "BagelScore expected τ_b", "BagelScore decode τ_b", "CLIP-S τ_b"], trend,
                   "alignment-trend")
    return html_ + _earlier(evals, _alignment_eval)


def _editing_eval(label: str, out: Path) -> str:
    summary = _read_json(out / SUITE_FILES["editing"]) or {}
    results = summary.get("results") or {}
    criteria, kendall = results.get("criteria") or [], results.get("kendall") or {}
    rows = [[f"<td>{_e(key)}</td>", *(_td((kendall[key].get(c) or {}).get("tau_b")) for c in criteria)]
            for key in kendall]
    html_ = _table(["Kendall τ_b vs rating", *criteria], rows, "editing-tau")
    direction = ", ".join(f"{c}: {d}" for c, d in (results.get("score_direction") or {}).items())
    html_ += (f'<p class="note">N = {_num(results.get("n"))}; raw score (not normalised); direction: '
              f'{_e(direction or "-")}; non-finite scores: {_num(results.get("nonfinite_scores"))}</p>')
    by_candidate = results.get("by_candidate") or {}
    if by_candidate:
        keys = ("n", "mean_cos_image", "mean_sim_text", "mean_rls", "median_score", "mean_overall_rating")
        html_ += "<h3>By candidate kind</h3>" + _table(
            ["candidate", *keys], [[f"<td>{_e(g)}</td>", *(_td(v.get(k)) for k in keys)]
                                   for g, v in by_candidate.items()], "editing-candidates")
    own = (summary.get("own_edits") or {}).get("by_kind") or {}
    if own:
        keys = sorted({k for v in own.values() for k in v})
        html_ += "<h3>The model's own edits</h3>" + _table(
            ["edit kind", *keys], [[f"<td>{_e(kind)}</td>", *(_td(v.get(k)) for k in keys)]
                                   for kind, v in own.items()], "editing-own")
    return html_ + _figures(out, "editing", label)


def _section_editing(run_dir: Path) -> str:
    evals = suite_outputs(run_dir, "editing")
    return _earlier(evals, _editing_eval) if evals else _not_evaluated("editing")


def _section_config(run_dir: Path) -> str:
    path = run_dir / "config.yaml"
    if not path.is_file():
        return '<p class="empty">No config.yaml in this folder (a standalone evaluation keeps its arguments in W&amp;B).</p>'
    from omegaconf import OmegaConf

    from unicon.loggers import flatten_config  # lazy: pulls in Lightning, not needed by unicon report

    try:
        flat = flatten_config(OmegaConf.load(path))
    except Exception as e:  # a hand-edited file: show it as text rather than fail the report
        return f'<p class="bad">{_e(path)}: {_e(e)}</p><pre>{_e(path.read_text(errors="replace"))}</pre>'
    rows = [[f"<td>{_e(k)}</td>", f'<td class="text">{_e(json.dumps(v) if not isinstance(v, str) else v)}</td>']
            for k, v in flat.items()]
    return _table(["key", "value"], rows, "config")


def render_html(run_dir: Path, series: dict | None = None, baseline: str | Path | None = None) -> str:
    """The page of :func:`write_html` as a string."""
    run_dir = Path(run_dir)
    series = collect(run_dir) if series is None else series
    bodies = {
        "summary": _section_comparison(baseline, _compared(series, baseline)) + _section_summary(run_dir, series),
        "training": _section_training(series),
        "cococon": _section_cococon(run_dir),
        "drift": _section_drift(run_dir),
        "ureason": _section_ureason(run_dir),
        "realunify": _section_realunify(run_dir),
        "alignment": _section_alignment(run_dir),
        "editing": _section_editing(run_dir),
        "config": _section_config(run_dir),
    }
    nav = "".join(f'<a href="#{sid}">{_e(title)}</a>' for sid, title in SECTIONS)
    sections = "".join(f'<section id="{sid}"><h2>{_e(title)}</h2>{bodies[sid]}</section>' for sid, title in SECTIONS)
    when = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>unicon report: {_e(run_dir.name)}</title><style>{CSS}</style></head><body>"
            f"<header><h1>unicon report: {_e(run_dir.name)}</h1><p>{_e(run_dir.resolve())} &middot; written {_e(when)}"
            f"</p></header><nav>{nav}</nav><main>{sections}</main></body></html>\n")


def _atomic_write(path: Path, data: bytes) -> None:
    """Write through a temporary file of this process: every DDP rank runs ``unicon train`` to its
    end and writes the (same) report; a reader never sees a partial file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    tmp.replace(path)


def write_html(run_dir: str | Path, series: dict | None = None, baseline: str | Path | None = None) -> Path:
    """Write ``<run_dir>/report.html`` (see the module docstring) and return its path."""
    run_dir = Path(run_dir)
    out = run_dir / "report.html"
    _atomic_write(out, render_html(run_dir, series, baseline).encode("utf-8"))
    return out


def print_summary(run_dir: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    series = collect(run_dir)
    table = Table(title=f"unicon run {run_dir.name}")
    for col in ("metric", "final", "first", "n"):
        table.add_column(col, justify="left" if col == "metric" else "right")
    for key in sorted(series):
        vals = series[key]
        table.add_row(key, _fmt(vals[-1][1]), _fmt(vals[0][1]), str(len(vals)))
    Console().print(table)


def cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="unicon report",
        description="Summarise a run directory: final and first value of every metric in metrics.jsonl; "
        "writes <run_dir>/report.md, report_curves.png and report.html (one self-contained page: "
        "training curves, CocoCon, drift and UReason results with their figures, the run config).",
    )
    parser.add_argument("run_dir", type=Path, help="a run directory, e.g. checkpoints/shapes_demo")
    parser.add_argument("--baseline", type=Path, default=None, metavar="RUN_DIR",
                        help="another run to compare with (e.g. the control run K of a consistency run M): "
                             "CocoCon C_1 and rho per task at each run's last epoch end, and the change")
    parser.add_argument("--brief", action="store_true",
                        help="print only the comparison (with --baseline), not every metric")
    args = parser.parse_args(argv)
    for path in (args.run_dir, args.baseline):
        if path is not None and not path.is_dir():
            raise UserError(f"{path} is not a directory")
    if not args.brief:
        print_summary(args.run_dir)
    report = write_report(args.run_dir, args.baseline)
    if args.baseline is not None:
        print(comparison_table(_compared(collect(args.run_dir), args.baseline), args.run_dir.name, args.baseline.name))
    print(f"report: {report}")
    print(f"html:   {args.run_dir / 'report.html'}")
    return 0
