"""The one interface every unified vision-language backend implements.

A *unified model* understands images (captioning, VQA, grounding: I2T) and
generates them (T2I). Everything else in unicon -- consistency training,
CocoCon, drift chains, UReason -- talks to a model only through
:class:`UnifiedModel`, so a new backend (OFA, Janus, ...) is one module that subclasses it and
registers itself with ``@register_backend(name)`` (:mod:`unicon.models.registry`).

Conventions shared by all backends
----------------------------------
* **Images** are passed as a list of ``PIL.Image.Image`` *or* as a float tensor
  ``[B, 3, H, W]`` already produced by :meth:`UnifiedModel.prepare_images`
  (the data loaders do this in worker processes for speed).
* **Boxes** are ``[x, y, w, h]`` in pixels of the *original* image, as in COCO
  and the CocoCon file.
* **Likelihood scores** are negative log-likelihoods: lower means more likely.
  ``Scores.nll[b, k]`` is the *length-normalised* NLL (mean over the target
  tokens, EOS included) of candidate ``k`` of example ``b``; ``Scores.sum_nll`` is
  the summed NLL. Both are differentiable when grad is enabled.
* **Prompts** are passed as written (a VQA question, a referring expression, a caption, a think
  prompt); each backend applies its own template (OFA: a leading space and its task
  instructions; Janus: the chat format). Training and evaluation therefore score the same text.
* **Ragged candidate lists** are padded to ``K = max_b K_b``; ``Scores.mask`` is
  True for real candidates. Padded entries hold 0.0 (never inf/nan, so that
  masked arithmetic keeps finite gradients).
* An **empty candidate list** for an example is a ``ValueError`` naming the
  example index. A candidate longer than the model's maximum target length is
  truncated and counted in ``Scores.num_truncated`` (and a warning is logged);
  it is never cut silently.
* **Batched scoring** must run the encoder (or the shared prefix) once per
  example and reuse it for all K candidates.

The three scoring directions mirror CocoCon section 4.3:

====================  =========================  ======================
method                input varies?              output (scored) varies?
====================  =========================  ======================
``score_text``        no (image + prompt)        yes (K captions/answers/traces)
``score_boxes``       yes (K expressions)        no (the gold box)
``score_image``       yes (K prompts)            no (the gold image's codes)
====================  =========================  ======================
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch
from PIL import Image
from torch import nn

from unicon.core import ImageBatch, ImageTokenizer

Box = Sequence[float]  # [x, y, w, h] in pixels


@dataclass
class Scores:
    """Per-candidate negative log-likelihoods, ``[B, K]`` each."""

    nll: torch.Tensor  # length-normalised (mean over target tokens)
    sum_nll: torch.Tensor  # summed over target tokens
    mask: torch.Tensor  # bool, True where a real candidate
    num_tokens: torch.Tensor  # long, target length used (after truncation)
    num_truncated: int = 0  # candidates that had to be cut to max length

    def __post_init__(self) -> None:
        if self.nll.shape != self.mask.shape:
            raise ValueError(f"nll {tuple(self.nll.shape)} and mask {tuple(self.mask.shape)} differ")


@dataclass
class TextGeneration:
    """Free text produced by ``reason`` (think-then-draw traces)."""

    text: str
    truncated: bool = False  # True when generation stopped at max_new_tokens
    num_tokens: int = 0


class EditingNotSupported(NotImplementedError):
    """The backend does not edit images (``UnifiedModel.supports_editing`` is False); the message
    names the backend and the call that was refused."""


class MultiImageNotSupported(NotImplementedError):
    """The backend takes one image per question (``UnifiedModel.supports_multi_image`` is False); the
    message names the backend and the call that was refused."""


class EmbeddingNotSupported(NotImplementedError):
    """The backend has no latents / joint embeddings for EditingScore (``image_latents``,
    ``embed_image``, ``embed_text``); the message names the backend and the call."""


@dataclass
class ImageGenerationConfig:
    """Options shared by every backend's ``generate_image``.

    ``guidance_scale`` > 1 enables classifier-free guidance: logits are
    ``l_uncond + s * (l_cond - l_uncond)``. ``do_sample=False`` is greedy.

    ``num_candidates`` = N > 1 draws N images per prompt and returns the one the model's own
    captioner finds most likely to say the prompt (:meth:`UnifiedModel.best_of_candidates`).
    """

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    guidance_scale: float = 1.0
    seed: int | None = None
    num_candidates: int = 1
    extra: dict = field(default_factory=dict)


class UnifiedModel(nn.Module, abc.ABC):
    """A model that scores and generates both text (I2T) and images (T2I)."""

    #: True on backends that implement :meth:`edit_image` and :meth:`score_edit`
    supports_editing: bool = False
    #: True on backends that implement :meth:`answer_images` (several images before one question)
    supports_multi_image: bool = False

    #: human-readable backend name, e.g. ``"ofa"`` or ``"janus"``
    backend: str = "abstract"
    #: the files of a world directory whose vocabulary a from-scratch model reads (OFA: the
    #: ShapesWorld's ``tokenizer.json`` and ``world.json``); none for a backend with its own
    world_vocabulary_files: tuple[str, ...] = ()
    #: the tokenizer whose codes ``score_image``/``generate_image`` use
    image_tokenizer: ImageTokenizer | None = None
    #: the instruction captioning is scored and generated with (the CocoCon anchor task);
    #: backends override it (OFA: " what does the image describe?")
    caption_prompt: str = "Describe the image."

    @classmethod
    def world_vocabulary(cls, world_root: str | Path | None) -> dict[str, str]:
        """Text of :attr:`world_vocabulary_files` under ``world_root`` (the files present; ``{}`` without
        a root). ``unicon train`` stores them in every ``.ckpt`` (key ``unicon_world_files``), so a
        checkpoint loads without the world, and rebuilding the world cannot change an old run's
        vocabulary."""
        if world_root is None:
            return {}
        root = Path(world_root)
        return {name: (root / name).read_text() for name in cls.world_vocabulary_files if (root / name).is_file()}

    # ---- training mode ------------------------------------------------------------
    def freeze_batchnorm(self) -> "UnifiedModel":
        """Keep every BatchNorm on its running statistics, with frozen affine parameters, also after
        ``train()`` (``model.freeze_batchnorm=true``). Per-GPU batches then do not change the
        normalisation, so DDP on N ranks computes what one process computes on the whole batch."""
        self._batchnorm_frozen = True
        for module in self.modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                module.eval()
                for p in module.parameters():
                    p.requires_grad_(False)
        return self

    def train(self, mode: bool = True) -> "UnifiedModel":
        super().train(mode)
        if getattr(self, "_batchnorm_frozen", False):
            for module in self.modules():
                if isinstance(module, nn.modules.batchnorm._BatchNorm):
                    module.eval()
        return self

    # ---- inputs -----------------------------------------------------------------
    @abc.abstractmethod
    def prepare_images(self, images: ImageBatch) -> torch.Tensor:
        """Convert/resize/normalise images to the encoder's input tensor.

        Images of another mode are converted to RGB; anything that is not an
        image is refused with a ``ValueError``. Tensors are passed through
        after a shape check.
        """

    # ---- likelihood scoring ---------------------------------------------------------
    @abc.abstractmethod
    def score_text(
        self, images: ImageBatch | None, prompts: Sequence[str], candidates: Sequence[Sequence[str]]
    ) -> Scores:
        """NLL of each candidate text given (image, prompt): ``[B] x [B][K] -> [B, K]``.

        ``images=None`` scores text-only continuations with exactly the prompt format of
        :meth:`reason` (think-then-draw traces: the training target of :meth:`reason`).
        """

    @abc.abstractmethod
    def score_boxes(
        self, images: ImageBatch, expressions: Sequence[Sequence[str]], boxes: Sequence[Box]
    ) -> Scores:
        """NLL of the fixed box ``boxes[b]`` given (image, expression k): ``[B][K] -> [B, K]``.

        ``boxes[b]`` is in pixels of ``images[b]`` (``image_sizes`` must be known:
        PIL inputs carry them; tensor inputs are assumed already at model size).
        """

    @abc.abstractmethod
    def score_image(self, prompts: Sequence[Sequence[str]], images: ImageBatch,
                    contexts: Sequence[str] | None = None) -> Scores:
        """NLL of the image's own tokens given each prompt k: ``[B][K] x [B] -> [B, K]``.

        ``contexts[b]``, when given, follows every prompt of row b, exactly as ``context`` does in
        :meth:`generate_image` (UReason's ``[P, R]``); cut it with :meth:`fit_context` first."""

    # ---- generation -----------------------------------------------------------------
    @abc.abstractmethod
    def caption(self, images: ImageBatch, prompt: str | None = None, **generate_kwargs) -> list[str]:
        """One caption per image (``prompt`` overrides the backend's captioning prompt)."""

    @abc.abstractmethod
    def answer(self, images: ImageBatch, questions: Sequence[str], **generate_kwargs) -> list[str]: ...

    def answer_images(self, images: Sequence[Sequence[Image.Image]], questions: Sequence[str],
                      **generate_kwargs) -> list[str]:
        """One generated reply per question, where ``images[b]`` is the list of PIL images of row ``b``
        (one or more), shown to the model in that order before ``questions[b]``, in one user turn (the
        backend's own multi-image layout; see its docstring). :meth:`answer` is the one-image case. A
        row without images, or ``len(images) != len(questions)``, is a ``ValueError``. Backends that
        take several images set :attr:`supports_multi_image`; the default raises
        :class:`MultiImageNotSupported` naming the backend."""
        raise MultiImageNotSupported(f"the {self._backend_name()} backend takes one image per question "
                                     "(answer_images)")

    @abc.abstractmethod
    def locate(self, images: ImageBatch, expressions: Sequence[str]) -> torch.Tensor:
        """``[B, 4]`` boxes ``[x, y, w, h]`` in pixels of each input image."""

    @property
    def image_generation_config(self) -> ImageGenerationConfig:
        """The model's default image-generation settings (used when ``generate_image`` gets no
        ``config``; callers that set a seed start from a copy of it). Greedy unless a backend's
        saved settings say otherwise."""
        return ImageGenerationConfig()

    @abc.abstractmethod
    def generate_image(
        self,
        prompts: Sequence[str],
        context: Sequence[str] | None = None,
        config: ImageGenerationConfig | None = None,
    ) -> list[Image.Image]:
        """Text-to-image through image tokens and ``image_tokenizer.decode``.

        ``context[b]``, when given, is extra conditioning text (a reasoning trace) placed
        *after* the prompt -- UReason's setting 2, ``M([P, R])`` (its Eq. 2). Callers that may
        exceed the model's input first cut it with :meth:`fit_context`. ``config`` None means
        :attr:`image_generation_config`.
        """

    def edit_image(self, images: ImageBatch, instructions: Sequence[str],
                   config: ImageGenerationConfig | None = None) -> list[Image.Image]:
        """Image + instruction -> one edited image per row (``len(images)`` images, RGB, the size
        :meth:`generate_image` produces), through the same image tokens (or sampler) and sampling
        recipe as :meth:`generate_image`: ``config`` None means :attr:`image_generation_config`; its
        ``seed`` makes a call reproducible; ``num_candidates`` must be 1. ``instructions[b]`` is
        passed as written; each backend applies its own edit template (see the backend's docstring).
        As with :meth:`generate_image` the whole list is one batch (callers split large inputs) and
        nothing is reported as progress. ``len(images) != len(instructions)`` is a ``ValueError``
        naming both lengths. Backends that edit set :attr:`supports_editing`; the default raises
        :class:`EditingNotSupported` naming the backend."""
        raise EditingNotSupported(f"the {self._backend_name()} backend does not edit images (edit_image)")

    def score_edit(self, images: ImageBatch, instructions: Sequence[str], targets: ImageBatch) -> Scores:
        """``[B, 1]`` NLL of ``targets[b]`` (its image tokens; a diffusion backend: its likelihood
        proxy) given ``images[b]`` and ``instructions[b]`` in :meth:`edit_image`'s input format: the
        training loss of image-edit rows, with the :class:`Scores` layout of :meth:`score_image`
        (``nll`` per token, ``sum_nll``, ``num_tokens``; differentiable when grad is enabled). Unequal
        lengths of the three inputs are a ``ValueError`` naming them. The default raises
        :class:`EditingNotSupported` naming the backend."""
        raise EditingNotSupported(f"the {self._backend_name()} backend does not edit images (score_edit)")

    # ---- embeddings for EditingScore (unicon.evaluation.editing) -------------------------------
    def image_latents(self, images: ImageBatch) -> torch.Tensor:
        """``[B, d]`` float32 latent vector of each image in the model's *generative* space: EditingScore's
        ``f(x)`` (image cosine) and ``z`` (relative latent shift ``||z_s - z_t|| / sqrt(d)``). Deterministic
        (no sampling, eval mode), one row per image; ``d`` is fixed for a model and an image size. What the
        latent is, per backend, is in the backend's own docstring of this method. The default raises
        :class:`EmbeddingNotSupported` naming the backend."""
        raise EmbeddingNotSupported(f"the {self._backend_name()} backend has no image latents (image_latents) "
                                    "for EditingScore")

    def embed_image(self, images: ImageBatch) -> torch.Tensor:
        """``[B, e]`` float32 pooled embedding of each image in the space :meth:`embed_text` writes to:
        EditingScore's ``f^(x_t)``, compared with the instruction by cosine. The default raises
        :class:`EmbeddingNotSupported` naming the backend."""
        raise EmbeddingNotSupported(f"the {self._backend_name()} backend has no image-text embedding (embed_image)")

    def embed_text(self, texts: Sequence[str]) -> torch.Tensor:
        """``[B, e]`` float32 pooled embedding of each text, in :meth:`embed_image`'s space (EditingScore's
        ``p``). The default raises :class:`EmbeddingNotSupported` naming the backend."""
        raise EmbeddingNotSupported(f"the {self._backend_name()} backend has no text embedding (embed_text)")

    def _backend_name(self) -> str:
        """:attr:`backend`, or the class name for a model that never registered one."""
        return self.backend if self.backend != "abstract" else type(self).__name__

    def best_of_candidates(self, prompts: Sequence[str], context: Sequence[str] | None,
                           config: ImageGenerationConfig) -> list[Image.Image]:
        """``config.num_candidates`` = N images per prompt, reranked: for prompt ``p`` the kept image is

            x* = argmin_{x_1..x_N ~ M(· | p)}  NLL_caption(p | x_n)

        the candidate whose caption likelihood of ``p`` (summed over ``p``'s tokens, under the
        model's own :attr:`caption_prompt`) is highest. This is OFA's text-to-image protocol (its
        ``image_gen`` task draws ``sampling_times`` images and keeps the one CLIP finds closest to the
        text) with the model's I2T side as the judge instead of CLIP, so that nothing outside the
        model is needed; it couples the T2I output to the model's captioner, so report it beside
        single-sample numbers, not instead of them. Backends call it from ``generate_image`` when
        ``num_candidates > 1``; the N draws of a prompt are rows of one batch (one generator), so
        they differ through sampling: token backends need ``do_sample=True``."""
        from dataclasses import replace

        n = int(config.num_candidates)
        if n < 1:
            raise ValueError(f"ImageGenerationConfig.num_candidates must be >= 1, got {n}")
        one = replace(config, num_candidates=1)
        if n == 1:
            return self.generate_image(prompts, context, one)
        if not config.do_sample:
            raise ValueError(f"num_candidates={n} needs do_sample=True: greedy decoding draws {n} identical images")
        expanded = [p for p in prompts for _ in range(n)]
        contexts = None if context is None else [c for c in context for _ in range(n)]
        images = self.generate_image(expanded, contexts, one)
        with torch.no_grad():
            scores = self.score_text(images, [self.caption_prompt] * len(images), [[p] for p in expanded])
        best = scores.sum_nll[:, 0].view(len(prompts), n).argmin(dim=1).tolist()
        return [images[b * n + k] for b, k in enumerate(best)]

    def fit_context(self, prompts: Sequence[str], contexts: Sequence[str]) -> tuple[list[str], list[int]]:
        """Cut each ``contexts[b]`` from the left, a word at a time, until ``[prompts[b], contexts[b]]``
        fits the model's text-to-image input; returns the kept contexts and the number of words cut
        from each (0 = kept whole). The end of a trace (its conclusion) is what survives. Default: the
        backend has no input limit to respect."""
        return list(contexts), [0] * len(contexts)

    @abc.abstractmethod
    def reason(self, prompts: Sequence[str], max_new_tokens: int = 256) -> list[TextGeneration]:
        """Free text generation used for think-then-draw."""

    # ---- persistence ----------------------------------------------------------------
    @abc.abstractmethod
    def save_pretrained(self, path: str) -> None: ...

    @classmethod
    @abc.abstractmethod
    def from_pretrained(cls, path: str, **kwargs) -> "UnifiedModel": ...


# ---- small shared helpers ---------------------------------------------------------------

def pil_to_tensor(images: Sequence[Image.Image]) -> torch.Tensor:
    """List of PIL images (same size) -> ``[B, 3, H, W]`` floats in [0, 1]; non-RGB is converted."""
    import numpy as np

    out = []
    for i, im in enumerate(images):
        if not isinstance(im, Image.Image):
            raise ValueError(f"image {i} is a {type(im).__name__}, expected a PIL image")
        out.append(torch.from_numpy(np.asarray(im.convert("RGB"), dtype=np.float32) / 255.0))
    sizes = {tuple(t.shape) for t in out}
    if len(sizes) > 1:
        raise ValueError(f"images have different sizes {sorted(sizes)}; resize them first")
    return torch.stack(out).permute(0, 3, 1, 2).contiguous()


def pad_scores(values: list[list[torch.Tensor]], like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack ragged per-example lists of scalar tensors into ``([B, K], mask)`` with 0.0 padding."""
    B = len(values)
    K = max((len(v) for v in values), default=0)
    out = like.new_zeros(B, K)
    mask = torch.zeros(B, K, dtype=torch.bool, device=like.device)
    rows = []
    for b, v in enumerate(values):
        row = torch.stack(v) if v else like.new_zeros(0)
        rows.append(torch.cat([row, like.new_zeros(K - len(v))]))
        mask[b, : len(v)] = True
    if rows:
        out = torch.stack(rows)
    return out, mask


def check_candidates(candidates: Sequence[Sequence], what: str = "candidates") -> None:
    """Raise ``ValueError`` naming the first example with an empty candidate list."""
    for b, c in enumerate(candidates):
        if len(c) == 0:
            raise ValueError(f"example {b} has an empty list of {what}")
