"""ShapesWorld: exact rendering/parsing/tokenizer, grammar, contrast sets, verifiers and the builder."""

from __future__ import annotations

import filecmp
import json
import re
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from standins import SMALL_INSTRUCT
from unicon.errors import UserError
from unicon.models.base import pil_to_tensor
from unicon.worlds.shapes import (
    NotAShapesWorldImage,
    Scene,
    ShapeObject,
    ShapesTokenizer,
    WorldConfig,
    codes_to_scene,
    detect,
    load_world,
    parse,
    render,
    scene_boxes,
    scene_to_codes,
)
from unicon.worlds.shapes_reasoning import REFINED_MARKER, make_reasoning_item
from unicon.worlds.shapes_text import (
    answer_question,
    caption_matches,
    caption_mismatch,
    count_question_form,
    flip_relation_question,
    mentions_concept,
    mentions_kind,
    parse_caption,
    pattern_matches,
)
from unicon.worlds.shapes_verify import check_criterion, check_geneval

REPO = Path(__file__).resolve().parents[1]
CFG = WorldConfig()
SMALL = ["--num-train", "120", "--num-val", "30", "--num-test", "30", "--num-reason-train", "40",
         "--num-ureason", "8", "--geneval-per-tag", "5", "--num-drift-seeds", "8", "--quiet", *SMALL_INSTRUCT]


def _builder():
    import data_builders.shapes

    return data_builders.shapes


