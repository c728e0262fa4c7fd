"""The ShapesWorld task accuracies as torchmetrics metrics: one way to compute each number of
``unicon evaluate shapes`` and of its epoch-end run (:mod:`.suite`).

No model calls and no file I/O here (those are :mod:`.runner`'s). Every state is a **sum** (examples,
correct examples, examples per slice and per cause of a miss, IoUs) that torchmetrics reduces with
``"sum"``, so under DDP, with every example given to ``update`` on exactly one rank, ``compute()``
returns the numbers of the whole evaluation set on every rank.

A task metric is updated with the model's outputs, their targets and, per example, the names of
the slices it counts in (:func:`unicon.evaluation.shapes.runner.slice_names`). With ``N`` the
examples, ``N_s`` those of slice ``s`` and ``c_i`` = 1 when example ``i`` is right, each reports
(the task's ``<key>`` below)::

    <key>     = (1/N)   sum_i c_i              <key>_n     = N
    <key>/s   = (1/N_s) sum_{i in s} c_i       <key>/s_n   = N_s

and the generation tasks, whose misses have causes ``m_i`` (None when right), also::

    <task>_error/k = (1/N) sum_i 1[m_i = k]   for every cause k, so <key> + sum_k <task>_error/k = 1

:class:`VQAAccuracy` (``vqa_accuracy``), :class:`CaptionMatch` (``caption_match``),
:class:`LocalizationAccuracy` (``loc_iou50``, and ``loc_miou``), :class:`T2IMatch` (``t2i_match``),
:class:`EditMatch` (``edit_match``, by edit kind) and :class:`RelationFlip` (``vqa_relation_flip/*``) say what
``c_i`` is; :class:`EditPreference` (``edit_pref/*``) compares the edit likelihoods of the target and
two wrong images. A metric that saw no
example reports nothing. :func:`report` joins what they compute into the dict ``shapes_eval.json``
holds; :func:`logged_scalars` names its entries for the loggers (``shapes/<task>/<key>``).
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

import torch
from torchmetrics import Metric

from unicon.config import SHAPES_DEFAULT_TASKS, SHAPES_EVAL_TASKS
from unicon.evaluation.cococon.metrics import box_iou, normalize_answer
from unicon.worlds.shapes import NotAShapesWorldImage, parse
from unicon.worlds.shapes_text import MISMATCHES, caption_mismatch, parse_caption

TASKS = SHAPES_EVAL_TASKS
#: the tasks evaluated unless asked otherwise (edit only for models that edit: ``--tasks ... edit``)
DEFAULT_TASKS = SHAPES_DEFAULT_TASKS
#: localization counts a box as right from this IoU on
IOU_THRESHOLD = 0.5
#: a miss of a task whose misses have no causes told apart
WRONG = "wrong"


def answer_matches(prediction: str, target: Any) -> bool:
    """``normalize(prediction) == normalize(target)`` with CocoCon's VQA normalisation
    (:func:`unicon.evaluation.cococon.metrics.normalize_answer`)."""
    return normalize_answer(prediction) == normalize_answer(str(target))


def drawing_miss(prompt: str, image, cfg=None) -> str | None:
    """Why a generated image misses its prompt, from the image's side: None when the scene parsed
    from the image satisfies the prompt; ``not_an_image`` when the parser refuses the image; else
    the cause of :func:`unicon.worlds.shapes_text.caption_mismatch` of the prompt against the drawn
    scene, with ``fewer_objects`` and ``more_objects`` swapped (a prompt that names fewer objects than
    the image has = an image that draws more). ``CaptionParseError`` when the prompt is not in the
    world's grammar."""
    parse_caption(prompt, cfg)  # the prompt must be in the grammar
    try:
        cause = caption_mismatch(prompt, parse(image, cfg), cfg)
    except NotAShapesWorldImage:
        return "not_an_image"
    return {"fewer_objects": "more_objects", "more_objects": "fewer_objects"}.get(cause, cause)


