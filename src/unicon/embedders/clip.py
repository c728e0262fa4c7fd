"""CLIP embeddings through open_clip: text<->image, and text->text / image->image (appendix C).

``ClipEmbedder(source)`` accepts

* a local directory holding ``open_clip_config.json`` (``{"model_cfg", "preprocess_cfg"}``) and the
  weights (``open_clip_model.safetensors``) -- what :func:`train_shapes_clip` writes, and the layout
  of open_clip models on the HF hub (loaded with open_clip's ``local-dir:`` schema);
* ``"<arch>:<weights file>"`` -- a built-in open_clip architecture with local weights, e.g.
  ``ViT-B-32:/models/openai_vit_b32.pt``;
* ``"hf-hub:<org>/<repo>"`` (needs network or the HF cache).

ShapesWorld has no pretrained CLIP, so a small one is trained contrastively on the world's
(image, caption) pairs -- minutes on a CPU::

    python -m unicon.embedders.clip --train-shapes data/shapes --out checkpoints/shapes_clip

No augmentation is used: flips/crops would change the very relations (left of, above) the
captions describe. The result is an ordinary open_clip checkpoint (``open_clip.create_model_and_transforms
("local-dir:checkpoints/shapes_clip")`` loads it), so text<->image MCD on the world is meaningful.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import tempfile
import time
from pathlib import Path
from typing import Sequence

import torch
from PIL import Image

from unicon import jsonsafe
from unicon.data.mixture import read_mixture
from unicon.embedders.base import Embedder, EmbedderNotFound, normalize

log = logging.getLogger(__name__)

TRAIN_HINT = (
    "train one for ShapesWorld with `python -m unicon.embedders.clip --train-shapes data/shapes "
    "--out checkpoints/shapes_clip`, or give an open_clip directory (open_clip_config.json + weights), "
    "'<arch>:<weights file>' or 'hf-hub:<repo>'"
)

#: a small ViT-CLIP for 64x64 ShapesWorld images (8x8 patches -> 8x8 grid), CLIP's BPE tokenizer
SHAPES_CLIP_CONFIG = {
    "embed_dim": 64,
    "vision_cfg": {"image_size": 64, "patch_size": 8, "width": 128, "layers": 3, "head_width": 32},
    "text_cfg": {"context_length": 48, "vocab_size": 49408, "width": 128, "heads": 4, "layers": 3},
}
SHAPES_PREPROCESS = {"size": 64, "mean": [0.5, 0.5, 0.5], "std": [0.5, 0.5, 0.5], "interpolation": "bicubic",
                     "resize_mode": "shortest"}


def _resolve(source: str) -> tuple[str, str | None]:
    """open_clip (model_name, pretrained) for ``source``; raises EmbedderNotFound naming the path."""
    import open_clip

    if source.startswith("hf-hub:"):
        return source, None
    path = Path(source).expanduser()
    if path.is_dir():
        if not (path / "open_clip_config.json").is_file():
            raise EmbedderNotFound(f"{path.resolve()} has no open_clip_config.json: {TRAIN_HINT}")
        return f"local-dir:{path}", None
    arch, sep, weights = source.partition(":")
    if sep and arch in open_clip.list_models():
        if not Path(weights).expanduser().is_file():
            raise EmbedderNotFound(f"open_clip weights for {arch} not found at {Path(weights).resolve()}: "
                                   f"{TRAIN_HINT}")
        return arch, str(Path(weights).expanduser())
    raise EmbedderNotFound(f"CLIP model not found at {path.resolve()}: {TRAIN_HINT}")


class ClipEmbedder(Embedder):
    name = "clip"
    modalities = frozenset({"text", "image"})
    joint = True

    def __init__(self, source: str | Path, device: str = "cpu", batch_size: int = 64):
        import open_clip

        model_name, pretrained = _resolve(str(source))
        self.model, _, self.preprocess = open_clip.create_model_and_transforms(
            model_name, pretrained=pretrained, device=device
        )
        self.tokenizer = open_clip.get_tokenizer(model_name)
        self.model.eval()
        self.device = device
        self.batch_size = batch_size
        self.source = str(source)

    @torch.no_grad()
    def embed_text(self, texts: Sequence[str]) -> torch.Tensor:
        out = []
        for s in range(0, len(texts), self.batch_size):
            tokens = self.tokenizer(list(texts[s : s + self.batch_size])).to(self.device)
            out.append(self.model.encode_text(tokens).float().cpu())
        return normalize(torch.cat(out)) if out else torch.zeros(0, self.dim)

    @torch.no_grad()
    def embed_image(self, images: Sequence[Image.Image]) -> torch.Tensor:
        out = []
        for s in range(0, len(images), self.batch_size):
            x = torch.stack([self.preprocess(im.convert("RGB")) for im in images[s : s + self.batch_size]])
            out.append(self.model.encode_image(x.to(self.device)).float().cpu())
        return normalize(torch.cat(out)) if out else torch.zeros(0, self.dim)

    @property
    def dim(self) -> int:
        return int(self.model.text_projection.shape[-1]) if hasattr(self.model, "text_projection") else 0


# ---- training a small CLIP on ShapesWorld ------------------------------------------------------------------
def _caption_pairs(world_root: Path, split: str) -> list[tuple[Path, str]]:
    """(image path, caption) pairs from ``mixture_<split>.jsonl`` caption rows (one per scene)."""
    path = world_root / f"mixture_{split}.jsonl"
    if not path.is_file():
        raise EmbedderNotFound(f"ShapesWorld split file not found at {path.resolve()}: "
                               f"run `unicon build-data shapes --out {world_root}`")

    pairs, seen = [], set()
    for row in read_mixture(path, tasks=("caption",)):
        key = (row["image"], row["target"])
        if key not in seen:
            seen.add(key)
            pairs.append((world_root / row["image"], row["target"]))
    if not pairs:
        raise ValueError(f"{path}: no caption rows to train CLIP on")
    return pairs


def _load_pairs(pairs, preprocess, tokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    images, texts = [], []
    for p, caption in pairs:
        if not p.is_file():
            raise FileNotFoundError(f"ShapesWorld image not found: {p}")
        with Image.open(p) as im:
            images.append(preprocess(im.convert("RGB")))
        texts.append(caption)
    return torch.stack(images), tokenizer(texts)


@torch.no_grad()
def retrieval_accuracy(model, images: torch.Tensor, tokens: torch.Tensor, batch: int = 256) -> float:
    """Image->text top-1 accuracy within ``images``' own captions (chance = 1/N)."""
    starts = range(0, len(images), batch)
    img = torch.cat([model.encode_image(images[s : s + batch], normalize=True) for s in starts])
    txt = torch.cat([model.encode_text(tokens[s : s + batch], normalize=True) for s in starts])
    return float(((img @ txt.T).argmax(-1) == torch.arange(len(img))).float().mean())


