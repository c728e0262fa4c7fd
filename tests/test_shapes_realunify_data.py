"""ShapesWorld's RealUnify files: UEG polling questions that the world answers exactly, GEU items with one
verified option and the exact target of their stepwise edit."""

from __future__ import annotations

import collections
import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest

from unicon.worlds.shapes import Scene, ShapeObject, WorldConfig, load_world, parse, render
from unicon.worlds.shapes_edit import (
    RESTORE_INSTRUCTION,
    apply_steps,
    keep_only,
    relevant_objects,
    rotate_quarters,
    route_marker,
    shortest_paths,
)
from unicon.worlds.shapes_realunify import (
    ALL_UEG_CATEGORIES,
    GEU_CATEGORIES,
    GEU_EDIT_KIND,
    LEFT_OUT,
    LETTERS,
    UEG_CATEGORIES,
    stepwise_truths,
    answer_poll,
    check_geu,
    geu_answer,
    geu_items,
    geu_truths,
    poll_image,
    ueg_rows,
)
from unicon.worlds.shapes_text import resolve_expression

REPO = Path(__file__).resolve().parents[1]
CFG = WorldConfig()


def _scenes(n: int, seed: int = 0) -> list[Scene]:
    sys.path.insert(0, str(REPO))
    from data_builders.shapes import sample_scene

    rng = np.random.default_rng(seed)
    return [sample_scene(rng, CFG) for _ in range(n)]


@pytest.fixture(scope="module")
def ueg():
    return ueg_rows(CFG, 60, seed=0)


@pytest.fixture(scope="module")
def geu():
    return geu_items(CFG, _scenes(200), 40, seed=0)


def test_categories_and_left_out_ones_are_documented():
    assert set(UEG_CATEGORIES) | set(LEFT_OUT) == set(ALL_UEG_CATEGORIES) and not set(UEG_CATEGORIES) & set(LEFT_OUT)
    assert set(GEU_EDIT_KIND) == set(GEU_CATEGORIES)
    import unicon.worlds.shapes_realunify as module

    for cat in LEFT_OUT:
        assert f"``{cat}``" in module.__doc__


# ---------------------------------------------------------------------------------------------
# UEG
# ---------------------------------------------------------------------------------------------
def test_ueg_rows_poll_exactly_and_are_deterministic(ueg):
    assert ueg == ueg_rows(CFG, 60, seed=0) and ueg != ueg_rows(CFG, 60, seed=1)
    assert collections.Counter(r["category"] for r in ueg) == {c: 60 for c in UEG_CATEGORIES}
    for r in ueg:
        assert set(r) == {"id", "category", "prompt", "questions", "scene"} and r["prompt"].isascii()
        assert len(r["questions"]) >= 3 and {q["answer"] for q in r["questions"]} == {"yes", "no"}
        scene = Scene.from_dict(r["scene"])
        assert [answer_poll(q, scene, CFG) for q in r["questions"]] == [q["answer"] for q in r["questions"]]
        assert poll_image(r, render(scene, CFG, seed=1), CFG) == [True] * len(r["questions"])
    assert len({r["prompt"] for r in ueg}) == len(ueg)


def _violations(row: dict, rng) -> list[Scene]:
    """Scenes that break the prompt: one more object, one object fewer; for code, an object moved; for
    the exclusions of logic prompts, an object painted an excluded colour."""
    scene = Scene.from_dict(row["scene"])
    used = {(o.row, o.col) for o in scene.objects}
    empty = [(r, c) for r in range(CFG.grid) for c in range(CFG.grid) if (r, c) not in used]
    out = []
    for shape, color in (("star", "red"), (scene.objects[0].shape, scene.objects[0].color)):
        out.append(Scene(scene.objects + (ShapeObject(shape, color, *empty[int(rng.integers(len(empty)))]),)))
    out += [Scene(tuple(o for o in scene.objects if o != x)) for x in scene.objects]
    if row["category"] == "code_to_image":
        for x in scene.objects:
            out.append(Scene(tuple(o for o in scene.objects if o != x) + (ShapeObject(x.shape, x.color, *empty[0]),)))
    m = re.search(r"neither (\w+) nor (\w+)|not (\w+), and|none of them (\w+)\.", row["prompt"])
    if m:
        bad = next(g for g in m.groups() if g)
        out += [Scene(tuple(o for o in scene.objects if o != x) + (ShapeObject(x.shape, bad, x.row, x.col),))
                for x in scene.objects]
    return out


def test_a_scene_violating_the_prompt_fails_a_polling_question(ueg):
    rng = np.random.default_rng(0)
    n = 0
    for r in ueg:
        for bad in _violations(r, rng):
            assert any(answer_poll(q, bad, CFG) != q["answer"] for q in r["questions"]), (r["prompt"], bad)
            n += 1
    assert n > 500


def test_answer_poll_refuses_what_it_cannot_check():
    scene = Scene((ShapeObject("circle", "red", 0, 0),))
    with pytest.raises(ValueError, match="no machine-checkable"):
        answer_poll({"question": "is it nice?", "answer": "yes"}, scene, CFG)
    with pytest.raises(ValueError, match="unknown check op"):
        answer_poll({"question": "q", "check": {"op": "nice"}}, scene, CFG)
    with pytest.raises(ValueError, match="unknown colour"):
        answer_poll({"question": "q", "check": {"op": "exists", "where": {"color": "teal"}}}, scene, CFG)
    with pytest.raises(ValueError, match="malformed check"):
        answer_poll({"question": "q", "check": {"op": "count", "where": {}}}, scene, CFG)
    two = Scene((ShapeObject("circle", "red", 0, 0), ShapeObject("square", "red", 1, 1), ShapeObject("square", "red", 2, 2)))
    same = {"question": "q", "check": {"op": "same_color", "a": {"shape": "circle"}, "b": {"shape": "square"}}}
    assert answer_poll(same, two, CFG) == "no" and answer_poll(same, Scene(two.objects[:2]), CFG) == "yes"


