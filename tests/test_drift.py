"""Semantic drift chains: resume, MCD, GenEval rules, MGG, loaders, embedders, callback, CLI,
2 gloo ranks == 1 process."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import matplotlib
import numpy as np
import pytest
import torch
from conftest import float32_tol
from PIL import Image
from standins import FakeModel, Killed, random_scene

from unicon.data.drift_seeds import (
    DriftSeed, SeedFormatError, balanced, geneval_seeds, load_shapes_seeds, nd400_seeds,
)
from unicon.data.geneval import GenEvalFormatError, load_geneval, parse_row
from unicon.embedders.base import Embedder, EmbedderNotFound
from unicon.bench import chains as bench
from unicon.evaluation.drift import metrics, runner
from unicon.evaluation import cli_common
from unicon.evaluation.callbacks import SuiteCallback
from unicon.evaluation.suites import suite
from unicon.errors import UserError
from unicon.evaluation.drift.geneval import evaluate_detections, keep_detections, relative_position, summarize


# ---------------------------------------------------------------------------------------------------------
# Test doubles
# ---------------------------------------------------------------------------------------------------------
#: the chain runner's double (``standins.FakeModel``): ``generate_image(p)`` draws 16x16 pixels from sha256(p),
#: ``caption(im)`` names the image's hash in a caption with quotes and a newline (the CSV must round-trip them).
#: Every output depends on its input, so a wrong resume shows up as different bytes downstream.
CHAIN_CAPTIONS = '{prompt} with pattern {hash}, "quoted"\nand a newline'


def chain_model(kill_after: int | None = None) -> FakeModel:
    """``kill_after``: that model call raises :class:`standins.Killed`."""
    return FakeModel(captions=CHAIN_CAPTIONS, draw="hash", kill_after=kill_after)


def make_seeds(tmp: Path, n: int) -> list[DriftSeed]:
    seeds = []
    for i in range(n):
        p = tmp / "seed_images" / f"s{i}.png"
        p.parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (16, 16), (10 * i, 200 - 10 * i, 7)).save(p)
        seeds.append(DriftSeed(id=f"s{i}", caption=f"seed caption number {i}", image=p))
    return seeds


def tree_bytes(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# ---------------------------------------------------------------------------------------------------------
# Chain runner: layout, batching, resume
# ---------------------------------------------------------------------------------------------------------
def test_chain_layout_and_batching(tmp_path):
    seeds = make_seeds(tmp_path, 5)
    model = chain_model()
    run = runner.run_chains(model, seeds, tmp_path / "run", generations=3, batch_size=2, i2t_prompt="describe")
    out = tmp_path / "run"
    assert (out / "text-first" / "gen-0.csv").is_file() and (out / "text-first" / "gen-2.csv").is_file()
    assert sorted(p.name for p in (out / "text-first" / "gen-1").iterdir()) == [f"s{i}.png" for i in range(5)]
    assert (out / "image-first" / "gen-0" / "s3.png").is_file() and (out / "image-first" / "gen-3.csv").is_file()
    rows = runner.read_csv(out / "text-first" / "gen-0.csv")
    assert rows == [(f"s{i}.png", f"seed caption number {i}") for i in range(5)]
    # CSV round-trips quotes and newlines; captions were produced with the I2T prompt
    t2 = runner.read_csv(out / "text-first" / "gen-2.csv")
    assert all(c.startswith("describe with pattern") and "\n" in c and '"quoted"' in c for _, c in t2)
    # batched across samples: 3 batches (2+2+1) per model generation, 3 model generations per chain
    assert [n for _, n in model.calls] == [2, 2, 1] * 6
    assert {name for name, _ in model.calls} == {"caption", "generate_image"}  # nothing else is called
    assert run.model_steps == 5 * 3 * 2
    # nothing left but outputs and markers
    assert not list(out.rglob("*.partial.jsonl")) and not list(out.rglob(".*tmp*"))


@pytest.mark.parametrize("kill_after", [1, 4, 8, 11])
def test_killed_run_resumes_to_identical_bytes(tmp_path, kill_after):
    seeds = make_seeds(tmp_path, 5)
    kw = dict(generations=4, batch_size=2, i2t_prompt="describe")
    runner.run_chains(chain_model(), seeds, tmp_path / "clean", **kw)

    killed = chain_model(kill_after=kill_after)
    with pytest.raises(Killed):
        runner.run_chains(killed, seeds, tmp_path / "resumed", **kw)
    # a half-written temporary file, as left by a kill inside a write
    (tmp_path / "resumed" / "text-first" / ".gen-1.tmp-999").write_bytes(b"\x89PNG half")
    # ... and a garbage file where a not-yet-journaled image of the interrupted generation goes
    if not (tmp_path / "resumed" / "text-first" / "gen-3.done.json").exists():
        (tmp_path / "resumed" / "text-first" / "gen-3").mkdir(parents=True, exist_ok=True)
        (tmp_path / "resumed" / "text-first" / "gen-3" / "s4.png").write_bytes(b"\x89PNG garbage")
    resumed = chain_model()
    run = runner.run_chains(resumed, seeds, tmp_path / "resumed", **kw)
    assert tree_bytes(tmp_path / "clean") == tree_bytes(tmp_path / "resumed")
    # complete generations and journaled batches were not recomputed
    total_calls = 3 * 4 * 2  # batches x model generations x chains
    assert len(resumed.calls) == total_calls - (kill_after - 1)
    assert any("leftover" in r for r in run.repairs)


def test_resume_of_complete_run_does_nothing(tmp_path):
    seeds = make_seeds(tmp_path, 3)
    runner.run_chains(chain_model(), seeds, tmp_path / "r", generations=2, batch_size=2)
    again = chain_model()
    run = runner.run_chains(again, seeds, tmp_path / "r", generations=2, batch_size=2)
    assert again.calls == [] and run.repairs == []
    # extending the chain computes only the new generations
    more = chain_model()
    runner.run_chains(more, seeds, tmp_path / "r", generations=3, batch_size=2)
    assert len(more.calls) == 2 * 2  # gen 3 of both chains, 2 batches each


def test_corrupt_image_and_csv_are_reported_and_regenerated(tmp_path, caplog):
    seeds = make_seeds(tmp_path, 4)
    kw = dict(generations=3, batch_size=2)
    runner.run_chains(chain_model(), seeds, tmp_path / "clean", **kw)
    shutil.copytree(tmp_path / "clean", tmp_path / "bad")
    bad_img = tmp_path / "bad" / "text-first" / "gen-1" / "s2.png"
    bad_img.write_bytes(bad_img.read_bytes()[:40])  # truncated PNG
    csv_path = tmp_path / "bad" / "image-first" / "gen-1.csv"
    csv_path.write_bytes(runner.csv_bytes(runner.read_csv(csv_path)[:-1]))  # a row went missing
    model = chain_model()
    with caplog.at_level("WARNING"):
        run = runner.run_chains(model, seeds, tmp_path / "bad", **kw)
    assert any(str(bad_img) in r for r in run.repairs)
    assert any(str(csv_path) in r and "rows do not match" in r for r in run.repairs)
    assert str(bad_img) in caplog.text
    assert tree_bytes(tmp_path / "clean") == tree_bytes(tmp_path / "bad")
    # only the affected batches were redone (deterministic model: later generations kept)
    assert len(model.calls) == 2


def test_reordered_csv_is_rewritten_without_model_calls(tmp_path):
    seeds = make_seeds(tmp_path, 3)
    runner.run_chains(chain_model(), seeds, tmp_path / "r", generations=2, batch_size=2)
    path = tmp_path / "r" / "text-first" / "gen-2.csv"
    clean = path.read_bytes()
    rows = runner.read_csv(path)
    path.write_bytes(runner.csv_bytes(rows[::-1] + rows[:1]))  # reversed, one duplicated row
    model = chain_model()
    run = runner.run_chains(model, seeds, tmp_path / "r", generations=2, batch_size=2)
    assert model.calls == [] and path.read_bytes() == clean
    assert any(str(path) in r for r in run.repairs)


def test_resume_refuses_other_settings(tmp_path):
    seeds = make_seeds(tmp_path, 2)
    runner.run_chains(chain_model(), seeds, tmp_path / "r", generations=1, batch_size=2, i2t_prompt="a")
    with pytest.raises(Exception, match="different i2t_prompt"):
        runner.run_chains(chain_model(), seeds, tmp_path / "r", generations=1, batch_size=2, i2t_prompt="b")


# ---------------------------------------------------------------------------------------------------------
# MCD
# ---------------------------------------------------------------------------------------------------------
class TableEmbedder(Embedder):
    """Looks the vector of each caption / image colour up in a table (a joint space)."""

    name = "table"
    modalities = frozenset({"text", "image"})
    joint = True

    def __init__(self, table):
        self.table = table

    def _v(self, key):
        v = torch.tensor(self.table[key], dtype=torch.float32)
        return v / v.norm()

    def embed_text(self, texts):
        return torch.stack([self._v(t) for t in texts])

    def embed_image(self, images):
        return torch.stack([self._v(im.getpixel((0, 0))) for im in images])


def write_chain(out: Path, chain: str, items: dict[int, dict[str, object]]):
    """items[g][id] = caption str or RGB colour tuple (a solid 4x4 image)."""
    d = out / chain
    for g, per in items.items():
        if metrics.modality(chain, g) == "text":
            d.mkdir(parents=True, exist_ok=True)
            (d / f"gen-{g}.csv").write_bytes(runner.csv_bytes([(f"{i}.png", c) for i, c in per.items()]))
        else:
            (d / f"gen-{g}").mkdir(parents=True, exist_ok=True)
            for i, color in per.items():
                Image.new("RGB", (4, 4), color).save(d / f"gen-{g}" / f"{i}.png")


def test_mcd_matches_hand_computation(tmp_path):
    A, B, C = (255, 0, 0), (0, 255, 0), (0, 0, 255)
    table = {"a": [1, 0], "b": [0, 1], "c": [1, 1], A: [1, 0], B: [0, 1], C: [3, 4]}
    # text-first: T0 -> I1 -> T2 -> I3 -> T4 ; image-first: I0 -> T1 -> I2 -> T3 -> I4
    write_chain(tmp_path, "text-first", {
        0: {"x": "a", "y": "b"}, 1: {"x": A, "y": C}, 2: {"x": "c", "y": "b"}, 3: {"x": B, "y": B}, 4: {"x": "b", "y": "c"},
    })
    write_chain(tmp_path, "image-first", {
        0: {"x": A, "y": C}, 1: {"x": "a", "y": "c"}, 2: {"x": C, "y": C}, 3: {"x": "b", "y": "b"}, 4: {"x": A, "y": B},
    })
    sims = runner.chain_similarities(runner.ChainLayout(tmp_path), ["x", "y"], {"table": TableEmbedder(table)},
                                     generations=4, chains=metrics.CHAINS)
    r = metrics.mcd([sims["x"], sims["y"]], generations=4)
    s2 = 1 / math.sqrt(2)
    # S_t2t(2) = mean(cos(a,c), cos(b,b)) ; S_t2t(4) = mean(cos(a,b), cos(b,c))
    S_t2t = {2: (s2 + 1) / 2, 4: (0 + s2) / 2}
    # S_t2i(1) = mean(cos(a,A), cos(b,C)) = (1 + 0.8)/2 ; S_t2i(3) = mean(cos(a,B), cos(b,B)) = 0.5
    S_t2i = {1: 0.9, 3: 0.5}
    # image-first inputs: A=[1,0], C=[.6,.8]
    S_i2t = {1: (1 + (0.6 + 0.8) / math.sqrt(2)) / 2, 3: (0 + 0.8) / 2}
    S_i2i = {2: (0.6 + 1) / 2, 4: (1 + 0.8) / 2}
    for mapping, S in (("t2t", S_t2t), ("t2i", S_t2i), ("i2t", S_i2t), ("i2i", S_i2i)):
        assert r["S"][mapping] == pytest.approx(S, abs=1e-6), mapping
        assert r["MCD"][mapping] == pytest.approx(sum(S.values()) / 2, abs=1e-6)
    expected_avg = np.mean([sum(S.values()) / 2 for S in (S_t2t, S_t2i, S_i2t, S_i2i)])
    assert r["MCD_avg"] == pytest.approx(expected_avg, abs=1e-6)
    assert r["embedder"]["t2t"] == "table"
    assert r["by_embedder"]["table"]["t2i"]["per_chain"][0] == pytest.approx([1.0, 0.0], abs=1e-6)


def test_text_only_embedder_does_not_claim_cross_modal(tmp_path):
    class TextOnly(TableEmbedder):
        name = "text"
        modalities = frozenset({"text"})
        joint = False

    emb = TextOnly({})
    assert emb.supports("text", "text") and not emb.supports("text", "image") and not emb.supports("image", "image")


def test_decay_fit_recovers_parameters_and_fails_gracefully():
    g = np.arange(1, 11)
    y = 0.4 * np.exp(-0.3 * g) + 0.5
    fit = metrics.fit_decay(g, y)
    assert fit["a"] == pytest.approx(0.4, rel=1e-3) and fit["b"] == pytest.approx(0.3, rel=1e-3)
    assert fit["c"] == pytest.approx(0.5, rel=1e-3) and fit["rmse"] < 1e-6
    assert "error" in metrics.fit_decay([1, 2], [0.5, 0.4])
    assert "error" in metrics.fit_decay([1, 2, 3], [0.5, float("nan"), 0.4])


# ---------------------------------------------------------------------------------------------------------
# GenEval rules
# ---------------------------------------------------------------------------------------------------------
def row(tag, include, exclude=None, prompt="p"):
    r = {"tag": tag, "include": include, "prompt": prompt}
    if exclude is not None:
        r["exclude"] = exclude
    return parse_row(r, "test", 0)


def det(label, box, score=0.95, color=None):
    d = {"label": label, "box": box, "score": score}
    if color:
        d["color"] = color
    return d


def test_include_needs_count_detections_above_threshold():
    p = row("two_object", [{"class": "cat", "count": 1}, {"class": "dog", "count": 1}])
    assert evaluate_detections(p, [det("cat", [0, 0, 10, 10]), det("dog", [20, 0, 10, 10], 0.31)]).correct
    # 0.3 is not > 0.3
    assert not evaluate_detections(p, [det("cat", [0, 0, 10, 10]), det("dog", [20, 0, 10, 10], 0.3)]).correct
    assert not evaluate_detections(p, [det("cat", [0, 0, 10, 10])]).correct


def test_counting_threshold_and_exclusion():
    p = row("counting", [{"class": "clock", "count": 2}], [{"class": "clock", "count": 3}])
    two = [det("clock", [0, 0, 5, 5]), det("clock", [10, 0, 5, 5])]
    assert evaluate_detections(p, two).correct
    # a third clock above 0.9 triggers the exclusion (count >= 3)
    assert not evaluate_detections(p, two + [det("clock", [20, 0, 5, 5], 0.91)]).correct
    # a third clock at 0.8 is below the counting threshold: ignored
    assert evaluate_detections(p, two + [det("clock", [20, 0, 5, 5], 0.8)]).correct
    # counting uses 0.9 also for the include: 0.85 clocks do not count
    assert not evaluate_detections(p, [det("clock", [0, 0, 5, 5], 0.85), det("clock", [9, 0, 5, 5])]).correct
    kept = keep_detections(two + [det("clock", [1, 1, 1, 1], 0.5)], "counting")
    assert len(kept["clock"]) == 2


def test_color_rule_uses_top_count_boxes():
    p = row("colors", [{"class": "car", "count": 1, "color": "pink"}])
    assert evaluate_detections(p, [det("car", [0, 0, 9, 9], 0.9, "pink")]).correct
    # only the most confident car is colour-checked
    dets = [det("car", [0, 0, 9, 9], 0.9, "red"), det("car", [20, 0, 9, 9], 0.5, "pink")]
    assert not evaluate_detections(p, dets).correct
    # a pluggable classifier overrides missing colours
    calls = []

    def clf(image, boxes, classname):
        calls.append((classname, len(boxes)))
        return ["pink"] * len(boxes)

    assert evaluate_detections(p, [det("car", [0, 0, 9, 9])], color_classifier=clf).correct
    assert calls == [("car", 1)]


def test_relative_position_margins_by_hand():
    # A centre (15, 5), B centre (5, 5): offset (10, 0), margin 0.1*(10+10)=2 -> revised (8, 0) / 10 = 0.8
    assert relative_position([10, 0, 10, 10], [0, 0, 10, 10]) == {"right of"}
    assert relative_position([0, 0, 10, 10], [10, 0, 10, 10]) == {"left of"}
    # diagonal: offset (10, 10), margins 2 each -> (8, 8)/14.142 = 0.566 on both axes
    assert relative_position([10, 10, 10, 10], [0, 0, 10, 10]) == {"right of", "below"}
    # offset (10, 6): revised (8, 4)/11.66 = (0.686, 0.343) -> only right of
    assert relative_position([10, 6, 10, 10], [0, 0, 10, 10]) == {"right of"}
    # offsets inside the margin vanish: offset (1.5, 0) with margin 2 -> no relation
    assert relative_position([1.5, 0, 10, 10], [0, 0, 10, 10]) == set()
    # large boxes eat the offset: widths 100 -> margin 20 > offset 15
    assert relative_position([15, 0, 100, 10], [0, 0, 100, 10]) == set()
    # just above the 0.5 threshold vs just below: offset (x, 10), no margin on y for thin boxes
    assert "above" in relative_position([0, 0, 1, 1], [0, 10, 1, 1])


def test_position_rule_against_reference_clause():
    p = row("position", [{"class": "teddy bear", "count": 1},
                         {"class": "dog", "count": 1, "position": ["right of", 0]}])
    bear, dog_right, dog_left = [0, 0, 10, 10], [30, 0, 10, 10], [-30, 0, 10, 10]
    assert evaluate_detections(p, [det("teddy bear", bear), det("dog", dog_right)]).correct
    res = evaluate_detections(p, [det("teddy bear", bear), det("dog", dog_left)])
    assert not res.correct and "expected dog right of target, found left of" in res.reasons[0]
    # no bear: the position clause has no target
    res = evaluate_detections(p, [det("dog", dog_right)])
    assert not res.correct and any("no target" in r for r in res.reasons)


def test_summary_is_mean_of_task_accuracies_not_micro():
    s = summarize(["counting"] * 4 + ["colors"], [True, False, False, False, True])
    assert s["tasks"] == {"counting": 0.25, "colors": 1.0}
    assert s["overall"] == pytest.approx(0.625) and s["overall_micro"] == pytest.approx(0.4)


# ---------------------------------------------------------------------------------------------------------
# Loaders
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.shared
def test_real_geneval_files_parse(shared_data):
    d = shared_data / "geneval"
    short = load_geneval(d / "evaluation_metadata.jsonl")
    bagel = load_geneval(d / "evaluation_metadata_long_bagel.jsonl")
    blip = load_geneval(d / "geneval_prompt_blip3o_rewritten.jsonl")
    assert len(short) == len(bagel) == len(blip) == 553
    assert short[0].prompt == "a photo of a bench" and blip[0].prompt == short[0].prompt
    assert [p.include for p in short] == [p.include for p in bagel] == [p.include for p in blip]
    assert len(bagel[0].prompt) > 200 and blip[0].detailed_caption.startswith("A clear photo of a wooden bench")
    tags = {p.tag for p in short}
    assert tags == {"single_object", "two_object", "counting", "colors", "position", "color_attr"}
    pos = next(p for p in short if p.tag == "position")
    assert pos.include[1].position == ("right of", 0)
    cnt = next(p for p in short if p.tag == "counting")
    assert cnt.exclude[0].count == cnt.include[0].count + 1
    seeds = geneval_seeds(d / "geneval_prompt_blip3o_rewritten.jsonl", long=True, limit=2)
    assert len(seeds) == 12 and seeds[0].caption == blip[0].detailed_caption
    with pytest.raises(GenEvalFormatError, match="detailed_caption"):
        short[0].text(long=True)
    picked = balanced(geneval_seeds(d / "evaluation_metadata.jsonl"), 12)
    assert sorted(s.geneval.tag for s in picked) == sorted(list(tags) * 2)


def test_geneval_errors_name_file_and_line(tmp_path):
    f = tmp_path / "m.jsonl"
    f.write_text('{"tag": "single_object", "include": [{"class": "cat", "count": 1}], "prompt": "a cat"}\n\n{"tag": "x"\n')
    with pytest.raises(GenEvalFormatError, match=rf"{f}:3: malformed JSON"):
        load_geneval(f)
    f.write_text('{"tag": "position", "include": [{"class": "cat", "count": 1, "position": ["left of", 0]}], "prompt": "p"}\n')
    with pytest.raises(GenEvalFormatError, match=rf"{f}:1: 'position'.*earlier include clause"):
        load_geneval(f)
    f.write_text('{"tag": "counting", "include": [{"class": "cat", "count": 0}], "prompt": "p"}\n')
    with pytest.raises(GenEvalFormatError, match=rf"{f}:1: .*count"):
        load_geneval(f)


def test_nd400_from_local_files(tmp_path):
    nc_imgs, dc_imgs = tmp_path / "nocaps", tmp_path / "docci"
    nc_imgs.mkdir()
    dc_imgs.mkdir()
    images, anns = [], []
    for i in range(5):
        Image.new("RGB", (8, 8)).save(nc_imgs / f"n{i}.jpg")
        images.append({"id": i, "file_name": f"n{i}.jpg"})
        anns += [{"id": 10 * i + k, "image_id": i, "caption": f"nocaps {i} caption {k}"} for k in range(3)]
    (tmp_path / "nocaps.json").write_text(json.dumps({"images": images, "annotations": anns}))
    with open(tmp_path / "docci.jsonlines", "w") as f:
        for i in range(6):
            Image.new("RGB", (8, 8)).save(dc_imgs / f"d{i}.jpg")
            split = "test" if i % 2 else "train"
            f.write(json.dumps({"example_id": f"ex_{i}", "split": split, "image_file": f"d{i}.jpg",
                                "description": f"docci {i}"}) + "\n")
    seeds = nd400_seeds(tmp_path / "nocaps.json", nc_imgs, tmp_path / "docci.jsonlines", dc_imgs, n=2, seed=3)
    assert len(seeds) == 4 and [s.source for s in seeds] == ["nocaps", "nocaps", "docci", "docci"]
    for s in seeds[:2]:
        i = int(s.id.split("-")[1])
        assert s.caption.startswith(f"nocaps {i} caption") and s.image == nc_imgs / f"n{i}.jpg"
    assert all(int(s.id.split("_")[1]) % 2 == 1 for s in seeds[2:])  # test split only
    again = nd400_seeds(tmp_path / "nocaps.json", nc_imgs, tmp_path / "docci.jsonlines", dc_imgs, n=2, seed=3)
    assert [(s.id, s.caption) for s in again] == [(s.id, s.caption) for s in seeds]
    with pytest.raises(SeedFormatError, match="asked for 4"):
        nd400_seeds(tmp_path / "nocaps.json", nc_imgs, tmp_path / "docci.jsonlines", dc_imgs, n=4)
    (dc_imgs / "d1.jpg").unlink()
    (dc_imgs / "d3.jpg").unlink()
    with pytest.raises(SeedFormatError, match="not found"):
        nd400_seeds(tmp_path / "nocaps.json", nc_imgs, tmp_path / "docci.jsonlines", dc_imgs, n=2, seed=3)


def test_shapes_seed_file_errors(tmp_path):
    f = tmp_path / "drift_seeds.jsonl"
    Image.new("RGB", (8, 8)).save(tmp_path / "a.png")
    f.write_text(json.dumps({"id": "a", "image": "a.png", "caption": "a red circle"}) + "\n"
                 + json.dumps({"id": "b", "image": "missing.png", "caption": "x"}) + "\n")
    with pytest.raises(SeedFormatError, match=rf"{f}:2: image not found"):
        load_shapes_seeds(f)
    f.write_text(json.dumps({"id": "a b", "image": "a.png", "caption": "c"}) + "\n")
    with pytest.raises(SeedFormatError, match="safe file name"):
        load_shapes_seeds(f)


# ---------------------------------------------------------------------------------------------------------
# Embedders
# ---------------------------------------------------------------------------------------------------------
def test_missing_embedders_name_the_path(tmp_path):
    from unicon.embedders.clip import ClipEmbedder
    from unicon.embedders.dino import DinoEmbedder
    from unicon.embedders.sentence import SentenceEmbedder

    with pytest.raises(EmbedderNotFound, match=r"nowhere_clip.*--train-shapes"):
        ClipEmbedder(tmp_path / "nowhere_clip")
    with pytest.raises(EmbedderNotFound, match=r"nowhere_dino.*save_pretrained"):
        DinoEmbedder(tmp_path / "nowhere_dino")
    with pytest.raises(EmbedderNotFound, match=r"nowhere_st"):
        SentenceEmbedder(tmp_path / "nowhere_st")


def test_sentence_embedder_bundled_minilm():
    from unicon.embedders.sentence import SentenceEmbedder, default_sentence_model_path

    assert (default_sentence_model_path() / "model.safetensors").is_file()
    e = SentenceEmbedder()
    v = e.embed_text(["a red circle above a blue square", "a red circle over a blue square", "four green stars"])
    # a unit vector computed in float32: the norm's 384-term sum rounds to within float32_tol(384)
    assert v.shape == (3, 384) and torch.allclose(v.norm(dim=-1), torch.ones(3), atol=float32_tol(384))
    sim = v @ v.T
    assert sim[0, 1] > sim[0, 2] + 0.2  # paraphrase closer than an unrelated caption


def test_dino_embedder_tiny_local_model(tmp_path):
    from transformers import BitImageProcessor, Dinov2Config, Dinov2Model

    from unicon.embedders.dino import DinoEmbedder

    torch.manual_seed(0)
    cfg = Dinov2Config(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                       image_size=32, patch_size=8)
    Dinov2Model(cfg).save_pretrained(tmp_path)
    BitImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}).save_pretrained(tmp_path)
    e = DinoEmbedder(tmp_path)
    ims = [Image.new("RGB", (40, 40), c) for c in [(255, 0, 0), (255, 0, 0), (0, 0, 255)]]
    v = e.embed_image(ims)
    assert v.shape == (3, 32) and torch.allclose(v.norm(dim=-1), torch.ones(3), atol=float32_tol(32))
    assert torch.allclose(v[0], v[1], atol=float32_tol(32))  # the same input in two batch rows
    assert e.supports("image", "image") and not e.supports("text", "image")


# ---------------------------------------------------------------------------------------------------------
# ShapesWorld: scene embedder, exact detector, MGG of a competent vs a random model, shapes CLIP
# ---------------------------------------------------------------------------------------------------------
import unicon.worlds.shapes as shapes  # noqa: E402
import unicon.worlds.shapes_text as shapes_text  # noqa: E402

SHAPES_GENEVAL = [
    {"tag": "single_object", "include": [{"class": "circle", "count": 1}], "prompt": "a photo of a circle"},
    {"tag": "single_object", "include": [{"class": "star", "count": 1}], "prompt": "a photo of a star"},
    {"tag": "two_object", "include": [{"class": "square", "count": 1}, {"class": "star", "count": 1}],
     "prompt": "a photo of a square and a star"},
    {"tag": "two_object", "include": [{"class": "cross", "count": 1}, {"class": "diamond", "count": 1}],
     "prompt": "a photo of a cross and a diamond"},
    {"tag": "counting", "include": [{"class": "triangle", "count": 3}], "exclude": [{"class": "triangle", "count": 4}],
     "prompt": "a photo of three triangles"},
    {"tag": "counting", "include": [{"class": "circle", "count": 2}], "exclude": [{"class": "circle", "count": 3}],
     "prompt": "a photo of two circles"},
    {"tag": "colors", "include": [{"class": "diamond", "count": 1, "color": "red"}], "prompt": "a photo of a red diamond"},
    {"tag": "colors", "include": [{"class": "square", "count": 1, "color": "blue"}], "prompt": "a photo of a blue square"},
    {"tag": "position", "include": [{"class": "circle", "count": 1}, {"class": "cross", "count": 1, "position": ["right of", 0]}],
     "prompt": "a photo of a cross right of a circle"},
    {"tag": "position", "include": [{"class": "star", "count": 1}, {"class": "square", "count": 1, "position": ["above", 0]}],
     "prompt": "a photo of a square above a star"},
    {"tag": "color_attr", "include": [{"class": "star", "count": 1, "color": "yellow"}, {"class": "square", "count": 1, "color": "green"}],
     "prompt": "a photo of a yellow star and a green square"},
    {"tag": "color_attr", "include": [{"class": "circle", "count": 1, "color": "purple"}, {"class": "triangle", "count": 1, "color": "orange"}],
     "prompt": "a photo of a purple circle and an orange triangle"},
]


def shapes_model(root, competent: bool) -> FakeModel:
    """``standins.FakeModel`` over the ShapesWorld at ``root``. ``competent=True``: an oracle that renders exactly
    what a caption says and describes what it sees. ``competent=False``: ignores its input (a random scene per
    call, seeded by the input)."""
    if competent:
        return FakeModel(captions="world", draw="world_exact", world=str(root))
    return FakeModel(captions="world_random", draw="world", world=str(root))


@pytest.fixture(scope="module")
def world_cfg():
    return shapes.WorldConfig()


@pytest.fixture(scope="module")
def world_root(world_cfg, tmp_path_factory):
    """A world folder holding only ``world.json`` (what the model doubles read)."""
    root = tmp_path_factory.mktemp("world_cfg")
    (root / "world.json").write_text(json.dumps({"config": world_cfg.to_dict()}))
    return root


def test_scene_embedder_exact_similarity(world_cfg):
    from unicon.embedders.scene import SceneEmbedder

    e = SceneEmbedder(world_cfg)
    scene = shapes.Scene((shapes.ShapeObject("circle", "red", 0, 0), shapes.ShapeObject("square", "blue", 1, 2)))
    img = shapes.render(scene, world_cfg, seed=1)
    t = e.embed_text(["a red circle and a blue square", "a red circle", "a circle", "not a caption at all"])
    i = e.embed_image([img, Image.new("RGB", (64, 64), (1, 2, 3))])
    assert float(t[0] @ i[0]) == pytest.approx(1.0)
    # vectors [kinds | shapes]: "a red circle" = (1 red circle, 1 circle) vs scene (1,1 | 1,1) -> 2/sqrt(2*4)
    assert float(t[1] @ i[0]) == pytest.approx(2 / math.sqrt(8))
    # colourless noun phrase only fills the shape block: 1 / sqrt(1 * 4)
    assert float(t[2] @ i[0]) == pytest.approx(0.5)
    assert float(t[3].norm()) == 0 and float(i[1].norm()) == 0 and e.failures == {"text": 1, "image": 1}


def test_shapes_detector_feeds_geneval_rules(world_cfg, world_root, tmp_path):
    from unicon.evaluation.drift.geneval import ShapesDetector, score_images

    f = tmp_path / "g.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in SHAPES_GENEVAL))
    prompts = load_geneval(f)
    oracle = shapes_model(world_root, competent=True)
    images = oracle.generate_image([p.prompt for p in prompts])
    summary, results = score_images(prompts, images, ShapesDetector(world_cfg))
    assert all(r.correct for r in results), [r.reasons for r in results]
    assert summary["overall"] == 1.0
    # the same images against the wrong prompts fail (rotate by one)
    summary, _ = score_images(prompts, images[1:] + images[:1], ShapesDetector(world_cfg))
    assert summary["overall"] < 0.5
    # a non-ShapesWorld image contains no objects
    _, res = score_images(prompts[:1], [Image.new("RGB", (10, 10))], ShapesDetector(world_cfg))
    assert not res[0].correct


def test_mgg_competent_model_beats_random(world_cfg, world_root, tmp_path):
    """Competent = oracle test double (renders the caption's scene, describes the parsed scene); the trained OFA
    is not used here. Random = ignores its input."""
    from unicon.evaluation.drift.geneval import ShapesDetector

    f = tmp_path / "g.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in SHAPES_GENEVAL))
    seeds = geneval_seeds(f)
    det_ = ShapesDetector(world_cfg)
    reports = {}
    for name, competent in (("oracle", True), ("random", False)):
        model = shapes_model(world_root, competent)
        reports[name] = runner.evaluate_drift(model, tmp_path / name, geneval_seeds=seeds, generations=4,
                                              batch_size=6, detector=det_, strips=0)
    oracle, rand = reports["oracle"], reports["random"]
    assert oracle["mgg"]["per_generation"][1]["overall"] == 1.0
    assert set(oracle["mgg"]["per_generation"]) == {1, 3}
    assert oracle["MGG"] > rand["MGG"] + 0.3
    stored = json.loads((tmp_path / "oracle" / "drift.json").read_text())
    assert stored["MGG"] == pytest.approx(oracle["MGG"])
    assert (tmp_path / "oracle" / "mgg_heatmap.png").is_file()
    m = metrics.drift_metrics(oracle)
    assert m["drift/MGG"] == oracle["MGG"] and "drift/MGG_counting" in m


def test_mcd_end_to_end_with_scene_embedder_and_outputs(world_cfg, world_root, tmp_path):
    from unicon.embedders.scene import SceneEmbedder

    seeds = []
    rng = np.random.default_rng(0)
    model = shapes_model(world_root, competent=False)
    for i in range(4):
        scene = random_scene(world_cfg, rng, max_objects=4)
        p = tmp_path / f"{i}.png"
        shapes.render(scene, world_cfg, seed=0).save(p)
        seeds.append(DriftSeed(id=f"w{i}", caption=shapes_text.describe_scene(scene), image=p, scene=scene.to_dict()))
    emb = {"scene": SceneEmbedder(world_cfg)}
    backend = matplotlib.get_backend()
    rep_oracle = runner.evaluate_drift(shapes_model(world_root, True), tmp_path / "o", seeds=seeds, generations=3,
                                       batch_size=4, embedders=emb, strips=1)
    rep_random = runner.evaluate_drift(model, tmp_path / "r", seeds=seeds, generations=3, batch_size=4,
                                       embedders=emb, strips=1)
    assert matplotlib.get_backend() == backend  # the plots leave the caller's backend alone
    # the oracle preserves the object multiset exactly in every mapping
    assert rep_oracle["MCD"] == pytest.approx({"t2t": 1.0, "t2i": 1.0, "i2i": 1.0, "i2t": 1.0})
    assert rep_random["MCD_avg"] < 0.8
    for f in ("drift.json", "drift_curves.png", "strips.png"):
        assert (tmp_path / "o" / f).is_file()
    # one strip per chain direction of the first seed: its images side by side, its captions by generation
    strips = rep_oracle["strips"]
    assert [(e["chain"], e["id"]) for e in strips] == [("text-first", "w0"), ("image-first", "w0")]
    captions = strips[0]["captions"].splitlines()
    assert len(captions) == 2 and captions[0] == f"g0: {seeds[0].caption}" and captions[1].startswith("g2: ")
    with Image.open(tmp_path / "o" / strips[1]["image"]) as im:
        assert im.size == (2 * (128 + 4), 128)  # image-first, G = 3: images at generations 0 and 2
    report = json.loads((tmp_path / "o" / "drift.json").read_text())
    assert report["image_generation"]["do_sample"] is False and "versions.torch" in report["environment"]
    # which embedder measured, and whether G compares with the paper's 20
    assert report["embedders"]["scene"]["class"] == "SceneEmbedder" and report["embedders"]["scene"]["source"]
    assert report["G"] == {"value": 3, "paper": 20, "comparable_with_paper": False}
    assert set(report["SDR"]) <= set(report["MCD"]) and "SDR_avg" in report


def test_train_shapes_clip_saves_open_clip_checkpoint(world_cfg, tmp_path):
    import open_clip

    from unicon.embedders.clip import ClipEmbedder, train_shapes_clip

    rng = np.random.default_rng(0)
    (tmp_path / "world" / "images").mkdir(parents=True)
    with open(tmp_path / "world" / "mixture_train.jsonl", "w") as f:
        for i in range(24):
            scene = random_scene(world_cfg, rng, max_objects=4)
            shapes.render(scene, world_cfg, seed=i).save(tmp_path / "world" / "images" / f"{i}.png")
            f.write(json.dumps({"id": i, "task": "caption", "image": f"images/{i}.png", "text": None,
                                "target": shapes_text.describe_scene(scene)}) + "\n")
            f.write(json.dumps({"id": 100 + i, "task": "vqa", "image": f"images/{i}.png", "text": "q", "target": "a"}) + "\n")
    tiny = {"embed_dim": 16, "vision_cfg": {"image_size": 64, "patch_size": 16, "width": 32, "layers": 1, "head_width": 16},
            "text_cfg": {"context_length": 32, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1}}
    report = train_shapes_clip(tmp_path / "world", tmp_path / "clip", steps=40, batch_size=24, lr=3e-3, model_cfg=tiny)
    assert report["pairs"] == 24 and report["final_loss"] < report["first_loss"]
    assert (tmp_path / "clip" / "open_clip_config.json").is_file()
    # it is an ordinary open_clip checkpoint
    model, _, _ = open_clip.create_model_and_transforms(f"local-dir:{tmp_path / 'clip'}")
    emb = ClipEmbedder(tmp_path / "clip")
    t = emb.embed_text(["a red circle", "two blue squares"])
    im = emb.embed_image([Image.open(tmp_path / "world" / "images" / "0.png")])
    assert t.shape == (2, 16) and im.shape == (1, 16)
    tok = open_clip.get_tokenizer(f"local-dir:{tmp_path / 'clip'}")(["a red circle"])
    with torch.no_grad():
        ref = model.encode_text(tok, normalize=True)
    assert torch.allclose(ref[0], t[0], atol=1e-5)


def make_world(root: Path, cfg, n: int = 4) -> Path:
    """A minimal on-disk world: world.json, drift_seeds.jsonl, geneval_metadata.jsonl, images."""
    (root / "images").mkdir(parents=True, exist_ok=True)
    (root / "world.json").write_text(json.dumps({"config": cfg.to_dict()}))
    rng = np.random.default_rng(1)
    with open(root / "drift_seeds.jsonl", "w") as f:
        for i in range(n):
            scene = random_scene(cfg, rng, max_objects=4)
            shapes.render(scene, cfg, seed=0).save(root / "images" / f"{i}.png")
            f.write(json.dumps({"id": f"{i:05d}", "image": f"images/{i}.png", "caption": shapes_text.describe_scene(scene),
                                "scene": scene.to_dict()}) + "\n")
    (root / "geneval_metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in SHAPES_GENEVAL))
    return root


def run_config(data_root: Path, **drift):
    """A RunConfig with ``data.root`` and ``eval.drift`` settings, as ``unicon train`` passes it."""
    from omegaconf import OmegaConf

    from unicon.config import RunConfig

    cfg = OmegaConf.structured(RunConfig)
    cfg.data.root = str(data_root)
    for key, value in drift.items():
        cfg.eval.drift[key] = value
    return cfg


def fake_trainer(run_dir: Path, rank: int = 0, loggers=()):
    from types import SimpleNamespace

    return SimpleNamespace(default_root_dir=str(run_dir), current_epoch=0, global_step=7, loggers=list(loggers),
                           sanity_checking=False, is_global_zero=rank == 0,
                           strategy=SimpleNamespace(root_device=torch.device("cpu")))


def test_drift_callback_logs_metrics(world_cfg, tmp_path):
    from unicon.loggers import JsonlLogger

    world = make_world(tmp_path / "world", world_cfg)
    cfg = run_config(world, num_chains=3, generations=2, embedders=["scene", "clip"], clip=str(tmp_path / "no_clip"),
                     batch_size=4, strips=1)
    cb = SuiteCallback.from_config(suite("drift"), cfg)
    logger = JsonlLogger(tmp_path / "run")
    result = cb.evaluate(fake_trainer(tmp_path / "run", loggers=[logger]), shapes_model(world, competent=True))
    # the missing CLIP was skipped (warning), the scene embedder covers all four mappings
    assert result["drift/MCD_avg"] == pytest.approx(1.0)
    assert {f"drift/MCD_{m}" for m in metrics.MAPPINGS} <= set(result)
    assert 0.8 <= result["drift/MGG"] <= 1.0
    out = tmp_path / "run" / "eval" / "drift" / "epoch-1"
    assert (out / "drift.json").is_file() and (out / "mgg" / "text-first" / "gen-1").is_dir()
    table = (tmp_path / "run" / "tables" / "drift_strips.jsonl").read_text().splitlines()
    assert len(table) == 2 and json.loads(table[0])["chain"] == "text-first"


def test_a_missing_default_clip_is_named_once_with_its_consequence_and_its_fix(world_cfg, tmp_path, monkeypatch,
                                                                              caplog):
    """The default CLIP (checkpoints/shapes_clip) is trained separately: a run without it says once
    which MCDs the scene embedder measures instead and which command trains it."""
    world = make_world(tmp_path / "world", world_cfg)
    monkeypatch.chdir(tmp_path)  # no checkpoints/shapes_clip here
    with caplog.at_level("WARNING"):
        cb = SuiteCallback.from_config(suite("drift"), run_config(world, embedders=["scene", "clip"]))
    assert list(cb.inputs.embedders) == ["scene"]
    assert [r.getMessage() for r in caplog.records] == [
        "drift: no CLIP model at the default checkpoints/shapes_clip, so MCD t2t, t2i, i2i, i2t is measured with the "
        "scene embedder instead of CLIP and no drift/clip/* metric is logged; train the world's CLIP (minutes on a "
        f"CPU): python -m unicon.embedders.clip --train-shapes {world} --out checkpoints/shapes_clip"]
    assert "so MCD t2i, i2i, i2t is not measured and" in metrics.without_clip("c", "w", ["text"])  # t2t: text


def test_drift_callback_on_data_that_is_not_a_shapes_world(world_cfg, tmp_path):
    """Real-data training: seeds from a file, no ShapesWorld piece is built, MGG needs the world."""
    world = make_world(tmp_path / "world", world_cfg)
    data = tmp_path / "coco"  # a data root without world.json
    data.mkdir()
    cfg = run_config(data, seeds=str(world / "drift_seeds.jsonl"), num_chains=2, generations=1,
                     embedders=["scene"], geneval=False, strips=0)
    cb = SuiteCallback.from_config(suite("drift"), cfg)
    assert cb.inputs.detector is None and cb.inputs.geneval_seeds == [] and cb.inputs.embedders == {} \
        and len(cb.inputs.seeds) == 2
    cb.evaluate(fake_trainer(tmp_path / "run"), shapes_model(world, competent=True))
    assert (tmp_path / "run" / "eval" / "drift" / "epoch-1" / "mcd" / "image-first" / "gen-1.csv").is_file()
    with pytest.raises(UserError, match=r"eval\.drift\.geneval.*not a ShapesWorld"):
        SuiteCallback.from_config(suite("drift"), run_config(data, seeds=str(world / "drift_seeds.jsonl")))
    with pytest.raises(UserError, match=r"eval\.drift\.seeds: not set"):
        SuiteCallback.from_config(suite("drift"), run_config(data, geneval=False))


def test_a_detector_threshold_for_the_exact_shapes_detector_is_refused(world_cfg, tmp_path):
    """The epoch-end MGG and ``--detector shapes`` score with the exact ShapesWorld detector, which has
    no score threshold: a threshold set for it would be silently without effect, so it is refused."""
    from unicon.evaluation.drift.geneval import load_detector

    world = make_world(tmp_path / "world", world_cfg)
    with pytest.raises(UserError, match=r"eval\.drift\.detector_threshold=0\.5: .*exact.*owlv2"):
        SuiteCallback.from_config(suite("drift"), run_config(world, detector_threshold=0.5))
    with pytest.raises(UserError, match=r"--detector-threshold 0\.5: the 'shapes' detector is exact"):
        load_detector("shapes", world_cfg=world_cfg, threshold=0.5)
    assert load_detector("shapes", world_cfg=world_cfg).describe()["name"] == "shapes"


# ---------------------------------------------------------------------------------------------------------
# DDP: the epoch-end callback on 2 gloo ranks == 1 process
# ---------------------------------------------------------------------------------------------------------
DDP_SETTINGS = dict(num_chains=3, generations=3, embedders=["scene"], batch_size=2, strips=2)  # 3 seeds: padded


def _ddp_drift_rank(rank, world_size, init_file, world_root, run_dir):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        cb = SuiteCallback.from_config(suite("drift"), run_config(Path(world_root), **DDP_SETTINGS))
        result = cb.evaluate(fake_trainer(Path(run_dir), rank), shapes_model(world_root, competent=False))
        Path(run_dir, f"metrics-rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(300)
def test_ddp_two_ranks_match_single_process(world_cfg, tmp_path, fork_safe_threads):
    import torch.multiprocessing as mp

    world = make_world(tmp_path / "world", world_cfg)
    cb = SuiteCallback.from_config(suite("drift"), run_config(world, **DDP_SETTINGS))
    single = cb.evaluate(fake_trainer(tmp_path / "single"), shapes_model(world, competent=False))
    # fork: the children inherit the imported modules and this module's test doubles
    mp.start_processes(_ddp_drift_rank, args=(2, str(tmp_path / "init"), str(world), str(tmp_path / "ddp")),
                       nprocs=2, join=True, start_method="fork")
    for rank in (0, 1):
        assert json.loads((tmp_path / "ddp" / f"metrics-rank{rank}.json").read_text()) == single
    one, two = (tmp_path / d / "eval" / "drift" / "epoch-1" for d in ("single", "ddp"))
    # the whole report: per-chain similarities and GenEval verdicts in seed order, strips, repairs
    assert json.loads((two / "drift.json").read_text()) == json.loads((one / "drift.json").read_text())
    assert tree_bytes(two / "strips") == tree_bytes(one / "strips")
    # each rank ran its share of the seeds (rank 1's second seed is rank 0's first: the padding)
    ids = [json.loads((two / "mcd" / f"rank-{r}" / "run.json").read_text())["ids"] for r in (0, 1)]
    assert ids == [["00000", "00002"], ["00001", "00000"]]
    assert not (one / "mcd" / "rank-0").exists()


def test_cli_and_bench_with_a_model_double(world_cfg, tmp_path, monkeypatch, capsys):
    from unicon.loggers import environment_info
    from unicon.core import weights_fingerprint

    world = make_world(tmp_path / "world", world_cfg)
    monkeypatch.setattr(bench, "_load_model", lambda ckpt: shapes_model(world, competent=True))
    monkeypatch.setattr(cli_common, "load_model_for", lambda args: shapes_model(world, competent=True))
    out = tmp_path / "out"
    rc = suite("drift").cli(["--ckpt", "x", "--world", str(world), "--generations", "2", "--out", str(out),
                            "--embedders", "scene", "--logger", "csv", "--batch-size", "3", "--image-seed", "5"])
    assert rc == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["MCD_avg"] == pytest.approx(1.0) and summary["MGG"] > 0.8 and summary["repairs"] == 0
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert logged[0]["drift/MCD_avg"] == pytest.approx(1.0)
    report = json.loads((out / "drift.json").read_text())
    assert report["image_generation"]["seed"] == 5  # --image-seed overrides the model's setting
    assert report["model_fingerprint"] == weights_fingerprint(shapes_model(world, competent=True))
    assert report["environment"] == environment_info()  # git commit, package versions
    # a second invocation resumes: nothing recomputed
    rc = suite("drift").cli(["--ckpt", "x", "--world", str(world), "--generations", "2", "--out", str(out),
                            "--embedders", "scene", "--batch-size", "3", "--logger", "none", "--image-seed", "5"])
    assert rc == 0
    with pytest.raises(SystemExit):
        suite("drift").cli(["--help"])
    capsys.readouterr()
    rc = bench.bench_cli(["--ckpt", "x", "--world", str(world), "--num-chains", "3", "--generations", "1",
                          "--t2i-base-codes", "2"])
    bench_result = json.loads(capsys.readouterr().out)
    assert rc == 0 and bench_result["batched_batch_size"] == 3 and bench_result["sequential_batch_size"] == 1
    assert bench_result["speedup"] == pytest.approx(bench_result["batched_steps_per_s"]
                                                    / bench_result["sequential_steps_per_s"])


def test_cli_defaults_are_the_epoch_end_settings(tmp_path):
    from unicon.config import DriftEvalConfig
    from unicon.evaluation.cli_common import check_common_args

    args = suite("drift").parser().parse_args(["--ckpt", "x", "--out", str(tmp_path / "y")])
    cfg = DriftEvalConfig()
    assert (args.generations, args.batch_size, args.i2t_prompt, args.clip, args.dino, args.sentence, args.strips,
            args.seeds, args.geneval, args.long) == (cfg.generations, cfg.batch_size, cfg.i2t_prompt, cfg.clip,
                                                     cfg.dino, cfg.sentence, cfg.strips, cfg.seeds,
                                                     cfg.geneval_prompts, cfg.long_prompts)
    assert args.embedders.split(",") == list(cfg.embedders)
    assert args.device is None  # resolved when the command runs (building the parser imports no torch)
    check_common_args(args)
    assert args.device == ("cuda" if torch.cuda.is_available() else "cpu")


def test_clip_color_classifier_crops_boxes_and_averages_templates():
    from unicon.evaluation.drift.geneval import COLORS, ClipColorClassifier, Detection

    rgb = {"red": (255, 0, 0), "blue": (0, 0, 255), "green": (0, 255, 0)}
    seen_texts = []

    class FakeClip:
        def embed_text(self, texts):
            seen_texts.extend(texts)
            rows = [torch.eye(len(COLORS))[next(i for i, c in enumerate(COLORS) if f" {c} " in f" {t.replace('-', ' ')} ")]
                    for t in texts]
            return torch.stack(rows)

        def embed_image(self, crops):
            rows = []
            for im in crops:
                mean = np.asarray(im, dtype=float).reshape(-1, 3).mean(0)
                name = min(rgb, key=lambda c: np.abs(np.array(rgb[c]) - mean).sum())
                rows.append(torch.eye(len(COLORS))[COLORS.index(name)])
            return torch.stack(rows)

    image = Image.new("RGB", (40, 20), rgb["red"])
    image.paste(Image.new("RGB", (20, 20), rgb["blue"]), (20, 0))
    clf = ClipColorClassifier(FakeClip())
    boxes = [Detection((22, 2, 16, 16), "car", 0.9), Detection((0, 0, 18, 20), "car", 0.8)]
    assert clf(image, boxes, "car") == ["blue", "red"]
    assert "a photo of a blue car" in seen_texts and "a photo of a blue-colored car" in seen_texts
    assert "a photo of a blue object" in seen_texts and len(seen_texts) == 3 * len(COLORS)
    clf(image, boxes, "car")
    assert len(seen_texts) == 3 * len(COLORS)  # the per-class head is cached


def test_owlv2_detector_wiring_on_a_tiny_random_model(tmp_path):
    import standins

    from unicon.evaluation.drift.geneval import Owlv2Detector

    standins.owlv2(tmp_path / "owl")  # 1 layer, letter vocabulary, 32x32 input, 8x8 patches
    det_ = Owlv2Detector(str(tmp_path / "owl"))
    out = det_.detect([Image.new("RGB", (40, 30), (200, 10, 10)), Image.new("RGB", (30, 30))], ["cat", "dog"])
    assert [len(o) for o in out] == [16, 16]  # one box per 8x8 patch of the 32x32 input
    for d in out[0]:
        assert d.label in ("cat", "dog") and 0.0 < d.score < 1.0 and d.box[2] >= 0 and d.box[3] >= 0
        assert d.box[0] + d.box[2] <= 40 + 1e-3  # [x, y, w, h] in pixels of the padded 40x40 square
    with pytest.raises(Exception, match="cannot load OWLv2"):
        Owlv2Detector(str(tmp_path / "missing"))


# ---- drift fidelity (detectors, thresholds, SDR, GenEval-R, MPNet) ----------------------
def test_color_crop_masks_like_geneval_and_box_crop_without_mask():
    from unicon.evaluation.drift.geneval import MASK_BACKGROUND, Detection, color_crop

    im = Image.new("RGB", (8, 8), (0, 0, 255))
    im.paste((255, 0, 0), (2, 2, 4, 4))  # a 2x2 red object inside a 4x4 box of blue
    mask = np.zeros((8, 8), dtype=bool)
    mask[2:4, 2:4] = True
    box = (1.0, 1.0, 4.0, 4.0)
    plain = np.asarray(color_crop(im, Detection(box, "apple", 0.9)))
    masked = np.asarray(color_crop(im, Detection(box, "apple", 0.9, mask=mask)))
    assert plain.shape == masked.shape == (4, 4, 3)
    assert (plain[0, 0] == (0, 0, 255)).all() and (masked[0, 0] == MASK_BACKGROUND).all()
    assert (masked[1:3, 1:3] == (255, 0, 0)).all() and (plain[1:3, 1:3] == (255, 0, 0)).all()
    with pytest.raises(ValueError, match="mask"):
        color_crop(im, Detection(box, "apple", 0.9, mask=np.ones((4, 4), dtype=bool)))


def test_detector_threshold_is_applied_and_recorded(tmp_path):
    from standins import owlv2

    from unicon.evaluation.drift.geneval import OWLV2_THRESHOLD, check_detector_spec, load_detector, score_images

    path = owlv2(tmp_path / "owl")
    det = load_detector(f"owlv2:{path}", color_classifier=lambda im, boxes, c: ["red"] * len(boxes))
    d = det.describe()
    assert (d["name"], d["threshold"], d["source"], d["color"]) == ("owlv2", OWLV2_THRESHOLD, str(path),
                                                                    "in the OWLv2 query")
    assert d["protocol"] == "telephone-game" and d["counting_threshold"] == OWLV2_THRESHOLD
    assert load_detector(f"owlv2:{path}", threshold=0.5).describe()["threshold"] == 0.5
    prompt = parse_row({"tag": "single_object", "include": [{"class": "apple", "count": 1}], "prompt": "an apple"},
                       "x", 1)
    images = [Image.new("RGB", (32, 32), (200, 30, 30))]
    scores = [dt.score for dt in det.detect(images, ["apple"])[0]]
    # the kept set follows the detector's threshold: with it at the best score nothing is kept
    det.threshold = max(scores)
    assert score_images([prompt], images, det)[0]["overall"] == 0.0
    det.threshold = min(scores) - 1e-6
    assert score_images([prompt], images, det)[0]["overall"] == 1.0
    with pytest.raises(UserError, match="mask2former"):
        check_detector_spec("yolo:/x")


def test_mask2former_detections_carry_masks_and_coco_labels(tmp_path):
    from transformers import (Mask2FormerConfig, Mask2FormerForUniversalSegmentation, Mask2FormerImageProcessor,
                              SwinConfig)

    from unicon.evaluation.drift.geneval import THRESHOLD, load_detector

    backbone = SwinConfig(image_size=64, patch_size=4, embed_dim=16, depths=[1, 1, 1, 1], num_heads=[1, 1, 1, 1],
                          window_size=2, out_features=["stage1", "stage2", "stage3", "stage4"])
    cfg = Mask2FormerConfig(backbone_config=backbone, hidden_dim=32, mask_feature_size=32, feature_size=32,
                            encoder_feedforward_dim=32, dim_feedforward=32, encoder_layers=1, decoder_layers=2,
                            num_attention_heads=2, num_queries=4, common_stride=4, use_pretrained_backbone=False,
                            id2label={0: "apple", 1: "dog"}, label2id={"apple": 0, "dog": 1})
    torch.manual_seed(0)
    Mask2FormerForUniversalSegmentation(cfg).eval().save_pretrained(tmp_path / "m2f")
    Mask2FormerImageProcessor(size={"height": 64, "width": 64}, do_resize=True).save_pretrained(tmp_path / "m2f")
    det = load_detector(f"mask2former:{tmp_path / 'm2f'}", color_classifier=lambda im, b, c: ["red"] * len(b))
    assert det.describe()["threshold"] == THRESHOLD and det.describe()["color"] == "CLIP on masked crops"
    out = det.detect([Image.new("RGB", (40, 24), (10, 200, 10))], ["apple", "dog"])
    assert len(out) == 1
    for d in out[0]:
        assert d.label in ("apple", "dog") and d.mask.shape == (24, 40) and d.mask.any()
        ys, xs = np.nonzero(d.mask)
        assert d.box == (xs.min(), ys.min(), xs.max() - xs.min() + 1, ys.max() - ys.min() + 1)
    assert all(d.label == "dog" for d in det.detect([Image.new("RGB", (40, 24))], ["dog"])[0])


def test_sdr_per_mapping_and_the_reference_average():
    gens = 10
    sims = []
    for d in range(3):
        chain = {"t2t": [0.9 * math.exp(-0.5 * g) + 0.05 * d for g in metrics.mapping_generations("t2t", gens)],
                 "t2i": [0.8 * math.exp(-0.2 * g) for g in metrics.mapping_generations("t2i", gens)]}
        sims.append({"text": {"t2t": chain["t2t"]}, "clip": {"t2i": chain["t2i"]}})
    out = metrics.mcd(sims, gens)
    assert out["SDR"]["t2t"] == pytest.approx(0.5, rel=1e-3) and out["SDR"]["t2i"] == pytest.approx(0.2, rel=1e-3)
    assert out["SDR_avg"] == pytest.approx((out["SDR"]["t2t"] + out["SDR"]["t2i"]) / 2)
    # the reference's printed "SDR": the mean of the fitted (a, b, c) triples over the mappings
    fits = [out["decay"][m] for m in ("t2t", "t2i")]
    assert out["SDR_abc"]["t2i"] == {k: fits[1][k] for k in "abc"}
    assert out["SDR_abc_mean"] == pytest.approx({k: (fits[0][k] + fits[1][k]) / 2 for k in "abc"})
    assert out["SDR_abc_mean"]["b"] == pytest.approx(out["SDR_avg"])
    short = metrics.mcd([{"text": {"t2t": [0.5]}}], 2)  # one point: no fit, no SDR
    assert short["SDR"] == {} and short["SDR_avg"] is None and short["SDR_abc_mean"] is None
    assert "t2t: needs >= 3 generations, got 1" in short["SDR_avg_reason"]


def reference_fit(x, y):
    """An independent recomputation of the reference code's SDR fit (semantic-drift/mcd-sdr.py):
    ``a exp(-b x) + c`` by scipy ``curve_fit`` from p0 = (1, 0.1, 0), maxfev 5000, no bounds."""
    import warnings

    from scipy.optimize import curve_fit

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the reference only prints scipy's covariance warning
        params, _ = curve_fit(lambda t, a, b, c: a * np.exp(-b * t) + c, np.asarray(x, float), np.asarray(y, float),
                              p0=(1, 0.1, 0), maxfev=5000)
    return params


@pytest.mark.parametrize("mapping", ["t2t", "t2i"])
@pytest.mark.parametrize("abc", [(0.4, 0.3, 0.5), (0.25, 0.08, 0.6), (0.3, 0.9, 0.2), (-0.2, 0.15, 0.9)])
def test_decay_fit_is_the_reference_fit(mapping, abc):
    a, b, c = abc  # the last one rises with g: the fit keeps its sign (no bound on a or b)
    x = metrics.mapping_generations(mapping, 20)  # the reference's generations: 2..20 even / 1..19 odd
    rng = np.random.default_rng(int(100 * b))
    y = a * np.exp(-b * np.asarray(x, float)) + c
    fit = metrics.fit_decay(x, y)
    assert (fit["a"], fit["b"], fit["c"]) == pytest.approx(abc, rel=1e-4, abs=1e-6)
    noisy = y + rng.normal(0, 0.01, len(x))
    fit = metrics.fit_decay(x, noisy)
    assert (fit["a"], fit["b"], fit["c"]) == pytest.approx(tuple(reference_fit(x, noisy)), rel=1e-6, abs=1e-9)


def test_decay_fit_has_no_bound_on_b_and_keeps_three_point_fits():
    # a similarity that grows with g: the reference's unbounded fit gives b < 0
    x = metrics.mapping_generations("t2i", 20)
    y = 0.2 * np.exp(0.1 * np.asarray(x, float))
    fit = metrics.fit_decay(x, y)
    assert (fit["a"], fit["b"], fit["c"]) == pytest.approx((0.2, -0.1, 0.0), rel=1e-6, abs=1e-6)
    # a nearly linear rise sends the fit from (1, 0.1, 0) to a large a and c of opposite signs, as the reference's
    y = 0.01 * np.exp(0.1 * np.asarray(x, float)) + 0.5
    fit = metrics.fit_decay(x, y)
    assert (fit["a"], fit["b"], fit["c"]) == pytest.approx(tuple(reference_fit(x, y)), rel=1e-6)
    # three points (G = 6): an exact fit whose covariance scipy cannot estimate is kept, with a warning
    y3 = [0.9 * math.exp(-0.4 * g) + 0.3 for g in (2, 4, 6)]
    fit = metrics.fit_decay([2, 4, 6], y3)
    assert "error" not in fit
    assert (fit["a"], fit["b"], fit["c"]) == pytest.approx(tuple(reference_fit([2, 4, 6], y3)), rel=1e-6)


class HashEmbedder(Embedder):
    """A joint embedder whose vectors are drawn from sha256 of the caption / the image bytes."""

    name = "hash"
    modalities = frozenset({"text", "image"})
    joint = True

    def _v(self, data: bytes):
        import hashlib

        seed = int.from_bytes(hashlib.sha256(data).digest()[:4], "little")
        v = torch.from_numpy(np.random.default_rng(seed).normal(size=8)).float()
        return v / v.norm()

    def embed_text(self, texts):
        return torch.stack([self._v(t.encode()) for t in texts])

    def embed_image(self, images):
        return torch.stack([self._v(im.tobytes()) for im in images])


def test_drift_json_is_strict_json_when_sdr_cannot_be_fitted(tmp_path):
    from unicon.jsonsafe import loads_strict

    report = runner.evaluate_drift(chain_model(), tmp_path / "o", seeds=make_seeds(tmp_path, 8), generations=4,
                                   batch_size=4, embedders={"hash": HashEmbedder()}, strips=0)
    assert report["SDR"] == {} and report["SDR_avg"] is None  # 2 points per mapping: no fit
    text = (tmp_path / "o" / "drift.json").read_text()
    stored = loads_strict(text)  # raises on a bare NaN / Infinity
    assert "NaN" not in text and stored["SDR_avg"] is None and stored["SDR_abc_mean"] is None
    assert "needs >= 3 generations" in stored["SDR_avg_reason"]
    assert stored["MCD_avg"] == pytest.approx(report["MCD_avg"])
    assert "drift/SDR_avg" not in metrics.drift_metrics(stored) and "drift/MCD_avg" in metrics.drift_metrics(stored)
    for f in (tmp_path / "o").rglob("*.json"):
        loads_strict(f.read_text())


def test_strict_json_writer_replaces_non_finite_values_with_reasons():
    from unicon import jsonsafe

    text = jsonsafe.dumps({"MGG": float("nan"), "SDR_avg": None, "SDR_avg_reason": "given",
                           "S": {1: np.float32("inf"), 2: 0.5}, "x": [float("-inf"), np.int64(3)]})
    out = jsonsafe.loads_strict(text)
    assert out == {"MGG": None, "MGG_reason": "non-finite value (nan)", "SDR_avg": None, "SDR_avg_reason": "given",
                   "S": {"1": None, "2": 0.5}, "x": [None, 3]}
    with pytest.raises(ValueError, match="NaN"):
        jsonsafe.loads_strict('{"a": NaN}')


def test_geneval_r_is_the_default_outside_shapesworld(tmp_path, monkeypatch):
    from unicon.data.geneval import geneval_r_path

    monkeypatch.setenv("UNICON_SHARED_DIR", str(tmp_path))
    with pytest.raises(UserError, match="geneval_prompt_blip3o_rewritten.jsonl"):
        geneval_r_path()
    (tmp_path / "data" / "geneval").mkdir(parents=True)
    row = {"tag": "single_object", "include": [{"class": "bench", "count": 1}], "prompt": "a photo of a bench",
           "detailed_caption": "A long rewrite of a wooden bench.", "index": "00000"}
    (tmp_path / "data" / "geneval" / "geneval_prompt_blip3o_rewritten.jsonl").write_text(json.dumps(row) + "\n")
    assert geneval_r_path() == tmp_path / "data" / "geneval" / "geneval_prompt_blip3o_rewritten.jsonl"
    # the CLI without a world reaches the GenEval-R default (and then needs a model detector)
    seeds = tmp_path / "seeds.jsonl"
    Image.new("RGB", (8, 8)).save(tmp_path / "s0.png")
    seeds.write_text(json.dumps({"id": "s0", "caption": "a bench", "image": str(tmp_path / "s0.png")}) + "\n")
    with pytest.raises(UserError, match="'shapes' detector needs the ShapesWorld"):
        suite("drift").cli(["--ckpt", str(tmp_path / "none"), "--out", str(tmp_path / "o"), "--world",
                           str(tmp_path / "noworld"), "--seeds", str(seeds), "--embedders", ""])


def test_mpnet_sentence_embedder_from_a_local_directory(tmp_path):
    from sentence_transformers import SentenceTransformer, models
    from transformers import MPNetConfig, MPNetModel, MPNetTokenizerFast

    from unicon.embedders.factory import load_embedders

    words = ["[PAD]", "[UNK]", "<s>", "</s>", "<mask>", "a", "red", "blue", "circle", "square"]
    tok = MPNetTokenizerFast(vocab={w: i for i, w in enumerate(words)}, pad_token="[PAD]", unk_token="[UNK]")
    torch.manual_seed(0)
    MPNetModel(MPNetConfig(vocab_size=len(words), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                           intermediate_size=32, max_position_embeddings=40)).save_pretrained(tmp_path / "hf")
    tok.save_pretrained(tmp_path / "hf")
    word = models.Transformer(str(tmp_path / "hf"), max_seq_length=16)
    SentenceTransformer(modules=[word, models.Pooling(16, "mean")]).save(str(tmp_path / "mpnet"))
    emb = load_embedders(["text"], sentence=str(tmp_path / "mpnet"))["text"]
    v = emb.embed_text(["a red circle", "a blue square", "a red circle"])
    assert v.shape == (3, 16) and torch.allclose(v.norm(dim=-1), torch.ones(3), atol=float32_tol(16))
    assert torch.allclose(v[0], v[2], atol=float32_tol(16)) and not torch.allclose(v[0], v[1], atol=1e-3)
    assert emb.describe() == {"class": "SentenceEmbedder", "source": str(tmp_path / "mpnet")}


# ---- MGG with OWLv2: the Telephone-Game reference protocol (semantic-drift/mgg.py) ------------------------
def test_reference_queries_put_the_colour_in_the_query():
    from unicon.evaluation.drift.geneval import reference_queries

    p = row("color_attr", [{"class": "car", "count": 1, "color": "red"}, {"class": "bench", "count": 1}])
    assert reference_queries(p) == ["a photo of a red car", "a photo of a bench"]


def test_reference_threshold_is_0_1_for_every_prompt_type_counting_included():
    from unicon.evaluation.drift.geneval import evaluate_reference

    p = row("counting", [{"class": "clock", "count": 2}], [{"class": "clock", "count": 3}])
    low = [det("clock", [0, 0, 5, 5], 0.2), det("clock", [10, 0, 5, 5], 0.15)]
    assert evaluate_reference(p, low).correct  # GenEval's rules want 0.9 for counting
    assert not evaluate_detections(p, low).correct
    # a third clock above 0.1 triggers the exclusion; one at exactly 0.1 is not kept (> 0.1)
    assert not evaluate_reference(p, low + [det("clock", [20, 0, 5, 5], 0.11)]).correct
    assert evaluate_reference(p, low + [det("clock", [20, 0, 5, 5], 0.1)]).correct
    # include uses every kept box, not the top count: no colour check (the colour was in the query)
    c = row("colors", [{"class": "car", "count": 1, "color": "pink"}])
    assert evaluate_reference(c, [det("car", [0, 0, 9, 9], 0.3)]).correct
    assert not evaluate_reference(c, [det("car", [0, 0, 9, 9], 0.05)]).correct


def test_pixel_relative_position_by_hand():
    from unicon.evaluation.drift.geneval import pixel_relative_position

    # offset (10, 6), margins 2 -> (8, 4) pixels: right of and below (GenEval's normalised rule: right of only)
    assert pixel_relative_position([10, 6, 10, 10], [0, 0, 10, 10]) == {"right of", "below"}
    assert relative_position([10, 6, 10, 10], [0, 0, 10, 10]) == {"right of"}
    # margin-reduced offset of 0.4 px: no relation; of 0.6 px: a relation (half a pixel, not normalised)
    assert pixel_relative_position([2.4, 0, 10, 10], [0, 0, 10, 10]) == set()
    assert pixel_relative_position([2.6, 0, 10, 10], [0, 0, 10, 10]) == {"right of"}
    assert pixel_relative_position([0, 0, 10, 10], [0, 30, 10, 10]) == {"above"}


def test_reference_position_needs_one_target_per_box():
    from unicon.evaluation.drift.geneval import evaluate_reference

    p = row("position", [{"class": "teddy bear", "count": 1},
                         {"class": "dog", "count": 1, "position": ["right of", 0]}])
    bears = [det("teddy bear", [0, 0, 10, 10], 0.2), det("teddy bear", [100, 0, 10, 10], 0.3)]
    dog = det("dog", [50, 0, 10, 10], 0.2)
    # the dog is right of one bear and left of the other: enough for the reference (any target, every box);
    # GenEval checks the top-1 bear only, the right one
    assert evaluate_reference(p, bears + [dog]).correct
    assert not evaluate_detections(p, [dict(b, score=b["score"] + 0.6) for b in bears] + [dict(dog, score=0.95)]).correct
    # every dog box must have such a target
    assert not evaluate_reference(p, bears[1:] + [dog]).correct
    res = evaluate_reference(p, [dog])
    assert not res.correct and any("no target" in r for r in res.reasons)


def test_score_images_runs_the_reference_protocol_with_a_stub_detector():
    from unicon.evaluation.drift.geneval import Detector, Detection, reference_queries, score_images

    class Stub(Detector):
        name, protocol, threshold = "stub", "telephone-game", 0.1

        def __init__(self):
            self.queries = []

        def detect(self, images, class_names):
            raise AssertionError("the reference protocol queries each prompt's own clauses")

        def detect_prompts(self, images, prompts):
            self.queries += [reference_queries(p) for p in prompts]
            return [[Detection((0, 0, 4, 4), "cat", 0.12), Detection((9, 0, 4, 4), "dog", 0.5)] for _ in images]

    prompts = [row("counting", [{"class": "cat", "count": 1}], [{"class": "cat", "count": 2}]),
               row("colors", [{"class": "dog", "count": 1, "color": "blue"}]),
               row("position", [{"class": "cat", "count": 1}, {"class": "dog", "count": 1, "position": ["left of", 0]}])]
    stub = Stub()
    summary, results = score_images(prompts, [Image.new("RGB", (16, 16))] * 3, stub, batch_size=2)
    assert stub.queries == [["a photo of a cat"], ["a photo of a blue dog"], ["a photo of a cat", "a photo of a dog"]]
    assert [r.correct for r in results] == [True, True, False]  # the dog is right of the cat
    assert summary["tasks"] == {"counting": 1.0, "colors": 1.0, "position": 0.0}
    assert stub.describe()["counting_threshold"] == 0.1 and stub.describe()["color"] == "in the OWLv2 query"


def test_owlv2_reference_protocol_labels_boxes_by_clause_on_a_tiny_random_model(tmp_path):
    import standins

    from unicon.evaluation.drift.geneval import Owlv2Detector

    standins.owlv2(tmp_path / "owl")
    det_ = Owlv2Detector(str(tmp_path / "owl"), color_classifier=lambda im, b, c: ["red"] * len(b))
    assert det_.protocol == "telephone-game" and det_.color_classifier is None
    prompts = [row("color_attr", [{"class": "cat", "count": 1, "color": "red"}, {"class": "dog", "count": 1}]),
               row("single_object", [{"class": "dog", "count": 1}])]
    out = det_.detect_prompts([Image.new("RGB", (32, 32), (200, 10, 10)), Image.new("RGB", (30, 20))], prompts)
    assert [len(o) for o in out] == [16, 16]
    assert {d.label for d in out[0]} <= {"cat", "dog"} and {d.label for d in out[1]} == {"dog"}
    geneval = Owlv2Detector(str(tmp_path / "owl"), protocol="geneval")
    assert geneval.describe()["counting_threshold"] == 0.9 and geneval.describe()["protocol"] == "geneval"
