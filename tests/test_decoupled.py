"""The decoupled backend (a VLM + a diffusion pipeline) on tiny random-weight components.

``configs/model/decoupled_tiny.yaml`` builds a 1-layer LLaVA and a tiny Stable Diffusion 1.x itself
(``arch.random_tiny_parts``); most tests point it at the same parts saved once to a folder
(``tests/standins.py``). References are independent paths: one uncached transformers forward
over the whole (prompt, reply) sequence for text, one (image, caption) pair per call for images.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import float32_tol
from omegaconf import OmegaConf
from PIL import Image

import standins
from unicon.models.base import ImageGenerationConfig
from unicon.models.decoupled import BOX_FORMATS, DecoupledUnifiedModel

REPO = Path(__file__).resolve().parents[1]
CAPTIONS = ["a red square on the left", "a blue circle", "two green triangles"]


def text_tol(value) -> float:
    """float32 rounding of a summed reply NLL of this magnitude, batched/cached vs one full forward:
    the longest reduction is the log-softmax over the byte vocabulary (< 270 terms), through 4
    reducing layers (vision layer, projector, language layer, head)."""
    return float32_tol(270, float(torch.as_tensor(value).abs().max()), depth=4)


def image_tol(value) -> float:
    """float32 rounding of a denoising MSE of this magnitude, batched vs one row at a time: the
    longest reduction is a GroupNorm over (32 / 8 groups) x 16 x 16 = 1,024 latent elements, through
    the tiny UNet's 12 reducing layers (4 resnets, 2 transformers, conv in/out, time embedding, ...)."""
    return float32_tol(1024, float(torch.as_tensor(value).abs().max()), depth=12)


def _config(root: Path, **arch) -> dict:
    cfg = OmegaConf.to_container(OmegaConf.load(REPO / "configs" / "model" / "decoupled_tiny.yaml"))
    cfg["arch"].update(random_tiny_parts=False, vlm_path=str(root / "vlm"), diffusion_path=str(root / "diffusion"),
                       **arch)
    return cfg


