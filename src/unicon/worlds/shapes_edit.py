"""ShapesWorld image edits: (source scene, instruction) -> target scene, every target exact.

An :class:`Edit` holds an instruction (lowercase ASCII, in the world's caption/question style) and
two scenes; the instruction and the source determine the target exactly, so an edited image is
checked by parsing it (:func:`edit_matches`). :func:`sample_edit` draws one edit of a kind for a
scene (``None`` when the kind does not apply to it). Words used by the instructions:

* objects are named by referring expressions that pick out one object of the source
  (:func:`unicon.worlds.shapes_text.referring_expressions`: "red circle", "circle", "red object");
* cells are named "the <ordinal> row and <ordinal> column", rows counted from the top and columns
  from the left, starting at "first" (so the top left cell is "the first row and first column");
* "just left of X" / "just right of X" / "just above X" / "just below X" is the side-by-side cell
  next to X (grid relations in general hold across whole rows/columns; "just" means adjacent);
* "n cells left/right/up/down" moves an object by n cells along its row or column.

The kinds (:data:`EDIT_KINDS`):

``recolor``
    "paint the red circle blue": that object takes the colour; nothing else changes.
``move``
    one to three steps joined by ", then ", each either "move the X two cells left", "move the X to
    the second row and third column" (the destination is empty when the step is made) or "swap the X
    and the Y" (the two objects exchange cells). Objects keep their colour and shape, so an
    expression names the same object at every step. This is the stepwise edit of RealUnify's mental
    tracking (the GEU question describes the same steps).
``add``
    "add a blue square just left of the red circle" or "... in the second row and third column"
    (an empty cell); only while the scene has fewer than ``cfg.max_objects`` objects.
``remove``
    "remove the red circle", or a group: "remove all the red objects" / "all the circles" / "all the
    red circles"; never empties the board.
``restore``
    the source is the scene with its four quarters (``grid/2 x grid/2`` blocks) each moved one step
    clockwise (top left -> top right -> bottom right -> bottom left -> top left, every object keeping
    its place inside its quarter); the target is the scene itself. The shuffle is always this fixed,
    documented one, and the instruction (:data:`RESTORE_INSTRUCTION`) says so, so the target is a
    function of the source alone (a natural photo can be unshuffled from its content; a board of
    shapes cannot, so the rule has to be fixed). Needs an even grid. Note: for ``restore``,
    ``sample_edit(..., scene)`` returns ``source != scene`` and ``target == scene``.
``highlight``
    keep only the objects relevant to a request and remove the rest: "keep only the red objects" /
    "... the circles" / "... the red circles", or "keep only the objects needed to answer: <question>"
    for a focus question (:func:`focus_questions`; each question type defines its relevant objects,
    :func:`relevant_objects`, and answering it on the kept objects gives the same answer). The
    stepwise edit of RealUnify's attentional focusing.
``route``
    "mark the shortest path from the red star to the blue square with white circles": every cell
    strictly between the two objects on the shortest 4-connected path through empty cells gets one
    marker object. The marker kind (:func:`route_marker`: white circle unless held out, else the
    next of :data:`ROUTE_MARKERS`) is named in the instruction, never occurs in the source (the edit
    does not apply to a scene holding one, so markers and scene objects cannot be confused), and the
    edit applies only when the shortest path is unique and passes at least one empty cell. Markers
    may take the board past ``cfg.max_objects`` (they are marks, not scene objects). The stepwise
    edit of RealUnify's cognitive navigation.

All sampling uses the ``rng`` passed in, so an edit is a function of (kind, scene, rng state, cfg).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from unicon.worlds.shapes import NotAShapesWorldImage, Scene, ShapeObject, WorldConfig, parse
from unicon.worlds.shapes_text import number_word, plural, referring_expressions, resolve_expression

EDIT_KINDS = ("recolor", "move", "add", "remove", "restore", "highlight", "route")
ORDINALS = ("first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth", "tenth",
            "eleventh", "twelfth", "thirteenth", "fourteenth", "fifteenth", "sixteenth")
#: step direction -> (d_row, d_col)
DIRECTIONS = {"left": (0, -1), "right": (0, 1), "up": (-1, 0), "down": (1, 0)}
#: adjacent-cell relation -> (d_row, d_col) and its phrase
SIDES = {"left": ((0, -1), "just left of"), "right": ((0, 1), "just right of"),
         "above": ((-1, 0), "just above"), "below": ((1, 0), "just below")}
#: the four quarters in clockwise order; a restore source moves each one step along this list
QUARTERS = ("top left", "top right", "bottom right", "bottom left")
_QUARTER_BLOCK = {"top left": (0, 0), "top right": (0, 1), "bottom right": (1, 1), "bottom left": (1, 0)}
RESTORE_INSTRUCTION = ("restore the board: each of its four quarters was moved one quarter clockwise, "
                       "so move every quarter one quarter back")
#: route marker kinds (color, shape), in order of preference (:func:`route_marker`)
ROUTE_MARKERS = (("white", "circle"), ("gray", "circle"), ("white", "square"), ("gray", "square"),
                 ("white", "diamond"), ("gray", "diamond"))


@dataclass(frozen=True)
class Edit:
    """One edit: ``instruction`` turns ``source`` into exactly ``target``."""

    kind: str
    instruction: str
    source: Scene
    target: Scene


# ---------------------------------------------------------------------------------------------
# Words
# ---------------------------------------------------------------------------------------------
def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def cell_phrase(row: int, col: int) -> str:
    """``"the second row and third column"`` for (1, 2) (rows from the top, columns from the left)."""
    return f"the {ORDINALS[row]} row and {ORDINALS[col]} column"


def cells_phrase(n: int) -> str:
    return f"{number_word(n)} cell" + ("" if n == 1 else "s")


def quarter_of(row: int, col: int, cfg: WorldConfig) -> str:
    """Name of the quarter (:data:`QUARTERS`) holding cell (row, col) of an even grid."""
    h = cfg.grid // 2
    return {v: k for k, v in _QUARTER_BLOCK.items()}[(row // h, col // h)]


def _pick(rng: np.random.Generator, items: Sequence):
    return items[int(rng.integers(len(items)))]


def _expressions(scene: Scene) -> list[tuple[ShapeObject, str]]:
    return [(o, e) for o in scene.objects for e in referring_expressions(o, scene)]


def _empty_cells(scene: Scene, cfg: WorldConfig) -> list[tuple[int, int]]:
    used = {(o.row, o.col) for o in scene.objects}
    return [(r, c) for r in range(cfg.grid) for c in range(cfg.grid) if (r, c) not in used]


def _replace(scene: Scene, old: ShapeObject, new: ShapeObject | None) -> Scene:
    return Scene(tuple(o for o in scene.objects if o != old) + ((new,) if new is not None else ()))


def _kinds(cfg: WorldConfig, forbidden) -> list[tuple[str, str]]:
    bad = set(map(tuple, forbidden))
    return [(c, s) for c in cfg.color_names for s in cfg.shapes if (c, s) not in bad]


# ---------------------------------------------------------------------------------------------
# Moves (also the mental-tracking steps)
# ---------------------------------------------------------------------------------------------
def apply_steps(scene: Scene, steps: Sequence[dict[str, Any]], cfg: WorldConfig | None = None) -> Scene:
    """The scene after ``steps``: ``{"op": "move", "ref": expr, "to": [row, col]}`` moves the object
    ``expr`` names to an empty cell; ``{"op": "swap", "refs": [expr, expr]}`` exchanges two objects'
    cells. ``ValueError`` when an expression does not name exactly one object, a destination is
    occupied or off the grid, or a step is malformed."""
    for k, step in enumerate(steps):
        op = step.get("op")
        if op == "move":
            obj = resolve_expression(step["ref"], scene, cfg)
            r, c = (int(v) for v in step["to"])
            if cfg is not None and not (0 <= r < cfg.grid and 0 <= c < cfg.grid):
                raise ValueError(f"step {k}: cell ({r}, {c}) is off the grid")
            if any((o.row, o.col) == (r, c) for o in scene.objects if o != obj):
                raise ValueError(f"step {k}: cell ({r}, {c}) is occupied")
            scene = _replace(scene, obj, ShapeObject(obj.shape, obj.color, r, c))
        elif op == "swap":
            a, b = (resolve_expression(e, scene, cfg) for e in step["refs"])
            if a == b:
                raise ValueError(f"step {k}: both expressions name the same object")
            scene = Scene(tuple(o for o in scene.objects if o not in (a, b)) + (
                ShapeObject(a.shape, a.color, b.row, b.col), ShapeObject(b.shape, b.color, a.row, a.col)))
        else:
            raise ValueError(f"step {k}: unknown op {op!r} (expected move or swap)")
    return scene


def sample_step(scene: Scene, rng: np.random.Generator, cfg: WorldConfig) -> tuple[dict[str, Any], str] | None:
    """One move/swap step on ``scene`` (spec for :func:`apply_steps`, and its words), or None."""
    refs = _expressions(scene)
    if not refs:
        return None
    form = _pick(rng, ("direction", "cell", "swap"))
    if form == "swap":
        if len(refs) >= 2:
            (a, ea), (b, eb) = refs[int(rng.integers(len(refs)))], refs[int(rng.integers(len(refs)))]
            if a != b:
                return {"op": "swap", "refs": [ea, eb]}, f"swap the {ea} and the {eb}"
        form = "direction"
    obj, expr = _pick(rng, refs)
    empty = set(_empty_cells(scene, cfg))
    if form == "direction":
        options = [(d, n) for d, (dr, dc) in DIRECTIONS.items() for n in range(1, cfg.grid)
                   if (obj.row + n * dr, obj.col + n * dc) in empty]
        if options:
            d, n = _pick(rng, options)
            to = [obj.row + n * DIRECTIONS[d][0], obj.col + n * DIRECTIONS[d][1]]
            return {"op": "move", "ref": expr, "to": to}, f"move the {expr} {cells_phrase(n)} {d}"
    if not empty:
        return None
    r, c = _pick(rng, sorted(empty))
    return {"op": "move", "ref": expr, "to": [r, c]}, f"move the {expr} to {cell_phrase(r, c)}"


def sample_steps(scene: Scene, rng: np.random.Generator, cfg: WorldConfig, n: int) -> tuple[list[dict], list[str], Scene] | None:
    """``n`` successive steps (specs, words, final scene); None when a step cannot be drawn."""
    specs, words, cur = [], [], scene
    for _ in range(n):
        step = sample_step(cur, rng, cfg)
        if step is None:
            return None
        specs.append(step[0])
        words.append(step[1])
        cur = apply_steps(cur, [step[0]], cfg)
    return specs, words, cur


# ---------------------------------------------------------------------------------------------
# Restore (quarter shuffle)
# ---------------------------------------------------------------------------------------------
def rotate_quarters(scene: Scene, cfg: WorldConfig, steps: int = 1) -> Scene:
    """Each quarter moved ``steps`` quarters clockwise (negative: anticlockwise), objects keeping their
    place inside the quarter. ``ValueError`` on an odd grid."""
    if cfg.grid % 2:
        raise ValueError(f"a {cfg.grid}x{cfg.grid} grid has no quarters (needs an even grid)")
    h = cfg.grid // 2
    objs = []
    for o in scene.objects:
        q = QUARTERS.index(quarter_of(o.row, o.col, cfg))
        br, bc = _QUARTER_BLOCK[QUARTERS[(q + steps) % 4]]
        objs.append(ShapeObject(o.shape, o.color, br * h + o.row % h, bc * h + o.col % h))
    return Scene(tuple(objs))


# ---------------------------------------------------------------------------------------------
# Focus questions (highlight edits, attentional focusing)
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FocusQuestion:
    """A question about part of a scene: ``query`` (machine form), its answer, the relevant objects."""

    text: str
    query: dict[str, Any]
    answer: Any


def answer_query(query: dict[str, Any], scene: Scene, cfg: WorldConfig | None = None) -> Any:
    """Exact answer of a focus query on ``scene`` (``ValueError`` when ill-posed):

    * ``{"q": "count", "color"?, "shape"?}`` -> number of matching objects;
    * ``{"q": "color_of", "ref"}`` -> colour of the object ``ref`` names;
    * ``{"q": "line_count", "ref", "line": "row"|"column"}`` -> other objects in that object's row/column;
    * ``{"q": "neighbor_shape", "ref", "side"}`` -> shape of the object in the cell just ``side`` of it.
    """
    q = query.get("q")
    if q == "count":
        return scene.count(query.get("color"), query.get("shape"))
    if q == "color_of":
        return resolve_expression(query["ref"], scene, cfg).color
    if q == "line_count":
        a = resolve_expression(query["ref"], scene, cfg)
        key = "row" if query["line"] == "row" else "col"
        return sum(1 for o in scene.objects if o != a and getattr(o, key) == getattr(a, key))
    if q == "neighbor_shape":
        a = resolve_expression(query["ref"], scene, cfg)
        dr, dc = SIDES[query["side"]][0]
        found = [o for o in scene.objects if (o.row, o.col) == (a.row + dr, a.col + dc)]
        if not found:
            raise ValueError(f"no object just {query['side']} of the {query['ref']}")
        return found[0].shape
    raise ValueError(f"unknown focus query {query!r}")


def relevant_objects(query: dict[str, Any], scene: Scene, cfg: WorldConfig | None = None) -> list[ShapeObject]:
    """The objects a focus query depends on (what a highlight edit keeps): the counted objects; the
    named object; the named object and the others in its row/column; the named object and its
    neighbour. Answering the query on these objects alone gives the same answer."""
    q = query.get("q")
    if q == "count":
        return scene.find(query.get("color"), query.get("shape"))
    a = resolve_expression(query["ref"], scene, cfg)
    if q == "color_of":
        return [a]
    if q == "line_count":
        key = "row" if query["line"] == "row" else "col"
        return [o for o in scene.objects if getattr(o, key) == getattr(a, key)]
    if q == "neighbor_shape":
        dr, dc = SIDES[query["side"]][0]
        return [a] + [o for o in scene.objects if (o.row, o.col) == (a.row + dr, a.col + dc)]
    raise ValueError(f"unknown focus query {query!r}")


def focus_questions(scene: Scene, cfg: WorldConfig) -> list[FocusQuestion]:
    """Every well-posed focus question about ``scene`` whose relevant objects are a non-empty part of it."""
    out: list[FocusQuestion] = []
    for c in cfg.color_names:
        if scene.count(color=c):
            out.append(FocusQuestion(f"how many {c} objects are there?", {"q": "count", "color": c}, scene.count(color=c)))
    for (c, s) in sorted(scene.kinds()):
        out.append(FocusQuestion(f"how many {c} {plural(s)} are there?", {"q": "count", "color": c, "shape": s},
                                 scene.count(c, s)))
    for s in cfg.shapes:
        if scene.count(shape=s) == 1:
            out.append(FocusQuestion(f"what color is the {s}?", {"q": "color_of", "ref": s}, scene.find(shape=s)[0].color))
    for o, e in _expressions(scene):
        for line in ("row", "column"):
            query = {"q": "line_count", "ref": e, "line": line}
            out.append(FocusQuestion(f"how many other objects are in the same {line} as the {e}?", query,
                                     answer_query(query, scene, cfg)))
        for side, ((dr, dc), phrase) in SIDES.items():
            if any((x.row, x.col) == (o.row + dr, o.col + dc) for x in scene.objects):
                query = {"q": "neighbor_shape", "ref": e, "side": side}
                out.append(FocusQuestion(f"what shape is the object {phrase} the {e}?", query,
                                         answer_query(query, scene, cfg)))
    return [f for f in out if 0 < len(relevant_objects(f.query, scene, cfg)) < len(scene)]


def keep_only(scene: Scene, objects: Sequence[ShapeObject]) -> Scene:
    keep = set(objects)
    return Scene(tuple(o for o in scene.objects if o in keep))


# ---------------------------------------------------------------------------------------------
# Routes
# ---------------------------------------------------------------------------------------------
def route_marker(cfg: WorldConfig, forbidden: Sequence[tuple[str, str]] = ()) -> tuple[str, str]:
    """The route marker kind (color, shape): the first of :data:`ROUTE_MARKERS` in the world and not
    held out (``forbidden``), else the first composition of the world that is not held out."""
    bad = set(map(tuple, forbidden))
    for c, s in ROUTE_MARKERS:
        if c in cfg.colors and s in cfg.shapes and (c, s) not in bad:
            return c, s
    return _kinds(cfg, forbidden)[0]


def shortest_paths(scene: Scene, a: ShapeObject, b: ShapeObject, cfg: WorldConfig) -> tuple[int | None, int, list[tuple[int, int]]]:
    """``(steps, number of shortest paths, cells strictly between a and b on the path)`` for 4-connected
    paths from a's cell to b's cell through empty cells (breadth-first search). ``steps`` is None when
    no path exists; the cells are listed (from a to b) only when the shortest path is unique."""
    blocked = {(o.row, o.col) for o in scene.objects} - {(b.row, b.col)}
    start, goal = (a.row, a.col), (b.row, b.col)
    dist, ways = {start: 0}, {start: 1}
    queue = deque([start])
    while queue:
        cur = queue.popleft()
        for dr, dc in DIRECTIONS.values():
            nxt = (cur[0] + dr, cur[1] + dc)
            if not (0 <= nxt[0] < cfg.grid and 0 <= nxt[1] < cfg.grid) or nxt in blocked:
                continue
            if nxt not in dist:
                dist[nxt], ways[nxt] = dist[cur] + 1, ways[cur]
                if nxt != goal:
                    queue.append(nxt)
            elif dist[nxt] == dist[cur] + 1:
                ways[nxt] += ways[cur]
    if goal not in dist:
        return None, 0, []
    if ways[goal] != 1:
        return dist[goal], ways[goal], []
    cells, cur = [], goal
    while dist[cur] > 1:
        cur = next(p for dr, dc in DIRECTIONS.values()
                   if dist.get(p := (cur[0] + dr, cur[1] + dc)) == dist[cur] - 1 and p not in blocked)
        cells.append(cur)
    return dist[goal], 1, cells[::-1]


def route_pairs(scene: Scene, cfg: WorldConfig) -> list[tuple[ShapeObject, ShapeObject, int, list[tuple[int, int]]]]:
    """Ordered pairs of objects, each the only one of its colour-shape kind, joined by a unique
    shortest path through at least one empty cell: ``(a, b, steps, cells between)``."""
    unique = [o for o in scene.objects if scene.count(o.color, o.shape) == 1]
    out = []
    for a in unique:
        for b in unique:
            if a != b:
                steps, ways, cells = shortest_paths(scene, a, b, cfg)
                if steps is not None and ways == 1 and cells:
                    out.append((a, b, steps, cells))
    return out


def mark_route(scene: Scene, cells: Sequence[tuple[int, int]], marker: tuple[str, str]) -> Scene:
    return Scene(scene.objects + tuple(ShapeObject(marker[1], marker[0], r, c) for r, c in cells))


def route_instruction(a: ShapeObject, b: ShapeObject, marker: tuple[str, str]) -> str:
    return f"mark the shortest path from the {a.color} {a.shape} to the {b.color} {b.shape} with {marker[0]} {plural(marker[1])}"


def add_clutter(scene: Scene, rng: np.random.Generator, cfg: WorldConfig, n: int,
                forbidden: Sequence[tuple[str, str]] = (), avoid_kinds: Sequence[tuple[str, str]] = ()) -> Scene:
    """``scene`` plus up to ``n`` random objects in random empty cells (kinds outside ``forbidden`` and
    ``avoid_kinds``): a busy scene for highlight and route edits and their benchmark items."""
    kinds = [k for k in _kinds(cfg, forbidden) if k not in set(map(tuple, avoid_kinds))]
    empty = _empty_cells(scene, cfg)
    n = min(n, len(empty))
    cells = [empty[i] for i in rng.choice(len(empty), size=n, replace=False)] if n else []
    extra = [ShapeObject(s, c, r, col) for (r, col), (c, s) in zip(cells, (_pick(rng, kinds) for _ in cells))]
    return Scene(scene.objects + tuple(extra))


# ---------------------------------------------------------------------------------------------
# Sampling edits
# ---------------------------------------------------------------------------------------------
def sample_edit(kind: str, scene: Scene, rng: np.random.Generator, cfg: WorldConfig,
                forbidden: Sequence[tuple[str, str]] = (), marker: tuple[str, str] | None = None) -> Edit | None:
    """One edit of ``kind`` applied to ``scene`` (the source, except for ``restore``: module
    docstring), or None when the kind does not apply. No new object or instruction uses a
    ``forbidden`` colour-shape composition (the held-out ones, for training rows); ``marker`` is
    the route marker kind (default :func:`route_marker`)."""
    if kind not in EDIT_KINDS:
        raise ValueError(f"unknown edit kind {kind!r}; expected one of {EDIT_KINDS}")
    bad = set(map(tuple, forbidden))
    if kind == "restore":
        if cfg.grid % 2 or not len(scene):
            return None
        source = rotate_quarters(scene, cfg, 1)
        return None if source == scene else Edit(kind, RESTORE_INSTRUCTION, source, scene)
    refs = _expressions(scene)
    if kind == "recolor":
        if not refs:
            return None
        obj, expr = _pick(rng, refs)
        colors = [c for c in cfg.color_names if c != obj.color and (c, obj.shape) not in bad]
        if not colors:
            return None
        new = _pick(rng, colors)
        verb = _pick(rng, ("paint the {} {}", "make the {} {}", "change the color of the {} to {}"))
        return Edit(kind, verb.format(expr, new), scene, _replace(scene, obj, ShapeObject(obj.shape, new, obj.row, obj.col)))
    if kind == "move":
        n = int(rng.choice([1, 1, 2, 3]))
        drawn = sample_steps(scene, rng, cfg, n)
        if drawn is None or drawn[2] == scene:
            return None
        return Edit(kind, ", then ".join(drawn[1]), scene, drawn[2])
    if kind == "add":
        empty = _empty_cells(scene, cfg)
        kinds = _kinds(cfg, forbidden)
        if len(scene) >= cfg.max_objects or not empty or not kinds:
            return None
        c, s = _pick(rng, kinds)
        anchored = [(side, o, e) for o, e in refs for side, ((dr, dc), _) in SIDES.items()
                    if (o.row + dr, o.col + dc) in set(empty)]
        if anchored and rng.random() < 0.5:
            side, o, e = _pick(rng, anchored)
            (dr, dc), phrase = SIDES[side]
            cell, where = (o.row + dr, o.col + dc), f"{phrase} the {e}"
        else:
            cell = _pick(rng, empty)
            where = f"in {cell_phrase(*cell)}"
        return Edit(kind, f"add {_article(c)} {c} {s} {where}", scene, Scene(scene.objects + (ShapeObject(s, c, *cell),)))
    if kind == "remove":
        if len(scene) < 2:
            return None
        groups = [(f"all the {c} objects", scene.find(color=c)) for c in sorted({o.color for o in scene})]
        groups += [(f"all the {plural(s)}", scene.find(shape=s)) for s in sorted({o.shape for o in scene})]
        groups += [(f"all the {c} {plural(s)}", scene.find(c, s)) for c, s in sorted(scene.kinds())]
        groups = [(t, objs) for t, objs in groups if len(objs) < len(scene)]
        if refs and (not groups or rng.random() < 0.6):
            obj, expr = _pick(rng, refs)
            return Edit(kind, f"remove the {expr}", scene, _replace(scene, obj, None))
        if not groups:
            return None
        text, objs = _pick(rng, groups)
        return Edit(kind, f"remove {text}", scene, keep_only(scene, [o for o in scene.objects if o not in objs]))
    if kind == "highlight":
        questions = focus_questions(scene, cfg) if rng.random() < 0.5 else []
        if questions:
            fq = _pick(rng, questions)
            keep = relevant_objects(fq.query, scene, cfg)
            return Edit(kind, f"keep only the objects needed to answer: {fq.text}", scene, keep_only(scene, keep))
        groups = [(f"the {c} objects", scene.find(color=c)) for c in sorted({o.color for o in scene})]
        groups += [(f"the {plural(s)}", scene.find(shape=s)) for s in sorted({o.shape for o in scene})]
        groups += [(f"the {c} {plural(s)}", scene.find(c, s)) for c, s in sorted(scene.kinds())]
        groups = [(t, objs) for t, objs in groups if len(objs) < len(scene)]
        if not groups:
            return None
        text, objs = _pick(rng, groups)
        return Edit(kind, f"keep only {text}", scene, keep_only(scene, objs))
    # route
    marker = tuple(marker) if marker is not None else route_marker(cfg, forbidden)
    if scene.count(*marker):
        return None
    # the first pair, in random order, that route_pairs would list
    unique = [o for o in scene.objects if scene.count(o.color, o.shape) == 1]
    pairs = [(a, b) for a in unique for b in unique if a != b]
    for i in rng.permutation(len(pairs)):
        a, b = pairs[i]
        steps, ways, cells = shortest_paths(scene, a, b, cfg)
        if steps is not None and ways == 1 and cells:
            return Edit(kind, route_instruction(a, b, marker), scene, mark_route(scene, cells, marker))
    return None


def edit_matches(image_or_scene, edit: Edit, cfg: WorldConfig) -> bool:
    """Is the edited image (or scene) exactly ``edit.target``? An unparseable image is a miss."""
    if isinstance(image_or_scene, Scene):
        return image_or_scene == edit.target
    try:
        return parse(image_or_scene, cfg) == edit.target
    except NotAShapesWorldImage:
        return False


def edit_row(edit: Edit, row_id: str, image: str, target_image: str) -> dict[str, Any]:
    """The ``edit_<split>.jsonl`` row of an edit (image paths relative to the world root)."""
    return {"id": row_id, "task": "edit", "kind": edit.kind, "image": image, "text": edit.instruction,
            "target_image": target_image, "source_scene": edit.source.to_dict(), "target_scene": edit.target.to_dict()}


__all__ = [
    "EDIT_KINDS", "ORDINALS", "DIRECTIONS", "SIDES", "QUARTERS", "RESTORE_INSTRUCTION", "ROUTE_MARKERS",
    "Edit", "FocusQuestion", "sample_edit", "edit_matches", "edit_row", "apply_steps", "sample_step", "sample_steps",
    "rotate_quarters", "quarter_of", "cell_phrase", "focus_questions", "answer_query", "relevant_objects",
    "keep_only", "route_marker", "shortest_paths", "route_pairs", "mark_route", "route_instruction", "add_clutter",
]
