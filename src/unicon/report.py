"""``unicon report RUN_DIR``: a human summary of a run, from its files alone (no W&B needed).

Reads ``<run_dir>/metrics.jsonl`` (every scalar logged during training and evaluation) and
writes ``<run_dir>/report.md`` with

* the final value of each metric, grouped by the prefix before its first ``/`` (``train/``, then
  one per suite),
* each metric's value at every logged step of its suite's epoch-end evaluations (a trend table),
* ``report_curves.png``: the training loss and each suite's headline metrics against the step.

and ``<run_dir>/report.html`` (:func:`write_html`), one self-contained page -- plain HTML and CSS,
every image inlined as a ``data:`` URI, no script and no network reference -- with the sections

* ``summary``: the headline metrics' first and final values;
* ``training``: the training curves (losses, learning rates, rank diagnostics) and the headline
  evaluation curves against the step;
* one section per registered evaluation suite with a report renderer (``Suite.report``, the
  function ``(run_dir) -> str`` in the suite's ``report.py``), in the registry's order, titled
  ``Suite.title``: its metrics per evaluation, its figures and sample rows;
* ``config``: the resolved run config (``config.yaml``), flattened to dotted keys.

A suite's section reads ``<run_dir>/eval/<suite>/epoch-<n>/`` (epoch-end evaluation) or, for the
output folder of a standalone ``unicon evaluate``, the suite's files in the folder itself
(:func:`unicon.evaluation.html.suite_outputs`); the HTML pieces of every section come from
:mod:`unicon.evaluation.html`. This module names no suite: its sections and headline metrics
(``Suite.headline``) come from the suite registry, imported when a report is written, so
``unicon report --help`` does not load the suites. The
same summary is printed as rich tables. ``write_report`` (both files) is called at the end of
``unicon train``, which then prints :func:`headline_table`.

With ``--baseline RUN_K`` (another run, e.g. the control run K of a consistency run M), both files
start with the run against the baseline: the suites whose report module defines ``compare``
(:meth:`unicon.evaluation.framework.EvalSuite.report_module`, see :mod:`unicon.evaluation.suites`) each
give their rows, as text (``comparison_text``) and HTML (``comparison_html``); a baseline that no
suite can compare with the run is an error naming it.
"""

from __future__ import annotations

import argparse
import datetime
import io
import json
import math
import os
from collections import defaultdict
from pathlib import Path
from typing import Any, Sequence

from unicon.errors import UserError
from unicon.evaluation import html as h

#: the report's own sections before and after those of the suites: ``(id, title)``
OWN_SECTIONS = (("summary", "Summary"), ("training", "Training curves"))
LAST_SECTIONS = (("config", "Run config"),)


def headline() -> tuple[str, ...]:
    """The headline metrics (summary table, ``report_curves.png``): the training loss, then each
    registered suite's ``Suite.headline``, in the registry's order."""
    from unicon.evaluation.suites import suites  # lazy: the registry imports every suite's command

    return ("train/loss", *(key for s in suites().values() for key in s.headline))


def sections() -> tuple[tuple[str, str], ...]:
    """The sections of report.html, in page order: ``(id, title)``; a suite's id is its name."""
    from unicon.evaluation.suites import suites  # lazy: the registry imports every suite's command

    return (*OWN_SECTIONS, *((s.name, s.title or s.name) for s in suites().values() if s.report),
            *LAST_SECTIONS)


