"""Image editing (``UnifiedModel.edit_image`` / ``score_edit``) on the tiny configs of all three
backends -- the native OFA, Janus and the decoupled VLM + Stable Diffusion pipeline -- and the
interface's refusal on a model that does not edit.

The models have random weights (the plumbing is what is checked, which a random model exercises as
well as a trained one); the edit rows are the tiny ShapesWorld's ``edit_<split>.jsonl`` (source image,
instruction, exact target image). Checks that can fail on a wrong implementation: a model prefers
its own greedy edit to other targets (OFA, Janus); Janus's edit decode is the text-to-image step rule
(its loop over a text prefix reproduces transformers' image loop) and ``score_edit`` reads exactly the
logits it decodes from; the decoupled score is recomputed from its definition one UNet call at a
time, over the timesteps the img2img sampler actually starts from. ``tests/test_ofa_edit.py`` holds
OFA's exact decode-vs-score identity.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import float32_tol
from omegaconf import OmegaConf
from PIL import Image

from unicon.models.base import EditingNotSupported, ImageGenerationConfig, UnifiedModel

REPO = Path(__file__).resolve().parents[1]
BACKENDS = ("ofa", "janus", "decoupled")
OFA_ARCH = dict(d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, resnet_width=8,
                num_bins=65, num_beams=2, max_new_tokens=8)


# ---- models and data ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def edits(tiny_shapes_world):
    """(sources, instructions, targets) of three edit rows of the tiny world."""
    rows = [json.loads(line) for split in ("test", "train")
            for line in (tiny_shapes_world / f"edit_{split}.jsonl").read_text().splitlines()]
    assert len(rows) >= 3, "the tiny world has too few edit rows"
    rows = rows[:3]

    def image(rel):
        with Image.open(tiny_shapes_world / rel) as im:
            return im.convert("RGB")

    sources, targets = [image(r["image"]) for r in rows], [image(r["target_image"]) for r in rows]
    return sources, [r["text"] for r in rows], targets


def _ofa(world):
    from unicon.models import build_model

    torch.manual_seed(0)
    m = build_model({"backend": "ofa", "preset": "shapes-tiny", "arch": dict(OFA_ARCH)}, world_root=world)
    gen = torch.Generator().manual_seed(1)  # full-strength weights: at init all codes are about equally likely
    with torch.no_grad():
        for p in m.parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(noise * p[0].numel() ** -0.5 if p.dim() >= 2 else p + 0.1 * noise)
    return m


def _janus():
    from unicon.models.janus import JanusUnifiedModel

    cfg = OmegaConf.to_container(OmegaConf.load(REPO / "configs" / "model" / "janus_tiny.yaml"))
    cfg["arch"]["initializer_range"] = 0.3  # distributions far from uniform
    cfg["arch"]["text_config"]["initializer_range"] = 0.3
    torch.manual_seed(0)
    return JanusUnifiedModel.from_config(cfg)


def _decoupled():
    from unicon.models.decoupled import DecoupledUnifiedModel

    cfg = OmegaConf.to_container(OmegaConf.load(REPO / "configs" / "model" / "decoupled_tiny.yaml"))
    return DecoupledUnifiedModel.from_config(cfg)  # random_tiny_parts: builds its own tiny LLaVA + SD 1.x


@pytest.fixture(scope="module")
def models(tiny_shapes_world):
    return {"ofa": _ofa(tiny_shapes_world).eval(), "janus": _janus().eval(), "decoupled": _decoupled().eval()}


def _output_size(model) -> tuple[int, int]:
    if model.backend == "decoupled":
        return (model.image_size, model.image_size)
    h, w = model.image_tokenizer.image_size
    return (w, h)


# ---- every backend ------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_edit_image_gives_one_image_per_row_reproducibly_under_a_seed(models, edits, backend):
    model = models[backend]
    sources, instructions, _ = edits
    assert model.supports_editing
    cfg = ImageGenerationConfig(do_sample=True, seed=3, guidance_scale=2.0)
    first = model.edit_image(sources, instructions, cfg)
    assert [(im.size, im.mode) for im in first] == [(_output_size(model), "RGB")] * len(sources)
    again = model.edit_image(sources, instructions, cfg)
    assert [im.tobytes() for im in again] == [im.tobytes() for im in first]
    other_seed = ImageGenerationConfig(do_sample=True, seed=4, guidance_scale=2.0)
    other = model.edit_image(sources, instructions, other_seed)
    assert [im.tobytes() for im in other] != [im.tobytes() for im in first]
    default = model.edit_image(sources[:1], instructions[:1])  # config None: the model's own settings
    assert len(default) == 1 and default[0].size == _output_size(model)


@pytest.mark.parametrize("backend", BACKENDS)
def test_score_edit_shape_gradient_and_dependence_on_the_target(models, edits, backend):
    model = models[backend]
    sources, instructions, targets = edits
    B = len(sources)
    scores = model.score_edit(sources, instructions, targets)
    assert scores.nll.shape == scores.sum_nll.shape == (B, 1) and bool(scores.mask.all())
    assert torch.isfinite(scores.sum_nll).all() and (scores.num_tokens > 0).all()
    torch.testing.assert_close(scores.nll, scores.sum_nll / scores.num_tokens)
    swapped = model.score_edit(sources, instructions, targets[1:] + targets[:1])
    assert (swapped.sum_nll - scores.sum_nll).abs().min() > 0  # every row reads its own target
    model.train()
    try:
        model.zero_grad(set_to_none=True)
        model.score_edit(sources, instructions, targets).sum_nll.sum().backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}
        assert grads and all(torch.isfinite(g).all() for g in grads.values())
        # the image-producing part learns from edit rows
        producer = {"ofa": "ofa.decoder.", "janus": "janus.model.generation_head.",
                    "decoupled": "diffusion.unet."}[backend]
        assert any(g.abs().sum() > 0 for n, g in grads.items() if n.startswith(producer)), sorted(grads)[:5]
    finally:
        model.zero_grad(set_to_none=True)
        model.eval()


@pytest.mark.parametrize("backend", BACKENDS)
def test_edit_calls_refuse_mismatched_lengths(models, edits, backend):
    model = models[backend]
    sources, instructions, targets = edits
    n = len(sources)
    with pytest.raises(ValueError, match=f"got {n} images but 1 instructions"):
        model.edit_image(sources, instructions[:1])
    with pytest.raises(ValueError, match=f"got {n} images, {n} instructions and {n - 1} target images"):
        model.score_edit(sources, instructions, targets[1:])
    with pytest.raises(ValueError, match=f"got {n} images, {n - 1} instructions and {n} target images"):
        model.score_edit(sources, instructions[1:], targets)


def test_the_interface_refuses_editing_naming_the_backend(models, edits):
    sources, instructions, targets = edits
    abstract = {name: (lambda self, *a, **k: None) for name in UnifiedModel.__abstractmethods__}
    NoEdit = type("NoEdit", (UnifiedModel,), abstract)
    assert not NoEdit.supports_editing and not UnifiedModel.supports_editing
    with pytest.raises(EditingNotSupported, match=r"the NoEdit backend does not edit images \(edit_image\)"):
        NoEdit().edit_image(sources, instructions)
    Named = type("Named", (NoEdit,), {"backend": "toy"})
    with pytest.raises(EditingNotSupported, match=r"the toy backend does not edit images \(score_edit\)"):
        Named().score_edit(sources, instructions, targets)
    assert issubclass(EditingNotSupported, NotImplementedError)
    with pytest.raises(EditingNotSupported, match="the janus backend"):  # the default, on a real backend
        UnifiedModel.edit_image(models["janus"], sources, instructions)


# ---- the model prefers its own greedy edit ------------------------------------------------------
def test_ofa_prefers_its_own_greedy_edit_to_other_targets(models, edits):
    model = models["ofa"]
    sources, instructions, targets = edits
    with torch.no_grad():
        greedy = model.edit_image(sources, instructions, ImageGenerationConfig())
        own = model.score_edit(sources, instructions, greedy).sum_nll[:, 0]
        gold = model.score_edit(sources, instructions, targets).sum_nll[:, 0]
        tok = model.image_tokenizer
        gen = torch.Generator().manual_seed(0)
        codes = torch.randint(tok.codebook_size, (len(sources), *tok.grid_size), generator=gen)
        random = model.score_edit(sources, instructions, tok.decode_to_pil(codes)).sum_nll[:, 0]
    assert (own < gold).all() and (own < random).all(), (own, gold, random)


def test_janus_edit_decode_is_the_text_to_image_step_rule(models):
    """Over a text-only prefix, the loop edit_image runs reproduces transformers' image loop
    (what generate_image runs), greedy and sampled with guidance under a seed."""
    from unicon.models.janus import _seeded

    model = models["janus"]
    embed = model.janus.get_input_embeddings()
    ids = torch.tensor([model._generation_prompt_ids("a red square")])
    uncond = ids.clone()  # transformers' unconditional prompt: every token but BOS and BOI padded
    uncond[(uncond != model.boi_id) & (uncond != model.tokenizer.bos_token_id)] = model.pad_id
    sampled = ImageGenerationConfig(do_sample=True, seed=5, temperature=0.8, top_p=0.9, guidance_scale=2.0)
    for cfg in (ImageGenerationConfig(), sampled):
        reference = model.generate_image_codes(["a red square"], config=cfg)
        with _seeded(cfg.seed, model.device):
            codes, _ = model._decode_image_codes(ids, embed(ids), torch.ones_like(ids), embed(uncond), cfg)
        assert torch.equal(codes, reference), cfg


def test_janus_score_edit_reads_the_logits_the_edit_decodes_from(models, edits):
    """The NLL pass of score_edit over the greedy edit's codes equals -sum log p from the decode's own
    per-step logits; and those codes are more likely than the gold target's and a shuffled edit's."""
    model = models["janus"]
    sources, instructions, targets = edits
    B = len(sources)
    with torch.no_grad():
        ids, embeds, mask, uncond = model._edit_prefix(sources, instructions)
        codes, logits = model._decode_image_codes(ids, embeds, mask, uncond, ImageGenerationConfig(),
                                                  keep_logits=True)
        raw = torch.stack(logits, dim=1)  # [B, N, V]
        decoded = -raw.log_softmax(-1).gather(-1, codes[..., None])[..., 0].sum(-1)
        rows = torch.arange(B)
        scored = model._code_nll(embeds, mask, codes, rows).sum(-1)
        gold = model._code_nll(embeds, mask, model.image_codes(targets), rows).sum(-1)
        shuffled = model._code_nll(embeds, mask, codes.roll(1, dims=0), rows).sum(-1)
        # score_edit = this pass over the targets' VQ codes
        torch.testing.assert_close(model.score_edit(sources, instructions, targets).sum_nll[:, 0], gold)
    # cached one-step decode vs one full pass, float32: the longest reduction is the VQ/vision stack's
    # 576-term convolutions, 6 reducing layers deep (as tests/test_janus.py bounds its loop check)
    per_code = 2 * float32_tol(576, float(raw.abs().max()), depth=6)
    torch.testing.assert_close(scored, decoded, rtol=0, atol=codes.shape[1] * per_code)
    assert (scored < gold).all() and (scored < shuffled).all(), (scored, gold, shuffled)
    # guidance against the image-only prompt changes the edit (the unconditional rows differ)
    guided, _ = model._decode_image_codes(ids, embeds, mask, uncond, ImageGenerationConfig(guidance_scale=3))
    assert not torch.equal(guided, codes)


# ---- the decoupled proxy, from its definition ---------------------------------------------------
def test_decoupled_score_edit_is_its_definition_over_the_chain_edit_image_runs(models, edits, monkeypatch):
    model = models["decoupled"]
    sources, instructions, targets = edits
    pipe = model._image_to_image()
    assert type(pipe).__name__ == "StableDiffusionImg2ImgPipeline" and pipe.unet is model.pipeline.unet
    # the sampler of edit_image starts at edit_start_timestep (record the UNet's timesteps)
    seen = []
    unet_forward = type(pipe.unet).forward
    monkeypatch.setattr(type(pipe.unet), "forward",
                        lambda self, sample, timestep, *a, **k: seen.append(int(timestep)) or
                        unet_forward(self, sample, timestep, *a, **k))
    model.edit_image(sources[:1], instructions[:1], ImageGenerationConfig(guidance_scale=1.0))
    monkeypatch.undo()
    t_s = model.edit_start_timestep()
    steps = model.settings.num_inference_steps
    assert seen[0] == t_s and len(seen) == int(steps * model.settings.edit_strength)
    # score_edit = mean_i [ e(t_i, eps_i; instruction) + abar_s / (2 (1 - abar_s)) mean (z - z_src)^2 ]
    n = model.settings.score_timesteps
    with torch.no_grad():
        scores = model.score_edit(sources, instructions, targets)
        abar = model.pipeline.scheduler.alphas_cumprod.float()
        for b in range(len(sources)):
            pixels = model.prepare_images(targets[b:b + 1])
            z = model._latents(pixels).float()[0]
            z_src = model._latents(model.prepare_images(sources[b:b + 1])).float()[0]
            eps = model._noise(pixels[0], tuple(z.shape))
            cond = model._text_conditioning([instructions[b].strip()])["encoder_hidden_states"]
            total = 0.0
            for i in range(n):
                t = int((i + 0.5) * t_s / n)
                x_t = abar[t].sqrt() * z + (1 - abar[t]).sqrt() * eps[i]
                out = model.pipeline.unet(x_t[None], torch.tensor([t]), encoder_hidden_states=cond).sample[0]
                total += float((out - eps[i]).pow(2).mean())  # the tiny SD predicts epsilon
            start = float(abar[t_s] / (2 * (1 - abar[t_s])) * (z - z_src).pow(2).mean())
            expected = total / n + start
            tol = float32_tol(1024, expected, depth=12)  # GroupNorm over 1,024 latents, 12 reducing layers
            assert abs(scores.nll[b, 0].item() - expected) < tol, (b, scores.nll[b, 0].item(), expected)
        # the source matters only through the start of the chain: a target equal to the source drops it
        same = model.score_edit(sources, instructions, sources).nll[:, 0]
        other_source = model.score_edit(targets, instructions, sources).nll[:, 0]
    assert (other_source > same).all()
    stronger = model.edit_image(sources[:1], instructions[:1], ImageGenerationConfig(extra={"strength": 1.0}))
    weaker = model.edit_image(sources[:1], instructions[:1])
    assert stronger[0].tobytes() != weaker[0].tobytes()
