"""Image editing on the native OFA (``OFAUnifiedModel.edit_image`` / ``score_edit``) and the
interface's refusal on backends that do not edit.

The model is a random tiny ShapesWorld OFA: what is checked is the plumbing, which a random model
exercises as well as a trained one. ``score_edit`` must score exactly the input ``edit_image`` decodes
from: the summed log-probabilities of the greedy edit's codes, read from the decoder's own per-step
logits, equal ``-score_edit(source, instruction, greedy edit)`` up to float32 rounding.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import float32_tol
from PIL import Image

from unicon.models.base import EditingNotSupported, ImageGenerationConfig, UnifiedModel

TINY_ARCH = dict(d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                 decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, resnet_width=8,
                 num_bins=65, num_beams=2, max_new_tokens=8)


@pytest.fixture(scope="module")
def edits(tiny_shapes_world):
    rows = [json.loads(line) for line in (tiny_shapes_world / "edit_test.jsonl").read_text().splitlines()]
    assert len(rows) >= 2, "the tiny world has too few edit rows"
    rows = rows[:3]

    def image(rel):
        with Image.open(tiny_shapes_world / rel) as im:
            return im.convert("RGB")

    return [image(r["image"]) for r in rows], [r["text"] for r in rows], [image(r["target_image"]) for r in rows]


@pytest.fixture(scope="module")
def model(tiny_shapes_world):
    from unicon.models import build_model

    torch.manual_seed(0)
    m = build_model({"backend": "ofa", "preset": "shapes-tiny", "arch": dict(TINY_ARCH)}, world_root=tiny_shapes_world)
    # redraw the weights at full strength: at initialisation every code is nearly equally likely
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in m.parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(noise * p[0].numel() ** -0.5 if p.dim() >= 2 else p + 0.1 * noise)
    return m.eval()


def test_edit_image_returns_one_image_per_row_reproducibly_under_a_seed(model, edits):
    sources, instructions, _ = edits
    cfg = ImageGenerationConfig(do_sample=True, seed=3)
    first = model.edit_image(sources, instructions, cfg)
    assert [(im.size, im.mode) for im in first] == [(sources[0].size, "RGB")] * len(sources)
    again = model.edit_image(sources, instructions, cfg)
    assert [im.tobytes() for im in again] == [im.tobytes() for im in first]
    other = model.edit_image(sources, instructions, ImageGenerationConfig(do_sample=True, seed=4))
    assert [im.tobytes() for im in other] != [im.tobytes() for im in first]
    guided = model.edit_image(sources, instructions, ImageGenerationConfig(guidance_scale=2.0))
    assert len(guided) == len(sources)


def test_score_edit_scores_what_edit_image_decodes(model, edits):
    """-score_edit(source, instruction, greedy edit) = sum_t log p(code_t | ...) from the decode's own logits."""
    sources, instructions, _ = edits
    greedy = ImageGenerationConfig()
    h, w = model.image_tokenizer.grid_size
    texts = [model.settings.edit_prompt.format(t) for t in instructions]
    with torch.no_grad():
        codes, logits = model._generate_image_codes(texts, greedy, h * w, model.image_tokenizer.codebook_size,
                                                    keep_logits=True, patch_images=model.prepare_images(sources))
        raw = torch.stack(logits, dim=1)  # [B, h*w, codebook]
        steps = raw.log_softmax(-1)
        decoded = steps.gather(-1, codes.unsqueeze(-1)).squeeze(-1).sum(-1)
        scored = model.score_edit(sources, instructions, model.edit_image(sources, instructions, greedy))
    assert scored.nll.shape == (len(sources), 1) and bool(scored.mask.all())
    # each of the h*w log-probabilities: logits of two computations (cached decode vs one full pass,
    # float32, ffn width 64, ~4 reductions deep) differ within float32_tol; log_softmax at most doubles it
    per_code = 2 * float32_tol(64, scale=float(raw.abs().max()), depth=4)
    tol = h * w * per_code
    torch.testing.assert_close(-scored.sum_nll[:, 0], decoded, rtol=0, atol=tol)
    assert torch.equal(scored.num_tokens[:, 0], torch.full((len(sources),), h * w))


def test_score_edit_reads_the_source_the_instruction_and_the_target_and_trains(model, edits):
    sources, instructions, targets = edits
    base = model.score_edit(sources, instructions, targets).sum_nll[:, 0]
    swapped_instruction = model.score_edit(sources, instructions[1:] + instructions[:1], targets).sum_nll[:, 0]
    swapped_source = model.score_edit(sources[1:] + sources[:1], instructions, targets).sum_nll[:, 0]
    swapped_target = model.score_edit(sources, instructions, targets[1:] + targets[:1]).sum_nll[:, 0]
    for other in (swapped_instruction, swapped_source, swapped_target):
        assert not torch.allclose(base, other)
    model.train()
    try:
        model.zero_grad()
        model.score_edit(sources, instructions, targets).sum_nll.sum().backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
        assert all(torch.isfinite(g).all() for g in grads.values() if g is not None)
        assert any(g is not None and g.abs().sum() > 0 for n, g in grads.items() if "image" in n or "patch" in n)
    finally:
        model.zero_grad()
        model.eval()


def test_edit_calls_refuse_mismatched_lengths(model, edits):
    sources, instructions, targets = edits
    with pytest.raises(ValueError, match=f"got {len(sources)} images but 1 instructions"):
        model.edit_image(sources, instructions[:1])
    with pytest.raises(ValueError, match=f"{len(sources) - 1} target images"):
        model.score_edit(sources, instructions, targets[1:])


def test_a_backend_without_editing_is_refused_naming_it(model, edits):
    sources, instructions, targets = edits
    assert model.supports_editing and not UnifiedModel.supports_editing
    with pytest.raises(EditingNotSupported, match="the ofa backend does not edit images"):
        UnifiedModel.edit_image(model, sources, instructions)  # the interface's default
    with pytest.raises(EditingNotSupported, match=r"score_edit"):
        UnifiedModel.score_edit(model, sources, instructions, targets)
