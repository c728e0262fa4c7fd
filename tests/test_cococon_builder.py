"""`unicon build-data cococon` (CocoCon section 4.1, Steps 1-4) and the ShapesWorld COCO-format export.

The pipeline runs on a small ShapesWorld exported in COCO / VQAv2 formats, where the world's exact
caption semantics check every contrast caption; on synthetic COCO-format input (the benchmark's
generator) for resume / settings / bad-input behaviour; and its output must load with the project's
CocoCon loader and use the released file's keys.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from conftest import float32_tol

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import data_builders.cococon as cb  # noqa: E402
from unicon.cli import main as unicon_main  # noqa: E402
from unicon.data.cococon import load_cococon  # noqa: E402
from unicon.data.shapes_coco import verify_contrasts  # noqa: E402
from unicon.errors import UserError  # noqa: E402


# ---------------------------------------------------------------------------------------------
# Fixtures
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    """A ShapesWorld with 36 test scenes, built with --coco-format."""
    import data_builders.shapes

    root = tmp_path_factory.mktemp("cocoworld") / "world"
    data_builders.shapes.main(["--out", str(root), "--num-train", "12", "--num-val", "4", "--num-test", "36", "--quiet",
                  "--num-reason-train", "0", "--num-ureason", "1", "--geneval-per-tag", "1", "--num-drift-seeds", "1",
                  "--vocab-size", "300", "--coco-format"])
    return root


def coco_args(world: Path, out: Path, *extra: str, split: str = "test") -> list[str]:
    c = world / "coco"
    return ["--captions", str(c / f"captions_{split}.json"), "--questions", str(c / f"questions_{split}.json"),
            "--annotations", str(c / f"vqa_annotations_{split}.json"), "--instances", str(c / f"instances_{split}.json"),
            "--images", str(world), "--out", str(out), "--shards", "4", "--workers", "1", "--quiet", *extra]


@pytest.fixture(scope="module")
def vocab_build(world, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("vocab") / "out"
    assert cb.main(coco_args(world, out, "--candidates", "vocab", "--lm", "none")) == 0
    return out


@pytest.fixture()
def synthetic(tmp_path) -> dict[str, Path]:
    return cb.synthetic_inputs(tmp_path / "in", 300)


def synth_args(paths: dict[str, Path], out: Path, *extra: str) -> list[str]:
    return ["--captions", str(paths["captions"]), "--questions", str(paths["questions"]),
            "--annotations", str(paths["annotations"]), "--instances", str(paths["instances"]),
            "--candidates", "vocab", "--lexical", "none", "--lm", "none", "--out", str(out), "--shards", "4",
            "--workers", "1", "--quiet", *extra]


# ---------------------------------------------------------------------------------------------
# Step 1 text processing
# ---------------------------------------------------------------------------------------------
def test_pivot_matching_uses_lemmas_not_shared_stems():
    toks = [t for t, _, _ in cb.tokenize("Two apples hanging from a tree that has hardly any leaves.")]
    assert cb.find_span(toks, ["apple"]) == 1          # plural noun ~ its lemma
    assert cb.find_span(toks, ["2"]) == 0              # digits ~ number words
    assert cb.find_span(toks, ["left"]) is None        # "left" and "leaves" only share the lemma "leave"
    assert cb.find_span(["zebras", "standing"], ["stand"]) == 1
    assert cb.find_span(["a", "teddy", "bear"], ["teddy", "bear"]) == 1


def test_contrast_caption_inflects_and_fixes_articles():
    cap = "Three elephants walking along a river."
    toks = cb.tokenize(cap)
    span = toks[1:2]
    word = cb.surface_form("lion", ["elephant"], [t for t, _, _ in span])
    assert cb.contrast_caption(cap, span[0][1], span[0][2], word) == "Three lions walking along a river."
    cap = "A cat eating a bird it has caught."
    toks = cb.tokenize(cap)
    assert cb.contrast_caption(cap, toks[4][1], toks[4][2], cb.surface_form("owl", ["bird"], ["bird"])) == \
        "A cat eating an owl it has caught."
    assert cb.contrast_caption(cap, toks[1][1], toks[1][2], "orange dog") == "An orange dog eating a bird it has caught."
    assert cb.surface_form("3", ["2"], ["two"]) == "three"


def test_wordnet_filter_relations():
    wn = cb.wordnet_filter()
    assert wn.relation("gray", "grey") == "synonym"
    assert wn.relation("dog", "animal") == "hypernym"
    assert wn.relation("finger", "hand") == "holonym"
    assert wn.relation("wheel", "car") == "holonym"    # a car is a wheeled vehicle, the whole of a wheel
    assert wn.relation("tree", "trunk") == "meronym"
    assert wn.relation("dog", "cat") is None
    assert wn.relation("stuffed animal", "pillow") is None  # no WordNet entry: nothing to exclude


# ---------------------------------------------------------------------------------------------
# ShapesWorld: exact verification of every contrast
# ---------------------------------------------------------------------------------------------
def test_coco_export_of_shapesworld(world):
    c = world / "coco"
    caps = json.loads((c / "captions_test.json").read_text())
    inst = json.loads((c / "instances_test.json").read_text())
    refs = json.loads((c / "refs_test.json").read_text())["refs"]
    vqa = json.loads((c / "vqa_annotations_test.json").read_text())["annotations"]
    assert [x["name"] for x in inst["categories"]] == ["circle", "square", "triangle", "star", "cross", "diamond"]
    assert len(caps["images"]) == 36 and all((world / im["file_name"]).is_file() for im in caps["images"])
    assert {a["answer_type"] for a in vqa} <= {"yes/no", "number", "other"} and all(len(a["answers"]) == 10 for a in vqa)
    # every box is the tight box of the rendered object: the world's exact detector finds the same
    from unicon.worlds.shapes import detect, load_world

    cfg = load_world(world).config
    by_image = {}
    for a in inst["annotations"]:
        by_image.setdefault(a["image_id"], []).append((inst["categories"][a["category_id"] - 1]["name"], a["color"],
                                                       a["bbox"]))
    for im in caps["images"][:10]:
        found = sorted((d["label"], d["color"], list(d["box"])) for d in detect(Image_open(world / im["file_name"]), cfg))
        assert found == sorted(by_image[im["id"]])
    ann_ids = {a["id"] for a in inst["annotations"]}
    assert refs and all(r["ann_id"] in ann_ids for r in refs)


def Image_open(path):
    from PIL import Image

    with Image.open(path) as im:
        return im.convert("RGB")


def test_vocab_contrasts_are_verified_false_and_pivots_found(world, vocab_build):
    report = verify_contrasts(vocab_build / "cococon.json", world, "test")
    assert report["gold_captions"]["false"] == report["gold_captions"]["unparseable"] == 0
    vocab = report["sources"]["vocab"]
    assert vocab["contrasts"] >= 100
    assert vocab["valid_rate"] >= 0.95, report["examples"]
    assert vocab["valid_parsed_rate"] >= 0.8, report["examples"]
    assert report["pivot_recall"]["recall"] >= 0.9, report["pivot_recall"]
    drops = json.loads((vocab_build / "drop_report.json").read_text())
    assert drops["candidates"]["dropped"]["answer_duplicate"] > 0  # the gold answer is in its own vocabulary
    assert drops["pivots"]["skipped"]["yes_no"] > 0


def test_output_loads_and_matches_the_released_schema(world, vocab_build, shared_data):
    data = load_cococon(vocab_build / "cococon.json", images_root=world)
    assert len(data) > 0 and data.report.num_contrast_sets > 0 and data.report.num_localization > 0
    assert all(1 <= len(s.contrast_sets) <= 5 for s in data)
    real = json.loads((shared_data / "cococon" / "cococon.json").read_text())
    real_keys = {k for a in real["annotations"] for k in a}
    real_cs_keys = {k for a in real["annotations"] for cs in a["contrast_sets"] for k in cs}
    ours = json.loads((vocab_build / "cococon.json").read_text())
    assert set(ours) == set(real)
    assert {k for a in ours["annotations"] for k in a} - real_keys == {"provenance"}
    assert {k for a in ours["annotations"] for cs in a["contrast_sets"] for k in cs} - real_cs_keys == \
        {"source", "lm_score"}
    inst = json.loads((world / "coco" / "instances_test.json").read_text())
    names = {c["id"]: c["name"] for c in inst["categories"]}
    for s in data:
        if s.has_localization:  # Step 4: every box of the category the answer names
            want = [a["bbox"] for a in inst["annotations"]
                    if a["image_id"] == s.image_id and names[a["category_id"]] == s.answer]
            assert s.boxes == [[float(v) for v in b] for b in want]
            assert [c.detection for c in s.contrast_sets] == [c.answer for c in s.contrast_sets]


def test_model_and_file_sources(world, tmp_path):
    """model: a tiny random OFA ranks the vocabulary; its most likely answers become the contrasts.
    file: the file's order is kept, the gold answer dropped."""
    from omegaconf import OmegaConf
    from PIL import Image

    from unicon.models import build_model, load_model

    cfg = OmegaConf.load(REPO / "configs" / "model" / "ofa_shapes_tiny.yaml")
    torch.manual_seed(0)
    build_model(cfg, world_root=world).save_pretrained(str(tmp_path / "model"))
    out = tmp_path / "model_out"
    assert cb.main(coco_args(world, out, "--candidates", f"model:{tmp_path / 'model'}", "--lm", "none",
                             "--lexical", "none", "--max-contrasts", "2")) == 0
    report = verify_contrasts(out / "cococon.json", world, "test")
    assert report["sources"]["model"]["valid_rate"] >= 0.95 and report["pivot_recall"]["recall"] >= 0.9
    # the kept contrasts are the model's top-ranked vocabulary answers (gold answer excluded)
    ann = json.loads((out / "cococon.json").read_text())["annotations"][0]
    qtype = ann["provenance"]["question_type"]
    vocab = json.loads(cb.read_meta(out / ".work" / "index.sqlite")["vocab"])[qtype]
    model = load_model(tmp_path / "model")
    image = json.loads((world / "coco" / "captions_test.json").read_text())["images"]
    file_name = next(im["file_name"] for im in image if im["id"] == ann["image_id"])
    with torch.no_grad():
        nll = model.score_text([Image.open(world / file_name).convert("RGB")], [ann["query"]], [vocab]).nll[0]
    ranked = [vocab[i] for i in torch.argsort(nll[: len(vocab)], stable=True).tolist() if vocab[i] != ann["answer"]]
    assert [c["mutex_answer"] for c in ann["contrast_sets"]] == ranked[:2]

    questions = json.loads((world / "coco" / "vqa_annotations_test.json").read_text())["annotations"]
    colors = ["red", "green", "blue", "yellow", "purple", "orange", "white", "gray"]
    cands = {str(q["question_id"]): [q["multiple_choice_answer"]] + [c for c in reversed(colors)
                                                                     if c != q["multiple_choice_answer"]]
             for q in questions if q["question_type"] == "what color is the"}
    (tmp_path / "cands.json").write_text(json.dumps(cands))
    out = tmp_path / "file_out"
    assert cb.main(coco_args(world, out, "--candidates", f"file:{tmp_path / 'cands.json'}", "--lm", "none",
                             "--lexical", "none", "--max-contrasts", "3")) == 0
    anns = json.loads((out / "cococon.json").read_text())["annotations"]
    assert anns and all(a["query"].startswith("what color is the") for a in anns)
    for a in anns:
        assert [c["mutex_answer"] for c in a["contrast_sets"]] == cands[str(a["question_id"])][1:4]
    assert verify_contrasts(out / "cococon.json", world, "test")["sources"]["file"]["valid_rate"] >= 0.95


