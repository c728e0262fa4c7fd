"""BagelScore alignment: the paper's prompt, both modes, the loaders, Kendall τ, the ShapesWorld set with
exact ratings, the builder's byte-identity, and ``unicon evaluate alignment`` end to end (shards, merge)."""

from __future__ import annotations

import filecmp
import json
import math
import re
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image

import standins
from unicon.cli import main as unicon_main
from unicon.errors import UserError
from unicon.evaluation.alignment import prompts
from unicon.evaluation.alignment.bagelscore import decode_scores, expected_scores
from unicon.evaluation.alignment.data import load_pairs, read_image
from unicon.evaluation.alignment.metrics import clip_scores, summarize
from unicon.evaluation.correlation import kendall

REPO = Path(__file__).resolve().parents[1]
EPS64 = torch.finfo(torch.float64).eps
TINY_WORLD = ["--num-train", "12", "--num-val", "4", "--num-test", "4", "--quiet", "--overwrite", "--num-ureason", "2",
              "--geneval-per-tag", "2", "--num-drift-seeds", "2", "--num-reason-train", "0",
              *standins.SMALL_INSTRUCT]


# ---------------------------------------------------------------------------------------------
# the prompt and the decode grammar
# ---------------------------------------------------------------------------------------------
def test_prompt_is_the_papers(shared_dir):
    paper = shared_dir / "papers" / "bagelscore-editingscore.txt"
    if not paper.is_file():
        pytest.skip(f"needs the BagelScore paper text {paper}")
    m = re.search(r"Flickr8K-CF Prompt\n(.*?)\n\n3\.2 IMAGE EDITING", paper.read_text(), re.S)
    assert m, "the prompt section was not found in the paper text"
    words = " ".join(m.group(1).split())
    assert " ".join(prompts.BAGELSCORE_PROMPT.replace("{caption}", "caption").split()) == words
    assert prompts.bagelscore_prompt(" a red circle ").startswith(
        'Analyze how accurately this image matches the caption: "a red circle"\n')
    assert prompts.VALUES == (0.0, 0.3, 0.6, 1.0) and prompts.ANSWERS == ("0", "0.3", "0.6", "1.0")


@pytest.mark.parametrize("reply, value", [
    ("0", 0.0), ("0.0", 0.0), (" 0.3 ", 0.3), (".3", 0.3), ("0.30", 0.3), ("0.6.", 0.6), ("1", 1.0), ("1.0", 1.0),
    ("1.", 1.0), ("0.5", None), ("0.6 (good)", None), ("Good match", None), ("", None), (None, None),
    ("1.0/1.0", None), ("-0.3", None), ("rating: 0.6", None), ("0.6\n0.3", None), ("10", None),
])
def test_decode_grammar_is_strict(reply, value):
    assert prompts.parse_rating(reply) == value


# ---------------------------------------------------------------------------------------------
# the two modes
# ---------------------------------------------------------------------------------------------
def _images(n: int) -> list[Image.Image]:
    return [Image.new("RGB", (8 + i, 8), (30 * i, 100, 200 - 20 * i)) for i in range(n)]


def test_expected_mode_is_the_softmax_over_the_four_answers():
    model = standins.FakeModel(scale=0.37)
    images, captions = _images(3), ["a red circle", "two blue squares", "no green stars"]
    results = expected_scores(model, images, captions)
    assert model.calls == [("score_text", 3)]  # one call per batch, K = 4 candidates per row
    by_hand = model.score_text(images, [prompts.bagelscore_prompt(c) for c in captions],
                               [list(prompts.ANSWERS)] * 3)
    for r, row in zip(results, by_hand.sum_nll.tolist()):
        weights = [math.exp(-(s - min(row))) for s in row]  # softmax(-sum_nll), shifted
        p = [w / sum(weights) for w in weights]
        assert r.probs == pytest.approx(p, abs=8 * EPS64)
        assert r.score == pytest.approx(sum(pk * v for pk, v in zip(p, prompts.VALUES)), abs=8 * EPS64)
        assert 0.0 <= r.score <= 1.0


class Replies:
    """A model whose ``answer`` replies are given (the only method decode calls)."""

    def __init__(self, replies):
        self.replies, self.calls = list(replies), []

    def answer(self, images, questions, **kw):
        self.calls.append(len(questions))
        assert all(q.startswith("Analyze how accurately") for q in questions)
        return self.replies[: len(questions)]


