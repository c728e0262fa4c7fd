"""Judges of RealUnify: the UEG polling judges and the GEU multiple-choice letter extraction
(strict, or lenient as the authors' scorer).

UEG (Understanding Enhances Generation). A generated image is polled with each of the instance's
yes/no questions (Table 7). **An instance counts as correct only when every one of its polling
questions gets the expected answer.** The supplementary text (B.1-B.2) says only that the judge
polls the image; the authors' released evaluation script (``eval/eval_generation.py`` of
github.com/FrankYang-17/RealUnify) scores an instance 1 exactly when all its questions match (0
for a missing image) and reports the per-task mean of that score, so we score per instance the
same way and report the per-question accuracy beside it (:mod:`.metrics`). Two judges:

* :class:`ExactPollJudge` (``exact``, ShapesWorld): the image is parsed into a scene
  (:func:`unicon.worlds.shapes.parse`) and each question answered exactly by
  :func:`unicon.worlds.shapes_realunify.answer_poll` from its ``check``; an image that does not
  parse answers nothing (status ``no_scene``: every question failed);
* :class:`PollingVLMJudge` (``vlm:<dir>``): a local image-text-to-text model asked Table 7, loaded
  as UReason's VLM judge (:class:`unicon.evaluation.ureason.judges.VLMJudge`: local directories
  only, ``trust_remote_code`` off unless asked). Its reply is parsed strictly
  (:func:`parse_yes_no`): after stripping whitespace, surrounding quotes and one final ``.``/``!``,
  the reply must be ``yes`` or ``no`` (any case); anything else is ``unparseable``, a failure kept in
  the denominator and counted. (The authors' script instead looks for the substrings "yes"/"no",
  so "I do not know" is scored "no"; we never guess from substrings.)

GEU (Generation Enhances Understanding). The model's reply to Table 8 is read by
:func:`parse_choice`, which accepts exactly this grammar (``S``: any whitespace, letters of either
case)::

    reply  := S [lead S] choice S
    lead   := ["the" S] ["best" S | "correct" S] ("answer" | "option") S "is" S [":"]
            | ("answer" | "option") S ":"
    choice := "(" L ")" ["."] | L [")"] ["."]
    L      := "A" | "B" | "C" | "D"

e.g. ``A``, `` b. ``, ``(C)``, ``D)``, ``The best answer is: A``, ``Answer: (B).``. Anything else --
``A. a red circle``, ``A or B``, an empty reply -- is unparseable: a failure kept in the denominator
and counted. That is ``letter_parse="strict"``, the default.

``letter_parse="lenient"`` (:func:`parse_choice_lenient`) reads a reply as the authors' scorer does
(``extract_characters_regex`` of ``eval/eval_understanding.py`` in github.com/FrankYang-17/RealUnify,
which produced the paper's GEU numbers; lmms-eval's RealUnify tasks read replies the same way): the
phrases "The best answer is", "The correct answer is", "The answer is", "The answer", "The best option
is", "The correct option is", "Best answer:", "Best option:", "Answer" and "Answer is" are deleted
wherever they occur (case-sensitive, in that order), then the first capital A, B, C or D **anywhere**
in what is left is the choice; none is unparseable. So ``A. a red circle`` is read as ``A`` (strict:
unparseable), but so is "Because ..." as ``B`` and "I think it is a Circle" as ``C``, and a lower-case
``b`` is not read at all. Lenient reproduces the paper's scoring; strict never guesses a letter from
prose. ``realunify.json`` records which one ran (``letter_parse``), and ``samples.jsonl`` keeps every
reply, so either reading can be recomputed from a run.
"""

from __future__ import annotations

import abc
import re
from dataclasses import dataclass
from typing import Sequence

from PIL import Image

