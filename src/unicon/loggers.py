"""Experiment loggers: W&B (or CSV) plus a local ``metrics.jsonl`` that always exists.

``make_loggers(cfg, run_dir)`` returns the loggers of a run:

* ``WandbLogger`` (``logger.type=wandb``, the default) or ``CSVLogger`` (``logger.type=csv``);
* :class:`JsonlLogger`, which appends every scalar to ``<run_dir>/metrics.jsonl`` so that tests,
  ``unicon report`` and users read the numbers back without W&B. The file exists from the start.

This module does not import Lightning (six seconds and more of imports): the loggers built on
Lightning's classes (:class:`~unicon.lightning_loggers.UniconWandbLogger`,
:class:`~unicon.lightning_loggers.KeepingCSVLogger`) live in :mod:`unicon.lightning_loggers`, which
:func:`make_loggers` imports when it makes one. :class:`JsonlLogger` implements the part of
Lightning's ``Logger`` interface that a Trainer calls, without deriving from it, so that a standalone
evaluation with ``--logger none`` logs without Lightning. Rank zero is the one Lightning's
``rank_zero_only`` sees (:func:`global_rank`).

A resumed run continues the same files: :class:`unicon.training.log_files.LogFilesCallback` records
in every checkpoint how many bytes of ``metrics.jsonl`` and how many lines of ``csv/metrics.csv``
existed when it was written (lines, not bytes: Lightning's CSV writer rewrites the whole file under
a wider header when a new key appears, which moves every byte offset but keeps the rows and their
order). On resume each file keeps that prefix plus the later rows of steps before the restored step
(Lightning logs a step's metrics just after an on-batch-end checkpoint), and loses the rows a killed
run wrote after its checkpoint, including a partial last line. Nothing written before the checkpoint
is lost.

W&B mode: ``logger.mode`` if set, else ``$WANDB_MODE``, else ``online`` when an API key is
configured (``$WANDB_API_KEY`` or a ``~/.netrc`` entry for api.wandb.ai) and ``offline``
otherwise. Offline runs land in ``<run_dir>/wandb/offline-run-*``; sync them later with
``wandb sync <run_dir>/wandb/offline-run-*`` -- the usual practice on SLURM clusters without
internet. ``$WANDB_PROJECT`` is respected when ``logger.project`` is unset.

What reaches W&B (:class:`~unicon.lightning_loggers.UniconWandbLogger`, Lightning's ``WandbLogger``
plus the points below):

* **One step axis.** Everything -- scalars, tables, figures, charts -- goes through
  ``WandbLogger.log_metrics(values, step)``, which logs ``{**values, "trainer/global_step": step}``
  as a new history row and lets W&B number its own ``_step``; charts plot against
  ``trainer/global_step`` (Lightning's ``define_metric("*", step_metric=...)``). Nothing passes
  ``step=`` to ``wandb.log``: W&B drops rows whose explicit step is below its current one, which is
  how epoch-end tables used to vanish after Lightning had logged the epoch's scalars.
  :mod:`unicon.evaluation.logs` holds the helpers the suites call (``log_table``,
  ``log_figures``, ``log_wandb``).
* **Summaries.** The first time a key is logged that matches
  :data:`~unicon.lightning_loggers.SUMMARY_RULES` (CocoCon ``C_k``/``acc@k``/``rho``, drift
  ``MCD``/``MGG``/drift rate, UReason accuracies, training losses), it gets
  ``define_metric(key, summary="max,last")`` (or ``"min,last"`` where lower is better), so the runs
  table can sort on the best and the last value.
* **Run config.** :func:`log_run_config` sends the resolved RunConfig, flattened to dotted keys
  (``model.backend``, ``loss.lambda_``, ``optim.lr``, ...), with :func:`environment_info` (git
  commit and dirtiness of the checkout unicon runs from, when it runs from one; python, torch,
  lightning, transformers, wandb and unicon versions) and the weights fingerprint
  (:func:`unicon.core.weights_fingerprint`; ``weights.fingerprint``: the weights a fresh run
  starts from, i.e. the ``init_from`` checkpoint's, with LoRA adapters when they are added;
  ``weights.resume_fingerprint``: those of the checkpoint a resumed run restarts from, leaving the
  first part's ``weights.fingerprint`` in place). ``log_hyperparams`` of the other loggers
  receives the same dict (the CSV logger writes it to ``csv/hparams.yaml``).
* **Resume.** A training run's W&B id is stored in ``<run_dir>/wandb_run_id`` when its loggers are
  made (:func:`persistent_run_id`) and reused, with ``resume="allow"``, by every later process in
  the same run folder: ``resume=<ckpt>`` and a SLURM requeue continue the same W&B run. (A folder
  only holds an earlier run's files when that run is resumed; ``overwrite=true`` deletes the file
  with the rest.) Offline, each process writes its own ``offline-run-*`` folder with that id; sync
  them in order. ``finalize("success"|"failed")`` (the end of ``Trainer.fit``, or of a standalone
  evaluation) finishes the W&B run, so that a second run in the same process (``unicon experiment
  table2``, tests) gets its own W&B run instead of Lightning reusing the first one.
* **Artifacts** (opt-in: ``logger.log_model=true``). At the end of a training run
  :func:`log_run_artifacts` logs ``<name>-export`` (type ``model``: the ``save_pretrained`` folder)
  and ``<name>-eval`` (type ``evaluation``: ``eval/<suite>/epoch-<n>/``, ``tables/`` and
  ``metrics.jsonl``), each with the resolved run config (nested, under ``config``: W&B allows 100
  top-level metadata keys), :func:`environment_info` and ``trainer/global_step`` as metadata and
  the aliases ``latest`` and ``step-<global step>``; a resumed run logs new versions. The W&B
  run is then finished (``finalize("success")`` leaves it open for them). W&B copies the files to
  its staging folder (``$WANDB_DATA_DIR``, default ``~/.local/share/wandb``) until they are
  uploaded (offline: by ``wandb sync``), so the export is on disk twice until then. Lightning's own
  checkpoint logging (``WandbLogger(log_model=...)``) stays off: checkpoints carry optimizer state.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import json
import math
import os
import platform
import re
import secrets
import string
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Mapping

import unicon
from unicon.core import weights_fingerprint
from unicon.data.jsonl import read_jsonl
from unicon.errors import UserError


#: the launcher's variables that hold a process's global rank, in the order Lightning reads them
LAUNCHER_RANKS = ("RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK")


def global_rank() -> int:
    """This process's global rank, as Lightning's ``rank_zero_only`` has it (a Trainer sets it) where
    Lightning is imported; else as Lightning would read it: the first of :data:`LAUNCHER_RANKS`
    that is set, else 0. Imports nothing."""
    rank_zero = sys.modules.get("lightning_utilities.core.rank_zero")
    rank = getattr(getattr(rank_zero, "rank_zero_only", None), "rank", None)
    if rank is not None:
        return int(rank)
    for key in LAUNCHER_RANKS:
        if os.environ.get(key) is not None:
            return int(os.environ[key])
    return 0


def on_rank_zero(fn: Callable) -> Callable:
    """``fn`` runs on global rank zero only (:func:`global_rank`) and returns None on the other ranks,
    as under Lightning's ``rank_zero_only``."""

    @functools.wraps(fn)
    def on_zero(*args, **kwargs):
        return fn(*args, **kwargs) if global_rank() == 0 else None

    return on_zero