def test_decode_mode_parses_strictly_and_counts_failures():
    model = Replies(["0.6", "Good match", "1.0.", "0.5"])
    results = decode_scores(model, _images(4), ["a", "b", "c", "d"])
    assert model.calls == [4]
    assert [r.score for r in results] == [0.6, None, 1.0, None]
    assert [r.reply for r in results] == model.replies
    records = [{"rating": rt, "scores": {"bagelscore_decode": r.score}} for rt, r in zip((2.0, 1.0, 4.0, 3.0), results)]
    s = summarize(records, ["bagelscore_decode"])["bagelscore_decode"]
    assert s["n"] == 2 and s["failures"] == 2 and s["failure_rate"] == 0.5


def test_kendall_and_clip_scores():
    from scipy.stats import kendalltau

    scores, ratings = [0.1, None, 0.3, 0.3, 0.9, float("nan")], [1, 2, 2, 3, 4, 4]
    k = kendall(scores, ratings)
    assert k["n"] == 4 and k["missing"] == 2
    assert k["tau_b"] == kendalltau([0.1, 0.3, 0.3, 0.9], [1, 2, 3, 4], variant="b").statistic
    assert k["tau_c"] == kendalltau([0.1, 0.3, 0.3, 0.9], [1, 2, 3, 4], variant="c").statistic
    assert kendall([1.0], [2.0])["tau_b"] is None
    img = torch.nn.functional.normalize(torch.tensor([[1.0, 0.0], [0.0, 1.0]]), dim=-1)
    cap = torch.nn.functional.normalize(torch.tensor([[1.0, 1.0], [1.0, -1.0]]), dim=-1)
    refs = [torch.nn.functional.normalize(torch.tensor([[1.0, 0.2]]), dim=-1), None]
    clip_s, ref_s = clip_scores(img, cap, refs)
    c0 = 2.5 * math.sqrt(0.5)
    r0 = float(refs[0][0].double() @ cap[0].double())
    assert clip_s == pytest.approx([c0, 0.0], abs=16 * torch.finfo(torch.float32).eps)
    assert ref_s[0] == pytest.approx(2 * c0 * r0 / (c0 + r0), abs=16 * torch.finfo(torch.float32).eps)
    assert ref_s[1] is None


# ---------------------------------------------------------------------------------------------
# loaders
# ---------------------------------------------------------------------------------------------
def _png(path: Path) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (8, 8), (10, 20, 30)).save(path)
    return path.name


def test_flickr8k_layout(tmp_path):
    images = tmp_path / "imgs"
    _png(images / "a.jpg")
    _png(images / "b.jpg")
    data = {
        "k1": {"image_path": "flickr8k/a.jpg", "ground_truth": ["A dog runs .", "a dog runs", "Two dogs play"],
               "human_judgement": [{"caption": "A dog runs .", "rating": 4.0, "image_path": "flickr8k/a.jpg"},
                                   {"caption": "a cat", "rating": float("nan")},
                                   {"caption": "a bird", "rating": 7}]},
        "k2": {"image_path": "b.jpg", "ground_truth": ["a tree"],
               "human_judgement": [{"caption": "a tree", "rating": 1}, {"caption": "a car"},
                                   {"caption": "a bus", "rating": "3"}]},
    }
    f = tmp_path / "flickr8k.json"
    f.write_text(json.dumps(data))  # NaN is written as NaN, as json.dumps does
    pairs, skipped = load_pairs(f, images, rating_min=1, rating_max=4)
    assert [(p.id, p.caption, p.rating) for p in pairs] == [("k1/0", "A dog runs .", 4.0), ("k2/0", "a tree", 1.0)]
    assert pairs[0].references == ["a dog runs", "Two dogs play"]  # the candidate's own copy is left out
    assert pairs[1].references == [] and pairs[0].image_path == images / "a.jpg"
    assert dict(skipped) == {"rating_nan": 1, "rating_out_of_range": 1, "rating_missing": 1, "rating_not_a_number": 1}
    data["k2"]["human_judgement"][0]["image_path"] = "missing.jpg"
    f.write_text(json.dumps(data))
    with pytest.raises(UserError, match=r"flickr8k\.json:k2\[0\]: image file not found: .*missing\.jpg"):
        load_pairs(f, images)


