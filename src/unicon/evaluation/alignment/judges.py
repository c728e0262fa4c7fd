"""The optional VLM judge (``--judge vlm:<local model directory>``): any ``transformers``
image-text-to-text model asked the run's BagelScore prompt (its scale), its reply parsed by the same strict rule
as BagelScore's ``decode`` mode (:func:`~.prompts.parse_rating`; unparseable: a failure, counted).
Loading (local directories only), batching and greedy decoding are UReason's
:class:`~unicon.evaluation.ureason.judges.VLMJudge`'s."""

from __future__ import annotations

from typing import Sequence

from PIL import Image

from unicon.errors import UserError
from unicon.evaluation import preemption
from unicon.evaluation.alignment.bagelscore import BagelResult
from unicon.evaluation.alignment.prompts import bagelscore_prompt, parse_rating
from unicon.evaluation.ureason.judges import VLMJudge, _generate_replies, check_vlm_spec


def check_judge(spec: str | None) -> None:
    """None (no judge) or ``vlm:<existing local directory>``; anything else is a :class:`UserError`."""
    if spec is None or spec == "":
        return
    if not spec.startswith("vlm:"):
        raise UserError(f"--judge {spec!r}: use 'vlm:<local model directory>' (or leave it out)")
    check_vlm_spec(spec, "no judge")


def rate_with_vlm(judge: VLMJudge, texts: Sequence[str], images: Sequence[Sequence[Image.Image]],
                  scale: str) -> list[BagelResult]:
    """A :class:`VLMJudge`'s greedy reply to each ``texts[i]`` (its chat text) shown ``images[i]``
    (one or more images, in order), in batches of ``judge.batch_size``, cut to ``max_reply_chars``
    and read by :func:`parse_rating` on ``scale`` (unparseable: a rating of None)."""
    out: list[BagelResult] = []
    for start in range(0, len(texts), judge.batch_size):
        preemption.check()
        stop = start + judge.batch_size
        batch_images = [im.convert("RGB") for row in images[start:stop] for im in row]
        inputs = judge.processor(text=list(texts[start:stop]), images=batch_images, return_tensors="pt", padding=True)
        for reply, _ in _generate_replies(judge.model, judge.tokenizer, inputs, judge.max_new_tokens):
            reply = reply[: judge.max_reply_chars]
            out.append(BagelResult(parse_rating(reply, scale), reply=reply))
    return out


class AlignmentVLMJudge(VLMJudge):
    """The BagelScore prompt asked of a local VLM."""

    name = "vlm"

    def build_text(self, caption: str, scale: str = "cf") -> str:  # type: ignore[override]
        return self.chat(bagelscore_prompt(caption, scale))

    def rate(self, images: Sequence[Image.Image], captions: Sequence[str], scale: str = "cf") -> list[BagelResult]:
        return rate_with_vlm(self, [self.build_text(c, scale) for c in captions], [[im] for im in images], scale)


def build_judge(spec: str | None, device: str = "cpu", dtype: str = "float32", trust_remote_code: bool = False,
                max_new_tokens: int = 16, batch_size: int = 4) -> AlignmentVLMJudge | None:
    check_judge(spec)
    if not spec:
        return None
    return AlignmentVLMJudge.from_pretrained(spec[len("vlm:"):], device=device, dtype=dtype,
                                             trust_remote_code=trust_remote_code, max_new_tokens=max_new_tokens,
                                             batch_size=batch_size)
