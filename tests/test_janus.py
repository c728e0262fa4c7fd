"""Janus backend on the tiny random-weight config (configs/model/janus_tiny.yaml).

Reference values come from independent paths: transformers' own ``JanusProcessor`` +
``JanusForConditionalGeneration.forward`` for text, one unpadded forward per candidate for images,
and the logits that ``generate(generation_mode="image")`` itself computes.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from conftest import float32_tol
from omegaconf import OmegaConf
from PIL import Image

import standins

from unicon.models.base import ImageGenerationConfig
from unicon.models.janus import (
    GROUNDING_PROMPT,
    JanusUnifiedModel,
    NotAJanusCheckpoint,
    format_box,
    parse_box,
)

REPO = Path(__file__).resolve().parents[1]
def tol(value) -> float:
    """Rounding-only difference between two float32 computations of an NLL of this magnitude
    (batched vs one at a time, cached vs full, merged vs unmerged LoRA): conftest.float32_tol over
    janus_tiny's longest reduction (the VQ decoder's 3x3 convolutions over 64 channels = 576 terms;
    the LM head's vocabulary is shorter) through at most 6 reducing layers (vision encoder, aligner,
    2 language layers, norm, head)."""
    return float32_tol(576, float(torch.as_tensor(value).abs().max()), depth=6)


def _tiny_cfg(**arch_extra) -> dict:
    cfg = OmegaConf.to_container(OmegaConf.load(REPO / "configs" / "model" / "janus_tiny.yaml"))
    # larger init than the default 0.02 so that the random model's distributions are far from uniform
    cfg["arch"]["initializer_range"] = 0.3
    cfg["arch"]["text_config"]["initializer_range"] = 0.3
    cfg["arch"].update(arch_extra)
    return cfg


@pytest.fixture(scope="module")
def model() -> JanusUnifiedModel:
    torch.manual_seed(0)
    return JanusUnifiedModel.from_config(_tiny_cfg()).eval()


@pytest.fixture(scope="module")
def images() -> list[Image.Image]:
    g = torch.Generator().manual_seed(1)
    a = (torch.rand(30, 40, 3, generator=g) * 255).to(torch.uint8).numpy()
    b = (torch.rand(32, 32, 3, generator=g) * 255).to(torch.uint8).numpy()
    return [Image.fromarray(a), Image.fromarray(b).convert("L")]  # a non-RGB one on purpose


# ---- independent references -------------------------------------------------------------------
def _naive_text_nll(model: JanusUnifiedModel, image, prompt: str, answer: str) -> torch.Tensor:
    """One full forward through transformers' processor + model for a single (image, prompt, answer)."""
    proc, tok = model.processor, model.tokenizer
    chat = proc.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]}],
        add_generation_prompt=True,
        tokenize=False,
    )
    inputs = proc(text=[chat], images=[image.convert("RGB")], return_tensors="pt")
    target = tok(" " + answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    ids = torch.cat([inputs["input_ids"], torch.tensor([target])], dim=1)
    logits = model.janus(input_ids=ids, pixel_values=inputs["pixel_values"]).logits[0]
    logp = logits[-len(target) - 1 : -1].float().log_softmax(-1)
    return -logp.gather(-1, torch.tensor(target)[:, None]).sum()


def _naive_image_nll(model: JanusUnifiedModel, prompt: str, codes: torch.Tensor) -> torch.Tensor:
    """Unpadded single-prompt forward: processor(generation_mode="image") ids + generation embeddings."""
    chat = model.processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "text", "text": prompt}]}],
        add_generation_prompt=True,
        tokenize=False,
    )
    ids = model.processor(text=[chat], generation_mode="image", return_tensors="pt")["input_ids"]
    assert ids[0, -1].item() == model.boi_id
    text_embeds = model.janus.get_input_embeddings()(ids)
    code_embeds = model.janus.prepare_embeddings_for_image_generation(codes[None])
    embeds = torch.cat([text_embeds, code_embeds], dim=1)
    hidden = model.janus.model.language_model(inputs_embeds=embeds).last_hidden_state
    P, N = ids.shape[1], codes.shape[0]
    logp = model.janus.model.generation_head(hidden[0, P - 1 : P + N - 1]).float().log_softmax(-1)
    return -logp.gather(-1, codes[:, None]).sum()