def test_jsonl_layout_and_bad_rows(tmp_path):
    _png(tmp_path / "im" / "x.png")
    (tmp_path / "im" / "bad.png").write_bytes(b"not a png")
    rows = [{"image": "im/x.png", "caption": "a red circle", "rating": 3, "references": ["a red circle"]},
            {"image": "im/x.png", "caption": "two stars", "rating": None},
            {"image": "im/bad.png", "caption": "a cross", "rating": 2.5, "id": "b"}]
    f = tmp_path / "pairs.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    pairs, skipped = load_pairs(f)
    assert [p.id for p in pairs] == ["1", "b"] and dict(skipped) == {"rating_missing": 1}
    assert read_image(pairs[0]).size == (8, 8)
    with pytest.raises(UserError, match=r"pairs\.jsonl:3: cannot read image .*bad\.png"):
        read_image(pairs[1])
    f.write_text(json.dumps({"image": "im/x.png", "rating": 1}) + "\n")
    with pytest.raises(UserError, match=r"pairs\.jsonl:1: missing 'caption'"):
        load_pairs(f)
    f.write_text(json.dumps({"image": "im/none.png", "caption": "c", "rating": 1}) + "\n")
    with pytest.raises(UserError, match=r"pairs\.jsonl:1: image file not found: .*none\.png"):
        load_pairs(f)
    f.write_text(json.dumps({"image": "im/x.png", "caption": "c", "rating": float("inf")}) + "\n")
    with pytest.raises(UserError, match=r"no pair with a valid rating .*rating_nan"):
        load_pairs(f)
    with pytest.raises(UserError, match="does not exist"):
        load_pairs(tmp_path / "nope.jsonl")


# ---------------------------------------------------------------------------------------------
# the ShapesWorld set
# ---------------------------------------------------------------------------------------------
def _recompute(caption: str, scene, cfg) -> float:
    """The rating from the caption text and the scene parsed from the image, by the world's own parts."""
    from unicon.worlds.shapes import relation_holds
    from unicon.worlds.shapes_text import parse_caption, plural

    t = caption
    for p in ("there is ", "there are ", "a photo of ", "an image of "):
        if t.startswith(p):
            t = t[len(p):]
            break
    singular = {plural(s): s for s in cfg.shapes}
    truths, named = [], 0
    for part in re.split(r" , | and ", t.replace(",", " , ")):
        part = part.strip(" ,")
        if part.startswith("no "):
            *color, noun = part.split()[1:]
            truths.append(scene.count(color=color[0] if color else None, shape=singular[noun]) == 0)
            continue
        clause = parse_caption(part, cfg).clauses[0]
        named += sum(n.count for n in clause.noun_phrases())
        if clause.relation is None:
            truths.append(sum(clause.subject.matches(o) for o in scene.objects) == clause.subject.count)
        else:
            truths.append(any(a is not b and relation_holds(a, clause.relation, b) for a in scene.objects
                              if clause.subject.matches(a) for b in scene.objects if clause.object.matches(b)))
    truths.append(named == len(scene))
    return 1 + 3 * sum(truths) / len(truths)


def test_shapes_alignment_ratings_are_exact(tiny_shapes_world, tmp_path):
    from unicon.worlds.shapes import load_world, parse
    from unicon.worlds.shapes_alignment import ERROR_KINDS, write_alignment_set
    from unicon.worlds.shapes_text import caption_matches

    world = load_world(tiny_shapes_world)
    rows = [json.loads(x) for x in (tiny_shapes_world / "alignment" / "pairs.jsonl").read_text().splitlines()]
    assert len(rows) == 200  # the builder's default
    seen = set()
    for r in rows:
        scene = parse(world.image(r["image"]), world.config)  # the exact parser: the scene the image shows
        assert r["rating"] == _recompute(r["caption"], scene, world.config), r
        assert 1.0 <= r["rating"] <= 4.0 and r["caption"] not in r["references"]
        assert (r["errors"] == []) <= (r["rating"] == 4.0)
        if not re.search(r"(^|, | and | of )no ", r["caption"]):
            assert (r["rating"] == 4.0) == caption_matches(r["caption"], scene, world.config), r
        assert all(caption_matches(ref, scene, world.config) for ref in r["references"])
        seen.update(r["errors"])
    assert seen == set(ERROR_KINDS)
    assert len({r["rating"] for r in rows}) >= 4
    again = write_alignment_set(tiny_shapes_world, tmp_path / "again", n=20, seed=0)
    assert again.read_text().splitlines() == [json.dumps(r) for r in rows[:20]]  # a prefix, from the same RNG


def test_alignment_files_leave_a_default_build_unchanged(tiny_shapes_world, tmp_path):
    sys.path.insert(0, str(REPO))
    from data_builders.shapes import main as build_shapes

    build_shapes(["--out", str(tmp_path / "none"), *TINY_WORLD, "--alignment-pairs", "0"])
    default = {p.relative_to(tiny_shapes_world) for p in tiny_shapes_world.rglob("*") if p.is_file()}
    none = {p.relative_to(tmp_path / "none") for p in (tmp_path / "none").rglob("*") if p.is_file()}
    assert Path("alignment/pairs.jsonl") in default - none and none <= default
    different = [str(p) for p in none if not filecmp.cmp(tmp_path / "none" / p, tiny_shapes_world / p, shallow=False)]
    assert different == ["world.json"]  # the non-default option is recorded there, nothing else differs
    info = json.loads((tmp_path / "none" / "world.json").read_text())
    assert info["build"]["alignment_pairs"] == 0 and info["alignment_rows"] == 0
    default_info = json.loads((tiny_shapes_world / "world.json").read_text())
    assert "alignment_pairs" not in default_info["build"] and "alignment_rows" not in default_info
    info["build"].pop("alignment_pairs")
    info.pop("alignment_rows")
    assert info == default_info


