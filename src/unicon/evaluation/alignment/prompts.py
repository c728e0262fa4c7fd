"""The BagelScore prompts: the paper's Flickr8K-CF prompt (§3.1), verbatim, and its 1-4 form for
Flickr8K-Expert; each scale's allowed values and the strict grammar of a decoded rating.

The paper sets the scale per task ("The BagelScore is computed on a scale defined by the task, e.g.,
between 1 and 4 for the expert dataset") but prints one prompt only, the one it labels "Flickr8K-CF
Prompt", with the four values 0 / 0.3 / 0.6 / 1.0. :data:`SCALES` holds one entry per scale:

* ``cf``: that prompt, **verbatim**. The paper's text is flattened; the line breaks are restored where
  the paper's layout has them (a new line before "Evaluate" and before each bullet), the wording is
  the paper's, character for character (``tests/test_alignment.py`` checks the template against
  ``papers/bagelscore-editingscore.txt``). ShapesWorld's instruction rows train this prompt
  (``data_builders/shapes_instruct.py``), so a ShapesWorld set is asked in it;
* ``expert``: **our adaptation** for the 1-4 scale the paper names for Flickr8K-Expert, whose prompt it
  does not print: the same prompt with the values 1, 2, 3, 4 in place of 0.0, 0.3, 0.6, 1.0 (the same
  four descriptions, in the same order) and the last line asking for "a single integer rating (1, 2,
  3, or 4)".

The scale is a setting (``eval.alignment.bagel_scale`` / ``--bagel-scale``: ``auto`` picks ``expert``
for a Flickr8K-Expert file, ``cf`` otherwise; :func:`unicon.evaluation.alignment.runner.resolve_bagel_scale`)
and ``alignment.json`` records the scale that ran. Kendall's τ does not depend on the values' spacing,
only on the model's answers, which the wording of the prompt can change.
``"caption"`` in the paper is the slot: :func:`bagelscore_prompt` puts the candidate caption there.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation

#: the paper's Flickr8K-CF prompt; ``{caption}`` is the slot the paper writes as ``"caption"``
BAGELSCORE_PROMPT = (
    'Analyze how accurately this image matches the caption: "{caption}"\n'
    "Evaluate the match on a precise scale with only these four possible values:\n\n"
    "- 0.0: No match The caption is completely unrelated to the image.\n"
    "- 0.3: Poor match The caption has minimal relevance with major inaccuracies.\n"
    "- 0.6: Good match The caption is mostly accurate with only minor omissions or imprecisions.\n"
    "- 1.0: Perfect match The caption perfectly describes all important aspects of the image.\n\n"
    "Consider:\n\n"
    "- Factual accuracy (are all statements true about the image?)\n"
    "- Completeness (does the caption cover the main elements?)\n"
    "- Precision (does the caption avoid vague descriptions?)\n"
    "- Relevance (does the caption focus on important aspects?)\n\n"
    "Provide ONLY a single decimal rating (0, 0.3, 0.6, or 1.0) without explanation:"
)

#: the four values the prompt allows, ascending
VALUES = (0.0, 0.3, 0.6, 1.0)
#: the answer strings whose likelihoods the ``expected`` mode compares, as the prompt's last line
#: spells them ("0, 0.3, 0.6, or 1.0")
ANSWERS = ("0", "0.3", "0.6", "1.0")

#: the 1-4 form of the prompt for Flickr8K-Expert (our adaptation: module docstring): the Flickr8K-CF
#: prompt with the values 1-4 in place of 0.0-1.0
BAGELSCORE_PROMPT_EXPERT = (
    BAGELSCORE_PROMPT.replace("- 0.0:", "- 1:").replace("- 0.3:", "- 2:").replace("- 0.6:", "- 3:")
    .replace("- 1.0:", "- 4:")
    .replace("single decimal rating (0, 0.3, 0.6, or 1.0)", "single integer rating (1, 2, 3, or 4)")
)


@dataclass(frozen=True)
class RatingScale:
    """A BagelScore scale: its prompt template (``{caption}`` the slot), allowed values (ascending),
    the answer strings of the ``expected`` mode and where the prompt comes from."""

    name: str
    template: str
    values: tuple[float, ...]
    answers: tuple[str, ...]
    source: str

    def describe(self) -> dict:
        return {"name": self.name, "values": list(self.values), "prompt": self.source}


#: the scales by name (module docstring)
SCALES = {
    "cf": RatingScale("cf", BAGELSCORE_PROMPT, VALUES, ANSWERS,
                      "the paper's Flickr8K-CF prompt, verbatim"),
    "expert": RatingScale("expert", BAGELSCORE_PROMPT_EXPERT, (1.0, 2.0, 3.0, 4.0), ("1", "2", "3", "4"),
                          "adapted: the Flickr8K-CF prompt with the 1-4 scale the paper names for "
                          "Flickr8K-Expert (the paper prints no Expert prompt)"),
}

_DECIMAL = re.compile(r"[+]?(\d+(\.\d*)?|\.\d+)")


def scale_of(scale: str | RatingScale) -> RatingScale:
    if isinstance(scale, RatingScale):
        return scale
    if scale not in SCALES:
        raise ValueError(f"unknown BagelScore scale {scale!r}; choose from {', '.join(SCALES)}")
    return SCALES[scale]


def bagelscore_prompt(caption: str, scale: str | RatingScale = "cf") -> str:
    """The scale's prompt (default: the paper's) with ``caption`` in its slot (the caption's
    surrounding whitespace stripped)."""
    return scale_of(scale).template.replace("{caption}", str(caption).strip())


def parse_rating(reply: str | None, scale: str | RatingScale = "cf") -> float | None:
    """The rating a decoded reply gives, or None (a failure).

    Strict: after stripping whitespace (and one final period), the whole reply must be one decimal
    number equal to one of the scale's values (``cf``: ``0``, ``0.0``, ``.3``, ``0.30``, ``1`` and ``1.0``
    are read; ``0.5``, ``1.0/1.0``, ``0.6 (good)``, ``Good match`` or an empty reply are failures;
    ``expert``: ``3``, ``3.0``, ``4.`` are read, ``2.5`` or ``3/4`` are not). We never search a longer
    reply for a number: a reply that explains itself did not follow the prompt."""
    values = scale_of(scale).values
    if reply is None:
        return None
    text = str(reply).strip()
    if text.endswith(".") and not _DECIMAL.fullmatch(text):
        text = text[:-1].rstrip()
    if not _DECIMAL.fullmatch(text):
        return None
    try:
        value = Decimal(text)
    except InvalidOperation:  # pragma: no cover - the regex admits decimals only
        return None
    for allowed in values:
        if value == Decimal(str(allowed)):
            return allowed
    return None