# ---- scoring -----------------------------------------------------------------------------------
def test_prompt_layout_is_the_janus_pro_format(model):
    bos, boi, eoi = "<｜begin▁of▁sentence｜>", "<begin_of_image>", "<end_of_image>"
    img = "<image_placeholder>"
    assert model._chat([{"type": "image"}, {"type": "text", "text": " What is it? "}]) == (
        "<|User|>: <image_placeholder>\nWhat is it?\n\n<|Assistant|>:"
    )
    head, rest = model._image_prompt_parts("What is it?")
    decode = model.tokenizer.decode
    assert decode(head) == f"{bos}<|User|>: {boi}{img * 16}{eoi}"
    assert decode(rest) == "\nWhat is it?\n\n<|Assistant|>:"
    expected = f"{bos}<|User|>: draw a cat\n\n<|Assistant|>:{boi}"
    assert decode(model._generation_prompt_ids("draw a cat")) == expected
    assert decode(model._generation_prompt_ids("draw a cat", "so a cat")) == (  # UReason's [P, R]
        f"{bos}<|User|>: draw a cat\nso a cat\n\n<|Assistant|>:{boi}"
    )
    target, cut = model._target_ids("red")
    assert decode(target) == " red<｜end▁of▁sentence｜>" and not cut


def test_score_text_shapes_grad_and_naive(model, images):
    prompts = ["What color is it?", "Describe it."]
    cands = [["red", "a blue square", "green"], ["two circles"]]
    scores = model.score_text(images, prompts, cands)
    assert scores.nll.shape == scores.sum_nll.shape == scores.mask.shape == (2, 3)
    assert scores.mask.tolist() == [[True, True, True], [True, False, False]]
    assert scores.sum_nll[1, 1:].eq(0).all() and scores.nll[1, 1:].eq(0).all()
    tok = model.tokenizer
    lengths = [[len(tok(" " + c, add_special_tokens=False)["input_ids"]) + 1 for c in row] for row in cands]
    assert scores.num_tokens[0].tolist() == lengths[0] and scores.num_tokens[1, 0] == lengths[1][0]
    torch.testing.assert_close(scores.nll, scores.sum_nll / scores.num_tokens.clamp(min=1), atol=0, rtol=0)
    with torch.no_grad():
        for b, row in enumerate(cands):
            for k, cand in enumerate(row):
                ref = _naive_text_nll(model, images[b], prompts[b], cand)
                assert abs(scores.sum_nll[b, k].item() - ref.item()) < tol(ref), (b, k)
                assert abs(scores.nll[b, k].item() - ref.item() / lengths[b][k]) < tol(ref / lengths[b][k]), (b, k)
    # candidates differ, so the scores do too (the image and prompt are shared)
    assert len(set(scores.nll[0].tolist())) == 3

    model.zero_grad(set_to_none=True)
    scores.nll[scores.mask].sum().backward()
    named = dict(model.named_parameters())
    assert named["janus.model.language_model.layers.0.self_attn.q_proj.weight"].grad.abs().sum() > 0
    assert named["janus.model.aligner.fc1.weight"].grad.abs().sum() > 0
    frozen = [n for n, p in named.items() if n.startswith(model.default_frozen_prefixes)]
    assert frozen and all(named[n].grad is None and not named[n].requires_grad for n in frozen)
    model.zero_grad(set_to_none=True)


