"""``ConsistencyModule``: CocoCon's Algorithm 1 (cross-task consistency training) for any UnifiedModel.

Each training step receives a contrast batch and a pretraining-mixture batch
(:mod:`unicon.training.datamodule`) and draws ``r ~ U(0, 1)`` from a seeded
``torch.Generator`` that is identical on every rank and saved in checkpoints:

* ``r < γ`` (``loss.gamma``) -- **consistency update** on the contrast batch. For each sample an
  evaluation task ``i`` is drawn among those it supports (``loss.tasks`` ∩ {vqa, localization,
  t2i}; localization needs a gold box and contrast expressions). Its candidate list is
  ``[gold] + contrasts``; the anchor (captioning) scores the *same* contrast sets' captions:

  - anchor ``s0[b, k] = score_text(image, caption_prompt, caption_k)``
  - VQA ``si[b, k] = score_text(image, question, answer_k)``
  - localization ``si[b, k] = score_boxes(image, expression_k, gold_box)``  (input varies)
  - T2I ``si[b, k] = score_image(caption_k, gold_image)``                 (input varies)

  all length-normalised NLL (``Scores.nll``, CocoCon section 4.3). Then
  ``L = λ · L_const(s0, si, mask) + L_ce`` (each example's term of ``L_const`` times its task's
  ``loss.task_lambda`` factor, 1 by default) with ``L_const`` from
  :mod:`unicon.losses.consistency` and ``L_ce`` the token-weighted CE of the gold targets of both
  tasks (:func:`token_weighted_ce`). With ``loss.type=none`` only the gold candidates are trained
  on (λ = 0: the paper's "+ Cont. Pretrain" control sees exactly the same data). Each consistency
  step also logs the hard-rank Spearman ρ of ``s0``/``si`` and the mean |soft − hard rank|; per
  task, the training-batch ρ is logged as the running mean of the current epoch over the task's rows
  (``train/rho/<task>/epoch_mean``: at the epoch's last step, the epoch mean) and as a moving average over its last ~20 rows
  (``train/rho/<task>/ema``, every step), for K from a gradient-free scoring of every candidate:
  whether the objective moves what it optimises.
* otherwise -- **standard update**: the token-weighted CE of the mixture batch's gold
  targets (each task through its ``score_*`` method with one candidate; think-then-draw
  ``reason`` rows through ``score_text(None, prompt, [trace])``, their ``reason_t2i`` rows through
  ``score_image([prompt], image, contexts=[trace])`` after ``fit_context``, and image-edit rows
  through ``score_edit(source, instruction, target)``).

Bad input: contrast samples with no contrast candidate are skipped and counted
(``train/skipped_no_contrast``); a batch left empty falls back to a standard update. A
NaN/inf loss raises :class:`NonFiniteLossError` naming the step and the example ids, or with
``loss.on_nonfinite=skip`` skips the step on every rank and counts it.

The evaluation task is drawn per sample (``loss.task_draw=per_sample``, the default outside
DeepSpeed: a step then mixes tasks in one batch; the draw is a deterministic function of
``(seed, step, sample)`` so that DDP and a single process agree) or once per step
(``per_step``, the paper's Algorithm 1 and the default under DeepSpeed): a function of
``(seed, step)`` among the tasks that at least one contrast sample supports on *every* rank (one
all-gather of per-task counts), the samples that do not support it sitting the step out. Under
DeepSpeed ZeRO every rank must then touch the same parameters in the same order (ZeRO reduces
gradients from hooks as the backward pass reaches them): with ``per_step`` and
``data.batching=by_task`` they do. Whether a drawn consistency step happens is also decided
together: when a rank has no usable contrast sample, every rank takes the standard update (so the
ranks always run the same collectives).

Differences from the paper: the per-sample draw (above) outside DeepSpeed; ``L_const`` works on
rank-scaled scores and may use other soft ranks (see the loss module).
"""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any, Sequence

import lightning as L
import torch
from omegaconf import DictConfig, OmegaConf

