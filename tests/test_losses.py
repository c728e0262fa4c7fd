"""Rank-consistency losses (unicon.losses.consistency), checked against hand computations."""

import itertools

import pytest
import torch
from scipy.stats import spearmanr

from unicon.losses.consistency import consistency_loss, hinge_rank_loss, soft_ranks, spearman_rank_loss


def test_soft_rank_is_hard_rank_for_well_separated_values():
    x = torch.tensor([[30.0, 10.0, 20.0, 0.0]])
    assert torch.allclose(soft_ranks(x), torch.tensor([[4.0, 2.0, 3.0, 1.0]]))


def test_zero_for_identical_orderings_and_positive_otherwise():
    s0 = torch.tensor([[0.0, 10.0, 20.0, 30.0]])
    same_order = torch.tensor([[5.0, 15.0, 40.0, 60.0]])  # different values, same ranks
    assert spearman_rank_loss(s0, same_order).item() == pytest.approx(0.0, abs=1e-6)
    swapped = torch.tensor([[10.0, 0.0, 20.0, 30.0]])
    assert spearman_rank_loss(s0, swapped).item() > 0


def test_normalised_value_is_half_one_minus_spearman_for_every_permutation_and_k():
    for k in (2, 3, 5, 7):
        s0 = torch.arange(k, dtype=torch.float32)[None] * 10
        perms = list(itertools.permutations(range(k)))[:50]
        for perm in perms:
            si = torch.tensor(perm, dtype=torch.float32)[None] * 10
            rho = spearmanr(s0[0].numpy(), si[0].numpy()).statistic
            assert spearman_rank_loss(s0, si).item() == pytest.approx((1 - rho) / 2, abs=1e-5)
        # fully reversed ordering is the maximum, 1.0, whatever K is
        assert spearman_rank_loss(s0, s0.flip(1)).item() == pytest.approx(1.0, abs=1e-5)


def test_gradient_moves_misranked_candidates_toward_a_common_rank():
    # candidate 1 is ranked 1st by the anchor and 3rd by the task; candidate 2 the reverse
    # (values within the regularization strength, where soft ranks are not piecewise constant)
    s0 = torch.tensor([[1.0, 0.5, 1.5]], requires_grad=True)
    si = torch.tensor([[1.0, 1.5, 0.5]], requires_grad=True)
    spearman_rank_loss(s0, si).backward()
    step_s0, step_si = -s0.grad[0], -si.grad[0]  # gradient-descent direction
    # the anchor should make candidate 1 less likely (NLL up) and 2 more likely; the task the opposite
    assert step_s0[1] > 0 and step_s0[2] < 0
    assert step_si[1] < 0 and step_si[2] > 0
    # a small step reduces the loss
    with torch.no_grad():
        before = spearman_rank_loss(s0, si)
        after = spearman_rank_loss(s0 + 0.1 * step_s0 / step_s0.norm(), si + 0.1 * step_si / step_si.norm())
    assert after < before


def test_masked_padding_does_not_change_the_loss():
    torch.manual_seed(0)
    a0, ai = torch.randn(1, 3), torch.randn(1, 3)
    b0, bi = torch.randn(1, 5), torch.randn(1, 5)
    alone = (spearman_rank_loss(a0, ai) + spearman_rank_loss(b0, bi)) / 2
    for pad in (0.0, -1e6, 1e6, float("nan")):
        p = torch.full((1, 2), pad)
        s0 = torch.cat([torch.cat([a0, p], 1), b0])
        si = torch.cat([torch.cat([ai, p], 1), bi])
        mask = torch.tensor([[True] * 3 + [False] * 2, [True] * 5])
        assert spearman_rank_loss(s0, si, mask).item() == pytest.approx(alone.item(), abs=1e-6)
        assert hinge_rank_loss(s0, si, mask).item() == pytest.approx(
            ((hinge_rank_loss(a0, ai) + hinge_rank_loss(b0, bi)) / 2).item(), abs=1e-6
        )
    # gradients of the padded entries are exactly zero
    s0 = torch.cat([torch.cat([a0, torch.zeros(1, 2)], 1), b0]).requires_grad_()
    si = torch.cat([torch.cat([ai, torch.zeros(1, 2)], 1), bi]).requires_grad_()
    spearman_rank_loss(s0, si, mask).backward()
    assert torch.all(s0.grad[0, 3:] == 0) and torch.all(si.grad[0, 3:] == 0)


def test_single_candidate_rows_are_ignored():
    s0 = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    si = torch.tensor([[0.0, 1.0], [5.0, 0.0]])
    mask = torch.tensor([[True, True], [True, False]])
    assert spearman_rank_loss(s0, si, mask).item() == pytest.approx(spearman_rank_loss(s0[:1], si[:1]).item())


def test_hinge_value_by_hand():
    m = 0.1
    s0 = torch.tensor([[1.0, 2.0]])  # anchor: candidate 0 more likely
    si = torch.tensor([[1.05, 1.0]])  # task: candidate 1 slightly more likely (wrong order)
    # pair (0,1): σ0=+1, di=-0.05 -> relu(0.1+0.05)=0.15; σi=-1, d0=+1 -> relu(0.1+1)=1.1
    # pair (1,0): σ0=-1, di=+0.05 -> 0.15;               σi=+1, d0=-1 -> 1.1
    expected = 0.5 * (0.15 + 1.1)
    assert hinge_rank_loss(s0, si, margin=m).item() == pytest.approx(expected, abs=1e-6)
    # same ordering with gaps above the margin: zero
    assert hinge_rank_loss(s0, torch.tensor([[0.0, 1.0]]), margin=m).item() == pytest.approx(0.0)


def test_dispatch_and_bad_input():
    s = torch.randn(2, 3)
    assert consistency_loss("none", s, s).item() == 0.0
    with pytest.raises(ValueError, match="loss.type"):
        consistency_loss("cosine", s, s)
    with pytest.raises(ValueError, match="same shape"):
        spearman_rank_loss(s, torch.randn(2, 4))
    with pytest.raises(ValueError, match="prefix mask"):
        spearman_rank_loss(s, s, torch.tensor([[True, False, True], [True, True, True]]))