from unicon.errors import UserError
from unicon.evaluation.realunify.data import GEUInstance, Instance, UEGInstance
from unicon.evaluation.realunify.prompts import polling_prompt
from unicon.evaluation.ureason.judges import VLMJudge, WorldJudge, check_judge_spec
from unicon.worlds.shapes import NotAShapesWorldImage, Scene, WorldConfig, parse
from unicon.worlds.shapes_realunify import answer_poll

#: per-question statuses; a question is right when its status equals its expected answer
POLL_STATUSES = ("yes", "no", "unparseable", "no_input", "no_scene")

_CHOICE = re.compile(
    r"^\s*(?:(?:the\s+)?(?:best\s+|correct\s+)?(?:answer|option)\s+is\s*:?\s*|(?:answer|option)\s*:\s*)?"
    r"(?:\(([a-d])\)|([a-d])\)?)\s*\.?\s*$",
    re.IGNORECASE,
)


def parse_choice(reply: str | None) -> str | None:
    """The letter ``A``-``D`` a reply chooses under the module docstring's grammar, else None."""
    m = _CHOICE.match(reply or "")
    if m is None:
        return None
    return (m.group(1) or m.group(2)).upper()


#: the answer phrases the authors' scorer deletes before it looks for a letter, in its order
LENIENT_PHRASES = ("The best answer is", "The correct answer is", "The answer is", "The answer",
                   "The best option is", "The correct option is", "Best answer:", "Best option:", "Answer",
                   "Answer is")
_CAPITAL_CHOICE = re.compile(r"[ABCD]")


def parse_choice_lenient(reply: str | None) -> str | None:
    """The first capital ``A``-``D`` of the reply once :data:`LENIENT_PHRASES` are deleted (the
    authors' reading, module docstring), else None."""
    text = (reply or "").strip()
    for phrase in LENIENT_PHRASES:
        text = text.replace(phrase, "")
    m = _CAPITAL_CHOICE.search(text)
    return m.group(0) if m else None


#: ``letter_parse`` -> the reader of a Table 8 reply
LETTER_PARSERS = {"strict": parse_choice, "lenient": parse_choice_lenient}


def parse_yes_no(reply: str | None) -> str:
    """``"yes"``, ``"no"`` or ``"unparseable"`` (module docstring)."""
    text = (reply or "").strip().strip("\"'`").strip()
    if text[-1:] in (".", "!"):
        text = text[:-1].strip()
    text = text.lower()
    return text if text in ("yes", "no") else "unparseable"


@dataclass
class PollVerdict:
    """A judge's answers to one instance's polling questions: a status per question
    (:data:`POLL_STATUSES`) and the reply it came from (a judge model's text, or a note)."""

    statuses: list[str]
    replies: list[str]

    def correct(self, questions: Sequence[dict]) -> list[bool]:
        """Per question: does the judge's answer equal the expected one?"""
        return [s == q["answer"] for s, q in zip(self.statuses, questions)]


class PollingJudge(abc.ABC):
    """Answers a UEG instance's polling questions about a generated image."""

    name: str = "judge"

    @abc.abstractmethod
    def judge(self, instances: Sequence[UEGInstance], images: Sequence[Image.Image | None]) -> list[PollVerdict]:
        """One verdict per (instance, image); a ``None`` image gets ``no_input`` for every question."""

    @staticmethod
    def _none(inst: UEGInstance, status: str, note: str) -> PollVerdict:
        return PollVerdict([status] * len(inst.questions), [note] * len(inst.questions))


class ExactPollJudge(WorldJudge, PollingJudge):
    """The ShapesWorld judge (module docstring)."""

    def judge(self, instances, images):
        if len(instances) != len(images):
            raise ValueError(f"{len(instances)} instances but {len(images)} images")
        out = []
        for inst, im in zip(instances, images):
            if im is None:
                out.append(self._none(inst, "no_input", "no image was generated"))
                continue
            try:
                scene = parse(im, self.cfg)
            except NotAShapesWorldImage as e:
                out.append(self._none(inst, "no_scene", f"not a ShapesWorld image: {e}"))
                continue
            statuses = []
            for q in inst.questions:
                try:
                    statuses.append(answer_poll(q, scene, self.cfg))
                except ValueError as e:
                    raise UserError(f"{inst.source}: judge 'exact' cannot answer {q['question']!r}: {e}") from None
            out.append(PollVerdict(statuses, ["answer_poll"] * len(statuses)))
        return out


