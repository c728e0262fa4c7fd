"""RealUnify in ShapesWorld: UEG prompts with exactly checkable polling questions, and GEU multiple-choice
items whose answers and stepwise edits the world verifies.

``unicon build-data shapes`` writes ``<world>/realunify/ueg.jsonl`` and ``<world>/realunify/geu.jsonl``
(:meth:`unicon.worlds.shapes.World.realunify_path`), GEU images under ``<world>/realunify/images/``.

UEG row (the documented layout of a real UEG file, plus ShapesWorld's ``check`` and ``scene``)::

    {"id", "category", "prompt", "questions": [{"question", "answer": "yes"|"no", "check": {...}}, ...],
     "scene": <one scene satisfying every requirement of the prompt>}

A prompt's polling questions verify every requirement (counts, colours, cells, exclusions, "nothing
else"): a scene gets all the expected answers iff it satisfies the prompt. :func:`answer_poll`
answers one question exactly from a parsed scene through its ``check``:

* ``{"op": "count", "where": F, "cmp": "eq"|"gt"|"lt", "n": int}`` -- the number of objects matching F;
* ``{"op": "exists", "where": F}`` -- some object matches F;
* ``{"op": "same_color", "a": F, "b": G}`` -- F and G each match exactly one object, of the same colour;

where a filter F holds keys ``color``, ``shape``, ``row``, ``col`` (equal), ``not_colors``,
``not_shapes`` (lists) and ``not_kinds`` (list of ``[color, shape]``); an empty filter matches every
object.

UEG categories built (:data:`UEG_CATEGORIES`):

* ``mathematical_reasoning`` -- "draw a board with as many red circles as five minus three and nothing
  else" (plus, minus, times, half of; one or two kinds);
* ``logical_reasoning`` -- "one star that is neither red nor blue", "a circle and a square of the same
  color, a color that is not green", "three objects, none of them a star and none of them red";
* ``code_to_image`` -- a small Python program filling a ``board`` dict of cells (assignments, a loop,
  an overwrite, a ``del``); the board after it runs is drawn, objects in their exact cells.

Left out, because ShapesWorld has no honest analogue:

* ``world_knowledge`` -- the world teaches no facts: every text row (captions, questions, think-then-draw
  scenarios) describes the scene it comes with or a scenario stated in full in the prompt, so there is
  no knowledge that a prompt could rely on without stating it;
* ``commonsense_reasoning`` and ``scientific_reasoning`` -- the world has no everyday situations and
  no physics, chemistry or biology (objects never fall, melt or grow); a "commonsense" prompt would be
  one of the categories above renamed.

GEU row (ShapesWorld JSONL; ``image`` relative to the world root)::

    {"id", "category", "image", "question", "options": [4 str], "answer": "A".."D",
     "target_scene": <the exact scene the category's stepwise edit produces>,
     "edit_instruction": <that edit's instruction, in the words of the edit rows>,
     "stepwise_question": <the question as it reads of the edited image>,
     "scene": <the image's scene>, "check": {"transform"?: {...}, "query": {...}, "values": [4 values]}}

``stepwise_question`` is what GEU stepwise asks of the edited image: a perfect edit changes the board the
question is about (the quarters are back in place, the moves are made, the route is marked), so the
direct question would no longer have its answer there ("... on the original board ...", "through empty
cells"). It asks for the same value of the edited board, with the same options and the same answer
letter: "in which quarter is the red circle?", "in which cell is the red circle?", "the shortest path from
the A to the B is marked with blue crosses in the cells between them. how many moves does it take?"
(attentional focusing keeps its question: its edit removes only what the question does not need).
``check.values`` are the options' machine values; :func:`geu_truths` evaluates which options are true on
a scene (the row's own by default) and exactly one is. GEU categories (:data:`GEU_CATEGORIES`; the
stepwise edit kind of each is :data:`GEU_EDIT_KIND`):

* ``mental_reconstruction`` -- the image is a test scene with its quarters moved one quarter clockwise
  (the fixed shuffle of the ``restore`` edit, stated in the question); the question asks where an object
  was, or what a cell held, on the original board. Options: the four quarters, or the cell's object
  with the shuffled board's content of that cell and other objects as distractors.
* ``mental_tracking`` -- a test scene and two or three moves/swaps (the ``move`` edit's steps); the
  question asks in which cell an object ends. Distractors: its start, intermediate and neighbouring cells.
  (Recolouring steps are left out so that one edit kind, ``move``, performs the stepwise step.)
* ``attentional_focusing`` -- a busy scene (a test scene plus clutter, 7-10 objects) and a focus
  question (:func:`unicon.worlds.shapes_edit.focus_questions`: counts, the colour of the only star, the
  objects sharing a row, an object's neighbour); the ``highlight`` edit keeps the relevant objects.
* ``cognitive_navigation`` -- a test scene plus obstacles; the question asks for the number of moves of
  the shortest path between two objects through empty side-by-side cells, or which cell it passes
  through (the shortest path is unique); the ``route`` edit marks it.

Answer letters are balanced per category (each letter holds a quarter of the answers, +-1) by a
seeded permutation.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from unicon.worlds.shapes import NotAShapesWorldImage, Scene, ShapeObject, WorldConfig, parse
from unicon.worlds.shapes_edit import (
    QUARTERS,
    RESTORE_INSTRUCTION,
    add_clutter,
    answer_query,
    apply_steps,
    cell_phrase,
    focus_questions,
    keep_only,
    mark_route,
    quarter_of,
    relevant_objects,
    rotate_quarters,
    route_instruction,
    route_marker,
    route_pairs,
    sample_steps,
    shortest_paths,
)
from unicon.worlds.shapes_text import (
    color_alternatives,
    number_word,
    plural,
    referring_expressions,
    resolve_expression,
    shape_alternatives,
)

UEG_CATEGORIES = ("mathematical_reasoning", "logical_reasoning", "code_to_image")
GEU_CATEGORIES = ("mental_reconstruction", "mental_tracking", "attentional_focusing", "cognitive_navigation")
#: every RealUnify category, and the ones this world leaves out (module docstring says why)
ALL_UEG_CATEGORIES = ("world_knowledge", "commonsense_reasoning", "mathematical_reasoning", "logical_reasoning",
                      "scientific_reasoning", "code_to_image")
LEFT_OUT = {"world_knowledge": "the world teaches no facts beyond the scene or scenario a text states",
            "commonsense_reasoning": "the world has no everyday situations to reason about",
            "scientific_reasoning": "the world has no physics, chemistry or biology"}
GEU_EDIT_KIND = {"mental_reconstruction": "restore", "mental_tracking": "move",
                 "attentional_focusing": "highlight", "cognitive_navigation": "route"}
LETTERS = ("A", "B", "C", "D")
RESTORE_RULE = ("this board was made from an original board by moving each of its four quarters one quarter "
                "clockwise (top left to top right, top right to bottom right, bottom right to bottom left, "
                "bottom left to top left).")


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def _pick(rng: np.random.Generator, items: Sequence):
    return items[int(rng.integers(len(items)))]


# ---------------------------------------------------------------------------------------------
# Polling questions
# ---------------------------------------------------------------------------------------------
_FILTER_KEYS = {"color", "shape", "row", "col", "not_colors", "not_shapes", "not_kinds"}


def _matches(o: ShapeObject, f: Mapping[str, Any]) -> bool:
    unknown = set(f) - _FILTER_KEYS
    if unknown:
        raise ValueError(f"unknown filter keys {sorted(unknown)}; known: {sorted(_FILTER_KEYS)}")
    return ((f.get("color") is None or o.color == f["color"]) and (f.get("shape") is None or o.shape == f["shape"])
            and (f.get("row") is None or o.row == f["row"]) and (f.get("col") is None or o.col == f["col"])
            and o.color not in f.get("not_colors", ()) and o.shape not in f.get("not_shapes", ())
            and [o.color, o.shape] not in [list(k) for k in f.get("not_kinds", ())])


def _check_vocab(f: Mapping[str, Any], cfg: WorldConfig) -> None:
    colors = [f.get("color")] + list(f.get("not_colors", ())) + [k[0] for k in f.get("not_kinds", ())]
    shapes = [f.get("shape")] + list(f.get("not_shapes", ())) + [k[1] for k in f.get("not_kinds", ())]
    for c in colors:
        if c is not None and c not in cfg.colors:
            raise ValueError(f"unknown colour {c!r} in check filter {dict(f)!r}")
    for s in shapes:
        if s is not None and s not in cfg.shapes:
            raise ValueError(f"unknown shape {s!r} in check filter {dict(f)!r}")


def answer_poll(question_row: Mapping[str, Any], scene: Scene, cfg: WorldConfig) -> str:
    """``"yes"``/``"no"``: the exact answer of one polling question (its ``check``) on ``scene``.
    ``ValueError`` when the row has no check or the check is malformed (module docstring)."""
    check = question_row.get("check")
    if not isinstance(check, Mapping):
        raise ValueError(f"polling question {question_row.get('question')!r} has no machine-checkable 'check'")
    op = check.get("op")
    try:
        if op in ("count", "exists"):
            where = check.get("where", {})
            _check_vocab(where, cfg)
            n = sum(_matches(o, where) for o in scene.objects)
            if op == "exists":
                return "yes" if n else "no"
            cmp, k = check["cmp"], int(check["n"])
            if cmp not in ("eq", "gt", "lt"):
                raise ValueError(f"unknown cmp {cmp!r} (expected eq, gt or lt)")
            return "yes" if {"eq": n == k, "gt": n > k, "lt": n < k}[cmp] else "no"
        if op == "same_color":
            _check_vocab(check["a"], cfg)
            _check_vocab(check["b"], cfg)
            a = [o for o in scene.objects if _matches(o, check["a"])]
            b = [o for o in scene.objects if _matches(o, check["b"])]
            return "yes" if len(a) == len(b) == 1 and a[0] != b[0] and a[0].color == b[0].color else "no"
    except (KeyError, TypeError) as e:
        raise ValueError(f"malformed check {dict(check)!r} ({e!r})") from None
    raise ValueError(f"unknown check op {op!r} in {dict(check)!r} (expected count, exists or same_color)")


def poll_image(row: Mapping[str, Any], image, cfg: WorldConfig) -> list[bool] | None:
    """Per polling question, does ``image`` give the expected answer? None when the image does not parse."""
    try:
        scene = parse(image, cfg)
    except NotAShapesWorldImage:
        return None
    return [answer_poll(q, scene, cfg) == q["answer"] for q in row["questions"]]


def _q(text: str, check: dict, answer: str) -> dict[str, Any]:
    """A polling question with the answer the prompt requires (checked against the intended scene by
    :func:`ueg_rows`)."""
    return {"question": text, "answer": answer, "check": check}


def _kind_np(n: int, color: str, shape: str) -> str:
    return f"{number_word(n)} {color} {shape if n == 1 else plural(shape)}"


def _place(kinds: Sequence[tuple[str, str]], rng: np.random.Generator, cfg: WorldConfig) -> Scene:
    cells = rng.choice(cfg.grid * cfg.grid, size=len(kinds), replace=False)
    return Scene(tuple(ShapeObject(s, c, int(k) // cfg.grid, int(k) % cfg.grid) for (c, s), k in zip(kinds, cells)))


def _two_kinds(rng, cfg) -> tuple[tuple[str, str], tuple[str, str]]:
    a = (_pick(rng, cfg.color_names), _pick(rng, cfg.shapes))
    b = (_pick(rng, [c for c in cfg.color_names if c != a[0]]), _pick(rng, [s for s in cfg.shapes if s != a[1]]))
    return a, b


# ---------------------------------------------------------------------------------------------
# UEG prompts
# ---------------------------------------------------------------------------------------------
def _expression(value: int, rng: np.random.Generator) -> str:
    """Words for an arithmetic expression equal to ``value``: a sum, a difference (subtrahend 1-4), a
    product of factors >= 2, or "half of"."""
    forms = []
    for a in range(1, value):
        forms.append(f"{number_word(a)} plus {number_word(value - a)}")
    for b in range(1, 5):
        forms.append(f"{number_word(value + b)} minus {number_word(b)}")
    for a in range(2, value + 1):
        if value % a == 0 and value // a >= 2:
            forms.append(f"{number_word(a)} times {number_word(value // a)}")
    forms.append(f"half of {number_word(2 * value)}")
    return _pick(rng, forms)


def _math(rng, cfg: WorldConfig):
    two = cfg.max_objects >= 2 and rng.random() < 0.4
    kinds = list(_two_kinds(rng, cfg)) if two else [(_pick(rng, cfg.color_names), _pick(rng, cfg.shapes))]
    counts = [int(rng.integers(1, cfg.max_objects - (len(kinds) - 1) + 1))]
    if two:
        counts.append(int(rng.integers(1, cfg.max_objects - counts[0] + 1)))
    parts = [f"as many {c} {plural(s)} as {_expression(n, rng)}" for (c, s), n in zip(kinds, counts)]
    prompt = f"draw a board with {' and '.join(parts)}, and nothing else."
    scene = _place([k for k, n in zip(kinds, counts) for _ in range(n)], rng, cfg)
    qs = []
    for (c, s), n in zip(kinds, counts):
        qs.append(_q(f"are there exactly {number_word(n)} {c} {plural(s)}?",
                     {"op": "count", "where": {"color": c, "shape": s}, "cmp": "eq", "n": n}, "yes"))
        off = n + 1 if n == 1 or rng.random() < 0.5 else n - 1
        qs.append(_q(f"are there exactly {number_word(off)} {c} {plural(s)}?",
                     {"op": "count", "where": {"color": c, "shape": s}, "cmp": "eq", "n": off}, "no"))
    names = " or ".join(f"{_article(c)} {c} {s}" for c, s in kinds)
    qs.append(_q(f"is there any object that is not {names}?",
                 {"op": "exists", "where": {"not_kinds": [list(k) for k in kinds]}}, "no"))
    return prompt, qs, scene


def _logic(rng, cfg: WorldConfig):
    form = _pick(rng, ("neither", "same_color", "none_of") if cfg.max_objects >= 2 else ("neither",))
    if form == "neither":
        s = _pick(rng, cfg.shapes)
        c1, c2 = (cfg.color_names[i] for i in rng.choice(len(cfg.colors), size=2, replace=False))
        prompt = f"draw one {s} that is neither {c1} nor {c2}, and nothing else."
        scene = _place([(_pick(rng, [c for c in cfg.color_names if c not in (c1, c2)]), s)], rng, cfg)
        qs = [_q(f"is there exactly one {s}?", {"op": "count", "where": {"shape": s}, "cmp": "eq", "n": 1}, "yes"),
              _q(f"is there {_article(c1)} {c1} {s}?", {"op": "exists", "where": {"color": c1, "shape": s}}, "no"),
              _q(f"is there {_article(c2)} {c2} {s}?", {"op": "exists", "where": {"color": c2, "shape": s}}, "no"),
              _q(f"is there any object that is not {_article(s)} {s}?",
                 {"op": "exists", "where": {"not_shapes": [s]}}, "no")]
        return prompt, qs, scene
    if form == "same_color":
        s1, s2 = (cfg.shapes[i] for i in rng.choice(len(cfg.shapes), size=2, replace=False))
        c = _pick(rng, cfg.color_names)
        prompt = f"draw {_article(s1)} {s1} and {_article(s2)} {s2} of the same color, a color that is not {c}, and nothing else."
        shared = _pick(rng, [x for x in cfg.color_names if x != c])
        scene = _place([(shared, s1), (shared, s2)], rng, cfg)
        qs = [_q(f"is there exactly one {s1}?", {"op": "count", "where": {"shape": s1}, "cmp": "eq", "n": 1}, "yes"),
              _q(f"is there exactly one {s2}?", {"op": "count", "where": {"shape": s2}, "cmp": "eq", "n": 1}, "yes"),
              _q(f"are the {s1} and the {s2} the same color?",
                 {"op": "same_color", "a": {"shape": s1}, "b": {"shape": s2}}, "yes"),
              _q(f"is there {_article(c)} {c} object?", {"op": "exists", "where": {"color": c}}, "no"),
              _q(f"is there any object that is neither {_article(s1)} {s1} nor {_article(s2)} {s2}?",
                 {"op": "exists", "where": {"not_shapes": [s1, s2]}}, "no")]
        return prompt, qs, scene
    n = int(rng.integers(2, cfg.max_objects + 1))
    s, c = _pick(rng, cfg.shapes), _pick(rng, cfg.color_names)
    prompt = f"draw {number_word(n)} objects, none of them {_article(s)} {s} and none of them {c}."
    kinds = [(_pick(rng, [x for x in cfg.color_names if x != c]), _pick(rng, [x for x in cfg.shapes if x != s]))
             for _ in range(n)]
    scene = _place(kinds, rng, cfg)
    qs = [_q(f"are there exactly {number_word(n)} objects?", {"op": "count", "where": {}, "cmp": "eq", "n": n}, "yes"),
          _q(f"is there {_article(s)} {s}?", {"op": "exists", "where": {"shape": s}}, "no"),
          _q(f"is there {_article(c)} {c} object?", {"op": "exists", "where": {"color": c}}, "no")]
    return prompt, qs, scene


def _code(rng, cfg: WorldConfig):
    """A program over ``board`` (a dict (row, col) -> "color shape"); returns prompt, polls, final scene."""
    n_final = int(rng.integers(1, cfg.max_objects + 1))
    lines = ["board = {}  # (row, column) -> object; (0, 0) is the top left cell, rows go down"]
    board: dict[tuple[int, int], tuple[str, str]] = {}
    gone: list[tuple[tuple[int, int], tuple[str, str]]] = []  # (cell, object) no longer on the board

    def kind():
        return _pick(rng, cfg.color_names), _pick(rng, cfg.shapes)

    def free():
        return [(r, c) for r in range(cfg.grid) for c in range(cfg.grid) if (r, c) not in board]

    if n_final >= 2 and rng.random() < 0.4:  # a loop along a row or column
        k, length = kind(), int(rng.integers(2, min(n_final, cfg.grid) + 1))
        line = int(rng.integers(cfg.grid))
        start = int(rng.integers(cfg.grid - length + 1))
        if rng.random() < 0.5:
            lines.append(f"for col in range({start}, {start + length}):\n    board[({line}, col)] = \"{k[0]} {k[1]}\"")
            board.update({(line, col): k for col in range(start, start + length)})
        else:
            lines.append(f"for row in range({start}, {start + length}):\n    board[(row, {line})] = \"{k[0]} {k[1]}\"")
            board.update({(row, line): k for row in range(start, start + length)})
    while len(board) < n_final:
        cell, k = _pick(rng, free()), kind()
        lines.append(f"board[{cell}] = \"{k[0]} {k[1]}\"")
        board[cell] = k
    if rng.random() < 0.5:  # overwrite one cell
        cell = _pick(rng, sorted(board))
        k = _pick(rng, [x for x in ((c, s) for c in cfg.color_names for s in cfg.shapes) if x != board[cell]])
        gone.append((cell, board[cell]))
        lines.append(f"board[{cell}] = \"{k[0]} {k[1]}\"")
        board[cell] = k
    if len(board) < cfg.grid * cfg.grid and rng.random() < 0.5:  # an extra object deleted again
        cell, k = _pick(rng, free()), kind()
        lines += [f"board[{cell}] = \"{k[0]} {k[1]}\"", f"del board[{cell}]"]
        gone.append((cell, k))
    prompt = ("task: code to board\ncode:\n" + "\n".join(lines) +
              "\n\ndraw one object in its cell for every entry of `board` after the code runs, and nothing else.")
    scene = Scene(tuple(ShapeObject(s, c, r, col) for (r, col), (c, s) in board.items()))
    qs = [_q(f"is there {_article(c)} {c} {s} in {cell_phrase(r, col)}?",
             {"op": "exists", "where": {"color": c, "shape": s, "row": r, "col": col}}, "yes")
          for (r, col), (c, s) in sorted(board.items())]
    qs += [_q(f"is there {_article(c)} {c} {s} in {cell_phrase(r, col)}?",
              {"op": "exists", "where": {"color": c, "shape": s, "row": r, "col": col}}, "no")
           for (r, col), (c, s) in gone]
    qs.append(_q(f"are there exactly {number_word(len(board))} objects on the board?",
                 {"op": "count", "where": {}, "cmp": "eq", "n": len(board)}, "yes"))
    if not gone:  # a requirement the board must not meet, so that the list is not all "yes"
        qs.append(_q(f"are there exactly {number_word(len(board) + 1)} objects on the board?",
                     {"op": "count", "where": {}, "cmp": "eq", "n": len(board) + 1}, "no"))
    return prompt, qs, scene


UEG_GENERATORS = {"mathematical_reasoning": _math, "logical_reasoning": _logic, "code_to_image": _code}


def ueg_rows(cfg: WorldConfig, per_category: int, seed: int) -> list[dict[str, Any]]:
    """``per_category`` distinct prompts per UEG category (fewer when the world has fewer), each with
    its polling questions and one intended scene; a function of ``seed``."""
    rows = []
    for ci, cat in enumerate(UEG_CATEGORIES):
        rng = np.random.default_rng([seed, 47, ci])
        seen: set[str] = set()
        misses = 0
        while len(seen) < per_category and misses < 50 * (per_category + 10):
            prompt, qs, scene = UEG_GENERATORS[cat](rng, cfg)
            wrong = [q["question"] for q in qs if answer_poll(q, scene, cfg) != q["answer"]]
            if wrong:  # the intended scene must satisfy the prompt's requirements
                raise RuntimeError(f"{cat}: intended scene of {prompt!r} fails {wrong}")
            if prompt in seen:
                misses += 1
                continue
            seen.add(prompt)
            rows.append({"id": f"ueg-{cat}-{len(seen) - 1:04d}", "category": cat, "prompt": prompt,
                         "questions": qs, "scene": scene.to_dict()})
    return rows


# ---------------------------------------------------------------------------------------------
# GEU items
# ---------------------------------------------------------------------------------------------
def _cell_value(scene: Scene, r: int, c: int) -> str:
    found = [o for o in scene.objects if (o.row, o.col) == (r, c)]
    return f"{_article(found[0].color)} {found[0].color} {found[0].shape}" if found else "nothing"


def evaluate_geu_query(check: Mapping[str, Any], scene: Scene, cfg: WorldConfig) -> Any:
    """The answer value of a GEU ``check`` on ``scene``: its ``transform`` applied (``unrotate``: the
    quarters moved one quarter back; ``steps``: :func:`apply_steps`), then its ``query``: a focus query
    (:func:`unicon.worlds.shapes_edit.answer_query`), ``quarter_of`` / ``position_of`` an object
    (a quarter name / ``[row, col]``), ``cell`` (what a cell holds: "a red circle" or "nothing"),
    ``path_length`` (moves of the shortest path) or ``path_cells`` (the cells strictly inside the
    unique shortest path, a list)."""
    t = check.get("transform")
    if t is not None:
        if t.get("op") == "unrotate":
            scene = rotate_quarters(scene, cfg, -1)
        elif t.get("op") == "steps":
            scene = apply_steps(scene, t["steps"], cfg)
        else:
            raise ValueError(f"unknown GEU transform {t!r}")
    q = check["query"]
    kind = q.get("q")
    if kind == "quarter_of":
        o = resolve_expression(q["ref"], scene, cfg)
        return quarter_of(o.row, o.col, cfg)
    if kind == "position_of":
        o = resolve_expression(q["ref"], scene, cfg)
        return [o.row, o.col]
    if kind == "cell":
        return _cell_value(scene, int(q["row"]), int(q["col"]))
    if kind in ("path_length", "path_cells"):
        a, b = resolve_expression(q["from"], scene, cfg), resolve_expression(q["to"], scene, cfg)
        steps, ways, cells = shortest_paths(scene, a, b, cfg)
        if steps is None:
            raise ValueError(f"no path from the {q['from']} to the {q['to']}")
        if kind == "path_length":
            return steps
        if ways != 1:
            raise ValueError(f"the shortest path from the {q['from']} to the {q['to']} is not unique")
        return [list(c) for c in cells]
    return answer_query(q, scene, cfg)


def geu_truths(row: Mapping[str, Any], cfg: WorldConfig, scene: Scene | None = None) -> list[bool]:
    """Which options of a GEU row are true, evaluated by the world on ``scene`` (default: the row's own
    image scene). A ``path_cells`` option is true when its cell is on the path."""
    scene = Scene.from_dict(row["scene"]) if scene is None else scene
    check = row["check"]
    result = evaluate_geu_query(check, scene, cfg)
    if check["query"].get("q") == "path_cells":
        return [list(v) in result for v in check["values"]]
    return [v == result for v in check["values"]]


def stepwise_truths(row: Mapping[str, Any], cfg: WorldConfig, scene: Scene) -> list[bool]:
    """Which options of a GEU row are true for its ``stepwise_question`` on ``scene``, the edited board:
    the row's query without its transform (the edit has made it); for a navigation row, the marked route
    (``check.marker`` objects): its length is the number of markers plus one, and an option cell is on it
    when it holds a marker."""
    check, values = row["check"], row["check"]["values"]
    kind = check["query"].get("q")
    if kind in ("path_length", "path_cells"):
        marker = tuple(check["marker"])
        cells = [[o.row, o.col] for o in scene.objects if o.kind == marker]
        if kind == "path_length":
            return [v == len(cells) + 1 for v in values]
        return [list(v) in cells for v in values]
    result = evaluate_geu_query({"query": check["query"]}, scene, cfg)
    return [v == result for v in values]


def geu_answer(row: Mapping[str, Any], cfg: WorldConfig, scene: Scene | None = None) -> str:
    """The letter of the one true option (``ValueError`` unless exactly one option is true)."""
    truths = geu_truths(row, cfg, scene)
    if sum(truths) != 1:
        raise ValueError(f"GEU row {row.get('id')}: {sum(truths)} options are true, expected exactly one")
    return LETTERS[truths.index(True)]


def check_geu(row: Mapping[str, Any], image_or_scene, cfg: WorldConfig) -> bool:
    """Is a stepwise edit's output (image or scene) exactly the row's ``target_scene``? An image that
    does not parse is a miss."""
    if isinstance(image_or_scene, Scene):
        scene = image_or_scene
    else:
        try:
            scene = parse(image_or_scene, cfg)
        except NotAShapesWorldImage:
            return False
    return scene == Scene.from_dict(row["target_scene"])


def _cell_words(v) -> str:
    return cell_phrase(*v)


def _number_options(answer: int, rng, extra: Sequence[int] = ()) -> list[int]:
    near = [v for v in dict.fromkeys([*extra, answer - 1, answer + 1, answer - 2, answer + 2, answer + 3])
            if v >= 0 and v != answer]
    return [answer] + near[:3]


def _reconstruction(scene: Scene, rng, cfg: WorldConfig):
    if cfg.grid % 2 or not len(scene):
        return None
    shuffled = rotate_quarters(scene, cfg, 1)
    if shuffled == scene:
        return None
    refs = [(o, e) for o in scene.objects for e in referring_expressions(o, scene)]
    if refs and rng.random() < 0.5:
        o, e = _pick(rng, refs)
        values = [quarter_of(o.row, o.col, cfg)] + [q for q in QUARTERS if q != quarter_of(o.row, o.col, cfg)]
        question = f"{RESTORE_RULE} on the original board, in which quarter was the {e}?"
        check = {"transform": {"op": "unrotate"}, "query": {"q": "quarter_of", "ref": e}}
        return (shuffled, question, check, values, list(values), scene, RESTORE_INSTRUCTION,
                f"in which quarter is the {e}?")
    o = _pick(rng, scene.objects)
    r, c = o.row, o.col
    answer = _cell_value(scene, r, c)
    pool = [_cell_value(shuffled, r, c)] + [_cell_value(scene, x.row, x.col) for x in scene.objects] + ["nothing"]
    pool += [f"{_article(col)} {col} {o.shape}" for col in color_alternatives(o.color, cfg)]
    values = [answer] + [v for v in dict.fromkeys(pool) if v != answer][:3]
    question = f"{RESTORE_RULE} on the original board, what was in {cell_phrase(r, c)}?"
    check = {"transform": {"op": "unrotate"}, "query": {"q": "cell", "row": r, "col": c}}
    return (shuffled, question, check, values, list(values), scene, RESTORE_INSTRUCTION,
            f"what is in {cell_phrase(r, c)}?")


def _tracking(scene: Scene, rng, cfg: WorldConfig):
    drawn = sample_steps(scene, rng, cfg, int(rng.integers(2, 4)))
    if drawn is None:
        return None
    specs, words, final = drawn
    refs = [(o, e) for o in scene.objects for e in referring_expressions(o, scene)]
    moved = [(o, e) for o, e in refs if resolve_expression(e, final, cfg) != o]
    if not moved:
        return None
    o, e = _pick(rng, moved)
    end = resolve_expression(e, final, cfg)
    answer = [end.row, end.col]
    path = [[o.row, o.col]]
    cur = scene
    for s in specs:
        cur = apply_steps(cur, [s], cfg)
        x = resolve_expression(e, cur, cfg)
        path.append([x.row, x.col])
    near = [[end.row + dr, end.col + dc] for dr, dc in ((0, 1), (0, -1), (1, 0), (-1, 0), (1, 1), (-1, -1), (1, -1), (-1, 1))]
    near = [v for v in near if 0 <= v[0] < cfg.grid and 0 <= v[1] < cfg.grid]
    pool = [v for v in path[:-1] if v != answer] + [near[i] for i in rng.permutation(len(near))]
    values = [answer]
    for v in pool:
        if v not in values and len(values) < 4:
            values.append(v)
    steps_text = ", then ".join(words)
    question = f"make these moves on the board: {steps_text}. after the moves, in which cell is the {e}?"
    check = {"transform": {"op": "steps", "steps": specs}, "query": {"q": "position_of", "ref": e}}
    return (scene, question, check, values, [_cell_words(v) for v in values], final, steps_text,
            f"in which cell is the {e}?")


def _focusing(scene: Scene, rng, cfg: WorldConfig):
    cap = min(cfg.grid * cfg.grid - 1, 10)
    busy = add_clutter(scene, rng, cfg, int(rng.integers(min(7, cap), cap + 1)) - len(scene))
    questions = focus_questions(busy, cfg)
    if not questions:
        return None
    fq = _pick(rng, questions)
    q = fq.query["q"]
    if q in ("count", "line_count"):
        values = _number_options(fq.answer, rng)
        options = [number_word(v) for v in values]
    elif q == "color_of":
        values = [fq.answer] + color_alternatives(fq.answer, cfg)[:3]
        options = list(values)
    else:
        values = [fq.answer] + shape_alternatives(fq.answer, cfg)[:3]
        options = list(values)
    target = keep_only(busy, relevant_objects(fq.query, busy, cfg))
    return (busy, fq.text, {"query": fq.query}, values, options, target,
            f"keep only the objects needed to answer: {fq.text}", fq.text)


def _navigation(scene: Scene, rng, cfg: WorldConfig):
    marker = route_marker(cfg)
    if scene.count(*marker):
        return None
    cap = min(cfg.grid * cfg.grid - 2, 9)
    busy = add_clutter(scene, rng, cfg, int(rng.integers(min(6, cap), cap + 1)) - len(scene), avoid_kinds=[marker])
    pairs = [p for p in route_pairs(busy, cfg) if p[2] >= 3] or route_pairs(busy, cfg)
    if not pairs:
        return None
    a, b, steps, cells = _pick(rng, pairs)
    ea, eb = f"{a.color} {a.shape}", f"{b.color} {b.shape}"
    lead = "moving one cell at a time to a side-by-side empty cell,"
    marked = f"the shortest path from the {ea} to the {eb} is marked with {marker[0]} {plural(marker[1])} in the cells between them."
    if rng.random() < 0.5:
        manhattan = abs(a.row - b.row) + abs(a.col - b.col)
        values = _number_options(steps, rng, extra=[manhattan])
        options = [number_word(v) for v in values]
        question = f"{lead} how many moves does the shortest path from the {ea} to the {eb} take?"
        after = f"{marked} how many moves does it take?"
        check = {"query": {"q": "path_length", "from": ea, "to": eb}, "marker": list(marker)}
    else:
        on = [list(c) for c in cells]
        empty = {(r, c) for r in range(cfg.grid) for c in range(cfg.grid)} - {(o.row, o.col) for o in busy.objects}
        off = sorted(set(empty) - set(cells))
        if len(off) < 3:
            return None
        # distractors next to the path first (near misses), then any other empty cell
        touching = [c for c in off if any(abs(c[0] - p[0]) + abs(c[1] - p[1]) == 1 for p in cells)]
        rest = [c for c in off if c not in touching]
        ordered = [touching[i] for i in rng.permutation(len(touching))] + [rest[i] for i in rng.permutation(len(rest))]
        values = [_pick(rng, on)] + [list(c) for c in ordered[:3]]
        options = [_cell_words(v) for v in values]
        question = f"{lead} which of these cells does the shortest path from the {ea} to the {eb} pass through?"
        after = f"{marked} which of these cells holds one of them?"
        check = {"query": {"q": "path_cells", "from": ea, "to": eb}, "marker": list(marker)}
    target = mark_route(busy, cells, marker)
    return busy, question, check, values, options, target, route_instruction(a, b, marker), after


GEU_GENERATORS = {"mental_reconstruction": _reconstruction, "mental_tracking": _tracking,
                  "attentional_focusing": _focusing, "cognitive_navigation": _navigation}


def geu_items(cfg: WorldConfig, scenes: Sequence[Scene], per_category: int, seed: int) -> list[tuple[dict[str, Any], Scene]]:
    """``(row without "image", image scene)`` pairs: up to ``per_category`` distinct items per GEU category
    drawn from ``scenes`` (the test split), answer letters balanced by a seeded permutation."""
    out = []
    if not scenes or per_category <= 0:
        return out
    for ci, cat in enumerate(GEU_CATEGORIES):
        rng = np.random.default_rng([seed, 53, ci])
        seen: set[tuple] = set()
        drawn = []
        tries = 0
        while len(drawn) < per_category and tries < 50 * (per_category + 10):
            tries += 1
            item = GEU_GENERATORS[cat](scenes[int(rng.integers(len(scenes)))], rng, cfg)
            if item is None:
                continue
            key = (item[0].key(), item[1])
            if key in seen or len(item[3]) != 4 or len({str(v) for v in item[3]}) != 4:
                continue
            seen.add(key)
            drawn.append(item)
        # the answer (values[0]) goes to a letter of a balanced, shuffled list; distractors in random order
        letters = np.tile(np.arange(4), -(-len(drawn) // 4))[:len(drawn)][rng.permutation(len(drawn))]
        for k, (image_scene, question, check, values, options, target, instruction, after) in enumerate(drawn):
            pos = int(letters[k])
            order = [1 + i for i in rng.permutation(3)]
            order.insert(pos, 0)
            row = {"id": f"geu-{cat}-{k:04d}", "category": cat, "question": question,
                   "options": [options[i] for i in order], "answer": LETTERS[pos],
                   "target_scene": target.to_dict(), "edit_instruction": instruction, "stepwise_question": after,
                   "scene": image_scene.to_dict(), "check": {**check, "values": [values[i] for i in order]}}
            if geu_answer(row, cfg, image_scene) != row["answer"]:  # the world verifies the one answer
                raise RuntimeError(f"GEU {cat} item {question!r}: the world's answer is not the drawn one")
            out.append((row, image_scene))
    return out


__all__ = [
    "UEG_CATEGORIES", "GEU_CATEGORIES", "ALL_UEG_CATEGORIES", "LEFT_OUT", "GEU_EDIT_KIND", "LETTERS", "RESTORE_RULE",
    "answer_poll", "poll_image", "ueg_rows", "geu_items", "geu_truths", "stepwise_truths", "geu_answer", "check_geu", "evaluate_geu_query",
]