# ---------------------------------------------------------------------------------------------
# the command end to end
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_clip(tiny_shapes_world, tmp_path_factory) -> Path:
    return standins.tiny_clip(tiny_shapes_world, tmp_path_factory.mktemp("clip"))


def test_cli_scores_taus_and_merges_shards(tiny_shapes_world, tiny_clip, tmp_path, capsys, monkeypatch):
    """Without java (patched away here, which also keeps the test fast): METEOR is skipped with the
    reason, the other reference metrics tokenise in Python."""
    import shutil

    from scipy.stats import kendalltau

    from unicon.core import weights_fingerprint

    which = shutil.which
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None if name == "java" else which(name, *a, **k))

    model = standins.FakeModel(scale=0.5, answers=["0.6", "maybe", "1.0", "0.3", "0"])
    ckpt = tmp_path / "ckpt"
    model.save_pretrained(str(ckpt))
    common = ["evaluate", "alignment", "--ckpt", str(ckpt), "--data", str(tiny_shapes_world), "--device", "cpu",
              "--logger", "none", "--limit", "24", "--batch-size", "5", "--clip", str(tiny_clip),
              "--baselines", "clip_s,refclip_s,bleu4,meteor,cider"]
    assert unicon_main([*common, "--logger", "csv", "--out", str(tmp_path / "one")]) == 0  # the last --logger wins
    printed = capsys.readouterr().out
    table = [json.loads(x) for x in (tmp_path / "one" / "tables" / "alignment_samples.jsonl").read_text().splitlines()]
    assert len(table) == 16 and {"image", "caption", "rating", "bagelscore_expected", "clip_s"} <= set(table[0])
    assert "| bagelscore_expected |" in printed and "alignment.json" in printed
    one = json.loads((tmp_path / "one" / "alignment.json").read_text())
    assert one["model_fingerprint"] == weights_fingerprint(model) and one["n_pairs"] == 24
    assert "java" in one["not_run"]["meteor"] and one["tokenizer"] == "simple"
    assert list(one["metrics"]) == ["bagelscore_expected", "bagelscore_decode", "clip_s", "refclip_s", "bleu4", "cider"]
    rows = [json.loads(x) for x in (tmp_path / "one" / "samples.jsonl").read_text().splitlines()]
    ratings = [r["rating"] for r in rows]
    for name, s in one["metrics"].items():  # τ recomputed by scipy from the per-sample file
        pts = [(r["scores"][name], r["rating"]) for r in rows if r["scores"][name] is not None]
        assert s["n"] == len(pts) and s["missing"] == len(rows) - len(pts)
        for v in ("b", "c"):
            want = kendalltau(*zip(*pts), variant=v).statistic
            assert s[f"tau_{v}"] == (None if math.isnan(want) else want), (name, v)
    decode = one["metrics"]["bagelscore_decode"]
    fails = sum(r["scores"]["bagelscore_decode"] is None for r in rows)
    assert decode["failures"] == fails and decode["failure_rate"] == fails / 24 and fails > 0
    assert all(r["bagel_reply"] is not None and len(r["bagel_probs"]) == 4 for r in rows)
    assert len(ratings) == 24 and (tmp_path / "one" / "metrics_vs_rating.png").stat().st_size > 0
    from unicon.report import render_html

    page = render_html(tmp_path / "one")  # the report.html section of the output folder
    assert 'class="alignment-tau"' in page and "alignment/fig/metrics_vs_rating" in page
    for part in ("0/2", "1/2"):
        assert unicon_main([*common, "--out", str(tmp_path / "split"), "--shard", part]) == 0
    assert unicon_main([*common, "--out", str(tmp_path / "split"), "--merge"]) == 0
    for name in ("samples.jsonl", "table.md"):
        assert (tmp_path / "split" / name).read_text() == (tmp_path / "one" / name).read_text(), name
    assert json.loads((tmp_path / "split" / "alignment.json").read_text())["metrics"] == one["metrics"]
    for run in ("one", "split"):
        standins.assert_strict_json(tmp_path / run)  # results, samples, tables, metrics: no NaN / Infinity
    assert unicon_main([*common, "--judge", "vlm:/nonexistent", "--out", str(tmp_path / "x")]) == 2
    assert unicon_main([*common, "--bagel-modes", "guess", "--out", str(tmp_path / "x")]) == 2
    assert unicon_main([*common[:-2], "--baselines", "clip_s", "--clip", str(tmp_path / "noclip"),
                        "--out", str(tmp_path / "x")]) == 2


