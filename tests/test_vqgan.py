"""VQGAN tokenizer on a tiny random diffusers VQModel, and the taming-transformers key conversion."""

import re

import pytest
import torch
from diffusers import VQModel
from torch import nn

from conftest import float32_tol

from unicon.models.base import pil_to_tensor
from unicon.models.vqgan import VQGANTokenizer, convert_taming_checkpoint, taming_config_to_diffusers

DDCONFIG = dict(ch=32, ch_mult=[1, 2, 2], num_res_blocks=1, attn_resolutions=[4], resolution=16,
                in_channels=3, out_ch=3, z_channels=4, double_z=False, dropout=0.0)


@pytest.fixture(scope="module")
def vq():
    torch.manual_seed(0)
    return VQModel(**taming_config_to_diffusers(DDCONFIG, n_embed=16, embed_dim=3)).eval()


def to_taming(state):
    """Independent inverse of the documented mapping (diffusers -> taming names)."""
    n = 1 + max(int(m.group(1)) for k in state if (m := re.match(r"decoder\.up_blocks\.(\d+)\.", k)))
    attn = {"group_norm": "norm", "to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "proj_out"}
    out = {}
    for key, value in state.items():
        new = key.replace("conv_norm_out", "norm_out").replace("conv_shortcut", "nin_shortcut")
        new = new.replace("mid_block.resnets.0", "mid.block_1").replace("mid_block.resnets.1", "mid.block_2")
        new = new.replace("mid_block.attentions.0", "mid.attn_1")
        new = re.sub(r"down_blocks\.(\d+)\.downsamplers\.0", r"down.\1.downsample", new)
        new = re.sub(r"down_blocks\.(\d+)\.resnets", r"down.\1.block", new)
        new = re.sub(r"down_blocks\.(\d+)\.attentions", r"down.\1.attn", new)
        kinds = {"resnets": "block", "attentions": "attn", "upsamplers.0": "upsample"}
        new = re.sub(r"up_blocks\.(\d+)\.(resnets|attentions|upsamplers\.0)",
                     lambda m: f"up.{n - 1 - int(m.group(1))}.{kinds[m.group(2)]}", new)
        for d, t in attn.items():
            new = new.replace(f".{d}.", f".{t}.")
        if re.search(r"\.(q|k|v|proj_out)\.weight$", new):
            value = value[:, :, None, None]
        out[new] = value
    return out


def test_convert_taming_checkpoint_round_trip(vq):
    taming = to_taming(vq.state_dict())
    assert "encoder.down.0.block.0.norm1.weight" in taming and "decoder.up.0.block.0.conv1.weight" in taming
    assert taming["encoder.mid.attn_1.q.weight"].ndim == 4
    taming["loss.discriminator.main.0.weight"] = torch.zeros(1)  # dropped
    converted, gumbel = convert_taming_checkpoint(taming)
    assert gumbel is None
    assert converted.keys() == vq.state_dict().keys()
    for key, value in vq.state_dict().items():
        assert torch.equal(converted[key], value), key
    # the lowest-resolution taming decoder level is diffusers' first up block
    assert torch.equal(converted["decoder.up_blocks.0.resnets.0.conv1.weight"],
                       taming["decoder.up.2.block.0.conv1.weight"])


def test_convert_gumbel_and_unknown_keys(vq):
    taming = to_taming(vq.state_dict())
    taming["quantize.embed.weight"] = taming.pop("quantize.embedding.weight")
    taming["quantize.proj.weight"], taming["quantize.proj.bias"] = torch.randn(16, 3, 1, 1), torch.randn(16)
    converted, gumbel = convert_taming_checkpoint(taming)
    assert "quantize.embedding.weight" in converted and set(gumbel) == {"weight", "bias"}
    with pytest.raises(KeyError, match="encoder.down.0.block.0.strange.weight"):
        convert_taming_checkpoint({**taming, "encoder.down.0.block.0.strange.weight": torch.zeros(1)})


def test_encode_decode_shapes_and_quantizer(vq):
    tok = VQGANTokenizer(vq)
    assert tok.grid_size == (4, 4) and tok.image_size == (16, 16) and tok.codebook_size == 16
    images = torch.rand(2, 3, 16, 16)
    codes = tok.encode(images)
    assert codes.shape == (2, 4, 4) and codes.dtype == torch.long
    # encode = nearest codebook entry of quant_conv(encoder(2x - 1)), computed independently
    with torch.no_grad():
        h = vq.quant_conv(vq.encoder(images * 2 - 1)).permute(0, 2, 3, 1)
        dist = ((h[..., None, :] - vq.quantize.embedding.weight) ** 2).sum(-1)
    assert torch.equal(codes, dist.argmin(-1))
    decoded = tok.decode(codes)
    assert decoded.shape == (2, 3, 16, 16) and 0 <= decoded.min() and decoded.max() <= 1
    # decode(codes) runs the decoder on exactly the codebook vectors of those codes
    with torch.no_grad():
        quant = vq.quantize.embedding.weight[codes].permute(0, 3, 1, 2)
        want = ((vq.decoder(vq.post_quant_conv(quant)) + 1) / 2).clamp(0, 1)
    # the tokenizer's decode and this recomputation may batch/round the convolutions differently:
    # conftest.float32_tol over the decoder's longest reduction (3x3 convolutions over 64 channels,
    # ch * max(ch_mult)) through its reducing layers (post-quant conv, conv_in, 2 res blocks of 2 convs
    # per level for 3 levels, attention, conv_out: 16), for images in [0, 1]
    assert torch.allclose(decoded, want, atol=float32_tol(9 * 64, 1.0, depth=16), rtol=0)
    # the quantizer is idempotent: codebook vectors of the codes re-quantize to the same codes
    _, _, (_, _, again) = vq.quantize(quant)
    assert torch.equal(again.view(codes.shape), codes)
    # PIL input gives the same codes as the tensor
    pil = tok.decode_to_pil(codes)
    assert torch.equal(tok.encode(pil), tok.encode(pil_to_tensor(pil)))


def test_bad_inputs(vq):
    tok = VQGANTokenizer(vq)
    with pytest.raises(ValueError, match="expects"):
        tok.encode(torch.rand(1, 3, 32, 32))
    with pytest.raises(ValueError, match="codes must lie"):
        tok.decode(torch.full((1, 4, 4), 16))


def test_save_load_with_gumbel(vq, tmp_path):
    proj = nn.Conv2d(3, 16, 1)
    tok = VQGANTokenizer(vq, gumbel_proj=proj)
    images = torch.rand(1, 3, 16, 16)
    codes = tok.encode(images)
    with torch.no_grad():
        want = proj(vq.quant_conv(vq.encoder(images * 2 - 1))).argmax(1)
    assert torch.equal(codes, want)
    tok.save_pretrained(tmp_path)
    again = VQGANTokenizer.from_pretrained(tmp_path)
    assert torch.equal(again.encode(images), codes)
    assert torch.equal(again.decode(codes), tok.decode(codes))
    with pytest.raises(FileNotFoundError):
        VQGANTokenizer.from_pretrained(tmp_path / "missing")