def is_wandb(logger: Any) -> bool:
    """Whether ``logger`` is a Lightning ``WandbLogger``. Imports nothing: where Lightning's loggers
    are not imported, no logger is one."""
    module = sys.modules.get("lightning.pytorch.loggers")
    return module is not None and isinstance(logger, module.WandbLogger)


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``path`` whole or not at all (a temporary file beside it, then a rename)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


class JsonlLogger:
    """Appends ``{"step": s, "time": t, "<name>": value, ...}`` lines to ``metrics.jsonl``.

    Only finite-or-not scalars are written (NaN/inf are written as strings so that the
    file stays valid JSON). Rank-zero only under DDP, like every Lightning logger.

    The methods and properties of Lightning's ``Logger`` that a Trainer calls (``name``, ``version``,
    ``save_dir``, ``log_dir``, ``log_metrics``, ``log_hyperparams``, ``save``, ``finalize``, ...), with
    Lightning's defaults where this logger has nothing to do, and no Lightning base class.
    """

    def __init__(self, run_dir: str | Path, filename: str = "metrics.jsonl"):
        self._run_dir = Path(run_dir)
        self.path = self._run_dir / filename
        if global_rank() == 0:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.touch()

    @property
    def name(self) -> str:
        return "jsonl"

    @property
    def version(self) -> str:
        return "0"

    @property
    def root_dir(self) -> str | None:
        return None

    @property
    def save_dir(self) -> str:
        return str(self._run_dir)

    @property
    def log_dir(self) -> str:
        return str(self._run_dir)

    @property
    def group_separator(self) -> str:
        return "/"

    @on_rank_zero
    def log_hyperparams(self, params: Any, *args, **kwargs) -> None:  # config.yaml holds them
        pass

    @on_rank_zero
    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        row: dict[str, Any] = {"step": step, "time": round(time.time(), 3)}
        for key, value in metrics.items():
            value = float(value.item() if hasattr(value, "item") else value)
            row[key] = value if math.isfinite(value) else str(value)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            f.write(json.dumps(row, allow_nan=False) + "\n")

    def log_graph(self, model: Any, input_array: Any = None) -> None:
        pass

    def save(self) -> None:  # each row is written when it is logged
        pass

    def finalize(self, status: str) -> None:
        pass

    def after_save_checkpoint(self, checkpoint_callback: Any) -> None:
        pass


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