def test_eval_group_and_callback_from_config(tiny_shapes_world, tmp_path):
    from types import SimpleNamespace

    from unicon import config
    from unicon.evaluation import suites
    from unicon.evaluation.callbacks import SuiteCallback

    cfg = config.compose(["eval=alignment", f"data.root={tiny_shapes_world}", "eval.alignment.bagel_modes=[expected]"])
    assert cfg.eval.alignment.enabled and not cfg.eval.cococon.enabled
    argv = suites.suite("alignment").argv(cfg)
    assert argv[0] == f"--data={tiny_shapes_world}" and "--bagel-modes=expected" in argv and "--limit=64" in argv
    cb = SuiteCallback.from_config(suites.suite("alignment"), cfg)
    assert cb.config.bagel_modes == ["expected"] and len(cb.inputs.pairs) == 64
    assert not config.compose([]).eval.alignment.enabled
    cb = SuiteCallback(suites.suite("alignment"), config.AlignmentEvalConfig(
        data=str(tiny_shapes_world), bagel_modes=["expected"], baselines=[], max_samples=6))
    trainer = SimpleNamespace(default_root_dir=str(tmp_path), current_epoch=0, global_step=3, loggers=[],
                              is_global_zero=True, strategy=SimpleNamespace(root_device=torch.device("cpu")))
    metrics = cb.evaluate(trainer, standins.FakeModel())
    saved = json.loads((tmp_path / "eval" / "alignment" / "epoch-1" / "alignment.json").read_text())
    assert saved["epoch"] == 1 and saved["n_pairs"] == 6
    assert metrics == {"alignment/bagelscore_expected/tau_b": saved["metrics"]["bagelscore_expected"]["tau_b"],
                       "alignment/bagelscore_expected/tau_c": saved["metrics"]["bagelscore_expected"]["tau_c"],
                       "alignment/bagelscore_expected/n": 6.0}
    with pytest.raises(Exception, match="lists a value twice"):
        config.compose(["eval=alignment", "eval.alignment.baselines=[bleu4,bleu4]"])


def test_tiny_ofa_bagelscore(pretrained_shapes, tmp_path):
    """The pretrained ShapesWorld OFA through the command (expected mode, no baseline): runs, and its
    probabilities over the four answers are a distribution."""
    from unicon.worlds.shapes_alignment import write_alignment_set

    export, world = pretrained_shapes
    pairs = write_alignment_set(world, tmp_path / "set", n=6, seed=1)
    out = tmp_path / "out"
    assert unicon_main(["evaluate", "alignment", "--ckpt", str(export), "--data", str(pairs), "--images", str(world),
                        "--device", "cpu", "--logger", "none", "--bagel-modes", "expected", "--baselines", "",
                        "--out", str(out)]) == 0
    rows = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 6
    for r in rows:
        assert sum(r["bagel_probs"]) == pytest.approx(1.0, abs=8 * EPS64)
        assert 0.0 <= r["scores"]["bagelscore_expected"] <= 1.0


# ---------------------------------------------------------------------------------------------
# the rating scale per dataset, CLIP's prompt prefix: settings, recorded
# ---------------------------------------------------------------------------------------------
def test_bagel_scale_is_set_per_dataset(tmp_path):
    from unicon.evaluation.alignment.runner import resolve_bagel_scale

    assert prompts.bagelscore_prompt("x") == prompts.bagelscore_prompt("x", "cf") == \
        prompts.BAGELSCORE_PROMPT.replace("{caption}", "x")
    cf, expert = prompts.BAGELSCORE_PROMPT.splitlines(), prompts.BAGELSCORE_PROMPT_EXPERT.splitlines()
    changed = [i for i, (a, b) in enumerate(zip(cf, expert)) if a != b]
    assert len(cf) == len(expert) and changed == [3, 4, 5, 6, len(cf) - 1]  # the four values and the last line
    assert [line.split(":")[0] for line in expert[3:7]] == ["- 1", "- 2", "- 3", "- 4"]
    assert expert[-1] == "Provide ONLY a single integer rating (1, 2, 3, or 4) without explanation:"
    assert prompts.parse_rating("3", "expert") == 3.0 and prompts.parse_rating("4.0", "expert") == 4.0
    assert prompts.parse_rating("0.3", "expert") is None and prompts.parse_rating("3") is None
    assert resolve_bagel_scale("auto", tmp_path / "flickr8k.json") == "expert"
    assert resolve_bagel_scale("auto", tmp_path / "crowdflower_flickr8k.json") == "cf"
    assert resolve_bagel_scale("auto", tmp_path / "composite.jsonl") == "cf"
    assert resolve_bagel_scale("auto", tmp_path / "alignment" / "pairs.jsonl") == "cf"  # a ShapesWorld's set
    assert resolve_bagel_scale("cf", tmp_path / "flickr8k.json") == "cf"
    with pytest.raises(UserError, match="bagel-scale"):
        resolve_bagel_scale("1-5", None)
    model = standins.FakeModel(scale=0.37)
    results = expected_scores(model, _images(2), ["a", "b"], "expert")
    assert all(1.0 <= r.score <= 4.0 and len(r.probs) == 4 for r in results)
    replies = Replies(["3", "0.6"])
    assert [r.score for r in decode_scores(replies, _images(2), ["a", "b"], "expert")] == [3.0, None]


