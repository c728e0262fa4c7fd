"""The run folder ``<output_dir>/<name>/``: :func:`claim_run_dir` creates and locks it (one run per
folder; a folder that already holds a run is refused unless this run resumes it or
``overwrite=true`` deletes it), :func:`write_run_config` writes the resolved ``config.yaml`` into it,
:func:`release_run_dir` unlocks it; :func:`claimed_run_dir` holds it for a ``with`` block."""

from __future__ import annotations

import fcntl
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from omegaconf import DictConfig

from unicon.config import to_yaml
from unicon.errors import UserError

LOCK_NAME = ".lock"


def run_dir_of(cfg: DictConfig) -> Path:
    """The run folder of a config: ``<output_dir>/<name>``."""
    return Path(cfg.output_dir) / cfg.name


def _holds_no_checkpoint(run_dir: Path) -> bool:
    """Whether ``run_dir`` holds no checkpoint (no ``*.ckpt`` file or DeepSpeed checkpoint folder, at
    any depth) and no ``export/``: in a run folder, what a run leaves that failed before its first
    checkpoint, with nothing to resume or keep."""
    return not (run_dir / "export").exists() and next(run_dir.rglob("*.ckpt"), None) is None


def claim_run_dir(cfg: DictConfig):
    """Create and lock the run folder; returns the open lock file (held until the process ends or
    :func:`release_run_dir`). Under DDP only global rank 0 claims it.

    A folder that already holds files is refused unless the run resumes a checkpoint inside it
    (a requeued SLURM job does: :func:`~unicon.training.run.compose_run`) or ``overwrite=true``
    (which deletes the old run's files first). A run folder (one with a lock file) that holds nothing to resume or keep
    (:func:`_holds_no_checkpoint`: a run that stopped before its first checkpoint) is cleared and reused.
    """
    from lightning.pytorch.utilities.rank_zero import rank_zero_only

    run_dir = run_dir_of(cfg)
    if run_dir.exists() and not run_dir.is_dir():
        raise UserError(f"run folder {run_dir} (output_dir/name) exists and is not a directory")
    if rank_zero_only.rank != 0:
        return None
    was_run = (run_dir / LOCK_NAME).is_file()  # claimed by an earlier run, not just any folder
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        lock = open(run_dir / LOCK_NAME, "a+")
    except OSError as e:
        raise UserError(f"cannot create the run folder {run_dir} ({e.strerror}); check output_dir") from None
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        owner = lock.read().strip() or "?"
        lock.close()
        raise UserError(f"{run_dir} is in use by another unicon run (pid {owner}); choose another name=") from None
    entries = sorted(p for p in run_dir.iterdir() if p.name != LOCK_NAME)
    resuming = bool(cfg.resume) and Path(cfg.resume).resolve().parent == run_dir.resolve()
    if entries and not resuming:
        if was_run and _holds_no_checkpoint(run_dir):
            print(f"{run_dir}: clearing the files of a run that stopped before its first checkpoint")
        elif not cfg.overwrite:
            lock.close()
            raise UserError(f"{run_dir} already holds a run ({len(entries)} entries, e.g. {entries[0].name}); resume it "
                            f"with resume={run_dir / 'last.ckpt'}, choose another name=, or pass overwrite=true "
                            "to delete it")
        for p in entries:
            shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
    lock.seek(0)
    lock.truncate()
    lock.write(f"{os.getpid()}\n")
    lock.flush()
    return lock


@contextmanager
def claimed_run_dir(cfg: DictConfig) -> Iterator[Path]:
    """The run folder, claimed (:func:`claim_run_dir`) for the ``with`` block and released after it."""
    lock = claim_run_dir(cfg)
    try:
        yield run_dir_of(cfg)
    finally:
        release_run_dir(lock)


def write_run_config(run_dir: Path, cfg: DictConfig) -> None:
    """Write the resolved ``config.yaml`` into the run folder, on global rank 0 only: only rank 0
    creates the folder (:func:`claim_run_dir`), so another rank could get there first and find none."""
    from lightning.pytorch.utilities.rank_zero import rank_zero_only

    if rank_zero_only.rank == 0:
        (run_dir / "config.yaml").write_text(to_yaml(cfg))


def release_run_dir(lock) -> None:
    if lock is not None:
        fcntl.flock(lock, fcntl.LOCK_UN)
        lock.close()
