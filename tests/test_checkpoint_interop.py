"""Checkpoints that load anywhere (issue 21, item 4): DeepSpeed ZeRO-2/3 folders through
``load_model`` and the export, LoRA adapters in PEFT's format, DeepSpeed configs.

**DeepSpeed on CPU here.** DeepSpeed (0.19.8) picks its CPU accelerator when there is no GPU and
talks gloo (oneCCL only when ``oneccl_bindings_for_pytorch`` is installed); ZeRO-2 and ZeRO-3 train
on it. Lightning's ``DeepSpeedStrategy`` refuses the CPU, in three places:

* ``setup_environment``: ``RuntimeError: The DeepSpeed strategy is only supported on CUDA GPUs but
  `CPUAccelerator` is used.``;
* ``setup_distributed``: ``RuntimeError: The selected device indices [None, None] don't match the
  local rank values of processes.`` (a CPU device has no index);
* ``deepspeed.initialize(args=Namespace(device_rank=root_device.index))``: ``TypeError: '>=' not
  supported between instances of 'NoneType' and 'int'`` (same cause).

:class:`CPUDeepSpeedStrategy` lifts exactly these -- indexed CPU devices (``torch.device("cpu", r)``
is the CPU) and DDP's environment setup without the CUDA check -- and everything else is
Lightning's and DeepSpeed's own code: the engine, ZeRO partitioning, Lightning's checkpoint folder
(DeepSpeed's ``save_checkpoint`` with Lightning's client state), and the conversion. ``unicon
train`` itself keeps refusing DeepSpeed without CUDA (test_training); the runs below replace
``check_strategy`` (its CUDA check) and ``make_strategy`` in their own processes (this file run
as a script, Lightning's launcher starting the second rank the same way).

**Ranks must run the same parameters.** ZeRO-2/3 reduce gradients from backward hooks into
buckets in the order gradients arrive; when the ranks' steps use different parameter subsets (a
consistency step's second task, or mixed-task batches), the buckets differ and gloo fails with
``op.preamble.length <= op.nbytes. 520420 vs 436244. Received data size doesn't match expected
size`` (seen with ``loss.gamma=1``). DDP copes (``find_unused_parameters``); DeepSpeed does not. So
these runs use ``data.batching=by_task`` and ``loss.gamma=0``: every rank's step is the same task.

Time: each 2-rank run is ~30-50 s on two busy cores (start-up, DeepSpeed's shared-memory op
build, 2 steps, checkpoint, conversion); the rest is seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
TINY = ["model.arch.d_model=32", "model.arch.encoder_layers=1", "model.arch.decoder_layers=1",
        "model.arch.encoder_ffn_dim=64", "model.arch.decoder_ffn_dim=64"]


def _deepspeed_or_skip():
    try:
        import deepspeed  # noqa: F401
    except ImportError as e:  # the [deepspeed] extra (make setup installs it)
        pytest.skip(f"needs deepspeed (pip install -e '.[deepspeed]'): {e}")


# ---- a DeepSpeed run on CPU, in its own processes ---------------------------------------------------
def _cpu_deepspeed_strategy_class():
    from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy

    class CPUDeepSpeedStrategy(DeepSpeedStrategy):
        """Lightning's DeepSpeedStrategy on DeepSpeed's CPU accelerator (see the module docstring)."""

        def setup_environment(self) -> None:
            if self.parallel_devices and all(d.type == "cpu" for d in self.parallel_devices):
                self.parallel_devices = [torch.device("cpu", i) for i in range(len(self.parallel_devices))]
                DDPStrategy.setup_environment(self)  # DeepSpeedStrategy's, minus its CUDA check
            else:
                super().setup_environment()

    return CPUDeepSpeedStrategy


def _run_main(argv: list[str]) -> None:
    """``python tests/test_checkpoint_interop.py OUT overrides...``: ``unicon.training.run.train``
    with the DeepSpeed strategy on CPU; rank 0 writes ``OUT/result.json`` and ``OUT/live.pt`` (the
    engine's parameters at the start and at the end of training, gathered from the ZeRO-3
    partitions)."""
    import deepspeed
    from lightning.pytorch.callbacks import Callback

    import unicon.training.run as run

    out, overrides = Path(argv[0]), argv[1:]
    cls, real = _cpu_deepspeed_strategy_class(), run.make_strategy

    def make_strategy(name: str, micro_batch_size: int = 1, **kwargs):
        if name.startswith("deepspeed"):
            return cls(config=run.deepspeed_config(name, micro_batch_size))
        return real(name, micro_batch_size, **kwargs)

    def check_strategy(name: str, micro_batch_size: int = 1):  # the CUDA check only; the config is read
        return run.deepspeed_config(name, micro_batch_size) if name.startswith("deepspeed") else None

    run.check_strategy, run.make_strategy = check_strategy, make_strategy

    class Live(Callback):
        def __init__(self):
            self.states = {}

        def _grab(self, trainer, pl_module, key):
            params = list(pl_module.model.parameters())
            with deepspeed.zero.GatheredParameters(params, modifier_rank=None):  # collective; no-op below ZeRO-3
                self.states[key] = {k: v.detach().clone() for k, v in pl_module.model.state_dict().items()}
            self.states[f"{key}_optimizer"] = type(trainer.strategy.deepspeed_engine.optimizer.optimizer
                                                   if hasattr(trainer.strategy.deepspeed_engine.optimizer, "optimizer")
                                                   else trainer.strategy.deepspeed_engine.optimizer).__name__

        def on_train_start(self, trainer, pl_module):
            self._grab(trainer, pl_module, "start")

        def on_train_end(self, trainer, pl_module):
            self._grab(trainer, pl_module, "end")
            if trainer.is_global_zero:
                torch.save(self.states, out / "live.pt")

    live = Live()
    result = run.train(run.compose_run(overrides), extra_callbacks=[live])
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        (out / "result.json").write_text(json.dumps({k: result[k] for k in ("ckpt_path", "export_dir", "global_step")}))


def _deepspeed_run(world: Path, out: Path, strategy: str, steps: int = 2) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    overrides = ["trainer=cpu", "trainer.devices=2", f"trainer.strategy={strategy}", f"data.root={world}",
                 f"output_dir={out / 'runs'}", "name=ds", f"trainer.max_steps={steps}", "trainer.max_epochs=-1",
                 "eval=none", "logger=csv", "trainer.enable_progress_bar=false", "data.batching=by_task",
                 "loss.gamma=0", "data.batch_size=2", "data.contrast_batch_size=2", "optim.lr=1e-3", *TINY]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", WANDB_MODE="offline",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO / "src"), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, __file__, str(out), *overrides], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, f"{strategy} run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return {**json.loads((out / "result.json").read_text()), "live": torch.load(out / "live.pt", weights_only=True),
            "log": proc.stdout + proc.stderr}


@pytest.fixture(scope="module")
def deepspeed_runs(tiny_shapes_world, tmp_path_factory) -> dict[str, dict]:
    _deepspeed_or_skip()
    root = tmp_path_factory.mktemp("deepspeed")
    return {stage: _deepspeed_run(tiny_shapes_world, root / stage, f"deepspeed_zero{stage[-1]}")
            for stage in ("zero2", "zero3")}


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_deepspeed_run_converts_through_load_model_and_export(deepspeed_runs, stage):
    from unicon.models import deepspeed_client_state, load_model, recorded_model_section

    run = deepspeed_runs[stage]
    assert run["global_step"] == 2
    folder = Path(run["ckpt_path"])
    assert folder.is_dir() and (folder / "latest").is_file()  # Lightning's DeepSpeed layout, not a file
    shards = sorted(p.name for p in (folder / "checkpoint").glob("*_states.pt"))
    if stage == "zero3":  # parameters partitioned: one model-states file per rank
        assert shards == [f"zero_pp_rank_{r}_mp_rank_00_{k}_states.pt" for r in (0, 1) for k in ("model", "optim")]
    else:  # weights whole in one file, optimizer state partitioned
        assert shards == ["mp_rank_00_model_states.pt"] + [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)]
    client = deepspeed_client_state(folder)
    assert client["global_step"] == 2 and client["unicon_config"]["trainer"]["strategy"] == f"deepspeed_{stage}"
    assert recorded_model_section(folder)["arch"]["d_model"] == 32
    # the run used plain AdamW (no offload), wrapped by ZeRO
    assert run["live"]["end_optimizer"] == "AdamW"

    model = load_model(folder)
    start, end = run["live"]["start"], run["live"]["end"]
    state = model.state_dict()
    assert set(state) == set(end)
    # fp32 training: the master weights DeepSpeed keeps (and the conversion gathers from every
    # rank's partition) are the engine's parameters, copied, not recomputed: equal bit for bit
    for name, value in end.items():
        assert torch.equal(state[name], value), name
    assert any(not torch.equal(end[k], start[k]) for k in end)  # it trained
    # the export is the same conversion, saved with save_pretrained
    export = Path(run["export_dir"])
    assert export == folder.parent / "export" and (export / "training_config.json").is_file()
    exported = load_model(export).state_dict()
    assert all(torch.equal(exported[k], v) for k, v in end.items())
    assert "converted from the DeepSpeed checkpoint" in run["log"]


@pytest.mark.slow
def test_deepspeed_folder_with_foreign_objects_needs_consent(deepspeed_runs, tmp_path):
    from unicon.errors import UserError
    from unicon.models import load_model

    folder = tmp_path / "last.ckpt"
    shutil.copytree(deepspeed_runs["zero2"]["ckpt_path"], folder)
    states = folder / "checkpoint" / "mp_rank_00_model_states.pt"
    blob = torch.load(states, weights_only=False)
    blob["foreign"] = argparse.Namespace(note="any class; unpickling it could run code")
    torch.save(blob, states)
    with pytest.raises(UserError, match=r"mp_rank_00_model_states\.pt: refusing to unpickle.*argparse\.Namespace"):
        load_model(folder)
    model = load_model(folder, allow_pickle=True)
    end = deepspeed_runs["zero2"]["live"]["end"]
    assert all(torch.equal(model.state_dict()[k], v) for k, v in end.items())

    (folder / "latest").write_text("global_step7\n")
    with pytest.raises(UserError, match="names the tag 'global_step7'"):
        load_model(folder)


# ---- DeepSpeed configs ---------------------------------------------------------------------------
def test_deepspeed_configs_take_the_micro_batch_from_data_and_offload_uses_cpu_adam(tmp_path, monkeypatch):
    from lightning.pytorch.strategies import DeepSpeedStrategy

    import unicon.training.run as run
    from unicon.config import STRATEGIES, config_dir
    from unicon.errors import UserError
    from unicon.training.module import offloads_optimizer

    names = [s for s in STRATEGIES if s.startswith("deepspeed")]
    assert sorted(names) == sorted(p.stem for p in (config_dir() / "strategy").glob("*.json"))
    for name in names:
        config = run.deepspeed_config(name, 6)
        assert config["train_micro_batch_size_per_gpu"] == 6
        offload = "offload" in name
        # DeepSpeed's default zero_force_ds_cpu_optimizer=true then insists on its CPU Adam
        assert "zero_force_ds_cpu_optimizer" not in config
        assert offloads_optimizer(DeepSpeedStrategy(config=config)) == offload, name
    assert not offloads_optimizer(run.make_strategy("ddp"))

    (tmp_path / "strategy").mkdir()
    (tmp_path / "strategy" / "deepspeed_zero2.json").write_text('{"train_micro_batch_size_per_gpu": 1}')
    monkeypatch.setattr(run, "config_dir", lambda: tmp_path)
    with pytest.raises(UserError, match=r"deepspeed_zero2\.json: train_micro_batch_size_per_gpu comes from "
                                        r"data\.batch_size"):
        run.deepspeed_config("deepspeed_zero2", 2)


def _cpu_adam_op_ready() -> str | None:
    """None when DeepSpeedCPUAdam's C++ op loads without compiling (installed with DS_BUILD_CPU_ADAM=1,
    or built before into torch's extension cache); otherwise why not."""
    from deepspeed.git_version_info import installed_ops
    from deepspeed.ops.op_builder import CPUAdamBuilder
    from torch.utils.cpp_extension import _get_build_directory

    builder = CPUAdamBuilder()
    if not builder.is_compatible(verbose=False):
        return "DeepSpeed's CPUAdamBuilder is not compatible with this machine"
    if installed_ops.get("cpu_adam") or any(Path(_get_build_directory(builder.name, False)).glob("*.so")):
        return None
    return ("DeepSpeedCPUAdam's C++ op is not built: its first use compiles it (1.5-6 min of 2 cores), too long "
            "for a unit test; make setup builds it once (scripts/build_deepspeed_ops.py)")