class RecordingClip:
    """A CLIP stand-in that records the texts it embeds (all embeddings equal)."""

    source = "ViT-B-32:/models/openai_vit_b32.pt"

    def __init__(self):
        self.texts = []

    def embed_image(self, images):
        return torch.nn.functional.normalize(torch.ones(len(images), 4), dim=-1)

    def embed_text(self, texts):
        self.texts += list(texts)
        return torch.nn.functional.normalize(torch.ones(len(texts), 4), dim=-1)


def test_clip_prefix_is_hessels_for_a_real_clip_none_for_the_worlds_and_recorded(tmp_path):
    from unicon.evaluation.alignment.metrics import HESSEL_PREFIX
    from unicon.evaluation.alignment.runner import evaluate_alignment, resolve_clip_prefix

    assert HESSEL_PREFIX == "A photo depicts "
    world_clip = tmp_path / "shapes_clip"
    world_clip.mkdir()
    (world_clip / "train_log.json").write_text(json.dumps({"world": "data/shapes", "steps": 500}))
    assert resolve_clip_prefix("auto", str(world_clip)) == ""
    assert resolve_clip_prefix("auto", "ViT-B-32:/models/openai_vit_b32.pt") == HESSEL_PREFIX
    assert resolve_clip_prefix("auto", "hf-hub:laion/CLIP-ViT-B-32") == HESSEL_PREFIX
    assert resolve_clip_prefix("none", "ViT-B-32:/x.pt") == "" and resolve_clip_prefix("hessel", str(world_clip)) == HESSEL_PREFIX
    for i in range(3):
        _images(3)[i].save(tmp_path / f"{i}.png")
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(
        {"image": f"{i}.png", "caption": f"caption {i}", "rating": float(i + 1), "references": [f"ref {i}"]}) + "\n"
        for i in range(3)))
    pairs, _ = load_pairs(tmp_path / "pairs.jsonl")
    for setting, prefix in (("auto", HESSEL_PREFIX), ("none", "")):
        clip = RecordingClip()
        results, _ = evaluate_alignment(standins.FakeModel(), pairs, tmp_path / setting, ["expected"],
                                        ["clip_s", "refclip_s"], clip=clip, clip_prefix=setting)
        assert sorted(clip.texts) == sorted([prefix + f"caption {i}" for i in range(3)] + [prefix + f"ref {i}" for i in range(3)])
        saved = json.loads((tmp_path / setting / "alignment.json").read_text())["settings"]
        assert saved["clip_prefix"] == {"setting": setting, "text": prefix}
        assert saved["bagel_scale"]["name"] == "cf" and saved["bagel_scale"]["values"] == [0.0, 0.3, 0.6, 1.0]


# ---------------------------------------------------------------------------------------------
# Table 1's other baselines: BLEU-1, ROUGE-L, SPICE, BERTScore
# ---------------------------------------------------------------------------------------------
def _no_java(monkeypatch):
    import shutil

    which = shutil.which
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None if name == "java" else which(name, *a, **k))


TWO_CAPTIONS = ["A cat sits on the mat.", "a dog runs in the park", "a caption without references"]
TWO_REFERENCES = [["The cat is on the mat.", "There is a cat on the mat."], ["A dog is running through the park."], []]


