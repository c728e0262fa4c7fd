"""A decoupled pipeline -- an understanding VLM plus a diffusion generator -- as one :class:`UnifiedModel`.

The Telephone Game paper (``shared/papers/telephone-game-semantic-drift.txt``, section 3) compares
unified models with *decoupled* pipelines such as LLaVA-1.5 + SDXL, whose two directions share no
weights. This backend builds such a pipeline from two local checkpoints so that CocoCon, drift chains
and UReason run on it through the same interface as OFA and Janus:

* **I2T** -- any transformers ``AutoModelForImageTextToText`` (LLaVA, Qwen2-VL, SmolVLM, ...) with its
  ``AutoProcessor``: ``score_text``, ``score_boxes``, ``caption``, ``answer``, ``locate``, ``reason``.
* **T2I** -- any diffusers pipeline (``DiffusionPipeline.from_pretrained``: SD 1.x/2.x, SDXL, PixArt, ...)
  for ``generate_image``; ``score_image`` needs a UNet pipeline (SD 1.x/2.x or SDXL).

It reads the two checkpoint directories and touches nothing else; it has no training hooks (LoRA,
gradient checkpointing), though its scores are differentiable when grad is enabled.

Text scores (``score_text``, ``score_boxes``)
--------------------------------------------
A prompt is the checkpoint's chat template over one user turn (``[image, text]``, or ``[text]`` for
``images=None``) with the generation prompt. A candidate's target tokens are what the template writes
for an assistant turn holding it: the ids of ``template(user, assistant=candidate)`` after those of
``template(user) + generation prompt`` (tokenised jointly, so the boundary is the tokenizer's own),
cut after the first end-of-sequence id (one is appended when the template writes none). The NLL is
the mean over these target tokens, EOS included (``base.py``), after at most ``max_target_length``.

Batched candidate scoring, per example: the K rows (prompt ids from the processor, then target ids)
share a token prefix -- the whole prompt with the image in ``score_text``, the prompt up to the first
differing word in ``score_boxes`` (where the K referring expressions vary and the box is fixed). That
prefix runs once with ``use_cache=True`` and ``logits_to_keep=1``; its KV cache is repeated over the K
rows (``Cache.batch_repeat_interleave``), whose remainders run as one right-padded batch, and the
prefix's last logits predict each row's first remaining token. Positions come from the cache length,
so models with their own position scheme (Qwen2-VL's M-RoPE deltas) continue correctly; the prefix is
never padded, which is why examples are not stacked into one prefix batch (left padding shifts
positions in a model-specific way). The shared prefix must contain the whole image (templates that
put the image first; others are refused).

Boxes are written in the VLM's own format (:data:`BOX_FORMATS`, chosen by ``box_format`` or by the
checkpoint's ``model_type``): ``unit`` ``"[0.12, 0.34, 0.56, 0.78]"`` (LLaVA-1.5's grounding data),
``qwen_vl`` ``"<|box_start|>(120,340),(560,780)<|box_end|>"`` (0-1000), and otherwise ``thousandths``
``"[120, 340, 560, 780]"`` (0-1000 integers, the Janus backend's plain convention, for VLMs without
a grounding format). ``locate`` generates an answer to the grounding prompt and parses it back.

Image scores (``score_image``): the diffusion-classifier ELBO proxy
---------------------------------------------------------------------
Li et al. 2023, "Your Diffusion Model is Secretly a Zero-Shot Classifier": for image x and caption c,

    x0 = vae.encode(x).latent_dist.mean * scaling_factor            (the mean: no encoder noise)
    x_t = sqrt(abar_t) x0 + sqrt(1 - abar_t) eps                      (the DDPM forward process)
    e(t, eps; c) = mean over latent elements of (f_theta(x_t, t, c) - target)^2
    score(x, c) = 1/n * sum_{i=1..n} e(t_i, eps_i; c)

with ``target`` = eps, v = sqrt(abar_t) eps - sqrt(1 - abar_t) x0, or x0 for the scheduler's
``prediction_type`` epsilon / v_prediction / sample. ``abar`` is the scheduler's ``alphas_cumprod``
(the training noise schedule, whatever sampler the pipeline uses for generation).

* **Timesteps** ``t_i = floor((i + 1/2) T / n)``, i = 0..n-1 (evenly spaced over the T training steps,
  Li et al.'s "even" scheme); ``n = score_timesteps`` (config key, default 32).
* **Noise** ``eps_i ~ N(0, I)`` from a CPU generator seeded with a hash of (``score_noise_seed``, the
  prepared image's pixels): identical for every candidate caption of an image, in every call, on
  every device and whatever the batch composition (so batched and one-at-a-time scores agree). It is
  seeded by the image's content rather than its position in a batch for that last property.
* **Weighting**: uniform over timesteps, i.e. the ELBO's per-timestep weights ``w_t`` are dropped (Ho
  et al.'s L_simple), as Li et al. do (they found the ELBO weights hurt classification).

``score`` is a Monte-Carlo estimate of ``E_{t, eps}[e]``: with n pairs its standard error is
``std_{t,eps}(e) / sqrt(n)``, dominated by the spread over t (errors are much larger at small t for
eps-prediction). Because all captions of an image share the same ``(t_i, eps_i)`` (common random
numbers), the *difference* between two captions -- all a ranking uses -- has the much smaller
variance ``Var(e_c - e_c') / n``. :meth:`DecoupledUnifiedModel.denoising_errors` returns the n
per-pair errors so that callers can estimate it.

``Scores.nll`` is ``score`` (lower = caption more likely, the NLL direction), ``sum_nll`` is the sum
over the n pairs and ``num_tokens`` is n. These "NLLs" are mean squared errors, on a different scale
than token NLLs; the consistency loss standardises each row (``unicon.losses.consistency``) and
CocoCon compares candidates only within a task, so the scale does not matter there.

Image generation
----------------
``generate_image`` calls the pipeline with ``guidance_scale`` (CFG in the diffusers convention,
1 = off), ``num_inference_steps`` (backend config; ``ImageGenerationConfig`` has no steps field) and a
CPU ``torch.Generator`` seeded with ``config.seed``. ``do_sample=False`` without a seed uses seed 0 --
the diffusion analogue of greedy decoding: the same prompt always gives the same image.
``temperature`` / ``top_k`` / ``top_p`` are token-sampling options and are refused when set;
``config.extra`` is passed to the pipeline call (e.g. ``negative_prompt``, ``num_inference_steps``).
UReason's ``[P, R]`` is ``prompt + "\\n" + context``; :meth:`fit_context` keeps it within the text
encoder's ``model_max_length``.

Image editing
-------------
``edit_image`` is SDEdit (Meng et al. 2022) through diffusers' image-to-image pipeline built from the
same components (``AutoPipelineForImage2Image.from_pipe``: ``StableDiffusionImg2ImgPipeline`` for SD
1.x/2.x, the SDXL one for SDXL): the source is noised ``edit_strength`` (config key, default 0.75;
``config.extra["strength"]`` per call) of the way up the schedule and denoised with the instruction as
the prompt, with ``generate_image``'s seed / guidance / steps. ``score_edit`` is the diffusion-classifier
proxy of ``score_image`` over the timesteps below img2img's start, plus the KL of the chain's start
(the noised source) against the noised target: the only place an SD UNet sees the source
(:meth:`DecoupledUnifiedModel.score_edit`). Pipelines without a UNet image-to-image counterpart set
``supports_editing`` False and refuse both calls (``EditingNotSupported``).
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import re
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.nn.functional as F
from PIL import Image
from torch import nn

from unicon.core import ImageBatch, config_dict, tensor_to_pil, torch_dtype
from unicon.errors import UserError
from unicon.models.base import (
    Box,
    EditingNotSupported,
    EmbeddingNotSupported,
    ImageGenerationConfig,
    Scores,
    TextGeneration,
    UnifiedModel,
    check_candidates,
    pad_scores,
)
from unicon.models.boxes import format_box as format_thousandths_box
from unicon.models.boxes import parse_box as parse_thousandths_box
from unicon.models.registry import register_backend
from unicon.models.tiny_parts import build_tiny_llava, build_tiny_stable_diffusion

logger = logging.getLogger(__name__)

_MARKER_FILE = "unicon_model.json"
_NUM = r"\s*(-?\d+(?:\.\d+)?)\s*"


@dataclass
class DecoupledConfig:
    """Settings of :class:`DecoupledUnifiedModel` (the ``arch`` keys of ``configs/model/decoupled_*.yaml``)."""

    vlm_path: str = ""  # AutoModelForImageTextToText + AutoProcessor directory
    diffusion_path: str = ""  # DiffusionPipeline directory
    random_tiny_parts: bool = False  # build a random tiny LLaVA + SD 1.x instead (unicon.models.tiny_parts)
    caption_prompt: str = "Describe the image in one sentence."
    box_format: str | None = None  # a BOX_FORMATS key; None = by the VLM's model_type (else "thousandths")
    grounding_prompt: str | None = None  # with "{expression}"; None = the box format's own
    max_target_length: int = 128  # target tokens scored per candidate (longer ones are cut and counted)
    image_size: int | None = None  # diffusion resolution; None = unet sample_size * vae scale factor
    score_timesteps: int = 32  # n (t, eps) pairs of the diffusion-classifier estimate
    score_noise_seed: int = 0  # mixed with each image's hash to seed its noise
    score_batch_size: int = 64  # denoiser rows per forward in score_image
    num_inference_steps: int = 30  # sampler steps of generate_image
    guidance_scale: float = 7.5  # default CFG scale of generate_image (and edit_image)
    edit_strength: float = 0.75  # img2img strength of edit_image / score_edit (edit_image: extra['strength'] wins)
    max_new_tokens: int = 32  # caption / answer / locate generation length

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], source: str = "model.arch") -> "DecoupledConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise UserError(f"{source}: unknown decoupled-backend keys {unknown} (known: {sorted(known)})")
        cfg = cls(**values)
        if cfg.box_format is not None and cfg.box_format not in BOX_FORMATS:
            raise UserError(f"{source}.box_format {cfg.box_format!r} is not one of {sorted(BOX_FORMATS)}")
        for name in ("score_timesteps", "score_batch_size", "num_inference_steps", "max_target_length"):
            if getattr(cfg, name) < 1:
                raise UserError(f"{source}.{name} must be >= 1, got {getattr(cfg, name)}")
        if not 0.0 < cfg.edit_strength <= 1.0:
            raise UserError(f"{source}.edit_strength must be in (0, 1], got {cfg.edit_strength}")
        return cfg


# ---------------------------------------------------------------------------------------------
# Box formats
# ---------------------------------------------------------------------------------------------
def _corners(box: Box, width: float, height: float) -> tuple[float, float, float, float]:
    if len(box) != 4:
        raise ValueError(f"box {list(box)} must have 4 numbers [x, y, w, h]")
    x, y, w, h = (float(v) for v in box)
    return tuple(min(max(c, 0.0), 1.0) for c in (x / width, y / height, (x + w) / width, (y + h) / height))


def _from_corners(values: Sequence[float], scale: float, width: float, height: float) -> list[float]:
    x1, y1, x2, y2 = (v / scale for v in values)
    x1, x2 = sorted((x1, x2))
    y1, y2 = sorted((y1, y2))
    return [x1 * width, y1 * height, (x2 - x1) * width, (y2 - y1) * height]


@dataclass(frozen=True)
class BoxFormat:
    """How a VLM writes a box as text: ``format(box, W, H)`` and its inverse ``parse(text, W, H)``
    (``[x, y, w, h]`` pixels, ``None`` when the text holds no box), and the grounding instruction."""

    format: Callable[[Box, float, float], str]
    parse: Callable[[str, float, float], list[float] | None]
    prompt: str


def _unit_format(box, width, height):
    return "[" + ", ".join(f"{c:.2f}" for c in _corners(box, width, height)) + "]"


_UNIT_RE = re.compile(r"\[" + ",".join([_NUM] * 4) + r"\]")
_QWEN_RE = re.compile(r"\(" + _NUM + "," + _NUM + r"\)\s*,\s*\(" + _NUM + "," + _NUM + r"\)")


def _unit_parse(text, width, height):
    m = _UNIT_RE.search(text)
    return None if m is None else _from_corners([float(g) for g in m.groups()], 1.0, width, height)


def _qwen_format(box, width, height):
    x1, y1, x2, y2 = (int(round(1000 * c)) for c in _corners(box, width, height))
    return f"<|box_start|>({x1},{y1}),({x2},{y2})<|box_end|>"


def _qwen_parse(text, width, height):
    m = _QWEN_RE.search(text)
    return None if m is None else _from_corners([float(g) for g in m.groups()], 1000.0, width, height)


#: box text formats by name; ``model_type`` -> format for VLMs that have their own (others: thousandths)
BOX_FORMATS = {
    "unit": BoxFormat(_unit_format, _unit_parse,
                      "Please provide the bounding box coordinate of the region this sentence describes: {expression}"),
    "qwen_vl": BoxFormat(_qwen_format, _qwen_parse,
                         "Output the bounding box of <|object_ref_start|>{expression}<|object_ref_end|>"),
    "thousandths": BoxFormat(format_thousandths_box, parse_thousandths_box,
                             'Which region does the text "{expression}" describe? '
                             "Answer with a box [x1, y1, x2, y2] in coordinates normalised to 0-1000."),
}
MODEL_BOX_FORMATS = {"llava": "unit", "qwen2_vl": "qwen_vl"}


# ---------------------------------------------------------------------------------------------
# The unified model
# ---------------------------------------------------------------------------------------------
@register_backend("decoupled")
class DecoupledUnifiedModel(UnifiedModel):
    """VLM (I2T) + diffusion pipeline (T2I); see the module docstring for prompts and scores.

    ``supports_editing`` is True on an instance whose pipeline has a UNet and an image-to-image
    counterpart in diffusers (SD 1.x/2.x, SDXL); others set it False and refuse both edit calls."""

    supports_editing = True

    def __init__(self, vlm, processor, pipeline, settings: DecoupledConfig):
        super().__init__()
        self.vlm = vlm
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.tokenizer.padding_side = "left"  # generation batches
        self.pipeline = pipeline
        pipeline.set_progress_bar_config(disable=True)
        # the pipeline's networks as submodules: .to(), parameters() and state_dict() see them
        self.diffusion = nn.ModuleDict({k: v for k, v in pipeline.components.items() if isinstance(v, nn.Module)})
        self.settings = settings
        self.caption_prompt = settings.caption_prompt
        box_name = settings.box_format or MODEL_BOX_FORMATS.get(vlm.config.model_type, "thousandths")
        self.box_format = BOX_FORMATS[box_name]
        self.grounding_prompt = settings.grounding_prompt or self.box_format.prompt
        eos = vlm.generation_config.eos_token_id
        if eos is None:
            eos = self.tokenizer.eos_token_id
        if eos is None:
            raise UserError(f"{settings.vlm_path}: neither generation_config nor the tokenizer names an EOS token")
        self.eos_ids = [eos] if isinstance(eos, int) else list(eos)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos_ids[0]
        vae_scale = 2 ** (len(pipeline.vae.config.block_out_channels) - 1) if hasattr(pipeline, "vae") else 8
        denoiser = getattr(pipeline, "unet", None) or getattr(pipeline, "transformer", None)
        sample = getattr(getattr(denoiser, "config", None), "sample_size", None)
        self.image_size = int(settings.image_size or (sample * vae_scale if isinstance(sample, int) else 512))
        self._img2img, self._no_img2img = None, ""
        if getattr(pipeline, "unet", None) is None:
            self._no_img2img = f"{type(pipeline).__name__} has no UNet"
        else:
            from diffusers import AutoPipelineForImage2Image

            try:  # shares the pipeline's components (no weights are copied)
                self._img2img = AutoPipelineForImage2Image.from_pipe(pipeline)
                self._img2img.set_progress_bar_config(disable=True)
            except ValueError as e:
                self._no_img2img = str(e).splitlines()[0]
        self.supports_editing = self._img2img is not None

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def from_config(cls, model_cfg: Any, world_root: Any = None) -> "DecoupledUnifiedModel":
        """The model of a ``model:`` section: ``arch`` holds the :class:`DecoupledConfig` keys
        (``vlm_path`` and ``diffusion_path`` required); ``dtype``, ``allow_pickle`` and
        ``trust_remote_code`` are the section's own. ``world_root`` is accepted for
        ``unicon.models.build_model`` and ignored (both checkpoints bring their own vocabularies)."""
        cfg = config_dict(model_cfg)
        if cfg.get("backend", "decoupled") != "decoupled":
            raise UserError(f"model.backend is {cfg.get('backend')!r}, expected 'decoupled'")
        if cfg.get("pretrained"):
            raise UserError("model.pretrained is not used by the decoupled backend: set model.arch.vlm_path "
                            "and model.arch.diffusion_path")
        settings = DecoupledConfig.from_dict(dict(cfg.get("arch") or {}))
        return cls.load(settings, dtype=cfg.get("dtype"), allow_pickle=bool(cfg.get("allow_pickle", False)),
                        trust_remote_code=bool(cfg.get("trust_remote_code", False)))

    @classmethod
    def load(cls, settings: DecoupledConfig, dtype: str | None = None, allow_pickle: bool = False,
             trust_remote_code: bool = False) -> "DecoupledUnifiedModel":
        """Load the VLM from ``settings.vlm_path`` and the pipeline from ``settings.diffusion_path``
        (local directories; safetensors only unless ``allow_pickle``)."""
        from diffusers import DiffusionPipeline
        from transformers import AutoModelForImageTextToText, AutoProcessor

        if settings.random_tiny_parts:
            return cls._load_random_tiny_parts(settings, dtype)
        weights_dtype = torch_dtype(dtype) if dtype else None
        for key in ("vlm_path", "diffusion_path"):
            path = getattr(settings, key)
            if not path or not Path(path).expanduser().is_dir():
                raise UserError(f"model.arch.{key}: {path!r} is not a local directory")
        vlm_dir, diffusion_dir = (str(Path(p).expanduser()) for p in (settings.vlm_path, settings.diffusion_path))
        if not (Path(vlm_dir) / "config.json").is_file():
            raise UserError(f"model.arch.vlm_path {vlm_dir}: no config.json (expected a transformers checkpoint)")
        if not (Path(diffusion_dir) / "model_index.json").is_file():
            raise UserError(f"model.arch.diffusion_path {diffusion_dir}: no model_index.json "
                            "(expected a diffusers pipeline saved with save_pretrained)")
        try:
            vlm = AutoModelForImageTextToText.from_pretrained(
                vlm_dir, dtype=weights_dtype, use_safetensors=None if allow_pickle else True,
                trust_remote_code=trust_remote_code)
            processor = AutoProcessor.from_pretrained(vlm_dir, trust_remote_code=trust_remote_code)
        except (OSError, ValueError) as e:
            raise UserError(f"model.arch.vlm_path {vlm_dir}: {str(e).splitlines()[0]}") from None
        try:
            pipeline = DiffusionPipeline.from_pretrained(
                diffusion_dir, dtype=weights_dtype or torch.float32,
                use_safetensors=None if allow_pickle else True)
        except (OSError, ValueError) as e:
            raise UserError(f"model.arch.diffusion_path {diffusion_dir}: {str(e).splitlines()[0]}") from None
        return cls(vlm, processor, pipeline, settings)

    @classmethod
    def _load_random_tiny_parts(cls, settings: DecoupledConfig, dtype: str | None) -> "DecoupledUnifiedModel":
        """``random_tiny_parts``: build the tiny LLaVA and SD 1.x of :mod:`unicon.models.tiny_parts` at
        ``image_size`` (default 32) in a temporary folder and load them as checkpoints are loaded."""
        import tempfile

        if settings.vlm_path or settings.diffusion_path:
            raise UserError("model.arch.random_tiny_parts builds both parts: leave vlm_path and diffusion_path "
                            f"empty (got {settings.vlm_path!r}, {settings.diffusion_path!r})")
        size = settings.image_size or 32
        with tempfile.TemporaryDirectory(prefix="unicon-decoupled-tiny-") as tmp:
            built = replace(settings, random_tiny_parts=False,
                            vlm_path=str(build_tiny_llava(Path(tmp) / "vlm", size)),
                            diffusion_path=str(build_tiny_stable_diffusion(Path(tmp) / "diffusion", size)))
            model = cls.load(built, dtype=dtype)
        model.settings = replace(settings, vlm_path="<random tiny LLaVA>", diffusion_path="<random tiny SD 1.x>")
        return model

    @classmethod
    def from_pretrained(cls, path: str, dtype: str | None = None, allow_pickle: bool = False,
                        trust_remote_code: bool = False, map_location: str | torch.device | None = None,
                        **_ignored) -> "DecoupledUnifiedModel":
        """A directory written by :meth:`save_pretrained` (``vlm/``, ``diffusion/``, ``unicon_model.json``)."""
        root = Path(path)
        marker = root / _MARKER_FILE
        if not marker.is_file():
            raise UserError(f"{root}: no {_MARKER_FILE}; expected a directory written by "
                            "DecoupledUnifiedModel.save_pretrained")
        meta = json.loads(marker.read_text())
        if meta.get("backend") != cls.backend:
            raise UserError(f"{marker}: backend is {meta.get('backend')!r}, expected {cls.backend!r}")
        settings = DecoupledConfig.from_dict({**meta.get("settings", {}), "vlm_path": str(root / "vlm"),
                                              "diffusion_path": str(root / "diffusion")}, source=str(marker))
        model = cls.load(settings, dtype=dtype, allow_pickle=allow_pickle, trust_remote_code=trust_remote_code)
        return model.to(map_location) if map_location is not None else model

    def save_pretrained(self, path: str) -> None:
        root = Path(path)
        root.mkdir(parents=True, exist_ok=True)
        self.vlm.save_pretrained(root / "vlm")
        self.processor.save_pretrained(root / "vlm")
        self.pipeline.save_pretrained(root / "diffusion")
        settings = {k: v for k, v in asdict(self.settings).items()
                    if k not in ("vlm_path", "diffusion_path", "random_tiny_parts")}  # the saved parts are real folders
        (root / _MARKER_FILE).write_text(json.dumps({"backend": self.backend, "settings": settings}, indent=1))

    # ---- inputs -------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.vlm.device

    def prepare_images(self, images: ImageBatch) -> torch.Tensor:
        """``[B, 3, S, S]`` in [0, 1] at the diffusion resolution S (shorter side resized to S, centre
        crop). The VLM reads such tensors back as PIL images (exact for 8-bit sources)."""
        S = self.image_size
        if isinstance(images, torch.Tensor):
            if images.ndim != 4 or images.shape[1] != 3 or tuple(images.shape[-2:]) != (S, S):
                raise ValueError(f"expected prepared images [B, 3, {S}, {S}] in [0, 1], got {tuple(images.shape)}")
            return images
        import numpy as np

        out = []
        for i, im in enumerate(_check_pil(images)):
            im = im.convert("RGB")
            scale = S / min(im.size)
            w, h = max(S, round(im.width * scale)), max(S, round(im.height * scale))
            im = im.resize((w, h), Image.BICUBIC)
            left, top = (w - S) // 2, (h - S) // 2
            im = im.crop((left, top, left + S, top + S))
            out.append(torch.from_numpy(np.asarray(im, dtype=np.float32) / 255.0).permute(2, 0, 1))
        return torch.stack(out)

    def _pil(self, images: ImageBatch) -> list[Image.Image]:
        return tensor_to_pil(self.prepare_images(images)) if isinstance(images, torch.Tensor) else _check_pil(images)

    # ---- prompts ------------------------------------------------------------------------
    def _turn(self, question: str, with_image: bool) -> list[dict]:
        content = ([{"type": "image"}] if with_image else []) + [{"type": "text", "text": question.strip()}]
        return [{"role": "user", "content": content}]

    def _prompt_text(self, question: str, with_image: bool) -> str:
        return self.processor.apply_chat_template(self._turn(question, with_image), add_generation_prompt=True,
                                                  tokenize=False)

    def _target_ids(self, question: str, with_image: bool, answer: str) -> tuple[list[int], bool]:
        """Ids of ``answer`` as the template writes the assistant turn, up to and including EOS."""
        turn = self._turn(question, with_image)
        prompt = self.processor.apply_chat_template(turn, add_generation_prompt=True, tokenize=False)
        reply = [{"role": "assistant", "content": [{"type": "text", "text": answer.strip()}]}]
        full = self.processor.apply_chat_template(turn + reply, tokenize=False)
        if not full.startswith(prompt):
            raise ValueError(f"{self.settings.vlm_path}: the chat template's assistant turn does not continue its "
                             "generation prompt; candidates cannot be scored as replies")
        prompt_ids = self.tokenizer(prompt)["input_ids"]
        full_ids = self.tokenizer(full)["input_ids"]
        if full_ids[: len(prompt_ids)] != prompt_ids:
            raise ValueError(f"{self.settings.vlm_path}: the reply's first token merges with the end of the prompt "
                             f"({prompt[-20:]!r}); cannot separate the scored tokens")
        target = full_ids[len(prompt_ids):]
        end = next((i for i, t in enumerate(target) if t in self.eos_ids), None)
        target = target[: end + 1] if end is not None else target + [self.eos_ids[0]]
        if len(target) > self.settings.max_target_length:
            return target[: self.settings.max_target_length], True
        return target, False

    def _prompt_inputs(self, question: str, image: Image.Image | None) -> dict:
        """Processor output (image placeholders expanded, pixel values) for one prompt, on the device."""
        text = self._prompt_text(question, image is not None)
        inputs = self.processor(text=[text], images=None if image is None else [image.convert("RGB")],
                                return_tensors="pt")
        return {k: (v.to(self.device, self.vlm.dtype) if torch.is_floating_point(v) else v.to(self.device))
                for k, v in inputs.items()}

    # ---- text scoring -------------------------------------------------------------------
    def _replies_nll(self, image: Image.Image | None, questions: Sequence[str],
                     answers: Sequence[str]) -> tuple[list[torch.Tensor], list[int], int]:
        """Summed NLL of ``answers[k]`` replying to ``questions[k]``, all about one image.

        The K rows (prompt ids + target ids) share a token prefix: the whole prompt when only the
        answers vary, up to the first differing word when the questions do. That prefix (holding the
        image) runs once; its KV cache is repeated over the K rows, whose remainders run as one
        right-padded batch. Returns (sums, target lengths, number of truncated targets)."""
        prompts = {q: self._prompt_inputs(q, image) for q in dict.fromkeys(questions)}
        rows, n_target, truncated = [], [], 0
        for q, a in zip(questions, answers):
            target, cut = self._target_ids(q, image is not None, a)
            truncated += cut
            rows.append(prompts[q]["input_ids"][0].tolist() + target)
            n_target.append(len(target))
        P = min(len(prompts[q]["input_ids"][0]) for q in questions)
        for row in rows[1:]:
            P = next((i for i, (x, y) in enumerate(zip(rows[0][:P], row[:P])) if x != y), P)
        image_token = getattr(self.vlm.config, "image_token_id", None)
        if image_token is not None and any(image_token in row[P:] for row in rows):
            raise ValueError(f"{self.settings.vlm_path}: the prompts differ before the image ends; the chat "
                             "template must place the image before the text")
        prefix = {k: v for k, v in prompts[questions[0]].items() if k not in ("input_ids", "attention_mask")}
        ids = torch.tensor(rows[0][:P], device=self.device)[None]
        out = self.vlm(input_ids=ids, attention_mask=torch.ones_like(ids), **prefix, use_cache=True,
                       logits_to_keep=1)
        K, width = len(rows), max(len(r) for r in rows) - P
        tokens = torch.full((K, width), self.pad_id, dtype=torch.long, device=self.device)
        real = torch.zeros((K, width), dtype=torch.bool, device=self.device)
        scored = torch.zeros((K, width), dtype=torch.bool, device=self.device)
        for k, (row, n) in enumerate(zip(rows, n_target)):
            tokens[k, : len(row) - P] = torch.tensor(row[P:], device=self.device)
            real[k, : len(row) - P] = True
            scored[k, len(row) - P - n: len(row) - P] = True
        logits = out.logits[:, -1:].expand(K, 1, -1)  # predicts each row's token P
        if width > 1:
            cache = out.past_key_values
            cache.batch_repeat_interleave(K)
            mask = torch.cat([torch.ones((K, P), dtype=torch.long, device=self.device), real[:, :-1].long()], 1)
            rest = self.vlm(input_ids=tokens[:, :-1], attention_mask=mask, past_key_values=cache, use_cache=True)
            logits = torch.cat([logits, rest.logits], dim=1)
        token_nll = F.cross_entropy(logits.float().transpose(1, 2), tokens, reduction="none")
        return list((token_nll * scored).sum(-1)), n_target, truncated

    def _scores(self, sums: list[list[torch.Tensor]], lengths: list[list[int]], truncated: int) -> Scores:
        like = sums[0][0]
        sum_nll, mask = pad_scores(sums, like)
        num, _ = pad_scores([[like.new_tensor(float(n)) for n in row] for row in lengths], like)
        if truncated:
            logger.warning("%d candidate(s) longer than max_target_length=%d were truncated", truncated,
                           self.settings.max_target_length)
        return Scores(nll=sum_nll / num.clamp(min=1), sum_nll=sum_nll, mask=mask, num_tokens=num.long(),
                      num_truncated=truncated)

    def score_text(self, images: ImageBatch | None, prompts: Sequence[str],
                   candidates: Sequence[Sequence[str]]) -> Scores:
        check_candidates(candidates)
        if images is not None:
            _check_lengths(images, prompts, candidates)
        elif len(prompts) != len(candidates):
            raise ValueError(f"batch sizes differ: {len(prompts)} prompts, {len(candidates)} candidate lists")
        pil = [None] * len(prompts) if images is None else self._pil(images)
        sums, lengths, truncated = [], [], 0
        for im, prompt, cands in zip(pil, prompts, candidates):
            row, n, cut = self._replies_nll(im, [prompt] * len(cands), cands)
            sums.append(row)
            lengths.append(n)
            truncated += cut
        return self._scores(sums, lengths, truncated)

    def score_boxes(self, images: ImageBatch, expressions: Sequence[Sequence[str]], boxes: Sequence[Box]) -> Scores:
        check_candidates(expressions, "expressions")
        _check_lengths(images, boxes, expressions)
        sums, lengths, truncated = [], [], 0
        for im, exprs, box in zip(self._pil(images), expressions, boxes):
            questions = [self.grounding_prompt.format(expression=e.strip()) for e in exprs]
            row, n, cut = self._replies_nll(im, questions, [self.box_format.format(box, *im.size)] * len(exprs))
            sums.append(row)
            lengths.append(n)
            truncated += cut
        return self._scores(sums, lengths, truncated)

    # ---- image scoring ------------------------------------------------------------------
    def _denoiser(self):
        unet = getattr(self.pipeline, "unet", None)
        if unet is None:
            raise UserError(f"score_image needs a UNet diffusion pipeline (SD 1.x/2.x, SDXL); "
                            f"{type(self.pipeline).__name__} at {self.settings.diffusion_path} has none")
        return unet

    def _text_conditioning(self, texts: list[str]) -> dict:
        """UNet keyword arguments conditioning on ``texts`` (SDXL adds pooled embeddings and size ids)."""
        pipe, device = self.pipeline, self._denoiser().device
        if hasattr(pipe, "text_encoder_2"):  # SDXL
            embeds, _, pooled, _ = pipe.encode_prompt(texts, device=device, num_images_per_prompt=1,
                                                      do_classifier_free_guidance=False)
            S = self.image_size
            time_ids = pipe._get_add_time_ids((S, S), (0, 0), (S, S), dtype=embeds.dtype,
                                              text_encoder_projection_dim=pipe.text_encoder_2.config.projection_dim)
            added = {"text_embeds": pooled, "time_ids": time_ids.to(device).expand(len(texts), -1)}
            return {"encoder_hidden_states": embeds, "added_cond_kwargs": added}
        embeds, _ = pipe.encode_prompt(texts, device, 1, False)
        return {"encoder_hidden_states": embeds}

    def _latents(self, pixels: torch.Tensor) -> torch.Tensor:
        vae = self.pipeline.vae
        latents = vae.encode((pixels * 2 - 1).to(vae.device, vae.dtype)).latent_dist.mean
        shift = getattr(vae.config, "shift_factor", None) or 0.0
        return (latents - shift) * vae.config.scaling_factor

    def _noise(self, pixels: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        """``score_timesteps`` standard-normal draws for one image, seeded by its content."""
        digest = hashlib.blake2b(pixels.detach().float().cpu().contiguous().numpy().tobytes(), digest_size=8,
                                 key=str(self.settings.score_noise_seed).encode()).digest()
        generator = torch.Generator().manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))
        return torch.randn((self.settings.score_timesteps, *shape), generator=generator)

    def score_timestep_values(self) -> torch.Tensor:
        """``t_i = floor((i + 1/2) T / n)``, the n evenly spaced training timesteps of the estimate."""
        T, n = self.pipeline.scheduler.config.num_train_timesteps, self.settings.score_timesteps
        return ((torch.arange(n, dtype=torch.float64) + 0.5) * T / n).floor().long()

    def denoising_errors(self, prompts: Sequence[Sequence[str]], images: ImageBatch,
                         contexts: Sequence[str] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-(t, eps) denoising errors ``[R, n]`` of every (image b, prompt k) row, in row-major
        (b, k) order, and the example index ``[R]`` of each row (see the module docstring)."""
        check_candidates(prompts, "prompts")
        n_images = images.shape[0] if isinstance(images, torch.Tensor) else len(images)
        if n_images != len(prompts):
            raise ValueError(f"got {len(prompts)} prompt lists but {n_images} images")
        if contexts is not None and len(contexts) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompt lists but {len(contexts)} contexts")
        pixels = self.prepare_images(images)
        x0 = self._latents(pixels).float()  # [B, C, h, w]
        texts = [_join(p, None if contexts is None else contexts[b]) for b, ps in enumerate(prompts) for p in ps]
        row_image = torch.tensor([b for b, ps in enumerate(prompts) for _ in ps], device=x0.device)
        return self._denoising_errors(pixels, x0, self.score_timestep_values(), texts, row_image), row_image

    def _denoising_errors(self, pixels: torch.Tensor, x0: torch.Tensor, t: torch.Tensor, texts: list[str],
                          row_image: torch.Tensor) -> torch.Tensor:
        """``e(t_i, eps_i; texts[r])`` ``[R, n]`` for the latents ``x0[row_image[r]]`` at the timesteps
        ``t`` ``[n]``, with the noise of :meth:`_noise` seeded by each image's ``pixels``."""
        unet = self._denoiser()
        scheduler = self.pipeline.scheduler
        prediction = scheduler.config.prediction_type
        if prediction not in ("epsilon", "v_prediction", "sample"):
            raise UserError(f"{self.settings.diffusion_path}: scheduler prediction_type {prediction!r} is not "
                            "epsilon, v_prediction or sample")
        eps = torch.stack([self._noise(p, tuple(x0.shape[1:])) for p in pixels]).to(x0.device)  # [B, n, C, h, w]
        t = t.to(x0.device)
        abar = scheduler.alphas_cumprod.to(x0.device, torch.float32)[t].view(1, -1, 1, 1, 1)
        x_t = abar.sqrt() * x0[:, None] + (1 - abar).sqrt() * eps  # [B, n, C, h, w]
        target = {"epsilon": eps, "v_prediction": abar.sqrt() * eps - (1 - abar).sqrt() * x0[:, None],
                  "sample": x0[:, None].expand_as(eps)}[prediction]
        cond = self._text_conditioning(texts)  # text encoder once per (image, prompt) row
        n = t.numel()
        pairs = torch.arange(len(texts) * n, device=x0.device)
        errors = []
        for chunk in pairs.split(self.settings.score_batch_size):
            r, i = chunk // n, chunk % n
            b = row_image[r]
            kwargs = {"encoder_hidden_states": cond["encoder_hidden_states"][r]}
            if "added_cond_kwargs" in cond:
                kwargs["added_cond_kwargs"] = {k: v[r] for k, v in cond["added_cond_kwargs"].items()}
            out = unet(x_t[b, i].to(unet.dtype), t[i], **kwargs).sample.float()
            out = out[:, : x0.shape[1]]  # learned-variance UNets also predict the variance channels
            errors.append((out - target[b, i]).pow(2).flatten(1).mean(-1))
        return torch.cat(errors).view(len(texts), n)

    def score_image(self, prompts: Sequence[Sequence[str]], images: ImageBatch,
                    contexts: Sequence[str] | None = None) -> Scores:
        """Diffusion-classifier scores (mean denoising error, lower = more likely), see the module docstring."""
        errors, row_image = self.denoising_errors(prompts, images, contexts)
        n = errors.shape[1]
        per_row: list[list[torch.Tensor]] = [[] for _ in prompts]
        for r, b in enumerate(row_image.tolist()):
            per_row[b].append(errors[r].sum())
        sum_nll, mask = pad_scores(per_row, errors)
        return Scores(nll=sum_nll / n, sum_nll=sum_nll, mask=mask,
                      num_tokens=torch.where(mask, n, 0).to(torch.long), num_truncated=0)

    # ---- text generation ----------------------------------------------------------------
    @torch.no_grad()
    # ---- EditingScore embeddings (UnifiedModel.image_latents / embed_image / embed_text) ----------
    @torch.no_grad()
    def image_latents(self, images: ImageBatch) -> torch.Tensor:
        """The diffusion VAE's latents of the image (:meth:`_latents`: posterior mean, shifted and scaled
        as the denoiser sees them, at the diffusion resolution), **flattened**: ``[B, C * h * w]``.
        A pipeline without a VAE raises :class:`~unicon.models.base.EmbeddingNotSupported`."""
        if getattr(self.pipeline, "vae", None) is None:
            raise EmbeddingNotSupported(f"the decoupled backend's pipeline {type(self.pipeline).__name__} has no VAE: "
                                        "no image latents for EditingScore")
        return self._latents(self.prepare_images(images)).float().flatten(1)

    @torch.no_grad()
    def _mean_vlm_state(self, inputs: dict, pool: torch.Tensor) -> torch.Tensor:
        hidden = self.vlm(**inputs, output_hidden_states=True, use_cache=False).hidden_states[-1][0].float()
        w = pool[0].unsqueeze(-1).float()
        return (hidden * w).sum(0) / w.sum(0)

    def embed_image(self, images: ImageBatch) -> torch.Tensor:
        """The VLM's last hidden states over the image's placeholder tokens (the chat template's user turn
        ``[image, ""]``, one image per forward), **mean-pooled**: ``[B, D]`` in the VLM's space, that of
        :meth:`embed_text`. A VLM whose config names no ``image_token_id`` raises
        :class:`~unicon.models.base.EmbeddingNotSupported`."""
        token = getattr(self.vlm.config, "image_token_id", None)
        if token is None:
            token = getattr(self.vlm.config, "image_token_index", None)
        if token is None:
            raise EmbeddingNotSupported(f"the decoupled backend's VLM at {self.settings.vlm_path} names no image token "
                                        "(config.image_token_id): no image embedding for EditingScore")
        out = []
        for im in self._pil(images):
            inputs = self._prompt_inputs("", im)
            out.append(self._mean_vlm_state(inputs, inputs["input_ids"] == token))
        return torch.stack(out)

    def embed_text(self, texts: Sequence[str]) -> torch.Tensor:
        """The VLM's last hidden states of the text alone (its tokenizer's special tokens, no chat template),
        **mean-pooled** over its tokens: ``[B, D]``, the space of :meth:`embed_image`."""
        out = []
        for t in texts:
            ids = self.tokenizer(t.strip(), return_tensors="pt")
            inputs = {k: v.to(self.device) for k, v in ids.items() if k in ("input_ids", "attention_mask")}
            out.append(self._mean_vlm_state(inputs, inputs["attention_mask"]))
        return torch.stack(out)

    def _generate_text(self, questions: Sequence[str], images: list[Image.Image] | None,
                       max_new_tokens: int, **kwargs) -> list[TextGeneration]:
        texts = [self._prompt_text(q, images is not None) for q in questions]
        inputs = self.processor(text=texts, images=None if images is None else [im.convert("RGB") for im in images],
                                padding=True, return_tensors="pt")
        inputs = {k: (v.to(self.device, self.vlm.dtype) if torch.is_floating_point(v) else v.to(self.device))
                  for k, v in inputs.items()}
        options = dict(do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=self.pad_id,
                       eos_token_id=self.eos_ids)
        options.update(kwargs)
        out = self.vlm.generate(**inputs, **options)
        results = []
        for row in out[:, inputs["input_ids"].shape[1]:].tolist():
            end = next((i for i, t in enumerate(row) if t in self.eos_ids), None)
            kept = [t for t in (row if end is None else row[:end]) if t != self.pad_id]
            text = self.tokenizer.decode(kept, skip_special_tokens=True).strip()
            results.append(TextGeneration(text=text, truncated=end is None, num_tokens=len(kept)))
        return results

    def caption(self, images: ImageBatch, prompt: str | None = None, **generate_kwargs) -> list[str]:
        pil = self._pil(images)
        max_new = generate_kwargs.pop("max_new_tokens", self.settings.max_new_tokens)
        return [g.text for g in self._generate_text([prompt or self.caption_prompt] * len(pil), pil, max_new,
                                                    **generate_kwargs)]

    def answer(self, images: ImageBatch, questions: Sequence[str], **generate_kwargs) -> list[str]:
        pil = self._pil(images)
        if len(questions) != len(pil):
            raise ValueError(f"got {len(questions)} questions for {len(pil)} images")
        max_new = generate_kwargs.pop("max_new_tokens", self.settings.max_new_tokens)
        return [g.text for g in self._generate_text(questions, pil, max_new, **generate_kwargs)]

    def locate(self, images: ImageBatch, expressions: Sequence[str]) -> torch.Tensor:
        """Generate an answer to the grounding prompt and parse the box format back; an answer
        without a box gives ``[0, 0, 0, 0]`` (counted in a warning)."""
        pil = self._pil(images)
        questions = [self.grounding_prompt.format(expression=e.strip()) for e in expressions]
        texts = [g.text for g in self._generate_text(questions, pil, self.settings.max_new_tokens)]
        boxes, failed = [], 0
        for text, im in zip(texts, pil):
            box = self.box_format.parse(text, *im.size)
            failed += box is None
            boxes.append(box if box is not None else [0.0, 0.0, 0.0, 0.0])
        if failed:
            logger.warning("locate: %d of %d answers held no box; gave empty boxes", failed, len(texts))
        return torch.tensor(boxes, dtype=torch.float32)

    def reason(self, prompts: Sequence[str], max_new_tokens: int = 256) -> list[TextGeneration]:
        return self._generate_text(prompts, None, max_new_tokens)

    # ---- image generation ---------------------------------------------------------------
    @property
    def image_generation_config(self) -> ImageGenerationConfig:
        return ImageGenerationConfig(guidance_scale=self.settings.guidance_scale)

    def fit_context(self, prompts: Sequence[str], contexts: Sequence[str]) -> tuple[list[str], list[int]]:
        """Cut contexts from the left, a word at a time, until ``prompt + "\\n" + context`` fits the
        pipeline's (first) text tokenizer's ``model_max_length``."""
        tokenizer = getattr(self.pipeline, "tokenizer", None)
        limit = getattr(tokenizer, "model_max_length", None)
        if tokenizer is None or limit is None or limit > 100_000:  # no tokenizer, or no real limit
            return list(contexts), [0] * len(contexts)
        kept, cut = [], []
        for prompt, context in zip(prompts, contexts):
            words = context.split()
            n = 0
            while n < len(words) and len(tokenizer(_join(prompt, " ".join(words[n:])))["input_ids"]) > limit:
                n += 1
            kept.append(" ".join(words[n:]))
            cut.append(n)
        return kept, cut

    def _sampler_options(self, config: ImageGenerationConfig) -> tuple[torch.Generator | None, dict]:
        """The pipeline-call options of ``config`` shared by :meth:`generate_image` and :meth:`edit_image`:
        a CPU generator (``seed``; seed 0 when ``do_sample=False`` without one), ``guidance_scale``,
        ``num_inference_steps`` and PIL output. Token-sampling options are refused."""
        token_sampling = {"temperature": (config.temperature, 1.0), "top_k": (config.top_k, 0),
                          "top_p": (config.top_p, 1.0)}
        set_options = sorted(k for k, (value, default) in token_sampling.items() if value != default)
        if set_options:
            raise ValueError(f"ImageGenerationConfig {set_options} are token-sampling options; a diffusion "
                             "pipeline has none (use guidance_scale, seed, extra={'num_inference_steps': ...})")
        seed = config.seed if config.seed is not None else (None if config.do_sample else 0)
        generator = None if seed is None else torch.Generator().manual_seed(int(seed))
        return generator, dict(num_inference_steps=self.settings.num_inference_steps,
                               guidance_scale=config.guidance_scale, output_type="pil")

    @torch.no_grad()
    def generate_image(self, prompts: Sequence[str], context: Sequence[str] | None = None,
                       config: ImageGenerationConfig | None = None) -> list[Image.Image]:
        config = config or self.image_generation_config
        if context is not None and len(context) != len(prompts):
            raise ValueError(f"got {len(context)} contexts for {len(prompts)} prompts")
        if config.num_candidates != 1:
            return self.best_of_candidates(prompts, context, config)
        generator, options = self._sampler_options(config)
        options.update(height=self.image_size, width=self.image_size)
        options.update(config.extra)
        texts = [_join(p, None if context is None else context[b]) for b, p in enumerate(prompts)]
        return list(self.pipeline(prompt=texts, generator=generator, **options).images)

    # ---- image editing ------------------------------------------------------------------
    def _image_to_image(self):
        """The image-to-image pipeline over this pipeline's components (``AutoPipelineForImage2Image.from_pipe``)."""
        if self._img2img is None:
            raise EditingNotSupported(f"the {self.backend} backend does not edit images with "
                                      f"{self.settings.diffusion_path}: {self._no_img2img}")
        return self._img2img

    @torch.no_grad()
    def edit_image(self, images: ImageBatch, instructions: Sequence[str],
                   config: ImageGenerationConfig | None = None) -> list[Image.Image]:
        """SDEdit-style image-to-image (diffusers' ``StableDiffusionImg2ImgPipeline`` / SDXL's, over the
        text-to-image pipeline's UNet, VAE, text encoder(s) and scheduler): the source, prepared at the
        diffusion resolution (:meth:`prepare_images`), is encoded by the VAE, noised to the timestep
        ``strength`` of the way up the sampler's schedule, and denoised with the instruction (stripped,
        as :meth:`generate_image` writes a prompt) as the text condition. ``strength`` is
        ``edit_strength`` unless ``config.extra["strength"]`` sets it; seed, guidance and
        ``num_inference_steps`` follow :meth:`generate_image` (the sampler runs ``int(steps * strength)``
        of them). Returns ``image_size`` x ``image_size`` RGB images, one per row."""
        n = images.shape[0] if isinstance(images, torch.Tensor) else len(images)
        if n != len(instructions):
            raise ValueError(f"got {n} images but {len(instructions)} instructions")
        config = config or self.image_generation_config
        if config.num_candidates != 1:
            raise ValueError("edit_image draws one image per instruction (num_candidates=1)")
        pipe = self._image_to_image()
        generator, options = self._sampler_options(config)
        options.update(strength=self.settings.edit_strength)
        options.update(config.extra)
        sources = tensor_to_pil(self.prepare_images(images))
        return list(pipe(prompt=[_join(t, None) for t in instructions], image=sources, generator=generator,
                         **options).images)

    def edit_start_timestep(self) -> int:
        """The training timestep ``t_s`` at which :meth:`edit_image` (with ``edit_strength`` and
        ``num_inference_steps``) starts its sampler, computed as diffusers' img2img ``get_timesteps``
        does: the scheduler's ``num_inference_steps`` timesteps, of which the last
        ``min(int(steps * strength), steps)`` run."""
        scheduler = copy.deepcopy(self._image_to_image().scheduler)
        steps = self.settings.num_inference_steps
        scheduler.set_timesteps(steps)
        start = max(steps - min(int(steps * self.settings.edit_strength), steps), 0)
        timesteps = scheduler.timesteps[start * scheduler.order:]
        if len(timesteps) == 0:
            raise UserError(f"model.arch.edit_strength={self.settings.edit_strength} with num_inference_steps="
                            f"{steps} leaves img2img no step to run")
        return int(timesteps[0])

    def score_edit(self, images: ImageBatch, instructions: Sequence[str], targets: ImageBatch) -> Scores:
        """``[B, 1]`` likelihood proxy of ``targets[b]`` under :meth:`edit_image`'s chain from ``images[b]``
        with ``instructions[b]``: the diffusion-classifier estimate of :meth:`score_image` restricted to
        the part of the schedule img2img runs, plus the source's only way into that chain, its start.

        The UNet of an SD pipeline does not read the source (it is not InstructPix2Pix): img2img
        starts from ``x_{t_s} ~ N(sqrt(abar_s) z_src, (1 - abar_s) I)`` (``t_s`` =
        :meth:`edit_start_timestep`, ``z`` the VAE latents of :meth:`_latents`) and denoises with the
        instruction. The ELBO of the target's latents ``z`` under that chain is the denoising terms for
        ``t < t_s`` plus ``KL(q(x_{t_s} | z) || N(sqrt(abar_s) z_src, (1 - abar_s) I))``, so the score
        per (t, eps) pair is

            e(t_i, eps_i; instruction) + abar_s / (2 (1 - abar_s)) * mean((z - z_src)^2)

        with ``t_i = floor((i + 1/2) t_s / n)``, ``n = score_timesteps``, ``e`` the mean squared
        denoising error of :meth:`score_image` (uniform weights over timesteps, Li et al.'s L_simple;
        noise seeded by the target's pixels) and the second term the exact per-element KL of the
        start. ``nll`` is the mean over the n pairs, ``sum_nll`` the sum, ``num_tokens`` n; lower =
        more likely; differentiable through the UNet, text encoder and VAE encoder."""
        n = images.shape[0] if isinstance(images, torch.Tensor) else len(images)
        m = targets.shape[0] if isinstance(targets, torch.Tensor) else len(targets)
        if not (n == len(instructions) == m):
            raise ValueError(f"got {n} images, {len(instructions)} instructions and {m} target images")
        t_s = self.edit_start_timestep()
        steps = self.settings.score_timesteps
        t = ((torch.arange(steps, dtype=torch.float64) + 0.5) * t_s / steps).floor().long()
        pixels = self.prepare_images(targets)
        z = self._latents(pixels).float()
        z_src = self._latents(self.prepare_images(images)).float()
        rows = torch.arange(n, device=z.device)
        errors = self._denoising_errors(pixels, z, t, [_join(i, None) for i in instructions], rows)  # [B, n]
        abar = self.pipeline.scheduler.alphas_cumprod[t_s].to(z.device, torch.float32)
        start = abar / (2 * (1 - abar)) * (z - z_src).pow(2).flatten(1).mean(-1)  # [B]
        sum_nll = (errors + start[:, None]).sum(-1, keepdim=True)
        return Scores(nll=sum_nll / steps, sum_nll=sum_nll, mask=torch.ones_like(sum_nll, dtype=torch.bool),
                      num_tokens=torch.full_like(sum_nll, steps, dtype=torch.long), num_truncated=0)


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------
def _join(prompt: str, context: str | None) -> str:
    """The T2I text: the prompt, followed by UReason's context on a new line when given."""
    return prompt.strip() if not context else f"{prompt.strip()}\n{context.strip()}"


def _check_pil(images) -> list[Image.Image]:
    images = list(images)
    for i, im in enumerate(images):
        if not isinstance(im, Image.Image):
            raise ValueError(f"image {i} is a {type(im).__name__}, expected a PIL image or a tensor from prepare_images")
    return images


def _check_lengths(images: ImageBatch, per_example: Sequence, candidates: Sequence) -> None:
    n = images.shape[0] if isinstance(images, torch.Tensor) else len(images)
    if not (n == len(per_example) == len(candidates)):
        raise ValueError(f"batch sizes differ: {n} images, {len(per_example)} prompts/boxes, "
                         f"{len(candidates)} candidate lists")
