"""Progress of long loops (drift chains, image generation, judging, scoring) on a terminal and in logs.

``for batch in track(batches, "cococon: scoring"): ...`` shows

* on a terminal, a rich progress bar (description, bar, done/total, elapsed, time left), nested
  under Lightning's ``RichProgressBar`` during an epoch-end evaluation (rich nests live displays);
* when the output is not a terminal (a SLURM log, a pipe, a CI log), plain lines on stderr::

      drift: text-first chains: 2/5 generations (40%), 0:01:02 elapsed, ~0:01:33 left
      drift: text-first chains: 5/5 generations (100%) in 0:02:35

  one each time ``every_seconds`` have passed since the last one (or the start), and one at the
  end: a loop shorter than ``every_seconds`` writes one line.

A loop is a stage: a ``track`` inside another one (drift's batches within a generation of its
chains) reports nothing, so a stage shows one bar, or its few lines. Only rank zero of a process
group reports (every rank runs the same loop on its shard).
``$UNICON_PROGRESS`` chooses: ``auto`` (default: bars on a terminal, lines otherwise), ``rich``,
``plain`` or ``off``.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Iterable, Iterator, TextIO, TypeVar

T = TypeVar("T")

MODES = ("auto", "rich", "plain", "off")
ENV = "UNICON_PROGRESS"
_clock = time.monotonic  # replaced in tests
_depth = 0  # the tracks running in this process, outermost first: only the outermost one reports


def progress_mode(mode: str | None = None) -> str:
    """``rich``, ``plain`` or ``off``: ``mode``, else ``$UNICON_PROGRESS``, else ``auto``, where
    ``auto`` means ``rich`` when rich's console writes to a terminal and ``plain`` otherwise."""
    mode = (mode or os.environ.get(ENV) or "auto").strip().lower()
    if mode not in MODES:
        raise ValueError(f"${ENV} must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "auto":
        from rich import get_console

        return "rich" if get_console().is_terminal else "plain"
    return mode


def _rank() -> int:
    """This process's rank in the default process group (0 without one); ``$RANK`` before it is made.
    (A process group exists only where ``torch.distributed`` was imported: no import here.)"""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def _hms(seconds: float) -> str:
    seconds = int(max(0.0, seconds) + 0.5)
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def track(iterable: Iterable[T], description: str, total: int | None = None, *, unit: str = "",
          every_seconds: float = 60.0, mode: str | None = None, stream: TextIO | None = None,
          console=None) -> Iterator[T]:
    """Yield the items of ``iterable`` while reporting progress (see the module docstring).

    ``total`` defaults to ``len(iterable)`` where it has one; ``unit`` names the items in plain
    lines (``"batches"``); ``stream`` (plain lines, default ``sys.stderr``) and ``console`` (a rich
    ``Console`` for the bar, default rich's global one, which Lightning's bar uses too) are for
    tests. Breaking out of the loop closes the bar or writes the last line."""
    global _depth
    if every_seconds <= 0:
        raise ValueError(f"every_seconds must be > 0, got {every_seconds}")
    if total is None:
        try:
            total = len(iterable)  # type: ignore[arg-type]
        except TypeError:
            total = None
    chosen = progress_mode(mode)
    if chosen == "off" or _rank() != 0 or _depth:
        yield from iterable
        return
    _depth += 1
    try:
        if chosen == "rich":
            yield from _rich(iterable, description, total, console)
        else:
            yield from _plain(iterable, description, total, unit, every_seconds, stream)
    finally:
        _depth -= 1


def _rich(iterable: Iterable[T], description: str, total: int | None, console) -> Iterator[T]:
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn,
                               TimeElapsedColumn, TimeRemainingColumn)

    columns = [SpinnerColumn(), TextColumn("[progress.description]{task.description}"), BarColumn(),
               MofNCompleteColumn(), TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn()]
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task(description, total=total)
        for item in iterable:
            yield item
            progress.advance(task)


def _plain(iterable: Iterable[T], description: str, total: int | None, unit: str, every_seconds: float,
           stream: TextIO | None) -> Iterator[T]:
    out = stream or sys.stderr
    unit = f" {unit}" if unit else ""

    def write(line: str) -> None:
        out.write(f"{description}: {line}\n")
        out.flush()

    start = last = _clock()
    done = 0
    try:
        for item in iterable:
            yield item
            done += 1
            now = _clock()
            if now - last < every_seconds or (total and done >= total):  # the closing line says it
                continue
            if total:
                left = (now - start) / done * (total - done)
                write(f"{done}/{total}{unit} ({100.0 * done / total:.0f}%), {_hms(now - start)} elapsed, "
                      f"~{_hms(left)} left")
            else:
                write(f"{done}{unit}, {_hms(now - start)} elapsed")
            last = now
    finally:
        elapsed = _hms(_clock() - start)
        if total is None:
            write(f"{done}{unit} in {elapsed}")
        elif done >= total:
            write(f"{done}/{total}{unit} (100%) in {elapsed}")
        else:
            write(f"stopped at {done}/{total}{unit} after {elapsed}")