def test_text_only_scoring_is_the_reason_prompt_format(model):
    """score_text(None, ...) = the processor's text-only chat turn (what reason() continues) + target."""
    prompts, cands = ["Plan the picture.", "Count to three, then draw."], [["three red circles", "two"], ["one"]]
    proc, tok = model.processor, model.tokenizer
    with torch.no_grad():
        scores = model.score_text(None, prompts, cands)
        for b, row in enumerate(cands):
            chat = proc.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": prompts[b]}]}],
                                            add_generation_prompt=True, tokenize=False)
            prompt_ids = proc(text=[chat], return_tensors="pt")["input_ids"]
            assert prompt_ids[0].tolist() == model._reason_prompt_ids(prompts[b])
            for k, cand in enumerate(row):
                target = tok(" " + cand, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
                logits = model.janus(input_ids=torch.cat([prompt_ids, torch.tensor([target])], 1)).logits[0]
                ref = -logits[-len(target) - 1: -1].float().log_softmax(-1).gather(-1, torch.tensor(target)[:, None]).sum()
                assert abs(scores.sum_nll[b, k].item() - ref.item()) < tol(ref), (b, k)
    assert scores.mask.tolist() == [[True, True], [True, False]]


def test_score_text_checkpointing_path_matches_cached_path(model, images):
    """Gradient checkpointing in training mode disables the KV cache; the full-sequence path must agree."""
    m = copy.deepcopy(model)
    prompts, cands = ["Q?", "What is shown here?"], [["yes", "no"], ["a cat", "dog", "x"]]
    with torch.no_grad():
        cached = m.eval().score_text(images, prompts, cands)
        m.gradient_checkpointing_enable()
        m.train()
        assert m._lm().gradient_checkpointing and m._lm().training  # selects the no-cache path
        full = m.score_text(images, prompts, cands)
    torch.testing.assert_close(full.sum_nll, cached.sum_nll, atol=tol(full.sum_nll), rtol=0)


def test_score_boxes_format_and_naive(model, images):
    assert format_box([10, 20, 30, 40], 100, 200) == "[100, 100, 400, 300]"
    assert parse_box("box: [100, 100, 400, 300]", 100, 200) == pytest.approx([10, 20, 30, 40])
    assert parse_box("no box here", 100, 200) is None
    exprs = [["the left object", "the top right cell"], ["it"]]
    boxes = [[4, 3, 12, 9], [0, 0, 16, 16]]
    scores = model.score_boxes(images, exprs, boxes)
    assert scores.nll.shape == (2, 2) and scores.mask.tolist() == [[True, True], [True, False]]
    targets = [format_box(boxes[0], 40, 30), format_box(boxes[1], 32, 32)]
    assert targets == ["[100, 100, 400, 400]", "[0, 0, 500, 500]"]
    with torch.no_grad():
        for b, row in enumerate(exprs):
            for k, expr in enumerate(row):
                prompt = GROUNDING_PROMPT.format(expression=expr)
                ref = _naive_text_nll(model, images[b], prompt, targets[b])
                assert abs(scores.sum_nll[b, k].item() - ref.item()) < tol(ref), (b, k)
                mean_ref = ref.item() / scores.num_tokens[b, k].item()
                assert abs(scores.nll[b, k].item() - mean_ref) < tol(mean_ref), (b, k)


def test_score_image_shapes_grad_and_naive(model, images):
    prompts = [["a red square", "two blue circles on the left"], ["x"]]
    scores = model.score_image(prompts, images)
    N = model.num_image_tokens
    assert scores.nll.shape == (2, 2) and scores.num_tokens.tolist() == [[N, N], [N, 0]]
    codes = model.image_codes(images)
    assert codes.shape == (2, N) and codes.dtype == torch.long
    assert torch.equal(codes, model.image_tokenizer.encode(images).view(2, -1))
    with torch.no_grad():
        for b, row in enumerate(prompts):
            for k, p in enumerate(row):
                ref = _naive_image_nll(model, p, codes[b])
                assert abs(scores.sum_nll[b, k].item() - ref.item()) < tol(ref), (b, k)
                assert abs(scores.nll[b, k].item() - ref.item() / N) < tol(ref / N), (b, k)
    model.zero_grad(set_to_none=True)
    scores.sum_nll[scores.mask].sum().backward()
    named = dict(model.named_parameters())
    assert named["janus.model.generation_head.vision_head.weight"].grad.abs().sum() > 0
    assert named["janus.model.language_model.layers.1.mlp.up_proj.weight"].grad.abs().sum() > 0
    assert all(p.grad is None for n, p in named.items() if n.startswith("janus.model.vqmodel."))
    model.zero_grad(set_to_none=True)


class _Recorder:
    """Logits processor that records the raw generation-head logits of Janus's image loop."""

    def __init__(self):
        self.steps = []

    def __call__(self, input_ids, scores):
        self.steps.append(scores.detach().clone())
        return scores


@pytest.mark.parametrize("guidance", [1.0, 3.0])
def test_score_image_matches_generate_loop(model, guidance):
    from transformers import LogitsProcessorList

    prompts = ["a red square", "three small green triangles in a row"]
    # unicon's generate_image path (greedy) ...
    codes = model.generate_image_codes(prompts, config=ImageGenerationConfig(guidance_scale=guidance))
    scores = model.score_image_codes([[p] for p in prompts], codes)
    for b, p in enumerate(prompts):
        # ... against transformers' loop run directly, recording its conditional logits per step
        recorder = _Recorder()
        ids = torch.tensor([model._generation_prompt_ids(p)])
        extra = [] if guidance > 1 else [model_conditional_rows()]
        out = model.janus.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            generation_mode="image",
            guidance_scale=guidance,
            do_sample=False,
            logits_processor=LogitsProcessorList([recorder, *extra]),
        )
        assert torch.equal(out[0], codes[b])
        cond = torch.stack([s[0] for s in recorder.steps])  # row 0 = conditional, row 1 = unconditional copy
        ref = -cond.float().log_softmax(-1).gather(-1, out[0][:, None]).sum()
        assert abs(scores.sum_nll[b, 0].item() - ref.item()) < tol(ref)


