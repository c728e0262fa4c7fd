"""Janus / Janus-Pro (DeepSeek) behind the :class:`~unicon.models.base.UnifiedModel` interface.

The network is transformers' native ``JanusForConditionalGeneration``: a SigLIP encoder + aligner
for understanding, a VQ-VAE (``model.vqmodel``) with its own embeddings/aligner/head for
generation, and one Llama language model shared by both directions. This file adds the scoring
and generation API that consistency training and the CocoCon / drift / UReason evaluations use.

Prompts follow the checkpoint's chat template (``processor.chat_template``)::

    [system prompt]<|User|>: <image_placeholder>\\n{question}\\n\\n<|Assistant|>: {answer}<eos>

``<image_placeholder>`` is expanded to ``<begin_of_image> + N x <image_placeholder> +
<end_of_image>`` exactly like ``JanusProcessor`` does (N = ``vision_config.num_image_tokens``), and
the default system prompt is prepended to understanding prompts when
``processor.use_default_system_prompt`` is set (also as in ``JanusProcessor``). Image generation
prompts are ``<|User|>: {prompt}\\n\\n<|Assistant|>:<begin_of_image>`` (no system prompt).

Scores (all negative log-likelihoods, see ``base.py``)
------------------------------------------------------
* ``score_text`` -- NLL of ``" " + candidate + <eos>`` after ``<|Assistant|>:``. The candidate is
  tokenised on its own (``add_special_tokens=False``), which is what ``generate`` would have to
  produce after the prompt. The image is encoded once per example and the shared prefix
  (system prompt, user tag, image tokens and the question up to ``<|Assistant|>:``) is run once;
  its KV cache is copied to the K candidates, which run as one batch over it.
* ``score_boxes`` -- Janus is **not trained for grounding**. The box is written as text,
  ``"[x1, y1, x2, y2]"`` with integer coordinates normalised to 0..1000 of the original image's
  width/height (the Qwen-VL/DeepSeek-VL2 convention), and scored like an answer to
  :data:`GROUNDING_PROMPT`. The score is well defined (a likelihood of a string) but its values
  for a pretrained Janus carry little signal until the model is fine-tuned on grounding.
* ``score_image`` -- NLL of the gold image's VQ codes: ``vqmodel.encode(pixels).image_tokens``
  (row-major ``[B, h*w]``), prompt ending in ``<begin_of_image>`` embedded with the text
  embeddings, codes embedded with ``prepare_embeddings_for_image_generation``, one LM pass over
  the concatenation, ``generation_head`` on the hidden states at positions BOI ... last-1, then
  log-softmax + gather. This is the *conditional* model (no classifier-free guidance), i.e. the
  distribution ``generate(generation_mode="image")`` samples from when ``guidance_scale == 1``;
  ``tests/test_janus.py`` checks it against the logits of that loop.

Several images per question
---------------------------
``answer_images(images, questions)`` (``supports_multi_image``) writes the row's images one after the
other in the user turn, as the chat template lays out a list of image items, then the question::

    [system prompt]<|User|>: <image 1>\n<image 2>\n{question}\n\n<|Assistant|>:

each ``<image k>`` expanded as above; the images' SigLIP + aligner features fill the placeholders in
order (row by row, image by image), exactly as ``JanusProcessor`` with a list of images does. With one
image it is ``answer``'s prompt.

Image editing
-------------
``edit_image(images, instructions)`` prompts with the understanding layout above, the instruction as
the question, and opens the assistant turn with ``<begin_of_image>``::

    [system prompt]<|User|>: <begin_of_image><image_placeholder>*N<end_of_image>\n{instruction}\n\n<|Assistant|>:<begin_of_image>

(the source image enters through SigLIP + the understanding aligner, as in ``score_text``); the edited
image's codes come out of the generation head, one at a time, by the step rule and sampling recipe of
``generate(generation_mode="image")`` (whose loop takes token ids only, so this file runs the same
steps over embeddings: ``_decode_image_codes``). With guidance the unconditional rows keep the source
image and pad the text after it. ``score_edit`` is the NLL of the target's VQ codes after that prompt
(``score_image``'s pass with the edit prompt as prefix), the training loss of edit rows.

Text positions are derived from the attention mask (``cumsum - 1``), so scores do not depend on
how a batch is padded.

Tiny models
-----------
:meth:`JanusUnifiedModel.from_config` builds a randomly initialised model from ``ModelConfig.arch``
(``JanusConfig`` overrides, e.g. ``configs/model/janus_tiny.yaml``) with no download. Its
tokenizer is built locally by :func:`build_byte_tokenizer`: a byte-level BPE with the 256 byte
symbols and **no merges** (so any text is representable, deterministically, without training) plus
the Janus special tokens named as in the real checkpoints. The tiny chat template
(:data:`TINY_CHAT_TEMPLATE`) produces the same prompt layout as the Janus-Pro template.

LoRA
----
:attr:`JanusUnifiedModel.default_lora_targets` lists the language model's attention
(``q_proj k_proj v_proj o_proj``) and MLP (``gate_proj up_proj down_proj``) projections by full
module name, so that PEFT's suffix matching never wraps the SigLIP encoder's own ``q_proj``
layers. :meth:`JanusUnifiedModel.add_lora` injects adapters in place; ``save_pretrained`` writes
the merged weights (:meth:`merged_state_dict`, the live model is not modified). The SigLIP encoder
and the VQ-VAE are always frozen (:attr:`default_frozen_prefixes`); ``model.freeze`` adds prefixes.
Image-token scoring keeps gradients through ``generation_head``, the generation aligner and the
language model (or its adapters); the VQ codes themselves are computed without gradients.
"""

from __future__ import annotations

import copy
import json
import logging
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from unicon.core import ImageBatch, ImageTokenizer, config_dict, torch_dtype
from unicon.errors import UserError
from unicon.models.base import (
    Box,
    ImageGenerationConfig,
    Scores,
    TextGeneration,
    UnifiedModel,
    check_candidates,
)
from unicon.models.boxes import format_box, parse_box
from unicon.models.lora import inject_lora, merge_lora
from unicon.models.registry import register_backend

logger = logging.getLogger(__name__)

#: special tokens of the Janus(-Pro) tokenizer, by role
SPECIAL_TOKENS = {
    "bos_token": "<｜begin▁of▁sentence｜>",
    "eos_token": "<｜end▁of▁sentence｜>",
    "pad_token": "<｜▁pad▁｜>",
    "image_token": "<image_placeholder>",
    "boi_token": "<begin_of_image>",
    "eoi_token": "<end_of_image>",
    "user_token": "<|User|>",
    "assistant_token": "<|Assistant|>",
}

#: chat template of the tiny tokenizer; renders the Janus-Pro layout (see module docstring).
#: Newlines are Jinja string literals because transformers renders templates with ``trim_blocks``.
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}<|User|>: {% else %}<|Assistant|>: {% endif %}"
    "{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}<image_placeholder>{% if not loop.last %}{{ '\\n' }}{% endif %}"
    "{% else %}{{ item['text'] | trim }}{% endif %}"
    "{% endfor %}"
    "{% if message['role'] == 'user' %}{{ '\\n\\n' }}{% else %}<｜end▁of▁sentence｜>{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|Assistant|>:{% endif %}"
)

CAPTION_PROMPT = "Describe the image in one sentence."
GROUNDING_PROMPT = (
    'Which region does the text "{expression}" describe? '
    "Answer with a box [x1, y1, x2, y2] in coordinates normalised to 0-1000."
)
_SENTINEL = "\u2063UNICON_TEXT\u2063"
_MARKER_FILE = "unicon_model.json"
_LM_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class NotAJanusCheckpoint(UserError, ValueError):
    """``from_pretrained`` was pointed at something that is not a transformers Janus checkpoint."""


