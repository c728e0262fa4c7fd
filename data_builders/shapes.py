"""Build a ShapesWorld dataset directory: ``unicon build-data shapes --out data/shapes``.

Writes (see the team brief for the schemas)::

    world.json                      config, held-out compositions, seed, sizes, build options
    tokenizer.json                  byte-level BPE trained on all world text (<s>=0 <pad>=1 </s>=2 <unk>=3)
    images/<split>/<scene_id>.png   one rendered scene per file (jittered, noise per --noise)
    mixture_<split>.jsonl           caption / vqa / grounding / t2i rows; the train split also has the
                                    think-then-draw rows, task "reason" (no image; text = think prompt,
                                    target = gold trace ending "refined prompt: ..."), trained on when
                                    data.tasks lists "reason", and their [P, R] -> image rows, task
                                    "reason_t2i" (text = think prompt, context = trace, image =
                                    images/reason/<k>.png, a scene satisfying the target)
    cococon_<split>.json            CocoCon schema + "category" + "scene" per annotation
    drift_seeds.jsonl               (image, caption) pairs from the test split
    geneval_metadata.jsonl          GenEval schema with ShapesWorld classes and colours
    ureason/direct_<cat>.jsonl      UReason direct prompts (+ target_scene, trace)
    ureason/<cat>.jsonl             UReason think-then-refine prompts (+ target_scene, trace)
    edit_<split>.jsonl              image-edit rows, task "edit" (unicon.worlds.shapes_edit): image = source
                                    png, text = instruction, target_image = the exact edited scene's png
                                    (images/edit/<split>/), source_scene / target_scene; --edits-per-scene
    realunify/ueg.jsonl, geu.jsonl  RealUnify analogues from the test split (unicon.worlds.shapes_realunify;
                                    GEU images in realunify/images/<category>/); --realunify-per-category
    alignment/pairs.jsonl           image-caption pairs over the test images with controlled caption errors and
                                    exact ratings 1-4 (unicon.worlds.shapes_alignment); --alignment-pairs
    editscore/editscore.jsonl       edit candidates of test edits with exact quality ratings, for EditingScore
                                    (unicon.worlds.shapes_editscore; images in editscore/images/); --editscore-edits

Default sizes (6000 / 500 / 500 scenes, ~9 mixture rows per scene, 6000 reasoning rows) give a
tiny OFA enough data to learn all four tasks; the default world builds in seconds. Everything is
a function of ``--seed``: each scene's image and text use their own RNG seeded with
``(seed, split, index)``, so the output does not depend on ``--workers``. Large worlds are
rendered by a process pool, streamed to disk, and never held in memory.

The edit, RealUnify and alignment files are written last, from their own RNG streams, so the other files of a
world do not depend on them (the BPE tokenizer is trained without their text), and ``world.json``
records their options only when they differ from the defaults.

Splits are disjoint by scene. ``--held-out`` colour-shape compositions never appear in any
training image or training text (they are listed in ``world.json``); val/test contain them.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import shutil
import sys
import time
from fractions import Fraction
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from unicon.data.jsonl import read_jsonl
from unicon.errors import UserError
from unicon.worlds.shapes import (
    SPLITS,
    UREASON_CATEGORIES,
    Scene,
    ShapeObject,
    WorldConfig,
    render,
    scene_boxes,
)
from data_builders.shapes_instruct import instruct_rows
from unicon.worlds.shapes_edit import EDIT_KINDS, add_clutter, edit_row, route_marker, sample_edit
from unicon.worlds.shapes_alignment import write_alignment_set
from unicon.worlds.shapes_editscore import write_editscore_set
from unicon.worlds.shapes_realunify import GEU_CATEGORIES, geu_items, ueg_rows
from unicon.worlds.shapes_reasoning import make_reasoning_item
from unicon.worlds.shapes_text import (
    CATEGORIES,
    candidate_questions,
    describe_scene,
    make_contrast_sample,
    mentions_concept,
    mentions_kind,
    number_word,
    answer_question,
    plural,
    question_category,
    realize_pattern,
    referring_expressions,
)

SPECIAL_TOKENS = ["<s>", "<pad>", "</s>", "<unk>"]
GENEVAL_TAGS = ("single_object", "two_object", "counting", "colors", "position", "color_attr")
UREASON_ID_RANK = {"code": 1, "attribute": 2, "spatial": 3, "arithmetic": 4}  # as in the real release
QTYPES = ("color", "shape", "count", "exist", "relation")
EDITS_PER_SCENE = 0.5
REALUNIFY_PER_CATEGORY = 100
ALIGNMENT_PAIRS = 200
EDITSCORE_EDITS = 60
#: instruction rows of the train mixture (data_builders.shapes_instruct): multiple choice, GEU, BagelScore
INSTRUCT_MC, INSTRUCT_GEU, INSTRUCT_RATINGS = 6000, 1000, 6000
#: RNG stream constants of the edit rows and the RealUnify files (beside 11..23 of the other files)
EDIT_STREAM, REALUNIFY_STREAM = 41, 43
#: the tasks that a knowledge gap (``--<task>-gap``) can take a concept from, and the train rows it drops
TASK_GAP_ROWS = {"vqa": "VQA question or answer", "grounding": "referring expression",
                 "t2i": "text-to-image prompt"}
# The OFA task prompts (owned by OFAUnifiedModel) are added to the BPE corpus so that their words
# are whole tokens too.
TASK_PROMPTS = (" what does the image describe?", ' which region does the text " X " describe?',
                " what is the complete image? caption: X")


# ---------------------------------------------------------------------------------------------
# Options
# ---------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="unicon build-data shapes", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", default="data/shapes", help="output directory (the world root)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-train", type=int, default=6000, help="training scenes")
    p.add_argument("--num-val", type=int, default=500)
    p.add_argument("--num-test", type=int, default=500)
    p.add_argument("--workers", type=int, default=0, help="render processes (0 = auto: 1 for small worlds)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing world in --out")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--coco-format", action="store_true",
                   help="also write each split in COCO / VQAv2 / RefCOCO formats to <out>/coco "
                        "(unicon.data.shapes_coco; input for `unicon build-data cococon`)")
    w = p.add_argument_group("world")
    w.add_argument("--grid", type=int, default=4)
    w.add_argument("--canvas", type=int, default=64)
    w.add_argument("--min-objects", type=int, default=1)
    w.add_argument("--max-objects", type=int, default=4)
    w.add_argument("--jitter", type=int, default=1, help="max per-object pixel shift")
    w.add_argument("--noise", type=float, default=0.0, help="Gaussian pixel noise std (0..255 units)")
    w.add_argument("--held-out", type=int, default=4, help="colour-shape compositions kept out of training")
    t = p.add_argument_group("tasks")
    t.add_argument("--captions-per-scene", type=int, default=2)
    t.add_argument("--vqa-per-scene", type=int, default=4)
    t.add_argument("--grounding-per-scene", type=int, default=2)
    t.add_argument("--t2i-per-scene", type=int, default=1)
    t.add_argument("--categories", nargs="+", default=list(CATEGORIES), choices=CATEGORIES,
                   help="contrast-set categories")
    t.add_argument("--min-contrast-sets", type=int, default=1)
    t.add_argument("--max-contrast-sets", type=int, default=5)
    t.add_argument("--num-reason-train", type=int, default=6000, help="think-then-draw rows in the train mixture")
    t.add_argument("--reason-images", type=int, default=None,
                   help="[P, R] -> image rows (task reason_t2i) made from the first N think-then-draw rows "
                        "(default: all of them; 0 = none)")
    g = p.add_argument_group("knowledge gaps (a concept one task's training rows never or rarely name, "
                             "while the other tasks and every split's contrast sets keep it)")
    g.add_argument("--caption-gap", default=None, metavar="CONCEPT",
                   help="a colour or shape of the world that the train split's caption rows rarely name; "
                        "VQA, grounding and text-to-image rows keep it (None: no gap)")
    g.add_argument("--caption-gap-keep", type=float, default=0.05,
                   help="fraction of the train caption rows naming --caption-gap that are kept")
    for task, rows in TASK_GAP_ROWS.items():
        g.add_argument(f"--{task}-gap", default=None, metavar="CONCEPT",
                       help=f"a colour or shape that no train {rows} names (None: no gap)")
    t.add_argument("--num-ureason", type=int, default=50, help="UReason items per category")
    t.add_argument("--edits-per-scene", type=float, default=EDITS_PER_SCENE,
                   help="image-edit rows (edit_<split>.jsonl) per scene of every split, on average (0.5: every "
                        "other scene has one; 2: every scene two); kinds take turns (0 = none)")
    t.add_argument("--realunify-per-category", type=int, default=REALUNIFY_PER_CATEGORY,
                   help="RealUnify items per UEG/GEU category (realunify/*.jsonl, from the test split; 0 = none)")
    t.add_argument("--alignment-pairs", type=int, default=ALIGNMENT_PAIRS,
                   help="image-caption pairs with exact ratings (alignment/pairs.jsonl, over the test images; 0 = none)")
    t.add_argument("--editscore-edits", type=int, default=EDITSCORE_EDITS,
                   help="test edits whose candidates get exact ratings (editscore/editscore.jsonl; 0 = none)")
    t.add_argument("--instruct-mc", type=int, default=INSTRUCT_MC,
                   help="training VQA questions also asked as RealUnify's multiple-choice prompt (task instruct)")
    t.add_argument("--instruct-geu-per-category", type=int, default=INSTRUCT_GEU,
                   help="RealUnify GEU items per category drawn from training scenes (task instruct)")
    t.add_argument("--instruct-ratings", type=int, default=INSTRUCT_RATINGS,
                   help="BagelScore-prompt rows over training images (task instruct)")
    t.add_argument("--geneval-per-tag", type=int, default=50, help="max GenEval prompts per tag (unique)")
    t.add_argument("--num-drift-seeds", type=int, default=64)
    t.add_argument("--vocab-size", type=int, default=1000)
    return p.parse_args(argv)


def world_config(args: argparse.Namespace) -> WorldConfig:
    return WorldConfig(grid=args.grid, canvas=args.canvas, min_objects=args.min_objects,
                       max_objects=args.max_objects, jitter=args.jitter, noise=args.noise)


def validate(args: argparse.Namespace, cfg: WorldConfig) -> None:
    """Refuse configurations that cannot be satisfied, naming the option."""
    if args.num_train < 1 or args.num_val < 0 or args.num_test < 0:
        raise ValueError("--num-train must be >= 1 and --num-val/--num-test >= 0")
    for name in ("captions_per_scene", "vqa_per_scene", "grounding_per_scene", "t2i_per_scene",
                 "num_reason_train", "num_ureason", "geneval_per_tag", "num_drift_seeds", "edits_per_scene",
                 "realunify_per_category", "alignment_pairs", "editscore_edits", "instruct_mc",
                 "instruct_geu_per_category", "instruct_ratings"):
        if getattr(args, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0")
    if not 1 <= args.min_contrast_sets <= args.max_contrast_sets <= 5:
        raise ValueError(
            f"need 1 <= --min-contrast-sets ({args.min_contrast_sets}) <= --max-contrast-sets "
            f"({args.max_contrast_sets}) <= 5 (the CocoCon schema has 1-5 contrast sets per sample)"
        )
    alternatives = {"attribute": len(cfg.colors) - 1, "object": len(cfg.shapes) - 1,
                    "count": cfg.max_objects - 1, "location": 3}
    for cat in args.categories:
        if args.min_contrast_sets > alternatives[cat]:
            raise ValueError(
                f"--min-contrast-sets={args.min_contrast_sets} but category {cat!r} has only "
                f"{alternatives[cat]} alternatives in this world; lower it or drop the category"
            )
    most = max(alternatives[c] for c in args.categories)
    if args.max_contrast_sets > most:
        raise ValueError(
            f"--max-contrast-sets={args.max_contrast_sets} is more contrast sets than alternatives: "
            f"the categories {args.categories} offer at most {most}"
        )
    if args.held_out < 0 or args.held_out > min(len(cfg.colors), len(cfg.shapes)) - 1:
        raise ValueError(
            f"--held-out={args.held_out}: at most {min(len(cfg.colors), len(cfg.shapes)) - 1} compositions "
            "can be held out while every colour and shape keeps a training composition"
        )
    if args.num_drift_seeds > args.num_test:
        raise ValueError(f"--num-drift-seeds={args.num_drift_seeds} exceeds --num-test={args.num_test}")
    if args.vocab_size < 300:
        raise ValueError("--vocab-size must be >= 300 (256 byte symbols + specials + merges)")
    if args.reason_images is not None and not 0 <= args.reason_images <= args.num_reason_train:
        raise ValueError(f"--reason-images={args.reason_images} must be in 0..--num-reason-train ({args.num_reason_train})")
    if args.caption_gap is not None and args.caption_gap not in (*cfg.color_names, *cfg.shapes):
        raise ValueError(f"--caption-gap={args.caption_gap!r} is neither a colour ({', '.join(cfg.color_names)}) "
                         f"nor a shape ({', '.join(cfg.shapes)}) of the world")
    if not 0.0 <= args.caption_gap_keep <= 1.0:
        raise ValueError(f"--caption-gap-keep={args.caption_gap_keep} must be in [0, 1]")
    for task in TASK_GAP_ROWS:
        concept = getattr(args, f"{task}_gap")
        if concept is not None and concept not in (*cfg.color_names, *cfg.shapes):
            raise ValueError(f"--{task}-gap={concept!r} is neither a colour ({', '.join(cfg.color_names)}) "
                             f"nor a shape ({', '.join(cfg.shapes)}) of the world")
    gaps = task_gaps(args)
    if len(set(gaps.values())) < len(gaps):
        raise ValueError(f"two tasks share a gap concept ({gaps}): each task's gap must be its own concept, "
                         "so that the contrast sets can tell which task lacks what")


def task_gaps(args: argparse.Namespace | dict) -> dict[str, str]:
    """``{task: concept}`` of every knowledge gap the build options ask for (the caption gap included)."""
    get = args.get if isinstance(args, dict) else lambda k: getattr(args, k, None)
    return {task: get(f"{task}_gap") for task in ("caption", *TASK_GAP_ROWS) if get(f"{task}_gap") is not None}


# ---------------------------------------------------------------------------------------------
# Scenes
# ---------------------------------------------------------------------------------------------
def choose_held_out(cfg: WorldConfig, k: int, seed: int) -> list[tuple[str, str]]:
    """``k`` compositions with distinct colours and distinct shapes."""
    rng = np.random.default_rng([seed, 11])
    colors = rng.permutation(len(cfg.colors))[:k]
    shapes = rng.permutation(len(cfg.shapes))[:k]
    return sorted((cfg.color_names[c], cfg.shapes[s]) for c, s in zip(colors, shapes))


def sample_scene(rng: np.random.Generator, cfg: WorldConfig, p_repeat: float = 0.3) -> Scene:
    n = int(rng.integers(cfg.min_objects, cfg.max_objects + 1))
    cells = rng.choice(cfg.grid * cfg.grid, size=n, replace=False)
    kinds: list[tuple[str, str]] = []
    for i in range(n):
        if i and rng.random() < p_repeat:
            kinds.append(kinds[rng.integers(i)])
        else:
            kinds.append((cfg.color_names[rng.integers(len(cfg.colors))], cfg.shapes[rng.integers(len(cfg.shapes))]))
    return Scene(tuple(ShapeObject(s, c, int(k) // cfg.grid, int(k) % cfg.grid) for (c, s), k in zip(kinds, cells)))


def sample_splits(cfg: WorldConfig, sizes: dict[str, int], held_out, seed: int) -> dict[str, list[Scene]]:
    """Unique scenes per split (no scene in two splits); training scenes avoid held-out compositions."""
    rng = np.random.default_rng([seed, 13])
    seen: set[tuple] = set()
    held = set(held_out)
    out: dict[str, list[Scene]] = {}
    for split in SPLITS:
        scenes = []
        misses = 0
        while len(scenes) < sizes[split]:
            s = sample_scene(rng, cfg)
            if s.key() in seen or (split == "train" and any(o.kind in held for o in s.objects)):
                misses += 1
                if misses > 10_000 + 20 * len(seen):
                    raise ValueError(
                        f"cannot draw {sizes[split]} distinct {split} scenes: the world ({cfg.grid}x{cfg.grid} grid, "
                        f"{cfg.min_objects}-{cfg.max_objects} objects) has too few; lower the split sizes"
                    )
                continue
            seen.add(s.key())
            scenes.append(s)
        out[split] = scenes
    return out


# ---------------------------------------------------------------------------------------------
# Per-scene work (runs in worker processes)
# ---------------------------------------------------------------------------------------------
_STATE: dict[str, Any] = {}


def _init_worker(state: dict[str, Any]) -> None:
    _STATE.clear()
    _STATE.update(state)


def scene_name(scene_id: int, width: int) -> str:
    return f"{scene_id:0{width}d}"


def process_scene(task: tuple[str, int, int, dict]) -> dict[str, Any]:
    """Render one scene to disk and write all its text rows. Deterministic in (seed, split, index)."""
    split, index, scene_id, scene_dict = task
    cfg: WorldConfig = _STATE["cfg"]
    args = _STATE["args"]
    forbidden = _STATE["held_out"] if split == "train" else []
    scene = Scene.from_dict(scene_dict)
    name = scene_name(scene_id, _STATE["width"])
    rel = f"images/{split}/{name}.png"
    img_seed = int(np.random.SeedSequence([args["seed"], SPLITS.index(split), index]).generate_state(1)[0])
    render(scene, cfg, seed=img_seed).save(Path(_STATE["out"]) / rel)
    boxes = scene_boxes(scene, cfg, seed=img_seed)
    rng = np.random.default_rng([args["seed"], SPLITS.index(split), index, 1])
    sd = scene.to_dict()

    def row(task_name, k, text, target, qtype=None):
        return {"id": f"{split}-{name}-{task_name}-{k}", "scene_id": name, "image": rel, "task": task_name,
                "text": text, "target": target, "qtype": qtype, "scene": sd}

    def ok(text: str) -> bool:
        return not (forbidden and mentions_kind(text, forbidden))

    rows = []
    captions = []
    # the knowledge gaps: a train caption naming the caption gap's concept is kept with probability
    # keep (its own RNG stream, so a world without a gap is unchanged by the option); a train row of
    # another task naming that task's gap concept is dropped. Rows are drawn first and dropped after,
    # so every other row of the scene is the one a world without gaps has.
    gaps = task_gaps(args) if split == "train" else {}
    gap, keep = gaps.get("caption"), args["caption_gap_keep"]
    gap_rng = np.random.default_rng([args["seed"], SPLITS.index(split), index, 2])

    def in_gap(task_name: str, *texts: str) -> bool:
        return task_name in gaps and any(mentions_concept(t, gaps[task_name]) for t in texts)

    for k in range(args["captions_per_scene"]):
        cap = describe_scene(scene, rng)
        captions.append(cap)
        if gap is not None and mentions_concept(cap, gap) and gap_rng.random() >= keep:
            continue
        rows.append(row("caption", k, None, cap))
    questions = candidate_questions(scene, cfg, rng)
    types = [t for t in QTYPES if any(ok(q) for q in questions[t])]
    for k in range(args["vqa_per_scene"]):
        if not types:
            break
        qtype = types[(index + k) % len(types)]
        pool = [q for q in questions[qtype] if ok(q)]
        q = pool[rng.integers(len(pool))]
        answer = answer_question(q, scene, cfg)
        if not in_gap("vqa", q, answer):
            rows.append(row("vqa", k, q, answer, question_category(q)))
    refs = [(e, i) for i, o in enumerate(scene.objects) for e in referring_expressions(o, scene)]
    for k in range(min(args["grounding_per_scene"], len(refs))):
        e, i = refs[rng.integers(len(refs))]
        if not in_gap("grounding", e):
            rows.append(row("grounding", k, e, list(boxes[i])))
    for k in range(args["t2i_per_scene"]):
        prompt = captions[k % len(captions)] if captions else describe_scene(scene, rng)
        if not in_gap("t2i", prompt):
            rows.append(row("t2i", k, prompt, None))

    # One contrast sample per scene. Categories take turns by scene index; when the scene cannot
    # host its turn's category, a random feasible one is used (so no category absorbs the misses).
    # With knowledge gaps, a scene holding a gap concept gets a sample about it (gold answer = the
    # concept: attribute for a colour, object for a shape), so the contrast sets probe every gap.
    ann = None
    cats = list(args["categories"])
    preferred = cats[index % len(cats)]
    present = [c for c in task_gaps(args).values() if any(c in (o.color, o.shape) for o in scene.objects)]
    # with several gap concepts in one scene, scenes take turns (index), so no RNG draw is added
    gap = present[index % len(present)] if present else None
    if gap is not None:
        gap_category = "attribute" if gap in cfg.colors else "object"
        preferred = gap_category if gap_category in cats else preferred
    others = [c for c in cats if c != preferred]
    for cat in [preferred] + [others[k] for k in rng.permutation(len(others))]:
        sample = make_contrast_sample(scene, cat, cfg, rng, args["min_contrast_sets"], args["max_contrast_sets"],
                                      forbidden=forbidden, boxes=boxes, concept=gap)
        if sample is not None:
            ann = {"id": scene_id, "image_id": scene_id, "question_id": scene_id * 1000, **sample, "scene": sd}
            break
    image = {"id": scene_id, "file_name": rel, "height": cfg.canvas, "width": cfg.canvas}
    return {"rows": rows, "annotation": ann, "image": image,
            "drift": {"id": name, "image": rel, "caption": describe_scene(scene), "scene": sd}}


# ---------------------------------------------------------------------------------------------
# World-level files
# ---------------------------------------------------------------------------------------------
def geneval_rows(cfg: WorldConfig, per_tag: int, seed: int) -> list[dict[str, Any]]:
    """Unique GenEval-schema prompts per tag (capped by how many distinct prompts the world has)."""
    rng = np.random.default_rng([seed, 17])
    shapes, colors = list(cfg.shapes), list(cfg.color_names)

    def a(word):
        return "an" if word[0] in "aeiou" else "a"

    def pool(tag):
        if tag == "single_object":
            return [{"include": [{"class": s, "count": 1}], "prompt": f"a photo of {a(s)} {s}"} for s in shapes]
        if tag == "two_object":
            return [{"include": [{"class": s, "count": 1}, {"class": t, "count": 1}],
                     "prompt": f"a photo of {a(s)} {s} and {a(t)} {t}"} for s in shapes for t in shapes if s != t]
        if tag == "counting":
            return [{"include": [{"class": s, "count": n}], "exclude": [{"class": s, "count": n + 1}],
                     "prompt": f"a photo of {number_word(n)} {plural(s)}"}
                    for s in shapes for n in range(2, cfg.max_objects + 1)]
        if tag == "colors":
            return [{"include": [{"class": s, "count": 1, "color": c}], "prompt": f"a photo of {a(c)} {c} {s}"}
                    for s in shapes for c in colors]
        if tag == "position":
            return [{"include": [{"class": t, "count": 1}, {"class": s, "count": 1, "position": [rel, 0]}],
                     "prompt": f"a photo of {a(s)} {s} {rel} {a(t)} {t}"}
                    for s in shapes for t in shapes if s != t for rel in ("left of", "right of", "above", "below")]
        return [{"include": [{"class": s, "count": 1, "color": c}, {"class": t, "count": 1, "color": d}],
                 "prompt": f"a photo of {a(c)} {c} {s} and {a(d)} {d} {t}"}
                for s in shapes for t in shapes if s != t for c in colors for d in colors if c != d]

    out = []
    for tag in GENEVAL_TAGS:
        items = pool(tag)
        for i in sorted(rng.permutation(len(items))[:per_tag].tolist()):
            out.append({"tag": tag, **items[i]})
    return out


def reasoning_items(cfg: WorldConfig, args: argparse.Namespace, held_out) -> tuple[dict, list[dict]]:
    """Evaluation items per UReason category, and training think-then-draw rows (disjoint prompts)."""
    n = args.num_ureason
    block = 100 if n <= 100 else 10 ** len(str(n))
    evals: dict[str, list[dict]] = {}
    seen: set[str] = set()
    for cat in UREASON_CATEGORIES:
        rng = np.random.default_rng([args.seed, 19, UREASON_CATEGORIES.index(cat)])
        items, misses = [], 0
        while len(items) < n:
            it = make_reasoning_item(cat, rng, cfg)
            if it["direct_prompt"] in seen:
                misses += 1
                if misses > 50 * (n + 10):
                    raise ValueError(f"cannot draw {n} distinct {cat} reasoning prompts in this world")
                continue
            seen.add(it["direct_prompt"])
            items.append({"id": UREASON_ID_RANK[cat] * block + len(items) + 1, **it})
        evals[cat] = items
    rng = np.random.default_rng([args.seed, 23])
    train, tries = [], 0
    while len(train) < args.num_reason_train:
        cat = UREASON_CATEGORIES[len(train) % len(UREASON_CATEGORIES)]
        it = make_reasoning_item(cat, rng, cfg, forbidden=held_out)
        tries += 1
        if it["direct_prompt"] in seen:
            if tries > 50 * (args.num_reason_train + 100):
                raise ValueError("cannot draw enough training reasoning prompts distinct from the evaluation ones")
            continue
        train.append({"id": f"train-reason-{len(train)}", "scene_id": None, "image": None, "task": "reason",
                      "text": it["think_prompt"], "target": it["trace"], "qtype": cat, "scene": None,
                      "target_scene": it["target_scene"]})
    return evals, train


def reason_image_rows(cfg: WorldConfig, reason_rows: list[dict], out: Path, seed: int,
                      avoid: set[tuple]) -> Iterator[dict]:
    """Think-then-draw rows as text-to-image rows: ``[P, R] -> image`` (task ``reason_t2i``; text = the
    think prompt P, context = the gold trace R, image = a rendered scene satisfying the target), the
    input UReason's setting 2 gives the model (``generate_image(P, context=R)``). Images go to
    ``images/reason/``; each scene is drawn from the target pattern with its own RNG and is never
    one of the ``avoid`` scene keys (the val/test scenes)."""
    (out / "images" / "reason").mkdir(parents=True, exist_ok=True)
    width = max(5, len(str(max(len(reason_rows) - 1, 0))))
    for k, r in enumerate(reason_rows):
        rng = np.random.default_rng([seed, 23, k])
        scene = realize_pattern(r["target_scene"], cfg, rng)
        for _ in range(100):
            if scene.key() not in avoid:
                break
            scene = realize_pattern(r["target_scene"], cfg, rng)
        else:
            raise ValueError(f"think-then-draw row {k}: every scene satisfying its target is an evaluation scene")
        rel = f"images/reason/{k:0{width}d}.png"
        img_seed = int(np.random.SeedSequence([seed, 23, k, 1]).generate_state(1)[0])
        render(scene, cfg, seed=img_seed).save(out / rel)
        yield {"id": f"train-reason-image-{k}", "scene_id": None, "image": rel, "task": "reason_t2i",
               "text": r["text"], "context": r["target"], "target": None, "qtype": r["qtype"],
               "scene": scene.to_dict()}


def train_tokenizer(texts: Iterator[str], vocab_size: int, path: Path) -> int:
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    for i, t in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(t) != i:
            raise RuntimeError(f"special token {t} got id {tok.token_to_id(t)}, expected {i}")
    tok.save(str(path))
    return tok.get_vocab_size()


def _world_texts(out: Path) -> Iterator[str]:
    for _ in range(10):
        yield from TASK_PROMPTS
    for name in [f"mixture_{s}.jsonl" for s in SPLITS]:
        for _, r in read_jsonl(out / name):
            if r["task"] == "reason_t2i":  # the think prompt and trace of a "reason" row, again
                continue
            yield from (v for v in (r["text"], r["target"]) if isinstance(v, str))
    for split in SPLITS:
        for a in _stream_annotations(out / f"cococon_{split}.json"):
            yield from (a["caption"], a["query"], a["answer"])
            for cs in a["contrast_sets"]:
                yield from (cs["mutex_caption"], cs["mutex_answer"])
    for _, r in read_jsonl(out / "geneval_metadata.jsonl"):
        yield r["prompt"]
    for cat in UREASON_CATEGORIES:
        for name in (f"direct_{cat}.jsonl", f"{cat}.jsonl"):
            for _, r in read_jsonl(out / "ureason" / name):
                yield from (r["prompt"], r["expect_en"], r["trace"])


def _stream_annotations(path: Path) -> Iterator[dict]:
    """Annotations of a CocoCon file written by :func:`build` (one annotation per line), without
    loading the whole file -- a 100k-scene world's file is large."""
    with open(path) as f:
        for line in f:
            line = line.strip().rstrip(",")
            if line.startswith('{"id"'):
                yield json.loads(line)


