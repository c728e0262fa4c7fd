"""Rank-consistency losses (unicon.losses.consistency), checked against hand computations."""

import itertools
import math

import pytest
import torch
from scipy.stats import spearmanr

from unicon.losses.consistency import (
    batch_scales,
    consistency_loss,
    hinge_rank_loss,
    hard_ranks,
    rank_diagnostics,
    rank_scale,
    soft_ranks,
    spearman_rank_loss,
)


def test_soft_rank_is_hard_rank_for_well_separated_values():
    x = torch.tensor([[30.0, 10.0, 20.0, 0.0]])
    assert torch.allclose(soft_ranks(x), torch.tensor([[4.0, 2.0, 3.0, 1.0]]))


def test_zero_for_the_same_order_on_any_scale_and_positive_otherwise():
    s0 = torch.tensor([[0.0, 10.0, 20.0, 30.0]])
    same_order = 3 * s0 + 7  # another scale, the same order
    assert spearman_rank_loss(s0, same_order).item() == pytest.approx(0.0, abs=1e-9)
    swapped = torch.tensor([[10.0, 0.0, 20.0, 30.0]])
    assert spearman_rank_loss(s0, swapped).item() > 0


def test_value_by_hand_is_equation_3_on_rank_scaled_scores():
    # [0, 1, 2] standardised and rescaled to the spread of ranks 1..3 is [-1, 0, 1]: one rank step
    # apart = ε, so the soft ranks are the hard ranks [1, 2, 3]; [1, 0, 2] -> ranks [2, 1, 3]
    s0 = torch.tensor([[0.0, 1.0, 2.0]], dtype=torch.float64)
    si = torch.tensor([[1.0, 0.0, 2.0]], dtype=torch.float64)
    assert torch.allclose(soft_ranks(rank_scale(s0)[0]), torch.tensor([[1.0, 2.0, 3.0]], dtype=torch.float64))
    # Eq. 3: ½((1-2)² + (2-1)² + 0²) = 1
    assert spearman_rank_loss(s0, si).item() == pytest.approx(1.0, abs=1e-12)


def test_hard_rank_value_is_eq3_times_one_minus_spearman_for_every_permutation_and_k():
    for k in (2, 3, 5, 7):
        s0 = torch.arange(k, dtype=torch.float64)[None] * 10  # evenly spaced: soft ranks = hard ranks
        perms = list(itertools.permutations(range(k)))[:50]
        for perm in perms:
            si = torch.tensor(perm, dtype=torch.float64)[None] * 10
            rho = spearmanr(s0[0].numpy(), si[0].numpy()).statistic
            # ½‖r0 - ri‖² = (K³ - K)/12 · (1 - ρ) for hard ranks
            assert spearman_rank_loss(s0, si).item() == pytest.approx((k**3 - k) / 12 * (1 - rho), abs=1e-9)
        # fully reversed: (K³ - K)/6, the paper's scale (20 at K = 5)
        assert spearman_rank_loss(s0, s0.flip(1)).item() == pytest.approx((k**3 - k) / 6, abs=1e-9)


# float64 throughout: rank_scale's mean/std are K-term sums (relative rounding <= K * eps64) and
# torchsort's projection is exact arithmetic on them, so two affine images of a row give losses equal
# to ~1e-13; 1e-9 leaves four orders of magnitude.
AFFINE_TOL = 1e-9
SCALES = (1e-3, 1e-2, 1e-1, 1.0, 10.0, 100.0)


@pytest.mark.parametrize("k", [2, 3, 4, 5, 6])
@pytest.mark.parametrize("scale", SCALES)
def test_operates_on_ranks_at_every_scale(k, scale):
    g = torch.Generator().manual_seed(k)
    s0 = torch.rand(64, k, generator=g, dtype=torch.float64) * scale
    reversed_ = spearman_rank_loss(s0, -0.5 * s0)
    affine = spearman_rank_loss(s0, 3 * s0 + 7)
    monotone = spearman_rank_loss(s0, torch.exp(s0 / scale) * scale)  # same order, another spacing
    assert affine.item() < 0.05 * reversed_.item() and monotone.item() < 0.05 * reversed_.item()
    # the rank regime: well-separated candidates have soft ranks = hard ranks
    separated = torch.arange(k, dtype=torch.float64)[None].repeat(4, 1) * scale
    assert rank_diagnostics(separated, separated)["soft_hard_gap"] < 1e-9