def test_offload_optimizer_is_deepspeed_cpu_adam_with_adamw_groups(tiny_shapes_world):
    """configure_optimizers under an offload config: DeepSpeedCPUAdam with the two AdamW groups,
    decoupled weight decay."""
    _deepspeed_or_skip()
    if (why := _cpu_adam_op_ready()) is not None:
        pytest.skip(why)
    from lightning.pytorch.strategies import DeepSpeedStrategy

    import unicon.training.run as run
    from unicon.config import compose
    from unicon.models import build_model
    from unicon.training.module import ConsistencyModule

    cfg = compose(["model=ofa_shapes_tiny", f"data.root={tiny_shapes_world}", "optim.weight_decay=0.05", *TINY])
    module = ConsistencyModule(build_model(cfg.model, tiny_shapes_world), cfg)

    class FakeTrainer:  # what configure_optimizers reads of the trainer
        strategy = DeepSpeedStrategy(config=run.deepspeed_config("deepspeed_zero3_offload", 2))
        estimated_stepping_batches = 10

    module._trainer = FakeTrainer()
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    opt = module.configure_optimizers()["optimizer"]
    assert isinstance(opt, DeepSpeedCPUAdam) and opt.adam_w_mode
    assert [g["name"] for g in opt.param_groups] == ["decay", "no_decay"]
    assert [g["weight_decay"] for g in opt.param_groups] == [0.05, 0.0]
    assert opt.param_groups[0]["initial_lr"] == cfg.optim.lr  # ("lr" is the warm-up schedule's, 0 at step 0)


