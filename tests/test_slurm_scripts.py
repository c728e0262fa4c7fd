"""``slurm/train.sbatch`` runs as written: its body as plain bash with the SLURM variables of a
one-node, one-task allocation set and ``srun`` standing in as "run the command here".

The script's own overrides come first and the submitter's last, so a test can point it at a tiny
world and the CPU; everything else (venv activation, W&B offline, run name from the job) is the
script's.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture()
def srun_shim(tmp_path) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shim = bin_dir / "srun"
    shim.write_text('#!/bin/bash\nexec "$@"\n')
    shim.chmod(shim.stat().st_mode | stat.S_IEXEC)
    return bin_dir


def slurm_env(bin_dir: Path, job_id: str) -> dict:
    env = dict(os.environ, PATH=f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}",
               SLURM_SUBMIT_DIR=str(REPO), SLURM_JOB_ID=job_id, SLURM_JOB_NAME="unicon-train", SLURM_JOB_NUM_NODES="1",
               SLURM_NNODES="1", SLURM_NTASKS="1", SLURM_NTASKS_PER_NODE="1", SLURM_PROCID="0", SLURM_LOCALID="0",
               SLURM_NODEID="0", SLURM_NODELIST="localhost", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    env.pop("WANDB_MODE", None)  # the script sets it
    return env


def test_train_sbatch_body_runs(srun_shim, tmp_path):
    sys.path.insert(0, str(REPO))
    from data_builders.shapes import main as build_shapes

    world = tmp_path / "world"
    build_shapes(["--out", str(world), "--num-train", "8", "--num-val", "2", "--num-test", "2", "--quiet",
                  "--num-ureason", "1", "--geneval-per-tag", "1", "--num-drift-seeds", "1", "--num-reason-train", "0"])
    venv_python = REPO / ".venv" / "bin" / "python"
    if not venv_python.is_file():
        pytest.skip(f"needs the project's virtual environment {venv_python} (make setup), which the script activates")
    args = ["trainer=cpu", f"data.root={world}", f"output_dir={tmp_path / 'runs'}", "trainer.max_steps=2",
            "eval=none", "data.batch_size=4", "data.contrast_batch_size=2", "trainer.enable_progress_bar=false",
            "model.arch.d_model=32", "model.arch.encoder_layers=1", "model.arch.decoder_layers=1",
            "model.arch.encoder_ffn_dim=64", "model.arch.decoder_ffn_dim=64"]
    proc = subprocess.run(["bash", str(REPO / "slurm" / "train.sbatch"), *args], env=slurm_env(srun_shim, "4242"),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = tmp_path / "runs" / "unicon-train-4242"
    assert (run / "last.ckpt").is_file() and (run / "export" / "training_config.json").is_file()
    assert list((run / "wandb").glob("offline-run-*")), "W&B should run offline on compute nodes"