# ---- W&B: persistent run id ------------------------------------------------------------------
WANDB_ID_FILE = "wandb_run_id"
_ID_CHARS = string.ascii_lowercase + string.digits


def persistent_run_id(run_dir: str | Path) -> str:
    """The W&B run id of the training run in ``run_dir``: read from ``<run_dir>/wandb_run_id``, or
    made (8 base-36 characters, like W&B's own) and written there on rank zero."""
    path = Path(run_dir) / WANDB_ID_FILE
    if path.is_file():
        run_id = path.read_text().strip()
        if not run_id or len(run_id) > 128 or re.search(r"[\s/\\#?%:]", run_id):
            raise UserError(f"{path} does not hold a W&B run id ({run_id[:40]!r}); delete it to start a new W&B run")
        return run_id
    run_id = "".join(secrets.choice(_ID_CHARS) for _ in range(8))
    if global_rank() == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, f"{run_id}\n".encode())
    return run_id


#: what the loggers of a run write into its folder: JsonlLogger's, the CSV logger's and ``log_table``'s
LOG_FILES = ("metrics.jsonl", "csv", "tables")


def make_loggers(cfg: Any, run_dir: str | Path, name: str | None = None, persist_run_id: bool = False,
                 replace: bool = False) -> list:
    """The loggers of a run: [W&B or CSV, JsonlLogger]. ``cfg`` is a RunConfig (or its ``logger`` section).
    Lightning is imported for a W&B or CSV logger only (:mod:`unicon.lightning_loggers`).

    ``persist_run_id`` (training runs): the W&B run id is :func:`persistent_run_id` of ``run_dir``,
    so that a resumed or requeued run continues the same W&B run. Standalone evaluations start a
    new W&B run each time, and pass ``replace``: the :data:`LOG_FILES` an earlier run of the same
    evaluation left in its ``--out`` are deleted first, so that a rerun replaces their rows instead
    of adding a second row for each step (``--out`` holds one run: ``cli_common.claim_out``)."""
    import shutil

    # absolute: W&B writes from its own service process, whose working directory may be another one
    run_dir = Path(run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    if replace and global_rank() == 0:
        for entry in (run_dir / f for f in LOG_FILES):
            shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink(missing_ok=True)
    lcfg = cfg.logger if hasattr(cfg, "logger") else cfg
    name = name or getattr(cfg, "name", None) or run_dir.name
    loggers: list = []
    if lcfg.type == "wandb":
        mode = wandb_mode(lcfg.mode)
        if mode != "disabled":
            from unicon.lightning_loggers import UniconWandbLogger

            project = lcfg.project or os.environ.get("WANDB_PROJECT") or "unicon"
            loggers.append(
                UniconWandbLogger(
                    name=name,
                    project=project,
                    entity=lcfg.entity,
                    save_dir=str(run_dir),
                    id=persistent_run_id(run_dir) if persist_run_id else None,  # WandbLogger: resume="allow"
                    tags=list(lcfg.tags or []),
                    group=lcfg.group,
                    mode=mode,
                    artifacts=bool(getattr(lcfg, "log_model", False)),
                    settings={"silent": True} if mode == "offline" else None,
                )
            )
    elif lcfg.type == "csv":
        from unicon.lightning_loggers import KeepingCSVLogger

        loggers.append(KeepingCSVLogger(save_dir=str(run_dir), name="csv", version=""))
    elif lcfg.type != "none":
        raise UserError(f"logger.type must be wandb, csv or none, got {lcfg.type!r}")
    loggers.append(JsonlLogger(run_dir))
    return loggers


def wandb_run_dir(loggers: list) -> str | None:
    """Directory of the W&B run, if any (printed at the end of a run)."""
    for lg in loggers:
        if is_wandb(lg):
            try:
                return str(Path(lg.experiment.dir).parent)
            except Exception:  # wandb failed to start; the error was already logged
                return None
    return None


# ---- run config and environment ----------------------------------------------------------------
def flatten_config(cfg: Any, prefix: str = "") -> dict[str, Any]:
    """A (resolved) config -- OmegaConf, dataclass or dict -- as ``{"model.backend": ...,
    "loss.lambda_": ..., ...}``. Lists stay values; an empty section stays ``{}``."""
    from omegaconf import OmegaConf

    if OmegaConf.is_config(cfg):
        cfg = OmegaConf.to_container(cfg, resolve=True)
    elif dataclasses.is_dataclass(cfg):
        cfg = dataclasses.asdict(cfg)
    out: dict[str, Any] = {}
    for key, value in cfg.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flatten_config(value, f"{name}."))
        else:
            out[name] = dict(value) if isinstance(value, Mapping) else value
    return out


