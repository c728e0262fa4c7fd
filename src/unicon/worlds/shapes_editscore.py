"""ShapesWorld ground truth for EditingScore: edit candidates of known, exact quality.

From a world's test edit rows (``edit_test.jsonl``, :mod:`unicon.worlds.shapes_edit`: source scene S,
instruction, exact target scene T), :func:`write_editscore_set` draws ``n`` edits and, for each, up to
six candidate edited scenes (:data:`CANDIDATES`), every one rendered with the world's renderer:

``exact``
    T itself.
``partial``
    T on a random non-empty proper subset of the cells the edit changes, S on the others (only for edits
    that change at least two cells; otherwise this candidate is left out).
``wrong_object``
    another edit of the same kind on the same source (:func:`~unicon.worlds.shapes_edit.sample_edit`,
    up to 10 draws), whose target differs from T and from S (left out when none is found, e.g. ``restore``,
    whose target is a function of the source alone).
``collateral``
    T plus one unrequested change in a cell the edit leaves alone: an object there is recoloured (another
    colour of the world), an empty cell gets a new object.
``no_change``
    S (the source, untouched).
``different_scene``
    the target scene of another drawn edit (a different board).

Exact quality ratings (the scale, all in [0, 1], exact rationals of small integers): with ``R`` the grid
cells where S and T differ (what the edit must change) and ``U`` the others (what it must keep),
comparing cells by their content (empty, or one object's shape and colour):

* ``editing_accuracy``     = |{c in R : C[c] == T[c]}| / |R|
* ``content_preservation`` = |{c in U : C[c] == S[c]}| / |U|   (1 when U is empty)
* ``overall``              = editing_accuracy x content_preservation

so ``exact`` is 1, ``no_change`` 0, ``collateral`` (|U| - 1) / |U|, ``partial`` k / |R|; Edit-1K's
other two criteria (visual quality, style consistency) are constant on a clean renderer and are not
written. Every image is the canonical render (``seed=None``: no jitter, no noise), so two candidates
differ in pixels exactly where their scenes differ; the source is re-rendered the same way.

Layout of ``out_dir`` (the Edit-1K-like JSONL of :mod:`unicon.evaluation.editing.data`, paths relative to
the file)::

    editscore.jsonl          one row per candidate: id, source_image, edited_image, instruction, ratings,
                             kind, candidate, edit_id, source_scene, edited_scene, target_scene
    images/<edit_id>/source.png, <candidate>.png

Everything is a function of the world and ``seed`` (RNG ``(seed, EDITSCORE_STREAM)``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from unicon.worlds.shapes import Scene, ShapeObject, WorldConfig, load_world, render
from unicon.worlds.shapes_edit import route_marker, sample_edit

CANDIDATES = ("exact", "partial", "wrong_object", "collateral", "no_change", "different_scene")
CRITERIA = ("editing_accuracy", "content_preservation", "overall")
#: RNG stream constant of the EditingScore set (beside the builder's 11..23, 41, 43)
EDITSCORE_STREAM = 47
FILE_NAME = "editscore.jsonl"

Cell = tuple[str, str] | None  # (shape, color) or empty


def cells(scene: Scene, cfg: WorldConfig) -> dict[tuple[int, int], Cell]:
    """Every grid cell's content: ``(shape, color)`` or None."""
    out: dict[tuple[int, int], Cell] = {(r, c): None for r in range(cfg.grid) for c in range(cfg.grid)}
    for o in scene.objects:
        out[(o.row, o.col)] = (o.shape, o.color)
    return out


def from_cells(content: dict[tuple[int, int], Cell]) -> Scene:
    return Scene(tuple(ShapeObject(v[0], v[1], r, c) for (r, c), v in content.items() if v is not None))


def ratings(source: Scene, target: Scene, candidate: Scene, cfg: WorldConfig) -> dict[str, float]:
    """The exact ratings of ``candidate`` for the edit ``source -> target`` (module docstring)."""
    s, t, c = cells(source, cfg), cells(target, cfg), cells(candidate, cfg)
    changed = [k for k in s if s[k] != t[k]]
    kept = [k for k in s if s[k] == t[k]]
    if not changed:
        raise ValueError("the edit changes no cell")
    accuracy = sum(c[k] == t[k] for k in changed) / len(changed)
    preservation = sum(c[k] == s[k] for k in kept) / len(kept) if kept else 1.0
    return {"editing_accuracy": accuracy, "content_preservation": preservation, "overall": accuracy * preservation}


