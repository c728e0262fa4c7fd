"""Judges for UReason: does an image (or a reasoning chain) satisfy the criterion ``C``?

One interface, :class:`Judge`, three implementations:

* :class:`VLMJudge` -- any ``transformers`` image-text-to-text model (the paper used
  Qwen3-VL-235B-A22B) asked with the paper's Fig. 19 prompt; implements the indicator
  ``I(I, C)`` of eq. (4).
* :class:`ReasoningChainJudge` -- any causal LM (the paper used Qwen3-235B-A22B) asked with the
  Fig. 20 prompt whether the thought process ``R`` implies ``C`` (the paper's Table 3). It
  judges text only, so it is combined with an image judge through :class:`JudgePanel`.
* :class:`ShapesJudge` -- the exact verifier for ShapesWorld prompts: images are checked with
  ``unicon.worlds.shapes_verify.check_criterion(target_scene, image)``; a reasoning chain counts as
  correct when its refined prompt, parsed with the world's caption grammar, states the target
  pattern (:func:`refined_prompt_implies`).

Answer parsing is strict (:func:`parse_answer`): the reply must contain
``<answer>Yes</answer>`` or ``<answer>No</answer>`` (case-insensitive, whitespace and a final
period inside the tags tolerated); the *last* answer tag decides, because a step-by-step reply
may first quote the format. Anything else -- no tag, ``<answer>I do not know</answer>`` -- is
``"unparseable"``, counted separately and scored as a failure. The public reference code instead
looks for "yes"/"no" substrings, so a reply containing "not" or "know" can be scored as a
"no"; we never guess from substrings.

Length limit: a generated reply that stops at ``max_new_tokens`` without an end-of-sequence
token, or whose text is longer than ``max_reply_chars`` (then cut to that length), is flagged
``truncated``; the flag is counted by the evaluation and the (possibly cut) text is still parsed.

``trust_remote_code`` is off unless asked for explicitly. Judge models load from local directories
only (:func:`check_judge_spec`), never from a hub; nothing here writes files.
"""

from __future__ import annotations

import abc
import re
from collections import Counter
from pathlib import Path
from dataclasses import dataclass
from typing import Sequence

import torch
from PIL import Image

from unicon.config import JUDGE_DTYPES, JUDGE_MAX_NEW_TOKENS
from unicon.core import torch_dtype
from unicon.data.ureason import UReasonInstance
from unicon.errors import UserError
from unicon.evaluation import preemption
from unicon.worlds.shapes import WorldConfig, load_world
from unicon.worlds.shapes_text import CaptionParseError, parse_caption
from unicon.worlds.shapes_verify import check_criterion

# Paper, appendix F, Fig. 19 (the paper text is flattened; line breaks are restored at the
# sentence/step boundaries, the wording is verbatim).
VISUAL_VERIFICATION_PROMPT = (
    "You are an objective image evaluator. Your goal is to verify if the image content matches the "
    "provided text description.\n"
    'Target Description: "{description}"\n'
    "Please think step by step:\n"
    "1. Analyze the image content carefully.\n"
    '2. Compare the visual elements with the "Target Description".\n'
    "3. Determine if the image strictly meets the requirements.\n"
    "Finally, output your judgment in the following format:\n"
    "If it matches, output <answer>Yes</answer>.\n"
    "If it does not match, output <answer>No</answer>."
)

# Paper, appendix F, Fig. 20 (wording verbatim; the paper shows "doesn’t" with a typographic
# apostrophe, kept as is).
REASONING_CHAIN_PROMPT = (
    'You are an objective logic evaluator. I will provide you with a "User Prompt" and a model\u2019s '
    '"Thought Process". Your task is to judge whether the model\u2019s thought process implies or covers '
    'the meaning of a specific "Target Criteria".\n'
    "=== User Prompt ===\n{user_prompt}\n"
    "=== Model Thought Process ===\n{model_thought}\n"
    "=== Target Criteria ===\n{criteria}\n"
    "=== Instruction ===\n"
    "Please think step by step:\n"
    '1. Analyze the "Target Criteria" to understand the core requirement.\n'
    '2. Read the "Thought Process" carefully.\n'
    '3. Determine if the thought process explicitly or implicitly covers the "Target Criteria".\n'
    "Note: It doesn\u2019t need to match word-for-word, but the logic/meaning must be present.\n"
    "Finally, output your judgment in the following format:\n"
    "If the criteria is met/implied, output <answer>Yes</answer>.\n"
    "If the criteria is missed or contradicted, output <answer>No</answer>."
)

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.IGNORECASE | re.DOTALL)
_PLACEHOLDER = re.compile(r"\{(description|user_prompt|model_thought|criteria)\}")

