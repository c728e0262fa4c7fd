"""Training the way users train: mixed precision, the trainer presets and the DeepSpeed strategies.

Every preset and strategy runs here on CPU with only the accelerator swapped (precision, clipping,
optimizer and strategy kept): DeepSpeed's CPU accelerator trains ZeRO-2/3 over gloo, and
Lightning's ``bf16-mixed`` autocasts on CPU as on CUDA.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from conftest import EPS32, float32_tol

from unicon.config import compose
from unicon.errors import UserError

sys.path.insert(0, str(Path(__file__).parent))

#: bfloat16's unit roundoff: 8 significant bits
U_BF16 = 2.0 ** -8


def bfloat16_tol(scale: float, depth: int) -> float:
    """A forward-error bound for a value that autocast computes with bfloat16 matmuls.

    Autocast rounds a matmul's two inputs to bfloat16 (relative error ``u`` each) and accumulates in
    float32, so each product term is off by at most ``2u`` relative and a layer's output by
    ``2u * sum|x_i w_i|``; ``depth`` such layers in a row, on values of magnitude ``scale``, give at
    most ``depth * 2u * scale``. Worst case and machine independent; the float32 accumulation's own
    error (``n * eps32``, :func:`conftest.float32_tol`) is two orders of magnitude smaller."""
    return depth * 2.0 * U_BF16 * max(scale, 1.0)


# ---- mixed precision ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_ofa_batch(tiny_shapes_world):
    """The world's tiny OFA (random init, seed 0) in a ConsistencyModule, and a contrast batch of 6."""
    from unicon.models import build_model
    from unicon.training.datamodule import ConsistencyDataModule, collate_contrast
    from unicon.training.module import ConsistencyModule

    cfg = compose(["model=ofa_shapes_tiny", f"data.root={tiny_shapes_world}"])
    torch.manual_seed(0)
    module = ConsistencyModule(build_model(cfg.model, tiny_shapes_world), cfg)
    data = ConsistencyDataModule(cfg.data)
    data.setup()
    return module, collate_contrast([data.contrast[i] for i in range(6)])


def test_bf16_autocast_scores_and_rank_loss_stay_float32(tiny_ofa_batch):
    """Under ``bf16-mixed`` the matmuls run in bfloat16, but the scores (log-softmax of float32
    logits) and the soft-rank loss are float32: the loss of given scores is the same inside and
    outside autocast up to float32 rounding, and the whole consistency loss is within the bfloat16
    bound of its float32 value."""
    from unicon.losses.consistency import consistency_loss

    module, batch = tiny_ofa_batch
    model, n = module.model, len(batch["samples"])
    anchors = [[s.caption] + [c.caption for c in cs] for s, cs in zip(batch["samples"], batch["contrasts"])]
    with torch.no_grad():
        full = module.consistency_loss(batch)
        s0 = model.score_text(batch["images"], [model.caption_prompt] * n, anchors)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            mixed = module.consistency_loss(batch)
            s0_mixed = model.score_text(batch["images"], [model.caption_prompt] * n, anchors)
            si = s0_mixed.nll.flip(1)  # any second score matrix with the same mask
            const_mixed = consistency_loss("spearman", s0_mixed.nll, si, s0_mixed.mask)
        const = consistency_loss("spearman", s0_mixed.nll, si, s0_mixed.mask)
    assert s0_mixed.nll.dtype == s0_mixed.sum_nll.dtype == torch.float32
    assert mixed["loss"].dtype == mixed["loss_const"].dtype == torch.float32
    # the loss of the same scores: float32 in and out of autocast (reductions over K <= 6 candidates)
    assert abs(float(const_mixed) - float(const)) <= float32_tol(6, float(const), depth=3)
    # the scores themselves: bfloat16 matmuls through the encoder and decoder layers and the output
    # projection (depth = layers + 1), on NLLs of the scores' magnitude
    arch = model.ofa.config
    depth = arch.encoder_layers + arch.decoder_layers + 1
    scale = float(s0.nll.abs().max())
    assert (s0_mixed.nll - s0.nll).abs().max() <= bfloat16_tol(scale, depth)
    assert not torch.equal(s0_mixed.nll, s0.nll)  # autocast did run the matmuls in bfloat16
    assert abs(float(mixed["loss_ce"]) - float(full["loss_ce"])) <= bfloat16_tol(float(full["loss_ce"]), depth)
    assert EPS32 < U_BF16