class PollingVLMJudge(VLMJudge):
    """Table 7 asked of a local image-text-to-text model, one question per generation row; the
    loading, batching and greedy decoding are UReason's :class:`VLMJudge`'s."""

    name = "vlm"

    def build_text(self, question: str) -> str:  # type: ignore[override]
        return self.chat(polling_prompt(question))

    def judge(self, instances: Sequence[UEGInstance], images: Sequence[Image.Image | None]) -> list[PollVerdict]:
        """Every (instance, question) pair with an image, ``batch_size`` pairs per generation."""
        if len(instances) != len(images):
            raise ValueError(f"{len(instances)} instances but {len(images)} images")
        out = [PollingJudge._none(inst, "no_input", "no image was generated") if im is None
               else PollVerdict([""] * len(inst.questions), [""] * len(inst.questions))
               for inst, im in zip(instances, images)]
        pairs = [(i, k) for i, im in enumerate(images) if im is not None for k in range(len(instances[i].questions))]
        replies = self.replies([self.build_text(instances[i].questions[k]["question"]) for i, k in pairs],
                               [[images[i]] for i, _ in pairs])
        for (i, k), reply in zip(pairs, replies):
            out[i].statuses[k], out[i].replies[k] = parse_yes_no(reply), reply
        return out

    def judge_images(self, instances, images):
        raise NotImplementedError("the RealUnify VLM judge polls questions: use judge()")


def check_judge_fits(spec: str, instances: Sequence[Instance]) -> None:
    """Judge ``exact`` needs every UEG polling question machine-checkable (``check``); say so before
    any image is generated."""
    if spec != "exact":
        return
    for inst in instances:
        if isinstance(inst, UEGInstance) and any("check" not in q for q in inst.questions):
            raise UserError(f"{inst.source}: judge 'exact' needs ShapesWorld polling questions with a 'check'; "
                            "judge real UEG prompts with --judge vlm:<model path>")


def build_judge(spec: str, world_root: str | None = None, **kw) -> PollingJudge | PollingVLMJudge:
    """``exact`` (ShapesWorld, configured by ``world_root``'s ``world.json``) or ``vlm:<local dir>``
    (``kw``: the settings of :meth:`~unicon.evaluation.ureason.judges.VLMJudge.from_pretrained`)."""
    check_judge_spec(spec)
    if spec == "exact":
        return ExactPollJudge.from_world(world_root)
    return PollingVLMJudge.from_pretrained(spec[len("vlm:"):], **kw)


def edit_matches(image: Image.Image | None, target_scene: dict, cfg: WorldConfig) -> bool:
    """Stepwise edit accuracy of one GEU row: the edited image parses into exactly ``target_scene``
    (an image that does not parse, or no image, is a miss)."""
    if image is None:
        return False
    try:
        return parse(image, cfg) == Scene.from_dict(target_scene)
    except NotAShapesWorldImage:
        return False


def geu_prediction(inst: GEUInstance, reply: str | None, letter_parse: str = "strict") -> tuple[str | None, bool]:
    """``(letter or None, correct)`` of a reply to the instance's Table 8 question, read by
    ``letter_parse`` (``strict``: :func:`parse_choice`; ``lenient``: :func:`parse_choice_lenient`)."""
    if letter_parse not in LETTER_PARSERS:
        raise UserError(f"letter_parse must be one of {', '.join(LETTER_PARSERS)}, got {letter_parse!r}")
    letter = LETTER_PARSERS[letter_parse](reply)
    return letter, letter == inst.answer
