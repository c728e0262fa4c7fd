"""Parity of the native OFA model with the OFA-Sys reference (golden fixture), and its checkpoint I/O.

The fixture (``../shared/fixtures/ofa-reference-tiny``) holds the reference's weights and its
outputs on four cases; the model is loaded with the same ``from_pretrained`` users call.
"""

import hashlib
import json
import logging
import math
import shutil

import pytest
import torch
from conftest import float32_tol
from safetensors.torch import load_file, save_file

from unicon.models.ofa.configuration_ofa import OFA_PRESETS, OFAConfig, OFAConfigError, preset_config
from unicon.models.ofa.convert import CheckpointError
from unicon.models.ofa.modeling_ofa import (
    OFAEncoderOutput,
    OFAForConditionalGeneration,
    OFAModel,
    image_position_ids,
    make_image_bucket_position,
    make_token_bucket_position,
)

CASES = ["image_text", "text_only", "image_masked", "text_to_image"]


def tol(reference: torch.Tensor) -> float:
    """Rounding-only difference allowed between two float32 computations of ``reference``'s values
    (the reference implementation on another machine, another batch shape or a masked input):
    conftest.float32_tol with the fixture's longest reduction, the ResNet's 3x3 convolutions over
    64 channels (576 terms), and at most 5 reducing layers per output (2 encoder, 2 decoder, the
    output projection), at the magnitude of the values compared."""
    return float32_tol(576, float(reference.detach().abs().max()), depth=5)

HASHES = {
    "token_rp_bucket": "20c31e82a79b5e99e560102fc14acca443cae87bcddffeb9021430a3dd46e46c",
    "image_rp_bucket": "f982ef63073e509c2bee49d3c0fcd15ab78c40b214d286478c0f58bad925b756",
    "image_position_idx": "d9a52fd9dd437b4e90f82d79063c5e5de5308183b7ddd04928c1d5a4a7c8333e",
}


@pytest.fixture(scope="module")
def reference_model(ofa_fixture_dir):
    return OFAForConditionalGeneration.from_pretrained(ofa_fixture_dir)


def load_case(fixture_dir, name):
    tensors = load_file(fixture_dir / f"case_{name}.safetensors")
    inputs = {k.removeprefix("input."): v for k, v in tensors.items() if k.startswith("input.")}
    outputs = {k.removeprefix("output."): v for k, v in tensors.items() if k.startswith("output.")}
    return inputs, outputs


def max_diff(a, b):
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


# --------------------------------------------------------------------------------- parity


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_fixture_case(ofa_fixture_dir, reference_model, case, attn):
    inputs, expected = load_case(ofa_fixture_dir, case)
    model = reference_model
    model.config._attn_implementation = attn
    try:
        with torch.no_grad():
            out = model(**inputs)
            enc = model.encode(inputs["input_ids"], inputs.get("patch_images"), inputs.get("patch_masks"))
    finally:
        model.config._attn_implementation = "sdpa"
    assert out.logits.shape == expected["logits"].shape
    assert max_diff(out.logits, expected["logits"]) < tol(expected["logits"])
    assert max_diff(out.encoder_last_hidden_state, expected["encoder_last_hidden_state"]) < tol(
        expected["encoder_last_hidden_state"])
    assert torch.equal(enc.last_hidden_state, out.encoder_last_hidden_state)
    assert torch.equal(enc.padding_mask, expected["encoder_padding_mask"])
    assert max_diff(enc.position_embedding, expected["encoder_position_embedding"]) < tol(
        expected["encoder_position_embedding"])


def test_derived_buffer_hashes(reference_model):
    def sha(t):
        return hashlib.sha256(t.contiguous().to(torch.int64).numpy().astype("<i8").tobytes()).hexdigest()

    enc, dec = reference_model.model.encoder, reference_model.model.decoder
    for module in (enc, dec):
        assert sha(module.token_rp_bucket) == HASHES["token_rp_bucket"]
        assert sha(module.image_rp_bucket) == HASHES["image_rp_bucket"]
    assert sha(dec.image_position_idx) == HASHES["image_position_idx"]


