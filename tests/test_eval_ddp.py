"""Every suite's epoch-end evaluation, as a training run builds it (``training.run.make_eval_callbacks``
on a composed ``eval=shapes`` config), on 2 gloo ranks == 1 process: the same metrics on both ranks
and the same files, byte for byte.

The model is ``standins.FakeModel`` (outputs are functions of their inputs); the sample counts are odd,
so rank 1 carries the DistributedSampler's padding repeat."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import standins
from unicon import loggers
from unicon.config import compose

#: suite -> the files its epoch-end evaluation writes (compared byte for byte)
FILES = {"cococon": ["results.json", "per_sample.jsonl"], "drift": ["drift.json"],
         "ureason": ["ureason.json", "samples.jsonl", "table.md"]}


def _config(world: Path):
    return compose(["eval=shapes", f"data.root={world}", "eval.drift.embedders=[scene]", "eval.drift.generations=2",
                    "eval.drift.num_chains=3", "eval.drift.batch_size=2", "eval.cococon.max_samples=3",
                    "eval.cococon.batch_size=2", "eval.ureason.max_samples=3", "eval.ureason.batch_size=2"])


def _evaluate(world: Path, ckpt: Path, run_dir: Path, rank: int = 0) -> dict:
    from unicon.models import load_model
    from unicon.training.run import make_eval_callbacks

    trainer = SimpleNamespace(default_root_dir=str(run_dir), current_epoch=0, global_step=3, loggers=[],
                              sanity_checking=False, is_global_zero=rank == 0,
                              strategy=SimpleNamespace(root_device=torch.device("cpu")))
    model = load_model(ckpt)
    return {cb.name: cb.evaluate(trainer, model) for cb in make_eval_callbacks(_config(world))}


def _rank(rank, world_size, init_file, world, ckpt, run_dir):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        metrics = _evaluate(Path(world), Path(ckpt), Path(run_dir), rank)
        Path(run_dir, f"metrics-rank{rank}.json").write_text(json.dumps(metrics, sort_keys=True))
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(600)
def test_every_suite_on_two_gloo_ranks_equals_one_process(tmp_path, monkeypatch, fork_safe_threads):
    import torch.multiprocessing as mp

    state = loggers.git_state()  # recorded in the reports; fixed while others may edit the checkout
    monkeypatch.setattr(loggers, "git_state", lambda: state)
    world = standins.build_world(tmp_path / "world", "--num-drift-seeds", "3", "--num-reason-train", "0", train=8)
    ckpt = tmp_path / "ckpt"
    standins.FakeModel(scale=0.5, captions="world", draw="world", world=str(world)).save_pretrained(str(ckpt))
    single = json.dumps(_evaluate(world, ckpt, tmp_path / "one"), sort_keys=True)
    assert sorted(json.loads(single)) == sorted(FILES)
    # fork: the children inherit the imported modules, the registered backend "fake" and the fixed git state
    mp.start_processes(_rank, args=(2, str(tmp_path / "init"), str(world), str(ckpt), str(tmp_path / "two")),
                       nprocs=2, join=True, start_method="fork")
    for rank in (0, 1):
        assert (tmp_path / "two" / f"metrics-rank{rank}.json").read_text() == single, rank
    for suite, names in FILES.items():
        one, two = (tmp_path / d / "eval" / suite / "epoch-1" for d in ("one", "two"))
        for name in names:
            assert (two / name).read_bytes() == (one / name).read_bytes(), (suite, name)
    metrics = json.loads(single)
    assert metrics["drift"]["drift/MCD_avg"] > 0  # input-dependent, not a constant
    results = json.loads((tmp_path / "one" / "eval" / "cococon" / "epoch-1" / "results.json").read_text())
    assert results["num_samples"] == 3