from unicon.config import EVAL_TASKS
from unicon.data.mixture import TRAINABLE_TASKS
from unicon.losses.consistency import consistency_loss, rank_diagnostics
from unicon.models.base import Scores, UnifiedModel
from unicon.training.optim import build_optimizer, decay_groups

#: weight of one training row in ``train/rho/<task>/ema``: a row's ρ moves the average by this
#: fraction of its difference (about the last 1/RATE = 20 rows of the task count)
RHO_EMA_RATE = 0.05

#: ``optim.scheduler`` -> the name ``transformers.get_scheduler`` knows it by
SCHEDULERS = {"linear": "linear", "cosine": "cosine", "constant": "constant_with_warmup"}


#: Mixture tasks scored by one encoder/decoder call per standard step: caption and VQA rows are
#: both "image + prompt -> text" (the caption prompt is the model's own), so they share one call.
#: ``edit`` rows (source image + instruction -> target image) go through ``UnifiedModel.score_edit``.
SCORING_GROUPS = (("caption", "vqa"), ("reason",), ("grounding",), ("t2i",), ("reason_t2i",), ("edit",), ("instruct",))
if sorted(t for g in SCORING_GROUPS for t in g) != sorted(TRAINABLE_TASKS):  # pragma: no cover
    raise ImportError(f"SCORING_GROUPS {SCORING_GROUPS} must cover the trainable tasks {TRAINABLE_TASKS}")


def token_weighted_ce(sums: Sequence[torch.Tensor], tokens: Sequence[torch.Tensor],
                      all_reduce: Any = None) -> torch.Tensor:
    """``Σ summed NLL / Σ target tokens`` over every gold target: each token weighs the same, as in
    OFA's criterion (a per-sequence mean of length-normalised NLLs would upweight short targets,
    e.g. one-word VQA answers against 16-code images).

    Under DDP (``all_reduce``: sums a tensor over ranks, returns ``(total, world_size)``), the token
    count is the global one and the rank's loss is ``world · Σ_rank NLL / Σ_all tokens``, so that
    the mean over ranks DDP applies to the gradients is exactly the single-process loss."""
    total = torch.cat([s.float() for s in sums]).sum()
    count = torch.cat([t.float() for t in tokens]).sum()
    if all_reduce is not None:
        count, world = all_reduce(count.detach())
        return total * world / count.clamp(min=1)
    return total / count.clamp(min=1)


class NonFiniteLossError(RuntimeError):
    """The training loss became NaN/inf; the message names the global step and example ids."""


def supported_tasks(sample: Any, contrasts: Sequence[Any], tasks: Sequence[str]) -> list[str]:
    """Evaluation tasks a CocoCon sample can be trained on (each needs ≥ 1 contrast candidate)."""
    out = []
    for task in tasks:
        if task == "localization":
            if not (sample.detection and sample.boxes and any(c.detection for c in contrasts)):
                continue
        elif task == "vqa":
            if not (sample.query and sample.answer):
                continue
        out.append(task)
    return out


def task_candidates(sample: Any, contrasts: Sequence[Any], task: str) -> tuple[list[str], list[str]]:
    """Aligned ``(anchor captions, task candidates)``, gold first, over the usable contrast sets."""
    used = [c for c in contrasts if c.detection] if task == "localization" else list(contrasts)
    captions = [sample.caption] + [c.caption for c in used]
    if task == "vqa":
        return captions, [sample.answer] + [c.answer for c in used]
    if task == "localization":
        return captions, [sample.detection] + [c.detection for c in used]
    if task == "t2i":
        return captions, list(captions)
    raise ValueError(f"unknown evaluation task {task!r}; choose from {', '.join(EVAL_TASKS)}")


def offloads_optimizer(strategy) -> bool:
    """Whether ``strategy`` is a DeepSpeed one whose config offloads the optimizer (ZeRO-Offload,
    ``configs/strategy/*_offload.json``): then the optimizer must be DeepSpeed's CPU Adam."""
    from lightning.pytorch.strategies import DeepSpeedStrategy

    if not isinstance(strategy, DeepSpeedStrategy) or not isinstance(strategy.config, dict):
        return False
    offload = (strategy.config.get("zero_optimization") or {}).get("offload_optimizer") or {}
    return offload.get("device", "none") in ("cpu", "nvme")