def _write_jsonl(path: Path, rows) -> None:
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


# ---------------------------------------------------------------------------------------------
# Build
# ---------------------------------------------------------------------------------------------
def build(args: argparse.Namespace) -> dict[str, Any]:
    cfg = world_config(args)
    validate(args, cfg)
    final = Path(args.out)
    if final.exists():
        if not (final / "world.json").exists() and any(final.iterdir()):
            raise ValueError(f"{final} exists and is not a ShapesWorld directory; choose another --out")
        if (final / "world.json").exists() and not args.overwrite:
            raise ValueError(f"{final} already holds a world; pass --overwrite to replace it")
    # Build next to the target and swap at the end, so readers never see a half-written world.
    out = final.with_name(final.name + ".partial")
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    t0 = time.time()
    try:
        info = write_world(args, cfg, out)
        if args.coco_format:
            from unicon.data.shapes_coco import export_world

            export_world(out)
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise
    if final.exists():
        shutil.rmtree(final)
    out.rename(final)
    info["seconds"] = round(time.time() - t0, 2)
    return info


def write_world(args: argparse.Namespace, cfg: WorldConfig, out: Path) -> dict[str, Any]:
    """Write every file of the world into ``out`` (an empty directory); returns world.json's content."""
    held_out = choose_held_out(cfg, args.held_out, args.seed)
    sizes = {"train": args.num_train, "val": args.num_val, "test": args.num_test}
    scenes = sample_splits(cfg, sizes, held_out, args.seed)
    total = sum(sizes.values())
    width = max(5, len(str(total - 1)))
    for split in SPLITS:
        (out / "images" / split).mkdir(parents=True, exist_ok=True)
    (out / "ureason").mkdir(parents=True, exist_ok=True)

    state = {"cfg": cfg, "out": str(out), "width": width, "held_out": held_out,
             "args": {k: getattr(args, k) for k in ("seed", "captions_per_scene", "vqa_per_scene",
                                                     "grounding_per_scene", "t2i_per_scene", "categories",
                                                     "min_contrast_sets", "max_contrast_sets",
                                                     "caption_gap", "caption_gap_keep",
                                                     *(f"{t}_gap" for t in TASK_GAP_ROWS))}}
    workers = args.workers or (1 if total < 20_000 else min(8, os.cpu_count() or 1))
    offsets = {"train": 0, "val": sizes["train"], "test": sizes["train"] + sizes["val"]}
    counts: dict[str, Any] = {}
    evals, reason_train = reasoning_items(cfg, args, held_out)
    n_reason_images = len(reason_train) if args.reason_images is None else args.reason_images
    drift, train_rows = [], []
    pool = mp.get_context("fork").Pool(workers, _init_worker, (state,)) if workers > 1 else None
    if pool is None:
        _init_worker(state)
    try:
        progress = _progress(args.quiet)
        with progress:
            bar = progress.add_task("rendering scenes", total=total)
            for split in SPLITS:
                tasks = ((split, i, offsets[split] + i, s.to_dict()) for i, s in enumerate(scenes[split]))
                results = pool.imap(process_scene, tasks, chunksize=64) if pool else map(process_scene, tasks)
                n_rows, n_ann, n_sets, by_cat, images = 0, 0, 0, {}, []
                with open(out / f"mixture_{split}.jsonl", "w") as mix, open(out / f"cococon_{split}.json", "w") as coco:
                    coco.write('{"annotations": [')
                    for res in results:
                        for r in res["rows"]:
                            mix.write(json.dumps(r) + "\n")
                        if split == "train":
                            train_rows.extend(res["rows"])
                        n_rows += len(res["rows"])
                        if res["annotation"] is not None:
                            a = res["annotation"]
                            coco.write((",\n" if n_ann else "\n") + json.dumps(a))
                            n_ann += 1
                            n_sets += len(a["contrast_sets"])
                            by_cat[a["category"]] = by_cat.get(a["category"], 0) + 1
                        images.append(res["image"])
                        if split == "test" and len(drift) < args.num_drift_seeds:
                            drift.append(res["drift"])
                        progress.advance(bar)
                    if split == "train":
                        for r in reason_train:
                            mix.write(json.dumps(r) + "\n")
                        n_rows += len(reason_train)
                        avoid = {s.key() for split_ in ("val", "test") for s in scenes[split_]}
                        for r in reason_image_rows(cfg, reason_train[:n_reason_images], out, args.seed, avoid):
                            mix.write(json.dumps(r) + "\n")
                        n_rows += n_reason_images
                        for r in instruct_rows(train_rows, cfg, args.seed, out, held_out, args.instruct_mc,
                                               args.instruct_geu_per_category, args.instruct_ratings):
                            mix.write(json.dumps(r) + "\n")
                            n_rows += 1
                    coco.write('\n], "images": ' + json.dumps(images) + "}\n")
                counts[split] = {"scenes": sizes[split], "mixture_rows": n_rows, "cococon_annotations": n_ann,
                                 "contrast_sets": n_sets, "categories": by_cat}
    finally:
        if pool is not None:
            pool.close()
            pool.join()

    _write_jsonl(out / "drift_seeds.jsonl", drift)
    geneval = geneval_rows(cfg, args.geneval_per_tag, args.seed)
    _write_jsonl(out / "geneval_metadata.jsonl", geneval)
    for cat, items in evals.items():
        base = {"category": cat}
        _write_jsonl(out / "ureason" / f"direct_{cat}.jsonl",
                     ({"id": it["id"], "prompt": it["direct_prompt"], "expect_en": it["expect_en"], **base,
                       "target_scene": it["target_scene"], "trace": it["trace"]} for it in items))
        _write_jsonl(out / "ureason" / f"{cat}.jsonl",
                     ({"id": it["id"], "prompt": it["think_prompt"], "expect_en": it["expect_en"], **base,
                       "target_scene": it["target_scene"], "trace": it["trace"]} for it in items))
    vocab = train_tokenizer(_world_texts(out), args.vocab_size, out / "tokenizer.json")
    # new files last, from their own RNG streams: everything above is unchanged by them
    edit_counts = write_edits(cfg, args, out, scenes, held_out, width, offsets)
    realunify_counts = write_realunify(cfg, args, out, scenes["test"])
    if args.alignment_pairs > 0 and scenes["test"]:  # its own RNG stream (shapes_alignment.ALIGNMENT_STREAM), test images reused
        test_images = [(f"images/test/{scene_name(offsets['test'] + i, width)}.png", s)
                       for i, s in enumerate(scenes["test"])]
        write_alignment_set(out, out / "alignment", args.alignment_pairs, args.seed, cfg=cfg, scenes=test_images)
    if args.editscore_edits > 0 and edit_counts.get("test"):  # its own RNG stream (shapes_editscore.EDITSCORE_STREAM)
        write_editscore_set(out, out / "editscore", args.editscore_edits, args.seed, cfg=cfg, held_out=held_out)
    info = {
        "name": "shapes",
        "format_version": 1,
        "seed": args.seed,
        "config": cfg.to_dict(),
        "held_out": [list(k) for k in held_out],
        "relations": "grid: left of <=> smaller column, above <=> smaller row",
        "splits": sizes,
        "counts": counts,
        "geneval_rows": len(geneval),
        "ureason_per_category": args.num_ureason,
        "reason_train_rows": len(reason_train),
        "reason_image_rows": n_reason_images,
        "caption_gap": None if args.caption_gap is None else {"concept": args.caption_gap, "keep": args.caption_gap_keep},
        **({"task_gaps": task_gaps(args)} if any(getattr(args, f"{t}_gap") for t in TASK_GAP_ROWS) else {}),
        "drift_seeds": len(drift),
        "vocab_size": vocab,
        "special_tokens": {t: i for i, t in enumerate(SPECIAL_TOKENS)},
        "build": {k: v for k, v in vars(args).items()
                  if k not in ("out", "overwrite", "quiet", "workers") and not _default_new_option(k, v)},
    }
    if not (_default_new_option("edits_per_scene", args.edits_per_scene)
            and _default_new_option("realunify_per_category", args.realunify_per_category)):
        info["edit_rows"], info["realunify_rows"] = edit_counts, realunify_counts
    if not _default_new_option("alignment_pairs", args.alignment_pairs):
        info["alignment_rows"] = args.alignment_pairs if args.num_test else 0
    if not _default_new_option("editscore_edits", args.editscore_edits):
        info["editscore_edits"] = args.editscore_edits
    (out / "world.json").write_text(json.dumps(info, indent=2) + "\n")
    return info


