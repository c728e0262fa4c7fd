"""``OFAUnifiedModel``: the native OFA encoder-decoder behind the :class:`UnifiedModel` interface.

OFA (Wang et al., 2022) casts every task as sequence-to-sequence over one vocabulary
(see :mod:`unicon.models.ofa.tokenization`): the encoder reads ``[image patches, prompt]``
and the decoder writes text, location bins or image codes. This file owns the task
prompts, the collation of ragged candidate lists, likelihood scoring and generation;
the network itself is ``OFAModel`` (``modeling_ofa.py``).

Task prompts (OFA style)::

    caption    " what does the image describe?"
    vqa        " {question}"
    grounding  ' which region does the text " {expression} " describe?'   -> 4 bins (x0 y0 x1 y1)
    t2i        " what is the complete image? caption: {caption}"          -> h*w image codes

Scoring (CocoCon section 4.3). ``nll[b, k] = -(1/T_bk) * sum_t log p(y_t | y_<t, x)``,
``sum_nll[b, k] = -sum_t log p(y_t | y_<t, x)``:

* ``score_text``: the encoder runs once per example (image + prompt); its states are
  gathered for the K candidates and the decoder runs once over all ``sum_b K_b`` targets
  (``y`` = BPE tokens + eos).
* ``score_boxes`` / ``score_image``: the *inputs* differ per candidate, so the ``sum_b K_b``
  inputs go through one encoder call and the fixed target through one decoder call.
  Box targets are the 4 corner bins + eos over the full vocabulary (OFA's grounding loss).
  Image targets are the ``h*w`` codes with the softmax restricted to the code block, as
  in OFA's image-generation criterion (its ``constraint_range``); no eos, because the
  length is fixed. T2I inputs are text only: OFA feeds a dummy image whose patches are all
  masked, which gives the same encoder output for the text and adds only masked keys.

Generation: caption/answer (beam search; OFA defaults beam 5 + 3-gram blocking for real
checkpoints), reason (greedy, text-only source) and locate (4 tokens constrained to the bins) use
transformers' ``generate`` on ``OFAModel`` (KV cache, the encoder runs once, ``suppress_tokens``
for the constrained vocabularies). ``generate_image`` (h*w tokens constrained to the codes,
greedy/sampling/classifier-free guidance) is a short loop over ``OFAModel.decode`` because CFG
mixes the logits of two prompts at every step: the conditional and unconditional prompts are one
batch (one encoder call, one decoder KV cache), each step feeds only the newest code, and
transformers' logits processors (a CFG mix, temperature, top-k, top-p) shape the code-block logits
on the model's device (:meth:`OFAUnifiedModel._generate_image_codes`).
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
from PIL import Image
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)
from transformers.cache_utils import DynamicCache, EncoderDecoderCache

from unicon.core import ImageBatch, ImageTokenizer, build_image_tokenizer
from unicon.data.jsonl import read_json
from unicon.errors import UserError
from unicon.models.base import (
    Box,
    ImageGenerationConfig,
    Scores,
    TextGeneration,
    UnifiedModel,
    check_candidates,
    pil_to_tensor,
)
from unicon.models.ofa.configuration_ofa import OFA_PRESETS, preset_config
from unicon.models.ofa.modeling_ofa import OFAEncoderOutput, OFAModel
from unicon.models.ofa.tokenization import BOS_ID, EOS_ID, PAD_ID, OFATokenizer
from unicon.models.registry import register_backend

logger = logging.getLogger(__name__)

WRAPPER_CONFIG_NAME = "unicon_model.json"


@dataclass
class OFAWrapperConfig:
    """Settings of the wrapper (not of the network); saved as ``unicon_model.json``."""

    backend: str = "ofa"
    image_size: int = 64  # encoder image side (OFA: patch_image_size)
    max_source_length: int = 64  # prompt tokens incl. bos/eos
    max_target_length: int = 32  # target tokens incl. eos
    num_beams: int = 5
    no_repeat_ngram_size: int = 3
    max_new_tokens: int = 20
    length_penalty: float = 1.0
    caption_prompt: str = " what does the image describe?"
    grounding_prompt: str = ' which region does the text " {} " describe?'
    t2i_prompt: str = " what is the complete image? caption: {}"
    # image editing: the source image's patches, then this text around the instruction (edit_image)
    edit_prompt: str = " what is the edited image? instruction: {}"
    # {"type": "shapes", "world": <WorldConfig dict>} | {"type": "vqgan", "path": dir} | None
    image_tokenizer: dict[str, Any] | None = None
    # default ImageGenerationConfig fields of generate_image (None: greedy)
    image_generation: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.image_generation is not None:
            known = set(ImageGenerationConfig.__dataclass_fields__)
            unknown = sorted(set(self.image_generation) - known)
            if unknown:
                raise ValueError(f"image_generation: unknown setting(s) {unknown}; known: {sorted(known)}")

    @classmethod
    def from_dict(cls, d: dict) -> "OFAWrapperConfig":
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown OFA wrapper setting(s) {unknown}; known: {sorted(known)}")
        return cls(**d)


def world_image_tokenizer_spec(root: Path) -> dict[str, Any]:
    """The image tokenizer spec of the ShapesWorld world at ``root``: ``{"type": "shapes", "world": <its
    world.json config>}``, rebuilt by the builder ``unicon.worlds.shapes`` registers for type ``shapes``."""
    for name in OFAUnifiedModel.world_vocabulary_files:
        if not (root / name).is_file():
            raise UserError(f"{root}: no ShapesWorld {name} (build it: unicon build-data shapes --out {root})")
    info = read_json(root / "world.json", what="ShapesWorld world.json")
    if not isinstance(info, dict) or not isinstance(info.get("config"), dict):
        raise UserError(f"{root / 'world.json'}: not a ShapesWorld world.json (no 'config' object)")
    return {"type": "shapes", "world": info["config"]}


class ClassifierFreeGuidance(LogitsProcessor):
    """Classifier-free guidance over a doubled batch: ``l_u + s · (l_c − l_u)``.

    ``scores`` has ``2B`` rows, the ``B`` conditional rows first and their ``B`` unconditional
    partners after them; the result has ``B`` rows. transformers'
    ``ClassifierFreeGuidanceLogitsProcessor`` computes the same expression but refuses ``s <= 1``
    (this model accepts any ``s != 1``; ``s = 0`` samples the unconditional model), and
    ``UnbatchedClassifierFreeGuidanceLogitsProcessor`` runs a decoder-only model itself for the
    unconditional branch, which cannot pass OFA's encoder states or code mode.
    """

    def __init__(self, guidance_scale: float):
        self.guidance_scale = float(guidance_scale)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        if scores.shape[0] % 2:
            raise ValueError("classifier-free guidance needs conditional + unconditional rows, "
                             f"got {scores.shape[0]}")
        cond, uncond = scores.chunk(2)
        return uncond + self.guidance_scale * (cond - uncond)


def image_code_processors(cfg: ImageGenerationConfig) -> LogitsProcessorList:
    """What turns one step's code-block logits into the scores that are sampled or argmaxed:
    the CFG mix (``guidance_scale != 1``), then, when sampling, temperature, top-k and top-p
    (transformers' warpers, in the order ``generate`` applies them). Greedy decoding ignores the
    sampling options, as ``generate`` does."""
    procs: list[LogitsProcessor] = []
    if cfg.guidance_scale != 1.0:
        procs.append(ClassifierFreeGuidance(cfg.guidance_scale))
    if cfg.do_sample:
        if cfg.temperature != 1.0:
            procs.append(TemperatureLogitsWarper(float(cfg.temperature)))  # refuses temperature <= 0
        if cfg.top_k > 0:
            procs.append(TopKLogitsWarper(int(cfg.top_k)))
        if cfg.top_p < 1.0:
            procs.append(TopPLogitsWarper(float(cfg.top_p)))
    return LogitsProcessorList(procs)


@register_backend("ofa")
class OFAUnifiedModel(UnifiedModel):
    """OFA as a :class:`UnifiedModel`. ``self.ofa`` is the ``OFAModel`` network."""

    #: the files of a world directory a from-scratch model's vocabulary is read from
    world_vocabulary_files = ("tokenizer.json", "world.json")
    supports_editing = True

    def __init__(self, ofa: torch.nn.Module, tokenizer: OFATokenizer, settings: OFAWrapperConfig | None = None,
                 image_tokenizer: ImageTokenizer | None = None):
        super().__init__()
        self.ofa = ofa
        self.tokenizer = tokenizer
        self.settings = settings or OFAWrapperConfig()
        self.image_tokenizer = image_tokenizer
        positions = getattr(ofa.config, "max_position_embeddings", None)
        for name in ("max_source_length", "max_target_length"):
            if positions is not None and getattr(self.settings, name) > positions:
                raise ValueError(f"{name}={getattr(self.settings, name)} exceeds the network's "
                                 f"max_position_embeddings={positions}")
        vocab = getattr(ofa.config, "vocab_size", None)
        if vocab is not None and vocab < len(tokenizer):
            raise ValueError(f"model vocab_size {vocab} < tokenizer size {len(tokenizer)} (text+codes+bins)")
        if image_tokenizer is not None and image_tokenizer.codebook_size > tokenizer.num_codes:
            raise ValueError(
                f"image tokenizer has {image_tokenizer.codebook_size} codes but the vocabulary only "
                f"{tokenizer.num_codes} <code_i> tokens")

    @classmethod
    def from_config(cls, model_cfg: dict[str, Any], world_root: str | Path | None = None) -> "OFAUnifiedModel":
        """The model of an OFA ``model:`` section (see :mod:`unicon.models`): ``pretrained`` loaded,
        or ``preset`` + ``arch`` at random init with the vocabulary of the world at ``world_root``."""
        arch = dict(model_cfg.get("arch") or {})
        wrapper_keys = set(OFAWrapperConfig.__dataclass_fields__) - {"image_tokenizer", "backend"}
        settings = {k: arch.pop(k) for k in list(arch) if k in wrapper_keys}
        num_bins = arch.pop("num_bins", None)

        if model_cfg.get("pretrained"):
            if arch or num_bins is not None:
                raise UserError(f"model.arch keys {sorted(arch) + (['num_bins'] if num_bins else [])} cannot change "
                                f"the architecture of the pretrained model {model_cfg['pretrained']}")
            return cls.from_pretrained(model_cfg["pretrained"], settings=settings,
                                       allow_pickle=model_cfg.get("allow_pickle", False))

        preset = model_cfg.get("preset")
        if preset is None:
            raise UserError("model.preset is required for backend 'ofa' without model.pretrained "
                            f"(one of {sorted(OFA_PRESETS)})")
        if preset not in OFA_PRESETS:
            raise UserError(f"model.preset {preset!r} is unknown; choose one of {sorted(OFA_PRESETS)}")
        if world_root is None:
            raise UserError(f"model preset {preset!r} from scratch needs a world (data.root) for its vocabulary")
        root = Path(world_root)
        image_tokenizer_spec = world_image_tokenizer_spec(root)
        image_tokenizer = build_image_tokenizer(image_tokenizer_spec)
        tokenizer = OFATokenizer.from_file(root / "tokenizer.json", image_tokenizer.codebook_size, num_bins or 1000,
                                           max_length=max(settings.get("max_target_length", 128) + 1, 128))
        try:
            config = preset_config(preset, **arch, vocab_size=len(tokenizer))
        except (TypeError, ValueError) as e:
            raise UserError(f"model.arch: {e}") from None
        image_size = settings.pop("image_size", None) or config.patch_image_size or 64
        grid = image_tokenizer.grid_size[0]
        if config.code_image_size // 8 != grid:
            raise UserError(f"model.arch.code_image_size {config.code_image_size} gives a {config.code_image_size // 8}"
                            f"-wide decoder code grid, but the world's image tokenizer is {grid}x{grid}")
        wrapper = OFAWrapperConfig.from_dict({**settings, "image_size": image_size,
                                              "image_tokenizer": image_tokenizer_spec})
        return cls(OFAModel(config), tokenizer, wrapper, image_tokenizer)

    @property
    def caption_prompt(self) -> str:
        return self.settings.caption_prompt

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @property
    def image_generation_config(self) -> ImageGenerationConfig:
        return ImageGenerationConfig(**(self.settings.image_generation or {}))

    # ======================================================================================
    # inputs
    # ======================================================================================
    def prepare_images(self, images: ImageBatch) -> torch.Tensor:
        """PIL -> RGB, resized to ``image_size`` (bicubic, as OFA), normalised with mean/std 0.5."""
        s = self.settings.image_size
        if isinstance(images, torch.Tensor):
            if images.dim() != 4 or images.shape[1] != 3 or tuple(images.shape[2:]) != (s, s):
                raise ValueError(f"image tensor must be [B, 3, {s}, {s}] from prepare_images, "
                                 f"got {tuple(images.shape)}")
            return images.to(self.device, torch.float32)
        if isinstance(images, (str, bytes)) or not isinstance(images, Sequence):
            raise ValueError(f"images must be a list of PIL images or a tensor, got {type(images).__name__}")
        resized = []
        for i, im in enumerate(images):
            if not isinstance(im, Image.Image):
                raise ValueError(f"image {i} is a {type(im).__name__}, expected a PIL image")
            im = im.convert("RGB")
            if im.size != (s, s):
                im = im.resize((s, s), Image.BICUBIC)
            resized.append(im)
        x = pil_to_tensor(resized) if resized else torch.zeros(0, 3, s, s)
        return ((x - 0.5) / 0.5).to(self.device)

    @staticmethod
    def _image_sizes(images: ImageBatch, size: int) -> list[tuple[int, int]]:
        if isinstance(images, torch.Tensor):
            return [(size, size)] * images.shape[0]
        return [im.size for im in images]

    def _pad(self, rows: list[list[int]], value: int = PAD_ID) -> torch.Tensor:
        width = max(len(r) for r in rows)
        return torch.tensor([list(r) + [value] * (width - len(r)) for r in rows], dtype=torch.long,
                            device=self.device)

    def _source_ids(self, texts: Sequence[str]) -> torch.Tensor:
        """Encoder text rows. Every prompt starts with one space, as OFA formats them (``" {question}"``),
        so that a caller's question and the model's own VQA prompt give the same BPE tokens."""
        rows = []
        for i, t in enumerate(texts):
            t = " " + t.lstrip()
            ids, truncated = self.tokenizer.encode_text(t, self.settings.max_source_length)
            if truncated:
                logger.warning("prompt %d truncated to %d tokens: %.60r", i, self.settings.max_source_length, t)
            rows.append(ids)
        return self._pad(rows)

    # ---- the network: encoder once, decoder over many targets --------------------------------
    def encode(self, input_ids: torch.Tensor, patch_images: torch.Tensor | None = None):
        """Encoder states for ``[image patches, text]`` (text only when ``patch_images`` is None)."""
        patch_masks = None
        if patch_images is not None:
            patch_masks = torch.ones(patch_images.shape[0], dtype=torch.bool, device=patch_images.device)
        return self.ofa.encode(input_ids=input_ids, patch_images=patch_images, patch_masks=patch_masks)

    def decode(self, decoder_input_ids: torch.Tensor, encoder_out, code_mode: bool = False,
               past_key_values: EncoderDecoderCache | None = None) -> torch.Tensor:
        """Decoder logits ``[N, T, V]`` for ``decoder_input_ids`` against ``encoder_out``; with
        ``past_key_values`` the ids are the positions after the cached ones, and the cache grows."""
        code_masks = None
        if code_mode:
            code_masks = torch.ones(decoder_input_ids.shape[0], dtype=torch.bool, device=decoder_input_ids.device)
        return self.ofa.decode(decoder_input_ids=decoder_input_ids, encoder_outputs=encoder_out,
                               code_masks=code_masks, past_key_values=past_key_values)

    @staticmethod
    def select(encoder_out, index: torch.Tensor):
        """Rows ``index`` of an ``OFAEncoderOutput``: K candidates share one encoding without recomputing it."""
        return encoder_out.index_select(index.to(encoder_out.last_hidden_state.device))

    def _target_nll(self, encoder_out, targets: list[list[int]], code_mode: bool = False,
                    index: torch.Tensor | None = None):
        """Summed NLL ``-sum_t log p(target_t | bos, target_<t, source)`` and length of each target row
        (decoder input = bos + target[:-1]).

        ``index`` (optional, ``[len(targets)]``): target row ``r`` is decoded against encoder row
        ``index[r]``. The part shared by the rows of one encoder row then runs once per encoder row:
        the decoder's first step (bos) fills an ``EncoderDecoderCache`` whose cross-attention keys and
        values (the encoder states projected in every layer) and bos self-attention entry are copied
        to the rows; one cached pass over all rows runs ``target[:-1]``. Same sums as the uncached
        pass within float rounding (other matrix shapes). Without ``index``, or with gradient
        checkpointing in training (no cache), ``encoder_out`` is expanded to the rows and run in full."""
        cached = index is not None and len(targets) > int(index.numel() and index.max()) + 1
        if index is not None and not cached or (self.ofa.decoder.gradient_checkpointing and self.training):
            encoder_out = self.select(encoder_out, index) if index is not None else encoder_out
            cached = False
        if cached:
            index = index.to(self.device)
            cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
            bos = torch.full((encoder_out.last_hidden_state.shape[0], 1), BOS_ID, dtype=torch.long,
                             device=self.device)
            first = self.decode(bos, encoder_out, code_mode=code_mode, past_key_values=cache)
            cache.batch_select_indices(index)
            rows = OFAEncoderOutput(encoder_out.last_hidden_state, encoder_out.padding_mask[index],
                                    encoder_out.position_embedding[index])
            rest = self.decode(self._pad([t[:-1] or [PAD_ID] for t in targets]), rows, code_mode=code_mode,
                               past_key_values=cache)
            logits = torch.cat([first[index], rest], dim=1).float()
            labels = self._pad([t + [-100] for t in targets], value=-100)[:, : logits.shape[1]]
        else:
            dec_in = self._pad([[BOS_ID] + t[:-1] for t in targets])
            labels = self._pad(targets, value=-100)
            logits = self.decode(dec_in, encoder_out, code_mode=code_mode).float()
        if code_mode:  # softmax over the code block only (OFA's constraint range)
            lo = self.tokenizer.code_offset
            logits = logits[..., lo: lo + self.tokenizer.num_codes]
            labels = torch.where(labels >= 0, labels - lo, labels)
        logp = logits.log_softmax(-1)
        valid = labels >= 0
        tok = logp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        sum_nll = -(tok * valid).sum(-1)
        return sum_nll, valid.sum(-1)

    @staticmethod
    def _to_scores(sum_nll: torch.Tensor, lengths: torch.Tensor, counts: list[int], truncated: int) -> Scores:
        B, K = len(counts), max(counts)
        mask = torch.zeros(B, K, dtype=torch.bool)
        for b, k in enumerate(counts):
            mask[b, :k] = True
        mask = mask.to(sum_nll.device)
        flat = mask.flatten().nonzero().squeeze(1)
        total = sum_nll.new_zeros(B * K).index_put((flat,), sum_nll).view(B, K)
        num = lengths.new_zeros(B * K).index_put((flat,), lengths).view(B, K)
        nll = total / num.clamp(min=1)
        if truncated:
            logger.warning("%d candidate(s) longer than the maximum target length were truncated", truncated)
        return Scores(nll=nll, sum_nll=total, mask=mask, num_tokens=num, num_truncated=truncated)

    def _text_targets(self, candidates: Sequence[Sequence[str]]) -> tuple[list[list[int]], int]:
        targets, truncated = [], 0
        for cands in candidates:
            for c in cands:
                ids, cut = self.tokenizer.encode_text(c, self.settings.max_target_length + 1)
                targets.append(ids[1:])  # drop bos: target = bpe + eos
                truncated += int(cut)
        return targets, truncated

    # ======================================================================================
    # likelihood scoring
    # ======================================================================================
    def score_text(self, images: ImageBatch | None, prompts: Sequence[str],
                   candidates: Sequence[Sequence[str]]) -> Scores:
        B = len(candidates)
        if len(prompts) != B or (images is not None and len(images) != B):
            n_images = "no" if images is None else len(images)
            raise ValueError(f"got {n_images} images, {len(prompts)} prompts, {B} candidate lists")
        check_candidates(candidates)
        counts = [len(c) for c in candidates]
        pixels = None if images is None else self.prepare_images(images)  # None: reason()'s text-only source
        enc = self.encode(self._source_ids(prompts), pixels)
        index = torch.repeat_interleave(torch.arange(B), torch.tensor(counts))
        targets, truncated = self._text_targets(candidates)
        sum_nll, lengths = self._target_nll(enc, targets, index=index)
        return self._to_scores(sum_nll, lengths, counts, truncated)

    def score_boxes(self, images: ImageBatch, expressions: Sequence[Sequence[str]],
                    boxes: Sequence[Box]) -> Scores:
        B = len(expressions)
        if len(boxes) != B or len(images) != B:
            raise ValueError(f"got {len(images)} images, {len(expressions)} expression lists, {len(boxes)} boxes")
        check_candidates(expressions, "expressions")
        counts = [len(e) for e in expressions]
        sizes = self._image_sizes(images, self.settings.image_size)
        pixels = self.prepare_images(images)
        index = torch.repeat_interleave(torch.arange(B), torch.tensor(counts))
        prompts = [self.settings.grounding_prompt.format(e) for ex in expressions for e in ex]
        enc = self.encode(self._source_ids(prompts), pixels.index_select(0, index.to(pixels.device)))
        targets = []
        for b, box in enumerate(boxes):
            ids = self.tokenizer.box_to_ids(box, *sizes[b]) + [EOS_ID]
            targets += [ids] * counts[b]
        sum_nll, lengths = self._target_nll(enc, targets)
        return self._to_scores(sum_nll, lengths, counts, 0)

    def image_codes(self, images: ImageBatch) -> torch.Tensor:
        """``[B, h*w]`` code indices of images (PIL, or tensors from ``prepare_images``)."""
        if self.image_tokenizer is None:
            raise ValueError("this OFA model has no image tokenizer; text-to-image is unavailable")
        if isinstance(images, torch.Tensor):
            images = images * 0.5 + 0.5  # undo prepare_images' normalisation: [0, 1] pixels
        with torch.no_grad():
            codes = self.image_tokenizer.encode(images)
        return codes.flatten(1)

    def score_image(self, prompts: Sequence[Sequence[str]], images: ImageBatch,
                    contexts: Sequence[str] | None = None) -> Scores:
        B = len(prompts)
        if len(images) != B:
            raise ValueError(f"got {B} prompt lists but {len(images)} images")
        if contexts is not None and len(contexts) != B:
            raise ValueError(f"got {B} prompt lists but {len(contexts)} contexts")
        check_candidates(prompts, "prompts")
        counts = [len(p) for p in prompts]
        codes = self.image_codes(images)
        if contexts is None:
            texts = [self.settings.t2i_prompt.format(p) for ps in prompts for p in ps]
        else:
            texts = [self._t2i_text(p, contexts[b]) for b, ps in enumerate(prompts) for p in ps]
        enc = self.encode(self._source_ids(texts))
        targets = []
        for b in range(B):
            targets += [self.tokenizer.codes_to_ids(codes[b]).tolist()] * counts[b]
        sum_nll, lengths = self._target_nll(enc, targets, code_mode=True)
        return self._to_scores(sum_nll, lengths, counts, 0)

    # ======================================================================================
    # generation
    # ======================================================================================
    def _token_mask(self, allowed: str) -> torch.Tensor:
        """Bool ``[V]`` of the tokens a constrained decode may emit ('text' | 'bins' | 'codes')."""
        V = self.ofa.config.vocab_size
        mask = torch.zeros(V, dtype=torch.bool, device=self.device)
        tok = self.tokenizer
        if allowed == "text":
            mask[: tok.num_text] = True
            mask[[BOS_ID, PAD_ID]] = False
        elif allowed == "bins":
            mask[tok.bin_offset: tok.bin_offset + tok.num_bins] = True
        elif allowed == "codes":
            mask[tok.code_offset: tok.code_offset + tok.num_codes] = True
        else:
            raise ValueError(allowed)
        return mask

    def _suppressed(self, allowed: str) -> list[int]:
        """Token ids a constrained decode must not emit (for ``generate(suppress_tokens=...)``)."""
        mask = self._token_mask(allowed)
        if allowed == "text":
            mask[EOS_ID] = True
        return (~mask).nonzero().flatten().tolist()

    def _generate(self, images: ImageBatch | None, prompts: Sequence[str], allowed: str = "text",
                  **kw) -> tuple[list[list[int]], list[bool]]:
        """transformers' ``generate`` (beam search with the decoder's KV cache; the encoder runs
        once) restricted to ``allowed`` tokens. Returns the token ids after the start token, up to
        eos, and whether each row ran out of ``max_new_tokens`` without an eos."""
        pixels = None if images is None else self.prepare_images(images)
        input_ids = self._source_ids(prompts)
        patch_masks = None
        if pixels is not None:
            patch_masks = torch.ones(pixels.shape[0], dtype=torch.bool, device=pixels.device)
        opts = dict(num_beams=self.settings.num_beams, max_new_tokens=self.settings.max_new_tokens,
                    no_repeat_ngram_size=self.settings.no_repeat_ngram_size,
                    length_penalty=self.settings.length_penalty, min_new_tokens=1)
        unknown = set(kw) - set(opts)
        if unknown:
            raise ValueError(f"unknown generation option(s) {sorted(unknown)}; known: {sorted(opts)}")
        opts.update(kw)
        out = self.ofa.generate(
            input_ids=input_ids, patch_images=pixels, patch_masks=patch_masks,
            suppress_tokens=self._suppressed(allowed), do_sample=False,
            pad_token_id=PAD_ID, eos_token_id=EOS_ID, decoder_start_token_id=BOS_ID, **opts,
        )
        ids, truncated = [], []
        for row in out[:, 1:].tolist():
            ended = EOS_ID in row
            row = row[: row.index(EOS_ID)] if ended else row
            ids.append([t for t in row if t != PAD_ID])
            truncated.append(not ended and allowed == "text")
        return ids, truncated

    def _generate_text(self, images: ImageBatch | None, prompts: Sequence[str], **kw) -> tuple[list[str], list]:
        ids, truncated = self._generate(images, prompts, "text", **kw)
        return [self.tokenizer.decode(t) for t in ids], list(zip(ids, truncated))

    @torch.no_grad()
    def caption(self, images: ImageBatch, prompt: str | None = None, **generate_kwargs) -> list[str]:
        prompts = [prompt or self.settings.caption_prompt] * len(images)
        return self._generate_text(images, prompts, **generate_kwargs)[0]

    @torch.no_grad()
    def answer(self, images: ImageBatch, questions: Sequence[str], **generate_kwargs) -> list[str]:
        if len(questions) != len(images):
            raise ValueError(f"got {len(images)} images but {len(questions)} questions")
        return self._generate_text(images, [" " + q.strip() for q in questions], **generate_kwargs)[0]

    @torch.no_grad()
    def locate(self, images: ImageBatch, expressions: Sequence[str]) -> torch.Tensor:
        if len(expressions) != len(images):
            raise ValueError(f"got {len(images)} images but {len(expressions)} expressions")
        sizes = self._image_sizes(images, self.settings.image_size)
        prompts = [self.settings.grounding_prompt.format(e) for e in expressions]
        ids, _ = self._generate(images, prompts, "bins", min_new_tokens=4, max_new_tokens=4,
                                no_repeat_ngram_size=0)
        return torch.tensor([self.tokenizer.ids_to_box(t, *sizes[b]) for b, t in enumerate(ids)])

    @torch.no_grad()
    def edit_image(self, images: ImageBatch, instructions: Sequence[str],
                   config: ImageGenerationConfig | None = None) -> list[Image.Image]:
        """Image + instruction -> image: the encoder reads the source image's patches and
        ``edit_prompt`` around the instruction; the decoder writes the edited image's codes exactly as
        :meth:`generate_image` writes a generated one (same sampling recipe, KV cache and seed). With
        guidance ``s != 1`` the unconditional rows keep the source image and drop the instruction:
        ``l_u(image) + s (l_c(image, instruction) - l_u(image))``."""
        if self.image_tokenizer is None:
            raise ValueError("this OFA model has no image tokenizer; image editing is unavailable")
        if len(images) != len(instructions):
            raise ValueError(f"got {len(images)} images but {len(instructions)} instructions")
        cfg = config or self.image_generation_config
        if cfg.num_candidates != 1:
            raise ValueError("edit_image draws one image per instruction (num_candidates=1)")
        texts = [self.settings.edit_prompt.format(t.strip()) for t in instructions]
        h, w = self.image_tokenizer.grid_size
        codes, _ = self._generate_image_codes(texts, cfg, h * w, self.image_tokenizer.codebook_size,
                                              patch_images=self.prepare_images(images),
                                              unconditional=self.settings.edit_prompt.format(""))
        return self.image_tokenizer.decode_to_pil(codes.view(len(texts), h, w).cpu())

    def score_edit(self, images: ImageBatch, instructions: Sequence[str], targets: ImageBatch) -> Scores:
        """``[B, 1]`` NLL of each target image's codes given the source image and the instruction,
        in :meth:`edit_image`'s input format (the training loss of edit rows)."""
        B = len(instructions)
        if len(images) != B or len(targets) != B:
            raise ValueError(f"got {len(images)} images, {B} instructions and {len(targets)} target images")
        if self.image_tokenizer is None:
            raise ValueError("this OFA model has no image tokenizer; image editing is unavailable")
        codes = self.image_codes(targets)
        texts = [self.settings.edit_prompt.format(t.strip()) for t in instructions]
        enc = self.encode(self._source_ids(texts), self.prepare_images(images))
        rows = [self.tokenizer.codes_to_ids(codes[b]).tolist() for b in range(B)]
        sum_nll, lengths = self._target_nll(enc, rows, code_mode=True)
        return self._to_scores(sum_nll, lengths, [1] * B, 0)

    # ---- EditingScore embeddings (UnifiedModel.image_latents / embed_image / embed_text) ----------
    @torch.no_grad()
    def _patch_states(self, images: ImageBatch) -> torch.Tensor:
        """``[B, P, D]`` encoder states at the image-patch positions of ``[patches, " "]`` (no task prompt)."""
        pixels = self.prepare_images(images)
        ids = self._source_ids([""] * pixels.shape[0])
        states = self.encode(ids, pixels).last_hidden_state
        return states[:, : states.shape[1] - ids.shape[1]].float()

    def image_latents(self, images: ImageBatch) -> torch.Tensor:
        """The encoder's output at the image-patch positions (the image read with an empty prompt),
        **flattened** over the patch grid: ``[B, P * D]`` (P patches, D = ``d_model``); the spatial
        layout is kept, so a moved or recoloured object changes the latent where it is."""
        return self._patch_states(images).flatten(1)

    def embed_image(self, images: ImageBatch) -> torch.Tensor:
        """The same patch states **mean-pooled** over the patches: ``[B, D]``, in the encoder's hidden space."""
        return self._patch_states(images).mean(1)

    @torch.no_grad()
    def embed_text(self, texts: Sequence[str]) -> torch.Tensor:
        """The encoder's output for the text alone (as written, OFA's leading space added), mean-pooled
        over its non-pad tokens (bos and eos included): ``[B, D]``, the space of :meth:`embed_image`."""
        ids = self._source_ids(list(texts))
        out = self.encode(ids)
        keep = (~out.padding_mask).unsqueeze(-1).float()
        return (out.last_hidden_state.float() * keep).sum(1) / keep.sum(1)

    def generate_image(self, prompts: Sequence[str], context: Sequence[str] | None = None,
                       config: ImageGenerationConfig | None = None) -> list[Image.Image]:
        """Code-by-code decoding (greedy, or sampling with temperature/top-k/top-p), with
        classifier-free guidance ``l_u + s (l_c - l_u)`` against the empty prompt when s != 1.
        The decoder keeps a KV cache (see :meth:`_generate_image_codes`)."""
        if self.image_tokenizer is None:
            raise ValueError("this OFA model has no image tokenizer; text-to-image is unavailable")
        cfg = config or self.image_generation_config
        if context is not None and len(context) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(context)} contexts")
        if cfg.num_candidates != 1:
            return self.best_of_candidates(prompts, context, cfg)
        texts = [self._t2i_text(p, None if context is None else context[i]) for i, p in enumerate(prompts)]
        h, w = self.image_tokenizer.grid_size
        codes, _ = self._generate_image_codes(texts, cfg, h * w, self.image_tokenizer.codebook_size)
        return self.image_tokenizer.decode_to_pil(codes.view(len(texts), h, w).cpu())

    @torch.no_grad()
    def _generate_image_codes(self, texts: Sequence[str], cfg: ImageGenerationConfig, num_steps: int,
                              codebook_size: int, use_cache: bool = True, keep_logits: bool = False,
                              patch_images: torch.Tensor | None = None,
                              unconditional: str | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The first ``num_steps`` image codes (row-major over the code grid) for the t2i source
        ``texts`` (after ``patch_images``' patches when given: an edit's source image; the guidance
        rows then keep the image, with ``unconditional`` as their text): ``[B, num_steps]`` indices in ``[0, codebook_size)``, and, with ``keep_logits``,
        each step's raw code-block logits ``[R, codebook_size]`` (``R = 2B`` with guidance: the
        conditional rows, then the unconditional ones; before any logits processor).

        With guidance the unconditional source (the t2i template around an empty caption) is
        appended to the batch: the ``2B`` rows share one encoder call and one decoder pass per step.

        ``use_cache=True`` (what :meth:`generate_image` runs): the encoder runs once; the decoder
        runs once per code on the newest token only, against an ``EncoderDecoderCache`` holding,
        per layer, the self-attention keys/values of the tokens decoded so far and the
        cross-attention keys/values of the encoder states (computed at the first step), and, for
        the whole decoder, the projected keys of its absolute position bias for the positions
        decoded so far (modeling_ofa ``_self_position_keys``), so that a step costs the same at
        the end of the grid as at its start, up to attention over a longer cache. The result
        equals the full recompute (``use_cache=False``: the whole prefix through the decoder at
        every step) up to float rounding because nothing a cached entry depends on changes later:
        the decoder is causal (the states at position ``t`` depend only on tokens ``<= t``), and in
        code mode every position-dependent term is a function of the absolute position ``t``
        alone, which the decoder derives from the cache length: the absolute position embedding
        of image-grid cell ``t`` added to the token embedding, the absolute self/cross position
        bias of query ``t`` and the relative image bias between ``t`` and each cached position.

        Both paths consume the sampling generator identically (one draw per step), so the same
        seed gives the same codes; ``tests/test_ofa_generation.py`` checks codes and per-step
        logits. Logits, processors and sampling stay on the model's device (the generator lives
        there too; without ``cfg.seed`` it starts from torch's fixed default seed, so unseeded
        generation is reproducible as well). Codes are restricted to the first ``codebook_size``
        image codes by slicing the logits before any processor, as OFA's ``constraint_range``.
        """
        B = len(texts)
        guided = cfg.guidance_scale != 1.0
        blank = self.settings.t2i_prompt.format("") if unconditional is None else unconditional
        rows = list(texts) + ([blank] * B if guided else [])
        if patch_images is not None and guided:
            patch_images = torch.cat([patch_images, patch_images])
        processors = image_code_processors(cfg)
        gen = torch.Generator(device=self.device)
        if cfg.seed is not None:
            gen.manual_seed(cfg.seed)
        lo = self.tokenizer.code_offset
        enc = self.encode(self._source_ids(rows), patch_images)
        seqs = torch.full((len(rows), 1), BOS_ID, dtype=torch.long, device=self.device)
        cache = EncoderDecoderCache(DynamicCache(), DynamicCache()) if use_cache else None
        kept: list[torch.Tensor] = []
        for _ in range(num_steps):
            if use_cache:
                logits = self.decode(seqs[:, -1:], enc, code_mode=True, past_key_values=cache)
            else:
                logits = self.decode(seqs, enc, code_mode=True)
            logits = logits[:, -1, lo: lo + codebook_size].float()
            if keep_logits:
                kept.append(logits)
            scores = processors(seqs[:B], logits)
            if cfg.do_sample:
                code = torch.multinomial(scores.softmax(-1), 1, generator=gen).squeeze(1)
            else:
                code = scores.argmax(-1)
            code = (code.repeat(2) if guided else code) + lo  # both halves continue with the guided code
            seqs = torch.cat([seqs, code.unsqueeze(1)], dim=1)
        return seqs[:B, 1:] - lo, kept

    def _t2i_text(self, prompt: str, context: str | None = None) -> str:
        """T2I source text: the prompt, then the context (UReason's [P, R]), in the t2i template."""
        text = prompt.strip() if not context else f"{prompt.strip()} {context.strip()}"
        return self.settings.t2i_prompt.format(text)

    def fit_context(self, prompts: Sequence[str], contexts: Sequence[str]) -> tuple[list[str], list[int]]:
        if len(prompts) != len(contexts):
            raise ValueError(f"got {len(prompts)} prompts but {len(contexts)} contexts")
        limit = self.settings.max_source_length
        kept, cut = [], []
        for p, c in zip(prompts, contexts):
            words = c.split()
            n = 0
            while n < len(words):  # the encoder text gets one leading space (_source_ids)
                ids, over = self.tokenizer.encode_text(" " + self._t2i_text(p, " ".join(words[n:])).lstrip(), limit)
                if not over:
                    break
                n += 1
            kept.append(" ".join(words[n:]))
            cut.append(n)
        return kept, cut

    @torch.no_grad()
    def reason(self, prompts: Sequence[str], max_new_tokens: int = 256) -> list[TextGeneration]:
        """Free text from a text-only input (greedy; OFA is encoder-decoder, so the prompt is the source).

        ``max_new_tokens`` is capped by the decoder's learned positions (``max_position_embeddings``
        minus the start token); a trace that reaches the cap is marked truncated."""
        limit = int(self.ofa.config.max_position_embeddings) - 1
        if max_new_tokens > limit:
            logger.info("reason: max_new_tokens %d capped at the decoder's %d positions", max_new_tokens, limit)
        _, raw = self._generate_text(None, prompts, num_beams=1, max_new_tokens=min(max_new_tokens, limit),
                                     no_repeat_ngram_size=0)
        return [TextGeneration(text=self.tokenizer.decode(ids), truncated=cut, num_tokens=len(ids))
                for ids, cut in raw]

    # ======================================================================================
    # persistence
    # ======================================================================================
    def save_pretrained(self, path: str) -> None:
        """OFA config + weights (``OFAModel.save_pretrained``), tokenizer files and ``unicon_model.json``."""
        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        self.ofa.save_pretrained(str(out))
        self.tokenizer.save_pretrained(out)
        (out / WRAPPER_CONFIG_NAME).write_text(json.dumps(asdict(self.settings), indent=2) + "\n")

    @classmethod
    def from_pretrained(cls, path: str, **kwargs) -> "OFAUnifiedModel":
        """Restore :meth:`save_pretrained`'s directory. ``kwargs`` go to ``OFAModel.from_pretrained``
        (e.g. ``allow_pickle``), except ``settings`` (a dict of wrapper overrides)."""
        src = Path(path)
        if not src.is_dir():
            raise FileNotFoundError(f"no model directory {src}")
        overrides = kwargs.pop("settings", None) or {}
        ofa = OFAModel.from_pretrained(str(src), **kwargs)
        if (src / WRAPPER_CONFIG_NAME).is_file():
            settings = json.loads((src / WRAPPER_CONFIG_NAME).read_text())
        else:  # an OFA-Sys checkpoint: OFA's own inference defaults (caption: beam 5, 3-gram block, 16 tokens)
            settings = {"image_size": getattr(ofa.config, "patch_image_size", None) or 480,
                        "max_source_length": 128, "max_target_length": 64, "max_new_tokens": 16}
        settings = OFAWrapperConfig.from_dict({**settings, **overrides})
        try:
            tokenizer = OFATokenizer.from_pretrained(src)
        except FileNotFoundError:
            logger.warning("%s has no tokenizer files; using a byte-level vocabulary of %d entries "
                           "(text bytes, then location bins)", src, ofa.config.vocab_size)
            tokenizer = OFATokenizer.byte_level(ofa.config.vocab_size)
        image_tokenizer = build_image_tokenizer(settings.image_tokenizer) if settings.image_tokenizer else None
        return cls(ofa, tokenizer, settings, image_tokenizer)
