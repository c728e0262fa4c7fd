"""Experiment loggers: W&B (or CSV) plus a local ``metrics.jsonl`` that always exists.

``make_loggers(cfg, run_dir)`` returns the Lightning loggers of a run:

* ``WandbLogger`` (``logger.type=wandb``, the default) or ``CSVLogger`` (``logger.type=csv``);
* :class:`JsonlLogger`, which appends every scalar to ``<run_dir>/metrics.jsonl`` so that tests,
  ``unicon report`` and users read the numbers back without W&B. The file exists from the start.

A resumed run continues the same files: :class:`LogFilesCallback` records in every checkpoint how
many bytes of ``metrics.jsonl`` and ``csv/metrics.csv`` existed when it was written; on resume
each file keeps those bytes plus the later rows of steps before the restored step (Lightning logs
a step's metrics just after an on-batch-end checkpoint), and loses the rows a killed run wrote
after its checkpoint, including a partial last line. Nothing written before the checkpoint is lost.

W&B mode: ``logger.mode`` if set, else ``$WANDB_MODE``, else ``online`` when an API key is
configured (``$WANDB_API_KEY`` or a ``~/.netrc`` entry for api.wandb.ai) and ``offline``
otherwise. Offline runs land in ``<run_dir>/wandb/offline-run-*``; sync them later with
``wandb sync <run_dir>/wandb/offline-run-*`` -- the usual practice on SLURM clusters without
internet. ``$WANDB_PROJECT`` is respected when ``logger.project`` is unset.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import time
from pathlib import Path
from typing import Any, Mapping

from lightning.pytorch import Callback
from lightning.pytorch.loggers import CSVLogger, Logger, WandbLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.utilities import rank_zero_only

from unicon.data.jsonl import read_jsonl
from unicon.errors import UserError


class JsonlLogger(Logger):
    """Appends ``{"step": s, "time": t, "<name>": value, ...}`` lines to ``metrics.jsonl``.

    Only finite-or-not scalars are written (NaN/inf are written as strings so that the
    file stays valid JSON). Rank-zero only under DDP, like every Lightning logger.
    """

    def __init__(self, run_dir: str | Path, filename: str = "metrics.jsonl"):
        super().__init__()
        self._run_dir = Path(run_dir)
        self.path = self._run_dir / filename
        if rank_zero_only.rank == 0:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.touch()

    @property
    def name(self) -> str:
        return "jsonl"

    @property
    def version(self) -> str:
        return "0"

    @property
    def save_dir(self) -> str:
        return str(self._run_dir)

    @property
    def log_dir(self) -> str:
        return str(self._run_dir)

    @rank_zero_only
    def log_hyperparams(self, params: Any, *args, **kwargs) -> None:  # config.yaml holds them
        pass

    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        row: dict[str, Any] = {"step": step, "time": round(time.time(), 3)}
        for key, value in metrics.items():
            value = float(value.item() if hasattr(value, "item") else value)
            row[key] = value if math.isfinite(value) else str(value)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")


def read_metrics(path: str | Path) -> list[dict]:
    """Read ``metrics.jsonl`` back (one dict per logged call)."""
    return [row for _, row in read_jsonl(path, UserError, "metrics file")]


class _KeepingCSVWriter(ExperimentWriter):
    """Lightning's CSV writer deletes an existing ``metrics.csv`` when it starts; this one appends
    to it (a resumed run), keeping its columns."""

    def _check_log_dir_exists(self) -> None:
        if self._fs.isfile(self.metrics_file_path):
            with self._fs.open(self.metrics_file_path, "r", newline="") as f:
                self.metrics_keys = sorted(next(csv.reader(f), []))


class KeepingCSVLogger(CSVLogger):
    """``CSVLogger`` that appends to the run's ``metrics.csv`` instead of deleting it on resume."""

    @property
    def experiment(self) -> ExperimentWriter:
        if self._experiment is None:
            os.makedirs(self.root_dir, exist_ok=True)
            self._experiment = _KeepingCSVWriter(log_dir=self.log_dir)
        return self._experiment


def _trim_jsonl(path: Path, keep_bytes: int, restored_step: int) -> int:
    """Keep the first ``keep_bytes`` of a JSONL file plus later complete rows whose step is below
    ``restored_step``; returns the number of rows dropped."""
    data = path.read_bytes()
    head, tail = data[:keep_bytes], data[keep_bytes:]
    kept, dropped = [], 0
    for line in tail.split(b"\n"):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            ok = isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] < restored_step
        except ValueError:  # a line cut by the kill
            ok = False
        if ok:
            kept.append(line + b"\n")
        else:
            dropped += 1
    if not head.endswith(b"\n") and head:
        head = head[: head.rfind(b"\n") + 1]
    _atomic_write(path, head + b"".join(kept))
    return dropped