def test_bf16_mixed_trains_m_and_k_with_fused_adamw_and_clipping(tiny_shapes_world, tmp_path):
    """``trainer.precision=bf16-mixed`` with the presets' fused AdamW and gradient clipping (Lightning's
    mixed-precision plugin refuses to clip for fused optimizers): M (spearman) and K (none) train."""
    from unicon.training.run import train

    for loss in ("spearman", "none"):
        out = train(compose([
            "trainer=cpu", "model=ofa_shapes_tiny", "logger=csv", "eval=none", f"data.root={tiny_shapes_world}",
            f"output_dir={tmp_path}", f"name={loss}", "trainer.precision=bf16-mixed", "trainer.gradient_clip_val=1.0",
            "trainer.max_steps=3", "trainer.enable_progress_bar=false", "loss.gamma=0.7", f"loss.type={loss}",
            "data.batch_size=4", "data.contrast_batch_size=3", "optim.lr=1e-3"]))
        assert out["global_step"] == 3
        assert out["counts"]["consistency_updates"] >= 1 and out["counts"]["standard_updates"] >= 1
        assert torch.isfinite(torch.tensor(out["metrics"]["train/loss"]))


def test_nonfinite_guard_under_bf16_mixed(tmp_path, monkeypatch):
    import unicon.models.factory
    from test_training import TinyUnified, make_world, run_cfg

    from unicon.training.module import NonFiniteLossError
    from unicon.training.run import train

    world = make_world(tmp_path / "world")
    monkeypatch.setattr(unicon.models.factory, "build_model", lambda c, world_root=None: TinyUnified(nan=True))
    with pytest.raises(NonFiniteLossError, match=r"global step 0 \(batch 0"):
        train(run_cfg(world, tmp_path, "trainer.max_steps=1", "trainer.precision=bf16-mixed"))


@pytest.mark.parametrize("overrides, key", [
    (["trainer.accelerator=cpu", "trainer.precision=16-mixed"], "trainer.precision='16-mixed'"),
    (["trainer.strategy=deepspeed_zero2", "data.batching=mixed"], "data.batching='mixed'"),
    (["trainer.strategy=deepspeed_zero3", "loss.task_draw=per_sample"], "loss.task_draw='per_sample'"),
])
def test_pairs_that_cannot_work_fail_at_compose_naming_the_key(overrides, key):
    from unicon.config import ConfigError

    with pytest.raises(ConfigError, match=rf"command line: {key} ") as err:
        compose(overrides)
    assert len(str(err.value).splitlines()) == 1


def test_auto_batching_and_task_draw_follow_the_strategy():
    zero = compose(["trainer.strategy=deepspeed_zero2"])
    assert (zero.data.batching, zero.loss.task_draw) == ("by_task", "per_step")
    ddp = compose(["trainer.strategy=ddp"])
    assert (ddp.data.batching, ddp.loss.task_draw) == ("mixed", "per_sample")


def test_a_loss_scaler_gets_the_unfused_adamw():
    """Under ``16-mixed`` (a GradScaler; CUDA only: Lightning runs ``16-mixed`` as bf16 on CPU) the
    scaler must unscale before clipping, which the fused kernel does not allow."""
    from unicon.training.optim import build_optimizer

    model = torch.nn.Linear(4, 4)
    assert build_optimizer("adamw", model, 1e-3, 0.01, (0.9, 0.999)).defaults["fused"]
    assert not build_optimizer("adamw", model, 1e-3, 0.01, (0.9, 0.999), scaled_gradients=True).defaults["fused"]


