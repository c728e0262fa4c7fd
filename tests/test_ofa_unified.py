"""OFAUnifiedModel: vocabulary layout, batched scoring vs a naive re-implementation, gradients,
persistence, bad input, generation, the factory, and a pretrained ShapesWorld model."""

from __future__ import annotations

import json
import math
from typing import Sequence

import pytest
import torch
from conftest import float32_tol
from PIL import Image
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from unicon.core import ImageTokenizer
from unicon.models.base import ImageGenerationConfig, Scores
from unicon.models.ofa.tokenization import BOS_ID, EOS_ID, OFATokenizer
from unicon.models.ofa.unified import OFAUnifiedModel, OFAWrapperConfig

TEXTS = [
    "a red circle left of a blue square", "a green triangle above a red circle", "what does the image describe?",
    "which region does the text describe", "what is the complete image? caption:", "how many shapes are there",
    "yes", "no", "two", "three",
]


def naive_score_text(model, images: Sequence[Image.Image], prompts: Sequence[str],
                     candidates: Sequence[Sequence[str]]) -> torch.Tensor:
    """Reference scorer: a full ``model.ofa(...)`` forward for every (example, candidate).

    Returns the ``[B, K]`` length-normalised NLL (0.0 at padded positions), computed
    independently of ``OFAUnifiedModel``'s collation: no padding, no shared encoder.
    """
    from unicon.models.ofa.tokenization import BOS_ID

    B, K = len(candidates), max(len(c) for c in candidates)
    out = torch.zeros(B, K)
    tok = model.tokenizer
    for b in range(B):
        pixels = model.prepare_images([images[b]])
        src, _ = tok.encode_text(prompts[b], model.settings.max_source_length)
        for k, cand in enumerate(candidates[b]):
            tgt, _ = tok.encode_text(cand, model.settings.max_target_length + 1)
            tgt = tgt[1:]
            dec_in = torch.tensor([[BOS_ID] + tgt[:-1]], device=pixels.device)
            res = model.ofa(input_ids=torch.tensor([src], device=pixels.device), patch_images=pixels,
                            patch_masks=torch.ones(1, dtype=torch.bool, device=pixels.device),
                            decoder_input_ids=dec_in)
            logits = res.logits if hasattr(res, "logits") else (res[0] if isinstance(res, tuple) else res)
            logp = logits[0].float().log_softmax(-1)
            nll = -logp[torch.arange(len(tgt)), torch.tensor(tgt)].mean()
            out[b, k] = nll.item()
    return out


def _bpe(vocab_size: int = 120) -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "<pad>", "</s>", "<unk>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(TEXTS * 5, trainer)
    return tok


class CellColorTokenizer(ImageTokenizer):
    """Test image tokenizer: a 4x4 grid, code = which of R/G/B dominates the 16x16 cell (+ 0 = dark)."""

    codebook_size = 4
    grid_size = (4, 4)
    image_size = (64, 64)

    def encode(self, images):
        if not isinstance(images, torch.Tensor):
            from unicon.models.base import pil_to_tensor

            images = pil_to_tensor(images)
        cells = torch.nn.functional.avg_pool2d(images, 16)  # [B, 3, 4, 4]
        codes = cells.argmax(1) + 1
        return torch.where(cells.max(1).values < 0.2, torch.zeros_like(codes), codes)

    def decode(self, codes):
        colors = torch.tensor([[0, 0, 0], [1, 0, 0], [0, 1, 0], [0, 0, 1]], dtype=torch.float32)
        img = colors[codes].permute(0, 3, 1, 2)
        return img.repeat_interleave(16, 2).repeat_interleave(16, 3)


def _tiny_model(seed: int = 0, **settings) -> OFAUnifiedModel:
    from unicon.models.ofa.configuration_ofa import preset_config
    from unicon.models.ofa.modeling_ofa import OFAModel

    tok = OFATokenizer(_bpe(), num_codes=4, num_bins=65, max_length=64)
    config = preset_config("shapes-tiny", vocab_size=len(tok), d_model=32, encoder_layers=1, decoder_layers=1,
                           encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
                           decoder_ffn_dim=64, resnet_width=8)
    torch.manual_seed(seed)
    opts = dict(image_size=64, max_source_length=64, max_target_length=12, num_beams=2, max_new_tokens=6)
    opts.update(settings)
    return OFAUnifiedModel(OFAModel(config), tok, OFAWrapperConfig(**opts), CellColorTokenizer()).eval()


def _images(n: int = 3) -> list[Image.Image]:
    colors = [(200, 30, 30), (30, 200, 30), (30, 30, 200), (200, 200, 30)]
    out = []
    for i in range(n):
        im = Image.new("RGB", (64, 64), colors[i % 4])
        im.paste(colors[(i + 1) % 4], (16 * (i % 3), 16, 16 * (i % 3) + 16, 32))
        out.append(im)
    return out


@pytest.fixture(scope="module")
def model() -> OFAUnifiedModel:
    return _tiny_model()


def nll_tol(model: OFAUnifiedModel, values) -> float:
    """Rounding-only difference between two float32 computations of these NLLs (batched vs one
    candidate at a time: other batch shapes, paddings and summation orders): conftest.float32_tol
    over the tiny model's longest reduction (the log-softmax over its vocabulary, or a 3x3
    convolution over at most 64 channels) through at most 6 reducing layers (ResNet stem, encoder,
    decoder, output projection), at the magnitude of the NLLs compared."""
    scale = float(torch.as_tensor(values).abs().max())
    return float32_tol(max(len(model.tokenizer), 9 * 64), scale, depth=6)


CANDS = [["a red circle", "a blue square", "a green triangle above a red circle"], ["yes"],
         ["two", "three"]]


# ---- vocabulary -------------------------------------------------------------------------------------------
def test_vocabulary_layout_is_text_then_codes_then_bins():
    tok = OFATokenizer(_bpe(), num_codes=8192, num_bins=1000)
    n = tok.num_text
    assert (tok.code_offset, tok.bin_offset, len(tok)) == (n, n + 8192, n + 9192)
    # BART's 50265 entries give OFA-Sys's ids: <code_0> = 50265, <bin_0> = 58457, |V| = 59457
    assert 50265 + 8192 + 1000 == 59457
    assert tok.codes_to_ids(torch.tensor([0, 8191])).tolist() == [n, n + 8191]
    assert tok.ids_to_codes(torch.tensor([n + 5])).tolist() == [5]
    with pytest.raises(ValueError, match="image codes"):
        tok.codes_to_ids(torch.tensor([8192]))


