"""Task accuracies of a :class:`UnifiedModel` on a ShapesWorld split (the pretraining targets).

Read from ``mixture_<split>.jsonl``, the first ``limit`` rows of each task are evaluated
with the model's *generation* methods and the world's exact verifiers:

* ``vqa_accuracy``   = mean[ normalise(answer(image, question)) == normalise(target) ]
  with the VQA normalisation of CocoCon (``unicon.evaluation.cococon.metrics.normalize_answer``:
  lower case, punctuation and articles dropped, number words as digits). The gold answers are
  single vocabulary words (a colour, a shape, a number word, yes/no, a relation), so this only
  forgives the spelling around a correct word ("The circle." for ``circle``, "2" for ``two``);
  it never makes two different gold words equal, and no strict match is needed;
* ``caption_match``  = mean[ caption_matches(caption(image), scene) ] -- the generated caption
  describes the image's scene exactly (``unicon.worlds.shapes_text.caption_matches``);
* ``loc_iou50``      = mean[ IoU(locate(image, expression), target_box) >= 0.5 ], with
  ``IoU = |A ∩ B| / |A ∪ B|`` of ``[x, y, w, h]`` boxes (CocoCon's ``box_iou``, torchvision); ``loc_miou``
  is the mean IoU;
* ``t2i_match``      = mean[ caption_matches(caption, parse(generate_image(caption))) ] -- the
  scene parsed from the generated image satisfies the prompt; an image the parser refuses
  (``NotAShapesWorldImage``) counts as a miss.

Each accuracy is also reported by slice, as ``<metric>/<slice>`` with its count in
``<metric>/<slice>_n``: VQA by question type (``vqa_accuracy/relation``: the row's ``qtype``), and
count questions also by what they count (``vqa_accuracy/count_all``, ``count_colour``,
``count_shape``, ``count_kind``: "how many objects / red objects / circles / red circles";
``unicon.worlds.shapes_text.count_question_form``);
caption and T2I by the number of objects in the scene (``caption_match/objects_3``); T2I by whether
the prompt has a relation clause (``t2i_match/relation``, ``t2i_match/no_relation``); every task by
whether its scene holds one of the world's held-out colour-shape compositions (``world.json``
``held_out``: never in a training scene, caption, question or prompt), as ``<metric>/held_out`` and
``<metric>/no_held_out``. They say which skill a missed target lacks (counting, relations,
compositional generalisation) without another script.

The misses of the two generation tasks are also split by cause, as fractions of all the task's
examples (so ``<metric> + sum of <task>_error/* = 1``), from the point of view of the model's output
(``unicon.worlds.shapes_text.caption_mismatch``):

* ``caption_error/unparsable``: the caption is not in the world's grammar;
* ``<task>_error/fewer_objects`` and ``<task>_error/more_objects``: the caption names, or the image
  draws, fewer or more objects than it should;
* ``<task>_error/attributes``: as many objects, some colour or shape wrong;
* ``<task>_error/relation``: the objects are right and a relation clause does not hold;
* ``t2i_error/not_an_image``: the parser refuses the generated image.

Relation questions are also asked flipped: every yes/no relation question among the evaluated VQA
rows whose answer the opposite relation reverses ("is the A left of the B?" -> "... right of ...",
``unicon.worlds.shapes_text.flip_relation_question``; the pairs on one line, where both answers
are "no", are left out) is asked again with the opposite relation:

* ``vqa_relation_flip/answer_kept`` = mean[ answer(q) == answer(flip(q)) ]: 1 for a model that
  ignores the relation word, 0 for one that reads it (``_n``: the number of such questions);
* ``vqa_relation_flip/both_right``  = mean[ both answers right ]: 1/4 for coin flips, 0 for a model
  that ignores the word, 1 for one that compares the two objects.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch
from PIL import Image

from unicon.evaluation.cococon.metrics import box_iou, normalize_answer
from unicon.progress import track

TASKS = ("vqa", "caption", "grounding", "t2i")


def read_split(world_root: str | Path, split: str) -> dict[str, list[dict]]:
    """Rows of ``mixture_<split>.jsonl`` grouped by task (always has the four :data:`TASKS` keys)."""
    from unicon.data.mixture import read_mixture

    rows: dict[str, list[dict]] = {t: [] for t in TASKS}
    for row in read_mixture(Path(world_root) / f"mixture_{split}.jsonl", tasks=TASKS):
        rows[row["task"]].append(row)
    return rows


def _drawing_miss(prompt: str, image, cfg) -> str | None:
    """Why a generated image misses its prompt, from the image's side (module docstring): None when
    it matches; ``CaptionParseError`` when the prompt is not in the world's grammar."""
    from unicon.worlds.shapes import NotAShapesWorldImage, parse
    from unicon.worlds.shapes_text import caption_mismatch, parse_caption

    parse_caption(prompt, cfg)  # the prompt must be in the grammar
    try:
        cause = caption_mismatch(prompt, parse(image, cfg), cfg)
    except NotAShapesWorldImage:
        return "not_an_image"
    # the prompt names fewer objects than the image has = the image draws more
    return {"fewer_objects": "more_objects", "more_objects": "fewer_objects"}.get(cause, cause)


