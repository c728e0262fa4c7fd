"""VQGAN image tokenizer (OFA's text-to-image codes) on diffusers' ``VQModel``.

OFA represents an image as a grid of VQGAN codebook indices (8192 entries) that the decoder
predicts as ``<code_i>`` tokens. This module wraps a diffusers :class:`~diffusers.VQModel`
loaded from a *local* directory as a :class:`unicon.core.ImageTokenizer`:

* ``encode``: pixels in [0, 1] -> ``2x − 1`` -> encoder -> ``quant_conv`` -> codes ``[B, h, w]``
  (nearest codebook entry; or, for Gumbel-quantized VQGANs, ``argmax`` of the Gumbel
  projection logits, i.e. the noise-free mode of the Gumbel sampler);
* ``decode``: codes -> codebook vectors -> ``post_quant_conv`` -> decoder -> ``(x + 1) / 2`` in [0, 1].

The downsampling factor is ``2 ** (len(block_out_channels) − 1)``: f16 for a 5-level VQGAN
(256 px -> 16x16 codes). The OFA-Sys text-to-image code (``code_image_size // 8`` decoder
window; the OFA-Sys/ModelScope generators load taming's ``GumbelVQ``) uses taming's Gumbel
VQGAN with 8192 codes; both quantizer kinds are supported here.

Converting a taming-transformers checkpoint
-------------------------------------------
1. Read the taming ``.ckpt`` (``torch.load(path, map_location="cpu", weights_only=True)["state_dict"]``)
   and its YAML (``model.params``: ``ddconfig``, ``n_embed``, ``embed_dim``).
2. ``kwargs = taming_config_to_diffusers(ddconfig, n_embed, embed_dim)``;
   ``vq = diffusers.VQModel(**kwargs)``.
3. ``state, gumbel = convert_taming_checkpoint(state_dict)``;
   ``vq.load_state_dict(state, strict=True)``.
4. ``VQGANTokenizer(vq, gumbel_proj=...).save_pretrained(dir)`` writes the diffusers folder
   (plus ``gumbel_proj.safetensors`` for Gumbel models); ``VQGANTokenizer.from_pretrained(dir)``
   reads it back.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from unicon.core import ImageBatch, ImageTokenizer, register_image_tokenizer
from unicon.models.base import pil_to_tensor

GUMBEL_FILE = "gumbel_proj.safetensors"

_ATTN = {"norm": "group_norm", "q": "to_q", "k": "to_k", "v": "to_v", "proj_out": "to_out.0"}
_RESNET = {
    "norm1": "norm1", "conv1": "conv1", "norm2": "norm2", "conv2": "conv2", "nin_shortcut": "conv_shortcut",
}


def convert_taming_checkpoint(
    state_dict: dict[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], dict | None]:
    """Map a taming-transformers VQGAN ``state_dict`` to diffusers ``VQModel`` keys.

    Returns ``(vqmodel_state, gumbel_proj_state)``; the second is ``None`` unless the
    checkpoint is a ``GumbelVQ`` (``quantize.proj`` present). Mapping:

    ==========================================  ===============================================
    taming                                      diffusers
    ==========================================  ===============================================
    ``{enc,dec}oder.conv_in`` / ``conv_out``    same
    ``{enc,dec}oder.norm_out``                  ``conv_norm_out``
    ``encoder.down.{i}.block.{j}.<r>``          ``encoder.down_blocks.{i}.resnets.{j}.<r'>``
    ``encoder.down.{i}.attn.{j}.<a>``           ``encoder.down_blocks.{i}.attentions.{j}.<a'>``
    ``encoder.down.{i}.downsample.conv``        ``encoder.down_blocks.{i}.downsamplers.0.conv``
    ``decoder.up.{i}.block/attn.{j}``           ``decoder.up_blocks.{n−1−i}.resnets/attentions.{j}``
    ``decoder.up.{i}.upsample.conv``            ``decoder.up_blocks.{n−1−i}.upsamplers.0.conv``
    ``*.mid.block_1`` / ``attn_1`` / ``block_2``  ``*.mid_block.resnets.0`` / ``attentions.0`` / ``resnets.1``
    ``quant_conv``, ``post_quant_conv``         same
    ``quantize.embedding`` (or Gumbel ``embed``)  ``quantize.embedding``
    ``quantize.proj`` (Gumbel only)             returned separately (``gumbel_proj``)
    ``loss.*`` (discriminator, LPIPS)           dropped
    ==========================================  ===============================================

    with ``<r'>`` = ``norm1, conv1, norm2, conv2`` and ``nin_shortcut -> conv_shortcut``; attention
    ``norm -> group_norm``, ``q/k/v -> to_q/to_k/to_v``, ``proj_out -> to_out.0``, and the 1x1-conv
    attention weights ``[C, C, 1, 1]`` squeezed to linear ``[C, C]``. ``n`` is the number of
    decoder levels. An unrecognised key raises ``KeyError`` naming it.
    """
    ups = {int(m.group(1)) for k in state_dict if (m := re.match(r"decoder\.up\.(\d+)\.", k))}
    num_levels = max(ups) + 1 if ups else 0
    out: dict[str, torch.Tensor] = {}
    gumbel: dict[str, torch.Tensor] = {}

    def sub_block(rest: str) -> tuple[str, bool]:
        """``block.{j}.x`` / ``attn.{j}.x`` -> diffusers name, and whether it is attention."""
        kind, j, name, param = re.fullmatch(r"(block|attn)\.(\d+)\.(\w+)\.(weight|bias)", rest).groups()
        if kind == "block":
            return f"resnets.{j}.{_RESNET[name]}.{param}", False
        return f"attentions.{j}.{_ATTN[name]}.{param}", name != "norm"

    def mid(rest: str) -> tuple[str, bool]:
        name, sub, param = re.fullmatch(r"(block_1|block_2|attn_1)\.(\w+)\.(weight|bias)", rest).groups()
        if name == "attn_1":
            return f"mid_block.attentions.0.{_ATTN[sub]}.{param}", sub != "norm"
        return f"mid_block.resnets.{0 if name == 'block_1' else 1}.{_RESNET[sub]}.{param}", False

    for key, value in state_dict.items():
        squeeze = False
        try:
            if key.startswith("loss."):
                continue
            if key in ("quantize.embedding.weight", "quantize.embed.weight"):
                new = "quantize.embedding.weight"
            elif key.startswith("quantize.proj."):
                gumbel[key.removeprefix("quantize.proj.")] = value
                continue
            elif key.split(".")[0] in ("quant_conv", "post_quant_conv"):
                new = key
            else:
                part, rest = key.split(".", 1)
                if part not in ("encoder", "decoder"):
                    raise KeyError(key)
                if rest.split(".")[0] in ("conv_in", "conv_out"):
                    new = key
                elif rest.startswith("norm_out."):
                    new = f"{part}.conv_norm_out.{rest.split('.', 1)[1]}"
                elif rest.startswith("mid."):
                    name, squeeze = mid(rest[4:])
                    new = f"{part}.{name}"
                elif m := re.fullmatch(r"down\.(\d+)\.downsample\.conv\.(weight|bias)", rest):
                    new = f"encoder.down_blocks.{m.group(1)}.downsamplers.0.conv.{m.group(2)}"
                elif m := re.fullmatch(r"up\.(\d+)\.upsample\.conv\.(weight|bias)", rest):
                    level = num_levels - 1 - int(m.group(1))
                    new = f"decoder.up_blocks.{level}.upsamplers.0.conv.{m.group(2)}"
                elif m := re.fullmatch(r"down\.(\d+)\.(.*)", rest):
                    name, squeeze = sub_block(m.group(2))
                    new = f"encoder.down_blocks.{m.group(1)}.{name}"
                elif m := re.fullmatch(r"up\.(\d+)\.(.*)", rest):
                    name, squeeze = sub_block(m.group(2))
                    new = f"decoder.up_blocks.{num_levels - 1 - int(m.group(1))}.{name}"
                else:
                    raise KeyError(key)
        except (AttributeError, KeyError) as e:  # regex no-match (None.groups()) or unknown sub-name
            raise KeyError(f"taming checkpoint key {key!r} has no diffusers VQModel equivalent") from e
        if squeeze and value.ndim == 4:
            value = value[:, :, 0, 0]
        out[new] = value
    return out, (gumbel or None)


def taming_config_to_diffusers(ddconfig: dict[str, Any], n_embed: int, embed_dim: int) -> dict[str, Any]:
    """``diffusers.VQModel`` kwargs equivalent to a taming ``ddconfig`` (+ ``n_embed``, ``embed_dim``)."""
    ch_mult = list(ddconfig["ch_mult"])
    levels = len(ch_mult)
    attn_res = set(ddconfig.get("attn_resolutions", []))
    res = [ddconfig["resolution"] // 2**i for i in range(levels)]  # resolution at encoder level i
    down = tuple("AttnDownEncoderBlock2D" if r in attn_res else "DownEncoderBlock2D" for r in res)
    up = tuple("AttnUpDecoderBlock2D" if r in attn_res else "UpDecoderBlock2D" for r in reversed(res))
    return dict(
        in_channels=ddconfig.get("in_channels", 3),
        out_channels=ddconfig.get("out_ch", 3),
        down_block_types=down,
        up_block_types=up,
        block_out_channels=tuple(ddconfig["ch"] * m for m in ch_mult),
        layers_per_block=ddconfig["num_res_blocks"],
        latent_channels=ddconfig["z_channels"],
        num_vq_embeddings=n_embed,
        vq_embed_dim=embed_dim,
        norm_num_groups=32,
        sample_size=ddconfig["resolution"],
    )


class VQGANTokenizer(ImageTokenizer):
    """``ImageTokenizer`` over a diffusers ``VQModel`` (optionally with a Gumbel projection)."""

    def __init__(self, vq, gumbel_proj: nn.Conv2d | None = None, image_size: int | None = None):
        self.vq = vq.eval()
        self.gumbel_proj = gumbel_proj.eval() if gumbel_proj is not None else None
        cfg = vq.config
        self.factor = 2 ** (len(cfg.block_out_channels) - 1)
        side = image_size or cfg.sample_size
        if side % self.factor:
            raise ValueError(f"image size {side} is not a multiple of the VQGAN factor {self.factor}")
        self.codebook_size = cfg.num_vq_embeddings
        self.image_size = (side, side)
        self.grid_size = (side // self.factor, side // self.factor)

    @classmethod
    def from_pretrained(cls, path: str | Path, image_size: int | None = None) -> "VQGANTokenizer":
        """Load a local diffusers ``VQModel`` folder (+ ``gumbel_proj.safetensors`` if present)."""
        from diffusers import VQModel

        path = Path(path)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path}: no diffusers VQModel config.json")
        vq = VQModel.from_pretrained(path, local_files_only=True)
        gumbel = None
        if (path / GUMBEL_FILE).is_file():
            state = load_file(path / GUMBEL_FILE)
            gumbel = nn.Conv2d(state["weight"].shape[1], state["weight"].shape[0], 1)
            gumbel.load_state_dict(state)
        return cls(vq, gumbel, image_size)

    def save_pretrained(self, path: str | Path) -> None:
        path = Path(path)
        self.vq.save_pretrained(path)
        if self.gumbel_proj is not None:
            state = {k: v.contiguous() for k, v in self.gumbel_proj.state_dict().items()}
            save_file(state, path / GUMBEL_FILE)

    def _to_tensor(self, images: ImageBatch) -> torch.Tensor:
        if not isinstance(images, torch.Tensor):
            images = pil_to_tensor([im.resize(self.image_size[::-1]) for im in images])
        if images.ndim != 4 or images.shape[1] != 3:
            raise ValueError(f"expected images [B, 3, H, W], got {tuple(images.shape)}")
        if tuple(images.shape[-2:]) != self.image_size:
            raise ValueError(f"images are {tuple(images.shape[-2:])}, this VQGAN expects {self.image_size}")
        return images

    @torch.no_grad()
    def encode(self, images: ImageBatch) -> torch.Tensor:
        """``[B, 3, H, W]`` in [0, 1] (or PIL) -> codes ``[B, H/f, W/f]``."""
        x = self._to_tensor(images).to(self.vq.device, self.vq.dtype) * 2 - 1
        h = self.vq.quant_conv(self.vq.encoder(x))
        if self.gumbel_proj is not None:
            return self.gumbel_proj(h).argmax(1)
        _, _, (_, _, indices) = self.vq.quantize(h)
        return indices.view(h.shape[0], h.shape[2], h.shape[3])

    @torch.no_grad()
    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """Codes ``[B, h, w]`` -> images ``[B, 3, h·f, w·f]`` in [0, 1]."""
        if codes.ndim != 3:
            raise ValueError(f"expected codes [B, h, w], got {tuple(codes.shape)}")
        if codes.min() < 0 or codes.max() >= self.codebook_size:
            raise ValueError(
                f"codes must lie in [0, {self.codebook_size}), got [{codes.min()}, {codes.max()}]"
            )
        B, h, w = codes.shape
        codes = codes.to(self.vq.device)
        shape = (B, h, w, self.vq.quantize.vq_embed_dim)
        quant = self.vq.quantize.get_codebook_entry(codes.reshape(-1), shape)
        x = self.vq.decode(quant, force_not_quantize=True).sample
        return ((x.float() + 1) / 2).clamp(0, 1)


@register_image_tokenizer("vqgan")
def vqgan_from_spec(spec: dict[str, Any]) -> VQGANTokenizer:
    """A saved model's ``{"type": "vqgan", "path": dir}``: the VQGAN in ``dir``."""
    return VQGANTokenizer.from_pretrained(spec["path"])
