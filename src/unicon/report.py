"""``unicon report RUN_DIR``: a human summary of a run, from its files alone (no W&B needed).

Reads ``<run_dir>/metrics.jsonl`` (every scalar logged during training and evaluation) and
writes ``<run_dir>/report.md`` with

* the final value of each metric, grouped by suite (``train/``, ``cococon/``, ``drift/``, ...),
* each metric's value at every logged step of its suite's epoch-end evaluations (a trend table),
* ``report_curves.png``: the training loss and each suite's headline metrics against the step.

The same summary is printed as rich tables. ``write_report`` is called at the end of ``unicon train``.
"""

from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict
from pathlib import Path

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
)


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


def _fmt(v: float) -> str:
    return "nan" if math.isnan(v) else f"{v:.4g}"


def write_report(run_dir: str | Path) -> Path:
    """Write ``report.md`` (+ ``report_curves.png``) into ``run_dir`` and return its path."""
    run_dir = Path(run_dir)
    series = collect(run_dir)
    groups: dict[str, list[str]] = defaultdict(list)
    for key in sorted(series):
        groups[key.split("/", 1)[0] if "/" in key else "other"].append(key)

    lines = [f"# unicon report: {run_dir.name}", "", f"Run directory: `{run_dir}`", ""]
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
    out.write_text("\n".join(lines))
    return out


def _plot(run_dir: Path, series: dict) -> Path | None:
    keys = [k for k in HEADLINE if k in series]
    if not keys:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(5, len(keys))
    rows = -(-len(keys) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 2.6 * rows), squeeze=False)
    for ax in axes.flat[len(keys):]:
        ax.axis("off")
    for ax, k in zip(axes.flat, keys):
        steps, vals = zip(*series[k])
        ax.plot(steps, vals, marker="o" if len(vals) < 30 else None, ms=3)
        ax.set_title(k, fontsize=8)
        ax.set_xlabel("step", fontsize=7)
        ax.tick_params(labelsize=7)
    fig.tight_layout()
    path = run_dir / "report_curves.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


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
        "writes <run_dir>/report.md and report_curves.png.",
    )
    parser.add_argument("run_dir", type=Path, help="a run directory, e.g. checkpoints/shapes_demo")
    args = parser.parse_args(argv)
    if not args.run_dir.is_dir():
        raise UserError(f"{args.run_dir} is not a directory")
    print_summary(args.run_dir)
    print(f"report: {write_report(args.run_dir)}")
    return 0