def test_box_quantisation_matches_ofa_rule():
    tok = OFATokenizer(_bpe(), num_codes=4, num_bins=1000)
    # corners (x0, y0, x1, y1) / side * 999, rounded: 10/640*999 = 15.6 -> 16, 20/480*999 = 41.6 -> 42 ...
    bins = tok.box_to_bins([10, 20, 100, 50], 640, 480)
    assert bins == [round(10 / 640 * 999), round(20 / 480 * 999), round(110 / 640 * 999), round(70 / 480 * 999)]
    back = tok.bins_to_box(bins, 640, 480)
    assert all(abs(a - b) <= 640 / 999 for a, b in zip(back, [10, 20, 100, 50]))
    assert tok.ids_to_box(tok.box_to_ids([0, 0, 64, 64], 64, 64), 64, 64) == [0.0, 0.0, 64.0, 64.0]
    with pytest.raises(ValueError, match="negative"):
        tok.box_to_bins([0, 0, -1, 5], 64, 64)


def test_text_round_trip_and_special_ids():
    tok = OFATokenizer(_bpe(), num_codes=4, num_bins=65)
    ids, cut = tok.encode_text(" a red circle left of a blue square")
    assert ids[0] == BOS_ID and ids[-1] == EOS_ID and not cut
    assert tok.decode(ids) == "a red circle left of a blue square"
    short, cut = tok.encode_text(" a red circle left of a blue square", max_length=5)
    assert len(short) == 5 and short[-1] == EOS_ID and cut


def test_tokenizer_save_load(tmp_path):
    tok = OFATokenizer(_bpe(), num_codes=4, num_bins=65, max_length=40)
    tok.save_pretrained(tmp_path)
    again = OFATokenizer.from_pretrained(tmp_path)
    assert (again.num_codes, again.num_bins, again.max_length, len(again)) == (4, 65, 40, len(tok))
    assert again.encode_text(" two shapes")[0] == tok.encode_text(" two shapes")[0]


# ---- scoring -----------------------------------------------------------------------------------------------
def test_score_text_runs_the_shared_prefix_once_per_image(model, monkeypatch):
    """Candidate scoring decodes bos once per image (cross-attention keys/values cached), then all
    candidates in one cached pass; the sums equal the uncached pass over repeated encoder rows."""
    images = _images()
    prompts = [model.caption_prompt] * 3
    cands = [*CANDS[:2], ["", "three"]]  # "" is eos only: a row with no token after bos
    calls = []
    decode = model.decode

    def spy(ids, enc, code_mode=False, past_key_values=None):
        calls.append((tuple(ids.shape), past_key_values is not None))
        return decode(ids, enc, code_mode=code_mode, past_key_values=past_key_values)

    monkeypatch.setattr(model, "decode", spy)
    with torch.no_grad():
        s = model.score_text(images, prompts, cands)
        assert [c[0][0] for c in calls] == [3, 6] and calls[0][0][1] == 1 and all(c[1] for c in calls)
        enc = model.encode(model._source_ids(prompts), model.prepare_images(images))
        targets, _ = model._text_targets(cands)
        index = torch.tensor([0, 0, 0, 1, 2, 2])
        full, lengths = model._target_nll(model.select(enc, index), targets)
    assert s.num_tokens[s.mask].tolist() == lengths.tolist()
    assert torch.allclose(s.sum_nll[s.mask], full, atol=nll_tol(model, full) * int(lengths.max()), rtol=0)


def test_score_text_matches_naive_per_candidate_forwards(model):
    images = _images()
    prompts = [model.caption_prompt] * 3
    with torch.no_grad():
        s = model.score_text(images, prompts, CANDS)
        naive = naive_score_text(model, images, prompts, CANDS)
    assert s.nll.shape == (3, 3) and s.mask.tolist() == [[True] * 3, [True, False, False], [True, True, False]]
    assert torch.allclose(s.nll, naive, atol=nll_tol(model, naive), rtol=0)
    assert torch.all(s.nll[~s.mask] == 0) and torch.all(s.sum_nll[~s.mask] == 0)
    # sum = mean * length, and the length is bpe + eos
    assert torch.allclose(s.sum_nll, s.nll * s.num_tokens, atol=nll_tol(model, s.sum_nll))
    assert s.num_tokens[1, 0] == len(model.tokenizer.text.encode("yes").ids) + 1


def _independent_target_nll(model, src_ids, pixels, target, code_mode=False):
    """One (input, target) pair through the network's full forward."""
    dec_in = torch.tensor([[BOS_ID] + target[:-1]])
    kw = {}
    if pixels is not None:
        kw = dict(patch_images=pixels, patch_masks=torch.ones(1, dtype=torch.bool))
    if code_mode:
        kw["code_masks"] = torch.ones(1, dtype=torch.bool)
    res = model.ofa(input_ids=torch.tensor([src_ids]), decoder_input_ids=dec_in, **kw)
    logits = res.logits if hasattr(res, "logits") else res
    logits = logits[0]
    tgt = torch.tensor(target)
    if code_mode:
        lo = model.tokenizer.code_offset
        logits, tgt = logits[:, lo: lo + model.tokenizer.num_codes], tgt - lo
    return -logits.log_softmax(-1)[torch.arange(len(target)), tgt].mean()


def test_score_boxes_and_score_image_match_independent_forwards(model):
    images = _images(2)
    exprs = [["the red square", "the blue square"], ["a green triangle"]]
    boxes = [[16, 16, 16, 16], [0, 16, 32, 16]]
    with torch.no_grad():
        sb = model.score_boxes(images, exprs, boxes)
        prompts = [["a red circle", "a blue square", "two"], ["a green triangle above a red circle"]]
        si = model.score_image(prompts, images)
        tok = model.tokenizer
        pixels = model.prepare_images(images)
        for b in range(2):
            target = tok.box_to_ids(boxes[b], 64, 64) + [EOS_ID]
            for k, e in enumerate(exprs[b]):
                src = tok.encode_text(model.settings.grounding_prompt.format(e))[0]
                ref = _independent_target_nll(model, src, pixels[b: b + 1], target)
                assert abs(sb.nll[b, k].item() - ref.item()) < nll_tol(model, ref)
            codes = CellColorTokenizer().encode([images[b]]).flatten().tolist()
            for k, p in enumerate(prompts[b]):
                src = tok.encode_text(model.settings.t2i_prompt.format(p))[0]
                ref = _independent_target_nll(model, src, None, [c + tok.code_offset for c in codes], code_mode=True)
                assert abs(si.nll[b, k].item() - ref.item()) < nll_tol(model, ref)
    assert sb.num_tokens[0, 0] == 5 and si.num_tokens[0, 0] == 16
    assert sb.mask.tolist() == [[True, True], [True, False]]


