"""A ShapesWorld image-caption alignment set with exact "human" ratings (for BagelScore vs CLIPScore).

Each pair is a test-split image and a caption of its scene in the world's caption grammar
(:func:`~unicon.worlds.shapes_text.build_spec` with a random phrasing) into which 0-3 **controlled
errors** are put, each on its own clause:

* ``negation``      -- a clause "two red circles" becomes "no red circles" (the kind is in the scene);
* ``color``         -- a noun phrase's colour is substituted;
* ``shape``         -- a noun phrase's shape is substituted;
* ``relation``      -- a relation clause's relation is swapped for its opposite ("left of" -> "right of");
* ``count``         -- a plural or singular group clause gets another count;
* ``omission``      -- a clause is dropped.

A substitution, negation or miscount is only applied when it makes its statement false (another
choice is tried otherwise), so every error is a real one.

**The rating.** A caption is read as a list of *statements*, each checked exactly against the scene:
every clause (a group clause "two red circles": exactly two red circles; a relation clause "a red
circle left of a blue square": some red circle is left of some blue square
(:func:`~unicon.worlds.shapes.relation_holds`); a negation "no red circles": none) and one
completeness statement ("nothing else": the clauses' noun phrases count as many objects as the scene
has). With ``share`` = true statements / statements, the rating is

    rating = 1 + 3 * share        (in [1, 4]: 4 = every statement true, Flickr8K-Expert's scale)

so an error-free caption rates exactly 4 and, without a negation clause, rates 4 iff the world's own
closed-world check :func:`~unicon.worlds.shapes_text.caption_matches` accepts it. Ratings are exact,
not sampled from annotators: ties are frequent (τ_b and τ_c both matter).

Each row of ``<out>/pairs.jsonl`` (the plain JSONL layout of :mod:`unicon.evaluation.alignment.data`):
``id``, ``image`` (the test image, relative to the world root), ``caption``, ``rating``, ``share``,
``references`` (three error-free phrasings of the scene, none equal to the caption), ``errors`` (the
kinds applied), ``statements`` (``[{"text", "true"}]``) and ``scene``. Pair ``i`` uses test scene
``i mod N`` and the RNG ``(seed, ALIGNMENT_STREAM, i)``: the first ``k`` pairs of a larger set are the
set of size ``k``, and nothing here touches another file of the world.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from unicon.worlds.shapes import Scene, WorldConfig, load_world, relation_holds
from unicon.worlds.shapes_text import (
    OPPOSITE_RELATION,
    Clause,
    CaptionSpec,
    NounPhrase,
    build_spec,
    plural,
)

#: the RNG stream of the alignment set (beside the builder's 11..23, 41, 43)
ALIGNMENT_STREAM = 53
ERROR_KINDS = ("negation", "color", "shape", "relation", "count", "omission")
#: how many errors a caption gets, and how often
ERROR_COUNTS, ERROR_COUNT_P = (0, 1, 2, 3), (0.3, 0.35, 0.2, 0.15)
N_REFERENCES = 3


@dataclass(frozen=True)
class Negation:
    """The clause "no <color> <shapes>": true iff no object of that kind is in the scene."""

    color: str | None
    shape: str

    def text(self, short_relations: bool = False) -> str:
        return f"no {self.color + ' ' if self.color else ''}{plural(self.shape)}"


def _count(np_: NounPhrase, scene: Scene) -> int:
    return sum(1 for o in scene.objects if np_.matches(o))


def clause_holds(clause: Clause | Negation, scene: Scene) -> bool:
    """One clause as a statement about ``scene`` (module docstring)."""
    if isinstance(clause, Negation):
        return scene.count(color=clause.color, shape=clause.shape) == 0
    if clause.relation is None:
        return _count(clause.subject, scene) == clause.subject.count
    return any(a is not b and relation_holds(a, clause.relation, b)
               for a in scene.objects if clause.subject.matches(a)
               for b in scene.objects if clause.object.matches(b))


def named_objects(clauses: Sequence[Clause | Negation]) -> int:
    return sum(n.count for c in clauses if isinstance(c, Clause) for n in c.noun_phrases())


def statements(clauses: Sequence[Clause | Negation], scene: Scene, short: bool = False) -> list[dict[str, Any]]:
    """``[{"text", "true"}]``: every clause, then completeness."""
    out = [{"text": c.text(short), "true": clause_holds(c, scene)} for c in clauses]
    out.append({"text": f"nothing else ({named_objects(clauses)} objects named)",
                "true": named_objects(clauses) == len(scene)})
    return out


def rating_of(stmts: Sequence[dict[str, Any]]) -> tuple[float, float]:
    """``(rating, share)``: ``1 + 3 * share`` with ``share`` the fraction of true statements."""
    share = sum(bool(s["true"]) for s in stmts) / len(stmts)
    return 1.0 + 3.0 * share, share


def caption_text(clauses: Sequence[Clause | Negation], prefix: str = "", short: bool = False) -> str:
    """The caption, joined as :meth:`CaptionSpec.text` joins clauses (a negation is never first)."""
    parts = [c.text(short) for c in clauses]
    body = parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
    first = clauses[0]
    if prefix == "there is" and isinstance(first, Clause) and first.subject.count > 1:
        prefix = "there are"
    return f"{prefix} {body}" if prefix else body


def _error_candidates(kind: str, clauses: list, scene: Scene, cfg: WorldConfig, rng) -> list[tuple[int, Any]]:
    """``(clause index, replacement or None for a drop)`` options of error ``kind`` that falsify their clause."""
    out: list[tuple[int, Any]] = []
    for i, c in enumerate(clauses):
        if isinstance(c, Negation):
            continue
        if kind == "omission":
            if len(clauses) > 1:
                out.append((i, None))
        elif kind == "negation" and c.relation is None:
            out.append((i, Negation(c.subject.color, c.subject.shape)))
        elif kind == "relation" and c.relation is not None:
            out.append((i, replace(c, relation=OPPOSITE_RELATION[c.relation])))
        elif kind == "count" and c.relation is None:
            for n in range(1, cfg.max_objects + 1):
                if n != c.subject.count:
                    out.append((i, replace(c, subject=replace(c.subject, count=n))))
        elif kind in ("color", "shape"):
            for which in ("subject", "object"):
                np_ = getattr(c, which)
                if np_ is None:
                    continue
                values = cfg.color_names if kind == "color" else cfg.shapes
                for v in values:
                    if v == getattr(np_, kind):
                        continue
                    new = replace(c, **{which: replace(np_, **{kind: v})})
                    out.append((i, new))
    return [(i, new) for i, new in out if new is None or not clause_holds(new, scene)]


def make_pair(scene: Scene, cfg: WorldConfig, rng: np.random.Generator) -> dict[str, Any]:
    """One caption of ``scene`` with its errors, statements, rating and references."""
    spec = build_spec(scene, rng, p_relation=0.6)
    clauses: list[Clause | Negation] = list(spec.clauses)
    n_errors = int(rng.choice(ERROR_COUNTS, p=ERROR_COUNT_P))
    touched: set[int] = set()
    errors: list[str] = []
    for kind in [ERROR_KINDS[k] for k in rng.permutation(len(ERROR_KINDS))]:
        if len(errors) == n_errors:
            break
        options = [(i, new) for i, new in _error_candidates(kind, clauses, scene, cfg, rng) if i not in touched]
        if not options:
            continue
        i, new = options[int(rng.integers(len(options)))]
        if new is None:  # omission: drop the clause; indices after it shift
            clauses.pop(i)
            touched = {t - (t > i) for t in touched}
        else:
            clauses[i] = new
            touched.add(i)
        errors.append(kind)
    if isinstance(clauses[0], Negation):  # "there is no ..." first would read as a statement about all
        k = next((j for j, c in enumerate(clauses) if not isinstance(c, Negation)), None)
        if k is not None:
            clauses[0], clauses[k] = clauses[k], clauses[0]
    stmts = statements(clauses, scene, spec.short_relations)
    rating, share = rating_of(stmts)
    caption = caption_text(clauses, spec.prefix, spec.short_relations)
    refs: list[str] = []
    for _ in range(20):
        if len(refs) == N_REFERENCES:
            break
        r = build_spec(scene, rng).text()
        if r != caption and r not in refs:
            refs.append(r)
    return {"caption": caption, "rating": rating, "share": share, "references": refs, "errors": errors,
            "statements": stmts}


def test_scenes(world_root: str | Path) -> list[tuple[str, Scene]]:
    """``(image path relative to the root, scene)`` of every test scene, in split order (from the
    rows of ``mixture_test.jsonl``, which name each scene's image and scene)."""
    path = Path(world_root) / "mixture_test.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found; build the world with `unicon build-data shapes --out {world_root}`")
    seen: dict[str, Scene] = {}
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: malformed JSON ({e.msg})") from None
            if row.get("image") and row.get("scene") and row["image"] not in seen:
                seen[row["image"]] = Scene.from_dict(row["scene"])
    return list(seen.items())


