"""Tiny stand-ins for the real checkpoints the README's commands name, built locally in seconds.

The README documents commands on real models (``checkpoints/pretrained/Janus-Pro-1B``, an OWLv2
detector, a CLIP model, a Qwen-VL judge). Tests run those exact commands with each path pointing
at a random-weight model of the same family and layout, saved with ``save_pretrained``:
the code path is the real one, only the sizes differ.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def build_world(root: Path, *extra: str, train: int = 12) -> Path:
    """A small ShapesWorld written by the real builder."""
    sys.path.insert(0, str(REPO))
    from data_builders.shapes import main as build_shapes

    build_shapes(["--out", str(root), "--num-train", str(train), "--num-val", "4", "--num-test", "4", "--quiet",
                  "--overwrite", "--num-ureason", "2", "--geneval-per-tag", "2", "--num-drift-seeds", "2", *extra])
    return root


def janus_export(path: Path) -> Path:
    """``configs/model/janus_tiny.yaml`` at random init, saved like a Janus-Pro checkpoint export."""
    from omegaconf import OmegaConf

    from unicon.models.janus import JanusUnifiedModel

    cfg = OmegaConf.to_container(OmegaConf.load(REPO / "configs" / "model" / "janus_tiny.yaml"))
    torch.manual_seed(0)
    JanusUnifiedModel.from_config(cfg).save_pretrained(str(path))
    return path


def owlv2(path: Path) -> Path:
    """A 1-layer OWLv2 with a letter vocabulary (transformers layout)."""
    from transformers import CLIPTokenizer, Owlv2Config, Owlv2ForObjectDetection, Owlv2ImageProcessor, Owlv2Processor

    path.mkdir(parents=True, exist_ok=True)
    vocab = {"!": 0, "<|startoftext|>": 1, "<|endoftext|>": 2}  # OWL masks queries whose first id is 0
    for ch in "abcdefghijklmnopqrstuvwxyz":
        vocab[ch] = len(vocab)
        vocab[ch + "</w>"] = len(vocab)
    (path / "vocab.json").write_text(json.dumps(vocab))
    (path / "merges.txt").write_text("#version: 0.2\n")
    processor = Owlv2Processor(image_processor=Owlv2ImageProcessor(size={"height": 32, "width": 32}),
                               tokenizer=CLIPTokenizer(str(path / "vocab.json"), str(path / "merges.txt")))
    small = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    cfg = Owlv2Config(text_config=dict(vocab_size=len(vocab), max_position_embeddings=16, **small),
                      vision_config=dict(image_size=32, patch_size=8, **small), projection_dim=16)
    torch.manual_seed(0)
    Owlv2ForObjectDetection(cfg).save_pretrained(path)
    processor.save_pretrained(path)
    return path


def qwen2_vl(path: Path) -> Path:
    """A 1-layer Qwen2-VL with a word-level vocabulary, loadable as a ``vlm:`` judge."""
    from transformers import (Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLImageProcessor,
                              Qwen2VLProcessor, Qwen2VLVideoProcessor)

    from test_ureason import CHAT_TEMPLATE, VLM_SPECIALS, _word_tokenizer

    tokenizer, vocab = _word_tokenizer(VLM_SPECIALS)
    tokenizer.image_token = "<|image_pad|>"
    processor = Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=56 * 56),
        tokenizer=tokenizer, video_processor=Qwen2VLVideoProcessor(), chat_template=CHAT_TEMPLATE)
    cfg = Qwen2VLConfig(
        text_config=dict(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1,
                         rope_scaling={"type": "mrope", "mrope_section": [2, 2, 4]},
                         eos_token_id=vocab["<|im_end|>"], bos_token_id=None, pad_token_id=vocab["<|endoftext|>"]),
        vision_config=dict(depth=1, embed_dim=32, hidden_size=32, num_heads=2, mlp_ratio=2),
        image_token_id=vocab["<|image_pad|>"], video_token_id=vocab["<|video_pad|>"],
        vision_start_token_id=vocab["<|vision_start|>"], vision_end_token_id=vocab["<|vision_end|>"])
    torch.manual_seed(0)
    Qwen2VLForConditionalGeneration(cfg).save_pretrained(path)
    processor.save_pretrained(path)
    return path
