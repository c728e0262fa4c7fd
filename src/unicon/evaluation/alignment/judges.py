"""The optional VLM judge (``--judge vlm:<local model directory>``): any ``transformers``
image-text-to-text model asked the run's BagelScore prompt (its scale), its reply parsed by the same strict rule
as BagelScore's ``decode`` mode (:func:`~.prompts.parse_rating`; unparseable: a failure, counted).
Loading (local directories only), batching and greedy decoding are UReason's
:class:`~unicon.evaluation.ureason.judges.VLMJudge`'s."""

from __future__ import annotations

from typing import Sequence

from PIL import Image

from unicon.evaluation.alignment.bagelscore import BagelResult
from unicon.evaluation.alignment.prompts import bagelscore_prompt, parse_rating
from unicon.evaluation.ureason.judges import VLMJudge, check_vlm_spec


def check_judge(spec: str | None) -> None:
    """None (no judge) or ``vlm:<existing local directory>``; anything else is a :class:`~unicon.errors.UserError`."""
    if spec:
        check_vlm_spec(spec, "no judge (leave --judge out)")


def rate_with_vlm(judge: VLMJudge, texts: Sequence[str], images: Sequence[Sequence[Image.Image]],
                  scale: str) -> list[BagelResult]:
    """A :class:`VLMJudge`'s reply to each ``texts[i]`` (its chat text) shown ``images[i]``
    (:meth:`VLMJudge.replies`), read by :func:`parse_rating` on ``scale`` (unparseable: a rating of None)."""
    return [BagelResult(parse_rating(reply, scale), reply=reply) for reply in judge.replies(texts, images)]


class AlignmentVLMJudge(VLMJudge):
    """The BagelScore prompt asked of a local VLM."""

    name = "vlm"

    def build_text(self, caption: str, scale: str = "cf") -> str:  # type: ignore[override]
        return self.chat(bagelscore_prompt(caption, scale))

    def rate(self, images: Sequence[Image.Image], captions: Sequence[str], scale: str = "cf") -> list[BagelResult]:
        return rate_with_vlm(self, [self.build_text(c, scale) for c in captions], [[im] for im in images], scale)


def build_judge(spec: str | None, max_new_tokens: int = 16, **kw) -> AlignmentVLMJudge | None:
    """The judge of ``spec`` (None without one); ``kw``: the other settings of :meth:`VLMJudge.from_pretrained`."""
    check_judge(spec)
    if not spec:
        return None
    return AlignmentVLMJudge.from_pretrained(spec[len("vlm:"):], max_new_tokens=max_new_tokens, **kw)