def test_derived_buffer_excerpts(ofa_fixture_dir, reference_model):
    ex = load_file(ofa_fixture_dir / "derived_buffers_excerpt.safetensors")
    enc, dec = reference_model.model.encoder, reference_model.model.decoder
    ids = image_position_ids(8, 8, 42)
    assert torch.equal(ids, ex["encoder_image_position_ids_8x8"])
    assert torch.equal(enc.token_rp_bucket[:128, :128], ex["token_rp_bucket_first128x128"])
    assert torch.equal(enc.image_rp_bucket[ids][:, ids], ex["encoder_image_rp_bucket_8x8_gathered"])
    assert torch.equal(dec.image_position_idx, ex["decoder_image_position_idx"])
    first8 = dec.image_position_idx[:8]
    assert torch.equal(dec.image_rp_bucket[first8][:, first8], ex["decoder_image_rp_bucket_first8_gathered"])


def test_token_buckets_by_hand():
    bucket = make_token_bucket_position(256) - 255
    mid = 128
    for rel in (0, 1, 127, 128, -128):
        assert bucket[rel if rel > 0 else 0, -rel if rel < 0 else 0] == rel
    # log region with the hard-coded max position 1024: ceil(log(r/128)/log(1023/128)*127) + 128
    for rel in (129, 130, 200, 500, 1023):
        want = math.ceil(math.log(rel / mid) / math.log(1023 / mid) * (mid - 1)) + mid
        assert bucket[rel, 0] == want and bucket[0, rel] == -want
    assert bucket[130, 0] == 129 and bucket[200, 0] == 156 and bucket[1023, 0] == 255


def test_image_buckets_by_hand():
    n = 83**2 + 3
    table = make_image_bucket_position(42, n)
    p = lambda r, c: r * 42 + c + 1  # noqa: E731
    assert table[p(3, 5), p(1, 9)] == (3 - 1 + 41) * 83 + (5 - 9 + 41)
    assert table[p(0, 0), p(41, 41)] == 0 and table[p(41, 41), p(0, 0)] == 82 * 83 + 82
    assert table[0, 7] == n - 3 and table[7, 0] == n - 2 and table[0, 0] == n - 1


# --------------------------------------------------------------------------- behaviour


def test_kv_cache_and_shared_encoder(ofa_fixture_dir, reference_model):
    from transformers.cache_utils import DynamicCache, EncoderDecoderCache

    inputs, _ = load_case(ofa_fixture_dir, "text_to_image")
    model = reference_model
    dec = inputs["decoder_input_ids"]
    with torch.no_grad():
        enc = model.encode(inputs["input_ids"], inputs["patch_images"], inputs["patch_masks"])
        full = model.decode(dec, enc, inputs["code_masks"])
        cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
        steps = [model.decode(dec[:, :3], enc, inputs["code_masks"], past_key_values=cache)]
        steps += [model.decode(dec[:, t : t + 1], enc, inputs["code_masks"], past_key_values=cache)
                  for t in range(3, dec.shape[1])]
        assert max_diff(torch.cat(steps, 1), full) < tol(full)
        # K candidates share one encoder pass: index_select rows instead of re-encoding
        index = torch.tensor([1, 1, 0, 1])
        shared = model.decode(dec[index], enc.index_select(index), inputs["code_masks"][index])
        assert max_diff(shared, full[index]) < tol(full)  # another batch shape: rounding only


def test_mixed_code_masks_match_per_sample(ofa_fixture_dir, reference_model):
    inputs, _ = load_case(ofa_fixture_dir, "image_text")
    model = reference_model
    with torch.no_grad():
        enc = model.encode(inputs["input_ids"], inputs["patch_images"], inputs["patch_masks"])
        mixed = model.decode(inputs["decoder_input_ids"], enc, torch.tensor([True, False]))
        for b, code in ((0, True), (1, False)):
            alone = model.decode(inputs["decoder_input_ids"][b : b + 1], enc.index_select(torch.tensor([b])),
                                 torch.tensor([code]))
            assert max_diff(mixed[b : b + 1], alone) < tol(alone)
        text_mode = model.decode(inputs["decoder_input_ids"], enc)
        assert max_diff(mixed[0], text_mode[0]) > tol(text_mode)  # code mode really changes row 0 (beyond rounding)


