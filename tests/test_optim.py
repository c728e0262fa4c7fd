"""The training optimizers (``optim.name``): which parameters Muon steps, and Muon + AdamW as one optimizer
(scheduler, state dict, resume) on CPU."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from conftest import float32_tol
from unicon.config import ConfigError, compose
from unicon.training.optim import MuonWithAdamW, ShapeBatchedMuon, build_optimizer, decay_groups, muon_parameters


class Net(nn.Module):
    """A tied embedding/output pair, two hidden matrices, a conv, a norm and biases."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(11, 8)
        self.conv = nn.Conv2d(3, 8, 2, stride=2)
        self.hidden = nn.Linear(8, 16)
        self.back = nn.Linear(16, 8)
        self.norm = nn.LayerNorm(8)
        self.out = nn.Linear(8, 11, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, ids: torch.Tensor, image: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) + self.conv(image).mean((2, 3))[:, None]
        return self.out(self.norm(x + self.back(torch.relu(self.hidden(x)))))


def _loss(net: Net, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    ids, image = torch.randint(0, 11, (4, 5), generator=g), torch.randn(4, 3, 4, 4, generator=g)
    return nn.functional.cross_entropy(net(ids, image).flatten(0, 1), ids.flatten())


def _train(net: Net, opt, scheduler, steps: range) -> None:
    for step in steps:
        opt.zero_grad()
        _loss(net, step).backward()
        opt.step()
        scheduler.step()


def test_muon_steps_hidden_matrices_only():
    net = Net()
    on_muon = muon_parameters(net)
    assert on_muon == {id(net.hidden.weight), id(net.back.weight)}  # not the tied output, conv, norm, biases
    opt = build_optimizer("muon", net, 1e-2, 0.01, (0.9, 0.999))
    assert isinstance(opt, MuonWithAdamW)
    assert [g["name"] for g in opt.param_groups] == ["muon", "decay", "no_decay"]
    assert {id(p) for p in opt.muon.param_groups[0]["params"]} == on_muon
    adamw_ids = {id(p) for g in opt.adamw.param_groups for p in g["params"]}
    assert adamw_ids.isdisjoint(on_muon) and len(adamw_ids) + len(on_muon) == len(list(net.parameters()))
    # the real tiny OFA: attention, FFN and position projections on Muon; embeddings, rel-pos tables, stem on AdamW
    from unicon.models.ofa.configuration_ofa import preset_config
    from unicon.models.ofa.modeling_ofa import OFAModel

    ofa = OFAModel(preset_config("shapes-tiny", resnet_width=8))
    names = {n for n, p in ofa.named_parameters() if id(p) in muon_parameters(ofa)}
    assert "encoder.layers.0.self_attn.q_proj.weight" in names and "decoder.layers.1.fc2.weight" in names
    assert not any("embed" in n or "rel_pos" in n or n.endswith("bias") for n in names)
    assert ofa.decoder.output_projection.weight is ofa.encoder.embed_tokens.weight


def test_muon_with_adamw_follows_the_schedule_and_resumes_exactly():
    from transformers import get_scheduler

    def make(net):
        opt = build_optimizer("muon", net, 1e-2, 0.01, (0.9, 0.999))
        return opt, get_scheduler("cosine", opt, num_warmup_steps=2, num_training_steps=8)

    full = Net()
    opt, sched = make(full)
    _train(full, opt, sched, range(4))
    lrs = {g["name"]: g["lr"] for g in opt.param_groups}
    assert len(set(lrs.values())) == 1 and 0 < lrs["muon"] < 1e-2  # one schedule for both optimizers
    assert len(opt.state) == len(list(full.parameters()))
    _train(full, opt, sched, range(4, 8))

    half = Net()
    opt, sched = make(half)
    _train(half, opt, sched, range(4))
    saved = copy.deepcopy((half.state_dict(), opt.state_dict(), sched.state_dict()))
    resumed = Net()
    resumed.load_state_dict(saved[0])
    opt, sched = make(resumed)
    opt.load_state_dict(saved[1])
    sched.load_state_dict(saved[2])
    _train(resumed, opt, sched, range(4, 8))
    for (name, a), b in zip(full.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name  # the same operations in the same order


def test_muon_moves_the_loss_like_adamw_and_bad_input_is_named():
    losses = {}
    for name in ("adamw", "muon"):
        net = Net()
        opt = build_optimizer(name, net, 1e-2, 0.0, (0.9, 0.999))
        before = _loss(net, 0).item()
        for _ in range(30):
            opt.zero_grad()
            _loss(net, 0).backward()
            opt.step()
        losses[name] = (before, _loss(net, 0).item())
    assert all(after < 0.9 * before for before, after in losses.values()), losses
    with pytest.raises(ValueError, match="trained with optim.name=adamw"):
        build_optimizer("muon", Net(), 1e-2, 0.0, (0.9, 0.999)).load_state_dict(
            build_optimizer("adamw", Net(), 1e-2, 0.0, (0.9, 0.999)).state_dict())
    with pytest.raises(ValueError, match="no trainable nn.Linear matrix"):
        build_optimizer("muon", nn.Sequential(nn.LayerNorm(4)), 1e-2, 0.0, (0.9, 0.999))
    frozen = Net().requires_grad_(False)
    for build in (lambda: build_optimizer("adamw", frozen, 1e-2, 0.0, (0.9, 0.999)),
                  lambda: build_optimizer("muon", frozen, 1e-2, 0.0, (0.9, 0.999)),
                  lambda: decay_groups(frozen, 0.0)):  # the ZeRO-Offload path builds these groups itself
        with pytest.raises(ValueError, match="no trainable parameters"):
            build()
    with pytest.raises(ConfigError, match="optim.name"):
        compose(["optim.name=sgd"])
    with pytest.raises(ConfigError, match="optim.name.*DeepSpeed"):
        compose(["optim.name=muon", "trainer.strategy=deepspeed_zero2"])
    with pytest.raises(ConfigError, match="optim.name.*FSDP shards"):
        compose(["optim.name=muon", "trainer.strategy=fsdp"])


def test_shape_batched_muon_is_torch_muon():
    """The batched Newton-Schulz runs torch's per-matrix products, in float32 on the CPU where torch's
    loop rounds every product to bfloat16. The bound allows that rounding: a difference of one
    bfloat16 ulp (2^-8) in an iterate can grow through the five quintic iterations, whose slope near
    0 is a = 3.4, to a few percent of the update, while a wrong orientation, norm or coefficient
    changes it by O(1)."""
    torch.manual_seed(0)
    shapes = [(128, 128), (128, 128), (512, 128), (128, 512), (512, 128), (7, 3)]
    ours = [nn.Parameter(torch.randn(*shape)) for shape in shapes]
    ref = [nn.Parameter(p.detach().clone()) for p in ours]
    batched = ShapeBatchedMuon(ours, lr=1e-2, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    loop = torch.optim.Muon(ref, lr=1e-2, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        before = [p.detach().clone() for p in ours]
        for p, q in zip(ours, ref):
            p.grad = torch.randn(p.shape, generator=g)
            q.grad = p.grad.clone()
        batched.step()
        loop.step()
        for p, q, x in zip(ours, ref, before):
            update, expected = p.detach() - x, q.detach() - x
            assert (update - expected).abs().max() <= 0.05 * expected.abs().max(), (step, tuple(p.shape))
            q.data.copy_(p.data)  # the next step starts from the same weights
    assert batched.state_dict()["state"].keys() == loop.state_dict()["state"].keys()


def _shared_muon_worker(rank, world, init_file, out_dir, ungraded_on_rank1=None):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        params = _muon_params()
        opt = ShapeBatchedMuon(params, lr=1e-2, weight_decay=0.1, adjust_lr_fn="match_rms_adamw",
                               share_across_ranks=True)
        # the same gradients on every rank, as after DDP's all-reduce, except the matrix rank 1 leaves out
        for step in range(2):
            _set_grads(params, step, None if rank == 0 else ungraded_on_rank1)
            opt.step()
        torch.save([p.detach() for p in params], f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _muon_params() -> list[nn.Parameter]:
    torch.manual_seed(0)  # three 128x128 matrices: rank 0 takes two, rank 1 one; a lone 7x3 on rank 0
    return [nn.Parameter(torch.randn(*shape)) for shape in [(128, 128), (512, 128), (128, 128), (7, 3), (128, 128)]]


def _set_grads(params: list[nn.Parameter], step: int, ungraded: int | None = None) -> None:
    g = torch.Generator().manual_seed(100 + step)
    for i, p in enumerate(params):
        p.grad = torch.randn(p.shape, generator=g)
        if i == ungraded:
            p.grad = None


def _single_process_muon(ungraded: int | None = None) -> tuple[list[nn.Parameter], list[torch.Tensor]]:
    params = _muon_params()
    opt = ShapeBatchedMuon(params, lr=1e-2, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    start = [p.detach().clone() for p in params]
    for step in range(2):
        _set_grads(params, step, ungraded)
        opt.step()
    return params, start


@pytest.mark.timeout(180)
def test_muon_shared_across_ranks_is_the_single_process_update(tmp_path, fork_safe_threads):
    """Two gloo ranks each orthogonalise part of the matrices and all-reduce the rest: every rank ends
    with the single-process weights. Each matrix's iterations are the same products on either path
    (a batch of 1 or 2 instead of 3): the bound is float32 rounding (conftest.float32_tol) over the
    30 products of two steps' iterations, whose iterates have unit norm and whose longest reduction is
    512, relative to how far the weights moved; a missing or doubled matrix changes the update by
    all of it."""
    import torch.multiprocessing as mp

    params, start = _single_process_muon()
    mp.start_processes(_shared_muon_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2,
                       join=True, start_method="fork")
    for rank in (0, 1):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        for p, q, p0 in zip(params, got, start):
            moved = (p.detach() - p0).abs().max()
            assert (q - p.detach()).abs().max() <= float32_tol(512, 1.0, depth=30) * moved, (rank, tuple(p.shape))


@pytest.mark.timeout(180)
def test_muon_shared_across_ranks_survives_ranks_with_different_gradients(tmp_path, fork_safe_threads):
    """A rank that holds no gradient for one matrix (a strategy that does not fill in unused
    parameters' gradients) must neither hang nor misalign the shared all-reduce: both ranks see the
    mismatch and each steps as one process would with its own gradients (same bound as above)."""
    import torch.multiprocessing as mp

    mp.start_processes(_shared_muon_worker, args=(2, str(tmp_path / "init"), str(tmp_path), 2), nprocs=2,
                       join=True, start_method="fork")
    for rank, ungraded in ((0, None), (1, 2)):
        params, start = _single_process_muon(ungraded)
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert torch.equal(got[2], start[2]) == (ungraded == 2)  # an ungraded matrix is not stepped
        for p, q, p0 in zip(params, got, start):
            moved = (p.detach() - p0).abs().max().clamp_min(1e-12)
            assert (q - p.detach()).abs().max() <= float32_tol(512, 1.0, depth=30) * moved, (rank, tuple(p.shape))
