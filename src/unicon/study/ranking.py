"""The rule that ties a judgement's ranking to its ratings.

An annotator rates every output Good / Medium / Poor and ranks the outputs best first. The two must
not contradict each other: an output may not be ranked above one that got a better rating (Poor above
Good, Medium above Good, Poor above Medium). Outputs with the same rating may come in any order:
the ranking is where the annotator separates them. The app refuses a contradictory judgement with
the message of :func:`ranking_contradiction`, and the page starts with no rank chosen, so a ranking
left untouched is refused too (the selects are required; the plain form without them is a 400).
"""

from __future__ import annotations

from typing import Mapping, Sequence

from unicon.study.db import LEVEL_VALUE


def ranking_contradiction(ratings: Mapping[str, str], ranking: Sequence[str]) -> str | None:
    """None when ``ranking`` (letters, best first) agrees with ``ratings`` (letter -> level); else
    a message naming the first pair ranked against its ratings."""
    for i, above in enumerate(ranking):
        for below in ranking[i + 1:]:
            if LEVEL_VALUE[ratings[below]] > LEVEL_VALUE[ratings[above]]:
                return (f"Output {below} is rated {ratings[below]} but ranked below Output {above}, rated "
                        f"{ratings[above]}; rank better-rated outputs first, or change a rating")
    return None