def test_text_only_scoring_matches_independent_forwards(model):
    """score_text(None, ...) reads the prompt alone (no image patches), as reason() does."""
    prompts = ["two shapes", "what is the complete image?"]
    cands = [["two", "yes"], ["three"]]
    tok = model.tokenizer
    with torch.no_grad():
        s = model.score_text(None, prompts, cands)
        for b, prompt in enumerate(prompts):
            src = tok.encode_text(" " + prompt)[0]
            for k, cand in enumerate(cands[b]):
                ref = _independent_target_nll(model, src, None, tok.encode_text(cand)[0][1:])
                assert abs(s.nll[b, k].item() - ref.item()) < nll_tol(model, ref)
    assert s.mask.tolist() == [[True, True], [True, False]]
    with pytest.raises(ValueError, match="got 1 images, 2 prompts"):
        model.score_text(_images(1), prompts, cands)


def test_training_on_text_only_scores_teaches_reason_to_write_the_trace():
    """Minimising score_text(None, prompt, [trace]) makes reason(prompt) emit that trace: training and
    generation share one prompt format. Two prompts with different traces rule out a prompt-blind fit."""
    model = _tiny_model(seed=2, max_target_length=24).train()
    prompts, traces = ["two shapes", "a green triangle above"], ["a blue square", "two three"]
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(150):
        loss = model.score_text(None, prompts, [[t] for t in traces]).nll.mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if loss.item() < 0.02:
            break
    model.eval()
    out = model.reason(prompts, max_new_tokens=20)
    assert [g.text.strip() for g in out] == traces and not any(g.truncated for g in out)


def test_encoder_runs_once_per_example_in_score_text(model, monkeypatch):
    calls = []
    real = model.ofa.encode

    def counting(*args, **kwargs):
        calls.append(kwargs["input_ids"].shape[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(model.ofa, "encode", counting)
    with torch.no_grad():
        model.score_text(_images(), [model.caption_prompt] * 3, CANDS)
    assert calls == [3]  # one call, one row per example, shared by its 6 candidates


def test_gradients_flow_from_every_scorer():
    model = _tiny_model(seed=1).train()
    images = _images(2)
    loss = (model.score_text(images, [" what?"] * 2, [["yes", "no"], ["two"]]).nll.sum()
            + model.score_boxes(images, [["the red square"], ["a", "b"]], [[0, 0, 16, 16], [8, 8, 8, 8]]).nll.sum()
            + model.score_image([["a red circle"], ["two", "yes"]], images).nll.sum())
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values() if g is not None)
    embed = [g for n, g in grads.items() if "embed_tokens" in n and g is not None]
    assert embed and embed[0].abs().sum() > 0
    stem = [g for n, g in grads.items() if "embed_images" in n and g is not None]
    assert stem and any(g.abs().sum() > 0 for g in stem)


def test_save_pretrained_round_trip_reproduces_scores(tmp_path, model):
    from unicon.models.ofa.unified import WRAPPER_CONFIG_NAME

    model.save_pretrained(str(tmp_path))
    assert (tmp_path / WRAPPER_CONFIG_NAME).is_file()
    # the test image tokenizer is not serialisable: attach it again
    again = OFAUnifiedModel.from_pretrained(str(tmp_path)).eval()
    again.image_tokenizer = model.image_tokenizer
    assert again.settings == model.settings
    with torch.no_grad():
        a = model.score_text(_images(), [model.caption_prompt] * 3, CANDS)
        b = again.score_text(_images(), [model.caption_prompt] * 3, CANDS)
        c = model.score_image([["two"]], _images(1)).nll
        d = again.score_image([["two"]], _images(1)).nll
    assert torch.equal(a.nll, b.nll) and torch.equal(c, d)


# ---- bad input ---------------------------------------------------------------------------------------------
def test_truncated_candidates_are_counted(model, caplog):
    long = " ".join(["a red circle left of a blue square"] * 4)
    with torch.no_grad():
        s = model.score_text(_images(2), [" q"] * 2, [[long, "yes"], [long]])
    assert s.num_truncated == 2
    assert s.num_tokens[0, 0] == model.settings.max_target_length
    assert "truncated" in caplog.text


def test_empty_candidate_list_names_the_example(model):
    with pytest.raises(ValueError, match="example 1 has an empty list"):
        model.score_text(_images(2), [" q"] * 2, [["yes"], []])
    with pytest.raises(ValueError, match="example 0 has an empty list of expressions"):
        model.score_boxes(_images(1), [[]], [[0, 0, 1, 1]])


def test_image_modes_are_converted_and_non_images_refused(model):
    rgb = _images(1)[0]
    variants = [rgb.convert("L").convert("RGB"), rgb.convert("L"), rgb.convert("RGBA"), rgb.convert("P")]
    x = model.prepare_images(variants)
    assert x.shape == (4, 3, 64, 64)
    assert torch.equal(x[0], x[1])  # L -> RGB equals the converted image
    assert x.min() >= -1 and x.max() <= 1
    big = model.prepare_images([rgb.resize((128, 96))])
    assert big.shape == (1, 3, 64, 64)
    with pytest.raises(ValueError, match="image 1 is a str"):
        model.prepare_images([rgb, "cat.png"])
    with pytest.raises(ValueError, match=r"\[B, 3, 64, 64\]"):
        model.prepare_images(torch.zeros(1, 3, 32, 32))


# ---- generation ---------------------------------------------------------------------------------------------
def test_generation_outputs_are_well_formed(model):
    images = _images(2)
    caps = model.caption(images)
    assert len(caps) == 2 and all(isinstance(c, str) for c in caps)
    boxes = model.locate([images[0], images[1].resize((128, 64))], ["a", "b"])
    assert boxes.shape == (2, 4) and (boxes >= 0).all()
    assert (boxes[1, 0] + boxes[1, 2]) <= 128 + 1e-4 and (boxes[1, 1] + boxes[1, 3]) <= 64 + 1e-4
    out = model.reason(["two shapes"], max_new_tokens=3)
    assert out[0].num_tokens <= 3
    greedy = model.generate_image(["a red circle"])
    assert greedy[0].size == (64, 64)
    cfg = ImageGenerationConfig(do_sample=True, top_k=2, seed=3, guidance_scale=2.0)
    a, b = model.generate_image(["a red circle"], config=cfg), model.generate_image(["a red circle"], config=cfg)
    assert list(a[0].getdata()) == list(b[0].getdata())  # seeded sampling is reproducible


def test_greedy_image_generation_takes_the_argmax_code(model):
    """The first generated code equals the argmax of the code-restricted logits at step 0."""
    tok = model.tokenizer
    with torch.no_grad():
        img = model.generate_image(["a red circle"])[0]
        src = torch.tensor([tok.encode_text(model.settings.t2i_prompt.format("a red circle"))[0]])
        logits = model.ofa(input_ids=src, decoder_input_ids=torch.tensor([[BOS_ID]]),
                           code_masks=torch.ones(1, dtype=torch.bool))
        logits = logits.logits if hasattr(logits, "logits") else logits
    first = logits[0, -1, tok.code_offset: tok.code_offset + 4].argmax().item()
    assert CellColorTokenizer().encode([img])[0, 0, 0].item() == first


def test_constrained_greedy_generation_is_the_step_by_step_argmax(model):
    """transformers' generate with 1 beam = argmax over the allowed (text + eos) tokens at each step."""
    images = _images(1)
    with torch.no_grad():
        text, raw = model._generate_text(images, [model.caption_prompt], num_beams=1, max_new_tokens=3,
                                         no_repeat_ngram_size=0)
        enc = model.encode(model._source_ids([model.caption_prompt]), model.prepare_images(images))
        seq = [BOS_ID]
        mask = model._token_mask("text")
        mask[EOS_ID] = True
        for step in range(3):
            logits = model.decode(torch.tensor([seq]), enc)[0, -1]
            logits = logits.masked_fill(~mask, -math.inf)
            if step == 0:
                logits[EOS_ID] = -math.inf  # min_new_tokens=1
            nxt = logits.argmax().item()
            if nxt == EOS_ID:
                break
            seq.append(nxt)
    ids, ran_out = raw[0]
    assert ids == seq[1:]
    assert ran_out == (len(seq) == 4)
    assert text[0] == model.tokenizer.decode(seq[1:])


def test_locate_emits_exactly_four_bins(model):
    tok = model.tokenizer
    with torch.no_grad():
        ids, _ = model._generate(_images(2), [model.settings.grounding_prompt.format("x")] * 2, "bins",
                                 min_new_tokens=4, max_new_tokens=4, no_repeat_ngram_size=0)
    assert all(len(r) == 4 and all(tok.bin_offset <= t < tok.bin_offset + tok.num_bins for t in r) for r in ids)


def test_scores_type_and_wrapper_config_errors():
    with pytest.raises(ValueError, match="unknown OFA wrapper setting"):
        OFAWrapperConfig.from_dict({"num_beam": 3})
    assert isinstance(Scores(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1, dtype=torch.bool),
                             torch.ones(1, 1, dtype=torch.long)), Scores)


