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
