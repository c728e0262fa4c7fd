"""OFA text-to-image decoding with the decoder's KV cache (``OFAUnifiedModel._generate_image_codes``).

The cached path (encoder once, one new token per decoder call) must give the same codes as the
full recompute (the whole prefix through the decoder at every step) for greedy decoding, seeded
sampling and classifier-free guidance, with per-step logits equal up to float32 rounding. The
model is a tiny random OFA whose position parameters are re-drawn at full strength: at OFA's
initialisation the relative-position tables are zero and the position projections tiny, so an
incremental path that got positions wrong would still pass on it.
"""

from __future__ import annotations

import pytest
import torch
from conftest import float32_tol
from transformers import ClassifierFreeGuidanceLogitsProcessor

from unicon.core import ImageTokenizer
from unicon.models.base import ImageGenerationConfig
from unicon.models.ofa.tokenization import BOS_ID, OFATokenizer
from unicon.models.ofa.unified import (
    ClassifierFreeGuidance,
    OFAUnifiedModel,
    OFAWrapperConfig,
    image_code_processors,
)

GRID = 8  # code_image_size 64 -> an 8x8 decoder code grid (64 steps)
NUM_CODES = 32
PROMPTS = ["a red circle", "two blue squares above a green triangle", "x"]  # ragged: padded sources


class PaletteTokenizer(ImageTokenizer):
    """An 8x8 grid of 32 codes; code i decodes to a flat cell of a fixed colour."""

    codebook_size = NUM_CODES
    grid_size = (GRID, GRID)
    image_size = (8 * GRID, 8 * GRID)

    def encode(self, images):
        raise NotImplementedError("generation only")

    def decode(self, codes):
        palette = torch.rand(NUM_CODES, 3, generator=torch.Generator().manual_seed(0))
        return palette[codes].permute(0, 3, 1, 2).repeat_interleave(8, 2).repeat_interleave(8, 3)