def model_conditional_rows():
    from unicon.models.janus import _ConditionalRows

    return _ConditionalRows()


def test_vq_codes_round_trip(model, images):
    tok = model.image_tokenizer
    codes = tok.encode(images)
    assert codes.shape == (2, *tok.grid_size) and 0 <= codes.min() and codes.max() < tok.codebook_size
    decoded = tok.decode(codes)
    assert decoded.shape == (2, 3, *tok.image_size) and 0 <= decoded.min() and decoded.max() <= 1
    # decode == transformers' decode_image_tokens on the row-major flattening, un-normalised (mean=std=0.5)
    with torch.no_grad():
        ref = model.janus.decode_image_tokens(codes.view(2, -1)).permute(0, 3, 1, 2)
    torch.testing.assert_close(decoded, (ref * 0.5 + 0.5).clamp(0, 1))
    # index convention: the codebook vectors at the returned indices, laid out [B, D, h, w] the way
    # decode lays them out, quantise back to the same indices in the same order
    vq = model.janus.model.vqmodel
    latent = vq.quantize.embedding(codes).permute(0, 3, 1, 2)
    _, _, again = vq.quantize(latent)
    assert torch.equal(again.view_as(codes), codes)
    # decoded PIL images re-encode to a valid grid (pixel-level equality needs a trained VQ-VAE)
    pil = tok.decode_to_pil(codes)
    assert [im.size for im in pil] == [(32, 32)] * 2 and tok.encode(pil).shape == codes.shape


def test_generate_image_seed_and_context(model):
    cfg = ImageGenerationConfig(do_sample=True, temperature=1.0, guidance_scale=2.0, seed=7)
    a = model.generate_image(["a red square", "x"], config=cfg)
    b = model.generate_image(["a red square", "x"], config=cfg)
    assert [im.size for im in a] == [(32, 32)] * 2
    assert all(list(x.getdata()) == list(y.getdata()) for x, y in zip(a, b))
    seeded = ImageGenerationConfig(seed=1)
    c1 = model.generate_image_codes(["a red square"], context=["think: red"], config=seeded)
    c2 = model.generate_image_codes(["a red square\nthink: red"], config=seeded)
    assert torch.equal(c1, c2)  # the context follows the prompt in the user turn (UReason's [P, R])
    with pytest.raises(ValueError, match="bogus"):
        model.generate_image_codes(["x"], config=ImageGenerationConfig(extra={"bogus": 1}))


def test_text_generation_and_truncation(model, images):
    from transformers import LogitsProcessorList

    caps = model.caption(images, max_new_tokens=4)
    answers = model.answer(images, ["what?", "where is the square?"], max_new_tokens=4)
    assert len(caps) == len(answers) == 2 and all(isinstance(t, str) for t in caps + answers)
    assert model.locate(images, ["a", "b"]).shape == (2, 4)

    eos = model.eos_id
    ids = [model.tokenizer(p)["input_ids"] for p in ["think", "think harder"]]
    stopped = model._generate_text(ids, None, max_new_tokens=5, forced_eos_token_id=eos)
    assert all(not g.truncated and g.num_tokens <= 4 for g in stopped)
    running = model._generate_text(ids, None, max_new_tokens=5, suppress_tokens=[eos])
    assert all(g.truncated and g.num_tokens == 5 for g in running)
    with pytest.raises(ValueError, match="logits_processor"):
        model._generate_text(ids, None, max_new_tokens=2, logits_processor=LogitsProcessorList())
    out = model.reason(["Plan the picture."], max_new_tokens=3)
    assert out[0].num_tokens <= 3 and out[0].truncated == (out[0].num_tokens == 3)