#: verdict statuses; only "yes" counts as a pass
STATUSES = ("yes", "no", "unparseable", "no_input")


def fill_prompt(template: str, **values: str) -> str:
    """Substitute ``{name}`` placeholders in one pass (the values may contain braces, e.g. code)."""
    return _PLACEHOLDER.sub(lambda m: values[m.group(1)], template)


def parse_answer(reply: str) -> str:
    """``"yes"``, ``"no"`` or ``"unparseable"`` from the last ``<answer>...</answer>`` tag of ``reply``."""
    tags = _ANSWER_TAG.findall(reply or "")
    if not tags:
        return "unparseable"
    answer = tags[-1].strip().rstrip(".").strip().lower()
    return answer if answer in ("yes", "no") else "unparseable"


@dataclass
class Verdict:
    """A judge's decision on one sample."""

    status: str  # one of STATUSES
    reply: str = ""  # the judge's raw reply (or a note from an exact verifier)
    truncated: bool = False  # reply cut by max_new_tokens / max_reply_chars

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"verdict status must be one of {STATUSES}, got {self.status!r}")

    @property
    def passed(self) -> bool:
        return self.status == "yes"


def verdict_from_reply(reply: str, hit_token_limit: bool = False, max_reply_chars: int | None = None) -> Verdict:
    """Apply the length limit, then :func:`parse_answer`."""
    truncated = hit_token_limit
    if max_reply_chars is not None and len(reply) > max_reply_chars:
        reply, truncated = reply[:max_reply_chars], True
    return Verdict(parse_answer(reply), reply, truncated)


class Judge(abc.ABC):
    """Decides whether generated images (and optionally reasoning chains) satisfy each criterion."""

    name: str = "judge"
    #: whether :meth:`judge_reasoning` is implemented
    judges_reasoning: bool = False

    @abc.abstractmethod
    def judge_images(
        self, instances: Sequence[UReasonInstance], images: Sequence[Image.Image | None]
    ) -> list[Verdict]:
        """One verdict per (instance, image); a ``None`` image gets ``status="no_input"``."""

    def judge_reasoning(
        self,
        instances: Sequence[UReasonInstance],
        traces: Sequence[str],
        refined_prompts: Sequence[str],
    ) -> list[Verdict]:
        """One verdict per reasoning chain: does the trace imply the instance's criterion?"""
        raise NotImplementedError(f"judge '{self.name}' does not judge reasoning chains")


class JudgePanel(Judge):
    """An image judge plus an optional, separate reasoning-chain judge."""

    def __init__(self, image_judge: Judge, chain_judge: Judge | None = None):
        self.image_judge, self.chain_judge = image_judge, chain_judge
        self.name = image_judge.name + (f"+{chain_judge.name}" if chain_judge else "")
        self.judges_reasoning = chain_judge is not None and chain_judge.judges_reasoning

    def judge_images(self, instances, images):
        return self.image_judge.judge_images(instances, images)

    def judge_reasoning(self, instances, traces, refined_prompts):
        if self.chain_judge is None:
            return super().judge_reasoning(instances, traces, refined_prompts)
        return self.chain_judge.judge_reasoning(instances, traces, refined_prompts)


class RecordedJudge(Judge):
    """The judge a run needs no model for: its name and abilities; it judges nothing. A merge's
    stand-in for the shards' judge (a merge has no instance of its own), and RealUnify's judge of a
    standalone run without UEG instances (:meth:`judge` is its polling interface)."""

    def __init__(self, name: str, judges_reasoning: bool = False):
        self.name, self.judges_reasoning = name, judges_reasoning

    def judge_images(self, instances, images):
        if instances:
            raise RuntimeError("a merge of shards judges no image")
        return []

    judge = judge_images

    def judge_reasoning(self, instances, traces, refined_prompts):
        return self.judge_images(instances, [])


# ---------------------------------------------------------------------------------------------
# transformers-backed judges
# ---------------------------------------------------------------------------------------------
def _eos_ids(model, tokenizer) -> set[int]:
    eos = model.generation_config.eos_token_id
    ids = set(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


@torch.no_grad()
def _generate_replies(model, tokenizer, inputs: dict, max_new_tokens: int) -> list[tuple[str, bool]]:
    """Greedy replies and whether each hit ``max_new_tokens`` without an EOS token."""
    def move(v):  # pixel values follow the model's dtype (bf16 judges), ids stay integer
        if not torch.is_tensor(v):
            return v
        return v.to(model.device, model.dtype) if v.is_floating_point() else v.to(model.device)

    inputs = {k: move(v) for k, v in inputs.items()}
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad)
    new = out[:, inputs["input_ids"].shape[1] :]
    eos = _eos_ids(model, tokenizer)
    texts = tokenizer.batch_decode(new, skip_special_tokens=True)
    return [(text.strip(), not any(int(t) in eos for t in row)) for text, row in zip(texts, new)]


