"""Lightning's DeepSpeed strategy as ``unicon train`` runs it: on GPUs or on CPU, with checkpoint
folders that say when they are complete.

:class:`ZeroStrategy` is Lightning's ``DeepSpeedStrategy`` with three changes, everything else
(the engine, ZeRO partitioning, Lightning's checkpoint folder and its loading) being Lightning's
and DeepSpeed's own code:

* **CPU.** DeepSpeed picks its CPU accelerator when there is no GPU and talks gloo; ZeRO-2 and
  ZeRO-3 train on it. Lightning refuses the CPU in ``setup_environment`` (a CUDA check), and its
  rank-to-device check and ``deepspeed.initialize(args=Namespace(device_rank=root_device.index))``
  need indexed devices. On CPU the strategy uses ``torch.device("cpu", local_rank)`` (the CPU) and
  DDP's environment set-up without the CUDA check. ``trainer.accelerator=cpu`` with
  ``trainer.strategy=deepspeed_*`` therefore runs the same strategy a cluster runs.
* **Complete checkpoints.** A DeepSpeed checkpoint is a folder that every rank writes into, and
  ``last.ckpt`` is rewritten in place at every save: a job killed mid-save leaves a folder whose
  ``latest`` file names a tag with half-old, half-new files. :meth:`save_checkpoint` removes
  ``<folder>/complete.json`` before the ranks write and rank 0 writes it back (with the step)
  after all of them finished; resume and the SLURM requeue only take folders that have it
  (:func:`unicon.models.resumable_deepspeed_state`).
* **Gathered evaluation.** :meth:`gathered_parameters` is the context the epoch-end evaluations
  run in: under ZeRO-3 DeepSpeed's ``GatheredParameters`` over the model (every rank holds the
  whole model while the ranks evaluate their shards independently, with no collective inside
  generation); below ZeRO-3 the parameters are already whole and it does nothing.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any, Iterator

import torch
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy

from unicon.models.checkpoints import DEEPSPEED_COMPLETE_FILE


class ZeroStrategy(DeepSpeedStrategy):
    """``DeepSpeedStrategy`` on GPUs or CPU, with complete-marked checkpoint folders (module docstring)."""

    @property
    def zero_stage(self) -> int:
        return int((self.config.get("zero_optimization") or {}).get("stage", 0))

    def setup_environment(self) -> None:
        if self.parallel_devices and all(d.type == "cpu" for d in self.parallel_devices):
            self.parallel_devices = [torch.device("cpu", i) for i in range(len(self.parallel_devices))]
            DDPStrategy.setup_environment(self)  # DeepSpeedStrategy's, minus its CUDA check
        else:
            super().setup_environment()

    def save_checkpoint(self, checkpoint: dict, filepath, storage_options: Any | None = None) -> None:
        marker = Path(filepath) / DEEPSPEED_COMPLETE_FILE
        if self.is_global_zero:
            marker.unlink(missing_ok=True)
        self.barrier("unicon_checkpoint_start")
        super().save_checkpoint(checkpoint, filepath, storage_options)
        self.barrier("unicon_checkpoint_end")
        if self.is_global_zero:
            tmp = marker.with_suffix(".tmp")
            tmp.write_text(json.dumps({"global_step": int(checkpoint.get("global_step", -1))}) + "\n")
            tmp.replace(marker)

    @contextlib.contextmanager
    def gathered_parameters(self, module: torch.nn.Module) -> Iterator[None]:
        if self.zero_stage < 3:
            yield
            return
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
            yield
