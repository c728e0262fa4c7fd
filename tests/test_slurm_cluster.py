"""``slurm/train.sbatch`` on a real SLURM: a one-node cluster on this machine (``slurm/local-cluster.sh``).

A 2-task gloo DDP run of a tiny OFA is warned with SIGUSR1 mid-run, as SLURM does 90 s before a
time limit. It must checkpoint at a step boundary, requeue itself, and the requeued job (same job
id and run folder) must continue from that exact step: ``metrics.jsonl`` holds every step once,
the γ draws are those of one uninterrupted generator, and the W&B run id is the same. A 2-task
DeepSpeed ZeRO-2 consistency run on the CPU, requeued the same way, resumes from its checkpoint
folder and ends with the weights and per-step metrics of the same job run without the signal. A
2-task DeepSpeed job whose second task fails while DeepSpeed sets up ends at once, with its error.

Needs root and either SLURM's Debian packages or apt-get with a reachable Debian mirror (the
cluster script installs them); otherwise skipped with the reason. The cluster lives in a
temporary folder on free ports and is brought down at the end.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
CLUSTER = REPO / "slurm" / "local-cluster.sh"

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


def _free_port_pair() -> int:
    """A port p with p and p + 1 free (slurmctld, slurmd)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port < 65535:
            with socket.socket() as s2:
                try:
                    s2.bind(("127.0.0.1", port + 1))
                    return port
                except OSError:
                    continue
    pytest.fail("no two consecutive free ports")


@pytest.fixture(scope="module")
def slurm_cluster(tmp_path_factory):
    if os.geteuid() != 0:
        pytest.skip("the local SLURM cluster needs root (slurmd runs job steps as the submitting user)")
    installed = all(shutil.which(c) for c in ("munged", "slurmctld", "slurmd", "sbatch"))
    if not installed and not shutil.which("apt-get"):
        pytest.skip("SLURM is not installed and there is no apt-get to install slurmctld slurmd slurm-client munge")
    state = tmp_path_factory.mktemp("slurm")
    env = dict(os.environ, UNICON_SLURM_DIR=str(state), UNICON_SLURM_PORT=str(_free_port_pair()))
    proc = subprocess.run(["bash", str(CLUSTER), "up"], env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        if not installed:  # apt-get failed: no network to the mirror, or no Debian
            pytest.skip(f"could not install SLURM's Debian packages: {proc.stderr.strip()[-500:]}")
        pytest.fail(f"local-cluster.sh up failed:\n{proc.stdout}{proc.stderr}")
    env["SLURM_CONF"] = str(state / "slurm.conf")
    try:
        yield env
    finally:
        down = subprocess.run(["bash", str(CLUSTER), "down"], env=env, capture_output=True, text=True, timeout=120)
        assert down.returncode == 0, down.stderr


def _job(env: dict, job_id: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "-o", "show", "job", job_id], env=env, capture_output=True, text=True,
                         check=True).stdout
    return dict(kv.split("=", 1) for kv in out.split() if "=" in kv)


def _wait(what: str, cond, timeout: float, log: Path, env: dict, job_id: str):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = cond()
        if value:
            return value
        state = _job(env, job_id)
        if state["JobState"] in ("FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY") or (
                what != "the job to finish" and state["JobState"] == "COMPLETED") or (
                state["JobState"] == "PENDING" and state.get("Reason") not in ("None", "Priority", "Resources",
                                                                              "BeginTime")):  # never runs
            value = cond()  # the job may have reached what was awaited between the two reads
            if value:
                return value
            break
        time.sleep(0.2)
    slurmctld = Path(env["UNICON_SLURM_DIR"]) / "log" / "slurmctld.log"
    pytest.fail(f"waiting for {what}: job {job_id} is {state['JobState']} ({state.get('Reason')}); job log:\n"
                f"{log.read_text()[-4000:] if log.is_file() else '(none)'}\nslurmctld.log:\n"
                f"{slurmctld.read_text()[-2000:] if slurmctld.is_file() else '(none)'}")


def _train_rows(metrics: Path) -> list[dict]:
    if not metrics.is_file():
        return []
    rows = []
    for line in metrics.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:  # a row being written
            continue
        if "train/loss" in row:
            rows.append(row)
    return rows


