"""Where a run starts from: ``resume=CKPT``, the SLURM restart, and the checks on both.

* :func:`compose_resumed` -- the config of ``unicon train resume=CKPT [overrides]``: the one stored
  in ``CKPT`` with the command-line overrides on top, each change printed;
* :func:`requeue_checkpoint` -- in a requeued SLURM job (:func:`slurm_restart_count` > 0), the
  newest readable checkpoint of the run folder, which the restart resumes;
* :func:`resume_checkpoint` -- the dict of ``resume=``'s checkpoint, which a run's weights come
  from; a checkpoint older than another one in its folder is refused unless ``resume_older=true``.

All of them read checkpoints through one :class:`CheckpointReads` per start, which reads each file
once (memory-mapped): the resume checkpoint's stored config, its step and its weights all come
from that one read, and Lightning's load of ``ckpt_path`` is the only other one.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from omegaconf import DictConfig

from unicon.config import compose, compose_resume
from unicon.errors import UserError
from unicon.training.requeue import HPC_PREFIX
from unicon.training.run_folder import run_dir_of


class CheckpointReads:
    """The training checkpoints one start of a run reads, each read once
    (:func:`unicon.models.checkpoints.read_training_checkpoint`, memory-mapped): its dict, or the
    :class:`~unicon.errors.UserError` the read raised, raised again at every later ask. A dict read
    without ``allow_pickle`` also answers an ask with it (the file needed no unpickling).

    The dicts map the files' tensors: :meth:`release` drops them once the model is built, before
    ``ModelCheckpoint`` rewrites those files (``last.ckpt``)."""

    def __init__(self) -> None:
        self._reads: dict[tuple[Path, bool], dict | UserError] = {}

    def read(self, path: str | Path, allow_pickle: bool = False) -> dict:
        """The checkpoint's dict (:func:`~unicon.models.checkpoints.read_training_checkpoint`), read on the first ask."""
        # lazy: pulls in every model backend (transformers), not needed by unicon train --help
        from unicon.models.checkpoints import read_training_checkpoint

        key, allow_pickle = Path(path).resolve(), bool(allow_pickle)
        got = self._reads.get((key, allow_pickle))
        if got is None and allow_pickle and isinstance(self._reads.get((key, False)), dict):
            got = self._reads[key, False]
        if got is None:
            try:
                got = read_training_checkpoint(path, allow_pickle=allow_pickle, mmap=True)
            except UserError as e:
                got = e
            self._reads[key, allow_pickle] = got
        if isinstance(got, UserError):
            raise got
        return got

    def step(self, path: str | Path, allow_pickle: bool = False) -> int:
        """The checkpoint's ``global_step`` (-1 when it records none)."""
        return int(self.read(path, allow_pickle).get("global_step", -1))

    def release(self) -> None:
        self._reads.clear()


def compose_resumed(overrides: list[str], announce: bool, reads: CheckpointReads) -> DictConfig:
    """The config of ``unicon train OVERRIDES``: with ``resume=CKPT``, the config stored in CKPT with
    the other overrides on top (each change printed when ``announce``); without, :func:`compose`."""
    resume = [o.split("=", 1)[1] for o in overrides if o.startswith("resume=")]
    if not resume or not resume[-1] or resume[-1] in ("null", "None"):
        return compose(overrides)
    path = resume[-1]
    rest = [o for o in overrides if not o.startswith("resume=")]
    pickle_opt = [o.split("=", 1)[1] for o in rest if o.startswith("model.allow_pickle=")]
    allow_pickle = bool(pickle_opt) and pickle_opt[-1].strip().lower() in ("true", "1", "yes")
    ckpt = reads.read(path, allow_pickle)
    cfg, changes = compose_resume(ckpt["unicon_config"], f"{path} (stored config)", rest, resume=path)
    if announce:
        print(f"resume: {path} (run '{cfg.name}', step {ckpt.get('global_step', '?')}), with the config stored in it")
        for change in changes:
            print(f"resume: command line changes {change}")
    return cfg


# ---- SLURM restart --------------------------------------------------------------------------------
def slurm_restart_count() -> int:
    """How often SLURM has requeued this job (``SLURM_RESTART_COUNT``, set in the batch script's and
    the job steps' environment from the first requeue on); 0 outside SLURM and on the first start."""
    try:
        return int(os.environ.get("SLURM_RESTART_COUNT") or 0)
    except ValueError:
        return 0


