"""The HTML pieces of ``report.html`` that every suite's section is built from.

``unicon report`` (:mod:`unicon.report`) writes the page; each evaluation suite renders its own
section (``EvalSuite.report = "module:function"``, a function ``(run_dir) -> str`` in the
suite's ``report.py``) from these helpers: escaping and number formatting, tables, inlined images
and figures, and finding the suite's outputs in a run folder (:func:`suite_outputs`). Every image
is inlined as a ``data:`` URI; every piece of text is escaped here, so a section passes only
already-escaped HTML around.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
import re
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

from unicon.errors import UserError

#: how many sample rows (or chain strips) a suite's section shows per evaluation
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


def esc(value: Any) -> str:
    return html.escape("" if value is None else str(value), quote=True)


def num(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return esc(value if value is not None else "-")
    return "nan" if isinstance(value, float) and math.isnan(value) else f"{value:.4g}"


def data_uri(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode('ascii')}"


#: sample images are inlined at most this many pixels a side (COCO photos are 640)
THUMB_SIDE = 192


def img(path: Path, alt: str, cls: str = "", key: str | None = None, max_side: int | None = None) -> str:
    """An ``<img>`` with the file inlined (downscaled to ``max_side`` pixels a side, as PNG, when it
    is larger), or a visible note when the file is missing or unreadable (never a broken image)."""
    if not path.is_file():
        return f'<span class="empty">missing: {esc(path.name)}</span>'
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
            return f'<span class="empty">unreadable image {esc(path.name)}: {esc(e)}</span>'
    attrs = f' class="{cls}"' if cls else ""
    attrs += f' data-key="{esc(key)}"' if key else ""
    return f'<img src="{data_uri(data, mime)}" alt="{esc(alt)}"{attrs}>'


def figure_png(fig, key: str, caption: str, data: Any = None) -> str:
    """A matplotlib figure inlined as PNG; ``data`` (JSON-able, e.g. the plotted points) goes into
    the figure's ``data-series`` attribute as JSON, for a reader or a test of what was drawn."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    attrs = "" if data is None else f' data-series="{esc(json.dumps(data, allow_nan=False))}"'
    return (f'<figure data-key="{esc(key)}"{attrs}><img src="{data_uri(buf.getvalue())}" alt="{esc(caption)}">'
            f"<figcaption>{esc(caption)}</figcaption></figure>")


def figure_file(path: Path, key: str, caption: str) -> str:
    return f'<figure data-key="{esc(key)}">{img(path, caption)}<figcaption>{esc(caption)}</figcaption></figure>'


def table(header: Sequence[str], rows: Iterable[Sequence[str]], cls: str = "") -> str:
    """A table from already-escaped cell HTML."""
    head = "".join(f"<th>{h}</th>" for h in header)
    body = "".join("<tr>" + "".join(cells) + "</tr>" for cells in rows)
    return f'<table class="{cls}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def td(value: Any) -> str:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return f'<td class="num">{num(value)}</td>'
    return f'<td class="text">{esc(value)}</td>'


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except ValueError as e:
        raise UserError(f"{path}: not valid JSON ({e})") from None


def read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return read_rows(path)[0]


def suite_outputs(run_dir: Path, suite: str, summary: str) -> list[tuple[str, Path]]:
    """``[(label, folder), ...]`` of a suite's evaluations in ``run_dir``: ``("epoch 1",
    <run_dir>/eval/<suite>/epoch-1)``, ... in epoch order, or ``[("", run_dir)]`` when ``run_dir``
    is a standalone evaluation's output folder of that suite. A folder counts when it holds the
    suite's summary file ``summary`` (e.g. ``results.json``)."""
    found = []
    for d in (run_dir / "eval" / suite).glob("epoch-*"):
        m = re.fullmatch(r"epoch-(\d+)", d.name)
        if m and (d / summary).is_file():
            found.append((int(m.group(1)), d))
    if found:
        return [(f"epoch {n}", d) for n, d in sorted(found)]
    return [("", run_dir)] if (run_dir / summary).is_file() else []


def not_evaluated(suite: str, summary: str) -> str:
    """The body of a suite's section when :func:`suite_outputs` finds no evaluation."""
    return (f'<p class="empty">No {suite} evaluation in this run (neither eval/{suite}/epoch-*/'
            f"{summary} nor {summary}).</p>")


def figures(out: Path, suite: str, label: str, names: Sequence[str]) -> str:
    """The figures ``<out>/<name>.png`` of ``names`` that exist (as the suite logs them to W&B)."""
    return '<div class="figures">' + "".join(
        figure_file(out / f"{name}.png", f"{suite}/fig/{name}", f"{name} ({label or 'evaluation'})")
        for name in names if (out / f"{name}.png").is_file()) + "</div>"


def trend(evals: list[tuple[str, Path]], summary: str, columns: Mapping[str, Callable[[dict], Any]], cls: str) -> str:
    """One row per evaluation of :func:`suite_outputs`: its label, then each column's value, read by
    ``columns[header]`` from the evaluation's summary file ``summary`` (``{}`` when unreadable)."""
    rows = []
    for label, out in evals:
        results = read_json(out / summary) or {}
        rows.append([f"<td>{esc(label or '-')}</td>", *(td(read(results)) for read in columns.values())])
    return table(["evaluation", *columns], rows, cls)


def metric(key: str) -> Callable[[dict], Any]:
    """A :func:`trend` column: ``results["metrics"][key]`` (None where missing)."""
    return lambda results: (results.get("metrics") or {}).get(key)


def section(run_dir: Path, suite: str, summary: str, render, columns: Mapping[str, Any] | None = None) -> str:
    """A suite's section: its evaluations in ``run_dir`` (:func:`suite_outputs` of the summary file
    ``summary``; none: :func:`not_evaluated`), their :func:`trend` over ``columns`` (a column given as a
    string is that :func:`metric`), then :func:`earlier` with ``render(label, folder)``."""
    evals = suite_outputs(run_dir, suite, summary)
    if not evals:
        return not_evaluated(suite, summary)
    columns = {header: metric(c) if isinstance(c, str) else c for header, c in (columns or {}).items()}
    return (trend(evals, summary, columns, f"{suite}-trend") if columns else "") + earlier(evals, render)


def earlier(evals: list[tuple[str, Path]], render) -> str:
    """The last evaluation in full; earlier ones folded under ``<details>``."""
    parts = []
    for label, out in evals[:-1]:
        parts.append(f"<details><summary>{esc(label)}</summary>{render(label, out)}</details>")
    label, out = evals[-1]
    return f"<h3>{esc(label or 'Evaluation')}</h3>" + render(label, out) + "".join(parts)