@pytest.mark.parametrize("reply, expected", [
    ("1. lake (confidence: 0.8)\n2. river - 60%\n3. Pool: 9/10\n4. \"sea\"", ["pool", "lake", "river", "sea"]),
    ("lake, river, pond", ["lake", "river", "pond"]),
    ("Answer 1: lake 0.7\nAnswer 2: River 0.9\nAnswer 3: lake 0.1", ["river", "lake"]),
    ("- a tennis court\n- the ocean floor at night with many fish in it\n* beach", ["a tennis court", "beach"]),
    ("", []),
])
def test_mllm_replies_parse_into_answers_best_first(reply, expected):
    assert cb.parse_mllm_answers(reply) == expected
    assert cb.parse_mllm_answers(reply, 1) == expected[:1]


def test_mllm_source(world, tmp_path, monkeypatch):
    """mllm:PATH (Appendix B.1): the paper's prompt over the caption with its concept blanked, the
    reply parsed best first, then Step 3 as for any source. The reply is scripted (a random tiny VLM
    writes bytes); the real transformers call is checked on its own below."""
    import standins

    vlm = standins.llava(tmp_path / "vlm")
    colors = ["red", "green", "blue", "yellow", "purple", "orange", "white", "gray"]
    prompts: list[str] = []

    def reply(self, image_path, blanked, n):
        prompts.append(self.prompt(blanked, n))
        assert "___" in blanked and Path(image_path).is_file()
        # colours whatever the blank; confidences rise down the list: the parser puts the last first
        return "\n".join(f"{i + 1}. {w} (confidence: {0.1 * (i + 1):.1f})" for i, w in enumerate(colors[:n]))

    monkeypatch.setattr(cb.MllmProposer, "reply", reply)
    out = tmp_path / "out"
    assert cb.main(coco_args(world, out, "--candidates", f"mllm:{vlm}", "--lm", "none", "--lexical", "none",
                             "--max-contrasts", "3", "--mllm-answers", "5")) == 0
    anns = json.loads((out / "cococon.json").read_text())["annotations"]
    assert anns and prompts
    assert prompts[0].startswith("Based on the image, write 5 different answers for filling in the blank")
    asked = list(reversed(colors[:5]))  # best first
    for a in anns:
        assert all(c["source"] == "mllm" for c in a["contrast_sets"])
        assert [c["mutex_answer"] for c in a["contrast_sets"]] == [w for w in asked if w != a["answer"]][:3]
        start, end = a["provenance"]["span"]
        assert any(p.endswith("write your confidence in how well the answer fits into the caption while staying "
                              "true to the image.") and f"caption: {cb.contrast_caption(a['caption'], start, end, '___')}." in p
                   for p in prompts)
    # colour pivots get colour contrasts: false captions of their scenes
    color_anns = {"annotations": [a for a in anns if a["answer"] in colors]}
    assert color_anns["annotations"]
    (tmp_path / "colors.json").write_text(json.dumps({**json.loads((out / "cococon.json").read_text()), **color_anns}))
    assert verify_contrasts(tmp_path / "colors.json", world, "test")["sources"]["mllm"]["valid_rate"] >= 0.95

    # the real image-text-to-text call: the chat template, the image, greedy generation (deterministic)
    monkeypatch.undo()
    proposer = cb.MllmProposer(str(vlm), "cpu", max_new_tokens=6)
    image = world / json.loads((world / "coco" / "captions_test.json").read_text())["images"][0]["file_name"]
    first = proposer.reply(image, "a ___ circle", 5)
    assert isinstance(first, str) and first == proposer.reply(image, "a ___ circle", 5)
    assert isinstance(proposer.propose(image, "a ___ circle", 5), list)


