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
    shim.write_text('#!/bin/bash\nwhile [[ "$1" == -* ]]; do shift; done\nexec "$@"\n')  # srun's options dropped
    shim.chmod(shim.stat().st_mode | stat.S_IEXEC)
    return bin_dir


def slurm_env(bin_dir: Path, job_id: str) -> dict:
    env = dict(os.environ, PATH=f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}",
               SLURM_SUBMIT_DIR=str(REPO), SLURM_JOB_ID=job_id, SLURM_JOB_NAME="unicon-train", SLURM_JOB_NUM_NODES="1",
               SLURM_NNODES="1", SLURM_NTASKS="1", SLURM_NTASKS_PER_NODE="1", SLURM_PROCID="0", SLURM_LOCALID="0",
               SLURM_NODEID="0", SLURM_NODELIST="localhost", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    env.pop("WANDB_MODE", None)  # the script sets it
    return env


@pytest.mark.slow
def test_train_sbatch_body_runs(srun_shim, tmp_path):
    sys.path.insert(0, str(REPO))
    from data_builders.shapes import main as build_shapes
    from standins import SMALL_INSTRUCT

    world = tmp_path / "world"
    build_shapes(["--out", str(world), "--num-train", "8", "--num-val", "2", "--num-test", "2", "--quiet",
                  "--num-ureason", "1", "--geneval-per-tag", "1", "--num-drift-seeds", "1", "--num-reason-train", "0", *SMALL_INSTRUCT])
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


@pytest.mark.slow
def test_evaluate_sbatch_body_runs(srun_shim, tmp_path):
    """The evaluation script on stand-ins: a tiny Janus export, placeholder COCO images, a tiny
    OWLv2, a tiny ShapesWorld CLIP and a tiny Qwen2-VL judge."""
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
    standins.tiny_clip(world, tmp_path / "clip")
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


# ---------------------------------------------------------------------------------------------
# slurm/evaluate_array.sbatch: checkpoints x suites x shards, then a dependent merge
# ---------------------------------------------------------------------------------------------
ARRAY_SCRIPT = REPO / "slurm" / "evaluate_array.sbatch"


def test_evaluate_array_sbatch_static():
    text = ARRAY_SCRIPT.read_text()
    assert subprocess.run(["bash", "-n", str(ARRAY_SCRIPT)]).returncode == 0
    directives = [line.split(None, 1)[1] for line in text.splitlines() if line.startswith("#SBATCH")]
    for needed in ("--signal=SIGUSR1@90", "--requeue", "--open-mode=append", "--output=slurm-%x-%A_%a.out"):
        assert needed in directives, needed
    assert "--shard" in text and "--merge" in text and "--dependency=\"afterok:$JOB\"" in text


def _sbatch_shim(bin_dir: Path, log: Path) -> None:
    """An ``sbatch`` that records its arguments and answers job ids 100, 101, ..."""
    shim = bin_dir / "sbatch"
    shim.write_text(f'#!/bin/bash\necho "$@" >> {log}\necho $((100 + $(wc -l < {log}) - 1))\n')
    shim.chmod(shim.stat().st_mode | stat.S_IEXEC)


def _submit_path(bin_dir: Path) -> str:
    """``PATH`` for submitting: the shims, then this interpreter's ``unicon`` (the submit directory's
    ``.venv/bin/activate`` is empty)."""
    return f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}"


def _submit_dir(root: Path, *ckpts: str) -> Path:
    """A folder to submit from: the checkpoints and the ``.venv/bin/activate`` the jobs source."""
    (root / ".venv" / "bin").mkdir(parents=True)
    (root / ".venv" / "bin" / "activate").write_text("")
    for ckpt in ckpts:
        (root / ckpt).mkdir(parents=True)
    return root


def test_evaluate_array_submits_the_shards_then_a_dependent_merge(srun_shim, tmp_path):
    log = tmp_path / "sbatch.log"
    _sbatch_shim(srun_shim, log)
    submit_dir = _submit_dir(tmp_path / "submit", "a/export", "b/export")
    env = dict(os.environ, PATH=_submit_path(srun_shim), CKPTS="a/export b/export", SUITES="drift cococon",
               SHARDS="3", OUT=str(tmp_path / "out"), SBATCH_ARGS="--partition=p")
    proc = subprocess.run(["bash", str(ARRAY_SCRIPT), "submit"], env=env, capture_output=True, text=True,
                          cwd=submit_dir)
    assert proc.returncode == 0, proc.stderr
    shards, merge = log.read_text().splitlines()
    assert shards.split() == ["--parsable", "--partition=p", "--array=0-11", str(ARRAY_SCRIPT), "task"]
    assert "--dependency=afterok:100" in merge.split() and "--array=0-3" in merge.split()
    assert merge.split()[-2:] == [str(ARRAY_SCRIPT), "merge"] and "shards job 100" in proc.stdout
    bad = subprocess.run(["bash", str(ARRAY_SCRIPT), "submit"], env={**env, "SUITES": "drift nosuch"},
                         capture_output=True, text=True, cwd=submit_dir)
    assert bad.returncode == 2 and "suite 'nosuch' cannot be sharded (SUITES: any of cococon, drift," in bad.stderr
    assert len(log.read_text().splitlines()) == 2  # nothing more was submitted


def test_evaluate_array_shards_every_suite_that_takes_shard():
    """``unicon evaluate --list-shardable`` prints exactly the registered suites whose CLI has --shard
    (the registry's ``shardable``)."""
    from unicon.evaluation.suites import suites

    helps = {name: subprocess.run([sys.executable, "-m", "unicon.cli", "evaluate", name, "--help"],
                                  capture_output=True, text=True).stdout for name in suites()}
    assert {name: "--shard" in text for name, text in helps.items()} == {n: s.shardable for n, s in suites().items()}
    listed = subprocess.run([sys.executable, "-m", "unicon.cli", "evaluate", "--list-shardable"], capture_output=True,
                            text=True, check=True).stdout
    assert listed.splitlines() == [n for n, s in suites().items() if s.shardable]