def _config_container(cfg: Any) -> Any:
    """A (resolved) config -- OmegaConf, dataclass or mapping -- as plain nested dicts and lists."""
    from omegaconf import OmegaConf

    if OmegaConf.is_config(cfg):
        return OmegaConf.to_container(cfg, resolve=True)
    if dataclasses.is_dataclass(cfg):
        return dataclasses.asdict(cfg)
    return dict(cfg) if isinstance(cfg, Mapping) else cfg


def git_state() -> dict[str, Any]:
    """``{"git.commit": sha, "git.dirty": bool}`` of the checkout the unicon package is imported
    from (its ``__init__.py`` must be tracked there); ``{}`` for an installed package, without git,
    or when git fails."""
    pkg = Path(unicon.__file__).resolve().parent

    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "-C", str(pkg), *args], capture_output=True, text=True, timeout=20)

    try:
        if git("ls-files", "--error-unmatch", "__init__.py").returncode:
            return {}
        commit = git("rev-parse", "HEAD")
        if commit.returncode:
            return {}
        status = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return {}
    out: dict[str, Any] = {"git.commit": commit.stdout.strip()}
    if status.returncode == 0:
        out["git.dirty"] = bool(status.stdout.strip())
    return out


VERSIONED = ("torch", "lightning", "transformers", "wandb", "unicon")