def test_answer_images_is_the_processor_layout_with_every_image(model, images):
    """Two images before the question: the prompt ids and the greedy reply equal transformers' own
    ``JanusProcessor`` + ``generate`` over the same chat (both images' features in their placeholders);
    one image is :meth:`answer`'s prompt; the second image changes the first reply token's logits."""
    q = "Which is it?\nA. x\nB. y"
    assert model._images_question_ids(1, q) == model._image_question_ids(q)
    chat = model.processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": q}]}],
        add_generation_prompt=True, tokenize=False)
    inputs = model.processor(text=[chat], images=[im.convert("RGB") for im in images], return_tensors="pt")
    assert inputs["input_ids"][0].tolist() == model._images_question_ids(2, q)
    assert (inputs["input_ids"][0] == model.image_token_id).sum() == 2 * model.num_image_tokens
    ref = model.janus.generate(**inputs, generation_mode="text", do_sample=False, max_new_tokens=4,
                               pad_token_id=model.pad_id, eos_token_id=model.eos_id)
    want = model.tokenizer.decode(ref[0, inputs["input_ids"].shape[1]:].tolist(), skip_special_tokens=True).strip()
    other = Image.new("RGB", (32, 32), (250, 10, 10))
    got = model.answer_images([images, [images[0], other]], [q, q], max_new_tokens=4)
    assert got[0] == want
    with torch.no_grad():
        last = [model.janus(input_ids=inputs["input_ids"],
                            pixel_values=model.prepare_images([images[0], second])).logits[0, -1]
                for second in (images[1], other)]
    assert (last[0] - last[1]).abs().max() > tol(last[0])
    with pytest.raises(ValueError, match="row 0 has no image"):
        model.answer_images([[]], [q])
    with pytest.raises(ValueError, match="2 questions for 1 rows"):
        model.answer_images([images], [q, q])


# ---- LoRA ----------------------------------------------------------------------------------------
def test_lora_step_changes_only_adapters_and_merges_on_save(model, images, tmp_path):
    m = copy.deepcopy(model)
    m.add_lora({"r": 4, "alpha": 8, "dropout": 0.0})
    targets = m.default_lora_targets
    assert targets and all(".language_model." in t for t in targets)
    assert not any("vision_model" in n and "lora_" in n for n, _ in m.named_parameters())
    trainable = [n for n, p in m.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert len(trainable) == 2 * len(targets)
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    opt = torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.1)
    m.train()
    loss = m.score_text(images, ["Q?", "Q?"], [["yes", "no"], ["a"]]).nll.sum() + m.score_image(
        [["a red square"], ["b"]], images
    ).nll.sum()
    loss.backward()
    opt.step()
    changed = {n for n, p in m.named_parameters() if not torch.equal(p.detach(), before[n])}
    assert changed and all("lora_" in n for n in changed)
    assert any("lora_B" in n for n in changed)  # B starts at zero; the update makes the adapter non-trivial

    m.eval()
    with torch.no_grad():
        expected = m.score_text(images, ["Q?", "Q?"], [["yes", "no"], ["a"]]).sum_nll
    m.save_pretrained(str(tmp_path / "merged"))
    keys = json.loads((tmp_path / "merged" / "unicon_model.json").read_text())
    assert keys["backend"] == "janus"
    reloaded = JanusUnifiedModel.from_pretrained(str(tmp_path / "merged")).eval()
    assert not any("lora_" in n for n, _ in reloaded.named_parameters())
    with torch.no_grad():
        got = reloaded.score_text(images, ["Q?", "Q?"], [["yes", "no"], ["a"]]).sum_nll
    torch.testing.assert_close(got, expected, atol=tol(expected), rtol=0)


