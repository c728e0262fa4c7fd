"""The training optimizers (``optim.name``): AdamW, or Muon for the hidden matrices plus AdamW for the rest.

``adamw``: ``torch.optim.AdamW`` (fused where the parameters allow), weight decay on the matrices only.

``muon``: ``torch.optim.Muon`` (Jordan et al. 2024; torch's implementation) on the 2-D weights of
``nn.Linear`` layers that are not tied to an embedding: each update is the momentum of the gradient,
orthogonalised by five Newton-Schulz iterations, ``W -= lr · 0.2 · sqrt(max(A, B)) · NS(B_t)``
(``adjust_lr_fn="match_rms_adamw"``: the update's RMS matches AdamW's, so the run's ``optim.lr``
and ``optim.weight_decay`` carry over unchanged). Embeddings (and the output projection tied to
them), position and relative-position tables, convolutions, norms and biases stay on AdamW, as the
Muon authors prescribe. Both optimizers sit behind one :class:`torch.optim.Optimizer`
(:class:`MuonWithAdamW`), so Lightning's automatic optimisation, the LR scheduler (which sets
``lr`` on every param group) and checkpoints see a single optimizer.
"""

from __future__ import annotations

import logging
from collections.abc import MutableMapping
from typing import Any, Iterator

import torch
from torch import nn

from unicon.config import OPTIMIZERS

logger = logging.getLogger(__name__)


def muon_parameters(model: nn.Module) -> set[int]:
    """``id`` of every trainable 2-D ``nn.Linear`` weight of ``model`` that is not also an embedding's
    weight (a tied output projection is an embedding: Muon's orthogonalised step suits hidden maps)."""
    embedded = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    return {id(m.weight) for m in model.modules()
            if isinstance(m, nn.Linear) and m.weight.requires_grad and m.weight.ndim == 2
            and id(m.weight) not in embedded}


def newton_schulz(updates: torch.Tensor, coefficients: tuple[float, float, float], steps: int,
                  eps: float) -> torch.Tensor:
    """Muon's orthogonalisation of a batch of same-shaped matrices ``[N, A, B]``, as
    ``torch.optim.Muon`` computes it for one (in bfloat16; on the CPU in float32, below): each matrix
    scaled to unit Frobenius norm, then ``steps`` quintic iterations
    ``X <- a·X + (b·XXᵀ + c·(XXᵀ)²)·X`` on the wide orientation.

    Difference from torch: on the CPU the products run in float32 (on accelerators in bfloat16, as
    torch's Muon does everywhere). A CPU without bfloat16 matrix units (AVX-512 without AMX, e.g.
    Cascade Lake) emulates bfloat16 products: the ``shapes-tiny`` step's iterations took 160 ms there in
    bfloat16 against 43 ms in float32. float32 is also the more exact of the two; the quintic's
    coefficients do not rely on bfloat16's rounding."""
    a, b, c = coefficients
    x = updates.float() if updates.device.type == "cpu" else updates.bfloat16()
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = x.mT
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.mT
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.mT if tall else x