# ---- LoRA adapters in PEFT's format --------------------------------------------------------------
def test_lora_export_holds_a_peft_adapter_folder_that_peft_loads(tiny_shapes_world, tmp_path):
    from PIL import Image
    from peft import PeftModel

    from conftest import float32_tol
    from unicon.config import compose
    from unicon.models import build_model, load_model
    from unicon.models.lora import apply_lora
    from unicon.training.checkpoints import export_model

    cfg = compose(["model=ofa_shapes_tiny", f"data.root={tiny_shapes_world}", "model.lora.enabled=true",
                   "model.lora.r=4", "model.lora.alpha=8", *TINY])
    torch.manual_seed(0)
    build_model(cfg.model, tiny_shapes_world).save_pretrained(str(tmp_path / "base"))  # the run's base model
    model = load_model(tmp_path / "base")
    apply_lora(model, cfg.model.lora)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # lora_B starts at zero: give the adapters an effect (as training would)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    adapters = {k: v.clone() for k, v in model.state_dict().items() if "lora_" in k}
    images = [Image.open(p).convert("RGB") for p in sorted((tiny_shapes_world / "images" / "train").glob("*.png"))[:2]]
    prompts = [model.caption_prompt] * 2
    candidates = [["a red circle", "two blue squares"], ["a green triangle", "a red circle"]]
    with torch.no_grad():
        trained = model.eval().score_text(images, prompts, candidates).nll

    export = export_model(model, tmp_path / "export", merge=True,
                          run_config={"init_from": str(tmp_path / "base"), "model": {"backend": "ofa"}})
    adapter = export / "adapter"
    assert sorted(p.name for p in adapter.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 8
    assert config["base_model_name_or_path"] == str(tmp_path / "base") and config["inference_mode"]

    # PEFT itself reads the folder onto the base model
    peft_model = PeftModel.from_pretrained(load_model(tmp_path / "base"), str(adapter))
    loaded = peft_model.base_model.model
    state = loaded.state_dict()
    assert set(adapters) <= set(state)
    for name, value in adapters.items():
        assert torch.equal(state[name], value), name
    with torch.no_grad():
        via_peft = loaded.eval().score_text(images, prompts, candidates).nll
    assert torch.equal(via_peft, trained)  # the same layers and weights: the same computation

    # the merged export computes the same up to the rounding of W + (alpha/r) B A (one d_model-long
    # reduction per merged weight, through the encoder and decoder layers)
    with torch.no_grad():
        merged = load_model(export).score_text(images, prompts, candidates).nll
    tol = float32_tol(32, trained.abs().max().item(), depth=8)
    torch.testing.assert_close(merged, trained, rtol=0, atol=tol)


if __name__ == "__main__":
    _run_main(sys.argv[1:])