def test_language_model_filter(world, tmp_path):
    """Step 3 with a local causal LM: scores are recorded per contrast, and the margin drops exactly
    the contrast captions that score more than ``margin`` below their gold caption."""
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    lm = tmp_path / "lm"
    tok = PreTrainedTokenizerFast(tokenizer_file=str(world / "tokenizer.json"), bos_token="<s>", eos_token="</s>",
                                  pad_token="<pad>", unk_token="<unk>")
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_positions=64, n_embd=32, n_layer=2, n_head=2,
                                               bos_token_id=0, eos_token_id=2)).save_pretrained(lm)
    tok.save_pretrained(lm)
    loose, strict = tmp_path / "loose", tmp_path / "strict"
    base = ["--candidates", "vocab", "--lm", str(lm), "--lexical", "none", "--max-contrasts", "5"]
    assert cb.main(coco_args(world, loose, *base, "--lm-margin", "1000")) == 0
    assert cb.main(coco_args(world, strict, *base, "--lm-margin", "0.05")) == 0
    anns = json.loads((loose / "cococon.json").read_text())["annotations"]
    scorer = cb.LMScorer(str(lm))
    a = anns[0]
    direct = scorer.score([a["caption"]] + [c["mutex_caption"] for c in a["contrast_sets"]])
    assert a["provenance"]["lm_score"] == pytest.approx(direct[0], abs=1e-3)
    assert [c["lm_score"] for c in a["contrast_sets"]] == pytest.approx(direct[1:], abs=1e-3)
    # with --max-contrasts 5 and at most 7 alternatives per question type, the loose run keeps (almost)
    # every candidate: recount the strict drops from its recorded scores
    expected = sum(c["lm_score"] < a["provenance"]["lm_score"] - 0.05 for a in anns for c in a["contrast_sets"])
    rep = json.loads((strict / "drop_report.json").read_text())
    assert rep["candidates"]["dropped"]["lm_score"] >= expected > 0
    strict_anns = json.loads((strict / "cococon.json").read_text())["annotations"]
    assert strict_anns and all(c["lm_score"] >= a["provenance"]["lm_score"] - 0.05
                               for a in strict_anns for c in a["contrast_sets"])


