"""Every suite's epoch-end evaluation, as a training run builds it (``training.trainer.make_eval_callbacks``
on a composed ``eval=shapes`` config with every other suite enabled: :data:`OVERRIDES`), run through the
callback's Lightning hook: on 2 gloo ranks == 1 process (the same metrics on both ranks and the same
files, byte for byte). And each suite's standalone command, given the arguments ``unicon evaluate all``
gives it for the same config, logs the W&B keys its epoch end logs; both are the golden key sets of
tests/golden/wandb_keys.json (``UNICON_UPDATE_GOLDEN=1`` rewrites that file from the epoch end).

The model is ``standins.FakeModel`` (outputs are functions of their inputs); the sample counts are odd,
so rank 1 carries the DistributedSampler's padding repeat."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.loggers import WandbLogger

import standins
from unicon import loggers
from unicon.config import compose

#: the composed config beyond ``eval=shapes``: every suite with an epoch-end callback on, small odd counts
OVERRIDES = ["eval.fail_on_error=true",
             "eval.drift.embedders=[scene]", "eval.drift.generations=2", "eval.drift.num_chains=3",
             "eval.drift.batch_size=2", "eval.cococon.max_samples=3", "eval.cococon.batch_size=2",
             "eval.ureason.max_samples=3", "eval.ureason.batch_size=2",
             "eval.shapes.enabled=true", "eval.shapes.max_samples=3", "eval.shapes.batch_size=2",
             # one instance per category: 7 (3 UEG categories in a ShapesWorld root, 4 GEU)
             "eval.realunify.enabled=true", "eval.realunify.max_samples=1", "eval.realunify.batch_size=2",
             # clip_s is skipped (no eval.alignment.clip); bleu4 is the cheapest reference metric
             "eval.alignment.enabled=true", "eval.alignment.max_samples=3", "eval.alignment.batch_size=2",
             "eval.alignment.baselines=[clip_s,bleu4]",
             "eval.editing.enabled=true", "eval.editing.max_samples=3", "eval.editing.batch_size=2",
             "eval.editing.own_edits=1"]

#: suite -> the files its epoch-end evaluation writes (compared byte for byte)
FILES = {"cococon": ["results.json", "per_sample.jsonl"], "drift": ["drift.json"],
         "ureason": ["ureason.json", "samples.jsonl", "table.md"], "shapes": ["shapes_eval.json", "shapes_eval.png"],
         "realunify": ["realunify.json", "samples.jsonl", "table.md"],
         "alignment": ["alignment.json", "samples.jsonl", "table.md"],
         "editing": ["editing.json", "samples.jsonl", "own_edits.jsonl", "table.md"]}

GOLDEN = Path(__file__).parent / "golden" / "wandb_keys.json"


def _kind(value) -> str:
    import wandb

    if isinstance(value, (int, float)):
        return "scalar"
    if isinstance(value, wandb.Table):
        return f"table of {len(value.data)} rows"
    return "image" if isinstance(value, wandb.Image) else type(value).__name__


class WandbKeys(WandbLogger):
    """A W&B logger that starts no W&B run: ``logged`` is the key and kind (:func:`_kind`) of every value
    logged, ``config`` the run config."""

    def __init__(self):  # WandbLogger's own starts W&B
        self.logged: dict[str, str] = {}
        self.config: dict = {}

    def log_metrics(self, metrics, step=None):
        self.logged.update({k: _kind(v) for k, v in metrics.items()})

    def log_hyperparams(self, params, *args, **kwargs):
        self.config.update(params)

    def finalize(self, status):
        pass


def _config(world: Path):
    return compose(["eval=shapes", f"data.root={world}", *OVERRIDES])


def _evaluate(world: Path, ckpt: Path, run_dir: Path, rank: int = 0, logged: dict | None = None) -> dict:
    """Every enabled suite's epoch end (``on_train_epoch_end``): ``{suite: its metrics but the timing}``;
    ``logged`` gets ``{suite: {key: kind}}`` of what each logged to W&B."""
    from unicon.models import load_model
    from unicon.training.trainer import make_eval_callbacks

    recorder = WandbKeys()
    trainer = SimpleNamespace(default_root_dir=str(run_dir), current_epoch=0, global_step=3, loggers=[recorder],
                              sanity_checking=False, is_global_zero=rank == 0,
                              strategy=SimpleNamespace(root_device=torch.device("cpu")))
    module = SimpleNamespace(model=load_model(ckpt))  # the hook evaluates pl_module.model
    metrics = {}
    for cb in make_eval_callbacks(_config(world)):
        recorder.logged = {}
        cb.on_train_epoch_end(trainer, module)
        metrics[cb.name] = {k: v for k, v in cb.last_metrics.items() if k != f"{cb.name}/seconds"}
        if logged is not None:
            logged[cb.name] = recorder.logged
    return metrics


def _rank(rank, world_size, init_file, world, ckpt, run_dir):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        metrics = _evaluate(Path(world), Path(ckpt), Path(run_dir), rank)
        Path(run_dir, f"metrics-rank{rank}.json").write_text(json.dumps(metrics, sort_keys=True))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def fixed_git_state():
    """The runs record the checkout's git state; fixed while others may edit the checkout."""
    state = loggers.git_state()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(loggers, "git_state", lambda: state)
        yield state


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    return standins.build_world(tmp_path_factory.mktemp("ddp") / "world", "--num-drift-seeds", "3",
                                "--num-reason-train", "0", train=8)