def build_byte_tokenizer(model_max_length: int = 4096):
    """A byte-level BPE tokenizer without merges plus the Janus special tokens (for tiny models).

    Every string maps to its UTF-8 bytes (ids 0..255); the special tokens follow in the order of
    :data:`SPECIAL_TOKENS`. A BOS is prepended by the post-processor, as the Janus-Pro tokenizer does.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(list(SPECIAL_TOKENS.values()))
    bos = SPECIAL_TOKENS["bos_token"]
    backend.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, backend.token_to_id(bos))]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=bos,
        eos_token=SPECIAL_TOKENS["eos_token"],
        pad_token=SPECIAL_TOKENS["pad_token"],
        extra_special_tokens={k: SPECIAL_TOKENS[k] for k in ("image_token", "boi_token", "eoi_token")},
        model_max_length=model_max_length,
        padding_side="left",
    )


class _ConditionalRows(torch.nn.Module):
    """Logits processor for ``guidance_scale <= 1``: keep the conditional half of Janus's doubled batch.

    ``JanusForConditionalGeneration.generate(generation_mode="image")`` always runs a conditional and
    an unconditional copy of the batch; without the CFG processor the two halves would not be merged.
    """

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        return scores[: scores.shape[0] // 2]


# ---------------------------------------------------------------------------------------------
# Image tokenizer
# ---------------------------------------------------------------------------------------------
class JanusVQTokenizer(ImageTokenizer):
    """Janus's VQ-VAE as an :class:`ImageTokenizer` (codes ``[B, h, w]`` <-> images in ``[0, 1]``).

    ``encode`` normalises with the image processor's mean/std (the VQ-VAE works in [-1, 1] for
    Janus-Pro) and returns ``vqmodel.encode(...).image_tokens`` reshaped row-major to ``[B, h, w]``;
    ``decode`` is ``JanusForConditionalGeneration.decode_image_tokens`` followed by un-normalising.
    For a trained VQ-VAE ``encode(decode(c))`` reproduces most codes; for random weights only the
    index convention (row-major order, codebook lookup) is guaranteed, which the tests check.
    """

    def __init__(self, janus, image_processor):
        self._janus = janus  # JanusForConditionalGeneration (not registered: owned by the model)
        self._processor = image_processor
        vq = janus.config.vq_config
        side = janus.config.vision_config.image_size
        self.codebook_size = int(vq.num_embeddings)
        self.grid_size = (int(vq.num_patches), int(vq.num_patches))
        self.image_size = (int(side), int(side))
        self._mean = torch.tensor(image_processor.image_mean, dtype=torch.float32).view(1, 3, 1, 1)
        self._std = torch.tensor(image_processor.image_std, dtype=torch.float32).view(1, 3, 1, 1)

    def _normalise(self, images: ImageBatch) -> torch.Tensor:
        if isinstance(images, torch.Tensor):
            if images.ndim != 4 or images.shape[1] != 3:
                raise ValueError(f"expected images [B, 3, H, W] in [0, 1], got {tuple(images.shape)}")
            x = images.float()
            if tuple(x.shape[-2:]) != self.image_size:
                x = F.interpolate(x, size=self.image_size, mode="bicubic", antialias=True)
            return (x - self._mean.to(x.device)) / self._std.to(x.device)
        return self._processor(images=[im.convert("RGB") for im in _check_pil(images)], return_tensors="pt")[
            "pixel_values"
        ]

    @torch.no_grad()
    def encode(self, images: ImageBatch) -> torch.Tensor:
        vq = self._janus.model.vqmodel
        pixels = self._normalise(images).to(vq.device, vq.dtype)
        codes = vq.encode(pixels).image_tokens
        return codes.view(pixels.shape[0], *self.grid_size)

    @torch.no_grad()
    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        if codes.ndim != 3 or tuple(codes.shape[1:]) != self.grid_size:
            h, w = self.grid_size
            raise ValueError(f"expected codes [B, {h}, {w}], got {tuple(codes.shape)}")
        if codes.numel() and (codes.min() < 0 or codes.max() >= self.codebook_size):
            lo, hi = int(codes.min()), int(codes.max())
            raise ValueError(f"codes must lie in [0, {self.codebook_size}), got [{lo}, {hi}]")
        pixels = self._janus.decode_image_tokens(codes.reshape(codes.shape[0], -1).to(self._janus.device))
        pixels = pixels.permute(0, 3, 1, 2).float()  # decode_image_tokens returns channels-last
        return (pixels * self._std.to(pixels.device) + self._mean.to(pixels.device)).clamp(0, 1)


def _check_pil(images) -> list:
    from PIL import Image

    images = list(images)
    for i, im in enumerate(images):
        if not isinstance(im, Image.Image):
            raise ValueError(
                f"image {i} is a {type(im).__name__}, expected a PIL image or a tensor from prepare_images"
            )
    return images


# ---------------------------------------------------------------------------------------------
# The unified model
# ---------------------------------------------------------------------------------------------
@register_backend("janus", model_types=("multi_modality",))
class JanusUnifiedModel(UnifiedModel):
    """Janus / Janus-Pro as a unified model (see module docstring for prompts and scores)."""

    supports_editing = True
    supports_multi_image = True

    #: instruction used for captioning and for scoring captions (read by training and CocoCon)
    caption_prompt = CAPTION_PROMPT
    #: parameter-name prefixes (of this module) frozen by default: SigLIP encoder + VQ-VAE
    default_frozen_prefixes = ("janus.model.vision_model.", "janus.model.vqmodel.")

    def __init__(self, janus, processor, max_target_length: int = 128, freeze: Sequence[str] = ()):
        super().__init__()
        self.janus = janus
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.max_target_length = int(max_target_length)
        self._check_tokenizer()
        # generate(generation_mode="image") reads the BOI id from generation_config.generation_kwargs
        extra = dict(getattr(janus.generation_config, "generation_kwargs", None) or {})
        extra.setdefault("boi_token_id", self.boi_id)
        janus.generation_config.generation_kwargs = extra
        self.image_tokenizer = JanusVQTokenizer(janus, processor.image_processor)
        self.freeze(list(self.default_frozen_prefixes) + list(freeze))

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def from_config(cls, model_cfg: Any, world_root: Any = None) -> "JanusUnifiedModel":
        """The model of a ``ModelConfig`` section: random weights from ``arch`` (``JanusConfig`` overrides,
        no download), or ``from_pretrained(pretrained)`` when ``pretrained`` is set. ``world_root`` is
        accepted for ``unicon.models.build_model`` and ignored (Janus has its own tokenizer).

        ``dtype`` and ``freeze`` are applied here; LoRA (``model.lora``) and gradient checkpointing are
        applied by the training run (``unicon.models.checkpoints.load_for_training``), or with
        :meth:`add_lora` / :meth:`gradient_checkpointing_enable`.
        """
        from transformers import (
            JanusConfig,
            JanusForConditionalGeneration,
            JanusImageProcessor,
            JanusProcessor,
        )

        cfg = config_dict(model_cfg)
        if cfg.get("backend", "janus") != "janus":
            raise ValueError(f"model.backend is '{cfg.get('backend')}', expected 'janus'")
        arch = dict(cfg.get("arch") or {})
        if cfg.get("pretrained"):
            if arch:
                raise ValueError(
                    f"model.arch keys {sorted(arch)} cannot change the architecture of the pretrained "
                    f"model {cfg['pretrained']}"
                )
            return cls.from_pretrained(
                cfg["pretrained"],
                allow_pickle=bool(cfg.get("allow_pickle", False)),
                trust_remote_code=bool(cfg.get("trust_remote_code", False)),
                model_cfg=cfg,
            )
        tokenizer = build_byte_tokenizer()
        ids = {k: tokenizer.convert_tokens_to_ids(v) for k, v in SPECIAL_TOKENS.items()}
        text = dict(arch.pop("text_config", {}) or {})
        text.setdefault("model_type", "llama")
        text.setdefault("vocab_size", len(tokenizer))
        if text["vocab_size"] < len(tokenizer):
            raise ValueError(
                f"model.arch.text_config.vocab_size={text['vocab_size']} < tokenizer size {len(tokenizer)}"
            )
        bos, eos, pad = ids["bos_token"], ids["eos_token"], ids["pad_token"]
        text.update(bos_token_id=bos, eos_token_id=eos, pad_token_id=pad)
        try:
            config = JanusConfig(text_config=text, image_token_id=ids["image_token"], **arch)
        except (TypeError, ValueError) as e:
            raise ValueError(f"model.arch: invalid JanusConfig: {e}") from None
        _check_arch(config)
        janus = JanusForConditionalGeneration(config)
        gen = janus.generation_config
        gen.bos_token_id, gen.eos_token_id, gen.pad_token_id = bos, eos, pad
        gen.generation_kwargs = {"boi_token_id": ids["boi_token"]}
        side = config.vision_config.image_size
        image_processor = JanusImageProcessor(
            size={"height": side, "width": side}, image_mean=[0.5] * 3, image_std=[0.5] * 3
        )
        processor = JanusProcessor(
            image_processor=image_processor,
            tokenizer=tokenizer,
            chat_template=TINY_CHAT_TEMPLATE,
            use_default_system_prompt=False,
            num_image_tokens=config.vision_config.num_image_tokens,
        )
        model = cls(janus, processor, freeze=cfg.get("freeze") or ())
        return model._apply_dtype(cfg)

    @classmethod
    def from_pretrained(
        cls,
        path: str,
        allow_pickle: bool = False,
        trust_remote_code: bool = False,
        dtype: str | torch.dtype | None = None,
        model_cfg: Any = None,
        world_root: Any = None,
        map_location: str | torch.device | None = None,
        **hf_kwargs,
    ) -> "JanusUnifiedModel":
        """A transformers Janus checkpoint: local directory or hub id (``deepseek-community/Janus-Pro-1B``).

        Safetensors only unless ``allow_pickle=True``; ``trust_remote_code`` is passed through and off by
        default (Janus is native to transformers). ``model_cfg`` (a ``ModelConfig``) supplies dtype and
        extra frozen prefixes. ``world_root`` is accepted for ``unicon.models.load_model`` and ignored
        (Janus has its own tokenizer); ``map_location`` moves the loaded model to that device.
        """
        from transformers import AutoConfig, JanusForConditionalGeneration, JanusProcessor

        path = str(path)
        cfg = config_dict(model_cfg) if model_cfg is not None else {}
        expected = (
            "a transformers Janus checkpoint: config.json with model_type 'janus' "
            "(e.g. deepseek-community/Janus-Pro-1B), model.safetensors and the processor files"
        )
        local = Path(path).expanduser()
        if local.exists():
            if not local.is_dir() or not (local / "config.json").is_file():
                raise NotAJanusCheckpoint(f"{path}: no config.json; expected {expected}")
            model_type = json.loads((local / "config.json").read_text()).get("model_type")
            if model_type != "janus":
                hint = (
                    " (the original DeepSeek format; use the converted deepseek-community/ checkpoint)"
                    if model_type == "multi_modality"
                    else ""
                )
                raise NotAJanusCheckpoint(
                    f"{path}: config.json has model_type '{model_type}'{hint}; expected {expected}"
                )
            has_safetensors = any(local.glob("model*.safetensors"))
            has_pickle = any(local.glob("pytorch_model*.bin")) or any(local.glob("*.pt"))
            if not has_safetensors:
                if has_pickle and not allow_pickle:
                    raise NotAJanusCheckpoint(
                        f"{path}: only pickle weights (pytorch_model*.bin) found; refusing to unpickle them. "
                        "Convert to safetensors or opt in with model.allow_pickle=true (allow_pickle=True)"
                    )
                if not has_pickle:
                    raise NotAJanusCheckpoint(f"{path}: no weight files; expected {expected}")
            path = str(local)
        try:
            config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        except (OSError, ValueError) as e:
            raise NotAJanusCheckpoint(
                f"{path}: not a local directory, and no config could be read for it as a hub id "
                f"({str(e).splitlines()[0]}); expected {expected}"
            ) from None
        if getattr(config, "model_type", None) != "janus":
            raise NotAJanusCheckpoint(f"{path}: model_type '{config.model_type}'; expected {expected}")
        load_dtype = dtype if dtype is not None else cfg.get("dtype")
        load_dtype = torch_dtype(load_dtype) if load_dtype is not None else None
        try:
            janus = JanusForConditionalGeneration.from_pretrained(
                path,
                config=config,
                use_safetensors=None if allow_pickle else True,
                dtype=load_dtype,
                trust_remote_code=trust_remote_code,
                **hf_kwargs,
            )
            processor = JanusProcessor.from_pretrained(path, trust_remote_code=trust_remote_code)
        except (OSError, ValueError) as e:
            raise NotAJanusCheckpoint(f"{path}: {str(e).splitlines()[0]}; expected {expected}") from None
        extra = {}
        marker = local / _MARKER_FILE if local.exists() else None
        if marker is not None and marker.is_file():
            extra = json.loads(marker.read_text())
        max_target_length = extra.get("max_target_length", 128)
        model = cls(janus, processor, max_target_length=max_target_length, freeze=cfg.get("freeze") or ())
        if map_location is not None:
            model.to(map_location)
        return model._apply_dtype(cfg)

    def _apply_dtype(self, cfg: dict) -> "JanusUnifiedModel":
        dtype = torch_dtype(cfg["dtype"]) if cfg.get("dtype") is not None else None
        if dtype is not None and dtype != self.janus.dtype:
            self.janus.to(dtype)
        return self

    def _check_tokenizer(self) -> None:
        tok = self.tokenizer
        for attr in ("image_token", "boi_token", "eoi_token"):
            if getattr(tok, attr, None) is None:
                raise NotAJanusCheckpoint(f"the tokenizer has no '{attr}'; expected a Janus tokenizer")
        self.image_token_id = tok.convert_tokens_to_ids(tok.image_token)
        self.boi_id = tok.convert_tokens_to_ids(tok.boi_token)
        self.eoi_id = tok.convert_tokens_to_ids(tok.eoi_token)
        if self.image_token_id != self.janus.config.image_token_id:
            raise NotAJanusCheckpoint(
                f"tokenizer image token id {self.image_token_id} != "
                f"config.image_token_id {self.janus.config.image_token_id}"
            )
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        self.eos_id = tok.eos_token_id
        self.num_image_tokens = int(self.janus.config.vision_config.num_image_tokens)

    def gradient_checkpointing_enable(self) -> None:
        """Activation checkpointing of the transformer layers (non-reentrant, so frozen inputs are fine)."""
        if hasattr(self.janus, "activation_checkpointing_enable"):  # transformers >= 5.x name
            self.janus.activation_checkpointing_enable({"use_reentrant": False})
        else:
            self.janus.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    # ---- freezing / LoRA ----------------------------------------------------------------
    def freeze(self, prefixes: Sequence[str]) -> None:
        """Set ``requires_grad=False`` on parameters whose name (in this module) starts with a prefix."""
        names = [n for n, _ in self.named_parameters()]
        for prefix in prefixes:
            if not any(n.startswith(prefix) for n in names):
                raise ValueError(
                    f"model.freeze: no parameter starts with '{prefix}' (names look like '{names[0]}')"
                )
        for n, p in self.named_parameters():
            if any(n.startswith(prefix) for prefix in prefixes):
                p.requires_grad_(False)

    @property
    def default_lora_targets(self) -> list[str]:
        """Full names (relative to this module) of the LM's attention and MLP projections."""
        return self._lm_modules(_LM_PROJECTIONS)

    def _lm_modules(self, suffixes: Sequence[str]) -> list[str]:
        names = [
            name
            for name, _ in self.named_modules()
            if name.startswith("janus.model.language_model.") and name.rsplit(".", 1)[-1] in suffixes
        ]
        if not names:
            raise ValueError(
                f"model.lora.target_modules: no language-model linear layer named {list(suffixes)}"
            )
        return names

    def add_lora(self, lora_cfg: Mapping[str, Any]) -> None:
        """Inject PEFT LoRA adapters (in place) into the language model; everything else is frozen.

        ``lora_cfg`` has the fields of ``unicon.config.LoraConfig``; ``target_modules`` are module-name
        suffixes resolved inside the language model only (empty = :attr:`default_lora_targets`).
        """
        from peft import LoraConfig

        lora_cfg = config_dict(lora_cfg)
        wanted = list(lora_cfg.get("target_modules") or [])
        if wanted:
            targets = self._lm_modules([w.rsplit(".", 1)[-1] for w in wanted])
        else:
            targets = self.default_lora_targets
        config = LoraConfig(
            r=int(lora_cfg.get("r", 8)),
            lora_alpha=int(lora_cfg.get("alpha", 16)),
            lora_dropout=float(lora_cfg.get("dropout", 0.0)),
            target_modules=targets,
        )
        inject_lora(self, config)

    def merged_state_dict(self) -> dict[str, torch.Tensor]:
        """State dict of ``self.janus`` with any LoRA adapters folded into the base weights; the live
        model keeps its adapters (the merge runs on a copy, through PEFT's ``merge_and_unload``)."""
        if not any("lora_" in name for name, _ in self.named_parameters()):
            return self.janus.state_dict()
        merged = copy.deepcopy(self)
        merge_lora(merged)
        return merged.janus.state_dict()

    # ---- persistence --------------------------------------------------------------------
    def save_pretrained(self, path: str) -> None:
        """Write a transformers Janus checkpoint (safetensors, LoRA merged) + processor + a unicon marker."""
        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        self.janus.save_pretrained(out, state_dict=self.merged_state_dict())
        self.processor.save_pretrained(out)
        marker = {"backend": self.backend, "max_target_length": self.max_target_length}
        (out / _MARKER_FILE).write_text(json.dumps(marker))

    # ---- inputs -------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.janus.device

    def prepare_images(self, images: ImageBatch) -> torch.Tensor:
        """PIL images -> ``[B, 3, S, S]`` via the Janus image processor (long side resized to S, padded
        to a square with the mean colour, normalised). Prepared tensors (or lists of their ``[3, S, S]``
        rows) pass through after a shape check."""
        side = self.janus.config.vision_config.image_size
        if isinstance(images, (list, tuple)) and images and all(torch.is_tensor(im) for im in images):
            images = torch.stack(list(images))
        if isinstance(images, torch.Tensor):
            if images.ndim != 4 or images.shape[1] != 3 or tuple(images.shape[-2:]) != (side, side):
                raise ValueError(
                    f"expected prepared images [B, 3, {side}, {side}], got {tuple(images.shape)}"
                )
            return images
        pil = [im.convert("RGB") for im in _check_pil(images)]
        return self.processor.image_processor(images=pil, return_tensors="pt")["pixel_values"]

    def _image_sizes(self, images: ImageBatch) -> list[tuple[int, int]]:
        """(width, height) of each input image (tensors: the model size)."""
        if isinstance(images, torch.Tensor):
            return [(images.shape[-1], images.shape[-2])] * images.shape[0]
        return [im.size for im in _check_pil(images)]

    def _pixels(self, images: ImageBatch) -> torch.Tensor:
        return self.prepare_images(images).to(self.device, self.janus.dtype)

    # ---- prompt construction ------------------------------------------------------------
    def _chat(self, content: list[dict], generation: bool = True) -> str:
        messages = [{"role": "user", "content": content}]
        return self.processor.apply_chat_template(messages, add_generation_prompt=generation, tokenize=False)

    def _system(self) -> str:
        if getattr(self.processor, "use_default_system_prompt", False):
            from transformers.models.janus.processing_janus import DEFAULT_SYSTEM_PROMPT

            return DEFAULT_SYSTEM_PROMPT
        return ""

    def _image_prompt_parts(self, question: str) -> tuple[list[int], list[int]]:
        """Token ids of (head up to and including the image, rest of the prompt up to ``<|Assistant|>:``).

        The split is at the image's ``<end_of_image>`` special token, so tokenising the two parts
        separately gives exactly the ids of the whole prompt. Memoised per question (scoring asks for
        the same prompt once per example; the template and tokenizer never change after loading).
        """
        memo = self.__dict__.setdefault("_prompt_parts_memo", {})
        if question not in memo:
            if len(memo) >= 4096:
                memo.clear()
            memo[question] = self._build_image_prompt_parts(question)
        head, rest = memo[question]
        return list(head), list(rest)

    def _build_image_prompt_parts(self, question: str) -> tuple[list[int], list[int]]:
        text = self._chat([{"type": "image"}, {"type": "text", "text": _SENTINEL}])
        image_token = self.tokenizer.image_token
        cut = text.index(image_token) + len(image_token)
        head, rest = text[:cut], text[cut:]
        if _SENTINEL not in rest:
            raise ValueError("the chat template does not place the text after the image")
        expanded = self.tokenizer.boi_token + image_token * self.num_image_tokens + self.tokenizer.eoi_token
        head = self._system() + head[: -len(image_token)] + expanded
        head_ids = self.tokenizer(head, add_special_tokens=True)["input_ids"]
        rest = rest.replace(_SENTINEL, question.strip())
        rest_ids = self.tokenizer(rest, add_special_tokens=False)["input_ids"]
        return head_ids, rest_ids

    def _target_ids(self, text: str) -> tuple[list[int], bool]:
        return self._targets([text])[0]

    def _targets(self, texts: Sequence[str]) -> list[tuple[list[int], bool]]:
        """``(ids, truncated)`` of each ``" " + text + <eos>``, cut to ``max_target_length`` (one tokenizer call)."""
        out = []
        for ids in self.tokenizer([" " + t.strip() for t in texts], add_special_tokens=False)["input_ids"]:
            ids = ids + [self.eos_id]
            cut = len(ids) > self.max_target_length
            out.append((ids[: self.max_target_length], cut))
        return out

    def _generation_prompt_ids(self, prompt: str, context: str | None = None) -> list[int]:
        text = prompt.strip() if not context else f"{prompt.strip()}\n{context.strip()}"  # UReason's [P, R]
        chat = self._chat([{"type": "text", "text": text}]) + self.tokenizer.boi_token
        return self.tokenizer(chat, add_special_tokens=True)["input_ids"]

    # ---- core scoring passes ------------------------------------------------------------
    def _lm(self):
        return self.janus.model.language_model

    def _embed_with_image(self, ids: torch.Tensor, pixels: torch.Tensor | None) -> torch.Tensor:
        """Text embeddings with the SigLIP+aligner features scattered into the image placeholders
        (plain text embeddings when ``pixels`` is None)."""
        embeds = self.janus.get_input_embeddings()(ids)
        if pixels is None:
            return embeds
        features = self.janus.model.get_image_features(pixels, return_dict=True).pooler_output
        mask = (ids == self.image_token_id).unsqueeze(-1)
        return embeds.masked_scatter(mask, features.to(embeds.dtype))

    def _score_after_image(
        self,
        pixels: torch.Tensor | None,
        heads: list[list[int]],
        rows: list[tuple[int, list[int], list[int]]],
        shape: tuple[int, int],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Summed target NLLs for continuations ``(b, context_ids, target_ids)`` of image prefixes.

        Row ``r`` is the sequence ``heads[b] + context + target``; only ``target`` is scored
        (``-sum_j log p(target_j | everything before it)``). The work shared by an example's K rows
        runs once per example: ``heads[b]`` (which contains the image, unless ``pixels`` is None)
        extended by the common prefix of the rows' contexts (for a caption prompt: the whole
        question up to ``<|Assistant|>:``; capped so that every row keeps at least one token of its
        own). Its KV cache is copied to
        the K rows and one continuation pass over all rows runs the tokens where the candidates
        differ. A target token predicted inside the shared prefix takes its logits from the prefix
        pass. When the LM uses gradient checkpointing in training mode (which disables the KV
        cache), the prefix embeddings are instead copied to each row and the full sequence is run;
        both give the same numbers (within float rounding: the same sums, other matrix shapes).
        Returns ``(sum_nll [B, K], num_tokens [B, K], mask [B, K])``.
        """
        device = self.device
        lm = self._lm()
        full_pass = lm.gradient_checkpointing and lm.training
        inputs = []
        for _, ctx, tgt in rows:
            if not ctx:
                raise ValueError("internal: empty context before the target")
            inputs.append(ctx + tgt[:-1])
        shared = [0] * len(heads)  # tokens of each example's rows moved into its head
        if not full_pass:
            by_example: dict[int, list[tuple[list[int], int]]] = {}
            for (b, ctx, _), seq in zip(rows, inputs):
                by_example.setdefault(b, []).append((seq, len(ctx)))
            for b, seqs in by_example.items():
                # the contexts' common part only: target prefixes shared by one example's candidates
                # and not another's would widen both padded passes (measured slower on janus_tiny)
                limit = min(min(n, len(q) - 1) for q, n in seqs)
                shared[b] = _common_prefix_length([q for q, _ in seqs], limit=limit)
        first = {}
        for (b, _, _), seq in zip(rows, inputs):
            first.setdefault(b, seq)
        heads = [h + first[b][: shared[b]] if b in first else h for b, h in enumerate(heads)]
        head_ids, head_mask = _pad(heads, self.pad_id, left=True, device=device)
        head_embeds = self._embed_with_image(head_ids, pixels)
        example_of = [r[0] for r in rows]
        row_of = torch.tensor(example_of, device=device)
        cont_ids, cont_mask = _pad([seq[shared[b]:] for b, seq in zip(example_of, inputs)], self.pad_id,
                                   left=False, device=device)
        full_mask = torch.cat([head_mask[row_of], cont_mask], dim=1)
        positions = (full_mask.cumsum(-1) - 1).clamp(min=0)
        cont_embeds = self.janus.get_input_embeddings()(cont_ids)
        W = head_ids.shape[1]
        if full_pass:
            out = lm(
                inputs_embeds=torch.cat([head_embeds[row_of], cont_embeds], dim=1),
                attention_mask=full_mask,
                position_ids=positions,
                use_cache=False,
            )
            head_hidden, hidden = None, out.last_hidden_state[:, W:]
        else:
            prefix = lm(
                inputs_embeds=head_embeds,
                attention_mask=head_mask,
                position_ids=(head_mask.cumsum(-1) - 1).clamp(min=0),
                use_cache=True,
            )
            head_hidden, cache = prefix.last_hidden_state, prefix.past_key_values
            cache.batch_select_indices(row_of)
            hidden = lm(
                inputs_embeds=cont_embeds,
                attention_mask=full_mask,
                position_ids=positions[:, W:],
                past_key_values=cache,
                use_cache=True,
            ).last_hidden_state
        # target token j of row r is predicted at input index q = len(ctx) - 1 + j: inside the shared
        # prefix (the head pass, right-aligned) when q < shared[b], else in the row's continuation
        head_at, cont_at, labels_head, labels_cont, row_head, row_cont = [], [], [], [], [], []
        for r, (b, ctx, tgt) in enumerate(rows):
            for j, label in enumerate(tgt):
                q = len(ctx) - 1 + j
                if q < shared[b]:
                    head_at.append((b, W - shared[b] + q))
                    labels_head.append(label)
                    row_head.append(r)
                else:
                    cont_at.append((r, q - shared[b]))
                    labels_cont.append(label)
                    row_cont.append(r)
        picked = [hidden[tuple(torch.tensor(cont_at, device=device).T)]]
        if head_at:
            picked.insert(0, head_hidden[tuple(torch.tensor(head_at, device=device).T)])
        logits = self.janus.lm_head(torch.cat(picked))
        labels = torch.tensor(labels_head + labels_cont, device=device)
        row_idx = torch.tensor(row_head + row_cont, device=device)
        token_nll = -logits.float().log_softmax(-1).gather(-1, labels[:, None])[:, 0]
        sums = torch.zeros(len(rows), device=device, dtype=torch.float32).index_add(0, row_idx, token_nll)
        return _to_grid(sums, example_of, shape, [len(r[2]) for r in rows])

    # ---- likelihood scoring -------------------------------------------------------------
    def score_text(
        self, images: ImageBatch | None, prompts: Sequence[str], candidates: Sequence[Sequence[str]]
    ) -> Scores:
        check_candidates(candidates)
        if images is None:  # text only: the prompt reason() generates after; its last token starts the row
            if len(prompts) != len(candidates):
                raise ValueError(f"batch sizes differ: {len(prompts)} prompts, {len(candidates)} candidate lists")
            pixels, parts = None, [self._reason_prompt_ids(p) for p in prompts]
            parts = [(ids[:-1], ids[-1:]) for ids in parts]
        else:
            _check_lengths(images, prompts, candidates)
            pixels, parts = self._pixels(images), [self._image_prompt_parts(p) for p in prompts]
        heads, rows, truncated = [], [], 0
        targets = iter(self._targets([c for cands in candidates for c in cands]))
        for b, ((head, ctx), cands) in enumerate(zip(parts, candidates)):
            heads.append(head)
            for _ in cands:
                tgt, cut = next(targets)
                truncated += cut
                rows.append((b, ctx, tgt))
        K = max(len(c) for c in candidates)
        return _scores(*self._score_after_image(pixels, heads, rows, (len(prompts), K)), truncated)

    def score_boxes(
        self, images: ImageBatch, expressions: Sequence[Sequence[str]], boxes: Sequence[Box]
    ) -> Scores:
        check_candidates(expressions, "expressions")
        _check_lengths(images, boxes, expressions)
        sizes = self._image_sizes(images)
        pixels = self._pixels(images)
        heads, rows, truncated = [], [], 0
        for b, (exprs, box) in enumerate(zip(expressions, boxes)):
            tgt, cut = self._target_ids(format_box(box, *sizes[b]))
            for k, expr in enumerate(exprs):
                head, ctx = self._image_prompt_parts(GROUNDING_PROMPT.format(expression=expr.strip()))
                if k == 0:
                    heads.append(head)
                truncated += cut
                rows.append((b, ctx, tgt))
        K = max(len(e) for e in expressions)
        return _scores(*self._score_after_image(pixels, heads, rows, (len(boxes), K)), truncated)

    def image_codes(self, images: ImageBatch) -> torch.Tensor:
        """Flat VQ codes ``[B, h*w]`` of images (PIL or ``prepare_images`` tensors)."""
        with torch.no_grad():
            vq = self.janus.model.vqmodel
            pixels = self.prepare_images(images).to(vq.device, vq.dtype)
            return vq.encode(pixels).image_tokens.view(pixels.shape[0], -1)

    def score_image_codes(self, prompts: Sequence[Sequence[str]], codes: torch.Tensor,
                          contexts: Sequence[str] | None = None) -> Scores:
        """NLL of flat codes ``[B, N]`` given each prompt (the body of :meth:`score_image`)."""
        check_candidates(prompts, "prompts")
        if codes.ndim != 2 or codes.shape[0] != len(prompts):
            raise ValueError(f"expected codes [{len(prompts)}, N], got {tuple(codes.shape)}")
        if contexts is not None and len(contexts) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompt lists but {len(contexts)} contexts")
        device = self.device
        rows = [(b, self._generation_prompt_ids(p, None if contexts is None else contexts[b]))
                for b, ps in enumerate(prompts) for p in ps]
        row_of = torch.tensor([b for b, _ in rows], device=device)
        ids, mask = _pad([r[1] for r in rows], self.pad_id, left=True, device=device)
        token_nll = self._code_nll(self.janus.get_input_embeddings()(ids), mask, codes.to(device), row_of)
        K = max(len(p) for p in prompts)
        example_of = [b for b, _ in rows]
        grid = _to_grid(token_nll.sum(-1), example_of, (len(prompts), K), [codes.shape[1]] * len(rows))
        return _scores(*grid, truncated=0)

    def _code_nll(self, prefix_embeds: torch.Tensor, prefix_mask: torch.Tensor, codes: torch.Tensor,
                  row_of: torch.Tensor) -> torch.Tensor:
        """Per-code NLLs ``[R, N]``: ``-log p(codes[row_of[r], j] | prefix_r, codes[row_of[r], <j])``.

        ``prefix_embeds`` ``[R, P, D]`` (left-padded, ``prefix_mask`` 1 = token) end at ``<begin_of_image>``;
        the codes are embedded with ``prepare_embeddings_for_image_generation`` (once per image), one LM
        pass runs over prefix + codes and ``generation_head`` reads the hidden states at BOI ... last-1."""
        P, N = prefix_embeds.shape[1], codes.shape[1]
        code_embeds = self.janus.prepare_embeddings_for_image_generation(codes)  # once per image
        embeds = torch.cat([prefix_embeds, code_embeds[row_of].to(prefix_embeds.dtype)], dim=1)
        full_mask = torch.cat([prefix_mask, prefix_mask.new_ones(len(row_of), N)], dim=1)
        hidden = self._lm()(
            inputs_embeds=embeds,
            attention_mask=full_mask,
            position_ids=(full_mask.cumsum(-1) - 1).clamp(min=0),
            use_cache=False,
        ).last_hidden_state
        logits = self.janus.model.generation_head(hidden[:, P - 1 : P + N - 1])  # BOI ... last-1
        return -logits.float().log_softmax(-1).gather(-1, codes[row_of].unsqueeze(-1))[..., 0]

    def score_image(self, prompts: Sequence[Sequence[str]], images: ImageBatch,
                    contexts: Sequence[str] | None = None) -> Scores:
        check_candidates(prompts, "prompts")
        n = images.shape[0] if isinstance(images, torch.Tensor) else len(images)
        if n != len(prompts):
            raise ValueError(f"got {len(prompts)} prompt lists but {n} images")
        return self.score_image_codes(prompts, self.image_codes(images), contexts)

    # ---- generation ---------------------------------------------------------------------
    @torch.no_grad()
    def _generate_text(
        self, prompt_ids: list[list[int]], pixels: torch.Tensor | None, max_new_tokens: int, **kwargs
    ) -> list[TextGeneration]:
        ids, mask = _pad(prompt_ids, self.pad_id, left=True, device=self.device)
        if "logits_processor" in kwargs:  # JanusForConditionalGeneration.generate drops it in text mode
            raise ValueError(
                "logits_processor is ignored by transformers' Janus text generation; use generation flags"
            )
        # max_length (not max_new_tokens) so that the checkpoint's default max_length does not clash with it
        options = dict(do_sample=False, max_length=ids.shape[1] + max_new_tokens, pad_token_id=self.pad_id,
                       eos_token_id=self.eos_id)
        options.update(kwargs)
        if pixels is not None:
            options["pixel_values"] = pixels
        out = self.janus.generate(input_ids=ids, attention_mask=mask, generation_mode="text", **options)
        results = []
        for row in out[:, ids.shape[1] :].tolist():
            finished = self.eos_id in row
            row = row[: row.index(self.eos_id)] if finished else row
            row = [t for t in row if t != self.pad_id]
            text = self.tokenizer.decode(row, skip_special_tokens=True).strip()
            results.append(TextGeneration(text=text, truncated=not finished, num_tokens=len(row)))
        return results

    def _image_question_ids(self, question: str) -> list[int]:
        head, rest = self._image_prompt_parts(question)
        return head + rest

    def caption(self, images: ImageBatch, prompt: str | None = None, **generate_kwargs) -> list[str]:
        pixels = self._pixels(images)
        ids = [self._image_question_ids(prompt or CAPTION_PROMPT)] * pixels.shape[0]
        generate_kwargs.setdefault("max_new_tokens", 32)
        return [g.text for g in self._generate_text(ids, pixels, **generate_kwargs)]

    def answer(self, images: ImageBatch, questions: Sequence[str], **generate_kwargs) -> list[str]:
        pixels = self._pixels(images)
        if len(questions) != pixels.shape[0]:
            raise ValueError(f"got {len(questions)} questions for {pixels.shape[0]} images")
        generate_kwargs.setdefault("max_new_tokens", 16)
        ids = [self._image_question_ids(q) for q in questions]
        return [g.text for g in self._generate_text(ids, pixels, **generate_kwargs)]

    def _images_question_ids(self, n_images: int, question: str) -> list[int]:
        """Token ids of a prompt with ``n_images`` images, then ``question`` (module docstring): the chat
        template over ``n_images`` image items and the text, every image placeholder expanded to
        ``<begin_of_image> + N x <image_placeholder> + <end_of_image>``, the system prompt first."""
        text = self._chat([{"type": "image"}] * n_images + [{"type": "text", "text": _SENTINEL}])
        image_token = self.tokenizer.image_token
        if text.count(image_token) != n_images or _SENTINEL not in text.split(image_token)[-1]:
            raise ValueError(f"the chat template does not place {n_images} images before the text")
        expanded = self.tokenizer.boi_token + image_token * self.num_image_tokens + self.tokenizer.eoi_token
        text = self._system() + text.replace(image_token, expanded).replace(_SENTINEL, question.strip())
        return self.tokenizer(text, add_special_tokens=True)["input_ids"]

    def answer_images(self, images: Sequence[Sequence], questions: Sequence[str], **generate_kwargs) -> list[str]:
        """Several images, then the question, in one user turn (module docstring); greedy, at most 16
        new tokens unless ``max_new_tokens`` says otherwise, as :meth:`answer`."""
        rows = [list(row) for row in images]
        if len(rows) != len(questions):
            raise ValueError(f"got {len(questions)} questions for {len(rows)} rows of images")
        empty = [b for b, row in enumerate(rows) if not row]
        if empty:
            raise ValueError(f"row {empty[0]} has no image")
        pixels = self._pixels([im for row in rows for im in row])
        generate_kwargs.setdefault("max_new_tokens", 16)
        ids = [self._images_question_ids(len(row), q) for row, q in zip(rows, questions)]
        return [g.text for g in self._generate_text(ids, pixels, **generate_kwargs)]

    def locate(self, images: ImageBatch, expressions: Sequence[str]) -> torch.Tensor:
        """Generate ``"[x1, y1, x2, y2]"``, convert it to pixels; unparsable answers give ``[0, 0, 0, 0]``."""
        sizes = self._image_sizes(images)
        pixels = self._pixels(images)
        ids = [self._image_question_ids(GROUNDING_PROMPT.format(expression=e.strip())) for e in expressions]
        texts = [g.text for g in self._generate_text(ids, pixels, max_new_tokens=32)]
        boxes, failed = [], 0
        for text, (w, h) in zip(texts, sizes):
            box = parse_box(text, w, h)
            failed += box is None
            boxes.append(box if box is not None else [0.0, 0.0, 0.0, 0.0])
        if failed:
            logger.warning(
                "locate: %d of %d answers had no [x1, y1, x2, y2] box; gave empty boxes", failed, len(texts)
            )
        return torch.tensor(boxes, dtype=torch.float32)

    @torch.no_grad()
    def generate_image_codes(
        self,
        prompts: Sequence[str],
        context: Sequence[str] | None = None,
        config: ImageGenerationConfig | None = None,
    ) -> torch.Tensor:
        """Flat VQ codes ``[B, h*w]`` from ``generate(generation_mode="image")``.

        Prompts are generated in groups of equal token length: Janus's image loop numbers positions
        without looking at the padding mask, so a padded batch would change the result.
        """
        from transformers import LogitsProcessorList

        config = config or self.image_generation_config
        if context is not None and len(context) != len(prompts):
            raise ValueError(f"got {len(context)} contexts for {len(prompts)} prompts")
        ids = [self._generation_prompt_ids(p, context[i] if context else None) for i, p in enumerate(prompts)]
        generation_config = self._image_generation_config(config)
        processors = [] if config.guidance_scale > 1 else [_ConditionalRows()]
        device = self.device
        codes = torch.zeros(len(prompts), self.num_image_tokens, dtype=torch.long, device=device)
        with _seeded(config.seed, device):
            for length in sorted({len(i) for i in ids}):
                group = [b for b, i in enumerate(ids) if len(i) == length]
                input_ids = torch.tensor([ids[b] for b in group], device=device)
                codes[group] = self.janus.generate(
                    input_ids=input_ids,
                    attention_mask=torch.ones_like(input_ids),
                    generation_mode="image",
                    logits_processor=LogitsProcessorList(processors),
                    generation_config=generation_config,
                )
        return codes

    def _image_generation_config(self, config: ImageGenerationConfig):
        """The checkpoint's ``GenerationConfig`` updated with ``config``'s sampling recipe (do_sample,
        temperature/top-k/top-p when sampling, guidance clamped to >= 1, ``config.extra`` as
        ``GenerationConfig`` fields: anything else is a ``ValueError``). Shared by text-to-image
        (transformers' image loop) and editing (:meth:`_decode_image_codes`)."""
        generation_config = copy.deepcopy(self.janus.generation_config)
        sampling = dict(temperature=config.temperature, top_k=config.top_k or None, top_p=config.top_p)
        unused = generation_config.update(
            do_sample=config.do_sample,
            guidance_scale=max(float(config.guidance_scale), 1.0),
            pad_token_id=self.pad_id,
            **(sampling if config.do_sample else {}),
            **config.extra,
        )
        if unused:
            raise ValueError(f"ImageGenerationConfig.extra: {sorted(unused)} are not GenerationConfig fields")
        return generation_config

    @torch.no_grad()
    def _decode_image_codes(self, ids: torch.Tensor, embeds: torch.Tensor, mask: torch.Tensor,
                            unconditional: torch.Tensor | None, config: ImageGenerationConfig,
                            keep_logits: bool = False) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The ``h*w`` image codes after prefixes given as embeddings, by the step rule of transformers'
        ``generate(generation_mode="image")`` (which takes token ids only, so it cannot read an image).

        ``embeds`` ``[B, P, D]`` (left-padded, ``mask`` 1 = token, ``ids`` the prefix's token ids for
        the logits processors) end at ``<begin_of_image>``. Each step runs ``generation_head`` on the
        last hidden state, applies the processors ``generate`` builds from
        :meth:`_image_generation_config` (with guidance ``s > 1`` first transformers'
        ``ClassifierFreeGuidanceLogitsProcessor`` over the conditional rows and their
        ``unconditional`` partners ``[B, P, D]``, same mask), then takes the argmax or a
        ``torch.multinomial`` draw from the global RNG (seeded by the caller), and feeds the code back
        through ``prepare_embeddings_for_image_generation`` against a ``DynamicCache``. Positions come
        from the mask (``cumsum - 1``), so left padding does not change a row. Returns the codes
        ``[B, h*w]`` and, with ``keep_logits``, each step's raw generation-head logits ``[B or 2B, V]``."""
        from transformers import ClassifierFreeGuidanceLogitsProcessor, LogitsProcessorList

        generation_config = self._image_generation_config(config)
        guided = generation_config.guidance_scale > 1
        if guided and unconditional is None:
            raise ValueError("classifier-free guidance needs the unconditional prefixes")
        procs = LogitsProcessorList()
        if guided:
            procs.append(ClassifierFreeGuidanceLogitsProcessor(generation_config.guidance_scale))
        generation_config.guidance_scale = None  # as generate does: the batched CFG above, not the unbatched one
        self.janus._prepare_special_tokens(generation_config, True, device=ids.device)
        procs = self.janus._get_logits_processor(
            generation_config=generation_config, input_ids_seq_length=ids.shape[1], encoder_input_ids=ids,
            prefix_allowed_tokens_fn=None, logits_processor=procs, device=ids.device)
        B = embeds.shape[0]
        if guided:
            embeds, mask = torch.cat([embeds, unconditional.to(embeds.dtype)]), mask.repeat(2, 1)
        lm, head = self._lm(), self.janus.model.generation_head
        cache = DynamicCache(config=lm.config)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        hidden = lm(inputs_embeds=embeds, attention_mask=mask, position_ids=positions, past_key_values=cache,
                    use_cache=True).last_hidden_state[:, -1]
        codes = torch.zeros(B, self.num_image_tokens, dtype=torch.long, device=ids.device)
        logits = []
        for i in range(self.num_image_tokens):
            raw = head(hidden)
            if keep_logits:
                logits.append(raw.float())
            scores = procs(ids, raw)
            if generation_config.do_sample:
                code = torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(-1)
            else:
                code = torch.argmax(scores, dim=-1)
            codes[:, i] = code
            if i + 1 == self.num_image_tokens:
                break
            step = code.repeat(2) if guided else code
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
            step_embeds = self.janus.prepare_embeddings_for_image_generation(step[:, None]).to(embeds.dtype)
            hidden = lm(inputs_embeds=step_embeds, attention_mask=mask, position_ids=positions[:, -1:] + i + 1,
                        past_key_values=cache, use_cache=True).last_hidden_state[:, -1]
        return codes, logits

    def decode_codes(self, codes: torch.Tensor) -> list:
        """Flat codes ``[B, h*w]`` -> PIL images via ``decode_image_tokens`` and the processor's postprocess.

        ``postprocess`` un-normalises and rescales to uint8 ``[3, H, W]``; the PIL conversion is done
        here because ``return_tensors="PIL.Image.Image"`` fails inside transformers 5.23.
        """
        from PIL import Image

        with torch.no_grad():
            pixels = self.janus.decode_image_tokens(codes.to(self.device))
        uint8 = self.processor.postprocess(list(pixels.float().cpu()))["pixel_values"]
        return [Image.fromarray(im.permute(1, 2, 0).numpy(), mode="RGB") for im in uint8]

    def generate_image(
        self,
        prompts: Sequence[str],
        context: Sequence[str] | None = None,
        config: ImageGenerationConfig | None = None,
    ) -> list:
        config = config or self.image_generation_config
        if config.num_candidates != 1:
            return self.best_of_candidates(prompts, context, config)
        return self.decode_codes(self.generate_image_codes(prompts, context, config))

    # ---- image editing ------------------------------------------------------------------
    def _edit_prompt_ids(self, instruction: str) -> tuple[list[int], int]:
        """Token ids of an edit prompt and the length of its image part: the understanding prompt of
        :meth:`_image_prompt_parts` with the instruction as the user's text, then ``<begin_of_image>``::

            [system prompt]<|User|>: <begin_of_image><image_placeholder>*N<end_of_image>\n{instruction}\n\n<|Assistant|>:<begin_of_image>
        """
        head, rest = self._image_prompt_parts(instruction)
        return head + rest + [self.boi_id], len(head)

    def _edit_prefix(self, images: ImageBatch, instructions: Sequence[str]):
        """``(ids, embeds, mask, unconditional)`` of the edit prompts, left-padded: the SigLIP + aligner
        features of each source image in its placeholders (the path ``score_text`` uses), and the
        classifier-free-guidance partner of each row, which keeps everything up to the image's
        ``<end_of_image>`` and the final ``<begin_of_image>`` and replaces the text between them (the
        instruction and the chat tags) by the pad embedding, as Janus's text-to-image loop replaces
        every token but BOS and BOI: the model's distribution given the source image alone."""
        prompts = [self._edit_prompt_ids(t) for t in instructions]
        ids, mask = _pad([p for p, _ in prompts], self.pad_id, left=True, device=self.device)
        embeds = self._embed_with_image(ids, self._pixels(images))
        width = ids.shape[1]
        keep = torch.zeros_like(mask, dtype=torch.bool)
        for r, (row, n_head) in enumerate(prompts):
            start = width - len(row)
            keep[r, : start + n_head] = True
            keep[r, -1] = True
        pad = self.janus.get_input_embeddings()(torch.tensor([self.pad_id], device=self.device))
        unconditional = torch.where(keep[..., None], embeds, pad.to(embeds.dtype))
        return ids, embeds, mask, unconditional

    def edit_image(self, images: ImageBatch, instructions: Sequence[str],
                   config: ImageGenerationConfig | None = None) -> list:
        """Source image + instruction -> edited image. The prompt is :meth:`_edit_prompt_ids` (the
        image through SigLIP as in understanding, the instruction as the user's text, the assistant
        turn opened with ``<begin_of_image>``); the codes come from the generation head by the
        text-to-image step rule and sampling recipe (:meth:`_decode_image_codes`: greedy / sampling,
        temperature, top-k, top-p, ``extra``, guidance against the image-only prompt, ``seed`` through
        the global RNG as in :meth:`generate_image_codes`) and are decoded by the VQ-VAE."""
        n = images.shape[0] if isinstance(images, torch.Tensor) else len(images)
        if n != len(instructions):
            raise ValueError(f"got {n} images but {len(instructions)} instructions")
        config = config or self.image_generation_config
        if config.num_candidates != 1:
            raise ValueError("edit_image draws one image per instruction (num_candidates=1)")
        with torch.no_grad(), _seeded(config.seed, self.device):
            codes, _ = self._decode_image_codes(*self._edit_prefix(images, instructions), config)
        return self.decode_codes(codes)

    def score_edit(self, images: ImageBatch, instructions: Sequence[str], targets: ImageBatch) -> Scores:
        """``[B, 1]`` NLL of each target's VQ codes (:meth:`image_codes`) after the edit prompt of
        :meth:`edit_image` (source image + instruction), through the generation head: the conditional
        distribution :meth:`edit_image` samples from at guidance 1. Differentiable like
        :meth:`score_image` (generation head and aligner, language model, understanding aligner; the
        codes and the frozen SigLIP / VQ-VAE carry no gradient)."""
        n = images.shape[0] if isinstance(images, torch.Tensor) else len(images)
        m = targets.shape[0] if isinstance(targets, torch.Tensor) else len(targets)
        if not (n == len(instructions) == m):
            raise ValueError(f"got {n} images, {len(instructions)} instructions and {m} target images")
        ids, embeds, mask, _ = self._edit_prefix(images, instructions)
        codes = self.image_codes(targets).to(self.device)
        rows = torch.arange(n, device=self.device)
        token_nll = self._code_nll(embeds, mask, codes, rows)
        grid = _to_grid(token_nll.sum(-1), list(range(n)), (n, 1), [codes.shape[1]] * n)
        return _scores(*grid, truncated=0)

    # ---- EditingScore embeddings (UnifiedModel.image_latents / embed_image / embed_text) ----------
    @torch.no_grad()
    def image_latents(self, images: ImageBatch) -> torch.Tensor:
        """The image's VQ codes (:meth:`image_codes`) embedded as the language model reads them when it
        writes an image (``prepare_embeddings_for_image_generation``: VQ codebook + generation aligner),
        **flattened** over the code grid: ``[B, N * D]`` (N codes, D the LM width)."""
        codes = self.image_codes(images).to(self.device)
        return self.janus.prepare_embeddings_for_image_generation(codes).float().flatten(1)

    @torch.no_grad()
    def _mean_lm_states(self, embeds: torch.Tensor, mask: torch.Tensor, pool: torch.Tensor) -> torch.Tensor:
        hidden = self._lm()(inputs_embeds=embeds, attention_mask=mask,
                            position_ids=(mask.cumsum(-1) - 1).clamp(min=0), use_cache=False).last_hidden_state
        w = pool.unsqueeze(-1).float()
        return (hidden.float() * w).sum(1) / w.sum(1)

    def embed_image(self, images: ImageBatch) -> torch.Tensor:
        """Language-model last hidden states over the image's understanding tokens (``<bos><begin_of_image>``
        + SigLIP/aligner features + ``<end_of_image>``, no question), **mean-pooled** over the N image
        positions: ``[B, D]``, the space of :meth:`embed_text`."""
        pixels = self._pixels(images)
        tok = self.tokenizer
        row = ([tok.bos_token_id] + tok.convert_tokens_to_ids([tok.boi_token]) + [self.image_token_id] * self.num_image_tokens
               + tok.convert_tokens_to_ids([tok.eoi_token]))
        ids = torch.tensor([row] * pixels.shape[0], device=self.device)
        with torch.no_grad():
            embeds = self._embed_with_image(ids, pixels)
        return self._mean_lm_states(embeds, torch.ones_like(ids), ids == self.image_token_id)

    def embed_text(self, texts: Sequence[str]) -> torch.Tensor:
        """Language-model last hidden states of the text alone (``<bos>`` + its tokens, no chat template),
        **mean-pooled** over its tokens (bos included): ``[B, D]``, the space of :meth:`embed_image`."""
        rows = self.tokenizer([t.strip() for t in texts], add_special_tokens=True)["input_ids"]
        ids, mask = _pad(rows, self.pad_id, left=False, device=self.device)
        with torch.no_grad():
            embeds = self.janus.get_input_embeddings()(ids)
        return self._mean_lm_states(embeds, mask, mask.bool())

    def _reason_prompt_ids(self, prompt: str) -> list[int]:
        """Token ids of a text-only chat turn up to ``<|Assistant|>:`` (``reason`` and text-only scoring)."""
        return self.tokenizer(self._system() + self._chat([{"type": "text", "text": prompt}]))["input_ids"]

    def reason(self, prompts: Sequence[str], max_new_tokens: int = 256) -> list[TextGeneration]:
        ids = [self._reason_prompt_ids(p) for p in prompts]
        return self._generate_text(ids, None, max_new_tokens=max_new_tokens)


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------
@contextmanager
def _seeded(seed: int | None, device: torch.device):
    """Run the block with torch's global RNG (and the CUDA device's) seeded to ``seed`` and restored
    afterwards; no-op for ``seed=None`` (the caller's RNG state is used and advanced)."""
    if seed is None:
        yield
        return
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        yield


def _check_arch(config) -> None:
    """The vision grid, the VQ grid and the number of image tokens must agree (no silent mismatch)."""
    vision, vq, text = config.vision_config, config.vq_config, config.text_config
    grid = vision.image_size // vision.patch_size
    vq_down = 2 ** (len(vq.channel_multiplier) - 1)
    problems = []
    if vision.num_image_tokens != grid * grid:
        problems.append(
            f"vision_config.num_image_tokens={vision.num_image_tokens} != (image_size/patch_size)^2={grid**2}"
        )
    if vision.image_size // vq_down != grid:
        problems.append(
            f"VQ grid image_size/2^(len(channel_multiplier)-1)={vision.image_size // vq_down} != {grid}"
        )
    dims = {
        "vision_config.projection_dim": vision.projection_dim,
        "vq_config.projection_dim": vq.projection_dim,
        "vq_config.image_token_embed_dim": vq.image_token_embed_dim,
    }
    for name, value in dims.items():
        if value != text.hidden_size:
            problems.append(f"{name}={value} != text_config.hidden_size={text.hidden_size}")
    if problems:
        raise ValueError("model.arch: " + "; ".join(problems))


def _check_lengths(images: ImageBatch, per_example: Sequence, candidates: Sequence) -> None:
    n = images.shape[0] if isinstance(images, torch.Tensor) else len(images)
    if not (n == len(per_example) == len(candidates)):
        raise ValueError(
            f"batch sizes differ: {n} images, {len(per_example)} prompts/boxes, "
            f"{len(candidates)} candidate lists"
        )


def _pad(seqs: list[list[int]], pad_id: int, left: bool, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, mask)`` ``[N, max_len]`` (mask 1 = token), padded on the left or the right."""
    width = max(len(s) for s in seqs)
    if left:
        ids = [[pad_id] * (width - len(s)) + list(s) for s in seqs]
        mask = [[0] * (width - len(s)) + [1] * len(s) for s in seqs]
    else:
        ids = [list(s) + [pad_id] * (width - len(s)) for s in seqs]
        mask = [[1] * len(s) + [0] * (width - len(s)) for s in seqs]
    return (torch.tensor(ids, dtype=torch.long, device=device),
            torch.tensor(mask, dtype=torch.long, device=device))


def _common_prefix_length(seqs: list[list[int]], limit: int) -> int:
    """Length of the longest prefix all ``seqs`` share, at most ``limit``."""
    n = 0
    while n < limit and all(s[n] == seqs[0][n] for s in seqs):
        n += 1
    return n


def _to_grid(values: torch.Tensor, example_of: list[int], shape: tuple[int, int], lengths: list[int]):
    """Scatter per-row values to ``([B, K] values, [B, K] lengths, [B, K] mask)``.

    ``example_of[r]`` is the example of row ``r``; rows of one example are consecutive, in candidate order.
    """
    B, K = shape
    k_of = [0] * len(example_of)
    for i in range(1, len(example_of)):
        k_of[i] = k_of[i - 1] + 1 if example_of[i] == example_of[i - 1] else 0
    b_idx = torch.tensor(example_of, device=values.device)
    k_idx = torch.tensor(k_of, device=values.device)
    grid = values.new_zeros(B, K).index_put((b_idx, k_idx), values)
    num = torch.zeros(B, K, dtype=torch.long, device=values.device).index_put(
        (b_idx, k_idx), torch.tensor(lengths, device=values.device)
    )
    mask = torch.zeros(B, K, dtype=torch.bool, device=values.device).index_put(
        (b_idx, k_idx), torch.ones(len(example_of), dtype=torch.bool, device=values.device)
    )
    return grid, num, mask


def _scores(sum_nll: torch.Tensor, num: torch.Tensor, mask: torch.Tensor, truncated: int) -> Scores:
    if truncated:
        logger.warning("%d candidate(s) longer than max_target_length were truncated", truncated)
    nll = sum_nll / num.clamp(min=1).to(sum_nll.dtype)
    return Scores(nll=nll, sum_nll=sum_nll, mask=mask, num_tokens=num, num_truncated=int(truncated))