# ---- the factory, load_model and the ShapesWorld evaluator --------------------------------------------------
REPO = __import__("pathlib").Path(__file__).resolve().parents[1]
TINY_ARCH = dict(d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                 decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, resnet_width=8,
                 num_bins=65, num_beams=2, max_new_tokens=8)


@pytest.fixture(scope="module")
def tiny_world(tmp_path_factory):
    import data_builders.shapes

    out = tmp_path_factory.mktemp("ofa_world") / "shapes"
    data_builders.shapes.main(["--out", str(out), "--num-train", "20", "--num-val", "4", "--num-test", "12",
                  "--num-reason-train", "0", "--num-ureason", "2", "--geneval-per-tag", "2",
                  "--num-drift-seeds", "2", "--quiet"])
    return out


def _world_model(world, seed=0):
    from unicon.models import build_model

    torch.manual_seed(seed)
    return build_model({"backend": "ofa", "preset": "shapes-tiny", "arch": dict(TINY_ARCH)}, world_root=world).eval()


def _world_batch(world, n=3):
    rows = [json.loads(line) for line in (world / "mixture_test.jsonl").read_text().splitlines()]
    caps = [r for r in rows if r["task"] == "caption"][:n]
    return [Image.open(world / r["image"]).convert("RGB") for r in caps], [[r["target"], "a red circle"] for r in caps]


def test_build_model_sizes_the_vocabulary_from_the_world(tiny_world):
    from tokenizers import Tokenizer as HFTokenizer

    from unicon.worlds.shapes import load_world

    model = _world_model(tiny_world)
    n_text = HFTokenizer.from_file(str(tiny_world / "tokenizer.json")).get_vocab_size()
    codes = load_world(tiny_world).config.codebook_size
    assert model.tokenizer.num_text == n_text and model.tokenizer.num_codes == codes == 49
    assert model.ofa.config.vocab_size == n_text + codes + 65
    assert model.image_tokenizer.grid_size == (4, 4) and model.settings.image_size == 64
    images, cands = _world_batch(tiny_world)
    with torch.no_grad():
        s = model.score_image([[c[0]] for c in cands], images)  # the world's own image codes
    assert s.num_tokens[:, 0].tolist() == [16] * len(images)


def test_build_model_refuses_bad_configs(tiny_world):
    from unicon.errors import UserError
    from unicon.models import build_model

    with pytest.raises(UserError, match="preset 'nope' is unknown"):
        build_model({"backend": "ofa", "preset": "nope"}, world_root=tiny_world)
    with pytest.raises(UserError, match="backend 'cnn' is unknown"):
        build_model({"backend": "cnn"})
    with pytest.raises(UserError, match="needs a world"):
        build_model({"backend": "ofa", "preset": "shapes-tiny"})
    with pytest.raises(UserError, match="code grid"):  # 5x5 codes for the world's 4x4 cells
        build_model({"backend": "ofa", "preset": "shapes-tiny", "arch": {**TINY_ARCH, "code_image_size": 40}},
                     world_root=tiny_world)
    with pytest.raises(UserError, match="model.arch: .*8-code side, wider than the 5x5 position window"):
        build_model({"backend": "ofa", "preset": "shapes-tiny", "arch": {**TINY_ARCH, "code_image_size": 64}},
                     world_root=tiny_world)


