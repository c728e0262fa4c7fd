"""Experiment loggers: W&B (or CSV) plus a local ``metrics.jsonl`` that always exists.

``make_loggers(cfg, run_dir)`` returns the Lightning loggers of a run:

* ``WandbLogger`` (``logger.type=wandb``, the default) or ``CSVLogger`` (``logger.type=csv``);
* :class:`JsonlLogger`, which appends every scalar to ``<run_dir>/metrics.jsonl`` so that tests,
  ``unicon report`` and users read the numbers back without W&B. The file exists from the start.

A resumed run continues the same files: :class:`LogFilesCallback` records in every checkpoint how
many bytes of ``metrics.jsonl`` and how many lines of ``csv/metrics.csv`` existed when it was
written (lines, not bytes: Lightning's CSV writer rewrites the whole file under a wider header when
a new key appears, which moves every byte offset but keeps the rows and their order). On resume
each file keeps that prefix plus the later rows of steps before the restored step (Lightning logs
a step's metrics just after an on-batch-end checkpoint), and loses the rows a killed run wrote
after its checkpoint, including a partial last line. Nothing written before the checkpoint is lost.

W&B mode: ``logger.mode`` if set, else ``$WANDB_MODE``, else ``online`` when an API key is
configured (``$WANDB_API_KEY`` or a ``~/.netrc`` entry for api.wandb.ai) and ``offline``
otherwise. Offline runs land in ``<run_dir>/wandb/offline-run-*``; sync them later with
``wandb sync <run_dir>/wandb/offline-run-*`` -- the usual practice on SLURM clusters without
internet. ``$WANDB_PROJECT`` is respected when ``logger.project`` is unset.

What reaches W&B (:class:`UniconWandbLogger`, Lightning's ``WandbLogger`` plus the points below):

* **One step axis.** Everything -- scalars, tables, figures, charts -- goes through
  ``WandbLogger.log_metrics(values, step)``, which logs ``{**values, "trainer/global_step": step}``
  as a new history row and lets W&B number its own ``_step``; charts plot against
  ``trainer/global_step`` (Lightning's ``define_metric("*", step_metric=...)``). Nothing passes
  ``step=`` to ``wandb.log``: W&B drops rows whose explicit step is below its current one, which is
  how epoch-end tables used to vanish after Lightning had logged the epoch's scalars.
  :mod:`unicon.evaluation.callbacks` holds the helpers the suites call (``log_table``,
  ``log_figures``, ``log_wandb``).
* **Summaries.** The first time a key is logged that matches :data:`SUMMARY_RULES` (CocoCon
  ``C_k``/``acc@k``/``rho``, drift ``MCD``/``MGG``/drift rate, UReason accuracies, training
  losses), it gets ``define_metric(key, summary="max,last")`` (or ``"min,last"`` where lower is
  better), so the runs table can sort on the best and the last value.
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

import csv
import dataclasses
import importlib.metadata
import io
import json
import math
import os
import platform
import re
import secrets
import string
import subprocess
import time
from pathlib import Path
from typing import Any, Mapping

from lightning.pytorch import Callback
from lightning.pytorch.loggers import CSVLogger, Logger, WandbLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.utilities import rank_zero_only

import unicon
from unicon.core import weights_fingerprint
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
            f.write(json.dumps(row, allow_nan=False) + "\n")


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
    _atomic_write(path, head + b"".join(line + b"\n" for line in kept))
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
    _atomic_write(path, b"".join(line + b"\n" for line in head + kept))
    return dropped + cut


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


# ---- W&B: one step axis, summaries, persistent run id ------------------------------------------
STEP_KEY = "trainer/global_step"  # Lightning's x-axis for every W&B key (``define_metric("*", step_metric=...)``)

#: ``(pattern, summary)``: a logged key matching ``pattern`` gets ``define_metric(key, summary=...)``
#: (W&B globs only allow a trailing ``*``, hence patterns on the first use of each key). MCD is a
#: mean cosine *similarity* to the chain's input: higher means less drift.
SUMMARY_RULES: tuple[tuple[re.Pattern, str], ...] = (
    (re.compile(r"^cococon/.+/(C_\d+|acc@\d+|rho)$"), "max,last"),
    (re.compile(r"^drift/(.+/)?(MCD_\w+|MGG(_\w+)?)$"), "max,last"),
    (re.compile(r"^drift/drift_rate_\w+$"), "min,last"),
    (re.compile(r"^ureason/(acc_s\d|chain_acc)$"), "max,last"),
    (re.compile(r"^train/loss(_ce|_const)?$"), "min,last"),
)


def summary_for(key: str) -> str | None:
    """The W&B summary aggregation of a metric key (:data:`SUMMARY_RULES`), or None."""
    return next((summary for pattern, summary in SUMMARY_RULES if pattern.match(key)), None)


def _is_scalar(value: Any) -> bool:
    if hasattr(value, "numel"):  # a tensor
        return value.numel() == 1
    return isinstance(value, (int, float))


class UniconWandbLogger(WandbLogger):
    """Lightning's ``WandbLogger`` that defines the summary of each :data:`SUMMARY_RULES` key the
    first time it is logged (with ``trainer/global_step`` as its x-axis: a key's own definition
    replaces the ``"*"`` glob's)."""

    def __init__(self, *args, artifacts: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        # Lightning passes wandb.init anonymous=None, a setting wandb deprecates (it warns when one is given)
        self._wandb_init.pop("anonymous", None)
        self._defined: set[str] = set()
        self.artifacts = artifacts  # logger.log_model: log_run_artifacts logs, then finishes the run
        self._finish_pending = False

    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        for key, value in metrics.items():
            if key in self._defined or not _is_scalar(value):  # tables, images, charts: no summary
                continue
            self._defined.add(key)
            summary = summary_for(key)
            if summary:
                self.experiment.define_metric(key, step_metric=STEP_KEY, step_sync=True, summary=summary)
        super().log_metrics(metrics, step)

    @rank_zero_only
    def finalize(self, status: str) -> None:
        """Lightning's finalize, then finish the W&B run when the run is over (``success`` /
        ``failed``; not ``finished``, which Lightning's SLURM requeue handler sends while training
        goes on until the job is killed). Lightning would leave it open until the process exits,
        and a later ``WandbLogger`` in the same process would log into it. One ``fit`` per logger."""
        super().finalize(status)
        if status in ("success", "failed") and self._experiment is not None:
            if status == "success" and self.artifacts:
                self._finish_pending = True  # the export comes after fit: log_run_artifacts finishes the run
                return
            self._experiment.finish(exit_code=0 if status == "success" else 1)

    def finish_run(self) -> None:
        """Finish the W&B run that ``finalize("success")`` left open for the artifacts."""
        if self._experiment is not None:
            self._experiment.finish(exit_code=0)
        self._finish_pending = False


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
    if rank_zero_only.rank == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        _atomic_write(path, f"{run_id}\n".encode())
    return run_id


#: what the loggers of a run write into its folder: JsonlLogger's, the CSV logger's and ``log_table``'s
LOG_FILES = ("metrics.jsonl", "csv", "tables")


def make_loggers(cfg: Any, run_dir: str | Path, name: str | None = None, persist_run_id: bool = False,
                 replace: bool = False) -> list[Logger]:
    """The loggers of a run: [W&B or CSV, JsonlLogger]. ``cfg`` is a RunConfig (or its ``logger`` section).

    ``persist_run_id`` (training runs): the W&B run id is :func:`persistent_run_id` of ``run_dir``,
    so that a resumed or requeued run continues the same W&B run. Standalone evaluations start a
    new W&B run each time, and pass ``replace``: the :data:`LOG_FILES` an earlier run of the same
    evaluation left in its ``--out`` are deleted first, so that a rerun replaces their rows instead
    of adding a second row for each step (``--out`` holds one run: ``cli_common.claim_out``)."""
    import shutil

    # absolute: W&B writes from its own service process, whose working directory may be another one
    run_dir = Path(run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    if replace and rank_zero_only.rank == 0:
        for entry in (run_dir / f for f in LOG_FILES):
            shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink(missing_ok=True)
    lcfg = cfg.logger if hasattr(cfg, "logger") else cfg
    name = name or getattr(cfg, "name", None) or run_dir.name
    loggers: list[Logger] = []
    if lcfg.type == "wandb":
        mode = wandb_mode(lcfg.mode)
        if mode != "disabled":
            project = lcfg.project or os.environ.get("WANDB_PROJECT") or "unicon"
            loggers.append(
                UniconWandbLogger(
                    name=name,
                    project=project,
                    entity=lcfg.entity,
                    save_dir=str(run_dir),
                    id=persistent_run_id(run_dir) if persist_run_id else None,  # WandbLogger: resume="allow"
                    tags=list(lcfg.tags or []),
                    mode=mode,
                    artifacts=bool(getattr(lcfg, "log_model", False)),
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


@rank_zero_only
def log_run_config(loggers: list[Logger], cfg: Any, model: Any = None) -> dict[str, Any]:
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


@rank_zero_only
def log_run_artifacts(loggers: list[Logger], cfg: Any, export_dir: str | Path | None, run_dir: str | Path,
                      step: int | None = None) -> list[str]:
    """Log a finished training run's artifacts to every :class:`UniconWandbLogger` that has
    ``artifacts`` on (``logger.log_model=true``; see the module docstring), then finish its W&B
    run. ``export_dir`` None or missing (ZeRO-3): only the evaluation outputs; no ``eval/`` folder
    (``eval=none``): only the export. Returns the names of the artifacts logged."""
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
