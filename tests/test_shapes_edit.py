"""ShapesWorld image edits: exact targets, instructions that determine them, the built edit rows, and
their reading by the training mixture."""

from __future__ import annotations

import filecmp
import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from standins import SMALL_INSTRUCT
from unicon.worlds.shapes import Scene, ShapeObject, WorldConfig, load_world, parse, render
from unicon.worlds.shapes_edit import (
    EDIT_KINDS,
    ORDINALS,
    RESTORE_INSTRUCTION,
    SIDES,
    DIRECTIONS,
    Edit,
    add_clutter,
    answer_query,
    apply_steps,
    edit_matches,
    focus_questions,
    relevant_objects,
    rotate_quarters,
    route_marker,
    sample_edit,
    shortest_paths,
)
from unicon.worlds.shapes_text import plural, resolve_expression

REPO = Path(__file__).resolve().parents[1]
CFG = WorldConfig()
TINY = ["--num-train", "12", "--num-val", "4", "--num-test", "4", "--quiet", "--num-ureason", "2",
        "--geneval-per-tag", "2", "--num-drift-seeds", "2", "--num-reason-train", "4", *SMALL_INSTRUCT]


def O(shape, color, row, col):  # noqa: E743 - short helper for hand-made scenes
    return ShapeObject(shape, color, row, col)


def _scenes(n: int, seed: int = 0, busy: bool = False) -> list[Scene]:
    sys.path.insert(0, str(REPO))
    from data_builders.shapes import sample_scene

    rng = np.random.default_rng(seed)
    out = [sample_scene(rng, CFG) for _ in range(n)]
    return [add_clutter(s, rng, CFG, 5) for s in out] if busy else out


# ---------------------------------------------------------------------------------------------
# An independent reader of the instructions: the words alone give the target
# ---------------------------------------------------------------------------------------------
_CELL = r"the (\w+) row and (\w+) column"