def test_seq2seq_language_model_filter(world, tmp_path):
    """Step 3 with an encoder-decoder LM (the paper used T5): each caption is scored as the decoder's
    target given an empty source; batched scores equal one text at a time through the model's own
    loss (mean token NLL), and a build records them."""
    from transformers import PreTrainedTokenizerFast, T5Config, T5ForConditionalGeneration

    lm = tmp_path / "t5"
    tok = PreTrainedTokenizerFast(tokenizer_file=str(world / "tokenizer.json"), bos_token="<s>", eos_token="</s>",
                                  pad_token="<pad>", unk_token="<unk>")
    torch.manual_seed(0)
    pad = tok.convert_tokens_to_ids("<pad>")
    T5ForConditionalGeneration(T5Config(vocab_size=len(tok), d_model=32, d_ff=64, d_kv=16, num_layers=1,
                                        num_heads=2, pad_token_id=pad, decoder_start_token_id=pad,
                                        eos_token_id=tok.convert_tokens_to_ids("</s>"))).save_pretrained(lm)
    tok.save_pretrained(lm)
    scorer = cb.LMScorer(str(lm))
    assert scorer.seq2seq
    texts = ["a red circle", "there is a blue square left of a green star", "two yellow crosses"]
    batched = scorer.score(texts)
    for text, score in zip(texts, batched):
        source = tok("", return_tensors="pt")["input_ids"]
        if source.shape[1] == 0:
            source = torch.tensor([[pad]])
        with torch.no_grad():
            loss = scorer.model(input_ids=source, labels=tok(text, return_tensors="pt")["input_ids"]).loss
        # padded batch vs one text: another summation order; the longest reduction is the
        # log-softmax over the vocabulary, through the 1+1 layers, the cross-attention and the head
        assert score == pytest.approx(-loss.item(), abs=float32_tol(len(tok), abs(score), depth=4))
    out = tmp_path / "out"
    assert cb.main(coco_args(world, out, "--candidates", "vocab", "--lm", str(lm), "--lexical", "none",
                             "--lm-margin", "1000")) == 0
    anns = json.loads((out / "cococon.json").read_text())["annotations"]
    assert anns and all(isinstance(c["lm_score"], float) for a in anns for c in a["contrast_sets"])