def test_bleu1_and_rouge_l_of_two_captions_by_hand(monkeypatch):
    """Without java the captions are lower-cased and stripped of punctuation, so the counts are those of
    the words. Caption 1 ``a cat sits on the mat`` (6 words) against ``the cat is on the mat`` (6) and
    ``there is a cat on the mat`` (7): 5 of its unigrams are matched (all but "sits"), the closest
    reference length is 6 (no brevity penalty); LCS 4 and 5. Caption 2 ``a dog runs in the park`` (6)
    against ``a dog is running through the park`` (7): 4 matched unigrams, LCS 4, brevity penalty
    exp(1 - 7/6). pycocoevalcap adds 1e-15 to every match count and 1e-9 to every n-gram count and
    length (its own smoothing, reproduced here), the rest is float64 rounding."""
    from unicon.evaluation.alignment.metrics import reference_metrics

    _no_java(monkeypatch)
    scores, notes = reference_metrics(TWO_CAPTIONS, TWO_REFERENCES, ["bleu1", "rouge_l"])
    assert notes == {"tokenizer": "simple"} and set(scores) == {"bleu1", "rouge_l"}

    def bleu1(correct, guess, reflen):
        ratio = (guess + 1e-15) / (reflen + 1e-9)
        return (correct + 1e-15) / (guess + 1e-9) * (math.exp(1 - 1 / ratio) if ratio < 1 else 1.0)

    def rouge_l(lcs_len, cand_len, ref_lens):
        p, r, b2 = max(lcs / cand_len for lcs in lcs_len), max(lcs / n for lcs, n in zip(lcs_len, ref_lens)), 1.2 ** 2
        return (1 + b2) * p * r / (r + b2 * p)

    tol = 8 * EPS64
    assert scores["bleu1"][0] == pytest.approx(bleu1(5, 6, 6), rel=tol)
    assert scores["bleu1"][1] == pytest.approx(bleu1(4, 6, 7), rel=tol)
    assert scores["bleu1"][0] == pytest.approx(5 / 6, rel=1e-9)  # the smoothing is below 1e-9 here
    assert scores["rouge_l"][0] == pytest.approx(rouge_l([4, 5], 6, [6, 7]), rel=tol)
    assert scores["rouge_l"][1] == pytest.approx(rouge_l([4], 6, [7]), rel=tol)
    assert scores["bleu1"][2] is None and scores["rouge_l"][2] is None  # no references: no score
    # the captions swapped: each is scored against the other's references, and scores less
    swapped, _ = reference_metrics(TWO_CAPTIONS[1::-1] + TWO_CAPTIONS[2:], TWO_REFERENCES, ["bleu1", "rouge_l"])
    for name in ("bleu1", "rouge_l"):
        assert all(s < o for s, o in zip(swapped[name][:2], scores[name][:2])), name


def test_spice_is_skipped_with_the_reason_without_java_or_corenlp(monkeypatch):
    from unicon.evaluation.alignment import metrics

    _no_java(monkeypatch)
    scores, notes = metrics.reference_metrics(TWO_CAPTIONS, TWO_REFERENCES, ["spice", "bleu1"])
    assert "spice" not in scores and "bleu1" in scores
    assert notes["spice"] == "java is not on the PATH (pycocoevalcap's SPICE runs a Java jar)"
    # java there, the CoreNLP jars not: skipped, naming them, and nothing is downloaded
    monkeypatch.setattr(metrics.shutil, "which", lambda name, *a, **k: "/usr/bin/java")
    monkeypatch.setattr(metrics, "SPICE_CORENLP_JARS", ("no-such-corenlp.jar",))
    monkeypatch.setattr(metrics, "spice_scores", lambda *a: pytest.fail("SPICE ran without CoreNLP"))
    assert "no-such-corenlp.jar" in metrics.spice_unavailable()
    monkeypatch.setattr("pycocoevalcap.tokenizer.ptbtokenizer.PTBTokenizer.tokenize",
                        lambda self, d: {k: [_simple(v["caption"]) for v in vs] for k, vs in d.items()})
    _, notes = metrics.reference_metrics(TWO_CAPTIONS, TWO_REFERENCES, ["spice"])
    assert "Stanford CoreNLP" in notes["spice"] and "no-such-corenlp.jar" in notes["spice"]


def _simple(text):
    from unicon.evaluation.cococon.metrics import _simple_tokenize

    return _simple_tokenize(text)


def test_spice_reads_the_jars_all_f_per_pair(monkeypatch, tmp_path):
    """The jar's output (a JSON list of ``{"image_id", "scores": {"All": {"f"}}}``) becomes one value per
    pair in the order of the input; a NaN F is no score; a failing jar is a reason, not a crash."""
    import subprocess

    from unicon.evaluation.alignment import metrics

    seen = {}

    def fake_java(cmd, cwd, **kwargs):
        rows = json.loads(Path(cmd[cmd.index("-jar") + 3]).read_text())
        seen["rows"], seen["cwd"] = rows, cwd
        out = [{"image_id": r["image_id"], "scores": {"All": {"f": f, "pr": 0, "re": 0}}}
               for r, f in zip(rows[::-1], ["NaN", 0.25])]
        Path(cmd[cmd.index("-out") + 1]).write_text(json.dumps(out))
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(metrics.subprocess, "run", fake_java)
    values, why = metrics.spice_scores({3: ["a cat"], 7: ["a dog", "the dog"]}, {3: ["a cat"], 7: ["a dog"]})
    assert why is None and values == [0.25, None]
    assert [r["refs"] for r in seen["rows"]] == [["a cat"], ["a dog", "the dog"]] and seen["cwd"].name == "spice"

    def failing(cmd, **kwargs):
        raise subprocess.CalledProcessError(1, cmd, stderr="Exception in thread main\njava.lang.OutOfMemoryError")

    monkeypatch.setattr(metrics.subprocess, "run", failing)
    assert metrics.spice_scores({0: ["a"]}, {0: ["a"]}) == ([], "SPICE failed: java exited with 1 "
                                                               "(java.lang.OutOfMemoryError)")