def _strong_random_(ofa: torch.nn.Module, seed: int) -> None:
    """Redraw every parameter so that each term of the decoder matters: matrices (projections,
    embeddings, rel-pos tables [buckets, heads]) N(0, 1/fan_in), vectors (biases, norms, c_attn)
    at their init value + N(0, 0.1)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in ofa.parameters():
            noise = torch.randn(p.shape, generator=gen)
            if p.dim() >= 2:
                p.copy_(noise * p[0].numel() ** -0.5)
            else:
                p.add_(0.1 * noise)


def _model(decoder_layers: int = 2) -> OFAUnifiedModel:
    from unicon.models.ofa.configuration_ofa import preset_config
    from unicon.models.ofa.modeling_ofa import OFAModel

    tok = OFATokenizer.byte_level(300, num_codes=NUM_CODES)
    config = preset_config("shapes-tiny", vocab_size=len(tok), d_model=32, encoder_layers=1,
                           decoder_layers=decoder_layers, encoder_attention_heads=2, decoder_attention_heads=2,
                           encoder_ffn_dim=64, decoder_ffn_dim=64, resnet_width=8, code_image_size=8 * GRID,
                           image_bucket_size=GRID + 1)
    ofa = OFAModel(config)
    _strong_random_(ofa, seed=0)
    settings = OFAWrapperConfig(image_size=64, max_source_length=96, max_target_length=12)
    return OFAUnifiedModel(ofa, tok, settings, PaletteTokenizer()).eval()


@pytest.fixture(scope="module")
def model() -> OFAUnifiedModel:
    return _model()


def _texts(model: OFAUnifiedModel) -> list[str]:
    return [model._t2i_text(p) for p in PROMPTS]


def logit_tol(model: OFAUnifiedModel, logits: torch.Tensor) -> float:
    """Rounding-only difference between the cached and the full decoder pass (other matmul shapes
    and attention lengths sum in another order): conftest.float32_tol over the decoder's longest
    reduction (FFN width, model width, or the attention span of a full grid) through its reducing
    layers (embedding norm, then self-attention, cross-attention and two FFN matmuls per layer,
    then the output projection), at the magnitude of the logits compared."""
    cfg = model.ofa.config
    longest = max(cfg.d_model, cfg.decoder_ffn_dim, GRID * GRID + 1, model.settings.max_source_length)
    return float32_tol(longest, float(logits.abs().max()), depth=2 + 4 * cfg.decoder_layers)


CONFIGS = {
    "greedy": ImageGenerationConfig(),
    "sampling": ImageGenerationConfig(do_sample=True, temperature=0.8, top_k=20, top_p=0.9, seed=3),
    "sampling+cfg3": ImageGenerationConfig(do_sample=True, top_k=16, guidance_scale=3.0, seed=5),
    "greedy+cfg0.5": ImageGenerationConfig(guidance_scale=0.5),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_cached_decoding_gives_the_full_recompute_codes_and_logits(model, name):
    cfg = CONFIGS[name]
    texts = _texts(model)
    steps = GRID * GRID
    cached, cached_logits = model._generate_image_codes(texts, cfg, steps, NUM_CODES, use_cache=True,
                                                        keep_logits=True)
    full, full_logits = model._generate_image_codes(texts, cfg, steps, NUM_CODES, use_cache=False,
                                                    keep_logits=True)
    assert cached.shape == (len(texts), steps) and cached.min() >= 0 and cached.max() < NUM_CODES
    assert torch.equal(cached, full)
    rows = len(texts) * (2 if cfg.guidance_scale != 1.0 else 1)
    assert len(cached_logits) == len(full_logits) == steps
    for step, (a, b) in enumerate(zip(cached_logits, full_logits)):
        assert a.shape == b.shape == (rows, NUM_CODES)
        diff = float((a - b).abs().max())
        assert diff <= logit_tol(model, b), f"step {step}: cached logits differ by {diff:.3g}"
    if cfg.do_sample:  # (greedy decoding of a random model settles on one or two codes)
        assert len(cached.unique()) > NUM_CODES // 4


def test_the_logit_tolerance_would_catch_a_decoder_that_forgets_positions_or_history(model):
    """A decode that loses the cache (each new code seen at position 0 with no history) moves the
    logits by far more than the tolerance the cached path must stay within."""
    texts = _texts(model)
    codes, full_logits = model._generate_image_codes(texts, ImageGenerationConfig(), 8, NUM_CODES,
                                                     use_cache=False, keep_logits=True)
    enc = model.encode(model._source_ids(texts))
    lo = model.tokenizer.code_offset
    seqs = torch.cat([torch.full((len(texts), 1), BOS_ID), codes + lo], dim=1)
    with torch.no_grad():
        for step in range(1, 8):
            forgetful = model.decode(seqs[:, step: step + 1], enc, code_mode=True)[:, -1, lo: lo + NUM_CODES]
            diff = float((forgetful - full_logits[step]).abs().max())
            assert diff > 100 * logit_tol(model, full_logits[step])


def test_generate_image_encodes_once_and_feeds_one_code_per_decoder_call(model, monkeypatch):
    cfg = ImageGenerationConfig(do_sample=True, guidance_scale=2.0, seed=1)
    encoder_rows, decoder_lengths = [], []
    encoder_forward, decoder_forward = model.ofa.encoder.forward, model.ofa.decoder.forward
    def encoder(ids, *args, **kwargs):
        encoder_rows.append(ids.shape[0])
        return encoder_forward(ids, *args, **kwargs)

    def decoder(ids, *args, **kwargs):
        decoder_lengths.append(ids.shape[1])
        return decoder_forward(ids, *args, **kwargs)

    monkeypatch.setattr(model.ofa.encoder, "forward", encoder)
    monkeypatch.setattr(model.ofa.decoder, "forward", decoder)
    images = model.generate_image(PROMPTS, config=cfg)
    assert encoder_rows == [2 * len(PROMPTS)]  # conditional + unconditional rows, one encoder call
    assert decoder_lengths == [1] * (GRID * GRID)
    monkeypatch.undo()
    reference, _ = model._generate_image_codes(_texts(model), cfg, GRID * GRID, NUM_CODES, use_cache=False)
    expected = model.image_tokenizer.decode_to_pil(reference.view(-1, GRID, GRID))
    assert [list(im.getdata()) for im in images] == [list(im.getdata()) for im in expected]


def test_seeds_reproduce_and_differ(model):
    texts = _texts(model)

    def codes(seed):
        cfg = ImageGenerationConfig(do_sample=True, seed=seed)
        return model._generate_image_codes(texts, cfg, GRID * GRID, NUM_CODES)[0]

    assert torch.equal(codes(7), codes(7))
    assert not torch.equal(codes(7), codes(8))
    assert torch.equal(codes(None), codes(None))  # unseeded: torch's default generator seed


def test_sampling_with_top_k_1_or_top_p_0_is_greedy(model):
    texts = _texts(model)
    for guidance in (1.0, 3.0):
        greedy = model._generate_image_codes(texts, ImageGenerationConfig(guidance_scale=guidance),
                                             GRID * GRID, NUM_CODES)[0]
        for opts in (dict(top_k=1), dict(top_p=0.0), dict(temperature=0.5, top_k=1)):
            cfg = ImageGenerationConfig(do_sample=True, guidance_scale=guidance, seed=11, **opts)
            sampled = model._generate_image_codes(texts, cfg, GRID * GRID, NUM_CODES)[0]
            assert torch.equal(sampled, greedy), opts


def test_logits_processors():
    scores = torch.randn(6, NUM_CODES, generator=torch.Generator().manual_seed(0))
    ids = torch.zeros(3, 1, dtype=torch.long)
    cond, uncond = scores[:3], scores[3:]
    # the CFG mix is transformers' (MusicGen) processor for s > 1, bit for bit, and defined for any s != 1
    mixed = ClassifierFreeGuidance(3.0)(ids, scores)
    assert torch.equal(mixed, ClassifierFreeGuidanceLogitsProcessor(3.0)(ids, scores))
    assert torch.equal(ClassifierFreeGuidance(0.0)(ids, scores), uncond)
    torch.testing.assert_close(ClassifierFreeGuidance(0.5)(ids, scores), 0.5 * (cond + uncond))
    with pytest.raises(ValueError, match="unconditional"):
        ClassifierFreeGuidance(2.0)(ids, scores[:5])
    # order: guidance, temperature, top-k, top-p; greedy ignores the sampling options
    names = [type(p).__name__ for p in image_code_processors(
        ImageGenerationConfig(do_sample=True, temperature=0.7, top_k=5, top_p=0.9, guidance_scale=2.0))]
    assert names == ["ClassifierFreeGuidance", "TemperatureLogitsWarper", "TopKLogitsWarper",
                     "TopPLogitsWarper"]
    assert len(image_code_processors(ImageGenerationConfig(temperature=0.7, top_k=5, top_p=0.9))) == 0
    # top-p keeps the smallest set whose mass reaches p, including the token that crosses it
    logits = torch.tensor([[0.5, 0.3, 0.2]]).log()
    kept = image_code_processors(ImageGenerationConfig(do_sample=True, top_p=0.6))(ids[:1], logits)
    assert torch.isfinite(kept).tolist() == [[True, True, False]]
    with pytest.raises(ValueError, match="temperature"):
        image_code_processors(ImageGenerationConfig(do_sample=True, temperature=0.0))


def test_a_single_layer_model_and_a_batch_of_one_agree_too():
    """The cache is indexed per layer: one layer, and one row, are their own edge cases."""
    model = _model(decoder_layers=1)
    texts = [model._t2i_text("a red circle")]
    cfg = ImageGenerationConfig(do_sample=True, guidance_scale=1.5, seed=2)
    cached, a = model._generate_image_codes(texts, cfg, GRID * GRID, NUM_CODES, keep_logits=True)
    full, b = model._generate_image_codes(texts, cfg, GRID * GRID, NUM_CODES, use_cache=False,
                                          keep_logits=True)
    assert torch.equal(cached, full)
    assert max(float((x - y).abs().max()) for x, y in zip(a, b)) <= logit_tol(model, torch.stack(b))


def test_decoder_position_keys_kept_with_the_cache_match_the_full_pass(model):
    """The decoder keeps the self-attention position keys of cached positions beside the KV cache
    (modeling_ofa ``_self_position_keys``). Prefill + one token at a time, a cache whose kept keys
    are lost (filled elsewhere), a cropped cache, and a batch mixing code and text rows (keys not
    kept) all give the full pass's logits."""
    from transformers.cache_utils import DynamicCache, EncoderDecoderCache

    ofa = model.ofa
    texts = _texts(model)
    lo = model.tokenizer.code_offset
    codes = torch.randint(lo, lo + NUM_CODES, (len(texts), 12), generator=torch.Generator().manual_seed(0))
    seqs = torch.cat([torch.full((len(texts), 1), BOS_ID), codes], dim=1)
    enc = model.encode(model._source_ids(texts))
    with torch.no_grad():
        for code_masks in (torch.ones(3, dtype=torch.bool), torch.tensor([True, False, True])):
            full = ofa.decode(seqs, enc, code_masks)
            tol = logit_tol(model, full)
            cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
            steps = [ofa.decode(seqs[:, :5], enc, code_masks, past_key_values=cache)]
            for t in range(5, seqs.shape[1]):
                if t == 8:  # as if another caller had filled the cache
                    vars(cache.self_attention_cache).pop("_ofa_position_keys", None)
                steps.append(ofa.decode(seqs[:, t: t + 1], enc, code_masks, past_key_values=cache))
            assert float((torch.cat(steps, 1) - full).abs().max()) <= tol
            cache.crop(6 - cache.get_seq_length())  # drop positions 6.. and continue from there
            again = ofa.decode(seqs[:, 6:9], enc, code_masks, past_key_values=cache)
            assert float((again - full[:, 6:9]).abs().max()) <= tol
            kept = getattr(cache.self_attention_cache, "_ofa_position_keys", None)
            if code_masks.all():  # one set of keys for all rows, up to the last position decoded
                assert kept[0] is True and kept[1].shape == (1, ofa.config.decoder_attention_heads, 9, 16)
            else:  # rows in different modes: every step embeds and projects all positions itself
                assert kept is None