class _TransformersJudge(Judge):
    """What the transformers-backed judges share: a model and its tokenizer (left padding for
    batched decoder-only generation), greedy replies turned into verdicts batch by batch, and
    loading with a one-line error. Subclasses say how a batch of items is tokenised, and declare
    their default ``prompt``, what the loading error calls them and the ``transformers`` Auto classes
    they load with."""

    prompt: str = ""
    what, model_class, preprocessor_class = "judge", "", ""

    def __init__(self, model, tokenizer, max_new_tokens: int = JUDGE_MAX_NEW_TOKENS, max_reply_chars: int = 8000,
                 batch_size: int = 4, prompt: str | None = None):
        self.model, self.tokenizer = model.eval(), tokenizer
        self.tokenizer.padding_side = "left"  # decoder-only batched generation
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.max_new_tokens, self.max_reply_chars, self.batch_size = max_new_tokens, max_reply_chars, batch_size
        if prompt is not None:
            self.prompt = prompt

    @classmethod
    def from_pretrained(cls, path: str, device: str = "cpu", dtype: str = "float32", trust_remote_code: bool = False,
                        **kwargs):
        """The judge of the local model directory ``path``; ``kwargs``: ``max_new_tokens``,
        ``max_reply_chars``, ``batch_size``, ``prompt``."""
        import transformers

        if dtype not in JUDGE_DTYPES:
            raise UserError(f"judge dtype must be one of {', '.join(JUDGE_DTYPES)}, got {dtype!r}")
        try:
            pre = getattr(transformers, cls.preprocessor_class).from_pretrained(path, trust_remote_code=trust_remote_code)
            model = getattr(transformers, cls.model_class).from_pretrained(
                path, dtype=dtype if dtype == "auto" else torch_dtype(dtype), trust_remote_code=trust_remote_code)
        except (OSError, ValueError) as e:
            raise UserError(f"cannot load {cls.what} from {path}: {str(e).splitlines()[0]}") from None
        return cls(model.to(device), pre, **kwargs)

    def _replies(self, count: int, encode) -> list[tuple[str, bool]]:
        """The greedy replies to ``count`` items, ``batch_size`` at a time (the model inputs of a batch:
        ``encode(its item indices)``), with whether each hit ``max_new_tokens`` without an EOS token."""
        replies = []
        for start in range(0, count, self.batch_size):
            preemption.check()
            inputs = encode(list(range(start, min(start + self.batch_size, count))))
            replies += _generate_replies(self.model, self.tokenizer, inputs, self.max_new_tokens)
        return replies

    def _verdicts(self, items: Sequence, empty: str, encode) -> list[Verdict]:
        """One verdict per item: ``Verdict("no_input", empty)`` where the item is None or blank text,
        else the reply to the model inputs ``encode(indices of the items)``."""
        verdicts = [Verdict("no_input", empty) if item is None or (isinstance(item, str) and not item.strip())
                    else None for item in items]
        todo = [i for i, v in enumerate(verdicts) if v is None]
        for i, (reply, hit) in zip(todo, self._replies(len(todo), lambda idx: encode([todo[k] for k in idx]))):
            verdicts[i] = verdict_from_reply(reply, hit, self.max_reply_chars)
        return verdicts  # type: ignore[return-value]


