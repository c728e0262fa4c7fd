"""``unicon evaluate <suite> --shard i/n`` + ``--merge`` == one run, byte for byte, for every suite that
takes them (``EvalSuite.shardable``: every in-tree suite); the merge's refusals (a missing shard, other
settings, other weights); the partition is the DistributedSampler's; the merge reads only the JSON
parts the shards write, never a pickle.

Every run goes through the real CLI and ``load_model`` on a saved ``standins.FakeModel`` whose
outputs depend on their inputs (a wrong order, a lost or doubled sample changes the files). The
world has 3 drift seeds and an odd number of CocoCon samples, and the other suites run on odd counts
(RealUnify 7 instances, alignment 3 pairs, EditingScore 3 rows and 1 own edit), so shard 1 of 2
carries a padding repeat, as a rank does."""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
from pathlib import Path

import pytest

import standins
from unicon import loggers
from unicon.errors import UserError
from unicon.evaluation.cococon.suite import TIMING_FIELDS
from unicon.evaluation.distributed import Shard, shard_indices
from unicon.evaluation.suites import suite


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


def command(name):
    """``unicon evaluate <name>``"""
    return lambda argv: suite(name).cli(argv)


#: suite -> (cli, its arguments over the world, the files compared, their timing lines)
SUITES = {
    "cococon": (command("cococon"), lambda w: ["--data", str(w / "cococon_test.json"), "--cider-tokenizer", "simple"],
                ["results.json", "per_sample.jsonl"], TIMING_FIELDS),
    "drift": (command("drift"), lambda w: ["--world", str(w), "--generations", "2", "--embedders", "scene"],
              ["drift.json"], ()),
    "ureason": (command("ureason"), lambda w: ["--data", str(w), "--judge", "exact"],
                ["ureason.json", "samples.jsonl", "table.md"], ()),
    "realunify": (command("realunify"), lambda w: ["--data", str(w), "--limit", "1"],  # 1 per category: 7
                  ["realunify.json", "samples.jsonl", "table.md"], ()),
    # clip_s is not run (no --clip); bleu4 is computed by the merge over every pair
    "alignment": (command("alignment"), lambda w: ["--data", str(w), "--limit", "3", "--baselines", "clip_s,bleu4"],
                  ["alignment.json", "samples.jsonl", "table.md"], ()),
    # the picture shows each task's first rows, whichever shard ran them
    "shapes": (command("shapes"), lambda w: ["--world", str(w), "--limit", "5", "--examples", "2"],
               ["shapes_eval.json", "shapes_eval.png"], ()),
    "editing": (command("editing"), lambda w: ["--data", str(w / "editscore" / "editscore.jsonl"), "--limit", "3",
                                            "--own-edits", "1"],
                ["editing.json", "samples.jsonl", "own_edits.jsonl", "table.md"], ()),
}


def test_every_shardable_suite_is_covered():
    from unicon.evaluation.suites import suites

    assert sorted(SUITES) == sorted(s.name for s in suites().values()) == \
        sorted(s.name for s in suites().values() if s.shardable)


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
        if name.endswith(".png"):
            assert (one / name).read_bytes() == (split / name).read_bytes(), name
            continue
        a, b = (one / name).read_text(), (split / name).read_text()
        assert _without(b, timing if name == "results.json" else ()) == \
            _without(a, timing if name == "results.json" else ()), name
    images = {"ureason": "images", "realunify": "images", "editing": "own_edits"}.get(suite)
    if images:  # the images each shard saved are the ones one run saves
        assert _tree(split, images) == _tree(one, images) and _tree(one, images)
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
        command("cococon")([*common, "--merge"])
    assert command("cococon")([*common, "--shard", "0/2"]) == 0
    with pytest.raises(UserError, match=r"shard 1/2 has not finished \(no .*shard-1-of-2/done\.json\)"):
        command("cococon")([*common, "--merge"])
    with pytest.raises(UserError, match=r"--out .*o holds the outputs of another run \(written with other settings: "
                                        r"max_samples=null \(this run: 3\)\); use another --out, or pass --overwrite"):
        command("cococon")([*common, "--shard", "1/2", "--max-samples", "3"])  # refused before it runs
    assert command("cococon")([*common, "--shard", "1/2"]) == 0
    done = tmp_path / "o" / "shards" / "shard-1-of-2" / "done.json"  # a shard folder of other settings, copied in
    info = json.loads(done.read_text())
    info["key"]["max_samples"] = 3
    done.write_text(json.dumps(info))
    with pytest.raises(UserError, match=r"shard 1/2 .* was run with other settings: max_samples=3 \(merge: None\)"):
        command("cococon")([*common, "--merge"])
    standins.FakeModel(scale=0.25).save_pretrained(str(ckpt))  # the checkpoint changed between the shards
    assert command("cococon")([*common, "--shard", "1/2"]) == 0  # a rerun replaces the shard's parts
    with pytest.raises(UserError, match="merge: shard 1/2 evaluated another model than shard 0 \\(model_fingerprint"):
        command("cococon")([*common, "--merge"])
    standins.FakeModel(scale=0.5).save_pretrained(str(ckpt))
    assert command("cococon")([*common, "--shard", "1/2"]) == 0
    shutil.rmtree(ckpt)  # the merge loads no model: the shards recorded what it needs
    assert command("cococon")([*common, "--merge"]) == 0
    assert json.loads((tmp_path / "o" / "results.json").read_text())["num_samples"] > 0
    with pytest.raises(SystemExit):  # one or the other
        command("cococon")([*common, "--merge", "--shard", "0/2"])
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