def _default_new_option(key: str, value: Any) -> bool:
    """Is ``key`` an option added after format_version 1 and left at its default? Such options stay out
    of ``world.json``, so that a default build's world.json is the same as before they existed."""
    return (key, value) in (("edits_per_scene", EDITS_PER_SCENE), ("realunify_per_category", REALUNIFY_PER_CATEGORY),
                            ("alignment_pairs", ALIGNMENT_PAIRS), ("editscore_edits", EDITSCORE_EDITS),
                            *((f"{t}_gap", None) for t in TASK_GAP_ROWS))


def write_edits(cfg: WorldConfig, args: argparse.Namespace, out: Path, scenes: dict[str, list[Scene]],
                held_out, width: int, offsets: dict[str, int]) -> dict[str, int]:
    """``edit_<split>.jsonl`` for every split: ``--edits-per-scene`` = r rows per scene on average (scene i
    has ``floor((i + 1) r) - floor(i r)``), the kinds taking turns row by row (a kind that does not
    apply gives way to a random one that does; ``highlight``
    and ``route`` first try the scene with 3-6 clutter objects added). Train rows never show a held-out
    composition; the route marker kind is the same in every split. The source png is the scene's own
    image when the edit keeps the scene as its source, the target png the scene's image when the edit's
    target is the scene (``restore``); other pngs go to ``images/edit/<split>/``. Each scene's rows use
    the RNG ``(seed, EDIT_STREAM, split, index)``. Returns rows per split."""
    marker = route_marker(cfg, held_out)
    counts = {}
    for split in SPLITS:
        n = 0
        forbidden = held_out if split == "train" else []
        rate = Fraction(args.edits_per_scene).limit_denominator(1000)
        if rate:
            (out / "images" / "edit" / split).mkdir(parents=True, exist_ok=True)
        turn = 0
        with open(out / f"edit_{split}.jsonl", "w") as f:
            for index, scene in enumerate(scenes[split] if rate else []):
                rows_here = math.floor((index + 1) * rate) - math.floor(index * rate)
                if not rows_here:
                    continue
                name = scene_name(offsets[split] + index, width)
                own = f"images/{split}/{name}.png"
                rng = np.random.default_rng([args.seed, EDIT_STREAM, SPLITS.index(split), index])
                for k in range(rows_here):
                    first = EDIT_KINDS[turn % len(EDIT_KINDS)]
                    turn += 1
                    others = [EDIT_KINDS[i] for i in rng.permutation(len(EDIT_KINDS)) if EDIT_KINDS[i] != first]
                    edit = None
                    for kind in [first] + others:
                        if kind in ("highlight", "route"):
                            busy = add_clutter(scene, rng, cfg, int(rng.integers(3, 7)), forbidden, avoid_kinds=[marker])
                            edit = sample_edit(kind, busy, rng, cfg, forbidden, marker)
                        if edit is None:
                            edit = sample_edit(kind, scene, rng, cfg, forbidden, marker)
                        if edit is not None:
                            break
                    if edit is None:
                        continue
                    paths = []
                    for role, which in (("source", edit.source), ("target", edit.target)):
                        if which == scene:
                            paths.append(own)
                            continue
                        rel = f"images/edit/{split}/{name}-{k}-{role}.png"
                        seed = int(np.random.SeedSequence([args.seed, EDIT_STREAM, SPLITS.index(split), index, k,
                                                           role == "target"]).generate_state(1)[0])
                        render(which, cfg, seed=seed).save(out / rel)
                        paths.append(rel)
                    f.write(json.dumps(edit_row(edit, f"{split}-{name}-edit-{k}", *paths)) + "\n")
                    n += 1
        counts[split] = n
    return counts


