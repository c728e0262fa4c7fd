"""ShapesWorld in COCO / VQAv2 / RefCOCO formats, and the exact check of contrast sets built from it.

``export`` writes, for each split of a built world (``unicon build-data shapes``), into
``<world>/coco/`` (or ``--out``)::

    captions_<split>.json        COCO captions: images (file_name relative to the world root) + every
                                 caption of the split's mixture and CocoCon files
    questions_<split>.json       VQAv2 questions (question_id = image_id * 1000 + k)
    vqa_annotations_<split>.json VQAv2 annotations: question_type (VQAv2's question prefixes),
                                 answer_type (yes/no, number, other), multiple_choice_answer and 10
                                 identical human answers (the world's answers are exact)
    instances_<split>.json       COCO instances: categories = the world's shapes; one box per object,
                                 exactly as rendered (plus the object's "color")
    refs_<split>.json            RefCOCO-style referring expressions: every expression that picks
                                 out one object of a scene ("red circle", "circle", "red object")

so that ``unicon build-data cococon`` (CocoCon section 4.1) can run on a world whose every
caption is checkable. ``unicon build-data shapes --coco-format`` runs the export as part of the
build; ``python -m unicon.data.shapes_coco export --world DIR`` exports an existing world.

``verify`` checks a built ``cococon.json`` against the scenes with the world's exact caption
semantics (:func:`unicon.worlds.shapes_text.caption_matches`): every gold caption must be true
of its scene, and each contrast caption is classified as *false* (a valid contrast: it parses in
the world's grammar and contradicts the scene), *unparseable* (outside the grammar, e.g. "one
red circles"; not true of the scene either, but what a language-model filter is for) or *true*
(an invalid contrast). Rates are reported per candidate source (the contrast sets' ``source``).
It also measures pivot recall: the share of the world's own CocoCon pivots (``cococon_<split>.json``,
built from the scene structure, not from text matching) that the pipeline found.

Boxes: the builder renders scene ``i`` of a split with the seed ``SeedSequence([seed, split, i])``;
the export recomputes the boxes from that seed and checks them against every box the world
recorded (grounding rows, CocoCon ``boxes``), refusing a world whose boxes differ.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from unicon.data.coco_format import write_json
from unicon.data.jsonl import read_json, read_jsonl
from unicon.errors import UserError
from unicon.worlds.shapes import SPLITS, Scene, load_world, scene_boxes
from unicon.worlds.shapes_text import (
    NUMBER_WORDS,
    CaptionParseError,
    answer_question,
    parse_caption,
    referring_expressions,
    resolve_expression,
    spec_matches,
)

# VQAv2 question_type prefixes for the world's question grammar (longest first)
QUESTION_TYPES = ("what color is the", "what shape is the", "how many", "is there an", "is there a", "where is the",
                  "is the")


def vqa_question_type(question: str) -> str:
    """VQAv2's ``question_type`` of a ShapesWorld question: the longest of :data:`QUESTION_TYPES` it starts with."""
    q = " ".join(question.lower().split())
    for prefix in QUESTION_TYPES:
        if q.startswith(prefix + " "):
            return prefix
    raise ValueError(f"no VQAv2 question type for {question!r}")


def answer_type(answer: str) -> str:
    return "yes/no" if answer in ("yes", "no") else "number" if answer in NUMBER_WORDS else "other"


def image_seed(seed: int, split: str, index: int) -> int:
    """The render seed of scene ``index`` of ``split`` (as in ``data_builders/shapes.py``)."""
    return int(np.random.SeedSequence([seed, SPLITS.index(split), index]).generate_state(1)[0])


def _load(world_dir: str | Path):
    try:
        return load_world(world_dir)
    except (FileNotFoundError, ValueError) as e:
        raise UserError(str(e)) from e


