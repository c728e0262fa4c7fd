"""Cross-task rank-consistency losses (CocoCon, section 5, Eq. 3 and Algorithm 1).

Inputs are two score matrices of the *same* candidate list seen by two tasks: ``s0`` for
the anchor task (captioning) and ``si`` for an evaluation task (VQA, localization or
text-to-image), each ``[B, K]`` per-candidate length-normalised NLL (``Scores.nll``), plus
the ``[B, K]`` bool ``mask`` of real candidates (candidate 0 is the gold one, 1.. are the
contrasts). Lower NLL = more likely, and both tasks are ranked the same way, so a
consistent model gives both lists the same ranks.

Spearman (the paper's, ``loss.type=spearman``)
    With differentiable ranks ``R = soft_rank(s)`` (Blondel et al. 2020, via
    ``torchsort.soft_rank``; ranks lie in ``[1, K_b]``; regularization ``l2`` or ``kl`` with
    strength ``eps``, default 1.0 as in Table 5), per example ``b`` with ``K_b`` real
    candidates::

        L_b = ½ ‖R0_b − Ri_b‖²  /  D(K_b),       D(K) = (K³ − K) / 6

    ``D(K)`` is ``½‖r − reverse(r)‖²`` for hard ranks ``r = 1..K``, the largest value the
    numerator can take, so ``L_b ∈ [0, 1]`` and, for hard ranks, ``L_b = (1 − ρ_b) / 2``
    with ``ρ_b`` Spearman's correlation. This is the normalisation that makes the scale of
    the loss independent of K (the paper's Eq. 3 is un-normalised; at K=5 our value is the
    paper's divided by 20). The batch loss is the mean of ``L_b`` over examples with
    ``K_b ≥ 2`` (a single candidate has no ranking); it is 0 when no example qualifies.

    Masking: ranks are computed for each example on its real candidates only (examples are
    grouped by ``K_b`` and each group is one batched ``soft_rank`` call), so padded entries
    can never change a real candidate's rank.

Hinge (``loss.type=hinge``, the paper's "+ Hinge Loss" baseline; the paper does not give
    its formula, this is ours) -- a pairwise margin-ranking version of the same idea: for
    every ordered pair ``(j, k)`` of real candidates, let ``σ0_jk = sign(s0_k − s0_j)`` be the
    anchor's (detached) ordering; task ``i`` should order the pair the same way by a margin
    ``m``, and vice versa::

        L_b = mean_{j≠k, σ≠0} ½ [ max(0, m − σ0_jk (si_k − si_j)) + max(0, m − σi_jk (s0_k − s0_j)) ]

    Averaging over pairs keeps the scale independent of K. Batch loss = mean over examples
    with at least one ordered pair.

None (``loss.type=none``): 0 -- Algorithm 1 with λ = 0, the "+ Cont. Pretrain" control.
"""

from __future__ import annotations

import torch

LOSS_TYPES = ("spearman", "hinge", "none")


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


def soft_ranks(values: torch.Tensor, regularization: str = "l2", regularization_strength: float = 1.0) -> torch.Tensor:
    """``torchsort.soft_rank`` of each row of ``[n, K]`` (ascending: the smallest value gets rank ≈ 1)."""
    import torchsort

    # torchsort's kernels work in float32/64; bf16 scores are promoted and the result cast back
    out = torchsort.soft_rank(
        values.float(), regularization=regularization, regularization_strength=regularization_strength
    )
    return out.to(values.dtype)


def spearman_rank_loss(
    s0: torch.Tensor,
    si: torch.Tensor,
    mask: torch.Tensor | None = None,
    regularization: str = "l2",
    regularization_strength: float = 1.0,
    reduction: str = "mean",
) -> torch.Tensor:
    """``½‖R0 − Ri‖² / ((K³−K)/6)`` per example, mean over examples with ≥ 2 candidates (module docstring)."""
    mask = _check(s0, si, mask)
    counts = mask.sum(1)
    per_example = s0.new_zeros(s0.shape[0], dtype=torch.float32)
    for k in sorted({int(c) for c in counts.tolist() if c >= 2}):
        rows = (counts == k).nonzero(as_tuple=True)[0]
        r0 = soft_ranks(s0[rows, :k], regularization, regularization_strength).float()
        ri = soft_ranks(si[rows, :k], regularization, regularization_strength).float()
        norm = (k**3 - k) / 6.0
        per_example = per_example.index_put((rows,), 0.5 * ((r0 - ri) ** 2).sum(1) / norm)
    valid = counts >= 2
    return _reduce(per_example, valid, reduction)


def hinge_rank_loss(
    s0: torch.Tensor,
    si: torch.Tensor,
    mask: torch.Tensor | None = None,
    margin: float = 0.1,
    reduction: str = "mean",
) -> torch.Tensor:
    """Symmetric pairwise margin-ranking loss between the two tasks' orderings (module docstring)."""
    mask = _check(s0, si, mask)
    # padded entries are replaced by 0 (not just multiplied by 0) so that NaN/inf padding cannot leak
    s0f = torch.where(mask, s0.float(), torch.zeros_like(s0, dtype=torch.float32))
    sif = torch.where(mask, si.float(), torch.zeros_like(si, dtype=torch.float32))
    d0 = s0f[:, None, :] - s0f[:, :, None]  # [B, j, k] = s0_k - s0_j
    di = sif[:, None, :] - sif[:, :, None]
    pair = mask[:, :, None] & mask[:, None, :]
    sign0, signi = torch.sign(d0).detach(), torch.sign(di).detach()
    term = 0.5 * (torch.relu(margin - sign0 * di) * (sign0 != 0) + torch.relu(margin - signi * d0) * (signi != 0))
    counted = pair & ((sign0 != 0) | (signi != 0))
    n_pairs = counted.sum((1, 2))
    per_example = (term * counted).sum((1, 2)) / n_pairs.clamp(min=1)
    return _reduce(per_example, n_pairs > 0, reduction)


def _reduce(per_example: torch.Tensor, valid: torch.Tensor, reduction: str) -> torch.Tensor:
    if reduction == "none":
        return per_example * valid
    if reduction != "mean":
        raise ValueError(f"reduction must be 'mean' or 'none', got {reduction!r}")
    n = valid.sum()
    return (per_example * valid).sum() / n.clamp(min=1)


def consistency_loss(
    loss_type: str,
    s0: torch.Tensor,
    si: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    regularization: str = "l2",
    regularization_strength: float = 1.0,
    margin: float = 0.1,
) -> torch.Tensor:
    """Dispatch on ``loss.type`` (``spearman`` | ``hinge`` | ``none``)."""
    if loss_type == "spearman":
        return spearman_rank_loss(s0, si, mask, regularization, regularization_strength)
    if loss_type == "hinge":
        return hinge_rank_loss(s0, si, mask, margin)
    if loss_type == "none":
        _check(s0, si, mask)
        return s0.new_zeros((), dtype=torch.float32)
    raise ValueError(f"loss.type must be one of {', '.join(LOSS_TYPES)}, got {loss_type!r}")
