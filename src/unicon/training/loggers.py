"""Experiment loggers: W&B (or CSV) plus a local ``metrics.jsonl`` that always exists.

``make_loggers(cfg, run_dir)`` returns the Lightning loggers of a run:

* ``WandbLogger`` (``logger.type=wandb``, the default) or ``CSVLogger`` (``logger.type=csv``);
* :class:`JsonlLogger`, which appends every scalar to ``<run_dir>/metrics.jsonl`` so that tests,
  ``unicon report`` and users read the numbers back without W&B.

W&B mode: ``logger.mode`` if set, else ``$WANDB_MODE``, else ``online`` when an API key is
configured (``$WANDB_API_KEY`` or a ``~/.netrc`` entry for api.wandb.ai) and ``offline``
otherwise. Offline runs land in ``<run_dir>/wandb/offline-run-*``; sync them later with
``wandb sync <run_dir>/wandb/offline-run-*`` -- the usual practice on SLURM clusters without
internet. ``$WANDB_PROJECT`` is respected when ``logger.project`` is unset.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any, Mapping

from lightning.pytorch.loggers import CSVLogger, Logger, WandbLogger
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
    run_dir = Path(run_dir)
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
        loggers.append(CSVLogger(save_dir=str(run_dir), name="csv", version=""))
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