class TaskAccuracy(Metric):
    """The accuracy of one task, overall and by slice, and the shares of its misses by cause (module
    docstring). Subclasses name the task and say, in :meth:`miss`, whether one example is right.

    ``slices`` fixes the state shape (one count per slice), so every rank must pass the same names
    (e.g. those of every evaluated example). ``config``: the world's ``WorldConfig``, for the
    metrics that check outputs with the world's parser.
    """

    full_state_update = False
    task: str = ""
    key: str = ""
    #: the causes of a miss reported as ``<task>_error/<cause>`` (none: misses are not told apart)
    causes: tuple[str, ...] = ()

    def __init__(self, slices: Iterable[str] = (), config=None, **kwargs: Any):
        super().__init__(**kwargs)
        self.slices = tuple(sorted(set(slices)))
        self.config = config
        self._slice_row = {name: i for i, name in enumerate(self.slices)}
        for name, size in (("total", ()), ("correct", ()), ("slice_total", len(self.slices)),
                           ("slice_correct", len(self.slices)), ("misses", len(self.causes))):
            self.add_state(name, default=torch.zeros(size, dtype=torch.long), dist_reduce_fx="sum")

    def miss(self, prediction: Any, target: Any) -> str | None:
        """None when ``prediction`` is right for ``target``, else why it misses (one of :attr:`causes`,
        or :data:`WRONG` for a task without causes)."""
        raise NotImplementedError

    def update(self, predictions: Sequence[Any], targets: Sequence[Any], slices: Sequence[Sequence[str]]) -> None:
        """Count each example: its output, its target and the slices it counts in."""
        if not len(predictions) == len(targets) == len(slices):
            raise ValueError(f"{len(predictions)} predictions, {len(targets)} targets, "
                             f"{len(slices)} slice lists")
        misses = [self.miss(p, t) for p, t in zip(predictions, targets)]
        slice_total = torch.zeros(len(self.slices), dtype=torch.long)
        slice_correct = torch.zeros(len(self.slices), dtype=torch.long)
        for miss, names in zip(misses, slices):
            for name in names:
                if name not in self._slice_row:
                    raise ValueError(f"an example in slice {name!r}; the metric knows {self.slices}")
                slice_total[self._slice_row[name]] += 1
                slice_correct[self._slice_row[name]] += int(miss is None)
        self.total = self.total + len(misses)
        self.correct = self.correct + sum(miss is None for miss in misses)
        self.slice_total = self.slice_total + slice_total.to(self.device)
        self.slice_correct = self.slice_correct + slice_correct.to(self.device)
        counts = torch.tensor([sum(miss == cause for miss in misses) for cause in self.causes], dtype=torch.long)
        self.misses = self.misses + counts.to(self.device)

    def compute(self) -> dict[str, float]:
        n = int(self.total)
        if not n:
            return {}
        out = {self.key: int(self.correct) / n, f"{self.key}_n": float(n)}
        for name, right, count in zip(self.slices, self.slice_correct.tolist(), self.slice_total.tolist()):
            if count:
                out[f"{self.key}/{name}"] = right / count
                out[f"{self.key}/{name}_n"] = float(count)
        for cause, count in zip(self.causes, self.misses.tolist()):
            out[f"{self.task}_error/{cause}"] = count / n
        return out


class VQAAccuracy(TaskAccuracy):
    """``vqa_accuracy = (1/N) sum_i 1[normalize(answer_i) = normalize(gold_i)]`` (:func:`answer_matches`).

    The gold answers are single vocabulary words (a colour, a shape, a number word, yes/no, a
    relation), so the normalisation only forgives the spelling around a correct word ("The circle."
    for ``circle``, "2" for ``two``); it never makes two different gold words equal.
    ``update(answers, gold answers, slices)``."""

    task, key = "vqa", "vqa_accuracy"

    def miss(self, prediction: str, target: Any) -> str | None:
        return None if answer_matches(prediction, target) else WRONG


class CaptionMatch(TaskAccuracy):
    """``caption_match = (1/N) sum_i 1[m_i = None]`` with ``m_i = caption_mismatch(caption_i, scene_i)``
    (:func:`unicon.worlds.shapes_text.caption_mismatch`): the generated caption describes the image's
    scene exactly. ``caption_error/k = (1/N) sum_i 1[m_i = k]`` for ``k`` in ``unparsable``,
    ``fewer_objects``, ``more_objects`` (the caption names fewer or more objects than the scene has),
    ``attributes`` (as many, some colour or shape wrong), ``relation`` (a relation clause does not
    hold). ``update(captions, scenes, slices)``."""

    task, key = "caption", "caption_match"
    causes = MISMATCHES

    def miss(self, prediction: str, target) -> str | None:
        return caption_mismatch(prediction, target, self.config)


