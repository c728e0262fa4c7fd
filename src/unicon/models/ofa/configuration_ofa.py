"""OFA configuration: the reference ``OFAConfig`` keys, presets for the published sizes and ShapesWorld.

The key names are those of the OFA-Sys Hugging Face port (``config.json`` of its
checkpoints and of ``../shared/fixtures/ofa-reference-tiny``), so a real checkpoint's
``config.json`` loads unchanged. Five keys are unicon extensions with defaults that
reproduce the reference exactly:

* ``resnet_width`` (64): planes of the first ResNet stage (stages use w, 2w, 4w planes,
  expansion 4, so the feature map has 16·w channels; the reference is fixed at 64 -> 1024);
* ``resnet_layers`` (None): explicit Bottleneck counts of the three stages, overriding
  ``resnet_type`` (ShapesWorld uses ``[1, 1, 1]`` to stay fast on CPU);
* ``patch_image_size`` (None): the image side the checkpoint expects (used by the
  wrapper's preprocessing; not part of the network);
* ``image_stem`` ("resnet"): ``"patch"`` replaces the ResNet by two patchifying convolutions
  (``modeling_ofa.PatchStem``, one token per 16-pixel cell; ShapesWorld's preset);
* ``token_embedding_init_std`` (None = ``init_std``): the std of the shared token embedding at
  initialisation (it is also the output projection, so it sets the initial logit scale);
  only read when a model is built from scratch.

A ``config.json`` of another architecture is refused by :func:`check_config_dict`, which
names the field that gave it away (``model_type`` or a missing OFA key).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from transformers import PretrainedConfig

#: Bottleneck counts of the three ResNet stages used by OFA (layer4 is never built).
#: "resnet18" is the reference's smallest option: Bottleneck blocks, not a true ResNet-18.
RESNET_LAYERS = {
    "resnet18": [2, 2, 2],
    "resnet34": [3, 4, 6],
    "resnet50": [3, 4, 6],
    "resnet101": [3, 4, 23],
    "resnet152": [3, 8, 36],
}

#: Image stems: OFA's ResNet (every published checkpoint) or ShapesWorld's per-cell patch stem.
IMAGE_STEMS = ("resnet", "patch")

#: Keys an OFA ``config.json`` must carry (``resnet_type`` is the one BART-style configs lack).
#: Other OFA keys (bucket sizes, ``code_image_size``, ...) fall back to the reference defaults.
REQUIRED_KEYS = (
    "vocab_size",
    "d_model",
    "encoder_layers",
    "decoder_layers",
    "encoder_attention_heads",
    "decoder_attention_heads",
    "encoder_ffn_dim",
    "decoder_ffn_dim",
    "resnet_type",
)


class OFAConfigError(ValueError):
    """A ``config.json`` that does not describe an OFA model."""


def check_config_dict(config: dict[str, Any], source: str = "config") -> None:
    """Refuse a config dict of another architecture, naming the field that shows it."""
    model_type = config.get("model_type", "ofa")
    if model_type != "ofa":
        raise OFAConfigError(
            f"{source}: model_type is {model_type!r}, expected 'ofa' (not an OFA checkpoint)"
        )
    missing = [k for k in REQUIRED_KEYS if k not in config]
    if missing:
        raise OFAConfigError(
            f"{source}: missing OFA key {missing[0]!r} (all missing: {missing}); not an OFA config.json"
        )
    resnet_type = config["resnet_type"]
    if config.get("resnet_layers") is None and resnet_type not in RESNET_LAYERS:
        raise OFAConfigError(f"{source}: resnet_type {resnet_type!r} is not one of {sorted(RESNET_LAYERS)}")
    for side in ("encoder", "decoder"):
        d, h = config["d_model"], config[f"{side}_attention_heads"]
        if d % h:
            raise OFAConfigError(f"{source}: d_model {d} is not divisible by {side}_attention_heads {h}")


class OFAConfig(PretrainedConfig):
    """Configuration of :class:`unicon.models.ofa.modeling_ofa.OFAModel` (reference key names)."""

    model_type = "ofa"
    keys_to_ignore_at_inference = ["past_key_values"]

    vocab_size: int = 59457
    max_position_embeddings: int = 1024
    d_model: int = 1024
    encoder_ffn_dim: int = 4096
    encoder_layers: int = 12
    encoder_attention_heads: int = 16
    decoder_ffn_dim: int = 4096
    decoder_layers: int = 12
    decoder_attention_heads: int = 16
    dropout: float = 0.1
    attention_dropout: float = 0.0
    activation_dropout: float = 0.0
    activation_function: str = "gelu"
    init_std: float = 0.02
    encoder_layerdrop: float = 0.0
    decoder_layerdrop: float = 0.0
    classifier_dropout: float = 0.0
    use_cache: bool = True
    num_hidden_layers: int | None = None
    scale_embedding: bool = False
    encoder_normalize_before: bool = True
    decoder_normalize_before: bool = True
    normformer: bool = True
    encoder_drop_path_rate: float = 0.0
    decoder_drop_path_rate: float = 0.0
    layernorm_embedding: bool = True
    patch_layernorm_embedding: bool = True
    resnet_type: str = "resnet101"
    resnet_model_path: str | None = None
    resnet_drop_path_rate: float = 0.0
    token_bucket_size: int = 256
    image_bucket_size: int = 42
    add_type_embedding: bool = True
    share_decoder_input_output_embed: bool = True
    attn_scale_factor: float = 2.0
    code_layernorm_embedding: bool = True
    code_image_size: int = 128
    entangle_position_embedding: bool = False
    # unicon extensions (defaults = reference behaviour)
    resnet_width: int = 64
    resnet_layers: list[int] | None = None
    patch_image_size: int | None = None
    image_stem: str = "resnet"
    token_embedding_init_std: float | None = None
    # special tokens (BART convention)
    pad_token_id: int | None = 1
    bos_token_id: int | None = 0
    eos_token_id: int | None = 2
    decoder_start_token_id: int | None = 0
    is_encoder_decoder: bool = True
    tie_word_embeddings: bool = True

    def __post_init__(self, **kwargs):
        if self.num_hidden_layers is None:
            self.num_hidden_layers = self.encoder_layers
        super().__post_init__(**kwargs)
        check_config_dict(self.__dict__ | {"model_type": "ofa"}, source="OFAConfig")
        if not (self.normformer and self.encoder_normalize_before and self.decoder_normalize_before):
            raise OFAConfigError(
                "OFAConfig: only normformer=True with pre-LN (the OFA-Sys checkpoints) is implemented"
            )
        if self.image_stem not in IMAGE_STEMS:
            raise OFAConfigError(f"OFAConfig: image_stem {self.image_stem!r} is not one of {list(IMAGE_STEMS)}")
        if not self.share_decoder_input_output_embed:
            raise OFAConfigError("OFAConfig: share_decoder_input_output_embed=False is not implemented")
        if self.code_image_size // 8 > self.image_bucket_size:
            raise OFAConfigError(
                f"OFAConfig: code_image_size {self.code_image_size} gives a {self.code_image_size // 8}-code "
                f"side, wider than the {self.image_bucket_size}x{self.image_bucket_size} position window "
                "(image_bucket_size)"
            )

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], **kwargs):
        """Refuse other architectures; fill ``patch_image_size`` (absent from OFA-Sys files) by preset."""
        check_config_dict(config_dict, source=kwargs.pop("_source", "config.json"))
        if config_dict.get("patch_image_size") is None:
            config_dict = {**config_dict, "patch_image_size": published_image_size(config_dict)}
        return super().from_dict(config_dict, **kwargs)

    @property
    def stage_layers(self) -> list[int]:
        """Bottleneck counts of ResNet stages 1-3."""
        return list(self.resnet_layers) if self.resnet_layers is not None else RESNET_LAYERS[self.resnet_type]

    @property
    def image_feature_dim(self) -> int:
        """Channels of the ResNet feature map that ``image_proj`` maps to ``d_model``."""
        return self.resnet_width * 4 * 4


_PUBLISHED = dict(
    vocab_size=59457,  # BART BPE 50265 + 8192 <code_i> + 1000 <bin_i>
    max_position_embeddings=1024,
    token_bucket_size=256,
    image_bucket_size=42,
    code_image_size=128,
    dropout=0.1,
    attention_dropout=0.0,
    activation_dropout=0.0,
)


def _size(d, enc, dec, heads, ffn, resnet, image_size):
    return dict(
        _PUBLISHED,
        d_model=d,
        encoder_layers=enc,
        decoder_layers=dec,
        encoder_attention_heads=heads,
        decoder_attention_heads=heads,
        encoder_ffn_dim=ffn,
        decoder_ffn_dim=ffn,
        resnet_type=resnet,
        patch_image_size=image_size,
    )


#: Presets as plain dicts of ``OFAConfig`` keyword arguments (``OFAConfig(**preset)``).
#: Published OFA sizes (OFA paper, Table 1; OFA-Sys model cards: tiny 33M, medium 93M,
#: base 182M, large 472M, huge 930M). ``patch_image_size`` is the pretraining resolution.
OFA_PRESETS: dict[str, dict[str, Any]] = {
    # the golden fixture ../shared/fixtures/ofa-reference-tiny/config.json
    "reference-tiny": dict(
        vocab_size=1000,
        max_position_embeddings=128,
        d_model=64,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=128,
        decoder_ffn_dim=128,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        resnet_type="resnet18",
        token_bucket_size=256,
        image_bucket_size=42,
        code_image_size=128,
        patch_image_size=128,
    ),
    "ofa-tiny": _size(256, 4, 4, 4, 1024, "resnet50", 256),
    "ofa-medium": _size(512, 4, 4, 8, 2048, "resnet101", 256),
    "ofa-base": _size(768, 6, 6, 12, 3072, "resnet101", 384),
    "ofa-large": _size(1024, 12, 12, 16, 4096, "resnet152", 480),
    "ofa-huge": _size(1280, 24, 12, 16, 5120, "resnet152", 480),
    # ShapesWorld: 64x64 images -> 4x4 encoder patches, one per 16-px cell (the patch stem: every
    # object lives in one cell, so a per-cell embedding is exact and cheaper than OFA's ResNet);
    # code_image_size 32 -> 4x4 decoder code grid (window = code_image_size // 8). vocab_size is set
    # at build time from the world tokenizer (+ codes + bins) by the OFA-unified wrapper.
    "shapes-tiny": dict(
        vocab_size=1024,
        max_position_embeddings=192,  # think-then-draw prompts reach ~140 tokens
        d_model=128,
        # 2+2 layers, not 3+3: the pretraining budget (8 minutes) is bound by steps, not by depth. A
        # step of the two-rank recipe costs 0.395 s against 3+3's 0.59 s (0.34 s without DDP's buffer
        # broadcast), so 1,250 steps fit where 920 did, and the attribute binding behind localization
        # emerges within them on every seed tried (VQA's colour/shape binding on one seed of three;
        # docs/notebook/2026-11-27-shapes-consistency-notebook.md)
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=512,
        decoder_ffn_dim=512,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        resnet_type="resnet18",  # unused by the patch stem; kept so that config.json stays OFA-shaped
        resnet_width=32,  # the patch stem's hidden channels (its output: 16 * 32 = 512 -> image_proj)
        resnet_layers=[1, 1, 1],
        image_stem="patch",
        # N(0, 1) token embeddings (= output projection) instead of N(0, init_std): trained from
        # scratch, the model then leaves the language-prior plateau (VQA loss ~0.6 nats/token,
        # answers from the question alone) in a few hundred steps; with 0.1 it stayed there for
        # 1,600 steps (docs/notebook/2026-11-27-shapes-consistency-notebook.md)
        token_embedding_init_std=1.0,
        token_bucket_size=256,
        # a 5x5 position window around the 4x4 grid of 16-px cells (64 px images, 4x4 image codes; the
        # fifth row and column keep the decoder's filler position, the step after the last code, off
        # the cells: make_decoder_image_position_idx). OFA's 42 (a 42x42 window) left 1,748 of the 1,765
        # image position rows and 6,840 of each layer's 6,892 relative-position rows untouched: 26% of
        # the parameters that DDP all-reduces and the optimizer steps every step, and a 25 MB bucket table
        image_bucket_size=5,
        code_image_size=32,
        patch_image_size=64,
    ),
}


def published_image_size(config: dict[str, Any]) -> int | None:
    """Image size of the preset whose dimensions these are (published OFA sizes: their
    pretraining resolution; the golden fixture: 128), or None if none matches."""
    dims = ("d_model", "encoder_layers", "decoder_layers", "resnet_type")
    for preset in OFA_PRESETS.values():
        if all(config.get(k) == preset.get(k) for k in dims):
            return preset["patch_image_size"]
    return None


def preset_config(name: str, **overrides) -> OFAConfig:
    """``OFAConfig`` of a named preset with keyword overrides (e.g. ``vocab_size``)."""
    if name not in OFA_PRESETS:
        raise ValueError(f"unknown OFA preset {name!r}; choose one of {sorted(OFA_PRESETS)}")
    known = {f.name for f in dataclasses.fields(OFAConfig)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"unknown OFAConfig key {unknown[0]!r} (all unknown: {unknown})")
    return OFAConfig(**(copy.deepcopy(OFA_PRESETS[name]) | overrides))