class _Payload:
    """Unpickling it would run ``touch <marker>``."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_merge_reads_no_pickle_and_refuses_any_file_but_a_shard_part(world, ckpt, tmp_path):
    """A crafted part file (a pickle with a code payload, an unknown tag, an object dtype, a torn
    file) is refused with one line naming it, and nothing in it runs; the rerun shard merges."""
    cli, extra, files, _ = SUITES["cococon"]
    common = ["--ckpt", str(ckpt), "--device", "cpu", "--logger", "none", *extra(world), "--out", str(tmp_path / "o")]
    for i in range(2):
        assert cli([*common, "--shard", f"{i}/2"]) == 0
    part = tmp_path / "o" / "shards" / "shard-1-of-2" / "collective-000.json"
    assert json.loads(part.read_text())["format"] == "unicon-shard-part"  # strict JSON, no pickle
    marker = tmp_path / "payload-ran"
    crafted = {
        pickle.dumps(_Payload(marker)): r"binary data, a pickle\)",
        json.dumps({"format": "unicon-shard-part", "version": 1, "value": {"$t": "os.system", "v": "id"}}).encode():
            r"unknown value type 'os.system'",
        json.dumps({"format": "unicon-shard-part", "version": 1,
                    "value": {"$t": "ndarray", "dtype": "|O", "shape": [1], "data": ""}}).encode():
            r"numpy dtype object is not one a part may hold",
        json.dumps({"format": "unicon-shard-part", "version": 1,
                    "value": {"$t": "tensor", "dtype": "float32", "shape": [1000000], "data": "AAAA"}}).encode():
            r"tensor data of 3 bytes for shape \[1000000\]",
        b'{"format": "unicon-shard-part", "version": 1, "value": [NaN]}': r"non-JSON constant NaN",
        part.read_bytes()[:50]: r"not JSON",
    }
    for content, why in crafted.items():
        part.write_bytes(content)
        with pytest.raises(UserError, match=rf"merge: {re.escape(str(part))} is not a shard part file \({why}") as err:
            cli([*common, "--merge"])
        assert "\n" not in str(err.value) and not marker.exists()
    part.unlink()
    part.with_suffix(".pkl").write_bytes(pickle.dumps(_Payload(marker)))  # a pickle where a part should be
    with pytest.raises(UserError, match=r"holds collective-000\.pkl, a pickle, and no collective-000\.json"):
        cli([*common, "--merge"])
    assert not marker.exists() and not (tmp_path / "o" / files[0]).exists()
    assert cli([*common, "--shard", "1/2"]) == 0 and cli([*common, "--merge"]) == 0
    assert not marker.exists() and (tmp_path / "o" / files[0]).is_file()


def test_shard_parts_round_trip_what_the_suites_gather():
    from collections import Counter, OrderedDict

    import numpy as np
    import torch
    from PIL import Image

    from unicon.evaluation.shard_parts import dumps_part, loads_part

    image = Image.new("RGB", (5, 3), (10, 20, 30))
    image.info["dpi"] = (72, 72)
    value = {
        3: {"similarity": [0.1, float("nan"), float("inf"), -0.0], "trail": ("a caption", image), "$t": None},
        "counts": Counter({"truncated": 2}), "ordered": OrderedDict(b=1, a=2), "ids": {"x", "y"}, "raw": b"\x00\xff",
        "state": torch.arange(6, dtype=torch.float64).reshape(2, 3), "half": torch.tensor([1.5], dtype=torch.bfloat16),
        "flags": torch.tensor([True, False]), "empty": torch.empty(0, 4), "np": np.arange(3, dtype=np.int16),
        "np_scalar": np.float32(0.1), (1, "k"): None,
    }
    back = loads_part(dumps_part(value))
    assert set(back) == set(value) and back["counts"] == value["counts"] and type(back["counts"]) is Counter
    assert list(back["ordered"]) == ["b", "a"] and back["ids"] == {"x", "y"} and back["raw"] == b"\x00\xff"
    sim = back[3]["similarity"]
    assert sim[0] == 0.1 and sim[1] != sim[1] and sim[2] == float("inf") and str(sim[3]) == "-0.0"
    caption, img = back[3]["trail"]
    assert caption == "a caption" and img.mode == "RGB" and img.tobytes() == image.tobytes() and img.info == image.info
    for key in ("state", "half", "flags", "empty"):
        assert back[key].dtype == value[key].dtype and torch.equal(back[key], value[key]), key
    assert back["np"].dtype == np.int16 and back["np"].tolist() == [0, 1, 2]
    assert type(back["np_scalar"]) is np.float32 and back["np_scalar"] == np.float32(0.1)
    with pytest.raises(TypeError, match="cannot hold a pathlib"):
        dumps_part(Path("x"))
