"""Cross-task rank-consistency losses (CocoCon, section 5, Eq. 3 and Algorithm 1).

Inputs are two score matrices of the *same* candidate list seen by two tasks: ``s0`` for
the anchor task (captioning) and ``si`` for an evaluation task (VQA, localization or
text-to-image), each ``[B, K]`` per-candidate length-normalised NLL (``Scores.nll``), plus
the ``[B, K]`` bool ``mask`` of real candidates (candidate 0 is the gold one, 1.. are the
contrasts; real candidates first). Lower NLL = more likely, and both tasks are ranked the same
way, so a consistent model gives both lists the same ranks.

Rank scale (our choice; the paper does not state the scale of the scores)
    Soft ranks ``R = soft_rank(θ, ε)`` (Blondel et al. 2020, ``torchsort.soft_rank``) project
    ``θ/ε`` onto the permutahedron: they equal the hard ranks only where sorted values are at
    least ε apart, and merge into ``R = mean + (θ − mean θ)/ε`` where they are closer. NLL gaps
    between candidates are ~0.05-0.3 nats (and divided again by the output length for T2I and
    localization), so with ε = 1 raw NLLs are always merged: the "rank" loss would compare
    centred raw scores, not orders. Each row is therefore standardised over its ``K_b`` real
    candidates and rescaled to the spread of the ranks ``1..K_b``::

        z_b = (s_b − mean(s_b)) / std(s_b) · σ(K_b),      σ(K) = sqrt((K² − 1) / 12)

    (population std). An evenly spread row then has gaps of exactly one rank, so ε = 1
    (Table 5) means "one rank step". The loss is invariant to positive affine changes of either
    row, so it does not depend on how a backend scales its scores. The std is *detached*: the
    gradient reaches the scores through the centring only, ``∂z/∂s = σ(K)/std · (I − 11ᵀ/K)``.
    Through a differentiated std the gradient would have no component that changes the row's
    spread, and a two-candidate row (whose standardised values are always ±½) would get none at
    all: its order can only flip by shrinking its spread through zero. A row whose spread is below the rounding of its values (all candidates scored alike)
    carries no order and is skipped, like a row with one candidate; a row with a NaN/inf score makes
    the loss NaN instead (so the training step's non-finite guard sees it).

Batch rank scale (``loss.rank_scale=batch``; ours, a deviation from the paper, which states no
    scale). With the per-row std above (``row``, the default), ``∂z/∂s`` grows as ``1/std(s_b)``: a
    row whose candidates are scored almost alike gets as large a rank difference, and a gradient on
    its scores as many times larger, as its spread is smaller (T2I's rows spread ~8x less than
    VQA's). ``batch`` divides every row of one task in one loss call by one detached scale, the
    root-mean-square of the stds of that task's ordered rows::

        z_b = (s_b − mean(s_b)) / S · σ(K_b),      S = sqrt(mean_{b' ordered} std(s_b')²)

    (one ``S`` for the anchor's rows, one per evaluation task for ``s_i``'s rows, each over that
    device's batch). A row with a small spread then keeps small rank differences (soft ranks merge
    toward its mean) and ``∂z/∂s = σ(K)/S · (I − 11ᵀ/K)`` does not grow as its spread shrinks. The
    loss is invariant to positive affine changes of a task's whole batch, no longer of one row; which
    rows are skipped (no order, one candidate) is the same as with ``row``. :func:`rank_diagnostics`
    stays on per-row scaled scores.

Soft ranks (``loss.soft_rank``, softness ε = ``loss.regularization_strength``, in rank steps)
    ``torchsort`` (the paper's): the projection above. It equals the hard ranks wherever sorted
    neighbours are ≥ ε apart, and there its gradient is exactly zero: a misordered pair that is
    well separated in both tasks gets no push, only near-ties do. On rank-scaled rows (gaps of
    about one rank step) with ε = 1 most candidates are in that regime.
    ``sigmoid`` (ours; a deviation from the paper): the pairwise logistic relaxation of the rank
    at temperature ε::

        R_j(z) = ½ + Σ_k σ((z_j − z_k) / ε)        (the k = j term is σ(0) = ½)

    the hard rank (ties averaged) as ε → 0, and smooth everywhere: every pair contributes a
    gradient ``σ'((z_j − z_k)/ε)/ε > 0``, so every misordered candidate is pushed, the closer
    pairs harder. Same scale as the hard ranks, so Eq. 3's scale and λ carry over.

Spearman (the paper's, ``loss.type=spearman``) -- Eq. 3 as written, per example::

        L_b = ½ ‖R(z0_b) − R(zi_b)‖²

    For hard ranks ``½‖r0 − ri‖² = (K³ − K)/12 · (1 − ρ_b)`` with Spearman's ρ_b: 0 for the same
    order, ``(K³ − K)/6`` (20 at K = 5) for the reversed one.
    λ = 0.25 therefore has the paper's scale. (The first version divided by ``(K³ − K)/6``,
    which made the effective λ 20-35× smaller than the paper's.) The batch loss is the mean of
    ``L_b`` over the examples that have an order in both tasks; 0 when none has.

    Differences from the paper, all written down here: the standardisation above; masking of
    ragged K (ranks are computed per example on its real candidates only: examples are grouped by
    ``K_b``, one batched ``soft_rank`` call per group, so padding can never change a rank); the
    mean over examples (the paper's Eq. 3 is per example).

Rank terms (``loss.rank_terms``; ``gold`` is ours, a deviation from the paper). ``all`` is Eq. 3:
    every candidate's squared soft-rank difference. ``gold`` keeps the gold candidate's (index 0)
    term only::

        L_b = ½ (R(z0_b)_0 − R(zi_b)_0)²

    the disagreement on where the gold ranks among its contrasts, which is what ``C_k`` measures;
    the order of the contrasts among themselves gets no push. With ``sigmoid`` ranks,
    ``R_0 = ½ + Σ_k σ((z_0 − z_k)/ε)``, so every gold-vs-contrast pair still has a gradient. For
    hard ranks the term is 0 when both tasks put the gold at the same place, and ``(K − 1)²/2``
    (8 at K = 5) when one ranks it first and the other last.

Hinge (``loss.type=hinge``, the paper's "+ Hinge Loss" baseline; the paper does not give
    its formula, this is ours) -- a pairwise margin-ranking version of the same idea on the same
    standardised scores ``z``: for every ordered pair ``(j, k)`` of real candidates, let
    ``σ0_jk = sign(z0_k − z0_j)`` be the anchor's (detached) ordering; task ``i`` should order the
    pair the same way by a margin ``m`` (in rank steps), and vice versa::

        L_b = mean_{j≠k, σ≠0} ½ [ max(0, m − σ0_jk (zi_k − zi_j)) + max(0, m − σi_jk (z0_k − z0_j)) ]

    Averaging over pairs keeps the scale independent of K. Batch loss = mean over examples
    with at least one ordered pair.

None (``loss.type=none``): 0 -- Algorithm 1 with λ = 0, the "+ Cont. Pretrain" control.

Direction (``loss.direction``; ours, not the paper's). ``mutual`` (the paper's Eq. 3): the
gradient moves both tasks toward each other's order. ``toward_gold``: on an example where exactly
one of the two tasks ranks the gold candidate (index 0) first, that task's scores are detached, so
only the other task moves toward its order; where both or neither do, both move. Why: in a world
where VQA knows a concept that captioning does not (``unicon build-data shapes --caption-gap``),
the mutual loss reached agreement by moving the task that was right: on the probed samples M
raised VQA C₁ while VQA accuracy fell from 84-95% to 58-82%
(docs/notebook/2026-11-27-shapes-consistency-notebook.md). The gold label is the one the L_ce term
of the same step already uses. ``toward_gold_strict`` (ours): as ``toward_gold``, and an example where
neither task ranks the gold first is left out of the loss (and of its mean): pulling two wrong orders
together makes the tasks agree in error, which C_k counts as consistent (on ShapesWorld's location
contrasts, where captioning is below chance, ``toward_gold`` raised VQA's C_1 while its accuracy fell:
docs/notebook/2026-12-03-the-method-shown.md).

:func:`rank_diagnostics` reports, per consistency step, the hard-rank Spearman ρ between the
two tasks and the mean |soft rank − hard rank| of the ranks the loss uses (near 0: the loss
operates on ranks; large: it compares merged, score-like values).
"""