def test_bertscore_greedy_matching_by_hand():
    """Candidate tokens e1, e2 against a reference token e1: P = (1 + 0) / 2, R = 1, F = 2/3."""
    from unicon.evaluation.alignment.bertscore import greedy_match

    cand = torch.tensor([[1.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
    ref = torch.tensor([[1.0, 0.0]], dtype=torch.float64)
    assert greedy_match(cand, ref) == (0.5, 1.0, pytest.approx(2 / 3, rel=EPS64))
    assert greedy_match(ref, cand) == (1.0, 0.5, pytest.approx(2 / 3, rel=EPS64))  # P and R swap
    assert greedy_match(cand[:0], ref) == (0.0, 0.0, 0.0)


def test_bertscore_with_the_local_minilm_is_one_for_the_same_text_and_lower_for_another():
    from unicon.evaluation.alignment.bertscore import NOT_COMPARABLE, default_scorer

    scorer = default_scorer()
    caption = "a red circle left of a blue square"
    got = scorer.score([caption, "three green triangles", caption],
                       [[caption], [caption], ["two yellow stars", caption]])
    d = 384  # the model's hidden size: float64 rounding of the unit-vector dot products
    assert got[0] == pytest.approx((1.0, 1.0, 1.0), abs=d * EPS64)
    assert got[2] == got[0]  # several references: the best one
    assert 0 < got[1][2] < got[0][2] - 0.1
    assert scorer.model.config.hidden_size == d
    info = scorer.describe()
    assert "all-MiniLM-L6-v2" in info["model"] and info["layer"] == 6 and info["note"] == NOT_COMPARABLE
    assert "roberta-large" in NOT_COMPARABLE and "layer 17" in NOT_COMPARABLE


def test_table1_baselines_in_the_tau_table_and_the_files(tmp_path, monkeypatch):
    """BLEU-1, ROUGE-L, SPICE and BERTScore through ``evaluate_alignment``: τ of each equals scipy's on
    the samples file, SPICE without java is listed under ``not_run`` with its reason (as METEOR), and
    BERTScore's model and its note are in ``alignment.json`` and ``table.md``."""
    from scipy.stats import kendalltau

    from unicon.evaluation.alignment.runner import evaluate_alignment

    _no_java(monkeypatch)
    captions = ["a cat on a mat", "a dog in the park", "two birds on a wire", "a red car", "a cat"]
    refs = ["a cat sits on the mat", "a dog runs in the park", "birds sit on a wire", "a blue bus", "a cat on a mat"]
    for i in range(len(captions)):
        _images(1)[0].save(tmp_path / f"{i}.png")
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(
        {"image": f"{i}.png", "caption": c, "rating": float(i % 4 + 1), "references": [r]}) + "\n"
        for i, (c, r) in enumerate(zip(captions, refs))))
    pairs, _ = load_pairs(tmp_path / "pairs.jsonl")
    results, _ = evaluate_alignment(standins.FakeModel(), pairs, tmp_path / "out", [],
                                    ["bleu1", "rouge_l", "meteor", "spice", "bertscore"])
    assert list(results["metrics"]) == ["bleu1", "rouge_l", "bertscore"]
    assert "java" in results["not_run"]["meteor"] and "java" in results["not_run"]["spice"]
    saved = json.loads((tmp_path / "out" / "alignment.json").read_text())
    assert saved["not_run"] == results["not_run"] and "all-MiniLM-L6-v2" in saved["bertscore_model"]["model"]
    rows = [json.loads(x) for x in (tmp_path / "out" / "samples.jsonl").read_text().splitlines()]
    for name in ("bleu1", "rouge_l", "bertscore"):
        want = kendalltau([r["scores"][name] for r in rows], [r["rating"] for r in rows], variant="b").statistic
        assert saved["metrics"][name]["tau_b"] == pytest.approx(want, abs=EPS64) and saved["metrics"][name]["n"] == 5
    table = (tmp_path / "out" / "table.md").read_text()
    assert "| bertscore |" in table and "spice: not run (java is not on the PATH" in table
    assert "roberta-large" in table and "all-MiniLM-L6-v2" in table
