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


def test_evaluate_sbatch_body_runs(srun_shim, tmp_path):
    """The evaluation script on stand-ins: a tiny Janus export, placeholder COCO images, a tiny
    OWLv2, a ShapesWorld CLIP trained for a few steps and a tiny Qwen2-VL judge."""
    import json

    from PIL import Image

    import standins

    shared = Path(os.environ.get("UNICON_SHARED_DIR", REPO.parent / "shared"))
    if not (shared / "data").is_dir():
        pytest.skip(f"needs the shared data directory {shared} (real benchmark files)")
    if not (REPO / ".venv" / "bin" / "unicon").is_file():
        pytest.skip("needs the project's virtual environment (make setup), which the script activates")
    janus = standins.janus_export(tmp_path / "janus")
    owl = standins.owlv2(tmp_path / "owlv2")
    judge = standins.qwen2_vl(tmp_path / "judge")
    world = standins.build_world(tmp_path / "world", "--num-reason-train", "0", train=8)
    env = slurm_env(srun_shim, "77")
    subprocess.run([sys.executable, "-m", "unicon.embedders.clip", "--train-shapes", str(world), "--out",
                    str(tmp_path / "clip"), "--steps", "2", "--batch-size", "8"], check=True, env=env,
                   capture_output=True)
    coco = tmp_path / "val2014"
    coco.mkdir()
    for image in json.loads((shared / "data" / "cococon" / "cococon.json").read_text())["images"]:
        Image.new("RGB", (64, 48), (120, 80, 40)).save(coco / image["file_name"])
    env.update(SLURM_SUBMIT_DIR=str(tmp_path), UNICON_SHARED_DIR=str(shared),
               EVAL_ARGS="--max-samples 2 --logger none",
               DRIFT_ARGS="--num-chains 2 --generations 2 --geneval-limit 1 --logger none")
    (tmp_path / ".venv").symlink_to(REPO / ".venv")
    proc = subprocess.run(["bash", str(REPO / "slurm" / "evaluate.sbatch"), str(janus), str(coco), str(owl),
                           str(tmp_path / "clip"), str(judge)], env=env, capture_output=True, text=True, timeout=900,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = tmp_path / "outputs" / "eval-77"
    for f in ("cococon/results.json", "drift/drift.json", "ureason/ureason.json"):
        assert (out / f).is_file(), f