def test_load_model_accepts_save_pretrained_dirs_and_lightning_ckpts(tiny_world, tmp_path):
    from unicon.config import RunConfig
    from unicon.errors import UserError
    from unicon.models import load_model
    from omegaconf import OmegaConf

    model = _world_model(tiny_world, seed=3)
    images, cands = _world_batch(tiny_world)
    prompts = [model.caption_prompt] * len(images)
    with torch.no_grad():
        ref = model.score_text(images, prompts, cands).nll
    model.save_pretrained(str(tmp_path / "export"))
    cfg = OmegaConf.to_container(OmegaConf.merge(OmegaConf.structured(RunConfig), {
        "model": {"backend": "ofa", "preset": "shapes-tiny", "arch": dict(TINY_ARCH)},
        "data": {"root": str(tiny_world)}}))
    ckpt = {"unicon_config": cfg, "state_dict": {f"model.{k}": v for k, v in model.state_dict().items()}}
    torch.save(ckpt, tmp_path / "last.ckpt")
    for path in (tmp_path / "export", tmp_path / "last.ckpt"):
        again = load_model(path)
        assert not again.training
        with torch.no_grad():
            assert torch.equal(again.score_text(images, prompts, cands).nll, ref), path
    with pytest.raises(UserError, match="does not exist"):
        load_model(tmp_path / "missing")
    with pytest.raises(UserError, match="not a unicon model directory"):
        load_model(tmp_path)
    # unicon train stores the world's vocabulary files: the .ckpt then loads without the world
    moved = {**ckpt, "unicon_world_files": OFAUnifiedModel.world_vocabulary(tiny_world),
             "unicon_config": {**cfg, "data": {**cfg["data"], "root": str(tmp_path / "world-was-deleted")}}}
    assert set(moved["unicon_world_files"]) == {"tokenizer.json", "world.json"}
    torch.save(moved, tmp_path / "moved.ckpt")
    with torch.no_grad():
        assert torch.equal(load_model(tmp_path / "moved.ckpt").score_text(images, prompts, cands).nll, ref)
    torch.save({**moved, "unicon_world_files": {"../evil.json": "{}"}}, tmp_path / "evil.ckpt")
    with pytest.raises(UserError, match="unexpected stored world files"):
        load_model(tmp_path / "evil.ckpt")
    ckpt["state_dict"] = {k: v for k, v in ckpt["state_dict"].items() if "layer_norm" not in k}
    torch.save(ckpt, tmp_path / "broken.ckpt")
    with pytest.raises(UserError, match="first missing"):
        load_model(tmp_path / "broken.ckpt")


class _Oracle(torch.nn.Module):
    """Answers from the parsed image with the world's own functions (or wrongly, when ``wrong``)."""

    def __init__(self, world, wrong=False):
        super().__init__()
        from unicon.worlds.shapes import load_world

        self.world, self.cfg, self.wrong = world, load_world(world).config, wrong
        rows = [json.loads(line) for line in (world / "mixture_test.jsonl").read_text().splitlines()]
        self.t2i = {r["text"]: r["image"] for r in rows if r["task"] == "t2i"}

    def _scene(self, im):
        from unicon.worlds.shapes import parse

        return parse(im, self.cfg)

    def answer(self, images, questions):
        from unicon.worlds.shapes_text import answer_question

        return ["zebra" if self.wrong else answer_question(q, self._scene(im), self.cfg).upper() + "."
                for im, q in zip(images, questions)]

    def caption(self, images):
        from unicon.worlds.shapes_text import describe_scene

        return ["a zebra" if self.wrong else describe_scene(self._scene(im)) for im in images]

    def locate(self, images, expressions):
        from unicon.worlds.shapes import parse_cells, object_box
        from unicon.worlds.shapes_text import resolve_expression

        out = []
        for im, e in zip(images, expressions):
            cells = dict(parse_cells(im, self.cfg))
            obj = resolve_expression(e, self._scene(im), self.cfg)
            box = object_box(obj, self.cfg, cells[obj])
            out.append([box[0] + 30, box[1], box[2], box[3]] if self.wrong else box)
        return torch.tensor(out, dtype=torch.float32)

    image_generation_config = ImageGenerationConfig(do_sample=True, temperature=0.7)

    def generate_image(self, prompts, context=None, config=None):
        self.last_image_config = config
        if self.wrong:
            return [Image.new("RGB", (64, 64), (255, 0, 255)) for _ in prompts]
        return [Image.open(self.world / self.t2i[p]).convert("RGB") for p in prompts]


def test_shapes_task_accuracies_scores_an_oracle_1_and_a_wrong_model_0(tiny_world):
    from unicon.evaluation.shapes.runner import shapes_task_accuracies

    good = shapes_task_accuracies(_Oracle(tiny_world), tiny_world, "test", limit=8)
    bad = shapes_task_accuracies(_Oracle(tiny_world, wrong=True), tiny_world, "test", limit=8)
    for key in ("vqa_accuracy", "caption_match", "loc_iou50", "t2i_match"):
        assert good[key] == 1.0 and bad[key] == 0.0, key
        assert 1 <= good[f"{key}_n"] <= 8
    assert good["loc_miou"] > 0.99
    # the slices (question type, object count, relation clause, held-out composition) partition each
    # task's examples
    qtypes = ("color", "shape", "count", "exist", "relation")
    for key in ("vqa_accuracy", "caption_match", "loc_iou50", "t2i_match"):
        sliced = {k.split("/")[1]: v for k, v in good.items() if k.startswith(key + "/") and not k.endswith("_n")}
        assert sliced and all(v == 1.0 for v in sliced.values()), (key, sliced)
        assert all(bad[f"{key}/{name}"] == 0.0 for name in sliced), key
        held = good.get(f"{key}/held_out_n", 0) + good.get(f"{key}/no_held_out_n", 0)
        assert held == good[f"{key}_n"], key
        if key in ("caption_match", "t2i_match"):
            counts = sum(good[f"{key}/{n}_n"] for n in sliced if n.startswith("objects_"))
            assert counts == good[f"{key}_n"], key
    with_relation = good.get("t2i_match/relation_n", 0) + good.get("t2i_match/no_relation_n", 0)
    assert with_relation == good["t2i_match_n"]
    assert sum(good.get(f"vqa_accuracy/{q}_n", 0) for q in qtypes) == good["vqa_accuracy_n"]
    # each slice's count, recomputed from the split's rows (question type, objects, relation words,
    # the world's held-out compositions)
    rows = [json.loads(line) for line in (tiny_world / "mixture_test.jsonl").read_text().splitlines()]
    first = {t: [r for r in rows if r["task"] == t][:8] for t in ("vqa", "caption", "grounding", "t2i")}
    expected = {f"vqa_accuracy/{q}_n": sum(r["qtype"] == q for r in first["vqa"]) for q in {r["qtype"] for r in first["vqa"]}}
    held_out = {tuple(k) for k in json.loads((tiny_world / "world.json").read_text())["held_out"]}
    assert held_out, "the tiny world holds compositions out (data_builders.shapes --held-out)"
    for task, key in (("vqa", "vqa_accuracy"), ("caption", "caption_match"), ("grounding", "loc_iou50"),
                      ("t2i", "t2i_match")):
        n_held = sum(any((o["color"], o["shape"]) in held_out for o in r["scene"]["objects"]) for r in first[task])
        expected[f"{key}/held_out_n"], expected[f"{key}/no_held_out_n"] = n_held, len(first[task]) - n_held
    for task, key in (("caption", "caption_match"), ("t2i", "t2i_match")):
        for k in {len(r["scene"]["objects"]) for r in first[task]}:
            expected[f"{key}/objects_{k}_n"] = sum(len(r["scene"]["objects"]) == k for r in first[task])
    forms = {"objects": "all", "objects_coloured": "colour", "shapes": "shape", "shapes_coloured": "kind"}
    for r in first["vqa"]:
        if r["qtype"] == "count":  # "how many [colour] objects|<shapes> are there?"
            words = r["text"].split()
            form = forms[("objects" if words[-3] == "objects" else "shapes") + ("_coloured" if len(words) == 6 else "")]
            expected[f"vqa_accuracy/count_{form}_n"] = expected.get(f"vqa_accuracy/count_{form}_n", 0) + 1
    assert any(k.startswith("vqa_accuracy/count_") for k in expected), "the tiny world's first questions hold a count"
    related = sum(any(w in r["text"] for w in (" left of ", " right of ", " above ", " below ")) for r in first["t2i"])
    expected["t2i_match/relation_n"], expected["t2i_match/no_relation_n"] = related, len(first["t2i"]) - related
    assert {k: good.get(k, 0) for k in expected} == expected
    # the misses' causes: none for the oracle; the wrong model's captions are not English and its
    # magenta images not the world's
    for out in (good, bad):
        for task, key in (("caption", "caption_match"), ("t2i", "t2i_match")):
            causes = {k: v for k, v in out.items() if k.startswith(f"{task}_error/")}
            assert len(causes) == 5 and out[key] + sum(causes.values()) == pytest.approx(1.0), (task, causes)
    assert not any(v for k, v in good.items() if "_error/" in k)
    assert bad["caption_error/unparsable"] == 1.0 and bad["t2i_error/not_an_image"] == 1.0