def _interpret(instruction: str, source: Scene) -> Scene:
    """The target that ``instruction`` describes, read from its words (module docstring of shapes_edit)."""
    objs = list(source.objects)

    def obj(expr):
        return resolve_expression(expr, source, CFG)

    def without(*gone):
        return [o for o in objs if o not in gone]

    if instruction == RESTORE_INSTRUCTION:
        return rotate_quarters(source, CFG, -1)
    if m := re.fullmatch(r"(?:paint|make) the (.+) (\w+)|change the color of the (.+) to (\w+)", instruction):
        expr, color = (m.group(1), m.group(2)) if m.group(1) else (m.group(3), m.group(4))
        o = obj(expr)
        return Scene(tuple(without(o)) + (O(o.shape, color, o.row, o.col),))
    if m := re.fullmatch(rf"add an? (\w+) (\w+) (?:in {_CELL}|(just (?:left of|right of|above|below)) the (.+))", instruction):
        color, shape = m.group(1), m.group(2)
        if m.group(3):
            r, c = ORDINALS.index(m.group(3)), ORDINALS.index(m.group(4))
        else:
            side = next(k for k, (_, p) in SIDES.items() if p == m.group(5))
            a = obj(m.group(6))
            r, c = a.row + SIDES[side][0][0], a.col + SIDES[side][0][1]
        return Scene(source.objects + (O(shape, color, r, c),))
    if m := re.fullmatch(r"remove all the (?:(\w+) objects|(\w+) (\w+)|(\w+))", instruction):
        if m.group(1):
            return Scene(tuple(o for o in objs if o.color != m.group(1)))
        if m.group(2):
            return Scene(tuple(o for o in objs if not (o.color == m.group(2) and plural(o.shape) == m.group(3))))
        return Scene(tuple(o for o in objs if plural(o.shape) != m.group(4)))
    if m := re.fullmatch(r"remove the (.+)", instruction):
        return Scene(tuple(without(obj(m.group(1)))))
    if m := re.fullmatch(r"keep only the objects needed to answer: (.+)", instruction):
        q = m.group(1)
        if m := re.fullmatch(r"how many (\w+) objects are there\?", q):
            return Scene(tuple(o for o in objs if o.color == m.group(1)))
        if m := re.fullmatch(r"how many (\w+) (\w+) are there\?", q):
            return Scene(tuple(o for o in objs if o.color == m.group(1) and plural(o.shape) == m.group(2)))
        if m := re.fullmatch(r"what color is the (\w+)\?", q):
            return Scene((obj(m.group(1)),))
        if m := re.fullmatch(r"how many other objects are in the same (row|column) as the (.+)\?", q):
            a = obj(m.group(2))
            return Scene(tuple(o for o in objs if (o.row == a.row if m.group(1) == "row" else o.col == a.col)))
        m = re.fullmatch(r"what shape is the object (just (?:left of|right of|above|below)) the (.+)\?", q)
        a = obj(m.group(2))
        (dr, dc), _ = next(v for v in SIDES.values() if v[1] == m.group(1))
        return Scene(tuple(o for o in objs if o == a or (o.row, o.col) == (a.row + dr, a.col + dc)))
    if m := re.fullmatch(r"keep only the (?:(\w+) objects|(\w+) (\w+)|(\w+))", instruction):
        if m.group(1):
            return Scene(tuple(o for o in objs if o.color == m.group(1)))
        if m.group(2):
            return Scene(tuple(o for o in objs if o.color == m.group(2) and plural(o.shape) == m.group(3)))
        return Scene(tuple(o for o in objs if plural(o.shape) == m.group(4)))
    if m := re.fullmatch(r"mark the shortest path from the (\w+ \w+) to the (\w+ \w+) with (\w+) (\w+)", instruction):
        a, b = obj(m.group(1)), obj(m.group(2))
        marker_color, marker_shape = m.group(3), next(s for s in CFG.shapes if plural(s) == m.group(4))
        paths = _all_shortest_paths(source, a, b)
        assert len(paths) == 1, f"{instruction!r}: {len(paths)} shortest paths"
        return Scene(source.objects + tuple(O(marker_shape, marker_color, r, c) for r, c in paths[0][1:-1]))
    # move: steps joined by ", then "
    scene = source
    for step in instruction.split(", then "):
        if m := re.fullmatch(r"swap the (.+) and the (.+)", step):
            scene = apply_steps(scene, [{"op": "swap", "refs": [m.group(1), m.group(2)]}], CFG)
        elif m := re.fullmatch(rf"move the (.+) to {_CELL}", step):
            scene = apply_steps(scene, [{"op": "move", "ref": m.group(1),
                                         "to": [ORDINALS.index(m.group(2)), ORDINALS.index(m.group(3))]}], CFG)
        elif m := re.fullmatch(r"move the (.+) (\w+) cells? (left|right|up|down)", step):
            from unicon.worlds.shapes_text import NUMBER_WORDS

            o = resolve_expression(m.group(1), scene, CFG)
            n = NUMBER_WORDS.index(m.group(2))
            dr, dc = DIRECTIONS[m.group(3)]
            scene = apply_steps(scene, [{"op": "move", "ref": m.group(1), "to": [o.row + n * dr, o.col + n * dc]}], CFG)
        else:
            raise AssertionError(f"instruction outside the documented words: {instruction!r}")
    return scene


def _all_shortest_paths(scene: Scene, a, b) -> list[list[tuple[int, int]]]:
    """Every shortest 4-connected path from a to b through empty cells, by exhaustive search."""
    blocked = {(o.row, o.col) for o in scene.objects} - {(b.row, b.col)}
    best: list[list[tuple[int, int]]] = []
    limit = [CFG.grid * CFG.grid]

    def walk(path):
        if len(path) - 1 > limit[0]:
            return
        cur = path[-1]
        if cur == (b.row, b.col):
            if len(path) - 1 < limit[0]:
                limit[0], best[:] = len(path) - 1, []
            best.append(list(path))
            return
        for dr, dc in DIRECTIONS.values():
            nxt = (cur[0] + dr, cur[1] + dc)
            if 0 <= nxt[0] < CFG.grid and 0 <= nxt[1] < CFG.grid and nxt not in blocked and nxt not in path:
                walk(path + [nxt])

    walk([(a.row, a.col)])
    return best