# ---------------------------------------------------------------------------------------------
# Scale: resume, settings hash, workers, bad input, missing images, benchmark
# ---------------------------------------------------------------------------------------------
def test_resume_after_a_kill_and_refuse_mixed_settings(synthetic, tmp_path):
    out = tmp_path / "out"
    assert cb.main(synth_args(synthetic, out)) == 0
    first = (out / "cococon.json").read_bytes()
    # a kill: two shards never finished, one was mid-write (only its temporary file exists)
    shards = out / ".work" / "shards"
    (shards / "shard-00001.json").unlink()
    (shards / "shard-00002.json").rename(shards / "shard-00002.json.tmp")
    (shards / "shard-00002.json.tmp").write_text('{"trunc')
    (out / "cococon.json").unlink()
    assert cb.main(synth_args(synthetic, out)) == 0
    assert json.loads((out / "drop_report.json").read_text())["resumed_shards"] == 2
    assert (out / "cococon.json").read_bytes() == first
    with pytest.raises(UserError, match="max_contrasts"):
        cb.main(synth_args(synthetic, out, "--max-contrasts", "2"))
    # a shard written under other settings (copied in by hand) is refused too
    shard = json.loads((shards / "shard-00000.json").read_text())
    shard["settings_hash"] = "0" * 16
    (shards / "shard-00000.json").write_text(json.dumps(shard))
    with pytest.raises(UserError, match="other settings"):
        cb.main(synth_args(synthetic, out))
    assert cb.main(synth_args(synthetic, out, "--max-contrasts", "2", "--overwrite")) == 0
    assert all(len(a["contrast_sets"]) <= 2 for a in json.loads((out / "cococon.json").read_text())["annotations"])