def test_relation_questions_are_asked_flipped_and_a_model_that_ignores_the_word_keeps_its_answers(tiny_world):
    from unicon.evaluation.shapes.runner import shapes_task_accuracies
    from unicon.worlds.shapes import Scene, load_world
    from unicon.worlds.shapes_text import answer_question, flip_relation_question

    cfg = load_world(tiny_world).config
    rows = [json.loads(line) for line in (tiny_world / "mixture_test.jsonl").read_text().splitlines()]
    flippable = 0
    for r in rows:
        q = flip_relation_question(r["text"]) if r["task"] == "vqa" else None
        flippable += q is not None and answer_question(q, Scene.from_dict(r["scene"]), cfg) != r["target"]
    assert flippable >= 2, "the tiny world's test split should hold flippable relation questions"
    good = shapes_task_accuracies(_Oracle(tiny_world), tiny_world, "test", limit=None, tasks=("vqa",))
    bad = shapes_task_accuracies(_Oracle(tiny_world, wrong=True), tiny_world, "test", limit=None, tasks=("vqa",))
    for out in (good, bad):
        assert out["vqa_relation_flip/answer_kept_n"] == flippable
    assert good["vqa_relation_flip/answer_kept"] == 0.0 and good["vqa_relation_flip/both_right"] == 1.0
    assert bad["vqa_relation_flip/answer_kept"] == 1.0 and bad["vqa_relation_flip/both_right"] == 0.0


