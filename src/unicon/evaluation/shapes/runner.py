"""Task accuracies of a :class:`UnifiedModel` on a ShapesWorld split (the pretraining targets).

The first ``limit`` rows of each task of ``mixture_<split>.jsonl`` (``edit``: of ``edit_<split>.jsonl``,
and only when asked for, of a model that edits images) go through the model's *generation* methods
(``answer``, ``caption``, ``locate``, ``generate_image``, ``edit_image``) into the metrics of
:mod:`unicon.evaluation.shapes.metrics`, which say what each number is.

Each accuracy is also reported by slice, as ``<metric>/<slice>`` with its count in
``<metric>/<slice>_n`` (:func:`slice_names`): VQA by question type (``vqa_accuracy/relation``: the
row's ``qtype``), and count questions also by what they count (``vqa_accuracy/count_all``,
``count_colour``, ``count_shape``, ``count_kind``: "how many objects / red objects / circles / red
circles"; ``unicon.worlds.shapes_text.count_question_form``); caption and T2I by the number of
objects in the scene (``caption_match/objects_3``); T2I by whether the prompt has a relation clause
(``t2i_match/relation``, ``t2i_match/no_relation``); every task by whether its scene holds one of the
world's held-out colour-shape compositions (``world.json`` ``held_out``: never in a training scene,
caption, question or prompt), as ``<metric>/held_out`` and ``<metric>/no_held_out``. They say which
skill a missed target lacks (counting, relations, compositional generalisation) without another
script.

Every yes/no relation question among the evaluated VQA rows whose answer the opposite relation
reverses (the pairs on one line, where both answers are "no", are left out) is asked again with the
opposite relation (:func:`_ask_flipped`, :class:`~unicon.evaluation.shapes.metrics.RelationFlip`).

Each rank evaluates its share of every task's rows and counts the rows it owns
(:mod:`unicon.evaluation.distributed`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch
from PIL import Image

from unicon.data.mixture import read_edits, read_mixture
from unicon.errors import UserError
from unicon.evaluation import preemption
from unicon.evaluation.distributed import gather_records, metric_sync_kwargs, owned_indices, shard_indices
from unicon.evaluation.framework import eval_mode
from unicon.evaluation.shapes.metrics import DEFAULT_TASKS, METRICS, TASKS, EditPreference, RelationFlip, report
from unicon.worlds.shapes import Scene, load_world
from unicon.worlds.shapes_text import (
    CaptionParseError,
    answer_question,
    count_question_form,
    flip_relation_question,
    parse_caption,
)


def read_split(world_root: str | Path, split: str, tasks: Sequence[str] = DEFAULT_TASKS) -> dict[str, list[dict]]:
    """Rows of ``mixture_<split>.jsonl`` grouped by task (a key for every task of :data:`TASKS`); with
    ``edit`` in ``tasks``, the rows of ``edit_<split>.jsonl`` under ``edit``."""
    rows: dict[str, list[dict]] = {t: [] for t in TASKS}
    for row in read_mixture(Path(world_root) / f"mixture_{split}.jsonl", tasks=[t for t in TASKS if t != "edit"]):
        rows[row["task"]].append(row)
    if "edit" in tasks:
        rows["edit"] = read_edits(Path(world_root) / f"edit_{split}.jsonl")
    return rows


def check_world(world: str | Path, split: str, what: str = "--world") -> None:
    """A :class:`UserError` unless ``world`` is a ShapesWorld root with a ``split`` mixture (``what``:
    the setting that named it)."""
    world = Path(world)
    if not (world / "world.json").is_file():
        raise UserError(f"{what} {world}: not a ShapesWorld root (no world.json); build one with "
                        f"`unicon build-data shapes --out {world}`")
    if not (world / f"mixture_{split}.jsonl").is_file():
        raise UserError(f"{world / f'mixture_{split}.jsonl'} not found: the world has no {split} split")


def row_scene(row: dict):
    """The row's scene as a ``Scene`` (rows store it as a dict)."""
    s = row["scene"]
    return Scene.from_dict(s) if isinstance(s, dict) and hasattr(Scene, "from_dict") else s


