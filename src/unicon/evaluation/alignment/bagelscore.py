"""BagelScore (§3.1 of the BagelScore/EditingScore paper) for any :class:`~unicon.models.base.UnifiedModel`.

The model is asked the prompt of a rating scale (:mod:`.prompts`: ``cf``, the paper's Flickr8K-CF
prompt with 0 / 0.3 / 0.6 / 1.0, or ``expert``, its 1-4 form) about an (image, caption) pair. Two modes:

* ``decode`` (the paper's): ``model.answer([image], [prompt])`` generates a reply, parsed strictly by
  :func:`~.prompts.parse_rating` into one of the scale's four values. An unparseable reply is a **failure**:
  its score is None, it stays out of Kendall's τ and is counted (``failures``, ``failure_rate`` in the
  summary), never replaced by a guess;
* ``expected`` (**our deterministic addition**, not in the paper): one ``model.score_text`` call per
  batch scores the scale's four answer strings (``cf``: ``"0", "0.3", "0.6", "1.0"``; ``expert``:
  ``"1"``-``"4"``) (K = 4 candidates per row, as
  CocoCon scores its contrast sets) after the same prompt. With ``s_k`` the summed NLL of answer
  ``k`` (``Scores.sum_nll``: ``-log P(answer string | image, prompt)``), ``p = softmax(-s)`` and the
  score is ``sum_k p_k v_k``, a value between the scale's lowest and highest value. The softmax **normalises over these four strings
  only, not over the vocabulary**: the probability mass the model puts on any other reply is
  ignored, so ``p`` says which of the four the model prefers, not how likely it is to answer with
  one of them at all. It needs no generation, has no failures and ties less often than ``decode``.

Both modes use the same prompt; neither changes the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from unicon.evaluation.alignment.prompts import RatingScale, bagelscore_prompt, parse_rating, scale_of

MODES = ("expected", "decode")


@dataclass
class BagelResult:
    """One pair's BagelScore in one mode: ``score`` (None: a ``decode`` failure), the ``reply``
    (decode) or the four answer ``probs`` (expected, in the scale's ``answers`` order)."""

    score: float | None
    reply: str | None = None
    probs: list[float] | None = None


def expected_scores(model, images: Sequence, captions: Sequence[str],
                    scale: str | RatingScale = "cf") -> list[BagelResult]:
    """``expected`` mode for one batch: one ``score_text`` call with the four answers as candidates."""
    scale = scale_of(scale)
    answers = scale.answers
    scores = model.score_text(list(images), [bagelscore_prompt(c, scale) for c in captions],
                              [list(answers) for _ in captions])
    sum_nll = scores.sum_nll.detach().to(torch.float64).cpu()
    if sum_nll.shape != (len(captions), len(answers)):
        raise RuntimeError(f"score_text returned {tuple(sum_nll.shape)} scores for {len(captions)} rows "
                           f"of {len(answers)} answers")
    probs = torch.softmax(-sum_nll, dim=1)
    values = torch.tensor(scale.values, dtype=torch.float64)
    return [BagelResult(float(p @ values), probs=[float(x) for x in p]) for p in probs]


def decode_scores(model, images: Sequence, captions: Sequence[str], scale: str | RatingScale = "cf",
                  **generate_kwargs) -> list[BagelResult]:
    """``decode`` mode for one batch: one ``answer`` call, each reply parsed strictly."""
    scale = scale_of(scale)
    replies = model.answer(list(images), [bagelscore_prompt(c, scale) for c in captions], **generate_kwargs)
    if len(replies) != len(captions):
        raise RuntimeError(f"answer returned {len(replies)} replies for {len(captions)} rows")
    return [BagelResult(parse_rating(r, scale), reply=r) for r in replies]


def bagelscore(model, images: Sequence, captions: Sequence[str], mode: str, scale: str | RatingScale = "cf",
               **generate_kwargs) -> list[BagelResult]:
    """BagelScore of a batch of pairs in ``mode`` (``expected`` or ``decode``) on ``scale``."""
    if mode not in MODES:
        raise ValueError(f"unknown BagelScore mode {mode!r}; choose from {', '.join(MODES)}")
    if len(images) != len(captions):
        raise ValueError(f"{len(images)} images but {len(captions)} captions")
    if not captions:
        return []
    if mode == "expected":
        return expected_scores(model, images, captions, scale)
    return decode_scores(model, images, captions, scale, **generate_kwargs)