PLUGIN_SUITES = '''
from dataclasses import dataclass

from unicon.evaluation.framework import EvalSuite
from unicon.evaluation.suites import register


@dataclass
class ToyEvalConfig:
    enabled: bool = False
    every_n_epochs: int = 1


class ToySplit(EvalSuite):
    name, help, config = "toysplit", "a plugin suite that takes --shard", ToyEvalConfig


class ToyWhole(EvalSuite):
    name, help, config, shardable = "toywhole", "a plugin suite that does not", ToyEvalConfig, False


register(ToySplit())
register(ToyWhole())
'''


def test_evaluate_array_asks_the_suite_registry_which_suites_shard(srun_shim, tmp_path):
    """The script accepts the suites the registry declares shardable, plugins included, and refuses
    the others before submitting anything: a plugin package (entry point ``unicon.suites``) on the
    jobs' ``PYTHONPATH`` registers ``toysplit`` (shardable) and ``toywhole`` (not)."""
    site = tmp_path / "site"
    (site / "toy_suites").mkdir(parents=True)
    (site / "toy_suites" / "__init__.py").write_text(PLUGIN_SUITES)
    dist = site / "toy_suites-0.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: toy_suites\nVersion: 0.0\n")
    (dist / "entry_points.txt").write_text("[unicon.suites]\ntoy_suites = toy_suites\n")
    log = tmp_path / "sbatch.log"
    _sbatch_shim(srun_shim, log)
    submit_dir = _submit_dir(tmp_path / "submit", "a/export")
    env = dict(os.environ, PATH=_submit_path(srun_shim), PYTHONPATH=str(site), CKPTS="a/export", SHARDS="2",
               OUT=str(tmp_path / "out"))

    def submit(suites: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", str(ARRAY_SCRIPT), "submit"], env={**env, "SUITES": suites},
                              capture_output=True, text=True, cwd=submit_dir)

    refused = submit("drift toywhole")
    assert refused.returncode == 2, refused.stderr
    assert "suite 'toywhole' cannot be sharded" in refused.stderr and "toysplit" in refused.stderr
    assert not log.exists()
    accepted = submit("drift toysplit")
    assert accepted.returncode == 0, accepted.stderr
    assert "--array=0-3" in log.read_text().splitlines()[0].split()


def test_evaluate_array_submit_checks_its_inputs_before_sbatch(srun_shim, tmp_path):
    log = tmp_path / "sbatch.log"
    _sbatch_shim(srun_shim, log)
    submit_dir = _submit_dir(tmp_path / "submit", "a/export")
    (tmp_path / "out_file").write_text("x")
    env = dict(os.environ, PATH=_submit_path(srun_shim), CKPTS="a/export b/export", SUITES="cococon",
               SHARDS="2", OUT=str(tmp_path / "out"))

    def submit(cwd: Path = submit_dir, **extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", str(ARRAY_SCRIPT), "submit"], env={**env, **extra}, capture_output=True,
                              text=True, cwd=cwd)

    missing = submit()
    assert missing.returncode == 2, missing.stderr
    assert missing.stderr.strip() == \
        f"evaluate_array: checkpoint 'b/export' (CKPTS) does not exist (the jobs start in {submit_dir})"
    bad_out = submit(CKPTS="a/export", OUT=str(tmp_path / "out_file"))
    assert bad_out.returncode == 2 and "OUT" in bad_out.stderr and "is not a folder" in bad_out.stderr
    no_venv = submit(cwd=submit_dir / "a", CKPTS="export")
    assert no_venv.returncode == 2 and "no .venv/bin/activate in" in no_venv.stderr
    assert not log.exists()  # nothing was submitted
    assert submit(CKPTS="a/export").returncode == 0 and len(log.read_text().splitlines()) == 2


@pytest.mark.slow
def test_evaluate_array_tasks_and_merge_equal_one_run(srun_shim, tmp_path):
    """The array body for 1 checkpoint x drift x 2 shards, then the merge body, as SLURM runs them;
    drift.json equals an unsharded ``unicon evaluate drift`` byte for byte. Each run is its own
    process and records the checkout's git state, which others may commit to meanwhile in a shared
    tree: those two values are compared for presence only (tests/test_sharding.py pins them)."""
    import standins

    if not (REPO / ".venv" / "bin" / "unicon").is_file():
        pytest.skip("needs the project's virtual environment (make setup), which the script activates")
    ckpt, args = standins.drift_shard_case(tmp_path)
    env = slurm_env(srun_shim, "5")
    env.update(SLURM_SUBMIT_DIR=str(tmp_path), CKPTS=str(ckpt), SUITES="drift", SHARDS="2", OUT=str(tmp_path / "out"),
               DRIFT_ARGS=args, PYTHONPATH=standins.fake_backend_plugin(tmp_path / "plugin"))  # backend "fake"
    for role, ids in (("task", (0, 1)), ("merge", (0,))):
        for i in ids:
            proc = subprocess.run(["bash", str(ARRAY_SCRIPT), role], env={**env, "SLURM_ARRAY_TASK_ID": str(i)},
                                  capture_output=True, text=True, timeout=600, cwd=tmp_path)
            assert proc.returncode == 0, (role, i, proc.stdout[-2000:], proc.stderr[-2000:])
    merged = tmp_path / "out" / "00-export" / "drift" / "drift.json"
    standins.assert_drift_equals_one_run(merged, ckpt, args, env, tmp_path / "one")
