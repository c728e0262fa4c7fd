"""``unicon evaluate <suite> --shard i/n`` + ``--merge`` == one run, byte for byte, for CocoCon, drift
and UReason; the merge's refusals (a missing shard, other settings, other weights); the partition is
the DistributedSampler's.

Every run goes through the real CLI and ``load_model`` on a saved ``standins.FakeModel`` whose
outputs depend on their inputs (a wrong order, a lost or doubled sample changes the files). The
world has 3 drift seeds and an odd number of CocoCon samples, so shard 1 of 2 carries a padding
repeat, as a rank does."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

import standins
from unicon import loggers
from unicon.errors import UserError
from unicon.evaluation.cococon import cli as cococon_cli
from unicon.evaluation.distributed import Shard, shard_indices
from unicon.evaluation.drift import cli as drift_cli
from unicon.evaluation.ureason import cli as ureason_cli


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    return standins.build_world(tmp_path_factory.mktemp("world"), "--num-drift-seeds", "3")


@pytest.fixture(scope="module")
def ckpt(world, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("fake") / "ckpt"
    standins.FakeModel(scale=0.5, captions="world", draw="world", world=str(world)).save_pretrained(str(path))
    return path


@pytest.fixture(autouse=True)
def fixed_git_state(monkeypatch):
    """The runs record the checkout's git state; other people may edit the tree meanwhile."""
    state = loggers.git_state()
    monkeypatch.setattr(loggers, "git_state", lambda: state)


#: suite -> (cli, its arguments over the world, the files compared, their timing lines)
SUITES = {
    "cococon": (cococon_cli.cli, lambda w: ["--data", str(w / "cococon_test.json"), "--cider-tokenizer", "simple"],
                ["results.json", "per_sample.jsonl"], cococon_cli.TIMING_FIELDS),
    "drift": (drift_cli.cli, lambda w: ["--world", str(w), "--generations", "2", "--embedders", "scene"],
              ["drift.json"], ()),
    "ureason": (ureason_cli.cli, lambda w: ["--data", str(w), "--judge", "exact"],
                ["ureason.json", "samples.jsonl", "table.md"], ()),
}


def _without(text: str, timing: tuple[str, ...]) -> str:
    """``text`` without the top-level lines of the listed timing fields (nothing else)."""
    for name in timing:
        text, n = re.subn(rf'^  "{name}": [^\n]*\n', "", text, flags=re.M)
        assert n == 1, f"{name} is not a top-level field"
    return text


def _tree(root: Path, sub: str) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted((root / sub).rglob("*.png"))}


@pytest.mark.parametrize("suite", list(SUITES))
def test_two_shards_and_merge_equal_one_run(suite, world, ckpt, tmp_path, capsys):
    cli, extra, files, timing = SUITES[suite]
    common = ["--ckpt", str(ckpt), "--device", "cpu", "--logger", "none", "--batch-size", "2", *extra(world)]
    one, split = tmp_path / "one", tmp_path / "split"
    assert cli([*common, "--out", str(one)]) == 0
    for i in range(2):
        assert cli([*common, "--out", str(split), "--shard", f"{i}/2"]) == 0
        assert not (split / files[0]).exists()  # a shard writes no final file
    assert cli([*common, "--out", str(split), "--merge"]) == 0
    capsys.readouterr()
    for name in files:
        a, b = (one / name).read_text(), (split / name).read_text()
        assert _without(b, timing if name == "results.json" else ()) == \
            _without(a, timing if name == "results.json" else ()), name
    if suite == "ureason":  # the images each shard saved are the ones one run saves
        assert _tree(split, "images") == _tree(one, "images") and _tree(one, "images")
    if suite == "drift":  # shard i's chains are where rank i of a 2-rank run keeps them
        report = json.loads((one / "drift.json").read_text())
        assert report["num_chains"] == 3 and report["model_fingerprint"]
        assert 0 < report["MCD_avg"] < 1 and 0 <= report["MGG"] <= 1  # input-dependent, not constant
        assert sorted(p.name for p in (split / "mcd").iterdir()) == ["rank-0", "rank-1"]
        ids = [[json.loads(line)["id"] for line in open(world / "drift_seeds.jsonl")][k] for k in shard_indices(3, 1, 2)]
        assert sorted(p.stem for p in (split / "mcd" / "rank-1" / "text-first" / "gen-1").glob("*.png")) == sorted(ids)


