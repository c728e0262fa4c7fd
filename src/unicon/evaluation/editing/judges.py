"""The baseline of the paper's Table 3: a judge asked to rate each edit, correlated with the human
score as EditingScore is.

The paper compares EditingScore with "GPT-based scoring for image edits" (Table 3: Kendall τ_b / τ_c
against the human score 0.192 / 0.189, EditScore 0.259 / 0.253) and names neither the GPT model nor
its prompt nor its scale. GPT is an API model and cannot be called here (no network, no weights), so
``--judge`` names the judge that stands in for it:

* ``model``: the evaluated :class:`~unicon.models.base.UnifiedModel` itself,
  ``model.answer([edited image], [prompt])``. The interface takes one image per question, so this judge
  sees the **edited image only** and the instruction (:data:`EDITED_ONLY_PROMPT`): it can judge whether
  the instruction was carried out and the image's quality, not what was preserved of the source;
* ``vlm:<local model directory>``: any ``transformers`` image-text-to-text model whose chat template
  takes two images (loaded as UReason's :class:`~unicon.evaluation.ureason.judges.VLMJudge`, local
  directories only), shown the **source, then the edited image** (:data:`PAIR_PROMPT`), as a GPT
  judge of edits is.

Both prompts are ours, written in the form of the paper's BagelScore prompt (§3.1) with Edit-1K's
criteria (§4.2). The reply is read by BagelScore's strict rule on its 0 / 0.3 / 0.6 / 1.0 scale
(:func:`~unicon.evaluation.alignment.prompts.parse_rating`): an unparseable reply is a **failure**,
counted and left out of τ and Pearson's r, never guessed.
"""

from __future__ import annotations

from typing import Sequence

from PIL import Image

from unicon.evaluation.alignment.bagelscore import BagelResult
from unicon.evaluation.alignment.judges import rate_with_vlm
from unicon.evaluation.alignment.prompts import parse_rating
from unicon.evaluation.ureason.judges import VLMJudge, check_vlm_spec

#: the judge's rating scale: BagelScore's Flickr8K-CF values, read by :func:`parse_rating`
SCALE = "cf"

_CRITERIA = ("Consider:\n\n"
             "- Editing accuracy (is the instruction carried out?)\n"
             "- Visual quality (is the edited image clear and free of artifacts?)\n"
             "{preservation}"
             "\nProvide ONLY a single decimal rating (0, 0.3, 0.6, or 1.0) of the overall effect of the edit "
             "without explanation:")

#: the two-image prompt (``vlm:``): source first, edited second
PAIR_PROMPT = ("You are evaluating an image edit. The first image is the original image; the second image is the "
               "result of editing it with the instruction: \"{instruction}\"\n\n"
               + _CRITERIA.replace("{preservation}",
                                   "- Content preservation (is everything the instruction does not mention "
                                   "unchanged?)\n- Style consistency (does the edited image keep the style of "
                                   "the original?)\n"))
#: the one-image prompt (``model``): the edited image alone
EDITED_ONLY_PROMPT = ("You are evaluating an image edit. The image is the result of editing an original image "
                      "(not shown) with the instruction: \"{instruction}\"\n\n"
                      + _CRITERIA.replace("{preservation}", ""))

#: why the Table 3 baseline is missing from a run without ``--judge``
NO_JUDGE = ("no --judge given: the paper's Table 3 baseline is GPT-based scoring, an API model that is not "
            "available here (no network, no weights); --judge model asks the evaluated model (edited image "
            "only), --judge vlm:<local directory> a local VLM (source and edited image)")


def judge_prompt(instruction: str, pair: bool) -> str:
    """:data:`PAIR_PROMPT` (``pair``) or :data:`EDITED_ONLY_PROMPT` with the instruction in its slot."""
    return (PAIR_PROMPT if pair else EDITED_ONLY_PROMPT).replace("{instruction}", str(instruction).strip())


def check_judge(spec: str | None) -> None:
    """None or "" (no judge), ``model`` or ``vlm:<existing local directory>``; anything else is a
    :class:`UserError`."""
    if not spec or spec == "model":
        return
    check_vlm_spec(spec, "'model' (the evaluated model)")


class ModelEditJudge:
    """The evaluated model asked :data:`EDITED_ONLY_PROMPT` about each edited image."""

    name = "model"
    sees = "edited image only"

    def __init__(self, model, **generate_kwargs):
        self.model, self.generate_kwargs = model, generate_kwargs

    def rate(self, sources: Sequence[Image.Image], edited: Sequence[Image.Image],
             instructions: Sequence[str]) -> list[BagelResult]:
        if not len(sources) == len(edited) == len(instructions):
            raise ValueError(f"{len(sources)} sources, {len(edited)} edited images, {len(instructions)} instructions")
        if not instructions:
            return []
        replies = self.model.answer(list(edited), [judge_prompt(i, pair=False) for i in instructions],
                                    **self.generate_kwargs)
        if len(replies) != len(instructions):
            raise RuntimeError(f"answer returned {len(replies)} replies for {len(instructions)} rows")
        return [BagelResult(parse_rating(r, SCALE), reply=r) for r in replies]


class EditVLMJudge(VLMJudge):
    """A local VLM asked :data:`PAIR_PROMPT` with the source and the edited image."""

    name = "vlm"
    sees = "source and edited image"

    def build_text(self, instruction: str) -> str:  # type: ignore[override]
        return self.chat(judge_prompt(instruction, pair=True), images=2)

    def rate(self, sources: Sequence[Image.Image], edited: Sequence[Image.Image],
             instructions: Sequence[str]) -> list[BagelResult]:
        if not len(sources) == len(edited) == len(instructions):
            raise ValueError(f"{len(sources)} sources, {len(edited)} edited images, {len(instructions)} instructions")
        return rate_with_vlm(self, [self.build_text(i) for i in instructions],
                             [[s, e] for s, e in zip(sources, edited)], SCALE)


def describe(spec: str) -> dict[str, str]:
    """What ``editing.json`` records of the judge of ``spec``: the spec, what it sees and its prompt
    (with ``{instruction}`` left in its slot)."""
    pair = spec.split(":", 1)[0] == "vlm"
    return {"spec": spec, "sees": (EditVLMJudge if pair else ModelEditJudge).sees,
            "prompt": PAIR_PROMPT if pair else EDITED_ONLY_PROMPT, "scale": "0, 0.3, 0.6, 1.0 (parse_rating, strict)"}


def build_judge(spec: str | None, model=None, max_new_tokens: int = 16, **kw):
    """The judge of ``spec`` (None without one); ``model``: the evaluated model (``spec == "model"``);
    ``kw``: the other settings of :meth:`VLMJudge.from_pretrained`."""
    check_judge(spec)
    if not spec:
        return None
    if spec == "model":
        return ModelEditJudge(model)
    return EditVLMJudge.from_pretrained(spec[len("vlm:"):], max_new_tokens=max_new_tokens, **kw)