class ConsistencyModule(L.LightningModule):
    """Algorithm 1 around ``self.model`` (a :class:`UnifiedModel`); ``cfg`` is a RunConfig from
    :func:`unicon.config.compose`, which validated its values (``loss.type``, ``loss.gamma``, ...)."""

    def __init__(self, model: UnifiedModel, cfg: DictConfig):
        super().__init__()
        self.model = model
        self.cfg = cfg
        self.gamma_rng = torch.Generator().manual_seed(int(cfg.seed))
        # read once: every checkpoint carries the vocabulary files the run started with (those the model's
        # backend reads from data.root); a model loaded from an init_from directory brings its own (a
        # shipped model's tokenizer, whatever data.root's is)
        self.world_files = model.world_vocabulary(None if cfg.model.get("pretrained") else cfg.data.root)
        if cfg.get("init_from") and Path(cfg.init_from).is_dir():
            for name in self.world_files:
                if (Path(cfg.init_from) / name).is_file():
                    self.world_files[name] = (Path(cfg.init_from) / name).read_text()
        self.counts = {"consistency_updates": 0, "standard_updates": 0, "skipped_no_contrast": 0,
                       "skipped_nonfinite": 0, "truncated": 0}
        self.rho_ema: dict[str, float] = {}  # each task's training-batch ρ, moving average (RHO_EMA_RATE)
        # each task's (Σ ρ·rows, Σ rows) over the current epoch's consistency steps so far; logged every
        # step as the epoch's running mean (no on_epoch aggregation: its state is not in checkpoints)
        self.rho_epoch: dict[str, Any] = {}

    # ---- Algorithm 1 ----------------------------------------------------------------------
    def draw_update(self) -> bool:
        """True for a consistency update (``r < γ``); one draw per training step on every rank."""
        return torch.rand((), generator=self.gamma_rng).item() < self.cfg.loss.gamma

    def _task_rng(self, sample_key: Any) -> random.Random:
        return random.Random(f"{self.cfg.seed}:{self.global_step}:{sample_key}")

    def _t2i_prompt(self, prompt: str, row_id: str) -> str:
        """``prompt``, or "" for a ``data.t2i_prompt_dropout`` fraction of (row, step) draws (the
        unconditional model of classifier-free guidance; reproducible under resume)."""
        p = self.cfg.data.t2i_prompt_dropout
        return "" if p > 0 and self._task_rng(f"t2i-dropout:{row_id}").random() < p else prompt

    def score_contrast(self, batch: dict[str, Any], step_task: str | None = None,
                       only_gold: bool = False) -> dict[str, Any]:
        """Score a contrast batch for Algorithm 1: ``tasks`` (each row's evaluation task), ``s0``
        (the anchor's :class:`Scores` of the captions), ``si`` (``[B, K]`` task NLLs aligned with
        ``s0``'s candidates, zero-padded) and the gold targets' ``gold_sum`` / ``gold_tokens``.
        ``step_task``: every sample is scored on that task (``loss.task_draw=per_step``); the samples
        that do not support it are left out. ``only_gold``: the gold candidates alone (λ = 0)."""
        if step_task is not None:
            keep = [b for b, (s, c) in enumerate(zip(batch["samples"], batch["contrasts"]))
                    if step_task in supported_tasks(s, c, [step_task])]
            if not keep:
                raise ValueError(f"no contrast sample of this batch supports the step's task {step_task!r}")
            batch = {key: [batch[key][b] for b in keep] for key in ("samples", "contrasts", "images")}
        n = len(batch["samples"])
        tasks, anchors, cands = [], [], []
        for sample, contrasts in zip(batch["samples"], batch["contrasts"]):
            options = supported_tasks(sample, contrasts, self.cfg.loss.tasks)
            if not options:
                raise ValueError(f"contrast sample {sample.id} supports none of loss.tasks {list(self.cfg.loss.tasks)}")
            task = step_task or self._task_rng(sample.index).choice(options)
            a, c = task_candidates(sample, contrasts, task)
            if only_gold:
                a, c = a[:1], c[:1]
            tasks.append(task)
            anchors.append(a)
            cands.append(c)

        images = batch["images"]
        s0 = self._count(self.model.score_text(images, [self.model.caption_prompt] * n, anchors))
        K = s0.nll.shape[1]
        si = s0.nll.new_zeros(n, K)
        gold_sum, gold_tokens = [s0.sum_nll[:, 0]], [s0.num_tokens[:, 0]]
        for task in EVAL_TASKS:
            rows = [b for b in range(n) if tasks[b] == task]
            if not rows:
                continue
            imgs = [images[b] for b in rows]
            if task == "vqa":
                sc = self.model.score_text(imgs, [batch["samples"][b].query for b in rows], [cands[b] for b in rows])
            elif task == "localization":
                sc = self.model.score_boxes(imgs, [cands[b] for b in rows], [batch["samples"][b].boxes[0] for b in rows])
            else:
                sc = self.model.score_image([cands[b] for b in rows], imgs)
            sc = self._count(sc)
            if not torch.equal(sc.mask, s0.mask[rows, : sc.mask.shape[1]]):
                raise RuntimeError(f"{task} scores are not aligned with the anchor's candidates")
            index = torch.tensor(rows, device=si.device)
            si = si.index_put((index,), torch.nn.functional.pad(sc.nll.to(si.dtype), (0, K - sc.nll.shape[1])))
            gold_sum.append(sc.sum_nll[:, 0])
            gold_tokens.append(sc.num_tokens[:, 0])
        return {"tasks": tasks, "s0": s0, "si": si, "gold_sum": gold_sum, "gold_tokens": gold_tokens}

    def consistency_loss(self, batch: dict[str, Any], step_task: str | None = None) -> dict[str, torch.Tensor]:
        """``λ·L_const + L_ce`` of a contrast batch (keys ``loss``, ``loss_ce``, ``loss_const``), and
        the rank diagnostics of the step (:func:`rank_diagnostics`, over the batch and, under
        ``rho/<task>``, per evaluation task as ``(ρ, #rows)``). With ``loss.type=none`` only the gold
        candidates are trained on; the diagnostics then come from a second, gradient-free scoring of
        every candidate under a forked RNG (the control's training is unchanged, and K and M report
        the same training-batch ρ). ``step_task``: see :meth:`score_contrast`."""
        loss_cfg = self.cfg.loss
        only_gold = loss_cfg.type == "none"
        scored = self.score_contrast(batch, step_task, only_gold)
        s0, si = scored["s0"], scored["si"]
        loss_ce = token_weighted_ce(scored["gold_sum"], scored["gold_tokens"], self._token_all_reduce())
        reg = dict(regularization=loss_cfg.regularization, regularization_strength=loss_cfg.regularization_strength,
                   soft_rank=loss_cfg.soft_rank)
        task_lambda = dict(loss_cfg.task_lambda)
        weight = (torch.tensor([float(task_lambda.get(t, 1.0)) for t in scored["tasks"]], device=si.device)
                  if task_lambda else None)
        loss_const = consistency_loss(loss_cfg.type, s0.nll, si, s0.mask, margin=loss_cfg.hinge_margin,
                                      direction=loss_cfg.direction, rank_terms=loss_cfg.rank_terms,
                                      rank_scale=loss_cfg.rank_scale, tasks=scored["tasks"],
                                      all_reduce=self._token_all_reduce(), weight=weight, **reg)
        lam = 0.0 if only_gold else loss_cfg.lambda_
        out = {"loss": lam * loss_const + loss_ce, "loss_ce": loss_ce.detach(), "loss_const": loss_const.detach(),
               "num_sequences": torch.tensor(int(s0.mask.sum()) * 2)}
        if only_gold:
            devices = [self.device] if self.device.type == "cuda" else []
            with torch.no_grad(), torch.random.fork_rng(devices=devices):
                scored = self.score_contrast(batch, step_task)
        tasks, a, b, mask = scored["tasks"], scored["s0"].nll.detach(), scored["si"].detach(), scored["s0"].mask
        out.update(rank_diagnostics(a, b, mask, **reg))
        out["rho"] = {}
        for task in sorted(set(tasks)):
            rows = torch.tensor([i for i, t in enumerate(tasks) if t == task], device=a.device)
            rho = rank_diagnostics(a[rows], b[rows], mask[rows], **reg)["rho_hard"]
            if math.isfinite(rho):
                out["rho"][task] = (rho, len(rows))
        return out

    def standard_loss(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        """Token-weighted CE of the mixture batch's gold targets (see :func:`token_weighted_ce`);
        ``task_ce[t]`` is task t's own per-token CE in this batch (for studies; not logged: a key
        logged only on some steps makes a resumed run's metrics rows differ)."""
        sums, tokens, per_task = [], [], {}
        for group in SCORING_GROUPS:
            rows = [b for b, t in enumerate(batch["tasks"]) if t in group]
            if not rows:
                continue
            imgs = [batch["images"][b] for b in rows]
            texts = [batch["texts"][b] for b in rows]
            targets = [batch["targets"][b] for b in rows]
            if group[0] == "caption":
                prompts = [self.model.caption_prompt if batch["tasks"][b] == "caption" else texts[i]
                           for i, b in enumerate(rows)]
                sc = self.model.score_text(imgs, prompts, [[t] for t in targets])
            elif group[0] == "instruct":  # a suite's long prompt format, given as answer() gives it
                sc = self.model.score_text(imgs, [" " + t.strip() for t in texts], [[t] for t in targets])
            elif group[0] == "reason":  # think prompt -> trace, text only (the format reason() generates in)
                sc = self.model.score_text(None, texts, [[t] for t in targets])
            elif group[0] == "grounding":
                sc = self.model.score_boxes(imgs, [[t] for t in texts], targets)
            elif group[0] == "reason_t2i":  # [P, R] -> image, R cut from the left to fit (UReason setting 2)
                contexts, _ = self.model.fit_context(texts, [batch["contexts"][b] for b in rows])
                sc = self.model.score_image([[t] for t in texts], imgs, contexts=contexts)
            elif group[0] == "edit":  # source image + instruction -> the target image's codes
                sc = self.model.score_edit(imgs, texts, targets)
            else:
                prompts = [[self._t2i_prompt(t, batch["ids"][b])] for t, b in zip(texts, rows)]
                sc = self.model.score_image(prompts, imgs)
            sc = self._count(sc)
            sums.append(sc.sum_nll[:, 0])
            tokens.append(sc.num_tokens[:, 0])
            for task in group:
                idx = [i for i, b in enumerate(rows) if batch["tasks"][b] == task]
                if idx:
                    total = sums[-1].detach()[idx].sum() / tokens[-1][idx].sum().clamp(min=1)
                    per_task[task] = total.float()
        loss = token_weighted_ce(sums, tokens, self._token_all_reduce())
        return {"loss": loss, "loss_ce": loss.detach(), "num_sequences": torch.tensor(len(batch["tasks"])),
                "task_ce": per_task}

    def _token_all_reduce(self):
        """Sum over ranks (for global token and example counts) under a multi-process strategy, else None."""
        if self._trainer is None or self.trainer.world_size <= 1:
            return None
        strategy = self.trainer.strategy
        return lambda t: (strategy.reduce(t, reduce_op="sum"), float(self.trainer.world_size))

    def _count(self, scores: Scores) -> Scores:
        self.counts["truncated"] += int(scores.num_truncated)
        return scores

    # ---- Lightning hooks ------------------------------------------------------------------
    def consistency_plan(self, contrast: dict[str, Any] | None) -> tuple[bool, str | None]:
        """``(consistency update?, step task)`` of a step whose γ draw chose a consistency update,
        the same on every rank: an update needs a usable contrast sample on every rank, and with
        ``loss.task_draw=per_step`` its task is drawn from ``(seed, step)`` among ``loss.tasks``
        that some sample supports on every rank (None with ``per_sample``). One all-gather of
        ``[#samples, #samples supporting each task]`` under a multi-process strategy."""
        tasks = list(self.cfg.loss.tasks)
        samples = list(zip(contrast["samples"], contrast["contrasts"])) if contrast is not None else []
        supported = [supported_tasks(s, c, tasks) for s, c in samples]
        counts = torch.tensor([len(samples)] + [sum(t in opts for opts in supported) for t in tasks],
                              device=self.device)
        if self._trainer is not None and self.trainer.world_size > 1:
            counts = self.trainer.strategy.all_gather(counts).reshape(-1, len(tasks) + 1).amin(0)
        if counts[0] == 0:
            return False, None
        if self.cfg.loss.task_draw != "per_step":
            return True, None
        options = [t for t, c in zip(tasks, counts[1:].tolist()) if c > 0]
        if not options:
            return False, None
        return True, self._task_rng("step-task").choice(options)

    def training_step(self, batch: dict[str, Any], batch_idx: int):
        contrast = batch.get("contrast")
        consistency = self.draw_update()
        if consistency and contrast is not None:
            self.counts["skipped_no_contrast"] += int(contrast["num_skipped"])
        if consistency:
            consistency, step_task = self.consistency_plan(contrast)
        if consistency:
            out, kind, ids = self.consistency_loss(contrast, step_task), "consistency", contrast["ids"]
            self.counts["consistency_updates"] += 1
        else:
            out, kind, ids = self.standard_loss(batch["mixture"]), "standard", batch["mixture"]["ids"]
            self.counts["standard_updates"] += 1
        loss = out["loss"]

        finite = bool(torch.isfinite(loss.detach()).item())
        all_finite = self.trainer.strategy.reduce_boolean_decision(finite, all=True) if self._trainer else finite
        if not all_finite:
            msg = (f"non-finite loss ({loss.item() if not finite else 'on another rank'}) at global step "
                   f"{self.global_step} (batch {batch_idx}, {kind} update, example ids {ids[:16]})")
            if self.cfg.loss.on_nonfinite == "stop":
                raise NonFiniteLossError(msg + "; set loss.on_nonfinite=skip to skip such steps")
            self.counts["skipped_nonfinite"] += 1
            self.print(f"skipping step: {msg}")
            self._log_counts()
            return None

        bs = len(ids)
        self.log("train/loss", loss.detach(), prog_bar=True, batch_size=bs)
        self.log("train/loss_ce", out["loss_ce"], batch_size=bs)
        if kind == "consistency":
            self.log("train/loss_const", out["loss_const"], prog_bar=True, batch_size=bs)
            for key, name in (("rho_hard", "train/rank_rho_hard"), ("soft_hard_gap", "train/soft_hard_gap")):
                if key in out and math.isfinite(out[key]):
                    self.log(name, out[key], batch_size=bs)
            if self.rho_epoch.get("epoch") != self.current_epoch:  # a new epoch (kept across a resume)
                self.rho_epoch = {"epoch": self.current_epoch, "tasks": {}}
            for task, (rho, rows) in out.get("rho", {}).items():
                total, count = self.rho_epoch["tasks"].get(task, (0.0, 0))
                self.rho_epoch["tasks"][task] = (total + rho * rows, count + rows)
                previous = self.rho_ema.get(task, rho)
                self.rho_ema[task] = previous + (1 - (1 - RHO_EMA_RATE) ** rows) * (rho - previous)
        for task, value in self.rho_ema.items():
            self.log(f"train/rho/{task}/ema", value, batch_size=1)
        for task, (total, count) in self.rho_epoch.get("tasks", {}).items():
            self.log(f"train/rho/{task}/epoch_mean", total / count, batch_size=1)
        self._log_counts()
        return loss

    def _log_counts(self) -> None:
        for key, value in self.counts.items():
            self.log(f"train/{key}", float(value), reduce_fx="max", batch_size=1)

    def configure_optimizers(self):
        """``optim.name`` (:func:`unicon.training.optim.build_optimizer`: AdamW, or Muon + AdamW) with
        weight decay on the matrices only, and ``optim.scheduler`` stepped every optimizer step.
        Lightning's ``LearningRateMonitor`` (:func:`unicon.training.run.train`) logs the learning rate
        as ``train/lr/<param group>``: ``decay``, ``no_decay`` (and ``muon``)."""
        from transformers import get_scheduler

        ocfg = self.cfg.optim
        if offloads_optimizer(self.trainer.strategy):
            # ZeRO-Offload steps the fp32 master weights and Adam moments in CPU memory: DeepSpeed's
            # vectorised C++ Adam, the same update as AdamW (adamw_mode: decoupled weight decay);
            # DeepSpeed refuses other optimizers with offload (zero_force_ds_cpu_optimizer)
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            optimizer = DeepSpeedCPUAdam(decay_groups(self.model, ocfg.weight_decay, nonempty=True), lr=ocfg.lr,
                                         betas=tuple(ocfg.betas), adamw_mode=True)
        else:
            from lightning.pytorch.strategies import DDPStrategy

            data_parallel = isinstance(self.trainer.strategy, DDPStrategy) and self.trainer.world_size > 1
            optimizer = build_optimizer(ocfg.name, self.model, ocfg.lr, ocfg.weight_decay, tuple(ocfg.betas),
                                        data_parallel=data_parallel,
                                        scaled_gradients=getattr(self.trainer.precision_plugin, "scaler", None) is not None)
        total = int(self.trainer.estimated_stepping_batches)
        scheduler = get_scheduler(
            SCHEDULERS[ocfg.scheduler], optimizer,
            num_warmup_steps=math.ceil(ocfg.warmup_ratio * total), num_training_steps=total,
        )
        return {"optimizer": optimizer,
                "lr_scheduler": {"scheduler": scheduler, "interval": "step", "name": "train/lr"}}

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        """Lightning's clipping (``trainer.gradient_clip_val``), also for torch's fused AdamW under
        ``bf16-mixed``. Lightning's ``MixedPrecision`` plugin refuses to clip for any optimizer that
        unscales gradients inside its step (``_step_supports_amp_scaling``, the fused kernels): a rule
        for fp16's loss scaler, which would have it clip scaled gradients. bf16 has no scaler (the
        plugin's ``scaler`` is None), the gradients are the true ones, and the plugin's base class
        clips them as under fp32. (Under ``16-mixed`` the optimizer is not fused:
        :func:`~unicon.training.optim.build_optimizer`'s ``scaled_gradients``.)"""
        from lightning.pytorch.plugins.precision import MixedPrecision, Precision
        from lightning.pytorch.utilities import GradClipAlgorithmType

        plugin = self.trainer.precision_plugin
        if type(plugin) is MixedPrecision and plugin.scaler is None and gradient_clip_val:
            algorithm = GradClipAlgorithmType(gradient_clip_algorithm or GradClipAlgorithmType.NORM)
            Precision.clip_gradients(plugin, optimizer, gradient_clip_val, algorithm)
            return
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["unicon_config"] = OmegaConf.to_container(self.cfg, resolve=True)
        checkpoint["unicon_world_files"] = self.world_files
        checkpoint["gamma_rng_state"] = self.gamma_rng.get_state()
        checkpoint["unicon_counts"] = dict(self.counts)
        checkpoint["unicon_rho_ema"] = dict(self.rho_ema)
        checkpoint["unicon_rho_epoch"] = {"epoch": self.rho_epoch.get("epoch"),
                                          "tasks": {t: list(v) for t, v in self.rho_epoch.get("tasks", {}).items()}}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if "gamma_rng_state" in checkpoint:
            self.gamma_rng.set_state(checkpoint["gamma_rng_state"])
        self.counts.update(checkpoint.get("unicon_counts", {}))
        self.rho_ema.update(checkpoint.get("unicon_rho_ema", {}))
        stored = checkpoint.get("unicon_rho_epoch") or {}
        if stored.get("epoch") is not None:
            self.rho_epoch = {"epoch": stored["epoch"], "tasks": {t: tuple(v) for t, v in stored["tasks"].items()}}
