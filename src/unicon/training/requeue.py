"""Checkpoint-and-requeue of a SLURM job on its warning signal: :class:`SlurmRequeue`, which
:func:`unicon.training.run.train` installs when it runs under SLURM (:func:`install_slurm_requeue`).
The checkpoint it writes, ``<run_dir>/hpc_ckpt_<n>.ckpt``, is one of those a restart chooses from
(:func:`unicon.training.resume.requeue_checkpoint`)."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from pathlib import Path

from unicon.evaluation.preemption import Preempted

HPC_PREFIX = "hpc_ckpt_"  # Lightning's name for requeue checkpoints (``ckpt_path="hpc"`` finds them)


def next_hpc_checkpoint(run_dir: Path) -> Path:
    numbers = [int(p.stem[len(HPC_PREFIX):]) for p in run_dir.glob(f"{HPC_PREFIX}*.ckpt")
               if p.stem[len(HPC_PREFIX):].isdigit()]
    return run_dir / f"{HPC_PREFIX}{max(numbers, default=0) + 1}.ckpt"


def install_slurm_requeue(run_dir: Path) -> SlurmRequeue | None:
    """Under SLURM (Lightning's ``SLURMEnvironment.detect()``), a :class:`SlurmRequeue` of ``run_dir``,
    installed; None elsewhere."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    if not SLURMEnvironment.detect():
        return None
    requeue = SlurmRequeue(run_dir)
    requeue.install()
    return requeue


class SlurmRequeue:
    """Checkpoint-and-requeue on SLURM's warning signal (``#SBATCH --signal=SIGUSR1@90``).

    Lightning's own handler (``SLURMEnvironment(auto_requeue=True)``) saves the checkpoint inside
    the signal handler, i.e. wherever the main thread is when the signal lands: ranks then enter
    the checkpoint's barriers at different points of their step (against DDP's gradient
    all-reduce: a hang or a mismatched collective), and a checkpoint taken between fetching a batch
    and finishing it resumes with the data position and γ generator of a half-done step. Here the
    handler only sets a flag, and the step boundary does the work:

    * ``on_train_batch_end`` (where ``ModelCheckpoint`` saves, a tested exact-resume point): the
      ranks agree whether any of them got the signal (one-element all-reduce per step) and all save
      ``<run_dir>/hpc_ckpt_<n>.ckpt`` at the same step;
    * the next hook (``on_train_batch_start``, ``on_train_epoch_end``) comes after Lightning wrote
      that step's metrics row, which the checkpoint's log offsets then keep: it raises
      :class:`~unicon.evaluation.preemption.Preempted`, so the run stops without an export;
    * :meth:`requeue`, called by :func:`~unicon.training.run.train` once the Trainer has torn down
      (loggers flushed, the W&B run closed), runs ``scontrol requeue`` on global rank 0; the other
      ranks exit 0, so that ``srun --kill-on-bad-exit=1`` does not end the step first. SLURM then
      kills the job's processes, which have nothing left to write, and starts the job again;
      :func:`~unicon.training.run.compose_run` resumes it from the newest checkpoint, continuing
      ``metrics.jsonl`` and the W&B run.

    A signal during an epoch-end evaluation also reaches :mod:`unicon.evaluation.preemption`, whose
    callback writes ``last.ckpt`` and raises ``Preempted``; :meth:`requeue` requeues that as well.
    """

    signum = signal.SIGUSR1

    def __init__(self, run_dir: Path):
        from lightning.pytorch.callbacks import Callback

        self.run_dir = Path(run_dir)
        self.signalled = False
        self.checkpoint: Path | None = None
        self._previous = None
        outer = self

        class _Hooks(Callback):  # the Lightning callback; SlurmRequeue itself also owns the handler
            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                outer._on_step_end(trainer)

            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
                outer._stop_if_saved()

            def on_train_epoch_end(self, trainer, pl_module):
                outer._stop_if_saved()

        self.callback = _Hooks()

    def install(self) -> None:
        """SIGUSR1 sets the flag from now on (its default action would kill the process). Call
        before the model is built: the warning can come while a large model loads."""
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(self.signum, self._handler)

    def uninstall(self) -> None:
        if self._previous is not None:
            signal.signal(self.signum, self._previous)
            self._previous = None

    def _handler(self, signum, frame) -> None:
        self.signalled = True

    def _on_step_end(self, trainer) -> None:
        if self.checkpoint is not None or not trainer.strategy.reduce_boolean_decision(self.signalled, all=False):
            return
        loop = trainer.fit_loop
        if (0 <= trainer.max_steps <= trainer.global_step) or (
                loop.epoch_loop.batch_progress.is_last_batch and loop.max_epochs is not None
                and 0 <= loop.max_epochs <= trainer.current_epoch + 1):
            return  # the run ends after this step anyway: finishing beats a requeue
        path = Path(trainer.strategy.broadcast(str(next_hpc_checkpoint(self.run_dir))))
        trainer.save_checkpoint(path)  # collective: every rank, at the same step
        self.signalled = True  # ranks that did not get the signal themselves requeue too
        self.checkpoint = path

    def _stop_if_saved(self) -> None:
        if self.checkpoint is not None:
            raise Preempted(self.signum, checkpoint=str(self.checkpoint))

    def on_preempted(self) -> None:
        """The end of a run that :class:`Preempted` stopped: :meth:`requeue` on global rank 0; another
        rank that got the warning exits 0 here."""
        from lightning.pytorch.utilities.rank_zero import rank_zero_only

        self.requeue(is_global_zero=rank_zero_only.rank == 0)
        if self.signalled and rank_zero_only.rank != 0:
            # rank 0 requeues the job: this rank's part is done, and a failing exit would make
            # srun --kill-on-bad-exit=1 (slurm/train.sbatch) end the step before rank 0 gets there
            raise SystemExit(0) from None

    def requeue(self, is_global_zero: bool) -> None:
        """``scontrol requeue`` this job if the warning signal came (rank 0 only); the last thing
        a preempted run does. A job that cannot be requeued (``--no-requeue``, outside SLURM) keeps
        its checkpoint: the message says how to resume by hand."""
        if not (self.signalled and is_global_zero):
            return
        array_job, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
        job = f"{array_job}_{task}" if array_job and task else os.environ.get("SLURM_JOB_ID")
        hint = f"resume with resume={self.checkpoint or self.run_dir / 'last.ckpt'}"
        if not job:
            print(f"SIGUSR1 outside a SLURM job: not requeued; {hint}")
            return
        # said before the call: SLURM kills the job as soon as the requeue is accepted, often before
        # a message printed afterwards reaches the log
        print(f"requeueing SLURM job {job}; it resumes from {self.checkpoint or 'the newest checkpoint'}", flush=True)
        try:
            proc = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
            ok, why = proc.returncode == 0, (proc.stderr or proc.stdout).strip()
        except (OSError, subprocess.TimeoutExpired) as e:
            ok, why = False, str(e)
        if not ok:
            print(f"scontrol requeue {job} failed ({why}); {hint}", flush=True)