def test_best_of_candidates_keeps_the_draw_the_captioner_scores_highest(model, monkeypatch):
    """``num_candidates=N``: N draws per prompt (rows of one sampled batch), reranked by the
    model's caption NLL of the prompt. The judge here is a stand-in that prefers bright images,
    so the kept image of each prompt must be its brightest draw, and every draw must be scored
    against its own prompt."""
    from dataclasses import replace

    import numpy as np

    from unicon.models.base import Scores

    n = 3
    cfg = ImageGenerationConfig(do_sample=True, seed=11, num_candidates=n)
    draws = model.generate_image([p for p in PROMPTS for _ in range(n)], config=replace(cfg, num_candidates=1))
    brightness = [float(np.asarray(im, dtype=np.float64).mean()) for im in draws]
    assert len(set(brightness)) > len(PROMPTS), "the draws of a prompt should differ"
    judged = []

    def judge(images, prompts, candidates):
        judged.append((prompts, [c[0] for c in candidates]))
        nll = -torch.tensor([[float(np.asarray(im, dtype=np.float64).mean())] for im in images])
        return Scores(nll=nll, sum_nll=nll, mask=torch.ones_like(nll, dtype=torch.bool),
                      num_tokens=torch.ones_like(nll, dtype=torch.long))

    monkeypatch.setattr(model, "score_text", judge)
    kept = model.generate_image(PROMPTS, config=cfg)
    assert judged == [([model.caption_prompt] * n * len(PROMPTS), [p for p in PROMPTS for _ in range(n)])]
    for b, im in enumerate(kept):
        best = max(range(n), key=lambda k: brightness[b * n + k])
        assert list(im.getdata()) == list(draws[b * n + best].getdata())
    with pytest.raises(ValueError, match="do_sample"):
        model.generate_image(PROMPTS, config=ImageGenerationConfig(num_candidates=2))