def slice_names(task: str, row: dict, world, where: str) -> list[str]:
    """The slices a row of ``task`` counts in (see the module docstring). A count question the
    grammar does not know, or a T2I prompt outside the caption grammar, is a ``ValueError`` naming
    ``where`` (the mixture file) and the row."""
    if task == "edit":
        return [row["kind"]]
    sc = row_scene(row) if isinstance(row.get("scene"), dict) else None
    names = []
    if sc is not None:
        names.append("no_held_out" if set(world.held_out).isdisjoint(sc.kinds()) else "held_out")
    if task == "vqa" and row.get("qtype"):
        names.append(row["qtype"])
        if row["qtype"] == "count":
            try:
                names.append(f"count_{count_question_form(row['text'])}")
            except ValueError as e:
                raise ValueError(f"{where}: vqa row {row.get('id')!r} has qtype count: {e}") from None
    if task in ("caption", "t2i") and sc is not None:
        names.append(f"objects_{len(sc.objects)}")
    if task == "t2i":
        try:
            spec = parse_caption(row["text"], world.config)
        except CaptionParseError as e:
            raise ValueError(f"{where}: the prompt of t2i row {row.get('id')!r} "
                             f"is not in the world's caption grammar: {e}") from None
        names.append("relation" if any(c.relation for c in spec.clauses) else "no_relation")
    return names


def _ask_flipped(model, rows: Sequence[dict], images, cfg) -> list[tuple[int, str, str]]:
    """Ask each yes/no relation question of ``rows`` whose answer the opposite relation reverses
    again with the opposite relation; per such question (its position in ``rows``, the model's
    answer to the flipped question, the flipped question's gold answer)."""
    asked = []  # (index in rows, flipped question, its answer)
    for i, r in enumerate(rows):
        q = flip_relation_question(r["text"])
        if q is not None and (a := answer_question(q, row_scene(r), cfg)) != r["target"]:
            asked.append((i, q, a))
    if not asked:
        return []
    again = model.answer([images[i] for i, _, _ in asked], [q for _, q, _ in asked])
    return [(i, p, a) for (i, _, a), p in zip(asked, again)]


def _edit_likelihoods(model, rows: Sequence[dict], images: Sequence, target_images: Sequence,
                      other_images: Sequence | None) -> tuple[list[float], list[float], list[float | None]]:
    """Summed NLLs (``score_edit``) of each row's target, of its source (the unchanged image) and of
    ``other_images`` (another edit's target; None: no other edit) given the row's source and instruction."""
    texts = [r["text"] for r in rows]

    def nll(outputs):
        return model.score_edit(images, texts, outputs).sum_nll[:, 0].tolist()

    return nll(target_images), nll(images), nll(other_images) if other_images else [None] * len(rows)


def _predict(model, task: str, rows: Sequence[dict], images: Sequence, image_config) -> tuple[list, list]:
    """The model's outputs for ``rows`` of ``task`` (``images``: theirs, none for t2i) and what the
    task's metric checks each against: the gold answer, the scene, the gold box, (t2i, whose
    output is an image) the prompt, or (edit) the source and target scenes."""
    if task == "vqa":
        return model.answer(images, [r["text"] for r in rows]), [r["target"] for r in rows]
    if task == "caption":
        return model.caption(images), [row_scene(r) for r in rows]
    if task == "grounding":
        return model.locate(images, [r["text"] for r in rows]).tolist(), [r["target"] for r in rows]
    if task == "edit":
        return (model.edit_image(images, [r["text"] for r in rows], config=image_config),
                [(Scene.from_dict(r["source_scene"]), Scene.from_dict(r["target_scene"])) for r in rows])
    return model.generate_image([r["text"] for r in rows], config=image_config), [r["text"] for r in rows]