# ---- the trainer presets, accelerator swapped to CPU --------------------------------------------------
TINY = ["model.arch.d_model=32", "model.arch.encoder_layers=1", "model.arch.decoder_layers=1",
        "model.arch.encoder_ffn_dim=64", "model.arch.decoder_ffn_dim=64"]


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["gpu", "slurm_multinode"])
def test_trainer_preset_runs_consistency_training_on_cpu(preset, tiny_shapes_world, tmp_path):
    """``unicon train trainer=<preset>`` as a user types it, with only the accelerator (and the device
    count, to this machine's 2 processes) swapped: the preset's precision (bf16-mixed), gradient
    clipping, fused AdamW and strategy (DDP; DeepSpeed ZeRO-2) run consistency steps, and under
    DeepSpeed the epoch-end evaluations."""
    import json
    import os
    import subprocess

    from omegaconf import OmegaConf

    repo = Path(__file__).resolve().parents[1]
    preset_cfg = OmegaConf.load(repo / "configs" / "trainer" / f"{preset}.yaml")
    if str(preset_cfg.strategy).startswith("deepspeed"):
        pytest.importorskip("deepspeed")
    zero = str(preset_cfg.strategy).startswith("deepspeed")
    # DeepSpeed: also the epoch-end evaluations (3 steps = one epoch of the 12-row world at 2 x 2 rows)
    evaluation = ["eval=shapes", "eval.fail_on_error=true", "eval.drift.embedders=[scene]", "eval.drift.generations=1",
                  "eval.drift.num_chains=2", "eval.cococon.max_samples=2", "eval.ureason.max_samples=2"] \
        if zero else ["eval=none"]
    args = [f"trainer={preset}", "trainer.accelerator=cpu", "trainer.devices=2", "trainer.num_nodes=1",
            f"data.root={tiny_shapes_world}", f"output_dir={tmp_path}", "name=run", "trainer.max_steps=3",
            "trainer.max_epochs=1", "trainer.log_every_n_steps=1", "trainer.enable_progress_bar=false", *evaluation,
            "logger=csv", "loss.gamma=0.7", "data.batch_size=2", "data.contrast_batch_size=3", *TINY]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-m", "unicon.cli", "train", *args], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{preset}:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    stored = OmegaConf.load(tmp_path / "run" / "config.yaml")
    assert stored.trainer.precision == preset_cfg.precision == "bf16-mixed"
    assert stored.trainer.strategy == preset_cfg.strategy and stored.trainer.gradient_clip_val == 1.0
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["train/loss"] for r in rows if "train/loss" in r]
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
    assert max(r.get("train/consistency_updates", 0) for r in rows) >= 1
    assert (tmp_path / "run" / "export" / "unicon_model.json").is_file()
    if zero:
        evaluated = {k: v for r in rows for k, v in r.items() if k.endswith("/failed")}
        assert evaluated == {"cococon/failed": 0.0, "drift/failed": 0.0, "ureason/failed": 0.0}


# ---- epoch-end evaluation under ZeRO-3 ---------------------------------------------------------------
#: the suites' files compared byte for byte (as in test_eval_ddp)
EVAL_FILES = {"cococon": ["results.json", "per_sample.jsonl"], "drift": ["drift.json"],
              "ureason": ["ureason.json", "samples.jsonl", "table.md"]}