from __future__ import annotations

import math

import torch

LOSS_TYPES = ("spearman", "hinge", "none")
SOFT_RANKS = ("torchsort", "sigmoid")
RANK_TERMS = ("all", "gold")
RANK_SCALES = ("row", "batch")


def _check(s0: torch.Tensor, si: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    if s0.dim() != 2 or s0.shape != si.shape:
        raise ValueError(f"expected two [B, K] score matrices of the same shape, got {tuple(s0.shape)} and {tuple(si.shape)}")
    if mask is None:
        return torch.ones_like(s0, dtype=torch.bool)
    if mask.shape != s0.shape:
        raise ValueError(f"mask {tuple(mask.shape)} does not match scores {tuple(s0.shape)}")
    mask = mask.bool()
    # real candidates must come first (the collator pads at the end); anything else is a bug upstream
    counts = mask.sum(1)
    expected = torch.arange(mask.shape[1], device=mask.device)[None, :] < counts[:, None]
    if not torch.equal(mask, expected):
        raise ValueError("mask must be a prefix mask: real candidates first, padding at the end of each row")
    return mask


def soft_ranks(values: torch.Tensor, regularization: str = "l2", regularization_strength: float = 1.0,
               soft_rank: str = "torchsort") -> torch.Tensor:
    """Soft ranks of each row of ``[n, K]`` (ascending: the smallest value gets rank ≈ 1):
    ``torchsort.soft_rank`` or the pairwise ``sigmoid`` ranks at temperature
    ``regularization_strength`` (module docstring)."""
    # both work in float32/64; bf16 scores are promoted and the result cast back
    dtype = values.dtype if values.dtype in (torch.float32, torch.float64) else torch.float32
    x = values.to(dtype)
    if soft_rank == "sigmoid":
        out = 0.5 + torch.sigmoid((x[:, :, None] - x[:, None, :]) / regularization_strength).sum(-1)
    elif soft_rank == "torchsort":
        import torchsort

        out = torchsort.soft_rank(x, regularization=regularization, regularization_strength=regularization_strength)
    else:
        raise ValueError(f"loss.soft_rank must be one of {', '.join(SOFT_RANKS)}, got {soft_rank!r}")
    return out.to(values.dtype)


def rank_scale(values: torch.Tensor, scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(z, ordered)`` for ``[n, K]`` rows of real candidates: each row standardised and rescaled
    to the spread of the ranks 1..K (module docstring), and whether the row has an order at all
    (its spread exceeds the rounding of its values). ``scale``: ``[n]`` detached divisors used
    instead of each row's own std (``loss.rank_scale=batch``, see :func:`batch_scales`)."""
    k = values.shape[1]
    x = values if values.dtype in (torch.float32, torch.float64) else values.float()
    centred = x - x.mean(1, keepdim=True)
    std = centred.detach().pow(2).mean(1, keepdim=True).sqrt()
    floor = torch.finfo(x.dtype).eps * x.detach().abs().amax(1, keepdim=True) * k
    ordered = (std.detach() > floor).squeeze(1)
    if scale is not None:
        std = scale.detach().to(x.dtype).reshape(-1, 1)
    safe = torch.where(ordered[:, None], std, torch.ones_like(std))
    z = centred / safe * math.sqrt((k * k - 1) / 12.0)
    return torch.where(ordered[:, None], z, torch.zeros_like(z)), ordered


def _groups(mask: torch.Tensor):
    """``(K_b, row indices)`` for every candidate count ``K_b >= 2`` present in the batch."""
    counts = mask.sum(1)
    for k in sorted({int(c) for c in counts.tolist() if c >= 2}):
        yield k, (counts == k).nonzero(as_tuple=True)[0]


@torch.no_grad()
def batch_scales(values: torch.Tensor, mask: torch.Tensor, labels=None) -> torch.Tensor:
    """``[B]`` detached divisors for ``loss.rank_scale=batch``: per label (``labels``, one per row,
    e.g. the evaluation task; all rows share one when None), the root-mean-square of the stds of
    that label's ordered rows (each over its ``K_b`` real candidates); 1 for a label without one."""
    B = values.shape[0]
    dtype = torch.float64 if values.dtype == torch.float64 else torch.float32
    var = torch.zeros(B, dtype=dtype, device=values.device)
    ordered = torch.zeros(B, dtype=torch.bool, device=values.device)
    for k, rows in _groups(mask):
        x = values[rows, :k].to(dtype)
        centred = x - x.mean(1, keepdim=True)
        std = centred.pow(2).mean(1).sqrt()
        floor = torch.finfo(dtype).eps * x.abs().amax(1) * k
        var = var.index_put((rows,), std.pow(2))
        ordered = ordered.index_put((rows,), std > floor)  # the rows rank_scale calls ordered
    labels = [0] * B if labels is None else list(labels)
    if len(labels) != B:
        raise ValueError(f"expected one label per row ({B}), got {len(labels)}")
    scale = torch.ones(B, dtype=dtype, device=values.device)
    for label in set(labels):
        rows = torch.tensor([i for i, x in enumerate(labels) if x == label], device=values.device)
        ok = rows[ordered[rows]]
        if len(ok):
            scale = scale.index_put((rows,), var[ok].mean().sqrt())
    return scale


def _scales(s0: torch.Tensor, si: torch.Tensor, mask: torch.Tensor, scale: str, tasks=None):
    """``(scale0, scalei)`` for :func:`rank_scale`: ``(None, None)`` for ``row``; for ``batch`` one
    scale over the call for the anchor ``s0`` (one task) and one per label of ``tasks`` for ``si``."""
    if scale not in RANK_SCALES:
        raise ValueError(f"loss.rank_scale must be one of {', '.join(RANK_SCALES)}, got {scale!r}")
    if scale == "row":
        return None, None
    return batch_scales(s0, mask), batch_scales(si, mask, tasks)


def spearman_rank_loss(
    s0: torch.Tensor,
    si: torch.Tensor,
    mask: torch.Tensor | None = None,
    regularization: str = "l2",
    regularization_strength: float = 1.0,
    reduction: str = "mean",
    all_reduce=None,
    soft_rank: str = "torchsort",
    weight: torch.Tensor | None = None,
    rank_terms: str = "all",
    scale: str = "row",
    tasks=None,
    keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """Eq. 3, ``½‖R(z0) − R(zi)‖²`` per example on rank-scaled scores, mean over examples (module
    docstring); ``rank_terms="gold"``: the gold candidate's term only; ``weight``: ``[B]`` factors
    of the examples' terms (see :func:`_reduce`); ``scale``: ``loss.rank_scale`` (``row`` | ``batch``;
    with ``batch``, ``tasks`` labels each row's evaluation task: one scale per task for ``si``); ``keep``:
    ``[B]`` bool, the examples that may enter the loss (the others are left out of it and of its mean)."""
    if rank_terms not in RANK_TERMS:
        raise ValueError(f"loss.rank_terms must be one of {', '.join(RANK_TERMS)}, got {rank_terms!r}")
    mask = _check(s0, si, mask)
    scale0, scalei = _scales(s0, si, mask, scale, tasks)
    dtype = torch.float64 if s0.dtype == torch.float64 else torch.float32
    per_example = s0.new_zeros(s0.shape[0], dtype=dtype)
    valid = torch.zeros(s0.shape[0], dtype=torch.bool, device=s0.device)
    for k, rows in _groups(mask):
        z0, ok0 = rank_scale(s0[rows, :k], None if scale0 is None else scale0[rows])
        zi, oki = rank_scale(si[rows, :k], None if scalei is None else scalei[rows])
        r0 = soft_ranks(z0, regularization, regularization_strength, soft_rank).to(dtype)
        ri = soft_ranks(zi, regularization, regularization_strength, soft_rank).to(dtype)
        # a non-finite score is never hidden as "no order": it makes the loss NaN (the training guard)
        broken = ~(torch.isfinite(s0[rows, :k]).all(1) & torch.isfinite(si[rows, :k]).all(1))
        ok = (ok0 & oki) | broken
        diff = (r0 - ri)[:, :1] if rank_terms == "gold" else r0 - ri
        value = torch.where(broken, float("nan"), 0.5 * (diff ** 2).sum(1))
        per_example = per_example.index_put((rows,), torch.where(ok, value, 0.0))
        valid = valid.index_put((rows,), ok)
    if keep is not None:
        valid = valid & keep
    return _reduce(per_example, valid, reduction, all_reduce, weight)


def hinge_rank_loss(
    s0: torch.Tensor,
    si: torch.Tensor,
    mask: torch.Tensor | None = None,
    margin: float = 0.1,
    reduction: str = "mean",
    all_reduce=None,
    weight: torch.Tensor | None = None,
    scale: str = "row",
    tasks=None,
    keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """Symmetric pairwise margin-ranking loss between the two tasks' orderings of rank-scaled scores
    (``scale``, ``tasks``, ``keep``: as for :func:`spearman_rank_loss`)."""
    mask = _check(s0, si, mask)
    scale0, scalei = _scales(s0, si, mask, scale, tasks)
    B, K = s0.shape
    z0 = s0.new_zeros(B, K, dtype=torch.float32)
    zi = s0.new_zeros(B, K, dtype=torch.float32)
    for k, rows in _groups(mask):  # padded entries stay 0 (never NaN/inf from the padding)
        z0k = rank_scale(s0[rows, :k], None if scale0 is None else scale0[rows])[0]
        zik = rank_scale(si[rows, :k], None if scalei is None else scalei[rows])[0]
        z0 = z0.index_put((rows,), torch.nn.functional.pad(z0k.float(), (0, K - k)))
        zi = zi.index_put((rows,), torch.nn.functional.pad(zik.float(), (0, K - k)))
    d0 = z0[:, None, :] - z0[:, :, None]  # [B, j, k] = z0_k - z0_j
    di = zi[:, None, :] - zi[:, :, None]
    pair = mask[:, :, None] & mask[:, None, :]
    sign0, signi = torch.sign(d0).detach(), torch.sign(di).detach()
    term = 0.5 * (torch.relu(margin - sign0 * di) * (sign0 != 0) + torch.relu(margin - signi * d0) * (signi != 0))
    counted = pair & ((sign0 != 0) | (signi != 0))
    n_pairs = counted.sum((1, 2))
    per_example = (term * counted).sum((1, 2)) / n_pairs.clamp(min=1)
    valid = n_pairs > 0 if keep is None else (n_pairs > 0) & keep
    return _reduce(per_example, valid, reduction, all_reduce, weight)


def _reduce(per_example: torch.Tensor, valid: torch.Tensor, reduction: str, all_reduce=None,
            weight: torch.Tensor | None = None) -> torch.Tensor:
    """Mean over the valid examples, of ``weight_b · L_b`` when ``weight`` is given (the count stays
    the number of valid examples: a weight scales its example's term, as a per-task λ does). Under
    DDP, ``all_reduce`` (sums a tensor over ranks, returns ``(total, world_size)``) makes it the mean
    over all ranks' valid examples: the rank returns ``world · Σ_rank / n_all``, whose mean over
    ranks (what DDP averages) is the global mean."""
    if weight is not None:
        per_example = per_example * weight.to(per_example.dtype)
    if reduction == "none":
        return per_example * valid
    if reduction != "mean":
        raise ValueError(f"reduction must be 'mean' or 'none', got {reduction!r}")
    total = torch.where(valid, per_example, torch.zeros_like(per_example)).sum()
    n = valid.sum().to(per_example.dtype)
    if all_reduce is not None:
        n, world = all_reduce(n)
        return total * world / n.clamp(min=1)
    return total / n.clamp(min=1)


def gold_first(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B]`` bool: the gold candidate (column 0) has a strictly lower NLL than every other real candidate."""
    others = scores.detach().masked_fill(~mask, float("inf"))[:, 1:]
    has_others = mask[:, 1:].any(1)
    return has_others & (scores.detach()[:, 0] < others.min(1).values)


def toward_gold(s0: torch.Tensor, si: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(s0, si)`` with the scores of the task that alone ranks the gold first detached, per example
    (``loss.direction=toward_gold``, module docstring)."""
    g0, gi = gold_first(s0, mask), gold_first(si, mask)
    s0 = torch.where((g0 & ~gi)[:, None], s0.detach(), s0)
    si = torch.where((gi & ~g0)[:, None], si.detach(), si)
    return s0, si


DIRECTIONS = ("mutual", "toward_gold", "toward_gold_strict")


def consistency_loss(
    loss_type: str,
    s0: torch.Tensor,
    si: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    regularization: str = "l2",
    regularization_strength: float = 1.0,
    margin: float = 0.1,
    direction: str = "mutual",
    soft_rank: str = "torchsort",
    rank_terms: str = "all",
    rank_scale: str = "row",
    tasks=None,
    all_reduce=None,
    weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dispatch on ``loss.type`` (``spearman`` | ``hinge`` | ``none``) after ``loss.direction`` (``mutual``
    | ``toward_gold`` | ``toward_gold_strict``); ``soft_rank`` and ``rank_terms``: the Spearman loss's
    ranks and terms; ``rank_scale`` (``row`` | ``batch``) and ``tasks`` (each row's evaluation task):
    the rank scale of both rank losses; ``all_reduce`` and ``weight`` (``[B]``, e.g. each example's task
    λ factor): see :func:`_reduce`."""
    if direction not in DIRECTIONS:
        raise ValueError(f"loss.direction must be one of {', '.join(DIRECTIONS)}, got {direction!r}")
    if rank_scale not in RANK_SCALES:
        raise ValueError(f"loss.rank_scale must be one of {', '.join(RANK_SCALES)}, got {rank_scale!r}")
    keep = None
    if direction in ("toward_gold", "toward_gold_strict") and loss_type != "none":
        checked = _check(s0, si, mask)
        if direction == "toward_gold_strict":
            keep = gold_first(s0, checked) | gold_first(si, checked)
        s0, si = toward_gold(s0, si, checked)
    if loss_type == "spearman":
        return spearman_rank_loss(s0, si, mask, regularization, regularization_strength,
                                  all_reduce=all_reduce, soft_rank=soft_rank, weight=weight, rank_terms=rank_terms,
                                  scale=rank_scale, tasks=tasks, keep=keep)
    if loss_type == "hinge":
        return hinge_rank_loss(s0, si, mask, margin, all_reduce=all_reduce, weight=weight,
                               scale=rank_scale, tasks=tasks, keep=keep)
    if loss_type == "none":
        _check(s0, si, mask)
        return s0.new_zeros((), dtype=torch.float32)
    raise ValueError(f"loss.type must be one of {', '.join(LOSS_TYPES)}, got {loss_type!r}")


def hard_ranks(values: torch.Tensor) -> torch.Tensor:
    """Ranks 1..K of each row, ties sharing their average rank (``scipy.stats.rankdata``'s 'average')."""
    smaller = (values[:, None, :] < values[:, :, None]).sum(-1)
    equal = (values[:, None, :] == values[:, :, None]).sum(-1)
    return (smaller + (equal + 1) / 2.0).to(torch.float64)


@torch.no_grad()
def rank_diagnostics(
    s0: torch.Tensor, si: torch.Tensor, mask: torch.Tensor | None = None,
    regularization: str = "l2", regularization_strength: float = 1.0, soft_rank: str = "torchsort",
) -> dict[str, float]:
    """``rho_hard``: mean Spearman ρ of the hard ranks of ``s0`` and ``si`` over the examples with an
    order in both; ``soft_hard_gap``: mean |soft rank − hard rank| of the rank-scaled scores the
    Spearman loss ranks (both tasks, every real candidate). NaN when no example qualifies."""
    mask = _check(s0, si, mask)
    rhos, gaps = [], []
    for k, rows in _groups(mask):
        a, b = s0[rows, :k].double(), si[rows, :k].double()
        za, oka = rank_scale(a)
        zb, okb = rank_scale(b)
        ok = oka & okb
        if not ok.any():
            continue
        ha, hb = hard_ranks(a[ok]), hard_ranks(b[ok])
        ca, cb = ha - ha.mean(1, keepdim=True), hb - hb.mean(1, keepdim=True)
        denom = (ca.norm(dim=1) * cb.norm(dim=1)).clamp(min=1e-300)
        rhos.append((ca * cb).sum(1) / denom)
        for z, h in ((za[ok], ha), (zb[ok], hb)):
            gaps.append((soft_ranks(z, regularization, regularization_strength, soft_rank).double() - h).abs().flatten())
    if not rhos:
        return {"rho_hard": float("nan"), "soft_hard_gap": float("nan")}
    return {"rho_hard": float(torch.cat(rhos).mean()), "soft_hard_gap": float(torch.cat(gaps).mean())}