@pytest.fixture(scope="module")
def ckpt(world, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("fake") / "ckpt"
    standins.FakeModel(scale=0.5, captions="world", draw="world", world=str(world)).save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def one_process(world, ckpt, fixed_git_state, tmp_path_factory) -> dict:
    """The epoch end in one process: ``{"run_dir", "metrics", "logged"}`` (:func:`_evaluate`)."""
    run_dir = tmp_path_factory.mktemp("one")
    logged: dict = {}
    return {"run_dir": run_dir, "metrics": _evaluate(world, ckpt, run_dir, logged=logged), "logged": logged}


@pytest.mark.timeout(600)
def test_every_suite_on_two_gloo_ranks_equals_one_process(one_process, world, ckpt, tmp_path, fork_safe_threads):
    import torch.multiprocessing as mp

    from unicon.evaluation.suites import suites

    assert sorted(FILES) == sorted(suites())  # every suite
    single = json.dumps(one_process["metrics"], sort_keys=True)
    assert sorted(json.loads(single)) == sorted(FILES)
    # fork: the children inherit the imported modules, the registered backend "fake" and the fixed git state
    mp.start_processes(_rank, args=(2, str(tmp_path / "init"), str(world), str(ckpt), str(tmp_path / "two")),
                       nprocs=2, join=True, start_method="fork")
    for rank in (0, 1):
        got = json.loads((tmp_path / "two" / f"metrics-rank{rank}.json").read_text())
        if rank:
            # alignment's reference metrics (corpus-level: bleu4 here) are computed only where the files are
            # written (evaluate_alignment: writes_outputs()); another rank returns them unscored, without a tau
            ref = {k: got["alignment"].pop(k) for k in list(got["alignment"]) if k.startswith("alignment/bleu4/")}
            assert ref == {"alignment/bleu4/n": 0.0}
            got["alignment"].update({k: v for k, v in json.loads(single)["alignment"].items()
                                     if k.startswith("alignment/bleu4/")})
        assert json.dumps(got, sort_keys=True) == single, rank
    for suite, names in FILES.items():
        one, two = (d / "eval" / suite / "epoch-1" for d in (one_process["run_dir"], tmp_path / "two"))
        for name in names:
            assert (two / name).read_bytes() == (one / name).read_bytes(), (suite, name)
    metrics = json.loads(single)
    assert all(m[f"{suite}/failed"] == 0 for suite, m in metrics.items())
    assert metrics["drift"]["drift/MCD_avg"] > 0  # input-dependent, not a constant
    one = one_process["run_dir"] / "eval"
    results = json.loads((one / "cococon" / "epoch-1" / "results.json").read_text())
    assert results["num_samples"] == 3
    # the padding repeat of rank 1 is dropped: each odd count is counted once
    assert metrics["alignment"]["alignment/bagelscore_expected/n"] == 3 and metrics["editing"]["editing/n"] == 3
    assert len((one / "realunify" / "epoch-1" / "samples.jsonl").read_text().splitlines()) == 7
    assert len((one / "editing" / "epoch-1" / "own_edits.jsonl").read_text().splitlines()) == 1
    shapes = json.loads((one / "shapes" / "epoch-1" / "shapes_eval.json").read_text())["metrics"]
    assert shapes["vqa_accuracy_n"] == shapes["loc_iou50_n"] == 3


def test_each_standalone_command_logs_the_wandb_keys_of_its_epoch_end(one_process, world, ckpt, tmp_path,
                                                                      monkeypatch, capsys):
    """``unicon evaluate <suite>`` with the arguments ``unicon evaluate all`` passes it for the same config
    logs the keys of its epoch end, of the same kinds (scalar, image, table of as many rows, chart), but
    ``<suite>/failed``, which the epoch-end callback adds (both log ``<suite>/seconds``), and its run config with the weights fingerprint; the epoch end logs the golden keys."""
    from unicon.evaluation.suites import suites

    cfg = _config(world)
    recorder = WandbKeys()
    monkeypatch.setattr(loggers, "make_loggers", lambda *args, **kwargs: [recorder])
    standalone = {}
    for s in suites().values():
        recorder.logged, recorder.config = {}, {}
        assert s.cli(["--ckpt", str(ckpt), "--device", "cpu", "--logger", "wandb", *s.argv(cfg),
                      "--out", str(tmp_path / s.name)]) == 0
        assert recorder.config.get("weights.fingerprint") and recorder.config["args.logger"] == "wandb", s.name
        standalone[s.name] = recorder.logged
    capsys.readouterr()
    epoch_end = one_process["logged"]
    assert sorted(standalone) == sorted(epoch_end) == sorted(FILES)
    for suite, logged in standalone.items():
        want = {k: v for k, v in epoch_end[suite].items() if k not in (f"{suite}/failed", f"{suite}/seconds")}
        got = {k: v for k, v in logged.items() if k != f"{suite}/seconds"}
        assert {f"{suite}/failed", f"{suite}/seconds"} <= set(epoch_end[suite]), suite
        assert got == want, (suite, {k: (got.get(k), want.get(k)) for k in sorted(set(got) | set(want))
                                     if got.get(k) != want.get(k)})
    # every command logs its time, as the epoch end does
    assert [suite for suite, logged in standalone.items() if f"{suite}/seconds" not in logged] == []
    if os.environ.get("UNICON_UPDATE_GOLDEN"):
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps(epoch_end, indent=1, sort_keys=True) + "\n")
    golden = json.loads(GOLDEN.read_text())
    for suite in sorted(set(golden) | set(epoch_end)):
        want, got = golden.get(suite, {}), epoch_end.get(suite, {})
        changed = {k: (want.get(k), got.get(k)) for k in sorted(set(want) | set(got)) if want.get(k) != got.get(k)}
        assert not changed, f"{suite}: W&B keys of this run differ from {GOLDEN} (golden, this run): {changed}"