@pytest.fixture(scope="module")
def parts(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("decoupled")
    standins.llava(root / "vlm")
    standins.stable_diffusion(root / "diffusion")
    return root


@pytest.fixture(scope="module")
def model(parts) -> DecoupledUnifiedModel:
    return DecoupledUnifiedModel.from_config(_config(parts)).eval()


@pytest.fixture(scope="module")
def images() -> list[Image.Image]:
    g = torch.Generator().manual_seed(1)
    a = (torch.rand(30, 40, 3, generator=g) * 255).to(torch.uint8).numpy()
    b = (torch.rand(32, 32, 3, generator=g) * 255).to(torch.uint8).numpy()
    return [Image.fromarray(a), Image.fromarray(b).convert("L")]  # a non-RGB one on purpose


def _full_forward_nll(model: DecoupledUnifiedModel, image, question: str, reply: str) -> torch.Tensor:
    """Summed NLL of the reply's tokens from one uncached forward over the whole conversation."""
    turn = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
    answer = [{"role": "assistant", "content": [{"type": "text", "text": reply}]}]
    text = model.processor.apply_chat_template(turn + answer, tokenize=False)
    inputs = model.processor(text=[text], images=[image.convert("RGB")], return_tensors="pt")
    # the reply is what the tiny template writes after "ASSISTANT:": " " + reply + "</s>", one byte a token
    n = len(model.tokenizer(" " + reply, add_special_tokens=False)["input_ids"]) + 1
    ids = inputs["input_ids"][0]
    assert ids[-1] == model.tokenizer.eos_token_id
    logits = model.vlm(**inputs).logits[0]
    return F.cross_entropy(logits[-n - 1: -1].float(), ids[-n:], reduction="sum")


# ---- I2T ----------------------------------------------------------------------------------------
def test_reply_targets_are_the_templates_assistant_turn(model):
    ids, cut = model._target_ids("what is it?", True, "  a red square ")
    assert not cut and model.tokenizer.decode(ids) == " a red square</s>"
    long_ids, cut = model._target_ids("q", True, "x" * 40)
    assert cut and len(long_ids) == model.settings.max_target_length


def test_batched_text_scores_equal_one_full_forward_per_candidate(model, images):
    prompts = ["What is in the image?", "Describe it."]
    candidates = [CAPTIONS, ["a cat"]]
    with torch.no_grad():
        scores = model.score_text(images, prompts, candidates)
        for b, cands in enumerate(candidates):
            for k, cand in enumerate(cands):
                naive = _full_forward_nll(model, images[b], prompts[b], cand)
                assert abs(scores.sum_nll[b, k] - naive) <= text_tol(naive), (b, k)
                n = len(model._target_ids(prompts[b], True, cand)[0])
                assert scores.num_tokens[b, k] == n
                assert scores.nll[b, k] == pytest.approx(float(scores.sum_nll[b, k]) / n, rel=1e-6)
    assert scores.mask.tolist() == [[True] * 3, [True, False, False]] and scores.nll[1, 1:].eq(0).all()


def test_batched_box_scores_equal_one_full_forward_per_expression(model, images):
    expressions = [["the left square", "a circle"], ["the cat"]]
    boxes = [[4, 3, 10, 8], [0, 0, 16, 32]]
    with torch.no_grad():
        scores = model.score_boxes(images, expressions, boxes)
        for b, exprs in enumerate(expressions):
            answer = BOX_FORMATS["unit"].format(boxes[b], *images[b].size)
            for k, expr in enumerate(exprs):
                naive = _full_forward_nll(model, images[b], model.grounding_prompt.format(expression=expr), answer)
                assert abs(scores.sum_nll[b, k] - naive) <= text_tol(naive), (b, k)
    assert BOX_FORMATS["unit"].format(boxes[0], 40, 30) == "[0.10, 0.10, 0.35, 0.37]"


@pytest.mark.parametrize("name", sorted(BOX_FORMATS))
def test_box_formats_parse_back(name):
    fmt = BOX_FORMATS[name]
    text = fmt.format([8, 6, 16, 12], 40, 30)
    parsed = fmt.parse(f"The box is {text}.", 40, 30)
    resolution = 40 / (100 if name == "unit" else 1000)  # the format's rounding step, in pixels
    assert parsed == pytest.approx([8, 6, 16, 12], abs=resolution)
    assert fmt.parse("no box here", 40, 30) is None


def test_generation_entry_points_run(model, images):
    captions = model.caption(images)
    assert len(captions) == 2 and all(isinstance(c, str) for c in captions)
    assert model.locate(images, ["a", "b"]).shape == (2, 4)
    (trace,) = model.reason(["think about a red square"], max_new_tokens=4)
    assert trace.num_tokens <= 4
    with torch.no_grad():  # text-only scoring uses reason()'s prompt; a longer reply costs more
        s = model.score_text(None, ["think"], [["a", "a red square"]])
    assert s.num_tokens.tolist() == [[3, 14]] and (s.sum_nll > 0).all()


# ---- T2I ----------------------------------------------------------------------------------------
def test_batched_image_scores_equal_one_pair_at_a_time(model, images):
    prompts = [CAPTIONS, ["a cat", "a red square on the left"]]
    with torch.no_grad():
        batched = model.score_image(prompts, images)
        for b, ps in enumerate(prompts):
            for k, p in enumerate(ps):
                single = model.score_image([[p]], [images[b]])
                assert abs(batched.nll[b, k] - single.nll[0, 0]) <= image_tol(single.nll[0, 0]), (b, k)
    assert batched.num_tokens.tolist() == [[8, 8, 8], [8, 8, 0]]
    assert batched.mask.tolist() == [[True] * 3, [True, True, False]]


def test_fixed_noise_estimate_is_deterministic_and_shared_by_candidates(model, images):
    prompts = [["a red square", "a red square", "a blue circle"], ["a cat"]]
    with torch.no_grad():
        first = model.score_image(prompts, images)
        second = model.score_image(prompts, images)
        errors, rows = model.denoising_errors(prompts, images)
    assert torch.equal(first.nll, second.nll) and torch.equal(first.sum_nll, second.sum_nll)
    assert torch.equal(errors[0], errors[1])  # the same caption sees the same (t, eps) pairs
    assert rows.tolist() == [0, 0, 0, 1] and errors.shape == (4, model.settings.score_timesteps)
    assert model.score_timestep_values().tolist() == [62, 187, 312, 437, 562, 687, 812, 937]


def test_trained_diffusion_model_prefers_the_gold_caption(parts):
    """150 steps of the standard eps-prediction loss on two (image, caption) pairs (16 px, 8x8
    latents, to stay cheap): each image's own caption must then have the lower diffusion-classifier
    score."""
    model = DecoupledUnifiedModel.from_config(_config(parts, score_timesteps=16, image_size=16))
    pipe = model.pipeline
    pairs = [(Image.new("RGB", (32, 32), (230, 20, 20)), "a red square"),
             (Image.new("RGB", (32, 32), (20, 20, 230)), "a blue circle")]
    with torch.no_grad():
        x0 = model._latents(model.prepare_images([im for im, _ in pairs]))
        cond = model._text_conditioning([c for _, c in pairs])["encoder_hidden_states"]
    abar = pipe.scheduler.alphas_cumprod
    unet = pipe.unet.train()
    optimizer = torch.optim.Adam(unet.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    for _ in range(150):
        t = torch.randint(0, 1000, (8,), generator=g)
        b = torch.arange(8) % 2
        eps = torch.randn(8, *x0.shape[1:], generator=g)
        a = abar[t].view(-1, 1, 1, 1)
        x_t = a.sqrt() * x0[b] + (1 - a).sqrt() * eps
        loss = F.mse_loss(unet(x_t, t, encoder_hidden_states=cond[b]).sample, eps)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    unet.eval()
    with torch.no_grad():
        scores = model.score_image([[c for _, c in pairs], [c for _, c in reversed(pairs)]], [im for im, _ in pairs])
    assert (scores.nll[:, 0] < scores.nll[:, 1]).all(), scores.nll


def test_generate_image_honours_seed_guidance_and_context(model):
    cfg = ImageGenerationConfig(seed=3, guidance_scale=2.0)
    a = model.generate_image(["a red square"], config=cfg)[0]
    b = model.generate_image(["a red square"], config=cfg)[0]
    c = model.generate_image(["a red square"], config=ImageGenerationConfig(seed=4, guidance_scale=2.0))[0]
    assert a.size == (32, 32) and a.tobytes() == b.tobytes() and a.tobytes() != c.tobytes()
    greedy = model.generate_image(["a red square"])[0]  # do_sample=False: the fixed seed 0
    assert greedy.tobytes() == model.generate_image(["a red square"], config=ImageGenerationConfig(seed=0, guidance_scale=2.0))[0].tobytes()
    with pytest.raises(ValueError, match="top_k"):
        model.generate_image(["x"], config=ImageGenerationConfig(top_k=5))
    kept, cut = model.fit_context(["a red square"], ["word " * 40 + "end"])
    assert cut[0] > 0 and kept[0].endswith("end")
    assert len(model.pipeline.tokenizer("a red square\n" + kept[0])["input_ids"]) <= model.pipeline.tokenizer.model_max_length


def test_save_and_reload_round_trip(model, images, tmp_path):
    from unicon.models import load_model

    model.save_pretrained(str(tmp_path / "export"))
    assert json.loads((tmp_path / "export" / "unicon_model.json").read_text())["backend"] == "decoupled"
    reloaded = load_model(tmp_path / "export")
    assert isinstance(reloaded, DecoupledUnifiedModel)
    with torch.no_grad():
        assert torch.equal(reloaded.score_image([["a cat"]], images[:1]).nll, model.score_image([["a cat"]], images[:1]).nll)
        assert torch.equal(reloaded.score_text(images[:1], ["q"], [["a"]]).nll, model.score_text(images[:1], ["q"], [["a"]]).nll)


def test_the_shipped_config_builds_its_own_parts(parts, images, tiny_shapes_world, capsys):
    """``decoupled_tiny.yaml`` as shipped builds the same tiny parts as the saved fixture (same seed),
    leaves the caller's RNG alone, refuses paths beside ``random_tiny_parts``, and ``unicon bench
    scoring --model-config decoupled_tiny`` runs on it with batched = naive."""
    from unicon.errors import UserError
    from unicon.bench.scoring import cli as bench_scoring

    shipped = OmegaConf.to_container(OmegaConf.load(REPO / "configs" / "model" / "decoupled_tiny.yaml"))
    state = torch.random.get_rng_state()
    built = DecoupledUnifiedModel.from_config(shipped).eval()
    assert torch.equal(torch.random.get_rng_state(), state)
    saved = DecoupledUnifiedModel.from_config(_config(parts)).eval()
    for (name, a), b in zip(built.vlm.state_dict().items(), saved.vlm.state_dict().values()):
        assert torch.equal(a, b), name
    with torch.no_grad():
        assert torch.equal(built.score_text(images[:1], ["q"], [["a", "b"]]).nll,
                           saved.score_text(images[:1], ["q"], [["a", "b"]]).nll)
    shipped["arch"]["vlm_path"] = str(parts / "vlm")
    with pytest.raises(UserError, match="random_tiny_parts"):
        DecoupledUnifiedModel.from_config(shipped)
    assert bench_scoring(["--model-config", "decoupled_tiny", "--world", str(tiny_shapes_world),
                          "--samples", "4", "--k", "3", "--batch-size", "2"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["agree"] and result["samples"] == 4


# ---- evaluation suites ------------------------------------------------------------------------
def test_cococon_end_to_end(model, tmp_path):
    from unicon.data.cococon import load_cococon
    from unicon.evaluation.cococon.runner import evaluate_model

    data = load_cococon(standins.mini_cococon(tmp_path))
    flat = evaluate_model(model, data.samples, batch_size=2, cider_tokenizer="simple").flat()
    for task in ("vqa", "localization", "t2i"):
        assert 0.0 <= flat[f"cococon/{task}/C_1"] <= 100.0
    assert "cococon/caption/acc@1" in flat


def test_drift_chains_end_to_end(model, tmp_path):
    from unicon.data.drift_seeds import DriftSeed
    from unicon.evaluation.drift.runner import run_chains

    seeds = []
    for i in range(2):
        Image.new("RGB", (32, 32), (100 * i, 50, 200)).save(tmp_path / f"s{i}.png")
        seeds.append(DriftSeed(id=f"s{i}", caption=f"a blue square number {i}", image=tmp_path / f"s{i}.png"))
    run_chains(model, seeds, tmp_path / "chains", generations=2, batch_size=2,
               image_config=ImageGenerationConfig(seed=0, guidance_scale=2.0))
    pngs = list((tmp_path / "chains").rglob("*.png"))
    assert pngs and any(p.suffix == ".csv" for p in (tmp_path / "chains").rglob("*"))
    for png in pngs:
        with Image.open(png) as im:
            assert im.size == (32, 32)


def test_ureason_end_to_end(model, tmp_path):
    from unicon.data.ureason import UReasonInstance
    from unicon.evaluation.ureason.judges import Judge, Verdict
    from unicon.evaluation.ureason.runner import evaluate_ureason

    class AnyImageJudge(Judge):
        name = "any"

        def judge_images(self, instances, images):
            return [Verdict("yes" if im is not None else "no_input") for im in images]

    instances = [UReasonInstance(id=i, category="attribute", direct_prompt=f"draw {c}", prompt=f"think {c}",
                                 expect_en=c) for i, c in enumerate(["red", "blue"])]
    metrics, samples = evaluate_ureason(model, instances, AnyImageJudge(), out_dir=tmp_path, max_new_tokens=6,
                                        batch_size=2, image_config=ImageGenerationConfig(seed=0, guidance_scale=2.0))
    assert len(samples) == 2 and metrics["acc_s1"] == 100.0
    assert all(0.0 <= metrics[k] <= 100.0 for k in ("acc_s2", "acc_s3"))
