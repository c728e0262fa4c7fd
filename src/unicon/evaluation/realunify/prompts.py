"""The RealUnify prompts (Shi et al., supplementary B.2, Tables 7-13), verbatim, and their filling.

Each ``TABLE_<n>`` is the table's text as printed, placeholders included: ``[Image]`` marks where
the image goes, ``[Question]``, ``[Prompt]`` and ``[Option A]``..``[Option D]`` the instance's
text. The fill functions substitute the text placeholders in one pass (a value may itself contain
brackets) and drop the ``[Image]`` line with the blank lines after it: every backend takes the
image as a separate input (``answer(images, questions)``, ``edit_image(images, instructions)``),
so the text it gets is what follows the image in the table.

* Table 7 -- the UEG polling question asked of a judge about a generated image (:func:`polling_prompt`);
* Table 8 -- the GEU multiple-choice question (:func:`multiple_choice_prompt`), direct and, on the
  edited image, stepwise;
* Table 9 -- the UEG stepwise refinement of the prompt before drawing (:func:`refine_prompt`);
* Tables 10-13 -- the GEU stepwise edit instruction of each category (:func:`edit_prompt`).

Not in the paper: with ``stepwise_input="original+edited"`` the GEU stepwise question is shown the
input image and then the edited one, and Table 8 is preceded by a sentence saying so
(:func:`two_image_prompt`, :data:`TWO_IMAGE_NOTES`). Those sentences are the public release's stepwise
runner's (lmms-eval, ``lmms_eval/tasks/realunify/utils.py``, its visual chain-of-thought prompts for
mental reconstruction, mental tracking and attentional focusing: the sentence, a blank line, then the
row's evaluation prompt); the release has no cognitive navigation task, and its sentence here is ours,
written the same way after Table 13's edit.
"""

from __future__ import annotations

import re
from typing import Sequence

TABLE_7 = (
    "[Image]\n"
    "Please answer the following question based on the image:\n"
    "Question: [Question]\n"
    "\n"
    "You should only reply yes or no, and do not provide any other extra content."
)

TABLE_8 = (
    "[Image]\n"
    "Select the best answer to the following multiple-option question based on the image. Respond with only "
    "the letter (A, B, C, or D) of the correct option.\n"
    "Question: [Question]\n"
    "Option:\n"
    "A. [Option A]\n"
    "B. [Option B]\n"
    "C. [Option C]\n"
    "D. [Option D]\n"
    "The best answer is:"
)

TABLE_9 = (
    "Here is the prompt for image generation: [Prompt]\n"
    "\n"
    "Please refine it into a simple, direct, and unambiguous form to ensure the generated image fully aligns "
    "with the given description and conditions.\n"
    "\n"
    "Respond only with the refined prompt, without adding anything else."
)

TABLE_10 = (
    "[Image]\n"
    "\n"
    "Please restore the image that has been shuffled by patches, without adding extra content or altering the "
    "original image."
)

TABLE_11 = (
    "[Image]\n"
    "\n"
    "Here is the question: [Question]\n"
    "\n"
    "Please apply the corresponding transformations and modifications to the contents of the image according "
    "to the question."
)

TABLE_12 = (
    "[Image]\n"
    "\n"
    "Here is the question: [Question]\n"
    "\n"
    "Please highlight the regions of the image that are relevant to the question."
)

TABLE_13 = (
    "[Image]\n"
    "\n"
    "Here is the question: [Question]\n"
    "\n"
    "Please mark the path(s) in the image that are relevant to the question."
)

#: the tables by number, as the verbatim test reads them
TABLES = {7: TABLE_7, 8: TABLE_8, 9: TABLE_9, 10: TABLE_10, 11: TABLE_11, 12: TABLE_12, 13: TABLE_13}

#: the stepwise edit prompt of each GEU category (Tables 10-13)
EDIT_TABLES = {
    "mental_reconstruction": TABLE_10,
    "mental_tracking": TABLE_11,
    "attentional_focusing": TABLE_12,
    "cognitive_navigation": TABLE_13,
}
LETTERS = ("A", "B", "C", "D")

#: the sentence before Table 8 when the stepwise question also shows the edited image (module docstring:
#: the release's wording, the cognitive navigation one ours)
TWO_IMAGE_NOTES = {
    "mental_reconstruction": "In addition to the original image, you are also given a restored version of the "
                             "shuffled image to help you answer the question.",
    "mental_tracking": "In addition to the original image, you are also given a transformed version of the image "
                       "with the modifications applied according to the question.",
    "attentional_focusing": "In addition to the original image, you are also given a visualization that "
                            "highlights the regions relevant to the question.",
    "cognitive_navigation": "In addition to the original image, you are also given a version of the image with "
                            "the path(s) relevant to the question marked.",
}

_PLACEHOLDER = re.compile(r"\[(Question|Prompt|Option [ABCD])\]")
_IMAGE_LINE = re.compile(r"\A\[Image\]\n+")


def fill(template: str, **values: str) -> str:
    """``template`` with ``[Question]`` -> ``values["question"]``, ``[Prompt]`` -> ``values["prompt"]``,
    ``[Option X]`` -> ``values["option_x"]`` (one pass), and its leading ``[Image]`` line (plus the
    blank lines after it) removed. A placeholder without a value is a ``KeyError`` naming it."""
    def sub(m: re.Match) -> str:
        key = m.group(1).lower().replace(" ", "_")
        if key not in values:
            raise KeyError(f"no value for [{m.group(1)}]")
        return str(values[key])

    return _PLACEHOLDER.sub(sub, _IMAGE_LINE.sub("", template))


def polling_prompt(question: str) -> str:
    """Table 7 for one polling question (the judge also gets the generated image)."""
    return fill(TABLE_7, question=question)


def multiple_choice_prompt(question: str, options: Sequence[str]) -> str:
    """Table 8 for a question and its four options (in A-D order)."""
    if len(options) != 4:
        raise ValueError(f"a RealUnify question has 4 options, got {len(options)}")
    return fill(TABLE_8, question=question, **{f"option_{x.lower()}": o for x, o in zip(LETTERS, options)})


def refine_prompt(prompt: str) -> str:
    """Table 9: the request to refine a UEG prompt (stepwise UEG, answered by ``model.reason``)."""
    return fill(TABLE_9, prompt=prompt)


def edit_prompt(category: str, question: str) -> str:
    """The stepwise edit instruction of a GEU ``category`` (Tables 10-13; Table 10 takes no question)."""
    if category not in EDIT_TABLES:
        raise ValueError(f"no stepwise edit prompt for GEU category {category!r}; known: {', '.join(EDIT_TABLES)}")
    return fill(EDIT_TABLES[category], question=question)


def two_image_prompt(category: str, question: str, options: Sequence[str]) -> str:
    """The GEU stepwise question asked of the input image and the edited one (in that order): the
    category's :data:`TWO_IMAGE_NOTES` sentence, a blank line, then Table 8."""
    if category not in TWO_IMAGE_NOTES:
        raise ValueError(f"no two-image note for GEU category {category!r}; known: {', '.join(TWO_IMAGE_NOTES)}")
    return f"{TWO_IMAGE_NOTES[category]}\n\n{multiple_choice_prompt(question, options)}"
