"""Random-weight tiny checkpoints of the decoupled backend's two parts, built locally in seconds.

``configs/model/decoupled_tiny.yaml`` sets ``arch.random_tiny_parts: true``: the backend then builds
a 1-layer LLaVA (:func:`build_tiny_llava`) and a tiny Stable Diffusion 1.x
(:func:`build_tiny_stable_diffusion`) into a temporary folder and loads them through the same
``from_pretrained`` path as real checkpoints, so ``unicon bench scoring --model-config decoupled_tiny``
and the tests need no download and no prepared folder. Both are saved in the layouts that
``AutoModelForImageTextToText``/``AutoProcessor`` and ``DiffusionPipeline`` read. Weights are drawn
from a fixed seed inside :func:`torch.random.fork_rng`, so building leaves the caller's RNG alone.

This module touches only the folder it is given.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch


def _seeded(build):
    """Run ``build`` with torch's RNG seeded to 0 and restored afterwards."""
    @functools.wraps(build)
    def wrapper(*args, **kwargs):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            return build(*args, **kwargs)
    return wrapper


def byte_tokenizer(specials: dict[str, str], chat_template: str | None = None, bos: str | None = None):
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


@_seeded
def build_tiny_llava(path: Path, image_size: int = 32) -> Path:
    """A 1-layer LLaVA (tiny CLIP vision tower + Llama) with a byte-level vocabulary, saved in the
    llava-hf layout that ``AutoModelForImageTextToText`` / ``AutoProcessor`` load."""
    from transformers import CLIPImageProcessor, LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor

    tokenizer = byte_tokenizer({"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "image_token": "<image>"},
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
    model = LlavaForConditionalGeneration(cfg)
    model.generation_config.update(bos_token_id=ids["<s>"], eos_token_id=ids["</s>"], pad_token_id=ids["<pad>"])
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return path


@_seeded
def build_tiny_stable_diffusion(path: Path, image_size: int = 32) -> Path:
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