# ---- persistence and bad input ---------------------------------------------------------------------
def test_save_load_round_trip(model, images, tmp_path):
    model.save_pretrained(str(tmp_path / "tiny"))
    assert (tmp_path / "tiny" / "model.safetensors").is_file()
    again = JanusUnifiedModel.from_pretrained(str(tmp_path / "tiny")).eval()
    with torch.no_grad():
        a = model.score_image([["a red square"], ["b"]], images).sum_nll
        b = again.score_image([["a red square"], ["b"]], images).sum_nll
        c = model.score_text(images, ["q", "q"], [["x"], ["y"]]).sum_nll
        d = again.score_text(images, ["q", "q"], [["x"], ["y"]]).sum_nll
    torch.testing.assert_close(a, b, atol=0, rtol=0)
    torch.testing.assert_close(c, d, atol=0, rtol=0)


def test_not_a_janus_checkpoint(tmp_path):
    other = tmp_path / "llama"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(NotAJanusCheckpoint, match=r"llama.*model_type 'llama'.*expected"):
        JanusUnifiedModel.from_pretrained(str(other))
    original = tmp_path / "deepseek"
    original.mkdir()
    (original / "config.json").write_text(json.dumps({"model_type": "multi_modality"}))
    with pytest.raises(NotAJanusCheckpoint, match="original DeepSeek format"):
        JanusUnifiedModel.from_pretrained(str(original))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(NotAJanusCheckpoint, match=f"{empty}: no config.json"):
        JanusUnifiedModel.from_pretrained(str(empty))
    with pytest.raises(ValueError, match="backend"):
        JanusUnifiedModel.from_config({"backend": "ofa"})
    with pytest.raises(ValueError, match="num_image_tokens"):
        JanusUnifiedModel.from_config({"backend": "janus", "arch": {**_tiny_cfg()["arch"], "vision_config": {
            **_tiny_cfg()["arch"]["vision_config"], "num_image_tokens": 15}}})


def test_pickle_weights_refused_unless_opted_in(model, images, tmp_path):
    from safetensors.torch import load_file

    path = tmp_path / "pickled"
    model.save_pretrained(str(path))
    state = load_file(str(path / "model.safetensors"))
    torch.save(state, path / "pytorch_model.bin")
    (path / "model.safetensors").unlink()
    with pytest.raises(NotAJanusCheckpoint, match="allow_pickle"):
        JanusUnifiedModel.from_pretrained(str(path))
    loaded = JanusUnifiedModel.from_pretrained(str(path), allow_pickle=True).eval()
    with torch.no_grad():
        got = loaded.score_image([["q"], ["r"]], images).sum_nll
        torch.testing.assert_close(got, model.score_image([["q"], ["r"]], images).sum_nll)


def test_bad_inputs(model, images):
    with pytest.raises(ValueError, match="example 1 has an empty list"):
        model.score_text(images, ["a", "b"], [["x"], []])
    with pytest.raises(ValueError, match="image 0 is a str"):
        model.score_text(["not an image"], ["a"], [["x"]])
    with pytest.raises(ValueError, match="expected prepared images"):
        model.prepare_images(torch.zeros(1, 3, 8, 8))
    prepared = model.prepare_images(images)
    assert prepared.shape == (2, 3, 32, 32) and torch.equal(model.prepare_images(list(prepared)), prepared)
    # truncation is counted, never silent
    long = copy.copy(model)
    long.max_target_length = 3
    s = long.score_text(images[:1], ["q"], [["a long answer", "a"]])  # " a" + eos = 3 tokens
    assert s.num_truncated == 1 and s.num_tokens.tolist() == [[3, 3]]