def requeue_checkpoint(overrides: list[str], reads: CheckpointReads | None = None) -> Path | None:
    """The checkpoint a requeued run continues from: of ``<run_dir>/hpc_ckpt_*.ckpt`` (written at
    SIGUSR1), ``<run_dir>/last.ckpt`` (periodic; the only one after a requeue without warning, e.g.
    a node failure), the run folder's other ``*.ckpt`` (ModelCheckpoint's) and an explicit
    ``resume=`` of the command line, the one with the highest ``global_step``. Files and DeepSpeed
    checkpoint folders alike. None when there is none (the job was requeued before its first
    checkpoint). Unreadable candidates (a save cut by a kill; a DeepSpeed folder without its
    ``complete.json``) are skipped with a message."""
    from unicon.models.checkpoints import is_deepspeed_checkpoint  # lazy: pulls in every model backend

    reads = reads if reads is not None else CheckpointReads()
    cfg = compose_resumed(overrides, announce=False, reads=reads)  # with resume=: the run folder of the stored config
    candidates = folder_checkpoints(run_dir_of(cfg))
    if cfg.resume:
        candidates.append(Path(cfg.resume))
    best, best_step = None, -1
    for path in candidates:
        if not (path.is_file() or is_deepspeed_checkpoint(path)):
            continue
        try:
            step = reads.step(path, bool(cfg.model.allow_pickle))
        except UserError as e:
            print(f"SLURM restart: skipping {path}: {e}")
            continue
        if step > best_step:  # ties: the earlier candidate (hpc, then last, then resume=): same state
            best, best_step = path, step
    return best


def folder_checkpoints(folder: Path) -> list[Path]:
    """The checkpoints of a run folder (files and DeepSpeed checkpoint folders): ``hpc_ckpt_*.ckpt``,
    ``last.ckpt``, then ModelCheckpoint's others; the order in which :func:`requeue_checkpoint`
    prefers one of equal steps (they hold the same state)."""
    from unicon.models.checkpoints import is_deepspeed_checkpoint  # lazy: pulls in every model backend

    others = sorted(p for p in folder.glob("*.ckpt") if p.name != "last.ckpt" and not p.name.startswith(HPC_PREFIX))
    candidates = sorted(folder.glob(f"{HPC_PREFIX}*.ckpt")) + [folder / "last.ckpt"] + others
    return [p for p in candidates if p.is_file() or is_deepspeed_checkpoint(p)]


# ---- resume continues the newest state --------------------------------------------------------------
def resume_checkpoint(cfg: DictConfig, reads: CheckpointReads) -> dict:
    """The dict of the checkpoint ``cfg.resume`` names (:meth:`CheckpointReads.read`), which the
    run's network and weights come from. It must be readable, and is refused while another
    checkpoint in its folder holds a later step, naming both, unless ``resume_older=true``:
    resuming it would go back and redo (and overwrite) the later steps. The others that cannot be
    read (a save cut short, a DeepSpeed folder without its ``complete.json``) do not count."""
    allow_pickle = bool(cfg.model.allow_pickle)
    resume = Path(cfg.resume)
    resumed = reads.read(resume, allow_pickle)  # readable, ours
    if cfg.resume_older:
        return resumed
    step = int(resumed.get("global_step", -1))
    newest, newest_step = None, step
    for path in folder_checkpoints(resume.parent):
        if path.resolve() == resume.resolve():
            continue
        try:
            other = reads.step(path, allow_pickle)
        except UserError:
            continue
        if other > newest_step:
            newest, newest_step = path, other
    if newest is not None:
        last = last_training_row(resume.parent / "metrics.jsonl")
        logged = "" if last is None else (
            f" (metrics.jsonl's last training row is step {last}: resuming {newest.name} continues after step "
            f"{newest_step - 1}, resume_older=true trains again from step {step} and rewrites the rows after it)")
        raise UserError(f"resume={resume} is at step {step}, but {newest} in the same folder is at step {newest_step}: "
                        f"resume from {newest}, or pass resume_older=true to go back to step {step}{logged}")
    return resumed


def last_training_row(metrics: Path) -> int | None:
    """The step of the last ``train/loss`` row of a run's ``metrics.jsonl`` (None: no file or no such
    row). A line cut short by a kill is passed over. A checkpoint saved at the end of step ``s`` comes
    before the row of step ``s`` is written, so a kill between the two leaves the newest checkpoint
    one row ahead of the file, which the refusal above shows."""
    if not metrics.is_file():
        return None
    last = None
    for line in metrics.read_text(errors="replace").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and "train/loss" in row and isinstance(row.get("step"), int):
            last = row["step"]
    return last
