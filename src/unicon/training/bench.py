"""``unicon bench train``: throughput of consistency updates vs standard updates.

Both kinds of update process the same number of *sequences* per step (``--sequences``, a
sequence = one scored target: a mixture example, or one candidate of one task of a
contrast sample). A standard step takes that many mixture examples; a consistency step takes
contrast samples until their ``2 · (1 + #contrasts)`` candidates (anchor + task) reach it.
Each step is forward + backward + AdamW step, timed after ``--warmup`` steps. Prints one JSON
object::

    {"standard_seq_per_s", "consistency_seq_per_s", "ratio", "sequences_per_step", ...}

``ratio = consistency / standard``; the goal is ≥ 0.8 (the soft-rank bookkeeping is cheap
and candidates are batched, so a consistency step costs about what its sequences cost).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch

from unicon.config import ConfigError, compose
from unicon.errors import UserError


def _take_mixture(dataset, n: int, start: int = 0) -> dict[str, Any]:
    from unicon.data.mixture import collate_mixture

    return collate_mixture([dataset[(start + i) % len(dataset)] for i in range(n)])


def _take_contrast(dataset, sequences: int, start: int = 0) -> tuple[dict[str, Any], int]:
    from unicon.training.datamodule import collate_contrast

    examples, total, i = [], 0, start
    while total < sequences and i - start < 10 * len(dataset):
        ex = dataset[i % len(dataset)]
        i += 1
        if not ex["contrasts"]:
            continue
        examples.append(ex)
        total += 2 * (1 + len(ex["contrasts"]))
    if not examples:
        raise UserError("bench train: the contrast file has no sample with contrast sets")
    return collate_contrast(examples), total


def _timed(step_fn, batches: list, warmup: int, device: torch.device) -> float:
    for b in batches[:warmup]:
        step_fn(b)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for b in batches[warmup:]:
        step_fn(b)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def run_bench(cfg, steps: int = 10, warmup: int = 2, sequences: int = 32, device: str | None = None) -> dict:
    from unicon.training.datamodule import ConsistencyDataModule
    from unicon.training.module import ConsistencyModule
    from unicon.training.run import build_training_model

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.manual_seed(cfg.seed)
    model = build_training_model(cfg).to(dev).train()
    module = ConsistencyModule(model, cfg)
    dm = ConsistencyDataModule(cfg.data, seed=cfg.seed)
    dm.setup("fit")
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.optim.lr)
    autocast = torch.autocast(dev.type, dtype=torch.bfloat16, enabled="bf16" in str(cfg.trainer.precision))

    def step(fn):
        def run(batch):
            with autocast:
                loss = fn(batch)["loss"]
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return run

    n = warmup + steps
    std_batches = [_take_mixture(dm.mixture, sequences, i * sequences) for i in range(n)]
    con = [_take_contrast(dm.contrast, sequences, i * sequences) for i in range(n)]
    con_batches, con_seqs = [b for b, _ in con], [s for _, s in con]

    t_std = _timed(step(module.standard_loss), std_batches, warmup, dev)
    t_con = _timed(step(module.consistency_loss), con_batches, warmup, dev)
    std_rate = steps * sequences / t_std
    con_rate = sum(con_seqs[warmup:]) / t_con
    return {
        "standard_seq_per_s": round(std_rate, 2),
        "consistency_seq_per_s": round(con_rate, 2),
        "ratio": round(con_rate / std_rate, 3),
        "sequences_per_step": sequences,
        "consistency_sequences_per_step_mean": round(sum(con_seqs[warmup:]) / steps, 2),
        "steps": steps,
        "warmup": warmup,
        "loss_type": cfg.loss.type,
        "device": str(dev) if dev.type != "cuda" else torch.cuda.get_device_name(dev),
        "model_backend": getattr(model, "backend", type(model).__name__),
        "peak_memory_mb": round(torch.cuda.max_memory_allocated(dev) / 2**20, 1) if dev.type == "cuda" else None,
    }


def cli(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="unicon bench train",
        description="Sequences/s of consistency updates vs standard updates at the same sequences per step "
        "(prints one JSON object; goal: ratio >= 0.8).",
        epilog="example: unicon bench train experiment=shapes_consistency --steps 20 --sequences 64",
    )
    parser.add_argument("overrides", nargs="*", help="config overrides, as for `unicon train`")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per update kind")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--sequences", type=int, default=32, help="scored sequences per step")
    parser.add_argument("--device", default=None, help="cpu | cuda (default: cuda when available)")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.sequences < 2:
        raise UserError("bench train: need --steps >= 1, --warmup >= 0, --sequences >= 2")
    try:
        cfg = compose(args.overrides)
    except ConfigError as e:
        raise UserError(str(e)) from None
    print(json.dumps(run_bench(cfg, args.steps, args.warmup, args.sequences, args.device)))
    return 0


# ---------------------------------------------------------------------------------------------
# `unicon bench pretrain`
# ---------------------------------------------------------------------------------------------
def matmul_peak_flops(n: int = 1024, repeats: int = 5) -> float:
    """FLOP/s of a float32 ``n x n`` matrix product on this machine at the current thread count
    (best of ``repeats``): the practical ceiling the training step is compared against."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)  # warm up the kernels
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n**3 / best