def test_factory_config_and_load_model(images, tmp_path):
    from unicon.config import compose
    from unicon.models import build_model, load_model

    cfg = compose(["model=janus_tiny"])
    torch.manual_seed(0)
    built = build_model(cfg.model).eval()
    assert isinstance(built, JanusUnifiedModel) and built.num_image_tokens == 16
    assert 1e6 < sum(p.numel() for p in built.parameters()) < 5e6  # "a few million parameters"
    built.save_pretrained(str(tmp_path / "export"))
    loaded = load_model(str(tmp_path / "export"), world_root="ignored")
    assert isinstance(loaded, JanusUnifiedModel) and not loaded.training
    # `pretrained` in the model section goes through from_pretrained
    overrides = ["model=janus_pro_1b", f"model.pretrained={tmp_path / 'export'}", "model.dtype=float32"]
    again = build_model(compose(overrides).model)
    with torch.no_grad():
        a = built.score_text(images, ["q", "q"], [["x", "y"], ["z"]]).sum_nll
        b = loaded.score_text(images, ["q", "q"], [["x", "y"], ["z"]]).sum_nll
        c = again.eval().score_text(images, ["q", "q"], [["x", "y"], ["z"]]).sum_nll
    torch.testing.assert_close(a, b, atol=0, rtol=0)
    torch.testing.assert_close(a, c, atol=0, rtol=0)
    with pytest.raises(ValueError, match="cannot change the architecture"):
        JanusUnifiedModel.from_config({**_tiny_cfg(), "pretrained": str(tmp_path / "export")})
    # the real-checkpoint configs compose, and an absent local checkpoint fails with its path
    pro = compose(["model=janus_pro_1b"]).model
    assert pro.dtype == "bfloat16" and pro.lora.enabled and not pro.trust_remote_code and not pro.allow_pickle
    with pytest.raises(NotAJanusCheckpoint, match="models/Janus-Pro-1B: not a local directory"):
        JanusUnifiedModel.from_config({**OmegaConf.to_container(pro), "pretrained": "models/Janus-Pro-1B"})


# ---- end to end through the evaluation suites --------------------------------------------------------
def test_cococon_evaluation_end_to_end(model, tmp_path):
    import unicon.evaluation.cococon.runner as cc
    from unicon.data.cococon import load_cococon

    data = load_cococon(standins.mini_cococon(tmp_path))
    result = cc.evaluate_model(model, data.samples, batch_size=2, cider_tokenizer="simple")
    flat = result.flat()
    for task in ("vqa", "localization", "t2i"):
        assert 0.0 <= flat[f"cococon/{task}/C_1"] <= 100.0
    assert "cococon/caption/acc@1" in flat
    # the evaluator's NLLs are the backend's scores: check sample 2's caption row directly
    cc.write_outputs(result, tmp_path / "out")
    rows = [json.loads(line) for line in (tmp_path / "out" / "per_sample.jsonl").read_text().splitlines()]
    s = data.samples[2]
    with torch.no_grad():
        captions = [cc.normalize_text(s.caption)] + [cc.normalize_text(c.caption) for c in s.contrast_sets]
        direct = model.score_text([s.load_image()], [model.caption_prompt], [captions])
    assert rows[2]["nll"]["caption"] == pytest.approx(direct.nll[0].tolist(), abs=1e-5)


def test_drift_two_generations_end_to_end(model, tmp_path):
    import unicon.evaluation.drift.runner as drift
    from unicon.data.drift_seeds import DriftSeed

    seeds = []
    for i in range(2):
        p = tmp_path / f"s{i}.png"
        Image.new("RGB", (32, 32), (100 * i, 50, 200)).save(p)
        seeds.append(DriftSeed(id=f"s{i}", caption=f"a blue square number {i}", image=p))
    run = drift.run_chains(model, seeds, tmp_path / "chains", generations=2, batch_size=2,
                           image_config=ImageGenerationConfig(seed=0))
    assert (run.ids, run.generations) == (["s0", "s1"], 2)
    assert run.computed == {chain: [0, 1, 2] for chain in run.chains}  # generation 0: the seeds
    assert run.model_steps == len(run.chains) * 2 * len(seeds) and not run.repairs
    files = [p.name for p in (tmp_path / "chains").rglob("*") if p.is_file()]
    assert any(f.endswith(".png") for f in files) and any(f.endswith(".csv") for f in files)
    for png in (tmp_path / "chains").rglob("*.png"):
        with Image.open(png) as im:
            assert im.size == (32, 32)