def test_a_row_outside_the_grammar_is_an_error_naming_the_file_and_row(tiny_world, tmp_path):
    from unicon.evaluation.shapes.runner import shapes_task_accuracies

    world = tmp_path / "shapes"
    world.mkdir()
    for name in ("world.json", "tokenizer.json"):
        (world / name).write_text((tiny_world / name).read_text())
    (world / "images").symlink_to(tiny_world / "images")
    rows = [json.loads(line) for line in (tiny_world / "mixture_test.jsonl").read_text().splitlines()]
    first = next(r for r in rows if r["task"] == "t2i")
    first["text"] = "a red zebra"
    (world / "mixture_test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError, match=rf"mixture_test.jsonl: the prompt of t2i row '{first['id']}' .*zebra"):
        shapes_task_accuracies(_Oracle(world), world, "test", limit=8, tasks=("t2i",))
    # a vqa row filed as a count question whose text is another kind of question
    rows = [json.loads(line) for line in (tiny_world / "mixture_test.jsonl").read_text().splitlines()]
    count = next(r for r in rows if r["task"] == "vqa" and r["qtype"] == "count")
    count["text"], count["target"] = "is there a red circle?", "no"
    (world / "mixture_test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError, match=rf"mixture_test.jsonl: vqa row '{count['id']}' has qtype count: not a "
                                         r"ShapesWorld count question: 'is there a red circle\?'"):
        shapes_task_accuracies(_Oracle(world), world, "test", limit=None, tasks=("vqa",))


class _Miscounting(_Oracle):
    """Captions one object too many; draws the empty canvas."""

    def caption(self, images):
        from unicon.worlds.shapes import Scene, ShapeObject
        from unicon.worlds.shapes_text import describe_scene

        out = []
        for im in images:
            scene = self._scene(im)
            taken = {(o.row, o.col) for o in scene.objects}
            free = next((r, c) for r in range(self.cfg.grid) for c in range(self.cfg.grid) if (r, c) not in taken)
            out.append(describe_scene(Scene(scene.objects + (ShapeObject("circle", "red", *free),))))
        return out

    def generate_image(self, prompts, context=None, config=None):
        from unicon.worlds.shapes import Scene, render

        return [render(Scene(()), self.cfg) for _ in prompts]


def test_shapes_task_accuracies_names_the_cause_of_each_miss_from_the_outputs_side(tiny_world):
    from unicon.evaluation.shapes.runner import shapes_task_accuracies

    out = shapes_task_accuracies(_Miscounting(tiny_world), tiny_world, "test", limit=8, tasks=("caption", "t2i"))
    assert out["caption_match"] == 0.0 and out["caption_error/more_objects"] == 1.0  # the caption names too many
    assert out["t2i_match"] == 0.0 and out["t2i_error/fewer_objects"] == 1.0  # the image draws too few


def test_evaluate_shapes_command_writes_json_and_picture(tiny_world, tmp_path, monkeypatch):
    import unicon.core
    import unicon.evaluation.cli_common as cli_common
    from unicon.cli import main

    oracle = _Oracle(tiny_world)
    monkeypatch.setattr(cli_common, "load_model_for", lambda args: oracle)
    monkeypatch.setattr(unicon.core, "weights_fingerprint", lambda model: "oracle")
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    out = tmp_path / "out"
    assert main(["evaluate", "shapes", "--ckpt", str(ckpt), "--world", str(tiny_world), "--out", str(out),
                 "--limit", "8", "--examples", "2", "--logger", "none", "--guidance-scale", "2",
                 "--image-seed", "3"]) == 0
    result = json.loads((out / "shapes_eval.json").read_text())
    # the sampling recipe: the model's own settings, the given flags on top, recorded
    expected = ImageGenerationConfig(do_sample=True, temperature=0.7, guidance_scale=2.0, seed=3)
    assert oracle.last_image_config == expected and result["image_generation"]["guidance_scale"] == 2.0
    assert result["image_generation"]["temperature"] == 0.7 and result["image_generation"]["seed"] == 3
    bad = tmp_path / "bad"  # refused flags: each fails with one line before writing anything
    assert main(["evaluate", "shapes", "--ckpt", str(ckpt), "--world", str(tiny_world), "--out", str(bad),
                 "--limit", "2", "--logger", "none", "--temperature", "0"]) == 2
    assert main(["evaluate", "shapes", "--ckpt", str(ckpt), "--world", str(tiny_world), "--out", str(bad),
                 "--limit", "2", "--logger", "none", "--candidates", "0"]) == 2
    assert main(["evaluate", "shapes", "--ckpt", str(ckpt), "--world", str(tiny_world), "--out", str(bad),
                 "--limit", "2", "--logger", "none", "--greedy", "--candidates", "4"]) == 2  # identical draws
    for key in ("vqa_accuracy", "caption_match", "loc_iou50", "t2i_match"):
        assert result["metrics"][key] == 1.0, key
    assert result["model_fingerprint"] == "oracle" and result["split"] == "test"
    from PIL import Image as PILImage

    with PILImage.open(out / "shapes_eval.png") as im:
        assert im.width > 400 and im.height > 400  # 4 task rows x 2 examples


def test_shapes_task_accuracies_runs_the_real_model(tiny_world):
    from unicon.evaluation.shapes.runner import shapes_task_accuracies

    acc = shapes_task_accuracies(_world_model(tiny_world), tiny_world, "test", limit=3)
    assert set(acc) >= {"vqa_accuracy", "caption_match", "loc_iou50", "t2i_match", "loc_miou"}
    assert all(0.0 <= v <= 1.0 for k, v in acc.items() if not k.endswith("_n"))


# ---- a pretrained ShapesWorld model (from `unicon train experiment=shapes_pretrain_edit`) ----------------------
@pytest.fixture(scope="session")
def pretrained(pretrained_shapes):
    """The pretraining recipe's model (conftest.pretrained_shapes: trained here unless $UNICON_PRETRAINED) + its world."""
    from unicon.models import load_model

    export, world = pretrained_shapes
    return load_model(export), world


def _gold_vs_contrast_captions(world, n: int = 128):
    """The first ``n`` CocoCon test samples of the world: images, ``[gold caption] + contrast captions``
    per image, and the chance of the gold one ranking first (``mean 1 / (1 + #contrasts)``, ~0.27)."""
    data = json.loads((world / "cococon_test.json").read_text())
    files = {im["id"]: im["file_name"] for im in data["images"]}
    anns = data["annotations"][:n]
    images = [Image.open(world / files[a["image_id"]]).convert("RGB") for a in anns]
    captions = [[a["caption"]] + [c["mutex_caption"] for c in a["contrast_sets"]] for a in anns]
    return images, captions, sum(1 / len(c) for c in captions) / len(captions)


def _gold_best(scores) -> float:
    """Share of rows whose gold candidate (column 0) has a lower NLL than every real contrast."""
    nll = scores.nll.masked_fill(~scores.mask, float("inf"))
    return (nll[:, 0] < nll[:, 1:].min(dim=1).values).float().mean().item()


@pytest.mark.slow
def test_pretrained_model_prefers_gold_over_contrast_captions(pretrained):
    model, world = pretrained
    images, cands, chance = _gold_vs_contrast_captions(world)
    with torch.no_grad():
        gold_best = _gold_best(model.score_text(images, [model.caption_prompt] * len(images), cands))
    # the short recipe run (test_competence: 450 steps of shapes_pretrain_edit): 0.54-0.62 over seeds 0-2
    # (chance 0.26)
    assert gold_best > chance + 0.08, (f"gold caption ranked first on only {gold_best:.0%} of {len(images)} "
                                      f"contrast sets (chance {chance:.0%})")


@pytest.mark.slow
def test_pretrained_model_prefers_the_gold_caption_for_generating_the_image(pretrained):
    """T2I competence by likelihood: the image's codes are more likely under its own caption than under
    the contrast captions (chance = 1 / (1 + #contrasts), about 0.26; the short recipe run, 450 steps:
    0.63-0.70 over seeds 0-2)."""
    model, world = pretrained
    images, prompts, chance = _gold_vs_contrast_captions(world)
    with torch.no_grad():
        gold_best = _gold_best(model.score_image(prompts, images))
    assert gold_best > chance + 0.08, f"gold prompt best for {gold_best:.0%} of {len(images)} images (chance {chance:.0%})"


@pytest.mark.shared
def test_reference_fixture_loads_with_a_byte_level_vocabulary_and_scores(ofa_fixture_dir):
    """The OFA-Sys fixture ships no BPE files: text is spelled in bytes, the rest of its 1000 ids are bins."""
    from unicon.models import load_model

    model = load_model(ofa_fixture_dir)
    tok = model.tokenizer
    assert (tok.num_text, tok.num_codes, tok.num_bins, len(tok)) == (260, 0, 740, 1000)
    assert model.settings.image_size == 128 and model.image_tokenizer is None
    images = [Image.new("RGB", (100, 80), (200, 30, 30)), Image.new("L", (64, 64), 100)]
    cands = [["a red image", "a cat"], ["gray"]]
    with torch.no_grad():
        s = model.score_text(images, [model.caption_prompt] * 2, cands)
        naive = naive_score_text(model, images, [model.caption_prompt] * 2, cands)
    assert torch.allclose(s.nll, naive, atol=nll_tol(model, naive), rtol=0)
    assert s.num_tokens[0, 0] == len("a red image".encode()) + 1  # one token per byte + eos
    assert model.locate(images, ["x", "y"]).shape == (2, 4)
    with pytest.raises(ValueError, match="no image tokenizer"):
        model.generate_image(["a cat"])


# ---- ShapesWorld's patch stem and default image sampling ------------------------------------------------------
def test_patch_stem_gives_one_token_per_cell_that_sees_only_its_cell():
    from unicon.models.ofa.configuration_ofa import OFAConfigError, preset_config
    from unicon.models.ofa.modeling_ofa import PatchStem, build_image_stem

    config = preset_config("shapes-tiny", resnet_width=8)
    stem = build_image_stem(config)
    assert isinstance(stem, PatchStem)
    x = torch.randn(2, 3, 64, 64)
    y = x.clone()
    y[:, :, 16:32, 32:48] = torch.randn(2, 3, 16, 16)  # change cell (row 1, col 2) only
    with torch.no_grad():
        fx, fy = stem(x), stem(y)
    assert fx.shape == (2, config.image_feature_dim, 4, 4)
    changed = (fx - fy).abs().amax(dim=(0, 1)) > 0
    assert changed.nonzero().tolist() == [[1, 2]]
    # the matrix-product form computes the two convolutions it holds (an image whose sides are not
    # multiples of 16 loses its last partial cells, as under the convolutions)
    for size in ((64, 64), (70, 50)):
        z = torch.randn(2, 3, *size)
        with torch.no_grad():
            conv = stem.conv2(torch.nn.functional.gelu(stem.conv1(z)))
            out = stem(z)
            # Higham's sum |x_i y_i| of each layer's dot products (GELU is 1-Lipschitz)
            first = torch.nn.functional.conv2d(z.abs(), stem.conv1.weight.abs(), stem.conv1.bias.abs(), stride=4)
            scale = torch.nn.functional.conv2d(first, stem.conv2.weight.abs(), stride=4).max().item()
        assert out.shape == conv.shape
        torch.testing.assert_close(out, conv, rtol=0, atol=float32_tol(16 * 8, scale=scale, depth=2))
    assert isinstance(build_image_stem(preset_config("reference-tiny")), torch.nn.Module)
    assert preset_config("ofa-large").image_stem == "resnet"  # published presets keep OFA's ResNet
    with pytest.raises(OFAConfigError, match="image_stem 'vit' is not one of"):
        preset_config("shapes-tiny", image_stem="vit")


def test_token_embedding_init_std_sets_the_shared_embedding_and_output_projection(tmp_path):
    """shapes-tiny draws its tied token embedding from N(0, 1); presets without the key keep
    N(0, init_std) (the reference init); the padding row is zero; a saved model reloads unchanged."""
    from unicon.models.ofa.configuration_ofa import OFAConfig, preset_config
    from unicon.models.ofa.modeling_ofa import OFAModel

    torch.manual_seed(0)
    model = OFAModel(preset_config("shapes-tiny", vocab_size=4000))
    weight = model.encoder.embed_tokens.weight
    assert model.decoder.output_projection.weight is weight
    rows = torch.cat([weight[:1], weight[2:]]).detach()
    # the sample std of 4000 x 128 N(0, 1) draws is within 1 +- 5 / sqrt(2 n) (5 sigma)
    assert abs(float(rows.std()) - 1.0) < 5 / (2 * rows.numel()) ** 0.5
    assert not weight[model.config.pad_token_id].any()
    assert float(model.encoder.layers[0].fc1.weight.std()) < 0.05  # the other layers keep init_std
    reference = OFAModel(preset_config("reference-tiny"))
    assert reference.config.token_embedding_init_std is None
    ref_std = float(reference.encoder.embed_tokens.weight.std())
    assert abs(ref_std - reference.config.init_std) < 0.1 * reference.config.init_std
    model.save_pretrained(tmp_path)
    reloaded = OFAModel.from_pretrained(tmp_path)
    assert torch.equal(reloaded.encoder.embed_tokens.weight, weight)
    assert OFAConfig.from_dict(model.config.to_dict()).token_embedding_init_std == 1.0


def test_saved_image_generation_settings_are_the_default_and_bad_keys_are_named(tmp_path):
    import numpy as np

    model = _tiny_model(image_generation={"do_sample": True, "temperature": 1.0})
    assert model.image_generation_config.do_sample is True
    with torch.no_grad():
        sampled = [np.asarray(im) for im in model.generate_image(["a", "b", "c", "d"])]
        explicit = [np.asarray(im) for im in model.generate_image(
            ["a", "b", "c", "d"], config=ImageGenerationConfig(do_sample=True, temperature=1.0))]
        greedy = [np.asarray(im) for im in model.generate_image(["a", "b", "c", "d"], config=ImageGenerationConfig())]
    assert all((a == b).all() for a, b in zip(sampled, explicit))  # the saved settings, same default generator
    model.save_pretrained(str(tmp_path / "m"))
    assert OFAUnifiedModel.from_pretrained(str(tmp_path / "m")).image_generation_config.do_sample is True
    assert len(greedy) == 4
    with pytest.raises(ValueError, match=r"image_generation: unknown setting\(s\) \['temprature'\]"):
        OFAWrapperConfig(image_generation={"temprature": 0.5})


def test_setting_two_input_is_prompt_then_trace_cut_from_the_left(monkeypatch):
    """UReason's Eq. 2 is M([P, R]): the prompt first; when the input is too long, R loses its
    beginning (its conclusion, the refined prompt, survives) and the cut is counted."""
    model = _tiny_model(max_source_length=128)
    assert model._t2i_text("a red star", "so draw it") == model.settings.t2i_prompt.format("a red star so draw it")
    trace = " ".join(f"w{i}" for i in range(100)) + " refined prompt: a red star"
    kept, cut = model.fit_context(["a red star", "x"], [trace, "short"])
    assert cut[0] > 0 and kept[0].endswith("refined prompt: a red star") and trace.endswith(kept[0])
    assert (kept[1], cut[1]) == ("short", 0)
    ids, over = model.tokenizer.encode_text(" " + model._t2i_text("a red star", kept[0]).lstrip(), 128)
    assert not over
    seen = []
    monkeypatch.setattr(model, "_source_ids", lambda texts: seen.extend(texts) or OFAUnifiedModel._source_ids(model, texts))
    with torch.no_grad():
        model.generate_image(["a red star"], context=[kept[0]], config=ImageGenerationConfig())
    assert seen[0].index("a red star") < seen[0].index(kept[0])