def _random_scene(rng, cfg=CFG) -> Scene:
    n = int(rng.integers(cfg.min_objects, cfg.max_objects + 1))
    cells = rng.choice(cfg.grid * cfg.grid, size=n, replace=False)
    return Scene(tuple(ShapeObject(cfg.shapes[rng.integers(len(cfg.shapes))], cfg.color_names[rng.integers(len(cfg.colors))],
                                   int(c) // cfg.grid, int(c) % cfg.grid) for c in cells))


def O(shape, color, row, col):  # noqa: E743 - short helper for hand-made scenes
    return ShapeObject(shape, color, row, col)


@pytest.fixture(scope="session")
def world(tmp_path_factory):
    out = tmp_path_factory.mktemp("shapes") / "world"
    t0 = time.time()
    assert _builder().main(["--out", str(out), "--seed", "3", *SMALL]) == 0
    return load_world(out), time.time() - t0


# ---------------------------------------------------------------------------------------------
# Pixels
# ---------------------------------------------------------------------------------------------
def test_tokenizer_round_trips_exactly():
    tok = ShapesTokenizer(CFG)
    assert tok.codebook_size == 1 + 6 * 8 and tok.grid_size == (4, 4) and tok.image_size == (64, 64)
    codes = torch.randint(0, tok.codebook_size, (8, 4, 4), generator=torch.Generator().manual_seed(0))
    images = tok.decode(codes)
    assert images.shape == (8, 3, 64, 64) and 0 <= images.min() and images.max() <= 1
    assert torch.equal(tok.encode(images), codes)
    assert torch.equal(tok.encode(tok.decode_to_pil(codes)), codes)
    # code layout: 1 + shape_idx * n_colors + color_idx, row-major cells
    scene = Scene((O("star", "blue", 1, 2),))
    expected = np.zeros((4, 4), dtype=np.int64)
    expected[1, 2] = 1 + CFG.shapes.index("star") * 8 + CFG.color_names.index("blue")
    assert np.array_equal(scene_to_codes(scene, CFG), expected)
    assert codes_to_scene(expected, CFG) == scene
    # decode == canonical render, pixel for pixel
    canon = render(scene, CFG)
    assert torch.equal(tok.decode(torch.from_numpy(expected)[None]), pil_to_tensor([canon]))
    with pytest.raises(ValueError, match="codes must be in"):
        tok.decode(torch.full((1, 4, 4), tok.codebook_size))


def test_render_is_deterministic_and_antialiased():
    scene = Scene((O("circle", "red", 0, 0), O("cross", "white", 3, 3)))
    a, b = np.asarray(render(scene, CFG, seed=5)), np.asarray(render(scene, CFG, seed=5))
    assert np.array_equal(a, b)
    cell = a[:16, :16].reshape(-1, 3)
    bg, red = np.asarray(CFG.background), np.asarray(CFG.colors["red"])
    n_bg = (cell == bg).all(1).sum()
    n_red = (cell == red).all(1).sum()
    assert n_bg > 0 and n_red > 0 and n_bg + n_red < len(cell)  # some edge pixels are blends
    jittered = {render(scene, CFG, seed=s).tobytes() for s in range(10)}
    assert len(jittered) > 1  # jitter changes the pixels


def test_parser_recovers_every_rendered_scene_with_jitter():
    rng = np.random.default_rng(0)
    for i in range(150):
        scene = _random_scene(rng)
        img = render(scene, CFG, seed=i)
        assert parse(img, CFG) == scene
        dets = detect(img, CFG)
        assert [d["box"] for d in dets] == scene_boxes(scene, CFG, seed=i)
        assert [(d["label"], d["color"], d["score"]) for d in dets] == [(o.shape, o.color, 1.0) for o in scene.objects]
    # a world with more jitter and a different grid parses exactly too
    cfg = WorldConfig(grid=3, canvas=60, jitter=2, max_objects=5)
    for i in range(30):
        scene = _random_scene(rng, cfg)
        assert parse(render(scene, cfg, seed=i), cfg) == scene


def test_parser_tolerates_moderate_noise():
    cfg = WorldConfig(noise=4.0)
    rng = np.random.default_rng(1)
    for i in range(20):
        scene = _random_scene(rng, cfg)
        assert parse(render(scene, cfg, seed=i), cfg) == scene


def test_parser_refuses_images_not_from_the_world():
    rng = np.random.default_rng(0)
    with pytest.raises(NotAShapesWorldImage, match="64x64"):
        parse(Image.new("RGB", (32, 32)), CFG)
    with pytest.raises(NotAShapesWorldImage, match="cell"):
        parse(Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)), CFG)
    with pytest.raises(NotAShapesWorldImage):
        parse(Image.new("RGB", (64, 64), CFG.colors["red"]), CFG)  # a flat palette colour is no shape
    gradient = np.broadcast_to(np.linspace(0, 255, 64, dtype=np.uint8)[None, :, None], (64, 64, 3)).copy()
    with pytest.raises(NotAShapesWorldImage):
        parse(Image.fromarray(gradient), CFG)
    # two renders blended: every pixel is plausible-looking, but no cell is one shape in one colour
    a = np.asarray(render(Scene((O("circle", "red", 0, 0),)), CFG), dtype=float)
    b = np.asarray(render(Scene((O("square", "blue", 0, 0),)), CFG), dtype=float)
    with pytest.raises(NotAShapesWorldImage, match="row 0, col 0"):
        parse(Image.fromarray(((a + b) / 2).astype(np.uint8)), CFG)


def test_unrenderable_world_configs_error():
    with pytest.raises(ValueError, match="cannot fit on a 2x2 grid"):
        WorldConfig(grid=2, canvas=32, max_objects=5)
    with pytest.raises(ValueError, match="jitter"):
        WorldConfig(jitter=4)
    with pytest.raises(ValueError, match="divisible"):
        WorldConfig(canvas=65)
    with pytest.raises(ValueError, match="unknown shapes"):
        WorldConfig(shapes=("circle", "hexagon"))


# ---------------------------------------------------------------------------------------------
# Language
# ---------------------------------------------------------------------------------------------
SCENE = Scene((O("circle", "red", 0, 0), O("square", "blue", 0, 2), O("triangle", "green", 2, 1), O("triangle", "green", 3, 3)))


@pytest.mark.parametrize("caption, ok", [
    ("a red circle to the left of a blue square and two green triangles", True),
    ("there is a red circle, a blue square and two green triangles", True),
    ("a photo of two green triangles, a blue square and a red circle", True),
    ("a blue square right of a red circle and two green triangles", True),
    ("a red circle above two green triangles", False),  # relations need singular phrases -> unparseable
    ("a red circle to the right of a blue square and two green triangles", False),  # wrong relation
    ("a red circle, a blue square and three green triangles", False),  # wrong count
    ("a red circle and a blue square", False),  # closed world: triangles missing
    ("a circle, a square and two triangles", True),  # colourless phrases match any colour
    ("a red circle, a blue square, a green triangle and a green triangle", True),
    ("a red circle, a blue square and two green triangle", False),  # number disagreement
    ("a red hexagon", False),
])
def test_caption_semantics(caption, ok):
    assert caption_matches(caption, SCENE) is ok


@pytest.mark.parametrize("caption, cause", [
    ("a red circle to the left of a blue square and two green triangles", None),
    ("a red circle above two green triangles", "unparsable"),
    ("a red zebra", "unparsable"),
    ("a red circle and a blue square", "fewer_objects"),
    ("a red circle, a blue square and three green triangles", "more_objects"),
    ("a red circle, a blue square and two green circles", "attributes"),
    ("a red square, a blue circle and two green triangles", "attributes"),
    ("a red circle to the right of a blue square and two green triangles", "relation"),
    ("a red circle below a blue square and two green triangles", "relation"),
])
def test_caption_mismatch_names_the_first_cause(caption, cause):
    assert caption_mismatch(caption, SCENE) == cause
    assert caption_matches(caption, SCENE) is (cause is None)


def test_flip_relation_question_keeps_the_wording_and_reverses_the_answer():
    assert flip_relation_question("is the red circle to the left of the blue square?") == \
        "is the red circle to the right of the blue square?"
    assert flip_relation_question("Is the circle  right of the square?") == "is the circle left of the square?"
    assert flip_relation_question("is the circle below the blue square?") == "is the circle above the blue square?"
    for other in ("where is the red circle relative to the blue square?", "what colour is the circle?"):
        assert flip_relation_question(other) is None
    q = "is the red circle to the left of the blue square?"  # SCENE: circle (0, 0), square (0, 2)
    assert (answer_question(q, SCENE), answer_question(flip_relation_question(q), SCENE)) == ("yes", "no")


def test_count_question_form_names_what_is_counted():
    assert [count_question_form(q) for q in (
        "how many objects are there?", "How many red objects are there?", "how many circles are there?",
        "how many red  circles are there?")] == ["all", "colour", "shape", "kind"]
    for other in ("is there a red circle?", "what colour is the circle?", "how many are there?"):
        with pytest.raises(ValueError, match="not a ShapesWorld count question"):
            count_question_form(other)


def test_answer_question_hand_cases():
    cases = {
        "what color is the circle?": "red",
        "what shape is the blue object?": "square",
        "how many triangles are there?": "two",
        "how many green objects are there?": "two",
        "how many objects are there?": "four",
        "how many yellow stars are there?": "zero",
        "is there a blue square?": "yes",
        "is there a red square?": "no",
        "is the red circle to the left of the blue square?": "yes",
        "is the blue square left of the red circle?": "no",
        "where is the red circle relative to the blue square?": "left",
    }
    for q, a in cases.items():
        assert answer_question(q, SCENE) == a, q
    with pytest.raises(ValueError, match="matches 2 objects"):
        answer_question("what color is the triangle?", SCENE)
    with pytest.raises(ValueError, match="no unique answer"):
        answer_question("where is the red circle relative to the green triangle?",
                        Scene((O("circle", "red", 0, 0), O("triangle", "green", 2, 1))))


def _concepts(caption: str):
    """Flatten a parsed caption into comparable concept slots."""
    spec = parse_caption(caption)
    slots = []
    for i, c in enumerate(spec.clauses):
        for j, n in enumerate(c.noun_phrases()):
            slots += [((i, j, "count"), n.count), ((i, j, "color"), n.color), ((i, j, "shape"), n.shape)]
        slots.append(((i, "relation"), c.relation))
    return dict(slots)


NUMBER = {"one": 1, "two": 2, "three": 3, "four": 4}


def test_every_contrast_set_changes_exactly_one_concept(world):
    w, _ = world
    n_checked = 0
    cats = set()
    for split in ("train", "val", "test"):
        data = json.loads(w.cococon_path(split).read_text())
        assert {im["id"] for im in data["images"]} >= {a["image_id"] for a in data["annotations"]}
        for a in data["annotations"]:
            scene = Scene.from_dict(a["scene"])
            cats.add(a["category"])
            assert caption_matches(a["caption"], scene, w.config), a
            assert answer_question(a["query"], scene, w.config) == a["answer"]
            assert 1 <= len(a["contrast_sets"]) <= 5
            assert len({c["mutex_answer"] for c in a["contrast_sets"]}) == len(a["contrast_sets"])
            gold = _concepts(a["caption"])
            for cs in a["contrast_sets"]:
                assert cs["mutex_answer"] != a["answer"]
                assert not caption_matches(cs["mutex_caption"], scene, w.config), cs  # it is a real contrast
                new = _concepts(cs["mutex_caption"])
                assert new.keys() == gold.keys()
                changed = {k for k in gold if gold[k] != new[k]}
                assert len(changed) == 1, (a["caption"], cs["mutex_caption"])
                (slot,) = changed
                value = new[slot]
                # the changed concept is the answer, and the answer's word is in both texts
                expected = {"count": NUMBER.get(cs["mutex_answer"])}.get(slot[-1], cs["mutex_answer"])
                assert value == expected, (slot, value, cs)
                assert cs["mutex_answer"] in re.findall(r"\w+", cs["mutex_caption"])
                assert a["answer"] in re.findall(r"\w+", a["caption"])
                if "detection" in a:
                    assert cs["mutex_detection"].split() == a["detection"].replace(a["answer"], cs["mutex_answer"]).split()
                n_checked += 1
            if "detection" in a:
                img = w.image(next(i["file_name"] for i in data["images"] if i["id"] == a["image_id"]))
                boxes = [d["box"] for d in detect(img, w.config) if f"{d['color']} {d['label']}" == a["detection"]]
                assert a["boxes"] == boxes
    assert cats == {"attribute", "object", "count", "location"}
    assert n_checked > 100


def test_contrast_sets_include_near_and_far(world):
    from unicon.worlds.shapes_text import color_alternatives

    w, _ = world
    checked = 0
    for split in ("train", "test"):
        held = set(w.held_out) if split == "train" else set()
        for a in json.loads(w.cococon_path(split).read_text())["annotations"]:
            if a["category"] != "attribute" or len(a["contrast_sets"]) < 2:
                continue
            shape = a["query"].split()[-1].rstrip("?")
            alts = [c for c in color_alternatives(a["answer"], w.config) if (c, shape) not in held]
            got = [c["mutex_answer"] for c in a["contrast_sets"]]
            assert got == sorted(got, key=alts.index)  # ordered near -> far
            assert (got[0], got[-1]) == (alts[0], alts[-1])  # nearest and farthest both present
            checked += 1
    assert checked > 0


# ---------------------------------------------------------------------------------------------
# Verifiers
# ---------------------------------------------------------------------------------------------
def _det(shape, color, row, col):
    return {"box": [col * 16 + 3, row * 16 + 3, 10, 10], "label": shape, "color": color, "score": 1.0}


def test_geneval_checker_hand_cases():
    two = [_det("circle", "red", 0, 0), _det("circle", "blue", 1, 3)]
    assert check_geneval({"tag": "single_object", "include": [{"class": "circle", "count": 1}]}, two)
    assert not check_geneval({"tag": "single_object", "include": [{"class": "star", "count": 1}]}, two)
    counting = {"tag": "counting", "include": [{"class": "circle", "count": 2}], "exclude": [{"class": "circle", "count": 3}]}
    assert check_geneval(counting, two)
    assert not check_geneval(counting, two + [_det("circle", "red", 3, 3)])  # exclude fires
    assert not check_geneval(counting, two[:1])
    assert check_geneval({"tag": "colors", "include": [{"class": "circle", "count": 1, "color": "blue"}]}, two)
    assert not check_geneval({"tag": "colors", "include": [{"class": "circle", "count": 1, "color": "green"}]}, two)
    pos = {"tag": "position", "include": [{"class": "square", "count": 1},
                                          {"class": "circle", "count": 1, "position": ["left of", 0]}]}
    assert check_geneval(pos, [_det("circle", "red", 2, 0), _det("square", "gray", 0, 2)])
    assert not check_geneval(pos, [_det("circle", "red", 2, 2), _det("square", "gray", 0, 2)])  # same column
    assert not check_geneval(pos, [_det("circle", "red", 2, 0)])  # anchor group missing
    above = {"tag": "position", "include": [{"class": "square", "count": 1},
                                            {"class": "circle", "count": 1, "position": ["above", 0]}]}
    assert check_geneval(above, [_det("circle", "red", 0, 3), _det("square", "gray", 1, 0)])
    attr = {"tag": "color_attr", "include": [{"class": "circle", "count": 1, "color": "red"},
                                             {"class": "square", "count": 1, "color": "gray"}]}
    assert check_geneval(attr, [_det("circle", "red", 2, 0), _det("square", "gray", 0, 2)])
    assert not check_geneval(attr, [_det("circle", "gray", 2, 0), _det("square", "red", 0, 2)])


def test_geneval_checker_runs_on_the_detector(world):
    w, _ = world
    img = render(Scene((O("circle", "red", 3, 0), O("star", "yellow", 0, 0))), w.config, seed=1)
    row = {"tag": "position", "include": [{"class": "circle", "count": 1},
                                          {"class": "star", "count": 1, "position": ["above", 0]}]}
    assert check_geneval(row, detect(img, w.config), w.config)
    row["include"][1]["position"] = ["below", 0]
    assert not check_geneval(row, detect(img, w.config), w.config)


def test_criterion_checker_hand_cases():
    two_red = {"objects": [{"shape": "circle", "color": "red"}] * 2, "relations": []}
    assert check_criterion(two_red, render(Scene((O("circle", "red", 0, 0), O("circle", "red", 3, 1))), CFG, seed=2))
    assert not check_criterion(two_red, render(Scene((O("circle", "red", 0, 0),)), CFG))
    assert not check_criterion(two_red, render(Scene((O("circle", "red", 0, 0), O("circle", "red", 3, 1),
                                                      O("star", "blue", 1, 1))), CFG))  # closed world
    rel = {"objects": [{"shape": "star", "color": "blue"}, {"shape": "square", "color": "gray"}],
           "relations": [{"subject": 0, "relation": "above", "object": 1}]}
    assert check_criterion(rel, render(Scene((O("star", "blue", 0, 3), O("square", "gray", 2, 0))), CFG))
    assert not check_criterion(rel, render(Scene((O("star", "blue", 2, 3), O("square", "gray", 2, 0))), CFG))
    cell = {"objects": [{"shape": "star", "color": "blue", "row": 1, "col": 1}], "relations": []}
    assert check_criterion(cell, render(Scene((O("star", "blue", 1, 1),)), CFG))
    assert not check_criterion(cell, render(Scene((O("star", "blue", 1, 2),)), CFG))
    assert not check_criterion(two_red, Image.new("RGB", (64, 64), (255, 0, 255)))  # refused image fails


def test_refined_prompt_is_equivalent_to_the_criterion():
    rng = np.random.default_rng(4)
    scenes = [_random_scene(rng) for _ in range(300)]
    for cat in ("arithmetic", "attribute", "spatial", "code"):
        for _ in range(10):
            item = make_reasoning_item(cat, rng, CFG)
            assert item["trace"].endswith(f"{REFINED_MARKER} {item['refined_prompt']}")
            assert REFINED_MARKER in item["think_prompt"] and REFINED_MARKER not in item["direct_prompt"]
            pattern = item["target_scene"]
            for s in scenes:
                assert caption_matches(item["refined_prompt"], s) == pattern_matches(pattern, s)
            # a scene built to satisfy the pattern passes the image criterion
            objs = pattern["objects"]
            if pattern["relations"]:
                r = pattern["relations"][0]["relation"]
                cells = {"left": ((1, 0), (1, 2)), "right": ((1, 2), (1, 0)), "above": ((0, 1), (2, 1)),
                         "below": ((2, 1), (0, 1))}[r]
            else:
                cells = [(k // 4, k % 4) for k in range(len(objs))]
            scene = Scene(tuple(O(o["shape"], o["color"], *c) for o, c in zip(objs, cells)))
            assert check_criterion(pattern, render(scene, CFG, seed=0))


def test_arithmetic_prompts_have_the_right_final_count():
    rng = np.random.default_rng(9)
    for _ in range(30):
        item = make_reasoning_item("arithmetic", rng, CFG)
        text = item["direct_prompt"]
        start, color, shape = re.search(r"had (\d+) (\w+) (\w+?)e?s?\.", text).groups()
        removed = int(re.search(r"(\d+) of them were taken away", text).group(1))
        added = re.search(r"then (\d+) more", text)
        final = int(start) - removed + (int(added.group(1)) if added else 0)
        kinds = [(o["color"], o["shape"]) for o in item["target_scene"]["objects"]]
        main_kind = kinds[0]
        assert main_kind[0] == color and main_kind[1].startswith(shape[:4])
        assert kinds.count(main_kind) == final


# ---------------------------------------------------------------------------------------------
# The built world
# ---------------------------------------------------------------------------------------------
def test_small_world_builds_quickly_with_the_documented_layout(world):
    w, seconds = world
    assert seconds < 90, f"building a 180-scene world took {seconds:.1f}s"
    root = w.root
    for name in ["world.json", "tokenizer.json", "drift_seeds.jsonl", "geneval_metadata.jsonl"] + \
            [f"mixture_{s}.jsonl" for s in ("train", "val", "test")] + [f"cococon_{s}.json" for s in ("train", "val", "test")] + \
            [f"ureason/{p}{c}.jsonl" for c in ("arithmetic", "attribute", "spatial", "code") for p in ("", "direct_")]:
        assert (root / name).is_file(), name
    for split, n in (("train", 120), ("val", 30), ("test", 30)):
        assert len(list((root / "images" / split).glob("*.png"))) == n

    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(root / "tokenizer.json"))
    assert [tok.token_to_id(t) for t in ("<s>", "<pad>", "</s>", "<unk>")] == [0, 1, 2, 3]
    assert tok.get_vocab_size() <= 1000
    assert len(tok.encode("a red circle to the left of two blue squares").ids) <= 12  # words are whole tokens

    rows = [json.loads(line) for line in open(w.mixture_path("val"))]
    assert {r["task"] for r in rows} == {"caption", "vqa", "grounding", "t2i"}
    for r in rows[:200]:
        assert set(r) == {"id", "scene_id", "image", "task", "text", "target", "qtype", "scene"}
        scene = Scene.from_dict(r["scene"])
        img = w.image(r["image"])
        if r["task"] in ("caption", "t2i"):
            assert caption_matches(r["target"] if r["task"] == "caption" else r["text"], scene)
        elif r["task"] == "vqa":
            assert answer_question(r["text"], scene) == r["target"]
        elif r["task"] == "grounding":
            assert r["target"] in [d["box"] for d in detect(img, w.config)]
        assert parse(img, w.config) == scene
    test_scenes = {r["image"]: r["scene"] for r in map(json.loads, open(w.mixture_path("test")))}
    assert len(test_scenes) == 30
    for image, scene in test_scenes.items():  # every test image parses back to its scene
        assert parse(w.image(image), w.config) == Scene.from_dict(scene)
    reason = [r for r in map(json.loads, open(w.mixture_path("train"))) if r["task"] == "reason"]
    assert len(reason) == 40 and all(r["image"] is None and REFINED_MARKER in r["target"] for r in reason)


def test_think_then_draw_rows_are_drawn_from_prompt_and_trace(world):
    """reason_t2i rows pair each think prompt P and its gold trace R (UReason setting 2's [P, R])
    with a rendered image that satisfies the item's exact target, and never an evaluation scene."""
    w, _ = world
    rows = [json.loads(line) for line in open(w.mixture_path("train"))]
    reason = [r for r in rows if r["task"] == "reason"]
    drawn = [r for r in rows if r["task"] == "reason_t2i"]
    assert len(drawn) == len(reason) == 40 and json.loads((w.root / "world.json").read_text())["reason_image_rows"] == 40
    evaluation = {json.dumps(json.loads(line)["scene"], sort_keys=True)
                  for split in ("val", "test") for line in open(w.mixture_path(split))}
    for r, d in zip(reason, drawn):
        assert (d["text"], d["context"], d["target"]) == (r["text"], r["target"], None)
        assert check_criterion(r["target_scene"], w.image(d["image"]), w.config)
        assert parse(w.image(d["image"]), w.config) == Scene.from_dict(d["scene"])
        assert json.dumps(d["scene"], sort_keys=True) not in evaluation


def test_caption_gap_removes_one_concept_from_training_captions_only(tmp_path):
    """--caption-gap: train caption rows naming the concept are dropped (keep 0); every other row,
    and the val/test splits, are those of the same world without the gap."""
    small = ["--num-train", "60", "--num-val", "10", "--num-test", "10", "--num-reason-train", "4",
             "--num-ureason", "2", "--geneval-per-tag", "2", "--num-drift-seeds", "2", "--quiet", "--seed", "5",
             *SMALL_INSTRUCT]
    b = _builder()
    assert b.main(["--out", str(tmp_path / "base"), *small]) == 0
    assert b.main(["--out", str(tmp_path / "gap"), *small, "--caption-gap", "purple", "--caption-gap-keep", "0"]) == 0

    def rows(name, split):
        return [json.loads(line) for line in open(tmp_path / name / f"mixture_{split}.jsonl")]

    named = lambda r: r["task"] == "caption" and mentions_concept(r["target"], "purple")  # noqa: E731
    base = rows("base", "train")
    assert any(named(r) for r in base)
    assert rows("gap", "train") == [r for r in base if not named(r)]
    assert any(r["task"] == "vqa" and "purple" in r["target"] for r in rows("gap", "train"))  # VQA keeps it
    for split in ("val", "test"):
        assert rows("gap", split) == rows("base", split)
    # the contrast sets probe the concept: a scene with a purple object whose shape is unique in it
    # gets an attribute sample about that object (gold answer purple)
    probed = 0
    for split in ("train", "test"):
        for a in json.loads((tmp_path / "gap" / f"cococon_{split}.json").read_text())["annotations"]:
            objs = a["scene"]["objects"]
            usable = [o for o in objs if o["color"] == "purple" and sum(p["shape"] == o["shape"] for p in objs) == 1]
            if usable:
                assert (a["category"], a["answer"]) == ("attribute", "purple"), a
                probed += 1
    assert probed >= 5
    info = json.loads((tmp_path / "gap" / "world.json").read_text())
    assert info["caption_gap"] == {"concept": "purple", "keep": 0.0}
    with pytest.raises(UserError, match="--caption-gap='teal' is neither a colour"):
        b.main(["--out", str(tmp_path / "bad"), *small, "--caption-gap", "teal"])


def test_task_gaps_remove_each_concept_from_its_own_task_only(tmp_path):
    """--vqa-gap / --grounding-gap / --t2i-gap (with --caption-gap): each task's train rows naming its
    concept are dropped, every other train row and the val/test splits are those of the same world
    without gaps, and the contrast sets hold samples about every gap concept."""
    small = ["--num-train", "80", "--num-val", "10", "--num-test", "10", "--num-reason-train", "4",
             "--num-ureason", "2", "--geneval-per-tag", "2", "--num-drift-seeds", "2", "--quiet", "--seed", "5",
             "--instruct-mc", "0", "--instruct-geu-per-category", "0", "--instruct-ratings", "0"]
    gaps = {"caption": "purple", "vqa": "star", "grounding": "orange", "t2i": "cross"}
    b = _builder()
    assert b.main(["--out", str(tmp_path / "base"), *small]) == 0
    assert b.main(["--out", str(tmp_path / "gap"), *small, "--caption-gap-keep", "0",
                   *[a for t, c in gaps.items() for a in (f"--{t}-gap", c)]]) == 0

    def rows(name, split):
        return [json.loads(line) for line in open(tmp_path / name / f"mixture_{split}.jsonl")]

    def texts(r):
        return [x for x in (r["text"], r["target"]) if isinstance(x, str)]

    def in_gap(r):
        return r["task"] in gaps and any(mentions_concept(x, gaps[r["task"]]) for x in texts(r))

    base, gap = rows("base", "train"), rows("gap", "train")
    for task in gaps:
        assert any(in_gap(r) for r in base if r["task"] == task), task  # the small world names every concept
    assert gap == [r for r in base if not in_gap(r)]
    for task, concept in gaps.items():  # the other tasks keep each concept
        assert any(r["task"] != task and any(mentions_concept(x, concept) for x in texts(r)) for r in gap), concept
    for split in ("val", "test"):
        assert rows("gap", split) == rows("base", split)
    answers = [a["answer"] for split in ("train", "test")
               for a in json.loads((tmp_path / "gap" / f"cococon_{split}.json").read_text())["annotations"]]
    for concept in gaps.values():
        assert answers.count(concept) >= 3, (concept, answers.count(concept))
    info = json.loads((tmp_path / "gap" / "world.json").read_text())
    assert info["task_gaps"] == gaps
    assert "task_gaps" not in json.loads((tmp_path / "base" / "world.json").read_text())
    with pytest.raises(UserError, match="two tasks share a gap concept"):
        b.main(["--out", str(tmp_path / "bad"), *small, "--vqa-gap", "star", "--t2i-gap", "star"])
    with pytest.raises(UserError, match="--grounding-gap='teal' is neither a colour"):
        b.main(["--out", str(tmp_path / "bad"), *small, "--grounding-gap", "teal"])


def test_splits_are_disjoint_and_held_out_compositions_stay_out_of_training(world):
    w, _ = world
    held = w.held_out
    assert len(held) == 4
    keys = {}
    geu_images = set()
    for split in ("train", "val", "test"):
        rows = [json.loads(line) for line in open(w.mixture_path(split))]
        keys[split] = {json.dumps(r["scene"], sort_keys=True) for r in rows
                       if r["task"] != "reason" and not str(r.get("qtype")).startswith("geu/")}
        geu_images |= {json.dumps(r["scene"], sort_keys=True) for r in rows if str(r.get("qtype")).startswith("geu/")}
    assert not (keys["train"] & keys["val"]) and not (keys["train"] & keys["test"]) and not (keys["val"] & keys["test"])
    # Known limitation of the instruction rows: a GEU item's image is a transformed training scene (quarters
    # moved, clutter or obstacles added) and can equal an evaluation scene by chance (2 of 3,205 in the
    # default world); the builder does not yet avoid them, as reason_image_rows does. Bounded here.
    leaked = geu_images & (keys["val"] | keys["test"])
    assert len(leaked) <= max(2, len(geu_images) // 200), len(leaked)
    texts = []
    for line in open(w.mixture_path("train")):
        r = json.loads(line)
        scene = r["scene"] or r["target_scene"]  # think-then-draw rows have no image, only a target
        assert not any((o["color"], o["shape"]) in held for o in scene["objects"])
        texts += [t for t in (r["text"], r["target"]) if isinstance(t, str)]
    for a in json.loads(w.cococon_path("train").read_text())["annotations"]:
        texts += [a["caption"]] + [c["mutex_caption"] for c in a["contrast_sets"]]
    assert not [t for t in texts if mentions_kind(t, held)]
    evaluation = [Scene.from_dict(json.loads(s)) for s in keys["val"] | keys["test"]]
    assert any(o.kind in held for s in evaluation for o in s.objects)  # generalisation cases exist


def test_written_files_load_with_the_benchmark_loaders(world):
    w, _ = world
    import unicon.data.cococon as cococon
    import unicon.data.geneval as geneval
    import unicon.data.ureason as ureason
    data = cococon.load_cococon(w.cococon_path("test"), images_root=w.root)
    assert len(data) == 30 and data[0].image_path.is_file()
    prompts = geneval.load_geneval(w.geneval_path)
    assert {p.tag for p in prompts} == {"single_object", "two_object", "counting", "colors", "position", "color_attr"}
    items = ureason.load_shapes_ureason(w.root)
    assert len(items) == 4 * 8 and all(i.target_scene is not None for i in items)
    import unicon.data.drift_seeds as drift
    assert len(drift.load_shapes_seeds(w.drift_seeds_path)) == 8


def test_real_benchmark_files_match_the_schemas_we_write(shared_data, world):
    """Our files use exactly the real files' keys (plus the documented extras)."""
    w, _ = world
    real = json.loads((shared_data / "cococon" / "cococon.json").read_text())
    ours = json.loads(w.cococon_path("test").read_text())
    assert set(real) == set(ours) == {"annotations", "images"}
    real_keys = set().union(*(a.keys() for a in real["annotations"]))
    our_keys = set().union(*(a.keys() for a in ours["annotations"]))
    assert our_keys - real_keys == {"category", "scene"}
    real_cs = set().union(*(c.keys() for a in real["annotations"] for c in a["contrast_sets"]))
    our_cs = set().union(*(c.keys() for a in ours["annotations"] for c in a["contrast_sets"]))
    assert our_cs <= real_cs
    real_ge = [json.loads(line) for line in open(shared_data / "geneval" / "evaluation_metadata.jsonl")]
    ours_ge = [json.loads(line) for line in open(w.geneval_path)]
    assert {r["tag"] for r in real_ge} == {r["tag"] for r in ours_ge}
    assert set().union(*map(set, ours_ge)) <= set().union(*map(set, real_ge))
    real_ur = json.loads(open(shared_data / "ureason" / "arithmetic.jsonl").readline())
    ours_ur = json.loads(open(w.ureason_path("arithmetic")).readline())
    assert set(ours_ur) - set(real_ur) == {"target_scene", "trace"}
    assert isinstance(ours_ur["id"], int) and ours_ur["category"] == "arithmetic"


def test_build_is_deterministic_and_independent_of_workers(world, tmp_path):
    w, _ = world
    out = tmp_path / "again"
    assert _builder().main(["--out", str(out), "--seed", "3", "--workers", "2", *SMALL]) == 0
    a = sorted(p.relative_to(w.root) for p in w.root.rglob("*") if p.is_file())
    b = sorted(p.relative_to(out) for p in out.rglob("*") if p.is_file())
    assert a == b
    different = [str(p) for p in a if not filecmp.cmp(w.root / p, out / p, shallow=False)]
    assert different == []
    # --overwrite replaces the world (another seed gives other scenes)
    assert _builder().main(["--out", str(out), "--seed", "4", "--overwrite", *SMALL]) == 0
    assert load_world(out).info["seed"] == 4 and not out.with_name("again.partial").exists()
    assert not filecmp.cmp(w.mixture_path("test"), out / "mixture_test.jsonl", shallow=False)


@pytest.mark.parametrize("argv, message", [
    (["--grid", "2", "--canvas", "32", "--max-objects", "5"], "cannot fit on a 2x2 grid"),
    (["--categories", "location", "count", "--max-objects", "2", "--max-contrast-sets", "5"], "more contrast sets than alternatives"),
    (["--min-contrast-sets", "4"], "category '(count|location)' has only 3 alternatives"),
    (["--max-contrast-sets", "6"], "1-5 contrast sets"),
    (["--held-out", "6"], "held out"),
    (["--grid", "2", "--canvas", "32", "--max-objects", "1", "--categories", "attribute", "object",
      "--num-train", "500"], "distinct train scenes"),
])
def test_unsatisfiable_builder_configs_fail_clearly(tmp_path, argv, message):
    with pytest.raises(UserError, match=message):
        _builder().main(["--out", str(tmp_path / "w"), *SMALL, *argv])
    assert list(tmp_path.iterdir()) == []  # nothing half-written is left behind


def test_existing_world_is_not_overwritten_silently(world, tmp_path):
    w, _ = world
    with pytest.raises(UserError, match="--overwrite"):
        _builder().main(["--out", str(w.root), *SMALL])
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="not a ShapesWorld directory"):
        _builder().main(["--out", str(tmp_path), *SMALL])
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_tokenizer_caches_parses_by_content_and_names_a_foreign_image():
    from unicon.worlds.shapes import NotAShapesWorldImage, Scene, ShapeObject, ShapesTokenizer, WorldConfig, render

    cfg = WorldConfig()
    tok = ShapesTokenizer(cfg)
    a = render(Scene((ShapeObject("star", "red", 0, 1),)), cfg)
    b = render(Scene((ShapeObject("circle", "blue", 3, 3), ShapeObject("cross", "white", 2, 0))), cfg)
    first = tok.encode([a, b])
    assert len(tok._cache) == 2
    again = tok.encode([b, a, a])  # served from the cache: same codes as parsing
    assert torch.equal(again, torch.stack([first[1], first[0], first[0]]))
    assert len(tok._cache) == 2
    assert torch.equal(tok.encode(torch.stack([tok.decode(first)[0]])), first[:1])  # tensor input, same key space
    with pytest.raises(NotAShapesWorldImage, match=r"image 1 of 2: image is 32x32"):
        tok.encode([a, a.resize((32, 32))])
