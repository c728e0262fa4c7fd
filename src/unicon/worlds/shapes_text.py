"""ShapesWorld language: captions, questions, referring expressions, contrast sets, reasoning prompts.

All text is lowercase. The caption grammar (parsed by :func:`parse_caption`) is::

    caption := [prefix] clause ((", " | " and ") clause)*
    prefix  := "there is" | "there are" | "a photo of" | "an image of"
    clause  := np | np relation np
    np      := det [color] shape        det in a/an/one/two/.../sixteen; plural shape when det > 1
    relation:= "to the left of" | "left of" | "to the right of" | "right of" | "above" | "below"

A caption is a *closed-world* description (:func:`caption_matches`): the scene holds exactly the
objects its noun phrases count (a noun phrase without a colour matches any colour), and every
relation clause holds for some pair of matching objects (grid relations, see
:mod:`unicon.worlds.shapes`).

Contrast sets follow CocoCon's construction (section 4): the perturbed concept is one that the
caption and the VQA answer share; it is swapped for alternatives that make both false. Categories:

* ``attribute`` -- the colour of the only object of its shape ("what color is the circle?");
* ``object`` -- the shape of the only object of its colour ("what shape is the red object?");
* ``count`` -- the number of a group ("how many green triangles are there?" -> "two");
* ``location`` -- the relation between two objects sharing a row or column ("where is the red
  circle relative to the blue square?" -> "left").

Alternatives are ordered from *near* (hard) to *far* (easy): colours by RGB distance, shapes by the
IoU of their masks, counts by |difference|, relations perpendicular before opposite. A sample with
k >= 2 contrast sets always contains the nearest and the farthest alternative.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any, Sequence

import numpy as np

from unicon.worlds.shapes import (
    DEFAULT_COLORS,
    DEFAULT_SHAPES,
    RELATIONS,
    Scene,
    ShapeObject,
    WorldConfig,
    relation_holds,
    relations_between,
    shape_coverage,
)

NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
                "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen")
REL_PHRASES = {"left": ("to the left of", "left of"), "right": ("to the right of", "right of"),
               "above": ("above",), "below": ("below",)}
_PHRASE_TO_REL = {p: r for r, ps in REL_PHRASES.items() for p in ps}
PREFIXES = ("", "there is", "a photo of", "an image of")  # "there is" becomes "there are" before a plural
CATEGORIES = ("attribute", "object", "count", "location")


class CaptionParseError(ValueError):
    """Text outside the caption grammar."""


def plural(shape: str) -> str:
    return shape + "es" if shape.endswith(("s", "x", "ch", "sh")) else shape + "s"


def number_word(n: int) -> str:
    if not 0 <= n < len(NUMBER_WORDS):
        raise ValueError(f"no number word for {n}")
    return NUMBER_WORDS[n]


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def _vocab(cfg: WorldConfig | None) -> tuple[Sequence[str], Sequence[str]]:
    return (cfg.shapes, cfg.color_names) if cfg is not None else (DEFAULT_SHAPES, tuple(DEFAULT_COLORS))


# ---------------------------------------------------------------------------------------------
# Caption specs: the structure behind a caption
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class NounPhrase:
    count: int
    color: str | None
    shape: str
    numeral: bool = False  # say "one" rather than "a" when count == 1

    def text(self) -> str:
        head = f"{self.color} {self.shape}" if self.color else self.shape
        if self.count == 1:
            return f"{'one' if self.numeral else _article(head)} {head}"
        noun = plural(self.shape)
        return f"{number_word(self.count)} {self.color + ' ' if self.color else ''}{noun}"

    def matches(self, obj: ShapeObject) -> bool:
        return obj.shape == self.shape and (self.color is None or obj.color == self.color)


@dataclass(frozen=True)
class Clause:
    subject: NounPhrase
    relation: str | None = None  # left/right/above/below
    object: NounPhrase | None = None

    def text(self, short_relations: bool = False) -> str:
        if self.relation is None:
            return self.subject.text()
        phrases = REL_PHRASES[self.relation]
        return f"{self.subject.text()} {phrases[-1] if short_relations else phrases[0]} {self.object.text()}"

    def noun_phrases(self) -> list[NounPhrase]:
        return [self.subject] if self.object is None else [self.subject, self.object]


@dataclass(frozen=True)
class CaptionSpec:
    clauses: tuple[Clause, ...]
    prefix: str = ""
    short_relations: bool = False

    def text(self) -> str:
        parts = [c.text(self.short_relations) for c in self.clauses]
        body = parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
        prefix = self.prefix
        if prefix == "there is" and self.clauses[0].subject.count > 1:
            prefix = "there are"
        return f"{prefix} {body}" if prefix else body

    def noun_phrases(self) -> list[NounPhrase]:
        return [np_ for c in self.clauses for np_ in c.noun_phrases()]


def spec_matches(spec: CaptionSpec, scene: Scene) -> bool:
    """Closed-world semantics of a caption (module docstring)."""
    nps = spec.noun_phrases()
    if sum(n.count for n in nps) != len(scene):
        return False
    have = scene.kinds()
    need_kind: dict[tuple[str, str], int] = {}
    need_shape: dict[str, int] = {}
    for n in nps:
        if n.color is None:
            need_shape[n.shape] = need_shape.get(n.shape, 0) + n.count
        else:
            need_kind[(n.color, n.shape)] = need_kind.get((n.color, n.shape), 0) + n.count
    left_by_shape: dict[str, int] = {}
    for kind, cnt in have.items():
        rest = cnt - need_kind.get(kind, 0)
        if rest < 0:
            return False
        left_by_shape[kind[1]] = left_by_shape.get(kind[1], 0) + rest
    if any(kind not in have for kind in need_kind):
        return False
    if any(left_by_shape.get(s, 0) < c for s, c in need_shape.items()):
        return False
    for cl in spec.clauses:
        if cl.relation is not None:
            ok = any(
                a is not b and relation_holds(a, cl.relation, b)
                for a in scene.objects if cl.subject.matches(a)
                for b in scene.objects if cl.object.matches(b)
            )
            if not ok:
                return False
    return True


def parse_caption(text: str, cfg: WorldConfig | None = None) -> CaptionSpec:
    """Parse a caption of the grammar above; raise :class:`CaptionParseError` otherwise."""
    shapes, colors = _vocab(cfg)
    singular = {s: s for s in shapes} | {plural(s): s for s in shapes}
    t = " ".join(str(text).lower().replace(",", " , ").split()).rstrip(" .")
    prefix = ""
    for p in ("there is", "there are", "a photo of", "an image of"):
        if t.startswith(p + " "):
            prefix, t = ("there is" if p == "there are" else p), t[len(p) + 1:]
            break
    short = False

    def noun_phrase(tokens: list[str]) -> NounPhrase:
        if len(tokens) not in (2, 3):
            raise CaptionParseError(f"cannot parse noun phrase {' '.join(tokens)!r} in {text!r}")
        det, *rest = tokens
        if det in ("a", "an"):
            count, numeral = 1, False
        elif det in NUMBER_WORDS[1:]:
            count, numeral = NUMBER_WORDS.index(det), det == "one"
        else:
            raise CaptionParseError(f"expected a/an or a number word, got {det!r} in {text!r}")
        color = rest[0] if len(rest) == 2 else None
        if color is not None and color not in colors:
            raise CaptionParseError(f"unknown colour {color!r} in {text!r}")
        noun = rest[-1]
        if noun not in singular:
            raise CaptionParseError(f"unknown shape {noun!r} in {text!r}")
        if (noun == singular[noun]) != (count == 1):
            raise CaptionParseError(f"number disagreement in {' '.join(tokens)!r} of {text!r}")
        return NounPhrase(count, color, singular[noun], numeral)

    clauses = []
    for part in re.split(r" , | and ", t):
        part = part.strip(" ,")
        if not part:
            raise CaptionParseError(f"empty clause in {text!r}")
        for phrase in sorted(_PHRASE_TO_REL, key=len, reverse=True):
            m = re.fullmatch(rf"(.+) {phrase} (.+)", part)
            if m:
                a, b = noun_phrase(m.group(1).split()), noun_phrase(m.group(2).split())
                if a.count != 1 or b.count != 1:
                    raise CaptionParseError(f"relations need singular noun phrases: {part!r}")
                short = short or phrase in ("left of", "right of")
                clauses.append(Clause(a, _PHRASE_TO_REL[phrase], b))
                break
        else:
            clauses.append(Clause(noun_phrase(part.split())))
    return CaptionSpec(tuple(clauses), prefix, short)


#: why a description misses a scene (:func:`caption_mismatch`), in the order they are tested
MISMATCHES = ("unparsable", "fewer_objects", "more_objects", "attributes", "relation")


def caption_mismatch(caption: str, scene: Scene, cfg: WorldConfig | None = None) -> str | None:
    """Why ``caption`` does not describe ``scene`` exactly (None when it does), the first that holds of:

    * ``unparsable``    -- the text is not in the grammar (:class:`CaptionParseError`);
    * ``fewer_objects`` -- its noun phrases count fewer objects than the scene has;
    * ``more_objects``  -- they count more;
    * ``attributes``    -- as many, but some colour or shape is wrong;
    * ``relation``      -- the objects are right (the caption with its relation clauses dropped
      matches) and a relation clause does not hold.
    """
    try:
        spec = parse_caption(caption, cfg)
    except CaptionParseError:
        return "unparsable"
    if spec_matches(spec, scene):
        return None
    named = sum(n.count for n in spec.noun_phrases())
    if named != len(scene):
        return "fewer_objects" if named < len(scene) else "more_objects"
    objects_only = CaptionSpec(tuple(Clause(n) for n in spec.noun_phrases()))
    return "relation" if spec_matches(objects_only, scene) else "attributes"


def caption_matches(caption: str, scene: Scene, cfg: WorldConfig | None = None) -> bool:
    """True iff ``caption`` parses and describes ``scene`` exactly; unparseable text is False."""
    return caption_mismatch(caption, scene, cfg) is None


# ---------------------------------------------------------------------------------------------
# Describing scenes
# ---------------------------------------------------------------------------------------------
def _groups(scene: Scene) -> list[tuple[tuple[str, str], list[ShapeObject]]]:
    """(color, shape) groups in reading order of their first member."""
    groups: dict[tuple[str, str], list[ShapeObject]] = {}
    for o in scene.objects:
        groups.setdefault(o.kind, []).append(o)
    return list(groups.items())


def _dominant_relation(a: ShapeObject, b: ShapeObject, rng: np.random.Generator | None) -> str | None:
    """A relation that holds, preferring the axis with the larger offset (ties: random/horizontal)."""
    rels = relations_between(a, b)
    if not rels:
        return None
    dr, dc = abs(a.row - b.row), abs(a.col - b.col)
    horiz = [r for r in rels if r in ("left", "right")]
    vert = [r for r in rels if r in ("above", "below")]
    if horiz and vert:
        if dr == dc:
            return (horiz if rng is None or rng.random() < 0.5 else vert)[0]
        return horiz[0] if dc > dr else vert[0]
    return rels[0]


def build_spec(
    scene: Scene,
    rng: np.random.Generator | None = None,
    relation_pair: tuple[ShapeObject, ShapeObject, str] | None = None,
    numeral_kinds: Sequence[tuple[str, str]] = (),
    p_relation: float = 0.5,
) -> CaptionSpec:
    """Structure of a caption describing ``scene`` completely.

    With ``rng=None`` the result is canonical (reading order, no prefix, no relation unless
    ``relation_pair`` is given). ``relation_pair=(a, b, rel)`` forces the clause "a rel b"
    (both kinds must be unique in the scene); ``numeral_kinds`` are spelled with number words.
    """
    groups = _groups(scene)
    unique = [objs[0] for _, objs in groups if len(objs) == 1]
    pair = relation_pair
    if pair is None and rng is not None and len(unique) >= 2 and rng.random() < p_relation:
        i, j = rng.choice(len(unique), size=2, replace=False)
        a, b = unique[i], unique[j]
        rel = _dominant_relation(a, b, rng)
        pair = (a, b, rel) if rel else None
    clauses = []
    for kind, objs in groups:
        if pair is not None and kind in (pair[0].kind, pair[1].kind):
            if kind == pair[0].kind:
                clauses.append(Clause(_np(pair[0].kind, 1, numeral_kinds), pair[2], _np(pair[1].kind, 1, numeral_kinds)))
            continue
        clauses.append(Clause(_np(kind, len(objs), numeral_kinds)))
    if rng is not None:
        clauses = [clauses[k] for k in rng.permutation(len(clauses))]
        prefix = PREFIXES[rng.integers(len(PREFIXES))]
        short = bool(rng.random() < 0.3)
    else:
        prefix, short = "", False
    return CaptionSpec(tuple(clauses), prefix, short)


def _np(kind: tuple[str, str], count: int, numeral_kinds) -> NounPhrase:
    return NounPhrase(count, kind[0], kind[1], numeral=kind in numeral_kinds)


def describe_scene(scene: Scene, rng: np.random.Generator | None = None) -> str:
    """A caption of ``scene``: canonical when ``rng`` is None, else a random phrasing."""
    return build_spec(scene, rng).text()


def mentions_kind(text: str, kinds: Sequence[tuple[str, str]]) -> bool:
    """Does ``text`` name any (color, shape) composition of ``kinds`` (singular or plural)?"""
    return any(re.search(rf"\b{c} (?:{s}|{plural(s)})\b", text) for c, s in kinds)


def mentions_concept(text: str, concept: str) -> bool:
    """Does ``text`` name ``concept`` (a colour, or a shape in the singular or plural) as a word?"""
    return re.search(rf"\b(?:{re.escape(concept)}|{re.escape(plural(concept))})\b", text) is not None


# ---------------------------------------------------------------------------------------------
# Referring expressions
# ---------------------------------------------------------------------------------------------
def referring_expressions(obj: ShapeObject, scene: Scene) -> list[str]:
    """Expressions that pick out ``obj`` uniquely: "red circle", "circle", "red object"."""
    out = []
    if scene.count(obj.color, obj.shape) == 1:
        out.append(f"{obj.color} {obj.shape}")
    if scene.count(shape=obj.shape) == 1:
        out.append(obj.shape)
    if scene.count(color=obj.color) == 1:
        out.append(f"{obj.color} object")
    return out


def resolve_expression(expr: str, scene: Scene, cfg: WorldConfig | None = None) -> ShapeObject:
    """The one object ``expr`` refers to; ``ValueError`` if none or several match."""
    shapes, colors = _vocab(cfg)
    words = expr.lower().strip(" .?").split()
    if words and words[0] == "the":
        words = words[1:]
    color = shape = None
    if len(words) == 2 and words[0] in colors and (words[1] in shapes or words[1] == "object"):
        color, shape = words[0], (None if words[1] == "object" else words[1])
    elif len(words) == 1 and words[0] in shapes:
        shape = words[0]
    else:
        raise ValueError(f"not a ShapesWorld referring expression: {expr!r}")
    found = scene.find(color, shape)
    if len(found) != 1:
        raise ValueError(f"{expr!r} matches {len(found)} objects, not exactly one")
    return found[0]


# ---------------------------------------------------------------------------------------------
# Questions
# ---------------------------------------------------------------------------------------------
_REF = r"(\w+ \w+|\w+)"
_Q_PATTERNS = [
    ("color", re.compile(r"what colou?r is the (\w+)\?")),
    ("shape", re.compile(r"what shape is the (\w+) object\?")),
    ("count", re.compile(r"how many (?:(\w+) )?(\w+) are there\?")),
    ("exist", re.compile(r"is there an? (?:(\w+) )?(\w+)\?")),
    ("relation", re.compile(rf"is the {_REF} ({'|'.join(sorted(_PHRASE_TO_REL, key=len, reverse=True))}) the {_REF}\?")),
    ("relation", re.compile(rf"where is the {_REF} relative to the {_REF}\?")),
]


def _parse_question(question: str) -> tuple[str, re.Match]:
    """``(question type, match)`` of the first grammar pattern that the question (case and runs of
    whitespace ignored) matches in full; ``ValueError`` naming the question otherwise."""
    q = " ".join(question.lower().split())
    for qtype, pat in _Q_PATTERNS:
        m = pat.fullmatch(q)
        if m:
            return qtype, m
    raise ValueError(f"not a ShapesWorld question: {question!r}")


def question_category(question: str) -> str:
    """The grammar category of a ShapesWorld question (the first element of its parse; e.g. a count or
    a relation question). Not VQAv2's ``question_type``, a question prefix: see
    :func:`unicon.data.shapes_coco.vqa_question_type`."""
    return _parse_question(question)[0]


#: what a count question counts, by (does it name a colour, does it name a shape): every object, a
#: colour, a shape, or one colour-shape kind
COUNT_FORMS = {(False, False): "all", (True, False): "colour", (False, True): "shape", (True, True): "kind"}


def count_question_form(question: str) -> str:
    """Which of :data:`COUNT_FORMS` a count question asks: "how many objects" (``all``), "how many red
    objects" (``colour``), "how many circles" (``shape``), "how many red circles" (``kind``).
    ``ValueError`` for a question that is not a count question of the grammar."""
    try:
        qtype, m = _parse_question(question)
    except ValueError:
        qtype = None
    if qtype != "count":
        raise ValueError(f"not a ShapesWorld count question: {question!r}")
    return COUNT_FORMS[(m.group(1) is not None, m.group(2) != "objects")]


def answer_question(question: str, scene: Scene, cfg: WorldConfig | None = None) -> str:
    """The exact answer to a question of the grammar; ``ValueError`` if ill-posed (e.g. ambiguous)."""
    shapes, colors = _vocab(cfg)
    singular = {plural(s): s for s in shapes}
    qtype, m = _parse_question(question)
    if qtype == "color":
        return resolve_expression(m.group(1), scene, cfg).color
    if qtype == "shape":
        return resolve_expression(f"{m.group(1)} object", scene, cfg).shape
    if qtype == "count":
        color, noun = m.group(1), m.group(2)
        if color is not None and color not in colors:
            raise ValueError(f"unknown colour {color!r} in {question!r}")
        if noun == "objects":
            return number_word(scene.count(color=color))
        if noun not in singular:
            raise ValueError(f"unknown plural shape {noun!r} in {question!r}")
        return number_word(scene.count(color, singular[noun]))
    if qtype == "exist":
        color, shape = m.group(1), m.group(2)
        if shape not in shapes or (color is not None and color not in colors):
            raise ValueError(f"unknown colour/shape in {question!r}")
        return "yes" if scene.count(color, shape) else "no"
    if m.re.pattern.startswith("is the"):
        a = resolve_expression(m.group(1), scene, cfg)
        b = resolve_expression(m.group(3), scene, cfg)
        return "yes" if relation_holds(a, _PHRASE_TO_REL[m.group(2)], b) else "no"
    a, b = resolve_expression(m.group(1), scene, cfg), resolve_expression(m.group(2), scene, cfg)
    rels = relations_between(a, b)
    if len(rels) != 1:
        raise ValueError(f"{question!r} has no unique answer (relations {rels})")
    return rels[0]


OPPOSITE_RELATION = {"left": "right", "right": "left", "above": "below", "below": "above"}


def flip_relation_question(question: str) -> str | None:
    """``"is the A <relation> the B?"`` with the opposite relation, in the same wording ("to the left
    of" <-> "to the right of", "left of" <-> "right of", "above" <-> "below"); None for any other
    question."""
    try:
        qtype, m = _parse_question(question)
    except ValueError:
        return None
    if qtype != "relation" or not m.re.pattern.startswith("is the"):
        return None
    phrase = m.group(2)
    rel = _PHRASE_TO_REL[phrase]
    opposite = REL_PHRASES[OPPOSITE_RELATION[rel]][REL_PHRASES[rel].index(phrase)]
    return f"is the {m.group(1)} {opposite} the {m.group(3)}?"


def candidate_questions(scene: Scene, cfg: WorldConfig, rng: np.random.Generator) -> dict[str, list[str]]:
    """Well-posed questions about ``scene`` grouped by question type."""
    out: dict[str, list[str]] = {k: [] for k in ("color", "shape", "count", "exist", "relation")}
    for s in cfg.shapes:
        if scene.count(shape=s) == 1:
            out["color"].append(f"what color is the {s}?")
    for c in cfg.color_names:
        if scene.count(color=c) == 1:
            out["shape"].append(f"what shape is the {c} object?")
    out["count"].append("how many objects are there?")
    out["count"].append(f"how many {plural(cfg.shapes[rng.integers(len(cfg.shapes))])} are there?")
    c = cfg.color_names[rng.integers(len(cfg.colors))]
    out["count"].append(f"how many {c} objects are there?")
    for (c, s), _ in _groups(scene):
        out["count"].append(f"how many {c} {plural(s)} are there?")
        out["exist"].append(f"is there {_article(c)} {c} {s}?")
    absent = [(c, s) for c in cfg.color_names for s in cfg.shapes if scene.count(c, s) == 0]
    for k in rng.permutation(len(absent))[: max(1, len(out["exist"]))]:
        c, s = absent[k]
        out["exist"].append(f"is there {_article(c)} {c} {s}?")
    unique = [objs[0] for _, objs in _groups(scene) if len(objs) == 1]
    for a in unique:
        for b in unique:
            if a is b:
                continue
            rel = RELATIONS[rng.integers(len(RELATIONS))]
            phrase = REL_PHRASES[rel][rng.integers(len(REL_PHRASES[rel]))]
            out["relation"].append(f"is the {a.color} {a.shape} {phrase} the {b.color} {b.shape}?")
            if len(relations_between(a, b)) == 1:
                out["relation"].append(f"where is the {a.color} {a.shape} relative to the {b.color} {b.shape}?")
    return out


# ---------------------------------------------------------------------------------------------
# Contrast sets (CocoCon construction)
# ---------------------------------------------------------------------------------------------
def color_alternatives(color: str, cfg: WorldConfig) -> list[str]:
    """Other colours, nearest (hardest) first, by Euclidean RGB distance."""
    ref = np.asarray(cfg.colors[color], dtype=float)
    others = [c for c in cfg.color_names if c != color]
    return sorted(others, key=lambda c: (float(np.linalg.norm(np.asarray(cfg.colors[c]) - ref)), c))


def shape_alternatives(shape: str, cfg: WorldConfig) -> list[str]:
    """Other shapes, most similar first, by IoU of their (centred, soft) masks."""
    cov = shape_coverage(cfg)
    a = cov[cfg.shapes.index(shape)]

    def iou(s: str) -> float:
        b = cov[cfg.shapes.index(s)]
        return float(np.minimum(a, b).sum() / np.maximum(a, b).sum())

    return sorted((s for s in cfg.shapes if s != shape), key=lambda s: (-iou(s), s))


def count_alternatives(n: int, max_count: int) -> list[int]:
    return sorted((m for m in range(1, max_count + 1) if m != n), key=lambda m: (abs(m - n), m))


def relation_alternatives(rel: str) -> list[str]:
    """Perpendicular relations (near) before the opposite one (far)."""
    opposite = OPPOSITE_RELATION[rel]
    return [r for r in RELATIONS if r not in (rel, opposite)] + [opposite]


def pick_contrasts(alts: list, rng: np.random.Generator, min_k: int, max_k: int) -> list:
    """``min_k..max_k`` alternatives in near->far order; k >= 2 always keeps the nearest and the farthest.

    Half of the samples take as many as allowed (rank-based consistency losses want long lists),
    the other half a uniform k, so short lists (down to a single near or far contrast) occur too.
    """
    hi = min(max_k, len(alts))
    if hi < min_k:
        return []
    k = hi if rng.random() < 0.5 else int(rng.integers(min_k, hi + 1))
    if k == 1:
        return [alts[0] if rng.random() < 0.5 else alts[-1]]
    middle = sorted(rng.choice(np.arange(1, len(alts) - 1), size=k - 2, replace=False).tolist()) if k > 2 else []
    return [alts[0]] + [alts[i] for i in middle] + [alts[-1]]


def feasible_categories(scene: Scene) -> list[str]:
    out = []
    if any(scene.count(shape=o.shape) == 1 for o in scene.objects):
        out.append("attribute")
    if any(scene.count(color=o.color) == 1 for o in scene.objects):
        out.append("object")
    if any(len(objs) >= 2 for _, objs in _groups(scene)) or len(scene) == 1:
        out.append("count")
    if _aligned_pairs(scene):
        out.append("location")
    return out


def _aligned_pairs(scene: Scene) -> list[tuple[ShapeObject, ShapeObject]]:
    unique = [objs[0] for _, objs in _groups(scene) if len(objs) == 1]
    return [(a, b) for a in unique for b in unique if a is not b and len(relations_between(a, b)) == 1]


def make_contrast_sample(
    scene: Scene,
    category: str,
    cfg: WorldConfig,
    rng: np.random.Generator,
    min_contrast: int = 1,
    max_contrast: int = 5,
    forbidden: Sequence[tuple[str, str]] = (),
    boxes: Sequence[Sequence[int]] | None = None,
    concept: str | None = None,
) -> dict[str, Any] | None:
    """One CocoCon-schema sample (without ids) for ``category``, or None if not constructible.

    ``forbidden`` compositions never appear in any caption (held-out compositions in training).
    ``boxes[i]`` is the pixel box of ``scene.objects[i]``; with it, attribute/object samples get
    ``detection``/``boxes``/``mutex_detection`` (the referring expression carries the concept).
    ``concept`` (a colour for attribute, a shape for object samples): the sample is about an
    object with that colour/shape when the scene has a usable one (its gold answer is the concept).
    """
    forbidden = set(map(tuple, forbidden))
    if category in ("attribute", "object"):
        key = "shape" if category == "attribute" else "color"
        targets = [o for o in scene.objects if scene.count(**{key: getattr(o, key)}) == 1]
        about = [o for o in targets if (o.color if category == "attribute" else o.shape) == concept]
        targets = about or targets
        if not targets:
            return None
        t = targets[rng.integers(len(targets))]
        if category == "attribute":
            query, answer = f"what color is the {t.shape}?", t.color
            alts = [c for c in color_alternatives(t.color, cfg) if (c, t.shape) not in forbidden]
            new_kind = lambda v: (v, t.shape)  # noqa: E731
        else:
            query, answer = f"what shape is the {t.color} object?", t.shape
            alts = [s for s in shape_alternatives(t.shape, cfg)
                    if (t.color, s) not in forbidden and scene.count(t.color, s) == 0]
            new_kind = lambda v: (t.color, v)  # noqa: E731
        spec = build_spec(scene, rng)
        chosen = pick_contrasts(alts, rng, min_contrast, max_contrast)
        if not chosen:
            return None

        def swap(v):
            return _replace_kind(spec, t.kind, new_kind(v))

        sample = _sample(spec, query, answer, category, [(swap(v), v) for v in chosen])
        if boxes is not None:
            sample["detection"] = f"{t.color} {t.shape}"
            sample["boxes"] = [list(boxes[scene.objects.index(t)])]
            for cs, v in zip(sample["contrast_sets"], chosen):
                cs["mutex_detection"] = "{} {}".format(*new_kind(v))
        return sample
    if category == "count":
        groups = [(k, objs) for k, objs in _groups(scene) if len(objs) >= 2] or (
            _groups(scene) if len(scene) == 1 else [])
        if not groups:
            return None
        kind, objs = groups[rng.integers(len(groups))]
        n = len(objs)
        spec = build_spec(scene, rng, numeral_kinds=[kind])
        query, answer = f"how many {kind[0]} {plural(kind[1])} are there?", number_word(n)
        chosen = pick_contrasts(count_alternatives(n, cfg.max_objects), rng, min_contrast, max_contrast)
        if not chosen:
            return None
        variants = [(_replace_count(spec, kind, m), number_word(m)) for m in chosen]
        return _sample(spec, query, answer, category, variants)
    if category == "location":
        pairs = _aligned_pairs(scene)
        if not pairs:
            return None
        a, b = pairs[rng.integers(len(pairs))]
        rel = relations_between(a, b)[0]
        spec = build_spec(scene, rng, relation_pair=(a, b, rel))
        query = f"where is the {a.color} {a.shape} relative to the {b.color} {b.shape}?"
        chosen = pick_contrasts(relation_alternatives(rel), rng, min_contrast, max_contrast)
        if not chosen:
            return None
        variants = [(_replace_relation(spec, r), r) for r in chosen]
        return _sample(spec, query, rel, category, variants)
    raise ValueError(f"unknown contrast category {category!r}; expected one of {CATEGORIES}")


def _sample(spec: CaptionSpec, query: str, answer: str, category: str, variants) -> dict[str, Any]:
    return {
        "caption": spec.text(),
        "query": query,
        "answer": answer,
        "contrast_sets": [{"mutex_caption": s.text(), "mutex_answer": a} for s, a in variants],
        "category": category,
    }


def _map_nps(spec: CaptionSpec, fn) -> CaptionSpec:
    clauses = tuple(
        Clause(fn(c.subject), c.relation, fn(c.object) if c.object is not None else None) for c in spec.clauses
    )
    return replace(spec, clauses=clauses)


def _replace_kind(spec: CaptionSpec, old: tuple[str, str], new: tuple[str, str]) -> CaptionSpec:
    return _map_nps(spec, lambda n: replace(n, color=new[0], shape=new[1]) if (n.color, n.shape) == old else n)


def _replace_count(spec: CaptionSpec, kind: tuple[str, str], count: int) -> CaptionSpec:
    return _map_nps(spec, lambda n: replace(n, count=count) if (n.color, n.shape) == kind else n)


def _replace_relation(spec: CaptionSpec, rel: str) -> CaptionSpec:
    return replace(spec, clauses=tuple(replace(c, relation=rel) if c.relation else c for c in spec.clauses))


# ---------------------------------------------------------------------------------------------
# Target patterns (reasoning prompts' criteria)
# ---------------------------------------------------------------------------------------------
def pattern_spec(pattern: dict[str, Any]) -> CaptionSpec:
    """Canonical caption structure of a target pattern ``{"objects": [...], "relations": [...]}``."""
    objs = pattern["objects"]
    rels = pattern.get("relations", [])
    counts: dict[tuple[str, str], int] = {}
    for o in objs:
        counts[(o["color"], o["shape"])] = counts.get((o["color"], o["shape"]), 0) + 1
    in_rel = set()
    clauses = []
    for r in rels:
        a, b = objs[r["subject"]], objs[r["object"]]
        ka, kb = (a["color"], a["shape"]), (b["color"], b["shape"])
        clauses.append(Clause(NounPhrase(1, *ka), r["relation"], NounPhrase(1, *kb)))
        in_rel |= {ka, kb}
    for kind, n in counts.items():
        if kind not in in_rel:
            clauses.append(Clause(NounPhrase(n, *kind)))
    return CaptionSpec(tuple(clauses))


def pattern_caption(pattern: dict[str, Any]) -> str:
    return pattern_spec(pattern).text()


def pattern_matches(pattern: dict[str, Any], scene: Scene) -> bool:
    """Closed-world match of a target pattern: the multiset of (color, shape) is exact, objects that
    carry ``row``/``col`` are in that cell, and every relation holds for some matching pair."""
    want: dict[tuple[str, str], int] = {}
    for o in pattern["objects"]:
        want[(o["color"], o["shape"])] = want.get((o["color"], o["shape"]), 0) + 1
        if "row" in o and not any(x.row == o["row"] and x.col == o["col"] and x.kind == (o["color"], o["shape"])
                                  for x in scene.objects):
            return False
    if want != scene.kinds():
        return False
    objs = pattern["objects"]
    for r in pattern.get("relations", []):
        a, b = objs[r["subject"]], objs[r["object"]]
        if not any(relation_holds(x, r["relation"], y)
                   for x in scene.find(a["color"], a["shape"]) for y in scene.find(b["color"], b["shape"]) if x is not y):
            return False
    return True


def realize_pattern(pattern: dict[str, Any], cfg: WorldConfig, rng: np.random.Generator, tries: int = 2000) -> Scene:
    """A scene that satisfies ``pattern`` (:func:`pattern_matches`): objects with ``row``/``col`` in
    their cell, the others in random free cells, redrawn until every relation holds. Used to render
    the image of a think-then-draw training row ([P, R] -> image)."""
    objs = pattern["objects"]
    fixed = {(o["row"], o["col"]) for o in objs if "row" in o}
    free = [c for c in range(cfg.grid * cfg.grid) if divmod(c, cfg.grid) not in fixed]
    loose = [o for o in objs if "row" not in o]
    if len(loose) > len(free):
        raise ValueError(f"pattern with {len(objs)} objects does not fit a {cfg.grid}x{cfg.grid} grid")
    placed = [ShapeObject(o["shape"], o["color"], o["row"], o["col"]) for o in objs if "row" in o]
    for _ in range(tries):
        cells = rng.choice(free, size=len(loose), replace=False) if loose else []
        scene = Scene(tuple(placed + [ShapeObject(o["shape"], o["color"], int(c) // cfg.grid, int(c) % cfg.grid)
                                      for o, c in zip(loose, cells)]))
        if pattern_matches(pattern, scene):
            return scene
    raise ValueError(f"no scene satisfying pattern {pattern!r} found in {tries} draws")


def pattern_english(pattern: dict[str, Any]) -> str:
    """``expect_en``: the criterion in plain words."""
    spec = pattern_spec(pattern)
    parts = []
    for c in spec.clauses:
        if c.relation is None:
            n = c.subject
            parts.append(f"exactly {n.count} {n.color} {n.shape if n.count == 1 else plural(n.shape)}")
        else:
            parts.append(f"the {c.subject.color} {c.subject.shape} is {REL_PHRASES[c.relation][0]} "
                         f"the {c.object.color} {c.object.shape}")
    return "; ".join(parts) + " on the board, and nothing else."
