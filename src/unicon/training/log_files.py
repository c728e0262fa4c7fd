"""A resumed run's metric files, consistent with its checkpoint: :class:`LogFilesCallback`.

Every checkpoint records how many bytes of ``metrics.jsonl`` and how many lines of ``csv/metrics.csv``
existed when it was written; a resume trims each file back to that prefix plus the later rows of
steps before the restored step (the details: the docstring of :mod:`unicon.loggers`).
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter

from unicon.loggers import JsonlLogger, atomic_write


def _rows_before(lines: list[bytes], step_of, restored_step: int) -> tuple[list[bytes], int]:
    """The complete rows among ``lines`` whose step (``step_of(line)``: an int, or None for a row
    that cannot be read, e.g. one cut by a kill) is below ``restored_step``, and how many were dropped."""
    kept, dropped = [], 0
    for line in lines:
        if not line.strip():
            continue
        step = step_of(line)
        if step is not None and step < restored_step:
            kept.append(line)
        else:
            dropped += 1
    return kept, dropped


def _jsonl_step(line: bytes) -> int | None:
    try:
        row = json.loads(line)
    except ValueError:
        return None
    return row["step"] if isinstance(row, dict) and isinstance(row.get("step"), int) else None


def _trim_jsonl(path: Path, keep_bytes: int, restored_step: int) -> int:
    """Keep the first ``keep_bytes`` of a JSONL file (cut back to a complete line; a line the cut
    fell inside is judged with the rest) plus later rows whose step is below ``restored_step``;
    returns the number of rows dropped."""
    data = path.read_bytes()
    head = data[:keep_bytes]
    if head and not head.endswith(b"\n"):
        head = head[: head.rfind(b"\n") + 1]
    kept, dropped = _rows_before(data[len(head):].split(b"\n"), _jsonl_step, restored_step)
    atomic_write(path, head + b"".join(line + b"\n" for line in kept))
    return dropped


def _trim_csv(path: Path, keep_lines: int, restored_step: int) -> int:
    """:func:`_trim_jsonl` for Lightning's ``metrics.csv`` (column ``step``), keeping the first
    ``keep_lines`` lines (the header included) rather than a byte prefix."""
    lines = path.read_bytes().split(b"\n")
    cut = 1 if lines[-1].strip() else 0  # whatever follows the last newline is a row cut by the kill
    keep_lines = max(keep_lines, 1)  # the header stays, even for a checkpoint written before any row
    head, tail = lines[:-1][:keep_lines], lines[:-1][keep_lines:]
    header = next(csv.reader(io.StringIO(head[0].decode() if head else "")), [])

    def step_of(line: bytes) -> int | None:
        row = next(csv.reader(io.StringIO(line.decode(errors="replace"))), [])
        if len(row) != len(header) or "step" not in header:
            return None
        try:
            return int(float(row[header.index("step")]))
        except ValueError:
            return None

    kept, dropped = _rows_before(tail, step_of, restored_step)
    atomic_write(path, b"".join(line + b"\n" for line in head + kept))
    return dropped + cut


class LogFilesCallback(Callback):
    """Keeps the run's metric files consistent with its checkpoints (see the module docstring)."""

    KEY = "unicon_log_bytes"

    def __init__(self, loggers: list):
        self.files: dict[str, tuple[Any, Path]] = {}
        for lg in loggers:
            if isinstance(lg, JsonlLogger):
                self.files["jsonl"] = (lg, lg.path)
            elif isinstance(lg, CSVLogger):
                self.files["csv"] = (lg, Path(lg.log_dir) / ExperimentWriter.NAME_METRICS_FILE)
        self.dropped: dict[str, int] = {}

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        sizes = {}
        for key, (lg, path) in self.files.items():
            if isinstance(lg, CSVLogger):
                if trainer.is_global_zero:
                    lg.save()  # flush the rows buffered so far, so the file holds every row before this point
                sizes["csv_lines"] = path.read_bytes().count(b"\n") if path.is_file() else 0
            else:
                sizes[key] = path.stat().st_size if path.is_file() else 0
        checkpoint[self.KEY] = sizes

    def on_load_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        sizes = checkpoint.get(self.KEY)
        if not trainer.is_global_zero or sizes is None:
            return
        step = int(checkpoint.get("global_step", 0))
        for key, (lg, path) in self.files.items():
            if not path.is_file():
                continue
            if key == "jsonl" and "jsonl" in sizes:
                self.dropped[key] = _trim_jsonl(path, int(sizes["jsonl"]), step)
            elif key == "csv" and "csv_lines" in sizes:
                self.dropped[key] = _trim_csv(path, int(sizes["csv_lines"]), step)
            else:
                continue
            if self.dropped[key]:
                print(f"resume: dropped {self.dropped[key]} row(s) of {path} written after the checkpoint")
