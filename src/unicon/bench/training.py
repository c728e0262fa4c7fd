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

``unicon bench train --loop`` (:func:`run_loop_bench`) instead times the training loop's own cost:
the bare step (forward, backward, clipping, optimizer and scheduler, no Lightning) beside the same
steps through ``unicon train``'s ``Trainer.fit`` with its callbacks and logging, in one process and
in turn. Prints::

    {"bare_step_examples_per_s", "lightning_loop_examples_per_s", "loop_fraction_of_bare", ...}

with the goal ``loop_fraction_of_bare >= 0.95``.

``unicon bench train --rank-regime`` (:func:`run_rank_regime`) measures, per evaluation task, the
regime the consistency loss works in: the spread of the scores it ranks, how many rows its soft
ranks merge, and the gradient it sends through each task, for each soft-rank variant.
"""

from __future__ import annotations

import argparse
import time
from typing import TYPE_CHECKING, Any

from unicon import jsonsafe
from unicon.config import ConfigError, compose
from unicon.errors import UserError

if TYPE_CHECKING:  # heavy (torch, the training code): each function imports what it runs, not --help
    import torch


def _take_mixture(dataset, n: int, start: int = 0) -> dict[str, Any]:
    from unicon.data.mixture import collate_mixture

    return collate_mixture([dataset[(start + i) % len(dataset)] for i in range(n)])


def _take_contrast(dataset, sequences: int, start: int = 0) -> tuple[dict[str, Any], int]:
    from unicon.training.datamodule import collate_contrast  # lazy: pulls in Lightning

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
    import torch

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


def _training_setup(cfg, device: str | None):
    """``(device, model, module, datamodule, trainable parameters)`` as a training run builds them:
    the seeded model in training mode, its :class:`ConsistencyModule` and the fitted data."""
    import torch

    from unicon.training.datamodule import ConsistencyDataModule  # lazy: pulls in Lightning
    from unicon.training.module import ConsistencyModule  # lazy: pulls in Lightning
    from unicon.models.checkpoints import load_for_training

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.manual_seed(cfg.seed)
    model = load_for_training(cfg).to(dev).train()
    dm = ConsistencyDataModule(cfg.data, seed=cfg.seed)
    dm.setup("fit")
    return dev, model, ConsistencyModule(model, cfg), dm, [p for p in model.parameters() if p.requires_grad]


def run_bench(cfg, steps: int = 10, warmup: int = 2, sequences: int = 32, device: str | None = None) -> dict:
    import torch

    dev, model, module, dm, params = _training_setup(cfg, device)
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
        epilog="examples:\n  unicon bench train experiment=shapes_consistency --steps 20 --sequences 64\n"
        "  unicon bench train --loop experiment=shapes_pretrain logger=csv --steps 30",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("overrides", nargs="*", help="config overrides, as for `unicon train`")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per update kind")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--sequences", type=int, default=32, help="scored sequences per step")
    parser.add_argument("--device", default=None, help="cpu | cuda (default: cuda when available)")
    parser.add_argument("--loop", action="store_true",
                        help="instead: examples/s of Lightning's training loop (unicon train's Trainer.fit, its "
                        "callbacks and logging) beside the bare step on the same batches, in one process, "
                        "interleaved (goal: loop_fraction_of_bare >= 0.95)")
    parser.add_argument("--rounds", type=int, default=2, help="--loop: bare and loop runs, in turn")
    parser.add_argument("--rank-regime", action="store_true",
                        help="instead: per evaluation task, the spread of the scores the consistency loss ranks, "
                        "how many rows its soft ranks merge, and the gradient it sends to the model through each "
                        "task, for each soft-rank variant, on --steps contrast batches")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.sequences < 2 or args.rounds < 1:
        raise UserError("bench train: need --steps >= 1, --warmup >= 0, --sequences >= 2, --rounds >= 1")
    try:
        cfg = compose(args.overrides)
    except ConfigError as e:
        raise UserError(str(e)) from None
    if args.rank_regime:
        print(jsonsafe.dumps(run_rank_regime(cfg, args.steps, args.device)))
        return 0
    if args.loop:
        print(jsonsafe.dumps(run_loop_bench(cfg, args.steps, max(args.warmup, 1), args.rounds, args.device)))
        return 0
    print(jsonsafe.dumps(run_bench(cfg, args.steps, args.warmup, args.sequences, args.device)))
    return 0


# ---------------------------------------------------------------------------------------------
# `unicon bench train --rank-regime`: where the consistency loss has a gradient, per task
# ---------------------------------------------------------------------------------------------
#: the soft ranks compared by --rank-regime: ``(loss.soft_rank, ε)``
RANK_VARIANTS = (("torchsort", 1.0), ("sigmoid", 1.0), ("sigmoid", 0.5))


def _grads(loss: torch.Tensor, params: list) -> torch.Tensor:
    """The gradient of ``loss`` over ``params`` as one flat float64 vector (zeros where unused)."""
    import torch

    grads = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
    return torch.cat([(g if g is not None else torch.zeros_like(p)).double().flatten() for g, p in zip(grads, params)])


def _grad_norm(loss: torch.Tensor, params: list) -> float:
    return float(_grads(loss, params).norm())


def clipping_shares(g_ce: torch.Tensor, g_rank: torch.Tensor, clip: float) -> dict[str, float]:
    """How clipping the summed gradient ``g = g_ce + g_rank`` to norm ``clip`` (0: no clipping) treats
    its CE part (:func:`run_rank_regime`'s ``clipping/*``)::

        clip_factor = min(1, clip/‖g‖)        ce_share = ⟨g_ce, g⟩ / ‖g‖²
        ce_kept = clip_factor·‖g_ce‖ / (min(1, clip/‖g_ce‖)·‖g_ce‖)
    """
    g = g_ce + g_rank
    n_ce, n_rank, n = (float(v.norm()) for v in (g_ce, g_rank, g))
    factor = lambda norm: min(1.0, clip / norm) if clip and norm > 0 else 1.0  # noqa: E731
    return {"grad_rank": n_rank,
            "cos_ce_rank": float(g_ce @ g_rank) / (n_ce * n_rank) if n_ce and n_rank else float("nan"),
            "clip_factor": factor(n), "ce_share": float(g_ce @ g) / n**2 if n else float("nan"),
            "ce_kept": factor(n) / factor(n_ce) if n_ce else float("nan")}


def run_rank_regime(cfg, batches: int = 8, device: str | None = None) -> dict:
    """Per evaluation task, on ``batches`` contrast batches of the training split (``data.contrast_batch_size``
    samples, every one scored on that task, the model in training mode as the loss sees it):

    * ``score_std`` / ``anchor_score_std``: the mean over rows of the std of the task's (the anchor's)
      raw NLLs over the candidates: how far apart the scores the loss ranks are;
    * ``rho_hard``: the rows' mean hard-rank Spearman ρ between the two tasks;
    * per soft-rank variant (``<soft_rank>@<ε>``): ``soft_hard_gap`` (mean |soft − hard rank|),
      ``merged_rows`` (share of rows where some soft rank is > 0.01 from its hard rank),
      ``misordered_rows_without_gradient`` (share of the rows with ρ < 1 whose ``∂L_const/∂s_i`` is 0),
      and the gradient norm that ``λ_t·L_const`` (``lambda``: λ times the task's ``loss.task_lambda``)
      sends to the model's parameters through the task's scores alone (``grad_task_side``, the
      anchor's scores detached) and through the anchor's alone (``grad_anchor_side``);
    * ``grad_ce``: the norm of the same batches' ``L_ce`` gradient, for scale;
    * ``clipping/*``: the consistency step as the run takes it (its own ``loss.*`` settings, λ_t), with
      ``g_ce = ∇L_ce`` and ``g_rank = λ_t ∇L_const`` over the parameters and ``g = g_ce + g_rank``
      clipped to ``c = trainer.gradient_clip_val`` (:func:`clipping_shares`): ``grad_rank`` (‖g_rank‖),
      ``cos_ce_rank`` (their cosine), ``clip_factor`` (``min(1, c/‖g‖)``, 1 without clipping),
      ``ce_share`` (``⟨g_ce, g⟩/‖g‖²``, the part of the update along the CE gradient) and
      ``ce_kept`` (the CE gradient's norm in the clipped step, ``min(1, c/‖g‖)·‖g_ce‖``, over what a
      step on ``L_ce`` alone would apply, ``min(1, c/‖g_ce‖)·‖g_ce‖``: below 1 when the rank term
      makes clipping shrink the CE part)."""
    import torch

    from unicon.losses.consistency import consistency_loss, hard_ranks, rank_scale, soft_ranks
    from unicon.training.datamodule import collate_contrast  # lazy: pulls in Lightning
    from unicon.training.module import supported_tasks, token_weighted_ce  # lazy: pulls in Lightning

    _, _, module, dm, params = _training_setup(cfg, device)
    size, task_lambda = int(cfg.data.contrast_batch_size), dict(cfg.loss.task_lambda)
    clip = float(cfg.trainer.gradient_clip_val or 0)
    run_loss = dict(regularization=cfg.loss.regularization, regularization_strength=cfg.loss.regularization_strength,
                    soft_rank=cfg.loss.soft_rank, direction=cfg.loss.direction, rank_terms=cfg.loss.rank_terms,
                    rank_scale=cfg.loss.rank_scale)
    report: dict[str, Any] = {"batches": batches, "contrast_batch_size": size, "init_from": cfg.init_from, "tasks": {}}
    for task in cfg.loss.tasks:
        lam = float(cfg.loss.lambda_) * float(task_lambda.get(task, 1.0))  # the task's λ_t
        usable = [i for i, sample in enumerate(dm.contrast.data)
                  if sample.contrast_sets and task in supported_tasks(sample, sample.contrast_sets, [task])]
        if not usable:
            continue
        stats: dict[str, list[float]] = {}
        add = lambda key, v: stats.setdefault(key, []).append(float(v))  # noqa: E731
        for b in range(batches):
            picked = [usable[(b * size + j) % len(usable)] for j in range(size)]
            scored = module.score_contrast(collate_contrast([dm.contrast[i] for i in picked]), task)
            s0, si, mask = scored["s0"].nll, scored["si"], scored["s0"].mask
            g_ce = _grads(token_weighted_ce(scored["gold_sum"], scored["gold_tokens"]), params)
            add("grad_ce", g_ce.norm())
            rank = consistency_loss("spearman", s0, si, mask, tasks=scored["tasks"], **run_loss)
            for key, value in clipping_shares(g_ce, _grads(lam * rank, params), clip).items():
                add(f"clipping/{key}", value)
            for row in range(si.shape[0]):
                k = int(mask[row].sum())
                a, t = s0[row, :k].detach().double()[None], si[row, :k].detach().double()[None]
                add("score_std", t.std(unbiased=False))
                add("anchor_score_std", a.std(unbiased=False))
                ha, ht = hard_ranks(a), hard_ranks(t)
                ca, ct = ha - ha.mean(), ht - ht.mean()
                add("rho_hard", (ca * ct).sum() / (ca.norm() * ct.norm()).clamp(min=1e-300))
            for soft_rank, eps in RANK_VARIANTS:
                name = f"{soft_rank}@{eps:g}"
                kw = dict(regularization=cfg.loss.regularization, regularization_strength=eps, soft_rank=soft_rank)
                for row in range(si.shape[0]):
                    k = int(mask[row].sum())
                    t = si[row, :k].detach().double()[None].requires_grad_()
                    a = s0[row, :k].detach().double()[None]
                    z = rank_scale(t)[0]
                    gap = (soft_ranks(z.detach(), cfg.loss.regularization, eps, soft_rank) - hard_ranks(t.detach())).abs()
                    add(f"{name}/soft_hard_gap", gap.mean())
                    add(f"{name}/merged_rows", gap.max() > 0.01)
                    (grad,) = torch.autograd.grad(consistency_loss("spearman", a, t, **kw), t)
                    if not torch.equal(hard_ranks(a), hard_ranks(t.detach())):
                        add(f"{name}/misordered_rows_without_gradient", grad.abs().max() == 0)
                task_side = consistency_loss("spearman", s0.detach(), si, mask, **kw)
                anchor_side = consistency_loss("spearman", s0, si.detach(), mask, **kw)
                add(f"{name}/grad_task_side", lam * _grad_norm(task_side, params))
                add(f"{name}/grad_anchor_side", lam * _grad_norm(anchor_side, params))
        report["tasks"][task] = {"lambda": lam, **{key: round(sum(v) / len(v), 5) for key, v in sorted(stats.items())}}
    return report


# ---------------------------------------------------------------------------------------------
# `unicon bench train --loop`: Lightning's training loop against the bare step
# ---------------------------------------------------------------------------------------------
def _loop_config(cfg, steps: int, warmup: int, output_dir: str):
    """``cfg`` for one process (the loop's per-rank cost; all-reduces are not loop overhead), bounded
    by ``warmup + steps`` optimizer steps, writing its run folder under ``output_dir``."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    cfg.trainer.devices, cfg.trainer.num_nodes, cfg.trainer.strategy = 1, 1, "auto"
    cfg.trainer.max_steps, cfg.trainer.max_epochs = warmup + steps, -1
    cfg.trainer.accumulate_grad_batches, cfg.trainer.limit_train_batches = 1, None
    cfg.output_dir, cfg.name, cfg.overwrite, cfg.resume = output_dir, "bench-loop", True, None
    return cfg


def _step_clock(device: torch.device):
    """A Lightning callback that records the time at the end of every training step and the examples
    that step trained on (the contrast samples of a consistency update, else the mixture rows)."""
    import torch
    from lightning.pytorch.callbacks import Callback

    class StepClock(Callback):
        def __init__(self):
            self.ends: list[float] = []
            self.examples: list[int] = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self._before = pl_module.counts["consistency_updates"]

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            self.ends.append(time.perf_counter())
            consistency = pl_module.counts["consistency_updates"] > self._before
            self.examples.append(len(batch["contrast"]["ids"] if consistency else batch["mixture"]["ids"]))

    return StepClock()


def _bare_step(cfg, device: torch.device):
    """``(step, batches)``: the training step without Lightning -- the γ draw, the update's loss,
    backward, gradient clipping (``trainer.gradient_clip_val``), the run's optimizer and LR
    scheduler -- and the batches of the training loader's first epoch, in its order (collated
    before timing: the bare step does not load data)."""
    import torch
    from transformers import get_scheduler

    from unicon.data.coco_mixture import image_resize_for
    from unicon.training.datamodule import ConsistencyDataModule  # lazy: pulls in Lightning
    from unicon.training.module import SCHEDULERS, ConsistencyModule  # lazy: pulls in Lightning
    from unicon.training.optim import build_optimizer
    from unicon.models.checkpoints import load_for_training

    torch.manual_seed(cfg.seed)
    model = load_for_training(cfg).to(device).train()
    module = ConsistencyModule(model, cfg)
    dm = ConsistencyDataModule(cfg.data, seed=cfg.seed, with_contrast=cfg.loss.gamma > 0,
                               image_resize=image_resize_for(model))
    dm.setup("fit")
    n = int(cfg.trainer.max_steps)
    batches = []
    while len(batches) < n:  # epochs in a row, as the loop's max_steps run them
        batches += [b for b, _, _ in dm.train_dataloader()][: n - len(batches)]
    ocfg = cfg.optim
    opt = build_optimizer(ocfg.name, model, ocfg.lr, ocfg.weight_decay, tuple(ocfg.betas))
    sched = get_scheduler(SCHEDULERS[ocfg.scheduler], opt, num_warmup_steps=0, num_training_steps=n)
    clip = float(cfg.trainer.gradient_clip_val or 0)
    params = [p for p in model.parameters() if p.requires_grad]
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled="bf16" in str(cfg.trainer.precision))
    examples: list[int] = []

    def step(batch) -> None:
        contrast = batch.get("contrast")
        consistency, task = module.draw_update(), None
        if consistency:
            consistency, task = module.consistency_plan(contrast)
        with autocast:
            out = module.consistency_loss(contrast, task) if consistency else module.standard_loss(batch["mixture"])
        examples.append(len(contrast["ids"] if consistency else batch["mixture"]["ids"]))
        out["loss"].backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)

    return step, batches, examples


def run_loop_bench(cfg, steps: int = 20, warmup: int = 3, rounds: int = 2, device: str | None = None) -> dict:
    """Examples/s of the bare training step (:func:`_bare_step`) and of the same steps through
    :func:`unicon.training.run.train` -- Lightning's ``Trainer.fit`` with the run's callbacks
    (checkpointing, log files, LR monitor, progress bar when enabled, evaluations), loggers and
    per-step logging -- in one process, ``rounds`` times in turn. Each side runs ``warmup + steps``
    steps from a fresh model and times its last ``steps``: the loop from the end of step ``warmup``
    to the end of the last step (data loading, hooks and logging included; the run's start and its
    export are not); the bare side goes first in even rounds, the loop in odd ones.
    ``loop_fraction_of_bare`` = loop examples/s / bare examples/s over all rounds (and per round)."""
    import contextlib
    import io
    import tempfile

    import torch

    from unicon.training.run import train

    if warmup < 1:
        raise UserError("bench train --loop: need --warmup >= 1 (the loop's clock starts at the end of a step)")
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if cfg.trainer.cpu_threads:
        torch.set_num_threads(int(cfg.trainer.cpu_threads))
    bare_s = loop_s = 0.0
    bare_examples = loop_examples = 0
    round_fractions = []
    with tempfile.TemporaryDirectory(prefix="unicon-bench-loop-") as tmp:
        cfg = _loop_config(cfg, steps, warmup, tmp)

        def bare_run() -> tuple[float, int]:
            step, batches, examples = _bare_step(cfg, dev)
            return _timed(step, batches, warmup, dev), sum(examples[warmup:])

        def loop_run() -> tuple[float, int]:
            clock = _step_clock(dev)
            with contextlib.redirect_stdout(io.StringIO()):  # the run's own messages
                train(cfg, extra_callbacks=[clock])
            if len(clock.ends) != warmup + steps:
                raise RuntimeError(f"bench train --loop: the loop ran {len(clock.ends)} steps, not {warmup + steps}")
            return clock.ends[-1] - clock.ends[warmup - 1], sum(clock.examples[warmup:])

        for r in range(rounds):  # bare first in even rounds, the loop first in odd ones
            if r % 2:
                (ls, le), (bs, be) = loop_run(), bare_run()
            else:
                (bs, be), (ls, le) = bare_run(), loop_run()
            bare_s, bare_examples, loop_s, loop_examples = bare_s + bs, bare_examples + be, loop_s + ls, loop_examples + le
            round_fractions.append(round((le / ls) / (be / bs), 3))
    bare, loop = bare_examples / bare_s, loop_examples / loop_s
    return {
        "bare_step_examples_per_s": round(bare, 2),
        "lightning_loop_examples_per_s": round(loop, 2),
        "loop_fraction_of_bare": round(loop / bare, 3),
        "loop_fraction_of_bare_per_round": round_fractions,
        "bare_ms_per_step": round(1e3 * bare_s / (rounds * steps), 2),
        "loop_ms_per_step": round(1e3 * loop_s / (rounds * steps), 2),
        "examples_per_step": round(loop_examples / (rounds * steps), 2),
        "same_examples": bare_examples == loop_examples,
        "steps": steps,
        "warmup": warmup,
        "rounds": rounds,
        "logger": cfg.logger.type,
        "progress_bar": bool(cfg.trainer.enable_progress_bar),
        "log_every_n_steps": int(cfg.trainer.log_every_n_steps),
        "torch_threads": torch.get_num_threads(),
        "device": str(dev) if dev.type != "cuda" else torch.cuda.get_device_name(dev),
    }


# ---------------------------------------------------------------------------------------------
# `unicon bench pretrain`
# ---------------------------------------------------------------------------------------------
def matmul_peak_flops(n: int = 1024, repeats: int = 5) -> float:
    """FLOP/s of a float32 ``n x n`` matrix product on this machine at the current thread count
    (best of ``repeats``): the practical ceiling the training step is compared against."""
    import torch

    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)  # warm up the kernels
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n**3 / best


def _pretrain_step(cfg, steps: int, warmup: int, rank: int = 0, world: int = 1):
    """``(module, step function, batches)`` of standard pretraining updates; with ``world > 1`` this
    rank takes every ``world``-th batch and the step all-reduces the gradients (one flat buffer:
    DDP's bucketed all-reduce without its overlap with the backward pass) before AdamW."""
    import torch
    import torch.distributed as dist

    from unicon.data.mixture import collate_mixture
    from unicon.training.datamodule import ConsistencyDataModule  # lazy: pulls in Lightning
    from unicon.training.module import ConsistencyModule  # lazy: pulls in Lightning
    from unicon.training.optim import build_optimizer
    from unicon.models.checkpoints import load_for_training

    if cfg.trainer.cpu_threads:
        torch.set_num_threads(int(cfg.trainer.cpu_threads))
    torch.manual_seed(cfg.seed)
    model = load_for_training(cfg).train()
    module = ConsistencyModule(model, cfg)
    dm = ConsistencyDataModule(cfg.data, seed=cfg.seed, with_contrast=False)
    dm.setup("fit")
    bs = int(cfg.data.batch_size)
    # the recipe's epoch order (task weights, data.batching), as the training loader draws it: a
    # batch of the first rows of the file would hold no think-then-draw rows, the costliest ones
    order = list(dm.mixture_sampler(world))
    batches = [collate_mixture([dm.mixture[order[((i * world + rank) * bs + j) % len(order)]] for j in range(bs)])
               for i in range(warmup + steps)]
    params = [p for p in model.parameters() if p.requires_grad]
    # the recipe's optimizer (optim.name: fused AdamW, or Muon + AdamW), as configure_optimizers builds it
    opt = build_optimizer(cfg.optim.name, model, cfg.optim.lr, cfg.optim.weight_decay, tuple(cfg.optim.betas),
                          data_parallel=world > 1)

    def step(batch):
        module.standard_loss(batch)["loss"].backward()
        if world > 1:
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat)
            flat /= world
            for p, g in zip(params, flat.split([q.numel() for q in params])):
                p.grad = g.view_as(p)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return module, step, batches


def _rank_worker(rank: int, world: int, port: int, cfg, steps: int, warmup: int, results) -> None:
    """One rank of :func:`ranks_throughput` (spawned): the timed steps, idle then beside a busy process."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        _, step, batches = _pretrain_step(cfg, steps, warmup, rank, world)
        for phase in ("idle", "busy"):
            dist.barrier()
            if rank == 0:
                results.put(("ready", phase))  # the parent starts the busy process before "busy"
            time.sleep(1.0 if phase == "busy" else 0.0)
            dist.barrier()
            seconds = _timed(step, batches, warmup, torch.device("cpu"))
            if rank == 0:
                results.put((phase, seconds))
            dist.barrier()
    finally:
        dist.destroy_process_group()


def ranks_throughput(cfg, ranks: int, steps: int, warmup: int) -> tuple[float, float]:
    """Examples/s of ``ranks`` data-parallel CPU processes (gloo, the recipe's ``trainer.devices``),
    idle and while one busy single-threaded process shares the cores."""
    import multiprocessing
    import queue
    import socket
    import subprocess
    import sys

    import torch.multiprocessing as tmp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    results = multiprocessing.get_context("spawn").Queue()
    ctx = tmp.start_processes(_rank_worker, args=(ranks, port, cfg, steps, warmup, results), nprocs=ranks,
                              join=False, start_method="spawn")
    seconds, busy_proc = {}, None
    try:
        while len(seconds) < 2:
            try:
                kind, value = results.get(timeout=1.0)
            except queue.Empty:
                ctx.join(timeout=0)  # raises (with the rank's traceback) if a rank failed
                if not any(p.is_alive() for p in ctx.processes):
                    raise RuntimeError("bench pretrain: the ranks exited without their timings") from None
                continue
            if kind == "ready" and value == "busy":
                busy_proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
                time.sleep(0.5)
            elif kind in ("idle", "busy"):
                seconds[kind] = value
        while not ctx.join():
            pass
    finally:
        if busy_proc is not None:
            busy_proc.kill()
            busy_proc.wait()
        for p in ctx.processes:
            if p.is_alive():
                p.terminate()
    examples = steps * ranks * int(cfg.data.batch_size)
    return examples / seconds["idle"], examples / seconds["busy"]


def run_pretrain_bench(cfg, steps: int = 10, warmup: int = 2) -> dict:
    """Pretraining throughput (standard updates of the mixture) on CPU: examples/s, model FLOPs per
    example (counted by ``torch.utils.flop_counter`` on one forward + backward), the achieved FLOP/s
    as a fraction of :func:`matmul_peak_flops` measured in the same run, and the throughput kept while
    one busy single-threaded process shares the cores. When the config trains on several CPU ranks
    (``trainer.strategy=ddp``, ``trainer.devices=N``, as the ShapesWorld recipe does), the same is
    measured for N gloo processes (``ranks_*``), side by side with the single process."""
    import subprocess
    import sys

    import torch
    from torch.utils.flop_counter import FlopCounterMode

    module, step, batches = _pretrain_step(cfg, steps, warmup)
    bs = int(cfg.data.batch_size)
    with FlopCounterMode(display=False) as counter:
        module.standard_loss(batches[0])["loss"].backward()
    module.zero_grad(set_to_none=True)
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
    ranks = int(cfg.trainer.devices) if str(cfg.trainer.strategy).startswith("ddp") and \
        str(cfg.trainer.devices).isdigit() else 1
    multi = {}
    if ranks > 1:
        ranks_idle, ranks_busy = ranks_throughput(cfg, ranks, steps, warmup)
        multi = {
            "ranks": ranks,
            "ranks_examples_per_s": round(ranks_idle, 2),
            "ranks_speedup_over_one_process": round(ranks_idle / idle, 3),
            "ranks_fraction_of_matmul_peak_per_core": round(ranks_idle * flops_per_example / ranks / peak, 4),
            "ranks_examples_per_s_beside_a_busy_process": round(ranks_busy, 2),
            "ranks_kept_beside_a_busy_process": round(ranks_busy / ranks_idle, 3),
        }
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
        **multi,
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
    print(jsonsafe.dumps(run_pretrain_bench(cfg, args.steps, args.warmup)))
    return 0