def _closure_loss(closure) -> Any:
    """The loss ``closure`` recomputes (with gradients enabled), as a torch optimizer's ``step`` does."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


class ShapeBatchedMuon(torch.optim.Muon):
    """``torch.optim.Muon`` (same state, hyperparameters and update) with the Newton-Schulz iterations
    of all same-shaped matrices run as one batched product (in float32 on the CPU: :func:`newton_schulz`).
    torch's loop runs 15 small matrix products per matrix: for the 39 matrices of ``shapes-tiny`` that
    was 40 ms of a ~340 ms CPU step (fused AdamW: 2 ms); batched by shape, the whole Muon + AdamW step
    takes about 25 ms.

    ``share_across_ranks`` (data parallelism, where every rank holds the same weights, gradients and
    momenta after DDP's all-reduce): rank ``r`` of ``W`` orthogonalises matrices ``r, r + W, ...`` of
    each shape and one all-reduce hands every rank all of them, instead of each rank repeating the
    whole Newton-Schulz (the update is the same; a CPU rank spends half the time on it)."""

    def __init__(self, params, share_across_ranks: bool = False, **kwargs):
        super().__init__(params, **kwargs)
        self.share_across_ranks = share_across_ranks
        self._warned_unshared = False

    def _same_matrices_on_every_rank(self) -> bool:
        """Whether every rank holds a gradient for the same matrices this step (one all-reduce of a
        0/1 mask, a few hundred bytes). DDP's all-reduce gives every rank the same gradients, so it is
        True there; a rank whose batch left a matrix without a gradient, under a strategy that does
        not fill it in, would otherwise misalign the shared all-reduce. Then each rank runs the whole
        Newton-Schulz on its own gradients this step, unshared, with a warning (once)."""
        import torch.distributed as dist

        params = [p for group in self.param_groups for p in group["params"]]
        mask = torch.tensor([float(p.grad is not None) for p in params], device=params[0].device)
        total = mask.clone()
        dist.all_reduce(total)
        if torch.equal(total, mask * dist.get_world_size()):
            return True
        if not self._warned_unshared:
            logger.warning("Muon: the ranks hold gradients for different matrices this step; each rank "
                           "orthogonalises all of them itself (share_across_ranks needs the same set)")
            self._warned_unshared = True
        return False

    @torch.no_grad()
    def step(self, closure=None):
        import torch.distributed as dist
        from torch.optim._muon import _adjust_lr

        loss = _closure_loss(closure)
        shared = self.share_across_ranks and dist.is_available() and dist.is_initialized()
        if shared and not self._same_matrices_on_every_rank():
            shared = False
        world, rank = (dist.get_world_size(), dist.get_rank()) if shared else (1, 0)
        steps = []
        for group in self.param_groups:
            params, grads, bufs = [], [], []
            self._init_group(group, params, grads, bufs)
            lr, momentum, decay = group["lr"], group["momentum"], group["weight_decay"]
            by_shape: dict[torch.Size, list[tuple[torch.Tensor, torch.Tensor]]] = {}
            for param, grad, buf in zip(params, grads, bufs):
                buf.lerp_(grad, 1 - momentum)
                update = grad.lerp(buf, momentum) if group["nesterov"] else buf
                by_shape.setdefault(param.shape, []).append((param, update))
            for shape, items in by_shape.items():
                updates = torch.stack([u for _, u in items])
                mine = newton_schulz(updates[rank::world], group["ns_coefficients"], group["ns_steps"],
                                     group["eps"])
                ortho = mine if world == 1 else mine.new_zeros(updates.shape).index_copy_(
                    0, torch.arange(rank, len(items), world, device=updates.device), mine)
                steps.append((items, ortho, lr * decay, _adjust_lr(lr, group["adjust_lr_fn"], shape)))
        if world > 1 and steps:  # every matrix is non-zero on exactly one rank: the sum is the whole set
            flat = torch.cat([ortho.reshape(-1) for _, ortho, _, _ in steps])
            dist.all_reduce(flat)
            sizes = [ortho.numel() for _, ortho, _, _ in steps]
            steps = [(items, part.view_as(ortho), d, s)
                     for (items, ortho, d, s), part in zip(steps, flat.split(sizes))]
        for items, ortho, decay_step, step_size in steps:
            for (param, _), o in zip(items, ortho):
                param.mul_(1 - decay_step)
                param.add_(o, alpha=-step_size)
        return loss


class _JointState(MutableMapping):
    """``optimizer.state`` of :class:`MuonWithAdamW`: each parameter's state lives in the optimizer
    that steps it (reads and writes are routed there; the parameter sets are disjoint)."""

    def __init__(self, *optimizers: torch.optim.Optimizer):
        self._optimizers = optimizers

    def _owner(self, param) -> dict:
        for opt in self._optimizers:
            if any(param is p for g in opt.param_groups for p in g["params"]):
                return opt.state
        raise KeyError("parameter not optimised here")

    def __getitem__(self, param):
        return self._owner(param)[param]

    def __setitem__(self, param, value) -> None:
        self._owner(param)[param] = value

    def __delitem__(self, param) -> None:
        del self._owner(param)[param]

    def __iter__(self) -> Iterator:
        for opt in self._optimizers:
            yield from opt.state

    def __len__(self) -> int:
        return sum(len(opt.state) for opt in self._optimizers)


class MuonWithAdamW(torch.optim.Optimizer):
    """``torch.optim.Muon`` on ``muon_groups`` and ``torch.optim.AdamW`` on ``adamw_groups``, stepped
    together. ``param_groups`` is the two optimizers' own group dicts (Muon's first), so a scheduler
    setting ``group["lr"]`` reaches both; ``state_dict`` holds both optimizers' states."""

    def __init__(self, muon_groups: list[dict], adamw_groups: list[dict], lr: float,
                 betas: tuple[float, float], fused: bool = False, share_across_ranks: bool = False):
        self.muon = ShapeBatchedMuon(muon_groups, lr=lr, adjust_lr_fn="match_rms_adamw",
                                     share_across_ranks=share_across_ranks)
        self.adamw = torch.optim.AdamW(adamw_groups, lr=lr, betas=betas, fused=fused)
        # no super().__init__: the groups and states are the two optimizers' own objects
        self.defaults = {"lr": lr}
        self.param_groups = self.muon.param_groups + self.adamw.param_groups
        self.state = _JointState(self.muon, self.adamw)
        self._optimizer_step_pre_hooks, self._optimizer_step_post_hooks = {}, {}
        self._optimizer_state_dict_pre_hooks, self._optimizer_state_dict_post_hooks = {}, {}
        self._optimizer_load_state_dict_pre_hooks, self._optimizer_load_state_dict_post_hooks = {}, {}

    @torch.no_grad()
    def step(self, closure=None):
        loss = _closure_loss(closure)
        self.muon.step()
        self.adamw.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.muon.zero_grad(set_to_none)
        self.adamw.zero_grad(set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if set(state_dict) != {"muon", "adamw"}:
            raise ValueError(f"not a Muon + AdamW optimizer state (keys {sorted(state_dict)}); "
                             "was the checkpoint trained with optim.name=adamw?")
        self.muon.load_state_dict(state_dict["muon"])
        self.adamw.load_state_dict(state_dict["adamw"])
        self.param_groups = self.muon.param_groups + self.adamw.param_groups


def decay_groups(model: nn.Module, weight_decay: float, exclude: set[int] = frozenset(),
                 nonempty: bool = False) -> list[dict]:
    """Param groups ``decay`` (trainable matrices, ``weight_decay``) and ``no_decay`` (vectors: norms,
    biases, head scales) of ``model``, without the parameters whose ``id`` is in ``exclude``. Raises
    when ``model`` has no trainable parameter at all (every optimizer path builds its groups here).
    ``nonempty``: leave out a group without parameters (LoRA trains matrices only; DeepSpeed drops
    empty groups, which would leave the LR scheduler with more groups than the optimizer)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    if not trainable:
        raise ValueError("no trainable parameters (check model.freeze / model.lora)")
    params = [p for p in trainable if id(p) not in exclude]
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay, "name": "decay"},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0, "name": "no_decay"}]
    return [g for g in groups if g["params"]] if nonempty else groups


def build_optimizer(name: str, model: nn.Module, lr: float, weight_decay: float,
                    betas: tuple[float, float], data_parallel: bool = False,
                    scaled_gradients: bool = False) -> torch.optim.Optimizer:
    """The ``optim.name`` optimizer over ``model``'s trainable parameters: param groups
    :func:`decay_groups` (and ``muon``, Muon's matrices, with ``weight_decay``). ``data_parallel``: the
    ranks of the default process group hold the same weights and all-reduced gradients (DDP), so
    Muon shares its Newton-Schulz iterations among them (:class:`ShapeBatchedMuon`).
    ``scaled_gradients``: a loss scaler multiplies the gradients (``16-mixed``'s GradScaler). Then
    AdamW is torch's per-tensor one, which the scaler unscales before gradient clipping; the fused
    kernel unscales inside its own step, after the clipping would have seen scaled gradients."""
    fused = not scaled_gradients and all(p.device.type in ("cpu", "cuda") and p.dtype.is_floating_point
                                         for p in model.parameters() if p.requires_grad)
    if name == "adamw":
        # torch's fused AdamW kernel (CPU and CUDA): one pass over all tensors instead of one op per
        # tensor per moment, ~5x cheaper on the tiny models, where the step is ~3% of an update
        return torch.optim.AdamW(decay_groups(model, weight_decay, nonempty=True), lr=lr, betas=betas, fused=fused)
    if name == "muon":
        on_muon = muon_parameters(model)
        rest = decay_groups(model, weight_decay, on_muon)
        if not on_muon:
            raise ValueError("optim.name=muon: the model has no trainable nn.Linear matrix for Muon")
        muon = [p for p in model.parameters() if id(p) in on_muon]
        return MuonWithAdamW([{"params": muon, "weight_decay": weight_decay, "name": "muon"}],
                             rest, lr=lr, betas=betas, fused=fused, share_across_ranks=data_parallel)
    raise ValueError(f"unknown optimizer {name!r}; choose from {', '.join(OPTIMIZERS)}")