# ---------------------------------------------------------------------------------------------
# GEU
# ---------------------------------------------------------------------------------------------
def _expected_target(row: dict, scene: Scene) -> Scene:
    """The stepwise edit's target, recomputed from the row's words and check (independently of the builder)."""
    cat, check = row["category"], row["check"]
    if cat == "mental_reconstruction":
        assert row["edit_instruction"] == RESTORE_INSTRUCTION
        return rotate_quarters(scene, CFG, -1)
    if cat == "mental_tracking":
        assert row["edit_instruction"] in row["question"]
        return apply_steps(scene, check["transform"]["steps"], CFG)
    if cat == "attentional_focusing":
        assert row["edit_instruction"].endswith(row["question"])
        return keep_only(scene, relevant_objects(check["query"], scene, CFG))
    q = check["query"]
    a, b = resolve_expression(q["from"], scene, CFG), resolve_expression(q["to"], scene, CFG)
    steps, ways, cells = shortest_paths(scene, a, b, CFG)
    assert ways == 1
    color, shape = route_marker(CFG)
    assert scene.count(color, shape) == 0
    return Scene(scene.objects + tuple(ShapeObject(shape, color, r, c) for r, c in cells))


def test_geu_items_have_one_verified_answer_and_an_exact_edit_target(geu):
    rows = [r for r, _ in geu]
    counts = collections.Counter(r["category"] for r in rows)
    assert counts == {c: 40 for c in GEU_CATEGORIES}
    for cat in GEU_CATEGORIES:  # balanced answer letters
        letters = collections.Counter(r["answer"] for r in rows if r["category"] == cat)
        assert set(letters) == set(LETTERS) and max(letters.values()) - min(letters.values()) <= 1
    for row, scene in geu:
        assert len(row["options"]) == len(set(row["options"])) == 4 and row["question"].isascii()
        assert Scene.from_dict(row["scene"]) == scene
        truths = geu_truths(row, CFG)
        assert sum(truths) == 1 and LETTERS[truths.index(True)] == row["answer"] == geu_answer(row, CFG)
        target = Scene.from_dict(row["target_scene"])
        assert _expected_target(row, scene) == target
        assert check_geu(row, render(target, CFG, seed=3), CFG) and not check_geu(row, scene, CFG)
        if row["category"] == "attentional_focusing":  # the kept objects answer the question the same way
            assert geu_truths(row, CFG, target) == truths
        if row["category"] == "cognitive_navigation" and row["check"]["query"]["q"] == "path_length":
            a, b = (resolve_expression(row["check"]["query"][k], scene, CFG) for k in ("from", "to"))
            assert row["check"]["values"][LETTERS.index(row["answer"])] == shortest_paths(scene, a, b, CFG)[0]
    assert geu == geu_items(CFG, _scenes(200), 40, seed=0)


def test_geu_questions_need_the_transformation(geu):
    """Reconstruction and tracking answers are about the transformed board: asked of the image as it is,
    the answer usually differs (the distractors include the untransformed answer)."""
    differ = collections.Counter()
    for row, scene in geu:
        if row["category"] in ("mental_reconstruction", "mental_tracking"):
            untransformed = {**row["check"]}
            untransformed.pop("transform")
            try:
                truths = geu_truths({**row, "check": untransformed}, CFG)
            except ValueError:
                truths = [False] * 4
            differ[row["category"]] += LETTERS[truths.index(True)] != row["answer"] if any(truths) else 1
    assert differ["mental_tracking"] == 40 and differ["mental_reconstruction"] >= 30


def test_stepwise_questions_keep_their_answer_after_a_perfect_edit(geu):
    """GEU stepwise asks the edited image its stepwise_question: on the exact target scene (a perfect edit)
    exactly the answer's option is true, for every category. The direct question there loses its answer
    (reconstruction and tracking ask about the board before the edit, navigation about empty cells the
    route markers fill)."""
    lost = collections.Counter()
    for row, _ in geu:
        target = Scene.from_dict(row["target_scene"])
        truths = stepwise_truths(row, CFG, target)
        assert sum(truths) == 1 and LETTERS[truths.index(True)] == row["answer"], row["stepwise_question"]
        assert row["stepwise_question"].isascii() and row["stepwise_question"].endswith("?")
        try:
            direct = geu_truths(row, CFG, target)
        except ValueError:  # e.g. no path through empty cells any more
            direct = [False] * 4
        lost[row["category"]] += direct != truths
    assert lost["attentional_focusing"] == 0
    assert lost["mental_reconstruction"] >= 30 and lost["cognitive_navigation"] >= 30


def test_built_world_has_realunify_files(tiny_shapes_world):
    w = load_world(tiny_shapes_world)
    ueg = [json.loads(line) for line in open(w.realunify_path("ueg"))]
    geu = [json.loads(line) for line in open(w.realunify_path("geu"))]
    assert collections.Counter(r["category"] for r in ueg) == {c: 100 for c in UEG_CATEGORIES}
    assert {r["category"] for r in geu} == set(GEU_CATEGORIES)
    for row in geu:
        assert set(row) >= {"id", "category", "image", "question", "options", "answer", "target_scene"}
        scene = parse(w.image(row["image"]), w.config)
        assert scene == Scene.from_dict(row["scene"]) and geu_answer(row, w.config, scene) == row["answer"]
    with pytest.raises(ValueError, match="unknown RealUnify axis"):
        w.realunify_path("both")