@pytest.mark.parametrize("scale", SCALES)
def test_invariant_to_positive_affine_changes_of_either_row(scale):
    g = torch.Generator().manual_seed(1)
    s0 = torch.rand(32, 5, generator=g, dtype=torch.float64) * scale
    si = torch.rand(32, 5, generator=g, dtype=torch.float64) * scale
    base = spearman_rank_loss(s0, si).item()
    for a, b in ((2.0, 1.0), (0.01, -3.0), (1e3, 5.0)):
        assert spearman_rank_loss(a * s0 + b, si).item() == pytest.approx(base, rel=AFFINE_TOL)
        assert spearman_rank_loss(s0, a * si + b).item() == pytest.approx(base, rel=AFFINE_TOL)
    assert hinge_rank_loss(s0.float(), si.float()).item() == pytest.approx(
        hinge_rank_loss(7 * s0.float() + 1, si.float()).item(), rel=1e-4)  # float32 path: eps32-level


def test_gradient_steps_on_the_task_alone_align_its_order_with_the_anchor():
    g = torch.Generator().manual_seed(3)
    s0 = torch.rand(16, 5, generator=g, dtype=torch.float64) * 0.2  # NLL-like spread
    si = torch.rand(16, 5, generator=g, dtype=torch.float64).mul(0.2).requires_grad_()
    anchor = s0.clone()
    before = rank_diagnostics(s0, si.detach())["rho_hard"]
    opt = torch.optim.SGD([si], lr=0.05)
    for _ in range(200):
        opt.zero_grad()
        spearman_rank_loss(s0, si).backward()
        opt.step()
    after = rank_diagnostics(s0, si.detach())["rho_hard"]
    assert torch.equal(s0, anchor)  # the anchor's scores (and so its order) are untouched
    assert before < 0.5 and after > 0.95, (before, after)


def test_diagnostics_match_scipy_spearman():
    g = torch.Generator().manual_seed(0)
    s0 = torch.rand(10, 4, generator=g)
    si = torch.rand(10, 4, generator=g)
    si[0] = s0[0]  # and one exact tie pattern
    s0[1, :2] = 0.5
    expected = [spearmanr(a.numpy(), b.numpy()).statistic for a, b in zip(s0, si)]
    assert rank_diagnostics(s0, si)["rho_hard"] == pytest.approx(sum(expected) / len(expected), abs=1e-12)


def test_a_gradient_step_reduces_the_loss_and_reaches_both_rows():
    # uneven spacing: candidates 0 and 1 are closer than one rank step, so their soft ranks merge
    # and carry a gradient (well-separated candidates have piecewise-constant ranks)
    s0 = torch.tensor([[1.0, 0.8, 1.5]], requires_grad=True)
    si = torch.tensor([[1.0, 1.5, 0.8]], requires_grad=True)
    spearman_rank_loss(s0, si).backward()
    step_s0, step_si = -s0.grad[0], -si.grad[0]  # gradient-descent direction
    assert step_s0.norm() > 0 and step_si.norm() > 0
    assert step_s0[1] > 0  # the anchor's favourite, which the task ranks last, becomes less likely
    with torch.no_grad():
        before = spearman_rank_loss(s0, si)
        after = spearman_rank_loss(s0 + 0.01 * step_s0 / step_s0.norm(), si + 0.01 * step_si / step_si.norm())
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
    # rank-scaled (K = 2: standardised to ±1, times σ(2) = 0.5): z0 = [-0.5, 0.5], zi = [0.5, -0.5]
    # pair (0,1): σ0=+1, di=-1 -> relu(0.1+1)=1.1; σi=-1, d0=+1 -> relu(0.1+1)=1.1; the same for (1,0)
    expected = 0.5 * (1.1 + 1.1)
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


