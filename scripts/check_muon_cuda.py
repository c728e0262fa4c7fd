"""A device check of Muon's CUDA path (CI has no GPU, so no test runs it):

- ``ShapeBatchedMuon`` (bfloat16 Newton-Schulz on CUDA, batched by shape) against ``torch.optim.Muon``;
- the rank-shared iterations (``share_across_ranks``) on two gloo ranks holding CUDA tensors of one GPU,
  against one process;
- the batched iterations' time per step for ``shapes-tiny``'s 39 matrices against a per-matrix loop.

Run from the repository root on a CUDA machine: ``OUT=/tmp python3 scripts/check_muon_cuda.py``.
Session 15, one H200 (torch 2.11): every matrix bit-identical to torch's, both shared ranks
bit-identical to one process, 1.3 ms per step batched against 23.1 ms per matrix.
"""
import os, sys, time, torch, torch.distributed as dist, torch.multiprocessing as mp
from torch import nn
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
from unicon.training.optim import ShapeBatchedMuon, newton_schulz

SHAPES = [(128, 128), (512, 128), (128, 128), (7, 3), (128, 512), (128, 128)]

def params(dev):
    torch.manual_seed(0)
    return [nn.Parameter(torch.randn(*s, device=dev)) for s in SHAPES]

def grads(ps, step):
    g = torch.Generator().manual_seed(100 + step)
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g).to(p.device)

def worker(rank, world, init, out):
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    ps = params("cuda")
    opt = ShapeBatchedMuon(ps, lr=1e-2, weight_decay=0.1, adjust_lr_fn="match_rms_adamw", share_across_ranks=True)
    for s in range(3):
        grads(ps, s); opt.step()
    torch.save([p.detach().cpu() for p in ps], f"{out}/rank{rank}.pt")
    dist.destroy_process_group()

if __name__ == "__main__":
    print(torch.__version__, torch.cuda.get_device_name())
    ours, ref = params("cuda"), params("cuda")
    a = ShapeBatchedMuon(ours, lr=1e-2, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    b = torch.optim.Muon(ref, lr=1e-2, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    start = [p.detach().clone() for p in ours]
    for s in range(3):
        grads(ours, s); grads(ref, s); a.step(); b.step()
    for p, q, p0 in zip(ours, ref, start):
        moved = (q.detach() - p0).abs().max().item()
        print("vs torch.optim.Muon", tuple(p.shape), "max diff / moved", (p - q).abs().max().item() / moved)
    x = torch.randn(3, 128, 512, device="cuda")
    print("newton_schulz dtype on cuda:", newton_schulz(x, (3.4445, -4.7750, 2.0315), 5, 1e-7).dtype)
    single = params("cuda")
    opt = ShapeBatchedMuon(single, lr=1e-2, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    for s in range(3):
        grads(single, s); opt.step()
    out = os.environ.get("OUT", "/tmp")
    mp.start_processes(worker, args=(2, f"{out}/init", out), nprocs=2, join=True, start_method="spawn")
    for r in (0, 1):
        got = torch.load(f"{out}/rank{r}.pt")
        print("shared rank", r, "max diff vs one process:", max((g - p.detach().cpu()).abs().max().item() for g, p in zip(got, single)))
    for f in ("rank0.pt", "rank1.pt", "init"):
        if os.path.exists(f"{out}/{f}"): os.remove(f"{out}/{f}")
    # timing: the shapes-tiny step's 39 matrices, batched bf16 NS vs torch's loop
    mats = [torch.randn(128, 128, device="cuda") for _ in range(20)] + [torch.randn(512, 128, device="cuda") for _ in range(19)]
    for name, fn in (("batched", lambda: [newton_schulz(torch.stack(mats[:20]), (3.4445, -4.7750, 2.0315), 5, 1e-7), newton_schulz(torch.stack(mats[20:]), (3.4445, -4.7750, 2.0315), 5, 1e-7)]),
                     ("per-matrix", lambda: [newton_schulz(m[None], (3.4445, -4.7750, 2.0315), 5, 1e-7) for m in mats])):
        for _ in range(3): fn()
        torch.cuda.synchronize(); t = time.perf_counter()
        for _ in range(20): fn()
        torch.cuda.synchronize(); print(name, "NS ms per step", 1000 * (time.perf_counter() - t) / 20)
