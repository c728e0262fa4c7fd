"""Reasoning-to-image prompts for ShapesWorld, in the UReason style (arithmetic, attribute, spatial, code).

Each item has two prompt forms, as in UReason (Setting 1 vs Settings 2/3):

* ``direct`` -- the scenario plus "generate the image ... strictly according to the final state";
* ``think`` -- the scenario plus "think step by step ... then output ``refined prompt: {...}``".

Besides UReason's English ``expect_en`` every item carries the exact criterion ``target_scene``
(a pattern checked by :func:`unicon.worlds.shapes_verify.check_criterion`) and a gold ``trace``:
a few lines of reasoning ending with ``refined prompt: <canonical caption of the target>``, so a
model can be *trained* to think, then draw. The canonical caption satisfies the criterion exactly
(``caption_matches(refined, s) == pattern_matches(target, s)`` for every scene ``s``).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from unicon.worlds.shapes import WorldConfig
from unicon.worlds.shapes_text import REL_PHRASES, mentions_kind, pattern_caption, pattern_english, plural

DIRECT_INSTRUCTIONS = (
    "instructions:\ngenerate the image of the board strictly according to the final state in the scenario."
)
THINK_INSTRUCTIONS = (
    "instructions:\ndescribe & format: first, think step by step about the scenario to find the final state "
    "of the board. then output the description following the format as \"refined prompt: {your visual "
    "description here}\"\ngenerate: generate the image of the board based only on your visual description."
)
REFINED_MARKER = "refined prompt:"


def _np(n: int, color: str, shape: str) -> str:
    return f"{n} {color} {shape if n == 1 else plural(shape)}"


def _kind(rng, cfg: WorldConfig, forbidden, exclude=()) -> tuple[str, str]:
    for _ in range(1000):
        k = (cfg.color_names[rng.integers(len(cfg.colors))], cfg.shapes[rng.integers(len(cfg.shapes))])
        if k not in forbidden and k not in exclude and k[1] not in {e[1] for e in exclude}:
            return k
    raise ValueError("cannot draw a composition outside the forbidden/excluded ones; world too small")


def _arithmetic(rng, cfg: WorldConfig, forbidden):
    color, shape = _kind(rng, cfg, forbidden)
    other = _kind(rng, cfg, forbidden, exclude=[(color, shape)]) if cfg.max_objects >= 2 and rng.random() < 0.4 else None
    final = int(rng.integers(1, cfg.max_objects + (0 if other else 1)))
    removed = int(rng.integers(1, 5))
    added = int(rng.integers(0, min(2, final) + 1))  # keeps start - removed >= 0
    start = final + removed - added
    steps = [f"a board had {_np(start, color, shape)}."]
    lines = [f"the board starts with {start}."]
    value = start
    steps.append(f"{removed} of them were taken away.")
    lines.append(f"{value} - {removed} = {value - removed}.")
    value -= removed
    if added:
        steps.append(f"then {added} more {shape + ' was' if added == 1 else plural(shape) + ' were'} added.")
        lines.append(f"{value} + {added} = {value + added}.")
        value += added
    assert value == final
    objects = [{"shape": shape, "color": color}] * final
    if other:
        steps.append(f"{_np(1, *other)} stayed on the board the whole time.")
        lines.append(f"the {other[0]} {other[1]} is still there.")
        objects = objects + [{"shape": other[1], "color": other[0]}]
    scenario = " ".join(steps) + " draw the board now."
    lines.append(f"so the board has {_np(final, color, shape)}" + (f" and 1 {other[0]} {other[1]}." if other else "."))
    return "shape counting", scenario, {"objects": objects, "relations": []}, lines


def _attribute(rng, cfg: WorldConfig, forbidden):
    n = int(rng.integers(1, min(3, cfg.max_objects) + 1))
    kinds: list[tuple[str, str]] = []
    for _ in range(n):
        kinds.append(_kind(rng, cfg, forbidden, exclude=kinds))
    t = int(rng.integers(n))
    old, shape = kinds[t]
    options = [c for c in cfg.color_names if c != old and (c, shape) not in forbidden]
    new = options[rng.integers(len(options))]
    decoys = [c for c in options if c != new]
    listing = " and ".join(f"{'an' if c[0] in 'aeiou' else 'a'} {c} {s}" for c, s in kinds)
    steps = [f"a board shows {listing}."]
    if decoys and rng.random() < 0.5:
        decoy = decoys[rng.integers(len(decoys))]
        steps.append(f"someone wanted to paint the {old} {shape} {decoy}, but in the end it was painted {new}.")
        lines = [f"the {decoy} paint was not used.", f"the {old} {shape} becomes {new}."]
    else:
        steps.append(f"the {old} {shape} is painted {new}.")
        lines = [f"the {old} {shape} becomes {new}."]
    kinds[t] = (new, shape)
    lines.append("the other objects do not change.")
    scenario = " ".join(steps) + " draw the board now."
    return "paint job", scenario, {"objects": [{"shape": s, "color": c} for c, s in kinds], "relations": []}, lines


def _spatial(rng, cfg: WorldConfig, forbidden):
    a = _kind(rng, cfg, forbidden)
    b = _kind(rng, cfg, forbidden, exclude=[a])
    rel = ("left", "right", "above", "below")[rng.integers(4)]
    opposite = {"left": "right", "right": "left", "above": "below", "below": "above"}[rel]
    start = f"a board shows {'an' if a[0][0] in 'aeiou' else 'a'} {a[0]} {a[1]} {REL_PHRASES[rel][0]} " \
            f"{'an' if b[0][0] in 'aeiou' else 'a'} {b[0]} {b[1]}."
    if rng.random() < 0.5:
        steps = [start, f"swap the {a[1]} and the {b[1]}."]
        final = opposite
        lines = [f"before the swap the {a[1]} is {REL_PHRASES[rel][0]} the {b[1]}.",
                 f"after the swap the {a[1]} is {REL_PHRASES[opposite][0]} the {b[1]}."]
    else:
        choices = [r for r in ("left", "right", "above", "below") if r != rel]
        final = choices[rng.integers(len(choices))]
        decoy = [r for r in choices if r != final][rng.integers(2)]
        steps = [start, f"you thought about putting the {a[1]} {REL_PHRASES[decoy][0]} the {b[1]}, "
                        f"but instead you move it so that it is {REL_PHRASES[final][0]} the {b[1]}."]
        lines = [f"the {a[1]} is not put {REL_PHRASES[decoy][0]} the {b[1]}.",
                 f"the {a[1]} ends {REL_PHRASES[final][0]} the {b[1]}."]
    pattern = {"objects": [{"shape": a[1], "color": a[0]}, {"shape": b[1], "color": b[0]}],
               "relations": [{"subject": 0, "relation": final, "object": 1}]}
    return "shape arrangement", " ".join(steps) + " draw the board now.", pattern, lines


def _code(rng, cfg: WorldConfig, forbidden):
    if rng.random() < 0.5:
        color, shape = _kind(rng, cfg, forbidden)
        options = [c for c in cfg.color_names if c != color and (c, shape) not in forbidden]
        color2 = options[rng.integers(len(options))]
        final = int(rng.integers(1, cfg.max_objects + 1))
        first = int(rng.integers(0, final + 1))
        code = (f"shape = \"{shape}\"\ncolor = \"{color}\"\nn = {first}\nn = n + {final - first}\n"
                f"color = \"{color2}\"\nboard = [(color, shape)] * n")
        task = "draw one object for every item of `board` after the code runs."
        lines = [f"n = {first} + {final - first} = {final}.", f"color is reassigned from {color} to {color2}.",
                 f"board holds {_np(final, color2, shape)}."]
        pattern = {"objects": [{"shape": shape, "color": color2}] * final, "relations": []}
    else:
        n = int(rng.integers(2, min(4, cfg.max_objects + 1) + 1))
        kinds: list[tuple[str, str]] = []
        for _ in range(n):
            kinds.append(_kind(rng, cfg, forbidden, exclude=kinds))
        dropped = int(rng.integers(n))
        spans = [f"  <!-- <span class=\"{c} {s}\"></span> -->" if i == dropped else f"  <span class=\"{c} {s}\"></span>"
                 for i, (c, s) in enumerate(kinds)]
        code = "<div class=\"board\">\n" + "\n".join(spans) + "\n</div>"
        task = "draw one shape for every span that is not commented out."
        kept = [k for i, k in enumerate(kinds) if i != dropped]
        lines = [f"the {kinds[dropped][0]} {kinds[dropped][1]} is commented out.",
                 f"{len(kept)} spans remain: " + ", ".join(f"{c} {s}" for c, s in kept) + "."]
        pattern = {"objects": [{"shape": s, "color": c} for c, s in kept], "relations": []}
    return "code to board", code, pattern, lines, task


GENERATORS: dict[str, Callable] = {"arithmetic": _arithmetic, "attribute": _attribute, "spatial": _spatial, "code": _code}


def make_reasoning_item(category: str, rng: np.random.Generator, cfg: WorldConfig,
                        forbidden: Sequence[tuple[str, str]] = ()) -> dict[str, Any]:
    """``{direct_prompt, think_prompt, expect_en, target_scene, trace, refined_prompt}`` for one item."""
    if category not in GENERATORS:
        raise ValueError(f"unknown reasoning category {category!r}; expected one of {sorted(GENERATORS)}")
    forbidden = set(map(tuple, forbidden))
    for _ in range(100):
        out = GENERATORS[category](rng, cfg, forbidden)
        if category == "code":
            title, code, pattern, lines, task = out
            body = f"task: {title}\ncode:\n{code}\n\n"
            direct_tail = f"instructions:\n{task} generate the image of the board strictly according to the code."
        else:
            title, scenario, pattern, lines = out
            body = f"task: {title}\nscenario: {scenario}\n"
            direct_tail = DIRECT_INSTRUCTIONS
        if len(pattern["objects"]) > cfg.max_objects:
            continue
        refined = pattern_caption(pattern)
        text = body + direct_tail
        if forbidden and (mentions_kind(text, list(forbidden)) or mentions_kind(refined, list(forbidden))):
            continue
        think_tail = THINK_INSTRUCTIONS if category != "code" else \
            THINK_INSTRUCTIONS.replace("about the scenario", f"about the code ({task[:-1]})")
        return {
            "direct_prompt": body + direct_tail,
            "think_prompt": body + think_tail,
            "expect_en": pattern_english(pattern),
            "target_scene": pattern,
            "trace": " ".join(lines) + f"\n{REFINED_MARKER} {refined}",
            "refined_prompt": refined,
        }
    raise ValueError(f"could not draw a {category} item that fits max_objects={cfg.max_objects} and avoids held-out compositions")