def run_pretrain_bench(cfg, steps: int = 10, warmup: int = 2) -> dict:
    """Pretraining throughput (standard updates of the mixture) on CPU: examples/s, model FLOPs per
    example (counted by ``torch.utils.flop_counter`` on one forward + backward), the achieved FLOP/s
    as a fraction of :func:`matmul_peak_flops` measured in the same run, and the throughput kept while
    one busy single-threaded process shares the cores."""
    import subprocess
    import sys

    from torch.utils.flop_counter import FlopCounterMode

    from unicon.training.datamodule import ConsistencyDataModule
    from unicon.training.module import ConsistencyModule
    from unicon.training.run import build_training_model

    if cfg.trainer.cpu_threads:
        torch.set_num_threads(int(cfg.trainer.cpu_threads))
    torch.manual_seed(cfg.seed)
    model = build_training_model(cfg).train()
    module = ConsistencyModule(model, cfg)
    dm = ConsistencyDataModule(cfg.data, seed=cfg.seed, with_contrast=False)
    dm.setup("fit")
    bs = int(cfg.data.batch_size)
    batches = [_take_mixture(dm.mixture, bs, i * bs) for i in range(warmup + steps)]
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.optim.lr)

    def step(batch):
        loss = module.standard_loss(batch)["loss"]
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    with FlopCounterMode(display=False) as counter:
        module.standard_loss(batches[0])["loss"].backward()
    opt.zero_grad(set_to_none=True)
    flops_per_example = counter.get_total_flops() / bs
    peak = matmul_peak_flops()
    idle = steps * bs / _timed(step, batches, warmup, torch.device("cpu"))
    busy_proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)
        busy = steps * bs / _timed(step, batches, warmup, torch.device("cpu"))
    finally:
        busy_proc.kill()
        busy_proc.wait()
    return {
        "examples_per_s": round(idle, 2),
        "model_flops_per_example": round(flops_per_example),
        "achieved_flops_per_s": round(idle * flops_per_example),
        "matmul_peak_flops_per_s": round(peak),
        "fraction_of_matmul_peak": round(idle * flops_per_example / peak, 4),
        "examples_per_s_beside_a_busy_process": round(busy, 2),
        "kept_beside_a_busy_process": round(busy / idle, 3),
        "torch_threads": torch.get_num_threads(),
        "batch_size": bs,
        "steps": steps,
        "tasks": list(cfg.data.tasks),
    }


def pretrain_cli(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="unicon bench pretrain",
        description="Pretraining throughput on the CPU (experiment=shapes_pretrain + overrides): examples/s, "
        "model FLOPs per example, the fraction of a matmul peak measured in the same run, and the throughput "
        "kept beside one busy single-threaded process (goal >= 0.9). Prints one JSON object.",
        epilog="example: unicon bench pretrain trainer.cpu_threads=2 --steps 20",
    )
    parser.add_argument("overrides", nargs="*", help="config overrides on top of experiment=shapes_pretrain")
    parser.add_argument("--steps", type=int, default=10, help="timed steps")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        raise UserError("bench pretrain: need --steps >= 1 and --warmup >= 0")
    try:
        cfg = compose(["experiment=shapes_pretrain", *args.overrides])
    except ConfigError as e:
        raise UserError(str(e)) from None
    print(json.dumps(run_pretrain_bench(cfg, args.steps, args.warmup)))
    return 0