def shapes_task_accuracies(model, world_root: str | Path, split: str = "test", limit: int | None = 200,
                           batch_size: int = 32, tasks: Sequence[str] = DEFAULT_TASKS,
                           examples: list | None = None, num_examples: int = 0,
                           image_config=None, device: torch.device | str = "cpu") -> dict[str, float]:
    """The ShapesWorld task accuracies of ``tasks`` (default: VQA, caption, grounding, T2I; see the
    module docstring) of ``model``. With
    ``examples`` (a list) and ``num_examples``, the predictions of the first ``num_examples`` rows of
    each task are appended to it as dicts (task, input image or prompt, prediction, target, correct),
    on every rank: gathered from the ranks (or the shards of a ``--shard`` run) that made them. ``image_config`` (an ``ImageGenerationConfig``; default the
    model's own) draws the t2i images. ``device`` holds the metric states (the process group's
    device: CUDA under NCCL)."""
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise ValueError(f"unknown task {unknown[0]!r}; choose from {TASKS}")
    if "edit" in tasks and not getattr(model, "supports_editing", False):
        backend = getattr(model, "backend", type(model).__name__)
        raise UserError(f"shapes: task edit needs a model that edits images; the {backend} backend "
                        "does not (UnifiedModel.supports_editing)")
    root = Path(world_root)
    world = load_world(root)
    rows = read_split(root, split, tasks)
    where = str(world.mixture_path(split))

    def image(row, key="image"):
        with Image.open(root / row[key]) as im:
            return im.convert("RGB")

    metrics = []
    with eval_mode(model):
        for task in tasks:
            items = rows[task][:limit] if limit else rows[task]
            if not items:
                continue
            # every rank names the slices of every row: the metric states have the same shape on all ranks,
            # and a row outside the grammar fails before the model runs
            slices = [slice_names(task, r, world, where) for r in items]
            metric = METRICS[task]({name for names in slices for name in names}, world.config,
                                   **metric_sync_kwargs()).to(device)
            metrics.append(metric)
            flips = RelationFlip(**metric_sync_kwargs()).to(device) if task == "vqa" else None
            prefs = EditPreference(**metric_sync_kwargs()).to(device) if task == "edit" else None
            mine, owned = shard_indices(len(items)), set(owned_indices(len(items)))
            shown: dict[int, dict] = {}  # this rank's rows among the first num_examples: the picture's
            for batch in preemption.batches(mine, batch_size, f"shapes: {task}"):
                chunk = [items[i] for i in batch]
                images = [image(r) for r in chunk] if task != "t2i" else []
                preds, targets = _predict(model, task, chunk, images, image_config)
                # positions in the batch of the rows this rank counts (a padding repeat counts on its owner)
                counted = [j for j, i in enumerate(batch) if i in owned]
                metric.update([preds[j] for j in counted], [targets[j] for j in counted],
                              [slices[batch[j]] for j in counted])
                if flips is not None:
                    asked = _ask_flipped(model, chunk, images, world.config)
                    again = [(j, p, a) for j, p, a in asked if j in counted]
                    flips.update([preds[j] for j, _, _ in again], [chunk[j]["target"] for j, _, _ in again],
                                 [p for _, p, _ in again], [a for _, _, a in again])
                if prefs is not None:
                    # the other target of row i: row i + 1's (of the whole list, so the same under any sharding)
                    others = [image(items[(i + 1) % len(items)], "target_image") for i in batch] \
                        if len(items) > 1 else None
                    liked = _edit_likelihoods(model, chunk, images, [image(r, "target_image") for r in chunk], others)
                    prefs.update(*([values[j] for j in counted] for values in liked))
                for j, i in enumerate(batch):
                    if examples is not None and i < num_examples and i in owned:
                        r = chunk[j]
                        shown[i] = {"task": task, "id": r.get("id"), "text": r.get("text"),
                                    "image": None if task == "t2i" else images[j], "prediction": preds[j],
                                    "target": r.get("target"), "correct": metric.miss(preds[j], targets[j]) is None}
            if examples is not None:  # the task's first rows, from whichever rank (or shard) ran them
                examples += gather_records(shown).values()
            metrics += [m for m in (flips, prefs) if m is not None]
    return report(m.compute() for m in metrics)