class VLMJudge(_TransformersJudge):
    """Visual verification with an image-text-to-text model and the paper's Fig. 19 prompt.

    ``model``/``processor`` are any ``AutoModelForImageTextToText`` / ``AutoProcessor`` pair
    whose processor has a chat template (the template decides where the image goes).
    """

    name = "vlm"
    prompt = VISUAL_VERIFICATION_PROMPT
    what, model_class, preprocessor_class = "VLM judge", "AutoModelForImageTextToText", "AutoProcessor"

    def __init__(self, model, processor, **kwargs):
        """``kwargs``: ``max_new_tokens``, ``max_reply_chars``, ``batch_size``, ``prompt``."""
        if getattr(processor, "chat_template", None) is None:
            raise UserError("the VLM judge's processor has no chat template; it decides where the image goes")
        self.processor = processor
        super().__init__(model, processor.tokenizer, **kwargs)

    def chat(self, text: str, images: int = 1) -> str:
        """One user turn of ``images`` images, then ``text``, laid out by the processor's chat template."""
        content = [*({"type": "image"} for _ in range(images)), {"type": "text", "text": text}]
        return self.processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                                  tokenize=False)

    def build_text(self, criterion: str) -> str:
        return self.chat(fill_prompt(self.prompt, description=criterion))

    def _encode(self, texts: Sequence[str], images: Sequence[Sequence[Image.Image]]):
        """The model inputs of the chat texts ``texts[i]``, each shown the images ``images[i]`` (in order)."""
        return self.processor(text=list(texts), images=[im.convert("RGB") for row in images for im in row],
                              return_tensors="pt", padding=True)

    def replies(self, texts: Sequence[str], images: Sequence[Sequence[Image.Image]]) -> list[str]:
        """The greedy reply to each chat text ``texts[i]`` shown the images ``images[i]`` (in order), cut
        to ``max_reply_chars``."""
        replies = self._replies(len(texts), lambda idx: self._encode([texts[i] for i in idx], [images[i] for i in idx]))
        return [reply[: self.max_reply_chars] for reply, _ in replies]

    def judge_images(self, instances, images):
        if len(instances) != len(images):
            raise ValueError(f"{len(instances)} instances but {len(images)} images")
        return self._verdicts(images, "no image was generated", lambda idx: self._encode(
            [self.build_text(instances[i].expect_en) for i in idx], [[images[i]] for i in idx]))


class ReasoningChainJudge(_TransformersJudge):
    """LLM-as-judge of reasoning chains with the paper's Fig. 20 prompt (Table 3).

    The chat template is used when the tokenizer has one; otherwise the prompt is fed raw.
    """

    name = "chain-llm"
    judges_reasoning = True
    prompt = REASONING_CHAIN_PROMPT
    what, model_class, preprocessor_class = "reasoning-chain judge", "AutoModelForCausalLM", "AutoTokenizer"

    def build_text(self, user_prompt: str, thought: str, criterion: str) -> str:
        text = fill_prompt(self.prompt, user_prompt=user_prompt, model_thought=thought, criteria=criterion)
        if getattr(self.tokenizer, "chat_template", None):
            return self.tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
            )
        return text

    def judge_images(self, instances, images):
        raise NotImplementedError("the reasoning-chain judge is text-only; pair it with an image judge (JudgePanel)")

    def judge_reasoning(self, instances, traces, refined_prompts):
        if not (len(instances) == len(traces) == len(refined_prompts)):
            raise ValueError("instances, traces and refined prompts must have the same length")

        def encode(idx):
            texts = [self.build_text(instances[i].prompt, traces[i], instances[i].expect_en) for i in idx]
            # chat templates already hold the special tokens
            return self.tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)

        return self._verdicts(traces, "empty reasoning trace", encode)


# ---------------------------------------------------------------------------------------------
# exact verifier for ShapesWorld
# ---------------------------------------------------------------------------------------------
_INVERSE = {"left": "right", "right": "left", "above": "below", "below": "above"}


def refined_prompt_implies(text: str, pattern: dict, cfg=None) -> bool:
    """Does a ShapesWorld refined prompt state the target pattern? (the exact chain check)

    ``text`` must parse with the world's caption grammar (``parse_caption``); every noun phrase
    must name a colour; the multiset of (colour, shape) it counts must equal the pattern's
    (closed world, as in ``caption_matches``); and every relation of the pattern must be stated
    (``a left of b`` and ``b right of a`` are the same statement). Cell positions (``row``/``col``)
    cannot be said in the grammar and are not required.
    """
    try:
        spec = parse_caption(text, cfg)
    except CaptionParseError:
        return False
    nps = spec.noun_phrases()
    if any(n.color is None for n in nps):
        return False
    said: Counter = Counter()
    for n in nps:
        said[(n.color, n.shape)] += n.count
    objs = pattern["objects"]
    if said != Counter((o["color"], o["shape"]) for o in objs):
        return False
    stated = set()
    for c in spec.clauses:
        if c.relation is not None:
            a, b = (c.subject.color, c.subject.shape), (c.object.color, c.object.shape)
            stated |= {(a, c.relation, b), (b, _INVERSE[c.relation], a)}
    for r in pattern.get("relations", []):
        a, b = objs[r["subject"]], objs[r["object"]]
        if ((a["color"], a["shape"]), r["relation"], (b["color"], b["shape"])) not in stated:
            return False
    return True