def _trim_csv(path: Path, keep_bytes: int, restored_step: int) -> int:
    """:func:`_trim_jsonl` for Lightning's ``metrics.csv`` (column ``step``)."""
    data = path.read_bytes()
    head, tail = data[:keep_bytes], data[keep_bytes:]
    if not head.endswith(b"\n") and head:
        head = head[: head.rfind(b"\n") + 1]
    header = next(csv.reader(io.StringIO(head.decode() or data.decode())), [])
    kept, dropped = [], 0
    for line in tail.split(b"\n"):
        if not line.strip():
            continue
        row = next(csv.reader(io.StringIO(line.decode(errors="replace"))), [])
        ok = len(row) == len(header) and "step" in header
        if ok:
            try:
                ok = int(float(row[header.index("step")])) < restored_step
            except ValueError:
                ok = False
        if ok:
            kept.append(line + b"\n")
        else:
            dropped += 1
    _atomic_write(path, head + b"".join(kept))
    return dropped


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


class LogFilesCallback(Callback):
    """Keeps the run's metric files consistent with its checkpoints (see the module docstring)."""

    KEY = "unicon_log_bytes"

    def __init__(self, loggers: list[Logger]):
        self.files: dict[str, tuple[Logger, Path]] = {}
        for lg in loggers:
            if isinstance(lg, JsonlLogger):
                self.files["jsonl"] = (lg, lg.path)
            elif isinstance(lg, CSVLogger):
                self.files["csv"] = (lg, Path(lg.log_dir) / ExperimentWriter.NAME_METRICS_FILE)
        self.dropped: dict[str, int] = {}

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        sizes = {}
        for key, (lg, path) in self.files.items():
            if isinstance(lg, CSVLogger) and trainer.is_global_zero:
                lg.save()  # flush the rows buffered so far, so the file holds every row before this point
            sizes[key] = path.stat().st_size if path.is_file() else 0
        checkpoint[self.KEY] = sizes

    def on_load_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        sizes = checkpoint.get(self.KEY)
        if not trainer.is_global_zero or sizes is None:
            return
        step = int(checkpoint.get("global_step", 0))
        for key, (lg, path) in self.files.items():
            if path.is_file() and key in sizes:
                trim = _trim_jsonl if key == "jsonl" else _trim_csv
                self.dropped[key] = trim(path, int(sizes[key]), step)
                if self.dropped[key]:
                    print(f"resume: dropped {self.dropped[key]} row(s) of {path} written after the checkpoint")


def wandb_mode(configured: str | None = None) -> str:
    """Resolve the W&B mode (see module docstring)."""
    mode = configured or os.environ.get("WANDB_MODE")
    if mode:
        if mode == "dryrun":
            mode = "offline"
        if mode not in ("online", "offline", "disabled"):
            raise UserError(f"logger.mode / WANDB_MODE must be online, offline or disabled, got {mode!r}")
        return mode
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    netrc = Path.home() / ".netrc"
    if netrc.is_file() and "api.wandb.ai" in netrc.read_text(errors="ignore"):
        return "online"
    return "offline"


def make_loggers(cfg: Any, run_dir: str | Path, name: str | None = None) -> list[Logger]:
    """The loggers of a run: [W&B or CSV, JsonlLogger]. ``cfg`` is a RunConfig (or its ``logger`` section)."""
    # absolute: W&B writes from its own service process, whose working directory may be another one
    run_dir = Path(run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    lcfg = cfg.logger if hasattr(cfg, "logger") else cfg
    name = name or getattr(cfg, "name", None) or run_dir.name
    loggers: list[Logger] = []
    if lcfg.type == "wandb":
        mode = wandb_mode(lcfg.mode)
        if mode != "disabled":
            project = lcfg.project or os.environ.get("WANDB_PROJECT") or "unicon"
            loggers.append(
                WandbLogger(
                    name=name,
                    project=project,
                    entity=lcfg.entity,
                    save_dir=str(run_dir),
                    tags=list(lcfg.tags or []),
                    mode=mode,
                    settings={"silent": True} if mode == "offline" else None,
                )
            )
    elif lcfg.type == "csv":
        loggers.append(KeepingCSVLogger(save_dir=str(run_dir), name="csv", version=""))
    elif lcfg.type != "none":
        raise UserError(f"logger.type must be wandb, csv or none, got {lcfg.type!r}")
    loggers.append(JsonlLogger(run_dir))
    return loggers


def wandb_run_dir(loggers: list[Logger]) -> str | None:
    """Directory of the W&B run, if any (printed at the end of a run)."""
    for lg in loggers:
        if isinstance(lg, WandbLogger):
            try:
                return str(Path(lg.experiment.dir).parent)
            except Exception:  # wandb failed to start; the error was already logged
                return None
    return None