@pytest.mark.parametrize("loss_type", ["spearman", "hinge"])
def test_toward_gold_moves_only_the_task_that_misranks_the_gold(loss_type):
    """loss.direction=toward_gold: where exactly one task ranks the gold (column 0) first, only the
    other task gets a gradient; where both or neither do, both do (as with mutual). Same value."""
    # near-ties inside each row keep the soft ranks off the hard ones (a hard rank has no gradient)
    s0 = torch.tensor([[0.0, 0.1, 0.2, 3.0],    # A: s0 ranks gold first, si does not -> only si moves
                       [0.2, 0.1, 0.0, 3.0],    # B: the reverse -> only s0 moves
                       [0.1, 0.0, 0.2, 3.0],    # C: neither ranks gold first -> both move
                       [0.0, 0.2, 0.1, 3.0]])   # D: both rank gold first, orders differ -> both move
    si = torch.tensor([[0.2, 0.1, 0.0, 3.0],
                       [0.0, 0.1, 0.2, 3.0],
                       [0.2, 0.1, 0.0, 3.0],
                       [0.0, 0.1, 0.2, 3.0]])
    grads, values = {}, {}
    for direction in ("mutual", "toward_gold"):
        a, b = s0.clone().requires_grad_(), si.clone().requires_grad_()
        loss = consistency_loss(loss_type, a, b, direction=direction)
        loss.backward()
        grads[direction], values[direction] = (a.grad.abs().sum(1), b.grad.abs().sum(1)), loss.item()
    assert values["mutual"] == values["toward_gold"]
    g0, gi = grads["toward_gold"]
    assert g0[0] == 0 and gi[0] > 0 and g0[1] > 0 and gi[1] == 0
    assert (g0[2:] > 0).all() and (gi[2:] > 0).all()
    assert all((g > 0).all() for g in grads["mutual"])
    with pytest.raises(ValueError, match="loss.direction"):
        consistency_loss(loss_type, s0, si, direction="sideways")


@pytest.mark.parametrize("loss_type", ["spearman", "hinge"])
def test_toward_gold_strict_leaves_out_the_examples_where_neither_task_ranks_the_gold_first(loss_type):
    """loss.direction=toward_gold_strict: toward_gold's gradients on the examples where a task ranks the gold
    first, none where neither does, and the mean over the examples kept: the loss of the kept rows alone."""
    s0 = torch.tensor([[0.0, 0.1, 0.2, 3.0],    # only s0 ranks gold first -> only si moves
                       [0.1, 0.0, 0.2, 3.0],    # neither ranks gold first -> left out
                       [0.0, 0.2, 0.1, 3.0]])   # both rank gold first -> both move
    si = torch.tensor([[0.2, 0.1, 0.0, 3.0],
                       [0.2, 0.1, 0.0, 3.0],
                       [0.0, 0.1, 0.2, 3.0]])
    a, b = s0.clone().requires_grad_(), si.clone().requires_grad_()
    loss = consistency_loss(loss_type, a, b, direction="toward_gold_strict")
    loss.backward()
    g0, gi = a.grad.abs().sum(1), b.grad.abs().sum(1)
    assert g0[0] == 0 and gi[0] > 0 and g0[1] == 0 and gi[1] == 0 and g0[2] > 0 and gi[2] > 0
    kept = consistency_loss(loss_type, s0[[0, 2]], si[[0, 2]], direction="toward_gold")
    assert loss.item() == pytest.approx(kept.item(), rel=1e-6)
    with pytest.raises(ValueError, match="toward_gold_strict"):  # the message lists the new direction
        consistency_loss(loss_type, s0, si, direction="sideways")


# ---- loss.soft_rank=sigmoid: a gradient for every misordered candidate ----------------------------
def _reversed_rows():
    """``(anchor, task)`` rows, K = 2..6: the anchor's candidates one step apart, the task's in the
    reversed order with every combination of gaps of 1..5 (K ≤ 4) or a spread of them (K = 5, 6)."""
    for k in range(2, 7):
        combos = itertools.product(range(1, 6), repeat=k - 1) if k <= 4 else (
            [g] * (k - 1) for g in range(1, 6))
        for gaps in combos:
            task = torch.cat([torch.zeros(1), torch.tensor(gaps, dtype=torch.float64).cumsum(0)]).flip(0)
            yield torch.arange(k, dtype=torch.float64)[None], task[None]
    yield torch.arange(6, dtype=torch.float64)[None], torch.tensor([[15.0, 10, 9, 5, 4, 0]], dtype=torch.float64)


def test_sigmoid_soft_ranks_tend_to_the_hard_ranks_with_ties_averaged():
    x = torch.tensor([[3.0, 1.0, 2.0, 2.0, 0.0]], dtype=torch.float64)
    hard = torch.tensor([[5.0, 2.0, 3.5, 3.5, 1.0]], dtype=torch.float64)
    assert torch.allclose(soft_ranks(x, regularization_strength=1e-3, soft_rank="sigmoid"), hard, atol=1e-12)
    soft = soft_ranks(x, regularization_strength=1.0, soft_rank="sigmoid")
    # Σ_j R_j = K(K+1)/2 whatever ε (σ(d) + σ(-d) = 1 pairs up), and the order is kept
    assert soft.sum().item() == pytest.approx(15.0, abs=1e-12)
    assert torch.equal(soft.argsort(), x.argsort())
    with pytest.raises(ValueError, match="loss.soft_rank"):
        soft_ranks(x, soft_rank="neural")