def test_merge_refuses_what_does_not_add_up(world, tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    standins.FakeModel(scale=0.5).save_pretrained(str(ckpt))
    common = ["--ckpt", str(ckpt), "--device", "cpu", "--logger", "none", "--data", str(world / "cococon_test.json"),
              "--cider-tokenizer", "simple", "--out", str(tmp_path / "o")]
    with pytest.raises(UserError, match=r"no shard folder under .*shards"):
        cococon_cli.cli([*common, "--merge"])
    assert cococon_cli.cli([*common, "--shard", "0/2"]) == 0
    with pytest.raises(UserError, match=r"shard 1/2 has not finished \(no .*shard-1-of-2/done\.json\)"):
        cococon_cli.cli([*common, "--merge"])
    assert cococon_cli.cli([*common, "--shard", "1/2", "--max-samples", "3"]) == 0
    with pytest.raises(UserError, match=r"shard 1/2 .* was run with other settings: max_samples=3 \(merge: None\)"):
        cococon_cli.cli([*common, "--merge"])
    standins.FakeModel(scale=0.25).save_pretrained(str(ckpt))  # the checkpoint changed between the shards
    assert cococon_cli.cli([*common, "--shard", "1/2"]) == 0  # a rerun replaces the shard's parts
    with pytest.raises(UserError, match="merge: shard 1/2 evaluated another model than shard 0 \\(model_fingerprint"):
        cococon_cli.cli([*common, "--merge"])
    standins.FakeModel(scale=0.5).save_pretrained(str(ckpt))
    assert cococon_cli.cli([*common, "--shard", "1/2"]) == 0
    shutil.rmtree(ckpt)  # the merge loads no model: the shards recorded what it needs
    assert cococon_cli.cli([*common, "--merge"]) == 0
    assert json.loads((tmp_path / "o" / "results.json").read_text())["num_samples"] > 0
    with pytest.raises(SystemExit):  # one or the other
        cococon_cli.cli([*common, "--merge", "--shard", "0/2"])
    capsys.readouterr()


@pytest.mark.parametrize("text,error", [("2/2", "0 <= i < n"), ("1", "expected i/n"), ("a/b", "expected i/n"),
                                        ("0/0", "n >= 1")])
def test_shard_spec_errors_name_the_flag(text, error):
    with pytest.raises(UserError, match=f"--shard {re.escape(repr(text)) if 'expected' in error else text}.*{error}"):
        Shard.parse(text)


def test_shards_are_the_distributed_sampler_partition():
    from torch.utils.data import DistributedSampler

    for n, world in [(7, 2), (3, 2), (2, 5), (8, 4)]:
        for rank in range(world):
            assert shard_indices(n, rank, world) == list(DistributedSampler(range(n), world, rank, shuffle=False))
        assert sorted({i for r in range(world) for i in shard_indices(n, r, world)}) == list(range(n))


@pytest.mark.parametrize("suite", list(SUITES))
def test_a_bad_shard_spec_creates_no_output_folder(suite, world, ckpt, tmp_path):
    cli, extra, _, _ = SUITES[suite]
    out = tmp_path / "out"
    with pytest.raises(UserError, match=r"--shard 2/2: need n >= 1 and 0 <= i < n"):
        cli(["--ckpt", str(ckpt), "--device", "cpu", "--logger", "none", *extra(world), "--out", str(out),
             "--shard", "2/2"])
    assert not out.exists()
