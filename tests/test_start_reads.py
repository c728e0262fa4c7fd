"""A run's start reads each checkpoint once: ``unicon train resume=CKPT`` and a SLURM restart read
the resume checkpoint one time of their own (its stored config, its step for the newest-checkpoint
check and its weights all come from that read), plus Lightning's load for ``ckpt_path``; the other
checkpoints of the run folder, which the restart chooses among and the newest check compares, once
each (:class:`unicon.training.resume.CheckpointReads`). ``init_from=CKPT`` and ``load_model(CKPT)`` read
theirs once: what to build and its weights come from one read (:mod:`unicon.models.checkpoints`).

The runs are tests/test_training.py's: its test double on its synthetic world, two steps, then one
more from a checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_training import make_world

from unicon.config import compose
from unicon.training.run import cli, train


@pytest.fixture()
def double(monkeypatch):
    """build_model routed to tests/test_training.py's test double."""
    import unicon.models.factory
    from test_training import TinyUnified

    monkeypatch.setattr(unicon.models.factory, "build_model", lambda model_cfg, world_root=None: TinyUnified())


@pytest.fixture()
def first_run(tmp_path, double) -> tuple[list[str], Path]:
    """A two-step run's command line and folder: ``last.ckpt`` and ``epoch=0-step=2.ckpt``, both at step 2."""
    world = make_world(tmp_path / "world")
    args = ["trainer=cpu", "logger=csv", "eval=none", f"data.root={world}", f"output_dir={tmp_path / 'out'}",
            "data.batch_size=4", "data.contrast_batch_size=4", "trainer.enable_progress_bar=false",
            "trainer.log_every_n_steps=1", "optim.lr=1e-2", "optim.warmup_ratio=0.0", "loss.gamma=0.5",
            "name=r", "trainer.max_steps=2"]
    result = train(compose(args))
    run_dir = Path(result["run_dir"])
    assert sorted(p.name for p in run_dir.glob("*.ckpt")) == ["epoch=0-step=2.ckpt", "last.ckpt"]
    return args, run_dir


@pytest.fixture()
def loads(monkeypatch) -> list[tuple[str, bool]]:
    """Every ``torch.load`` from now on: ``(file name, mmap)``; a file object is named by its path."""
    calls, real = [], torch.load

    def counting(f, *args, **kwargs):
        name = f if isinstance(f, (str, Path)) else getattr(f, "name", None) or getattr(f, "path", repr(f))
        calls.append((Path(str(name)).name, bool(kwargs.get("mmap"))))
        return real(f, *args, **kwargs)

    monkeypatch.setattr(torch, "load", counting)
    return calls


def test_a_resume_start_reads_its_checkpoint_once(first_run, loads, capsys):
    args, run_dir = first_run
    assert cli([f"resume={run_dir / 'last.ckpt'}", "trainer.max_steps=3"]) == 0
    assert "resume:" in capsys.readouterr().out
    # last.ckpt: ours (memory-mapped: config, step, weights) and Lightning's (ckpt_path); the folder's other
    # checkpoint once, for the newest-checkpoint check
    assert sorted(loads) == [("epoch=0-step=2.ckpt", True), ("last.ckpt", False), ("last.ckpt", True)], loads


def test_a_slurm_restart_reads_each_checkpoint_once(first_run, loads, monkeypatch, capsys):
    args, run_dir = first_run
    for name in ("SLURM_NTASKS", "SLURM_JOB_NAME"):  # no SLURM job around the test: no SlurmRequeue
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    assert cli([*args[:-1], "trainer.max_steps=3"]) == 0
    assert f"SLURM job 7 restarted (1x): resuming from {run_dir / 'last.ckpt'}" in capsys.readouterr().out
    # each candidate once, ours; the chosen one (last.ckpt: the first of equal steps) also Lightning's
    assert sorted(loads) == [("epoch=0-step=2.ckpt", True), ("last.ckpt", False), ("last.ckpt", True)], loads


def test_resuming_a_deepspeed_folder_loads_each_of_its_files_once(tmp_path, loads):
    """``read_training_checkpoint`` of a DeepSpeed checkpoint folder (a ZeRO-2 layout of two ranks,
    written here with ``torch.save``) checks every file by loading it, memory-mapped, and takes the
    client state from that load of rank 0's model states instead of loading the file again."""
    from unicon.models import DEEPSPEED_COMPLETE_FILE, read_training_checkpoint

    folder = tmp_path / "last.ckpt"
    tag = folder / "checkpoint"
    tag.mkdir(parents=True)
    (folder / "latest").write_text("checkpoint")
    torch.save({"unicon_config": {"model": {}}, "global_step": 2}, tag / "mp_rank_00_model_states.pt")
    for rank in (0, 1):
        torch.save({"optimizer_state_dict": {"m": torch.zeros(2)}}, tag / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
    (folder / DEEPSPEED_COMPLETE_FILE).write_text('{"global_step": 2}')
    assert read_training_checkpoint(folder)["global_step"] == 2
    assert sorted(loads) == [("mp_rank_00_model_states.pt", True), ("zero_pp_rank_0_mp_rank_00_optim_states.pt", True),
                             ("zero_pp_rank_1_mp_rank_00_optim_states.pt", True)], loads


def test_an_init_from_start_reads_its_checkpoint_once(first_run, loads, tmp_path):
    """``init_from=CKPT``: the one read of the checkpoint (its archive checked, not memory-mapped) gives
    the architecture check its stored config and the model its weights; Lightning restores nothing."""
    args, run_dir = first_run
    train(compose([*args[:-2], "name=from_init", "trainer.max_steps=1", f"init_from={run_dir / 'last.ckpt'}"]))
    assert loads == [("last.ckpt", False)], loads


def test_load_model_reads_a_checkpoint_once(first_run, loads):
    """``unicon evaluate --ckpt CKPT`` (:func:`unicon.models.load_model`): one read for the model and its weights."""
    from unicon.models import load_model

    args, run_dir = first_run
    load_model(run_dir / "last.ckpt")
    assert loads == [("last.ckpt", False)], loads
