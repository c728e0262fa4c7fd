"""BagelScore (§3.1 of the BagelScore/EditingScore paper) for any :class:`~unicon.models.base.UnifiedModel`.

The model is asked the paper's prompt (:mod:`.prompts`) about an (image, caption) pair. Two modes:

* ``decode`` (the paper's): ``model.answer([image], [prompt])`` generates a reply, parsed strictly by
  :func:`~.prompts.parse_rating` into one of 0 / 0.3 / 0.6 / 1.0. An unparseable reply is a **failure**:
  its score is None, it stays out of Kendall's τ and is counted (``failures``, ``failure_rate`` in the
  summary), never replaced by a guess;
* ``expected`` (**our deterministic addition**, not in the paper): one ``model.score_text`` call per
  batch scores the four answer strings ``"0", "0.3", "0.6", "1.0"`` (K = 4 candidates per row, as
  CocoCon scores its contrast sets) after the same prompt. With ``s_k`` the summed NLL of answer
  ``k`` (``Scores.sum_nll``: ``-log P(answer string | image, prompt)``), ``p = softmax(-s)`` and the
  score is ``sum_k p_k v_k``, a value in [0, 1]. The softmax **normalises over these four strings
  only, not over the vocabulary**: the probability mass the model puts on any other reply is
  ignored, so ``p`` says which of the four the model prefers, not how likely it is to answer with
  one of them at all. It needs no generation, has no failures and ties less often than ``decode``.

Both modes use the same prompt; neither changes the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from unicon.evaluation.alignment.prompts import ANSWERS, VALUES, bagelscore_prompt, parse_rating

MODES = ("expected", "decode")


@dataclass
class BagelResult:
    """One pair's BagelScore in one mode: ``score`` (None: a ``decode`` failure), the ``reply``
    (decode) or the four answer ``probs`` (expected, in :data:`~.prompts.ANSWERS` order)."""

    score: float | None
    reply: str | None = None
    probs: list[float] | None = None


def expected_scores(model, images: Sequence, captions: Sequence[str]) -> list[BagelResult]:
    """``expected`` mode for one batch: one ``score_text`` call with the four answers as candidates."""
    if len(images) != len(captions):
        raise ValueError(f"{len(images)} images but {len(captions)} captions")
    if not captions:
        return []
    scores = model.score_text(list(images), [bagelscore_prompt(c) for c in captions],
                              [list(ANSWERS) for _ in captions])
    sum_nll = scores.sum_nll.detach().to(torch.float64).cpu()
    if sum_nll.shape != (len(captions), len(ANSWERS)):
        raise RuntimeError(f"score_text returned {tuple(sum_nll.shape)} scores for {len(captions)} rows "
                           f"of {len(ANSWERS)} answers")
    probs = torch.softmax(-sum_nll, dim=1)
    values = torch.tensor(VALUES, dtype=torch.float64)
    return [BagelResult(float(p @ values), probs=[float(x) for x in p]) for p in probs]


def decode_scores(model, images: Sequence, captions: Sequence[str], **generate_kwargs) -> list[BagelResult]:
    """``decode`` mode for one batch: one ``answer`` call, each reply parsed strictly."""
    if len(images) != len(captions):
        raise ValueError(f"{len(images)} images but {len(captions)} captions")
    if not captions:
        return []
    replies = model.answer(list(images), [bagelscore_prompt(c) for c in captions], **generate_kwargs)
    if len(replies) != len(captions):
        raise RuntimeError(f"answer returned {len(replies)} replies for {len(captions)} rows")
    return [BagelResult(parse_rating(r), reply=r) for r in replies]


def bagelscore(model, images: Sequence, captions: Sequence[str], mode: str, **generate_kwargs) -> list[BagelResult]:
    """BagelScore of a batch of pairs in ``mode`` (``expected`` or ``decode``)."""
    if mode == "expected":
        return expected_scores(model, images, captions)
    if mode == "decode":
        return decode_scores(model, images, captions, **generate_kwargs)
    raise ValueError(f"unknown BagelScore mode {mode!r}; choose from {', '.join(MODES)}")