def environment_info() -> dict[str, Any]:
    """:func:`git_state` plus ``versions.<package>`` (python and :data:`VERSIONED`, where installed)."""
    info = git_state()
    info["versions.python"] = platform.python_version()
    for dist in VERSIONED:
        try:
            info[f"versions.{dist}"] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    return info


@on_rank_zero
def log_run_config(loggers: list, cfg: Any, model: Any = None) -> dict[str, Any]:
    """Send the flattened run config, :func:`environment_info` and the weights fingerprint of
    ``model`` (``weights.fingerprint``; ``weights.resume_fingerprint`` when ``cfg.resume`` is set)
    to every logger's ``log_hyperparams``. Returns the dict sent."""
    params = flatten_config(cfg)
    extra = environment_info()
    if model is not None:
        extra["weights.resume_fingerprint" if getattr(cfg, "resume", None) else "weights.fingerprint"] = \
            weights_fingerprint(model)
    sections = {k.split(".", 1)[0] for k in params}
    clash = sorted(k for k in extra if k.split(".", 1)[0] in sections)
    if clash:  # the config schema grew a section with one of these names
        raise ValueError(f"run metadata keys {clash} collide with config keys")
    params.update(extra)
    for lg in loggers:
        lg.log_hyperparams(params)
    return params


# ---- artifacts -----------------------------------------------------------------------------------
EVAL_ARTIFACT_PARTS = ("eval", "tables", "metrics.jsonl")  # under the run folder


def artifact_name(name: str) -> str:
    """``name`` with what W&B does not allow in artifact names (anything but letters, digits,
    ``-``, ``_`` and ``.``) replaced by ``-``."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", name).strip("-") or "run"


@on_rank_zero
def log_run_artifacts(loggers: list, cfg: Any, export_dir: str | Path | None, run_dir: str | Path,
                      step: int | None = None) -> list[str]:
    """Log a finished training run's artifacts to every :class:`UniconWandbLogger` that has
    ``artifacts`` on (``logger.log_model=true``; see the module docstring), then finish its W&B
    run. ``export_dir`` None or missing (ZeRO-3): only the evaluation outputs; no ``eval/`` folder
    (``eval=none``): only the export. Returns the names of the artifacts logged."""
    from unicon.lightning_loggers import STEP_KEY, UniconWandbLogger  # training: Lightning is loaded

    run_dir = Path(run_dir)
    logged: list[str] = []
    for lg in loggers:
        if not isinstance(lg, UniconWandbLogger) or not lg.artifacts:
            continue
        try:
            import wandb

            # W&B allows 100 top-level metadata keys: the config stays nested
            metadata = {"config": _config_container(cfg), **environment_info()}
            if step is not None:
                metadata[STEP_KEY] = step
            aliases = ["latest", *([f"step-{step}"] if step is not None else [])]
            name = artifact_name(str(getattr(cfg, "name", None) or run_dir.name))
            if export_dir is not None and Path(export_dir).is_dir():
                art = wandb.Artifact(f"{name}-export", type="model", metadata=metadata,
                                     description=f"save_pretrained export of the unicon run {name}")
                art.add_dir(str(export_dir))
                lg.experiment.log_artifact(art, aliases=aliases)
                logged.append(art.name)
            if (run_dir / "eval").is_dir():
                art = wandb.Artifact(f"{name}-eval", type="evaluation", metadata=metadata,
                                     description=f"epoch-end evaluation outputs of the unicon run {name}")
                for part in EVAL_ARTIFACT_PARTS:
                    path = run_dir / part
                    if path.is_dir():
                        art.add_dir(str(path), name=part)
                    elif path.is_file():
                        art.add_file(str(path), name=part)
                lg.experiment.log_artifact(art, aliases=aliases)
                logged.append(art.name)
        finally:
            if lg._finish_pending:
                lg.finish_run()
    return logged