#: a tiny OFA: seconds per run on two cores
TINY = ["model.arch.d_model=32", "model.arch.encoder_layers=1", "model.arch.decoder_layers=1",
        "model.arch.encoder_ffn_dim=64", "model.arch.decoder_ffn_dim=64"]


def _needs_venv() -> None:
    if not (REPO / ".venv" / "bin" / "unicon").is_file():
        pytest.skip("needs the project's virtual environment (make setup), which the sbatch script activates")


def _train_env(cluster_env: dict) -> dict:
    env = dict(cluster_env, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    env.pop("WANDB_MODE", None)  # the script sets offline
    return env


def _submit_train(env: dict, overrides: list[str], log: Path) -> str:
    """``sbatch slurm/train.sbatch OVERRIDES`` as one node with 2 tasks (2 ranks) on the CPU; the job id."""
    # The script's GPU allocation is overridden on the command line; 2 tasks = 2 ranks.
    submit = subprocess.run(["sbatch", "--parsable", "--nodes=1", "--ntasks-per-node=2", "--gpus-per-node=0",
                             "--cpus-per-task=1", "--time=10", f"--output={log}", str(REPO / "slurm" / "train.sbatch"),
                             *overrides], env=env, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert submit.returncode == 0, submit.stderr
    return submit.stdout.strip().split(";")[0]


def _wait_to_end(env: dict, job_id: str, log: Path, timeout: float = 300) -> str:
    """The job's final state, once it has one."""
    return _wait("the job to finish",
                 lambda: (s := _job(env, job_id)["JobState"]) not in ("PENDING", "RUNNING", "REQUEUED",
                                                                      "COMPLETING", "CONFIGURING") and s,
                 timeout, log, env, job_id)


def _requeue_mid_run(env: dict, job_id: str, metrics: Path, log: Path, signal_at: int,
                     start_timeout: float = 240) -> tuple[int, str]:
    """Once ``metrics.jsonl`` has a row for step ``signal_at`` (within ``start_timeout`` s), SIGUSR1
    to every task (SLURM's warning before a time limit); then wait for the job's requeue, restart and
    end. Returns the last step logged before the signal and the job's final state."""
    try:
        _wait(f"step {signal_at}", lambda: any(r["step"] >= signal_at for r in _train_rows(metrics)), start_timeout,
              log, env, job_id)
        signalled_after = max(r["step"] for r in _train_rows(metrics))
        # what `#SBATCH --signal=SIGUSR1@90` does before the time limit: USR1 to every task
        subprocess.run(["scancel", "--signal=USR1", job_id], env=env, check=True, timeout=30)
        _wait("the requeue", lambda: int(_job(env, job_id).get("Restarts", 0)) >= 1, 120, log, env, job_id)
        # SLURM holds a requeued job back for ~2 minutes (its BeginTime); a cluster has other jobs
        # to run meanwhile, this test has not.
        _wait("the job to be pending again", lambda: _job(env, job_id)["JobState"] in ("PENDING", "RUNNING"), 60,
              log, env, job_id)
        if _job(env, job_id)["JobState"] == "PENDING":
            # slurmd refuses a launch credential created in the same second as the revocation of the
            # job's previous one ("Killing non-startable batch job: Job credential revoked", and the
            # job ends FAILED); SLURM's own BeginTime delay avoids that, forcing the start must too
            time.sleep(2.0)
            subprocess.run(["scontrol", "update", f"jobid={job_id}", "StartTime=now"], env=env, check=True)
        final = _wait_to_end(env, job_id, log)
    finally:
        subprocess.run(["scancel", job_id], env=env, timeout=30)
    return signalled_after, final


def test_requeued_ddp_job_resumes_at_the_exact_step(slurm_cluster, tiny_shapes_world, tmp_path):
    _needs_venv()
    env = _train_env(slurm_cluster)
    # Only CocoCon samples with contrasts: then every γ draw below γ is a consistency update, and the
    # logged update counts spell out the draws.
    world = tmp_path / "world"
    shutil.copytree(tiny_shapes_world, world)
    coco = json.loads((world / "cococon_train.json").read_text())
    coco["annotations"] = [a for a in coco["annotations"] if a["contrast_sets"]]
    (world / "cococon_train.json").write_text(json.dumps(coco))

    seed, gamma, max_steps, signal_at = 3, 0.5, 30, 4
    overrides = ["trainer=cpu", "trainer.strategy=ddp", f"data.root={world}", f"output_dir={tmp_path / 'runs'}",
                 f"trainer.max_steps={max_steps}", "trainer.max_epochs=-1", "trainer.log_every_n_steps=1",
                 "eval=none", f"seed={seed}", f"loss.gamma={gamma}", "data.batch_size=2",
                 "data.contrast_batch_size=2", "trainer.enable_progress_bar=false", *TINY]
    log = tmp_path / "job.out"
    job_id = _submit_train(env, overrides, log)
    run = tmp_path / "runs" / f"unicon-train-{job_id}"
    metrics = run / "metrics.jsonl"
    t0 = time.monotonic()
    signalled_after, final = _requeue_mid_run(env, job_id, metrics, log, signal_at)
    out = log.read_text()
    print(f"job {job_id}: {final} after {time.monotonic() - t0:.0f} s (cluster + job)\n{out[-3000:]}")
    assert final == "COMPLETED", out[-4000:]
    assert int(_job(env, job_id)["Restarts"]) == 1

    # the first attempt checkpointed at a step boundary after the signal and requeued itself
    hpc = run / "hpc_ckpt_1.ckpt"
    assert hpc.is_file() and not (run / "hpc_ckpt_2.ckpt").exists()
    step = torch.load(hpc, map_location="cpu", weights_only=True, mmap=True)["global_step"]
    assert signalled_after < step < max_steps
    assert f"requeueing SLURM job {job_id}" in out
    # the second attempt resumed from it (not from an epoch-end last.ckpt), at its step
    assert f"restarted (1x): resuming from {hpc}" in out
    assert f"resume: {hpc} (run 'unicon-train-{job_id}', step {step})" in out
    assert "dropped" not in out  # the first attempt stopped at the checkpoint: no rows to undo

    rows = _train_rows(metrics)
    assert [r["step"] for r in rows] == list(range(max_steps)), "every step logged exactly once"
    # γ draws: one per step from one generator seeded with `seed`, across the requeue
    gen = torch.Generator().manual_seed(seed)
    drawn = [int(torch.rand((), generator=gen).item() < gamma) for _ in range(max_steps)]
    counts = [0] + [int(r["train/consistency_updates"]) for r in rows]
    assert [b - a for a, b in zip(counts, counts[1:])] == drawn
    assert 0 < sum(drawn[step:]) < max_steps - step  # both update kinds after the resume

    run_id = (run / "wandb_run_id").read_text().strip()
    attempts = sorted((run / "wandb").glob("offline-run-*"))
    assert len(attempts) == 2 and all(p.name.endswith(f"-{run_id}") for p in attempts), attempts
    assert (run / "export" / "training_config.json").is_file()


def test_requeued_zero2_consistency_job_equals_an_uninterrupted_one(slurm_cluster, tiny_shapes_world, tmp_path):
    """A 2-rank DeepSpeed ZeRO-2 consistency job (γ > 0, on CPU) warned with SIGUSR1 mid-run saves the
    checkpoint folder ``hpc_ckpt_1.ckpt`` (with ``complete.json``), requeues itself, and the restart
    resumes from that folder. It ends with the same final weights (the export, converted from its
    last checkpoint folder) and the same per-step ``train/`` rows as the same job run without the
    signal: both are the same ZeRO-2 computation on the same data in the same order (fp32, one
    thread per rank, a 2-rank gradient sum that is exact either way round) and the checkpoint
    restores the fp32 weights, the optimizer and LR-scheduler state, the data position and the γ
    generator bit for bit, so the two runs agree exactly, with no rounding to allow for."""
    _needs_venv()
    try:
        import deepspeed  # noqa: F401
    except ImportError as e:  # the [deepspeed] extra (make setup installs it)
        pytest.skip(f"needs deepspeed (pip install -e '.[deepspeed]'): {e}")
    from unicon.models import DEEPSPEED_COMPLETE_FILE, deepspeed_checkpoint_step, deepspeed_client_state, load_model

    # DeepSpeed's shared-memory all-reduce op (ZeRO on CPU) comes from torch's extension cache, built at
    # make setup with the virtual environment's ninja, the one train.sbatch's jobs run with
    env = _train_env(slurm_cluster)
    seed, max_steps, signal_at = 5, 30, 2
    # γ = 0.5: consistency and plain steps both, so the γ generator's restored state matters;
    # data.batching and loss.task_draw resolve to by_task and per_step under DeepSpeed
    overrides = ["trainer=cpu", "trainer.strategy=deepspeed_zero2", f"data.root={tiny_shapes_world}",
                 f"output_dir={tmp_path / 'runs'}", f"trainer.max_steps={max_steps}", "trainer.max_epochs=-1",
                 "trainer.log_every_n_steps=1", "eval=none", "logger=csv", f"seed={seed}", "loss.gamma=0.5",
                 "data.batch_size=2", "data.contrast_batch_size=3", "trainer.enable_progress_bar=false", *TINY]
    t0 = time.monotonic()
    log = tmp_path / "requeued.out"
    job_id = _submit_train(env, overrides, log)
    run = tmp_path / "runs" / f"unicon-train-{job_id}"
    signalled_after, final = _requeue_mid_run(env, job_id, run / "metrics.jsonl", log, signal_at,
                                              start_timeout=480)  # start-up on two busy cores
    out = log.read_text()
    print(f"requeued job {job_id}: {final} after {time.monotonic() - t0:.0f} s\n{out[-3000:]}")
    assert final == "COMPLETED", out[-4000:]
    assert int(_job(env, job_id)["Restarts"]) == 1

    t1 = time.monotonic()
    ref_log = tmp_path / "uninterrupted.out"
    ref_id = _submit_train(env, overrides, ref_log)
    try:
        ref_final = _wait_to_end(env, ref_id, ref_log)
    finally:
        subprocess.run(["scancel", ref_id], env=env, timeout=30)
    ref_out = ref_log.read_text()
    print(f"uninterrupted job {ref_id}: {ref_final} after {time.monotonic() - t1:.0f} s")
    assert ref_final == "COMPLETED", ref_out[-4000:]
    ref = tmp_path / "runs" / f"unicon-train-{ref_id}"

    # the first attempt saved a complete checkpoint folder at a step boundary after the signal
    hpc = run / "hpc_ckpt_1.ckpt"
    assert hpc.is_dir() and (hpc / DEEPSPEED_COMPLETE_FILE).is_file() and not (run / "hpc_ckpt_2.ckpt").exists()
    step = deepspeed_checkpoint_step(hpc)
    assert step == deepspeed_client_state(hpc)["global_step"]
    assert signalled_after < step < max_steps
    assert f"requeueing SLURM job {job_id}" in out
    # the second attempt resumed from that folder, at its step
    assert f"restarted (1x): resuming from {hpc}" in out
    assert f"resume: {hpc} (run 'unicon-train-{job_id}', step {step})" in out
    assert "dropped" not in out  # the first attempt stopped at the checkpoint: no rows to undo

    rows, ref_rows = _train_rows(run / "metrics.jsonl"), _train_rows(ref / "metrics.jsonl")
    assert [r["step"] for r in rows] == [r["step"] for r in ref_rows] == list(range(max_steps)), \
        "every step logged exactly once"
    for before, row, ref_row in zip([{}] + ref_rows, rows, ref_rows):
        train = {k: v for k, v in row.items() if k.startswith("train/")}
        ref_train = {k: v for k, v in ref_row.items() if k.startswith("train/")}
        assert "train/loss" in train and train == {k: ref_train.get(k) for k in train}, row["step"]
        if row["step"] < step:
            assert train == ref_train, row["step"]
        else:  # Lightning repeats a value logged at an earlier step (a consistency step's
            # loss_const, ...) in the rows after it; a restored trainer has none to repeat until the
            # next consistency step logs them again
            assert all(before.get(k) == v for k, v in ref_train.items() if k not in train), row["step"]
    updates = [int(r["train/consistency_updates"]) for r in rows]
    assert 0 < updates[-1] < max_steps  # consistency and plain steps both

    weights = load_model(run / "export").state_dict()
    ref_weights = load_model(ref / "export").state_dict()
    assert set(weights) == set(ref_weights)
    assert [k for k in weights if not torch.equal(weights[k], ref_weights[k])] == []
    assert "converted from the DeepSpeed checkpoint" in out


#: the job's ``sitecustomize.py``: in the task SLURM numbers $UNICON_FAILING_TASK,
#: ``ZeroStrategy.setup_environment`` (where the ranks join DeepSpeed's process group) fails
FAILING_TASK_SITECUSTOMIZE = """\
import os

if os.environ.get("SLURM_PROCID") == os.environ.get("UNICON_FAILING_TASK"):
    from unicon.training import zero

    def fail(self):
        raise RuntimeError(f"task {os.environ['SLURM_PROCID']} failed while DeepSpeed set up")

    zero.ZeroStrategy.setup_environment = fail
"""


def test_a_task_failing_while_deepspeed_sets_up_ends_the_job(slurm_cluster, tiny_shapes_world, tmp_path):
    """``srun --kill-on-bad-exit=1`` (slurm/train.sbatch): task 1 of a 2-task ZeRO-2 job fails before it
    joins the process group, and the job ends FAILED with its error within minutes; without the
    option task 0 waited for it in the rendezvous for the process group's 30-minute timeout."""
    _needs_venv()
    pytest.importorskip("deepspeed")
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(FAILING_TASK_SITECUSTOMIZE)
    env = dict(_train_env(slurm_cluster), PYTHONPATH=str(site), UNICON_FAILING_TASK="1")
    overrides = ["trainer=cpu", "trainer.strategy=deepspeed_zero2", f"data.root={tiny_shapes_world}",
                 f"output_dir={tmp_path / 'runs'}", "trainer.max_steps=2", "eval=none", "logger=csv",
                 "data.batch_size=2", "data.contrast_batch_size=2", "trainer.enable_progress_bar=false", *TINY]
    log = tmp_path / "job.out"
    job_id = _submit_train(env, overrides, log)
    try:
        final = _wait_to_end(env, job_id, log, timeout=480)  # start-up on two busy cores, then at once
    finally:
        subprocess.run(["scancel", job_id], env=env, timeout=30)
    out = log.read_text()
    assert final == "FAILED", out[-4000:]
    assert "task 1 failed while DeepSpeed set up" in out, out[-4000:]


def test_sharded_drift_array_and_merge_equal_one_run(slurm_cluster, tmp_path):
    """``slurm/evaluate_array.sbatch submit``: a 2-shard drift array job and its dependent merge job run
    on the cluster; the merged ``drift.json`` equals one unsharded ``unicon evaluate drift`` byte for
    byte (the checkout's git state, which others may commit to meanwhile, compared for presence)."""
    import re

    import standins

    if not (REPO / ".venv" / "bin" / "unicon").is_file():
        pytest.skip("needs the project's virtual environment (make setup), which the sbatch script activates")
    ckpt, args = standins.drift_shard_case(tmp_path)
    env = dict(slurm_cluster, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", CKPTS=str(ckpt), SUITES="drift", SHARDS="2",
               OUT=str(tmp_path / "out"), DRIFT_ARGS=args, SBATCH_ARGS="--gpus-per-node=0 --cpus-per-task=1 --time=10",
               PYTHONPATH=standins.fake_backend_plugin(tmp_path / "plugin"))  # sbatch exports it to the jobs
    t0 = time.monotonic()
    submit = subprocess.run(["bash", str(REPO / "slurm" / "evaluate_array.sbatch"), "submit"], env=env, cwd=tmp_path,
                            capture_output=True, text=True, timeout=60)
    assert submit.returncode == 0, submit.stderr
    shards_job, merge_job = re.search(r"shards job (\d+) .* merge job (\d+)", submit.stdout).groups()
    merged = tmp_path / "out" / "00-export" / "drift" / "drift.json"
    try:
        end = time.monotonic() + 600
        while time.monotonic() < end:
            queue = subprocess.run(["squeue", "-h", "-j", f"{shards_job},{merge_job}"], env=env, capture_output=True,
                                   text=True).stdout
            if not queue.strip():
                break
            time.sleep(1)
    finally:
        subprocess.run(["scancel", shards_job, merge_job], env=env, timeout=30)
    logs = "\n".join(f"{p.name}:\n{p.read_text()[-1500:]}" for p in sorted(tmp_path.glob("slurm-*.out")))
    print(f"array + merge: {time.monotonic() - t0:.0f} s\n{logs}")
    assert merged.is_file(), logs
    assert len(list(tmp_path.glob("slurm-unicon-eval-array-*.out"))) == 2, logs  # one log per shard task
    standins.assert_drift_equals_one_run(merged, ckpt, args, env, tmp_path / "one")