def test_every_reversed_row_gets_a_gradient_and_a_few_sgd_steps_on_the_task_reverse_it():
    """For rows of K = 2..6 whose task order is the anchor's reversed, with gaps of 1-5 rank steps,
    ∂L_const/∂s_i is non-zero on every candidate, and plain SGD on s_i alone (a fixed step of 2·std(s_i)²,
    the scale on which a scale-invariant loss's gradient lives) reaches the anchor's order in a few steps."""
    for anchor, task in _reversed_rows():
        si = task.clone().requires_grad_()
        lr = 2.0 * float(task.std(unbiased=False)) ** 2
        for step in range(10):
            (grad,) = torch.autograd.grad(spearman_rank_loss(anchor, si, soft_rank="sigmoid"), si)
            if step == 0:
                assert (grad != 0).all(), (anchor, task, grad)
            with torch.no_grad():
                si -= lr * grad
            if torch.equal(hard_ranks(si.detach()), hard_ranks(anchor)):
                break
        else:
            raise AssertionError(f"10 SGD steps did not reverse {task.tolist()} (now {si.detach().tolist()})")


def test_torchsort_ranks_give_no_gradient_to_a_well_separated_misordered_candidate():
    """Why loss.soft_rank=sigmoid exists: the projection's soft ranks are the hard ranks where
    neighbours are >= ε apart, with a zero gradient there. Rank-scaled, [0, 0.1, 5] is
    [-0.59, -0.56, 1.15]: candidate 2 is 1.7 rank steps from the others; reversed in the task, the
    task's candidate 0 (ranked last instead of first) gets no push from the projection's ranks."""
    anchor = torch.tensor([[0.0, 0.1, 5.0]], dtype=torch.float64)
    task = anchor.flip(1).clone().requires_grad_()
    (grad,) = torch.autograd.grad(spearman_rank_loss(anchor, task, soft_rank="torchsort"), task)
    assert grad[0, 0] == 0 and grad[0, 1] != 0
    (grad,) = torch.autograd.grad(spearman_rank_loss(anchor, task, soft_rank="sigmoid"), task)
    assert (grad != 0).all() and grad[0, 0] > 0  # descent lowers its NLL, toward the anchor's first place


@pytest.mark.parametrize("soft_rank", ["torchsort", "sigmoid"])
def test_both_soft_ranks_keep_the_loss_properties(soft_rank):
    """A consistent order costs far less than a reversed one; positive affine maps of either row
    change nothing; masked padding changes nothing (float64: exact up to K-term sums)."""
    g = torch.Generator().manual_seed(5)
    s0 = torch.rand(32, 5, generator=g, dtype=torch.float64) * 0.3
    si = torch.rand(32, 5, generator=g, dtype=torch.float64) * 0.3
    loss = lambda a, b, mask=None: spearman_rank_loss(a, b, mask, soft_rank=soft_rank).item()  # noqa: E731
    assert loss(s0, 2 * s0 + 1) < 0.2 * loss(s0, -s0)
    base = loss(s0, si)
    for a, b in ((2.0, 1.0), (0.01, -3.0), (1e3, 5.0)):
        assert loss(a * s0 + b, si) == pytest.approx(base, rel=AFFINE_TOL)
        assert loss(s0, a * si + b) == pytest.approx(base, rel=AFFINE_TOL)
    mask = torch.ones_like(s0, dtype=torch.bool)
    mask[:8, 3:] = False
    padded0, paddedi = s0.clone(), si.clone()
    padded0[:8, 3:], paddedi[:8, 3:] = 1e6, -1e6
    alone = (loss(s0[:8, :3], si[:8, :3]) * 8 + loss(s0[8:], si[8:]) * 24) / 32
    assert loss(padded0, paddedi, mask) == pytest.approx(alone, rel=1e-12)


