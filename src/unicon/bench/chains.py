"""``unicon bench chains``: how fast drift chains run.

Generation steps per second with the chains batched across samples vs one chain at a time (the
same :func:`unicon.evaluation.drift.runner.run_chains` path, in a temporary folder), and OFA
text-to-image with the decoder's KV cache vs the full-prefix recompute (:func:`bench_t2i_cache`).
Prints one JSON object; writes nothing else.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import shutil
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from unicon.config import DRIFT_CHAINS, compose
from unicon.data.drift_seeds import load_seeds
from unicon.errors import UserError
from unicon.evaluation.drift.suite import add_chain_args
from unicon import jsonsafe

if TYPE_CHECKING:  # heavy (torch, the model backends): each function imports what it runs, not --help
    import torch

    from unicon.models.base import ImageGenerationConfig, UnifiedModel


def _load_model(ckpt: str) -> UnifiedModel:
    if not Path(ckpt).exists():
        raise UserError(f"checkpoint not found: {ckpt}")
    from unicon.models import load_model

    return load_model(ckpt)


def _time_image_codes(model, texts: list[str], cfg: ImageGenerationConfig, num_steps: int, codebook_size: int,
                      repeats: int) -> dict[str, Any]:
    """Best-of-``repeats`` seconds for the first ``num_steps`` codes of ``texts`` with the decoder's
    KV cache and with the full-prefix recompute (the two alternate within each repeat, in one
    process), and whether both gave the same codes (they must: same seed, logits equal up to
    rounding)."""
    import torch

    best = {"cached": math.inf, "uncached": math.inf}
    codes = {}
    for _ in range(max(repeats, 1)):
        for label in best:
            start = time.perf_counter()
            codes[label] = model._generate_image_codes(texts, cfg, num_steps, codebook_size,
                                                       use_cache=label == "cached")[0]
            best[label] = min(best[label], time.perf_counter() - start)
    out: dict[str, Any] = {}
    for label, seconds in best.items():
        out[f"{label}_seconds"] = seconds
        out[f"{label}_codes_per_s"] = len(texts) * num_steps / seconds
    out["speedup"] = best["uncached"] / best["cached"]
    out["identical_codes"] = bool(torch.equal(codes["cached"], codes["uncached"]))
    return out


def _time_last_code(model, text: str, num_codes: int, codebook_size: int, repeats: int) -> dict[str, Any]:
    """Best-of-``repeats`` seconds of the decoder pass that yields the last code of a full grid:
    the newest token against a cache of the ``num_codes - 1`` tokens before it, vs the whole
    ``num_codes``-token prefix (the work each path does per code at the end of an image). The
    prefix codes are random: timing does not depend on their values."""
    import torch
    from transformers.cache_utils import DynamicCache, EncoderDecoderCache

    from unicon.models.ofa.tokenization import BOS_ID

    lo = model.tokenizer.code_offset
    codes = torch.randint(codebook_size, (1, num_codes - 1), generator=torch.Generator().manual_seed(0))
    prefix = torch.cat([torch.full((1, 1), BOS_ID), codes + lo], dim=1).to(model.device)
    enc = model.encode(model._source_ids([text]))
    cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
    model.decode(prefix[:, :-1], enc, code_mode=True, past_key_values=cache)  # prefill, not timed
    best = {"cached": math.inf, "uncached": math.inf}
    for _ in range(max(repeats, 1)):
        start = time.perf_counter()
        model.decode(prefix[:, -1:], enc, code_mode=True, past_key_values=cache)
        best["cached"] = min(best["cached"], time.perf_counter() - start)
        cache.crop(-1)  # back to num_codes - 1 cached tokens
        start = time.perf_counter()
        model.decode(prefix, enc, code_mode=True)
        best["uncached"] = min(best["uncached"], time.perf_counter() - start)
    return {"cache_length": num_codes - 1, "cached_seconds": best["cached"],
            "uncached_seconds": best["uncached"], "speedup": best["uncached"] / best["cached"]}


def bench_t2i_cache(model: UnifiedModel, source: str, prompts: Sequence[str], batch_size: int,
                    base_codes: int, repeats: int = 1, device: torch.device | str = "cpu") -> dict[str, Any]:
    """OFA text-to-image with the decoder's KV cache vs the full recompute, side by side.

    * ``chain_model``: the chains' ``model`` (named by ``source``; an OFA model with an image
      tokenizer, by default the 4x4 ShapesWorld one) draws its whole code grid for ``batch_size``
      prompts with its own ``image_generation`` settings.
    * ``ofa_base``: ``configs/model/ofa_base.yaml``'s preset with random weights (nothing is
      loaded) at OFA's image-generation code grid (``code_image_size`` 256: 32x32 = 1,024 codes,
      8,192-code block, the published 59,457-token vocabulary), one prompt, sampling. Without a
      cache every step reruns the decoder on the whole prefix, so its cost grows with the square
      of the codes drawn; only the first ``base_codes`` codes are timed (``0`` skips it), plus the
      single decoder pass for the grid's last code (``last_code``) both ways.
    """
    import torch

    from unicon.models.base import ImageGenerationConfig
    from unicon.models.ofa.configuration_ofa import preset_config
    from unicon.models.ofa.modeling_ofa import OFAModel
    from unicon.models.ofa.tokenization import OFATokenizer
    from unicon.models.ofa.unified import OFAUnifiedModel, OFAWrapperConfig

    with torch.no_grad():
        result: dict[str, Any] = {}
        if isinstance(model, OFAUnifiedModel) and model.image_tokenizer is not None:
            h, w = model.image_tokenizer.grid_size
            texts = [model._t2i_text(p) for p in prompts[:batch_size]]
            cfg = dataclasses.replace(model.image_generation_config, seed=0)
            result["chain_model"] = {"source": source, "grid": [h, w], "codes_timed": h * w,
                                     "batch_size": len(texts), "generation": asdict(cfg),
                                     **_time_image_codes(model, texts, cfg, h * w,
                                                         model.image_tokenizer.codebook_size, repeats)}
        else:
            why = f"{type(model).__name__} is not an OFA model with an image tokenizer"
            result["chain_model"] = {"source": source, "skipped": why}
        if base_codes > 0:
            preset = compose(["model=ofa_base"]).model.preset
            config = preset_config(preset, code_image_size=256)  # OFA's image generation: 256 px / 8 = 32x32
            grid = config.code_image_size // 8
            num_codes = grid * grid
            if base_codes > num_codes:
                raise UserError(f"--t2i-base-codes {base_codes} exceeds the {grid}x{grid} grid's "
                                f"{num_codes} codes")
            torch.manual_seed(0)
            base = OFAUnifiedModel(OFAModel(config), OFATokenizer.byte_level(config.vocab_size, num_codes=8192),
                                   OFAWrapperConfig(max_source_length=128)).to(device).eval()
            cfg = ImageGenerationConfig(do_sample=True, seed=0)
            result["ofa_base"] = {"preset": preset, "random_weights": True, "grid": [grid, grid],
                                  "codes_timed": base_codes, "codes_per_image": num_codes, "batch_size": 1,
                                  "generation": asdict(cfg),
                                  **_time_image_codes(base, [base._t2i_text(prompts[0])], cfg, base_codes, 8192,
                                                      repeats)}
            result["ofa_base"]["last_code"] = _time_last_code(base, base._t2i_text(prompts[0]), num_codes, 8192,
                                                              repeats)
            if base_codes < num_codes:
                result["ofa_base"]["note"] = (
                    f"both paths timed on the first {base_codes} of {num_codes} codes (--t2i-base-codes): the "
                    "uncached decoder reruns the whole prefix at every code, so a full image would take it "
                    "tens of minutes on a CPU; the speed-up grows with the number of codes (last_code: the "
                    "decoder pass for the final code of a full image, timed both ways)")
            del base
        return result


def bench_cli(argv: Sequence[str] | None = None) -> int:
    """``unicon bench chains``: generation steps/s with batched chains vs one chain at a time, and
    OFA text-to-image with vs without the decoder's KV cache (:func:`bench_t2i_cache`)."""
    p = argparse.ArgumentParser(
        prog="unicon bench chains",
        description="Throughput of drift chains: batched across samples vs one chain at a time; OFA "
                    "text-to-image with vs without the decoder's KV cache.",
    )
    add_chain_args(p)
    p.add_argument("--ckpt", default=None, help="a trained checkpoint (default: --model with random weights)")
    p.add_argument("--model", default="ofa_shapes_tiny",
                   help="without --ckpt: a config name under configs/model/ built with random weights")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--t2i-base-codes", type=int, default=64,
                   help="image codes timed with and without the KV cache on a random-weight ofa_base "
                        "(32x32 = 1024 codes per image; 0 skips it; default: %(default)s)")
    p.set_defaults(generations=2, num_chains=8)
    args = p.parse_args(argv)
    import torch  # heavy: imported when the command runs, not for --help

    from unicon.evaluation.drift.runner import run_chains
    from unicon.models import build_model

    seeds = load_seeds(args.seeds or Path(args.world))[: args.num_chains]
    if args.ckpt:
        model = _load_model(args.ckpt)
    else:
        cfg = compose([f"model={args.model}", f"data.root={args.world}"])
        model = build_model(cfg.model, world_root=args.world)
    model.eval()
    device = next(model.parameters(), torch.empty(0)).device
    result = {"num_chains": len(seeds), "generations": args.generations, "chains": list(DRIFT_CHAINS),
              "device": str(device), "torch_threads": torch.get_num_threads()}
    with torch.no_grad(), tempfile.TemporaryDirectory() as tmp:
        for label, bs in (("batched", min(args.batch_size, len(seeds))), ("sequential", 1)):
            best = math.inf
            for r in range(args.repeats):
                d = Path(tmp) / f"{label}-{r}"
                run = run_chains(model, seeds, d, generations=args.generations, batch_size=bs,
                                 i2t_prompt=args.i2t_prompt)
                best = min(best, run.model_seconds)
                shutil.rmtree(d)
            steps = len(seeds) * args.generations * len(DRIFT_CHAINS)
            result[f"{label}_steps_per_s"] = steps / best
            result[f"{label}_seconds"] = best
            result[f"{label}_batch_size"] = bs
    result["speedup"] = result["batched_steps_per_s"] / result["sequential_steps_per_s"]
    prompts = [s.caption for s in seeds if s.caption] or ["a red circle"]
    source = args.ckpt or f"model={args.model} (random weights)"
    result["t2i_kv_cache"] = bench_t2i_cache(model, source, prompts, min(args.batch_size, len(prompts)),
                                             args.t2i_base_codes, args.repeats, device)
    print(jsonsafe.dumps(result))
    return 0
