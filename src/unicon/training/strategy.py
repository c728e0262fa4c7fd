"""The Lightning strategy of ``trainer.strategy``: :func:`check_strategy` refuses, before any work,
one this machine cannot run (DeepSpeed without its package, its CPU Adam op or a valid
``configs/strategy/<name>.json``: :func:`deepspeed_config`); :func:`make_strategy` builds it (DDP
with the buffer broadcast only for models that keep running statistics, FSDP, DeepSpeed's ZeRO
through :class:`unicon.training.zero.ZeroStrategy`)."""

from __future__ import annotations

from pathlib import Path

from unicon.config import config_dir
from unicon.data.jsonl import read_json
from unicon.errors import UserError


def deepspeed_config(name: str, micro_batch_size: int) -> dict:
    """``configs/strategy/<name>.json`` with ``train_micro_batch_size_per_gpu`` set to
    ``micro_batch_size`` (``data.batch_size``: the mixture rows one rank's step takes; DeepSpeed
    uses it for ``train_batch_size = micro x accumulation x ranks`` and its throughput logs). The
    key belongs to the data config, so a strategy file that sets it is refused."""
    path = config_dir() / "strategy" / f"{name}.json"
    if not path.is_file():
        raise UserError(f"no DeepSpeed config {path}")
    config = read_json(path, what="DeepSpeed config")
    if not isinstance(config, dict):
        raise UserError(f"{path}: expected a JSON object")
    if "train_micro_batch_size_per_gpu" in config:
        raise UserError(f"{path}: train_micro_batch_size_per_gpu comes from data.batch_size; remove the key "
                        f"(it is {config['train_micro_batch_size_per_gpu']!r} there)")
    config["train_micro_batch_size_per_gpu"] = int(micro_batch_size)
    return config


def keeps_running_statistics(model: torch.nn.Module) -> bool:
    """Whether ``model`` has buffers that training updates (BatchNorm running statistics), which DDP
    keeps equal across ranks by broadcasting rank 0's before every forward. Conservative: a BatchNorm
    held on its statistics by ``model.freeze_batchnorm`` still counts."""
    import torch

    return any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.track_running_stats
               for m in model.modules())


def check_strategy(name: str, micro_batch_size: int = 1) -> dict | None:
    """Refuse, before any work, a ``trainer.strategy`` this machine cannot run: DeepSpeed needs the
    ``deepspeed`` package, a valid ``configs/strategy/<name>.json`` and, to offload the optimizer,
    its CPU Adam op. Returns that DeepSpeed config (None otherwise). (DeepSpeed runs on GPUs and,
    with ``trainer.accelerator=cpu``, on CPU: :mod:`unicon.training.zero`.)"""
    if not name.startswith("deepspeed"):
        return None
    try:
        import deepspeed  # noqa: F401
    except ImportError as e:
        raise UserError(f"trainer.strategy={name} needs deepspeed ({e}); "
                        "pip install -c constraints.txt -e '.[deepspeed]'") from None
    config = deepspeed_config(name, micro_batch_size)
    offload = (config.get("zero_optimization") or {}).get("offload_optimizer") or {}
    if offload.get("device", "none") in ("cpu", "nvme") and (why := cpu_adam_unavailable()):
        raise UserError(f"trainer.strategy={name} offloads the optimizer to DeepSpeed's CPU Adam, but {why}")
    return config


def cpu_adam_unavailable() -> str | None:
    """None when DeepSpeed's CPU Adam op loads without compiling (built at install with
    ``DS_BUILD_CPU_ADAM=1``, or by ``make test`` into torch's extension cache); otherwise why not."""
    from deepspeed.git_version_info import installed_ops
    from deepspeed.ops.op_builder import CPUAdamBuilder
    from torch.utils.cpp_extension import _get_build_directory

    builder = CPUAdamBuilder()
    if not builder.is_compatible(verbose=False):
        return "DeepSpeed's CPUAdamBuilder is not compatible with this machine"
    if installed_ops.get("cpu_adam") or any(Path(_get_build_directory(builder.name, False)).glob("*.so")):
        return None
    return ("its C++ op is not built; build it once with `python scripts/build_deepspeed_ops.py` "
            "(make test does), or install deepspeed with DS_BUILD_CPU_ADAM=1")


def make_strategy(name: str, micro_batch_size: int = 1, broadcast_buffers: bool = True):
    """Lightning strategy object/name for ``trainer.strategy`` (one of ``unicon.config.STRATEGIES``,
    checked at compose time), after :func:`check_strategy`. ``micro_batch_size``:
    ``data.batch_size`` (DeepSpeed's ``train_micro_batch_size_per_gpu``, :func:`deepspeed_config`).
    ``broadcast_buffers`` (DDP): False for a model whose buffers are constants of its config
    (:func:`keeps_running_statistics` is False): OFA's relative-position bucket tables are 33 MB in
    ``shapes-tiny``, and broadcasting them before every forward cost 13% of a step of the two-rank
    CPU recipe (0.39 s against 0.33-0.34 s).

    DDP searches every step's autograd graph for unused parameters (``find_unused_parameters``): a
    step uses a task-dependent subset of them (OFA's image-code decoder embeddings only in T2I, its
    image stem only with image inputs) and ranks mix tasks differently. The search costs about 1 ms
    of a 340 ms step of the ShapesWorld recipe (2,100 graph nodes); ``static_graph`` would assume one
    set of used parameters for every step, which mixed-task batches break."""
    config = check_strategy(name, micro_batch_size)
    if config is not None:
        from unicon.training.zero import ZeroStrategy  # lazy: pulls in Lightning's DeepSpeed strategy

        return ZeroStrategy(config=config)
    if name in ("ddp", "ddp_spawn"):
        import inspect

        from lightning.pytorch.strategies import DDPStrategy
        from torch.nn.parallel import DistributedDataParallel

        # torch 2.13 renamed DDP's broadcast_buffers (deprecated) to forward_sync_buffers
        sync = "forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(
            DistributedDataParallel).parameters else "broadcast_buffers"
        return DDPStrategy(find_unused_parameters=True, start_method="spawn" if name == "ddp_spawn" else "popen",
                           **{sync: broadcast_buffers})
    if name == "fsdp":
        from lightning.pytorch.strategies import FSDPStrategy

        return FSDPStrategy(sharding_strategy="FULL_SHARD")
    return name