def test_workers_give_the_same_output(synthetic, tmp_path, fork_safe_threads):
    one, two = tmp_path / "one", tmp_path / "two"
    assert cb.main(synth_args(synthetic, one)) == 0
    assert cb.main(synth_args(synthetic, two, "--workers", "2")) == 0
    assert (one / "cococon.json").read_bytes() == (two / "cococon.json").read_bytes()


@pytest.mark.parametrize("damage, message", [
    (lambda t: t[: len(t) // 2], r"questions\.json: malformed or truncated VQAv2 questions file after record questions\[\d+\]"),
    (lambda t: t.replace('"question": "what color', '"q": "what color', 1),
     r"questions\.json: questions\[0\] \(question_id \d+\): missing key 'question'"),
    (lambda t: t.replace('{"questions"', '{"quest"', 1), r"no top-level list 'questions'"),
])
def test_bad_input_names_the_file_and_record(synthetic, tmp_path, damage, message, capsys):
    q = synthetic["questions"]
    q.write_text(damage(q.read_text()))
    argv = ["build-data", "cococon", *synth_args(synthetic, tmp_path / "out")]
    assert unicon_main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("unicon: error:")
    import re

    assert re.search(message, err[0]), err[0]


def test_duplicate_ids_and_mismatched_files(synthetic, tmp_path):
    ann = json.loads(synthetic["annotations"].read_text())
    ann["annotations"][1]["image_id"] = ann["annotations"][1]["image_id"] + 1
    synthetic["annotations"].write_text(json.dumps(ann))
    with pytest.raises(UserError, match=r"question_id \d+ has image_id \d+ in .*questions.json but \d+ in"):
        cb.main(synth_args(synthetic, tmp_path / "a"))
    qs = json.loads(synthetic["questions"].read_text())
    qs["questions"].append(qs["questions"][3])
    synthetic["questions"].write_text(json.dumps(qs))
    with pytest.raises(UserError, match=r"questions.json: duplicate question_id \d+"):
        cb.main(synth_args(synthetic, tmp_path / "b"))


def test_missing_images_are_counted_and_skipped(world, tmp_path):
    images = tmp_path / "images"
    shutil.copytree(world / "images", images / "images")
    gone = sorted((images / "images" / "test").iterdir())[:3]
    for p in gone:
        p.unlink()
    out = tmp_path / "out"
    argv = coco_args(world, out, "--candidates", "vocab", "--lm", "none", "--lexical", "none")
    argv[argv.index("--images") + 1] = str(images)
    assert cb.main(argv) == 0
    rep = json.loads((out / "drop_report.json").read_text())
    assert rep["missing_images"]["count"] == 3 and rep["pivots"]["skipped"]["missing_image"] > 0
    assert sorted(rep["missing_images"]["first"]) == sorted(str(p) for p in gone)
    data = load_cococon(out / "cococon.json", images_root=images)  # every kept sample has its image
    assert len(data) > 0


def test_candidate_sources_are_validated(synthetic, tmp_path):
    with pytest.raises(UserError, match="no transformers checkpoint"):
        cb.main(synth_args(synthetic, tmp_path / "o") + ["--candidates", "mllm:/models/llava"])
    (tmp_path / "vlm").mkdir()
    (tmp_path / "vlm" / "config.json").write_text("{}")
    with pytest.raises(UserError, match="pass --images"):
        cb.main(synth_args(synthetic, tmp_path / "o") + ["--candidates", f"mllm:{tmp_path / 'vlm'}"])
    with pytest.raises(UserError, match="pass --images"):
        cb.main(synth_args(synthetic, tmp_path / "o") + ["--candidates", f"model:{tmp_path}"])
    with pytest.raises(UserError, match="candidate file not found"):
        cb.main(synth_args(synthetic, tmp_path / "o") + ["--candidates", "file:/nonexistent.json"])


def test_bench_build_cococon(capsys):
    assert unicon_main(["bench", "build-cococon", "--pairs", "400", "--shards", "4", "--workers", "1",
                        "--lexical", "none"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["pairs"] == 400 and r["pairs_per_s"] > 0 and r["peak_rss_mb_main"] > 0
    assert 0 < r["questions_with_pivot"] <= 400 and r["contrast_sets"] >= r["samples"] > 0


def test_readme_commands(world, tmp_path, monkeypatch, capsys):
    """The CocoCon-builder commands of docs/evaluation.md, as test_readme_commands runs them, in a small
    sandbox."""
    import test_readme_commands as readme

    proj = tmp_path / "project"
    shutil.copytree(world, proj / "data" / "shapes", ignore=shutil.ignore_patterns("coco"))
    commands = [c for c in readme.RUNS if "shapes_coco" in c or "build-data cococon" in c or "build-cococon" in c]
    assert len(commands) == 4 and set(commands) <= set(readme.documented_commands())
    outputs = {c: readme.run(c, proj, monkeypatch, capsys) for c in commands}
    verify = json.loads(outputs[next(c for c in commands if " verify " in c)])
    assert verify["sources"]["vocab"]["valid_rate"] >= 0.95 and verify["pivot_recall"]["recall"] >= 0.9
    assert json.loads(outputs["unicon bench build-cococon"])["pairs"] == 400


def test_failed_builds_leave_no_folder_and_a_file_out_is_refused(synthetic, tmp_path, capsys):
    """A malformed input and an LM that does not load fail before the first shard: no folder is left
    (a corrected retry would be refused as other settings); --out naming a file is a one-line error."""
    good = synthetic["questions"].read_text()
    synthetic["questions"].write_text(good[: len(good) // 2])
    out = tmp_path / "new" / "out"
    with pytest.raises(UserError, match="malformed or truncated"):
        cb.main(synth_args(synthetic, out))
    assert not (tmp_path / "new").exists()
    synthetic["questions"].write_text(good)
    (tmp_path / "lm").mkdir()  # a folder, but no LM in it
    with pytest.raises(UserError, match=r"--lm .*lm: cannot load"):
        cb.main(synth_args(synthetic, out, "--lm", str(tmp_path / "lm")))
    assert not (tmp_path / "new").exists()
    assert cb.main(synth_args(synthetic, out)) == 0  # the corrected retry
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    assert unicon_main(["build-data", "cococon", *synth_args(synthetic, a_file)]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"unicon: error: --out {a_file} exists and is not a folder"]


def test_all_empty_captions_fail_naming_the_file_and_the_rows_dropped(synthetic, tmp_path):
    data = json.loads(synthetic["captions"].read_text())
    for row in data["annotations"]:
        row["caption"] = " "
    synthetic["captions"].write_text(json.dumps(data))
    n = len(data["annotations"])
    with pytest.raises(UserError, match=rf"captions\.json: no non-empty caption .*\({n} caption rows dropped as empty\)"):
        cb.main(synth_args(synthetic, tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_without_lm_the_filter_is_off_with_a_warning_naming_the_flag(synthetic, tmp_path, capsys):
    """No LM is available offline, so the paper's T5 filter cannot be the default: a build without
    --lm warns and builds exactly what --lm none builds (which stays silent)."""
    argv = synth_args(synthetic, tmp_path / "quiet")
    assert cb.main(argv) == 0
    assert "--lm" not in capsys.readouterr().err
    i = argv.index("--lm")
    bare = argv[:i] + argv[i + 2:]
    bare[bare.index("--out") + 1] = str(tmp_path / "bare")
    assert "--lm" not in bare
    assert cb.main(bare) == 0
    err = capsys.readouterr().err
    assert "warning: no --lm given" in err and "T5" in err and "--lm none" in err
    assert (tmp_path / "bare" / "cococon.json").read_bytes() == (tmp_path / "quiet" / "cococon.json").read_bytes()
