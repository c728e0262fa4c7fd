"""The BagelScore prompt of the paper (§3.1, "Flickr8K-CF Prompt"), verbatim, its four allowed values and
the strict grammar of a decoded rating.

The paper's text is flattened; the line breaks are restored where the paper's layout has them (a new
line before "Evaluate" and before each bullet), the wording is the paper's, character for character.
``"caption"`` in the paper is the slot: :func:`bagelscore_prompt` puts the candidate caption there.
``tests/test_alignment.py`` checks the template against ``papers/bagelscore-editingscore.txt``.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

#: the paper's prompt; ``{caption}`` is the slot the paper writes as ``"caption"``
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

_DECIMAL = re.compile(r"[+]?(\d+(\.\d*)?|\.\d+)")


def bagelscore_prompt(caption: str) -> str:
    """The paper's prompt with ``caption`` in its slot (the caption's surrounding whitespace stripped)."""
    return BAGELSCORE_PROMPT.replace("{caption}", str(caption).strip())


def parse_rating(reply: str | None) -> float | None:
    """The rating a decoded reply gives, or None (a failure).

    Strict: after stripping whitespace (and one final period), the whole reply must be one decimal
    number equal to one of :data:`VALUES` (``0``, ``0.0``, ``.3``, ``0.30``, ``1`` and ``1.0`` are
    read; ``0.5``, ``1.0/1.0``, ``0.6 (good)``, ``Good match`` or an empty reply are failures). We never
    search a longer reply for a number: a reply that explains itself did not follow the prompt."""
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
    for allowed in VALUES:
        if value == Decimal(str(allowed)):
            return allowed
    return None