def _split_scenes(world, split: str) -> dict[int, dict[str, Any]]:
    """image_id -> {"scene", "image", "captions", "qa" [(q, a)], "boxes_seen" [(expr, box)]} from the
    split's mixture and CocoCon files."""
    scenes: dict[int, dict[str, Any]] = {}

    def entry(image_id: int, scene: dict, image: str) -> dict:
        e = scenes.setdefault(image_id, {"scene": scene, "image": image, "captions": [], "qa": [], "boxes_seen": []})
        if e["scene"] != scene:
            raise UserError(f"{world.root}: image {image_id} has two different scenes")
        return e

    for lineno, r in read_jsonl(world.mixture_path(split), what="ShapesWorld mixture file"):
        if r.get("scene") is None or r.get("image") is None or r.get("scene_id") is None:
            continue  # rows not about one of the split's scenes: think-then-draw, instruction rows
        e = entry(int(r["scene_id"]), r["scene"], r["image"])
        if r["task"] in ("caption", "t2i"):
            text = r["target"] if r["task"] == "caption" else r["text"]
            if text not in e["captions"]:
                e["captions"].append(text)
        elif r["task"] == "vqa" and (r["text"], r["target"]) not in e["qa"]:
            e["qa"].append((r["text"], r["target"]))
        elif r["task"] == "grounding":
            e["boxes_seen"].append((r["text"], r["target"], f"{world.mixture_path(split)}:{lineno}"))
    coco = read_json(world.cococon_path(split), what="ShapesWorld CocoCon file")
    files = {im["id"]: im["file_name"] for im in coco["images"]}
    for k, a in enumerate(coco["annotations"]):
        e = entry(int(a["image_id"]), a["scene"], files[a["image_id"]])
        if a["caption"] not in e["captions"]:
            e["captions"].append(a["caption"])
        if (a["query"], a["answer"]) not in e["qa"]:
            e["qa"].append((a["query"], a["answer"]))
        if a.get("detection") is not None:
            for box in a["boxes"]:
                e["boxes_seen"].append((a["detection"], box, f"{world.cococon_path(split)}: annotations[{k}]"))
    return scenes


def export_world(world_dir: str | Path, out_dir: str | Path | None = None, splits=None) -> dict[str, Any]:
    """Write the COCO-format files of ``splits`` (default: all) of the world; returns counts."""
    world = _load(world_dir)
    cfg = world.config
    out = Path(out_dir) if out_dir is not None else world.root / "coco"
    out.mkdir(parents=True, exist_ok=True)
    sizes = world.info["splits"]
    offsets = {"train": 0, "val": sizes["train"], "test": sizes["train"] + sizes["val"]}
    categories = [{"id": i + 1, "name": s, "supercategory": "shape"} for i, s in enumerate(cfg.shapes)]
    cat_id = {s: i + 1 for i, s in enumerate(cfg.shapes)}
    counts: dict[str, Any] = {}
    for split in splits or SPLITS:
        scenes = _split_scenes(world, split)
        images, captions, questions, vqa, instances, refs = [], [], [], [], [], []
        for image_id in sorted(scenes):
            e = scenes[image_id]
            scene = Scene.from_dict(e["scene"])
            index = image_id - offsets[split]
            boxes = scene_boxes(scene, cfg, seed=image_seed(world.info["seed"], split, index))
            images.append({"id": image_id, "file_name": e["image"], "width": cfg.canvas, "height": cfg.canvas})
            for text in e["captions"]:
                captions.append({"id": len(captions) + 1, "image_id": image_id, "caption": text})
            for k, (q, a) in enumerate(e["qa"]):
                if answer_question(q, scene, cfg) != a:
                    raise UserError(f"{world.root}: image {image_id}: the world answers {q!r} with "
                                    f"{answer_question(q, scene, cfg)!r}, its files say {a!r}")
                qid = image_id * 1000 + k
                questions.append({"image_id": image_id, "question": q, "question_id": qid})
                vqa.append({"question_id": qid, "image_id": image_id, "question_type": vqa_question_type(q),
                            "answer_type": answer_type(a), "multiple_choice_answer": a,
                            "answers": [{"answer": a, "answer_confidence": "yes", "answer_id": j + 1}
                                        for j in range(10)]})
            ann_ids = []
            for obj, box in zip(scene.objects, boxes):
                ann_ids.append(len(instances) + 1)
                instances.append({"id": ann_ids[-1], "image_id": image_id, "category_id": cat_id[obj.shape],
                                  "bbox": box, "area": box[2] * box[3], "iscrowd": 0, "color": obj.color})
            for i, obj in enumerate(scene.objects):
                for expr in referring_expressions(obj, scene):
                    refs.append({"ref_id": len(refs) + 1, "ann_id": ann_ids[i], "image_id": image_id,
                                 "category_id": cat_id[obj.shape], "split": split, "bbox": boxes[i],
                                 "sentences": [{"sent_id": len(refs) + 1, "raw": expr, "sent": expr,
                                                "tokens": expr.split()}]})
            _check_boxes(e["boxes_seen"], scene, boxes, cfg, image_id)
        write_json(out / f"captions_{split}.json", {"images": images, "annotations": captions})
        write_json(out / f"questions_{split}.json", {"questions": questions})
        write_json(out / f"vqa_annotations_{split}.json", {"annotations": vqa})
        write_json(out / f"instances_{split}.json", {"images": images, "categories": categories,
                                                     "annotations": instances})
        write_json(out / f"refs_{split}.json", {"refs": refs})
        counts[split] = {"images": len(images), "captions": len(captions), "questions": len(questions),
                         "instances": len(instances), "refs": len(refs)}
    return {"out": str(out), "splits": counts}