def _ask_flipped(model, rows: Sequence[dict], answers: Sequence[str], images, scenes, cfg) -> list[tuple[bool, bool]]:
    """Ask each yes/no relation question of ``rows`` whose answer the opposite relation reverses
    again with the opposite relation; per such question (answer kept, both answers right)."""
    from unicon.worlds.shapes_text import answer_question, flip_relation_question

    asked = []  # (index in rows, flipped question, its answer)
    for i, (r, sc) in enumerate(zip(rows, scenes)):
        q = flip_relation_question(r["text"])
        if q is not None and (a := answer_question(q, sc, cfg)) != r["target"]:
            asked.append((i, q, a))
    if not asked:
        return []
    again = model.answer([images[i] for i, _, _ in asked], [q for _, q, _ in asked])

    def same(x, y) -> bool:
        return normalize_answer(x) == normalize_answer(str(y))

    return [(same(p, answers[i]), same(answers[i], rows[i]["target"]) and same(p, a))
            for (i, _, a), p in zip(asked, again)]


@torch.no_grad()
def shapes_task_accuracies(model, world_root: str | Path, split: str = "test", limit: int | None = 200,
                           batch_size: int = 32, tasks: Sequence[str] = TASKS,
                           examples: list | None = None, num_examples: int = 0,
                           image_config=None) -> dict[str, float]:
    """The four ShapesWorld task accuracies (see the module docstring) of ``model``. With
    ``examples`` (a list) and ``num_examples``, the first ``num_examples`` predictions of each task
    are appended to it as dicts (task, input image or prompt, prediction, target, correct).
    ``image_config`` (an ``ImageGenerationConfig``; default the model's own) draws the t2i images."""
    from unicon.worlds.shapes import Scene, load_world
    from unicon.worlds.shapes_text import (MISMATCHES, CaptionParseError, caption_mismatch, count_question_form,
                                           parse_caption)

    root = Path(world_root)
    world = load_world(root)
    rows = read_split(root, split)
    was_training = model.training
    model.eval()
    out: dict[str, float] = {}

    def image(row):
        with Image.open(root / row["image"]) as im:
            return im.convert("RGB")

    def scene(row):
        s = row["scene"]
        return Scene.from_dict(s) if isinstance(s, dict) and hasattr(Scene, "from_dict") else s

    def batches(task):
        items = rows[task][:limit] if limit else rows[task]
        for i in range(0, len(items), batch_size):
            yield items[i: i + batch_size]

    held_out = set(world.held_out)

    def slice_names(task: str, row) -> list[str]:
        """The slices a row of ``task`` counts in (see the module docstring)."""
        sc = scene(row) if isinstance(row.get("scene"), dict) else None
        names = []
        if sc is not None:
            names.append("no_held_out" if held_out.isdisjoint(sc.kinds()) else "held_out")
        if task == "vqa" and row.get("qtype"):
            names.append(row["qtype"])
            if row["qtype"] == "count":
                try:
                    names.append(f"count_{count_question_form(row['text'])}")
                except ValueError as e:
                    raise ValueError(f"{world.mixture_path(split)}: vqa row {row.get('id')!r} has qtype "
                                     f"count: {e}") from None
        if task in ("caption", "t2i") and sc is not None:
            names.append(f"objects_{len(sc.objects)}")
        if task == "t2i":
            try:
                spec = parse_caption(row["text"], world.config)
                names.append("relation" if any(c.relation for c in spec.clauses) else "no_relation")
            except CaptionParseError:
                pass
        return names

    hits: dict[str, list[float]] = {t: [] for t in tasks}
    errors: dict[str, list[str]] = {"caption": [], "t2i": []}  # the cause of each miss
    flips: list[tuple[bool, bool]] = []  # per flippable relation question: (answer kept, both right)
    slices: dict[str, list[tuple[str, float]]] = {t: [] for t in tasks}  # (slice name, hit)
    ious: list[float] = []
    for task in tasks:
        for chunk in track(batches(task), f"shapes: {task}", -(-len(rows[task][:limit or None]) // batch_size), unit="batches"):
            start = len(hits[task])
            if task == "vqa":
                images = [image(r) for r in chunk]
                preds = model.answer(images, [r["text"] for r in chunk])
                hits[task] += [float(normalize_answer(p) == normalize_answer(str(r["target"])))
                               for p, r in zip(preds, chunk)]
                flips += _ask_flipped(model, chunk, preds, images, [scene(r) for r in chunk], world.config)
            elif task == "caption":
                preds = model.caption([image(r) for r in chunk])
                causes = [caption_mismatch(p, scene(r), world.config) for p, r in zip(preds, chunk)]
                hits[task] += [float(c is None) for c in causes]
                errors[task] += [c for c in causes if c is not None]
            elif task == "grounding":
                preds = model.locate([image(r) for r in chunk], [r["text"] for r in chunk]).tolist()
                for box, r in zip(preds, chunk):
                    iou = box_iou(box, r["target"])
                    ious.append(iou)
                    hits[task].append(float(iou >= 0.5))
            elif task == "t2i":
                preds = model.generate_image([r["text"] for r in chunk], config=image_config)
                for im, r in zip(preds, chunk):
                    try:
                        cause = _drawing_miss(r["text"], im, world.config)
                    except CaptionParseError as e:
                        raise ValueError(f"{world.mixture_path(split)}: the prompt of t2i row {r.get('id')!r} "
                                         f"is not in the world's caption grammar: {e}") from None
                    hits[task].append(float(cause is None))
                    if cause is not None:
                        errors[task].append(cause)
            else:
                raise ValueError(f"unknown task {task!r}; choose from {TASKS}")
            for r, ok in zip(chunk, hits[task][start:]):
                slices[task] += [(n, ok) for n in slice_names(task, r)]
            if examples is not None:
                for r, p, ok in zip(chunk, preds, hits[task][start:]):
                    if sum(e["task"] == task for e in examples) < num_examples:
                        examples.append({"task": task, "id": r.get("id"), "text": r.get("text"),
                                         "image": None if task == "t2i" else image(r), "prediction": p,
                                         "target": r.get("target"), "correct": bool(ok)})
    names = {"vqa": "vqa_accuracy", "caption": "caption_match", "grounding": "loc_iou50", "t2i": "t2i_match"}
    for task in tasks:
        if hits[task]:
            out[names[task]] = sum(hits[task]) / len(hits[task])
            out[f"{names[task]}_n"] = float(len(hits[task]))
        for name in sorted({n for n, _ in slices[task]}):
            part = [ok for n, ok in slices[task] if n == name]
            out[f"{names[task]}/{name}"] = sum(part) / len(part)
            out[f"{names[task]}/{name}_n"] = float(len(part))
    cause_names = {"caption": MISMATCHES, "t2i": ("not_an_image",) + MISMATCHES[1:]}
    for task in errors:
        if hits.get(task):
            for cause in cause_names[task]:
                out[f"{task}_error/{cause}"] = errors[task].count(cause) / len(hits[task])
    if flips:
        out["vqa_relation_flip/answer_kept"] = sum(k for k, _ in flips) / len(flips)
        out["vqa_relation_flip/both_right"] = sum(b for _, b in flips) / len(flips)
        out["vqa_relation_flip/answer_kept_n"] = float(len(flips))
    if ious:
        out["loc_miou"] = sum(ious) / len(ious)
    model.train(was_training)
    return out
