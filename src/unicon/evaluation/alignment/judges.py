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
from unicon.evaluation.ureason.judges import VLMJudge, _generate_replies


def check_judge(spec: str | None) -> None:
    """None (no judge) or ``vlm:<existing local directory>``; anything else is a :class:`UserError`."""
    from pathlib import Path

    if spec is None or spec == "":
        return
    if not spec.startswith("vlm:"):
        raise UserError(f"--judge {spec!r}: use 'vlm:<local model directory>' (or leave it out)")
    path = Path(spec[len("vlm:"):]).expanduser()
    if not path.is_dir():
        raise UserError(f"--judge {spec}: {path} is not a local model directory (judges load from disk only)")


class AlignmentVLMJudge(VLMJudge):
    """The BagelScore prompt asked of a local VLM."""

    name = "vlm"

    def build_text(self, caption: str, scale: str = "cf") -> str:  # type: ignore[override]
        messages = [{"role": "user", "content": [{"type": "image"},
                                                 {"type": "text", "text": bagelscore_prompt(caption, scale)}]}]
        return self.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    def rate(self, images: Sequence[Image.Image], captions: Sequence[str], scale: str = "cf") -> list[BagelResult]:
        out: list[BagelResult] = []
        for start in range(0, len(captions), self.batch_size):
            preemption.check()
            texts = [self.build_text(c, scale) for c in captions[start:start + self.batch_size]]
            ims = [im.convert("RGB") for im in images[start:start + self.batch_size]]
            inputs = self.processor(text=texts, images=ims, return_tensors="pt", padding=True)
            for reply, _ in _generate_replies(self.model, self.tokenizer, inputs, self.max_new_tokens):
                reply = reply[: self.max_reply_chars]
                out.append(BagelResult(parse_rating(reply, scale), reply=reply))
        return out


def build_judge(spec: str | None, device: str = "cpu", dtype: str = "float32", trust_remote_code: bool = False,
                max_new_tokens: int = 16, batch_size: int = 4) -> AlignmentVLMJudge | None:
    check_judge(spec)
    if not spec:
        return None
    return AlignmentVLMJudge.from_pretrained(spec[len("vlm:"):], device=device, dtype=dtype,
                                             trust_remote_code=trust_remote_code, max_new_tokens=max_new_tokens,
                                             batch_size=batch_size)
