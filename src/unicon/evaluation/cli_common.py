"""What every ``unicon evaluate <suite>`` command shares: the model, output, device, pickle and
logger arguments, and their checks, done before any model or data is loaded.

* ``--device cuda`` on a machine without CUDA, an ``--out`` that is a file or cannot be written,
  and a count below its minimum fail with one line naming the flag;
* the model loads with :func:`unicon.models.load_model`; unpickling only with ``--allow-pickle``;
* ``--logger`` defaults to the training default (``LoggerConfig.type``), for every suite;
* commands that draw images expose the sampling recipe (:func:`add_image_generation_args`): each
  flag overrides the model's own ``image_generation_config``, and the result is recorded.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path
from typing import Sequence

import torch

from unicon.config import LoggerConfig
from unicon.errors import UserError


def add_common_args(p: argparse.ArgumentParser, out_help: str = "output directory") -> None:
    p.add_argument("--ckpt", required=True, help="model: save_pretrained directory or Lightning .ckpt")
    p.add_argument("--out", required=True, help=out_help)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="torch device (default: cuda when available)")
    p.add_argument("--allow-pickle", action="store_true",
                   help="accept checkpoints that need unpickling (pytorch_model.bin; can run code: trusted files only)")
    p.add_argument("--logger", choices=["wandb", "csv", "none"], default=LoggerConfig.type,
                   help=f"where the metrics also go (default: {LoggerConfig.type}, offline without an API key)")


def add_image_generation_args(p: argparse.ArgumentParser) -> None:
    """``--sample/--greedy``, ``--temperature``, ``--top-k``, ``--top-p``, ``--guidance-scale``,
    ``--image-seed``; unset flags keep the model's saved setting (:func:`image_generation_config`)."""
    g = p.add_argument_group("image generation (default: the model's saved settings)")
    g.add_argument("--sample", dest="do_sample", action="store_true", default=None, help="sample image tokens")
    g.add_argument("--greedy", dest="do_sample", action="store_false", help="argmax image tokens")
    g.add_argument("--temperature", type=float, default=None, help="sampling temperature (> 0)")
    g.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens (0: all)")
    g.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass in (0, 1]")
    g.add_argument("--guidance-scale", type=float, default=None,
                   help="classifier-free guidance scale s: l_u + s (l_c - l_u) (1: off)")
    g.add_argument("--image-seed", type=int, default=None, help="seed of the image sampling")


def image_generation_config(model, args: argparse.Namespace):
    """The model's ``image_generation_config`` with the flags of :func:`add_image_generation_args`
    that were given; a value out of range is a one-line error naming the flag."""
    import dataclasses

    checks = {"temperature": (lambda v: v > 0, "> 0"), "top_k": (lambda v: v >= 0, ">= 0"),
              "top_p": (lambda v: 0 < v <= 1, "in (0, 1]")}
    for name, (ok, what) in checks.items():
        value = getattr(args, name)
        if value is not None and not ok(value):
            raise UserError(f"--{name.replace('_', '-')} must be {what}, got {value}")
    given = {k: getattr(args, k) for k in ("do_sample", "temperature", "top_k", "top_p", "guidance_scale")
             if getattr(args, k) is not None}
    if args.image_seed is not None:
        given["seed"] = args.image_seed
    return dataclasses.replace(model.image_generation_config, **given)


def check_common_args(args: argparse.Namespace, counts: Sequence[str] = (), minimum: dict | None = None) -> Path:
    """Validate the shared arguments and the count flags ``counts`` (>= 1, or ``minimum[name]``);
    create ``--out``. Returns the output directory."""
    minimum = minimum or {}
    for name in counts:
        value = getattr(args, name)
        low = minimum.get(name, 1)
        if value is not None and value < low:
            raise UserError(f"--{name.replace('_', '-')} must be >= {low}, got {value}")
    device = str(args.device)
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"--device {device}: CUDA is not available on this machine (torch.cuda.is_available() "
                        "is False); use --device cpu")
    return prepare_out(args.out)


def prepare_out(out: str | Path) -> Path:
    """Create the output directory and check that it can be written, before any work."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} exists and is not a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=".write-test-"):
            pass
    except OSError as e:
        raise UserError(f"--out {out}: cannot write there ({e.strerror})") from None
    if not os.access(out, os.W_OK):  # pragma: no cover - covered by the write test above on POSIX
        raise UserError(f"--out {out}: not writable")
    return out


def load_model_for(args: argparse.Namespace):
    """The model of ``--ckpt`` on ``--device``, in eval mode."""
    from unicon.models import load_model

    if not Path(args.ckpt).exists():
        raise UserError(f"--ckpt {args.ckpt} does not exist")
    return load_model(args.ckpt, allow_pickle=args.allow_pickle).to(args.device).eval()