def test_masked_dummy_image_equals_no_image(ofa_fixture_dir, reference_model):
    """OFA feeds zero images with patch_masks=False for text-to-image; text-only input is equivalent."""
    inputs, expected = load_case(ofa_fixture_dir, "text_to_image")
    with torch.no_grad():
        no_image = reference_model(input_ids=inputs["input_ids"], decoder_input_ids=inputs["decoder_input_ids"],
                                   code_masks=inputs["code_masks"]).logits
        dummy = reference_model(**inputs).logits
    assert max_diff(no_image, dummy) < tol(no_image)  # masked keys are summed in another order
    assert max_diff(no_image, expected["logits"]) < tol(expected["logits"])


def test_beam_search_with_cache(ofa_fixture_dir, reference_model):
    inputs, _ = load_case(ofa_fixture_dir, "image_text")
    kw = dict(input_ids=inputs["input_ids"], patch_images=inputs["patch_images"],
              patch_masks=inputs["patch_masks"], num_beams=5, no_repeat_ngram_size=3, max_new_tokens=10)
    with torch.no_grad():
        cached = reference_model.generate(**kw, use_cache=True)
        recomputed = reference_model.generate(**kw, use_cache=False)
        greedy = reference_model.generate(**{**kw, "num_beams": 1, "no_repeat_ngram_size": 0}, use_cache=True)
        enc = reference_model.encode(inputs["input_ids"], inputs["patch_images"], inputs["patch_masks"])
        seq = torch.zeros(2, 1, dtype=torch.long)
        for _ in range(greedy.shape[1] - 1):
            seq = torch.cat([seq, reference_model.decode(seq, enc)[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(cached, recomputed)
    gc = reference_model.generation_config  # OFA's captioning defaults
    assert (gc.num_beams, gc.no_repeat_ngram_size, gc.max_new_tokens) == (5, 3, 16)
    assert gc.decoder_start_token_id == 0
    bare = OFAModel.from_pretrained(ofa_fixture_dir)  # the un-prefixed class generates identically
    with torch.no_grad():
        assert torch.equal(bare.generate(**kw), cached)
    assert cached[:, 0].eq(0).all()  # decoder_start_token_id
    assert torch.equal(greedy, seq)
    for row in cached.tolist():
        row = row[: row.index(2) + 1] if 2 in row else row
        trigrams = [tuple(row[i : i + 3]) for i in range(len(row) - 2)]
        assert len(trigrams) == len(set(trigrams))


# ------------------------------------------------------------------------ checkpoint I/O


def copy_config(fixture_dir, dst):
    dst.mkdir(parents=True, exist_ok=True)
    shutil.copy(fixture_dir / "config.json", dst / "config.json")
    return dst


def test_save_load_round_trip(ofa_fixture_dir, reference_model, tmp_path):
    inputs, _ = load_case(ofa_fixture_dir, "image_text")
    reference_model.save_pretrained(tmp_path / "ckpt")
    saved = load_file(tmp_path / "ckpt" / "model.safetensors")
    assert "model.encoder.embed_tokens.weight" in saved
    assert "model.decoder.output_projection.weight" not in saved  # tied: stored once
    assert not any(k.endswith("rp_bucket") for k in saved)  # derived: never stored
    reloaded = OFAForConditionalGeneration.from_pretrained(tmp_path / "ckpt")
    assert reloaded.model.decoder.output_projection.weight is reloaded.model.encoder.embed_tokens.weight
    bare = OFAModel.from_pretrained(ofa_fixture_dir)  # same keys without the "model." prefix
    with torch.no_grad():
        a = reference_model(**inputs).logits
        assert torch.equal(reloaded(**inputs).logits, a)
        assert torch.equal(bare(**inputs).logits, a)
    assert reloaded.config.to_dict() == reference_model.config.to_dict()


def test_key_mismatch_names_first_missing_and_unexpected(ofa_fixture_dir, tmp_path):
    state = load_file(ofa_fixture_dir / "model.safetensors")
    state["model.encoder.bogus.weight"] = state.pop("model.encoder.pos_q_linear.weight")
    save_file(state, copy_config(ofa_fixture_dir, tmp_path) / "model.safetensors")
    with pytest.raises(CheckpointError) as err:
        OFAForConditionalGeneration.from_pretrained(tmp_path)
    msg = str(err.value)
    assert "model.encoder.pos_q_linear.weight" in msg and "model.encoder.bogus.weight" in msg


def test_shape_mismatch_and_untied_copies_refused(ofa_fixture_dir, tmp_path):
    state = load_file(ofa_fixture_dir / "model.safetensors")
    state["model.decoder.output_projection.weight"] = state["model.decoder.output_projection.weight"] + 1
    save_file(state, copy_config(ofa_fixture_dir, tmp_path / "a") / "model.safetensors")
    with pytest.raises(CheckpointError, match="tied"):
        OFAForConditionalGeneration.from_pretrained(tmp_path / "a")
    state = load_file(ofa_fixture_dir / "model.safetensors")
    state["model.encoder.image_proj.bias"] = torch.zeros(3)
    save_file(state, copy_config(ofa_fixture_dir, tmp_path / "b") / "model.safetensors")
    with pytest.raises(CheckpointError, match="image_proj.bias"):
        OFAForConditionalGeneration.from_pretrained(tmp_path / "b")


def test_derived_buffers_in_checkpoint(ofa_fixture_dir, reference_model, tmp_path):
    state = load_file(ofa_fixture_dir / "model.safetensors")
    state["model.encoder.token_rp_bucket"] = reference_model.model.encoder.token_rp_bucket.clone()
    state["model.decoder.image_position_idx"] = reference_model.model.decoder.image_position_idx.clone()
    save_file(state, copy_config(ofa_fixture_dir, tmp_path / "ok") / "model.safetensors")
    OFAForConditionalGeneration.from_pretrained(tmp_path / "ok")  # accepted
    state["model.decoder.image_position_idx"][5] += 1
    save_file(state, copy_config(ofa_fixture_dir, tmp_path / "bad") / "model.safetensors")
    with pytest.raises(CheckpointError, match="image_position_idx"):
        OFAForConditionalGeneration.from_pretrained(tmp_path / "bad")


def test_wrong_architecture_refused(ofa_fixture_dir, tmp_path):
    config = json.loads((ofa_fixture_dir / "config.json").read_text())
    (tmp_path / "bart").mkdir()
    (tmp_path / "bart" / "config.json").write_text(json.dumps({**config, "model_type": "bart"}))
    with pytest.raises(OFAConfigError, match="model_type is 'bart'"):
        OFAForConditionalGeneration.from_pretrained(tmp_path / "bart")
    (tmp_path / "nokey").mkdir()
    no_resnet = {k: v for k, v in config.items() if k != "resnet_type"}
    (tmp_path / "nokey" / "config.json").write_text(json.dumps(no_resnet))
    with pytest.raises(OFAConfigError, match="'resnet_type'"):
        OFAForConditionalGeneration.from_pretrained(tmp_path / "nokey")


def test_pickle_refused_then_converted_once(ofa_fixture_dir, reference_model, tmp_path, caplog):
    ckpt = copy_config(ofa_fixture_dir, tmp_path)
    torch.save(reference_model.state_dict(), ckpt / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="allow_pickle=true"):
        OFAForConditionalGeneration.from_pretrained(ckpt)
    assert not (ckpt / "model.safetensors").exists()
    with caplog.at_level(logging.WARNING, logger="unicon.models.ofa.convert"):
        model = OFAForConditionalGeneration.from_pretrained(ckpt, allow_pickle=True)
    assert (ckpt / "model.safetensors").is_file()
    assert any("converted" in r.getMessage() for r in caplog.records)
    inputs, _ = load_case(ofa_fixture_dir, "text_only")
    with torch.no_grad():
        assert torch.equal(model(**inputs).logits, reference_model(**inputs).logits)
    OFAForConditionalGeneration.from_pretrained(ckpt)  # now safetensors; no pickle needed


# ------------------------------------------------------------------------------- presets


def test_reference_preset_equals_fixture_config(ofa_fixture_dir):
    fixture = OFAConfig.from_pretrained(ofa_fixture_dir)
    for key, value in OFA_PRESETS["reference-tiny"].items():
        assert getattr(fixture, key) == value, key  # patch_image_size 128: matched by dimensions


@pytest.mark.parametrize(
    "name,millions",
    [("ofa-tiny", 33), ("ofa-medium", 93), ("ofa-base", 182), ("ofa-large", 472), ("ofa-huge", 930)],
)
def test_published_sizes(name, millions):
    with torch.device("meta"):
        model = OFAForConditionalGeneration(preset_config(name))
    assert abs(sum(p.numel() for p in model.parameters()) / 1e6 - millions) < 1.5


def test_published_config_gets_its_image_size(tmp_path):
    from unicon.models.ofa.convert import read_config

    preset = {k: v for k, v in OFA_PRESETS["ofa-base"].items() if k != "patch_image_size"}
    (tmp_path / "config.json").write_text(json.dumps({**preset, "model_type": "ofa"}))
    assert read_config(tmp_path).patch_image_size == 384
    (tmp_path / "config.json").write_text(json.dumps({**preset, "model_type": "ofa", "d_model": 96}))
    assert read_config(tmp_path).patch_image_size is None


def test_preset_overrides_checked():
    assert preset_config("shapes-tiny", vocab_size=300, d_model=192).d_model == 192
    with pytest.raises(ValueError, match="d_modle"):
        preset_config("shapes-tiny", d_modle=192)
    with pytest.raises(ValueError, match="unknown OFA preset"):
        preset_config("ofa-gigantic")
    with pytest.raises(OFAConfigError, match="not divisible"):
        preset_config("shapes-tiny", encoder_attention_heads=5)


def test_shapes_tiny_grid_and_gradients():
    model = OFAForConditionalGeneration(preset_config("shapes-tiny", vocab_size=300))
    model.train()
    ids = torch.randint(4, 300, (2, 7))
    ids[:, 0], ids[:, -1] = 0, 2
    dec = torch.randint(4, 300, (2, 17))
    dec[:, 0] = 0
    out = model(input_ids=ids, patch_images=torch.randn(2, 3, 64, 64), decoder_input_ids=dec,
                code_masks=torch.tensor([True, True]), labels=dec)
    assert out.encoder_last_hidden_state.shape == (2, 16 + 7, 128)  # 4x4 image tokens + text
    idx = model.model.decoder.image_position_idx
    assert idx[1:17].tolist() == image_position_ids(4, 4, 5).tolist()
    assert idx[17] == 25 and 25 not in idx[:17].tolist()  # the step after the last code sits off the cells
    out.loss.backward()
    assert model.model.encoder.embed_images.conv1.weight.grad.abs().sum() > 0
    assert model.model.decoder.image_rel_pos_table_list[0].weight.grad.abs().sum() > 0


def test_gradient_checkpointing_same_gradients(monkeypatch):
    torch.manual_seed(0)
    model = OFAForConditionalGeneration(preset_config("shapes-tiny", vocab_size=300, dropout=0.0))
    model.train()
    ids, dec = torch.randint(4, 300, (2, 6)), torch.randint(4, 300, (2, 5))
    images = torch.randn(2, 3, 64, 64)

    def grads():
        model.zero_grad()
        model(input_ids=ids, patch_images=images, decoder_input_ids=dec, labels=dec).loss.backward()
        return model.model.encoder.layers[0].fc1.weight.grad.clone()

    plain = grads()  # train-mode BatchNorm uses batch statistics, so both passes see the same function
    model.activation_checkpointing_enable()
    assert model.model.encoder.gradient_checkpointing and model.model.decoder.gradient_checkpointing
    calls = []
    original = torch.utils.checkpoint.checkpoint
    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint",
                        lambda *a, **k: calls.append(1) or original(*a, **k))
    # recomputation in the backward pass: the same function, rounded the same or in another order
    assert max_diff(grads(), plain) < tol(plain)
    assert len(calls) == model.config.encoder_layers + model.config.decoder_layers  # one per layer


def test_encoder_output_is_model_output():
    out = OFAEncoderOutput(torch.zeros(2, 3, 4), torch.zeros(2, 3, dtype=torch.bool), torch.ones(2, 3, 4))
    picked = out.index_select(torch.tensor([1, 1, 0]))
    assert picked.last_hidden_state.shape == (3, 3, 4) and picked.padding_mask.shape == (3, 3)