def test_gold_rank_terms_are_the_gold_candidates_term_of_eq3():
    """loss.rank_terms=gold: ½(R(z0)_0 − R(zi)_0)² per example, by hand with hard-like ranks (gaps of
    20 rank steps at ε = 0.01); 0 when both tasks put the gold at the same place, whatever the order of
    the contrasts; a gold ranked first by one task and last by the other gives (K − 1)²/2; every
    gold-vs-contrast pair gets a gradient with sigmoid ranks, and a few SGD steps on the task alone
    bring its gold to where the anchor ranks it."""
    kw = dict(soft_rank="sigmoid", regularization_strength=0.01, rank_terms="gold")
    anchor = torch.tensor([[0.0, 1.0, 2.0, 3.0, 4.0]])  # gold ranked first (lowest NLL)
    shuffled = torch.tensor([[0.0, 4.0, 3.0, 1.0, 2.0]])  # gold first, contrasts reordered
    assert float(spearman_rank_loss(anchor, shuffled, **kw)) == pytest.approx(0.0, abs=1e-6)
    assert float(spearman_rank_loss(anchor, shuffled, soft_rank="sigmoid", regularization_strength=0.01)) > 1.0
    gold_last = torch.tensor([[4.0, 0.0, 1.0, 2.0, 3.0]])
    assert float(spearman_rank_loss(anchor, gold_last, **kw)) == pytest.approx(0.5 * 4 ** 2, rel=1e-4)
    assert float(spearman_rank_loss(anchor, torch.tensor([[2.0, 0.0, 1.0, 3.0, 4.0]]), **kw)) == pytest.approx(2.0, rel=1e-4)
    si = gold_last.clone().requires_grad_()
    (grad,) = torch.autograd.grad(spearman_rank_loss(anchor, si, soft_rank="sigmoid", rank_terms="gold"), si)
    assert (grad != 0).all()
    for _ in range(20):
        (grad,) = torch.autograd.grad(spearman_rank_loss(anchor, si, soft_rank="sigmoid", rank_terms="gold"), si)
        with torch.no_grad():
            si -= 2.0 * float(si.std(unbiased=False)) ** 2 * grad
        if int(si.detach().argmin()) == 0:
            break
    else:
        raise AssertionError(f"20 SGD steps did not bring the gold first: {si.detach().tolist()}")
    with pytest.raises(ValueError, match="loss.rank_terms must be one of all, gold"):
        spearman_rank_loss(anchor, gold_last, rank_terms="pairs")


# ---- loss.rank_scale: one detached scale per task and call instead of each row's own std ---------
def _row_scaled_reference(s0, si, soft_rank):
    """Eq. 3 on per-row standardised scores, written out: z = (s − mean s)/std(s) · σ(K) per row."""
    def z(s):
        k = s.shape[1]
        c = s - s.mean(1, keepdim=True)
        return c / c.detach().pow(2).mean(1, keepdim=True).sqrt() * ((k * k - 1) / 12) ** 0.5
    diff = soft_ranks(z(s0), soft_rank=soft_rank) - soft_ranks(z(si), soft_rank=soft_rank)
    return (0.5 * diff.pow(2).sum(1)).mean()


@pytest.mark.parametrize("soft_rank", ["torchsort", "sigmoid"])
def test_row_rank_scale_is_the_per_row_standardisation(soft_rank):
    """loss.rank_scale=row (the default) is the per-row std of the module docstring: the same value
    and gradient as the default call (bit for bit) and as the formula written out (float64 sums)."""
    g = torch.Generator().manual_seed(7)
    s0 = torch.rand(12, 5, generator=g, dtype=torch.float64) * 0.3
    si = (torch.rand(12, 5, generator=g, dtype=torch.float64) * 0.3).requires_grad_()
    default = spearman_rank_loss(s0, si, soft_rank=soft_rank)
    (g_default,) = torch.autograd.grad(default, si)
    row = consistency_loss("spearman", s0, si, soft_rank=soft_rank, rank_scale="row", tasks=["vqa", "t2i"] * 6)
    (g_row,) = torch.autograd.grad(row, si)
    assert torch.equal(default, row) and torch.equal(g_default, g_row)
    reference = _row_scaled_reference(s0, si, soft_rank)
    (g_ref,) = torch.autograd.grad(reference, si)
    assert default.item() == pytest.approx(reference.item(), rel=1e-12)
    assert torch.allclose(g_default, g_ref, rtol=1e-9, atol=1e-12)
    assert torch.equal(hinge_rank_loss(s0.float(), si.float()), hinge_rank_loss(s0.float(), si.float(), scale="row"))