def _check_boxes(seen, scene, boxes, cfg, image_id: int) -> None:
    for expr, box, where in seen:
        obj = resolve_expression(expr, scene, cfg)
        if list(boxes[scene.objects.index(obj)]) != [int(v) for v in box]:
            raise UserError(f"{where}: image {image_id}: the world recorded box {box} for {expr!r}, but its scene "
                            f"renders it at {boxes[scene.objects.index(obj)]} (built by another builder version?)")


# ---------------------------------------------------------------------------------------------
# Verification of built contrast sets
# ---------------------------------------------------------------------------------------------
def verify_contrasts(cococon_path: str | Path, world_dir: str | Path, split: str) -> dict[str, Any]:
    """Classify every contrast caption of ``cococon_path`` against its scene (module docstring)."""
    world = _load(world_dir)
    cfg = world.config
    scenes = {i: Scene.from_dict(e["scene"]) for i, e in _split_scenes(world, split).items()}
    data = read_json(cococon_path, what="CocoCon file")

    def verdict(text: str, scene) -> str:
        try:
            spec = parse_caption(text, cfg)
        except CaptionParseError:
            return "unparseable"
        return "true" if spec_matches(spec, scene) else "false"

    by_source: dict[str, Counter] = defaultdict(Counter)
    gold = Counter()
    examples: dict[str, list] = defaultdict(list)
    found = set()
    for k, a in enumerate(data["annotations"]):
        if a["image_id"] not in scenes:
            raise UserError(f"{cococon_path}: annotations[{k}]: image_id {a['image_id']} is not a {split} scene "
                            f"of {world.root}")
        scene = scenes[a["image_id"]]
        gold[verdict(a["caption"], scene)] += 1
        found.add((a["image_id"], a["caption"], a["query"]))
        for cs in a["contrast_sets"]:
            v = verdict(cs["mutex_caption"], scene)
            src = cs.get("source", "unknown")
            by_source[src][v] += 1
            if v != "false" and len(examples[v]) < 5:
                examples[v].append({"caption": a["caption"], "query": a["query"], "answer": a["answer"],
                                    "mutex_caption": cs["mutex_caption"], "source": src})
    eligible = {(a["image_id"], a["caption"], a["query"])
                for a in read_json(world.cococon_path(split), what="ShapesWorld CocoCon file")["annotations"]}
    sources = {}
    for src, c in sorted(by_source.items()):
        n = sum(c.values())
        sources[src] = {"contrasts": n, "false": c["false"], "unparseable": c["unparseable"], "true": c["true"],
                        "valid_rate": round((n - c["true"]) / n, 4) if n else None,
                        "valid_parsed_rate": round(c["false"] / n, 4) if n else None}
    return {
        "cococon": str(cococon_path), "world": str(world.root), "split": split,
        "samples": len(data["annotations"]),
        "gold_captions": {"true": gold["true"], "false": gold["false"], "unparseable": gold["unparseable"]},
        "sources": sources,
        "pivot_recall": {"eligible": len(eligible), "found": len(eligible & found),
                         "recall": round(len(eligible & found) / len(eligible), 4) if eligible else None},
        "examples": dict(examples),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m unicon.data.shapes_coco", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    e = sub.add_parser("export", help="write a built world's splits in COCO / VQAv2 / RefCOCO formats")
    e.add_argument("--world", required=True, help="a folder written by `unicon build-data shapes`")
    e.add_argument("--out", help="output folder (default: <world>/coco)")
    e.add_argument("--splits", nargs="+", choices=SPLITS, default=list(SPLITS))
    v = sub.add_parser("verify", help="check a cococon.json built from the export against the scenes")
    v.add_argument("--world", required=True)
    v.add_argument("--split", choices=SPLITS, default="test", help="the split the cococon.json was built from")
    v.add_argument("--cococon", required=True, help="cococon.json written by `unicon build-data cococon`")
    v.add_argument("--out", help="also write the report here (JSON)")
    a = p.parse_args(argv)
    if a.command == "export":
        print(json.dumps(export_world(a.world, a.out, a.splits), indent=2))
        return 0
    report = verify_contrasts(a.cococon, a.world, a.split)
    if a.out:
        write_json(a.out, report, indent=2)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
