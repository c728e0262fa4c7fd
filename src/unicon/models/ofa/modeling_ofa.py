"""Native OFA (One-For-All) encoder-decoder in plain PyTorch, numerically equal to the OFA-Sys port.

This file re-implements the architecture of the OFA-Sys Hugging Face port
(``OFAForConditionalGeneration``) from the facts in
``../shared/fixtures/ofa-reference-tiny/README.md``; parameter names are the reference
names, so a real OFA checkpoint (or the golden fixture) loads with strict key matching.
``tests/test_ofa_parity.py`` checks logits and encoder states against the fixture.

Public API (names are stable; ``unicon.models.ofa.unified`` builds on them)
--------------------------------------------------------------------------
``OFAForConditionalGeneration`` (top class, keys ``model.encoder.*`` / ``model.decoder.*``)
    * ``forward(input_ids, patch_images=None, patch_masks=None, decoder_input_ids=None,
      code_masks=None, encoder_outputs=None, past_key_values=None, use_cache=False, ...)``
      -> ``Seq2SeqLMOutput`` with ``.logits`` ``[B, T, vocab]``.
    * ``encode(input_ids, patch_images=None, patch_masks=None) -> OFAEncoderOutput``
      (``last_hidden_state``, ``padding_mask`` (True = pad), ``position_embedding``);
      ``OFAEncoderOutput.index_select(index)`` repeats/reorders it along the batch so
      K candidates share one encoder pass.
    * ``decode(decoder_input_ids, encoder_outputs, code_masks=None, decoder_attention_mask=None)
      -> logits`` ``[B, T, vocab]``.
    * ``generate(...)`` from transformers' ``GenerationMixin`` (beam search, sampling, ...),
      with a KV cache for the decoder; the encoder runs once. ``generation_config`` starts
      at OFA's captioning defaults: 5 beams, no repeated 3-grams, 16 new tokens.
    * ``from_pretrained(dir, allow_pickle=False)`` / ``save_pretrained(dir)``.
``OFAModel``: the same ``forward``/``encode``/``decode``/``generate`` without the ``model.``
key prefix (the reference decoder already ends in the tied output projection). Either class
loads a checkpoint of the other (``unicon.models.ofa.convert`` maps the prefix).

Attention runs through torch SDPA with one additive float mask carrying the position biases
and the padding/causal mask (``config._attn_implementation = "sdpa"``, the default). On CPU,
SDPA's fused kernel sums in another order than the reference: max |Δlogit| ≈ 8e-6 on the
fixture (logits up to ~20); with SDPA's math backend
(``torch.nn.attention.sdpa_kernel(SDPBackend.MATH)``) or ``_attn_implementation = "eager"``
(matmul + softmax in the reference's order) the fixture is reproduced bit for bit.
Gradient checkpointing: ``model.activation_checkpointing_enable()`` (training, no KV cache).

Architecture summary (see the fixture README for the full statement)
--------------------------------------------------------------------
* ResNet stem (stages 1-3 of ResNet-v1.5 Bottlenecks, stride 16) -> ``image_proj``; the
  encoder sequence is [image patches, text tokens], with a type embedding and separate
  layer norms. Absolute positions enter the *encoder* only as an attention bias
  ``pos_q_linear(P) · pos_k_linear(P)ᵀ / sqrt(head_dim · attn_scale_factor)``.
* Per-layer relative-position biases: text-text through log buckets (hard-coded max
  position 1024), image-image through 2-D offsets in a 42x42 window.
* NormFormer pre-LN layers: extra mid layer norms after attention, an FFN layer norm
  after the activation, and a learned per-head scale ``c_attn``.
* Decoder code mode (``code_masks[b]`` True): image-grid positions, ``image_pos_ln``,
  ``code_layernorm_embedding`` and image relative buckets replace their text versions.

Two reference quirks reproduced on purpose: attention layers scale q by
``(head_dim * 2.0) ** -0.5`` whatever ``attn_scale_factor`` says, and the decoder always adds
its absolute position embedding to the token embedding (the reference tests
``entangle_position_embedding is not None`` on a bool).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, DynamicCache, EncoderDecoderCache
from transformers.modeling_outputs import Seq2SeqLMOutput
from transformers.utils import ModelOutput

from .configuration_ofa import OFAConfig
from .convert import load_pretrained, save_pretrained

#: The reference builds the text bucket table for 1024 positions whatever the config says.
TOKEN_BUCKET_MAX_POSITION = 1024
#: Attention layers are built with the default ``scale_factor=2.0`` (not ``attn_scale_factor``).
ATTENTION_SCALE_FACTOR = 2.0


# ---------------------------------------------------------------------------------------------
# relative-position buckets (pure functions of the config)
# ---------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=4)
def make_token_bucket_position(
    bucket_size: int, max_position: int = TOKEN_BUCKET_MAX_POSITION
) -> torch.Tensor:
    """``[max_position, max_position]`` index into the text rel-pos table (``2·bucket_size − 1`` rows).

    With ``mid = bucket_size // 2`` and ``rel = i − j``: the bucket is ``rel`` for ``|rel| ≤ mid``
    and ``sign(rel) · (mid + ceil(log(|rel|/mid) / log((max_position−1)/mid) · (mid−1)))`` beyond;
    the index is ``bucket + bucket_size − 1``.
    """
    pos = torch.arange(max_position, dtype=torch.long, device="cpu")
    rel = pos[:, None] - pos[None, :]
    mid = bucket_size // 2
    abs_rel = torch.where((rel < mid) & (rel > -mid), torch.full_like(rel, mid - 1), rel.abs())
    log_pos = torch.ceil(torch.log(abs_rel / mid) / math.log((max_position - 1) / mid) * (mid - 1)) + mid
    bucket = torch.where(abs_rel <= mid, rel, log_pos.int() * torch.sign(rel)).long()
    return bucket + bucket_size - 1


@functools.lru_cache(maxsize=4)
def make_image_bucket_position(bucket_size: int, num_relative_distance: int) -> torch.Tensor:
    """``[bucket_size² + 1]²`` index into the image rel-pos table (``(2·bucket_size−1)² + 3`` rows).

    Position id ``p = r·bucket_size + c + 1``; for two patches the index is
    ``(r1 − r2 + bucket_size − 1)·(2·bucket_size − 1) + (c1 − c2 + bucket_size − 1)``.
    Id 0 is special: row 0 -> ``n − 3``, column 0 -> ``n − 2``, (0, 0) -> ``n − 1``.
    Both bucket builders are cached: encoder and decoder (and every model instance) share one
    read-only table per configuration.
    """
    coords = torch.arange(bucket_size, device="cpu")
    rows = coords.repeat_interleave(bucket_size)  # row-major flattening of the grid
    cols = coords.repeat(bucket_size)
    d_row = rows[:, None] - rows[None, :] + bucket_size - 1
    d_col = cols[:, None] - cols[None, :] + bucket_size - 1
    index = torch.zeros((bucket_size * bucket_size + 1,) * 2, dtype=torch.long, device="cpu")
    index[1:, 1:] = d_row * (2 * bucket_size - 1) + d_col
    index[0, :] = num_relative_distance - 3
    index[:, 0] = num_relative_distance - 2
    index[0, 0] = num_relative_distance - 1
    return index


def image_position_ids(height: int, width: int, bucket_size: int) -> torch.Tensor:
    """Row-major ids ``r·bucket_size + c + 1`` of an ``height x width`` grid (0 is reserved)."""
    return (torch.arange(height)[:, None] * bucket_size + torch.arange(width)[None, :] + 1).flatten()


def make_decoder_image_position_idx(code_image_size: int, bucket_size: int) -> torch.Tensor:
    """Decoder position ids in code mode.

    ``[0, grid ids of the (code_image_size // 8)² codes, 768 × filler]`` (the tail, e.g. the step that
    predicts eos after the last code): OFA-Sys's filler id is 1024; a position window smaller than
    32x32 has no row 1024 and takes its last row, ``bucket_size²``, instead (a cell only where the
    code grid fills the window's last row and column).
    """
    window = code_image_size // 8
    grid = image_position_ids(window, window, bucket_size)
    filler = min(1024, bucket_size**2)
    return torch.cat([torch.zeros(1, dtype=torch.long), grid, torch.full((768,), filler, dtype=torch.long)])


def linear_rates(stop: float, n: int) -> list[float]:
    """``n`` drop-path rates rising linearly from 0 to ``stop`` (deeper blocks drop more)."""
    return [stop * i / max(n - 1, 1) for i in range(n)]


def drop_path(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """Stochastic depth: drop whole samples of a residual branch with probability ``p``."""
    if p == 0.0 or not training:
        return x
    keep = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(1 - p)
    return x * keep / (1 - p)


# ---------------------------------------------------------------------------------------------
# image stem
# ---------------------------------------------------------------------------------------------


class Bottleneck(nn.Module):
    """ResNet-v1.5 Bottleneck (stride on the 3x3 conv), expansion 4."""

    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None,
                 drop_path_rate: float = 0.0):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, planes * self.expansion, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample
        self.drop_path_rate = drop_path_rate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(identity + drop_path(out, self.drop_path_rate, self.training))


class ResNet(nn.Module):
    """OFA's image stem: 7x7/2 conv, BN, ReLU, 3x3/2 max-pool, then stages 1-3 (no layer4/pool/fc).

    ``width`` is the planes of stage 1 (64 in OFA); the output has ``16 · width`` channels at stride 16.
    """

    def __init__(self, layers: list[int], width: int = 64, drop_path_rate: float = 0.0):
        super().__init__()
        self.inplanes = width
        self.conv1 = nn.Conv2d(3, width, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        rates = linear_rates(drop_path_rate, sum(layers))
        self.layer1 = self._make_layer(width, layers[0], 1, rates[: layers[0]])
        self.layer2 = self._make_layer(width * 2, layers[1], 2, rates[layers[0] : layers[0] + layers[1]])
        self.layer3 = self._make_layer(width * 4, layers[2], 2, rates[layers[0] + layers[1] :])

    def _make_layer(self, planes: int, blocks: int, stride: int, rates: list[float]) -> nn.Sequential:
        out = planes * Bottleneck.expansion
        downsample = None
        if stride != 1 or self.inplanes != out:
            downsample = nn.Sequential(
                nn.Conv2d(self.inplanes, out, 1, stride=stride, bias=False), nn.BatchNorm2d(out)
            )
        modules = [Bottleneck(self.inplanes, planes, stride, downsample, rates[0])]
        self.inplanes = out
        modules += [Bottleneck(out, planes, drop_path_rate=r) for r in rates[1:blocks]]
        return nn.Sequential(*modules)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        return self.layer3(self.layer2(self.layer1(x)))


class PatchStem(nn.Module):
    """A stem for images made of 16 x 16-pixel cells (ShapesWorld): two non-overlapping
    patchifying convolutions, 4x4/4 (3 -> ``width``) then GELU and 4x4/4 (``width`` -> ``out``),
    so every output position sees exactly one 16-pixel cell and nothing else.

    OFA's ResNet stem (7x7/2 conv, max-pool, Bottlenecks) mixes neighbouring cells through
    overlapping receptive fields and spends most of its FLOPs at 32x32 and 16x16 resolution;
    for a world whose objects never leave their cell, a per-cell embedding is both exact and
    cheaper (``unicon bench pretrain``). Not part of any published OFA checkpoint."""

    def __init__(self, width: int, out_channels: int):
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 4, stride=4)
        self.conv2 = nn.Conv2d(width, out_channels, 4, stride=4)

    @staticmethod
    def _patchify(x: torch.Tensor, conv: nn.Conv2d) -> torch.Tensor:
        """``conv`` (kernel = stride = k, no padding) on channels-last ``x`` ``[B, H, W, C]`` as one
        matrix product over the unfolded k x k patches: ``[B, H // k, W // k, out]``. The same sums
        as ``conv(x)`` (rows/columns past the last whole patch are dropped, as the convolution does),
        at a fraction of its CPU cost: oneDNN's convolution and its backward took 7% of a pretraining
        step, the matrix product under 1% (``unicon bench pretrain``)."""
        k = conv.kernel_size[0]
        B, H, W, C = x.shape
        h, w = H // k, W // k
        patches = x[:, : h * k, : w * k].reshape(B, h, k, w, k, C).permute(0, 1, 3, 5, 2, 4)
        return F.linear(patches.reshape(B, h, w, C * k * k), conv.weight.flatten(1), conv.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self._patchify(x.permute(0, 2, 3, 1), self.conv1))
        return self._patchify(h, self.conv2).permute(0, 3, 1, 2)


def build_image_stem(config: OFAConfig) -> nn.Module:
    """The image stem named by ``config.image_stem`` (stride 16, ``config.image_feature_dim`` channels)."""
    if config.image_stem == "patch":
        return PatchStem(config.resnet_width, config.image_feature_dim)
    return ResNet(config.stage_layers, config.resnet_width, config.resnet_drop_path_rate)


# ---------------------------------------------------------------------------------------------
# attention and layers
# ---------------------------------------------------------------------------------------------


class OFAAttention(nn.Module):
    """Multi-head attention with an additive bias, NormFormer head scale ``c_attn`` and torch SDPA.

    ``softmax((q · (head_dim·2)^-½)·kᵀ + bias) · v``, then each head is multiplied by ``c_attn[h]``
    before ``out_proj``. ``bias`` ``[B, H, T, S]`` carries position biases *and* the mask.

    ``config._attn_implementation``: ``"sdpa"`` (default; torch's fused CPU kernel sums in
    another order: ≈8e-6 from the reference on logits of size ~20) or ``"eager"`` (matmul +
    softmax in the reference's order: bitwise equal to the reference on CPU).
    """

    def __init__(self, config: OFAConfig, embed_dim: int, num_heads: int, dropout: float = 0.0,
                 layer_idx: int = 0, is_cross_attention: bool = False):
        super().__init__()
        self.config = config
        self.embed_dim, self.num_heads = embed_dim, num_heads
        self.head_dim = embed_dim // num_heads
        self.scaling = (self.head_dim * ATTENTION_SCALE_FACTOR) ** -0.5
        self.dropout = dropout
        self.layer_idx = layer_idx
        self.is_cross_attention = is_cross_attention
        self.c_attn = nn.Parameter(torch.ones(num_heads))
        self.k_proj = nn.Linear(embed_dim, embed_dim)
        self.v_proj = nn.Linear(embed_dim, embed_dim)
        self.q_proj = nn.Linear(embed_dim, embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(x.shape[0], x.shape[1], self.num_heads, self.head_dim).transpose(1, 2)

    def forward(self, hidden_states: torch.Tensor, bias: torch.Tensor,
                key_value_states: torch.Tensor | None = None,
                past_key_values: EncoderDecoderCache | None = None) -> torch.Tensor:
        q = self._heads(self.q_proj(hidden_states) * self.scaling)  # scale q first, as the reference does
        if self.is_cross_attention:
            cache = past_key_values.cross_attention_cache if past_key_values is not None else None
            if cache is not None and past_key_values.is_updated.get(self.layer_idx):
                k, v = cache.layers[self.layer_idx].keys, cache.layers[self.layer_idx].values
            else:
                k, v = self._heads(self.k_proj(key_value_states)), self._heads(self.v_proj(key_value_states))
                if cache is not None:
                    k, v = cache.update(k, v, self.layer_idx)
                    past_key_values.is_updated[self.layer_idx] = True
        else:
            k, v = self._heads(self.k_proj(hidden_states)), self._heads(self.v_proj(hidden_states))
            if past_key_values is not None:
                k, v = past_key_values.self_attention_cache.update(k, v, self.layer_idx)
        dropout = self.dropout if self.training else 0.0
        if self.config._attn_implementation == "eager":
            probs = torch.softmax(q @ k.transpose(2, 3) + bias, dim=-1)
            out = F.dropout(probs, dropout, self.training) @ v
        else:
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=bias.to(q.dtype), dropout_p=dropout, scale=1.0  # q is already scaled
            )
        out = out * self.c_attn.view(1, -1, 1, 1)
        out = out.transpose(1, 2).reshape(hidden_states.shape[0], hidden_states.shape[1], self.embed_dim)
        return self.out_proj(out)


class OFAEncoderLayer(nn.Module):
    """Pre-LN NormFormer layer: ``x += midLN(Attn(LN(x)))``; ``x += fc2(ffnLN(act(fc1(LN(x)))))``."""

    def __init__(self, config: OFAConfig, drop_path_rate: float = 0.0, num_heads: int | None = None,
                 ffn_dim: int | None = None):
        super().__init__()
        d = config.d_model
        num_heads = num_heads or config.encoder_attention_heads
        ffn_dim = ffn_dim or config.encoder_ffn_dim
        self.self_attn = OFAAttention(config, d, num_heads, config.attention_dropout)
        self.self_attn_layer_norm = nn.LayerNorm(d)
        self.self_attn_mid_layer_norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, ffn_dim)
        self.fc2 = nn.Linear(ffn_dim, d)
        self.ffn_layer_norm = nn.LayerNorm(ffn_dim)
        self.final_layer_norm = nn.LayerNorm(d)
        self.activation_fn = ACT2FN[config.activation_function]
        self.dropout, self.activation_dropout = config.dropout, config.activation_dropout
        self.drop_path_rate = drop_path_rate

    def _residual(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        x = F.dropout(x, self.dropout, self.training)
        return residual + drop_path(x, self.drop_path_rate, self.training)

    def _ffn(self, x: torch.Tensor) -> torch.Tensor:
        h = self.activation_fn(self.fc1(self.final_layer_norm(x)))
        h = self.ffn_layer_norm(F.dropout(h, self.activation_dropout, self.training))
        return self._residual(self.fc2(h), x)

    def forward(self, x: torch.Tensor, attn_bias: torch.Tensor) -> torch.Tensor:
        h = self.self_attn_mid_layer_norm(self.self_attn(self.self_attn_layer_norm(x), attn_bias))
        return self._ffn(self._residual(h, x))


class OFADecoderLayer(OFAEncoderLayer):
    """Encoder layer plus a NormFormer cross-attention block between self-attention and FFN."""

    def __init__(self, config: OFAConfig, layer_idx: int, drop_path_rate: float = 0.0):
        super().__init__(config, drop_path_rate, config.decoder_attention_heads, config.decoder_ffn_dim)
        d, heads = config.d_model, config.decoder_attention_heads
        self.self_attn.layer_idx = layer_idx
        self.cross_attn = OFAAttention(
            config, d, heads, config.attention_dropout, layer_idx, is_cross_attention=True
        )
        self.cross_attn_layer_norm = nn.LayerNorm(d)
        self.cross_attn_mid_layer_norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor, self_attn_bias: torch.Tensor, encoder_hidden_states: torch.Tensor,
                cross_attn_bias: torch.Tensor,
                past_key_values: EncoderDecoderCache | None = None) -> torch.Tensor:
        h = self.self_attn(self.self_attn_layer_norm(x), self_attn_bias, past_key_values=past_key_values)
        x = self._residual(self.self_attn_mid_layer_norm(h), x)
        h = self.cross_attn(
            self.cross_attn_layer_norm(x), cross_attn_bias, encoder_hidden_states, past_key_values
        )
        x = self._residual(self.cross_attn_mid_layer_norm(h), x)
        return self._ffn(x)


# ---------------------------------------------------------------------------------------------
# encoder / decoder
# ---------------------------------------------------------------------------------------------


@dataclass
class OFAEncoderOutput(ModelOutput):
    """Encoder states ``[B, N, d]``, padding mask ``[B, N]`` (True = pad), positions ``[B, N, d]``."""

    last_hidden_state: torch.Tensor | None = None
    padding_mask: torch.Tensor | None = None
    position_embedding: torch.Tensor | None = None

    def index_select(self, index: torch.Tensor) -> "OFAEncoderOutput":
        """Rows ``index`` of every tensor (e.g. repeated ids so K candidates share one encoding)."""
        return OFAEncoderOutput(*(t.index_select(0, index) for t in self.to_tuple()))


def _additive_mask(padding_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[B, S]`` bool (True = pad) -> ``[B, 1, 1, S]`` with ``finfo.min`` at padded keys."""
    return torch.zeros(padding_mask.shape, dtype=dtype, device=padding_mask.device).masked_fill(
        padding_mask, torch.finfo(dtype).min
    )[:, None, None, :]


class _RelPosTables(nn.Module):
    """Shared by encoder and decoder: bucket buffers, per-layer rel-pos tables, position projections."""

    def _init_rel_pos(self, config: OFAConfig, num_layers: int, num_heads: int) -> None:
        self.num_heads = num_heads
        self.pos_scaling = (config.d_model / num_heads * config.attn_scale_factor) ** -0.5
        self.image_bucket_size = config.image_bucket_size
        num_token_rel = 2 * config.token_bucket_size - 1
        num_image_rel = (2 * config.image_bucket_size - 1) ** 2 + 3
        self.token_rel_pos_table_list = nn.ModuleList(
            nn.Embedding(num_token_rel, num_heads) for _ in range(num_layers)
        )
        self.image_rel_pos_table_list = nn.ModuleList(
            nn.Embedding(num_image_rel, num_heads) for _ in range(num_layers)
        )

    def _register_buckets(self, config: OFAConfig) -> None:
        # derived from the config, never loaded (see convert.DERIVED_SUFFIXES); reference order: first
        token_bucket = make_token_bucket_position(config.token_bucket_size)
        num_image_rel = (2 * config.image_bucket_size - 1) ** 2 + 3
        image_bucket = make_image_bucket_position(config.image_bucket_size, num_image_rel)
        self.register_buffer("token_rp_bucket", token_bucket, persistent=False)
        self.register_buffer("image_rp_bucket", image_bucket, persistent=False)

    def _position_heads(self, linear: nn.Linear, pos: torch.Tensor) -> torch.Tensor:
        """``linear(pos)`` split into heads: ``[B, N, d]`` -> ``[B, H, N, d / H]``."""
        head_dim = linear.out_features // self.num_heads
        return linear(pos).view(pos.shape[0], pos.shape[1], self.num_heads, head_dim).transpose(1, 2)

    def _project(self, q_linear: nn.Linear, k_linear: nn.Linear, q_pos: torch.Tensor,
                 k_pos: torch.Tensor) -> torch.Tensor:
        """Absolute position bias ``[B, H, Tq, Tk]`` = (q_linear(q_pos)·scale) · k_linear(k_pos)ᵀ."""
        q = self._position_heads(q_linear, q_pos) * self.pos_scaling
        return q @ self._position_heads(k_linear, k_pos).transpose(2, 3)

    def token_rel_bias(self, idx: int, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        """``[H, len(rows), len(cols)]`` text rel-pos bias of layer ``idx``."""
        bucket = self.token_rp_bucket[rows][:, cols]
        return F.embedding(bucket, self.token_rel_pos_table_list[idx].weight).permute(2, 0, 1)

    def image_rel_bias(self, idx: int, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        """``[H, len(rows), len(cols)]`` image rel-pos bias of layer ``idx`` (rows/cols: position ids)."""
        bucket = self.image_rp_bucket[rows][:, cols]
        return F.embedding(bucket, self.image_rel_pos_table_list[idx].weight).permute(2, 0, 1)


class OFAEncoder(_RelPosTables):
    """ResNet + text embeddings -> NormFormer encoder with absolute and relative position biases."""

    main_input_name = "input_ids"

    def __init__(self, config: OFAConfig, embed_tokens: nn.Embedding):
        super().__init__()
        self._register_buckets(config)
        d = config.d_model
        self.padding_idx = config.pad_token_id
        self.embed_scale = math.sqrt(d) if config.scale_embedding else 1.0
        self.entangle_position_embedding = config.entangle_position_embedding
        self.dropout = config.dropout
        self.layernorm_embedding = nn.LayerNorm(d) if config.layernorm_embedding else None
        self.embed_tokens = embed_tokens
        self.type_embedding = nn.Embedding(2, d) if config.add_type_embedding else None
        self.embed_images = build_image_stem(config)
        self.image_proj = nn.Linear(config.image_feature_dim, d)
        self.patch_layernorm_embedding = nn.LayerNorm(d) if config.patch_layernorm_embedding else None
        self.embed_positions = nn.Embedding(config.max_position_embeddings + 2, d)
        self.embed_image_positions = nn.Embedding(config.image_bucket_size**2 + 1, d)
        self.pos_ln = nn.LayerNorm(d)
        self.image_pos_ln = nn.LayerNorm(d)
        self.pos_q_linear = nn.Linear(d, d)
        self.pos_k_linear = nn.Linear(d, d)
        rates = linear_rates(config.encoder_drop_path_rate, config.encoder_layers)
        self.layers = nn.ModuleList(OFAEncoderLayer(config, r) for r in rates)
        self.layer_norm = nn.LayerNorm(d)
        self._init_rel_pos(config, config.encoder_layers, config.encoder_attention_heads)
        self.gradient_checkpointing = False

    def _embed(self, x: torch.Tensor, pos: torch.Tensor, type_id: int,
               norm: nn.LayerNorm | None) -> torch.Tensor:
        x = self.embed_scale * x
        if self.entangle_position_embedding:
            x = x + pos
        if self.type_embedding is not None:
            x = x + self.type_embedding.weight[type_id]
        if norm is not None:
            x = norm(x)
        return F.dropout(x, self.dropout, self.training)

    def forward(self, input_ids: torch.Tensor, patch_images: torch.Tensor | None = None,
                patch_masks: torch.Tensor | None = None, output_attentions: bool = False,
                output_hidden_states: bool = False, return_dict: bool = True) -> OFAEncoderOutput:
        """Encode ``[image patches, text]``. ``patch_masks[b]`` False masks row b's image as padding.

        ``output_attentions``/``output_hidden_states``/``return_dict`` are accepted for
        ``GenerationMixin`` and ignored (the output is always an :class:`OFAEncoderOutput`).
        """
        B, L = input_ids.shape
        device = input_ids.device
        if L > self.embed_positions.num_embeddings:
            raise ValueError(
                f"text of {L} tokens exceeds the encoder's {self.embed_positions.num_embeddings} positions"
            )
        text_pos = self.embed_positions(torch.arange(L, device=device)).expand(B, L, -1)
        x = self._embed(self.embed_tokens(input_ids), text_pos, 0, self.layernorm_embedding)
        padding_mask = input_ids.eq(self.padding_idx)
        pos_embed = self.pos_ln(text_pos)
        num_patches, patch_ids = 0, None
        if patch_images is not None:
            # in the weights' dtype: under DeepSpeed's bf16 (or bf16-true) the parameters are bf16,
            # while the pixels arrive as float32 (autocast, bf16-mixed, casts them itself)
            feats = self.embed_images(patch_images.to(self.embed_tokens.weight.dtype))  # [B, C, h, w]
            h, w = feats.shape[-2:]
            if max(h, w) > self.image_bucket_size:
                n = self.image_bucket_size
                raise ValueError(f"image of {tuple(patch_images.shape[-2:])} px gives a {h}x{w} patch grid; "
                                 f"the position window is {n}x{n} (stride 16)")
            num_patches = h * w
            patch_ids = image_position_ids(h, w, self.image_bucket_size).to(device)
            image_pos = self.embed_image_positions(patch_ids).expand(B, num_patches, -1)
            patches = self.image_proj(feats.flatten(2).transpose(1, 2))
            image_x = self._embed(patches, image_pos, 1, self.patch_layernorm_embedding)
            image_pad = torch.zeros(B, num_patches, dtype=torch.bool, device=device)
            if patch_masks is not None:
                image_pad = image_pad | ~patch_masks.to(device=device, dtype=torch.bool)[:, None]
            x = torch.cat([image_x, x], dim=1)
            padding_mask = torch.cat([image_pad, padding_mask], dim=1)
            pos_embed = torch.cat([self.image_pos_ln(image_pos), pos_embed], dim=1)
        has_pads = bool(padding_mask.any())
        if has_pads:
            x = x * (1 - padding_mask.unsqueeze(-1).type_as(x))

        abs_bias = self._project(self.pos_q_linear, self.pos_k_linear, pos_embed, pos_embed)
        mask = _additive_mask(padding_mask, x.dtype) if has_pads else None
        text_idx = torch.arange(L, device=device)
        for idx, layer in enumerate(self.layers):
            rel = torch.zeros_like(abs_bias[0])
            rel[:, num_patches:, num_patches:] = self.token_rel_bias(idx, text_idx, text_idx)
            if patch_ids is not None:
                rel[:, :num_patches, :num_patches] = self.image_rel_bias(idx, patch_ids, patch_ids)
            bias = abs_bias + rel
            if mask is not None:
                bias = bias + mask
            if self.gradient_checkpointing and self.training:
                x = torch.utils.checkpoint.checkpoint(layer, x, bias, use_reentrant=False)
            else:
                x = layer(x, bias)
        x = self.layer_norm(x)
        return OFAEncoderOutput(last_hidden_state=x, padding_mask=padding_mask, position_embedding=pos_embed)


class OFADecoder(_RelPosTables):
    """NormFormer decoder with self/cross position biases, text and image-code modes, tied output."""

    def __init__(self, config: OFAConfig, embed_tokens: nn.Embedding):
        super().__init__()
        self._register_buckets(config)
        self.register_buffer(
            "image_position_idx",
            make_decoder_image_position_idx(config.code_image_size, config.image_bucket_size),
            persistent=False,
        )
        d = config.d_model
        self.padding_idx = config.pad_token_id
        self.embed_scale = math.sqrt(d) if config.scale_embedding else 1.0
        self.dropout = config.dropout
        self.embed_tokens = embed_tokens
        rates = linear_rates(config.decoder_drop_path_rate, config.decoder_layers)
        self.layers = nn.ModuleList(OFADecoderLayer(config, i, r) for i, r in enumerate(rates))
        self.layernorm_embedding = nn.LayerNorm(d) if config.layernorm_embedding else None
        self.embed_positions = nn.Embedding(config.max_position_embeddings + 2, d)
        self.embed_image_positions = nn.Embedding(config.image_bucket_size**2 + 1, d)
        self.pos_ln = nn.LayerNorm(d)
        self.image_pos_ln = nn.LayerNorm(d)
        self.self_pos_q_linear = nn.Linear(d, d)
        self.self_pos_k_linear = nn.Linear(d, d)
        self.cross_pos_q_linear = nn.Linear(d, d)
        self.cross_pos_k_linear = nn.Linear(d, d)
        self.code_layernorm_embedding = nn.LayerNorm(d) if config.code_layernorm_embedding else None
        self.layer_norm = nn.LayerNorm(d)
        self.output_projection = nn.Linear(d, config.vocab_size, bias=False)
        self.output_projection.weight = embed_tokens.weight
        self._init_rel_pos(config, config.decoder_layers, config.decoder_attention_heads)
        self.gradient_checkpointing = False

    @staticmethod
    def _per_sample(code: torch.Tensor | None, image_value, text_value):
        """Select ``image_value`` for samples in code mode, ``text_value`` otherwise (callables, lazily)."""
        if code is None or not bool(code.any()):
            return text_value()
        if bool(code.all()):
            return image_value()
        img, txt = image_value(), text_value()
        shape = (-1,) + (1,) * (img.ndim - 1)
        return torch.where(code.view(shape), img, txt)

    def _positions(self, pos: torch.Tensor, code: torch.Tensor | None,
                   batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Absolute embeddings ``[batch, len(pos), d]`` of decoder positions ``pos``: the one added to
        the tokens (image-grid cells for rows in code mode, text positions otherwise) and its layer
        norm, from which the self/cross-attention position biases are projected."""
        n = pos.numel()
        token_pos = self.embed_positions(pos).expand(batch, n, -1)
        tgt_pos = self._per_sample(
            code, lambda: self.embed_image_positions(self.image_position_idx[pos]).expand(batch, n, -1),
            lambda: token_pos,
        )
        ln_pos = self._per_sample(code, lambda: self.image_pos_ln(tgt_pos), lambda: self.pos_ln(tgt_pos))
        return tgt_pos, ln_pos

    def _self_position_keys(self, cache: EncoderDecoderCache, past: int, new_ln_pos: torch.Tensor,
                            code: torch.Tensor | None) -> torch.Tensor:
        """Self-attention position keys ``self_pos_k_linear(ln_pos)`` of positions ``[0, past + T)``,
        ``[1, H, past + T, d / H]``, for a batch whose rows are all in code mode or all in text mode
        (the keys are then the same for every row).

        A key depends on its position and the mode only, never on tokens, so the keys of the
        cached positions are kept beside the self-attention cache (attribute
        ``_ofa_position_keys``) and only the ``T`` new ones (``new_ln_pos``, ``[1, T, d]``) are
        projected: without this, every incremental step would re-embed and re-project all
        ``past + T`` positions, O(length · d²) per step, quadratic over a 1,024-code image. A cache
        that holds no keys for its positions (filled elsewhere, or in the other mode) gets them
        projected here; one cropped shorter keeps a prefix of its keys (they stay valid)."""
        store = cache.self_attention_cache
        code_mode = code is not None and bool(code.any())
        held = getattr(store, "_ofa_position_keys", None)
        if held is not None and held[0] == code_mode and held[1].shape[2] >= past:
            old = held[1][:, :, :past]
        else:
            _, ln_past = self._positions(torch.arange(past, device=new_ln_pos.device), code, 1)
            old = self._position_heads(self.self_pos_k_linear, ln_past)
        keys = torch.cat([old, self._position_heads(self.self_pos_k_linear, new_ln_pos)], dim=2)
        store._ofa_position_keys = (code_mode, keys)
        return keys

    def forward(self, input_ids: torch.Tensor, encoder_hidden_states: torch.Tensor,
                encoder_padding_mask: torch.Tensor, encoder_position_embedding: torch.Tensor,
                code_masks: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                past_key_values: EncoderDecoderCache | None = None) -> torch.Tensor:
        """Logits ``[B, T, vocab]`` for ``input_ids`` ``[B, T]`` following ``past_key_values`` (if any).

        ``attention_mask`` (optional, ``[B, past + T]``, 1 = keep) overrides the default
        decoder padding mask ``input_ids == pad`` (cached positions count as not padded).
        """
        B, T = input_ids.shape
        device = input_ids.device
        past = past_key_values.get_seq_length() if past_key_values is not None else 0
        total = past + T
        max_len = min(self.image_position_idx.numel(), self.embed_positions.num_embeddings)
        if total > max_len:
            raise ValueError(f"decoder length {total} exceeds the model's maximum {max_len}")
        code = code_masks.to(device=device, dtype=torch.bool) if code_masks is not None else None
        all_pos = torch.arange(total, device=device)
        new_pos = all_pos[past:]

        # Incremental decoding of a batch in one mode embeds only the new positions and takes the
        # position keys of the cached ones from the cache (_self_position_keys); otherwise every
        # position is embedded and projected, as in the reference.
        one_mode = code is None or bool(code.all()) or not bool(code.any())
        incremental = past_key_values is not None and one_mode
        tgt_pos, ln_pos = self._positions(new_pos if incremental else all_pos, code, B)
        new = ln_pos.shape[1] - T  # index of the first new position in tgt_pos / ln_pos
        q_pos = ln_pos[:, new:]
        if incremental:
            q = self._position_heads(self.self_pos_q_linear, q_pos) * self.pos_scaling
            self_abs = q @ self._self_position_keys(past_key_values, past, q_pos[:1], code).transpose(2, 3)
        else:
            self_abs = self._project(self.self_pos_q_linear, self.self_pos_k_linear, q_pos, ln_pos)
        cross_bias = self._project(self.cross_pos_q_linear, self.cross_pos_k_linear, q_pos,
                                   encoder_position_embedding)
        cross_bias = cross_bias + _additive_mask(encoder_padding_mask, cross_bias.dtype)

        # positions are always added in the decoder (reference quirk)
        x = self.embed_scale * self.embed_tokens(input_ids) + tgt_pos[:, new:]
        if self.layernorm_embedding is not None:
            if self.code_layernorm_embedding is not None:
                x = self._per_sample(
                    code, lambda: self.code_layernorm_embedding(x), lambda: self.layernorm_embedding(x)
                )
            else:
                x = self.layernorm_embedding(x)
        x = F.dropout(x, self.dropout, self.training)

        min_value = torch.finfo(x.dtype).min
        mask = torch.zeros(T, total, dtype=x.dtype, device=device)
        mask = mask.masked_fill(all_pos[None, :] > new_pos[:, None], min_value)[None, None]  # causal
        if attention_mask is not None:
            key_pad = ~attention_mask.to(device=device, dtype=torch.bool)
        else:
            past_pad = torch.zeros(B, past, dtype=torch.bool, device=device)
            key_pad = torch.cat([past_pad, input_ids.eq(self.padding_idx)], 1)
        if bool(key_pad.any()):
            mask = mask + _additive_mask(key_pad, x.dtype)
        image_ids = self.image_position_idx[all_pos]
        for idx, layer in enumerate(self.layers):
            rel = self._per_sample(
                code, lambda: self.image_rel_bias(idx, image_ids[past:], image_ids)[None],
                lambda: self.token_rel_bias(idx, new_pos, all_pos)[None],
            )
            self_bias = self_abs + rel + mask
            if self.gradient_checkpointing and self.training and past_key_values is None:
                x = torch.utils.checkpoint.checkpoint(
                    layer, x, self_bias, encoder_hidden_states, cross_bias, use_reentrant=False
                )
            else:
                x = layer(x, self_bias, encoder_hidden_states, cross_bias, past_key_values)
        return self.output_projection(self.layer_norm(x))


# ---------------------------------------------------------------------------------------------
# models
# ---------------------------------------------------------------------------------------------


#: OFA's captioning/VQA inference defaults, set on ``generation_config`` (override per call;
#: text-to-image uses sampling/greedy without the n-gram block).
OFA_GENERATION_DEFAULTS = dict(num_beams=5, no_repeat_ngram_size=3, max_new_tokens=16)


class OFAPreTrainedModel(PreTrainedModel):
    """Weight init, checkpoint I/O (strict keys, safetensors), gradient checkpointing."""

    config_class = OFAConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    supports_gradient_checkpointing = True
    _supports_sdpa = True
    _no_split_modules = ["OFAEncoderLayer", "OFADecoderLayer"]

    def _init_weights(self, module: nn.Module) -> None:
        """Reference init: N(0, init_std) Linear/Embedding, identity LayerNorm, ``c_attn`` = 1,
        zero rel-pos tables; Kaiming convs and identity BatchNorm in the ResNet. The shared token
        embedding (also the output projection) is N(0, ``token_embedding_init_std``) when that is set."""
        std = self.config.token_embedding_init_std
        if getattr(module, "is_token_embedding", False) and std is not None:  # embedding or tied output
            init.normal_(module.weight, mean=0.0, std=std)
            if self.config.pad_token_id is not None:
                init.zeros_(module.weight[self.config.pad_token_id])
            return
        super()._init_weights(module)  # Linear, Embedding, LayerNorm, BatchNorm
        if isinstance(module, nn.Conv2d):
            init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(module, OFAAttention):
            init.ones_(module.c_attn)
        elif isinstance(module, _RelPosTables):
            for table in (*module.token_rel_pos_table_list, *module.image_rel_pos_table_list):
                init.zeros_(table.weight)

    @classmethod
    def from_pretrained(cls, path, allow_pickle: bool = False, config: OFAConfig | None = None, **kwargs):
        """Load ``config.json`` + ``model.safetensors`` from a local directory.

        Strict keys; the one key mapping lives in ``unicon.models.ofa.convert``. ``kwargs``:
        ``dtype``, ``device``, ``attn_implementation`` (``"sdpa"`` | ``"eager"``).
        """
        return load_pretrained(cls, path, allow_pickle=allow_pickle, config=config, **kwargs)

    def save_pretrained(self, path, **kwargs) -> None:
        """Write ``config.json`` + ``model.safetensors`` (one copy of the tied embedding)."""
        save_pretrained(self, path)


class OFAModel(OFAPreTrainedModel, GenerationMixin):
    """Encoder-decoder (keys ``encoder.*`` / ``decoder.*``); the decoder ends in the tied output projection.

    The reference decoder already projects to the vocabulary, so this class returns logits and
    can ``generate`` like the top class; it only lacks the ``model.`` key prefix.
    """

    _tied_weights_keys = {
        "decoder.embed_tokens.weight": "encoder.embed_tokens.weight",
        "decoder.output_projection.weight": "encoder.embed_tokens.weight",
    }

    def __init__(self, config: OFAConfig):
        super().__init__(config)
        shared = nn.Embedding(config.vocab_size, config.d_model, config.pad_token_id)
        self.encoder = OFAEncoder(config, shared)
        self.decoder = OFADecoder(config, shared)
        for module in (shared, self.decoder.output_projection):  # one tensor, two modules to initialise
            module.is_token_embedding = True  # _init_weights: config.token_embedding_init_std
        self.post_init()
        self.generation_config.update(**OFA_GENERATION_DEFAULTS)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.encoder.embed_tokens

    def get_output_embeddings(self) -> nn.Linear:
        return self.decoder.output_projection

    def get_encoder(self):
        return self.encoder

    def encode(self, input_ids: torch.Tensor, patch_images: torch.Tensor | None = None,
               patch_masks: torch.Tensor | None = None) -> OFAEncoderOutput:
        """Run the encoder once; reuse the result for any number of decoder passes."""
        return self.encoder(input_ids, patch_images, patch_masks)

    def decode(self, decoder_input_ids: torch.Tensor, encoder_outputs: OFAEncoderOutput,
               code_masks: torch.Tensor | None = None, decoder_attention_mask: torch.Tensor | None = None,
               past_key_values: EncoderDecoderCache | None = None) -> torch.Tensor:
        """Logits ``[B, T, vocab]`` of ``decoder_input_ids`` given encoder outputs (row-aligned)."""
        return self.decoder(
            decoder_input_ids,
            encoder_outputs.last_hidden_state,
            encoder_outputs.padding_mask,
            encoder_outputs.position_embedding,
            code_masks=code_masks,
            attention_mask=decoder_attention_mask,
            past_key_values=past_key_values,
        )

    def forward(self, input_ids: torch.Tensor | None = None, patch_images: torch.Tensor | None = None,
                patch_masks: torch.Tensor | None = None, decoder_input_ids: torch.Tensor | None = None,
                code_masks: torch.Tensor | None = None, encoder_outputs: OFAEncoderOutput | None = None,
                past_key_values: Cache | None = None, use_cache: bool = False,
                decoder_attention_mask: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                **unused) -> Seq2SeqLMOutput:
        """Full pass; ``encoder_outputs`` skips the encoder, ``labels`` (-100 = ignore) add a CE ``loss``.

        A given ``past_key_values`` is used and extended (``decoder_input_ids`` are then the new
        tokens only); ``use_cache=True`` without one starts a new cache.
        """
        if encoder_outputs is None:
            if input_ids is None:
                raise ValueError("OFA forward needs input_ids or encoder_outputs")
            encoder_outputs = self.encode(input_ids, patch_images, patch_masks)
        elif not isinstance(encoder_outputs, OFAEncoderOutput):
            encoder_outputs = OFAEncoderOutput(*encoder_outputs)
        if decoder_input_ids is None:
            raise ValueError("OFA forward needs decoder_input_ids")
        if use_cache and past_key_values is None:
            past_key_values = EncoderDecoderCache(DynamicCache(), DynamicCache())
        elif past_key_values is not None and not isinstance(past_key_values, EncoderDecoderCache):
            past_key_values = EncoderDecoderCache(past_key_values, DynamicCache())  # self-attention only
        logits = self.decode(
            decoder_input_ids, encoder_outputs, code_masks, decoder_attention_mask, past_key_values
        )
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)
        return Seq2SeqLMOutput(
            loss=loss,
            logits=logits,
            past_key_values=past_key_values,
            encoder_last_hidden_state=encoder_outputs.last_hidden_state,
        )


class OFAForConditionalGeneration(OFAPreTrainedModel, GenerationMixin):
    """Top class (keys ``model.*``) as in the OFA-Sys port, with transformers' ``generate``."""

    _tied_weights_keys = {
        "model.decoder.embed_tokens.weight": "model.encoder.embed_tokens.weight",
        "model.decoder.output_projection.weight": "model.encoder.embed_tokens.weight",
    }

    def __init__(self, config: OFAConfig):
        super().__init__(config)
        self.model = OFAModel(config)
        self.post_init()
        self.generation_config.update(**OFA_GENERATION_DEFAULTS)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.encoder.embed_tokens

    def get_output_embeddings(self) -> nn.Linear:
        return self.model.decoder.output_projection

    def get_encoder(self):
        return self.model.encoder

    def encode(self, input_ids, patch_images=None, patch_masks=None) -> OFAEncoderOutput:
        return self.model.encode(input_ids, patch_images, patch_masks)

    def decode(self, decoder_input_ids, encoder_outputs, code_masks=None, decoder_attention_mask=None,
               past_key_values=None) -> torch.Tensor:
        return self.model.decode(decoder_input_ids, encoder_outputs, code_masks, decoder_attention_mask,
                                 past_key_values)

    def forward(self, input_ids=None, patch_images=None, patch_masks=None, decoder_input_ids=None,
                code_masks=None, encoder_outputs=None, past_key_values=None, use_cache=False,
                decoder_attention_mask=None, labels=None, **unused) -> Seq2SeqLMOutput:
        return self.model(
            input_ids=input_ids, patch_images=patch_images, patch_masks=patch_masks,
            decoder_input_ids=decoder_input_ids, code_masks=code_masks, encoder_outputs=encoder_outputs,
            past_key_values=past_key_values, use_cache=use_cache,
            decoder_attention_mask=decoder_attention_mask, labels=labels,
        )
