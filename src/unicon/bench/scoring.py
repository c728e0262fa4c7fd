"""``unicon bench scoring``: batched vs naive likelihood scoring of CocoCon contrast sets.

For each CocoCon annotation the K candidates are the gold caption and its contrast
captions (``mutex_caption``), scored under the captioning prompt -- the workload of the
consistency loss and of CocoCon evaluation. Two implementations are timed:

* **batched** -- ``model.score_text``: one encoder pass per image, one decoder pass over all
  ``sum_b K_b`` candidates of the batch;
* **naive** -- ``model.score_text`` called once per (example, candidate): one full
  encoder+decoder forward per candidate, through the same interface (any backend).

Both must give the same ``Scores.nll`` within the tolerance of float32 rounding (``--atol``
overrides it): the two differ only in summation order (other batch shapes and paddings; for
OFA and Janus also a shared-prefix cache against one full pass), and a length-``n`` float32 sum
is within ``n * eps * sum|x_i|`` of the exact value (Higham's gamma_n bound), so two of them
differ by at most ``atol = 2 * n * eps32 * max(1, max|nll|)`` with ``n`` the longest scored
sequence (target tokens plus the prompt's characters, an upper bound on its tokens). The command
prints one JSON object with samples/s of both, their ratio, the largest difference and the
tolerance, and exits non-zero on disagreement.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from PIL import Image

from unicon import jsonsafe
from unicon.config import ModelConfig, config_dir
from unicon.errors import UserError


def load_contrast_sets(path: Path, images_root: Path, k: int, limit: int) -> list[dict]:
    """``[{"image": PIL, "candidates": [gold, contrast...][:k]}]`` from a CocoCon-schema file."""
    if not path.is_file():
        raise UserError(f"no CocoCon contrast file {path} (build the world: unicon build-data shapes)")
    data = json.loads(path.read_text())
    if "annotations" not in data or "images" not in data:
        raise UserError(f"{path}: not a CocoCon file (needs 'annotations' and 'images')")
    files = {im["id"]: im["file_name"] for im in data["images"]}
    samples = []
    for i, ann in enumerate(data["annotations"][:limit]):
        try:
            cands = [ann["caption"]] + [c["mutex_caption"] for c in ann["contrast_sets"]]
            file = files[ann["image_id"]]
        except KeyError as e:
            raise UserError(f"{path}: annotation {i} lacks {e}") from None
        with Image.open(images_root / file) as im:
            samples.append({"image": im.convert("RGB"), "candidates": cands[:k]})
    if not samples:
        raise UserError(f"{path}: no annotations")
    return samples


def _load(args) -> "object":
    import torch

    from unicon.models.checkpoints import load_model  # lazy: pulls in every model backend (transformers)
    from unicon.models.factory import build_model  # lazy: pulls in every model backend (transformers)

    if args.ckpt:
        return load_model(args.ckpt, world_root=args.world)
    from omegaconf import OmegaConf

    path = Path(args.model_config)
    if not path.is_file():
        path = config_dir() / "model" / f"{args.model_config}.yaml"
    if not path.is_file():
        raise UserError(f"no model config {args.model_config} (a yaml path or a name in {config_dir() / 'model'})")
    cfg = OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(path))
    torch.manual_seed(0)
    return build_model(cfg, world_root=args.world).eval()


def float32_atol(nll: list[list[float]], num_tokens: int, prompt: str) -> float:
    """``2 * n * eps32 * max(1, max|nll|)``, ``n = num_tokens + len(prompt)`` (see the module docstring)."""
    import torch

    scale = max([1.0] + [abs(v) for row in nll for v in row])
    return 2.0 * (num_tokens + len(prompt)) * torch.finfo(torch.float32).eps * scale


def run(model, samples: list[dict], batch_size: int, atol: float | None = None) -> dict:
    import torch

    prompt = model.caption_prompt
    batched, naive, longest = [], [], 0
    with torch.no_grad():
        # warm-up (allocator, lazy init) outside the timings
        model.score_text([samples[0]["image"]], [prompt], [samples[0]["candidates"]])
        t0 = time.perf_counter()
        for i in range(0, len(samples), batch_size):
            chunk = samples[i: i + batch_size]
            s = model.score_text([c["image"] for c in chunk], [prompt] * len(chunk),
                                 [c["candidates"] for c in chunk])
            batched += [row[m].tolist() for row, m in zip(s.nll.cpu(), s.mask.cpu())]
            longest = max(longest, int(s.num_tokens.max()))
        t_batched = time.perf_counter() - t0
        t0 = time.perf_counter()
        for c in samples:  # one full forward per (example, candidate), through the same interface
            naive.append([model.score_text([c["image"]], [prompt], [[cand]]).nll[0, 0].item()
                          for cand in c["candidates"]])
        t_naive = time.perf_counter() - t0
    diff = max(abs(a - b) for ra, rb in zip(batched, naive) for a, b in zip(ra, rb))
    n = len(samples)
    if atol is None:
        atol = float32_atol(naive, longest, prompt)
    return {
        "samples": n,
        "candidates": sum(len(s["candidates"]) for s in samples),
        "batch_size": batch_size,
        "batched_samples_per_s": n / t_batched,
        "naive_samples_per_s": n / t_naive,
        "speedup": t_naive / t_batched,
        "max_abs_diff": diff,
        "atol": atol,
        "agree": diff <= atol,
        "threads": torch.get_num_threads(),
    }


def cli(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="unicon bench scoring", description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, default=5, help="candidates per sample (gold + K-1 contrasts)")
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--model-config", default="ofa_shapes_tiny", help="configs/model/<name>.yaml (random init)")
    parser.add_argument("--ckpt", default=None, help="a trained checkpoint instead (.ckpt or save_pretrained dir)")
    parser.add_argument("--world", default="data/shapes", help="ShapesWorld root")
    parser.add_argument("--contrast-file", default=None, help="default <world>/cococon_test.json")
    parser.add_argument("--atol", type=float, default=None,
                        help="largest allowed |batched - naive| (default: the float32 bound of the docstring)")
    parser.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "1")))
    args = parser.parse_args(argv)
    if args.k < 2 or args.samples < 1 or args.batch_size < 1:
        raise UserError("--k must be >= 2, --samples and --batch-size >= 1")
    import torch  # heavy: imported when the command runs, not for --help

    torch.set_num_threads(args.threads)
    world = Path(args.world)
    contrast = Path(args.contrast_file) if args.contrast_file else world / "cococon_test.json"
    samples = load_contrast_sets(contrast, world, args.k, args.samples)
    model = _load(args)
    result = run(model, samples, args.batch_size, args.atol)
    result["k"] = args.k
    print(jsonsafe.dumps(result))
    if not result["agree"]:
        raise UserError(f"batched and naive scores differ by {result['max_abs_diff']:.3g} > {result['atol']:.3g}")
    return 0