@pytest.mark.slow
def test_epoch_end_evaluation_under_zero3_equals_ddp(tiny_shapes_world, tmp_path):
    """Every suite at the epoch end of a 2-rank run, ZeRO-3 (parameters partitioned, gathered for the
    evaluation by ``ZeroStrategy.gathered_parameters``) against DDP: the same files, byte for byte,
    and the same metrics. The learning rate (1e-12) leaves every weight of magnitude > 1e-4 where
    it was (an AdamW step moves a weight by about lr, below half its float32 spacing), so both
    strategies evaluate the same network."""
    import json
    import os
    import subprocess

    pytest.importorskip("deepspeed")
    repo = Path(__file__).resolve().parents[1]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    runs = {}
    for strategy in ("ddp", "deepspeed_zero3"):
        args = ["trainer=cpu", "trainer.devices=2", f"trainer.strategy={strategy}", f"data.root={tiny_shapes_world}",
                f"output_dir={tmp_path}", f"name={strategy}", "trainer.max_epochs=1", "trainer.limit_train_batches=1",
                "trainer.enable_progress_bar=false", "logger=csv", "loss.gamma=1", "optim.lr=1e-12",
                "data.batch_size=2", "data.contrast_batch_size=2", "data.batching=by_task", "loss.task_draw=per_step",
                "eval=shapes", "eval.fail_on_error=true", "eval.drift.embedders=[scene]", "eval.drift.generations=1",
                "eval.drift.num_chains=3", "eval.drift.batch_size=2", "eval.cococon.max_samples=3",
                "eval.cococon.batch_size=2", "eval.ureason.max_samples=3", "eval.ureason.batch_size=2", *TINY]
        proc = subprocess.run([sys.executable, "-m", "unicon.cli", "train", *args], cwd=repo, env=env,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, f"{strategy}:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
        rows = [json.loads(line) for line in (tmp_path / strategy / "metrics.jsonl").read_text().splitlines()]
        runs[strategy] = {k: v for r in rows for k, v in r.items()
                          if k.split("/")[0] in EVAL_FILES and not k.endswith("/seconds")}
    assert runs["ddp"] and runs["ddp"] == runs["deepspeed_zero3"]
    assert all(runs["ddp"][f"{suite}/failed"] == 0.0 for suite in EVAL_FILES)
    for suite, names in EVAL_FILES.items():
        for name in names:
            ddp = tmp_path / "ddp" / "eval" / suite / "epoch-1" / name
            zero3 = tmp_path / "deepspeed_zero3" / "eval" / suite / "epoch-1" / name
            assert ddp.read_bytes() == zero3.read_bytes(), (suite, name)


def test_a_deepspeed_save_cut_short_leaves_no_complete_marker(tmp_path, monkeypatch):
    """``ZeroStrategy.save_checkpoint`` removes ``complete.json`` before the ranks write into the folder
    and writes it (with the step) only after all of them finished: a kill during the writes leaves a
    folder that resume and the SLURM restart refuse."""
    pytest.importorskip("deepspeed")
    from lightning.pytorch.strategies import DeepSpeedStrategy

    from unicon.models import DEEPSPEED_COMPLETE_FILE, deepspeed_checkpoint_step
    from unicon.training.zero import ZeroStrategy

    class OneRank(ZeroStrategy):
        is_global_zero = True

        def barrier(self, name=None):
            pass

    folder = tmp_path / "last.ckpt"
    folder.mkdir()
    (folder / DEEPSPEED_COMPLETE_FILE).write_text('{"global_step": 2}\n')  # the previous save's

    def killed(self, checkpoint, filepath, storage_options=None):
        (Path(filepath) / "latest").write_text("checkpoint")
        raise KeyboardInterrupt("killed while writing")

    strategy = OneRank.__new__(OneRank)
    monkeypatch.setattr(DeepSpeedStrategy, "save_checkpoint", killed)
    with pytest.raises(KeyboardInterrupt):
        strategy.save_checkpoint({"global_step": 4}, folder)
    assert deepspeed_checkpoint_step(folder) is None

    monkeypatch.setattr(DeepSpeedStrategy, "save_checkpoint", lambda self, c, f, s=None: None)
    strategy.save_checkpoint({"global_step": 4}, folder)
    assert deepspeed_checkpoint_step(folder) == 4


# ---- a rank that fails at start-up ends the run --------------------------------------------------------
#: ``unicon train`` with ``ZeroStrategy.setup_environment`` (where the ranks join DeepSpeed's process
#: group) failing on the rank named by $UNICON_FAILING_RANK; Lightning starts the other rank with
#: the same script
FAILING_RANK_SCRIPT = """\
import os
import sys

from unicon.training import zero

rank = os.environ.get("LOCAL_RANK", "0")
if rank == os.environ["UNICON_FAILING_RANK"]:
    def fail(self):
        raise RuntimeError(f"rank {rank} failed while DeepSpeed set up")

    zero.ZeroStrategy.setup_environment = fail

from unicon.cli import main

sys.exit(main())
"""


@pytest.mark.slow
@pytest.mark.parametrize("failing_rank", ["0", "1"])
def test_a_rank_failing_while_deepspeed_sets_up_ends_the_run(failing_rank, tiny_shapes_world, tmp_path):
    """A 2-rank ZeRO-2 run on CPU (Lightning's launcher: rank 0 starts rank 1) whose rank 0 or 1 fails
    while DeepSpeed sets up ends, every process of it, with that rank's error and a failing exit
    code. A failing rank 1 is Lightning's (it kills the run); a failing rank 0 left rank 1 waiting
    for its rendezvous (30 minutes): the run's output pipes stayed open, ``communicate`` timed out."""
    import os
    import signal
    import subprocess

    pytest.importorskip("deepspeed")
    repo = Path(__file__).resolve().parents[1]
    script = tmp_path / "failing_rank.py"
    script.write_text(FAILING_RANK_SCRIPT)
    args = ["trainer=cpu", "trainer.devices=2", "trainer.strategy=deepspeed_zero2", f"data.root={tiny_shapes_world}",
            f"output_dir={tmp_path}", "name=run", "trainer.max_steps=2", "trainer.enable_progress_bar=false",
            "logger=csv", "eval=none", "data.batch_size=2", "data.contrast_batch_size=2", *TINY]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", UNICON_FAILING_RANK=failing_rank)
    proc = subprocess.Popen([sys.executable, str(script), "train", *args], cwd=repo, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        # the pipes close when every process of the run has ended, the launched rank included
        _, err = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        pytest.fail(f"rank {failing_rank} failed while DeepSpeed set up, and the run did not end within 600 s")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever is left of the run's process group
        except ProcessLookupError:
            pass
    assert proc.returncode != 0, err[-3000:]
    assert f"rank {failing_rank} failed while DeepSpeed set up" in err, err[-3000:]