# ---------------------------------------------------------------------------------------------
# Edits
# ---------------------------------------------------------------------------------------------
def _edits(n_scenes=40, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for busy in (False, True):
        for scene in _scenes(n_scenes, seed, busy):
            for kind in EDIT_KINDS:
                e = sample_edit(kind, scene, rng, CFG)
                if e is not None:
                    out.append(e)
    return out


def test_every_kind_has_an_exact_target_that_its_instruction_determines():
    edits = _edits()
    assert {e.kind for e in edits} == set(EDIT_KINDS)
    for i, e in enumerate(edits):
        assert e.source != e.target, e
        assert e.instruction.isascii() and e.instruction == e.instruction.lower()
        image = render(e.target, CFG, seed=i)
        assert parse(image, CFG) == e.target  # render -> parse round trip
        assert edit_matches(image, e, CFG) and edit_matches(e.target, e, CFG)
        assert not edit_matches(render(e.source, CFG, seed=i), e, CFG)
        assert _interpret(e.instruction, e.source) == e.target, e.instruction
    # the same (source, instruction) never maps to two targets
    seen = {}
    for e in edits:
        assert seen.setdefault((e.source.key(), e.instruction), e.target) == e.target


def test_unparseable_image_is_a_miss():
    e = Edit("remove", "remove the circle", Scene((O("circle", "red", 0, 0), O("star", "blue", 1, 1))),
             Scene((O("star", "blue", 1, 1),)))
    assert not edit_matches(Image.new("RGB", (CFG.canvas, CFG.canvas), (255, 0, 255)), e, CFG)
    assert not edit_matches(Image.new("RGB", (10, 10)), e, CFG)


def test_hand_made_edits():
    scene = Scene((O("circle", "red", 0, 0), O("square", "blue", 0, 3), O("star", "green", 1, 1)))
    assert _interpret("paint the red circle yellow", scene) == Scene(
        (O("circle", "yellow", 0, 0), O("square", "blue", 0, 3), O("star", "green", 1, 1)))
    assert _interpret("move the circle two cells down, then swap the circle and the star", scene) == Scene(
        (O("star", "green", 2, 0), O("square", "blue", 0, 3), O("circle", "red", 1, 1)))
    with pytest.raises(ValueError, match="occupied"):
        apply_steps(scene, [{"op": "move", "ref": "circle", "to": [1, 1]}], CFG)
    # restore: the top left quarter was moved to the top right one
    shuffled = rotate_quarters(scene, CFG, 1)
    assert shuffled == Scene((O("circle", "red", 0, 2), O("square", "blue", 2, 3), O("star", "green", 1, 3)))
    assert rotate_quarters(shuffled, CFG, 3) == scene and rotate_quarters(shuffled, CFG, -1) == scene
    e = sample_edit("restore", scene, np.random.default_rng(0), CFG)
    assert (e.source, e.target, e.instruction) == (shuffled, scene, RESTORE_INSTRUCTION)
    assert sample_edit("restore", scene, np.random.default_rng(0), WorldConfig(grid=3, canvas=48)) is None
    # two sources, one instruction: two targets
    other = Scene((O("circle", "red", 3, 3), O("star", "green", 1, 1)))
    assert _interpret("paint the red circle yellow", other) != _interpret("paint the red circle yellow", scene)
    assert _interpret("paint the red circle yellow", scene) != _interpret("paint the red circle white", scene)


def test_route_is_the_unique_bfs_shortest_path_around_obstacles():
    a, b = O("star", "red", 0, 0), O("square", "blue", 0, 2)
    wall = O("cross", "green", 0, 1)
    scene = Scene((a, b, wall, O("cross", "green", 1, 1), O("cross", "green", 2, 1)))
    steps, ways, cells = shortest_paths(scene, a, b, CFG)
    assert (steps, ways, cells) == (8, 1, [(1, 0), (2, 0), (3, 0), (3, 1), (3, 2), (2, 2), (1, 2)])
    e = sample_edit("route", scene, np.random.default_rng(0), CFG)
    assert e.kind == "route" and route_marker(CFG) == ("white", "circle")
    rng = np.random.default_rng(3)
    checked = 0
    for scene in _scenes(40, 1, busy=True):
        e = sample_edit("route", scene, rng, CFG)
        if e is None:
            continue
        m = re.fullmatch(r"mark the shortest path from the (\w+ \w+) to the (\w+ \w+) with white circles", e.instruction)
        a, b = resolve_expression(m.group(1), scene, CFG), resolve_expression(m.group(2), scene, CFG)
        paths = _all_shortest_paths(scene, a, b)
        marks = [o for o in e.target.objects if o not in scene.objects]
        assert len(paths) == 1 and len(marks) == len(paths[0]) - 2 == shortest_paths(scene, a, b, CFG)[0] - 1
        assert scene.count("white", "circle") == 0  # markers cannot be confused with scene objects
        checked += 1
    assert checked >= 10
    # a scene holding the marker kind gets no route edit
    marked = Scene((O("circle", "white", 3, 3), O("star", "red", 0, 0), O("square", "blue", 0, 3)))
    assert sample_edit("route", marked, np.random.default_rng(0), CFG) is None


def test_highlight_keeps_what_answers_the_question():
    checked = 0
    for scene in _scenes(30, 2, busy=True):
        for fq in focus_questions(scene, CFG):
            kept = Scene(tuple(relevant_objects(fq.query, scene, CFG)))
            assert 0 < len(kept) < len(scene)
            assert answer_query(fq.query, kept, CFG) == answer_query(fq.query, scene, CFG) == fq.answer
            checked += 1
    assert checked > 100


def test_sampling_is_deterministic_and_avoids_forbidden_compositions():
    forbidden = [("white", "circle"), ("red", "star"), ("blue", "square")]
    scenes = [s for s in _scenes(60, 5) if not set(s.kinds()) & set(forbidden)]  # as training scenes
    runs = []
    for _ in range(2):
        rng = np.random.default_rng(11)
        runs.append([sample_edit(k, s, rng, CFG, forbidden) for s in scenes for k in EDIT_KINDS])
    assert runs[0] == runs[1]
    assert route_marker(CFG, forbidden) == ("gray", "circle")
    for e in runs[0]:
        if e is not None:
            new = set(e.target.kinds()) - set(e.source.kinds())
            assert not new & set(forbidden) and not any(f"{c} {s}" in e.instruction for c, s in forbidden)
    with pytest.raises(ValueError, match="unknown edit kind"):
        sample_edit("rotate", scenes[0], np.random.default_rng(0), CFG)


# ---------------------------------------------------------------------------------------------
# The built world
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    """A tiny world with the default edit/RealUnify options and the same world without those files."""
    sys.path.insert(0, str(REPO))
    from data_builders.shapes import main

    root = tmp_path_factory.mktemp("edit_worlds")
    main(["--out", str(root / "default"), *TINY])
    main(["--out", str(root / "none"), *TINY, "--edits-per-scene", "0", "--realunify-per-category", "0"])
    main(["--out", str(root / "more"), *TINY, "--edits-per-scene", "2", "--realunify-per-category", "3"])
    return root


def test_new_files_leave_every_other_file_of_the_world_unchanged(worlds):
    files = {}
    for name in ("default", "none", "more"):
        files[name] = {p.relative_to(worlds / name) for p in (worlds / name).rglob("*") if p.is_file()}
    old = {p for p in files["none"] if not p.name.startswith("edit_") and "edit" not in p.parts and p.parts[0] != "realunify"}
    assert old <= files["default"] and old <= files["more"]
    for name in ("default", "more"):
        different = [str(p) for p in old if p.name != "world.json" and not filecmp.cmp(worlds / "none" / p, worlds / name / p, shallow=False)]
        assert different == []
    infos = {n: json.loads((worlds / n / "world.json").read_text()) for n in files}
    for n in ("none", "more"):  # a non-default option is recorded, with the row counts
        assert infos[n]["build"]["edits_per_scene"] == {"none": 0, "more": 2}[n] and "edit_rows" in infos[n]
    assert infos["none"]["edit_rows"] == {"train": 0, "val": 0, "test": 0}
    assert infos["more"]["edit_rows"] == {"train": 24, "val": 8, "test": 8}
    strip = ("build", "edit_rows", "realunify_rows")
    assert {k: v for k, v in infos["none"].items() if k not in strip} == {k: v for k, v in infos["more"].items() if k not in strip}
    # the default build's world.json holds exactly the keys a build had before the edit options existed
    assert not {"edits_per_scene", "realunify_per_category"} & set(infos["default"]["build"])
    assert not {"edit_rows", "realunify_rows"} & set(infos["default"])
    assert {k: v for k, v in infos["none"].items() if k not in strip} == {k: v for k, v in infos["default"].items() if k != "build"}


def test_edit_rows_are_exact_and_their_images_parse(worlds):
    w = load_world(worlds / "more")
    rows = [json.loads(line) for line in open(w.edit_path("train"))]
    assert len(rows) == 24 and {r["kind"] for r in rows} == set(EDIT_KINDS)
    held = set(map(tuple, w.held_out))
    for r in rows:
        assert set(r) == {"id", "task", "kind", "image", "text", "target_image", "source_scene", "target_scene"}
        assert r["task"] == "edit"
        source, target = Scene.from_dict(r["source_scene"]), Scene.from_dict(r["target_scene"])
        assert parse(w.image(r["image"]), w.config) == source and parse(w.image(r["target_image"]), w.config) == target
        assert _interpret(r["text"], source) == target
        assert not any(o.kind in held for o in source.objects + target.objects)
    assert len([json.loads(line) for line in open(w.edit_path("test"))]) == 8


def test_mixture_reads_edit_rows_only_when_asked(worlds, tmp_path):
    from unicon.data.mixture import TASKS, MixtureDataset, MixtureFormatError, collate_mixture, read_mixture

    root = worlds / "default"
    plain = MixtureDataset(root, tasks=list(TASKS))
    assert plain.rows == read_mixture(root / "mixture_train.jsonl", TASKS)
    both = MixtureDataset(root, tasks=list(TASKS) + ["edit"])
    n = len(plain.rows)
    assert both.rows[:n] == plain.rows and {r["task"] for r in both.rows[n:]} == {"edit"} and len(both.rows) == n + 6
    only = MixtureDataset(root, tasks=["edit"])
    batch = collate_mixture([only[i] for i in range(len(only))])
    assert batch["tasks"] == ["edit"] * 6
    for text, image, target, row in zip(batch["texts"], batch["images"], batch["targets"], only.rows):
        assert isinstance(image, Image.Image) and isinstance(target, Image.Image) and text == row["text"]
        assert parse(target, CFG) == Scene.from_dict(row["target_scene"])
    assert only[0]["target"] is only[0]["target"]  # through the image cache
    # a malformed row names the file, the line and the key
    bad = tmp_path / "w"
    bad.mkdir()
    good = json.loads((root / "edit_train.jsonl").read_text().splitlines()[0])
    broken = {k: v for k, v in good.items() if k != "target_image"}
    (bad / "edit_train.jsonl").write_text(json.dumps(good) + "\n" + json.dumps(broken) + "\n")
    (bad / "mixture_train.jsonl").write_text((root / "mixture_train.jsonl").read_text())
    with pytest.raises(MixtureFormatError, match=r"edit_train\.jsonl:2: .*'target_image'"):
        MixtureDataset(bad, tasks=["caption", "edit"])
    (bad / "edit_train.jsonl").write_text(json.dumps({**good, "text": ""}) + "\n")
    with pytest.raises(MixtureFormatError, match=r"edit_train\.jsonl:1: .*'text'"):
        MixtureDataset(bad, tasks=["edit"])
    with pytest.raises(MixtureFormatError, match="no image-edit file"):
        MixtureDataset(tmp_path, tasks=["edit"])
    with pytest.raises(MixtureFormatError, match="no image-edit rows"):
        MixtureDataset(worlds / "none", tasks=["edit"])