def test_ureason_settings_end_to_end(model, tmp_path):
    import unicon.evaluation.ureason.runner as ur
    from unicon.data.ureason import UReasonInstance
    from unicon.evaluation.ureason.judges import Judge, Verdict

    class BrightJudge(Judge):
        name = "bright"

        def __init__(self):
            self.seen = []

        def judge_images(self, instances, images):
            self.seen += [im.size if im is not None else None for im in images]
            bright = [im is not None and sum(im.getpixel((0, 0))) > 384 for im in images]
            return [Verdict("yes" if b else "no") for b in bright]

    instances = [
        UReasonInstance(id=i, category="attribute", direct_prompt=f"draw {c}", prompt=f"think {c}", expect_en=c)
        for i, c in enumerate(["red", "blue"])
    ]
    judge = BrightJudge()
    metrics, samples = ur.evaluate_ureason(
        model, instances, judge, out_dir=tmp_path, max_new_tokens=8, batch_size=2,
        image_config=ImageGenerationConfig(seed=0),
    )
    assert len(samples) == 2 and judge.seen and all(s == (32, 32) for s in judge.seen)
    assert all(0.0 <= metrics[k] <= 100.0 for k in ("acc_s1", "acc_s2", "acc_s3"))
    assert all(isinstance(s.trace, str) for s in samples)


@pytest.mark.slow
def test_lora_consistency_training_through_the_training_run(tmp_path, monkeypatch):
    """Two ConsistencyModule steps with PEFT LoRA on the tiny Janus, then export + reload."""
    import sys

    sys.path.insert(0, str(REPO))
    import data_builders.shapes as builder
    import unicon.models.checkpoints
    import unicon.training.run as run
    from unicon.config import compose
    from unicon.models import load_model
    from unicon.models.checkpoints import load_for_training

    world = tmp_path / "shapes"
    builder.main(["--out", str(world), "--num-train", "6", "--num-val", "2", "--num-test", "2", "--quiet",
                  "--overwrite", "--num-ureason", "1", "--geneval-per-tag", "1", "--num-drift-seeds", "1",
                  "--num-reason-train", "0"])
    cfg = compose([
        "model=janus_tiny", "trainer=cpu", "logger=csv", "eval=none", f"data.root={world}",
        f"output_dir={tmp_path / 'runs'}", "data.batch_size=2", "data.contrast_batch_size=2",
        "data.max_contrast=2", "trainer.max_steps=2", "trainer.enable_progress_bar=false",
        "trainer.log_every_n_steps=1", "optim.lr=1e-2", "optim.warmup_ratio=0.0", "loss.gamma=1.0",
        "model.lora.enabled=true", "model.lora.r=2",
    ])
    model = load_for_training(cfg)
    assert isinstance(model, JanusUnifiedModel)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert any(".language_model." in n for n in trainable)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    monkeypatch.setattr(unicon.models.checkpoints, "load_for_training", lambda c, resumed=None: model)
    out = run.train(cfg)
    assert out["global_step"] == 2
    state = torch.load(out["ckpt_path"], weights_only=False)["state_dict"]
    for name, value in frozen.items():  # only adapters moved
        torch.testing.assert_close(state[f"model.{name}"], value, atol=0, rtol=0)
    assert any(v.abs().sum() > 0 for k, v in state.items() if "lora_B" in k and ".language_model." in k)
    exported = load_model(out["export_dir"])
    assert isinstance(exported, JanusUnifiedModel)
    assert not any("lora_" in n for n, _ in exported.named_parameters())
    images = [Image.new("RGB", (32, 32), (200, 10, 10))]
    with torch.no_grad():  # `model` was merged in place by the export
        torch.testing.assert_close(exported.score_text(images, ["q"], [["a red square", "x"]]).sum_nll,
                                   model.eval().score_text(images, ["q"], [["a red square", "x"]]).sum_nll,
                                   atol=tol(20.0), rtol=0)  # NLL sums of a few tokens: |value| < 20


def test_training_lora_hook_keeps_vision_encoder_frozen():
    """The training code's apply_lora defers to the backend: adapters only in the language model."""
    from unicon.models.lora import apply_lora

    fresh = JanusUnifiedModel.from_config(_tiny_cfg())
    wrapped = apply_lora(fresh, OmegaConf.create({"r": 2, "alpha": 4, "dropout": 0.0, "target_modules": []}))
    assert wrapped and all(n.startswith("janus.model.language_model.") for n in wrapped)
    trainable = [n for n, p in fresh.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