def collect(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """metric name -> [(step, value), ...] in logging order (unreadable lines are skipped and
    counted under ``report/unreadable_lines``)."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise UserError(f"{path} not found: is {run_dir} a unicon run directory?")
    series: dict[str, list[tuple[int, float]]] = defaultdict(list)
    rows, bad = h.read_rows(path)
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


def _report_modules(hook: str) -> list:
    """The report modules of the registered suites that define ``hook`` (e.g. ``compare``), in the
    registry's order."""
    from unicon.evaluation.suites import suites  # lazy: the registry imports every suite's command

    return [m for s in suites().values() if (m := s.report_module()) is not None and hasattr(m, hook)]


def headline_table(series: dict[str, list[tuple[int, float]]]) -> str | None:
    """The run's headline as plain text (printed at the end of ``unicon train``): each suite's
    ``headline_table``, in the registry's order; None when no suite has one for the run."""
    tables = [t for m in _report_modules("headline_table") if (t := m.headline_table(series))]
    return "\n\n".join(tables) if tables else None


def comparison_text(compared: list[tuple[Any, list]], run: str, baseline: str) -> str:
    """:func:`_compared` as plain text: each suite's ``comparison_text``."""
    return "\n\n".join(m.comparison_text(rows, run, baseline) for m, rows in compared)


def _fmt(v: float) -> str:
    return "nan" if math.isnan(v) else f"{v:.4g}"


def write_report(run_dir: str | Path, baseline: str | Path | None = None) -> Path:
    """Write ``report.md`` (+ ``report_curves.png``) and ``report.html`` (:func:`write_html`) into
    ``run_dir`` and return the path of ``report.md``. With ``baseline`` (another run folder, e.g.
    the control run K of a consistency run M), both files start with the run against it
    (:func:`_compared`)."""
    run_dir = Path(run_dir)
    series = collect(run_dir)
    compared = _compared(series, baseline)
    groups: dict[str, list[str]] = defaultdict(list)
    for key in sorted(series):
        groups[key.split("/", 1)[0] if "/" in key else "other"].append(key)

    lines = [f"# unicon report: {run_dir.name}", "", f"Run directory: `{run_dir}`", "",
             "The same run as one page with every figure: [report.html](report.html)", ""]
    if compared:
        lines += [f"## Against the baseline run `{baseline}`", "", "```",
                  comparison_text(compared[1], run_dir.name, Path(baseline).name), "```", ""]
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


def _compared(series: dict, baseline: str | Path | None) -> tuple[dict, list[tuple[Any, list]]] | None:
    """A run's series against the baseline run folder's (None without one): ``(baseline series,
    [(suite report module, its compare rows), ...])``, the suites with rows only; a baseline that
    no suite can compare is an error naming it, with each comparing suite's ``NOT_COMPARED``."""
    if baseline is None:
        return None
    base = collect(Path(baseline))
    modules = _report_modules("compare")
    compared = [(m, rows) for m in modules if (rows := m.compare(series, base))]
    if not compared:
        why = "; ".join(m.NOT_COMPARED for m in modules) or "no registered suite compares two runs"
        raise UserError(f"baseline {baseline}: {why}")
    return base, compared


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
    keys = [k for k in headline() if k in series]
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


def _section_comparison(baseline: str | Path | None, series: dict,
                        compared: tuple[dict, list[tuple[Any, list]]] | None) -> str:
    """The run against its baseline run (:func:`_compared`): each suite's ``comparison_html``."""
    if not compared:
        return ""
    base, found = compared
    return (f"<h3>Against the baseline run {h.esc(baseline)}</h3>"
            + "".join(m.comparison_html(rows, baseline, series, base) for m, rows in found))


def _section_summary(run_dir: Path, series: dict) -> str:
    keys = [k for k in headline() if k in series]
    run_id = (run_dir / "wandb_run_id").read_text().strip() if (run_dir / "wandb_run_id").is_file() else None
    rows = [[f"<td>{h.esc(k)}</td>", h.td(series[k][0][1]), h.td(series[k][-1][1]), h.td(len(series[k]))] for k in keys]
    out = h.table(["metric", "first", "final", "n"], rows, "headline") if rows else \
        '<p class="empty">No headline metric in metrics.jsonl.</p>'
    steps = max((s for vals in series.values() for s, _ in vals), default=0)
    out += f'<p class="note">Last logged step: {steps}. W&amp;B run id: {h.esc(run_id or "(none)")}.</p>'
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
        parts.append(h.figure_png(rho, "training/rho", "training-batch ρ per task: is the consistency objective "
                                 "moving what it optimises?"))
    if train:
        parts.append(h.figure_png(_curves_figure(series, train, 6, (2.6, 2.0)), "training/curves",
                                 "training metrics against step"))
    evals = [k for k in headline() if k in series and not k.startswith("train/")]
    if evals:
        parts.append(h.figure_png(_curves_figure(series, evals, 6, (2.6, 2.0)), "evaluation/curves",
                                 "headline evaluation metrics against step"))
    if not parts:
        return '<p class="empty">No training metric in metrics.jsonl.</p>'
    groups: dict[str, list[str]] = defaultdict(list)
    for key in sorted(series):
        groups[key.split("/", 1)[0] if "/" in key else "other"].append(key)
    tables = "".join(
        f"<details><summary>{h.esc(g)}: {len(keys)} metrics, first and final values</summary>"
        + h.table(["metric", "first", "final", "n"],
                 [[f"<td>{h.esc(k)}</td>", h.td(series[k][0][1]), h.td(series[k][-1][1]), h.td(len(series[k]))] for k in keys])
        + "</details>" for g, keys in groups.items())
    return '<div class="figures">' + "".join(parts) + "</div>" + tables


def _section_config(run_dir: Path) -> str:
    path = run_dir / "config.yaml"
    if not path.is_file():
        return '<p class="empty">No config.yaml in this folder (a standalone evaluation keeps its arguments in W&amp;B).</p>'
    from omegaconf import OmegaConf

    from unicon.loggers import flatten_config  # lazy: pulls in Lightning, not needed by unicon report

    try:
        flat = flatten_config(OmegaConf.load(path))
    except Exception as e:  # a hand-edited file: show it as text rather than fail the report
        return f'<p class="bad">{h.esc(path)}: {h.esc(e)}</p><pre>{h.esc(path.read_text(errors="replace"))}</pre>'
    rows = [[f"<td>{h.esc(k)}</td>", f'<td class="text">{h.esc(json.dumps(v) if not isinstance(v, str) else v)}</td>']
            for k, v in flat.items()]
    return h.table(["key", "value"], rows, "config")


def render_html(run_dir: Path, series: dict | None = None, baseline: str | Path | None = None) -> str:
    """The page of :func:`write_html` as a string."""
    run_dir = Path(run_dir)
    series = collect(run_dir) if series is None else series
    from unicon.evaluation.suites import suites  # lazy: the registry imports every suite's command

    bodies = {
        "summary": (_section_comparison(baseline, series, _compared(series, baseline))
                    + _section_summary(run_dir, series)),
        "training": _section_training(series),
        **{s.name: s.report_section()(run_dir) for s in suites().values() if s.report},
        "config": _section_config(run_dir),
    }
    nav = "".join(f'<a href="#{sid}">{h.esc(title)}</a>' for sid, title in sections())
    page = "".join(f'<section id="{sid}"><h2>{h.esc(title)}</h2>{bodies[sid]}</section>' for sid, title in sections())
    when = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>unicon report: {h.esc(run_dir.name)}</title><style>{CSS}</style></head><body>"
            f"<header><h1>unicon report: {h.esc(run_dir.name)}</h1><p>{h.esc(run_dir.resolve())} &middot; written {h.esc(when)}"
            f"</p></header><nav>{nav}</nav><main>{page}</main></body></html>\n")


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
        "training curves, each evaluation suite's results with their figures, the run config).",
    )
    parser.add_argument("run_dir", type=Path, help="a run directory, e.g. checkpoints/shapes_demo")
    parser.add_argument("--baseline", type=Path, default=None, metavar="RUN_DIR",
                        help="another run to compare with (e.g. the control run K of a consistency run M): "
                             "the metrics each evaluation suite compares (at each run's last epoch end), "
                             "and the change")
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
        _, compared = _compared(collect(args.run_dir), args.baseline)
        print(comparison_text(compared, args.run_dir.name, args.baseline.name))
    print(f"report: {report}")
    print(f"html:   {args.run_dir / 'report.html'}")
    return 0