def candidates(source: Scene, target: Scene, kind: str, other: Scene, rng: np.random.Generator,
               cfg: WorldConfig, marker: tuple[str, str]) -> dict[str, Scene]:
    """The candidate scenes of one edit, in :data:`CANDIDATES` order (some may be left out)."""
    s, t = cells(source, cfg), cells(target, cfg)
    changed = [k for k in s if s[k] != t[k]]
    kept = [k for k in s if s[k] == t[k]]
    out: dict[str, Scene] = {"exact": target}
    if len(changed) >= 2:
        k = int(rng.integers(1, len(changed)))
        pick = {changed[i] for i in rng.choice(len(changed), size=k, replace=False)}
        out["partial"] = from_cells({cell: (t[cell] if cell in pick else s[cell]) for cell in s})
    for _ in range(10):
        e = sample_edit(kind, source, rng, cfg, (), marker)
        if e is not None and e.source == source and e.target not in (target, source):
            out["wrong_object"] = e.target
            break
    if kept:
        cell = kept[int(rng.integers(len(kept)))]
        c = dict(t)
        if c[cell] is not None:
            shape, color = c[cell]
            colors = [x for x in cfg.color_names if x != color]
            c[cell] = (shape, colors[int(rng.integers(len(colors)))])
        else:
            c[cell] = (cfg.shapes[int(rng.integers(len(cfg.shapes)))],
                       cfg.color_names[int(rng.integers(len(cfg.color_names)))])
        out["collateral"] = from_cells(c)
    out["no_change"] = source
    if other not in (source, target):
        out["different_scene"] = other
    return {name: out[name] for name in CANDIDATES if name in out}


def write_editscore_set(world_root: str | Path, out_dir: str | Path, n: int = 60, seed: int = 0,
                        cfg: WorldConfig | None = None, held_out=None) -> Path:
    """Draw ``n`` edits of ``world_root``'s ``edit_test.jsonl`` (all of them when fewer) and write their
    candidates, images and exact ratings to ``out_dir`` (module docstring); returns the JSONL path.
    ``out_dir`` is replaced when it exists. ``cfg`` / ``held_out`` (the builder, before ``world.json``
    exists): the world's config and held-out compositions, instead of reading ``world.json``."""
    if cfg is None:
        world = load_world(world_root)
        cfg, held_out = world.config, world.held_out
    edit_file = Path(world_root) / "edit_test.jsonl"
    rows = [json.loads(line) for line in edit_file.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r["source_scene"] != r["target_scene"]]
    if not rows:
        raise ValueError(f"{edit_file} has no edit rows")
    rng = np.random.default_rng([seed, EDITSCORE_STREAM])
    chosen = sorted(int(i) for i in rng.choice(len(rows), size=min(n, len(rows)), replace=False))
    marker = route_marker(cfg, held_out or [])
    out_dir = Path(out_dir)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    (out_dir / "images").mkdir(parents=True)
    path = out_dir / FILE_NAME
    with open(path, "w") as f:
        for j, i in enumerate(chosen):
            row = rows[i]
            source, target = Scene.from_dict(row["source_scene"]), Scene.from_dict(row["target_scene"])
            other_i = chosen[(j + 1 + int(rng.integers(len(chosen) - 1))) % len(chosen)] if len(chosen) > 1 else i
            other = Scene.from_dict(rows[other_i]["target_scene"])
            edit_id = row["id"]
            folder = out_dir / "images" / edit_id
            folder.mkdir()
            render(source, cfg).save(folder / "source.png")
            for name, scene in candidates(source, target, row["kind"], other, rng, cfg, marker).items():
                render(scene, cfg).save(folder / f"{name}.png")
                rec: dict[str, Any] = {
                    "id": f"{edit_id}/{name}", "source_image": f"images/{edit_id}/source.png",
                    "edited_image": f"images/{edit_id}/{name}.png", "instruction": row["text"],
                    "ratings": ratings(source, target, scene, cfg), "kind": row["kind"], "candidate": name,
                    "edit_id": edit_id, "source_scene": source.to_dict(), "edited_scene": scene.to_dict(),
                    "target_scene": target.to_dict()}
                f.write(json.dumps(rec) + "\n")
    return path


__all__ = ["CANDIDATES", "CRITERIA", "EDITSCORE_STREAM", "FILE_NAME", "cells", "from_cells", "ratings", "candidates",
           "write_editscore_set"]