def test_batch_rank_scale_by_hand():
    """Two K = 3 rows, [0, 1, 2] (std √(2/3)) and [0, 2, 4] (std √(8/3)), reversed in the task: one
    scale S = √((2/3 + 8/3)/2) = √(5/3), so z = a·[−1, 0, 1] and 2a·[−1, 0, 1] with a = σ(3)/S = √(2/5).
    Sigmoid ranks at ε = 1, R_j = ½ + Σ_k σ(z_j − z_k), give for z = c·[−1, 0, 1] against its reverse
    the differences ∓(tanh(c/2) + tanh(c)) at the ends and 0 in the middle (σ(x) − σ(−x) = tanh(x/2)),
    so L_b = (tanh(c/2) + tanh(c))². A constant row has no order: skipped, and not in S."""
    s0 = torch.tensor([[0.0, 1.0, 2.0], [0.0, 2.0, 4.0]], dtype=torch.float64)
    si = s0.flip(1)
    assert torch.allclose(batch_scales(s0, torch.ones_like(s0, dtype=torch.bool)),
                          torch.full((2,), (5 / 3) ** 0.5, dtype=torch.float64), rtol=1e-15, atol=0)
    a = (2 / 5) ** 0.5
    term = lambda c: (math.tanh(c / 2) + math.tanh(c)) ** 2  # noqa: E731
    batch = spearman_rank_loss(s0, si, soft_rank="sigmoid", scale="batch")
    assert batch.item() == pytest.approx((term(a) + term(2 * a)) / 2, rel=1e-12)
    # row: both rows are z = [−1, 0, 1]
    assert spearman_rank_loss(s0, si, soft_rank="sigmoid").item() == pytest.approx(term(1.0), rel=1e-12)
    flat = torch.cat([s0, torch.ones(1, 3, dtype=torch.float64)])
    assert spearman_rank_loss(flat, flat.flip(1), soft_rank="sigmoid", scale="batch").item() == pytest.approx(
        batch.item(), rel=1e-12)
    # one scale per task label: each row alone is its own group, i.e. its own std
    mask = torch.ones_like(s0, dtype=torch.bool)
    assert torch.allclose(batch_scales(si, mask, ["vqa", "t2i"]),
                          torch.tensor([(2 / 3) ** 0.5, (8 / 3) ** 0.5], dtype=torch.float64), rtol=1e-15, atol=0)
    assert consistency_loss("spearman", s0, si, soft_rank="sigmoid", rank_scale="batch").item() == pytest.approx(
        batch.item(), rel=1e-12)
    with pytest.raises(ValueError, match="loss.rank_scale must be one of row, batch"):
        consistency_loss("spearman", s0, si, rank_scale="column")


@pytest.mark.parametrize("soft_rank", ["torchsort", "sigmoid"])
def test_batch_rank_scale_gradient_does_not_grow_as_one_over_a_rows_spread(soft_rank):
    """Shrinking one task row by 10x and 100x (the others unchanged): with row scaling its z is the
    same, so ∂L/∂s of that row grows exactly 10x and 100x; with batch scaling ∂z/∂s = σ(K)/S barely
    changes (S is the RMS over 8 rows) and ∂L/∂z is bounded, so the gradient stays within 2x of the
    unshrunk one and the 100x shrink is within 25% of the 10x one (it tends to a limit)."""
    for seed in range(4):
        g = torch.Generator().manual_seed(seed)
        s0 = torch.rand(8, 5, generator=g, dtype=torch.float64)
        si = torch.rand(8, 5, generator=g, dtype=torch.float64)
        norms = {}
        for scale in ("row", "batch"):
            norms[scale] = []
            for factor in (1.0, 0.1, 0.01):
                x = si.clone()
                x[0] *= factor
                x.requires_grad_()
                (grad,) = torch.autograd.grad(spearman_rank_loss(s0, x, soft_rank=soft_rank, scale=scale), x)
                norms[scale].append(float(grad[0].norm()))
        row, batch = norms["row"], norms["batch"]
        assert row[0] > 0 and batch[0] > 0
        assert row[1] / row[0] == pytest.approx(10.0, rel=1e-9) and row[2] / row[0] == pytest.approx(100.0, rel=1e-9)
        assert batch[1] / batch[0] < 2.0 and batch[2] / batch[0] < 2.0, (seed, batch)
        assert 0.8 < batch[2] / batch[1] < 1.25, (seed, batch)
