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


def _byte_tokenizer(specials: dict[str, str], chat_template: str | None = None, bos: str | None = None):
    """A byte-level BPE without merges (every text is representable) plus ``specials`` (role -> token)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(list(specials.values()))
    if bos is not None:
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, backend.token_to_id(bos))])
    return PreTrainedTokenizerFast(tokenizer_object=backend, chat_template=chat_template, padding_side="left",
                                   **specials)


#: LLaVA-1.5's conversation layout ("USER: <image>\n{question} ASSISTANT: {answer}</s>")
LLAVA_CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}USER: {% else %}ASSISTANT: {% endif %}"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<image>{{ '\\n' }}{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{% if m['role'] == 'user' %} {% else %}</s>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)


def llava(path: Path, image_size: int = 32) -> Path:
    """A 1-layer LLaVA (tiny CLIP vision tower + Llama) with a byte-level vocabulary, saved in the
    llava-hf layout that ``AutoModelForImageTextToText`` / ``AutoProcessor`` load."""
    from transformers import CLIPImageProcessor, LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor

    tokenizer = _byte_tokenizer({"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "image_token": "<image>"},
                                LLAVA_CHAT_TEMPLATE, bos="<s>")
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in ("<s>", "</s>", "<pad>", "<image>")}
    patch = 8
    processor = LlavaProcessor(
        image_processor=CLIPImageProcessor(size={"shortest_edge": image_size},
                                           crop_size={"height": image_size, "width": image_size}),
        tokenizer=tokenizer, patch_size=patch, vision_feature_select_strategy="default",
        num_additional_image_tokens=1, chat_template=LLAVA_CHAT_TEMPLATE)
    cfg = LlavaConfig(
        vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, image_size=image_size, patch_size=patch, projection_dim=32),
        text_config=dict(model_type="llama", vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=256, bos_token_id=ids["<s>"], eos_token_id=ids["</s>"],
                         pad_token_id=ids["<pad>"], initializer_range=0.3),
        image_token_id=ids["<image>"], vision_feature_select_strategy="default", vision_feature_layer=-1)
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(cfg)
    model.generation_config.update(bos_token_id=ids["<s>"], eos_token_id=ids["</s>"], pad_token_id=ids["<pad>"])
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return path


def stable_diffusion(path: Path, image_size: int = 32) -> Path:
    """A tiny Stable Diffusion 1.x pipeline (UNet2DConditionModel, AutoencoderKL with 2x downsampling,
    1-layer CLIP text encoder over a letter vocabulary, DDIM scheduler), saved with ``save_pretrained``."""
    from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    path.mkdir(parents=True, exist_ok=True)
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for ch in "abcdefghijklmnopqrstuvwxyz0123456789":
        vocab[ch] = len(vocab)
        vocab[ch + "</w>"] = len(vocab)
    (path / "vocab.json").write_text(json.dumps(vocab))
    (path / "merges.txt").write_text("#version: 0.2\n")
    tokenizer = CLIPTokenizer(str(path / "vocab.json"), str(path / "merges.txt"), model_max_length=48)
    torch.manual_seed(0)
    text_encoder = CLIPTextModel(CLIPTextConfig(
        vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        max_position_embeddings=48, bos_token_id=0, eos_token_id=1, pad_token_id=1))
    vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 16),
                        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                        layers_per_block=1, norm_num_groups=8, sample_size=image_size)
    with torch.no_grad():  # unit-variance latents, as SD's scaling factor gives its trained VAE
        g = torch.Generator().manual_seed(0)
        vae.register_to_config(scaling_factor=1.0 / float(vae.encode(
            torch.rand(8, 3, image_size, image_size, generator=g) * 2 - 1).latent_dist.mean.std()))
    unet = UNet2DConditionModel(
        sample_size=image_size // 2, in_channels=4, out_channels=4, block_out_channels=(16, 32), layers_per_block=1,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32, attention_head_dim=4, norm_num_groups=8)
    scheduler = DDIMScheduler(num_train_timesteps=1000, beta_schedule="scaled_linear", beta_start=0.00085,
                              beta_end=0.012, clip_sample=False, set_alpha_to_one=False, steps_offset=1)
    pipe = StableDiffusionPipeline(vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet,
                                   scheduler=scheduler, safety_checker=None, feature_extractor=None,
                                   requires_safety_checker=False)
    pipe.save_pretrained(path)
    return path


def mini_cococon(root: Path, green: int = 120) -> Path:
    """Three CocoCon-schema samples under ``root`` (one without localization; 1 or 2 contrast sets)
    and their 40-px images of colour ``(60 i, green, 30)``: the benchmark's shape, for running the
    CocoCon suite end to end on a backend."""
    from PIL import Image

    (root / "images").mkdir()
    anns, table = [], []
    for i in range(3):
        Image.new("RGB", (40, 30 + i), (60 * i, green, 30)).save(root / "images" / f"{i}.png")
        table.append({"id": i, "file_name": f"images/{i}.png", "width": 40, "height": 30 + i})
        ann = {"id": i, "question_id": 10 + i, "image_id": i, "caption": f"a red circle left of shape {i}",
               "query": "what color is the circle?", "answer": "red",
               "contrast_sets": [{"mutex_caption": f"a {c} circle left of shape {i}", "mutex_answer": c}
                                 for c in ["blue", "green"][: i + 1]]}
        if i != 1:
            ann["detection"], ann["boxes"] = "the circle", [[2, 3, 10, 8]]
            ann["contrast_sets"][0]["mutex_detection"] = "the square"
        anns.append(ann)
    path = root / "cococon.json"
    path.write_text(json.dumps({"annotations": anns, "images": table}))
    return path