def alignment_rows(scenes: Sequence[tuple[str, Scene]], cfg: WorldConfig, n: int, seed: int) -> list[dict[str, Any]]:
    """``n`` pairs over ``scenes`` (pair ``i``: scene ``i mod len(scenes)``, RNG ``(seed, ALIGNMENT_STREAM, i)``)."""
    if n > 0 and not scenes:
        raise ValueError("the alignment set needs test scenes (--num-test >= 1)")
    rows = []
    for i in range(n):
        image, scene = scenes[i % len(scenes)]
        rng = np.random.default_rng([seed, ALIGNMENT_STREAM, i])
        pair = make_pair(scene, cfg, rng)
        rows.append({"id": f"align-{i:05d}", "image": image, **pair, "scene": scene.to_dict()})
    return rows


def write_alignment_set(world_root: str | Path, out_dir: str | Path | None = None, n: int = 200, seed: int = 0,
                        cfg: WorldConfig | None = None,
                        scenes: Sequence[tuple[str, Scene]] | None = None) -> Path:
    """Write ``<out_dir>/pairs.jsonl`` (default ``<world_root>/alignment``) with ``n`` pairs over the
    world's test images (paths relative to the root; no image is written). ``cfg``/``scenes`` default
    to the world's (``world.json``, :func:`test_scenes`); the builder passes them. Returns the file."""
    root = Path(world_root)
    out = Path(out_dir) if out_dir is not None else root / "alignment"
    cfg = cfg or load_world(root).config
    scenes = list(scenes) if scenes is not None else test_scenes(root)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "pairs.jsonl"
    with open(path, "w") as f:
        for row in alignment_rows(scenes, cfg, n, seed):
            f.write(json.dumps(row) + "\n")
    return path


__all__ = ["ALIGNMENT_STREAM", "ERROR_KINDS", "Negation", "clause_holds", "statements", "rating_of", "make_pair",
           "alignment_rows", "write_alignment_set", "test_scenes", "CaptionSpec"]