class WorldJudge:
    """What the exact ShapesWorld judges (UReason's, RealUnify's) share: no model, and the world's
    ``WorldConfig`` ``cfg`` (``world.json``; default the built-in world)."""

    name = "exact"

    def __init__(self, cfg: WorldConfig | None = None):
        self.cfg = cfg or WorldConfig()

    @classmethod
    def from_world(cls, root: str | None):
        return cls(load_world(root).config if root else None)


class ShapesJudge(WorldJudge, Judge):
    """Exact checks for ShapesWorld prompts: needs ``target_scene`` on every instance.

    * image: ``check_criterion(target_scene, image, cfg)`` from :mod:`unicon.worlds.shapes_verify` (an image
      the parser refuses fails);
    * reasoning chain: :func:`refined_prompt_implies` on the extracted refined prompt.
    """

    judges_reasoning = True

    @staticmethod
    def _target(inst) -> dict:
        if inst.target_scene is None:
            raise UserError(f"{inst.source}: the exact judge needs 'target_scene' (a ShapesWorld prompt)")
        return inst.target_scene

    def judge_images(self, instances, images):
        if len(instances) != len(images):
            raise ValueError(f"{len(instances)} instances but {len(images)} images")
        out = []
        for inst, im in zip(instances, images):
            if im is None:
                out.append(Verdict("no_input", "no image was generated"))
                continue
            ok = bool(check_criterion(self._target(inst), im, self.cfg))
            out.append(Verdict("yes" if ok else "no", "check_criterion"))
        return out

    def judge_reasoning(self, instances, traces, refined_prompts):
        out = []
        for inst, refined in zip(instances, refined_prompts):
            if not refined:
                out.append(Verdict("no_input", "no refined prompt"))
                continue
            ok = refined_prompt_implies(refined, self._target(inst), self.cfg)
            out.append(Verdict("yes" if ok else "no", "refined_prompt_implies"))
        return out


def check_vlm_spec(spec: str, other: str) -> None:
    """Refuse a ``--judge`` that is not ``vlm:<existing local directory>`` (judges load from disk only,
    never the network); ``other`` names the suite's other choices in the message."""
    if not spec.startswith("vlm:"):
        raise UserError(f"--judge {spec!r}: use {other} or 'vlm:<local model directory>'")
    path = Path(spec[len("vlm:"):]).expanduser()
    if not path.is_dir():
        raise UserError(f"--judge {spec}: {path} is not a local model directory (judges load from disk only)")


def check_judge_spec(spec: str, chain: str | None = None) -> None:
    """Refuse a judge spec that names no local model, before anything loads (never the network)."""
    if spec != "exact":
        check_vlm_spec(spec, "'exact' (the ShapesWorld verifier)")
    if chain is not None and not Path(chain).expanduser().is_dir():
        raise UserError(f"--chain-judge {chain}: not a local model directory (judges load from disk only)")


def check_judge_fits(spec: "str | Judge", instances: Sequence[UReasonInstance]) -> None:
    """The exact judge needs ShapesWorld prompts; say so before any image is generated."""
    if spec == "exact":
        missing = [i.source for i in instances if i.target_scene is None]
        if missing:
            raise UserError(
                f"judge 'exact' needs ShapesWorld prompts with 'target_scene' ({len(missing)} rows lack it, "
                f"first {missing[0]}); judge real UReason data with --judge vlm:<model path>"
            )


def build_judge(spec: str, chain: str | None = None, world_root: str | None = None, **kw) -> Judge:
    """``spec``: ``exact`` (ShapesWorld) or ``vlm:<local directory>`` (VLM judge).

    ``chain``: optional causal-LM path for the reasoning-chain judge (``exact`` judges chains
    itself unless ``chain`` is given). ``world_root``: the ShapesWorld root whose ``world.json``
    configures the exact judge. ``kw``: the judge models' loading and generation settings
    (``device``, ``dtype``, ``trust_remote_code``, ``max_new_tokens``, ``batch_size`` of
    :meth:`VLMJudge.from_pretrained`).
    """
    check_judge_spec(spec, chain)
    if spec == "exact":
        image_judge: Judge = ShapesJudge.from_world(world_root)
    else:
        path = spec[len("vlm:") :] if spec.startswith("vlm:") else spec
        if not path:
            raise UserError("judge must be 'exact' or 'vlm:<model path>'")
        image_judge = VLMJudge.from_pretrained(path, **kw)
    chain_judge = ReasoningChainJudge.from_pretrained(chain, **kw) if chain else None
    if chain_judge is None:
        return image_judge
    return JudgePanel(image_judge, chain_judge)