class LocalizationAccuracy(TaskAccuracy):
    """``loc_iou50 = (1/N) sum_i 1[IoU(box_i, gold_i) >= 0.5]`` and
    ``loc_miou = (1/N) sum_i IoU(box_i, gold_i)``, with ``IoU = |A ∩ B| / |A ∪ B|`` of ``[x, y, w, h]`` boxes (CocoCon's
    :func:`~unicon.evaluation.cococon.metrics.box_iou`). ``update(boxes, gold boxes, slices)``.

    The IoUs are summed one at a time in float64, so one process gives the left-to-right sum; a
    sum over ranks adds the ranks' partial sums (equal up to float64 rounding)."""

    task, key = "grounding", "loc_iou50"

    def __init__(self, slices: Iterable[str] = (), config=None, **kwargs: Any):
        super().__init__(slices, config, **kwargs)
        self.add_state("iou_sum", default=torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")

    def miss(self, prediction: Sequence[float], target: Sequence[float]) -> str | None:
        return None if box_iou(prediction, target) >= IOU_THRESHOLD else WRONG

    def update(self, predictions: Sequence[Sequence[float]], targets: Sequence[Sequence[float]],
               slices: Sequence[Sequence[str]]) -> None:
        super().update(predictions, targets, slices)
        for box, gold in zip(predictions, targets):
            self.iou_sum = self.iou_sum + box_iou(box, gold)

    def compute(self) -> dict[str, float]:
        out = super().compute()
        if out:
            out["loc_miou"] = float(self.iou_sum) / int(self.total)
        return out


class T2IMatch(TaskAccuracy):
    """``t2i_match = (1/N) sum_i 1[d_i = None]`` with ``d_i = drawing_miss(prompt_i, image_i)``
    (:func:`drawing_miss`): the scene parsed from the generated image satisfies the prompt; an image
    the parser refuses counts as a miss. ``t2i_error/k = (1/N) sum_i 1[d_i = k]`` for ``k`` in
    ``not_an_image``, ``fewer_objects``, ``more_objects`` (the image draws fewer or more objects than
    the prompt names), ``attributes``, ``relation``. ``update(images, prompts, slices)``."""

    task, key = "t2i", "t2i_match"
    causes = ("not_an_image",) + MISMATCHES[1:]

    def miss(self, prediction, target: str) -> str | None:
        return drawing_miss(target, prediction, self.config)


class EditMatch(TaskAccuracy):
    """``edit_match = (1/N) sum_i 1[parse(edited_i) = target_i]``: the scene parsed from the edited
    image is exactly the edit's target scene (:mod:`unicon.worlds.shapes_edit`; every kind's target
    is determined by the source and the instruction). ``edit_error/k = (1/N) sum_i 1[e_i = k]`` for
    ``k`` in ``not_an_image`` (the parser refuses the image), ``unchanged`` (the image is the source
    scene: the instruction was ignored) and ``wrong_scene`` (any other scene).
    ``update(edited images, (source scene, target scene) pairs, slices)``; the slices are the kinds."""

    task, key = "edit", "edit_match"
    causes = ("not_an_image", "unchanged", "wrong_scene")

    def miss(self, prediction, target) -> str | None:
        source, wanted = target
        try:
            drawn = parse(prediction, self.config)
        except NotAShapesWorldImage:
            return "not_an_image"
        if drawn == wanted:
            return None
        return "unchanged" if drawn == source else "wrong_scene"


class RelationFlip(Metric):
    """Relation questions asked again with the opposite relation
    (:func:`unicon.worlds.shapes_text.flip_relation_question`). Over the ``M`` yes/no relation questions ``q_j`` whose answer the flip reverses, with the model's
    answers ``a_j`` to ``q_j`` and ``a'_j`` to ``flip(q_j)`` and the gold answers ``g_j`` and ``g'_j``
    (compared by :func:`answer_matches`)::

        vqa_relation_flip/answer_kept   = (1/M) sum_j 1[a_j = a'_j]
        vqa_relation_flip/both_right    = (1/M) sum_j 1[a_j = g_j and a'_j = g'_j]
        vqa_relation_flip/answer_kept_n = M

    ``answer_kept`` is 1 for a model that ignores the relation word, 0 for one that reads it;
    ``both_right`` is 1/4 for coin flips, 0 for a model that ignores the word, 1 for one that
    compares the two objects. ``update(answers, gold answers, flipped answers, flipped gold answers)``.
    """

    full_state_update = False

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        for name in ("total", "kept", "both_right"):
            self.add_state(name, default=torch.zeros((), dtype=torch.long), dist_reduce_fx="sum")

    def update(self, answers: Sequence[str], targets: Sequence[Any], flipped_answers: Sequence[str],
               flipped_targets: Sequence[Any]) -> None:
        if not len(answers) == len(targets) == len(flipped_answers) == len(flipped_targets):
            raise ValueError("answers, targets, flipped answers and flipped targets differ in length")
        kept = [answer_matches(b, a) for a, b in zip(answers, flipped_answers)]
        both = [answer_matches(a, g) and answer_matches(b, h)
                for a, g, b, h in zip(answers, targets, flipped_answers, flipped_targets)]
        self.total = self.total + len(answers)
        self.kept = self.kept + sum(kept)
        self.both_right = self.both_right + sum(both)

    def compute(self) -> dict[str, float]:
        m = int(self.total)
        if not m:
            return {}
        return {"vqa_relation_flip/answer_kept": int(self.kept) / m,
                "vqa_relation_flip/both_right": int(self.both_right) / m,
                "vqa_relation_flip/answer_kept_n": float(m)}


class EditPreference(Metric):
    """Whether the model's edit likelihood (``score_edit``, teacher-forced: no sampling) prefers each
    edit's target over two wrong outputs. With ``L(y)`` the summed NLL of image ``y`` given the
    source and the instruction, over the ``N`` evaluated edits::

        edit_pref/unchanged = (1/N) sum_i 1[L(target_i) < L(source_i)]
        edit_pref/other     = (1/N') sum_i 1[L(target_i) < L(target_j(i))]

    ``unchanged`` asks whether the model moves away from the source as instructed; ``other``
    (``j(i) = i + 1`` modulo the evaluated edits: another source's target; ``N' = N`` when ``N > 1``)
    whether it keeps the source's scene. A model that ignores its inputs scores 1/2 on
    average; an exact editor scores 1. These emerge long before an exact ``edit_match`` (a whole
    scene of 16 cells drawn right) and are what the CI competence test checks of a short run.
    ``update(nll of targets, nll of sources, nll of other targets or None per edit)``."""

    full_state_update = False

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        for name in ("total", "beats_unchanged", "total_other", "beats_other"):
            self.add_state(name, default=torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, target_nll: Sequence[float], source_nll: Sequence[float],
               other_nll: Sequence[float | None]) -> None:
        others = [(t, o) for t, o in zip(target_nll, other_nll) if o is not None]
        self.total = self.total + len(target_nll)
        self.beats_unchanged = self.beats_unchanged + sum(t < s for t, s in zip(target_nll, source_nll))
        self.total_other = self.total_other + len(others)
        self.beats_other = self.beats_other + sum(t < o for t, o in others)

    def compute(self) -> dict[str, float]:
        n, n_other = int(self.total), int(self.total_other)
        out = {}
        if n:
            out.update({"edit_pref/unchanged": int(self.beats_unchanged) / n, "edit_pref/unchanged_n": float(n)})
        if n_other:
            out.update({"edit_pref/other": int(self.beats_other) / n_other, "edit_pref/other_n": float(n_other)})
        return out


#: the metric of each task
METRICS: dict[str, type[TaskAccuracy]] = {"vqa": VQAAccuracy, "caption": CaptionMatch,
                                          "grounding": LocalizationAccuracy, "t2i": T2IMatch, "edit": EditMatch}


def _position(key: str) -> int:
    """The group of ``key`` in the report: accuracies and slices, caption misses, T2I misses, edit
    misses and preferences, relation flips, mean IoU."""
    for i, prefix in enumerate(("caption_error/", "t2i_error/", ("edit_error/", "edit_pref/"), "vqa_relation_flip/",
                                "loc_miou"), start=1):
        if key.startswith(prefix):
            return i
    return 0


def report(computed: Iterable[Mapping[str, float]]) -> dict[str, float]:
    """The ``compute()`` results of the task metrics (in task order) as the one dict of
    ``shapes_eval.json``: every accuracy with its count and slices first, task by task, then the
    caption, T2I and edit miss causes, the relation flips and ``loc_miou``."""
    items = [item for result in computed for item in result.items()]
    return dict(sorted(items, key=lambda item: _position(item[0])))  # stable: each group keeps its order


#: the task of a report key, by the key's start
_TASK_OF = {"vqa_": "vqa", "caption_": "caption", "loc_": "grounding", "t2i_": "t2i", "edit_": "edit"}


def logged_scalars(metrics: Mapping[str, float], prefix: str = "shapes") -> dict[str, float]:
    """A :func:`report` as logger scalars ``<prefix>/<task>/<key>`` (``shapes/vqa/vqa_accuracy``,
    ``shapes/grounding/loc_miou``, ``shapes/t2i/t2i_error/not_an_image``, ...)."""
    out = {}
    for key, value in metrics.items():
        task = next(t for start, t in _TASK_OF.items() if key.startswith(start))
        out[f"{prefix}/{task}/{key}"] = value
    return out