def write_realunify(cfg: WorldConfig, args: argparse.Namespace, out: Path, test_scenes: list[Scene]) -> dict[str, int]:
    """``realunify/ueg.jsonl`` and ``realunify/geu.jsonl`` (GEU images in ``realunify/images/<category>/``),
    ``--realunify-per-category`` items per category (GEU items drawn from the test scenes; fewer when the
    test split is too small for that many distinct items). Returns rows per file."""
    n = args.realunify_per_category
    if n <= 0:
        return {"ueg": 0, "geu": 0}
    root = out / "realunify"
    for cat in GEU_CATEGORIES:
        (root / "images" / cat).mkdir(parents=True, exist_ok=True)
    ueg = ueg_rows(cfg, n, args.seed)
    _write_jsonl(root / "ueg.jsonl", ueg)
    geu = []
    for row, scene in geu_items(cfg, test_scenes, n, args.seed):
        rel = f"realunify/images/{row['category']}/{row['id']}.png"
        seed = int(np.random.SeedSequence([args.seed, REALUNIFY_STREAM, GEU_CATEGORIES.index(row["category"]),
                                           len(geu)]).generate_state(1)[0])
        render(scene, cfg, seed=seed).save(out / rel)
        geu.append({"id": row["id"], "category": row["category"], "image": rel,
                    **{k: v for k, v in row.items() if k not in ("id", "category")}})
    _write_jsonl(root / "geu.jsonl", geu)
    return {"ueg": len(ueg), "geu": len(geu)}


def _progress(quiet: bool):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TimeRemainingColumn(), disable=quiet)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        info = build(args)
    except ValueError as e:
        raise UserError(f"build-data shapes: {e}") from e
    if not args.quiet:
        c = info["counts"]
        print(f"built ShapesWorld in {args.out} in {info['seconds']}s: "
              + ", ".join(f"{s} {c[s]['scenes']} scenes / {c[s]['mixture_rows']} rows / "
                          f"{c[s]['cococon_annotations']} contrast samples" for s in SPLITS)
              + f"; vocab {info['vocab_size']}; held out {info['held_out']}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