def train_shapes_clip(
    world_root: str | Path, out: str | Path, steps: int = 1500, batch_size: int = 128, lr: float = 1e-3,
    seed: int = 0, model_cfg: dict | None = None, max_pairs: int | None = None, log_every: int = 100,
) -> dict:
    """Contrastively train a small open_clip model on ShapesWorld (image, caption) pairs and save it.

    Writes ``<out>/open_clip_config.json`` and ``<out>/open_clip_model.safetensors`` (load with
    :class:`ClipEmbedder` or open_clip's ``local-dir:`` schema) and ``<out>/train_log.json`` with the
    final loss and the val image->text top-1 retrieval accuracy. Returns that log.
    """
    import open_clip
    from open_clip.loss import ClipLoss
    from safetensors.torch import save_file

    world_root, out = Path(world_root), Path(out)
    torch.manual_seed(seed)
    cfg = json.loads(json.dumps(model_cfg or SHAPES_CLIP_CONFIG))
    name = "unicon-shapes-clip"
    with tempfile.TemporaryDirectory() as tmp:  # register the custom architecture under its file stem
        (Path(tmp) / f"{name}.json").write_text(json.dumps(cfg))
        open_clip.add_model_config(Path(tmp) / f"{name}.json")
    model, _, preprocess = open_clip.create_model_and_transforms(
        name, image_mean=SHAPES_PREPROCESS["mean"], image_std=SHAPES_PREPROCESS["std"]
    )
    tokenizer = open_clip.get_tokenizer(name)

    train = _caption_pairs(world_root, "train")[:max_pairs]
    images, tokens = _load_pairs(train, preprocess, tokenizer)
    try:
        val = _caption_pairs(world_root, "val")[:512]
        val_images, val_tokens = _load_pairs(val, preprocess, tokenizer)
    except (FileNotFoundError, ValueError):
        val_images = val_tokens = None

    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 50) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))
    )
    loss_fn = ClipLoss()
    gen = torch.Generator().manual_seed(seed)
    n = len(images)
    bs = min(batch_size, n)
    model.train()
    t0, losses = time.perf_counter(), []
    for step in range(steps):
        idx = torch.randperm(n, generator=gen)[:bs]
        img = model.encode_image(images[idx], normalize=True)
        txt = model.encode_text(tokens[idx], normalize=True)
        loss = loss_fn(img, txt, model.logit_scale.exp())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        with torch.no_grad():
            model.logit_scale.clamp_(0, math.log(100))
        losses.append(loss.item())
        if log_every and (step + 1) % log_every == 0:
            log.info("shapes clip step %d/%d loss %.4f", step + 1, steps, sum(losses[-log_every:]) / log_every)
    model.eval()

    out.mkdir(parents=True, exist_ok=True)
    config = {"model_cfg": cfg, "preprocess_cfg": SHAPES_PREPROCESS}
    (out / "open_clip_config.json").write_text(json.dumps(config, indent=2))
    weights = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(weights, str(out / "open_clip_model.safetensors"))
    report = {
        "world": str(world_root), "pairs": n, "steps": steps, "batch_size": bs, "lr": lr, "seed": seed,
        "first_loss": losses[0] if losses else None,
        "final_loss": sum(losses[-20:]) / max(1, len(losses[-20:])) if losses else None,
        "train_seconds": round(time.perf_counter() - t0, 1),
        "train_top1": retrieval_accuracy(model, images[:512], tokens[:512]),
        "val_top1": retrieval_accuracy(model, val_images, val_tokens) if val_images is not None else None,
    }
    (out / "train_log.json").write_text(jsonsafe.dumps(report, indent=2))
    return report


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m unicon.embedders.clip",
        description="Train a small open_clip model on a ShapesWorld (for text<->image MCD).",
    )
    parser.add_argument("--train-shapes", metavar="WORLD_DIR", required=True,
                        help="ShapesWorld root (data/shapes)")
    parser.add_argument("--out", required=True, help="output directory (e.g. checkpoints/shapes_clip)")
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    report = train_shapes_clip(args.train_shapes, args.out, steps=args.steps, batch_size=args.batch_size,
                               lr=args.lr, seed=args.seed)
    print(jsonsafe.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
